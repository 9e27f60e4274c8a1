//! Black-box specification of `ShouldRateLimit`: the real binary over gRPC, every test run on the
//! embedded store, on a standalone Redis and on a Redis Cluster. Each test starts its own sluice
//! with the rules it needs.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use support::{
    OK, OVER_LIMIT, Sluice, Store, decide, descriptor, in_one_window, request, sleep_until_unix_ms,
    unix_ms,
};

on_every_store!(
    a_20_per_minute_rule_counts_down_then_denies,
    an_unknown_domain_or_unmatched_descriptor_is_ok_without_a_limit,
    unlimited_is_ok_with_the_largest_remaining,
    a_shadow_mode_rule_is_ok_while_its_counter_moves,
    global_shadow_mode_answers_ok_but_reports_over_limit_descriptors,
    replaces_drops_the_replaced_limits,
    wildcards_resolve_before_the_key_only_rule,
    nested_descriptors_take_the_limit_of_the_last_entry,
    keys_and_values_are_compared_as_pairs,
    a_descriptor_limit_override_is_used,
    a_denied_request_consumes_nothing_from_its_other_descriptors,
    hits_addend_consumes_that_many_and_zero_only_checks,
    negative_hits_give_capacity_back,
    statuses_follow_the_request_order,
    the_same_descriptor_twice_counts_twice,
    a_sliding_window_rule_reports_its_window,
    several_descriptors_with_different_values_count_apart,
    several_limits_on_one_descriptor_must_all_pass,
    a_second_and_a_minute_limit_deny_by_the_one_that_is_full_and_denials_consume_nothing,
);

const RULES: &str = r#"
domain: web
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 20, name: per_user}
  - key: tier
    value: free
    rate_limit: {unit: minute, requests_per_unit: 2, name: free_tier}
  - key: tier
    value: gold
    rate_limit: {unit: minute, requests_per_unit: 1000, replaces: [{name: free_tier}, {name: per_user}]}
  - key: internal
    rate_limit: {unlimited: true}
  - key: canary
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: client
    descriptors:
      - key: method
        value: POST
        rate_limit: {unit: hour, requests_per_unit: 4}
      - key: method
        rate_limit: {unit: hour, requests_per_unit: 40}
  - key: a_b
    value: c
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: a
    value: b_c
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: window
    rate_limit: {unit: second, requests_per_unit: 5, unit_multiplier: 10, algorithm: sliding_window}
"#;

fn remaining(
    r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse,
    i: usize,
) -> u32 {
    r.statuses[i].limit_remaining
}

async fn a_20_per_minute_rule_counts_down_then_denies(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for expected in (0..20).rev() {
        let r = sluice.ask(request("web", &[&[("user", "alice")]])).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(r.statuses[0].code, OK);
        assert_eq!(remaining(&r, 0), expected);
        let limit = r.statuses[0]
            .current_limit
            .as_ref()
            .expect("current_limit is set");
        assert_eq!(
            (limit.requests_per_unit, limit.unit, limit.name.as_str()),
            (20, 2, "per_user")
        );
        let reset = r.statuses[0]
            .duration_until_reset
            .expect("duration_until_reset is set");
        assert!((0..=60).contains(&reset.seconds));
    }
    let r = sluice.ask(request("web", &[&[("user", "alice")]])).await;
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(r.statuses[0].code, OVER_LIMIT);
    assert_eq!(remaining(&r, 0), 0);
    assert!(
        r.response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after"),
        "an OVER_LIMIT answer says when to retry"
    );
    let other = sluice.ask(request("web", &[&[("user", "bob")]])).await;
    assert_eq!(
        (other.overall_code, remaining(&other, 0)),
        (OK, 19),
        "each value has its own counter"
    );
}

async fn an_unknown_domain_or_unmatched_descriptor_is_ok_without_a_limit(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let r = sluice.ask(request("nope", &[&[("user", "alice")]])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses.len(), 1);
    assert!(r.statuses[0].current_limit.is_none());
    let r = sluice.ask(request("web", &[&[("nothing", "here")]])).await;
    assert_eq!((r.overall_code, r.statuses[0].code), (OK, OK));
    assert!(r.statuses[0].current_limit.is_none());
}

