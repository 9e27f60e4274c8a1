//! envoyproxy/ratelimit's README examples 1–11 ("Configuration" → "Examples"), each rule file as
//! that README gives it, asked what that README says about it, on the embedded store and on a
//! real Redis. Where sluice answers differently on purpose (a denied request consumes nothing),
//! the test says so. A test counting against a limit of a second asks through `/json` at one
//! instant it chooses, so that no second ends between its requests.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use support::metrics::scrape;
use support::{OK, OVER_LIMIT, Sluice, Store, http, request, unix_ms};

on_stores!(
    memory: Memory, redis: Redis;
    example_1_each_database_gets_500_per_second,
    example_2_nested_and_several_descriptors_limit_messages_per_number,
    example_3_an_exact_value_beats_the_key_alone,
    example_4_a_descriptor_matches_rules_only_at_its_own_depth,
    example_5_unlimited_is_ok_with_the_largest_remaining,
    example_6_shadow_mode_never_denies_and_counts_the_breach,
    example_7_replaces_drops_the_named_limit_and_leaves_its_counter_alone,
    example_8_detailed_metric_names_metrics_by_the_request_value,
    example_9_wildcards_match_anywhere_in_the_value,
    example_10_value_to_metric_names_metrics_by_request_values,
    example_11_share_threshold_shares_one_counter_per_pattern,
);

/// A descriptor's entries.
type Entries<'a> = &'a [(&'a str, &'a str)];

