//! `sliding_log`: the instant of every admitted hit. Exact: every window of the limit's length
//! (`[s, s + window)`, to the millisecond) that holds the request's instant holds at most
//! `limit` hits once the request is admitted. For a request at the store's clock, that is the
//! window ending now; a request for a later instant (a scheduled one) must fit every window
//! around it, entries already logged for other future instants included.
//!
//! - `remaining`: hits that still fit at the instant: the limit less the fullest window that
//!   holds it.
//! - `reset`: the time until the log is empty again (its newest entry plus one window); when
//!   over, until the earliest instant from the request's one at which the hits would fit; a
//!   request for more hits than the limit never fits, and is told one window.
//! - Only hits that fit are recorded, in every mode: the log holds at most `limit` entries per
//!   window, so a shadow or quota limit over it reports it and logs nothing. Counted `always`,
//!   a charge is logged over the limit too, but only up to one entry past it in the fullest
//!   window: enough to keep check-only requests over until an entry leaves, while the log stays
//!   bounded.
//! - A refund removes up to its hits of the newest entries at or before its instant.
//!
//! Entries older than one window before the clock can no longer matter: reads skip them and
//! every write drops them; the log lives until its newest entry stops mattering (for an entry
//! scheduled ahead, at most `--max-schedule-ahead` and a window from now).
//!
//! Stored state: the entries' instants in ascending order. Redis: a sorted set scored by instant
//! whose members are `<instant>:<n>`, `n` numbering the entries of one instant from `0001` up
//! (zero-padded, so that members sort as their numbers do), which keeps every member unique and
//! exact. Memory: up to about 120 bytes per entry in Redis, so `limit` is at most
//! `MOST_ENTRIES`.
//! Mirrored by the log section of `lua/check.lua`.

use super::{Ask, Verdict};

/// The largest `requests_per_unit` of a sliding log, which bounds its entries per window.
pub(crate) const MOST_ENTRIES: u32 = 1_000;

/// What to store if the request is admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing changes.
    Keep,
    /// Log `hits` entries at `at_ms`.
    Add { at_ms: u64, hits: u64 },
    /// Remove up to `hits` of the newest entries at or before `at_ms`.
    Remove { at_ms: u64, hits: u64 },
}

/// Evaluates a log of `entries` (ascending, stale ones included) at `ask.at_ms`, which is no
/// earlier than `ask.now_ms`.
pub(crate) fn evaluate(ask: &Ask, entries: &[u64]) -> (Verdict, Change) {
    let Ask {
        limit,
        window_ms,
        now_ms,
        at_ms,
        hits,
        refund,
        always,
        ..
    } = *ask;
    let live = live(entries, now_ms, window_ms);
    let need = ask.need();
    let fullest = peak(live, at_ms, window_ms);
    let never = need > limit;
    let over = !refund && (never || fullest + need > limit);
    let until_empty = |log: &[u64]| log.last().map_or(0, |newest| newest + window_ms - now_ms);
    let before = Verdict {
        over,
        remaining_after: limit.saturating_sub(fullest),
        remaining_before: limit.saturating_sub(fullest),
        reset_after_ms: until_empty(live),
        reset_before_ms: until_empty(live),
        charged: 0,
        window: 0,
        hold: None,
    };
    if over {
        let fits = if never {
            window_ms
        } else {
            first_fit(live, at_ms, window_ms, limit - need) - now_ms
        };
        let logged = if always {
            hits.min((limit + 1).saturating_sub(fullest))
        } else {
            0
        };
        let verdict = Verdict {
            remaining_after: limit.saturating_sub(fullest + logged),
            reset_after_ms: fits,
            reset_before_ms: fits,
            charged: logged,
            ..before
        };
        let change = if logged > 0 {
            Change::Add {
                at_ms,
                hits: logged,
            }
        } else {
            Change::Keep
        };
        return (verdict, change);
    }
    let change = match (refund, hits) {
        (_, 0) => Change::Keep,
        (false, hits) => Change::Add { at_ms, hits },
        (true, hits) if live.first().is_some_and(|&oldest| oldest <= at_ms) => {
            Change::Remove { at_ms, hits }
        }
        (true, _) => Change::Keep,
    };
    let verdict = match change {
        Change::Keep => before,
        Change::Add { .. } => Verdict {
            remaining_after: limit.saturating_sub(fullest + hits),
            charged: hits,
            reset_after_ms: live.last().map_or(at_ms, |&n| n.max(at_ms)) + window_ms - now_ms,
            ..before
        },
        Change::Remove { .. } => {
            let mut after = live.to_vec();
            apply(&mut after, change, now_ms, window_ms);
            Verdict {
                remaining_after: limit.saturating_sub(peak(&after, at_ms, window_ms)),
                reset_after_ms: until_empty(&after),
                ..before
            }
        }
    };
    (verdict, change)
}

