//! The replicas attached to each primary, as the primary's own replication state says (`INFO
//! replication`), read every `REFRESH` and at once when a `WAIT` found fewer than asked. With
//! `--redis-confirm-replicas N`, a request on a primary known to have fewer than N replicas in
//! step gets the `--on-store-error` answer at once, without a script call or a `WAIT`; readiness
//! names the primary, and the log says so once per change.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;

/// How often the primaries' replication state is read.
pub(super) const REFRESH: Duration = Duration::from_millis(200);
/// A replica whose last acknowledgement is older than this many seconds is not counted: it
/// acknowledges every second, so one that stopped (a paused process, a cut link the primary has
/// not noticed yet) would only let every `WAIT` run to its timeout.
const LAG_SECONDS: u64 = 2;

/// One primary's replicas, as last read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Primary {
    /// Its address, `host:port`.
    pub(super) name: String,
    /// The Cluster slots it serves, first and last (all of them on one server).
    pub(super) slots: Vec<(u16, u16)>,
    /// Replicas online whose acknowledgement is recent; `None` while unknown (its `INFO` did
    /// not answer, and it never did).
    pub(super) attached: Option<u32>,
}

impl Primary {
    fn short(&self, asked: u32) -> bool {
        self.attached.is_some_and(|a| a < asked)
    }
}

/// The replicas of every primary of one deployment, shared by every store opened on it.
#[derive(Clone)]
pub struct Replication {
    inner: Arc<Inner>,
}

struct Inner {
    /// `--redis-confirm-replicas`: 0 when nothing is confirmed, and nothing is read.
    asked: u32,
    primaries: ArcSwap<Vec<Primary>>,
    /// One store reads the state for all.
    reading: AtomicBool,
    /// Told when a `WAIT` found fewer replicas than asked: read again now.
    again: Notify,
    /// Told when a primary gets too few replicas or enough again.
    changed: Notify,
}

impl Replication {
    /// The replicas of a deployment whose decisions `asked` replicas must confirm.
    pub(crate) fn new(asked: u32) -> Replication {
        Replication {
            inner: Arc::new(Inner {
                asked,
                primaries: ArcSwap::from_pointee(Vec::new()),
                reading: AtomicBool::new(false),
                again: Notify::new(),
                changed: Notify::new(),
            }),
        }
    }

    /// Replicas that must confirm a decision; 0 for none.
    pub(crate) fn asked(&self) -> u32 {
        self.inner.asked
    }

    /// Whether the caller is the one store to read the state (the first to ask).
    pub(super) fn reader(&self) -> bool {
        self.inner.asked > 0 && !self.inner.reading.swap(true, Ordering::Relaxed)
    }

    /// The primary serving `slot` and its replicas, when it is known to have fewer than asked.
    pub(super) fn short(&self, slot: u16) -> Option<(String, u32)> {
        let primaries = self.inner.primaries.load();
        primaries
            .iter()
            .find(|p| p.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .filter(|p| p.short(self.inner.asked))
            .map(|p| (p.name.clone(), p.attached.unwrap_or(0)))
    }

    /// Why a decision cannot be confirmed now: the primaries with fewer replicas than asked.
    pub(crate) fn problem(&self) -> Option<String> {
        let primaries = self.inner.primaries.load();
        let short: Vec<String> = primaries
            .iter()
            .filter(|p| p.short(self.inner.asked))
            .map(|p| format!("{} has {}", p.name, p.attached.unwrap_or(0)))
            .collect();
        (!short.is_empty()).then(|| {
            format!(
                "fewer replicas are attached than the {} --redis-confirm-replicas asks for ({}): \
                 their requests get the --on-store-error answer",
                self.inner.asked,
                short.join(", ")
            )
        })
    }

    /// The primaries known to have fewer replicas than asked.
    pub(crate) fn short_primaries(&self) -> usize {
        let asked = self.inner.asked;
        self.inner
            .primaries
            .load()
            .iter()
            .filter(|p| p.short(asked))
            .count()
    }

    /// Records what was read, logging each primary that got too few replicas or enough again.
    /// A primary that did not answer keeps what it last said.
    pub(super) fn read(&self, mut now: Vec<Primary>) {
        let asked = self.inner.asked;
        let before = self.inner.primaries.load_full();
        let last = |name: &str| before.iter().find(|p| p.name == name);
        for primary in &mut now {
            if primary.attached.is_none() {
                primary.attached = last(&primary.name).and_then(|p| p.attached);
            }
        }
        let was_short = |name: &str| {
            last(name)
                .filter(|p| p.attached.is_some())
                .map(|p| p.short(asked))
        };
        let mut changed = false;
        for primary in now.iter().filter(|p| p.attached.is_some()) {
            let short = primary.short(asked);
            if was_short(&primary.name) == Some(short) {
                continue;
            }
            if short {
                tracing::warn!(
                    "Redis {}: {} replica(s) attached, too few for --redis-confirm-replicas \
                     {asked}: its requests get the --on-store-error answer until enough are",
                    primary.name,
                    primary.attached.unwrap_or(0)
                );
                changed = true;
            } else if was_short(&primary.name).is_some() {
                tracing::info!(
                    "Redis {} has enough replicas again ({} of {asked}): deciding with \
                     confirmation",
                    primary.name,
                    primary.attached.unwrap_or(0)
                );
                changed = true;
            }
        }
        changed |= before
            .iter()
            .any(|p| p.short(asked) && !now.iter().any(|q| q.name == p.name && q.short(asked)));
        self.inner.primaries.store(Arc::new(now));
        if changed {
            self.inner.changed.notify_one();
        }
    }

    /// Asks for the state to be read again now: a `WAIT` found fewer replicas than asked.
    pub(super) fn read_again(&self) {
        self.inner.again.notify_one();
    }

    /// Waits until `REFRESH` has passed or the state is asked for again.
    pub(super) async fn next_read(&self) {
        let _ = tokio::time::timeout(REFRESH, self.inner.again.notified()).await;
    }

    /// Woken when a primary gets too few replicas or enough again; one waiter only.
    pub(crate) async fn changed(&self) {
        self.inner.changed.notified().await
    }
}

/// The replicas `INFO replication` of a primary counts as attached: online, and acknowledging;
/// `None` when the node is no primary.
pub(super) fn attached(info: &str) -> Option<u32> {
    let mut primary = false;
    let mut attached = 0;
    for line in info.lines() {
        let line = line.trim();
        if line == "role:master" {
            primary = true;
        }
        let Some((name, fields)) = line.split_once(':') else {
            continue;
        };
        if !name.starts_with("slave") {
            continue;
        }
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
        };
        let lag = field("lag").and_then(|l| l.parse::<u64>().ok());
        if field("state") == Some("online") && lag.is_some_and(|l| l <= LAG_SECONDS) {
            attached += 1;
        }
    }
    primary.then_some(attached)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_online_and_acknowledging_are_attached() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
                    slave0:ip=127.0.0.1,port=7001,state=online,offset=42,lag=0\r\n\
                    slave1:ip=127.0.0.1,port=7002,state=wait_bgsave,offset=0,lag=0\r\n\
                    slave2:ip=127.0.0.1,port=7003,state=online,offset=40,lag=9\r\n\
                    master_failover_state:no-failover\r\n";
        assert_eq!(attached(info), Some(1));
        assert_eq!(attached("role:master\r\nconnected_slaves:0\r\n"), Some(0));
        assert_eq!(
            attached("role:slave\r\nmaster_host:127.0.0.1\r\nslave_read_repl_offset:5\r\n"),
            None
        );
    }
}
