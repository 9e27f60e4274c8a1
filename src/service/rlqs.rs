//! The Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, `StreamRateLimitQuotas`):
//! each Envoy holds one stream and reports, every few seconds, what each of its buckets let
//! through and denied; sluice answers every report of a bucket at once with the Envoy's share of
//! the bucket's global limit, as a token bucket Envoy enforces itself. No request waits for sluice.
//!
//! Envoy 1.40 enforces only what it is told in this shape (see docs/quota-service.md): a token
//! bucket with an explicit `tokens_per_fill` and a whole-second `fill_interval`, or a blanket rule;
//! an assignment with a whole-second time to live, which expires without a new one, so it is sent
//! again on every report. The first report of a bucket on a stream subscribes the stream to it.
//! When one report changes how a bucket divides, the other streams of that bucket on this replica
//! get their new shares at once; streams on other replicas get theirs with their next report.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::Shutdown;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use super::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::limiter::{CounterKey, DescriptorKey, Limit};
use crate::quota::{Assignment, MILLI, demand, divide, settle};
use crate::rules::{QuotaRule, RuleSet};
use crate::store::{Deadline, Report, Store};
use crate::telemetry::Throttle;
use crate::telemetry::metrics::{METRICS, QuotaLabels, UNKNOWN_DOMAIN, UNMATCHED_RULE};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};

/// How often Envoy reports (fixed at 5 s in Envoy 1.40, whatever the bucket says).
const REPORT_INTERVAL: Duration = Duration::from_secs(5);
/// How long a stream's demand stays counted without a new report: three report intervals, so
/// that one late or lost report does not take its share away.
const DEMAND_STAYS: Duration = Duration::from_secs(3 * REPORT_INTERVAL.as_secs());
/// The most a demand record may take. No request waits for it: the Envoy keeps enforcing its
/// last assignment meanwhile.
const STORE_DEADLINE: Duration = Duration::from_secs(1);
/// Buckets one stream may hold, and the bytes of their ids; a bucket reported past either is
/// answered without being tracked or divided: with its rule's whole limit, as if its Envoy were
/// alone (a client that makes up bucket values gets no more than a limit per value, as it would
/// from buckets that are tracked).
const MOST_BUCKETS_PER_STREAM: usize = 10_000;
const MOST_BUCKET_BYTES_PER_STREAM: usize = 16 << 20;
/// Demand records one report may have in flight at once.
const RECORDS_AT_ONCE: usize = 64;
/// Buckets that may be divided at once on one replica (their keys hashed to as many turns).
const TURNS: usize = 256;
/// Answers waiting to be written to one stream; a push that finds it full is dropped (the
/// stream's next report is answered anyway).
const OUTBOX: usize = 64;

/// What a bucket no rule matches gets (`--quota-unmatched`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Unmatched {
    Allow,
    Deny,
}

/// How the quota service answers.
#[derive(Clone, Copy, Debug)]
pub struct QuotaSettings {
    pub unmatched: Unmatched,
    /// Each assignment's time to live, in whole seconds (Envoy reads no fraction).
    pub ttl: Duration,
    /// Reports of nothing in a row after which a stream is told to abandon a bucket.
    pub abandon_after: u32,
}

/// The streams served by this replica, shared by every event loop: each bucket's local
/// subscribers and what each was last sent, so that one stream's report can re-divide the others'.
pub struct Quotas {
    settings: QuotaSettings,
    /// This replica's name among the replicas sharing a store.
    replica: String,
    next_stream: AtomicU64,
    buckets: Mutex<HashMap<CounterKey, Subscribers>>,
    /// Turns to divide a bucket, one bucket at a time: a bucket takes the turn its key hashes to.
    turns: Box<[tokio::sync::Mutex<()>]>,
    hasher: std::hash::RandomState,
}

/// A bucket's subscribers on this replica, by stream number.
type Subscribers = HashMap<u64, Subscriber>;

/// One stream subscribed to one bucket.
struct Subscriber {
    outbox: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    bucket_id: BucketId,
    labels: QuotaLabels,
    /// What it was last sent.
    sent: Assignment,
    /// The share that was, in thousandths of a request per window, when it was one.
    share: Option<u64>,
    /// The bucket's rule is in shadow mode: it is sent "allow all" whatever its share.
    shadow: bool,
}

