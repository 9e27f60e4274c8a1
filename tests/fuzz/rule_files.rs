//! Rule files: any text, any bytes, and generated rule files (valid ones mutated, nested deep,
//! with huge scalars and many rules). Parsing never panics nor overflows a stack, and every
//! error names the file and a line of it.

use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;
use sluice_core::config::{self, DEFAULT_MAX_CONFIG_BYTES, Source};
use sluice_core::rules::RuleSet;

use super::fuzz;

/// A YAML value, rendered in block or flow style.
#[derive(Clone, Debug)]
enum Yaml {
    Scalar(String),
    Seq(Vec<Yaml>),
    Map(Vec<(String, Yaml)>),
}

impl Yaml {
    fn map(pairs: Vec<(&str, Yaml)>) -> Yaml {
        Yaml::Map(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    /// The text of this value as a document; `flow` writes collections as `[…]` and `{…}`.
    fn render(&self, flow: bool) -> String {
        let mut out = String::new();
        if flow {
            self.flow(&mut out);
        } else {
            self.block(&mut out, 0);
        }
        out.push('\n');
        out
    }

    fn flow(&self, out: &mut String) {
        match self {
            Yaml::Scalar(s) => out.push_str(s),
            Yaml::Seq(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.flow(out);
                }
                out.push(']');
            }
            Yaml::Map(pairs) => {
                out.push('{');
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(k);
                    out.push_str(": ");
                    v.flow(out);
                }
                out.push('}');
            }
        }
    }

    /// Block style: each collection item on its own line, `indent` spaces in.
    fn block(&self, out: &mut String, indent: usize) {
        let pad = " ".repeat(indent);
        match self {
            Yaml::Scalar(s) => out.push_str(s),
            Yaml::Seq(items) if items.is_empty() => out.push_str("[]"),
            Yaml::Map(pairs) if pairs.is_empty() => out.push_str("{}"),
            Yaml::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push('\n');
                        out.push_str(&pad);
                    }
                    out.push_str("- ");
                    item.block(out, indent + 2);
                }
            }
            Yaml::Map(pairs) => {
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push('\n');
                        out.push_str(&pad);
                    }
                    out.push_str(k);
                    out.push(':');
                    match v {
                        Yaml::Scalar(s) => {
                            out.push(' ');
                            out.push_str(s);
                        }
                        Yaml::Seq(items) if !items.is_empty() => {
                            out.push('\n');
                            out.push_str(&pad);
                            v.block(out, indent);
                        }
                        _ => {
                            out.push('\n');
                            out.push_str(&pad);
                            out.push_str("  ");
                            v.block(out, indent + 2);
                        }
                    }
                }
            }
        }
    }
}

fn scalar(s: &str) -> Yaml {
    Yaml::Scalar(s.to_owned())
}

/// Scalars as a rule file may hold them, or not: numbers past every bound, other types' words,
/// quoted text of any characters.
fn scalars() -> impl Strategy<Value = Yaml> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "4294967295",
            "4294967296",
            "18446744073709551616",
            "1e309",
            "0x10",
            "true",
            "false",
            "null",
            "~",
            "\"\"",
            "second",
            "minute",
            "hour",
            "day",
            "week",
            "month",
            "year",
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
            "leaky_bucket",
            "admitted",
            "always",
            "auto",
            "off",
            "\"*\"",
            "\"a*b*\"",
            "&a x",
            "*a",
            "!!str x",
            "|",
            "'",
        ])
        .prop_map(scalar),
        any::<u64>().prop_map(|n| Yaml::Scalar(n.to_string())),
        "[a-z_*./]{1,12}".prop_map(Yaml::Scalar),
        any::<String>().prop_map(|s| Yaml::Scalar(format!("{s:?}"))),
    ]
}

