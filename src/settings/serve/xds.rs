//! The rules over xDS: the server `serve` subscribes to instead of reading `--config`, how it
//! introduces itself, the TLS it connects with and the largest response it accepts.

use std::path::PathBuf;

use clap::Args;

use crate::xds::{Server, Tls};

#[derive(Args)]
#[command(next_help_heading = "Rules over xDS")]
pub struct XdsFlags {
    /// Take the rules from this xDS server (HOST:PORT, no scheme), instead of --config:
    /// envoyproxy/ratelimit's CONFIG_GRPC_XDS_SERVER_URL.
    #[arg(long, env = "SLUICE_XDS_SERVER", value_name = "HOST:PORT")]
    xds_server: Option<String>,
    /// The node id sent to the xDS server (Envoy Gateway serves `envoy-ratelimit`).
    #[arg(long, env = "SLUICE_XDS_NODE_ID", default_value = "default")]
    xds_node_id: String,
    /// The node metadata sent to the xDS server, `k=v,k2=v2` (string values; an entry without
    /// `=` is skipped, as envoyproxy/ratelimit skips it).
    #[arg(long, env = "SLUICE_XDS_NODE_METADATA", default_value = "")]
    xds_node_metadata: String,
    /// Trust the CAs of this PEM file for the xDS server's certificate, besides the system's;
    /// any --xds-tls-* flag makes the connection TLS.
    #[arg(long, env = "SLUICE_XDS_TLS_CA", requires = "xds_server")]
    xds_tls_ca: Option<PathBuf>,
    /// Present this PEM client certificate chain to the xDS server.
    #[arg(long, env = "SLUICE_XDS_TLS_CERT", requires_all = ["xds_tls_key", "xds_server"])]
    xds_tls_cert: Option<PathBuf>,
    /// The PEM private key of --xds-tls-cert: PKCS#8, PKCS#1 (RSA PRIVATE KEY) or SEC1.
    #[arg(long, env = "SLUICE_XDS_TLS_KEY", requires = "xds_tls_cert")]
    xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry (default: the host of --xds-server).
    #[arg(long, env = "SLUICE_XDS_TLS_SERVER_NAME", requires = "xds_server")]
    xds_tls_server_name: Option<String>,
    /// The largest xDS response accepted, in bytes: Envoy Gateway sends every domain in one.
    #[arg(long, env = "SLUICE_XDS_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024 * 1024)]
    xds_max_message_bytes: usize,
}

impl XdsFlags {
    /// The xDS server to take the rules from; `None` without --xds-server.
    pub(super) fn server(&self) -> Option<Server> {
        let address = self.xds_server.clone()?;
        let tls = (self.xds_tls_ca.is_some() || self.xds_tls_cert.is_some()).then(|| Tls {
            ca: self.xds_tls_ca.clone(),
            identity: self.xds_tls_cert.clone().zip(self.xds_tls_key.clone()),
            server_name: self.xds_tls_server_name.clone(),
        });
        let node_metadata = self
            .xds_node_metadata
            .split(',')
            .filter_map(|entry| entry.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Some(Server {
            address,
            node_id: self.xds_node_id.clone(),
            node_metadata,
            tls,
            max_message_bytes: self.xds_max_message_bytes,
        })
    }
}
