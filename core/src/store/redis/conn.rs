//! Connections to Redis: the URL forms (standalone, TLS, Sentinel, Cluster), the reconnect policy,
//! the replies that mean a connection reaches a node that is no longer a primary (`WRONG_NODE`),
//! the probe that loads the scripts and pings, closing and opening the store's breaker, the
//! connections confirmed calls run on (`Lanes`), and the reading of the primaries' replicas.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fred::bytes_utils::Str;
use fred::clients::WithOptions;
use fred::interfaces::{ClientLike, ClusterInterface};
use fred::prelude::*;
use fred::socket2::TcpKeepalive;
use fred::types::config::ReconnectError;
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, FromValue, InfoKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc};
use tokio::time::Instant;

use super::RedisTls;
use super::replication::{self, Primary, Replication};
use crate::log_throttle::LogThrottle;
use crate::store::StoreError;
use crate::store::guard::Breaker;

/// How long a TCP connection to Redis may take when a failure is diagnosed.
const DIAGNOSIS: Duration = Duration::from_millis(500);
/// How often an open breaker's probe tries Redis.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// How often, and how patiently, a closed breaker's probe pings Redis, so that an outage is
/// noticed (and reported by readiness) even when no request comes.
const PING_INTERVAL: Duration = Duration::from_secs(1);
/// How soon a listener whose channel to its reader was full tries again to tell it that
/// messages were missed.
const MISSED_RETRY: Duration = Duration::from_millis(10);
/// Error replies meaning the connection now reaches a node that cannot run the scripts: a
/// primary demoted behind a fixed address (a Kubernetes Service, a cloud primary endpoint, DNS),
/// a replica cut off from its primary, a node loading its data. fred drops the connection the
/// first one comes on (once, whatever calls were in flight on it) and reconnects as the
/// reconnect policy says, reaching whichever node the address leads to now.
const WRONG_NODE: [(&str, ReconnectError); 3] = [
    ("READONLY", ReconnectError::ReadOnly),
    ("MASTERDOWN", ReconnectError::MasterDown),
    ("LOADING", ReconnectError::Loading),
];

/// A Redis client.
#[derive(Clone)]
pub(super) struct Conn {
    client: Client,
    /// The same client, failing commands at once while it is not connected rather than holding
    /// them until it reconnects, where they would arrive after their caller gave up.
    at_once: WithOptions<Client>,
}

impl Conn {
    /// A client of `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`),
    /// connecting in the background and retrying with backoff. `tls`, given for a TLS URL,
    /// replaces the client's default (the system's CAs, no client certificate). Fails only on a
    /// malformed URL.
    pub(super) fn connect(url: &str, tls: Option<&RedisTls>) -> Result<Conn, StoreError> {
        let client = builder(url, tls)?.build().map_err(config_error)?;
        client.connect();
        let at_once = client.with_options(&Options {
            fail_fast: true,
            ..Default::default()
        });
        Ok(Conn { client, at_once })
    }

    /// Whether it reaches a Cluster.
    pub(super) fn clustered(&self) -> bool {
        self.client.is_clustered()
    }

    /// Sends `command` with `args` once, failing at once while not connected.
    pub(super) async fn send<R: FromValue>(
        &self,
        command: CustomCommand,
        args: Vec<Value>,
    ) -> Result<R, Error> {
        self.at_once.custom(command, args).await
    }

    /// Waits, at most `timeout`, for `replicas` replicas of the node that serves `slot` to
    /// acknowledge every write this connection sent it so far (`WAIT`): `Unconfirmed` when
    /// fewer do in time. Redis holds every later command of the connection until it answers:
    /// send it only on a lane (`Lanes`).
    pub(super) async fn confirm(
        &self,
        slot: ClusterHash,
        replicas: u32,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        // Never 0, which WAIT takes as no timeout at all.
        let ms = timeout.as_millis().clamp(1, i64::MAX as u128) as i64;
        // Sent as a plain command, so that the client queues the calls behind it on the
        // connection as usual: Redis holds them until WAIT answers.
        let wait = CustomCommand::new_static("WAIT", slot, false);
        let args = vec![Value::from(i64::from(replicas)), Value::from(ms)];
        let confirmed: i64 = self.send(wait, args).await.map_err(failed)?;
        let confirmed = u32::try_from(confirmed).unwrap_or(0);
        if confirmed < replicas {
            return Err(StoreError::Unconfirmed {
                confirmed,
                asked: replicas,
            });
        }
        Ok(())
    }

