//! `scope:` per rule, as docs/rules.md has it: `global` counters are shared by every replica,
//! `cluster` counters by the replicas of one `--cluster-name` (each name its own, in the same
//! Redis), `replica` counters are each replica's own with no key in Redis, and `split` divides
//! the limit among the replicas live now, following one that joins, one that leaves in good
//! order and one that dies. A request with counters of both kinds is decided all or nothing:
//! the replica's own counters are given back when the store denies, and the store is not
//! charged when they deny.

use std::process::Command;
use std::time::{Duration, Instant};

use support::proxy::Proxy;
use support::{OK, Sluice, Store, request, unix_ms};

on_stores!(redis: Redis, cluster: Cluster; each_scope_counts_where_it_says, a_split_limit_follows_the_replicas_that_join_and_leave);
on_stores!(memory: Memory; a_split_limit_follows_the_replicas_that_join_and_leave);

const RULES: &str = "\
domain: scoped
descriptors:
  - key: global
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: cluster
    scope: cluster
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: replica
    scope: replica
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: split
    scope: split
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: split_s
    scope: split
    rate_limit: {unit: second, requests_per_unit: 10}
";

/// How many of `n` requests of `descriptors` `sluice` admits.
async fn admitted(sluice: &Sluice, descriptors: &[&[(&str, &str)]], n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        let answer = sluice.ask(request("scoped", descriptors)).await;
        admitted += usize::from(answer.overall_code == OK);
    }
    admitted
}

/// A replica on `store` counting under `prefix`, in cluster `name` if given.
async fn replica(store: Store, prefix: &str, name: Option<&str>) -> Sluice {
    let mut flags = vec!["--redis-key-prefix", prefix];
    if let Some(name) = name {
        flags.extend(["--cluster-name", name]);
    }
    Sluice::on(store, &[("rules.yaml", RULES)], &flags).await
}

