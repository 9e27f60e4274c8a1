//! How each algorithm counts, in one module per algorithm: for a counter's stored state, the
//! clock and the hits of a request, whether the limit is over, what remains, when it resets and
//! what to store. The embedded store runs this code; `lua/check.lua` mirrors each module in a
//! section of its own, and a differential test drives both with the same requests at the same
//! instants and requires the same answers and the same stored state.
//!
//! - [`window`] — `fixed_window` and `sliding_window`: a count per window.
//! - [`log`] — `sliding_log`: one entry per admitted hit.
//! - [`gcra`] — `token_bucket` and `leaky_bucket`: one generic cell rate algorithm.

pub mod gcra;
pub mod log;
pub mod window;

use std::time::Duration;

use super::calendar::Span;
use super::outcome::HoldSeen;
use super::{ItemStep, Source, Usage};

/// How a limit counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// A counter per window aligned to the Unix epoch (envoyproxy/ratelimit's behaviour).
    FixedWindow,
    /// The previous window's count, weighted by how much of it still overlaps the sliding
    /// window, plus the current window's count.
    SlidingWindow,
    /// Every admitted hit, with its instant: any window of the limit's length holds at most the
    /// limit.
    SlidingLog,
    /// Tokens refill at the limit per window, up to `burst`; a hit takes one.
    TokenBucket,
    /// A level drains at the limit per window and holds at most `burst`; a hit adds one.
    LeakyBucket,
}

impl Algorithm {
    pub(crate) const NAMES: &'static str =
        "fixed_window, sliding_window, sliding_log, token_bucket or leaky_bucket";

    pub fn parse(name: &str) -> Option<Algorithm> {
        Some(match name {
            "fixed_window" => Algorithm::FixedWindow,
            "sliding_window" => Algorithm::SlidingWindow,
            "sliding_log" => Algorithm::SlidingLog,
            "token_bucket" => Algorithm::TokenBucket,
            "leaky_bucket" => Algorithm::LeakyBucket,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
        }
    }

    /// Whether a request may name the instant it counts at (`fixed_window`, `sliding_log`).
    pub fn schedulable(self) -> bool {
        matches!(self, Algorithm::FixedWindow | Algorithm::SlidingLog)
    }

    /// Whether `burst` applies.
    pub(crate) fn is_bucket(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::LeakyBucket)
    }
}

/// What a request asks of one counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    /// Requests per window.
    pub limit: u64,
    pub window_ms: u64,
    /// The calendar window holding `at_ms`, for a limit on the calendar: it stands for the
    /// window of `window_ms` from the Unix epoch, and its start names it.
    pub calendar: Option<Span>,
    /// The store's clock, ms since the Unix epoch.
    pub now_ms: u64,
    /// The instant the hits count at: `now_ms`, or later for a request that names an instant.
    pub at_ms: u64,
    /// Hits to consume; 0 checks without consuming and is over when not even one more fits.
    pub hits: u64,
    /// Give `hits` back instead: never over.
    pub refund: bool,
    /// `Counting::Always`: the hits are charged whatever the answer, and a check-only request is
    /// over only when the count is above the limit.
    pub always: bool,
    /// A request's hits, or a lease's block (`window` only).
    pub step: ItemStep,
}

impl Ask {
    /// The hits a decision must find room for: at least one, so that a check-only request is
    /// over when the counter is full; counting `always`, the hits alone.
    pub(crate) fn need(&self) -> u64 {
        if let ItemStep::Take { least } = self.step {
            least.max(1)
        } else if self.always {
            self.hits
        } else {
            self.hits.max(1)
        }
    }
}

/// The most a window counts: a charge past it is clamped, so that a count stays exact in the
/// script's doubles. Only a count far above any limit (at most 2^32) gets there.
pub(crate) const MOST_COUNT: u64 = 1 << 52;

/// What evaluating one counter found; the check script returns the same numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The hits do not fit (for a check-only request, not even one more would).
    pub over: bool,
    /// What remains if the request is admitted and the hits are consumed.
    pub remaining_after: u64,
    /// What remains if nothing is consumed.
    pub remaining_before: u64,
    /// Milliseconds until the counter resets if the request is admitted (see each algorithm);
    /// when over, until the hits would fit.
    pub reset_after_ms: u64,
    /// The same if nothing is consumed.
    pub reset_before_ms: u64,
    /// What the counter records of the hits when its write lands (the request admitted, or
    /// counted `always`), as `lua/undo.lua` takes it back: hits for a window, entries for a
    /// log, units for a bucket; 0 when nothing is recorded (a refund, or hits that do not fit).
    pub charged: u64,
    /// The index of the window the counter counted in (`instant / window`) for the window
    /// algorithms, where a leased block is given back; 0 for the others.
    pub window: u64,
    /// What a held counter's item did (`limiter::hold`); `None` for any other counter.
    pub hold: Option<HoldSeen>,
}

impl Verdict {
    /// What to report once the request is decided, for a counter of `algorithm` asked for
    /// `hits`, `charged` or not.
    pub(crate) fn usage(&self, charged: bool, algorithm: Algorithm, hits: u64) -> Usage {
        let (after, reset) = if charged {
            (self.remaining_after, self.reset_after_ms)
        } else {
            (self.remaining_before, self.reset_before_ms)
        };
        Usage {
            over: self.over,
            // A hold refused for itself (its request id reused, its table full of holds) says
            // what is left.
            remaining: if self.over && !self.hold.is_some_and(|h| h.outcome.refused()) {
                0
            } else {
                after
            },
            left_before: self.remaining_before,
            reset: Duration::from_millis(reset),
            // Holds settle and expire before the counter resets: the cache would keep it over
            // longer than it is.
            full: self.hold.is_none()
                && super::cache::full(algorithm, hits, self.over, self.remaining_before, after),
            source: Source::Store,
            window: self.window,
            hold: self.hold,
        }
    }
}
