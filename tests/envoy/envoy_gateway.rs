//! sluice swapped in for envoyproxy/ratelimit under Envoy Gateway, end to end. sluice runs as
//! `ratelimit` with the environment Envoy Gateway renders for that container (its exact
//! variables, ports aside), takes its rules over xDS from a test ADS server that requires TLS 1.3
//! and a client certificate (as Envoy Gateway's does), and counts in a real Redis. A real Envoy
//! 1.40, configured with the rate limit actions Envoy Gateway generates, asks it over TLS with a
//! client certificate and no SNI. The cases are those of Envoy Gateway's own rate limit
//! end-to-end tests: a CIDR selector, header selectors, shadow mode, a shared limit with a
//! request cost, and request and response costs; the answers and headers are those tests'.
//! Needs the Envoy binary: `scripts/test` installs it, or `SLUICE_ENVOY=/path/to/envoy`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::ratelimit::config::ratelimit::v3::{RateLimitDescriptor, RateLimitUnit};
use support::envoy::{Envoy, Front, Upstream, UpstreamTls, bootstrap_with, envoy_binary, header};
use support::metrics::{Scrape, scrape_at};
use support::ratelimit::{ENVOY_GATEWAY, Ratelimit};
use support::xds::{Certs, ServerTlsFiles, XdsServer, certgen, domain, nest, rule};
use support::{HOUR, exchange, free_port, http, in_one_window};

/// Envoy Gateway's listener domain for Gateway `default/eg`, listener `http`.
const DOMAIN: &str = "default/eg/http";
/// The domain of a shared rule: its policy's namespace and name.
const SHARED: &str = "default/shared-policy";

/// The route names Envoy Gateway gives its rules (`httproute/<ns>/<name>/rule/<r>/match/<m>/<host>`,
/// a `*` host as is).
const CIDR: &str = "httproute/default/cidr-ratelimit/rule/0/match/0/*";
const HEADERS: &str = "httproute/default/header-ratelimit/rule/0/match/0/*";
const SHADOW: &str = "httproute/default/shadow-ratelimit/rule/0/match/0/*";
const SHARED_RULE: &str = "default/shared-policy/rule/0";
const COST: &str = "httproute/default/token-ratelimit/rule/0/match/0/*";

/// The environment Envoy Gateway renders for its rate limit container (ENVOY-GATEWAY.md §1.3),
/// with this test's addresses and files in place of the cluster's.
fn envoy_gateways_environment<'a>(
    certs: &'a Certs,
    xds: &'a str,
    redis: &'a str,
    metrics: &'a str,
    mapper: &'a str,
) -> Vec<(&'static str, &'a str)> {
    let text = |p: &'a std::path::Path| p.to_str().expect("a UTF-8 path");
    let here = |name: &str| -> Option<&'a str> {
        Some(match name {
            "CONFIG_GRPC_XDS_SERVER_URL" => xds,
            "GRPC_SERVER_TLS_CERT" => text(&certs.server_cert),
            "GRPC_SERVER_TLS_KEY" => text(&certs.server_key),
            "GRPC_SERVER_TLS_CA_CERT" | "CONFIG_GRPC_XDS_SERVER_TLS_CACERT" => text(&certs.ca),
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT" => text(&certs.client_cert),
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY" => text(&certs.client_key),
            "REDIS_URL" => redis,
            "PROMETHEUS_ADDR" => metrics,
            "PROMETHEUS_MAPPER_YAML" => mapper,
            _ => return None,
        })
    };
    let mut env: Vec<(&'static str, &'a str)> = ENVOY_GATEWAY
        .iter()
        .map(|&(name, value)| (name, here(name).unwrap_or(value)))
        .collect();
    // Not Envoy Gateway's: a debug build on a busy 2-core machine may take longer than the
    // 10 ms sluice gives Redis by default.
    env.push(("REDIS_TIMEOUT", "2s"));
    env
}

