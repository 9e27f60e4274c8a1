//! The matcher built from rule files: domain → descriptor tree → the limits that apply to one
//! request descriptor. Matching follows envoyproxy/ratelimit: at each level an entry first matches
//! its exact (key, value), then the first `*` pattern of that key in file order, then the key alone;
//! the limits are those of the node matched by the last entry. Keys and values are compared as
//! pairs of bytes (a request's may be any bytes, not only UTF-8), never as a joined `key_value`
//! string.
//!
//! Each rule holds its metric counters, named as envoyproxy/ratelimit names its stats: the rule's
//! path of `key_value` (or `key` alone) steps joined by dots. `plan` turns a request's
//! descriptors into the one `Check` the limiter decides.

mod dump;
mod explain;
pub mod plan;
mod quota;

pub use dump::{limit_json, rule_limit_json};
pub use explain::{Stop, Walk};
pub use quota::QuotaRule;

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};
use std::time::SystemTime;

use memchr::memmem;

use crate::config::{
    DescriptorConfig, DomainConfig, HoldRule, Loaded, RuleLimit, Sources, Weights,
};
use crate::limiter::lease::Leasing;
use crate::limiter::{Counting, LONGEST_LITERAL, Mode, Scope};
use crate::observe::{Observer, RuleCounters, unobserved};

/// Every loaded domain, ready to match.
pub struct RuleSet {
    domains: HashMap<Vec<u8>, Level>,
    /// Each domain's quota bucket rules.
    quota: HashMap<Vec<u8>, quota::QuotaLevel>,
    /// What the domains were made from, for the dumps.
    sources: Sources,
    origin: Origin,
    /// No configuration has come yet (rules over xDS, before the first snapshot).
    awaiting: bool,
    /// `/config` and `/rlconfig`, once rendered: a large rule set is rendered once, not per
    /// request.
    rendered: dump::Rendered,
    /// What its rules' counters are, and what is told of requests for unknown domains.
    observer: Arc<dyn Observer>,
    /// A rule has `scope: split`: the replica beats in the store (`store::peers`).
    split: bool,
    /// A rule takes entries after its own (`hold.settle`, `weights`): `plan` looks for them.
    trailing: bool,
}

impl Default for RuleSet {
    fn default() -> Self {
        RuleSet {
            domains: HashMap::default(),
            quota: HashMap::default(),
            sources: Sources::default(),
            origin: Origin::default(),
            awaiting: false,
            rendered: dump::Rendered::default(),
            observer: unobserved(),
            split: false,
            trailing: false,
        }
    }
}

/// Where a rule set comes from.
#[derive(Clone, Debug)]
pub struct Origin {
    /// Every file read, with the SHA-256 (hex) of its bytes.
    pub files: Vec<(PathBuf, String)>,
    /// One hash of them all: equal for equal rules.
    pub hash: String,
    pub loaded_at: SystemTime,
    /// The rules come over xDS rather than from files.
    pub over_xds: bool,
}

/// Where a rule is declared: `file:line`, or the resource alone for rules over xDS (line 0).
fn source(file: &Path, line: usize) -> String {
    if line == 0 {
        file.display().to_string()
    } else {
        format!("{}:{line}", file.display())
    }
}

impl Default for Origin {
    fn default() -> Self {
        Origin {
            files: Vec::new(),
            hash: String::new(),
            loaded_at: SystemTime::now(),
            over_xds: false,
        }
    }
}

/// The (domain, rule path) of every rule of a set, as the sorted hashes of a key of this
/// process: 8 bytes a rule, where a set of the paths themselves would take 32 and a table's
/// room on top (a swap of 480,000 rules peaked 50 MB higher with one). Two paths with the same
/// hash would keep the series of a removed rule, never forget that of a rule in force.
pub struct RulePaths {
    hasher: RandomState,
    hashes: Vec<u64>,
}

impl RulePaths {
    pub fn contains(&self, domain: &str, path: &str) -> bool {
        let hash = self.hasher.hash_one((domain, path));
        self.hashes.binary_search(&hash).is_ok()
    }
}

