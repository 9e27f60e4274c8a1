//! A request on a Redis Cluster: its counters grouped by hash slot (all limits of one descriptor
//! share a slot), one script call per group, all at once. When one group denies after another
//! admitted, or the caller is gone by the time the answer is ready, every admitted group is
//! refunded in the window it was charged in. The refunds of a denied request are queued on their
//! connections before the answer leaves, so this process's next request on those counters sees
//! them; until they land, another replica may see a counter a little higher: a Cluster can
//! briefly under-admit, never over-admit.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::sync::oneshot;

use super::{Answer, Charge, Conn, Undo};
use crate::limiter::algorithm::Verdict;
use crate::limiter::{Check, admits};

/// Decides `check` (whose counters are `keys`) and sends the answer on `reply`; runs to the end
/// even when the caller has stopped waiting, so that nothing it charged stays charged.
pub(super) async fn decide(
    conn: Conn,
    check: Check,
    keys: Vec<Bytes>,
    reply: oneshot::Sender<Answer>,
) {
    if reply.is_closed() {
        return;
    }
    let groups = slot_groups(&keys);
    let quota_here = groups.len() == 1;
    let ran = join_all(
        groups
            .iter()
            .map(|g| conn.run(&check, &keys, g, quota_here)),
    )
    .await;
    let mut verdicts: Vec<Option<Verdict>> = vec![None; check.items.len()];
    let mut committed = Vec::new();
    let mut failure = None;
    for (group, ran) in groups.iter().zip(ran) {
        match ran {
            Ok(ran) => {
                if ran.admitted {
                    committed.push((group, ran.now_ms, ran.verdicts.clone()));
                }
                for (&i, v) in group.iter().zip(ran.verdicts) {
                    verdicts[i] = Some(v);
                }
            }
            Err(e) => failure = Some(e),
        }
    }
    let admitted = failure.is_none()
        && admits(&check.items, |i| verdicts[i].is_some_and(|v| v.over))
        && committed.len() == groups.len();
    let answer = match failure {
        Some(e) => Err(e),
        None => Ok((
            admitted,
            verdicts
                .into_iter()
                .map(|v| v.expect("every group answered"))
                .collect(),
        )),
    };
    let refund = |committed: Vec<(&Vec<usize>, i64, Vec<Verdict>)>| {
        join_all(committed.into_iter().map(|(group, now_ms, verdicts)| {
            let mut undo = Undo::default();
            for (&i, verdict) in group.iter().zip(&verdicts) {
                undo.add(
                    &keys[i],
                    Charge::of(&check.items[i], check.at),
                    verdict,
                    now_ms,
                );
            }
            conn.undo(undo)
        }))
    };
    if !admitted {
        let mut refunds = Box::pin(refund(committed));
        // The first poll queues every refund on its node's connection, ahead of any later
        // command of this process on those slots.
        let _ = futures_util::poll!(refunds.as_mut());
        let _ = reply.send(answer);
        refunds.await;
    } else if reply.send(answer).is_err() {
        refund(committed).await;
    }
}

/// The items grouped by the Cluster slot of their keys.
fn slot_groups(keys: &[Bytes]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        groups
            .entry(fred::util::redis_keyslot(key))
            .or_default()
            .push(i);
    }
    groups.into_values().collect()
}
