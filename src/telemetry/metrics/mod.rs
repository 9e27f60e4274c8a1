//! Prometheus metrics: one set per `Telemetry` handle (one per process), moved on the request path with atomics
//! and written by `/metrics` in the OpenMetrics text format. Here: the registry and the service's
//! own series (latencies, store errors, policy answers, reloads, quota). Beside it:
//!
//! - `rules`: per-rule series and their cap; each decided descriptor is counted there, where a
//!   view of who is being limited would be fed too.
//! - `statsd`: the stats envoyproxy/ratelimit would emit for the same decisions, rendered at
//!   scrape time through its statsd_exporter mapping (`--prometheus-mapper`) so that its
//!   dashboards and alerts keep working; a statsd push over UDP would read them there.
//! - `response_times`: the summary behind that project's `response_time` timer.

mod response_times;
mod rules;
mod statsd;

pub use response_times::ResponseTimes;
pub use rules::RuleStats;
pub(crate) use rules::TopCell;
pub use statsd::{RESPONSE_TIME, StatsdTotals};

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::telemetry::mapper::Mapper;
use rules::RuleSeries;
use statsd::StatsdSeries;

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
    store_unreachable: Family<Labels, Counter>,
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
    holds: Family<ActionLabels, Counter>,
    holds_expired: Family<QuotaLabels, Counter>,
    quota_store_errors: Family<Labels, Counter>,
    memory_refused: Family<Labels, Counter>,
    quota_untracked: Family<Labels, Counter>,
    /// Bucket reports that waited their turn past `--quota-max-reports`.
    pub quota_paced: Counter,
    trace_spans: Family<Labels, Counter>,
    counter_changes: Family<Labels, Counter>,
    admin_refused: Family<Labels, Counter>,
    /// The mapping of envoyproxy/ratelimit's statsd names in force: `use_mapper`'s, else that
    /// project's built-in one.
    mapper: OnceLock<Mapper>,
    /// The top view, once started, which the rules' counters feed.
    top: TopCell,
}

/// Why Redis could not be reached, as `sluice_store_unreachable_total` counts it.
pub const UNREACHABLE: [&str; 9] = [
    "refused",
    "timeout",
    "tls",
    "auth",
    "readonly",
    "loading",
    "unknown_command",
    "io",
    "other",
];

/// Why the store could not decide, as `sluice_store_errors` (and the quota service's) count it.
const STORE_ERRORS: [&str; 9] = [
    "full",
    "timeout",
    "shed",
    "down",
    "unavailable",
    "data",
    "redirected",
    "skewed",
    "unconfirmed",
];

