//! The quota service's grants across replicas sharing Redis: a share shrinks at once and grows
//! only by what no stream on any replica holds, so that at every answer any stream gets, the live
//! assignments of a bucket add up to at most its limit — through a new subscriber on the other
//! replica, a stream going idle, a stream ending, Redis restarted empty and a replica killed; and
//! a division changed on one replica reaches the streams of the other within a few round trips
//! (the time is printed).

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use futures_util::FutureExt;

use support::quota::{QuotaStream, bucket, share};
use support::redis::Controlled;
use support::{Sluice, Store, eventually};

const DOMAIN: &str = "quota";
const RULES: &str = "
domain: quota
quota_buckets:
  - bucket: {name: shared}
    rate_limit: {unit: second, requests_per_unit: 20}
";
/// Requests per second.
const LIMIT: f64 = 20.0;
/// How long an assignment lives here: the Envoys of a killed replica enforce theirs that long.
const TTL: Duration = Duration::from_secs(5);
/// No answer for this long: the division has settled.
const QUIET: Duration = Duration::from_millis(600);
/// The longest a division may take to reach the state a test expects.
const SETTLED: Duration = Duration::from_secs(10);
/// How long an answer sent on one connection may take to be read after one sent later on another.
const IN_FLIGHT: Duration = Duration::from_millis(250);

fn shared() -> BucketId {
    bucket(&[("name", "shared")])
}

/// A stream's last assignment of the bucket, in requests per second, when it came and how long
/// it lives.
#[derive(Clone, Copy, Debug)]
struct Assigned {
    rate: f64,
    at: Instant,
    ttl: Duration,
}

/// The test's Envoys: their streams (`None` once ended), what each enforces, and the streams of
/// a killed replica, whose Envoys enforce their last assignments until these expire.
struct Envoys {
    streams: Vec<Option<QuotaStream>>,
    live: Vec<Option<Assigned>>,
    /// Every assignment each stream got, in order.
    given: Vec<Vec<Assigned>>,
    answers: usize,
}

impl Envoys {
    fn new() -> Self {
        Envoys {
            streams: Vec::new(),
            live: Vec::new(),
            given: Vec::new(),
            answers: 0,
        }
    }

    /// Opens a stream on `sluice`; its index.
    async fn open(&mut self, sluice: &Sluice) -> usize {
        self.streams
            .push(Some(QuotaStream::open(sluice, DOMAIN).await));
        self.live.push(None);
        self.given.push(Vec::new());
        self.streams.len() - 1
    }

    /// Envoy `i` reports `allowed` and `denied` requests of the bucket.
    async fn report(&self, i: usize, allowed: u64, denied: u64) {
        let stream = self.streams[i].as_ref().expect("an open stream");
        stream.report(&[(&shared(), allowed, denied)]).await;
    }

    /// Envoy `i`'s stream ends: its assignment no longer counts.
    fn end(&mut self, i: usize) {
        self.streams[i] = None;
        self.live[i] = None;
    }

    /// Envoy `i`'s replica dies: its stream ends, and its Envoy enforces its last assignment
    /// until it expires.
    fn cut(&mut self, i: usize) {
        self.streams[i] = None;
    }

    /// Requests per second of the assignments live now.
    fn total(&self) -> f64 {
        self.live
            .iter()
            .flatten()
            .filter(|a| a.at.elapsed() < a.ttl)
            .map(|a| a.rate)
            .sum()
    }

    fn rate(&self, i: usize) -> f64 {
        self.live[i].map_or(0.0, |a| a.rate)
    }

    /// Reads answers as they come until none comes for `QUIET` (or `within` passes), checking
    /// at each that the live assignments add up to at most the limit; when the last came.
    async fn settle(&mut self, within: Duration) -> Instant {
        let start = Instant::now();
        let mut last = start;
        while start.elapsed() < within {
            let next = self.next_answer();
            match tokio::time::timeout(QUIET, next).await {
                Ok(()) => last = Instant::now(),
                Err(_) => break,
            }
        }
        last
    }

