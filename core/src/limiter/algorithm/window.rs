//! `fixed_window` and `sliding_window`: a count per window of the limit's length, windows
//! aligned to the Unix epoch; or, for a `fixed_window` on the calendar, per calendar window
//! (`limiter::calendar`), named by its start. A fixed window counts the window holding the request's instant; a
//! sliding window also weighs the window before by how much of it the sliding window still
//! covers. `remaining` is the limit less the (weighted) count; `reset` is the end of the window
//! or, for a sliding window that is over, the first millisecond at which the hits fit. Counted
//! `always`, a charge lands whole (up to `MOST_COUNT`), over the limit or not.
//! Mirrored by the window section of `lua/check.lua`.
//!
//! Stored state. A fixed window keeps one count per window index (a calendar window's start):
//! a Redis hash field per index
//! (fields of windows already over are dropped when a new one is written), a counter of its own
//! per index in the embedded store. A sliding window keeps `State` as a Redis hash of `w`, `c`
//! and `p`. A fixed window's count lives until its window ends: one for a scheduled instant, at
//! most `--max-schedule-ahead` and a window from now.

use super::{Algorithm, Ask, MOST_COUNT, Verdict};
use crate::limiter::ItemStep as Change;
use crate::limiter::lease::SHARE;

/// A window counter as stored: the index of the window it was last written in (`instant /
/// window`), its count there and, for the sliding window, the count of the window before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub window: u64,
    pub count: u64,
    pub previous: u64,
}

/// The result of evaluating one window counter, with the state to store if the request is
/// admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WindowStep {
    pub verdict: Verdict,
    /// The state to store when the request is admitted.
    pub next: State,
    /// Milliseconds the stored state must live.
    pub ttl_ms: u64,
    /// The request moves the counter: it has hits (for a block given back, in its window).
    pub writes: bool,
}

/// Evaluates one window counter at `ask.at_ms` (the clock or, for a fixed window, a later
/// instant a request names). `stored` is the counter's state (for a fixed window, that of the
/// window holding the instant, if any).
pub(crate) fn evaluate(algorithm: Algorithm, ask: &Ask, stored: Option<State>) -> WindowStep {
    let Ask {
        limit,
        window_ms,
        now_ms,
        at_ms,
        refund,
        ..
    } = *ask;
    let sliding = algorithm == Algorithm::SlidingWindow;
    let (index, start, end) = bounds(ask);
    let elapsed = at_ms - start;
    // From now: the instant may lie in a later window.
    let to_end = end - now_ms;
    let need = ask.need();
    let (previous, current) = match stored {
        Some(s) if s.window == index => (s.previous, s.count),
        Some(s) if sliding && s.window + 1 == index => (s.count, 0),
        _ => (0, 0),
    };
    let weighted = if sliding {
        weigh(previous, window_ms - elapsed, window_ms)
    } else {
        0
    };
    // Counts grow past the limit in shadow and quota mode and counted `always`.
    let used = weighted.saturating_add(current);
    let over = !refund && used.saturating_add(need) > limit;
    let hits = match ask.step {
        Change::Hits | Change::Held(_) => ask.hits,
        // A block: a share of what remains, at least the hits the request needs.
        Change::Take { .. } => ask.hits.min(need.max(limit.saturating_sub(used) / SHARE)),
        Change::Return { window } if window == index => ask.hits,
        Change::Return { .. } => 0,
    };
    let after = if refund {
        current.saturating_sub(hits)
    } else {
        current.saturating_add(hits).min(MOST_COUNT)
    };
    let reset_ms = if sliding && over {
        sliding_retry_ms(limit, window_ms, elapsed, previous, current, need)
    } else {
        to_end
    };
    WindowStep {
        verdict: Verdict {
            over,
            remaining_after: limit.saturating_sub(weighted.saturating_add(after)),
            remaining_before: limit.saturating_sub(used),
            reset_after_ms: reset_ms,
            reset_before_ms: reset_ms,
            charged: if refund { 0 } else { after - current },
            window: index,
            hold: None,
        },
        next: State {
            window: index,
            count: after,
            previous,
        },
        ttl_ms: if sliding { to_end + window_ms } else { to_end },
        writes: hits > 0,
    }
}

