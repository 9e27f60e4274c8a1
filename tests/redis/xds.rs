//! Rules over xDS: a real sluice following the test ADS server (tests/support/src/xds.rs), as
//! envoyproxy/ratelimit follows Envoy Gateway's.

use std::time::{Duration, Instant};

use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{RateLimitConfig, RateLimitUnit};
use support::xds::{
    Certs, Received, ServerTlsFiles, XdsServer, certgen, domain, nest, resource, rule,
};
use support::{
    FREED_PAGES_RETURNED, HOUR, OK, OVER_LIMIT, Sluice, Store, Wait, http, in_one_window,
    memory_kb, request, reset_peak, settled_resident_kb,
};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const WAIT: Duration = Duration::from_secs(5);

/// Domain `d`: key `k` at `n` per hour.
fn limit_d(n: u32) -> RateLimitConfig {
    domain("d", vec![rule("k", "", RateLimitUnit::Hour, n)])
}

async fn start(store: Store, server: &XdsServer, flags: &[&str]) -> Sluice {
    let target = server.target();
    let mut all = vec!["--xds-server", target.as_str()];
    all.extend_from_slice(flags);
    Sluice::on(store, &[], &all).await
}

async fn code(sluice: &Sluice, domain: &str, entries: &[(&str, &str)]) -> i32 {
    sluice.ask(request(domain, &[entries])).await.overall_code
}

