//! Redis failing over while callers ask, on loopback, one test at a time (they time promotions).
//!
//! - Behind one fixed address (a Kubernetes Service, a cloud provider's primary endpoint, a DNS
//!   name; a proxy here): the replica is promoted, the old primary demoted, and the address sends
//!   new connections to the new primary. Connections already open stay on the old node, which
//!   answers READONLY to every script; sluice drops them and reconnects, so that decisions resume
//!   within seconds.
//! - Sentinel, and a Cluster of three primaries with a replica each: callers race for a limit
//!   `L`; once a third of it is spent, the replica of the counter's primary is cut off, and the
//!   primary is killed 300 ms later, having admitted alone meanwhile. The promoted replica lacks
//!   those hits: with `--redis-confirm-replicas 1` no more than `L` are ever admitted; without
//!   it, the hits it lacks are admitted again, which the test measures. Every answer comes within
//!   `ANSWERED`, and decisions resume within `RESUMED` of the promotion (of a replica attached
//!   to the new primary, with confirmation: until then nothing can confirm).
//! - A primary whose only replica is gone, with `--redis-confirm-replicas 1`: nothing can confirm,
//!   so every request gets the policy answer within its deadline (never queued behind another
//!   request's `WAIT`), `/readyz` says why, and confirmed decisions resume once a replica is
//!   attached again.
//! - A Cluster's manual `CLUSTER FAILOVER`, and a slot migrated by `redis-cli --cluster reshard`
//!   (MOVED, then ASK while its keys move), lose nothing: at most `L` admitted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::proxy::Proxy;
use support::redis::{Controlled, ReplicatedCluster, Sentinels};
use support::{OK, ONE_AT_A_TIME, OVER_LIMIT, Sluice, Store, gather, http, request};
use tonic::transport::Channel;

/// A limit no test reaches: every decided answer is OK, with the limit in its status.
const RULES: &str = "domain: failover\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";
const CALLERS: usize = 6;
/// Each caller's pace.
const PACE: Duration = Duration::from_millis(5);
/// How soon after the address reaches the new primary every request must be decided again.
const RESUME: Duration = Duration::from_secs(3);
/// Decided answers the callers have had before the failure comes: the load is under way.
const WARM: usize = 50;

/// One answer, as its caller saw it.
struct Answer {
    sent: Instant,
    received: Instant,
    decided: bool,
}

/// Waits until `replica` has its first full copy from its primary.
fn wait_in_sync(replica: &Controlled) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Callers asking every `PACE` until stopped.
struct Load {
    callers: Vec<tokio::task::JoinHandle<Vec<Answer>>>,
    /// How many of their answers were decided so far.
    decided: Arc<AtomicUsize>,
    stopped: Arc<AtomicBool>,
}

impl Load {
    /// `CALLERS` callers, each on a value of its own.
    async fn start(sluice: &Sluice) -> Load {
        Load::on(sluice, CALLERS, |i| format!("v{i}")).await
    }

    /// `count` callers, caller `i` on `value(i)`.
    async fn on(sluice: &Sluice, count: usize, value: impl Fn(usize) -> String) -> Load {
        let decided = Arc::new(AtomicUsize::new(0));
        let stopped = Arc::new(AtomicBool::new(false));
        let mut callers = Vec::with_capacity(count);
        for i in 0..count {
            let client = sluice.client().await;
            let ask = caller(client, value(i), decided.clone(), stopped.clone());
            callers.push(tokio::spawn(ask));
        }
        Load {
            callers,
            decided,
            stopped,
        }
    }

    /// Waits, at most `within`, until `n` more of their answers are decided than when called;
    /// `what` says what that shows, should it never come.
    async fn decided(&self, n: usize, within: Duration, what: &str) {
        let target = self.decided.load(Ordering::Relaxed) + n;
        support::eventually(what, within, async || {
            self.decided.load(Ordering::Relaxed) >= target
        })
        .await;
    }

    /// Lets them ask until `at`, then stops them: their answers.
    async fn until(self, at: Instant) -> Vec<Answer> {
        tokio::time::sleep_until(at.into()).await;
        self.stopped.store(true, Ordering::Relaxed);
        gather(self.callers).await
    }
}

