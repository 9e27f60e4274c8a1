//! Holds: a rule whose hits are held at the request and settled at the response, as a token
//! budget needs when the cost of a request is known only once its response is done. The
//! request-time call names a request (by a descriptor entry such as `x-request-id`) and holds an
//! estimate: admitted only if the counter's count, every hold outstanding and the estimate fit
//! the limit. The response-time call carries an entry only the route configuration adds (the
//! rule's `settle` entry: no client can forge it) and settles: it charges the real cost in full
//! (whatever the estimate was) and releases the hold, in one step.
//!
//! A request id is the client's word, so nothing rests on it but the pairing of the two calls:
//! a request-time call naming an id the counter knows (held, settled or lapsed) is refused and
//! charges nothing; a settle that finds no hold of its id charges its cost in full. Nothing is
//! ever admitted uncharged.
//!
//! Each counter keeps a table of its holds beside it: per request, its entry (held, settled, or
//! lapsed: a hold that expired unsettled), and the total held. Holds are due when they expire,
//! marks of settled and lapsed requests when they are forgotten (one time to live after): each
//! call first tidies at most `MOST_DUE` holds and `MOST_DUE` marks that are due, so no call scans
//! the table. A hold lives its rule's time to live, across a window's end (its settle is charged
//! in the window it comes in); expired, it is charged its estimate or released, as its rule
//! says. A table keeps at most its rule's `most` entries: a new hold past them makes room by
//! forgetting the oldest mark, and only a table full of holds refuses one. Mirrored by the hold
//! section of `lua/check.lua`, which keeps the table in the hash `<key>~h` and the sorted sets
//! `<key>~e` (holds) and `<key>~m` (marks). A request holds on a counter once, however many of
//! its descriptors name it (`RuleSet::plan` sees to it): the stores decide a held counter once
//! per request.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::algorithm::{Algorithm, Ask, Verdict, window};
use super::outcome::{HoldSeen, Outcome};

/// The most due holds, and the most due marks, one call tidies.
pub(crate) const MOST_DUE: usize = 16;

/// The identity of a request for its hold: the first 16 bytes of the SHA-256 of the value that
/// names it, the same on every replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HoldId([u8; 16]);

impl HoldId {
    pub fn of(value: &[u8]) -> HoldId {
        let digest = Sha256::digest(value);
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        HoldId(id)
    }

    /// Its 32 lowercase hex digits: sorted as the ids are.
    pub fn hex(self) -> String {
        let mut out = String::with_capacity(32);
        for b in self.0 {
            write!(out, "{b:02x}").expect("writing to a String succeeds");
        }
        out
    }
}

/// What a held rule's item asks of its counter: hold `estimate` for the request `id` (the
/// request-time call) or settle its hold at the item's hits (the response-time call).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HoldAsk {
    pub id: HoldId,
    /// What a hold takes (at least 1 is needed to fit).
    pub estimate: u64,
    /// How long a hold lives at most, and a mark after it.
    pub ttl_ms: u64,
    pub on_expiry: OnExpiry,
    /// The most entries (holds and marks) the counter's table keeps.
    pub most: u32,
    /// The call is the response-time call: it settles.
    pub settle: bool,
}

/// What an expired hold does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnExpiry {
    /// Its estimate is charged: a request that never settles costs its estimate.
    #[default]
    Charge,
    /// Nothing is charged: a request that never settles costs nothing.
    Release,
}

impl OnExpiry {
    pub fn parse(name: &str) -> Option<OnExpiry> {
        match name {
            "release" => Some(OnExpiry::Release),
            "charge" => Some(OnExpiry::Charge),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OnExpiry::Release => "release",
            OnExpiry::Charge => "charge",
        }
    }
}

/// One request's entry in a counter's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Holds `amount` until `due`.
    Held { amount: u64, due: u64 },
    /// Settled; forgotten at `due`.
    Settled { due: u64 },
    /// Its hold expired unsettled, which charged `charged`; forgotten at `due`.
    Lapsed { charged: u64, due: u64 },
}

impl Entry {
    fn due(self) -> u64 {
        match self {
            Entry::Held { due, .. } | Entry::Settled { due } | Entry::Lapsed { due, .. } => due,
        }
    }
}

/// A counter's holds and marks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    entries: HashMap<HoldId, Entry>,
    /// Holds by when they expire.
    holds: BTreeSet<(u64, HoldId)>,
    /// Marks by when they are forgotten.
    marks: BTreeSet<(u64, HoldId)>,
    /// What the holds outstanding hold.
    held: u64,
}

