//! Space-saving (Metwally, Agrawal and El Abbadi, 2005): the values seen most often in a stream,
//! in a fixed number of counters. A value not held takes over the counter of the least count and
//! inherits that count as its possible overestimate (`error`); a held value's count is thus never
//! below its true count nor more than `error` above it, and every `error` is at most the
//! stream's total divided by the counters. Values are known by an id (a keyed hash of the value).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The most frequent values of one stream, in at most `capacity` counters.
pub(super) struct Sketch {
    capacity: usize,
    /// Every weight added, held or not.
    total: u64,
    counters: Vec<Counter>,
    /// Where each held id's counter is.
    at: HashMap<u64, usize, BuildHasherDefault<Ids>>,
}

/// One held value.
#[derive(Clone, Debug)]
pub(super) struct Counter {
    pub id: u64,
    /// At least its true count, at most `error` more.
    pub count: u64,
    pub error: u64,
    /// What it is shown as (empty when it is shown by its id).
    pub value: Box<[u8]>,
}

impl Sketch {
    pub(super) fn new(capacity: usize) -> Self {
        Sketch {
            capacity,
            total: 0,
            counters: Vec::new(),
            at: HashMap::default(),
        }
    }

    /// Counts `weight` more of the value `id`, whose shown form `value` gives when it becomes
    /// held.
    pub(super) fn add(&mut self, id: u64, weight: u64, value: impl FnOnce() -> Box<[u8]>) {
        self.total += weight;
        if self.capacity == 0 {
            return;
        }
        if let Some(&i) = self.at.get(&id) {
            self.counters[i].count += weight;
            return;
        }
        let (i, least) = if self.counters.len() < self.capacity {
            self.counters.push(Counter {
                id,
                count: 0,
                error: 0,
                value: Box::default(),
            });
            (self.counters.len() - 1, 0)
        } else {
            let (i, least) = self.least();
            self.at.remove(&self.counters[i].id);
            (i, least)
        };
        self.at.insert(id, i);
        self.counters[i] = Counter {
            id,
            count: least + weight,
            error: least,
            value: value(),
        };
    }

    /// Forgets every value, keeping the memory for the next ones.
    pub(super) fn clear(&mut self) {
        self.total = 0;
        self.counters.clear();
        self.at.clear();
    }

    /// Every weight added since the last `clear`.
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// The most a value not held can have been counted: the least count once every counter is
    /// taken, else 0 (every value seen is held).
    fn floor(&self) -> u64 {
        if self.counters.len() < self.capacity {
            0
        } else {
            self.least().1
        }
    }

    /// Values held.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.counters.len()
    }

    fn least(&self) -> (usize, u64) {
        self.counters
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.count))
            .min_by_key(|&(_, count)| count)
            .unwrap_or((0, 0))
    }
}

/// The values of several sketches of disjoint stretches of one stream, as one: a value's count
/// is its counts summed, plus, for each sketch not holding it, that sketch's floor (what it may
/// have had there), which its error also takes. So each merged count stays at least the true one
/// and at most `error` above it, `error` at most the total of the sketches over their capacity.
/// The `n` largest counts, largest first.
pub(super) fn merge<'a>(sketches: impl IntoIterator<Item = &'a Sketch>, n: usize) -> Vec<Counter> {
    let mut floors = 0;
    // Each value's sums, and the floors of the sketches that hold it.
    let mut merged: HashMap<u64, (Counter, u64), BuildHasherDefault<Ids>> = HashMap::default();
    for sketch in sketches {
        let floor = sketch.floor();
        floors += floor;
        for c in &sketch.counters {
            let (m, held) = merged.entry(c.id).or_insert_with(|| {
                let empty = Counter {
                    count: 0,
                    error: 0,
                    ..c.clone()
                };
                (empty, 0)
            });
            m.count += c.count;
            m.error += c.error;
            *held += floor;
        }
    }
    let mut out: Vec<Counter> = merged
        .into_values()
        .map(|(mut c, held)| {
            c.count += floors - held;
            c.error += floors - held;
            c
        })
        .collect();
    out.sort_unstable_by(|a, b| {
        (b.count, a.error, &a.value, a.id).cmp(&(a.count, b.error, &b.value, b.id))
    });
    out.truncate(n);
    out
}

/// Hashes ids, which are already keyed hashes, to themselves.
#[derive(Default)]
pub(super) struct Ids(u64);

impl Hasher for Ids {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(sketch: &mut Sketch, id: u64, weight: u64) {
        sketch.add(id, weight, || id.to_string().into_bytes().into());
    }

    /// A skewed stream of 2,000 values, interleaved: value i seen (i % 50 + 1)² times, at most
    /// 400.
    fn stream() -> Vec<u64> {
        let mut out = Vec::new();
        for round in 0..400u64 {
            for id in 0..2_000u64 {
                if (id % 50 + 1).pow(2) > round {
                    out.push(id);
                }
            }
        }
        out
    }

    #[test]
    fn each_held_count_is_at_least_the_true_one_and_at_most_its_error_above() {
        let mut sketch = Sketch::new(32);
        let mut truth: HashMap<u64, u64> = HashMap::new();
        for id in stream() {
            add(&mut sketch, id, 1);
            *truth.entry(id).or_default() += 1;
        }
        let bound = sketch.total() / 32;
        for c in &sketch.counters {
            let t = truth[&c.id];
            assert!(c.count >= t && c.count - c.error <= t, "{c:?} true {t}");
            assert!(c.error <= bound, "{c:?} past N/K = {bound}");
        }
        // Whatever was seen more than N/K times is held.
        for (id, t) in &truth {
            if *t > bound {
                assert!(sketch.at.contains_key(id), "{id} seen {t} > {bound}");
            }
        }
    }

    #[test]
    fn merged_sketches_keep_the_guarantee_over_the_whole_stream() {
        let mut slots: Vec<Sketch> = (0..6).map(|_| Sketch::new(16)).collect();
        let mut truth: HashMap<u64, u64> = HashMap::new();
        let stream = stream();
        for (i, &id) in stream.iter().enumerate() {
            add(&mut slots[i * 6 / stream.len()], id, 2);
            *truth.entry(id).or_default() += 2;
        }
        let total: u64 = slots.iter().map(Sketch::total).sum();
        let merged = merge(&slots, 100);
        assert!(!merged.is_empty());
        for c in &merged {
            let t = truth[&c.id];
            assert!(c.count >= t && c.count - c.error <= t, "{c:?} true {t}");
            assert!(c.error <= total / 16, "{c:?}");
        }
        assert!(merged.windows(2).all(|w| w[0].count >= w[1].count));
    }

    #[test]
    fn a_million_distinct_values_hold_no_more_than_the_capacity() {
        let mut sketch = Sketch::new(64);
        for id in 0..1_000_000u64 {
            add(&mut sketch, id.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1);
        }
        assert_eq!(sketch.counters.len(), 64);
        assert_eq!(sketch.at.len(), 64);
        assert!(sketch.at.capacity() < 256, "{}", sketch.at.capacity());
        assert_eq!(sketch.total(), 1_000_000);
        assert!(sketch.counters.iter().all(|c| c.error <= 1_000_000 / 64));
    }

    #[test]
    fn no_counters_counts_only_the_total() {
        let mut sketch = Sketch::new(0);
        add(&mut sketch, 1, 5);
        assert_eq!((sketch.total(), sketch.counters.len()), (5, 0));
        assert!(merge([&sketch], 10).is_empty());
    }
}