/// The window holding `ask.at_ms`: what names it (its index from the Unix epoch, or a calendar
/// window's start), its start and its end, in ms.
pub(crate) fn bounds(ask: &Ask) -> (u64, u64, u64) {
    match ask.calendar {
        Some(span) => (span.start, span.start, span.end),
        None => {
            let index = ask.at_ms / ask.window_ms;
            (index, index * ask.window_ms, (index + 1) * ask.window_ms)
        }
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

    /// A request at `now` for a window of a minute.
    fn ask(limit: u64, now: u64, hits: u64, refund: bool) -> Ask {
        Ask {
            limit,
            window_ms: MIN,
            calendar: None,
            now_ms: now,
            at_ms: now,
            hits,
            refund,
            always: false,
            step: Change::Hits,
        }
    }

    /// The same, counted `always`.
    fn always(limit: u64, now: u64, hits: u64) -> Ask {
        Ask {
            always: true,
            ..ask(limit, now, hits, false)
        }
    }

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
            let step = evaluate(alg, &ask(limit, now, 1, false), *state);
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
            let step = evaluate(FixedWindow, &ask(20, now, 1, false), state);
            assert!(!step.verdict.over);
            assert_eq!(step.verdict.remaining_after, expected);
            state = Some(step.next);
        }
        let step = evaluate(FixedWindow, &ask(20, now, 1, false), state);
        assert!(step.verdict.over);
        assert_eq!(step.verdict.remaining_before, 0);
        assert_eq!(step.verdict.reset_before_ms, 55_000);
    }

    #[test]
    fn fixed_windows_are_aligned_to_the_epoch() {
        let step = evaluate(FixedWindow, &ask(5, 7 * MIN + 59_999, 1, false), None);
        assert_eq!(step.verdict.reset_before_ms, 1);
        assert_eq!(step.next.window, 7);
        let later = evaluate(FixedWindow, &ask(5, 8 * MIN, 1, false), Some(step.next));
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
        let step = evaluate(FixedWindow, &ask(5, 3 * MIN, 0, false), full);
        assert!(step.verdict.over);
        let room = Some(State {
            window: 3,
            count: 4,
            previous: 0,
        });
        let step = evaluate(FixedWindow, &ask(5, 3 * MIN, 0, false), room);
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
        let step = evaluate(FixedWindow, &ask(5, 3 * MIN, 2, true), state);
        assert!(!step.verdict.over);
        assert_eq!(step.next.count, 3);
        let step = evaluate(FixedWindow, &ask(5, 3 * MIN, 9, true), state);
        assert_eq!(step.next.count, 0);
    }

    #[test]
    fn a_block_takes_a_share_of_what_remains_and_at_least_what_the_request_needs() {
        let take = |count, hits, least| {
            let mut a = ask(100, 3 * MIN, hits, false);
            a.step = Change::Take { least };
            let state = State {
                window: 3,
                count,
                previous: 0,
            };
            let step = evaluate(FixedWindow, &a, Some(state));
            (!step.verdict.over).then_some(step.verdict.charged)
        };
        assert_eq!(take(20, 50, 1), Some(80 / SHARE));
        assert_eq!(take(20, 5, 1), Some(5), "no more than asked");
        assert_eq!(
            take(96, 50, 3),
            Some(3),
            "little left: what the request needs"
        );
        assert_eq!(take(99, 50, 1), Some(1));
        assert_eq!(
            take(99, 50, 2),
            None,
            "over when the request's hits do not fit"
        );
        assert_eq!(take(100, 50, 1), None);
    }

    #[test]
    fn a_block_comes_back_only_to_the_window_that_counted_it() {
        let state = Some(State {
            window: 3,
            count: 40,
            previous: 0,
        });
        let give = |window| {
            let mut a = ask(100, 3 * MIN, 30, true);
            a.step = Change::Return { window };
            evaluate(FixedWindow, &a, state).next.count
        };
        assert_eq!(give(3), 10);
        assert_eq!(
            give(2),
            40,
            "a block of a window that is over frees nothing now"
        );
    }

    #[test]
    fn a_limit_of_zero_denies_everything() {
        assert!(
            evaluate(FixedWindow, &ask(0, MIN, 1, false), None)
                .verdict
                .over
        );
        assert!(
            evaluate(SlidingWindow, &ask(0, MIN, 1, false), None)
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
        let step = evaluate(SlidingWindow, &ask(10, 5 * MIN, 1, false), old);
        assert_eq!(step.verdict.remaining_after, 9);
    }

    /// Asserts that an over-limit sliding window's reset names the first millisecond at which
    /// one more hit fits (limit 10), and returns that moment.
    fn exact_retry(state: State, now: u64) -> u64 {
        let over = |at: u64| evaluate(SlidingWindow, &ask(10, at, 1, false), Some(state)).verdict;
        let step = over(now);
        assert!(step.over);
        let retry = now + step.reset_before_ms;
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
        let step = evaluate(SlidingWindow, &ask(10, 5 * MIN + 20_000, 1, false), None);
        assert_eq!(step.ttl_ms, 40_000 + MIN);
    }

    #[test]
    fn counted_always_a_charge_lands_past_the_limit_and_check_only_is_over_only_above_it() {
        let state = |count| {
            Some(State {
                window: 3,
                count,
                previous: 0,
            })
        };
        let at_limit = evaluate(FixedWindow, &always(2, 3 * MIN, 0), state(2));
        assert!(
            !at_limit.verdict.over,
            "a count at the limit is not above it"
        );
        let above = evaluate(FixedWindow, &always(2, 3 * MIN, 0), state(3));
        assert!(above.verdict.over);
        let charge = evaluate(FixedWindow, &always(2, 3 * MIN, 5), state(1));
        assert!(charge.verdict.over);
        assert_eq!(charge.next.count, 6, "the whole charge is recorded");
        assert_eq!(charge.verdict.charged, 5);
    }

    #[test]
    fn a_count_is_clamped_where_it_would_stop_being_exact() {
        let huge = Some(State {
            window: 3,
            count: MOST_COUNT - 1,
            previous: 0,
        });
        let step = evaluate(FixedWindow, &always(2, 3 * MIN, 1 << 32), huge);
        assert_eq!(step.next.count, MOST_COUNT);
        assert_eq!(step.verdict.charged, 1);
    }
}
