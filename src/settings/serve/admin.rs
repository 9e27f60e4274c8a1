//! Who may use the admin endpoints that show client values or move counters: a bearer token
//! read from a file.

use std::path::PathBuf;

use clap::Args;

use crate::service::{AdminToken, JsonAt};

#[derive(Args)]
#[command(next_help_heading = "Admin authentication")]
pub struct AdminFlags {
    /// A file holding the admin token (its first line): /top, /explain, /counters and /json then
    /// answer 401 unless asked with `Authorization: Bearer <token>`.
    ///
    /// The probes, /metrics, /config, /rlconfig and / stay open. The file is read again every
    /// second: a new token is in force within about a second, and one that cannot be read
    /// leaves the token in force.
    #[arg(long, env = "SLUICE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
}

impl AdminFlags {
    /// The admin token, read now; `None` without one, said in a warning: `/counters` (and
    /// `/json`, when served) move counters.
    pub fn token(&self, json: JsonAt) -> anyhow::Result<Option<AdminToken>> {
        match &self.admin_token_file {
            Some(path) => AdminToken::load(path).map(Some),
            None => {
                let moving = if json == JsonAt::Off {
                    "/counters resets and sets counters"
                } else {
                    "/counters resets and sets counters, /json moves them"
                };
                tracing::warn!(
                    "the admin endpoints are open to anyone who reaches them: {moving}, /top and /explain show client values; --admin-token-file puts them behind a bearer token"
                );
                Ok(None)
            }
        }
    }
}
