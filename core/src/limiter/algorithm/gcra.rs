//! `token_bucket` and `leaky_bucket`: one generic cell rate algorithm (GCRA) serves both. A
//! bucket of `burst` refills (token bucket) or drains (leaky bucket, the meter form) at `limit`
//! per window; a hit takes a token, or adds to the level, and fits only if the bucket does not
//! run dry, or overflow. The two are the same decision seen from either side: a token bucket
//! with `t` tokens is a leaky bucket with `burst - t` in it.
//!
//! Exact in integers: a hit weighs `window_ms` units and the level drains `limit` units per
//! millisecond, so a bucket holds at most `burst × window_ms` units, which rule files keep below
//! `MOST_UNITS` (2^51) so that every value is exact in the Lua script's doubles too.
//!
//! - `remaining`: whole hits that fit now (tokens left, or room left in the leaky bucket).
//! - `reset`: the time until the bucket is full of tokens again (the leaky bucket empty);
//!   when over, until the hits fit; a request for more than `burst` hits never fits, and is
//!   told one window.
//! - Only hits that fit are recorded, in every mode: a shadow or quota limit over its burst
//!   reports it and stores nothing, so its bucket shows what enforcing it would have done.
//!   Counted `always`, a charge is recorded whole, past the burst too (up to `MOST_LEVEL`): debt
//!   that the drain clears before anything fits again.
//! - A limit of 0 denies everything.
//!
//! Stored state: the level and the instant it was measured (Redis: a hash of `t` and `l`),
//! kept until the bucket would be full again; a bucket full again is deleted.
//! Mirrored by the bucket section of `lua/check.lua`.

use super::{Ask, Verdict};

/// The most units a bucket may hold (`burst × window_ms`): 2^51, so that a level plus the
/// hits of one request stays exact below 2^53.
pub(crate) const MOST_UNITS: u64 = 1 << 51;

/// The highest level a bucket records, debt included: a charge past it is clamped, so that a
/// level stays exact in the script's doubles.
pub(crate) const MOST_LEVEL: u64 = 1 << 52;

/// A bucket as stored: its level in units (a hit is `window_ms` units), measured at `stamp_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    pub stamp_ms: u64,
    pub level: u64,
}

/// What to store if the request is admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// Nothing changes.
    Keep,
    /// Store the state, to live `ttl_ms`.
    Set { state: State, ttl_ms: u64 },
    /// The bucket is full again: forget it.
    Delete,
}

