//! `sluice explain` and `POST /explain`: for a request, each descriptor's walk through the rule
//! tree (`RuleSet::explain`, the request path's own matching), then what the request path plans
//! from it, by the same `RuleSet::plan` (`rules::plan`) as `rls`: the limits chosen, those
//! `replaces` dropped, the hits, and the counter (and Redis key) each limit moves. Nothing is
//! counted: no store is asked and no metric moves.

mod render;

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::auth::{AdminAccess, guarded};
use super::http::decode;
use super::in_force::Rules;
use super::rls::{Answering, Bounds, descriptors};
use crate::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use sluice_core::limiter::lease::Leases;
use sluice_core::limiter::{Item, ItemStep, Limit, Mode, Scope};
use sluice_core::rules::plan::{Asked, Plan};
use sluice_core::rules::{Matched, Node, RuleSet, Stop, Walk, limit_json, rule_limit_json};
use sluice_core::store::redis_key;
use sluice_core::store::unix_ms;

/// A request to explain, as the rate limit service would receive it.
pub struct Request(RateLimitRequest);

impl Request {
    /// A request in protobuf JSON, as `/json` takes it.
    pub fn from_json(body: &[u8]) -> Result<Request, String> {
        decode(body).map(|(request, _)| Request(request))
    }

    /// A request for `domain` with one descriptor per list of (key, value) entries.
    pub fn new(domain: &str, descriptors: &[Vec<(String, String)>]) -> Request {
        let descriptor = |entries: &Vec<(String, String)>| RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(key, value)| Entry {
                    key: key.as_bytes().to_vec(),
                    value: value.as_bytes().to_vec(),
                })
                .collect(),
            ..Default::default()
        };
        Request(RateLimitRequest {
            domain: domain.as_bytes().to_vec(),
            descriptors: descriptors.iter().map(descriptor).collect(),
            hits_addend: 0,
        })
    }
}

/// How the rules answer one request, descriptor by descriptor.
#[derive(Serialize)]
pub struct Explanation {
    domain: String,
    /// Whether a rule file declares the domain (else every descriptor is OK with no limit).
    known_domain: bool,
    /// The prefix the Redis keys are shown under; `None` for a server on the embedded store.
    redis_key_prefix: Option<String>,
    descriptors: Vec<Descriptor>,
}

#[derive(Serialize)]
struct Descriptor {
    /// Every entry of the request descriptor, in order.
    entries: Vec<WalkStep>,
    /// Why the walk ended before the last entry, if it did.
    stop: Option<Stopped>,
    /// The rule matched by the last entry, when every entry matched.
    rule: Option<Rule>,
    /// The request's own limit for this descriptor, which replaces the rule's.
    #[serde(rename = "override")]
    limit_override: Option<Value>,
    /// Hits every limit of the descriptor would consume (or give back when `refund`).
    hits: u64,
    /// `descriptor`: its own `hits_addend`; `request`: the request's, 0 meaning 1.
    hits_from: &'static str,
    refund: bool,
    /// The rule's limits dropped because a rule of the request `replaces` them.
    replaced: Vec<Replaced>,
    /// `limited`, `unlimited` or `no_limit` (OK without a limit).
    result: &'static str,
    /// Whether `share_threshold` made every value of a pattern share the counters.
    shared_counter: bool,
    /// The counters the request would move, one per limit that applies.
    counters: Vec<Counter>,
}

#[derive(Serialize)]
struct WalkStep {
    key: String,
    value: String,
    /// `exact`, `wildcard`, `key` (a key-only rule), `none`, or `not_reached` after a `none`.
    #[serde(rename = "match")]
    how: &'static str,
    /// The `*` pattern that matched, for `wildcard`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pattern: Option<String>,
    /// `file:line` of the rule the entry matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<String>,
    /// What the counters count the entry under: its value, or the pattern under
    /// `share_threshold`.
    #[serde(skip_serializing_if = "Option::is_none")]
    counted_value: Option<String>,
}

