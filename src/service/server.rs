//! The server's life: every listener bound at once, the event loops and the admin HTTP servers
//! started, gRPC connections accepted once the store is reached, and the drain at shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic_health::server::HealthReporter;

use super::accept::hand_out;
use super::admin::{Admin, Answers};
use super::conns::{Budget, Connections};
use super::decide::Decider;
use super::event_loop::{EventLoops, Grpc};
use super::gauges::Gauges;
use super::in_force::Rules;
use super::readiness::Readiness;
use super::setup::{Addrs, JsonAt, Setup};
use super::shutdown::Shutdown;
use sluice_core::limiter::lease::{Leases, Pass};
use sluice_core::limiter::{CounterKey, OverLimitCache};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::store::{Backend, Deadline, Reset, Store};

/// How long gRPC connections wait at the start for the store to be reached.
const STORE_AT_START: Duration = Duration::from_secs(2);
/// How often the start looks again whether the store is reached.
const STORE_POLL: Duration = Duration::from_millis(5);
/// How long the blocks still held at exit have to reach the store.
const GIVE_BACK_AT_EXIT: Duration = Duration::from_secs(1);

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
    let (grpc_listener, quota_listener, admin) = bind_all(&addrs, loops).await?;
    let budget = Budget::from_limit(loops, admin.count(), setup.edges.max_connections);
    let grpc_connections = Connections::new("gRPC", budget.grpc);
    let health = HealthReporter::new();
    let readiness = Readiness::new(&setup, shutdown.clone());
    let rls = setup.rls()?;
    let counters_store = setup.backend.open()?;
    follow_resets(&setup)?;
    // A reload that changes a quota rule reaches the streams of the buckets it divides at once.
    setup
        .quotas
        .spawn(setup.quotas.clone().follow(setup.rules.shared()));
    // Gives back the blocks that went unused, on this thread's own store connections.
    let giver = Decider::new(
        setup.backend.open()?,
        None,
        setup.leases.clone(),
        setup.fallback.store_timeout,
        setup.telemetry.clone(),
    );
    let grpc = Grpc {
        setup: setup.clone(),
        health: health.clone(),
        shutdown: shutdown.clone(),
    };
    let event_loops = grpc.start(loops).await?;
    // The quota service's own listener shares the gRPC connections' bound.
    let (quota_accept, quota_served) = quota_listener
        .map(|listener| {
            let (to_quota, incoming) = mpsc::unbounded_channel();
            let served = setup.quotas.spawn(grpc.clone().serve_quota(incoming));
            let accept = hand_out(
                listener,
                grpc_connections.clone(),
                vec![to_quota],
                shutdown.clone(),
            );
            (accept, served)
        })
        .unzip();
    tokio::spawn(readiness.clone().report(health));
    if let Some(tls) = &setup.tls {
        tokio::spawn(tls.clone().watch());
    }
    let accept = hand_out(
        grpc_listener,
        grpc_connections,
        event_loops.incoming.clone(),
        shutdown.clone(),
    );
    let accept = accept_once_reached(
        setup.backend.clone(),
        shutdown.clone(),
        accept,
        quota_accept,
    );
    let beat = beat(setup.backend.clone(), setup.rules.clone(), shutdown.clone());
    let answers = Answers {
        gauges: Gauges {
            backend: setup.backend.clone(),
            telemetry: setup.telemetry.clone(),
            cache: setup.cache.clone(),
            leases: setup.leases.clone(),
            quotas: setup.quotas.clone(),
            runtimes: runtimes(&setup, &event_loops).into(),
        },
        setup,
        json_at: addrs.json,
        readiness,
        rls,
        counters_store,
    };
    let admin = admin.serve(answers, budget.admin, shutdown.clone());
    tokio::join!(accept, admin, giver.give_back_until(shutdown.clone()), beat);
    event_loops.finished().await?;
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