    /// Reads answers as they come until `done` holds of the assignments (or `within` passes),
    /// then until none comes for `QUIET`, checking the bound at each; when `done` first held.
    /// The quota thread runs at the lowest priority: on a busy machine its answers may be slow
    /// to come, and the state they settle to is waited for, not assumed after a quiet spell.
    async fn settle_to(&mut self, within: Duration, done: impl Fn(&Self) -> bool) -> Instant {
        let start = Instant::now();
        while !done(self) {
            let left = within.saturating_sub(start.elapsed());
            if tokio::time::timeout(left, self.next_answer())
                .await
                .is_err()
            {
                break;
            }
        }
        let reached = Instant::now();
        self.settle(QUIET).await;
        reached
    }

    /// Waits for an answer on any stream, then takes every other one already there, before
    /// checking the bound. A shrink is sent before what it frees is given, but on another
    /// connection: it may be read after the growth it made room for, so the check waits up to
    /// `IN_FLIGHT` for answers still on their way while the bound is exceeded.
    async fn next_answer(&mut self) {
        let waiting: Vec<_> = self
            .streams
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_mut().map(|s| (i, s)))
            .map(|(i, s)| Box::pin(async move { (i, s.answers.message().await) }))
            .collect();
        if waiting.is_empty() {
            std::future::pending::<()>().await;
        }
        let ((i, answer), _, _) = futures_util::future::select_all(waiting).await;
        self.take(i, answer);
        self.take_arrived();
        let checked = Instant::now();
        while self.total() > LIMIT + 1e-9 && checked.elapsed() < IN_FLIGHT {
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.take_arrived();
        }
        let total = self.total();
        assert!(
            total <= LIMIT + 1e-9,
            "the live assignments add up to {total}/s, more than {LIMIT}/s: {:?}",
            self.live
        );
    }

    /// Takes every answer already there.
    fn take_arrived(&mut self) {
        let mut answers = Vec::new();
        for (j, stream) in self.streams.iter_mut().enumerate() {
            let Some(stream) = stream else { continue };
            while let Some(answer) = stream.answers.message().now_or_never() {
                answers.push((j, answer));
            }
        }
        for (j, answer) in answers {
            self.take(j, answer);
        }
    }

    /// Takes an answer on stream `i`: its assignment is live from now; told to abandon the
    /// bucket, its Envoy enforces none (it falls back to its no-assignment behaviour).
    fn take(&mut self, i: usize, answer: Result<Option<RateLimitQuotaResponse>, tonic::Status>) {
        let answer = answer
            .expect("the stream stays open")
            .expect("the stream stays open");
        for action in answer.bucket_action {
            assert_eq!(action.bucket_id, Some(shared()));
            let assigned = match action.bucket_action {
                Some(Action::QuotaAssignmentAction(assigned)) => assigned,
                Some(Action::AbandonAction(_)) => {
                    self.live[i] = None;
                    continue;
                }
                None => panic!("expected an assignment, got {action:?}"),
            };
            let ttl = assigned
                .assignment_time_to_live
                .map_or(TTL, |t| Duration::from_secs(t.seconds.max(0) as u64));
            let strategy = assigned
                .rate_limit_strategy
                .and_then(|s| s.strategy)
                .expect("a strategy");
            let rate = match strategy {
                Strategy::BlanketRule(r) if r == BlanketRule::DenyAll as i32 => 0.0,
                other => share(&other, 1),
            };
            let assigned = Assigned {
                rate,
                at: Instant::now(),
                ttl,
            };
            self.live[i] = Some(assigned);
            self.given[i].push(assigned);
            self.answers += 1;
        }
    }
}

fn replica(redis: &Controlled, prefix: &str) -> [String; 6] {
    [
        "--redis-url".into(),
        redis.url.clone(),
        "--redis-key-prefix".into(),
        prefix.into(),
        "--quota-assignment-ttl".into(),
        format!("{}s", TTL.as_secs()),
    ]
}

async fn start(redis: &Controlled, prefix: &str) -> Sluice {
    start_with(redis, prefix, &[]).await
}

async fn start_with(redis: &Controlled, prefix: &str, extra: &[&str]) -> Sluice {
    let flags = replica(redis, prefix);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(extra);
    Sluice::on(Store::Memory, &[("quota.yaml", RULES)], &flags).await
}

