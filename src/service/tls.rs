//! TLS on the gRPC server: the certificate chain and key it presents and, for mTLS, the CAs a
//! client's certificate must chain to, read from PEM files and read again whenever they change;
//! and the handshake each connection makes on its event loop before it is served.

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

use crate::certs::{self, PemFile};
use crate::throttle::Throttle;

/// How long a connection may take to complete its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How often the PEM files are read to see whether they changed.
const POLL: Duration = Duration::from_secs(1);

/// The server's TLS configuration in force, shared by every event loop; a connection handshakes
/// with the one in force when it arrives and keeps it.
#[derive(Clone)]
pub struct ServerTls(Arc<Shared>);

struct Shared {
    files: Files,
    current: ArcSwap<ServerConfig>,
    /// What the files held when the configuration in force at start was made from them.
    loaded: Read,
}

impl ServerTls {
    /// Reads the PEM certificate chain `cert` (leaf first), its private key `key` and, for
    /// mTLS, the CAs a client's certificate must chain to, and makes the configuration from
    /// them; an error names the flag and the file at fault.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<ServerTls> {
        let files = Files {
            cert: PemFile::new("--tls-cert", cert),
            key: PemFile::new("--tls-key", key),
            client_ca: client_ca.map(|path| PemFile::new("--tls-client-ca", path)),
        };
        let pem = files.read()?;
        let config = files.config(&pem)?;
        tracing::info!(
            client_certificates = files.client_ca.is_some(),
            "gRPC serves TLS only"
        );
        Ok(ServerTls(Arc::new(Shared {
            current: ArcSwap::from_pointee(config),
            loaded: Ok(pem),
            files,
        })))
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
            let config =
                now.and_then(|pem| self.0.files.config(&pem).map_err(|e| format!("{e:#}")));
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
        handshake(TlsAcceptor::from(self.0.current.load_full()), stream).await
    }
}

async fn handshake(acceptor: TlsAcceptor, stream: TcpStream) -> Option<TlsStream<TcpStream>> {
    static FAILED: Throttle = Throttle::new();
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
                    "{n} failed TLS handshake(s) on gRPC connections, the last from {peer}: {e}"
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

    /// The server configuration: this chain and key, client certificates required when a client
    /// CA is given, and HTTP/2 (gRPC) as the only application protocol.
    fn config(&self, pem: &Pem) -> anyhow::Result<ServerConfig> {
        let provider = certs::provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("the TLS provider")?;
        let builder = match self.client_ca.as_ref().zip(pem.client_ca.as_ref()) {
            Some((file, bytes)) => {
                let roots = Arc::new(file.roots(bytes)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                    .build()
                    .with_context(|| format!("{file}"))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let chain = self.cert.certificates(&pem.cert)?;
        let key = self.key.key(&pem.key)?;
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| certs::refused_pair(&self.cert, &self.key, e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}
