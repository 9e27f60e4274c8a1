//! Leased counters: replicas that admit from blocks of a counter taken from the store admit
//! exactly the limit together, never more (a replica killed holding a block takes it with it),
//! with far fewer script calls than requests; a block unused on one replica comes back for
//! another within the documented bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{HOUR, OK, Sluice, Store, in_one_window, request};
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
    let own = store.dedicated();
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
            let before = support::redis::evalsha_calls(ports);
            let (admitted, callers) = race(
                clients,
                self::run(&format!("{run}.{attempt}")),
                stop.clone(),
            );
            let started = Instant::now();
            reached(&admitted, Duration::from_secs(20)).await;
            let took = started.elapsed();
            let calls = support::redis::evalsha_calls(ports) - before;
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
        let value = format!("{}", support::unix_ms());
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

/// The value of the sample `name` (no labels) on `sluice`'s `/metrics`.
fn metric(sluice: &Sluice, name: &str) -> u64 {
    let (_, _, body) = support::http(sluice.http, "GET", "/metrics", "");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} on /metrics"))
}

/// Hits `sluice` holds in leased blocks now (`sluice_lease_held_hits`).
fn held(sluice: &Sluice) -> u64 {
    metric(sluice, "sluice_lease_held_hits")
}

/// What the counters under `prefix` on the Redis at `port` count, in all.
fn counted(port: u16, prefix: &str) -> u64 {
    const SUM: &str = "local n = 0 \
        for _, key in ipairs(redis.call('KEYS', ARGV[1])) do \
          for _, v in ipairs(redis.call('HVALS', key)) do n = n + (tonumber(v) or 0) end \
        end \
        return n";
    let sum = support::redis::cli(port, &["EVAL", SUM, "0", &format!("{prefix}*")]);
    sum.trim().parse().expect("a whole number")
}

