//! sluice run as `ratelimit`, as Envoy Gateway runs envoyproxy/ratelimit: through a link of that
//! name, with nothing but that project's environment.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::free_port;

/// Envoy Gateway's rendered environment (ENVOY-GATEWAY.md §1.3), with Redis and Prometheus on.
pub const ENVOY_GATEWAY: &[(&str, &str)] = &[
    ("RUNTIME_ROOT", "/data"),
    ("RUNTIME_SUBDIRECTORY", "ratelimit"),
    ("RUNTIME_IGNOREDOTFILES", "true"),
    ("RUNTIME_WATCH_ROOT", "false"),
    ("LOG_LEVEL", "info"),
    ("USE_STATSD", "false"),
    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
    ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
    ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
    ("GRPC_SERVER_USE_TLS", "true"),
    ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
    ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
    ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
    ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ("REDIS_SOCKET_TYPE", "tcp"),
    ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
    ("USE_PROMETHEUS", "true"),
    ("PROMETHEUS_ADDR", ":19001"),
    ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
];

/// How long a `ratelimit` start may take.
pub const PATIENCE: Duration = Duration::from_secs(15);

/// The sluice binary run as `ratelimit` through a link of that name, with only the given
/// envoyproxy/ratelimit environment, plus free loopback ports and file rules in
/// `RUNTIME_ROOT/ratelimit/config` (which the environment may override).
pub struct Ratelimit {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub debug: SocketAddr,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

/// What `ratelimit` runs in: a temporary directory holding the link named `ratelimit` and the
/// rule file in `runtime/ratelimit/config` (envoyproxy/ratelimit's `RUNTIME_ROOT`,
/// `RUNTIME_SUBDIRECTORY` and its default `RUNTIME_APPDIRECTORY`).
struct Runtime {
    dir: tempfile::TempDir,
    link: PathBuf,
}

impl Runtime {
    fn new(rules: &str) -> Runtime {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // Readable by any user the test runs it as; writable by its owner only.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let config = dir.path().join("runtime/ratelimit/config");
        std::fs::create_dir_all(&config).unwrap();
        std::fs::write(config.join("erl.yaml"), rules).unwrap();
        let link = dir.path().join("ratelimit");
        std::os::unix::fs::symlink(super::sluice_binary(), &link).unwrap();
        Runtime { dir, link }
    }

    /// `ratelimit` with only `env`, after this runtime and the loopback ports (gRPC, HTTP,
    /// debug), run by `setpriv` with the given arguments (another user) when given; its stderr
    /// to `log`.
    fn command(
        &self,
        ports: (u16, u16, u16),
        env: &[(&str, &str)],
        setpriv: Option<&[&str]>,
        log: &Path,
    ) -> Command {
        let (grpc, http, debug) = ports;
        let root = self.dir.path().join("runtime");
        let layout = [
            ("RUNTIME_ROOT", root.to_str().unwrap()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("HOST", "127.0.0.1"),
            ("GRPC_HOST", "127.0.0.1"),
            ("DEBUG_HOST", "127.0.0.1"),
            ("PORT", &http.to_string()),
            ("GRPC_PORT", &grpc.to_string()),
            ("DEBUG_PORT", &debug.to_string()),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let mut command = match setpriv {
            None => Command::new(&self.link),
            Some(how) => {
                let mut c = Command::new("setpriv");
                c.args(how).arg(&self.link);
                c
            }
        };
        command
            .env_clear()
            .envs(layout)
            .envs(env.iter().copied())
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log file"));
        command
    }
}

impl Ratelimit {
    /// Starts it and waits until its gRPC and HTTP ports accept, for at most `PATIENCE`.
    pub fn start(rules: &str, env: &[(&str, &str)]) -> Ratelimit {
        Ratelimit::start_as(rules, env, None)
    }

    /// `start`, run by `setpriv` with the given arguments (another user) when given.
    pub fn start_as(rules: &str, env: &[(&str, &str)], setpriv: Option<&[&str]>) -> Ratelimit {
        let runtime = Runtime::new(rules);
        let log = runtime.dir.path().join("ratelimit.log");
        for _ in 0..3 {
            let (grpc, http, debug) = (free_port(), free_port(), free_port());
            let mut child = runtime
                .command((grpc, http, debug), env, setpriv, &log)
                .spawn()
                .expect("ratelimit starts");
            let http: SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
            let grpc: SocketAddr = format!("127.0.0.1:{grpc}").parse().unwrap();
            let accepts =
                |a| std::net::TcpStream::connect_timeout(a, Duration::from_millis(200)).is_ok();
            let deadline = Instant::now() + PATIENCE;
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                if accepts(&grpc) && accepts(&http) {
                    // A port another process took makes this one exit at once: try others.
                    std::thread::sleep(Duration::from_millis(200));
                    if !matches!(child.try_wait(), Ok(None)) {
                        break;
                    }
                    return Ratelimit {
                        child,
                        grpc,
                        http,
                        debug: format!("127.0.0.1:{debug}").parse().unwrap(),
                        _dir: runtime.dir,
                        log,
                    };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "ratelimit did not start; its log:\n{}",
            super::read_log(&log)
        );
    }

    /// `start`, then waits until gRPC health for `ratelimit` is SERVING; with the plaintext
    /// channel it asked over.
    pub async fn serving(rules: &str, env: &[(&str, &str)]) -> (Ratelimit, Channel) {
        Ratelimit::serving_as(rules, env, None).await
    }

    /// `serving`, run by `setpriv` with the given arguments when given.
    pub async fn serving_as(
        rules: &str,
        env: &[(&str, &str)],
        setpriv: Option<&[&str]>,
    ) -> (Ratelimit, Channel) {
        let ratelimit = Ratelimit::start_as(rules, env, setpriv);
        let channel = ratelimit.channel().await;
        assert!(
            ratelimit.wait_serving(|| channel.clone()).await,
            "not SERVING within {PATIENCE:?}; its log:\n{}",
            ratelimit.log_text()
        );
        (ratelimit, channel)
    }

    /// Runs it with `env`, which it must refuse: how it exited, within 10 s, and what it wrote to
    /// stderr.
    pub fn refusal(rules: &str, env: &[(&str, &str)]) -> (ExitStatus, String) {
        let runtime = Runtime::new(rules);
        let stderr = runtime.dir.path().join("stderr");
        let ports = (free_port(), free_port(), free_port());
        let mut child = runtime
            .command(ports, env, None, &stderr)
            .spawn()
            .expect("ratelimit starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "ratelimit still runs with {env:?}: {}",
                    super::read_log(&stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (status, super::read_log(&stderr))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        super::read_log(&self.log)
    }

    /// gRPC health's status for `service`, over `channel`.
    pub async fn health(channel: Channel, service: &str) -> Option<ServingStatus> {
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .ok()?;
        ServingStatus::try_from(reply.into_inner().status).ok()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect_timeout(PATIENCE)
            .connect()
            .await
            .expect("gRPC connects")
    }

    /// Waits, for at most `PATIENCE`, until gRPC health for `ratelimit` is SERVING.
    pub async fn wait_serving(&self, channel: impl Fn() -> Channel) -> bool {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if Ratelimit::health(channel(), "ratelimit").await == Some(ServingStatus::Serving) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

impl Drop for Ratelimit {
    fn drop(&mut self) {
        super::stop_showing_log(&mut self.child, "ratelimit", &self.log);
    }
}
