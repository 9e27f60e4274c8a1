//! The rules in force, written out for operators: as JSON (`/config`: every domain and rule with
//! its source file and line, the files' hashes and the load time) and as text, one line per
//! limit, in envoyproxy/ratelimit's `/rlconfig` format. Each is rendered once per rule set, in
//! time and size linear in the rules: the JSON is indented down to `PRETTY_DEPTH` levels only.

use std::io;
use std::sync::OnceLock;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use serde::Serialize;
use serde_json::ser::Formatter;
use serde_json::{Value, json};

use super::RuleSet;
use crate::config::{DescriptorConfig, DomainConfig, QuotaBucketConfig, RuleLimit, quota_path};
use crate::limiter::{Algorithm, Limit, Mode};

/// The dumps of one rule set, once rendered.
#[derive(Default)]
pub(super) struct Rendered {
    json: OnceLock<Bytes>,
    text: OnceLock<Bytes>,
}

impl RuleSet {
    /// `dump_json` as pretty text (`/config`), rendered on the first call.
    pub fn rendered_json(&self) -> Bytes {
        self.rendered
            .json
            .get_or_init(|| {
                let mut text = Vec::new();
                let mut json = serde_json::Serializer::with_formatter(&mut text, Layout::default());
                // Writing JSON values to memory cannot fail.
                let _ = self.dump_json().serialize(&mut json);
                text.push(b'\n');
                Bytes::from(text)
            })
            .clone()
    }

    /// `dump_text` (`/rlconfig`), rendered on the first call.
    pub fn rendered_text(&self) -> Bytes {
        self.rendered
            .text
            .get_or_init(|| Bytes::from(self.dump_text()))
            .clone()
    }

    /// The rules as JSON.
    pub(crate) fn dump_json(&self) -> Value {
        let origin = &self.origin;
        let loaded_at = origin
            .loaded_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut domains = self.sources.domains();
        domains.sort_by(|a, b| a.domain.cmp(&b.domain));
        json!({
            "hash": origin.hash,
            "loaded_at": humantime::format_rfc3339_millis(origin.loaded_at).to_string(),
            "loaded_at_unix": loaded_at.as_secs_f64(),
            "files": origin.files.iter().map(|(path, sha256)| json!({
                "path": path.display().to_string(),
                "sha256": sha256,
            })).collect::<Vec<_>>(),
            "domains": domains.iter().map(domain_json).collect::<Vec<_>>(),
        })
    }

    /// The rules as envoyproxy/ratelimit's `/rlconfig` text: per limit,
    /// `domain.path: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false`,
    /// followed by what that format cannot say (`name`, `unit_multiplier`, `algorithm`) when set.
    pub(crate) fn dump_text(&self) -> String {
        let mut domains = self.sources.domains();
        domains.sort_by(|a, b| a.domain.cmp(&b.domain));
        let mut out = String::new();
        for d in &domains {
            for descriptor in &d.descriptors {
                text_lines(&d.domain, descriptor, &mut out);
            }
        }
        out
    }
}

/// How deep the JSON of `/config` is laid out a value per line, indented; deeper values are
/// written compactly. Every rule down to the third level of nesting is laid out in full; deep
/// `metadata` or rules cannot make the text grow with the square of their depth.
const PRETTY_DEPTH: usize = 12;

/// serde_json's pretty layout (two spaces per level) down to `PRETTY_DEPTH`, compact below.
#[derive(Default)]
struct Layout {
    depth: usize,
    has_value: bool,
}

impl Layout {
    fn pretty(&self) -> bool {
        self.depth <= PRETTY_DEPTH
    }

    fn open<W: ?Sized + io::Write>(&mut self, out: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        out.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, out: &mut W, bracket: &[u8]) -> io::Result<()> {
        let pretty = self.pretty();
        self.depth -= 1;
        if self.has_value && pretty {
            self.new_line(out)?;
        }
        out.write_all(bracket)
    }

    /// Before a value of an array or a key of an object.
    fn next<W: ?Sized + io::Write>(&mut self, out: &mut W, first: bool) -> io::Result<()> {
        if !first {
            out.write_all(b",")?;
        }
        if self.pretty() {
            self.new_line(out)?;
        }
        Ok(())
    }

    fn new_line<W: ?Sized + io::Write>(&self, out: &mut W) -> io::Result<()> {
        out.write_all(b"\n")?;
        for _ in 0..self.depth {
            out.write_all(b"  ")?;
        }
        Ok(())
    }
}