#[derive(Serialize)]
struct Stopped {
    /// The index of the entry that matched nothing.
    entry: usize,
    reason: &'static str,
    message: String,
}

#[derive(Serialize)]
struct Rule {
    /// `file:line`.
    source: String,
    /// As the metrics name it.
    path: String,
    modes: Map<String, Value>,
    share_threshold: bool,
    /// As the rule declares them, `replaces` included.
    limits: Vec<Value>,
}

#[derive(Serialize)]
struct Replaced {
    name: String,
    /// The descriptors whose rules replace it.
    by: Vec<usize>,
}

#[derive(Serialize)]
struct Counter {
    /// `rule`, or `override` for the request's own limit.
    source: &'static str,
    limit: Value,
    modes: Map<String, Value>,
    /// The counter's identity, as the embedded store keys it.
    counter: String,
    /// Its Redis key under the prefix.
    redis_key: Option<String>,
    /// A calendar limit's window now: its start and end in the limit's zone, and the seconds
    /// left until it ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    window: Option<Value>,
    /// What a held rule's call does: `{"holds": n}` at the request, `{"settles": hits}` at the
    /// response.
    #[serde(skip_serializing_if = "Option::is_none")]
    hold: Option<Value>,
}

/// Explains `request` against `rules` after the checks of the request path (within `bounds`),
/// answered as `answering` says (global quota mode, default counting), with Redis keys under
/// `redis_key_prefix` when given.
pub fn explain(
    rules: &RuleSet,
    request: &Request,
    bounds: &Bounds,
    answering: &Answering,
    redis_key_prefix: Option<&str>,
) -> Result<Explanation, String> {
    let request = &request.0;
    bounds
        .validate(request)
        .map_err(|s| s.message().to_owned())?;
    let domain = request.domain.as_slice();
    let asked = descriptors(request);
    let (plans, check) = rules.plan(domain, &asked, answering.global(), false);
    let walks: Vec<Walk> = asked
        .iter()
        .map(|d| rules.explain(domain, &d.entries))
        .collect();
    let descriptors = request
        .descriptors
        .iter()
        .zip(&asked)
        .zip(&walks)
        .zip(&plans)
        .map(|(((descriptor, asked), walk), plan)| {
            let items = match plan {
                Plan::Limited { items, .. } => &check.items[items.clone()],
                Plan::Free | Plan::Unlimited => &[],
            };
            explain_descriptor(
                descriptor,
                asked,
                walk,
                plan,
                items,
                &walks,
                redis_key_prefix,
            )
        })
        .collect();
    Ok(Explanation {
        domain: text(domain),
        known_domain: rules.has_domain(domain),
        redis_key_prefix: redis_key_prefix.map(str::to_owned),
        descriptors,
    })
}

fn explain_descriptor(
    descriptor: &RateLimitDescriptor,
    asked: &Asked,
    walk: &Walk,
    plan: &Plan,
    items: &[Item],
    walks: &[Walk],
    redis_key_prefix: Option<&str>,
) -> Descriptor {
    let counted = walk.matched.as_ref().map(|m| &m.counted_values);
    let stop = walk.stop.map(|stop| {
        let entry = walk.steps.len();
        Stopped {
            entry,
            reason: stop.name(),
            message: stop_message(stop, walk, descriptor, entry),
        }
    });
    let node = walk.matched.as_ref().map(|m| m.node);
    let rule = node.map(|node| Rule {
        source: node.source(),
        path: node.path().to_owned(),
        modes: node.modes(),
        share_threshold: node.share_threshold(),
        limits: node.limits.iter().map(rule_limit_json).collect(),
    });
    Descriptor {
        entries: entry_steps(descriptor, walk),
        stop,
        rule,
        limit_override: asked.limit.map(|o| {
            json!({
                "requests_per_unit": o.requests_per_unit,
                "unit": o.unit.name(),
            })
        }),
        hits: asked.hits,
        hits_from: if descriptor.hits_addend.is_some() {
            "descriptor"
        } else {
            "request"
        },
        refund: descriptor.is_negative_hits,
        replaced: replaced(descriptor, node, plan, items, walks),
        result: match plan {
            Plan::Free => "no_limit",
            Plan::Unlimited => "unlimited",
            Plan::Limited { .. } => "limited",
        },
        shared_counter: counted.is_some_and(|c| {
            c.iter()
                .zip(&descriptor.entries)
                .any(|(counted, entry)| *counted != entry.value.as_slice())
        }),
        counters: counters(descriptor, items, redis_key_prefix),
    }
}

