//! The replicas live now, for `scope: split`: each replica beats once a second in the store (a
//! sorted set of replica ids, each live until `LIVE_FOR` after its last beat on the store's
//! clock) and reads back the ids live now, sorted. A split limit is divided by their number,
//! and the remainder goes one each to the first replicas in that order, so that the shares add
//! up to the limit exactly once every replica has read the same set.
//!
//! The replicas together admit at most the limit in a window, whatever membership does:
//!
//! - A replica uses a share only within `OWN_LIFE` of sending the last beat that counted it,
//!   shorter than the `LIVE_FOR` the others give it: one cut off from the store or paused stops
//!   admitting before any other can count it gone. Its split requests are then answered by
//!   `--on-store-error`, as those of a replica that never read the replicas.
//! - Shares only shrink within a window: a replica divides by the most replicas it counted from
//!   the start of the window (the count it had read then included) to now, and gives the
//!   remainder only while the set it read has not changed since. A replica that leaves or dies
//!   frees its share at the next window.
//! - A replica has a share in a window only if it was counted without a break from
//!   `MEMBER_BEFORE` before the window's start, so that every other replica's count at the start
//!   included it: a newcomer, a restarted replica, or one whose beat lapsed before the window
//!   began, has a share of 0 until the next window, unless no other replica was live at all since
//!   the window began (the store keeps the lapsed beats for the longest split window).
//!
//! The window is the limit's (a fixed or calendar window), or for the other algorithms the span
//! whose hits still weigh on a decision (`Limit::counted_since`). On the embedded store there is
//! one replica, with the whole limit.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

/// How often a replica beats.
pub const BEAT: Duration = Duration::from_secs(1);
/// How long a beat keeps a replica counted by the others.
pub const LIVE_FOR: Duration = Duration::from_secs(3);
/// How long a beat lets its replica use its shares, from when it was sent: shorter than
/// `LIVE_FOR` by a beat, so that a replica has stopped before another can count it gone.
pub const OWN_LIFE: Duration = Duration::from_secs(2);
/// How long before a window's start a replica must have been counted without a break to have a
/// share in it: every other replica's count in force at the start was read within `OWN_LIFE` of
/// it; a beat more for the replicas' clocks.
const MEMBER_BEFORE_MS: u64 = (OWN_LIFE.as_millis() + BEAT.as_millis()) as u64;
/// Counts kept; the oldest two are merged past it, keeping the larger.
const COUNTS_KEPT: usize = 32;
/// Spells of unbroken membership kept; the oldest is dropped past it.
const SPELLS_KEPT: usize = 8;
/// The place of a count merged from several: no remainder is given on it.
const MERGED: u32 = u32::MAX;

/// This replica's id and what it read of the live replicas.
#[derive(Clone)]
pub struct Peers(Arc<Shared>);

struct Shared {
    id: String,
    /// Whether it counts alone (the embedded store): always the whole limit.
    alone: bool,
    view: ArcSwap<View>,
}

/// What the beats told a replica: written by its beat alone, read by every split request.
#[derive(Clone, Default)]
struct View {
    /// When the last beat that counted this replica was sent; `None` until one did.
    renewed: Option<Instant>,
    /// The counts read, oldest first: each in force from `at` to the next.
    counts: Vec<Count>,
    /// Spells during which the others counted this replica without a break, oldest first.
    spells: Vec<Spell>,
}

/// A spell of unbroken membership, in ms of this replica's clock.
#[derive(Clone, Copy, Debug)]
struct Spell {
    from: u64,
    until: u64,
    /// Until when another replica was counted, as the spell's first beat read it.
    others_before: u64,
}

