//! `sluice load`: a load generator for any Envoy rate limit service, or with `--http` for an HTTP
//! service (say, Envoy in front of an upstream). Callers send `ShouldRateLimit` requests over a
//! few HTTP/2 connections, or GETs over one keep-alive HTTP/1.1 connection each, closed-loop or
//! paced to a rate, and report throughput, an HDR latency histogram and the answers by code.
//!
//! HTTP/1.1 goes through hyper's connection-level client (`client::conn::http1`), already built
//! for tonic and axum: it frames responses (lengths, chunks, `Connection: close`) as a real
//! client does, and, with no pool in the way, each caller owns its connection.

use super::parse_descriptor;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HOST, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint};

/// How long a caller waits for a TCP connection (and, over gRPC, its HTTP/2 handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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
    #[arg(long, conflicts_with = "http")]
    pub connections: Option<usize>,
    /// Load an HTTP/1.1 service instead: GET this URL (http://host:port/path) over one
    /// keep-alive connection per caller; answers count by status: 2xx OK, 429 over the limit.
    #[arg(
        long,
        value_name = "URL",
        value_parser = parse_url,
        conflicts_with_all = ["target", "domain", "descriptors", "distinct_values", "hits"]
    )]
    pub http: Option<HttpTarget>,
    /// A header of every --http request, as name:value; repeat for several.
    #[arg(long = "header", value_name = "NAME:VALUE", value_parser = parse_header, requires = "http")]
    pub headers: Vec<(HeaderName, HeaderValue)>,
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

/// Where `--http` sends its GETs.
#[derive(Clone, Debug)]
pub struct HttpTarget {
    /// `host:port`, to connect to and to send as `Host`.
    authority: String,
    /// The request target: path and query.
    path: Uri,
}

/// An `http://host[:port][/path]` URL.
pub fn parse_url(text: &str) -> Result<HttpTarget, String> {
    let uri: Uri = text.parse().map_err(|e| format!("'{text}': {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("'{text}' is not an http:// URL"));
    }
    let authority = uri
        .authority()
        .filter(|a| !a.as_str().contains('@'))
        .ok_or_else(|| format!("'{text}' has no host (or has user info)"))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    Ok(HttpTarget {
        authority: format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        ),
        path: path.parse().map_err(|e| format!("'{text}': {e}"))?,
    })
}

/// A header from `name:value`, split at the first `:`, the value trimmed.
pub fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("'{text}' is not name:value"))?;
    Ok((
        name.parse().map_err(|e| format!("'{name}': {e}"))?,
        value
            .trim()
            .parse()
            .map_err(|e| format!("'{value}': {e}"))?,
    ))
}

