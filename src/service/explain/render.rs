//! An explanation as JSON, and as the text `sluice explain` prints.

use super::*;

impl Explanation {
    /// As JSON, one document.
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).expect("an explanation serializes");
        text.push('\n');
        text
    }

    /// As an indented text tree, for a terminal.
    pub fn render(&self) -> String {
        let mut out = format!("domain \"{}\"", self.domain);
        if !self.known_domain {
            out.push_str(": no rule file declares it (every descriptor is OK with no limit)");
        }
        out.push('\n');
        for (i, d) in self.descriptors.iter().enumerate() {
            d.render(i, &mut out);
        }
        out
    }
}

impl Descriptor {
    fn render(&self, index: usize, out: &mut String) {
        let mut line = |indent: usize, text: String| {
            out.push_str(&"  ".repeat(indent));
            out.push_str(&text);
            out.push('\n');
        };
        line(0, format!("descriptor {index}"));
        for step in &self.entries {
            let how = match (&step.pattern, &step.rule) {
                (Some(p), Some(r)) => format!("wildcard \"{p}\" ({r})"),
                (None, Some(r)) => format!("{} ({r})", step.how),
                _ => step.how.to_owned(),
            };
            let shared = match &step.counted_value {
                Some(c) if *c != step.value => format!(", counted as \"{c}\" (share_threshold)"),
                _ => String::new(),
            };
            line(
                1,
                format!("{} = \"{}\": {how}{shared}", step.key, step.value),
            );
        }
        if let Some(stop) = &self.stop {
            line(
                1,
                format!("stopped at entry {}: {}", stop.entry, stop.message),
            );
        }
        if let Some(rule) = &self.rule {
            line(
                1,
                format!(
                    "rule `{}` ({}){}",
                    rule.path,
                    rule.source,
                    modes_text(&rule.modes)
                ),
            );
            for limit in &rule.limits {
                line(2, format!("limit {}", limit_text(limit)));
            }
            if let Some(hold) = rule.modes.get("hold").filter(|h| h.is_object()) {
                line(2, format!("hold: {}", hold_text(hold)));
            }
        }
        for r in &self.replaced {
            let by: Vec<String> = r.by.iter().map(|i| format!("descriptor {i}")).collect();
            line(1, format!("replaced: `{}` by {}", r.name, by.join(", ")));
        }
        if let Some(o) = &self.limit_override {
            line(
                1,
                format!(
                    "override: {} per {} (replaces the rule's limits)",
                    o["requests_per_unit"],
                    o["unit"].as_str().unwrap_or_default()
                ),
            );
        }
        let from = match self.hits_from {
            "descriptor" => "the descriptor's hits_addend",
            _ => "the request's hits_addend, 0 meaning 1",
        };
        let verb = if self.refund { "gives back" } else { "hits" };
        line(1, format!("{verb} {} ({from})", self.hits));
        line(1, format!("result: {}", self.result.replace('_', " ")));
        for c in &self.counters {
            line(
                1,
                format!("counter {}{}", limit_text(&c.limit), modes_text(&c.modes)),
            );
            line(2, c.counter.clone());
            if let Some(key) = &c.redis_key {
                line(2, format!("redis key {key}"));
            }
            if let Some(hold) = &c.hold {
                if let Some(n) = hold.get("holds") {
                    line(2, format!("holds {n} until the response settles it"));
                } else if let Some(n) = hold.get("settles") {
                    line(
                        2,
                        format!("settles: charges {n} and releases the request's hold"),
                    );
                }
            }
            if let Some(window) = &c.window {
                line(
                    2,
                    format!(
                        "window {} to {}, ends in {} s",
                        window["start"].as_str().unwrap_or_default(),
                        window["end"].as_str().unwrap_or_default(),
                        window["ends_in_seconds"]
                    ),
                );
            }
        }
    }
}

/// A rule's `hold` as `HoldRule::json` writes it, in words.
fn hold_text(hold: &Value) -> String {
    let field = |name: &str| match &hold[name] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    format!(
        "estimate {}, settled by {}={}, ttl {}, on expiry {}, at most {} entries, largest {}",
        field("estimate"),
        hold["settle"]["key"].as_str().unwrap_or_default(),
        hold["settle"]["value"].as_str().unwrap_or_default(),
        field("ttl"),
        field("on_expiry"),
        field("most"),
        field("largest"),
    )
}

/// The modes that are on: ` [shadow_mode]`, or nothing.
fn modes_text(modes: &Map<String, Value>) -> String {
    let on: Vec<String> = modes
        .iter()
        .filter_map(|(name, value)| match value {
            Value::Bool(true) => Some(name.clone()),
            // A mapping (a rule's hold) has a line of its own.
            Value::Bool(false) | Value::Null | Value::Object(_) => None,
            Value::String(s) => Some(format!("{name}={s}")),
            other => Some(format!("{name}={other}")),
        })
        .collect();
    if on.is_empty() {
        String::new()
    } else {
        format!(" [{}]", on.join(", "))
    }
}

/// A limit as `limit_json` writes it, in words: `10 per minute, fixed_window, name per_ip`.
fn limit_text(limit: &Value) -> String {
    if limit["unlimited"] == json!(true) {
        return "unlimited".to_owned();
    }
    let unit = limit["unit"].as_str().unwrap_or_default();
    let window = match limit["unit_multiplier"].as_u64() {
        Some(1) | None => unit.to_owned(),
        Some(n) => format!("{n} {unit}s"),
    };
    let mut text = format!(
        "{} per {window}, {}",
        limit["requests_per_unit"],
        limit["algorithm"].as_str().unwrap_or_default()
    );
    if let Some(calendar) = limit["calendar"].as_object() {
        let zone = calendar["time_zone"].as_str().unwrap_or_default();
        match (&calendar.get("anchor_day"), &calendar.get("week_starts")) {
            (Some(day), _) => write!(text, ", on the calendar in {zone} from day {day}"),
            (_, Some(Value::String(first))) => {
                write!(text, ", on the calendar in {zone} from {first}")
            }
            _ => write!(text, ", on the calendar in {zone}"),
        }
        .expect("writing to a String");
    }
    for field in ["burst", "name"] {
        match &limit[field] {
            Value::Null => {}
            Value::String(s) => write!(text, ", {field} {s}").expect("writing to a String"),
            other => write!(text, ", {field} {other}").expect("writing to a String"),
        }
    }
    if let Some(replaces) = limit["replaces"].as_array() {
        let names: Vec<&str> = replaces.iter().filter_map(Value::as_str).collect();
        write!(text, ", replaces {}", names.join(", ")).expect("writing to a String");
    }
    text
}
