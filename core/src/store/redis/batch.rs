//! Batching on a standalone server or behind Sentinel: requests that arrive while the script
//! calls before them are in flight wait in a bounded queue and are decided together by the next
//! call, each all-or-nothing and in order: one `EVALSHA` per request at most. A request whose
//! caller has gone, or whose time has run out, is never sent; one admitted by a call whose answer
//! came too late, or whose writes the replicas did not confirm, is refunded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use fred::prelude::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument;

use super::script::{
    ARGS_PER_ITEM, Answer, Charge, Checked, Scripts, Undo, encode, split_head, take_request,
};
use crate::limiter::Check;
use crate::observe::Observer;

/// Script calls in flight at once; requests arriving meanwhile wait for the next.
pub(super) const CALLS_IN_FLIGHT: usize = 2;
/// Counters one batched call may carry, so that one call keeps Redis busy for a bounded time.
const COUNTERS_PER_CALL: usize = 256;

/// One request's encoded counters, waiting for a batched call.
pub(super) struct Pending {
    keys: Vec<Bytes>,
    args: Vec<Value>,
    charges: Vec<Charge>,
    deadline: Instant,
    reply: oneshot::Sender<Answer>,
    taken: Taken,
    /// Its store call's span, which the script call carrying it links to.
    span: tracing::Span,
}

impl Pending {
    pub(super) fn new(
        check: &Check,
        keys: Vec<Bytes>,
        deadline: Instant,
        reply: oneshot::Sender<Answer>,
        taken: Taken,
    ) -> Self {
        let all: Vec<usize> = (0..keys.len()).collect();
        Pending {
            args: encode(check, &all, true),
            charges: check
                .items
                .iter()
                .map(|i| Charge::of(i, check.at))
                .collect(),
            keys,
            deadline,
            reply,
            taken,
            span: tracing::Span::current(),
        }
    }

    /// Its caller still waits, with time left: the call about to be sent takes it.
    fn wanted(&self, now: Instant) -> bool {
        !self.reply.is_closed() && now < self.deadline && self.taken.take()
    }
}

/// Whether a waiting request was taken: into a call by the batcher, or back by its caller once
/// its time has run out, whichever comes first. Taken back, it was surely never sent.
#[derive(Clone, Default)]
pub(super) struct Taken(Arc<AtomicBool>);

impl Taken {
    /// Takes the request; false when it was taken already.
    pub(super) fn take(&self) -> bool {
        !self.0.swap(true, Ordering::AcqRel)
    }
}

/// Sends the requests waiting in `queue` in batched script calls, at most `CALLS_IN_FLIGHT` at
/// once: a request that arrives while the calls are busy rides in the next one.
pub(super) async fn run(
    scripts: Scripts,
    mut queue: mpsc::Receiver<Pending>,
    observer: Arc<dyn Observer>,
) {
    let calls = Arc::new(Semaphore::new(CALLS_IN_FLIGHT));
    while let Some(first) = queue.recv().await {
        let Ok(permit) = calls.clone().acquire_owned().await else {
            return;
        };
        let now = Instant::now();
        let mut requests = Vec::new();
        let mut counters = 0;
        let mut next = Some(first);
        while let Some(request) = next.take() {
            if request.wanted(now) {
                counters += request.keys.len();
                requests.push(request);
            }
            if counters < COUNTERS_PER_CALL {
                next = queue.try_recv().ok();
            }
        }
        if !requests.is_empty() {
            observer.batch(requests.len());
            tokio::spawn(call(scripts.clone(), requests, counters, permit));
        }
    }
}

/// One batched call for `requests`, holding `counters` counters in all.
async fn call(
    scripts: Scripts,
    requests: Vec<Pending>,
    counters: usize,
    _permit: OwnedSemaphorePermit,
) {
    let mut keys = Vec::with_capacity(counters);
    let mut args = Vec::with_capacity(3 * requests.len() + counters * ARGS_PER_ITEM);
    let mut waiting = Vec::with_capacity(requests.len());
    // The replicas' confirmation must come while every caller still waits.
    let deadline = requests
        .iter()
        .map(|r| r.deadline)
        .min()
        .unwrap_or_else(Instant::now);
    let span = super::script_span(requests.iter().map(|r| &r.span), counters);
    for request in requests {
        keys.extend(request.keys.iter().cloned());
        args.extend(request.args);
        waiting.push((request.keys, request.charges, request.reply));
    }
    let checked = scripts.check(keys, args, deadline).instrument(span).await;
    let split = match &checked {
        Ok(Checked { reply, confirmed }) => {
            split_head(reply).map(|(head, rest)| (head, rest, confirmed))
        }
        Err(e) => Err(e.clone()),
    };
    let (head, mut rest, confirmed) = match split {
        Ok(split) => split,
        Err(e) => {
            for (_, _, reply) in waiting {
                let _ = reply.send(Err(e.clone()));
            }
            return;
        }
    };
    let mut undo = Undo::of(&head);
    for (keys, charges, reply) in waiting {
        // A request on a key that cannot be read gets its error; the others, their decisions,
        // or the error of replicas that did not confirm them.
        let answer = take_request(&mut rest, &keys);
        let decided = answer.as_ref().ok().cloned();
        let answer = match (confirmed, answer) {
            (Err(e), Ok(_)) => Err(e.clone()),
            (_, answer) => answer,
        };
        if (reply.send(answer).is_err() || confirmed.is_err())
            && let Some((admitted, verdicts)) = decided
        {
            for ((key, charge), verdict) in keys.iter().zip(charges).zip(&verdicts) {
                if charge.landed(admitted) {
                    undo.add(key, charge, verdict);
                }
            }
        }
    }
    scripts.undo(undo).await;
}
