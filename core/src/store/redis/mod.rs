//! The Redis store: counters in Redis hashes, decided by `lua/check.lua` through fred. `conn`
//! reaches Redis (URL forms, Sentinel, Cluster, `tls`, reconnects, the probe); `script` calls the
//! scripts (arguments, `EVALSHA`, replies, refunds). On a standalone server or behind Sentinel,
//! requests wait in the guard's bounded queue and are decided together by the next script call
//! (`batch`); on a Cluster a request is one call per hash slot (`cluster`). Either way each
//! request's calls run in a task of their own, so that they end in a decision or a refund
//! (`lua/undo.lua`) even when the caller gives up: a request whose answer did not reach its
//! caller leaves no counter moved. The quota service's demand records are batched the same way
//! (`records`, `lua/demand.lua`).
//!
//! Commands are never re-sent (a script re-sent after a broken connection could count a request
//! twice), not even after a Cluster's MOVED or ASK (`conn`: the request gets the
//! `--on-store-error` answer, and MOVED refreshes the slots for the next), and never wait for a
//! reconnection: while the client is not connected they fail at once, and after
//! `FAILURES_TO_OPEN` failures in a row the breaker answers for Redis until the probe reaches it
//! again. A connection is dropped when the network stops acknowledging (TCP user
//! timeout) or when it reaches a node that is no longer a primary (`WRONG_NODE`), never because
//! Redis is slow: a paused Redis answers every call when it resumes, and what it admitted for
//! callers that have gone is refunded. A key that holds what no counter does fails only the
//! requests naming it (`StoreError::Data`), and never counts against Redis.
//!
//! With `--redis-confirm-replicas`, each check call is followed by a `WAIT` on its connection,
//! bounded by the deadline: what the replicas did not acknowledge in time is refunded and its
//! requests fail (`StoreError::Unconfirmed`), so that a replica promoted after losing the last
//! writes finds every admitted request counted. Those calls run on lanes, connections of their
//! own, so that no other command waits behind a `WAIT` (`conn::Lanes`); and a primary known to
//! have fewer replicas than asked gets no call at all (`replicas`).

mod batch;
mod cluster;
mod conn;
mod records;
mod replication;
mod script;
mod tls;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use super::demand::{Division, Settle};
use super::guard::{self, Breaker, Queue};
use super::peers::{self, Beat, Peers};
use super::{Deadline, QuotaNotice, Reset, StoreError};
use fred::prelude::Value;
use fred::types::{ClusterHash, CustomCommand};

use crate::limiter::{Algorithm, Check, CounterKey, Decision, Item};
use crate::observe::{Observer, TRACES};
use batch::{Pending, Taken};
use conn::{Conn, Lanes};
use records::Record;
pub use replication::Replication;
use script::{Confirm, Scripts};
pub use tls::RedisTls;

/// Lanes of a store on a Cluster, where every request calls on its own: confirmed calls beyond
/// these wait for a free lane, until their deadline at most. On one server the batched calls in
/// flight (`batch::CALLS_IN_FLIGHT`) have a lane each.
const CLUSTER_LANES: usize = 8;

pub struct RedisStore {
    scripts: Scripts,
    /// For the commands that are no script: a reset's.
    conn: Conn,
    prefix: Vec<u8>,
    /// Where requests wait to be batched; `None` on a Cluster, where each request calls per slot.
    queue: Option<Queue<Pending>>,
    /// Where demand records wait to be batched; `None` on a Cluster, where each is a call.
    records: Option<Queue<Record>>,
}

