//! TLS, with certificates each test makes: gRPC over TLS (a plaintext client is refused) and mTLS
//! (only a certificate from the client CA is served), certificates re-read when they change,
//! keys in every PEM form, start-up errors naming the flag and file, `sluice health` over TLS, a
//! real Envoy speaking mTLS to sluice, and sluice counting in a Redis that speaks TLS only and
//! requires a client certificate. Needs `openssl`, `redis-server` and Envoy (see tests/envoy/envoy.rs).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use support::envoy::{Envoy, Filter, Upstream, UpstreamTls, envoy_binary};
use support::redis::TlsRedis;
use support::{
    HOUR, OK, OVER_LIMIT, Sluice, Wait, eventually, http, in_one_window, openssl, request,
};

/// Three requests an hour per `generic_key` value; a test counting them runs `in_one_window` of
/// an hour.
const RULES: &str = "\
domain: tls
descriptors:
  - key: generic_key
    rate_limit:
      unit: hour
      requests_per_unit: 3
";
const LIMIT: usize = 3;

/// The names in every server certificate.
const SERVER_NAMES: &[&str] = &["localhost", "127.0.0.1"];

/// The longest a test waits for a connection, an answer, or a change to show.
const PATIENCE: Duration = Duration::from_secs(15);

/// A CA that signs a test's certificates.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// What a certificate is for.
#[derive(Clone, Copy)]
enum Role {
    Server,
    Client,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("a CA key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("a CA certificate"),
        }
    }

    /// Writes the CA's certificate to `dir/<name>.pem`.
    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(&path, self.issuer.pem()).expect("CA certificate written");
        path
    }

    /// A certificate for `key`, signed by this CA: a server's holds `SERVER_NAMES`.
    fn sign(&self, key: &KeyPair, role: Role) -> String {
        let (names, usage) = match role {
            Role::Server => (SERVER_NAMES, ExtendedKeyUsagePurpose::ServerAuth),
            Role::Client => (&[][..], ExtendedKeyUsagePurpose::ClientAuth),
        };
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("valid names");
        params
            .distinguished_name
            .push(DnType::CommonName, "sluice test");
        params.extended_key_usages = vec![usage];
        params
            .signed_by(key, &self.issuer)
            .expect("a certificate")
            .pem()
    }

    /// A new key and its certificate, as PEM.
    fn issue(&self, role: Role) -> (String, String) {
        let key = KeyPair::generate().expect("a key");
        (self.sign(&key, role), key.serialize_pem())
    }
}

/// A certificate file and its key file.
struct Pair {
    cert: PathBuf,
    key: PathBuf,
}

impl Pair {
    /// A new key and a certificate from `ca`, written to `dir/<name>.pem` and `dir/<name>-key.pem`.
    fn issue(ca: &Ca, role: Role, dir: &Path, name: &str) -> Pair {
        let (cert, key) = ca.issue(role);
        let pair = Pair {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
        };
        std::fs::write(&pair.cert, cert).expect("certificate written");
        std::fs::write(&pair.key, key).expect("key written");
        pair
    }
}

/// One test's certificates, in a directory of their own: a CA, a server certificate and a client
/// certificate it signed, and a client certificate that another CA signed.
struct Pki {
    dir: tempfile::TempDir,
    authority: Ca,
    ca: PathBuf,
    server: Pair,
    client: Pair,
    stranger: Pair,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let authority = Ca::new("sluice test CA");
        let other = Ca::new("another CA");
        Pki {
            ca: authority.write(dir.path(), "ca"),
            server: Pair::issue(&authority, Role::Server, dir.path(), "server"),
            client: Pair::issue(&authority, Role::Client, dir.path(), "client"),
            stranger: Pair::issue(&other, Role::Client, dir.path(), "stranger"),
            authority,
            dir,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `serve` flags for TLS with the server certificate, and mTLS when `mutual`.
    fn serve_flags(&self, mutual: bool) -> Vec<String> {
        let mut flags = vec![
            "--tls-cert".to_owned(),
            text(&self.server.cert),
            "--tls-key".to_owned(),
            text(&self.server.key),
        ];
        if mutual {
            flags.extend(["--tls-client-ca".to_owned(), text(&self.ca)]);
        }
        flags
    }
}

fn text(path: &Path) -> String {
    path.to_str().expect("a UTF-8 path").to_owned()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Starts sluice with `RULES` and `flags`, waiting until its admin server answers (its gRPC
/// health cannot be asked in plaintext once it speaks TLS).
async fn serve(flags: &[String]) -> Sluice {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, Wait::Live).await
}

/// A gRPC connection over TLS trusting `ca`, presenting `client` when given.
async fn tls_channel(
    grpc: SocketAddr,
    ca: &Path,
    client: Option<&Pair>,
) -> Result<Channel, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(ca)))
        .domain_name("localhost");
    if let Some(pair) = client {
        tls = tls.identity(Identity::from_pem(read(&pair.cert), read(&pair.key)));
    }
    let endpoint = Endpoint::from_shared(format!("https://{grpc}"))
        .unwrap()
        .tls_config(tls)
        .expect("a TLS configuration")
        .connect_timeout(PATIENCE);
    match tokio::time::timeout(PATIENCE, endpoint.connect()).await {
        Ok(connected) => connected.map_err(|e| format!("{e:?}")),
        Err(_) => Err("no connection in time".to_owned()),
    }
}

