//! A rule's `hold` and `weights`: what a held rule needs to be one, and the weight tables that
//! turn a call's hits into money.

use marked_yaml::Node;
use marked_yaml::types::MarkedMappingNode;

use super::{Parser, is_null, line_of};
use crate::config::{DescriptorConfig, HoldRule, RuleLimit, SettleEntry, Weights};
use crate::limiter::lease::Leasing;
use crate::limiter::{Algorithm, OnExpiry, Scope};

const HOLD_KEYS: &[&str] = &["estimate", "settle", "ttl", "on_expiry", "most", "largest"];
const SETTLE_KEYS: &[&str] = &["key", "value"];
const WEIGHTS_KEYS: &[&str] = &["key", "values", "default"];

/// What the response-time rate limit of Envoy's route adds, for an error that asks for it.
const SETTLE_HOW: &str = "add 'settle: {key: phase, value: response}' here and the entry \
     '- generic_key: {descriptor_key: phase, descriptor_value: response}' to the actions of \
     Envoy's apply_on_stream_done rate limit, after the request id's";

impl Parser<'_> {
    /// A rule's `hold` at `node`, if it is one a rule with `value`, `descriptors`, `limits`,
    /// `lease` and `scope` can have.
    pub(super) fn held_rule(
        &mut self,
        node: &Node,
        value: Option<&str>,
        descriptors: &[DescriptorConfig],
        limits: &[RuleLimit],
        lease: Option<Leasing>,
        scope: Option<Scope>,
    ) -> Option<HoldRule> {
        let hold = self.hold(node)?;
        let at = line_of(node);
        let refuse = |why: &str| format!("hold: {why}");
        if value.is_some() {
            self.error(at, refuse("a held rule's entry names the request (an x-request-id): it takes any value, and has no 'value'"));
        } else if !descriptors.is_empty() {
            self.error(
                at,
                refuse("a held rule has no descriptors under it: its entry names the request"),
            );
        } else if limits.is_empty() || limits.iter().any(|l| l.limit.is_none()) {
            self.error(
                at,
                refuse("a held rule needs a rate_limit, and is not unlimited"),
            );
        } else if let Some(l) = limits.iter().filter_map(|l| l.limit.as_ref()).find(|l| {
            !matches!(
                l.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingWindow
            )
        }) {
            self.error(
                at,
                refuse(&format!(
                    "a {} limit cannot hold: only fixed_window and sliding_window limits can",
                    l.algorithm.name()
                )),
            );
        } else if lease == Some(Leasing::Auto) {
            self.error(at, refuse("a held rule cannot be leased (lease: auto): a replica deciding from a block would not see the other replicas' holds"));
        } else if let Some(scope) = scope.filter(|s| s.is_local()) {
            self.error(at, refuse(&format!("a held rule counts in the store (scope global or cluster), not scope {}: a hold settled on another replica would not find it", scope.name())));
        }
        Some(hold)
    }

    /// A rule's `hold` mapping, its defaults filled in.
    fn hold(&mut self, node: &Node) -> Option<HoldRule> {
        let Some(map) = node.as_mapping() else {
            self.error(
                line_of(node),
                "'hold' must be a mapping (estimate, settle, ttl, on_expiry, most, largest)",
            );
            return None;
        };
        self.check_keys(map, HOLD_KEYS);
        let at = |key: &str| map.get_node(key).map_or(line_of(node), line_of);
        let Some(estimate) = self.number(map, "estimate") else {
            if map.get_node("estimate").is_none() {
                self.error(
                    line_of(node),
                    "hold: 'estimate' is needed: what a hold takes at least (a request's expected cost)",
                );
            }
            return None;
        };
        if estimate == 0 {
            self.error(at("estimate"), "hold: 'estimate' must be at least 1");
            return None;
        }
        let settle = self.settle(map, line_of(node))?;
        let ttl_ms = match self.string(map, "ttl") {
            None => HoldRule::TTL_MS,
            Some(text) => match humantime::parse_duration(&text) {
                Ok(ttl)
                    if (1_000..=HoldRule::LONGEST_TTL_MS).contains(&(ttl.as_millis() as u64)) =>
                {
                    ttl.as_millis() as u64
                }
                _ => {
                    self.error(
                        at("ttl"),
                        format!(
                            "hold: invalid ttl '{text}': a duration from 1s to 1h, such as 60s"
                        ),
                    );
                    return None;
                }
            },
        };
        let on_expiry = match self.string(map, "on_expiry") {
            None => OnExpiry::default(),
            Some(name) => {
                let Some(on_expiry) = OnExpiry::parse(&name) else {
                    self.error(
                        at("on_expiry"),
                        format!("hold: invalid on_expiry '{name}': charge or release"),
                    );
                    return None;
                };
                on_expiry
            }
        };
        let most = self.number(map, "most").unwrap_or(HoldRule::MOST);
        if most == 0 {
            self.error(at("most"), "hold: 'most' must be at least 1");
            return None;
        }
        let largest = match self.string(map, "largest") {
            None => 100,
            Some(text) => match text.trim_end_matches('%').parse::<u8>() {
                Ok(p) if (1..=100).contains(&p) => p,
                _ => {
                    self.error(
                        at("largest"),
                        format!("hold: invalid largest '{text}': a percentage of the limit from 1% to 100%"),
                    );
                    return None;
                }
            },
        };
        Some(HoldRule {
            estimate: u64::from(estimate),
            ttl_ms,
            on_expiry,
            most,
            largest,
            settle,
        })
    }

    /// The `settle` entry of a `hold` mapping at `line`: a key and a value, both needed.
    fn settle(&mut self, map: &MarkedMappingNode, line: usize) -> Option<SettleEntry> {
        let Some(node) = map.get_node("settle") else {
            self.error(
                line,
                format!(
                    "hold: 'settle' is needed: the entry only Envoy's response-time call carries, which no client can send; {SETTLE_HOW}"
                ),
            );
            return None;
        };
        let Some(entry) = node.as_mapping() else {
            self.error(
                line_of(node),
                format!("hold: 'settle' must be a mapping (key, value); {SETTLE_HOW}"),
            );
            return None;
        };
        self.check_keys(entry, SETTLE_KEYS);
        match (self.string(entry, "key"), self.string(entry, "value")) {
            (Some(key), Some(value)) if !key.is_empty() && !value.is_empty() => {
                Some(SettleEntry { key, value })
            }
            _ => {
                self.error(
                    line_of(node),
                    format!("hold: 'settle' needs a key and a value, neither empty; {SETTLE_HOW}"),
                );
                None
            }
        }
    }

    /// A rule's `weights`, for a rule of entry `key` with `hold` and `descriptors` under it: a
    /// weight's entry follows the rule's own, so it is neither the rule's key, nor its settle
    /// entry's, nor a key of the rules under it, nor another table's.
    pub(super) fn weights(
        &mut self,
        map: &MarkedMappingNode,
        key: &str,
        hold: Option<&HoldRule>,
        descriptors: &[DescriptorConfig],
    ) -> Vec<Weights> {
        let tables = self.maps(map, "weights");
        if let Some(node) = map.get_node("weights")
            && tables.len() > Weights::MOST_TABLES
        {
            self.error(
                line_of(node),
                format!("weights: at most {} tables", Weights::MOST_TABLES),
            );
            return Vec::new();
        }
        let mut out: Vec<Weights> = Vec::new();
        for table in tables {
            self.check_keys(table, WEIGHTS_KEYS);
            let line = table
                .keys()
                .next()
                .map_or(1, |k| k.span().start().map_or(1, |m| m.line()));
            let Some(entry) = self.string(table, "key").filter(|k| !k.is_empty()) else {
                self.error(
                    line,
                    "weights: each table needs a 'key': the entry whose value chooses the weight",
                );
                continue;
            };
            let clash = if entry == key {
                Some("the rule's own key".to_owned())
            } else if hold.is_some_and(|h| h.settle.key == entry) {
                Some("the key of the rule's settle entry".to_owned())
            } else if descriptors.iter().any(|d| d.key == entry) {
                Some("the key of a rule under it".to_owned())
            } else if out.iter().any(|w| w.key == entry) {
                Some("the key of another table".to_owned())
            } else {
                None
            };
            if let Some(clash) = clash {
                self.error(
                    line,
                    format!("weights: key '{entry}' is {clash}: a weight's entry follows the rule's own in the descriptor, under a key of its own"),
                );
                continue;
            }
            let Some(values) = table.get_node("values").and_then(Node::as_mapping) else {
                self.error(
                    line,
                    format!("weights: table '{entry}' needs 'values', a mapping of each value to its weight"),
                );
                continue;
            };
            if values.is_empty() || values.len() > Weights::MOST_VALUES {
                self.error(
                    line,
                    format!(
                        "weights: table '{entry}' lists from 1 to {} values",
                        Weights::MOST_VALUES
                    ),
                );
                continue;
            }
            let mut weights = std::collections::BTreeMap::new();
            for (name, weight) in values.iter() {
                if let Some(w) = self.weight(weight, &entry) {
                    weights.insert(name.as_str().to_owned(), w);
                }
            }
            let default = table
                .get_node("default")
                .and_then(|node| self.weight(node, &entry));
            out.push(Weights {
                key: entry,
                values: weights,
                default,
            });
        }
        out
    }

    /// A weight at `node`, in thousandths: a number above 0 with at most three decimals, at
    /// most a million.
    fn weight(&mut self, node: &Node, table: &str) -> Option<u64> {
        let text = node
            .as_scalar()
            .filter(|s| !is_null(s))
            .map_or("", |s| s.as_str());
        let (whole, part) = text.split_once('.').unwrap_or((text, ""));
        let digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
        let milli = (!whole.is_empty()
            && whole.len() <= 7
            && digits(whole)
            && part.len() <= 3
            && digits(part))
        .then(|| {
            let part = format!("{part:0<3}");
            whole
                .parse::<u64>()
                .ok()?
                .checked_mul(1000)?
                .checked_add(part.parse().ok()?)
        })
        .flatten()
        .filter(|w| (1..=Weights::LARGEST).contains(w));
        if milli.is_none() {
            self.error(
                line_of(node),
                format!("weights: invalid weight '{text}' in table '{table}': a number above 0 and at most 1000000, with at most three decimals (such as 0.25)"),
            );
        }
        milli
    }
}

