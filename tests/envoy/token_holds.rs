//! Token budgets that hold, through a real Envoy configured as `examples/envoy-llm.yaml` says,
//! with `examples/rules/llm.yaml` (a `/probe` route added for the readiness check, its ports and
//! the filter's timeout the test's own): the rate limit filter asks at the request with the
//! request's `x-request-id` and `x-model` among the descriptor's entries and no hits of its own
//! (`hits_addend: 0`), so sluice holds the rule's estimate (1,000 tokens); once the response is
//! done (`apply_on_stream_done`) it asks again for the same request with the tokens the upstream
//! reported (read from dynamic metadata that Envoy's `header_to_metadata` filter sets from the
//! response's `x-tokens`) and the entry `phase=response` that only that call carries, which
//! settles the hold at the real cost, weighted by the model's weight.
//!
//! - Concurrent requests hold their estimate: 50 started together on a budget of 10,000 let
//!   exactly 10 through, settled at 300 each the budget admits one at a time until an estimate
//!   no longer fits (9,300 spent); the same flow on a rule without holds (counted `always`, as
//!   Envoy Gateway's response costs are) shows the overspend that holds prevent.
//! - A client's own `x-request-id` (which reaches sluice when Envoy is not the edge:
//!   `use_remote_address: false`) buys nothing: one id for every request admits the first alone,
//!   a request overlapping another under its id is refused, and every admitted request is
//!   charged.
//! - A request whose response brings no count (the upstream reset, a 503 without `x-tokens`) is
//!   charged its estimate once its hold expires (a rule with `ttl: 2s`).
//! - Models of different weights draw one budget in proportion; a request without `x-user` or
//!   `x-model` is refused by the route, sluice never asked.
//!
//! Needs the Envoy binary, as `tests/envoy/token_budget.rs`.

use super::token_budget;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::envoy::{Envoy, Upstream, envoy_binary, replaced_once};
use support::metrics::scrape;
use support::{HOUR, Sluice, eventually, exchange, http, in_one_window, repo_file};

/// The budget, in tokens an hour.
const BUDGET: u64 = 10_000;
/// What a request holds while it runs.
const ESTIMATE: u64 = 1_000;
/// What each request really costs, in the first test.
const COST: u64 = 300;
/// Requests started together.
const CONCURRENT: usize = 50;
/// The model of weight 1, and the one of weight 10 (`examples/rules/llm.yaml`).
const MINI: &str = "gpt-4o-mini";
const DEAR: &str = "gpt-4o";
/// The held rule, as sluice's metrics name it.
const RULE: &str = "user.request_id";
/// How long a test waits for something Envoy or sluice does on its own.
const WAIT: Duration = Duration::from_secs(15);

/// The same budget without holds, charged once each response is done.
const PLAIN: &str = "\
domain: plain
descriptors:
  - key: user
    counting: always
    rate_limit: {unit: hour, requests_per_unit: 10000}
";

/// `examples/envoy-llm.yaml` on the given ports, its rate limit filter given time on a busy
/// machine, a `/probe` route (to the model, unchecked) for `Envoy::launch`'s readiness check,
/// and `changes` of the test's own.
fn example(
    listener: SocketAddr,
    admin: SocketAddr,
    model: SocketAddr,
    sluice: SocketAddr,
    changes: &[(&str, String)],
) -> String {
    let mut all = vec![
        (
            "port_value: 10010",
            format!("port_value: {}", listener.port()),
        ),
        ("port_value: 9911", format!("port_value: {}", admin.port())),
        ("port_value: 8010", format!("port_value: {}", model.port())),
        ("port_value: 8081", format!("port_value: {}", sluice.port())),
        ("timeout: 0.25s", "timeout: 5s".to_owned()),
        (
            "                      routes:\n",
            "                      routes:\n                        \
             - match: { prefix: /probe }\n                          \
             route: { cluster: model }\n"
                .to_owned(),
        ),
    ];
    all.extend(changes.iter().map(|(from, to)| (*from, to.clone())));
    replaced_once("examples/envoy-llm.yaml", &all)
}

/// The example as it is, but for a proxy that is not the edge: a client's `x-request-id` reaches
/// sluice.
fn client_ids() -> Vec<(&'static str, String)> {
    vec![(
        "use_remote_address: true",
        "use_remote_address: false".to_owned(),
    )]
}

/// sluice with `examples/rules/llm.yaml` (`rules` changed in it), the test upstream, and Envoy
/// as `example` makes it with `changes`.
struct Stack {
    sluice: Sluice,
    upstream: Upstream,
    envoy: Envoy,
    /// What the upstream had answered once Envoy was ready (its readiness probes).
    probed: usize,
}

