//! `POST /counters`: an operator's hand on the counters of one request. Given a domain and
//! descriptors, as Envoy sends them, it finds the counters the request would move (by the request
//! path's own plan, as `/explain` does) and shows what each holds, or resets it, sets it or adds
//! to it. Nothing changes unless the body says `"apply": true`: without it the answer is a dry
//! run, the counters as they are and what the action would make of them.
//!
//! - `reset`: the counter is deleted, as if never written (a window counts nothing, a log holds
//!   no entry, a bucket is full): in the window now, or, for a `fixed_window`, the one holding
//!   `"at"`.
//! - `set`: reset, then `hits` charged (two store calls: a request between them counts too).
//! - `add`: `hits` charged (counted `always`: past the limit too), or given back when negative
//!   (down to an empty counter, as Envoy's refunds do).
//!
//! Every replica forgets what it knew of a counter reset or given hits back: its local
//! over-limit cache entry and its leased blocks (dropped, not given back: the store no longer
//! counts them), this one at once and the others through the store (`Store::reset`); a leased
//! counter on Redis only after the give-backs on their way have landed (see `change`). Each change
//! is logged as an audit line (who, what, before, after) and counted
//! (`sluice_counter_changes`).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use serde::Serialize;
use serde_json::{Map, Value, json};

mod asked;
mod audit;
mod change;

use super::auth::{AdminAccess, Refusal, guarded};
use super::conns::Peer;
use super::explain::{calendar_window, text};
use super::http::decode;
use super::in_force::Rules;
use super::rls::{Answering, Bounds, descriptors};
use crate::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use crate::telemetry::Telemetry;
use asked::{Action, Asked, check_at, check_room, dry_run, hits_of, read_call};
use change::Outcome;
use sluice_core::limiter::lease::Leases;
use sluice_core::limiter::{Algorithm, Check, Counting, Item, ItemStep, Mode, OverLimitCache};
use sluice_core::rules::limit_json;
use sluice_core::rules::plan::Plan;
use sluice_core::store::unix_ms;
use sluice_core::store::{Deadline, Store, redis_key};

/// How long the store has for each call of a change: an operator waits, no request does.
const STORE_WAIT: Duration = Duration::from_secs(2);
/// How long past a give-back's own deadline a reset of leased counters waits before it deletes
/// them.
const RESET_MARGIN: Duration = Duration::from_millis(100);

/// One counter's line of the answer.
#[derive(Serialize)]
struct Line {
    /// The request descriptor it is a counter of.
    descriptor: usize,
    limit: Value,
    counter: String,
    /// Where it is counted: in the store (`global`, `cluster`), or in this replica's memory
    /// (`replica`, `split`: the replica answering, alone).
    scope: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_key: Option<String>,
    /// A calendar limit's window the call acts on.
    #[serde(skip_serializing_if = "Option::is_none")]
    window: Option<Value>,
    before: CounterHolds,
    /// After the change (applied), or what it would make (a dry run); absent when the change
    /// was applied but the counters could not be read back.
    after: Option<CounterHolds>,
}

/// What a counter holds.
#[derive(Clone, Copy, Serialize)]
struct CounterHolds {
    /// Hits counted (a bucket: its capacity less what it holds), leased blocks included; a
    /// window's past its limit too (charges counted always, settles).
    used: u64,
    /// What a held counter's requests in flight hold (`hold`), and how many they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    held: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    holds: Option<usize>,
    /// What a new request finds: the limit less what is used and held.
    remaining: u64,
}

/// What `/counters` answers from.
struct Counters {
    rules: Rules,
    bounds: Bounds,
    answering: Answering,
    store: Store,
    cache: Option<Arc<OverLimitCache>>,
    leases: Arc<Leases>,
    telemetry: Telemetry,
    redis_key_prefix: Option<String>,
    access: AdminAccess,
}

/// What a `/counters` route is made of.
pub(super) struct Parts {
    pub(super) rules: Rules,
    pub(super) bounds: Bounds,
    pub(super) answering: Answering,
    pub(super) store: Store,
    pub(super) cache: Option<Arc<OverLimitCache>>,
    pub(super) leases: Arc<Leases>,
    pub(super) telemetry: Telemetry,
    pub(super) redis_key_prefix: Option<String>,
}

/// The `POST /counters` route, bounded to `max_body` bytes and behind the admin token when there
/// is one: 200 with the counters, 400 for a malformed call, 403 for a change without the token
/// on an untrusted port, 413 past `max_body`, 503 when the store could not answer (what was
/// applied before is in the log).
pub(super) fn route(parts: Parts, max_body: usize, access: &AdminAccess) -> Router {
    let counters = Arc::new(Counters {
        rules: parts.rules,
        bounds: parts.bounds,
        answering: parts.answering,
        store: parts.store,
        cache: parts.cache,
        leases: parts.leases,
        telemetry: parts.telemetry,
        redis_key_prefix: parts.redis_key_prefix,
        access: access.clone(),
    });
    Router::new()
        .route("/counters", guarded(post(answer), access))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(counters)
}

