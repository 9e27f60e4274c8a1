//! `envoy.service.ratelimit.v3.RateLimitService`: validates a request, resolves each descriptor's
//! hits, has the rules plan its limits (`rules::plan`), asks the limiter for one all-or-nothing
//! decision and answers with one status per descriptor, in order (with headers and dynamic
//! metadata as configured). When the store cannot decide in time, `--on-store-error` answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::{Instrument, Span};

use super::counted;
use super::decide::Decider;
use super::metadata;
use crate::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit,
};
use crate::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::telemetry::traces;
use crate::telemetry::{PolicyAnswer, Telemetry};
use sluice_core::config::{MOST_DOMAIN_BYTES, domain_too_long};
use sluice_core::limiter::lease::Leasing;
use sluice_core::limiter::{Check, Counting, Decision, Limit, Mode, Source, Unit, Usage, admits};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::rules::RuleSet;
use sluice_core::rules::plan::{Asked, Global, Override, Plan};
use sluice_core::store::unix_ms;
use sluice_core::store::{Deadline, StoreError};

/// Limits on the shape of a request, which Envoy's route configuration decides (not its
/// clients), so that no caller can make a check unboundedly large. Keys and values may be any
/// bytes of any length (the request's size bounds them); the domain, which Envoy's
/// configuration names, is at most `MOST_DOMAIN_BYTES`.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub max_descriptors: usize,
    pub max_entries: usize,
    /// How far ahead of now a request's instant (`/json`'s `"at"`) may lie: every counter it
    /// writes, in Redis or the embedded store, lives at most that and its window.
    pub max_schedule_ahead: Duration,
}

/// Hits above this count as this: more than any limit (at most 4294967295) holds, so such a
/// request is over every limit, and every sum of hits stays exact in both stores.
const MOST_HITS: u64 = u32::MAX as u64 + 1;

/// What a request gets when the store cannot decide it in time (`--on-store-error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStoreError {
    /// gRPC UNAVAILABLE (RESOURCE_EXHAUSTED for a full embedded store): Envoy's
    /// `failure_mode_deny` decides.
    Error,
    /// OK, without a limit in the statuses.
    Allow,
    /// OVER_LIMIT on every limited descriptor (shadow-mode limits excepted).
    Deny,
}

impl From<OnStoreError> for PolicyAnswer {
    fn from(policy: OnStoreError) -> Self {
        match policy {
            OnStoreError::Error => PolicyAnswer::Error,
            OnStoreError::Allow => PolicyAnswer::Allow,
            OnStoreError::Deny => PolicyAnswer::Deny,
        }
    }
}

/// How the service answers when the store cannot.
#[derive(Clone, Copy, Debug)]
pub struct Fallback {
    /// The most a request waits for the store.
    pub store_timeout: Duration,
    pub on_store_error: OnStoreError,
}

/// How requests are answered beyond the rules: `--shadow-mode`, `--quota-mode`, `--counting`,
/// `--near-limit-ratio`, `--limit-response-headers` and `--response-dynamic-metadata`.
#[derive(Clone, Debug, Default)]
pub struct Answering {
    /// Count and report, but never deny.
    pub shadow_mode: bool,
    /// Every limit is a quota limit (envoyproxy/ratelimit's global quota mode): a request is
    /// denied only when all its limited descriptors are over, and a descriptor without a limit
    /// counts as one that is not.
    pub quota_mode: bool,
    /// When hits are charged, for rules that do not say (`counting`).
    pub counting: Counting,
    /// Whether rules that do not say are leased (`lease`).
    pub lease: Leasing,
    /// The cluster `scope: cluster` rules count in (`--cluster-name`).
    pub cluster_name: Option<String>,
    /// The share of a limit past which hits count as near it, in the metrics.
    pub near_limit_ratio: f64,
    /// Send the limit closest to denying as `RateLimit-*` headers, under these names.
    pub limit_headers: Option<LimitHeaders>,
    /// Send the request and the passed rules' `metadata` as the response's dynamic metadata.
    pub dynamic_metadata: bool,
}

/// The names of the headers that carry a limit, its remaining requests and its reset in
/// seconds (the IETF draft's `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`).
#[derive(Clone, Debug)]
pub struct LimitHeaders {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
}

/// The rate limit service: current rules, the decider and the request bounds.
pub struct Rls {
    rules: Arc<ArcSwap<RuleSet>>,
    decider: Decider,
    bounds: Bounds,
    fallback: Fallback,
    answering: Answering,
    telemetry: Telemetry,
}

