//! A test xDS server: Aggregated Discovery Service (State of the World) on a loopback port,
//! serving the `RateLimitConfig` snapshot a test sets and recording every request it receives.
//! Like go-control-plane's snapshot cache (Envoy Gateway's), it sends a snapshot on a new stream
//! only when its version differs from the one the request names. It can require TLS 1.3 and a
//! client certificate, as Envoy Gateway's does, and be stopped and started again on its port
//! with a fresh state. Also the certificates for such tests, made as Envoy Gateway's certgen
//! makes them (`certgen`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use futures_util::Stream;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// A rule of `n` per `unit` on (`key`, `value`; empty: any value).
pub fn rule(key: &str, value: &str, unit: RateLimitUnit, n: u32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        rate_limit: Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: n,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A rule without a limit of its own, over `children`.
pub fn nest(key: &str, value: &str, children: Vec<RateLimitDescriptor>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        descriptors: children,
        ..Default::default()
    }
}

/// `config` as the resource of a DiscoveryResponse.
pub fn resource(config: &RateLimitConfig) -> Any {
    Any {
        type_url: TYPE_URL.into(),
        value: prost::Message::encode_to_vec(config),
    }
}

/// The configuration of one domain, named after it (as Envoy Gateway names them).
pub fn domain(name: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: name.into(),
        descriptors,
    }
}

/// A snapshot: its version and its resources.
type Snapshot = Option<(String, Vec<Any>)>;

/// One DiscoveryRequest, as the server received it.
#[derive(Clone, Debug)]
pub struct Received {
    pub version: String,
    pub nonce: String,
    /// `error_detail.message` of a NACK.
    pub error: Option<String>,
    pub node: Option<Node>,
    pub type_url: String,
    pub resource_names: Vec<String>,
}

