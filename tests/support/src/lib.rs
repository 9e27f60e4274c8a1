//! Test harness: starts the real `sluice` binary on free loopback ports with the given rule files,
//! waits until gRPC health reports SERVING, and stops it when dropped; asks it as Envoy would. A
//! library that every test binary of `tests/` shares (`support::…`). The rest by concern, in its
//! modules: raw HTTP (`http`), the wall clock's windows (`windows`), resident memory (`memory`),
//! `openssl`, the generated histories' knobs and log (`history`), and the servers the tests run
//! beside sluice (`redis`, `envoy`, `ratelimit`, `xds`, `otlp`, `proxy`, `quota`, `rlqs`).

pub mod envoy;
pub mod history;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod openssl;
pub mod otlp;
pub mod proxy;
pub mod quota;
pub mod ratelimit;
pub mod redis;
pub mod rlqs;
pub mod rng;
pub mod windows;
pub mod xds;

// The helpers every test binary reaches for, at the crate's root as before.
pub use history::{env_number, histories, replaying};
pub use http::{exchange, http};
pub use memory::{
    FREED_PAGES_RETURNED, bytes_per_rule, memory_kb, reset_peak, settled_resident_kb,
};
pub use openssl::openssl;
pub use windows::{HOUR, MINUTE, in_one_window, sleep_until_unix_ms, unix_ms};

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
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

/// A loopback port that was free a moment ago, and never given before in this process: two
/// servers started side by side never both try it, so that one cannot take the other's answer
/// for its own.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
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

    /// A Redis deployment of this store's kind that is the test's own (a standalone server or a
    /// Cluster), for a test that reads its statistics or flushes its scripts: the shared one
    /// serves every other test of the binary.
    pub fn dedicated(self) -> redis::Redis {
        match self {
            Store::Memory => panic!("the embedded store has no Redis"),
            Store::Redis => redis::dedicated(),
            Store::Cluster => redis::dedicated_cluster(),
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
/// `memory::test`, `redis::test` and `cluster::test`. Their counts rule out a window of a minute
/// or more ending meanwhile: each runs `in_one_window` of a minute, whose ends are every longer
/// window's too.
#[macro_export]
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        $crate::on_stores!(
            memory: Memory, redis: Redis, cluster: Cluster;
            $($test),*
        );
    };
}

/// Generates, for each named `async fn test(store: Store)`, one `#[tokio::test]` per
/// `module: Store` pair given, run `in_one_window` of a minute.
#[macro_export]
macro_rules! on_stores {
    ($module:ident: $store:ident $(, $more:ident: $more_store:ident)*; $($test:ident),* $(,)?) => {
        mod $module {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() {
                $crate::in_one_window($crate::MINUTE, async || {
                    super::$test($crate::Store::$store).await
                })
                .await
            })*
        }
        $crate::on_stores!($($more: $more_store),*; $($test),*);
    };
    (; $($test:ident),* $(,)?) => {};
}

/// Generates one multi-threaded `#[tokio::test]` per `name => scenario`, a future it awaits: one
/// scenario run with several arguments, each case named for what it shows.
#[macro_export]
macro_rules! scenarios {
    ($($name:ident => $scenario:expr),* $(,)?) => {
        $(#[tokio::test(flavor = "multi_thread")]
        async fn $name() {
            $scenario.await
        })*
    };
}

/// A running `sluice serve`. Its log (stderr) goes to a file, printed when a test fails.
pub struct Sluice {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// The rules directory given as `--config`.
    pub rules: PathBuf,
    /// The shell prelude and the flags it was started with, for `start_again`.
    wrapper: Option<String>,
    flags: Vec<String>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// What `Sluice::spawn` waits for before returning.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// gRPC health reports SERVING: rules loaded and the store reached.
    Serving,
    /// The admin HTTP server answers `/healthz`, ready or not.
    Live,
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

    /// Starts sluice on `store` with rule `files` (name, YAML) and extra `serve` flags, and waits
    /// until it reports SERVING.
    pub async fn on(store: Store, files: &[(&str, &str)], flags: &[&str]) -> Sluice {
        Sluice::on_prepared(store, write_files(files), flags).await
    }