/// One caller of a `Load`, asking for `k=value` until `stopped`, counting its decided answers in
/// `decided`; an answer that is not decided must be the `--on-store-error error` answer,
/// UNAVAILABLE.
async fn caller(
    mut client: RateLimitServiceClient<Channel>,
    value: String,
    decided: Arc<AtomicUsize>,
    stopped: Arc<AtomicBool>,
) -> Vec<Answer> {
    let mut answers = Vec::new();
    while !stopped.load(Ordering::Relaxed) {
        let sent = Instant::now();
        let ask = request("failover", &[&[("k", value.as_str())]]);
        let answer = tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(ask))
            .await
            .expect("an answer within 5 s");
        let was_decided = match answer {
            Ok(r) => {
                let r = r.into_inner();
                assert!(
                    r.overall_code == OK && r.statuses[0].current_limit.is_some(),
                    "{r:?}"
                );
                decided.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                false
            }
        };
        answers.push(Answer {
            sent,
            received: Instant::now(),
            decided: was_decided,
        });
        tokio::time::sleep_until((sent + PACE).into()).await;
    }
    answers
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failover_behind_a_fixed_address_is_decided_again_within_seconds() {
    let old = Controlled::started();
    let new = Controlled::started();
    let _alone = ONE_AT_A_TIME.lock().await;
    let primary = old.port.to_string();
    new.cli(&["REPLICAOF", "127.0.0.1", &primary]);
    wait_in_sync(&new);
    let address = Proxy::start(old.port).await;
    let url = format!("redis://127.0.0.1:{}", address.port);
    let sluice = Sluice::on(
        Store::Memory,
        &[("rules.yaml", RULES)],
        &[
            "--redis-url",
            &url,
            "--redis-key-prefix",
            "failover:",
            "--store-timeout",
            "2s",
        ],
    )
    .await;

    let load = Load::start(&sluice).await;
    load.decided(WARM, Duration::from_secs(10), "the callers are decided")
        .await;
    let failing_over = Instant::now();
    new.cli(&["REPLICAOF", "NO", "ONE"]);
    let promoted = new.port.to_string();
    old.cli(&["REPLICAOF", "127.0.0.1", &promoted]);
    address.switch(new.port);
    let moved = Instant::now();
    let answers = load.until(moved + RESUME + Duration::from_secs(2)).await;

    let before: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.received < failing_over)
        .collect();
    assert!(!before.is_empty() && before.iter().all(|a| a.decided));
    let last_undecided = answers
        .iter()
        .filter(|a| !a.decided)
        .map(|a| a.received)
        .max();
    eprintln!(
        "decided again {:?} after the failover began ({} of {} answers undecided)",
        last_undecided.map_or(Duration::ZERO, |at| at
            .saturating_duration_since(failing_over)),
        answers.iter().filter(|a| !a.decided).count(),
        answers.len()
    );
    let late: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent >= moved + RESUME)
        .collect();
    assert!(
        !late.is_empty(),
        "no request was sent {RESUME:?} after the failover"
    );
    let undecided = late.iter().filter(|a| !a.decided).count();
    assert_eq!(
        undecided,
        0,
        "{undecided} of {} requests sent from {RESUME:?} after the failover were not decided",
        late.len()
    );
    assert_eq!(
        new.cli(&["ROLE"]).lines().next(),
        Some("master"),
        "the old replica is the primary"
    );
    let log = sluice.log_text();
    assert!(
        log.contains("READONLY") && log.contains("reconnecting"),
        "{log}"
    );
}

/// How long the callers go on once the replica is gone.
const WITHOUT_REPLICA: Duration = Duration::from_secs(2);
/// Every answer while no replica can confirm comes within this: the 10 ms store deadline, and
/// slack for a debug build on a loaded 2-core machine (requests queued behind each other's
/// `WAIT` took most of a second on a Cluster).
const NO_REPLICA_ANSWERED: Duration = Duration::from_secs(1);

/// `/readyz`: its status and body.
fn readyz(sluice: &Sluice) -> (u16, String) {
    let (status, _, body) = http(sluice.http, "GET", "/readyz", "");
    (status, body)
}

/// `/readyz` once it names the replicas (for at most 10 s): its status and body.
async fn readyz_naming_replicas(sluice: &Sluice) -> (u16, String) {
    support::settled(
        Duration::from_secs(10),
        || readyz(sluice),
        |(_, body)| body.contains("replica"),
    )
    .await
}