/// Asks on `channel` about a descriptor no rule limits.
async fn ask_on(channel: Channel) -> Result<RateLimitResponse, String> {
    let unlimited = request("tls", &[&[("unlimited", "probe")]]);
    let mut client = RateLimitServiceClient::new(channel);
    match tokio::time::timeout(PATIENCE, client.should_rate_limit(unlimited)).await {
        Ok(answer) => answer
            .map(|a| a.into_inner())
            .map_err(|status| format!("{status:?}")),
        Err(_) => Err("no answer in time".to_owned()),
    }
}

/// Connects over TLS as `tls_channel` does and asks as `ask_on` does: TLS 1.3 refuses a client
/// certificate after the client has finished its handshake, so a refusal may show only here.
async fn ask_tls(
    grpc: SocketAddr,
    ca: &Path,
    client: Option<&Pair>,
) -> Result<RateLimitResponse, String> {
    ask_on(tls_channel(grpc, ca, client).await?).await
}

/// Runs `sluice` with `args` and returns what it printed once it exits; killed after `PATIENCE`.
fn run_sluice(args: &[String]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the sluice binary starts");
    let deadline = Instant::now() + PATIENCE;
    while child.try_wait().expect("waiting for sluice").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("sluice's output");
            panic!(
                "sluice {args:?} still runs after {PATIENCE:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("sluice's output")
}

/// `sluice health` against `grpc` with extra `args`: whether it exited 0, and what it printed.
fn health(grpc: SocketAddr, args: &[String]) -> (bool, String) {
    let mut all = vec!["health".to_owned(), "--target".to_owned(), grpc.to_string()];
    all.extend_from_slice(args);
    let out = run_sluice(&all);
    let printed =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), printed)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tls_client_is_served_and_a_plaintext_one_is_refused() {
    let pki = Pki::new();
    let sluice = serve(&pki.serve_flags(false)).await;

    let answer = ask_tls(sluice.grpc, &pki.ca, None)
        .await
        .expect("a TLS client trusting the CA is served");
    assert_eq!(answer.overall_code, OK);

    let plaintext = async {
        let channel = Channel::from_shared(format!("http://{}", sluice.grpc))
            .unwrap()
            .connect()
            .await
            .map_err(|e| format!("{e:?}"))?;
        ask_on(channel).await
    };
    let refused = tokio::time::timeout(PATIENCE, plaintext).await;
    assert!(
        matches!(refused, Ok(Err(_))),
        "a plaintext client is refused: {refused:?}"
    );

    let ca = vec!["--tls-ca".to_owned(), text(&pki.ca)];
    let (serving, printed) = health(sluice.grpc, &ca);
    assert!(serving, "sluice health --tls-ca: {printed}");
    assert_eq!(printed.trim(), "SERVING");
}

