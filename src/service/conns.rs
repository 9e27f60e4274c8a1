//! Bounds on the connections every listener holds: a cap per listener, with the longest-idle
//! connection closed to make room for a new one; how long a connection may wait before its first
//! request, stay idle or live (a GOAWAY, then a close after a grace); how long a request may take
//! to be answered; and the split of the process's file descriptors that keeps the gRPC port
//! reachable whatever the admin listeners or idle clients hold.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response};
use hyper_util::server::graceful::GracefulConnection;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::shutdown::Shutdown;
use sluice_core::log_throttle::LogThrottle;

/// Connections each admin listener (admin HTTP, `/json` apart, metrics apart, debug) holds at
/// once: probes, a scraper and a few people need far fewer.
pub const ADMIN_CONNECTIONS: usize = 64;
/// File descriptors kept for what is not a client connection: the listeners, the main runtime,
/// the log, rule files and their watcher, certificates, the xDS stream.
const RESERVED: usize = 64;
/// File descriptors kept for each event loop: its runtime, and its connections to the store (one
/// per Redis node it reaches).
const RESERVED_PER_LOOP: usize = 16;
/// The fewest gRPC connections allowed, however low the file descriptor limit.
const FEWEST_GRPC: usize = 16;

/// How many connections each listener may hold, from the process's file descriptor limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// gRPC connections, over every event loop.
    pub grpc: usize,
    /// Connections of each admin listener.
    pub admin: usize,
}

impl Budget {
    /// Raises the soft file descriptor limit to the hard one (as Go programs such as
    /// envoyproxy/ratelimit do at start) and shares it out: `ADMIN_CONNECTIONS` per admin
    /// listener and the reserve first, so that neither admin clients nor idle gRPC clients can
    /// take the descriptors a new gRPC connection, a store connection or a rule file needs; gRPC
    /// gets the rest, at most `max_grpc`.
    pub fn from_limit(loops: usize, admin_listeners: usize, max_grpc: usize) -> Budget {
        let limit = match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(limit) => usize::try_from(limit).unwrap_or(usize::MAX),
            Err(e) => {
                tracing::warn!("cannot read the file descriptor limit ({e}): taking 1024");
                1024
            }
        };
        let budget = Budget::share(limit, loops, admin_listeners, max_grpc);
        if limit.saturating_sub(Budget::kept(loops, admin_listeners)) < FEWEST_GRPC {
            tracing::warn!(
                limit,
                "the file descriptor limit leaves little for gRPC connections: {FEWEST_GRPC} \
                 at most; raise it (ulimit -n)"
            );
        }
        tracing::info!(
            "file descriptors: {limit} at most; connections: {} gRPC at most, {} per admin listener",
            budget.grpc,
            budget.admin
        );
        budget
    }

    /// Descriptors kept before gRPC connections get any.
    fn kept(loops: usize, admin_listeners: usize) -> usize {
        RESERVED + RESERVED_PER_LOOP * loops + ADMIN_CONNECTIONS * admin_listeners
    }

    /// The share of a limit of `limit` descriptors.
    fn share(limit: usize, loops: usize, admin_listeners: usize, max_grpc: usize) -> Budget {
        let left = limit.saturating_sub(Budget::kept(loops, admin_listeners));
        Budget {
            grpc: left.max(FEWEST_GRPC).min(max_grpc),
            admin: ADMIN_CONNECTIONS,
        }
    }
}

/// The connections one listener holds, shared by every thread serving them.
#[derive(Clone)]
pub(super) struct Connections(Arc<Pool>);

struct Pool {
    /// The listener, as logs name it.
    name: &'static str,
    cap: usize,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    evicted: LogThrottle,
    refused: LogThrottle,
}

impl Connections {
    pub(super) fn new(name: &'static str, cap: usize) -> Connections {
        Connections(Arc::new(Pool {
            name,
            cap,
            open: Mutex::default(),
            next: AtomicU64::new(0),
            evicted: LogThrottle::new(),
            refused: LogThrottle::new(),
        }))
    }