/// The rules Envoy Gateway sends for the cases below: one listener domain and one shared one.
fn snapshot() -> Vec<envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig> {
    let hour = |key: &str, value: &str, n| rule(key, value, RateLimitUnit::Hour, n);
    let shadowed = |mut d: RateLimitDescriptor| {
        fn shadow(d: &mut RateLimitDescriptor) {
            d.shadow_mode = true;
            d.descriptors.iter_mut().for_each(shadow);
        }
        shadow(&mut d);
        d
    };
    vec![
        domain(
            DOMAIN,
            vec![
                // A CIDR selector: every IPv4 client, 3 per hour.
                nest(
                    CIDR,
                    CIDR,
                    vec![hour("masked_remote_address", "0.0.0.0/0", 3)],
                ),
                // Two exact header selectors, both needed.
                nest(
                    HEADERS,
                    HEADERS,
                    vec![nest(
                        "rule-0-match-0",
                        "rule-0-match-0",
                        vec![hour("rule-0-match-1", "rule-0-match-1", 3)],
                    )],
                ),
                // Shadow mode sets `shadow_mode` on every node of the rule's chain.
                shadowed(nest(
                    SHADOW,
                    SHADOW,
                    vec![hour("masked_remote_address", "0.0.0.0/0", 1)],
                )),
                // A distinct header (one counter per user), with a request and a response cost.
                nest(COST, COST, vec![hour("rule-0-match-0", "", 1000)]),
            ],
        ),
        domain(
            SHARED,
            vec![nest(
                SHARED_RULE,
                SHARED_RULE,
                vec![hour("rule-0-match--1", "rule-0-match--1", 4)],
            )],
        ),
    ]
}

/// Envoy's routes as Envoy Gateway writes them: the rule's actions in each route's
/// `RateLimitPerRoute`, with its domain.
fn routes() -> String {
    let route = |prefix: &str, domain: &str, rate_limits: &str| {
        format!(
            r#"- match: {{ prefix: {prefix} }}
  route: {{ cluster: upstream }}
  typed_per_filter_config:
    envoy.filters.http.ratelimit:
      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
      domain: {domain}
      rate_limits:{rate_limits}
"#
        )
    };
    let key = |k: &str| format!("{{ descriptor_key: \"{k}\", descriptor_value: \"{k}\" }}");
    let any_ipv4 = |key_of: &str| {
        format!(
            "\n          - remote_address_match: {{ descriptor_key: {key_of}, descriptor_value: 0.0.0.0/0, address_matcher: {{ ranges: [{{ address_prefix: 0.0.0.0, prefix_len: 0 }}] }} }}"
        )
    };
    let header = |n: u32, name: &str, value: &str| {
        format!(
            "\n          - header_value_match: {{ descriptor_key: rule-0-match-{n}, descriptor_value: rule-0-match-{n}, expect_match: true, headers: [{{ name: {name}, string_match: {{ exact: {value} }} }}] }}"
        )
    };
    let shared = format!(
        "\n        - actions:\n          - generic_key: {}\n          - generic_key: {}\n          hits_addend: {{ number: 2 }}",
        key(SHARED_RULE),
        key("rule-0-match--1")
    );
    let cost_actions = format!(
        "\n          - generic_key: {}\n          - request_headers: {{ header_name: x-user-id, descriptor_key: rule-0-match-0 }}",
        key(COST)
    );
    [
        route(
            "/cidr",
            DOMAIN,
            &format!(
                "\n        - actions:\n          - generic_key: {}{}",
                key(CIDR),
                any_ipv4("masked_remote_address")
            ),
        ),
        route(
            "/headers",
            DOMAIN,
            &format!(
                "\n        - actions:\n          - generic_key: {}{}{}",
                key(HEADERS),
                header(0, "x-user-id", "one"),
                header(1, "x-user-org", "acme")
            ),
        ),
        route(
            "/shadow",
            DOMAIN,
            &format!(
                "\n        - actions:\n          - generic_key: {}{}",
                key(SHADOW),
                any_ipv4("masked_remote_address")
            ),
        ),
        route("/shared-a", SHARED, &shared),
        route("/shared-b", SHARED, &shared),
        route(
            "/llm",
            DOMAIN,
            &format!(
                "\n        - actions:{cost_actions}\n          hits_addend: {{ number: 0 }}\n        - actions:{cost_actions}\n          hits_addend: {{ format: \"%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%\" }}\n          apply_on_stream_done: true"
            ),
        ),
    ]
    .concat()
}

