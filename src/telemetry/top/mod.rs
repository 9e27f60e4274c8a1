//! Who is being limited right now: per rule, the request values most often denied and most
//! often hit over the last 1 and 10 minutes, in space-saving sketches of a fixed size (`sketch`)
//! on rings of slots (`periods`), with the process's decision rate, store latency and policy
//! answers beside them; served as `/top` and read by `sluice top`.
//!
//! Memory is fixed at the start: at most `--top-rules` rules have sketches of their own (the rest
//! share one, `(other)`), each value shown is cut to `MOST_VALUE_BYTES`, and each rule's values go
//! to `SHARDS` shards by their hash, each with its own lock and `--top-capacity` / `SHARDS`
//! counters per slot, so that event loops recording the same rule rarely wait for each other.

mod periods;
mod sketch;

pub use periods::{ANSWERS, Period};

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use siphasher::sip::SipHasher13;

use periods::{Read, Ring, Tallies};
use sketch::{Counter, Sketch};

/// The most bytes of a value kept and shown: longer values are cut, and values alike in their
/// first `MOST_VALUE_BYTES` count as one.
pub const MOST_VALUE_BYTES: usize = 256;
/// Shards per rule, each with a lock and a share of the counters.
pub const SHARDS: usize = 4;
/// The domain and rule under which rules past `--top-rules` are counted together.
pub const OTHER: &str = "(other)";
/// Rows a period's lists may have at most.
pub const MOST_ROWS: usize = 1_000;

/// How values are shown (`--top-values`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Values {
    /// As sent: each entry `key=value`, joined by commas.
    Show,
    /// As 16 hex digits of a SipHash keyed at start: told apart, not readable.
    Hash,
    /// Not at all: only each rule's counts are kept.
    Hide,
}

/// What the top view keeps.
#[derive(Clone, Copy, Debug)]
pub struct TopSettings {
    /// Counters per rule, period, slot and kind (hits, denials): K.
    pub capacity: usize,
    /// Rules with sketches of their own.
    pub rules: usize,
    pub values: Values,
}

impl TopSettings {
    /// The most memory the sketches can take, in bytes: every counter of every slot holding a
    /// value of `MOST_VALUE_BYTES` (at most 80 bytes more each for the counter, its index entry
    /// and the allocation's rounding).
    pub fn most_bytes(&self) -> usize {
        let value = match self.values {
            Values::Show => MOST_VALUE_BYTES,
            Values::Hash | Values::Hide => 0,
        };
        let counters = match self.values {
            Values::Hide => 0,
            Values::Show | Values::Hash => self.capacity.div_ceil(SHARDS) * SHARDS,
        };
        let slots: usize = Period::ALL.iter().map(|p| p.slots()).sum();
        (self.rules + 1) * 2 * slots * counters * (value + 80)
    }
}

/// The top view: each rule's sketches, and the process's tallies.
pub struct Top {
    settings: TopSettings,
    /// The SipHash key of value ids (and of `--top-values hash`), drawn at start.
    key: (u64, u64),
    started: Instant,
    rules: Mutex<HashMap<(String, String), Arc<RuleTop>>>,
    other: Arc<RuleTop>,
    tallies: [Tallies; 2],
}

/// One rule's sketches, in `SHARDS` shards.
pub struct RuleTop {
    domain: String,
    rule: String,
    shards: [Mutex<Shard>; SHARDS],
}

/// A shard's hits and denials, over each period.
struct Shard {
    hits: [Ring<Sketch>; 2],
    denied: [Ring<Sketch>; 2],
}

impl Top {
    pub(super) fn new(settings: TopSettings) -> Self {
        let random = RandomState::new();
        Top {
            settings,
            key: (random.hash_one(1u8), random.hash_one(2u8)),
            started: Instant::now(),
            rules: Mutex::default(),
            other: Arc::new(RuleTop::new(OTHER, OTHER, &settings)),
            tallies: Period::ALL.map(Tallies::new),
        }
    }

