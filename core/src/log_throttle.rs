//! `LogThrottle`: an event that every request (or a spinning loop) can hit is logged at most once a
//! second, with how many times it occurred meanwhile.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Counts occurrences of one event and lets it be logged at most once a second.
pub struct LogThrottle {
    /// When it was last logged, and how many occurred since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogThrottle {
    pub const fn new() -> Self {
        LogThrottle {
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many occurred since the last log (this one included)
    /// when it is time to log again.
    pub fn hit(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, count) = &mut *state;
        *count += 1;
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(count))
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        LogThrottle::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_logs_the_first_hit_then_at_most_once_a_second_with_the_count() {
        let t = LogThrottle::new();
        assert_eq!(t.hit(), Some(1));
        for _ in 0..1000 {
            assert_eq!(t.hit(), None);
        }
        *t.state.lock().unwrap() = (Some(Instant::now() - Duration::from_secs(2)), 1000);
        assert_eq!(t.hit(), Some(1001));
    }
}
