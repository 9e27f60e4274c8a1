//! Request planning: each descriptor of a request resolved against the rules into the limits
//! that apply (`replaces` and the request's own limit taken into account, hits and modes set),
//! gathered into one `Check` for the limiter, with the metric series its hits are counted in.
//! The service reads the protobuf request into `Asked` descriptors; `service::explain` plans
//! with the very same `RuleSet::plan`, unmetered.

use std::ops::Range;
use std::sync::Arc;

use super::{Match, RuleSet};
use crate::config::{HoldRule, RuleLimit, Weights};
use crate::limiter::algorithm::{MOST_COUNT, gcra, log};
use crate::limiter::lease::Leasing;
use crate::limiter::{
    Algorithm, Check, Counting, Decision, DescriptorKey, HoldAsk, HoldId, Item, ItemStep, Limit,
    Mode, RuleId, Scope, Source, Unit,
};
use crate::observe::{Outcome, RuleCounters};

/// One request descriptor, as the rules plan it.
pub struct Asked<'a> {
    /// Its entries, as (key, value) pairs in order.
    pub entries: Vec<(&'a [u8], &'a [u8])>,
    /// Hits each of its limits consumes (or gives back, with `refund`).
    pub hits: u64,
    pub refund: bool,
    /// The request's own limit for it, which replaces the rule's.
    pub limit: Option<Override>,
}

/// A limit a request brings for one of its descriptors.
#[derive(Clone, Copy, Debug)]
pub struct Override {
    pub requests_per_unit: u32,
    pub unit: Unit,
}

/// What applies to every rule: `--quota-mode` (every limit a quota limit) and `--counting` (for
/// rules that do not say).
#[derive(Clone, Copy, Debug)]
pub struct Global<'a> {
    pub quota_mode: bool,
    pub counting: Counting,
    /// `--lease`, for rules that do not say.
    pub lease: Leasing,
    /// `--cluster-name`: the cluster whose counters a rule of `scope: cluster` counts in
    /// (without one, every replica without one shares them).
    pub cluster: Option<&'a str>,
}

/// What one request descriptor turned into.
pub enum Plan<'a> {
    /// No rule applies (unknown domain, no match, or every limit replaced).
    Free,
    Unlimited,
    /// These items of the check are this descriptor's limits, counted in `stats` (none for a
    /// limit override no rule matched).
    Limited {
        items: Range<usize>,
        stats: Option<Stats<'a>>,
        /// The matched rule's `metadata` (none for a limit override: the rule's limit does not
        /// apply).
        metadata: Option<&'a serde_json::Map<String, serde_json::Value>>,
    },
}

/// The metric counters a descriptor's hits go to.
pub enum Stats<'a> {
    /// Its rule's own.
    Rule(&'a dyn RuleCounters),
    /// A series named from the request's values.
    Request(Arc<dyn RuleCounters>),
}

/// The hold an item of a held `rule` asks for, for the request `id`: a settle (`settle`), or a
/// hold of the rule's estimate at least, of the request-time call's `hits` when it brings more
/// (an estimate of its own, from a `max_tokens` header), and at most the rule's `largest` part
/// of `limit`.
fn held(rule: &HoldRule, id: HoldId, hits: u64, limit: &Limit, settle: bool) -> HoldAsk {
    let largest = (u64::from(limit.requests_per_unit) * u64::from(rule.largest)).div_ceil(100);
    HoldAsk {
        id,
        estimate: rule.estimate.max(hits).min(largest).max(1),
        ttl_ms: rule.ttl_ms,
        on_expiry: rule.on_expiry,
        most: rule.most,
        settle,
    }
}

/// `hits` weighed by each of `weights` whose entry is among `after` (rounded up; an entry
/// absent weighs 1), within what a count holds exactly.
fn weighed(hits: u64, weights: &[Weights], after: &[(&[u8], &[u8])]) -> u64 {
    let mut weighed = u128::from(hits);
    for table in weights {
        if let Some((_, value)) = after.iter().find(|(k, _)| *k == table.key.as_bytes()) {
            weighed = (weighed * u128::from(table.of(value))).div_ceil(1000);
            weighed = weighed.min(u128::from(MOST_COUNT));
        }
    }
    weighed as u64
}