impl Answering {
    /// What planning applies to every rule.
    pub(super) fn global(&self) -> Global<'_> {
        Global {
            quota_mode: self.quota_mode,
            counting: self.counting,
            lease: self.lease,
            cluster: self.cluster_name.as_deref(),
        }
    }
}

impl Rls {
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        decider: Decider,
        bounds: Bounds,
        fallback: Fallback,
        answering: Answering,
        telemetry: Telemetry,
    ) -> Self {
        Rls {
            rules,
            decider,
            bounds,
            fallback,
            answering,
            telemetry,
        }
    }

    /// Answers one request whose caller gives up after `caller_timeout`, if it said, counting
    /// at the instant `at` (ms since the Unix epoch) if it names one; the gRPC method and the
    /// admin `/json` endpoint both call this.
    pub async fn answer(
        &self,
        request: &RateLimitRequest,
        caller_timeout: Option<Duration>,
        at: Option<u64>,
    ) -> Result<RateLimitResponse, Status> {
        if let Err(invalid) = self.bounds.validate(request) {
            self.telemetry.invalid_request();
            return Err(invalid);
        }
        let rules = self.rules.load();
        if rules.is_awaiting() {
            // envoyproxy/ratelimit's answer before its first xDS configuration: Envoy's
            // failure_mode_deny decides.
            return Err(Status::unavailable("no rate limit configuration loaded"));
        }
        let asked = descriptors(request);
        let (plans, mut check) = rules.plan(&request.domain, &asked, self.answering.global(), true);
        if self.telemetry.tracing() {
            traced(request, &plans, self.telemetry.tracing_values());
        }
        if let Some(at) = at {
            if let Some(item) = check.items.iter().find(|i| !i.limit.schedulable()) {
                self.telemetry.invalid_request();
                let limit = match item.limit.calendar {
                    Some(_) => format!("a limit on the calendar (per {})", item.limit.unit.name()),
                    None => format!("a {} limit", item.limit.algorithm.name()),
                };
                return Err(Status::invalid_argument(format!(
                    "\"at\" names an instant, which only fixed_window and sliding_log limits off the calendar count at; this request has {limit}"
                )));
            }
            let ahead = Duration::from_millis(at.saturating_sub(unix_ms()));
            if ahead > self.bounds.max_schedule_ahead {
                self.telemetry.invalid_request();
                return Err(Status::invalid_argument(format!(
                    "\"at\" is more than --max-schedule-ahead ({}) ahead",
                    in_largest_unit(self.bounds.max_schedule_ahead)
                )));
            }
            check.at = Some(at);
        }
        let deadline = Deadline::new(self.fallback.store_timeout, caller_timeout);
        let decided = match self.decider.share(&mut check) {
            Ok(()) => self.decider.decide(&check, deadline).await,
            Err(e) => Err(e),
        };
        self.telemetry.decided();
        match decided {
            Ok(decision) => {
                if self.answering.shadow_mode && !decision.admitted {
                    self.telemetry.shadow_mode_pass();
                }
                let near = self.answering.near_limit_ratio;
                counted::descriptors(&plans, &asked, &check, &decision, near);
                counted::holds(&self.telemetry, &request.domain, &plans, &decision);
                let response = respond(request, &plans, &check, &decision, &self.answering);
                if self.telemetry.tracing() {
                    let code = Code::try_from(response.overall_code).unwrap_or(Code::Unknown);
                    Span::current().record("ratelimit.decision", code.as_str_name());
                }
                tracing::debug!(
                    domain = %String::from_utf8_lossy(&request.domain),
                    descriptors = request.descriptors.len(),
                    code = ?Code::try_from(response.overall_code).unwrap_or(Code::Unknown),
                    local_cache = decision.usages.iter().any(|u| u.source == Source::LocalCache),
                    "decided"
                );
                Ok(response)
            }
            Err(e) => {
                tracing::debug!(domain = %String::from_utf8_lossy(&request.domain), "undecided: {e}");
                self.undecided(e, request, &plans, &check)
            }
        }
    }

    /// The `--on-store-error` answer to a request the store could not decide.
    fn undecided(
        &self,
        e: StoreError,
        request: &RateLimitRequest,
        plans: &[Plan],
        check: &Check,
    ) -> Result<RateLimitResponse, Status> {
        static UNDECIDED: LogThrottle = LogThrottle::new();
        let policy = self.fallback.on_store_error;
        let answer = PolicyAnswer::from(policy);
        self.telemetry.undecided(e.kind(), answer);
        let name = answer.name();
        if self.telemetry.tracing() {
            let span = Span::current();
            span.record("ratelimit.policy_answer", name);
            traces::store_failed(&span, &e);
        }
        if let Some(n) = UNDECIDED.hit() {
            tracing::warn!(
                "{n} request(s) since the last report answered by --on-store-error {name}: {e}"
            );
        }
        match policy {
            OnStoreError::Error => Err(match e {
                StoreError::Full { .. } => Status::resource_exhausted(e.to_string()),
                _ => Status::unavailable(e.to_string()),
            }),
            OnStoreError::Allow => {
                let statuses: Vec<DescriptorStatus> = plans.iter().map(unknown_status).collect();
                Ok(RateLimitResponse {
                    overall_code: Code::Ok as i32,
                    dynamic_metadata: self
                        .answering
                        .dynamic_metadata
                        .then(|| passed_metadata(request, plans, &statuses)),
                    statuses,
                    ..Default::default()
                })
            }
            OnStoreError::Deny => {
                let over = Usage {
                    over: true,
                    remaining: 0,
                    left_before: 0,
                    reset: Duration::from_secs(1),
                    full: false,
                    source: Source::Store,
                    window: 0,
                    hold: None,
                };
                let decision = Decision {
                    admitted: admits(check, |_| true),
                    usages: vec![over; check.items.len()],
                };
                Ok(respond(request, plans, check, &decision, &self.answering))
            }
        }
    }
}

