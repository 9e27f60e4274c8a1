//! Rules over xDS: a State-of-the-World ADS client for envoyproxy/ratelimit's `RateLimitConfig`
//! resources, as Envoy Gateway serves them. Each response is written as rule-file YAML and
//! validated exactly as rule files are; a valid one is handed on and ACKed, an invalid one is
//! NACKed and the rules in force stay. A lost stream is resubscribed, with backoff, from scratch.

use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Any, Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitUnit,
};
use prost::Message;
use rustls::{ClientConfig, RootCertStore};
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Identity};

use super::{ConfigError, DescriptorConfig, DomainConfig, Loaded, domain_collisions, file, hex};
use crate::certs::{self, PemFile};

/// The one resource type subscribed to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// The first pause after a lost stream; it doubles on each failed try up to `LAST_RETRY`, and
/// each pause is drawn between half of it and all of it.
const FIRST_RETRY: Duration = Duration::from_millis(500);
const LAST_RETRY: Duration = Duration::from_secs(30);
/// How long a connection to the xDS server may take to set up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on the stream, so that a server gone without a word is noticed.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The `serve` flags of the xDS client.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct XdsFlags {
    /// Take the rules from this xDS server (HOST:PORT, no scheme), instead of --config:
    /// envoyproxy/ratelimit's CONFIG_GRPC_XDS_SERVER_URL.
    #[arg(long, env = "SLUICE_XDS_SERVER", value_name = "HOST:PORT")]
    pub xds_server: Option<String>,
    /// The node id sent to the xDS server (Envoy Gateway serves `envoy-ratelimit`).
    #[arg(long, env = "SLUICE_XDS_NODE_ID", default_value = "default")]
    pub xds_node_id: String,
    /// The node metadata sent to the xDS server, `k=v,k2=v2` (string values; an entry without
    /// `=` is skipped, as envoyproxy/ratelimit skips it).
    #[arg(long, env = "SLUICE_XDS_NODE_METADATA", default_value = "")]
    pub xds_node_metadata: String,
    /// Trust the CAs of this PEM file for the xDS server's certificate, besides the system's;
    /// any --xds-tls-* flag makes the connection TLS.
    #[arg(long, env = "SLUICE_XDS_TLS_CA", requires = "xds_server")]
    pub xds_tls_ca: Option<PathBuf>,
    /// Present this PEM client certificate chain to the xDS server.
    #[arg(long, env = "SLUICE_XDS_TLS_CERT", requires_all = ["xds_tls_key", "xds_server"])]
    pub xds_tls_cert: Option<PathBuf>,
    /// The PEM private key of --xds-tls-cert: PKCS#8, PKCS#1 (RSA PRIVATE KEY) or SEC1.
    #[arg(long, env = "SLUICE_XDS_TLS_KEY", requires = "xds_tls_cert")]
    pub xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry (default: the host of --xds-server).
    #[arg(long, env = "SLUICE_XDS_TLS_SERVER_NAME", requires = "xds_server")]
    pub xds_tls_server_name: Option<String>,
    /// The largest xDS response accepted, in bytes: Envoy Gateway sends every domain in one.
    #[arg(long, env = "SLUICE_XDS_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub xds_max_message_bytes: usize,
}