impl Plan<'_> {
    /// The path of the rule whose limits this descriptor has, for a trace: never a value the
    /// request named.
    pub fn rule(&self) -> Option<&str> {
        match self {
            Plan::Limited {
                stats: Some(stats), ..
            } => Some(stats.get().rule_path()),
            _ => None,
        }
    }
}

impl Stats<'_> {
    fn get(&self) -> &dyn RuleCounters {
        match self {
            Stats::Rule(s) => *s,
            Stats::Request(s) => &**s,
        }
    }
}

/// What holds for every descriptor of one request's plan.
struct Planning<'r> {
    domain: &'r [u8],
    global: Global<'r>,
    metered: bool,
    /// The limits a matched rule's `replaces` names: dropped from every descriptor.
    replaced: Vec<&'r str>,
}

/// What every counter of one descriptor shares, as its limits become items of the check.
struct Counters<'d> {
    domain: &'d [u8],
    /// The entries the rules matched, and the values counted under.
    entries: &'d [(&'d [u8], &'d [u8])],
    matched: Option<&'d Match<'d>>,
    counted: Vec<(&'d [u8], &'d [u8])>,
    hits: u64,
    refund: bool,
    /// A held rule's hold: the rule, the request's id, and whether the call settles.
    hold: Option<(&'d HoldRule, HoldId, bool)>,
    counting: Counting,
    scope: Scope,
    leased: bool,
    global: Global<'d>,
    /// Made with the first counter.
    key: Option<DescriptorKey>,
    rule: Option<RuleId>,
}

impl<'d> Counters<'d> {
    /// The counters of `descriptor`, whose first `n` entries `matched` matched.
    fn of(
        planning: &Planning<'d>,
        descriptor: &'d Asked<'d>,
        matched: Option<&'d Match<'d>>,
        n: usize,
    ) -> Self {
        let (entries, after) = descriptor.entries.split_at(n);
        let mut counted: Vec<(&[u8], &[u8])> = match matched {
            Some(m) => entries
                .iter()
                .zip(&m.counted_values)
                .map(|((k, _), v)| (*k, *v))
                .collect(),
            None => entries.to_vec(),
        };
        let hits = match matched {
            Some(m) if !m.node.weights().is_empty() => {
                weighed(descriptor.hits, m.node.weights(), after)
            }
            _ => descriptor.hits,
        };
        // A held rule's own entry names the request, not the counter; a call carrying its
        // settle entry settles.
        let hold =
            matched
                .and_then(|m| m.node.hold())
                .zip(entries.last())
                .map(|(rule, (_, id))| {
                    counted.pop();
                    let settle = after.iter().any(|(k, _)| *k == rule.settle.key.as_bytes());
                    (rule, HoldId::of(id), settle)
                });
        let global = planning.global;
        let scope = matched.and_then(|m| m.node.scope()).unwrap_or_default();
        let leased = hold.is_none()
            && !scope.is_local()
            && matched.and_then(|m| m.node.lease).unwrap_or(global.lease) == Leasing::Auto;
        Counters {
            domain: planning.domain,
            entries,
            matched,
            counted,
            hits,
            refund: descriptor.refund,
            hold,
            counting: matched
                .and_then(|m| m.node.counting)
                .unwrap_or(global.counting),
            scope,
            leased,
            global,
            key: None,
            rule: None,
        }
    }

