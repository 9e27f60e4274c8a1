//! End-to-end test with a real Envoy in front of sluice: Envoy's global rate limit filter asks
//! sluice over gRPC for every request to a local upstream and answers 429 once the limit is reached.
//! Needs the Envoy binary: `scripts/test` installs it, or `SLUICE_ENVOY=/path/to/envoy`.

use std::time::Duration;

use support::envoy::{
    Envoy, Filter, UPSTREAM_BODY, Upstream, envoy_binary, get_with_headers, header,
};
use support::{HOUR, Sluice, http, in_one_window};

/// Five requests per hour; a test counting them runs `in_one_window` of an hour.
const LIMIT: u32 = 5;
const WINDOW_SECS: u64 = 3600;
const RULES: &str = "\
domain: e2e
descriptors:
  - key: generic_key
    value: e2e
    rate_limit:
      unit: hour
      requests_per_unit: 5
";

/// One `generic_key: e2e` descriptor for every request; a request sluice does not answer is
/// denied.
const FILTER: Filter = Filter {
    domain: "e2e",
    actions: &["generic_key: { descriptor_value: e2e }"],
    failure_mode_deny: true,
    timeout: Duration::from_secs(5),
};

#[tokio::test(flavor = "multi_thread")]
async fn envoy_answers_429_with_ratelimit_headers_once_the_limit_is_reached() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let sluice = Sluice::start(RULES).await;
        let upstream = Upstream::start();
        let envoy = Envoy::start(&binary, upstream.addr, sluice.grpc, &FILTER);

        let served_before = upstream.served();
        for expected_remaining in (0..LIMIT).rev() {
            let (status, headers, body) = http(envoy.listener, "GET", "/", "");
            assert_eq!(
                status, 200,
                "request with {expected_remaining} left: {headers:?} {body}"
            );
            assert_eq!(body, UPSTREAM_BODY, "the answer comes from the upstream");
            assert_eq!(
                header(&headers, "x-ratelimit-limit"),
                Some(limit_header().as_str())
            );
            assert_eq!(
                header(&headers, "x-ratelimit-remaining"),
                Some(expected_remaining.to_string().as_str())
            );
            assert_reset_within_window(&headers);
            assert_eq!(header(&headers, "x-envoy-ratelimited"), None);
        }
        for _ in 0..3 {
            let (status, headers, body) = http(envoy.listener, "GET", "/", "");
            assert_eq!(status, 429, "request over the limit: {headers:?} {body}");
            // Envoy sets this header only on the 429 its rate limit filter sends after an OVER_LIMIT.
            assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
            assert_eq!(
                header(&headers, "x-ratelimit-limit"),
                Some(limit_header().as_str())
            );
            assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("0"));
            assert_reset_within_window(&headers);
        }
        assert_eq!(
            upstream.served() - served_before,
            LIMIT as usize,
            "only the admitted requests reach the upstream"
        );

        // Envoy's own counters confirm every decision came from sluice, none from a failure.
        let stats = envoy.ratelimit_stats();
        assert_eq!(stats.get("ok"), Some(&(LIMIT as u64)), "{stats:?}");
        assert_eq!(stats.get("over_limit"), Some(&3), "{stats:?}");
        assert_eq!(stats.get("error").copied().unwrap_or(0), 0, "{stats:?}");
        assert_eq!(
            stats.get("failure_mode_allowed").copied().unwrap_or(0),
            0,
            "{stats:?}"
        );
    })
    .await;
}

/// The DRAFT_VERSION_03 `x-ratelimit-limit` value for the rule: the limit, then its policy.
fn limit_header() -> String {
    format!("{LIMIT}, {LIMIT};w={WINDOW_SECS}")
}

fn assert_reset_within_window(headers: &[(String, String)]) {
    let reset: u64 = header(headers, "x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a numeric x-ratelimit-reset: {headers:?}"));
    assert!(
        (1..=WINDOW_SECS).contains(&reset),
        "x-ratelimit-reset {reset} lies within the window"
    );
}

