//! A stream's buckets, from subscription to departure: whether a new one can be tracked, its
//! fixed answer or its division, what it keeps while the store cannot answer, and leaving the
//! division when abandoned or when the stream ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use prost::Message;

use super::assignment::assign;
use super::bounds::FullBound;
use super::replica::{BucketMove, LocalStreams, Subscriber};
use super::stream::ReportStep;
use super::tally::Tally;
use super::{
    Assignment, MOST_BUCKET_BYTES_PER_STREAM, MOST_BUCKETS_PER_STREAM, ONE_SECOND, QuotaStream,
    RECORDS_IN_FLIGHT, REPORT_INTERVAL, demand, fixed_answer,
};
use sluice_core::limiter::share::MILLI;
use sluice_core::limiter::{CounterKey, IdHasher};
use sluice_core::rules::QuotaRule;
use sluice_core::store::Change;

impl QuotaStream {
    /// Whether a bucket new to the stream, with `size` bytes of id, can be tracked: the stream is
    /// counted among the tracked streams, within its own bounds, and a bucket is left in its
    /// client's budget and in the process's allowance (taken here). Else the tally counts the
    /// bound that was full.
    pub(super) fn room_for(&self, size: usize, tally: &mut Tally) -> bool {
        let full = if let Err(bound) = self.counted {
            bound
        } else if self.buckets.len() >= MOST_BUCKETS_PER_STREAM
            || self.held_bytes + size > MOST_BUCKET_BYTES_PER_STREAM
        {
            FullBound::StreamBuckets
        } else if !self.quotas.clients.take_bucket(self.client) {
            FullBound::ClientBuckets
        } else if self.quotas.tracked_buckets.take() {
            return true;
        } else {
            self.quotas.clients.give_back(self.client, 0, 1);
            FullBound::Buckets
        };
        tally.untracked(full);
        false
    }

    /// The assignment of a bucket whose answer needs no division: unmatched, unlimited, a limit
    /// of 0, or untracked (denied: its limit may be divided among other streams, on any replica,
    /// which this one cannot take part in; allowed in shadow mode, which denies nothing).
    pub(super) fn fixed(&self, step: &ReportStep) -> Option<Assignment> {
        let rule = step.rule.as_deref();
        fixed_answer(self.quotas.settings.unmatched, rule).or(match rule {
            Some(rule) if !step.tracked && rule.shadow => Some(Assignment::AllowAll),
            Some(_) if !step.tracked => Some(Assignment::DenyAll),
            _ => None,
        })
    }

