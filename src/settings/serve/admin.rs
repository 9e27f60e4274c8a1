//! Who may use the admin endpoints that show client values or move counters: a bearer token
//! read from a file, or a client certificate on the admin port's TLS; and whether the admin port
//! is trusted to change counters without either.

use std::path::PathBuf;

use clap::Args;

use crate::service::tls::ServerTls;
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
    /// Serve the admin port (--http-addr) over TLS only, presenting this PEM certificate chain
    /// (leaf first).
    #[arg(long, env = "SLUICE_ADMIN_TLS_CERT", requires = "admin_tls_key")]
    admin_tls_cert: Option<PathBuf>,
    /// The PEM private key of --admin-tls-cert: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
    #[arg(long, env = "SLUICE_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    admin_tls_key: Option<PathBuf>,
    /// A client presenting a certificate signed by a CA of this PEM bundle is let in as the
    /// admin token lets its holder in (mTLS); a client without one (a probe) is still served.
    ///
    /// With it, /top, /explain, /counters and /json ask for the token or such a certificate.
    #[arg(long, env = "SLUICE_ADMIN_TLS_CLIENT_CA", requires = "admin_tls_cert")]
    admin_tls_client_ca: Option<PathBuf>,
}

impl AdminFlags {
    /// Who may use the admin endpoints: the admin token and the admin port's TLS, read now, and
    /// whether the port is trusted; an open door said in a warning.
    pub fn access(&self, json: JsonAt, telemetry: Telemetry) -> anyhow::Result<AdminAccess> {
        let token = self
            .admin_token_file
            .as_deref()
            .map(AdminToken::load)
            .transpose()?;
        let tls = match (&self.admin_tls_cert, &self.admin_tls_key) {
            (Some(cert), Some(key)) => Some(ServerTls::admin(
                cert,
                key,
                self.admin_tls_client_ca.as_deref(),
            )?),
            _ => None,
        };
        if token.is_none() && self.admin_tls_client_ca.is_none() {
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
        }
        Ok(AdminAccess::new(
            token,
            tls,
            self.trust_admin_port,
            telemetry,
        ))
    }
}
