//! The telemetry handle: what the service tells, as typed events, fanned out to the Prometheus
//! metrics (and the statsd stats rendered from them), the top view and the traces. One is made
//! at the start and handed, cloned, to every part that tells it something; a test makes its own
//! and reads what it was told.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::mapper::Mapper;
use super::metrics::{Metrics, QuotaLabels, TopCell};
use super::top::{Top, TopSettings};
use sluice_core::observe::{Observer, RuleCounters};

/// The process's telemetry. Cheap to clone.
#[derive(Clone)]
pub struct Telemetry(Arc<Parts>);

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("top", &self.top().is_some())
            .finish_non_exhaustive()
    }
}

struct Parts {
    metrics: Metrics,
    top: TopCell,
    /// Spans are opened (`--tracing-endpoint`), once the export has started.
    traced: AtomicBool,
    /// Spans may carry descriptor values (`--tracing-values`), which can be personal data.
    values: AtomicBool,
}

/// How a request the store could not decide was answered (`--on-store-error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyAnswer {
    Error,
    Allow,
    Deny,
}

impl PolicyAnswer {
    pub fn name(self) -> &'static str {
        match self {
            PolicyAnswer::Error => "error",
            PolicyAnswer::Allow => "allow",
            PolicyAnswer::Deny => "deny",
        }
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry::new()
    }
}

impl Telemetry {
    /// Metrics from zero, the top view off until `start_top`.
    pub fn new() -> Self {
        let top = TopCell::default();
        Telemetry(Arc::new(Parts {
            metrics: Metrics::new(top.clone()),
            top,
            traced: AtomicBool::new(false),
            values: AtomicBool::new(false),
        }))
    }

    /// Whether spans are opened at all.
    pub fn tracing(&self) -> bool {
        self.0.traced.load(Ordering::Relaxed)
    }

    /// Whether spans may carry descriptor values (`--tracing-values`).
    pub fn tracing_values(&self) -> bool {
        self.0.values.load(Ordering::Relaxed)
    }

    /// Opens spans from now on, with descriptor values if `values`.
    pub(super) fn trace(&self, values: bool) {
        self.0.values.store(values, Ordering::Relaxed);
        self.0.traced.store(true, Ordering::Relaxed);
    }

    /// Every metric, for `/metrics` and the statsd push.
    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// The top view, once started.
    pub fn top(&self) -> Option<&Top> {
        self.0.top.get()
    }

    /// Starts the top view with `settings`; only the first call counts.
    pub fn start_top(&self, settings: TopSettings) {
        let _ = self.0.top.set(Top::new(settings));
    }

    /// Names envoyproxy/ratelimit's series through `mapper` from now on (see
    /// `Metrics::use_mapper`).
    pub fn use_mapper(&self, mapper: Mapper) {
        self.0.metrics.use_mapper(mapper);
    }

    /// A request refused as invalid.
    pub fn invalid_request(&self) {
        self.0.metrics.service_errors.inc();
    }

    /// A ShouldRateLimit call answered, `took` from its decoded request to its encoded answer.
    pub fn answered(&self, took: Duration) {
        self.0.metrics.request_seconds.observe(took.as_secs_f64());
        self.0.metrics.response_times.observe(took);
    }

    /// A request decided by the store or the local cache.
    pub fn decided(&self) {
        if let Some(view) = self.top() {
            view.decided();
        }
    }

    /// A request over a limit answered OK only because of `--shadow-mode`.
    pub fn shadow_mode_pass(&self) {
        self.0.metrics.global_shadow_mode.inc();
    }

    /// A request the store could not decide (for want of `kind`), answered `answer`.
    pub fn undecided(&self, kind: &'static str, answer: PolicyAnswer) {
        self.0.metrics.store_error(kind);
        self.0.metrics.policy_answer(answer.name());
        if let Some(view) = self.top() {
            view.policy_answer(answer.name());
        }
    }

    /// One store call, which took `took`.
    pub fn store_call(&self, took: Duration) {
        self.0
            .metrics
            .store_call_seconds
            .observe(took.as_secs_f64());
        if let Some(view) = self.top() {
            view.store_call(took);
        }
    }

    /// Rules of `hash` put in force, at the start or by a reload (`reload`).
    pub fn rules_loaded(&self, hash: &str, reload: bool) {
        self.0.metrics.rules_loaded(hash, reload);
    }

