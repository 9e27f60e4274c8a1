//! The Rate Limit Quota Service spoken to directly, as Envoy 1.40 speaks it: every report of a
//! bucket is answered at once, in the only shapes Envoy 1.40 enforces (a token bucket with an
//! explicit `tokens_per_fill` and a whole-second `fill_interval`, a whole-second time to live);
//! the first report of a bucket subscribes the stream; a bucket's global limit is divided among
//! the streams reporting it, on one replica or several sharing Redis; idle buckets are abandoned.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};

use support::metrics::scrape;
use support::quota::{Flood, PATIENCE, QuotaStream, blanket, bucket, only, share, tokens};
use support::redis::Controlled;
use support::{Sluice, Store, request};

const DOMAIN: &str = "quota";

const RULES: &str = "
domain: quota
quota_buckets:
  - bucket: {name: per-tenant, tenant: '*'}
    rate_limit: {unit: second, requests_per_unit: 20}
  - bucket: {name: per-minute}
    rate_limit: {unit: minute, requests_per_unit: 600}
  - bucket: {name: open}
    rate_limit: {unlimited: true}
  - bucket: {name: closed}
    rate_limit: {unit: second, requests_per_unit: 0}
  - bucket: {name: shadow}
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 5}
";

fn tenant(name: &str) -> BucketId {
    bucket(&[("name", "per-tenant"), ("tenant", name)])
}

async fn first_report_is_a_subscription_answered_at_once_with_an_enforceable_bucket(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let acme = tenant("acme");
    let answer = envoy.ask(&acme, 1, 0).await;
    assert_eq!(
        tokens(&answer, 1),
        20,
        "alone, the stream gets the whole limit"
    );
    let minute = bucket(&[("name", "per-minute")]);
    assert_eq!(tokens(&envoy.ask(&minute, 1, 0).await, 60), 600);
    // Every later report is answered again: Envoy lets an assignment expire otherwise.
    assert_eq!(tokens(&envoy.ask(&acme, 3, 0).await, 1), 20);
}

async fn two_streams_share_the_limit_and_the_first_is_told_at_once(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let acme = tenant("acme");
    let mut first = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&first.ask(&acme, 1, 0).await, 1), 20);
    let mut second = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(
        tokens(&second.ask(&acme, 1, 0).await, 1),
        10,
        "a new subscriber counts as wanting all of it: an equal part"
    );
    let pushed = first.answer().await;
    assert_eq!(
        tokens(&only(&pushed, &acme), 1),
        10,
        "the first stream's share shrinks without waiting for its report"
    );
    let other = tenant("globex");
    assert_eq!(
        tokens(&second.ask(&other, 1, 0).await, 1),
        20,
        "another tenant is another bucket"
    );
}

async fn an_idle_streams_share_goes_to_the_busy_one(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let acme = tenant("acme");
    let mut idle = QuotaStream::open(&sluice, DOMAIN).await;
    let mut busy = QuotaStream::open(&sluice, DOMAIN).await;
    idle.ask(&acme, 1, 0).await;
    busy.ask(&acme, 1, 0).await;
    idle.answer().await;
    assert_eq!(
        tokens(&idle.ask(&acme, 0, 0).await, 1),
        1,
        "an idle stream keeps one request a second"
    );
    assert_eq!(
        tokens(&only(&busy.answer().await, &acme), 1),
        19,
        "pushed to the busy stream at once"
    );
    assert_eq!(tokens(&busy.ask(&acme, 50, 100).await, 1), 19);
}

async fn a_stream_that_ends_leaves_its_share_to_the_others(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let acme = tenant("acme");
    let mut stays = QuotaStream::open(&sluice, DOMAIN).await;
    stays.ask(&acme, 1, 0).await;
    let mut goes = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&goes.ask(&acme, 1, 0).await, 1), 10);
    stays.answer().await;
    drop(goes);
    // The stream's end reaches sluice asynchronously: ask until it has.
    let mut share = 0;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        share = tokens(&stays.ask(&acme, 100, 100).await, 1);
        if share == 20 {
            break;
        }
    }
    assert_eq!(share, 20, "the whole limit, once the other stream has gone");
}

async fn blanket_rules_for_unlimited_closed_unmatched_and_shadow_buckets(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let open = bucket(&[("name", "open")]);
    assert_eq!(
        blanket(&envoy.ask(&open, 1, 0).await),
        BlanketRule::AllowAll
    );
    let closed = bucket(&[("name", "closed")]);
    assert_eq!(
        blanket(&envoy.ask(&closed, 1, 0).await),
        BlanketRule::DenyAll
    );
    let unknown = bucket(&[("name", "unknown")]);
    assert_eq!(
        blanket(&envoy.ask(&unknown, 1, 0).await),
        BlanketRule::AllowAll,
        "--quota-unmatched allow, the default"
    );
    let shadow = bucket(&[("name", "shadow")]);
    assert_eq!(
        blanket(&envoy.ask(&shadow, 1, 0).await),
        BlanketRule::AllowAll
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        blanket(&envoy.ask(&shadow, 100, 0).await),
        BlanketRule::AllowAll,
        "shadow mode never denies"
    );
    let labels = [("domain", DOMAIN), ("rule", "name_shadow")];
    let would_deny = scrape(sluice.http).value("sluice_quota_shadow_denied_total", &labels);
    assert!(
        (80.0..=96.0).contains(&would_deny),
        "100 requests over about a second at 5 a second: about 90 would have been denied, not {would_deny}"
    );
}

