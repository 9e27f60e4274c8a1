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
//!
//! Every stream is served on a thread of its own (`Quotas::start`), with a store of its own: a
//! flood of reports is decoded, matched and recorded there, never on the event loops that answer
//! `ShouldRateLimit`. What the service tracks is bounded for the whole process as well as per
//! stream; past a bound, a bucket is answered untracked, with its rule's whole limit.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use prost::Message;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::Shutdown;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use super::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::limiter::{CounterIds, CounterKey, DescriptorKey, IdHasher, Limit};
use crate::quota::{Assignment, MILLI, demand, divide, settle};
use crate::rules::{QuotaRule, RuleSet};
use crate::store::{Backend, Deadline, Demands, Report, Store, StoreError};
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
/// from buckets that are tracked). `--quota-max-buckets` and `--quota-max-streams` bound the same
/// for the whole process.
const MOST_BUCKETS_PER_STREAM: usize = 10_000;
const MOST_BUCKET_BYTES_PER_STREAM: usize = 16 << 20;
/// Demand records (store calls) in flight at once on this replica, over every stream: a flood
/// of reports waits its turn here, not in Redis ahead of the rate limit checks.
const RECORDS_IN_FLIGHT: usize = 64;
/// Buckets of a report handled at a time, and answered in one message: between two such turns
/// the other streams have theirs, and no answer takes its connection's event loop long to encode.
const BUCKETS_AT_A_TIME: usize = 256;
/// Buckets that may be divided at once on one replica (their ids hashed to as many turns).
const TURNS: usize = 256;
/// Answers waiting to be written to one stream (each of at most `BUCKETS_AT_A_TIME` buckets); a
/// push that finds it full is dropped (the stream's next report is answered anyway), and an answer
/// to a report waits, holding back the rest of the report.
const OUTBOX: usize = 8;

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
    /// Most buckets tracked at once over every stream (a bucket two streams report counts twice).
    pub max_buckets: usize,
    /// Most streams tracked at once.
    pub max_streams: usize,
    /// Demand records a second this replica sends the store, at most (for as many tracked
    /// buckets as fit in it; past that, each bucket is recorded less often).
    pub max_records: u32,
}

/// A process-wide allowance of things tracked: streams or buckets, at most `most` at once.
struct Allowance {
    most: usize,
    taken: AtomicUsize,
}

impl Allowance {
    fn new(most: usize) -> Self {
        Allowance {
            most,
            taken: AtomicUsize::new(0),
        }
    }

    /// Takes one, if one is left.
    fn take(&self) -> bool {
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.most).then_some(n + 1)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.taken.fetch_sub(n, Ordering::AcqRel);
    }

    fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }
}

/// The demand records a replica may send: `--quota-max-records` a second, at most a second's
/// worth at once.
struct RecordBudget {
    per_second: f64,
    /// Records left, and when that was counted.
    left: Mutex<(f64, Instant)>,
}

impl RecordBudget {
    fn new(per_second: u32) -> Self {
        let per_second = f64::from(per_second.max(1));
        RecordBudget {
            per_second,
            left: Mutex::new((per_second, Instant::now())),
        }
    }

    /// Takes a record, if one is left; with `must`, takes it anyway (a record that would
    /// otherwise lapse), owing it to the next second.
    fn take(&self, must: bool) -> bool {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refilled =
            left.0 + now.saturating_duration_since(left.1).as_secs_f64() * self.per_second;
        *left = (refilled.min(self.per_second), now);
        let taken = must || left.0 >= 1.0;
        if taken {
            left.0 = (left.0 - 1.0).max(-self.per_second);
        }
        taken
    }
}

/// The streams served by this replica: each bucket's local subscribers and what each was last
/// sent, so that one stream's report can re-divide the others'; what is tracked; and the thread
/// and store that serve them.
pub struct Quotas {
    settings: QuotaSettings,
    /// This replica's name among the replicas sharing a store.
    replica: String,
    next_stream: AtomicU64,
    /// Per bucket, by the keyed 128-bit hash of its key (as the embedded store indexes
    /// counters), the streams subscribed to it on this replica.
    buckets: Mutex<HashMap<u128, Vec<Subscriber>, IdHasher>>,
    ids: CounterIds,
    /// Turns to divide a bucket, one bucket at a time: a bucket takes the turn its id hashes to.
    turns: Box<[tokio::sync::Mutex<()>]>,
    /// (stream, bucket) pairs tracked (`--quota-max-buckets`), and streams (`--quota-max-streams`).
    tracked_buckets: Allowance,
    tracked_streams: Allowance,
    /// Demand records in flight (`RECORDS_IN_FLIGHT`).
    records: Semaphore,
    /// Demand records a second (`--quota-max-records`).
    records_left: RecordBudget,
    /// The runtime of the thread every stream is served on.
    runtime: tokio::runtime::Handle,
    /// That thread's store: demand records never share an event loop's connections.
    store: Store,
}