/// The answers to requests sent with no replica left to confirm: each within `bound`, none
/// decided from when `/readyz` said why (`readyz`, read then: 503, naming the replicas).
fn without_replica(without: &[&Answer], told: Instant, readyz: (u16, &str), bound: Duration) {
    let slowest = without
        .iter()
        .map(|a| a.received - a.sent)
        .max()
        .expect("requests sent without a replica");
    eprintln!(
        "no replica: the slowest of {} answers took {slowest:?}",
        without.len()
    );
    assert!(
        slowest <= bound,
        "the slowest answer with no replica left took {slowest:?}"
    );
    let (status, body) = readyz;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("replica") && body.contains("--redis-confirm-replicas"),
        "{body}"
    );
    assert!(
        without
            .iter()
            .filter(|a| a.sent >= told)
            .all(|a| !a.decided),
        "nothing is decided while no replica can confirm"
    );
}

/// sluice on `url` with `--redis-confirm-replicas 1` and a 10 ms store deadline.
async fn confirming_sluice(url: &str) -> Sluice {
    Sluice::on(
        Store::Memory,
        &[("rules.yaml", RULES)],
        &[
            "--redis-url",
            url,
            "--redis-key-prefix",
            "confirm:",
            "--redis-confirm-replicas",
            "1",
            "--store-timeout",
            "10ms",
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn with_no_replica_left_to_confirm_every_request_gets_the_policy_answer_within_its_deadline()
{
    let primary = Controlled::started();
    let mut replica =
        Controlled::started_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
    wait_in_sync(&replica);
    let _alone = ONE_AT_A_TIME.lock().await;
    let sluice = confirming_sluice(&primary.url).await;

    let load = Load::start(&sluice).await;
    load.decided(WARM, Duration::from_secs(10), "the callers are decided")
        .await;
    replica.kill();
    let gone = Instant::now();
    let (status, body) = readyz_naming_replicas(&sluice).await;
    let told = Instant::now();
    let answers = load.until(gone + WITHOUT_REPLICA).await;

    assert!(
        answers.iter().any(|a| a.sent < gone && a.decided),
        "decided while the replica confirmed"
    );
    let without: Vec<&Answer> = answers.iter().filter(|a| a.sent >= gone).collect();
    without_replica(&without, told, (status, &body), NO_REPLICA_ANSWERED);
    let log = sluice.log_text();
    assert_eq!(
        log.matches("too few for --redis-confirm-replicas").count(),
        1,
        "said once: {log}"
    );

    replica.start();
    wait_in_sync(&replica);
    let load = Load::start(&sluice).await;
    load.decided(
        1,
        RESUME,
        "decisions resume once a replica is attached again",
    )
    .await;
    load.until(Instant::now()).await;
    let (status, body) = support::settled(
        Duration::from_secs(10),
        || readyz(&sluice),
        |(status, _)| *status == 200,
    )
    .await;
    assert_eq!(status, 200, "ready again: {body}");
}

/// Callers on one counter of a Cluster whose primary loses its only replica.
const CLUSTER_CALLERS: usize = 24;
/// Every answer on that counter comes within this once its primary is killed: the 10 ms store
/// deadline, and slack for a debug build on a loaded 2-core machine (the slowest, across the
/// kill, is 55-120 ms there, 322 ms once, right after the promotion).
const CLUSTER_NO_REPLICA_ANSWERED: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread")]
async fn on_a_cluster_with_no_replica_left_to_confirm_every_request_gets_the_policy_answer_within_its_deadline()
 {
    let mut cluster = ReplicatedCluster::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let sluice = confirming_sluice(&cluster.url).await;

    let load = Load::on(&sluice, CLUSTER_CALLERS, |_| "hot".to_owned()).await;
    let key = support::settled(
        Duration::from_secs(10),
        || cluster.keys("confirm:").pop(),
        Option::is_some,
    )
    .await
    .expect("the counter's key");
    load.decided(WARM, Duration::from_secs(10), "the callers are decided")
        .await;
    let primary = cluster.holder_of(&key);
    let replica = cluster.replica_of(primary);
    cluster.nodes[primary].kill();
    let killed = Instant::now();
    when("the replica is promoted", || {
        cluster.nodes[replica].is_primary()
    })
    .await;
    let (status, body) = readyz_naming_replicas(&sluice).await;
    let told = Instant::now();
    tokio::time::sleep(WITHOUT_REPLICA).await;
    // The old primary comes back with its cluster state, as a replica of the new one: from
    // then on a request may be confirmed, before the poll below sees the link up.
    let back = Instant::now();
    cluster.nodes[primary].start();
    when("the old primary replicates the new one", || {
        cluster.nodes[primary].in_sync()
    })
    .await;
    let (ready, ready_body) = support::settled(
        Duration::from_secs(10),
        || readyz(&sluice),
        |(status, _)| *status == 200,
    )
    .await;
    let resumed = Instant::now();
    // A caller has at most one request in flight: past one more decided answer than there are
    // callers, one was sent after `resumed`.
    load.decided(
        CLUSTER_CALLERS + 1,
        Duration::from_secs(10),
        "decisions resume once a replica is attached again",
    )
    .await;
    let answers = load.until(Instant::now()).await;

    assert!(
        answers.iter().any(|a| a.sent < killed && a.decided),
        "decided while the replica confirmed"
    );
    let without: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent >= killed && a.sent < back)
        .collect();
    without_replica(&without, told, (status, &body), CLUSTER_NO_REPLICA_ANSWERED);
    assert_eq!(ready, 200, "ready again: {ready_body}");
    assert!(
        answers.iter().any(|a| a.sent >= resumed && a.decided),
        "decisions resume once a replica is attached again"
    );
}

/// The limit the callers race for.
const L: u64 = 3000;
const RACE_RULES: &str = "domain: race\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 3000}\n";
/// Racing callers, each asking every `RACE_PACE`.
const RACERS: usize = 8;
const RACE_PACE: Duration = Duration::from_millis(2);
/// The store deadline of the racing sluice.
const STORE_TIMEOUT: &str = "200ms";
/// Every answer comes within this, failover or not.
const ANSWERED: Duration = Duration::from_secs(1);
/// Decisions resume within this of the promotion (of the attached replica, with confirmation).
const RESUMED: Duration = Duration::from_secs(3);
/// How long the replica is cut off before its primary dies.
const LAG: Duration = Duration::from_millis(300);

/// How a racing caller's request was answered.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    Admitted,
    Over,
    /// The `--on-store-error error` answer.
    Unavailable,
}

struct Reply {
    sent: Instant,
    received: Instant,
    outcome: Outcome,
}

/// Callers racing for the limit on one descriptor until stopped.
struct Race {
    admitted: Arc<AtomicU64>,
    over: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    callers: Vec<tokio::task::JoinHandle<Vec<Reply>>>,
}

impl Race {
    /// `RACERS` callers asking for `k=value`, each every `pace`.
    async fn start(sluice: &Sluice, value: &str, pace: Duration) -> Race {
        let admitted = Arc::new(AtomicU64::new(0));
        let over = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut callers = Vec::with_capacity(RACERS);
        for _ in 0..RACERS {
            let mut client = sluice.client().await;
            let (admitted, over, stop) = (admitted.clone(), over.clone(), stop.clone());
            let value = value.to_owned();
            callers.push(tokio::spawn(async move {
                let mut replies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let ask = request("race", &[&[("k", value.as_str())]]);
                    let answer = tokio::time::timeout(
                        Duration::from_secs(10),
                        client.should_rate_limit(ask),
                    )
                    .await
                    .expect("an answer within 10 s");
                    let outcome = match answer {
                        Ok(r) => match r.into_inner().overall_code {
                            OK => Outcome::Admitted,
                            OVER_LIMIT => Outcome::Over,
                            code => panic!("overall code {code}"),
                        },
                        Err(s) => {
                            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                            Outcome::Unavailable
                        }
                    };
                    match outcome {
                        Outcome::Admitted => admitted.fetch_add(1, Ordering::Relaxed),
                        Outcome::Over => over.fetch_add(1, Ordering::Relaxed),
                        Outcome::Unavailable => 0,
                    };
                    replies.push(Reply {
                        sent,
                        received: Instant::now(),
                        outcome,
                    });
                    tokio::time::sleep_until((sent + pace).into()).await;
                }
                replies
            }));
        }
        Race {
            admitted,
            over,
            stop,
            callers,
        }
    }

    /// Waits until `n` requests are admitted.
    async fn admitted(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.admitted.load(Ordering::Relaxed) < n {
            assert!(Instant::now() < deadline, "{n} never admitted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `n` more requests are over the limit, and stops the callers: their replies.
    async fn until_over(self, n: u64) -> Vec<Reply> {
        let target = self.over.load(Ordering::Relaxed) + n;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.over.load(Ordering::Relaxed) < target {
            assert!(
                Instant::now() < deadline,
                "the limit was never reached again"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.stop.store(true, Ordering::Relaxed);
        gather(self.callers).await
    }
}

/// What a race through a failover came to.
struct Measured {
    admitted: u64,
    /// The longest any request waited for its answer.
    slowest: Duration,
    /// From `since` to the first request sent after it that was decided.
    resumed: Duration,
    /// Requests answered by the policy (UNAVAILABLE).
    undecided: usize,
    replies: usize,
}

impl Measured {
    fn of(replies: &[Reply], since: Instant) -> Measured {
        Measured {
            admitted: replies
                .iter()
                .filter(|r| r.outcome == Outcome::Admitted)
                .count() as u64,
            slowest: replies
                .iter()
                .map(|r| r.received - r.sent)
                .max()
                .unwrap_or_default(),
            resumed: replies
                .iter()
                .filter(|r| r.sent >= since && r.outcome != Outcome::Unavailable)
                .map(|r| r.received - since)
                .min()
                .expect("decisions resumed"),
            undecided: replies
                .iter()
                .filter(|r| r.outcome == Outcome::Unavailable)
                .count(),
            replies: replies.len(),
        }
    }

    /// The measures, as the benchmarks report them.
    fn summary(&self) -> String {
        format!(
            "{} admitted of {L}; answers within {:.2?}; decisions again {:.2?} after; {} of {} \
             answered by policy",
            self.admitted, self.slowest, self.resumed, self.undecided, self.replies
        )
    }

    /// The bounds every failover keeps: answers within `ANSWERED`, decisions again within
    /// `RESUMED`.
    fn bounded(&self) {
        assert!(self.slowest <= ANSWERED, "{}", self.summary());
        assert!(self.resumed <= RESUMED, "{}", self.summary());
    }
}

/// sluice racing on `url`, with or without replica confirmation; the local over-limit cache is
/// off so that every request reaches Redis.
async fn racing_sluice(url: &str, confirm: bool) -> Sluice {
    let mut flags = vec![
        "--redis-url",
        url,
        "--redis-key-prefix",
        "race:",
        "--store-timeout",
        STORE_TIMEOUT,
        "--local-cache-size",
        "0",
    ];
    if confirm {
        flags.extend(["--redis-confirm-replicas", "1"]);
    }
    Sluice::on(Store::Memory, &[("rules.yaml", RACE_RULES)], &flags).await
}

/// Waits, at most 20 s, until `ready`; when it was.
async fn when(what: &str, mut ready: impl FnMut() -> bool) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Instant::now()
}

/// The Sentinel race: the replica cut off `LAG` before its primary is killed.
async fn sentinel_promotion(mut redis: Sentinels, confirm: bool) -> Measured {
    let sluice = racing_sluice(&redis.url, confirm).await;
    let race = Race::start(&sluice, "hot", RACE_PACE).await;
    race.admitted(L / 3).await;
    redis.replica.cut_off();
    tokio::time::sleep(LAG).await;
    redis.primary.kill();
    let promoted = when("the replica is promoted", || redis.replica.is_primary()).await;
    // The old primary comes back empty, as a replica of the new one: with confirmation, the
    // first replica that can confirm.
    redis.primary.start();
    let new_primary = redis.replica.port.to_string();
    redis.primary.cli(&["REPLICAOF", "127.0.0.1", &new_primary]);
    let attached = when("the old primary replicates the new one", || {
        redis.primary.in_sync()
    })
    .await;
    let replies = race.until_over(200).await;
    Measured::of(&replies, if confirm { attached } else { promoted })
}

#[tokio::test(flavor = "multi_thread")]
async fn with_replica_confirmation_a_sentinel_promotion_of_a_lagging_replica_never_over_admits() {
    let deployment = Sentinels::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let measured = sentinel_promotion(deployment, true).await;
    eprintln!("Sentinel, confirmed: {}", measured.summary());
    assert!(measured.admitted <= L, "{}", measured.summary());
    measured.bounded();
}

#[tokio::test(flavor = "multi_thread")]
async fn without_replica_confirmation_a_sentinel_promotion_of_a_lagging_replica_admits_the_lost_hits_again()
 {
    let deployment = Sentinels::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let measured = sentinel_promotion(deployment, false).await;
    eprintln!(
        "Sentinel, unconfirmed: {} hits lost; {}",
        measured.admitted.saturating_sub(L),
        measured.summary()
    );
    assert!(measured.admitted > L, "{}", measured.summary());
    measured.bounded();
}

/// The Cluster race: the replica of the counter's primary cut off `LAG` before its primary is
/// killed.
async fn cluster_promotion(mut cluster: ReplicatedCluster, confirm: bool) -> Measured {
    let sluice = racing_sluice(&cluster.url, confirm).await;
    let race = Race::start(&sluice, "hot", RACE_PACE).await;
    race.admitted(L / 3).await;
    let key = cluster.keys("race:").pop().expect("the counter's key");
    let primary = cluster.holder_of(&key);
    let replica = cluster.replica_of(primary);
    cluster.nodes[replica].cut_off();
    tokio::time::sleep(LAG).await;
    cluster.nodes[primary].kill();
    let promoted = when("the replica is promoted", || {
        cluster.nodes[replica].is_primary()
    })
    .await;
    // The old primary comes back with its cluster state, and follows the new one.
    cluster.nodes[primary].start();
    let attached = when("the old primary replicates the new one", || {
        cluster.nodes[primary].in_sync()
    })
    .await;
    let replies = race.until_over(200).await;
    Measured::of(&replies, if confirm { attached } else { promoted })
}

#[tokio::test(flavor = "multi_thread")]
async fn with_replica_confirmation_a_cluster_promotion_of_a_lagging_replica_never_over_admits() {
    let deployment = ReplicatedCluster::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let measured = cluster_promotion(deployment, true).await;
    eprintln!("Cluster, confirmed: {}", measured.summary());
    assert!(measured.admitted <= L, "{}", measured.summary());
    measured.bounded();
}

#[tokio::test(flavor = "multi_thread")]
async fn without_replica_confirmation_a_cluster_promotion_of_a_lagging_replica_admits_the_lost_hits_again()
 {
    let deployment = ReplicatedCluster::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let measured = cluster_promotion(deployment, false).await;
    eprintln!(
        "Cluster, unconfirmed: {} hits lost; {}",
        measured.admitted.saturating_sub(L),
        measured.summary()
    );
    assert!(measured.admitted > L, "{}", measured.summary());
    measured.bounded();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_manual_cluster_failover_under_load_loses_nothing() {
    let cluster = ReplicatedCluster::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    let sluice = racing_sluice(&cluster.url, false).await;
    let race = Race::start(&sluice, "hot", RACE_PACE).await;
    race.admitted(L / 3).await;
    let key = cluster.keys("race:").pop().expect("the counter's key");
    let replica = cluster.replica_of(cluster.holder_of(&key));
    assert_eq!(
        cluster.nodes[replica].cli(&["CLUSTER", "FAILOVER"]).trim(),
        "OK"
    );
    let promoted = when("the replica is promoted", || {
        cluster.nodes[replica].is_primary()
    })
    .await;
    let measured = Measured::of(&race.until_over(200).await, promoted);
    eprintln!("CLUSTER FAILOVER: {}", measured.summary());
    assert!(measured.admitted <= L, "{}", measured.summary());
    measured.bounded();
}

/// The slot ranges each primary of `cluster` serves, from `CLUSTER NODES`: (port, first, last).
fn slot_ranges(cluster: &ReplicatedCluster) -> Vec<(u16, u16, u16)> {
    let nodes = cluster.nodes[cluster.primaries()[0]].cli(&["CLUSTER", "NODES"]);
    nodes
        .lines()
        .filter(|line| line.split(' ').nth(2).is_some_and(|f| f.contains("master")))
        .flat_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("a node's port");
            fields[8..]
                .iter()
                .filter_map(move |range| {
                    let (first, last) = range.split_once('-').unwrap_or((range, range));
                    Some((port, first.parse().ok()?, last.parse().ok()?))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_resharded_under_load_keeps_its_counts() {
    let cluster = ReplicatedCluster::start();
    let _alone = ONE_AT_A_TIME.lock().await;
    // A value whose counter's slot comes early in its primary's range, so that resharding the
    // first slots of that primary moves it (`redis-cli --cluster reshard` takes them in order):
    // a scout request names 64 values, and the counters' keys tell their slots.
    let scout = racing_sluice(&cluster.url, false).await;
    let values: Vec<String> = (0..64).map(|i| format!("v{i}")).collect();
    let descriptors: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("k", v.as_str())]).collect();
    let descriptors: Vec<&[(&str, &str)]> = descriptors.iter().map(|d| &d[..]).collect();
    scout.ask(request("race", &descriptors)).await;
    let ranges = slot_ranges(&cluster);
    let rank = |slot: u16| {
        ranges
            .iter()
            .find(|&&(_, first, last)| (first..=last).contains(&slot))
            .map(|&(port, first, _)| (slot - first, port))
            .expect("every slot is served")
    };
    let (moved, value, tag, from) = cluster
        .keys("race:")
        .into_iter()
        .map(|key| {
            let (rank, port) = rank(fred::util::redis_keyslot(key.as_bytes()));
            let value = values
                .iter()
                .find(|v| key.contains(&format!(":k{}:{v}", v.len())))
                .expect("a key names its value")
                .clone();
            let tag = key[key.find('{').unwrap()..=key.find('}').unwrap()].to_owned();
            (rank + 1, value, tag, port)
        })
        .min_by_key(|found| found.0)
        .expect("the scout's counters");
    drop(scout);
    // The counter is made again by the race, after the filler: Redis hands a slot's newest keys
    // to the migration first, so it moves early and its requests meet ASK until the slot is done.
    for key in cluster.keys("race:") {
        let holder = cluster.holder_of(&key);
        cluster.nodes[holder].cli(&["DEL", &key]);
    }
    let from_node = cluster.nodes.iter().position(|n| n.port == from).unwrap();
    let to_node = cluster
        .primaries()
        .into_iter()
        .find(|&i| i != from_node)
        .unwrap();
    // Keys enough in the slot that its migration takes a while: requests meet ASK meanwhile.
    let filler = format!("filler:{tag}:");
    cluster.nodes[from_node].cli(&[
        "EVAL",
        "for i = 1, tonumber(ARGV[1]) do redis.call('SET', KEYS[1] .. i, 'x') end",
        "1",
        &filler,
        "20000",
    ]);

    let sluice = racing_sluice(&cluster.url, false).await;
    let race = Race::start(&sluice, &value, Duration::from_millis(10)).await;
    race.admitted(100).await;
    let (from_id, to_id) = (
        cluster.nodes[from_node].node_id(),
        cluster.nodes[to_node].node_id(),
    );
    let address = format!("127.0.0.1:{from}");
    let resharded = tokio::task::spawn_blocking(move || {
        std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &address])
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &moved.to_string(), "--cluster-yes"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("redis-cli runs")
    })
    .await
    .unwrap();
    assert!(
        resharded.status.success(),
        "{}",
        String::from_utf8_lossy(&resharded.stdout)
    );
    let done = Instant::now();
    let key = cluster
        .keys("race:")
        .into_iter()
        .find(|k| k.contains(&format!(":k{}:{value}", value.len())))
        .expect("the counter");
    assert_eq!(cluster.holder_of(&key), to_node, "the counter moved");
    let measured = Measured::of(&race.until_over(200).await, done);
    let replies = |node: usize, reply: &str| -> u64 {
        let stat = format!("errorstat_{reply}:count=");
        cluster.nodes[node]
            .cli(&["INFO", "errorstats"])
            .lines()
            .find_map(|l| l.strip_prefix(&stat)?.trim().parse().ok())
            .unwrap_or(0)
    };
    let (asked, moved_replies) = (replies(from_node, "ASK"), replies(from_node, "MOVED"));
    eprintln!(
        "reshard of {moved} slots: {}; {asked} ASK, {moved_replies} MOVED",
        measured.summary()
    );
    assert!(asked > 0, "no request met the migration");
    assert!(measured.admitted <= L, "{}", measured.summary());
    measured.bounded();
    assert!(
        measured.undecided as u64 <= asked + moved_replies,
        "only the redirected requests are answered by policy: {}",
        measured.summary()
    );
}
