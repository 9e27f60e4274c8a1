//! This replica's side of the quota service: each bucket's subscribers here and what each was
//! last sent, the thread and store that serve every stream, the allowances of what is tracked,
//! and what the other replicas name through the store.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::bounds::{Allowance, Clients, FullBound, Pace};
use super::clock::StoreClock;
use super::stream::Outbox;
use super::{
    Assignment, FROZEN_AFTER_RECONNECTION, GROWS_WITHIN, QuotaSettings, RECORDS_IN_FLIGHT,
    STORE_DEADLINE, TURNS,
};
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::QuotaLabels;
use sluice_core::limiter::{CounterIds, CounterKey, IdHasher};
use sluice_core::rules::QuotaRule;
use sluice_core::store::{
    Backend, Change, Deadline, Division, QuotaNotice, Settle, Store, StoreError,
};

/// The streams served by this replica: each bucket's local subscribers and what each was last
/// sent, so that one stream's report can re-divide the others'; what is tracked; and the thread
/// and store that serve them.
pub struct Quotas {
    pub(super) settings: QuotaSettings,
    /// This replica's name among the replicas sharing a store.
    pub(super) replica: String,
    pub(super) next_stream: AtomicU64,
    /// Per bucket, by the keyed 128-bit hash of its key (as the embedded store indexes
    /// counters), the streams subscribed to it on this replica.
    pub(super) buckets: Mutex<HashMap<u128, LocalStreams, IdHasher>>,
    /// The store's servers this replica had answers from, and until when no grant grows.
    heard: Mutex<HeardServers>,
    /// A settle call failed for want of the store, and none has succeeded since: no grant grows
    /// (the store may come back empty, its connections made again before this replica hears
    /// of it).
    store_failed: AtomicBool,
    /// Told when the store answers again after failing: every bucket is to be listed again.
    answers_again: tokio::sync::Notify,
    /// How far the store's clock is ahead of this one, as its answers tell it.
    store_clock: StoreClock,
    pub(super) ids: CounterIds,
    /// Turns to divide a bucket, one bucket at a time: a bucket takes the turn its id hashes to.
    pub(super) turns: Box<[tokio::sync::Mutex<()>]>,
    /// (stream, bucket) pairs tracked (`--quota-max-buckets`), and streams (`--quota-max-streams`).
    pub(super) tracked_buckets: Allowance,
    pub(super) tracked_streams: Allowance,
    /// The same per client.
    pub(super) clients: Clients,
    /// Demand records in flight (`RECORDS_IN_FLIGHT`).
    pub(super) records: Semaphore,
    /// Demand records a second (`--quota-max-records`).
    pub(super) records_left: Pace,
    /// Bucket reports taken a second (`--quota-max-reports`).
    pub(super) reports_left: Pace,
    /// The runtime of the thread every stream is served on.
    runtime: tokio::runtime::Handle,
    /// That thread's store: demand records never share an event loop's connections.
    pub(super) store: Store,
    /// Told what the streams report and are sent.
    pub(super) telemetry: Telemetry,
}

/// What a replica has heard of the store's servers.
struct HeardServers {
    /// Per Cluster slot (0 off a Cluster, where one server keeps every bucket), the server whose
    /// answer came last (`Division::server`).
    servers: HashMap<u16, u64>,
    /// Until when no grant grows (`FROZEN_AFTER_RECONNECTION`).
    frozen_until: Instant,
}

/// A bucket's streams on this replica.
pub(super) struct LocalStreams {
    pub(super) key: CounterKey,
    /// The domain its streams report it for, to find its rule again after a reload.
    pub(super) domain: Box<str>,
    pub(super) subscribers: Vec<Subscriber>,
    /// It is to be settled again when what a stream of another replica holds lapses, for one of
    /// its streams here waits for it.
    pub(super) waking: bool,
}

/// One stream subscribed to one bucket.
pub(super) struct Subscriber {
    /// The stream's number on this replica.
    pub(super) stream: u64,
    pub(super) outbox: Outbox,
    /// The bucket id as the stream reported it, encoded (a few dozen bytes, where the decoded
    /// map takes hundreds), for pushes.
    pub(super) bucket_id: Box<[u8]>,
    pub(super) labels: Arc<QuotaLabels>,
    /// What it was last sent.
    pub(super) sent: Assignment,
    /// The share that was, in thousandths of a request per window, when it was one.
    pub(super) share: Option<u64>,
    /// The bucket's rule is in shadow mode: it is sent "allow all" whatever its share.
    pub(super) shadow: bool,
    /// The rule dividing the bucket, while the stream takes part in the division.
    pub(super) divided: Option<Arc<QuotaRule>>,
    /// Its last demand, in thousandths of a request per window.
    pub(super) demand: u64,
    /// The most its Envoy may be enforcing, in thousandths of a request per window: its grant,
    /// or more while a smaller one has not been sent to it.
    pub(super) held: u64,
    /// A settle call has counted it in the store.
    pub(super) known: bool,
}

