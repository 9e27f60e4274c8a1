//! The Redis store: counters in Redis hashes, decided by `lua/check.lua` through fred. On a
//! standalone server or behind Sentinel, requests wait in a bounded queue and are decided together
//! by the next script call (`batch`); on a Cluster a request is one call per hash slot
//! (`cluster`). Either way each request's calls run in a task of their own, so that they end in a
//! decision or a refund (`lua/undo.lua`) even when the caller gives up: a request whose answer
//! did not reach its caller leaves no counter moved.
//!
//! Commands are never re-sent (a script re-sent after a broken connection could count a request
//! twice) and never wait for a reconnection: while the client is not connected they fail at once,
//! and after `FAILURES_TO_OPEN` failures in a row the breaker answers for Redis until the probe
//! reaches it again. A connection is dropped when the network stops acknowledging (TCP user
//! timeout) or when it reaches a node that is no longer a primary (`WRONG_NODE`), never because
//! Redis is slow: a paused Redis answers every call when it resumes, and what it admitted for
//! callers that have gone is refunded. A key that holds what no counter does fails only the
//! requests naming it (`StoreError::Data`), and never counts against Redis.

mod batch;
mod cluster;
mod tls;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::WithOptions;
use fred::interfaces::ClientLike;
use fred::prelude::*;
use fred::socket2::TcpKeepalive;
use fred::types::config::ReconnectError;
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, FromValue};
use tokio::sync::{mpsc, oneshot};

use super::breaker::Breaker;
use super::demand::{Demands, Report};
use super::{Deadline, StoreError};
use crate::limiter::algorithm::Verdict;
use crate::limiter::{Algorithm, Check, CounterKey, Counting, Decision, Item, Mode};
use crate::telemetry::Throttle;
use batch::Pending;
pub use tls::RedisTls;

const ARGS_PER_ITEM: usize = 8;
/// Numbers the check script answers per counter.
const REPLY_PER_ITEM: usize = 6;
/// Requests waiting for a batched call, per event loop; past it, requests are shed.
const QUEUE_BOUND: usize = 4096;
/// How often an open breaker's probe tries Redis.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// How often, and how patiently, a closed breaker's probe pings Redis, so that an outage is
/// noticed (and reported by readiness) even when no request comes.
const PING_INTERVAL: Duration = Duration::from_secs(1);
/// Error replies meaning the connection now reaches a node that cannot run the scripts: a
/// primary demoted behind a fixed address (a Kubernetes Service, a cloud primary endpoint, DNS),
/// a replica cut off from its primary, a node loading its data. fred drops the connection the
/// first one comes on (once, whatever calls were in flight on it) and reconnects as the
/// reconnect policy says, reaching whichever node the address leads to now.
const WRONG_NODE: [(&str, ReconnectError); 3] = [
    ("READONLY", ReconnectError::ReadOnly),
    ("MASTERDOWN", ReconnectError::MasterDown),
    ("LOADING", ReconnectError::Loading),
];

pub struct RedisStore {
    conn: Conn,
    prefix: Vec<u8>,
    breaker: Arc<Breaker>,
    /// Where requests wait to be batched; `None` on a Cluster, where each request calls per slot.
    queue: Option<mpsc::Sender<Pending>>,
}

/// What a request gets from its script calls: admitted, and what each counter found.
type Answer = Result<(bool, Vec<Verdict>), StoreError>;