    fn open(&self) -> MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.0.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new connection. At the cap, the connection that has waited longest for a
    /// request makes room, in the order `Conn::rank` gives: first one that never sent any though
    /// it had the time to, then one still sending a body, then one with nothing in flight, then
    /// one just opened, then one that is only receiving an answer (a stream); `None` (refuse the
    /// new one) when every connection is awaiting an answer, which takes a bounded time.
    pub(super) fn admit(&self) -> Option<Slot> {
        let conn = Arc::new(Conn::new(self.0.next.fetch_add(1, Ordering::Relaxed)));
        let mut open = self.open();
        if open.len() >= self.0.cap {
            let victim = open
                .values()
                .filter_map(|c| Some((c.rank()?, c.id)))
                .min()
                .map(|(_, id)| id);
            let Some(victim) = victim.and_then(|id| open.remove(&id)) else {
                drop(open);
                if let Some(n) = self.0.refused.hit() {
                    tracing::warn!(
                        "{n} {} connection(s) refused: all {} are awaiting an answer",
                        self.0.name,
                        self.0.cap
                    );
                }
                return None;
            };
            victim.evict.notify_one();
            if let Some(n) = self.0.evicted.hit() {
                tracing::warn!(
                    "{n} {} connection(s) waiting for a request closed to make room: {} are \
                     open, the most allowed",
                    self.0.name,
                    self.0.cap
                );
            }
        }
        open.insert(conn.id, conn.clone());
        Some(Slot {
            conn,
            pool: self.clone(),
        })
    }
}

/// How long a new connection has to send its first request before it is the first to make room
/// for another: a connection's request takes a moment to arrive and be read, and a flood of
/// connections must not close a probe's before it has.
const FIRST_REQUEST_CHANCE: Duration = Duration::from_secs(1);

/// What is known of one connection: whether it is idle, since when, and whether it must close
/// to make room.
pub(super) struct Conn {
    id: u64,
    opened: Instant,
    /// Requests not answered yet (a gRPC call still reading its message, or deciding).
    calls: AtomicU32,
    /// Requests whose answer is not sent in full yet (a stream's included).
    answers: AtomicU32,
    /// Requests still receiving their body (said by what reads it, `Body::reading`).
    reading: AtomicU32,
    /// Whether it has ever sent a request.
    used: AtomicBool,
    /// When a request last started or ended, in ms after `opened`.
    active_ms: AtomicU64,
    /// Told once it must close at once.
    evict: Notify,
}

impl Conn {
    fn new(id: u64) -> Conn {
        Conn {
            id,
            opened: Instant::now(),
            calls: AtomicU32::new(0),
            answers: AtomicU32::new(0),
            reading: AtomicU32::new(0),
            used: AtomicBool::new(false),
            active_ms: AtomicU64::new(0),
            evict: Notify::new(),
        }
    }

    fn touch(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.active_ms.store(ms, Ordering::Relaxed);
    }

    fn last_active(&self) -> Instant {
        self.opened + Duration::from_millis(self.active_ms.load(Ordering::Relaxed))
    }

    fn idle(&self) -> bool {
        self.answers.load(Ordering::Relaxed) == 0
    }

    /// Which connection makes room first (the least): one that never sent a request though it
    /// had `FIRST_REQUEST_CHANCE` to, then one still sending a request's body, then an idle one,
    /// then one just opened (a probe whose request is on its way, which connections opened in a
    /// flood after it would otherwise close), then one only receiving an answer (a stream);
    /// `None` while a request whose body is in awaits its answer.
    fn rank(&self) -> Option<(u8, Instant)> {
        let tier = if self.calls.load(Ordering::Relaxed) > 0 {
            if self.reading.load(Ordering::Relaxed) == 0 {
                return None;
            }
            1
        } else {
            match (self.used.load(Ordering::Relaxed), self.idle()) {
                (false, _) if self.opened.elapsed() < FIRST_REQUEST_CHANCE => 3,
                (false, _) => 0,
                (true, true) => 2,
                (true, false) => 4,
            }
        };
        Some((tier, self.last_active()))
    }
}

