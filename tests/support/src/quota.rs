//! The Rate Limit Quota Service driven by hand, as one Envoy drives its stream: reports of
//! buckets, and the assignments they get, checked for the shapes Envoy 1.40 enforces.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use futures_util::StreamExt as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use super::Sluice;

/// How long an answer may take to come.
pub const PATIENCE: Duration = Duration::from_secs(15);

/// One Envoy's stream, driven by hand.
pub struct QuotaStream {
    pub reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    pub answers: Streaming<RateLimitQuotaResponse>,
    domain: String,
}

impl QuotaStream {
    /// Opens a stream reporting for `domain`.
    pub async fn open(sluice: &Sluice, domain: &str) -> QuotaStream {
        QuotaStream::open_on(sluice.channel().await, domain).await
    }

    /// Opens a stream reporting for `domain` on `channel`.
    pub async fn open_on(channel: tonic::transport::Channel, domain: &str) -> QuotaStream {
        let mut client = RateLimitQuotaServiceClient::new(channel);
        let (reports, outgoing) = mpsc::channel(16);
        let answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(outgoing))
            .await
            .expect("the quota stream opens")
            .into_inner();
        QuotaStream {
            reports,
            answers,
            domain: domain.to_owned(),
        }
    }

    /// Reports `allowed` and `denied` requests of each bucket, as Envoy does every 5 s.
    pub async fn report(&self, buckets: &[(&BucketId, u64, u64)]) {
        let usages = buckets
            .iter()
            .map(|(id, allowed, denied)| BucketQuotaUsage {
                bucket_id: Some((*id).clone()),
                time_elapsed: Some(ProtoDuration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: *allowed,
                num_requests_denied: *denied,
            })
            .collect();
        self.reports
            .send(RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: usages,
            })
            .await
            .expect("the stream takes reports");
    }

    /// The next answer, within `PATIENCE`.
    pub async fn answer(&mut self) -> RateLimitQuotaResponse {
        tokio::time::timeout(PATIENCE, self.answers.message())
            .await
            .expect("sluice answers in time")
            .expect("the stream stays up")
            .expect("the stream is not ended")
    }

    /// Reports `allowed`/`denied` for one bucket and returns what it is assigned.
    pub async fn ask(&mut self, id: &BucketId, allowed: u64, denied: u64) -> Strategy {
        self.report(&[(id, allowed, denied)]).await;
        only(&self.answer().await, id)
    }

    /// Whether an answer comes within `wait`.
    pub async fn quiet_for(&mut self, wait: Duration) -> bool {
        tokio::time::timeout(wait, self.answers.message())
            .await
            .is_err()
    }
}