async fn unlimited_is_ok_with_the_largest_remaining(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for _ in 0..3 {
        let r = sluice.ask(request("web", &[&[("internal", "x")]])).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(remaining(&r, 0), u32::MAX);
        assert!(r.statuses[0].current_limit.is_none());
    }
}

async fn a_shadow_mode_rule_is_ok_while_its_counter_moves(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let first = sluice.ask(request("web", &[&[("canary", "c")]])).await;
    assert_eq!((first.overall_code, remaining(&first, 0)), (OK, 0));
    for _ in 0..3 {
        let r = sluice.ask(request("web", &[&[("canary", "c")]])).await;
        assert_eq!(r.overall_code, OK, "shadow mode never denies");
        assert_eq!(r.statuses[0].code, OK);
        assert_eq!(remaining(&r, 0), 0, "the counter is over its limit");
    }
}

async fn global_shadow_mode_answers_ok_but_reports_over_limit_descriptors(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &["--shadow-mode"]).await;
    for _ in 0..2 {
        sluice.ask(request("web", &[&[("tier", "free")]])).await;
    }
    let r = sluice.ask(request("web", &[&[("tier", "free")]])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[0].code, OVER_LIMIT);
}

async fn replaces_drops_the_replaced_limits(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for _ in 0..5 {
        let r = sluice
            .ask(request(
                "web",
                &[
                    &[("tier", "free")],
                    &[("tier", "gold")],
                    &[("user", "carol")],
                ],
            ))
            .await;
        assert_eq!(r.overall_code, OK, "free_tier (2/min) no longer applies");
        assert!(r.statuses[0].current_limit.is_none());
        assert!(
            r.statuses[2].current_limit.is_none(),
            "per_user is replaced too"
        );
        assert_eq!(
            r.statuses[1]
                .current_limit
                .as_ref()
                .unwrap()
                .requests_per_unit,
            1000
        );
    }
    let alone = sluice.ask(request("web", &[&[("user", "carol")]])).await;
    assert_eq!(remaining(&alone, 0), 19, "replaced limits were not counted");
}

async fn wildcards_resolve_before_the_key_only_rule(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let api = sluice
        .ask(request("web", &[&[("path", "/api/users")]]))
        .await;
    assert_eq!(
        api.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        3
    );
    let other = sluice.ask(request("web", &[&[("path", "/home")]])).await;
    assert_eq!(
        other.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        30
    );
    for _ in 0..2 {
        sluice
            .ask(request("web", &[&[("path", "/api/users")]]))
            .await;
    }
    let denied = sluice
        .ask(request("web", &[&[("path", "/api/users")]]))
        .await;
    assert_eq!(denied.overall_code, OVER_LIMIT);
    let sibling = sluice
        .ask(request("web", &[&[("path", "/api/orders")]]))
        .await;
    assert_eq!(
        sibling.overall_code, OK,
        "each value matched by a wildcard counts alone"
    );
}

async fn nested_descriptors_take_the_limit_of_the_last_entry(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let post = sluice
        .ask(request("web", &[&[("client", "x"), ("method", "POST")]]))
        .await;
    assert_eq!(
        post.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        4
    );
    assert_eq!(
        post.statuses[0].current_limit.as_ref().unwrap().unit,
        3,
        "HOUR"
    );
    let get = sluice
        .ask(request("web", &[&[("client", "x"), ("method", "GET")]]))
        .await;
    assert_eq!(
        get.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        40
    );
    let parent = sluice.ask(request("web", &[&[("client", "x")]])).await;
    assert!(parent.statuses[0].current_limit.is_none());
    let deeper = sluice
        .ask(request(
            "web",
            &[&[("client", "x"), ("method", "GET"), ("extra", "1")]],
        ))
        .await;
    assert!(deeper.statuses[0].current_limit.is_none());
}

async fn keys_and_values_are_compared_as_pairs(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let a = sluice.ask(request("web", &[&[("a_b", "c")]])).await;
    let b = sluice.ask(request("web", &[&[("a", "b_c")]])).await;
    assert_eq!(
        (a.overall_code, b.overall_code),
        (OK, OK),
        "two rules, two counters"
    );
    let a = sluice.ask(request("web", &[&[("a_b", "c")]])).await;
    assert_eq!(a.overall_code, OVER_LIMIT);
}

