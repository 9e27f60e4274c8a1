//! Parses and validates one rule file. Errors carry the line of the offending node and the
//! wording of envoyproxy/ratelimit's own errors where it has one.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode, MarkedSequenceNode};
use marked_yaml::{LoadError, LoaderOptions, Node};

use super::{
    ConfigError, DescriptorConfig, DomainConfig, MOST_BUCKET_KEYS, MOST_DESCRIPTOR_DEPTH,
    MOST_METADATA_DEPTH, MOST_YAML_DEPTH, QuotaBucketConfig, RuleLimit,
};
use crate::limiter::algorithm::{gcra, log};
use crate::limiter::calendar::{self, Calendar, Weekday};
use crate::limiter::lease::Leasing;
use crate::limiter::{Algorithm, Counting, LONGEST_WINDOW_SECONDS, Limit, Mode, Scope, Unit};

const ROOT_KEYS: &[&str] = &["domain", "descriptors", "quota_buckets"];
const QUOTA_KEYS: &[&str] = &["bucket", "rate_limit", "shadow_mode"];
/// Keys of a limit that have no meaning for a quota bucket: its limit is shared out as token
/// buckets, and nothing replaces it.
const NOT_FOR_QUOTA: &[&str] = &["name", "replaces", "algorithm", "burst", "calendar"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "counting",
    "lease",
    "hold",
    "weights",
    "scope",
];
const LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "unit_multiplier",
    "burst",
    "calendar",
];
const CALENDAR_KEYS: &[&str] = &["time_zone", "anchor_day", "week_starts"];
const REPLACES_KEYS: &[&str] = &["name"];

/// Parses one rule file into its domain, with warnings for keys that are valid somewhere in a
/// rule file but ignored where they stand (envoyproxy/ratelimit accepts them silently).
pub fn parse(
    file: &Path,
    text: &str,
) -> Result<(DomainConfig, Vec<ConfigError>), Vec<ConfigError>> {
    parse_with_clock(file, text, 0)
}

/// `parse`, the calendars of its limits with their clock set `calendar_offset_ms` from the
/// system's (`Calendar::offset_by`, tests only).
pub(crate) fn parse_with_clock(
    file: &Path,
    text: &str,
    calendar_offset_ms: i64,
) -> Result<(DomainConfig, Vec<ConfigError>), Vec<ConfigError>> {
    let mut p = Parser {
        file,
        calendar_offset_ms,
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let domain = p.root(text);
    match domain {
        Some(d) if p.errors.is_empty() => Ok((d, p.warnings)),
        _ => Err(p.errors),
    }
}

mod descriptor;
mod held;
mod limit;
mod quota;

struct Parser<'a> {
    file: &'a Path,
    /// How far the calendars' clock is set from the system's (tests only).
    calendar_offset_ms: i64,
    errors: Vec<ConfigError>,
    warnings: Vec<ConfigError>,
}

const CALENDAR_SHAPE: &str =
    "'calendar' must be true or a mapping (time_zone, anchor_day, week_starts)";

fn line_of(node: &Node) -> usize {
    node.span().start().map(|m| m.line()).unwrap_or(1)
}

fn scalar_line(node: &MarkedScalarNode) -> usize {
    node.span().start().map(|m| m.line()).unwrap_or(1)
}

/// A plain scalar that YAML reads as null.
fn is_null(s: &MarkedScalarNode) -> bool {
    s.may_coerce() && matches!(s.as_str(), "" | "~" | "null" | "Null" | "NULL")
}

