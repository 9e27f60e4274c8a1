//! What an answer carries beside its statuses, over gRPC on every store: resets in whole
//! seconds, a window with a multiplier reported as the unit it equals, the `RateLimit-*`
//! headers of `--limit-response-headers`, and the dynamic metadata of
//! `--response-dynamic-metadata` in envoyproxy/ratelimit's shape.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::google::protobuf::{UInt64Value, Value, value::Kind};
use serde_json::json;
use support::{OK, OVER_LIMIT, Sluice, Store, request};

on_every_store!(
    resets_are_whole_seconds_of_at_least_one_on_every_algorithm,
    a_window_with_a_multiplier_is_reported_as_the_unit_it_equals_else_unknown,
    limit_headers_carry_the_least_remaining_limit_then_the_one_that_denied,
    dynamic_metadata_carries_the_request_and_the_merged_metadata_of_the_rules_that_passed,
);

const RULES: &str = r#"
domain: ans
descriptors:
  - key: fixed
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: sliding
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: sliding_log}
  - key: token
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket}
  - key: leaky
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: leaky_bucket}
  - key: sixty_seconds
    rate_limit: {unit: second, unit_multiplier: 60, requests_per_unit: 10}
  - key: seven_days
    rate_limit: {unit: day, unit_multiplier: 7, requests_per_unit: 10}
  - key: five_minutes
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 10}
  - key: wide
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: narrow
    rate_limit: {unit: hour, requests_per_unit: 3}
"#;

const METADATA_RULES: &str = r#"
domain: meta
descriptors:
  - key: team
    metadata: {owner: web, tier: {level: gold, region: eu}}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: plan
    metadata: {owner: billing, tier: {level: silver, zone: a}, extra: [1, true]}
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: spent
    quota_mode: true
    metadata: {spent: true}
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: left
    quota_mode: true
    metadata: {left: true}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: overridden
    metadata: {overridden: true}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: free
    metadata: {free: true}
    rate_limit: {unlimited: true}
"#;

async fn resets_are_whole_seconds_of_at_least_one_on_every_algorithm(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for key in ["fixed", "sliding", "log", "token", "leaky"] {
        // Admitted, then (at most a few hits later) denied: both report whole seconds, rounded
        // up: 1 for what frees within the second (a sliding window's denial may wait for the
        // first millisecond of the next).
        for _ in 0..12 {
            let r = sluice.ask(request("ans", &[&[(key, "v")]])).await;
            let reset = r.statuses[0].duration_until_reset.expect("a reset");
            assert!(
                (1..=2).contains(&reset.seconds) && reset.nanos == 0,
                "{key}: a per-second limit resets in whole seconds: {r:?}"
            );
            if r.overall_code == OVER_LIMIT {
                break;
            }
        }
    }
}

async fn a_window_with_a_multiplier_is_reported_as_the_unit_it_equals_else_unknown(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    for (key, unit) in [
        ("sixty_seconds", Unit::Minute),
        ("seven_days", Unit::Week),
        ("five_minutes", Unit::Unknown),
    ] {
        let r = sluice.ask(request("ans", &[&[(key, "v")]])).await;
        let limit = r.statuses[0].current_limit.as_ref().expect("a limit");
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (10, unit as i32),
            "{key}"
        );
    }
}

/// The value of header `name` in `r`'s `response_headers_to_add`.
fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// (limit, remaining, reset) of the `RateLimit-*` headers.
fn limit_headers(r: &RateLimitResponse) -> (Option<&str>, Option<&str>, u64) {
    let reset = header(r, "RateLimit-Reset").map_or(0, |v| v.parse().expect("whole seconds"));
    (
        header(r, "RateLimit-Limit"),
        header(r, "RateLimit-Remaining"),
        reset,
    )
}

