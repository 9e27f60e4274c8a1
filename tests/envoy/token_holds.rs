//! A token budget that holds under concurrency, through a real Envoy configured as
//! `examples/envoy-llm.yaml` says, with `examples/rules/llm.yaml`: the rate limit filter asks at
//! the request with the request's `x-request-id` among the descriptor's entries and no hits of
//! its own (`hits_addend: 0`), so sluice holds the rule's estimate (1,000 tokens); once the
//! response is done (`apply_on_stream_done`) it asks again for the same request with the tokens
//! the upstream reported (read from dynamic metadata that Envoy's `header_to_metadata` filter
//! sets from the response's `x-tokens`), which settles the hold at the real cost (300). The same
//! flow on a rule without holds (counted `always`, as Envoy Gateway's response costs are) shows
//! the overspend that holds prevent. Needs the Envoy binary, as `tests/envoy/token_budget.rs`.

use super::{common, token_budget};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::envoy::{Envoy, Upstream, envoy_binary, replaced_once};
use common::metrics::scrape;
use common::{HOUR, Sluice, exchange, in_one_window, repo_file};

/// The budget, in tokens an hour.
const BUDGET: u64 = 10_000;
/// What a request holds while it runs.
const ESTIMATE: u64 = 1_000;
/// What each request really costs.
const COST: u64 = 300;
/// Requests started together.
const CONCURRENT: usize = 50;

/// The same budget without holds, charged once each response is done.
const PLAIN: &str = "\
domain: plain
descriptors:
  - key: user
    counting: always
    rate_limit: {unit: hour, requests_per_unit: 10000}
";

/// `examples/envoy-llm.yaml` on the given ports, its rate limit filter given time on a busy
/// machine.
fn example(
    listener: SocketAddr,
    admin: SocketAddr,
    model: SocketAddr,
    sluice: SocketAddr,
) -> String {
    replaced_once(
        "examples/envoy-llm.yaml",
        &[
            (
                "port_value: 10000",
                format!("port_value: {}", listener.port()),
            ),
            ("port_value: 9901", format!("port_value: {}", admin.port())),
            ("port_value: 8000", format!("port_value: {}", model.port())),
            ("port_value: 8081", format!("port_value: {}", sluice.port())),
            ("timeout: 0.25s", "timeout: 5s".to_owned()),
        ],
    )
}

/// A request on `path` as `user`, whose upstream answers after `delay_ms` reporting `COST`
/// tokens; its status and its `x-ratelimit-remaining`.
fn call(listener: SocketAddr, path: &str, user: &str, delay_ms: u64) -> (u16, Option<u64>) {
    let head = format!(
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nx-user: {user}\r\nx-cost: {COST}\r\n\
         x-delay-ms: {delay_ms}\r\nConnection: close\r\n\r\n"
    );
    let (status, headers, _) = exchange(listener, head.as_bytes());
    let remaining = headers
        .iter()
        .find(|(name, _)| name == "x-ratelimit-remaining")
        .and_then(|(_, value)| value.parse().ok());
    (status, remaining)
}

/// `CONCURRENT` requests started together, each answered by the upstream after a second: how
/// many were let through.
async fn together(listener: SocketAddr, user: &'static str) -> u64 {
    let calls: Vec<_> = (0..CONCURRENT)
        .map(|_| tokio::task::spawn_blocking(move || call(listener, "/", user, 1_000)))
        .collect();
    let mut admitted = 0;
    for call in calls {
        let (status, _) = call.await.expect("the request runs");
        assert!(status == 200 || status == 429, "status {status}");
        admitted += u64::from(status == 200);
    }
    admitted
}

/// Calls on held counters that did `outcome`, so far.
fn holds(sluice: &Sluice, outcome: &str) -> f64 {
    scrape(sluice.http)
        .get(
            "sluice_holds_total",
            &[
                ("domain", "llm"),
                ("rule", "user.request_id"),
                ("outcome", outcome),
            ],
        )
        .unwrap_or(0.0)
}

/// Waits (at most 10 s) until `n` holds have been settled: Envoy settles after the response has
/// reached the client.
async fn settled(sluice: &Sluice, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while holds(sluice, "settle") < n as f64 {
        assert!(
            Instant::now() < deadline,
            "{} holds settled, not {n}",
            holds(sluice, "settle")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_hold_their_estimate_and_never_spend_past_the_budget() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let rules =
            std::fs::read_to_string(repo_file("examples/rules/llm.yaml")).expect("the example");
        let sluice = Sluice::start_with(&[("llm.yaml", &rules), ("plain.yaml", PLAIN)], &[]).await;
        let upstream = Upstream::start();
        let envoy = Envoy::launch(&binary, &|listener, admin| {
            example(listener, admin, upstream.addr, sluice.grpc)
        });
        let plain = Envoy::launch(&binary, &|listener, admin| {
            token_budget::bootstrap("plain", listener, admin, upstream.addr, sluice.grpc)
        });

        // Held: the budget holds ten estimates at once, whatever the requests end up costing.
        let first = together(envoy.listener, "alice").await;
        assert_eq!(
            first,
            BUDGET / ESTIMATE,
            "of {CONCURRENT} requests started together, as many as the budget holds estimates"
        );
        settled(&sluice, first).await;
        // Settled at their real cost, they leave room: one request at a time until refused.
        let mut later = 0;
        loop {
            let (status, remaining) = call(envoy.listener, "/", "alice", 0);
            match status {
                200 => later += 1,
                429 => break,
                status => panic!("status {status}"),
            }
            assert_eq!(
                remaining,
                Some(BUDGET - (first + later - 1) * COST - ESTIMATE),
                "what remains counts the request's own hold, on what the others spent"
            );
            settled(&sluice, first + later).await;
            assert!(later <= BUDGET / COST, "the budget never ends");
        }
        let spent = (first + later) * COST;
        println!(
            "holds: {first} of {CONCURRENT} admitted together, {later} more one at a time: \
             {spent} tokens spent of {BUDGET}"
        );
        assert!(spent <= BUDGET, "{spent} tokens spent, past {BUDGET}");
        assert!(
            spent + ESTIMATE > BUDGET,
            "refused only once an estimate no longer fits: {spent} spent of {BUDGET}"
        );
        assert_eq!(holds(&sluice, "unheld"), 0.0);
        assert_eq!(holds(&sluice, "duplicate"), 0.0);

        // Without holds, every request started together passes the check at 0, and each is
        // charged once done.
        let plain = together(plain.listener, "bob").await;
        let overspent = plain * COST;
        println!(
            "without holds: {plain} of {CONCURRENT} admitted together: {overspent} tokens spent \
             of {BUDGET}"
        );
        assert_eq!(plain, CONCURRENT as u64, "nothing counted yet: all pass");
        assert!(overspent > BUDGET, "{overspent} tokens spent");
    })
    .await;
}