impl Stack {
    async fn start(rules: &[(&str, String)], changes: &[(&str, String)]) -> Stack {
        let rules = replaced_once("examples/rules/llm.yaml", rules);
        let sluice = Sluice::start_with(&[("llm.yaml", &rules)], &[]).await;
        let upstream = Upstream::start();
        let envoy = Envoy::launch(&envoy_binary(), &|listener, admin| {
            example(listener, admin, upstream.addr, sluice.grpc, changes)
        });
        let probed = upstream.served();
        Stack {
            sluice,
            upstream,
            envoy,
            probed,
        }
    }

    /// Requests the upstream has answered since Envoy was ready.
    fn served(&self) -> u64 {
        (self.upstream.served() - self.probed) as u64
    }
}

/// A request through Envoy: its headers, besides `Host` and `Connection`.
#[derive(Clone)]
struct Call(Vec<(&'static str, String)>);

impl Call {
    /// A request of `user` to `model`.
    fn new(user: &str, model: &str) -> Call {
        Call(vec![
            ("x-user", user.to_owned()),
            ("x-model", model.to_owned()),
        ])
    }

    /// The request with the header `name` set to `value` as well.
    fn with(mut self, name: &'static str, value: impl ToString) -> Call {
        self.0.push((name, value.to_string()));
        self
    }

    /// Sends it to `listener`: the response's status and its `x-ratelimit-remaining`.
    fn send(&self, listener: SocketAddr) -> (u16, Option<u64>) {
        let headers: String = self
            .0
            .iter()
            .map(|(name, value)| format!("{name}: {value}\r\n"))
            .collect();
        let head =
            format!("GET / HTTP/1.1\r\nHost: localhost\r\n{headers}Connection: close\r\n\r\n");
        let (status, headers, _) = exchange(listener, head.as_bytes());
        let remaining = headers
            .iter()
            .find(|(name, _)| name == "x-ratelimit-remaining")
            .and_then(|(_, value)| value.parse().ok());
        (status, remaining)
    }

    /// `send`, off the async runtime's threads.
    async fn sent(&self, listener: SocketAddr) -> (u16, Option<u64>) {
        let call = self.clone();
        tokio::task::spawn_blocking(move || call.send(listener))
            .await
            .expect("the request runs")
    }
}

/// A request of `user` to gpt-4o-mini (weight 1) whose upstream answers after `delay_ms`
/// reporting `COST` tokens: its status and its `x-ratelimit-remaining`.
fn call(listener: SocketAddr, user: &str, delay_ms: u64) -> (u16, Option<u64>) {
    Call::new(user, MINI)
        .with("x-cost", COST)
        .with("x-delay-ms", delay_ms)
        .send(listener)
}

/// `CONCURRENT` requests started together, each answered by the upstream after a second: how
/// many were let through.
async fn together(listener: SocketAddr, user: &'static str) -> u64 {
    let calls: Vec<_> = (0..CONCURRENT)
        .map(|_| tokio::task::spawn_blocking(move || call(listener, user, 1_000)))
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
fn holds(sluice: &Sluice, outcome: &str) -> u64 {
    scrape(sluice.http)
        .get(
            "sluice_holds_total",
            &[("domain", "llm"), ("rule", RULE), ("outcome", outcome)],
        )
        .unwrap_or(0.0) as u64
}

/// Holds found expired unsettled, so far.
fn expired(sluice: &Sluice) -> u64 {
    scrape(sluice.http)
        .get(
            "sluice_holds_expired_total",
            &[("domain", "llm"), ("rule", RULE)],
        )
        .unwrap_or(0.0) as u64
}

/// Waits (at most `WAIT`) until `n` holds have been settled: Envoy settles after the response
/// has reached the client.
async fn settled(sluice: &Sluice, n: u64) {
    let deadline = Instant::now() + WAIT;
    while holds(sluice, "settle") < n {
        assert!(
            Instant::now() < deadline,
            "{} holds settled, not {n}",
            holds(sluice, "settle")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What `user`'s budget holds, as sluice's `POST /counters` shows it.
#[derive(Debug, PartialEq, Eq)]
struct Budget {
    /// Tokens charged (settled, and the estimates of expired holds found so far).
    used: u64,
    /// Tokens the holds in flight hold, and how many they are.
    held: u64,
    holds: u64,
}

fn budget(sluice: &Sluice, user: &str) -> Budget {
    let body = serde_json::json!({
        "domain": "llm",
        "action": "show",
        "descriptors": [{"entries": [
            {"key": "user", "value": user},
            {"key": "request_id", "value": "any"},
        ]}],
    });
    let (status, _, text) = http(sluice.http, "POST", "/counters", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let counters = answer["counters"].as_array().expect("counters");
    assert_eq!(counters.len(), 1, "one counter, the user's budget: {text}");
    let field = |name: &str| {
        counters[0]["before"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {text}"))
    };
    Budget {
        used: field("used"),
        held: field("held"),
        holds: field("holds"),
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
            example(listener, admin, upstream.addr, sluice.grpc, &[])
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
            let (status, remaining) = call(envoy.listener, "alice", 0);
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
        assert_eq!(
            budget(&sluice, "alice"),
            Budget {
                used: spent,
                held: 0,
                holds: 0
            }
        );
        assert_eq!(holds(&sluice, "unheld"), 0);
        assert_eq!(holds(&sluice, "reused"), 0);

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

/// Requests sent by a client that names every one of them with one `x-request-id`.
const SAME_ID: usize = 30;

#[tokio::test(flavor = "multi_thread")]
async fn one_request_id_for_every_request_admits_the_first_alone_and_charges_it() {
    in_one_window(HOUR, async || {
        let stack = Stack::start(&[], &client_ids()).await;
        let listener = stack.envoy.listener;
        // Each costs its estimate: were the id ignored, ten would be admitted.
        let request = Call::new("carol", MINI)
            .with("x-request-id", "one-id-for-all")
            .with("x-cost", ESTIMATE);
        let mut admitted = 0;
        for _ in 0..SAME_ID {
            let (status, _) = request.sent(listener).await;
            assert!(status == 200 || status == 429, "status {status}");
            admitted += u64::from(status == 200);
        }
        settled(&stack.sluice, admitted).await;
        let budget = budget(&stack.sluice, "carol");
        let reused = holds(&stack.sluice, "reused");
        println!(
            "one id for {SAME_ID} requests: {admitted} admitted, {reused} refused as reused; \
             {budget:?}"
        );
        assert!(admitted <= BUDGET / ESTIMATE, "{admitted} of {SAME_ID}");
        // Held, then settled: the id stays known to the counter for a ttl, each later request
        // refused without being charged.
        assert_eq!(admitted, 1, "the first request alone");
        assert_eq!(reused, SAME_ID as u64 - admitted);
        assert_eq!(stack.served(), admitted);
        assert_eq!(
            budget,
            Budget {
                used: admitted * ESTIMATE,
                held: 0,
                holds: 0
            },
            "every admitted request charged"
        );
    })
    .await;
}

/// Pairs of requests under one id each, the second sent while the first runs.
const PAIRS: usize = 15;

/// Two requests of `dave` under the id `id`, each costing its estimate: the first answered by
/// the upstream two seconds after it came, the second sent once sluice has decided the first
/// (refused it, or held it: it is at the upstream). Their statuses, and whether the first was
/// still running when the second was sent.
async fn pair(listener: SocketAddr, upstream: &Upstream, id: String) -> (u16, u16, bool) {
    let request = Call::new("dave", MINI)
        .with("x-request-id", &id)
        .with("x-cost", ESTIMATE);
    let first = {
        let request = request.clone().with("x-delay-ms", 2_000);
        tokio::task::spawn_blocking(move || request.send(listener))
    };
    eventually(
        &format!("{id}'s first request is decided"),
        WAIT,
        async || first.is_finished() || upstream.received(&id),
    )
    .await;
    let running = !first.is_finished();
    let (second, _) = request.sent(listener).await;
    let (first, _) = first.await.expect("the request runs");
    (first, second, running)
}

#[tokio::test(flavor = "multi_thread")]
async fn overlapping_requests_under_one_id_admit_the_first_alone() {
    in_one_window(HOUR, async || {
        let stack = Stack::start(&[], &client_ids()).await;
        let (listener, upstream) = (stack.envoy.listener, &stack.upstream);
        // Each pair's first: answered by the upstream two seconds after it came, costing its
        // estimate; the pairs all at once, more than the budget holds.
        let pairs = futures_util::future::join_all(
            (0..PAIRS).map(|i| pair(listener, upstream, format!("pair-{i}"))),
        )
        .await;
        let firsts = pairs.iter().filter(|(first, ..)| *first == 200).count() as u64;
        let seconds = pairs.iter().filter(|(_, second, _)| *second == 200).count() as u64;
        let overlapped = pairs.iter().filter(|(.., running)| *running).count();
        for (first, second, _) in &pairs {
            assert!(*first == 200 || *first == 429, "status {first}");
            assert_eq!(*second, 429, "the second of a pair refused");
        }
        settled(&stack.sluice, firsts).await;
        let budget = budget(&stack.sluice, "dave");
        let reused = holds(&stack.sluice, "reused");
        println!(
            "{PAIRS} pairs under one id each: {firsts} first and {seconds} second requests \
             admitted, {overlapped} seconds sent while their first ran, {reused} refused as \
             reused; {budget:?}"
        );
        assert!(
            firsts + seconds <= BUDGET / ESTIMATE,
            "{firsts} + {seconds}"
        );
        assert_eq!(firsts, BUDGET / ESTIMATE, "as many as the budget holds");
        // The second of each admitted first is refused for its id (the others find no room).
        assert_eq!(
            reused, firsts,
            "each second whose first was admitted: reused"
        );
        assert!(overlapped > 0, "no second request overlapped its first");
        assert_eq!(stack.served(), firsts);
        assert_eq!(
            budget,
            Budget {
                used: firsts * ESTIMATE,
                held: 0,
                holds: 0
            },
            "every admitted request charged"
        );
    })
    .await;
}

/// The hold's time to live in the test of requests that never settle.
const SHORT_TTL: &str = "ttl: 2s";

#[tokio::test(flavor = "multi_thread")]
async fn requests_whose_response_brings_no_count_are_charged_their_estimate_once_it_expires() {
    in_one_window(HOUR, async || {
        let stack = Stack::start(&[("ttl: 60s", SHORT_TTL.to_owned())], &[]).await;
        let listener = stack.envoy.listener;
        let failures = ["reset", "no-tokens", "reset", "no-tokens"];
        for fail in failures {
            let request = Call::new("erin", MINI)
                .with("x-cost", 100)
                .with("x-fail", fail);
            let (status, _) = request.sent(listener).await;
            assert_eq!(status, 503, "x-fail: {fail}");
        }
        let failed = failures.len() as u64;
        // Nothing to settle with: the holds stay until they expire.
        let before = budget(&stack.sluice, "erin");
        assert_eq!(
            before,
            Budget {
                used: 0,
                held: failed * ESTIMATE,
                holds: failed
            }
        );
        // A hold is found expired by a call on its counter: requests that cost nothing, until
        // the counter shows the estimates charged.
        let probe = Call::new("erin", MINI).with("x-cost", 0);
        let began = Instant::now();
        let mut probes = 0;
        eventually(
            "the holds that never settled are charged their estimate",
            WAIT,
            async || {
                let (status, _) = probe.sent(listener).await;
                assert_eq!(status, 200);
                probes += 1;
                budget(&stack.sluice, "erin").used >= failed * ESTIMATE
            },
        )
        .await;
        let charged_after = began.elapsed();
        settled(&stack.sluice, probes).await;
        let after = budget(&stack.sluice, "erin");
        println!(
            "{failed} requests without a count ({failures:?}): {before:?}; charged {} \
             {charged_after:?} later ({probes} probes), {after:?}; {} holds expired",
            after.used,
            expired(&stack.sluice)
        );
        assert_eq!(
            after,
            Budget {
                used: failed * ESTIMATE,
                held: 0,
                holds: 0
            },
            "each charged its estimate, once"
        );
        assert_eq!(expired(&stack.sluice), failed);
        assert_eq!(
            holds(&stack.sluice, "unheld"),
            0,
            "no settle without a count"
        );
        assert_eq!(holds(&stack.sluice, "settle"), probes);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn models_draw_one_budget_in_proportion_to_their_weights() {
    in_one_window(HOUR, async || {
        let stack = Stack::start(&[], &[]).await;
        let listener = stack.envoy.listener;
        // Refused by the route, sluice never asked.
        let (status, _) = Call(vec![("x-model", MINI.to_owned())]).send(listener);
        assert_eq!(status, 401, "without x-user");
        let (status, _) = Call(vec![("x-user", "frank".to_owned())]).send(listener);
        assert_eq!(status, 400, "without x-model");
        assert_eq!(stack.served(), 0);
        assert_eq!(holds(&stack.sluice, "held"), 0);

        // 100 tokens of each model; one not listed weighs the rule's default (10).
        let mut used = 0;
        let mut settles = 0;
        for (model, weight) in [(MINI, 1), (DEAR, 10), ("llama-3", 10), (MINI, 1)] {
            let (status, _) = Call::new("frank", model)
                .with("x-cost", 100)
                .sent(listener)
                .await;
            assert_eq!(status, 200, "{model}");
            settles += 1;
            settled(&stack.sluice, settles).await;
            let now = budget(&stack.sluice, "frank");
            println!(
                "100 tokens of {model}: the budget grew by {}",
                now.used - used
            );
            assert_eq!(now.used - used, 100 * weight, "{model}: {now:?}");
            assert_eq!((now.held, now.holds), (0, 0));
            used = now.used;
        }
        assert_eq!(used, 2_200);
    })
    .await;
}
