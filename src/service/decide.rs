//! One request's decision: the blocks this replica leased, then the local over-limit cache, then
//! the store behind its guard, the cache learning from every answer. It joins the limiter's rules
//! to a store, so it sits above both, where the request path composes them.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::shutdown::Shutdown;
use crate::telemetry::Telemetry;
use crate::telemetry::traces;
use sluice_core::limiter::lease::{Draw, Leases, Pass, Returning};
use sluice_core::limiter::{Check, Decision, OverLimitCache};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::store::{Deadline, Store, StoreError};

/// Draws a leased check from its blocks at most this many times (each after a block was taken,
/// awaited, or listened for) before the store decides it as any other.
const DRAWS: usize = 6;
/// Counters one give-back call carries at most, as a batched script call does.
pub const GIVE_BACK_COUNTERS: usize = 256;
/// How long one give-back call may take: its own deadline, not a request's, since nobody waits
/// for it and one that does not land leaves its hits unusable until their window ends.
pub(super) const GIVE_BACK_TIMEOUT: Duration = Duration::from_secs(1);
/// Failed give-backs, logged at most once a second.
static GIVE_BACK_FAILED: LogThrottle = LogThrottle::new();

/// Decides checks against a store, from leased blocks or the local over-limit cache when it can.
pub struct Decider {
    store: Arc<Store>,
    cache: Option<Arc<OverLimitCache>>,
    leases: Arc<Leases>,
    /// `--store-timeout`, which a block's store call has whatever its caller's deadline.
    store_timeout: Duration,
    /// Told how long each store call took.
    telemetry: Telemetry,
}

impl Decider {
    pub fn new(
        store: Store,
        cache: Option<Arc<OverLimitCache>>,
        leases: Arc<Leases>,
        store_timeout: Duration,
        telemetry: Telemetry,
    ) -> Self {
        Decider {
            store: Arc::new(store),
            cache,
            leases,
            store_timeout,
            telemetry,
        }
    }

    /// Gives each `scope: split` item of `check` this replica's share of its limit (see
    /// `Store::share`).
    pub fn share(&self, check: &mut Check) -> Result<(), StoreError> {
        self.store.share(check)
    }

    /// Decides `check`; the store must answer by `deadline`. A check without items is admitted
    /// without asking the store; one whose counters are all leased is admitted from their blocks
    /// when they hold its hits; one that counters known to be full deny is denied without asking
    /// the store.
    pub async fn decide(&self, check: &Check, deadline: Deadline) -> Result<Decision, StoreError> {
        if check.items.is_empty() {
            return Ok(Decision {
                admitted: true,
                usages: Vec::new(),
            });
        }
        if Leases::applies(check) {
            let mut waiting = None;
            for _ in 0..DRAWS {
                let now = Instant::now();
                match self.leases.draw(check, now) {
                    Draw::Admitted(decision) => return Ok(decision),
                    Draw::Wait => match waiting.take() {
                        // Listens for the block on its way, then draws again in case it came
                        // meanwhile.
                        None => {
                            let mut taken = Box::pin(self.leases.next_taken());
                            taken.as_mut().enable();
                            waiting = Some(taken);
                            continue;
                        }
                        Some(taken) => {
                            let _ = tokio::time::timeout_at(deadline.at, taken).await;
                        }
                    },
                    Draw::Take(at, take) => {
                        // A task of its own, with the store's own deadline: a block the store
                        // charged is recorded for the next requests even when this one's caller
                        // gives up first.
                        let taking = tokio::spawn(
                            take_block(
                                self.store.clone(),
                                self.leases.clone(),
                                check.clone(),
                                at.clone(),
                                take,
                                Deadline::new(self.store_timeout, None),
                                self.telemetry.clone(),
                            )
                            .in_current_span(),
                        );
                        match tokio::time::timeout_at(deadline.at, taking).await {
                            Ok(Ok(Ok((_, Some(admitted))))) => return Ok(admitted),
                            Ok(Ok(Ok((decision, None)))) if decision.admitted => {}
                            Ok(Ok(Ok((denied, None)))) => return Ok(merge(check, &at, denied)),
                            Ok(Ok(Err(e))) => return Err(e),
                            Ok(Err(_)) | Err(_) => return Err(StoreError::Timeout),
                        }
                    }
                    // Not through the over-limit cache, as for a block.
                    Draw::Store => return self.store_call(check, deadline, now).await,
                }
                if Instant::now() >= deadline.at {
                    return Err(StoreError::Timeout);
                }
            }
        }
        self.ask(check, deadline, Instant::now()).await
    }

    /// Asks the local over-limit cache, then the store, at `asked`.
    async fn ask(
        &self,
        check: &Check,
        deadline: Deadline,
        asked: Instant,
    ) -> Result<Decision, StoreError> {
        if let Some(denied) = self.cache.as_ref().and_then(|c| c.deny(check, asked)) {
            return Ok(denied);
        }
        let decided = self.store_call(check, deadline, asked).await;
        if let (Some(cache), Ok(decision)) = (&self.cache, &decided) {
            cache.learn(check, decision, asked);
        }
        decided
    }

