//! The network surface: the gRPC server (rate limit service, health, reflection) and the admin
//! HTTP server, started together and stopped together.

mod http;
pub mod rls;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;

use rls::Rls;

/// The compiled `proto/` descriptor set (see build.rs).
pub(crate) const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// Tells every server to stop accepting and drain.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    pub fn new() -> (watch::Sender<bool>, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (tx, Shutdown(rx))
    }

    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Serves gRPC on `grpc_addr` and admin HTTP on `http_addr` until `shutdown` fires, then lets
/// in-flight calls finish.
pub async fn run(
    rls: Arc<Rls>,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let grpc_listener = TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("cannot listen for gRPC on {grpc_addr}"))?;
    let http_listener = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(grpc = %grpc_listener.local_addr()?, http = %http_listener.local_addr()?, "serving");

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<RateLimitServiceServer<Rls>>()
        .await;
    let reflection_v1 = reflection().build_v1().context("reflection v1")?;
    let reflection_v1alpha = reflection().build_v1alpha().context("reflection v1alpha")?;

    let grpc = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(RateLimitServiceServer::from_arc(rls.clone()))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
            shutdown.clone().wait(),
        );
    let http =
        axum::serve(http_listener, http::router(rls)).with_graceful_shutdown(shutdown.wait());

    let (grpc, http) = tokio::join!(grpc, http);
    grpc.context("gRPC server")?;
    http.context("HTTP server")?;
    Ok(())
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}
