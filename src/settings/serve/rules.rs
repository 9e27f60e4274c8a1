//! Where `serve` takes its rules from: rule files under `--config` (watched, reloaded on change
//! and SIGHUP, bounded in size), or an xDS server (`xds`).

use std::path::PathBuf;

use clap::Args;

use super::at_least_one;
use super::xds::XdsFlags;
use crate::service::reload::Feed;
use sluice_core::config;

#[derive(Args)]
#[command(next_help_heading = "Rules and reload")]
pub struct RuleFlags {
    /// A rule file, or a directory of them (one domain per file); or --xds-server instead.
    #[arg(
        long,
        env = "SLUICE_CONFIG",
        required_unless_present = "xds_server",
        conflicts_with = "xds_server"
    )]
    config: Option<PathBuf>,
    /// Start with no rules (an empty rules directory) instead of refusing to: not ready until a
    /// reload (SIGHUP) finds some.
    #[arg(long, env = "SLUICE_ALLOW_EMPTY_CONFIG")]
    allow_empty_config: bool,
    /// One domain may span several files, their rules joined into one tree (envoyproxy/ratelimit's
    /// MERGE_DOMAIN_CONFIG).
    ///
    /// Else a domain in two files is an error.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
    merge_domains: bool,
    /// The most bytes the rule files under --config may hold together.
    ///
    /// Past it, a load is refused (at start, the start fails; on a reload, the rules in force stay)
    /// before the files are read.
    #[arg(long, env = "SLUICE_MAX_CONFIG_BYTES", default_value_t = config::DEFAULT_MAX_CONFIG_BYTES)]
    max_config_bytes: u64,
    /// For tests only: calendar windows are read as if the clock were this many ms ahead
    /// (behind, when negative), so that a test crosses a calendar boundary of its choosing.
    #[arg(
        long,
        env = "SLUICE_CALENDAR_CLOCK_OFFSET_MS",
        hide = true,
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    calendar_clock_offset_ms: i64,
    /// For tests only: this replica's clock reads this many ms ahead of the host's (behind,
    /// when negative), as the clock of a replica that is off does.
    #[arg(
        long,
        env = "SLUICE_CLOCK_SKEW_MS",
        hide = true,
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    clock_skew_ms: i64,
    #[command(flatten)]
    xds: XdsFlags,
}

impl RuleFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        at_least_one(
            "--max-config-bytes",
            usize::try_from(self.max_config_bytes).unwrap_or(usize::MAX),
        )
    }

    /// Sets this replica's clock as `--clock-skew-ms` says (tests only); the calendars' clock
    /// (`--calendar-clock-offset-ms`) goes with the rule files (`feed`).
    pub fn set_clock_skew(&self) {
        sluice_core::store::set_test_clock_skew(self.clock_skew_ms);
    }

    /// Where the rules come from, an xDS server's TLS files read and checked now.
    pub fn feed(&self) -> anyhow::Result<Feed> {
        if let Some(server) = self.xds.server() {
            return Ok(Feed::Xds(Box::new(
                server.subscription(self.merge_domains)?,
            )));
        }
        let Some(path) = &self.config else {
            anyhow::bail!("--config or --xds-server is needed");
        };
        Ok(Feed::Files {
            source: config::Source {
                path: path.clone(),
                merge_domains: self.merge_domains,
                max_bytes: self.max_config_bytes,
                calendar_offset_ms: self.calendar_clock_offset_ms,
            },
            allow_empty: self.allow_empty_config,
        })
    }
}