/// Reads `stream`'s answers until every report it sent is answered: a stream's reports are
/// answered in order, so once a report of a bucket no rule matches (answered without the store)
/// is, so is every one before it. No answer for `QUIET` does not tell as much on a loaded host,
/// where a report may still be settling seconds later, after what the test does next.
async fn all_answered(stream: &mut QuotaStream) {
    let unmatched = bucket(&[("name", "unmatched")]);
    stream.report(&[(&unmatched, 0, 0)]).await;
    while !stream
        .answer()
        .await
        .bucket_action
        .iter()
        .any(|action| action.bucket_id.as_ref() == Some(&unmatched))
    {}
}

fn near(rate: f64, expected: f64) -> bool {
    (rate - expected).abs() <= expected * 0.02 + 1e-9
}

#[tokio::test(flavor = "multi_thread")]
async fn the_assignments_of_a_bucket_never_add_up_to_more_than_its_limit() {
    let mut redis = Controlled::started();
    let prefix = format!("grants-{}:", std::process::id());
    let one = start(&redis, &prefix).await;
    let mut two = start(&redis, &prefix).await;
    let mut envoys = Envoys::new();
    let busy = (100, 100);

    let (a, b) = halves_across(
        &mut envoys,
        &one,
        &two,
        "a new subscriber on the other replica",
    )
    .await;

    // Busy on both, and a third on the first replica: thirds.
    envoys.report(a, busy.0, busy.1).await;
    envoys.report(b, busy.0, busy.1).await;
    let c = envoys.open(&one).await;
    envoys.report(c, 1, 0).await;
    envoys
        .settle_to(SETTLED, |e| {
            [a, b, c].iter().all(|&i| near(e.rate(i), LIMIT / 3.0))
        })
        .await;
    for i in [a, b, c] {
        assert!(near(envoys.rate(i), LIMIT / 3.0), "{:?}", envoys.live);
    }

    // c goes idle: it keeps one request a second, the others share the rest.
    envoys.report(c, 0, 0).await;
    let asked = Instant::now();
    let last = envoys
        .settle_to(SETTLED, |e| {
            e.rate(c) == 1.0 && near(e.rate(a), 9.5) && near(e.rate(b), 9.5)
        })
        .await;
    assert_eq!(envoys.rate(c), 1.0, "{:?}", envoys.live);
    assert!(
        near(envoys.rate(a), 9.5) && near(envoys.rate(b), 9.5),
        "{:?}",
        envoys.live
    );
    println!(
        "a stream gone idle: its share on both replicas {:?} after its report",
        last - asked
    );

    // c's stream ends: its share goes to the others at once.
    envoys.end(c);
    envoys
        .settle_to(SETTLED, |e| (e.rate(a), e.rate(b)) == (10.0, 10.0))
        .await;
    assert_eq!((envoys.rate(a), envoys.rate(b)), (10.0, 10.0));

    // Redis restarted empty: the replicas list their streams again before any grows, and a new
    // subscriber gets only what is free.
    let clients = |redis: &Controlled| redis.cli(&["CLIENT", "LIST"]).lines().count();
    let connected = clients(&redis);
    redis.kill();
    redis.start();
    // Once both replicas have reached it again: a subscriber new while the store cannot answer
    // gets the limit divided among its replica's streams, which is the outage's bound, not this.
    eventually(
        "both replicas reconnect",
        Duration::from_secs(10),
        async || {
            clients(&redis) >= connected
                && [&one, &two]
                    .iter()
                    .all(|s| support::http(s.http, "GET", "/readyz", "").0 == 200)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d = envoys.open(&one).await;
    let restart = Instant::now();
    while restart.elapsed() < Duration::from_secs(4) {
        envoys.report(d, busy.0, busy.1).await;
        envoys.report(a, busy.0, busy.1).await;
        envoys.report(b, busy.0, busy.1).await;
        envoys.settle(Duration::from_millis(500)).await;
    }
    envoys
        .settle_to(SETTLED, |e| {
            [a, b, d].iter().all(|&i| near(e.rate(i), LIMIT / 3.0))
        })
        .await;
    for i in [a, b, d] {
        assert!(near(envoys.rate(i), LIMIT / 3.0), "{:?}", envoys.live);
    }

    // The second replica killed: its Envoys enforce b's share until it expires, and the store
    // counts it that long; then the first replica's streams take it.
    two.kill();
    envoys.cut(b);
    let killed = Instant::now();
    let mut grown = None;
    while killed.elapsed() < Duration::from_secs(25) && grown.is_none() {
        envoys.report(a, busy.0, busy.1).await;
        envoys.report(d, busy.0, busy.1).await;
        envoys.settle(Duration::from_secs(1)).await;
        if near(envoys.rate(a), LIMIT / 2.0) && near(envoys.rate(d), LIMIT / 2.0) {
            grown = Some(killed.elapsed());
        }
    }
    let grown = grown.expect("the killed replica's share comes back");
    assert!(
        grown >= TTL,
        "b's share was taken {grown:?} after its replica died, before its assignment expired"
    );
    println!(
        "a replica killed: its streams' shares taken by the others {grown:?} after; {} answers checked",
        envoys.answers
    );
}

/// The sequence that once let a bucket's assignments add up past its limit: A and C on the
/// first replica, B on the second, each reporting every second; A and B busy (30/s), C at 2/s,
/// then idle, so that it is told to abandon the bucket (after 3 idle reports here), while B's
/// stream is cancelled on the other replica. C reports its idle bucket still, as a client that
/// ignores the abandon would. At every answer the live assignments add up to at most the limit,
/// and once C reported no request, it is never granted more than the minimum, one a second.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_stream_abandoned_while_a_busy_one_ends_on_the_other_replica_gets_no_more_than_the_minimum()
 {
    let redis = Controlled::started();
    let prefix = format!("abandon-{}:", std::process::id());
    let one = start_with(&redis, &prefix, &["--quota-abandon-after", "3"]).await;
    let two = start(&redis, &prefix).await;
    let mut envoys = Envoys::new();
    let a = envoys.open(&one).await;
    let c = envoys.open(&one).await;
    let b = envoys.open(&two).await;
    for _ in 0..4 {
        envoys.report(a, 30, 0).await;
        envoys.report(b, 30, 0).await;
        envoys.report(c, 2, 0).await;
        envoys.settle(Duration::from_secs(1)).await;
    }
    let idle_from = envoys.given[c].len();
    for second in 0..8 {
        envoys.report(a, 30, 0).await;
        envoys.report(c, 0, 0).await;
        if second == 4 {
            envoys.end(b);
        } else if second < 4 {
            envoys.report(b, 30, 0).await;
        }
        envoys.settle(Duration::from_secs(1)).await;
    }
    // The first answer to its idle report may still carry its share of before.
    let idle: Vec<f64> = envoys.given[c][idle_from..]
        .iter()
        .skip(1)
        .map(|g| g.rate)
        .collect();
    assert!(
        idle.iter().all(|&rate| rate <= 1.0 + 1e-9),
        "C, idle, was granted {idle:?}"
    );
    envoys
        .settle_to(SETTLED, |e| {
            near(e.rate(a), LIMIT - 1.0) || e.rate(a) == LIMIT
        })
        .await;
    println!("{} answers checked", envoys.answers);
}

/// A reload lowering the bucket's limit from 20/s to 6/s while three busy streams on two
/// replicas hold 6.67/s each: every stream is sent 2/s without reporting again (an Envoy reports
/// every 5 s, and one that stopped would keep its share until its assignment expired), and the
/// time it took is printed; then one changing its unit (6 a minute): 2 a minute each.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_lowering_the_limit_shrinks_every_share_without_waiting_for_a_report() {
    let redis = Controlled::started();
    let prefix = format!("reload-{}:", std::process::id());
    let one = start(&redis, &prefix).await;
    let two = start(&redis, &prefix).await;
    let mut envoys = Envoys::new();
    let a = envoys.open(&one).await;
    let b = envoys.open(&one).await;
    let c = envoys.open(&two).await;
    let all = [a, b, c];
    for _ in 0..3 {
        for i in all {
            envoys.report(i, 30, 0).await;
        }
        envoys.settle(Duration::from_secs(1)).await;
    }
    envoys
        .settle_to(SETTLED, |e| {
            all.iter().all(|&i| near(e.rate(i), LIMIT / 3.0))
        })
        .await;
    let lowered = RULES.replace("requests_per_unit: 20", "requests_per_unit: 6");
    for sluice in [&one, &two] {
        std::fs::write(sluice.rules.join("quota.yaml"), &lowered).expect("rules written");
    }
    let reloaded = Instant::now();
    let reached = envoys
        .settle_to(SETTLED, |e| all.iter().all(|&i| near(e.rate(i), 2.0)))
        .await;
    for i in all {
        assert!(near(envoys.rate(i), 2.0), "{:?}", envoys.live);
    }
    println!(
        "a lowered limit: every stream had its new share {:?} after the reload, unasked",
        reached - reloaded
    );
    // The unit changed: 6 a minute, 2 a minute each.
    let per_minute = lowered.replace("unit: second", "unit: minute");
    for sluice in [&one, &two] {
        std::fs::write(sluice.rules.join("quota.yaml"), &per_minute).expect("rules written");
    }
    envoys
        .settle_to(SETTLED, |e| {
            all.iter().all(|&i| near(e.rate(i), 2.0 / 60.0))
        })
        .await;
    for i in all {
        assert!(near(envoys.rate(i), 2.0 / 60.0), "{:?}", envoys.live);
    }
}

/// A reload that stops a rule dividing its bucket (here, `unlimited`) sends every stream its
/// fixed answer without waiting for a report, and takes them out of the division in the store:
/// once the limit is back, the first stream to report is alone in it and gets the whole limit,
/// the other's old demand no longer counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_stops_a_rule_dividing_sends_its_fixed_answer_at_once_and_frees_the_grants() {
    let redis = Controlled::started();
    let prefix = format!("reload-off-{}:", std::process::id());
    let one = start(&redis, &prefix).await;
    let two = start(&redis, &prefix).await;
    let mut a = QuotaStream::open(&one, DOMAIN).await;
    let mut b = QuotaStream::open(&two, DOMAIN).await;
    a.ask(&shared(), 30, 0).await;
    b.ask(&shared(), 30, 0).await;
    // Both busy: 10 a second each, once every push has come.
    for stream in [&mut a, &mut b] {
        eventually("10 a second each", SETTLED, async || {
            stream.report(&[(&shared(), 30, 0)]).await;
            share(&stream.ask(&shared(), 30, 0).await, 1) == 10.0
        })
        .await;
        all_answered(stream).await;
        while !stream.quiet_for(QUIET).await {}
    }
    let unlimited = RULES.replace(
        "rate_limit: {unit: second, requests_per_unit: 20}",
        "rate_limit: {unlimited: true}",
    );
    for sluice in [&one, &two] {
        std::fs::write(sluice.rules.join("quota.yaml"), &unlimited).expect("rules written");
    }
    let reloaded = Instant::now();
    // A replica that reloads first frees its stream's grant, which the other's may be sent
    // before that one reloads too.
    for stream in [&mut a, &mut b] {
        let allowed = async {
            loop {
                let pushed = stream.answer().await;
                let strategy = support::quota::only(&pushed, &shared());
                if strategy == Strategy::BlanketRule(BlanketRule::AllowAll as i32) {
                    break;
                }
            }
        };
        tokio::time::timeout(SETTLED, allowed)
            .await
            .expect("unlimited: allow all, pushed unasked");
    }
    println!(
        "a rule made unlimited: both streams told {:?} after the reload, unasked",
        reloaded.elapsed()
    );
    for sluice in [&one, &two] {
        std::fs::write(sluice.rules.join("quota.yaml"), RULES).expect("rules written");
    }
    eventually("the limit back", SETTLED, async || {
        let answer = a.ask(&shared(), 30, 0).await;
        !matches!(answer, Strategy::BlanketRule(_))
    })
    .await;
    all_answered(&mut a).await;
    while !a.quiet_for(QUIET).await {}
    assert_eq!(
        share(&a.ask(&shared(), 30, 0).await, 1),
        LIMIT,
        "alone in the division: the other stream left it at the reload"
    );
}