#[cfg(test)]
mod tests {
    use crate::config::file::tests::{errors, ok};
    use crate::config::{HoldRule, SettleEntry};
    use crate::limiter::OnExpiry;

    const SETTLE: &str = "settle: {key: phase, value: response}";

    fn held(hold: &str, rest: &str) -> String {
        format!(
            "domain: d\ndescriptors:\n  - key: user\n    descriptors:\n      - key: request_id\n        hold: {hold}\n        rate_limit: {{unit: hour, requests_per_unit: 100}}\n{rest}"
        )
    }

    #[test]
    fn a_hold_names_the_request_by_its_own_entry_and_is_settled_by_an_entry_of_envoys() {
        let d = ok(&held(
            &format!(
                "{{estimate: 10, {SETTLE}, ttl: 30s, on_expiry: release, most: 50, largest: 20%}}"
            ),
            "",
        ));
        let settle = SettleEntry {
            key: "phase".into(),
            value: "response".into(),
        };
        assert_eq!(
            d.descriptors[0].descriptors[0].hold,
            Some(HoldRule {
                estimate: 10,
                ttl_ms: 30_000,
                on_expiry: OnExpiry::Release,
                most: 50,
                largest: 20,
                settle: settle.clone(),
            })
        );
        assert_eq!(
            ok(&held(&format!("{{estimate: 5, {SETTLE}}}"), "")).descriptors[0].descriptors[0].hold,
            Some(HoldRule {
                estimate: 5,
                ttl_ms: HoldRule::TTL_MS,
                on_expiry: OnExpiry::Charge,
                most: HoldRule::MOST,
                largest: 100,
                settle,
            }),
            "an expired hold charges its estimate unless the rule says"
        );
        let with = |more: &str| format!("{{estimate: 5, {SETTLE}, {more}}}");
        for (hold, error) in [
            (
                with("ttl: 2h"),
                "r.yaml:6: hold: invalid ttl '2h': a duration from 1s to 1h, such as 60s",
            ),
            (
                with("on_expiry: keep"),
                "r.yaml:6: hold: invalid on_expiry 'keep': charge or release",
            ),
            (with("most: 0"), "r.yaml:6: hold: 'most' must be at least 1"),
            (
                with("largest: 0%"),
                "r.yaml:6: hold: invalid largest '0%': a percentage of the limit from 1% to 100%",
            ),
            (
                with("size: 1"),
                "r.yaml:6: config error, unknown key 'size'",
            ),
            (
                format!("{{estimate: -1, {SETTLE}}}"),
                "r.yaml:6: 'estimate' must be a whole number from 0 to 4294967295, not '-1'",
            ),
            (
                format!("{{estimate: 0, {SETTLE}}}"),
                "r.yaml:6: hold: 'estimate' must be at least 1",
            ),
            (
                format!("{{{SETTLE}}}"),
                "r.yaml:6: hold: 'estimate' is needed: what a hold takes at least (a request's expected cost)",
            ),
            (
                "{estimate: 5}".to_owned(),
                "r.yaml:6: hold: 'settle' is needed: the entry only Envoy's response-time call carries, which no client can send; add 'settle: {key: phase, value: response}' here and the entry '- generic_key: {descriptor_key: phase, descriptor_value: response}' to the actions of Envoy's apply_on_stream_done rate limit, after the request id's",
            ),
            (
                "{estimate: 5, settle: {key: phase}}".to_owned(),
                "r.yaml:6: hold: 'settle' needs a key and a value, neither empty; add 'settle: {key: phase, value: response}' here and the entry '- generic_key: {descriptor_key: phase, descriptor_value: response}' to the actions of Envoy's apply_on_stream_done rate limit, after the request id's",
            ),
            (
                "yes".to_owned(),
                "r.yaml:6: 'hold' must be a mapping (estimate, settle, ttl, on_expiry, most, largest)",
            ),
        ] {
            assert_eq!(errors(&held(&hold, "")), [error], "{hold}");
        }
        let refused = |rule: &str| {
            errors(&format!(
                "domain: d\ndescriptors:\n{}",
                rule.replace("HOLD", &format!("{{estimate: 1, {SETTLE}}}"))
            ))
        };
        for (rule, error) in [
            (
                "  - key: request_id\n    value: x\n    hold: HOLD\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
                "r.yaml:5: hold: a held rule's entry names the request (an x-request-id): it takes any value, and has no 'value'",
            ),
            (
                "  - key: request_id\n    hold: HOLD\n    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: token_bucket}\n",
                "r.yaml:4: hold: a token_bucket limit cannot hold: only fixed_window and sliding_window limits can",
            ),
            (
                "  - key: request_id\n    hold: HOLD\n    lease: auto\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
                "r.yaml:4: hold: a held rule cannot be leased (lease: auto): a replica deciding from a block would not see the other replicas' holds",
            ),
            (
                "  - key: request_id\n    hold: HOLD\n    scope: split\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
                "r.yaml:4: hold: a held rule counts in the store (scope global or cluster), not scope split: a hold settled on another replica would not find it",
            ),
            (
                "  - key: request_id\n    hold: HOLD\n",
                "r.yaml:4: hold: a held rule needs a rate_limit, and is not unlimited",
            ),
            (
                "  - key: request_id\n    hold: HOLD\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    descriptors:\n      - key: x\n        rate_limit: {unit: hour, requests_per_unit: 1}\n",
                "r.yaml:4: hold: a held rule has no descriptors under it: its entry names the request",
            ),
        ] {
            assert_eq!(refused(rule), [error], "{rule}");
        }
    }

