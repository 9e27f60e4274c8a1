//! What the Redis store adds: exact admission across replicas, one script call per request, key
//! safety, surviving a flushed script cache, and the sliding window at a window boundary.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{
    HOUR, MINUTE, OK, OVER_LIMIT, Sluice, Store, in_one_window, request, sleep_until_unix_ms,
    unix_ms,
};
use tonic::transport::Channel;

fn rules(yaml: &str) -> [(&str, &str); 1] {
    [("rules.yaml", yaml)]
}

const HUNDRED: &str = "domain: race\ndescriptors:\n  - key: run\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

/// `n` clients, each on a connection of its own, to `sluices` in turn.
async fn clients(sluices: &[Sluice], n: usize) -> Vec<RateLimitServiceClient<Channel>> {
    let mut clients = Vec::with_capacity(n);
    for caller in 0..n {
        clients.push(sluices[caller % sluices.len()].client().await);
    }
    clients
}

/// Every client asks `ask` `attempts` times, all at once; returns how many were admitted.
async fn race(
    clients: Vec<RateLimitServiceClient<Channel>>,
    ask: RateLimitRequest,
    attempts: usize,
) -> u32 {
    let admitted = Arc::new(AtomicU32::new(0));
    let mut callers = Vec::new();
    for mut client in clients {
        let (admitted, ask) = (admitted.clone(), ask.clone());
        callers.push(tokio::spawn(async move {
            for _ in 0..attempts {
                let r = client
                    .should_rate_limit(ask.clone())
                    .await
                    .expect("no error reaches the client");
                if r.get_ref().overall_code == OK {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for c in callers {
        c.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

/// A request for `run=<value>`, limited to 100 a minute by `HUNDRED`.
fn run(value: &str) -> RateLimitRequest {
    request("race", &[&[("run", value)]])
}

/// 64 callers over 3 sluice processes sharing one Redis race for a limit of 100, 5 runs in a row.
async fn replicas_admit_exactly_the_limit(store: Store) {
    let prefix = format!("race-{}-{store:?}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let replicas = [
        Sluice::on(store, &rules(HUNDRED), &flags).await,
        Sluice::on(store, &rules(HUNDRED), &flags).await,
        Sluice::on(store, &rules(HUNDRED), &flags).await,
    ];
    for run in 0..5 {
        // A value of its own each attempt: one that saw the minute end counts nothing into the next.
        let mut attempt = 0;
        in_one_window(MINUTE, async || {
            attempt += 1;
            let clients = clients(&replicas, 64).await;
            let admitted = race(clients, self::run(&format!("{run}.{attempt}")), 3).await;
            assert_eq!(admitted, 100, "run {run}: 192 attempts, limit 100");
        })
        .await;
    }
}

/// Four descriptors, one `EVALSHA` on a standalone Redis. The deployment is the test's own, so
/// that no other test's calls show in its statistics.
async fn a_request_is_one_script_call(store: Store) {
    let yaml = "domain: rt\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 9}\n  - key: b\n    rate_limits:\n      - {unit: hour, requests_per_unit: 9}\n      - {unit: minute, requests_per_unit: 9}\n";
    let own = store.dedicated();
    let sluice = Sluice::on_own_redis(&own, &rules(yaml), &[]).await;
    let ports = &own.ports;
    let four = request(
        "rt",
        &[&[("a", "1")], &[("a", "2")], &[("b", "3")], &[("b", "4")]],
    );
    sluice.ask(four.clone()).await;
    for _ in 0..5 {
        let before = support::redis::evalsha_calls(ports);
        let r = sluice.ask(four.clone()).await;
        let calls = support::redis::evalsha_calls(ports) - before;
        assert_eq!(r.overall_code, OK);
        match store {
            Store::Redis => assert_eq!(calls, 1, "one round trip for 4 descriptors"),
            _ => assert!(
                (1..=4).contains(&calls),
                "at most one call per slot: {calls}"
            ),
        }
    }
}

/// Concurrent requests to one sluice ride in shared script calls, each still decided exactly:
/// 64 callers, 4 requests each, limit 100 → 100 admitted, fewer `EVALSHA` than requests.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_share_script_calls_and_stay_exact() {
    in_one_window(MINUTE, async || {
        let own = support::redis::dedicated();
        let sluice = Sluice::on_own_redis(&own, &rules(HUNDRED), &[]).await;
        let before = support::redis::evalsha_calls(&own.ports);
        let clients = clients(std::slice::from_ref(&sluice), 64).await;
        let admitted = race(clients, run("shared"), 4).await;
        let calls = support::redis::evalsha_calls(&own.ports) - before;
        assert_eq!(admitted, 100, "256 attempts, limit 100");
        assert!(
            (1..256).contains(&calls),
            "256 concurrent requests took {calls} script calls"
        );
    })
    .await;
}

/// Values full of separators never make two descriptors share a counter.
async fn awkward_bytes_never_share_a_counter(store: Store) {
    let yaml = "domain: keys\ndescriptors:\n  - key: a_b\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: v\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let sluice = Sluice::on(store, &rules(yaml), &[]).await;
    let split: [&[(&str, &str)]; 2] = [&[("a_b", "c")], &[("a", "b_c")]];
    for d in split {
        assert_eq!(
            sluice.ask(request("keys", &[d])).await.overall_code,
            OK,
            "{d:?}"
        );
    }
    let values = [
        "{", "}", "{x}", ":", "a:b", "\n", "", " ", "}{", "{{}}", "1:v",
    ];
    for v in values {
        let r = sluice.ask(request("keys", &[&[("v", v)]])).await;
        assert_eq!(r.overall_code, OK, "{v:?} has a counter of its own");
    }
    for v in values {
        let r = sluice.ask(request("keys", &[&[("v", v)]])).await;
        assert_eq!(r.overall_code, OVER_LIMIT, "{v:?} was counted once");
    }
}

/// `SCRIPT FLUSH` while requests flow: none fails and none is counted twice. The deployment is
/// the test's own, so that no other test's scripts are flushed.
async fn a_flushed_script_cache_is_reloaded_without_errors(store: Store) {
    let own = store.dedicated();
    in_one_window(HOUR, async || {
        let yaml = "domain: flush\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";
        let sluice = Sluice::on_own_redis(&own, &rules(yaml), &[]).await;
        let ports = own.ports.clone();
        let flusher = tokio::task::spawn_blocking(move || {
            for _ in 0..40 {
                for &p in &ports {
                    support::redis::cli(p, &["SCRIPT", "FLUSH"]);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let clients = clients(std::slice::from_ref(&sluice), 8).await;
        race(clients, request("flush", &[&[("k", "x")]]), 50).await;
        flusher.await.unwrap();
        let r = sluice.ask(request("flush", &[&[("k", "x")]])).await;
        assert_eq!(
            r.statuses[0].limit_remaining,
            1_000_000 - 401,
            "400 requests, each counted once"
        );
    })
    .await;
}

/// L requests at the end of one window and L at the start of the next: the fixed window admits
/// 2L, the sliding window about L (L plus the share of L the new window has already covered).
async fn the_sliding_window_smooths_a_window_boundary(store: Store) {
    const L: u64 = 10;
    let yaml = "domain: edge\ndescriptors:\n  - key: fixed\n    rate_limit: {unit: second, requests_per_unit: 10}\n  - key: sliding\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: sliding_window}\n";
    let sluice = Sluice::on(store, &rules(yaml), &[]).await;
    let mut client = sluice.client().await;
    for key in ["fixed", "sliding"] {
        // A busy machine may stretch the first burst past its window: tried again at a later
        // boundary, with a value of its own.
        for attempt in 0.. {
            let value = format!("x{attempt}");
            let ask = || request("edge", &[&[(key, value.as_str())]]);
            let boundary = (unix_ms() / 1000 + 2) * 1000;
            let mut admitted = 0;
            sleep_until_unix_ms(boundary - 600).await;
            for _ in 0..L {
                let r = client.should_rate_limit(ask()).await.unwrap();
                admitted += u64::from(r.get_ref().overall_code == OK);
            }
            if unix_ms() >= boundary {
                assert!(attempt < 2, "the first burst never ended inside its window");
                continue;
            }
            sleep_until_unix_ms(boundary + 20).await;
            for _ in 0..L {
                let r = client.should_rate_limit(ask()).await.unwrap();
                admitted += u64::from(r.get_ref().overall_code == OK);
            }
            let covered = (unix_ms() - boundary) as f64 / 1000.0;
            if key == "fixed" {
                assert_eq!(admitted, 2 * L);
            } else {
                let bound = L + (L as f64 * covered).ceil() as u64 + 1;
                assert!(
                    admitted <= bound,
                    "sliding admitted {admitted}, bound {bound}"
                );
                assert!(admitted >= L, "the first burst fits: {admitted}");
            }
            break;
        }
    }
}

/// Through Sentinel, sluice finds the primary and counts there.
async fn sentinel_leads_to_the_primary() {
    in_one_window(HOUR, async || {
        let redis = support::redis::sentinel();
        let yaml =
            "domain: s\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";
        let sluice = Sluice::on_own_redis(&redis, &rules(yaml), &[]).await;
        for expected in [2, 1, 0] {
            let r = sluice.ask(request("s", &[&[("k", "v")]])).await;
            assert_eq!(
                (r.overall_code, r.statuses[0].limit_remaining),
                (OK, expected)
            );
        }
        assert_eq!(
            sluice
                .ask(request("s", &[&[("k", "v")]]))
                .await
                .overall_code,
            OVER_LIMIT
        );
        assert_eq!(
            support::redis::evalsha_calls(&redis.ports),
            3,
            "the primary ran every check but the last, which the local cache denied"
        );
    })
    .await;
}

scenarios! {
    a_sentinel_url_counts_on_the_primary_it_names => sentinel_leads_to_the_primary(),
    replicas_sharing_a_standalone_redis_admit_exactly_the_limit
        => replicas_admit_exactly_the_limit(Store::Redis),
    replicas_sharing_a_cluster_admit_exactly_the_limit
        => replicas_admit_exactly_the_limit(Store::Cluster),
    four_descriptors_cost_one_evalsha_on_standalone_redis
        => a_request_is_one_script_call(Store::Redis),
    four_descriptors_cost_one_evalsha_per_slot_on_a_cluster
        => a_request_is_one_script_call(Store::Cluster),
    script_flush_on_standalone_redis_loses_nothing
        => a_flushed_script_cache_is_reloaded_without_errors(Store::Redis),
    script_flush_on_every_cluster_node_loses_nothing
        => a_flushed_script_cache_is_reloaded_without_errors(Store::Cluster),
}

on_every_store!(
    awkward_bytes_never_share_a_counter,
    the_sliding_window_smooths_a_window_boundary
);

/// A `--redis-url` without a scheme (`localhost:6379`) is refused at start with a hint of the
/// URL forms, not only the client's "invalid or missing host".
#[test]
fn a_redis_url_without_a_scheme_is_refused_with_the_forms_it_takes() {
    let rules = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(
        rules.path().join("rules.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .expect("rules written");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .arg("--config")
        .arg(rules.path())
        .args(["--redis-url", "localhost:6379"])
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{}", support::free_port()),
        ])
        .args([
            "--http-addr",
            &format!("127.0.0.1:{}", support::free_port()),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sluice runs");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("a status") {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(15) {
            let _ = child.kill();
            panic!("sluice did not stop on a bad --redis-url");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut log)
        .expect("the log");
    assert!(!status.success());
    assert!(log.contains("--redis-url"), "{log}");
    assert!(log.contains("redis://host:6379"), "{log}");
}
