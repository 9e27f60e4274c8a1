//! The recent periods the top view reads, 1 min and 10 min, each a ring of slots (10 s and 1 min)
//! on the process's clock: a period is read as its slots merged, the current one included, so it
//! covers from one to one and a sixth of its length (`Period::covered`); a slot is cleared when
//! its turn comes again. `Ring` holds any slot (a sketch); `Tallies`, the process's own counts
//! (decisions, store latency, policy answers), in atomics that every event loop adds to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A period the top view reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Period {
    /// The last minute, in 10 s slots.
    #[serde(rename = "1m")]
    #[value(name = "1m")]
    Minute,
    /// The last 10 minutes, in 1 min slots.
    #[serde(rename = "10m")]
    #[value(name = "10m")]
    TenMinutes,
}

impl Period {
    pub const ALL: [Period; 2] = [Period::Minute, Period::TenMinutes];

    pub fn name(self) -> &'static str {
        match self {
            Period::Minute => "1m",
            Period::TenMinutes => "10m",
        }
    }

    /// The length of one slot, in ms.
    fn slot_ms(self) -> u64 {
        match self {
            Period::Minute => 10_000,
            Period::TenMinutes => 60_000,
        }
    }

    /// Slots kept: the period's, and the current one, filling.
    pub(super) fn slots(self) -> usize {
        match self {
            Period::Minute => 7,
            Period::TenMinutes => 11,
        }
    }

    /// The slot `now` (ms on the process's clock) falls in.
    fn slot(self, now: u64) -> u64 {
        now / self.slot_ms()
    }

    /// How much of the process's life the period read at `now` covers: its full slots and the
    /// current one so far, or the whole life when it is shorter.
    pub fn covered(self, now: u64) -> Duration {
        let oldest = (self.slot(now) + 1).saturating_sub(self.slots() as u64);
        Duration::from_millis(now - oldest * self.slot_ms())
    }

    /// Whether `slot` is among those the period reads at `now`.
    fn reads(self, slot: u64, now: u64) -> bool {
        let current = self.slot(now);
        slot <= current && slot + self.slots() as u64 > current
    }
}

/// A period's slots, each a `T` and the slot number it holds (`None`: never used).
pub(super) struct Ring<T> {
    period: Period,
    slots: Vec<(Option<u64>, T)>,
}

impl<T> Ring<T> {
    pub(super) fn new(period: Period, mut slot: impl FnMut() -> T) -> Self {
        Ring {
            period,
            slots: (0..period.slots()).map(|_| (None, slot())).collect(),
        }
    }

    /// The slot of `now`, cleared by `clear` if it held an older one.
    pub(super) fn current(&mut self, now: u64, clear: impl FnOnce(&mut T)) -> &mut T {
        let slot = self.period.slot(now);
        let len = self.slots.len();
        let (held, value) = &mut self.slots[slot as usize % len];
        if *held != Some(slot) {
            clear(value);
            *held = Some(slot);
        }
        value
    }

    /// The slots the period reads at `now`.
    pub(super) fn recent(&self, now: u64) -> impl Iterator<Item = &T> {
        self.slots
            .iter()
            .filter(move |(held, _)| held.is_some_and(|s| self.period.reads(s, now)))
            .map(|(_, value)| value)
    }
}

/// What `--on-store-error` answered, in `Tally::policy` order.
pub const ANSWERS: [&str; 3] = ["error", "allow", "deny"];

/// Store latency buckets: below 4 µs one per µs, then four per doubling (a bucket's bounds
/// within 25 % of each other), up to 2²⁷ µs (134 s).
const LATENCY_BUCKETS: usize = 4 * 26;

/// The bucket of a latency of `us` µs.
fn bucket(us: u64) -> usize {
    if us < 4 {
        return us as usize;
    }
    let octave = 63 - u64::from(us.leading_zeros());
    let quarter = (us >> (octave - 2)) & 3;
    ((4 * (octave - 1) + quarter) as usize).min(LATENCY_BUCKETS - 1)
}

/// The upper bound, in µs, of the bucket `i`.
fn bucket_top(i: usize) -> u64 {
    if i < 4 {
        return i as u64 + 1;
    }
    let (octave, quarter) = (i as u64 / 4 + 1, i as u64 % 4);
    (4 + quarter + 1) << (octave - 2)
}

/// The process's counts in one slot.
pub(super) struct Tally {
    /// The slot number it counts (`u64::MAX`: none yet).
    slot: AtomicU64,
    decisions: AtomicU64,
    policy: [AtomicU64; ANSWERS.len()],
    latency: [AtomicU64; LATENCY_BUCKETS],
}

/// The process's counts over one period, lock-free: the first to see a slot's turn come again
/// clears it, losing at most what others add at that very moment.
pub(super) struct Tallies {
    period: Period,
    slots: Vec<Tally>,
}

/// The process's counts read over one period.
#[derive(Debug, Default)]
pub(super) struct Read {
    pub decisions: u64,
    pub policy: [u64; ANSWERS.len()],
    pub latency: Vec<u64>,
}

