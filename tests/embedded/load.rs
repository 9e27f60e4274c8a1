//! `sluice load` against a running sluice, and with `--http` against a small HTTP server: it
//! sends what it is told and counts the answers right.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderMap, StatusCode};
use axum::serve::ListenerExt;
use support::{HOUR, Sluice, in_one_window};

#[tokio::test]
async fn load_counts_ok_and_over_limit_answers() {
    in_one_window(HOUR, async || {
        let rules = "domain: bench\ndescriptors:\n  - key: key\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";
        let sluice = Sluice::start(rules).await;
        let report = support::load_report(
            &sluice,
            &[
                "--domain",
                "bench",
                "--descriptor",
                "key=v",
                "--requests",
                "200",
                "--concurrency",
                "8",
            ],
        )
        .await;
        assert_eq!(report["requests"], 200);
        assert_eq!(report["ok"], 50, "the limit admits 50");
        assert_eq!(report["over_limit"], 150);
        assert_eq!(report["errors"], serde_json::json!({}));
        assert!(
            report["latency_us"]["p99"].as_u64().unwrap()
                >= report["latency_us"]["p50"].as_u64().unwrap()
        );
    })
    .await;
}

#[tokio::test]
async fn load_reports_errors_by_grpc_code() {
    let sluice = Sluice::start("domain: bench\n").await;
    let target = sluice.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "load", "--json", "--quiet", "--target", &target, "--domain", "",
            ])
            .args(["--requests", "10", "--concurrency", "2"])
            .output()
            .expect("sluice load runs")
    })
    .await
    .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(
        report["errors"]["InvalidArgument"], 10,
        "an empty domain is invalid"
    );
}

/// `--connections` opens that many HTTP/2 connections, however many callers share them and
/// however few threads carry them: counted by a proxy in front of sluice.
#[tokio::test]
async fn load_opens_as_many_grpc_connections_as_asked() {
    in_one_window(HOUR, async || {
        let rules = "domain: bench\ndescriptors:\n  - key: key\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";
        let sluice = Sluice::start(rules).await;
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = proxy.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        let upstream = sluice.grpc;
        let proxying = tokio::spawn(async move {
            while let Ok((mut client, _)) = proxy.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
                .args(["load", "--json", "--quiet", "--target", &target])
                .args(["--domain", "bench", "--descriptor", "key=v"])
                .args(["--requests", "120", "--concurrency", "12", "--connections", "9"])
                .output()
                .expect("sluice load runs")
        })
        .await
        .unwrap();
        proxying.abort();
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
        assert_eq!(report["ok"], 120, "{report}");
        assert_eq!(accepted.load(Ordering::SeqCst), 9, "connections opened");
    })
    .await;
}

#[tokio::test]
async fn load_over_http_counts_answers_by_status_over_kept_alive_connections() {
    // Every 4th request that carries the header gets 429, every 4th 503, the rest 200; a request
    // without it gets 400. The server keeps connections alive but for every 10th answer.
    let answered = Arc::new(AtomicU64::new(0));
    let connections = Arc::new(AtomicU64::new(0));
    let app = {
        let answered = answered.clone();
        axum::Router::new().route(
            "/api",
            axum::routing::get(move |headers: HeaderMap| {
                let n = answered.fetch_add(1, Ordering::SeqCst);
                let status = match (headers.get("x-tenant").is_some_and(|v| v == "acme"), n % 4) {
                    (false, _) => StatusCode::BAD_REQUEST,
                    (_, 2) => StatusCode::TOO_MANY_REQUESTS,
                    (_, 3) => StatusCode::SERVICE_UNAVAILABLE,
                    _ => StatusCode::OK,
                };
                let close = if n % 10 == 9 { "close" } else { "keep-alive" };
                async move { (status, [("connection", close)], "body\n") }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counted = connections.clone();
    let listener = listener.tap_io(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
    });
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let url = format!("http://{addr}/api");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["load", "--json", "--quiet", "--http", &url])
            .args([
                "--header",
                "x-tenant: acme",
                "--requests",
                "200",
                "--concurrency",
                "4",
            ])
            .output()
            .expect("sluice load runs")
    })
    .await
    .unwrap();
    server.abort();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(report["requests"], 200);
    assert_eq!(report["ok"], 100);
    assert_eq!(report["over_limit"], 50);
    assert_eq!(report["errors"], serde_json::json!({"HTTP 503": 50}));
    assert_eq!(answered.load(Ordering::SeqCst), 200);
    // One connection per caller, kept alive; after each of the 20 closes a new one, unless the
    // close came with that caller's last answer.
    let opened = connections.load(Ordering::SeqCst);
    assert!(
        (4 + 20 - 4..=4 + 20).contains(&opened),
        "{opened} connections"
    );
}

/// Into a pipe, the progress is a line a second, not one line rewritten with carriage returns.
#[tokio::test]
async fn load_writes_its_progress_as_lines_into_a_pipe() {
    let rules = "domain: bench\ndescriptors:\n  - key: key\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";
    let sluice = Sluice::start(rules).await;
    let target = sluice.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["load", "--target", &target, "--domain", "bench"])
            .args([
                "--descriptor",
                "key=v",
                "--duration",
                "2500ms",
                "--rate",
                "100",
            ])
            .output()
            .expect("sluice load runs")
    })
    .await
    .unwrap();
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{progress}");
    assert!(!progress.contains('\r'), "{progress:?}");
    assert!(
        progress.lines().filter(|l| l.contains("requests")).count() >= 2,
        "a line a second: {progress:?}"
    );
}