on_every_store!(
    first_report_is_a_subscription_answered_at_once_with_an_enforceable_bucket,
    two_streams_share_the_limit_and_the_first_is_told_at_once,
    an_idle_streams_share_goes_to_the_busy_one,
    a_stream_that_ends_leaves_its_share_to_the_others,
    blanket_rules_for_unlimited_closed_unmatched_and_shadow_buckets,
);

#[tokio::test(flavor = "multi_thread")]
async fn unmatched_buckets_can_be_denied() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-unmatched", "deny"]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let unknown = bucket(&[("name", "unknown")]);
    assert_eq!(
        blanket(&envoy.ask(&unknown, 1, 0).await),
        BlanketRule::DenyAll
    );
    let other_domain = RateLimitQuotaUsageReports {
        domain: "elsewhere".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(tenant("acme")),
            time_elapsed: None,
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    };
    envoy.reports.send(other_domain).await.unwrap();
    assert_eq!(
        blanket(&only(&envoy.answer().await, &tenant("acme"))),
        BlanketRule::DenyAll,
        "a domain without rules is unmatched too"
    );
    let scrape = scrape(sluice.http);
    let unknown = [("domain", "(unknown)"), ("rule", "(none)")];
    assert_eq!(
        scrape.value("sluice_quota_reported_allowed_total", &unknown),
        1.0,
        "a domain no rule file declares is not named in metrics"
    );
    assert!(
        scrape
            .get(
                "sluice_quota_reported_allowed_total",
                &[("domain", "elsewhere"), ("rule", "(none)")]
            )
            .is_none()
    );
}

/// A report naming a domain over 1024 bytes, the bound of a rate limit request's domain, ends its
/// stream with `INVALID_ARGUMENT` naming the bound; a stream with an ordinary domain is answered.
#[tokio::test(flavor = "multi_thread")]
async fn a_report_with_a_domain_over_1024_bytes_ends_its_stream_with_invalid_argument() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let mut hostile = QuotaStream::open(&sluice, &"d".repeat(1025)).await;
    hostile.report(&[(&tenant("acme"), 1, 0)]).await;
    let refused = hostile
        .answers
        .message()
        .await
        .expect_err("the stream ends with an error");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("1024"), "{}", refused.message());
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&envoy.ask(&tenant("acme"), 1, 0).await, 1), 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bucket_reported_idle_n_times_in_a_row_is_abandoned() {
    let sluice =
        Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-abandon-after", "2"]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let acme = tenant("acme");
    envoy.ask(&acme, 1, 0).await;
    envoy.ask(&acme, 0, 0).await;
    // Idle, its share shrinks to the least: pushed, then answered.
    while !envoy.quiet_for(Duration::from_millis(300)).await {}
    envoy.report(&[(&acme, 0, 0)]).await;
    let answer = envoy.answer().await;
    assert!(
        matches!(
            answer.bucket_action[0].bucket_action,
            Some(Action::AbandonAction(_))
        ),
        "{answer:?}"
    );
    assert_eq!(
        tokens(&envoy.ask(&acme, 1, 0).await, 1),
        20,
        "the bucket's next report subscribes again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_report_of_many_buckets_is_answered_in_one_message() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let ids: Vec<BucketId> = (0..50).map(|n| tenant(&format!("t{n}"))).collect();
    let reports: Vec<(&BucketId, u64, u64)> = ids.iter().map(|id| (id, 1, 0)).collect();
    envoy.report(&reports).await;
    let answer = envoy.answer().await;
    let answered: Vec<&BucketId> = answer
        .bucket_action
        .iter()
        .filter_map(|a| a.bucket_id.as_ref())
        .collect();
    assert_eq!(answered.len(), 50);
    assert!(ids.iter().all(|id| answered.contains(&id)));
    let scrape = scrape(sluice.http);
    let rule = [("domain", DOMAIN), ("rule", "name_per-tenant.tenant_*")];
    assert_eq!(scrape.value("sluice_quota_streams", &rule), 50.0);
    assert_eq!(scrape.value("sluice_quota_assigned_rate", &rule), 1000.0);
    assert_eq!(
        scrape.value("sluice_quota_reported_allowed_total", &rule),
        50.0
    );
    assert!(envoy.quiet_for(Duration::from_millis(300)).await);
}

/// The quota thread yields to the event loops that answer rate limit requests: it is SCHED_IDLE
/// (policy 5 in `/proc/PID/task/TID/stat`), so an event loop waking with a request takes the CPU
/// from it at once, while the event loops keep the normal policy.
#[tokio::test(flavor = "multi_thread")]
async fn the_quota_thread_runs_below_the_event_loops() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let policies: Vec<(String, String)> = std::fs::read_dir(format!("/proc/{}/task", sluice.pid()))
        .expect("the process's threads")
        .filter_map(|task| {
            let task = task.ok()?.path();
            let name = std::fs::read_to_string(task.join("comm")).ok()?;
            // `stat`'s fields after the name (in parentheses): the 41st, `policy`, is the 39th.
            let stat = std::fs::read_to_string(task.join("stat")).ok()?;
            let (_, fields) = stat.rsplit_once(')')?;
            let policy = fields.split_whitespace().nth(38)?.to_owned();
            Some((name.trim().to_owned(), policy))
        })
        .collect();
    let policy_of = |name: &str| {
        policies
            .iter()
            .filter(|(n, _)| n.starts_with(name))
            .map(|(_, p)| p.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(policy_of("sluice-quota"), ["5"], "threads: {policies:?}");
    let loops = policy_of("sluice-loop");
    assert!(
        !loops.is_empty() && loops.iter().all(|p| *p == "0"),
        "threads: {policies:?}"
    );
}

/// `--quota-addr` serves the quota service (and health) on a port of its own, where its streams
/// share the division with those on the gRPC port; `ShouldRateLimit` is not served there.
#[tokio::test(flavor = "multi_thread")]
async fn the_quota_service_has_a_port_of_its_own_when_asked() {
    let quota_addr = format!("127.0.0.1:{}", support::free_port());
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-addr", &quota_addr]).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{quota_addr}"))
        .expect("a URI")
        .connect()
        .await
        .expect("the quota port takes connections");
    let acme = tenant("acme");
    let mut apart = QuotaStream::open_on(channel.clone(), DOMAIN).await;
    assert_eq!(
        tokens(&apart.ask(&acme, 1, 0).await, 1),
        20,
        "alone, the whole limit"
    );
    let mut beside = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(
        tokens(&beside.ask(&acme, 1, 0).await, 1),
        10,
        "one limit, two streams"
    );
    assert_eq!(
        tokens(&only(&apart.answer().await, &acme), 1),
        10,
        "told at once"
    );

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health is served on the quota port")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let mut rls = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel);
    let refused = rls
        .should_rate_limit(request(DOMAIN, &[&[("k", "v")]]))
        .await
        .expect_err("ShouldRateLimit is not served on the quota port");
    assert_eq!(refused.code(), tonic::Code::Unimplemented);
}