#[tokio::test(flavor = "multi_thread")]
async fn under_mtls_only_a_client_with_a_certificate_from_the_client_ca_is_served() {
    let pki = Pki::new();
    let sluice = serve(&pki.serve_flags(true)).await;

    let anonymous = ask_tls(sluice.grpc, &pki.ca, None).await;
    assert!(
        anonymous.is_err(),
        "a client without a certificate is refused: {anonymous:?}"
    );
    let stranger = ask_tls(sluice.grpc, &pki.ca, Some(&pki.stranger)).await;
    assert!(
        stranger.is_err(),
        "a client whose certificate another CA signed is refused: {stranger:?}"
    );
    let answer = ask_tls(sluice.grpc, &pki.ca, Some(&pki.client))
        .await
        .expect("a client with a certificate from the client CA is served");
    assert_eq!(answer.overall_code, OK);

    let ca = vec!["--tls-ca".to_owned(), text(&pki.ca)];
    let (serving, printed) = health(sluice.grpc, &ca);
    assert!(
        !serving,
        "sluice health without a client certificate is refused: {printed}"
    );
    let mut with_certificate = ca;
    with_certificate.extend([
        "--tls-cert".to_owned(),
        text(&pki.client.cert),
        "--tls-key".to_owned(),
        text(&pki.client.key),
        "--tls-server-name".to_owned(),
        "localhost".to_owned(),
    ]);
    let (serving, printed) = health(sluice.grpc, &with_certificate);
    assert!(
        serving,
        "sluice health with a client certificate: {printed}"
    );
}

/// A Kubernetes Secret volume: each file is a symlink through `..data`, a symlink to the
/// directory of the current generation, which an update replaces by renaming a new symlink
/// over it, so that every file changes at once.
struct SecretVolume {
    dir: PathBuf,
    generation: usize,
}

