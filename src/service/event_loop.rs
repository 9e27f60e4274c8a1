//! The event loops: one single-threaded runtime per thread, each serving the gRPC connections
//! the listener hands it, with the services every gRPC listener serves.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use super::conns::{self, CLOSE_GRACE, Slot, Timers, Tracked};
use super::dispatch::Dispatch;
use super::rlqs::Rlqs;
use super::setup::Setup;
use super::shutdown::Shutdown;
use super::tls::ServerTls;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use sluice_core::store::StoreError;

/// How long a gRPC connection, once served, may go before its first call: one that never calls
/// only holds a descriptor and memory.
const FIRST_REQUEST: Duration = Duration::from_secs(10);
/// How long a gRPC connection may stay with no call in flight; Envoy opens a new one when it
/// needs one.
const IDLE: Duration = Duration::from_secs(300);
/// What a gRPC stream may send ahead of what its handler has read (HTTP/2's default, where the
/// server's default is 1 MiB): a rate limit request is far smaller, and a quota stream waiting
/// its turn (`--quota-max-reports`) holds its Envoy's next report at the Envoy rather than in
/// the event loop that carries its connection.
const STREAM_WINDOW: u32 = 65_535;
/// How long a gRPC call may take to send its request message, on top of `--store-timeout` for
/// its answer: past both, it is answered DEADLINE_EXCEEDED.
const REQUEST_MESSAGE: Duration = Duration::from_secs(10);

/// What every event loop serves.
#[derive(Clone)]
pub(super) struct Grpc {
    pub(super) setup: Setup,
    pub(super) health: HealthReporter,
    pub(super) shutdown: Shutdown,
}

/// A connection handed to an event loop, with its place in the listener's bound.
pub(super) type Handed = (std::net::TcpStream, Slot);

/// The event loops, started.
pub(super) struct EventLoops {
    /// Where each loop is handed its connections.
    pub(super) incoming: Vec<mpsc::UnboundedSender<Handed>>,
    /// Each loop's runtime.
    pub(super) runtimes: Vec<tokio::runtime::Handle>,
    finished: Vec<oneshot::Receiver<anyhow::Result<()>>>,
}

impl EventLoops {
    /// Waits until every loop has finished its connections (after `shutdown`).
    pub(super) async fn finished(self) -> anyhow::Result<()> {
        for finished in self.finished {
            finished
                .await
                .context("an event loop stopped")?
                .context("gRPC server")?;
        }
        Ok(())
    }
}

impl Grpc {
    /// Starts `loops` event loops, each on a thread of its own, once each has opened its store.
    pub(super) async fn start(&self, loops: usize) -> anyhow::Result<EventLoops> {
        let mut started = EventLoops {
            incoming: Vec::with_capacity(loops),
            runtimes: Vec::with_capacity(loops),
            finished: Vec::with_capacity(loops),
        };
        for n in 0..loops {
            let (to_loop, incoming) = mpsc::unbounded_channel();
            let (ready, loop_ready) = oneshot::channel();
            let (done, loop_finished) = oneshot::channel();
            let grpc = self.clone();
            std::thread::Builder::new()
                .name(format!("sluice-loop-{n}"))
                .spawn(move || {
                    let _ = done.send(grpc.serve(incoming, ready));
                })
                .context("starting an event loop")?;
            let runtime = loop_ready.await.context("an event loop stopped")??;
            started.runtimes.push(runtime);
            started.incoming.push(to_loop);
            started.finished.push(loop_finished);
        }
        Ok(started)
    }