impl XdsFlags {
    /// The subscription these flags describe, with its TLS files read and checked now; `None`
    /// without --xds-server.
    pub fn subscription(&self, merge_domains: bool) -> anyhow::Result<Option<Subscription>> {
        let Some(server) = &self.xds_server else {
            return Ok(None);
        };
        if server.contains("://") {
            anyhow::bail!("--xds-server {server}: HOST:PORT, without a scheme");
        }
        let host = match server.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                host.trim_start_matches('[').trim_end_matches(']')
            }
            _ => anyhow::bail!("--xds-server {server}: HOST:PORT expected"),
        };
        let tls = self.xds_tls_ca.is_some() || self.xds_tls_cert.is_some();
        let scheme = if tls { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{server}"))
            .with_context(|| format!("--xds-server {server}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if tls {
            let name = self.xds_tls_server_name.as_deref().unwrap_or(host);
            endpoint = endpoint
                .tls_config(self.tls(name)?)
                .context("the xDS TLS configuration")?;
        }
        let metadata = self
            .xds_node_metadata
            .split(',')
            .filter_map(|entry| entry.split_once('='))
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.to_owned())),
                };
                (k.to_owned(), value)
            })
            .collect();
        Ok(Some(Subscription {
            server: server.clone(),
            endpoint,
            node: Node {
                id: self.xds_node_id.clone(),
                metadata: Some(Struct { fields: metadata }),
                ..Default::default()
            },
            max_message_bytes: self.xds_max_message_bytes,
            merge_domains,
        }))
    }

    /// TLS towards the xDS server: the system's CAs and --xds-tls-ca's, the client certificate
    /// when given. The files are checked here, so that a bad one stops the start.
    fn tls(&self, server_name: &str) -> anyhow::Result<ClientTlsConfig> {
        let mut roots = certs::system_roots();
        if let Some(path) = &self.xds_tls_ca {
            let ca = PemFile::new("--xds-tls-ca", path);
            roots.roots.extend(ca.roots(&ca.read()?)?.roots);
        }
        if roots.is_empty() {
            anyhow::bail!(
                "TLS to --xds-server: no CA certificates on the system: give --xds-tls-ca"
            );
        }
        let mut tls = ClientTlsConfig::new()
            .trust_anchors(roots.roots)
            .domain_name(server_name);
        if let Some((cert, key)) = self
            .xds_tls_cert
            .as_deref()
            .zip(self.xds_tls_key.as_deref())
        {
            let (cert, key) = (
                PemFile::new("--xds-tls-cert", cert),
                PemFile::new("--xds-tls-key", key),
            );
            let (cert_pem, key_pem) = (cert.read()?, key.read()?);
            ClientConfig::builder_with_provider(certs::provider())
                .with_safe_default_protocol_versions()
                .context("the TLS provider")?
                .with_root_certificates(RootCertStore::empty())
                .with_client_auth_cert(cert.certificates(&cert_pem)?, key.key(&key_pem)?)
                .map_err(|e| certs::refused_pair(&cert, &key, e))?;
            tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
        }
        Ok(tls)
    }
}

/// What one xDS response turned out to be.
pub enum Snapshot {
    /// Valid rules, to put in force (then ACKed).
    Valid { version: String, rules: Loaded },
    /// Rejected (then NACKed): every problem, each naming its resource and where in it.
    Rejected {
        version: String,
        errors: Vec<String>,
    },
}

/// A subscription to the `RateLimitConfig`s of one xDS server.
pub struct Subscription {
    server: String,
    endpoint: Endpoint,
    node: Node,
    max_message_bytes: usize,
    merge_domains: bool,
}

/// Why a stream ended.
enum Ended {
    /// Asked to start a new stream at once.
    Resubscribe,
    /// The connection or the stream failed; `answered` when the server had sent something.
    Failed { answered: bool, error: String },
}

impl Subscription {
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Follows the server for ever: every response goes to `apply`, then is ACKed or NACKed.
    /// A lost stream is retried with backoff; `resubscribe` starts a new stream at once.
    pub async fn follow(self, mut apply: impl FnMut(Snapshot), resubscribe: Arc<Notify>) {
        let mut pause = FIRST_RETRY;
        let mut failing = false;
        loop {
            match self.stream(&mut apply, &resubscribe, &mut failing).await {
                Ended::Resubscribe => {
                    tracing::info!(server = %self.server, "resubscribing to the xDS server");
                    pause = FIRST_RETRY;
                }
                Ended::Failed { answered, error } => {
                    if answered {
                        pause = FIRST_RETRY;
                    }
                    if answered || !failing {
                        tracing::warn!(
                            server = %self.server,
                            "xDS stream lost: {error}; retrying (the rules in force stay)"
                        );
                    } else {
                        tracing::debug!(server = %self.server, "xDS stream: {error}");
                    }
                    failing = true;
                    tokio::select! {
                        () = tokio::time::sleep(jittered(pause)) => {}
                        () = resubscribe.notified() => {}
                    }
                    pause = (pause * 2).min(LAST_RETRY);
                }
            }
        }
    }

    /// One ADS stream, from its first request (version "", whatever was ACKed before: a new
    /// server process may number its versions from "1" again) until it fails or is replaced.
    async fn stream(
        &self,
        apply: &mut impl FnMut(Snapshot),
        resubscribe: &Notify,
        failing: &mut bool,
    ) -> Ended {
        let mut answered = false;
        let result: Result<Ended, String> = async {
            let channel: Channel = self.endpoint.connect().await.map_err(|e| describe(&e))?;
            let mut client = AggregatedDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(self.max_message_bytes);
            let (requests, outgoing) = mpsc::channel(2);
            let _ = requests.try_send(self.request("", "", None));
            let call = client.stream_aggregated_resources(ReceiverStream::new(outgoing));
            let mut responses = tokio::select! {
                r = call => r.map_err(|s| describe(&s))?.into_inner(),
                () = resubscribe.notified() => return Ok(Ended::Resubscribe),
            };
            let mut acked = String::new();
            loop {
                let response = tokio::select! {
                    r = responses.message() => r.map_err(|s| describe(&s))?,
                    () = resubscribe.notified() => return Ok(Ended::Resubscribe),
                };
                let response = response.ok_or("the server ended the stream")?;
                answered = true;
                if std::mem::take(failing) {
                    tracing::info!(server = %self.server, "xDS stream re-established");
                }
                let Some(reply) = self.answer(&response, &mut acked, apply) else {
                    continue;
                };
                requests
                    .send(reply)
                    .await
                    .map_err(|_| "the stream closed".to_owned())?;
            }
        }
        .await;
        result.unwrap_or_else(|error| Ended::Failed { answered, error })
    }