impl RedisStore {
    /// A store on `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`). It
    /// connects in the background, retrying with backoff, and its breaker stays open until the
    /// probe has loaded the scripts on every primary. `tls`, given for a TLS URL, replaces the
    /// client's default (the system's CAs, no client certificate). Fails only on a malformed URL.
    pub fn connect(
        url: &str,
        prefix: &str,
        tls: Option<&RedisTls>,
        breaker: Arc<Breaker>,
    ) -> Result<Self, StoreError> {
        let config_error = |e: Error| StoreError::Config(format!("--redis-url: {e}"));
        let mut config = Config::from_url(url).map_err(config_error)?;
        if let Some(tls) = tls {
            config.tls = Some(tls.connector());
        }
        // The first connection follows the reconnect policy too: sluice serves before Redis.
        config.fail_fast = false;
        let clustered = config.server.is_clustered();
        let client = Builder::from_config(config)
            .with_connection_config(|c| {
                c.max_command_attempts = 1;
                c.connection_timeout = Duration::from_secs(2);
                c.internal_command_timeout = Duration::from_secs(2);
                c.tcp = TcpConfig {
                    nodelay: Some(true),
                    keepalive: Some(
                        TcpKeepalive::new()
                            .with_time(Duration::from_secs(5))
                            .with_interval(Duration::from_secs(1)),
                    ),
                    user_timeout: Some(Duration::from_secs(5)),
                    ..Default::default()
                };
                c.reconnect_errors = WRONG_NODE.iter().map(|(_, e)| e.clone()).collect();
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 500, 2))
            .build()
            .map_err(config_error)?;
        client.connect();
        let conn = Conn::new(client);
        tokio::spawn(probe(conn.clone(), breaker.clone()));
        let queue = (!clustered).then(|| {
            let (tx, rx) = mpsc::channel(QUEUE_BOUND);
            tokio::spawn(batch::run(conn.clone(), rx));
            tx
        });
        Ok(RedisStore {
            conn,
            prefix: prefix.as_bytes().to_vec(),
            breaker,
            queue,
        })
    }

    fn key(&self, key: &CounterKey) -> Bytes {
        redis_key(&self.prefix, key)
    }

    pub async fn apply(&self, check: &Check, deadline: Deadline) -> Result<Decision, StoreError> {
        if self.breaker.is_open() {
            return Err(StoreError::Down);
        }
        let keys: Vec<Bytes> = check.items.iter().map(|i| self.key(&i.key)).collect();
        let (reply, answer) = oneshot::channel();
        match &self.queue {
            Some(queue) => queue
                .try_send(Pending::new(check, keys, deadline.at, reply))
                .map_err(|e| match e {
                    mpsc::error::TrySendError::Full(_) => StoreError::Shed,
                    mpsc::error::TrySendError::Closed(_) => {
                        StoreError::Unavailable("the Redis store has stopped".into())
                    }
                })?,
            None => {
                tokio::spawn(cluster::decide(
                    self.conn.clone(),
                    check.clone(),
                    keys,
                    reply,
                ));
            }
        }
        let answer = match tokio::time::timeout_at(deadline.at, answer).await {
            Ok(Ok(answer)) => answer,
            // No answer in time, or dropped from the queue once its time had run out.
            Ok(Err(_)) | Err(_) => Err(StoreError::Timeout),
        };
        self.count(&answer, deadline);
        let (admitted, verdicts) = answer?;
        Ok(Decision::of(check, admitted, &verdicts))
    }

    /// Records a stream's demand for a quota bucket with one call of `lua/demand.lua`.
    pub async fn record_demand(
        &self,
        bucket: &CounterKey,
        report: Report<'_>,
        deadline: Deadline,
    ) -> Result<Demands, StoreError> {
        if self.breaker.is_open() {
            return Err(StoreError::Down);
        }
        let args = vec![
            Value::from(report.stream),
            report
                .demand
                .map_or(Value::from(""), |d| Value::from(d.to_string())),
            Value::from(report.stays_ms.to_string()),
        ];
        let key = self.key(bucket);
        let call = self
            .conn
            .eval::<Vec<Value>>(&self.conn.demand, vec![key.clone()], args);
        let answer = match tokio::time::timeout_at(deadline.at, call).await {
            Ok(answer) => answer.and_then(|reply| demands(reply, &key)),
            Err(_) => Err(StoreError::Timeout),
        };
        self.count(&answer, deadline);
        answer
    }

    /// Tells the breaker how a call with `deadline` went: an answer, even one saying a key
    /// cannot be read, is a success; missing a deadline the caller set sooner is neither.
    fn count<T>(&self, answer: &Result<T, StoreError>, deadline: Deadline) {
        match answer {
            Ok(_) | Err(StoreError::Data { .. }) => self.breaker.success(),
            Err(StoreError::Timeout) if !deadline.store_own => {}
            Err(e) => self.breaker.failure(e),
        }
    }
}

