//! What `/metrics` reads at scrape time rather than counting on the request path: the store's
//! state (breakers, live counters), the local cache's size and the process's own resources.

use std::sync::Arc;

use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::quota::Quotas;
use crate::telemetry::Telemetry;
use sluice_core::limiter::OverLimitCache;
use sluice_core::limiter::lease::Leases;
use sluice_core::store::Backend;

/// The handles a scrape reads.
#[derive(Clone)]
pub struct Gauges {
    pub backend: Backend,
    /// The metrics every part counts into.
    pub telemetry: Telemetry,
    pub cache: Option<Arc<OverLimitCache>>,
    pub leases: Arc<Leases>,
    pub quotas: Arc<Quotas>,
    /// The Tokio runtimes serving, by role (`main`, `quota`, `event_loop`), whose tasks a
    /// growth would show in.
    pub runtimes: Arc<[(&'static str, tokio::runtime::Handle)]>,
}

impl Gauges {
    /// Every metric, in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut r = Registry::default();
        self.store_into(&mut r);
        self.leases_into(&mut r);
        self.quotas_into(&mut r);
        self.tasks_into(&mut r);
        process(&mut r);
        // Envoy Gateway's "Global Ratelimit" dashboard charts this Go runtime gauge of
        // envoyproxy/ratelimit; a value keeps its panel from showing "no data".
        r.register(
            "go_memstats_gc_cpu_fraction",
            "Always 0: sluice has no garbage collector (the Go runtime gauge envoyproxy/ratelimit exports, kept for dashboards that chart it)",
            ConstGauge::new(0.0),
        );
        self.telemetry.metrics().encode(&r)
    }

    /// The counter store's state: reachable, its breakers, replicas and clock, its counters.
    fn store_into(&self, r: &mut Registry) {
        let reachable = i64::from(self.backend.reachable());
        r.register(
            "sluice_store_reachable",
            "1 when the counter store can decide (Redis: every breaker closed), else 0",
            ConstGauge::new(reachable),
        );
        if let Some(open) = self.backend.open_breakers() {
            r.register(
                "sluice_store_breakers_open",
                "Redis circuit breakers open (one per event loop): requests get --on-store-error",
                ConstGauge::new(open as i64),
            );
        }
        if let Some(short) = self.backend.unreplicated_primaries() {
            r.register(
                "sluice_store_unreplicated_primaries",
                "Redis primaries with fewer replicas attached than --redis-confirm-replicas asks \
                 for: their requests get --on-store-error at once",
                ConstGauge::new(short as i64),
            );
        }
        if let Some(skew) = self.backend.clock_skew_ms() {
            r.register(
                "sluice_clock_skew_seconds",
                "How far Redis' clock reads ahead of this replica's (behind, when negative), \
                 measured every second; past the shortest calendar window, calendar limits \
                 cannot be counted and /readyz reports not ready",
                ConstGauge::new(skew as f64 / 1000.0),
            );
        }
        if let Some(live) = self.backend.live_counters() {
            r.register(
                "sluice_memory_counters",
                "Live counters in the embedded store",
                ConstGauge::new(live as i64),
            );
        }
        if let Some(live) = self.backend.live_replicas() {
            r.register(
                "sluice_replicas_live",
                "Replicas live as this one last read them from the store's beats (scope: split \
                 divides by it); 0 until read",
                ConstGauge::new(i64::from(live)),
            );
        }
        if let Some(cache) = &self.cache {
            r.register(
                "sluice_local_cache_entries",
                "Counters the local over-limit cache holds as full",
                ConstGauge::new(cache.entries() as i64),
            );
        }
    }

    /// What the leased blocks took, admitted, gave back and hold.
    fn leases_into(&self, r: &mut Registry) {
        let leased = self.leases.totals();
        r.register(
            "sluice_lease_blocks",
            "Blocks of leased counters this replica took from the store",
            ConstCounter::new(leased.blocks),
        );
        r.register(
            "sluice_lease_admitted_hits",
            "Hits admitted from leased blocks, with no store call",
            ConstCounter::new(leased.admitted),
        );
        r.register(
            "sluice_lease_returned_hits",
            "Hits of leased blocks given back to the store unused (idle, or at exit)",
            ConstCounter::new(leased.returned),
        );
        r.register(
            "sluice_lease_unreturned_hits",
            "Hits of leased blocks whose give-back failed and may not have reached the store: counted there until their window ends",
            ConstCounter::new(leased.unreturned),
        );
        r.register(
            "sluice_lease_held_hits",
            "Hits this replica holds now in leased blocks, those of give-backs to be sent again included",
            ConstGauge::new(self.leases.left(tokio::time::Instant::now()) as i64),
        );
    }

    /// The quota service's streams, assigned rates and what it tracks.
    fn quotas_into(&self, r: &mut Registry) {
        let streams = Family::<_, Gauge>::default();
        let rates = Family::<_, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        for (labels, subscribed, rate) in self.quotas.by_rule() {
            streams.get_or_create(&labels).set(subscribed as i64);
            rates.get_or_create(&labels).set(rate);
        }
        r.register(
            "sluice_quota_streams",
            "Envoy streams subscribed to a quota bucket on this replica, per quota bucket rule (one per stream and bucket)",
            streams,
        );
        r.register(
            "sluice_quota_assigned_rate",
            "Requests per second this replica has assigned to its Envoys, per quota bucket rule (allow-all assignments count none; a shadow-mode rule counts what it would assign)",
            rates,
        );
        let (buckets, streams) = self.quotas.tracked();
        r.register(
            "sluice_quota_tracked_buckets",
            "Quota buckets tracked on this replica, one per stream and bucket (at most --quota-max-buckets)",
            ConstGauge::new(buckets as i64),
        );
        r.register(
            "sluice_quota_tracked_streams",
            "Quota streams tracked on this replica (at most --quota-max-streams)",
            ConstGauge::new(streams as i64),
        );
    }

    /// The Tokio tasks alive, per runtime.
    fn tasks_into(&self, r: &mut Registry) {
        let tasks = Family::<[(&str, &str); 1], Gauge>::default();
        for (role, runtime) in self.runtimes.iter() {
            tasks
                .get_or_create(&[("runtime", role)])
                .inc_by(runtime.metrics().num_alive_tasks() as i64);
        }
        r.register(
            "sluice_tasks",
            "Tokio tasks alive, per runtime: main (admin, probes, accepts), quota (the quota service's thread) and event_loop (all of them)",
            tasks,
        );
    }
}

/// The process's CPU time, memory and open files, from /proc (Linux), under the names every
/// Prometheus client library uses.
fn process(r: &mut Registry) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let Some((_, rest)) = stat.rsplit_once(") ") else {
        return;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    // Clock ticks are 100 a second on every Linux Rust supports.
    const TICKS: f64 = 100.0;
    if let (Some(user), Some(system)) = (field(14), field(15)) {
        r.register(
            "process_cpu_seconds",
            "User and system CPU time spent",
            ConstCounter::new((user + system) as f64 / TICKS),
        );
    }
    if let Some(virtual_bytes) = field(23) {
        r.register(
            "process_virtual_memory_bytes",
            "Virtual memory size",
            ConstGauge::new(virtual_bytes as i64),
        );
    }
    if let Some(pages) = field(24) {
        r.register(
            "process_resident_memory_bytes",
            "Resident memory size",
            ConstGauge::new((pages * 4096) as i64),
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        r.register(
            "process_open_fds",
            "Open file descriptors",
            ConstGauge::new(fds.count() as i64),
        );
    }
}