impl RedisStore {
    /// A store on `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`). It
    /// connects in the background, retrying with backoff, and its `breaker` stays open until the
    /// probe has loaded the scripts on every primary. `tls`, given for a TLS URL, replaces the
    /// client's default (the system's CAs, no client certificate). A decision is answered once
    /// the replicas `replicas` asks for acknowledge its writes (none: at once). Fails only on a
    /// malformed URL.
    pub(crate) fn connect(
        url: &str,
        prefix: &str,
        tls: Option<&RedisTls>,
        replicas: &Replication,
        breaker: Arc<Breaker>,
        observer: Arc<dyn Observer>,
    ) -> Result<Self, StoreError> {
        let conn = Conn::connect(url, tls)?;
        let confirm = if replicas.asked() > 0 {
            let lanes = if conn.clustered() {
                CLUSTER_LANES
            } else {
                batch::CALLS_IN_FLIGHT
            };
            Some(Confirm {
                lanes: Lanes::connect(url, tls, lanes)?,
                replicas: replicas.clone(),
            })
        } else {
            None
        };
        if replicas.reader() {
            tokio::spawn(conn::watch_replicas(conn.clone(), replicas.clone()));
        }
        let lanes = confirm.as_ref().map(|c| c.lanes.clone());
        let scripts = Scripts::new(conn.clone(), quota_channel(prefix), confirm);
        let plain = conn.clone();
        tokio::spawn(conn::probe(conn.clone(), lanes, scripts.all(), breaker));
        let queue = (!conn.clustered()).then(|| {
            let (queue, waiting) = guard::queue();
            tokio::spawn(batch::run(scripts.clone(), waiting, observer));
            queue
        });
        let records = (!conn.clustered()).then(|| {
            let (queue, waiting) = guard::queue();
            tokio::spawn(records::run(scripts.clone(), waiting));
            queue
        });
        Ok(RedisStore {
            scripts,
            conn: plain,
            prefix: prefix.as_bytes().to_vec(),
            queue,
            records,
        })
    }

    /// Listens for the quota buckets other replicas name on the quota channel under `prefix`
    /// (see `Backend::listen`).
    pub(crate) fn listen(
        url: &str,
        prefix: &str,
        tls: Option<&RedisTls>,
    ) -> Result<mpsc::Receiver<QuotaNotice>, StoreError> {
        let (heard, told) = mpsc::channel(TOLD_WAITING);
        let skip = prefix.len() + TAG_BYTES;
        let read = move |payload: Bytes| {
            (payload.len() > skip).then(|| QuotaNotice::Bucket(payload.slice(skip..)))
        };
        conn::listen(url, tls, quota_channel(prefix), heard, read, || {
            Some(QuotaNotice::Reconnected)
        })?;
        Ok(told)
    }

    /// Listens for the counters other replicas reset, on the reset channel under `prefix`
    /// (see `Backend::listen_resets`).
    pub(crate) fn listen_resets(
        url: &str,
        prefix: &str,
        tls: Option<&RedisTls>,
    ) -> Result<mpsc::Receiver<Reset>, StoreError> {
        let (heard, told) = mpsc::channel(TOLD_WAITING);
        let skip = prefix.len() + TAG_BYTES;
        let read = move |payload: Bytes| {
            let (key, limit) = payload.split_at_checked(payload.len().checked_sub(4)?)?;
            let requests_per_unit = u32::from_be_bytes(limit.try_into().ok()?);
            (key.len() > skip).then(|| Reset::Counter {
                key: payload.slice(skip..key.len()),
                requests_per_unit,
            })
        };
        // A reset told while the connection was being made again is missed.
        conn::listen(url, tls, reset_channel(prefix), heard, read, || {
            Some(Reset::Missed)
        })?;
        Ok(told)
    }

    /// Resets the counters of `items` (see `Store::reset`).
    pub(crate) async fn reset(&self, items: &[Item], at_ms: u64) -> Result<(), StoreError> {
        for item in items {
            let key = Value::from(self.key(&item.key));
            let (command, args) = match item.limit.algorithm {
                Algorithm::FixedWindow => (
                    "HDEL",
                    vec![key, Value::from(item.limit.window_at(at_ms).to_string())],
                ),
                _ => ("DEL", vec![key]),
            };
            let command = CustomCommand::new_static(command, ClusterHash::FirstKey, false);
            self.conn
                .send::<Value>(command, args)
                .await
                .map_err(conn::failed)?;
            // A held counter's holds go with it (they share its slot).
            let table: Vec<Value> = ["~h", "~e", "~m"]
                .iter()
                .map(|suffix| self.table_key(&item.key, suffix))
                .collect();
            let delete = CustomCommand::new_static("DEL", ClusterHash::FirstKey, false);
            self.conn
                .send::<Value>(delete, table)
                .await
                .map_err(conn::failed)?;
        }
        Ok(())
    }

