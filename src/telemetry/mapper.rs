//! statsd_exporter's mapping (`--prometheus-mapper`): how envoyproxy/ratelimit's statsd names
//! (`ratelimit.service.rate_limit.<domain>.<key>….total_hits`) become Prometheus names and
//! labels. Parsed once at start; glob mappings are tried first, then regex mappings, each kind
//! in file order, first match wins, as statsd_exporter maps them.

use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{LoaderOptions, Node};
use regex::Regex;

/// Prometheus' default histogram buckets (client_golang's `DefBuckets`), statsd_exporter's
/// default for timers.
const DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const TOP_KEYS: &[&str] = &["mappings", "defaults"];
const DEFAULT_KEYS: &[&str] = &[
    "match_type",
    "timer_type",
    "observer_type",
    "buckets",
    "histogram_options",
    // Accepted and without effect here.
    "glob_disable_ordering",
    "ttl",
    "quantiles",
    "summary_options",
];
const MAPPING_KEYS: &[&str] = &[
    "match",
    "name",
    "labels",
    "match_type",
    "match_metric_type",
    "timer_type",
    "observer_type",
    "buckets",
    "histogram_options",
    "scale",
    "action",
    "help",
    // Accepted and without effect here.
    "ttl",
    "quantiles",
    "summary_options",
    "honor_labels",
];

/// The kind of a statsd event, as `match_metric_type` selects it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// A timer (`ms`) or histogram event.
    Observer,
}

/// A parsed mapping file.
#[derive(Debug)]
pub struct Mapper {
    /// Glob mappings in file order, then regex mappings in file order.
    mappings: Vec<Mapping>,
    /// How an observer event no mapping names is written.
    default_buckets: Vec<f64>,
}

#[derive(Debug)]
struct Mapping {
    matcher: Matcher,
    name: String,
    labels: Vec<(String, String)>,
    drop: bool,
    kind: Option<Kind>,
    buckets: Vec<f64>,
    scale: Option<f64>,
    help: Option<String>,
}

#[derive(Debug)]
enum Matcher {
    /// Dot-separated parts; `None` is a `*`, which captures one whole part.
    Glob(Vec<Option<String>>),
    /// Unanchored, as Go's `FindStringSubmatchIndex` searches.
    Regex(Regex),
}

/// What a statsd name becomes.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The Prometheus name, escaped as statsd_exporter escapes it.
    pub name: String,
    /// Label pairs, sorted by name.
    pub labels: Vec<(String, String)>,
    /// Whether a mapping named it (else it is the escaped statsd name).
    pub mapped: bool,
    /// For an observer event: the histogram's upper bounds and the factor each observation is
    /// multiplied by.
    pub buckets: Vec<f64>,
    pub scale: Option<f64>,
    pub help: Option<String>,
}

impl Mapper {
    /// envoyproxy/ratelimit's built-in mapping.
    pub fn erl_default() -> Mapper {
        Mapper::parse(include_str!("erl_default_mapper.yaml"))
            .expect("the shipped default mapping parses")
    }

    /// Parses a statsd_exporter mapping file; an error names the line.
    pub fn parse(text: &str) -> Result<Mapper, String> {
        let options = LoaderOptions::default().error_on_duplicate_keys(true);
        let root = marked_yaml::parse_yaml_with_options(0, text, options)
            .map_err(|e| format!("not a YAML mapping file: {e}"))?;
        let root = root
            .as_mapping()
            .ok_or("line 1: the top level must be a mapping")?;
        known_keys(root, TOP_KEYS)?;
        let mut defaults = Defaults {
            regex: false,
            buckets: DEFAULT_BUCKETS.to_vec(),
        };
        if let Some(d) = root.get_node("defaults") {
            let d = d
                .as_mapping()
                .ok_or_else(|| format!("line {}: defaults must be a mapping", line(d)))?;
            known_keys(d, DEFAULT_KEYS)?;
            defaults.regex = match_type(d)?.unwrap_or(false);
            if let Some(b) = buckets(d)? {
                defaults.buckets = b;
            }
        }
        let mut globs = Vec::new();
        let mut regexes = Vec::new();
        if let Some(list) = root.get_node("mappings") {
            let list = list
                .as_sequence()
                .ok_or_else(|| format!("line {}: mappings must be a list", line(list)))?;
            for node in list.iter() {
                let m = node
                    .as_mapping()
                    .ok_or_else(|| format!("line {}: a mapping must be a mapping", line(node)))?;
                let mapping =
                    mapping(m, &defaults).map_err(|e| format!("line {}: {e}", line(node)))?;
                match mapping.matcher {
                    Matcher::Glob(_) => globs.push(mapping),
                    Matcher::Regex(_) => regexes.push(mapping),
                }
            }
        }
        globs.extend(regexes);
        Ok(Mapper {
            mappings: globs,
            default_buckets: defaults.buckets,
        })
    }

