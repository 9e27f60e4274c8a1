//! Protobuf to rules: each `RateLimitConfig` resource converted straight into the typed rules
//! and validated as a rule file is, with a bounded summary of the errors.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use envoy_types::pb::google::protobuf::{Any, Struct, Value, value::Kind};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use prost::Message;

use sluice_core::config::{
    DescriptorConfig, DomainConfig, Loaded, MOST_DESCRIPTOR_DEPTH, MOST_DOMAIN_BYTES,
    MOST_METADATA_DEPTH, Received, RuleLimit, Sources, composite, domain_collisions,
    domain_too_long, hex,
};
use sluice_core::limiter::{Algorithm, Limit, Mode, Unit};

use super::{Digest, TYPE_URL};

/// The errors a rejected response shows, in the log and in its NACK; the rest are counted.
pub(super) const SHOWN_ERRORS: usize = 10;
/// The longest error shown, in bytes: a longer one (resource names and keys can be long) is cut.
pub(super) const LONGEST_ERROR: usize = 1024;

/// The rules of one xDS response, converted from protobuf straight into the typed rules: every
/// resource a `RateLimitConfig`, validated as a rule file named `xds:<resource name>` is; the
/// resources are kept as the rules' sources (`Resources`). The errors name the resource and the path of the
/// offending field (`descriptors[0].rate_limit.unit`). No resource at all is a valid, empty
/// configuration. `digests` are the SHA-256 of each resource's bytes. Public as the one entry
/// from protobuf into rules, for the fuzz targets.
pub fn convert(
    resources: Vec<Any>,
    digests: &[Digest],
    merge_domains: bool,
) -> Result<Loaded, Rejection> {
    let mut errors = Rejection::default();
    let mut loaded = Loaded::default();
    let mut kept = Vec::with_capacity(resources.len());
    for (i, (any, digest)) in resources.into_iter().zip(digests).enumerate() {
        if any.type_url != TYPE_URL {
            errors.add(|| format!("resource {i}: a {}, not a RateLimitConfig", any.type_url));
            continue;
        }
        let config = match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(config) => config,
            Err(e) => {
                errors.add(|| {
                    let named = Named::decode(any.value.as_slice()).unwrap_or_default();
                    let name = resource_name(&named.name, &named.domain, i);
                    format!("xds:{name}: not a RateLimitConfig: {}", compact(&e))
                });
                continue;
            }
        };
        kept.push(any);
        let file = PathBuf::from(format!(
            "xds:{}",
            resource_name(&config.name, &config.domain, i)
        ));
        loaded.files.push((file.clone(), hex(digest)));
        let mut resource = Resource {
            file: &file,
            domain: &config.domain,
            errors: &mut errors,
        };
        let descriptors = resource.descriptors(config.descriptors, None);
        if config.domain.is_empty() {
            resource.error(|| "domain".into(), "config file cannot have empty domain");
        } else if config.domain.len() > MOST_DOMAIN_BYTES {
            resource.error(|| "domain".into(), domain_too_long(config.domain.len()));
        }
        loaded.domains.push(DomainConfig {
            file,
            // A resource has no lines: line 0 says so wherever rules are shown.
            line: 0,
            domain: config.domain,
            descriptors,
            quota_buckets: Vec::new(),
        });
    }
    // While collisions are sought, a top-level rule's line is its index + 1: it names the rule.
    number_rules(&mut loaded.domains, true);
    for e in domain_collisions(&loaded.domains, merge_domains) {
        errors.add(|| {
            let path = match e.line {
                0 => "domain".to_owned(),
                line => format!("descriptors[{}]", line - 1),
            };
            format!("{}: {path}: {}", e.file.display(), e.message)
        });
    }
    number_rules(&mut loaded.domains, false);
    if errors.total > 0 {
        return Err(errors);
    }
    loaded.sources = Sources::Received(Box::new(Resources(kept)));
    Ok(loaded)
}

