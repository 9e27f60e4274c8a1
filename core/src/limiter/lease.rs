//! Leased counters: a replica takes a block of a counter's capacity from the store in one call (an
//! item with `ItemStep::Take`) and admits that counter's requests from it, with no store call, until
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
//! - What a block holds past what its counter's recent rate draws in `AHEAD` is given back
//!   (`ItemStep::Return`, in its window only) at the next periodic pass, as is the whole block of a
//!   counter unused for `--lease-idle`, and every block at shutdown. A give-back that did not
//!   reach the store stays held and is sent again until its window ends.
//! - `--lease-max-counters` counters at most are held at once, past which a new counter is
//!   decided by the store as any other; counters unused for `--lease-idle` leave the table on
//!   the periodic pass, never on a request's path.
//!
//! Only the window algorithms can be leased: a bucket's tokens taken now and spent later would
//! let a burst pass that the bucket refused, and a sliding log cannot count hits it has not seen
//! at their instants.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    Algorithm, Check, CounterIds, CounterKey, Counting, Decision, IdHasher, Item, ItemStep, Limit,
    Mode, RuleId, Scope, Source, Usage,
};

/// A block takes at most this part of what remains in the store (`lua/check.lua` applies it).
pub(crate) const SHARE: u64 = 8;
/// A block holds what the replica admitted of its counter in this long, at its recent rate.
const AHEAD: Duration = Duration::from_millis(100);
/// The replica's rate on a counter is measured over periods of this length.
const PERIOD: Duration = Duration::from_millis(50);
/// A block is spent only until this long before its window ends, as this replica times it: a
/// block given back must reach the store within its window.
const MARGIN: Duration = Duration::from_millis(5);
/// Counters held at once by default (`--lease-max-counters`); past it, a new counter is decided
/// by the store.
pub const MOST_HELD: usize = 100_000;
/// A give-back that did not reach the store is sent again after this long, doubling with each
/// failure up to `RETRY_MOST`, until its window ends.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MOST: Duration = Duration::from_secs(5);

/// Whether a rule's counters are leased (`lease`, or `--lease` for rules that do not say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
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

    pub(crate) fn name(self) -> &'static str {
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

/// The blocks held, by counter: the keyed hash of its key and its limit, so that a changed limit
/// takes blocks of its own and the old limit's are given back once idle.
type Table = HashMap<u128, LeaseHeld, IdHasher>;

/// The hits the items of `check` before item `i` draw from its counter (`ids`): a counter named
/// twice needs both.
fn earlier_hits(check: &Check, ids: &[u128], i: usize) -> u64 {
    check.items[..i]
        .iter()
        .zip(ids)
        .filter(|(_, other)| **other == ids[i])
        .map(|(item, _)| item.hits)
        .sum()
}

/// Admits `check` (whose counters are `ids`) from the blocks `held`, which hold its hits.
fn admit(held: &mut Table, check: &Check, ids: &[u128], now: Instant) -> Decision {
    let usages = check
        .items
        .iter()
        .zip(ids)
        .map(|(item, id)| {
            let h = held.get_mut(id).expect("a counter with hits is held");
            h.admit(item.hits, now);
            Usage {
                over: false,
                remaining: h.store_left + h.left,
                left_before: h.store_left + h.left + item.hits,
                reset: h.until.duration_since(now) + MARGIN,
                full: false,
                source: Source::Lease,
                window: h.window,
                hold: None,
            }
        })
        .collect();
    Decision {
        admitted: true,
        usages,
    }
}

/// What this replica holds of one counter.
struct LeaseHeld {
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
    /// The counter was reset while a block was on its way: the block may have been counted
    /// before the reset, which erased it, so it is not spent.
    forgotten: bool,
    /// When the call that took the oldest hits `left` holds (or the block on its way) was sent:
    /// a reset after it erased them.
    since: Option<Instant>,
    /// The counter's key, rule and limit, to give the block back with, once it took one.
    counter: Option<(CounterKey, RuleId, Limit)>,
}