const ANSWERS_RULES: &str = "\
domain: answers
descriptors:
  - key: rule
    value: per_second
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: rule
    value: five_minutes
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 10}
  - key: rule
    value: sixty_minutes
    rate_limit: {unit: minute, unit_multiplier: 60, requests_per_unit: 10}
  - key: rule
    value: hourly
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: rule
    value: seven_days
    rate_limit: {unit: day, unit_multiplier: 7, requests_per_unit: 10}
  - key: rule
    value: thirty_days
    rate_limit: {unit: day, unit_multiplier: 30, requests_per_unit: 10}
";

/// A `rule` descriptor from the request's `x-rule` header.
const ANSWERS_FILTER: Filter = Filter {
    domain: "answers",
    actions: &["request_headers: { header_name: x-rule, descriptor_key: rule }"],
    failure_mode_deny: true,
    timeout: Duration::from_secs(5),
};

/// A GET of `/` asking about `rule`.
fn get_rule(envoy: &Envoy, rule: &str) -> (u16, Vec<(String, String)>) {
    let (status, headers, _) =
        get_with_headers(envoy.listener, "/", &[("x-rule", rule.as_bytes())]);
    (status, headers)
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_shows_whole_second_resets_and_states_no_window_a_multiplier_would_falsify() {
    let binary = envoy_binary();
    let sluice = Sluice::start(ANSWERS_RULES).await;
    let upstream = Upstream::start();
    let envoy = Envoy::start(&binary, upstream.addr, sluice.grpc, &ANSWERS_FILTER);

    let (status, headers) = get_rule(&envoy, "per_second");
    assert_eq!(status, 200, "{headers:?}");
    assert_eq!(header(&headers, "x-ratelimit-limit"), Some("5, 5;w=1"));
    assert_eq!(
        header(&headers, "x-ratelimit-reset"),
        Some("1"),
        "a fraction of a second left reads as 1 s, not 0"
    );

    let (_, headers) = get_rule(&envoy, "five_minutes");
    assert_eq!(
        header(&headers, "x-ratelimit-limit"),
        Some("10"),
        "a 5-minute window is no unit Envoy knows: no `w=` rather than `w=60`"
    );
    let (_, headers) = get_rule(&envoy, "sixty_minutes");
    assert_eq!(
        header(&headers, "x-ratelimit-limit"),
        Some("10, 10;w=3600"),
        "60 minutes are an hour"
    );
    let (_, headers) = get_rule(&envoy, "seven_days");
    assert_eq!(
        header(&headers, "x-ratelimit-limit"),
        Some("10, 10;w=604800"),
        "7 days are a week"
    );
    let (_, headers) = get_rule(&envoy, "thirty_days");
    assert_eq!(
        header(&headers, "x-ratelimit-limit"),
        Some("10, 10;w=2592000"),
        "30 days are a month"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_sends_the_limit_response_headers_on_to_the_client() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let sluice = Sluice::start_with(
            &[("rules.yaml", ANSWERS_RULES)],
            &["--limit-response-headers"],
        )
        .await;
        let upstream = Upstream::start();
        let envoy = Envoy::start(&binary, upstream.addr, sluice.grpc, &ANSWERS_FILTER);

        for (expected_status, remaining) in [(200, "1"), (200, "0"), (429, "0")] {
            let (status, headers) = get_rule(&envoy, "hourly");
            assert_eq!(status, expected_status, "{headers:?}");
            assert_eq!(
                header(&headers, "ratelimit-limit"),
                Some("2"),
                "{headers:?}"
            );
            assert_eq!(header(&headers, "ratelimit-remaining"), Some(remaining));
            let reset: u64 = header(&headers, "ratelimit-reset")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("a numeric ratelimit-reset: {headers:?}"));
            assert!((1..=3600).contains(&reset), "{headers:?}");
            if status == 429 {
                assert_eq!(
                    header(&headers, "retry-after"),
                    Some(reset.to_string().as_str())
                );
            }
        }
    })
    .await;
}
