//! The network surface: the gRPC server (rate limit service, health, reflection) and the admin
//! HTTP server, started together and stopped together.
//!
//! gRPC connections are served by event loops, one single-threaded runtime per thread; the
//! listener hands each new connection to the next loop in turn and the connection stays there.
//! On one loop, the answers to the requests that arrived together are written together, where a
//! work-stealing runtime would wake the connection, and write to the socket, once per answer.

mod http;
pub mod rls;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use futures_util::StreamExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use rls::{Bounds, Rls};

use crate::limiter::Limiter;
use crate::rules::RuleSet;
use crate::store::{Backend, StoreError};

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

/// What a rate limit service is made of; each event loop makes its own from it.
#[derive(Clone)]
pub struct Setup {
    pub rules: Arc<ArcSwap<RuleSet>>,
    pub backend: Backend,
    pub bounds: Bounds,
    pub shadow_mode: bool,
}

impl Setup {
    /// A rate limit service for the calling runtime (on Redis, with connections of its own).
    pub async fn rls(&self) -> Result<Arc<Rls>, StoreError> {
        let store = self.backend.open().await?;
        Ok(Arc::new(Rls::new(
            self.rules.clone(),
            Limiter::new(store),
            self.bounds,
            self.shadow_mode,
        )))
    }
}

/// Serves gRPC on `grpc_addr` with `loops` event loops and admin HTTP on `http_addr` until
/// `shutdown` fires, then lets in-flight calls finish. Fails before serving anything when the
/// store cannot be reached.
pub async fn run(
    setup: Setup,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    loops: usize,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let grpc_listener = TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("cannot listen for gRPC on {grpc_addr}"))?;
    let http_listener = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(grpc = %grpc_listener.local_addr()?, http = %http_listener.local_addr()?, loops, "serving");

    let health = HealthReporter::new();
    health.set_serving::<RateLimitServiceServer<Rls>>().await;
    let rls = setup.rls().await?;
    let mut connections = Vec::with_capacity(loops);
    let mut finished = Vec::with_capacity(loops);
    for n in 0..loops {
        let (to_loop, incoming) = mpsc::unbounded_channel();
        let (ready, loop_ready) = oneshot::channel();
        let (done, loop_finished) = oneshot::channel();
        let grpc = Grpc {
            setup: setup.clone(),
            health: health.clone(),
            shutdown: shutdown.clone(),
        };
        std::thread::Builder::new()
            .name(format!("sluice-loop-{n}"))
            .spawn(move || {
                let _ = done.send(grpc.serve(incoming, ready));
            })
            .context("starting an event loop")?;
        loop_ready.await.context("an event loop stopped")??;
        connections.push(to_loop);
        finished.push(loop_finished);
    }

    let accept = hand_out(grpc_listener, connections, shutdown.clone());
    let http =
        axum::serve(http_listener, http::router(rls)).with_graceful_shutdown(shutdown.wait());
    let (accept, http) = tokio::join!(accept, http);
    accept.context("accepting gRPC connections")?;
    http.context("HTTP server")?;
    for loop_finished in finished {
        loop_finished
            .await
            .context("an event loop stopped")?
            .context("gRPC server")?;
    }
    Ok(())
}

/// Accepts gRPC connections until `shutdown` fires and hands them to the event loops in turn.
async fn hand_out(
    listener: TcpListener,
    loops: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let stop = shutdown.wait();
    tokio::pin!(stop);
    for next in (0..loops.len()).cycle() {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // A connection that failed while queued (reset, out of descriptors) is not
                    // the listener's end.
                    tracing::warn!("accepting a gRPC connection: {e}");
                    continue;
                }
            },
            () = &mut stop => return Ok(()),
        };
        match stream.set_nodelay(true).and_then(|()| stream.into_std()) {
            Ok(stream) => loops[next]
                .send(stream)
                .map_err(|_| anyhow::anyhow!("event loop {next} has stopped"))?,
            Err(e) => tracing::warn!("setting up a gRPC connection: {e}"),
        }
    }
    unreachable!("the loops cycle forever")
}

/// What one event loop serves.
struct Grpc {
    setup: Setup,
    health: HealthReporter,
    shutdown: Shutdown,
}

impl Grpc {
    /// Runs a single-threaded runtime on this thread serving the connections sent on `incoming`,
    /// once its store is open (said on `ready`).
    fn serve(
        self,
        incoming: mpsc::UnboundedReceiver<std::net::TcpStream>,
        ready: oneshot::Sender<Result<(), StoreError>>,
    ) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let rls = match self.setup.rls().await {
                Ok(rls) => {
                    let _ = ready.send(Ok(()));
                    rls
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return Ok(());
                }
            };
            let reflection_v1 = reflection().build_v1().context("reflection v1")?;
            let reflection_v1alpha = reflection().build_v1alpha().context("reflection v1alpha")?;
            let incoming = UnboundedReceiverStream::new(incoming).map(TcpStream::from_std);
            tonic::transport::Server::builder()
                .add_service(HealthServer::new(HealthService::from_health_reporter(
                    self.health,
                )))
                .add_service(reflection_v1)
                .add_service(reflection_v1alpha)
                .add_service(RateLimitServiceServer::from_arc(rls))
                .serve_with_incoming_shutdown(incoming, self.shutdown.wait())
                .await
                .context("gRPC server")
        })
    }
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}
