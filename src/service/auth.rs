//! Who may use the admin endpoints. With the admin token (`--admin-token-file`), the endpoints
//! that show client values or move counters (`/top`, `/explain`, `/counters`, `/json`) answer
//! 401 unless asked with `Authorization: Bearer <token>`; the probes, `/metrics`, `/config`,
//! `/rlconfig` and `/` stay open. The file is read again every second, so a token is rotated
//! without a restart; a file that cannot be read or holds no token is logged, and the token in
//! force stays. Without a token, `/counters` changes nothing unless the port is declared trusted
//! (`--trust-admin-port`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use arc_swap::ArcSwap;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;

use super::conns::Peer;
use super::tls::ServerTls;
use crate::telemetry::Telemetry;
use sluice_core::log_throttle::LogThrottle;

/// How often the token file is read to see whether it changed.
const POLL: Duration = Duration::from_secs(1);
/// The longest token a file may hold.
const LONGEST_TOKEN: usize = 4096;
/// The shortest token taken without a warning: 16 random bytes are out of reach of guessing,
/// a few are not.
const SHORTEST_TOKEN: usize = 16;

/// The admin token in force, shared by every admin listener.
#[derive(Clone)]
pub struct AdminToken(Arc<Shared>);

struct Shared {
    path: PathBuf,
    current: ArcSwap<Vec<u8>>,
}

impl AdminToken {
    /// Reads the token from `path`: its first line, without surrounding blanks; an error when it
    /// cannot be read or holds none.
    pub fn load(path: &Path) -> anyhow::Result<AdminToken> {
        let token = read(path).with_context(|| format!("--admin-token-file {}", path.display()))?;
        warn_if_short(&token, path);
        Ok(AdminToken(Arc::new(Shared {
            path: path.to_path_buf(),
            current: ArcSwap::from_pointee(token),
        })))
    }

    /// Reads the file every `POLL` and puts a token that changed in force; one that cannot be
    /// read is logged once, and the token in force stays.
    pub(super) async fn watch(self) {
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failed = false;
        loop {
            tick.tick().await;
            let shared = self.0.clone();
            let Ok(read) = tokio::task::spawn_blocking(move || read(&shared.path)).await else {
                continue;
            };
            match read {
                Ok(token) if **self.0.current.load() != token => {
                    warn_if_short(&token, &self.0.path);
                    self.0.current.store(Arc::new(token));
                    failed = false;
                    tracing::info!(file = %self.0.path.display(), "admin token reloaded");
                }
                Ok(_) => failed = false,
                Err(e) if !failed => {
                    failed = true;
                    tracing::error!(
                        "admin token not reloaded, the one in force stays: --admin-token-file {}: {e:#}",
                        self.0.path.display()
                    );
                }
                Err(_) => {}
            }
        }
    }

    /// Whether `headers` carry the token in force as `Authorization: Bearer <token>`.
    fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().split_at_checked(7))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|(_, token)| token.trim_ascii())
        else {
            return false;
        };
        same(given, &self.0.current.load())
    }
}

/// The first line of `path`, without surrounding blanks: an error when it is empty or too long.
fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    let text = std::fs::read(path)?;
    let line = text
        .split(|&b| b == b'\n')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    anyhow::ensure!(!line.is_empty(), "the file holds no token");
    anyhow::ensure!(
        line.len() <= LONGEST_TOKEN,
        "the token is longer than {LONGEST_TOKEN} bytes"
    );
    Ok(line.to_vec())
}

/// Warns when `token` is shorter than `SHORTEST_TOKEN` bytes.
fn warn_if_short(token: &[u8], path: &Path) {
    if token.len() < SHORTEST_TOKEN {
        tracing::warn!(
            file = %path.display(),
            "the admin token is {} byte(s) long: one of fewer than {SHORTEST_TOKEN} can be guessed; \
             make one with `openssl rand -hex 32`",
            token.len()
        );
    }
}

/// Compares in time that depends on the lengths alone, not on where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Who may use the admin endpoints that show client values or move counters: the holders of
/// the admin token when there is one; and who may change counters through `/counters`: the
/// holders of the token, or anyone on an admin port the operator declared trusted
/// (`--trust-admin-port`). Closed by default: without either, `/counters` changes nothing.
/// Refused attempts are counted (`sluice_admin_refused_total`), logged at most once a second,
/// and slowed per peer: after a refusal, a peer's next attempts within `COOL_DOWN` are refused
/// without being checked (429).
#[derive(Clone)]
pub struct AdminAccess(Arc<Access>);

struct Access {
    token: Option<AdminToken>,
    /// The admin port's TLS; with a client CA, a verified client certificate lets its client in.
    tls: Option<ServerTls>,
    trusted: bool,
    /// Per peer, until when its attempts are refused unchecked.
    cooling: Mutex<HashMap<IpAddr, Instant>>,
    refused: LogThrottle,
    telemetry: Telemetry,
}

/// How long a peer refused once is refused unchecked.
const COOL_DOWN: Duration = Duration::from_secs(1);
/// The peers remembered as cooling down, at most; past it (once the cooled ones are dropped) a
/// new peer is not slowed.
const MOST_COOLING: usize = 4096;

/// Why an admin request was refused, as the metrics and the log name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Without the admin token, or with a wrong one: 401.
    Token,
    /// A peer refused within `COOL_DOWN`: 429, unchecked.
    Cooling,
    /// A change through `/counters` without the token on an untrusted port: 403.
    Untrusted,
}

