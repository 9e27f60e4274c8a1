//! The explain walk: how one request descriptor travels the rule tree, entry by entry, told by
//! the very walk the request path matches with (`RuleSet::walk` and `resolve`, not a copy of
//! their precedence), and why it stops where it does. `service::explain` adds what the request
//! path plans from it: limits, `replaces`, hits and counters.

use serde_json::{Map, Value, json};

use super::{Match, Matched, Node, RuleSet};
use crate::limiter::Mode;

/// One descriptor's way through the rules.
pub struct Walk<'a> {
    /// The rule each entry matched and how, in order, up to the first entry that matched none.
    pub steps: Vec<(Matched<'a>, &'a Node)>,
    /// Why the walk ended before the last entry, if it did.
    pub stop: Option<Stop>,
    /// What the request path resolves the descriptor to (the rule of the last entry and the
    /// values its counters count under), when every entry matched.
    pub matched: Option<Match<'a>>,
    /// The entries after the last step that its rule takes (its settle entry, its weights').
    pub taken: usize,
}

/// Why an entry matched no rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// No rule file declares the domain.
    UnknownDomain,
    /// The rule matched by the entry before has no nested rules (or the domain has none at all):
    /// the descriptor has more entries than the rules are deep.
    DeeperThanRules,
    /// No rule at this depth has the entry's key.
    NoRuleForKey,
    /// Rules at this depth have the key, but none takes the value: no exact value, no pattern
    /// matching it, no key-only rule.
    NoRuleForValue,
}

impl Stop {
    /// A stable name for machines.
    pub fn name(self) -> &'static str {
        match self {
            Stop::UnknownDomain => "unknown_domain",
            Stop::DeeperThanRules => "deeper_than_rules",
            Stop::NoRuleForKey => "no_rule_for_key",
            Stop::NoRuleForValue => "no_rule_for_value",
        }
    }
}

impl RuleSet {
    /// How the descriptor `entries` of `domain` match the rules.
    pub fn explain<'a>(&'a self, domain: &[u8], entries: &[(&'a [u8], &'a [u8])]) -> Walk<'a> {
        let mut steps = Vec::with_capacity(entries.len());
        self.walk(domain, entries, |node, how, _, _| steps.push((how, node)));
        let (matched, taken) = match self.resolve_taking(domain, entries) {
            Some((m, n)) => {
                steps.truncate(n);
                (Some(m), entries.len() - n)
            }
            None => (None, 0),
        };
        let stop = entries
            .get(steps.len())
            .filter(|_| matched.is_none())
            .map(|(key, _)| self.why_stopped(domain, steps.last().map(|(_, n)| *n), key));
        Walk {
            matched,
            steps,
            stop,
            taken,
        }
    }

    /// Why an entry with `key` matched nothing under `parent` (the top of `domain` when `None`).
    fn why_stopped(&self, domain: &[u8], parent: Option<&Node>, key: &[u8]) -> Stop {
        let Some(top) = self.domains.get(domain) else {
            return Stop::UnknownDomain;
        };
        let level = parent.map_or(top, |n| n.children());
        if level.by_key.is_empty() {
            Stop::DeeperThanRules
        } else if !level.by_key.contains_key(key) {
            Stop::NoRuleForKey
        } else {
            Stop::NoRuleForValue
        }
    }
}

impl Node {
    /// The rule's path, `key_value.key…`, as envoyproxy/ratelimit names the rule's stats.
    pub fn path(&self) -> &str {
        self.stats.rule_path()
    }

    /// Where the rule is declared: `file:line` (`xds:<resource>` over xDS).
    pub fn source(&self) -> String {
        super::source(&self.file, self.line as usize)
    }

    /// The rule's modes by name, each `true` or `false`, and its `counting` and `lease` when
    /// it says (else `null`: the service's default), and its `hold` (else `null`).
    pub fn modes(&self) -> Map<String, Value> {
        [
            ("shadow_mode", json!(self.mode.is_shadow())),
            (
                "quota_mode",
                json!(matches!(self.mode, Mode::Quota | Mode::ShadowQuota)),
            ),
            ("counting", json!(self.counting.map(|c| c.name()))),
            ("lease", json!(self.lease.map(|l| l.name()))),
            ("scope", json!(self.scope().map(|s| s.name()))),
            ("hold", self.hold().map_or(Value::Null, |h| h.json())),
        ]
        .into_iter()
        .map(|(name, on)| (name.to_owned(), on))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const RULES: &str = "domain: d
descriptors:
  - key: ip
    value: 10.*
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: path
        value: /a
        rate_limit: {unit: second, requests_per_unit: 2}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 3}
";

    fn walk<'a>(set: &'a RuleSet, domain: &str, entries: &[(&'a str, &'a str)]) -> Walk<'a> {
        let entries: Vec<(&[u8], &[u8])> = entries
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        set.explain(domain.as_bytes(), &entries)
    }

    fn rules() -> RuleSet {
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), RULES).expect("valid rules");
        RuleSet::new(vec![domain])
    }

    #[test]
    fn each_entry_is_told_how_it_matched_and_where_its_rule_is() {
        let set = rules();
        let w = walk(&set, "d", &[("ip", "10.1.2.3"), ("path", "/a")]);
        assert!(matches!(w.steps[0].0, Matched::Pattern(b"10.*")));
        assert_eq!(w.steps[0].1.source(), "t.yaml:3");
        assert!(matches!(w.steps[1].0, Matched::Exact));
        assert_eq!(w.steps[1].1.source(), "t.yaml:7");
        assert_eq!(w.stop, None);
        assert_eq!(w.matched.expect("a match").node.path(), "ip_10.*.path_/a");
        let w = walk(&set, "d", &[("user", "ann")]);
        assert!(matches!(w.steps[0].0, Matched::Key));
    }

    #[test]
    fn the_walk_says_why_it_stopped() {
        let set = rules();
        let stop = |domain, entries: &[(&str, &str)]| walk(&set, domain, entries).stop;
        assert_eq!(stop("other", &[("ip", "10.1")]), Some(Stop::UnknownDomain));
        assert_eq!(stop("d", &[("nope", "x")]), Some(Stop::NoRuleForKey));
        assert_eq!(stop("d", &[("ip", "11.0")]), Some(Stop::NoRuleForValue));
        assert_eq!(
            stop("d", &[("user", "a"), ("path", "/a")]),
            Some(Stop::DeeperThanRules)
        );
        let w = walk(&set, "d", &[("ip", "10.1"), ("path", "/b"), ("x", "y")]);
        assert_eq!((w.steps.len(), w.stop), (1, Some(Stop::NoRuleForValue)));
        assert!(w.matched.is_none());
    }
}