/// A connection's place among its listener's; it leaves when this is dropped.
pub(super) struct Slot {
    conn: Arc<Conn>,
    pool: Connections,
}

impl Slot {
    /// Resolves once the connection must close at once, to make room.
    pub(super) async fn evicted(&self) {
        self.conn.evict.notified().await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.open().remove(&self.conn.id);
    }
}

/// The longest a connection lives: GOAWAY after `age` (give or take 10 %, so that connections
/// opened together do not all reconnect together), closed `grace` later if calls are still in
/// flight (gRPC's MaxConnectionAge and MaxConnectionAgeGrace).
#[derive(Clone, Copy, Debug)]
pub struct MaxAge {
    pub age: Duration,
    /// `None`: until its calls end.
    pub grace: Option<Duration>,
}

impl MaxAge {
    fn jittered(&self) -> Duration {
        let draw = RandomState::new().hash_one(()) % 2001;
        self.age.mul_f64(0.9 + draw as f64 / 10_000.0)
    }
}

/// How long a peer told to go (GOAWAY) for idleness has to close before it is closed.
pub(super) const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// When a connection is closed for being idle or old.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Timers {
    /// How long it may wait before its first request.
    pub first_request: Option<Duration>,
    /// How long it may stay with no request in flight.
    pub idle: Option<Duration>,
    pub max_age: Option<MaxAge>,
    /// After a GOAWAY for idleness, how long a peer has to close before it is closed for it.
    pub grace: Duration,
}

/// Serves `connection` in `slot` until it ends: closed at once to make room, gracefully (a
/// GOAWAY on HTTP/2, after the answer in progress on HTTP/1) when idle or old as `timers` say or
/// when `shutdown` fires, then dropped if still open once the grace is over. Shutdown has no
/// grace here: the process ends within `--shutdown-grace` anyway.
pub(super) async fn supervise<C: GracefulConnection>(
    connection: C,
    slot: &Slot,
    timers: &Timers,
    shutdown: Shutdown,
) {
    tokio::pin!(connection);
    let conn = &slot.conn;
    let started = Instant::now();
    let old_at = timers
        .max_age
        .map(|m| (conn.opened + m.jittered(), m.grace));
    let stop = shutdown.wait();
    tokio::pin!(stop);
    // Once told to close: when to drop it, if ever.
    let mut closing: Option<Option<Instant>> = None;
    loop {
        let wake = match closing {
            Some(at) => at,
            None => {
                let idle_at = if !conn.used.load(Ordering::Relaxed) {
                    timers.first_request.map(|d| started + d)
                } else if conn.idle() {
                    timers.idle.map(|d| conn.last_active() + d)
                } else {
                    // Busy: look again once it could have been idle that long.
                    timers.idle.map(|d| Instant::now() + d)
                };
                [idle_at, old_at.map(|(at, _)| at)]
                    .into_iter()
                    .flatten()
                    .min()
            }
        };
        let sleep = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = connection.as_mut() => return,
            () = slot.evicted() => return,
            () = &mut stop, if closing.is_none() => {
                connection.as_mut().graceful_shutdown();
                closing = Some(None);
            }
            () = sleep => {
                if closing.is_some() {
                    return;
                }
                let now = Instant::now();
                if let Some((at, grace)) = old_at.filter(|(at, _)| now >= *at) {
                    connection.as_mut().graceful_shutdown();
                    closing = Some(grace.map(|g| at.max(now) + g));
                } else if conn.idle() {
                    let limit = if conn.used.load(Ordering::Relaxed) {
                        timers.idle.map(|d| conn.last_active() + d)
                    } else {
                        timers.first_request.map(|d| started + d)
                    };
                    if limit.is_some_and(|at| now >= at) {
                        connection.as_mut().graceful_shutdown();
                        closing = Some(Some(now + timers.grace));
                    }
                }
            }
        }
    }
}

