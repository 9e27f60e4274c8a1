//! The `sluice` command: `serve` runs the service, `check-config` validates rule files, `explain`
//! shows how rules match a request, `load` measures a running service and `health` probes its
//! gRPC health. Run as `ratelimit` (a link named so), it serves as envoyproxy/ratelimit does, from
//! that project's environment variables.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use sluice::certs::PemFile;
use sluice::config;
use sluice::config::xds::XdsFlags;
use sluice::limiter::{Counting, OverLimitCache};
use sluice::rules::RuleSet;
use sluice::service::rlqs::{QuotaSettings, Quotas, Unmatched};
use sluice::service::rls::{Answering, Bounds, Fallback, LimitHeaders, OnStoreError};
use sluice::service::tls::{ServerTls, TlsFlags};
use sluice::service::{self, Addrs, Edges, Healthcheck, JsonAt, Rules, Setup, Shutdown, reload};
use sluice::settings::erl;
use sluice::store::{Backend, RedisTls, RedisTlsFlags};
use sluice::telemetry::LogFormat;
use sluice::telemetry::mapper::Mapper;
use sluice::telemetry::metrics;

/// mimalloc: measurably less CPU per request than the system allocator on the request path, and
/// less memory held for the embedded store's many small counters.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(version, about = "Envoy global rate limit service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the rate limit service over gRPC, with an admin HTTP server beside it.
    Serve(Box<ServeArgs>),
    /// Validate rule files: exit 0 when valid, else print `file:line: message` per error.
    CheckConfig {
        /// A rule file, or a directory of them.
        path: PathBuf,
        /// One domain may span several files (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG).
        #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
        merge_domains: bool,
    },
    /// Explain how rules match a request: each descriptor's walk through the rule tree, the
    /// limits, replaces and modes that apply, and the counters it would move (none is moved).
    Explain(ExplainArgs),
    /// Load a rate limit service (sluice or another) and report throughput and latency.
    Load(sluice::load::Options),
    /// Ask a running server's gRPC health service; exit 0 when it reports SERVING.
    Health {
        /// The gRPC address to ask [default: the address `serve` listens on, from
        /// SLUICE_GRPC_ADDR (an unspecified IP such as 0.0.0.0 asked on loopback), else
        /// 127.0.0.1:8081].
        #[arg(long, env = "SLUICE_HEALTH_TARGET")]
        target: Option<SocketAddr>,
        #[command(flatten)]
        tls: HealthTls,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// A rule file, or a directory of them (one domain per file); or --xds-server instead.
    #[arg(
        long,
        env = "SLUICE_CONFIG",
        required_unless_present = "xds_server",
        conflicts_with = "xds_server"
    )]
    config: Option<PathBuf>,
    /// Address of the gRPC server (rate limit service, health, reflection).
    #[arg(long, env = "SLUICE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Address of the admin HTTP server (/healthz, /readyz, /metrics, /config, /rlconfig,
    /// /explain, and /json unless --json-addr moves it).
    #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Where /json (which moves counters) is served: an address of its own, or `off`. Without
    /// it, /json is served on --http-addr.
    #[arg(long, env = "SLUICE_JSON_ADDR", value_parser = parse_json_addr)]
    json_addr: Option<JsonAt>,
    /// Serve Prometheus metrics also on this address (envoyproxy/ratelimit's PROMETHEUS_ADDR;
    /// Envoy Gateway scrapes :19001), at --metrics-path; they stay on --http-addr's /metrics.
    #[arg(long, env = "SLUICE_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on --metrics-addr.
    #[arg(long, env = "SLUICE_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    metrics_path: String,
    /// A statsd_exporter mapping file naming the series envoyproxy/ratelimit exports
    /// (envoyproxy/ratelimit's PROMETHEUS_MAPPER_YAML). Without it, that project's built-in
    /// mapping. A file that does not parse stops the start.
    #[arg(long, env = "SLUICE_PROMETHEUS_MAPPER")]
    prometheus_mapper: Option<PathBuf>,
    /// Serve envoyproxy/ratelimit's debug endpoints (`/rlconfig`, and `/` listing them) on this
    /// address too (its port is 6070).
    #[arg(long, env = "SLUICE_DEBUG_ADDR")]
    debug_addr: Option<SocketAddr>,
    /// /healthcheck (and gRPC health for `ratelimit`) reports healthy before any rules are
    /// loaded, as envoyproxy/ratelimit does without HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED.
    #[arg(long, env = "SLUICE_HEALTHCHECK_WITHOUT_RULES")]
    healthcheck_without_rules: bool,
    /// /healthcheck (and gRPC health for `ratelimit`) fails whenever the store is unreachable,
    /// not only until it is first reached (envoyproxy/ratelimit's
    /// REDIS_HEALTH_CHECK_ACTIVE_CONNECTION).
    #[arg(long, env = "SLUICE_HEALTHCHECK_FOLLOWS_STORE")]
    healthcheck_follows_store: bool,
    /// Keep counters in Redis: redis://, rediss:// (TLS), redis-cluster://, redis-sentinel://
    /// (user and password in the URL). Without it, counters live in the embedded store.
    #[arg(long, env = "SLUICE_REDIS_URL")]
    redis_url: Option<String>,
    /// Prefix of every Redis key sluice writes.
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// Count and report, but never deny: every answer is OK.
    #[arg(long, env = "SLUICE_SHADOW_MODE")]
    shadow_mode: bool,
    /// Treat every limit as a quota limit (envoyproxy/ratelimit's global quota mode): a request
    /// is denied only when every descriptor it has is over its limit.
    #[arg(long, env = "SLUICE_QUOTA_MODE")]
    quota_mode: bool,
    /// When hits are charged, for rules without `counting`: admitted (only when the whole
    /// request is admitted, and only if they fit) or always (envoyproxy/ratelimit's counting:
    /// every charge lands, and a request is over when the count is above the limit).
    #[arg(long, env = "SLUICE_COUNTING", value_enum, default_value_t = Counting::Admitted)]
    counting: Counting,
    /// Send the limit closest to denying (the one that denied, else the one with the least
    /// left) on every answer that has one, as the RateLimit-Limit, RateLimit-Remaining and
    /// RateLimit-Reset headers for Envoy to add to its response.
    #[arg(long, env = "SLUICE_LIMIT_RESPONSE_HEADERS")]
    limit_response_headers: bool,
    /// The name of the header that carries the limit (--limit-response-headers).
    #[arg(long, env = "SLUICE_LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit", value_parser = parse_header_name)]
    limit_limit_header: String,
    /// The name of the header that carries the requests left (--limit-response-headers).
    #[arg(long, env = "SLUICE_LIMIT_REMAINING_HEADER", default_value = "RateLimit-Remaining", value_parser = parse_header_name)]
    limit_remaining_header: String,
    /// The name of the header that carries the seconds until the limit resets
    /// (--limit-response-headers).
    #[arg(long, env = "SLUICE_LIMIT_RESET_HEADER", default_value = "RateLimit-Reset", value_parser = parse_header_name)]
    limit_reset_header: String,
    /// Send the request's domain, descriptors and hits, and the rule metadata of the
    /// descriptors that passed, as the response's dynamic metadata.
    #[arg(long, env = "SLUICE_RESPONSE_DYNAMIC_METADATA")]
    response_dynamic_metadata: bool,
    /// The share of a limit past which hits are counted as near it (metrics only).
    #[arg(long, env = "SLUICE_NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    near_limit_ratio: f64,
    /// Most counters the local over-limit cache holds (denying requests that counters known to
    /// be full would deny, without a store call, until they free up); 0 switches it off.
    #[arg(long, env = "SLUICE_LOCAL_CACHE_SIZE", default_value_t = 65_536)]
    local_cache_size: usize,
    /// Start with no rules (an empty rules directory) instead of refusing to: not ready until a
    /// reload (SIGHUP) finds some.
    #[arg(long, env = "SLUICE_ALLOW_EMPTY_CONFIG")]
    allow_empty_config: bool,
    /// One domain may span several files, their rules joined into one tree (envoyproxy/ratelimit's
    /// MERGE_DOMAIN_CONFIG); else a domain in two files is an error.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
    merge_domains: bool,
    /// The longest a request waits for the counter store (e.g. 10ms, 1s); a caller's own
    /// shorter grpc-timeout shortens it.
    #[arg(long, env = "SLUICE_STORE_TIMEOUT", default_value = "10ms", value_parser = humantime::parse_duration)]
    store_timeout: Duration,
    /// What a request gets when the store cannot decide in time, is marked down, sheds load or
    /// is full: error (gRPC UNAVAILABLE, so Envoy's failure_mode_deny decides), allow or deny.
    #[arg(long, env = "SLUICE_ON_STORE_ERROR", value_enum, default_value_t = OnStoreError::Error)]
    on_store_error: OnStoreError,
    /// What the quota service (RLQS) assigns a bucket no quota_buckets rule matches: allow (all
    /// of its requests) or deny (all of them).
    #[arg(long, env = "SLUICE_QUOTA_UNMATCHED", value_enum, default_value_t = Unmatched::Allow)]
    quota_unmatched: Unmatched,
    /// How long an Envoy enforces a quota assignment without hearing from sluice again, in whole
    /// seconds (e.g. 30s); each report renews it. Past it, Envoy falls back to the bucket's
    /// no_assignment_behavior.
    #[arg(long, env = "SLUICE_QUOTA_ASSIGNMENT_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    quota_assignment_ttl: Duration,
    /// Reports of no request in a row (Envoy reports every 5 s) after which an Envoy is told to
    /// abandon a quota bucket.
    #[arg(long, env = "SLUICE_QUOTA_ABANDON_AFTER", default_value_t = 6)]
    quota_abandon_after: u32,
    /// Most quota buckets tracked at once, over every stream (a bucket two Envoys report counts
    /// twice); a bucket reported past it gets its rule's whole limit, undivided.
    #[arg(long, env = "SLUICE_QUOTA_MAX_BUCKETS", default_value_t = 100_000)]
    quota_max_buckets: usize,
    /// Most quota streams (one per Envoy and domain) tracked at once; the buckets of a stream
    /// past it get their rules' whole limits, undivided, until another stream ends.
    #[arg(long, env = "SLUICE_QUOTA_MAX_STREAMS", default_value_t = 1_000)]
    quota_max_streams: usize,
    /// Most live counters the embedded store holds; a request needing a new one beyond that gets
    /// the --on-store-error answer.
    #[arg(long, env = "SLUICE_MAX_KEYS", default_value_t = 1_000_000)]
    max_keys: usize,
    /// Most descriptors in one request.
    #[arg(long, env = "SLUICE_MAX_DESCRIPTORS", default_value_t = 64)]
    max_descriptors: usize,
    /// Most entries in one descriptor.
    #[arg(long, env = "SLUICE_MAX_ENTRIES", default_value_t = 32)]
    max_entries: usize,
    /// Event loops answering gRPC, one thread each (default: one per CPU). Connections are
    /// spread over them in turn.
    #[arg(long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    /// Largest gRPC request message or /json body, in bytes.
    #[arg(long, env = "SLUICE_MAX_REQUEST_BYTES", default_value_t = 256 * 1024)]
    max_request_bytes: usize,
    /// Most requests in flight on one gRPC connection.
    #[arg(long, env = "SLUICE_MAX_CONCURRENT_STREAMS", default_value_t = 1024)]
    max_concurrent_streams: u32,
    /// How long SIGTERM waits for in-flight calls before exiting anyway.
    #[arg(long, env = "SLUICE_SHUTDOWN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_grace: Duration,
    /// How log lines are written: text, or json (one object per line).
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// A level (error, warn, info, debug, trace: sluice's own events; its libraries' stay at
    /// info) or a full filter such as `info,sluice::store=debug`. Without it, SLUICE_LOG or
    /// RUST_LOG, else info.
    #[arg(long, env = "SLUICE_LOG_LEVEL")]
    log_level: Option<String>,
    #[command(flatten)]
    tls: TlsFlags,
    #[command(flatten)]
    redis_tls: RedisTlsFlags,
    #[command(flatten)]
    xds: XdsFlags,
}

