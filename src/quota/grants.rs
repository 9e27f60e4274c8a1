//! Settling a bucket: one settle call records the moving stream's demand and this replica's
//! grants in the store, which shrinks them to their shares at once and grows them by what no
//! stream holds; the grants that moved are pushed to their streams, and once a shrink is taken
//! by its connection the bucket is settled again, which frees it for the others.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tracing::Instrument;

use super::assignment::assign;
use super::replica::{BucketMove, Subscriber};
use super::stream::Outbox;
use super::{
    Assignment, DEMAND_STAYS, FROZEN_AFTER_RECONNECTION, GROWS_WITHIN, LATE_RETRY, Quotas,
    SETTLE_ROUNDS, TAKEN_WITHIN, WAKE_SLACK,
};
use crate::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use crate::telemetry::traces;
use sluice_core::limiter::share::MILLI;
use sluice_core::limiter::share::settled;
use sluice_core::limiter::{CounterKey, Limit};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::rules::QuotaRule;
use sluice_core::store::{Change, Division, Listed, Settle, StoreError};

impl Quotas {
    /// Sends `subscriber` its new `assignment` of the bucket, for the assignments' time to live;
    /// whether it went (a full outbox drops it).
    pub(super) fn push(&self, subscriber: &Subscriber, assignment: Assignment) -> bool {
        let Ok(bucket_id) = BucketId::decode(&*subscriber.bucket_id) else {
            return false;
        };
        let pushed = RateLimitQuotaResponse {
            bucket_action: vec![assign(bucket_id, assignment, self.settings.ttl)],
        };
        let sent = subscriber.outbox.try_send(Ok(pushed)).is_ok();
        if sent {
            self.telemetry
                .quota_actions(&subscriber.labels, assignment.name(), 1);
        }
        sent
    }

    /// Counts and logs (at most once a second) that a settle call failed: the buckets keep
    /// their assignments.
    pub(super) fn failed_settle(&self, e: &StoreError) {
        static FAILED: LogThrottle = LogThrottle::new();
        self.telemetry.quota_store_error(e.kind());
        if let Some(n) = FAILED.hit() {
            tracing::warn!(
                "{n} quota demand record(s) since the last report failed, the buckets keep their last assignments: {e}"
            );
        }
    }

    /// Settles bucket `id` with no report (another replica moved, or the store came back).
    pub(super) async fn settle_in_background(
        self: &Arc<Self>,
        id: u128,
        key: CounterKey,
        rule: Arc<QuotaRule>,
    ) {
        if let Err(e) = self.settle(id, &key, &rule, None, None).await {
            self.failed_settle(&e);
        }
    }

    /// Takes `stream` out of bucket `id`'s division (`key`, divided by `rule`) in the store: its
    /// grant goes to the others at once.
    pub(super) async fn leave(
        self: &Arc<Self>,
        id: u128,
        key: &CounterKey,
        rule: &QuotaRule,
        stream: u64,
    ) {
        let leaving = BucketMove {
            stream,
            change: Change::Leave,
            demand: 0,
        };
        if let Err(e) = self.settle(id, key, rule, Some(leaving), None).await {
            self.failed_settle(&e);
        }
    }

    /// Settles bucket `id` (`key`, divided by `rule`) for this replica's streams of it, with
    /// `moving`'s report or departure, and sends every stream whose grant moved its new
    /// assignment, but for a growth of `answering`'s, which its answer carries. Once a shrink has
    /// been sent, settles again, which frees it for the others. One bucket at a time: each sees
    /// what the ones before it left.
    pub(super) async fn settle(
        self: &Arc<Self>,
        id: u128,
        key: &CounterKey,
        rule: &QuotaRule,
        mut moving: Option<BucketMove>,
        answering: Option<u64>,
    ) -> Result<Division, StoreError> {
        let _turn = self.turn(id).lock().await;
        let limit = rule.limit.as_ref().expect("a divided bucket has a limit");
        let total = u64::from(limit.requests_per_unit) * MILLI;
        let stays = self.stays();
        let mut rounds = 0;
        loop {
            let listed = self.listed(id, moving);
            let mut call = Settle {
                limit: total,
                grow: true,
                stays_ms: stays.as_millis() as u64,
                freeze_ms: FROZEN_AFTER_RECONNECTION.as_millis() as u64,
                not_after_ms: 0,
                grow_until_ms: 0,
                heard: None,
                streams: listed
                    .iter()
                    .map(|(stream, change, demand, held, known)| Listed {
                        stream,
                        change: *change,
                        demand: *demand,
                        grant: *held,
                        known: *known,
                    })
                    .collect(),
            };
            let span = traces::division_span(&self.telemetry, &rule.path, call.streams.len());
            let sent = Instant::now();
            let division = match self.record(key, &mut call).instrument(span.clone()).await {
                Ok(division) => division,
                Err(e) => {
                    traces::store_failed(&span, &e);
                    return Err(e);
                }
            };
            let shrunk = self.send_grants(id, &division, limit, answering);
            moving = None;
            rounds += 1;
            if !division.again || shrunk.is_empty() || rounds == SETTLE_ROUNDS {
                let again = if call.grow_until_ms != 0 && sent.elapsed() > GROWS_WITHIN {
                    Some(LATE_RETRY)
                } else if !call.grow {
                    // Held back by a freeze: settled again once it thaws.
                    Some(self.frozen_for() + WAKE_SLACK)
                } else {
                    None
                };
                self.wake_when_free(id, &division, again);
                return Ok(division);
            }
            taken(&shrunk).await;
        }
    }