/// A replica dies while its stream holds the whole limit, and a new subscriber on the other
/// replica waits for that grant: it is told nothing, not "deny all" (its Envoy keeps what it has,
/// as one reconnecting from the dead replica keeps the assignment the dead grant stands for), and
/// it is sent the limit without reporting again as soon as the dead stream stops being counted
/// (15 s after its last report), not at its next report.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_waiting_for_a_dead_replicas_grant_is_told_nothing_then_sent_it_when_it_lapses() {
    let redis = Controlled::started();
    let prefix = format!("grants-dead-{}:", std::process::id());
    let one = start(&redis, &prefix).await;
    let mut two = start(&redis, &prefix).await;
    let mut envoys = Envoys::new();
    let b = envoys.open(&two).await;
    envoys.report(b, 1, 0).await;
    let reported = Instant::now();
    envoys.settle_to(SETTLED, |e| e.rate(b) == LIMIT).await;
    assert_eq!(envoys.rate(b), LIMIT, "alone, the whole limit");

    two.kill();
    envoys.cut(b);
    let e = envoys.open(&one).await;
    envoys.report(e, 100, 100).await;
    envoys.settle(Duration::from_secs(2)).await;
    assert!(
        envoys.live[e].is_none(),
        "told nothing while the dead stream holds the limit: {:?}",
        envoys.live
    );
    while envoys.live[e].is_none() && reported.elapsed() < Duration::from_secs(25) {
        envoys.settle(Duration::from_secs(1)).await;
    }
    let sent = envoys.live[e].map_or(reported.elapsed(), |a| a.at - reported);
    assert_eq!(envoys.rate(e), LIMIT, "{:?} after: {:?}", sent, envoys.live);
    assert!(
        (Duration::from_secs(15)..Duration::from_secs(18)).contains(&sent),
        "the waiting stream is sent the limit as the dead one lapses, 15 s after its report: \
         {sent:?}"
    );
    println!("a waiting stream: sent its grant {sent:?} after the dead stream's last report");
}

