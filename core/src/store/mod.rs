//! Where counters live. Every store applies a whole `Check` atomically: it evaluates each counter
//! with the window math, admits the request only if the limiter's rule allows it, and then moves
//! every counter of the request or none. Every call goes through the store's `guard`: it has a
//! `Deadline`, and a store that cannot decide in time says so, and never charges a request whose
//! caller it did not answer. Stores build on the limiter's types; the limiter knows no store.

mod demand;
mod guard;
mod memory;
mod peers;
mod redis;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;

pub use demand::{Change, Division, Listed, Settle};
pub use guard::Deadline;
pub use memory::{MemoryStore, Percent, Stored};
pub use peers::Peers;
pub use redis::{RedisStore, RedisTls, Replication, redis_key};

use crate::limiter::{Check, CounterKey, Counting, Decision, Item, Mode, Scope, Usage};
use crate::observe::Observer;
use guard::{Breakers, Guard};

/// Where the counters are, from which each event loop opens a `Store` of its own: the one
/// embedded store, shared, or a Redis deployment, reached on the loop's own connections.
#[derive(Clone)]
pub enum Backend {
    Memory(Arc<MemoryStore>),
    Redis {
        /// The counters of `scope: replica` and `scope: split` rules, in this replica's memory.
        local: Arc<MemoryStore>,
        /// The replicas live now, which `scope: split` divides limits by.
        peers: Peers,
        url: String,
        key_prefix: String,
        tls: Option<RedisTls>,
        /// The replicas that must acknowledge a decision's writes before it is answered, and
        /// those each primary has.
        replicas: Replication,
        /// The breakers of every store opened on this deployment: it is reachable when all are
        /// closed.
        breakers: Breakers,
        /// What its stores tell of their calls.
        observer: Arc<dyn Observer>,
    },
}

impl Backend {
    /// The embedded store, holding at most `max_keys` live counters, a rule at most `per_rule`
    /// of them, telling `observer` of the counters it refuses. Sweeps expired counters every
    /// second from a task that ends with the store; call it inside a Tokio runtime.
    pub fn memory(max_keys: usize, per_rule: Percent, observer: Arc<dyn Observer>) -> Backend {
        Backend::Memory(swept(
            MemoryStore::new(max_keys, per_rule).observed_by(observer),
        ))
    }

    /// A Redis deployment (see `RedisStore::connect` for the URL forms), reached over TLS as
    /// `tls` says when the URL asks for TLS, whose decisions count once `confirm_replicas`
    /// replicas acknowledge their writes (0: as soon as the primary has them), and whose stores
    /// tell `observer` of their calls; the counters of rules scoped to the replica live in
    /// `local`, an embedded store (swept as `memory`'s; call it inside a Tokio runtime).
    pub fn redis(
        url: String,
        key_prefix: String,
        tls: Option<RedisTls>,
        confirm_replicas: u32,
        observer: Arc<dyn Observer>,
        local: MemoryStore,
    ) -> Backend {
        Backend::Redis {
            local: swept(local.observed_by(observer.clone())),
            peers: Peers::unknown(),
            url,
            key_prefix,
            tls,
            replicas: Replication::new(confirm_replicas),
            breakers: Breakers::new(observer.clone()),
            observer,
        }
    }

    /// A store for the calling runtime. It does not wait for Redis: until Redis answers, its
    /// calls fail at once and the backend is not reachable. Fails only on a malformed URL.
    pub fn open(&self) -> Result<Store, StoreError> {
        match self {
            Backend::Memory(store) => Ok(Store {
                guard: Guard::new(None),
                counters: Counters::Memory(store.clone()),
                local: store.clone(),
                peers: Peers::alone(),
            }),
            Backend::Redis {
                local,
                peers,
                url,
                key_prefix,
                tls,
                replicas,
                breakers,
                observer,
            } => {
                let breaker = breakers.breaker();
                let store = RedisStore::connect(
                    url,
                    key_prefix,
                    tls.as_ref(),
                    replicas,
                    breaker.clone(),
                    observer.clone(),
                )?;
                breakers.add(breaker.clone());
                Ok(Store {
                    guard: Guard::new(Some(breaker)),
                    counters: Counters::Redis(Box::new(store)),
                    local: local.clone(),
                    peers: peers.clone(),
                })
            }
        }
    }