impl LeaseHeld {
    /// A counter seen at `now`, holding nothing yet.
    fn seen(item: &Item, now: Instant) -> LeaseHeld {
        LeaseHeld {
            left: 0,
            window: 0,
            until: now,
            store_left: 0,
            drawn: now,
            period: (item.hits, now, 0),
            taking: false,
            forgotten: false,
            since: None,
            counter: None,
        }
    }

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
        ahead(count.max(previous)).max(least)
    }

    /// What the rate measured until `now` draws in `AHEAD`: hits held past it are not drawn as
    /// fast as the block was sized for.
    fn kept(&self, now: Instant) -> u64 {
        let (count, began, previous) = self.period;
        let since = now.duration_since(began);
        let per_period = if since >= 2 * PERIOD {
            0
        } else if since >= PERIOD {
            count
        } else {
            count.max(previous)
        };
        ahead(per_period)
    }

    /// Gives back `hits` of its block: the item that does it, and until when it may land.
    fn back(&mut self, hits: u64, now: Instant) -> Option<Returning> {
        let (key, rule, limit) = self.counter.as_ref()?;
        self.left -= hits;
        Some(Returning {
            item: Item {
                key: key.clone(),
                rule: *rule,
                limit: limit.clone(),
                mode: Mode::Enforce,
                hits,
                refund: true,
                counting: Counting::Admitted,
                leased: true,
                // In the store, as every leased counter (a cluster's too: its key names it).
                scope: Scope::Global,
                step: ItemStep::Return {
                    window: self.window,
                },
            },
            until: self.until,
            failed: 0,
            due: now,
        })
    }
}

/// What `per_period` hits in each `PERIOD` come to in `AHEAD`.
fn ahead(per_period: u64) -> u64 {
    let periods = (AHEAD.as_millis() / PERIOD.as_millis()) as u64;
    per_period.saturating_mul(periods)
}

/// Which give-backs `Leases::give_back` makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The periodic pass: blocks unused, or drawn slower than they were sized for, and the
    /// failed give-backs due again.
    Periodic,
    /// Only the failed give-backs due again.
    Retry,
    /// Every block, and every failed give-back: the process ends.
    Exit,
}

/// Hits of one counter on their way back to the store.
#[derive(Clone)]
pub struct Returning {
    /// The `ItemStep::Return` item that gives them back.
    pub item: Item,
    /// The end of their window, less `MARGIN`: past it they lapsed with it, nothing to give back.
    until: Instant,
    /// Attempts that failed so far.
    failed: u32,
    /// When to send it again, after a failure.
    due: Instant,
}

/// What a check finds in the blocks held.
pub enum Draw {
    /// Every counter had the hits: the request is admitted from them.
    Admitted(Decision),
    /// These counters (by index into the check) are short: take blocks with this check (one
    /// `ItemStep::Take` item each, in the same order), then draw again.
    Take(Vec<usize>, Check),
    /// A block is on its way for a counter that is short: wait for it, then draw again.
    Wait,
    /// A counter not seen lately, or `MOST_HELD` counters held: decide by the store, as for a
    /// counter not leased.
    Store,
}

/// Totals, for the metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Blocks taken.
    pub blocks: u64,
    /// Hits admitted from blocks.
    pub admitted: u64,
    /// Hits given back: their give-back reached the store.
    pub returned: u64,
    /// Hits whose give-back failed in a way that may have reached the store or not: they stay
    /// counted there until their window ends.
    pub unreturned: u64,
}

/// The blocks this replica holds, shared by every event loop.
pub struct Leases {
    /// A block not drawn on for this long is given back.
    idle: Duration,
    /// Counters held at once, at most.
    most: usize,
    ids: CounterIds,
    held: Mutex<Table>,
    /// Give-backs that failed before reaching the store, waiting to be sent again.
    returning: Mutex<Vec<Returning>>,
    /// Wakes the requests waiting for a block.
    taken: tokio::sync::Notify,
    totals: Mutex<Totals>,
}

impl Leases {
    /// Leases whose blocks go back once unused for `idle`, of `most` counters at most.
    pub fn new(idle: Duration, most: usize) -> Self {
        Leases {
            idle,
            most,
            ids: CounterIds::new(),
            held: Mutex::default(),
            returning: Mutex::default(),
            taken: tokio::sync::Notify::new(),
            totals: Mutex::default(),
        }
    }
}