impl SecretVolume {
    fn new(dir: PathBuf, cert: &[u8], key: &[u8]) -> SecretVolume {
        std::fs::create_dir(&dir).expect("the volume's directory");
        let mut volume = SecretVolume { dir, generation: 0 };
        volume.publish(cert, key);
        for file in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(format!("..data/{file}"), volume.dir.join(file))
                .expect("a file's symlink");
        }
        volume
    }

    /// Writes a new generation holding `cert` and `key` and swaps `..data` to it.
    fn publish(&mut self, cert: &[u8], key: &[u8]) {
        self.generation += 1;
        let generation = format!("..generation-{}", self.generation);
        let dir = self.dir.join(&generation);
        std::fs::create_dir(&dir).expect("a generation's directory");
        std::fs::write(dir.join("tls.crt"), cert).expect("tls.crt written");
        std::fs::write(dir.join("tls.key"), key).expect("tls.key written");
        let swap = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&generation, &swap).expect("the new ..data");
        std::fs::rename(&swap, self.dir.join("..data")).expect("..data swapped");
        if self.generation > 1 {
            let previous = self
                .dir
                .join(format!("..generation-{}", self.generation - 1));
            std::fs::remove_dir_all(previous).expect("the previous generation removed");
        }
    }

    fn flags(&self) -> Vec<String> {
        vec![
            "--tls-cert".to_owned(),
            text(&self.dir.join("tls.crt")),
            "--tls-key".to_owned(),
            text(&self.dir.join("tls.key")),
        ]
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn changed_certificates_serve_new_connections_and_a_broken_set_leaves_the_last_good_one() {
    let pki = Pki::new();
    let mut volume = SecretVolume::new(
        pki.path().join("secret"),
        &read(&pki.server.cert),
        &read(&pki.server.key),
    );
    let sluice = serve(&volume.flags()).await;
    let earlier = tls_channel(sluice.grpc, &pki.ca, None)
        .await
        .expect("a connection under the first certificate");
    ask_on(earlier.clone())
        .await
        .expect("served under the first certificate");

    let second = Ca::new("second CA");
    let second_ca = second.write(pki.path(), "second-ca");
    let (cert, key) = second.issue(Role::Server);
    volume.publish(cert.as_bytes(), key.as_bytes());
    eventually(
        "a new connection trusting only the second CA is served",
        PATIENCE,
        async || ask_tls(sluice.grpc, &second_ca, None).await.is_ok(),
    )
    .await;
    let first = ask_tls(sluice.grpc, &pki.ca, None).await;
    assert!(
        first.is_err(),
        "a new connection gets the new certificate, which the first CA did not sign: {first:?}"
    );
    ask_on(earlier.clone())
        .await
        .expect("a connection made earlier keeps its certificate");

    let broken_key = b"-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n";
    volume.publish(cert.as_bytes(), broken_key);
    eventually(
        "the broken key is logged, naming its flag",
        PATIENCE,
        async || {
            let log = sluice.log_text();
            log.contains("TLS certificates not reloaded") && log.contains("--tls-key")
        },
    )
    .await;
    let answer = ask_tls(sluice.grpc, &second_ca, None)
        .await
        .expect("the last good certificate stays in force");
    assert_eq!(answer.overall_code, OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_server_key_may_be_pkcs8_pkcs1_or_sec1() {
    let pki = Pki::new();
    let dir = pki.path();
    let sec1 = dir.join("server-sec1.pem");
    openssl(&["ec", "-in", &text(&pki.server.key), "-out", &text(&sec1)]);
    let (rsa_pkcs1, rsa_pkcs8, rsa_cert) = (
        dir.join("rsa-pkcs1.pem"),
        dir.join("rsa-pkcs8.pem"),
        dir.join("rsa.pem"),
    );
    openssl(&["genrsa", "-traditional", "-out", &text(&rsa_pkcs1), "2048"]);
    openssl(&[
        "pkcs8",
        "-topk8",
        "-nocrypt",
        "-in",
        &text(&rsa_pkcs1),
        "-out",
        &text(&rsa_pkcs8),
    ]);
    let rsa = KeyPair::from_pem(&std::fs::read_to_string(&rsa_pkcs8).unwrap()).expect("RSA key");
    std::fs::write(&rsa_cert, pki.authority.sign(&rsa, Role::Server)).unwrap();

    for (cert, key, form) in [
        (&pki.server.cert, &pki.server.key, "PRIVATE KEY"),
        (&pki.server.cert, &sec1, "EC PRIVATE KEY"),
        (&rsa_cert, &rsa_pkcs1, "RSA PRIVATE KEY"),
    ] {
        let pem = String::from_utf8(read(key)).unwrap();
        assert!(pem.starts_with(&format!("-----BEGIN {form}-----")), "{pem}");
        let flags = ["--tls-cert", &text(cert), "--tls-key", &text(key)].map(str::to_owned);
        let sluice = serve(&flags).await;
        let answer = ask_tls(sluice.grpc, &pki.ca, None)
            .await
            .unwrap_or_else(|e| panic!("served with a {form}: {e}"));
        assert_eq!(answer.overall_code, OK);
    }
}

#[test]
fn serve_refuses_to_start_on_tls_settings_it_cannot_use_naming_the_flag_and_file() {
    let pki = Pki::new();
    let rules = pki.path().join("rules.yaml");
    std::fs::write(&rules, RULES).unwrap();
    let (ca, cert, key) = (text(&pki.ca), text(&pki.server.cert), text(&pki.server.key));
    let missing = text(&pki.path().join("missing.pem"));
    let client_key = text(&pki.client.key);
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["--tls-cert", &cert], "--tls-key <TLS_KEY>".into()),
        (vec!["--tls-key", &key], "--tls-cert <TLS_CERT>".into()),
        (vec!["--tls-client-ca", &ca], "--tls-cert <TLS_CERT>".into()),
        (
            vec!["--tls-cert", &missing, "--tls-key", &key],
            format!("--tls-cert {missing}: cannot read the file"),
        ),
        (
            vec!["--tls-cert", &key, "--tls-key", &key],
            format!("--tls-cert {key}: no certificate"),
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &cert],
            format!("--tls-key {cert}: no unencrypted private key"),
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &client_key],
            format!(
                "--tls-key {client_key}: not the private key of the certificate in --tls-cert {cert}"
            ),
        ),
        (
            vec![
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--tls-client-ca",
                &missing,
            ],
            format!("--tls-client-ca {missing}: cannot read the file"),
        ),
        (vec!["--redis-ca", &ca], "--redis-url <REDIS_URL>".into()),
        (
            vec!["--redis-url", "redis://127.0.0.1:1", "--redis-ca", &ca],
            "--redis-ca: only for a TLS --redis-url".into(),
        ),
        (
            vec!["--redis-url", "rediss://127.0.0.1:1", "--redis-cert", &cert],
            "--redis-key <REDIS_KEY>".into(),
        ),
        (
            vec![
                "--redis-url",
                "rediss://127.0.0.1:1",
                "--redis-ca",
                &ca,
                "--redis-cert",
                &cert,
                "--redis-key",
                &client_key,
            ],
            format!(
                "--redis-key {client_key}: not the private key of the certificate in --redis-cert {cert}"
            ),
        ),
    ];
    for (flags, expected) in cases {
        let mut args: Vec<String> = ["serve", "--config", &text(&rules)]
            .into_iter()
            .chain(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .map(str::to_owned)
            .collect();
        args.extend(flags.iter().map(|f| (*f).to_owned()));
        let out = run_sluice(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} is refused");
        assert!(
            stderr.contains(&expected),
            "{flags:?}: expected {expected:?} in:\n{stderr}"
        );
    }
}

