//! A standalone Redis failing under paced load: paused (SIGSTOP), killed and restarted, or not
//! started yet. Under each `--on-store-error` policy, answers stay prompt, Redis decides again soon
//! after it is back, and a counter holds exactly the requests answered with a decided OK.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use support::redis::Controlled;
use support::{
    HOUR, OK, ONE_AT_A_TIME, OVER_LIMIT, Sluice, Store, Wait, gather, http, in_one_window, request,
};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const STORE_TIMEOUT: &str = "100ms";
/// The longest an answer may take: the store timeout plus room for a busy 2-core test machine.
const PROMPT: Duration = Duration::from_millis(100 + 400);
/// How soon after Redis is back every request must be decided again.
const RECOVERY: Duration = Duration::from_secs(2);
const CALLERS: usize = 8;
/// Decided answers the callers have had before Redis fails: the load is under way.
const WARM: usize = 50;
/// Each caller's pace: requests keep arriving while script calls are in flight, yet the machine
/// is not saturated.
const PACE: Duration = Duration::from_millis(5);
const PREFIX: &str = "faults:";
/// A limit no test reaches, in an hour window: every decided answer is OK, and counts.
const RULES: &str = "domain: faults\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";

fn ask() -> RateLimitRequest {
    request("faults", &[&[("k", "v")]])
}

#[derive(Clone, Copy, Debug)]
enum Policy {
    Error,
    Allow,
    Deny,
}

impl Policy {
    fn flag(self) -> &'static str {
        match self {
            Policy::Error => "error",
            Policy::Allow => "allow",
            Policy::Deny => "deny",
        }
    }
}

/// What an answer was.
#[derive(Debug, PartialEq)]
enum Kind {
    /// Redis decided: OK, with the limit in the status.
    Decided,
    /// The `--on-store-error` answer.
    Policy,
    /// Anything else: always a failure.
    Unexpected(String),
}

fn classify(
    policy: Policy,
    answer: Result<Result<RateLimitResponse, tonic::Status>, tokio::time::error::Elapsed>,
) -> Kind {
    let unexpected = |what: String| Kind::Unexpected(format!("under {policy:?}: {what}"));
    let r = match answer {
        Err(_) => return unexpected("no answer within 5 s".into()),
        Ok(Err(s)) if matches!(policy, Policy::Error) && s.code() == tonic::Code::Unavailable => {
            return Kind::Policy;
        }
        Ok(Err(s)) => return unexpected(format!("{s:?}")),
        Ok(Ok(r)) => r,
    };
    let status = &r.statuses[0];
    let limited = status.current_limit.is_some();
    let one_second = status
        .duration_until_reset
        .is_some_and(|d| (d.seconds, d.nanos) == (1, 0));
    match (policy, r.overall_code) {
        (_, OK) if limited => Kind::Decided,
        (Policy::Allow, OK) => Kind::Policy,
        (Policy::Deny, OVER_LIMIT) if limited && status.limit_remaining == 0 && one_second => {
            Kind::Policy
        }
        _ => unexpected(format!("{r:?}")),
    }
}

/// One answer, as its caller saw it.
struct Answer {
    sent: Instant,
    received: Instant,
    kind: Kind,
}

/// Asks once, timing the answer.
async fn ask_once(client: &mut RateLimitServiceClient<Channel>, policy: Policy) -> Answer {
    let sent = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(ask()))
        .await
        .map(|r| r.map(tonic::Response::into_inner));
    Answer {
        sent,
        received: Instant::now(),
        kind: classify(policy, answer),
    }
}

/// `CALLERS` callers, each on a connection of its own, asking every `PACE` until stopped.
struct Load {
    callers: Vec<JoinHandle<Vec<Answer>>>,
    /// How many of their answers were decided so far.
    decided: Arc<AtomicUsize>,
    stopped: Arc<AtomicBool>,
}

impl Load {
    async fn start(sluice: &Sluice, policy: Policy) -> Load {
        let decided = Arc::new(AtomicUsize::new(0));
        let stopped = Arc::new(AtomicBool::new(false));
        let mut callers = Vec::with_capacity(CALLERS);
        for _ in 0..CALLERS {
            let mut client = sluice.client().await;
            let (decided, stopped) = (decided.clone(), stopped.clone());
            callers.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stopped.load(Ordering::Relaxed) {
                    let answer = ask_once(&mut client, policy).await;
                    if answer.kind == Kind::Decided {
                        decided.fetch_add(1, Ordering::Relaxed);
                    }
                    let next = answer.sent + PACE;
                    answers.push(answer);
                    tokio::time::sleep_until(next.into()).await;
                }
                answers
            }));
        }
        Load {
            callers,
            decided,
            stopped,
        }
    }

    /// Waits, at most 10 s, until `WARM` of their answers are decided: the load is under way.
    async fn under_way(&self) {
        support::eventually(
            "the callers are decided",
            Duration::from_secs(10),
            async || self.decided.load(Ordering::Relaxed) >= WARM,
        )
        .await;
    }

    /// Lets them ask until `at`, then stops them: their answers.
    async fn until(self, at: Instant) -> Vec<Answer> {
        tokio::time::sleep_until(at.into()).await;
        self.stopped.store(true, Ordering::Relaxed);
        gather(self.callers).await
    }
}