async fn answer(
    State(counters): State<Arc<Counters>>,
    peer: Option<Extension<Peer>>,
    body: Bytes,
) -> Response {
    let peer = peer.map(|Extension(Peer(ip))| ip);
    match counters.call(&body, peer).await {
        Ok(answer) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            answer,
        )
            .into_response(),
        Err((status, message)) => (status, format!("{message}\n")).into_response(),
    }
}

type Failed = (StatusCode, String);

fn bad(message: impl Into<String>) -> Failed {
    (StatusCode::BAD_REQUEST, message.into())
}

/// The counters a call acts on: each with the descriptor it is first a counter of, whether it
/// is a held rule's, and whether replicas may hold leased blocks of one of them.
struct Found {
    counters: Vec<(usize, Item)>,
    holding: Vec<bool>,
    leased: bool,
}

impl Counters {
    async fn call(&self, body: &[u8], peer: Option<IpAddr>) -> Result<String, Failed> {
        let (mut asked, request) = read_call(body)?;
        self.permitted(&asked, peer)?;
        let now = unix_ms();
        let (request, at) = self.request(&request, now)?;
        asked.at = at;
        let domain = request.domain.as_slice();
        let found = self.found(&request, &asked)?;
        if let Some(at) = asked.at {
            check_at(&found.counters, at, now)?;
        }
        // A split limit's counter holds this replica's share.
        let mut check = Check {
            items: found.counters.iter().map(|(_, i)| i.clone()).collect(),
            ..Check::default()
        };
        self.store.share(&mut check).map_err(unavailable)?;
        let items = check.items;
        let before = self.held(&items, &found.holding, asked.at).await?;
        check_room(&items, &before, asked.action)?;
        let applying = asked.apply && asked.action != Action::Show;
        let (after, outcome) = if applying {
            self.apply(&items, &asked, &found).await
        } else {
            (dry_run(&items, &before, asked.action), Outcome::DryRun)
        };
        let lines = self.lines(&found, &items, &before, &after, asked.at.unwrap_or(now));
        if applying {
            self.audit(&asked, peer, domain, &lines, &outcome);
            if outcome.changed() {
                self.telemetry
                    .counter_changes(asked.action.name(), lines.len() as u64);
            }
        }
        if let Some((status, message)) = outcome.failure() {
            return Err((status, message));
        }
        Ok(answer_text(&asked, applying, domain, lines))
    }

