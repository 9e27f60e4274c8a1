//! The scripts and how they are called: `lua/check.lua`, `lua/undo.lua` and `lua/demand.lua`,
//! each sent by `EVALSHA` (its source by `EVAL` after a `NOSCRIPT`), their arguments encoded and
//! their replies read back; and what a request charged, for the refund of a caller that gave up.

use std::sync::Arc;

use bytes::Bytes;
use fred::prelude::Value;
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, FromValue};
use tokio::time::Instant;

use super::conn::{self, Conn, Lanes};
use super::replication::Replication;
use crate::limiter::algorithm::Verdict;
use crate::limiter::hold::HoldId;
use crate::limiter::outcome::{HoldSeen, Outcome};
use crate::limiter::{Algorithm, Check, Counting, Item, ItemStep, Mode, OnExpiry};
use crate::log_throttle::LogThrottle;
use crate::store::StoreError;
use crate::store::demand::{Change, Division, Granted, Settle};

pub(super) const ARGS_PER_ITEM: usize = 8;
/// Numbers the check script answers per counter.
const REPLY_PER_ITEM: usize = 8;

/// What a request gets from its script calls: admitted, and what each counter found.
pub(super) type Answer = Result<(bool, Vec<Verdict>), StoreError>;

/// The scripts, called on one client.
#[derive(Clone)]
pub(super) struct Scripts {
    conn: Conn,
    /// The channel `lua/demand.lua` tells of a quota bucket whose grants other replicas have to
    /// move.
    channel: Bytes,
    check: Lua,
    undo: Lua,
    demand: Lua,
    /// With `--redis-confirm-replicas`, how check calls are confirmed; `None` without.
    confirm: Option<Confirm>,
}

/// How the replicas confirm a check's writes: on a lane of its own, and only when the primary has
/// the replicas.
#[derive(Clone)]
pub(super) struct Confirm {
    pub(super) lanes: Arc<Lanes>,
    pub(super) replicas: Replication,
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

    /// The slot that picks the node (the keys share one: one call per slot on a Cluster), and
    /// the `EVALSHA` arguments.
    fn call(&self, keys: Vec<Bytes>, args: Vec<Value>) -> (u16, Vec<Value>) {
        let slot = keys.first().map_or(0, |k| fred::util::redis_keyslot(k));
        let mut command = Vec::with_capacity(2 + keys.len() + args.len());
        command.push(Value::from(self.script.sha1().clone()));
        command.push(Value::from(keys.len() as i64));
        command.extend(keys.into_iter().map(Value::Bytes));
        command.extend(args);
        (slot, command)
    }
}

/// The check script's reply, and whether the replicas `--redis-confirm-replicas` asks for
/// acknowledged what it wrote: when they did not, its writes must be refunded and its requests
/// answered with the error.
pub(super) struct Checked {
    pub(super) reply: Vec<Value>,
    pub(super) confirmed: Result<(), StoreError>,
}

/// What one script call decided for a group of counters taken as one request.
pub(super) struct Ran {
    pub(super) head: Head,
    pub(super) admitted: bool,
    pub(super) verdicts: Vec<Verdict>,
}

impl Scripts {
    pub(super) fn new(conn: Conn, channel: Bytes, confirm: Option<Confirm>) -> Self {
        Scripts {
            conn,
            channel,
            check: Lua::new(include_str!("../../../../lua/check.lua")),
            undo: Lua::new(include_str!("../../../../lua/undo.lua")),
            demand: Lua::new(include_str!("../../../../lua/demand.lua")),
            confirm,
        }
    }