/// The resources of an accepted xDS response, kept as the rules' sources.
#[derive(Debug)]
struct Resources(Vec<Any>);

impl Received for Resources {
    fn domains(&self) -> Vec<DomainConfig> {
        // Digests name files in `Loaded`, which is not kept; domains may merge here as they did
        // when the resources were accepted.
        let digests = vec![Digest::default(); self.0.len()];
        convert(self.0.clone(), &digests, true)
            .map(|loaded| loaded.domains)
            .unwrap_or_default()
    }
}

/// Gives each top-level rule its index + 1 as its line (`numbered`), or line 0 (none).
fn number_rules(domains: &mut [DomainConfig], numbered: bool) {
    for d in domains {
        for (j, rule) in d.descriptors.iter_mut().enumerate() {
            rule.line = if numbered { j + 1 } else { 0 };
        }
    }
}

/// A resource's name: its `name`, else its domain, else its place in the response.
fn resource_name(name: &str, domain: &str, i: usize) -> String {
    [name, domain]
        .into_iter()
        .find(|n| !n.is_empty())
        .map_or_else(|| format!("#{i}"), str::to_owned)
}

/// The name and domain of a `RateLimitConfig` that does not decode in full, to name it in the
/// error: the descriptors (field 3) are skipped, not decoded.
#[derive(Clone, PartialEq, prost::Message)]
struct Named {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    domain: String,
}

/// A decoding error with each run of one field in its path said once, with its count: a message
/// nested a hundred times deep names its field once, not a hundred times.
fn compact(e: &prost::DecodeError) -> String {
    let text = e.to_string();
    let mut out = String::new();
    let mut parts = text.split(": ").peekable();
    while let Some(part) = parts.next() {
        let mut times = 1;
        while parts.peek() == Some(&part) {
            parts.next();
            times += 1;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(part);
        if times > 1 {
            let _ = write!(out, " (×{times})");
        }
    }
    out
}

/// Where a descriptor sits in its resource: its index among its siblings, under its parent,
/// `depth` levels down (1 at the top).
struct At<'a> {
    up: Option<&'a At<'a>>,
    depth: usize,
    index: usize,
    key: &'a str,
    value: Option<&'a str>,
}

impl At<'_> {
    /// The field path, `descriptors[0].descriptors[3]`.
    fn path(&self) -> String {
        let mut indices = Vec::new();
        let mut at = Some(self);
        while let Some(a) = at {
            indices.push(a.index);
            at = a.up;
        }
        let steps: Vec<String> = indices
            .iter()
            .rev()
            .map(|i| format!("descriptors[{i}]"))
            .collect();
        steps.join(".")
    }

    /// The composite key, as envoyproxy/ratelimit names a rule: `domain.key_value.key…`.
    fn composite(&self, domain: &str) -> String {
        let mut steps = Vec::new();
        let mut at = Some(self);
        while let Some(a) = at {
            steps.push(composite(a.key, a.value));
            at = a.up;
        }
        steps.push(domain.to_owned());
        steps.reverse();
        steps.join(".")
    }
}

/// Converts the descriptors of one resource into rules, validating them as a rule file's are.
struct Resource<'a> {
    file: &'a Path,
    domain: &'a str,
    errors: &'a mut Rejection,
}