    /// Refuses a change without the admin token on a port not declared trusted.
    fn permitted(&self, asked: &Asked, peer: Option<IpAddr>) -> Result<(), Failed> {
        if asked.apply && asked.action != Action::Show && !self.access.may_change() {
            self.access.refuse(Refusal::Untrusted, peer, "/counters");
            return Err((
                StatusCode::FORBIDDEN,
                "refused: /counters changes counters only when asked with the admin token \
                 (--admin-token-file), or on an admin port declared trusted \
                 (--trust-admin-port); nothing was changed"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// The request of a call, within the bounds, and the instant it names, if not further ahead
    /// than `--max-schedule-ahead` from `now`.
    fn request(&self, json: &[u8], now: u64) -> Result<(RateLimitRequest, Option<u64>), Failed> {
        let (request, at) = decode(json).map_err(|m| bad(m.trim_end()))?;
        self.bounds
            .validate(&request)
            .map_err(|s| bad(s.message()))?;
        if let Some(at) = at
            && at > now + self.bounds.max_schedule_ahead.as_millis() as u64
        {
            return Err(bad(
                "\"at\" lies further ahead than --max-schedule-ahead allows",
            ));
        }
        Ok((request, at))
    }

    /// The counters `request` touches under the rules in force (those of the limit `asked`
    /// names, if it names one), each once; 404 for a domain no rule declares.
    fn found(&self, request: &RateLimitRequest, asked: &Asked) -> Result<Found, Failed> {
        let rules = self.rules.in_force();
        let domain = request.domain.as_slice();
        if !rules.has_domain(domain) {
            return Err((
                StatusCode::NOT_FOUND,
                format!(
                    "no rules in force for the domain {}: no counter to show or change",
                    text(domain)
                ),
            ));
        }
        let asked_descriptors = descriptors(request);
        let (plans, check) = rules.plan(domain, &asked_descriptors, self.answering.global(), false);
        let mut seen = HashSet::new();
        let mut found = Found {
            counters: Vec::new(),
            holding: Vec::new(),
            leased: false,
        };
        for (descriptor, plan) in plans.iter().enumerate() {
            let Plan::Limited { items, .. } = plan else {
                continue;
            };
            for item in &check.items[items.clone()] {
                if asked.limit.as_ref().is_some_and(|l| *l != item.limit.name)
                    || !seen.insert((item.key.clone(), item.limit.requests_per_unit))
                {
                    continue;
                }
                found.leased |= Leases::hold(item);
                found.holding.push(matches!(item.step, ItemStep::Held(_)));
                found.counters.push((descriptor, plain(item)));
            }
        }
        Ok(found)
    }

    /// Applies the change `asked` says to `items`: what they hold after it, and its outcome.
    async fn apply(
        &self,
        items: &[Item],
        asked: &Asked,
        found: &Found,
    ) -> (Vec<CounterHolds>, Outcome) {
        match self.change(items, asked, found.leased).await {
            Ok(()) => match self.held(items, &found.holding, asked.at).await {
                Ok(after) => (after, Outcome::Applied),
                Err(_) => (Vec::new(), Outcome::AppliedUnread),
            },
            Err(e) if e.surely_not_applied => (Vec::new(), Outcome::Failed(e.message)),
            Err(e) => (Vec::new(), Outcome::Unknown(e.message)),
        }
    }

    /// The answer's line of each counter, in the window holding `at`.
    fn lines(
        &self,
        found: &Found,
        items: &[Item],
        before: &[CounterHolds],
        after: &[CounterHolds],
        at: u64,
    ) -> Vec<Line> {
        found
            .counters
            .iter()
            .zip(items)
            .zip(before.iter().enumerate())
            .map(|(((descriptor, _), item), (i, before))| Line {
                descriptor: *descriptor,
                limit: limit_json(&item.limit),
                counter: text(item.key.as_bytes()),
                scope: item.scope.name(),
                redis_key: self
                    .redis_key_prefix
                    .as_ref()
                    .filter(|_| !item.scope.is_local())
                    .map(|p| text(&redis_key(p.as_bytes(), &item.key))),
                window: calendar_window(&item.limit, at),
                before: *before,
                after: after.get(i).copied(),
            })
            .collect()
    }

    /// What the counters of `items` hold now (a fixed window: in the window holding `at`), and
    /// what their holds hold where `holding` says they are a held rule's.
    async fn held(
        &self,
        items: &[Item],
        holding: &[bool],
        at: Option<u64>,
    ) -> Result<Vec<CounterHolds>, Failed> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        // A window is probed under the largest limit, so that a count past its own shows
        // whole; its counter is the same whatever the limit.
        let counts_past = |i: &Item| {
            matches!(
                i.limit.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingWindow
            )
        };
        let probe = Check {
            items: items
                .iter()
                .map(|i| {
                    let mut probe = Item {
                        hits: 0,
                        ..i.clone()
                    };
                    if counts_past(i) {
                        probe.limit.requests_per_unit = u32::MAX;
                    }
                    probe
                })
                .collect(),
            at,
            quota_passes: false,
        };
        let decision = self
            .store
            .apply(&probe, Deadline::new(STORE_WAIT, None))
            .await
            .map_err(unavailable)?;
        let held = if holding.iter().any(|h| *h) {
            self.store
                .held(items, Deadline::new(STORE_WAIT, None))
                .await
                .map_err(unavailable)?
        } else {
            vec![(0, 0); items.len()]
        };
        Ok(decision
            .usages
            .iter()
            .zip(items)
            .zip(held)
            .zip(holding)
            .map(|(((usage, item), (in_flight, holds)), &is_held)| {
                let capacity = u64::from(item.limit.capacity());
                let used = if counts_past(item) {
                    u64::from(u32::MAX) - usage.remaining.min(u64::from(u32::MAX))
                } else {
                    capacity - usage.remaining.min(capacity)
                };
                CounterHolds {
                    used,
                    held: is_held.then_some(in_flight),
                    holds: is_held.then_some(holds),
                    remaining: capacity.saturating_sub(used + in_flight),
                }
            })
            .collect())
    }

    /// Forgets what this replica knew of the counters of `items`: they may have room again.
    fn forget(&self, items: &[Item]) {
        for item in items {
            if let Some(cache) = &self.cache {
                cache.forget(item.key.as_bytes(), item.limit.requests_per_unit);
            }
            self.leases
                .forget(item.key.as_bytes(), item.limit.requests_per_unit);
        }
    }
}

/// The JSON answer of a call.
fn answer_text(asked: &Asked, applying: bool, domain: &[u8], lines: Vec<Line>) -> String {
    let mut answer = Map::new();
    answer.insert("action".to_owned(), json!(asked.action.name()));
    if let Some(hits) = hits_of(asked.action) {
        answer.insert("hits".to_owned(), json!(hits));
    }
    answer.insert("applied".to_owned(), json!(applying));
    answer.insert("domain".to_owned(), json!(String::from_utf8_lossy(domain)));
    answer.insert("counters".to_owned(), json!(lines));
    let mut text =
        serde_json::to_string_pretty(&Value::Object(answer)).expect("an answer serializes");
    text.push('\n');
    text
}

/// The counter of `item` as `/counters` moves it: its own hits, enforced, no lease, no hold.
fn plain(item: &Item) -> Item {
    Item {
        hits: 0,
        refund: false,
        mode: Mode::Enforce,
        counting: Counting::Admitted,
        leased: false,
        step: ItemStep::Hits,
        ..item.clone()
    }
}

fn unavailable(e: sluice_core::store::StoreError) -> Failed {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the store could not answer: {e}"),
    )
}