    /// Adds the counter of `limit` under `identity`, counted in `mode`, to `check`.
    fn push(&mut self, check: &mut Check, limit: Limit, mut identity: String, mode: Mode) {
        // Counters of another scope are other counters.
        match self.scope {
            Scope::Global => {}
            Scope::Cluster => {
                identity.push_str(":cluster:");
                identity.push_str(self.global.cluster.unwrap_or_default());
            }
            Scope::Replica | Scope::Split => {
                identity.push(':');
                identity.push_str(self.scope.name());
            }
        }
        let key = self
            .key
            .get_or_insert_with(|| DescriptorKey::new(self.domain, &self.counted))
            .counter(&identity);
        // A limit override that no rule matched belongs to the descriptor's keys.
        let rule = *self.rule.get_or_insert_with(|| match self.matched {
            Some(m) => RuleId::of(self.domain, m.node.path().as_bytes()),
            None => RuleId::of(
                self.domain,
                &self
                    .entries
                    .iter()
                    .map(|(k, _)| *k)
                    .collect::<Vec<_>>()
                    .join(&b'.'),
            ),
        });
        // A request holds (or settles) once on a counter, however many of its descriptors name
        // it: the stores decide a held counter once per request. The settles of one call add up
        // (input and output tokens priced apart).
        if let Some((_, id, settle)) = self.hold
            && let Some(earlier) = check
                .items
                .iter_mut()
                .find(|i| i.key == key && matches!(i.step, ItemStep::Held(h) if h.id == id))
        {
            if let ItemStep::Held(h) = earlier.step
                && h.settle
                && settle
            {
                earlier.hits = earlier.hits.saturating_add(self.hits).min(MOST_COUNT);
            }
            return;
        }
        check.items.push(Item {
            key,
            rule,
            mode: if self.global.quota_mode {
                mode.as_quota()
            } else {
                mode
            },
            hits: self.hits,
            refund: self.refund && self.hold.is_none(),
            counting: self.counting,
            leased: self.leased,
            scope: self.scope,
            step: match self.hold {
                Some((held_by, id, settle)) => {
                    ItemStep::Held(held(held_by, id, self.hits, &limit, settle))
                }
                None => ItemStep::Hits,
            },
            limit,
        });
    }
}

/// The limit a request's own `o` sets for a descriptor `matched` matched (or none did), counted
/// with the rule's algorithm within what it can count (a sliding log's entries, a bucket's exact
/// arithmetic), and its counter's identity.
fn overriding(o: Override, matched: Option<&Match<'_>>) -> (Limit, String) {
    let algorithm = matched
        .and_then(|m| m.node.limits.iter().find_map(|l| l.limit.as_ref()))
        .map_or(Algorithm::FixedWindow, |l| l.algorithm);
    let identity = format!(
        "override:{}:{}:{}",
        algorithm.name(),
        o.unit.name(),
        o.requests_per_unit
    );
    let window_ms = o.unit.seconds() * 1000;
    let requests_per_unit = match algorithm {
        Algorithm::SlidingLog => o.requests_per_unit.min(log::MOST_ENTRIES),
        _ => o.requests_per_unit,
    };
    let most_burst = u32::try_from(gcra::MOST_UNITS / window_ms).unwrap_or(u32::MAX);
    let limit = Limit {
        name: String::new(),
        requests_per_unit,
        unit: o.unit,
        unit_multiplier: 1,
        algorithm,
        burst: requests_per_unit.min(most_burst),
        calendar: None,
    };
    (limit, identity)
}

/// A rule's limit's counter identity: its algorithm, unit and multiplier, and its calendar.
fn identity(limit: &Limit) -> String {
    let mut identity = format!(
        "{}:{}:{}",
        limit.algorithm.name(),
        limit.unit.name(),
        limit.unit_multiplier
    );
    // A calendar's windows are other windows than the unit's from the epoch.
    if let Some(calendar) = &limit.calendar {
        identity.push_str(&calendar.identity(limit.unit));
    }
    identity
}

