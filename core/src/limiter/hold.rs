//! Holds: a rule whose hits are held at the request and settled at the response, as a token
//! budget needs when the cost of a request is known only once its response is done. The first
//! call that names a request (by a descriptor entry such as `x-request-id`) holds an estimate:
//! admitted only if the counter's count, every hold outstanding and the estimate fit the limit.
//! The second call for the same request settles: it charges the real cost in full (whatever the
//! estimate was) and releases the hold, in one step. A third charges nothing.
//!
//! Each counter keeps a table of its holds beside it: per request, its entry (held, settled, or
//! lapsed: a hold that expired unsettled), and the total held in the window the holds count in.
//! Entries are due at a time (a hold's expiry, a mark's end): each call first tidies at most
//! `MOST_DUE` entries that are due, so no call scans the table. A hold expires at the earliest of
//! its rule's time to live and the end of its window (a fixed window; a sliding window's at most
//! one window); expired, it is released (nothing charged) or charged its estimate, as its rule
//! says. Marks of settled and lapsed requests stay for one time to live more, so that a second
//! settle charges nothing and a late one is charged in full. Mirrored by the hold section of
//! `lua/check.lua`, which keeps the table in the hash `<key>~h` and the sorted set `<key>~e`.
//! A request holds on a counter once, however many of its descriptors name it (`RuleSet::plan`
//! sees to it): the stores decide a held counter once per request.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::algorithm::{Algorithm, Ask, Verdict, window};

/// The most due entries one call tidies.
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

/// What a held rule's item asks of its counter: hold `estimate` for the request `id` or, when
/// that request holds already, settle it at the item's hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Held {
    pub id: HoldId,
    /// What a hold takes (at least 1 is needed to fit).
    pub estimate: u64,
    /// How long a hold lives at most, and a mark after it.
    pub ttl_ms: u64,
    pub on_expiry: OnExpiry,
    /// The most entries (holds and marks) the counter's table keeps: a hold past them is over.
    pub most: u32,
}

/// What an expired hold does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnExpiry {
    /// Nothing is charged: a request that never settles costs nothing.
    #[default]
    Release,
    /// Its estimate is charged (in its window only): a request that never settles costs its
    /// estimate.
    Charge,
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

/// What a held item did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Held its estimate (if admitted; over when it does not fit).
    Hold,
    /// Settled its hold: charged its hits, released the hold.
    Settle,
    /// A second settle: charged nothing.
    Duplicate,
    /// A settle whose hold had expired: charged its hits in full.
    Unheld,
    /// The counter's table was full: over, nothing held.
    Full,
}

impl Outcome {
    /// The outcome of its code in the check script's reply (1 to 5, in the order above).
    pub(crate) fn of_code(code: u64) -> Option<Outcome> {
        Some(match code {
            1 => Outcome::Hold,
            2 => Outcome::Settle,
            3 => Outcome::Duplicate,
            4 => Outcome::Unheld,
            5 => Outcome::Full,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Hold => "hold",
            Outcome::Settle => "settle",
            Outcome::Duplicate => "duplicate",
            Outcome::Unheld => "unheld",
            Outcome::Full => "full",
        }
    }
}

/// What a call saw of a held counter: what its item did, and how many holds it found expired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub outcome: Outcome,
    pub expired: u64,
}

impl Seen {
    /// What the check script's reply says as the outcome's code plus 8 per expired hold.
    pub(crate) fn of_code(code: u64) -> Option<Seen> {
        Some(Seen {
            outcome: Outcome::of_code(code % 8)?,
            expired: code / 8,
        })
    }
}

/// One request's entry in a counter's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Holds `amount` in window `window`.
    Held {
        amount: u64,
        window: u64,
        due: u64,
    },
    Settled {
        due: u64,
    },
    /// Its hold expired unsettled.
    Lapsed {
        due: u64,
    },
}

impl Entry {
    fn due(self) -> u64 {
        match self {
            Entry::Held { due, .. } | Entry::Settled { due } | Entry::Lapsed { due } => due,
        }
    }
}

