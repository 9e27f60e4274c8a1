//! The admin HTTP servers: the admin port (probes, metrics, `/explain`, `/json` unless it is
//! served apart or off), and `/json`, metrics and envoyproxy/ratelimit's debug port on listeners
//! of their own where asked.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::accept::accept;
use super::auth::Certified;
use super::conns::{self, BodyReader, CLOSE_GRACE, Connections, Timers, Tracked};
use super::gauges::Gauges;
use super::readiness::Readiness;
use super::rls::Rls;
use super::setup::{JsonAt, Setup};
use super::shutdown::Shutdown;
use super::tls::ServerTls;
use super::{counters, explain, http};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::store::Store;

/// How long an admin HTTP client may take to send a request's headers, the first or the next
/// on a kept-alive connection, before the connection is closed.
const HEADER_READ: Duration = Duration::from_secs(5);
/// How long an admin HTTP client may take to send a request's body once its headers are in:
/// past it, 408 and the connection closed.
const BODY_READ: Duration = Duration::from_secs(5);
/// How long an admin HTTP request may take to be answered, its body read included: past it, 408.
const ADMIN_ANSWER: Duration = Duration::from_secs(30);

/// The admin HTTP listeners.
pub(super) struct Admin {
    /// The admin port.
    pub(super) http: TcpListener,
    /// `/json` apart.
    pub(super) json: Option<TcpListener>,
    /// Metrics also apart, at this path.
    pub(super) metrics: Option<(TcpListener, String)>,
    /// envoyproxy/ratelimit's debug port.
    pub(super) debug: Option<TcpListener>,
}

/// What the admin endpoints answer from.
pub(super) struct Answers {
    pub(super) setup: Setup,
    pub(super) json_at: JsonAt,
    pub(super) readiness: Readiness,
    pub(super) gauges: Gauges,
    /// The rate limit service `/json` asks.
    pub(super) rls: Arc<Rls>,
    /// The store `/counters` changes.
    pub(super) counters_store: Store,
}

impl Admin {
    /// How many listeners there are, each with its own bound of `per_listener` connections.
    pub(super) fn count(&self) -> usize {
        1 + usize::from(self.json.is_some())
            + usize::from(self.metrics.is_some())
            + usize::from(self.debug.is_some())
    }

    /// Serves every admin listener until `shutdown` fires and their connections are finished.
    pub(super) async fn serve(self, answers: Answers, per_listener: usize, shutdown: Shutdown) {
        let Answers {
            setup,
            json_at,
            readiness,
            gauges,
            rls,
            counters_store,
        } = answers;
        let bound = |name| Connections::new(name, per_listener);
        let max_body = setup.edges.max_request_bytes;
        let gate = |router| Gate::new(per_listener, max_body).over(router);
        let metrics = self
            .metrics
            .map(|(listener, path)| (listener, http::metrics_route(&path, gauges.clone())));
        // `/explain` moves no counter: it stays on the admin port wherever `/json` is served.
        let access = &setup.admin;
        if let Some(token) = access.token() {
            tokio::spawn(token.clone().watch());
        }
        if let Some(tls) = access.tls() {
            tokio::spawn(tls.clone().watch());
        }
        let mut admin =
            http::admin(readiness, setup.rules.clone(), gauges, access).merge(explain::route(
                setup.rules.clone(),
                setup.bounds,
                setup.answering.clone(),
                setup.backend.redis_key_prefix().map(str::to_owned),
                setup.edges.max_request_bytes,
                access,
            ));
        admin = admin.merge(counters::route(
            counters::Parts {
                rules: setup.rules.clone(),
                bounds: setup.bounds,
                answering: setup.answering.clone(),
                store: counters_store,
                cache: setup.cache.clone(),
                leases: setup.leases.clone(),
                telemetry: setup.telemetry.clone(),
                redis_key_prefix: setup.backend.redis_key_prefix().map(str::to_owned),
            },
            setup.edges.max_request_bytes,
            access,
        ));
        let json = http::json_route(rls, setup.edges.max_request_bytes, access);
        if json_at == JsonAt::Http {
            admin = admin.merge(json.clone());
        }
        admin = admin.merge(http::index(json_at == JsonAt::Http));
        let admin = serve_http(
            self.http,
            gate(admin),
            bound("admin HTTP"),
            shutdown.clone(),
            access.tls().cloned(),
        );
        let json = async {
            if let Some(listener) = self.json {
                serve_http(listener, gate(json), bound("/json"), shutdown.clone(), None).await;
            }
        };
        let metrics = async {
            if let Some((listener, route)) = metrics {
                serve_http(
                    listener,
                    gate(route),
                    bound("metrics"),
                    shutdown.clone(),
                    None,
                )
                .await;
            }
        };
        let debug = async {
            if let Some(listener) = self.debug {
                let route = http::debug(setup.rules.clone());
                serve_http(
                    listener,
                    gate(route),
                    bound("debug HTTP"),
                    shutdown.clone(),
                    None,
                )
                .await;
            }
        };
        tokio::join!(admin, json, metrics, debug);
    }
}