    /// Starts sluice on the embedded store with a rules directory that `prepare` lays out (given
    /// the empty directory, whose parent belongs to the test too), such as a Kubernetes
    /// ConfigMap volume's links, and extra flags; waits until it reports SERVING.
    pub async fn start_prepared(prepare: impl FnOnce(&Path), flags: &[&str]) -> Sluice {
        Sluice::on_prepared(Store::Memory, prepare, flags).await
    }

    /// Starts sluice counting in `redis`, a deployment of the test's own (whose statistics no
    /// other test moves), with rule `files` and extra flags; waits until it reports SERVING.
    pub async fn on_own_redis(
        redis: &redis::Redis,
        files: &[(&str, &str)],
        flags: &[&str],
    ) -> Sluice {
        let mut all = vec!["--redis-url", redis.url.as_str()];
        all.extend_from_slice(flags);
        Sluice::on(Store::Memory, files, &all).await
    }

    async fn on_prepared(store: Store, prepare: impl FnOnce(&Path), flags: &[&str]) -> Sluice {
        let store_flags = store.flags(flags);
        let flags: Vec<&str> = flags
            .iter()
            .copied()
            .chain(store_flags.iter().map(String::as_str))
            .collect();
        Sluice::launch(prepare, &flags, None, Wait::Serving).await
    }

    /// Starts `sluice serve` with rule `files` and exactly `flags` (plus its addresses), through
    /// `sh -c "<wrapper> exec sluice …"` when a shell `wrapper` is given (e.g. `ulimit -n 64;`),
    /// and waits as `wait` says, for at most 15 s.
    pub async fn spawn(
        files: &[(&str, &str)],
        flags: &[&str],
        wrapper: Option<&str>,
        wait: Wait,
    ) -> Sluice {
        Sluice::launch(write_files(files), flags, wrapper, wait).await
    }