pub fn bucket(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// The strategy assigned to `id`, the only bucket of `answer`, checking the assignment's shape:
/// the bucket id echoed exactly and a whole-second time to live.
pub fn only(answer: &RateLimitQuotaResponse, id: &BucketId) -> Strategy {
    assert_eq!(answer.bucket_action.len(), 1, "{answer:?}");
    let action = &answer.bucket_action[0];
    assert_eq!(
        action.bucket_id.as_ref(),
        Some(id),
        "the bucket id is echoed"
    );
    match &action.bucket_action {
        Some(Action::QuotaAssignmentAction(a)) => {
            let ttl = a
                .assignment_time_to_live
                .expect("a time to live is always set");
            assert!(
                ttl.seconds >= 1 && ttl.nanos == 0,
                "Envoy 1.40 reads whole seconds of the TTL, and treats none as 0: {ttl:?}"
            );
            a.rate_limit_strategy
                .as_ref()
                .and_then(|s| s.strategy)
                .expect("a strategy is always set")
        }
        other => panic!("expected an assignment, got {other:?}"),
    }
}

/// A token bucket's share of the limit, in whole requests per window of `window_seconds`,
/// checking the shape Envoy 1.40 enforces: `tokens_per_fill` set, a whole-second fill interval
/// of at least 1 s, and at least one token held.
pub fn tokens(strategy: &Strategy, window_seconds: i64) -> u32 {
    let per_window = share(strategy, window_seconds);
    assert_eq!(per_window.fract(), 0.0, "a whole share: {per_window}");
    per_window as u32
}

/// A token bucket's share of the limit per window of `window_seconds`, checked as `tokens` does.
pub fn share(strategy: &Strategy, window_seconds: i64) -> f64 {
    let Strategy::TokenBucket(bucket) = strategy else {
        panic!("expected a token bucket, got {strategy:?}");
    };
    let per_fill = bucket
        .tokens_per_fill
        .as_ref()
        .expect("tokens_per_fill is always set: Envoy 1.40 reads it unset as 0, never refilling")
        .value;
    let fill = bucket.fill_interval.expect("a fill interval");
    assert!(
        fill.seconds >= 1 && fill.nanos == 0,
        "Envoy 1.40 reads a sub-second fill interval as 0 s, no limit at all: {fill:?}"
    );
    assert!(
        bucket.max_tokens >= 1,
        "a bucket holding nothing denies all"
    );
    (f64::from(per_fill) * window_seconds as f64 / fill.seconds as f64 * 1000.0).round() / 1000.0
}

pub fn blanket(strategy: &Strategy) -> BlanketRule {
    match strategy {
        Strategy::BlanketRule(rule) => BlanketRule::try_from(*rule).expect("a known rule"),
        other => panic!("expected a blanket rule, got {other:?}"),
    }
}

/// Streams that report the same many buckets over and over, as fast as sluice takes them, each
/// reading its answers, until dropped.
pub struct Flood {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    answered: Arc<AtomicU64>,
    /// Ends every stream's reports when dropped.
    _stop: tokio::sync::watch::Sender<()>,
}

impl Flood {
    /// `streams` streams of `domain` to sluice's gRPC address `grpc`, each on a connection of its
    /// own (as each Envoy has), on the calling runtime; stream
    /// `s` reporting the buckets `{name: per-tenant, tenant: s<s>-<b>}` for `b` below `buckets`
    /// in every report, each tenant value padded with `x` to `value_bytes`; every `pace` (as
    /// Envoy reports every 5 s), or else as fast as sluice takes them.
    pub async fn start(
        grpc: std::net::SocketAddr,
        domain: &str,
        (streams, buckets, value_bytes): (usize, usize, usize),
        pace: Option<Duration>,
    ) -> Flood {
        let answered = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::watch::channel(());
        let mut tasks = Vec::with_capacity(streams);
        for s in 0..streams {
            let report = RateLimitQuotaUsageReports {
                domain: domain.to_owned(),
                bucket_quota_usages: (0..buckets)
                    .map(|b| BucketQuotaUsage {
                        bucket_id: Some(bucket(&[
                            ("name", "per-tenant"),
                            (
                                "tenant",
                                &format!("{:x<value_bytes$}", format!("s{s}-{b}-")),
                            ),
                        ])),
                        time_elapsed: Some(ProtoDuration {
                            seconds: 5,
                            nanos: 0,
                        }),
                        num_requests_allowed: 1,
                        num_requests_denied: 0,
                    })
                    .collect(),
            };
            let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
                .expect("a gRPC address")
                .connect()
                .await
                .expect("gRPC connects");
            let client =
                RateLimitQuotaServiceClient::new(channel).max_decoding_message_size(usize::MAX);
            let answered = answered.clone();
            let mut stopped = stopped.clone();
            tasks.push(tokio::spawn(async move {
                let mut client = client;
                let reports = futures_util::stream::unfold(true, move |first| {
                    let report = report.clone();
                    async move {
                        if let (Some(pace), false) = (pace, first) {
                            tokio::time::sleep(pace).await;
                        }
                        Some((report, false))
                    }
                })
                .take_until(async move {
                    let _ = stopped.changed().await;
                });
                let Ok(answers) = client.stream_rate_limit_quotas(reports).await else {
                    return;
                };
                let mut answers = answers.into_inner();
                while let Ok(Some(answer)) = answers.message().await {
                    answered.fetch_add(answer.bucket_action.len() as u64, Ordering::Relaxed);
                }
            }));
        }
        Flood {
            tasks,
            answered,
            _stop: stop,
        }
    }

    /// Bucket actions answered so far, over every stream.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Waits, for at most `limit`, until `actions` bucket actions have been answered in all.
    pub async fn wait_answered(&self, actions: u64, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.answered() < actions {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }
}

impl Drop for Flood {
    /// Ends every stream (its reports end, as an Envoy's stream does).
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
