//! The audit of a change through `/counters`: a line per counter for the first `MOST_AUDITED`,
//! then one counting the rest, every text field quoted and escaped.

use std::net::IpAddr;

use super::asked::{Asked, hits_of};
use super::change::Outcome;
use super::{Counters, Line};
use crate::service::explain::text;

/// Counters one call's audit names a line each; past them, one line counts the rest.
const MOST_AUDITED: usize = 16;

impl Counters {
    /// Writes the audit of a change: at `warn`, with the target `sluice::audit`, a line per
    /// counter for the first `MOST_AUDITED`, then one counting the rest; every text field
    /// quoted and escaped (control, format and separator characters included), so that no
    /// value a caller sends can pass for another field or another line.
    pub(super) fn audit(
        &self,
        asked: &Asked,
        peer: Option<IpAddr>,
        domain: &[u8],
        lines: &[Line],
        outcome: &Outcome,
    ) {
        let by = if asked.by.is_empty() {
            "unknown"
        } else {
            asked.by.as_str()
        };
        let peer = peer.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let domain = text(domain);
        for line in lines.iter().take(MOST_AUDITED) {
            tracing::warn!(
                target: "sluice::audit",
                by = ?by,
                peer = ?peer,
                action = asked.action.name(),
                hits = hits_of(asked.action),
                outcome = outcome.name(),
                domain = ?domain,
                counter = ?line.counter,
                limit = ?line.limit.to_string(),
                before_used = line.before.used,
                after_used = line.after.map(|a| a.used),
                "counter changed through /counters"
            );
        }
        if lines.len() > MOST_AUDITED {
            tracing::warn!(
                target: "sluice::audit",
                by = ?by,
                peer = ?peer,
                action = asked.action.name(),
                hits = hits_of(asked.action),
                outcome = outcome.name(),
                domain = ?domain,
                more_counters = lines.len() - MOST_AUDITED,
                "and more counters changed through /counters by the same call"
            );
        }
    }
}