    /// Records this stream's demand for a shared bucket and settles the bucket: this stream's
    /// grant (none while it waits for others to free its share), and new grants sent to the
    /// others on this replica. When the store cannot answer, the stream keeps what it was last
    /// sent, and so it does when its record is not due (`--quota-max-records`).
    pub(super) async fn divide(
        &self,
        mut step: ReportStep,
        requests: u64,
    ) -> (ReportStep, Option<Assignment>, bool) {
        let rule = step.rule.clone().expect("a shared bucket has a rule");
        let limit = rule.limit.as_ref().expect("a shared bucket has a limit");
        let total = u64::from(limit.requests_per_unit);
        let window = Duration::from_millis(limit.window_ms());
        // A new subscriber, whose demand is not known yet, counts as wanting all of it, unless
        // its first report says it had no request: it is idle, and wants nothing.
        let wanted = match step.elapsed {
            Some(elapsed) => demand(requests, elapsed, window, total),
            None if requests == 0 => 0,
            None => total * MILLI,
        };
        let now = Instant::now();
        let every = self.quotas.record_every();
        // Due once `every` has passed (give or take half a report), if the budget has a record
        // left; and always before the last record stops being counted (with two reports to
        // spare). A bucket not recorded yet waits for the budget as the others do: meanwhile it
        // is not answered, as while the store is down.
        let lapsing = step
            .recorded
            .is_some_and(|(_, until)| now + 2 * REPORT_INTERVAL >= until);
        let due = lapsing
            || step.recorded.is_none_or(|(at, _)| {
                now.saturating_duration_since(at) + REPORT_INTERVAL / 2 >= every
            });
        let due = due && self.quotas.records_left.try_take(lapsing);
        let stays = self.quotas.stays();
        let share = if due {
            self.enlist(&step, &rule, wanted, total * MILLI);
            let moving = BucketMove {
                stream: self.number,
                change: Change::Report,
                demand: wanted,
            };
            let settled = self
                .quotas
                .settle(step.id, &step.key, &rule, Some(moving), Some(self.number))
                .await;
            match settled {
                Ok(division) => {
                    step.recorded = Some((now, now + stays));
                    match division.of(&self.id) {
                        Some(granted) if granted.waiting() => None,
                        granted => {
                            let grant = granted.map_or(0, |g| g.grant);
                            Some((Assignment::share(grant, limit), Some(grant)))
                        }
                    }
                }
                Err(e) => {
                    self.quotas.failed_settle(&e);
                    // Renewed only while its last record stays counted: past that, the other
                    // replicas, which may reach the store when this one does not, may give its
                    // share away, and its Envoy falls back to its own behaviour.
                    let left = step.recorded.map_or(Duration::ZERO, |(_, until)| {
                        until.saturating_duration_since(now)
                    });
                    step.lives = Some(left);
                    if left >= ONE_SECOND {
                        self.kept(step.id)
                    } else {
                        None
                    }
                }
            }
        } else {
            // Its grant is counted in the store only until its record lapses: its Envoy must not
            // enforce it longer (a replica that dies sends no more).
            step.lives = step
                .recorded
                .map(|(_, until)| until.saturating_duration_since(now).max(ONE_SECOND));
            self.kept(step.id)
        };
        let Some((share, milli)) = share else {
            return (step, None, rule.shadow);
        };
        if let (Some(elapsed), true) = (step.elapsed, rule.shadow) {
            let admissible = share.rate().unwrap_or(f64::INFINITY) * elapsed.as_secs_f64();
            let over = step.allowed as f64 - admissible;
            if over >= 1.0 {
                self.quotas
                    .telemetry
                    .quota_shadow_denied(&step.labels, over as u64);
            }
        }
        self.subscribe(&step, share, milli, rule.shadow);
        let shadow = rule.shadow;
        (step, Some(share), shadow)
    }

    /// What a bucket gets while the store cannot answer (as long as its last record stays
    /// counted), or before its first record is due: what this stream was last sent, or nothing
    /// when it was sent no share yet. A bucket new to
    /// the stream is granted nothing the store has not counted: its Envoy applies the filter's
    /// `no_assignment_behavior` meanwhile, as it does before any first answer.
    pub(super) fn kept(&self, id: u128) -> Option<(Assignment, Option<u64>)> {
        let buckets = self.quotas.buckets();
        let subscriber = buckets
            .get(&id)?
            .subscribers
            .iter()
            .find(|s| s.stream == self.number)?;
        subscriber.share.map(|share| (subscriber.sent, Some(share)))
    }

    /// Makes the stream take part in the division of a bucket of `total` thousandths with its
    /// demand `demand`: listed in the next settle call, holding what it was last sent (nothing,
    /// when new to it).
    fn enlist(&self, step: &ReportStep, rule: &Arc<QuotaRule>, demand: u64, total: u64) {
        let mut buckets = self.quotas.buckets();
        let (subscriber, new) = self.subscriber(&mut buckets, step);
        if new {
            subscriber.shadow = rule.shadow;
        } else if subscriber.divided.is_none() {
            // It was sent a fixed assignment, which may be the whole limit or more.
            subscriber.held = total;
        }
        subscriber.divided = Some(rule.clone());
        subscriber.demand = demand;
    }

    /// Remembers what the stream was sent for a bucket, for pushes and for store outages.
    pub(super) fn subscribe(
        &self,
        step: &ReportStep,
        sent: Assignment,
        share: Option<u64>,
        shadow: bool,
    ) {
        let mut buckets = self.quotas.buckets();
        let (subscriber, _) = self.subscriber(&mut buckets, step);
        subscriber.labels = step.labels.clone();
        subscriber.sent = sent;
        subscriber.share = share;
        subscriber.shadow = shadow;
        subscriber.held = subscriber.held.max(share.unwrap_or(0));
    }