/// Applies `change` to `entries` at `now_ms`, dropping the entries that can no longer matter.
pub(crate) fn apply(entries: &mut Vec<u64>, change: Change, now_ms: u64, window_ms: u64) {
    let stale = entries.len() - live(entries, now_ms, window_ms).len();
    entries.drain(..stale);
    match change {
        Change::Keep => {}
        Change::Add { at_ms, hits } => {
            let at = entries.partition_point(|&e| e <= at_ms);
            entries.splice(at..at, (0..hits).map(|_| at_ms));
        }
        Change::Remove { at_ms, hits } => {
            let end = entries.partition_point(|&e| e <= at_ms);
            let start = end.saturating_sub(usize::try_from(hits).unwrap_or(usize::MAX));
            entries.drain(start..end);
        }
    }
}

/// How long a log must live from `now_ms`: until its newest entry stops mattering; `None` for
/// an empty log, which is not stored.
pub(crate) fn ttl_ms(entries: &[u64], now_ms: u64, window_ms: u64) -> Option<u64> {
    entries.last().map(|newest| newest + window_ms - now_ms)
}

/// The entries that can still matter at `now_ms` or later: those less than a window old.
fn live(entries: &[u64], now_ms: u64, window_ms: u64) -> &[u64] {
    &entries[entries.partition_point(|&e| e + window_ms <= now_ms)..]
}

/// The most entries any window of `window_ms` holding `at_ms` holds. The fullest window can be
/// slid left until an entry is its first, or right until it starts at `at_ms`.
fn peak(log: &[u64], at_ms: u64, window_ms: u64) -> u64 {
    let from_at = log
        .iter()
        .filter(|&&e| e >= at_ms && e < at_ms + window_ms)
        .count();
    let mut best = from_at;
    let mut end = 0;
    for (first, &start) in log.iter().enumerate() {
        if start + window_ms <= at_ms {
            continue;
        }
        if start > at_ms {
            break;
        }
        end = end.max(first);
        while end < log.len() && log[end] < start + window_ms {
            end += 1;
        }
        best = best.max(end - first);
    }
    best as u64
}