impl Parser<'_> {
    fn error(&mut self, line: usize, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_path_buf(),
            line,
            message: message.into(),
        });
    }

    fn root(&mut self, text: &str) -> Option<DomainConfig> {
        if text.trim().is_empty() {
            self.error(1, "config file cannot have empty domain");
            return None;
        }
        // Before any tree is built: building, dropping and walking one recurse once per level.
        if let Some(line) = super::nesting::too_deep(text) {
            self.error(
                line,
                format!("YAML collections nest deeper than {MOST_YAML_DEPTH} levels"),
            );
            return None;
        }
        let options = LoaderOptions::default().error_on_duplicate_keys(true);
        let node = match marked_yaml::parse_yaml_with_options(0, text, options) {
            Ok(node) => node,
            Err(e) => {
                let (line, message) = describe_load_error(&e, text);
                self.error(line, format!("error loading config file: {message}"));
                return None;
            }
        };
        let Some(map) = node.as_mapping() else {
            self.error(
                line_of(&node),
                "error loading config file: the top level must be a mapping",
            );
            return None;
        };
        self.check_keys(map, ROOT_KEYS);
        let line = map
            .get_node("domain")
            .map(line_of)
            .unwrap_or_else(|| map.span().start().map(|m| m.line()).unwrap_or(1));
        let domain = self.string(map, "domain").unwrap_or_default();
        if domain.is_empty() {
            self.error(line, "config file cannot have empty domain");
        } else if domain.len() > super::MOST_DOMAIN_BYTES {
            self.error(line, super::domain_too_long(domain.len()));
        }
        // Composite keys are named from the domain down, as envoyproxy/ratelimit names them.
        let descriptors = self.descriptors(map, &format!("{domain}."), 1);
        let quota_buckets = self.quota_buckets(map);
        Some(DomainConfig {
            file: self.file.to_path_buf(),
            line,
            domain,
            descriptors,
            quota_buckets,
        })
    }

    /// Keys must be strings and known; a key known elsewhere in a rule file only warns.
    fn check_keys(&mut self, map: &MarkedMappingNode, allowed: &[&str]) {
        for key in map.keys() {
            let line = scalar_line(key);
            if key.may_coerce()
                && (key.as_bool().is_some() || key.as_f64().is_some() || is_null(key))
            {
                self.error(
                    line,
                    format!("config error, key is not of type string: {}", key.as_str()),
                );
            } else if allowed.contains(&key.as_str()) {
                continue;
            } else if [ROOT_KEYS, DESCRIPTOR_KEYS, LIMIT_KEYS]
                .iter()
                .any(|set| set.contains(&key.as_str()))
            {
                self.warnings.push(ConfigError {
                    file: self.file.to_path_buf(),
                    line,
                    message: format!("key '{}' has no effect here and is ignored", key.as_str()),
                });
            } else {
                self.error(
                    line,
                    format!("config error, unknown key '{}'", key.as_str()),
                );
            }
        }
    }

    fn string(&mut self, map: &MarkedMappingNode, key: &str) -> Option<String> {
        let node = map.get_node(key)?;
        match node.as_scalar() {
            Some(s) if is_null(s) => None,
            Some(s) => Some(s.as_str().to_owned()),
            None => {
                self.error(line_of(node), format!("'{key}' must be a string"));
                None
            }
        }
    }

    fn flag(&mut self, map: &MarkedMappingNode, key: &str) -> bool {
        let Some(node) = map.get_node(key) else {
            return false;
        };
        match node.as_scalar() {
            Some(s) if is_null(s) => false,
            Some(s) => match s.as_bool() {
                Some(b) => b,
                None => {
                    self.error(
                        line_of(node),
                        format!("'{key}' must be true or false, not '{}'", s.as_str()),
                    );
                    false
                }
            },
            None => {
                self.error(line_of(node), format!("'{key}' must be true or false"));
                false
            }
        }
    }

    fn number(&mut self, map: &MarkedMappingNode, key: &str) -> Option<u32> {
        let node = map.get_node(key)?;
        let parsed = node
            .as_scalar()
            .filter(|s| !is_null(s))
            .map(|s| s.as_str().parse::<u32>().map_err(|_| s.as_str().to_owned()));
        match parsed {
            None => None,
            Some(Ok(n)) => Some(n),
            Some(Err(text)) => {
                self.error(
                    line_of(node),
                    format!("'{key}' must be a whole number from 0 to 4294967295, not '{text}'"),
                );
                None
            }
        }
    }

    /// A list of mappings; anything else in the list is an error.
    fn maps<'n>(&mut self, map: &'n MarkedMappingNode, key: &str) -> Vec<&'n MarkedMappingNode> {
        let Some(node) = map.get_node(key) else {
            return Vec::new();
        };
        if node.as_scalar().is_some_and(is_null) {
            return Vec::new();
        }
        let Some(list): Option<&MarkedSequenceNode> = node.as_sequence() else {
            self.error(line_of(node), format!("'{key}' must be a list"));
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in list.iter() {
            match entry.as_mapping() {
                Some(m) => out.push(m),
                None => self.error(
                    line_of(entry),
                    format!(
                        "config error, yaml file contains list of type other than map: {}",
                        go_value(entry)
                    ),
                ),
            }
        }
        out
    }
}

/// A YAML value as envoyproxy/ratelimit's messages print it (Go's `%v`): a scalar as itself, a
/// list as `[a b]`, a mapping as `map[k:v]`.
fn go_value(node: &Node) -> String {
    if let Some(scalar) = node.as_scalar() {
        scalar.as_str().to_owned()
    } else if let Some(list) = node.as_sequence() {
        let items: Vec<String> = list.iter().map(go_value).collect();
        format!("[{}]", items.join(" "))
    } else if let Some(map) = node.as_mapping() {
        let items: Vec<String> = map
            .iter()
            .map(|(k, v)| format!("{}:{}", k.as_str(), go_value(v)))
            .collect();
        format!("map[{}]", items.join(" "))
    } else {
        String::new()
    }
}