impl Bounds {
    /// Rejects a request no rule could be matched against, or one past these bounds, naming
    /// what is wrong.
    pub(super) fn validate(&self, request: &RateLimitRequest) -> Result<(), Status> {
        let b = self;
        let invalid = |m: String| Err(Status::invalid_argument(m));
        if request.domain.is_empty() {
            return invalid("rate limit domain must not be empty".into());
        }
        if request.domain.len() > MOST_DOMAIN_BYTES {
            return invalid(format!(
                "rate limit {}",
                domain_too_long(request.domain.len())
            ));
        }
        if request.descriptors.is_empty() {
            return invalid("rate limit descriptor list must not be empty".into());
        }
        if request.descriptors.len() > b.max_descriptors {
            return invalid(format!(
                "{} descriptors exceed --max-descriptors ({})",
                request.descriptors.len(),
                b.max_descriptors
            ));
        }
        for (i, d) in request.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return invalid(format!("descriptor {i} has no entries"));
            }
            if d.entries.len() > b.max_entries {
                return invalid(format!(
                    "descriptor {i} has {} entries, more than --max-entries ({})",
                    d.entries.len(),
                    b.max_entries
                ));
            }
            for (j, e) in d.entries.iter().enumerate() {
                if e.key.is_empty() {
                    return invalid(format!("descriptor {i} entry {j} has an empty key"));
                }
            }
            if let Some(limit) = &d.limit
                && override_unit(limit.unit).is_none()
            {
                return invalid(format!(
                    "descriptor {i} has a limit override with an unknown unit ({})",
                    limit.unit
                ));
            }
        }
        Ok(())
    }
}

impl Rls {
    /// `RateLimitService.ShouldRateLimit`, timed, in the caller's trace.
    pub(super) async fn should_rate_limit(
        self: Arc<Self>,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        let caller_timeout = grpc_timeout(request.metadata());
        let answering = self.answer(request.get_ref(), caller_timeout, None);
        let answer = if self.telemetry.tracing() {
            let span = traces::call_span(&self.telemetry, request.metadata());
            answering.instrument(span).await
        } else {
            answering.await
        };
        self.telemetry.answered(started.elapsed());
        answer.map(Response::new)
    }
}

/// The caller's `grpc-timeout` (gRPC over HTTP/2: at most 8 digits, then a unit).
fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at_checked(text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn override_unit(unit: i32) -> Option<Unit> {
    Some(match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Unknown => return None,
        RateLimitUnit::Second => Unit::Second,
        RateLimitUnit::Minute => Unit::Minute,
        RateLimitUnit::Hour => Unit::Hour,
        RateLimitUnit::Day => Unit::Day,
        RateLimitUnit::Month => Unit::Month,
        RateLimitUnit::Year => Unit::Year,
    })
}

fn response_unit(unit: Unit) -> rate_limit::Unit {
    match unit {
        Unit::Second => rate_limit::Unit::Second,
        Unit::Minute => rate_limit::Unit::Minute,
        Unit::Hour => rate_limit::Unit::Hour,
        Unit::Day => rate_limit::Unit::Day,
        Unit::Week => rate_limit::Unit::Week,
        Unit::Month => rate_limit::Unit::Month,
        Unit::Year => rate_limit::Unit::Year,
    }
}

