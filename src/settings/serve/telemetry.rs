//! What `serve` tells about itself: the metrics' own address and path, envoyproxy/ratelimit's
//! statsd stats, and how log lines are written and filtered.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::telemetry::LogFormat;
use crate::telemetry::statsd::{StatsdSettings, parse_tags};

#[derive(Args)]
#[command(next_help_heading = "Metrics and logs")]
pub struct TelemetryFlags {
    /// Serve Prometheus metrics also on this address (envoyproxy/ratelimit's PROMETHEUS_ADDR;
    /// Envoy Gateway scrapes :19001), at --metrics-path; they stay on --http-addr's /metrics.
    #[arg(long, env = "SLUICE_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on --metrics-addr.
    #[arg(long, env = "SLUICE_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    metrics_path: String,
    /// Send envoyproxy/ratelimit's statsd stats to this statsd, HOST:PORT, over UDP (its
    /// USE_STATSD, STATSD_HOST, STATSD_PORT). The host is resolved at each flush until it
    /// resolves.
    #[arg(long, env = "SLUICE_STATSD_ADDR")]
    statsd_addr: Option<String>,
    /// How often the statsd stats are sent (STATS_FLUSH_INTERVAL).
    #[arg(long, env = "SLUICE_STATSD_FLUSH_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    statsd_flush_interval: Duration,
    /// Tags on every statsd stat, key:value,key:value (EXTRA_TAGS): in the stat's name
    /// (`.__key=value`), or after the line with --statsd-dogstatsd.
    #[arg(long, env = "SLUICE_STATSD_TAGS", default_value = "")]
    statsd_tags: String,
    /// Tag statsd stats DogStatsD's way, `|#key:value` (USE_DOG_STATSD).
    #[arg(long, env = "SLUICE_STATSD_DOGSTATSD")]
    statsd_dogstatsd: bool,
    /// How log lines are written: text, or json (one object per line).
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// A level (error, warn, info, debug, trace: sluice's own events; its libraries' stay at
    /// info) or a full filter such as `info,sluice::store=debug`. Without it, SLUICE_LOG or
    /// RUST_LOG, else info.
    #[arg(long, env = "SLUICE_LOG_LEVEL")]
    log_level: Option<String>,
}

impl TelemetryFlags {
    /// The metrics' own address and path, if they have one.
    pub(super) fn metrics_at(&self) -> Option<(SocketAddr, String)> {
        self.metrics_addr
            .map(|addr| (addr, self.metrics_path.clone()))
    }

    /// Rejects a statsd flush interval of 0 and tags that are not key:value pairs.
    pub(super) fn check(&self) -> anyhow::Result<()> {
        if self.statsd_flush_interval.is_zero() {
            anyhow::bail!("--statsd-flush-interval: must be more than 0");
        }
        parse_tags(&self.statsd_tags).map_err(|e| anyhow::anyhow!("--statsd-tags: {e}"))?;
        Ok(())
    }

    /// Where and how the statsd stats go, if they do.
    pub fn statsd(&self) -> Option<StatsdSettings> {
        Some(StatsdSettings {
            addr: self.statsd_addr.clone()?,
            every: self.statsd_flush_interval,
            tags: parse_tags(&self.statsd_tags).unwrap_or_default(),
            dogstatsd: self.statsd_dogstatsd,
        })
    }

    pub fn log_format(&self) -> LogFormat {
        self.log_format
    }

    /// A level or a full filter; `None` for the environment's.
    pub fn log_level(&self) -> Option<&str> {
        self.log_level.as_deref()
    }
}

/// A literal URL path for --metrics-path: a `/`, then no query, fragment, space or route
/// pattern characters.
fn parse_metrics_path(value: &str) -> Result<String, String> {
    let literal = |c: char| c.is_ascii_graphic() && !"{}*?#:".contains(c);
    if !value.starts_with('/') || !value.chars().all(literal) {
        return Err("a path such as /metrics".into());
    }
    Ok(value.to_owned())
}
