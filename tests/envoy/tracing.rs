//! Traces (OpenTelemetry, OTLP) to a collector on loopback: a real Envoy's span and sluice's
//! spans in one trace with the right parent; the sampling ratio where the caller did not decide,
//! and the caller's decision where it did; the batched Redis call's span linked to every request
//! it carried; envoyproxy/ratelimit's tracing environment; a dead collector, which changes no
//! decision and drops spans, counted, nor grows the process whatever the requests hold; and
//! strings cut to their bound in every span. Needs the Envoy binary: `scripts/test` installs it, or
//! `SLUICE_ENVOY=/path/to/envoy`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::envoy::{ENVOY_SERVICE, Envoy, Filter, Upstream, envoy_binary, get_with_headers};
use support::metrics::scrape;
use support::otlp::{Collector, Span};
use support::ratelimit::Ratelimit;
use support::{MINUTE, OK, OVER_LIMIT, Sluice, in_one_window, memory_kb, redis, request};
use tonic::transport::Channel;

const CALL: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// How long spans may take to reach the collector: Envoy flushes every 200 ms here, sluice
/// every second.
const ARRIVAL: Duration = Duration::from_secs(20);

/// Three requests a minute per user.
const RULES: &str = "
domain: traced
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
";

/// The `x-user` header as the `user` descriptor.
const FILTER: Filter = Filter {
    domain: "traced",
    actions: &["request_headers: { header_name: x-user, descriptor_key: user }"],
    failure_mode_deny: true,
    timeout: Duration::from_secs(2),
};

/// A user id: personal data that no span may carry unless asked.
const USER: &str = "alice-7f3a9c";

fn calls(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| s.name == CALL).collect()
}

/// sluice on `rules`, exporting its spans over OTLP/gRPC to `endpoint`, with `flags` besides.
async fn tracing_to(endpoint: &str, rules: &str, flags: &[&str]) -> Sluice {
    let mut all = vec!["--tracing", "grpc", "--tracing-endpoint", endpoint];
    all.extend_from_slice(flags);
    Sluice::start_with(&[("rules.yaml", rules)], &all).await
}

/// A collector that takes connections (the kernel accepts them) and never answers, and its URL.
fn silent_collector() -> (std::net::TcpListener, String) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    (silent, endpoint)
}

/// The connection of the first export to reach the silent collector `silent`, once it has come
/// (for at most 10 s): the export waits for an answer that never comes, as long as it is held.
async fn export_waiting(silent: &std::net::TcpListener) -> std::net::TcpStream {
    silent.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match silent.accept() {
            Ok((connection, _)) => return connection,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("no export reached the collector: {e}"),
        }
    }
}

fn by_id<'a>(spans: &'a [Span], id: &str) -> Option<&'a Span> {
    spans.iter().find(|s| s.span_id == id)
}

