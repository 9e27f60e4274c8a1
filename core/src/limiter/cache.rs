//! The local over-limit cache: counters the store found full, each with the instant until which
//! not one more hit fits. A request that such a counter would deny on its own is denied here,
//! without a store call, until that instant: under abuse the store hears from one hot key about
//! once per window, not once per request. Bounded (`--local-cache-size` entries, least useful
//! evicted first); one per process, shared by every event loop.

use tokio::time::Instant;

use super::{Algorithm, Check, CounterIds, Counting, Decision, IdHasher, Item, Usage, admits};

pub struct OverLimitCache {
    /// Counter (keyed hash of its key and limit) → until when it is full.
    full: quick_cache::sync::Cache<u128, Instant, quick_cache::UnitWeighter, IdHasher>,
    ids: CounterIds,
}

impl OverLimitCache {
    /// A cache of at most `entries` counters (at least 1).
    pub fn new(entries: usize) -> Self {
        OverLimitCache {
            full: quick_cache::sync::Cache::with(
                entries.max(1),
                entries.max(1) as u64,
                quick_cache::UnitWeighter,
                IdHasher::default(),
                quick_cache::sync::DefaultLifecycle::default(),
            ),
            ids: CounterIds::new(),
        }
    }

    /// Counters held.
    pub fn entries(&self) -> usize {
        self.full.len()
    }

    /// The counter of `item`: its key and its limit, so that a changed limit is a new entry.
    fn id(&self, item: &Item) -> u128 {
        self.ids
            .id(&item.key, u64::from(item.limit.requests_per_unit))
    }

    /// Forgets the counter whose key's bytes are `key` under a limit of `requests_per_unit`:
    /// reset in the store (`/counters`), it is no longer known to be full.
    pub fn forget(&self, key: &[u8], requests_per_unit: u32) {
        self.full.remove(
            &self
                .ids
                .salted_id_of_bytes(key, u64::from(requests_per_unit)),
        );
    }

    /// Forgets every counter: resets may have been missed.
    pub fn forget_all(&self) {
        self.full.clear();
    }

    /// The denial of `check` when counters known to be full deny it on their own, else `None`.
    /// A check that gives hits back, names an instant, or charges a counter whatever the
    /// answer (`Counting::Always`), is never answered here: its store call must happen.
    pub fn deny(&self, check: &Check, now: Instant) -> Option<Decision> {
        if check.at.is_some()
            || check
                .items
                .iter()
                .any(|i| i.refund || i.counting == Counting::Always)
        {
            return None;
        }
        let known_full = |item: &Item| {
            let cached = (!item.mode.is_shadow()).then(|| self.full.get(&self.id(item)));
            cached.flatten().filter(|at| *at > now)
        };
        // Per item, until when it is known to be full; built only once one is.
        let (first, at) = check
            .items
            .iter()
            .enumerate()
            .find_map(|(i, item)| known_full(item).map(|at| (i, at)))?;
        let mut until = vec![None; check.items.len()];
        until[first] = Some(at);
        for (i, item) in check.items.iter().enumerate().skip(first + 1) {
            until[i] = known_full(item);
        }
        if admits(check, |i| until[i].is_some()) {
            return None;
        }
        let usages = until
            .iter()
            .map(|at| match at {
                Some(at) => Usage {
                    over: true,
                    remaining: 0,
                    left_before: 0,
                    reset: *at - now,
                    full: true,
                    source: super::Source::LocalCache,
                    window: 0,
                    hold: None,
                },
                None => Usage::unknown(),
            })
            .collect();
        Some(Decision {
            admitted: false,
            usages,
        })
    }

    /// Learns from the store's `decision` on `check`, asked at `asked`: a counter it found full
    /// is full until `asked` plus its reset (no later than the store's own instant), and a
    /// counter given hits back is no longer known to be full. A check naming an instant
    /// teaches nothing: its counters are those of that instant. A counter counted `Always` is
    /// full only above its limit, which its usage does not tell: it is never learned.
    pub fn learn(&self, check: &Check, decision: &Decision, asked: Instant) {
        if check.at.is_some() {
            return;
        }
        for (item, usage) in check.items.iter().zip(&decision.usages) {
            if item.refund {
                self.full.remove(&self.id(item));
            } else if usage.full
                && !item.mode.is_shadow()
                && item.counting == Counting::Admitted
                && !usage.reset.is_zero()
            {
                self.full.insert(self.id(item), asked + usage.reset);
            }
        }
    }
}

/// Whether, after this verdict, not one more hit fits in the counter until its reset: it was
/// full before the request, or a fixed window the request filled. (Elsewhere an over reset is
/// when `hits` fit, so it says when one fits only for a request of one hit, and an admitted
/// reset is not when one more fits.)
pub(crate) fn full(algorithm: Algorithm, hits: u64, over: bool, before: u64, after: u64) -> bool {
    match algorithm {
        Algorithm::FixedWindow => (over && before == 0) || (!over && after == 0 && hits > 0),
        Algorithm::SlidingWindow
        | Algorithm::SlidingLog
        | Algorithm::TokenBucket
        | Algorithm::LeakyBucket => over && before == 0 && hits <= 1,
    }
}
