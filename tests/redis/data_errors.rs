//! A Redis key where a counter should be that holds something else (another writer on the
//! prefix, a rolling upgrade, a hand edit): only the requests on that key fail, answered by
//! `--on-store-error` with a message naming the key; every other request, batched with them or
//! not, is decided; the breaker never opens and the store stays ready. On a standalone server, a
//! Cluster (one call per slot), and for the quota service's demand records.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use support::metrics::scrape;
use support::quota::{QuotaStream, bucket, tokens};
use support::{OK, OVER_LIMIT, Sluice, Store, gather, http, redis_key, request};

const DOMAIN: &str = "data";

/// Limits the healthy callers never reach (they ask on `k` only), on each kind of counter sluice
/// writes: a fixed window and a token bucket (hashes), a sliding log (a
/// sorted set).
const RULES: &str = "
domain: data
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
  - key: log
    rate_limit: {unit: hour, requests_per_unit: 1000, algorithm: sliding_log}
  - key: bucket
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: token_bucket}
";

/// Callers on healthy keys, each on a connection of its own, beside the callers on bad keys.
const HEALTHY_CALLERS: usize = 6;
/// How long the callers ask.
const RUN: Duration = Duration::from_secs(3);
/// The most requests one caller sends, whatever the machine's speed.
const MOST_PER_CALLER: usize = 3_000;

/// Runs `redis-cli -c` (following a Cluster's redirections) against the node at `port`.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-c", "-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs (install redis-tools)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What one caller's answers were.
#[derive(Default)]
struct Answers {
    /// Decided by the store: OK with the limit in the status.
    decided: usize,
    /// The `--on-store-error` answer, naming the key where the answer is an error.
    policy: usize,
    /// Anything else, described.
    other: Vec<String>,
}

/// Asks `ask` over and over on a connection of its own until `stop` (at most
/// `MOST_PER_CALLER` times), tallying the answers; `bad_key` is the key it asks on when that
/// key is a bad one.
async fn caller(
    sluice: &Sluice,
    ask: RateLimitRequest,
    bad_key: Option<String>,
    deny: bool,
    stop: Instant,
) -> tokio::task::JoinHandle<Vec<Answers>> {
    let mut client = sluice.client().await;
    tokio::spawn(async move {
        let mut answers = Answers::default();
        for _ in 0..MOST_PER_CALLER {
            if Instant::now() >= stop {
                break;
            }
            let answer = tokio::time::timeout(
                Duration::from_secs(5),
                client.should_rate_limit(ask.clone()),
            )
            .await;
            let kind = match (&bad_key, answer) {
                (_, Err(_)) => Err("no answer within 5 s".to_owned()),
                (None, Ok(Ok(r))) => {
                    let r = r.into_inner();
                    if r.overall_code == OK && r.statuses[0].current_limit.is_some() {
                        Ok(true)
                    } else {
                        Err(format!("{r:?}"))
                    }
                }
                (Some(_), Ok(Ok(r))) if deny && r.get_ref().overall_code == OVER_LIMIT => Ok(false),
                (Some(key), Ok(Err(s)))
                    if !deny
                        && s.code() == tonic::Code::Unavailable
                        && s.message().contains(key.as_str()) =>
                {
                    Ok(false)
                }
                (_, Ok(other)) => Err(format!("{other:?}")),
            };
            match kind {
                Ok(true) => answers.decided += 1,
                Ok(false) => answers.policy += 1,
                Err(what) => answers.other.push(what),
            }
        }
        vec![answers]
    })
}

