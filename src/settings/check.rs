//! `check-config`'s arguments: the rule files to validate, read as `serve` reads them.

use std::path::PathBuf;

use clap::Args;

use sluice_core::config;

#[derive(Args)]
pub struct CheckArgs {
    /// A rule file, or a directory of them.
    path: PathBuf,
    /// One domain may span several files (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG).
    #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
    merge_domains: bool,
    /// The most bytes the rule files may hold together, as `serve --max-config-bytes`.
    #[arg(long, env = "SLUICE_MAX_CONFIG_BYTES", default_value_t = config::DEFAULT_MAX_CONFIG_BYTES)]
    max_config_bytes: u64,
}

impl CheckArgs {
    /// The rule files to validate.
    pub fn source(&self) -> config::Source {
        config::Source {
            path: self.path.clone(),
            merge_domains: self.merge_domains,
            max_bytes: self.max_config_bytes,
            calendar_offset_ms: 0,
        }
    }
}
