//! The admin HTTP surface: liveness, readiness, `/healthcheck` (envoyproxy/ratelimit's probe
//! path), Prometheus `/metrics`, the rules in force (`/config` as JSON, `/rlconfig` as
//! envoyproxy/ratelimit's text) and `/json`, which answers a RateLimitRequest posted as protobuf
//! JSON with 200 (OK), 429 (over limit), 400 (invalid request), 413 (body over
//! `--max-request-bytes`) or 503 (the store could not decide, under `--on-store-error error`). `/json` moves counters, so it can be served apart or not at all.
//! Beside the request's fields, `/json` takes `"at"`: an RFC 3339 instant the request counts at
//! (a message scheduled for then, at most `--max-schedule-ahead` ahead), which `fixed_window` and
//! `sliding_log` limits honour.
//! `/top` tells who is being limited right now (`telemetry::top`), as JSON.
//! Apart, envoyproxy/ratelimit's debug port: `/rlconfig` and the list of its endpoints.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

use super::auth::{AdminAccess, guarded};
use super::gauges::Gauges;
use super::in_force::Rules;
use super::readiness::Readiness;
use super::render::Renders;
use super::rls::Rls;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::telemetry::Telemetry;
use crate::telemetry::top::{self, Period, Report};
use sluice_core::rules::RuleSet;
use sluice_core::store::unix_ms;

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(crate::pb::DESCRIPTORS).expect("build.rs writes a valid descriptor set")
});

fn message(name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(name)
        .expect("the descriptor set holds the rate limit service")
}

/// The admin routes: probes, metrics and the rules in force.
pub fn admin(readiness: Readiness, rules: Rules, gauges: Gauges, access: &AdminAccess) -> Router {
    let config = rules.clone();
    let telemetry = gauges.telemetry.clone();
    Router::new()
        .merge(super::ui::console(gauges.clone(), rules.clone(), access))
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(metrics_route("/metrics", gauges))
        .route("/top", {
            let renders = Arc::new(Renders::new(TOP_FRESH));
            let rules = rules.clone();
            guarded(
                get(move |uri: Uri| top_page(renders, telemetry, rules, uri)),
                access,
            )
        })
        .route(
            "/config",
            get(move || render(config, RuleSet::rendered_json, "application/json")),
        )
        .route(
            "/rlconfig",
            get(move || render(rules, RuleSet::rendered_text, TEXT)),
        )
        .route(
            "/healthcheck",
            any({
                let readiness = readiness.clone();
                move || async move {
                    if readiness.healthy() {
                        (StatusCode::OK, "OK")
                    } else {
                        (StatusCode::INTERNAL_SERVER_ERROR, "")
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get(move || async move {
                match readiness.problem() {
                    None => (StatusCode::OK, "ready\n".to_owned()),
                    Some(why) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    ),
                }
            }),
        )
}

/// The admin port's endpoints, each with its help line, as `/` lists them; `/json` last, listed
/// only where it is served.
const ADMIN_ENDPOINTS: &[(&str, &str)] = &[
    ("GET /healthz", "liveness: ok while the process serves"),
    (
        "GET /readyz",
        "readiness: 200 once the rules are loaded and the store reached, else 503 and why",
    ),
    ("GET /healthcheck", "envoyproxy/ratelimit's health check"),
    ("GET /metrics", "Prometheus metrics"),
    (
        "GET /config",
        "the rules in force as JSON, with their files and hash",
    ),
    (
        "GET /rlconfig",
        "the rules in force as envoyproxy/ratelimit prints them",
    ),
    ("GET /top", "who is being limited right now (?n=, ?period=)"),
    (
        "GET /ui",
        "the console: who is being limited, the rules, why, counters, the store",
    ),
    (
        "GET /status",
        "the store, the split replicas and the quota service, as JSON",
    ),
    (
        "POST /explain",
        "how the rules match a request, counting nothing",
    ),
    (
        "POST /counters",
        "shows, resets, sets or adds to a request's counters (a dry run unless \"apply\": true)",
    ),
    (
        "POST /json",
        "envoyproxy/ratelimit's JSON API: decides and counts a request",
    ),
];

/// `/` on the admin port: the list of its endpoints (`/json` when `json_here`).
pub fn index(json_here: bool) -> Router {
    let listed = ADMIN_ENDPOINTS
        .iter()
        .filter(|(endpoint, _)| json_here || !endpoint.ends_with("/json"))
        .map(|(endpoint, help)| format!("{endpoint}: {help}\n"))
        .collect::<String>();
    Router::new().route("/", get(move || async move { listed }))
}

/// What envoyproxy/ratelimit's debug port serves that sluice has, each with its help line as
/// `/` lists them there.
const DEBUG_ENDPOINTS: &[(&str, &str)] = &[(
    "/rlconfig",
    "print out the currently loaded configuration for debugging",
)];

/// envoyproxy/ratelimit's debug port (`--debug-addr`): `/rlconfig` (what `egctl config
/// envoy-ratelimit` prints) and `/`, the list of its endpoints.
pub fn debug(rules: Rules) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async {
                DEBUG_ENDPOINTS
                    .iter()
                    .map(|(path, help)| format!("{path}: {help}\n"))
                    .collect::<String>()
            }),
        )
        .route(
            "/rlconfig",
            get(move || render(rules, RuleSet::rendered_text, TEXT)),
        )
}