    /// What the statsd event `name` of `kind` becomes; `None` when a mapping drops it or names
    /// it with nothing.
    pub fn map(&self, name: &str, kind: Kind) -> Option<Series> {
        for m in &self.mappings {
            if m.kind.is_some_and(|k| k != kind) {
                continue;
            }
            let Some((series, labels)) = m.apply(name) else {
                continue;
            };
            if m.drop {
                return None;
            }
            let series = escape(&series);
            if series.is_empty() {
                return None;
            }
            return Some(Series {
                name: series,
                labels,
                mapped: true,
                buckets: m.buckets.clone(),
                scale: m.scale,
                help: m.help.clone(),
            });
        }
        Some(Series {
            name: escape(name),
            labels: Vec::new(),
            mapped: false,
            buckets: self.default_buckets.clone(),
            scale: None,
            help: None,
        })
    }
}

struct Defaults {
    regex: bool,
    buckets: Vec<f64>,
}

impl Mapping {
    /// The expanded name and labels when `name` matches.
    fn apply(&self, name: &str) -> Option<(String, Vec<(String, String)>)> {
        let expand: Box<dyn Fn(&str) -> String> = match &self.matcher {
            Matcher::Glob(parts) => {
                let fields: Vec<&str> = name.split('.').collect();
                if fields.len() != parts.len() {
                    return None;
                }
                let mut captures = Vec::new();
                for (part, field) in parts.iter().zip(&fields) {
                    match part {
                        None => captures.push(*field),
                        Some(literal) if literal == field => {}
                        Some(_) => return None,
                    }
                }
                Box::new(move |template| glob_expand(template, &captures))
            }
            Matcher::Regex(regex) => {
                let captures = regex.captures(name)?;
                Box::new(move |template| {
                    let mut out = String::new();
                    captures.expand(template, &mut out);
                    out
                })
            }
        };
        let mut labels: Vec<(String, String)> = self
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), expand(v)))
            .collect();
        labels.sort();
        Some((expand(&self.name), labels))
    }
}

/// `$1` or `${1}` in `template` replaced by the glob's captures (nothing past the last).
fn glob_expand(template: &str, captures: &[&str]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (digits, skip) = match after.strip_prefix('{') {
            Some(inner) => {
                let n = inner.bytes().take_while(u8::is_ascii_digit).count();
                if n > 0 && inner[n..].starts_with('}') {
                    (&inner[..n], n + 2)
                } else {
                    ("", 0)
                }
            }
            None => {
                let n = after.bytes().take_while(u8::is_ascii_digit).count();
                (&after[..n], n)
            }
        };
        match digits.parse::<usize>() {
            Ok(i) => {
                if let Some(c) = i.checked_sub(1).and_then(|i| captures.get(i)) {
                    out.push_str(c);
                }
                rest = &after[skip..];
            }
            Err(_) => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// statsd_exporter's `EscapeMetricName`: a leading digit gets a `_` before it, every character
/// but ASCII letters, digits and `_` becomes `_`, and a `-` right after a `-` is dropped.
pub fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 1);
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        out.push('_');
    }
    let mut previous = None;
    for c in name.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            out.push(c);
        } else if !(c == '-' && previous == Some('-')) {
            out.push('_');
        }
        previous = Some(c);
    }
    out
}

fn line(node: &Node) -> usize {
    node.span().start().map_or(1, |m| m.line())
}

fn scalar_line(node: &MarkedScalarNode) -> usize {
    node.span().start().map_or(1, |m| m.line())
}

