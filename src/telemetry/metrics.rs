//! Prometheus metrics: one process-wide set (`METRICS`), moved on the request path with atomics
//! and written by `/metrics` in the OpenMetrics text format. Every series has a sluice name;
//! beside them, at scrape time, the statsd stats envoyproxy/ratelimit would emit for the same
//! decisions go through its statsd_exporter mapping (`mapper`, `--prometheus-mapper`), so that its
//! dashboards and alerts keep working.
//!
//! Per-rule counters are bounded by the rule files: one series per rule, plus, for rules with
//! `detailed_metric` or `value_to_metric`, one per request value, at most `DETAILED_SERIES` in all.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::mapper::{Kind, Mapper, Series};

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
/// A quota bucket rule's series: its domain and rule path.
pub type QuotaLabels = [(&'static str, String); 2];
/// The same, with the assignment sent.
type ActionLabels = [(&'static str, String); 3];

/// The name of the quota bucket rule of buckets no rule matches, in metrics.
pub const UNMATCHED_RULE: &str = "(none)";
/// The name, in quota metrics, of every domain no rule file declares.
pub const UNKNOWN_DOMAIN: &str = "(unknown)";

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    /// Time to answer one ShouldRateLimit call, decoded request to encoded answer.
    pub request_seconds: Histogram,
    /// The same in whole milliseconds, envoyproxy/ratelimit's `response_time` timer (and, counted,
    /// its `total_requests`).
    pub response_times: ResponseTimes,
    /// Time the store took to decide one request (queueing for a Redis call included).
    pub store_call_seconds: Histogram,
    /// Requests per Redis script call.
    pub batch_requests: Histogram,
    store_errors: Family<Labels, Counter>,
    redis_errors: Counter,
    /// Requests refused as invalid (envoyproxy/ratelimit's `service_error`).
    pub service_errors: Counter,
    policy_answers: Family<Labels, Counter>,
    reloads: Family<Labels, Counter>,
    loads_ok: Counter,
    loads_failed: Counter,
    /// Requests for a domain no rule file declares.
    pub unknown_domain: Counter,
    /// Requests over a limit answered OK only because of `--shadow-mode`.
    pub global_shadow_mode: Counter,
    loaded_at: Gauge<f64, AtomicU64>,
    rules_hash: Mutex<String>,
    rules: Mutex<RuleSeries>,
    quota_allowed: Family<QuotaLabels, Counter>,
    quota_denied: Family<QuotaLabels, Counter>,
    quota_shadow_denied: Family<QuotaLabels, Counter>,
    quota_actions: Family<ActionLabels, Counter>,
    quota_store_errors: Family<Labels, Counter>,
    memory_refused: Family<Labels, Counter>,
    quota_untracked: Family<Labels, Counter>,
}

pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            request_seconds: Histogram::new(LATENCY_BUCKETS),
            response_times: ResponseTimes::new(),
            store_call_seconds: Histogram::new(LATENCY_BUCKETS),
            batch_requests: Histogram::new(BATCH_BUCKETS),
            store_errors: Family::default(),
            redis_errors: Counter::default(),
            service_errors: Counter::default(),
            policy_answers: Family::default(),
            reloads: Family::default(),
            loads_ok: Counter::default(),
            loads_failed: Counter::default(),
            unknown_domain: Counter::default(),
            global_shadow_mode: Counter::default(),
            loaded_at: Gauge::default(),
            rules_hash: Mutex::default(),
            rules: Mutex::default(),
            quota_allowed: Family::default(),
            quota_denied: Family::default(),
            quota_shadow_denied: Family::default(),
            quota_actions: Family::default(),
            quota_store_errors: Family::default(),
            memory_refused: Family::default(),
            quota_untracked: Family::default(),
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
            "Requests the store could not decide, by kind (full, timeout, shed, down, unavailable; data: a key sluice cannot read)",
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
            "sluice_quota_reported_allowed",
            "Requests Envoys reported letting through, per quota bucket rule",
            m.quota_allowed.clone(),
        );
        r.register(
            "sluice_quota_reported_denied",
            "Requests Envoys reported denying, per quota bucket rule",
            m.quota_denied.clone(),
        );
        r.register(
            "sluice_quota_shadow_denied",
            "Requests a shadow-mode quota bucket rule would have had Envoys deny (estimated from each report)",
            m.quota_shadow_denied.clone(),
        );
        r.register(
            "sluice_quota_assignments",
            "Bucket actions sent to Envoys, per quota bucket rule and action (token_bucket, allow_all, deny_all, abandon)",
            m.quota_actions.clone(),
        );
        r.register(
            "sluice_quota_store_errors",
            "Quota demand records the store could not take, by kind: the bucket kept its last assignment",
            m.quota_store_errors.clone(),
        );
        r.register(
            "sluice_memory_refused_counters",
            "New counters the embedded store refused because their share was full, by share (rule, scheduled): their requests were answered over the limit",
            m.memory_refused.clone(),
        );
        for share in ["rule", "scheduled"] {
            drop(m.memory_refused.get_or_create(&[("share", share)]));
        }
        r.register(
            "sluice_quota_untracked",
            "Bucket reports answered untracked, with the rule's whole limit, by the bound that was full: stream_buckets (the stream's), buckets or streams (the process's)",
            m.quota_untracked.clone(),
        );
        // Every label a counter can take exists from the start, so the first event is an
        // increase a rate or an alert sees.
        for kind in ["full", "timeout", "shed", "down", "unavailable", "data"] {
            drop(m.store_errors.get_or_create(&[("kind", kind)]));
            drop(m.quota_store_errors.get_or_create(&[("kind", kind)]));
        }
        for bound in ["stream_buckets", "buckets", "streams"] {
            drop(m.quota_untracked.get_or_create(&[("bound", bound)]));
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

    /// One quota report of a bucket of the rule `labels`.
    pub fn quota_reported(&self, labels: &QuotaLabels, allowed: u64, denied: u64) {
        self.quota_allowed.get_or_create(labels).inc_by(allowed);
        self.quota_denied.get_or_create(labels).inc_by(denied);
    }

    /// Requests a shadow-mode quota rule would have denied.
    pub fn quota_shadow_denied(&self, labels: &QuotaLabels, denied: u64) {
        self.quota_shadow_denied
            .get_or_create(labels)
            .inc_by(denied);
    }

    /// `n` bucket actions sent for buckets of the rule `labels`.
    pub fn quota_actions(&self, labels: &QuotaLabels, action: &'static str, n: u64) {
        let [domain, rule] = labels.clone();
        self.quota_actions
            .get_or_create(&[domain, rule, ("action", action.to_owned())])
            .inc_by(n);
    }

    /// `n` bucket reports answered untracked because `bound` was full.
    pub fn quota_untracked(&self, bound: &'static str, n: u64) {
        self.quota_untracked
            .get_or_create(&[("bound", bound)])
            .inc_by(n);
    }

    /// A quota demand record the store could not take.
    pub fn quota_store_error(&self, kind: &'static str) {
        self.quota_store_errors
            .get_or_create(&[("kind", kind)])
            .inc();
    }

    /// A new counter the embedded store refused because its `share` (rule, scheduled) was full.
    pub fn memory_refused(&self, share: &'static str) {
        self.memory_refused.get_or_create(&[("share", share)]).inc();
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

    /// envoyproxy/ratelimit's statsd stats for what sluice counted, through the mapping in
    /// force: the per-rule counters of `rules` (every one written, 0 included, when a mapping
    /// names it; an unmapped one once it counts, as statsd_exporter sees a stat only once it
    /// moves), the service's counters and the response-time timer.
    fn statsd(&self, rules: &RuleSnapshot) -> StatsdSeries {
        let mut out = StatsdSeries::default();
        for rule in &rules.0 {
            for (series, value) in rule.mapped.iter().zip(rule.values) {
                if let Some(series) = series {
                    out.counter(series, value);
                }
            }
        }
        let m = mapper();
        let counters = [
            ("ratelimit.service.config_load_success", &self.loads_ok),
            ("ratelimit.service.config_load_error", &self.loads_failed),
            (
                "ratelimit.service.call.should_rate_limit.redis_error",
                &self.redis_errors,
            ),
            (
                "ratelimit.service.call.should_rate_limit.service_error",
                &self.service_errors,
            ),
            (
                "ratelimit.service.global_shadow_mode",
                &self.global_shadow_mode,
            ),
        ];
        for (name, counter) in counters {
            if let Some(series) = m.map(name, Kind::Counter) {
                out.counter(&series, counter.get());
            }
        }
        let times = self.response_times.seen();
        let calls = times.iter().map(|(_, n)| n).sum();
        let method = "ratelimit_server.ShouldRateLimit";
        if let Some(series) = m.map(&format!("{method}.total_requests"), Kind::Counter) {
            out.counter(&series, calls);
        }
        if let Some(series) = m.map(&format!("{method}.response_time"), Kind::Observer) {
            out.observations(&series, &times);
        }
        out
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
        let snapshot = RuleSnapshot::take(self);
        rules.register_collector(Box::new(self.statsd(&snapshot)));
        rules.register_collector(Box::new(snapshot));
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

/// The mapping of envoyproxy/ratelimit's statsd names in force: `use_mapper`'s, else that
/// project's built-in one.
static MAPPER: OnceLock<Mapper> = OnceLock::new();

/// Names envoyproxy/ratelimit's series through `mapper` from now on; only the first call counts
/// (`serve` makes it once, at start, before any scrape).
pub fn use_mapper(mapper: Mapper) {
    let _ = MAPPER.set(mapper);
}

fn mapper() -> &'static Mapper {
    MAPPER.get_or_init(Mapper::erl_default)
}

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
    fn new() -> Self {
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
    fn seen(&self) -> Vec<(u64, u64)> {
        let mut seen: Vec<(u64, u64)> = (0..FAST_MS as u64)
            .map(|ms| (ms, self.fast[ms as usize].load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect();
        seen.extend(lock(&self.slow).iter().map(|(ms, n)| (*ms, *n)));
        seen
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
    /// What its stats are named through the mapping (`None`: dropped), worked out at the first
    /// scrape.
    mapped: OnceLock<Vec<Option<Series>>>,
}

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
            mapped: OnceLock::new(),
        }
    }

    /// Counts `hits` of one decided descriptor as envoyproxy/ratelimit does: a near-limit hit is
    /// one past `near_ratio` of the limit; a shadow-mode hit over the limit is also an
    /// `over_limit` hit. Hits charged over the limit split as that project's
    /// `checkOverLimitThreshold` splits them: those past the limit are over, those below it
    /// and past the near threshold near, none within. Refused hits are all over.
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

    /// What the mapping names each of its stats: envoyproxy/ratelimit's statsd name is
    /// `ratelimit.service.rate_limit.<domain>.<descriptor>.<stat>`, the key sanitized.
    fn mapped(&self) -> &[Option<Series>] {
        self.mapped.get_or_init(|| {
            let key = sanitize(&format!("{}.{}", self.domain, self.descriptor));
            RULE_STATS
                .iter()
                .map(|(stat, _, _)| {
                    mapper().map(
                        &format!("ratelimit.service.rate_limit.{key}.{stat}"),
                        Kind::Counter,
                    )
                })
                .collect()
        })
    }
}

/// envoyproxy/ratelimit's near-limit threshold: the limit times the ratio, in 32-bit floats as
/// that project computes it, rounded down.
fn near_threshold(limit: u64, ratio: f64) -> u64 {
    ((limit as f32) * (ratio as f32)).floor() as u64
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

/// The per-rule series, read once per scrape and written under sluice's names here, and under
/// envoyproxy/ratelimit's through `StatsdSeries`.
#[derive(Debug)]
struct RuleSnapshot(Vec<RuleValues>);

#[derive(Debug)]
struct RuleValues {
    domain: String,
    descriptor: String,
    mapped: Vec<Option<Series>>,
    values: [u64; 6],
}

/// Each per-rule stat: envoyproxy/ratelimit's name, sluice's, and its help.
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
                mapped: s.mapped().to_vec(),
                values: s.values(),
            })
            .collect();
        rules.sort_by(|a, b| (&a.domain, &a.descriptor).cmp(&(&b.domain, &b.descriptor)));
        RuleSnapshot(rules)
    }
}

impl Collector for RuleSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (i, (_, name, help)) in RULE_STATS.iter().enumerate() {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
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
        Ok(())
    }
}