/// A replica cut off from Redis (a partition) keeps answering its stream with its last
/// assignment only while the stream's last record stays counted (15 s), each answer living no
/// longer: once it lapses, the other replica gives its share away, and the two never add up past
/// the limit, checked at every answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_cut_off_from_redis_renews_no_share_past_its_record_while_the_other_gives_it_away()
 {
    let redis = Controlled::started();
    let prefix = format!("grants-cut-{}:", std::process::id());
    let proxy = support::proxy::Proxy::start(redis.port).await;
    let one = start(&redis, &prefix).await;
    let mut flags = replica(&redis, &prefix);
    flags[1] = format!("redis://127.0.0.1:{}", proxy.port);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let two = Sluice::on(Store::Memory, &[("quota.yaml", RULES)], &flags).await;
    let mut envoys = Envoys::new();
    let a = envoys.open(&two).await;
    let b = envoys.open(&one).await;
    // Reported every 5 s, as Envoy does, until each has about half: on a loaded host a record
    // through the proxy may miss its deadline, and its bucket then waits for the next report.
    let halves = |e: &Envoys| {
        [e.rate(a), e.rate(b)]
            .iter()
            .all(|rate| (9.0..=11.0).contains(rate))
    };
    let settling = Instant::now();
    while !halves(&envoys) && settling.elapsed() < SETTLED * 3 {
        envoys.report(a, 30, 0).await;
        envoys.report(b, 30, 0).await;
        envoys.settle_to(Duration::from_secs(5), halves).await;
    }
    assert!(
        halves(&envoys) && envoys.rate(a) + envoys.rate(b) <= LIMIT,
        "halves: {:?}",
        envoys.live
    );

    drop(proxy);
    let cut = Instant::now();
    while cut.elapsed() < Duration::from_secs(24) {
        envoys.report(a, 30, 0).await;
        envoys.report(b, 30, 0).await;
        envoys.settle(Duration::from_secs(1)).await;
    }
    let last = envoys.given[a].last().expect("answers to a").to_owned();
    assert!(
        last.at + last.ttl <= cut + Duration::from_secs(16),
        "a's last kept answer lives past its record's lapse: {last:?}, {:?} after the cut",
        last.at - cut
    );
    assert_eq!(
        envoys.rate(b),
        LIMIT,
        "the other replica's stream has the whole limit once a's record lapsed"
    );
}

