//! One Envoy's stream: its reports, each bucket matched to its rule and answered at once (or, when
//! its share is held by others, once it has some), a few hundred buckets at a time, and its
//! departure.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::assignment::{encode, sorted_entries};
use super::bounds::{FullBound, client_of};
use super::tally::Tally;
use super::{Assignment, BUCKETS_AT_A_TIME, ONE_SECOND, OUTBOX, Quotas, RECORDS_IN_FLIGHT};
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action,
};
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use crate::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::telemetry::metrics::{QuotaLabels, UNKNOWN_DOMAIN};
use sluice_core::config::{MOST_DOMAIN_BYTES, domain_too_long};
use sluice_core::limiter::{CounterKey, DescriptorKey};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::rules::{QuotaRule, RuleSet};

/// An answer on its way to a stream's Envoy.
pub type Answer = Result<RateLimitQuotaResponse, Status>;
/// Where a stream's answers wait for its connection.
pub type Outbox = mpsc::Sender<Answer>;

/// One Envoy's stream.
pub struct QuotaStream {
    /// Its name in the store, unique across replicas.
    pub(super) id: String,
    /// Its number among this replica's streams.
    pub(super) number: u64,
    pub(super) quotas: Arc<Quotas>,
    pub(super) rules: Arc<ArcSwap<RuleSet>>,
    pub(super) outbox: Outbox,
    /// The domain the stream reports for: Envoy names it in every report, gRPC's clients only in
    /// the first.
    pub(super) domain: String,
    /// The client it comes from, whose budgets it counts in.
    pub(super) client: IpAddr,
    /// Counted among the tracked streams of its client and of the process, or the bound that
    /// kept it out (tried again at each report); until it is counted, every bucket it reports is
    /// answered untracked.
    pub(super) counted: Result<(), FullBound>,
    pub(super) buckets: HashMap<CounterKey, HeldBucket>,
    /// The bytes of the ids of `buckets`.
    pub(super) held_bytes: usize,
}

/// A bucket a stream holds.
pub(super) struct HeldBucket {
    /// When it was last reported, on sluice's clock (Envoy's own `time_elapsed` is in whole
    /// seconds, and 0 on the first report).
    pub(super) reported: Instant,
    /// Reports of nothing in a row.
    pub(super) idle: u32,
    /// It takes part in the division (its demand is in the store).
    pub(super) shared: bool,
    /// The bytes of its id.
    pub(super) size: usize,
    /// When its demand was last recorded in the store, and until when that record stays counted.
    pub(super) recorded: Option<(Instant, Instant)>,
}

/// What one report of one bucket comes to before the store is asked.
pub(super) struct ReportStep {
    pub(super) key: CounterKey,
    /// The keyed hash of `key`, which indexes the bucket's subscribers.
    pub(super) id: u128,
    pub(super) bucket_id: BucketId,
    pub(super) labels: Arc<QuotaLabels>,
    pub(super) rule: Option<Arc<QuotaRule>>,
    pub(super) allowed: u64,
    pub(super) elapsed: Option<Duration>,
    pub(super) tracked: bool,
    /// When its demand was last recorded, and until when that record stays counted.
    pub(super) recorded: Option<(Instant, Instant)>,
    /// How long its answer may live when shorter than an assignment: what its record has left,
    /// when it is answered without a record (none due) and the store is counting it.
    pub(super) lives: Option<Duration>,
}

impl QuotaStream {
    /// A stream from the client at `peer` that a quota stream's connection opened, and where
    /// its answers come out.
    pub fn open(
        quotas: &Arc<Quotas>,
        rules: Arc<ArcSwap<RuleSet>>,
        peer: Option<IpAddr>,
    ) -> (QuotaStream, mpsc::Receiver<Answer>) {
        let (outbox, answers) = mpsc::channel(OUTBOX);
        let number = quotas.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = QuotaStream {
            id: quotas.stream_id(number),
            number,
            client: client_of(peer),
            quotas: quotas.clone(),
            rules,
            outbox,
            domain: String::new(),
            counted: Err(FullBound::Streams),
            buckets: HashMap::new(),
            held_bytes: 0,
        };
        (stream, answers)
    }

