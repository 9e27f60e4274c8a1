//! `/ui`, the admin console, as served: the page, its script and its style from the binary, with
//! a Content-Security-Policy that lets nothing run or load from elsewhere; every value set as
//! text; `/status`, what it shows of the store and the replicas.

use support::envoy::header;
use support::{Sluice, http};

const RULES: &str =
    "domain: web\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

#[tokio::test]
async fn the_page_and_its_assets_come_from_the_binary_under_a_policy_that_allows_nothing_else() {
    let sluice = Sluice::start(RULES).await;
    for (path, content_type) in [
        ("/ui", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let (status, headers, body) = http(sluice.http, "GET", path, "");
        assert_eq!(status, 200, "{path}: {body}");
        assert!(
            header(&headers, "content-type").is_some_and(|t| t.starts_with(content_type)),
            "{path}: {headers:?}"
        );
        let policy = header(&headers, "content-security-policy").unwrap_or_default();
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(policy.contains(directive), "{path}: {policy}");
        }
        assert!(!policy.contains("unsafe"), "{path}: {policy}");
        assert_eq!(header(&headers, "x-content-type-options"), Some("nosniff"));
    }
    let (_, _, page) = http(sluice.http, "GET", "/ui", "");
    assert!(page.contains(r#"<script src="/ui/app.js" defer></script>"#));
    assert_eq!(page.matches("<script").count(), 1, "no inline script");
    assert!(!page.contains("style="), "no inline style");
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "nothing from elsewhere"
    );
    let (_, _, index) = http(sluice.http, "GET", "/", "");
    assert!(index.contains("GET /ui:"), "{index}");
}

/// What a client sent reaches the page only as text: the script never writes markup.
#[test]
fn the_script_sets_values_as_text_only() {
    let script = include_str!("../../src/service/ui/app.js");
    for markup in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!script.contains(markup), "{markup}");
    }
}

#[tokio::test]
async fn status_tells_the_store_and_the_rules_in_force() {
    let sluice = Sluice::start(RULES).await;
    let (status, _, body) = http(sluice.http, "GET", "/status", "");
    assert_eq!(status, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["store"]["kind"], "memory", "{status}");
    assert_eq!(status["store"]["reachable"], true, "{status}");
    assert!(status["store"]["live_counters"].is_u64(), "{status}");
    assert!(status["store"]["breakers_open"].is_null(), "{status}");
    assert_eq!(status["quota"]["rules"], serde_json::json!([]), "{status}");
    let (_, _, config) = http(sluice.http, "GET", "/config", "");
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(status["rules_hash"], config["hash"]);
}

/// `/status` tells when each calendar window ends, which the console shows beside its rule.
#[tokio::test]
async fn status_tells_when_each_calendar_window_ends() {
    let rules = "domain: web\ndescriptors:\n  - key: day\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: true}\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let sluice = Sluice::start(rules).await;
    let (_, _, body) = http(sluice.http, "GET", "/status", "");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ends = status["calendar_ends"].as_array().expect("calendar_ends");
    assert_eq!(ends.len(), 1, "{status}");
    assert_eq!(ends[0]["domain"], "web");
    assert_eq!(ends[0]["rule"], "day");
    let end_ms = ends[0]["ends_ms"].as_u64().unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        end_ms > now_ms && end_ms <= now_ms + 86_400_000,
        "{end_ms} against {now_ms}"
    );
    assert_eq!(end_ms % 86_400_000, 0, "a UTC day ends at midnight");
}