/// What keeps the probes of a listener answered whatever other clients send: a request with a
/// body (anything but `GET` and `HEAD`) takes one of half the listener's connections, and has
/// `BODY_READ` to send its body in full. Past either, it is answered at once (503, 408) and its
/// connection closed; and while it sends its body, its connection may be closed to make room
/// for a new one (`Connections::admit`). So slow or many bodies never hold every connection: a
/// probe (`GET`) always finds one to take.
#[derive(Clone)]
struct Gate {
    bodies: Arc<Semaphore>,
    max_body: usize,
}

impl Gate {
    /// The gate of a listener of `per_listener` connections.
    fn new(per_listener: usize, max_body: usize) -> Gate {
        Gate {
            bodies: Arc::new(Semaphore::new((per_listener / 2).max(1))),
            max_body,
        }
    }

    /// `router`, behind this gate.
    fn over(self, router: axum::Router) -> axum::Router {
        router.layer(middleware::from_fn_with_state(self, pass))
    }
}

async fn pass(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let closing = |status: StatusCode, message: String| {
        (status, [(header::CONNECTION, "close")], message).into_response()
    };
    let Ok(_permit) = gate.bodies.try_acquire() else {
        return closing(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: too many admin requests with a body in flight; try again\n".to_owned(),
        );
    };
    // Meanwhile, the connection may be closed to make room for another.
    let _reading = request
        .extensions()
        .get::<BodyReader>()
        .map(BodyReader::reading);
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, gate.max_body);
    let bytes = match tokio::time::timeout(BODY_READ, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => {
            return closing(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is larger than --max-request-bytes ({} bytes) or was cut short\n",
                    gate.max_body
                ),
            );
        }
        Err(_) => {
            return closing(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {}s\n", BODY_READ.as_secs()),
            );
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Serves `router` over HTTP/1.1 on `listener` until `shutdown` fires, then lets the
/// connections finish what they are answering. Each connection has `HEADER_READ` to send the
/// headers of a request, `BODY_READ` for its body (`Gate`) and `ADMIN_ANSWER` for its answer;
/// `connections` bounds how many.
async fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    connections: Connections,
    shutdown: Shutdown,
    tls: Option<ServerTls>,
) {
    static FAILED: LogThrottle = LogThrottle::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ);
    let http1 = Arc::new(http1);
    let timers = Timers {
        grace: CLOSE_GRACE,
        ..Timers::default()
    };
    let late = || {
        let message = format!("no answer within {}s\n", ADMIN_ANSWER.as_secs());
        (axum::http::StatusCode::REQUEST_TIMEOUT, message).into_response()
    };
    let mut served = JoinSet::new();
    let stop = shutdown.clone().wait();
    tokio::pin!(stop);
    let mut pause = Duration::ZERO;
    loop {
        let stream = tokio::select! {
            stream = accept(&listener, &mut pause, &FAILED, "HTTP") => stream,
            Some(_) = served.join_next(), if !served.is_empty() => continue,
            () = &mut stop => break,
        };
        let Some(slot) = connections.admit() else {
            continue;
        };
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        let (router, http1, shutdown, tls) =
            (router.clone(), http1.clone(), shutdown.clone(), tls.clone());
        served.spawn(async move {
            // The handshake on the connection's own task: a slow one holds up no other.
            let serve = |router: axum::Router| {
                Tracked::new(router, &slot, ADMIN_ANSWER, late)
                    .with_peer(peer)
                    .with_body_reader()
            };
            match tls {
                None => {
                    let service = TowerToHyperService::new(serve(router));
                    let connection = http1.serve_connection(TokioIo::new(stream), service);
                    conns::supervise(connection, &slot, &timers, shutdown).await;
                }
                Some(tls) => {
                    let Some(stream) = tls.accept(stream).await else {
                        return;
                    };
                    // A certificate presented was verified against the client CA in the
                    // handshake: it lets its client in as the admin token does.
                    let certified = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .is_some_and(|c| !c.is_empty());
                    let router = if certified {
                        router.layer(axum::Extension(Certified))
                    } else {
                        router
                    };
                    let service = TowerToHyperService::new(serve(router));
                    let connection = http1.serve_connection(TokioIo::new(stream), service);
                    conns::supervise(connection, &slot, &timers, shutdown).await;
                }
            }
        });
    }
    drop(listener);
    while served.join_next().await.is_some() {}
}
