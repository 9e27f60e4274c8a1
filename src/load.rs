//! `sluice load`: a gRPC load generator for any Envoy rate limit service. Callers send
//! `ShouldRateLimit` requests over a few HTTP/2 connections, closed-loop or paced to a rate, and
//! report throughput, an HDR latency histogram and the answers by code.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use hdrhistogram::Histogram;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

/// What to send, how hard and for how long.
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    /// The rate limit service to load.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub target: SocketAddr,
    /// Requests in flight at once (one caller each).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// HTTP/2 connections the callers share.
    #[arg(long)]
    pub connections: Option<usize>,
    /// How long to run, e.g. 10s or 1m (default 10s unless --requests is given).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// How many requests to send in all.
    #[arg(long, conflicts_with = "duration")]
    pub requests: Option<u64>,
    /// Pace all callers together to this many requests per second (default: as fast as answered).
    #[arg(long)]
    pub rate: Option<f64>,
    /// The request's domain.
    #[arg(long, default_value = "bench")]
    pub domain: String,
    /// One descriptor as key=value[,key=value…]; repeat for several descriptors.
    #[arg(long = "descriptor", value_parser = parse_descriptor, default_value = "key=value")]
    pub descriptors: Vec<Vec<(String, String)>>,
    /// Spread the last value of every descriptor over this many distinct values.
    #[arg(long, default_value_t = 1)]
    pub distinct_values: u64,
    /// The request's hits_addend.
    #[arg(long, default_value_t = 1)]
    pub hits: u32,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
}

/// A descriptor from `key=value[,key=value…]`, each entry split at its first `=`.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!("'{pair}' is not key=value")),
        })
        .collect()
}

/// The outcome of a run.
#[derive(Debug, Serialize)]
pub struct Report {
    pub requests: u64,
    pub seconds: f64,
    pub requests_per_second: f64,
    pub latency_us: Latency,
    pub ok: u64,
    pub over_limit: u64,
    /// gRPC errors by code name.
    pub errors: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub struct Latency {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
}

/// What one caller saw.
struct Tally {
    latency: Histogram<u64>,
    ok: u64,
    over_limit: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            latency: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
            ok: 0,
            over_limit: 0,
            errors: BTreeMap::new(),
        }
    }

    fn add(&mut self, other: Tally) -> anyhow::Result<()> {
        self.latency.add(&other.latency)?;
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        Ok(())
    }
}

/// Runs the load: each connection and its callers on a single-threaded runtime of its own
/// thread, so that the generator spends little CPU per request.
pub async fn run(options: Options) -> anyhow::Result<Report> {
    let connections = options
        .connections
        .unwrap_or(options.concurrency.clamp(1, 4))
        .clamp(1, options.concurrency.max(1));
    let duration = match (options.duration, options.requests) {
        (Some(d), _) => Some(d),
        (None, None) => Some(Duration::from_secs(10)),
        (None, Some(_)) => None,
    };
    let start = Instant::now();
    let deadline = duration.map(|d| start + d);
    let sent = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let options = Arc::new(options);

    let progress = (!options.quiet).then(|| {
        let done = done.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            let mut last = 0;
            loop {
                tick.tick().await;
                let now = done.load(Ordering::Relaxed);
                eprint!(
                    "\r{:>7.1} s  {now:>10} requests  {:>9} /s",
                    start.elapsed().as_secs_f64(),
                    now - last
                );
                last = now;
            }
        })
    });

    let mut connections_done = Vec::with_capacity(connections);
    for connection in 0..connections {
        let (finished, tally) = tokio::sync::oneshot::channel();
        let (options, sent, done) = (options.clone(), sent.clone(), done.clone());
        std::thread::Builder::new()
            .name(format!("load-{connection}"))
            .spawn(move || {
                let tally = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(anyhow::Error::from)
                    .and_then(|runtime| {
                        runtime.block_on(connection_load(
                            options,
                            connection,
                            connections,
                            deadline,
                            sent,
                            done,
                        ))
                    });
                let _ = finished.send(tally);
            })?;
        connections_done.push(tally);
    }
    let mut total = Tally::new();
    for tally in connections_done {
        total.add(tally.await??)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    let requests = total.latency.len();
    let h = &total.latency;
    Ok(Report {
        requests,
        seconds,
        requests_per_second: requests as f64 / seconds,
        latency_us: Latency {
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
        },
        ok: total.ok,
        over_limit: total.over_limit,
        errors: total.errors,
    })
}

