//! Bad requests get INVALID_ARGUMENT with a message naming what is wrong, and the server keeps
//! serving; the request bounds are set by flags. What a client controls (values, hits) is never
//! an error.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use support::{MINUTE, OK, OVER_LIMIT, Sluice, descriptor, in_one_window, request};
use tonic::Code;

const RULES: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 20}\n";

async fn rejected(sluice: &Sluice, request: RateLimitRequest, mentions: &str) {
    let status = sluice
        .client()
        .await
        .should_rate_limit(request)
        .await
        .expect_err("the request is rejected");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains(mentions),
        "message {:?} should mention {mentions:?}",
        status.message()
    );
}

#[tokio::test]
async fn every_bad_request_is_invalid_argument_and_the_server_keeps_serving() {
    let mut sluice = Sluice::start_with(
        &[("rules.yaml", RULES)],
        &["--max-descriptors", "3", "--max-entries", "2"],
    )
    .await;

    rejected(
        &sluice,
        request("", &[&[("user", "a")]]),
        "domain must not be empty",
    )
    .await;
    rejected(
        &sluice,
        request("web", &[]),
        "descriptor list must not be empty",
    )
    .await;
    let four: &[&[(&str, &str)]] = &[
        &[("user", "a")],
        &[("user", "b")],
        &[("user", "c")],
        &[("user", "d")],
    ];
    rejected(&sluice, request("web", four), "--max-descriptors (3)").await;
    rejected(
        &sluice,
        request("web", &[&[]]),
        "descriptor 0 has no entries",
    )
    .await;
    rejected(
        &sluice,
        request("web", &[&[("a", "1"), ("b", "2"), ("c", "3")]]),
        "--max-entries (2)",
    )
    .await;
    rejected(&sluice, request("web", &[&[("", "x")]]), "empty key").await;

    let mut bad_unit = request("web", &[&[("user", "a")]]);
    bad_unit.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 0,
    });
    rejected(&sluice, bad_unit, "unknown unit").await;

    assert!(sluice.alive(), "the server is still up");
    let fine = sluice
        .ask(request(
            "web",
            &[&[("user", "a")], &[("user", "b")], &[("user", "c")]],
        ))
        .await;
    assert_eq!(fine.overall_code, OK);
    assert_eq!(
        fine.statuses[0].limit_remaining, 19,
        "rejected requests consumed nothing"
    );
}

#[tokio::test]
async fn a_domain_past_1024_bytes_is_invalid_argument_naming_the_bound_and_one_at_it_is_decided() {
    let at_bound = "d".repeat(1024);
    let rules = format!(
        "domain: {at_bound}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: 20}}\n"
    );
    let mut sluice = Sluice::start(&rules).await;
    rejected(
        &sluice,
        request(&"d".repeat(1025), &[&[("user", "a")]]),
        "rate limit domain of 1025 bytes is longer than the most a domain may be (1024 bytes)",
    )
    .await;
    assert!(sluice.alive());
    let r = sluice.ask(request(&at_bound, &[&[("user", "a")]])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[0].limit_remaining, 19, "the rule matched");
}

#[tokio::test]
async fn hits_beyond_any_limit_are_over_limit_not_an_error() {
    let sluice = Sluice::start(RULES).await;
    let mut huge = request("web", &[&[("user", "h")]]);
    huge.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    let r = sluice.ask(huge).await;
    assert_eq!(r.overall_code, OVER_LIMIT);
    let r = sluice.ask(request("web", &[&[("user", "h")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 19, "nothing was consumed");
}

#[tokio::test]
async fn the_default_bounds_admit_ordinary_envoy_requests() {
    let sluice = Sluice::start(RULES).await;
    let mut r = request("web", &[]);
    for i in 0..10 {
        r.descriptors.push(descriptor(&[
            ("user", &format!("u{i}")),
            ("path", "/a/long/enough/path"),
        ]));
    }
    assert_eq!(sluice.ask(r).await.overall_code, OK);
}

#[tokio::test]
async fn a_full_embedded_store_answers_resource_exhausted_and_keeps_known_counters() {
    in_one_window(MINUTE, async || {
        let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--max-keys", "1"]).await;
        let mut client = sluice.client().await;
        let mut exhausted = None;
        for i in 0..500 {
            let result = client
                .should_rate_limit(request("web", &[&[("user", &format!("u{i}"))]]))
                .await;
            if let Err(status) = result {
                exhausted = Some(status);
                break;
            }
        }
        let status = exhausted.expect("the store fills up");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("--max-keys"), "{status:?}");
        let known = sluice.ask(request("web", &[&[("user", "u0")]])).await;
        assert_eq!(
            known.statuses[0].limit_remaining, 18,
            "an existing counter still counts"
        );
    })
    .await;
}

/// Fills a one-counter-per-shard embedded store under `policy` and returns the answer to the
/// first request that found its shard full, after checking that known counters still count.
async fn answer_when_full(
    policy: &str,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
    let sluice = Sluice::start_with(
        &[("rules.yaml", RULES)],
        &["--max-keys", "1", "--on-store-error", policy],
    )
    .await;
    let mut client = sluice.client().await;
    let mut seen: Vec<String> = Vec::new();
    for i in 0..500 {
        let value = format!("u{i}");
        let r = client
            .should_rate_limit(request("web", &[&[("user", &value)]]))
            .await
            .expect("a full store is not an error under this policy")
            .into_inner();
        let counted = r.statuses[0].limit_remaining == 19;
        if !counted {
            let known = sluice.ask(request("web", &[&[("user", &seen[0])]])).await;
            assert_eq!(
                known.statuses[0].limit_remaining, 18,
                "an existing counter still counts"
            );
            return r;
        }
        seen.push(value);
    }
    panic!("the store never filled up");
}

#[tokio::test]
async fn a_full_embedded_store_denies_new_counters_under_on_store_error_deny() {
    in_one_window(MINUTE, async || {
        let r = answer_when_full("deny").await;
        assert_eq!(r.overall_code, OVER_LIMIT);
        let status = &r.statuses[0];
        assert_eq!(status.code, OVER_LIMIT);
        assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 20);
    })
    .await;
}

#[tokio::test]
async fn a_full_embedded_store_allows_new_counters_under_on_store_error_allow() {
    in_one_window(MINUTE, async || {
        let r = answer_when_full("allow").await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(r.statuses[0].current_limit, None, "nothing was counted");
    })
    .await;
}
