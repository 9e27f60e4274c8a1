//! Per-rule series: what envoyproxy/ratelimit counts per rule (hits total, over, near and within
//! the limit, in shadow mode, from the local cache), one series per rule, plus, for rules with
//! `detailed_metric` or `value_to_metric`, one per request value, at most `DETAILED_SERIES` in all.
//!
//! Each decided descriptor's outcome arrives at `RuleStats::count` (from `rules::plan`), and its
//! values at `RuleStats::seen`, which feeds the top view (`telemetry::top`: the request values
//! most often over a limit, in a bounded top-k of its own rather than in more series under the
//! cap).

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use hashbrown::HashTable;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::telemetry::mapper::Series;
use crate::telemetry::top::{RuleTop, Top};
use sluice_core::observe::{Outcome, RuleCounters};

/// Most series made from request values (`detailed_metric`, `value_to_metric`); past it, such
/// hits count under their rule's own series.
const DETAILED_SERIES: usize = 10_000;

/// The per-rule counters, found by domain and name. The table holds the counters alone (each
/// holds its names): a rule costs its counters, its name and a slot of 8 bytes, which matters
/// at hundreds of thousands of rules.
#[derive(Default)]
pub(super) struct RuleSeries {
    by_name: HashTable<Arc<RuleStats>>,
    hasher: RandomState,
    /// Each domain's name, shared by its series.
    domains: HashSet<Arc<str>>,
    /// How many of them are named from request values.
    detailed: usize,
}

impl RuleSeries {
    /// The counters of the rule `descriptor` in `domain`.
    pub(super) fn rule(&mut self, domain: &str, descriptor: &str, top: &TopCell) -> Arc<RuleStats> {
        self.get(domain, descriptor, None, top)
    }

    /// The counters of a series named from request values for the rule `rule`, or `None` once
    /// `DETAILED_SERIES` exist.
    pub(super) fn detailed(
        &mut self,
        domain: &str,
        name: &str,
        rule: &str,
        top: &TopCell,
    ) -> Option<Arc<RuleStats>> {
        if self.detailed >= DETAILED_SERIES && self.find(domain, name).is_none() {
            return None;
        }
        Some(self.get(domain, name, Some(rule), top))
    }

    /// Forgets the series of rules that `keep` (domain, rule path) no longer has, and the names
    /// of domains left without series.
    pub(super) fn retain(&mut self, keep: impl Fn(&str, &str) -> bool) {
        self.by_name.retain(|s| keep(&s.domain, s.rule_path()));
        let hasher = &self.hasher;
        self.by_name
            .shrink_to_fit(|s| hasher.hash_one((&*s.domain, &*s.descriptor)));
        self.detailed = self.by_name.iter().filter(|s| s.rule.is_some()).count();
        // A domain's name is held by the set and by each of its series.
        self.domains.retain(|d| Arc::strong_count(d) > 1);
    }

    /// Every series' values, ordered by domain and descriptor, with what `name` (the statsd
    /// mapping) names its stats, worked out once per series.
    pub(super) fn snapshot(
        &self,
        name: impl Fn(&str, &str) -> Vec<Option<Series>>,
    ) -> RuleSnapshot {
        let mut rules: Vec<RuleValues> = self
            .by_name
            .iter()
            .map(|s| RuleValues {
                domain: s.domain.clone(),
                descriptor: s.descriptor.clone(),
                mapped: s
                    .mapped
                    .get_or_init(|| name(&s.domain, &s.descriptor).into())
                    .to_vec(),
                values: s.values(),
            })
            .collect();
        rules.sort_by(|a, b| (&a.domain, &a.descriptor).cmp(&(&b.domain, &b.descriptor)));
        RuleSnapshot(rules)
    }

    fn find(&self, domain: &str, name: &str) -> Option<&Arc<RuleStats>> {
        let hash = self.hasher.hash_one((domain, name));
        self.by_name
            .find(hash, |s| &*s.domain == domain && &*s.descriptor == name)
    }

    fn get(
        &mut self,
        domain: &str,
        name: &str,
        rule: Option<&str>,
        top: &TopCell,
    ) -> Arc<RuleStats> {
        if let Some(s) = self.find(domain, name) {
            return s.clone();
        }
        if rule.is_some() {
            self.detailed += 1;
        }
        let domain = match self.domains.get(domain) {
            Some(shared) => shared.clone(),
            None => {
                let shared: Arc<str> = domain.into();
                self.domains.insert(shared.clone());
                shared
            }
        };
        let s = Arc::new(RuleStats::new(domain, name, rule, top.clone()));
        let hasher = &self.hasher;
        let hash = hasher.hash_one((&*s.domain, &*s.descriptor));
        self.by_name.insert_unique(hash, s.clone(), |s| {
            hasher.hash_one((&*s.domain, &*s.descriptor))
        });
        s
    }
}