/// Asks about `descriptors` of `domain` with `hits` hits (0: Envoy's default, one hit).
async fn ask(
    sluice: &Sluice,
    domain: &str,
    descriptors: &[Entries<'_>],
    hits: u32,
) -> RateLimitResponse {
    let mut r = request(domain, descriptors);
    r.hits_addend = hits;
    sluice.ask(r).await
}

/// An instant (RFC 3339) an hour from now: every request of a test asked `at` it counts in the
/// same window, wherever the wall clock is.
fn an_hour_ahead() -> String {
    jiff::Timestamp::from_millisecond((unix_ms() + 3_600_000) as i64)
        .expect("a valid instant")
        .to_string()
}

/// Asks as `ask` does, through `/json` counting at the instant `at`; the answer's statuses as
/// gRPC would carry them.
fn ask_at(
    sluice: &Sluice,
    at: &str,
    domain: &str,
    descriptors: &[Entries<'_>],
    hits: u32,
) -> RateLimitResponse {
    let descriptors: Vec<_> = descriptors
        .iter()
        .map(|entries| {
            let entries: Vec<_> = entries
                .iter()
                .map(|(key, value)| serde_json::json!({"key": key, "value": value}))
                .collect();
            serde_json::json!({ "entries": entries })
        })
        .collect();
    let body = serde_json::json!({
        "domain": domain, "descriptors": descriptors, "hitsAddend": hits, "at": at,
    });
    let (status, _, body) = http(sluice.http, "POST", "/json", &body.to_string());
    assert!(
        status == 200 || status == 429,
        "/json answered {status}: {body}"
    );
    let json: serde_json::Value = serde_json::from_str(&body).expect("a JSON answer");
    let code = |v: &serde_json::Value| {
        Code::from_str_name(v.as_str().unwrap_or("UNKNOWN")).expect("a code") as i32
    };
    let statuses = json["statuses"].as_array().expect("statuses");
    RateLimitResponse {
        overall_code: code(&json["overallCode"]),
        statuses: statuses
            .iter()
            .map(|s| DescriptorStatus {
                code: code(&s["code"]),
                current_limit: s.get("currentLimit").map(|l| RateLimit {
                    requests_per_unit: l["requestsPerUnit"].as_u64().unwrap_or(0) as u32,
                    unit: Unit::from_str_name(l["unit"].as_str().unwrap_or("UNKNOWN"))
                        .expect("a unit") as i32,
                    ..Default::default()
                }),
                // Protobuf JSON leaves out a remaining of 0.
                limit_remaining: s["limitRemaining"].as_u64().unwrap_or(0) as u32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The limit the status of descriptor `i` reports, as (requests per unit, unit).
fn limit(r: &RateLimitResponse, i: usize) -> Option<(u32, Unit)> {
    let l = r.statuses[i].current_limit.as_ref()?;
    Some((l.requests_per_unit, Unit::try_from(l.unit).expect("a unit")))
}

/// The per-rule hits of `rule` in `domain`, 0 when the series is not written.
fn hits(sluice: &Sluice, domain: &str, rule: &str) -> f64 {
    scrape(sluice.http)
        .get(
            "sluice_rule_hits_total",
            &[("domain", domain), ("descriptor", rule)],
        )
        .unwrap_or(0.0)
}

/// Every series of `domain` that has counted hits (a rule's own series is written from the start).
fn rules_with_hits(sluice: &Sluice, domain: &str) -> Vec<String> {
    let prefix = "descriptor=\"";
    let domain_label = format!("domain=\"{domain}\"");
    scrape(sluice.http)
        .samples_of("sluice_rule_hits_total")
        .into_iter()
        .filter(|(labels, count)| labels.contains(&domain_label) && *count > 0.0)
        .filter_map(|(labels, _)| {
            let rule = labels.split(prefix).nth(1)?;
            Some(rule.split('"').next()?.to_owned())
        })
        .collect()
}

const EXAMPLE_1: &str = "
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
";

/// The 500th hit of a second passes, the 501st is over; each value counts apart; another value
/// has no limit.
async fn example_1_each_database_gets_500_per_second(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_1)], &[]).await;
    let at = an_hour_ahead();
    let users: Entries = &[("database", "users")];
    let r = ask_at(&sluice, &at, "mongo_cps", &[users], 499);
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((500, Unit::Second)))
    );
    let r = ask_at(&sluice, &at, "mongo_cps", &[users], 1);
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, 0),
        "the 500th"
    );
    let r = ask_at(&sluice, &at, "mongo_cps", &[users], 1);
    assert_eq!(r.overall_code, OVER_LIMIT, "the 501st");
    let r = ask_at(
        &sluice,
        &at,
        "mongo_cps",
        &[&[("database", "default")]],
        500,
    );
    assert_eq!(r.overall_code, OK, "default has 500 of its own");
    let r = ask_at(&sluice, &at, "mongo_cps", &[&[("database", "other")]], 1000);
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, None),
        "no rule for other"
    );
}

const EXAMPLE_2: &str = "
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
";

/// 5 marketing messages a day to each number, 100 messages a day to each number, asked in one
/// request of two descriptors: the answer is over when either is. Unlike envoyproxy/ratelimit,
/// the denied request does not count against the 100.
async fn example_2_nested_and_several_descriptors_limit_messages_per_number(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_2)], &[]).await;
    let marketing_to = |n| [("message_type", "marketing"), ("to_number", n)];
    let first = marketing_to("2061111111");
    let both: [Entries; 2] = [&first, &[("to_number", "2061111111")]];
    for i in 1..=5 {
        let r = ask(&sluice, "messaging", &both, 0).await;
        assert_eq!(r.overall_code, OK, "marketing message {i}");
        assert_eq!(limit(&r, 0), Some((5, Unit::Day)));
        assert_eq!(limit(&r, 1), Some((100, Unit::Day)));
    }
    let r = ask(&sluice, "messaging", &both, 0).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].code, r.statuses[1].code),
        (OVER_LIMIT, OVER_LIMIT, OK),
        "the sixth marketing message"
    );
    let second = marketing_to("2062222222");
    let r = ask(&sluice, "messaging", &[&second], 5).await;
    assert_eq!(r.overall_code, OK, "another number has its own 5");
    let r = ask(&sluice, "messaging", &[&[("to_number", "2061111111")]], 0).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, 94),
        "5 marketing messages and this one: the denied sixth consumed nothing"
    );
}