/// Every key under `prefix` in `store`'s Redis.
fn keys(store: Store, prefix: &str) -> Vec<String> {
    let pattern = format!("{prefix}*");
    let redis = store.redis().expect("a Redis");
    redis
        .ports
        .iter()
        .flat_map(|port| {
            let out = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "--scan", "--pattern", &pattern])
                .output()
                .expect("redis-cli runs");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

async fn each_scope_counts_where_it_says(store: Store) {
    let prefix = format!("scope-{}-{}:", std::process::id(), unix_ms());
    let east = [
        replica(store, &prefix, Some("east")).await,
        replica(store, &prefix, Some("east")).await,
    ];
    let west = replica(store, &prefix, Some("west")).await;
    let all = [&east[0], &east[1], &west];
    let across = async |replicas: &[&Sluice], key: &str| {
        let mut n = 0;
        for _ in 0..2 {
            for sluice in replicas {
                n += admitted(sluice, &[&[(key, "v")]], 1).await;
            }
        }
        n
    };
    assert_eq!(
        across(&all, "global").await,
        3,
        "global: one counter for all"
    );
    assert_eq!(
        across(&[&east[0], &east[1]], "cluster").await,
        3,
        "cluster: one counter for the replicas of east"
    );
    assert_eq!(
        across(&[&west], "cluster").await,
        2,
        "cluster: west has its own (2 asked)"
    );
    assert_eq!(admitted(&west, &[&[("cluster", "v")]], 2).await, 1);
    assert_eq!(
        across(&all, "replica").await,
        6,
        "replica: each its own (2 asked of each)"
    );
    for sluice in all {
        assert_eq!(admitted(sluice, &[&[("replica", "v")]], 2).await, 1);
    }
    let keys = keys(store, &prefix);
    assert!(
        keys.iter().any(|k| k.contains(":cluster:east"))
            && keys.iter().any(|k| k.contains(":cluster:west")),
        "{keys:?}"
    );
    assert!(
        !keys.iter().any(|k| k.contains("7:replica1:v")),
        "no replica-scoped key in Redis: {keys:?}"
    );

    // All or nothing across the two kinds: a store that denies leaves the replica's own counter
    // as it was, and an own counter that denies leaves the store's.
    let one = &east[0];
    assert_eq!(admitted(one, &[&[("global", "full")]], 3).await, 3);
    assert_eq!(
        admitted(one, &[&[("replica", "m")], &[("global", "full")]], 4).await,
        0
    );
    assert_eq!(
        admitted(one, &[&[("replica", "m")]], 4).await,
        3,
        "given back when the store denied"
    );
    assert_eq!(
        admitted(one, &[&[("replica", "m")], &[("global", "fresh")]], 2).await,
        0
    );
    assert_eq!(
        admitted(one, &[&[("global", "fresh")]], 4).await,
        3,
        "the store not charged when the own counter denied"
    );
    assert_eq!(
        admitted(one, &[&[("replica", "k")], &[("global", "both")]], 4).await,
        3,
        "both admit: both charged"
    );
    assert_eq!(admitted(one, &[&[("replica", "k")]], 1).await, 0);
    assert_eq!(admitted(one, &[&[("global", "both")]], 1).await, 0);
}

/// This replica's share of the split limit `key`, as its `/counters` shows it; `None` while it
/// may not use one (`/counters` answers 503: its share is unknown).
fn share(sluice: &Sluice, key: &str) -> Option<u64> {
    support::counted_limit(sluice, "scoped", key, "probe")
}

/// Waits, at most `within`, until the replicas' shares of `key` are `shares`.
async fn shares_become(
    replicas: &[&Sluice],
    key: &str,
    shares: &[u64],
    within: Duration,
    what: &str,
) {
    let start = Instant::now();
    let wanted: Vec<Option<u64>> = shares.iter().copied().map(Some).collect();
    loop {
        let now: Vec<Option<u64>> = replicas.iter().map(|s| share(s, key)).collect();
        if now == wanted {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{what}: the shares of {key} are {now:?}, not {shares:?}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the replicas take to divide a per-second split limit anew once they change: a
/// beat's life (a killed replica's), a newcomer counted for 3 s before a window begins, two beats,
/// and the delays of a busy machine.
const NEXT_WINDOWS: Duration = Duration::from_secs(10);

async fn a_split_limit_follows_the_replicas_that_join_and_leave(store: Store) {
    support::in_one_window(support::HOUR, async || joins_and_leaves(store).await).await;
}

/// Within a window (the hour), shares only shrink and a newcomer has none; from the windows
/// that begin once the replicas have counted each other (every second), the limit is divided
/// among the live.
async fn joins_and_leaves(store: Store) {
    let prefix = format!("split-{}-{}:", std::process::id(), unix_ms());
    let mut a = replica(store, &prefix, None).await;
    shares_become(&[&a], "split", &[10], Duration::from_secs(2), "alone").await;
    let split = |v| [("split", v)];
    assert_eq!(admitted(&a, &[&split("s")], 4).await, 4);
    if store == Store::Memory {
        assert_eq!(
            admitted(&a, &[&split("s")], 10).await,
            6,
            "one replica: all of it"
        );
        return;
    }
    // A replica joins: within a beat, a's share is halved; b has none in the hour a counted
    // alone in, and half of each second from the first that begins once a counts it.
    let mut b = replica(store, &prefix, None).await;
    let within = Duration::from_secs(3);
    shares_become(&[&a, &b], "split", &[5, 0], within, "one joined").await;
    assert_eq!(
        admitted(&a, &[&split("s")], 3).await,
        1,
        "a: 4 of its 5 used"
    );
    assert_eq!(
        admitted(&b, &[&split("s")], 7).await,
        0,
        "b: none in this hour"
    );
    shares_become(
        &[&a, &b],
        "split_s",
        &[5, 5],
        NEXT_WINDOWS,
        "one joined, next windows",
    )
    .await;
    // A third joins, and leaves in good order: in the hour a's share is a third and stays so;
    // each second is halved again between the two.
    let mut c = replica(store, &prefix, None).await;
    shares_become(&[&a, &b, &c], "split", &[3, 0, 0], within, "a third joined").await;
    let _ = Command::new("kill").arg(c.pid().to_string()).status();
    assert!(
        c.exited_within(Duration::from_secs(15)).await.is_some(),
        "c stops on SIGTERM"
    );
    shares_become(
        &[&a, &b],
        "split_s",
        &[5, 5],
        NEXT_WINDOWS,
        "one left, next windows",
    )
    .await;
    assert_eq!(
        share(&a, "split"),
        Some(3),
        "a's share does not grow in the hour"
    );
    // A replica dies: its beat lapses, and the survivor takes each second whole; in the hour it
    // still has none.
    a.kill();
    shares_become(
        &[&b],
        "split_s",
        &[10],
        NEXT_WINDOWS,
        "one died, next windows",
    )
    .await;
    assert_eq!(share(&b, "split"), Some(0), "b: still none in this hour");
    b.kill();
}

/// A split limit smaller than the live replicas leaves some of them a share of 0: each replica
/// says so in a warning, naming the rule, once the replicas are read (and again on a reload
/// that brings another such limit, or when the live replicas change).
#[tokio::test(flavor = "multi_thread")]
async fn a_split_limit_smaller_than_the_live_replicas_warns() {
    const SMALL: &str = "domain: small\ndescriptors:\n  - key: k\n    scope: split\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let prefix = format!("small-{}-{}:", std::process::id(), unix_ms());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let a = Sluice::on(Store::Redis, &[("rules.yaml", SMALL)], &flags).await;
    let b = Sluice::on(Store::Redis, &[("rules.yaml", SMALL)], &flags).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    for replica in [&a, &b] {
        while !replica.log_text().contains(
            "rules.yaml:3 is smaller than the 2 live replicas: 1 of them have a share of 0",
        ) {
            assert!(Instant::now() < deadline, "{}", replica.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A replica that could not read the live replicas (Redis down since its start) has no share
/// of a split limit: its split requests are answered by `--on-store-error`, as every request
/// the store cannot decide, not denied.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_that_never_read_the_live_replicas_answers_split_requests_by_the_policy() {
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://127.0.0.1:{}", unused.local_addr().unwrap().port());
    drop(unused);
    let flags = ["--redis-url", url.as_str(), "--on-store-error", "allow"];
    let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, support::Wait::Live).await;
    // gRPC is served once the store is not reached within 2 s of the start.
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        let mut client = sluice.client().await;
        if let Ok(answer) = client
            .should_rate_limit(request("scoped", &[&[("split", "s")]]))
            .await
        {
            break answer.into_inner();
        }
        assert!(Instant::now() < deadline, "never served");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        answer.overall_code, OK,
        "answered by --on-store-error allow"
    );
    assert!(
        sluice
            .log_text()
            .contains("answered by --on-store-error allow")
            && sluice.log_text().contains("no share of a split limit"),
        "{}",
        sluice.log_text()
    );
}

const HOURLY: &str = "domain: hourly\ndescriptors:\n  - key: client\n    scope: split\n    rate_limit: {unit: hour, requests_per_unit: 100}\n";

/// Two replicas (under a key prefix of `name`), `b` reaching Redis through a proxy, counted by each other since before an hour
/// began: their clocks are set (`--clock-skew-ms`, for tests) so that one begins 8 s after
/// they start. Answers once the hour began and each has its half of the 100 of it.
async fn two_replicas_in_an_hour(name: &str) -> (Sluice, Sluice, Proxy) {
    const HOUR_MS: u64 = 3_600_000;
    let now = unix_ms();
    let skew = (now / HOUR_MS + 1) * HOUR_MS - (now + 8_000);
    let skew = format!("--clock-skew-ms={skew}");
    let prefix = format!("hourly-{name}-{}-{now}:", std::process::id());
    let port = Store::Redis.redis().expect("a Redis").ports[0];
    let proxy = Proxy::start(port).await;
    let through = format!("redis://127.0.0.1:{}", proxy.port);
    let direct = format!("redis://127.0.0.1:{port}");
    let replica = async |url: &str| {
        let flags = [
            "--redis-url",
            url,
            "--redis-key-prefix",
            prefix.as_str(),
            skew.as_str(),
        ];
        Sluice::on(Store::Memory, &[("rules.yaml", HOURLY)], &flags).await
    };
    let (a, b) = (replica(&direct).await, replica(&through).await);
    // Until the hour began.
    let began = Duration::from_millis((now + 8_500).saturating_sub(unix_ms()));
    tokio::time::sleep(began).await;
    let halves = Duration::from_secs(10);
    let start = Instant::now();
    while [&a, &b].map(|s| support::counted_limit(s, "hourly", "client", "probe")) != [Some(50); 2]
    {
        assert!(
            start.elapsed() < halves,
            "no halves of the hour after {halves:?}: {:?}\n{}",
            [&a, &b].map(|s| support::http(s.http, "POST", "/counters", r#"{"domain":"hourly","descriptors":[{"entries":[{"key":"client","value":"probe"}]}]}"#)),
            a.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (a, b, proxy)
}

/// What `sluice` admits of `n` requests of the hourly client; those answered with an error (no
/// share) counted apart.
async fn hourly(sluice: &Sluice, n: usize) -> (u64, u64) {
    let (mut admitted, mut unanswered) = (0, 0);
    for _ in 0..n {
        let asked = sluice
            .client()
            .await
            .should_rate_limit(request("hourly", &[&[("client", "c")]]))
            .await;
        match asked {
            Ok(answer) => admitted += u64::from(answer.into_inner().overall_code == OK),
            Err(_) => unanswered += 1,
        }
    }
    (admitted, unanswered)
}

/// Drives 10 requests on each of `a` and `b` every 200 ms for `during`: what they admitted
/// together, and how many of `b`'s had no answer.
async fn traffic(a: &Sluice, b: &Sluice, during: Duration) -> (u64, u64) {
    let (mut admitted, mut b_unanswered) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < during {
        admitted += hourly(a, 10).await.0;
        let (by_b, none) = hourly(b, 10).await;
        admitted += by_b;
        b_unanswered += none;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (admitted, b_unanswered)
}

/// A replica cut off from Redis (its proxy stops forwarding, its connections held open) stops
/// admitting on its share within its beat's life, and the other does not grow its share within
/// the hour: 100 an hour on two replicas admit at most 100, where a replica keeping its share
/// while the other took the whole limit admitted 150.
#[tokio::test(flavor = "multi_thread")]
async fn a_split_replica_cut_off_from_redis_never_takes_the_two_past_the_limit() {
    let (a, b, proxy) = two_replicas_in_an_hour("cut").await;
    let mut admitted = hourly(&a, 30).await.0 + hourly(&b, 30).await.0;
    assert_eq!(admitted, 60, "30 of each half");
    proxy.cut();
    let (cut, unanswered) = traffic(&a, &b, Duration::from_secs(8)).await;
    proxy.mend();
    let (after, _) = traffic(&a, &b, Duration::from_secs(4)).await;
    admitted += cut + after;
    println!("cut 8 s: {admitted} admitted of 100 an hour, {unanswered} of b's unanswered");
    assert!(admitted <= 100, "{admitted} admitted of 100 an hour");
    assert!(
        unanswered > 0,
        "b stopped admitting on its share while cut off"
    );
}

/// A replica paused 5 s (SIGSTOP: a node freeze) resumes with a share the other's has not grown
/// into: 100 an hour on two replicas admit at most 100.
#[tokio::test(flavor = "multi_thread")]
async fn a_split_replica_paused_past_its_beat_never_takes_the_two_past_the_limit() {
    let (a, b, _proxy) = two_replicas_in_an_hour("paused").await;
    let mut admitted = hourly(&a, 30).await.0 + hourly(&b, 30).await.0;
    assert_eq!(admitted, 60, "30 of each half");
    let signal = |name: &str| {
        let status = Command::new("kill")
            .args([name, &b.pid().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {name}");
    };
    signal("-STOP");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        admitted += hourly(&a, 10).await.0;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    signal("-CONT");
    let (after, _) = traffic(&a, &b, Duration::from_secs(4)).await;
    admitted += after;
    println!("paused 5 s: {admitted} admitted of 100 an hour");
    assert!(admitted <= 100, "{admitted} admitted of 100 an hour");
}