/// One stream subscribed to one bucket.
struct Subscriber {
    /// The stream's number on this replica.
    stream: u64,
    outbox: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The bucket id as the stream reported it, encoded (a few dozen bytes, where the decoded
    /// map takes hundreds), for pushes.
    bucket_id: Box<[u8]>,
    labels: Arc<QuotaLabels>,
    /// What it was last sent.
    sent: Assignment,
    /// The share that was, in thousandths of a request per window, when it was one.
    share: Option<u64>,
    /// The bucket's rule is in shadow mode: it is sent "allow all" whatever its share.
    shadow: bool,
}

impl Quotas {
    /// Starts the thread that serves every quota stream, with a store of its own on `backend`.
    pub fn start(settings: QuotaSettings, backend: &Backend) -> anyhow::Result<Quotas> {
        let (opened, store) = std::sync::mpsc::channel();
        let backend = backend.clone();
        std::thread::Builder::new()
            .name("sluice-quota".into())
            .spawn(move || {
                // Below the event loops: an event loop that wakes with a rate limit request to
                // answer takes the CPU from this thread at once, and the quota work waits, which
                // it can for seconds without harm (Envoy reports every 5 s, and an assignment
                // lives 30 s).
                let idle = thread_priority::set_thread_priority_and_policy(
                    thread_priority::thread_native_id(),
                    thread_priority::ThreadPriority::Min,
                    thread_priority::ThreadSchedulePolicy::Normal(
                        thread_priority::NormalThreadSchedulePolicy::Idle,
                    ),
                );
                if let Err(e) = idle {
                    tracing::warn!("the quota service's thread keeps its CPU priority: {e:?}");
                }
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let runtime = match runtime {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = opened.send(Err(anyhow::Error::from(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match backend.open() {
                        Ok(store) => {
                            let _ = opened.send(Ok((tokio::runtime::Handle::current(), store)));
                            // Serves the streams spawned on it for the life of the process.
                            std::future::pending::<()>().await;
                        }
                        Err(e) => {
                            let _ = opened.send(Err(e.into()));
                        }
                    }
                });
            })
            .context("starting the quota service's thread")?;
        let (runtime, store) = store
            .recv()
            .context("the quota service's thread stopped")??;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Ok(Quotas {
            settings,
            replica: format!("{:x}-{:x}", std::process::id(), now.as_nanos()),
            next_stream: AtomicU64::new(1),
            buckets: Mutex::default(),
            ids: CounterIds::new(),
            turns: (0..TURNS).map(|_| tokio::sync::Mutex::new(())).collect(),
            tracked_buckets: Allowance::new(settings.max_buckets),
            tracked_streams: Allowance::new(settings.max_streams),
            records: Semaphore::new(RECORDS_IN_FLIGHT),
            records_left: RecordBudget::new(settings.max_records),
            runtime,
            store,
        })
    }

    /// Runs `work` on the quota service's thread.
    pub fn spawn<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.spawn(work)
    }

    /// The name in the store of this replica's stream `number`, unique across replicas.
    fn stream_id(&self, number: u64) -> String {
        format!("{}:{number}", self.replica)
    }

    fn turn(&self, id: u128) -> &tokio::sync::Mutex<()> {
        &self.turns[(id % self.turns.len() as u128) as usize]
    }

    /// How often each tracked bucket's demand can be recorded within `--quota-max-records`: at
    /// most once per report while the tracked buckets fit in it, less often past that.
    fn record_every(&self) -> Duration {
        let tracked = self.tracked_buckets.taken() as f64;
        Duration::from_secs_f64(tracked / f64::from(self.settings.max_records.max(1)))
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Vec<Subscriber>, IdHasher>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Per quota bucket rule: (stream, bucket) subscriptions on this replica, and the requests
    /// per second assigned to them (blanket "allow all" assignments count no rate; a shadow-mode
    /// bucket counts the share it would be sent).
    pub fn by_rule(&self) -> Vec<(QuotaLabels, usize, f64)> {
        let mut out: HashMap<Arc<QuotaLabels>, (usize, f64)> = HashMap::new();
        for subscriber in self.buckets().values().flatten() {
            let entry = out.entry(subscriber.labels.clone()).or_default();
            entry.0 += 1;
            entry.1 += subscriber.sent.rate().unwrap_or(0.0);
        }
        out.into_iter()
            .map(|(l, (n, rate))| ((*l).clone(), n, rate))
            .collect()
    }

    /// (stream, bucket) pairs tracked on this replica, and streams tracked.
    pub fn tracked(&self) -> (usize, usize) {
        (self.tracked_buckets.taken(), self.tracked_streams.taken())
    }
}

/// The quota service of one event loop: it hands each stream to the quota service's thread.
pub struct Rlqs {
    quotas: Arc<Quotas>,
    rules: Arc<ArcSwap<RuleSet>>,
    shutdown: Shutdown,
}

impl Rlqs {
    pub fn new(quotas: Arc<Quotas>, rules: Arc<ArcSwap<RuleSet>>, shutdown: Shutdown) -> Self {
        Rlqs {
            quotas,
            rules,
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
            outbox,
            domain: String::new(),
            counted: false,
            buckets: HashMap::new(),
            held_bytes: 0,
        };
        self.quotas
            .runtime
            .spawn(stream.run(request.into_inner(), self.shutdown.clone()));
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
    outbox: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The domain the stream reports for: Envoy names it in every report, gRPC's clients only in
    /// the first.
    domain: String,
    /// It is counted among the process's tracked streams; until it is, every bucket it reports
    /// is answered untracked.
    counted: bool,
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
    /// When its demand was last recorded in the store, and until when that record stays counted.
    recorded: Option<(Instant, Instant)>,
}

/// What one report of one bucket comes to before the store is asked.
struct Step {
    key: CounterKey,
    /// The keyed hash of `key`, which indexes the bucket's subscribers.
    id: u128,
    bucket_id: BucketId,
    labels: Arc<QuotaLabels>,
    rule: Option<Arc<QuotaRule>>,
    allowed: u64,
    elapsed: Option<Duration>,
    tracked: bool,
    /// When its demand was last recorded, and until when that record stays counted.
    recorded: Option<(Instant, Instant)>,
}

/// The bound that was full when a bucket was answered untracked, as the metrics name it.
#[derive(Clone, Copy)]
enum Bound {
    /// The stream's own (`MOST_BUCKETS_PER_STREAM`, `MOST_BUCKET_BYTES_PER_STREAM`).
    StreamBuckets,
    /// `--quota-max-buckets`.
    Buckets,
    /// `--quota-max-streams`.
    Streams,
}

impl Bound {
    const ALL: [Bound; 3] = [Bound::StreamBuckets, Bound::Buckets, Bound::Streams];

    fn name(self) -> &'static str {
        match self {
            Bound::StreamBuckets => "stream_buckets",
            Bound::Buckets => "buckets",
            Bound::Streams => "streams",
        }
    }

    /// Its name in the log.
    fn described(self) -> &'static str {
        match self {
            Bound::StreamBuckets => "the stream's bound (10,000 buckets, 16 MiB of bucket ids)",
            Bound::Buckets => "--quota-max-buckets",
            Bound::Streams => "--quota-max-streams",
        }
    }
}

/// What a report adds to the metrics, added up per rule and counted before each answer is sent
/// (so that the metrics show it once the Envoy has it) rather than once per bucket; and the
/// labels of its rules, made once.
struct Tally {
    domain: String,
    /// By rule path.
    labels: HashMap<String, Arc<QuotaLabels>>,
    counts: HashMap<Arc<QuotaLabels>, RuleCounts>,
    /// By `Bound`.
    untracked: [u64; 3],
}

/// What a report adds to one rule's series.
#[derive(Default)]
struct RuleCounts {
    allowed: u64,
    denied: u64,
    /// Actions sent, by name.
    actions: Vec<(&'static str, u64)>,
}

impl Tally {
    fn new(domain: String) -> Self {
        Tally {
            domain,
            labels: HashMap::new(),
            counts: HashMap::new(),
            untracked: [0; 3],
        }
    }

