//! What a call did to a held counter (`hold`): its item's outcome, and the holds it found
//! expired, as both stores tell them; the algorithms carry it in their verdicts.

/// What a held item did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Held its estimate (if admitted; over when it does not fit).
    Hold,
    /// Settled its hold: charged its hits, released the hold.
    Settle,
    /// A request-time call naming a request the counter knows: over, nothing held or charged.
    Reused,
    /// A settle that found no hold of its request: charged its hits in full.
    Unheld,
    /// The counter's table was full of holds: over, nothing held.
    Full,
}

impl Outcome {
    /// The outcome of its code in the check script's reply (1 to 5, in the order above).
    pub(crate) fn of_code(code: u64) -> Option<Outcome> {
        Some(match code {
            1 => Outcome::Hold,
            2 => Outcome::Settle,
            3 => Outcome::Reused,
            4 => Outcome::Unheld,
            5 => Outcome::Full,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Hold => "hold",
            Outcome::Settle => "settle",
            Outcome::Reused => "reused",
            Outcome::Unheld => "unheld",
            Outcome::Full => "full",
        }
    }

    /// A refusal that is the hold's own, not the counter's: the answer says what is left.
    pub fn refused(self) -> bool {
        matches!(self, Outcome::Reused | Outcome::Full)
    }
}

/// What a call saw of a held counter: what its item did, and how many holds it found expired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldSeen {
    pub outcome: Outcome,
    pub expired: u64,
}

impl HoldSeen {
    /// What the check script's reply says as the outcome's code plus 8 per expired hold.
    pub(crate) fn of_code(code: u64) -> Option<HoldSeen> {
        Some(HoldSeen {
            outcome: Outcome::of_code(code % 8)?,
            expired: code / 8,
        })
    }
}
