//! The network surface: the gRPC server (rate limit service, health, reflection) and the admin
//! HTTP server, started together and stopped together, and the readiness they both report.
//!
//! gRPC connections are served by event loops, one single-threaded runtime per thread; the
//! listener hands each new connection to the next loop in turn and the connection stays there.
//! On one loop, the answers to the requests that arrived together are written together, where a
//! work-stealing runtime would wake the connection, and write to the socket, once per answer.
//! Every listener's connections are bounded (`conns`): how many, how long idle, how old. The
//! quota service's own listener (`--quota-addr`), when there is one, is served the same way on
//! the quota service's thread.

mod conns;
mod decide;
pub mod explain;
mod gauges;
mod http;
mod metadata;

pub mod reload;
mod render;
pub mod rlqs;
pub mod rls;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use arc_swap::ArcSwap;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use crate::quota::Quotas;
use rlqs::Rlqs;
use rls::{Answering, Bounds, Fallback, Rls};
use tls::ServerTls;

pub use conns::MaxAge;
use conns::{Budget, Connections, Slot, Timers, Tracked};
use decide::Decider;

use crate::limiter::OverLimitCache;
use crate::limiter::lease::{Leases, Pass};
use crate::rules::RuleSet;
use crate::store::{Backend, StoreError};
use crate::telemetry::Throttle;

/// The compiled `proto/` descriptor set (see build.rs).
pub(crate) const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// Tells every server to stop accepting and drain.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    pub fn new() -> (watch::Sender<bool>, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (tx, Shutdown(rx))
    }

    /// Whether it has fired.
    pub fn fired(&self) -> bool {
        *self.0.borrow()
    }

    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// The rules in force, swapped whole by a reload.
#[derive(Clone, Default)]
pub struct Rules {
    current: Arc<ArcSwap<RuleSet>>,
    changed: Arc<Notify>,
}

impl Rules {
    pub fn new(rules: RuleSet) -> Self {
        Rules {
            current: Arc::new(ArcSwap::from_pointee(rules)),
            changed: Arc::default(),
        }
    }

    /// Puts `rules` in force for every request that starts from now on (see `reload` for
    /// loading them).
    pub fn replace(&self, rules: RuleSet) {
        self.current.store(Arc::new(rules));
        self.changed.notify_one();
    }

    /// Whether rules are loaded: any domain from files; any configuration over xDS, where an
    /// empty one (no rate limits anywhere) is as valid as any.
    pub fn loaded(&self) -> bool {
        let rules = self.current.load();
        rules.domains() > 0 || (self.over_xds() && !rules.is_awaiting())
    }

    /// Whether the rules come over xDS (they started awaiting their first configuration).
    pub fn over_xds(&self) -> bool {
        self.current.load().origin().over_xds
    }
}

/// Bounds on what a client can make the server hold before a request is even decoded.
#[derive(Clone, Copy, Debug)]
pub struct Edges {
    /// The largest gRPC message or `/json` body.
    pub max_request_bytes: usize,
    /// Requests in flight on one HTTP/2 connection.
    pub max_concurrent_streams: u32,
    /// The largest header list of a gRPC call (HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE); a call
    /// past it is refused (431), one past four times it ends its connection (hyper's h2).
    pub max_header_list_bytes: u32,
    /// gRPC connections open at once (fewer if the file descriptor limit leaves fewer).
    pub max_connections: usize,
    /// When a gRPC connection is told to go (GOAWAY), and closed.
    pub max_connection_age: Option<MaxAge>,
}

/// What a rate limit service is made of; each event loop makes its own from it.
#[derive(Clone)]
pub struct Setup {
    pub rules: Rules,
    pub backend: Backend,
    pub bounds: Bounds,
    pub fallback: Fallback,
    pub edges: Edges,
    pub answering: Answering,
    /// The local over-limit cache, shared by every event loop; `None` when switched off.
    pub cache: Option<Arc<OverLimitCache>>,
    /// The blocks of leased counters this replica holds, shared by every event loop.
    pub leases: Arc<Leases>,
    /// gRPC over TLS only; without it, plaintext.
    pub tls: Option<ServerTls>,
    pub healthcheck: Healthcheck,
    /// The quota service's streams on this replica, shared by every event loop.
    pub quotas: Arc<Quotas>,
}