/// Values of any shape, a few levels deep.
fn values() -> impl Strategy<Value = Yaml> {
    scalars().prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Yaml::Seq),
            prop::collection::vec(("[a-z_]{1,10}", inner), 0..4).prop_map(Yaml::Map),
        ]
    })
}

/// Every key a rule file knows: the file's, a rule's, a limit's and a quota bucket's.
const KEYS: &str = "domain descriptors quota_buckets key value rate_limit rate_limits shadow_mode \
    quota_mode detailed_metric value_to_metric share_threshold metadata counting lease unit \
    requests_per_unit unlimited name replaces algorithm unit_multiplier burst calendar time_zone \
    anchor_day week_starts hold bucket";

/// A key of a rule, a limit, a quota bucket or the file, or another.
fn keys() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(KEYS.split(' ').collect::<Vec<_>>())
        .prop_map(str::to_owned),
        1 => "[a-z_]{1,10}",
    ]
}

fn limit() -> impl Strategy<Value = Yaml> {
    (
        scalars(),
        scalars(),
        prop::collection::vec((keys(), values()), 0..3),
    )
        .prop_map(|(unit, requests, mut extra)| {
            let mut pairs = vec![
                ("unit".to_owned(), unit),
                ("requests_per_unit".to_owned(), requests),
            ];
            pairs.append(&mut extra);
            Yaml::Map(pairs)
        })
}

/// A rule with its key, value, limit and any other keys, and rules nested under it.
fn rules(depth: u32) -> impl Strategy<Value = Yaml> {
    let leaf = (
        "[a-z_]{1,8}",
        prop::option::of(scalars()),
        prop::option::of(limit()),
        prop::collection::vec((keys(), values()), 0..3),
    )
        .prop_map(|(key, value, limit, extra)| {
            let mut pairs = vec![("key".to_owned(), Yaml::Scalar(key))];
            pairs.extend(value.map(|v| ("value".to_owned(), v)));
            pairs.extend(limit.map(|l| ("rate_limit".to_owned(), l)));
            pairs.extend(extra);
            Yaml::Map(pairs)
        });
    leaf.prop_recursive(depth, 64, 6, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..6)).prop_map(|(rule, nested)| {
            let Yaml::Map(mut pairs) = rule else {
                return rule;
            };
            pairs.push(("descriptors".to_owned(), Yaml::Seq(nested)));
            Yaml::Map(pairs)
        })
    })
}

/// A rule file: a domain, rules and quota buckets, in block or flow style.
fn rule_files() -> impl Strategy<Value = String> {
    (
        prop_oneof![3 => Just(scalar("web")), 1 => scalars()],
        prop::collection::vec(rules(5), 0..8),
        prop::collection::vec((values(), prop::option::of(limit())), 0..3),
        prop::collection::vec((keys(), values()), 0..2),
        any::<bool>(),
    )
        .prop_map(|(domain, descriptors, buckets, extra, flow)| {
            let buckets = buckets
                .into_iter()
                .map(|(bucket, limit)| {
                    let mut pairs = vec![("bucket", bucket)];
                    pairs.extend(limit.map(|l| ("rate_limit", l)));
                    Yaml::map(pairs)
                })
                .collect();
            let mut pairs = vec![
                ("domain".to_owned(), domain),
                ("descriptors".to_owned(), Yaml::Seq(descriptors)),
                ("quota_buckets".to_owned(), Yaml::Seq(buckets)),
            ];
            pairs.extend(extra);
            Yaml::Map(pairs).render(flow)
        })
}

/// One edit of a text: bytes cut out, text put in, or a line said twice.
#[derive(Clone, Debug)]
enum Edit {
    Cut(Index, usize),
    Put(Index, String),
    Repeat(Index),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<Index>(), 1..16usize).prop_map(|(at, n)| Edit::Cut(at, n)),
        (any::<Index>(), "(.|\n| {2,4}|- |: |\\[|\\{){1,4}").prop_map(|(at, s)| Edit::Put(at, s)),
        any::<Index>().prop_map(Edit::Repeat),
    ];
    prop::collection::vec(edit, 0..4)
}