/// The children of one node, grouped by entry key.
#[derive(Default)]
struct Level {
    by_key: HashMap<Vec<u8>, Branches<Node>>,
}

/// The rules of one key at one level: by exact value, by pattern (in file order), and for the
/// key alone.
struct Branches<T> {
    /// Each rule boxed: a table keeps room for up to twice its entries, and a rule is larger
    /// than a box.
    exact: HashMap<Box<[u8]>, Box<T>>,
    patterns: Vec<(Pattern, T)>,
    any: Option<Box<T>>,
}

impl<T> Default for Branches<T> {
    fn default() -> Self {
        Branches {
            exact: HashMap::new(),
            patterns: Vec::new(),
            any: None,
        }
    }
}

impl<T> Branches<T> {
    /// The rule an entry's value matches, and how: its exact value, else the first pattern that
    /// matches it, else the key alone.
    fn find(&self, value: &[u8]) -> Option<(&T, Matched<'_>)> {
        if let Some(n) = self.exact.get(value) {
            Some((&**n, Matched::Exact))
        } else if let Some((p, n)) = self.patterns.iter().find(|(p, _)| p.matches(value)) {
            Some((n, Matched::Pattern(p.text.as_slice())))
        } else {
            Some((self.any.as_deref()?, Matched::Key))
        }
    }
}

/// One rule of the tree.
pub struct Node {
    pub limits: Arc<[RuleLimit]>,
    pub mode: Mode,
    /// When the rule's hits are charged, if it says (`counting`).
    pub counting: Option<Counting>,
    /// Whether the rule's counters are leased, if it says (`lease`).
    pub lease: Option<Leasing>,
    flags: Flags,
    /// The file and line that declare the rule (a thin pointer: a rule fits 64 bytes).
    file: Arc<PathBuf>,
    line: u32,
    /// The counters of the rule's metrics, which hold its domain and path.
    pub stats: Arc<dyn RuleCounters>,
    /// What few rules have: a non-empty `metadata`, a `hold`.
    extras: Option<Box<Extras>>,
    /// `None` for a leaf, as most rules are: an empty table would cost each one 48 bytes.
    children: Option<Box<Level>>,
}

/// The settings few rules have, boxed apart so that a rule fits 64 bytes.
struct Extras {
    /// The rule's `metadata`, when it is a non-empty mapping: what `--response-dynamic-metadata`
    /// sends for a descriptor that passed it.
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
    hold: Option<HoldRule>,
    weights: Vec<Weights>,
}

/// A rule's yes-or-no settings, in one byte.
#[derive(Clone, Copy)]
struct Flags(u8);

impl Flags {
    const SHARE_THRESHOLD: u8 = 1;
    const NAMED_BY_REQUEST: u8 = 2;
    const DETAILED_METRIC: u8 = 4;
    const VALUE_TO_METRIC: u8 = 8;
    /// The rule's `scope`, when it says one: one of these.
    const SCOPE_GLOBAL: u8 = 16;
    const SCOPE_CLUSTER: u8 = 32;
    const SCOPE_REPLICA: u8 = 64;
    const SCOPE_SPLIT: u8 = 128;

    fn of(set: [(u8, bool); 8]) -> Flags {
        Flags(
            set.iter()
                .filter(|(_, on)| *on)
                .fold(0, |all, (f, _)| all | f),
        )
    }

    fn has(self, flag: u8) -> bool {
        self.0 & flag != 0
    }
}

impl Node {
    /// The rule's `metadata`, when it is a non-empty mapping.
    pub fn metadata(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.extras.as_ref()?.metadata.as_ref()
    }

    /// The rule's holds (`hold`), if it says.
    pub fn hold(&self) -> Option<&HoldRule> {
        self.extras.as_ref()?.hold.as_ref()
    }

    /// The rule's weight tables (`weights`).
    pub fn weights(&self) -> &[Weights] {
        self.extras.as_ref().map_or(&[], |e| &e.weights)
    }