    /// `spawn`, with the rules directory laid out by `prepare`.
    async fn launch(
        prepare: impl FnOnce(&Path),
        flags: &[&str],
        wrapper: Option<&str>,
        wait: Wait,
    ) -> Sluice {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let rules = dir.path().join("rules");
        std::fs::create_dir(&rules).expect("rules directory");
        prepare(&rules);
        let log = dir.path().join("sluice.log");
        for _ in 0..3 {
            let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let log_file = std::fs::File::create(&log).expect("log file");
            let mut child = serve(wrapper, &rules, grpc, http, flags, log_file);
            let up = match wait {
                Wait::Serving => wait_serving(&mut child, grpc).await,
                Wait::Live => wait_live(&mut child, http).await,
            };
            if up {
                return Sluice {
                    child,
                    grpc,
                    http,
                    rules,
                    wrapper: wrapper.map(str::to_owned),
                    flags: flags.iter().map(|f| f.to_string()).collect(),
                    log,
                    _dir: dir,
                };
            }
            // Most likely a port was taken in between: try other ports.
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "sluice did not start on loopback; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Kills the process (SIGKILL), as a crash would; `start_again` brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts `sluice serve` again as it was started first (same addresses, rules and flags, so
    /// the same store), its log going on in the same file, and waits until it reports SERVING.
    pub async fn start_again(&mut self) {
        self.relaunch();
        assert!(
            wait_serving(&mut self.child, self.grpc).await,
            "sluice did not start again on {}; its log:\n{}",
            self.grpc,
            self.log_text()
        );
    }

    /// Starts `sluice serve` again as it was started first, and returns at once.
    pub fn relaunch(&mut self) {
        assert!(!self.alive(), "sluice still runs");
        let log_file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .expect("log file");
        let flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        self.child = serve(
            self.wrapper.as_deref(),
            &self.rules,
            self.grpc,
            self.http,
            &flags,
            log_file,
        );
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        read_log(&self.log)
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

    /// Sends one request on a connection of its own and returns the response, panicking on a
    /// gRPC error.
    pub async fn ask(&self, request: RateLimitRequest) -> RateLimitResponse {
        decide(&mut self.client().await, request).await
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits, for at most `limit`, until the process exits; its exit status, or `None` if it
    /// still runs.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Spawns `sluice serve` on `grpc` and `http` with the rules directory `rules` and `flags`, through
/// `sh -c "<wrapper> exec sluice …"` when a shell `wrapper` is given, logging (stderr) to `log`.
fn serve(
    wrapper: Option<&str>,
    rules: &Path,
    grpc: SocketAddr,
    http: SocketAddr,
    flags: &[&str],
    log: std::fs::File,
) -> Child {
    let binary = sluice_binary();
    let mut command = match wrapper {
        None => Command::new(binary),
        Some(prelude) => {
            let mut sh = Command::new("sh");
            sh.arg("-c")
                .arg(format!("{prelude} exec \"$0\" \"$@\""))
                .arg(binary);
            sh
        }
    };
    command.arg("serve");
    // Rules over xDS take no rules directory.
    if !flags.contains(&"--xds-server") {
        command.arg("--config").arg(rules);
    }
    command
        .arg("--grpc-addr")
        .arg(grpc.to_string())
        .arg("--http-addr")
        .arg(http.to_string())
        .args(flags)
        // Warnings only, unless `TEST_SLUICE_LOG` asks for more (e.g. `warn,sluice=debug`) to
        // follow a failing test.
        .env(
            "SLUICE_LOG",
            std::env::var("TEST_SLUICE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("the sluice binary starts")
}

/// Writes rule `files` (name, YAML) into the rules directory it is given.
fn write_files<'a>(files: &'a [(&str, &str)]) -> impl FnOnce(&Path) + 'a {
    move |rules| {
        for (name, yaml) in files {
            std::fs::write(rules.join(name), yaml).expect("rule file written");
        }
    }
}

/// Lays out a rules directory (for `Sluice::start_prepared`) whose `rules.yaml` is a link to
/// `yaml` written outside it, so that writing the file is invisible to the file watcher: only
/// SIGHUP reloads it.
pub fn linked_from_outside(yaml: impl AsRef<str>) -> impl FnOnce(&Path) {
    move |rules: &Path| {
        let outside = outside_file(rules);
        std::fs::create_dir(outside.parent().unwrap()).expect("outside directory");
        std::fs::write(&outside, yaml.as_ref()).expect("rule file written");
        std::os::unix::fs::symlink(&outside, rules.join("rules.yaml")).expect("rules.yaml link");
    }
}

/// The file `linked_from_outside` links the rules directory `rules` to.
pub fn outside_file(rules: &Path) -> PathBuf {
    rules.parent().unwrap().join("outside").join("rules.yaml")
}

/// Sends one request over `client`'s connection and returns the response, panicking on a gRPC
/// error.
pub async fn decide(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .expect("ShouldRateLimit succeeds")
        .into_inner()
}

/// `sluice load --json --quiet` against `sluice` with `args` (its domain among them), which must
/// succeed: its report.
pub async fn load_report(sluice: &Sluice, args: &[&str]) -> serde_json::Value {
    let target = sluice.grpc.to_string();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(sluice_binary())
            .args(["load", "--json", "--quiet", "--target", &target])
            .args(&args)
            .output()
            .expect("sluice load runs")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a JSON report")
}

/// Reads `read` every 50 ms until what it reads is `done`, for at most `limit`; the last read,
/// for the test to assert on.
pub async fn settled<T>(
    limit: Duration,
    mut read: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let now = read();
        if done(&now) || Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads `read` every 50 ms until it has read the same for `quiet`, for at most `limit`: the last
/// read, for the test to assert on.
pub async fn steady<T: PartialEq>(
    quiet: Duration,
    limit: Duration,
    mut read: impl FnMut() -> T,
) -> T {
    let deadline = Instant::now() + limit;
    let mut last = read();
    let mut since = Instant::now();
    while since.elapsed() < quiet && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = read();
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    last
}

/// Polls `ready` every 50 ms until it holds, and fails the test if it does not within `limit`.
pub async fn eventually(what: &str, limit: Duration, mut ready: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ready().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out after {limit:?} waiting until {what}");
}

/// Waits for every task and returns what they returned, in order.
pub async fn gather<T>(tasks: Vec<tokio::task::JoinHandle<Vec<T>>>) -> Vec<T> {
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("a task runs to the end"));
    }
    all
}

/// Held by the tests whose timing bounds assume the machine to themselves (Redis failing over,
/// paused or killed under paced load): one of them at a time in a test binary, whatever module it
/// is in, from the start of sluice and its load to the end; the other test thread meanwhile
/// starts its Redis deployment (servers, a cluster, Sentinels: mostly waiting), then waits too.
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
            // Still running: the answer is its own, not that of a server that held the port.
            if status.is_ok_and(|s| s.get_ref().status == ServingStatus::Serving as i32) {
                return matches!(child.try_wait(), Ok(None));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

impl Drop for Sluice {
    fn drop(&mut self) {
        stop_showing_log(&mut self.child, "sluice", &self.log);
    }
}

/// A log file's text, or why there is none.
pub fn read_log(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no log: {e})"))
}

/// Kills `child` and, when a test is failing, prints its log.
pub fn stop_showing_log(child: &mut Child, name: &str, log: &std::path::Path) {
    let _ = child.kill();
    let _ = child.wait();
    if std::thread::panicking() {
        eprintln!("{name} log:\n{}", read_log(log));
    }
}

/// Polls `/healthz` until it answers 200, for at most 15 s or until the process exits.
pub async fn wait_live(child: &mut Child, http_addr: SocketAddr) -> bool {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        let live = tokio::task::spawn_blocking(move || {
            std::net::TcpStream::connect_timeout(&http_addr, Duration::from_millis(200)).is_ok()
                && http(http_addr, "GET", "/healthz", "").0 == 200
        })
        .await
        .unwrap_or(false);
        if live {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
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

/// The Redis key sluice counts a descriptor of `entries` of `domain` in, as its `/explain` names
/// it.
pub fn redis_key(sluice: &Sluice, domain: &str, entries: &[(&str, &str)]) -> String {
    explained(sluice, domain, entries)["descriptors"][0]["counters"][0]["redis_key"]
        .as_str()
        .expect("a Redis key")
        .to_owned()
}

/// What sluice's `/explain` answers for a request with one descriptor of `entries`.
pub fn explained(sluice: &Sluice, domain: &str, entries: &[(&str, &str)]) -> serde_json::Value {
    let entries: Vec<serde_json::Value> = entries
        .iter()
        .map(|(k, v)| serde_json::json!({"key": k, "value": v}))
        .collect();
    let body = serde_json::json!({"domain": domain, "descriptors": [{"entries": entries}]});
    let (status, _, text) = http(sluice.http, "POST", "/explain", &body.to_string());
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("JSON")
}

/// The limit `sluice` decides the counter of `key`=`value` in `domain` with, as its
/// `/counters` shows it (a `split` rule's: this replica's share); `None` unless it answers 200.
pub fn counted_limit(sluice: &Sluice, domain: &str, key: &str, value: &str) -> Option<u64> {
    let body = serde_json::json!({
        "domain": domain,
        "descriptors": [{"entries": [{"key": key, "value": value}]}],
    });
    let (status, _, text) = http(sluice.http, "POST", "/counters", &body.to_string());
    let answer: serde_json::Value = serde_json::from_str(&text).ok().filter(|_| status == 200)?;
    answer["counters"][0]["limit"]["requests_per_unit"].as_u64()
}

/// The repository's root (the `sluice` package's directory, two above this crate's).
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("tests/support lies two directories below the repository's root")
}

/// `path` in the repository.
pub fn repo_file(path: &str) -> std::path::PathBuf {
    root().join(path)
}

/// The `sluice` binary that `cargo test` built with the running test binary, one directory above
/// it: `target/<profile>/deps/<test>-<hash>` runs `target/<profile>/sluice`.
pub fn sluice_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let test = std::env::current_exe().expect("the running test binary's path");
            let binary = test
                .parent()
                .and_then(Path::parent)
                .expect("a test binary in target/<profile>/deps/")
                .join(format!("sluice{}", std::env::consts::EXE_SUFFIX));
            assert!(
                binary.is_file(),
                "no sluice binary at {} (beside the test binary {}'s directory)",
                binary.display(),
                test.display()
            );
            binary
        })
        .clone()
}
