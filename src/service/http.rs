//! The admin HTTP surface: liveness, readiness, `/healthcheck` (envoyproxy/ratelimit's probe
//! path), Prometheus `/metrics`, the rules in force (`/config` as JSON, `/rlconfig` as
//! envoyproxy/ratelimit's text) and `/json`, which answers a RateLimitRequest posted as protobuf
//! JSON with 200 (OK), 429 (over limit), 400 (invalid request), 413 (body over
//! `--max-request-bytes`) or 503 (the store could not decide, under `--on-store-error error`). `/json` moves counters, so it can be served apart or not at all.
//! Beside the request's fields, `/json` takes `"at"`: an RFC 3339 instant the request counts at
//! (a message scheduled for then), which `fixed_window` and `sliding_log` limits honour.
//! Apart, envoyproxy/ratelimit's debug port: `/rlconfig` and the list of its endpoints.

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

use super::gauges::Gauges;
use super::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use super::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use super::rls::Rls;
use super::{Readiness, Rules};
use crate::limiter::LONGEST_WINDOW_SECONDS;
use crate::rules::RuleSet;

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(super::DESCRIPTORS).expect("build.rs writes a valid descriptor set")
});

fn message(name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(name)
        .expect("the descriptor set holds the rate limit service")
}

/// The admin routes: probes, metrics and the rules in force.
pub fn admin(readiness: Readiness, rules: Rules, gauges: Gauges) -> Router {
    let config = rules.clone();
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(metrics_route("/metrics", gauges))
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
    let rules = rules.current.load_full();
    match tokio::task::spawn_blocking(move || page(&rules)).await {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// The `/json` route, bounded to `max_body` bytes.
/// Prometheus metrics on `path` (the admin `/metrics`, and `--metrics-path` on
/// `--metrics-addr`).
pub fn metrics_route(path: &str, gauges: Gauges) -> Router {
    Router::new().route(
        path,
        get(move || async move {
            match gauges.encode() {
                Ok(text) => (
                    StatusCode::OK,
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    text,
                )
                    .into_response(),
                Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            }
        }),
    )
}

pub fn json_route(rls: Arc<Rls>, max_body: usize) -> Router {
    Router::new()
        .route("/json", post(json))
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

/// `"at"`: an RFC 3339 instant, in ms since the Unix epoch, no more than the longest window
/// ahead.
fn instant(at: &serde_json::Value) -> Result<u64, String> {
    let text = at.as_str().ok_or_else(|| {
        "\"at\" must be an RFC 3339 instant in a string, such as \"2026-11-22T11:11:11Z\"\n"
            .to_owned()
    })?;
    let instant: jiff::Timestamp = text
        .parse()
        .map_err(|e| format!("\"at\" is not an RFC 3339 instant: {e}\n"))?;
    let ms = u64::try_from(instant.as_millisecond())
        .map_err(|_| "\"at\" is before 1970\n".to_owned())?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    if ms > now + LONGEST_WINDOW_SECONDS * 1000 {
        return Err(format!(
            "\"at\" is more than {} days ahead\n",
            LONGEST_WINDOW_SECONDS / 86_400
        ));
    }
    Ok(ms)
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