/// What envoyproxy/ratelimit's health model (`/healthcheck`, gRPC health for `ratelimit`)
/// requires beyond not shutting down and the store reached once since the start.
#[derive(Clone, Copy, Debug, Default)]
pub struct Healthcheck {
    /// Healthy before any rules are loaded (that project's default, without
    /// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
    pub without_rules: bool,
    /// Unhealthy whenever the store is unreachable, not only until it is first reached (its
    /// `REDIS_HEALTH_CHECK_ACTIVE_CONNECTION`).
    pub follows_store: bool,
}

impl Setup {
    /// A rate limit service for the calling runtime (on Redis, with connections of its own,
    /// made in the background).
    fn rls(&self) -> Result<Arc<Rls>, StoreError> {
        let store = self.backend.open()?;
        Ok(Arc::new(Rls::new(
            self.rules.current.clone(),
            Decider::new(
                store,
                self.cache.clone(),
                self.leases.clone(),
                self.fallback.store_timeout,
            ),
            self.bounds,
            self.fallback,
            self.answering.clone(),
        )))
    }

    /// A quota service for the calling runtime (its streams are served on the quota service's
    /// own thread).
    fn rlqs(&self, shutdown: Shutdown) -> Result<Rlqs, StoreError> {
        Ok(Rlqs::new(
            self.quotas.clone(),
            self.rules.current.clone(),
            shutdown,
        ))
    }
}

/// The rate limit service's name in gRPC health.
const RLS: &str = <RateLimitServiceServer<Rls> as tonic::server::NamedService>::NAME;
/// The name envoyproxy/ratelimit reports its health under in gRPC health.
const ERL_HEALTH: &str = "ratelimit";
/// How long Watch streams have to see NOT_SERVING at shutdown before they are ended.
const WATCHERS_SEE: Duration = Duration::from_millis(100);

/// Whether sluice can answer from its rules and its store: rules are loaded, the store is
/// reachable, the replicas `--redis-confirm-replicas` asks for are attached, and it is not
/// shutting down. Reported by `/readyz` and by gRPC health.
#[derive(Clone)]
pub struct Readiness {
    rules: Rules,
    backend: Backend,
    shutdown: Shutdown,
    healthcheck: Healthcheck,
    /// The store has been reachable at least once since the start.
    reached: Arc<AtomicBool>,
}

impl Readiness {
    /// `None` when ready, else why not (for an unreachable store, the cause last seen; for
    /// missing replicas, the primaries that lack them).
    pub fn problem(&self) -> Option<String> {
        if self.shutdown.fired() {
            Some("shutting down".into())
        } else if !self.rules.loaded() {
            Some("no rules loaded".into())
        } else if !self.store_reachable() {
            Some(match self.backend.unreachable_cause() {
                Some(cause) => format!("the counter store is unreachable ({cause})"),
                None => "the counter store is unreachable".into(),
            })
        } else {
            self.backend.unconfirmable()
        }
    }

    /// Whether the store is reachable now, remembering that it was.
    fn store_reachable(&self) -> bool {
        let reachable = self.backend.reachable();
        if reachable {
            self.reached.store(true, Ordering::Relaxed);
        }
        reachable
    }

