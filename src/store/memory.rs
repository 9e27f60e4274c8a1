//! The embedded store: counters in sharded in-process maps, decided by the algorithm modules of
//! `limiter::algorithm`, which the Redis script mirrors. A check locks the shards it touches in
//! index order, so concurrent checks are exact and never deadlock. Counters are indexed by a
//! 128-bit SipHash of their `CounterKey` (and, for a fixed window, the index of the window:
//! each window is a counter of its own), keyed at random per process, so that a collision
//! between two of a billion counters has a probability under 10⁻²⁰ that no input can raise.
//! Expired counters are ignored when read and dropped by `sweep`, which the store runs every
//! second; a full shard refuses new counters at once until then, so that no request ever pays
//! for a sweep.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use super::StoreError;
use super::demand::{DemandBoard, Demands, Report};
use crate::limiter::algorithm::{Ask, Verdict, gcra, log, window};
use crate::limiter::{
    Algorithm, Check, CounterIds, CounterKey, Counting, Decision, IdHasher, Item, Limit, admits,
};

const SHARDS: usize = 64;

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    max_keys: usize,
    ids: CounterIds,
    /// Quota buckets' demands, at most `max_keys` buckets.
    demand: DemandBoard,
}

/// A counter's identity in this store: the keyed 128-bit hash of its `CounterKey`.
type Id = u128;

#[derive(Default)]
struct Shard {
    counters: HashMap<Id, Counter, IdHasher>,
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

#[derive(Clone)]
struct Counter {
    stored: Stored,
    expires_ms: u64,
}

impl Counter {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_ms > now_ms
    }
}

impl Shard {
    fn live(&self, id: Id, now_ms: u64) -> Option<&Stored> {
        self.counters
            .get(&id)
            .filter(|c| c.live(now_ms))
            .map(|c| &c.stored)
    }

    fn sweep(&mut self, now_ms: u64) {
        self.counters.retain(|_, c| c.live(now_ms));
    }
}

/// What admitting a request does to one counter: store it, or forget it (`None`).
type Write = (Id, Option<Counter>);

impl MemoryStore {
    /// A store that holds at most `max_keys` live counters.
    pub fn new(max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: max_keys.div_ceil(SHARDS).max(1),
            max_keys,
            ids: CounterIds::new(),
            demand: DemandBoard::new(max_keys),
        }
    }

    /// The id of the counter of `key` under `limit` at `at_ms`: a fixed window's counter is
    /// that of the window holding `at_ms`.
    fn id(&self, key: &CounterKey, limit: &Limit, at_ms: u64) -> Id {
        let salt = match limit.algorithm {
            Algorithm::FixedWindow => at_ms / limit.window_ms() + 1,
            _ => 0,
        };
        self.ids.id(key, salt)
    }

    fn shard_of(id: Id) -> usize {
        ((id >> 64) as u64 % SHARDS as u64) as usize
    }

    pub fn apply(&self, check: &Check) -> Result<Decision, StoreError> {
        self.apply_at(check, now_ms())
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
        let ids: Vec<Id> = check
            .items
            .iter()
            .map(|i| self.id(&i.key, &i.limit, at_ms))
            .collect();
        let homes: Vec<usize> = ids.iter().map(|&id| Self::shard_of(id)).collect();
        let mut order = homes.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = order
            .iter()
            .map(|&s| (s, self.shards[s].lock().unwrap_or_else(|e| e.into_inner())))
            .collect();
        let slot = |shard: usize| {
            order
                .binary_search(&shard)
                .expect("every home shard is locked")
        };

        // Items are evaluated in order, each seeing what the items before it would write, so a
        // request naming one counter twice is counted twice.
        let mut verdicts: Vec<Verdict> = Vec::with_capacity(check.items.len());
        let mut writes: Vec<(Id, Option<Counter>, bool)> = Vec::new();
        for (i, item) in check.items.iter().enumerate() {
            let stored = match writes.iter().rev().find(|(id, _, _)| *id == ids[i]) {
                Some((_, written, _)) => written.as_ref().map(|c| &c.stored),
                None => guards[slot(homes[i])].1.live(ids[i], now_ms),
            };
            let always = item.counting == Counting::Always;
            let ask = Ask {
                limit: u64::from(item.limit.requests_per_unit),
                window_ms: item.limit.window_ms(),
                now_ms,
                at_ms,
                hits: item.hits,
                refund: item.refund,
                always,
            };
            let (verdict, write) = evaluate(item, &ask, stored);
            verdicts.push(verdict);
            if let Some(write) = write {
                writes.push((ids[i], write, always));
            }
        }
        let admitted = admits(check, |i| verdicts[i].over);

        // Counted `always`, a counter's write lands whether the request is admitted or not.
        let landing: Vec<Write> = writes
            .into_iter()
            .filter(|(_, _, always)| admitted || *always)
            .map(|(id, write, _)| (id, write))
            .collect();
        self.make_room(&landing, &guards, &slot)?;
        for (id, write) in landing {
            let shard = &mut guards[slot(Self::shard_of(id))].1;
            match write {
                Some(counter) => shard.counters.insert(id, counter),
                None => shard.counters.remove(&id),
            };
        }

        Ok((admitted, verdicts))
    }

    /// Fails, before anything is written, when a shard cannot take the new counters. Constant
    /// time: it never sweeps (the expired counters of a full shard go at the next `sweep`).
    fn make_room(
        &self,
        writes: &[Write],
        guards: &[(usize, MutexGuard<'_, Shard>)],
        slot: &impl Fn(usize) -> usize,
    ) -> Result<(), StoreError> {
        let mut new_per_slot = vec![0usize; guards.len()];
        for (i, (id, write)) in writes.iter().enumerate() {
            let first = !writes[..i].iter().any(|(earlier, _)| earlier == id);
            let home = slot(Self::shard_of(*id));
            if write.is_some() && first && !guards[home].1.counters.contains_key(id) {
                new_per_slot[home] += 1;
            }
        }
        let full = guards
            .iter()
            .zip(&new_per_slot)
            .any(|((_, shard), &new)| new > 0 && shard.counters.len() + new > self.per_shard);
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

    /// Counters held, expired ones not swept yet included.
    pub fn counters(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).counters.len())
            .sum()
    }

    /// Records a stream's demand for a quota bucket (see `demand`).
    pub fn record_demand(
        &self,
        bucket: &CounterKey,
        report: Report,
    ) -> Result<Demands, StoreError> {
        self.demand.record(bucket, report, now_ms())
    }

    /// Drops expired counters, one shard at a time, and quota streams gone quiet.
    pub fn sweep(&self) {
        let now_ms = now_ms();
        self.sweep_at(now_ms);
        self.demand.sweep(now_ms);
    }

    fn sweep_at(&self, now_ms: u64) {
        for shard in self.shards.iter() {
            shard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .sweep(now_ms);
        }
    }
}

