//! Where counters live. Every store applies a whole `Check` atomically: it evaluates each counter
//! with the window math, admits the request only if the limiter's rule allows it, and then moves
//! every counter of the request or none. Every call goes through the store's `guard`: it has a
//! `Deadline`, and a store that cannot decide in time says so, and never charges a request whose
//! caller it did not answer. Stores build on the limiter's types; the limiter knows no store.

mod demand;
mod guard;
mod memory;
mod redis;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;

pub use demand::{Change, Division, Listed, Settle};
pub use guard::Deadline;
pub use memory::{MemoryStore, Percent, Stored};
pub use redis::{RedisStore, RedisTls, Replicas, redis_key};

use crate::limiter::{Check, CounterKey, Decision, Item};
use crate::observe::Observer;
use guard::{Breakers, Guard};

/// Where the counters are, from which each event loop opens a `Store` of its own: the one
/// embedded store, shared, or a Redis deployment, reached on the loop's own connections.
#[derive(Clone)]
pub enum Backend {
    Memory(Arc<MemoryStore>),
    Redis {
        url: String,
        key_prefix: String,
        tls: Option<RedisTls>,
        /// The replicas that must acknowledge a decision's writes before it is answered, and
        /// those each primary has.
        replicas: Replicas,
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
        let store = Arc::new(MemoryStore::new(max_keys, per_rule).observed_by(observer));
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
        Backend::Memory(store)
    }

    /// A Redis deployment (see `RedisStore::connect` for the URL forms), reached over TLS as
    /// `tls` says when the URL asks for TLS, whose decisions count once `confirm_replicas`
    /// replicas acknowledge their writes (0: as soon as the primary has them), and whose stores
    /// tell `observer` of their calls.
    pub fn redis(
        url: String,
        key_prefix: String,
        tls: Option<RedisTls>,
        confirm_replicas: u32,
        observer: Arc<dyn Observer>,
    ) -> Backend {
        Backend::Redis {
            url,
            key_prefix,
            tls,
            replicas: Replicas::new(confirm_replicas),
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
            }),
            Backend::Redis {
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
                })
            }
        }
    }

    /// What other replicas tell this one of the quota buckets, for as long as the receiver is
    /// kept; `None` on the embedded store, which serves one replica. Call it inside a Tokio
    /// runtime.
    pub fn listen(&self) -> Result<Option<mpsc::Receiver<Told>>, StoreError> {
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

/// The counter store an event loop decides against: a backend behind its guard.
pub struct Store {
    guard: Guard,
    counters: Counters,
}

/// The counter stores sluice can run on.
enum Counters {
    Memory(Arc<MemoryStore>),
    Redis(Box<RedisStore>),
}

impl Store {
    pub async fn apply(&self, check: &Check, deadline: Deadline) -> Result<Decision, StoreError> {
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
        let reset = async {
            match &self.counters {
                Counters::Memory(memory) => {
                    memory.reset(items, at_ms);
                    Ok(())
                }
                Counters::Redis(redis) => {
                    redis.reset(items, at_ms).await?;
                    redis.unblock(items).await
                }
            }
        };
        self.guard.call(deadline, reset).await
    }

    /// Tells every replica that the counters of `items` may have room again: they forget
    /// them in their over-limit cache and drop their leased blocks of them
    /// (`Backend::listen_resets`). Nothing to tell on the embedded store, which serves one.
    pub async fn unblock(&self, items: &[Item], deadline: Deadline) -> Result<(), StoreError> {
        let told = async {
            match &self.counters {
                Counters::Memory(_) => Ok(()),
                Counters::Redis(redis) => redis.unblock(items).await,
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

/// What the quota service hears from other replicas through the store.
#[derive(Debug, PartialEq, Eq)]
pub enum Told {
    /// The bucket of this counter key (its bytes) has grants this replica may have to move.
    Bucket(Bytes),
    /// The store's connection was made again: a restarted store may have lost the buckets.
    Reconnected,
}

/// A counter a replica reset (`Store::reset`), as every replica hears of it.
#[derive(Debug, PartialEq, Eq)]
pub struct Reset {
    /// The bytes of its key.
    pub key: Bytes,
    /// Its limit's, which the over-limit cache and the leases know it by.
    pub requests_per_unit: u32,
}

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// A shard of the embedded store holds its part of `--max-keys` live counters, and a
    /// request needs a new one there (within its rule's share).
    Full { max_keys: usize },
    /// No answer before the deadline.
    Timeout,
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
            StoreError::Shed => f.write_str("too many requests are waiting for Redis"),
            StoreError::Down => f.write_str("Redis is unreachable (circuit breaker open)"),
            StoreError::Data { key, why } => write!(
                f,
                "the Redis key \"{key}\" is not a counter sluice can read: {why}"
            ),
            StoreError::Redirected => {
                f.write_str("the counter's Cluster slot is moving to another node (MOVED or ASK)")
            }
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
    /// redirected or unconfirmed.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Full { .. } => "full",
            StoreError::Timeout => "timeout",
            StoreError::Shed => "shed",
            StoreError::Down => "down",
            StoreError::Unavailable(_) | StoreError::Config(_) => "unavailable",
            StoreError::Data { .. } => "data",
            StoreError::Redirected => "redirected",
            StoreError::Unconfirmed { .. } | StoreError::Unreplicated { .. } => "unconfirmed",
        }
    }

    /// Redis answered, and the request failed by what it found: a key it cannot read, a slot
    /// on the move, or replicas that did not confirm or are not there. It says nothing of
    /// whether Redis is up.
    pub(crate) fn answered(&self) -> bool {
        matches!(
            self,
            StoreError::Data { .. }
                | StoreError::Redirected
                | StoreError::Unconfirmed { .. }
                | StoreError::Unreplicated { .. }
        )
    }
}

impl std::error::Error for StoreError {}

/// This process's clock, in ms since the Unix epoch: the embedded store's clock, and the one a
/// replica picks calendar windows around for Redis.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