    /// The series of `rule` (`None`: unmatched).
    fn labels(&mut self, rule: Option<&QuotaRule>) -> Arc<QuotaLabels> {
        let path = rule.map_or(UNMATCHED_RULE, |r| r.path.as_str());
        if let Some(labels) = self.labels.get(path) {
            return labels.clone();
        }
        let labels = Arc::new([("domain", self.domain.clone()), ("rule", path.to_owned())]);
        self.labels.insert(path.to_owned(), labels.clone());
        labels
    }

    fn counts(&mut self, labels: &Arc<QuotaLabels>) -> &mut RuleCounts {
        self.counts.entry(labels.clone()).or_default()
    }

    fn reported(&mut self, labels: &Arc<QuotaLabels>, allowed: u64, denied: u64) {
        let counts = self.counts(labels);
        counts.allowed = counts.allowed.saturating_add(allowed);
        counts.denied = counts.denied.saturating_add(denied);
    }

    fn action(&mut self, labels: &Arc<QuotaLabels>, name: &'static str) {
        let actions = &mut self.counts(labels).actions;
        match actions.iter_mut().find(|(n, _)| *n == name) {
            Some((_, sent)) => *sent += 1,
            None => actions.push((name, 1)),
        }
    }

    fn untracked(&mut self, bound: Bound) {
        self.untracked[bound as usize] += 1;
    }