/// The earliest instant from `at_ms` at which `limit - room` hits fit: where no window holding
/// it holds more than `room` entries. A window holds more than `room` entries exactly when it
/// holds `room + 1` consecutive entries spanning less than a window, and such a group forbids
/// the instants from its last entry's window start to its first entry's window end; the groups'
/// spans are ordered, so one pass skips them all.
fn first_fit(log: &[u64], at_ms: u64, window_ms: u64, room: u64) -> u64 {
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    let mut at = at_ms;
    for (first, &start) in log.iter().enumerate() {
        let Some(&last) = log.get(first + room) else {
            break;
        };
        if last < start + window_ms && last < at + window_ms && start + window_ms > at {
            at = start + window_ms;
        }
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000;
    const MINUTE: u64 = 60 * SECOND;
    const HOUR: u64 = 60 * MINUTE;
    const T0: u64 = 1_700_000_000_000;

    /// A log of `limit` per `window_ms`, asked at given instants.
    struct Log {
        limit: u64,
        window_ms: u64,
        entries: Vec<u64>,
        always: bool,
    }

    impl Log {
        fn new(limit: u64, window_ms: u64) -> Self {
            Log {
                limit,
                window_ms,
                entries: Vec::new(),
                always: false,
            }
        }

        /// Asks for `hits` at `now` (ms after T0), counting at `at` (ms after T0).
        fn ask(&mut self, now: u64, at: u64, hits: u64, refund: bool) -> Verdict {
            let ask = Ask {
                limit: self.limit,
                window_ms: self.window_ms,
                calendar: None,
                now_ms: T0 + now,
                at_ms: T0 + at.max(now),
                hits,
                refund,
                always: self.always,
                step: crate::limiter::ItemStep::Hits,
            };
            let (verdict, change) = evaluate(&ask, &self.entries);
            apply(&mut self.entries, change, ask.now_ms, self.window_ms);
            verdict
        }
    }

    /// (now, at, hits, admitted, remaining, reset), in ms after T0, for one log.
    fn table(mut log: Log, rows: &[(u64, u64, u64, bool, u64, u64)]) {
        for (i, &(now, at, hits, admitted, remaining, reset)) in rows.iter().enumerate() {
            let v = log.ask(now, at, hits, false);
            let (left, until) = if v.over {
                (0, v.reset_before_ms)
            } else {
                (v.remaining_after, v.reset_after_ms)
            };
            assert_eq!(
                (!v.over, left, until),
                (admitted, remaining, reset),
                "row {i}: {hits} hit(s) at {at} asked at {now}"
            );
        }
    }

    #[test]
    fn every_window_ending_now_holds_at_most_the_limit() {
        // 3 per second.
        table(
            Log::new(3, SECOND),
            &[
                (0, 0, 1, true, 2, 1_000),
                (400, 400, 2, true, 0, 1_000),
                (700, 700, 1, false, 0, 300),
                (999, 999, 1, false, 0, 1),
                (1_000, 1_000, 1, true, 0, 1_000),
                (1_399, 1_399, 1, false, 0, 1),
                (1_400, 1_400, 2, true, 0, 1_000),
                (1_400, 1_400, 0, false, 0, 600),
                (5_000, 5_000, 0, true, 3, 0),
            ],
        );
    }

    #[test]
    fn no_window_admits_twice_the_limit_across_a_boundary() {
        let mut log = Log::new(10, MINUTE);
        let admitted =
            |log: &mut Log, at: u64| (0..10).filter(|_| !log.ask(at, at, 1, false).over).count();
        assert_eq!(admitted(&mut log, MINUTE - SECOND), 10);
        assert_eq!(admitted(&mut log, MINUTE + SECOND), 0);
        assert_eq!(
            admitted(&mut log, 2 * MINUTE - SECOND),
            10,
            "a whole window later"
        );
    }

    #[test]
    fn a_request_for_more_than_the_limit_never_fits() {
        table(
            Log::new(2, SECOND),
            &[(0, 0, 3, false, 0, 1_000), (0, 0, 2, true, 0, 1_000)],
        );
    }

    #[test]
    fn a_scheduled_instant_must_fit_every_window_around_it() {
        // 1 per minute, scheduled: 11:11:11 is taken.
        let at = 11 * HOUR + 11 * MINUTE + 11 * SECOND;
        table(
            Log::new(1, MINUTE),
            &[
                (0, at, 1, true, 0, at + MINUTE),
                (0, at + SECOND, 1, false, 0, at + MINUTE),
                (0, at - MINUTE + 1, 1, false, 0, at + MINUTE),
                (0, at - MINUTE, 1, true, 0, at + MINUTE),
                (0, at + MINUTE, 1, true, 0, at + 2 * MINUTE),
                (0, at + MINUTE + SECOND, 1, false, 0, at + 2 * MINUTE),
            ],
        );
    }

    #[test]
    fn a_scheduled_instant_is_told_when_the_hits_would_fit() {
        // 2 per minute, with 0:00, 0:30 and 1:10 taken: every instant before 1:30 lies in a
        // window holding two of them (up to 1:00 the one from 0:00, then the one from 0:30).
        let mut log = Log::new(2, MINUTE);
        for at in [0, 30 * SECOND, 70 * SECOND] {
            assert!(!log.ask(0, at, 1, false).over);
        }
        let v = log.ask(0, 50 * SECOND, 1, false);
        assert!(v.over);
        assert_eq!(v.reset_before_ms, 90 * SECOND);
        assert!(log.ask(0, 90 * SECOND - 1, 1, false).over);
        assert!(!log.ask(0, 90 * SECOND, 1, false).over);
    }

    #[test]
    fn entries_that_can_no_longer_matter_are_dropped_on_write() {
        let mut log = Log::new(5, SECOND);
        log.ask(0, 0, 2, false);
        log.ask(500, 500, 1, false);
        assert_eq!(log.entries, [T0, T0, T0 + 500]);
        log.ask(1_200, 1_200, 1, false);
        assert_eq!(log.entries, [T0 + 500, T0 + 1_200]);
        assert_eq!(ttl_ms(&log.entries, T0 + 1_200, SECOND), Some(1_000));
    }

    #[test]
    fn refunds_remove_the_newest_entries_at_or_before_the_instant() {
        let mut log = Log::new(5, MINUTE);
        log.ask(0, 0, 2, false);
        log.ask(0, 10 * SECOND, 1, false);
        log.ask(0, 50 * SECOND, 1, false);
        let v = log.ask(20 * SECOND, 20 * SECOND, 2, true);
        assert!(!v.over);
        assert_eq!(log.entries, [T0, T0 + 50 * SECOND]);
        assert_eq!(v.remaining_after, 3);
        log.ask(20 * SECOND, 20 * SECOND, 9, true);
        assert_eq!(
            log.entries,
            [T0 + 50 * SECOND],
            "a later instant is not refunded"
        );
    }

    #[test]
    fn check_only_consumes_nothing() {
        let mut log = Log::new(1, SECOND);
        assert!(!log.ask(0, 0, 0, false).over);
        assert!(log.entries.is_empty());
        log.ask(0, 0, 1, false);
        assert!(log.ask(10, 10, 0, false).over);
    }

    #[test]
    fn counted_always_a_charge_is_logged_up_to_one_past_the_limit() {
        let mut log = Log {
            always: true,
            ..Log::new(3, SECOND)
        };
        let v = log.ask(0, 0, 2, false);
        assert!(!v.over);
        assert_eq!(v.charged, 2);
        let v = log.ask(100, 100, 5, false);
        assert!(v.over);
        assert_eq!(v.charged, 2, "logged up to one past the limit");
        assert_eq!(log.entries.len(), 4);
        assert!(log.ask(200, 200, 0, false).over, "above the limit");
        let v = log.ask(1_000, 1_000, 0, false);
        assert!(!v.over, "the first two left: at the limit, not above it");
    }
}