    /// What other replicas tell this one of the quota buckets, for as long as the receiver is
    /// kept; `None` on the embedded store, which serves one replica. Call it inside a Tokio
    /// runtime.
    pub fn listen(&self) -> Result<Option<mpsc::Receiver<QuotaNotice>>, StoreError> {
        match self {
            Backend::Memory(_) => Ok(None),
            Backend::Redis {
                url,
                key_prefix,
                tls,
                ..
            } => RedisStore::listen(url, key_prefix, tls.as_ref()).map(Some),
        }
    }

    /// Beats in the store for this replica (`store::peers`) while `wanted` gives the longest
    /// window of the `scope: split` rules in force (ms), until `stop` resolves, then takes the
    /// beat back; at once on the embedded store, which serves one.
    pub async fn beat(
        &self,
        stop: impl Future<Output = ()>,
        wanted: impl Fn() -> Option<u64>,
    ) -> Result<(), StoreError> {
        match self {
            Backend::Memory(_) => Ok(()),
            Backend::Redis {
                url,
                key_prefix,
                tls,
                peers,
                ..
            } => redis::beat(url, key_prefix, tls.as_ref(), peers.clone(), stop, wanted).await,
        }
    }

    /// The counters other replicas reset (`Store::reset`), for as long as the receiver is kept;
    /// `None` on the embedded store, which serves one replica. Call it inside a Tokio runtime.
    pub fn listen_resets(&self) -> Result<Option<mpsc::Receiver<Reset>>, StoreError> {
        match self {
            Backend::Memory(_) => Ok(None),
            Backend::Redis {
                url,
                key_prefix,
                tls,
                ..
            } => RedisStore::listen_resets(url, key_prefix, tls.as_ref()).map(Some),
        }
    }

    /// The store's kind, as the console names it: `memory` (the embedded store) or `redis`.
    pub fn kind(&self) -> &'static str {
        match self {
            Backend::Memory(_) => "memory",
            Backend::Redis { .. } => "redis",
        }
    }

    /// The prefix of the Redis keys; `None` on the embedded store.
    pub fn redis_key_prefix(&self) -> Option<&str> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { key_prefix, .. } => Some(key_prefix),
        }
    }

    /// Whether the store can decide now: the embedded store always can; Redis when every
    /// store opened on it has reached it and its breaker is closed.
    pub fn reachable(&self) -> bool {
        match self {
            Backend::Memory(_) => true,
            Backend::Redis { breakers, .. } => breakers.all_closed(),
        }
    }

    /// How far (ms) Redis' clock read ahead of this replica's (behind, when negative) when last
    /// measured (every second, with the probe's `TIME`); `None` on the embedded store, which
    /// counts on this replica's clock, or before the first measure.
    pub fn clock_skew_ms(&self) -> Option<i64> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { breakers, .. } => breakers.skew_ms(),
        }
    }

    /// Why Redis was last found unreachable, while it is; `None` on the embedded store or when
    /// no cause is known.
    pub fn unreachable_cause(&self) -> Option<String> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { breakers, .. } => breakers.cause(),
        }
    }

    /// Why decisions cannot be confirmed now (`--redis-confirm-replicas`): the primaries with
    /// fewer replicas attached than asked; `None` when none is known to.
    pub fn unconfirmable(&self) -> Option<String> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { replicas, .. } => replicas.problem(),
        }
    }

    /// Primaries known to have fewer replicas than `--redis-confirm-replicas` asks for; `None`
    /// without confirmation.
    pub fn unreplicated_primaries(&self) -> Option<usize> {
        match self {
            Backend::Redis { replicas, .. } if replicas.asked() > 0 => {
                Some(replicas.short_primaries())
            }
            _ => None,
        }
    }

    /// Redis breakers open now; `None` on the embedded store.
    pub fn open_breakers(&self) -> Option<usize> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { breakers, .. } => Some(breakers.open()),
        }
    }

    /// The replicas live as this one last read them (`store::peers`); `None` on the embedded
    /// store, which serves one.
    pub fn live_replicas(&self) -> Option<u32> {
        match self {
            Backend::Memory(_) => None,
            Backend::Redis { peers, .. } => Some(peers.count()),
        }
    }

    /// Live counters in the embedded store; `None` on Redis.
    pub fn live_counters(&self) -> Option<usize> {
        match self {
            Backend::Memory(store) => Some(store.counters()),
            Backend::Redis { .. } => None,
        }
    }

    /// Woken whenever `reachable` or `unconfirmable` may have changed; one waiter only (gRPC
    /// health's).
    pub async fn changed(&self) {
        match self {
            Backend::Memory(_) => std::future::pending().await,
            Backend::Redis {
                breakers, replicas, ..
            } => {
                tokio::select! {
                    () = breakers.changed() => {}
                    () = replicas.changed() => {}
                }
            }
        }
    }
}