    /// What the holds of each counter of `items` hold, and how many are outstanding (see
    /// `Store::held`).
    pub(crate) async fn held(&self, items: &[Item]) -> Result<Vec<(u64, usize)>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let table = |suffix: &str| self.table_key(&item.key, suffix);
            let hget = CustomCommand::new_static("HGET", ClusterHash::FirstKey, false);
            let held: Option<String> = self
                .conn
                .send(hget, vec![table("~h"), Value::from("~")])
                .await
                .map_err(conn::failed)?;
            let zcard = CustomCommand::new_static("ZCARD", ClusterHash::FirstKey, false);
            let holds: u64 = self
                .conn
                .send(zcard, vec![table("~e")])
                .await
                .map_err(conn::failed)?;
            out.push((
                held.and_then(|h| h.parse().ok()).unwrap_or(0),
                holds as usize,
            ));
        }
        Ok(out)
    }

    /// Tells every replica on the reset channel that the counters of `items` may have room
    /// again (see `Store::unblock`).
    pub(crate) async fn unblock(&self, items: &[Item]) -> Result<(), StoreError> {
        let channel = Bytes::from(reset_channel_of(&self.prefix));
        for item in items {
            // Marked first, for a replica that misses the notice (`changed_after`), as long
            // as a block of the counter's window may live.
            let set = CustomCommand::new_static("SET", ClusterHash::FirstKey, false);
            let keep_ms = item.limit.window_ms().saturating_mul(2).max(1) as i64;
            let args = vec![
                self.table_key(&item.key, CHANGED),
                Value::from(super::unix_ms().to_string()),
                Value::from("PX"),
                Value::from(keep_ms),
            ];
            self.conn
                .send::<Value>(set, args)
                .await
                .map_err(conn::failed)?;
            let mut told = self.key(&item.key).to_vec();
            told.extend_from_slice(&item.limit.requests_per_unit.to_be_bytes());
            let publish = CustomCommand::new_static("PUBLISH", ClusterHash::Random, false);
            let args = vec![Value::from(channel.clone()), Value::from(Bytes::from(told))];
            self.conn
                .send::<Value>(publish, args)
                .await
                .map_err(conn::failed)?;
        }
        Ok(())
    }

    /// For each of `counters`, whether it was changed by hand (`unblock`) at or after the
    /// instant (ms of this replica's clock) beside it, a replica's clock apart.
    pub(crate) async fn changed_after(
        &self,
        counters: &[(CounterKey, u64)],
    ) -> Result<Vec<bool>, StoreError> {
        let mut out = Vec::with_capacity(counters.len());
        for chunk in counters.chunks(CHANGES_READ_AT_ONCE) {
            let reads = chunk.iter().map(|(key, after_ms)| async move {
                let get = CustomCommand::new_static("GET", ClusterHash::FirstKey, false);
                let marked: Option<String> = self
                    .conn
                    .send(get, vec![self.table_key(key, CHANGED)])
                    .await
                    .map_err(conn::failed)?;
                let at = marked.and_then(|m| m.parse::<u64>().ok());
                Ok::<_, StoreError>(at.is_some_and(|at| at + CLOCKS_APART_MS >= *after_ms))
            });
            for changed in futures_util::future::join_all(reads).await {
                out.push(changed?);
            }
        }
        Ok(out)
    }

    fn key(&self, key: &CounterKey) -> Bytes {
        redis_key(&self.prefix, key)
    }

    /// The key of a held counter's table beside the counter of `key`, in its slot: `~h`, `~e`
    /// or `~m` (lua/check.lua's hold section); or its marker of changes by hand, `~r`.
    fn table_key(&self, key: &CounterKey, suffix: &str) -> Value {
        let mut table = self.key(key).to_vec();
        table.extend_from_slice(suffix.as_bytes());
        Value::from(Bytes::from(table))
    }

    /// Decides `check`, queued for the next batched call, or in calls per slot on a Cluster;
    /// either way they run to the end when the caller gives up, refunding what they admitted.
    /// The guard waits until `deadline`, past which the batcher no longer sends the request.
    pub(crate) async fn apply(
        &self,
        check: &Check,
        deadline: Deadline,
    ) -> Result<Decision, StoreError> {
        let keys: Vec<Bytes> = check.items.iter().map(|i| self.key(&i.key)).collect();
        let (reply, answer) = oneshot::channel();
        let answer = match &self.queue {
            Some(queue) => {
                let taken = Taken::default();
                queue.push(Pending::new(check, keys, deadline.at, reply, taken.clone()))?;
                match tokio::time::timeout_at(deadline.at, answer).await {
                    Ok(Ok(answer)) => answer,
                    // Still waiting behind the calls in flight, or dropped from the queue, once
                    // its time had run out: never sent.
                    _ if taken.take() => Err(StoreError::Expired),
                    _ => Err(StoreError::Timeout),
                }
            }
            None => {
                tokio::spawn(
                    cluster::decide(
                        self.scripts.clone(),
                        check.clone(),
                        keys,
                        deadline.at,
                        reply,
                    )
                    .in_current_span(),
                );
                answer.await.unwrap_or(Err(StoreError::Timeout))
            }
        };
        let (admitted, verdicts) = answer?;
        Ok(Decision::of(check, admitted, &verdicts))
    }

    /// The Cluster slot of a quota bucket's record; 0 off a Cluster.
    pub(crate) fn slot(&self, bucket: &CounterKey) -> u16 {
        match self.records {
            Some(_) => 0,
            None => fred::util::redis_keyslot(&self.key(bucket)),
        }
    }

    /// Settles a quota bucket for this replica's streams of it, in the next batched call of
    /// `lua/demand.lua`, or in a call of its own on a Cluster.
    pub(crate) async fn settle(
        &self,
        bucket: &CounterKey,
        call: &Settle<'_>,
    ) -> Result<Division, StoreError> {
        let key = self.key(bucket);
        let Some(records) = &self.records else {
            return records::alone(&self.scripts, key, call).await;
        };
        let (reply, answer) = oneshot::channel();
        records.push(Record::new(key, call, reply))?;
        answer.await.unwrap_or(Err(StoreError::Timeout))
    }
}