/// Hits a descriptor consumes: its own `hits_addend` when set (0 checks only), else the
/// request's, where 0 means 1; at most `MOST_HITS`.
fn hits(request: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> u64 {
    match descriptor.hits_addend {
        Some(h) => h.value.min(MOST_HITS),
        None => u64::from(request.hits_addend.max(1)),
    }
}

/// The request's descriptors as the rules plan them: their entries as (key, value) pairs, their
/// hits resolved, and the unit of their limit override read (a validated request's is known).
pub(super) fn descriptors(request: &RateLimitRequest) -> Vec<Asked<'_>> {
    request
        .descriptors
        .iter()
        .map(|d| Asked {
            entries: d
                .entries
                .iter()
                .map(|e| (e.key.as_slice(), e.value.as_slice()))
                .collect(),
            hits: hits(request, d),
            refund: d.is_negative_hits,
            limit: d.limit.as_ref().map(|o| Override {
                requests_per_unit: o.requests_per_unit,
                unit: override_unit(o.unit).expect("validated"),
            }),
        })
        .collect()
}

/// Names, on the call's span, its domain and the rules its descriptors matched, and with
/// `values` (`--tracing-values`) the descriptors themselves.
fn traced(request: &RateLimitRequest, plans: &[Plan], values: bool) {
    let span = Span::current();
    span.record(
        "ratelimit.domain",
        traces::cut(String::from_utf8_lossy(&request.domain)).as_str(),
    );
    let rules: Vec<&str> = plans.iter().filter_map(Plan::rule).collect();
    span.record("ratelimit.rules", traces::cut(rules.join(" ")).as_str());
    if values {
        span.record(
            "ratelimit.descriptors",
            traces::cut(Entries(&request.descriptors)).as_str(),
        );
    }
}

/// A request's descriptors as a span names them: `key=value` entries joined by `,`, descriptors
/// by a space; written piece by piece, so that `traces::cut` copies only what it keeps.
struct Entries<'a>(&'a [RateLimitDescriptor]);

impl std::fmt::Display for Entries<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            for (j, e) in d.entries.iter().enumerate() {
                if j > 0 {
                    f.write_str(",")?;
                }
                let key = String::from_utf8_lossy(&e.key);
                let value = String::from_utf8_lossy(&e.value);
                write!(f, "{key}={value}")?;
            }
        }
        Ok(())
    }
}

/// The status of a descriptor whose counters are not known: a free or unlimited one as always,
/// a limited one OK without a limit.
fn unknown_status(plan: &Plan) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: match plan {
            Plan::Unlimited => u32::MAX,
            Plan::Free | Plan::Limited { .. } => 0,
        },
        ..Default::default()
    }
}

/// The answer to a decided request: one status per descriptor, in order, with resets in whole
/// seconds; `retry-after` when denied; and, as `answering` says, `RateLimit-*` headers and
/// dynamic metadata.
fn respond(
    request: &RateLimitRequest,
    plans: &[Plan],
    check: &Check,
    decision: &Decision,
    answering: &Answering,
) -> RateLimitResponse {
    let mut statuses: Vec<DescriptorStatus> = Vec::with_capacity(plans.len());
    let mut retry_after = 0;
    // The status the `RateLimit-*` headers report, chosen as envoyproxy/ratelimit chooses it:
    // the least remaining, first come; but an enforced (not quota) denial always, last come.
    let mut headed: Option<usize> = None;
    for plan in plans {
        statuses.push(match plan.shown(check, decision) {
            None => unknown_status(plan),
            Some(shown) => {
                let usage = &decision.usages[shown];
                let item = &check.items[shown];
                let over = usage.over && !item.mode.is_shadow();
                let reset = whole_seconds(usage.reset);
                if over && !decision.admitted {
                    retry_after = retry_after.max(reset);
                }
                let remaining = u32::try_from(usage.remaining).unwrap_or(u32::MAX);
                let least = headed.is_none_or(|h| remaining < statuses[h].limit_remaining);
                if least || (over && item.mode != Mode::Quota) {
                    headed = Some(statuses.len());
                }
                DescriptorStatus {
                    code: if over { Code::OverLimit } else { Code::Ok } as i32,
                    current_limit: Some(RateLimit {
                        name: item.limit.name.clone(),
                        requests_per_unit: item.limit.requests_per_unit,
                        unit: reported_unit(&item.limit) as i32,
                    }),
                    limit_remaining: remaining,
                    duration_until_reset: Some(protobuf::Duration {
                        seconds: reset as i64,
                        nanos: 0,
                    }),
                    quota: None,
                }
            }
        });
    }
    let denied = !decision.admitted && !answering.shadow_mode;
    let mut response = RateLimitResponse {
        overall_code: if denied { Code::OverLimit } else { Code::Ok } as i32,
        ..Default::default()
    };
    if denied {
        response
            .response_headers_to_add
            .push(header("retry-after", retry_after));
    }
    if let (Some(names), Some(h)) = (&answering.limit_headers, headed) {
        let status = &statuses[h];
        let limit = status
            .current_limit
            .as_ref()
            .map_or(0, |l| l.requests_per_unit);
        let reset = status
            .duration_until_reset
            .as_ref()
            .map_or(0, |d| d.seconds);
        response.response_headers_to_add.extend([
            header(&names.limit, limit),
            header(&names.remaining, status.limit_remaining),
            header(&names.reset, reset),
        ]);
    }
    if answering.dynamic_metadata {
        response.dynamic_metadata = Some(passed_metadata(request, plans, &statuses));
    }
    response.statuses = statuses;
    response
}

