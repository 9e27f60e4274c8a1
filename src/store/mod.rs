//! Where counters live. Every store applies a whole `Check` atomically: it evaluates each counter
//! with the window math, admits the request only if the limiter's rule allows it, and then moves
//! every counter of the request or none.

mod memory;
mod redis;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use memory::MemoryStore;
pub use redis::RedisStore;

use crate::limiter::{Check, Decision};

/// Where the counters are, from which each event loop opens a `Store` of its own: the one
/// embedded store, shared, or a Redis deployment, reached on the loop's own connections.
#[derive(Clone)]
pub enum Backend {
    Memory(Arc<MemoryStore>),
    Redis { url: String, key_prefix: String },
}

impl Backend {
    /// The embedded store, holding at most `max_keys` live counters. Sweeps expired counters
    /// every second from a task that ends with the store; call it inside a Tokio runtime.
    pub fn memory(max_keys: usize) -> Backend {
        let store = Arc::new(MemoryStore::new(max_keys));
        let weak = Arc::downgrade(&store);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(store) => store.sweep(),
                    None => break,
                }
            }
        });
        Backend::Memory(store)
    }

    /// A store for the calling runtime. Redis gets 10 s to answer.
    pub async fn open(&self) -> Result<Store, StoreError> {
        match self {
            Backend::Memory(store) => Ok(Store::Memory(store.clone())),
            Backend::Redis { url, key_prefix } => {
                let connect = RedisStore::connect(url, key_prefix);
                tokio::time::timeout(Duration::from_secs(10), connect)
                    .await
                    .map_err(|_| {
                        StoreError::Unavailable("redis: no connection within 10 s".into())
                    })?
                    .map(Store::Redis)
            }
        }
    }
}

/// The counter stores sluice can run on.
pub enum Store {
    Memory(Arc<MemoryStore>),
    Redis(RedisStore),
}

impl Store {
    pub async fn apply(&self, check: &Check) -> Result<Decision, StoreError> {
        match self {
            Store::Memory(memory) => memory.apply(check),
            // Boxed: the Redis call's state is kilobytes, which would otherwise be moved with
            // every request's future, on either store.
            Store::Redis(redis) => Box::pin(redis.apply(check)).await,
        }
    }
}

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The embedded store holds `--max-keys` live counters and a request needs a new one.
    Full { max_keys: usize },
    /// Redis did not answer, or answered with an error.
    Unavailable(String),
    /// The Redis URL or options are wrong.
    Config(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Full { max_keys } => {
                write!(
                    f,
                    "the embedded counter store is full ({max_keys} live counters, see --max-keys)"
                )
            }
            StoreError::Unavailable(why) | StoreError::Config(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for StoreError {}
