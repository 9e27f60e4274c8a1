//! Real Redis for the tests: one standalone `redis-server` and one 3-primary Redis Cluster per
//! test binary, started on first use on free loopback ports; or the same of Valkey when
//! `SLUICE_TEST_SERVER` names a `valkey-server` (`scripts/test` runs the Redis tests on both). Each runs under a shell that stops
//! it when the test binary exits (its stdin, held open by this process, closes). A test may also
//! own a server, plain or TLS only, stopped when dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A Redis deployment the tests can point sluice at.
pub struct Redis {
    pub url: String,
    /// The ports of its primaries.
    pub ports: Vec<u16>,
}

/// Keeps each supervising shell, and so its stdin, open for the life of the test binary.
static GUARDS: Mutex<Vec<Child>> = Mutex::new(Vec::new());

/// The server the tests start: `redis-server`, or what `SLUICE_TEST_SERVER` names.
pub fn server() -> String {
    std::env::var("SLUICE_TEST_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

const SERVER_FLAGS: &str = "--bind 127.0.0.1 --save '' --appendonly no --protected-mode no";

/// The standalone server the tests of this binary share.
pub fn standalone() -> &'static Redis {
    static STANDALONE: OnceLock<Redis> = OnceLock::new();
    STANDALONE.get_or_init(dedicated)
}

/// A standalone server of its own, for a test that reads server-wide statistics.
pub fn dedicated() -> Redis {
    let port = low_free_ports(1)[0];
    supervise("", &[format!("{} --port {port} {SERVER_FLAGS}", server())]);
    wait_for(
        || cli(port, &["PING"]).trim() == "PONG",
        "redis-server answers PING",
    );
    Redis {
        url: format!("redis://127.0.0.1:{port}"),
        ports: vec![port],
    }
}

/// The 3-primary cluster the tests of this binary share.
pub fn cluster() -> &'static Redis {
    static CLUSTER: OnceLock<Redis> = OnceLock::new();
    CLUSTER.get_or_init(dedicated_cluster)
}

/// A 3-primary cluster of its own, for a test that reads server-wide statistics.
pub fn dedicated_cluster() -> Redis {
    let dir = tempfile::tempdir()
        .expect("a directory for cluster state")
        .keep();
    let ports = low_free_ports(3);
    let servers: Vec<String> = ports
        .iter()
        .map(|p| {
            format!(
                "{} --port {p} {SERVER_FLAGS} --cluster-enabled yes \
                 --cluster-config-file nodes-{p}.conf --dir {}",
                server(),
                dir.display()
            )
        })
        .collect();
    supervise(&format!("trap 'rm -rf {}' EXIT;", dir.display()), &servers);
    for &p in &ports {
        wait_for(
            || cli(p, &["PING"]).trim() == "PONG",
            "cluster node answers PING",
        );
    }
    let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    create_cluster(&nodes, 0);
    for &p in &ports {
        wait_for(
            || cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok"),
            "cluster state ok",
        );
    }
    Redis {
        url: format!(
            "redis-cluster://{}?node={}&node={}",
            nodes[0], nodes[1], nodes[2]
        ),
        ports,
    }
}

/// A standalone primary watched by one Sentinel, addressed through the Sentinel as
/// `redis-sentinel://…?sentinelServiceName=primary`; `ports` holds the primary's port.
pub fn sentinel() -> Redis {
    let dir = tempfile::tempdir()
        .expect("a directory for the sentinel's config")
        .keep();
    let [primary, sentinel] = low_free_ports(2)[..] else {
        unreachable!("two ports were asked for")
    };
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port {sentinel}\nbind 127.0.0.1\nsentinel monitor primary 127.0.0.1 {primary} 1\n"
        ),
    )
    .expect("sentinel.conf written");
    supervise(
        &format!("trap 'rm -rf {}' EXIT;", dir.display()),
        &[
            format!("{} --port {primary} {SERVER_FLAGS}", server()),
            format!("{} {} --sentinel", server(), conf.display()),
        ],
    );
    wait_for(
        || {
            cli(
                sentinel,
                &["SENTINEL", "get-master-addr-by-name", "primary"],
            )
            .contains(&primary.to_string())
        },
        "the sentinel knows the primary",
    );
    Redis {
        url: format!("redis-sentinel://127.0.0.1:{sentinel}?sentinelServiceName=primary"),
        ports: vec![primary],
    }
}

