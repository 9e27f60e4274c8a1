//! The embedded store: counters in sharded in-process maps, decided by the algorithm modules of
//! `limiter::algorithm`, which the Redis script mirrors. A check locks the shards it touches in
//! index order, so concurrent checks are exact and never deadlock. Counters are indexed by a
//! 128-bit SipHash of their `CounterKey` (and, for a fixed window, the index of the window:
//! each window is a counter of its own), keyed at random per process, so that a collision
//! between two of a billion counters has a probability under 10⁻²⁰ that no input can raise.
//! Expired counters are ignored when read and dropped by `sweep`, which the store runs every
//! second; a full shard refuses new counters at once until then, so that no request ever pays
//! for a sweep.
//!
//! Shares. Each counter is held for its rule (`Item::rule`), and a rule may hold at most its
//! share of every shard (`--max-keys-per-rule`), so that one rule keyed on values a client
//! chooses cannot take the whole store. A counter a scheduled request writes for a window that
//! has not started (it lives more than a window from now) is held apart, among at most
//! `SCHEDULED_SHARE` of every shard, a rule again holding at most its share of those: counters
//! for far instants, which no sweep can reclaim before then, never crowd out the present ones.
//! A new counter past its share is refused, and its item answered over its limit; a shard full
//! for every rule together refuses with `StoreError::Full`.
//!
//! Holds. A held counter's table of holds (`limiter::hold`) lives in the shard of the counter's
//! key (whatever its window), and lives two of its holds' time to live after its last change:
//! every entry is due a time to live before. Each table keeps at most its rule's `most`
//! entries, and the store at most as many holds, and as many marks, of every table together
//! as it holds counters (`--max-keys`): a new hold past the holds is refused (`full`), and
//! marks past theirs are forgotten, the table's oldest first, so that one user's marks never
//! refuse another user's hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::StoreError;
use super::demand::{DemandBoard, Division, Settle};
use crate::limiter::algorithm::{Ask, Verdict, gcra, log, window};
use crate::limiter::hold::{self, Table};
use crate::limiter::outcome::{HoldSeen, Outcome};
use crate::limiter::{
    Algorithm, Check, CounterIds, CounterKey, Counting, Decision, IdHasher, Item, ItemStep, Limit,
    RuleId, admits,
};
use crate::log_throttle::LogThrottle;
use crate::observe::{Observer, unobserved};

const SHARDS: usize = 64;

/// The share of the store that counters for windows not started yet (written by scheduled
/// requests) may hold together: the other three quarters stay for the present.
const SCHEDULED_SHARE: Percent = Percent(25);

/// When a request refused a new counter is told to try again: the next sweep may make room.
const REFUSED_RETRY_MS: u64 = 1_000;

/// A share of the store, in percent (1 to 100).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Percent(pub u8);

impl Percent {
    /// This share of `n`, rounded up: at least 1 of anything.
    fn of(self, n: usize) -> usize {
        (n * usize::from(self.0)).div_ceil(100).max(1)
    }
}

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    room: Room,
    max_keys: usize,
    /// Holds and marks of every hold table together, each at most about `max_keys`.
    hold_entries: Entries,
    ids: CounterIds,
    /// Quota buckets' demands, at most `max_keys` buckets.
    demand: DemandBoard,
    /// Told of the counters it refuses.
    observer: Arc<dyn Observer>,
}

/// How many counters one shard holds: in all, for one rule, and for windows not started yet.
#[derive(Clone, Copy, Debug)]
struct Room {
    shard: usize,
    /// A rule's present counters.
    rule: usize,
    scheduled: usize,
    /// A rule's scheduled counters.
    rule_scheduled: usize,
}

/// Until when a held counter's table lives after a change at `now_ms`: two times to live, and
/// not before the window in which its newest hold may expire ends (a sliding window's, a window
/// later), so that a hold that expires unsettled is found and charged while its window counts,
/// however long its user stays away.
fn table_until(limit: &Limit, now_ms: u64, ttl_ms: u64) -> u64 {
    let due = now_ms + ttl_ms;
    let window = limit.window_ms();
    let end = match limit.calendar_span(due) {
        Some(span) => span.end,
        None if limit.algorithm == Algorithm::SlidingWindow => (due / window + 2) * window,
        None => (due / window + 1) * window,
    };
    end.max(now_ms + 2 * ttl_ms)
}

/// The holds and the marks of every hold table together.
#[derive(Default)]
struct Entries {
    holds: AtomicUsize,
    marks: AtomicUsize,
}

impl Entries {
    /// The holds and marks of `table`.
    fn of(table: &Table) -> (usize, usize) {
        (table.holds(), table.len() - table.holds())
    }

    /// Counts a table that went from `before` to `after` (holds, marks).
    fn moved(&self, before: (usize, usize), after: (usize, usize)) {
        for (count, (b, a)) in [
            (&self.holds, (before.0, after.0)),
            (&self.marks, (before.1, after.1)),
        ] {
            if a >= b {
                count.fetch_add(a - b, Ordering::Relaxed);
            } else {
                count.fetch_sub(b - a, Ordering::Relaxed);
            }
        }
    }