    /// Whether envoyproxy/ratelimit's `/healthcheck` would call sluice healthy: not shutting
    /// down, rules loaded (unless `--healthcheck-without-rules`, or over xDS), and the store reached once
    /// since the start. A later store outage does not fail it (that project's default, and what
    /// a liveness probe on it needs: a restart cures no Redis outage) unless
    /// `--healthcheck-follows-store`; `/readyz` reports one. Reads state only: never waits on
    /// the store.
    pub fn healthy(&self) -> bool {
        // Over xDS, envoyproxy/ratelimit is healthy whether or not the first configuration has
        // come.
        let rules = self.healthcheck.without_rules || self.rules.loaded() || self.rules.over_xds();
        if self.shutdown.fired() || !rules {
            return false;
        }
        self.store_reachable()
            || (!self.healthcheck.follows_store && self.reached.load(Ordering::Relaxed))
    }

    /// Keeps gRPC health in step: readiness for the empty service name and the rate limit
    /// service, `/healthcheck` for `ratelimit` (as envoyproxy/ratelimit reports it).
    async fn report(self, mut health: HealthReporter) {
        let serving = |yes| {
            if yes {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            }
        };
        let mut last = None;
        loop {
            let ready = serving(self.problem().is_none());
            let healthy = serving(self.healthy());
            if last != Some((ready, healthy)) {
                health.set_service_status("", ready).await;
                health.set_service_status(RLS, ready).await;
                health.set_service_status(ERL_HEALTH, healthy).await;
                last = Some((ready, healthy));
            }
            if self.shutdown.fired() {
                // Watch streams never end on their own: once they have seen NOT_SERVING, end
                // them, so that the drain waits only for calls.
                tokio::time::sleep(WATCHERS_SEE).await;
                for name in ["", RLS, ERL_HEALTH] {
                    health.clear_service_status(name).await;
                }
                return;
            }
            tokio::select! {
                () = self.rules.changed.notified() => {}
                () = self.backend.changed() => {}
                () = self.shutdown.clone().wait() => {}
            }
        }
    }
}

/// Where the admin `/json` endpoint (which moves counters) is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonAt {
    /// With the other admin endpoints, on the HTTP address.
    Http,
    /// On an address of its own.
    Addr(SocketAddr),
    /// Nowhere.
    Off,
}

/// The addresses sluice serves on.
#[derive(Clone, Debug)]
pub struct Addrs {
    pub grpc: SocketAddr,
    /// The quota service alone, served on its own thread.
    pub quota: Option<SocketAddr>,
    pub http: SocketAddr,
    pub json: JsonAt,
    /// Prometheus metrics also on an address of their own, at this path (envoyproxy/ratelimit's
    /// PROMETHEUS_ADDR and PROMETHEUS_PATH).
    pub metrics: Option<(SocketAddr, String)>,
    /// envoyproxy/ratelimit's debug port (`/rlconfig`), if served.
    pub debug: Option<SocketAddr>,
}

