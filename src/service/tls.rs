//! TLS on the gRPC server and on the admin port: the certificate chain and key each presents and,
//! for mTLS, the CAs a client's certificate must chain to, read from PEM files and read again
//! whenever they change; and the handshake each connection makes before it is served. On the
//! gRPC server a client CA makes a certificate required; on the admin port it makes one a way
//! in (`AdminAccess`): a client without one (the kubelet's probes) is still served.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use sluice_core::certs::{self, PemFile};
use sluice_core::log_throttle::LogThrottle;

/// How long a connection may take to complete its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How often the PEM files are read to see whether they changed.
const POLL: Duration = Duration::from_secs(1);

/// The server's TLS configuration in force, shared by every event loop; a connection handshakes
/// with the one in force when it arrives and keeps it.
#[derive(Clone)]
pub struct ServerTls(Arc<Shared>);

struct Shared {
    role: Role,
    files: Files,
    current: ArcSwap<ServerConfig>,
    /// What the files held when the configuration in force at start was made from them.
    loaded: Read,
}

/// Which server a configuration is for: the flags that name its files, the protocol it speaks,
/// and whether a client certificate is required or only verified when presented.
#[derive(Clone, Copy)]
struct Role {
    /// As the logs name its connections.
    name: &'static str,
    flags: [&'static str; 3],
    alpn: &'static [u8],
    certificate_required: bool,
}

const GRPC: Role = Role {
    name: "gRPC",
    flags: ["--tls-cert", "--tls-key", "--tls-client-ca"],
    alpn: b"h2",
    certificate_required: true,
};

const ADMIN: Role = Role {
    name: "admin HTTP",
    flags: [
        "--admin-tls-cert",
        "--admin-tls-key",
        "--admin-tls-client-ca",
    ],
    alpn: b"http/1.1",
    certificate_required: false,
};

impl ServerTls {
    /// The gRPC server's: reads the PEM certificate chain `cert` (leaf first), its private key
    /// `key` and, for mTLS, the CAs a client's certificate must chain to, and makes the
    /// configuration from them; an error names the flag and the file at fault.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<ServerTls> {
        ServerTls::load_for(GRPC, cert, key, client_ca)
    }

    /// The admin port's, as `load` makes the gRPC server's, but a client certificate is only
    /// verified when one is presented: it lets its client in as the admin token does.
    pub fn admin(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<ServerTls> {
        ServerTls::load_for(ADMIN, cert, key, client_ca)
    }

    fn load_for(
        role: Role,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> anyhow::Result<ServerTls> {
        let [cert_flag, key_flag, ca_flag] = role.flags;
        let files = Files {
            cert: PemFile::new(cert_flag, cert),
            key: PemFile::new(key_flag, key),
            client_ca: client_ca.map(|path| PemFile::new(ca_flag, path)),
        };
        let pem = files.read()?;
        let config = files.config(&pem, role)?;
        tracing::info!(
            client_certificates = files.client_ca.is_some(),
            "{} serves TLS only",
            role.name
        );
        Ok(ServerTls(Arc::new(Shared {
            role,
            current: ArcSwap::from_pointee(config),
            loaded: Ok(pem),
            files,
        })))
    }

    /// Whether a client CA is given: a client's certificate is verified against it.
    pub(super) fn verifies_clients(&self) -> bool {
        self.0.files.client_ca.is_some()
    }

    /// Reads the files every `POLL` and puts a set that changed in force once it has stayed the
    /// same for a whole poll (so a certificate written a moment before its key is not logged as a
    /// mismatch) and is valid: new connections use it. A set that cannot be read or is invalid
    /// is logged once, naming the file, and the configuration in force stays.
    pub(super) async fn watch(self) {
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = self.0.loaded.clone();
        let mut decided = last.clone();
        loop {
            tick.tick().await;
            let shared = self.0.clone();
            let Ok(now) = tokio::task::spawn_blocking(move || {
                shared.files.read().map_err(|e| format!("{e:#}"))
            })
            .await
            else {
                continue;
            };
            if now != last {
                last = now;
                continue;
            }
            if now == decided {
                continue;
            }
            decided = now.clone();
            let role = self.0.role;
            let config = now.and_then(|pem| {
                self.0
                    .files
                    .config(&pem, role)
                    .map_err(|e| format!("{e:#}"))
            });
            match config {
                Ok(config) => {
                    self.0.current.store(Arc::new(config));
                    tracing::info!(cert = %self.0.files.cert, "TLS certificates reloaded");
                }
                Err(e) => {
                    tracing::error!("TLS certificates not reloaded, those in force stay: {e}")
                }
            }
        }
    }

    /// The connection's handshake with the configuration in force, within `HANDSHAKE`; a failed
    /// one is logged at most once a second and the connection closed.
    pub(super) async fn accept(&self, stream: TcpStream) -> Option<TlsStream<TcpStream>> {
        let acceptor = TlsAcceptor::from(self.0.current.load_full());
        handshake(acceptor, stream, self.0.role.name).await
    }
}

async fn handshake(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    role: &str,
) -> Option<TlsStream<TcpStream>> {
    static FAILED: LogThrottle = LogThrottle::new();
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown peer".to_owned(), |a| a.to_string());
    let accepted = match tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await {
        Ok(accepted) => accepted,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no TLS handshake within {HANDSHAKE:?}"),
        )),
    };
    match accepted {
        Ok(tls) => Some(tls),
        Err(e) => {
            if let Some(n) = FAILED.hit() {
                tracing::warn!(
                    "{n} failed TLS handshake(s) on {role} connections, the last from {peer}: {e}"
                );
            }
            None
        }
    }
}

/// The files, each with the flag that named it.
struct Files {
    cert: PemFile,
    key: PemFile,
    client_ca: Option<PemFile>,
}

/// What the files held, or why they could not be read.
type Read = Result<Pem, String>;

#[derive(Clone, PartialEq, Eq)]
struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Files {
    fn read(&self) -> anyhow::Result<Pem> {
        Ok(Pem {
            cert: self.cert.read()?,
            key: self.key.read()?,
            client_ca: self.client_ca.as_ref().map(PemFile::read).transpose()?,
        })
    }

    /// The server configuration: this chain and key, client certificates verified when a
    /// client CA is given (required, as `role` says), and `role`'s protocol as the only one.
    fn config(&self, pem: &Pem, role: Role) -> anyhow::Result<ServerConfig> {
        let provider = certs::provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("the TLS provider")?;
        let builder = match self.client_ca.as_ref().zip(pem.client_ca.as_ref()) {
            Some((file, bytes)) => {
                let roots = Arc::new(file.roots(bytes)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
                let verifier = if role.certificate_required {
                    verifier
                } else {
                    verifier.allow_unauthenticated()
                };
                let verifier = verifier.build().with_context(|| format!("{file}"))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let chain = self.cert.certificates(&pem.cert)?;
        let key = self.key.key(&pem.key)?;
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| certs::refused_pair(&self.cert, &self.key, e))?;
        config.alpn_protocols = vec![role.alpn.to_vec()];
        Ok(config)
    }
}