/// The nearest character boundary at or before `at`.
fn boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn apply(mut text: String, edits: &[Edit]) -> String {
    for edit in edits {
        if text.is_empty() {
            break;
        }
        match edit {
            Edit::Cut(at, n) => {
                let start = boundary(&text, at.index(text.len()));
                let end = boundary(&text, (start + n).min(text.len()));
                text.replace_range(start..end, "");
            }
            Edit::Put(at, s) => {
                let at = boundary(&text, at.index(text.len()));
                text.insert_str(at, s);
            }
            Edit::Repeat(at) => {
                let lines: Vec<&str> = text.lines().collect();
                let i = at.index(lines.len());
                let mut out: Vec<&str> = lines[..=i].to_vec();
                out.extend(&lines[i..]);
                text = out.join("\n");
            }
        }
    }
    text
}

/// Files nested past every bound: collections in block or flow style, rules under rules, and
/// `metadata` under a rule.
fn deep_files() -> impl Strategy<Value = String> {
    prop_oneof![
        (1..400usize).prop_map(|n| format!(
            "domain: web\nx: {}1{}\n",
            "[".repeat(n),
            "]".repeat(n)
        )),
        (1..400usize).prop_map(|n| format!(
            "domain: web\nx: {}1{}\n",
            "{a: ".repeat(n),
            "}".repeat(n)
        )),
        (1..400usize).prop_map(|n| format!("domain: web\nx:\n  {}1\n", "- ".repeat(n))),
        (1..400usize).prop_map(|n| {
            let mut text = "domain: web\nx:\n".to_owned();
            for i in 1..=n {
                text.push_str(&" ".repeat(2 * i));
                text.push_str("a:\n");
            }
            text
        }),
        (1..80usize, any::<bool>()).prop_map(|(n, flow)| {
            let mut rule = Yaml::map(vec![
                ("key", scalar("k")),
                (
                    "rate_limit",
                    Yaml::map(vec![
                        ("unit", scalar("hour")),
                        ("requests_per_unit", scalar("1")),
                    ]),
                ),
            ]);
            for _ in 1..n {
                rule = Yaml::map(vec![
                    ("key", scalar("k")),
                    ("descriptors", Yaml::Seq(vec![rule])),
                ]);
            }
            Yaml::map(vec![
                ("domain", scalar("web")),
                ("descriptors", Yaml::Seq(vec![rule])),
            ])
            .render(flow)
        }),
        (1..60usize, any::<bool>()).prop_map(|(n, flow)| {
            let mut metadata = scalar("1");
            for i in 0..n {
                metadata = if i % 2 == 0 {
                    Yaml::Seq(vec![metadata])
                } else {
                    Yaml::map(vec![("m", metadata)])
                };
            }
            let rule = Yaml::map(vec![("key", scalar("k")), ("metadata", metadata)]);
            Yaml::map(vec![
                ("domain", scalar("web")),
                ("descriptors", Yaml::Seq(vec![rule])),
            ])
            .render(flow)
        }),
    ]
}

/// Files large in one place: a huge scalar (key, value, domain, number) or many rules.
fn large_files() -> impl Strategy<Value = String> {
    prop_oneof![
        (1..200_000usize, 0..4usize).prop_map(|(n, at)| {
            let huge = "9".repeat(n);
            let mut parts = ["web", "k", "v", "1"].map(str::to_owned);
            parts[at] = huge;
            let [domain, key, value, requests] = parts;
            format!(
                "domain: {domain}\ndescriptors:\n  - key: {key}\n    value: \"{value}\"\n    rate_limit: {{unit: hour, requests_per_unit: {requests}}}\n"
            )
        }),
        (1..5_000usize, any::<bool>()).prop_map(|(n, same)| {
            let mut text = "domain: web\ndescriptors:\n".to_owned();
            for i in 0..n {
                let value = if same { 0 } else { i };
                text.push_str(&format!(
                    "  - key: k\n    value: \"{value}\"\n    rate_limit: {{unit: hour, requests_per_unit: {i}}}\n"
                ));
            }
            text
        }),
    ]
}

