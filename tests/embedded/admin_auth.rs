//! The admin token (`--admin-token-file`): `/top`, `/explain` and `/json` answer 401 without it,
//! or with another, and move no counter; with it they answer; the probes, `/metrics` and
//! `/config` stay open; a new token written to the file is in force within seconds, and the old
//! one no longer; without a token, the start warns that the admin endpoints are open.

use super::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Sluice, exchange, http};

const RULES: &str =
    "domain: web\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
const BODY: &str = r#"{"domain":"web","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;

/// `method path` with `body`, asked with `Authorization: Bearer <token>`: the status and body.
fn with_token(
    addr: SocketAddr,
    token: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, _, text) = exchange(addr, request.as_bytes());
    (status, text)
}

const GUARDED: [(&str, &str, &str); 3] = [
    ("GET", "/top", ""),
    ("POST", "/explain", BODY),
    ("POST", "/json", BODY),
];

#[tokio::test(flavor = "multi_thread")]
async fn the_guarded_endpoints_answer_only_with_the_token_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, "first-token\n").unwrap();
    let path = file.display().to_string();
    let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--admin-token-file", &path]).await;
    for (method, path, body) in GUARDED {
        let (status, headers, text) = http(sluice.http, method, path, body);
        assert_eq!(status, 401, "{method} {path} without the token: {text}");
        assert!(
            headers
                .iter()
                .any(|(k, v)| k.eq_ignore_ascii_case("www-authenticate") && v.starts_with("Bearer")),
            "{headers:?}"
        );
        let (status, _) = with_token(sluice.http, "first-tokem", method, path, body);
        assert_eq!(status, 401, "{method} {path} with another token");
    }
    for path in ["/healthz", "/readyz", "/metrics", "/config", "/"] {
        assert_eq!(
            http(sluice.http, "GET", path, "").0,
            200,
            "{path} stays open"
        );
    }
    for (method, path, body) in GUARDED {
        let (status, text) = with_token(sluice.http, "first-token", method, path, body);
        assert_eq!(status, 200, "{method} {path} with the token: {text}");
        if path == "/json" {
            // The refused calls moved nothing: this is the first to count.
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(answer["statuses"][0]["limitRemaining"], 1, "{answer}");
        }
    }

    std::fs::write(&file, "second-token\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while with_token(sluice.http, "second-token", "GET", "/top", "").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "the new token is in force within seconds"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        with_token(sluice.http, "first-token", "GET", "/top", "").0,
        401,
        "the old token no longer"
    );
    // A file emptied by mistake leaves the token in force.
    std::fs::write(&file, "").unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        with_token(sluice.http, "second-token", "GET", "/top", "").0,
        200
    );
    assert!(
        sluice.log_text().contains("admin token not reloaded"),
        "{}",
        sluice.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_the_start_warns_that_the_admin_endpoints_are_open() {
    let sluice = Sluice::start(RULES).await;
    assert_eq!(http(sluice.http, "GET", "/top", "").0, 200);
    assert!(
        sluice
            .log_text()
            .contains("the admin endpoints are open to anyone who reaches them"),
        "{}",
        sluice.log_text()
    );
    let no_json = Sluice::start_with(&[("rules.yaml", RULES)], &["--json-addr", "off"]).await;
    assert!(
        no_json
            .log_text()
            .contains("/counters resets and sets counters, /top"),
        "no /json, but /counters moves counters: {}",
        no_json.log_text()
    );
}
