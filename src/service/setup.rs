//! What a server is made of: the rules, the store, the bounds and answers, the listeners'
//! addresses; each event loop makes its services from it.

use std::net::SocketAddr;
use std::sync::Arc;

use super::auth::AdminAccess;
use super::conns::MaxAge;
use super::decide::Decider;
use super::in_force::Rules;
use super::rlqs::Rlqs;
use super::rls::{Answering, Bounds, Fallback, Rls};
use super::shutdown::Shutdown;
use super::tls::ServerTls;
use crate::quota::Quotas;
use crate::telemetry::Telemetry;
use sluice_core::limiter::OverLimitCache;
use sluice_core::limiter::lease::Leases;
use sluice_core::store::{Backend, StoreError};

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
    /// What every part tells of what it does.
    pub telemetry: Telemetry,
    /// Who may use the admin endpoints, and change counters through `/counters`.
    pub admin: AdminAccess,
}

impl Setup {
    /// A rate limit service for the calling runtime (on Redis, with connections of its own,
    /// made in the background).
    pub(super) fn rls(&self) -> Result<Arc<Rls>, StoreError> {
        let store = self.backend.open()?;
        Ok(Arc::new(Rls::new(
            self.rules.shared(),
            Decider::new(
                store,
                self.cache.clone(),
                self.leases.clone(),
                self.fallback.store_timeout,
                self.telemetry.clone(),
            ),
            self.bounds,
            self.fallback,
            self.answering.clone(),
            self.telemetry.clone(),
        )))
    }

    /// A quota service for the calling runtime (its streams are served on the quota service's
    /// own thread).
    pub(super) fn rlqs(&self, shutdown: Shutdown) -> Rlqs {
        Rlqs::new(self.quotas.clone(), self.rules.shared(), shutdown)
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
