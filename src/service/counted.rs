//! What a decided request counts beside its answer: each descriptor's hits in its rule's
//! metrics and its values in the top view, and what each of its held counters did.

use crate::telemetry::Telemetry;
use sluice_core::limiter::outcome::Outcome;
use sluice_core::limiter::{Check, Decision};
use sluice_core::rules::plan::{Asked, Plan};

/// Counts each decided descriptor's hits in its rule's metrics (hits past `near_ratio` of a
/// limit as near it) and its values in the top view.
pub(super) fn descriptors(
    plans: &[Plan],
    asked: &[Asked],
    check: &Check,
    decision: &Decision,
    near_ratio: f64,
) {
    for (plan, asked) in plans.iter().zip(asked) {
        plan.count(check, decision, near_ratio, &asked.entries);
    }
}

/// Counts what each held counter of `decision` did, under its rule of `domain`.
pub(super) fn holds(telemetry: &Telemetry, domain: &[u8], plans: &[Plan], decision: &Decision) {
    for plan in plans {
        let (Plan::Limited { items, .. }, Some(rule)) = (plan, plan.rule()) else {
            continue;
        };
        for usage in &decision.usages[items.clone()] {
            let Some(seen) = usage.hold else {
                continue;
            };
            let outcome = match seen.outcome {
                Outcome::Hold if decision.admitted && !usage.over => "held",
                Outcome::Hold => "denied",
                other => other.name(),
            };
            let labels = [
                ("domain", String::from_utf8_lossy(domain).into_owned()),
                ("rule", rule.to_owned()),
            ];
            telemetry.holds(&labels, outcome, seen.expired);
        }
    }
}