impl Quotas {
    pub fn new(settings: QuotaSettings) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Quotas {
            settings,
            replica: format!("{:x}-{:x}", std::process::id(), now.as_nanos()),
            next_stream: AtomicU64::new(1),
            buckets: Mutex::default(),
            turns: (0..TURNS).map(|_| tokio::sync::Mutex::new(())).collect(),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The name in the store of this replica's stream `number`, unique across replicas.
    fn stream_id(&self, number: u64) -> String {
        format!("{}:{number}", self.replica)
    }

    fn turn(&self, key: &CounterKey) -> &tokio::sync::Mutex<()> {
        let at = self.hasher.hash_one(key) as usize % self.turns.len();
        &self.turns[at]
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, HashMap<CounterKey, Subscribers>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Per quota bucket rule: (stream, bucket) subscriptions on this replica, and the requests
    /// per second assigned to them (blanket "allow all" assignments count no rate; a shadow-mode
    /// bucket counts the share it would be sent).
    pub fn by_rule(&self) -> Vec<(QuotaLabels, usize, f64)> {
        let mut out: HashMap<QuotaLabels, (usize, f64)> = HashMap::new();
        for subscriber in self.buckets().values().flat_map(HashMap::values) {
            let entry = out.entry(subscriber.labels.clone()).or_default();
            entry.0 += 1;
            entry.1 += subscriber.sent.rate().unwrap_or(0.0);
        }
        out.into_iter().map(|(l, (n, rate))| (l, n, rate)).collect()
    }
}

/// The quota service of one event loop.
pub struct Rlqs {
    quotas: Arc<Quotas>,
    rules: Arc<ArcSwap<RuleSet>>,
    store: Arc<Store>,
    shutdown: Shutdown,
}

impl Rlqs {
    pub fn new(
        quotas: Arc<Quotas>,
        rules: Arc<ArcSwap<RuleSet>>,
        store: Store,
        shutdown: Shutdown,
    ) -> Self {
        Rlqs {
            quotas,
            rules,
            store: Arc::new(store),
            shutdown,
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let (outbox, answers) = mpsc::channel(OUTBOX);
        let number = self.quotas.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = QuotaStream {
            id: self.quotas.stream_id(number),
            number,
            quotas: self.quotas.clone(),
            rules: self.rules.clone(),
            store: self.store.clone(),
            outbox,
            domain: String::new(),
            buckets: HashMap::new(),
            held_bytes: 0,
        };
        tokio::spawn(stream.run(request.into_inner(), self.shutdown.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(answers))))
    }
}

/// One Envoy's stream.
struct QuotaStream {
    /// Its name in the store, unique across replicas.
    id: String,
    /// Its number among this replica's streams.
    number: u64,
    quotas: Arc<Quotas>,
    rules: Arc<ArcSwap<RuleSet>>,
    store: Arc<Store>,
    outbox: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The domain the stream reports for: Envoy names it in every report, gRPC's clients only in
    /// the first.
    domain: String,
    buckets: HashMap<CounterKey, Held>,
    /// The bytes of the ids of `buckets`.
    held_bytes: usize,
}

/// A bucket a stream holds.
struct Held {
    /// When it was last reported, on sluice's clock (Envoy's own `time_elapsed` is in whole
    /// seconds, and 0 on the first report).
    reported: Instant,
    /// Reports of nothing in a row.
    idle: u32,
    /// It takes part in the division (its demand is in the store).
    shared: bool,
    /// The bytes of its id.
    size: usize,
}

/// What one report of one bucket comes to before the store is asked.
struct Step {
    key: CounterKey,
    bucket_id: BucketId,
    labels: QuotaLabels,
    rule: Option<Arc<QuotaRule>>,
    allowed: u64,
    elapsed: Option<Duration>,
    tracked: bool,
}

impl QuotaStream {
    async fn run(mut self, mut reports: Streaming<RateLimitQuotaUsageReports>, shutdown: Shutdown) {
        let stop = shutdown.wait();
        tokio::pin!(stop);
        loop {
            let report = tokio::select! {
                report = reports.message() => report,
                () = &mut stop => break,
                () = self.outbox.closed() => break,
            };
            match report {
                Ok(Some(report)) => self.on_report(report).await,
                Ok(None) | Err(_) => break,
            }
        }
        self.leave().await;
    }

    async fn on_report(&mut self, report: RateLimitQuotaUsageReports) {
        if !report.domain.is_empty() {
            self.domain = report.domain;
        }
        let rules = self.rules.load_full();
        let now = Instant::now();
        let mut actions = Vec::new();
        let mut shared = Vec::new();
        // Series are named by the rule files only: a domain without rules is not named.
        let domain_label = if rules.has_domain(self.domain.as_bytes()) {
            self.domain.clone()
        } else {
            UNKNOWN_DOMAIN.to_owned()
        };
        for usage in report.bucket_quota_usages {
            let Some(bucket_id) = usage.bucket_id.filter(|b| !b.bucket.is_empty()) else {
                continue;
            };
            let mut entries: Vec<(&str, &[u8])> = bucket_id
                .bucket
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_slice()))
                .collect();
            entries.sort_unstable();
            let rule = rules.quota_rule(self.domain.as_bytes(), &entries).cloned();
            let as_bytes: Vec<(&[u8], &[u8])> =
                entries.iter().map(|(k, v)| (k.as_bytes(), *v)).collect();
            let key = DescriptorKey::new(self.domain.as_bytes(), &as_bytes).counter("rlqs");
            let labels: QuotaLabels = [
                ("domain", domain_label.clone()),
                (
                    "rule",
                    rule.as_ref()
                        .map_or(UNMATCHED_RULE.to_owned(), |r| r.path.clone()),
                ),
            ];
            let (allowed, denied) = (usage.num_requests_allowed, usage.num_requests_denied);
            METRICS.quota_reported(&labels, allowed, denied);
            let size = bucket_id
                .bucket
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
            let tracked = self.buckets.contains_key(&key)
                || (self.buckets.len() < MOST_BUCKETS_PER_STREAM
                    && self.held_bytes + size <= MOST_BUCKET_BYTES_PER_STREAM);
            let (elapsed, idle) = match self.buckets.get_mut(&key) {
                Some(held) => {
                    let elapsed = now.saturating_duration_since(held.reported);
                    held.reported = now;
                    held.idle = if allowed == 0 && denied == 0 {
                        held.idle + 1
                    } else {
                        0
                    };
                    (Some(elapsed), held.idle)
                }
                None => {
                    if tracked {
                        self.held_bytes += size;
                        self.buckets.insert(
                            key.clone(),
                            Held {
                                reported: now,
                                idle: 0,
                                shared: false,
                                size,
                            },
                        );
                    }
                    (None, 0)
                }
            };
            if tracked && idle >= self.quotas.settings.abandon_after {
                self.abandon(&key).await;
                METRICS.quota_action(&labels, "abandon");
                actions.push(BucketAction {
                    bucket_id: Some(bucket_id),
                    bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                });
                continue;
            }
            let step = Step {
                key,
                bucket_id,
                labels,
                rule,
                allowed,
                elapsed,
                tracked,
            };
            let requests = allowed.saturating_add(denied);
            let fixed = self.fixed(&step);
            let was_shared = self.buckets.get_mut(&step.key).map(|held| {
                let was = held.shared;
                held.shared = fixed.is_none();
                was
            });
            match (fixed, was_shared) {
                (Some(assignment), was_shared) => {
                    if let Some(was_shared) = was_shared {
                        // A rule that stopped dividing this bucket (a reload): out of the
                        // division.
                        if was_shared {
                            self.leave_division(&step.key).await;
                        }
                        self.subscribe(&step, assignment, None, false);
                    }
                    actions.push(self.action(&step, assignment));
                }
                (None, _) => shared.push((step, requests)),
            }
        }
        let divided: Vec<(Step, Assignment, bool)> = futures_util::stream::iter(shared)
            .map(|(step, requests)| self.divide(step, requests))
            .buffer_unordered(RECORDS_AT_ONCE)
            .collect()
            .await;
        // Each divided bucket is answered with the latest share this stream got, its own or one
        // pushed by a later division; pushes go out under the same lock, so the Envoy gets shares
        // in the order they were decided.
        let late = {
            let buckets = self.quotas.buckets();
            for (step, share, shadow) in &divided {
                let latest = buckets
                    .get(&step.key)
                    .and_then(|local| local.get(&self.number))
                    .map_or(*share, |s| s.sent);
                let answer = if *shadow {
                    Assignment::AllowAll
                } else {
                    latest
                };
                actions.push(self.action(step, answer));
            }
            if actions.is_empty() {
                return;
            }
            let response = RateLimitQuotaResponse {
                bucket_action: actions,
            };
            match self.outbox.try_send(Ok(response)) {
                Err(mpsc::error::TrySendError::Full(response)) => Some(response),
                Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => None,
            }
        };
        if let Some(response) = late {
            let _ = self.outbox.send(response).await;
        }
    }