/// A standalone `redis-server` owned by one test, which can pause, resume, kill and restart it
/// on the same port; killed when dropped.
pub struct Controlled {
    pub port: u16,
    pub url: String,
    /// Flags of its own, beyond the defaults.
    flags: Vec<String>,
    child: Option<Child>,
    /// Its working directory, where a replica writes the copy it receives.
    dir: tempfile::TempDir,
}

impl Controlled {
    /// A free port for a server not started yet.
    pub fn unstarted() -> Controlled {
        let port = low_free_ports(1)[0];
        Controlled {
            port,
            url: format!("redis://127.0.0.1:{port}"),
            flags: Vec::new(),
            child: None,
            dir: tempfile::tempdir().expect("a directory for the server"),
        }
    }

    /// A server, started and answering PING.
    pub fn started() -> Controlled {
        Controlled::started_with(&[])
    }

    /// A server started with `flags` beyond the defaults (e.g. `--requirepass`), answering.
    pub fn started_with(flags: &[&str]) -> Controlled {
        let mut redis = Controlled::unstarted();
        redis.flags = flags.iter().map(|f| f.to_string()).collect();
        redis.start();
        redis
    }

    /// Starts the server (again) on its port and waits until it answers PING. A replica of it
    /// gets its first copy at once (no diskless-sync delay).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(server())
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "no", "--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (install redis-server)");
        self.child = Some(child);
        let port = self.port;
        // A server that requires a password answers NOAUTH: it answers all the same.
        wait_for(
            || {
                let pong = cli(port, &["PING"]);
                pong.trim() == "PONG" || pong.contains("NOAUTH")
            },
            "redis-server answers PING",
        );
    }

    /// SIGSTOP: the server keeps its connections but answers nothing.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// `SHUTDOWN SAVE`: the server writes its counters to its directory and exits; `start`
    /// loads them again, as a restart that keeps its data does.
    pub fn shut_down_saving(&mut self) {
        self.cli(&["SHUTDOWN", "SAVE"]);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// SIGKILL: connections reset, counters lost.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("the server runs").id()
    }

    /// Runs `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for Controlled {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal(child.id(), "CONT");
        }
        self.kill();
    }
}

impl Controlled {
    /// Cuts this replica off its primary and keeps it off: it reconnects with a password the
    /// primary does not take, as a replica whose network link dropped would find no way back.
    pub fn cut_off(&self) {
        self.cli(&["CONFIG", "SET", "masterauth", "not-the-password"]);
        self.cli(&["CLIENT", "KILL", "TYPE", "master"]);
    }

    /// Whether it is a primary now (`ROLE`).
    pub fn is_primary(&self) -> bool {
        self.cli(&["ROLE"]).lines().next() == Some("master")
    }

    /// Whether it is a replica whose link to its primary is up.
    pub fn in_sync(&self) -> bool {
        self.cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    }