    /// Whether the entry (`key`, `value`) may follow the rule's own: its settle entry, or a
    /// weight's entry.
    pub(crate) fn takes_after(&self, key: &[u8], value: &[u8]) -> bool {
        self.hold()
            .is_some_and(|h| h.settle.key.as_bytes() == key && h.settle.value.as_bytes() == value)
            || self.weights().iter().any(|w| w.key.as_bytes() == key)
    }

    /// Where the rule's counters are counted (`scope`), if it says.
    pub fn scope(&self) -> Option<Scope> {
        [
            (Flags::SCOPE_GLOBAL, Scope::Global),
            (Flags::SCOPE_CLUSTER, Scope::Cluster),
            (Flags::SCOPE_REPLICA, Scope::Replica),
            (Flags::SCOPE_SPLIT, Scope::Split),
        ]
        .into_iter()
        .find_map(|(flag, scope)| self.flags.has(flag).then_some(scope))
    }

    /// Every value matching the rule's pattern shares one counter (`share_threshold`).
    pub fn share_threshold(&self) -> bool {
        self.flags.has(Flags::SHARE_THRESHOLD)
    }

    /// The series is named from the request's values (`detailed_metric` here, or
    /// `value_to_metric` on the way here): see `RuleSet::metric_name`.
    pub(crate) fn named_by_request(&self) -> bool {
        self.flags.has(Flags::NAMED_BY_REQUEST)
    }

    fn detailed_metric(&self) -> bool {
        self.flags.has(Flags::DETAILED_METRIC)
    }

    fn value_to_metric(&self) -> bool {
        self.flags.has(Flags::VALUE_TO_METRIC)
    }

    /// The rules under this one.
    fn children(&self) -> &Level {
        static NONE: LazyLock<Level> = LazyLock::new(Level::default);
        self.children.as_deref().unwrap_or(&NONE)
    }
}

/// A value with `*` wildcards, each matching any run of bytes.
#[derive(Debug)]
struct Pattern {
    text: Vec<u8>,
    parts: Vec<Vec<u8>>,
}

impl Pattern {
    fn new(text: &str) -> Self {
        Pattern {
            text: text.as_bytes().to_vec(),
            parts: text.split('*').map(|p| p.as_bytes().to_vec()).collect(),
        }
    }

    fn matches(&self, value: &[u8]) -> bool {
        let (first, rest) = self
            .parts
            .split_first()
            .expect("split yields one part at least");
        let Some(mut tail) = value.strip_prefix(first.as_slice()) else {
            return false;
        };
        let (last, middle) = rest.split_last().expect("a pattern has a '*'");
        for part in middle {
            match memmem::find(tail, part) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last)
    }
}

/// What a request descriptor resolved to.
pub struct Match<'a> {
    pub node: &'a Node,
    /// The values to count under, one per entry: the request's value, or the matched pattern
    /// where that node has `share_threshold` (all matching values share one counter).
    pub counted_values: Vec<&'a [u8]>,
}

impl RuleSet {
    /// The rules of `domains`, which count into no observer (for explaining, and tests).
    pub fn new(domains: Vec<DomainConfig>) -> Self {
        let sources = Sources::Domains(domains.clone());
        RuleSet::made_from(domains, sources, unobserved())
    }

