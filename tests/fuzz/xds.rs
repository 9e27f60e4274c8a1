//! xDS resources: any bytes as a `RateLimitConfig`, and generated configurations (any text, any
//! unit, `descriptors` and `metadata` nested past their bounds and past protobuf's own). A
//! response converts into rules or is rejected with errors naming the resource, in a message of
//! bounded size; nothing panics or overflows a stack.

use std::time::Duration;

use envoy_types::pb::google::protobuf::{Any, ListValue, Struct, Value, value::Kind};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use prost::Message;
use sha2::{Digest, Sha256};
use sluice::xds::{TYPE_URL, convert};
use sluice_core::rules::RuleSet;

use super::fuzz;

/// The most a rejection's summary may hold: 10 errors of at most 1 KiB (and a `…`), with their
/// separators and count.
const LONGEST_SUMMARY: usize = 10 * (1024 + 5) + 64;

fn text() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        4 => prop::sample::select(vec!["", "k", "v", "*", "a*b", "web", "x"]).prop_map(str::to_owned),
        1 => any::<String>(),
        1 => (1..20_000usize).prop_map(|n| "v".repeat(n)),
    ]
}

/// Limits of `units` (as the resource numbers them), named and replacing `names`.
fn policies(
    units: impl Strategy<Value = i32>,
    names: impl Strategy<Value = String> + Clone,
) -> impl Strategy<Value = RateLimitPolicy> {
    (
        units,
        prop_oneof![Just(0u32), Just(1), Just(u32::MAX), any::<u32>()],
        prop::bool::weighted(0.2),
        names.clone(),
        prop::collection::vec(names.prop_map(|name| RateLimitReplace { name }), 0..2),
    )
        .prop_map(
            |(unit, requests_per_unit, unlimited, name, replaces)| RateLimitPolicy {
                unit,
                requests_per_unit,
                unlimited,
                name,
                replaces,
            },
        )
}

/// `metadata` nested `depth` levels deep, lists and structs in turn.
fn nested_struct(depth: usize) -> Struct {
    let mut value = Value {
        kind: Some(Kind::NumberValue(1.0)),
    };
    for level in 1..depth {
        value = Value {
            kind: Some(if level % 2 == 0 {
                Kind::ListValue(ListValue {
                    values: vec![value],
                })
            } else {
                Kind::StructValue(Struct {
                    fields: [("m".to_owned(), value)].into(),
                })
            }),
        };
    }
    Struct {
        fields: [("m".to_owned(), value)].into(),
    }
}

fn descriptors() -> impl Strategy<Value = RateLimitDescriptor> {
    let leaf = (
        text(),
        text(),
        prop::option::of(policies(
            prop_oneof![3 => 0..8i32, 1 => any::<i32>()],
            text(),
        )),
        any::<(bool, bool, bool)>(),
        prop::option::weighted(0.2, (0..24usize).prop_map(nested_struct)),
    )
        .prop_map(
            |(key, value, rate_limit, (shadow_mode, detailed_metric, quota_mode), metadata)| {
                RateLimitDescriptor {
                    key,
                    value,
                    rate_limit,
                    shadow_mode,
                    detailed_metric,
                    quota_mode,
                    metadata,
                    ..Default::default()
                }
            },
        );
    leaf.prop_recursive(4, 32, 4, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..4)).prop_map(|(mut d, nested)| {
            d.descriptors = nested;
            d
        })
    })
}

/// A chain of `depth` rules, each nested in the one before.
fn chain(depth: usize) -> RateLimitDescriptor {
    let mut d = RateLimitDescriptor {
        key: "k".into(),
        rate_limit: Some(RateLimitPolicy {
            unit: 3,
            requests_per_unit: 1,
            ..Default::default()
        }),
        ..Default::default()
    };
    for _ in 1..depth {
        d = RateLimitDescriptor {
            key: "k".into(),
            descriptors: vec![d],
            ..Default::default()
        };
    }
    d
}