impl RuleSet {
    /// Resolves every descriptor `asked` in `domain` into its limits, as `global` has them
    /// counted, and gathers them into one check; `metered`: count it in the metrics (a request),
    /// or not (an explanation).
    pub fn plan<'a>(
        &'a self,
        domain: &[u8],
        asked: &[Asked<'a>],
        global: Global,
        metered: bool,
    ) -> (Vec<Plan<'a>>, Check) {
        let mut check = Check::default();
        if !self.has_domain(domain) {
            if metered {
                self.observer.unknown_domain();
            }
            return (asked.iter().map(|_| Plan::Free).collect(), check);
        }
        // Each match, with how many of the descriptor's entries the rules matched: a rule may
        // take entries after its own (its settle entry, its weights').
        let (matches, matched): (Vec<Option<Match>>, Vec<usize>) = asked
            .iter()
            .map(|d| match self.resolve_taking(domain, &d.entries) {
                Some((m, n)) => (Some(m), n),
                None => (None, d.entries.len()),
            })
            .unzip();
        let planning = Planning {
            domain,
            global,
            metered,
            replaced: matches
                .iter()
                .flatten()
                .flat_map(|m| m.node.limits.iter())
                .flat_map(|l| l.replaces.iter().map(String::as_str))
                .collect(),
        };
        let plans = asked
            .iter()
            .zip(&matches)
            .zip(&matched)
            .map(|((descriptor, m), &n)| {
                self.plan_descriptor(&planning, descriptor, m.as_ref(), n, &mut check)
            })
            .collect();
        (plans, check)
    }

    /// Adds the counters of `descriptor`, whose first `n` entries `matched` matched, to `check`:
    /// its plan.
    fn plan_descriptor<'a>(
        &'a self,
        planning: &Planning<'_>,
        descriptor: &Asked<'_>,
        matched: Option<&Match<'a>>,
        n: usize,
        check: &mut Check,
    ) -> Plan<'a> {
        let mut counters = Counters::of(planning, descriptor, matched, n);
        let start = check.items.len();
        if let Some(o) = descriptor.limit {
            let (limit, identity) = overriding(o, matched);
            counters.push(check, limit, identity, Mode::Enforce);
        } else if let Some(m) = matched {
            if m.node.limits.iter().any(|l| l.limit.is_none()) {
                return Plan::Unlimited;
            }
            for rule in m
                .node
                .limits
                .iter()
                .filter(|l| !is_replaced(l, &planning.replaced))
            {
                let limit = rule.limit.clone().expect("unlimited handled above");
                let identity = identity(&limit);
                counters.push(check, limit, identity, m.node.mode);
            }
        }
        let end = check.items.len();
        if end == start {
            // Under global quota mode, envoyproxy/ratelimit counts a descriptor without a limit
            // as a quota descriptor within its limit.
            check.quota_passes |= planning.global.quota_mode;
            return Plan::Free;
        }
        Plan::Limited {
            items: start..end,
            stats: matched
                .filter(|_| planning.metered)
                .map(|m| self.stats_of(planning.domain, counters.entries, m)),
            metadata: match descriptor.limit {
                Some(_) => None,
                None => matched.and_then(|m| m.node.metadata()),
            },
        }
    }

    /// Where a matched descriptor's hits are counted: its rule's series, or one named from the
    /// request's values when the rule says so (while `DETAILED_SERIES` allows).
    fn stats_of<'a>(
        &'a self,
        domain: &[u8],
        entries: &[(&[u8], &[u8])],
        m: &Match<'a>,
    ) -> Stats<'a> {
        let node = m.node;
        if !node.named_by_request() {
            return Stats::Rule(&*node.stats);
        }
        let name = self.metric_name(domain, entries, node);
        let domain = String::from_utf8_lossy(domain);
        match self.observer.detailed(&domain, &name, node.path()) {
            Some(s) => Stats::Request(s),
            None => Stats::Rule(&*node.stats),
        }
    }
}

