//! The Redis store: counters in Redis hashes, updated by `lua/check.lua` through fred. On a
//! standalone server or behind Sentinel, requests that arrive while the script calls before them
//! are in flight are decided together by the next call, each all-or-nothing and in order: one
//! `EVALSHA` per request at most. On a Cluster a request is one `EVALSHA` per hash slot, sent
//! together, with a compensating refund when a slot admits and another denies.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use fred::prelude::*;
use fred::types::scripts::Script;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::StoreError;
use crate::limiter::window::Verdict;
use crate::limiter::{Algorithm, Check, Decision, Item, Mode, admits};

const CHECK_LUA: &str = include_str!("../../lua/check.lua");
const ARGS_PER_ITEM: usize = 6;
/// Script calls in flight at once from the batcher; requests arriving meanwhile wait for the next.
const CALLS_IN_FLIGHT: usize = 2;
/// Counters one batched call may carry, so that one call keeps Redis busy for a bounded time.
const COUNTERS_PER_CALL: usize = 256;

pub struct RedisStore {
    client: Client,
    script: Script,
    prefix: Vec<u8>,
    /// Where requests wait to be batched; `None` on a Cluster, where each request calls per slot.
    batcher: Option<mpsc::UnboundedSender<Pending>>,
}

/// One request's encoded counters, waiting for a batched call.
struct Pending {
    keys: Vec<Key>,
    args: Vec<Value>,
    reply: oneshot::Sender<Result<(bool, Vec<Verdict>), StoreError>>,
}

impl RedisStore {
    /// Connects to `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`) and
    /// loads the script on every primary, again after every reconnect.
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let config =
            Config::from_url(url).map_err(|e| StoreError::Config(format!("--redis-url: {e}")))?;
        let clustered = config.server.is_clustered();
        let client = Builder::from_config(config)
            .with_connection_config(|c| {
                // A script re-sent after a broken connection could count a request twice.
                c.max_command_attempts = 1;
                c.connection_timeout = Duration::from_secs(2);
                c.tcp.nodelay = Some(true);
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
            .build()
            .map_err(unavailable)?;
        client.init().await.map_err(unavailable)?;
        let script = Script::from_lua(CHECK_LUA);
        script.load(&client).await.map_err(unavailable)?;
        let (reload_client, reload_script) = (client.clone(), script.clone());
        client.on_reconnect(move |server| {
            let (client, script) = (reload_client.clone(), reload_script.clone());
            async move {
                if let Err(e) = script.load(&client).await {
                    tracing::warn!(%server, "reloading the check script after reconnect: {e}");
                }
                Ok(())
            }
        });
        let batcher = (!clustered).then(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(batch(client.clone(), script.clone(), rx));
            tx
        });
        Ok(RedisStore {
            client,
            script,
            prefix: prefix.as_bytes().to_vec(),
            batcher,
        })
    }

    /// The Redis key of a counter: prefix, a hash tag derived from the descriptor (so all limits
    /// of one descriptor share a slot), then the injective counter encoding.
    fn key(&self, item: &Item) -> Key {
        let counter = item.key.as_bytes();
        let mut key = Vec::with_capacity(self.prefix.len() + 18 + counter.len());
        key.extend_from_slice(&self.prefix);
        key.push(b'{');
        write!(key, "{:016x}}}", fnv1a(item.key.descriptor())).expect("writing to a Vec succeeds");
        key.extend_from_slice(counter);
        Key::from(bytes::Bytes::from(key))
    }