fn configs() -> impl Strategy<Value = RateLimitConfig> {
    (
        text(),
        prop_oneof![3 => Just("web".to_owned()), 1 => text()],
        prop_oneof![
            4 => prop::collection::vec(descriptors(), 0..6),
            1 => (1..150usize).prop_map(|n| vec![chain(n)]),
        ],
    )
        .prop_map(|(name, domain, descriptors)| RateLimitConfig {
            name,
            domain,
            descriptors,
        })
}

fn any_resource(value: Vec<u8>) -> Any {
    Any {
        type_url: TYPE_URL.into(),
        value,
    }
}

/// Converts `resources`: rules that build a rule set, or errors each naming a resource, at most
/// `LONGEST_SUMMARY` bytes of them.
fn converts_or_names_a_resource(resources: Vec<Any>) -> Result<(), TestCaseError> {
    let digests: Vec<[u8; 32]> = resources
        .iter()
        .map(|r| Sha256::digest(&r.value).into())
        .collect();
    match convert(resources, &digests, false) {
        Ok(loaded) => {
            RuleSet::new(loaded.domains);
        }
        Err(rejection) => {
            let summary = rejection.summary();
            prop_assert!(
                summary.contains("xds:") || summary.contains("resource "),
                "{summary:?} names no resource"
            );
            prop_assert!(
                summary.len() <= LONGEST_SUMMARY,
                "a summary of {} bytes",
                summary.len()
            );
        }
    }
    Ok(())
}

#[test]
fn any_bytes_as_a_resource_convert_or_are_rejected_naming_it() {
    fuzz(
        "xds::any_bytes",
        2_000,
        Duration::from_secs(5),
        prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..300),
                // Rules nested `n` deep, each in the `descriptors` (field 4) of the one above.
                (1..300usize).prop_map(|n| {
                    let mut bytes = vec![];
                    for level in 0..n {
                        let tag = if level + 1 == n { 0x1a } else { 0x22 };
                        let mut outer = vec![tag];
                        prost::encoding::encode_varint(bytes.len() as u64, &mut outer);
                        outer.extend(bytes);
                        bytes = outer;
                    }
                    bytes
                }),
            ],
            1..4,
        ),
        |values| converts_or_names_a_resource(values.into_iter().map(any_resource).collect()),
    );
}

#[test]
fn generated_resources_convert_or_are_rejected_naming_them() {
    fuzz(
        "xds::generated",
        500,
        Duration::from_secs(8),
        prop::collection::vec(configs(), 0..4),
        |configs| {
            converts_or_names_a_resource(
                configs
                    .iter()
                    .map(|c| any_resource(c.encode_to_vec()))
                    .collect(),
            )
        },
    );
}

/// A rule as both a rule file and an xDS resource can say it.
#[derive(Clone, Debug)]
struct Rule {
    key: String,
    value: String,
    limit: Option<RateLimitPolicy>,
    shadow_mode: bool,
    nested: Vec<Rule>,
}

/// Units as the resource numbers them (and one it does not), with their names in a rule file.
const UNITS: [(i32, &str); 9] = [
    (0, ""),
    (1, "second"),
    (2, "minute"),
    (3, "hour"),
    (4, "day"),
    (5, "month"),
    (6, "year"),
    (7, "week"),
    (99, "fortnight"),
];

fn words() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        3 => prop::sample::select(vec!["", "a", "b", "*", "a*", "*b", "x_y", "é"]).prop_map(str::to_owned),
        1 => "[ab*_ .]{0,4}",
    ]
}

