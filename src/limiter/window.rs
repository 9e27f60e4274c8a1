//! The window math, in one place: for a counter's stored state, the clock and the hits of a
//! request, whether the limit is over, what remains, when it resets and the state to store.
//! The memory store runs this code; the Redis scripts in `lua/` mirror it line for line.

use std::time::Duration;

use super::{Algorithm, Usage};

/// A counter as stored: the index of the window it was last written in (`now / window`), its
/// count there and, for the sliding window, the count of the window before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub window: u64,
    pub count: u64,
    pub previous: u64,
}

/// What evaluating one counter found; the Redis scripts return the same four numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The hits do not fit (for a check-only request, not even one more would).
    pub over: bool,
    /// What remains if the request is admitted and the hits are consumed.
    pub remaining_after: u64,
    /// What remains if nothing is consumed.
    pub remaining_before: u64,
    /// Milliseconds until the window ends or, when over, until the hits would fit.
    pub reset_ms: u64,
}

impl Verdict {
    /// What to report once the request is decided, for a counter of `algorithm` asked for
    /// `hits`.
    pub fn usage(&self, admitted: bool, algorithm: Algorithm, hits: u64) -> Usage {
        let after = if admitted {
            self.remaining_after
        } else {
            self.remaining_before
        };
        Usage {
            over: self.over,
            remaining: if self.over { 0 } else { after },
            reset: Duration::from_millis(self.reset_ms),
            full: super::cache::full(algorithm, hits, self.over, self.remaining_before, after),
            source: super::Source::Store,
        }
    }
}

/// The result of evaluating one counter, with the state to store if the request is admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub verdict: Verdict,
    /// The state to store when the request is admitted.
    pub next: State,
    /// Milliseconds the stored state must live.
    pub ttl_ms: u64,
}

/// Evaluates one counter. `hits` 0 checks without consuming and is over when not even one more
/// hit fits; `refund` gives `hits` back and is never over.
pub fn evaluate(
    algorithm: Algorithm,
    limit: u64,
    window_ms: u64,
    now_ms: u64,
    stored: Option<State>,
    hits: u64,
    refund: bool,
) -> Step {
    let index = now_ms / window_ms;
    let elapsed = now_ms - index * window_ms;
    let to_end = window_ms - elapsed;
    let need = hits.max(1);
    let (previous, current) = match stored {
        Some(s) if s.window == index => (s.previous, s.count),
        Some(s) if algorithm == Algorithm::SlidingWindow && s.window + 1 == index => (s.count, 0),
        _ => (0, 0),
    };
    let weighted = match algorithm {
        Algorithm::FixedWindow => 0,
        Algorithm::SlidingWindow => weigh(previous, window_ms - elapsed, window_ms),
    };
    // Saturating: counts only grow past the limit in shadow mode, where they stop mattering.
    let used = weighted.saturating_add(current);
    let over = !refund && used.saturating_add(need) > limit;
    let after = if refund {
        current.saturating_sub(hits)
    } else {
        current.saturating_add(hits)
    };
    let reset_ms = match algorithm {
        Algorithm::SlidingWindow if over => {
            sliding_retry_ms(limit, window_ms, elapsed, previous, current, need)
        }
        _ => to_end,
    };
    let ttl_ms = match algorithm {
        Algorithm::FixedWindow => to_end,
        Algorithm::SlidingWindow => to_end + window_ms,
    };
    Step {
        verdict: Verdict {
            over,
            remaining_after: limit.saturating_sub(weighted.saturating_add(after)),
            remaining_before: limit.saturating_sub(used),
            reset_ms,
        },
        next: State {
            window: index,
            count: after,
            previous,
        },
        ttl_ms,
    }
}

/// The previous window's count scaled by the part of it still inside the sliding window,
/// rounded down. Computed in f64 exactly as the Lua scripts do, so both stores agree.
fn weigh(previous: u64, overlap_ms: u64, window_ms: u64) -> u64 {
    (previous as f64 * overlap_ms as f64 / window_ms as f64).floor() as u64
}

/// When `need` more hits fit in a sliding window that is over: the first millisecond at which
/// the weighted previous count has decayed enough, in this window or the next.
fn sliding_retry_ms(
    limit: u64,
    window_ms: u64,
    elapsed: u64,
    previous: u64,
    current: u64,
    need: u64,
) -> u64 {
    let to_end = window_ms - elapsed;
    if need > limit {
        return to_end + window_ms;
    }
    let (base, previous, current) = if current.saturating_add(need) <= limit {
        (0, previous, current)
    } else {
        (to_end, current, 0)
    };
    let start = if base == 0 { elapsed } else { 0 };
    let room = limit - current - need;
    let at = first_fit(room, previous, window_ms).max(start);
    base + (at - start).max(1)
}

