//! What `serve` tells about itself: the metrics' own address and path, envoyproxy/ratelimit's
//! statsd stats, traces, and how log lines are written and filtered.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::telemetry::LogFormat;
use crate::telemetry::statsd::{StatsdSettings, parse_tags};
use crate::telemetry::traces::{Protocol, TracingSettings};

#[derive(Args)]
#[command(next_help_heading = "Metrics and logs")]
pub struct TelemetryFlags {
    /// Serve Prometheus metrics also on this address (envoyproxy/ratelimit's PROMETHEUS_ADDR; Envoy
    /// Gateway scrapes :19001), at --metrics-path.
    ///
    /// They stay on --http-addr's /metrics.
    #[arg(long, env = "SLUICE_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on --metrics-addr.
    #[arg(long, env = "SLUICE_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    metrics_path: String,
    /// Send envoyproxy/ratelimit's statsd stats to this statsd, HOST:PORT, over UDP (its
    /// USE_STATSD, STATSD_HOST, STATSD_PORT).
    ///
    /// The host is resolved at each flush until it resolves.
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
    /// Export traces (OpenTelemetry, OTLP) over this protocol: http (protobuf over HTTP, port 4318)
    /// or grpc (port 4317).
    ///
    /// Each ShouldRateLimit call is a span continuing the trace Envoy sends (W3C traceparent or
    /// B3), with its store call and Redis script call as child spans (envoyproxy/ratelimit's
    /// TRACING_ENABLED and TRACING_EXPORTER_PROTOCOL).
    #[arg(long, env = "SLUICE_TRACING", value_enum)]
    tracing: Option<Protocol>,
    /// The collector traces go to, such as http://collector:4318 (OTLP/HTTP's /v1/traces is added
    /// to an address without a path).
    ///
    /// Without it, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, then OTEL_EXPORTER_OTLP_ENDPOINT, else
    /// localhost on the protocol's port. Other OTEL_EXPORTER_OTLP_* variables (headers, timeout,
    /// compression) apply too.
    #[arg(long, env = "SLUICE_TRACING_ENDPOINT")]
    tracing_endpoint: Option<String>,
    /// The share of traces sampled, 0 to 1, where the caller did not decide.
    ///
    /// A call whose caller sampled its trace (or did not) follows that (TRACING_SAMPLING_RATE).
    #[arg(long, env = "SLUICE_TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    tracing_sampling_rate: f64,
    /// The service name spans are exported under (TRACING_SERVICE_NAME).
    #[arg(long, env = "SLUICE_TRACING_SERVICE_NAME", default_value = "sluice")]
    tracing_service_name: String,
    /// The service namespace spans are exported under (TRACING_SERVICE_NAMESPACE).
    #[arg(long, env = "SLUICE_TRACING_SERVICE_NAMESPACE")]
    tracing_service_namespace: Option<String>,
    /// The service instance id spans are exported under, a random one by default
    /// (TRACING_SERVICE_INSTANCE_ID).
    #[arg(long, env = "SLUICE_TRACING_SERVICE_INSTANCE_ID")]
    tracing_service_instance_id: Option<String>,
    /// Spans waiting for export at most; past it, spans are dropped and counted in
    /// sluice_trace_spans_total{outcome="dropped"}, never holding a decision up.
    #[arg(long, env = "SLUICE_TRACING_QUEUE", default_value_t = 4096)]
    tracing_queue: usize,
    /// Bytes of spans waiting for export, or being sent, at most (each span's size estimated; a
    /// span records at most 256 bytes of any string).
    ///
    /// Past it, spans are dropped and counted as past --tracing-queue.
    #[arg(long, env = "SLUICE_TRACING_QUEUE_BYTES", default_value_t = 16 * 1024 * 1024)]
    tracing_queue_bytes: usize,
    /// Put descriptor values in spans (the entries of each descriptor, which can be personal data:
    /// client addresses, user ids).
    ///
    /// Without it, spans name the rules matched only.
    #[arg(long, env = "SLUICE_TRACING_VALUES")]
    tracing_values: bool,
    /// How log lines are written: text, or json (one object per line).
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// A level (error, warn, info, debug, trace: sluice's own events; its libraries' stay at info)
    /// or a full filter such as `info,sluice_core::store=debug`.
    ///
    /// Without it, SLUICE_LOG or RUST_LOG, else info.
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
        if !(0.0..=1.0).contains(&self.tracing_sampling_rate) {
            anyhow::bail!("--tracing-sampling-rate: must be between 0 and 1");
        }
        if self.tracing_queue == 0 {
            anyhow::bail!("--tracing-queue: must be more than 0");
        }
        if self.tracing_queue_bytes == 0 {
            anyhow::bail!("--tracing-queue-bytes: must be more than 0");
        }
        Ok(())
    }

    /// Where and how traces go, if they do.
    pub fn tracing(&self) -> Option<TracingSettings> {
        Some(TracingSettings {
            protocol: self.tracing?,
            endpoint: self.tracing_endpoint.clone(),
            sampling_rate: self.tracing_sampling_rate,
            service_name: self.tracing_service_name.clone(),
            service_namespace: self.tracing_service_namespace.clone(),
            service_instance_id: self.tracing_service_instance_id.clone(),
            queue: self.tracing_queue,
            queue_bytes: self.tracing_queue_bytes,
            values: self.tracing_values,
        })
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