    /// Every script, for the probe to load on every primary.
    pub(super) fn all(&self) -> Vec<Script> {
        [&self.check, &self.undo, &self.demand]
            .map(|lua| lua.script.clone())
            .into()
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
        let (slot, command) = lua.call(keys, args);
        let evalsha = CustomCommand::new_static("EVALSHA", ClusterHash::Custom(slot), false);
        match self.conn.send(evalsha, command.clone()).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                resend(&self.conn, lua, slot, command).await
            }
            other => other.map_err(conn::failed),
        }
    }

    /// One call of the check script over requests whose counters are `keys`, with `args`
    /// encoded by `encode` one request after another; its reply, read by `split_head` and
    /// `take_request`. With `--redis-confirm-replicas`, it is not sent at all to a primary known
    /// to have fewer replicas than asked (`StoreError::Unreplicated`); else it runs on a lane
    /// (waiting for a free one until `deadline`) with a `WAIT` behind it, bounded by what is left
    /// until `deadline` less a fifth, kept for the answer to travel back.
    pub(super) async fn check(
        &self,
        keys: Vec<Bytes>,
        requests: Vec<Value>,
        deadline: Instant,
    ) -> Result<Checked, StoreError> {
        // With confirmation the reply names the node, so that a refund lands only where the
        // charge did.
        let mut args = Vec::with_capacity(1 + requests.len());
        args.push(flag(self.confirm.is_some()));
        args.extend(requests);
        let Some(confirm) = &self.confirm else {
            let reply = self.eval(&self.check, keys, args).await?;
            return Ok(Checked {
                reply,
                confirmed: Ok(()),
            });
        };
        let replicas = confirm.replicas.asked();
        let (slot, command) = self.check.call(keys, args);
        if let Some((node, attached)) = confirm.replicas.short(slot) {
            return Err(StoreError::Unreplicated {
                node,
                attached,
                asked: replicas,
            });
        }
        // Held until the call and its WAIT are answered: the lane carries nothing else meanwhile.
        let taken = confirm
            .lanes
            .take(deadline)
            .await
            .ok_or(StoreError::Timeout)?;
        let lane = taken.conn();
        let confirmation = || async {
            let left = deadline.saturating_duration_since(Instant::now());
            let confirmed = lane
                .confirm(ClusterHash::Custom(slot), replicas, left - left / 5)
                .await;
            if let Err(StoreError::Unconfirmed { .. }) = confirmed {
                confirm.replicas.read_again();
            }
            confirmed
        };
        let evalsha = CustomCommand::new_static("EVALSHA", ClusterHash::Custom(slot), false);
        let sent = lane.send::<Vec<Value>>(evalsha, command.clone());
        // On one server the WAIT rides right behind the script on the lane: one round trip. On a
        // Cluster the script may be redirected (MOVED, ASK), so the WAIT follows its answer, to
        // the node that serves the slot then.
        let (ran, confirmed) = if lane.clustered() {
            let ran = sent.await;
            let confirmed = match ran {
                Ok(_) => confirmation().await,
                Err(_) => Ok(()),
            };
            (ran, confirmed)
        } else {
            futures_util::join!(sent, confirmation())
        };
        match ran {
            // The WAIT ran before the script's source did: it has to be asked again.
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                let reply = resend(lane, &self.check, slot, command).await?;
                let confirmed = confirmation().await;
                Ok(Checked { reply, confirmed })
            }
            ran => Ok(Checked {
                reply: ran.map_err(conn::failed)?,
                confirmed,
            }),
        }
    }

    /// Runs the check script over the items `at` of `check` as one request. With `quota_here`
    /// the script applies the quota rule itself (the items are the whole request). When the
    /// replicas do not confirm what it wrote, that is refunded and the call fails.
    pub(super) async fn run(
        &self,
        check: &Check,
        keys: &[Bytes],
        at: &[usize],
        quota_here: bool,
        deadline: Instant,
    ) -> Result<Ran, StoreError> {
        let args = encode(check, at, quota_here);
        let group_keys: Vec<Bytes> = at.iter().map(|&i| keys[i].clone()).collect();
        let Checked { reply, confirmed } = self.check(group_keys.clone(), args, deadline).await?;
        let (head, mut rest) = split_head(&reply)?;
        let (admitted, verdicts) = take_request(&mut rest, &group_keys)?;
        if let Err(e) = confirmed {
            let mut undo = Undo::of(&head);
            for ((&i, key), verdict) in at.iter().zip(&group_keys).zip(&verdicts) {
                let charge = Charge::of(&check.items[i], check.at);
                if charge.landed(admitted) {
                    undo.add(key, charge, verdict);
                }
            }
            self.undo(undo).await;
            return Err(e);
        }
        Ok(Ran {
            head,
            admitted,
            verdicts,
        })
    }

    /// Sends `undo` (one call: its counters must share a Cluster slot); a failure is logged.
    pub(super) async fn undo(&self, undo: Undo) {
        static FAILED: LogThrottle = LogThrottle::new();
        if undo.keys.is_empty() {
            return;
        }
        if let Err(e) = self.eval::<i64>(&self.undo, undo.keys, undo.args).await
            && let Some(n) = FAILED.hit()
        {
            tracing::warn!("{n} refund(s) of requests nobody was answered for failed: {e}");
        }
    }

    /// Settles the quota buckets at `keys` (on a Cluster, keys of one slot) with one call of
    /// `lua/demand.lua`, `args` encoded by `settle_args` one key after another: each key's
    /// answer, or an error that stands for every key.
    pub(super) async fn demands(
        &self,
        keys: Vec<Bytes>,
        args: Vec<Value>,
    ) -> Result<Vec<Result<Division, StoreError>>, StoreError> {
        let mut all = Vec::with_capacity(args.len() + 1);
        all.push(Value::from(self.channel.clone()));
        all.extend(args);
        let reply = self
            .eval::<Vec<Value>>(&self.demand, keys.clone(), all)
            .await?;
        read_demands(reply, &keys)
    }
}