const EXAMPLE_3: &str = "
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
";

/// Any address gets 10 a second; 50.0.0.5, named exactly, gets none, though it is listed after
/// the key-only rule.
async fn example_3_an_exact_value_beats_the_key_alone(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_3)], &[]).await;
    let r = ask(
        &sluice,
        "edge_proxy_per_ip",
        &[&[("remote_address", "50.0.0.1")]],
        0,
    )
    .await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((10, Unit::Second)))
    );
    let r = ask(
        &sluice,
        "edge_proxy_per_ip",
        &[&[("remote_address", "50.0.0.5")]],
        0,
    )
    .await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((0, Unit::Second)))
    );
}

const EXAMPLE_4_FLAT: &str = "
domain: example4
descriptors:
  - key: key
    value: value
    rate_limit:
      requests_per_unit: 300
      unit: second
";

const EXAMPLE_4_NESTED: &str = "
domain: example4
descriptors:
  - key: key
    value: value
    descriptors:
      - key: subkey
        rate_limit:
          requests_per_unit: 300
          unit: second
";

/// A descriptor of two entries matches no rule one level deep, and the nested rule.
async fn example_4_a_descriptor_matches_rules_only_at_its_own_depth(store: Store) {
    let two: Entries = &[("key", "value"), ("subkey", "subvalue")];
    let flat = Sluice::on(store, &[("example.yaml", EXAMPLE_4_FLAT)], &[]).await;
    let r = ask(&flat, "example4", &[two], 0).await;
    assert_eq!((r.overall_code, limit(&r, 0)), (OK, None));
    let r = ask(&flat, "example4", &[&[("key", "value")]], 0).await;
    assert_eq!(
        limit(&r, 0),
        Some((300, Unit::Second)),
        "one entry matches it"
    );
    let nested = Sluice::on(store, &[("example.yaml", EXAMPLE_4_NESTED)], &[]).await;
    let r = ask(&nested, "example4", &[two], 0).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((300, Unit::Second)))
    );
}

const EXAMPLE_5: &str = "
domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true

  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
";

/// An unlimited descriptor is OK with `limit_remaining` 4294967295, however many hits; the other
/// rule limits as usual.
async fn example_5_unlimited_is_ok_with_the_largest_remaining(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_5)], &[]).await;
    let r = ask(&sluice, "internal", &[&[("ldap", "x")]], 1_000_000).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, u32::MAX)
    );
    let r = ask(&sluice, "internal", &[&[("azure", "x")]], 101).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((100, Unit::Minute)))
    );
}

const EXAMPLE_6: &str = "
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
";

/// user-a is never limited, but the breach of its 10 a second is counted; user-b is limited to
/// 20 a second.
async fn example_6_shadow_mode_never_denies_and_counts_the_breach(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_6)], &[]).await;
    let user = |u| [("service", "auth-service"), ("user", u)];
    let r = ask(&sluice, "example6", &[&user("user-a")], 11).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((10, Unit::Second)))
    );
    let r = ask(&sluice, "example6", &[&user("user-b")], 21).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((20, Unit::Second)))
    );
    let shadow = scrape(sluice.http).get(
        "sluice_rule_shadow_mode_total",
        &[
            ("domain", "example6"),
            ("descriptor", "service.user_user-a"),
        ],
    );
    assert_eq!(shadow, Some(11.0));
}

const EXAMPLE_7: &str = "
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
";

