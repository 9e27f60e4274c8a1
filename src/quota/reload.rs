//! Reloads: every bucket divided here whose rule a reload changed is settled again by the new
//! rule, or, when the rule no longer divides it, sent its fixed answer and taken out of the
//! division, without waiting for reports.

use std::sync::Arc;

use arc_swap::ArcSwap;
use futures_util::StreamExt;
use prost::Message;

use super::assignment::sorted_entries;
use super::{Assignment, Quotas, RECORDS_IN_FLIGHT, RULES_READ, fixed_answer};
use crate::pb::envoy::service::rate_limit_quota::v3::BucketId;
use sluice_core::limiter::CounterKey;
use sluice_core::rules::{QuotaRule, RuleSet};

impl Quotas {
    /// Re-divides, for as long as the process runs, every bucket whose rule a reload changed
    /// (`rules` is read every `RULES_READ`), without waiting for reports.
    pub async fn follow(self: Arc<Self>, rules: Arc<ArcSwap<RuleSet>>) {
        let mut divided_by = rules.load_full();
        loop {
            tokio::time::sleep(RULES_READ).await;
            let now = rules.load_full();
            if !Arc::ptr_eq(&now, &divided_by) {
                self.redivide(&now).await;
                divided_by = now;
            }
        }
    }

    /// Moves every bucket divided here whose rule `rules` changes, without waiting for reports.
    /// A rule that still divides it (a new limit, unit, window or shadow mode) settles it again
    /// by the new rule: a shrink reaches the streams at once, and so does a new unit. A rule that
    /// no longer divides it (removed, unlimited, a limit of 0) sends its streams their fixed
    /// answer at once and takes them out of the division, which frees their grants.
    async fn redivide(self: &Arc<Self>, rules: &RuleSet) {
        let moved = self.moved_by(rules);
        let (settling, leaving) = self.move_subscribers(moved);
        futures_util::stream::iter(settling)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule)| {
                self.settle_in_background(id, key, rule)
            })
            .await;
        futures_util::stream::iter(leaving)
            .for_each_concurrent(RECORDS_IN_FLIGHT, |(id, key, rule, stream)| async move {
                self.leave(id, &key, &rule, stream).await;
            })
            .await;
    }

    /// The buckets divided here that `rules` moves, each with the rule it was divided by: the
    /// buckets are copied out of the lock the streams take, then matched.
    fn moved_by(&self, rules: &RuleSet) -> Vec<(u128, Arc<QuotaRule>, Moved)> {
        let divided: Vec<Divided> = self
            .buckets()
            .iter()
            .filter_map(|(&id, local)| {
                let subscriber = local.subscribers.iter().find(|s| s.divided.is_some())?;
                Some(Divided {
                    id,
                    domain: local.domain.clone(),
                    bucket_id: subscriber.bucket_id.clone(),
                    rule: subscriber.divided.clone()?,
                })
            })
            .collect();
        let mut moved = Vec::new();
        for Divided {
            id,
            domain,
            bucket_id,
            rule: old,
        } in divided
        {
            let Ok(bucket_id) = BucketId::decode(&*bucket_id) else {
                continue;
            };
            let entries = sorted_entries(&bucket_id);
            let new = rules.quota_rule(domain.as_bytes(), &entries);
            let now = match (
                fixed_answer(self.settings.unmatched, new.map(|r| &**r)),
                new,
            ) {
                (Some(assignment), _) => Moved::Fixed(assignment),
                (None, Some(new))
                    if new.limit != old.limit
                        || new.path != old.path
                        || new.shadow != old.shadow =>
                {
                    Moved::Settle(new.clone())
                }
                (None, _) => continue,
            };
            moved.push((id, old, now));
        }
        moved
    }

    /// Moves the subscribers of the buckets `moved`: to the new rule (to be settled again by
    /// it), or to their fixed answer, sent at once (to leave the division).
    fn move_subscribers(
        &self,
        moved: Vec<(u128, Arc<QuotaRule>, Moved)>,
    ) -> (Vec<Settling>, Vec<Leaving>) {
        let mut settling = Vec::new();
        let mut leaving = Vec::new();
        let mut buckets = self.buckets();
        for (id, old, now) in moved {
            let Some(local) = buckets.get_mut(&id) else {
                continue;
            };
            let divided = local.subscribers.iter_mut().filter(|s| s.divided.is_some());
            match now {
                Moved::Settle(rule) => {
                    for subscriber in divided {
                        if rule.shadow && !subscriber.shadow {
                            self.push(subscriber, Assignment::AllowAll);
                        } else if !rule.shadow && subscriber.shadow {
                            // Its Envoy allows all: its grant is sent once settled.
                            subscriber.sent = Assignment::AllowAll;
                        }
                        subscriber.shadow = rule.shadow;
                        subscriber.divided = Some(rule.clone());
                    }
                    settling.push((id, local.key.clone(), rule));
                }
                Moved::Fixed(assignment) => {
                    for subscriber in divided {
                        self.push(subscriber, assignment);
                        subscriber.sent = assignment;
                        subscriber.share = None;
                        subscriber.shadow = false;
                        subscriber.divided = None;
                        subscriber.known = false;
                        subscriber.held = 0;
                        leaving.push((id, local.key.clone(), old.clone(), subscriber.stream));
                    }
                }
            }
        }
        (settling, leaving)
    }
}

/// A bucket divided here, copied out to be matched outside the lock the streams take.
struct Divided {
    id: u128,
    domain: Box<str>,
    bucket_id: Box<[u8]>,
    rule: Arc<QuotaRule>,
}

/// What a reload does to a bucket.
enum Moved {
    Settle(Arc<QuotaRule>),
    Fixed(Assignment),
}

/// A bucket to settle again by its new rule.
type Settling = (u128, CounterKey, Arc<QuotaRule>);
/// A stream leaving the division of a bucket, with the rule it was divided by.
type Leaving = (u128, CounterKey, Arc<QuotaRule>, u64);