/// `command` again on `conn`, by `EVAL` with `lua`'s source, after a `NOSCRIPT`.
async fn resend<R: FromValue>(
    conn: &Conn,
    lua: &Lua,
    slot: u16,
    mut command: Vec<Value>,
) -> Result<R, StoreError> {
    command[0] = Value::from_static_str(lua.source);
    let eval = CustomCommand::new_static("EVAL", ClusterHash::Custom(slot), false);
    conn.send(eval, command).await.map_err(conn::failed)
}

/// What `lua/undo.lua` needs to take back what a request wrote on one of its counters, beside
/// what the check script said it charged.
#[derive(Clone, Copy)]
pub(super) struct Charge {
    algorithm: Algorithm,
    limit: u64,
    window_ms: u64,
    /// The instant the request named, if any.
    at: Option<u64>,
    /// Counted `always`: the charge landed whether the request was admitted or not.
    pub(super) always: bool,
    /// The hold a request-time call of a held rule takes once admitted: its request and amount.
    hold: Option<(HoldId, u64)>,
}

impl Charge {
    pub(super) fn of(item: &Item, at: Option<u64>) -> Self {
        Charge {
            algorithm: item.limit.algorithm,
            limit: u64::from(item.limit.requests_per_unit),
            window_ms: item.limit.window_ms(),
            at,
            always: item.counting == Counting::Always,
            hold: match item.step {
                ItemStep::Held(held) if !held.settle => Some((held.id, held.estimate)),
                _ => None,
            },
        }
    }

    /// Whether the check script wrote this charge for a request `admitted` or not.
    pub(super) fn landed(&self, admitted: bool) -> bool {
        admitted || self.always
    }
}

/// What a check reply says before its requests: when the call ran, and the node that ran it.
#[derive(Clone)]
pub(super) struct Head {
    /// Redis' clock when the script ran, in ms: a charged counter was charged in window
    /// `now_ms / window`.
    pub(super) now_ms: i64,
    /// The replication ID of the node that ran it, when asked (with `--redis-confirm-replicas`),
    /// else empty: a refund runs only on that node.
    node: Bytes,
}

/// Refunds of what one check call charged for requests that were not admitted after all: the
/// counters and, for each, what the charge was, as `lua/undo.lua` takes them.
pub(super) struct Undo {
    head: Head,
    keys: Vec<Bytes>,
    args: Vec<Value>,
}

impl Undo {
    /// Refunds of what the call that `head` describes charged.
    pub(super) fn of(head: &Head) -> Self {
        Undo {
            head: head.clone(),
            keys: Vec::new(),
            args: vec![Value::Bytes(head.node.clone())],
        }
    }