    #[test]
    fn weights_are_read_in_thousandths_and_a_table_that_makes_no_sense_is_refused_at_its_line() {
        let weighed = |weights: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {{unit: hour, requests_per_unit: 100}}\n    weights:\n{weights}"
            )
        };
        let d = ok(&weighed(
            "      - key: model\n        values: {gpt-4o: 10, gpt-4o-mini: 0.25}\n        default: 2.5\n      - key: kind\n        values: {input: 1, output: 4}\n",
        ));
        let w = &d.descriptors[0].weights;
        assert_eq!(w.len(), 2);
        assert_eq!(
            (
                w[0].of(b"gpt-4o"),
                w[0].of(b"gpt-4o-mini"),
                w[0].of(b"other")
            ),
            (10_000, 250, 2_500)
        );
        assert_eq!(
            w[1].of(b"none"),
            4_000,
            "without a default, the dearest listed"
        );
        for (weights, error) in [
            (
                "      - key: model\n        values: {a: 0}\n",
                "r.yaml:7: weights: invalid weight '0' in table 'model': a number above 0 and at most 1000000, with at most three decimals (such as 0.25)",
            ),
            (
                "      - key: model\n        values: {a: 0.0001}\n",
                "r.yaml:7: weights: invalid weight '0.0001' in table 'model': a number above 0 and at most 1000000, with at most three decimals (such as 0.25)",
            ),
            (
                "      - key: model\n        values: {a: -2}\n",
                "r.yaml:7: weights: invalid weight '-2' in table 'model': a number above 0 and at most 1000000, with at most three decimals (such as 0.25)",
            ),
            (
                "      - key: model\n        values: {a: 1}\n        default: lots\n",
                "r.yaml:8: weights: invalid weight 'lots' in table 'model': a number above 0 and at most 1000000, with at most three decimals (such as 0.25)",
            ),
            (
                "      - key: model\n        values: {}\n",
                "r.yaml:6: weights: table 'model' lists from 1 to 10000 values",
            ),
            (
                "      - key: model\n",
                "r.yaml:6: weights: table 'model' needs 'values', a mapping of each value to its weight",
            ),
            (
                "      - values: {a: 1}\n",
                "r.yaml:6: weights: each table needs a 'key': the entry whose value chooses the weight",
            ),
            (
                "      - key: user\n        values: {a: 1}\n",
                "r.yaml:6: weights: key 'user' is the rule's own key: a weight's entry follows the rule's own in the descriptor, under a key of its own",
            ),
            (
                "      - key: m\n        values: {a: 1}\n      - key: m\n        values: {a: 2}\n",
                "r.yaml:8: weights: key 'm' is the key of another table: a weight's entry follows the rule's own in the descriptor, under a key of its own",
            ),
        ] {
            assert_eq!(errors(&weighed(weights)), [error], "{weights}");
        }
    }
}