/// A counter's holds and marks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    entries: HashMap<HoldId, Entry>,
    due: BTreeSet<(u64, HoldId)>,
    /// The window whose holds `held` counts (a fixed window's index; 0 for a sliding window).
    window: u64,
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

    /// What the holds outstanding in `window` hold.
    pub fn held(&self, window: u64) -> u64 {
        if self.window == window { self.held } else { 0 }
    }

    fn put(&mut self, id: HoldId, entry: Entry) {
        if let Some(old) = self.entries.insert(id, entry) {
            self.due.remove(&(old.due(), id));
        }
        self.due.insert((entry.due(), id));
    }

    fn remove(&mut self, id: HoldId) {
        if let Some(old) = self.entries.remove(&id) {
            self.due.remove(&(old.due(), id));
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

/// Tidies `table` at `now` (ms) for a call of `held` in window `window` (0 for a sliding
/// window), settling the item's hold if it has one, and says what the item does and is charged
/// (`hits`: its real cost, for a settle). A hold is taken by `take`, if the request is admitted.
pub(crate) fn tidy(table: &mut Table, held: &Held, hits: u64, window: u64, now: u64) -> Tidied {
    if table.window != window {
        table.window = window;
        table.held = 0;
    }
    let keep = held.ttl_ms;
    let due: Vec<(u64, HoldId)> = table
        .due
        .iter()
        .take_while(|(at, _)| *at <= now)
        .take(MOST_DUE)
        .copied()
        .collect();
    let (mut expired, mut charge) = (0, 0);
    for (_, id) in due {
        match table.entries[&id] {
            Entry::Held {
                amount, window: w, ..
            } => {
                if w == table.window {
                    table.held -= amount;
                    if held.on_expiry == OnExpiry::Charge {
                        charge += amount;
                    }
                }
                expired += 1;
                table.put(id, Entry::Lapsed { due: now + keep });
            }
            Entry::Settled { .. } | Entry::Lapsed { .. } => table.remove(id),
        }
    }
    let outcome = match table.entries.get(&held.id).copied() {
        Some(Entry::Held {
            amount, window: w, ..
        }) => {
            if w == table.window {
                table.held -= amount;
            }
            charge += hits;
            table.put(held.id, Entry::Settled { due: now + keep });
            Outcome::Settle
        }
        Some(Entry::Settled { .. }) => Outcome::Duplicate,
        Some(Entry::Lapsed { .. }) => {
            charge += hits;
            table.put(held.id, Entry::Settled { due: now + keep });
            Outcome::Unheld
        }
        None if table.len() >= held.most as usize => Outcome::Full,
        None => Outcome::Hold,
    };
    Tidied {
        outcome,
        expired,
        charge,
        held: table.held,
    }
}

/// Takes the hold of `held` in `table` (tidied for the call), as `take` says.
pub(crate) fn take(table: &mut Table, held: &Held, take: Take) {
    table.put(
        held.id,
        Entry::Held {
            amount: held.estimate,
            window: take.window,
            due: take.due,
        },
    );
    table.held += held.estimate;
}

/// What a call does to a held window counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    pub verdict: Verdict,
    /// The counter after what it is charged whatever the answer (expired estimates, a settle),
    /// when it is charged anything.
    pub charged: Option<window::Step>,
    /// The hold taken once the request is admitted, if one is.
    pub take: Option<Take>,
}

/// A hold to take: the window its table counts it in, and when it is due (its expiry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Take {
    pub window: u64,
    pub due: u64,
}