    /// The assignment of a bucket whose answer needs no division: unmatched, unlimited, a limit
    /// of 0, or past the stream's bounds on buckets (the whole limit).
    fn fixed(&self, step: &Step) -> Option<Assignment> {
        let Some(rule) = &step.rule else {
            return Some(match self.quotas.settings.unmatched {
                Unmatched::Allow => Assignment::AllowAll,
                Unmatched::Deny => Assignment::DenyAll,
            });
        };
        match &rule.limit {
            None => Some(Assignment::AllowAll),
            Some(limit) if limit.requests_per_unit == 0 => Some(Assignment::DenyAll),
            Some(_) if !step.tracked && rule.shadow => Some(Assignment::AllowAll),
            Some(limit) if !step.tracked => Some(Assignment::share(
                u64::from(limit.requests_per_unit) * MILLI,
                limit,
            )),
            Some(_) => None,
        }
    }

    /// Records this stream's demand for a shared bucket and divides the bucket's limit among
    /// every stream counted in it: this stream's share, and new shares pushed to the others on
    /// this replica. When the store cannot answer, the stream keeps what it was last sent.
    async fn divide(&self, step: Step, requests: u64) -> (Step, Assignment, bool) {
        // One division of a bucket at a time on this replica: each sees the demands recorded
        // before it, and its pushes and share land after theirs.
        let _turn = self.quotas.turn(&step.key).lock().await;
        let rule = step.rule.as_ref().expect("a shared bucket has a rule");
        let limit = rule.limit.as_ref().expect("a shared bucket has a limit");
        let total = u64::from(limit.requests_per_unit);
        let window = Duration::from_millis(limit.window_ms());
        // A new subscriber, whose demand is not known yet, counts as wanting all of it.
        let wanted = step.elapsed.map_or(total * MILLI, |elapsed| {
            demand(requests, elapsed, window, total)
        });
        let report = Report {
            stream: &self.id,
            demand: Some(wanted),
            stays_ms: DEMAND_STAYS.as_millis() as u64,
        };
        let deadline = Deadline::new(STORE_DEADLINE, None);
        let (share, milli) = match self.store.record_demand(&step.key, report, deadline).await {
            Ok(demands) => {
                let wants: Vec<u64> = demands.streams.iter().map(|(_, d)| *d).collect();
                let shares = divide(total * MILLI, &wants);
                let share_of = |stream: &str| {
                    demands
                        .streams
                        .iter()
                        .position(|(s, _)| s == stream)
                        .map(|at| shares[at])
                };
                self.push(&step, |stream| share_of(stream), limit);
                let due = share_of(&self.id).unwrap_or(total * MILLI);
                let milli = settle(self.last_share(&step.key), due);
                (Assignment::share(milli, limit), Some(milli))
            }
            Err(e) => {
                static FAILED: Throttle = Throttle::new();
                METRICS.quota_store_error(e.kind());
                if let Some(n) = FAILED.hit() {
                    tracing::warn!(
                        "{n} quota demand record(s) since the last report failed, the buckets keep their last assignments: {e}"
                    );
                }
                self.kept(&step.key, limit)
            }
        };
        if let (Some(elapsed), true) = (step.elapsed, rule.shadow) {
            let admissible = share.rate().unwrap_or(f64::INFINITY) * elapsed.as_secs_f64();
            let over = step.allowed as f64 - admissible;
            if over >= 1.0 {
                METRICS.quota_shadow_denied(&step.labels, over as u64);
            }
        }
        self.subscribe(&step, share, milli, rule.shadow);
        let shadow = rule.shadow;
        (step, share, shadow)
    }