/// The dynamic metadata of an answer: the request, and the rule `metadata` of the descriptors
/// whose status is OK.
fn passed_metadata(
    request: &RateLimitRequest,
    plans: &[Plan],
    statuses: &[DescriptorStatus],
) -> protobuf::Struct {
    let passed = plans
        .iter()
        .zip(statuses)
        .filter_map(|(plan, status)| match plan {
            Plan::Limited { metadata, .. } if status.code == Code::Ok as i32 => *metadata,
            _ => None,
        });
    metadata::describe(request, passed)
}

/// `d` as a flag would give it: in whole days (`31d`) or hours when it is, else as humantime
/// writes it (which writes 31 days as `1month 13h 26m 24s`).
fn in_largest_unit(d: Duration) -> String {
    match d.as_secs() {
        s if d.subsec_nanos() == 0 && s > 0 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if d.subsec_nanos() == 0 && s > 0 && s % 3_600 == 0 => format!("{}h", s / 3_600),
        _ => humantime::format_duration(d).to_string(),
    }
}

fn header(key: &str, value: impl ToString) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        value: value.to_string(),
        ..Default::default()
    }
}

/// A reset as Envoy reads it: whole seconds (it drops fractions), rounded up so that a client
/// that waits that long finds room, and at least 1.
fn whole_seconds(reset: Duration) -> u64 {
    let seconds = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
    seconds.max(1)
}

/// The unit a status names for `limit`, so that the policy Envoy derives from it (`;w=` of
/// `x-ratelimit-limit`: the unit's seconds) stays true: the unit itself, or the unit whose length
/// is the whole window (60 seconds: MINUTE); else UNKNOWN, for which Envoy states no window.
fn reported_unit(limit: &Limit) -> rate_limit::Unit {
    if limit.unit_multiplier == 1 {
        return response_unit(limit.unit);
    }
    const UNITS: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];
    let window = limit.unit.seconds() * u64::from(limit.unit_multiplier);
    UNITS
        .into_iter()
        .find(|u| u.seconds() == window)
        .map_or(rate_limit::Unit::Unknown, response_unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(value: &str) -> Option<Duration> {
        let mut metadata = MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().unwrap());
        grpc_timeout(&metadata)
    }

    #[test]
    fn the_callers_grpc_timeout_is_read_in_every_unit() {
        assert_eq!(timeout("20m"), Some(Duration::from_millis(20)));
        assert_eq!(timeout("1500u"), Some(Duration::from_micros(1500)));
        assert_eq!(timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("7n"), Some(Duration::from_nanos(7)));
        assert_eq!(grpc_timeout(&MetadataMap::new()), None);
    }

    #[test]
    fn a_malformed_grpc_timeout_is_ignored() {
        for bad in ["", "m", "20", "20x", "-1m", "123456789m", "1.5S"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_schedule_horizon_is_named_in_the_largest_whole_unit() {
        let secs = Duration::from_secs;
        assert_eq!(in_largest_unit(secs(31 * 86_400)), "31d");
        assert_eq!(in_largest_unit(secs(3_600)), "1h");
        assert_eq!(in_largest_unit(secs(90)), "1m 30s");
        assert_eq!(in_largest_unit(Duration::ZERO), "0s");
    }
}