impl Spell {
    /// Whether this spell gives its replica a share in the window that began at `since_ms`:
    /// the spell reaches into the window, and either began `MEMBER_BEFORE_MS` before it (every
    /// other replica counted this one when the window began) or began with no other replica
    /// counted since the window began (every replica joining later counts this one).
    fn gives_a_share(&self, since_ms: u64) -> bool {
        self.until >= since_ms
            && (self.from.saturating_add(MEMBER_BEFORE_MS) <= since_ms
                || self.others_before <= since_ms)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Count {
    at: u64,
    count: u32,
    place: u32,
}

/// One beat's answer: the live replicas and when another one was last counted.
pub(crate) struct Beat {
    /// When it was sent, on the monotonic clock and in ms of this replica's clock.
    pub sent: Instant,
    pub sent_ms: u64,
    /// When the answer came, in ms of this replica's clock.
    pub received_ms: u64,
    /// How many replicas are live, and this one's place among them.
    pub count: u32,
    pub place: u32,
    /// When the last other replica's beat lapses (lapsed), in ms of this replica's clock.
    pub others_until: u64,
}

impl Peers {
    /// A replica that counts alone: the embedded store's.
    pub(crate) fn alone() -> Peers {
        Peers::with(true)
    }

    /// A replica that has not read the live replicas yet, with an id of its own.
    pub(crate) fn unknown() -> Peers {
        Peers::with(false)
    }

    fn with(alone: bool) -> Peers {
        let random = std::hash::RandomState::new().hash_one((std::process::id(), super::unix_ms()));
        Peers(Arc::new(Shared {
            id: format!("{random:016x}"),
            alone,
            view: ArcSwap::default(),
        }))
    }

    /// This replica's id in the store's set.
    pub(crate) fn id(&self) -> &str {
        &self.0.id
    }

    /// Live replicas as last read: 0 until read.
    pub fn count(&self) -> u32 {
        if self.0.alone {
            return 1;
        }
        self.0.view.load().counts.last().map_or(0, |c| c.count)
    }

    /// Records a beat that counted this replica.
    pub(crate) fn saw(&self, beat: &Beat) {
        let mut view = View::clone(&self.0.view.load());
        let before = view.counts.last().map(|c| c.count);
        view.renewed = Some(beat.sent);
        let until = beat.sent_ms + OWN_LIFE.as_millis() as u64;
        match view.spells.last_mut() {
            Some(spell) if spell.until >= beat.sent_ms => spell.until = spell.until.max(until),
            _ => {
                view.spells.push(Spell {
                    from: beat.received_ms,
                    until,
                    others_before: beat.others_until,
                });
                if view.spells.len() > SPELLS_KEPT {
                    view.spells.remove(0);
                }
            }
        }
        let count = Count {
            at: beat.received_ms,
            count: beat.count,
            place: beat.place,
        };
        if view
            .counts
            .last()
            .is_none_or(|last| (last.count, last.place) != (count.count, count.place))
        {
            view.counts.push(count);
            if view.counts.len() > COUNTS_KEPT {
                let merged = Count {
                    at: view.counts[0].at,
                    count: view.counts[0].count.max(view.counts[1].count),
                    place: MERGED,
                };
                view.counts.splice(0..2, [merged]);
            }
        }
        self.0.view.store(Arc::new(view));
        if before != Some(beat.count) {
            tracing::info!(
                replicas = beat.count,
                "live replicas changed: split limits are divided by {} from their next window",
                beat.count
            );
        }
    }

    /// This replica's share of `total` in the window that began at `since_ms` (ms of this
    /// replica's clock): `None` while it may not use one (never counted, or its last beat
    /// past `OWN_LIFE`); 0 in a window none of its spells gives it a share in; else the total
    /// divided by the most replicas counted since the window began, with the remainder one each
    /// to the first replicas while the set read has not changed since.
    pub fn share(&self, total: u32, since_ms: u64, now: Instant) -> Option<u32> {
        if self.0.alone {
            return Some(total);
        }
        let view = self.0.view.load();
        let renewed = view.renewed?;
        if now.saturating_duration_since(renewed) >= OWN_LIFE {
            return None;
        }
        if !view
            .spells
            .iter()
            .any(|spell| spell.gives_a_share(since_ms))
        {
            return Some(0);
        }
        // The count in force when the window began, and every one read since.
        let first = view
            .counts
            .iter()
            .rposition(|c| c.at <= since_ms)
            .unwrap_or(0);
        let read = &view.counts[first..];
        let most = read.iter().map(|c| c.count).max().filter(|&n| n > 0)?;
        let remainder = match read {
            [only] if only.place != MERGED => u32::from(only.place < total % most),
            _ => 0,
        };
        Some(total / most + remainder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000;

    fn beat(peers: &Peers, at_ms: u64, count: u32, place: u32, others_until: u64) {
        peers.saw(&Beat {
            sent: Instant::now(),
            sent_ms: at_ms,
            received_ms: at_ms + 5,
            count,
            place,
            others_until,
        });
    }

    /// A replica counted `count` strong, `place`th, from time 0 to `to_ms`, beating each second.
    fn counted(count: u32, place: u32, to_ms: u64) -> Peers {
        let peers = Peers::unknown();
        for at in (0..=to_ms).step_by(S as usize) {
            beat(&peers, at, count, place, u64::MAX);
        }
        peers
    }

    #[test]
    fn the_shares_of_replicas_that_read_the_same_set_add_up_to_the_limit() {
        for count in 1..=7 {
            for total in [0, 1, 5, 10, 99, u32::MAX] {
                let sum: u64 = (0..count)
                    .map(|place| {
                        let peers = counted(count, place, 60 * S);
                        u64::from(peers.share(total, 50 * S, Instant::now()).expect("read"))
                    })
                    .sum();
                assert_eq!(sum, u64::from(total), "{total} among {count}");
            }
        }
    }

    #[test]
    fn a_replica_that_has_read_no_count_has_no_share() {
        let now = Instant::now();
        assert_eq!(Peers::unknown().share(100, 0, now), None);
        assert_eq!(Peers::alone().share(100, 0, now), Some(100));
    }

    #[test]
    fn a_share_is_used_only_within_its_own_life_of_the_last_beat() {
        let peers = counted(2, 0, 60 * S);
        let sent = Instant::now();
        assert_eq!(peers.share(100, 50 * S, sent), Some(50));
        assert_eq!(peers.share(100, 50 * S, sent + OWN_LIFE), None);
    }

    #[test]
    fn a_share_does_not_grow_within_the_window_when_a_replica_leaves() {
        let peers = counted(2, 1, 60 * S);
        beat(&peers, 61 * S, 1, 0, u64::MAX);
        let now = Instant::now();
        assert_eq!(peers.share(100, 50 * S, now), Some(50));
        // The next window began with one replica counted.
        assert_eq!(peers.share(100, 61 * S + 10, now), Some(100));
    }

    #[test]
    fn a_share_shrinks_at_once_when_a_replica_joins_and_keeps_no_remainder() {
        let peers = counted(2, 0, 60 * S);
        beat(&peers, 61 * S, 3, 0, u64::MAX);
        let now = Instant::now();
        assert_eq!(peers.share(101, 50 * S, now), Some(33));
    }

    #[test]
    fn a_newcomer_has_no_share_in_a_window_others_counted_in_until_the_next() {
        let peers = Peers::unknown();
        for at in [60 * S, 61 * S, 62 * S, 63 * S, 64 * S] {
            beat(&peers, at, 2, 1, at + 3 * S);
        }
        let now = Instant::now();
        assert_eq!(peers.share(100, 50 * S, now), Some(0));
        assert_eq!(peers.share(100, 60 * S, now), Some(0));
        assert_eq!(peers.share(100, 64 * S, now), Some(50));
    }

    #[test]
    fn a_newcomer_alone_since_the_window_began_has_the_limit() {
        let peers = Peers::unknown();
        beat(&peers, 60 * S, 1, 0, 40 * S);
        assert_eq!(peers.share(100, 50 * S, Instant::now()), Some(100));
        // A replica that lapsed within the window admitted in it.
        let peers = Peers::unknown();
        beat(&peers, 60 * S, 1, 0, 55 * S);
        assert_eq!(peers.share(100, 50 * S, Instant::now()), Some(0));
    }

    #[test]
    fn a_replica_alone_when_the_window_began_keeps_a_share_when_others_join() {
        let peers = Peers::unknown();
        beat(&peers, 60 * S, 1, 0, 0);
        beat(&peers, 61 * S, 2, 0, 64 * S);
        assert_eq!(peers.share(100, 50 * S, Instant::now()), Some(50));
    }

    #[test]
    fn a_break_after_the_window_began_keeps_the_share_in_it_and_costs_the_next() {
        let peers = counted(2, 0, 60 * S);
        // Paused or cut off for 5 s, then counted again.
        beat(&peers, 65 * S, 2, 0, u64::MAX);
        let now = Instant::now();
        assert_eq!(peers.share(100, 50 * S, now), Some(50));
        assert_eq!(peers.share(100, 64 * S, now), Some(0));
        beat(&peers, 66 * S, 2, 0, u64::MAX);
        beat(&peers, 67 * S, 2, 0, u64::MAX);
        beat(&peers, 68 * S, 2, 0, u64::MAX);
        assert_eq!(peers.share(100, 68 * S + 100, now), Some(50));
    }

    #[test]
    fn the_counts_kept_are_bounded_and_merged_to_the_larger() {
        let peers = Peers::unknown();
        for i in 0..200u64 {
            beat(&peers, i * S, 2 + (i % 2) as u32, 0, u64::MAX);
        }
        let view = peers.0.view.load();
        assert!(view.counts.len() <= COUNTS_KEPT);
        assert!(view.spells.len() <= SPELLS_KEPT);
        assert_eq!(peers.share(90, 10 * S, Instant::now()), Some(30));
    }

    /// Replicas that all were counted before a window read sets holding every one of them, some
    /// with replicas more (newcomers, lapsing ones): their shares never add up past the limit.
    #[test]
    fn shares_read_from_different_sets_holding_every_member_add_up_to_at_most_the_limit() {
        for members in 1..=4u32 {
            for extra in 0..=3u32 {
                for total in 0..=20u32 {
                    // Members are the ids 0..members·2 step 2, extras interleave anywhere.
                    for mask in 0..(1u32 << extra) {
                        let mut sum = 0;
                        for m in 0..members {
                            let mut set: Vec<u32> = (0..members).map(|i| i * 2).collect();
                            for e in 0..extra {
                                if (mask >> e) & 1 == 1 || m % 2 == 0 {
                                    set.push(e * 3 + 1);
                                }
                            }
                            set.sort_unstable();
                            set.dedup();
                            let place = set.iter().position(|&id| id == m * 2).expect("member");
                            let peers = counted(set.len() as u32, place as u32, 60 * S);
                            sum += peers.share(total, 50 * S, Instant::now()).expect("read");
                        }
                        assert!(
                            sum <= total,
                            "{members} members, {extra} more: {sum} of {total}"
                        );
                    }
                }
            }
        }
    }
}
