//! Logs and metrics. Logging: `tracing` events to stderr, as text (coloured only on a terminal)
//! or one JSON object per line, `info` by default (`sluice_core::log_throttle` keeps an event that every
//! request, or a spinning loop, can hit from flooding it). Metrics: see `metrics`; who is being
//! limited right now, in sketches of a fixed size: see `top`. Traces (OpenTelemetry, see
//! `traces`) are a layer on the same subscriber, added in `init`, over the spans opened on the
//! request path.

mod handle;
pub mod mapper;
pub mod metrics;
pub mod statsd;
pub mod top;
pub mod traces;

pub use handle::{PolicyAnswer, Telemetry};

use std::io::IsTerminal;

use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event (`timestamp`, `level`, `target`, `fields`).
    Json,
}

/// Starts logging, and tracing through `tracer` if given. `level` (`--log-level`) is a level
/// (`debug`: sluice's own events at debug, its libraries' at info) or a full filter
/// (`info,sluice=trace`); without it, `SLUICE_LOG`, then `RUST_LOG`, else `info`. The log never
/// sees the spans traced, nor the traces the log's events.
pub fn init(
    format: LogFormat,
    level: Option<&str>,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) {
    let filter = match level {
        Some(l) if l.contains(['=', ',']) => EnvFilter::new(l),
        Some(l) => EnvFilter::new(format!("info,sluice={l}")),
        None => EnvFilter::try_from_env("SLUICE_LOG")
            .or_else(|_| EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| EnvFilter::new("info")),
    };
    let Some(tracer) = tracer else {
        // One filter for the whole subscriber: an event it turns off costs nothing at its
        // call site.
        let registry = tracing_subscriber::registry().with(filter);
        registry.with(log_layer(format)).init();
        return;
    };
    // A filter per layer, each deciding once per call site: the log never sees the spans
    // traced, the traces only those spans.
    let spans_off = format!("{}=off", traces::TARGET)
        .parse()
        .expect("a valid directive");
    let traced = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(traces::TARGET, Level::INFO));
    tracing_subscriber::registry()
        .with(log_layer(format).with_filter(filter.add_directive(spans_off)))
        .with(traced)
        .init();
}

/// The layer writing log lines to stderr as `format` says.
fn log_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let builder = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => builder.json().with_current_span(false).boxed(),
    }
}
