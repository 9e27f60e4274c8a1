//! Where `serve` keeps its counters: the embedded store and its budgets, or Redis (its URL, key
//! prefix and TLS files); and the local over-limit cache in front of either.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::at_least_one;
use sluice_core::limiter::OverLimitCache;
use sluice_core::observe::Observer;
use sluice_core::store::{Backend, MemoryStore, Percent, RedisTls};

#[derive(Args)]
#[command(next_help_heading = "Counter store and Redis")]
pub struct StoreFlags {
    /// Keep counters in Redis: redis://, rediss:// (TLS), redis-cluster://, redis-sentinel:// (user
    /// and password in the URL).
    ///
    /// Without it, counters live in the embedded store.
    #[arg(long, env = "SLUICE_REDIS_URL")]
    redis_url: Option<String>,
    /// Prefix of every Redis key sluice writes.
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// Trust the CAs of this PEM file for Redis' certificate, instead of the system's.
    #[arg(long, env = "SLUICE_REDIS_CA", requires = "redis_url")]
    redis_ca: Option<PathBuf>,
    /// Present this PEM client certificate chain to Redis.
    #[arg(long, env = "SLUICE_REDIS_CERT", requires_all = ["redis_key", "redis_url"])]
    redis_cert: Option<PathBuf>,
    /// The PEM private key of --redis-cert.
    #[arg(long, env = "SLUICE_REDIS_KEY", requires = "redis_cert")]
    redis_key: Option<PathBuf>,
    /// Answer a decision only once this many replicas acknowledge its writes (Redis WAIT, within
    /// the store deadline).
    ///
    /// A request whose writes are not acknowledged in time is refunded and gets the
    /// --on-store-error answer, as does at once every request on a primary with fewer replicas
    /// attached (and /readyz is not ready meanwhile).
    ///
    /// A failover to a replica that lagged then under-admits rather than over-admits. 0: answer as
    /// soon as the primary has the writes.
    #[arg(
        long,
        env = "SLUICE_REDIS_CONFIRM_REPLICAS",
        default_value_t = 0,
        requires = "redis_url"
    )]
    redis_confirm_replicas: u32,
    /// Most live counters the embedded store holds; a request needing a new one beyond that gets
    /// the --on-store-error answer.
    #[arg(long, env = "SLUICE_MAX_KEYS", default_value_t = 1_000_000)]
    max_keys: usize,
    /// The share of --max-keys that the counters of one rule may hold (e.g. 50%).
    ///
    /// A rule keyed on values clients choose then cannot take the whole embedded store; a request
    /// needing a new counter past it is over the limit. 100% lets a rule fill the store.
    #[arg(long, env = "SLUICE_MAX_KEYS_PER_RULE", default_value = "50%", value_parser = parse_percent)]
    max_keys_per_rule: Percent,
    /// Most counters the local over-limit cache holds (denying requests that counters known to be
    /// full would deny, without a store call, until they free up).
    ///
    /// 0 switches it off.
    #[arg(long, env = "SLUICE_LOCAL_CACHE_SIZE", default_value_t = 65_536)]
    local_cache_size: usize,
}

impl StoreFlags {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        at_least_one("--max-keys", self.max_keys)
    }

    /// The counter store, its TLS files (for Redis) read and checked now, telling `observer` of
    /// its calls.
    pub fn backend(&self, observer: Arc<dyn Observer>) -> anyhow::Result<Backend> {
        let Some(url) = &self.redis_url else {
            return Ok(Backend::memory(
                self.max_keys,
                self.max_keys_per_rule,
                observer,
            ));
        };
        let identity = self.redis_cert.as_deref().zip(self.redis_key.as_deref());
        let tls = RedisTls::load(url, self.redis_ca.as_deref(), identity)?;
        Ok(Backend::redis(
            url.clone(),
            self.redis_key_prefix.clone(),
            tls,
            self.redis_confirm_replicas,
            observer,
            MemoryStore::new(self.max_keys, self.max_keys_per_rule),
        ))
    }

    /// The local over-limit cache; `None` when switched off.
    pub fn cache(&self) -> Option<Arc<OverLimitCache>> {
        (self.local_cache_size > 0).then(|| Arc::new(OverLimitCache::new(self.local_cache_size)))
    }
}

/// A share such as `50%` (or `50`), from 1% to 100%.
fn parse_percent(value: &str) -> Result<Percent, String> {
    value
        .strip_suffix('%')
        .unwrap_or(value)
        .trim()
        .parse::<u8>()
        .ok()
        .filter(|p| (1..=100).contains(p))
        .map(Percent)
        .ok_or_else(|| "a share from 1% to 100%, such as 50%".to_owned())
}