impl Resource<'_> {
    fn error(&mut self, path: impl FnOnce() -> String, message: impl std::fmt::Display) {
        let file = self.file;
        self.errors
            .add(|| format!("{}: {}: {message}", file.display(), path()));
    }

    /// The rules of `protos`, the children of `up` (`None` at the top); a level deeper than
    /// `MOST_DESCRIPTOR_DEPTH` is an error and is not converted, so that this recursion is
    /// bounded whatever the resource holds.
    fn descriptors(
        &mut self,
        protos: Vec<RateLimitDescriptor>,
        up: Option<&At>,
    ) -> Vec<DescriptorConfig> {
        let mut rules = Vec::with_capacity(protos.len());
        for (index, mut proto) in protos.into_iter().enumerate() {
            let key = std::mem::take(&mut proto.key);
            let value = Some(std::mem::take(&mut proto.value)).filter(|v| !v.is_empty());
            let at = At {
                up,
                depth: up.map_or(1, |u| u.depth + 1),
                index,
                key: &key,
                value: value.as_deref(),
            };
            if key.is_empty() {
                self.error(|| at.path(), "descriptor has empty key");
            }
            let limits: Vec<RuleLimit> = proto
                .rate_limit
                .take()
                .and_then(|policy| self.limit(policy, &at))
                .into_iter()
                .collect();
            let metadata = proto.metadata.take().and_then(|m| self.metadata(m, &at));
            let descriptors = if proto.descriptors.is_empty() {
                Vec::new()
            } else if at.depth >= MOST_DESCRIPTOR_DEPTH {
                self.error(
                    || format!("{}.descriptors[0]", at.path()),
                    format_args!("descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels"),
                );
                Vec::new()
            } else {
                self.descriptors(std::mem::take(&mut proto.descriptors), Some(&at))
            };
            rules.push(DescriptorConfig {
                line: 0,
                key,
                value,
                limits: limits.into(),
                mode: match (proto.shadow_mode, proto.quota_mode) {
                    (true, true) => Mode::ShadowQuota,
                    (true, false) => Mode::Shadow,
                    (false, true) => Mode::Quota,
                    (false, false) => Mode::Enforce,
                },
                counting: None,
                lease: None,
                scope: None,
                share_threshold: false,
                detailed_metric: proto.detailed_metric,
                value_to_metric: false,
                metadata,
                hold: None,
                weights: Vec::new(),
                descriptors,
            });
        }
        let mut distinct = HashSet::with_capacity(rules.len());
        for (index, rule) in rules.iter().enumerate() {
            if !distinct.insert((rule.key.as_str(), rule.value.as_deref())) {
                let at = At {
                    up,
                    depth: up.map_or(1, |u| u.depth + 1),
                    index,
                    key: &rule.key,
                    value: rule.value.as_deref(),
                };
                let domain = self.domain;
                self.error(
                    || at.path(),
                    format_args!(
                        "duplicate descriptor composite key '{}'",
                        at.composite(domain)
                    ),
                );
            }
        }
        rules
    }

    /// The limit of `policy`, validated as a rule file's `rate_limit` is; `None` when invalid.
    fn limit(&mut self, policy: RateLimitPolicy, at: &At) -> Option<RuleLimit> {
        let errors_before = self.errors.total;
        let field = |name: &'static str| move || format!("{}.rate_limit{name}", at.path());
        // UNKNOWN is how a proto says "no unit": what an unlimited limit has.
        let (unit, unit_text) = match RateLimitUnit::try_from(policy.unit) {
            Ok(RateLimitUnit::Unknown) => (None, "UNKNOWN".to_owned()),
            Ok(unit) => (
                Unit::parse(unit.as_str_name()),
                unit.as_str_name().to_owned(),
            ),
            Err(_) => (None, policy.unit.to_string()),
        };
        let mut replaces = Vec::with_capacity(policy.replaces.len());
        for (j, r) in policy.replaces.into_iter().enumerate() {
            let at_replace = || format!("{}.rate_limit.replaces[{j}]", at.path());
            if r.name.is_empty() {
                self.error(at_replace, "should not have an empty replaces entry");
            } else if r.name == policy.name {
                self.error(
                    at_replace,
                    "replaces should not contain name of same descriptor",
                );
            }
            replaces.push(r.name);
        }
        let limit = if policy.unlimited {
            if unit.is_some() {
                self.error(
                    field(".unit"),
                    "should not specify rate limit unit when unlimited",
                );
            }
            None
        } else {
            let Some(unit) = unit else {
                self.error(
                    field(".unit"),
                    format_args!("invalid rate limit unit '{unit_text}'"),
                );
                return None;
            };
            Some(Limit {
                name: policy.name.clone(),
                requests_per_unit: policy.requests_per_unit,
                unit,
                unit_multiplier: 1,
                algorithm: Algorithm::FixedWindow,
                burst: policy.requests_per_unit,
                calendar: None,
            })
        };
        (self.errors.total == errors_before).then_some(RuleLimit {
            name: policy.name,
            replaces,
            limit,
        })
    }

    /// The metadata as JSON (a `Struct` needs no other validation); nested deeper than
    /// `MOST_METADATA_DEPTH` (the mapping itself is level 1), an error.
    fn metadata(&mut self, metadata: Struct, at: &At) -> Option<serde_json::Value> {
        let json = object(metadata, 1);
        if json.is_none() {
            self.error(
                || format!("{}.metadata", at.path()),
                format_args!("metadata nests deeper than {MOST_METADATA_DEPTH} levels"),
            );
        }
        json
    }
}

