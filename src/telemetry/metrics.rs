//! Prometheus metrics: one process-wide set (`METRICS`), moved on the request path with atomics
//! and written by `/metrics` in the OpenMetrics text format. Every series has a sluice name; the
//! series envoyproxy/ratelimit exports through its statsd mapping are written beside them under
//! that project's names and labels, so its dashboards and alerts keep working.
//!
//! Per-rule counters are bounded by the rule files: one series per rule, plus, for rules with
//! `detailed_metric` or `value_to_metric`, one per request value, at most `DETAILED_SERIES` in all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

/// Most series made from request values (`detailed_metric`, `value_to_metric`); past it, such
/// hits count under their rule's own series.
pub const DETAILED_SERIES: usize = 10_000;

/// Bounds (seconds) of the latency histograms: a decision takes tens of microseconds on the
/// embedded store and a Redis round trip on Redis; `--store-timeout` is 10 ms by default.
const LATENCY_BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];
/// Bounds of the requests-per-Redis-call histogram (the batch limit is 256 counters per call).
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

type Labels = [(&'static str, &'static str); 1];

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    /// Time to answer one ShouldRateLimit call, decoded request to encoded answer.
    pub request_seconds: Histogram,
    /// ShouldRateLimit calls answered (envoyproxy/ratelimit's `total_requests`).
    pub requests: Untyped,
    /// Time the store took to decide one request (queueing for a Redis call included).
    pub store_call_seconds: Histogram,
    /// Requests per Redis script call.
    pub batch_requests: Histogram,
    store_errors: Family<Labels, Counter>,
    redis_errors: Untyped,
    policy_answers: Family<Labels, Counter>,
    reloads: Family<Labels, Counter>,
    loads_ok: Untyped,
    loads_failed: Untyped,
    /// Requests for a domain no rule file declares.
    pub unknown_domain: Counter,
    /// Requests over a limit answered OK only because of `--shadow-mode`.
    pub global_shadow_mode: Untyped,
    loaded_at: Gauge<f64, AtomicU64>,
    rules_hash: Mutex<String>,
    rules: Mutex<RuleSeries>,
}

pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            request_seconds: Histogram::new(LATENCY_BUCKETS),
            requests: Untyped::default(),
            store_call_seconds: Histogram::new(LATENCY_BUCKETS),
            batch_requests: Histogram::new(BATCH_BUCKETS),
            store_errors: Family::default(),
            redis_errors: Untyped::default(),
            policy_answers: Family::default(),
            reloads: Family::default(),
            loads_ok: Untyped::default(),
            loads_failed: Untyped::default(),
            unknown_domain: Counter::default(),
            global_shadow_mode: Untyped::default(),
            loaded_at: Gauge::default(),
            rules_hash: Mutex::default(),
            rules: Mutex::default(),
        };
        let mut registry = Registry::default();
        let r = &mut registry;
        r.register(
            "sluice_request_duration_seconds",
            "Time to answer one ShouldRateLimit call",
            m.request_seconds.clone(),
        );
        r.register(
            "sluice_store_call_duration_seconds",
            "Time the counter store took to decide one request, queueing included",
            m.store_call_seconds.clone(),
        );
        r.register(
            "sluice_redis_batch_requests",
            "Requests decided by one Redis script call",
            m.batch_requests.clone(),
        );
        r.register(
            "sluice_store_errors",
            "Requests the store could not decide, by kind (full, timeout, shed, down, unavailable)",
            m.store_errors.clone(),
        );
        r.register(
            "sluice_policy_answers",
            "Requests answered by --on-store-error instead of the store, by answer (error, allow, deny)",
            m.policy_answers.clone(),
        );
        r.register(
            "sluice_rule_reloads",
            "Rule reloads, by result (ok, failed)",
            m.reloads.clone(),
        );
        r.register(
            "sluice_unknown_domain_requests",
            "Requests for a domain no rule file declares",
            m.unknown_domain.clone(),
        );
        r.register(
            "sluice_rules_loaded_timestamp_seconds",
            "When the rules in force were loaded (Unix time)",
            m.loaded_at.clone(),
        );
        r.register(
            "ratelimit_service_global_shadow_mode",
            "Requests over a limit answered OK because of --shadow-mode (envoyproxy/ratelimit's name)",
            m.global_shadow_mode.clone(),
        );
        r.register(
            "ratelimit_service_config_load_success",
            "Rule loads that succeeded (envoyproxy/ratelimit's name)",
            m.loads_ok.clone(),
        );
        r.register(
            "ratelimit_service_config_load_error",
            "Rule loads that failed (envoyproxy/ratelimit's name)",
            m.loads_failed.clone(),
        );
        let method = r.sub_registry_with_label(("grpc_method".into(), "ShouldRateLimit".into()));
        method.register(
            "ratelimit_service_total_requests",
            "ShouldRateLimit calls answered (envoyproxy/ratelimit's name)",
            m.requests.clone(),
        );
        method.register(
            "ratelimit_service_response_time_seconds",
            "Time to answer one ShouldRateLimit call (envoyproxy/ratelimit's name)",
            m.request_seconds.clone(),
        );
        r.sub_registry_with_label(("err_type".into(), "redis_error".into()))
            .register(
                "ratelimit_service_should_rate_limit_error",
                "Calls the counter store could not decide (envoyproxy/ratelimit's name)",
                m.redis_errors.clone(),
            );
        // Every label a counter can take exists from the start, so the first event is an
        // increase a rate or an alert sees.
        for kind in ["full", "timeout", "shed", "down", "unavailable"] {
            drop(m.store_errors.get_or_create(&[("kind", kind)]));
        }
        for answer in ["error", "allow", "deny"] {
            drop(m.policy_answers.get_or_create(&[("answer", answer)]));
        }
        for result in ["ok", "failed"] {
            drop(m.reloads.get_or_create(&[("result", result)]));
        }
        Metrics { registry, ..m }
    }

    /// A request the store could not decide, for a reason of `kind` (see `StoreError::kind`).
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&[("kind", kind)]).inc();
        self.redis_errors.inc();
    }

    /// A request answered by `--on-store-error`, which answered `answer` (error, allow, deny).
    pub fn policy_answer(&self, answer: &'static str) {
        self.policy_answers
            .get_or_create(&[("answer", answer)])
            .inc();
    }

    /// Rules loaded, at start or by a reload, with their hash.
    pub fn rules_loaded(&self, hash: &str, reload: bool) {
        if reload {
            self.reloads.get_or_create(&[("result", "ok")]).inc();
        }
        self.loads_ok.inc();
        *lock(&self.rules_hash) = hash.to_owned();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.loaded_at.set(now.as_secs_f64());
    }

    /// A reload that failed: the rules in force stay.
    pub fn reload_failed(&self) {
        self.reloads.get_or_create(&[("result", "failed")]).inc();
        self.loads_failed.inc();
    }

    /// The counters of the rule `descriptor` (its path, as envoyproxy/ratelimit names it:
    /// `key_value.key…`) in `domain`, shared by every rule set that has it, so that counts
    /// survive a reload.
    pub fn rule(&self, domain: &str, descriptor: &str) -> Arc<RuleStats> {
        lock(&self.rules).get(domain, descriptor, None)
    }

    /// The counters of a series named from request values for the rule `rule`, or `None` once
    /// `DETAILED_SERIES` exist.
    pub fn detailed(&self, domain: &str, name: &str, rule: &str) -> Option<Arc<RuleStats>> {
        let mut rules = lock(&self.rules);
        if rules.detailed >= DETAILED_SERIES && !rules.has(domain, name) {
            return None;
        }
        Some(rules.get(domain, name, Some(rule)))
    }

    /// Forgets the series of rules that `keep` (domain, rule path) no longer has.
    pub fn retain_rules(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut rules = lock(&self.rules);
        rules
            .by_name
            .retain(|_, s| keep(&s.domain, s.rule.as_deref().unwrap_or(&s.descriptor)));
        rules.detailed = rules.by_name.values().filter(|s| s.rule.is_some()).count();
    }

    /// The metrics in the OpenMetrics text format, `extra` (gauges read at scrape time)
    /// included.
    pub fn encode(&self, extra: &Registry) -> Result<String, std::fmt::Error> {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::with_capacity(16 * 1024);
        encode_registry(&mut out, &self.registry)?;
        encode_registry(&mut out, extra)?;
        let mut rules = Registry::default();
        rules.register_collector(Box::new(RuleSnapshot::take(self)));
        rules.register(
            "sluice_rules",
            "The rules in force, by hash",
            Info::new([("hash", lock(&self.rules_hash).clone())]),
        );
        encode_registry(&mut out, &rules)?;
        encode_eof(&mut out)?;
        Ok(out)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The per-rule counters.
#[derive(Default)]
struct RuleSeries {
    by_name: HashMap<(String, String), Arc<RuleStats>>,
    /// How many of them are named from request values.
    detailed: usize,
}

impl RuleSeries {
    fn has(&self, domain: &str, name: &str) -> bool {
        self.by_name
            .contains_key(&(domain.to_owned(), name.to_owned()))
    }

    fn get(&mut self, domain: &str, name: &str, rule: Option<&str>) -> Arc<RuleStats> {
        let key = (domain.to_owned(), name.to_owned());
        if let Some(s) = self.by_name.get(&key) {
            return s.clone();
        }
        if rule.is_some() {
            self.detailed += 1;
        }
        let s = Arc::new(RuleStats::new(domain, name, rule));
        self.by_name.insert(key, s.clone());
        s
    }
}

/// What envoyproxy/ratelimit counts per rule, in hits (a request's `hits_addend`), not requests.
pub struct RuleStats {
    domain: String,
    descriptor: String,
    /// For a series named from request values, the path of the rule it belongs to.
    rule: Option<String>,
    total_hits: AtomicU64,
    over_limit: AtomicU64,
    near_limit: AtomicU64,
    within_limit: AtomicU64,
    shadow_mode: AtomicU64,
    over_limit_with_local_cache: AtomicU64,
}

/// How one descriptor of a decided request fared.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// Within its limit, with this much of it used once the request is counted.
    Within { limit: u64, used: u64 },
    /// Over its limit; `from_cache`: known from the local over-limit cache.
    Over { from_cache: bool },
    /// Over a shadow-mode limit: reported, not denied.
    Shadow,
}

