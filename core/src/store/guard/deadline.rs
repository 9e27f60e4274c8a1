//! The deadline of a store call: `--store-timeout`, or sooner when the caller gives up sooner (its
//! gRPC `grpc-timeout`), keeping time for the answer to travel back. Only a missed deadline of the
//! store's own counts against the store.

use std::time::Duration;

use tokio::time::Instant;

use crate::store::StoreError;

/// When a store call must have its answer.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    pub at: Instant,
    /// The store's own timeout set it, rather than a caller that gives up sooner: only then does
    /// missing it count against the store.
    pub store_own: bool,
}

impl Deadline {
    /// `timeout` from now, or sooner when the caller gives up within `caller`: a fifth of the
    /// caller's time (at least 1 ms) is kept for the answer to travel back.
    pub fn new(timeout: Duration, caller: Option<Duration>) -> Deadline {
        let now = Instant::now();
        let keep = |c: Duration| c.saturating_sub((c / 5).max(Duration::from_millis(1)));
        match caller.map(keep) {
            Some(budget) if budget < timeout => Deadline {
                at: now + budget,
                store_own: false,
            },
            _ => Deadline {
                at: now + timeout,
                store_own: true,
            },
        }
    }

    /// `call`'s answer, or `StoreError::Timeout` when it has none by the deadline. A call that
    /// answers when first asked (the embedded store's) has its answer whatever the time.
    pub(crate) async fn bound<T>(
        self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout_at(self.at, call)
            .await
            .unwrap_or(Err(StoreError::Timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_store_timeout_applies_unless_the_caller_gives_up_sooner() {
        let own = Deadline::new(10 * MS, None);
        assert!(own.store_own);
        let patient = Deadline::new(10 * MS, Some(1000 * MS));
        assert!(patient.store_own);
        let hasty = Deadline::new(10 * MS, Some(10 * MS));
        assert!(!hasty.store_own);
        assert!(
            hasty.at < own.at,
            "a fifth of the caller's 10 ms is kept for the way back"
        );
        let instant = Deadline::new(10 * MS, Some(Duration::ZERO));
        assert!(!instant.store_own);
    }
}
