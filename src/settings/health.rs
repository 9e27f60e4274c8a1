//! `health`'s arguments: the gRPC address to ask (by default the one `serve` listens on in this
//! environment) and the TLS to ask it over.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use clap::Args;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use sluice_core::certs::PemFile;

#[derive(Args)]
pub struct HealthArgs {
    /// The gRPC address to ask [default: the address `serve` listens on, from
    /// SLUICE_GRPC_ADDR (an unspecified IP such as 0.0.0.0 asked on loopback), else
    /// 127.0.0.1:8081].
    #[arg(long, env = "SLUICE_HEALTH_TARGET")]
    target: Option<SocketAddr>,
    #[command(flatten)]
    tls: HealthTls,
}

/// TLS for `sluice health`.
#[derive(Args)]
struct HealthTls {
    /// Connect over TLS, trusting the CAs of this PEM file.
    #[arg(long = "tls-ca", env = "SLUICE_HEALTH_TLS_CA")]
    ca: Option<PathBuf>,
    /// Present this PEM client certificate, to a server that requires one.
    #[arg(long = "tls-cert", env = "SLUICE_HEALTH_TLS_CERT", requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long = "tls-key", env = "SLUICE_HEALTH_TLS_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// The name the server's certificate must hold [default: localhost for a loopback target,
    /// else the target's address].
    #[arg(
        long = "tls-server-name",
        env = "SLUICE_HEALTH_TLS_SERVER_NAME",
        requires = "ca"
    )]
    server_name: Option<String>,
}

impl HealthArgs {
    /// The address to ask.
    pub fn target(&self) -> SocketAddr {
        self.target.unwrap_or_else(served_grpc_addr)
    }

    /// The gRPC endpoint of the target: over TLS when a CA is given, else plaintext.
    pub fn endpoint(&self) -> anyhow::Result<Endpoint> {
        let target = self.target();
        let tls = &self.tls;
        let Some(ca) = &tls.ca else {
            return Ok(Endpoint::from_shared(format!("http://{target}"))?);
        };
        let name = tls.server_name.clone().unwrap_or_else(|| {
            if target.ip().is_loopback() {
                "localhost".to_owned()
            } else {
                target.ip().to_string()
            }
        });
        let ca = PemFile::new("--tls-ca", ca).read()?;
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(name);
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            let cert = PemFile::new("--tls-cert", cert).read()?;
            let key = PemFile::new("--tls-key", key).read()?;
            config = config.identity(Identity::from_pem(cert, key));
        }
        Ok(Endpoint::from_shared(format!("https://{target}"))?.tls_config(config)?)
    }
}

/// Where `serve` listens for gRPC in this environment (SLUICE_GRPC_ADDR, else its default), as
/// a client reaches it: an unspecified IP (0.0.0.0, ::) on loopback. An image's health check
/// thus follows the address its server was given.
fn served_grpc_addr() -> SocketAddr {
    let mut addr = std::env::var("SLUICE_GRPC_ADDR")
        .ok()
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 8081)));
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}
