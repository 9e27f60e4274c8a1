//! A token budget through a real Envoy, as Envoy Gateway and Envoy AI Gateway express one: the
//! rate limit filter checks the budget when a request comes (`hits_addend: 0`) and, once the
//! response is done (`apply_on_stream_done`), charges the tokens the upstream reported, read
//! from dynamic metadata that Envoy's `header_to_metadata` filter sets from the response's
//! `x-tokens` header. The rate limits sit in the route's `RateLimitPerRoute`, as Envoy Gateway
//! puts them (Envoy reads `hits_addend` there). With `counting: always` (envoyproxy/ratelimit's counting) the budget holds:
//! a charge past it lands, and the next request is refused.
//! Needs the Envoy binary: `scripts/test` installs it, or `SLUICE_ENVOY=/path/to/envoy`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::google::protobuf::UInt64Value;
use support::envoy::{Envoy, Front, Upstream, bootstrap_with, envoy_binary, ratelimit_filter};
use support::metrics::scrape;
use support::{HOUR, Sluice, exchange, in_one_window, request};

const RULES: &str = "\
domain: llm
descriptors:
  - key: user
    counting: always
    rate_limit:
      unit: hour
      requests_per_unit: 1000
";

/// The same budget counted sluice's default way: a charge that does not fit is refused.
const ADMITTED: &str = "\
domain: llm
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 1000
";

/// Envoy in front of `upstream`: every request on `/` is checked against the `user` header's
/// budget of `domain`, and charged the response's `x-tokens` when done.
pub(super) fn bootstrap(
    domain: &str,
    listener: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
    ratelimit: SocketAddr,
) -> String {
    let filters = format!(
        r#"- name: envoy.filters.http.header_to_metadata
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
    response_rules:
      - header: x-tokens
        on_header_present: {{ metadata_namespace: sluice.test, key: tokens, type: NUMBER }}
{}"#,
        ratelimit_filter(domain, true, Duration::from_secs(5))
    );
    let front = Front {
        routes: r#"- match: { prefix: / }
  route: { cluster: upstream }
  typed_per_filter_config:
    envoy.filters.http.ratelimit:
      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
      rate_limits:
        - actions:
            - request_headers: { header_name: x-user, descriptor_key: user }
          hits_addend: { number: 0 }
        - actions:
            - request_headers: { header_name: x-user, descriptor_key: user }
          hits_addend: { format: "%DYNAMIC_METADATA(sluice.test:tokens)%" }
          apply_on_stream_done: true"#,
        filters: &filters,
    };
    bootstrap_with(listener, admin, upstream, ratelimit, &front, None)
}

/// A request as `user`, for which the upstream will report `tokens` used; its status.
fn call(envoy: &Envoy, user: &str, tokens: u64) -> u16 {
    let head = format!(
        "GET / HTTP/1.1\r\nHost: localhost\r\nx-user: {user}\r\nx-cost: {tokens}\r\nConnection: close\r\n\r\n"
    );
    exchange(envoy.listener, head.as_bytes()).0
}

/// What is left of `user`'s budget, asked without charging anything.
async fn left(sluice: &Sluice, user: &str) -> u32 {
    let mut check = request("llm", &[&[("user", user)]]);
    check.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    sluice.ask(check).await.statuses[0].limit_remaining
}

/// Waits (at most 5 s) until `user`'s budget shows `expected` left: Envoy charges after the
/// response has reached the client.
async fn charged(sluice: &Sluice, user: &str, expected: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = left(sluice, user).await;
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{user}'s budget shows {now} left, not {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_budget_charged_after_the_response_holds_through_envoy() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let sluice = Sluice::start(RULES).await;
        let upstream = Upstream::start();
        let envoy = Envoy::launch(&binary, &|listener, admin| {
            bootstrap("llm", listener, admin, upstream.addr, sluice.grpc)
        });

        assert_eq!(call(&envoy, "alice", 400), 200);
        charged(&sluice, "alice", 600).await;
        assert_eq!(call(&envoy, "alice", 400), 200);
        charged(&sluice, "alice", 200).await;
        assert_eq!(
            call(&envoy, "alice", 400),
            200,
            "200 tokens left: the request goes through and uses 400"
        );
        charged(&sluice, "alice", 0).await;
        let served = upstream.served();
        assert_eq!(call(&envoy, "alice", 400), 429, "the budget is spent");
        assert_eq!(
            upstream.served(),
            served,
            "a refused request never reaches the upstream"
        );
        assert_eq!(call(&envoy, "bob", 10), 200, "bob's budget is his own");
    })
    .await;
}

/// The reason `counting: always` exists: counted sluice's default way, the charge that does not
/// fit is refused (Envoy ignores that answer), so the user is never stopped.
#[tokio::test(flavor = "multi_thread")]
async fn counted_admitted_a_charge_that_does_not_fit_is_lost_and_the_budget_leaks() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let sluice = Sluice::start(ADMITTED).await;
        let upstream = Upstream::start();
        let envoy = Envoy::launch(&binary, &|listener, admin| {
            bootstrap("llm", listener, admin, upstream.addr, sluice.grpc)
        });

        assert_eq!(call(&envoy, "carol", 600), 200);
        charged(&sluice, "carol", 400).await;
        for _ in 0..3 {
            assert_eq!(call(&envoy, "carol", 600), 200);
        }
        // Each refused charge counts its 600 hits as over the limit once sluice has answered it.
        let deadline = Instant::now() + Duration::from_secs(5);
        let user = [("domain", "llm"), ("descriptor", "user")];
        while scrape(sluice.http).value("sluice_rule_over_limit_total", &user) < 1800.0 {
            assert!(Instant::now() < deadline, "Envoy sent the three charges");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            left(&sluice, "carol").await,
            400,
            "every later charge of 600 was refused, so nothing more was counted"
        );
    })
    .await;
}
