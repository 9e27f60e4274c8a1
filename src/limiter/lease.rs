//! Leased counters: a replica takes a block of a counter's capacity from the store in one call (an
//! item with `Step::Take`) and admits that counter's requests from it, with no store call, until
//! it is spent; then it takes the next. The store counts every block when it is taken, so what it
//! holds is what every replica admitted plus the blocks they hold: together the replicas never
//! admit more than the limit.
//!
//! - A block is what the replica's own rate admits in `AHEAD`, at least the hits the request
//!   needs, and never more than `1/SHARE` of what remains in the store (the script applies that
//!   cap, atomically): near the limit a block is the request's own hits, and the edge of the limit
//!   is decided as a store call decides it.
//! - A block counts in the window it was taken in, and is spent only until that window ends on
//!   the store's clock; what is left then was counted there and lapses with it.
//! - One block at a time is taken per counter: a request that finds its counter short while a
//!   block is on its way waits for it.
//! - A block unused for `IDLE` is given back (`Step::Return`, in its window only), as is every
//!   block at shutdown; `MOST_HELD` counters at most are held at once, past which a counter is
//!   decided by the store as any other.
//!
//! Only the window algorithms can be leased: a bucket's tokens taken now and spent later would
//! let a burst pass that the bucket refused, and a sliding log cannot count hits it has not seen
//! at their instants.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    Algorithm, Check, CounterKey, Counting, Decision, Item, Limit, Mode, Source, Step, Usage,
};

/// A block takes at most this part of what remains in the store (`lua/check.lua` applies it).
pub const SHARE: u64 = 8;
/// A block holds what the replica admitted of its counter in this long, at its recent rate.
const AHEAD: Duration = Duration::from_millis(100);
/// The replica's rate on a counter is measured over periods of this length.
const PERIOD: Duration = Duration::from_millis(50);
/// A block not drawn on for this long is given back.
pub const IDLE: Duration = Duration::from_millis(500);
/// A block is spent only until this long before its window ends, as this replica times it: a
/// block given back must reach the store within its window.
const MARGIN: Duration = Duration::from_millis(5);
/// Counters held at once; past it, a new counter is decided by the store.
pub const MOST_HELD: usize = 100_000;

/// Whether a rule's counters are leased (`lease`, or `--lease` for rules that do not say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Leasing {
    /// Decided from leased blocks where the algorithm allows it.
    Auto,
    /// Every request asks the store.
    #[default]
    Off,
}

impl Leasing {
    pub fn parse(name: &str) -> Option<Leasing> {
        match name {
            "auto" => Some(Leasing::Auto),
            "off" => Some(Leasing::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Leasing::Auto => "auto",
            Leasing::Off => "off",
        }
    }
}

/// Whether a limit of `algorithm` can be leased.
pub fn leasable(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow)
}

/// A counter as leases know it: its key and its limit, so that a changed limit takes blocks of
/// its own and the old limit's are given back once idle.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Id {
    key: CounterKey,
    limit: Limit,
}

/// What this replica holds of one counter.
struct Held {
    /// Hits left to admit.
    left: u64,
    /// The window the block counts in.
    window: u64,
    /// Until when it may be spent: its window's end, timed from when the call that took it was
    /// sent (no later than the store read its clock), less `MARGIN`.
    until: Instant,
    /// What the store had left once the block was taken.
    store_left: u64,
    /// When a request last drew on it.
    drawn: Instant,
    /// Hits admitted in the current period, when it began, and hits admitted in the period
    /// before.
    period: (u64, Instant, u64),
    /// A block is on its way.
    taking: bool,
    /// The item to give the block back with.
    item: Item,
}

impl Held {
    fn live(&self, now: Instant) -> bool {
        self.until > now
    }

