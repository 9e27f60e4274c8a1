//! Who may use the admin port. The admin token (`--admin-token-file`): `/top`, `/explain` and
//! `/json` answer 401 without it, or with another, and move no counter; with it they answer; the
//! probes, `/metrics` and `/config` stay open; a new token written to the file is in force within
//! seconds, and the old one no longer. A refused token is counted, logged and makes its peer wait
//! a second (429, unchecked, meanwhile); a short token warns. Without a token the start warns
//! that the admin endpoints are open, and `/counters` changes nothing (403) unless the port is
//! declared trusted (`--trust-admin-port`): a client cannot reset its own limit.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::metrics::scrape;
use support::{Sluice, exchange, http};

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

/// Waits out the second a peer refused the token waits before it is checked again.
async fn cool_down() {
    tokio::time::sleep(Duration::from_millis(1_100)).await;
}

const GUARDED: [(&str, &str, &str); 4] = [
    ("GET", "/top", ""),
    ("GET", "/status", ""),
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
        cool_down().await;
        let (status, _) = with_token(sluice.http, "first-tokem", method, path, body);
        assert_eq!(status, 401, "{method} {path} with another token");
        cool_down().await;
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
    // Refused (401), then unchecked (429) for a second after each refusal, until it is in force.
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
    cool_down().await;
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
            .contains("the admin endpoints are open to anyone who reaches them: /counters shows counters and changes none, /json charges them"),
        "{}",
        sluice.log_text()
    );
    let trusted = Sluice::start_with(
        &[("rules.yaml", RULES)],
        &["--json-addr", "off", "--trust-admin-port"],
    )
    .await;
    assert!(
        trusted
            .log_text()
            .contains("/counters resets and sets counters (--trust-admin-port), /top"),
        "no /json, but /counters moves counters: {}",
        trusted.log_text()
    );
}

/// `POST /counters` asking `action` on the client `k=v`, applied.
fn change(sluice: &Sluice, action: &str) -> (u16, String) {
    let body = format!(
        r#"{{"domain":"web","descriptors":[{{"entries":[{{"key":"k","value":"v"}}]}}],"action":"{action}","apply":true}}"#
    );
    let (status, _, text) = http(sluice.http, "POST", "/counters", &body);
    (status, text)
}

/// Whether the client `k=v` is admitted, asked through `/json`.
fn admitted(sluice: &Sluice) -> bool {
    let (status, _, text) = http(sluice.http, "POST", "/json", BODY);
    assert!(status == 200 || status == 429, "{status} {text}");
    status == 200
}

/// A client limited to 2 an hour that resets its own counter after every request: without a
/// token, every reset is refused (403, naming both ways in) and it gets its 2 in all; a dry run
/// and a show still answer. On a port declared trusted, the same resets free it.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_a_client_cannot_reset_its_own_limit_unless_the_port_is_trusted() {
    let sluice = Sluice::start(RULES).await;
    let mut admitted_count = 0;
    for _ in 0..10 {
        admitted_count += u32::from(admitted(&sluice));
        let (status, text) = change(&sluice, "reset");
        assert_eq!(status, 403, "{text}");
        assert!(
            text.contains("--admin-token-file") && text.contains("--trust-admin-port"),
            "{text}"
        );
    }
    assert_eq!(admitted_count, 2, "the limit holds");
    for action in ["set\",\"hits\":\"0", "add\",\"hits\":\"-2"] {
        let body = format!(
            r#"{{"domain":"web","descriptors":[{{"entries":[{{"key":"k","value":"v"}}]}}],"action":"{action}","apply":true}}"#
        )
        .replace("\"0\"", "0")
        .replace("\"-2\"", "-2");
        let (status, _, text) = http(sluice.http, "POST", "/counters", &body);
        assert_eq!(status, 403, "{body}: {text}");
    }
    assert!(!admitted(&sluice), "nothing was changed");
    let dry = r#"{"domain":"web","descriptors":[{"entries":[{"key":"k","value":"v"}]}],"action":"reset"}"#;
    let (status, _, text) = http(sluice.http, "POST", "/counters", dry);
    assert_eq!(status, 200, "a dry run answers: {text}");
    assert!(text.contains("\"applied\": false"), "{text}");
    let refused = scrape(sluice.http)
        .get("sluice_admin_refused_total", &[("reason", "untrusted")])
        .unwrap_or(0.0);
    assert_eq!(refused, 12.0, "each refused change is counted");
    assert!(
        sluice.log_text().contains("admin request(s) refused"),
        "{}",
        sluice.log_text()
    );

    let trusted = Sluice::start_with(&[("rules.yaml", RULES)], &["--trust-admin-port"]).await;
    let mut admitted_count = 0;
    for _ in 0..10 {
        admitted_count += u32::from(admitted(&trusted));
        let (status, text) = change(&trusted, "reset");
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(
        admitted_count, 10,
        "on a trusted port the resets are applied"
    );
}

/// Wrong tokens as fast as one client can send them: the first is checked and refused (401),
/// the rest within the second that follows are refused unchecked (429), so that a token is not
/// guessed thousands of times a second; the right token is checked again once the second is
/// over. Each refusal is counted, and logged at most once a second. A short token warns.
#[tokio::test(flavor = "multi_thread")]
async fn refused_tokens_are_counted_logged_and_slow_their_peer_down() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, "short\n").unwrap();
    let path = file.display().to_string();
    let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--admin-token-file", &path]).await;
    assert!(
        sluice
            .log_text()
            .contains("the admin token is 5 byte(s) long"),
        "{}",
        sluice.log_text()
    );
    let started = Instant::now();
    let mut statuses = std::collections::BTreeMap::new();
    let mut sent = 0;
    while started.elapsed() < Duration::from_millis(600) {
        let (status, _) = with_token(sluice.http, &format!("guess{sent}"), "GET", "/top", "");
        *statuses.entry(status).or_insert(0u32) += 1;
        sent += 1;
    }
    assert_eq!(statuses.get(&401), Some(&1), "{statuses:?} of {sent}");
    assert_eq!(statuses.get(&429).copied(), Some(sent - 1), "{statuses:?}");
    assert_eq!(
        with_token(sluice.http, "short", "GET", "/top", "").0,
        429,
        "not checked within the second"
    );
    cool_down().await;
    assert_eq!(with_token(sluice.http, "short", "GET", "/top", "").0, 200);
    let metrics = scrape(sluice.http);
    let refused = |reason| {
        metrics
            .get("sluice_admin_refused_total", &[("reason", reason)])
            .unwrap_or(0.0)
    };
    assert_eq!(refused("token"), 1.0);
    assert_eq!(refused("cooling"), f64::from(sent));
    let log = sluice.log_text();
    let lines = log.matches("admin request(s) refused").count();
    assert!(
        (1..=2).contains(&lines),
        "logged at most once a second: {log}"
    );
    assert!(
        log.contains("last_reason=\"token\"") || log.contains("last_reason=token"),
        "{log}"
    );

    std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        sluice.log_text().matches("byte(s) long").count(),
        1,
        "a token of 32 bytes does not warn"
    );
}