    /// Adds what the check script charged to `key` as `verdict` says (a sliding log or a
    /// bucket records nothing for hits that do not fit, unless counted `always`).
    /// A hold taken is released: nobody was answered for it.
    pub(super) fn add(&mut self, key: &Bytes, charge: Charge, verdict: &Verdict) {
        if let Some((id, amount)) = charge.hold
            && verdict
                .hold
                .is_some_and(|seen| seen.outcome == Outcome::Hold && !verdict.over)
        {
            self.keys.push(key.clone());
            self.args.push(Value::from_static_str("h"));
            self.args.extend([
                Value::from(id.hex()),
                Value::from(amount as i64),
                Value::from(0),
            ]);
        }
        if verdict.charged == 0 {
            return;
        }
        let now = self.head.now_ms.max(0) as u64;
        let at = charge.at.map_or(now, |at| at.max(now));
        let charged = verdict.charged;
        let (kind, a, b, c) = match charge.algorithm {
            Algorithm::FixedWindow => ("f", verdict.window, charged, 0),
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
pub(super) fn encode(check: &Check, at: &[usize], quota_here: bool) -> Vec<Value> {
    let mut args: Vec<Value> = Vec::with_capacity(3 + at.len() * ARGS_PER_ITEM);
    args.push(Value::from(at.len() as i64));
    args.push(Value::from(check.at.unwrap_or(0) as i64));
    args.push(flag(quota_here && !check.quota_passes));
    for &i in at {
        let item = &check.items[i];
        args.push(Value::from_static_str(match item.limit.algorithm {
            Algorithm::FixedWindow if item.limit.calendar.is_some() => "c",
            Algorithm::FixedWindow => "f",
            Algorithm::SlidingWindow => "s",
            Algorithm::SlidingLog => "l",
            Algorithm::TokenBucket | Algorithm::LeakyBucket => "b",
        }));
        args.push(Value::from(i64::from(item.limit.requests_per_unit)));
        // A calendar window's boundaries around this replica's clock: the script counts in the
        // one holding Redis' clock.
        args.push(match &item.limit.calendar {
            Some(calendar) => {
                let [b0, b1, b2, b3] = calendar.around(item.limit.unit, crate::store::unix_ms());
                Value::from(format!("{b0} {b1} {b2} {b3}"))
            }
            None => Value::from(item.limit.window_ms() as i64),
        });
        args.push(Value::from(i64::from(item.limit.burst)));
        args.push(Value::from(item.hits as i64));
        args.push(match item.step {
            ItemStep::Hits => flag(item.refund),
            ItemStep::Take { least } => Value::from(format!("u{least}")),
            ItemStep::Return { window } => Value::from(format!("r{window}")),
            ItemStep::Held(held) => Value::from(format!(
                "h{} {} {} {} {} {}",
                held.estimate,
                held.ttl_ms,
                u8::from(held.on_expiry == OnExpiry::Charge),
                held.most,
                u8::from(held.settle),
                held.id.hex()
            )),
        });
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
pub(super) fn split_head(reply: &[Value]) -> Result<(Head, &[Value]), StoreError> {
    match reply {
        [now_ms, node, rest @ ..] => {
            let head = Head {
                now_ms: now_ms.as_i64().ok_or_else(malformed_reply)?,
                node: node
                    .as_bytes()
                    .map(Bytes::copy_from_slice)
                    .unwrap_or_default(),
            };
            Ok((head, rest))
        }
        _ => Err(StoreError::Unavailable(
            "the check script answered nothing".into(),
        )),
    }
}

/// A check script reply sluice cannot read: never expected, counted against Redis.
fn malformed_reply() -> StoreError {
    StoreError::Unavailable("the check script answered malformed".into())
}

/// Takes the answer to a request on the counters `keys` off the front of a script reply:
/// admitted (1|0), then eight numbers per counter; or -1, the place (from 1) of the counter whose
/// key could not be read, the key's type and the error.
pub(super) fn take_request(reply: &mut &[Value], keys: &[Bytes]) -> Answer {
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
            window: count(&c[6])?,
            hold: match count(&c[7])? {
                0 => None,
                code => Some(HoldSeen::of_code(code).ok_or_else(malformed_reply)?),
            },
        });
    }
    Ok((admitted, verdicts))
}

/// The error of a request whose counter at `key` could not be read: it holds a `held` (Redis'
/// type name), and reading it failed with `error`.
fn unreadable(key: &[u8], held: &str, error: &str) -> StoreError {
    if held == "calendar" {
        return StoreError::Skewed {
            key: key.escape_ascii().to_string(),
        };
    }
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

/// `lua/demand.lua`'s arguments for one bucket.
pub(super) fn settle_args(call: &Settle) -> Vec<Value> {
    let number = |n: u64| Value::from(n.to_string());
    let flag = |yes: bool| Value::from(if yes { "1" } else { "0" });
    let mut args = Vec::with_capacity(8 + 5 * call.streams.len());
    args.extend([
        number(call.limit),
        flag(call.grow),
        number(call.stays_ms),
        number(call.freeze_ms),
        number(call.not_after_ms),
        number(call.grow_until_ms),
        Value::from(
            call.heard
                .map_or_else(String::new, |id| format!("{id:016x}")),
        ),
        number(call.streams.len() as u64),
    ]);
    for listed in &call.streams {
        let change = match listed.change {
            Change::Report => "r",
            Change::Keep => "k",
            Change::Leave => "l",
        };
        args.extend([
            Value::from(listed.stream),
            Value::from(change),
            number(listed.demand),
            number(listed.grant),
            flag(listed.known),
        ]);
    }
    args
}

/// The demand script's reply for the buckets at `keys`: the clock and the server, then per key whether the
/// replica is to settle again, when the first stream it did not list lapses, the number of
/// streams counted and their ids, demands, grants and shares;
/// or -1 and the type the key holds instead of a hash, which fails that key alone;
/// or -2 when the call came past its time and changed nothing, as a timeout.
fn read_demands(
    reply: Vec<Value>,
    keys: &[Bytes],
) -> Result<Vec<Result<Division, StoreError>>, StoreError> {
    let malformed = || StoreError::Unavailable("the demand script answered malformed".into());
    let mut values = reply.into_iter();
    let now_ms = values
        .next()
        .and_then(|v| v.as_u64())
        .ok_or_else(malformed)?;
    let server = values
        .next()
        .and_then(|v| v.into_string())
        .ok_or_else(malformed)?;
    let server = u64::from_str_radix(&server, 16).ok();
    let mut answers = Vec::with_capacity(keys.len());
    for key in keys {
        let again = values
            .next()
            .and_then(|v| v.as_i64())
            .ok_or_else(malformed)?;
        if again == -2 {
            answers.push(Err(StoreError::Timeout));
            continue;
        }
        if again < 0 {
            let held = values
                .next()
                .and_then(|v| v.as_string())
                .unwrap_or_default();
            answers.push(Err(StoreError::Data {
                key: key.escape_ascii().to_string(),
                why: format!("it holds a {held}, not a hash of quota demands"),
            }));
            continue;
        }
        let lapse_ms = values
            .next()
            .and_then(|v| v.as_u64())
            .ok_or_else(malformed)?;
        let count = values
            .next()
            .and_then(|v| v.as_u64())
            .ok_or_else(malformed)?;
        let mut streams = Vec::with_capacity(count.min(1024) as usize);
        for _ in 0..count {
            let stream = values
                .next()
                .and_then(|v| v.as_string())
                .ok_or_else(malformed)?;
            let mut number = || values.next().and_then(|v| v.as_u64()).ok_or_else(malformed);
            let (demand, grant, share) = (number()?, number()?, number()?);
            streams.push(Granted {
                stream,
                demand,
                grant,
                share,
            });
        }
        streams.sort_by(|a, b| a.stream.cmp(&b.stream));
        answers.push(Ok(Division {
            now_ms,
            server,
            again: again > 0,
            lapse_ms: (lapse_ms > 0).then_some(lapse_ms),
            streams,
        }));
    }
    if values.next().is_some() {
        return Err(malformed());
    }
    Ok(answers)
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
            1, 0, 4, 5, 900, 1000, 1, 7, 0, 1, 0, 0, 250, 250, 0, 7, 26, 0, 1, 0, 0, 30, 30, 0, 7,
            0,
        ]);
        let keys = |n: usize| vec![Bytes::from_static(b"k"); n];
        let mut rest = &reply[..];
        let (admitted, v) = take_request(&mut rest, &keys(2)).unwrap();
        assert!(admitted);
        assert_eq!(v[0].remaining_after, 4);
        assert_eq!(v[0].reset_after_ms, 900);
        assert_eq!(v[0].charged, 1);
        assert_eq!(v[0].window, 7);
        assert_eq!(v[0].hold, None);
        assert!(v[1].over);
        assert_eq!(
            v[1].hold,
            Some(HoldSeen {
                outcome: crate::limiter::outcome::Outcome::Settle,
                expired: 3
            })
        );
        assert_eq!(v[1].reset_before_ms, 250);
        let (admitted, v) = take_request(&mut rest, &keys(1)).unwrap();
        assert!(!admitted);
        assert_eq!(v[0].reset_before_ms, 30);
        assert!(rest.is_empty());
        assert!(take_request(&mut &values(&[1, 0])[..], &keys(1)).is_err());
    }