/// The demand script's reply for the bucket at `key`: the clock, then pairs of stream id and
/// demand; or -1 and the type the key holds instead of a hash.
fn demands(reply: Vec<Value>, key: &[u8]) -> Result<Demands, StoreError> {
    let malformed = || StoreError::Unavailable("the demand script answered malformed".into());
    let mut values = reply.into_iter();
    let now_ms = match values.next().and_then(|v| v.as_i64()) {
        Some(-1) => {
            let held = values
                .next()
                .and_then(|v| v.as_string())
                .unwrap_or_default();
            return Err(StoreError::Data {
                key: key.escape_ascii().to_string(),
                why: format!("it holds a {held}, not a hash of quota demands"),
            });
        }
        Some(now_ms) => u64::try_from(now_ms).map_err(|_| malformed())?,
        None => return Err(malformed()),
    };
    let mut streams = Vec::new();
    while let Some(stream) = values.next() {
        let stream = stream.as_string().ok_or_else(malformed)?;
        let demand = values
            .next()
            .and_then(|v| v.as_u64())
            .ok_or_else(malformed)?;
        streams.push((stream, demand));
    }
    streams.sort();
    Ok(Demands { now_ms, streams })
}

/// While the breaker is open, loads the scripts on every primary, every `PROBE_INTERVAL`; once
/// that succeeds, closes it. A load waits while the client reconnects, and for a paused Redis to
/// resume, so it succeeds as soon as Redis answers again. While the breaker is closed, pings
/// Redis every `PING_INTERVAL` and opens it when no answer comes within that time.
async fn probe(conn: Conn, breaker: Arc<Breaker>) {
    static FAILED: Throttle = Throttle::new();
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    let mut last_ping = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        if breaker.is_open() {
            match conn.load().await {
                Ok(()) => breaker.close(),
                Err(e) => {
                    if let Some(n) = FAILED.hit() {
                        tracing::warn!(
                            "Redis is not reachable ({n} tries since the last report): {e}"
                        );
                    }
                }
            }
        } else if last_ping.elapsed() >= PING_INTERVAL {
            last_ping = tokio::time::Instant::now();
            let ping = conn.at_once.ping::<()>(None);
            match tokio::time::timeout(PING_INTERVAL, ping).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => breaker.trip(&e),
                Err(_) => breaker.trip(&"no answer to PING within 1 s"),
            }
        }
    }
}

/// A Redis client and the scripts it runs.
#[derive(Clone)]
struct Conn {
    client: Client,
    /// The same client, failing commands at once while it is not connected rather than holding
    /// them until it reconnects, where they would arrive after their caller gave up.
    at_once: WithOptions<Client>,
    check: Lua,
    undo: Lua,
    demand: Lua,
}

/// A script: its source, for `EVAL` after a `NOSCRIPT`, and its SHA-1.
#[derive(Clone)]
struct Lua {
    source: &'static str,
    script: Script,
}

impl Lua {
    fn new(source: &'static str) -> Self {
        Lua {
            source,
            script: Script::from_lua(source),
        }
    }
}

/// What one script call decided for a group of counters taken as one request.
struct Ran {
    /// Redis' clock when the script ran, in ms: a charged counter was charged in window
    /// `now_ms / window`.
    now_ms: i64,
    admitted: bool,
    verdicts: Vec<Verdict>,
}

impl Conn {
    fn new(client: Client) -> Self {
        let at_once = client.with_options(&Options {
            fail_fast: true,
            ..Default::default()
        });
        Conn {
            client,
            at_once,
            check: Lua::new(include_str!("../../../lua/check.lua")),
            undo: Lua::new(include_str!("../../../lua/undo.lua")),
            demand: Lua::new(include_str!("../../../lua/demand.lua")),
        }
    }

    /// Loads the scripts on every primary.
    async fn load(&self) -> Result<(), Error> {
        self.check.script.load(&self.client).await?;
        self.undo.script.load(&self.client).await?;
        self.demand.script.load(&self.client).await
    }