    /// Answers the stream's `reports` until they end, its Envoy takes no answers, or `stop`
    /// comes; then takes it out of every division.
    pub async fn run(
        mut self,
        mut reports: Streaming<RateLimitQuotaUsageReports>,
        stop: impl Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        loop {
            let report = tokio::select! {
                report = reports.message() => report,
                () = &mut stop => break,
                () = self.outbox.closed() => break,
            };
            match report {
                Ok(Some(report)) => {
                    if !self.on_report(report).await {
                        break;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.leave().await;
    }

    /// Answers a report; false when its Envoy takes no answers (see `answer`).
    async fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> bool {
        if report.domain.len() > MOST_DOMAIN_BYTES {
            let refused = Status::invalid_argument(domain_too_long(report.domain.len()));
            let _ = self.outbox.try_send(Err(refused));
            return false;
        }
        if !report.domain.is_empty() {
            self.domain = report.domain;
        }
        // A stream past a bound on streams is counted once another has left.
        if self.counted.is_err() {
            self.counted = self.quotas.count_stream(self.client);
        }
        let rules = self.rules.load_full();
        // Series are named by the rule files only: a domain without rules is not named.
        let domain_label = if rules.has_domain(self.domain.as_bytes()) {
            self.domain.clone()
        } else {
            UNKNOWN_DOMAIN.to_owned()
        };
        let mut tally = Tally::new(domain_label);
        let mut usages = report.bucket_quota_usages.into_iter();
        let mut answered = true;
        while answered && usages.len() > 0 {
            let some: Vec<Bytes> = usages.by_ref().take(BUCKETS_AT_A_TIME).collect();
            // Past `--quota-max-reports` the stream waits, reading no further report meanwhile:
            // HTTP/2 flow control keeps its Envoy's next reports at the Envoy.
            if let Some(at) = self.quotas.reports_left.take(some.len()) {
                static PACED: LogThrottle = LogThrottle::new();
                self.quotas.telemetry.quota_paced(some.len() as u64);
                if let Some(n) = PACED.hit() {
                    tracing::warn!(
                        "quota streams report more buckets than --quota-max-reports a second: \
                         they wait their turn ({n} time(s) since the last report)"
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {}
                    () = self.outbox.closed() => return false,
                }
            }
            answered = self.answer(some, &rules, &mut tally).await;
            // The other streams have their turn.
            tokio::task::yield_now().await;
        }
        answered
    }

    /// Handles some buckets of a report (each as it came on the wire: they are decoded one at a
    /// time), and answers them in one message. False when the answer waited for room in the
    /// outbox for as long as an assignment lives: Envoy takes its answers at once, so its
    /// assignments have expired anyway, and the stream is ended rather than held.
    pub(super) async fn answer(
        &mut self,
        usages: Vec<Bytes>,
        rules: &RuleSet,
        tally: &mut Tally,
    ) -> bool {
        let now = Instant::now();
        let mut actions = Vec::with_capacity(usages.len());
        let mut shared = Vec::new();
        let mut abandoned = Vec::new();
        for usage in usages {
            let Some((step, requests, idle)) = self.step_of(usage, rules, tally, now) else {
                continue;
            };
            if step.tracked && idle >= self.quotas.settings.abandon_after {
                tally.action(&step.labels, "abandon");
                actions.push(encode(BucketAction {
                    bucket_id: Some(step.bucket_id),
                    bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                }));
                abandoned.push((step.key, step.id));
                continue;
            }
            match self.answer_fixed(&step).await {
                Some(assignment) => actions.push(self.action(&step, assignment, tally)),
                None => shared.push((step, requests)),
            }
        }
        let divided: Vec<(ReportStep, Option<Assignment>, bool)> =
            futures_util::stream::iter(shared)
                .map(|(step, requests)| self.divide(step, requests))
                .buffer_unordered(RECORDS_IN_FLIGHT)
                .collect()
                .await;
        for (step, _, _) in &divided {
            if let Some(held) = self.buckets.get_mut(&step.key) {
                held.recorded = step.recorded;
            }
        }
        let answered = match self.respond(&divided, actions, tally) {
            Respond::Nothing => return true,
            Respond::Sent => true,
            Respond::Late(response) => {
                let waited = self.outbox.send(response);
                tokio::time::timeout(self.quotas.settings.ttl, waited)
                    .await
                    .is_ok()
            }
        };
        // An abandoned bucket's grant is freed once the abandon is on its way, not before: until
        // its Envoy has it, that Envoy enforces the grant.
        for (key, id) in abandoned {
            self.abandon(&key, id).await;
        }
        answered
    }

    /// The step of one bucket's `usage` (skipped when it does not decode or has no bucket id),
    /// counted in `tally` and tracked if there is room; with the requests it reports and how many
    /// reports in a row it has been idle.
    fn step_of(
        &mut self,
        usage: Bytes,
        rules: &RuleSet,
        tally: &mut Tally,
        now: Instant,
    ) -> Option<(ReportStep, u64, u32)> {
        let usage = BucketQuotaUsage::decode(usage).ok()?;
        let bucket_id = usage.bucket_id.filter(|b| !b.bucket.is_empty())?;
        let entries = sorted_entries(&bucket_id);
        let rule = rules.quota_rule(self.domain.as_bytes(), &entries).cloned();
        let as_bytes: Vec<(&[u8], &[u8])> =
            entries.iter().map(|(k, v)| (k.as_bytes(), *v)).collect();
        let key = DescriptorKey::new(self.domain.as_bytes(), &as_bytes).counter("rlqs");
        let labels = tally.labels(rule.as_deref());
        let (allowed, denied) = (usage.num_requests_allowed, usage.num_requests_denied);
        tally.reported(&labels, allowed, denied);
        let size = bucket_id
            .bucket
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>();
        let tracked = self.buckets.contains_key(&key) || self.room_for(size, tally);
        let (elapsed, idle) = self.track(&key, tracked, size, allowed == 0 && denied == 0, now);
        let id = self.quotas.ids.id(&key, 0);
        let recorded = self.buckets.get(&key).and_then(|held| held.recorded);
        let step = ReportStep {
            key,
            id,
            bucket_id,
            labels,
            rule,
            allowed,
            elapsed,
            tracked,
            recorded,
            lives: None,
        };
        Some((step, allowed.saturating_add(denied), idle))
    }

    /// Notes a report of the bucket `key` at `now` (`idle`: it reported no request), tracking it
    /// from now if `tracked` and new: how long since its last report, and how many reports in a
    /// row it has been idle.
    fn track(
        &mut self,
        key: &CounterKey,
        tracked: bool,
        size: usize,
        idle: bool,
        now: Instant,
    ) -> (Option<Duration>, u32) {
        match self.buckets.get_mut(key) {
            Some(held) => {
                let elapsed = now.saturating_duration_since(held.reported);
                held.reported = now;
                held.idle = if idle { held.idle + 1 } else { 0 };
                (Some(elapsed), held.idle)
            }
            None => {
                if tracked {
                    self.held_bytes += size;
                    self.buckets.insert(
                        key.clone(),
                        HeldBucket {
                            reported: now,
                            idle: 0,
                            shared: false,
                            size,
                            recorded: None,
                        },
                    );
                }
                (None, 0)
            }
        }
    }

    /// The fixed assignment of `step`'s bucket when its rule does not divide it, subscribed with
    /// it (out of the division it was in, after a reload); `None` for a bucket divided.
    async fn answer_fixed(&mut self, step: &ReportStep) -> Option<Assignment> {
        let fixed = self.fixed(step);
        let was_shared = self.buckets.get_mut(&step.key).map(|held| {
            let was = held.shared;
            held.shared = fixed.is_none();
            if !held.shared {
                // Out of the division, its record is taken out: the next is due at once.
                held.recorded = None;
            }
            was
        });
        let assignment = fixed?;
        if let Some(was_shared) = was_shared {
            // A rule that stopped dividing this bucket (a reload): out of the division.
            let rule = self
                .quotas
                .buckets()
                .get(&step.id)
                .and_then(|l| l.subscribers.iter().find(|s| s.stream == self.number))
                .and_then(|s| s.divided.clone());
            if let (true, Some(rule)) = (was_shared, rule) {
                self.leave_division(&step.key, step.id, &rule).await;
            }
            self.subscribe(step, assignment, None, false);
        }
        Some(assignment)
    }

    /// Sends `actions` and the answer of each `divided` bucket: the latest share this stream
    /// got, its own or one pushed by a later division, and none while it waits for one. Pushes
    /// go out under the same lock, so the Envoy gets shares in the order they were decided.
    fn respond(
        &self,
        divided: &[(ReportStep, Option<Assignment>, bool)],
        mut actions: Vec<Bytes>,
        tally: &mut Tally,
    ) -> Respond {
        let buckets = self.quotas.buckets();
        for (step, share, shadow) in divided {
            if step.lives.is_some_and(|lives| lives < ONE_SECOND) {
                // Its record has lapsed in the store: nothing more to renew.
                continue;
            }
            let latest = buckets
                .get(&step.id)
                .and_then(|local| local.subscribers.iter().find(|s| s.stream == self.number))
                .filter(|s| s.share.is_some())
                .map(|s| s.sent)
                .or(*share);
            let answer = match latest {
                _ if *shadow => Assignment::AllowAll,
                Some(latest) => latest,
                None => continue,
            };
            actions.push(self.action(step, answer, tally));
        }
        tally.count(&self.quotas.telemetry);
        if actions.is_empty() {
            return Respond::Nothing;
        }
        let response = RateLimitQuotaResponse {
            bucket_action: actions,
        };
        match self.outbox.try_send(Ok(response)) {
            Err(mpsc::error::TrySendError::Full(response)) => Respond::Late(response),
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => Respond::Sent,
        }
    }
}

/// How an answer went out.
enum Respond {
    /// There was nothing to answer.
    Nothing,
    /// Sent (or the stream is gone).
    Sent,
    /// To send once the outbox has room.
    Late(Answer),
}
