//! One request's descriptors planned by the rules and decided by the embedded store, checked
//! for all-or-nothing decisions; shared by tests/fuzz and the `cargo fuzz` target `request`.

use sluice_core::limiter::lease::Leasing;
use sluice_core::limiter::{Check, Counting, Unit};
use sluice_core::rules::RuleSet;
use sluice_core::rules::plan::{Asked, Global, Override};
use sluice_core::store::MemoryStore;

/// The instant every check is decided at: no window ends between two of them.
const T0: u64 = 1_700_000_000_000;

/// A descriptor as the rules plan it: entries, hits, whether they are given back, and a limit
/// override.
pub type Planned = (Vec<(Vec<u8>, Vec<u8>)>, u64, bool, Option<(u32, Unit)>);

/// Plans `descriptors` of `domain` by `rules` and has `store` decide them: a check denied or
/// refused moves no counter, as the same check with 0 hits before and after it shows; one
/// admitted leaves no counter with more room than before. What went wrong, if anything.
pub fn all_or_nothing(
    rules: &RuleSet,
    store: &MemoryStore,
    domain: &[u8],
    descriptors: &[Planned],
) -> Result<(), String> {
    let asked: Vec<Asked> = descriptors
        .iter()
        .map(|(entries, hits, refund, limit)| Asked {
            entries: entries.iter().map(|(k, v)| (&k[..], &v[..])).collect(),
            hits: *hits,
            refund: *refund,
            limit: limit.map(|(requests_per_unit, unit)| Override {
                requests_per_unit,
                unit,
            }),
        })
        .collect();
    let global = Global {
        quota_mode: false,
        counting: Counting::Admitted,
        lease: Leasing::Off,
        cluster: None,
    };
    let (plans, check) = rules.plan(domain, &asked, global, false);
    if plans.len() != asked.len() {
        return Err(format!(
            "{} plans of {} descriptors",
            plans.len(),
            asked.len()
        ));
    }
    let mut probe = check.clone();
    for item in &mut probe.items {
        item.hits = 0;
        item.refund = false;
    }
    let left = |check: &Check| -> Result<Vec<u64>, String> {
        let decision = store
            .apply_at(check, T0)
            .map_err(|e| format!("a check of 0 hits is refused: {e}"))?;
        Ok(decision.usages.iter().map(|u| u.remaining).collect())
    };
    let before = left(&probe)?;
    let admitted = store.apply_at(&check, T0).is_ok_and(|d| d.admitted);
    let after = left(&probe)?;
    if !admitted && before != after {
        return Err(format!(
            "a check denied or refused moved a counter: {before:?} → {after:?}"
        ));
    }
    // Refunds give room back, to counters other items may share.
    if admitted
        && !check.items.iter().any(|i| i.refund)
        && let Some(i) = (0..before.len()).find(|&i| after[i] > before[i])
    {
        let key = &check.items[i].key;
        return Err(format!("{key:?} has more room after it was charged"));
    }
    Ok(())
}