/// The TLS files of a server that requires a client certificate.
#[derive(Clone, Debug)]
pub struct ServerTlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A running (or stopped) test xDS server.
pub struct XdsServer {
    pub addr: SocketAddr,
    snapshot: watch::Sender<Snapshot>,
    received: Arc<Mutex<Vec<Received>>>,
    tls: Option<ServerTlsFiles>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl XdsServer {
    /// A plaintext server on a free loopback port, with no snapshot yet.
    pub fn start() -> XdsServer {
        XdsServer::start_with(None)
    }

    /// A server speaking only TLS 1.3 and requiring a client certificate signed by `tls.ca`.
    pub fn start_tls(tls: ServerTlsFiles) -> XdsServer {
        XdsServer::start_with(Some(tls))
    }

    fn start_with(tls: Option<ServerTlsFiles>) -> XdsServer {
        let (snapshot, _) = watch::channel(None);
        let mut server = XdsServer {
            addr: SocketAddr::from(([127, 0, 0, 1], super::free_port())),
            snapshot,
            received: Arc::default(),
            tls,
            runtime: None,
        };
        server.run();
        server
    }

    /// The address as `--xds-server` takes it.
    pub fn target(&self) -> String {
        self.addr.to_string()
    }

    /// Serves `configs` as the snapshot `version`, to every stream.
    pub fn set(&self, version: &str, configs: &[RateLimitConfig]) {
        let resources = configs
            .iter()
            .map(|c| Any {
                type_url: TYPE_URL.into(),
                value: c.encode_to_vec(),
            })
            .collect();
        self.set_raw(version, resources);
    }

    /// Serves `resources` as they are (of any type) as the snapshot `version`.
    pub fn set_raw(&self, version: &str, resources: Vec<Any>) {
        self.snapshot
            .send_replace(Some((version.to_owned(), resources)));
    }

    /// Every request received so far, since the first start.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Waits (at most `limit`) for a request that `wanted` accepts, and returns it.
    pub async fn wait_for(
        &self,
        limit: Duration,
        wanted: impl Fn(&Received) -> bool,
    ) -> Option<Received> {
        self.wait_for_from(0, limit, wanted).await
    }

    /// As `wait_for`, among the requests received after the first `from`.
    pub async fn wait_for_from(
        &self,
        from: usize,
        limit: Duration,
        wanted: impl Fn(&Received) -> bool,
    ) -> Option<Received> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(r) = self.received().into_iter().skip(from).find(|r| wanted(r)) {
                return Some(r);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Stops the server: every connection is dropped at once, as when its process dies.
    pub fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// Starts it again on the same port, as a new process: no snapshot until one is set.
    pub fn restart(&mut self) {
        self.stop();
        self.snapshot.send_replace(None);
        self.run();
    }

    fn run(&mut self) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the xDS server");
        let service = Ads {
            snapshot: self.snapshot.clone(),
            received: self.received.clone(),
        };
        let addr = self.addr;
        let acceptor = self.tls.as_ref().map(acceptor);
        let listener = (0..100)
            .find_map(|_| {
                let bound = std::net::TcpListener::bind(addr);
                if bound.is_err() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                bound.ok()
            })
            .unwrap_or_else(|| panic!("the xDS server's port {addr} stays taken"));
        listener.set_nonblocking(true).unwrap();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let server = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(service));
            match acceptor {
                None => {
                    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                    let _ = server.serve_with_incoming(incoming).await;
                }
                Some(acceptor) => {
                    let (handshaken, incoming) = mpsc::channel(16);
                    tokio::spawn(async move {
                        while let Ok((tcp, _)) = listener.accept().await {
                            let acceptor = acceptor.clone();
                            let handshaken = handshaken.clone();
                            tokio::spawn(async move {
                                if let Ok(tls) = acceptor.accept(tcp).await {
                                    let _ = handshaken.send(Ok::<_, std::io::Error>(tls)).await;
                                }
                            });
                        }
                    });
                    let _ = server
                        .serve_with_incoming(ReceiverStream::new(incoming))
                        .await;
                }
            }
        });
        self.runtime = Some(runtime);
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// TLS 1.3 only, a client certificate required, ALPN h2: Envoy Gateway's xDS server.
fn acceptor(files: &ServerTlsFiles) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(&files.ca).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// The ADS service: one task per stream.
struct Ads {
    snapshot: watch::Sender<Snapshot>,
    received: Arc<Mutex<Vec<Received>>>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaResponses = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;
    type DeltaAggregatedResourcesStream = DeltaResponses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut requests = request.into_inner();
        let mut snapshot = self.snapshot.subscribe();
        let received = self.received.clone();
        let (out, responses) = mpsc::channel(16);
        tokio::spawn(async move {
            // The version this stream has: what its first request names, then what was sent.
            let mut has: Option<String> = None;
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    request = requests.next() => {
                        let Some(Ok(r)) = request else { return };
                        received.lock().unwrap().push(Received {
                            version: r.version_info.clone(),
                            nonce: r.response_nonce.clone(),
                            error: r.error_detail.as_ref().map(|e| e.message.clone()),
                            node: r.node.clone(),
                            type_url: r.type_url.clone(),
                            resource_names: r.resource_names.clone(),
                        });
                        if has.is_none() {
                            has = Some(r.version_info.clone());
                        } else {
                            continue;
                        }
                    }
                    changed = snapshot.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        if has.is_none() {
                            continue;
                        }
                    }
                }
                let current = snapshot.borrow_and_update().clone();
                let Some((version, resources)) = current else {
                    continue;
                };
                if has.as_deref() == Some(version.as_str()) {
                    continue;
                }
                nonce += 1;
                let response = DiscoveryResponse {
                    version_info: version.clone(),
                    resources,
                    type_url: TYPE_URL.into(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if out.send(Ok(response)).await.is_err() {
                    return;
                }
                has = Some(version);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(responses))))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaResponses>, Status> {
        Err(Status::unimplemented("State of the World only"))
    }
}

/// Certificates as Envoy Gateway's certgen makes them: RSA 2048 with PKCS#1 (`RSA PRIVATE KEY`)
/// keys, one CA, no ExtendedKeyUsage.
#[derive(Clone, Debug)]
pub struct Certs {
    pub ca: PathBuf,
    /// For a server named `localhost` (SAN DNS:localhost, IP:127.0.0.1).
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A client certificate (CN `envoy-rate-limit`).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// Makes the certificates in `dir` with the openssl command.
pub fn certgen(dir: &Path) -> Certs {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&["genrsa", "-traditional", "-out", "ca.key", "2048"]);
    openssl(&[
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-days",
        "365",
        "-subj",
        "/CN=envoy-gateway",
        "-out",
        "ca.crt",
    ]);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    // Any extension makes a version 3 certificate, which TLS libraries require.
    std::fs::write(dir.join("client.ext"), "basicConstraints=CA:FALSE\n").unwrap();
    for (name, ext) in [("server", "server.ext"), ("client", "client.ext")] {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let crt = format!("{name}.crt");
        let subject = format!(
            "/CN={}",
            if name == "server" {
                "localhost"
            } else {
                "envoy-rate-limit"
            }
        );
        openssl(&["genrsa", "-traditional", "-out", &key, "2048"]);
        openssl(&["req", "-new", "-key", &key, "-subj", &subject, "-out", &csr]);
        let args = [
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "365",
            "-extfile",
            ext,
            "-out",
            &crt,
        ];
        openssl(&args);
    }
    Certs {
        ca: dir.join("ca.crt"),
        server_cert: dir.join("server.crt"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.crt"),
        client_key: dir.join("client.key"),
    }
}