    /// The rules of `domains`, made from `sources`, counting into `observer`.
    fn made_from(
        domains: Vec<DomainConfig>,
        sources: Sources,
        observer: Arc<dyn Observer>,
    ) -> Self {
        let any_rule = |has: fn(&DescriptorConfig) -> bool| {
            domains.iter().any(|d| {
                let mut rules: Vec<&DescriptorConfig> = d.descriptors.iter().collect();
                while let Some(rule) = rules.pop() {
                    if has(rule) {
                        return true;
                    }
                    rules.extend(&rule.descriptors);
                }
                false
            })
        };
        let split = any_rule(|r| r.scope == Some(Scope::Split));
        let trailing = any_rule(|r| r.hold.is_some() || !r.weights.is_empty());
        let mut levels: HashMap<Vec<u8>, Level> = HashMap::new();
        let mut limits = HashSet::new();
        let mut quota: HashMap<Vec<u8>, quota::QuotaLevel> = HashMap::new();
        // A domain in several files (`--merge-domains`) is one tree: validation has made sure
        // that no two files define the same top-level rule.
        for d in domains {
            let file = Arc::new(d.file.clone());
            if !d.quota_buckets.is_empty() {
                let bucket_rules = quota.entry(d.domain.clone().into_bytes()).or_default();
                for rule in &d.quota_buckets {
                    bucket_rules.add(rule);
                }
            }
            let mut building = Building {
                domain: &d.domain,
                file: &file,
                limits: &mut limits,
                observer: &*observer,
            };
            levels
                .entry(d.domain.clone().into_bytes())
                .or_default()
                .add(&mut building, "", false, d.descriptors);
        }
        RuleSet {
            domains: levels,
            quota,
            sources,
            origin: Origin::default(),
            awaiting: false,
            rendered: dump::Rendered::default(),
            observer,
            split,
            trailing,
        }
    }

    /// No rules, because none have come over xDS yet: every request is refused until some do,
    /// which will count into `observer`.
    pub fn awaiting(observer: Arc<dyn Observer>) -> Self {
        let mut rules = RuleSet {
            awaiting: true,
            observer,
            ..RuleSet::default()
        };
        rules.origin.over_xds = true;
        rules
    }

    /// Whether no configuration has come yet.
    pub fn is_awaiting(&self) -> bool {
        self.awaiting
    }

    /// The rules of loaded files (or xDS resources, `over_xds`), with where they come from,
    /// counting into `observer`.
    pub fn from_loaded(loaded: Loaded, over_xds: bool, observer: Arc<dyn Observer>) -> Self {
        let origin = Origin {
            hash: loaded.hash(),
            files: loaded.files,
            loaded_at: SystemTime::now(),
            over_xds,
        };
        RuleSet {
            origin,
            ..RuleSet::made_from(loaded.domains, loaded.sources, observer)
        }
    }

    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// What its rules count into, and the rules that replace them will.
    pub fn observer(&self) -> Arc<dyn Observer> {
        self.observer.clone()
    }

    /// Every (domain, rule path), for pruning the metrics of rules a reload removed: gathered
    /// when asked rather than kept beside the rules, which it would cost a tenth more.
    pub fn rule_paths(&self) -> RulePaths {
        let hasher = RandomState::new();
        let mut hashes: Vec<u64> = self
            .nodes()
            .map(|node| hasher.hash_one((node.stats.domain(), node.path())))
            .collect();
        hashes.sort_unstable();
        hashes.dedup();
        hashes.shrink_to_fit();
        RulePaths { hasher, hashes }
    }

    /// When the calendar window of each rule with a limit on the calendar ends (its soonest,
    /// for several), in ms since the Unix epoch, for windows holding `now_ms`: by (domain, rule
    /// path).
    pub fn calendar_ends(&self, now_ms: u64) -> HashMap<(&str, &str), u64> {
        self.nodes()
            .filter_map(|node| {
                let end = node
                    .limits
                    .iter()
                    .filter_map(|l| l.limit.as_ref()?.calendar_span(now_ms))
                    .map(|span| span.end)
                    .min()?;
                Some(((node.stats.domain(), node.path()), end))
            })
            .collect()
    }

    /// The smallest limit (above 0) of a `scope: split` rule, with the rule's `file:line`;
    /// `None` without one. Fewer requests than live replicas leave some replicas a share of 0.
    pub fn smallest_split_limit(&self) -> Option<(u32, String)> {
        self.nodes()
            .filter(|node| node.scope() == Some(Scope::Split))
            .flat_map(|node| {
                node.limits
                    .iter()
                    .filter_map(|l| l.limit.as_ref())
                    .filter(|limit| limit.requests_per_unit > 0)
                    .map(move |limit| (limit.requests_per_unit, node.source()))
            })
            .min_by_key(|(requests, _)| *requests)
    }

