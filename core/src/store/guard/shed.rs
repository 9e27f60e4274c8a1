//! Load shedding: the bounded queue in which a backend that batches (Redis, standalone or behind
//! Sentinel) keeps the requests waiting for its next call. Past `QUEUE_BOUND` a request is shed at
//! once (`StoreError::Shed`, answered by `--on-store-error`) rather than queued without end
//! behind a store that cannot keep up.

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use crate::store::StoreError;

/// Requests waiting for a batched call, per store (one per event loop); past it, requests are
/// shed.
const QUEUE_BOUND: usize = 4096;

/// Where requests wait for the backend.
pub(crate) struct Queue<T>(mpsc::Sender<T>);

/// A queue of `QUEUE_BOUND` places, and the end the backend takes the requests from.
pub(crate) fn queue<T>() -> (Queue<T>, mpsc::Receiver<T>) {
    let (tx, rx) = mpsc::channel(QUEUE_BOUND);
    (Queue(tx), rx)
}

impl<T> Queue<T> {
    /// Puts `request` in the queue, or sheds it when the queue is full.
    pub(crate) fn push(&self, request: T) -> Result<(), StoreError> {
        self.0.try_send(request).map_err(|e| match e {
            TrySendError::Full(_) => StoreError::Shed,
            TrySendError::Closed(_) => {
                StoreError::Unavailable("the Redis store has stopped".into())
            }
        })
    }
}