/// Has the counters another replica reset forgotten here (`forget_resets`): room again, leased
/// blocks dropped.
fn follow_resets(setup: &Setup) -> anyhow::Result<()> {
    if let Some(resets) = setup.backend.listen_resets()? {
        tokio::spawn(forget_resets(
            resets,
            setup.cache.clone(),
            setup.leases.clone(),
            setup.backend.open()?,
        ));
    }
    Ok(())
}

/// Runs `accept` (and `quota_accept`) once the store is reached, or `STORE_AT_START` after the
/// start: connections wait in the listeners' backlogs meanwhile, the admin port answering.
async fn accept_once_reached(
    backend: Backend,
    shutdown: Shutdown,
    accept: impl Future<Output = ()>,
    quota_accept: Option<impl Future<Output = ()>>,
) {
    store_reached_at_start(&backend, shutdown).await;
    let quota_accept = async {
        if let Some(accept) = quota_accept {
            accept.await;
        }
    };
    tokio::join!(accept, quota_accept);
}

/// This replica's beat, for the split limits, taken back when `shutdown` fires; and the warning
/// of split limits smaller than the live replicas meanwhile.
async fn beat(backend: Backend, rules: Rules, shutdown: Shutdown) {
    let in_force = rules.clone();
    let wanted = move || in_force.in_force().longest_split_window_ms();
    let beating = async {
        if let Err(e) = backend.beat(shutdown.wait(), wanted).await {
            tracing::error!("the replicas' beat did not start: {e}");
        }
    };
    tokio::select! {
        () = beating => {}
        () = warn_small_splits(backend.clone(), rules) => {}
    }
}

/// How often the split limits are compared with the live replicas (as often as a replica beats).
const SPLIT_CHECK: Duration = Duration::from_secs(1);

/// Warns, at start, on every reload and whenever the live replicas change, when a `scope: split`
/// limit is smaller than the live replicas: some replicas then have a share of 0, and their
/// clients are always denied.
async fn warn_small_splits(backend: Backend, rules: Rules) {
    let mut warned = None;
    loop {
        let smallest = rules.in_force().smallest_split_limit();
        let live = backend.live_replicas().unwrap_or(1);
        let now = smallest.map(|(limit, source)| (limit, source, live));
        if now != warned {
            if let Some((limit, source, live)) = &now
                && live > limit
            {
                tracing::warn!(
                    "the split limit of {limit} of the rule at {source} is smaller than the {live} \
                     live replicas: {} of them have a share of 0 and deny every request of it",
                    live - limit
                );
            }
            warned = now;
        }
        tokio::time::sleep(SPLIT_CHECK).await;
    }
}

/// Forgets, in the over-limit cache and the leases, every counter another replica reset, for
/// as long as the store tells of them. Once resets may have been missed, empties the over-limit
/// cache and drops the leased blocks of the counters `store` marks changed by hand since their
/// blocks were taken (docs/leases.md).
async fn forget_resets(
    mut resets: mpsc::Receiver<Reset>,
    cache: Option<Arc<OverLimitCache>>,
    leases: Arc<Leases>,
    store: Store,
) {
    while let Some(reset) = resets.recv().await {
        match reset {
            Reset::Counter {
                key,
                requests_per_unit,
            } => {
                if let Some(cache) = &cache {
                    cache.forget(&key, requests_per_unit);
                }
                leases.forget(&key, requests_per_unit);
            }
            Reset::Missed => {
                static MISSED: LogThrottle = LogThrottle::new();
                if let Some(cache) = &cache {
                    cache.forget_all();
                }
                let dropped = drop_changed_blocks(&leases, &store).await;
                if let Some(n) = MISSED.hit() {
                    tracing::warn!(
                        "counter resets may have been missed ({n} time(s)): the reset channel's \
                         connection was made again; the over-limit cache is emptied, and the \
                         leased blocks of {dropped} counter(s) changed by hand since they were \
                         taken are dropped"
                    );
                }
            }
        }
    }
}

