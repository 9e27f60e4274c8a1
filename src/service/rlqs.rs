//! The Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, `StreamRateLimitQuotas`):
//! each Envoy holds one stream and reports, every few seconds, what each of its buckets let
//! through and denied; sluice answers every report of a bucket at once with the Envoy's share of
//! the bucket's global limit, as a token bucket Envoy enforces itself. No request waits for sluice.
//!
//! Envoy 1.40 enforces only what it is told in this shape (see docs/quota-service.md): a token
//! bucket with an explicit `tokens_per_fill` and a whole-second `fill_interval`, or a blanket rule;
//! an assignment with a whole-second time to live, which expires without a new one, so it is sent
//! again on every report. The first report of a bucket on a stream subscribes the stream to it.
//!
//! What a stream may enforce of a bucket is its grant in the store (`store::demand`): a grant
//! shrinks at once and grows only by what no stream on any replica holds, so the assignments of a
//! bucket never add up to more than its limit. When a report changes how a bucket divides, this
//! replica's streams of it are sent their new grants at once; once a shrink is sent, the bucket is
//! settled again, which frees it; and the store names the bucket on a channel every replica
//! listens to, so that the streams of the others move theirs within a few round trips.
//!
//! Every stream is served on a thread of its own (`Quotas::start`), with a store of its own: a
//! flood of reports is decoded, matched and recorded there, never on the event loops that answer
//! `ShouldRateLimit`. What the service tracks is bounded for the whole process, per client and
//! per stream; past a bound, a bucket is answered untracked: denied, for it cannot take part in
//! the division, and its limit may be shared by others.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
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
use tracing::Instrument;

use super::Shutdown;
use super::conns::Peer;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use super::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use super::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::config::{MOST_DOMAIN_BYTES, domain_too_long};
use crate::limiter::share::settled;
use crate::limiter::{CounterIds, CounterKey, DescriptorKey, IdHasher, Limit};
use crate::quota::{Assignment, MILLI, demand};
use crate::rules::{QuotaRule, RuleSet};
use crate::store::{Backend, Change, Deadline, Division, Listed, Settle, Store, StoreError, Told};
use crate::telemetry::Throttle;
use crate::telemetry::metrics::{METRICS, QuotaLabels, UNKNOWN_DOMAIN, UNMATCHED_RULE};
use crate::telemetry::traces;
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
/// answered without being tracked or divided: denied (its limit may be divided among others
/// already, on any replica). `--quota-max-buckets` and `--quota-max-streams` bound the same for
/// the whole process, `--quota-max-buckets-per-client` and `--quota-max-streams-per-client` for
/// each client, so that one client's made-up bucket values do not use the process's bounds up.
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
/// Settle calls one division may take: its own, then one after each round of shrinks sent.
const SETTLE_ROUNDS: usize = 3;
/// How long a settle call waits for the shrinks it sent to be taken by their connections before
/// it settles again, which frees them for the others.
const TAKEN_WITHIN: Duration = Duration::from_millis(100);
/// How long no grant grows on this replica once its store connection is made again: a restarted
/// store has lost what every replica's streams hold, and every replica lists its own again (at
/// once, on its reconnection) before any grows.
const FROZEN_AFTER_RECONNECTION: Duration = Duration::from_secs(2);
/// How often the rules in force are read for a reload that changed a divided bucket's rule.
const RULES_READ: Duration = Duration::from_millis(100);
/// The shortest life of an assignment (Envoy reads whole seconds).
const ONE_SECOND: Duration = Duration::from_secs(1);
/// How long after a stream of another replica lapses its bucket is settled again.
const WAKE_SLACK: Duration = Duration::from_millis(20);
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

