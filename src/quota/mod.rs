//! The Rate Limit Quota Service's decisions, below its network surface (`service::rlqs`): how
//! much of a bucket's global limit each Envoy gets. Each stream (one Envoy) reports what it let
//! through and denied; its demand is that per window, on sluice's clock. The limit is divided
//! among every stream counted in the bucket (on any replica, through the store) by max-min
//! fairness (`limiter::share`), and each stream gets its share as a token bucket Envoy enforces on
//! its own.

use std::time::Duration;

use crate::limiter::Limit;

pub use crate::limiter::share::MILLI;

/// What one stream is told to do with one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// A token bucket holding at most `max_tokens`, refilled continuously at `tokens_per_fill`
    /// every `fill_seconds`.
    TokenBucket {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_seconds: u64,
    },
    AllowAll,
    DenyAll,
}

impl Assignment {
    /// A share of `milli` thousandths of a request per window of `limit`: a token bucket that
    /// refills at exactly that rate and holds one second of it (rounded up; at most one window's
    /// share). Envoy refills at `tokens_per_fill / fill_interval`, both whole numbers, so the share
    /// is written in thousandths over a thousand windows (6.667 a second is 6667 every 1000 s);
    /// for limits too large for that, in whole requests per window. Either way every share of one
    /// limit has the same fill interval: Envoy 1.40 compares buckets without the fill interval's
    /// seconds. No share at all denies everything (Envoy reads a bucket that never refills as
    /// denying).
    pub fn share(milli: u64, limit: &Limit) -> Assignment {
        if milli == 0 {
            return Assignment::DenyAll;
        }
        let window_seconds = (limit.window_ms() / 1000).max(1);
        let in_thousandths = u64::from(limit.requests_per_unit) * MILLI <= u64::from(u32::MAX);
        let (tokens_per_fill, windows) = if in_thousandths {
            (milli, MILLI)
        } else {
            ((milli / MILLI).max(1), 1)
        };
        let per_second = milli.div_ceil(MILLI * window_seconds);
        let saturate = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Assignment::TokenBucket {
            max_tokens: saturate(per_second.clamp(1, milli.div_ceil(MILLI))),
            tokens_per_fill: saturate(tokens_per_fill),
            fill_seconds: window_seconds * windows,
        }
    }

    /// Requests per second it lets through; `None` when unbounded.
    pub fn rate(&self) -> Option<f64> {
        match self {
            Assignment::TokenBucket {
                tokens_per_fill,
                fill_seconds,
                ..
            } => Some(f64::from(*tokens_per_fill) / *fill_seconds as f64),
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
    use crate::limiter::{Algorithm, Unit};

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

    fn limit(unit: Unit, requests_per_unit: u32) -> Limit {
        Limit {
            name: String::new(),
            requests_per_unit,
            unit,
            unit_multiplier: 1,
            algorithm: Algorithm::FixedWindow,
            burst: requests_per_unit,
        }
    }

    fn bucket(max_tokens: u32, tokens_per_fill: u32, fill_seconds: u64) -> Assignment {
        Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_seconds,
        }
    }

    #[test]
    fn a_share_is_an_exact_rate_in_whole_numbers_with_a_second_of_burst() {
        let per_second = limit(Unit::Second, 20);
        assert_eq!(Assignment::share(0, &per_second), Assignment::DenyAll);
        assert_eq!(
            Assignment::share(20_000, &per_second),
            bucket(20, 20_000, 1000)
        );
        assert_eq!(Assignment::share(6667, &per_second), bucket(7, 6667, 1000));
        assert_eq!(Assignment::share(6667, &per_second).rate(), Some(6.667));
        let per_minute = limit(Unit::Minute, 600);
        assert_eq!(
            Assignment::share(300_000, &per_minute),
            bucket(5, 300_000, 60_000),
            "300 a minute: 5 a second, a burst of 5"
        );
        assert_eq!(Assignment::share(1, &per_minute), bucket(1, 1, 60_000));
        let huge = limit(Unit::Second, u32::MAX);
        assert_eq!(
            Assignment::share(u64::from(u32::MAX) * 1000, &huge),
            bucket(u32::MAX, u32::MAX, 1)
        );
        assert_eq!(Assignment::share(1500, &huge), bucket(2, 1, 1));
    }
}