impl Leases {
    fn held(&self) -> std::sync::MutexGuard<'_, Table> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ids(&self, check: &Check) -> Vec<u128> {
        check
            .items
            .iter()
            .map(|i| self.ids.id(&i.key, u64::from(i.limit.requests_per_unit)))
            .collect()
    }

    fn totals_mut(&self) -> std::sync::MutexGuard<'_, Totals> {
        self.totals.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn totals(&self) -> Totals {
        *self.totals_mut()
    }

    fn returning(&self) -> std::sync::MutexGuard<'_, Vec<Returning>> {
        self.returning.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hits held now, over every counter, those of give-backs waiting to be sent again included.
    pub fn left(&self, now: Instant) -> u64 {
        let held: u64 = self
            .held()
            .values()
            .filter(|h| h.live(now))
            .map(|h| h.left)
            .sum();
        let returning: u64 = self
            .returning()
            .iter()
            .filter(|r| r.until > now)
            .map(|r| r.item.hits)
            .sum();
        held + returning
    }

    /// Whether `check` is decided from leases: every counter's rule leases it, with an algorithm
    /// that can be leased, enforced, counted when admitted, with hits to charge at the store's
    /// clock.
    pub fn applies(check: &Check) -> bool {
        check.at.is_none()
            && check
                .items
                .iter()
                .all(|i| Leases::hold(i) && i.step == ItemStep::Hits && !i.refund && i.hits > 0)
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
        let ids = self.ids(check);
        let mut held = self.held();
        // Per item, the hits still needed past those held.
        let mut short = Vec::new();
        for (i, (item, id)) in check.items.iter().zip(&ids).enumerate() {
            let before = earlier_hits(check, &ids, i);
            let left = held
                .get(id)
                .filter(|h| h.live(now))
                .map_or(0, |h| h.left.saturating_sub(before));
            if left < item.hits {
                short.push((i, item.hits - left));
            }
        }
        if short.is_empty() {
            let decision = admit(&mut held, check, &ids, now);
            drop(held);
            self.count_admitted(check);
            return Draw::Admitted(decision);
        }
        if short
            .iter()
            .any(|&(i, _)| held.get(&ids[i]).is_some_and(|h| h.taking))
        {
            return Draw::Wait;
        }
        // A counter not seen lately is decided by the store, its request counted towards the
        // rate its first block will hold: a counter asked about once in a while never holds one.
        let unseen: Vec<usize> = short
            .iter()
            .map(|&(i, _)| i)
            .filter(|&i| !held.contains_key(&ids[i]))
            .collect();
        // A full table is made room in by the periodic pass only, never here.
        if !unseen.is_empty() {
            if held.len() + unseen.len() <= self.most {
                for i in unseen {
                    let item = &check.items[i];
                    held.insert(ids[i], LeaseHeld::seen(item, now));
                }
            }
            return Draw::Store;
        }
        let mut take = Check::default();
        let mut at = Vec::with_capacity(short.len());
        for (i, least) in short {
            let item = &check.items[i];
            let h = held.get_mut(&ids[i]).expect("every short counter is held");
            h.taking = true;
            if h.left == 0 {
                h.since = Some(now);
            }
            let mut block = item.clone();
            block.hits = h.block(least);
            block.step = ItemStep::Take { least };
            take.items.push(block);
            at.push(i);
        }
        Draw::Take(at, take)
    }

    fn count_admitted(&self, check: &Check) {
        let hits: u64 = check.items.iter().map(|i| i.hits).sum();
        self.totals_mut().admitted += hits;
    }

    /// Records the blocks `take` (from `Draw::Take` on `check`'s items `at`) got: `decided`,
    /// or nothing when the store did not decide, for a call sent at `sent`; and admits `check`
    /// from what is held then, if it can.
    pub fn took(
        &self,
        check: &Check,
        at: &[usize],
        decided: Option<&Decision>,
        sent: Instant,
    ) -> Option<Decision> {
        let ids = self.ids(check);
        let mut held = self.held();
        let mut blocks = 0;
        for (n, &i) in at.iter().enumerate() {
            let Some(h) = held.get_mut(&ids[i]) else {
                continue;
            };
            h.taking = false;
            if std::mem::take(&mut h.forgotten) {
                h.since = None;
                continue;
            }
            let Some(decision) = decided.filter(|d| d.admitted) else {
                if h.left == 0 {
                    h.since = None;
                }
                continue;
            };
            let usage = &decision.usages[n];
            let block = usage.left_before.saturating_sub(usage.remaining);
            if h.window != usage.window || !h.live(sent) {
                h.left = 0;
                h.since = Some(sent);
            }
            h.left += block;
            h.window = usage.window;
            h.until = (sent + usage.reset).checked_sub(MARGIN).unwrap_or(sent);
            h.store_left = usage.remaining;
            let item = &check.items[i];
            h.counter
                .get_or_insert_with(|| (item.key.clone(), item.rule, item.limit.clone()));
            blocks += 1;
        }
        let now = Instant::now();
        let covered = decided.is_some_and(|d| d.admitted)
            && check
                .items
                .iter()
                .zip(&ids)
                .enumerate()
                .all(|(i, (item, id))| {
                    held.get(id)
                        .filter(|h| h.live(now))
                        .is_some_and(|h| h.left >= earlier_hits(check, &ids, i) + item.hits)
                });
        let admitted = covered.then(|| admit(&mut held, check, &ids, now));
        drop(held);
        self.totals_mut().blocks += blocks;
        if admitted.is_some() {
            self.count_admitted(check);
        }
        self.taken.notify_waiters();
        admitted
    }

    /// Drops what the blocks of the counter whose key's bytes are `key`, under a limit of
    /// `requests_per_unit`, hold, giving nothing back: the counter was reset in the store
    /// (`/counters`), which no longer counts them; and a block on its way is dropped when it
    /// comes (counted before the reset, it was erased; after it, it stays counted unspent,
    /// which never admits more than the limit). Its next request takes a block anew.
    pub fn forget(&self, key: &[u8], requests_per_unit: u32) {
        let id = self
            .ids
            .salted_id_of_bytes(key, u64::from(requests_per_unit));
        if let Some(h) = self.held().get_mut(&id) {
            h.left = 0;
            h.forgotten = h.taking;
        }
        let mut returning = self.returning();
        returning.retain(|r| {
            r.item.key.as_bytes() != key || r.item.limit.requests_per_unit != requests_per_unit
        });
    }

    /// The counters whose blocks hold hits (or have one on its way), with when the call that
    /// took the oldest of those hits was sent: a reset of the counter after it erased them.
    pub fn held_since(&self) -> Vec<(CounterKey, u32, Instant)> {
        self.held()
            .values()
            .filter(|h| h.left > 0 || h.taking)
            .filter_map(|h| {
                let (key, _, limit) = h.counter.as_ref()?;
                Some((key.clone(), limit.requests_per_unit, h.since?))
            })
            .collect()
    }

    /// The next block taken (`took`): made before a `draw` that may answer `Draw::Wait`, so
    /// that a block taken in between is not missed.
    pub fn next_taken(&self) -> tokio::sync::futures::Notified<'_> {
        self.taken.notified()
    }

    /// How long a block may go unused before it is given back.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// What goes back to the store at `now`, in `pass`. The periodic pass forgets the counters
    /// unused since `now - idle` and those whose window is over, and gives back the whole of the
    /// blocks forgotten and what every other block holds past what its recent rate draws in
    /// `AHEAD`; with it (and alone, on `Pass::Retry`) go the failed give-backs due to be sent
    /// again. At exit, everything goes back.
    pub fn give_back(&self, now: Instant, pass: Pass) -> Vec<Returning> {
        let mut back = Vec::new();
        let all = pass == Pass::Exit;
        if pass != Pass::Retry {
            self.held().retain(|_, h| {
                if h.taking {
                    return true;
                }
                let idle = all || now.duration_since(h.drawn) >= self.idle;
                let live = h.live(now);
                let give = if idle || !live {
                    h.left
                } else {
                    h.left.saturating_sub(h.kept(now))
                };
                if live && give > 0 {
                    back.extend(h.back(give, now));
                }
                !idle
            });
        }
        self.returning().retain(|r| {
            if r.until <= now {
                return false;
            }
            if all || r.due <= now {
                back.push(r.clone());
                return false;
            }
            true
        });
        back
    }

    /// When the next give-back that failed is due to be sent again.
    pub fn next_due(&self) -> Option<Instant> {
        self.returning().iter().map(|r| r.due).min()
    }

    /// Counts the hits of give-backs that reached the store.
    pub fn returned(&self, back: &[Returning]) {
        let hits: u64 = back.iter().map(|r| r.item.hits).sum();
        self.totals_mut().returned += hits;
    }

    /// Give-backs that failed at `now`: sent again later when the store surely did not apply
    /// them (`again`), else counted as unreturned (they may have landed: sent twice, they would
    /// free hits the replicas admitted).
    pub fn failed(&self, back: Vec<Returning>, again: bool, now: Instant) {
        if !again {
            let hits: u64 = back.iter().map(|r| r.item.hits).sum();
            self.totals_mut().unreturned += hits;
            return;
        }
        let mut returning = self.returning();
        for mut r in back {
            let wait = RETRY_FIRST.saturating_mul(1 << r.failed.min(16));
            r.failed += 1;
            r.due = now + wait.min(RETRY_MOST);
            returning.push(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{DescriptorKey, RuleId, Unit};

    /// How long a block may go undrawn before it is given back, in these tests.
    const IDLE: Duration = Duration::from_millis(500);

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
                calendar: None,
            },
            mode: Mode::Enforce,
            hits,
            refund: false,
            counting: Counting::Admitted,
            leased: true,
            scope: Default::default(),
            step: ItemStep::Hits,
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
                hold: None,
            }],
        }
    }

    /// Takes a block of `taken` for `check` at `now` (a counter not seen yet is first decided
    /// by the store), which admits `check` from it.
    fn take(leases: &Leases, check: &Check, now: Instant, taken: u64) -> Check {
        let draw = match leases.draw(check, now) {
            Draw::Store => leases.draw(check, now),
            draw => draw,
        };
        let Draw::Take(at, take) = draw else {
            panic!("a block to take");
        };
        let admitted = leases.took(check, &at, Some(&answer(taken, 1000)), now);
        assert!(
            admitted.is_some(),
            "the request that took the block is admitted from it"
        );
        take
    }

    #[test]
    fn requests_are_admitted_from_a_block_until_it_is_spent() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        let one = check(item(2000, 1));
        assert!(
            matches!(leases.draw(&one, now), Draw::Store),
            "a counter not seen lately is decided by the store"
        );
        let take = take(&leases, &one, now, 3);
        assert_eq!(take.items[0].step, ItemStep::Take { least: 1 });
        for _ in 0..2 {
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
    fn a_reset_counter_drops_its_blocks_and_the_one_on_its_way() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        let one = check(item(2000, 1));
        take(&leases, &one, now, 40);
        let key = one.items[0].key.as_bytes().to_vec();
        leases.forget(&key, 2000);
        let Draw::Take(at, _) = leases.draw(&one, now) else {
            panic!("nothing held after the reset: a block to take");
        };
        // Reset again while that block is on its way: it may have been counted before.
        leases.forget(&key, 2000);
        assert!(
            leases
                .took(&one, &at, Some(&answer(40, 1000)), now)
                .is_none(),
            "a block taken before the reset is not spent"
        );
        assert!(matches!(leases.draw(&one, now), Draw::Take(..)));
        assert_eq!(leases.left(now), 0);
    }

    #[test]
    fn a_block_grows_with_the_rate_and_is_not_spent_past_its_window() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        let one = check(item(2000, 1));
        take(&leases, &one, now, 40);
        for _ in 0..39 {
            assert!(matches!(leases.draw(&one, now), Draw::Admitted(_)));
        }
        let next = take(&leases, &one, now, 80);
        assert_eq!(
            next.items[0].hits, 82,
            "41 hits in a period (the first, decided by the store, counted): 82 in 100 ms"
        );
        let later = now + Duration::from_secs(31);
        assert!(
            matches!(leases.draw(&one, later), Draw::Take(..)),
            "the window is over: its block lapsed"
        );
    }

    /// The hits `back` gives back, in all.
    fn hits(back: &[Returning]) -> u64 {
        back.iter().map(|r| r.item.hits).sum()
    }

    #[test]
    fn an_idle_block_goes_back_to_its_window_and_a_changed_limit_takes_its_own() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        let old = check(item(2000, 1));
        take(&leases, &old, now, 10);
        assert!(matches!(leases.draw(&old, now), Draw::Admitted(_)));
        let changed = check(item(3000, 1));
        assert!(
            matches!(leases.draw(&changed, now), Draw::Store),
            "a new limit is a counter of its own, not seen yet"
        );
        let early = leases.give_back(now, Pass::Periodic);
        assert_eq!(
            hits(&early),
            2,
            "3 hits in a period draw 6 in 100 ms: 2 of the 8 left are more than that"
        );
        let back = leases.give_back(now + IDLE, Pass::Periodic);
        assert_eq!(
            back.len(),
            1,
            "the old limit's block; the new one holds nothing"
        );
        assert_eq!(back[0].item.hits, 6);
        assert!(back[0].item.refund);
        assert_eq!(back[0].item.step, ItemStep::Return { window: 7 });
        assert!(leases.give_back(now + IDLE, Pass::Exit).is_empty());
    }

    #[test]
    fn a_block_drawn_slower_than_it_was_sized_for_gives_back_the_excess() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        let one = check(item(2000, 1));
        take(&leases, &one, now, 100);
        for _ in 0..40 {
            assert!(matches!(leases.draw(&one, now), Draw::Admitted(_)));
        }
        assert!(
            leases.give_back(now, Pass::Periodic).is_empty(),
            "42 hits in a period draw 84 in 100 ms, more than the 59 left"
        );
        // One request every 300 ms from then on: a period of 1 hit, none before it.
        let mut at = now;
        for _ in 0..3 {
            at += Duration::from_millis(300);
            assert!(matches!(leases.draw(&one, at), Draw::Admitted(_)));
        }
        let back = leases.give_back(at, Pass::Periodic);
        assert_eq!(
            hits(&back),
            56 - 2,
            "all but what 1 hit a period draws in 100 ms"
        );
        assert_eq!(leases.left(at), 2);
    }

    #[test]
    fn a_full_table_sends_new_counters_to_the_store_until_the_periodic_pass_makes_room() {
        let leases = Leases::new(IDLE, 2);
        let now = Instant::now();
        let value = |v: &str| {
            let mut i = item(2000, 1);
            i.key = DescriptorKey::new(b"d", &[(b"k", v.as_bytes())]).counter("l");
            check(i)
        };
        for v in ["a", "b"] {
            assert!(matches!(leases.draw(&value(v), now), Draw::Store));
        }
        for _ in 0..2 {
            assert!(
                matches!(leases.draw(&value("c"), now), Draw::Store),
                "the table is full: not held"
            );
        }
        assert!(leases.give_back(now + IDLE, Pass::Periodic).is_empty());
        let later = now + IDLE;
        assert!(matches!(leases.draw(&value("c"), later), Draw::Store));
        assert!(
            matches!(leases.draw(&value("c"), later), Draw::Take(..)),
            "the idle counters left the table: the new one is held"
        );
    }

    #[test]
    fn a_new_counter_at_a_full_table_costs_no_walk_of_it() {
        const MOST: usize = 200_000;
        let leases = Leases::new(IDLE, MOST);
        let now = Instant::now();
        let value = |v: usize| {
            let mut i = item(2000, 1);
            i.key = DescriptorKey::new(b"d", &[(b"k", v.to_string().as_bytes())]).counter("l");
            check(i)
        };
        let filling = std::time::Instant::now();
        for v in 0..MOST {
            leases.draw(&value(v), now);
        }
        let filled = filling.elapsed();
        let asking = std::time::Instant::now();
        for v in MOST..MOST + 1000 {
            assert!(matches!(leases.draw(&value(v), now), Draw::Store));
        }
        let asked = asking.elapsed();
        // 1,000 draws cost 1/200 of the 200,000 that filled it; a walk of the table on each
        // would cost 1,000 times more than that.
        assert!(
            asked < filled / 10,
            "1,000 new counters at a full table took {asked:?}; filling it took {filled:?}"
        );
    }

    #[test]
    fn a_give_back_that_did_not_reach_the_store_stays_held_and_goes_again_until_its_window_ends() {
        let leases = Leases::new(IDLE, MOST_HELD);
        let now = Instant::now();
        take(&leases, &check(item(2000, 1)), now, 10);
        let back = leases.give_back(now + IDLE, Pass::Periodic);
        assert_eq!(hits(&back), 9);
        leases.failed(back, true, now + IDLE);
        assert_eq!(leases.left(now + IDLE), 9, "still held");
        assert_eq!(leases.next_due(), Some(now + IDLE + RETRY_FIRST));
        assert!(leases.give_back(now + IDLE, Pass::Retry).is_empty());
        let again = leases.give_back(now + IDLE + RETRY_FIRST, Pass::Retry);
        assert_eq!(hits(&again), 9);
        leases.failed(again, true, now + IDLE + RETRY_FIRST);
        assert_eq!(leases.next_due(), Some(now + IDLE + 3 * RETRY_FIRST));
        let over = now + Duration::from_secs(30);
        assert!(
            leases.give_back(over, Pass::Retry).is_empty(),
            "its window is over: nothing to give back"
        );
        assert_eq!(leases.left(over), 0);
        take(&leases, &check(item(2000, 1)), over, 10);
        let exit = leases.give_back(over, Pass::Exit);
        leases.failed(exit, false, over);
        assert_eq!(leases.totals().unreturned, 9);
    }
}