#[derive(Args)]
struct ExplainArgs {
    /// A rule file, or a directory of them (one domain per file).
    path: PathBuf,
    /// The request's domain.
    #[arg(long, required_unless_present = "request")]
    domain: Option<String>,
    /// One request descriptor as key=value[,key=value…] (each entry split at its first `=`);
    /// repeat for several descriptors, in order.
    #[arg(long = "descriptor", value_parser = sluice::load::parse_descriptor, requires = "domain")]
    descriptors: Vec<Vec<(String, String)>>,
    /// The request as protobuf JSON, as `/json` takes it: a file, or `-` for standard input.
    #[arg(long, conflicts_with_all = ["domain", "descriptors"])]
    request: Option<PathBuf>,
    /// Prefix of the Redis keys shown.
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// Explain as `serve --merge-domains` loads the rules.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
    merge_domains: bool,
    /// Explain as `serve --quota-mode` answers.
    #[arg(long, env = "SLUICE_QUOTA_MODE")]
    quota_mode: bool,
    /// Explain as `serve --counting` counts rules that do not say.
    #[arg(long, env = "SLUICE_COUNTING", value_enum, default_value_t = Counting::Admitted)]
    counting: Counting,
    /// Print the explanation as JSON (as `POST /explain` answers) instead of a text tree.
    #[arg(long)]
    json: bool,
}

