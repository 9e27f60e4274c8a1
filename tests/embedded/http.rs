//! The admin HTTP surface and gRPC introspection: health and readiness, `/json` answering
//! protobuf JSON with 200 / 429 / 400, gRPC health, and server reflection (v1 and v1alpha) that
//! describes the rate limit service without proto files.

use support::{MINUTE, Sluice, http, in_one_window};
use tokio_stream::StreamExt;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const RULES: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

#[tokio::test]
async fn healthz_and_readyz_answer_200() {
    let sluice = Sluice::start(RULES).await;
    assert_eq!(http(sluice.http, "GET", "/healthz", "").0, 200);
    assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 200);
}

/// envoyproxy/ratelimit's probe path, which Envoy Gateway probes: 200 `OK` to any method.
#[tokio::test]
async fn healthcheck_answers_ok_as_envoy_ratelimit_does() {
    let sluice = Sluice::start(RULES).await;
    for method in ["GET", "POST"] {
        let (status, _, body) = http(sluice.http, method, "/healthcheck", "");
        assert_eq!((status, body.as_str()), (200, "OK"), "{method}");
    }
}

#[tokio::test]
async fn json_answers_200_until_the_limit_then_429() {
    in_one_window(MINUTE, async || {
        let sluice = Sluice::start(RULES).await;
        let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"ann"}]}]}"#;
        let (status, headers, text) = http(sluice.http, "POST", "/json", body);
        assert_eq!(status, 200, "{text}");
        assert!(
            headers
                .iter()
                .any(|(k, v)| k == "content-type" && v == "application/json")
        );
        let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["overallCode"], "OK");
        assert_eq!(answer["statuses"][0]["limitRemaining"], 1);
        assert_eq!(answer["statuses"][0]["currentLimit"]["unit"], "MINUTE");
        assert!(
            answer["statuses"][0]["durationUntilReset"]
                .as_str()
                .unwrap()
                .ends_with('s')
        );

        let snake = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"ann"}]}],"hits_addend":1}"#;
        assert_eq!(
            http(sluice.http, "POST", "/json", snake).0,
            200,
            "proto field names are accepted too"
        );
        let (status, _, text) = http(sluice.http, "POST", "/json", body);
        assert_eq!(status, 429);
        let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["overallCode"], "OVER_LIMIT");
    })
    .await;
}

#[tokio::test]
async fn json_rejects_bad_input_with_400_and_a_message() {
    let sluice = Sluice::start(RULES).await;
    let (status, _, text) = http(sluice.http, "POST", "/json", "{not json");
    assert_eq!(status, 400);
    assert!(text.contains("invalid RateLimitRequest JSON"), "{text}");
    let (status, _, text) = http(
        sluice.http,
        "POST",
        "/json",
        r#"{"domain":"web","descriptors":[],"colour":1}"#,
    );
    assert_eq!(status, 400);
    assert!(text.contains("colour"), "{text}");
    let (status, _, text) = http(
        sluice.http,
        "POST",
        "/json",
        r#"{"domain":"","descriptors":[]}"#,
    );
    assert_eq!(status, 400);
    assert!(text.contains("domain must not be empty"), "{text}");
    assert_eq!(
        http(sluice.http, "GET", "/healthz", "").0,
        200,
        "still serving"
    );
}

#[tokio::test]
async fn reflection_lists_and_describes_the_services() {
    let sluice = Sluice::start(RULES).await;
    let mut client = ServerReflectionClient::new(sluice.channel().await);
    let requests = tokio_stream::iter([
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(
                "envoy.service.ratelimit.v3.RateLimitService".into(),
            )),
        },
    ]);
    let mut replies = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let listed = replies.next().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = listed.message_response else {
        panic!("expected a service list, got {listed:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"envoy.service.ratelimit.v3.RateLimitService"),
        "{names:?}"
    );
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    let described = replies.next().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = described.message_response else {
        panic!("expected file descriptors, got {described:?}");
    };
    assert!(!files.file_descriptor_proto.is_empty());
}

#[tokio::test]
async fn reflection_v1alpha_is_served_too() {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResponse;
    let sluice = Sluice::start(RULES).await;
    let mut client = Alpha::new(sluice.channel().await);
    let request = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(AlphaRequest::ListServices(String::new())),
    };
    let mut replies = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let listed = replies.next().await.unwrap().unwrap();
    let Some(AlphaResponse::ListServicesResponse(list)) = listed.message_response else {
        panic!("expected a service list, got {listed:?}");
    };
    assert!(
        list.service
            .iter()
            .any(|s| s.name == "envoy.service.ratelimit.v3.RateLimitService")
    );
}

#[tokio::test]
async fn the_health_command_reports_serving_and_fails_when_nothing_answers() {
    let sluice = Sluice::start(RULES).await;
    let probe = |target: String| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["health", "--target", &target])
            .output()
            .expect("sluice runs")
    };
    let up = probe(sluice.grpc.to_string());
    assert!(up.status.success());
    assert_eq!(String::from_utf8_lossy(&up.stdout).trim(), "SERVING");
    let down = probe(format!("127.0.0.1:{}", support::free_port()));
    assert!(!down.status.success());
    let said = String::from_utf8_lossy(&down.stdout);
    assert!(said.starts_with("UNREACHABLE"), "{said}");
    assert!(
        !said.contains("tcp connect error: tcp connect error"),
        "each cause once: {said}"
    );
}

/// An image's health check runs `sluice health` with the server's own environment: without a
/// target it asks the address `serve` was given (SLUICE_GRPC_ADDR), on loopback when unspecified.
#[tokio::test]
async fn the_health_command_asks_where_serve_listens_by_default() {
    let sluice = Sluice::start(RULES).await;
    let probe = |grpc_addr: String| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("health")
            .env_remove("SLUICE_HEALTH_TARGET")
            .env("SLUICE_GRPC_ADDR", grpc_addr)
            .output()
            .expect("sluice runs")
    };
    let unspecified = probe(format!("0.0.0.0:{}", sluice.grpc.port()));
    assert_eq!(
        String::from_utf8_lossy(&unspecified.stdout).trim(),
        "SERVING"
    );
    assert!(unspecified.status.success());
    let elsewhere = probe(format!("127.0.0.1:{}", support::free_port()));
    assert!(!elsewhere.status.success());
}

/// `serve --help` names every endpoint the admin port lists at `/`, under `--http-addr`.
#[tokio::test(flavor = "multi_thread")]
async fn serve_help_names_every_admin_endpoint() {
    let sluice = Sluice::start(RULES).await;
    let (status, _, listed) = http(sluice.http, "GET", "/", "");
    assert_eq!(status, 200);
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--help"])
        .output()
        .expect("sluice runs");
    let help = String::from_utf8_lossy(&help.stdout);
    let http_addr = help
        .split("--http-addr")
        .nth(1)
        .and_then(|rest| rest.split("\n      --").next())
        .expect("--http-addr is in the help");
    let paths: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|p| p.trim_end_matches(':'))
        .collect();
    assert!(paths.len() >= 10, "{listed}");
    for path in paths {
        assert!(
            http_addr.contains(&format!("{path},"))
                || http_addr.contains(&format!("{path} "))
                || http_addr.contains(&format!("{path}\n")),
            "--http-addr's help does not name {path}: {http_addr}"
        );
    }
}