/// Parses `text` as the rule file `fuzz.yaml`: every error (and warning) names it and a line of
/// it, and rules that parse build a rule set, shown as JSON on `/config`.
fn parses_or_names_its_line(text: &str) -> Result<(), TestCaseError> {
    let file = Path::new("fuzz.yaml");
    let last_line = text.lines().count() + 1;
    let named = |e: &config::ConfigError| -> Result<(), TestCaseError> {
        prop_assert_eq!(e.file.as_path(), file);
        prop_assert!(
            (1..=last_line).contains(&e.line),
            "line {} of a file of {} line(s): {}",
            e.line,
            last_line - 1,
            e
        );
        prop_assert!(!e.message.is_empty(), "an error without a message: {}", e);
        let shown = e.to_string();
        prop_assert!(
            shown.starts_with(&format!("fuzz.yaml:{}: ", e.line)),
            "{}",
            shown
        );
        Ok(())
    };
    match config::parse(file, text) {
        Ok((domain, warnings)) => {
            for w in &warnings {
                named(w)?;
            }
            // The rules in force as /config and /rlconfig show them.
            let rules = RuleSet::new(vec![domain]);
            let shown: Result<serde_json::Value, _> =
                serde_json::from_slice(&rules.rendered_json());
            prop_assert!(shown.is_ok(), "/config is not JSON: {:?}", shown);
            rules.rendered_text();
        }
        Err(errors) => {
            prop_assert!(!errors.is_empty(), "refused without an error");
            for e in &errors {
                named(e)?;
            }
        }
    }
    Ok(())
}

#[test]
fn any_text_is_parsed_or_refused_at_a_line_of_the_file() {
    fuzz(
        "rule_files::any_text",
        2_000,
        Duration::from_secs(5),
        prop_oneof![
            any::<String>(),
            "([a-z_:\\-\\[\\]{},*&!|>'\" ]|\n|\t){0,200}"
        ],
        |text| parses_or_names_its_line(&text),
    );
}

#[test]
fn generated_rule_files_edited_are_parsed_or_refused_at_a_line_of_the_file() {
    fuzz(
        "rule_files::generated",
        300,
        Duration::from_secs(10),
        (rule_files(), edits()),
        |(text, edits)| parses_or_names_its_line(&apply(text, &edits)),
    );
}

#[test]
fn files_nested_past_every_bound_are_refused_at_a_line_without_overflowing_a_stack() {
    fuzz(
        "rule_files::deep",
        300,
        Duration::from_secs(5),
        (deep_files(), edits()),
        |(text, edits)| parses_or_names_its_line(&apply(text, &edits)),
    );
}

#[test]
fn huge_scalars_and_many_rules_are_parsed_or_refused_at_a_line() {
    fuzz(
        "rule_files::large",
        40,
        Duration::from_secs(10),
        large_files(),
        |text| parses_or_names_its_line(&text),
    );
}