/// Evaluates `item` against what its counter holds, by the module of its algorithm: the verdict
/// and, if admitting the request changes the counter, what it then holds (`None`: nothing).
fn evaluate(item: &Item, ask: &Ask, stored: Option<&Stored>) -> (Verdict, Option<Option<Counter>>) {
    let now_ms = ask.now_ms;
    let counter = |stored: Stored, ttl_ms: u64| Counter {
        stored,
        expires_ms: now_ms + ttl_ms,
    };
    match item.limit.algorithm {
        algorithm @ (Algorithm::FixedWindow | Algorithm::SlidingWindow) => {
            let state = match stored {
                Some(Stored::Window(s)) => Some(*s),
                _ => None,
            };
            let step = window::evaluate(algorithm, ask, state);
            let write =
                (item.hits > 0).then(|| Some(counter(Stored::Window(step.next), step.ttl_ms)));
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

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{DescriptorKey, Mode, Unit};

    fn item(value: &str, limit: u32, hits: u64) -> Item {
        Item {
            key: DescriptorKey::new(b"d", &[(b"k", value.as_bytes())])
                .counter("fixed_window:minute:1"),
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
        let store = MemoryStore::new(100);
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
        let store = MemoryStore::new(100);
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
        let store = MemoryStore::new(100);
        let twice = check(vec![item("a", 1, 1), item("a", 1, 1)]);
        assert!(!store.apply_at(&twice, NOW).unwrap().admitted);
        let twice = check(vec![item("a", 2, 1), item("a", 2, 1)]);
        let d = store.apply_at(&twice, NOW).unwrap();
        assert!(d.admitted);
        assert_eq!(d.usages[1].remaining, 0);
    }

    #[test]
    fn counters_expire_with_their_window() {
        let store = MemoryStore::new(100);
        store.apply_at(&check(vec![item("a", 10, 1)]), NOW).unwrap();
        assert_eq!(store.counters(), 1);
        store.sweep_at(NOW + 59_999);
        assert_eq!(store.counters(), 1, "live until the window ends");
        store.sweep_at(NOW + 120_000);
        assert_eq!(store.counters(), 0, "the expired counter was swept");
    }

    #[test]
    fn a_full_shard_takes_new_counters_again_once_swept() {
        let store = MemoryStore::new(1);
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
        let store = MemoryStore::new(1);
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
}
