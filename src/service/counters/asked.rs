//! What a `/counters` call asks, read off its body and checked against the counters it names:
//! the action and its hits, whether to apply it, the window (`"at"`), the limit and who asks.

use serde_json::Value;

use super::{CounterHolds, Failed, bad};
use sluice_core::limiter::{Algorithm, Item};
use sluice_core::rules::limit_json;

/// The longest `"by"` an audit line takes.
const LONGEST_BY: usize = 256;

/// What a `/counters` call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Show,
    Reset,
    Set(u64),
    Add(i64),
}

impl Action {
    pub(super) fn name(self) -> &'static str {
        match self {
            Action::Show => "show",
            Action::Reset => "reset",
            Action::Set(_) => "set",
            Action::Add(_) => "add",
        }
    }

    /// What the action makes of a counter that holds `used` hits.
    pub(super) fn after(self, used: u64) -> u64 {
        match self {
            Action::Show => used,
            Action::Reset => 0,
            Action::Set(n) => n,
            Action::Add(n) => used.saturating_add_signed(n),
        }
    }
}

/// A `/counters` call, as its body asks.
pub(super) struct Asked {
    pub(super) action: Action,
    pub(super) apply: bool,
    /// Names the window of a `fixed_window` (ms since the Unix epoch).
    pub(super) at: Option<u64>,
    /// Only the counters of limits of this name.
    pub(super) limit: Option<String>,
    pub(super) by: String,
}

/// Reads the call's own fields off `body`, leaving the request (domain, descriptors and `"at"`).
pub(super) fn read_call(body: &[u8]) -> Result<(Asked, Vec<u8>), Failed> {
    let mut json: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let object = json
        .as_object_mut()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    let mut take = |name: &str| object.remove(name).filter(|v| !v.is_null());
    let hits = take("hits");
    let hits = match &hits {
        None => None,
        Some(v) => Some(
            v.as_i64()
                .filter(|n| n.unsigned_abs() <= u64::from(u32::MAX))
                .ok_or_else(|| {
                    bad("\"hits\" must be a whole number from -4294967295 to 4294967295")
                })?,
        ),
    };
    let action = match take("action").as_ref().map(|a| a.as_str()) {
        None | Some(Some("show")) => Action::Show,
        Some(Some("reset")) => Action::Reset,
        Some(Some("set")) => match hits {
            Some(n) if n >= 0 => Action::Set(n as u64),
            _ => return Err(bad("\"set\" takes \"hits\", a whole number of at least 0")),
        },
        Some(Some("add")) => match hits {
            Some(n) if n != 0 => Action::Add(n),
            _ => return Err(bad("\"add\" takes \"hits\", a whole number other than 0")),
        },
        Some(_) => {
            return Err(bad(
                "\"action\" must be \"show\", \"reset\", \"set\" or \"add\"",
            ));
        }
    };
    if hits.is_some() && matches!(action, Action::Show | Action::Reset) {
        return Err(bad(format!("\"{}\" takes no \"hits\"", action.name())));
    }
    let apply = match take("apply") {
        None => false,
        Some(Value::Bool(apply)) => apply,
        Some(_) => return Err(bad("\"apply\" must be true or false")),
    };
    let limit = match take("limit") {
        None => None,
        Some(Value::String(name)) => Some(name),
        Some(_) => return Err(bad("\"limit\" must be a limit's name")),
    };
    let by = match take("by") {
        None => String::new(),
        Some(Value::String(by)) if by.is_empty() => String::new(),
        // No control character: the audit line is one line.
        Some(Value::String(by)) if by.len() <= LONGEST_BY && !by.chars().any(char::is_control) => {
            by
        }
        Some(_) => {
            return Err(bad(format!(
                "\"by\" must be a string of at most {LONGEST_BY} bytes, without control characters"
            )));
        }
    };
    // What is left is the request, `"at"` included.
    let request = serde_json::to_vec(&json).expect("a JSON value serializes");
    Ok((
        Asked {
            action,
            apply,
            at: None,
            limit,
            by,
        },
        request,
    ))
}

/// Refuses an `at` that names a window before the one now of a counter of `found`, or that a
/// counter's algorithm cannot name: a past window's counter is gone, and a change to it would
/// change nothing a request sees.
pub(super) fn check_at(found: &[(usize, Item)], at: u64, now: u64) -> Result<(), Failed> {
    for (_, item) in found {
        if item.limit.algorithm != Algorithm::FixedWindow {
            return Err(bad(format!(
                "\"at\" names a window of a fixed_window only; the limit {} is a {}",
                limit_json(&item.limit),
                item.limit.algorithm.name()
            )));
        }
        if item.limit.window_at(at) < item.limit.window_at(now) {
            return Err(bad(format!(
                "\"at\" names a window before the one now of the limit {}: a past window's \
                 counter is no longer counted, nothing to show or change",
                limit_json(&item.limit)
            )));
        }
    }
    Ok(())
}

/// Refuses a `set` or `add` that would take a counter of `items` past its limit's room: a
/// counter holds at most its limit (a bucket cannot hold less than empty), and an answer shows
/// what it holds.
pub(super) fn check_room(
    items: &[Item],
    before: &[CounterHolds],
    action: Action,
) -> Result<(), Failed> {
    if !matches!(action, Action::Set(_) | Action::Add(1..)) {
        return Ok(());
    }
    for (item, held) in items.iter().zip(before) {
        let capacity = u64::from(item.limit.capacity());
        let after = action.after(held.used);
        if after > capacity.max(held.used) {
            return Err(bad(format!(
                "{} {} would take the counter of the limit {} from {} to {after}, past its room \
                 of {capacity}: a counter holds at most its limit (raise the limit to let a \
                 client past it)",
                action.name(),
                hits_of(action).unwrap_or_default(),
                limit_json(&item.limit),
                held.used
            )));
        }
    }
    Ok(())
}

/// What `action` would make of the counters of `items`, which hold `before`.
pub(super) fn dry_run(
    items: &[Item],
    before: &[CounterHolds],
    action: Action,
) -> Vec<CounterHolds> {
    before
        .iter()
        .zip(items)
        .map(|(held, item)| {
            let used = action.after(held.used);
            // A reset or a set drops the holds in flight with the counter.
            let (in_flight, holds) = match action {
                Action::Reset | Action::Set(_) => (held.held.map(|_| 0), held.holds.map(|_| 0)),
                _ => (held.held, held.holds),
            };
            CounterHolds {
                used,
                held: in_flight,
                holds,
                remaining: u64::from(item.limit.capacity())
                    .saturating_sub(used + in_flight.unwrap_or(0)),
            }
        })
        .collect()
}

pub(super) fn hits_of(action: Action) -> Option<i64> {
    match action {
        Action::Set(n) => Some(n as i64),
        Action::Add(n) => Some(n),
        Action::Show | Action::Reset => None,
    }
}
