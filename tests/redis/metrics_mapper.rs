//! envoyproxy/ratelimit's Prometheus series through a statsd_exporter mapping
//! (`--prometheus-mapper`): that project's built-in mapping by default, Envoy Gateway's file
//! (examples/metrics/envoy-gateway-mapper.yaml) for the series its dashboard and e2e tests read,
//! a custom one; the values equal the hits decided under envoyproxy/ratelimit's counting; and
//! `--metrics-addr`/`--metrics-path` serve the same text on an address of their own.

use std::process::{Command, Stdio};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use support::metrics::{Scrape, scrape, scrape_at};
use support::{HOUR, OK, OVER_LIMIT, Sluice, Store, free_port, in_one_window, request};

const EG_MAPPER: &str = include_str!("../../examples/metrics/envoy-gateway-mapper.yaml");

const ROUTE: &str = "httproute/default/http-ratelimit/rule/0/match/0/ratelimit_example";

/// Envoy Gateway's docs example (its "Global Ratelimit" dashboard queries these series): the
/// route node, then the header-match rule node, 3 an hour.
fn docs_example() -> String {
    format!(
        "domain: default/eg/http
descriptors:
  - key: {ROUTE}
    value: {ROUTE}
    descriptors:
      - key: rule-0-match-0
        value: rule-0-match-0
        rate_limit: {{unit: HOUR, requests_per_unit: 3}}
"
    )
}