    /// ms on the process's clock.
    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The sketches of `rule` in `domain`: its own while fewer than `--top-rules` have theirs,
    /// else `(other)`'s.
    pub fn rule(&self, domain: &str, rule: &str) -> Arc<RuleTop> {
        let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        let key = (domain.to_owned(), rule.to_owned());
        if let Some(r) = rules.get(&key) {
            return r.clone();
        }
        if rules.len() >= self.settings.rules {
            return self.other.clone();
        }
        let r = Arc::new(RuleTop::new(domain, rule, &self.settings));
        rules.insert(key, r.clone());
        r
    }

    /// Forgets the sketches of rules that `keep` (domain, rule) no longer has, making room for
    /// new ones.
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        rules.retain(|(domain, rule), _| keep(domain, rule));
    }

    /// `hits` of a descriptor of `entries` that matched `rule`, `denied` or not.
    pub fn record(&self, rule: &RuleTop, entries: &[(&[u8], &[u8])], hits: u64, denied: bool) {
        if hits == 0 {
            return;
        }
        let id = self.id(entries);
        let shown = || match self.settings.values {
            Values::Show => shown(entries),
            Values::Hash | Values::Hide => Box::default(),
        };
        let now = self.now();
        let mut shard = rule.shards[id as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for ring in &mut shard.hits {
            ring.current(now, Sketch::clear).add(id, hits, shown);
        }
        if denied {
            for ring in &mut shard.denied {
                ring.current(now, Sketch::clear).add(id, hits, shown);
            }
        }
    }

    /// One request decided, by the store or by `--on-store-error`.
    pub fn decided(&self) {
        let now = self.now();
        for t in &self.tallies {
            t.decided(now);
        }
    }

    /// One request answered by `--on-store-error` `answer` (one of `ANSWERS`).
    pub fn policy_answer(&self, answer: &str) {
        let Some(i) = ANSWERS.iter().position(|a| *a == answer) else {
            return;
        };
        let now = self.now();
        for t in &self.tallies {
            t.policy(now, i);
        }
    }

    /// One store call, which took `took`.
    pub fn store_call(&self, took: std::time::Duration) {
        let now = self.now();
        for t in &self.tallies {
            t.store_call(now, took);
        }
    }

    /// The id of a value: the keyed SipHash of its first `MOST_VALUE_BYTES` as shown.
    fn id(&self, entries: &[(&[u8], &[u8])]) -> u64 {
        let mut hasher = SipHasher13::new_with_keys(self.key.0, self.key.1);
        let mut left = MOST_VALUE_BYTES;
        for part in parts(entries) {
            let n = part.len().min(left);
            hasher.write(&part[..n]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        hasher.finish()
    }

    /// The `n` top rows of `period` (at most `MOST_ROWS`).
    pub fn report(&self, period: Period, n: usize) -> PeriodReport {
        let n = n.min(MOST_ROWS);
        let now = self.now();
        let p = period_index(period);
        let seconds = period.covered(now).as_secs_f64().max(0.001);
        let per_second = |count: u64| count as f64 / seconds;
        let mut rules: Vec<Arc<RuleTop>> = {
            let rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
            rules.values().cloned().collect()
        };
        rules.push(self.other.clone());
        // Only the `n` leading values are kept as rules are read, and only those become rows:
        // a render holds one rule's counters at a time, not every rule's.
        let (mut denied, mut hits, mut by_rule) = (Vec::new(), Vec::new(), Vec::new());
        for (i, rule) in rules.iter().enumerate() {
            let read = rule.read(p, now, n);
            leading(&mut denied, read.denied.into_iter().map(|c| (i, c)), n);
            leading(&mut hits, read.hits.into_iter().map(|c| (i, c)), n);
            if read.hits_total > 0 || read.denied_total > 0 {
                by_rule.push(RuleRow {
                    domain: rule.domain.clone(),
                    rule: rule.rule.clone(),
                    hits: read.hits_total,
                    denied: read.denied_total,
                    hits_per_second: per_second(read.hits_total),
                    denied_per_second: per_second(read.denied_total),
                    window_ends_in_seconds: None,
                });
            }
        }
        let rows = |counters: Vec<(usize, Counter)>| -> Vec<ValueRow> {
            counters
                .into_iter()
                .map(|(i, c)| ValueRow {
                    value: match self.settings.values {
                        Values::Show => String::from_utf8_lossy(&c.value).into_owned(),
                        Values::Hash | Values::Hide => format!("{:016x}", c.id),
                    },
                    domain: rules[i].domain.clone(),
                    rule: rules[i].rule.clone(),
                    count: c.count,
                    error: c.error,
                    per_second: per_second(c.count),
                })
                .collect()
        };
        let (denied, hits) = (rows(denied), rows(hits));
        let mut rules_by_denied = by_rule.clone();
        rules_by_denied.retain(|r| r.denied > 0);
        rules_by_denied
            .sort_by(|a, b| (b.denied, &a.domain, &a.rule).cmp(&(a.denied, &b.domain, &b.rule)));
        rules_by_denied.truncate(n);
        let mut rules_by_hits = by_rule;
        rules_by_hits
            .sort_by(|a, b| (b.hits, &a.domain, &a.rule).cmp(&(a.hits, &b.domain, &b.rule)));
        rules_by_hits.truncate(n);
        let tallies: Read = self.tallies[p].read(now);
        let [error, allow, deny] = tallies.policy;
        PeriodReport {
            period,
            seconds,
            values: self.settings.values,
            capacity: self.settings.capacity,
            decisions: tallies.decisions,
            decisions_per_second: per_second(tallies.decisions),
            store_calls: tallies.calls(),
            store_p50_ms: tallies.latency_ms(0.5),
            store_p99_ms: tallies.latency_ms(0.99),
            policy_answers: PolicyAnswers { error, allow, deny },
            denied,
            hits,
            rules_by_denied,
            rules_by_hits,
        }
    }
}

/// Adds `more` to `kept`, keeping the `n` leading: the most counted first, then the least error,
/// then by value and id; sorted once they are all in.
fn leading(
    kept: &mut Vec<(usize, Counter)>,
    more: impl Iterator<Item = (usize, Counter)>,
    n: usize,
) {
    kept.extend(more);
    kept.sort_unstable_by(|(_, a), (_, b)| {
        (b.count, a.error, &a.value, a.id).cmp(&(a.count, b.error, &b.value, b.id))
    });
    kept.truncate(n);
}

fn period_index(period: Period) -> usize {
    match period {
        Period::Minute => 0,
        Period::TenMinutes => 1,
    }
}

/// What one rule's sketches hold over a period.
struct RuleRead {
    denied: Vec<Counter>,
    hits: Vec<Counter>,
    denied_total: u64,
    hits_total: u64,
}

impl RuleTop {
    fn new(domain: &str, rule: &str, settings: &TopSettings) -> Self {
        let per_shard = match settings.values {
            Values::Hide => 0,
            Values::Show | Values::Hash => settings.capacity.div_ceil(SHARDS),
        };
        let rings = || Period::ALL.map(|p| Ring::new(p, || Sketch::new(per_shard)));
        RuleTop {
            domain: domain.to_owned(),
            rule: rule.to_owned(),
            shards: std::array::from_fn(|_| {
                Mutex::new(Shard {
                    hits: rings(),
                    denied: rings(),
                })
            }),
        }
    }

    /// The `n` values most denied and most hit over period `p` at `now`, and the totals; shards
    /// hold disjoint values, so each one's top `n` are all the merge needs.
    fn read(&self, p: usize, now: u64, n: usize) -> RuleRead {
        let mut read = RuleRead {
            denied: Vec::new(),
            hits: Vec::new(),
            denied_total: 0,
            hits_total: 0,
        };
        for shard in &self.shards {
            let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let (hits, denied) = (&shard.hits[p], &shard.denied[p]);
            read.hits_total += hits.recent(now).map(Sketch::total).sum::<u64>();
            read.denied_total += denied.recent(now).map(Sketch::total).sum::<u64>();
            read.hits.extend(sketch::merge(hits.recent(now), n));
            read.denied.extend(sketch::merge(denied.recent(now), n));
        }
        read
    }
}

/// A value's parts as shown: `key=value` entries joined by commas.
fn parts<'a>(entries: &'a [(&'a [u8], &'a [u8])]) -> impl Iterator<Item = &'a [u8]> {
    entries.iter().enumerate().flat_map(|(i, (k, v))| {
        let comma: &[u8] = if i == 0 { b"" } else { b"," };
        [comma, k, b"=", v]
    })
}