/// The counter store an event loop decides against: a backend behind its guard, and this
/// replica's own counters (`scope: replica` and `split`), decided with no store call.
pub struct Store {
    guard: Guard,
    counters: Counters,
    /// The embedded store of the counters scoped to this replica (on the embedded store, the
    /// same store).
    local: Arc<MemoryStore>,
    peers: Peers,
}

/// The counter stores sluice can run on.
enum Counters {
    Memory(Arc<MemoryStore>),
    Redis(Box<RedisStore>),
}

impl Store {
    /// Gives each `scope: split` item of `check` this replica's share of its limit in the window
    /// it counts in now (`store::peers`); an error while this replica may not use a share (the
    /// live replicas never read, or its beat not renewed within its life): the request is then
    /// answered as one the store could not decide.
    pub fn share(&self, check: &mut Check) -> Result<(), StoreError> {
        if check.items.iter().all(|i| i.scope != Scope::Split) {
            return Ok(());
        }
        let (now, now_ms) = (std::time::Instant::now(), unix_ms());
        for item in check.items.iter_mut().filter(|i| i.scope == Scope::Split) {
            let since = item.limit.counted_since(now_ms);
            let (Some(requests), Some(burst)) = (
                self.peers.share(item.limit.requests_per_unit, since, now),
                self.peers.share(item.limit.burst, since, now),
            ) else {
                return Err(StoreError::Unavailable(
                    "this replica's count of the live replicas is unknown or out of date (its \
                     beat in the store not renewed): it has no share of a split limit"
                        .into(),
                ));
            };
            item.limit.requests_per_unit = requests;
            item.limit.burst = burst;
        }
        Ok(())
    }

    /// The replicas live now, as this one last read them.
    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// Decides `check`, all or nothing. The counters scoped to this replica are decided here,
    /// first; when they admit, the store decides the rest, and what they charged is given back
    /// if the store denies, fails, or its caller goes (see `apply_own_first`).
    pub async fn apply(&self, check: &Check, deadline: Deadline) -> Result<Decision, StoreError> {
        if matches!(self.counters, Counters::Redis(_))
            && check.items.iter().any(|i| i.scope.is_local())
        {
            return self.apply_own_first(check, deadline).await;
        }
        self.apply_shared(check, deadline).await
    }

    /// Decides a check some of whose counters are this replica's own (`scope: replica`,
    /// `split`), in its embedded store, and the others the shared store's, as one check. The own
    /// counters are decided first, all or nothing among them (their quota limits not denying
    /// while the store's part has quota limits too). When they deny, the store is not asked,
    /// save to charge its counters counted `always`, which are charged whatever the answer.
    /// When they admit, the store decides its part (its quota limits not denying while an own
    /// quota limit is not over), and what the own counters charged is given back unless the
    /// store admits: when it denies, fails, or its caller goes first.
    async fn apply_own_first(
        &self,
        check: &Check,
        deadline: Deadline,
    ) -> Result<Decision, StoreError> {
        let (own, shared): (Vec<usize>, Vec<usize>) =
            (0..check.items.len()).partition(|&i| check.items[i].scope.is_local());
        let quota = |i: &usize| matches!(check.items[*i].mode, Mode::Quota | Mode::ShadowQuota);
        let part = |at: &[usize], quota_passes: bool| Check {
            items: at.iter().map(|&i| check.items[i].clone()).collect(),
            at: check.at,
            quota_passes,
        };
        let own_check = part(&own, check.quota_passes || shared.iter().any(quota));
        let own_decision = self.local.apply(&own_check)?;
        let mut usages = vec![Usage::unknown(); check.items.len()];
        for (&i, usage) in own.iter().zip(&own_decision.usages) {
            usages[i] = *usage;
        }
        if shared.is_empty() || !own_decision.admitted {
            let always: Vec<usize> = shared
                .iter()
                .copied()
                .filter(|&i| check.items[i].counting == Counting::Always)
                .collect();
            if !own_decision.admitted && !always.is_empty() {
                let charged = self.apply_shared(&part(&always, true), deadline).await?;
                for (&i, usage) in always.iter().zip(&charged.usages) {
                    usages[i] = *usage;
                }
            }
            return Ok(Decision {
                admitted: own_decision.admitted,
                usages,
            });
        }
        let give_back = GiveBack::of(&self.local, &own_check, &own_decision);
        let quota_left =
            own.iter()
                .zip(&own_decision.usages)
                .any(|(&i, usage)| match check.items[i].mode {
                    Mode::Quota => !usage.over,
                    Mode::ShadowQuota => true,
                    Mode::Enforce | Mode::Shadow => false,
                });
        let shared_check = part(&shared, check.quota_passes || quota_left);
        let decided = self.apply_shared(&shared_check, deadline).await?;
        for (&i, usage) in shared.iter().zip(&decided.usages) {
            usages[i] = *usage;
        }
        if decided.admitted {
            give_back.keep();
        }
        Ok(Decision {
            admitted: decided.admitted,
            usages,
        })
    }