/// What envoyproxy/ratelimit counts per rule, in hits (a request's `hits_addend`), not requests.
pub struct RuleStats {
    domain: Arc<str>,
    descriptor: Arc<str>,
    /// For a series named from request values, the path of the rule it belongs to.
    rule: Option<Box<str>>,
    total_hits: AtomicU64,
    over_limit: AtomicU64,
    near_limit: AtomicU64,
    within_limit: AtomicU64,
    shadow_mode: AtomicU64,
    over_limit_with_local_cache: AtomicU64,
    /// What its stats are named through the mapping (`None`: dropped), worked out at the first
    /// scrape.
    mapped: OnceLock<Box<[Option<Series>]>>,
    /// The top view's sketches of its rule, found at its first decision.
    top: OnceLock<Arc<RuleTop>>,
    /// The top view, once started.
    view: TopCell,
}

/// The top view of the process, once started.
pub(crate) type TopCell = Arc<OnceLock<Top>>;

impl RuleStats {
    fn new(domain: Arc<str>, descriptor: &str, rule: Option<&str>, view: TopCell) -> Self {
        RuleStats {
            domain,
            descriptor: descriptor.into(),
            rule: rule.map(Box::from),
            total_hits: AtomicU64::new(0),
            over_limit: AtomicU64::new(0),
            near_limit: AtomicU64::new(0),
            within_limit: AtomicU64::new(0),
            shadow_mode: AtomicU64::new(0),
            over_limit_with_local_cache: AtomicU64::new(0),
            mapped: OnceLock::new(),
            top: OnceLock::new(),
            view,
        }
    }

    fn values(&self) -> [u64; 6] {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            get(&self.total_hits),
            get(&self.over_limit),
            get(&self.near_limit),
            get(&self.within_limit),
            get(&self.shadow_mode),
            get(&self.over_limit_with_local_cache),
        ]
    }
}

impl RuleCounters for RuleStats {
    /// The path of its rule: for a series named from request values, the rule it belongs to,
    /// not those values.
    fn rule_path(&self) -> &str {
        self.rule.as_deref().unwrap_or(&self.descriptor)
    }

    fn domain(&self) -> &str {
        &self.domain
    }

    /// Counts, in the top view when it is on, `hits` of a descriptor of `entries` under its
    /// rule, `denied` or not.
    fn seen(&self, entries: &[(&[u8], &[u8])], hits: u64, denied: bool) {
        let Some(view) = self.view.get() else {
            return;
        };
        let rule = self
            .top
            .get_or_init(|| view.rule(&self.domain, self.rule_path()));
        view.record(rule, entries, hits, denied);
    }

    /// Counts `hits` of one decided descriptor as envoyproxy/ratelimit does: a near-limit hit is
    /// one past `near_ratio` of the limit; a shadow-mode hit over the limit is also an
    /// `over_limit` hit. Hits charged over the limit split as that project's
    /// `checkOverLimitThreshold` splits them: those past the limit are over, those below it
    /// and past the near threshold near, none within. Refused hits are all over.
    fn count(&self, hits: u64, outcome: Outcome, near_ratio: f64) {
        let add = |c: &AtomicU64, n: u64| {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        };
        add(&self.total_hits, hits);
        match outcome {
            Outcome::Within { limit, used } => {
                add(&self.within_limit, hits);
                let near = near_threshold(limit, near_ratio);
                add(&self.near_limit, used.saturating_sub(near).min(hits));
            }
            Outcome::Over {
                limit,
                charged_from,
                shadow,
                from_cache,
            } => {
                let over = match charged_from {
                    Some(before) if before < limit => {
                        let near = near_threshold(limit, near_ratio);
                        add(&self.near_limit, limit - near.max(before));
                        (before + hits).saturating_sub(limit)
                    }
                    _ => hits,
                };
                add(&self.over_limit, over);
                if shadow {
                    add(&self.shadow_mode, over);
                }
                if from_cache {
                    add(&self.over_limit_with_local_cache, hits);
                }
            }
        }
    }
}