    /// The ACK or NACK of `response`, once `apply` has had it; `None` for a type not asked for.
    fn answer(
        &self,
        response: &DiscoveryResponse,
        acked: &mut String,
        apply: &mut impl FnMut(Snapshot),
    ) -> Option<DiscoveryRequest> {
        if response.type_url != TYPE_URL {
            tracing::warn!(type_url = %response.type_url, "xDS response of a type not subscribed to: ignored");
            return None;
        }
        let version = response.version_info.clone();
        match convert(&response.resources, self.merge_domains) {
            Ok(rules) => {
                apply(Snapshot::Valid {
                    version: version.clone(),
                    rules,
                });
                *acked = version;
                Some(self.request(acked, &response.nonce, None))
            }
            Err(errors) => {
                let message = errors.join("\n");
                apply(Snapshot::Rejected { version, errors });
                Some(self.request(acked, &response.nonce, Some(message)))
            }
        }
    }

    fn request(&self, version: &str, nonce: &str, error: Option<String>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.to_owned(),
            node: Some(self.node.clone()),
            type_url: TYPE_URL.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail: error.map(|message| Status {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            }),
            ..Default::default()
        }
    }
}

/// An error with its causes, on one line.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            let _ = write!(text, ": {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// A pause between half of `pause` and all of it, so that replicas do not retry in step.
fn jittered(pause: Duration) -> Duration {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let half = pause / 2;
    half + half.mul_f64((random % 1024) as f64 / 1024.0)
}

/// The rules of one xDS response: every resource a `RateLimitConfig`, each validated as a rule
/// file named `xds:<resource name>` is. The errors name the resource and the path of the
/// offending field (`descriptors[0].rate_limit.unit`). No resource at all is a valid, empty
/// configuration.
pub fn convert(resources: &[Any], merge_domains: bool) -> Result<Loaded, Vec<String>> {
    let mut errors = Vec::new();
    let mut loaded = Loaded::default();
    let mut parsed = Vec::new();
    for (i, any) in resources.iter().enumerate() {
        if any.type_url != TYPE_URL {
            errors.push(format!(
                "resource {i}: a {}, not a RateLimitConfig",
                any.type_url
            ));
            continue;
        }
        let config = match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(config) => config,
            Err(e) => {
                errors.push(format!("resource {i}: not a RateLimitConfig: {e}"));
                continue;
            }
        };
        let name = [&config.name, &config.domain]
            .into_iter()
            .find(|n| !n.is_empty())
            .cloned()
            .unwrap_or_else(|| format!("#{i}"));
        let file = PathBuf::from(format!("xds:{name}"));
        loaded
            .files
            .push((file.clone(), hex(&Sha256::digest(&any.value))));
        let yaml = Yaml::of(&config);
        match file::parse(&file, &yaml.text) {
            Ok((domain, _)) => parsed.push((domain, config, yaml)),
            Err(e) => errors.extend(e.iter().map(|e| yaml.locate(e))),
        }
    }
    let domains: Vec<DomainConfig> = parsed.iter().map(|(d, _, _)| d.clone()).collect();
    for e in domain_collisions(&domains, merge_domains) {
        if let Some((_, _, yaml)) = parsed.iter().find(|(d, _, _)| d.file == e.file) {
            errors.push(yaml.locate(&e));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    for (mut domain, config, _) in parsed {
        // A resource has no lines: line 0 says so wherever rules are shown.
        domain.line = 0;
        fill(&mut domain.descriptors, &config.descriptors);
        loaded.domains.push(domain);
    }
    Ok(loaded)
}

/// Takes the metadata from the resource as it is (a `Struct` needs no validation) and drops
/// the lines of the YAML the rules were validated from.
fn fill(configs: &mut [DescriptorConfig], protos: &[RateLimitDescriptor]) {
    for (config, proto) in configs.iter_mut().zip(protos) {
        config.line = 0;
        config.metadata = proto
            .metadata
            .as_ref()
            .map(|s| serde_json::Value::Object(object(s)));
        fill(&mut config.descriptors, &proto.descriptors);
    }
}

fn object(s: &Struct) -> serde_json::Map<String, serde_json::Value> {
    s.fields.iter().map(|(k, v)| (k.clone(), json(v))).collect()
}

fn json(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 2f64.powi(53) => {
            serde_json::Value::from(*n as i64)
        }
        Some(Kind::NumberValue(n)) => serde_json::Value::from(*n),
        Some(Kind::StringValue(s)) => serde_json::Value::from(s.as_str()),
        Some(Kind::BoolValue(b)) => serde_json::Value::from(*b),
        Some(Kind::StructValue(s)) => serde_json::Value::Object(object(s)),
        Some(Kind::ListValue(l)) => serde_json::Value::Array(l.values.iter().map(json).collect()),
    }
}

