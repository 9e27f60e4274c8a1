//! The quota service: its division of a limit (any limit, any demands) and its streams (reports
//! of any bucket ids, counts up to `u64::MAX`, many buckets at once, over several streams). The
//! shares of a limit add up to it exactly while a stream asks for some, a stream that asks for
//! nothing gets the least share, and every assignment sent is one Envoy enforces and never more
//! than the bucket's rule allows.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy as Assigned;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use sluice_core::limiter::{Algorithm, Limit, Unit};
use sluice::quota::{Assignment, demand};
use sluice_core::limiter::share::MILLI;
use sluice_core::limiter::share::divide;

use super::fuzz;
use support::Sluice;
use support::quota::QuotaStream;

#[test]
fn shares_add_up_to_the_limit_an_idle_stream_gets_the_least_and_none_is_shut_out() {
    fuzz(
        "quota::divide",
        800,
        Duration::from_secs(3),
        (
            prop_oneof![Just(0u64), Just(MILLI), 0..u64::from(u32::MAX) * MILLI],
            prop::collection::vec(
                prop_oneof![Just(0u64), Just(u64::MAX), 0..100 * MILLI, any::<u64>()],
                0..200,
            ),
        ),
        |(limit, demands)| {
            let shares = divide(limit, &demands);
            prop_assert_eq!(shares.len(), demands.len());
            let least = if limit >= demands.len() as u64 * MILLI {
                MILLI
            } else {
                0
            };
            if demands.iter().any(|&d| d > 0) {
                prop_assert_eq!(shares.iter().sum::<u64>(), limit);
            }
            for (share, demand) in shares.iter().zip(&demands) {
                prop_assert!(*share >= least, "{shares:?}");
                if *demand == 0 {
                    prop_assert_eq!(*share, least, "{:?}", shares);
                }
            }
            Ok(())
        },
    );
}

const UNITS: [&str; 7] = ["second", "minute", "hour", "day", "week", "month", "year"];

fn limits() -> impl Strategy<Value = Limit> {
    (
        1..=u32::MAX,
        prop::sample::select(UNITS.map(|u| Unit::parse(u).expect("a unit")).to_vec()),
        prop_oneof![Just(1u32), 1..10u32],
    )
        .prop_map(|(requests_per_unit, unit, unit_multiplier)| Limit {
            name: String::new(),
            requests_per_unit,
            unit,
            unit_multiplier,
            algorithm: Algorithm::FixedWindow,
            burst: requests_per_unit,
            calendar: None,
        })
}

#[test]
fn a_demand_and_its_assignment_never_exceed_the_limit() {
    fuzz(
        "quota::assignment",
        3_000,
        Duration::from_secs(3),
        (
            limits(),
            any::<u64>(),
            any::<u64>(),
            prop_oneof![Just(0u64), 1..u64::from(u32::MAX) * MILLI],
        ),
        |(limit, requests, elapsed_ms, milli)| {
            let whole = u64::from(limit.requests_per_unit);
            let window = Duration::from_millis(limit.window_ms());
            let asked = demand(requests, Duration::from_millis(elapsed_ms), window, whole);
            prop_assert!(
                asked <= whole * MILLI,
                "demand {asked} of a limit of {whole}"
            );
            let milli = milli.min(whole * MILLI);
            let assignment = Assignment::share(milli, &limit);
            let per_second = whole as f64 / (limit.window_ms() / 1000) as f64;
            match assignment {
                Assignment::DenyAll => prop_assert_eq!(milli, 0),
                Assignment::AllowAll => return Err(TestCaseError::fail("a share allows all")),
                Assignment::TokenBucket {
                    max_tokens,
                    fill_seconds,
                    ..
                } => {
                    prop_assert!(fill_seconds >= 1);
                    prop_assert!(
                        (1..=limit.requests_per_unit).contains(&max_tokens),
                        "{assignment:?}"
                    );
                    let rate = assignment.rate().unwrap();
                    prop_assert!(
                        rate <= per_second * (1.0 + 1e-9),
                        "{assignment:?} of {per_second}/s"
                    );
                }
            }
            Ok(())
        },
    );
}

const DOMAIN: &str = "quota";

/// How long a report's answers may take: the quota service's thread yields the CPU to every other
/// (`SCHED_IDLE`), and the other fuzz targets keep both cores busy.
const PATIENCE: Duration = Duration::from_secs(30);

const RULES: &str = r#"domain: quota
quota_buckets:
  - bucket: {name: tenant, tenant: "*"}
    rate_limit: {unit: second, requests_per_unit: 10}
  - bucket: {name: big}
    rate_limit: {unit: hour, requests_per_unit: 4294967295}
  - bucket: {name: free}
    rate_limit: {unlimited: true}
"#;

/// What a rule of `RULES` lets through a second, for an id it surely matches.
fn most_per_second(id: &BTreeMap<String, String>) -> Option<f64> {
    let keys: Vec<&str> = id.keys().map(String::as_str).collect();
    match (id.get("name").map(String::as_str), keys.as_slice()) {
        (Some("tenant"), ["name", "tenant"]) => Some(10.0),
        (Some("big"), ["name"]) => Some(f64::from(u32::MAX) / 3600.0),
        _ => None,
    }
}

fn words() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["name", "tenant", "big", "free", "", "*", "a"]).prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