/// Asked together, only the replacing 10 a second applies and the replaced limit's counter does
/// not move; asked alone, each descriptor has its own limit.
async fn example_7_replaces_drops_the_named_limit_and_leaves_its_counter_alone(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_7)], &[]).await;
    let at = an_hour_ahead();
    let specific: Entries = &[("key_1", "value_1"), ("user", "bkthomps")];
    let replacing: Entries = &[("key_2", "value_2"), ("user", "bkthomps")];
    let r = ask_at(&sluice, &at, "example7", &[specific, replacing], 6);
    assert_eq!(
        r.overall_code, OK,
        "6 hits fit 10 a second; the 5 a second is replaced"
    );
    assert_eq!(limit(&r, 0), None);
    assert_eq!(limit(&r, 1), Some((10, Unit::Second)));
    let r = ask_at(&sluice, &at, "example7", &[specific], 5);
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((5, Unit::Second))),
        "the replaced limit's 5 are all left"
    );
    let r = ask_at(&sluice, &at, "example7", &[replacing], 5);
    assert_eq!(r.overall_code, OVER_LIMIT, "6 + 5 is over 10 a second");
}

const EXAMPLE_8: &str = "
domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: key1
    value: value1
    rate_limit:
      unit: minute
      requests_per_unit: 20
";

/// Metrics of `key1_unspecified_value`, `key1_unspecified_value2` and `key1_value1`, not `key1`.
async fn example_8_detailed_metric_names_metrics_by_the_request_value(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_8)], &[]).await;
    for (value, expected) in [
        ("unspecified_value", 10),
        ("unspecified_value2", 10),
        ("value1", 20),
    ] {
        let r = ask(&sluice, "example8", &[&[("key1", value)]], 0).await;
        assert_eq!(limit(&r, 0), Some((expected, Unit::Minute)), "{value}");
    }
    let mut rules = rules_with_hits(&sluice, "example8");
    rules.sort();
    assert_eq!(
        rules,
        [
            "key1_unspecified_value",
            "key1_unspecified_value2",
            "key1_value1"
        ]
    );
}

