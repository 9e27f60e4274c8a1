//! The circuit breaker of one Redis store: open after `FAILURES_TO_OPEN` failures in a row, or at
//! once when the store's idle health check fails, when requests get the `--on-store-error` answer
//! at once instead of waiting for a store that does not answer; closed only by the store's
//! background probe. It starts open: a store has to be reached once before it decides anything.
//! Only Redis' own failures count: a reply saying that one key cannot be read is an answer, and
//! one bad key must not take the store away from every other request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::Notify;

/// Consecutive failed or timed-out calls that open the breaker.
pub const FAILURES_TO_OPEN: u32 = 5;

pub struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    /// Told when the breaker opens or closes.
    changed: Arc<Notify>,
}

impl Breaker {
    pub fn new(changed: Arc<Notify>) -> Self {
        Breaker {
            open: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            changed,
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    pub fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    pub fn failure(&self, why: &impl std::fmt::Display) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= FAILURES_TO_OPEN {
            self.trip(&format_args!(
                "{failures} failures in a row, the last: {why}"
            ));
        }
    }

    /// Opens the breaker at once: the store is known to be down.
    pub fn trip(&self, why: &impl std::fmt::Display) {
        if !self.open.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "Redis marked down ({why}): requests get the --on-store-error answer until it \
                 answers again"
            );
            self.changed.notify_one();
        }
    }

    pub fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open.swap(false, Ordering::Relaxed) {
            tracing::info!("Redis answers: deciding from its counters");
            self.changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_opens_after_failures_in_a_row_and_only_the_probe_closes_it() {
        let b = Breaker::new(Arc::default());
        assert!(b.is_open(), "closed only once the store was reached");
        b.close();
        for _ in 1..FAILURES_TO_OPEN {
            b.failure(&"x");
        }
        b.success();
        for _ in 1..FAILURES_TO_OPEN {
            b.failure(&"x");
        }
        assert!(!b.is_open(), "a success in between resets the count");
        b.failure(&"x");
        assert!(b.is_open());
        b.success();
        assert!(b.is_open(), "a late success does not close it");
        b.close();
        assert!(!b.is_open());
        b.trip(&"no answer");
        assert!(b.is_open(), "a failed health check opens it at once");
    }
}