/// Every answer arrived in time and is a decided or a policy answer.
fn all_prompt_and_expected(answers: &[Answer]) {
    for a in answers {
        if let Kind::Unexpected(what) = &a.kind {
            panic!("unexpected answer: {what}");
        }
        let took = a.received - a.sent;
        assert!(
            took <= PROMPT,
            "an answer took {took:?}, more than {PROMPT:?}"
        );
    }
}

/// The answers to requests sent and answered within `span` are all `kind`; there are some.
fn all_between(answers: &[Answer], span: Range<Instant>, kind: Kind, when: &str) {
    let between: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent >= span.start && a.received <= span.end)
        .collect();
    assert!(!between.is_empty(), "no request was answered {when}");
    let other = between.iter().filter(|a| a.kind != kind).count();
    assert_eq!(
        other,
        0,
        "{other} of {} answers {when} were not {kind:?}",
        between.len()
    );
}

fn decided_received_after(answers: &[Answer], after: Instant) -> usize {
    answers
        .iter()
        .filter(|a| a.kind == Kind::Decided && a.received >= after)
        .count()
}

/// The count of the test's one counter (0 when it does not exist).
/// The counter once it holds `expected`, or after 10 s: refunds reach Redis after their answers.
async fn counter_settled(redis: &Controlled, expected: usize) -> usize {
    support::settled(
        Duration::from_secs(10),
        || counter(redis),
        |n| *n == expected,
    )
    .await
}

fn counter(redis: &Controlled) -> usize {
    let pattern = format!("{PREFIX}*");
    let keys = redis.cli(&["--scan", "--pattern", &pattern]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(keys.len() <= 1, "one counter, found {keys:?}");
    // A fixed window: a hash field per window, holding its count.
    keys.first().map_or(0, |key| {
        let counts = redis.cli(&["HVALS", key]);
        counts
            .split_whitespace()
            .map(|c| c.parse::<usize>().expect("the counter holds counts"))
            .sum()
    })
}

async fn sluice_on(redis: &Controlled, policy: Policy) -> Sluice {
    sluice_with(redis, policy, &[]).await
}

async fn sluice_with(redis: &Controlled, policy: Policy, extra: &[&str]) -> Sluice {
    let mut flags = flags(redis, policy);
    flags.extend(extra);
    Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &flags).await
}

fn flags(redis: &Controlled, policy: Policy) -> Vec<&str> {
    vec![
        "--redis-url",
        redis.url.as_str(),
        "--redis-key-prefix",
        PREFIX,
        "--store-timeout",
        STORE_TIMEOUT,
        "--on-store-error",
        policy.flag(),
    ]
}

/// Redis paused for 2 s under load, then resumed: the policy answers while it is paused; Redis
/// decides again within `RECOVERY`; once the script calls it ran for callers already answered are
/// refunded, the counter equals the decided OK answers.
async fn paused(policy: Policy) {
    paused_with(policy, &[]).await
}

/// The same, every hit counted `always` (charged whatever the answer): a charge nobody was
/// answered for is taken back all the same.
async fn paused_counting_always(policy: Policy) {
    paused_with(policy, &["--counting", "always"]).await
}

async fn paused_with(policy: Policy, extra: &[&str]) {
    let redis = Controlled::started();
    let sluice = sluice_with(&redis, policy, extra).await;
    let start = Instant::now();
    let load = Load::start(&sluice, policy).await;
    load.under_way().await;
    let pausing_at = Instant::now();
    redis.pause();
    let paused_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resumed_at = Instant::now();
    redis.resume();
    let answers = load
        .until(resumed_at + RECOVERY + Duration::from_secs(1))
        .await;

    all_prompt_and_expected(&answers);
    all_between(
        &answers,
        start..pausing_at,
        Kind::Decided,
        "before the pause",
    );
    all_between(
        &answers,
        paused_at..resumed_at,
        Kind::Policy,
        "during the pause",
    );
    all_between(
        &answers,
        resumed_at + RECOVERY..Instant::now(),
        Kind::Decided,
        "from 2 s after the resume",
    );
    // Refunds of the calls Redis ran after it resumed go out as their answers arrive.
    let decided = decided_received_after(&answers, start);
    assert_eq!(
        counter_settled(&redis, decided).await,
        decided,
        "the counter holds exactly the decided OK answers: no phantom charge"
    );
}

