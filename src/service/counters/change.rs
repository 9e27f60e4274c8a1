//! Changing the counters a `/counters` call names, and how the change ended: applied, not
//! applied (the store failed before anything was sent), or unknown.

use axum::http::StatusCode;

use super::asked::{Action, Asked};
use super::{Counters, Failed, RESET_MARGIN, STORE_WAIT};
use crate::service::decide::GIVE_BACK_TIMEOUT;
use sluice_core::limiter::{Check, Counting, Item};
use sluice_core::store::unix_ms;
use sluice_core::store::{Deadline, StoreError};

impl Counters {
    /// Applies `asked`'s action to the counters of `items`, `leased` when replicas may hold
    /// blocks of them. A failure says whether nothing was changed for sure: the first store
    /// call failed before it was sent. Any other may have changed some counters, or all.
    pub(super) async fn change(
        &self,
        items: &[Item],
        asked: &Asked,
        leased: bool,
    ) -> Result<(), ChangeFailed> {
        let at_ms = asked.at.unwrap_or_else(unix_ms);
        let deadline = || Deadline::new(STORE_WAIT, None);
        let charge = |hits: u64, refund: bool| Check {
            items: items
                .iter()
                .map(|i| Item {
                    hits,
                    refund,
                    counting: Counting::Always,
                    ..i.clone()
                })
                .collect(),
            at: asked.at,
            quota_passes: false,
        };
        // Whether a store call was made that may have changed a counter.
        let mut sent = false;
        let mut step = |result: Result<(), StoreError>| {
            let first = !sent;
            sent = true;
            result.map_err(|e| ChangeFailed {
                surely_not_applied: first && surely_not_sent(&e),
                message: format!("the store could not answer: {e}"),
            })
        };
        match asked.action {
            Action::Show => {}
            Action::Reset | Action::Set(_) => {
                // Leased blocks on Redis: every replica drops them first, and the give-backs
                // already on their way land (or time out) before the counter goes: one landing
                // after it would free hits the reset erased. Dropping blocks changes no counter.
                if leased && self.redis_key_prefix.is_some() {
                    self.store
                        .unblock(items, deadline())
                        .await
                        .map_err(|e| ChangeFailed {
                            surely_not_applied: true,
                            message: format!("the store could not answer: {e}"),
                        })?;
                    self.forget(items);
                    tokio::time::sleep(GIVE_BACK_TIMEOUT + RESET_MARGIN).await;
                }
                let reset = self.store.reset(items, at_ms, deadline()).await;
                // Forgotten whatever the outcome: the counters may have been reset.
                self.forget(items);
                step(reset)?;
            }
            Action::Add(_) => {}
        }
        match asked.action {
            Action::Show | Action::Reset | Action::Set(0) => {}
            Action::Set(n) => {
                step(
                    self.store
                        .apply(&charge(n, false), deadline())
                        .await
                        .map(drop),
                )?;
            }
            Action::Add(n) if n > 0 => {
                let charged = charge(n.unsigned_abs(), false);
                step(self.store.apply(&charged, deadline()).await.map(drop))?;
            }
            Action::Add(n) => {
                let given = charge(n.unsigned_abs(), true);
                let given = self.store.apply(&given, deadline()).await.map(drop);
                self.forget(items);
                step(given)?;
                let unblocked = self.store.unblock(items, deadline()).await;
                step(unblocked)?;
            }
        }
        Ok(())
    }
}

/// How a change through `/counters` ended, as its audit says it and its answer tells.
pub(super) enum Outcome {
    /// A dry run: nothing asked to change.
    DryRun,
    Applied,
    /// Applied, but the counters could not be read back.
    AppliedUnread,
    /// Not applied: the store failed before anything was sent (its message).
    Failed(String),
    /// Unknown: the store failed after something was sent (its deadline passed, its connection
    /// broke); some counters may have changed, or all, or none (its message).
    Unknown(String),
}

impl Outcome {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Outcome::DryRun => "dry_run",
            Outcome::Applied | Outcome::AppliedUnread => "applied",
            Outcome::Failed(_) => "not_applied",
            Outcome::Unknown(_) => "unknown",
        }
    }

    /// Whether counters may have changed.
    pub(super) fn changed(&self) -> bool {
        !matches!(self, Outcome::DryRun | Outcome::Failed(_))
    }

    /// The answer to give instead of the counters, when the change did not surely happen or
    /// they could not be read back.
    pub(super) fn failure(&self) -> Option<Failed> {
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        match self {
            Outcome::AppliedUnread => Some((
                unavailable,
                "applied, but the counters could not be read back: show them to see what they hold"
                    .to_owned(),
            )),
            Outcome::Unknown(message) => Some((
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "outcome unknown: {message}; the change may have been applied to some \
                     counters, all or none (the audit line says unknown): show them to see"
                ),
            )),
            Outcome::Failed(message) => Some((
                unavailable,
                format!("not applied: {message}; nothing was changed"),
            )),
            Outcome::DryRun | Outcome::Applied => None,
        }
    }
}

/// A change that failed: whether nothing was changed for sure, and the store's message.
pub(super) struct ChangeFailed {
    pub(super) surely_not_applied: bool,
    pub(super) message: String,
}

/// Whether a store call that failed with `e` was surely not sent: nothing it asked happened.
fn surely_not_sent(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Full { .. }
            | StoreError::Expired
            | StoreError::Shed
            | StoreError::Down
            | StoreError::Redirected
            | StoreError::Unreplicated { .. }
    )
}