/// A `Struct` at nesting `depth` as JSON; `None` if it nests deeper than `MOST_METADATA_DEPTH`,
/// where the recursion stops.
fn object(s: Struct, depth: usize) -> Option<serde_json::Value> {
    if depth > MOST_METADATA_DEPTH {
        return None;
    }
    let mut map = serde_json::Map::with_capacity(s.fields.len());
    for (k, v) in s.fields {
        map.insert(k, json(v, depth)?);
    }
    Some(serde_json::Value::Object(map))
}

/// A `Value` inside a container at nesting `depth` as JSON.
fn json(v: Value, depth: usize) -> Option<serde_json::Value> {
    Some(match v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 2f64.powi(53) => {
            serde_json::Value::from(n as i64)
        }
        Some(Kind::NumberValue(n)) => serde_json::Value::from(n),
        Some(Kind::StringValue(s)) => serde_json::Value::from(s),
        Some(Kind::BoolValue(b)) => serde_json::Value::from(b),
        Some(Kind::StructValue(s)) => object(s, depth + 1)?,
        Some(Kind::ListValue(l)) => {
            if depth + 1 > MOST_METADATA_DEPTH {
                return None;
            }
            let items = l.values.into_iter().map(|v| json(v, depth + 1));
            serde_json::Value::Array(items.collect::<Option<_>>()?)
        }
    })
}

/// Why a response was rejected: its first errors, each naming its resource and where in it, and
/// how many there were in all. Its text is bounded, whatever the response held.
#[derive(Debug, Default)]
pub struct Rejection {
    pub(super) shown: Vec<String>,
    total: usize,
}

impl Rejection {
    /// Counts one error; `describe` is called only for the first `SHOWN_ERRORS`.
    pub(super) fn add(&mut self, describe: impl FnOnce() -> String) {
        self.total += 1;
        if self.shown.len() < SHOWN_ERRORS {
            self.shown.push(clip(&describe()));
        }
    }

    /// The NACK's `error_detail.message`: the errors shown, one per line, then how many more.
    pub(super) fn message(&self) -> String {
        let mut text = self.shown.join("\n");
        let hidden = self.total - self.shown.len();
        if hidden > 0 {
            let _ = write!(text, "\nand {hidden} more: {} errors in all", self.total);
        }
        text
    }

    /// How many errors, then those shown and how many more, on one line: for the log.
    pub fn summary(&self) -> String {
        let plural = if self.total == 1 { "" } else { "s" };
        let mut text = format!("{} error{plural}: {}", self.total, self.shown.join("; "));
        let hidden = self.total - self.shown.len();
        if hidden > 0 {
            let _ = write!(text, "; and {hidden} more");
        }
        text
    }
}

/// `error` as it is shown: control characters escaped (one error, one line), at most
/// `LONGEST_ERROR` bytes.
pub(super) fn clip(error: &str) -> String {
    let mut out = String::with_capacity(error.len().min(LONGEST_ERROR));
    for c in error.chars() {
        let before = out.len();
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        if out.len() > LONGEST_ERROR {
            out.truncate(before);
            out.push('…');
            break;
        }
    }
    out
}