/// A service that keeps its connection's `Conn` up to date (a request in flight from its start
/// until its answer is sent in full) and answers `late()` to a request it cannot answer within
/// `answer_within` (a gRPC call whose message never comes, a slow HTTP body).
pub(super) struct Tracked<S, B> {
    inner: S,
    conn: Arc<Conn>,
    answer_within: Duration,
    late: fn() -> Response<B>,
    peer: Option<Peer>,
    body_reader: bool,
}

/// A request's connection, as a request extension where the listener asks for it
/// (`Tracked::with_body_reader`): what reads the request's body says so (`reading`), and the
/// connection may then be closed to make room, as one that never sent a request may.
#[derive(Clone)]
pub(super) struct BodyReader(Arc<Conn>);

impl BodyReader {
    /// Counts the request as receiving its body until the guard is dropped.
    pub(super) fn reading(&self) -> Reading {
        self.0.reading.fetch_add(1, Ordering::Relaxed);
        Reading(self.0.clone())
    }
}

/// A request receiving its body, until dropped.
pub(super) struct Reading(Arc<Conn>);

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The address of the client a request came from, as a request extension: the quota service
/// keeps a budget per client.
#[derive(Clone, Copy, Debug)]
pub(super) struct Peer(pub IpAddr);

impl<S: Clone, B> Clone for Tracked<S, B> {
    fn clone(&self) -> Self {
        Tracked {
            inner: self.inner.clone(),
            conn: self.conn.clone(),
            answer_within: self.answer_within,
            late: self.late,
            peer: self.peer,
            body_reader: self.body_reader,
        }
    }
}

impl<S, B> Tracked<S, B> {
    pub(super) fn new(
        inner: S,
        slot: &Slot,
        answer_within: Duration,
        late: fn() -> Response<B>,
    ) -> Self {
        Tracked {
            inner,
            conn: slot.conn.clone(),
            answer_within,
            late,
            peer: None,
            body_reader: false,
        }
    }

    /// Each request it serves names `peer` as its client.
    pub(super) fn with_peer(self, peer: Option<IpAddr>) -> Self {
        Tracked {
            peer: peer.map(Peer),
            ..self
        }
    }

    /// Each request it serves carries its connection's `BodyReader`.
    pub(super) fn with_body_reader(self) -> Self {
        Tracked {
            body_reader: true,
            ..self
        }
    }
}

impl<S, B, R> tower::Service<Request<R>> for Tracked<S, B>
where
    S: tower::Service<Request<R>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<TrackedBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<R>) -> Self::Future {
        if let Some(peer) = self.peer {
            request.extensions_mut().insert(peer);
        }
        if self.body_reader {
            request
                .extensions_mut()
                .insert(BodyReader(self.conn.clone()));
        }
        let (call, answer) = InFlight::start(&self.conn);
        let answering = self.inner.call(request);
        let (within, late) = (self.answer_within, self.late);
        Box::pin(async move {
            let response = match tokio::time::timeout(within, answering).await {
                Ok(response) => response?,
                Err(_) => late(),
            };
            drop(call);
            Ok(response.map(|body| TrackedBody {
                body,
                _answer: answer,
            }))
        })
    }
}

/// One of a connection's counts of requests in flight, taken back when dropped.
struct InFlight {
    conn: Arc<Conn>,
    count: fn(&Conn) -> &AtomicU32,
}

impl InFlight {
    /// A request starting: counted as a call until answered, as an answer until sent.
    fn start(conn: &Arc<Conn>) -> (InFlight, InFlight) {
        conn.used.store(true, Ordering::Relaxed);
        conn.touch();
        let take = |count: fn(&Conn) -> &AtomicU32| {
            count(conn).fetch_add(1, Ordering::Relaxed);
            InFlight {
                conn: conn.clone(),
                count,
            }
        };
        (take(|c| &c.calls), take(|c| &c.answers))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        (self.count)(&self.conn).fetch_sub(1, Ordering::Relaxed);
        self.conn.touch();
    }
}