fn parse_json_addr(value: &str) -> Result<JsonAt, String> {
    if value == "off" {
        return Ok(JsonAt::Off);
    }
    value
        .parse()
        .map(JsonAt::Addr)
        .map_err(|e| format!("{e}: an address such as 127.0.0.1:8082, or `off`"))
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

/// An HTTP header name (RFC 9110 token characters), which Envoy can add to its response.
fn parse_header_name(value: &str) -> Result<String, String> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if value.is_empty() || !value.chars().all(token) {
        return Err("an HTTP header name such as RateLimit-Limit".into());
    }
    Ok(value.to_owned())
}

/// TLS for `sluice health`.
#[derive(Args)]
struct HealthTls {
    /// Connect over TLS, trusting the CAs of this PEM file.
    #[arg(long = "tls-ca", env = "SLUICE_HEALTH_TLS_CA")]
    ca: Option<PathBuf>,
    /// Present this PEM client certificate, to a server that requires one.
    #[arg(long = "tls-cert", env = "SLUICE_HEALTH_TLS_CERT", requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long = "tls-key", env = "SLUICE_HEALTH_TLS_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// The name the server's certificate must hold [default: localhost for a loopback target,
    /// else the target's address].
    #[arg(
        long = "tls-server-name",
        env = "SLUICE_HEALTH_TLS_SERVER_NAME",
        requires = "ca"
    )]
    server_name: Option<String>,
}