async fn a_descriptor_limit_override_is_used(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let mut with_override = request("web", &[&[("user", "dave")]]);
    with_override.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 2,
    });
    for expected in [1, 0] {
        let r = sluice.ask(with_override.clone()).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(remaining(&r, 0), expected);
        assert_eq!(
            r.statuses[0]
                .current_limit
                .as_ref()
                .unwrap()
                .requests_per_unit,
            2
        );
    }
    assert_eq!(sluice.ask(with_override).await.overall_code, OVER_LIMIT);
    let plain = sluice.ask(request("web", &[&[("user", "dave")]])).await;
    assert_eq!(
        remaining(&plain, 0),
        19,
        "the override counts apart from the rule's limit"
    );
}

async fn a_denied_request_consumes_nothing_from_its_other_descriptors(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for _ in 0..2 {
        sluice.ask(request("web", &[&[("tier", "free")]])).await;
    }
    for _ in 0..5 {
        let r = sluice
            .ask(request(
                "web",
                &[&[("user", "erin")], &[("tier", "free")], &[("path", "/x")]],
            ))
            .await;
        assert_eq!(r.overall_code, OVER_LIMIT);
        assert_eq!(
            r.statuses.iter().map(|s| s.code).collect::<Vec<_>>(),
            [OK, OVER_LIMIT, OK]
        );
    }
    let r = sluice
        .ask(request("web", &[&[("user", "erin")], &[("path", "/x")]]))
        .await;
    assert_eq!((remaining(&r, 0), remaining(&r, 1)), (19, 29));
}

async fn hits_addend_consumes_that_many_and_zero_only_checks(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let mut five = request("web", &[&[("user", "fay")]]);
    five.hits_addend = 5;
    assert_eq!(remaining(&sluice.ask(five).await, 0), 15);
    let mut check_only = request("web", &[&[("user", "fay")]]);
    check_only.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(remaining(&sluice.ask(check_only.clone()).await, 0), 15);
    assert_eq!(
        remaining(&sluice.ask(check_only).await, 0),
        15,
        "a check consumes nothing"
    );
    let mut too_many = request("web", &[&[("user", "fay")]]);
    too_many.descriptors[0].hits_addend = Some(UInt64Value { value: 16 });
    too_many.hits_addend = 1;
    assert_eq!(
        sluice.ask(too_many).await.overall_code,
        OVER_LIMIT,
        "descriptor hits win"
    );
}

async fn negative_hits_give_capacity_back(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for _ in 0..2 {
        sluice.ask(request("web", &[&[("tier", "free")]])).await;
    }
    assert_eq!(
        sluice
            .ask(request("web", &[&[("tier", "free")]]))
            .await
            .overall_code,
        OVER_LIMIT
    );
    let mut refund = request("web", &[&[("tier", "free")]]);
    refund.descriptors[0].is_negative_hits = true;
    refund.descriptors[0].hits_addend = Some(UInt64Value { value: 1 });
    let r = sluice.ask(refund).await;
    assert_eq!((r.overall_code, remaining(&r, 0)), (OK, 1));
    assert_eq!(
        sluice
            .ask(request("web", &[&[("tier", "free")]]))
            .await
            .overall_code,
        OK
    );
}

async fn statuses_follow_the_request_order(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let r = sluice
        .ask(request(
            "web",
            &[
                &[("internal", "1")],
                &[("nothing", "x")],
                &[("user", "gus")],
                &[("tier", "free")],
            ],
        ))
        .await;
    assert_eq!(r.statuses.len(), 4);
    assert_eq!(remaining(&r, 0), u32::MAX);
    assert!(r.statuses[1].current_limit.is_none());
    assert_eq!(
        r.statuses[2]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        20
    );
    assert_eq!(
        r.statuses[3]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        2
    );
}

async fn the_same_descriptor_twice_counts_twice(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let twice: RateLimitRequest = request("web", &[&[("tier", "free")], &[("tier", "free")]]);
    let r = sluice.ask(twice.clone()).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[1].limit_remaining, 0);
    assert_eq!(sluice.ask(twice).await.overall_code, OVER_LIMIT);
}