    /// Counts what it holds in the metrics, and empties it; warns (at most once a second) of
    /// buckets answered untracked.
    fn count(&mut self) {
        for (labels, counts) in self.counts.drain() {
            METRICS.quota_reported(&labels, counts.allowed, counts.denied);
            for (name, sent) in counts.actions {
                METRICS.quota_actions(&labels, name, sent);
            }
        }
        for bound in Bound::ALL {
            let n = std::mem::take(&mut self.untracked[bound as usize]);
            if n == 0 {
                continue;
            }
            METRICS.quota_untracked(bound.name(), n);
            static FULL: Throttle = Throttle::new();
            if let Some(answers) = FULL.hit() {
                tracing::warn!(
                    "quota buckets answered untracked, with their rules' whole limits, because a bound was full: {n} past {} in the latest answer, {answers} answer(s) with some since the last warning; see sluice_quota_untracked_total",
                    bound.described()
                );
            }
        }
    }
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
                Ok(Some(report)) => {
                    if !self.on_report(report).await {
                        break;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.leave().await;
    }

    /// Answers a report; false when its Envoy takes no answers (see `answer`).
    async fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> bool {
        if !report.domain.is_empty() {
            self.domain = report.domain;
        }
        // A stream past the bound on streams is counted once another has left.
        if !self.counted {
            self.counted = self.quotas.tracked_streams.take();
        }
        let rules = self.rules.load_full();
        // Series are named by the rule files only: a domain without rules is not named.
        let domain_label = if rules.has_domain(self.domain.as_bytes()) {
            self.domain.clone()
        } else {
            UNKNOWN_DOMAIN.to_owned()
        };
        let mut tally = Tally::new(domain_label);
        let mut usages = report.bucket_quota_usages.into_iter();
        let mut answered = true;
        while answered && usages.len() > 0 {
            let some: Vec<Bytes> = usages.by_ref().take(BUCKETS_AT_A_TIME).collect();
            answered = self.answer(some, &rules, &mut tally).await;
            // The other streams have their turn.
            tokio::task::yield_now().await;
        }
        answered
    }

    /// Handles some buckets of a report (each as it came on the wire: they are decoded one at a
    /// time), and answers them in one message. False when the answer waited for room in the
    /// outbox for as long as an assignment lives: Envoy takes its answers at once, so its
    /// assignments have expired anyway, and the stream is ended rather than held.
    async fn answer(&mut self, usages: Vec<Bytes>, rules: &RuleSet, tally: &mut Tally) -> bool {
        let now = Instant::now();
        let mut actions = Vec::with_capacity(usages.len());
        let mut shared = Vec::new();
        for usage in usages {
            // One that does not decode is skipped, as one without a bucket id is.
            let Ok(usage) = BucketQuotaUsage::decode(usage) else {
                continue;
            };
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
            let labels = tally.labels(rule.as_deref());
            let (allowed, denied) = (usage.num_requests_allowed, usage.num_requests_denied);
            tally.reported(&labels, allowed, denied);
            let size = bucket_id
                .bucket
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
            let tracked = self.buckets.contains_key(&key) || self.room_for(size, tally);
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
                                recorded: None,
                            },
                        );
                    }
                    (None, 0)
                }
            };
            let id = self.quotas.ids.id(&key, 0);
            if tracked && idle >= self.quotas.settings.abandon_after {
                self.abandon(&key, id).await;
                tally.action(&labels, "abandon");
                actions.push(encode(BucketAction {
                    bucket_id: Some(bucket_id),
                    bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                }));
                continue;
            }
            let recorded = self.buckets.get(&key).and_then(|held| held.recorded);
            let step = Step {
                key,
                id,
                bucket_id,
                labels,
                rule,
                allowed,
                elapsed,
                tracked,
                recorded,
            };
            let requests = allowed.saturating_add(denied);
            let fixed = self.fixed(&step);
            let was_shared = self.buckets.get_mut(&step.key).map(|held| {
                let was = held.shared;
                held.shared = fixed.is_none();
                if !held.shared {
                    // Out of the division, its record is taken out: the next is due at once.
                    held.recorded = None;
                }
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
                    actions.push(self.action(&step, assignment, tally));
                }
                (None, _) => shared.push((step, requests)),
            }
        }
        let divided: Vec<(Step, Assignment, bool)> = futures_util::stream::iter(shared)
            .map(|(step, requests)| self.divide(step, requests))
            .buffer_unordered(RECORDS_IN_FLIGHT)
            .collect()
            .await;
        for (step, _, _) in &divided {
            if let Some(held) = self.buckets.get_mut(&step.key) {
                held.recorded = step.recorded;
            }
        }
        // Each divided bucket is answered with the latest share this stream got, its own or one
        // pushed by a later division; pushes go out under the same lock, so the Envoy gets shares
        // in the order they were decided.
        let late = {
            let buckets = self.quotas.buckets();
            for (step, share, shadow) in &divided {
                let latest = buckets
                    .get(&step.id)
                    .and_then(|local| local.iter().find(|s| s.stream == self.number))
                    .map_or(*share, |s| s.sent);
                let answer = if *shadow {
                    Assignment::AllowAll
                } else {
                    latest
                };
                actions.push(self.action(step, answer, tally));
            }
            tally.count();
            if actions.is_empty() {
                return true;
            }
            let response = RateLimitQuotaResponse {
                bucket_action: actions,
            };
            match self.outbox.try_send(Ok(response)) {
                Err(mpsc::error::TrySendError::Full(response)) => Some(response),
                Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => None,
            }
        };
        match late {
            Some(response) => {
                let waited = self.outbox.send(response);
                tokio::time::timeout(self.quotas.settings.ttl, waited)
                    .await
                    .is_ok()
            }
            None => true,
        }
    }

    /// Whether a bucket new to the stream, with `size` bytes of id, can be tracked: the stream is
    /// counted among the process's streams, within its own bounds, and a bucket is left in the
    /// process's allowance (taken here). Else the tally counts the bound that was full.
    fn room_for(&self, size: usize, tally: &mut Tally) -> bool {
        let full = if !self.counted {
            Bound::Streams
        } else if self.buckets.len() >= MOST_BUCKETS_PER_STREAM
            || self.held_bytes + size > MOST_BUCKET_BYTES_PER_STREAM
        {
            Bound::StreamBuckets
        } else if self.quotas.tracked_buckets.take() {
            return true;
        } else {
            Bound::Buckets
        };
        tally.untracked(full);
        false
    }

    /// The assignment of a bucket whose answer needs no division: unmatched, unlimited, a limit
    /// of 0, or untracked (the whole limit).
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
    /// this replica. When the store cannot answer, the stream keeps what it was last sent, and
    /// so it does when its record is not due (`--quota-max-records`).
    async fn divide(&self, mut step: Step, requests: u64) -> (Step, Assignment, bool) {
        // One division of a bucket at a time on this replica: each sees the demands recorded
        // before it, and its pushes and share land after theirs.
        let _turn = self.quotas.turn(step.id).lock().await;
        let rule = step.rule.as_ref().expect("a shared bucket has a rule");
        let limit = rule.limit.as_ref().expect("a shared bucket has a limit");
        let total = u64::from(limit.requests_per_unit);
        let window = Duration::from_millis(limit.window_ms());
        // A new subscriber, whose demand is not known yet, counts as wanting all of it.
        let wanted = step.elapsed.map_or(total * MILLI, |elapsed| {
            demand(requests, elapsed, window, total)
        });
        let now = Instant::now();
        let every = self.quotas.record_every();
        // Due once `every` has passed (give or take half a report), if the budget has a record
        // left; and always before the last record stops being counted (with two reports to
        // spare). A bucket not recorded yet waits for the budget as the others do: meanwhile it
        // is divided among this replica's streams of it, as while the store is down.
        let lapsing = step
            .recorded
            .is_some_and(|(_, until)| now + 2 * REPORT_INTERVAL >= until);
        let due = lapsing
            || step.recorded.is_none_or(|(at, _)| {
                now.saturating_duration_since(at) + REPORT_INTERVAL / 2 >= every
            });
        let due = due && self.quotas.records_left.take(lapsing);
        // Counted for three of its records' intervals: it stays counted until the next.
        let stays = DEMAND_STAYS.max(3 * every);
        let report = Report {
            stream: &self.id,
            demand: Some(wanted),
            stays_ms: stays.as_millis() as u64,
        };
        let recorded = if due {
            Some(self.record(&step.key, report).await)
        } else {
            None
        };
        let (share, milli) = match recorded {
            None => self.kept(step.id, limit),
            Some(Ok(demands)) => {
                step.recorded = Some((now, now + stays));
                let wants: Vec<u64> = demands.streams.iter().map(|(_, d)| *d).collect();
                let shares = divide(total * MILLI, &wants);
                // The streams come sorted by id.
                let share_of = |stream: &str| {
                    demands
                        .streams
                        .binary_search_by(|(s, _)| s.as_str().cmp(stream))
                        .ok()
                        .map(|at| shares[at])
                };
                self.push(&step, share_of, limit);
                let due = share_of(&self.id).unwrap_or(total * MILLI);
                let milli = settle(self.last_share(step.id), due);
                (Assignment::share(milli, limit), Some(milli))
            }
            Some(Err(e)) => {
                static FAILED: Throttle = Throttle::new();
                METRICS.quota_store_error(e.kind());
                if let Some(n) = FAILED.hit() {
                    tracing::warn!(
                        "{n} quota demand record(s) since the last report failed, the buckets keep their last assignments: {e}"
                    );
                }
                self.kept(step.id, limit)
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

    /// One demand record, once one of the replica's `RECORDS_IN_FLIGHT` is free.
    async fn record(&self, bucket: &CounterKey, report: Report<'_>) -> Result<Demands, StoreError> {
        let _in_flight = self
            .quotas
            .records
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let deadline = Deadline::new(STORE_DEADLINE, None);
        self.quotas
            .store
            .record_demand(bucket, report, deadline)
            .await
    }

    /// The share this stream was last sent for a bucket, if it was sent one.
    fn last_share(&self, id: u128) -> Option<u64> {
        let buckets = self.quotas.buckets();
        buckets
            .get(&id)?
            .iter()
            .find(|s| s.stream == self.number)?
            .share
    }

    /// What a bucket gets while the store cannot answer: what this stream was last sent, or for
    /// a bucket new to it the limit divided among this replica's streams of the bucket.
    fn kept(&self, id: u128, limit: &Limit) -> (Assignment, Option<u64>) {
        let buckets = self.quotas.buckets();
        let local = buckets.get(&id);
        if let Some(s) = local.and_then(|l| l.iter().find(|s| s.stream == self.number)) {
            return (s.sent, s.share);
        }
        let streams = local.map_or(0, Vec::len) as u64 + 1;
        let milli = u64::from(limit.requests_per_unit) * MILLI / streams;
        (Assignment::share(milli, limit), Some(milli))
    }

    /// Sends the other streams of this replica subscribed to the bucket their new shares, where
    /// they changed.
    fn push(&self, step: &Step, share_of: impl Fn(&str) -> Option<u64>, limit: &Limit) {
        let mut buckets = self.quotas.buckets();
        let Some(local) = buckets.get_mut(&step.id) else {
            return;
        };
        for subscriber in local.iter_mut() {
            if subscriber.stream == self.number || subscriber.shadow {
                continue;
            }
            let Some(due) = share_of(&self.quotas.stream_id(subscriber.stream)) else {
                continue;
            };
            let milli = settle(subscriber.share, due);
            let assignment = Assignment::share(milli, limit);
            if assignment == subscriber.sent {
                continue;
            }
            let Ok(bucket_id) = BucketId::decode(&*subscriber.bucket_id) else {
                continue;
            };
            let pushed = RateLimitQuotaResponse {
                bucket_action: vec![assign(bucket_id, assignment, self.quotas.settings.ttl)],
            };
            // A full outbox drops the push; the stream's next answer carries the share anyway.
            subscriber.sent = assignment;
            subscriber.share = Some(milli);
            if subscriber.outbox.try_send(Ok(pushed)).is_ok() {
                METRICS.quota_actions(&subscriber.labels, assignment.name(), 1);
            }
        }
    }

    /// Remembers what the stream was sent for a bucket, for pushes and for store outages.
    fn subscribe(&self, step: &Step, sent: Assignment, share: Option<u64>, shadow: bool) {
        let mut buckets = self.quotas.buckets();
        let local = buckets.entry(step.id).or_default();
        match local.iter_mut().find(|s| s.stream == self.number) {
            Some(subscriber) => {
                subscriber.labels = step.labels.clone();
                subscriber.sent = sent;
                subscriber.share = share;
                subscriber.shadow = shadow;
            }
            None => {
                // Most buckets have one subscriber: no room for more until there is one.
                local.reserve_exact(1);
                local.push(Subscriber {
                    stream: self.number,
                    outbox: self.outbox.clone(),
                    bucket_id: step.bucket_id.encode_to_vec().into(),
                    labels: step.labels.clone(),
                    sent,
                    share,
                    shadow,
                });
            }
        }
    }

    /// The answer for one bucket, counted.
    fn action(&self, step: &Step, assignment: Assignment, tally: &mut Tally) -> Bytes {
        tally.action(&step.labels, assignment.name());
        assign(step.bucket_id.clone(), assignment, self.quotas.settings.ttl)
    }

    /// Forgets a bucket the stream is told to abandon.
    async fn abandon(&mut self, key: &CounterKey, id: u128) {
        if let Some(held) = self.buckets.remove(key) {
            self.held_bytes -= held.size;
            self.quotas.tracked_buckets.give_back(1);
        }
        self.unsubscribe(id);
        self.leave_division(key).await;
    }

    fn unsubscribe(&self, id: u128) {
        let mut buckets = self.quotas.buckets();
        if let Some(local) = buckets.get_mut(&id) {
            local.retain(|s| s.stream != self.number);
            if local.is_empty() {
                buckets.remove(&id);
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
        let _ = self.record(key, report).await;
    }

    /// At the stream's end: its buckets leave the division, so that the Envoy's next stream (on
    /// this replica or another) is not counted twice; then what it tracked is given back.
    async fn leave(self) {
        for key in self.buckets.keys() {
            self.unsubscribe(self.quotas.ids.id(key, 0));
        }
        let shared: Vec<&CounterKey> = self
            .buckets
            .iter()
            .filter(|(_, held)| held.shared)
            .map(|(key, _)| key)
            .collect();
        futures_util::stream::iter(shared)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |key| self.leave_division(key))
            .await;
        self.quotas.tracked_buckets.give_back(self.buckets.len());
        if self.counted {
            self.quotas.tracked_streams.give_back(1);
        }
    }
}

/// A bucket action assigning `assignment` for `ttl`, encoded.
fn assign(bucket_id: BucketId, assignment: Assignment, ttl: Duration) -> Bytes {
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
    encode(BucketAction {
        bucket_id: Some(bucket_id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(whole_seconds(ttl.as_secs())),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    })
}

/// A bucket action as an answer carries it: encoded here, on the quota service's thread, so that
/// the event loop writing the answer only copies it.
fn encode(action: BucketAction) -> Bytes {
    action.encode_to_vec().into()
}

fn whole_seconds(seconds: u64) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    }
}
