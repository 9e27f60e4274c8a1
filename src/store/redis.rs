//! The Redis store: counters in Redis hashes, updated by `lua/check.lua` through fred. One request
//! is one `EVALSHA` on a standalone server or behind Sentinel; on a Cluster it is one `EVALSHA`
//! per hash slot, sent together, with a compensating refund when a slot admits and another denies.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use fred::prelude::*;
use fred::types::scripts::Script;

use super::StoreError;
use crate::limiter::window::Verdict;
use crate::limiter::{Algorithm, Check, Decision, Item, Mode, admits};

const CHECK_LUA: &str = include_str!("../../lua/check.lua");
const ARGS_PER_ITEM: usize = 6;

pub struct RedisStore {
    client: Client,
    script: Script,
    prefix: Vec<u8>,
    clustered: bool,
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
        Ok(RedisStore {
            client,
            script,
            prefix: prefix.as_bytes().to_vec(),
            clustered,
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
        let groups = self.slot_groups(&keys);
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

    /// The items grouped by the Cluster slot of their keys; one group outside a Cluster.
    fn slot_groups(&self, keys: &[Key]) -> Vec<Vec<usize>> {
        if !self.clustered {
            return vec![(0..keys.len()).collect()];
        }
        let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            groups
                .entry(fred::util::redis_keyslot(key.as_bytes()))
                .or_default()
                .push(i);
        }
        groups.into_values().collect()
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

/// Runs the script over the items `at`. `undo` reverses each item's hits and never denies.
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
    let mut args: Vec<Value> = Vec::with_capacity(1 + at.len() * ARGS_PER_ITEM);
    args.push(flag(quota_here));
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
    // NOSCRIPT means the script did not run: send its source instead, which also caches it again.
    // EVAL cannot answer NOSCRIPT, so a cache flushed again meanwhile does not fail the request.
    let reply: Vec<i64> = match script
        .evalsha(client, group_keys.clone(), args.clone())
        .await
    {
        Err(e) if e.details().starts_with("NOSCRIPT") => {
            client.eval(CHECK_LUA, group_keys, args).await
        }
        other => other,
    }
    .map_err(unavailable)?;
    parse_reply(&reply, at.len())
}

fn flag(on: bool) -> Value {
    Value::from_static_str(if on { "1" } else { "0" })
}

fn parse_reply(reply: &[i64], items: usize) -> Result<(bool, Vec<Verdict>), StoreError> {
    if reply.len() != 1 + 4 * items {
        return Err(StoreError::Unavailable(format!(
            "the check script answered {} numbers for {items} counters",
            reply.len()
        )));
    }
    let verdicts = reply[1..]
        .chunks_exact(4)
        .map(|c| Verdict {
            over: c[0] == 1,
            remaining_after: c[1].max(0) as u64,
            remaining_before: c[2].max(0) as u64,
            reset_ms: c[3].max(0) as u64,
        })
        .collect();
    Ok((reply[0] == 1, verdicts))
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
    fn the_reply_maps_to_verdicts() {
        let (admitted, v) = parse_reply(&[1, 0, 4, 5, 1000, 1, 0, 0, 250], 2).unwrap();
        assert!(admitted);
        assert_eq!(v[0].remaining_after, 4);
        assert!(v[1].over);
        assert_eq!(v[1].reset_ms, 250);
        assert!(parse_reply(&[1, 0], 1).is_err());
    }

    #[test]
    fn the_hash_tag_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