async fn a_sliding_window_rule_reports_its_window(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    // All six requests in one 10 s window (across an edge, the sliding window admits a little
    // more), on a value of its own each run.
    let mut run = 0;
    in_one_window(Duration::from_secs(10), async || {
        run += 1;
        let window = format!("w{run}");
        let ask = || request("web", &[&[("window", window.as_str())]]);
        for expected in (0..5).rev() {
            let r = sluice.ask(ask()).await;
            assert_eq!((r.overall_code, remaining(&r, 0)), (OK, expected));
        }
        let r = sluice.ask(ask()).await;
        assert_eq!(r.overall_code, OVER_LIMIT);
        let reset = r.statuses[0].duration_until_reset.unwrap();
        assert!(
            reset.seconds <= 20,
            "retry within the 10 s window or the next: {reset:?}"
        );
    })
    .await;
}

async fn several_descriptors_with_different_values_count_apart(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let mut r = request("web", &[&[("user", "hal")]]);
    r.descriptors.push(descriptor(&[("user", "ivy")]));
    let answer = sluice.ask(r).await;
    assert_eq!((remaining(&answer, 0), remaining(&answer, 1)), (19, 19));
}

const SEVERAL: &str = r#"
domain: api
descriptors:
  - key: client
    rate_limits:
      - {unit: minute, requests_per_unit: 5, name: burst}
      - {unit: hour, requests_per_unit: 3, name: sustained}
"#;

async fn several_limits_on_one_descriptor_must_all_pass(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", SEVERAL)], &[]).await;
    for expected in [2, 1, 0] {
        let r = sluice.ask(request("api", &[&[("client", "k")]])).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(remaining(&r, 0), expected);
        let shown = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            shown.name, "sustained",
            "the status names the most restrictive limit"
        );
    }
    let r = sluice.ask(request("api", &[&[("client", "k")]])).await;
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "sustained"
    );
    let mut refund = request("api", &[&[("client", "k")]]);
    refund.descriptors[0].is_negative_hits = true;
    refund.descriptors[0].hits_addend = Some(UInt64Value { value: 3 });
    let r = sluice.ask(refund).await;
    assert_eq!(
        remaining(&r, 0),
        3,
        "a refund gives back to every limit of the descriptor"
    );
    let r = sluice.ask(request("api", &[&[("client", "k")]])).await;
    assert_eq!((r.overall_code, remaining(&r, 0)), (OK, 2));
}

const PER_SECOND_AND_MINUTE: &str = r#"
domain: api
descriptors:
  - key: client
    rate_limits:
      - {unit: second, requests_per_unit: 10, name: per_second}
      - {unit: minute, requests_per_unit: 20, name: per_minute}
"#;

/// Starts 50 ms into the next whole second (Unix time), so that a few dozen requests all fall in
/// that second; `on_every_store` runs the test `in_one_window` of a minute.
async fn at_the_start_of_a_second() {
    sleep_until_unix_ms((unix_ms() / 1000 + 1) * 1000 + 50).await;
}

async fn a_second_and_a_minute_limit_deny_by_the_one_that_is_full_and_denials_consume_nothing(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", PER_SECOND_AND_MINUTE)], &[]).await;
    let ask = || request("api", &[&[("client", "c")]]);
    // One connection, made before the second starts: every call of a second falls inside it.
    let mut client = sluice.client().await;
    let mut call = async |request| decide(&mut client, request).await;
    let shown = |r: &RateLimitResponse| r.statuses[0].current_limit.as_ref().unwrap().name.clone();
    at_the_start_of_a_second().await;
    for _ in 0..10 {
        assert_eq!(call(ask()).await.overall_code, OK);
    }
    let r = call(ask()).await;
    assert_eq!(
        (r.overall_code, shown(&r)),
        (OVER_LIMIT, "per_second".into())
    );

    at_the_start_of_a_second().await;
    for _ in 0..10 {
        assert_eq!(call(ask()).await.overall_code, OK);
    }
    let r = call(ask()).await;
    assert_eq!(
        (r.overall_code, shown(&r), remaining(&r, 0)),
        (OVER_LIMIT, "per_minute".into(), 0),
        "20 in the minute: the minute limit denies"
    );

    at_the_start_of_a_second().await;
    for _ in 0..12 {
        let r = call(ask()).await;
        assert_eq!(
            (r.overall_code, shown(&r)),
            (OVER_LIMIT, "per_minute".into())
        );
    }
    let mut refund = ask();
    refund.descriptors[0].is_negative_hits = true;
    call(refund).await;
    let r = call(ask()).await;
    assert_eq!(
        r.overall_code, OK,
        "the 12 denied requests took nothing from this second's 10"
    );
}