/// Serves gRPC with `loops` event loops and the admin HTTP server (and `/json` where `addrs`
/// says) until `shutdown` fires, then lets in-flight calls finish. Every listener is bound at
/// once and admin HTTP served at once; gRPC connections are accepted once the store is reached,
/// or `STORE_AT_START` after the start if it is not.
pub async fn run(
    setup: Setup,
    addrs: Addrs,
    loops: usize,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let grpc_listener = bind(addrs.grpc, "gRPC").await?;
    let quota_listener = bind_some(addrs.quota, "the quota service").await?;
    let http_listener = bind(addrs.http, "HTTP").await?;
    let json_addr = match addrs.json {
        JsonAt::Addr(addr) => Some(addr),
        JsonAt::Http | JsonAt::Off => None,
    };
    let json_listener = bind_some(json_addr, "/json").await?;
    let metrics_addr = addrs.metrics.as_ref().map(|(addr, _)| *addr);
    let metrics_listener = bind_some(metrics_addr, "metrics").await?;
    let debug_listener = bind_some(addrs.debug, "debug HTTP").await?;
    let mut serving = format!(
        "serving: gRPC on {} ({loops} event loops), admin HTTP on {}",
        grpc_listener.local_addr()?,
        http_listener.local_addr()?
    );
    if let Some(listener) = &quota_listener {
        serving += &format!(", the quota service alone on {}", listener.local_addr()?);
    }
    match &json_listener {
        Some(listener) => serving += &format!(", /json on {}", listener.local_addr()?),
        None if addrs.json == JsonAt::Off => serving += ", /json off",
        None => {}
    }
    if let (Some(listener), Some((_, path))) = (&metrics_listener, &addrs.metrics) {
        serving += &format!(", metrics also on {}{path}", listener.local_addr()?);
    }
    if let Some(listener) = &debug_listener {
        serving += &format!(", the debug port on {}", listener.local_addr()?);
    }
    tracing::info!("{serving}");

    let admin_listeners = 1 + [
        json_listener.is_some(),
        metrics_listener.is_some(),
        debug_listener.is_some(),
    ]
    .iter()
    .filter(|apart| **apart)
    .count();
    let budget = Budget::from_limit(loops, admin_listeners, setup.edges.max_connections);
    let grpc_connections = Connections::new("gRPC", budget.grpc);

    let health = HealthReporter::new();
    let readiness = Readiness {
        rules: setup.rules.clone(),
        backend: setup.backend.clone(),
        shutdown: shutdown.clone(),
        healthcheck: setup.healthcheck,
        reached: Arc::default(),
    };
    let rls = setup.rls()?;
    // A reload that changes a quota rule reaches the streams of the buckets it divides at once.
    setup
        .quotas
        .spawn(setup.quotas.clone().follow(setup.rules.current.clone()));
    // Gives back the blocks that went unused, on this thread's own store connections.
    let store_timeout = setup.fallback.store_timeout;
    let giver = Decider::new(
        setup.backend.open()?,
        None,
        setup.leases.clone(),
        store_timeout,
    );
    // Every half of `--lease-idle`, or sooner when a failed give-back is due to be sent again.
    let give_back = async {
        let stop = shutdown.clone().wait();
        tokio::pin!(stop);
        let mut periodic = tokio::time::Instant::now() + setup.leases.idle() / 2;
        loop {
            let wake = giver.next_due().map_or(periodic, |due| due.min(periodic));
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = &mut stop => return,
            }
            let now = tokio::time::Instant::now();
            let pass = if now >= periodic {
                periodic = now + setup.leases.idle() / 2;
                Pass::Periodic
            } else {
                Pass::Retry
            };
            giver.give_back(pass).await;
        }
    };
    let mut connections = Vec::with_capacity(loops);
    let mut finished = Vec::with_capacity(loops);
    let mut runtimes = vec![
        ("main", tokio::runtime::Handle::current()),
        ("quota", setup.quotas.runtime()),
    ];
    for n in 0..loops {
        let (to_loop, incoming) = mpsc::unbounded_channel();
        let (ready, loop_ready) = oneshot::channel();
        let (done, loop_finished) = oneshot::channel();
        let grpc = Grpc {
            setup: setup.clone(),
            health: health.clone(),
            shutdown: shutdown.clone(),
        };
        std::thread::Builder::new()
            .name(format!("sluice-loop-{n}"))
            .spawn(move || {
                let _ = done.send(grpc.serve(incoming, ready));
            })
            .context("starting an event loop")?;
        runtimes.push((
            "event_loop",
            loop_ready.await.context("an event loop stopped")??,
        ));
        connections.push(to_loop);
        finished.push(loop_finished);
    }

    // The quota service's own listener shares the gRPC connections' bound.
    let (quota_accept, quota_served) = quota_listener
        .map(|listener| {
            let (to_quota, incoming) = mpsc::unbounded_channel();
            let grpc = Grpc {
                setup: setup.clone(),
                health: health.clone(),
                shutdown: shutdown.clone(),
            };
            let served = setup.quotas.spawn(grpc.serve_quota(incoming));
            let accept = hand_out(
                listener,
                grpc_connections.clone(),
                vec![to_quota],
                shutdown.clone(),
            );
            (accept, served)
        })
        .unzip();
    let quota_accept = async {
        if let Some(accept) = quota_accept {
            accept.await;
        }
    };
    tokio::spawn(readiness.clone().report(health));
    if let Some(tls) = &setup.tls {
        tokio::spawn(tls.clone().watch());
    }
    let accept = hand_out(
        grpc_listener,
        grpc_connections,
        connections,
        shutdown.clone(),
    );
    // Connections wait in the listeners' backlogs meanwhile, the admin port answering.
    let accept = async {
        store_reached_at_start(&setup.backend, shutdown.clone()).await;
        tokio::join!(accept, quota_accept);
    };
    let gauges = gauges::Gauges {
        backend: setup.backend.clone(),
        cache: setup.cache.clone(),
        leases: setup.leases.clone(),
        quotas: setup.quotas.clone(),
        runtimes: runtimes.into(),
    };
    let metrics = match (metrics_listener, addrs.metrics) {
        (Some(listener), Some((_, path))) => {
            Some((listener, http::metrics_route(&path, gauges.clone())))
        }
        _ => None,
    };
    // `/explain` moves no counter: it stays on the admin port wherever `/json` is served.
    let mut admin = http::admin(readiness, setup.rules.clone(), gauges).merge(explain::route(
        setup.rules.clone(),
        setup.bounds,
        setup.answering.clone(),
        setup.backend.redis_key_prefix().map(str::to_owned),
        setup.edges.max_request_bytes,
    ));
    let json = http::json_route(rls, setup.edges.max_request_bytes);
    if addrs.json == JsonAt::Http {
        admin = admin.merge(json.clone());
    }
    admin = admin.merge(http::index(addrs.json == JsonAt::Http));
    let admin_http = |name| Connections::new(name, budget.admin);
    let http = serve_http(
        http_listener,
        admin,
        admin_http("admin HTTP"),
        shutdown.clone(),
    );
    let json = async {
        if let Some(listener) = json_listener {
            serve_http(listener, json, admin_http("/json"), shutdown.clone()).await;
        }
    };
    let metrics = async {
        if let Some((listener, route)) = metrics {
            serve_http(listener, route, admin_http("metrics"), shutdown.clone()).await;
        }
    };
    let debug = async {
        if let Some(listener) = debug_listener {
            let route = http::debug(setup.rules.clone());
            serve_http(listener, route, admin_http("debug HTTP"), shutdown.clone()).await;
        }
    };
    tokio::join!(accept, http, json, metrics, debug, give_back);
    for loop_finished in finished {
        loop_finished
            .await
            .context("an event loop stopped")?
            .context("gRPC server")?;
    }
    if let Some(served) = quota_served {
        served
            .await
            .context("the quota service's thread stopped")?
            .context("the quota service's gRPC server")?;
    }
    // Every call answered: what the blocks still hold goes back before the process ends.
    let _ = tokio::time::timeout(GIVE_BACK_AT_EXIT, giver.give_back(Pass::Exit)).await;
    Ok(())
}