/// What one stream's report or departure changes in a bucket.
#[derive(Clone, Copy)]
pub(super) struct BucketMove {
    pub(super) stream: u64,
    pub(super) change: Change,
    pub(super) demand: u64,
}

impl Quotas {
    /// Starts the thread that serves every quota stream, with a store of its own on `backend`.
    pub fn start(
        settings: QuotaSettings,
        backend: &Backend,
        telemetry: Telemetry,
    ) -> anyhow::Result<Arc<Quotas>> {
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
            heard: Mutex::new(HeardServers {
                servers: HashMap::new(),
                frozen_until: Instant::now(),
            }),
            store_failed: AtomicBool::new(false),
            answers_again: tokio::sync::Notify::new(),
            store_clock: StoreClock::default(),
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
            telemetry,
        });
        if let Some(told) = told {
            quotas.runtime.spawn(quotas.clone().hear(told));
        }
        quotas
            .runtime
            .spawn(quotas.clone().list_when_answered_again());
        Ok(quotas)
    }

    fn heard(&self) -> std::sync::MutexGuard<'_, HeardServers> {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// No grant grows for `FROZEN_AFTER_RECONNECTION` from now.
    /// How long growth stays frozen from now.
    pub(super) fn frozen_for(&self) -> Duration {
        self.heard()
            .frozen_until
            .saturating_duration_since(Instant::now())
    }

    fn freeze(&self) {
        self.heard().frozen_until = Instant::now() + FROZEN_AFTER_RECONNECTION;
    }

    /// Remembers that `server` answered for `slot`. Another than before is a restarted (or
    /// promoted) server, which may have lost what every replica's streams hold: no grant grows
    /// here for `FROZEN_AFTER_RECONNECTION` (frozen before a call can name the new server), and
    /// every bucket is listed again.
    fn heard_from(&self, slot: u16, server: u64) -> bool {
        let replaced = {
            let mut heard = self.heard();
            let replaced = heard
                .servers
                .insert(slot, server)
                .is_some_and(|before| before != server);
            if replaced {
                heard.frozen_until = Instant::now() + FROZEN_AFTER_RECONNECTION;
            }
            replaced
        };
        if replaced {
            self.answers_again.notify_one();
        }
        replaced
    }

    /// Lists every bucket again each time the store answers after failing, for as long as the
    /// process runs.
    async fn list_when_answered_again(self: Arc<Self>) {
        loop {
            self.answers_again.notified().await;
            self.clone().list_again().await;
        }
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
    pub(super) fn stream_id(&self, number: u64) -> String {
        format!("{}:{number}", self.replica)
    }

    pub(super) fn turn(&self, id: u128) -> &tokio::sync::Mutex<()> {
        &self.turns[(id % self.turns.len() as u128) as usize]
    }

    /// How often each tracked bucket's demand can be recorded within `--quota-max-records`: at
    /// most once per report while the tracked buckets fit in it, less often past that.
    pub(super) fn record_every(&self) -> Duration {
        let tracked = self.tracked_buckets.taken() as f64;
        Duration::from_secs_f64(tracked / f64::from(self.settings.max_records.max(1)))
    }

    pub(super) fn buckets(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u128, LocalStreams, IdHasher>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store may have come back empty: no grant grows for `FROZEN_AFTER_RECONNECTION`, while
    /// every bucket divided here is listed again (as every other replica lists its own), a few
    /// at a time.
    async fn list_again(self: Arc<Self>) {
        self.freeze();
        let all = self.all_divided();
        futures_util::stream::iter(all)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule)| {
                self.settle_in_background(id, key, rule)
            })
            .await;
    }

    /// Settles what other replicas name, and lists every bucket again when the store's
    /// connection is made again, a few buckets at a time.
    async fn hear(self: Arc<Self>, told: mpsc::Receiver<QuotaNotice>) {
        ReceiverStream::new(told)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |heard| {
                let quotas = self.clone();
                async move {
                    match heard {
                        QuotaNotice::Bucket(counter) => {
                            let id = quotas.ids.id_of_bytes(&counter);
                            if let Some((key, rule)) = quotas.divided(id) {
                                quotas.settle_in_background(id, key, rule).await;
                            }
                        }
                        QuotaNotice::Reconnected => quotas.list_again().await,
                    }
                }
            })
            .await;
    }

    /// The key and rule of bucket `id`, if a stream of this replica takes part in its division.
    pub(super) fn divided(&self, id: u128) -> Option<(CounterKey, Arc<QuotaRule>)> {
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

    /// One settle call, once one of the replica's `RECORDS_IN_FLIGHT` is free, changing nothing
    /// if it reaches the store past its deadline (on the store's clock, as far as this replica
    /// knows it): held up by a reconnection, it may list what the streams no longer hold. It
    /// names the server it last heard from for the bucket, so that the store grows nothing when
    /// it meets another, a restarted one that may have lost what every replica's streams hold;
    /// one that can name none grows nothing past `GROWS_WITHIN` (`call.grow_until_ms`): it may
    /// have waited out a restart. It grows nothing either while the store has failed this
    /// replica's last calls, nor for `FROZEN_AFTER_RECONNECTION` after the store's connection was
    /// made again, answered again or answered from another server. One that fails for want of
    /// the store stops every grant growing until one succeeds, and then every bucket is listed
    /// again: the store may be a new one, empty.
    pub(super) async fn record(
        &self,
        bucket: &CounterKey,
        call: &mut Settle<'_>,
    ) -> Result<Division, StoreError> {
        let _in_flight = self
            .records
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let deadline = Deadline::new(STORE_DEADLINE, None);
        let slot = self.store.slot(bucket);
        {
            // Read together: a server heard of as another's replacement has frozen growth.
            let heard = self.heard();
            call.heard = heard.servers.get(&slot).copied();
            call.grow = call.grow
                && !self.store_failed.load(Ordering::Acquire)
                && Instant::now() >= heard.frozen_until;
        }
        let ahead = self.store_clock.ahead_ms();
        let store_now = unix_ms() + ahead.unwrap_or(0);
        let at = |after: Duration| u64::try_from(store_now + after.as_millis() as i64);
        if ahead.is_some() {
            call.not_after_ms = at(STORE_DEADLINE).unwrap_or(0);
        }
        // A call that names a server grows nothing on another, whenever it gets there: only its
        // deadline bounds it. Held to `GROWS_WITHIN` as well, it would grow nothing on a loaded
        // host, whose answers are read hundreds of ms late for seconds at a time: the store's
        // clock, as they teach it, is behind by as much, and every call looks late. One that
        // names none (this replica's first, or any where Redis refuses `INFO`) has only its
        // timing to tell a restart by. Before the first answer the store's clock is taken for
        // this one's: a call that waits out a restart still grows nothing, and a late answer
        // still teaches the offset.
        if call.heard.is_none() {
            call.grow_until_ms = at(GROWS_WITHIN).unwrap_or(0);
        }
        let sent = Instant::now();
        let settled = self.store.settle(bucket, call, deadline).await;
        if matches!(settled, Err(StoreError::Timeout))
            && call.not_after_ms != 0
            && sent.elapsed() < STORE_DEADLINE
        {
            // Refused by the store for coming past its deadline, well before the deadline here:
            // the store's clock was past `not_after_ms` when it ran, before now. A lower bound
            // of the offset, which lifts one taken from an answer read late (else every call
            // would be refused, and teach nothing, for as long as that reading is kept).
            let store = i64::try_from(call.not_after_ms).unwrap_or(i64::MAX);
            self.store_clock
                .read(store, unix_ms(), Instant::now(), false);
        }
        if let Ok(division) = &settled {
            let (local, now) = (unix_ms(), Instant::now());
            let anew = division
                .server
                .is_some_and(|server| self.heard_from(slot, server));
            let store = i64::try_from(division.now_ms).unwrap_or(i64::MAX);
            self.store_clock.read(store, local, now, anew);
        }
        match &settled {
            Err(StoreError::Down | StoreError::Unavailable(_) | StoreError::Timeout) => {
                self.store_failed.store(true, Ordering::Release);
            }
            Ok(_) if self.store_failed.load(Ordering::Acquire) => {
                // Frozen before the next call can see the store answering again.
                self.freeze();
                self.store_failed.store(false, Ordering::Release);
                self.answers_again.notify_one();
            }
            _ => {}
        }
        settled
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
    pub(super) fn count_stream(&self, client: IpAddr) -> Result<(), FullBound> {
        if !self.clients.take_stream(client) {
            return Err(FullBound::ClientStreams);
        }
        if !self.tracked_streams.take() {
            self.clients.give_back(client, 1, 0);
            return Err(FullBound::Streams);
        }
        Ok(())
    }

    /// (stream, bucket) pairs tracked on this replica, and streams tracked.
    pub fn tracked(&self) -> (usize, usize) {
        (self.tracked_buckets.taken(), self.tracked_streams.taken())
    }
}

/// This process's clock, in ms since the Unix epoch, as the quota clock counts it.
fn unix_ms() -> i64 {
    i64::try_from(sluice_core::store::unix_ms()).unwrap_or(i64::MAX)
}
