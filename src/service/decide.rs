//! One request's decision: the local over-limit cache first, then the store behind its guard, the
//! cache learning from every answer. It joins the limiter's rules to a store, so it sits above
//! both, where the request path composes them.

use std::sync::Arc;

use tokio::time::Instant;

use crate::limiter::{Check, Decision, OverLimitCache};
use crate::store::{Deadline, Store, StoreError};
use crate::telemetry::metrics::METRICS;

/// Decides checks against a store, denying from the local over-limit cache when it can.
pub struct Decider {
    store: Store,
    cache: Option<Arc<OverLimitCache>>,
}

impl Decider {
    pub fn new(store: Store, cache: Option<Arc<OverLimitCache>>) -> Self {
        Decider { store, cache }
    }

    /// Decides `check`; the store must answer by `deadline`. A check without items is admitted
    /// without asking the store, and one that counters known to be full deny is denied without
    /// asking it.
    pub async fn decide(&self, check: &Check, deadline: Deadline) -> Result<Decision, StoreError> {
        if check.items.is_empty() {
            return Ok(Decision {
                admitted: true,
                usages: Vec::new(),
            });
        }
        let asked = Instant::now();
        if let Some(denied) = self.cache.as_ref().and_then(|c| c.deny(check, asked)) {
            return Ok(denied);
        }
        let decided = self.store.apply(check, deadline).await;
        METRICS
            .store_call_seconds
            .observe(asked.elapsed().as_secs_f64());
        if let (Some(cache), Ok(decision)) = (&self.cache, &decided) {
            cache.learn(check, decision, asked);
        }
        decided
    }
}
