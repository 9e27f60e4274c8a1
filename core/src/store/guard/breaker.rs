//! The circuit breaker of one Redis store: open after `FAILURES_TO_OPEN` failures in a row, or at
//! once when the store's idle health check fails, when requests get the `--on-store-error` answer
//! at once instead of waiting for a store that does not answer (fail fast); closed only by the
//! store's background probe. It starts open: a store has to be reached once before it decides
//! anything. Only Redis' own failures count: a reply saying that one key cannot be read is an
//! answer, and one bad key must not take the store away from every other request.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::Deadline;
use crate::log_throttle::LogThrottle;
use crate::observe::Observer;
use crate::store::StoreError;

/// Consecutive failed or timed-out calls that open the breaker.
pub(crate) const FAILURES_TO_OPEN: u32 = 5;

pub(crate) struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    /// Why the store was last found unreachable, until it answers again.
    cause: Mutex<Option<String>>,
    /// Told when the breaker opens or closes.
    changed: Arc<Notify>,
    /// Told why the store could not be reached.
    observer: Arc<dyn Observer>,
    /// How far the store's clock reads from this replica's, as its deployment last measured.
    skew: Arc<AtomicI64>,
    /// The breakers of its deployment open now: the first to open and the last to close say so
    /// in the log, once for the deployment.
    open_now: Arc<AtomicUsize>,
}

/// No skew measured yet.
const UNKNOWN_SKEW: i64 = i64::MIN;

impl Breaker {
    fn new(
        changed: Arc<Notify>,
        observer: Arc<dyn Observer>,
        skew: Arc<AtomicI64>,
        open_now: Arc<AtomicUsize>,
    ) -> Self {
        open_now.fetch_add(1, Ordering::Relaxed);
        Breaker {
            open: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            cause: Mutex::new(None),
            changed,
            observer,
            skew,
            open_now,
        }
    }

    /// The store's clock read `ms` ahead of this replica's (behind, when negative).
    pub(crate) fn measured_skew(&self, ms: i64) {
        self.skew.store(ms.max(UNKNOWN_SKEW + 1), Ordering::Relaxed);
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    /// Fails a call at once while the breaker is open.
    pub(crate) fn admit(&self) -> Result<(), StoreError> {
        if self.is_open() {
            return Err(StoreError::Down);
        }
        Ok(())
    }

    /// Hears how a call with `deadline` went: an answer, even one saying a key cannot be read or
    /// that replicas did not confirm, is a success; missing a deadline the caller set sooner is neither.
    pub(crate) fn count<T>(&self, answer: &Result<T, StoreError>, deadline: Deadline) {
        match answer {
            Ok(_) => self.success(),
            Err(e) if e.answered() => self.success(),
            Err(StoreError::Timeout | StoreError::Expired) if !deadline.store_own => {}
            Err(e) => self.failure(e),
        }
    }

    fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    fn failure(&self, why: &impl std::fmt::Display) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= FAILURES_TO_OPEN {
            self.trip(&format_args!(
                "{failures} failures in a row, the last: {why}"
            ));
        }
    }

    /// Opens the breaker at once: the store is known to be down.
    pub(crate) fn trip(&self, why: &impl std::fmt::Display) {
        if !self.open.swap(true, Ordering::Relaxed) {
            if self.open_now.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    "Redis marked down ({why}): requests get the --on-store-error answer until \
                     it answers again"
                );
            }
            self.changed.notify_one();
        }
    }

    /// Hears that the store could not be reached, for a cause of `kind` (one of `UNREACHABLE`),
    /// as `detail` says: counted, logged (at most once a second over every store) and kept for
    /// readiness to name until the store answers again.
    pub(crate) fn unreachable(&self, kind: &'static str, detail: &str) {
        static LOGGED: LogThrottle = LogThrottle::new();
        self.observer.store_unreachable(kind);
        let cause = format!("{kind}: {detail}");
        if let Some(n) = LOGGED.hit() {
            tracing::warn!("Redis cannot be reached ({n} time(s) since the last report): {cause}");
        }
        *self.cause.lock().unwrap_or_else(|e| e.into_inner()) = Some(cause);
    }

    /// Why the store was last found unreachable, while it has not answered since.
    pub(crate) fn cause(&self) -> Option<String> {
        self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        *self.cause.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if self.open.swap(false, Ordering::Relaxed) {
            if self.open_now.fetch_sub(1, Ordering::Relaxed) == 1 {
                tracing::info!("Redis answers: deciding from its counters");
            }
            self.changed.notify_one();
        }
    }
}

impl Drop for Breaker {
    fn drop(&mut self) {
        if self.is_open() {
            self.open_now.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The breakers of every store opened on one deployment, which is reachable when all are closed.
#[derive(Clone)]
pub struct Breakers {
    all: Arc<Mutex<Vec<Arc<Breaker>>>>,
    /// Told when any of them opens or closes.
    changed: Arc<Notify>,
    /// What each tells why the store could not be reached.
    observer: Arc<dyn Observer>,
    /// How far the store's clock reads from this replica's, as last measured by any of them.
    skew: Arc<AtomicI64>,
    /// How many of them are open now.
    open_now: Arc<AtomicUsize>,
}

impl Breakers {
    pub(crate) fn new(observer: Arc<dyn Observer>) -> Self {
        Breakers {
            all: Arc::default(),
            changed: Arc::default(),
            observer,
            skew: Arc::new(AtomicI64::new(UNKNOWN_SKEW)),
            open_now: Arc::default(),
        }
    }

    /// A new breaker (open) for a store on the deployment, counted once `add`ed.
    pub(crate) fn breaker(&self) -> Arc<Breaker> {
        Arc::new(Breaker::new(
            self.changed.clone(),
            self.observer.clone(),
            self.skew.clone(),
            self.open_now.clone(),
        ))
    }

    /// How far (ms) the store's clock read ahead of this replica's (behind, when negative) when
    /// last measured; `None` before the first measure.
    pub(crate) fn skew_ms(&self) -> Option<i64> {
        let skew = self.skew.load(Ordering::Relaxed);
        (skew != UNKNOWN_SKEW).then_some(skew)
    }

    pub(crate) fn add(&self, breaker: Arc<Breaker>) {
        self.all
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(breaker);
    }

    /// Why a store whose breaker is open was last found unreachable, if known.
    pub(crate) fn cause(&self) -> Option<String> {
        self.all
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|b| b.is_open())
            .find_map(|b| b.cause())
    }

    pub(crate) fn all_closed(&self) -> bool {
        self.all
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .all(|b| !b.is_open())
    }

    /// Breakers open now.
    pub(crate) fn open(&self) -> usize {
        self.all
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|b| b.is_open())
            .count()
    }

    /// Woken whenever a breaker opens or closes.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_opens_after_failures_in_a_row_and_only_the_probe_closes_it() {
        let b = Breaker::new(
            Arc::default(),
            crate::observe::unobserved(),
            Arc::new(AtomicI64::new(UNKNOWN_SKEW)),
            Arc::default(),
        );
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
