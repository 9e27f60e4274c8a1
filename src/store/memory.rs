//! The embedded store: counters in sharded in-process maps, with the same window math as the
//! Redis scripts. A check locks the shards it touches in index order, so concurrent checks are
//! exact and never deadlock. Counters are indexed by a 128-bit SipHash of their `CounterKey`,
//! keyed at random per process: 40 bytes a counter, and a collision between two of a billion
//! counters has a probability under 10⁻²⁰ that no input can raise. Expired counters are ignored
//! when read and dropped by `sweep`, which the store runs every second; a full shard refuses new
//! counters at once until then, so that no request ever pays for a sweep.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use super::StoreError;
use crate::limiter::window::{self, State, Step};
use crate::limiter::{Check, CounterIds, CounterKey, Decision, IdHasher, admits};

const SHARDS: usize = 64;

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    max_keys: usize,
    ids: CounterIds,
}

/// A counter's identity in this store: the keyed 128-bit hash of its `CounterKey`.
type Id = u128;

#[derive(Default)]
struct Shard {
    counters: HashMap<Id, Counter, IdHasher>,
}

/// A stored `State`, compacted: window indexes and expiry seconds fit 32 bits until 2106,
/// since every window is at least a second long.
#[derive(Clone, Copy)]
struct Counter {
    count: u64,
    previous: u64,
    window: u32,
    expires_s: u32,
}

impl Counter {
    fn new(state: State, expires_ms: u64) -> Self {
        Counter {
            count: state.count,
            previous: state.previous,
            window: u32::try_from(state.window).unwrap_or(u32::MAX),
            expires_s: u32::try_from(expires_ms.div_ceil(1000)).unwrap_or(u32::MAX),
        }
    }

    fn live(&self, now_ms: u64) -> bool {
        u64::from(self.expires_s) * 1000 > now_ms
    }

    fn state(&self) -> State {
        State {
            window: u64::from(self.window),
            count: self.count,
            previous: self.previous,
        }
    }
}

impl Shard {
    fn live(&self, id: Id, now_ms: u64) -> Option<State> {
        self.counters
            .get(&id)
            .filter(|c| c.live(now_ms))
            .map(Counter::state)
    }

    fn sweep(&mut self, now_ms: u64) {
        self.counters.retain(|_, c| c.live(now_ms));
    }
}

impl MemoryStore {
    /// A store that holds at most `max_keys` live counters.
    pub fn new(max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: max_keys.div_ceil(SHARDS).max(1),
            max_keys,
            ids: CounterIds::new(),
        }
    }

    fn id(&self, key: &CounterKey) -> Id {
        self.ids.id(key, 0)
    }

    fn shard_of(id: Id) -> usize {
        ((id >> 64) as u64 % SHARDS as u64) as usize
    }

    pub fn apply(&self, check: &Check) -> Result<Decision, StoreError> {
        self.apply_at(check, now_ms())
    }

    fn apply_at(&self, check: &Check, now_ms: u64) -> Result<Decision, StoreError> {
        let ids: Vec<Id> = check.items.iter().map(|i| self.id(&i.key)).collect();
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

        // Items are evaluated in order against the stored state updated by the items before
        // them, so a request naming one counter twice is counted twice.
        let mut steps: Vec<Step> = Vec::with_capacity(check.items.len());
        for (i, item) in check.items.iter().enumerate() {
            let earlier = (0..i).rev().find(|&j| ids[j] == ids[i]);
            let stored = match earlier {
                Some(j) => Some(steps[j].next),
                None => guards[slot(homes[i])].1.live(ids[i], now_ms),
            };
            steps.push(window::evaluate(
                item.limit.algorithm,
                u64::from(item.limit.requests_per_unit),
                item.limit.window_ms(),
                now_ms,
                stored,
                item.hits,
                item.refund,
            ));
        }
        let admitted = admits(&check.items, |i| steps[i].verdict.over);

        if admitted {
            self.make_room(check, &ids, &homes, &guards, &slot)?;
            for (i, item) in check.items.iter().enumerate() {
                if item.hits == 0 {
                    continue;
                }
                let step = &steps[i];
                guards[slot(homes[i])]
                    .1
                    .counters
                    .insert(ids[i], Counter::new(step.next, now_ms + step.ttl_ms));
            }
        }

        let usages = steps
            .iter()
            .zip(&check.items)
            .map(|(s, item)| s.verdict.usage(admitted, item.limit.algorithm, item.hits))
            .collect();
        Ok(Decision { admitted, usages })
    }

    /// Fails, before anything is written, when a shard cannot take the new counters. Constant
    /// time: it never sweeps (the expired counters of a full shard go at the next `sweep`).
    fn make_room(
        &self,
        check: &Check,
        ids: &[Id],
        homes: &[usize],
        guards: &[(usize, MutexGuard<'_, Shard>)],
        slot: &impl Fn(usize) -> usize,
    ) -> Result<(), StoreError> {
        let mut new_per_slot = vec![0usize; guards.len()];
        for (i, item) in check.items.iter().enumerate() {
            let first = !ids[..i].contains(&ids[i]);
            if item.hits > 0 && first && !guards[slot(homes[i])].1.counters.contains_key(&ids[i]) {
                new_per_slot[slot(homes[i])] += 1;
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

    /// Counters held, expired ones not swept yet included.
    pub fn counters(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).counters.len())
            .sum()
    }

    /// Drops expired counters, one shard at a time.
    pub fn sweep(&self) {
        self.sweep_at(now_ms());
    }

    fn sweep_at(&self, now_ms: u64) {
        for shard in self.shards.iter() {
            shard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .sweep(now_ms);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).counters.len())
            .sum()
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
    use crate::limiter::{Algorithm, DescriptorKey, Item, Limit, Mode, Unit};

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
            },
            mode: Mode::Enforce,
            hits,
            refund: false,
        }
    }

    fn check(items: Vec<Item>) -> Check {
        Check { items }
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
        assert_eq!(store.len(), 1);
        store.sweep_at(NOW + 59_999);
        assert_eq!(store.len(), 1, "live until the window ends");
        store.sweep_at(NOW + 120_000);
        assert_eq!(store.len(), 0, "the expired counter was swept");
    }

    #[test]
    fn a_full_shard_takes_new_counters_again_once_swept() {
        let store = MemoryStore::new(1);
        let minute = |v: u32| check(vec![item(&v.to_string(), 10, 1)]);
        let refused = (0..200)
            .find(|&v| store.apply_at(&minute(v), NOW).is_err())
            .expect("some shard fills up");
        assert!(
            store.apply_at(&minute(refused), NOW + 60_000).is_err(),
            "expired counters are only dropped by the sweep"
        );
        store.sweep_at(NOW + 60_000);
        assert!(store.apply_at(&minute(refused), NOW + 60_000).is_ok());
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
        assert!(store.len() <= SHARDS);
        assert!(store.apply_at(&check(vec![item("a", 10, 1)]), NOW).is_ok());
    }
}
