//! What `serve` tells about itself: the metrics' own address and path, and how log lines are
//! written and filtered.

use std::net::SocketAddr;

use clap::Args;

use crate::telemetry::LogFormat;

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
