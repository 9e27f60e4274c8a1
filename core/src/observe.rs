//! What the rules and the stores tell the process running them: how each decided descriptor
//! fared, under its rule, requests for domains no rule declares, and the store's faults. They
//! are handed an `Observer` when they are made and know nothing of what it does with what it is
//! told: the server's telemetry turns it into metrics and the top view; `Unobserved` drops it.

use std::sync::Arc;

/// The target of the `tracing` spans that are traces: the rules and the stores open some, the
/// server's telemetry exports them.
pub const TRACES: &str = "sluice::traces";

/// How one descriptor of a decided request fared.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// Within its limit, with this much of it used once the request is counted.
    Within { limit: u64, used: u64 },
    /// Over its limit.
    Over {
        limit: u64,
        /// Counted `always`: the hits landed all the same, on a count of this much (the limit
        /// or more when it had reached it); `None`: they were refused.
        charged_from: Option<u64>,
        /// A shadow-mode limit: reported, not denied.
        shadow: bool,
        /// Known from the local over-limit cache.
        from_cache: bool,
    },
}

/// The counters one rule's decided descriptors are counted in (or one series of the rule, named
/// from request values), which hold its domain and path.
pub trait RuleCounters: Send + Sync {
    fn domain(&self) -> &str;

    /// The path of its rule: for a series named from request values, the rule it belongs to,
    /// not those values.
    fn rule_path(&self) -> &str;

    /// Counts `hits` of one decided descriptor, which fared as `outcome`, hits past
    /// `near_ratio` of the limit counting as near it.
    fn count(&self, hits: u64, outcome: Outcome, near_ratio: f64);

    /// Counts `hits` of a descriptor of `entries`, `denied` or not: who is being limited.
    fn seen(&self, entries: &[(&[u8], &[u8])], hits: u64, denied: bool);
}

/// What the rules and the stores tell.
pub trait Observer: Send + Sync {
    /// The counters of the rule `path` of `domain`, at a load of the rules.
    fn rule(&self, domain: &str, path: &str) -> Arc<dyn RuleCounters>;

    /// The counters of a series named `name` from a request's values, of the rule `rule`, or
    /// `None` past the number of such series the observer keeps.
    fn detailed(&self, domain: &str, name: &str, rule: &str) -> Option<Arc<dyn RuleCounters>>;

    /// A request for a domain no rule declares.
    fn unknown_domain(&self);

    /// The store could not be reached, for want of `kind` (`refused`, `timeout`, …).
    fn store_unreachable(&self, kind: &'static str);

    /// The embedded store refused a new counter: `share` (`rule`, `scheduled`) was full.
    fn memory_refused(&self, share: &'static str);

    /// One Redis script call carried `requests` requests.
    fn batch(&self, requests: usize);
}

/// An observer that keeps nothing: for what decides without reporting (`explain`,
/// `check-config`, the tests of the rules).
pub(crate) struct Unobserved;

/// A rule's names, with no counter.
struct Named {
    domain: Box<str>,
    path: Box<str>,
}

impl RuleCounters for Named {
    fn domain(&self) -> &str {
        &self.domain
    }

    fn rule_path(&self) -> &str {
        &self.path
    }

    fn count(&self, _: u64, _: Outcome, _: f64) {}

    fn seen(&self, _: &[(&[u8], &[u8])], _: u64, _: bool) {}
}

impl Observer for Unobserved {
    fn rule(&self, domain: &str, path: &str) -> Arc<dyn RuleCounters> {
        Arc::new(Named {
            domain: domain.into(),
            path: path.into(),
        })
    }

    fn detailed(&self, _: &str, _: &str, _: &str) -> Option<Arc<dyn RuleCounters>> {
        None
    }

    fn unknown_domain(&self) {}

    fn store_unreachable(&self, _: &'static str) {}

    fn memory_refused(&self, _: &'static str) {}

    fn batch(&self, _: usize) {}
}

/// The observer that keeps nothing, shared.
pub fn unobserved() -> Arc<dyn Observer> {
    Arc::new(Unobserved)
}
