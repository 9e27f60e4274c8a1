//! Where `serve` listens and what one client can make it hold: the gRPC and admin addresses,
//! the event loops, the bounds of a connection and of a request's bytes, and how long a
//! shutdown drains.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use super::at_least_one;
use crate::service::{Addrs, Edges, JsonAt, MaxAge};

#[derive(Args)]
#[command(next_help_heading = "Listeners")]
pub struct ListenerFlags {
    /// Address of the gRPC server (rate limit service, health, reflection).
    #[arg(long, env = "SLUICE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Address of a gRPC server of the quota service (RLQS) alone (with health and reflection),
    /// served on the quota service's thread: its streams' bytes are then read and written away
    /// from the event loops that answer ShouldRateLimit. The quota service stays on --grpc-addr
    /// too.
    #[arg(long, env = "SLUICE_QUOTA_ADDR")]
    quota_addr: Option<SocketAddr>,
    /// Address of the admin HTTP server (/healthz, /readyz, /metrics, /config, /rlconfig,
    /// /explain, and /json unless --json-addr moves it).
    #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Where /json (which moves counters) is served: an address of its own, or `off`. Without
    /// it, /json is served on --http-addr.
    #[arg(long, env = "SLUICE_JSON_ADDR", value_parser = parse_json_addr)]
    json_addr: Option<JsonAt>,
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
    /// Most gRPC connections open at once, fewer if the file descriptor limit leaves fewer; past
    /// it, a new connection closes the one that has waited longest for a call.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = 10_000)]
    max_connections: usize,
    /// Tell a gRPC connection to go (GOAWAY) once it is this old, give or take 10 %, so that
    /// clients spread over new replicas (envoyproxy/ratelimit's GRPC_MAX_CONNECTION_AGE).
    /// Without it, connections have no maximum age.
    #[arg(long, env = "SLUICE_GRPC_MAX_CONNECTION_AGE", value_parser = humantime::parse_duration)]
    grpc_max_connection_age: Option<Duration>,
    /// How long a gRPC connection told to go for its age has to finish its calls before it is
    /// closed (GRPC_MAX_CONNECTION_AGE_GRACE). Without it, until they end.
    #[arg(long, env = "SLUICE_GRPC_MAX_CONNECTION_AGE_GRACE", value_parser = humantime::parse_duration, requires = "grpc_max_connection_age")]
    grpc_max_connection_age_grace: Option<Duration>,
    /// How long SIGTERM waits for in-flight calls before exiting anyway.
    #[arg(long, env = "SLUICE_SHUTDOWN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_grace: Duration,
}

impl ListenerFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        at_least_one("--max-request-bytes", self.max_request_bytes)?;
        at_least_one(
            "--max-concurrent-streams",
            self.max_concurrent_streams as usize,
        )?;
        at_least_one("--max-connections", self.max_connections)?;
        if self.threads == Some(0) {
            anyhow::bail!("--threads: must be at least 1");
        }
        if self
            .grpc_max_connection_age
            .is_some_and(|age| age.is_zero())
        {
            anyhow::bail!("--grpc-max-connection-age: must be more than 0 (leave it out for none)");
        }
        Ok(())
    }

    /// The addresses served, with the metrics' own and the debug port given by their groups.
    pub(super) fn addrs(
        &self,
        metrics: Option<(SocketAddr, String)>,
        debug: Option<SocketAddr>,
    ) -> Addrs {
        Addrs {
            grpc: self.grpc_addr,
            quota: self.quota_addr,
            http: self.http_addr,
            json: self.json_addr.unwrap_or(JsonAt::Http),
            metrics,
            debug,
        }
    }

    /// The gRPC event loops.
    pub fn loops(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
    }

    pub fn edges(&self) -> Edges {
        Edges {
            max_request_bytes: self.max_request_bytes,
            max_concurrent_streams: self.max_concurrent_streams,
            max_connections: self.max_connections,
            max_connection_age: self.grpc_max_connection_age.map(|age| MaxAge {
                age,
                grace: self.grpc_max_connection_age_grace,
            }),
        }
    }

    /// How long a shutdown waits for in-flight calls.
    pub fn shutdown_grace(&self) -> Duration {
        self.shutdown_grace
    }
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