/// Envoy's HTTP filters as Envoy Gateway writes them (the token count an AI gateway would put in
/// dynamic metadata comes here from the upstream's `x-tokens` header).
const FILTERS: &str = r#"- name: envoy.filters.http.header_to_metadata
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
    response_rules:
      - header: x-tokens
        on_header_present: { metadata_namespace: io.envoy.ai_gateway, key: llm_total_token, type: NUMBER }
- name: envoy.filters.http.ratelimit
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
    domain: default/eg/http
    failure_mode_deny: true
    enable_x_ratelimit_headers: DRAFT_VERSION_03
    disable_x_envoy_ratelimited_header: true
    timeout: 2s
    rate_limit_service:
      grpc_service:
        envoy_grpc: { cluster_name: ratelimit }
      transport_api_version: V3"#;

/// Everything of one run: the xDS server, sluice as `ratelimit`, the upstream and Envoy.
struct Gateway {
    _xds: XdsServer,
    _ratelimit: Ratelimit,
    metrics: SocketAddr,
    upstream: Upstream,
    envoy: Envoy,
    _certs: tempfile::TempDir,
}

impl Gateway {
    async fn start(test: &str) -> Gateway {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let certs = certgen(dir.path());
        let xds = XdsServer::start_tls(ServerTlsFiles {
            ca: certs.ca.clone(),
            cert: certs.server_cert.clone(),
            key: certs.server_key.clone(),
        });
        xds.set("1", &snapshot());
        let redis = support::redis::standalone();
        let redis_url = format!("127.0.0.1:{}", redis.ports[0]);
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let metrics_text = metrics.to_string();
        let mapper = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/metrics/envoy-gateway-mapper.yaml"
        );
        let target = xds.target();
        let prefix = format!("eg-{test}-{}-{}:", std::process::id(), support::unix_ms());
        let mut env =
            envoy_gateways_environment(&certs, &target, &redis_url, &metrics_text, mapper);
        env.push(("CACHE_KEY_PREFIX", &prefix));
        let ratelimit = Ratelimit::start("", &env);
        ready(&ratelimit).await;
        let upstream = Upstream::start();
        let tls = UpstreamTls {
            ca: &certs.ca,
            name: "",
            client: Some((&certs.client_cert, &certs.client_key)),
        };
        let front = Front {
            routes: &routes(),
            filters: FILTERS,
        };
        let envoy = Envoy::launch(&envoy_binary(), &|listener, admin| {
            bootstrap_with(
                listener,
                admin,
                upstream.addr,
                ratelimit.grpc,
                &front,
                Some(&tls),
            )
        });
        Gateway {
            _xds: xds,
            _ratelimit: ratelimit,
            metrics,
            upstream,
            envoy,
            _certs: dir,
        }
    }

    /// A GET of `path` with request `headers`: the status and the response headers.
    fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let (status, headers, _) = exchange(self.envoy.listener, head.as_bytes());
        (status, headers)
    }

    fn statuses(&self, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
        (0..n).map(|_| self.get(path, headers).0).collect()
    }

    fn metrics(&self) -> Scrape {
        scrape_at(self.metrics, "/metrics")
    }
}

/// Waits (at most 20 s) until sluice has its first rules over xDS and reaches Redis.
async fn ready(ratelimit: &Ratelimit) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while http(ratelimit.http, "GET", "/readyz", "").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready within 20 s:\n{}",
            ratelimit.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A per-rule series of Envoy Gateway's mapping (`domain`, `key1`, `key2`).