/// Evaluates one bucket holding at most `burst` hits at `ask.now_ms`.
pub(crate) fn evaluate(ask: &Ask, burst: u64, stored: Option<State>) -> (Verdict, Write) {
    let Ask {
        limit,
        window_ms,
        now_ms,
        hits,
        refund,
        always,
        ..
    } = *ask;
    let level = match stored {
        Some(s) => s
            .level
            .saturating_sub(now_ms.saturating_sub(s.stamp_ms).saturating_mul(limit)),
        None => 0,
    };
    let need = ask.need();
    let capacity = burst * window_ms;
    let never = limit == 0 || need > burst;
    let over = !refund && (never || level + need * window_ms > capacity);
    let mut after = level;
    let mut write = Write::Keep;
    if limit > 0 && (refund || !over || always) && hits > 0 {
        after = if refund {
            if hits >= level.div_ceil(window_ms) {
                0
            } else {
                level - hits * window_ms
            }
        } else {
            level
                .saturating_add(hits.saturating_mul(window_ms))
                .min(MOST_LEVEL)
        };
        write = if after == 0 {
            Write::Delete
        } else {
            Write::Set {
                state: State {
                    stamp_ms: now_ms,
                    level: after,
                },
                ttl_ms: after.div_ceil(limit),
            }
        };
    }
    let remaining = |level: u64| burst.saturating_sub(level.div_ceil(window_ms));
    let until_full = |level: u64| {
        if limit == 0 {
            window_ms
        } else {
            level.div_ceil(limit)
        }
    };
    let (reset_after_ms, reset_before_ms) = if over {
        let fits = if never {
            window_ms
        } else {
            (level + need * window_ms - capacity).div_ceil(limit)
        };
        (fits, fits)
    } else {
        (until_full(after), until_full(level))
    };
    (
        Verdict {
            over,
            remaining_after: remaining(after),
            remaining_before: remaining(level),
            reset_after_ms,
            reset_before_ms,
            charged: if refund { 0 } else { after - level },
            window: 0,
            hold: None,
        },
        write,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000;
    const T0: u64 = 1_700_000_000_000;

    /// A bucket of `limit` per second holding at most `burst`, asked at `at`.
    struct Bucket {
        limit: u64,
        burst: u64,
        state: Option<State>,
    }

    impl Bucket {
        fn new(limit: u64, burst: u64) -> Self {
            Bucket {
                limit,
                burst,
                state: None,
            }
        }

        /// Asks for `hits` at `at` (ms after `T0`); stores what an admitted request stores.
        fn ask(&mut self, at: u64, hits: u64, refund: bool) -> Verdict {
            self.ask_counting(at, hits, refund, false)
        }

        /// The same, counted `always` if `always`: then the write lands over the burst too.
        fn ask_counting(&mut self, at: u64, hits: u64, refund: bool, always: bool) -> Verdict {
            let ask = Ask {
                limit: self.limit,
                window_ms: SECOND,
                calendar: None,
                now_ms: T0 + at,
                at_ms: T0 + at,
                hits,
                refund,
                always,
                step: crate::limiter::ItemStep::Hits,
            };
            let (verdict, write) = evaluate(&ask, self.burst, self.state);
            if !verdict.over || always {
                match write {
                    Write::Keep => {}
                    Write::Set { state, .. } => self.state = Some(state),
                    Write::Delete => self.state = None,
                }
            }
            verdict
        }
    }

    /// (ms after T0, hits, admitted, remaining, reset in ms) for one bucket.
    fn table(mut bucket: Bucket, rows: &[(u64, u64, bool, u64, u64)]) {
        for (i, &(at, hits, admitted, remaining, reset)) in rows.iter().enumerate() {
            let v = bucket.ask(at, hits, false);
            let (left, until) = if v.over {
                (0, v.reset_before_ms)
            } else {
                (v.remaining_after, v.reset_after_ms)
            };
            assert_eq!(
                (!v.over, left, until),
                (admitted, remaining, reset),
                "row {i}: {hits} hit(s) at {at} ms"
            );
        }
    }

    #[test]
    fn a_bucket_admits_its_burst_then_refills_at_the_rate() {
        // 10 per second, burst 10: a token every 100 ms.
        table(
            Bucket::new(10, 10),
            &[
                (0, 1, true, 9, 100),
                (0, 8, true, 1, 900),
                (0, 1, true, 0, 1_000),
                (0, 1, false, 0, 100),
                (50, 1, false, 0, 50),
                (100, 1, true, 0, 1_000),
                (350, 2, true, 0, 950),
                (450, 1, true, 0, 950),
                (2_000, 0, true, 10, 0),
            ],
        );
    }

    #[test]
    fn burst_bounds_what_accumulates() {
        // 1 per second, burst 3: after a long idle only 3 fit at once.
        table(
            Bucket::new(1, 3),
            &[
                (0, 3, true, 0, 3_000),
                (0, 1, false, 0, 1_000),
                (60_000, 4, false, 0, SECOND),
                (60_000, 3, true, 0, 3_000),
                (61_500, 1, true, 0, 2_500),
            ],
        );
    }

    #[test]
    fn rates_that_do_not_divide_a_window_stay_exact() {
        // 3 per second: a token every 333⅓ ms.
        table(
            Bucket::new(3, 1),
            &[
                (0, 1, true, 0, 334),
                (333, 1, false, 0, 1),
                (334, 1, true, 0, 334),
                // A full bucket gains nothing: the next token comes 333⅓ ms after 334.
                (666, 1, false, 0, 2),
                (667, 1, false, 0, 1),
                (668, 1, true, 0, 334),
                (1_002, 1, true, 0, 334),
            ],
        );
    }

    #[test]
    fn a_request_larger_than_the_burst_never_fits() {
        table(
            Bucket::new(5, 5),
            &[(0, 6, false, 0, SECOND), (0, 5, true, 0, SECOND)],
        );
    }

    #[test]
    fn refunds_give_hits_back_and_a_full_bucket_is_forgotten() {
        let mut bucket = Bucket::new(10, 10);
        bucket.ask(0, 4, false);
        let v = bucket.ask(0, 1, true);
        assert_eq!(v.remaining_after, 7);
        let v = bucket.ask(0, 99, true);
        assert_eq!(
            (v.over, v.remaining_after, v.reset_after_ms),
            (false, 10, 0)
        );
        assert_eq!(bucket.state, None, "a bucket full again is not stored");
    }

    #[test]
    fn check_only_consumes_nothing() {
        let mut bucket = Bucket::new(2, 2);
        bucket.ask(0, 2, false);
        assert!(bucket.ask(0, 0, false).over);
        let v = bucket.ask(500, 0, false);
        assert!(!v.over);
        assert_eq!(v.remaining_after, 1);
        assert!(!bucket.ask(500, 1, false).over, "the check took nothing");
    }

    #[test]
    fn a_limit_of_zero_denies_everything() {
        let mut bucket = Bucket::new(0, 5);
        let v = bucket.ask(0, 1, false);
        assert!(v.over);
        assert_eq!(v.reset_before_ms, SECOND);
        assert_eq!(bucket.state, None);
    }

    #[test]
    fn a_bucket_lives_until_it_is_full_again() {
        let ask = Ask {
            limit: 4,
            window_ms: SECOND,
            calendar: None,
            now_ms: T0,
            at_ms: T0,
            hits: 3,
            refund: false,
            always: false,
            step: crate::limiter::ItemStep::Hits,
        };
        let (_, write) = evaluate(&ask, 4, None);
        assert_eq!(
            write,
            Write::Set {
                state: State {
                    stamp_ms: T0,
                    level: 3_000
                },
                ttl_ms: 750
            }
        );
    }

    #[test]
    fn counted_always_a_charge_past_the_burst_is_debt_the_drain_clears() {
        // 10 per second, burst 10: 15 charged at once are 5 over; check-only requests are over
        // until the level is back at the burst (500 ms), and one hit fits 100 ms later.
        let mut bucket = Bucket::new(10, 10);
        let v = bucket.ask_counting(0, 15, false, true);
        assert!(v.over);
        assert_eq!(v.charged, 15 * SECOND);
        let v = bucket.ask_counting(0, 0, false, true);
        assert!(v.over);
        assert_eq!(v.reset_before_ms, 500);
        assert!(
            !bucket.ask_counting(500, 0, false, true).over,
            "at the burst, not above it"
        );
        assert!(bucket.ask_counting(500, 1, false, false).over);
        assert!(!bucket.ask_counting(600, 1, false, false).over);
    }

    #[test]
    fn a_level_is_clamped_where_it_would_stop_being_exact() {
        let year = 365 * 86_400 * SECOND;
        let ask = Ask {
            limit: 1,
            window_ms: year,
            calendar: None,
            now_ms: T0,
            at_ms: T0,
            hits: u64::from(u32::MAX) + 1,
            refund: false,
            always: true,
            step: crate::limiter::ItemStep::Hits,
        };
        let (verdict, write) = evaluate(&ask, 1, None);
        assert_eq!(verdict.charged, MOST_LEVEL);
        assert!(matches!(write, Write::Set { state, .. } if state.level == MOST_LEVEL));
    }
}