/// Asks until the answer is `want`, for at most `limit`; how long it took.
async fn until_code(
    sluice: &Sluice,
    domain: &str,
    entries: &[(&str, &str)],
    want: i32,
    limit: Duration,
) -> Option<Duration> {
    let mut client = sluice.client().await;
    let started = Instant::now();
    while started.elapsed() < limit {
        if support::decide(&mut client, request(domain, &[entries]))
            .await
            .overall_code
            == want
        {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

async fn health(sluice: &Sluice) -> i32 {
    HealthClient::new(sluice.channel().await)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("gRPC health answers")
        .into_inner()
        .status
}

fn acked(version: &str) -> impl Fn(&Received) -> bool + '_ {
    move |r| r.version == version && !r.nonce.is_empty() && r.error.is_none()
}

async fn rules_arrive_over_xds_and_decide(store: Store) {
    in_one_window(HOUR, async || {
        let server = XdsServer::start();
        server.set("1", &[limit_d(2)]);
        let sluice = start(
            store,
            &server,
            &[
                "--xds-node-id",
                "envoy-ratelimit",
                "--xds-node-metadata",
                "cluster=eg,zone=a=b",
            ],
        )
        .await;
        let k = [("k", "x")];
        assert_eq!(code(&sluice, "d", &k).await, OK);
        assert_eq!(code(&sluice, "d", &k).await, OK);
        assert_eq!(code(&sluice, "d", &k).await, OVER_LIMIT);
        assert_eq!(code(&sluice, "unknown", &k).await, OK);

        let first = &server.received()[0];
        assert_eq!(first.version, "", "a new stream starts from no version");
        assert_eq!(first.nonce, "");
        assert_eq!(first.type_url, support::xds::TYPE_URL);
        assert!(first.resource_names.is_empty(), "a wildcard subscription");
        let node = first.node.as_ref().expect("the node is sent");
        assert_eq!(node.id, "envoy-ratelimit");
        let metadata = &node.metadata.as_ref().unwrap().fields;
        let text = |k: &str| match &metadata[k].kind {
            Some(Kind::StringValue(s)) => s.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!((text("cluster"), text("zone")), ("eg".into(), "a=b".into()));
        let ack = server.wait_for(WAIT, acked("1")).await.expect("an ACK");
        assert_eq!(ack.nonce, "1");
    })
    .await;
}

scenarios! {
    rules_arrive_over_xds_and_decide_on_the_embedded_store
        => rules_arrive_over_xds_and_decide(Store::Memory),
    rules_arrive_over_xds_and_decide_on_redis
        => rules_arrive_over_xds_and_decide(Store::Redis),
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_snapshot_changes_the_limits_within_2s() {
    let server = XdsServer::start();
    server.set("1", &[limit_d(100)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OK);
    server.set("2", &[limit_d(0)]);
    let took = until_code(&sluice, "d", &[("k", "y")], OVER_LIMIT, WAIT).await;
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(2)),
        "in force after {took:?}"
    );
    assert!(server.wait_for(WAIT, acked("2")).await.is_some());
    let config: serde_json::Value =
        serde_json::from_str(&http(sluice.http, "GET", "/config", "").2).unwrap();
    let d = &config["domains"][0];
    assert_eq!(
        (&d["file"], &d["line"]),
        (&"xds:d".into(), &serde_json::Value::Null)
    );
    let rlconfig = http(sluice.http, "GET", "/rlconfig", "").2;
    assert!(
        rlconfig.contains("d.k: unit=HOUR requests_per_unit=0"),
        "{rlconfig}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_snapshot_is_nacked_and_the_old_rules_stay() {
    let server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());

    let unknown_unit = domain("d", vec![rule("k", "", RateLimitUnit::Unknown, 5)]);
    let not_a_config = Any {
        type_url: "type.googleapis.com/google.protobuf.Struct".into(),
        value: Vec::new(),
    };
    let bad = [
        (
            "2",
            vec![resource(&limit_d(5)), resource(&limit_d(5))],
            "xds:d: domain: duplicate domain 'd' in config file",
        ),
        (
            "3",
            vec![resource(&unknown_unit)],
            "xds:d: descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'",
        ),
        (
            "4",
            vec![not_a_config],
            "resource 0: a type.googleapis.com/google.protobuf.Struct, not a RateLimitConfig",
        ),
    ];
    for (version, resources, message) in bad {
        // The test server numbers its responses 1, 2…: one per version here.
        let nonce = version;
        server.set_raw(version, resources);
        let nack = server
            .wait_for(WAIT, |r| r.nonce == nonce)
            .await
            .unwrap_or_else(|| panic!("an answer to version {version}"));
        assert_eq!(nack.version, "1", "a NACK names the version in force");
        assert_eq!(nack.error.as_deref(), Some(message));
        assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
    }
    let m = support::metrics::scrape(sluice.http);
    assert_eq!(m.value("ratelimit_service_config_load_success", &[]), 1.0);
    assert_eq!(m.value("ratelimit_service_config_load_error", &[]), 3.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn no_resources_is_an_empty_configuration_and_is_acked() {
    let server = XdsServer::start();
    server.set("1", &[]);
    let sluice = start(Store::Memory, &server, &[]).await;
    let response = sluice.ask(request("d", &[&[("k", "x")]])).await;
    assert_eq!(response.overall_code, OK);
    assert!(response.statuses[0].current_limit.is_none());
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
    assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_server_going_away_and_coming_back_loses_no_rules() {
    let mut server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
    server.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
    assert_eq!(health(&sluice).await, ServingStatus::Serving as i32);

    // A new server process numbers its versions from "1" again.
    let before = server.received().len();
    server.restart();
    server.set(
        "1",
        &[
            limit_d(0),
            domain("e", vec![rule("k", "", RateLimitUnit::Hour, 0)]),
        ],
    );
    assert!(
        until_code(&sluice, "e", &[("k", "x")], OVER_LIMIT, WAIT)
            .await
            .is_some(),
        "the new server's snapshot is taken"
    );
    assert_eq!(
        server.received()[before].version,
        "",
        "the new stream starts from no version"
    );
    assert!(
        server
            .wait_for_from(before, WAIT, acked("1"))
            .await
            .is_some(),
        "the new server's snapshot is ACKed (sluice sends the ACK once the rules are in force)"
    );
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
}

#[tokio::test(flavor = "multi_thread")]
async fn before_the_first_configuration_requests_are_unavailable_and_not_serving() {
    let server = XdsServer::start();
    let target = server.target();
    let sluice = Sluice::spawn(&[], &["--xds-server", &target], None, Wait::Live).await;
    let refused = sluice
        .client()
        .await
        .should_rate_limit(request("d", &[&[("k", "x")]]))
        .await
        .expect_err("no configuration yet");
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert_eq!(refused.message(), "no rate limit configuration loaded");
    assert_eq!(health(&sluice).await, ServingStatus::NotServing as i32);
    assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 503);
    assert_eq!(
        http(sluice.http, "GET", "/healthcheck", "").0,
        200,
        "envoyproxy/ratelimit's health check passes before the first configuration"
    );
    assert!(
        server
            .wait_for(WAIT, |r| r.version.is_empty())
            .await
            .is_some()
    );

    server.set("1", &[limit_d(0)]);
    let started = Instant::now();
    while health(&sluice).await != ServingStatus::Serving as i32 {
        assert!(started.elapsed() < WAIT, "SERVING once configured");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_with_pkcs1_keys_meets_a_tls13_only_server() {
    let dir = tempfile::tempdir().unwrap();
    let certs: Certs = certgen(dir.path());
    let key = std::fs::read_to_string(&certs.client_key).unwrap();
    assert!(key.starts_with("-----BEGIN RSA PRIVATE KEY-----"), "PKCS#1");
    let server = XdsServer::start_tls(ServerTlsFiles {
        ca: certs.ca.clone(),
        cert: certs.server_cert.clone(),
        key: certs.server_key.clone(),
    });
    server.set("1", &[limit_d(0)]);
    let target = format!("127.0.0.1:{}", server.addr.port());
    let (ca, cert, key) = (
        certs.ca.to_str().unwrap(),
        certs.client_cert.to_str().unwrap(),
        certs.client_key.to_str().unwrap(),
    );
    let sluice = Sluice::on(
        Store::Memory,
        &[],
        &[
            "--xds-server",
            &target,
            "--xds-tls-ca",
            ca,
            "--xds-tls-cert",
            cert,
            "--xds-tls-key",
            key,
            "--xds-tls-server-name",
            "localhost",
        ],
    )
    .await;
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_gateway_snapshots_match_requests_as_its_envoy_sends_them() {
    in_one_window(HOUR, async || {
        let route_a = "httproute/default/http-ratelimit/rule/0/match/0/ratelimit_example";
        let a = domain(
            "default/eg/http",
            vec![
                nest(
                    route_a,
                    route_a,
                    vec![rule(
                        "rule-0-match-0",
                        "rule-0-match-0",
                        RateLimitUnit::Hour,
                        3,
                    )],
                ),
                // B: a `*` host, a distinct header, a CIDR with a distinct address under it.
                nest(
                    "httproute/default/api/rule/0/match/0/*",
                    "httproute/default/api/rule/0/match/0/*",
                    vec![nest(
                        "rule-0-match-0",
                        "",
                        vec![nest(
                            "masked_remote_address",
                            "0.0.0.0/0",
                            vec![rule("remote_address", "", RateLimitUnit::Hour, 1)],
                        )],
                    )],
                ),
            ],
        );
        let shared = "test-namespace/test-policy-1";
        let c_key = "test-namespace/test-policy-1/rule/0";
        let c = domain(
            shared,
            vec![nest(
                c_key,
                c_key,
                vec![rule(
                    "rule-0-match-0",
                    "rule-0-match-0",
                    RateLimitUnit::Second,
                    5,
                )],
            )],
        );
        let server = XdsServer::start();
        server.set("7", &[a, c]);
        let sluice = start(
            Store::Memory,
            &server,
            &["--xds-node-id", "envoy-ratelimit"],
        )
        .await;

        let asked = [(route_a, route_a), ("rule-0-match-0", "rule-0-match-0")];
        let response = sluice.ask(request("default/eg/http", &[&asked])).await;
        let status = &response.statuses[0];
        assert_eq!(response.overall_code, OK);
        let limit = status.current_limit.as_ref().expect("the A limit applies");
        assert_eq!(
            (limit.requests_per_unit, limit.unit, limit.name.as_str()),
            (3, 3, "")
        );
        assert_eq!(status.limit_remaining, 2);

        let b_route = "httproute/default/api/rule/0/match/0/*";
        let b = |user: &'static str, ip: &'static str| {
            [
                (b_route, b_route),
                ("rule-0-match-0", user),
                ("masked_remote_address", "0.0.0.0/0"),
                ("remote_address", ip),
            ]
        };
        assert_eq!(
            code(&sluice, "default/eg/http", &b("alice", "10.1.2.3")).await,
            OK
        );
        assert_eq!(
            code(&sluice, "default/eg/http", &b("alice", "10.1.2.3")).await,
            OVER_LIMIT
        );
        assert_eq!(
            code(&sluice, "default/eg/http", &b("alice", "10.1.2.4")).await,
            OK
        );
        assert_eq!(
            code(&sluice, "default/eg/http", &b("bob", "10.1.2.3")).await,
            OK
        );
        // A route whose name is not in the snapshot matches no rule, `*` in the key or not.
        let other = "httproute/default/other/rule/0/match/0/*";
        let unknown_route = [(other, other), ("rule-0-match-0", "alice")];
        let response = sluice
            .ask(request("default/eg/http", &[&unknown_route]))
            .await;
        assert!(response.statuses[0].current_limit.is_none());

        let asked_c = [(c_key, c_key), ("rule-0-match-0", "rule-0-match-0")];
        let response = sluice.ask(request(shared, &[&asked_c])).await;
        let limit = response.statuses[0]
            .current_limit
            .as_ref()
            .expect("the C limit applies");
        assert_eq!((limit.requests_per_unit, limit.unit), (5, 1));
    })
    .await;
}

/// `n` domains (resources) of 20 rules each.
fn many_domains(n: usize) -> Vec<RateLimitConfig> {
    (0..n)
        .map(|i| {
            let rules = (0..20)
                .map(|j| rule(&format!("k{j}"), "", RateLimitUnit::Hour, 10))
                .collect();
            domain(&format!("d{i}"), rules)
        })
        .collect()
}

/// `GET /healthz`, given at most `limit` to answer: its status, or `None` without an answer.
fn healthz_within(addr: std::net::SocketAddr, limit: Duration) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, limit).ok()?;
    stream.set_read_timeout(Some(limit)).ok()?;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    String::from_utf8_lossy(&raw)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn probes_are_answered_while_a_large_snapshot_is_converted() {
    const PROMPT: Duration = Duration::from_secs(2);
    let server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());

    let mut large = many_domains(5_000);
    large.push(limit_d(0));
    server.set("2", &large);
    let http = sluice.http;
    let probes = tokio::task::block_in_place(|| {
        let started = Instant::now();
        let mut probes = 0;
        while !server.received().iter().any(|r| acked("2")(r)) {
            assert!(started.elapsed() < Duration::from_secs(120), "no ACK");
            assert_eq!(
                healthz_within(http, PROMPT),
                Some(200),
                "/healthz answers within {PROMPT:?} while the snapshot is converted"
            );
            probes += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        probes
    });
    assert!(probes > 0);
    assert_eq!(code(&sluice, "d4999", &[("k19", "x")]).await, OK);
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resent_unchanged_snapshot_is_acked_without_being_converted_again() {
    let server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &["--log-level", "info"]).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
    assert!(!sluice.log_text().contains("not converted again"));

    // SIGHUP starts a new stream, on which the server sends the same snapshot again.
    support::redis::signal(sluice.pid(), "HUP");
    let started = Instant::now();
    while server.received().iter().filter(|r| acked("1")(r)).count() < 2 {
        assert!(started.elapsed() < WAIT, "the re-sent snapshot is ACKed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = sluice.log_text();
    assert!(
        log.contains("xDS version 1: the resources in force, not converted again"),
        "{log}"
    );
    assert_eq!(log.matches("rules loaded").count(), 1, "{log}");
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
}

/// Domain `deep`: one rule under `levels` nested descriptors.
fn nested(levels: usize) -> RateLimitConfig {
    let mut d = rule("k", "", RateLimitUnit::Hour, 1);
    for _ in 1..levels {
        d = nest("k", "", vec![d]);
    }
    domain("deep", vec![d])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resource_nested_too_deep_is_nacked_and_the_old_rules_stay() {
    let server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());

    let deepest = sluice_core::config::MOST_DESCRIPTOR_DEPTH;
    server.set("2", &[limit_d(5), nested(deepest)]);
    assert!(server.wait_for(WAIT, acked("2")).await.is_some());
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OK);

    for (version, levels) in [("3", deepest + 1), ("4", 1_000)] {
        server.set(version, &[limit_d(0), nested(levels)]);
        let nack = server
            .wait_for(WAIT, |r| r.nonce == version)
            .await
            .unwrap_or_else(|| panic!("an answer to version {version}"));
        assert_eq!(nack.version, "2", "{levels} levels are NACKed");
        let error = nack.error.unwrap();
        assert!(error.starts_with("xds:deep: "), "{error}");
        if levels == deepest + 1 {
            assert!(error.contains(&format!("deeper than {deepest}")), "{error}");
        }
        assert_eq!(code(&sluice, "d", &[("k", "y")]).await, OK);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn many_bad_resources_sent_again_and_again_give_a_few_log_lines_and_a_short_nack() {
    const BAD: usize = 2_000;
    let server = XdsServer::start();
    server.set("1", &[limit_d(0)]);
    let sluice = start(Store::Memory, &server, &[]).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
    let lines_before = sluice.log_text().lines().count();

    let bad: Vec<RateLimitConfig> = (0..BAD)
        .map(|i| {
            let unknown_unit = rule("k", "", RateLimitUnit::Unknown, 1);
            domain(&format!("bad{i}"), vec![unknown_unit])
        })
        .collect();
    let started = Instant::now();
    for n in 2..22 {
        let version = n.to_string();
        server.set(&version, &bad);
        let nack = server
            .wait_for(Duration::from_secs(30), |r| r.nonce == version)
            .await
            .unwrap_or_else(|| panic!("an answer to version {version}"));
        let error = nack.error.expect("a NACK");
        assert!(error.len() <= 16 * 1024, "{} bytes", error.len());
        assert!(
            error.starts_with(
                "xds:bad0: descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'\n\
                 xds:bad1: descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'\n"
            ),
            "{error}"
        );
        assert!(error.contains(&format!("{BAD} errors in all")), "{error}");
    }
    // Repeated rejections are logged at most once a second.
    let seconds = started.elapsed().as_secs() as usize;
    let lines = sluice.log_text().lines().count() - lines_before;
    assert!(lines <= seconds + 2, "{lines} lines in {seconds} s");
    assert_eq!(code(&sluice, "d", &[("k", "x")]).await, OVER_LIMIT);
}

/// An xDS server serving one rule, a sluice following it with freed pages returned at once,
/// and its resident memory once settled, in kB.
async fn settled_on_one_rule() -> (XdsServer, Sluice, u64) {
    let server = XdsServer::start();
    server.set("1", &[limit_d(5)]);
    let target = server.target();
    let flags = ["--xds-server", target.as_str()];
    let sluice = Sluice::spawn(&[], &flags, FREED_PAGES_RETURNED, Wait::Serving).await;
    assert!(server.wait_for(WAIT, acked("1")).await.is_some());
    let before = settled_resident_kb(sluice.pid()).await;
    (server, sluice, before)
}

/// Rules in the snapshot whose memory is measured.
const MEASURED_RULES: usize = 40_000;
/// The most resident memory one rule of a snapshot may add, in bytes: the rule itself, its
/// share of the response kept as its source, and what the allocator keeps of the conversion
/// (measured: 370 to 530).
const MOST_BYTES_PER_RULE: u64 = 800;

/// A snapshot of 40,000 rules in place of one of one rule adds under `MOST_BYTES_PER_RULE` each
/// to the resident memory of sluice, once in force and settled: the thread that converted it has
/// ended. Measured in one process, before and after, so that what differs from one process to
/// the next (its threads' stacks and heaps) is not counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_rule_served_over_xds_holds_under_800_bytes() {
    let (server, sluice, before) = settled_on_one_rule().await;
    let many = (0..MEASURED_RULES)
        .map(|v| rule("k", &format!("v{v:07}"), RateLimitUnit::Second, 5))
        .collect();
    server.set("2", &[limit_d(5), domain("big", many)]);
    assert!(server.wait_for(WAIT * 4, acked("2")).await.is_some());
    let grown_kb = settled_resident_kb(sluice.pid())
        .await
        .saturating_sub(before);
    let per_rule = grown_kb * 1024 / MEASURED_RULES as u64;
    assert!(per_rule < MOST_BYTES_PER_RULE, "{per_rule} bytes a rule");
}

/// Resources in the large snapshot, each a domain of `RULES_PER_RESOURCE` rules: the shape of a
/// gateway with many tenants, each with a few routes.
const RESOURCES: usize = 30_000;
const RULES_PER_RESOURCE: usize = 16;
/// The most resident memory the large snapshot may add, at its peak as settled, in MB
/// (measured: 275 at the peak, 260 settled).
const MOST_MB_FOR_RESOURCES: u64 = 300;
/// Bad resources in each of the snapshots rejected after the large one.
const BAD_RESOURCES: usize = 20_000;

/// A snapshot of 30,000 resources of 16 rules (480,000 rules, an 18 MB response), then five
/// snapshots of 20,000 bad resources, add under `MOST_MB_FOR_RESOURCES` to the resident memory
/// of sluice, against a snapshot of one rule, at the peak (what a pod's memory limit is judged
/// on) and settled, the allocator told to return freed pages at once: under 660 bytes a rule,
/// all included (the rules, their series, the response kept as their source, the gRPC stream's
/// buffer, the conversion beside the rules in force, the swap).
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_of_30_000_resources_of_16_rules_adds_under_300_mb() {
    let (server, sluice, before) = settled_on_one_rule().await;
    reset_peak(sluice.pid());
    let tenants: Vec<RateLimitConfig> = (0..RESOURCES)
        .map(|t| {
            let routes = (0..RULES_PER_RESOURCE)
                .map(|r| {
                    rule(
                        "generic_key",
                        &format!("route-{t}-{r}"),
                        RateLimitUnit::Minute,
                        100,
                    )
                })
                .collect();
            domain(&format!("tenant-{t:05}"), routes)
        })
        .collect();
    let response_mb = tenants
        .iter()
        .map(|t| prost::Message::encoded_len(t) as f64)
        .sum::<f64>()
        / 1e6;
    server.set("2", &tenants);
    drop(tenants);
    assert!(
        server.wait_for(WAIT * 12, acked("2")).await.is_some(),
        "the large snapshot is put in force"
    );
    assert_eq!(
        code(
            &sluice,
            "tenant-29999",
            &[("generic_key", "route-29999-15")]
        )
        .await,
        OK
    );
    let grown_mb = settled_resident_kb(sluice.pid())
        .await
        .saturating_sub(before)
        / 1024;
    let bad: Vec<RateLimitConfig> = (0..BAD_RESOURCES)
        .map(|i| {
            let unknown_unit = rule("k", "", RateLimitUnit::Unknown, 1);
            domain(&format!("bad{i}"), vec![unknown_unit])
        })
        .collect();
    for n in 3..8 {
        let version = n.to_string();
        server.set(&version, &bad);
        let nack = server
            .wait_for(WAIT * 4, |r| r.nonce == version)
            .await
            .unwrap_or_else(|| panic!("an answer to version {version}"));
        assert!(nack.error.is_some(), "version {version} is rejected");
    }
    let peak_mb = memory_kb(sluice.pid(), "VmHWM").saturating_sub(before) / 1024;
    assert!(
        peak_mb < MOST_MB_FOR_RESOURCES,
        "{peak_mb} MB at the peak for {} rules in a response of {response_mb:.1} MB",
        RESOURCES * RULES_PER_RESOURCE
    );
    assert!(
        grown_mb < MOST_MB_FOR_RESOURCES,
        "{grown_mb} MB for {} rules in a response of {response_mb:.1} MB",
        RESOURCES * RULES_PER_RESOURCE
    );
}
