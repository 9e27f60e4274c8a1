//! The rules in force, which every request reads and a reload swaps.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::Notify;

use sluice_core::rules::RuleSet;

/// The rules in force, swapped whole by a reload.
#[derive(Clone, Default)]
pub struct Rules {
    current: Arc<ArcSwap<RuleSet>>,
    replaced: Arc<Notify>,
}

impl Rules {
    pub fn new(rules: RuleSet) -> Self {
        Rules {
            current: Arc::new(ArcSwap::from_pointee(rules)),
            replaced: Arc::default(),
        }
    }

    /// Puts `rules` in force for every request that starts from now on (see `reload` for
    /// loading them).
    pub fn replace(&self, rules: RuleSet) {
        self.current.store(Arc::new(rules));
        self.replaced.notify_one();
    }

    /// The rules in force now.
    pub fn in_force(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// What the services read the rules in force from, on every request.
    pub(super) fn shared(&self) -> Arc<ArcSwap<RuleSet>> {
        self.current.clone()
    }

    /// Waits for the next `replace` (one waiter is woken: gRPC health's).
    pub(super) async fn replaced(&self) {
        self.replaced.notified().await;
    }

    /// Whether rules are loaded: any domain from files; any configuration over xDS, where an
    /// empty one (no rate limits anywhere) is as valid as any.
    pub fn loaded(&self) -> bool {
        let rules = self.current.load();
        rules.domains() > 0 || (self.over_xds() && !rules.is_awaiting())
    }

    /// Whether the rules come over xDS (they started awaiting their first configuration).
    pub fn over_xds(&self) -> bool {
        self.current.load().origin().over_xds
    }
}