    /// Counts `hits` admitted at `now`.
    fn admit(&mut self, hits: u64, now: Instant) {
        self.left -= hits;
        self.drawn = now;
        let (count, began, _) = &mut self.period;
        if now.duration_since(*began) >= PERIOD {
            let previous = if now.duration_since(*began) < 2 * PERIOD {
                *count
            } else {
                0
            };
            self.period = (0, now, previous);
        }
        self.period.0 += hits;
    }

    /// The block to ask for: what the recent rate admits in `AHEAD`, at least `least`.
    fn block(&self, least: u64) -> u64 {
        let (count, _, previous) = self.period;
        let per_period = count.max(previous);
        let ahead = (AHEAD.as_millis() / PERIOD.as_millis()) as u64;
        per_period.saturating_mul(ahead).max(least)
    }
}

/// What a check finds in the blocks held.
pub enum Draw {
    /// Every counter had the hits: the request is admitted from them.
    Admitted(Decision),
    /// These counters (by index into the check) are short: take blocks with this check (one
    /// `Step::Take` item each, in the same order), then draw again.
    Take(Vec<usize>, Check),
    /// A block is on its way for a counter that is short: wait for it, then draw again.
    Wait,
    /// `MOST_HELD` counters are held: decide by the store, as for a counter not leased.
    Store,
}

/// Totals, for the metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Blocks taken.
    pub blocks: u64,
    /// Hits admitted from blocks.
    pub admitted: u64,
    /// Hits given back.
    pub returned: u64,
}

/// The blocks this replica holds, shared by every event loop.
pub struct Leases {
    held: Mutex<HashMap<Id, Held>>,
    /// Wakes the requests waiting for a block.
    taken: tokio::sync::Notify,
    totals: Mutex<Totals>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            held: Mutex::default(),
            taken: tokio::sync::Notify::new(),
            totals: Mutex::default(),
        }
    }
}

impl Leases {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<Id, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn totals_mut(&self) -> std::sync::MutexGuard<'_, Totals> {
        self.totals.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn totals(&self) -> Totals {
        *self.totals_mut()
    }

    /// Hits held now, over every counter.
    pub fn left(&self, now: Instant) -> u64 {
        self.held()
            .values()
            .filter(|h| h.live(now))
            .map(|h| h.left)
            .sum()
    }

    /// Whether `check` is decided from leases: every counter's rule leases it, with an algorithm
    /// that can be leased, enforced, counted when admitted, with hits to charge at the store's
    /// clock.
    pub fn applies(check: &Check) -> bool {
        check.at.is_none()
            && check
                .items
                .iter()
                .all(|i| Leases::hold(i) && i.step == Step::Hits && !i.refund && i.hits > 0)
    }

    /// Whether `item`'s counter is decided from leased blocks when its request charges hits:
    /// its rule leases it, with an algorithm that can be leased, enforced and counted when
    /// admitted.
    pub fn hold(item: &Item) -> bool {
        item.leased
            && leasable(item.limit.algorithm)
            && item.mode == Mode::Enforce
            && item.counting == Counting::Admitted
    }