const EXAMPLE_9: &str = "
domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: path
    value: /api/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: route
    value: /api/*/resource/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 20
";

/// The README's three snippets of `example9`, in one file: a trailing, a middle and several
/// wildcards.
async fn example_9_wildcards_match_anywhere_in_the_value(store: Store) {
    let sluice = Sluice::on(store, &[("example.yaml", EXAMPLE_9)], &[]).await;
    for (key, value, matches) in [
        ("key1", "value1", true),
        ("key1", "value2", true),
        ("key1", "valueXYZ", true),
        ("key1", "other", false),
        ("path", "/api/123/action", true),
        ("path", "/api/user-id/action", true),
        ("path", "/api/123/other", false),
        ("route", "/api/v1/resource/123/action", true),
        ("route", "/api/v2/resource/456/action", true),
        ("route", "/api/v1/other/123/action", false),
    ] {
        let r = ask(&sluice, "example9", &[&[(key, value)]], 0).await;
        let expected = matches.then_some((20, Unit::Minute));
        assert_eq!(limit(&r, 0), expected, "{key}={value}");
    }
}

const EXAMPLE_10: &str = "
domain: example10
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit:
              unit: minute
              requests_per_unit: 60
";

const EXAMPLE_10_WILDCARD: &str = "
domain: example10_wildcard
descriptors:
  - key: user
    value_to_metric: true
    descriptors:
      - key: action
        value: read*
        value_to_metric: true
        descriptors:
          - key: resource
            rate_limit:
              unit: minute
              requests_per_unit: 100
";

/// `route_api.http_method_GET.subject_id`, `route_web.http_method_POST.subject_id`, and with a
/// wildcard the whole request value: `user_alice.action_readfile.resource`.
async fn example_10_value_to_metric_names_metrics_by_request_values(store: Store) {
    let sluice = Sluice::on(
        store,
        &[
            ("example10.yaml", EXAMPLE_10),
            ("wildcard.yaml", EXAMPLE_10_WILDCARD),
        ],
        &[],
    )
    .await;
    for (route, method, subject) in [("api", "GET", "123"), ("web", "POST", "456")] {
        let entries = [
            ("route", route),
            ("http_method", method),
            ("subject_id", subject),
        ];
        let r = ask(&sluice, "example10", &[&entries], 0).await;
        assert_eq!(limit(&r, 0), Some((60, Unit::Minute)));
    }
    let entries = [
        ("user", "alice"),
        ("action", "readfile"),
        ("resource", "documents"),
    ];
    let r = ask(&sluice, "example10_wildcard", &[&entries], 0).await;
    assert_eq!(limit(&r, 0), Some((100, Unit::Minute)));
    assert_eq!(
        hits(&sluice, "example10", "route_api.http_method_GET.subject_id"),
        1.0
    );
    assert_eq!(
        hits(
            &sluice,
            "example10",
            "route_web.http_method_POST.subject_id"
        ),
        1.0
    );
    assert_eq!(
        hits(
            &sluice,
            "example10_wildcard",
            "user_alice.action_readfile.resource"
        ),
        1.0
    );
}

const EXAMPLE_11: &str = "
domain: example11
descriptors:
  # With share_threshold: true, all files/* matches share the same threshold
  - key: files
    value: files/*
    share_threshold: true
    rate_limit:
      unit: hour
      requests_per_unit: 10

  # Without share_threshold, each files_no_share/* match has its own isolated threshold
  - key: files_no_share
    value: files_no_share/*
    share_threshold: false
    rate_limit:
      unit: hour
      requests_per_unit: 10
";

const EXAMPLE_11_METRICS: &str = "
domain: example11_metrics
descriptors:
  - key: route
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit:
          unit: minute
          requests_per_unit: 60
";

/// 5 requests for `files/a.pdf` and 5 for `files/b.csv` leave none for `files/c.txt`; 10 for
/// `files_no_share/a.pdf` leave `files_no_share/b.csv` its own 10. The metric of
/// `route=api/v1, method=GET` is named `route_api/*.method`: the README says `route_api.method_GET`,
/// but envoyproxy/ratelimit's code and its config tests name it so (the pattern, whole; `method`
/// without `value_to_metric` has no value), and sluice follows the code.
async fn example_11_share_threshold_shares_one_counter_per_pattern(store: Store) {
    let sluice = Sluice::on(
        store,
        &[
            ("example11.yaml", EXAMPLE_11),
            ("metrics.yaml", EXAMPLE_11_METRICS),
        ],
        &[],
    )
    .await;
    for file in ["files/a.pdf", "files/b.csv"] {
        for _ in 0..5 {
            let r = ask(&sluice, "example11", &[&[("files", file)]], 0).await;
            assert_eq!(r.overall_code, OK, "{file}");
        }
    }
    let r = ask(&sluice, "example11", &[&[("files", "files/c.txt")]], 0).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((10, Unit::Hour)))
    );
    for _ in 0..10 {
        let r = ask(
            &sluice,
            "example11",
            &[&[("files_no_share", "files_no_share/a.pdf")]],
            0,
        )
        .await;
        assert_eq!(r.overall_code, OK);
    }
    let a = ask(
        &sluice,
        "example11",
        &[&[("files_no_share", "files_no_share/a.pdf")]],
        0,
    )
    .await;
    assert_eq!(a.overall_code, OVER_LIMIT);
    for _ in 0..10 {
        let r = ask(
            &sluice,
            "example11",
            &[&[("files_no_share", "files_no_share/b.csv")]],
            0,
        )
        .await;
        assert_eq!(r.overall_code, OK, "b.csv has its own 10");
    }
    let entries = [("route", "api/v1"), ("method", "GET")];
    let r = ask(&sluice, "example11_metrics", &[&entries], 0).await;
    assert_eq!(limit(&r, 0), Some((60, Unit::Minute)));
    assert_eq!(
        rules_with_hits(&sluice, "example11_metrics"),
        ["route_api/*.method"]
    );
}