    /// When a stream of this replica has less than its share of bucket `id`, settles the bucket
    /// again: once the stream of another replica that holds some of it stops being counted (a
    /// replica that died is not told to shrink); and after `again`, when the call could grow
    /// nothing: held to `GROWS_WITHIN` (it named no server) and took longer, `LATE_RETRY` (a
    /// loaded host, whose calls arrive late while the load lasts: the next call may be quicker,
    /// or name the server its answer named), or held back by a freeze, once it thaws. Its Envoy
    /// gets its grant then, not at its next report. One wake-up at a time per bucket.
    fn wake_when_free(self: &Arc<Self>, id: u128, division: &Division, again: Option<Duration>) {
        // The store's clock, not this one: how long from now, with a little for the two to
        // differ in their reading of the lapse.
        let freed = division.lapse_ms.map(|lapse_ms| {
            Duration::from_millis(lapse_ms.saturating_sub(division.now_ms)) + WAKE_SLACK
        });
        let Some(after) = [freed, again].into_iter().flatten().min() else {
            return;
        };
        // A retry for lateness or a freeze takes a record of `--quota-max-records`, as a
        // report's does: a loaded store is not asked more than that.
        let retry = freed.is_none_or(|freed| freed > after);
        {
            let mut buckets = self.buckets();
            let Some(local) = buckets.get_mut(&id) else {
                return;
            };
            let short = local.subscribers.iter().any(|s| {
                s.divided.is_some()
                    && division
                        .of(&self.stream_id(s.stream))
                        .is_some_and(|g| g.grant < g.share && !settled(g.grant, g.share))
            });
            if !short || local.waking {
                return;
            }
            local.waking = true;
        }
        let quotas = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(local) = quotas.buckets().get_mut(&id) {
                local.waking = false;
            }
            if retry && !quotas.records_left.try_take(false) {
                return;
            }
            if let Some((key, rule)) = quotas.divided(id) {
                quotas.settle_in_background(id, key, rule).await;
            }
        });
    }

    /// How long a stream stays counted in the store without reporting again: three of its
    /// records' intervals (it stays counted until the next), and no less than an assignment
    /// lives (the Envoys of a replica that died keep enforcing theirs that long).
    pub(super) fn stays(&self) -> Duration {
        DEMAND_STAYS
            .max(3 * self.record_every())
            .max(self.settings.ttl)
    }

    /// This replica's streams of bucket `id` in its division, as a settle call lists them: id,
    /// change, demand, what its Envoy may be enforcing and whether the store counted it;
    /// `moving`'s with its change (a stream new to the bucket, or one that left it, holding
    /// nothing).
    pub(super) fn listed(
        &self,
        id: u128,
        moving: Option<BucketMove>,
    ) -> Vec<(String, Change, u64, u64, bool)> {
        let buckets = self.buckets();
        let mut listed: Vec<(String, Change, u64, u64, bool)> = buckets
            .get(&id)
            .map(|local| {
                local
                    .subscribers
                    .iter()
                    .filter(|s| s.divided.is_some())
                    .map(|s| {
                        let (change, demand) = match moving {
                            Some(m) if m.stream == s.stream => (m.change, m.demand),
                            _ => (Change::Keep, s.demand),
                        };
                        (self.stream_id(s.stream), change, demand, s.held, s.known)
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(m) = moving {
            let stream = self.stream_id(m.stream);
            if !listed.iter().any(|(s, ..)| *s == stream) {
                listed.push((stream, m.change, m.demand, 0, false));
            }
        }
        listed
    }

    /// Sends this replica's streams of bucket `id` the grants `division` gave them, where their
    /// assignments change (but a growth of `answering`'s, which its answer carries); the outboxes
    /// a shrink was sent to. A push that finds its stream's outbox full is dropped: the stream's
    /// Envoy is then taken to enforce what it was last sent, until its next answer.
    fn send_grants(
        &self,
        id: u128,
        division: &Division,
        limit: &Limit,
        answering: Option<u64>,
    ) -> Vec<Outbox> {
        let mut buckets = self.buckets();
        let Some(local) = buckets.get_mut(&id) else {
            return Vec::new();
        };
        let mut shrunk = Vec::new();
        for subscriber in local.subscribers.iter_mut() {
            if subscriber.divided.is_none() {
                continue;
            }
            let Some(granted) = division.of(&self.stream_id(subscriber.stream)) else {
                continue;
            };
            subscriber.known = true;
            if granted.waiting() {
                continue;
            }
            let grant = granted.grant;
            let assignment = Assignment::share(grant, limit);
            let shrinks = grant < subscriber.held;
            let pushed = if subscriber.shadow
                || assignment == subscriber.sent
                || (answering == Some(subscriber.stream) && !shrinks)
            {
                true
            } else {
                self.push(subscriber, assignment)
            };
            if pushed {
                subscriber.sent = assignment;
                subscriber.share = Some(grant);
                subscriber.held = grant;
                if shrinks {
                    shrunk.push(subscriber.outbox.clone());
                }
            }
        }
        shrunk
    }
}

/// Waits until the connections of `outboxes` have taken what was pushed to them, for at most
/// `TAKEN_WITHIN`: a shrink is then on its way to its Envoy before what it frees is given to
/// another.
pub(super) async fn taken(outboxes: &[Outbox]) {
    let start = Instant::now();
    while outboxes
        .iter()
        .any(|o| !o.is_closed() && o.capacity() < o.max_capacity())
        && start.elapsed() < TAKEN_WITHIN
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