    /// Counts `table` gone.
    fn gone(&self, table: &Table) {
        self.moved(Entries::of(table), (0, 0));
    }
}

/// A counter's identity in this store: the keyed 128-bit hash of its `CounterKey`.
type Id = u128;

/// Whose share a counter takes: its rule's present counters, or its rule's scheduled ones (the
/// rule's hash with its lowest bit set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Holder(u64);

impl Holder {
    fn new(rule: RuleId, scheduled: bool) -> Holder {
        Holder(rule.bits() & !1 | u64::from(scheduled))
    }

    fn scheduled(self) -> bool {
        self.0 & 1 == 1
    }

    fn as_scheduled(self) -> Holder {
        Holder(self.0 | 1)
    }
}

/// Which share refused a new counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Share {
    /// Its rule's (`--max-keys-per-rule`).
    Rule,
    /// That of every rule's scheduled counters together (`SCHEDULED_SHARE`).
    Scheduled,
}

impl Share {
    fn name(self) -> &'static str {
        match self {
            Share::Rule => "rule",
            Share::Scheduled => "scheduled",
        }
    }
}

#[derive(Default)]
struct Shard {
    counters: HashMap<Id, Counter, IdHasher>,
    /// Held counters' tables, by the id of the counter's key.
    holds: HashMap<Id, Holds, IdHasher>,
    /// Counters held per holder, expired ones not swept yet included; no holder with none.
    held: HashMap<Holder, usize, IdHasher>,
    /// Scheduled counters held.
    scheduled: usize,
}

/// What a counter holds, by algorithm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stored {
    /// A fixed window (one counter per window) or a sliding window.
    Window(window::State),
    Bucket(gcra::State),
    /// The instants of a sliding log's entries, ascending.
    Log(Vec<u64>),
}

/// A held counter's table, and when it expires (ms since the Unix epoch).
#[derive(Default)]
struct Holds {
    table: Table,
    expires_ms: u64,
}

#[derive(Clone)]
struct Counter {
    stored: Stored,
    expires_ms: u64,
    holder: Holder,
}

impl Counter {
    /// `stored`, written for `item` and expiring at `expires_ms`, held among the present
    /// counters of the item's rule.
    fn of(item: &Item, stored: Stored, expires_ms: u64) -> Counter {
        Counter {
            stored,
            expires_ms,
            holder: Holder::new(item.rule, false),
        }
    }

    fn live(&self, now_ms: u64) -> bool {
        self.expires_ms > now_ms
    }
}

impl Shard {
    /// Stores `counter` as `id`, moving it to its new holder.
    fn put(&mut self, id: Id, counter: Counter) {
        let holder = counter.holder;
        match self.counters.insert(id, counter) {
            Some(old) if old.holder == holder => {}
            Some(old) => {
                self.release(old.holder);
                self.hold(holder);
            }
            None => self.hold(holder),
        }
    }

    fn remove(&mut self, id: Id) {
        if let Some(old) = self.counters.remove(&id) {
            self.release(old.holder);
        }
    }

    fn hold(&mut self, holder: Holder) {
        *self.held.entry(holder).or_default() += 1;
        self.scheduled += usize::from(holder.scheduled());
    }

    fn release(&mut self, holder: Holder) {
        release(&mut self.held, &mut self.scheduled, holder);
    }

    fn held(&self, holder: Holder) -> usize {
        self.held.get(&holder).copied().unwrap_or(0)
    }

    /// Drops what expired by `now_ms`: the hold entries dropped, counted off `hold_entries`.
    fn sweep(&mut self, now_ms: u64, hold_entries: &Entries) {
        self.holds.retain(|_, h| {
            let live = h.expires_ms > now_ms;
            if !live {
                hold_entries.gone(&h.table);
            }
            live
        });
        let Shard {
            counters,
            held,
            scheduled,
            ..
        } = self;
        counters.retain(|_, c| {
            let live = c.live(now_ms);
            if !live {
                release(held, scheduled, c.holder);
            }
            live
        });
    }
}

/// Counts one counter of `holder` less.
fn release(held: &mut HashMap<Holder, usize, IdHasher>, scheduled: &mut usize, holder: Holder) {
    if let std::collections::hash_map::Entry::Occupied(mut n) = held.entry(holder) {
        *n.get_mut() -= 1;
        if *n.get() == 0 {
            n.remove();
        }
    }
    *scheduled -= usize::from(holder.scheduled());
}

/// A write decided on, not landed yet.
struct Pending {
    id: Id,
    write: Option<Counter>,
    /// Counted `always`: it lands whether the request is admitted or not.
    always: bool,
    /// It creates a counter the shard does not hold.
    new: bool,
    /// The share it takes in its shard (a new counter, or one moving to the scheduled share),
    /// with the index of the shard among those locked.
    takes: Option<(usize, Holder)>,
}