impl Formatter for Layout {
    fn begin_array<W: ?Sized + io::Write>(&mut self, out: &mut W) -> io::Result<()> {
        self.open(out, b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, out: &mut W) -> io::Result<()> {
        self.close(out, b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        out: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.next(out, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, out: &mut W) -> io::Result<()> {
        self.open(out, b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, out: &mut W) -> io::Result<()> {
        self.close(out, b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        out: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.next(out, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, out: &mut W) -> io::Result<()> {
        out.write_all(if self.pretty() { b": " } else { b":" })
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// A domain as JSON: its rules, and its quota bucket rules when it has some.
fn domain_json(d: &DomainConfig) -> Value {
    let mut domain = json!({
        "domain": d.domain,
        "file": d.file.display().to_string(),
        "line": line(d.line),
        "descriptors": d.descriptors.iter().map(descriptor_json).collect::<Vec<_>>(),
    });
    if !d.quota_buckets.is_empty() {
        domain.as_object_mut().expect("an object").insert(
            "quota_buckets".into(),
            d.quota_buckets.iter().map(quota_json).collect(),
        );
    }
    domain
}

/// A rule's line in its file; `null` for rules over xDS, which have none.
fn line(line: usize) -> Value {
    if line == 0 { Value::Null } else { json!(line) }
}

fn descriptor_json(d: &DescriptorConfig) -> Value {
    let mut node = json!({ "key": d.key, "line": line(d.line) });
    let fields = node.as_object_mut().expect("an object");
    if let Some(v) = &d.value {
        fields.insert("value".into(), json!(v));
    }
    if !d.limits.is_empty() {
        fields.insert(
            "rate_limits".into(),
            d.limits.iter().map(rule_limit_json).collect(),
        );
    }
    if d.mode.is_shadow() {
        fields.insert("shadow_mode".into(), json!(true));
    }
    if matches!(d.mode, Mode::Quota | Mode::ShadowQuota) {
        fields.insert("quota_mode".into(), json!(true));
    }
    if let Some(scope) = d.scope {
        fields.insert("scope".into(), json!(scope.name()));
    }
    if let Some(lease) = d.lease {
        fields.insert("lease".into(), json!(lease.name()));
    }
    if let Some(counting) = d.counting {
        fields.insert("counting".into(), json!(counting.name()));
    }
    if let Some(hold) = &d.hold {
        fields.insert("hold".into(), hold.json());
    }
    if !d.weights.is_empty() {
        let weights: Vec<Value> = d.weights.iter().map(|w| w.json()).collect();
        fields.insert("weights".into(), Value::Array(weights));
    }
    for (flag, on) in [
        ("share_threshold", d.share_threshold),
        ("detailed_metric", d.detailed_metric),
        ("value_to_metric", d.value_to_metric),
    ] {
        if on {
            fields.insert(flag.into(), json!(true));
        }
    }
    if let Some(m) = &d.metadata {
        fields.insert("metadata".into(), m.clone());
    }
    if !d.descriptors.is_empty() {
        fields.insert(
            "descriptors".into(),
            d.descriptors.iter().map(descriptor_json).collect(),
        );
    }
    node
}

fn quota_json(q: &QuotaBucketConfig) -> Value {
    let bucket: serde_json::Map<String, Value> = q
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    json!({
        "bucket": bucket,
        "rule": quota_path(&q.bucket),
        "line": line(q.line),
        "rate_limit": q.limit.as_ref().map_or(json!({ "unlimited": true }), limit_json),
        "shadow_mode": q.shadow,
    })
}

/// A rule's limit as JSON: `limit_json` of it, or `unlimited`, with its `name` and `replaces`.
pub fn rule_limit_json(l: &RuleLimit) -> Value {
    let mut limit = match &l.limit {
        None => json!({ "unlimited": true }),
        Some(limit) => limit_json(limit),
    };
    let fields = limit.as_object_mut().expect("an object");
    if !l.name.is_empty() {
        fields.insert("name".into(), json!(l.name));
    }
    if !l.replaces.is_empty() {
        fields.insert("replaces".into(), json!(l.replaces));
    }
    limit
}

/// A limit as JSON: unit, requests per unit, multiplier, algorithm, a bucket's burst, its name
/// when it has one.
pub fn limit_json(limit: &Limit) -> Value {
    let mut json = json!({
        "unit": limit.unit.name(),
        "requests_per_unit": limit.requests_per_unit,
        "unit_multiplier": limit.unit_multiplier,
        "algorithm": limit.algorithm.name(),
    });
    let fields = json.as_object_mut().expect("an object");
    if limit.algorithm.is_bucket() {
        fields.insert("burst".into(), json!(limit.burst));
    }
    if !limit.name.is_empty() {
        fields.insert("name".into(), json!(limit.name));
    }
    if let Some(calendar) = &limit.calendar {
        fields.insert("calendar".into(), calendar.json(limit.unit));
    }
    json
}

fn text_lines(parent: &str, d: &DescriptorConfig, out: &mut String) {
    let path = match &d.value {
        Some(v) => format!("{parent}.{}_{v}", d.key),
        None => format!("{parent}.{}", d.key),
    };
    for l in d.limits.iter() {
        let (unit, requests) = match &l.limit {
            Some(limit) => (
                limit.unit.name().to_ascii_uppercase(),
                limit.requests_per_unit,
            ),
            None => ("UNKNOWN".to_owned(), 0),
        };
        out.push_str(&format!(
            "{path}: unit={unit} requests_per_unit={requests}, shadow_mode: {}, quota_mode: {}",
            d.mode.is_shadow(),
            matches!(d.mode, Mode::Quota | Mode::ShadowQuota)
        ));
        if let Some(scope) = d.scope {
            out.push_str(&format!(", scope: {}", scope.name()));
        }
        if let Some(lease) = d.lease {
            out.push_str(&format!(", lease: {}", lease.name()));
        }
        if let Some(counting) = d.counting {
            out.push_str(&format!(", counting: {}", counting.name()));
        }
        if let Some(hold) = &d.hold {
            out.push_str(&format!(", hold: {}", hold.json()));
        }
        for weights in &d.weights {
            out.push_str(&format!(", weights: {}", weights.json()));
        }
        if !l.name.is_empty() {
            out.push_str(&format!(", name: {}", l.name));
        }
        if let Some(limit) = &l.limit {
            if limit.unit_multiplier != 1 {
                out.push_str(&format!(", unit_multiplier: {}", limit.unit_multiplier));
            }
            if limit.algorithm != Algorithm::FixedWindow {
                out.push_str(&format!(", algorithm: {}", limit.algorithm.name()));
            }
            if let Some(calendar) = &limit.calendar {
                out.push_str(&format!(", calendar: {}", calendar.json(limit.unit)));
            }
            if limit.algorithm.is_bucket() {
                out.push_str(&format!(", burst: {}", limit.burst));
            }
        }
        out.push('\n');
    }
    for child in &d.descriptors {
        text_lines(&path, child, out);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn rlconfig_lists_every_limit_as_envoy_ratelimit_does() {
        let yaml = "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: minute, requests_per_unit: 10}\n    descriptors:\n      - key: c\n        shadow_mode: true\n        rate_limits:\n          - {unit: second, requests_per_unit: 1, name: a}\n          - {unit: hour, requests_per_unit: 5, unit_multiplier: 2, algorithm: sliding_window}\n          - {unit: minute, requests_per_unit: 6, algorithm: token_bucket, burst: 12}\n";
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), yaml).unwrap();
        let text = RuleSet::new(vec![domain]).dump_text();
        assert_eq!(
            text,
            "d.k_v: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false\n\
             d.k_v.c: unit=SECOND requests_per_unit=1, shadow_mode: true, quota_mode: false, name: a\n\
             d.k_v.c: unit=HOUR requests_per_unit=5, shadow_mode: true, quota_mode: false, unit_multiplier: 2, algorithm: sliding_window\n\
             d.k_v.c: unit=MINUTE requests_per_unit=6, shadow_mode: true, quota_mode: false, algorithm: token_bucket, burst: 12\n"
        );
    }

    #[test]
    fn config_json_is_laid_out_as_serde_json_pretty_down_to_its_depth_then_compact() {
        let mut deep = json!([1, {"a": []}]);
        for _ in 0..PRETTY_DEPTH + 3 {
            deep = json!({ "m": deep, "n": {} });
        }
        let shallow = json!({"a": [1, {"b": null, "c": []}], "d": {}});
        let write = |value: &Value| {
            let mut text = Vec::new();
            let mut json = serde_json::Serializer::with_formatter(&mut text, Layout::default());
            value.serialize(&mut json).unwrap();
            String::from_utf8(text).unwrap()
        };
        assert_eq!(
            write(&shallow),
            serde_json::to_string_pretty(&shallow).unwrap()
        );
        let text = write(&deep);
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), deep);
        let longest = text.lines().map(str::len).max().unwrap();
        let compact = r#""m":[1,{"a":[]}],"n":{}}"#;
        assert!(text.contains(compact), "{text}");
        assert!(longest < 2 * PRETTY_DEPTH + 80, "{text}");
    }
}