    /// Decides `check` in the shared store.
    async fn apply_shared(
        &self,
        check: &Check,
        deadline: Deadline,
    ) -> Result<Decision, StoreError> {
        let call = async {
            match &self.counters {
                Counters::Memory(memory) => memory.apply(check),
                // Boxed: the Redis call's state is kilobytes, which would otherwise be moved with
                // every request's future, on either store.
                Counters::Redis(redis) => Box::pin(redis.apply(check, deadline)).await,
            }
        };
        self.guard.call(deadline, call).await
    }

    /// The slot of a quota bucket's record on a Redis Cluster, whose slots each have a server
    /// of their own; 0 where one server keeps every bucket.
    pub fn slot(&self, bucket: &CounterKey) -> u16 {
        match &self.counters {
            Counters::Memory(_) => 0,
            Counters::Redis(redis) => redis.slot(bucket),
        }
    }

    /// Resets the counters of `items`: each is deleted, as if it had never been written (a
    /// window counts nothing, a log holds no entry, a bucket is full), a fixed window's in the
    /// window holding `at_ms` only; then every replica is told (`unblock`).
    pub async fn reset(
        &self,
        items: &[Item],
        at_ms: u64,
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let (own, shared): (Vec<Item>, Vec<Item>) =
            items.iter().cloned().partition(|i| i.scope.is_local());
        self.local.reset(&own, at_ms);
        if shared.is_empty() {
            return Ok(());
        }
        let reset = async {
            match &self.counters {
                Counters::Memory(memory) => {
                    memory.reset(&shared, at_ms);
                    Ok(())
                }
                Counters::Redis(redis) => {
                    redis.reset(&shared, at_ms).await?;
                    redis.unblock(&shared).await
                }
            }
        };
        self.guard.call(deadline, reset).await
    }

    /// What the holds of each counter of `items` hold now, and how many are outstanding
    /// (`limiter::hold`): none for a counter no rule holds.
    pub async fn held(
        &self,
        items: &[Item],
        deadline: Deadline,
    ) -> Result<Vec<(u64, usize)>, StoreError> {
        let read = async {
            match &self.counters {
                Counters::Memory(memory) => Ok(items.iter().map(|i| memory.held(&i.key)).collect()),
                Counters::Redis(redis) => redis.held(items).await,
            }
        };
        self.guard.call(deadline, read).await
    }

    /// For each of `counters`, whether it was changed by hand (`/counters`) at or after the
    /// instant beside it, or within a second before: what a replica that may have missed the
    /// notice (`Reset::Missed`) drops its blocks of. None on the embedded store.
    pub async fn changed_after(
        &self,
        counters: &[(CounterKey, tokio::time::Instant)],
        deadline: Deadline,
    ) -> Result<Vec<bool>, StoreError> {
        let Counters::Redis(redis) = &self.counters else {
            return Ok(vec![false; counters.len()]);
        };
        let (now, now_ms) = (tokio::time::Instant::now(), unix_ms());
        let after: Vec<(CounterKey, u64)> = counters
            .iter()
            .map(|(key, at)| {
                let ago = now.saturating_duration_since(*at).as_millis() as u64;
                (key.clone(), now_ms.saturating_sub(ago))
            })
            .collect();
        self.guard.call(deadline, redis.changed_after(&after)).await
    }

    /// Tells every replica that the counters of `items` may have room again: they forget
    /// them in their over-limit cache and drop their leased blocks of them
    /// (`Backend::listen_resets`). Nothing to tell on the embedded store, which serves one.
    pub async fn unblock(&self, items: &[Item], deadline: Deadline) -> Result<(), StoreError> {
        let shared: Vec<Item> = items
            .iter()
            .filter(|i| !i.scope.is_local())
            .cloned()
            .collect();
        if shared.is_empty() {
            return Ok(());
        }
        let told = async {
            match &self.counters {
                Counters::Memory(_) => Ok(()),
                Counters::Redis(redis) => redis.unblock(&shared).await,
            }
        };
        self.guard.call(deadline, told).await
    }