/// The first offset into a window at which `weigh(previous, window - offset, window) <= room`.
fn first_fit(room: u64, previous: u64, window_ms: u64) -> u64 {
    let mut lo = 0;
    let mut hi = window_ms;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if weigh(previous, window_ms - mid, window_ms) <= room {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use Algorithm::{FixedWindow, SlidingWindow};

    const MIN: u64 = 60_000;

    /// Runs `hits` single requests at `now`, storing the state whenever one is admitted, and
    /// returns how many were admitted.
    fn admit_many(
        alg: Algorithm,
        limit: u64,
        now: u64,
        state: &mut Option<State>,
        hits: u64,
    ) -> u64 {
        let mut admitted = 0;
        for _ in 0..hits {
            let step = evaluate(alg, limit, MIN, now, *state, 1, false);
            if !step.verdict.over {
                *state = Some(step.next);
                admitted += 1;
            }
        }
        admitted
    }

    #[test]
    fn fixed_window_counts_down_then_denies() {
        let mut state = None;
        let now = 10 * MIN + 5_000;
        for expected in (0..20).rev() {
            let step = evaluate(FixedWindow, 20, MIN, now, state, 1, false);
            assert!(!step.verdict.over);
            assert_eq!(step.verdict.remaining_after, expected);
            state = Some(step.next);
        }
        let step = evaluate(FixedWindow, 20, MIN, now, state, 1, false);
        assert!(step.verdict.over);
        assert_eq!(step.verdict.remaining_before, 0);
        assert_eq!(step.verdict.reset_ms, 55_000);
    }

    #[test]
    fn fixed_windows_are_aligned_to_the_epoch() {
        let step = evaluate(FixedWindow, 5, MIN, 7 * MIN + 59_999, None, 1, false);
        assert_eq!(step.verdict.reset_ms, 1);
        assert_eq!(step.next.window, 7);
        let later = evaluate(FixedWindow, 5, MIN, 8 * MIN, Some(step.next), 1, false);
        assert_eq!(
            later.verdict.remaining_after, 4,
            "a new window starts from zero"
        );
    }

    #[test]
    fn check_only_consumes_nothing_and_is_over_when_exhausted() {
        let full = Some(State {
            window: 3,
            count: 5,
            previous: 0,
        });
        let step = evaluate(FixedWindow, 5, MIN, 3 * MIN, full, 0, false);
        assert!(step.verdict.over);
        let room = Some(State {
            window: 3,
            count: 4,
            previous: 0,
        });
        let step = evaluate(FixedWindow, 5, MIN, 3 * MIN, room, 0, false);
        assert!(!step.verdict.over);
        assert_eq!(step.next.count, 4);
        assert_eq!(step.verdict.remaining_after, 1);
    }

    #[test]
    fn refunds_give_hits_back_and_never_go_below_zero() {
        let state = Some(State {
            window: 3,
            count: 5,
            previous: 0,
        });
        let step = evaluate(FixedWindow, 5, MIN, 3 * MIN, state, 2, true);
        assert!(!step.verdict.over);
        assert_eq!(step.next.count, 3);
        let step = evaluate(FixedWindow, 5, MIN, 3 * MIN, state, 9, true);
        assert_eq!(step.next.count, 0);
    }

    #[test]
    fn a_limit_of_zero_denies_everything() {
        assert!(
            evaluate(FixedWindow, 0, MIN, MIN, None, 1, false)
                .verdict
                .over
        );
        assert!(
            evaluate(SlidingWindow, 0, MIN, MIN, None, 1, false)
                .verdict
                .over
        );
    }

    #[test]
    fn fixed_window_admits_twice_the_limit_across_a_boundary() {
        let mut state = None;
        let a = admit_many(FixedWindow, 10, 5 * MIN - 1_000, &mut state, 10);
        let b = admit_many(FixedWindow, 10, 5 * MIN + 1_000, &mut state, 10);
        assert_eq!(a + b, 20);
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let mut state = None;
        let a = admit_many(SlidingWindow, 10, 5 * MIN - 1_000, &mut state, 10);
        assert_eq!(a, 10);
        // 1 s into the next window the previous 10 still weigh floor(10 * 59/60) = 9.
        let b = admit_many(SlidingWindow, 10, 5 * MIN + 1_000, &mut state, 10);
        assert_eq!(b, 1);
        // Half way through, they weigh 5: four more fit beside the one admitted.
        let c = admit_many(SlidingWindow, 10, 5 * MIN + 30_000, &mut state, 10);
        assert_eq!(c, 4);
    }

    #[test]
    fn sliding_window_forgets_windows_older_than_the_previous() {
        let old = Some(State {
            window: 3,
            count: 10,
            previous: 10,
        });
        let step = evaluate(SlidingWindow, 10, MIN, 5 * MIN, old, 1, false);
        assert_eq!(step.verdict.remaining_after, 9);
    }

    /// Asserts that an over-limit sliding window's reset names the first millisecond at which
    /// one more hit fits (limit 10), and returns that moment.
    fn exact_retry(state: State, now: u64) -> u64 {
        let over = |at: u64| evaluate(SlidingWindow, 10, MIN, at, Some(state), 1, false).verdict;
        let step = over(now);
        assert!(step.over);
        let retry = now + step.reset_ms;
        assert!(!over(retry).over, "one more fits at the reset");
        assert!(over(retry - 1).over, "and not a millisecond before");
        retry
    }

    #[test]
    fn sliding_window_retry_is_when_one_more_fits() {
        let state = State {
            window: 5,
            count: 1,
            previous: 10,
        };
        assert!(exact_retry(state, 5 * MIN + 1_000) < 6 * MIN);
    }

    #[test]
    fn sliding_window_retry_can_fall_in_the_next_window() {
        let state = State {
            window: 5,
            count: 10,
            previous: 0,
        };
        assert!(exact_retry(state, 5 * MIN + 30_000) > 6 * MIN);
    }

    #[test]
    fn sliding_state_lives_through_the_next_window() {
        let step = evaluate(SlidingWindow, 10, MIN, 5 * MIN + 20_000, None, 1, false);
        assert_eq!(step.ttl_ms, 40_000 + MIN);
    }
}
