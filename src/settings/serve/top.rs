//! The top view (`/top`, `sluice top`): how many counters each rule's values get, how many rules
//! get counters of their own, and how request values are shown.

use clap::Args;

use crate::telemetry::top::{TopSettings, Values};

/// The most `--top-capacity` and `--top-rules`.
const MOST: usize = 1024;

#[derive(Args)]
#[command(next_help_heading = "Who is being limited (/top)")]
pub struct TopFlags {
    /// Counters for the values most denied and most hit, per rule and per 10 s or 1 min slot
    /// (space-saving's K: a value's count is at most the slot's hits over K above its true count).
    ///
    /// 0 switches the top view off, /top included.
    #[arg(long, env = "SLUICE_TOP_CAPACITY", default_value_t = 64)]
    top_capacity: usize,
    /// Rules whose values are counted apart; the values of rules past it are counted together,
    /// as the rule (other).
    #[arg(long, env = "SLUICE_TOP_RULES", default_value_t = 32)]
    top_rules: usize,
    /// How /top shows request values: show (each entry key=value, joined by commas, cut to 256
    /// bytes), hash (16 hex digits of a SipHash keyed at start: told apart but not readable, nor
    /// alike across replicas or restarts) or hide (each rule's counts only).
    #[arg(long, env = "SLUICE_TOP_VALUES", value_enum, default_value_t = Values::Show)]
    top_values: Values,
}

impl TopFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        if self.top_capacity > MOST {
            anyhow::bail!("--top-capacity: must be at most {MOST}");
        }
        if self.top_rules == 0 || self.top_rules > MOST {
            anyhow::bail!("--top-rules: must be at least 1 and at most {MOST}");
        }
        Ok(())
    }

    /// What the top view keeps; `None` when it is off.
    pub fn settings(&self) -> Option<TopSettings> {
        (self.top_capacity > 0).then_some(TopSettings {
            capacity: self.top_capacity,
            rules: self.top_rules,
            values: self.top_values,
        })
    }
}
