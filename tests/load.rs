//! `sluice load` against a running sluice: it sends what it is told and counts the answers right.

mod common;

use common::Sluice;

#[tokio::test]
async fn load_counts_ok_and_over_limit_answers() {
    let rules = "domain: bench\ndescriptors:\n  - key: key\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";
    let sluice = Sluice::start(rules).await;
    let target = sluice.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "load", "--json", "--quiet", "--target", &target, "--domain", "bench",
            ])
            .args([
                "--descriptor",
                "key=v",
                "--requests",
                "200",
                "--concurrency",
                "8",
            ])
            .output()
            .expect("sluice load runs")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(report["requests"], 200);
    assert_eq!(report["ok"], 50, "the limit admits 50");
    assert_eq!(report["over_limit"], 150);
    assert_eq!(report["errors"], serde_json::json!({}));
    assert!(
        report["latency_us"]["p99"].as_u64().unwrap()
            >= report["latency_us"]["p50"].as_u64().unwrap()
    );
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