    /// `CLUSTER MYID`.
    pub fn node_id(&self) -> String {
        self.cli(&["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// Whether the process runs (it may be killed and not started again).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }
}

/// Makes a Cluster of the `nodes` (`host:port`), with `replicas` replicas per primary.
fn create_cluster(nodes: &[String], replicas: u8) {
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(nodes)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs");
    assert!(
        created.status.success(),
        "cluster create: {}",
        String::from_utf8_lossy(&created.stdout)
    );
}

/// A primary with one replica, watched by three Sentinels (quorum 2, a primary down after
/// `DOWN_AFTER_MS` without answers); every process belongs to the test and dies with it.
pub struct Sentinels {
    pub primary: Controlled,
    pub replica: Controlled,
    /// `redis-sentinel://…` naming the three Sentinels.
    pub url: String,
    sentinels: Vec<Child>,
    _dir: tempfile::TempDir,
}

impl Sentinels {
    pub const DOWN_AFTER_MS: u64 = 500;

    /// Starts them and waits until the replica has its first copy and every Sentinel knows it.
    pub fn start() -> Sentinels {
        let primary = Controlled::started();
        let replica =
            Controlled::started_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        wait_for(|| replica.in_sync(), "the replica syncs");
        let dir = tempfile::tempdir().expect("a directory for the Sentinels' files");
        let ports = low_free_ports(3);
        let sentinels = ports
            .iter()
            .map(|&port| {
                let conf = dir.path().join(format!("sentinel-{port}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                         sentinel monitor primary 127.0.0.1 {primary} 2\n\
                         sentinel down-after-milliseconds primary {down}\n\
                         sentinel failover-timeout primary 5000\n",
                        dir = dir.path().display(),
                        primary = primary.port,
                        down = Sentinels::DOWN_AFTER_MS,
                    ),
                )
                .expect("sentinel.conf written");
                Command::new(server())
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-server --sentinel starts")
            })
            .collect();
        let replica_port = replica.port.to_string();
        for &port in &ports {
            wait_for(
                || {
                    cli(port, &["SENTINEL", "REPLICAS", "primary"]).contains(&replica_port)
                        && cli(port, &["SENTINEL", "SENTINELS", "primary"])
                            .matches("127.0.0.1")
                            .count()
                            == 2
                },
                "every Sentinel knows the replica and the other Sentinels",
            );
        }
        Sentinels {
            url: format!(
                "redis-sentinel://127.0.0.1:{}?sentinelServiceName=primary&node=127.0.0.1:{}&node=127.0.0.1:{}",
                ports[0], ports[1], ports[2]
            ),
            primary,
            replica,
            sentinels,
            _dir: dir,
        }
    }
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for sentinel in &mut self.sentinels {
            let _ = sentinel.kill();
            let _ = sentinel.wait();
        }
    }
}

/// A Redis Cluster of three primaries, each with one replica, whose nodes belong to the test:
/// each can be killed and started again with its cluster state. A primary that answers nothing
/// for `NODE_TIMEOUT_MS` fails over to its replica, whatever the replica's lag.
pub struct ReplicatedCluster {
    pub nodes: Vec<Controlled>,
    /// `redis-cluster://…` naming every node.
    pub url: String,
}

impl ReplicatedCluster {
    pub const NODE_TIMEOUT_MS: u64 = 1000;

    /// Starts the six nodes, creates the cluster and waits until every replica is in sync.
    pub fn start() -> ReplicatedCluster {
        let timeout = ReplicatedCluster::NODE_TIMEOUT_MS.to_string();
        let nodes: Vec<Controlled> = (0..6)
            .map(|_| {
                Controlled::started_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                    "--cluster-replica-validity-factor",
                    "0",
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        create_cluster(&addresses, 1);
        let cluster = ReplicatedCluster {
            url: format!(
                "redis-cluster://{}?{}",
                addresses[0],
                addresses[1..]
                    .iter()
                    .map(|a| format!("node={a}"))
                    .collect::<Vec<_>>()
                    .join("&")
            ),
            nodes,
        };
        for node in &cluster.nodes {
            wait_for(
                || node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"),
                "cluster state ok",
            );
        }
        for i in 0..cluster.nodes.len() {
            if !cluster.nodes[i].is_primary() {
                wait_for(|| cluster.nodes[i].in_sync(), "every replica syncs");
            }
        }
        cluster
    }

    /// The nodes that are primaries now, by index.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].running() && self.nodes[i].is_primary())
            .collect()
    }

    /// The node that holds `key` (its primary), by index.
    pub fn holder_of(&self, key: &str) -> usize {
        self.primaries()
            .into_iter()
            .find(|&i| self.nodes[i].cli(&["EXISTS", key]).trim() == "1")
            .unwrap_or_else(|| panic!("no primary holds {key}"))
    }

    /// The replica of the primary `primary`, by index.
    pub fn replica_of(&self, primary: usize) -> usize {
        let primary_port = format!("master_port:{}\r", self.nodes[primary].port);
        (0..self.nodes.len())
            .find(|&i| {
                i != primary
                    && self.nodes[i].running()
                    && self.nodes[i]
                        .cli(&["INFO", "replication"])
                        .contains(&primary_port)
            })
            .expect("the primary has a replica")
    }

    /// The keys under `prefix` held by the primaries.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let pattern = format!("{prefix}*");
        self.primaries()
            .into_iter()
            .flat_map(|i| {
                self.nodes[i]
                    .cli(&["--scan", "--pattern", &pattern])
                    .lines()
                    .filter(|k| !k.is_empty())
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// A standalone `redis-server` owned by one test that speaks TLS only and requires every client
/// to present a certificate; killed when dropped.
pub struct TlsRedis {
    pub port: u16,
    /// The CA the server's certificate chains to, and a client certificate (chain, key) that it
    /// accepts, for `redis-cli`.
    ca: PathBuf,
    client: (PathBuf, PathBuf),
    log: PathBuf,
    child: Child,
}

impl TlsRedis {
    /// Starts a server presenting `cert` and `key`, accepting clients whose certificate `ca`
    /// signed, logging to `log`, and waits until it answers `client` (chain, key).
    pub fn start(
        ca: &Path,
        cert: &Path,
        key: &Path,
        client: (&Path, &Path),
        log: &Path,
    ) -> TlsRedis {
        let port = low_free_ports(1)[0];
        let child = Command::new(server())
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "no", "--tls-auth-clients", "yes"])
            .arg("--tls-cert-file")
            .arg(cert)
            .arg("--tls-key-file")
            .arg(key)
            .arg("--tls-ca-cert-file")
            .arg(ca)
            .arg("--logfile")
            .arg(log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (install redis-server)");
        let redis = TlsRedis {
            port,
            ca: ca.to_owned(),
            client: (client.0.to_owned(), client.1.to_owned()),
            log: log.to_owned(),
            child,
        };
        wait_for(
            || redis.cli(&["PING"]).trim() == "PONG",
            "redis-server answers PING over TLS",
        );
        redis
    }

    /// Runs `redis-cli` over TLS, with the client certificate, against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "--tls"])
            .arg("--cacert")
            .arg(&self.ca)
            .arg("--cert")
            .arg(&self.client.0)
            .arg("--key")
            .arg(&self.client.1)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs (install redis-tools)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What the server has logged so far.
    pub fn log_text(&self) -> String {
        super::read_log(&self.log)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        super::stop_showing_log(&mut self.child, "redis-server", &self.log);
    }
}

/// The process id of the server on `port`, from `INFO server`.
pub fn pid_of(port: u16) -> u32 {
    cli(port, &["INFO", "server"])
        .lines()
        .find_map(|l| l.trim().strip_prefix("process_id:"))
        .and_then(|pid| pid.parse().ok())
        .expect("INFO server names the process id")
}

/// A process stopped by SIGSTOP, continued (SIGCONT) by `resume` or when dropped: a failing test
/// never leaves a server stopped, which its supervising shell could not end.
pub struct Stopped(u32);

impl Stopped {
    pub fn new(pid: u32) -> Stopped {
        signal(pid, "STOP");
        Stopped(pid)
    }

    /// SIGCONT, by dropping it.
    pub fn resume(self) {}
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // Unchecked: this also runs while a failing test unwinds.
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// Sends `SIG<name>` to `pid`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{name} {pid}");
}

/// Runs `redis-cli -p port args…` and returns its output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs (install redis-tools)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// How many times `EVALSHA` ran on these primaries, from `INFO commandstats`.
pub fn evalsha_calls(ports: &[u16]) -> u64 {
    ports
        .iter()
        .map(|&p| {
            cli(p, &["INFO", "commandstats"])
                .lines()
                .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
                .and_then(|rest| rest.split(',').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// Starts `servers` in the background of an `sh`, which stops them once its stdin closes.
fn supervise(prelude: &str, servers: &[String]) {
    let background: String = servers
        .iter()
        .map(|s| format!("{s} & pids=\"$pids $!\"; "))
        .collect();
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{prelude} {background} cat >/dev/null; kill $pids; wait"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh starts");
    GUARDS.lock().unwrap().push(child);
}

/// `n` distinct free loopback ports, each with its cluster bus port (port + 10000) free too, all
/// below 32768: outside the range the kernel picks outgoing connections' ports from (32768 and
/// up by default), so a Redis killed and started again on its port finds it free.
fn low_free_ports(n: usize) -> Vec<u16> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        + u64::from(std::process::id()) * 7_919;
    let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
    let mut ports = Vec::with_capacity(n);
    for i in 0..5_000u64 {
        let port = 12_000 + ((seed + i * 104_729) % 10_000) as u16;
        if !ports.contains(&port) && free(port) && free(port + 10_000) {
            ports.push(port);
            if ports.len() == n {
                return ports;
            }
        }
    }
    panic!("no {n} free loopback port pairs below 32768");
}

fn wait_for(ready: impl Fn() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting until {what}");
}
