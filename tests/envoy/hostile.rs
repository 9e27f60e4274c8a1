//! What a hostile client sends cannot make sluice fail open or fall over: header values of any
//! bytes and length are counted like any other (behind a real Envoy that lets requests through on
//! errors), and so are requests carrying trace headers as large as Envoy passes on, on the
//! connection they came on; oversized requests are refused cheaply, and running out of
//! descriptors does not spin.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use support::envoy::{
    Envoy, Filter, UPSTREAM_BODY, Upstream, envoy_binary, get_with_headers, header,
};
use support::otlp::Collector;
use support::{
    HOUR, OK, OVER_LIMIT, Sluice, Wait, http, in_one_window, memory_kb, request, reset_peak,
};
use tonic::Code;

/// Three requests per hour per `user`; a test counting them runs `in_one_window` of an hour.
const LIMIT: usize = 3;
const RULES: &str = "\
domain: hostile
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 3
";

/// Header `x-user` becomes the `user` descriptor. Envoy lets a request through on any error from
/// sluice, so an error on a client-chosen value would be a way around the limit.
const FILTER: Filter = Filter {
    domain: "hostile",
    actions: &["request_headers: { header_name: x-user, descriptor_key: user }"],
    failure_mode_deny: false,
    timeout: Duration::from_secs(5),
};

/// sluice and an Envoy in front of it, asking about header `x-user`.
struct Stack {
    envoy: Envoy,
    upstream: Upstream,
    _sluice: Sluice,
}

impl Stack {
    async fn start() -> Stack {
        let sluice = Sluice::start(RULES).await;
        let upstream = Upstream::start();
        let envoy = Envoy::start(&envoy_binary(), upstream.addr, sluice.grpc, &FILTER);
        Stack {
            envoy,
            upstream,
            _sluice: sluice,
        }
    }

    /// `start`, with Envoy (its OpenTelemetry tracer) and sluice both tracing every request to
    /// `collector`: Envoy continues its client's trace in the rate limit call's metadata.
    async fn traced(collector: &Collector) -> Stack {
        let sluice = traced_sluice(collector).await;
        let upstream = Upstream::start();
        let envoy = Envoy::start_traced(
            &envoy_binary(),
            upstream.addr,
            sluice.grpc,
            &FILTER,
            collector.grpc,
        );
        Stack {
            envoy,
            upstream,
            _sluice: sluice,
        }
    }

    /// Sends `LIMIT + 3` requests as `user` and checks that exactly the first `LIMIT` reach the
    /// upstream and the rest get Envoy's rate limit 429.
    fn assert_limited(&self, user: &[u8]) {
        self.assert_limited_with(user, &[]);
    }

    /// `assert_limited`, each request also carrying `extra` headers.
    fn assert_limited_with(&self, user: &[u8], extra: &[(&str, &[u8])]) {
        let served_before = self.upstream.served();
        let mut headers = vec![("x-user", user)];
        headers.extend_from_slice(extra);
        for n in 0..LIMIT + 3 {
            let (status, headers, body) = get_with_headers(self.envoy.listener, "/", &headers);
            if n < LIMIT {
                assert_eq!(status, 200, "request {n}: {headers:?} {body}");
                assert_eq!(body, UPSTREAM_BODY, "request {n}");
            } else {
                assert_eq!(status, 429, "request {n}: {headers:?} {body}");
                assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
            }
        }
        assert_eq!(self.upstream.served() - served_before, LIMIT);
    }

    /// Checks Envoy's own counters: `ok` and `over_limit` answers from sluice, and no error
    /// that Envoy would have let through.
    fn assert_answered(&self, ok: u64, over_limit: u64) {
        let stats = self.envoy.ratelimit_stats();
        let get = |name: &str| stats.get(name).copied().unwrap_or(0);
        assert_eq!(get("error"), 0, "{stats:?}");
        assert_eq!(get("failure_mode_allowed"), 0, "{stats:?}");
        assert_eq!(get("ok"), ok, "{stats:?}");
        assert_eq!(get("over_limit"), over_limit, "{stats:?}");
    }