impl Table {
    /// Holds and marks kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the holds outstanding hold.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Holds outstanding.
    pub fn holds(&self) -> usize {
        self.holds.len()
    }

    /// When the next hold is due, if one is outstanding.
    pub fn next_due(&self) -> Option<u64> {
        self.holds.first().map(|(due, _)| *due)
    }

    fn put(&mut self, id: HoldId, entry: Entry) {
        self.remove(id);
        match entry {
            Entry::Held { .. } => self.holds.insert((entry.due(), id)),
            _ => self.marks.insert((entry.due(), id)),
        };
        self.entries.insert(id, entry);
    }

    fn remove(&mut self, id: HoldId) {
        if let Some(old) = self.entries.remove(&id) {
            match old {
                Entry::Held { .. } => self.holds.remove(&(old.due(), id)),
                _ => self.marks.remove(&(old.due(), id)),
            };
        }
    }

    /// Forgets the oldest mark, if there is one.
    pub(crate) fn forget_a_mark(&mut self) -> bool {
        self.forget_oldest(&[])
    }

    /// Forgets the oldest mark not in `fresh` or, if there is none, the first of `fresh` (made
    /// by this call, all due at once: the least id), if there is one.
    fn forget_oldest(&mut self, fresh: &[HoldId]) -> bool {
        let oldest = self
            .marks
            .iter()
            .find(|(_, id)| !fresh.contains(id))
            .or_else(|| self.marks.iter().find(|(_, id)| fresh.contains(id)))
            .map(|(_, id)| *id);
        match oldest {
            Some(id) => {
                self.remove(id);
                true
            }
            None => false,
        }
    }
}

/// Where a held counter stands in one call, before its item's own change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tidied {
    /// What the item does.
    pub outcome: Outcome,
    /// Holds found expired.
    pub expired: u64,
    /// What the counter is charged whatever the answer: the estimates of expired holds (when
    /// their rule charges them), and a settle's hits.
    pub charge: u64,
    /// What the holds outstanding hold, the item's own aside.
    pub held: u64,
}

/// Tidies `table` at `now` (ms) for a call of `held`, settling the item's hold if it settles,
/// and says what the item does and is charged (`hits`: its real cost, for a settle). A hold is
/// taken by `take`, if the request is admitted.
pub(crate) fn tidy(table: &mut Table, held: &HoldAsk, hits: u64, now: u64) -> Tidied {
    let keep = held.ttl_ms;
    let due = |set: &BTreeSet<(u64, HoldId)>| -> Vec<HoldId> {
        set.iter()
            .take_while(|(at, _)| *at <= now)
            .take(MOST_DUE)
            .map(|(_, id)| *id)
            .collect()
    };
    let (mut expired, mut charge) = (0, 0);
    // Marks made by this call: never the oldest to forget.
    let mut fresh = Vec::new();
    for id in due(&table.holds) {
        if let Some(Entry::Held { amount, .. }) = table.entries.get(&id).copied() {
            table.held -= amount;
            let charged = match held.on_expiry {
                OnExpiry::Charge => amount,
                OnExpiry::Release => 0,
            };
            charge += charged;
            expired += 1;
            table.put(
                id,
                Entry::Lapsed {
                    charged,
                    due: now + keep,
                },
            );
            fresh.push(id);
        }
    }
    for id in due(&table.marks) {
        table.remove(id);
    }
    let own = table.entries.get(&held.id).copied();
    let outcome = if held.settle {
        match own {
            Some(Entry::Held { amount, .. }) => {
                table.held -= amount;
                charge += hits;
                table.put(held.id, Entry::Settled { due: now + keep });
                Outcome::Settle
            }
            Some(Entry::Lapsed { charged, .. }) => {
                charge += hits.saturating_sub(charged);
                table.put(held.id, Entry::Settled { due: now + keep });
                Outcome::Unheld
            }
            Some(Entry::Settled { .. }) | None => {
                charge += hits;
                Outcome::Unheld
            }
        }
    } else if own.is_some() {
        Outcome::Reused
    } else if table.len() >= held.most as usize && !table.forget_oldest(&fresh) {
        Outcome::Full
    } else {
        Outcome::Hold
    };
    Tidied {
        outcome,
        expired,
        charge,
        held: table.held,
    }
}

