//! The network surface: the gRPC server (rate limit service, health, reflection) and the admin
//! HTTP server, started together and stopped together, and the readiness they both report.
//!
//! gRPC connections are served by event loops, one single-threaded runtime per thread; the
//! listener hands each new connection to the next loop in turn and the connection stays there.
//! On one loop, the answers to the requests that arrived together are written together, where a
//! work-stealing runtime would wake the connection, and write to the socket, once per answer.
//! Every listener's connections are bounded (`conns`): how many, how long idle, how old. The
//! quota service's own listener (`--quota-addr`), when there is one, is served the same way on
//! the quota service's thread.
//!
//! The map:
//! - `server`: the server's life (`run`): listeners bound, loops and admin servers started, the
//!   drain at shutdown;
//! - `setup`: what a server is made of (`Setup`, `Edges`, `Addrs`), and the services it makes;
//! - `shutdown`, `in_force` (the rules every request reads, swapped by `reload`), `readiness`;
//! - `accept` (accepting and handing out connections), `event_loop` (the loops serving gRPC;
//!   `dispatch`: what they serve, `ShouldRateLimit` straight, the rest through tonic's router),
//!   `conns` (every connection's bounds), `tls`;
//! - `admin` (the admin HTTP servers), `http` (their routes), `explain`, `gauges`, `render`,
//!   `ui` (the console: one page and `/status`);
//! - the services: `rls` (with `decide`: the cache, leases and the store, and `metadata`) and
//!   `rlqs` (the quota service's gRPC face over `crate::quota`).

mod accept;
mod admin;
mod auth;
mod conns;
mod counted;
mod counters;
mod decide;
mod dispatch;
mod event_loop;
pub mod explain;
mod gauges;
mod http;
mod in_force;
mod metadata;
mod readiness;
pub mod reload;
mod render;
pub mod rlqs;
pub mod rls;
mod server;
mod setup;
mod shutdown;
pub mod tls;
mod ui;

pub use auth::{AdminAccess, AdminToken};
pub use conns::MaxAge;
pub use in_force::Rules;
pub use readiness::Readiness;
pub use server::run;
pub use setup::{Addrs, Edges, Healthcheck, JsonAt, Setup};
pub use shutdown::Shutdown;
