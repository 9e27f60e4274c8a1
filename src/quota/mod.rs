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

/// The longest fill interval, in windows, that a share may take to be exact (a share of under a
/// request per window takes several windows to refill one).
const MOST_WINDOWS_PER_FILL: u64 = 1000;

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
    /// A share of `milli` thousandths of a request per window of `window_seconds`: a token bucket
    /// refilling at that rate (to within 0.5 %, never above it) and holding one window's share,
    /// rounded up. Envoy refills at `tokens_per_fill / fill_interval`, both whole numbers, so a
    /// fraction of a request per window takes a fill interval of several windows: 6.667 a
    /// second is 20 every 3 s. No share at all denies everything (Envoy reads a token bucket that
    /// never refills as denying).
    pub fn share(milli: u64, window_seconds: u64) -> Assignment {
        if milli == 0 {
            return Assignment::DenyAll;
        }
        let windows = (1..=MOST_WINDOWS_PER_FILL)
            .find(|&k| {
                let exact = milli * k;
                let under = exact % MILLI;
                exact >= MILLI && under * 200 <= exact
            })
            .unwrap_or(MOST_WINDOWS_PER_FILL);
        let saturate = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Assignment::TokenBucket {
            max_tokens: saturate(milli.div_ceil(MILLI)),
            tokens_per_fill: saturate((milli * windows / MILLI).max(1)),
            fill_seconds: window_seconds.max(1) * windows,
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
    fn a_share_is_a_steady_rate_in_whole_numbers_never_above_it() {
        let bucket = |max_tokens, tokens_per_fill, fill_seconds| Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_seconds,
        };
        assert_eq!(Assignment::share(0, 1), Assignment::DenyAll);
        assert_eq!(Assignment::share(20_000, 1), bucket(20, 20, 1));
        assert_eq!(Assignment::share(600_000, 60), bucket(600, 600, 60));
        assert_eq!(
            Assignment::share(6667, 1),
            bucket(7, 20, 3),
            "two thirds of 20 a second"
        );
        assert_eq!(Assignment::share(667, 1), bucket(1, 2, 3));
        assert_eq!(Assignment::share(1, 60), bucket(1, 1, 60_000));
        for milli in 1..5000 {
            let rate = Assignment::share(milli, 1).rate().unwrap();
            let exact = milli as f64 / 1000.0;
            assert!(rate <= exact && rate >= exact * 0.995, "{milli}: {rate}");
        }
        let huge = Assignment::share(u64::from(u32::MAX) * 1000, 1);
        assert_eq!(huge, bucket(u32::MAX, u32::MAX, 1));
        assert_eq!(Assignment::share(6000, 60).rate(), Some(0.1), "6 a minute");
    }
}