/// A value as shown, cut to `MOST_VALUE_BYTES`, in one allocation of its size.
fn shown(entries: &[(&[u8], &[u8])]) -> Box<[u8]> {
    let len = parts(entries).map(<[u8]>::len).sum::<usize>();
    let mut out = Vec::with_capacity(len.min(MOST_VALUE_BYTES));
    for part in parts(entries) {
        let n = part.len().min(MOST_VALUE_BYTES - out.len());
        out.extend_from_slice(&part[..n]);
    }
    out.into_boxed_slice()
}

/// `/top`: each period asked for.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub periods: Vec<PeriodReport>,
}

/// What one period holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeriodReport {
    pub period: Period,
    /// The time the period covers: its slots so far, or the process's life when shorter.
    pub seconds: f64,
    pub values: Values,
    /// `--top-capacity`.
    pub capacity: usize,
    /// Requests decided, by the store or by `--on-store-error`.
    pub decisions: u64,
    pub decisions_per_second: f64,
    /// Store calls, and the latency half and 99 % of them were within (the top of their
    /// bucket: within 25 %); `None` without calls.
    pub store_calls: u64,
    pub store_p50_ms: Option<f64>,
    pub store_p99_ms: Option<f64>,
    pub policy_answers: PolicyAnswers,
    /// The values with the most hits denied, then those with the most hits.
    pub denied: Vec<ValueRow>,
    pub hits: Vec<ValueRow>,
    /// Rules by hits denied (those with any), then by hits.
    pub rules_by_denied: Vec<RuleRow>,
    pub rules_by_hits: Vec<RuleRow>,
}