    /// The longest window of the `scope: split` limits in force, in ms (a calendar window's
    /// nominal length, doubled to hold the longest month); `None` without a split rule.
    pub fn longest_split_window_ms(&self) -> Option<u64> {
        if !self.split {
            return None;
        }
        let longest = self
            .nodes()
            .filter(|node| node.scope() == Some(Scope::Split))
            .flat_map(|node| node.limits.iter())
            .filter_map(|l| l.limit.as_ref())
            .map(|limit| limit.window_ms() * if limit.calendar.is_some() { 2 } else { 1 })
            .max();
        Some(longest.unwrap_or(0))
    }

    /// The shortest calendar window of the rules in force, in ms (its nominal length: a day is
    /// 24 h); `None` without a limit on the calendar. A replica whose clock is further than
    /// this from the store's cannot place a calendar request.
    pub fn shortest_calendar_window_ms(&self) -> Option<u64> {
        self.nodes()
            .flat_map(|node| node.limits.iter())
            .filter_map(|l| l.limit.as_ref())
            .filter(|limit| limit.calendar.is_some())
            .map(|limit| limit.window_ms())
            .min()
    }

    /// Every rule, in no order.
    fn nodes(&self) -> impl Iterator<Item = &Node> {
        let mut levels: Vec<&Level> = self.domains.values().collect();
        let mut found: Vec<&Node> = Vec::new();
        std::iter::from_fn(move || {
            loop {
                if let Some(node) = found.pop() {
                    levels.push(node.children());
                    return Some(node);
                }
                let level = levels.pop()?;
                for branches in level.by_key.values() {
                    found.extend(branches.exact.values().map(|n| &**n));
                    found.extend(branches.patterns.iter().map(|(_, n)| n));
                    found.extend(branches.any.as_deref());
                }
            }
        })
    }

    pub fn has_domain(&self, domain: &[u8]) -> bool {
        self.domains.contains_key(domain)
    }

    /// How many domains are loaded.
    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    /// The quota rule of a bucket id (its entries sorted by key) reported for `domain`.
    pub fn quota_rule(&self, domain: &[u8], bucket: &[(&str, &[u8])]) -> Option<&Arc<QuotaRule>> {
        self.quota.get(domain)?.resolve(bucket)
    }

