//! What bounds a request and what it gets when the store cannot decide: the deadline of a store
//! call, the `--on-store-error` answer, and the most descriptors, entries and scheduled time
//! one request may carry.

use std::time::Duration;

use clap::Args;

use super::at_least_one;
use crate::service::rls::{Bounds, Fallback, OnStoreError};
use sluice_core::limiter::LONGEST_WINDOW_SECONDS;

/// The longest `--store-timeout`.
const LONGEST_STORE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Args)]
#[command(next_help_heading = "Deadlines and policy")]
pub struct PolicyFlags {
    /// The longest a request waits for the counter store (e.g. 10ms, 1s); a caller's own
    /// shorter grpc-timeout shortens it.
    #[arg(long, env = "SLUICE_STORE_TIMEOUT", default_value = "10ms", value_parser = humantime::parse_duration)]
    store_timeout: Duration,
    /// What a request gets when the store cannot decide in time, is marked down, sheds load or is
    /// full.
    ///
    /// Error (gRPC UNAVAILABLE, so Envoy's failure_mode_deny decides), allow or deny.
    #[arg(long, env = "SLUICE_ON_STORE_ERROR", value_enum, default_value_t = OnStoreError::Error)]
    on_store_error: OnStoreError,
    /// Most descriptors in one request.
    #[arg(long, env = "SLUICE_MAX_DESCRIPTORS", default_value_t = 64)]
    max_descriptors: usize,
    /// Most entries in one descriptor.
    #[arg(long, env = "SLUICE_MAX_ENTRIES", default_value_t = 32)]
    max_entries: usize,
    /// How far ahead of now a /json request's "at" may lie (e.g. 31d, 1y).
    ///
    /// Every counter it writes lives at most that and its window. An instant further ahead is
    /// refused (400).
    #[arg(long, env = "SLUICE_MAX_SCHEDULE_AHEAD", default_value = "31d", value_parser = humantime::parse_duration)]
    max_schedule_ahead: Duration,
}

impl PolicyFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        at_least_one("--max-descriptors", self.max_descriptors)?;
        at_least_one("--max-entries", self.max_entries)?;
        if self.max_schedule_ahead > Duration::from_secs(LONGEST_WINDOW_SECONDS) {
            anyhow::bail!(
                "--max-schedule-ahead: must be at most {}d (10 years)",
                LONGEST_WINDOW_SECONDS / 86_400
            );
        }
        if self.store_timeout.is_zero() || self.store_timeout > LONGEST_STORE_TIMEOUT {
            anyhow::bail!(
                "--store-timeout: must be more than 0 and at most {}",
                humantime::format_duration(LONGEST_STORE_TIMEOUT)
            );
        }
        Ok(())
    }

    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_descriptors: self.max_descriptors,
            max_entries: self.max_entries,
            max_schedule_ahead: self.max_schedule_ahead,
        }
    }

    pub fn fallback(&self) -> Fallback {
        Fallback {
            store_timeout: self.store_timeout,
            on_store_error: self.on_store_error,
        }
    }
}
