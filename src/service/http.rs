//! The admin HTTP surface: liveness, readiness and `/json`, which answers a RateLimitRequest
//! posted as protobuf JSON with 200 (OK), 429 (over limit) or 400 (invalid request).

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

use super::rls::Rls;

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(super::DESCRIPTORS).expect("build.rs writes a valid descriptor set")
});

fn message(name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(name)
        .expect("the descriptor set holds the rate limit service")
}

pub fn router(rls: Arc<Rls>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/json", post(json))
        .with_state(rls)
}

async fn json(State(rls): State<Arc<Rls>>, body: Bytes) -> Response {
    let request = match decode(&body) {
        Ok(r) => r,
        Err(message) => return (StatusCode::BAD_REQUEST, message).into_response(),
    };
    match rls.answer(&request).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                encode(&response),
            )
                .into_response()
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

fn decode(body: &[u8]) -> Result<RateLimitRequest, String> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let dynamic = DynamicMessage::deserialize(
        message("envoy.service.ratelimit.v3.RateLimitRequest"),
        &mut de,
    )
    .and_then(|m| de.end().map(|()| m))
    .map_err(|e| format!("invalid RateLimitRequest JSON: {e}\n"))?;
    dynamic
        .transcode_to::<RateLimitRequest>()
        .map_err(|e| format!("invalid RateLimitRequest: {e}\n"))
}

fn encode(response: &RateLimitResponse) -> String {
    let mut dynamic = DynamicMessage::new(message("envoy.service.ratelimit.v3.RateLimitResponse"));
    dynamic
        .transcode_from(response)
        .expect("a response the service built fits its own descriptor");
    let mut text = serde_json::to_string(&dynamic).expect("a protobuf message serializes to JSON");
    text.push('\n');
    text
}