fn series(scrape: &Scrape, stat: &str, key1: &str, key2: &str) -> f64 {
    scrape.value(
        &format!("ratelimit_service_rate_limit_{stat}"),
        &[("domain", DOMAIN), ("key1", key1), ("key2", key2)],
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cidr_selector_allows_three_an_hour_with_envoy_gateways_headers_and_metrics() {
    in_one_window(HOUR, async || {
        let gw = Gateway::start("cidr").await;
        for n in 1..=3 {
            let (status, headers) = gw.get("/cidr", &[]);
            assert_eq!(status, 200, "request {n}: {headers:?}");
            assert_eq!(header(&headers, "x-ratelimit-limit"), Some("3, 3;w=3600"));
            assert_eq!(
                header(&headers, "x-ratelimit-remaining"),
                Some((3 - n).to_string().as_str())
            );
        }
        let served = gw.upstream.served();
        assert_eq!(gw.get("/cidr", &[]).0, 429);
        assert_eq!(
            gw.upstream.served(),
            served,
            "a 429 never reaches the upstream"
        );

        // Envoy Gateway's dashboard and e2e test read these series; counted as envoyproxy/ratelimit
        // counts: 4 hits, 3 within the limit (the third past the near-limit threshold), 1 over.
        let m = gw.metrics();
        let key1 = format!("{CIDR}_{CIDR}");
        let key2 = "masked_remote_address_0_0_0_0/0";
        let counts = ["total_hits", "within_limit", "near_limit", "over_limit"]
            .map(|stat| series(&m, stat, &key1, key2));
        assert_eq!(counts, [4.0, 3.0, 1.0, 1.0], "total, within, near, over");
        assert!(m.get("go_memstats_gc_cpu_fraction", &[]).is_some());
        assert!(m.get("process_resident_memory_bytes", &[]).is_some());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn header_selectors_limit_only_requests_with_every_header() {
    in_one_window(HOUR, async || {
        let gw = Gateway::start("headers").await;
        let one = [("x-user-id", "one")];
        assert_eq!(
            gw.statuses("/headers", &one, 4),
            [200; 4],
            "one matched header is not the rule"
        );
        let both = [("x-user-id", "one"), ("x-user-org", "acme")];
        let (status, headers) = gw.get("/headers", &both);
        assert_eq!(status, 200);
        assert_eq!(header(&headers, "x-ratelimit-limit"), Some("3, 3;w=3600"));
        assert_eq!(gw.statuses("/headers", &both, 3), [200, 200, 429]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn shadow_mode_never_limits_but_counts_what_it_would_have() {
    in_one_window(HOUR, async || {
        let gw = Gateway::start("shadow").await;
        assert_eq!(gw.statuses("/shadow", &[], 4), [200; 4]);
        let m = gw.metrics();
        let key1 = format!("{SHADOW}_{SHADOW}");
        let key2 = "masked_remote_address_0_0_0_0/0";
        assert_eq!(series(&m, "shadow_mode", &key1, key2), 3.0);
        assert_eq!(series(&m, "total_hits", &key1, key2), 4.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_limit_with_a_request_cost_counts_every_route_together() {
    in_one_window(HOUR, async || {
        let gw = Gateway::start("shared").await;
        let (status, headers) = gw.get("/shared-a", &[]);
        assert_eq!(status, 200);
        assert_eq!(header(&headers, "x-ratelimit-limit"), Some("4, 4;w=3600"));
        assert_eq!(gw.get("/shared-b", &[]).0, 200, "two requests of cost 2");
        assert_eq!(gw.get("/shared-a", &[]).0, 429, "the shared 4 are spent");
        assert_eq!(gw.get("/shared-b", &[]).0, 429);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn request_and_response_costs_hold_a_token_budget() {
    in_one_window(HOUR, async || {
        let gw = Gateway::start("tokens").await;
        let call = |user: &str, tokens: u64| {
            gw.get(
                "/llm",
                &[("x-user-id", user), ("x-cost", &tokens.to_string())],
            )
            .0
        };
        // The response cost is charged once the response is done: wait for each charge to land.
        let spent = |expected: f64| {
            let deadline = Instant::now() + Duration::from_secs(5);
            let key1 = format!("{COST}_{COST}");
            while series(&gw.metrics(), "total_hits", &key1, "rule-0-match-0") < expected {
                assert!(Instant::now() < deadline, "{expected} tokens not charged");
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        assert_eq!(call("alice", 400), 200);
        spent(400.0);
        assert_eq!(call("alice", 400), 200);
        spent(800.0);
        assert_eq!(call("alice", 400), 200, "200 tokens left: one more call");
        spent(1200.0);
        assert_eq!(call("alice", 400), 429, "the budget is spent");
        assert_eq!(
            call("bob", 10),
            200,
            "a distinct header: bob's budget is his own"
        );
    })
    .await;
}