/// The outcome of a run.
#[derive(Debug, Serialize)]
pub struct Report {
    pub requests: u64,
    pub seconds: f64,
    pub requests_per_second: f64,
    pub latency_us: Latency,
    /// OK, or over HTTP a 2xx status.
    pub ok: u64,
    /// OVER_LIMIT, or over HTTP status 429.
    pub over_limit: u64,
    /// The other answers by kind: a gRPC code name, `HTTP <status>`, or `no answer` (the HTTP
    /// connection failed).
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

/// Threads the load runs on at most, each a single-threaded runtime.
const MOST_THREADS: usize = 4;

/// Runs the load: the callers spread over at most `MOST_THREADS` threads, each a
/// single-threaded runtime (over gRPC, holding every `threads`-th HTTP/2 connection), so that
/// the generator spends little CPU per request however many connections it opens.
pub async fn run(options: Options) -> anyhow::Result<Report> {
    let threads = match options.http {
        Some(_) => options.concurrency.clamp(1, MOST_THREADS),
        None => connections(&options).min(MOST_THREADS),
    };
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

    // On a terminal, one line rewritten each second; into a pipe or a file, a line each second.
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let progress = (!options.quiet).then(|| {
        let done = done.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            let mut last = 0;
            loop {
                tick.tick().await;
                let now = done.load(Ordering::Relaxed);
                let line = format!(
                    "{:>7.1} s  {now:>10} requests  {:>9} /s",
                    start.elapsed().as_secs_f64(),
                    now - last
                );
                if terminal {
                    eprint!("\r{line}");
                } else {
                    eprintln!("{line}");
                }
                last = now;
            }
        })
    });

    let mut threads_done = Vec::with_capacity(threads);
    for thread in 0..threads {
        let (finished, tally) = tokio::sync::oneshot::channel();
        let (options, sent, done) = (options.clone(), sent.clone(), done.clone());
        std::thread::Builder::new()
            .name(format!("load-{thread}"))
            .spawn(move || {
                let tally = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(anyhow::Error::from)
                    .and_then(|runtime| {
                        runtime
                            .block_on(thread_load(options, thread, threads, deadline, sent, done))
                    });
                let _ = finished.send(tally);
            })?;
        threads_done.push(tally);
    }
    let mut total = Tally::new();
    for tally in threads_done {
        total.add(tally.await??)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
        if terminal {
            eprintln!();
        }
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

/// The HTTP/2 connections of a gRPC load: `--connections`, else one per thread; at most one
/// per caller.
fn connections(options: &Options) -> usize {
    options
        .connections
        .unwrap_or(options.concurrency.clamp(1, MOST_THREADS))
        .clamp(1, options.concurrency.max(1))
}

/// The callers of thread `thread`: over HTTP, those numbered `thread`, `thread + threads`, …,
/// each with its own connection; over gRPC, caller `i` shares connection `i % connections`
/// with the others of it, and connection `c` is served by thread `c % threads`.
async fn thread_load(
    options: Arc<Options>,
    thread: usize,
    threads: usize,
    deadline: Option<Instant>,
    sent: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<Tally> {
    let (indices, clients) = match &options.http {
        Some(target) => {
            let indices: Vec<usize> = (thread..options.concurrency).step_by(threads).collect();
            let mut clients = Vec::with_capacity(indices.len());
            for _ in &indices {
                clients.push(Client::Http(
                    HttpClient::connect(target, &options.headers).await?,
                ));
            }
            (indices, clients)
        }
        None => {
            let connections = connections(&options);
            let mut channels = Vec::new();
            for _ in (thread..connections).step_by(threads) {
                let channel = Endpoint::from_shared(format!("http://{}", options.target))?
                    .tcp_nodelay(true)
                    .connect_timeout(CONNECT_TIMEOUT)
                    .connect()
                    .await
                    .with_context(|| format!("connecting to {}", options.target))?;
                channels.push(channel);
            }
            let indices: Vec<usize> = (0..options.concurrency)
                .filter(|i| i % connections % threads == thread)
                .collect();
            let clients = indices
                .iter()
                .map(|i| {
                    let channel = &channels[i % connections / threads];
                    Client::Grpc(RateLimitServiceClient::new(channel.clone()))
                })
                .collect();
            (indices, clients)
        }
    };
    let callers: Vec<_> = indices
        .into_iter()
        .zip(clients)
        .map(|(i, client)| {
            tokio::spawn(caller(
                client,
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
    mut client: Client,
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
        let (answer, took) = client.call(&options, seq).await;
        tally
            .latency
            .saturating_record(took.as_micros().max(1) as u64);
        match answer {
            Answer::Ok => tally.ok += 1,
            Answer::OverLimit => tally.over_limit += 1,
            Answer::Other(kind) => *tally.errors.entry(kind).or_default() += 1,
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    tally
}

/// One caller's way to the service.
enum Client {
    Grpc(RateLimitServiceClient<Channel>),
    Http(HttpClient),
}

enum Answer {
    Ok,
    OverLimit,
    /// Anything else, by kind (see `Report::errors`).
    Other(String),
}

impl Client {
    /// Sends request `seq` and waits for the whole answer; the time taken excludes building the
    /// request.
    async fn call(&mut self, options: &Options, seq: u64) -> (Answer, Duration) {
        match self {
            Client::Grpc(client) => {
                let request = build(options, seq);
                let began = Instant::now();
                let answer = match client.should_rate_limit(request).await {
                    Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => {
                        Answer::OverLimit
                    }
                    Ok(_) => Answer::Ok,
                    Err(status) => Answer::Other(format!("{:?}", status.code())),
                };
                (answer, began.elapsed())
            }
            Client::Http(client) => {
                let request = client.request();
                let began = Instant::now();
                let answer = match client.get(request).await {
                    Ok(status) if status.is_success() => Answer::Ok,
                    Ok(StatusCode::TOO_MANY_REQUESTS) => Answer::OverLimit,
                    Ok(status) => Answer::Other(format!("HTTP {}", status.as_u16())),
                    Err(_) => Answer::Other("no answer".into()),
                };
                (answer, began.elapsed())
            }
        }
    }
}

/// One keep-alive HTTP/1.1 connection, opened again when the server closes it.
struct HttpClient {
    target: HttpTarget,
    headers: HeaderMap,
    sender: Option<SendRequest<Empty<Bytes>>>,
}

impl HttpClient {
    /// Connects to `target`, or fails: a service that cannot be reached at the start is an error
    /// of the run, not an answer. Requests carry `headers`, and `Host` unless among them.
    async fn connect(
        target: &HttpTarget,
        headers: &[(HeaderName, HeaderValue)],
    ) -> anyhow::Result<HttpClient> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(name, value.clone());
        }
        if !map.contains_key(HOST) {
            map.insert(HOST, HeaderValue::from_str(&target.authority)?);
        }
        let mut client = HttpClient {
            target: target.clone(),
            headers: map,
            sender: None,
        };
        client.sender = Some(
            client
                .open()
                .await
                .with_context(|| format!("connecting to {}", target.authority))?,
        );
        Ok(client)
    }

    async fn open(&self) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
        let stream =
            tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.target.authority))
                .await??;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        Ok(sender)
    }

    fn request(&self) -> Request<Empty<Bytes>> {
        let mut request = Request::new(Empty::new());
        *request.uri_mut() = self.target.path.clone();
        *request.headers_mut() = self.headers.clone();
        request
    }

    /// Sends `request` and reads the whole response; its status.
    async fn get(&mut self, request: Request<Empty<Bytes>>) -> anyhow::Result<StatusCode> {
        // A new connection when the server closed the last one after its answer, or it failed
        // (or none could be opened last time).
        let sender = match self.sender.take() {
            Some(mut sender) => match sender.ready().await {
                Ok(()) => sender,
                Err(_) => self.open().await?,
            },
            None => self.open().await?,
        };
        let sender = self.sender.insert(sender);
        let response = sender.send_request(request).await?;
        let status = response.status();
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            frame?;
        }
        Ok(status)
    }
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
    fn an_http_url_gives_the_address_and_the_request_target() {
        let t = parse_url("http://localhost:10000/a/b?c=d").unwrap();
        assert_eq!(t.authority, "localhost:10000");
        assert_eq!(t.path, "/a/b?c=d");
        let t = parse_url("http://127.0.0.1").unwrap();
        assert_eq!(
            (t.authority.as_str(), t.path.to_string().as_str()),
            ("127.0.0.1:80", "/")
        );
        assert!(parse_url("https://localhost/").is_err());
        assert!(parse_url("http://user@localhost/").is_err());
        assert!(parse_url("/path").is_err());
    }

    #[test]
    fn a_header_splits_at_its_first_colon() {
        let (name, value) = parse_header("X-Tenant: a:b ").unwrap();
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            ("x-tenant", "a:b")
        );
        assert!(parse_header("novalue").is_err());
        assert!(parse_header("bad name:v").is_err());
    }

    #[test]
    fn a_bad_descriptor_is_refused() {
        assert!(parse_descriptor("novalue").is_err());
        assert!(parse_descriptor("=v").is_err());
    }
}
