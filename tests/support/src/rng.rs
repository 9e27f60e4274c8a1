//! A small seeded random generator for generated histories: one `u64` seed replays the same
//! events.

use std::time::Duration;

/// splitmix64: a seed replays the same events.
pub struct Rng(pub u64);

impl Rng {
    /// The next number of the sequence.
    #[expect(
        clippy::should_implement_trait,
        reason = "an endless sequence read a number at a time, never an iterator's Option"
    )]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// From `lo` to `hi`, both included.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    pub fn index(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    /// An index into `weights`, each as likely as its weight.
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let mut n = self.next() % weights.iter().sum::<u64>();
        for (i, &w) in weights.iter().enumerate() {
            if n < w {
                return i;
            }
            n -= w;
        }
        unreachable!("n is below the sum of the weights")
    }

    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }
}