    /// One script call. NOSCRIPT means the script did not run: send its source instead, which
    /// also caches it again. EVAL cannot answer NOSCRIPT, so a cache flushed again meanwhile does
    /// not fail the call.
    async fn eval<R: FromValue>(
        &self,
        lua: &Lua,
        keys: Vec<Bytes>,
        args: Vec<Value>,
    ) -> Result<R, StoreError> {
        // The keys share a slot (one call per slot on a Cluster), which picks the node.
        let slot = ClusterHash::Custom(keys.first().map_or(0, |k| fred::util::redis_keyslot(k)));
        let mut command = Vec::with_capacity(2 + keys.len() + args.len());
        command.push(Value::from(lua.script.sha1().clone()));
        command.push(Value::from(keys.len() as i64));
        command.extend(keys.into_iter().map(Value::Bytes));
        command.extend(args);
        let evalsha = CustomCommand::new_static("EVALSHA", slot.clone(), false);
        match self.at_once.custom(evalsha, command.clone()).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                command[0] = Value::from_static_str(lua.source);
                let eval = CustomCommand::new_static("EVAL", slot, false);
                self.at_once.custom(eval, command).await
            }
            other => other,
        }
        .map_err(|e| {
            static WRONG: Throttle = Throttle::new();
            if WRONG_NODE
                .iter()
                .any(|(reply, _)| e.details().starts_with(reply))
                && let Some(n) = WRONG.hit()
            {
                tracing::warn!(
                    "Redis answered like a node that is no longer a primary ({n} time(s) since \
                     the last report): reconnecting, to reach the primary. {}",
                    e.details()
                );
            }
            StoreError::Unavailable(format!("redis: {e}"))
        })
    }

    /// Runs the check script over the items `at` of `check` as one request. With `quota_here`
    /// the script applies the quota rule itself (the items are the whole request).
    async fn run(
        &self,
        check: &Check,
        keys: &[Bytes],
        at: &[usize],
        quota_here: bool,
    ) -> Result<Ran, StoreError> {
        let args = encode(check, at, quota_here);
        let group_keys: Vec<Bytes> = at.iter().map(|&i| keys[i].clone()).collect();
        let reply: Vec<Value> = self.eval(&self.check, group_keys.clone(), args).await?;
        let (now_ms, mut rest) = split_clock(&reply)?;
        let (admitted, verdicts) = take_request(&mut rest, &group_keys)?;
        Ok(Ran {
            now_ms,
            admitted,
            verdicts,
        })
    }

    /// Sends `undo` (one call: its counters must share a Cluster slot); a failure is logged.
    async fn undo(&self, undo: Undo) {
        static FAILED: Throttle = Throttle::new();
        if undo.keys.is_empty() {
            return;
        }
        if let Err(e) = self.eval::<i64>(&self.undo, undo.keys, undo.args).await
            && let Some(n) = FAILED.hit()
        {
            tracing::warn!("{n} refund(s) of requests nobody was answered for failed: {e}");
        }
    }
}

/// What `lua/undo.lua` needs to take back what a request wrote on one of its counters, beside
/// what the check script said it charged.
#[derive(Clone, Copy)]
struct Charge {
    algorithm: Algorithm,
    limit: u64,
    window_ms: u64,
    /// The instant the request named, if any.
    at: Option<u64>,
    /// Counted `always`: the charge landed whether the request was admitted or not.
    always: bool,
}

impl Charge {
    fn of(item: &Item, at: Option<u64>) -> Self {
        Charge {
            algorithm: item.limit.algorithm,
            limit: u64::from(item.limit.requests_per_unit),
            window_ms: item.limit.window_ms(),
            at,
            always: item.counting == Counting::Always,
        }
    }

    /// Whether the check script wrote this charge for a request `admitted` or not.
    fn landed(&self, admitted: bool) -> bool {
        admitted || self.always
    }
}

/// Refunds for admitted requests: the counters they charged and, for each, what the charge was,
/// as `lua/undo.lua` takes them.
#[derive(Default)]
struct Undo {
    keys: Vec<Bytes>,
    args: Vec<Value>,
}

