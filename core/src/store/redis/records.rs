//! The quota service's demand records, batched on a standalone server or behind Sentinel: records
//! that arrive while the calls before them are in flight wait in a bounded queue and ride
//! together in the next call of `lua/demand.lua`, at most `RECORDS_PER_CALL` of them, so that a
//! flood of reports costs Redis a call per batch rather than one per bucket (each call's fixed
//! cost is most of a record's). A record whose caller has gone is never sent. On a Cluster each
//! record is a call of its own, to its key's slot.

use std::sync::Arc;

use bytes::Bytes;
use fred::prelude::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use super::script::{Scripts, settle_args};
use crate::store::StoreError;
use crate::store::demand::{Division, Settle};

/// Script calls in flight at once; records arriving meanwhile wait for the next.
const CALLS_IN_FLIGHT: usize = 2;
/// Records one call may carry, so that one call keeps Redis busy for a bounded time (each is a
/// few commands on one small hash).
const RECORDS_PER_CALL: usize = 32;

/// One bucket's record, waiting for a batched call.
pub(super) struct Record {
    key: Bytes,
    args: Vec<Value>,
    reply: oneshot::Sender<Result<Division, StoreError>>,
}

impl Record {
    pub(super) fn new(
        key: Bytes,
        call: &Settle,
        reply: oneshot::Sender<Result<Division, StoreError>>,
    ) -> Self {
        Record {
            key,
            args: settle_args(call),
            reply,
        }
    }
}

/// Sends the records waiting in `queue` in batched calls, at most `CALLS_IN_FLIGHT` at once.
pub(super) async fn run(scripts: Scripts, mut queue: mpsc::Receiver<Record>) {
    let calls = Arc::new(Semaphore::new(CALLS_IN_FLIGHT));
    while let Some(first) = queue.recv().await {
        let Ok(permit) = calls.clone().acquire_owned().await else {
            return;
        };
        let mut records = Vec::with_capacity(RECORDS_PER_CALL);
        let mut next = Some(first);
        while let Some(record) = next.take() {
            if !record.reply.is_closed() {
                records.push(record);
            }
            if records.len() < RECORDS_PER_CALL {
                next = queue.try_recv().ok();
            }
        }
        if !records.is_empty() {
            tokio::spawn(call(scripts.clone(), records, permit));
        }
    }
}

/// One call for `records`.
async fn call(scripts: Scripts, records: Vec<Record>, _permit: OwnedSemaphorePermit) {
    let mut keys = Vec::with_capacity(records.len());
    let mut args = Vec::with_capacity(records.iter().map(|r| r.args.len()).sum());
    let mut replies = Vec::with_capacity(records.len());
    for record in records {
        keys.push(record.key);
        args.extend(record.args);
        replies.push(record.reply);
    }
    match scripts.demands(keys, args).await {
        Ok(answers) => {
            for (answer, reply) in answers.into_iter().zip(replies) {
                let _ = reply.send(answer);
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// One record in a call of its own (on a Cluster: its key's slot).
pub(super) async fn alone(
    scripts: &Scripts,
    key: Bytes,
    call: &Settle<'_>,
) -> Result<Division, StoreError> {
    let answers = scripts.demands(vec![key], settle_args(call)).await?;
    answers.into_iter().next().unwrap_or_else(|| {
        Err(StoreError::Unavailable(
            "the demand script answered malformed".into(),
        ))
    })
}