/// How each entry of `descriptor` fared in `walk`.
fn entry_steps(descriptor: &RateLimitDescriptor, walk: &Walk) -> Vec<WalkStep> {
    let counted = walk.matched.as_ref().map(|m| &m.counted_values);
    descriptor
        .entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let (how, pattern, rule) = match walk.steps.get(i) {
                Some((Matched::Exact, node)) => ("exact", None, Some(node.source())),
                Some((Matched::Pattern(p), node)) => {
                    ("wildcard", Some(text(p)), Some(node.source()))
                }
                Some((Matched::Key, node)) => ("key", None, Some(node.source())),
                // Taken by the rule of the last step: its settle entry, a weight's entry.
                None if i < walk.steps.len() + walk.taken => (
                    "taken",
                    None,
                    walk.steps.last().map(|(_, node)| node.source()),
                ),
                None if i == walk.steps.len() => ("none", None, None),
                None => ("not_reached", None, None),
            };
            WalkStep {
                key: text(&entry.key),
                value: text(&entry.value),
                how,
                pattern,
                rule,
                counted_value: counted.and_then(|c| c.get(i)).map(|v| text(v)),
            }
        })
        .collect()
}

/// The named limits of the rule at `node` missing from the plan: dropped by a `replaces` of the
/// request's rules (an unnamed one of a held rule, by the request's earlier descriptor of the
/// same request: it holds once).
fn replaced(
    descriptor: &RateLimitDescriptor,
    node: Option<&Node>,
    plan: &Plan,
    items: &[Item],
    walks: &[Walk],
) -> Vec<Replaced> {
    match (node, plan) {
        (Some(node), Plan::Limited { .. } | Plan::Free) if descriptor.limit.is_none() => node
            .limits
            .iter()
            .filter(|l| {
                !l.name.is_empty()
                    && l.limit
                        .as_ref()
                        .is_some_and(|limit| !items.iter().any(|i| i.limit == *limit))
            })
            .map(|l| Replaced {
                name: l.name.clone(),
                by: replacers(&l.name, walks),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The counters of `items`, as `descriptor` has them counted.
fn counters(
    descriptor: &RateLimitDescriptor,
    items: &[Item],
    redis_key_prefix: Option<&str>,
) -> Vec<Counter> {
    items
        .iter()
        .map(|item| Counter {
            source: if descriptor.limit.is_some() {
                "override"
            } else {
                "rule"
            },
            limit: limit_json(&item.limit),
            modes: item_modes(item),
            counter: text(item.key.as_bytes()),
            redis_key: redis_key_prefix
                .filter(|_| !item.scope.is_local())
                .map(|p| text(&redis_key(p.as_bytes(), &item.key))),
            hold: match item.step {
                ItemStep::Held(h) if h.settle => Some(json!({"settles": item.hits})),
                ItemStep::Held(h) => Some(json!({"holds": h.estimate})),
                _ => None,
            },
            window: calendar_window(&item.limit, unix_ms()),
        })
        .collect()
}

/// The descriptors whose matched rules name `name` in their `replaces`.
fn replacers(name: &str, walks: &[Walk]) -> Vec<usize> {
    walks
        .iter()
        .enumerate()
        .filter(|(_, w)| {
            w.matched.as_ref().is_some_and(|m| {
                m.node
                    .limits
                    .iter()
                    .any(|l| l.replaces.iter().any(|r| r == name))
            })
        })
        .map(|(i, _)| i)
        .collect()
}

/// How a counter takes part in the decision, by mode name, as `Node::modes` names the rule's.
fn item_modes(item: &Item) -> Map<String, Value> {
    [
        ("shadow_mode", json!(item.mode.is_shadow())),
        (
            "quota_mode",
            json!(matches!(item.mode, Mode::Quota | Mode::ShadowQuota)),
        ),
        ("counting", json!(item.counting.name())),
        ("leased", json!(Leases::hold(item))),
        // Only where it is not the default, as the rule's own (`Node::modes`) says it.
        (
            "scope",
            json!((item.scope != Scope::Global).then(|| item.scope.name())),
        ),
    ]
    .into_iter()
    .map(|(name, on)| (name.to_owned(), on))
    .collect()
}

fn stop_message(stop: Stop, walk: &Walk, descriptor: &RateLimitDescriptor, entry: usize) -> String {
    let key = text(&descriptor.entries[entry].key);
    let value = text(&descriptor.entries[entry].value);
    let under = match walk.steps.last() {
        Some((_, node)) => format!("under rule `{}` ({})", node.path(), node.source()),
        None => "at the top of the domain".to_owned(),
    };
    match stop {
        Stop::UnknownDomain => "no rule file declares this domain: every descriptor is OK with no limit, as envoyproxy/ratelimit answers".to_owned(),
        Stop::DeeperThanRules if entry == 0 => "the domain has no rules".to_owned(),
        Stop::DeeperThanRules => format!(
            "the descriptor has more entries than the rules are deep: no rule is nested {under}"
        ),
        Stop::NoRuleForKey => format!("no rule has key `{key}` {under}"),
        Stop::NoRuleForValue => format!(
            "rules with key `{key}` {under} take other values: none is `{value}` exactly, no pattern matches it, and none is key-only"
        ),
    }
}

/// Request bytes as text: UTF-8 as it is, a backslash as `\\`, any other byte as `\xNN` (as
/// redis-cli reads them between double quotes).
pub(super) fn text(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' {
                out.push_str("\\\\");
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            write!(out, "\\x{b:02x}").expect("writing to a String succeeds");
        }
    }
    out
}

/// A calendar limit's window holding `at_ms`: its start and end in the limit's zone, and the
/// seconds from `at_ms` to its end; `None` off the calendar.
pub(super) fn calendar_window(limit: &Limit, at_ms: u64) -> Option<Value> {
    limit.calendar.as_ref().map(|calendar| {
        let span = calendar.span(limit.unit, at_ms);
        json!({
            "start": calendar.civil(span.start),
            "end": calendar.civil(span.end),
            "ends_in_seconds": span.end.saturating_sub(at_ms).div_ceil(1000),
        })
    })
}

/// What `/explain` answers with: the rules in force, the server's bounds, answering and Redis
/// key prefix.
struct Explainer {
    rules: Rules,
    bounds: Bounds,
    answering: Answering,
    redis_key_prefix: Option<String>,
}

/// The `POST /explain` route, bounded to `max_body` bytes: the rules in force, explained for a
/// request in protobuf JSON (as `/json` takes it); 200 with the explanation, 400 for a malformed
/// request, 413 past `max_body`.
pub(super) fn route(
    rules: Rules,
    bounds: Bounds,
    answering: Answering,
    redis_key_prefix: Option<String>,
    max_body: usize,
    access: &AdminAccess,
) -> Router {
    let explainer = Arc::new(Explainer {
        rules,
        bounds,
        answering,
        redis_key_prefix,
    });
    Router::new()
        .route("/explain", guarded(post(answer), access))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(explainer)
}

async fn answer(State(explainer): State<Arc<Explainer>>, body: Bytes) -> Response {
    let explained = Request::from_json(&body).and_then(|request| {
        explain(
            &explainer.rules.in_force(),
            &request,
            &explainer.bounds,
            &explainer.answering,
            explainer.redis_key_prefix.as_deref(),
        )
        .map_err(|m| format!("{m}\n"))
    });
    match explained {
        Ok(explanation) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            explanation.to_json(),
        )
            .into_response(),
        Err(message) => (StatusCode::BAD_REQUEST, message).into_response(),
    }
}
