//! Operating sluice: `/metrics` that a real Prometheus parser reads, counting every rule's
//! decisions under sluice's and envoyproxy/ratelimit's names; the rules in force at `/config` and
//! `/rlconfig`; JSON logs and log levels; where `/json` is served; and SIGTERM. (The local
//! over-limit cache and hot reload have files of their own.) Every limit is per hour, and a test
//! counting against one runs `in_one_window` of an hour.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
use sha2::{Digest, Sha256};
use support::metrics::scrape;
use support::redis::signal;
use support::{HOUR, OK, OVER_LIMIT, Sluice, Wait, eventually, http, in_one_window, request};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// `request` with `hits` hits (the request's `hits_addend`).
fn with_hits(mut r: RateLimitRequest, hits: u32) -> RateLimitRequest {
    r.hits_addend = hits;
    r
}

/// The limit a status reports (0 when it reports none).
pub(crate) fn limit_of(s: &DescriptorStatus) -> u32 {
    s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit)
}

pub(crate) fn get_text(sluice: &Sluice, path: &str) -> String {
    let (status, _, body) = http(sluice.http, "GET", path, "");
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

// ---------------------------------------------------------------------------------------------
// Metrics

const COUNTED: &str = "domain: ops
descriptors:
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: ip
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: bulk
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: client
    descriptors:
      - key: method
        value: GET
        rate_limit: {unit: hour, requests_per_unit: 5}
";

/// The six per-rule counters of `descriptor` in domain `ops`: total, within, over, near, shadow,
/// over with the local cache.
fn rule_counts(m: &support::metrics::Scrape, descriptor: &str) -> [f64; 6] {
    let labels = [("domain", "ops"), ("descriptor", descriptor)];
    [
        "hits",
        "within_limit",
        "over_limit",
        "near_limit",
        "shadow_mode",
        "over_limit_with_local_cache",
    ]
    .map(|stat| m.value(&format!("sluice_rule_{stat}_total"), &labels))
}

/// The same counts under envoyproxy/ratelimit's names (which have no local-cache series).
fn erl_counts(m: &support::metrics::Scrape, keys: &[(&str, &str)]) -> [f64; 5] {
    let mut labels = vec![("domain", "ops")];
    labels.extend_from_slice(keys);
    [
        "total_hits",
        "within_limit",
        "over_limit",
        "near_limit",
        "shadow_mode",
    ]
    .map(|stat| m.value(&format!("ratelimit_service_rate_limit_{stat}"), &labels))
}

/// A known sequence of decisions on the embedded store, then one scrape: every per-rule counter
/// equals the hits decided, under both names. Near-limit hits are those past floor(0.8 × limit)
/// of the used count; a shadow-mode hit over its limit is also an over-limit hit; a counter the
/// store found full denies from the local cache.
#[tokio::test]
async fn metrics_count_every_rules_decisions_in_openmetrics_a_prometheus_parser_reads() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start(COUNTED).await;
        let ask = |r: RateLimitRequest| sluice.ask(r);

        // plain, 2/hour: 2 within (the 2nd near, and filling the counter), then 2 over, both denied
        // from the local cache.
        let mut codes = Vec::new();
        for _ in 0..4 {
            codes.push(ask(request("ops", &[&[("plain", "a")]])).await.overall_code);
        }
        assert_eq!(codes, [OK, OK, OVER_LIMIT, OVER_LIMIT]);
        // shadow, 1/hour: 1 within (near: past floor(0.8) = 0), 2 over and answered OK.
        for _ in 0..3 {
            let r = ask(request("ops", &[&[("shadow", "s")]])).await;
            assert_eq!(r.overall_code, OK, "a shadow-mode rule never denies");
        }
        // ip, detailed: one series per address.
        for address in ["10.0.0.1", "10.0.0.1", "10.0.0.2"] {
            assert_eq!(
                ask(request("ops", &[&[("ip", address)]]))
                    .await
                    .overall_code,
                OK
            );
        }
        // bulk, 10/hour, counted in hits: 4 (used 4), 5 (used 9: 1 near), 3 (over), 1 (used 10:
        // 1 near).
        let mut codes = Vec::new();
        for hits in [4, 5, 3, 1] {
            let r = ask(with_hits(request("ops", &[&[("bulk", "b")]]), hits)).await;
            codes.push(r.overall_code);
        }
        assert_eq!(codes, [OK, OK, OVER_LIMIT, OK]);
        // client.method_GET, nested: once over gRPC, once over /json.
        ask(request("ops", &[&[("client", "c"), ("method", "GET")]])).await;
        let body = r#"{"domain":"ops","descriptors":[{"entries":[{"key":"client","value":"c"},{"key":"method","value":"GET"}]}]}"#;
        assert_eq!(http(sluice.http, "POST", "/json", body).0, 200);
        // A domain no file declares.
        ask(request("nowhere", &[&[("k", "v")]])).await;
        let grpc_calls = 4 + 3 + 3 + 4 + 1 + 1;

        let m = scrape(sluice.http);
        assert_eq!(rule_counts(&m, "plain"), [4.0, 2.0, 2.0, 1.0, 0.0, 2.0]);
        assert_eq!(rule_counts(&m, "shadow"), [3.0, 1.0, 2.0, 1.0, 2.0, 0.0]);
        assert_eq!(
            rule_counts(&m, "ip_10.0.0.1"),
            [2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(
            rule_counts(&m, "ip_10.0.0.2"),
            [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(
            rule_counts(&m, "ip"),
            [0.0; 6],
            "detailed hits count under the request's values only"
        );
        assert_eq!(rule_counts(&m, "bulk"), [13.0, 10.0, 3.0, 2.0, 0.0, 0.0]);
        assert_eq!(
            rule_counts(&m, "client.method_GET"),
            [2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
        );

        assert_eq!(
            erl_counts(&m, &[("key1", "plain")]),
            [4.0, 2.0, 2.0, 1.0, 0.0]
        );
        assert_eq!(
            erl_counts(&m, &[("key1", "shadow")]),
            [3.0, 1.0, 2.0, 1.0, 2.0]
        );
        assert_eq!(
            erl_counts(&m, &[("key1", "ip_10_0_0_1")]),
            [2.0, 2.0, 0.0, 0.0, 0.0],
            "envoyproxy/ratelimit's names have IPv4 dots as underscores"
        );
        assert_eq!(
            erl_counts(&m, &[("key1", "bulk")]),
            [13.0, 10.0, 3.0, 2.0, 0.0]
        );
        assert_eq!(
            erl_counts(&m, &[("key1", "client"), ("key2", "method_GET")]),
            [2.0, 2.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(m.family_type("sluice_rule_hits"), Some("counter"));
        assert_eq!(
            m.family_type("ratelimit_service_rate_limit_total_hits"),
            Some("unknown")
        );

        // Calls: every gRPC call (not /json) is timed and counted; the store is called for every
        // decided request but the two denied from the local cache (and the unknown domain's).
        let method = [("grpc_method", "ShouldRateLimit")];
        assert_eq!(
            m.value("ratelimit_service_total_requests", &method),
            f64::from(grpc_calls)
        );
        assert_eq!(
            m.value("sluice_request_duration_seconds_count", &[]),
            f64::from(grpc_calls)
        );
        assert_eq!(
            m.value("ratelimit_service_response_time_seconds_count", &method),
            f64::from(grpc_calls)
        );
        assert_eq!(
            m.family_type("sluice_request_duration_seconds"),
            Some("histogram")
        );
        assert_eq!(
            m.value("sluice_store_call_duration_seconds_count", &[]),
            f64::from(grpc_calls + 1 - 1 - 2)
        );
        assert_eq!(m.value("sluice_unknown_domain_requests_total", &[]), 1.0);
        // Counters: plain=a, shadow=s, ip ×2, bulk=b, client=c; full ones: plain=a and bulk=b.
        assert_eq!(m.value("sluice_memory_counters", &[]), 6.0);
        assert_eq!(m.value("sluice_local_cache_entries", &[]), 2.0);
        assert_eq!(m.value("sluice_store_reachable", &[]), 1.0);
        assert_eq!(m.value("ratelimit_service_config_load_success", &[]), 1.0);
        assert_eq!(m.value("ratelimit_service_config_load_error", &[]), 0.0);
        assert!(
            m.get("ratelimit_service_global_shadow_mode", &[]).is_none(),
            "unmapped by the default mapping, written once it counts"
        );
        assert_eq!(
            m.value(
                "ratelimit_service_should_rate_limit_error",
                &[("err_type", "redis_error")]
            ),
            0.0
        );
        assert_eq!(m.samples_of("sluice_rules_info").len(), 1);
        assert!(m.value("sluice_rules_loaded_timestamp_seconds", &[]) > 1e9);
        assert!(m.value("process_cpu_seconds_total", &[]) >= 0.0);
        for gauge in [
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
        ] {
            assert!(m.value(gauge, &[]) > 0.0, "{gauge}");
        }
        assert_eq!(m.value("sluice_redis_batch_requests_count", &[]), 0.0);
        assert!(
            m.get("sluice_store_breakers_open", &[]).is_none(),
            "no breakers on the embedded store"
        );
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// /config and /rlconfig

const ALPHA: &str = "domain: alpha
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10, name: per_user}
";

fn beta(per_hour: u32) -> String {
    format!(
        "domain: beta
descriptors:
  - key: client
    value: web
    descriptors:
      - key: path
        shadow_mode: true
        rate_limits:
          - {{unit: hour, requests_per_unit: {per_hour}}}
          - {{unit: second, requests_per_unit: 5, unit_multiplier: 2, algorithm: sliding_window}}
"
    )
}

fn sha256(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn config_json(sluice: &Sluice) -> serde_json::Value {
    let (status, headers, body) = http(sluice.http, "GET", "/config", "");
    assert_eq!(status, 200, "{body}");
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "content-type" && v == "application/json"),
        "{headers:?}"
    );
    serde_json::from_str(&body).expect("/config is JSON")
}

/// `/config` shows every domain and rule in force with its file and line, every file with its
/// SHA-256, the hash of them all (the `sluice_rules_info` hash) and when they were loaded;
/// `/rlconfig` one line per limit, as envoyproxy/ratelimit writes it. A reload changes the hash.
#[tokio::test]
async fn config_and_rlconfig_show_the_rules_in_force_their_files_and_hash() {
    let started = std::time::SystemTime::now();
    let sluice = Sluice::start_with(&[("a.yaml", ALPHA), ("b.yml", &beta(100))], &[]).await;
    let file = |name: &str| sluice.rules.join(name).display().to_string();

    assert_eq!(
        get_text(&sluice, "/rlconfig"),
        "alpha.user: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false, name: per_user\n\
         beta.client_web.path: unit=HOUR requests_per_unit=100, shadow_mode: true, quota_mode: false\n\
         beta.client_web.path: unit=SECOND requests_per_unit=5, shadow_mode: true, quota_mode: false, unit_multiplier: 2, algorithm: sliding_window\n"
    );

    let config = config_json(&sluice);
    let hash = config["hash"].as_str().expect("a hash").to_owned();
    assert!(
        hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "{hash}"
    );
    assert_eq!(
        config["files"],
        serde_json::json!([
            {"path": file("a.yaml"), "sha256": sha256(ALPHA)},
            {"path": file("b.yml"), "sha256": sha256(&beta(100))},
        ])
    );
    assert_eq!(
        config["domains"],
        serde_json::json!([
            {
                "domain": "alpha", "file": file("a.yaml"), "line": 1,
                "descriptors": [{
                    "key": "user", "line": 3,
                    "rate_limits": [{
                        "unit": "minute", "requests_per_unit": 10, "unit_multiplier": 1,
                        "algorithm": "fixed_window", "name": "per_user",
                    }],
                }],
            },
            {
                "domain": "beta", "file": file("b.yml"), "line": 1,
                "descriptors": [{
                    "key": "client", "value": "web", "line": 3,
                    "descriptors": [{
                        "key": "path", "line": 6, "shadow_mode": true,
                        "rate_limits": [
                            {"unit": "hour", "requests_per_unit": 100, "unit_multiplier": 1,
                             "algorithm": "fixed_window"},
                            {"unit": "second", "requests_per_unit": 5, "unit_multiplier": 2,
                             "algorithm": "sliding_window"},
                        ],
                    }],
                }],
            },
        ])
    );
    let loaded_at = humantime::parse_rfc3339(config["loaded_at"].as_str().expect("loaded_at"))
        .expect("loaded_at is RFC 3339");
    let loaded_at_unix = config["loaded_at_unix"].as_f64().expect("loaded_at_unix");
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    assert!((unix(loaded_at) - loaded_at_unix).abs() < 0.002);
    assert!(
        unix(started) - 1.0 <= loaded_at_unix && loaded_at_unix <= support::unix_ms() as f64 / 1e3,
        "loaded at {loaded_at_unix}"
    );
    let m = scrape(sluice.http);
    assert_eq!(m.value("sluice_rules_info", &[("hash", &hash)]), 1.0);

    std::fs::write(sluice.rules.join("b.yml"), beta(200)).unwrap();
    eventually(
        "the change is in force",
        Duration::from_secs(10),
        async || config_json(&sluice)["hash"] != hash.as_str(),
    )
    .await;
    let config = config_json(&sluice);
    let new_hash = config["hash"].as_str().unwrap();
    assert_eq!(config["files"][1]["sha256"], sha256(&beta(200)));
    assert!(config["loaded_at_unix"].as_f64().unwrap() >= loaded_at_unix);
    assert!(get_text(&sluice, "/rlconfig").contains("unit=HOUR requests_per_unit=200,"));
    let m = scrape(sluice.http);
    assert_eq!(
        m.samples_of("sluice_rules_info"),
        [(format!("hash=\"{new_hash}\""), 1.0)],
        "the hash in force, only"
    );
    assert!(
        (m.value("sluice_rules_loaded_timestamp_seconds", &[])
            - config["loaded_at_unix"].as_f64().unwrap())
        .abs()
            < 1.0
    );
}

// ---------------------------------------------------------------------------------------------
// Logs

const LOGGED: &str = "domain: logs\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

/// Each line of `log` as a JSON object; panics on any other line.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            assert!(v.is_object(), "not an object: {line}");
            v
        })
        .collect()
}

fn message(line: &serde_json::Value) -> &str {
    line["fields"]["message"].as_str().unwrap_or_default()
}

/// With `--log-format json`, every line a sluice writes from start to exit is one JSON object
/// with a timestamp, a level, a target and a message.
#[tokio::test]
async fn json_logs_write_every_line_of_a_run_as_one_object_with_level_and_message() {
    let mut sluice = Sluice::start_with(
        &[("rules.yaml", LOGGED)],
        &["--log-format", "json", "--log-level", "info"],
    )
    .await;
    for _ in 0..3 {
        sluice.ask(request("logs", &[&[("user", "j")]])).await;
    }
    signal(sluice.pid(), "TERM");
    let status = sluice.exited_within(Duration::from_secs(10)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");

    let lines = json_lines(&sluice.log_text());
    for line in &lines {
        assert!(line["timestamp"].is_string(), "{line}");
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"]
                .contains(&line["level"].as_str().unwrap_or("")),
            "{line}"
        );
        assert!(line["target"].is_string(), "{line}");
        assert!(!message(line).is_empty(), "{line}");
        assert_ne!(line["level"], "ERROR", "{line}");
    }
    let messages: Vec<&str> = lines.iter().map(message).collect();
    for expected in ["rules loaded", "serving: gRPC on", "stopped"] {
        assert!(
            messages.iter().any(|m| m.starts_with(expected)),
            "{expected}: {messages:?}"
        );
    }
    assert!(
        messages.iter().any(|m| m.starts_with("shutting down")),
        "{messages:?}"
    );
}

/// `--log-level debug` logs one `decided` line per request, with its domain.
#[tokio::test]
async fn at_debug_every_request_logs_one_decided_line() {
    let sluice = Sluice::start_with(
        &[("rules.yaml", LOGGED)],
        &["--log-format", "json", "--log-level", "debug"],
    )
    .await;
    for _ in 0..5 {
        sluice.ask(request("logs", &[&[("user", "d")]])).await;
    }
    let decided: Vec<serde_json::Value> = json_lines(&sluice.log_text())
        .into_iter()
        .filter(|l| message(l) == "decided")
        .collect();
    assert_eq!(decided.len(), 5, "{decided:#?}");
    for line in &decided {
        assert_eq!(line["level"], "DEBUG", "{line}");
        assert_eq!(line["fields"]["domain"], "logs", "{line}");
    }
}

/// At `info`, requests, admitted or denied, log nothing.
#[tokio::test]
async fn at_info_requests_log_nothing() {
    let sluice = Sluice::start_with(&[("rules.yaml", LOGGED)], &["--log-level", "info"]).await;
    let before = sluice.log_text();
    assert!(
        before.contains("serving"),
        "info lines are written: {before}"
    );
    let mut codes = Vec::new();
    for _ in 0..20 {
        codes.push(
            sluice
                .ask(request("logs", &[&[("user", "i")]]))
                .await
                .overall_code,
        );
    }
    assert!(codes.contains(&OK) && codes.contains(&OVER_LIMIT));
    assert_eq!(sluice.log_text(), before);
}

// ---------------------------------------------------------------------------------------------
// Where /json is served

const JSON_BODY: &str =
    r#"{"domain":"logs","descriptors":[{"entries":[{"key":"user","value":"h"}]}]}"#;

/// `--json-addr off`: `/json` is served nowhere; the admin endpoints still are.
#[tokio::test]
async fn with_json_addr_off_json_is_not_served_and_metrics_still_are() {
    let sluice = Sluice::start_with(&[("rules.yaml", LOGGED)], &["--json-addr", "off"]).await;
    assert_eq!(http(sluice.http, "POST", "/json", JSON_BODY).0, 404);
    assert_eq!(http(sluice.http, "GET", "/metrics", "").0, 200);
    assert_eq!(http(sluice.http, "GET", "/healthz", "").0, 200);
}

/// `/` on the admin port lists its endpoints, each of which answers (the listing stays true);
/// `/json` only where it is served.
#[tokio::test]
async fn the_admin_root_lists_every_endpoint_it_serves() {
    for (flags, json_listed) in [(&[][..], true), (&["--json-addr", "off"][..], false)] {
        let sluice = Sluice::start_with(&[("rules.yaml", LOGGED)], flags).await;
        let listing = get_text(&sluice, "/");
        let listed: Vec<(&str, &str)> = listing
            .lines()
            .map(|line| {
                let (endpoint, _) = line.split_once(": ").expect("endpoint: help");
                endpoint.split_once(' ').expect("method and path")
            })
            .collect();
        assert!(listed.len() >= 8, "{listing}");
        assert_eq!(
            listed.iter().any(|(_, path)| *path == "/json"),
            json_listed,
            "{listing}"
        );
        for (method, path) in listed {
            let body = if method == "POST" { JSON_BODY } else { "" };
            let (status, _, answer) = http(sluice.http, method, path, body);
            assert_ne!(status, 404, "{method} {path}: {answer}");
            assert_ne!(status, 405, "{method} {path}: {answer}");
        }
    }
}

/// `--json-addr ADDR`: `/json` is served there, and only there; the admin endpoints are not.
#[tokio::test]
async fn with_json_addr_json_is_served_on_that_address_only() {
    let json: std::net::SocketAddr = format!("127.0.0.1:{}", support::free_port())
        .parse()
        .unwrap();
    let sluice = Sluice::start_with(
        &[("rules.yaml", LOGGED)],
        &["--json-addr", &json.to_string()],
    )
    .await;
    let (status, _, body) = http(json, "POST", "/json", JSON_BODY);
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(http(sluice.http, "POST", "/json", JSON_BODY).0, 404);
    assert_eq!(http(json, "GET", "/metrics", "").0, 404);
    assert_eq!(http(sluice.http, "GET", "/metrics", "").0, 200);
}

// ---------------------------------------------------------------------------------------------
// SIGTERM

/// An idle sluice exits 0 promptly on SIGTERM, saying so, with nothing logged at error.
#[tokio::test]
async fn sigterm_ends_an_idle_sluice_with_status_0_and_no_error() {
    let mut sluice = Sluice::start_with(&[("rules.yaml", LOGGED)], &["--log-level", "info"]).await;
    sluice.ask(request("logs", &[&[("user", "t")]])).await;
    signal(sluice.pid(), "TERM");
    let status = sluice.exited_within(Duration::from_secs(5)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let log = sluice.log_text();
    assert!(
        log.contains("shutting down") && log.contains("stopped"),
        "{log}"
    );
    assert!(!log.contains("ERROR"), "{log}");
}

/// The next status a health Watch stream reports, within 5 s.
async fn next_status(watch: &mut tonic::Streaming<HealthCheckResponse>) -> Option<i32> {
    tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("a health update within 5 s")
        .expect("the stream stays up")
        .map(|r| r.status)
}

/// On SIGTERM gRPC health turns NOT_SERVING at once, as a Watch stream open at the time sees;
/// then the stream ends, so that it does not hold the drain, and the process exits with status 0
/// well before `--shutdown-grace`.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_turns_health_not_serving_then_ends_watch_streams() {
    let mut sluice = Sluice::spawn(
        &[("rules.yaml", LOGGED)],
        &["--shutdown-grace", "30s", "--log-level", "info"],
        None,
        Wait::Serving,
    )
    .await;
    let mut health = HealthClient::new(sluice.channel().await);
    let mut watch = health
        .watch(HealthCheckRequest::default())
        .await
        .expect("Watch opens")
        .into_inner();
    assert_eq!(
        next_status(&mut watch).await,
        Some(ServingStatus::Serving as i32)
    );
    signal(sluice.pid(), "TERM");
    assert_eq!(
        next_status(&mut watch).await,
        Some(ServingStatus::NotServing as i32)
    );
    let ended = tokio::time::timeout(Duration::from_secs(5), watch.message()).await;
    assert!(
        matches!(ended, Ok(Ok(None)) | Ok(Err(_))),
        "the Watch stream ends after NOT_SERVING: {ended:?}"
    );
    let status = sluice.exited_within(Duration::from_secs(10)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let log = sluice.log_text();
    assert!(!log.contains("--shutdown-grace"), "{log}");
}

/// A call still waiting when SIGTERM comes (its Redis is stopped and its store timeout is long)
/// does not hold the process past `--shutdown-grace`: it exits, with status 0, once the grace
/// has run out.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_outlasting_the_shutdown_grace_does_not_hold_the_process() {
    let redis = support::redis::Controlled::started();
    let mut sluice = Sluice::spawn(
        &[("rules.yaml", LOGGED)],
        &[
            "--redis-url",
            &redis.url,
            "--store-timeout",
            "50s",
            "--shutdown-grace",
            "2s",
            "--log-level",
            "info",
        ],
        None,
        Wait::Serving,
    )
    .await;
    let mut client = sluice.client().await;
    redis.pause();
    let stuck = tokio::spawn(async move {
        client
            .should_rate_limit(request("logs", &[&[("user", "stuck")]]))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!stuck.is_finished(), "the call waits for the stopped Redis");
    let term = Instant::now();
    signal(sluice.pid(), "TERM");
    let status = sluice.exited_within(Duration::from_secs(15)).await;
    redis.resume();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(
        term.elapsed() >= Duration::from_secs(2),
        "the call held the drain until the grace ran out: exited after {:?}",
        term.elapsed()
    );
    assert!(stuck.await.expect("the caller ends").is_err());
    let log = sluice.log_text();
    assert!(
        log.contains("in-flight calls still running after --shutdown-grace: exiting"),
        "{log}"
    );
}
