//! A request on a Redis Cluster: its counters grouped by hash slot (all limits of one descriptor
//! share a slot), one script call per group, all at once. When one group denies (or cannot read
//! a key) after another admitted, every admitted group is refunded in the window it was charged
//! in (charges counted `always` excepted: they land whatever the answer); when the caller is gone
//! by the time the answer is ready, everything the calls wrote is refunded. The refunds of a
//! denied request are queued on their connections before the answer leaves, so this process's
//! next request on those counters sees them; until they land, another replica may see a counter
//! a little higher: a Cluster can briefly under-admit, never over-admit.
//!
//! A group's confirmation by replicas (`--redis-confirm-replicas`) is asked of the node that
//! serves its slot once its call answered. While a slot migrates, a call that the old node
//! redirected (ASK) ran on the new node, which the `WAIT` does not reach: the confirmation of
//! keys moving at that moment is the old node's.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::script::{Answer, Charge, Scripts, Undo};
use crate::limiter::algorithm::Verdict;
use crate::limiter::{Check, admits};
use crate::store::StoreError;

/// Decides `check` (whose counters are `keys`) by `deadline` and sends the answer on `reply`;
/// runs to the end even when the caller has stopped waiting, so that nothing it charged stays
/// charged.
pub(super) async fn decide(
    scripts: Scripts,
    check: Check,
    keys: Vec<Bytes>,
    deadline: Instant,
    reply: oneshot::Sender<Answer>,
) {
    if reply.is_closed() {
        return;
    }
    let groups = slot_groups(&keys);
    let quota_here = groups.len() == 1;
    let traced = tracing::Span::current();
    let ran = join_all(groups.iter().map(|g| {
        scripts
            .run(&check, &keys, g, quota_here, deadline)
            .instrument(super::script_span(std::iter::once(&traced), g.len()))
    }))
    .await;
    let mut verdicts: Vec<Option<Verdict>> = vec![None; check.items.len()];
    // Per group that answered: the call's time and whether it admitted its items.
    let mut wrote = Vec::new();
    let mut failure = None;
    for (group, ran) in groups.iter().zip(ran) {
        match ran {
            Ok(ran) => {
                wrote.push((group, ran.head, ran.admitted));
                for (&i, v) in group.iter().zip(ran.verdicts) {
                    verdicts[i] = Some(v);
                }
            }
            // An outage outranks an answer that failed the request: it is what the breaker must
            // hear.
            Err(e) => {
                if failure.as_ref().is_none_or(StoreError::answered) {
                    failure = Some(e);
                }
            }
        }
    }
    let admitted = failure.is_none()
        && admits(&check, |i| verdicts[i].is_some_and(|v| v.over))
        && wrote.iter().all(|(_, _, admitted)| *admitted);
    // Takes back the charges that `undone` selects among those each group's call wrote.
    let refund = |undone: fn(&Charge, bool) -> bool| {
        join_all(wrote.iter().map(|&(group, ref head, group_admitted)| {
            let mut undo = Undo::of(head);
            for &i in group {
                let charge = Charge::of(&check.items[i], check.at);
                if let Some(verdict) = &verdicts[i]
                    && undone(&charge, group_admitted)
                {
                    undo.add(&keys[i], charge, verdict);
                }
            }
            scripts.undo(undo)
        }))
    };
    // Denied, a group that admitted its items takes back what the request's admission charged;
    // charges counted `always` stay. A caller gone takes back everything written.
    let denial = |c: &Charge, group_admitted: bool| group_admitted && !c.always;
    let everything = |c: &Charge, group_admitted: bool| c.landed(group_admitted);
    let answer = match failure {
        Some(e) => Err(e),
        None => Ok((
            admitted,
            verdicts
                .iter()
                .map(|v| v.expect("every group answered"))
                .collect(),
        )),
    };
    if !admitted {
        let mut refunds = Box::pin(refund(denial));
        // The first poll queues every refund on its node's connection, ahead of any later
        // command of this process on those slots.
        let _ = futures_util::poll!(refunds.as_mut());
        let gone = reply.send(answer).is_err();
        refunds.await;
        if gone {
            refund(|c, _| c.always).await;
        }
    } else if reply.send(answer).is_err() {
        refund(everything).await;
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
