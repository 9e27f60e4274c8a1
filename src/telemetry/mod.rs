//! Logs and metrics. Logging: `tracing` events to stderr, as text (coloured only on a terminal)
//! or one JSON object per line, `info` by default; `Throttle` keeps an event that every request
//! (or a spinning loop) can hit from flooding the log. Metrics: see `metrics`; who is being
//! limited right now, in sketches of a fixed size: see `top`. Traces
//! (OpenTelemetry) would be a layer on the same subscriber, added in `init`, over spans opened on
//! the request path.

pub mod mapper;
pub mod metrics;
pub mod statsd;
pub mod top;

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event (`timestamp`, `level`, `target`, `fields`).
    Json,
}

/// Starts logging. `level` (`--log-level`) is a level (`debug`: sluice's own events at debug,
/// its libraries' at info) or a full filter (`info,sluice=trace`); without it, `SLUICE_LOG`,
/// then `RUST_LOG`, else `info`.
pub fn init(format: LogFormat, level: Option<&str>) {
    let filter = match level {
        Some(l) if l.contains(['=', ',']) => EnvFilter::new(l),
        Some(l) => EnvFilter::new(format!("info,sluice={l}")),
        None => EnvFilter::try_from_env("SLUICE_LOG")
            .or_else(|_| EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| EnvFilter::new("info")),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(false).init(),
    }
}

/// Counts occurrences of one event and lets it be logged at most once a second.
pub struct Throttle {
    /// When it was last logged, and how many occurred since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub const fn new() -> Self {
        Throttle {
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many occurred since the last log (this one included)
    /// when it is time to log again.
    pub fn hit(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, count) = &mut *state;
        *count += 1;
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(count))
    }
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_logs_the_first_hit_then_at_most_once_a_second_with_the_count() {
        let t = Throttle::new();
        assert_eq!(t.hit(), Some(1));
        for _ in 0..1000 {
            assert_eq!(t.hit(), None);
        }
        *t.state.lock().unwrap() = (Some(Instant::now() - Duration::from_secs(2)), 1000);
        assert_eq!(t.hit(), Some(1001));
    }
}