#[tokio::test(flavor = "multi_thread")]
async fn envoys_span_and_sluices_spans_are_one_trace_with_the_right_parents() {
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.grpc);
    let sluice = tracing_to(&endpoint, RULES, &[]).await;
    let upstream = Upstream::start();
    let envoy = Envoy::start_traced(
        &envoy_binary(),
        upstream.addr,
        sluice.grpc,
        &FILTER,
        collector.grpc,
    );
    // Every attempt's answers (a second attempt, with a user of its own, only when a minute
    // ended during the first).
    let mut answered = Vec::new();
    let mut attempt = 0;
    in_one_window(MINUTE, async || {
        attempt += 1;
        let user = format!("{USER}-{attempt}");
        let statuses: Vec<u16> = (0..4)
            .map(|_| get_with_headers(envoy.listener, "/", &[("x-user", user.as_bytes())]).0)
            .collect();
        answered.extend(
            statuses
                .iter()
                .map(|&s| if s == 200 { "OK" } else { "OVER_LIMIT" }),
        );
        assert_eq!(statuses, [200, 200, 200, 429]);
    })
    .await;

    let spans = collector
        .until(
            "a ShouldRateLimit span per request with its Envoy parents",
            ARRIVAL,
            |spans| {
                let calls = calls(spans);
                calls.len() >= answered.len()
                    && calls.iter().all(|c| {
                        by_id(spans, &c.parent).is_some_and(|p| by_id(spans, &p.parent).is_some())
                    })
            },
        )
        .await;
    let mut decisions = Vec::new();
    for call in calls(&spans) {
        assert_eq!(call.service(), "sluice");
        let parent = by_id(&spans, &call.parent).unwrap();
        assert_eq!(parent.service(), ENVOY_SERVICE, "{parent:?}");
        assert_eq!(
            parent.trace_id, call.trace_id,
            "one trace: {parent:?} {call:?}"
        );
        assert!(
            parent.name.contains("RateLimitService"),
            "the parent is Envoy's rate limit call: {parent:?}"
        );
        let request = by_id(&spans, &parent.parent).unwrap();
        assert_eq!(request.service(), ENVOY_SERVICE);
        assert_eq!(request.trace_id, call.trace_id);
        assert_eq!(
            request.parent, "",
            "Envoy's request span is the trace's root"
        );

        assert_eq!(call.attribute("ratelimit.domain"), Some("traced"));
        assert_eq!(call.attribute("ratelimit.rules"), Some("user"));
        decisions.push(
            call.attribute("ratelimit.decision")
                .unwrap_or("")
                .to_owned(),
        );
        let store: Vec<&Span> = spans
            .iter()
            .filter(|s| s.parent == call.span_id && s.name == "store")
            .collect();
        // A request denied from the local over-limit cache made no store call.
        let calls_made = if call.attribute("ratelimit.decision") == Some("OK") {
            1..=1
        } else {
            0..=1
        };
        assert!(
            calls_made.contains(&store.len()),
            "store spans under {call:?}: {store:?}"
        );
        assert!(store.iter().all(|s| s.trace_id == call.trace_id));
    }
    decisions.sort();
    answered.sort();
    assert_eq!(decisions, answered);
    for span in spans.iter().filter(|s| s.service() == "sluice") {
        for value in span.attributes.values() {
            assert!(!value.contains(USER), "a descriptor value in {span:?}");
        }
    }
}

/// A W3C `traceparent` for trace number `n`, sampled or not.
fn traceparent(n: u64, sampled: bool) -> String {
    format!(
        "00-{n:032x}-{:016x}-{}",
        n + 1,
        if sampled { "01" } else { "00" }
    )
}

async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
    traceparent: Option<String>,
) -> i32 {
    let mut call = tonic::Request::new(request);
    if let Some(t) = traceparent {
        call.metadata_mut()
            .insert("traceparent", t.parse().unwrap());
    }
    client
        .should_rate_limit(call)
        .await
        .unwrap()
        .into_inner()
        .overall_code
}

const OPEN: &str = "
domain: open
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000000}
";

#[tokio::test(flavor = "multi_thread")]
async fn the_sampling_ratio_decides_where_the_caller_did_not_and_the_caller_where_it_did() {
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.http);
    let sluice = Sluice::start_with(
        &[("rules.yaml", OPEN)],
        &[
            "--tracing",
            "http",
            "--tracing-endpoint",
            &endpoint,
            "--tracing-sampling-rate",
            "0.25",
            "--tracing-values",
        ],
    )
    .await;
    let mut client = sluice.client().await;
    let asked = || request("open", &[&[("k", "v")]]);
    for _ in 0..400 {
        assert_eq!(ask(&mut client, asked(), None).await, OK);
    }
    for n in 1..=50 {
        assert_eq!(
            ask(&mut client, asked(), Some(traceparent(n, true))).await,
            OK
        );
        assert_eq!(
            ask(&mut client, asked(), Some(traceparent(1000 + n, false))).await,
            OK
        );
    }
    let spans = collector
        .until("the 50 calls their callers sampled", ARRIVAL, |spans| {
            calls(spans).iter().filter(|c| !c.parent.is_empty()).count() >= 50
        })
        .await;
    // The last batch of calls without a caller's decision, if any, follows within a second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let spans = [spans, collector.spans()].concat();
    let mut seen = HashSet::new();
    let calls: Vec<&Span> = calls(&spans)
        .into_iter()
        .filter(|c| seen.insert(c.span_id.clone()))
        .collect();
    let continued: HashSet<&str> = calls
        .iter()
        .filter(|c| !c.parent.is_empty())
        .map(|c| c.trace_id.as_str())
        .collect();
    let sampled: HashSet<String> = (1..=50).map(|n| format!("{n:032x}")).collect();
    assert_eq!(
        continued,
        sampled.iter().map(String::as_str).collect(),
        "every call its caller sampled, and none it did not"
    );
    // 400 calls at 1/4: 100 expected, 8.7 standard deviations; 60–140 is over 4 of them.
    let own = calls.iter().filter(|c| c.parent.is_empty()).count();
    assert!((60..=140).contains(&own), "{own} of 400 sampled at 0.25");
    assert!(
        calls
            .iter()
            .all(|c| c.attribute("ratelimit.descriptors") == Some("k=v")),
        "--tracing-values puts the descriptors in"
    );
}