/// One connection and the callers numbered `connection`, `connection + connections`, …
async fn connection_load(
    options: Arc<Options>,
    connection: usize,
    connections: usize,
    deadline: Option<Instant>,
    sent: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<Tally> {
    let channel = Endpoint::from_shared(format!("http://{}", options.target))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to {}", options.target))?;
    let callers: Vec<_> = (connection..options.concurrency)
        .step_by(connections)
        .map(|i| {
            tokio::spawn(caller(
                RateLimitServiceClient::new(channel.clone()),
                options.clone(),
                i,
                deadline,
                sent.clone(),
                done.clone(),
            ))
        })
        .collect();
    let mut total = Tally::new();
    for c in callers {
        total.add(c.await?)?;
    }
    Ok(total)
}

async fn caller(
    mut client: RateLimitServiceClient<Channel>,
    options: Arc<Options>,
    index: usize,
    deadline: Option<Instant>,
    sent: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
) -> Tally {
    let mut tally = Tally::new();
    // Paced callers each send rate / concurrency requests per second, starting staggered.
    let interval = options
        .rate
        .map(|r| Duration::from_secs_f64(options.concurrency as f64 / r.max(0.001)));
    let mut next = Instant::now()
        + interval.map_or(Duration::ZERO, |i| {
            i.mul_f64(index as f64 / options.concurrency as f64)
        });
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let seq = sent.fetch_add(1, Ordering::Relaxed);
        if options.requests.is_some_and(|n| seq >= n) {
            break;
        }
        if let Some(interval) = interval {
            tokio::time::sleep_until(next.into()).await;
            next += interval;
        }
        let request = build(&options, seq);
        let began = Instant::now();
        let answer = client.should_rate_limit(request).await;
        let took = began.elapsed().as_micros().max(1) as u64;
        tally.latency.saturating_record(took);
        match answer {
            Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => tally.over_limit += 1,
            Ok(_) => tally.ok += 1,
            Err(status) => {
                *tally
                    .errors
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1
            }
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    tally
}

/// The request numbered `seq`: the configured descriptors, each one's last value spread over
/// `distinct_values` values.
fn build(options: &Options, seq: u64) -> RateLimitRequest {
    let spread = seq % options.distinct_values.max(1);
    let descriptors = options
        .descriptors
        .iter()
        .map(|entries| {
            let last = entries.len() - 1;
            RateLimitDescriptor {
                entries: entries
                    .iter()
                    .enumerate()
                    .map(|(i, (key, value))| Entry {
                        key: key.clone(),
                        value: if i == last && options.distinct_values > 1 {
                            format!("{value}{spread}")
                        } else {
                            value.clone()
                        },
                    })
                    .collect(),
                ..Default::default()
            }
        })
        .collect();
    RateLimitRequest {
        domain: options.domain.clone(),
        descriptors,
        hits_addend: options.hits,
    }
}

impl Report {
    /// The report for people.
    pub fn render(&self) -> String {
        let l = &self.latency_us;
        let mut errors: String = self
            .errors
            .iter()
            .map(|(c, n)| format!("  {c} {n}"))
            .collect();
        if errors.is_empty() {
            errors = "  none".into();
        }
        format!(
            "requests     {} in {:.2} s = {:.0}/s\n\
             latency (µs) p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  mean {:.0}\n\
             answers      OK {}  OVER_LIMIT {}\n\
             errors      {errors}\n",
            self.requests,
            self.seconds,
            self.requests_per_second,
            l.p50,
            l.p90,
            l.p99,
            l.p999,
            l.max,
            l.mean,
            self.ok,
            self.over_limit,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: Options,
    }

    #[test]
    fn descriptors_parse_and_spread_their_last_value() {
        let cli = Cli::parse_from([
            "load",
            "--descriptor",
            "a=1,b=2",
            "--descriptor",
            "c=3",
            "--distinct-values",
            "10",
        ]);
        let r = build(&cli.options, 23);
        assert_eq!(r.descriptors.len(), 2);
        let values: Vec<_> = r.descriptors[0]
            .entries
            .iter()
            .map(|e| e.value.as_str())
            .collect();
        assert_eq!(values, ["1", "23"]);
        assert_eq!(r.descriptors[1].entries[0].value, "33");
    }

    #[test]
    fn a_bad_descriptor_is_refused() {
        assert!(parse_descriptor("novalue").is_err());
        assert!(parse_descriptor("=v").is_err());
    }
}