fn known_keys(map: &MarkedMappingNode, allowed: &[&str]) -> Result<(), String> {
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "line {}: unknown key {:?} (known: {})",
            scalar_line(k),
            k.as_str(),
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}

fn text<'a>(map: &'a MarkedMappingNode, key: &str) -> Result<Option<&'a str>, String> {
    match map.get_node(key) {
        None => Ok(None),
        Some(node) => node
            .as_scalar()
            .map(|s| Some(s.as_str()))
            .ok_or_else(|| format!("{key} must be a string")),
    }
}

/// `match_type`: `Some(true)` for regex.
fn match_type(map: &MarkedMappingNode) -> Result<Option<bool>, String> {
    match text(map, "match_type")? {
        None | Some("") => Ok(None),
        Some("glob") => Ok(Some(false)),
        Some("regex") => Ok(Some(true)),
        Some(other) => Err(format!("match_type must be glob or regex, not {other:?}")),
    }
}

/// `buckets` or `histogram_options.buckets`, strictly increasing.
fn buckets(map: &MarkedMappingNode) -> Result<Option<Vec<f64>>, String> {
    let nested = map
        .get_mapping("histogram_options")
        .and_then(|o| o.get_node("buckets"));
    let Some(node) = map.get_node("buckets").or(nested) else {
        return Ok(None);
    };
    let list = node
        .as_sequence()
        .ok_or("buckets must be a list of numbers")?;
    let bounds = list
        .iter()
        .map(|n| {
            n.as_scalar()
                .and_then(|s| s.as_str().parse::<f64>().ok())
                .filter(|b| b.is_finite())
                .ok_or_else(|| "buckets must be a list of numbers".to_owned())
        })
        .collect::<Result<Vec<f64>, String>>()?;
    if bounds.is_empty() {
        return Ok(None);
    }
    if bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err("buckets must be in increasing order".into());
    }
    Ok(Some(bounds))
}