fn ids() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop_oneof![
        3 => words().prop_map(|t| [("name".to_owned(), "tenant".to_owned()), ("tenant".to_owned(), t)].into()),
        1 => prop::collection::btree_map(words(), words(), 0..4),
    ]
}

fn counts() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), Just(u64::MAX), 0..1_000u64, any::<u64>()]
}

fn usages() -> impl Strategy<Value = BucketQuotaUsage> {
    (
        prop::option::weighted(0.9, ids()),
        prop::option::of((any::<i64>(), any::<i32>())),
        counts(),
        counts(),
    )
        .prop_map(|(id, elapsed, allowed, denied)| BucketQuotaUsage {
            bucket_id: id.map(|bucket| BucketId {
                bucket: bucket.into_iter().collect(),
            }),
            time_elapsed: elapsed.map(|(seconds, nanos)| ProtoDuration { seconds, nanos }),
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        })
}

/// A report on one of three streams: a few buckets, or many.
fn reports() -> impl Strategy<Value = (usize, RateLimitQuotaUsageReports)> {
    (
        0..3usize,
        prop_oneof![4 => Just(DOMAIN.to_owned()), 1 => words()],
        prop_oneof![
            4 => prop::collection::vec(usages(), 0..8),
            1 => prop::collection::vec(usages(), 200..600),
        ],
    )
        .prop_map(|(stream, domain, bucket_quota_usages)| {
            (
                stream,
                RateLimitQuotaUsageReports {
                    domain,
                    bucket_quota_usages,
                },
            )
        })
}

/// Checks one answer's assignments as Envoy reads them, and within its rule's limit; the ids
/// they answer.
fn well_formed(answer: &RateLimitQuotaResponse) -> Result<Vec<BucketId>, TestCaseError> {
    let mut ids = Vec::new();
    for action in &answer.bucket_action {
        let id = action
            .bucket_id
            .clone()
            .expect("an action names its bucket");
        match &action.bucket_action {
            Some(Action::AbandonAction(_)) => {}
            Some(Action::QuotaAssignmentAction(a)) => {
                let ttl = a.assignment_time_to_live.expect("a time to live");
                prop_assert!(ttl.seconds >= 1 && ttl.nanos == 0, "{ttl:?}");
                let strategy = a.rate_limit_strategy.and_then(|s| s.strategy);
                if let Some(Assigned::TokenBucket(bucket)) = strategy {
                    let per_fill = bucket.tokens_per_fill.expect("tokens_per_fill").value;
                    let fill = bucket.fill_interval.expect("a fill interval");
                    prop_assert!(fill.seconds >= 1 && fill.nanos == 0, "{fill:?}");
                    prop_assert!(bucket.max_tokens >= 1);
                    let id: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
                    if let Some(most) = most_per_second(&id) {
                        let rate = f64::from(per_fill) / fill.seconds as f64;
                        prop_assert!(
                            rate <= most * (1.0 + 1e-9),
                            "{id:?}: {rate}/s, more than {most}/s"
                        );
                    }
                } else {
                    prop_assert!(strategy.is_some(), "an assignment without a strategy");
                }
            }
            None => return Err(TestCaseError::fail("an action without an action")),
        }
        ids.push(id);
    }
    Ok(ids)
}

#[test]
fn any_report_on_any_stream_is_answered_within_its_rules() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (mut sluice, mut streams) = runtime.block_on(async {
        // A record for every bucket at once: a new bucket past --quota-max-records waits for its
        // first record unanswered (tests/redis/rlqs.rs covers that), and every bucket here is to be
        // answered.
        let sluice = Sluice::start_with(
            &[("rules.yaml", RULES)],
            &["--quota-max-records", "1000000"],
        )
        .await;
        let channel = sluice.channel().await;
        let mut streams = Vec::new();
        for _ in 0..3 {
            streams.push(QuotaStream::open_on(channel.clone(), DOMAIN).await);
        }
        (sluice, streams)
    });
    let streams = std::cell::RefCell::new(&mut streams);
    fuzz(
        "quota::reports",
        300,
        Duration::from_secs(12),
        reports(),
        |(at, report)| {
            let mut streams = streams.borrow_mut();
            let stream = &mut streams[at];
            let mut waiting: HashSet<BTreeMap<String, String>> = report
                .bucket_quota_usages
                .iter()
                .filter_map(|u| u.bucket_id.as_ref())
                .filter(|id| !id.bucket.is_empty())
                .map(|id| id.bucket.clone().into_iter().collect())
                .collect();
            runtime.block_on(async {
                stream
                    .reports
                    .send(report)
                    .await
                    .expect("the stream takes reports");
                while !waiting.is_empty() {
                    let answer = tokio::time::timeout(PATIENCE, stream.answers.message())
                        .await
                        .map_err(|_| {
                            TestCaseError::fail(format!("{} bucket(s) unanswered", waiting.len()))
                        })?
                        .map_err(|e| TestCaseError::fail(format!("the stream failed: {e}")))?
                        .ok_or_else(|| TestCaseError::fail("the stream ended"))?;
                    for id in well_formed(&answer)? {
                        waiting.remove(&id.bucket.into_iter().collect());
                    }
                }
                Ok(())
            })
        },
    );
    assert!(sluice.alive(), "sluice still runs:\n{}", sluice.log_text());
}