/// envoyproxy/ratelimit's series as its mapping names them, gathered at scrape time: counters
/// of equal name and labels add up, as statsd_exporter adds them; a name already taken by a
/// series of the other type keeps its first one (statsd_exporter's conflict).
#[derive(Debug, Default)]
struct StatsdSeries(BTreeMap<String, StatsdFamily>);

#[derive(Debug)]
struct StatsdFamily {
    help: String,
    values: StatsdValues,
}

type LabelPairs = Vec<(String, String)>;

#[derive(Debug)]
enum StatsdValues {
    Counters(BTreeMap<LabelPairs, u64>),
    Histograms(BTreeMap<LabelPairs, Observed>),
}

/// A histogram: per-bucket (not cumulative) counts, the last one past every bound.
#[derive(Debug)]
struct Observed {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
}

/// statsd_exporter's help for a mapping that gives none.
const DEFAULT_HELP: &str = "Metric autogenerated by statsd_exporter.";

impl StatsdSeries {
    fn family(&mut self, series: &Series, values: StatsdValues) -> &mut StatsdFamily {
        self.0
            .entry(series.name.clone())
            .or_insert_with(|| StatsdFamily {
                help: series.help.clone().unwrap_or_else(|| DEFAULT_HELP.into()),
                values,
            })
    }