    /// Loads `scripts` on every primary.
    async fn load(&self, scripts: &[Script]) -> Result<(), Error> {
        for script in scripts {
            script.load(&self.client).await?;
        }
        Ok(())
    }

    /// Every primary reached now, with its slots and the replicas its `INFO replication` counts
    /// as attached; unknown for a primary that does not answer in `REFRESH`. A node that answers
    /// as a replica is left out.
    async fn primaries(&self) -> Vec<Primary> {
        let mut slots: BTreeMap<Server, Vec<(u16, u16)>> = BTreeMap::new();
        let routing = self.clustered().then(|| self.client.cached_cluster_state());
        if let Some(routing) = routing.flatten() {
            for range in routing.slots() {
                slots
                    .entry(range.primary.clone())
                    .or_default()
                    .push((range.start, range.end));
            }
        } else if let Some(server) = self.client.active_connections().into_iter().next() {
            slots.insert(server, vec![(0, u16::MAX)]);
        }
        let mut primaries = Vec::with_capacity(slots.len());
        for (server, slots) in slots {
            let node = self.client.with_options(&Options {
                cluster_node: self.clustered().then(|| server.clone()),
                fail_fast: true,
                timeout: Some(replication::REFRESH),
                ..Default::default()
            });
            let attached = match node.info::<String>(Some(InfoKind::Replication)).await {
                Ok(info) => match replication::attached(&info) {
                    Some(attached) => Some(attached),
                    // A demoted node behind a fixed address or a Sentinel: the script calls,
                    // on their lanes, meet its READONLY and reconnect; this connection, which
                    // carries none, reconnects now to follow them.
                    None => {
                        if !self.clustered() {
                            let _ = self.client.force_reconnection().await;
                        }
                        continue;
                    }
                },
                Err(_) => None,
            };
            primaries.push(Primary {
                name: format!("{}:{}", server.host, server.port),
                slots,
                attached,
            });
        }
        primaries
    }
}

/// Reads the replicas of every primary `conn` reaches into `replicas`, every `REFRESH` and
/// whenever a `WAIT` found fewer than asked, for as long as the process runs.
pub(super) async fn watch_replicas(conn: Conn, replicas: Replication) {
    loop {
        let primaries = conn.primaries().await;
        if !primaries.is_empty() {
            replicas.read(primaries);
        }
        replicas.next_read().await;
    }
}

/// Connections of their own for the script calls whose writes replicas confirm: each carries
/// one call and its `WAIT` at a time, so that no other command waits behind that `WAIT`.
pub(super) struct Lanes {
    all: Vec<Conn>,
    free: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
}

/// A lane taken for one call, given back when dropped.
pub(super) struct Lane {
    conn: Option<Conn>,
    lanes: Arc<Lanes>,
    _permit: OwnedSemaphorePermit,
}

impl Lanes {
    /// `n` connections to `url`, each a client of its own.
    pub(super) fn connect(
        url: &str,
        tls: Option<&RedisTls>,
        n: usize,
    ) -> Result<Arc<Lanes>, StoreError> {
        let all = (0..n)
            .map(|_| Conn::connect(url, tls))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(Lanes {
            free: Mutex::new(all.clone()),
            all,
            permits: Arc::new(Semaphore::new(n)),
        }))
    }

    /// A free lane, waiting for one until `deadline` at most.
    pub(super) async fn take(self: &Arc<Self>, deadline: Instant) -> Option<Lane> {
        let permit = self.permits.clone().acquire_owned();
        let permit = tokio::time::timeout_at(deadline, permit).await.ok()?.ok()?;
        let conn = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Some(Lane {
            conn,
            lanes: self.clone(),
            _permit: permit,
        })
    }

    /// Whether every lane answers a `PING`, waiting for its connection.
    async fn ping(&self) -> Result<(), Error> {
        for lane in &self.all {
            lane.client.ping::<()>(None).await?;
        }
        Ok(())
    }
}

impl Lane {
    pub(super) fn conn(&self) -> &Conn {
        self.conn
            .as_ref()
            .expect("a lane holds its connection until dropped")
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.lanes
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(conn);
        }
    }
}