/// Listens on `addr` for `what`.
async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for {what} on {addr}"))
}

/// Listens on `addr`, if there is one, for `what`.
async fn bind_some(addr: Option<SocketAddr>, what: &str) -> anyhow::Result<Option<TcpListener>> {
    match addr {
        Some(addr) => Ok(Some(bind(addr, what).await?)),
        None => Ok(None),
    }
}

/// Waits, at the start, until every store connection has reached the store, for at most
/// `STORE_AT_START`: a request is then not answered by `--on-store-error` only because sluice
/// has just started. Past it, sluice serves as it does while the store is unreachable.
async fn store_reached_at_start(backend: &Backend, shutdown: Shutdown) {
    let start = Instant::now();
    // Polled: `Backend::changed` wakes one waiter, which is gRPC health's.
    let reached = async {
        while !backend.reachable() {
            tokio::time::sleep(STORE_POLL).await;
        }
    };
    tokio::select! {
        () = reached => tracing::info!(
            after_ms = start.elapsed().as_millis() as u64,
            "the counter store is reached: accepting gRPC connections"
        ),
        () = tokio::time::sleep(STORE_AT_START) => tracing::warn!(
            "the counter store was not reached within {STORE_AT_START:?} of the start: accepting \
             gRPC connections, answered by --on-store-error until it is"
        ),
        () = shutdown.wait() => {}
    }
}

