//! How far the store's clock is ahead of this replica's, as the store's answers tell it. An
//! answer names the store's clock when the call ran, which is at most this replica's clock when
//! the answer is read: every answer gives a reading that is at most the true offset, less by
//! however long the answer took to be read. A replica whose answers are read late (a loaded
//! host) would otherwise take its clock for behind the store's and find every call of its own
//! late, growing no grant for as long as the load lasts; so the highest reading of the last
//! `KEPT_FOR` is the one in force: never more than the true offset, and as close to it as the
//! quickest answer of that time. Another server (a restart, a failover to another host) starts
//! the readings over.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the highest reading stays in force before a lower, later one replaces it (a clock
/// that was stepped back).
const KEPT_FOR: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(super) struct StoreClock(Mutex<Option<Reading>>);

#[derive(Clone, Copy)]
struct Reading {
    ahead_ms: i64,
    at: Instant,
}

impl StoreClock {
    /// How far the store's clock is ahead of this replica's, in ms; `None` until it answered.
    pub(super) fn ahead_ms(&self) -> Option<i64> {
        self.lock().map(|r| r.ahead_ms)
    }

    /// Takes the reading of an answer that says the store's clock was `store_ms` when the call
    /// ran, read when this replica's clock says `local_ms`, at `now`; `anew` for an answer of
    /// another server than before.
    pub(super) fn read(&self, store_ms: i64, local_ms: i64, now: Instant, anew: bool) {
        let reading = Reading {
            ahead_ms: store_ms.saturating_sub(local_ms),
            at: now,
        };
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let replace = match *kept {
            None => true,
            Some(k) => {
                anew || reading.ahead_ms >= k.ahead_ms
                    || now.saturating_duration_since(k.at) >= KEPT_FOR
            }
        };
        if replace {
            *kept = Some(reading);
        }
    }

    fn lock(&self) -> Option<Reading> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_read_late_does_not_set_the_clock_back() {
        let clock = StoreClock::default();
        assert_eq!(clock.ahead_ms(), None);
        let start = Instant::now();
        // The store is 50 ms ahead: read at once, then 300 ms late.
        clock.read(1_050, 1_000, start, false);
        clock.read(2_050, 2_300, start + Duration::from_secs(1), false);
        assert_eq!(clock.ahead_ms(), Some(50));
        clock.read(3_050, 3_010, start + Duration::from_secs(2), false);
        assert_eq!(
            clock.ahead_ms(),
            Some(50),
            "the highest reading is in force"
        );
        clock.read(4_052, 4_000, start + Duration::from_secs(3), false);
        assert_eq!(clock.ahead_ms(), Some(52), "a higher one replaces it");
    }

    #[test]
    fn a_reading_is_kept_for_a_while_and_another_server_starts_over() {
        let clock = StoreClock::default();
        let start = Instant::now();
        clock.read(1_050, 1_000, start, false);
        clock.read(2_000, 2_100, start + KEPT_FOR, false);
        assert_eq!(
            clock.ahead_ms(),
            Some(-100),
            "past KEPT_FOR, the latest reading"
        );
        clock.read(3_000, 3_000, start + KEPT_FOR, false);
        clock.read(4_000, 4_500, start + KEPT_FOR, true);
        assert_eq!(clock.ahead_ms(), Some(-500), "another server's clock");
    }
}
