//! The bounds around every store call, whatever the backend, as small layers around the call:
//! fail fast while the store's breaker is open, answer by the deadline or not at all, and tell the
//! breaker how the call went (`breaker`, `deadline`); a backend that queues its callers does so in
//! the bounded queue that sheds past its bound (`shed`). A new backend, or a wrapper around one,
//! goes through `Guard::call` and inherits them all.

mod breaker;
mod deadline;
mod shed;

use std::sync::Arc;

pub(crate) use breaker::{Breaker, Breakers};
pub use deadline::Deadline;
pub(crate) use shed::{Queue, queue};

use super::StoreError;

/// The bounds of one store (each event loop opens its own).
pub(crate) struct Guard {
    /// `None` for a store that is always there: the embedded one.
    breaker: Option<Arc<Breaker>>,
}

impl Guard {
    pub(crate) fn new(breaker: Option<Arc<Breaker>>) -> Guard {
        Guard { breaker }
    }

    /// `call`'s answer by `deadline`. While the breaker is open the call is not even started;
    /// afterwards the breaker hears how it went.
    pub(crate) async fn call<T>(
        &self,
        deadline: Deadline,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if let Some(breaker) = &self.breaker {
            breaker.admit()?;
        }
        let answer = deadline.bound(call).await;
        if let Some(breaker) = &self.breaker {
            breaker.count(&answer, deadline);
        }
        answer
    }
}