    /// The share this stream was last sent for a bucket, if it was sent one.
    fn last_share(&self, key: &CounterKey) -> Option<u64> {
        let buckets = self.quotas.buckets();
        buckets.get(key)?.get(&self.number)?.share
    }

    /// What a bucket gets while the store cannot answer: what this stream was last sent, or for
    /// a bucket new to it the limit divided among this replica's streams of the bucket.
    fn kept(&self, key: &CounterKey, limit: &Limit) -> (Assignment, Option<u64>) {
        let buckets = self.quotas.buckets();
        let local = buckets.get(key);
        if let Some(s) = local.and_then(|l| l.get(&self.number)) {
            return (s.sent, s.share);
        }
        let streams = local.map_or(0, HashMap::len) as u64 + 1;
        let milli = u64::from(limit.requests_per_unit) * MILLI / streams;
        (Assignment::share(milli, limit), Some(milli))
    }

    /// Sends the other streams of this replica subscribed to the bucket their new shares, where
    /// they changed.
    fn push(&self, step: &Step, share_of: impl Fn(&str) -> Option<u64>, limit: &Limit) {
        let mut buckets = self.quotas.buckets();
        let Some(local) = buckets.get_mut(&step.key) else {
            return;
        };
        for (number, subscriber) in local.iter_mut() {
            if *number == self.number || subscriber.shadow {
                continue;
            }
            let id = self.quotas.stream_id(*number);
            let Some(due) = share_of(&id) else {
                continue;
            };
            let milli = settle(subscriber.share, due);
            let assignment = Assignment::share(milli, limit);
            if assignment == subscriber.sent {
                continue;
            }
            let pushed = RateLimitQuotaResponse {
                bucket_action: vec![assign(
                    subscriber.bucket_id.clone(),
                    assignment,
                    self.quotas.settings.ttl,
                )],
            };
            // A full outbox drops the push; the stream's next answer carries the share anyway.
            subscriber.sent = assignment;
            subscriber.share = Some(milli);
            if subscriber.outbox.try_send(Ok(pushed)).is_ok() {
                METRICS.quota_action(&subscriber.labels, assignment.name());
            }
        }
    }