impl Undo {
    /// Adds what the check script, in a call that ran at `now_ms`, charged to `key` as
    /// `verdict` says (a sliding log or a bucket records nothing for hits that do not fit,
    /// unless counted `always`).
    fn add(&mut self, key: &Bytes, charge: Charge, verdict: &Verdict, now_ms: i64) {
        if verdict.charged == 0 {
            return;
        }
        let now = now_ms.max(0) as u64;
        let at = charge.at.map_or(now, |at| at.max(now));
        let charged = verdict.charged;
        let (kind, a, b, c) = match charge.algorithm {
            Algorithm::FixedWindow => ("f", at / charge.window_ms, charged, 0),
            Algorithm::SlidingWindow => ("s", now / charge.window_ms, charged, 0),
            Algorithm::SlidingLog => ("l", at, charged, 0),
            Algorithm::TokenBucket | Algorithm::LeakyBucket => ("b", now, charged, charge.limit),
        };
        self.keys.push(key.clone());
        self.args.push(Value::from_static_str(kind));
        self.args.extend([a, b, c].map(|n| Value::from(n as i64)));
    }
}

/// The script's arguments for one request made of the items `at` of `check`: their count, the
/// instant it names ('0': none), whether its quota limits may deny (`quota_here`, unless a
/// descriptor outside the check passes as a quota), then each item.
fn encode(check: &Check, at: &[usize], quota_here: bool) -> Vec<Value> {
    let mut args: Vec<Value> = Vec::with_capacity(3 + at.len() * ARGS_PER_ITEM);
    args.push(Value::from(at.len() as i64));
    args.push(Value::from(check.at.unwrap_or(0) as i64));
    args.push(flag(quota_here && !check.quota_passes));
    for &i in at {
        let item = &check.items[i];
        args.push(Value::from_static_str(match item.limit.algorithm {
            Algorithm::FixedWindow => "f",
            Algorithm::SlidingWindow => "s",
            Algorithm::SlidingLog => "l",
            Algorithm::TokenBucket | Algorithm::LeakyBucket => "b",
        }));
        args.push(Value::from(i64::from(item.limit.requests_per_unit)));
        args.push(Value::from(item.limit.window_ms() as i64));
        args.push(Value::from(i64::from(item.limit.burst)));
        args.push(Value::from(item.hits as i64));
        args.push(flag(item.refund));
        args.push(Value::from_static_str(match item.mode {
            Mode::Enforce => "e",
            Mode::Shadow => "s",
            Mode::Quota => "q",
            Mode::ShadowQuota => "p",
        }));
        args.push(flag(item.counting == Counting::Always));
    }
    args
}

fn flag(on: bool) -> Value {
    Value::from_static_str(if on { "1" } else { "0" })
}

/// The check script's clock, and the requests' answers after it.
fn split_clock(reply: &[Value]) -> Result<(i64, &[Value]), StoreError> {
    match reply.split_first() {
        Some((now_ms, rest)) => Ok((now_ms.as_i64().ok_or_else(malformed_reply)?, rest)),
        None => Err(StoreError::Unavailable(
            "the check script answered nothing".into(),
        )),
    }
}

/// A check script reply sluice cannot read: never expected, counted against Redis.
fn malformed_reply() -> StoreError {
    StoreError::Unavailable("the check script answered malformed".into())
}

/// Takes the answer to a request on the counters `keys` off the front of a script reply:
/// admitted (1|0), then six numbers per counter; or -1, the place (from 1) of the counter whose
/// key could not be read, the key's type and the error.
fn take_request(reply: &mut &[Value], keys: &[Bytes]) -> Answer {
    let short = |len: usize| {
        StoreError::Unavailable(format!(
            "the check script answered {len} values for {} more counters",
            keys.len()
        ))
    };
    let number = |v: &Value| v.as_i64().ok_or_else(malformed_reply);
    let admitted = match reply.first().map(number).transpose()? {
        Some(-1) => {
            let [_, at, held, error, rest @ ..] = *reply else {
                return Err(short(reply.len()));
            };
            *reply = rest;
            let key = at
                .as_usize()
                .and_then(|at| keys.get(at.checked_sub(1)?))
                .ok_or_else(malformed_reply)?;
            let text = |v: &Value| {
                v.as_str_lossy()
                    .map(|t| t.into_owned())
                    .ok_or_else(malformed_reply)
            };
            return Err(unreadable(key, &text(held)?, &text(error)?));
        }
        Some(admitted) => admitted == 1,
        None => return Err(short(0)),
    };
    let Some((answer, rest)) = reply.split_at_checked(1 + REPLY_PER_ITEM * keys.len()) else {
        return Err(short(reply.len()));
    };
    *reply = rest;
    let mut verdicts = Vec::with_capacity(keys.len());
    for c in answer[1..].chunks_exact(REPLY_PER_ITEM) {
        let count = |v: &Value| number(v).map(|n| n.max(0) as u64);
        verdicts.push(Verdict {
            over: number(&c[0])? == 1,
            remaining_after: count(&c[1])?,
            remaining_before: count(&c[2])?,
            reset_after_ms: count(&c[3])?,
            reset_before_ms: count(&c[4])?,
            charged: count(&c[5])?,
        });
    }
    Ok((admitted, verdicts))
}