impl Plan<'_> {
    /// The item the descriptor's status reports: the limit that denied, else the one closest
    /// to denying, among those evaluated (none when the local cache denied the request on
    /// another's account, and none for a descriptor without limits).
    pub fn shown(&self, check: &Check, decision: &Decision) -> Option<usize> {
        let Plan::Limited { items, .. } = self else {
            return None;
        };
        let usages = &decision.usages;
        let denying = |i: &usize| usages[*i].over && !check.items[*i].mode.is_shadow();
        items
            .clone()
            .filter(denying)
            .max_by_key(|&i| usages[i].reset)
            .or_else(|| {
                items
                    .clone()
                    .filter(|&i| usages[i].source != Source::Unknown)
                    .min_by_key(|&i| usages[i].remaining)
            })
    }

    /// Counts the descriptor's hits, as `decision` decided them, in its metric series (none for
    /// an explanation), hits past `near_ratio` of a limit as near it, and its `entries` in the
    /// top view (refunds apart).
    pub fn count(
        &self,
        check: &Check,
        decision: &Decision,
        near_ratio: f64,
        entries: &[(&[u8], &[u8])],
    ) {
        let Plan::Limited {
            stats: Some(stats), ..
        } = self
        else {
            return;
        };
        let Some(shown) = self.shown(check, decision) else {
            return;
        };
        let usage = &decision.usages[shown];
        let item = &check.items[shown];
        let limit = u64::from(item.limit.capacity());
        let outcome = if usage.over {
            Outcome::Over {
                limit,
                charged_from: (item.counting == Counting::Always)
                    .then(|| limit.saturating_sub(usage.left_before)),
                shadow: item.mode.is_shadow(),
                from_cache: usage.source == Source::LocalCache,
            }
        } else {
            Outcome::Within {
                limit,
                used: limit.saturating_sub(usage.remaining),
            }
        };
        stats.get().count(item.hits, outcome, near_ratio);
        if !item.refund {
            let denied = usage.over && !item.mode.is_shadow();
            stats.get().seen(entries, item.hits, denied);
        }
    }
}

fn is_replaced(limit: &RuleLimit, replaced: &[&str]) -> bool {
    !limit.name.is_empty() && replaced.contains(&limit.name.as_str())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const RULES: &str = "
domain: d
descriptors:
  - key: ip
    rate_limits:
      - {unit: second, requests_per_unit: 10, name: per_ip}
      - {unit: hour, requests_per_unit: 100}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: per_ip}]}
  - key: log
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log}
  - key: free
    rate_limit: {unit: second, requests_per_unit: 1, name: gone}
  - key: taker
    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: gone}]}