/// How long gRPC connections wait at the start for the store to be reached.
const STORE_AT_START: Duration = Duration::from_secs(2);
/// How often the start looks again whether the store is reached.
const STORE_POLL: Duration = Duration::from_millis(5);
/// How long the blocks still held at exit have to reach the store.
const GIVE_BACK_AT_EXIT: Duration = Duration::from_secs(1);
/// The longest pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How long a new connection may stay silent: one that sends nothing only holds a descriptor.
const FIRST_BYTES: Duration = Duration::from_secs(10);
/// How long a gRPC connection, once served, may go before its first call: one that never calls
/// only holds a descriptor and memory.
const FIRST_REQUEST: Duration = Duration::from_secs(10);
/// How long a gRPC connection may stay with no call in flight; Envoy opens a new one when it
/// needs one.
const IDLE: Duration = Duration::from_secs(300);
/// What a gRPC stream may send ahead of what its handler has read (HTTP/2's default, where the
/// server's default is 1 MiB): a rate limit request is far smaller, and a quota stream waiting
/// its turn (`--quota-max-reports`) holds its Envoy's next report at the Envoy rather than in
/// the event loop that carries its connection.
const STREAM_WINDOW: u32 = 65_535;
/// How long a peer told to go (GOAWAY) for idleness has to close before it is closed.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// How long a gRPC call may take to send its request message, on top of `--store-timeout` for
/// its answer: past both, it is answered DEADLINE_EXCEEDED.
const REQUEST_MESSAGE: Duration = Duration::from_secs(10);
/// How long an admin HTTP client may take to send a request's headers, the first or the next
/// on a kept-alive connection, before the connection is closed.
const HEADER_READ: Duration = Duration::from_secs(10);
/// How long an admin HTTP request may take to be answered, its body read included: past it, 408.
const ADMIN_ANSWER: Duration = Duration::from_secs(30);

/// Accepts the next connection on `listener`. A failed accept (out of file descriptors, a
/// connection reset while queued) is logged at most once a second through `failed` and
/// followed by a pause, doubling from 5 ms to `ACCEPT_BACKOFF` while it lasts (`pause`), so that
/// a lasting one does not spin.
async fn accept(
    listener: &TcpListener,
    pause: &mut Duration,
    failed: &Throttle,
    what: &str,
) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                *pause = Duration::ZERO;
                return stream;
            }
            Err(e) => {
                if let Some(n) = failed.hit() {
                    tracing::warn!("{n} failed accept(s) of {what} connections: {e}");
                }
                *pause = (*pause * 2).clamp(Duration::from_millis(5), ACCEPT_BACKOFF);
                tokio::time::sleep(*pause).await;
            }
        }
    }
}

/// Accepts gRPC connections until `shutdown` fires and hands them to the event loops in turn,
/// each once it has sent its first bytes (within `FIRST_BYTES`, or it is closed) and only if
/// `connections` has room for it.
async fn hand_out(
    listener: TcpListener,
    connections: Connections,
    loops: Vec<mpsc::UnboundedSender<(std::net::TcpStream, Slot)>>,
    shutdown: Shutdown,
) {
    static FAILED: Throttle = Throttle::new();
    let stop = shutdown.wait();
    tokio::pin!(stop);
    let mut next = 0;
    let mut pause = Duration::ZERO;
    loop {
        let stream = tokio::select! {
            stream = accept(&listener, &mut pause, &FAILED, "gRPC") => stream,
            () = &mut stop => return,
        };
        let Some(slot) = connections.admit() else {
            continue;
        };
        // Lets a connection closed to make room, if waiting on this thread for its first bytes,
        // give its descriptor back before the next accept takes one.
        tokio::task::yield_now().await;
        let to_loop = loops[next].clone();
        tokio::spawn(async move {
            let mut first = [0; 1];
            let peek = tokio::time::timeout(FIRST_BYTES, stream.peek(&mut first));
            let spoke = tokio::select! {
                peeked = peek => matches!(peeked, Ok(Ok(_))),
                () = slot.evicted() => false,
            };
            if spoke {
                match stream.set_nodelay(true).and_then(|()| stream.into_std()) {
                    // Fails only while the loops stop.
                    Ok(stream) => drop(to_loop.send((stream, slot))),
                    Err(e) => tracing::warn!("setting up a gRPC connection: {e}"),
                }
            }
        });
        next = (next + 1) % loops.len();
    }
}