/// Requests answered by `--on-store-error`, by its answer.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct PolicyAnswers {
    pub error: u64,
    pub allow: u64,
    pub deny: u64,
}

/// One value of one rule: its hits (denied, or all), at least the true count and at most `error`
/// above it.
#[derive(Debug, Serialize, Deserialize)]
pub struct ValueRow {
    pub value: String,
    pub domain: String,
    pub rule: String,
    pub count: u64,
    pub error: u64,
    pub per_second: f64,
}

/// One rule's hits and denied hits.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RuleRow {
    pub domain: String,
    pub rule: String,
    pub hits: u64,
    pub denied: u64,
    pub hits_per_second: f64,
    pub denied_per_second: f64,
    /// For a rule with a limit on the calendar, the seconds until its window ends (the soonest,
    /// for several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ends_in_seconds: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(values: Values) -> TopSettings {
        TopSettings {
            capacity: 16,
            rules: 2,
            values,
        }
    }

    fn ip(n: u32) -> Vec<u8> {
        format!("10.0.{}.{}", n / 256, n % 256).into_bytes()
    }

    #[test]
    fn a_value_is_its_entries_joined_and_cut_to_the_most_bytes() {
        let entries: [(&[u8], &[u8]); 2] = [(b"generic_key", b"a"), (b"header_match", b"b")];
        assert_eq!(&*shown(&entries), b"generic_key=a,header_match=b");
        let long = vec![b'x'; 1_000];
        let entries: [(&[u8], &[u8]); 1] = [(b"k", &long)];
        assert_eq!(shown(&entries).len(), MOST_VALUE_BYTES);
        let top = Top::new(settings(Values::Show));
        let mut other = long.clone();
        other[900] = b'y';
        let alike: [(&[u8], &[u8]); 1] = [(b"k", &other)];
        assert_eq!(top.id(&entries), top.id(&alike), "alike in the bytes kept");
    }

    #[test]
    fn the_most_denied_values_lead_among_many_others() {
        let top = Top::new(settings(Values::Show));
        let rule = top.rule("d", "remote_address");
        for n in 0..20_000 {
            let v = ip(n % 10_000 + 3);
            top.record(&rule, &[(b"remote_address", &v)], 1, false);
            if n % 100 == 0 {
                for heavy in 0..3 {
                    let v = ip(heavy);
                    top.record(&rule, &[(b"remote_address", &v)], 1, true);
                }
            }
        }
        let report = top.report(Period::Minute, 3);
        let firsts: Vec<&str> = report.denied.iter().map(|r| r.value.as_str()).collect();
        assert_eq!(
            firsts,
            [
                "remote_address=10.0.0.0",
                "remote_address=10.0.0.1",
                "remote_address=10.0.0.2"
            ]
        );
        assert!(report.denied.iter().all(|r| r.count == 200 && r.error == 0));
        assert_eq!(report.rules_by_hits[0].hits, 20_600);
        assert_eq!(report.rules_by_denied[0].denied, 600);
    }

    #[test]
    fn rules_past_the_cap_are_counted_as_other() {
        let top = Top::new(settings(Values::Show));
        let names: Vec<String> = ["a", "b", "c", "d"]
            .iter()
            .map(|r| top.rule("d", r).rule.clone())
            .collect();
        assert_eq!(names, ["a", "b", OTHER, OTHER]);
        top.retain(|_, rule| rule != "a");
        assert_eq!(top.rule("d", "c").rule, "c", "a forgotten rule makes room");
    }

    #[test]
    fn hashed_and_hidden_values_never_show_the_value() {
        for values in [Values::Hash, Values::Hide] {
            let top = Top::new(settings(values));
            let rule = top.rule("d", "user");
            top.record(&rule, &[(b"user", b"alice")], 5, true);
            let report = top.report(Period::TenMinutes, 10);
            let json = serde_json::to_string(&report).unwrap();
            assert!(!json.contains("alice"), "{values:?}: {json}");
            assert_eq!(report.rules_by_denied[0].denied, 5);
            match values {
                Values::Hash => assert_eq!(report.denied[0].value.len(), 16),
                _ => assert!(report.denied.is_empty() && report.hits.is_empty()),
            }
        }
    }

    #[test]
    fn a_million_distinct_values_stay_within_the_bound() {
        let top = Top::new(TopSettings {
            capacity: 64,
            rules: 1,
            values: Values::Show,
        });
        let rule = top.rule("d", "k");
        for n in 0..1_000_000u32 {
            let v = n.to_be_bytes();
            top.record(&rule, &[(b"k", &v)], 1, n % 2 == 0);
        }
        let held: usize = rule
            .shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap();
                let count = |rings: &[Ring<Sketch>; 2]| {
                    rings
                        .iter()
                        .flat_map(|r| r.recent(top.now()))
                        .map(Sketch::held)
                        .sum::<usize>()
                };
                count(&s.hits) + count(&s.denied)
            })
            .sum();
        assert!(held <= SHARDS * 16 * 2 * (7 + 11), "{held}");
        let report = top.report(Period::Minute, 1_000);
        assert_eq!(report.rules_by_hits[0].hits, 1_000_000);
        // K values a slot at most; a slow run spans more than one of the period's slots.
        assert!(report.hits.len() <= 64 * Period::Minute.slots());
    }
}
