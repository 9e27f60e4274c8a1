//! The Rate Limit Quota Service's decisions, below its network surface (`service::rlqs`): how
//! much of a bucket's global limit each Envoy gets. Each stream (one Envoy) reports what it let
//! through and denied; its demand is that per window, on sluice's clock. The limit is divided
//! among every stream counted in the bucket (on any replica, through the store) by max-min
//! fairness (`share`), and each stream gets its share as a token bucket Envoy enforces on its own.

mod share;

use std::time::Duration;

pub use share::divide;

/// Demands and shares are counted in thousandths of a request per window.
pub const MILLI: u64 = 1000;

/// What one stream is told to do with one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// A token bucket holding at most `tokens`, refilled with `tokens` every `fill_seconds`:
    /// `tokens` requests per window, at a steady rate, with one window's worth of burst.
    TokenBucket {
        tokens: u32,
        fill_seconds: u64,
    },
    AllowAll,
    DenyAll,
}

impl Assignment {
    /// A share of `tokens` requests per window of `fill_seconds` (at least 1); none at all
    /// denies everything, as Envoy reads a token bucket that never refills.
    pub fn share(tokens: u64, fill_seconds: u64) -> Assignment {
        match u32::try_from(tokens) {
            Ok(0) => Assignment::DenyAll,
            Ok(tokens) => Assignment::TokenBucket {
                tokens,
                fill_seconds: fill_seconds.max(1),
            },
            Err(_) => Assignment::TokenBucket {
                tokens: u32::MAX,
                fill_seconds: fill_seconds.max(1),
            },
        }
    }

    /// Requests per second it lets through; `None` when unbounded.
    pub fn rate(&self) -> Option<f64> {
        match self {
            Assignment::TokenBucket {
                tokens,
                fill_seconds,
            } => Some(f64::from(*tokens) / *fill_seconds as f64),
            Assignment::AllowAll => None,
            Assignment::DenyAll => Some(0.0),
        }
    }

    /// Its name in metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Assignment::TokenBucket { .. } => "token_bucket",
            Assignment::AllowAll => "allow_all",
            Assignment::DenyAll => "deny_all",
        }
    }
}

/// A stream's demand from one report: `requests` (allowed and denied) over `elapsed`, per
/// `window`, in thousandths, at most the whole `limit` (no stream can use more than all of it).
pub fn demand(requests: u64, elapsed: Duration, window: Duration, limit: u64) -> u64 {
    let most = limit.saturating_mul(MILLI);
    if elapsed.is_zero() {
        return most;
    }
    let per_window = requests as f64 * window.as_secs_f64() / elapsed.as_secs_f64();
    ((per_window * MILLI as f64).ceil() as u64).min(most)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn demand_is_requests_per_window_in_thousandths_capped_at_the_limit() {
        assert_eq!(demand(50, 5 * S, S, 20), 10_000);
        assert_eq!(demand(50, 5 * S, 60 * S, 1000), 600_000);
        assert_eq!(demand(500, 5 * S, S, 20), 20_000);
        assert_eq!(demand(1, 3 * S, S, 20), 334);
        assert_eq!(demand(0, 5 * S, S, 20), 0);
        assert_eq!(demand(7, Duration::ZERO, S, 20), 20_000);
    }

    #[test]
    fn a_share_of_nothing_denies_and_a_huge_one_saturates() {
        assert_eq!(Assignment::share(0, 1), Assignment::DenyAll);
        assert_eq!(
            Assignment::share(1 << 40, 60),
            Assignment::TokenBucket {
                tokens: u32::MAX,
                fill_seconds: 60
            }
        );
        assert_eq!(
            Assignment::share(6, 60).rate(),
            Some(0.1),
            "6 a minute is 0.1 a second"
        );
    }
}