/// A request being decided: where its counters live (each item's counter, its holds' table if
/// held, and their shards), the shards locked in order, and what its items found so far: their
/// verdicts, the writes decided on, the shares refused, and the holds to take once the request is
/// admitted (in their tables, with when each is due and until when its table lives).
struct Deciding<'a> {
    ids: Vec<Id>,
    tables: Vec<Option<Id>>,
    homes: Vec<usize>,
    order: Vec<usize>,
    guards: Vec<(usize, MutexGuard<'a, Shard>)>,
    verdicts: Vec<Verdict>,
    pending: Vec<Pending>,
    refusals: Vec<Share>,
    holds: Vec<(Id, hold::HoldAsk, u64, u64)>,
}

impl Deciding<'_> {
    /// Where `shard` is among the shards locked.
    fn slot(&self, shard: usize) -> usize {
        self.order
            .binary_search(&shard)
            .expect("every home shard is locked")
    }
}

impl MemoryStore {
    /// A store that holds at most `max_keys` live counters, a rule at most `per_rule` of them,
    /// telling no one of the counters it refuses (see `observed_by`).
    pub fn new(max_keys: usize, per_rule: Percent) -> Self {
        let shard = max_keys.div_ceil(SHARDS).max(1);
        let scheduled = SCHEDULED_SHARE.of(shard);
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            room: Room {
                shard,
                rule: per_rule.of(shard),
                scheduled,
                rule_scheduled: per_rule.of(scheduled),
            },
            max_keys,
            hold_entries: Entries::default(),
            ids: CounterIds::new(),
            demand: DemandBoard::new(max_keys),
            observer: unobserved(),
        }
    }

    /// The store, telling `observer` of the counters it refuses.
    pub(crate) fn observed_by(self, observer: Arc<dyn Observer>) -> Self {
        MemoryStore { observer, ..self }
    }

    /// The id of the counter of `key` under `limit` at `at_ms`: a fixed window's counter is
    /// that of the window holding `at_ms`.
    fn id(&self, key: &CounterKey, limit: &Limit, at_ms: u64) -> Id {
        let salt = match limit.algorithm {
            Algorithm::FixedWindow => limit.window_at(at_ms) + 1,
            _ => 0,
        };
        self.ids.id(key, salt)
    }

    fn shard_of(id: Id) -> usize {
        ((id >> 64) as u64 % SHARDS as u64) as usize
    }

    pub fn apply(&self, check: &Check) -> Result<Decision, StoreError> {
        self.apply_at(check, super::unix_ms())
    }

    /// Decides `check` with the clock at `now_ms` (ms since the Unix epoch).
    pub fn apply_at(&self, check: &Check, now_ms: u64) -> Result<Decision, StoreError> {
        let (admitted, verdicts) = self.decide_at(check, now_ms)?;
        Ok(Decision::of(check, admitted, &verdicts))
    }

    /// Decides `check` with the clock at `now_ms`: admitted, and what each counter found, as the
    /// check script answers them.
    pub fn decide_at(
        &self,
        check: &Check,
        now_ms: u64,
    ) -> Result<(bool, Vec<Verdict>), StoreError> {
        let at_ms = check.at.map_or(now_ms, |at| at.max(now_ms));
        let mut d = self.lock(check, now_ms, at_ms);
        // Items are evaluated in order, each seeing what the items before it would write, so a
        // request naming one counter twice is counted twice.
        for (i, item) in check.items.iter().enumerate() {
            let verdict = self.decide_item(&mut d, i, item, now_ms, at_ms);
            d.verdicts.push(verdict);
        }
        let admitted = admits(check, |i| d.verdicts[i].over);
        self.land(&mut d, admitted)?;
        let Deciding {
            guards,
            verdicts,
            refusals,
            ..
        } = d;
        drop(guards);
        for share in refusals {
            refused(share, &*self.observer);
        }
        Ok((admitted, verdicts))
    }

    /// Places `check`'s counters (and its holds' tables) in their shards and locks those, in
    /// order.
    fn lock(&self, check: &Check, now_ms: u64, at_ms: u64) -> Deciding<'_> {
        // A held counter counts at the clock, and keeps its table under its key's id.
        let ids: Vec<Id> = check
            .items
            .iter()
            .map(|i| match i.step {
                ItemStep::Held(_) => self.id(&i.key, &i.limit, now_ms),
                _ => self.id(&i.key, &i.limit, at_ms),
            })
            .collect();
        let tables: Vec<Option<Id>> = check
            .items
            .iter()
            .map(|i| matches!(i.step, ItemStep::Held(_)).then(|| self.ids.id(&i.key, 0)))
            .collect();
        let homes: Vec<usize> = ids.iter().map(|&id| Self::shard_of(id)).collect();
        let mut order = homes.clone();
        order.extend(tables.iter().flatten().map(|&t| Self::shard_of(t)));
        order.sort_unstable();
        order.dedup();
        let guards = order
            .iter()
            .map(|&s| (s, self.shards[s].lock().unwrap_or_else(|e| e.into_inner())))
            .collect();
        Deciding {
            ids,
            tables,
            homes,
            order,
            guards,
            verdicts: Vec::with_capacity(check.items.len()),
            pending: Vec::new(),
            refusals: Vec::new(),
            holds: Vec::new(),
        }
    }

    /// Decides item `i` of a request (`item`) on what its counter holds and what the items
    /// before it would write; stages its write, if any, unless its shard has no room for it.
    fn decide_item(
        &self,
        d: &mut Deciding<'_>,
        i: usize,
        item: &Item,
        now_ms: u64,
        at_ms: u64,
    ) -> Verdict {
        let (id, home) = (d.ids[i], d.slot(d.homes[i]));
        let earlier = d.pending.iter().rev().find(|p| p.id == id);
        let (stored, holder) = match earlier {
            Some(p) => (
                p.write.as_ref().map(|c| &c.stored),
                p.write.as_ref().map(|c| c.holder),
            ),
            None => match d.guards[home].1.counters.get(&id) {
                Some(c) => (c.live(now_ms).then_some(&c.stored), Some(c.holder)),
                None => (None, None),
            },
        };
        // Held already: in the shard (live or not), or by an earlier write of the request.
        let held = earlier.is_some() || holder.is_some();
        let ask = Ask {
            limit: u64::from(item.limit.requests_per_unit),
            window_ms: item.limit.window_ms(),
            calendar: item.limit.calendar_span(at_ms),
            now_ms,
            at_ms,
            hits: item.hits,
            refund: item.refund,
            always: item.counting == Counting::Always,
            step: item.step,
        };
        let (verdict, write) = match (item.step, d.tables[i]) {
            (ItemStep::Held(h), Some(table)) => {
                let state = match stored {
                    Some(Stored::Window(s)) => Some(*s),
                    _ => None,
                };
                self.decide_held(d, table, h, item, &ask, state)
            }
            _ => evaluate(item, &ask, stored),
        };
        let Some(mut write) = write else {
            return verdict;
        };
        let mut takes = None;
        if let Some(counter) = &mut write {
            // Scheduled: a scheduled request made it live past a window from now.
            let scheduled = at_ms > now_ms && counter.expires_ms > now_ms + ask.window_ms;
            counter.holder = match holder {
                Some(h) if h.scheduled() || !scheduled => h,
                Some(h) => h.as_scheduled(),
                None => Holder::new(item.rule, scheduled),
            };
            if holder != Some(counter.holder) {
                takes = Some((home, counter.holder));
            }
        }
        if let Some((home, holder)) = takes {
            let taken = d.pending.iter().filter_map(|p| p.takes);
            if let Err(share) = self.fits(&d.guards[home].1, holder, home, taken) {
                // A refund has nothing to give back to a counter it cannot hold.
                if item.refund {
                    return verdict;
                }
                d.refusals.push(share);
                return REFUSED;
            }
        }
        d.pending.push(Pending {
            id,
            new: !held && write.is_some(),
            write,
            // What a held counter is charged lands whatever the answer.
            always: ask.always || matches!(item.step, ItemStep::Held(_)),
            takes,
        });
        verdict
    }

    /// Decides a held item (`item`, `held`, `ask`) on its counter's `state` in its holds'
    /// `table`, noting the hold it takes once the request is admitted.
    fn decide_held(
        &self,
        d: &mut Deciding<'_>,
        table: Id,
        held: hold::HoldAsk,
        item: &Item,
        ask: &Ask,
        state: Option<window::State>,
    ) -> (Verdict, Option<Option<Counter>>) {
        let slot = d.slot(Self::shard_of(table));
        let step = self.hold(&mut d.guards[slot].1, table, item, ask, &held, state);
        if let Some(due) = step.take {
            let until = table_until(&item.limit, ask.now_ms, held.ttl_ms);
            d.holds.push((table, held, due, until));
        }
        let write = step.charged.map(|c| {
            Some(Counter::of(
                item,
                Stored::Window(c.next),
                ask.now_ms + c.ttl_ms,
            ))
        });
        (step.verdict, write)
    }

    /// Lands what a request decided (`admitted` or not): the writes counted `always`, and all
    /// of them and its holds once admitted.
    fn land(&self, d: &mut Deciding<'_>, admitted: bool) -> Result<(), StoreError> {
        // Counted `always`, a counter's write lands whether the request is admitted or not.
        let landing: Vec<Pending> = std::mem::take(&mut d.pending)
            .into_iter()
            .filter(|p| admitted || p.always)
            .collect();
        self.make_room(&landing, &d.guards, &|shard| d.slot(shard))?;
        for (table, held, due, until) in std::mem::take(&mut d.holds) {
            let slot = d.slot(Self::shard_of(table));
            let shard = &mut d.guards[slot].1;
            if admitted {
                let holds = shard.holds.entry(table).or_default();
                hold::take(&mut holds.table, &held, due);
                holds.expires_ms = until;
                self.hold_entries.holds.fetch_add(1, Ordering::Relaxed);
            } else if shard.holds.get(&table).is_some_and(|h| h.table.is_empty()) {
                shard.holds.remove(&table);
            }
        }
        for p in landing {
            let slot = d.slot(Self::shard_of(p.id));
            let shard = &mut d.guards[slot].1;
            match p.write {
                Some(counter) => shard.put(p.id, counter),
                None => shard.remove(p.id),
            }
        }
        Ok(())
    }

    /// Evaluates the held item `item` (`ask`, `held`) on its counter's `state` and tidies its
    /// table `table` in `shard`, whatever the answer. A new hold past the holds the store keeps
    /// is over (`full`); marks past those it keeps are forgotten, the table's oldest first: a
    /// mark only makes a reused id refused and a late settle charged less, so one user's marks
    /// never refuse another user's hold.
    fn hold(
        &self,
        shard: &mut Shard,
        table: Id,
        item: &Item,
        ask: &Ask,
        held: &hold::HoldAsk,
        state: Option<window::State>,
    ) -> hold::HoldStep {
        let holds = shard.holds.entry(table).or_default();
        if holds.expires_ms <= ask.now_ms {
            self.hold_entries.gone(&holds.table);
            holds.table = Table::default();
        }
        let before = Entries::of(&holds.table);
        let mut step = hold::evaluate(item.limit.algorithm, ask, held, state, &mut holds.table);
        if step.take.is_some() && self.hold_entries.holds.load(Ordering::Relaxed) >= self.max_keys {
            step.take = None;
            step.verdict.over = true;
            step.verdict.hold = step.verdict.hold.map(|seen| HoldSeen {
                outcome: Outcome::Full,
                ..seen
            });
        }
        let marks = |t: &Table| t.len() - t.holds();
        while self.hold_entries.marks.load(Ordering::Relaxed) + marks(&holds.table)
            > self.max_keys + before.1
            && holds.table.forget_a_mark()
        {}
        self.hold_entries.moved(before, Entries::of(&holds.table));
        if !holds.table.is_empty() {
            holds.expires_ms = table_until(&item.limit, ask.now_ms, held.ttl_ms);
        }
        // No table is kept empty: a hold refused leaves none behind.
        if step.take.is_none() && holds.table.is_empty() {
            shard.holds.remove(&table);
        }
        step
    }

    /// Whether `shard` (locked as `home`) has room for one more counter of `holder` besides
    /// those the request's earlier writes already `taken`: `Err` names the share that is full.
    /// A share as large as the shard never refuses: a full shard is `make_room`'s answer.
    fn fits(
        &self,
        shard: &Shard,
        holder: Holder,
        home: usize,
        taken: impl Iterator<Item = (usize, Holder)>,
    ) -> Result<(), Share> {
        let room = &self.room;
        let (mut mine, mut scheduled) = (shard.held(holder), shard.scheduled);
        for (_, t) in taken.filter(|(h, _)| *h == home) {
            mine += usize::from(t == holder);
            scheduled += usize::from(t.scheduled());
        }
        if holder.scheduled() && room.scheduled < room.shard && scheduled >= room.scheduled {
            return Err(Share::Scheduled);
        }
        let own = if holder.scheduled() {
            room.rule_scheduled
        } else {
            room.rule
        };
        if own < room.shard && mine >= own {
            return Err(Share::Rule);
        }
        Ok(())
    }

    /// Fails, before anything is written, when a shard cannot take the new counters. Constant
    /// time: it never sweeps (the expired counters of a full shard go at the next `sweep`).
    fn make_room(
        &self,
        writes: &[Pending],
        guards: &[(usize, MutexGuard<'_, Shard>)],
        slot: &impl Fn(usize) -> usize,
    ) -> Result<(), StoreError> {
        let mut new_per_slot = vec![0usize; guards.len()];
        for p in writes.iter().filter(|p| p.new) {
            new_per_slot[slot(Self::shard_of(p.id))] += 1;
        }
        let full = guards
            .iter()
            .zip(&new_per_slot)
            .any(|((_, shard), &new)| new > 0 && shard.counters.len() + new > self.room.shard);
        if full {
            return Err(StoreError::Full {
                max_keys: self.max_keys,
            });
        }
        Ok(())
    }

    /// What the counter of `key` under `limit` holds at `now_ms` (a fixed window: the window
    /// holding `at_ms`), if it is live, and when it expires (ms since the Unix epoch).
    pub fn stored(
        &self,
        key: &CounterKey,
        limit: &Limit,
        at_ms: u64,
        now_ms: u64,
    ) -> Option<(Stored, u64)> {
        let id = self.id(key, limit, at_ms);
        let shard = self.shards[Self::shard_of(id)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        shard
            .counters
            .get(&id)
            .filter(|c| c.live(now_ms))
            .map(|c| (c.stored.clone(), c.expires_ms))
    }

    /// Deletes the counters of `items`, a fixed window's in the window holding `at_ms` (see
    /// `Store::reset`).
    /// A held counter's holds go with it: their settles find none and are charged in full.
    pub(crate) fn reset(&self, items: &[Item], at_ms: u64) {
        for item in items {
            let id = self.id(&item.key, &item.limit, at_ms);
            self.shards[Self::shard_of(id)]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(id);
            let table = self.ids.id(&item.key, 0);
            let gone = self.shards[Self::shard_of(table)]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .holds
                .remove(&table);
            if let Some(gone) = gone {
                self.hold_entries.gone(&gone.table);
            }
        }
    }

    /// What the holds of the counter of `key` hold now, and how many there are.
    pub(crate) fn held(&self, key: &CounterKey) -> (u64, usize) {
        let table = self.ids.id(key, 0);
        self.shards[Self::shard_of(table)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .holds
            .get(&table)
            .map_or((0, 0), |h| (h.table.held(), h.table.holds()))
    }

    /// Counters held, expired ones not swept yet included.
    pub(crate) fn counters(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).counters.len())
            .sum()
    }

    /// Settles a quota bucket for this replica's streams of it (see `demand`).
    pub(crate) fn settle(
        &self,
        bucket: &CounterKey,
        call: &Settle,
    ) -> Result<Division, StoreError> {
        self.demand.settle(bucket, call, super::unix_ms())
    }

    /// Drops expired counters, one shard at a time, and quota streams gone quiet.
    pub(crate) fn sweep(&self) {
        let now_ms = super::unix_ms();
        self.sweep_at(now_ms);
        self.demand.sweep(now_ms);
    }

    fn sweep_at(&self, now_ms: u64) {
        for shard in self.shards.iter() {
            shard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .sweep(now_ms, &self.hold_entries);
        }
    }
}

/// The verdict on an item whose new counter its share refused: over, with nothing left, until
/// the next sweep may have made room.
const REFUSED: Verdict = Verdict {
    over: true,
    remaining_after: 0,
    remaining_before: 0,
    reset_after_ms: REFUSED_RETRY_MS,
    reset_before_ms: REFUSED_RETRY_MS,
    charged: 0,
    window: 0,
    hold: None,
};

/// Counts a new counter that `share` refused, and logs the refusals at most once a second.
fn refused(share: Share, observer: &dyn Observer) {
    static RULE: LogThrottle = LogThrottle::new();
    static SCHEDULED: LogThrottle = LogThrottle::new();
    observer.memory_refused(share.name());
    let (throttle, whose) = match share {
        Share::Rule => (&RULE, "their rule's (--max-keys-per-rule)"),
        Share::Scheduled => (&SCHEDULED, "that of counters for windows not started yet"),
    };
    if let Some(n) = throttle.hit() {
        tracing::warn!(
            "{n} new counter(s) refused since the last report, their requests answered over the limit: {whose} share of the embedded store is full"
        );
    }
}

/// Evaluates `item` against what its counter holds, by the module of its algorithm: the verdict
/// and, if admitting the request changes the counter, what it then holds (`None`: nothing),
/// held among the present counters of the item's rule.
fn evaluate(item: &Item, ask: &Ask, stored: Option<&Stored>) -> (Verdict, Option<Option<Counter>>) {
    let now_ms = ask.now_ms;
    let counter = |stored: Stored, ttl_ms: u64| Counter::of(item, stored, now_ms + ttl_ms);
    match item.limit.algorithm {
        algorithm @ (Algorithm::FixedWindow | Algorithm::SlidingWindow) => {
            let state = match stored {
                Some(Stored::Window(s)) => Some(*s),
                _ => None,
            };
            let step = window::evaluate(algorithm, ask, state);
            let write = step
                .writes
                .then(|| Some(counter(Stored::Window(step.next), step.ttl_ms)));
            (step.verdict, write)
        }
        Algorithm::SlidingLog => {
            let entries = match stored {
                Some(Stored::Log(e)) => e.as_slice(),
                _ => &[],
            };
            let (verdict, change) = log::evaluate(ask, entries);
            let write = (change != log::Change::Keep).then(|| {
                let mut after = entries.to_vec();
                log::apply(&mut after, change, now_ms, ask.window_ms);
                log::ttl_ms(&after, now_ms, ask.window_ms)
                    .map(|ttl_ms| counter(Stored::Log(after), ttl_ms))
            });
            (verdict, write)
        }
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            let state = match stored {
                Some(Stored::Bucket(s)) => Some(*s),
                _ => None,
            };
            let (verdict, write) = gcra::evaluate(ask, u64::from(item.limit.burst), state);
            let write = match write {
                gcra::Write::Keep => None,
                gcra::Write::Set { state, ttl_ms } => {
                    Some(Some(counter(Stored::Bucket(state), ttl_ms)))
                }
                gcra::Write::Delete => Some(None),
            };
            (verdict, write)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{DescriptorKey, Mode, Unit};

    /// A store of `max_keys` counters, which one rule may fill.
    fn store(max_keys: usize) -> MemoryStore {
        MemoryStore::new(max_keys, Percent(100))
    }

    /// A store of `max_keys` counters, a rule holding at most half.
    fn halved(max_keys: usize) -> MemoryStore {
        MemoryStore::new(max_keys, Percent(50))
    }

    fn item(value: &str, limit: u32, hits: u64) -> Item {
        Item {
            key: DescriptorKey::new(b"d", &[(b"k", value.as_bytes())])
                .counter("fixed_window:minute:1"),
            rule: RuleId::of(b"d", b"k"),
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
            leased: false,
            scope: Default::default(),
            step: crate::limiter::ItemStep::Hits,
        }
    }

    fn check(items: Vec<Item>) -> Check {
        Check {
            items,
            ..Check::default()
        }
    }

    // The start of a minute.
    const NOW: u64 = 1_700_000_040_000;

    #[test]
    fn a_denied_check_moves_no_counter() {
        let store = store(100);
        let both = check(vec![item("a", 10, 1), item("b", 1, 1)]);
        assert!(store.apply_at(&both, NOW).unwrap().admitted);
        let denied = store.apply_at(&both, NOW).unwrap();
        assert!(!denied.admitted);
        assert!(!denied.usages[0].over);
        assert_eq!(denied.usages[0].remaining, 9, "a's hit was not consumed");
        let a = store.apply_at(&check(vec![item("a", 10, 1)]), NOW).unwrap();
        assert_eq!(a.usages[0].remaining, 8);
    }

    #[test]
    fn a_denied_check_moves_only_the_counters_counted_always() {
        let store = store(100);
        let mut charged = item("a", 10, 1);
        charged.counting = Counting::Always;
        let full = item("b", 0, 1);
        let denied = store.apply_at(&check(vec![charged, full]), NOW).unwrap();
        assert!(!denied.admitted);
        let a = store.apply_at(&check(vec![item("a", 10, 1)]), NOW).unwrap();
        assert_eq!(a.usages[0].remaining, 8, "a's charge landed");
    }

    #[test]
    fn one_counter_named_twice_is_counted_twice() {
        let store = store(100);
        let twice = check(vec![item("a", 1, 1), item("a", 1, 1)]);
        assert!(!store.apply_at(&twice, NOW).unwrap().admitted);
        let twice = check(vec![item("a", 2, 1), item("a", 2, 1)]);
        let d = store.apply_at(&twice, NOW).unwrap();
        assert!(d.admitted);
        assert_eq!(d.usages[1].remaining, 0);
    }

    #[test]
    fn counters_expire_with_their_window() {
        let store = store(100);
        store.apply_at(&check(vec![item("a", 10, 1)]), NOW).unwrap();
        assert_eq!(store.counters(), 1);
        store.sweep_at(NOW + 59_999);
        assert_eq!(store.counters(), 1, "live until the window ends");
        store.sweep_at(NOW + 120_000);
        assert_eq!(store.counters(), 0, "the expired counter was swept");
    }

    #[test]
    fn a_full_shard_takes_new_counters_again_once_swept() {
        let store = store(1);
        let minute = |v: u32| check(vec![item(&v.to_string(), 10, 1)]);
        for v in 0..200 {
            let _ = store.apply_at(&minute(v), NOW);
        }
        // A minute later every counter has expired, but a shard holding one is still full.
        let later = NOW + 60_000;
        let refused = (0..200)
            .find(|&v| store.apply_at(&minute(v), later).is_err())
            .expect("expired counters are only dropped by the sweep");
        store.sweep_at(later);
        assert!(store.apply_at(&minute(refused), later).is_ok());
    }

    #[test]
    fn a_full_store_refuses_new_counters_but_serves_existing_ones() {
        let store = store(1);
        store.apply_at(&check(vec![item("a", 10, 1)]), NOW).unwrap();
        let mut refused = 0;
        for v in 0..200 {
            if store
                .apply_at(&check(vec![item(&v.to_string(), 10, 1)]), NOW)
                .is_err()
            {
                refused += 1;
            }
        }
        assert!(refused > 0);
        assert!(store.counters() <= SHARDS);
        assert!(store.apply_at(&check(vec![item("a", 10, 1)]), NOW).is_ok());
    }

    /// An item of the rule `rule`, counting `value` in a minute's window of `algorithm`.
    fn of_rule(rule: &str, value: &str, algorithm: Algorithm) -> Item {
        let mut item = item(value, 10, 1);
        item.key = DescriptorKey::new(b"d", &[(rule.as_bytes(), value.as_bytes())])
            .counter(algorithm.name());
        item.rule = RuleId::of(b"d", rule.as_bytes());
        item.limit.algorithm = algorithm;
        item
    }

    /// `item` alone, counted at `at` (ms since the Unix epoch).
    fn at(item: Item, at: u64) -> Check {
        Check {
            items: vec![item],
            at: Some(at),
            ..Check::default()
        }
    }

    /// Asks one new value of `rule` after another; how many were counted before the first was
    /// refused by its share (answered over, retry in a second).
    fn fill(store: &MemoryStore, rule: &str, checks: impl Fn(Item) -> Check) -> usize {
        for n in 0..100_000 {
            let item = of_rule(rule, &n.to_string(), Algorithm::FixedWindow);
            let d = store
                .apply_at(&checks(item), NOW)
                .expect("a share refuses, not the store");
            if !d.admitted {
                assert!(d.usages[0].over);
                assert_eq!(d.usages[0].reset, std::time::Duration::from_secs(1));
                return n;
            }
        }
        panic!("{rule} was never refused");
    }

    #[test]
    fn a_rule_holds_at_most_its_share_of_a_shard_and_its_new_counters_past_it_are_over() {
        // One shard's worth: 64 shards of 10, a rule holding 5 of each.
        let store = halved(640);
        let counted = fill(&store, "user", |i| check(vec![i]));
        assert!(counted <= 5 * SHARDS, "{counted}");
        let other = of_rule("path", "p", Algorithm::FixedWindow);
        assert!(store.apply_at(&check(vec![other]), NOW).unwrap().admitted);
        let known = of_rule("user", "0", Algorithm::FixedWindow);
        let d = store.apply_at(&check(vec![known]), NOW).unwrap();
        assert_eq!(d.usages[0].remaining, 8, "an existing counter still counts");
    }

    #[test]
    fn a_share_as_large_as_the_store_leaves_the_answer_to_a_full_shard() {
        let store = MemoryStore::new(640, Percent(100));
        let full = (0..100_000).find_map(|n| {
            let item = of_rule("user", &n.to_string(), Algorithm::FixedWindow);
            store.apply_at(&check(vec![item]), NOW).err()
        });
        assert_eq!(full, Some(StoreError::Full { max_keys: 640 }));
    }

    #[test]
    fn counters_of_windows_not_started_hold_a_share_apart_from_the_present() {
        // 64 shards of 100: scheduled counters hold at most 25 of each, a rule 13 of those.
        let store = halved(6_400);
        let tomorrow = NOW + 86_400_000;
        let scheduled = fill(&store, "user", |i| at(i, tomorrow));
        assert!(scheduled <= 13 * SHARDS, "{scheduled}");
        let held: usize = store
            .shards
            .iter()
            .map(|s| s.lock().unwrap().scheduled)
            .sum();
        assert_eq!(held, scheduled);
        // Filled until the first shard refuses: that shard holds the rule's whole present
        // share, 50, beside the scheduled counters it holds too.
        let present = fill(&store, "user", |i| check(vec![i]));
        let user = Holder::new(RuleId::of(b"d", b"user"), false);
        let fullest = store
            .shards
            .iter()
            .map(|s| s.lock().unwrap().held(user))
            .max();
        assert_eq!(
            fullest,
            Some(50),
            "the rule's present share is whole ({present} counted)"
        );
        // Another rule schedules beside it, until the scheduled share itself is full.
        let other = fill(&store, "path", |i| at(i, tomorrow));
        assert!(other <= 13 * SHARDS, "{other}");
    }

    #[test]
    fn an_instant_in_the_current_window_writes_a_present_counter() {
        let store = halved(6_400);
        let item = of_rule("user", "a", Algorithm::FixedWindow);
        store.apply_at(&at(item, NOW + 30_000), NOW).unwrap();
        assert_eq!(
            store
                .shards
                .iter()
                .map(|s| s.lock().unwrap().scheduled)
                .sum::<usize>(),
            0
        );
    }

    #[test]
    fn a_log_given_an_entry_ahead_moves_to_the_scheduled_share_and_leaves_with_it() {
        let store = halved(6_400);
        let log = || of_rule("log", "a", Algorithm::SlidingLog);
        let scheduled = || -> usize {
            store
                .shards
                .iter()
                .map(|s| s.lock().unwrap().scheduled)
                .sum()
        };
        assert!(store.apply_at(&check(vec![log()]), NOW).unwrap().admitted);
        assert_eq!(scheduled(), 0);
        let ahead = NOW + 86_400_000;
        assert!(store.apply_at(&at(log(), ahead), NOW).unwrap().admitted);
        assert_eq!(scheduled(), 1, "it lives past a window from now");
        assert!(
            store
                .apply_at(&check(vec![log()]), NOW + 1)
                .unwrap()
                .admitted
        );
        assert_eq!(scheduled(), 1, "a present entry does not move it back");
        assert_eq!(store.counters(), 1);
        store.sweep_at(ahead + 60_000);
        assert_eq!(store.counters(), 0);
        let shard = store.shards.iter().map(|s| s.lock().unwrap());
        assert!(
            shard
                .into_iter()
                .all(|s| s.scheduled == 0 && s.held.is_empty())
        );
    }

    #[test]
    fn a_counter_a_write_deletes_releases_its_share() {
        let store = halved(6_400);
        let mut bucket = of_rule("bucket", "a", Algorithm::TokenBucket);
        store.apply_at(&check(vec![bucket.clone()]), NOW).unwrap();
        assert_eq!(store.counters(), 1);
        bucket.refund = true;
        store.apply_at(&check(vec![bucket]), NOW).unwrap();
        assert_eq!(store.counters(), 0, "a bucket given its hit back is empty");
        assert!(
            store
                .shards
                .iter()
                .all(|s| s.lock().unwrap().held.is_empty())
        );
    }

    #[test]
    fn a_refund_past_its_share_is_not_over() {
        let store = halved(640);
        fill(&store, "user", |i| check(vec![i]));
        let refunds = (0..1_000).map(|n| {
            let mut refund = of_rule("user", &format!("r{n}"), Algorithm::FixedWindow);
            refund.refund = true;
            store.apply_at(&check(vec![refund]), NOW).unwrap()
        });
        assert!(refunds.into_iter().all(|d| d.admitted && !d.usages[0].over));
    }
}