    /// The stream's subscription to `step`'s bucket, and whether it is new: then sent nothing,
    /// out of the division and holding nothing.
    pub(super) fn subscriber<'a>(
        &self,
        buckets: &'a mut HashMap<u128, LocalStreams, IdHasher>,
        step: &ReportStep,
    ) -> (&'a mut Subscriber, bool) {
        let local = buckets.entry(step.id).or_insert_with(|| LocalStreams {
            key: step.key.clone(),
            domain: self.domain.as_str().into(),
            subscribers: Vec::with_capacity(1),
            waking: false,
        });
        let at = local
            .subscribers
            .iter()
            .position(|s| s.stream == self.number);
        match at {
            Some(at) => (&mut local.subscribers[at], false),
            None => {
                // Most buckets have one subscriber: no room for more until there is one.
                local.subscribers.reserve_exact(1);
                local.subscribers.push(Subscriber {
                    stream: self.number,
                    outbox: self.outbox.clone(),
                    bucket_id: step.bucket_id.encode_to_vec().into(),
                    labels: step.labels.clone(),
                    sent: Assignment::DenyAll,
                    share: None,
                    shadow: false,
                    divided: None,
                    demand: 0,
                    held: 0,
                    known: false,
                });
                let last = local.subscribers.len() - 1;
                (&mut local.subscribers[last], true)
            }
        }
    }

    /// The answer for one bucket, counted.
    pub(super) fn action(
        &self,
        step: &ReportStep,
        assignment: Assignment,
        tally: &mut Tally,
    ) -> Bytes {
        tally.action(&step.labels, assignment.name());
        let ttl = self.quotas.settings.ttl;
        assign(
            step.bucket_id.clone(),
            assignment,
            step.lives.map_or(ttl, |lives| lives.min(ttl)),
        )
    }

    /// Forgets a bucket the stream is told to abandon.
    pub(super) async fn abandon(&mut self, key: &CounterKey, id: u128) {
        if let Some(held) = self.buckets.remove(key) {
            self.held_bytes -= held.size;
            self.quotas.tracked_buckets.give_back(1);
            self.quotas.clients.give_back(self.client, 0, 1);
        }
        let divided = self.unsubscribe(id).and_then(|s| s.divided);
        if let Some(rule) = divided {
            self.leave_division(key, id, &rule).await;
        }
    }

    /// Takes the stream off bucket `id` on this replica: what it was subscribed as.
    fn unsubscribe(&self, id: u128) -> Option<Subscriber> {
        let mut buckets = self.quotas.buckets();
        let local = buckets.get_mut(&id)?;
        let at = local
            .subscribers
            .iter()
            .position(|s| s.stream == self.number)?;
        let subscriber = local.subscribers.swap_remove(at);
        if local.subscribers.is_empty() {
            buckets.remove(&id);
        }
        Some(subscriber)
    }

    /// Takes the stream out of a bucket's division (`rule`'s), in the store and on this replica:
    /// its grant goes to the others at once.
    pub(super) async fn leave_division(&self, key: &CounterKey, id: u128, rule: &QuotaRule) {
        if let Some(subscriber) = self
            .quotas
            .buckets()
            .get_mut(&id)
            .and_then(|l| l.subscribers.iter_mut().find(|s| s.stream == self.number))
        {
            subscriber.divided = None;
            subscriber.known = false;
        }
        self.quotas.leave(id, key, rule, self.number).await;
    }

    /// At the stream's end: its buckets leave the division, so that the Envoy's next stream (on
    /// this replica or another) is not counted twice and the others get its grants; then what it
    /// tracked is given back.
    pub(super) async fn leave(self) {
        let mut shared = Vec::new();
        for key in self.buckets.keys() {
            let id = self.quotas.ids.id(key, 0);
            if let Some(rule) = self.unsubscribe(id).and_then(|s| s.divided) {
                shared.push((key, id, rule));
            }
        }
        let this = &self;
        futures_util::stream::iter(shared)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(key, id, rule)| async move {
                this.leave_division(key, id, &rule).await;
            })
            .await;
        self.quotas.tracked_buckets.give_back(self.buckets.len());
        if self.counted.is_ok() {
            self.quotas.tracked_streams.give_back(1);
            self.quotas
                .clients
                .give_back(self.client, 1, self.buckets.len());
        }
    }
}
