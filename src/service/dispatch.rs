//! What a gRPC listener serves: the method Envoy calls on every request, `ShouldRateLimit`,
//! straight through tonic's `Grpc::unary`, and every other path (health, reflection, the quota
//! service) through tonic's router. The router (axum) and the generated server would match the
//! path again, box the call three more times and the request's body twice.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::future::Either;
use hyper::{Request, Response};
use tonic::body::Body;
use tonic::server::{Grpc, UnaryService};
use tonic::service::Routes;
use tonic_prost::ProstCodec;

use super::rls::Rls;
use crate::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// The path of `RateLimitService.ShouldRateLimit`.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

type Boxed<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// A listener's gRPC services.
#[derive(Clone)]
pub(super) struct Dispatch {
    /// The rate limit service, with the largest request message it decodes.
    rls: Option<(Arc<Rls>, usize)>,
    routes: Routes,
}

impl Dispatch {
    /// Serves `routes` alone.
    pub(super) fn new(routes: Routes) -> Dispatch {
        Dispatch { rls: None, routes }
    }

    /// Serves `ShouldRateLimit` with `rls` too, decoding request messages of at most
    /// `max_request_bytes`.
    pub(super) fn with_rls(self, rls: Arc<Rls>, max_request_bytes: usize) -> Dispatch {
        Dispatch {
            rls: Some((rls, max_request_bytes)),
            ..self
        }
    }
}

impl<B> tower::Service<Request<B>> for Dispatch
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future =
        Either<Boxed<Response<Body>, Infallible>, <Routes as tower::Service<Request<B>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower::Service::<Request<B>>::poll_ready(&mut self.routes, cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        match &self.rls {
            Some((rls, max)) if request.uri().path() == SHOULD_RATE_LIMIT => {
                let method = ShouldRateLimit(rls.clone());
                let mut grpc = Grpc::new(ProstCodec::default())
                    .apply_max_message_size_config(Some(*max), None);
                Either::Left(Box::pin(
                    async move { Ok(grpc.unary(method, request).await) },
                ))
            }
            _ => Either::Right(self.routes.call(request)),
        }
    }
}

/// `ShouldRateLimit`, as tonic's `Grpc::unary` calls it.
struct ShouldRateLimit(Arc<Rls>);

impl UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = Boxed<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        Box::pin(self.0.clone().should_rate_limit(request))
    }
}