/// An answer's body, counted in flight until it is sent in full or dropped.
pub(super) struct TrackedBody<B> {
    body: B,
    _answer: InFlight,
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_and_the_reserve_come_before_grpc_connections() {
        // 1024 descriptors, 2 event loops, one admin listener: 64 + 2 × 16 + 64 kept.
        assert_eq!(
            Budget::share(1024, 2, 1, 100_000),
            Budget {
                grpc: 864,
                admin: 64
            }
        );
        assert_eq!(Budget::share(1 << 20, 2, 1, 10_000).grpc, 10_000);
        assert_eq!(Budget::share(100, 2, 1, 10_000).grpc, FEWEST_GRPC);
        assert_eq!(Budget::share(1024, 2, 1, 5).grpc, 5);
    }

    #[test]
    fn at_the_cap_a_never_used_connection_makes_room_before_an_idle_one_and_a_busy_one_never() {
        let pool = Connections::new("test", 3);
        let used = pool.admit().unwrap();
        drop(InFlight::start(&used.conn));
        let busy = pool.admit().unwrap();
        let _busy_in_flight = InFlight::start(&busy.conn);
        let unused = pool.admit().unwrap();
        // It has had its chance to send a request.
        std::thread::sleep(FIRST_REQUEST_CHANCE);
        let fourth = pool.admit().expect("room made");
        assert!(pool.open().contains_key(&used.conn.id));
        assert!(!pool.open().contains_key(&unused.conn.id));
        let _fourth_in_flight = InFlight::start(&fourth.conn);
        let _fifth = pool.admit().expect("room made");
        assert!(!pool.open().contains_key(&used.conn.id));
        assert!(pool.open().contains_key(&busy.conn.id));
    }

    #[test]
    fn at_the_cap_a_connection_just_opened_makes_room_after_an_idle_one_and_a_slow_body() {
        let pool = Connections::new("test", 3);
        let idle = pool.admit().unwrap();
        drop(InFlight::start(&idle.conn));
        let slow = pool.admit().unwrap();
        let _slow_in_flight = InFlight::start(&slow.conn);
        let reading = BodyReader(slow.conn.clone()).reading();
        let probe = pool.admit().unwrap();
        let _flood = pool.admit().expect("room made");
        assert!(!pool.open().contains_key(&slow.conn.id));
        let _more = pool.admit().expect("room made");
        assert!(!pool.open().contains_key(&idle.conn.id));
        assert!(pool.open().contains_key(&probe.conn.id));
        drop(reading);
    }

    #[test]
    fn at_the_cap_a_connection_still_sending_a_body_makes_room_before_an_idle_one() {
        let pool = Connections::new("test", 2);
        let idle = pool.admit().unwrap();
        drop(InFlight::start(&idle.conn));
        let slow = pool.admit().unwrap();
        let _slow_in_flight = InFlight::start(&slow.conn);
        let reading = BodyReader(slow.conn.clone()).reading();
        let _third = pool.admit().expect("room made");
        assert!(!pool.open().contains_key(&slow.conn.id));
        assert!(pool.open().contains_key(&idle.conn.id));
        drop(reading);
    }

    #[test]
    fn at_the_cap_with_every_connection_awaiting_an_answer_a_new_one_is_refused() {
        let pool = Connections::new("test", 1);
        let busy = pool.admit().unwrap();
        let _in_flight = InFlight::start(&busy.conn);
        assert!(pool.admit().is_none());
    }

    #[test]
    fn a_max_age_is_jittered_within_ten_percent() {
        let max = MaxAge {
            age: Duration::from_secs(100),
            grace: None,
        };
        for _ in 0..1000 {
            let age = max.jittered();
            assert!(age >= Duration::from_secs(90) && age <= Duration::from_secs(110));
        }
    }
}
