//! Leased counters: replicas that admit from blocks of a counter taken from the store admit
//! exactly the limit together, never more (a replica killed holding a block takes it with it),
//! with far fewer script calls than requests; a block unused on one replica comes back for
//! another within the documented bound.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::{HOUR, OK, Sluice, Store, in_one_window, request};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

/// A limit of 3,000 an hour, leased.
const LEASED: &str = "domain: lease\ndescriptors:\n  - key: run\n    lease: auto\n    rate_limit: {unit: hour, requests_per_unit: 3000}\n";
const LIMIT: u32 = 3000;

fn rules() -> [(&'static str, &'static str); 1] {
    [("rules.yaml", LEASED)]
}

fn run(value: &str) -> RateLimitRequest {
    request("lease", &[&[("run", value)]])
}

/// Three replicas sharing `store` under a prefix of the test's own.
async fn replicas(store: Store, name: &str) -> Vec<Sluice> {
    let prefix = format!("{name}-{}-{store:?}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Sluice::on(store, &rules(), &flags).await);
    }
    replicas
}

/// `n` clients, each on a connection of its own, to `sluices` in turn.
async fn clients(sluices: &[Sluice], n: usize) -> Vec<RateLimitServiceClient<Channel>> {
    let mut clients = Vec::with_capacity(n);
    for caller in 0..n {
        clients.push(sluices[caller % sluices.len()].client().await);
    }
    clients
}

