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
    let mut p = Parser {
        file,
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let domain = p.root(text);
    match domain {
        Some(d) if p.errors.is_empty() => Ok((d, p.warnings)),
        _ => Err(p.errors),
    }
}

mod held;

struct Parser<'a> {
    file: &'a Path,
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

    /// The rules of `map`'s `descriptors`, nested `depth` levels deep (1 at the top).
    fn descriptors(
        &mut self,
        map: &MarkedMappingNode,
        parent: &str,
        depth: usize,
    ) -> Vec<DescriptorConfig> {
        let mut out: Vec<DescriptorConfig> = Vec::new();
        let rules = self.maps(map, "descriptors");
        if depth > MOST_DESCRIPTOR_DEPTH {
            if let Some(first) = rules.first() {
                self.error(
                    first.span().start().map_or(1, |m| m.line()),
                    format!("descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels"),
                );
            }
            return out;
        }
        let mut seen = HashSet::new();
        for d in rules {
            let Some(descriptor) = self.descriptor(d, parent, depth) else {
                continue;
            };
            if !seen.insert((descriptor.key.clone(), descriptor.value.clone())) {
                self.error(
                    descriptor.line,
                    format!(
                        "duplicate descriptor composite key '{parent}{}'",
                        composite(&descriptor.key, descriptor.value.as_deref())
                    ),
                );
                continue;
            }
            out.push(descriptor);
        }
        out
    }

    fn descriptor(
        &mut self,
        map: &MarkedMappingNode,
        parent: &str,
        depth: usize,
    ) -> Option<DescriptorConfig> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, DESCRIPTOR_KEYS);
        let key = self.string(map, "key").unwrap_or_default();
        if key.is_empty() {
            self.error(line, "descriptor has empty key");
        }
        let value = self.string(map, "value").filter(|v| !v.is_empty());
        let share_threshold = self.flag(map, "share_threshold");
        if share_threshold && !value.as_deref().is_some_and(|v| v.contains('*')) {
            self.error(
                line,
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                    composite(&key, value.as_deref())
                ),
            );
        }
        let mode = match (self.flag(map, "shadow_mode"), self.flag(map, "quota_mode")) {
            (true, true) => Mode::ShadowQuota,
            (true, false) => Mode::Shadow,
            (false, true) => Mode::Quota,
            (false, false) => Mode::Enforce,
        };
        let counting = self.string(map, "counting").and_then(|name| {
            let counting = Counting::parse(&name);
            if counting.is_none() {
                let at = map.get_node("counting").map_or(line, line_of);
                self.error(at, format!("invalid counting '{name}': admitted or always"));
            }
            counting
        });
        let limits = self.limits(map);
        let lease = self.string(map, "lease").and_then(|name| {
            let at = map.get_node("lease").map_or(line, line_of);
            let Some(lease) = Leasing::parse(&name) else {
                self.error(at, format!("invalid lease '{name}': auto or off"));
                return None;
            };
            let unleasable = limits
                .iter()
                .filter_map(|l| l.limit.as_ref())
                .find(|l| !crate::limiter::lease::leasable(l.algorithm));
            if let (Leasing::Auto, Some(limit)) = (lease, unleasable) {
                self.error(
                    at,
                    format!(
                        "lease: auto cannot apply to a {} limit: only fixed_window and sliding_window limits can be leased",
                        limit.algorithm.name()
                    ),
                );
            }
            Some(lease)
        });
        let scope = self.string(map, "scope").and_then(|name| {
            let at = map.get_node("scope").map_or(line, line_of);
            let Some(scope) = Scope::parse(&name) else {
                self.error(
                    at,
                    format!("invalid scope '{name}': global, cluster, replica or split"),
                );
                return None;
            };
            if scope.is_local() && lease == Some(Leasing::Auto) {
                self.error(
                    at,
                    format!(
                        "scope: {name} counts in the replica's own memory, which takes no leased block (lease: auto)"
                    ),
                );
            }
            Some(scope)
        });
        let metadata = map.get_node("metadata").map(|node| {
            yaml_to_json(node, 0).unwrap_or_else(|line| {
                self.error(
                    line,
                    format!("metadata nests deeper than {MOST_METADATA_DEPTH} levels"),
                );
                serde_json::Value::Null
            })
        });
        let path = format!("{parent}{}.", composite(&key, value.as_deref()));
        let descriptors = self.descriptors(map, &path, depth + 1);
        let hold = map.get_node("hold").and_then(|node| {
            self.held_rule(node, value.as_deref(), &descriptors, &limits, lease, scope)
        });
        let weights = self.weights(map, &key, hold.as_ref(), &descriptors);
        Some(DescriptorConfig {
            line,
            key,
            value,
            limits: limits.into(),
            mode,
            counting,
            lease,
            scope,
            share_threshold,
            detailed_metric: self.flag(map, "detailed_metric"),
            value_to_metric: self.flag(map, "value_to_metric"),
            metadata,
            hold,
            weights,
            descriptors,
        })
    }

    fn quota_buckets(&mut self, map: &MarkedMappingNode) -> Vec<QuotaBucketConfig> {
        let mut out: Vec<QuotaBucketConfig> = Vec::new();
        // Each bucket already defined, with its line.
        let mut seen = HashMap::new();
        for q in self.maps(map, "quota_buckets") {
            let Some(rule) = self.quota_bucket(q) else {
                continue;
            };
            if let Some(first) = seen.get(&rule.bucket) {
                self.error(
                    rule.line,
                    format!(
                        "duplicate quota bucket '{}' (first at line {first})",
                        crate::config::quota_path(&rule.bucket),
                    ),
                );
                continue;
            }
            seen.insert(rule.bucket.clone(), rule.line);
            out.push(rule);
        }
        out
    }

    fn quota_bucket(&mut self, map: &MarkedMappingNode) -> Option<QuotaBucketConfig> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, QUOTA_KEYS);
        let errors_before = self.errors.len();
        let mut bucket = Vec::new();
        match map.get_node("bucket") {
            None => self.error(
                line,
                "a quota bucket needs 'bucket', a mapping of keys to values",
            ),
            Some(node) => match node.as_mapping() {
                Some(m) if m.len() > MOST_BUCKET_KEYS => self.error(
                    line_of(node),
                    format!(
                        "a quota bucket matches at most {MOST_BUCKET_KEYS} keys, this one {}",
                        m.len()
                    ),
                ),
                Some(m) if !m.is_empty() => {
                    for (key, value) in m.iter() {
                        let value = match value.as_scalar() {
                            Some(s) if is_null(s) => None,
                            Some(s) if s.as_str().is_empty() => None,
                            Some(s) => Some(s.as_str().to_owned()),
                            None => {
                                self.error(
                                    line_of(value),
                                    format!(
                                        "the value of bucket key '{}' must be a string, or ~ for any value",
                                        key.as_str()
                                    ),
                                );
                                None
                            }
                        };
                        if key.as_str().is_empty() {
                            self.error(scalar_line(key), "a bucket key cannot be empty");
                        }
                        bucket.push((key.as_str().to_owned(), value));
                    }
                }
                _ => self.error(
                    line_of(node),
                    "'bucket' must be a mapping of keys to values, with one key at least",
                ),
            },
        }
        bucket.sort();
        let limit = match map.get_node("rate_limit").map(|n| (n, n.as_mapping())) {
            None => {
                self.error(line, "a quota bucket needs a 'rate_limit'");
                None
            }
            Some((_, Some(m))) => {
                for key in m.keys() {
                    if NOT_FOR_QUOTA.contains(&key.as_str()) {
                        self.error(
                            scalar_line(key),
                            format!(
                                "'{}' does not apply to a quota bucket's limit",
                                key.as_str()
                            ),
                        );
                    }
                }
                self.limit(m)
            }
            Some((node, None)) => {
                self.error(line_of(node), "'rate_limit' must be a mapping");
                None
            }
        };
        let shadow = self.flag(map, "shadow_mode");
        let limit = limit?;
        (self.errors.len() == errors_before).then_some(QuotaBucketConfig {
            line,
            bucket,
            limit: limit.limit,
            shadow,
        })
    }

    fn limits(&mut self, map: &MarkedMappingNode) -> Vec<RuleLimit> {
        let single = map.get_node("rate_limit");
        let many = map.get_node("rate_limits");
        if let (Some(_), Some(node)) = (single, many) {
            self.error(
                line_of(node),
                "use either rate_limit or rate_limits, not both",
            );
            return Vec::new();
        }
        if let Some(node) = single {
            if node.as_scalar().is_some_and(is_null) {
                return Vec::new();
            }
            return match node.as_mapping() {
                Some(m) => self.limit(m).into_iter().collect(),
                None => {
                    self.error(line_of(node), "'rate_limit' must be a mapping");
                    Vec::new()
                }
            };
        }
        let mut out: Vec<RuleLimit> = Vec::new();
        let mut windows = HashSet::new();
        for m in self.maps(map, "rate_limits") {
            let line = m.span().start().map(|m| m.line()).unwrap_or(1);
            let Some(limit) = self.limit(m) else { continue };
            let Some(l) = &limit.limit else {
                self.error(line, "unlimited cannot be one of several rate_limits");
                continue;
            };
            if !windows.insert((l.algorithm, l.unit, l.unit_multiplier, l.calendar.clone())) {
                self.error(
                    line,
                    "rate_limits has two limits with the same algorithm and window",
                );
                continue;
            }
            out.push(limit);
        }
        out
    }

    fn limit(&mut self, map: &MarkedMappingNode) -> Option<RuleLimit> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, LIMIT_KEYS);
        let errors_before = self.errors.len();
        let unlimited = self.flag(map, "unlimited");
        let unit_text = self.string(map, "unit").unwrap_or_default();
        let unit = Unit::parse(&unit_text);
        let name = self.string(map, "name").unwrap_or_default();
        let mut replaces = Vec::new();
        for r in self.maps(map, "replaces") {
            let r_line = r.span().start().map(|m| m.line()).unwrap_or(line);
            self.check_keys(r, REPLACES_KEYS);
            let replaced = self.string(r, "name").unwrap_or_default();
            if replaced.is_empty() {
                self.error(r_line, "should not have an empty replaces entry");
            } else if replaced == name {
                self.error(
                    r_line,
                    "replaces should not contain name of same descriptor",
                );
            }
            replaces.push(replaced);
        }
        let requests_per_unit = self.number(map, "requests_per_unit").unwrap_or(0);
        let multiplier_node = map.get_node("unit_multiplier").map(line_of);
        let unit_multiplier = self.number(map, "unit_multiplier").unwrap_or(1);
        if unit_multiplier == 0 {
            self.error(
                multiplier_node.unwrap_or(line),
                "unit_multiplier must be at least 1",
            );
        } else if unit
            .is_some_and(|u| u.seconds() * u64::from(unit_multiplier) > LONGEST_WINDOW_SECONDS)
        {
            self.error(
                multiplier_node.unwrap_or(line),
                format!(
                    "unit_multiplier {unit_multiplier} makes the window longer than {} days (10 years)",
                    LONGEST_WINDOW_SECONDS / 86_400
                ),
            );
        }
        let algorithm_text = self.string(map, "algorithm");
        let algorithm = match algorithm_text.as_deref() {
            None => Some(Algorithm::FixedWindow),
            Some(a) => Algorithm::parse(a),
        };
        if algorithm.is_none() {
            self.error(
                map.get_node("algorithm").map(line_of).unwrap_or(line),
                format!(
                    "invalid algorithm '{}' (expected {})",
                    algorithm_text.unwrap_or_default(),
                    Algorithm::NAMES
                ),
            );
        }
        let requests_line = map
            .get_node("requests_per_unit")
            .map(line_of)
            .unwrap_or(line);
        let burst_line = map.get_node("burst").map(line_of).unwrap_or(requests_line);
        let burst = self.number(map, "burst");
        if let (Some(algorithm), Some(unit)) = (algorithm, unit) {
            let window_ms = (unit.seconds() * 1000).saturating_mul(u64::from(unit_multiplier));
            self.algorithm_bounds(
                algorithm,
                requests_per_unit,
                burst,
                window_ms,
                requests_line,
                burst_line,
            );
        }
        let calendar = map
            .get_node("calendar")
            .and_then(|node| self.calendar(node, unit, unit_multiplier, algorithm, unlimited));
        if unlimited {
            if unit.is_some() {
                self.error(line, "should not specify rate limit unit when unlimited");
            }
            return (self.errors.len() == errors_before).then_some(RuleLimit {
                name,
                replaces,
                limit: None,
            });
        }
        let Some(unit) = unit else {
            self.error(
                map.get_node("unit").map(line_of).unwrap_or(line),
                format!("invalid rate limit unit '{unit_text}'"),
            );
            return None;
        };
        let limit = Limit {
            name: name.clone(),
            requests_per_unit,
            unit,
            unit_multiplier,
            algorithm: algorithm?,
            burst: burst.unwrap_or(requests_per_unit),
            calendar,
        };
        (self.errors.len() == errors_before).then_some(RuleLimit {
            name,
            replaces,
            limit: Some(limit),
        })
    }

    /// A limit's `calendar`: `true` (UTC, months from the 1st, weeks from Monday) or a mapping
    /// of `time_zone`, `anchor_day` (a month's) and `week_starts` (a week's), for a
    /// `fixed_window` of one day, week, month or year.
    fn calendar(
        &mut self,
        node: &Node,
        unit: Option<Unit>,
        unit_multiplier: u32,
        algorithm: Option<Algorithm>,
        unlimited: bool,
    ) -> Option<Calendar> {
        let line = line_of(node);
        let (zone, anchor_day, week_starts) = match (node.as_scalar(), node.as_mapping()) {
            (Some(s), _) if is_null(s) => return None,
            (Some(s), _) => match s.as_bool() {
                Some(false) => return None,
                Some(true) => ("UTC".to_owned(), 1, Weekday::Monday),
                None => {
                    self.error(line, CALENDAR_SHAPE);
                    return None;
                }
            },
            (None, Some(map)) => {
                self.check_keys(map, CALENDAR_KEYS);
                let at = |key: &str| map.get_node(key).map_or(line, line_of);
                let zone = self
                    .string(map, "time_zone")
                    .unwrap_or_else(|| "UTC".to_owned());
                let anchor_day = self.number(map, "anchor_day");
                if anchor_day.is_some() && unit != Some(Unit::Month) {
                    self.error(
                        at("anchor_day"),
                        "calendar: anchor_day applies to unit: month",
                    );
                }
                let anchor_day = match anchor_day {
                    None => 1,
                    Some(day @ 1..=31) => day as u8,
                    Some(day) => {
                        self.error(
                            at("anchor_day"),
                            format!("calendar: anchor_day must be from 1 to 31, not {day} (a month too short for it starts on its last day)"),
                        );
                        return None;
                    }
                };
                let week_starts = match self.string(map, "week_starts") {
                    None => Weekday::Monday,
                    Some(day) => {
                        if unit != Some(Unit::Week) {
                            self.error(
                                at("week_starts"),
                                "calendar: week_starts applies to unit: week",
                            );
                        }
                        let Some(weekday) = calendar::parse_weekday(&day) else {
                            self.error(
                                at("week_starts"),
                                format!("calendar: invalid week_starts '{day}' (monday to sunday)"),
                            );
                            return None;
                        };
                        weekday
                    }
                };
                (zone, anchor_day, week_starts)
            }
            (None, None) => {
                self.error(line, CALENDAR_SHAPE);
                return None;
            }
        };
        if unlimited {
            self.error(line, "should not specify a calendar when unlimited");
            return None;
        }
        match unit {
            Some(Unit::Day | Unit::Week | Unit::Month | Unit::Year) => {}
            Some(other) => {
                self.error(
                    line,
                    format!(
                        "a calendar window is a day, a week, a month or a year, not {} {}",
                        if other == Unit::Hour { "an" } else { "a" },
                        other.name()
                    ),
                );
                return None;
            }
            None => return None,
        }
        if unit_multiplier != 1 {
            self.error(
                line,
                format!(
                    "a calendar window is one {}: unit_multiplier must be 1, not {unit_multiplier}",
                    unit?.name()
                ),
            );
        }
        if let Some(other) = algorithm.filter(|&a| a != Algorithm::FixedWindow) {
            self.error(
                line,
                format!(
                    "calendar windows count with fixed_window, not {} ({})",
                    other.name(),
                    match other {
                        Algorithm::SlidingWindow => "a sliding window weighs windows of one length",
                        Algorithm::SlidingLog => "a log has no window to start",
                        _ => "a bucket has no window to start",
                    }
                ),
            );
        }
        match Calendar::new(&zone, anchor_day, week_starts) {
            Ok(calendar) => Some(calendar),
            Err(message) => {
                let at = node
                    .as_mapping()
                    .and_then(|m| m.get_node("time_zone"))
                    .map_or(line, line_of);
                self.error(at, format!("calendar: {message}"));
                None
            }
        }
    }

    /// What each algorithm bounds: `burst` belongs to buckets, at least 1 and small enough for
    /// exact bucket arithmetic; a sliding log's limit bounds the entries it keeps.
    fn algorithm_bounds(
        &mut self,
        algorithm: Algorithm,
        requests_per_unit: u32,
        burst: Option<u32>,
        window_ms: u64,
        requests_line: usize,
        burst_line: usize,
    ) {
        if burst.is_some() && !algorithm.is_bucket() {
            self.error(
                burst_line,
                format!(
                    "burst applies to token_bucket and leaky_bucket, not {}",
                    algorithm.name()
                ),
            );
        }
        if burst == Some(0) {
            self.error(burst_line, "burst must be at least 1");
        }
        let held = u64::from(burst.unwrap_or(requests_per_unit));
        if algorithm.is_bucket() && held.saturating_mul(window_ms) > gcra::MOST_UNITS {
            self.error(
                burst_line,
                format!(
                    "a {} holding {held} over a {} s window is beyond exact arithmetic (burst × window in ms must be at most 2^51)",
                    algorithm.name(),
                    window_ms / 1000
                ),
            );
        }
        if algorithm == Algorithm::SlidingLog && requests_per_unit > log::MOST_ENTRIES {
            self.error(
                requests_line,
                format!(
                    "sliding_log keeps an entry per hit: requests_per_unit must be at most {} (this one is {requests_per_unit})",
                    log::MOST_ENTRIES
                ),
            );
        }
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

    #[test]
    fn quota_buckets_parse_with_sorted_keys_and_any_value_keys() {
        let d = ok(
            "domain: d\nquota_buckets:\n  - bucket: {tenant: ~, name: per-tenant}\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 60}\n  - bucket: {name: open}\n    rate_limit: {unlimited: true}\n",
        );
        assert_eq!(d.quota_buckets.len(), 2);
        let q = &d.quota_buckets[0];
        assert_eq!(q.line, 3);
        assert_eq!(
            q.bucket,
            [
                ("name".into(), Some("per-tenant".into())),
                ("tenant".into(), None)
            ]
        );
        assert!(q.shadow);
        assert_eq!(q.limit.as_ref().map(|l| l.requests_per_unit), Some(60));
        assert!(d.quota_buckets[1].limit.is_none());
    }

    #[test]
    fn a_lease_applies_to_window_limits_only() {
        let rule = |algorithm: &str, lease: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: k\n    lease: {lease}\n    rate_limit: {{unit: second, requests_per_unit: 5, algorithm: {algorithm}}}\n"
            )
        };
        assert_eq!(
            ok(&rule("sliding_window", "auto")).descriptors[0].lease,
            Some(Leasing::Auto)
        );
        assert!(errors(&rule("fixed_window", "off")).is_empty());
        assert_eq!(
            errors(&rule("token_bucket", "auto")),
            [
                "r.yaml:4: lease: auto cannot apply to a token_bucket limit: only fixed_window and sliding_window limits can be leased"
            ]
        );
        assert_eq!(
            errors(&rule("fixed_window", "always")),
            ["r.yaml:4: invalid lease 'always': auto or off"]
        );
    }

    #[test]
    fn a_calendar_window_reads_its_zone_anchor_and_first_weekday() {
        let rules = ok(
            "domain: d\ndescriptors:\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 5, calendar: {time_zone: Europe/Berlin, anchor_day: 31}}\n  - key: w\n    rate_limit: {unit: week, requests_per_unit: 5, calendar: {week_starts: Sunday}}\n  - key: d\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: true}\n  - key: off\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: false}\n",
        );
        let calendar = |i: usize| {
            rules.descriptors[i].limits[0]
                .limit
                .as_ref()
                .unwrap()
                .calendar
                .clone()
        };
        let month = calendar(0).expect("on the calendar");
        assert_eq!(
            (month.time_zone(), month.anchor_day()),
            ("Europe/Berlin", 31)
        );
        let week = calendar(1).expect("on the calendar");
        assert_eq!(
            (week.time_zone(), week.week_starts()),
            ("UTC", Weekday::Sunday)
        );
        assert_eq!(calendar(2).expect("on the calendar").time_zone(), "UTC");
        assert_eq!(calendar(3), None);
    }

    #[test]
    fn a_calendar_window_that_makes_no_sense_is_an_error_at_its_line() {
        let rule = |limit: &str| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      {limit}\n")
        };
        let cases = [
            (
                "{unit: second, requests_per_unit: 5, calendar: true}",
                "a calendar window is a day, a week, a month or a year, not a second",
            ),
            (
                "{unit: hour, requests_per_unit: 5, calendar: {time_zone: UTC}}",
                "a calendar window is a day, a week, a month or a year, not an hour",
            ),
            (
                "{unit: day, requests_per_unit: 5, unit_multiplier: 2, calendar: true}",
                "a calendar window is one day: unit_multiplier must be 1, not 2",
            ),
            (
                "{unit: month, requests_per_unit: 5, algorithm: sliding_window, calendar: true}",
                "calendar windows count with fixed_window, not sliding_window (a sliding window weighs windows of one length)",
            ),
            (
                "{unit: month, requests_per_unit: 5, algorithm: token_bucket, calendar: true}",
                "calendar windows count with fixed_window, not token_bucket (a bucket has no window to start)",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {time_zone: Europe/Berln}}",
                "calendar: unknown time zone 'Europe/Berln' (an IANA name such as Europe/Berlin, or UTC)",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {anchor_day: 32}}",
                "calendar: anchor_day must be from 1 to 31, not 32 (a month too short for it starts on its last day)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {anchor_day: 3}}",
                "calendar: anchor_day applies to unit: month",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {week_starts: sunday}}",
                "calendar: week_starts applies to unit: week",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {week_starts: someday}}",
                "calendar: invalid week_starts 'someday' (monday to sunday)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: weekly}",
                "'calendar' must be true or a mapping (time_zone, anchor_day, week_starts)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {zone: UTC}}",
                "config error, unknown key 'zone'",
            ),
            (
                "{unlimited: true, calendar: true}",
                "should not specify a calendar when unlimited",
            ),
        ];
        for (limit, message) in cases {
            assert_eq!(
                errors(&rule(limit)),
                [format!("r.yaml:5: {message}")],
                "{limit}"
            );
        }
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {k: ~}\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: true}\n"
            ),
            ["r.yaml:4: 'calendar' does not apply to a quota bucket's limit"]
        );
    }

    #[test]
    fn bad_quota_buckets_are_errors_at_their_lines() {
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - rate_limit: {unit: second, requests_per_unit: 1}\n"
            ),
            ["r.yaml:3: a quota bucket needs 'bucket', a mapping of keys to values"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {}\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
            ),
            ["r.yaml:3: 'bucket' must be a mapping of keys to values, with one key at least"]
        );
        assert_eq!(
            errors("domain: d\nquota_buckets:\n  - bucket: {name: a}\n"),
            ["r.yaml:3: a quota bucket needs a 'rate_limit'"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit:\n      unit: second\n      algorithm: sliding_log\n"
            ),
            ["r.yaml:6: 'algorithm' does not apply to a quota bucket's limit"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit: {unit: fortnight}\n"
            ),
            ["r.yaml:4: invalid rate limit unit 'fortnight'"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a, t: [1]}\n    rate_limit: {unit: second}\n"
            ),
            ["r.yaml:3: the value of bucket key 't' must be a string, or ~ for any value"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {b: x, a: y}\n    rate_limit: {unit: second}\n  - bucket: {a: y, b: x}\n    rate_limit: {unit: minute}\n"
            ),
            ["r.yaml:5: duplicate quota bucket 'a_y.b_x' (first at line 3)"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit: {unit: second}\n    colour: red\n"
            ),
            ["r.yaml:5: config error, unknown key 'colour'"]
        );
    }

    #[test]
    fn a_rule_names_its_scope_and_a_replica_scope_takes_no_lease() {
        let rule = |extra: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: k\n{extra}    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
            )
        };
        for name in ["global", "cluster", "replica", "split"] {
            let (domain, _) = parse(Path::new("r.yaml"), &rule(&format!("    scope: {name}\n")))
                .expect("a valid scope");
            assert_eq!(domain.descriptors[0].scope, Scope::parse(name));
        }
        assert_eq!(
            errors(&rule("    scope: region\n")),
            ["r.yaml:4: invalid scope 'region': global, cluster, replica or split"]
        );
        assert_eq!(
            errors(&rule("    scope: replica\n    lease: auto\n")),
            [
                "r.yaml:4: scope: replica counts in the replica's own memory, which takes no leased block (lease: auto)"
            ]
        );
        assert!(errors(&rule("    scope: cluster\n    lease: auto\n")).is_empty());
    }
}
