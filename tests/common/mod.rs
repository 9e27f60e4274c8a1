//! Test harness: starts the real `sluice` binary on free loopback ports with the given rule files,
//! waits until gRPC health reports SERVING, and stops it when dropped.
#![allow(dead_code)]

pub mod redis;

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub const OK: i32 = 1;
pub const OVER_LIMIT: i32 = 2;

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Where a test's sluice keeps its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Memory,
    Redis,
    Cluster,
}

impl Store {
    /// The Redis deployment behind this store, if any.
    pub fn redis(self) -> Option<&'static redis::Redis> {
        match self {
            Store::Memory => None,
            Store::Redis => Some(redis::standalone()),
            Store::Cluster => Some(redis::cluster()),
        }
    }

    /// `serve` flags selecting this store, with a key prefix of its own so that tests sharing
    /// one Redis never share a counter (unless the test's own `flags` choose one), and a store
    /// timeout that a debug build on a busy test machine always meets (unless they choose one).
    fn flags(self, flags: &[&str]) -> Vec<String> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let mut out = Vec::new();
        if !flags.contains(&"--store-timeout") {
            out.extend(["--store-timeout".into(), "2s".into()]);
        }
        let Some(r) = self.redis() else {
            return out;
        };
        out.extend(["--redis-url".into(), r.url.clone()]);
        if !flags.contains(&"--redis-key-prefix") {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            out.push("--redis-key-prefix".into());
            out.push(format!("t{}-{n}:", std::process::id()));
        }
        out
    }
}

/// Generates, for each named `async fn test(store: Store)`, one `#[tokio::test]` per store:
/// `memory::test`, `redis::test` and `cluster::test`.
#[macro_export]
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() { super::$test($crate::common::Store::Memory).await })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() { super::$test($crate::common::Store::Redis).await })*
        }
        mod cluster {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() { super::$test($crate::common::Store::Cluster).await })*
        }
    };
}

/// A running `sluice serve`.
pub struct Sluice {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Sluice {
    /// Starts sluice on the embedded store with one rule file holding `rules`.
    pub async fn start(rules: &str) -> Sluice {
        Sluice::on(Store::Memory, &[("rules.yaml", rules)], &[]).await
    }

    /// Starts sluice on the embedded store with rule `files` (name, YAML) and extra flags.
    pub async fn start_with(files: &[(&str, &str)], flags: &[&str]) -> Sluice {
        Sluice::on(Store::Memory, files, flags).await
    }

    /// Starts sluice on `store` with rule `files` (name, YAML) and extra `serve` flags.
    pub async fn on(store: Store, files: &[(&str, &str)], flags: &[&str]) -> Sluice {
        clear_of_minute_boundary().await;
        let store_flags = store.flags(flags);
        let dir = tempfile::tempdir().expect("a temporary directory");
        let rules = dir.path().join("rules");
        std::fs::create_dir(&rules).expect("rules directory");
        for (name, yaml) in files {
            std::fs::write(rules.join(name), yaml).expect("rule file written");
        }
        for _ in 0..3 {
            let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
                .arg("serve")
                .arg("--config")
                .arg(&rules)
                .arg("--grpc-addr")
                .arg(grpc.to_string())
                .arg("--http-addr")
                .arg(http.to_string())
                .args(flags)
                .args(&store_flags)
                .env("SLUICE_LOG", "warn")
                .stdin(Stdio::null())
                .spawn()
                .expect("the sluice binary starts");
            if wait_serving(&mut child, grpc).await {
                return Sluice {
                    child,
                    grpc,
                    http,
                    _dir: dir,
                };
            }
            // Most likely a port was taken in between: try other ports.
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("sluice did not report SERVING on loopback");
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .expect("gRPC connects")
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(self.channel().await)
    }

    /// Sends one request and returns the response, panicking on a gRPC error.
    pub async fn ask(&self, request: RateLimitRequest) -> RateLimitResponse {
        self.client()
            .await
            .should_rate_limit(request)
            .await
            .expect("ShouldRateLimit succeeds")
            .into_inner()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Waits, when a minute is about to end, until the next one starts, so that a test counting
/// against per-minute windows never straddles two of them.
pub async fn clear_of_minute_boundary() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let into_minute = now % 60_000;
    if into_minute > 50_000 {
        tokio::time::sleep(Duration::from_millis(60_000 - into_minute + 100)).await;
    }
}

/// Polls gRPC health until SERVING, for at most 15 s or until the process exits.
pub async fn wait_serving(child: &mut Child, grpc: SocketAddr) -> bool {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(channel) = Channel::from_shared(format!("http://{grpc}"))
            .unwrap()
            .connect()
            .await
        {
            let status = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await;
            if status.is_ok_and(|s| s.get_ref().status == ServingStatus::Serving as i32) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A descriptor from (key, value) pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request for `domain` with one descriptor per element of `descriptors`.
pub fn request(domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors.iter().map(|d| descriptor(d)).collect(),
        hits_addend: 0,
    }
}

/// Sends a raw HTTP/1.1 request to `addr` and returns (status, headers, body).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("HTTP connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("HTTP response");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("an HTTP status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}