/// A rule's step in envoyproxy/ratelimit's composite keys: `key_value`, or `key` alone.
pub fn composite(key: &str, value: Option<&str>) -> String {
    match value {
        Some(v) => format!("{key}_{v}"),
        None => key.to_owned(),
    }
}

/// A YAML error's line and message; a syntax error is worded as envoyproxy/ratelimit's YAML
/// library words it: `yaml: line N: problem`, without the context the scanner adds.
fn describe_load_error(e: &LoadError, text: &str) -> (usize, String) {
    match e {
        LoadError::TopLevelMustBeMapping(m) => (m.line(), "the top level must be a mapping".into()),
        LoadError::TopLevelMustBeSequence(m) => {
            (m.line(), "the top level must be a sequence".into())
        }
        LoadError::UnexpectedAnchor(m) => (
            m.line(),
            "YAML anchors and aliases are not supported".into(),
        ),
        LoadError::MappingKeyMustBeScalar(m) => (m.line(), "mapping keys must be scalars".into()),
        LoadError::UnexpectedTag(m) => (m.line(), "YAML tags are not supported".into()),
        LoadError::ScanError(m, err) => {
            let problem = match err.info().split_once(", ") {
                Some((context, problem)) if context.starts_with("while ") => problem,
                _ => err.info(),
            };
            // The scanner marks where the construct began; the problem of a truncated file is
            // where it ends, and that is the line Go's YAML library reports.
            let line = if problem == "found unexpected end of stream" {
                text.matches('\n').count() + 1
            } else {
                m.line()
            };
            (line, format!("yaml: line {line}: {problem}"))
        }
        LoadError::DuplicateKey(d) => (
            scalar_line(&d.key),
            format!(
                "duplicate key '{}' (first on line {})",
                d.key.as_str(),
                scalar_line(&d.prev_key)
            ),
        ),
    }
}