    /// Checks that Envoy opened one connection to sluice: none was closed under it.
    fn assert_one_connection(&self) {
        let stats = self.envoy.stats("cluster.ratelimit.");
        assert_eq!(stats.get("upstream_cx_total"), Some(&1), "{stats:?}");
    }
}

/// sluice on `RULES`, tracing its calls to `collector`.
async fn traced_sluice(collector: &Collector) -> Sluice {
    let endpoint = format!("http://{}", collector.grpc);
    Sluice::start_with(
        &[("rules.yaml", RULES)],
        &["--tracing", "grpc", "--tracing-endpoint", &endpoint],
    )
    .await
}

/// A sampled W3C `traceparent`.
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A valid W3C `tracestate` of about `bytes` bytes: members of 240 bytes, `m000=vvv…`, `m001=…`.
fn tracestate(bytes: usize) -> String {
    (0..bytes / 241)
        .map(|i| format!("m{i:03}={}", "v".repeat(235)))
        .collect::<Vec<_>>()
        .join(",")
}

/// A single `b3` header of about `bytes` bytes: a valid one padded past anything B3 allows.
fn b3(bytes: usize) -> String {
    format!(
        "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-{}",
        "0".repeat(bytes)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_24_kb_tracestate_or_b3_through_a_tracing_envoy_is_limited_on_one_connection() {
    in_one_window(HOUR, async || {
        let collector = Collector::start().await;
        let stack = Stack::traced(&collector).await;
        let parent = TRACEPARENT.as_bytes();
        let state = tracestate(24 * 1024);
        stack.assert_limited_with(
            b"traced-state",
            &[("traceparent", parent), ("tracestate", state.as_bytes())],
        );
        let b3 = b3(24 * 1024);
        stack.assert_limited_with(
            b"traced-b3",
            &[("traceparent", parent), ("b3", b3.as_bytes())],
        );
        // Later requests are still decided, on the connection the large ones came on.
        stack.assert_limited(b"after");
        stack.assert_answered(9, 9);
        stack.assert_one_connection();
    })
    .await;
}

/// Calls ShouldRateLimit for `user` on `client` with `metadata` added.
async fn ask_with(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    user: &str,
    metadata: &[(&'static str, &str)],
) -> Result<i32, tonic::Status> {
    let mut call = tonic::Request::new(request("hostile", &[&[("user", user)]]));
    for (name, value) in metadata {
        call.metadata_mut()
            .insert(*name, value.parse().expect("an ASCII metadata value"));
    }
    Ok(client
        .should_rate_limit(call)
        .await?
        .into_inner()
        .overall_code)
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_with_50_kb_or_128_kb_trace_headers_are_decided_and_the_trace_state_kept_small() {
    in_one_window(HOUR, async || {
        let collector = Collector::start().await;
        let sluice = traced_sluice(&collector).await;
        let mut client = sluice.client().await;
        let state = tracestate(50 * 1024);
        let b3 = b3(128 * 1024);
        let long_id = "a".repeat(50 * 1024);
        let calls: [&[(&str, &str)]; 4] = [
            &[("traceparent", TRACEPARENT), ("tracestate", &state)],
            &[("b3", &b3)],
            &[("x-b3-traceid", &long_id), ("x-b3-spanid", &long_id)],
            &[],
        ];
        let mut codes = Vec::new();
        for metadata in calls {
            let code = ask_with(&mut client, "large-headers", metadata).await;
            codes.push(code.expect("a call with large trace headers is decided"));
        }
        assert_eq!(codes, [OK, OK, OK, OVER_LIMIT]);

        // Of the caller's tracestate, whole members within W3C's 512 characters are kept.
        let spans = collector
            .until("the call's span", Duration::from_secs(20), |spans| {
                spans
                    .iter()
                    .any(|s| s.trace_id == "0af7651916cd43dd8448eb211c80319c")
            })
            .await;
        let members: Vec<&str> = state.split(',').take(2).collect();
        for span in spans
            .iter()
            .filter(|s| s.trace_id == "0af7651916cd43dd8448eb211c80319c")
        {
            assert_eq!(span.trace_state, members.join(","), "{}", span.name);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_non_utf8_header_value_is_limited_like_any_other() {
    in_one_window(HOUR, async || {
        let stack = Stack::start().await;
        stack.assert_limited(b"mallory\xff");
        stack.assert_answered(3, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_8_kib_header_value_is_limited_like_any_other() {
    in_one_window(HOUR, async || {
        let stack = Stack::start().await;
        stack.assert_limited(&[b'm'; 8 * 1024]);
        stack.assert_answered(3, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_40_kib_header_value_is_limited_like_any_other() {
    in_one_window(HOUR, async || {
        let stack = Stack::start().await;
        stack.assert_limited(&[b'm'; 40 * 1024]);
        stack.assert_answered(3, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_40_kib_header_values_differing_only_in_their_last_byte_count_apart() {
    in_one_window(HOUR, async || {
        let stack = Stack::start().await;
        let mut value = vec![b'm'; 40 * 1024];
        stack.assert_limited(&value);
        *value.last_mut().unwrap() = b'n';
        stack.assert_limited(&value);
        stack.assert_answered(6, 6);
    })
    .await;
}

/// A request within every bound.
fn ordinary() -> RateLimitRequest {
    request("hostile", &[&[("user", "a")]])
}

/// `RateLimitRequest` as it is on the wire, with `bytes` where envoy_types has `string`, so that
/// a test can send what Envoy sends for a header that is not UTF-8. Field numbers as in
/// proto/envoy/service/ratelimit/v3/rls.proto and
/// proto/envoy/extensions/common/ratelimit/v3/ratelimit.proto.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// Asks sluice about one `user` descriptor whose value is `user`, as raw bytes.
async fn ask_raw(sluice: &Sluice, user: &[u8]) -> Result<RateLimitResponse, tonic::Status> {
    let request = RawRequest {
        domain: b"hostile".to_vec(),
        descriptors: vec![RawDescriptor {
            entries: vec![RawEntry {
                key: b"user".to_vec(),
                value: user.to_vec(),
            }],
        }],
    };
    let mut grpc = tonic::client::Grpc::new(sluice.channel().await);
    grpc.ready().await.expect("the channel is ready");
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
    grpc.unary(tonic::Request::new(request), path, codec)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn a_non_utf8_value_sent_over_grpc_is_counted_not_rejected() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start(RULES).await;
        for remaining in (0..LIMIT as u32).rev() {
            let r = ask_raw(&sluice, b"mallory\xff")
                .await
                .expect("a value that is not UTF-8 is answered");
            assert_eq!(r.overall_code, OK);
            assert_eq!(r.statuses[0].limit_remaining, remaining);
        }
        let r = ask_raw(&sluice, b"mallory\xff").await.unwrap();
        assert_eq!(r.overall_code, OVER_LIMIT);
        // A lossy decoding would turn both invalid bytes into U+FFFD and share one counter.
        let r = ask_raw(&sluice, b"mallory\xfe").await.unwrap();
        assert_eq!(r.overall_code, OK);
        assert_eq!(r.statuses[0].limit_remaining, LIMIT as u32 - 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn eight_concurrent_4_mb_requests_are_refused_quickly_with_memory_bounded() {
    let mut sluice = Sluice::start(RULES).await;
    assert_eq!(sluice.ask(ordinary()).await.overall_code, OK);
    let pid = sluice.pid();
    let rss_before = memory_kb(pid, "VmRSS");
    reset_peak(pid);
    // Under tonic's own 4 MiB default, so only --max-request-bytes (256 KiB) refuses it.
    let huge = "d".repeat(4_000_000);
    let started = Instant::now();
    let mut calls = Vec::new();
    for _ in 0..8 {
        let mut client = sluice.client().await;
        let request = request(&huge, &[&[("user", "a")]]);
        calls.push(tokio::spawn(async move {
            let result = client.should_rate_limit(request).await;
            (result, started.elapsed())
        }));
    }
    for call in calls {
        let (result, took) = call.await.unwrap();
        let status = result.expect_err("a 4 MB request is refused");
        assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
        assert!(
            status.message().contains("the limit is: 262144 bytes"),
            "{status:?}"
        );
        assert!(took < Duration::from_secs(5), "refused after {took:?}");
    }
    assert!(sluice.alive());
    // Well under the 32 MB that the eight messages would take if they were buffered whole.
    let grown_kb = memory_kb(pid, "VmHWM").saturating_sub(rss_before);
    assert!(grown_kb < 24 * 1024, "the peak RSS grew by {grown_kb} kB");
    assert_eq!(sluice.ask(ordinary()).await.overall_code, OK);
}

/// POSTs `body` to `/json` and returns the status of the answer. The server may answer and
/// close before reading the whole body, so a failed write is not an error.
fn post_json_status(addr: SocketAddr, body: &[u8]) -> u16 {
    let mut stream = TcpStream::connect(addr).expect("HTTP connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let head = format!(
        "POST /json HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body));
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    raw.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("an HTTP status line: {raw:?}"))
}

#[tokio::test]
async fn a_json_body_over_the_request_bound_gets_413_and_the_server_keeps_serving() {
    let sluice = Sluice::start(RULES).await;
    let over = format!(
        r#"{{"domain":"{}","descriptors":[{{"entries":[{{"key":"user","value":"a"}}]}}]}}"#,
        "d".repeat(256 * 1024)
    );
    assert_eq!(post_json_status(sluice.http, over.as_bytes()), 413);
    let fine = r#"{"domain":"hostile","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#;
    assert_eq!(http(sluice.http, "POST", "/json", fine).0, 200);
    assert_eq!(sluice.ask(ordinary()).await.overall_code, OK);
}

/// CPU time the process has used (user and system), from /proc/PID/stat.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // The command name, in parentheses, may hold spaces: the fields are counted after it.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 1000 / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> u64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .expect("getconf runs");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("CLK_TCK")
}

#[tokio::test(flavor = "multi_thread")]
async fn running_out_of_file_descriptors_neither_spins_nor_floods_the_log_and_serving_resumes() {
    // A limit below what sluice keeps for itself: even the fewest gRPC connections it allows (16)
    // do not fit beside its own descriptors, so accepts fail.
    let sluice = Sluice::spawn(
        &[("rules.yaml", RULES)],
        &["--store-timeout", "2s"],
        Some("ulimit -n 32;"),
        Wait::Serving,
    )
    .await;
    let pid = sluice.pid();
    let failed_accepts = || {
        sluice
            .log_text()
            .lines()
            .filter(|l| l.contains("failed accept"))
            .count()
    };
    // Four times as many connections as it may hold descriptors: the kernel completes the ones
    // it cannot accept, and every accept fails while they wait.
    let connections: Vec<TcpStream> = (0..128)
        .map(|_| TcpStream::connect(sluice.grpc).expect("loopback connects"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while failed_accepts() == 0 {
        assert!(Instant::now() < deadline, "no failed accept was logged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Retrying the accept at once would keep a core busy: about 2 s of CPU in these 2 s.
    let before = cpu_time(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_time(pid) - before;
    assert!(used < Duration::from_millis(300), "{used:?} of CPU in 2 s");
    let logged = failed_accepts();
    assert!(logged <= 10, "{logged} log lines about failed accepts");

    drop(connections);
    // Its next accept comes within the longest back-off pause (1 s) of the descriptors freeing.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", sluice.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(channel) = endpoint.connect().await {
                let mut client = RateLimitServiceClient::new(channel);
                if let Ok(r) = client.should_rate_limit(ordinary()).await {
                    return r.into_inner();
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("sluice answers again once descriptors are free");
    assert_eq!(answered.overall_code, OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_sends_nothing_is_closed() {
    let sluice = Sluice::start(RULES).await;
    let grpc = sluice.grpc;
    let closed = tokio::task::spawn_blocking(move || {
        let mut silent = TcpStream::connect(grpc).expect("loopback connects");
        silent
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let started = Instant::now();
        let read = silent.read(&mut [0u8; 64]);
        (read.map_err(|e| e.kind()), started.elapsed())
    })
    .await
    .unwrap();
    assert_eq!(closed.0, Ok(0), "the connection was closed, not timed out");
    assert!(
        closed.1 >= Duration::from_secs(9),
        "closed only after its 10 s to start: {:?}",
        closed.1
    );
    assert_eq!(sluice.ask(ordinary()).await.overall_code, OK);
}
