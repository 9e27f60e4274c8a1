//! The admin token (`--admin-token-file`): with one, the admin endpoints that show client values
//! or move counters (`/top`, `/explain`, `/counters`, `/json`) answer 401 unless asked with
//! `Authorization: Bearer <token>`; the probes, `/metrics`, `/config`, `/rlconfig` and `/` stay
//! open. The file is read again every second, so a token is rotated without a restart; a file
//! that cannot be read or holds no token is logged, and the token in force stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;

/// How often the token file is read to see whether it changed.
const POLL: Duration = Duration::from_secs(1);
/// The longest token a file may hold.
const LONGEST_TOKEN: usize = 4096;

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

/// Compares in time that depends on the lengths alone, not on where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// `route`, answering 401 unless asked with the token when there is one.
pub(super) fn guarded<S>(route: MethodRouter<S>, token: Option<&AdminToken>) -> MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    match token {
        Some(token) => route.route_layer(middleware::from_fn_with_state(token.clone(), check)),
        None => route,
    }
}

async fn check(State(token): State<AdminToken>, request: Request, next: Next) -> Response {
    if token.admits(request.headers()) {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"sluice admin\"")],
        "this endpoint needs the admin token: Authorization: Bearer <the token of --admin-token-file>\n",
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
