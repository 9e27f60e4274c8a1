//! A Redis Cluster, where a request is one script call per hash slot: a request denied in one slot
//! after another admitted it never over-admits, even when its refund lands in the next window, and
//! a caller that gives up mid-request leaves no counter moved.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use support::redis::{Redis, Stopped, cli, dedicated_cluster, pid_of};
use support::{OK, Sluice, Store, gather, request, sleep_until_unix_ms, unix_ms};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

const DOMAIN: &str = "split";
/// The value of descriptor `a` in every test; `b`'s is chosen to put its counter on another node.
const A: &str = "x";
/// A limit on both descriptors that no test reaches, so that each request writes its counters.
const ROOMY: &str = "domain: split\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

/// Every key under `prefix` in the cluster, with the port of the node holding it.
fn keys(cluster: &Redis, prefix: &str) -> Vec<(u16, String)> {
    let pattern = format!("{prefix}*");
    cluster
        .ports
        .iter()
        .flat_map(|&port| {
            cli(port, &["--scan", "--pattern", &pattern])
                .lines()
                .filter(|k| !k.is_empty())
                .map(|k| (port, k.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Where `a=A` and some `b` keep their counters, on two different nodes.
struct Split {
    b: String,
    a_port: u16,
    b_port: u16,
}

/// Finds a value of `b` whose counters live on another node than `a=A`'s. A scout sluice with a
/// key prefix of its own counts one request per descriptor and looks where its key appears: the
/// slot of a counter depends on its descriptor alone, not on the prefix or the limit.
async fn on_different_nodes(cluster: &Redis) -> Split {
    let scout = Sluice::on(
        Store::Memory,
        &[("rules.yaml", ROOMY)],
        &["--redis-url", &cluster.url, "--redis-key-prefix", "scout:"],
    )
    .await;
    let node_of = async |key: &str, value: &str| {
        let before = keys(cluster, "scout:");
        scout.ask(request(DOMAIN, &[&[(key, value)]])).await;
        keys(cluster, "scout:")
            .into_iter()
            .find(|k| !before.contains(k))
            .expect("the request wrote its counter")
            .0
    };
    let a_port = node_of("a", A).await;
    for b in 0..100 {
        let b = b.to_string();
        let b_port = node_of("b", &b).await;
        if b_port != a_port {
            return Split { b, a_port, b_port };
        }
    }
    panic!("100 values of b all on the node of a={A}");
}

/// sluice on `cluster`, without the local over-limit cache: these tests follow each request's
/// script calls and refunds, which a request denied locally never makes.
async fn sluice_on(cluster: &Redis, rules: &str, prefix: &str) -> Sluice {
    Sluice::on(
        Store::Memory,
        &[("rules.yaml", rules)],
        &[
            "--redis-url",
            &cluster.url,
            "--redis-key-prefix",
            prefix,
            "--local-cache-size",
            "0",
        ],
    )
    .await
}

/// An answer, with the times (Unix ms) its request left and its answer arrived.
struct Timed {
    sent: u64,
    received: u64,
    answer: Result<RateLimitResponse, tonic::Status>,
}

async fn ask_timed(client: &mut RateLimitServiceClient<Channel>, ask: &RateLimitRequest) -> Timed {
    let sent = unix_ms();
    let answer = client
        .should_rate_limit(ask.clone())
        .await
        .map(tonic::Response::into_inner);
    Timed {
        sent,
        received: unix_ms(),
        answer,
    }
}

/// `n` callers, each on a connection of its own, sending `ask` every 25 ms until `stop`, but for
/// the `quiet` span (Unix ms).
async fn callers(
    sluice: &Sluice,
    ask: &RateLimitRequest,
    n: usize,
    quiet: Range<u64>,
    stop: u64,
) -> Vec<JoinHandle<Vec<Timed>>> {
    let mut callers = Vec::with_capacity(n);
    for _ in 0..n {
        let (mut client, ask, quiet) = (sluice.client().await, ask.clone(), quiet.clone());
        callers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            while unix_ms() < stop {
                if quiet.contains(&unix_ms()) {
                    sleep_until_unix_ms(quiet.end).await;
                    continue;
                }
                let answer = ask_timed(&mut client, &ask).await;
                let next = answer.sent + 25;
                answers.push(answer);
                sleep_until_unix_ms(next).await;
            }
            answers
        }));
    }
    callers
}

/// How long after a request was sent the script of `a`'s slot has run, at most, for the
/// straddling `[a, b]` requests sent while nothing else is in flight: that node is never paused.
const PROMPT: u64 = 100;

/// The end (Unix ms) of the per-second window in which a decided status of `a` counted, when
/// the answer proves it: it came in the second it was sent (a whole-second reset says nothing
/// more). The script read Redis' clock (this machine's) between sending and receiving.
fn window_end(t: &Timed, status: &DescriptorStatus) -> Option<u64> {
    let reset = status
        .duration_until_reset
        .expect("a decided status has its reset");
    assert_eq!((reset.seconds, reset.nanos), (1, 0), "a per-second reset");
    let end = (t.sent / 1000 + 1) * 1000;
    (t.received < end).then_some(end)
}

/// The end of the window `a` was charged in by a straddling `[a, b]`, sent more than `PROMPT`
/// before its second's end, whose answer waited for `b`'s paused node.
fn charged_window_end(t: &Timed) -> Option<u64> {
    let end = (t.sent / 1000 + 1) * 1000;
    (t.sent + PROMPT < end).then_some(end)
}

/// 5 per second on `a=A`; `b` always denies, in a slot on another node. Callers send `[a]` alone
/// and `[a, b]`, whose slot for `a` admits and charges, refunded once `b`'s slot denies. Around one
/// window edge, `b`'s node is paused for 0.55 s (below the 1 s after which sluice's health check
/// would mark the whole store down): `[a, b]` requests sent just before the edge charge `a` in
/// that window and are refunded only in the next, after `[a]` alone has used its limit there.
/// `[a]` alone keeps quiet in the window before the edge, so that those `[a, b]` find room to
/// charge. A refund into the next window's count would let that window admit up to 10.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_denied_in_another_slot_never_over_admits_even_when_refunded_in_the_next_window()
{
    let cluster = dedicated_cluster();
    let split = on_different_nodes(&cluster).await;
    let rules = "domain: split\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 0}\n";
    let sluice = sluice_on(&cluster, rules, "edge:").await;
    let alone = request(DOMAIN, &[&[("a", A)]]);
    let pair = request(DOMAIN, &[&[("a", A)], &[("b", &split.b)]]);
    let b_pid = pid_of(split.b_port);

    // Load from at least 0.6 s before the window that ends at `edge` to the end of the next.
    let edge = (unix_ms() + 2_600) / 1000 * 1000;
    let stop = edge + 1_000;
    let alone_callers = callers(&sluice, &alone, 2, edge - 1_000..edge, stop).await;
    let pair_callers = callers(&sluice, &pair, 2, 0..0, stop).await;
    let mut straddlers = Vec::new();
    for _ in 0..5 {
        straddlers.push(sluice.client().await);
    }
    sleep_until_unix_ms(edge - 200).await;
    let stopped = Stopped::new(b_pid);
    sleep_until_unix_ms(edge - 150).await;
    let straddling: Vec<_> = straddlers
        .into_iter()
        .map(|mut client| {
            let pair = pair.clone();
            tokio::spawn(async move { ask_timed(&mut client, &pair).await })
        })
        .collect();
    sleep_until_unix_ms(edge + 350).await;
    let resumed = unix_ms();
    stopped.resume();
    let mut pairs = gather(pair_callers).await;
    for s in straddling {
        pairs.push(s.await.expect("a straddling request ends"));
    }

    for t in &pairs {
        assert!(
            !t.answer.as_ref().is_ok_and(|r| r.overall_code == OK),
            "b's limit is 0, yet [a, b] was admitted"
        );
    }
    let refunded_in_the_next_window = pairs
        .iter()
        .filter_map(|t| t.answer.as_ref().ok().map(|r| (t, &r.statuses[0])))
        .filter(|(t, a)| a.code == OK && charged_window_end(t).is_some_and(|end| end <= resumed))
        .count();
    assert!(
        refunded_in_the_next_window > 0,
        "no [a, b] charged a window that ended before its refund could run"
    );
    // Admissions whose window the answer proves, and those sent in a window but answered after
    // it (counted in that window or the next), by the end of the window they were sent in.
    let mut admitted: BTreeMap<u64, u32> = BTreeMap::new();
    let mut unproven: BTreeMap<u64, u32> = BTreeMap::new();
    for t in gather(alone_callers).await {
        let r = t.answer.as_ref().expect("a's node answers");
        if r.overall_code != OK {
            continue;
        }
        match window_end(&t, &r.statuses[0]) {
            Some(end) => *admitted.entry(end).or_default() += 1,
            None => *unproven.entry((t.sent / 1000 + 1) * 1000).or_default() += 1,
        }
    }
    assert!(
        admitted.values().all(|&n| n <= 5),
        "a window admitted more than 5: {admitted:?} (window end in Unix ms → [a] admitted)"
    );
    let after_edge = admitted.get(&(edge + 1_000)).copied().unwrap_or(0);
    let maybe = unproven.get(&(edge + 1_000)).copied().unwrap_or(0);
    assert!(
        after_edge + maybe >= 5,
        "[a] alone filled the window after the edge: {admitted:?}, unproven {unproven:?}"
    );
}

/// `b`'s node paused, `[a, b]` sent twice: once with a gRPC deadline that passes first, once
/// dropped by its caller (its HTTP/2 stream reset). `a`'s slot admits at once and `b`'s once its
/// node resumes; both are refunded, since neither caller got the answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_caller_that_gives_up_mid_request_leaves_no_counter_moved() {
    let cluster = dedicated_cluster();
    let split = on_different_nodes(&cluster).await;
    let sluice = sluice_on(&cluster, ROOMY, "gone:").await;
    let pair = request(DOMAIN, &[&[("a", A)], &[("b", &split.b)]]);
    let mut client = sluice.client().await;

    let stopped = Stopped::new(pid_of(split.b_port));
    let mut hasty = tonic::Request::new(pair.clone());
    hasty.set_timeout(Duration::from_millis(300));
    let answer = client.should_rate_limit(hasty).await;
    assert!(
        answer.is_err(),
        "no decision while b's node is paused: {answer:?}"
    );
    let dropped =
        tokio::time::timeout(Duration::from_millis(100), client.should_rate_limit(pair)).await;
    assert!(dropped.is_err(), "no answer while b's node is paused");
    // The stream's reset goes out on the connection ahead of the next request: once sluice has
    // answered that one (a domain it does not know, which no store call delays), it has read the
    // reset, and b's answer can no longer reach the dropped request first. A moment more lets the
    // request's task see it.
    let _ = client
        .should_rate_limit(request("elsewhere", &[&[("k", "v")]]))
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stopped.resume();

    // Once b's node runs the scripts it held, both counters exist; their refunds follow as the
    // answers come back. Wait (at most 5 s) for both, then nothing may stay charged.
    // A fixed window: a hash field per window, holding its count.
    let charged = |keys: &[(u16, String)]| -> Vec<String> {
        keys.iter()
            .filter(|(port, key)| cli(*port, &["HVALS", key]).trim() != "0")
            .map(|(_, key)| key.clone())
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (keys, held) = loop {
        let keys = keys(&cluster, "gone:");
        let both = [split.a_port, split.b_port]
            .iter()
            .all(|p| keys.iter().any(|(port, _)| port == p));
        let held = charged(&keys);
        if (both && held.is_empty()) || std::time::Instant::now() >= deadline {
            break (keys, held);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let contents: Vec<String> = keys
        .iter()
        .filter(|(_, key)| held.contains(key))
        .map(|(port, key)| format!("{key} = {}", cli(*port, &["HGETALL", key]).trim()))
        .collect();
    assert!(
        held.is_empty(),
        "{contents:?}: charges nobody was answered for"
    );
    for p in [split.a_port, split.b_port] {
        assert!(
            keys.iter().any(|(port, _)| *port == p),
            "both counters were charged, then refunded: {keys:?}"
        );
    }
}