fn same_rules() -> impl Strategy<Value = Vec<Rule>> {
    let policy = policies(
        prop::sample::select(UNITS.map(|(n, _)| n).to_vec()),
        words(),
    );
    let leaf = (
        words(),
        words(),
        prop::option::of(policy),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(key, value, limit, shadow_mode)| Rule {
            key,
            value,
            limit,
            shadow_mode,
            nested: Vec::new(),
        });
    let tree = leaf.prop_recursive(3, 24, 3, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..3)).prop_map(|(mut rule, nested)| {
            rule.nested = nested;
            rule
        })
    });
    prop::collection::vec(tree, 0..4)
}

fn proto(rule: &Rule) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: rule.key.clone(),
        value: rule.value.clone(),
        rate_limit: rule.limit.clone(),
        shadow_mode: rule.shadow_mode,
        descriptors: rule.nested.iter().map(proto).collect(),
        ..Default::default()
    }
}

/// The rule as a rule file writes it (in JSON, which YAML reads), saying only what a resource
/// can tell from its absence: no empty text, no false.
fn yaml(rule: &Rule) -> serde_json::Value {
    let mut out = serde_json::json!({"key": rule.key});
    if !rule.value.is_empty() {
        out["value"] = rule.value.clone().into();
    }
    if let Some(p) = &rule.limit {
        let mut limit = serde_json::json!({"requests_per_unit": p.requests_per_unit});
        if let Some((_, name)) = UNITS
            .iter()
            .find(|(n, name)| *n == p.unit && !name.is_empty())
        {
            limit["unit"] = (*name).into();
        }
        if p.unlimited {
            limit["unlimited"] = true.into();
        }
        if !p.name.is_empty() {
            limit["name"] = p.name.clone().into();
        }
        if !p.replaces.is_empty() {
            let replaces: Vec<_> = p
                .replaces
                .iter()
                .map(|r| serde_json::json!({"name": r.name}))
                .collect();
            limit["replaces"] = replaces.into();
        }
        out["rate_limit"] = limit;
    }
    if rule.shadow_mode {
        out["shadow_mode"] = true.into();
    }
    if !rule.nested.is_empty() {
        out["descriptors"] = rule.nested.iter().map(yaml).collect::<Vec<_>>().into();
    }
    out
}

/// The rules without the lines they were read from, which a resource does not have.
fn unlined(rules: &mut [sluice_core::config::DescriptorConfig]) {
    for rule in rules {
        rule.line = 0;
        unlined(&mut rule.descriptors);
    }
}

#[test]
fn a_resource_and_a_rule_file_saying_the_same_rules_are_both_valid_and_equal_or_both_refused() {
    fuzz(
        "xds::same_as_rule_files",
        2_000,
        Duration::from_secs(8),
        same_rules(),
        |rules| {
            let config = RateLimitConfig {
                name: "r".into(),
                domain: "web".into(),
                descriptors: rules.iter().map(proto).collect(),
            };
            let bytes = config.encode_to_vec();
            let digest = Sha256::digest(&bytes).into();
            let from_xds = convert(vec![any_resource(bytes)], &[digest], false);
            let text = serde_json::json!({
                "domain": "web",
                "descriptors": rules.iter().map(yaml).collect::<Vec<_>>(),
            })
            .to_string();
            let from_file = sluice_core::config::parse(std::path::Path::new("r.yaml"), &text);
            match (from_xds, from_file) {
                (Ok(mut loaded), Ok((mut domain, _))) => {
                    unlined(&mut domain.descriptors);
                    unlined(&mut loaded.domains[0].descriptors);
                    prop_assert_eq!(&loaded.domains[0].descriptors, &domain.descriptors);
                }
                (Err(_), Err(_)) => {}
                (Ok(_), Err(errors)) => {
                    return Err(TestCaseError::fail(format!(
                        "{text}\nonly the file is refused: {errors:?}"
                    )));
                }
                (Err(rejection), Ok(_)) => {
                    return Err(TestCaseError::fail(format!(
                        "{text}\nonly the resource is refused: {}",
                        rejection.summary()
                    )));
                }
            }
            Ok(())
        },
    );
}