";

    fn rules() -> RuleSet {
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), RULES).expect("valid rules");
        RuleSet::new(vec![domain])
    }

    fn asked(key: &'static str) -> Asked<'static> {
        Asked {
            entries: vec![(key.as_bytes(), b"v".as_slice())],
            hits: 1,
            refund: false,
            limit: None,
        }
    }

    const GLOBAL: Global = Global {
        quota_mode: false,
        counting: Counting::Admitted,
        lease: Leasing::Off,
        cluster: None,
    };

    fn items<'a>(plan: &Plan, check: &'a Check) -> &'a [Item] {
        match plan {
            Plan::Limited { items, .. } => &check.items[items.clone()],
            Plan::Free | Plan::Unlimited => &[],
        }
    }

    #[test]
    fn a_limit_another_descriptor_replaces_is_dropped_and_a_descriptor_left_without_any_is_free() {
        let rules = rules();
        let request = [asked("ip"), asked("user"), asked("free"), asked("taker")];
        let (plans, check) = rules.plan(b"d", &request, GLOBAL, false);
        let ip = items(&plans[0], &check);
        assert_eq!(ip.len(), 1, "per_ip is replaced by user's rule");
        assert_eq!(ip[0].limit.requests_per_unit, 100);
        assert_eq!(items(&plans[1], &check).len(), 1);
        assert!(matches!(plans[2], Plan::Free));
        assert_eq!(check.items.len(), 3);
    }

    #[test]
    fn a_held_rule_counts_without_the_request_id_holds_its_estimate_at_least_and_settles_by_its_entry()
     {
        let yaml = "domain: d\ndescriptors:\n  - key: user\n    descriptors:\n      - key: id\n        hold: {estimate: 10, largest: 25%, settle: {key: phase, value: done}}\n        weights:\n          - key: model\n            values: {big: 2.5, small: 1}\n        rate_limit: {unit: hour, requests_per_unit: 100}\n";
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), yaml).expect("valid rules");
        let rules = RuleSet::new(vec![domain]);
        let call = |id: &'static str, hits: u64, after: &[(&'static str, &'static str)]| {
            let mut entries = vec![
                (b"user".as_slice(), b"u".as_slice()),
                (b"id", id.as_bytes()),
            ];
            entries.extend(after.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
            Asked {
                entries,
                hits,
                refund: false,
                limit: None,
            }
        };
        let done = ("phase", "done");
        let request = [
            call("a", 0, &[]),
            call("b", 40, &[]),
            call("a", 7, &[]),
            call("c", 2, &[]),
            call("d", 8, &[("model", "big")]),
            call("e", 30, &[done]),
            call("f", 30, &[("model", "big"), done]),
            call("f", 3, &[done, ("model", "small")]),
            call("g", 1, &[("phase", "other")]),
        ];
        let (plans, check) = rules.plan(b"d", &request, GLOBAL, false);
        let held: Vec<(HoldAsk, u64)> = check
            .items
            .iter()
            .map(|i| match i.step {
                ItemStep::Held(held) => (held, i.hits),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(held.len(), 6, "request a is named twice: it holds once");
        assert!(matches!(plans[2], Plan::Free));
        assert!(
            matches!(plans[8], Plan::Free),
            "an entry after the rule's own that it does not take matches nothing"
        );
        assert!(
            check.items.iter().all(|i| i.key == check.items[0].key),
            "one counter per user"
        );
        let does = |i: usize| {
            (
                held[i].0.id,
                held[i].0.estimate,
                held[i].0.settle,
                held[i].1,
            )
        };
        assert_eq!(
            does(0),
            (HoldId::of(b"a"), 10, false, 0),
            "the estimate is a floor"
        );
        assert_eq!(
            does(1),
            (HoldId::of(b"b"), 25, false, 40),
            "a larger cost holds, up to largest"
        );
        assert_eq!(
            does(2),
            (HoldId::of(b"c"), 10, false, 2),
            "a tiny cost holds the estimate"
        );
        assert_eq!(
            does(3),
            (HoldId::of(b"d"), 20, false, 20),
            "weighed: 8 × 2.5"
        );
        assert!(does(4).2, "the settle entry settles");
        assert_eq!(does(4).3, 30);
        assert_eq!(
            (does(5).0, does(5).2, does(5).3),
            (HoldId::of(b"f"), true, 75 + 3),
            "two settles of one request in one call add up, each weighed"
        );
    }

    #[test]
    fn an_override_takes_the_rules_algorithm_within_what_it_can_count_and_counts_apart() {
        let rules = rules();
        let mut overridden = asked("log");
        overridden.limit = Some(Override {
            requests_per_unit: 5_000,
            unit: Unit::Minute,
        });
        let request = [overridden, asked("log")];
        let (plans, check) = rules.plan(b"d", &request, GLOBAL, false);
        let [over, rule] = [items(&plans[0], &check), items(&plans[1], &check)];
        assert_eq!(over[0].limit.algorithm, Algorithm::SlidingLog);
        assert_eq!(over[0].limit.requests_per_unit, log::MOST_ENTRIES);
        assert_eq!(over[0].limit.unit, Unit::Minute);
        assert_eq!(over[0].mode, Mode::Enforce);
        assert!(
            over[0].key != rule[0].key,
            "an override counts apart from the rule"
        );
        assert!(matches!(plans[0], Plan::Limited { metadata: None, .. }));
    }

    #[test]
    fn under_global_quota_mode_every_limit_is_a_quota_one_and_a_free_descriptor_passes() {
        let rules = rules();
        let global = Global {
            quota_mode: true,
            ..GLOBAL
        };
        let request = [asked("user"), asked("unknown")];
        let (plans, check) = rules.plan(b"d", &request, global, false);
        assert_eq!(items(&plans[0], &check)[0].mode, Mode::Quota);
        assert!(matches!(plans[1], Plan::Free));
        assert!(check.quota_passes);
    }

    #[test]
    fn an_unknown_domain_plans_every_descriptor_free() {
        let rules = rules();
        let (plans, check) = rules.plan(b"other", &[asked("ip")], GLOBAL, false);
        assert!(matches!(plans[..], [Plan::Free]));
        assert!(check.items.is_empty());
    }
}
