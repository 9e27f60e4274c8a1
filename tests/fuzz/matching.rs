//! Which rule a descriptor matches, against a model of envoyproxy/ratelimit's matching written
//! from its description: entry by entry down the tree, the rule with the exact (key, value)
//! first, then the first rule whose `*` pattern matches the value, in file order, then the rule
//! with the key alone; the limits are those of the rule the last entry matched, and an entry
//! that matches nothing leaves the descriptor without a limit. A limit named in the `replaces`
//! of any rule a request matched is dropped from every descriptor of that request.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use sluice_core::config;
use sluice_core::limiter::Counting;
use sluice_core::limiter::lease::Leasing;
use sluice_core::rules::RuleSet;
use sluice_core::rules::plan::{Asked, Global, Plan};

use super::fuzz;

/// A rule: its key, its value (a pattern when it holds `*`), its limit if it has one, and the
/// rules under it. Its limit's `requests_per_unit` is its number in file order, naming it.
#[derive(Clone, Debug)]
struct Rule {
    key: &'static str,
    value: Option<String>,
    limit: Option<Named>,
    nested: Vec<Rule>,
}

/// A limit's name, if any, and the names it replaces (never its own).
#[derive(Clone, Debug)]
struct Named {
    name: Option<&'static str>,
    replaces: Vec<&'static str>,
}

const NAMES: [&str; 3] = ["n1", "n2", "n3"];

fn limits() -> impl Strategy<Value = Named> {
    (
        prop::option::of(prop::sample::select(NAMES.to_vec())),
        prop::option::weighted(0.2, prop::sample::subsequence(NAMES.to_vec(), 1..=2)),
    )
        .prop_map(|(name, replaces)| Named {
            name,
            replaces: replaces
                .unwrap_or_default()
                .into_iter()
                .filter(|r| Some(*r) != name)
                .collect(),
        })
}

fn rules() -> impl Strategy<Value = Vec<Rule>> {
    let leaf = (
        prop::sample::select(vec!["x", "y"]),
        prop::option::of("[ab*]{1,3}"),
        prop::option::weighted(0.8, limits()),
    )
        .prop_map(|(key, value, limit)| Rule {
            key,
            value,
            limit,
            nested: Vec::new(),
        });
    let tree = leaf.prop_recursive(3, 30, 5, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..5)).prop_map(|(mut rule, nested)| {
            rule.nested = nested;
            rule
        })
    });
    prop::collection::vec(tree, 0..6).prop_map(|mut rules| {
        distinct(&mut rules);
        rules
    })
}

/// Drops each rule that repeats a key and value of its level (an error in a rule file).
fn distinct(rules: &mut Vec<Rule>) {
    let mut seen = std::collections::HashSet::new();
    rules.retain(|r| seen.insert((r.key, r.value.clone())));
    for rule in rules {
        distinct(&mut rule.nested);
    }
}

/// The rules as a rule file, each limited rule's `requests_per_unit` its number (from 1).
fn text(rules: &[Rule], indent: usize, number: &mut u32, out: &mut String) {
    let pad = " ".repeat(indent);
    for rule in rules {
        out.push_str(&format!("{pad}- key: {}\n", rule.key));
        if let Some(value) = &rule.value {
            out.push_str(&format!("{pad}  value: \"{value}\"\n"));
        }
        *number += 1;
        if let Some(limit) = &rule.limit {
            let mut fields = format!("unit: hour, requests_per_unit: {number}");
            if let Some(name) = limit.name {
                fields.push_str(&format!(", name: {name}"));
            }
            if !limit.replaces.is_empty() {
                let replaces: Vec<String> = limit
                    .replaces
                    .iter()
                    .map(|r| format!("{{name: {r}}}"))
                    .collect();
                fields.push_str(&format!(", replaces: [{}]", replaces.join(", ")));
            }
            out.push_str(&format!("{pad}  rate_limit: {{{fields}}}\n"));
        }
        if !rule.nested.is_empty() {
            out.push_str(&format!("{pad}  descriptors:\n"));
            text(&rule.nested, indent + 4, number, out);
        }
    }
}

