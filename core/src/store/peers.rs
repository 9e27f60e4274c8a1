//! The replicas live now, for `scope: split`: each replica beats once a second in the store (a
//! sorted set of replica ids, each live until `LIVE_FOR` after its last beat on the store's
//! clock) and reads back the ids live now, sorted. A split limit is divided by their number,
//! and the remainder goes one each to the first replicas in that order, so that the shares add
//! up to the limit exactly once every replica has read the same set.
//!
//! While the set changes, the replicas' shares add up to more than the limit for at most one
//! beat: a replica that joins takes its share at once, the others theirs at their next beat. A
//! replica that leaves in good order takes its beat back, and the others grow theirs at their next
//! beat; one that dies is counted until its beat lapses (`LIVE_FOR`), the others keeping their
//! smaller shares meanwhile. A replica that cannot reach the store keeps the count it last read;
//! one that has never read any has no share: its split requests are answered by
//! `--on-store-error`, as those of a store it cannot reach. On the embedded store there is one
//! replica.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often a replica beats.
pub const BEAT: Duration = Duration::from_secs(1);
/// How long a beat keeps a replica counted.
pub const LIVE_FOR: Duration = Duration::from_secs(3);

/// This replica's id and the live replicas it last read.
#[derive(Clone)]
pub struct Peers(Arc<Shared>);

struct Shared {
    id: String,
    /// The live replicas (high 32 bits, 0 until read) and this one's place among them.
    seen: AtomicU64,
}

impl Peers {
    /// A replica that counts alone: the embedded store's.
    pub(crate) fn alone() -> Peers {
        let peers = Peers::unknown();
        peers.saw(1, 0);
        peers
    }

    /// A replica that has not read the live replicas yet, with an id of its own.
    pub(crate) fn unknown() -> Peers {
        let random = std::hash::RandomState::new().hash_one((std::process::id(), super::unix_ms()));
        Peers(Arc::new(Shared {
            id: format!("{random:016x}"),
            seen: AtomicU64::new(0),
        }))
    }

    /// This replica's id in the store's set.
    pub(crate) fn id(&self) -> &str {
        &self.0.id
    }

    /// Live replicas as last read: 0 until read.
    pub fn count(&self) -> u32 {
        (self.0.seen.load(Ordering::Relaxed) >> 32) as u32
    }

    /// Records that `count` replicas are live, this one `place`th among them (from 0).
    pub(crate) fn saw(&self, count: u32, place: u32) {
        let before = self
            .0
            .seen
            .swap(u64::from(count) << 32 | u64::from(place), Ordering::Relaxed);
        if before >> 32 != u64::from(count) {
            tracing::info!(
                replicas = count,
                "live replicas changed: split limits are divided by {count}"
            );
        }
    }

    /// This replica's share of `total`: a part of it as even as can be, the remainder going
    /// one each to the first replicas in the set's order; `None` before the replicas are read.
    pub fn share(&self, total: u32) -> Option<u32> {
        let seen = self.0.seen.load(Ordering::Relaxed);
        let (count, place) = ((seen >> 32) as u32, seen as u32);
        if count == 0 {
            return None;
        }
        Some(total / count + u32::from(place < total % count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shares_of_every_replica_add_up_to_the_limit() {
        for count in 1..=7 {
            for total in [0, 1, 5, 10, 99, u32::MAX] {
                let sum: u64 = (0..count)
                    .map(|place| {
                        let peers = Peers::unknown();
                        peers.saw(count, place);
                        u64::from(peers.share(total).expect("read"))
                    })
                    .sum();
                assert_eq!(sum, u64::from(total), "{total} among {count}");
            }
        }
    }

    #[test]
    fn a_replica_that_has_read_no_count_has_no_share() {
        assert_eq!(Peers::unknown().share(100), None);
        assert_eq!(Peers::alone().share(100), Some(100));
    }
}
