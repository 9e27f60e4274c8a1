//! Redis reached through one fixed address (a Kubernetes Service, a cloud provider's primary
//! endpoint, a DNS name; a proxy here) when it fails over: the replica is promoted, the old
//! primary demoted, and the address sends new connections to the new primary. Connections already
//! open stay on the old node, which answers READONLY to every script; sluice drops them and
//! reconnects, so that decisions resume within seconds, with callers asking throughout.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::redis::Controlled;
use common::{OK, Sluice, Store, gather, request};

/// A limit no test reaches: every decided answer is OK, with the limit in its status.
const RULES: &str = "domain: failover\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";
const CALLERS: usize = 6;
/// Each caller's pace.
const PACE: Duration = Duration::from_millis(5);
/// How soon after the address reaches the new primary every request must be decided again.
const RESUME: Duration = Duration::from_secs(3);

/// One answer, as its caller saw it.
struct Answer {
    sent: Instant,
    received: Instant,
    decided: bool,
}

/// Waits until `replica` has its first full copy from its primary.
fn wait_in_sync(replica: &Controlled) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Callers asking every `PACE` until `stop`; an answer that is not decided must be the
/// `--on-store-error error` answer, UNAVAILABLE.
async fn load(sluice: &Sluice, stop: Instant) -> Vec<tokio::task::JoinHandle<Vec<Answer>>> {
    let mut callers = Vec::with_capacity(CALLERS);
    for i in 0..CALLERS {
        let mut client = sluice.client().await;
        let value = format!("v{i}");
        callers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            while Instant::now() < stop {
                let sent = Instant::now();
                let ask = request("failover", &[&[("k", value.as_str())]]);
                let answer =
                    tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(ask))
                        .await
                        .expect("an answer within 5 s");
                let decided = match answer {
                    Ok(r) => {
                        let r = r.into_inner();
                        assert!(
                            r.overall_code == OK && r.statuses[0].current_limit.is_some(),
                            "{r:?}"
                        );
                        true
                    }
                    Err(s) => {
                        assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                        false
                    }
                };
                answers.push(Answer {
                    sent,
                    received: Instant::now(),
                    decided,
                });
                tokio::time::sleep_until((sent + PACE).into()).await;
            }
            answers
        }));
    }
    callers
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failover_behind_a_fixed_address_is_decided_again_within_seconds() {
    let old = Controlled::started();
    let new = Controlled::started();
    let primary = old.port.to_string();
    new.cli(&["REPLICAOF", "127.0.0.1", &primary]);
    wait_in_sync(&new);
    let address = Proxy::start(old.port).await;
    let url = format!("redis://127.0.0.1:{}", address.port);
    let sluice = Sluice::on(
        Store::Memory,
        &[("rules.yaml", RULES)],
        &[
            "--redis-url",
            &url,
            "--redis-key-prefix",
            "failover:",
            "--store-timeout",
            "2s",
        ],
    )
    .await;

    let start = Instant::now();
    let stop = start + Duration::from_secs(1) + RESUME + Duration::from_secs(2);
    let callers = load(&sluice, stop).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let failing_over = Instant::now();
    new.cli(&["REPLICAOF", "NO", "ONE"]);
    let promoted = new.port.to_string();
    old.cli(&["REPLICAOF", "127.0.0.1", &promoted]);
    address.switch(new.port);
    let moved = Instant::now();
    let answers = gather(callers).await;

    let before: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.received < failing_over)
        .collect();
    assert!(!before.is_empty() && before.iter().all(|a| a.decided));
    let last_undecided = answers
        .iter()
        .filter(|a| !a.decided)
        .map(|a| a.received)
        .max();
    eprintln!(
        "decided again {:?} after the failover began ({} of {} answers undecided)",
        last_undecided.map_or(Duration::ZERO, |at| at
            .saturating_duration_since(failing_over)),
        answers.iter().filter(|a| !a.decided).count(),
        answers.len()
    );
    let late: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent >= moved + RESUME)
        .collect();
    assert!(
        !late.is_empty(),
        "no request was sent {RESUME:?} after the failover"
    );
    let undecided = late.iter().filter(|a| !a.decided).count();
    assert_eq!(
        undecided,
        0,
        "{undecided} of {} requests sent from {RESUME:?} after the failover were not decided",
        late.len()
    );
    assert_eq!(
        new.cli(&["ROLE"]).lines().next(),
        Some("master"),
        "the old replica is the primary"
    );
    let log = sluice.log_text();
    assert!(
        log.contains("READONLY") && log.contains("reconnecting"),
        "{log}"
    );
}