/// Whether `pattern`'s `*`s, each any run of bytes, can make it `value`.
fn glob(pattern: &[u8], value: &[u8]) -> bool {
    match pattern.split_first() {
        None => value.is_empty(),
        Some((b'*', rest)) => (0..=value.len()).any(|skip| glob(rest, &value[skip..])),
        Some((c, rest)) => value.first() == Some(c) && glob(rest, &value[1..]),
    }
}

/// The rule `entries` match in the model, with its number.
fn matched<'a>(rules: &'a [Rule], entries: &[(&str, String)]) -> Option<(&'a Rule, u32)> {
    // Each rule's number, in file order, as `text` gives them.
    fn numbered<'a>(rules: &'a [Rule], next: &mut u32, out: &mut Vec<(&'a Rule, u32)>) {
        for rule in rules {
            *next += 1;
            out.push((rule, *next));
            numbered(&rule.nested, next, &mut Vec::new());
        }
    }
    let mut level = rules;
    let mut first = 0;
    let mut matched = None;
    for (key, value) in entries {
        let mut at = Vec::new();
        let mut next = first;
        numbered(level, &mut next, &mut at);
        let with_key = || at.iter().filter(|(r, _)| r.key == *key);
        let exact = with_key().find(|(r, _)| r.value.as_deref() == Some(value.as_str()));
        let pattern = with_key().find(|(r, _)| {
            r.value
                .as_deref()
                .is_some_and(|p| p.contains('*') && glob(p.as_bytes(), value.as_bytes()))
        });
        let key_only = with_key().find(|(r, _)| r.value.is_none());
        let (rule, number) = *exact.or(pattern).or(key_only)?;
        matched = Some((rule, number));
        level = &rule.nested;
        first = number;
    }
    matched
}

/// The number of the rule whose limit applies to each descriptor of a request, in the model.
fn model(rules: &[Rule], descriptors: &[Vec<(&str, String)>]) -> Vec<Option<u32>> {
    let matches: Vec<_> = descriptors.iter().map(|d| matched(rules, d)).collect();
    let replaced: Vec<&str> = matches
        .iter()
        .flatten()
        .filter_map(|(rule, _)| rule.limit.as_ref())
        .flat_map(|limit| limit.replaces.iter().copied())
        .collect();
    matches
        .iter()
        .map(|m| {
            let (rule, number) = (*m)?;
            let limit = rule.limit.as_ref()?;
            let dropped = limit.name.is_some_and(|n| replaced.contains(&n));
            (!dropped).then_some(number)
        })
        .collect()
}

fn descriptors() -> impl Strategy<Value = Vec<Vec<(&'static str, String)>>> {
    let entry = (prop::sample::select(vec!["x", "y"]), "[ab]{0,3}");
    prop::collection::vec(prop::collection::vec(entry, 1..5), 1..8)
}

#[test]
fn each_descriptor_gets_the_limit_of_the_rule_the_model_matches_unless_replaced() {
    let global = Global {
        quota_mode: false,
        counting: Counting::Admitted,
        lease: Leasing::Off,
        cluster: None,
    };
    fuzz(
        "matching::model",
        1_000,
        Duration::from_secs(5),
        (rules(), descriptors()),
        |(rules, descriptors)| {
            let mut file = "domain: web\ndescriptors:\n".to_owned();
            text(&rules, 2, &mut 0, &mut file);
            let (domain, _) = config::parse(std::path::Path::new("m.yaml"), &file)
                .map_err(|e| TestCaseError::fail(format!("{file}\n{e:?}")))?;
            let rule_set = RuleSet::new(vec![domain]);
            let asked: Vec<Asked> = descriptors
                .iter()
                .map(|entries| Asked {
                    entries: entries
                        .iter()
                        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                        .collect(),
                    hits: 1,
                    refund: false,
                    limit: None,
                })
                .collect();
            let (plans, check) = rule_set.plan(b"web", &asked, global, false);
            let got: Vec<Option<u32>> = plans
                .iter()
                .map(|plan| match plan {
                    Plan::Limited { items, .. } => {
                        Some(check.items[items.start].limit.requests_per_unit)
                    }
                    _ => None,
                })
                .collect();
            prop_assert_eq!(
                got,
                model(&rules, &descriptors),
                "{}\n{:?}",
                file,
                descriptors
            );
            Ok(())
        },
    );
}