/// Serves `router` over HTTP/1.1 on `listener` until `shutdown` fires, then lets the
/// connections finish what they are answering. Each connection has `HEADER_READ` to send the
/// headers of a request and `ADMIN_ANSWER` for its answer; `connections` bounds how many.
async fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    connections: Connections,
    shutdown: Shutdown,
) {
    static FAILED: Throttle = Throttle::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ);
    let http1 = Arc::new(http1);
    let timers = Timers {
        grace: CLOSE_GRACE,
        ..Timers::default()
    };
    let late = || {
        use axum::response::IntoResponse;
        let message = format!("no answer within {}s\n", ADMIN_ANSWER.as_secs());
        (axum::http::StatusCode::REQUEST_TIMEOUT, message).into_response()
    };
    let mut served = JoinSet::new();
    let stop = shutdown.clone().wait();
    tokio::pin!(stop);
    let mut pause = Duration::ZERO;
    loop {
        let stream = tokio::select! {
            stream = accept(&listener, &mut pause, &FAILED, "HTTP") => stream,
            Some(_) = served.join_next(), if !served.is_empty() => continue,
            () = &mut stop => break,
        };
        let Some(slot) = connections.admit() else {
            continue;
        };
        let service = Tracked::new(router.clone(), &slot, ADMIN_ANSWER, late);
        let http1 = http1.clone();
        let shutdown = shutdown.clone();
        served.spawn(async move {
            let io = TokioIo::new(stream);
            let connection = http1.serve_connection(io, TowerToHyperService::new(service));
            conns::supervise(connection, &slot, &timers, shutdown).await;
        });
    }
    drop(listener);
    while served.join_next().await.is_some() {}
}

/// What one event loop serves.
struct Grpc {
    setup: Setup,
    health: HealthReporter,
    shutdown: Shutdown,
}