/// The error of a request whose counter at `key` could not be read: it holds a `held` (Redis'
/// type name), and reading it failed with `error`.
fn unreadable(key: &[u8], held: &str, error: &str) -> StoreError {
    let why = if error.starts_with("WRONGTYPE") {
        format!("it holds a {held}")
    } else {
        format!("its {held} holds what sluice does not write ({error})")
    };
    StoreError::Data {
        key: key.escape_ascii().to_string(),
        why,
    }
}

/// The Redis key of a counter under `prefix`: the prefix, a hash tag derived from the
/// descriptor (so all limits of one descriptor share a slot), then the injective counter
/// encoding.
pub fn redis_key(prefix: &[u8], key: &CounterKey) -> Bytes {
    let counter = key.as_bytes();
    let mut out = Vec::with_capacity(prefix.len() + 18 + counter.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn values(numbers: &[i64]) -> Vec<Value> {
        numbers.iter().map(|&n| Value::Integer(n)).collect()
    }

    #[test]
    fn a_batched_reply_splits_into_requests() {
        let reply = values(&[
            1, 0, 4, 5, 900, 1000, 1, 1, 0, 0, 250, 250, 0, 0, 1, 0, 0, 30, 30, 0,
        ]);
        let keys = |n: usize| vec![Bytes::from_static(b"k"); n];
        let mut rest = &reply[..];
        let (admitted, v) = take_request(&mut rest, &keys(2)).unwrap();
        assert!(admitted);
        assert_eq!(v[0].remaining_after, 4);
        assert_eq!(v[0].reset_after_ms, 900);
        assert_eq!(v[0].charged, 1);
        assert!(v[1].over);
        assert_eq!(v[1].reset_before_ms, 250);
        let (admitted, v) = take_request(&mut rest, &keys(1)).unwrap();
        assert!(!admitted);
        assert_eq!(v[0].reset_before_ms, 30);
        assert!(rest.is_empty());
        assert!(take_request(&mut &values(&[1, 0])[..], &keys(1)).is_err());
    }

    #[test]
    fn a_request_on_a_key_that_cannot_be_read_fails_alone_naming_the_key() {
        let text = |t: &str| Value::String(t.into());
        let mut reply = vec![Value::Integer(-1), Value::Integer(2), text("list")];
        reply.push(text(
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ));
        reply.extend(values(&[0, 1, 0, 0, 5, 5, 0]));
        let keys = [Bytes::from_static(b"p:a"), Bytes::from_static(b"p:\"b\"")];
        let mut rest = &reply[..];
        let error = take_request(&mut rest, &keys).unwrap_err();
        assert_eq!(
            error.to_string(),
            r#"the Redis key "p:\"b\"" is not a counter sluice can read: it holds a list"#
        );
        assert_eq!(error.kind(), "data");
        let (admitted, v) = take_request(&mut rest, &keys[..1]).unwrap();
        assert!(
            !admitted && v[0].over,
            "the next request is read as it was answered"
        );
        assert!(rest.is_empty());
        let unread = unreadable(b"k", "hash", "user_script:9: attempt to compare nil");
        assert_eq!(
            unread.to_string(),
            "the Redis key \"k\" is not a counter sluice can read: its hash holds what sluice \
             does not write (user_script:9: attempt to compare nil)"
        );
    }

    #[test]
    fn the_hash_tag_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