/// Envoy Gateway's distinct-CIDR rule (as its e2e CIDR test generates it): the route node, the
/// masked address, then one counter per client address, 3 an hour.
const CIDR: &str = "domain: default/eg/http
descriptors:
  - key: httproute/default/api/rule/0/match/0/*
    value: httproute/default/api/rule/0/match/0/*
    descriptors:
      - key: masked_remote_address
        value: 0.0.0.0/0
        descriptors:
          - key: remote_address
            rate_limit: {unit: HOUR, requests_per_unit: 3}
";

/// One request for the docs example's descriptor consuming `hits` (`None`: the request's
/// default, 1).
fn docs_request(hits: Option<u64>) -> RateLimitRequest {
    let mut r = request(
        "default/eg/http",
        &[&[(ROUTE, ROUTE), ("rule-0-match-0", "rule-0-match-0")]],
    );
    r.descriptors[0].hits_addend = hits.map(|value| UInt64Value { value });
    r
}

/// `ratelimit_service_rate_limit_{total_hits,within_limit,near_limit,over_limit}` with `labels`.
fn erl_counts(m: &Scrape, labels: &[(&str, &str)]) -> [f64; 4] {
    ["total_hits", "within_limit", "near_limit", "over_limit"]
        .map(|stat| m.value(&format!("ratelimit_service_rate_limit_{stat}"), labels))
}

fn with_file(flags: &[&str], path: &std::path::Path) -> Vec<String> {
    let mut all: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
    all.extend(["--prometheus-mapper".into(), path.display().to_string()]);
    all
}

fn mapper_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("a temporary file");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("the mapping is written");
    file
}

/// Under `--counting always` with Envoy Gateway's mapping: a sequence of requests with and
/// without costs (0 = check only) is counted in hits as envoyproxy/ratelimit counts them. Limit 3,
/// near threshold floor(3 × 0.8) = 2:
/// 1 hit (count 1: within) · check · 3 hits (count 4: 1 over, 3 − max(2, 1) = 1 near, none
/// within) · check (over, counts nothing) · 1 hit (over from the start: 1 over).
async fn eg_docs_example_counts(store: Store) {
    in_one_window(HOUR, async || {
        let mapper = mapper_file(EG_MAPPER);
        let flags = with_file(&["--counting", "always"], mapper.path());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let sluice = Sluice::on(store, &[("eg.yaml", &docs_example())], &flags).await;
        let mut codes = Vec::new();
        for hits in [None, Some(0), Some(3), Some(0), Some(1)] {
            codes.push(sluice.ask(docs_request(hits)).await.overall_code);
        }
        assert_eq!(codes, [OK, OK, OVER_LIMIT, OVER_LIMIT, OVER_LIMIT]);

        let m = scrape(sluice.http);
        let key1 = format!("{ROUTE}_{ROUTE}");
        let labels = [
            ("domain", "default/eg/http"),
            ("key1", key1.as_str()),
            ("key2", "rule-0-match-0_rule-0-match-0"),
        ];
        assert_eq!(erl_counts(&m, &labels), [5.0, 1.0, 1.0, 2.0]);
        assert_eq!(
            m.value("ratelimit_service_rate_limit_shadow_mode", &labels),
            0.0
        );
        let method = [("grpc_method", "ShouldRateLimit")];
        assert_eq!(m.value("ratelimit_service_total_requests", &method), 5.0);
        assert_eq!(m.value("go_memstats_gc_cpu_fraction", &[]), 0.0);
        assert!(m.value("process_resident_memory_bytes", &[]) > 0.0);
        assert!(m.value("process_virtual_memory_bytes", &[]) > 0.0);
    })
    .await;
}

scenarios! {
    envoy_gateways_mapping_names_its_docs_example_with_the_hits_decided_on_memory
        => eg_docs_example_counts(Store::Memory),
    envoy_gateways_mapping_names_its_docs_example_with_the_hits_decided_on_redis
        => eg_docs_example_counts(Store::Redis),
}

/// A CIDR rule's masked address is `key2`, the dots of its IPv4 address turned into `_` (the
/// series Envoy Gateway's e2e CIDR test requires samples of); the per-address level is merged.
#[tokio::test]
async fn envoy_gateways_mapping_names_a_cidr_rule_with_its_address_sanitized() {
    in_one_window(HOUR, async || {
        let mapper = mapper_file(EG_MAPPER);
        let flags = with_file(&["--counting", "always"], mapper.path());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let sluice = Sluice::on(Store::Memory, &[("eg.yaml", CIDR)], &flags).await;
        let route = "httproute/default/api/rule/0/match/0/*";
        let mut codes = Vec::new();
        for client in ["10.1.2.3", "10.1.2.3", "10.1.2.3", "10.1.2.3", "10.9.9.9"] {
            let r = request(
                "default/eg/http",
                &[&[
                    (route, route),
                    ("masked_remote_address", "0.0.0.0/0"),
                    ("remote_address", client),
                ]],
            );
            codes.push(sluice.ask(r).await.overall_code);
        }
        assert_eq!(codes, [OK, OK, OK, OVER_LIMIT, OK]);
        let m = scrape(sluice.http);
        let key1 = format!("{route}_{route}");
        let labels = [
            ("domain", "default/eg/http"),
            ("key1", key1.as_str()),
            ("key2", "masked_remote_address_0_0_0_0/0"),
        ];
        // Hit 3 of 10.1.2.3 is near (past 2 of 3); both addresses add up in one series.
        assert_eq!(erl_counts(&m, &labels), [5.0, 4.0, 1.0, 1.0]);
    })
    .await;
}

/// One call made slow (Redis paused for 500 ms) lands past every bucket in Envoy Gateway's
/// mapping, which observes milliseconds, and inside the 10 bucket in the default one, which
/// scales them to seconds.
#[tokio::test(flavor = "multi_thread")]
async fn the_response_time_is_in_seconds_by_default_and_in_milliseconds_under_envoy_gateway() {
    let eg = mapper_file(EG_MAPPER);
    for mapping in [None, Some(eg.path())] {
        let own = support::redis::dedicated();
        let flags = mapping.map_or_else(Vec::new, |path| with_file(&[], path));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let sluice = Sluice::on_own_redis(&own, &[("eg.yaml", &docs_example())], &flags).await;
        let mut client = sluice.client().await;
        support::decide(&mut client, docs_request(Some(0))).await;
        support::redis::cli(own.ports[0], &["CLIENT", "PAUSE", "500", "ALL"]);
        support::decide(&mut client, docs_request(Some(0))).await;

        let m = scrape(sluice.http);
        let name = "ratelimit_service_response_time_seconds";
        assert_eq!(m.family_type(name), Some("histogram"));
        let bucket = |le: &str| {
            m.value(
                &format!("{name}_bucket"),
                &[("grpc_method", "ShouldRateLimit"), ("le", le)],
            )
        };
        let method = [("grpc_method", "ShouldRateLimit")];
        let (count, sum) = (
            m.value(&format!("{name}_count"), &method),
            m.value(&format!("{name}_sum"), &method),
        );
        assert_eq!((count, bucket("+Inf")), (2.0, 2.0));
        match mapping {
            None => {
                assert_eq!(bucket("10.0"), 2.0, "seconds: both well inside 10");
                assert!((0.3..10.0).contains(&sum), "seconds: {sum}");
            }
            Some(_) => {
                assert!(
                    bucket("10.0") <= 1.0,
                    "milliseconds: the slow call is past 10"
                );
                assert!(
                    sum >= 300.0 && sum.fract() == 0.0,
                    "whole milliseconds: {sum}"
                );
            }
        }
    }
}

const CUSTOM: &str = r#"
mappings:
  - match: "ratelimit\\.service\\.rate_limit\\.([^.]*)\\.(.*)\\.total_hits"
    match_type: regex
    name: "rl_hits"
    help: "Hits by rule path."
    labels:
      domain: "$1"
      path: "$2"
  - match: "ratelimit.service.rate_limit.*.*.near_limit"
    action: drop
  - match: "ratelimit.service.rate_limit.*.*.over_limit"
    name: "rl_${2}_over"
    labels:
      domain: "$1"
"#;

/// A regex mapping's captures become labels, a glob's a part of the name; a dropped stat is
/// written under no name; a stat no mapping names is written under its escaped statsd name once
/// it counts.
#[tokio::test]
async fn a_custom_mapping_names_labels_from_captures_and_drops_what_it_says() {
    in_one_window(HOUR, async || {
        let mapper = mapper_file(CUSTOM);
        let flags = with_file(&[], mapper.path());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let rules = "domain: d
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: a
    descriptors:
      - key: b
        rate_limit: {unit: hour, requests_per_unit: 5}
";
        let sluice = Sluice::start_with(&[("d.yaml", rules)], &flags).await;
        for _ in 0..3 {
            sluice.ask(request("d", &[&[("k", "v")]])).await;
        }
        sluice.ask(request("d", &[&[("a", "1"), ("b", "2")]])).await;

        let m = scrape(sluice.http);
        assert_eq!(m.value("rl_hits", &[("domain", "d"), ("path", "k")]), 3.0);
        assert_eq!(m.value("rl_hits", &[("domain", "d"), ("path", "a.b")]), 1.0);
        assert!(m.text.contains("# HELP rl_hits Hits by rule path."));
        assert_eq!(m.value("rl_k_over", &[("domain", "d")]), 2.0);
        assert_eq!(
            m.value("ratelimit_service_rate_limit_d_k_within_limit", &[]),
            1.0
        );
        assert!(
            !m.text
                .lines()
                .any(|l| l.starts_with("ratelimit") && l.contains("near_limit")),
            "the near-limit stats are dropped"
        );
        assert!(
            m.get("ratelimit_service_rate_limit_d_a_b_shadow_mode", &[])
                .is_none(),
            "an unmapped stat that never counted is not written"
        );
        assert!(
            m.get(
                "ratelimit_service_rate_limit_total_hits",
                &[("domain", "d"), ("key1", "k")]
            )
            .is_none()
        );
    })
    .await;
}

/// `--metrics-addr` serves the admin `/metrics` text at `--metrics-path`, and nothing else.
#[tokio::test]
async fn metrics_addr_serves_the_metrics_at_its_path() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let sluice = Sluice::start_with(
        &[("eg.yaml", &docs_example())],
        &["--metrics-addr", &addr, "--metrics-path", "/prom"],
    )
    .await;
    sluice.ask(docs_request(None)).await;
    let addr = addr.parse().expect("an address");
    let own = scrape_at(addr, "/prom");
    let admin = scrape(sluice.http);
    let key1 = format!("{ROUTE}_{ROUTE}");
    let labels = [
        ("domain", "default/eg/http"),
        ("key1", key1.as_str()),
        ("key2", "rule-0-match-0_rule-0-match-0"),
    ];
    for m in [&own, &admin] {
        assert_eq!(
            m.value("ratelimit_service_rate_limit_total_hits", &labels),
            1.0
        );
        assert_eq!(m.value("go_memstats_gc_cpu_fraction", &[]), 0.0);
    }
    assert_eq!(support::http(addr, "GET", "/metrics", "").0, 404);
    assert_eq!(support::http(addr, "GET", "/json", "").0, 404);
}

/// A mapping file that does not parse stops the start, naming the file and the line
/// (envoyproxy/ratelimit ignores it and maps nothing).
#[tokio::test]
async fn a_mapping_file_that_does_not_parse_stops_the_start() {
    let mapper = mapper_file("mappings:\n  - match: a.*\n    name: x\n    lables: {}\n");
    let rules = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(rules.path().join("d.yaml"), "domain: d\n").expect("a rule file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .arg("--config")
        .arg(rules.path())
        .args(["--grpc-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--http-addr", &format!("127.0.0.1:{}", free_port())])
        .arg("--prometheus-mapper")
        .arg(mapper.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the sluice binary starts");
    let mut exited = None;
    for _ in 0..100 {
        if let Some(status) = child.try_wait().expect("waiting works") {
            exited = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(status) = exited else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("sluice kept running with a mapping file that does not parse");
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("stderr reads");
    assert!(
        err.contains("--prometheus-mapper") && err.contains("line 4") && err.contains("lables"),
        "{err}"
    );
}

/// Envoy Gateway mounts its mapping from an optional ConfigMap: without the file, sluice starts
/// and envoyproxy/ratelimit's own mapping names the series, as that project does.
#[tokio::test]
async fn a_mapping_file_that_is_not_there_leaves_the_built_in_mapping() {
    let rules =
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let sluice = Sluice::start_with(
        &[("d.yaml", rules)],
        &[
            "--prometheus-mapper",
            "/nonexistent/statsd-exporter/conf.yaml",
        ],
    )
    .await;
    assert_eq!(
        sluice
            .ask(request("d", &[&[("k", "v")]]))
            .await
            .overall_code,
        OK
    );
    let m = scrape(sluice.http);
    assert_eq!(
        m.value(
            "ratelimit_service_rate_limit_total_hits",
            &[("domain", "d"), ("key1", "k")]
        ),
        1.0
    );
    assert!(
        sluice.log_text().contains("no such file"),
        "the missing file is logged: {}",
        sluice.log_text()
    );
}