impl Unmatched {
    fn assignment(self) -> Assignment {
        match self {
            Unmatched::Allow => Assignment::AllowAll,
            Unmatched::Deny => Assignment::DenyAll,
        }
    }
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
    /// Most buckets and streams tracked at once for one client (an address; an IPv6 one by its
    /// /64).
    pub max_buckets_per_client: usize,
    pub max_streams_per_client: usize,
    /// Demand records a second this replica sends the store, at most (for as many tracked
    /// buckets as fit in it; past that, each bucket is recorded less often).
    pub max_records: u32,
    /// Bucket reports a second this replica takes from its streams, at most.
    pub max_reports: u32,
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

/// What each client has tracked, within its budgets (`--quota-max-buckets-per-client`,
/// `--quota-max-streams-per-client`). A client is known while it has a stream counted: at most
/// `--quota-max-streams` of them.
struct Clients {
    most_buckets: usize,
    most_streams: usize,
    by_address: Mutex<HashMap<IpAddr, Tracking>>,
}

/// What one client has tracked.
#[derive(Default)]
struct Tracking {
    streams: usize,
    buckets: usize,
}

impl Clients {
    fn by_address(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Tracking>> {
        self.by_address.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a stream of `client`, if its budget has one left.
    fn take_stream(&self, client: IpAddr) -> bool {
        let mut by_address = self.by_address();
        let tracking = by_address.entry(client).or_default();
        let taken = tracking.streams < self.most_streams;
        tracking.streams += usize::from(taken);
        if tracking.streams == 0 && tracking.buckets == 0 {
            by_address.remove(&client);
        }
        taken
    }

    /// Takes a bucket of `client` (which has a stream counted), if its budget has one left.
    fn take_bucket(&self, client: IpAddr) -> bool {
        let mut by_address = self.by_address();
        let tracking = by_address.entry(client).or_default();
        let taken = tracking.buckets < self.most_buckets;
        tracking.buckets += usize::from(taken);
        taken
    }

    /// Gives back `streams` streams and `buckets` buckets of `client`.
    fn give_back(&self, client: IpAddr, streams: usize, buckets: usize) {
        let mut by_address = self.by_address();
        if let Some(tracking) = by_address.get_mut(&client) {
            tracking.streams = tracking.streams.saturating_sub(streams);
            tracking.buckets = tracking.buckets.saturating_sub(buckets);
            if tracking.streams == 0 && tracking.buckets == 0 {
                by_address.remove(&client);
            }
        }
    }
}

/// The client a stream's budget is kept under: its address, an IPv4 one mapped into IPv6 as
/// itself, and an IPv6 one by its /64 (what one host is usually given).
fn client_of(peer: Option<IpAddr>) -> IpAddr {
    match peer {
        Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        },
        Some(v4) => v4,
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// A pace of so many a second, at most a second's worth at once: the demand records a replica
/// may send (`--quota-max-records`), and the bucket reports its streams may take
/// (`--quota-max-reports`). It keeps when what was taken so far is paid for at that pace.
struct Pace {
    each: Duration,
    paid_until: Mutex<Instant>,
}

impl Pace {
    fn new(per_second: u32) -> Self {
        Pace {
            each: Duration::from_secs(1) / per_second.max(1),
            paid_until: Mutex::new(Instant::now()),
        }
    }

    /// Takes `n`: when that puts the pace more than a second's worth ahead, the instant to wait
    /// for before using them.
    fn take(&self, n: usize) -> Option<Instant> {
        let mut paid = self.paid_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        *paid = (*paid).max(now) + self.each * u32::try_from(n).unwrap_or(u32::MAX);
        (*paid > now + ONE_SECOND).then(|| *paid - ONE_SECOND)
    }

    /// Takes one, if it is within a second's worth ahead; with `must`, takes it anyway (a record
    /// that would otherwise lapse), owing at most another second's worth.
    fn try_take(&self, must: bool) -> bool {
        let mut paid = self.paid_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let next = (*paid).max(now) + self.each;
        let taken = must || next <= now + ONE_SECOND;
        if taken {
            *paid = next.min(now + 2 * ONE_SECOND);
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
    buckets: Mutex<HashMap<u128, Local, IdHasher>>,
    /// Until when no grant grows (`FROZEN_AFTER_RECONNECTION`).
    frozen_until: Mutex<Instant>,
    ids: CounterIds,
    /// Turns to divide a bucket, one bucket at a time: a bucket takes the turn its id hashes to.
    turns: Box<[tokio::sync::Mutex<()>]>,
    /// (stream, bucket) pairs tracked (`--quota-max-buckets`), and streams (`--quota-max-streams`).
    tracked_buckets: Allowance,
    tracked_streams: Allowance,
    /// The same per client.
    clients: Clients,
    /// Demand records in flight (`RECORDS_IN_FLIGHT`).
    records: Semaphore,
    /// Demand records a second (`--quota-max-records`).
    records_left: Pace,
    /// Bucket reports taken a second (`--quota-max-reports`).
    reports_left: Pace,
    /// The runtime of the thread every stream is served on.
    runtime: tokio::runtime::Handle,
    /// That thread's store: demand records never share an event loop's connections.
    store: Store,
}

/// A bucket's streams on this replica.
struct Local {
    key: CounterKey,
    /// The domain its streams report it for, to find its rule again after a reload.
    domain: Box<str>,
    subscribers: Vec<Subscriber>,
    /// It is to be settled again when what a stream of another replica holds lapses, for one of
    /// its streams here waits for it.
    waking: bool,
}

/// One stream subscribed to one bucket.
struct Subscriber {
    /// The stream's number on this replica.
    stream: u64,
    outbox: Outbox,
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
    /// The rule dividing the bucket, while the stream takes part in the division.
    divided: Option<Arc<QuotaRule>>,
    /// Its last demand, in thousandths of a request per window.
    demand: u64,
    /// The most its Envoy may be enforcing, in thousandths of a request per window: its grant,
    /// or more while a smaller one has not been sent to it.
    held: u64,
    /// A settle call has counted it in the store.
    known: bool,
}

/// What one stream's report or departure changes in a bucket.
#[derive(Clone, Copy)]
struct Move {
    stream: u64,
    change: Change,
    demand: u64,
}

impl Quotas {
    /// Starts the thread that serves every quota stream, with a store of its own on `backend`.
    pub fn start(settings: QuotaSettings, backend: &Backend) -> anyhow::Result<Arc<Quotas>> {
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
                    match backend
                        .open()
                        .and_then(|store| Ok((store, backend.listen()?)))
                    {
                        Ok((store, told)) => {
                            let handle = tokio::runtime::Handle::current();
                            let _ = opened.send(Ok((handle, store, told)));
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
        let (runtime, store, told) = store
            .recv()
            .context("the quota service's thread stopped")??;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let quotas = Arc::new(Quotas {
            settings,
            replica: format!("{:x}-{:x}", std::process::id(), now.as_nanos()),
            next_stream: AtomicU64::new(1),
            buckets: Mutex::default(),
            frozen_until: Mutex::new(Instant::now()),
            ids: CounterIds::new(),
            turns: (0..TURNS).map(|_| tokio::sync::Mutex::new(())).collect(),
            tracked_buckets: Allowance::new(settings.max_buckets),
            tracked_streams: Allowance::new(settings.max_streams),
            clients: Clients {
                most_buckets: settings.max_buckets_per_client,
                most_streams: settings.max_streams_per_client,
                by_address: Mutex::default(),
            },
            records: Semaphore::new(RECORDS_IN_FLIGHT),
            records_left: Pace::new(settings.max_records),
            reports_left: Pace::new(settings.max_reports),
            runtime,
            store,
        });
        if let Some(told) = told {
            quotas.runtime.spawn(quotas.clone().hear(told));
        }
        Ok(quotas)
    }

    /// The runtime of the quota service's thread.
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.runtime.clone()
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

    fn buckets(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Local, IdHasher>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether grants may grow now (not for `FROZEN_AFTER_RECONNECTION` after the store's
    /// connection was made again).
    fn growing(&self) -> bool {
        Instant::now() >= *self.frozen_until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Settles what other replicas name, and lists every bucket again when the store's
    /// connection is made again, a few buckets at a time.
    async fn hear(self: Arc<Self>, told: mpsc::Receiver<Told>) {
        ReceiverStream::new(told)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |heard| {
                let quotas = self.clone();
                async move {
                    match heard {
                        Told::Bucket(counter) => {
                            let id = quotas.ids.id_of_bytes(&counter);
                            if let Some((key, rule)) = quotas.divided(id) {
                                quotas.settle_in_background(id, key, rule).await;
                            }
                        }
                        Told::Reconnected => {
                            *quotas
                                .frozen_until
                                .lock()
                                .unwrap_or_else(|e| e.into_inner()) =
                                Instant::now() + FROZEN_AFTER_RECONNECTION;
                            let all = quotas.all_divided();
                            futures_util::stream::iter(all)
                                .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule)| {
                                    quotas.settle_in_background(id, key, rule)
                                })
                                .await;
                        }
                    }
                }
            })
            .await;
    }

    /// The key and rule of bucket `id`, if a stream of this replica takes part in its division.
    fn divided(&self, id: u128) -> Option<(CounterKey, Arc<QuotaRule>)> {
        let buckets = self.buckets();
        let local = buckets.get(&id)?;
        let rule = local.subscribers.iter().find_map(|s| s.divided.clone())?;
        Some((local.key.clone(), rule))
    }

    /// Every bucket a stream of this replica takes part in the division of.
    fn all_divided(&self) -> Vec<(u128, CounterKey, Arc<QuotaRule>)> {
        let buckets = self.buckets();
        buckets
            .iter()
            .filter_map(|(&id, local)| {
                let rule = local.subscribers.iter().find_map(|s| s.divided.clone())?;
                Some((id, local.key.clone(), rule))
            })
            .collect()
    }

    /// Re-divides, for as long as the process runs, every bucket whose rule a reload changed
    /// (`rules` is read every `RULES_READ`), without waiting for reports.
    pub async fn follow(self: Arc<Self>, rules: Arc<ArcSwap<RuleSet>>) {
        let mut divided_by = rules.load_full();
        loop {
            tokio::time::sleep(RULES_READ).await;
            let now = rules.load_full();
            if !Arc::ptr_eq(&now, &divided_by) {
                self.redivide(&now).await;
                divided_by = now;
            }
        }
    }

    /// Moves every bucket divided here whose rule `rules` changes, without waiting for reports.
    /// A rule that still divides it (a new limit, unit, window or shadow mode) settles it again
    /// by the new rule: a shrink reaches the streams at once, and so does a new unit. A rule that
    /// no longer divides it (removed, unlimited, a limit of 0) sends its streams their fixed
    /// answer at once and takes them out of the division, which frees their grants.
    async fn redivide(self: &Arc<Self>, rules: &RuleSet) {
        /// A bucket divided here, copied out to be matched outside the lock the streams take.
        struct Divided {
            id: u128,
            domain: Box<str>,
            bucket_id: Box<[u8]>,
            rule: Arc<QuotaRule>,
        }
        /// What a reload does to a bucket.
        enum Moved {
            Settle(Arc<QuotaRule>),
            Fixed(Assignment),
        }
        let divided: Vec<Divided> = self
            .buckets()
            .iter()
            .filter_map(|(&id, local)| {
                let subscriber = local.subscribers.iter().find(|s| s.divided.is_some())?;
                Some(Divided {
                    id,
                    domain: local.domain.clone(),
                    bucket_id: subscriber.bucket_id.clone(),
                    rule: subscriber.divided.clone()?,
                })
            })
            .collect();
        let mut moved = Vec::new();
        for Divided {
            id,
            domain,
            bucket_id,
            rule: old,
        } in divided
        {
            let Ok(bucket_id) = BucketId::decode(&*bucket_id) else {
                continue;
            };
            let entries = sorted_entries(&bucket_id);
            let now = match rules.quota_rule(domain.as_bytes(), &entries) {
                None => Moved::Fixed(self.settings.unmatched.assignment()),
                Some(new) => match &new.limit {
                    None => Moved::Fixed(Assignment::AllowAll),
                    Some(limit) if limit.requests_per_unit == 0 => {
                        Moved::Fixed(Assignment::DenyAll)
                    }
                    Some(_)
                        if new.limit != old.limit
                            || new.path != old.path
                            || new.shadow != old.shadow =>
                    {
                        Moved::Settle(new.clone())
                    }
                    Some(_) => continue,
                },
            };
            moved.push((id, old, now));
        }
        let mut settling = Vec::new();
        let mut leaving = Vec::new();
        {
            let mut buckets = self.buckets();
            for (id, old, now) in moved {
                let Some(local) = buckets.get_mut(&id) else {
                    continue;
                };
                let divided = local.subscribers.iter_mut().filter(|s| s.divided.is_some());
                match now {
                    Moved::Settle(rule) => {
                        for subscriber in divided {
                            if rule.shadow && !subscriber.shadow {
                                push(subscriber, Assignment::AllowAll, self.settings.ttl);
                            } else if !rule.shadow && subscriber.shadow {
                                // Its Envoy allows all: its grant is sent once settled.
                                subscriber.sent = Assignment::AllowAll;
                            }
                            subscriber.shadow = rule.shadow;
                            subscriber.divided = Some(rule.clone());
                        }
                        settling.push((id, local.key.clone(), rule));
                    }
                    Moved::Fixed(assignment) => {
                        for subscriber in divided {
                            push(subscriber, assignment, self.settings.ttl);
                            subscriber.sent = assignment;
                            subscriber.share = None;
                            subscriber.shadow = false;
                            subscriber.divided = None;
                            subscriber.known = false;
                            subscriber.held = 0;
                            leaving.push((id, local.key.clone(), old.clone(), subscriber.stream));
                        }
                    }
                }
            }
        }
        futures_util::stream::iter(settling)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule)| {
                self.settle_in_background(id, key, rule)
            })
            .await;
        futures_util::stream::iter(leaving)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule, stream)| async move {
                let leaving = Move {
                    stream,
                    change: Change::Leave,
                    demand: 0,
                };
                if let Err(e) = self.settle(id, &key, &rule, Some(leaving), None).await {
                    failed_settle(&e);
                }
            })
            .await;
    }

    /// Settles bucket `id` with no report (another replica moved, or the store came back).
    async fn settle_in_background(
        self: &Arc<Self>,
        id: u128,
        key: CounterKey,
        rule: Arc<QuotaRule>,
    ) {
        if let Err(e) = self.settle(id, &key, &rule, None, None).await {
            failed_settle(&e);
        }
    }

    /// Settles bucket `id` (`key`, divided by `rule`) for this replica's streams of it, with
    /// `moving`'s report or departure, and sends every stream whose grant moved its new
    /// assignment, but for a growth of `answering`'s, which its answer carries. Once a shrink has
    /// been sent, settles again, which frees it for the others. One bucket at a time: each sees
    /// what the ones before it left.
    async fn settle(
        self: &Arc<Self>,
        id: u128,
        key: &CounterKey,
        rule: &QuotaRule,
        mut moving: Option<Move>,
        answering: Option<u64>,
    ) -> Result<Division, StoreError> {
        let _turn = self.turn(id).lock().await;
        let limit = rule.limit.as_ref().expect("a divided bucket has a limit");
        let total = u64::from(limit.requests_per_unit) * MILLI;
        let stays = self.stays();
        let mut rounds = 0;
        loop {
            let listed = self.listed(id, moving);
            let call = Settle {
                limit: total,
                grow: self.growing(),
                stays_ms: stays.as_millis() as u64,
                freeze_ms: FROZEN_AFTER_RECONNECTION.as_millis() as u64,
                streams: listed
                    .iter()
                    .map(|(stream, change, demand, held, known)| Listed {
                        stream,
                        change: *change,
                        demand: *demand,
                        grant: *held,
                        known: *known,
                    })
                    .collect(),
            };
            let span = traces::division_span(&rule.path, call.streams.len());
            let division = match self.record(key, &call).instrument(span.clone()).await {
                Ok(division) => division,
                Err(e) => {
                    traces::store_failed(&span, &e);
                    return Err(e);
                }
            };
            let shrunk = self.send_grants(id, &division, limit, answering);
            moving = None;
            rounds += 1;
            if !division.again || shrunk.is_empty() || rounds == SETTLE_ROUNDS {
                self.wake_when_free(id, &division);
                return Ok(division);
            }
            taken(&shrunk).await;
        }
    }

    /// When a stream of this replica has less than its share of bucket `id` and a stream of
    /// another replica holds some of it, settles the bucket again once that stream stops being
    /// counted (a replica that died is not told to shrink): its Envoy gets its grant then, not at
    /// its next report. One wake-up at a time per bucket.
    fn wake_when_free(self: &Arc<Self>, id: u128, division: &Division) {
        let Some(lapse_ms) = division.lapse_ms else {
            return;
        };
        {
            let mut buckets = self.buckets();
            let Some(local) = buckets.get_mut(&id) else {
                return;
            };
            let short = local.subscribers.iter().any(|s| {
                s.divided.is_some()
                    && division
                        .of(&self.stream_id(s.stream))
                        .is_some_and(|g| g.grant < g.share && !settled(g.grant, g.share))
            });
            if !short || local.waking {
                return;
            }
            local.waking = true;
        }
        // The store's clock, not this one: how long from now, with a little for the two to
        // differ in their reading of the lapse.
        let after = Duration::from_millis(lapse_ms.saturating_sub(division.now_ms)) + WAKE_SLACK;
        let quotas = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(local) = quotas.buckets().get_mut(&id) {
                local.waking = false;
            }
            if let Some((key, rule)) = quotas.divided(id) {
                quotas.settle_in_background(id, key, rule).await;
            }
        });
    }

    /// How long a stream stays counted in the store without reporting again: three of its
    /// records' intervals (it stays counted until the next), and no less than an assignment
    /// lives (the Envoys of a replica that died keep enforcing theirs that long).
    fn stays(&self) -> Duration {
        DEMAND_STAYS
            .max(3 * self.record_every())
            .max(self.settings.ttl)
    }

    /// This replica's streams of bucket `id` in its division, as a settle call lists them: id,
    /// change, demand, what its Envoy may be enforcing and whether the store counted it;
    /// `moving`'s with its change (a stream new to the bucket, or one that left it, holding
    /// nothing).
    fn listed(&self, id: u128, moving: Option<Move>) -> Vec<(String, Change, u64, u64, bool)> {
        let buckets = self.buckets();
        let mut listed: Vec<(String, Change, u64, u64, bool)> = buckets
            .get(&id)
            .map(|local| {
                local
                    .subscribers
                    .iter()
                    .filter(|s| s.divided.is_some())
                    .map(|s| {
                        let (change, demand) = match moving {
                            Some(m) if m.stream == s.stream => (m.change, m.demand),
                            _ => (Change::Keep, s.demand),
                        };
                        (self.stream_id(s.stream), change, demand, s.held, s.known)
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(m) = moving {
            let stream = self.stream_id(m.stream);
            if !listed.iter().any(|(s, ..)| *s == stream) {
                listed.push((stream, m.change, m.demand, 0, false));
            }
        }
        listed
    }

    /// Sends this replica's streams of bucket `id` the grants `division` gave them, where their
    /// assignments change (but a growth of `answering`'s, which its answer carries); the outboxes
    /// a shrink was sent to. A push that finds its stream's outbox full is dropped: the stream's
    /// Envoy is then taken to enforce what it was last sent, until its next answer.
    fn send_grants(
        &self,
        id: u128,
        division: &Division,
        limit: &Limit,
        answering: Option<u64>,
    ) -> Vec<Outbox> {
        let mut buckets = self.buckets();
        let Some(local) = buckets.get_mut(&id) else {
            return Vec::new();
        };
        let mut shrunk = Vec::new();
        for subscriber in local.subscribers.iter_mut() {
            if subscriber.divided.is_none() {
                continue;
            }
            let Some(granted) = division.of(&self.stream_id(subscriber.stream)) else {
                continue;
            };
            subscriber.known = true;
            if granted.waiting() {
                continue;
            }
            let grant = granted.grant;
            let assignment = Assignment::share(grant, limit);
            let shrinks = grant < subscriber.held;
            let pushed = if subscriber.shadow
                || assignment == subscriber.sent
                || (answering == Some(subscriber.stream) && !shrinks)
            {
                true
            } else {
                push(subscriber, assignment, self.settings.ttl)
            };
            if pushed {
                subscriber.sent = assignment;
                subscriber.share = Some(grant);
                subscriber.held = grant;
                if shrinks {
                    shrunk.push(subscriber.outbox.clone());
                }
            }
        }
        shrunk
    }

    /// One settle call, once one of the replica's `RECORDS_IN_FLIGHT` is free.
    async fn record(&self, bucket: &CounterKey, call: &Settle<'_>) -> Result<Division, StoreError> {
        let _in_flight = self
            .records
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let deadline = Deadline::new(STORE_DEADLINE, None);
        self.store.settle(bucket, call, deadline).await
    }

    /// Per quota bucket rule: (stream, bucket) subscriptions on this replica, and the requests
    /// per second assigned to them (blanket "allow all" assignments count no rate; a shadow-mode
    /// bucket counts the share it would be sent).
    pub fn by_rule(&self) -> Vec<(QuotaLabels, usize, f64)> {
        let mut out: HashMap<Arc<QuotaLabels>, (usize, f64)> = HashMap::new();
        for subscriber in self.buckets().values().flat_map(|l| &l.subscribers) {
            let entry = out.entry(subscriber.labels.clone()).or_default();
            entry.0 += 1;
            entry.1 += subscriber.sent.rate().unwrap_or(0.0);
        }
        out.into_iter()
            .map(|(l, (n, rate))| ((*l).clone(), n, rate))
            .collect()
    }

    /// Counts a stream of `client` among the tracked streams, if its client's budget and the
    /// process's allowance have one left; else the bound that was full.
    fn count_stream(&self, client: IpAddr) -> Result<(), Bound> {
        if !self.clients.take_stream(client) {
            return Err(Bound::ClientStreams);
        }
        if !self.tracked_streams.take() {
            self.clients.give_back(client, 1, 0);
            return Err(Bound::Streams);
        }
        Ok(())
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
/// Where a stream's answers wait for its connection.
type Outbox = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let (outbox, answers) = mpsc::channel(OUTBOX);
        let number = self.quotas.next_stream.fetch_add(1, Ordering::Relaxed);
        let peer = request.extensions().get::<Peer>().map(|p| p.0);
        let stream = QuotaStream {
            id: self.quotas.stream_id(number),
            number,
            client: client_of(peer),
            quotas: self.quotas.clone(),
            rules: self.rules.clone(),
            outbox,
            domain: String::new(),
            counted: Err(Bound::Streams),
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
    outbox: Outbox,
    /// The domain the stream reports for: Envoy names it in every report, gRPC's clients only in
    /// the first.
    domain: String,
    /// The client it comes from, whose budgets it counts in.
    client: IpAddr,
    /// Counted among the tracked streams of its client and of the process, or the bound that
    /// kept it out (tried again at each report); until it is counted, every bucket it reports is
    /// answered untracked.
    counted: Result<(), Bound>,
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
    /// How long its answer may live when shorter than an assignment: what its record has left,
    /// when it is answered without a record (none due) and the store is counting it.
    lives: Option<Duration>,
}

/// The bound that was full when a bucket was answered untracked, as the metrics name it.
#[derive(Clone, Copy)]
enum Bound {
    /// The stream's own (`MOST_BUCKETS_PER_STREAM`, `MOST_BUCKET_BYTES_PER_STREAM`).
    StreamBuckets,
    /// `--quota-max-buckets-per-client`.
    ClientBuckets,
    /// `--quota-max-streams-per-client`.
    ClientStreams,
    /// `--quota-max-buckets`.
    Buckets,
    /// `--quota-max-streams`.
    Streams,
}

impl Bound {
    const ALL: [Bound; 5] = [
        Bound::StreamBuckets,
        Bound::ClientBuckets,
        Bound::ClientStreams,
        Bound::Buckets,
        Bound::Streams,
    ];

    fn name(self) -> &'static str {
        match self {
            Bound::StreamBuckets => "stream_buckets",
            Bound::ClientBuckets => "client_buckets",
            Bound::ClientStreams => "client_streams",
            Bound::Buckets => "buckets",
            Bound::Streams => "streams",
        }
    }

    /// Its name in the log.
    fn described(self) -> &'static str {
        match self {
            Bound::StreamBuckets => "the stream's bound (10,000 buckets, 16 MiB of bucket ids)",
            Bound::ClientBuckets => "--quota-max-buckets-per-client",
            Bound::ClientStreams => "--quota-max-streams-per-client",
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
    untracked: [u64; 5],
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
            untracked: [0; 5],
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
                    "quota buckets answered untracked, denied, because a bound was full: {n} past {} in the latest answer, {answers} answer(s) with some since the last warning; see sluice_quota_untracked_total",
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
        if report.domain.len() > MOST_DOMAIN_BYTES {
            let refused = Status::invalid_argument(domain_too_long(report.domain.len()));
            let _ = self.outbox.try_send(Err(refused));
            return false;
        }
        if !report.domain.is_empty() {
            self.domain = report.domain;
        }
        // A stream past a bound on streams is counted once another has left.
        if self.counted.is_err() {
            self.counted = self.quotas.count_stream(self.client);
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
            // Past `--quota-max-reports` the stream waits, reading no further report meanwhile:
            // HTTP/2 flow control keeps its Envoy's next reports at the Envoy.
            if let Some(at) = self.quotas.reports_left.take(some.len()) {
                static PACED: Throttle = Throttle::new();
                METRICS.quota_paced.inc_by(some.len() as u64);
                if let Some(n) = PACED.hit() {
                    tracing::warn!(
                        "quota streams report more buckets than --quota-max-reports a second: \
                         they wait their turn ({n} time(s) since the last report)"
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {}
                    () = self.outbox.closed() => return false,
                }
            }
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
        let mut abandoned = Vec::new();
        for usage in usages {
            // One that does not decode is skipped, as one without a bucket id is.
            let Ok(usage) = BucketQuotaUsage::decode(usage) else {
                continue;
            };
            let Some(bucket_id) = usage.bucket_id.filter(|b| !b.bucket.is_empty()) else {
                continue;
            };
            let entries = sorted_entries(&bucket_id);
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
                abandoned.push((key, id));
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
                lives: None,
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
                        let rule = self
                            .quotas
                            .buckets()
                            .get(&step.id)
                            .and_then(|l| l.subscribers.iter().find(|s| s.stream == self.number))
                            .and_then(|s| s.divided.clone());
                        if let (true, Some(rule)) = (was_shared, rule) {
                            self.leave_division(&step.key, step.id, &rule).await;
                        }
                        self.subscribe(&step, assignment, None, false);
                    }
                    actions.push(self.action(&step, assignment, tally));
                }
                (None, _) => shared.push((step, requests)),
            }
        }
        let divided: Vec<(Step, Option<Assignment>, bool)> = futures_util::stream::iter(shared)
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
        // pushed by a later division, and not at all while it waits for one; pushes go out under
        // the same lock, so the Envoy gets shares in the order they were decided.
        let late = {
            let buckets = self.quotas.buckets();
            for (step, share, shadow) in &divided {
                let latest = buckets
                    .get(&step.id)
                    .and_then(|local| local.subscribers.iter().find(|s| s.stream == self.number))
                    .filter(|s| s.share.is_some())
                    .map(|s| s.sent)
                    .or(*share);
                let answer = match latest {
                    _ if *shadow => Assignment::AllowAll,
                    Some(latest) => latest,
                    None => continue,
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
        let answered = match late {
            Some(response) => {
                let waited = self.outbox.send(response);
                tokio::time::timeout(self.quotas.settings.ttl, waited)
                    .await
                    .is_ok()
            }
            None => true,
        };
        // An abandoned bucket's grant is freed once the abandon is on its way, not before: until
        // its Envoy has it, that Envoy enforces the grant.
        for (key, id) in abandoned {
            self.abandon(&key, id).await;
        }
        answered
    }

    /// Whether a bucket new to the stream, with `size` bytes of id, can be tracked: the stream is
    /// counted among the tracked streams, within its own bounds, and a bucket is left in its
    /// client's budget and in the process's allowance (taken here). Else the tally counts the
    /// bound that was full.
    fn room_for(&self, size: usize, tally: &mut Tally) -> bool {
        let full = if let Err(bound) = self.counted {
            bound
        } else if self.buckets.len() >= MOST_BUCKETS_PER_STREAM
            || self.held_bytes + size > MOST_BUCKET_BYTES_PER_STREAM
        {
            Bound::StreamBuckets
        } else if !self.quotas.clients.take_bucket(self.client) {
            Bound::ClientBuckets
        } else if self.quotas.tracked_buckets.take() {
            return true;
        } else {
            self.quotas.clients.give_back(self.client, 0, 1);
            Bound::Buckets
        };
        tally.untracked(full);
        false
    }

    /// The assignment of a bucket whose answer needs no division: unmatched, unlimited, a limit
    /// of 0, or untracked (denied: its limit may be divided among other streams, on any replica,
    /// which this one cannot take part in; allowed in shadow mode, which denies nothing).
    fn fixed(&self, step: &Step) -> Option<Assignment> {
        let Some(rule) = &step.rule else {
            return Some(self.quotas.settings.unmatched.assignment());
        };
        match &rule.limit {
            None => Some(Assignment::AllowAll),
            Some(limit) if limit.requests_per_unit == 0 => Some(Assignment::DenyAll),
            Some(_) if !step.tracked && rule.shadow => Some(Assignment::AllowAll),
            Some(_) if !step.tracked => Some(Assignment::DenyAll),
            Some(_) => None,
        }
    }

    /// Records this stream's demand for a shared bucket and settles the bucket: this stream's
    /// grant (none while it waits for others to free its share), and new grants sent to the
    /// others on this replica. When the store cannot answer, the stream keeps what it was last
    /// sent, and so it does when its record is not due (`--quota-max-records`).
    async fn divide(&self, mut step: Step, requests: u64) -> (Step, Option<Assignment>, bool) {
        let rule = step.rule.clone().expect("a shared bucket has a rule");
        let limit = rule.limit.as_ref().expect("a shared bucket has a limit");
        let total = u64::from(limit.requests_per_unit);
        let window = Duration::from_millis(limit.window_ms());
        // A new subscriber, whose demand is not known yet, counts as wanting all of it, unless
        // its first report says it had no request: it is idle, and wants nothing.
        let wanted = match step.elapsed {
            Some(elapsed) => demand(requests, elapsed, window, total),
            None if requests == 0 => 0,
            None => total * MILLI,
        };
        let now = Instant::now();
        let every = self.quotas.record_every();
        // Due once `every` has passed (give or take half a report), if the budget has a record
        // left; and always before the last record stops being counted (with two reports to
        // spare). A bucket not recorded yet waits for the budget as the others do: meanwhile it
        // is not answered, as while the store is down.
        let lapsing = step
            .recorded
            .is_some_and(|(_, until)| now + 2 * REPORT_INTERVAL >= until);
        let due = lapsing
            || step.recorded.is_none_or(|(at, _)| {
                now.saturating_duration_since(at) + REPORT_INTERVAL / 2 >= every
            });
        let due = due && self.quotas.records_left.try_take(lapsing);
        let stays = self.quotas.stays();
        let share = if due {
            self.enlist(&step, &rule, wanted, total * MILLI);
            let moving = Move {
                stream: self.number,
                change: Change::Report,
                demand: wanted,
            };
            let settled = self
                .quotas
                .settle(step.id, &step.key, &rule, Some(moving), Some(self.number))
                .await;
            match settled {
                Ok(division) => {
                    step.recorded = Some((now, now + stays));
                    match division.of(&self.id) {
                        Some(granted) if granted.waiting() => None,
                        granted => {
                            let grant = granted.map_or(0, |g| g.grant);
                            Some((Assignment::share(grant, limit), Some(grant)))
                        }
                    }
                }
                Err(e) => {
                    failed_settle(&e);
                    self.kept(step.id)
                }
            }
        } else {
            // Its grant is counted in the store only until its record lapses: its Envoy must not
            // enforce it longer (a replica that dies sends no more).
            step.lives = step
                .recorded
                .map(|(_, until)| until.saturating_duration_since(now).max(ONE_SECOND));
            self.kept(step.id)
        };
        let Some((share, milli)) = share else {
            return (step, None, rule.shadow);
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
        (step, Some(share), shadow)
    }

    /// What a bucket gets while the store cannot answer, or before its first record is due:
    /// what this stream was last sent, or nothing when it was sent no share yet. A bucket new to
    /// the stream is granted nothing the store has not counted: its Envoy applies the filter's
    /// `no_assignment_behavior` meanwhile, as it does before any first answer.
    fn kept(&self, id: u128) -> Option<(Assignment, Option<u64>)> {
        let buckets = self.quotas.buckets();
        let subscriber = buckets
            .get(&id)?
            .subscribers
            .iter()
            .find(|s| s.stream == self.number)?;
        subscriber.share.map(|share| (subscriber.sent, Some(share)))
    }

    /// Makes the stream take part in the division of a bucket of `total` thousandths with its
    /// demand `demand`: listed in the next settle call, holding what it was last sent (nothing,
    /// when new to it).
    fn enlist(&self, step: &Step, rule: &Arc<QuotaRule>, demand: u64, total: u64) {
        let mut buckets = self.quotas.buckets();
        let (subscriber, new) = self.subscriber(&mut buckets, step);
        if new {
            subscriber.shadow = rule.shadow;
        } else if subscriber.divided.is_none() {
            // It was sent a fixed assignment, which may be the whole limit or more.
            subscriber.held = total;
        }
        subscriber.divided = Some(rule.clone());
        subscriber.demand = demand;
    }

    /// Remembers what the stream was sent for a bucket, for pushes and for store outages.
    fn subscribe(&self, step: &Step, sent: Assignment, share: Option<u64>, shadow: bool) {
        let mut buckets = self.quotas.buckets();
        let (subscriber, _) = self.subscriber(&mut buckets, step);
        subscriber.labels = step.labels.clone();
        subscriber.sent = sent;
        subscriber.share = share;
        subscriber.shadow = shadow;
        subscriber.held = subscriber.held.max(share.unwrap_or(0));
    }

    /// The stream's subscription to `step`'s bucket, and whether it is new: then sent nothing,
    /// out of the division and holding nothing.
    fn subscriber<'a>(
        &self,
        buckets: &'a mut HashMap<u128, Local, IdHasher>,
        step: &Step,
    ) -> (&'a mut Subscriber, bool) {
        let local = buckets.entry(step.id).or_insert_with(|| Local {
            key: step.key.clone(),
            domain: self.domain.as_str().into(),
            subscribers: Vec::with_capacity(1),
            waking: false,
        });
        let at = local
            .subscribers
            .iter()
            .position(|s| s.stream == self.number);
        match at {
            Some(at) => (&mut local.subscribers[at], false),
            None => {
                // Most buckets have one subscriber: no room for more until there is one.
                local.subscribers.reserve_exact(1);
                local.subscribers.push(Subscriber {
                    stream: self.number,
                    outbox: self.outbox.clone(),
                    bucket_id: step.bucket_id.encode_to_vec().into(),
                    labels: step.labels.clone(),
                    sent: Assignment::DenyAll,
                    share: None,
                    shadow: false,
                    divided: None,
                    demand: 0,
                    held: 0,
                    known: false,
                });
                let last = local.subscribers.len() - 1;
                (&mut local.subscribers[last], true)
            }
        }
    }

    /// The answer for one bucket, counted.
    fn action(&self, step: &Step, assignment: Assignment, tally: &mut Tally) -> Bytes {
        tally.action(&step.labels, assignment.name());
        let ttl = self.quotas.settings.ttl;
        assign(
            step.bucket_id.clone(),
            assignment,
            step.lives.map_or(ttl, |lives| lives.min(ttl)),
        )
    }

    /// Forgets a bucket the stream is told to abandon.
    async fn abandon(&mut self, key: &CounterKey, id: u128) {
        if let Some(held) = self.buckets.remove(key) {
            self.held_bytes -= held.size;
            self.quotas.tracked_buckets.give_back(1);
            self.quotas.clients.give_back(self.client, 0, 1);
        }
        let divided = self.unsubscribe(id).and_then(|s| s.divided);
        if let Some(rule) = divided {
            self.leave_division(key, id, &rule).await;
        }
    }

    /// Takes the stream off bucket `id` on this replica: what it was subscribed as.
    fn unsubscribe(&self, id: u128) -> Option<Subscriber> {
        let mut buckets = self.quotas.buckets();
        let local = buckets.get_mut(&id)?;
        let at = local
            .subscribers
            .iter()
            .position(|s| s.stream == self.number)?;
        let subscriber = local.subscribers.swap_remove(at);
        if local.subscribers.is_empty() {
            buckets.remove(&id);
        }
        Some(subscriber)
    }

    /// Takes the stream out of a bucket's division (`rule`'s), in the store and on this replica:
    /// its grant goes to the others at once.
    async fn leave_division(&self, key: &CounterKey, id: u128, rule: &QuotaRule) {
        if let Some(subscriber) = self
            .quotas
            .buckets()
            .get_mut(&id)
            .and_then(|l| l.subscribers.iter_mut().find(|s| s.stream == self.number))
        {
            subscriber.divided = None;
            subscriber.known = false;
        }
        let leaving = Move {
            stream: self.number,
            change: Change::Leave,
            demand: 0,
        };
        if let Err(e) = self.quotas.settle(id, key, rule, Some(leaving), None).await {
            failed_settle(&e);
        }
    }

    /// At the stream's end: its buckets leave the division, so that the Envoy's next stream (on
    /// this replica or another) is not counted twice and the others get its grants; then what it
    /// tracked is given back.
    async fn leave(self) {
        let mut shared = Vec::new();
        for key in self.buckets.keys() {
            let id = self.quotas.ids.id(key, 0);
            if let Some(rule) = self.unsubscribe(id).and_then(|s| s.divided) {
                shared.push((key, id, rule));
            }
        }
        let this = &self;
        futures_util::stream::iter(shared)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(key, id, rule)| async move {
                this.leave_division(key, id, &rule).await;
            })
            .await;
        self.quotas.tracked_buckets.give_back(self.buckets.len());
        if self.counted.is_ok() {
            self.quotas.tracked_streams.give_back(1);
            self.quotas
                .clients
                .give_back(self.client, 1, self.buckets.len());
        }
    }
}

/// Sends `subscriber` its new `assignment` of the bucket, for `ttl`; whether it went (a full
/// outbox drops it).
fn push(subscriber: &Subscriber, assignment: Assignment, ttl: Duration) -> bool {
    let Ok(bucket_id) = BucketId::decode(&*subscriber.bucket_id) else {
        return false;
    };
    let pushed = RateLimitQuotaResponse {
        bucket_action: vec![assign(bucket_id, assignment, ttl)],
    };
    let sent = subscriber.outbox.try_send(Ok(pushed)).is_ok();
    if sent {
        METRICS.quota_actions(&subscriber.labels, assignment.name(), 1);
    }
    sent
}

/// Waits until the connections of `outboxes` have taken what was pushed to them, for at most
/// `TAKEN_WITHIN`: a shrink is then on its way to its Envoy before what it frees is given to
/// another.
async fn taken(outboxes: &[Outbox]) {
    let start = Instant::now();
    while outboxes
        .iter()
        .any(|o| !o.is_closed() && o.capacity() < o.max_capacity())
        && start.elapsed() < TAKEN_WITHIN
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Logs (at most once a second) that a settle call failed: the buckets keep their assignments.
fn failed_settle(e: &StoreError) {
    static FAILED: Throttle = Throttle::new();
    METRICS.quota_store_error(e.kind());
    if let Some(n) = FAILED.hit() {
        tracing::warn!(
            "{n} quota demand record(s) since the last report failed, the buckets keep their last assignments: {e}"
        );
    }
}

/// A bucket id's entries sorted by key, as the rules match them.
fn sorted_entries(bucket_id: &BucketId) -> Vec<(&str, &[u8])> {
    let mut entries: Vec<(&str, &[u8])> = bucket_id
        .bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    entries.sort_unstable();
    entries
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_gives_a_seconds_worth_at_once_and_must_owes_at_most_another() {
        let pace = Pace::new(1);
        assert!(pace.try_take(false), "a second's worth at once");
        assert!(!pace.try_take(false), "then nothing until it is paid for");
        assert!(pace.try_take(true), "a record that must go is taken");
        assert!(pace.try_take(true), "and another");
        let wait = pace.take(0).expect("two seconds ahead of its pace");
        assert!(
            wait <= Instant::now() + ONE_SECOND,
            "owing a second at most"
        );
    }

    #[test]
    fn reports_past_a_seconds_worth_wait_for_their_turn() {
        let start = Instant::now();
        let pace = Pace::new(1000);
        assert_eq!(pace.take(1000), None, "a second's worth at once");
        let at = pace.take(500).expect("half a second past it");
        let half = Duration::from_millis(500);
        assert!(at >= start + half && at <= Instant::now() + half);
    }
}