/// On a Cluster, the script's channel reaches the other replica as well: a new subscriber there
/// has its half once the first stream has given it back, checked at every answer.
#[tokio::test(flavor = "multi_thread")]
async fn on_a_cluster_a_share_moves_to_the_other_replica_the_same_way() {
    let prefix = format!("grants-cluster-{}:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let one = Sluice::on(Store::Cluster, &[("quota.yaml", RULES)], &flags).await;
    let two = Sluice::on(Store::Cluster, &[("quota.yaml", RULES)], &flags).await;
    halves_across(&mut Envoys::new(), &one, &two, "on a Cluster").await;
}

/// A stream on `one` alone has the whole limit; a new subscriber on `two` has half once the
/// first has given it back (the time printed, as `what`). Their indexes.
async fn halves_across(
    envoys: &mut Envoys,
    one: &Sluice,
    two: &Sluice,
    what: &str,
) -> (usize, usize) {
    let a = envoys.open(one).await;
    envoys.report(a, 1, 0).await;
    envoys.settle_to(SETTLED, |e| e.rate(a) == LIMIT).await;
    assert_eq!(envoys.rate(a), LIMIT, "alone, the whole limit");
    let b = envoys.open(two).await;
    let asked = Instant::now();
    envoys.report(b, 1, 0).await;
    let last = envoys
        .settle_to(SETTLED, |e| (e.rate(a), e.rate(b)) == (10.0, 10.0))
        .await;
    assert_eq!((envoys.rate(a), envoys.rate(b)), (10.0, 10.0));
    println!(
        "{what}: halves in place {:?} after the new subscriber's first report",
        last - asked
    );
    (a, b)
}

/// `lua/demand.lua`, called as a replica calls it, to pin what a call meets on a restarted server.
const DEMAND: &str = include_str!("../../lua/demand.lua");

/// One call of the demand script for bucket `key`: `stream` reports wanting all of the limit
/// (20/s, in thousandths), as a replica whose last answer came from `heard` ("" for none) calls
/// it; the grant it gets, and the server that answered.
fn wants_all(redis: &Controlled, key: &str, stream: &str, heard: &str) -> (u64, String) {
    let args = [
        "EVAL",
        DEMAND,
        "1",
        key,
        "t:quota-moves",
        "20000",
        "1",
        "15000",
        "2000",
        "0",
        "0",
        heard,
        "1",
        stream,
        "r",
        "20000",
        "0",
        "0",
    ];
    let out = redis.cli(&args);
    let lines: Vec<&str> = out.lines().collect();
    // The clock, the server; then the key's "again", lapse, count, and per stream its id,
    // demand, grant and share.
    assert!(lines.len() >= 5, "the demand script answered: {out}");
    let grant = lines[5..]
        .chunks(4)
        .find(|s| s[0] == stream)
        .map(|s| s[2].parse().expect("a grant"))
        .unwrap_or_else(|| panic!("{stream} counted: {out}"));
    (grant, lines[1].to_string())
}

#[test]
fn a_call_that_meets_another_server_than_the_one_its_replica_last_heard_from_grows_nothing() {
    let mut redis = Controlled::started();
    let (grant, first) = wants_all(&redis, "t:b", "r1:a", "");
    assert_eq!(grant, 20_000, "alone, all of it");
    assert_eq!(first.len(), 16, "the server's id: {first:?}");
    // Restarted empty: r1:a's Envoy still enforces its 20/s, which the new server does not know.
    redis.kill();
    redis.start();
    let (grant, second) = wants_all(&redis, "t:b", "r2:c", &first);
    assert_ne!(second, first, "a restarted server has another id");
    assert_eq!(grant, 0, "another replica's stream, new, takes nothing");
    assert!(
        !redis.cli(&["HGET", "t:b", "~frozen"]).trim().is_empty(),
        "the bucket is frozen for every replica"
    );
    let (grant, _) = wants_all(&redis, "t:b", "r2:c", &second);
    assert_eq!(
        grant, 0,
        "nothing grows while the replicas list what their streams hold"
    );
    // The same calls on a bucket of its own: one that names the server that answers grows, and
    // so does one that names none (a replica that never had an answer).
    let (grant, _) = wants_all(&redis, "t:c", "r2:c", &second);
    assert_eq!(grant, 20_000);
    let (grant, _) = wants_all(&redis, "t:d", "r2:c", "");
    assert_eq!(grant, 20_000);
}