/// Buckets named on the quota channel waiting for the quota service; past it, one is dropped (its
/// streams' next reports settle it).
const TOLD_WAITING: usize = 4096;
/// The bytes of a key's hash tag, `{<16 hex digits>}`.
const TAG_BYTES: usize = 18;

/// The channel on which `lua/demand.lua` names the quota buckets under `prefix` whose grants
/// other replicas have to move.
fn quota_channel(prefix: &str) -> Bytes {
    Bytes::from(format!("{prefix}quota-moves"))
}

/// How soon a beat is sent again while no count of the live replicas was read yet.
const FIRST_BEAT_RETRY: Duration = Duration::from_millis(50);

/// This replica's beat (`peers`): `KEYS[1]` the set of replicas (scored by when each lapses),
/// `ARGV` its id, how long (ms) a beat keeps it counted, `1` to take its beat back, and how long
/// (ms) the set is kept (the longest split window: lapsed beats stay in it, the latest few, so
/// that a replica can tell whether another counted since a window began). Answers the store's
/// clock (ms), when the last other replica lapses (lapsed) and the ids live now. The clock is
/// Redis `TIME`, the same for every replica.
const BEAT_SCRIPT: &str = "\
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], 'XX', now, ARGV[1])
  return {}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local others = 0
local top = redis.call('ZREVRANGE', KEYS[1], 0, 1, 'WITHSCORES')
for i = 1, #top, 2 do
  if top[i] ~= ARGV[1] then others = math.max(others, tonumber(top[i + 1])) end
end
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(#live + 9))
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[4]), tonumber(ARGV[2])))
local reply = {tostring(now), tostring(others)}
for i = 1, #live do reply[#reply + 1] = live[i] end
return reply
";

/// Beats for `peers` in the Redis of `url` under `prefix` every `peers::BEAT` (see
/// `store::peers`) while `wanted` gives the longest split window (ms) of the rules in force,
/// taking the beat back when it no longer does, until `stop` resolves.
pub(crate) async fn beat(
    url: &str,
    prefix: &str,
    tls: Option<&RedisTls>,
    peers: Peers,
    stop: impl Future<Output = ()>,
    wanted: impl Fn() -> Option<u64>,
) -> Result<(), StoreError> {
    let conn = Conn::connect(url, tls)?;
    let key = Bytes::from(format!("{prefix}replicas"));
    let slot = fred::util::redis_keyslot(&key);
    let live_ms = Value::from(peers::LIVE_FOR.as_millis() as i64);
    let call = |leave: bool, keep_ms: u64| {
        let eval = CustomCommand::new_static("EVAL", ClusterHash::Custom(slot), false);
        let args = vec![
            Value::from(BEAT_SCRIPT),
            Value::from(1),
            Value::from(key.clone()),
            Value::from(peers.id()),
            live_ms.clone(),
            Value::from(if leave { "1" } else { "0" }),
            Value::from(keep_ms.min(i64::MAX as u64) as i64),
        ];
        let conn = conn.clone();
        async move { conn.send::<Vec<String>>(eval, args).await }
    };
    tokio::pin!(stop);
    let mut beating = false;
    loop {
        let want = wanted();
        if let Some(keep_ms) = want {
            beating = true;
            let (sent, sent_ms) = (Instant::now(), super::unix_ms());
            match tokio::time::timeout(peers::BEAT, call(false, keep_ms)).await {
                Ok(Ok(reply)) => match read_beat(&peers, reply, sent, sent_ms) {
                    Some(beat) => peers.saw(&beat),
                    None => tracing::debug!("this replica's beat was not among the live ones"),
                },
                Ok(Err(e)) => tracing::debug!("the replicas' beat failed: {e}"),
                Err(_) => tracing::debug!("the replicas' beat took longer than a beat"),
            }
        } else if beating
            && matches!(
                tokio::time::timeout(peers::BEAT, call(true, 0)).await,
                Ok(Ok(_))
            )
        {
            beating = false;
        }
        // Until the first count is read, sooner: the split limits deny meanwhile.
        let next = if want.is_some() && peers.count() == 0 {
            FIRST_BEAT_RETRY
        } else {
            peers::BEAT
        };
        tokio::select! {
            () = &mut stop => break,
            () = tokio::time::sleep(next) => {}
        }
    }
    if beating {
        let _ = tokio::time::timeout(peers::BEAT, call(true, 0)).await;
    }
    Ok(())
}