/// One `generic_key: envoy` descriptor for every request; a request sluice did not answer is
/// denied, so a failed handshake cannot pass for an answer.
const FILTER: Filter = Filter {
    domain: "tls",
    actions: &["generic_key: { descriptor_value: envoy }"],
    failure_mode_deny: true,
    timeout: Duration::from_secs(2),
};

#[tokio::test(flavor = "multi_thread")]
async fn envoy_speaking_mtls_to_sluice_gets_its_answers() {
    in_one_window(HOUR, async || {
        let binary = envoy_binary();
        let pki = Pki::new();
        let sluice = serve(&pki.serve_flags(true)).await;
        let upstream = Upstream::start();
        let tls = UpstreamTls {
            ca: &pki.ca,
            name: "localhost",
            client: Some((&pki.client.cert, &pki.client.key)),
        };
        let envoy = Envoy::start_tls(&binary, upstream.addr, sluice.grpc, &FILTER, &tls);

        for n in 0..LIMIT {
            let (status, headers, body) = http(envoy.listener, "GET", "/", "");
            assert_eq!(status, 200, "request {n}: {headers:?} {body}");
        }
        for _ in 0..2 {
            let (status, headers, body) = http(envoy.listener, "GET", "/", "");
            assert_eq!(status, 429, "over the limit: {headers:?} {body}");
        }

        let stats = envoy.ratelimit_stats();
        assert_eq!(stats.get("ok"), Some(&(LIMIT as u64)), "{stats:?}");
        assert_eq!(stats.get("over_limit"), Some(&2), "{stats:?}");
        assert_eq!(stats.get("error").copied().unwrap_or(0), 0, "{stats:?}");
        assert_eq!(
            stats.get("failure_mode_allowed").copied().unwrap_or(0),
            0,
            "{stats:?}"
        );
        let ssl = envoy.stats("cluster.ratelimit.ssl.");
        assert!(ssl.get("handshake").is_some_and(|&n| n >= 1), "{ssl:?}");
        assert_eq!(ssl.get("connection_error"), Some(&0), "{ssl:?}");
    })
    .await;
}

/// `serve` flags for Redis at `redis` over TLS, with `extra` TLS flags and a key prefix.
fn redis_flags(redis: &TlsRedis, extra: &[&Path]) -> Vec<String> {
    let mut flags = vec![
        "--redis-url".to_owned(),
        format!("rediss://127.0.0.1:{}", redis.port),
        "--redis-key-prefix".to_owned(),
        "tls:".to_owned(),
        "--store-timeout".to_owned(),
        "2s".to_owned(),
    ];
    let names = ["--redis-ca", "--redis-cert", "--redis-key"];
    for (name, path) in names.iter().zip(extra) {
        flags.extend([(*name).to_owned(), text(path)]);
    }
    flags
}