    /// Draws `check`'s hits from the blocks held, at `now`.
    pub fn draw(&self, check: &Check, now: Instant) -> Draw {
        let mut held = self.held();
        let ids: Vec<Id> = check
            .items
            .iter()
            .map(|i| Id {
                key: i.key.clone(),
                limit: i.limit.clone(),
            })
            .collect();
        // Per item, the hits still needed past those held (a counter named twice needs both).
        let mut short = Vec::new();
        let mut drawn: HashMap<&Id, u64> = HashMap::new();
        for (i, (item, id)) in check.items.iter().zip(&ids).enumerate() {
            let so_far = drawn.entry(id).or_default();
            let left = held
                .get(id)
                .filter(|h| h.live(now))
                .map_or(0, |h| h.left.saturating_sub(*so_far));
            if left < item.hits {
                short.push((i, item.hits - left));
            }
            *so_far += item.hits;
        }
        if short.is_empty() {
            let mut usages = Vec::with_capacity(check.items.len());
            for (item, id) in check.items.iter().zip(&ids) {
                let h = held.get_mut(id).expect("a counter with hits is held");
                h.admit(item.hits, now);
                usages.push(Usage {
                    over: false,
                    remaining: h.store_left + h.left,
                    left_before: h.store_left + h.left + item.hits,
                    reset: h.until.duration_since(now) + MARGIN,
                    full: false,
                    source: Source::Lease,
                    window: h.window,
                });
            }
            drop(held);
            let hits: u64 = check.items.iter().map(|i| i.hits).sum();
            self.totals_mut().admitted += hits;
            return Draw::Admitted(Decision {
                admitted: true,
                usages,
            });
        }
        if short
            .iter()
            .any(|&(i, _)| held.get(&ids[i]).is_some_and(|h| h.taking))
        {
            return Draw::Wait;
        }
        if short.iter().any(|&(i, _)| !held.contains_key(&ids[i]))
            && held.len() + short.len() > MOST_HELD
        {
            held.retain(|_, h| h.live(now) || h.taking);
            if held.len() + short.len() > MOST_HELD {
                return Draw::Store;
            }
        }
        let mut take = Check::default();
        let mut at = Vec::with_capacity(short.len());
        for (i, least) in short {
            let item = &check.items[i];
            let h = held.entry(ids[i].clone()).or_insert_with(|| Held {
                left: 0,
                window: 0,
                until: now,
                store_left: 0,
                drawn: now,
                period: (0, now, 0),
                taking: false,
                item: item.clone(),
            });
            h.taking = true;
            let mut block = item.clone();
            block.hits = h.block(least);
            block.step = Step::Take { least };
            take.items.push(block);
            at.push(i);
        }
        Draw::Take(at, take)
    }

    /// Records the blocks `take` (from `Draw::Take` on `check`'s items `at`) got: `decided`,
    /// or nothing when the store did not decide, for a call sent at `sent`.
    pub fn took(&self, check: &Check, at: &[usize], decided: Option<&Decision>, sent: Instant) {
        let mut held = self.held();
        let mut blocks = 0;
        for (n, &i) in at.iter().enumerate() {
            let item = &check.items[i];
            let id = Id {
                key: item.key.clone(),
                limit: item.limit.clone(),
            };
            let Some(h) = held.get_mut(&id) else {
                continue;
            };
            h.taking = false;
            let Some(decision) = decided.filter(|d| d.admitted) else {
                continue;
            };
            let usage = &decision.usages[n];
            let block = usage.left_before.saturating_sub(usage.remaining);
            let until = (sent + usage.reset).checked_sub(MARGIN).unwrap_or(sent);
            if h.window != usage.window || !h.live(sent) {
                h.left = 0;
            }
            h.left += block;
            h.window = usage.window;
            h.until = until;
            h.store_left = usage.remaining;
            h.item = item.clone();
            blocks += 1;
        }
        drop(held);
        self.totals_mut().blocks += blocks;
        self.taken.notify_waiters();
    }

