//! What an Envoy is told of a bucket: a token bucket refilling at its share, or a blanket rule;
//! its demand from a report; and the bucket actions as they go on the wire, encoded on the quota
//! service's thread.

use std::time::Duration;

use bytes::Bytes;
use prost::Message;

use crate::pb::envoy::service::rate_limit_quota::v3::BucketId;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use sluice_core::limiter::Limit;
use sluice_core::limiter::share::MILLI;

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

/// A bucket id's entries sorted by key, as the rules match them.
pub(super) fn sorted_entries(bucket_id: &BucketId) -> Vec<(&str, &[u8])> {
    let mut entries: Vec<(&str, &[u8])> = bucket_id
        .bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    entries.sort_unstable();
    entries
}

/// A bucket action assigning `assignment` for `ttl`, encoded.
pub(super) fn assign(bucket_id: BucketId, assignment: Assignment, ttl: Duration) -> Bytes {
    let strategy = match assignment {
        Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_seconds,
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(whole_seconds(fill_seconds)),
        }),
        Assignment::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Assignment::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
    };
    encode(BucketAction {
        bucket_id: Some(bucket_id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(whole_seconds(ttl.as_secs())),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    })
}

/// A bucket action as an answer carries it: encoded here, on the quota service's thread, so that
/// the event loop writing the answer only copies it.
pub(super) fn encode(action: BucketAction) -> Bytes {
    action.encode_to_vec().into()
}

fn whole_seconds(seconds: u64) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::limiter::{Algorithm, Unit};

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
            calendar: None,
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
