//! Start and signals: sluice refuses to start without rules unless told to, then is not ready
//! until rules arrive; SIGHUP reloads the rules (valid ones replace those in force, broken ones
//! are reported and change nothing) and never ends the process.

use std::process::{Command, Stdio};
use std::time::Duration;

use support::redis::signal;
use support::{HOUR, OK, OVER_LIMIT, Sluice, Wait, eventually, http, in_one_window, request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn rules(limit: u32) -> String {
    format!(
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// The limit sluice reports for `user=u` (a check-only request consumes nothing).
async fn reported_limit(sluice: &Sluice) -> u32 {
    let mut check = request("web", &[&[("user", "u")]]);
    check.descriptors[0].hits_addend =
        Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = sluice.ask(check).await;
    r.statuses[0]
        .current_limit
        .as_ref()
        .expect("a limited descriptor")
        .requests_per_unit
}

/// How long a reload or readiness may take to show.
const PATIENCE: Duration = Duration::from_secs(10);

async fn health(sluice: &Sluice) -> i32 {
    let mut client = HealthClient::new(sluice.channel().await);
    client
        .check(HealthCheckRequest::default())
        .await
        .expect("health answers")
        .into_inner()
        .status
}

#[tokio::test]
async fn sighup_puts_valid_rules_in_force_and_keeps_serving() {
    let mut sluice = Sluice::start(&rules(1)).await;
    assert_eq!(reported_limit(&sluice).await, 1);
    std::fs::write(sluice.rules.join("rules.yaml"), rules(100)).unwrap();
    signal(sluice.pid(), "HUP");
    eventually("the new limit is in force", PATIENCE, async || {
        reported_limit(&sluice).await == 100
    })
    .await;
    assert!(sluice.alive(), "SIGHUP does not end the process");
}

#[tokio::test]
async fn sighup_with_a_broken_file_keeps_the_rules_in_force() {
    in_one_window(HOUR, async || {
        let mut sluice = Sluice::start(&rules(1)).await;
        let ask = || sluice.ask(request("web", &[&[("user", "b")]]));
        assert_eq!(ask().await.overall_code, OK);
        std::fs::write(
            sluice.rules.join("rules.yaml"),
            "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight}\n",
        )
        .unwrap();
        signal(sluice.pid(), "HUP");
        eventually("the broken file is reported", PATIENCE, async || {
            sluice
                .log_text()
                .contains("rules.yaml:4: invalid rate limit unit 'fortnight'")
        })
        .await;
        assert_eq!(
            ask().await.overall_code,
            OVER_LIMIT,
            "the old limit of 1 holds"
        );
        assert!(sluice.alive());
    })
    .await;
}

#[tokio::test]
async fn an_empty_rules_directory_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--config"])
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .output()
        .expect("sluice runs");
    assert!(!out.status.success());
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("no rules in") && log.contains("--allow-empty-config"),
        "{log}"
    );
}

#[tokio::test]
async fn with_allow_empty_config_it_is_not_ready_until_rules_arrive() {
    let sluice = Sluice::spawn(&[], &["--allow-empty-config"], None, Wait::Live).await;
    let (status, _, body) = http(sluice.http, "GET", "/readyz", "");
    assert_eq!(
        (status, body.as_str()),
        (503, "not ready: no rules loaded\n")
    );
    assert_eq!(health(&sluice).await, ServingStatus::NotServing as i32);

    std::fs::write(sluice.rules.join("rules.yaml"), rules(5)).unwrap();
    signal(sluice.pid(), "HUP");
    eventually("ready", PATIENCE, async || {
        http(sluice.http, "GET", "/readyz", "").0 == 200
    })
    .await;
    assert_eq!(health(&sluice).await, ServingStatus::Serving as i32);
    assert_eq!(reported_limit(&sluice).await, 5);
}
