//! The Rate Limit Quota Service spoken to directly, as Envoy 1.40 speaks it: every report of a
//! bucket is answered at once, in the only shapes Envoy 1.40 enforces (a token bucket with an
//! explicit `tokens_per_fill` and a whole-second `fill_interval`, a whole-second time to live);
//! the first report of a bucket subscribes the stream; a bucket's global limit is divided among
//! the streams reporting it, on one replica or several sharing Redis; idle buckets are abandoned.

mod common;

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use common::metrics::scrape;
use common::redis::Controlled;
use common::{Sluice, Store};

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

/// How long an answer may take to come.
const PATIENCE: Duration = Duration::from_secs(5);

/// One Envoy's stream, driven by hand.
struct QuotaStream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

impl QuotaStream {
    async fn open(sluice: &Sluice) -> QuotaStream {
        let mut client = RateLimitQuotaServiceClient::new(sluice.channel().await);
        let (reports, outgoing) = mpsc::channel(16);
        let answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(outgoing))
            .await
            .expect("the quota stream opens")
            .into_inner();
        QuotaStream { reports, answers }
    }

    /// Reports `allowed` and `denied` requests of each bucket, as Envoy does every 5 s.
    async fn report(&self, buckets: &[(&BucketId, u64, u64)]) {
        let usages = buckets
            .iter()
            .map(|(id, allowed, denied)| BucketQuotaUsage {
                bucket_id: Some((*id).clone()),
                time_elapsed: Some(ProtoDuration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: *allowed,
                num_requests_denied: *denied,
            })
            .collect();
        self.reports
            .send(RateLimitQuotaUsageReports {
                domain: DOMAIN.into(),
                bucket_quota_usages: usages,
            })
            .await
            .expect("the stream takes reports");
    }

    /// The next answer, within `PATIENCE`.
    async fn answer(&mut self) -> RateLimitQuotaResponse {
        tokio::time::timeout(PATIENCE, self.answers.message())
            .await
            .expect("sluice answers in time")
            .expect("the stream stays up")
            .expect("the stream is not ended")
    }

    /// Reports `allowed`/`denied` for one bucket and returns what it is assigned.
    async fn ask(&mut self, id: &BucketId, allowed: u64, denied: u64) -> Strategy {
        self.report(&[(id, allowed, denied)]).await;
        only(&self.answer().await, id)
    }

    /// Whether an answer comes within `wait`.
    async fn quiet_for(&mut self, wait: Duration) -> bool {
        tokio::time::timeout(wait, self.answers.message())
            .await
            .is_err()
    }
}

