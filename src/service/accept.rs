//! Accepting connections: a failed accept pauses rather than spins, and a gRPC connection is
//! handed to an event loop once it has spoken and its listener's bound has room for it.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::conns::Connections;
use super::event_loop::Handed;
use super::shutdown::Shutdown;
use sluice_core::log_throttle::LogThrottle;

/// The longest pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How long a new connection may stay silent: one that sends nothing only holds a descriptor.
const FIRST_BYTES: Duration = Duration::from_secs(10);

/// Accepts the next connection on `listener`. A failed accept (out of file descriptors, a
/// connection reset while queued) is logged at most once a second through `failed` and
/// followed by a pause, doubling from 5 ms to `ACCEPT_BACKOFF` while it lasts (`pause`), so that
/// a lasting one does not spin.
pub(super) async fn accept(
    listener: &TcpListener,
    pause: &mut Duration,
    failed: &LogThrottle,
    what: &str,
) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                *pause = Duration::ZERO;
                return stream;
            }
            Err(e) => {
                if let Some(n) = failed.hit() {
                    tracing::warn!("{n} failed accept(s) of {what} connections: {e}");
                }
                *pause = (*pause * 2).clamp(Duration::from_millis(5), ACCEPT_BACKOFF);
                tokio::time::sleep(*pause).await;
            }
        }
    }
}

/// Accepts gRPC connections until `shutdown` fires and hands them to the event loops in turn,
/// each once it has sent its first bytes (within `FIRST_BYTES`, or it is closed) and only if
/// `connections` has room for it.
pub(super) async fn hand_out(
    listener: TcpListener,
    connections: Connections,
    loops: Vec<mpsc::UnboundedSender<Handed>>,
    shutdown: Shutdown,
) {
    static FAILED: LogThrottle = LogThrottle::new();
    let stop = shutdown.wait();
    tokio::pin!(stop);
    let mut next = 0;
    let mut pause = Duration::ZERO;
    loop {
        let stream = tokio::select! {
            stream = accept(&listener, &mut pause, &FAILED, "gRPC") => stream,
            () = &mut stop => return,
        };
        let Some(slot) = connections.admit() else {
            continue;
        };
        // Lets a connection closed to make room, if waiting on this thread for its first bytes,
        // give its descriptor back before the next accept takes one.
        tokio::task::yield_now().await;
        let to_loop = loops[next].clone();
        tokio::spawn(async move {
            let mut first = [0; 1];
            let peek = tokio::time::timeout(FIRST_BYTES, stream.peek(&mut first));
            let spoke = tokio::select! {
                peeked = peek => matches!(peeked, Ok(Ok(_))),
                () = slot.evicted() => false,
            };
            if spoke {
                match stream.set_nodelay(true).and_then(|()| stream.into_std()) {
                    // Fails only while the loops stop.
                    Ok(stream) => drop(to_loop.send((stream, slot))),
                    Err(e) => tracing::warn!("setting up a gRPC connection: {e}"),
                }
            }
        });
        next = (next + 1) % loops.len();
    }
}
