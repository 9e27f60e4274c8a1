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
                    // A killed replica's callers get errors: they count nothing, and wait a
                    // little rather than spin on a refused connection.
                    match client.should_rate_limit(ask.clone()).await {
                        Ok(r) if r.get_ref().overall_code == OK => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
        })
        .collect();
    (admitted, callers)
}

/// 32 callers race on `sluice` for `value` until `until` are admitted; they go on until the
/// flag returned is set.
async fn racing_until(
    sluice: &Sluice,
    value: &str,
    until: u32,
) -> (
    Arc<AtomicU32>,
    Vec<tokio::task::JoinHandle<()>>,
    Arc<AtomicBool>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let (admitted, callers) = race(
        clients(std::slice::from_ref(sluice), 32).await,
        run(value),
        stop.clone(),
    );
    while admitted.load(Ordering::Relaxed) < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (admitted, callers, stop)
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
    // A deployment of the test's own, so that no other test's script calls are counted.
    let own = match store {
        Store::Redis => common::redis::dedicated(),
        _ => common::redis::dedicated_cluster(),
    };
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Sluice::on_own_redis(&own, &rules(), &[]).await);
    }
    let ports = &own.ports;
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

/// Hits `sluice` holds in leased blocks now (`sluice_lease_held_hits`).
fn held(sluice: &Sluice) -> u64 {
    let (_, _, body) = common::http(sluice.http, "GET", "/metrics", "");
    body.lines()
        .find_map(|l| l.strip_prefix("sluice_lease_held_hits "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the held hits gauge")
}

/// Traffic moves from one replica to another: once the store has nothing left, the second is
/// denied while the first holds an unused block, until the first gives it back (`--lease-idle`,
/// 2 s here, so that the second surely runs the store dry first); then it admits the rest, and
/// the limit is reached exactly. The denial lasts no longer than docs/leases.md states: one and a
/// half times `--lease-idle`, and a store call.
#[tokio::test(flavor = "multi_thread")]
async fn a_block_unused_on_one_replica_comes_back_for_another() {
    const IDLE: Duration = Duration::from_secs(2);
    let prefix = format!("moved-{}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str(), "--lease-idle", "2s"];
    let first = Sluice::on(Store::Redis, &rules(), &flags).await;
    let second = Sluice::on(Store::Redis, &rules(), &flags).await;
    in_one_window(HOUR, async || {
        let value = format!("{}", common::unix_ms());
        // The first replica's callers take most of the limit, then stop: it holds a block.
        let (on_first, callers, stop) = racing_until(&first, &value, LIMIT - 100).await;
        stop.store(true, Ordering::Relaxed);
        for c in callers {
            c.await.unwrap();
        }
        // Its last block may have been spent to the last hit: then one more request takes the
        // next (as big as its recent rate), which it holds unused.
        let mut client = first.client().await;
        let mut admitted = on_first.load(Ordering::Relaxed);
        while held(&first) == 0 {
            let r = client.should_rate_limit(run(&value)).await.unwrap();
            assert_eq!(r.get_ref().overall_code, OK);
            admitted += 1;
        }
        let unused = held(&first);
        // 16 callers on the second replica take what remains, then wait for the first's block:
        // the longest time from a denial to the next admission.
        let state = Arc::new(std::sync::Mutex::new((admitted, None::<Instant>, Duration::ZERO)));
        let start = Instant::now();
        let mut callers = Vec::new();
        for mut client in clients(std::slice::from_ref(&second), 16).await {
            let (state, value) = (state.clone(), value.clone());
            callers.push(tokio::spawn(async move {
                while state.lock().unwrap().0 < LIMIT && start.elapsed() < Duration::from_secs(10) {
                    let r = client.should_rate_limit(run(&value)).await.unwrap();
                    let mut s = state.lock().unwrap();
                    if r.get_ref().overall_code == OK {
                        s.0 += 1;
                        if let Some(since) = s.1.take() {
                            s.2 = s.2.max(since.elapsed());
                        }
                    } else {
                        s.1.get_or_insert_with(Instant::now);
                    }
                }
            }));
        }
        for c in callers {
            c.await.unwrap();
        }
        let (admitted, _, longest) = *state.lock().unwrap();
        println!(
            "the first replica held {unused} unused; the second was denied for {longest:?} at most; {admitted} admitted in all"
        );
        assert_eq!(admitted, LIMIT, "every hit of the limit is admitted in the end");
        assert!(longest > Duration::ZERO, "denied while the first replica held a block");
        assert!(longest < IDLE * 3 / 2 + Duration::from_millis(500), "denied for {longest:?}");
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
        let (admitted, callers, stop) = racing_until(&sluice, &value, LIMIT / 2).await;
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

/// Redis stopped (SIGSTOP) while a replica holds a block: its requests are still admitted from
/// the block, which was reserved, and once it is spent they get `--on-store-error`'s answer (an
/// error here).
#[tokio::test(flavor = "multi_thread")]
async fn a_block_is_spent_while_redis_is_down_then_the_policy_answers() {
    let own = common::redis::dedicated();
    // A block is never given back for being idle here, however slowly the test goes on.
    let sluice = Sluice::on_own_redis(&own, &rules(), &["--lease-idle", "1h"]).await;
    in_one_window(HOUR, async || {
        let value = format!("{}", common::unix_ms());
        let (_, callers, stop) = racing_until(&sluice, &value, LIMIT / 3).await;
        stop.store(true, Ordering::Relaxed);
        for c in callers {
            c.await.unwrap();
        }
        let mut client = sluice.client().await;
        // Holds a block: one more request takes the next if the last was spent to the last hit.
        while held(&sluice) == 0 {
            client.should_rate_limit(run(&value)).await.unwrap();
        }
        let held = held(&sluice) as u32;
        let stopped = common::redis::Stopped::new(common::redis::pid_of(own.ports[0]));
        let (mut ok, mut errors) = (0, 0);
        while errors < 3 && ok <= held {
            match client.should_rate_limit(run(&value)).await {
                Ok(r) if r.get_ref().overall_code == OK => ok += 1,
                Ok(r) => panic!("answered {:?} while Redis is down", r.get_ref()),
                Err(_) => errors += 1,
            }
        }
        stopped.resume();
        println!("Redis stopped with {held} hits held: {ok} admitted from them, then {errors} policy answers");
        assert_eq!(ok, held, "the block held is spent, and nothing more");
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