/// Every client asks `ask` until `stop` is set; returns the admitted count, kept up to date.
fn race(
    clients: Vec<RateLimitServiceClient<Channel>>,
    ask: RateLimitRequest,
    stop: Arc<AtomicBool>,
) -> (Arc<AtomicU32>, Vec<tokio::task::JoinHandle<()>>) {
    let admitted = Arc::new(AtomicU32::new(0));
    let callers = clients
        .into_iter()
        .map(|mut client| {
            let (admitted, ask, stop) = (admitted.clone(), ask.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    // A killed replica's callers get errors: they count nothing.
                    if let Ok(r) = client.should_rate_limit(ask.clone()).await
                        && r.get_ref().overall_code == OK
                    {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    (admitted, callers)
}

/// Waits until `admitted` reaches the limit or `bound` passes.
async fn reached(admitted: &AtomicU32, bound: Duration) {
    let start = Instant::now();
    while admitted.load(Ordering::Relaxed) < LIMIT && start.elapsed() < bound {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Lets the callers keep asking past the limit for `settle` (none of them is admitted), then
/// stops them; returns the final count.
async fn finish(
    admitted: &AtomicU32,
    callers: Vec<tokio::task::JoinHandle<()>>,
    stop: &AtomicBool,
    settle: Duration,
) -> u32 {
    tokio::time::sleep(settle).await;
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

/// 64 callers over 3 replicas race for a leased limit: exactly the limit, 3 runs in a row, with
/// at most one script call for every 5 requests.
async fn leased_replicas_admit_exactly_the_limit(store: Store) {
    let replicas = replicas(store, "leased").await;
    let ports = &store.redis().expect("a Redis store").ports;
    for run in 0..3 {
        let mut attempt = 0;
        in_one_window(HOUR, async || {
            attempt += 1;
            let clients = clients(&replicas, 64).await;
            let stop = Arc::new(AtomicBool::new(false));
            let before = common::redis::evalsha_calls(ports);
            let (admitted, callers) = race(
                clients,
                self::run(&format!("{run}.{attempt}")),
                stop.clone(),
            );
            let started = Instant::now();
            reached(&admitted, Duration::from_secs(20)).await;
            let took = started.elapsed();
            let calls = common::redis::evalsha_calls(ports) - before;
            let admitted = finish(&admitted, callers, &stop, Duration::from_secs(1)).await;
            println!(
                "{store:?} run {run}: {admitted} admitted of {LIMIT}, the limit reached in {took:?} with {calls} script calls"
            );
            assert_eq!(admitted, LIMIT, "run {run}: 64 callers, limit {LIMIT}");
            assert!(
                u64::from(LIMIT) >= 5 * calls,
                "run {run}: {calls} script calls for {LIMIT} admitted"
            );
        })
        .await;
    }
}

/// A replica killed while its callers race takes its block with it: the others admit no more
/// than the limit, and the block it held is at most an eighth of what remained, and the hits
/// of a request.
async fn a_replica_killed_holding_a_block_never_lets_more_through(store: Store) {
    let mut replicas = replicas(store, "killed").await;
    in_one_window(HOUR, async || {
        let value = format!("{}", common::unix_ms());
        let clients = clients(&replicas, 64).await;
        let stop = Arc::new(AtomicBool::new(false));
        let (admitted, callers) = race(clients, run(&value), stop.clone());
        while admitted.load(Ordering::Relaxed) < LIMIT / 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        replicas[0].kill();
        reached(&admitted, Duration::from_secs(5)).await;
        let admitted = finish(&admitted, callers, &stop, Duration::from_secs(2)).await;
        let lost = LIMIT - admitted.min(LIMIT);
        println!(
            "{store:?}: {admitted} admitted of {LIMIT}; the killed replica's block took {lost}"
        );
        assert!(admitted <= LIMIT, "{admitted} admitted of {LIMIT}");
        assert!(lost <= LIMIT / 8 + 1, "the killed replica held {lost}");
        replicas[0].start_again().await;
    })
    .await;
}

/// Traffic moves from one replica to another: once the store has nothing left, the second is
/// denied while the first holds an unused block, until the first gives it back; then it admits
/// the rest, and the limit is reached exactly. The denial lasts less than a second (the bound
/// docs/leases.md states).
#[tokio::test(flavor = "multi_thread")]
async fn a_block_unused_on_one_replica_comes_back_for_another() {
    let replicas = replicas(Store::Redis, "moved").await;
    in_one_window(HOUR, async || {
        let value = format!("{}", common::unix_ms());
        // The first replica's callers take most of the limit, then stop: it holds a block.
        let stop = Arc::new(AtomicBool::new(false));
        let (first, callers) = race(clients(&replicas[..1], 32).await, run(&value), stop.clone());
        while first.load(Ordering::Relaxed) < LIMIT - 100 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stop.store(true, Ordering::Relaxed);
        for c in callers {
            c.await.unwrap();
        }
        let mut first = first.load(Ordering::Relaxed);
        // Its last block may have been spent to the last hit: then one more request takes the
        // next (as big as its recent rate), which it holds unused.
        let mut on_first = replicas[0].client().await;
        let held = || {
            common::metrics::scrape(replicas[0].http)
                .get("sluice_lease_held_hits", &[])
                .unwrap_or(0.0)
        };
        while held() == 0.0 {
            let r = on_first.should_rate_limit(run(&value)).await.unwrap();
            assert_eq!(r.get_ref().overall_code, OK);
            first += 1;
        }
        // The second replica takes what remains, then waits for the first's block.
        let mut client = replicas[1].client().await;
        let (mut admitted, mut denied_since, mut longest) = (first, None::<Instant>, Duration::ZERO);
        let start = Instant::now();
        while admitted < LIMIT && start.elapsed() < Duration::from_secs(10) {
            let r = client.should_rate_limit(run(&value)).await.unwrap();
            if r.get_ref().overall_code == OK {
                admitted += 1;
                if let Some(since) = denied_since.take() {
                    longest = longest.max(since.elapsed());
                }
            } else {
                denied_since.get_or_insert_with(Instant::now);
            }
        }
        println!(
            "the first replica admitted {first}; the second was denied for {longest:?} at most while the first's block was unused; {admitted} admitted in all"
        );
        assert_eq!(admitted, LIMIT, "every hit of the limit is admitted in the end");
        assert!(longest > Duration::ZERO, "denied while the first replica held a block");
        assert!(longest < Duration::from_secs(1), "denied for {longest:?}");
    })
    .await;
}

/// SIGTERM while callers race: once the last call is answered, every block still held goes back,
/// so that the store counts exactly what was admitted.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_gives_back_every_block_before_exit() {
    let prefix = format!("sigterm-{}:", std::process::id());
    let mut sluice = Sluice::on(Store::Redis, &rules(), &["--redis-key-prefix", &prefix]).await;
    let port = Store::Redis.redis().expect("a Redis").ports[0];
    in_one_window(HOUR, async || {
        let value = format!("{}", common::unix_ms());
        let stop = Arc::new(AtomicBool::new(false));
        let (admitted, callers) = race(
            clients(std::slice::from_ref(&sluice), 32).await,
            run(&value),
            stop.clone(),
        );
        while admitted.load(Ordering::Relaxed) < LIMIT / 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        common::redis::signal(sluice.pid(), "TERM");
        assert!(
            sluice
                .exited_within(Duration::from_secs(10))
                .await
                .is_some(),
            "sluice exits"
        );
        stop.store(true, Ordering::Relaxed);
        for c in callers {
            c.await.unwrap();
        }
        let admitted = admitted.load(Ordering::Relaxed);
        let counted: u64 =
            common::redis::cli(port, &["--scan", "--pattern", &format!("{prefix}*")])
                .split_whitespace()
                .flat_map(|key| {
                    common::redis::cli(port, &["HVALS", key])
                        .split_whitespace()
                        .filter_map(|n| n.parse::<u64>().ok())
                        .collect::<Vec<_>>()
                })
                .sum();
        println!("{admitted} admitted; the store counts {counted} after exit");
        assert_eq!(
            counted,
            u64::from(admitted),
            "what the blocks held went back"
        );
        sluice.start_again().await;
    })
    .await;
}

scenarios! {
    leased_replicas_on_a_standalone_redis_admit_exactly_the_limit
        => leased_replicas_admit_exactly_the_limit(Store::Redis),
    leased_replicas_on_a_cluster_admit_exactly_the_limit
        => leased_replicas_admit_exactly_the_limit(Store::Cluster),
    a_replica_killed_holding_a_block_on_a_standalone_redis_never_lets_more_through
        => a_replica_killed_holding_a_block_never_lets_more_through(Store::Redis),
    a_replica_killed_holding_a_block_on_a_cluster_never_lets_more_through
        => a_replica_killed_holding_a_block_never_lets_more_through(Store::Cluster),
}