const TEXT: &str = "text/plain; charset=utf-8";

/// The rules in force as `page` renders them, on a blocking thread: a large rule set takes a
/// while to render the first time, and the thread that answers probes must not wait for it.
async fn render(rules: Rules, page: fn(&RuleSet) -> Bytes, content_type: &'static str) -> Response {
    let rules = rules.in_force();
    match tokio::task::spawn_blocking(move || page(&rules)).await {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Rows of each list of `/top` unless `?n=` says.
const TOP_ROWS: usize = 10;
/// How old a render of `/top` may be and still answer: the requests asking the same within it
/// share one merge and one encoding.
const TOP_FRESH: Duration = Duration::from_secs(1);

/// `/top`: who is being limited, over `?period=` 1m or 10m (both unless it says), the first
/// `?n=` rows of each list; 404 when the top view is off.
async fn top_page(
    renders: Arc<Renders<(Vec<Period>, usize), Bytes>>,
    telemetry: Telemetry,
    rules: Rules,
    uri: Uri,
) -> Response {
    if telemetry.top().is_none() {
        return (
            StatusCode::NOT_FOUND,
            "the top view is off (--top-capacity 0)\n",
        )
            .into_response();
    }
    let (periods, n) = match top_query(uri.query().unwrap_or_default()) {
        Ok(asked) => asked,
        Err(message) => return (StatusCode::BAD_REQUEST, message).into_response(),
    };
    let render = {
        let periods = periods.clone();
        move || {
            let mut report = Report {
                periods: match telemetry.top() {
                    Some(view) => periods.into_iter().map(|p| view.report(p, n)).collect(),
                    None => Vec::new(),
                },
            };
            calendar_ends(&mut report, &rules.in_force());
            let mut json = serde_json::to_vec(&report).unwrap_or_default();
            json.push(b'\n');
            Bytes::from(json)
        }
    };
    match renders.page((periods, n), render).await {
        Some(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Gives each rule of `report` with a limit on the calendar the time until its window ends.
fn calendar_ends(report: &mut Report, rules: &RuleSet) {
    let now = unix_ms();
    let ends = rules.calendar_ends(now);
    if ends.is_empty() {
        return;
    }
    for period in &mut report.periods {
        for row in period
            .rules_by_denied
            .iter_mut()
            .chain(period.rules_by_hits.iter_mut())
        {
            row.window_ends_in_seconds = ends
                .get(&(row.domain.as_str(), row.rule.as_str()))
                .map(|end| end.saturating_sub(now).div_ceil(1000));
        }
    }
}

/// The periods and rows `/top`'s query asks for.
fn top_query(query: &str) -> Result<(Vec<Period>, usize), String> {
    let (mut periods, mut n) = (Period::ALL.to_vec(), TOP_ROWS);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("period", "1m")) => periods = vec![Period::Minute],
            Some(("period", "10m")) => periods = vec![Period::TenMinutes],
            Some(("n", rows)) => {
                n = rows
                    .parse()
                    .ok()
                    .filter(|n| (1..=top::MOST_ROWS).contains(n))
                    .ok_or_else(|| format!("n: rows from 1 to {}\n", top::MOST_ROWS))?;
            }
            _ => return Err(format!("{pair}: /top takes period=1m|10m and n=ROWS\n")),
        }
    }
    Ok((periods, n))
}

/// Prometheus metrics on `path` (the admin `/metrics`, and `--metrics-path` on
/// `--metrics-addr`), encoded on a blocking thread, one scrape's encoding shared by those that
/// arrive while it runs: with a series per rule the text of a large rule set takes a while.
pub fn metrics_route(path: &str, gauges: Gauges) -> Router {
    let renders = Arc::new(Renders::new(Duration::ZERO));
    Router::new().route(
        path,
        get(move || metrics_page(renders.clone(), gauges.clone())),
    )
}

async fn metrics_page(renders: Arc<Renders<(), Option<Bytes>>>, gauges: Gauges) -> Response {
    let text = renders
        .page((), move || gauges.encode().ok().map(Bytes::from))
        .await;
    match text.flatten() {
        Some(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// The `/json` route, bounded to `max_body` bytes.
pub fn json_route(rls: Arc<Rls>, max_body: usize, access: &AdminAccess) -> Router {
    Router::new()
        .route("/json", guarded(post(json), access))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(rls)
}

async fn json(State(rls): State<Arc<Rls>>, body: Bytes) -> Response {
    let (request, at) = match decode(&body) {
        Ok(r) => r,
        Err(message) => return (StatusCode::BAD_REQUEST, message).into_response(),
    };
    match rls.answer(&request, None, at).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            match encode(&response) {
                Ok(json) => {
                    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
                }
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
            }
        }
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response()
        }
        Err(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", s.message()),
        )
            .into_response(),
    }
}

/// A RateLimitRequest in protobuf JSON and the instant its `"at"` names, if any.
pub(super) fn decode(body: &[u8]) -> Result<(RateLimitRequest, Option<u64>), String> {
    let mut json: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("invalid RateLimitRequest JSON: {e}\n"))?;
    let at = match json.as_object_mut().and_then(|o| o.remove("at")) {
        None | Some(serde_json::Value::Null) => None,
        Some(at) => Some(instant(&at)?),
    };
    let dynamic =
        DynamicMessage::deserialize(message("envoy.service.ratelimit.v3.RateLimitRequest"), json)
            .map_err(|e| format!("invalid RateLimitRequest JSON: {e}\n"))?;
    let request = dynamic
        .transcode_to::<RateLimitRequest>()
        .map_err(|e| format!("invalid RateLimitRequest: {e}\n"))?;
    Ok((request, at))
}

/// `"at"`: an RFC 3339 instant, in ms since the Unix epoch (how far ahead it may lie is
/// `--max-schedule-ahead`, which `Rls::answer` holds it to).
fn instant(at: &serde_json::Value) -> Result<u64, String> {
    let text = at.as_str().ok_or_else(|| {
        "\"at\" must be an RFC 3339 instant in a string, such as \"2026-11-22T11:11:11Z\"\n"
            .to_owned()
    })?;
    let instant: jiff::Timestamp = text
        .parse()
        .map_err(|e| format!("\"at\" is not an RFC 3339 instant: {e}\n"))?;
    u64::try_from(instant.as_millisecond()).map_err(|_| "\"at\" is before 1970\n".to_owned())
}

fn encode(response: &RateLimitResponse) -> Result<String, String> {
    let mut dynamic = DynamicMessage::new(message("envoy.service.ratelimit.v3.RateLimitResponse"));
    dynamic
        .transcode_from(response)
        .map_err(|e| format!("cannot encode the response: {e}\n"))?;
    let mut text = serde_json::to_string(&dynamic)
        .map_err(|e| format!("cannot encode the response as JSON: {e}\n"))?;
    text.push('\n');
    Ok(text)
}