    /// The node matched by the descriptor's entries, if every entry matched, or every entry
    /// but those after it that the node takes (`Node::takes_after`, each key once), and how
    /// many entries the rules matched.
    pub(crate) fn resolve_taking<'a>(
        &'a self,
        domain: &[u8],
        entries: &[(&'a [u8], &'a [u8])],
    ) -> Option<(Match<'a>, usize)> {
        if let Some(m) = self.resolve(domain, entries) {
            return Some((m, entries.len()));
        }
        if !self.trailing {
            return None;
        }
        (1..entries.len())
            .rev()
            .take(Weights::MOST_TABLES + 1)
            .find_map(|n| {
                let m = self.resolve(domain, &entries[..n])?;
                let after = &entries[n..];
                let taken = after.iter().enumerate().all(|(i, (k, v))| {
                    m.node.takes_after(k, v) && after[..i].iter().all(|(other, _)| other != k)
                });
                taken.then_some((m, n))
            })
    }

    /// The node matched by the descriptor's last entry, if every entry matched.
    pub(crate) fn resolve<'a>(
        &'a self,
        domain: &[u8],
        entries: &[(&'a [u8], &'a [u8])],
    ) -> Option<Match<'a>> {
        let mut counted_values = Vec::with_capacity(entries.len());
        let node = self.walk(domain, entries, |node, how, _, value| {
            counted_values.push(match how {
                Matched::Pattern(pattern) if node.share_threshold() => pattern,
                _ => value,
            });
        })?;
        Some(Match {
            node,
            counted_values,
        })
    }

    /// Walks the tree along `entries`, telling `visit` each entry's rule, how it matched, and the
    /// entry's key and value; returns the rule of the last entry if every entry matched.
    fn walk<'a>(
        &'a self,
        domain: &[u8],
        entries: &[(&'a [u8], &'a [u8])],
        mut visit: impl FnMut(&'a Node, Matched<'a>, &'a [u8], &'a [u8]),
    ) -> Option<&'a Node> {
        let mut level = self.domains.get(domain)?;
        let mut node = None;
        for (key, value) in entries {
            let branches = level.by_key.get(*key)?;
            let (next, how) = branches.find(value)?;
            visit(next, how, key, value);
            level = next.children();
            node = Some(next);
        }
        node
    }

    /// The metric name of a matched descriptor whose rule is `named_by_request`, as
    /// envoyproxy/ratelimit builds it: with `detailed_metric`, every entry as `key_value` with
    /// the request's value (a `share_threshold` pattern's entries keep the pattern); else each
    /// entry as its rule names it, with the request's value where that rule has
    /// `value_to_metric`. Values are cut to `LONGEST_LITERAL` bytes.
    fn metric_name(&self, domain: &[u8], entries: &[(&[u8], &[u8])], leaf: &Node) -> String {
        let detailed = leaf.detailed_metric();
        let mut name = String::new();
        self.walk(domain, entries, |node, how, key, value| {
            let by_request = detailed || node.value_to_metric();
            let shown = match how {
                Matched::Exact => Some(text_of(value)),
                Matched::Pattern(p) if node.share_threshold() || !by_request => {
                    Some(String::from_utf8_lossy(p).into_owned())
                }
                Matched::Pattern(_) => Some(text_of(value)),
                Matched::Key => by_request.then(|| text_of(value)),
            };
            if !name.is_empty() {
                name.push('.');
            }
            name.push_str(&String::from_utf8_lossy(key));
            if let Some(v) = shown.filter(|v| !v.is_empty() || detailed) {
                name.push('_');
                name.push_str(&v);
            }
        });
        name
    }
}

/// How a descriptor entry matched its rule.
pub enum Matched<'a> {
    /// Its exact value.
    Exact,
    /// A value with `*` wildcards: this one.
    Pattern(&'a [u8]),
    /// The key alone.
    Key,
}

/// A request value as text for a metric name: lossy UTF-8, at most `LONGEST_LITERAL` bytes.
fn text_of(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(&value[..value.len().min(LONGEST_LITERAL)]);
    text.trim_end_matches('\u{fffd}').to_owned()
}

/// What the rules of one domain's file are built with.
struct Building<'a> {
    domain: &'a str,
    file: &'a Arc<PathBuf>,
    /// The distinct limits of the rule set, each shared by the rules that have it.
    limits: &'a mut HashSet<Arc<[RuleLimit]>>,
    /// What makes each rule's counters.
    observer: &'a dyn Observer,
}