    /// Settles a quota bucket for this replica's streams of it (see `demand`).
    pub async fn settle(
        &self,
        bucket: &CounterKey,
        call: &Settle<'_>,
        deadline: Deadline,
    ) -> Result<Division, StoreError> {
        let settled = async {
            match &self.counters {
                Counters::Memory(memory) => memory.settle(bucket, call),
                // Boxed, as `apply`'s: the quota service's futures nest deep enough already.
                Counters::Redis(redis) => Box::pin(redis.settle(bucket, call)).await,
            }
        };
        self.guard.call(deadline, settled).await
    }
}

/// What a check's own counters charged, given back when dropped unless kept: the store's part
/// of the check did not admit it, or its caller went first.
struct GiveBack<'a> {
    local: &'a MemoryStore,
    back: Option<Check>,
}

impl<'a> GiveBack<'a> {
    /// What `check`, decided as `decision` in `local`, charged: its items counted when admitted
    /// that were not over, each with its hits to give back.
    fn of(local: &'a MemoryStore, check: &Check, decision: &Decision) -> GiveBack<'a> {
        let items: Vec<Item> = check
            .items
            .iter()
            .zip(&decision.usages)
            .filter(|(item, usage)| {
                !item.refund && item.hits > 0 && item.counting == Counting::Admitted && !usage.over
            })
            .map(|(item, _)| Item {
                refund: true,
                ..item.clone()
            })
            .collect();
        GiveBack {
            local,
            back: (!items.is_empty()).then(|| Check {
                items,
                at: check.at,
                quota_passes: true,
            }),
        }
    }

    /// Keeps the charges.
    fn keep(mut self) {
        self.back = None;
    }
}

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some(back) = self.back.take() {
            let _ = self.local.apply(&back);
        }
    }
}

/// `store`, its expired counters swept every second by a task that ends with it.
fn swept(store: MemoryStore) -> Arc<MemoryStore> {
    let store = Arc::new(store);
    let weak = Arc::downgrade(&store);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            match weak.upgrade() {
                Some(store) => store.sweep(),
                None => break,
            }
        }
    });
    store
}

/// What the quota service hears from other replicas through the store.
#[derive(Debug, PartialEq, Eq)]
pub enum QuotaNotice {
    /// The bucket of this counter key (its bytes) has grants this replica may have to move.
    Bucket(Bytes),
    /// The store's connection was made again: a restarted store may have lost the buckets.
    Reconnected,
}