/// How long the markers of changes by hand are tried for once resets may have been missed (the
/// store may not be reached again yet: the reconnection that missed them is often the store's),
/// and how often.
const MARKERS_WAIT: Duration = Duration::from_secs(10);
const MARKERS_RETRY: Duration = Duration::from_millis(100);

/// Drops the leased blocks of the counters changed by hand since they were taken, as `store`
/// marks them; all of them when the marks cannot be read within `MARKERS_WAIT` (a block is then
/// given up, never spent past a reset). Answers how many counters' blocks were dropped.
async fn drop_changed_blocks(leases: &Leases, store: &Store) -> usize {
    let held = leases.held_since();
    if held.is_empty() {
        return 0;
    }
    let asked: Vec<(CounterKey, tokio::time::Instant)> = held
        .iter()
        .map(|(key, _, since)| (key.clone(), *since))
        .collect();
    let until = Instant::now() + MARKERS_WAIT;
    let changed = loop {
        let left = until.saturating_duration_since(Instant::now());
        match store.changed_after(&asked, Deadline::new(left, None)).await {
            Ok(changed) => break changed,
            Err(_) if Instant::now() + MARKERS_RETRY < until => {
                tokio::time::sleep(MARKERS_RETRY).await;
            }
            Err(e) => {
                tracing::warn!(
                    "the markers of counters changed by hand could not be read within {}s ({e}): \
                     every leased block is dropped",
                    MARKERS_WAIT.as_secs()
                );
                break vec![true; held.len()];
            }
        }
    };
    let mut dropped = 0;
    for ((key, requests_per_unit, _), changed) in held.iter().zip(changed) {
        if changed {
            leases.forget(key.as_bytes(), *requests_per_unit);
            dropped += 1;
        }
    }
    dropped
}

/// Every runtime of the process, by role: this one, the quota service's and the event loops'.
fn runtimes(setup: &Setup, loops: &EventLoops) -> Vec<(&'static str, tokio::runtime::Handle)> {
    let mut runtimes = vec![
        ("main", tokio::runtime::Handle::current()),
        ("quota", setup.quotas.runtime()),
    ];
    runtimes.extend(loops.runtimes.iter().map(|r| ("event_loop", r.clone())));
    runtimes
}

/// Binds every listener `addrs` asks for (gRPC, the quota service's own, the admin ones) and
/// logs where each serves.
async fn bind_all(
    addrs: &Addrs,
    loops: usize,
) -> anyhow::Result<(TcpListener, Option<TcpListener>, Admin)> {
    let grpc = bind(addrs.grpc, "gRPC").await?;
    let quota = bind_some(addrs.quota, "the quota service").await?;
    let json_addr = match addrs.json {
        JsonAt::Addr(addr) => Some(addr),
        JsonAt::Http | JsonAt::Off => None,
    };
    let admin = Admin {
        http: bind(addrs.http, "HTTP").await?,
        json: bind_some(json_addr, "/json").await?,
        metrics: match &addrs.metrics {
            Some((addr, path)) => Some((bind(*addr, "metrics").await?, path.clone())),
            None => None,
        },
        debug: bind_some(addrs.debug, "debug HTTP").await?,
    };
    let mut serving = format!(
        "serving: gRPC on {} ({loops} event loops), admin HTTP on {}",
        grpc.local_addr()?,
        admin.http.local_addr()?
    );
    if let Some(listener) = &quota {
        serving += &format!(", the quota service alone on {}", listener.local_addr()?);
    }
    match &admin.json {
        Some(listener) => serving += &format!(", /json on {}", listener.local_addr()?),
        None if addrs.json == JsonAt::Off => serving += ", /json off",
        None => {}
    }
    if let Some((listener, path)) = &admin.metrics {
        serving += &format!(", metrics also on {}{path}", listener.local_addr()?);
    }
    if let Some(listener) = &admin.debug {
        serving += &format!(", the debug port on {}", listener.local_addr()?);
    }
    tracing::info!("{serving}");
    Ok((grpc, quota, admin))
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