/// Any bytes as a rule file, read as `check-config` and `serve` read it, under any
/// `--max-config-bytes`: an error names the file and a line, line 0 only for a file that cannot
/// be read as text or is past the bound.
#[test]
fn any_bytes_in_a_rule_file_load_or_are_refused_at_a_line_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.yaml");
    fuzz(
        "rule_files::any_bytes",
        200,
        Duration::from_secs(5),
        (
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..400),
                rule_files().prop_map(String::into_bytes),
            ],
            prop_oneof![3 => Just(DEFAULT_MAX_CONFIG_BYTES), 1 => 0..600u64],
        ),
        |(bytes, max_bytes)| {
            std::fs::write(&path, &bytes).unwrap();
            let source = Source {
                path: path.clone(),
                merge_domains: false,
                max_bytes,
                calendar_offset_ms: 0,
            };
            let Err(errors) = config::load(&source) else {
                prop_assert!(
                    bytes.len() as u64 <= max_bytes,
                    "{} bytes loaded",
                    bytes.len()
                );
                return Ok(());
            };
            prop_assert!(!errors.is_empty());
            let readable = std::str::from_utf8(&bytes).is_ok() && bytes.len() as u64 <= max_bytes;
            for e in &errors {
                prop_assert_eq!(&e.file, &path);
                let shown = e.to_string();
                let named = format!("{}:{}: ", path.display(), e.line);
                prop_assert!(shown.starts_with(&named), "{}", shown);
                prop_assert!(
                    e.line >= 1 || !readable,
                    "a readable file's error at line 0: {}",
                    e
                );
            }
            Ok(())
        },
    );
}

/// A rule file of a directory: its domain and its top-level rules' keys and values.
type Part = (&'static str, Vec<(&'static str, Option<&'static str>)>);

fn parts() -> impl Strategy<Value = Vec<Part>> {
    let rule = (
        prop::sample::select(vec!["k", "m"]),
        prop::sample::select(vec![None, Some("v"), Some("w"), Some("")]),
    );
    let part = (
        prop::sample::select(vec!["a", "b"]),
        prop::collection::vec(rule, 0..3),
    );
    prop::collection::vec(part, 1..4)
}

/// Whether rule files of `parts` are valid together: no rule twice in a file, and a domain in
/// one file only, or with `merge`, no top-level rule of a domain in two files. An empty value is
/// no value, as envoyproxy/ratelimit reads it.
fn valid_together(parts: &[Part], merge: bool) -> bool {
    let mut seen = std::collections::HashSet::new();
    let mut domains = std::collections::HashSet::new();
    for (domain, rules) in parts {
        let mut here = std::collections::HashSet::new();
        for (key, value) in rules {
            let rule = (*domain, *key, value.filter(|v| !v.is_empty()));
            if !here.insert(rule) || (merge && !seen.insert(rule)) {
                return false;
            }
        }
        if !domains.insert(*domain) && !merge {
            return false;
        }
    }
    true
}

/// Rule files of a directory, loaded with and without `--merge-domains`: valid exactly when no
/// domain or rule is declared twice where that is an error, every error at a line of its file.
#[test]
fn a_directory_of_rule_files_is_valid_exactly_when_nothing_is_declared_twice() {
    fuzz(
        "rule_files::directories",
        1_000,
        Duration::from_secs(5),
        (parts(), any::<bool>()),
        |(parts, merge)| {
            let dir = tempfile::tempdir().unwrap();
            for (i, (domain, rules)) in parts.iter().enumerate() {
                let mut text = format!("domain: {domain}\ndescriptors:\n");
                for (key, value) in rules {
                    text.push_str(&format!("  - key: {key}\n"));
                    if let Some(value) = value {
                        text.push_str(&format!("    value: \"{value}\"\n"));
                    }
                    text.push_str("    rate_limit: {unit: hour, requests_per_unit: 1}\n");
                }
                std::fs::write(dir.path().join(format!("{i}.yaml")), text).unwrap();
            }
            let source = Source {
                path: dir.path().to_path_buf(),
                merge_domains: merge,
                max_bytes: DEFAULT_MAX_CONFIG_BYTES,
                calendar_offset_ms: 0,
            };
            let loaded = config::load(&source);
            if let Err(errors) = &loaded {
                for e in errors {
                    prop_assert!(e.file.starts_with(dir.path()) && e.line >= 1, "{}", e);
                }
            }
            prop_assert_eq!(
                loaded.is_ok(),
                valid_together(&parts, merge),
                "{:?}",
                loaded.err()
            );
            Ok(())
        },
    );
}