impl Level {
    /// Adds `descriptors` to the level under the rule at `parent` (empty at the top);
    /// `value_to_metric_above`: a rule on the way here has `value_to_metric`.
    fn add(
        &mut self,
        building: &mut Building,
        parent: &str,
        value_to_metric_above: bool,
        descriptors: Vec<DescriptorConfig>,
    ) {
        for d in descriptors {
            let step = match &d.value {
                Some(v) => format!("{}_{v}", d.key),
                None => d.key.clone(),
            };
            let path = if parent.is_empty() {
                step
            } else {
                format!("{parent}.{step}")
            };
            let value_to_metric = value_to_metric_above || d.value_to_metric;
            let mut children = Level::default();
            children.add(building, &path, value_to_metric, d.descriptors);
            // Rules with the same limits share them: most rule sets hold a few distinct ones.
            let shared = match building.limits.get(&*d.limits) {
                Some(shared) => shared.clone(),
                None => {
                    building.limits.insert(d.limits.clone());
                    d.limits
                }
            };
            let node = Node {
                limits: shared,
                mode: d.mode,
                counting: d.counting,
                lease: d.lease,
                flags: Flags::of([
                    (Flags::SHARE_THRESHOLD, d.share_threshold),
                    (
                        Flags::NAMED_BY_REQUEST,
                        d.detailed_metric || value_to_metric,
                    ),
                    (Flags::DETAILED_METRIC, d.detailed_metric),
                    (Flags::VALUE_TO_METRIC, d.value_to_metric),
                    (Flags::SCOPE_GLOBAL, d.scope == Some(Scope::Global)),
                    (Flags::SCOPE_CLUSTER, d.scope == Some(Scope::Cluster)),
                    (Flags::SCOPE_REPLICA, d.scope == Some(Scope::Replica)),
                    (Flags::SCOPE_SPLIT, d.scope == Some(Scope::Split)),
                ]),
                file: building.file.clone(),
                line: u32::try_from(d.line).unwrap_or(u32::MAX),
                stats: building.observer.rule(building.domain, &path),
                extras: {
                    let metadata = match d.metadata {
                        Some(serde_json::Value::Object(m)) if !m.is_empty() => Some(m),
                        _ => None,
                    };
                    (metadata.is_some() || d.hold.is_some() || !d.weights.is_empty()).then(|| {
                        Box::new(Extras {
                            metadata,
                            hold: d.hold,
                            weights: d.weights,
                        })
                    })
                },
                children: (!children.by_key.is_empty()).then(|| Box::new(children)),
            };
            let branches = self.by_key.entry(d.key.into_bytes()).or_default();
            match d.value {
                None => branches.any = Some(Box::new(node)),
                Some(v) if v.contains('*') => branches.patterns.push((Pattern::new(&v), node)),
                Some(v) => {
                    branches.exact.insert(v.into_bytes().into(), Box::new(node));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn rules(yaml: &str) -> RuleSet {
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), yaml).expect("valid rules");
        RuleSet::new(vec![domain])
    }

    /// A rule's node is allocated on its own: 64 bytes is a size class of its own with the
    /// allocator, 72 would take 80.
    #[test]
    fn a_rule_fits_64_bytes() {
        assert!(std::mem::size_of::<Node>() <= 64);
    }

    fn resolve<'a>(set: &'a RuleSet, entries: &[(&'a str, &'a str)]) -> Option<Match<'a>> {
        let entries: Vec<(&[u8], &[u8])> = entries
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        set.resolve(b"d", &entries)
    }

    fn limit_of(set: &RuleSet, entries: &[(&str, &str)]) -> Option<u32> {
        let m = resolve(set, entries)?;
        m.node
            .limits
            .first()?
            .limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    }