impl Tallies {
    pub(super) fn new(period: Period) -> Self {
        Tallies {
            period,
            slots: (0..period.slots())
                .map(|_| Tally {
                    slot: AtomicU64::new(u64::MAX),
                    decisions: AtomicU64::new(0),
                    policy: Default::default(),
                    latency: [const { AtomicU64::new(0) }; LATENCY_BUCKETS],
                })
                .collect(),
        }
    }

    fn current(&self, now: u64) -> &Tally {
        let slot = self.period.slot(now);
        let tally = &self.slots[slot as usize % self.slots.len()];
        let held = tally.slot.load(Ordering::Acquire);
        if held != slot
            && (held == u64::MAX || held < slot)
            && tally
                .slot
                .compare_exchange(held, slot, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            tally.decisions.store(0, Ordering::Relaxed);
            for c in tally.policy.iter().chain(&tally.latency) {
                c.store(0, Ordering::Relaxed);
            }
        }
        tally
    }

    pub(super) fn decided(&self, now: u64) {
        self.current(now).decisions.fetch_add(1, Ordering::Relaxed);
    }

    /// A policy answer, `ANSWERS[answer]`.
    pub(super) fn policy(&self, now: u64, answer: usize) {
        self.current(now).policy[answer].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn store_call(&self, now: u64, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.current(now).latency[bucket(us)].fetch_add(1, Ordering::Relaxed);
    }

    /// The slots the period reads at `now`, summed.
    pub(super) fn read(&self, now: u64) -> Read {
        let mut read = Read {
            latency: vec![0; LATENCY_BUCKETS],
            ..Read::default()
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        for tally in &self.slots {
            let slot = tally.slot.load(Ordering::Acquire);
            if slot == u64::MAX || !self.period.reads(slot, now) {
                continue;
            }
            read.decisions += get(&tally.decisions);
            for (sum, c) in read.policy.iter_mut().zip(&tally.policy) {
                *sum += get(c);
            }
            for (sum, c) in read.latency.iter_mut().zip(&tally.latency) {
                *sum += get(c);
            }
        }
        read
    }
}

impl Read {
    /// Store calls read.
    pub(super) fn calls(&self) -> u64 {
        self.latency.iter().sum()
    }

    /// The latency `q` (0 to 1) of the calls read are within, as the upper bound of its bucket,
    /// in ms; `None` without calls.
    pub(super) fn latency_ms(&self, q: f64) -> Option<f64> {
        let calls = self.calls();
        let rank = ((calls as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, n) in self.latency.iter().enumerate() {
            seen += n;
            if seen >= rank && calls > 0 {
                return Some(bucket_top(i) as f64 / 1000.0);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_rolling_out_of_the_period_is_forgotten() {
        let mut ring = Ring::new(Period::Minute, || 0u64);
        *ring.current(1_000, |v| *v = 0) += 5;
        *ring.current(15_000, |v| *v = 0) += 1;
        assert_eq!(
            ring.recent(69_999).sum::<u64>(),
            6,
            "seven slots: 0 s to 70 s"
        );
        assert_eq!(
            ring.recent(70_000).sum::<u64>(),
            1,
            "the first slot has left"
        );
        // Its turn comes again: cleared before it counts anew.
        *ring.current(71_000, |v| *v = 0) += 2;
        assert_eq!(ring.recent(71_000).sum::<u64>(), 3);
        assert_eq!(ring.recent(200_000).sum::<u64>(), 0);
    }

    #[test]
    fn a_period_covers_its_slots_so_far_or_the_life_of_the_process() {
        assert_eq!(Period::Minute.covered(5_000), Duration::from_secs(5));
        assert_eq!(Period::Minute.covered(65_000), Duration::from_secs(65));
        assert_eq!(Period::Minute.covered(75_000), Duration::from_secs(65));
        assert_eq!(
            Period::TenMinutes.covered(700_000),
            Duration::from_secs(640)
        );
    }

    #[test]
    fn tallies_forget_a_slot_whose_turn_comes_again() {
        let t = Tallies::new(Period::Minute);
        t.decided(0);
        t.decided(9_999);
        t.policy(10_000, 2);
        assert_eq!(t.read(10_000).decisions, 2);
        t.decided(70_000);
        let read = t.read(70_000);
        assert_eq!((read.decisions, read.policy), (1, [0, 0, 1]));
    }

    #[test]
    fn latency_quantiles_are_within_a_quarter_of_an_octave() {
        let t = Tallies::new(Period::Minute);
        for us in 1..=1000 {
            t.store_call(0, Duration::from_micros(us));
        }
        let read = t.read(0);
        assert_eq!(read.calls(), 1000);
        let p50 = read.latency_ms(0.5).unwrap();
        let p99 = read.latency_ms(0.99).unwrap();
        assert!((0.5..=0.5 * 1.25).contains(&p50), "{p50}");
        assert!((0.99..=0.99 * 1.25).contains(&p99), "{p99}");
        assert_eq!(Tallies::new(Period::Minute).read(0).latency_ms(0.5), None);
        for us in [0, 1, 3, 4, 5, 7, 8, 1_000, 123_456, u64::MAX / 2] {
            let i = bucket(us);
            assert!(us < bucket_top(i) || i == LATENCY_BUCKETS - 1, "{us}");
            assert!(i == 0 || us >= bucket_top(i - 1), "{us}");
        }
    }
}