impl HealthTls {
    /// The gRPC endpoint for `target`: over TLS when a CA is given, else plaintext.
    fn endpoint(&self, target: SocketAddr) -> anyhow::Result<tonic::transport::Endpoint> {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
        let Some(ca) = &self.ca else {
            return Ok(Endpoint::from_shared(format!("http://{target}"))?);
        };
        let name = self.server_name.clone().unwrap_or_else(|| {
            if target.ip().is_loopback() {
                "localhost".to_owned()
            } else {
                target.ip().to_string()
            }
        });
        let ca = PemFile::new("--tls-ca", ca).read()?;
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(name);
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            let cert = PemFile::new("--tls-cert", cert).read()?;
            let key = PemFile::new("--tls-key", key).read()?;
            config = config.identity(Identity::from_pem(cert, key));
        }
        Ok(Endpoint::from_shared(format!("https://{target}"))?.tls_config(config)?)
    }
}

fn main() -> ExitCode {
    let (cli, notes) = match parse() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("{}: {message}", erl::COMMAND);
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::CheckConfig {
            path,
            merge_domains,
        } => check_config(&config::Source {
            path,
            merge_domains,
        }),
        Command::Health { target, tls } => health(target.unwrap_or_else(served_grpc_addr), tls),
        Command::Explain(args) => explain(&args),
        Command::Load(options) => load(options),
        Command::Serve(args) => {
            sluice::telemetry::init(args.log_format, args.log_level.as_deref());
            for note in notes {
                tracing::warn!("{note}");
            }
            match serve(*args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The command line; run as `ratelimit`, `serve` with the flags envoyproxy/ratelimit's
/// environment means (and any arguments given after them), with what to warn about at start.
fn parse() -> Result<(Cli, Vec<String>), String> {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    if !args.first().is_some_and(erl::runs_as_ratelimit) {
        return Ok((Cli::parse(), Vec::new()));
    }
    let translation = erl::translate(&|name| std::env::var(name).ok())?;
    let given = args.split_off(1);
    let cli = Cli::parse_from(args.into_iter().chain(translation.args).chain(given));
    let notes = translation
        .unhonoured
        .iter()
        .map(ToString::to_string)
        .chain(translation.notes)
        .collect();
    Ok((cli, notes))
}

fn check_config(source: &config::Source) -> ExitCode {
    match config::load(source) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                eprintln!("{w} (warning)");
            }
            let domains: std::collections::HashSet<_> =
                loaded.domains.iter().map(|d| &d.domain).collect();
            let quota_buckets: usize = loaded.domains.iter().map(|d| d.quota_buckets.len()).sum();
            let quota = match quota_buckets {
                0 => String::new(),
                n => format!(", {n} quota bucket rule(s)"),
            };
            println!(
                "{}: {} domain(s) valid{quota}",
                source.path.display(),
                domains.len()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors {
                println!("{e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Exit status of `explain` for a request it cannot read (as clap's for a malformed argument).
const MALFORMED_REQUEST: u8 = 2;

fn explain(args: &ExplainArgs) -> ExitCode {
    use sluice::service::explain::{Request, explain};
    use std::io::Read;
    let request = match &args.request {
        None => Ok(Request::new(
            args.domain.as_deref().unwrap_or_default(),
            &args.descriptors,
        )),
        Some(path) => {
            let mut body = Vec::new();
            let read = if path.as_os_str() == "-" {
                std::io::stdin().read_to_end(&mut body).map(drop)
            } else {
                std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut body).map(drop))
            };
            read.map_err(|e| format!("--request {}: {e}\n", path.display()))
                .and_then(|()| Request::from_json(&body))
        }
    };
    let loaded = match config::load(&config::Source {
        path: args.path.clone(),
        merge_domains: args.merge_domains,
    }) {
        Ok(loaded) => loaded,
        Err(errors) => {
            for e in &errors {
                eprintln!("{e}");
            }
            return ExitCode::FAILURE;
        }
    };
    // Explaining is not serving: no --max-* bound applies.
    let unbounded = Bounds {
        max_descriptors: usize::MAX,
        max_entries: usize::MAX,
    };
    let rules = sluice::rules::RuleSet::from_loaded(loaded, false);
    let explained = request.and_then(|request| {
        let answering = Answering {
            quota_mode: args.quota_mode,
            counting: args.counting,
            ..Answering::default()
        };
        explain(
            &rules,
            &request,
            &unbounded,
            &answering,
            Some(&args.redis_key_prefix),
        )
        .map_err(|m| format!("{m}\n"))
    });
    match explained {
        Ok(explanation) if args.json => {
            print!("{}", explanation.to_json());
            ExitCode::SUCCESS
        }
        Ok(explanation) => {
            print!("{}", explanation.render());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprint!("sluice explain: {message}");
            ExitCode::from(MALFORMED_REQUEST)
        }
    }
}

#[tokio::main]
async fn load(options: sluice::load::Options) -> ExitCode {
    let json = options.json;
    match sluice::load::run(options).await {
        Ok(report) if json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).expect("a report serializes")
            );
            ExitCode::SUCCESS
        }
        Ok(report) => {
            print!("{}", report.render());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice load: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where `serve` listens for gRPC in this environment (SLUICE_GRPC_ADDR, else its default), as
/// a client reaches it: an unspecified IP (0.0.0.0, ::) on loopback. An image's health check
/// thus follows the address its server was given.
fn served_grpc_addr() -> SocketAddr {
    let mut addr = std::env::var("SLUICE_GRPC_ADDR")
        .ok()
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 8081)));
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

#[tokio::main(flavor = "current_thread")]
async fn health(target: SocketAddr, tls: HealthTls) -> ExitCode {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let ask = async {
        let channel = tls.endpoint(target)?.connect().await?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest::default())
            .await?;
        anyhow::Ok(reply.into_inner().status())
    };
    match tokio::time::timeout(std::time::Duration::from_secs(5), ask).await {
        Ok(Ok(status)) => {
            println!("{}", status.as_str_name());
            if status == ServingStatus::Serving {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Ok(Err(e)) => {
            println!("UNREACHABLE: {e:#}");
            ExitCode::FAILURE
        }
        Err(_) => {
            println!("UNREACHABLE: no answer within 5 s");
            ExitCode::FAILURE
        }
    }
}

/// The longest `--store-timeout`.
const LONGEST_STORE_TIMEOUT: Duration = Duration::from_secs(60);

/// Rejects flag values no request could be served with, or whose arithmetic could overflow.
fn check_bounds(args: &ServeArgs) -> anyhow::Result<()> {
    let at_least_one = [
        ("--max-keys", args.max_keys),
        ("--max-descriptors", args.max_descriptors),
        ("--max-entries", args.max_entries),
        ("--max-request-bytes", args.max_request_bytes),
        (
            "--max-concurrent-streams",
            args.max_concurrent_streams as usize,
        ),
    ];
    for (flag, value) in at_least_one {
        if value == 0 {
            anyhow::bail!("{flag}: must be at least 1");
        }
    }
    if args.threads == Some(0) {
        anyhow::bail!("--threads: must be at least 1");
    }
    if !(args.near_limit_ratio > 0.0 && args.near_limit_ratio <= 1.0) {
        anyhow::bail!("--near-limit-ratio: must be more than 0 and at most 1");
    }
    if args.quota_assignment_ttl.subsec_nanos() != 0 || args.quota_assignment_ttl.is_zero() {
        anyhow::bail!(
            "--quota-assignment-ttl: must be whole seconds, at least 1s (Envoy reads no fraction)"
        );
    }
    if args.quota_abandon_after == 0 {
        anyhow::bail!("--quota-abandon-after: must be at least 1");
    }
    if args.quota_max_buckets == 0 || args.quota_max_streams == 0 {
        anyhow::bail!("--quota-max-buckets, --quota-max-streams: must be at least 1");
    }
    if args.store_timeout.is_zero() || args.store_timeout > LONGEST_STORE_TIMEOUT {
        anyhow::bail!(
            "--store-timeout: must be more than 0 and at most {}",
            humantime::format_duration(LONGEST_STORE_TIMEOUT)
        );
    }
    Ok(())
}

/// The main thread runs the listener, the admin HTTP server and the embedded store's sweeper; the
/// gRPC event loops run on threads of their own (see `service`).
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: ServeArgs) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Before anything else: from here on a SIGHUP reloads instead of ending the process.
    let hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    check_bounds(&args)?;
    if let Some(path) = &args.prometheus_mapper {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let mapper = Mapper::parse(&text)
                    .map_err(|e| anyhow::anyhow!("--prometheus-mapper {}: {e}", path.display()))?;
                metrics::use_mapper(mapper);
            }
            // Envoy Gateway mounts its mapping from an optional ConfigMap: a file that is not
            // there leaves envoyproxy/ratelimit's own mapping, as that project does.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => tracing::warn!(
                "--prometheus-mapper {}: no such file; envoyproxy/ratelimit's built-in mapping names the metrics",
                path.display()
            ),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("--prometheus-mapper: cannot read {}", path.display())
                });
            }
        }
    }
    let rules = match (&args.config, args.xds.subscription(args.merge_domains)?) {
        (_, Some(subscription)) => {
            tracing::info!(
                server = subscription.server(),
                "rules over xDS: every request is refused (UNAVAILABLE) until the first configuration"
            );
            let rules = Rules::new(RuleSet::awaiting());
            tokio::spawn(reload::follow_xds(rules.clone(), subscription, hangup));
            rules
        }
        (Some(path), None) => {
            let source = config::Source {
                path: path.clone(),
                merge_domains: args.merge_domains,
            };
            let first = reload::load(&source, args.allow_empty_config)?;
            reload::first(&first);
            let rules = Rules::new(first);
            if !rules.loaded() {
                tracing::warn!("no rules loaded: not ready until a reload finds some");
            }
            tokio::spawn(reload::watch(
                rules.clone(),
                source,
                args.allow_empty_config,
                hangup,
            ));
            rules
        }
        (None, None) => anyhow::bail!("--config or --xds-server is needed"),
    };
    let backend = match &args.redis_url {
        None => Backend::memory(args.max_keys),
        Some(url) => Backend::redis(
            url.clone(),
            args.redis_key_prefix.clone(),
            RedisTls::load(url, &args.redis_tls)?,
        ),
    };
    let quotas = QuotaSettings {
        unmatched: args.quota_unmatched,
        ttl: args.quota_assignment_ttl,
        abandon_after: args.quota_abandon_after,
        max_buckets: args.quota_max_buckets,
        max_streams: args.quota_max_streams,
    };
    let quotas = std::sync::Arc::new(Quotas::start(quotas, &backend)?);
    let setup = Setup {
        rules,
        backend,
        bounds: Bounds {
            max_descriptors: args.max_descriptors,
            max_entries: args.max_entries,
        },
        fallback: Fallback {
            store_timeout: args.store_timeout,
            on_store_error: args.on_store_error,
        },
        edges: Edges {
            max_request_bytes: args.max_request_bytes,
            max_concurrent_streams: args.max_concurrent_streams,
        },
        answering: Answering {
            shadow_mode: args.shadow_mode,
            quota_mode: args.quota_mode,
            counting: args.counting,
            near_limit_ratio: args.near_limit_ratio,
            limit_headers: args.limit_response_headers.then(|| LimitHeaders {
                limit: args.limit_limit_header.clone(),
                remaining: args.limit_remaining_header.clone(),
                reset: args.limit_reset_header.clone(),
            }),
            dynamic_metadata: args.response_dynamic_metadata,
        },
        cache: (args.local_cache_size > 0)
            .then(|| std::sync::Arc::new(OverLimitCache::new(args.local_cache_size))),
        tls: ServerTls::load(&args.tls)?,
        healthcheck: Healthcheck {
            without_rules: args.healthcheck_without_rules,
            follows_store: args.healthcheck_follows_store,
        },
        quotas,
    };
    let (stop, shutdown) = Shutdown::new();
    let grace = args.shutdown_grace;
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!(
            "shutting down: not ready, not accepting, draining in-flight calls (at most {})",
            humantime::format_duration(grace)
        );
        let _ = stop.send(true);
        // Drained or not, the process ends within the grace period.
        std::thread::spawn(move || {
            std::thread::sleep(grace);
            tracing::warn!("in-flight calls still running after --shutdown-grace: exiting");
            std::process::exit(0);
        });
    });
    let loops = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let addrs = Addrs {
        grpc: args.grpc_addr,
        http: args.http_addr,
        json: args.json_addr.unwrap_or(JsonAt::Http),
        metrics: args
            .metrics_addr
            .map(|addr| (addr, args.metrics_path.clone())),
        debug: args.debug_addr,
    };
    let served = service::run(setup, addrs, loops, shutdown)
        .await
        .context("serving");
    tracing::info!("stopped");
    served
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