    /// Remembers what the stream was sent for a bucket, for pushes and for store outages.
    fn subscribe(&self, step: &Step, sent: Assignment, share: Option<u64>, shadow: bool) {
        self.quotas
            .buckets()
            .entry(step.key.clone())
            .or_default()
            .insert(
                self.number,
                Subscriber {
                    outbox: self.outbox.clone(),
                    bucket_id: step.bucket_id.clone(),
                    labels: step.labels.clone(),
                    sent,
                    share,
                    shadow,
                },
            );
    }

    /// The answer for one bucket, counted.
    fn action(&self, step: &Step, assignment: Assignment) -> BucketAction {
        METRICS.quota_action(&step.labels, assignment.name());
        assign(step.bucket_id.clone(), assignment, self.quotas.settings.ttl)
    }

    /// Forgets a bucket the stream is told to abandon.
    async fn abandon(&mut self, key: &CounterKey) {
        if let Some(held) = self.buckets.remove(key) {
            self.held_bytes -= held.size;
        }
        self.unsubscribe(key);
        self.leave_division(key).await;
    }

    fn unsubscribe(&self, key: &CounterKey) {
        let mut buckets = self.quotas.buckets();
        if let Some(local) = buckets.get_mut(key) {
            local.remove(&self.number);
            if local.is_empty() {
                buckets.remove(key);
            }
        }
    }

    /// Takes the stream's demand for a bucket out of the store, if it is there.
    async fn leave_division(&self, key: &CounterKey) {
        let report = Report {
            stream: &self.id,
            demand: None,
            stays_ms: DEMAND_STAYS.as_millis() as u64,
        };
        let _ = self
            .store
            .record_demand(key, report, Deadline::new(STORE_DEADLINE, None))
            .await;
    }

    /// At the stream's end: its buckets leave the division, so that the Envoy's next stream (on
    /// this replica or another) is not counted twice.
    async fn leave(self) {
        for key in self.buckets.keys() {
            self.unsubscribe(key);
        }
        let shared: Vec<CounterKey> = self
            .buckets
            .iter()
            .filter(|(_, held)| held.shared)
            .map(|(key, _)| key.clone())
            .collect();
        futures_util::stream::iter(shared)
            .for_each_concurrent(RECORDS_AT_ONCE, |key| {
                let stream = &self;
                async move { stream.leave_division(&key).await }
            })
            .await;
    }
}

/// A bucket action assigning `assignment` for `ttl`.
fn assign(bucket_id: BucketId, assignment: Assignment, ttl: Duration) -> BucketAction {
    let strategy = match assignment {
        Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_seconds,
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(whole_seconds(fill_seconds)),
        }),
        Assignment::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Assignment::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
    };
    BucketAction {
        bucket_id: Some(bucket_id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(whole_seconds(ttl.as_secs())),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}

fn whole_seconds(seconds: u64) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    }
}