fn valid_label(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn mapping(m: &MarkedMappingNode, defaults: &Defaults) -> Result<Mapping, String> {
    known_keys(m, MAPPING_KEYS)?;
    let pattern = text(m, "match")?
        .filter(|p| !p.is_empty())
        .ok_or("a mapping needs a match")?;
    let regex = match_type(m)?.unwrap_or(defaults.regex);
    let matcher = if regex {
        Matcher::Regex(Regex::new(pattern).map_err(|e| format!("invalid regex {pattern:?}: {e}"))?)
    } else {
        let parts = pattern
            .split('.')
            .map(|part| match part {
                "*" => Ok(None),
                p if p.is_empty() || p.contains('*') => Err(format!(
                    "invalid match {pattern:?}: a glob's parts are names or a whole `*`"
                )),
                p => Ok(Some(p.to_owned())),
            })
            .collect::<Result<Vec<_>, String>>()?;
        Matcher::Glob(parts)
    };
    let drop = match text(m, "action")? {
        None | Some("" | "map") => false,
        Some("drop") => true,
        Some(other) => return Err(format!("action must be map or drop, not {other:?}")),
    };
    let name = text(m, "name")?.unwrap_or_default().to_owned();
    if name.is_empty() && !drop {
        return Err(format!("the mapping of {pattern:?} sets no name"));
    }
    let kind = match text(m, "match_metric_type")? {
        None | Some("") => None,
        Some("counter") => Some(Kind::Counter),
        Some("gauge") => Some(Kind::Gauge),
        Some("observer" | "timer") => Some(Kind::Observer),
        Some(other) => {
            return Err(format!(
                "match_metric_type must be counter, gauge or observer, not {other:?}"
            ));
        }
    };
    for key in ["timer_type", "observer_type"] {
        match text(m, key)? {
            None | Some("" | "default" | "histogram" | "summary") => {}
            Some(other) => {
                return Err(format!("{key} must be histogram or summary, not {other:?}"));
            }
        }
    }
    let mut labels = Vec::new();
    if let Some(node) = m.get_node("labels") {
        let map = node.as_mapping().ok_or("labels must be a mapping")?;
        for (k, v) in map.iter() {
            if !valid_label(k.as_str()) {
                return Err(format!("invalid label name {:?}", k.as_str()));
            }
            let v = v
                .as_scalar()
                .ok_or_else(|| format!("the label {} must be a string", k.as_str()))?;
            labels.push((k.as_str().to_owned(), v.as_str().to_owned()));
        }
    }
    let scale = match text(m, "scale")? {
        None => None,
        Some(s) => Some(
            s.parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .ok_or_else(|| format!("scale must be a number, not {s:?}"))?,
        ),
    };
    Ok(Mapping {
        matcher,
        name,
        labels,
        drop,
        kind,
        buckets: buckets(m)?.unwrap_or_else(|| defaults.buckets.clone()),
        scale,
        help: text(m, "help")?.map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_default_mapping_names_two_levels_with_key1_and_deeper_ones_with_key2() {
        let m = Mapper::erl_default();
        let two = m
            .map(
                "ratelimit.service.rate_limit.d.k_v.total_hits",
                Kind::Counter,
            )
            .unwrap();
        assert_eq!(two.name, "ratelimit_service_rate_limit_total_hits");
        assert_eq!(two.labels, labels(&[("domain", "d"), ("key1", "k_v")]));
        let deep = m
            .map(
                "ratelimit.service.rate_limit.d.a_1.b.c_2.over_limit",
                Kind::Counter,
            )
            .unwrap();
        assert_eq!(
            deep.labels,
            labels(&[("domain", "d"), ("key1", "a_1"), ("key2", "b")])
        );
        let cached = m
            .map(
                "ratelimit.service.rate_limit.d.a.b.over_limit_with_local_cache",
                Kind::Counter,
            )
            .unwrap();
        assert_eq!(
            cached.name, "ratelimit_service_rate_limit_over_limit",
            "regexes are unanchored"
        );
    }

    #[test]
    fn an_unmapped_name_is_escaped() {
        let m = Mapper::erl_default();
        let s = m
            .map("ratelimit.service.global_shadow_mode", Kind::Counter)
            .unwrap();
        assert_eq!(
            (s.name.as_str(), s.mapped),
            ("ratelimit_service_global_shadow_mode", false)
        );
        assert_eq!(escape("9a-b--c---d.e/f"), "_9a_b_c_d_e_f");
    }

    #[test]
    fn match_metric_type_selects_the_kind() {
        let m = Mapper::erl_default();
        let timer = m
            .map(
                "ratelimit_server.ShouldRateLimit.response_time",
                Kind::Observer,
            )
            .unwrap();
        assert_eq!(timer.name, "ratelimit_service_response_time_seconds");
        assert_eq!((timer.scale, timer.buckets.len()), (Some(0.001), 11));
        let counter = m
            .map("ratelimit.service.config_load_success", Kind::Counter)
            .unwrap();
        assert!(counter.mapped);
        let gauge = m
            .map("ratelimit.service.config_load_success", Kind::Gauge)
            .unwrap();
        assert!(!gauge.mapped);
    }

    #[test]
    fn globs_come_before_regexes_and_the_first_match_wins() {
        let m = Mapper::parse(
            r#"
mappings:
  - match: "a\\.(.*)"
    match_type: regex
    name: "from_regex"
  - match: "a.*"
    name: "first_${1}"
  - match: "a.b"
    name: "second"
  - match: "a.c"
    action: drop
"#,
        )
        .unwrap();
        assert_eq!(m.map("a.b", Kind::Counter).unwrap().name, "first_b");
        assert_eq!(m.map("a.b.c", Kind::Counter).unwrap().name, "from_regex");
        assert_eq!(m.map("x", Kind::Counter).unwrap().name, "x");
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_line() {
        let cases = [
            ("mappings:\n  - match: a.*\n", "sets no name"),
            (
                "mappings:\n  - match: a.*\n    name: x\n    lables: {}\n",
                "line 4",
            ),
            (
                "mappings:\n  - match: a(\n    match_type: regex\n    name: x\n",
                "invalid regex",
            ),
            ("mappings:\n  - match: a.b*\n    name: x\n", "whole `*`"),
            (
                "mappings:\n  - match: a.*\n    name: x\n    buckets: [2, 1]\n",
                "increasing",
            ),
            ("mappings: [", "not a YAML"),
        ];
        for (text, wanted) in cases {
            let e = Mapper::parse(text).unwrap_err();
            assert!(e.contains(wanted), "{text:?}: {e}");
        }
    }
}