    fn counter(&mut self, series: &Series, value: u64) {
        if value == 0 && !series.mapped {
            return;
        }
        let family = self.family(series, StatsdValues::Counters(BTreeMap::new()));
        if let StatsdValues::Counters(c) = &mut family.values {
            *c.entry(series.labels.clone()).or_default() += value;
        }
    }

    /// Observations of `(value, times)` in whole milliseconds, scaled as `series` says.
    fn observations(&mut self, series: &Series, seen: &[(u64, u64)]) {
        if seen.is_empty() && !series.mapped {
            return;
        }
        let family = self.family(series, StatsdValues::Histograms(BTreeMap::new()));
        let StatsdValues::Histograms(h) = &mut family.values else {
            return;
        };
        let bounds = &series.buckets;
        let observed = h.entry(series.labels.clone()).or_insert_with(|| Observed {
            bounds: bounds.clone(),
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        });
        if observed.bounds != *bounds {
            return;
        }
        for &(ms, times) in seen {
            let value = ms as f64 * series.scale.unwrap_or(1.0);
            let bucket = bounds.partition_point(|b| *b < value);
            observed.counts[bucket] += times;
            observed.sum += value * times as f64;
        }
    }
}

impl Collector for StatsdSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, family) in &self.0 {
            match &family.values {
                // Untyped, so that a counter keeps its name (a typed one gains `_total`).
                StatsdValues::Counters(series) => {
                    let mut f =
                        encoder.encode_descriptor(name, &family.help, None, MetricType::Unknown)?;
                    for (labels, value) in series {
                        f.encode_family(labels)?.encode_gauge(value)?;
                    }
                }
                StatsdValues::Histograms(series) => {
                    let mut f = encoder.encode_descriptor(
                        name,
                        &family.help,
                        None,
                        MetricType::Histogram,
                    )?;
                    for (labels, h) in series {
                        let buckets: Vec<(f64, u64)> = h
                            .bounds
                            .iter()
                            .copied()
                            .chain([f64::INFINITY])
                            .zip(h.counts.iter().copied())
                            .collect();
                        let count = h.counts.iter().sum();
                        f.encode_family(labels)?
                            .encode_histogram::<NoLabelSet>(h.sum, count, &buckets, None)?;
                    }
                }
            }
        }
        Ok(())
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
    fn hits_are_counted_as_envoy_ratelimit_counts_them() {
        let s = RuleStats::new("d", "k", None);
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
        let s = RuleStats::new("d", "k", None);
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

    #[test]
    fn response_times_keep_every_whole_millisecond() {
        let t = ResponseTimes::new();
        for ms in [0, 0, 3, 5000] {
            t.observe(Duration::from_micros(ms * 1000 + 999));
        }
        assert_eq!(t.seen(), [(0, 2), (3, 1), (5000, 1)]);
    }

    #[test]
    fn observations_fall_in_the_buckets_of_the_mapping_scaled() {
        let mut out = StatsdSeries::default();
        let series = Series {
            name: "t".into(),
            labels: Vec::new(),
            mapped: true,
            buckets: vec![0.005, 1.0],
            scale: Some(0.001),
            help: None,
        };
        out.observations(&series, &[(0, 2), (5, 1), (7, 1), (2000, 1)]);
        let StatsdValues::Histograms(h) = &out.0["t"].values else {
            panic!("a histogram");
        };
        let h = &h[&Vec::new()];
        assert_eq!(h.counts, [3, 1, 1], "le is inclusive: 5 ms is in 0.005");
        assert!((h.sum - 2.012).abs() < 1e-9);
    }
}