/// A beat's answer as `peers` reads it (times on this replica's clock), or `None` when it was
/// not counted among the live.
fn read_beat(peers: &Peers, reply: Vec<String>, sent: Instant, sent_ms: u64) -> Option<Beat> {
    let received_ms = super::unix_ms();
    let [store_now, others, live @ ..] = reply.as_slice() else {
        return None;
    };
    let (store_now, others) = (store_now.parse::<u64>().ok()?, others.parse::<u64>().ok()?);
    // By id, an order every replica reading the same set agrees on.
    let mut live: Vec<&String> = live.iter().collect();
    live.sort_unstable();
    let place = live.iter().position(|id| *id == peers.id())?;
    Some(Beat {
        sent,
        sent_ms,
        received_ms,
        count: live.len() as u32,
        place: place as u32,
        // The store's clock read as this replica's: late rather than early.
        others_until: if others == 0 {
            0
        } else {
            (received_ms + others).saturating_sub(store_now)
        },
    })
}

/// The suffix of the key marking when a counter was last changed by hand, in its slot.
const CHANGED: &str = "~r";
/// Markers read at once when resets may have been missed.
const CHANGES_READ_AT_ONCE: usize = 256;
/// How far apart two replicas' clocks are taken to be, at most, when a marker written by one is
/// compared with an instant of another: a change within it is taken as after.
const CLOCKS_APART_MS: u64 = 1_000;

/// The channel on which a replica that reset counters (`/counters`) names them to every other
/// under `prefix`: the counter's Redis key, then its limit's requests per unit (4 bytes, big
/// endian), which the local over-limit cache and the leases know a counter by.
fn reset_channel(prefix: &str) -> Bytes {
    Bytes::from(reset_channel_of(prefix.as_bytes()))
}

fn reset_channel_of(prefix: &[u8]) -> Vec<u8> {
    [prefix, b"counter-resets"].concat()
}

/// The Redis key of a counter under `prefix`: the prefix, a hash tag derived from the
/// descriptor (so all limits of one descriptor share a slot), then the injective counter
/// encoding.
pub fn redis_key(prefix: &[u8], key: &CounterKey) -> Bytes {
    let counter = key.as_bytes();
    let mut out = Vec::with_capacity(prefix.len() + TAG_BYTES + counter.len());
    out.extend_from_slice(prefix);
    out.push(b'{');
    write!(out, "{:016x}}}", fnv1a(key.descriptor())).expect("writing to a Vec succeeds");
    out.extend_from_slice(counter);
    Bytes::from(out)
}

/// FNV-1a, 64 bits: a stable hash, the same in every replica, for the key's hash tag.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The span of one Redis script call carrying the requests whose store spans are `requests`:
/// a child of the first traced one, linked to every other (they share it); none when none is
/// traced (as none is when tracing is off).
pub(super) fn script_span<'a>(
    mut requests: impl Iterator<Item = &'a tracing::Span>,
    counters: usize,
) -> tracing::Span {
    let Some(first) = requests.find(|s| !s.is_none()) else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(
        target: TRACES,
        parent: first,
        "redis EVALSHA",
        otel.kind = "client",
        db.system = "redis",
        sluice.requests = 1,
        sluice.counters = counters,
    );
    let mut carried = 1;
    for other in requests.filter(|s| !s.is_none()) {
        span.follows_from(other);
        carried += 1;
    }
    span.record("sluice.requests", carried);
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_tag_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
