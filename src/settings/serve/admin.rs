//! Who may use the admin endpoints that show client values or move counters: a bearer token
//! read from a file; and whether the admin port is trusted to change counters without it.

use std::path::PathBuf;

use clap::Args;

use crate::service::{AdminAccess, AdminToken, JsonAt};
use crate::telemetry::Telemetry;

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
    /// Let anyone who reaches the admin port change counters through /counters (reset, set,
    /// add) without the admin token.
    ///
    /// Without a token and without this flag, /counters shows counters and answers dry runs,
    /// and refuses every change (403). For an admin port only trusted people reach (a loopback
    /// address, a network policy).
    #[arg(long, env = "SLUICE_TRUST_ADMIN_PORT")]
    trust_admin_port: bool,
}

impl AdminFlags {
    /// Who may use the admin endpoints: the admin token, read now, and whether the port is
    /// trusted; an open door said in a warning.
    pub fn access(&self, json: JsonAt, telemetry: Telemetry) -> anyhow::Result<AdminAccess> {
        let token = match &self.admin_token_file {
            Some(path) => Some(AdminToken::load(path)?),
            None => {
                let json = if json == JsonAt::Off {
                    ""
                } else {
                    ", /json charges them"
                };
                let counters = if self.trust_admin_port {
                    "/counters resets and sets counters (--trust-admin-port)"
                } else {
                    "/counters shows counters and changes none"
                };
                tracing::warn!(
                    "the admin endpoints are open to anyone who reaches them: {counters}{json}, \
                     /top and /explain show client values; --admin-token-file puts them behind a \
                     bearer token"
                );
                None
            }
        };
        Ok(AdminAccess::new(token, self.trust_admin_port, telemetry))
    }
}
