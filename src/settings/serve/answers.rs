//! How `serve` answers a decided request: shadow and quota modes, when hits are charged, the
//! share of a limit counted as near it, and what an answer carries back to Envoy (limit
//! headers, dynamic metadata).

use std::time::Duration;

use clap::Args;

use crate::service::rls::{Answering, LimitHeaders};
use sluice_core::limiter::Counting;
use sluice_core::limiter::lease::{Leases, Leasing, MOST_HELD};

#[derive(Args)]
#[command(next_help_heading = "Answers")]
pub struct AnswerFlags {
    /// Count and report, but never deny: every answer is OK.
    #[arg(long, env = "SLUICE_SHADOW_MODE")]
    shadow_mode: bool,
    /// Treat every limit as a quota limit (envoyproxy/ratelimit's global quota mode).
    ///
    /// A request is denied only when every descriptor it has is over its limit.
    #[arg(long, env = "SLUICE_QUOTA_MODE")]
    quota_mode: bool,
    /// When hits are charged, for rules without `counting`: admitted (only when the whole
    /// request is admitted, and only if they fit) or always (envoyproxy/ratelimit's counting:
    /// every charge lands, and a request is over when the count is above the limit).
    #[arg(long, env = "SLUICE_COUNTING", value_parser = crate::settings::counting(), default_value = "admitted")]
    counting: Counting,
    /// Whether rules without `lease` are decided from blocks of their counters leased from the
    /// store (auto: for fixed and sliding windows enforced and counted when admitted; see
    /// docs/leases.md) or ask the store on every request (off).
    #[arg(long, env = "SLUICE_LEASE", value_parser = crate::settings::leasing(), default_value = "off")]
    lease: Leasing,
    /// How long a leased block may go unused before this replica gives it back.
    ///
    /// The longest another replica's request is denied while capacity sits unused here is about one
    /// and a half times this (docs/leases.md).
    #[arg(long, env = "SLUICE_LEASE_IDLE", default_value = "500ms", value_parser = humantime::parse_duration)]
    lease_idle: Duration,
    /// How many leased counters this replica holds at once.
    ///
    /// Past it, a new counter is decided by the store on every request until the periodic give-back
    /// drops counters unused for --lease-idle (docs/leases.md).
    #[arg(long, env = "SLUICE_LEASE_MAX_COUNTERS", default_value_t = MOST_HELD as u64, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    lease_max_counters: u64,
    /// The cluster (a region, a zone) this replica counts `scope: cluster` rules in: replicas
    /// of one name share those counters, each name has its own (docs/rules.md, Scope).
    #[arg(long, env = "SLUICE_CLUSTER_NAME", value_parser = parse_cluster_name)]
    cluster_name: Option<String>,
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
}

impl AnswerFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        if self.lease_idle < Duration::from_millis(10)
            || self.lease_idle > Duration::from_secs(3600)
        {
            anyhow::bail!("--lease-idle: must be from 10ms to 1h");
        }
        if !(self.near_limit_ratio > 0.0 && self.near_limit_ratio <= 1.0) {
            anyhow::bail!("--near-limit-ratio: must be more than 0 and at most 1");
        }
        Ok(())
    }

    /// The blocks of leased counters this replica will hold.
    pub fn leases(&self) -> Leases {
        Leases::new(self.lease_idle, self.lease_max_counters as usize)
    }

    pub fn answering(&self) -> Answering {
        Answering {
            shadow_mode: self.shadow_mode,
            quota_mode: self.quota_mode,
            counting: self.counting,
            lease: self.lease,
            cluster_name: self.cluster_name.clone(),
            near_limit_ratio: self.near_limit_ratio,
            limit_headers: self.limit_response_headers.then(|| LimitHeaders {
                limit: self.limit_limit_header.clone(),
                remaining: self.limit_remaining_header.clone(),
                reset: self.limit_reset_header.clone(),
            }),
            dynamic_metadata: self.response_dynamic_metadata,
        }
    }
}

/// A cluster's name: 1 to 64 letters, digits, `-`, `_` or `.`, as it becomes part of every
/// counter key of its `scope: cluster` rules.
pub(in crate::settings) fn parse_cluster_name(value: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if value.is_empty() || value.len() > 64 || !value.chars().all(allowed) {
        return Err("1 to 64 letters, digits, '-', '_' or '.', such as eu-west-1".into());
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
