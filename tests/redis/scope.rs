//! `scope:` per rule, as docs/rules.md has it: `global` counters are shared by every replica,
//! `cluster` counters by the replicas of one `--cluster-name` (each name its own, in the same
//! Redis), `replica` counters are each replica's own with no key in Redis, and `split` divides
//! the limit among the replicas live now, following one that joins, one that leaves in good
//! order and one that dies. A request with counters of both kinds is decided all or nothing:
//! the replica's own counters are given back when the store denies, and the store is not
//! charged when they deny.

use super::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{OK, Sluice, Store, request, unix_ms};

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

/// This replica's share of the split limit, as its `/counters` shows it; `None` while it has not
/// read the live replicas (`/counters` answers 503: its share is unknown).
fn share(sluice: &Sluice) -> Option<u64> {
    common::counted_limit(sluice, "scoped", "split", "probe")
}

/// Waits, at most `within`, until the replicas' shares are `shares`.
async fn shares_become(replicas: &[&Sluice], shares: &[u64], within: Duration, what: &str) {
    let start = Instant::now();
    let wanted: Vec<Option<u64>> = shares.iter().copied().map(Some).collect();
    loop {
        let now: Vec<Option<u64>> = replicas.iter().map(|s| share(s)).collect();
        if now == wanted {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{what}: the shares are {now:?}, not {shares:?}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn a_split_limit_follows_the_replicas_that_join_and_leave(store: Store) {
    let prefix = format!("split-{}-{}:", std::process::id(), unix_ms());
    let mut a = replica(store, &prefix, None).await;
    shares_become(&[&a], &[10], Duration::from_secs(2), "alone").await;
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
    // A replica joins: within a beat, the limit is halved between the two.
    let mut b = replica(store, &prefix, None).await;
    shares_become(&[&a, &b], &[5, 5], Duration::from_secs(3), "one joined").await;
    assert_eq!(
        admitted(&a, &[&split("s")], 3).await,
        1,
        "a: 4 of its 5 used"
    );
    assert_eq!(admitted(&b, &[&split("s")], 7).await, 5, "b: its 5");
    // A third joins, and leaves in good order: at once the two are back to halves.
    let mut c = replica(store, &prefix, None).await;
    let mut thirds: Vec<u64> = Vec::new();
    let start = Instant::now();
    while thirds.iter().sum::<u64>() != 10 || thirds.len() != 3 || thirds.contains(&5) {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "thirds: {thirds:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        thirds = [&a, &b, &c].iter().filter_map(|s| share(s)).collect();
    }
    thirds.sort_unstable();
    assert_eq!(thirds, [3, 3, 4], "10 among three");
    let _ = Command::new("kill").arg(c.pid().to_string()).status();
    assert!(
        c.exited_within(Duration::from_secs(15)).await.is_some(),
        "c stops on SIGTERM"
    );
    shares_become(&[&a, &b], &[5, 5], Duration::from_secs(3), "one left").await;
    // A replica dies: its beat lapses, and the survivor takes the whole limit.
    a.kill();
    shares_become(&[&b], &[10], Duration::from_secs(6), "one died").await;
    assert_eq!(
        admitted(&b, &[&split("s")], 7).await,
        5,
        "b: the whole limit, 5 of it used"
    );
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
    let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, common::Wait::Live).await;
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
            && sluice.log_text().contains("has not read the live replicas"),
        "{}",
        sluice.log_text()
    );
}
