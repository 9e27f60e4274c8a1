//! What only envoyproxy/ratelimit's users need: its health model (`/healthcheck` and gRPC
//! health for `ratelimit`), its debug port, and the statsd_exporter mapping naming its metrics.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::service::Healthcheck;
use crate::telemetry::mapper::Mapper;

#[derive(Args)]
#[command(next_help_heading = "envoyproxy/ratelimit compatibility")]
pub struct ErlFlags {
    /// /healthcheck (and gRPC health for `ratelimit`) reports healthy before any rules are
    /// loaded, as envoyproxy/ratelimit does without HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED.
    #[arg(long, env = "SLUICE_HEALTHCHECK_WITHOUT_RULES")]
    healthcheck_without_rules: bool,
    /// /healthcheck (and gRPC health for `ratelimit`) fails whenever the store is unreachable,
    /// not only until it is first reached (envoyproxy/ratelimit's
    /// REDIS_HEALTH_CHECK_ACTIVE_CONNECTION).
    #[arg(long, env = "SLUICE_HEALTHCHECK_FOLLOWS_STORE")]
    healthcheck_follows_store: bool,
    /// Serve envoyproxy/ratelimit's debug endpoints (`/rlconfig`, and `/` listing them) on this
    /// address too (its port is 6070).
    #[arg(long, env = "SLUICE_DEBUG_ADDR")]
    debug_addr: Option<SocketAddr>,
    /// A statsd_exporter mapping file naming the series envoyproxy/ratelimit exports
    /// (envoyproxy/ratelimit's PROMETHEUS_MAPPER_YAML).
    ///
    /// Without it, that project's built-in mapping. A file that does not parse stops the start.
    #[arg(long, env = "SLUICE_PROMETHEUS_MAPPER")]
    prometheus_mapper: Option<PathBuf>,
}

impl ErlFlags {
    pub fn healthcheck(&self) -> Healthcheck {
        Healthcheck {
            without_rules: self.healthcheck_without_rules,
            follows_store: self.healthcheck_follows_store,
        }
    }

    pub(super) fn debug_addr(&self) -> Option<SocketAddr> {
        self.debug_addr
    }

    /// The mapping of --prometheus-mapper, read now; `None` without it, or when its file is not
    /// there: Envoy Gateway mounts it from an optional ConfigMap, and a file missing leaves
    /// envoyproxy/ratelimit's own mapping, as that project does.
    pub fn mapper(&self) -> anyhow::Result<Option<Mapper>> {
        let Some(path) = &self.prometheus_mapper else {
            return Ok(None);
        };
        match std::fs::read_to_string(path) {
            Ok(text) => Mapper::parse(&text)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--prometheus-mapper {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(
                    "--prometheus-mapper {}: no such file; envoyproxy/ratelimit's built-in mapping names the metrics",
                    path.display()
                );
                Ok(None)
            }
            Err(e) => Err(e)
                .with_context(|| format!("--prometheus-mapper: cannot read {}", path.display())),
        }
    }
}