/// `--quota-max-reports` paces the bucket reports a replica takes: a second's worth at once, then
/// the stream waits before it handles more of its report, and the rest is answered at that pace;
/// none is lost. 4,000 buckets at 1,000 a second: at most 1,500 (and the 256 being handled)
/// answered after half a second, all of them within 15 s.
#[tokio::test(flavor = "multi_thread")]
async fn bucket_reports_past_their_pace_wait_their_turn_and_none_is_lost() {
    let sluice = Sluice::on(
        Store::Memory,
        &[("quota.yaml", RULES)],
        &["--quota-max-reports", "1000"],
    )
    .await;
    let once = Some(Duration::from_secs(3600));
    let started = Instant::now();
    let flood = Flood::start(sluice.grpc, DOMAIN, (1, 4_000, 0), once).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let early = flood.answered();
    // A second's worth at once, then 1,000 a second, and the 256 being handled.
    let took = started.elapsed();
    let bound = 1_000 + (took.as_secs_f64() * 1_000.0) as u64 + 256;
    assert!(
        early <= bound,
        "{early} bucket reports answered within {took:?} at 1,000 a second, more than {bound}"
    );
    assert!(
        flood.wait_answered(4_000, Duration::from_secs(15)).await,
        "every bucket answered at that pace: {} of 4,000",
        flood.answered()
    );
}

