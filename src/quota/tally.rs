//! What a report adds to the metrics, added up per rule and counted before each answer is sent.

use std::collections::HashMap;
use std::sync::Arc;

use super::bounds::FullBound;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::{QuotaLabels, UNMATCHED_RULE};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::rules::QuotaRule;

/// What a report adds to the metrics, added up per rule and counted before each answer is sent
/// (so that the metrics show it once the Envoy has it) rather than once per bucket; and the
/// labels of its rules, made once.
pub(super) struct Tally {
    pub(super) domain: String,
    /// By rule path.
    pub(super) labels: HashMap<String, Arc<QuotaLabels>>,
    pub(super) counts: HashMap<Arc<QuotaLabels>, RuleCounts>,
    /// By `FullBound`.
    pub(super) untracked: [u64; 5],
}

/// What a report adds to one rule's series.
#[derive(Default)]
pub(super) struct RuleCounts {
    pub(super) allowed: u64,
    pub(super) denied: u64,
    /// Actions sent, by name.
    pub(super) actions: Vec<(&'static str, u64)>,
}

impl Tally {
    pub(super) fn new(domain: String) -> Self {
        Tally {
            domain,
            labels: HashMap::new(),
            counts: HashMap::new(),
            untracked: [0; 5],
        }
    }

    /// The series of `rule` (`None`: unmatched).
    pub(super) fn labels(&mut self, rule: Option<&QuotaRule>) -> Arc<QuotaLabels> {
        let path = rule.map_or(UNMATCHED_RULE, |r| r.path.as_str());
        if let Some(labels) = self.labels.get(path) {
            return labels.clone();
        }
        let labels = Arc::new([("domain", self.domain.clone()), ("rule", path.to_owned())]);
        self.labels.insert(path.to_owned(), labels.clone());
        labels
    }

    pub(super) fn counts(&mut self, labels: &Arc<QuotaLabels>) -> &mut RuleCounts {
        self.counts.entry(labels.clone()).or_default()
    }

    pub(super) fn reported(&mut self, labels: &Arc<QuotaLabels>, allowed: u64, denied: u64) {
        let counts = self.counts(labels);
        counts.allowed = counts.allowed.saturating_add(allowed);
        counts.denied = counts.denied.saturating_add(denied);
    }

    pub(super) fn action(&mut self, labels: &Arc<QuotaLabels>, name: &'static str) {
        let actions = &mut self.counts(labels).actions;
        match actions.iter_mut().find(|(n, _)| *n == name) {
            Some((_, sent)) => *sent += 1,
            None => actions.push((name, 1)),
        }
    }

    pub(super) fn untracked(&mut self, bound: FullBound) {
        self.untracked[bound as usize] += 1;
    }

    /// Counts what it holds in the metrics, and empties it; warns (at most once a second) of
    /// buckets answered untracked.
    pub(super) fn count(&mut self, telemetry: &Telemetry) {
        for (labels, counts) in self.counts.drain() {
            telemetry.quota_reported(&labels, counts.allowed, counts.denied);
            for (name, sent) in counts.actions {
                telemetry.quota_actions(&labels, name, sent);
            }
        }
        for bound in FullBound::ALL {
            let n = std::mem::take(&mut self.untracked[bound as usize]);
            if n == 0 {
                continue;
            }
            telemetry.quota_untracked(bound.name(), n);
            static FULL: LogThrottle = LogThrottle::new();
            if let Some(answers) = FULL.hit() {
                tracing::warn!(
                    "quota buckets answered untracked, denied, because a bound was full: {n} past {} in the latest answer, {answers} answer(s) with some since the last warning; see sluice_quota_untracked_total",
                    bound.described()
                );
            }
        }
    }
}