/// Takes the hold of `held` in `table` (tidied for the call), due at `due`.
pub(crate) fn take(table: &mut Table, held: &HoldAsk, due: u64) {
    table.put(
        held.id,
        Entry::Held {
            amount: held.estimate,
            due,
        },
    );
    table.held += held.estimate;
}

/// What a call does to a held window counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HoldStep {
    pub verdict: Verdict,
    /// The counter after what it is charged whatever the answer (expired estimates, a settle),
    /// when it is charged anything.
    pub charged: Option<window::WindowStep>,
    /// When the hold taken once the request is admitted is due, if one is taken.
    pub take: Option<u64>,
}

/// Evaluates a held window counter of `algorithm` for `ask` (its hits: a settle's real cost) at
/// the store's clock, `stored` its state, `table` its holds (tidied here whatever the answer).
/// The verdict's remaining counts the holds outstanding; a settle is never over, and reports
/// the counter as it leaves it. Nothing it charges is ever taken back (`charged` is 0): a
/// settle's caller that is not answered has its cost charged all the same. A request refused
/// while the holds in flight leave no room for its own, or by a table full of holds, is told
/// to try again when the next hold is due; one refused by the hold itself (`Outcome::refused`)
/// is told what is left.
pub(crate) fn evaluate(
    algorithm: Algorithm,
    ask: &Ask,
    held: &HoldAsk,
    stored: Option<window::State>,
    table: &mut Table,
) -> HoldStep {
    let now = ask.now_ms;
    let tidied = tidy(table, held, ask.hits, now);
    // Held counters count at the clock, never at an instant a request names.
    let base = Ask {
        at_ms: now,
        refund: false,
        step: crate::limiter::ItemStep::Hits,
        ..*ask
    };
    let room = base.limit.saturating_sub(tidied.held);
    let charged = (tidied.charge > 0).then(|| {
        window::evaluate(
            algorithm,
            &Ask {
                limit: room,
                hits: tidied.charge,
                always: true,
                ..base
            },
            stored,
        )
    });
    let state = charged.map(|c| c.next).or(stored);
    let seen = HoldSeen {
        outcome: tidied.outcome,
        expired: tidied.expired,
    };
    let holding = !held.settle;
    let mut verdict = window::evaluate(
        algorithm,
        &Ask {
            limit: room,
            hits: if holding { held.estimate } else { 0 },
            always: !holding,
            ..base
        },
        state,
    )
    .verdict;
    if holding {
        // Over for the holds in flight alone (or a table full of them): room comes back when
        // the next hold is due.
        let without = window::evaluate(
            algorithm,
            &Ask {
                hits: held.estimate,
                always: false,
                ..base
            },
            state,
        )
        .verdict;
        let waits = tidied.outcome == Outcome::Full || (verdict.over && !without.over);
        if let Some(due) = table.next_due().filter(|_| waits) {
            let wait = due.saturating_sub(now).max(1);
            verdict.reset_before_ms = verdict.reset_before_ms.min(wait);
            verdict.reset_after_ms = verdict.reset_after_ms.min(wait);
        }
        verdict.over |= tidied.outcome.refused();
    } else {
        verdict.over = false;
    }
    verdict.charged = 0;
    verdict.hold = Some(seen);
    let take = (tidied.outcome == Outcome::Hold && !verdict.over).then_some(now + held.ttl_ms);
    HoldStep {
        verdict,
        charged,
        take,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: &str, estimate: u64) -> HoldAsk {
        HoldAsk {
            id: HoldId::of(id.as_bytes()),
            estimate,
            ttl_ms: 1_000,
            on_expiry: OnExpiry::Charge,
            most: 4,
            settle: false,
        }
    }

    fn settle(h: HoldAsk) -> HoldAsk {
        HoldAsk { settle: true, ..h }
    }

    fn holding(table: &mut Table, h: &HoldAsk, now: u64) -> Tidied {
        let tidied = tidy(table, h, 0, now);
        if tidied.outcome == Outcome::Hold {
            take(table, h, now + h.ttl_ms);
        }
        tidied
    }

    #[test]
    fn a_request_holds_settles_once_and_its_id_is_never_held_again() {
        let mut table = Table::default();
        let a = held("a", 100);
        let first = holding(&mut table, &a, 10);
        assert_eq!(
            (first.outcome, first.charge, first.held),
            (Outcome::Hold, 0, 0)
        );
        assert_eq!(table.held(), 100);
        let again = tidy(&mut table, &a, 0, 15);
        assert_eq!(
            (again.outcome, again.charge, again.held),
            (Outcome::Reused, 0, 100),
            "a request-time call naming a held id is refused"
        );
        let settled = tidy(&mut table, &settle(a), 30, 20);
        assert_eq!(
            (settled.outcome, settled.charge, settled.held),
            (Outcome::Settle, 30, 0)
        );
        let twice = tidy(&mut table, &settle(a), 30, 30);
        assert_eq!(
            (twice.outcome, twice.charge),
            (Outcome::Unheld, 30),
            "a settle that finds no hold is charged in full"
        );
        assert_eq!(tidy(&mut table, &a, 0, 40).outcome, Outcome::Reused);
        let stranger = tidy(&mut table, &settle(held("b", 100)), 70, 50);
        assert_eq!((stranger.outcome, stranger.charge), (Outcome::Unheld, 70));
        assert_eq!(table.len(), 1, "a settle of an unknown id leaves no mark");
    }

    #[test]
    fn an_expired_hold_is_charged_or_released_and_its_late_settle_charged_the_rest() {
        for (on_expiry, charged, late) in [(OnExpiry::Charge, 100, 40), (OnExpiry::Release, 0, 140)]
        {
            let mut table = Table::default();
            let a = HoldAsk {
                on_expiry,
                ..held("a", 100)
            };
            holding(&mut table, &a, 0);
            let b = HoldAsk {
                on_expiry,
                ..held("b", 1)
            };
            let later = tidy(&mut table, &b, 0, 1_000);
            assert_eq!((later.expired, later.charge, later.held), (1, charged, 0));
            let settled = tidy(&mut table, &settle(a), 140, 1_500);
            assert_eq!((settled.outcome, settled.charge), (Outcome::Unheld, late));
        }
    }

    #[test]
    fn a_hold_lives_its_time_to_live_whatever_the_window() {
        let mut table = Table::default();
        holding(&mut table, &held("a", 100), 0);
        let next = tidy(&mut table, &held("b", 1), 0, 999);
        assert_eq!((next.expired, next.held), (0, 100));
    }

    #[test]
    fn marks_make_room_for_new_holds_and_only_holds_fill_a_table() {
        let mut table = Table::default();
        for i in 0..4 {
            let h = held(&i.to_string(), 1);
            holding(&mut table, &h, i);
            if i < 2 {
                tidy(&mut table, &settle(h), 1, 10 + i);
            }
        }
        assert_eq!((table.len(), table.holds()), (4, 2));
        assert_eq!(
            holding(&mut table, &held("x", 1), 20).outcome,
            Outcome::Hold
        );
        assert_eq!(
            tidy(&mut table, &held("0", 1), 0, 21).outcome,
            Outcome::Hold,
            "mark 0 went first"
        );
        take(&mut table, &held("0", 1), 1_021);
        let full = tidy(&mut table, &held("y", 1), 0, 22);
        assert_eq!((full.outcome, table.holds()), (Outcome::Full, 4));
        assert_eq!(table.next_due(), Some(1_002));
    }

    #[test]
    fn a_table_whose_holds_all_expired_takes_a_new_hold() {
        let mut table = Table::default();
        for i in 0..4 {
            holding(&mut table, &held(&i.to_string(), 1), 0);
        }
        let new = tidy(&mut table, &held("x", 1), 0, 1_500);
        assert_eq!((new.outcome, new.expired), (Outcome::Hold, 4));
        assert_eq!(table.len(), 3, "a mark the call made went");
    }

    #[test]
    fn a_call_tidies_at_most_most_due_holds() {
        let mut big = Table::default();
        let many = HoldAsk {
            most: 100,
            ..held("", 1)
        };
        for i in 0..(MOST_DUE + 3) {
            let h = HoldAsk {
                id: HoldId::of(i.to_string().as_bytes()),
                ..many
            };
            holding(&mut big, &h, 0);
        }
        let seen = tidy(
            &mut big,
            &HoldAsk {
                id: HoldId::of(b"y"),
                ..many
            },
            0,
            2_000,
        );
        assert_eq!(seen.expired, MOST_DUE as u64);
        assert_eq!(seen.held, 3);
    }

    #[test]
    fn a_reply_code_reads_back() {
        let seen = HoldSeen {
            outcome: Outcome::Unheld,
            expired: 3,
        };
        assert_eq!(HoldSeen::of_code(4 + 8 * 3), Some(seen));
        assert_eq!(HoldSeen::of_code(0), None);
        assert_eq!(HoldSeen::of_code(6), None);
    }
}
