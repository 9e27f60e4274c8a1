//! The quota service (RLQS): what a bucket no rule matches is assigned, how long an assignment
//! lasts without a report, when an idle bucket is abandoned, and how many buckets and streams are
//! tracked at once.

use std::time::Duration;

use clap::Args;

use crate::quota::{QuotaSettings, Unmatched};

#[derive(Args)]
#[command(next_help_heading = "Quota service (RLQS)")]
pub struct QuotaFlags {
    /// What the quota service (RLQS) assigns a bucket no quota_buckets rule matches: allow (all
    /// of its requests) or deny (all of them).
    #[arg(long, env = "SLUICE_QUOTA_UNMATCHED", value_enum, default_value_t = Unmatched::Allow)]
    quota_unmatched: Unmatched,
    /// How long an Envoy enforces a quota assignment without hearing from sluice again, in whole
    /// seconds (e.g. 30s).
    ///
    /// Each report renews it. Past it, Envoy falls back to the bucket's no_assignment_behavior.
    #[arg(long, env = "SLUICE_QUOTA_ASSIGNMENT_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    quota_assignment_ttl: Duration,
    /// Reports of no request in a row (Envoy reports every 5 s) after which an Envoy is told to
    /// abandon a quota bucket.
    #[arg(long, env = "SLUICE_QUOTA_ABANDON_AFTER", default_value_t = 6)]
    quota_abandon_after: u32,
    /// Most quota buckets tracked at once, over every stream (a bucket two Envoys report counts
    /// twice).
    ///
    /// A bucket reported past it is denied (it cannot take part in the division).
    #[arg(long, env = "SLUICE_QUOTA_MAX_BUCKETS", default_value_t = 100_000)]
    quota_max_buckets: usize,
    /// Most quota streams (one per Envoy and domain) tracked at once; the buckets of a stream
    /// past it are denied until another stream ends.
    #[arg(long, env = "SLUICE_QUOTA_MAX_STREAMS", default_value_t = 1_000)]
    quota_max_streams: usize,
    /// Most quota buckets tracked at once over the streams of one client (an address; an IPv6 one
    /// by its /64).
    ///
    /// Past it, the client's further buckets are denied, and the others' are tracked still.
    #[arg(
        long,
        env = "SLUICE_QUOTA_MAX_BUCKETS_PER_CLIENT",
        default_value_t = 20_000
    )]
    quota_max_buckets_per_client: usize,
    /// Most quota streams tracked at once from one client: past it, the buckets of the client's
    /// further streams are denied until one of its streams ends.
    #[arg(
        long,
        env = "SLUICE_QUOTA_MAX_STREAMS_PER_CLIENT",
        default_value_t = 100
    )]
    quota_max_streams_per_client: usize,
    /// Most quota demand records a second this replica sends the store (on Redis, script work
    /// shared with the rate limit checks).
    ///
    /// Tracked buckets past what it records once per report (5 s) are recorded less often, each
    /// record counted longer, and keep their shares between.
    #[arg(long, env = "SLUICE_QUOTA_MAX_RECORDS", default_value_t = 2_000)]
    quota_max_records: u32,
    /// Most bucket reports a second this replica takes from its quota streams, over every stream (a
    /// report of 100 buckets is 100 of them), a second's worth at once.
    ///
    /// By default every bucket --quota-max-buckets tracks, once per Envoy report (5 s).
    ///
    /// Past it, a stream waits before it takes more, reading no further report meanwhile: HTTP/2
    /// flow control holds its Envoy's next reports at the Envoy, and the rate limit service keeps
    /// the CPU.
    #[arg(long, env = "SLUICE_QUOTA_MAX_REPORTS", default_value_t = 20_000)]
    quota_max_reports: u32,
}

impl QuotaFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        let ttl = self.quota_assignment_ttl;
        if ttl.subsec_nanos() != 0 || ttl.is_zero() {
            anyhow::bail!(
                "--quota-assignment-ttl: must be whole seconds, at least 1s (Envoy reads no fraction)"
            );
        }
        if self.quota_abandon_after == 0 {
            anyhow::bail!("--quota-abandon-after: must be at least 1");
        }
        if [
            self.quota_max_buckets,
            self.quota_max_streams,
            self.quota_max_buckets_per_client,
            self.quota_max_streams_per_client,
            self.quota_max_records as usize,
            self.quota_max_reports as usize,
        ]
        .contains(&0)
        {
            anyhow::bail!(
                "--quota-max-buckets, --quota-max-streams, --quota-max-buckets-per-client, \
                 --quota-max-streams-per-client, --quota-max-records, --quota-max-reports: must \
                 be at least 1"
            );
        }
        Ok(())
    }

    pub fn settings(&self) -> QuotaSettings {
        QuotaSettings {
            unmatched: self.quota_unmatched,
            ttl: self.quota_assignment_ttl,
            abandon_after: self.quota_abandon_after,
            max_buckets: self.quota_max_buckets,
            max_streams: self.quota_max_streams,
            max_buckets_per_client: self.quota_max_buckets_per_client,
            max_streams_per_client: self.quota_max_streams_per_client,
            max_records: self.quota_max_records,
            max_reports: self.quota_max_reports,
        }
    }
}