    #[test]
    fn a_batched_demand_reply_splits_into_buckets_and_a_wrong_typed_one_fails_alone() {
        let text = |t: &str| Value::String(t.into());
        let reply = vec![
            Value::Integer(1_000),
            text("1272d1bd24222bdb"),
            Value::Integer(1),
            Value::Integer(31_000),
            Value::Integer(2),
            text("s2"),
            Value::Integer(500),
            Value::Integer(400),
            Value::Integer(500),
            text("s1"),
            Value::Integer(250),
            Value::Integer(250),
            Value::Integer(250),
            Value::Integer(-1),
            text("string"),
            Value::Integer(0),
            Value::Integer(0),
            Value::Integer(0),
        ];
        let keys = [b"p:a", b"p:b", b"p:c"].map(|k| Bytes::from_static(k));
        let answers = read_demands(reply, &keys).unwrap();
        let first = answers[0].as_ref().unwrap();
        assert_eq!(first.now_ms, 1_000);
        assert_eq!(first.server, Some(0x1272_d1bd_2422_2bdb));
        assert!(first.again);
        assert_eq!(first.lapse_ms, Some(31_000));
        let granted: Vec<(&str, u64, u64, u64)> = first
            .streams
            .iter()
            .map(|s| (s.stream.as_str(), s.demand, s.grant, s.share))
            .collect();
        assert_eq!(
            granted,
            [("s1", 250, 250, 250), ("s2", 500, 400, 500)],
            "sorted by stream id"
        );
        let error = answers[1].as_ref().unwrap_err();
        assert_eq!(error.kind(), "data");
        assert!(error.to_string().contains("p:b"), "{error}");
        assert!(answers[2].as_ref().unwrap().streams.is_empty());
        assert_eq!(answers[2].as_ref().unwrap().lapse_ms, None);
        let short = vec![
            Value::Integer(1_000),
            text(""),
            Value::Integer(0),
            Value::Integer(0),
            Value::Integer(1),
        ];
        assert!(read_demands(short, &keys[..1]).is_err());
        let long = vec![
            Value::Integer(1_000),
            text(""),
            Value::Integer(0),
            Value::Integer(0),
            Value::Integer(0),
            Value::Integer(0),
        ];
        assert!(read_demands(long, &keys[..1]).is_err());
        let refused = vec![
            Value::Integer(1_000),
            text(""),
            Value::Integer(0),
            Value::Integer(0),
            Value::Integer(0),
        ];
        let answers = read_demands(refused, &keys[..1]).unwrap();
        assert_eq!(
            answers[0].as_ref().unwrap().server,
            None,
            "no server id where INFO is refused"
        );
    }

    #[test]
    fn a_request_on_a_key_that_cannot_be_read_fails_alone_naming_the_key() {
        let text = |t: &str| Value::String(t.into());
        let mut reply = vec![Value::Integer(-1), Value::Integer(2), text("list")];
        reply.push(text(
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ));
        reply.extend(values(&[0, 1, 0, 0, 5, 5, 0, 0, 0]));
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
        let skewed = unreadable(b"k", "calendar", "");
        assert!(
            skewed
                .to_string()
                .contains("more than a window from Redis' clock"),
            "{skewed}"
        );
    }
}