impl Refusal {
    pub(super) fn name(self) -> &'static str {
        match self {
            Refusal::Token => "token",
            Refusal::Cooling => "cooling",
            Refusal::Untrusted => "untrusted",
        }
    }
}

/// A request extension: the request came on an admin connection whose client presented a
/// certificate the client CA verified (`--admin-tls-client-ca`).
#[derive(Clone, Copy)]
pub(super) struct Certified;

impl AdminAccess {
    pub fn new(
        token: Option<AdminToken>,
        tls: Option<ServerTls>,
        trusted: bool,
        telemetry: Telemetry,
    ) -> AdminAccess {
        AdminAccess(Arc::new(Access {
            token,
            tls,
            trusted,
            cooling: Mutex::default(),
            refused: LogThrottle::new(),
            telemetry,
        }))
    }

    /// The token, when there is one: its file is watched.
    pub(super) fn token(&self) -> Option<&AdminToken> {
        self.0.token.as_ref()
    }

    /// The admin port's TLS, when it speaks it.
    pub(super) fn tls(&self) -> Option<&ServerTls> {
        self.0.tls.as_ref()
    }

    /// Whether a client certificate lets its client in.
    fn certificates(&self) -> bool {
        self.0.tls.as_ref().is_some_and(ServerTls::verifies_clients)
    }

    /// Whether the guarded endpoints ask for credentials: the token or a client certificate.
    fn closed(&self) -> bool {
        self.0.token.is_some() || self.certificates()
    }

    /// Whether a request let through may change counters: the guarded endpoints asked it for
    /// credentials, or the port is trusted.
    pub(super) fn may_change(&self) -> bool {
        self.closed() || self.0.trusted
    }

    /// Counts and logs (at most once a second) a refusal of `path` asked by `peer`; one for the
    /// token makes the peer cool down.
    pub(super) fn refuse(&self, why: Refusal, peer: Option<IpAddr>, path: &str) {
        self.0.telemetry.admin_refused(why.name());
        if why == Refusal::Token
            && let Some(peer) = peer
        {
            let mut cooling = self.cooling();
            let now = Instant::now();
            if cooling.len() >= MOST_COOLING {
                cooling.retain(|_, until| *until > now);
            }
            if cooling.len() < MOST_COOLING || cooling.contains_key(&peer) {
                cooling.insert(peer, now + COOL_DOWN);
            }
        }
        if let Some(n) = self.0.refused.hit() {
            let peer = peer.map_or_else(|| "-".to_owned(), |p| p.to_string());
            tracing::warn!(
                refused = n,
                last_reason = why.name(),
                last_peer = %peer,
                last_path = ?path,
                "admin request(s) refused since the last report"
            );
        }
    }

    /// Whether `peer` was refused less than `COOL_DOWN` ago.
    fn cooling_down(&self, peer: Option<IpAddr>) -> bool {
        peer.is_some_and(|peer| {
            self.cooling()
                .get(&peer)
                .is_some_and(|until| *until > Instant::now())
        })
    }

    fn cooling(&self) -> MutexGuard<'_, HashMap<IpAddr, Instant>> {
        self.0.cooling.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `route`, answering 401 unless asked with the token or over a connection whose client
/// certificate the client CA verified, when either is configured (429, unchecked, to a peer
/// refused within a second).
pub(super) fn guarded<S>(route: MethodRouter<S>, access: &AdminAccess) -> MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    if !access.closed() {
        return route;
    }
    route.route_layer(middleware::from_fn_with_state(access.clone(), check))
}

async fn check(State(access): State<AdminAccess>, request: Request, next: Next) -> Response {
    if request.extensions().get::<Certified>().is_some() {
        return next.run(request).await;
    }
    let peer = request.extensions().get::<Peer>().map(|p| p.0);
    let path = request.uri().path().to_owned();
    if access.cooling_down(peer) {
        access.refuse(Refusal::Cooling, peer, &path);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            "refused: this peer was refused the admin token less than a second ago\n",
        )
            .into_response();
    }
    let admitted = access
        .token()
        .is_some_and(|token| token.admits(request.headers()));
    if admitted {
        return next.run(request).await;
    }
    access.refuse(Refusal::Token, peer, &path);
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"sluice admin\"")],
        "this endpoint needs the admin token (Authorization: Bearer <the token of \
         --admin-token-file>), or a client certificate of --admin-tls-client-ca\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str) -> (tempfile::TempDir, AdminToken) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, text).unwrap();
        let token = AdminToken::load(&path).unwrap();
        (dir, token)
    }

    fn asked(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, value.parse().unwrap());
        headers
    }

    #[test]
    fn only_the_token_as_a_bearer_is_admitted() {
        let (_dir, token) = token("  s3cret \nignored\n");
        assert!(token.admits(&asked("Bearer s3cret")));
        assert!(token.admits(&asked("bearer s3cret")));
        assert!(!token.admits(&asked("Bearer s3cre")));
        assert!(!token.admits(&asked("Bearer s3cret2")));
        assert!(!token.admits(&asked("Basic s3cret")));
        assert!(!token.admits(&asked("s3cret")));
        assert!(!token.admits(&HeaderMap::new()));
    }

    #[test]
    fn a_file_without_a_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, " \n").unwrap();
        let error = AdminToken::load(&path).err().expect("refused");
        assert!(format!("{error:#}").contains("holds no token"), "{error:#}");
        assert!(AdminToken::load(&dir.path().join("missing")).is_err());
    }
}
