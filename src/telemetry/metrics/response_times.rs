//! The response-time summary: every ShouldRateLimit call's duration in whole milliseconds, kept
//! exactly, so that envoyproxy/ratelimit's `response_time` timer can be written through any
//! mapping's buckets and scale at scrape time.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::lock;

/// Whole milliseconds each ShouldRateLimit call took, truncated as envoyproxy/ratelimit's timer
/// truncates them: counted per millisecond below `FAST_MS` (one relaxed add per call), in a map
/// above it (calls that slow are rare), so that any mapping's buckets and scale can be applied
/// exactly at scrape time.
pub struct ResponseTimes {
    fast: [AtomicU64; FAST_MS],
    slow: Mutex<BTreeMap<u64, u64>>,
}

/// Calls faster than this many ms are counted without a lock.
const FAST_MS: usize = 1024;

impl ResponseTimes {
    pub(super) fn new() -> Self {
        ResponseTimes {
            fast: [const { AtomicU64::new(0) }; FAST_MS],
            slow: Mutex::default(),
        }
    }

    pub fn observe(&self, elapsed: Duration) {
        let ms = elapsed.as_millis();
        match self.fast.get(ms as usize) {
            Some(n) => {
                n.fetch_add(1, Ordering::Relaxed);
            }
            None => *lock(&self.slow).entry(ms as u64).or_default() += 1,
        }
    }

    /// (milliseconds, calls) for every duration seen, shortest first.
    pub(super) fn seen(&self) -> Vec<(u64, u64)> {
        let mut seen: Vec<(u64, u64)> = (0..FAST_MS as u64)
            .map(|ms| (ms, self.fast[ms as usize].load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect();
        seen.extend(lock(&self.slow).iter().map(|(ms, n)| (*ms, *n)));
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_times_keep_every_whole_millisecond() {
        let t = ResponseTimes::new();
        for ms in [0, 0, 3, 5000] {
            t.observe(Duration::from_micros(ms * 1000 + 999));
        }
        assert_eq!(t.seen(), [(0, 2), (3, 1), (5000, 1)]);
    }
}