fn tls_redis(pki: &Pki) -> TlsRedis {
    TlsRedis::start(
        &pki.ca,
        &pki.server.cert,
        &pki.server.key,
        (&pki.client.cert, &pki.client.key),
        &pki.path().join("redis.log"),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn sluice_counts_in_a_redis_that_requires_tls_client_certificates() {
    in_one_window(HOUR, async || {
        let pki = Pki::new();
        let redis = tls_redis(&pki);
        let flags = redis_flags(&redis, &[&pki.ca, &pki.client.cert, &pki.client.key]);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, Wait::Serving).await;
        assert_eq!(http(sluice.http, "GET", "/readyz", "").0, 200);

        let limited = request("tls", &[&[("generic_key", "redis")]]);
        for n in 0..LIMIT {
            let answer = sluice.ask(limited.clone()).await;
            assert_eq!(answer.overall_code, OK, "request {n}: {answer:?}");
        }
        let answer = sluice.ask(limited).await;
        assert_eq!(answer.overall_code, OVER_LIMIT, "{answer:?}");
        let keys = redis.cli(&["KEYS", "tls:*"]);
        assert_eq!(keys.lines().count(), 1, "one counter in Redis: {keys:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_its_client_certificate_sluice_does_not_reach_a_redis_that_requires_one() {
    let pki = Pki::new();
    let redis = tls_redis(&pki);
    let flags = redis_flags(&redis, &[&pki.ca]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, Wait::Live).await;

    eventually("Redis refuses sluice's connection", PATIENCE, async || {
        redis
            .log_text()
            .contains("peer did not return a certificate")
    })
    .await;
    let (status, _, body) = http(sluice.http, "GET", "/readyz", "");
    assert_eq!(status, 503, "not ready: {body}");
    assert!(body.contains("unreachable"), "{body}");
    let refused = sluice
        .client()
        .await
        .should_rate_limit(request("tls", &[&[("generic_key", "redis")]]))
        .await;
    assert_eq!(
        refused.map(|_| ()).map_err(|s| s.code()),
        Err(tonic::Code::Unavailable),
        "the --on-store-error answer"
    );
}

/// `method path` with `body` over TLS to the admin port `addr`, trusting `ca`, presenting
/// `client` (certificate and key files) if given: the status, or `None` when the handshake or
/// the exchange fails.
async fn admin_tls(
    addr: SocketAddr,
    ca: &Path,
    client: Option<&Pair>,
    method: &str,
    path: &str,
    body: &str,
) -> Option<u16> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        Some(pair) => {
            let chain: Vec<CertificateDer> = CertificateDer::pem_file_iter(&pair.cert)
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_file(&pair.key).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = connector.connect(name, tcp).await.ok()?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer)
            .strip_prefix("HTTP/1.1 ")?
            .get(..3)?
            .parse()
            .ok()
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .ok()
        .flatten()
}

/// The admin port over TLS with a client CA (`--admin-tls-*`): a probe without a certificate is
/// served; `/top` and a change through `/counters` are refused (401) without a client
/// certificate and let in with one from the client CA, as the admin token lets its holder in; a
/// certificate from another CA is refused at the handshake; plain HTTP gets no answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_lets_its_client_into_the_admin_port_as_the_token_does() {
    let pki = Pki::new();
    let flags: Vec<String> = [
        "--admin-tls-cert",
        &text(&pki.server.cert),
        "--admin-tls-key",
        &text(&pki.server.key),
        "--admin-tls-client-ca",
        &text(&pki.ca),
    ]
    .iter()
    .map(|f| (*f).to_owned())
    .collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let sluice = Sluice::spawn(&[("rules.yaml", RULES)], &flags, None, Wait::Serving).await;
    let reset = r#"{"domain":"tls","descriptors":[{"entries":[{"key":"generic_key","value":"a"}]}],"action":"reset","apply":true}"#;
    let ask = |client: Option<&'static str>,
               method: &'static str,
               path: &'static str,
               body: &'static str| {
        let pair = match client {
            Some("client") => Some(&pki.client),
            Some(_) => Some(&pki.stranger),
            None => None,
        };
        admin_tls(sluice.http, &pki.ca, pair, method, path, body)
    };
    assert_eq!(ask(None, "GET", "/healthz", "").await, Some(200), "a probe");
    assert_eq!(ask(None, "GET", "/top", "").await, Some(401));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(ask(None, "POST", "/counters", reset).await, Some(401));
    assert_eq!(
        ask(Some("client"), "GET", "/top", "").await,
        Some(200),
        "a client certificate from the client CA lets its client in, even while its address \
         cools down from a refused token"
    );
    assert_eq!(
        ask(Some("client"), "POST", "/counters", reset).await,
        Some(200),
        "and may change counters"
    );
    assert_eq!(
        ask(Some("stranger"), "GET", "/healthz", "").await,
        None,
        "a certificate from another CA is refused at the handshake"
    );
    let plain = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut tcp = std::net::TcpStream::connect(sluice.http).unwrap();
        tcp.set_read_timeout(Some(PATIENCE)).unwrap();
        let _ = tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer);
        answer
    })
    .await
    .unwrap();
    assert!(
        !plain.starts_with(b"HTTP/1.1 200"),
        "plain HTTP is not served: {:?}",
        String::from_utf8_lossy(&plain)
    );
}