/// What a replica hears on the reset channel.
#[derive(Debug, PartialEq, Eq)]
pub enum Reset {
    /// A counter a replica reset (`Store::reset`).
    Counter {
        /// The bytes of its key.
        key: Bytes,
        /// Its limit's, which the over-limit cache and the leases know it by.
        requests_per_unit: u32,
    },
    /// Resets may have been missed: the channel's connection was made again, or notices came
    /// faster than they were read. Any counter may have been reset meanwhile.
    Missed,
}

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// A shard of the embedded store holds its part of `--max-keys` live counters, and a
    /// request needs a new one there (within its rule's share).
    Full { max_keys: usize },
    /// No answer before the deadline.
    Timeout,
    /// No answer before the deadline, and the request was never sent: it waited behind the
    /// calls in flight until its time ran out, so nothing it asked happened.
    Expired,
    /// Too many requests already wait for Redis.
    Shed,
    /// Redis is marked down after repeated failures, or not reached yet.
    Down,
    /// Redis answered with an error, or the connection failed.
    Unavailable(String),
    /// A Redis key where a counter (or a quota demand record) should be holds something else:
    /// another type, or fields sluice did not write. Only the requests naming it fail; Redis
    /// answered, so it is not counted as down.
    Data {
        /// The key, its bytes escaped as ASCII.
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The request's Cluster slot is moving to another node (Redis answered MOVED or ASK): it
    /// was not decided. Redis answered, so it is not counted as down.
    Redirected,
    /// A calendar counter's window was asked around this replica's clock, which is more than a
    /// window from Redis' clock: it cannot be placed. Redis answered, so it is not counted as
    /// down: only the requests with a calendar limit fail.
    Skewed {
        /// The key, its bytes escaped as ASCII.
        key: String,
    },
    /// Fewer replicas than `--redis-confirm-replicas` asks for acknowledged the request's writes
    /// before its deadline: they were refunded, so a failover cannot find them missing. Redis
    /// answered, so it is not counted as down.
    Unconfirmed {
        /// Replicas that acknowledged.
        confirmed: u32,
        /// Replicas asked for.
        asked: u32,
    },
    /// The primary serving the request's counters has fewer replicas attached than
    /// `--redis-confirm-replicas` asks for: nothing could confirm its writes, so it was not sent.
    /// Redis answered, so it is not counted as down.
    Unreplicated {
        /// The primary, `host:port`.
        node: String,
        /// Replicas attached to it.
        attached: u32,
        /// Replicas asked for.
        asked: u32,
    },
    /// The Redis URL or options are wrong.
    Config(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Full { max_keys } => write!(
                f,
                "the embedded counter store is full ({max_keys} live counters, see --max-keys)"
            ),
            StoreError::Timeout => {
                f.write_str("the store did not answer in time (--store-timeout)")
            }
            StoreError::Expired => f.write_str(
                "the store did not answer in time (--store-timeout): the calls before this one \
                 held it, and this one was not sent",
            ),
            StoreError::Shed => f.write_str("too many requests are waiting for Redis"),
            StoreError::Down => f.write_str("Redis is unreachable (circuit breaker open)"),
            StoreError::Data { key, why } => write!(
                f,
                "the Redis key \"{key}\" is not a counter sluice can read: {why}"
            ),
            StoreError::Redirected => {
                f.write_str("the counter's Cluster slot is moving to another node (MOVED or ASK)")
            }
            StoreError::Skewed { key } => write!(
                f,
                "the calendar window of the Redis key \"{key}\" was asked around this replica's \
                 clock, which is more than a window from Redis' clock: set both by NTP"
            ),
            StoreError::Unconfirmed { confirmed, asked } => write!(
                f,
                "{confirmed} of the {asked} replica(s) --redis-confirm-replicas asks for \
                 acknowledged the writes in time"
            ),
            StoreError::Unreplicated {
                node,
                attached,
                asked,
            } => write!(
                f,
                "Redis {node} has {attached} replica(s) attached, fewer than the {asked} \
                 --redis-confirm-replicas asks for"
            ),
            StoreError::Unavailable(why) | StoreError::Config(why) => f.write_str(why),
        }
    }
}

impl StoreError {
    /// The kind, as the metrics label it: full, timeout, shed, down, unavailable, data,
    /// redirected, skewed or unconfirmed.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Full { .. } => "full",
            StoreError::Timeout | StoreError::Expired => "timeout",
            StoreError::Shed => "shed",
            StoreError::Down => "down",
            StoreError::Unavailable(_) | StoreError::Config(_) => "unavailable",
            StoreError::Data { .. } => "data",
            StoreError::Redirected => "redirected",
            StoreError::Skewed { .. } => "skewed",
            StoreError::Unconfirmed { .. } | StoreError::Unreplicated { .. } => "unconfirmed",
        }
    }

    /// Redis answered, and the request failed by what it found: a key it cannot read, a slot
    /// on the move, a calendar window this replica's clock cannot place, or replicas that did
    /// not confirm or are not there. It says nothing of whether Redis is up.
    pub(crate) fn answered(&self) -> bool {
        matches!(
            self,
            StoreError::Data { .. }
                | StoreError::Redirected
                | StoreError::Skewed { .. }
                | StoreError::Unconfirmed { .. }
                | StoreError::Unreplicated { .. }
        )
    }
}

impl std::error::Error for StoreError {}

/// This process's clock, in ms since the Unix epoch: the embedded store's clock, the one a
/// replica picks calendar windows around for Redis, and the one every part of the process reads.
pub fn unix_ms() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_add_signed(TEST_CLOCK_SKEW_MS.load(Ordering::Relaxed))
}

/// For tests only (`--clock-skew-ms`): how far this replica's clock reads ahead of the host's
/// (behind, when negative), as a replica whose clock is off would.
static TEST_CLOCK_SKEW_MS: AtomicI64 = AtomicI64::new(0);

/// Sets this replica's clock `ms` ahead of the host's (tests only).
pub fn set_test_clock_skew(ms: i64) {
    TEST_CLOCK_SKEW_MS.store(ms, Ordering::Relaxed);
}