fn bucket(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

fn tenant(name: &str) -> BucketId {
    bucket(&[("name", "per-tenant"), ("tenant", name)])
}

/// The strategy assigned to `id`, the only bucket of `answer`, checking the assignment's shape:
/// the bucket id echoed exactly and a whole-second time to live.
fn only(answer: &RateLimitQuotaResponse, id: &BucketId) -> Strategy {
    assert_eq!(answer.bucket_action.len(), 1, "{answer:?}");
    let action = &answer.bucket_action[0];
    assert_eq!(
        action.bucket_id.as_ref(),
        Some(id),
        "the bucket id is echoed"
    );
    match &action.bucket_action {
        Some(Action::QuotaAssignmentAction(a)) => {
            let ttl = a
                .assignment_time_to_live
                .expect("a time to live is always set");
            assert!(
                ttl.seconds >= 1 && ttl.nanos == 0,
                "Envoy 1.40 reads whole seconds of the TTL, and treats none as 0: {ttl:?}"
            );
            a.rate_limit_strategy
                .as_ref()
                .and_then(|s| s.strategy)
                .expect("a strategy is always set")
        }
        other => panic!("expected an assignment, got {other:?}"),
    }
}

/// A token bucket's tokens per fill, checking the shape Envoy 1.40 enforces: tokens_per_fill
/// set and equal to max_tokens, a whole-second fill interval of `fill_seconds`.
fn tokens(strategy: &Strategy, fill_seconds: i64) -> u32 {
    let Strategy::TokenBucket(bucket) = strategy else {
        panic!("expected a token bucket, got {strategy:?}");
    };
    let per_fill = bucket
        .tokens_per_fill
        .as_ref()
        .expect("tokens_per_fill is always set: Envoy 1.40 reads it unset as 0, never refilling")
        .value;
    let fill = bucket.fill_interval.expect("a fill interval");
    assert_eq!(
        (fill.seconds, fill.nanos),
        (fill_seconds, 0),
        "Envoy 1.40 reads a sub-second fill interval as 0 s: no limit at all"
    );
    assert_eq!(bucket.max_tokens, per_fill, "one window's share of burst");
    per_fill
}

fn blanket(strategy: &Strategy) -> BlanketRule {
    match strategy {
        Strategy::BlanketRule(rule) => BlanketRule::try_from(*rule).expect("a known rule"),
        other => panic!("expected a blanket rule, got {other:?}"),
    }
}

async fn first_report_is_a_subscription_answered_at_once_with_an_enforceable_bucket(store: Store) {
    let sluice = Sluice::on(store, &[("quota.yaml", RULES)], &[]).await;
    let mut envoy = QuotaStream::open(&sluice).await;
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
    let mut first = QuotaStream::open(&sluice).await;
    assert_eq!(tokens(&first.ask(&acme, 1, 0).await, 1), 20);
    let mut second = QuotaStream::open(&sluice).await;
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
    let mut idle = QuotaStream::open(&sluice).await;
    let mut busy = QuotaStream::open(&sluice).await;
    idle.ask(&acme, 1, 0).await;
    busy.ask(&acme, 1, 0).await;
    idle.answer().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
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
    let mut stays = QuotaStream::open(&sluice).await;
    stays.ask(&acme, 1, 0).await;
    let mut goes = QuotaStream::open(&sluice).await;
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
    let mut envoy = QuotaStream::open(&sluice).await;
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
    let mut envoy = QuotaStream::open(&sluice).await;
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
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bucket_reported_idle_n_times_in_a_row_is_abandoned() {
    let sluice =
        Sluice::start_with(&[("quota.yaml", RULES)], &["--quota-abandon-after", "2"]).await;
    let mut envoy = QuotaStream::open(&sluice).await;
    let acme = tenant("acme");
    envoy.ask(&acme, 1, 0).await;
    envoy.ask(&acme, 0, 0).await;
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
    let mut envoy = QuotaStream::open(&sluice).await;
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

#[tokio::test(flavor = "multi_thread")]
async fn replicas_sharing_redis_divide_one_limit() {
    let one = Sluice::on(
        Store::Redis,
        &[("quota.yaml", RULES)],
        &["--redis-key-prefix", "rlqs-replicas:"],
    )
    .await;
    let two = Sluice::on(
        Store::Redis,
        &[("quota.yaml", RULES)],
        &["--redis-key-prefix", "rlqs-replicas:"],
    )
    .await;
    let acme = tenant("acme");
    let mut first = QuotaStream::open(&one).await;
    let mut second = QuotaStream::open(&two).await;
    assert_eq!(tokens(&first.ask(&acme, 1, 0).await, 1), 20);
    assert_eq!(
        tokens(&second.ask(&acme, 1, 0).await, 1),
        10,
        "the other replica's stream is counted"
    );
    assert!(
        first.quiet_for(Duration::from_millis(500)).await,
        "no push across replicas: the first stream learns with its next report"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(tokens(&first.ask(&acme, 100, 100).await, 1), 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn while_redis_is_down_buckets_keep_their_last_assignment() {
    let mut redis = Controlled::started();
    let url = redis.url.clone();
    let sluice = Sluice::start_with(&[("quota.yaml", RULES)], &["--redis-url", &url]).await;
    let acme = tenant("acme");
    let mut first = QuotaStream::open(&sluice).await;
    let mut second = QuotaStream::open(&sluice).await;
    first.ask(&acme, 1, 0).await;
    assert_eq!(tokens(&second.ask(&acme, 1, 0).await, 1), 10);
    first.answer().await;
    redis.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        tokens(&first.ask(&acme, 100, 100).await, 1),
        10,
        "the last assignment, not allow-all"
    );
    let new = tenant("new");
    assert_eq!(
        tokens(&first.ask(&new, 1, 0).await, 1),
        20,
        "a bucket new while Redis is down: the limit divided among this replica's streams of it"
    );
    let errors: f64 = scrape(sluice.http)
        .samples_of("sluice_quota_store_errors_total")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert!(errors >= 2.0, "{errors}");
    assert!(sluice.log_text().contains("keep their last assignments"));
}