/// The client settings of `url`, as `Conn::connect` says.
fn builder(url: &str, tls: Option<&RedisTls>) -> Result<Builder, StoreError> {
    let mut config = Config::from_url(url).map_err(|e| {
        let hint = if url.contains("://") {
            ""
        } else {
            " (a URL is expected, with its scheme: redis://host:6379, rediss://, redis-cluster://, redis-sentinel://; see docs/redis.md)"
        };
        StoreError::Config(format!("--redis-url: {e}{hint}"))
    })?;
    if let Some(tls) = tls {
        config.tls = Some(tls.connector());
    }
    // The first connection follows the reconnect policy too: sluice serves before Redis.
    config.fail_fast = false;
    let mut builder = Builder::from_config(config);
    builder
        .with_connection_config(|c| {
            c.max_command_attempts = 1;
            // A Cluster's MOVED refreshes the slots and fails the command, which did not run;
            // ASK fails it too. The client's own ASK handling reads the reply to ASKING off a
            // connection other commands are pipelined on, takes another's, and stops the client
            // for good: a slot migrating under load would take Redis away until a restart.
            c.max_redirections = 0;
            c.connection_timeout = Duration::from_secs(2);
            c.internal_command_timeout = Duration::from_secs(2);
            c.tcp = TcpConfig {
                nodelay: Some(true),
                keepalive: Some(
                    TcpKeepalive::new()
                        .with_time(Duration::from_secs(5))
                        .with_interval(Duration::from_secs(1)),
                ),
                user_timeout: Some(Duration::from_secs(5)),
                ..Default::default()
            };
            c.reconnect_errors = WRONG_NODE.iter().map(|(_, e)| e.clone()).collect();
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 500, 2));
    Ok(builder)
}

fn config_error(e: Error) -> StoreError {
    StoreError::Config(format!("--redis-url: {e}"))
}