    /// Asks the store, at `asked`.
    async fn store_call(
        &self,
        check: &Check,
        deadline: Deadline,
        asked: Instant,
    ) -> Result<Decision, StoreError> {
        call(&self.store, check, deadline, asked, &self.telemetry).await
    }

    /// Gives back what `pass` finds the blocks hold unused, in calls of `GIVE_BACK_COUNTERS`
    /// counters at most, one at a time, each with `GIVE_BACK_TIMEOUT`.
    pub async fn give_back(&self, pass: Pass) {
        let all = pass == Pass::Exit;
        let mut back = self.leases.give_back(Instant::now(), pass);
        while !back.is_empty() {
            let rest = back.split_off(back.len().min(GIVE_BACK_COUNTERS));
            let calls = std::mem::replace(&mut back, rest);
            let check = Check {
                items: calls.iter().map(|r| r.item.clone()).collect(),
                ..Check::default()
            };
            match self
                .store
                .apply(&check, Deadline::new(GIVE_BACK_TIMEOUT, None))
                .await
            {
                // Unconfirmed, it landed on the node that answered all the same: a refund is
                // never undone.
                Ok(_) | Err(StoreError::Unconfirmed { .. }) => self.leases.returned(&calls),
                Err(e) => self.failed(calls, &e, all),
            }
        }
    }

    /// Counts and logs a give-back that failed with `e`, to be sent again if the store surely
    /// did not apply it and the process goes on (not `at_exit`).
    fn failed(&self, calls: Vec<Returning>, e: &StoreError, at_exit: bool) {
        let unsent = matches!(
            e,
            StoreError::Expired
                | StoreError::Shed
                | StoreError::Down
                | StoreError::Redirected
                | StoreError::Full { .. }
        );
        let hits: u64 = calls.iter().map(|r| r.item.hits).sum();
        if let Some(n) = GIVE_BACK_FAILED.hit() {
            let then = if unsent && !at_exit {
                "sent again until their window ends"
            } else {
                "counted until their window ends"
            };
            tracing::warn!(
                "{n} give-back(s) of leased hits failed since the last report, the last of {hits} hits: {e}; {then}"
            );
        }
        self.leases
            .failed(calls, unsent && !at_exit, Instant::now());
    }

    /// Gives back what the blocks hold unused every half of `--lease-idle`, or sooner when a
    /// failed give-back is due to be sent again, until `shutdown` fires.
    pub async fn give_back_until(&self, shutdown: Shutdown) {
        let stop = shutdown.wait();
        tokio::pin!(stop);
        let mut periodic = Instant::now() + self.leases.idle() / 2;
        loop {
            let wake = (self.leases.next_due()).map_or(periodic, |due| due.min(periodic));
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = &mut stop => return,
            }
            let now = Instant::now();
            let pass = if now >= periodic {
                periodic = now + self.leases.idle() / 2;
                Pass::Periodic
            } else {
                Pass::Retry
            };
            self.give_back(pass).await;
        }
    }
}

/// Asks `store`, at `asked`.
async fn call(
    store: &Store,
    check: &Check,
    deadline: Deadline,
    asked: Instant,
    telemetry: &Telemetry,
) -> Result<Decision, StoreError> {
    let span = traces::store_span(telemetry, check.items.len());
    let decided = store.apply(check, deadline).instrument(span.clone()).await;
    if let Err(e) = &decided {
        traces::store_failed(&span, e);
    }
    telemetry.store_call(asked.elapsed());
    decided
}

/// Takes the blocks `take` asks for `check`'s items `at`, records what it got, and admits `check`
/// from what is held then if it can: the store's answer, and that admission. Not through the
/// over-limit cache: a block given back frees a counter the cache would hold full until its
/// window ends.
async fn take_block(
    store: Arc<Store>,
    leases: Arc<Leases>,
    check: Check,
    at: Vec<usize>,
    take: Check,
    deadline: Deadline,
    telemetry: Telemetry,
) -> Result<(Decision, Option<Decision>), StoreError> {
    let sent = Instant::now();
    let taken = call(&store, &take, deadline, sent, &telemetry).await;
    let admitted = leases.took(&check, &at, taken.as_ref().ok(), sent);
    taken.map(|taken| (taken, admitted))
}

/// The denial of `check` when taking blocks for its items `at` was `denied`: those items as the
/// store found them, the others as nobody looked at them.
fn merge(check: &Check, at: &[usize], denied: Decision) -> Decision {
    let mut usages = vec![sluice_core::limiter::Usage::unknown(); check.items.len()];
    for (&i, usage) in at.iter().zip(denied.usages) {
        usages[i] = usage;
    }
    Decision {
        admitted: false,
        usages,
    }
}