/// Metadata is free-form: kept as JSON for the config dump and responses. `depth` is the number
/// of collections `node` sits in; a collection past `MOST_METADATA_DEPTH` is an error at its line.
fn yaml_to_json(node: &Node, depth: usize) -> Result<serde_json::Value, usize> {
    if !matches!(node, Node::Scalar(_)) && depth == MOST_METADATA_DEPTH {
        return Err(line_of(node));
    }
    Ok(match node {
        Node::Scalar(s) if s.may_coerce() => {
            if is_null(s) {
                serde_json::Value::Null
            } else if let Some(b) = s.as_bool() {
                serde_json::Value::Bool(b)
            } else if let Some(i) = s.as_i64() {
                serde_json::Value::from(i)
            } else if let Some(f) = s.as_f64() {
                serde_json::Value::from(f)
            } else {
                serde_json::Value::String(s.as_str().to_owned())
            }
        }
        Node::Scalar(s) => serde_json::Value::String(s.as_str().to_owned()),
        Node::Sequence(seq) => serde_json::Value::Array(
            seq.iter()
                .map(|v| yaml_to_json(v, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
        Node::Mapping(map) => serde_json::Value::Object(
            map.iter()
                .map(|(k, v)| Ok((k.as_str().to_owned(), yaml_to_json(v, depth + 1)?)))
                .collect::<Result<_, usize>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn errors(text: &str) -> Vec<String> {
        match parse(Path::new("r.yaml"), text) {
            Ok(_) => Vec::new(),
            Err(e) => e.iter().map(ToString::to_string).collect(),
        }
    }

    pub(super) fn ok(text: &str) -> DomainConfig {
        match parse(Path::new("r.yaml"), text) {
            Ok((d, _)) => d,
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn parses_an_envoy_ratelimit_file() {
        let d = ok(
            "domain: web\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: MINUTE\n      requests_per_unit: 20\n    descriptors:\n      - key: path\n        value: /x\n        shadow_mode: true\n        rate_limit: {unit: second, requests_per_unit: 1, name: p}\n",
        );
        assert_eq!(d.domain, "web");
        assert_eq!(d.line, 1);
        let top = &d.descriptors[0];
        assert_eq!(top.line, 3);
        assert_eq!(top.limits[0].limit.as_ref().unwrap().requests_per_unit, 20);
        let inner = &top.descriptors[0];
        assert_eq!(inner.value.as_deref(), Some("/x"));
        assert_eq!(inner.mode, Mode::Shadow);
        assert_eq!(inner.limits[0].name, "p");
    }

    #[test]
    fn reports_each_envoy_ratelimit_error_with_its_line() {
        assert_eq!(
            errors("domain: \"\"\n"),
            ["r.yaml:1: config file cannot have empty domain"]
        );
        assert_eq!(
            errors("descriptors: []\n"),
            ["r.yaml:1: config file cannot have empty domain"]
        );
        assert_eq!(
            errors(&format!("domain: {}\n", "d".repeat(1025))),
            ["r.yaml:1: domain of 1025 bytes is longer than the most a domain may be (1024 bytes)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - value: x\n"),
            ["r.yaml:3: descriptor has empty key"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n"),
            ["r.yaml:5: duplicate descriptor composite key 'd.k_v'"]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n"
            ),
            ["r.yaml:5: invalid rate limit unit 'fortnight'"]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      unit: second\n"
            ),
            ["r.yaml:5: should not specify rate limit unit when unlimited"]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      name: a\n      replaces:\n        - name: a\n"
            ),
            ["r.yaml:8: replaces should not contain name of same descriptor"]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      replaces:\n        - name: \"\"\n"
            ),
            ["r.yaml:7: should not have an empty replaces entry"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    colour: red\n"),
            ["r.yaml:4: config error, unknown key 'colour'"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    1: x\n"),
            ["r.yaml:4: config error, key is not of type string: 1"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n  - just a string\n"),
            [
                "r.yaml:4: config error, yaml file contains list of type other than map: just a string"
            ]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    share_threshold: true\n"),
            [
                "r.yaml:3: share_threshold can only be used with wildcard values (containing '*'), but found key 'k'"
            ]
        );
    }

    #[test]
    fn reports_yaml_syntax_errors_with_their_line() {
        let e = errors("domain: d\ndescriptors:\n  - key: [unclosed\n");
        assert_eq!(e.len(), 1);
        assert!(e[0].starts_with("r.yaml:"), "{e:?}");
        assert!(e[0].contains("error loading config file"), "{e:?}");
        assert_eq!(
            errors("'''\n"),
            ["r.yaml:2: error loading config file: yaml: line 2: found unexpected end of stream"],
            "worded as Go's YAML library words it, at the line where the file ends"
        );
    }

    #[test]
    fn duplicate_composite_keys_are_found_at_every_depth() {
        let e = errors(
            "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n      - key: b\n",
        );
        assert_eq!(e, ["r.yaml:6: duplicate descriptor composite key 'd.a.b'"]);
    }

    #[test]
    fn reads_the_extensions() {
        let d = ok(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: second, requests_per_unit: 5}\n      - {unit: minute, requests_per_unit: 100, algorithm: sliding_window, unit_multiplier: 5}\n",
        );
        let limits: Vec<_> = d.descriptors[0]
            .limits
            .iter()
            .map(|l| l.limit.clone().unwrap())
            .collect();
        assert_eq!(limits[0].algorithm, Algorithm::FixedWindow);
        assert_eq!(limits[1].algorithm, Algorithm::SlidingWindow);
        assert_eq!(limits[1].window_ms(), 5 * 60_000);
    }

    #[test]
    fn rejects_bad_extension_values() {
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, algorithm: magic}\n"
            ),
            [
                "r.yaml:4: invalid algorithm 'magic' (expected fixed_window, sliding_window, sliding_log, token_bucket or leaky_bucket)"
            ]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, unit_multiplier: 0}\n"
            ),
            ["r.yaml:4: unit_multiplier must be at least 1"]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: year\n      unit_multiplier: 4000000000\n"
            ),
            [
                "r.yaml:6: unit_multiplier 4000000000 makes the window longer than 3650 days (10 years)"
            ]
        );
        assert!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, unit_multiplier: 10}\n"
            )
            .is_empty(),
            "ten years is the longest window"
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: lots\n"
            ),
            [
                "r.yaml:6: 'requests_per_unit' must be a whole number from 0 to 4294967295, not 'lots'"
            ]
        );
    }

    #[test]
    fn misplaced_known_keys_warn_without_failing() {
        let (_, warnings) = parse(
            Path::new("r.yaml"),
            "domain: d\ndescriptors:\n  - key: k\n    unit: second\n",
        )
        .unwrap();
        assert_eq!(
            warnings[0].to_string(),
            "r.yaml:4: key 'unit' has no effect here and is ignored"
        );
    }

    #[test]
    fn metadata_is_free_form() {
        let d = ok(
            "domain: d\ndescriptors:\n  - key: k\n    metadata:\n      team: web\n      anything: {goes: [1, true]}\n",
        );
        assert_eq!(
            d.descriptors[0].metadata,
            Some(serde_json::json!({"team": "web", "anything": {"goes": [1, true]}}))
        );
    }
}
