//! The floor sluice's request path is measured against: a Rate Limit Service on tonic's own
//! server that decides nothing. Every request is decoded as sluice decodes it (the same generated
//! types) and answered OK at once, with one OK status per descriptor, as the protocol asks of any
//! answer. It keeps no counter, reads no rule and sets no limit, so what a load costs it is what
//! the gRPC stack costs: tonic, hyper and h2, tokio, the kernel's loopback and the allocator
//! (mimalloc, as sluice's).
//!
//! `scripts/bench --floor` builds it, runs it and sluice under the same load, one after the
//! other, and prints sluice's CPU per decision as a ratio of this server's.
//!
//! ```text
//! cargo run --release --example floor -- 127.0.0.1:8091
//! ```

use std::net::SocketAddr;

use sluice::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use sluice::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use sluice::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Answers every request OK.
struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: Code::Ok.into(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses,
            ..Default::default()
        }))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let address: SocketAddr = std::env::args()
        .nth(1)
        .as_deref()
        .unwrap_or("127.0.0.1:8091")
        .parse()?;
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Floor))
        .serve(address)
        .await?;
    Ok(())
}
