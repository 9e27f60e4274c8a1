//! Whether sluice can answer (`/readyz`, gRPC health) and whether envoyproxy/ratelimit's health
//! model would call it healthy (`/healthcheck`, gRPC health for `ratelimit`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use super::in_force::Rules;
use super::setup::{Healthcheck, Setup};
use super::shutdown::Shutdown;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use sluice_core::store::Backend;

/// The rate limit service's name in gRPC health.
pub(super) const RLS: &str =
    <RateLimitServiceServer<super::rls::Rls> as tonic::server::NamedService>::NAME;
/// The name envoyproxy/ratelimit reports its health under in gRPC health.
const ERL_HEALTH: &str = "ratelimit";
/// How often readiness looks again at the clock's skew.
const SKEW_CHECK: Duration = Duration::from_secs(1);
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
    pub(super) fn new(setup: &Setup, shutdown: Shutdown) -> Self {
        Readiness {
            rules: setup.rules.clone(),
            backend: setup.backend.clone(),
            shutdown,
            healthcheck: setup.healthcheck,
            reached: Arc::default(),
        }
    }

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
            self.skewed().or_else(|| self.backend.unconfirmable())
        }
    }

    /// Why the calendar limits in force cannot be counted: this replica's clock is further from
    /// Redis' than their shortest window (a request with one fails, and is answered by
    /// `--on-store-error`); `None` while it is not, or without calendar limits.
    fn skewed(&self) -> Option<String> {
        let skew = self.backend.clock_skew_ms()?;
        let window = self.rules.in_force().shortest_calendar_window_ms()?;
        (skew.unsigned_abs() > window).then(|| {
            format!(
                "this replica's clock is {:.1} s {} Redis' clock, more than the shortest \
                 calendar window ({} s): calendar limits cannot be counted; set both by NTP",
                skew.unsigned_abs() as f64 / 1000.0,
                if skew > 0 { "behind" } else { "ahead of" },
                window / 1000
            )
        })
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
    pub(super) async fn report(self, mut health: HealthReporter) {
        let serving = |yes| {
            if yes {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            }
        };
        let mut last = None;
        let mut was_skewed = false;
        let mut tick = tokio::time::interval(SKEW_CHECK);
        loop {
            let skewed = self.skewed();
            if skewed.is_some() != was_skewed {
                was_skewed = skewed.is_some();
                match skewed {
                    Some(why) => tracing::warn!("not ready: {why}"),
                    None => tracing::info!(
                        "this replica's clock is back within a calendar window of Redis' clock"
                    ),
                }
            }
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
                () = self.rules.replaced() => {}
                () = self.backend.changed() => {}
                () = self.shutdown.clone().wait() => {}
                // The clock's skew is measured every second, and moves with no notice.
                _ = tick.tick() => {}
            }
        }
    }
}