/// `--quota-max-records` bounds the demand records a replica sends Redis: a second's worth at
/// once, and past what it can record once per report, each tracked bucket is recorded less
/// often, its record counted for three of those longer intervals (so it never lapses between
/// two), its share kept in between. Ten new buckets within one record a second: one recorded,
/// counted 30 s (ten buckets at one a second), and answered; the nine others are not answered
/// (granted nothing the store has not counted: their Envoy applies `no_assignment_behavior`)
/// until a record is left for them; and a report at once after records nothing, with the same
/// share. With the default budget, all ten, 30 s (no less than an assignment lives: the Envoys
/// of a replica that died enforce theirs that long), and a record per report.
#[tokio::test(flavor = "multi_thread")]
async fn demand_records_stay_within_their_budget_and_never_lapse_between_two() {
    let port = Store::Redis.redis().unwrap().ports[0];
    // Each demand key's fields and time to live, read in one call: quick enough on a loaded
    // machine that no second of the budget passes between the two reports it comes between.
    const READ: &str = "local out = {} \
        for _, key in ipairs(redis.call('KEYS', ARGV[1])) do \
            table.insert(out, key) \
            table.insert(out, table.concat(redis.call('HGETALL', key), ' ')) \
            table.insert(out, redis.call('PTTL', key)) \
        end return out";
    let records = |prefix: &str| -> std::collections::BTreeMap<String, (String, i64)> {
        let out = support::redis::cli(port, &["EVAL", READ, "0", &format!("{prefix}*")]);
        let lines: Vec<&str> = out.lines().collect();
        lines
            .chunks(3)
            .filter(|c| c.len() == 3)
            .map(|c| {
                (
                    c[0].to_owned(),
                    (c[1].to_owned(), c[2].trim().parse().unwrap()),
                )
            })
            .collect()
    };
    let ids: Vec<BucketId> = (0..10).map(|n| tenant(&format!("r{n}"))).collect();
    let reports: Vec<(&BucketId, u64, u64)> = ids.iter().map(|id| (id, 1, 0)).collect();
    for (budget, recorded, counted_ms, recorded_again) in
        [(Some("1"), 1, 30_000, false), (None, 10, 30_000, true)]
    {
        let prefix = format!("records-{}-{}:", std::process::id(), support::unix_ms());
        let mut flags = vec!["--redis-key-prefix", prefix.as_str()];
        flags.extend(
            budget
                .map(|b| ["--quota-max-records", b])
                .into_iter()
                .flatten(),
        );
        let sluice = Sluice::on(Store::Redis, &[("quota.yaml", RULES)], &flags).await;
        let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
        envoy.report(&reports).await;
        let first = envoy.answer().await;
        let before = records(&prefix);
        assert_eq!(before.len(), recorded, "records: {before:?}");
        for (fields, ttl) in before.values() {
            assert!(
                (counted_ms - 2_000..=counted_ms).contains(ttl),
                "counted {counted_ms} ms, found {ttl} ({fields})"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        envoy.report(&reports).await;
        let again = envoy.answer().await;
        assert_eq!(first.bucket_action.len(), recorded, "the recorded answered");
        assert_eq!(again.bucket_action.len(), recorded, "the recorded answered");
        // Each bucket's strategy, and the assignments' lives in seconds.
        let actions = |answer: &RateLimitQuotaResponse| {
            let mut shown = Vec::new();
            let mut lives = Vec::new();
            for a in &answer.bucket_action {
                let id = a.bucket_id.as_ref().expect("a bucket id");
                let id: std::collections::BTreeMap<_, _> = id.bucket.iter().collect();
                let Some(Action::QuotaAssignmentAction(assigned)) = &a.bucket_action else {
                    panic!("an assignment: {a:?}");
                };
                shown.push(format!("{id:?} {:?}", assigned.rate_limit_strategy));
                lives.push(assigned.assignment_time_to_live.map_or(0, |d| d.seconds));
            }
            shown.sort();
            (shown, lives)
        };
        let ((first, first_lives), (again, again_lives)) = (actions(&first), actions(&again));
        assert_eq!(first, again, "the shares kept");
        assert!(first_lives.iter().all(|&s| s == 30), "{first_lives:?}");
        // A bucket answered from its record, none due, lives no longer than the record is
        // counted (30 s from the first report): a replica that dies sends no more.
        let shortened: Vec<i64> = again_lives.iter().copied().filter(|&s| s != 30).collect();
        let recorded_only_before = if recorded_again { 0 } else { recorded };
        assert_eq!(shortened.len(), recorded_only_before, "{again_lives:?}");
        assert!(
            shortened.iter().all(|s| (28..30).contains(s)),
            "{again_lives:?}"
        );
        // The buckets recorded the first time (another may take a record the budget has
        // gained meanwhile).
        let after = records(&prefix);
        for (key, (fields, _)) in &before {
            assert_eq!(
                after.get(key).map(|(f, _)| f) != Some(fields),
                recorded_again,
                "{key} recorded again (budget {budget:?})"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn while_redis_is_down_buckets_keep_their_last_assignment() {
    let mut redis = Controlled::started();
    let url = redis.url.clone();
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &["--redis-url", &url]).await;
    let acme = tenant("acme");
    let mut first = QuotaStream::open(&sluice, DOMAIN).await;
    let mut second = QuotaStream::open(&sluice, DOMAIN).await;
    first.ask(&acme, 1, 0).await;
    assert_eq!(tokens(&second.ask(&acme, 1, 0).await, 1), 10);
    first.answer().await;
    redis.kill();
    support::eventually(
        "sluice finds Redis gone",
        Duration::from_secs(10),
        async || support::http(sluice.http, "GET", "/readyz", "").0 == 503,
    )
    .await;
    assert_eq!(
        tokens(&first.ask(&acme, 100, 100).await, 1),
        10,
        "the last assignment, not allow-all"
    );
    let new = tenant("new");
    first.report(&[(&new, 1, 0)]).await;
    assert!(
        first.quiet_for(Duration::from_secs(1)).await,
        "a bucket new while Redis is down is granted nothing the store has not counted: its \
         Envoy applies no_assignment_behavior"
    );
    let errors: f64 = scrape(sluice.http)
        .samples_of("sluice_quota_store_errors_total")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert!(errors >= 2.0, "{errors}");
    assert!(sluice.log_text().contains("keep their last assignments"));

    redis.start();
    let start = Instant::now();
    let granted = loop {
        first.report(&[(&new, 1, 0)]).await;
        if let Ok(Ok(Some(answer))) =
            tokio::time::timeout(Duration::from_millis(500), first.answers.message()).await
        {
            break tokens(&only(&answer, &new), 1);
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the new bucket is answered once Redis is back"
        );
    };
    assert_eq!(granted, 20, "alone in its bucket: the whole limit");
}

/// The quota service's messages with a bucket id's values as bytes, as Envoy may send them: it
/// copies request header values, which need not be UTF-8, into the `string` map.
mod raw {
    use std::collections::HashMap;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct BucketId {
        #[prost(map = "string, bytes", tag = "1")]
        pub bucket: HashMap<String, Vec<u8>>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Usage {
        #[prost(message, optional, tag = "1")]
        pub bucket_id: Option<BucketId>,
        #[prost(uint64, tag = "3")]
        pub allowed: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Reports {
        #[prost(string, tag = "1")]
        pub domain: String,
        #[prost(message, repeated, tag = "2")]
        pub usages: Vec<Usage>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Action {
        #[prost(message, optional, tag = "1")]
        pub bucket_id: Option<BucketId>,
        /// The assignment, left encoded.
        #[prost(bytes = "vec", optional, tag = "2")]
        pub assignment: Option<Vec<u8>>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Response {
        #[prost(message, repeated, tag = "1")]
        pub bucket_action: Vec<Action>,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bucket_values_of_any_bytes_and_length_are_answered_and_echoed_exactly() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let mut grpc = tonic::client::Grpc::new(sluice.channel().await);
    grpc.ready().await.expect("the channel is ready");
    let values: Vec<Vec<u8>> = vec![
        b"\xff\xfe".to_vec(),
        b"\xc3\x28".to_vec(),
        vec![b'x'; 200_000],
    ];
    let usages: Vec<raw::Usage> = values
        .iter()
        .map(|v| raw::Usage {
            bucket_id: Some(raw::BucketId {
                bucket: [
                    ("name".to_owned(), b"per-tenant".to_vec()),
                    ("tenant".to_owned(), v.clone()),
                ]
                .into(),
            }),
            allowed: 1,
        })
        .collect();
    let report = raw::Reports {
        domain: DOMAIN.into(),
        usages: usages.clone(),
    };
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    );
    let codec = tonic_prost::ProstCodec::<raw::Reports, raw::Response>::default();
    let mut answers = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter([report])),
            path,
            codec,
        )
        .await
        .expect("the quota stream opens")
        .into_inner();
    let answer = tokio::time::timeout(PATIENCE, answers.message())
        .await
        .expect("sluice answers in time")
        .expect("the stream stays up")
        .expect("an answer");
    let echoed: Vec<&raw::BucketId> = answer
        .bucket_action
        .iter()
        .filter_map(|a| a.bucket_id.as_ref())
        .collect();
    for usage in &usages {
        assert!(
            echoed.contains(&usage.bucket_id.as_ref().unwrap()),
            "echoed byte for byte"
        );
    }
    assert!(answer.bucket_action.iter().all(|a| a.assignment.is_some()));
    // The same assignment as any other tenant: 20 a second, shared by nobody else.
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&envoy.ask(&tenant("plain"), 1, 0).await, 1), 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_changes_the_next_assignment_and_config_shows_the_quota_rules() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let (status, _, body) = support::http(sluice.http, "GET", "/config", "");
    assert_eq!(status, 200);
    let config: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let rules = &config["domains"][0]["quota_buckets"];
    assert_eq!(rules[0]["rule"], "name_per-tenant.tenant_*");
    assert_eq!(rules[0]["bucket"]["tenant"], "*");
    assert_eq!(rules[0]["rate_limit"]["requests_per_unit"], 20);
    assert_eq!(rules[0]["line"], 4);
    assert_eq!(rules[4]["shadow_mode"], true);

    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    let acme = tenant("acme");
    assert_eq!(tokens(&envoy.ask(&acme, 1, 0).await, 1), 20);
    std::fs::write(
        sluice.rules.join("quota.yaml"),
        RULES.replace("requests_per_unit: 20", "requests_per_unit: 40"),
    )
    .unwrap();
    let mut share = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        share = tokens(&envoy.ask(&acme, 10, 0).await, 1);
        if share == 40 {
            break;
        }
    }
    assert_eq!(share, 40, "the reloaded limit, on the bucket's next report");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_open_quota_streams_and_sluice_exits_promptly() {
    let mut sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let mut envoy = QuotaStream::open(&sluice, DOMAIN).await;
    envoy.ask(&tenant("acme"), 1, 0).await;
    support::redis::signal(sluice.pid(), "TERM");
    let ended = tokio::time::timeout(PATIENCE, envoy.answers.message())
        .await
        .expect("the stream ends in time");
    assert!(
        matches!(ended, Ok(None)),
        "ended cleanly, for Envoy to reconnect elsewhere: {ended:?}"
    );
    let status = sluice.exited_within(Duration::from_secs(5)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn three_streams_get_a_third_each_in_whole_numbers_envoy_reads() {
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &[]).await;
    let acme = tenant("acme");
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut stream = QuotaStream::open(&sluice, DOMAIN).await;
        stream.ask(&acme, 1, 0).await;
        streams.push(stream);
    }
    // The first two have been pushed their new shares: two, then one.
    let mut latest = Vec::new();
    for (n, stream) in streams.iter_mut().enumerate() {
        let mut last = None;
        for _ in 0..(2 - n) {
            last = Some(only(&stream.answer().await, &acme));
        }
        latest.push(last);
    }
    let mut total = 0.0;
    for (n, stream) in streams.iter_mut().enumerate() {
        let strategy = match latest[n].take() {
            Some(s) => s,
            None => stream.ask(&acme, 5, 5).await,
        };
        let r = share(&strategy, 1);
        assert!(
            (6.666..=6.667).contains(&r),
            "a third of 20 a second, to the thousandth, not {r}"
        );
        total += r;
    }
    assert!(
        (total - 20.0).abs() < 1e-9,
        "the thirds add up to 20: {total}"
    );
}

/// A quota metric that carries no labels, read from `/metrics`.
fn gauge(sluice: &Sluice, name: &str) -> f64 {
    scrape(sluice.http).value(name, &[])
}

/// Waits, for at most 10 s, until the gauge `name` reads `value`.
async fn gauge_reaches(sluice: &Sluice, name: &str, value: f64) {
    for _ in 0..100 {
        if gauge(sluice, name) == value {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gauge(sluice, name), value, "{name}");
}

/// Every action of `answer` denies all (a blanket rule).
fn all_denied(answer: &RateLimitQuotaResponse) -> bool {
    answer.bucket_action.iter().all(|action| {
        let single = RateLimitQuotaResponse {
            bucket_action: vec![action.clone()],
        };
        let id = action.bucket_id.as_ref().expect("a bucket id");
        matches!(only(&single, id), Strategy::BlanketRule(rule) if rule == BlanketRule::DenyAll as i32)
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn buckets_past_the_process_wide_bound_are_denied_never_given_a_limit_others_share() {
    let mut sluice =
        Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-max-buckets", "100"]).await;
    let ids: Vec<BucketId> = (0..100).map(|n| tenant(&format!("t{n}"))).collect();
    let mut first = QuotaStream::open(&sluice, DOMAIN).await;
    first
        .report(&ids.iter().map(|id| (id, 1, 0)).collect::<Vec<_>>())
        .await;
    assert_eq!(first.answer().await.bucket_action.len(), 100);
    assert_eq!(gauge(&sluice, "sluice_quota_tracked_buckets"), 100.0);

    let mut second = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(
        blanket(&second.ask(&ids[0], 1, 0).await),
        BlanketRule::DenyAll,
        "past the bound, a bucket the first stream holds: denied, not the whole limit again"
    );
    assert!(
        first.quiet_for(Duration::from_millis(300)).await,
        "and the first stream keeps its share"
    );
    let more: Vec<BucketId> = (0..50).map(|n| tenant(&format!("u{n}"))).collect();
    second
        .report(&more.iter().map(|id| (id, 1, 0)).collect::<Vec<_>>())
        .await;
    let mut answered = 0;
    while answered < more.len() {
        let answer = second.answer().await;
        assert!(all_denied(&answer), "{answer:?}");
        answered += answer.bucket_action.len();
    }
    let metrics = scrape(sluice.http);
    assert_eq!(metrics.value("sluice_quota_tracked_buckets", &[]), 100.0);
    assert_eq!(
        metrics.value("sluice_quota_untracked_total", &[("bound", "buckets")]),
        51.0
    );

    drop(first);
    gauge_reaches(&sluice, "sluice_quota_tracked_buckets", 0.0).await;
    assert_eq!(
        tokens(&second.ask(&ids[0], 1, 0).await, 1),
        20,
        "once the first stream has left, the bucket is tracked: alone, the whole limit"
    );
    let mut third = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(
        tokens(&third.ask(&ids[0], 1, 0).await, 1),
        10,
        "and divided"
    );
    assert_eq!(tokens(&only(&second.answer().await, &ids[0]), 1), 10);
    assert!(sluice.alive());
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_past_the_process_wide_bound_are_denied_and_the_others_keep_their_shares() {
    let mut sluice =
        Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-max-streams", "2"]).await;
    let acme = tenant("acme");
    let mut first = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&first.ask(&acme, 1, 0).await, 1), 20);
    let mut second = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(tokens(&second.ask(&acme, 1, 0).await, 1), 10);
    assert_eq!(tokens(&only(&first.answer().await, &acme), 1), 10);

    let mut third = QuotaStream::open(&sluice, DOMAIN).await;
    assert_eq!(
        blanket(&third.ask(&acme, 1, 0).await),
        BlanketRule::DenyAll,
        "a stream past the bound: denied (it was given the whole limit, 40 in all)"
    );
    assert!(first.quiet_for(Duration::from_millis(300)).await);
    assert!(
        second.quiet_for(Duration::from_millis(300)).await,
        "the others keep their shares"
    );
    let metrics = scrape(sluice.http);
    assert_eq!(metrics.value("sluice_quota_tracked_streams", &[]), 2.0);
    assert_eq!(
        metrics.value("sluice_quota_untracked_total", &[("bound", "streams")]),
        1.0
    );

    drop(second);
    gauge_reaches(&sluice, "sluice_quota_tracked_streams", 1.0).await;
    assert_eq!(
        tokens(&third.ask(&acme, 1, 0).await, 1),
        10,
        "counted once another stream has left: divided"
    );
    assert!(sluice.alive());
}

/// A stream opened from the loopback address `from`, as a client of its own.
async fn stream_from(sluice: &Sluice, from: &str) -> QuotaStream {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", sluice.grpc))
        .expect("an endpoint")
        .local_address(Some(from.parse().expect("an address")))
        .connect()
        .await
        .expect("a connection from another loopback address");
    QuotaStream::open_on(channel, DOMAIN).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_makes_up_buckets_uses_its_own_budget_up_not_the_others() {
    let mut sluice = Sluice::start_with(
        &[("quota.yaml", RULES)],
        &[
            "--quota-max-buckets",
            "150",
            "--quota-max-buckets-per-client",
            "100",
            "--quota-max-streams",
            "10",
            "--quota-max-streams-per-client",
            "3",
        ],
    )
    .await;
    let made_up: Vec<BucketId> = (0..200).map(|n| tenant(&format!("m{n}"))).collect();
    let mut hostile = stream_from(&sluice, "127.0.0.2").await;
    hostile
        .report(&made_up.iter().map(|id| (id, 1, 0)).collect::<Vec<_>>())
        .await;
    let mut denied = 0;
    let mut answered = 0;
    while answered < made_up.len() {
        let answer = hostile.answer().await;
        for action in &answer.bucket_action {
            let single = RateLimitQuotaResponse {
                bucket_action: vec![action.clone()],
            };
            let id = action.bucket_id.as_ref().expect("a bucket id");
            if all_denied(&single) {
                denied += 1;
            } else {
                assert_eq!(tokens(&only(&single, id), 1), 20);
            }
        }
        answered += answer.bucket_action.len();
    }
    assert_eq!(denied, 100, "past its budget of 100 buckets, denied");
    let mut more = Vec::new();
    for _ in 0..3 {
        more.push(stream_from(&sluice, "127.0.0.2").await);
    }
    for stream in &mut more[..2] {
        assert_eq!(
            blanket(&stream.ask(&tenant("x"), 1, 0).await),
            BlanketRule::DenyAll,
            "its second and third streams are counted, and its bucket budget is used up"
        );
    }
    assert_eq!(
        blanket(&more[2].ask(&tenant("x"), 1, 0).await),
        BlanketRule::DenyAll,
        "its fourth stream, past its 3"
    );

    let acme = tenant("acme");
    let mut envoy = stream_from(&sluice, "127.0.0.3").await;
    assert_eq!(
        tokens(&envoy.ask(&acme, 1, 0).await, 1),
        20,
        "another client is tracked"
    );
    let mut other = stream_from(&sluice, "127.0.0.4").await;
    assert_eq!(tokens(&other.ask(&acme, 1, 0).await, 1), 10, "and divided");
    assert_eq!(tokens(&only(&envoy.answer().await, &acme), 1), 10);
    let metrics = scrape(sluice.http);
    assert_eq!(
        metrics.value(
            "sluice_quota_untracked_total",
            &[("bound", "client_buckets")]
        ),
        102.0
    );
    assert_eq!(
        metrics.value(
            "sluice_quota_untracked_total",
            &[("bound", "client_streams")]
        ),
        1.0
    );
    assert!(sluice.alive());
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limit_answers_stay_prompt_while_many_streams_report_many_buckets() {
    const RLS_RULES: &str = "
domain: rls
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1000000}
";
    // One event loop, and reports of 5,000 buckets with 300-byte values (1.6 MB each): every
    // report is a lot of work, on a process that answers rate limit requests too.
    let mut sluice = Sluice::start_with(
        &[("quota.yaml", RULES), ("rls.yaml", RLS_RULES)],
        &[
            "--threads",
            "1",
            "--max-request-bytes",
            "4194304",
            "--quota-max-buckets",
            "5000",
        ],
    )
    .await;
    let (streams, buckets) = (10, 5_000);
    let round = (streams * buckets) as u64;
    // The Envoys the flood stands for run elsewhere: their decoding of the answers does not
    // hold up the runtime of the client that measures.
    let elsewhere = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let grpc = sluice.grpc;
    let flood = elsewhere
        .spawn(async move { Flood::start(grpc, DOMAIN, (streams, buckets, 300), None).await })
        .await
        .expect("the flood starts");
    assert!(
        flood.wait_answered(round, Duration::from_secs(60)).await,
        "every stream's first report answered"
    );
    let mut client = sluice.client().await;
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut n = 0;
    // Until every stream has had another report answered.
    while flood.answered() < 2 * round && tokio::time::Instant::now() < until {
        let asked = tokio::time::timeout(
            Duration::from_secs(1),
            client.should_rate_limit(request("rls", &[&[("k", "v")]])),
        )
        .await;
        assert!(
            matches!(&asked, Ok(Ok(answer)) if answer.get_ref().overall_code == support::OK),
            "request {n} answered OK within 1 s while the reports flood in: {asked:?}"
        );
        if n % 10 == 0 {
            let tracked = gauge(&sluice, "sluice_quota_tracked_buckets");
            assert!(tracked <= 5000.0, "{tracked} buckets tracked");
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        flood.answered() >= 2 * round,
        "the reports kept being answered: {} bucket actions",
        flood.answered()
    );
    assert_eq!(gauge(&sluice, "sluice_quota_tracked_buckets"), 5000.0);
    assert!(sluice.alive());
    drop(flood);
    elsewhere.shutdown_background();
}

/// The resident memory of process `pid`, in MB.
fn rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `sluice load` at a steady 1000 requests a second for 10 s against `sluice`: its p50 and p99
/// latency (µs) and its errors.
async fn rls_latency(sluice: &Sluice) -> (u64, u64, serde_json::Value) {
    let grpc = sluice.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "load",
                "--target",
                &grpc,
                "--domain",
                "rls",
                "--descriptor",
                "k=v",
            ])
            .args(["--rate", "1000", "--concurrency", "8", "--connections", "2"])
            .args(["--duration", "10s", "--json", "--quiet"])
            .output()
    })
    .await
    .expect("sluice load runs")
    .expect("sluice load starts");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("sluice load prints JSON");
    let latency = &report["latency_us"];
    let micros = |q: &str| latency[q].as_u64().unwrap_or(0);
    (micros("p50"), micros("p99"), report["errors"].clone())
}

/// The most resident memory of process `pid` seen, in MB, sampled every 100 ms until aborted.
fn sample_rss(
    pid: u32,
) -> (
    Arc<std::sync::atomic::AtomicU64>,
    tokio::task::JoinHandle<()>,
) {
    let most = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let most = most.clone();
        tokio::spawn(async move {
            loop {
                most.fetch_max(rss_mb(pid) as u64, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    (most, sampler)
}

/// Where the figures' flood goes: the port `ShouldRateLimit` is asked on, the quota service's own
/// `--quota-addr`, or another process on the same machine (what the flood's own load costs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flooded {
    GrpcPort,
    QuotaPort,
    OtherProcess,
}

/// The median of `values`.
fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values[values.len() / 2]
}

/// The figures of the quota flood: resident memory and `ShouldRateLimit` latency, idle and while
/// 100 streams report 10,000 buckets each, every 5 s as Envoy does or as fast as sluice takes
/// them, on the embedded store and on Redis, with the default bounds. Idle and flooded windows
/// of 10 s alternate five times (the medians are printed): the machine's other load moves a
/// single window's p99 more than the flood does. A measurement, not a specification: run it on
/// a release build, `cargo test --release --test redis -- --ignored --nocapture rlqs::figures`
/// (`FIGURES_STORE=memory` or `redis` for one store; `FIGURES_QUOTA=shared` floods the gRPC port
/// that `ShouldRateLimit` is asked on, `own` the quota service's own `--quota-addr`,
/// `elsewhere` another sluice on the same machine, and otherwise the first two; `FIGURES_FLAGS`
/// adds `serve` flags, such as `--quota-max-reports 1000000` to take the flood at another pace).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement, for a release build"]
async fn figures_of_100_streams_reporting_10000_buckets_each() {
    const RLS_RULES: &str = "
domain: rls
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1000000000}
";
    let (streams, buckets) = (100, 10_000);
    const ROUNDS: usize = 5;
    // The Envoys the flood stands for run on other hosts: its client's threads are SCHED_IDLE
    // (any other thread takes the CPU from them at once), so that its work is not charged to
    // sluice's.
    let lowest_priority = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(|| {
            let thread = std::fs::read_link("/proc/thread-self").expect("Linux");
            let tid = thread.file_name().expect("a thread id").to_string_lossy();
            let _ = std::process::Command::new("chrt")
                .args(["--idle", "-p", "0", &tid])
                .output();
        })
        .build()
        .expect("a runtime");
    let stores = match std::env::var("FIGURES_STORE").as_deref() {
        Ok("memory") => vec![Store::Memory],
        Ok("redis") => vec![Store::Redis],
        _ => vec![Store::Memory, Store::Redis],
    };
    let extra = std::env::var("FIGURES_FLAGS").unwrap_or_default();
    let targets = match std::env::var("FIGURES_QUOTA").as_deref() {
        Ok("shared") => vec![Flooded::GrpcPort],
        Ok("own") => vec![Flooded::QuotaPort],
        Ok("elsewhere") => vec![Flooded::OtherProcess],
        _ => vec![Flooded::GrpcPort, Flooded::QuotaPort],
    };
    for (store, target) in stores
        .into_iter()
        .flat_map(|store| targets.iter().map(move |&target| (store, target)))
    {
        let quota_addr = format!("127.0.0.1:{}", support::free_port());
        // A report of 10,000 buckets is about 500 kB.
        let mut flags = vec!["--store-timeout", "10ms", "--max-request-bytes", "1048576"];
        flags.extend(extra.split_whitespace());
        if target == Flooded::QuotaPort {
            flags.extend(["--quota-addr", quota_addr.as_str()]);
        }
        let files = [("quota.yaml", RULES), ("rls.yaml", RLS_RULES)];
        let sluice = Sluice::on(store, &files, &flags).await;
        let other = match target {
            Flooded::OtherProcess => Some(Sluice::on(store, &files, &flags).await),
            _ => None,
        };
        let quota_at = match (target, &other) {
            (Flooded::QuotaPort, _) => quota_addr.parse().expect("an address"),
            (_, Some(other)) => other.grpc,
            _ => sluice.grpc,
        };
        let store = format!("{store:?}, {target:?}");
        let flooded_http = other.as_ref().map_or(sluice.http, |other| other.http);
        let pid = sluice.pid();
        println!("{store}: RSS idle {:.0} MB", rss_mb(pid));
        for (mode, pace) in [
            ("every 5 s", Some(Duration::from_secs(5))),
            ("as fast as taken", None),
        ] {
            let (mut idle, mut flooded) = (Vec::new(), Vec::new());
            let (mut answered, mut tracked, mut untracked) = (Vec::new(), None, 0.0);
            let (most_rss, sampler) = sample_rss(pid);
            for _ in 0..ROUNDS {
                idle.push(rls_latency(&sluice).await);
                let flood = lowest_priority
                    .spawn(async move {
                        Flood::start(quota_at, DOMAIN, (streams, buckets, 0), pace).await
                    })
                    .await
                    .expect("the flood starts");
                flooded.push(rls_latency(&sluice).await);
                answered.push(flood.answered() / 10);
                let metrics = scrape(flooded_http);
                tracked = metrics.get("sluice_quota_tracked_buckets", &[]);
                untracked = metrics
                    .samples_of("sluice_quota_untracked_total")
                    .iter()
                    .map(|(_, v)| v)
                    .sum();
                drop(flood);
                // Until every stream has left (read from a series a build without the bounds
                // has too, so that it can be measured the same way).
                for _ in 0..100 {
                    let subscribed: f64 = scrape(flooded_http)
                        .samples_of("sluice_quota_streams")
                        .iter()
                        .map(|(_, v)| v)
                        .sum();
                    if subscribed == 0.0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            sampler.abort();
            let p = |runs: &[(u64, u64, serde_json::Value)],
                     q: fn(&(u64, u64, serde_json::Value)) -> u64| {
                median(runs.iter().map(q).collect())
            };
            println!(
                "{store}, flood {mode}: RSS at most {} MB; {} bucket reports answered a second (median), {tracked:?} tracked, {untracked} untracked in all; \
                 ShouldRateLimit at 1000/s, medians of {ROUNDS}: idle p50 {} µs p99 {} µs, flood p50 {} µs p99 {} µs; every p99 idle {:?} flood {:?}; errors idle {:?} flood {:?}",
                most_rss.load(std::sync::atomic::Ordering::Relaxed),
                median(answered),
                p(&idle, |r| r.0),
                p(&idle, |r| r.1),
                p(&flooded, |r| r.0),
                p(&flooded, |r| r.1),
                idle.iter().map(|r| r.1).collect::<Vec<_>>(),
                flooded.iter().map(|r| r.1).collect::<Vec<_>>(),
                idle.iter().map(|r| r.2.to_string()).collect::<Vec<_>>(),
                flooded.iter().map(|r| r.2.to_string()).collect::<Vec<_>>(),
            );
        }
    }
    lowest_priority.shutdown_background();
}