/// Redis killed under load and restarted empty on its port 1 s later: the policy answers while it
/// is down; Redis decides again within `RECOVERY` of the restart, and the new counter holds
/// exactly the decided OK answers received since.
async fn killed(policy: Policy) {
    let mut redis = Controlled::started();
    let sluice = sluice_on(&redis, policy).await;
    let start = Instant::now();
    let load = Load::start(&sluice, policy).await;
    load.under_way().await;
    // Blocking calls such as these hold only the test's own thread, not the callers' workers.
    let killing_at = Instant::now();
    redis.kill();
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        healthcheck(&sluice),
        (200, "OK".to_owned()),
        "envoyproxy/ratelimit's health stays OK through an outage once Redis was reached"
    );
    let restarted_at = Instant::now();
    redis.start();
    let back_at = Instant::now();
    let answers = load
        .until(back_at + RECOVERY + Duration::from_secs(1))
        .await;

    all_prompt_and_expected(&answers);
    all_between(
        &answers,
        start..killing_at,
        Kind::Decided,
        "before the kill",
    );
    all_between(
        &answers,
        killed_at..restarted_at,
        Kind::Policy,
        "while down",
    );
    all_between(
        &answers,
        back_at + RECOVERY..Instant::now(),
        Kind::Decided,
        "from 2 s after the restart",
    );
    let decided = decided_received_after(&answers, restarted_at);
    assert_eq!(
        counter_settled(&redis, decided).await,
        decided,
        "the new counter holds exactly the decided OK answers since the restart"
    );
}

async fn health(sluice: &Sluice, service: &str) -> i32 {
    HealthClient::new(sluice.channel().await)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("gRPC health answers")
        .into_inner()
        .status
}

async fn serving(sluice: &Sluice) -> bool {
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        if health(sluice, service).await != ServingStatus::Serving as i32 {
            return false;
        }
    }
    true
}

/// envoyproxy/ratelimit's health endpoint: its status and body.
fn healthcheck(sluice: &Sluice) -> (u16, String) {
    let (status, _, body) = http(sluice.http, "GET", "/healthcheck", "");
    (status, body)
}

fn ready(sluice: &Sluice) -> bool {
    http(sluice.http, "GET", "/readyz", "").0 == 200
}

