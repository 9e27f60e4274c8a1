//! The Rate Limit Quota Service's network face (`envoy.service.rate_limit_quota.v3`,
//! `StreamRateLimitQuotas`): each Envoy holds one stream, which is handed, with the address of
//! the client it comes from, to the quota service's thread (`quota::Quotas`), where its reports
//! are answered; the answers come back through the stream's outbox. No request waits for sluice.

use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwap;
use futures_util::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::conns::Peer;
use super::shutdown::Shutdown;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::quota::{QuotaStream, Quotas};
use sluice_core::rules::RuleSet;

/// The quota service of one event loop: it hands each stream to the quota service's thread.
pub struct Rlqs {
    quotas: Arc<Quotas>,
    rules: Arc<ArcSwap<RuleSet>>,
    shutdown: Shutdown,
}

impl Rlqs {
    pub fn new(quotas: Arc<Quotas>, rules: Arc<ArcSwap<RuleSet>>, shutdown: Shutdown) -> Self {
        Rlqs {
            quotas,
            rules,
            shutdown,
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let peer = request.extensions().get::<Peer>().map(|p| p.0);
        let (stream, answers) = QuotaStream::open(&self.quotas, self.rules.clone(), peer);
        let stop = self.shutdown.clone().wait();
        self.quotas.spawn(stream.run(request.into_inner(), stop));
        Ok(Response::new(Box::pin(ReceiverStream::new(answers))))
    }
}