    const TREE: &str = "
domain: d
descriptors:
  - key: path
    value: /exact
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: path
    value: /api/*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: path
    value: /v*/users/*/avatar
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: path
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: a_b
    value: c
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: client
    descriptors:
      - key: method
        value: GET
        rate_limit: {unit: second, requests_per_unit: 6}
  - key: files
    value: '*'
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 7}
";

    #[test]
    fn a_rule_is_small_and_every_rule_path_is_found() {
        // A rule set of many rules is mostly nodes in hash tables: each byte here counts once
        // per rule, and more where the table is sparse. The rule's path lives in its stats.
        assert!(
            std::mem::size_of::<Node>() <= 80,
            "{}",
            std::mem::size_of::<Node>()
        );
        let set = rules(
            "domain: d\ndescriptors:\n  - key: a\n    value: x\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: c\n    value: y*\n",
        );
        let paths = set.rule_paths();
        for path in ["a_x", "a_x.b", "c_y*"] {
            assert!(paths.contains("d", path), "{path}");
        }
        for (domain, path) in [("d", "a"), ("d", "a_x.b.c"), ("d", "c_y"), ("e", "a_x")] {
            assert!(!paths.contains(domain, path), "{domain} {path}");
        }
    }

    #[test]
    fn exact_beats_wildcard_beats_key_only() {
        let set = rules(TREE);
        assert_eq!(limit_of(&set, &[("path", "/exact")]), Some(1));
        assert_eq!(limit_of(&set, &[("path", "/api/x")]), Some(2));
        assert_eq!(limit_of(&set, &[("path", "/other")]), Some(4));
    }

    #[test]
    fn wildcards_match_anywhere_in_the_value() {
        let set = rules(TREE);
        assert_eq!(limit_of(&set, &[("path", "/v2/users/42/avatar")]), Some(3));
        assert_eq!(
            limit_of(&set, &[("path", "/v2/users/42/avatar.png")]),
            Some(4)
        );
        assert!(Pattern::new("a*a").matches(b"aa"));
        assert!(!Pattern::new("ab*ba").matches(b"aba"));
    }

    #[test]
    fn pairs_are_never_compared_as_joined_strings() {
        let set = rules(TREE);
        assert_eq!(limit_of(&set, &[("a_b", "c")]), Some(5));
        assert!(resolve(&set, &[("a", "b_c")]).is_none());
    }

    #[test]
    fn the_limit_is_that_of_the_node_matched_by_the_last_entry() {
        let set = rules(TREE);
        assert_eq!(
            limit_of(&set, &[("client", "x"), ("method", "GET")]),
            Some(6)
        );
        assert_eq!(
            limit_of(&set, &[("client", "x")]),
            None,
            "the parent has no limit"
        );
        assert!(resolve(&set, &[("client", "x"), ("method", "POST")]).is_none());
        assert!(
            resolve(&set, &[("path", "/exact"), ("extra", "1")]).is_none(),
            "more entries than the tree is deep match nothing"
        );
    }

    #[test]
    fn share_threshold_counts_every_match_under_the_pattern() {
        let set = rules(TREE);
        let m = resolve(&set, &[("files", "a.txt")]).unwrap();
        assert_eq!(m.counted_values, [b"*"]);
        let m = resolve(&set, &[("path", "/api/x")]).unwrap();
        assert_eq!(
            m.counted_values,
            [b"/api/x"],
            "without share_threshold each value counts alone"
        );
    }

    #[test]
    fn values_that_are_not_utf8_match_patterns_and_key_only_rules() {
        let set = rules(TREE);
        let m = set.resolve(b"d", &[(b"path", b"/api/\xff\xfe")]).unwrap();
        assert_eq!(
            m.node.limits[0].limit.as_ref().unwrap().requests_per_unit,
            2
        );
        let m = set.resolve(b"d", &[(b"path", b"\xc3\x28")]).unwrap();
        assert_eq!(
            m.node.limits[0].limit.as_ref().unwrap().requests_per_unit,
            4
        );
    }

    #[test]
    fn metric_names_take_request_values_as_envoy_ratelimit_does() {
        let set = rules(
            "
domain: d
descriptors:
  - key: ip
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: user
    value_to_metric: true
    descriptors:
      - key: path
        value: /api/*
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: team
    descriptors:
      - key: path
        value: /v*
        value_to_metric: true
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: files
    value: '*'
    share_threshold: true
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 1}
",
        );
        let name = |entries: &[(&str, &str)]| {
            let entries: Vec<(&[u8], &[u8])> = entries
                .iter()
                .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                .collect();
            let leaf = set.resolve(b"d", &entries).expect("a match").node;
            assert!(leaf.named_by_request());
            set.metric_name(b"d", &entries, leaf)
        };
        assert_eq!(name(&[("ip", "10.0.0.1")]), "ip_10.0.0.1");
        assert_eq!(
            name(&[("user", "ann"), ("path", "/api/x")]),
            "user_ann.path_/api/*",
            "value_to_metric names its own entry's value; the pattern below keeps its text"
        );
        assert_eq!(name(&[("team", "t"), ("path", "/v2")]), "team.path_/v2");
        assert_eq!(name(&[("files", "a.txt")]), "files_*");
    }

    #[test]
    fn unknown_domains_and_keys_match_nothing() {
        let set = rules(TREE);
        assert!(set.resolve(b"other", &[(b"path", b"/exact")]).is_none());
        assert!(resolve(&set, &[("nope", "x")]).is_none());
        assert!(set.has_domain(b"d"));
    }
}