/// Listens on `channel` of `url` for as long as `heard` is open, following reconnections and
/// re-subscribing after each: what `read` makes of every message's payload goes to `heard`
/// (one it makes nothing of is dropped), and what `missed` makes once messages may have been
/// missed: a connection made again (a restarted server may also have lost what it held), a
/// message that found `heard` full (told once there is room), or messages the client could not
/// keep up with.
pub(super) fn listen<T: Send + 'static>(
    url: &str,
    tls: Option<&RedisTls>,
    channel: Bytes,
    heard: mpsc::Sender<T>,
    read: impl Fn(Bytes) -> Option<T> + Send + 'static,
    missed: impl Fn() -> Option<T> + Send + 'static,
) -> Result<(), StoreError> {
    let subscriber = builder(url, tls)?
        .build_subscriber_client()
        .map_err(config_error)?;
    let mut messages = subscriber.message_rx();
    let reconnections = subscriber.reconnect_rx();
    subscriber.connect();
    subscriber.manage_subscriptions();
    tokio::spawn(async move {
        static FAILED: LogThrottle = LogThrottle::new();
        let channel = Str::from_inner(channel).unwrap_or_default();
        while let Err(e) = subscriber.subscribe(channel.clone()).await {
            if let Some(n) = FAILED.hit() {
                tracing::warn!("{n} failed subscription(s) to the channel {channel}: {e}");
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
        // The connections made until the subscription are no reconnections: nothing was held
        // before them.
        let mut reconnections = reconnections.resubscribe();
        // A message dropped for want of room: `missed` is told as soon as there is room.
        let mut dropped = false;
        loop {
            if dropped {
                match missed().map(|told| heard.try_send(told)) {
                    None | Some(Ok(())) => dropped = false,
                    Some(Err(mpsc::error::TrySendError::Full(_))) => {}
                    Some(Err(mpsc::error::TrySendError::Closed(_))) => return,
                }
            }
            let heard_now = tokio::select! {
                message = messages.recv() => match message {
                    Ok(message) => match message.value.into_bytes() {
                        Some(payload) => match read(payload) {
                            Some(told) => told,
                            None => continue,
                        },
                        None => continue,
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => match missed() {
                        Some(told) => told,
                        None => continue,
                    },
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                again = reconnections.recv() => match again {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => match missed() {
                        Some(told) => told,
                        None => continue,
                    },
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                () = tokio::time::sleep(MISSED_RETRY), if dropped => continue,
            };
            match heard.try_send(heard_now) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => dropped = true,
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    });
    Ok(())
}

/// What a command Redis failed comes to. A reply saying that the connection reaches a node that
/// is no longer a primary is logged: fred reconnects, to reach the primary. A MOVED or ASK
/// reply, which the client does not follow (see `builder`), is an answer.
pub(super) fn failed(e: Error) -> StoreError {
    if matches!(e.kind(), ErrorKind::Routing) && e.details().contains("redirections") {
        return StoreError::Redirected;
    }
    static WRONG: LogThrottle = LogThrottle::new();
    if WRONG_NODE
        .iter()
        .any(|(reply, _)| e.details().starts_with(reply))
        && let Some(n) = WRONG.hit()
    {
        tracing::warn!(
            "Redis answered like a node that is no longer a primary ({n} time(s) since the last \
             report): reconnecting, to reach the primary. {}",
            e.details()
        );
    }
    StoreError::Unavailable(format!("redis: {e}"))
}

/// While the breaker is open, loads the `scripts` on every primary (and pings every lane, when
/// there are lanes), every `PROBE_INTERVAL`; once that succeeds, closes it. A load waits while the client reconnects, and for a paused Redis to
/// resume, so it succeeds as soon as Redis answers again. While the breaker is closed, pings
/// Redis every `PING_INTERVAL` and opens it when no answer comes within that time; after each
/// answer, measures how far Redis' clock is from this replica's (`measure_skew`).
pub(super) async fn probe(
    conn: Conn,
    lanes: Option<Arc<Lanes>>,
    scripts: Vec<Script>,
    breaker: Arc<Breaker>,
) {
    let config = conn.client.client_config();
    let tls_to: Arc<[Server]> = if config.tls.is_some() {
        config.server.hosts().into()
    } else {
        Arc::new([])
    };
    tokio::spawn(causes(
        conn.client.error_rx(),
        breaker.clone(),
        config.server.hosts().into(),
        tls_to.clone(),
    ));
    if !tls_to.is_empty() {
        tokio::spawn(plain_text(tls_to.clone(), breaker.clone()));
    }
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    let mut last_ping = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        if breaker.is_open() {
            let reached = match &lanes {
                Some(lanes) => conn.load(&scripts).await.and(lanes.ping().await),
                None => conn.load(&scripts).await,
            };
            match reached {
                Ok(()) => breaker.close(),
                Err(e) => {
                    let (kind, detail) = diagnosed(&e, &tls_to).await;
                    breaker.unreachable(kind, &detail);
                }
            }
        } else if last_ping.elapsed() >= PING_INTERVAL {
            last_ping = tokio::time::Instant::now();
            let ping = conn.at_once.ping::<()>(None);
            match tokio::time::timeout(PING_INTERVAL, ping).await {
                Ok(Ok(())) => measure_skew(&conn, &breaker).await,
                Ok(Err(e)) => breaker.trip(&e),
                Err(_) => breaker.trip(&"no answer to PING within 1 s"),
            }
        }
    }
}

/// Tells `breaker` how far Redis' clock is from this replica's: Redis' `TIME`, read halfway
/// between the ask and the answer. A `TIME` that fails tells nothing (the `PING` before it says
/// whether Redis answers).
async fn measure_skew(conn: &Conn, breaker: &Breaker) {
    let asked = crate::store::unix_ms();
    let time = CustomCommand::new_static("TIME", ClusterHash::Random, false);
    let time = conn.send::<Vec<String>>(time, Vec::<Value>::new());
    if let Ok(Ok(time)) = tokio::time::timeout(PING_INTERVAL, time).await {
        let answered = crate::store::unix_ms();
        if let Some(redis_ms) = time_ms(&time) {
            let here = (asked + answered) / 2;
            breaker.measured_skew(redis_ms as i64 - here as i64);
        }
    }
}

/// Redis' `TIME` answer (seconds, then microseconds) in ms since the Unix epoch.
fn time_ms(time: &[String]) -> Option<u64> {
    let seconds: u64 = time.first()?.parse().ok()?;
    let micros: u64 = time.get(1)?.parse().ok()?;
    Some(seconds * 1000 + micros / 1000)
}

/// Tells `breaker` why each connection of its client could not be made or was dropped, naming
/// the server (or, when the client does not say which, the `servers` it reaches): these errors
/// reach no command (the commands wait for the reconnection), so without them an unreachable
/// store would not say why.
async fn causes(
    mut errors: broadcast::Receiver<(Error, Option<Server>)>,
    breaker: Arc<Breaker>,
    servers: Arc<[Server]>,
    tls_to: Arc<[Server]>,
) {
    let named = servers
        .iter()
        .map(Server::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    loop {
        match errors.recv().await {
            Ok((e, server)) => {
                let (kind, detail) = diagnosed(&e, &tls_to).await;
                // The refusal in words, not the operating system's error as Rust debugs it.
                let detail = if kind == "refused" {
                    "connection refused".to_owned()
                } else {
                    detail
                };
                let server = server.map_or_else(|| named.clone(), |s| s.to_string());
                breaker.unreachable(kind, &format!("{server}: {detail}"));
            }
            Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// While `breaker` is open, asks each server reached over TLS (`tls_to`) for a `PING` in plain
/// text, every `DIAGNOSIS`: one that answers it serves no TLS (a `rediss://` URL for a plain
/// Redis), which is said at once rather than when the TLS handshake times out.
async fn plain_text(tls_to: Arc<[Server]>, breaker: Arc<Breaker>) {
    loop {
        tokio::time::sleep(DIAGNOSIS).await;
        if !breaker.is_open() {
            continue;
        }
        for server in tls_to.iter() {
            if answers_plain_text(server).await {
                breaker.unreachable(
                    "tls",
                    &format!(
                        "{server} answers in plain text: it serves no TLS, which the URL asks for"
                    ),
                );
            }
        }
    }
}

/// Whether `server` answers a `PING` sent in plain text with a Redis reply, within `DIAGNOSIS`.
async fn answers_plain_text(server: &Server) -> bool {
    let asked = async {
        let mut tcp = TcpStream::connect((&*server.host, server.port)).await?;
        tcp.write_all(b"PING\r\n").await?;
        let mut first = [0u8; 1];
        tcp.read_exact(&mut first).await?;
        Ok::<_, std::io::Error>(matches!(first[0], b'+' | b'-'))
    };
    matches!(tokio::time::timeout(DIAGNOSIS, asked).await, Ok(Ok(true)))
}

/// Why Redis could not be reached, as `sluice_store_unreachable_total` counts it, and what to
/// say. A timeout over TLS (`tls_to`: the servers reached over TLS) when a plain TCP connection to
/// the same address is made at once is a TLS handshake that never completes: most likely a
/// server that speaks no TLS, reached through a `rediss://` URL.
async fn diagnosed(e: &Error, tls_to: &[Server]) -> (&'static str, String) {
    if matches!(e.kind(), ErrorKind::Timeout) {
        for server in tls_to {
            let tcp = TcpStream::connect((&*server.host, server.port));
            if let Ok(Ok(_)) = tokio::time::timeout(DIAGNOSIS, tcp).await {
                return (
                    "tls",
                    format!(
                        "TCP connections to {server} are made, but no TLS handshake completes: \
                         does it serve TLS? ({})",
                        e.details()
                    ),
                );
            }
        }
    }
    (cause_of(e), e.details().to_owned())
}

/// Why Redis could not be reached, as `sluice_store_unreachable_total` counts it.
fn cause_of(e: &Error) -> &'static str {
    let details = e.details();
    let says = |reply: &str| details.contains(reply);
    match e.kind() {
        _ if says("NOAUTH") || says("WRONGPASS") || says("invalid password") => "auth",
        ErrorKind::Auth => "auth",
        ErrorKind::Tls => "tls",
        ErrorKind::Timeout => "timeout",
        _ if says("READONLY") => "readonly",
        _ if says("LOADING") => "loading",
        _ if says("unknown command") => "unknown_command",
        ErrorKind::IO if says("refused") || says("Connection refused") => "refused",
        ErrorKind::IO => "io",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_to_reach_redis_is_told_by_its_cause() {
        let cause = |kind, details: &'static str| cause_of(&Error::new(kind, details));
        assert_eq!(
            cause(ErrorKind::IO, "Connection refused (os error 111)"),
            "refused"
        );
        assert_eq!(
            cause(ErrorKind::Auth, "WRONGPASS invalid username-password pair"),
            "auth"
        );
        assert_eq!(
            cause(ErrorKind::Unknown, "NOAUTH Authentication required."),
            "auth"
        );
        assert_eq!(cause(ErrorKind::Timeout, "Connection timed out"), "timeout");
        assert_eq!(
            cause(
                ErrorKind::Unknown,
                "READONLY You can't write against a read only replica."
            ),
            "readonly"
        );
        assert_eq!(
            cause(
                ErrorKind::Unknown,
                "LOADING Redis is loading the dataset in memory"
            ),
            "loading"
        );
        assert_eq!(
            cause(ErrorKind::Unknown, "ERR unknown command 'EVALSHA'"),
            "unknown_command"
        );
        assert_eq!(cause(ErrorKind::IO, "Broken pipe"), "io");
        assert_eq!(cause(ErrorKind::Protocol, "an unexpected frame"), "other");
    }
}