/// Traffic moves from one replica to another: once the store has nothing left, the second is
/// denied while the first holds an unused block, until the first gives it back (at its next
/// periodic pass, every half of `--lease-idle`, 2 s here); then it admits the rest, and the
/// limit is reached exactly. A denial lasts no longer than docs/leases.md states: one and a
/// half times `--lease-idle`, and a store call.
#[tokio::test(flavor = "multi_thread")]
async fn a_block_unused_on_one_replica_comes_back_for_another() {
    const IDLE: Duration = Duration::from_secs(2);
    let prefix = format!("moved-{}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str(), "--lease-idle", "2s"];
    let first = Sluice::on(Store::Redis, &rules(), &flags).await;
    let second = Sluice::on(Store::Redis, &rules(), &flags).await;
    in_one_window(HOUR, async || {
        let value = format!("{}", support::unix_ms());
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
        let value = format!("{}", support::unix_ms());
        let (admitted, callers, stop) = racing_until(&sluice, &value, LIMIT / 2).await;
        support::redis::signal(sluice.pid(), "TERM");
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
        let counted = counted(port, &prefix);
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
    let own = support::redis::dedicated();
    // A block is never given back for being idle here, however slowly the test goes on.
    let sluice = Sluice::on_own_redis(&own, &rules(), &["--lease-idle", "1h"]).await;
    in_one_window(HOUR, async || {
        let value = format!("{}", support::unix_ms());
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
        let stopped = support::redis::Stopped::new(support::redis::pid_of(own.ports[0]));
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

/// A leased rule over many values (`many`) and a rule not leased (`big`), with limits no test
/// here reaches.
const MANY: &str = "domain: many\ndescriptors:\n  - key: many\n    lease: auto\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n  - key: big\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";

/// `sluice load --json --quiet` on `sluice`'s domain `many` with `args`: its report.
async fn load(sluice: &Sluice, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--domain", "many"];
    all.extend(args);
    support::load_report(sluice, &all).await
}

/// Asserts that every one of `report`'s requests was admitted, with no error.
fn all_admitted(report: &serde_json::Value, what: &str) {
    assert_eq!(report["errors"], serde_json::json!({}), "{what}: {report}");
    assert_eq!(report["ok"], report["requests"], "{what}: {report}");
}

/// `sluice load` arguments for `requests` requests over 16 callers, each of `descriptors` new
/// `many` values (`distinct` values of each descriptor, every one under `tag`).
fn many_values(tag: &str, descriptors: u64, distinct: u64, requests: u64) -> Vec<String> {
    let mut args = Vec::new();
    for d in 0..descriptors {
        args.extend(["--descriptor".to_string(), format!("many={tag}-{d}-")]);
    }
    let counts = [distinct, requests].map(|n| n.to_string());
    args.extend(
        [
            "--distinct-values",
            &counts[0],
            "--requests",
            &counts[1],
            "--concurrency",
            "16",
        ]
        .map(String::from),
    );
    args
}

/// New leased values and the rule not leased, asked together by 16 callers each: their reports.
async fn new_values_and_another_rule(
    sluice: &Sluice,
    tag: &str,
) -> (serde_json::Value, serde_json::Value) {
    let new = many_values(tag, 1, 10_000_000, 2000);
    let new: Vec<&str> = new.iter().map(String::as_str).collect();
    let big = format!("big={tag}");
    let big = [
        "--descriptor",
        &big,
        "--requests",
        "2000",
        "--concurrency",
        "16",
    ];
    let (new, big) = tokio::join!(load(sluice, &new), load(sluice, &big));
    all_admitted(&new, "new leased values");
    all_admitted(&big, "the rule not leased");
    (new, big)
}

/// Requests a second in `report`.
fn rate(report: &serde_json::Value) -> f64 {
    report["requests_per_second"].as_f64().unwrap()
}

/// The lease table full (`--lease-max-counters`, counters never idle under `--lease-idle 1h`):
/// a new counter is decided by the store at once, with no walk of the table on its request's
/// path, so that new leased values and a rule not leased, asked together, are answered about as
/// fast as by a replica whose table is empty, asked at the same time on the same machine (at
/// least a third as fast: a walk of the 120,000 counters on every request divides a debug
/// build's rates by 10 or more).
#[tokio::test(flavor = "multi_thread")]
async fn a_full_lease_table_leaves_new_counters_and_other_rules_as_fast_as_an_empty_one() {
    const MOST: u64 = 120_000;
    /// Descriptors in each request that fills the table, so that it fills in few requests.
    const DESCRIPTORS: u64 = 60;
    let most = MOST.to_string();
    let replica = async |name: &str| {
        let prefix = format!("{name}-{}:", std::process::id());
        // A store timeout no busy machine reaches: the rates tell.
        let flags = [
            "--redis-key-prefix",
            prefix.as_str(),
            "--lease-idle",
            "1h",
            "--lease-max-counters",
            &most,
            "--store-timeout",
            "10s",
        ];
        Sluice::on(Store::Redis, &[("rules.yaml", MANY)], &flags).await
    };
    let (empty, full) = (replica("empty").await, replica("full").await);
    in_one_window(HOUR, async || {
        let run = support::unix_ms();
        let fill = many_values(
            &format!("f{run}"),
            DESCRIPTORS,
            MOST / DESCRIPTORS,
            MOST / DESCRIPTORS,
        );
        let fill: Vec<&str> = fill.iter().map(String::as_str).collect();
        all_admitted(&load(&full, &fill).await, "filling the table");
        let (on_empty, on_full) = (format!("e{run}"), format!("n{run}"));
        let ((new_empty, big_empty), (new_full, big_full)) = tokio::join!(
            new_values_and_another_rule(&empty, &on_empty),
            new_values_and_another_rule(&full, &on_full),
        );
        println!(
            "requests/s with the table empty and full, at the same time: new leased values {:.0}, {:.0}; the rule not leased {:.0}, {:.0}",
            rate(&new_empty),
            rate(&new_full),
            rate(&big_empty),
            rate(&big_full)
        );
        assert!(rate(&new_full) > rate(&new_empty) / 3.0, "new leased values");
        assert!(rate(&big_full) > rate(&big_empty) / 3.0, "the rule not leased");
    })
    .await;
}

/// 2,000 leased counters drawn at once, then idle: their blocks all go back, in calls of at
/// most 256 counters, and land. The store ends holding exactly what was admitted, and
/// `sluice_lease_returned_hits_total` grows by exactly what it gave back.
#[tokio::test(flavor = "multi_thread")]
async fn thousands_of_counters_idle_together_all_come_back() {
    let prefix = format!("idle-{}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str(), "--lease-idle", "4s"];
    let sluice = Sluice::on(Store::Redis, &[("rules.yaml", MANY)], &flags).await;
    let port = Store::Redis.redis().expect("a Redis").ports[0];
    let returned = || metric(&sluice, "sluice_lease_returned_hits_total");
    in_one_window(HOUR, async || {
        let run = support::unix_ms();
        let value = format!("many=v{run}-");
        let report = load(
            &sluice,
            &[
                "--descriptor",
                &value,
                "--distinct-values",
                "2000",
                "--requests",
                "8000",
                "--concurrency",
                "32",
            ],
        )
        .await;
        all_admitted(&report, "the load");
        let admitted = report["ok"].as_u64().unwrap();
        // What the store holds, and what was returned by then, read while no give-back was on
        // its way: none was answered within a give-back call's deadline (1 s) after.
        let (returned_then, then) = loop {
            let returned_then = returned();
            let then = counted(port, &prefix);
            tokio::time::sleep(Duration::from_millis(1200)).await;
            if returned() == returned_then {
                break (returned_then, then);
            }
        };
        let after = support::settled(
            Duration::from_secs(60),
            || counted(port, &prefix),
            |c| *c == admitted,
        )
        .await;
        let given = returned() - returned_then;
        println!(
            "{admitted} admitted; the store held {then}, then {after}; {given} returned meanwhile"
        );
        assert_eq!(after, admitted, "every hit held came back");
        assert_eq!(given, then - admitted, "the hits given back are counted");
        assert!(returned() > 0, "the hits given back are counted");
        assert_eq!(held(&sluice), 0);
        assert_eq!(metric(&sluice, "sluice_lease_unreturned_hits_total"), 0);
    })
    .await;
}

/// Replica A takes a big block (50 hits or more) after a burst, then draws one request every
/// 300 ms: never idle, it gives back what its block holds past what that rate draws, so replica
/// B, which ran the store dry, is never denied longer than docs/leases.md states (one and a half
/// times `--lease-idle` and a store call), and the two admit the whole limit between them.
#[tokio::test(flavor = "multi_thread")]
async fn a_block_drawn_slowly_gives_back_its_excess_to_another_replica() {
    const IDLE: Duration = Duration::from_secs(1);
    let prefix = format!("trickle-{}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str(), "--lease-idle", "1s"];
    let a = Sluice::on(Store::Redis, &rules(), &flags).await;
    let b = Sluice::on(Store::Redis, &rules(), &flags).await;
    in_one_window(HOUR, async || {
        let value = format!("{}", support::unix_ms());
        // A's burst stops at half the limit: its last block holds up to an eighth of the rest.
        let (on_a, callers, stop) = racing_until(&a, &value, LIMIT / 2).await;
        stop.store(true, Ordering::Relaxed);
        for c in callers {
            c.await.unwrap();
        }
        // A holds a big block: its next requests take one as big as its burst's rate.
        let mut client = a.client().await;
        let mut on_a = on_a.load(Ordering::Relaxed);
        for _ in 0..500 {
            if held(&a) >= 50 {
                break;
            }
            let r = client.should_rate_limit(run(&value)).await.unwrap();
            on_a += u32::from(r.get_ref().overall_code == OK);
        }
        let start = Instant::now();
        let bound = Duration::from_secs(15);
        let total = Arc::new(AtomicU32::new(on_a));
        let trickle = {
            let (total, value) = (total.clone(), value.clone());
            tokio::spawn(async move {
                while total.load(Ordering::Relaxed) < LIMIT && start.elapsed() < bound {
                    let r = client.should_rate_limit(run(&value)).await.unwrap();
                    if r.get_ref().overall_code == OK {
                        total.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };
        // B's callers: the longest a denial lasted before the next admission, or until the end.
        let state = Arc::new(std::sync::Mutex::new((None::<Instant>, Duration::ZERO)));
        let mut callers = Vec::new();
        for mut client in clients(std::slice::from_ref(&b), 16).await {
            let (state, total, value) = (state.clone(), total.clone(), value.clone());
            callers.push(tokio::spawn(async move {
                while total.load(Ordering::Relaxed) < LIMIT && start.elapsed() < bound {
                    let r = client.should_rate_limit(run(&value)).await.unwrap();
                    let mut s = state.lock().unwrap();
                    if r.get_ref().overall_code == OK {
                        total.fetch_add(1, Ordering::Relaxed);
                        if let Some(since) = s.0.take() {
                            s.1 = s.1.max(since.elapsed());
                        }
                    } else {
                        s.0.get_or_insert_with(Instant::now);
                    }
                }
            }));
        }
        for c in callers {
            c.await.unwrap();
        }
        trickle.await.unwrap();
        let (open, closed) = *state.lock().unwrap();
        let longest = closed.max(open.map_or(Duration::ZERO, |since| since.elapsed()));
        let total = total.load(Ordering::Relaxed);
        println!("B was denied for {longest:?} at most while A trickled; {total} admitted in all");
        assert_eq!(total, LIMIT, "the two replicas admit the whole limit");
        assert!(
            longest < IDLE * 3 / 2 + Duration::from_millis(500),
            "B denied for {longest:?}"
        );
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