impl Grpc {
    /// Runs a single-threaded runtime on this thread serving the connections sent on `incoming`,
    /// once its store is open (said on `ready`), until `shutdown` fires and they are finished.
    fn serve(
        self,
        incoming: mpsc::UnboundedReceiver<(std::net::TcpStream, Slot)>,
        ready: oneshot::Sender<Result<tokio::runtime::Handle, StoreError>>,
    ) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        runtime.block_on(async move {
            let services = self
                .setup
                .rls()
                .and_then(|rls| Ok((rls, self.setup.rlqs(self.shutdown.clone())?)));
            let (rls, rlqs) = match services {
                Ok(services) => {
                    let _ = ready.send(Ok(handle));
                    services
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return Ok(());
                }
            };
            let max = self.setup.edges.max_request_bytes;
            let mut routes = self.routes(rlqs)?;
            routes
                .add_service(RateLimitServiceServer::from_arc(rls).max_decoding_message_size(max));
            self.connections(routes, incoming).await;
            Ok(())
        })
    }

    /// Serves the connections sent on `incoming` with the quota service alone (and health and
    /// reflection), on the calling runtime, until `shutdown` fires and they are finished.
    async fn serve_quota(
        self,
        incoming: mpsc::UnboundedReceiver<(std::net::TcpStream, Slot)>,
    ) -> anyhow::Result<()> {
        let rlqs = self.setup.rlqs(self.shutdown.clone())?;
        let routes = self.routes(rlqs)?;
        self.connections(routes, incoming).await;
        Ok(())
    }

    /// The services every gRPC listener serves: health, reflection and the quota service.
    fn routes(&self, rlqs: Rlqs) -> anyhow::Result<tonic::service::RoutesBuilder> {
        let max = self.setup.edges.max_request_bytes;
        let reflection_v1 = reflection().build_v1().context("reflection v1")?;
        let reflection_v1alpha = reflection().build_v1alpha().context("reflection v1alpha")?;
        let mut routes = tonic::service::Routes::builder();
        routes
            .add_service(
                HealthServer::new(HealthService::from_health_reporter(self.health.clone()))
                    .max_decoding_message_size(max),
            )
            .add_service(reflection_v1.max_decoding_message_size(max))
            .add_service(reflection_v1alpha.max_decoding_message_size(max))
            .add_service(RateLimitQuotaServiceServer::new(rlqs).max_decoding_message_size(max));
        Ok(routes)
    }

    /// Serves the connections sent on `incoming` with `routes` until `shutdown` fires and they
    /// are finished.
    async fn connections(
        self,
        routes: tonic::service::RoutesBuilder,
        mut incoming: mpsc::UnboundedReceiver<(std::net::TcpStream, Slot)>,
    ) {
        let edges = self.setup.edges;
        let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .initial_stream_window_size(STREAM_WINDOW)
            .max_concurrent_streams(edges.max_concurrent_streams)
            .max_header_list_size(edges.max_header_list_bytes);
        let serving = Arc::new(Serving {
            routes: routes.routes().prepare(),
            http2,
            tls: self.setup.tls.clone(),
            answer_within: REQUEST_MESSAGE + self.setup.fallback.store_timeout,
            timers: Timers {
                first_request: Some(FIRST_REQUEST),
                idle: Some(IDLE),
                max_age: edges.max_connection_age,
                grace: CLOSE_GRACE,
            },
        });
        let mut served = JoinSet::new();
        let stop = self.shutdown.clone().wait();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                handed = incoming.recv() => match handed {
                    Some((stream, slot)) => {
                        let serving = serving.clone();
                        served.spawn(serving.connection(stream, slot, self.shutdown.clone()));
                    }
                    None => break,
                },
                Some(_) = served.join_next(), if !served.is_empty() => {}
                () = &mut stop => break,
            }
        }
        while served.join_next().await.is_some() {}
    }
}

/// How an event loop serves each of its gRPC connections.
struct Serving {
    routes: tonic::service::Routes,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    tls: Option<ServerTls>,
    answer_within: Duration,
    timers: Timers,
}

impl Serving {
    /// Serves one connection (after its TLS handshake, if TLS is on) until it ends or its
    /// `slot` is needed by another.
    async fn connection(
        self: Arc<Self>,
        stream: std::net::TcpStream,
        slot: Slot,
        shutdown: Shutdown,
    ) {
        let Ok(stream) = TcpStream::from_std(stream) else {
            return;
        };
        let late = || {
            tonic::Status::deadline_exceeded(format!(
                "no request message within {}s",
                REQUEST_MESSAGE.as_secs()
            ))
            .into_http()
        };
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        let service = TowerToHyperService::new(
            Tracked::new(self.routes.clone(), &slot, self.answer_within, late).with_peer(peer),
        );
        match &self.tls {
            None => {
                let connection = self.http2.serve_connection(TokioIo::new(stream), service);
                conns::supervise(connection, &slot, &self.timers, shutdown).await;
            }
            Some(tls) => {
                let handshaken = tokio::select! {
                    tls = tls.accept(stream) => tls,
                    () = slot.evicted() => None,
                };
                if let Some(stream) = handshaken {
                    let connection = self.http2.serve_connection(TokioIo::new(stream), service);
                    conns::supervise(connection, &slot, &self.timers, shutdown).await;
                }
            }
        }
    }
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}