/// Evaluates a held window counter of `algorithm` for `ask` (its hits: a settle's real cost) at
/// the store's clock, `stored` its state, `table` its holds (tidied here whatever the answer).
/// The verdict's remaining counts the holds outstanding; a settle is never over, and reports
/// the counter as it leaves it. Nothing it charges is ever taken back (`charged` is 0): a
/// settle's caller that is not answered has its cost charged all the same.
pub(crate) fn evaluate(
    algorithm: Algorithm,
    ask: &Ask,
    held: &Held,
    stored: Option<window::State>,
    table: &mut Table,
) -> Step {
    let sliding = algorithm == Algorithm::SlidingWindow;
    let (now, window_ms) = (ask.now_ms, ask.window_ms);
    let (index, _, end) = window::bounds(&Ask { at_ms: now, ..*ask });
    let table_window = if sliding { 0 } else { index };
    let tidied = tidy(table, held, ask.hits, table_window, now);
    // Held counters count at the clock, never at an instant a request names.
    let base = Ask {
        at_ms: now,
        refund: false,
        step: crate::limiter::Step::Hits,
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
    let seen = Seen {
        outcome: tidied.outcome,
        expired: tidied.expired,
    };
    let mut verdict = match tidied.outcome {
        Outcome::Hold | Outcome::Full => {
            let hold = Ask {
                limit: room,
                hits: held.estimate,
                always: false,
                ..base
            };
            let mut verdict =
                window::evaluate(algorithm, &hold, charged.map(|c| c.next).or(stored)).verdict;
            verdict.over |= tidied.outcome == Outcome::Full;
            verdict
        }
        Outcome::Settle | Outcome::Unheld | Outcome::Duplicate => {
            let after = Ask {
                limit: room,
                hits: 0,
                always: true,
                ..base
            };
            let mut verdict =
                window::evaluate(algorithm, &after, charged.map(|c| c.next).or(stored)).verdict;
            verdict.over = false;
            verdict
        }
    };
    verdict.charged = 0;
    verdict.hold = Some(seen);
    let to_end = end - now;
    let take = (tidied.outcome == Outcome::Hold && !verdict.over).then(|| Take {
        window: table_window,
        due: now + held.ttl_ms.min(if sliding { window_ms } else { to_end }),
    });
    Step {
        verdict,
        charged,
        take,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: &str, estimate: u64) -> Held {
        Held {
            id: HoldId::of(id.as_bytes()),
            estimate,
            ttl_ms: 1_000,
            on_expiry: OnExpiry::Release,
            most: 4,
        }
    }

    #[test]
    fn a_request_holds_then_settles_then_charges_nothing() {
        let mut table = Table::default();
        let a = held("a", 100);
        let first = tidy(&mut table, &a, 7, 0, 10);
        assert_eq!(
            (first.outcome, first.charge, first.held),
            (Outcome::Hold, 0, 0)
        );
        take(
            &mut table,
            &a,
            Take {
                window: 0,
                due: 1_010,
            },
        );
        assert_eq!(table.held(0), 100);
        let second = tidy(&mut table, &a, 30, 0, 20);
        assert_eq!(
            (second.outcome, second.charge, second.held),
            (Outcome::Settle, 30, 0)
        );
        let third = tidy(&mut table, &a, 30, 0, 30);
        assert_eq!((third.outcome, third.charge), (Outcome::Duplicate, 0));
    }

    #[test]
    fn an_expired_hold_is_released_or_charged_and_its_late_settle_charged_in_full() {
        for (on_expiry, charged) in [(OnExpiry::Release, 0), (OnExpiry::Charge, 100)] {
            let mut table = Table::default();
            let a = Held {
                on_expiry,
                ..held("a", 100)
            };
            tidy(&mut table, &a, 0, 0, 0);
            take(
                &mut table,
                &a,
                Take {
                    window: 0,
                    due: 1_000,
                },
            );
            let b = Held {
                on_expiry,
                ..held("b", 1)
            };
            let later = tidy(&mut table, &b, 0, 0, 1_000);
            assert_eq!((later.expired, later.charge, later.held), (1, charged, 0));
            let late = tidy(&mut table, &a, 40, 0, 1_500);
            assert_eq!((late.outcome, late.charge), (Outcome::Unheld, 40));
        }
    }

    #[test]
    fn holds_of_a_window_over_count_nothing_and_charge_nothing() {
        let mut table = Table::default();
        let a = Held {
            on_expiry: OnExpiry::Charge,
            ..held("a", 100)
        };
        tidy(&mut table, &a, 0, 5, 0);
        take(
            &mut table,
            &a,
            Take {
                window: 5,
                due: 900,
            },
        );
        let b = held("b", 1);
        let next = tidy(&mut table, &b, 0, 6, 1_000);
        assert_eq!((next.expired, next.charge, next.held), (1, 0, 0));
    }

    #[test]
    fn a_full_table_takes_no_hold_and_a_call_tidies_at_most_most_due() {
        let mut table = Table::default();
        for i in 0..4 {
            let h = held(&i.to_string(), 1);
            tidy(&mut table, &h, 0, 0, 0);
            take(
                &mut table,
                &h,
                Take {
                    window: 0,
                    due: 100,
                },
            );
        }
        assert_eq!(
            tidy(&mut table, &held("x", 1), 0, 0, 50).outcome,
            Outcome::Full
        );
        let mut big = Table::default();
        let many = Held {
            most: 100,
            ..held("", 1)
        };
        for i in 0..(MOST_DUE + 3) {
            let h = Held {
                id: HoldId::of(i.to_string().as_bytes()),
                ..many
            };
            tidy(&mut big, &h, 0, 0, 0);
            take(
                &mut big,
                &h,
                Take {
                    window: 0,
                    due: 100,
                },
            );
        }
        let seen = tidy(
            &mut big,
            &Held {
                id: HoldId::of(b"y"),
                ..many
            },
            0,
            0,
            200,
        );
        assert_eq!(seen.expired, MOST_DUE as u64);
        assert_eq!(seen.held, 3);
    }

    #[test]
    fn a_reply_code_reads_back() {
        let seen = Seen {
            outcome: Outcome::Unheld,
            expired: 3,
        };
        assert_eq!(Seen::of_code(4 + 8 * 3), Some(seen));
        assert_eq!(Seen::of_code(0), None);
        assert_eq!(Seen::of_code(6), None);
    }
}