/// A `RateLimitConfig` as rule-file YAML, with the field path each line comes from.
#[derive(Default)]
struct Yaml {
    text: String,
    /// The path of line n + 1.
    paths: Vec<String>,
}

impl Yaml {
    fn of(config: &RateLimitConfig) -> Yaml {
        let mut yaml = Yaml::default();
        yaml.line(0, format!("domain: {}", quote(&config.domain)), "domain");
        if !config.descriptors.is_empty() {
            yaml.line(0, "descriptors:".into(), "descriptors");
        }
        for (i, d) in config.descriptors.iter().enumerate() {
            yaml.descriptor(d, 0, &format!("descriptors[{i}]"));
        }
        yaml
    }

    fn line(&mut self, indent: usize, text: String, path: &str) {
        let _ = writeln!(self.text, "{:indent$}{text}", "");
        self.paths.push(path.to_owned());
    }

    fn descriptor(&mut self, d: &RateLimitDescriptor, indent: usize, path: &str) {
        self.line(indent, format!("- key: {}", quote(&d.key)), path);
        let inner = indent + 2;
        if !d.value.is_empty() {
            self.line(inner, format!("value: {}", quote(&d.value)), path);
        }
        for (set, name) in [
            (d.shadow_mode, "shadow_mode"),
            (d.quota_mode, "quota_mode"),
            (d.detailed_metric, "detailed_metric"),
        ] {
            if set {
                self.line(inner, format!("{name}: true"), path);
            }
        }
        if let Some(policy) = &d.rate_limit {
            let at = format!("{path}.rate_limit");
            self.line(inner, "rate_limit:".into(), &at);
            let fields = inner + 2;
            match RateLimitUnit::try_from(policy.unit) {
                // UNKNOWN is how a proto says "no unit": what an unlimited limit has.
                Ok(RateLimitUnit::Unknown) if policy.unlimited => {}
                Ok(unit) => self.line(
                    fields,
                    format!("unit: {}", unit.as_str_name()),
                    &format!("{at}.unit"),
                ),
                Err(_) => self.line(
                    fields,
                    format!("unit: \"{}\"", policy.unit),
                    &format!("{at}.unit"),
                ),
            }
            self.line(
                fields,
                format!("requests_per_unit: {}", policy.requests_per_unit),
                &at,
            );
            if policy.unlimited {
                self.line(fields, "unlimited: true".into(), &at);
            }
            if !policy.name.is_empty() {
                self.line(fields, format!("name: {}", quote(&policy.name)), &at);
            }
            if !policy.replaces.is_empty() {
                self.line(fields, "replaces:".into(), &at);
            }
            for (j, r) in policy.replaces.iter().enumerate() {
                self.line(
                    fields + 2,
                    format!("- name: {}", quote(&r.name)),
                    &format!("{at}.replaces[{j}]"),
                );
            }
        }
        if !d.descriptors.is_empty() {
            self.line(inner, "descriptors:".into(), path);
        }
        for (j, child) in d.descriptors.iter().enumerate() {
            self.descriptor(child, inner + 2, &format!("{path}.descriptors[{j}]"));
        }
    }

    /// An error found in this YAML, located in the resource instead: `xds:<name>: path: message`.
    fn locate(&self, e: &ConfigError) -> String {
        let path = e
            .line
            .checked_sub(1)
            .and_then(|i| self.paths.get(i))
            .map_or("", String::as_str);
        format!("{}: {path}: {}", e.file.display(), e.message)
    }
}

