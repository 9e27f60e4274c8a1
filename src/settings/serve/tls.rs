//! TLS on the gRPC server: the PEM certificate chain and key it presents and, for mTLS, the
//! CAs a client's certificate must chain to (read again whenever they change).

use std::path::PathBuf;

use clap::Args;

use crate::service::tls::ServerTls;

#[derive(Args)]
#[command(next_help_heading = "gRPC server TLS")]
pub struct TlsFlags {
    /// Serve gRPC over TLS only, presenting this PEM certificate chain (leaf first).
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require every client to present a certificate signed by a CA of this PEM bundle (mTLS).
    #[arg(long, env = "SLUICE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
}

impl TlsFlags {
    /// The server's TLS, its files read and checked now; `None` without them: plaintext.
    pub fn server_tls(&self) -> anyhow::Result<Option<ServerTls>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        ServerTls::load(cert, key, self.tls_client_ca.as_deref()).map(Some)
    }
}