async fn limit_headers_carry_the_least_remaining_limit_then_the_one_that_denied(store: Store) {
    let sluice = Sluice::on(
        store,
        &[("rules.yaml", RULES)],
        &["--limit-response-headers"],
    )
    .await;
    let both = || request("ans", &[&[("wide", "w")], &[("narrow", "n")]]);
    for left in ["2", "1", "0"] {
        let r = sluice.ask(both()).await;
        assert_eq!(r.overall_code, OK);
        let (limit, remaining, reset) = limit_headers(&r);
        assert_eq!((limit, remaining), (Some("3"), Some(left)), "{r:?}");
        assert!((1..=3600).contains(&reset), "{r:?}");
        assert_eq!(
            header(&r, "retry-after"),
            None,
            "only a denial says when to retry"
        );
    }
    // `narrow` denies: its numbers are sent, whatever comes after it.
    let r = sluice
        .ask(request("ans", &[&[("narrow", "n")], &[("wide", "w")]]))
        .await;
    assert_eq!(r.overall_code, OVER_LIMIT);
    let (limit, remaining, reset) = limit_headers(&r);
    assert_eq!((limit, remaining), (Some("3"), Some("0")), "{r:?}");
    assert_eq!(
        header(&r, "retry-after"),
        Some(reset.to_string().as_str()),
        "retry-after is sent as before, the same whole seconds"
    );
    let r = sluice.ask(request("ans", &[&[("unknown", "u")]])).await;
    assert!(
        r.response_headers_to_add.is_empty(),
        "no limited descriptor, no headers: {r:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn limit_header_names_are_configurable_and_absent_without_the_flag() {
    let renamed = Sluice::start_with(
        &[("rules.yaml", RULES)],
        &[
            "--limit-response-headers",
            "--limit-limit-header",
            "X-Limit",
            "--limit-remaining-header",
            "X-Left",
            "--limit-reset-header",
            "X-Reset",
        ],
    )
    .await;
    let r = renamed.ask(request("ans", &[&[("wide", "w")]])).await;
    let keys: Vec<&str> = r
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert_eq!(keys, ["X-Limit", "X-Left", "X-Reset"]);
    assert_eq!(header(&r, "X-Limit"), Some("10"));

    let plain = Sluice::start(RULES).await;
    let r = plain.ask(request("ans", &[&[("wide", "w")]])).await;
    assert!(r.response_headers_to_add.is_empty(), "{r:?}");
    assert_eq!(r.dynamic_metadata, None);
}

fn to_json(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::ListValue(l)) => l.values.iter().map(to_json).collect(),
        Some(Kind::StructValue(s)) => s
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), to_json(v)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
    }
}

fn metadata_of(r: &RateLimitResponse) -> serde_json::Value {
    let s = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    to_json(&Value {
        kind: Some(Kind::StructValue(s.clone())),
    })
}

async fn dynamic_metadata_carries_the_request_and_the_merged_metadata_of_the_rules_that_passed(
    store: Store,
) {
    let sluice = Sluice::on(
        store,
        &[("rules.yaml", METADATA_RULES)],
        &["--response-dynamic-metadata"],
    )
    .await;
    let mut r = request(
        "meta",
        &[
            &[("team", "t")],
            &[("plan", "p")],
            &[("spent", "s")],
            &[("left", "l")],
            &[("overridden", "o")],
            &[("free", "f")],
        ],
    );
    r.hits_addend = 2;
    r.descriptors[1].hits_addend = Some(UInt64Value { value: 1 });
    r.descriptors[4].limit = Some(
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
            requests_per_unit: 42,
            unit: Unit::Hour as i32,
        },
    );
    let answer = sluice.ask(r).await;
    assert_eq!(
        answer.overall_code, OK,
        "one of two quota descriptors is over: admitted"
    );
    assert_eq!(answer.statuses[2].code, OVER_LIMIT, "{answer:?}");
    assert_eq!(
        metadata_of(&answer),
        json!({
            "domain": "meta",
            "descriptors": [
                {"entries": ["team=t"]},
                {"entries": ["plan=p"], "hitsAddend": 1.0},
                {"entries": ["spent=s"]},
                {"entries": ["left=l"]},
                {"entries": ["overridden=o"], "limit": "requests_per_unit:42 unit:HOUR"},
                {"entries": ["free=f"]},
            ],
            "hitsAddend": 2.0,
            "metadata": {
                "owner": "web",
                "tier": {"level": "gold", "region": "eu", "zone": "a"},
                "extra": [1.0, true],
                "left": true,
            },
        }),
        "the quota rule over its limit, the overridden rule and the unlimited one add nothing"
    );

    let denied = sluice
        .ask(request("meta", &[&[("spent", "s")], &[("team", "t")]]))
        .await;
    assert_eq!(denied.overall_code, OVER_LIMIT);
    assert_eq!(
        metadata_of(&denied),
        json!({
            "domain": "meta",
            "descriptors": [{"entries": ["spent=s"]}, {"entries": ["team=t"]}],
            "metadata": {"owner": "web", "tier": {"level": "gold", "region": "eu"}},
        }),
        "a denied request still carries what passed"
    );
}