    /// A reload that failed: the rules in force stay.
    pub fn reload_failed(&self) {
        self.0.metrics.reload_failed();
    }

    /// Forgets the series and sketches of rules that `keep` (domain, rule path) no longer has.
    pub fn rules_kept(&self, keep: impl Fn(&str, &str) -> bool) {
        self.0.metrics.retain_rules(&keep);
        if let Some(view) = self.top() {
            view.retain(keep);
        }
    }

    /// A quota report of a bucket of `labels`: `allowed` and `denied` requests.
    pub fn quota_reported(&self, labels: &QuotaLabels, allowed: u64, denied: u64) {
        self.0.metrics.quota_reported(labels, allowed, denied);
    }

    /// `n` assignments `action` (`allow_all`, `deny_all`, `token_bucket`) sent for `labels`.
    pub fn quota_actions(&self, labels: &QuotaLabels, action: &'static str, n: u64) {
        self.0.metrics.quota_actions(labels, action, n);
    }

    /// A call on a held counter of the rule `labels` that did `outcome`, finding `expired`
    /// holds expired.
    pub fn holds(&self, labels: &QuotaLabels, outcome: &'static str, expired: u64) {
        self.0.metrics.holds(labels, outcome, expired);
    }

    /// `n` buckets untracked past `bound`.
    pub fn quota_untracked(&self, bound: &'static str, n: u64) {
        self.0.metrics.quota_untracked(bound, n);
    }

    /// `n` requests of a shadow-mode bucket of `labels` that its share would have denied.
    pub fn quota_shadow_denied(&self, labels: &QuotaLabels, n: u64) {
        self.0.metrics.quota_shadow_denied(labels, n);
    }

    /// `n` bucket reports that waited their turn past `--quota-max-reports`.
    pub fn quota_paced(&self, n: u64) {
        self.0.metrics.quota_paced.inc_by(n);
    }

    /// A quota demand record the store could not take, for want of `kind`.
    pub fn quota_store_error(&self, kind: &'static str) {
        self.0.metrics.quota_store_error(kind);
    }

    /// `n` counters changed through `/counters` by `action` (`reset`, `set`, `add`).
    pub fn counter_changes(&self, action: &'static str, n: u64) {
        self.0.metrics.counter_changes(action, n);
    }

    /// An admin request refused for `reason` (`token`, `cooling`, `untrusted`).
    pub fn admin_refused(&self, reason: &'static str) {
        self.0.metrics.admin_refused(reason);
    }

    /// `n` trace spans that ended as `outcome` (`exported`, `dropped`, `failed`).
    pub fn trace_spans(&self, outcome: &'static str, n: u64) {
        self.0.metrics.trace_spans(outcome, n);
    }
}

/// The rules and the stores count into the metrics and, through the rules' counters, the top
/// view.
impl Observer for Telemetry {
    fn rule(&self, domain: &str, path: &str) -> Arc<dyn RuleCounters> {
        self.0.metrics.rule(domain, path)
    }

    fn detailed(&self, domain: &str, name: &str, rule: &str) -> Option<Arc<dyn RuleCounters>> {
        Some(self.0.metrics.detailed(domain, name, rule)?)
    }

    fn unknown_domain(&self) {
        self.0.metrics.unknown_domain.inc();
    }

    fn store_unreachable(&self, kind: &'static str) {
        self.0.metrics.store_unreachable(kind);
    }

    fn memory_refused(&self, share: &'static str) {
        self.0.metrics.memory_refused(share);
    }

    fn batch(&self, requests: usize) {
        self.0.metrics.batch_requests.observe(requests as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_handle_counts_what_it_is_told_and_no_other_does() {
        let (a, b) = (Telemetry::new(), Telemetry::new());
        a.invalid_request();
        a.clone().undecided("timeout", PolicyAnswer::Deny);
        let text = |t: &Telemetry| t.metrics().encode(&Default::default()).expect("encodes");
        assert!(
            text(&a).contains("sluice_policy_answers_total{answer=\"deny\"} 1"),
            "{}",
            text(&a)
        );
        assert!(
            text(&b).contains("sluice_policy_answers_total{answer=\"deny\"} 0"),
            "{}",
            text(&b)
        );
    }
}