impl RuleStats {
    fn new(domain: &str, descriptor: &str, rule: Option<&str>) -> Self {
        RuleStats {
            domain: domain.to_owned(),
            descriptor: descriptor.to_owned(),
            rule: rule.map(str::to_owned),
            total_hits: AtomicU64::new(0),
            over_limit: AtomicU64::new(0),
            near_limit: AtomicU64::new(0),
            within_limit: AtomicU64::new(0),
            shadow_mode: AtomicU64::new(0),
            over_limit_with_local_cache: AtomicU64::new(0),
        }
    }

    /// Counts `hits` of one decided descriptor as envoyproxy/ratelimit does: a shadow-mode hit
    /// over the limit is also an `over_limit` hit; a near-limit hit is one past `near_ratio` of
    /// the limit.
    pub fn count(&self, hits: u64, outcome: Outcome, near_ratio: f64) {
        let add = |c: &AtomicU64, n: u64| {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        };
        add(&self.total_hits, hits);
        match outcome {
            Outcome::Within { limit, used } => {
                add(&self.within_limit, hits);
                let threshold = (limit as f64 * near_ratio).floor() as u64;
                add(&self.near_limit, used.saturating_sub(threshold).min(hits));
            }
            Outcome::Over { from_cache } => {
                add(&self.over_limit, hits);
                if from_cache {
                    add(&self.over_limit_with_local_cache, hits);
                }
            }
            Outcome::Shadow => {
                add(&self.over_limit, hits);
                add(&self.shadow_mode, hits);
            }
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

    /// envoyproxy/ratelimit's labels for this series: its statsd name `domain.descriptor`
    /// (sanitized) split at dots into `domain`, `key1` and `key2`, deeper parts dropped.
    fn compatible_labels(&self) -> Vec<(&'static str, String)> {
        let name = sanitize(&format!("{}.{}", self.domain, self.descriptor));
        let mut parts = name.splitn(4, '.');
        let mut labels = Vec::with_capacity(3);
        for label in ["domain", "key1", "key2"] {
            if let Some(part) = parts.next() {
                labels.push((label, part.to_owned()));
            }
        }
        labels
    }
}

/// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` become `_`, and so do the dots of
/// IPv4 addresses.
fn sanitize(name: &str) -> String {
    let name = name.replace([':', '|'], "_");
    let bytes = name.as_bytes();
    let mut out = String::with_capacity(name.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = ipv4_at(&bytes[i..]) {
            out.push_str(&name[i..i + len].replace('.', "_"));
            i += len;
        } else {
            let c = name[i..].chars().next().expect("i is on a char boundary");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of the IPv4 address (four dot-separated runs of 1 to 3 digits) that `s` starts
/// with, if any.
fn ipv4_at(s: &[u8]) -> Option<usize> {
    let mut at = 0;
    for part in 0..4 {
        if part > 0 {
            if s.get(at) != Some(&b'.') {
                return None;
            }
            at += 1;
        }
        let digits = s[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if !(1..=3).contains(&digits) {
            return None;
        }
        at += digits;
    }
    Some(at)
}

/// The per-rule series, read once per scrape and written under sluice's names and, added up as
/// its statsd mapping merges them, under envoyproxy/ratelimit's.
#[derive(Debug)]
struct RuleSnapshot(Vec<RuleValues>);

#[derive(Debug)]
struct RuleValues {
    domain: String,
    descriptor: String,
    compatible: Vec<(&'static str, String)>,
    values: [u64; 6],
}

const RULE_STATS: [(&str, &str, &str); 6] = [
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
    fn take(m: &Metrics) -> Self {
        let mut rules: Vec<RuleValues> = lock(&m.rules)
            .by_name
            .values()
            .map(|s| RuleValues {
                domain: s.domain.clone(),
                descriptor: s.descriptor.clone(),
                compatible: s.compatible_labels(),
                values: s.values(),
            })
            .collect();
        rules.sort_by(|a, b| (&a.domain, &a.descriptor).cmp(&(&b.domain, &b.descriptor)));
        RuleSnapshot(rules)
    }
}

impl Collector for RuleSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (i, (stat, name, help)) in RULE_STATS.iter().enumerate() {
            {
                let mut family =
                    encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                for rule in &self.0 {
                    let labels = [
                        ("domain", rule.domain.as_str()),
                        ("descriptor", rule.descriptor.as_str()),
                    ];
                    family
                        .encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&rule.values[i], None)?;
                }
            }
            // envoyproxy/ratelimit's mapping has no local-cache series.
            if *stat == "over_limit_with_local_cache" {
                continue;
            }
            let mut merged: Vec<(&Vec<(&'static str, String)>, u64)> = Vec::new();
            for rule in &self.0 {
                match merged.iter_mut().find(|(l, _)| **l == rule.compatible) {
                    Some((_, v)) => *v += rule.values[i],
                    None => merged.push((&rule.compatible, rule.values[i])),
                }
            }
            let name = format!("ratelimit_service_rate_limit_{stat}");
            let mut family = encoder.encode_descriptor(
                &name,
                "envoyproxy/ratelimit's name for the rule counter of the same stat.",
                None,
                MetricType::Unknown,
            )?;
            for (labels, value) in merged {
                family.encode_family(labels)?.encode_gauge(&value)?;
            }
        }
        Ok(())
    }
}

/// A counter written as an untyped sample under its own name, as envoyproxy/ratelimit's
/// Prometheus names have it (a typed counter would gain a `_total` suffix).
#[derive(Debug, Clone, Default)]
pub struct Untyped(Counter);

impl Untyped {
    pub fn inc(&self) {
        self.0.inc();
    }
}

impl EncodeMetric for Untyped {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        encoder.encode_gauge(&self.0.get())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_names_are_sanitized_as_envoy_ratelimit_does() {
        assert_eq!(
            sanitize("d.remote_address_10.0.0.1"),
            "d.remote_address_10_0_0_1"
        );
        assert_eq!(sanitize("d.k_a:b|c"), "d.k_a_b_c");
        assert_eq!(
            sanitize("d.v_1.2.3"),
            "d.v_1.2.3",
            "three parts are no address"
        );
    }

    #[test]
    fn compatible_labels_keep_two_levels() {
        let s = RuleStats::new("d", "a_1.b.c_2", None);
        assert_eq!(
            s.compatible_labels(),
            [
                ("domain", "d".to_owned()),
                ("key1", "a_1".to_owned()),
                ("key2", "b".to_owned())
            ]
        );
        let s = RuleStats::new("d", "a", None);
        assert_eq!(s.compatible_labels().len(), 2);
    }

    #[test]
    fn hits_are_counted_as_envoy_ratelimit_counts_them() {
        let s = RuleStats::new("d", "k", None);
        s.count(3, Outcome::Within { limit: 10, used: 9 }, 0.8);
        s.count(2, Outcome::Over { from_cache: true }, 0.8);
        s.count(1, Outcome::Shadow, 0.8);
        let [total, over, near, within, shadow, cached] = s.values();
        assert_eq!((total, over, within, shadow, cached), (6, 3, 3, 1, 2));
        assert_eq!(near, 1, "only the hit past 8 of 10 is near");
    }
}
