//! Where `serve` listens and what one client can make it hold: the gRPC and admin addresses,
//! the event loops, the bounds of a connection and of a request's bytes, and how long a
//! shutdown drains.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use super::at_least_one;
use crate::service::{Addrs, Edges, JsonAt, MaxAge};

/// A gRPC call's header list by default: far above the 60 KiB Envoy accepts from its clients by
/// default, as gRPC servers commonly allow (grpc-go: 16 MiB).
const MAX_HEADER_LIST_DEFAULT: u32 = 1024 * 1024;
/// What `--max-header-list-bytes` may be: Envoy's default request header limit fits in the
/// least; Envoy's largest configurable one (8192 KiB) is the most.
const MAX_HEADER_LIST_RANGE: std::ops::RangeInclusive<u32> = 64 * 1024..=8 * 1024 * 1024;

#[derive(Args)]
#[command(next_help_heading = "Listeners")]
pub struct ListenerFlags {
    /// Address of the gRPC server: the rate limit service, the quota service (RLQS), health and
    /// reflection.
    #[arg(long, env = "SLUICE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Address of a gRPC server of the quota service (RLQS) alone (with health and reflection),
    /// served on the quota service's thread.
    ///
    /// Its streams' bytes are then read and written away from the event loops that answer
    /// ShouldRateLimit.
    ///
    /// The quota service stays on --grpc-addr too.
    #[arg(long, env = "SLUICE_QUOTA_ADDR")]
    quota_addr: Option<SocketAddr>,
    /// Address of the admin HTTP server: /healthz, /readyz, /healthcheck, /metrics, /config,
    /// /rlconfig, /top, /ui (the console), /status, /explain, /counters, / (the list of them),
    /// and /json unless --json-addr moves it.
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
    /// Largest header list (HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE) of a gRPC call, in bytes,
    /// from 64 KiB (Envoy's default request header limit, 60 KiB, must fit: Envoy forwards its
    /// clients' trace headers in the call) to 8 MiB (Envoy's own most).
    #[arg(long, env = "SLUICE_MAX_HEADER_LIST_BYTES", default_value_t = MAX_HEADER_LIST_DEFAULT)]
    max_header_list_bytes: u32,
    /// Most requests in flight on one gRPC connection.
    #[arg(long, env = "SLUICE_MAX_CONCURRENT_STREAMS", default_value_t = 1024)]
    max_concurrent_streams: u32,
    /// Most gRPC connections open at once, fewer if the file descriptor limit leaves fewer.
    ///
    /// Past it, a new connection closes the one that has waited longest for a call.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = 10_000)]
    max_connections: usize,
    /// Tell a gRPC connection to go (GOAWAY) once it is this old, give or take 10 %, so that
    /// clients spread over new replicas (envoyproxy/ratelimit's GRPC_MAX_CONNECTION_AGE).
    ///
    /// Without it, connections have no maximum age.
    #[arg(long, env = "SLUICE_GRPC_MAX_CONNECTION_AGE", value_parser = humantime::parse_duration)]
    grpc_max_connection_age: Option<Duration>,
    /// How long a gRPC connection told to go for its age has to finish its calls before it is
    /// closed (GRPC_MAX_CONNECTION_AGE_GRACE).
    ///
    /// Without it, until they end.
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
        if !MAX_HEADER_LIST_RANGE.contains(&self.max_header_list_bytes) {
            anyhow::bail!(
                "--max-header-list-bytes: must be from {} to {}",
                MAX_HEADER_LIST_RANGE.start(),
                MAX_HEADER_LIST_RANGE.end()
            );
        }
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
            max_header_list_bytes: self.max_header_list_bytes,
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::ListenerFlags;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        listen: ListenerFlags,
    }

    fn checked(args: &[&str]) -> anyhow::Result<()> {
        let args = std::iter::once("serve").chain(args.iter().copied());
        Flags::try_parse_from(args)
            .expect("flags parse")
            .listen
            .check()
    }

    #[test]
    fn the_header_list_bound_lies_from_envoys_default_limit_to_envoys_most() {
        checked(&[]).expect("the default is within the bounds");
        for within in ["65536", "8388608"] {
            checked(&["--max-header-list-bytes", within]).expect(within);
        }
        for past in ["65535", "8388609"] {
            let refused = checked(&["--max-header-list-bytes", past]).expect_err(past);
            assert_eq!(
                refused.to_string(),
                "--max-header-list-bytes: must be from 65536 to 8388608"
            );
        }
    }
}