    pub async fn apply(&self, check: &Check) -> Result<Decision, StoreError> {
        let keys: Vec<Key> = check.items.iter().map(|i| self.key(i)).collect();
        if let Some(batcher) = &self.batcher {
            let all: Vec<usize> = (0..keys.len()).collect();
            let (reply, answer) = oneshot::channel();
            let pending = Pending {
                keys,
                args: encode(check, &all, false),
                reply,
            };
            batcher
                .send(pending)
                .map_err(|_| StoreError::Unavailable("the Redis store has stopped".into()))?;
            let (admitted, verdicts) = answer
                .await
                .map_err(|_| StoreError::Unavailable("the Redis store has stopped".into()))??;
            let usages = verdicts.iter().map(|v| v.usage(admitted)).collect();
            return Ok(Decision { admitted, usages });
        }
        let groups = slot_groups(&keys);
        if let [all] = groups.as_slice() {
            // One slot: the script applies the whole admission rule and writes all or nothing.
            let (admitted, verdicts) =
                run(&self.client, &self.script, check, &keys, all, true, false).await?;
            let usages = verdicts.iter().map(|v| v.usage(admitted)).collect();
            return Ok(Decision { admitted, usages });
        }

        let replies = futures_util::future::join_all(
            groups
                .iter()
                .map(|g| run(&self.client, &self.script, check, &keys, g, false, false)),
        )
        .await;
        let mut verdicts: Vec<Option<Verdict>> = vec![None; check.items.len()];
        let mut committed = Vec::new();
        let mut failure = None;
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok((admitted, group_verdicts)) => {
                    if admitted {
                        committed.push(group);
                    }
                    for (&i, v) in group.iter().zip(group_verdicts) {
                        verdicts[i] = Some(v);
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        let admitted = failure.is_none()
            && admits(&check.items, |i| verdicts[i].is_some_and(|v| v.over))
            && committed.len() == groups.len();
        if !admitted && !committed.is_empty() {
            let mut refund = Box::pin(self.refund(check, &keys, committed));
            // The first poll queues every refund on its node's connection, ahead of any later
            // command of this process on those slots; the replies are awaited off the response path.
            if futures_util::poll!(refund.as_mut()).is_pending() {
                tokio::spawn(refund);
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let usages = verdicts
            .iter()
            .map(|v| v.expect("every group answered").usage(admitted))
            .collect();
        Ok(Decision { admitted, usages })
    }

    /// Gives back what the `groups` consumed for a request that was denied, all groups at once.
    fn refund(
        &self,
        check: &Check,
        keys: &[Key],
        groups: Vec<&Vec<usize>>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (client, script) = (self.client.clone(), self.script.clone());
        let (check, keys) = (check.clone(), keys.to_vec());
        let groups: Vec<Vec<usize>> = groups.into_iter().cloned().collect();
        async move {
            let refunds = groups
                .iter()
                .map(|g| run(&client, &script, &check, &keys, g, false, true));
            for reply in futures_util::future::join_all(refunds).await {
                if let Err(e) = reply {
                    tracing::warn!("refunding a request denied across cluster slots: {e}");
                }
            }
        }
    }
}

/// The items grouped by the Cluster slot of their keys.
fn slot_groups(keys: &[Key]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        groups
            .entry(fred::util::redis_keyslot(key.as_bytes()))
            .or_default()
            .push(i);
    }
    groups.into_values().collect()
}

/// Sends the requests waiting in `queue` in batched script calls, at most `CALLS_IN_FLIGHT` at
/// once: a request that arrives while the calls are busy rides in the next one.
async fn batch(client: Client, script: Script, mut queue: mpsc::UnboundedReceiver<Pending>) {
    let calls = std::sync::Arc::new(Semaphore::new(CALLS_IN_FLIGHT));
    while let Some(first) = queue.recv().await {
        let Ok(permit) = calls.clone().acquire_owned().await else {
            return;
        };
        let mut counters = first.keys.len();
        let mut requests = vec![first];
        while counters < COUNTERS_PER_CALL {
            let Ok(next) = queue.try_recv() else { break };
            counters += next.keys.len();
            requests.push(next);
        }
        let (client, script) = (client.clone(), script.clone());
        tokio::spawn(async move {
            let mut keys = Vec::with_capacity(counters);
            let mut args = Vec::with_capacity(1 + requests.len() + counters * ARGS_PER_ITEM);
            args.push(flag(true));
            let mut replies = Vec::with_capacity(requests.len());
            for request in requests {
                replies.push((request.keys.len(), request.reply));
                keys.extend(request.keys);
                args.extend(request.args);
            }
            match call(&client, &script, keys, args).await {
                Ok(answers) => {
                    let mut rest = answers.as_slice();
                    for (counters, reply) in replies {
                        let _ = reply.send(take_request(&mut rest, counters));
                    }
                }
                Err(e) => {
                    for (_, reply) in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// Runs the script over the items `at` as one request. `undo` reverses each item's hits and
/// never denies.
async fn run(
    client: &Client,
    script: &Script,
    check: &Check,
    keys: &[Key],
    at: &[usize],
    quota_here: bool,
    undo: bool,
) -> Result<(bool, Vec<Verdict>), StoreError> {
    let group_keys: Vec<Key> = at.iter().map(|&i| keys[i].clone()).collect();
    let mut args = Vec::with_capacity(2 + at.len() * ARGS_PER_ITEM);
    args.push(flag(quota_here));
    args.extend(encode(check, at, undo));
    let answer = call(client, script, group_keys, args).await?;
    take_request(&mut answer.as_slice(), at.len())
}

/// The script's arguments for one request made of the items `at`: their count, then each item.
fn encode(check: &Check, at: &[usize], undo: bool) -> Vec<Value> {
    let mut args: Vec<Value> = Vec::with_capacity(1 + at.len() * ARGS_PER_ITEM);
    args.push(Value::from(at.len() as i64));
    for &i in at {
        let item = &check.items[i];
        let refund = item.refund != undo;
        let mode = if undo { Mode::Shadow } else { item.mode };
        args.push(Value::from_static_str(match item.limit.algorithm {
            Algorithm::FixedWindow => "f",
            Algorithm::SlidingWindow => "s",
        }));
        args.push(Value::from(i64::from(item.limit.requests_per_unit)));
        args.push(Value::from(item.limit.window_ms() as i64));
        args.push(Value::from(item.hits as i64));
        args.push(flag(refund));
        args.push(Value::from_static_str(match mode {
            Mode::Enforce => "e",
            Mode::Shadow => "s",
            Mode::Quota => "q",
        }));
    }
    args
}

/// One script call. NOSCRIPT means the script did not run: send its source instead, which also
/// caches it again. EVAL cannot answer NOSCRIPT, so a cache flushed again meanwhile does not fail
/// the call.
async fn call(
    client: &Client,
    script: &Script,
    keys: Vec<Key>,
    args: Vec<Value>,
) -> Result<Vec<i64>, StoreError> {
    match script.evalsha(client, keys.clone(), args.clone()).await {
        Err(e) if e.details().starts_with("NOSCRIPT") => client.eval(CHECK_LUA, keys, args).await,
        other => other,
    }
    .map_err(unavailable)
}

fn flag(on: bool) -> Value {
    Value::from_static_str(if on { "1" } else { "0" })
}

/// Takes the answer to a request of `counters` counters off the front of a script reply:
/// admitted, then four numbers per counter.
fn take_request(reply: &mut &[i64], counters: usize) -> Result<(bool, Vec<Verdict>), StoreError> {
    let Some((answer, rest)) = reply.split_at_checked(1 + 4 * counters) else {
        return Err(StoreError::Unavailable(format!(
            "the check script answered {} numbers for {counters} more counters",
            reply.len()
        )));
    };
    *reply = rest;
    let verdicts = answer[1..]
        .chunks_exact(4)
        .map(|c| Verdict {
            over: c[0] == 1,
            remaining_after: c[1].max(0) as u64,
            remaining_before: c[2].max(0) as u64,
            reset_ms: c[3].max(0) as u64,
        })
        .collect();
    Ok((answer[0] == 1, verdicts))
}

fn unavailable(e: Error) -> StoreError {
    StoreError::Unavailable(format!("redis: {e}"))
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

    #[test]
    fn a_batched_reply_splits_into_requests() {
        let reply = [1, 0, 4, 5, 1000, 1, 0, 0, 250, 0, 1, 0, 0, 30];
        let mut rest = &reply[..];
        let (admitted, v) = take_request(&mut rest, 2).unwrap();
        assert!(admitted);
        assert_eq!(v[0].remaining_after, 4);
        assert!(v[1].over);
        assert_eq!(v[1].reset_ms, 250);
        let (admitted, v) = take_request(&mut rest, 1).unwrap();
        assert!(!admitted);
        assert_eq!(v[0].reset_ms, 30);
        assert!(rest.is_empty());
        assert!(take_request(&mut &[1, 0][..], 1).is_err());
    }

    #[test]
    fn the_hash_tag_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