/// Waits until Redis on `port` leaves a PING unanswered for 100 ms: it is paused.
fn wait_paused(port: u16) {
    use std::io::{Read, Write};
    for _ in 0..100 {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        conn.write_all(b"PING\r\n").unwrap();
        if conn.read(&mut [0u8; 16]).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("Redis never paused");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_redis_call_carrying_several_requests_is_one_span_linked_to_each() {
    let redis = redis::dedicated();
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.grpc);
    let sluice = Sluice::on_own_redis(
        &redis,
        &[("rules.yaml", OPEN)],
        &[
            "--tracing",
            "grpc",
            "--tracing-endpoint",
            &endpoint,
            "--store-timeout",
            "3s",
        ],
    )
    .await;
    // Redis holding every command for a while: the requests queue, then go in batched calls.
    let port = redis.ports[0];
    assert_eq!(
        redis::cli(port, &["CLIENT", "PAUSE", "1000", "ALL"]).trim(),
        "OK"
    );
    tokio::task::spawn_blocking(move || wait_paused(port))
        .await
        .unwrap();
    let mut asking = Vec::new();
    for n in 1..=20 {
        let mut client = sluice.client().await;
        asking.push(tokio::spawn(async move {
            ask(
                &mut client,
                request("open", &[&[("k", "v")]]),
                Some(traceparent(n, true)),
            )
            .await
        }));
    }
    for a in asking {
        assert_eq!(a.await.unwrap(), OK);
    }

    let traces: HashSet<String> = (1..=20).map(|n| format!("{n:032x}")).collect();
    let carried = |spans: &[Span]| -> u64 {
        spans
            .iter()
            .filter(|s| s.name == "redis EVALSHA" && traces.contains(&s.trace_id))
            .map(|s| {
                s.attribute("sluice.requests")
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
            .sum()
    };
    let spans = collector
        .until(
            "script call spans carrying the 20 requests",
            ARRIVAL,
            |spans| carried(spans) >= 20,
        )
        .await;
    assert_eq!(carried(&spans), 20, "each request in one script call");
    let scripts: Vec<&Span> = spans.iter().filter(|s| s.name == "redis EVALSHA").collect();
    let shared = scripts
        .iter()
        .find(|s| s.attribute("sluice.requests") != Some("1"))
        .expect("a script call carrying several requests");
    let requests: u64 = shared
        .attribute("sluice.requests")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(shared.links.len() as u64, requests - 1, "{shared:?}");
    let parent = by_id(&spans, &shared.parent).expect("its parent");
    assert_eq!(parent.name, "store");
    assert_eq!(parent.trace_id, shared.trace_id);
    for (trace, span) in &shared.links {
        let linked = by_id(&spans, span).expect("the linked span");
        assert_eq!(linked.name, "store", "{linked:?}");
        assert_eq!(&linked.trace_id, trace);
        assert_ne!(trace, &shared.trace_id, "another request's trace");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_as_ratelimit_its_tracing_environment_exports_traces() {
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.http);
    let (_ratelimit, channel) = Ratelimit::serving(
        OPEN,
        &[
            ("TRACING_ENABLED", "true"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("TRACING_SERVICE_NAME", "rl-under-test"),
            ("TRACING_SERVICE_NAMESPACE", "gateway-system"),
            ("TRACING_SERVICE_INSTANCE_ID", "ratelimit-pod-1"),
        ],
    )
    .await;
    let mut client = RateLimitServiceClient::new(channel);
    assert_eq!(
        ask(&mut client, request("open", &[&[("k", "v")]]), None).await,
        OK
    );
    let spans = collector
        .until("a span of the call", ARRIVAL, |spans| {
            !calls(spans).is_empty()
        })
        .await;
    let call = calls(&spans)[0];
    assert_eq!(call.service(), "rl-under-test");
    assert_eq!(
        call.resource.get("service.namespace").map(String::as_str),
        Some("gateway-system")
    );
    assert_eq!(
        call.resource.get("service.instance.id").map(String::as_str),
        Some("ratelimit-pod-1")
    );
}

/// Five requests a minute on one key.
const FIVE: &str = "
domain: dead
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 5}
";

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_collector_changes_no_decision_and_its_spans_are_dropped_and_counted() {
    let (silent, endpoint) = silent_collector();
    let sluice = tracing_to(&endpoint, FIVE, &["--tracing-queue", "16"]).await;
    let mut client = sluice.client().await;
    let mut attempt = 0;
    let mut exporting = None;
    in_one_window(MINUTE, async || {
        attempt += 1;
        let value = attempt.to_string();
        let mut codes = Vec::new();
        for n in 1..=400 {
            if n == 201 && exporting.is_none() {
                // Once the first export waits on the collector (one a second), the queue fills.
                exporting = Some(export_waiting(&silent).await);
            }
            let asked = request("dead", &[&[("k", value.as_str())]]);
            codes.push(ask(&mut client, asked, Some(traceparent(n, true))).await);
        }
        assert_eq!(codes.iter().filter(|&&c| c == OK).count(), 5);
        assert_eq!(codes.iter().filter(|&&c| c == OVER_LIMIT).count(), 395);
    })
    .await;
    let scraped = scrape(sluice.http);
    let dropped = scraped.value("sluice_trace_spans_total", &[("outcome", "dropped")]);
    assert!(
        dropped > 0.0,
        "spans past the queue are dropped and counted"
    );
    assert_eq!(
        scraped
            .get("sluice_trace_spans_total", &[("outcome", "exported")])
            .unwrap_or(0.0),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_string_a_span_records_is_cut_to_256_bytes_and_marked() {
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.grpc);
    let sluice = tracing_to(&endpoint, OPEN, &["--tracing-values"]).await;
    let mut client = sluice.client().await;
    let domain = "d".repeat(1000);
    let value = "v".repeat(100_000);
    assert_eq!(
        ask(&mut client, request(&domain, &[&[("k", "x")]]), None).await,
        OK
    );
    assert_eq!(
        ask(&mut client, request("open", &[&[("k", &value)]]), None).await,
        OK
    );
    let spans = collector
        .until("both calls' spans", ARRIVAL, |spans| {
            calls(spans).len() >= 2
        })
        .await;
    let calls = calls(&spans);
    let domains: Vec<&str> = calls
        .iter()
        .filter_map(|c| c.attribute("ratelimit.domain"))
        .collect();
    assert!(
        domains.contains(&format!("{}…[cut: 1000 bytes]", &domain[..256]).as_str()),
        "{domains:?}"
    );
    let descriptors: Vec<&str> = calls
        .iter()
        .filter_map(|c| c.attribute("ratelimit.descriptors"))
        .collect();
    let cut = format!("k={}…[cut: 100002 bytes]", &value[..254]);
    assert!(descriptors.contains(&cut.as_str()), "{descriptors:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_collector_that_never_answers_leaves_memory_bounded_whatever_the_requests_hold() {
    let (_silent, endpoint) = silent_collector();
    let sluice = tracing_to(
        &endpoint,
        OPEN,
        &["--tracing-queue", "512", "--tracing-values"],
    )
    .await;
    let pid = sluice.pid();
    let before = memory_kb(pid, "VmRSS");
    // 2,000 requests of 200 KB, each value unique, from four connections at once.
    let mut senders = Vec::new();
    for sender in 0..4 {
        let mut client = sluice.client().await;
        senders.push(tokio::spawn(async move {
            let padding = "v".repeat(200_000);
            for n in 0..500 {
                let value = format!("{sender}-{n}-{padding}");
                let asked = request("open", &[&[("k", &value)]]);
                assert_eq!(
                    ask(&mut client, asked, Some(traceparent(n + 1, true))).await,
                    OK
                );
            }
        }));
    }
    for sender in senders {
        sender.await.unwrap();
    }
    // Spans recorded whole, the queue and the batch waiting on the collector would hold about a
    // thousand spans of 200 KB: 185 MB more, measured.
    let after = memory_kb(pid, "VmRSS");
    let grown_mb = after.saturating_sub(before) / 1024;
    eprintln!("RSS {} MB before, {} MB after", before / 1024, after / 1024);
    assert!(grown_mb < 48, "RSS grew by {grown_mb} MB");
}