/// Polls `/readyz` until `stop`, counting the answers that were not 200.
fn watch_readiness(http_addr: SocketAddr, stop: Arc<AtomicBool>) -> Arc<AtomicUsize> {
    let unready = Arc::new(AtomicUsize::new(0));
    let count = unready.clone();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            if http(http_addr, "GET", "/readyz", "").0 != 200 {
                count.fetch_add(1, Ordering::Relaxed);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    unready
}

/// Asserts the store never counted an outage: no error of another kind than `data`, no breaker
/// open, nothing logged about Redis being down.
fn no_outage_seen(sluice: &Sluice, family: &str) {
    let scrape = scrape(sluice.http);
    for kind in ["timeout", "shed", "down", "unavailable"] {
        assert_eq!(
            scrape.value(family, &[("kind", kind)]),
            0.0,
            "{family} of kind {kind}"
        );
    }
    assert_eq!(scrape.value("sluice_store_breakers_open", &[]), 0.0);
    assert_eq!(scrape.value("sluice_store_reachable", &[]), 1.0);
    let log = sluice.log_text();
    assert!(!log.contains("Redis marked down"), "{log}");
}

/// Three bad keys, one per kind of counter: a string where a fixed window's hash should be, a
/// list where a sliding log's sorted set should be, a bucket's hash with a level that is not a
/// number. Their callers ask beside `HEALTHY_CALLERS` healthy ones for `RUN`: every healthy
/// request is decided, every bad one gets the policy's answer (`deny`, or an error naming the
/// key), the breaker never opens, and a request naming a bad key and a healthy one moves
/// neither counter.
async fn bad_keys_fail_only_their_own_requests(store: Store, deny: bool) {
    let policy = if deny { "deny" } else { "error" };
    let sluice = Sluice::on(
        store,
        &[("rules.yaml", RULES)],
        &["--on-store-error", policy],
    )
    .await;
    let port = store.redis().unwrap().ports[0];
    let string = redis_key(&sluice, DOMAIN, &[("k", "bad-string")]);
    let list = redis_key(&sluice, DOMAIN, &[("log", "bad-list")]);
    let hash = redis_key(&sluice, DOMAIN, &[("bucket", "bad-hash")]);
    // The bucket's key as sluice writes it, then its level made unreadable.
    sluice
        .ask(request(DOMAIN, &[&[("bucket", "bad-hash")]]))
        .await;
    assert_eq!(cli(port, &["TYPE", &hash]).trim(), "hash", "{hash}");
    cli(port, &["HSET", &hash, "l", "not-a-number"]);
    cli(port, &["SET", &string, "written by someone else"]);
    cli(port, &["LPUSH", &list, "written by someone else"]);

    let stop_watching = Arc::new(AtomicBool::new(false));
    let unready = watch_readiness(sluice.http, stop_watching.clone());
    let stop = Instant::now() + RUN;
    let mut healthy = Vec::new();
    for i in 0..HEALTHY_CALLERS {
        let value = format!("healthy-{i}");
        let ask = request(DOMAIN, &[&[("k", value.as_str())]]);
        healthy.push(caller(&sluice, ask, None, deny, stop).await);
    }
    let mut bad = Vec::new();
    for (entry, key) in [
        (("k", "bad-string"), &string),
        (("log", "bad-list"), &list),
        (("bucket", "bad-hash"), &hash),
    ] {
        let ask = request(DOMAIN, &[&[entry]]);
        bad.push(caller(&sluice, ask, Some(key.clone()), deny, stop).await);
    }
    let healthy = gather(healthy).await;
    let bad = gather(bad).await;
    stop_watching.store(true, Ordering::Relaxed);

    let asked: usize = healthy.iter().map(|a| a.decided + a.other.len()).sum();
    let decided: usize = healthy.iter().map(|a| a.decided).sum();
    eprintln!(
        "{store:?}: {decided} of {asked} healthy requests decided ({:.2} %) beside {} requests on bad keys",
        100.0 * decided as f64 / asked.max(1) as f64,
        bad.iter().map(|a| a.policy + a.other.len()).sum::<usize>()
    );
    for answers in healthy.iter().chain(&bad) {
        assert!(
            answers.other.is_empty(),
            "{} unexpected answers, the first: {}",
            answers.other.len(),
            answers.other[0]
        );
    }
    assert!(healthy.iter().all(|a| a.decided > 0 && a.policy == 0));
    assert!(bad.iter().all(|a| a.policy > 0 && a.decided == 0));
    assert_eq!(
        unready.load(Ordering::Relaxed),
        0,
        "/readyz answered other than 200"
    );
    no_outage_seen(&sluice, "sluice_store_errors_total");
    let on_bad: usize = bad.iter().map(|a| a.policy).sum();
    let data = scrape(sluice.http).value("sluice_store_errors_total", &[("kind", "data")]);
    assert_eq!(
        data, on_bad as f64,
        "every bad key's request counted as data"
    );

    // A request naming a bad key and a healthy one: answered by the policy, neither moved.
    let beside = redis_key(&sluice, DOMAIN, &[("k", "beside")]);
    for _ in 0..5 {
        let answer = sluice
            .client()
            .await
            .should_rate_limit(request(
                DOMAIN,
                &[&[("k", "beside")], &[("k", "bad-string")]],
            ))
            .await;
        match answer {
            Ok(r) => assert!(deny && r.get_ref().overall_code == OVER_LIMIT, "{r:?}"),
            Err(s) => assert!(!deny && s.message().contains(&string), "{s:?}"),
        }
    }
    // The refunds are queued before the answers, and land a moment later.
    let refunded = |counts: &String| counts.split_whitespace().all(|c| c == "0");
    let counts = support::settled(
        Duration::from_secs(5),
        || cli(port, &["HVALS", &beside]),
        refunded,
    )
    .await;
    assert!(
        refunded(&counts),
        "the healthy counter of a request on a bad key holds {counts:?}"
    );
    assert_eq!(cli(port, &["TYPE", &string]).trim(), "string", "left alone");
}

#[tokio::test(flavor = "multi_thread")]
async fn on_redis_a_wrong_typed_key_fails_only_its_own_requests_and_never_opens_the_breaker() {
    bad_keys_fail_only_their_own_requests(Store::Redis, false).await
}

#[tokio::test(flavor = "multi_thread")]
async fn on_a_cluster_a_wrong_typed_key_gets_the_deny_answer_and_never_opens_the_breaker() {
    bad_keys_fail_only_their_own_requests(Store::Cluster, true).await
}

const QUOTA_RULES: &str = "
domain: data-quota
quota_buckets:
  - bucket: {name: per-tenant, tenant: '*'}
    rate_limit: {unit: second, requests_per_unit: 20}
";

/// A quota bucket whose demand record holds a string: its reports keep the last assignment,
/// are counted as data errors, and never open the breaker; requests on other keys are decided.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_typed_quota_demand_key_keeps_its_assignment_and_never_opens_the_breaker() {
    let prefix = format!("data-quota-{}-{}:", std::process::id(), support::unix_ms());
    let sluice = Sluice::on(
        Store::Redis,
        &[("quota.yaml", QUOTA_RULES), ("rules.yaml", RULES)],
        &["--redis-key-prefix", &prefix],
    )
    .await;
    let port = Store::Redis.redis().unwrap().ports[0];
    let mut envoy = QuotaStream::open(&sluice, "data-quota").await;
    let acme = bucket(&[("name", "per-tenant"), ("tenant", "acme")]);
    assert_eq!(tokens(&envoy.ask(&acme, 1, 0).await, 1), 20);
    let pattern = format!("{prefix}*");
    let keys = cli(port, &["--scan", "--pattern", &pattern]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    let [demand] = keys[..] else {
        panic!("one demand record, found {keys:?}")
    };
    cli(port, &["DEL", demand]);
    cli(port, &["SET", demand, "written by someone else"]);

    let reports = 3 * 5;
    for _ in 0..reports {
        assert_eq!(
            tokens(&envoy.ask(&acme, 1, 0).await, 1),
            20,
            "the last assignment"
        );
        assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 200);
    }
    let answer = sluice.ask(request(DOMAIN, &[&[("k", "healthy")]])).await;
    assert_eq!(answer.overall_code, OK);
    assert!(answer.statuses[0].current_limit.is_some(), "decided");
    no_outage_seen(&sluice, "sluice_quota_store_errors_total");
    let data = scrape(sluice.http).value("sluice_quota_store_errors_total", &[("kind", "data")]);
    assert_eq!(data, reports as f64);
    let log = sluice.log_text();
    assert!(log.contains(demand), "the log names the key: {log}");
}