/// `text` as a YAML double-quoted scalar: any bytes of a resource survive, as YAML escapes.
fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            ' '..='~' | '\u{a0}'..='\u{2027}' | '\u{202a}'..='\u{d7ff}' => out.push(c),
            '\u{e000}'..='\u{fefe}' | '\u{ff00}'..='\u{fffd}' | '\u{10000}'.. => out.push(c),
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::ratelimit::config::ratelimit::v3::{RateLimitPolicy, RateLimitReplace};

    fn any(config: &RateLimitConfig) -> Any {
        Any {
            type_url: TYPE_URL.into(),
            value: config.encode_to_vec(),
        }
    }

    fn descriptor(key: &str, value: &str, unit: RateLimitUnit, n: u32) -> RateLimitDescriptor {
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

    fn config(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitConfig {
        RateLimitConfig {
            name: domain.into(),
            domain: domain.into(),
            descriptors,
        }
    }

    #[test]
    fn converts_a_resource_as_a_rule_file_reads() {
        let mut inner = descriptor("rule-0-match-0", "", RateLimitUnit::Hour, 3);
        inner.shadow_mode = true;
        inner.metadata = Some(Struct {
            fields: [(
                "team".to_owned(),
                Value {
                    kind: Some(Kind::StringValue("web".into())),
                },
            )]
            .into(),
        });
        let route = RateLimitDescriptor {
            key: "httproute/default/api/rule/0/match/0/*".into(),
            value: "httproute/default/api/rule/0/match/0/*".into(),
            descriptors: vec![inner],
            ..Default::default()
        };
        let loaded = convert(&[any(&config("default/eg/http", vec![route]))], false).unwrap();
        let d = &loaded.domains[0];
        assert_eq!(d.domain, "default/eg/http");
        assert_eq!(d.file, PathBuf::from("xds:default/eg/http"));
        assert_eq!(d.line, 0);
        let leaf = &d.descriptors[0].descriptors[0];
        assert_eq!(leaf.value, None);
        assert!(leaf.mode.is_shadow());
        assert_eq!(leaf.metadata, Some(serde_json::json!({"team": "web"})));
        let limit = leaf.limits[0].limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit.name()), (3, "hour"));
    }

    #[test]
    fn errors_name_the_resource_and_the_field() {
        let bad_unit = config(
            "d",
            vec![RateLimitDescriptor {
                key: "k".into(),
                descriptors: vec![descriptor("c", "v", RateLimitUnit::Unknown, 1)],
                ..Default::default()
            }],
        );
        assert_eq!(
            convert(&[any(&bad_unit)], false).unwrap_err(),
            [
                "xds:d: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'"
            ]
        );
        let twice = config("d", vec![descriptor("k", "v", RateLimitUnit::Second, 1)]);
        assert_eq!(
            convert(&[any(&twice), any(&twice)], false).unwrap_err(),
            ["xds:d: domain: duplicate domain 'd' in config file"]
        );
        assert!(convert(&[any(&twice), any(&twice)], true).is_err());
        let not_a_config = Any {
            type_url: "type.googleapis.com/google.protobuf.Struct".into(),
            value: Vec::new(),
        };
        assert_eq!(
            convert(&[not_a_config], false).unwrap_err(),
            ["resource 0: a type.googleapis.com/google.protobuf.Struct, not a RateLimitConfig"]
        );
    }

    #[test]
    fn unlimited_needs_no_unit_and_replaces_are_kept() {
        let mut d = descriptor("k", "", RateLimitUnit::Unknown, 0);
        let policy = d.rate_limit.as_mut().unwrap();
        policy.unlimited = true;
        policy.name = "free".into();
        policy.replaces = vec![RateLimitReplace {
            name: "other".into(),
        }];
        let loaded = convert(&[any(&config("d", vec![d]))], false).unwrap();
        let rule = &loaded.domains[0].descriptors[0].limits[0];
        assert_eq!(
            (rule.limit.is_none(), rule.replaces.as_slice()),
            (true, &["other".to_owned()][..])
        );
    }

    #[test]
    fn any_text_survives_quoting() {
        let odd = "a\"b\\c\n\t\u{7f}\u{85}\u{2028}\u{feff}é€😀: #x";
        let loaded = convert(
            &[any(&config(
                odd,
                vec![descriptor(odd, odd, RateLimitUnit::Second, 1)],
            ))],
            false,
        )
        .unwrap();
        let d = &loaded.domains[0];
        assert_eq!(d.domain, odd);
        assert_eq!(d.descriptors[0].key, odd);
        assert_eq!(d.descriptors[0].value.as_deref(), Some(odd));
    }

    #[test]
    fn no_resources_is_an_empty_configuration() {
        let loaded = convert(&[], false).unwrap();
        assert!(loaded.domains.is_empty());
    }
}