/// Sluice started before Redis: live but not ready; its gRPC connections accepted 2 s after the
/// start, and every request then answered at once by the policy; once Redis starts, ready within
/// a few seconds and deciding, having counted nothing before.
async fn redis_starts_late(policy: Policy) {
    let mut redis = Controlled::unstarted();
    let files = [("rules.yaml", RULES)];
    let sluice = Sluice::spawn(&files, &flags(&redis, policy), None, Wait::Live).await;
    assert_eq!(http(sluice.http, "GET", "/healthz", "").0, 200);
    assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 503);
    assert_eq!(
        healthcheck(&sluice),
        (500, String::new()),
        "envoyproxy/ratelimit's health fails until Redis is first reached"
    );
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        assert_eq!(
            health(&sluice, service).await,
            ServingStatus::NotServing as i32,
            "gRPC health of {service:?}"
        );
    }
    let mut client = sluice.client().await;
    let mut before = Vec::new();
    for _ in 0..20 {
        before.push(ask_once(&mut client, policy).await);
    }
    all_prompt_and_expected(&before);
    assert!(
        before.iter().all(|a| a.kind == Kind::Policy),
        "without Redis every answer is the policy's"
    );

    redis.start();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(ready(&sluice) && serving(&sluice).await) {
        assert!(
            Instant::now() < deadline,
            "not ready 5 s after Redis started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(healthcheck(&sluice), (200, "OK".to_owned()));
    let mut after = Vec::new();
    for _ in 0..20 {
        after.push(ask_once(&mut client, policy).await);
    }
    all_prompt_and_expected(&after);
    assert!(
        after.iter().all(|a| a.kind == Kind::Decided),
        "once ready, every request is decided"
    );
    assert_eq!(counter(&redis), 20, "only the decided requests counted");
}

/// Started with Redis up, sluice accepts gRPC connections once it has reached Redis: a client
/// that connects and asks as soon as the port lets it, at each of 50 starts in a row, is always
/// decided, never answered by the policy (the connection waits in the listener's backlog
/// meanwhile).
#[tokio::test(flavor = "multi_thread")]
async fn a_request_sent_as_soon_as_sluice_starts_is_decided_not_answered_by_policy() {
    let redis = Controlled::started();
    let mut sluice = sluice_on(&redis, Policy::Deny).await;
    for start in 1..=50 {
        sluice.kill();
        sluice.relaunch();
        let launched = Instant::now();
        let channel = loop {
            let endpoint = Channel::from_shared(format!("http://{}", sluice.grpc)).unwrap();
            match endpoint.connect().await {
                Ok(channel) => break channel,
                Err(_) if launched.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(e) => panic!("start {start}: the gRPC port never accepted: {e}"),
            }
        };
        let answer = ask_once(&mut RateLimitServiceClient::new(channel), Policy::Deny).await;
        assert!(
            matches!(answer.kind, Kind::Decided),
            "start {start}: the first request, sent {:?} after the launch, was not decided: {:?}; \
             the log:\n{}",
            answer.sent - launched,
            answer.kind,
            sluice.log_text()
        );
    }
}

/// One test per scenario and policy, counting in one hour window: a new window drops the last
/// from the counter's hash.
macro_rules! cases {
    ($($name:ident => $scenario:ident($policy:ident)),* $(,)?) => {
        $(#[tokio::test(flavor = "multi_thread")]
        async fn $name() {
            let _alone = ONE_AT_A_TIME.lock().await;
            in_one_window(HOUR, async || $scenario(Policy::$policy).await).await
        })*
    };
}

cases! {
    a_paused_redis_gets_the_error_answer_then_decides_again_without_phantom_charges
        => paused(Error),
    a_paused_redis_gets_the_allow_answer_then_decides_again_without_phantom_charges
        => paused(Allow),
    a_paused_redis_gets_the_deny_answer_then_decides_again_without_phantom_charges
        => paused(Deny),
    a_paused_redis_leaves_no_phantom_charge_counted_always
        => paused_counting_always(Error),
    a_killed_redis_gets_the_error_answer_until_restarted_then_counts_only_decided_requests
        => killed(Error),
    a_killed_redis_gets_the_allow_answer_until_restarted_then_counts_only_decided_requests
        => killed(Allow),
    a_killed_redis_gets_the_deny_answer_until_restarted_then_counts_only_decided_requests
        => killed(Deny),
    started_before_redis_sluice_is_not_ready_and_gives_the_error_answer_then_decides_once_ready
        => redis_starts_late(Error),
    started_before_redis_sluice_is_not_ready_and_gives_the_allow_answer_then_decides_once_ready
        => redis_starts_late(Allow),
    started_before_redis_sluice_is_not_ready_and_gives_the_deny_answer_then_decides_once_ready
        => redis_starts_late(Deny),
}

/// A Redis that requires a password, reached without one, with a wrong one, over TLS (it speaks
/// none), and a port where nothing listens (named, with the refusal in words): within a second
/// and for as long as it lasts, `/readyz` names the cause, the log says it, and
/// `sluice_store_unreachable_total` counts it by kind.
#[tokio::test(flavor = "multi_thread")]
async fn why_redis_cannot_be_reached_is_said_and_counted() {
    let redis = Controlled::started_with(&["--requirepass", "right"]);
    let nothing = Controlled::unstarted();
    let refused = format!("127.0.0.1:{}: connection refused", nothing.port);
    for (url, kind, said) in [
        (redis.url.clone(), "auth", "NOAUTH"),
        (
            format!("redis://:wrong@127.0.0.1:{}", redis.port),
            "auth",
            "WRONGPASS",
        ),
        (nothing.url.clone(), "refused", refused.as_str()),
        (format!("rediss://127.0.0.1:{}", redis.port), "tls", "TLS"),
    ] {
        let flags = [
            "--redis-url",
            url.as_str(),
            "--store-timeout",
            STORE_TIMEOUT,
        ];
        let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, Wait::Live).await;
        let live = Instant::now();
        let body = loop {
            let (status, _, body) = http(sluice.http, "GET", "/readyz", "");
            assert_eq!(status, 503, "not ready while Redis cannot be reached");
            if body.contains(said) || live.elapsed() > Duration::from_secs(10) {
                break body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            body.contains(&format!("the counter store is unreachable ({kind}: "))
                && body.contains(said),
            "{url}: /readyz says {body:?}"
        );
        assert!(
            live.elapsed() < Duration::from_secs(1),
            "{url}: /readyz named the cause {:?} after sluice was live, not within a second",
            live.elapsed()
        );
        let counted = support::metrics::scrape(sluice.http)
            .get("sluice_store_unreachable_total", &[("kind", kind)])
            .unwrap_or(0.0);
        assert!(counted >= 1.0, "{url}: {kind} counted {counted} times");
        let log = support::settled(
            Duration::from_secs(3),
            || sluice.log_text(),
            |log| log.contains(said),
        )
        .await;
        assert!(log.contains(said), "{url}: the log says why");
    }
}