    /// Runs a single-threaded runtime on this thread serving the connections sent on `incoming`,
    /// once its store is open (said on `ready`), until `shutdown` fires and they are finished.
    fn serve(
        self,
        incoming: mpsc::UnboundedReceiver<Handed>,
        ready: oneshot::Sender<Result<tokio::runtime::Handle, StoreError>>,
    ) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        runtime.block_on(async move {
            let rls = match self.setup.rls() {
                Ok(rls) => {
                    let _ = ready.send(Ok(handle));
                    rls
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return Ok(());
                }
            };
            let rlqs = self.setup.rlqs(self.shutdown.clone());
            let max = self.setup.edges.max_request_bytes;
            let services = Dispatch::new(self.routes(rlqs)?).with_rls(rls, max);
            self.connections(services, incoming).await;
            Ok(())
        })
    }

    /// Serves the connections sent on `incoming` with the quota service alone (and health and
    /// reflection), on the calling runtime, until `shutdown` fires and they are finished.
    pub(super) async fn serve_quota(
        self,
        incoming: mpsc::UnboundedReceiver<Handed>,
    ) -> anyhow::Result<()> {
        let rlqs = self.setup.rlqs(self.shutdown.clone());
        let services = Dispatch::new(self.routes(rlqs)?);
        self.connections(services, incoming).await;
        Ok(())
    }

    /// The services every gRPC listener serves: health, reflection and the quota service.
    fn routes(&self, rlqs: Rlqs) -> anyhow::Result<tonic::service::Routes> {
        let max = self.setup.edges.max_request_bytes;
        let reflection_v1 = reflection().build_v1().context("reflection v1")?;
        let reflection_v1alpha = reflection().build_v1alpha().context("reflection v1alpha")?;
        let mut routes = tonic::service::Routes::builder();
        routes
            .add_service(
                HealthServer::new(HealthService::from_health_reporter(self.health.clone()))
                    .max_decoding_message_size(max),
            )
            .add_service(reflection_v1.max_decoding_message_size(max))
            .add_service(reflection_v1alpha.max_decoding_message_size(max))
            .add_service(RateLimitQuotaServiceServer::new(rlqs).max_decoding_message_size(max));
        Ok(routes.routes().prepare())
    }

    /// Serves the connections sent on `incoming` with `services` until `shutdown` fires and
    /// they are finished.
    async fn connections(self, services: Dispatch, mut incoming: mpsc::UnboundedReceiver<Handed>) {
        let edges = self.setup.edges;
        let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .initial_stream_window_size(STREAM_WINDOW)
            .max_concurrent_streams(edges.max_concurrent_streams)
            .max_header_list_size(edges.max_header_list_bytes);
        let serving = Arc::new(Serving {
            services,
            http2,
            tls: self.setup.tls.clone(),
            answer_within: REQUEST_MESSAGE + self.setup.fallback.store_timeout,
            timers: Timers {
                first_request: Some(FIRST_REQUEST),
                idle: Some(IDLE),
                max_age: edges.max_connection_age,
                grace: CLOSE_GRACE,
            },
        });
        let mut served = JoinSet::new();
        let stop = self.shutdown.clone().wait();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                handed = incoming.recv() => match handed {
                    Some((stream, slot)) => {
                        let serving = serving.clone();
                        served.spawn(serving.connection(stream, slot, self.shutdown.clone()));
                    }
                    None => break,
                },
                Some(_) = served.join_next(), if !served.is_empty() => {}
                () = &mut stop => break,
            }
        }
        while served.join_next().await.is_some() {}
    }
}

/// How an event loop serves each of its gRPC connections.
struct Serving {
    services: Dispatch,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    tls: Option<ServerTls>,
    answer_within: Duration,
    timers: Timers,
}

impl Serving {
    /// Serves one connection (after its TLS handshake, if TLS is on) until it ends or its
    /// `slot` is needed by another.
    async fn connection(
        self: Arc<Self>,
        stream: std::net::TcpStream,
        slot: Slot,
        shutdown: Shutdown,
    ) {
        let Ok(stream) = TcpStream::from_std(stream) else {
            return;
        };
        let late = || {
            tonic::Status::deadline_exceeded(format!(
                "no request message within {}s",
                REQUEST_MESSAGE.as_secs()
            ))
            .into_http()
        };
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        let service = TowerToHyperService::new(
            Tracked::new(self.services.clone(), &slot, self.answer_within, late).with_peer(peer),
        );
        match &self.tls {
            None => {
                let connection = self.http2.serve_connection(TokioIo::new(stream), service);
                conns::supervise(connection, &slot, &self.timers, shutdown).await;
            }
            Some(tls) => {
                let handshaken = tokio::select! {
                    tls = tls.accept(stream) => tls,
                    () = slot.evicted() => None,
                };
                if let Some(stream) = handshaken {
                    let connection = self.http2.serve_connection(TokioIo::new(stream), service);
                    conns::supervise(connection, &slot, &self.timers, shutdown).await;
                }
            }
        }
    }
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::pb::DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}