/// Registers `family` as `name`, with every value of its `label` among `values` made at once:
/// the first event is then an increase a rate or an alert sees.
fn labelled(
    r: &mut Registry,
    name: &str,
    help: &str,
    family: &Family<Labels, Counter>,
    label: &'static str,
    values: &[&'static str],
) {
    r.register(name, help, family.clone());
    for &value in values {
        drop(family.get_or_create(&[(label, value)]));
    }
}

impl Metrics {
    /// The metrics of a process whose rules' counters feed `top`, once it is started.
    pub(super) fn new(top: TopCell) -> Self {
        let m = Metrics {
            registry: Registry::default(),
            request_seconds: Histogram::new(LATENCY_BUCKETS),
            response_times: ResponseTimes::new(),
            store_call_seconds: Histogram::new(LATENCY_BUCKETS),
            batch_requests: Histogram::new(BATCH_BUCKETS),
            store_errors: Family::default(),
            store_unreachable: Family::default(),
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
            holds: Family::default(),
            holds_expired: Family::default(),
            quota_store_errors: Family::default(),
            memory_refused: Family::default(),
            quota_untracked: Family::default(),
            quota_paced: Counter::default(),
            trace_spans: Family::default(),
            counter_changes: Family::default(),
            admin_refused: Family::default(),
            mapper: OnceLock::new(),
            top,
        };
        let mut registry = Registry::default();
        m.register_requests(&mut registry);
        m.register_store(&mut registry);
        m.register_rules(&mut registry);
        m.register_quota(&mut registry);
        m.register_operations(&mut registry);
        Metrics { registry, ..m }
    }

    /// The requests' metrics: their time, the invalid ones', the policy's answers.
    fn register_requests(&self, r: &mut Registry) {
        r.register(
            "sluice_request_duration_seconds",
            "Time to answer one ShouldRateLimit call",
            self.request_seconds.clone(),
        );
        r.register(
            "sluice_unknown_domain_requests",
            "Requests for a domain no rule file declares",
            self.unknown_domain.clone(),
        );
        labelled(
            r,
            "sluice_policy_answers",
            "Requests answered by --on-store-error instead of the store, by answer (error, allow, deny)",
            &self.policy_answers,
            "answer",
            &["error", "allow", "deny"],
        );
    }

    /// The counter store's metrics: its calls, its errors, Redis out of reach, the embedded
    /// store's refusals.
    fn register_store(&self, r: &mut Registry) {
        r.register(
            "sluice_store_call_duration_seconds",
            "Time the counter store took to decide one request, queueing included",
            self.store_call_seconds.clone(),
        );
        r.register(
            "sluice_redis_batch_requests",
            "Requests decided by one Redis script call",
            self.batch_requests.clone(),
        );
        labelled(
            r,
            "sluice_store_errors",
            "Requests the store could not decide, by kind (full, timeout, shed, down, unavailable; data: a key sluice cannot read; redirected: a Cluster slot moving; skewed: a calendar window this replica's clock cannot place; unconfirmed)",
            &self.store_errors,
            "kind",
            &STORE_ERRORS,
        );
        labelled(
            r,
            "sluice_store_unreachable",
            "Failures to reach Redis (a connection not made, or refusing sluice's commands) seen by each of sluice's Redis clients, by cause: refused, timeout, tls, auth, readonly, loading, unknown_command, io, other",
            &self.store_unreachable,
            "kind",
            &UNREACHABLE,
        );
        labelled(
            r,
            "sluice_memory_refused_counters",
            "New counters the embedded store refused because their share was full, by share (rule, scheduled): their requests were answered over the limit",
            &self.memory_refused,
            "share",
            &["rule", "scheduled"],
        );
    }

    /// The rules' metrics: reloads, when the rules in force were loaded, the held rules' calls.
    fn register_rules(&self, r: &mut Registry) {
        labelled(
            r,
            "sluice_rule_reloads",
            "Rule reloads, by result (ok, failed)",
            &self.reloads,
            "result",
            &["ok", "failed"],
        );
        r.register(
            "sluice_rules_loaded_timestamp_seconds",
            "When the rules in force were loaded (Unix time)",
            self.loaded_at.clone(),
        );
        r.register(
            "sluice_holds",
            "Calls on held counters, per rule and outcome: held (a hold taken), denied (the hold did not fit, or the request was denied), settle (a hold settled), unheld (a settle that found no hold of its request, charged in full), reused (a request-time call naming a request the counter knows, refused), full (the counter's table was full of holds)",
            self.holds.clone(),
        );
        r.register(
            "sluice_holds_expired",
            "Holds found expired unsettled, per rule: released, or charged their estimate as the rule says",
            self.holds_expired.clone(),
        );
    }

    /// The quota service's metrics: what Envoys report, the assignments sent, its bounds.
    fn register_quota(&self, r: &mut Registry) {
        r.register(
            "sluice_quota_reported_allowed",
            "Requests Envoys reported letting through, per quota bucket rule",
            self.quota_allowed.clone(),
        );
        r.register(
            "sluice_quota_reported_denied",
            "Requests Envoys reported denying, per quota bucket rule",
            self.quota_denied.clone(),
        );
        r.register(
            "sluice_quota_shadow_denied",
            "Requests a shadow-mode quota bucket rule would have had Envoys deny (estimated from each report)",
            self.quota_shadow_denied.clone(),
        );
        r.register(
            "sluice_quota_assignments",
            "Bucket actions sent to Envoys, per quota bucket rule and action (token_bucket, allow_all, deny_all, abandon)",
            self.quota_actions.clone(),
        );
        labelled(
            r,
            "sluice_quota_store_errors",
            "Quota demand records the store could not take, by kind: the bucket kept its last assignment",
            &self.quota_store_errors,
            "kind",
            &STORE_ERRORS,
        );
        labelled(
            r,
            "sluice_quota_untracked",
            "Bucket reports answered untracked, with the rule's whole limit, by the bound that was full: stream_buckets (the stream's), buckets or streams (the process's)",
            &self.quota_untracked,
            "bound",
            &["stream_buckets", "buckets", "streams"],
        );
        r.register(
            "sluice_quota_paced_reports",
            "Bucket reports a quota stream waited to take, past --quota-max-reports a second: its Envoy's next reports waited with it",
            self.quota_paced.clone(),
        );
    }

    /// What operating the process counts: traces exported, counters changed by hand, admin
    /// requests refused.
    fn register_operations(&self, r: &mut Registry) {
        r.register(
            "sluice_trace_spans",
            "Trace spans, by outcome: exported, dropped (the export queue was full), failed (the collector did not take them)",
            self.trace_spans.clone(),
        );
        labelled(
            r,
            "sluice_counter_changes",
            "Counters changed through the admin API (/counters), by action: reset, set, add",
            &self.counter_changes,
            "action",
            &["reset", "set", "add"],
        );
        labelled(
            r,
            "sluice_admin_refused",
            "Admin requests refused, by reason: token (without the admin token or with a wrong one), cooling (a peer refused less than a second before), untrusted (a change through /counters without the token on a port not declared trusted)",
            &self.admin_refused,
            "reason",
            &["token", "cooling", "untrusted"],
        );
    }

    /// `n` counters changed through `/counters` by `action`.
    pub fn counter_changes(&self, action: &'static str, n: u64) {
        self.counter_changes
            .get_or_create(&[("action", action)])
            .inc_by(n);
    }

    /// An admin request refused for `reason`.
    pub fn admin_refused(&self, reason: &'static str) {
        self.admin_refused
            .get_or_create(&[("reason", reason)])
            .inc();
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

    /// A call on a held counter of the rule `labels` that did `outcome`, finding `expired`
    /// holds expired.
    pub fn holds(&self, labels: &QuotaLabels, outcome: &'static str, expired: u64) {
        let [domain, rule] = labels.clone();
        self.holds
            .get_or_create(&[domain, rule, ("outcome", outcome.to_owned())])
            .inc();
        if expired > 0 {
            self.holds_expired.get_or_create(labels).inc_by(expired);
        }
    }

    /// `n` bucket reports answered untracked because `bound` was full.
    pub fn quota_untracked(&self, bound: &'static str, n: u64) {
        self.quota_untracked
            .get_or_create(&[("bound", bound)])
            .inc_by(n);
    }

    /// Redis not reached, for a cause of `kind` (one of `UNREACHABLE`).
    pub fn store_unreachable(&self, kind: &'static str) {
        self.store_unreachable
            .get_or_create(&[("kind", kind)])
            .inc();
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

    /// `n` trace spans that ended `outcome` (exported, dropped, failed).
    pub fn trace_spans(&self, outcome: &'static str, n: u64) {
        self.trace_spans
            .get_or_create(&[("outcome", outcome)])
            .inc_by(n);
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
        lock(&self.rules).rule(domain, descriptor, &self.top)
    }

    /// The counters of a series named from request values for the rule `rule`, or `None` once
    /// `DETAILED_SERIES` exist.
    pub fn detailed(&self, domain: &str, name: &str, rule: &str) -> Option<Arc<RuleStats>> {
        lock(&self.rules).detailed(domain, name, rule, &self.top)
    }

    /// Names envoyproxy/ratelimit's series through `mapper` from now on; only the first call
    /// counts (`serve` makes it once, at start, before any scrape).
    pub fn use_mapper(&self, mapper: Mapper) {
        let _ = self.mapper.set(mapper);
    }

    fn mapper(&self) -> &Mapper {
        self.mapper.get_or_init(Mapper::erl_default)
    }

    /// Forgets the series of rules that `keep` (domain, rule path) no longer has.
    pub fn retain_rules(&self, keep: impl Fn(&str, &str) -> bool) {
        lock(&self.rules).retain(keep);
    }

    /// envoyproxy/ratelimit's statsd stats for what was counted, unmapped, for a statsd push.
    pub fn statsd_totals(&self) -> StatsdTotals {
        let snapshot = lock(&self.rules).snapshot(|d, r| statsd::rule_series(self.mapper(), d, r));
        statsd::totals(self, &snapshot)
    }

    /// The metrics in the OpenMetrics text format, `extra` (gauges read at scrape time)
    /// included.
    pub fn encode(&self, extra: &Registry) -> Result<String, std::fmt::Error> {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::with_capacity(16 * 1024);
        encode_registry(&mut out, &self.registry)?;
        encode_registry(&mut out, extra)?;
        let mut rules = Registry::default();
        let snapshot = lock(&self.rules).snapshot(|d, r| statsd::rule_series(self.mapper(), d, r));
        rules.register_collector(Box::new(StatsdSeries::gather(self, &snapshot)));
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