/// envoyproxy/ratelimit's near-limit threshold: the limit times the ratio, in 32-bit floats as
/// that project computes it, rounded down.
fn near_threshold(limit: u64, ratio: f64) -> u64 {
    ((limit as f32) * (ratio as f32)).floor() as u64
}

/// The per-rule series, read once per scrape and written under sluice's names here, and under
/// envoyproxy/ratelimit's through `StatsdSeries`.
#[derive(Debug)]
pub(super) struct RuleSnapshot(Vec<RuleValues>);

#[derive(Debug)]
struct RuleValues {
    domain: Arc<str>,
    descriptor: Arc<str>,
    mapped: Vec<Option<Series>>,
    values: [u64; 6],
}

/// Each per-rule stat: envoyproxy/ratelimit's name, sluice's, and its help.
pub(super) const RULE_STATS: [(&str, &str, &str); 6] = [
    (
        "total_hits",
        "sluice_rule_hits",
        "Hits counted against the rule.",
    ),
    (
        "over_limit",
        "sluice_rule_over_limit",
        "Hits over the rule's limit (shadow-mode and local-cache ones included).",
    ),
    (
        "near_limit",
        "sluice_rule_near_limit",
        "Hits within the limit past --near-limit-ratio of it.",
    ),
    (
        "within_limit",
        "sluice_rule_within_limit",
        "Hits within the rule's limit.",
    ),
    (
        "shadow_mode",
        "sluice_rule_shadow_mode",
        "Hits over a shadow-mode limit, answered OK.",
    ),
    (
        "over_limit_with_local_cache",
        "sluice_rule_over_limit_with_local_cache",
        "Hits denied from the local over-limit cache, without a store call.",
    ),
];

impl RuleSnapshot {
    /// Each rule's domain, descriptor and values, in `RULE_STATS` order.
    pub(super) fn values(&self) -> impl Iterator<Item = (&str, &str, [u64; 6])> {
        self.0
            .iter()
            .map(|rule| (&*rule.domain, &*rule.descriptor, rule.values))
    }

    /// Each stat the mapping names, with its value, rule by rule.
    pub(super) fn mapped(&self) -> impl Iterator<Item = (&Series, u64)> {
        self.0.iter().flat_map(|rule| {
            rule.mapped
                .iter()
                .zip(rule.values)
                .filter_map(|(series, value)| Some((series.as_ref()?, value)))
        })
    }
}

impl Collector for RuleSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (i, (_, name, help)) in RULE_STATS.iter().enumerate() {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for rule in &self.0 {
                let labels = [("domain", &*rule.domain), ("descriptor", &*rule.descriptor)];
                family
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&rule.values[i], None)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_counted_as_envoy_ratelimit_counts_them() {
        let s = RuleStats::new("d".into(), "k", None, TopCell::default());
        s.count(3, Outcome::Within { limit: 10, used: 9 }, 0.8);
        let refused = Outcome::Over {
            limit: 10,
            charged_from: None,
            shadow: false,
            from_cache: true,
        };
        s.count(2, refused, 0.8);
        let shadow = Outcome::Over {
            limit: 10,
            charged_from: None,
            shadow: true,
            from_cache: false,
        };
        s.count(1, shadow, 0.8);
        let [total, over, near, within, shadow, cached] = s.values();
        assert_eq!((total, over, within, shadow, cached), (6, 3, 3, 1, 2));
        assert_eq!(near, 1, "only the hit past 8 of 10 is near");
    }

    #[test]
    fn a_charge_over_the_limit_splits_as_check_over_limit_threshold() {
        let s = RuleStats::new("d".into(), "k", None, TopCell::default());
        let charged = |before| Outcome::Over {
            limit: 10,
            charged_from: Some(before),
            shadow: true,
            from_cache: false,
        };
        // 7 + 5 = 12: 2 over, 10 - max(8, 7) = 2 near, none within.
        s.count(5, charged(7), 0.8);
        let [total, over, near, within, shadow, _] = s.values();
        assert_eq!((total, over, near, within, shadow), (5, 2, 2, 0, 2));
        // Already at the limit: all over; a check of 0 hits counts nothing.
        s.count(4, charged(10), 0.8);
        s.count(0, charged(10), 0.8);
        let [total, over, near, _, shadow, _] = s.values();
        assert_eq!((total, over, near, shadow), (9, 6, 2, 6));
    }
}