    /// The next block taken (`took`): made before a `draw` that may answer `Draw::Wait`, so
    /// that a block taken in between is not missed.
    pub fn next_taken(&self) -> tokio::sync::futures::Notified<'_> {
        self.taken.notified()
    }

    /// Forgets the blocks of counters unused since `now - IDLE` (every block, with `all`) and
    /// those whose window is over, and returns a check that gives back what the live ones hold.
    pub fn give_back(&self, now: Instant, all: bool) -> Check {
        let mut back = Check::default();
        self.held().retain(|_, h| {
            if h.taking {
                return true;
            }
            if !h.live(now) {
                return false;
            }
            if !all && now.duration_since(h.drawn) < IDLE {
                return true;
            }
            if h.left > 0 {
                let mut item = h.item.clone();
                item.hits = h.left;
                item.refund = true;
                item.step = Step::Return { window: h.window };
                back.items.push(item);
            }
            false
        });
        back
    }

    /// Counts hits given back.
    pub fn returned(&self, hits: u64) {
        self.totals_mut().returned += hits;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{DescriptorKey, RuleId, Unit};

    fn item(limit: u32, hits: u64) -> Item {
        Item {
            key: DescriptorKey::new(b"d", &[(b"k", b"v")]).counter("l"),
            rule: RuleId::default(),
            limit: Limit {
                name: String::new(),
                requests_per_unit: limit,
                unit: Unit::Minute,
                unit_multiplier: 1,
                algorithm: Algorithm::FixedWindow,
                burst: limit,
            },
            mode: Mode::Enforce,
            hits,
            refund: false,
            counting: Counting::Admitted,
            leased: true,
            step: Step::Hits,
        }
    }

    fn check(item: Item) -> Check {
        Check {
            items: vec![item],
            ..Check::default()
        }
    }

    /// The store's answer to a block of `taken` with `left` remaining after it, in window 7.
    fn answer(taken: u64, left: u64) -> Decision {
        Decision {
            admitted: true,
            usages: vec![Usage {
                over: false,
                remaining: left,
                left_before: left + taken,
                reset: Duration::from_secs(30),
                full: false,
                source: Source::Store,
                window: 7,
            }],
        }
    }

    /// Takes a block of `taken` for `check` at `now`.
    fn take(leases: &Leases, check: &Check, now: Instant, taken: u64) -> Check {
        let Draw::Take(at, take) = leases.draw(check, now) else {
            panic!("a block to take");
        };
        leases.took(check, &at, Some(&answer(taken, 1000)), now);
        take
    }

    #[test]
    fn requests_are_admitted_from_a_block_until_it_is_spent() {
        let leases = Leases::default();
        let now = Instant::now();
        let one = check(item(2000, 1));
        let take = take(&leases, &one, now, 3);
        assert_eq!(take.items[0].step, Step::Take { least: 1 });
        for _ in 0..3 {
            let Draw::Admitted(d) = leases.draw(&one, now) else {
                panic!("admitted from the block");
            };
            assert_eq!(d.usages[0].source, Source::Lease);
        }
        assert!(matches!(leases.draw(&one, now), Draw::Take(..)));
        assert!(
            matches!(leases.draw(&one, now), Draw::Wait),
            "one block on its way per counter"
        );
        assert_eq!(leases.totals().admitted, 3);
    }

    #[test]
    fn a_block_grows_with_the_rate_and_is_not_spent_past_its_window() {
        let leases = Leases::default();
        let now = Instant::now();
        let one = check(item(2000, 1));
        take(&leases, &one, now, 40);
        for _ in 0..40 {
            assert!(matches!(leases.draw(&one, now), Draw::Admitted(_)));
        }
        let next = take(&leases, &one, now, 80);
        assert_eq!(next.items[0].hits, 80, "40 hits in a period: 80 in 100 ms");
        let later = now + Duration::from_secs(31);
        assert!(
            matches!(leases.draw(&one, later), Draw::Take(..)),
            "the window is over: its block lapsed"
        );
    }

    #[test]
    fn an_idle_block_goes_back_to_its_window_and_a_changed_limit_takes_its_own() {
        let leases = Leases::default();
        let now = Instant::now();
        let old = check(item(2000, 1));
        take(&leases, &old, now, 10);
        assert!(matches!(leases.draw(&old, now), Draw::Admitted(_)));
        let changed = check(item(3000, 1));
        assert!(
            matches!(leases.draw(&changed, now), Draw::Take(..)),
            "a new limit holds nothing"
        );
        assert!(
            leases.give_back(now, false).items.is_empty(),
            "not idle yet"
        );
        let back = leases.give_back(now + IDLE, false);
        assert_eq!(
            back.items.len(),
            1,
            "the old limit's block; the new one is on its way"
        );
        assert_eq!(back.items[0].hits, 9);
        assert!(back.items[0].refund);
        assert_eq!(back.items[0].step, Step::Return { window: 7 });
        assert!(leases.give_back(now + IDLE, true).items.is_empty());
    }
}
