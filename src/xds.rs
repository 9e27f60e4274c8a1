//! Rules over xDS: a State-of-the-World ADS client for envoyproxy/ratelimit's `RateLimitConfig`
//! resources, as Envoy Gateway serves them. Each response is converted from protobuf straight
//! into typed rules and validated as rule files are, on a thread of its own: a valid one is handed
//! on and ACKed, an invalid one is NACKed with a bounded summary of its errors and the rules in
//! force stay. Resources already seen (in force, or rejected last) are recognised by their digest
//! and not converted again. A lost stream is resubscribed, with backoff, from scratch.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Any, Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use prost::Message;
use rustls::{ClientConfig, RootCertStore};
use sha2::{Digest as _, Sha256};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Identity};

use sluice_core::certs::{self, PemFile};
use sluice_core::config::{
    DescriptorConfig, DomainConfig, Loaded, MOST_DESCRIPTOR_DEPTH, MOST_DOMAIN_BYTES,
    MOST_METADATA_DEPTH, Received, RuleLimit, Sources, composite, domain_collisions,
    domain_too_long, hex, on_own_thread,
};
use sluice_core::limiter::{Algorithm, Limit, Mode, Unit};
use sluice_core::throttle::Throttle;

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
/// The errors a rejected response shows, in the log and in its NACK; the rest are counted.
const SHOWN_ERRORS: usize = 10;
/// The longest error shown, in bytes: a longer one (resource names and keys can be long) is cut.
const LONGEST_ERROR: usize = 1024;

/// An xDS server to take the rules from, and how sluice introduces itself to it.
#[derive(Debug)]
pub struct Server {
    /// HOST:PORT, without a scheme.
    pub address: String,
    /// The node id sent to the server.
    pub node_id: String,
    /// The node metadata sent to the server (string values).
    pub node_metadata: Vec<(String, String)>,
    /// TLS towards the server; `None` for plaintext.
    pub tls: Option<Tls>,
    /// The largest response accepted, in bytes.
    pub max_message_bytes: usize,
}

/// TLS towards an xDS server: the CAs trusted besides the system's, the client certificate
/// presented, and the name the server's certificate must carry (default: the host of its address).
#[derive(Debug)]
pub struct Tls {
    pub ca: Option<PathBuf>,
    /// The PEM certificate chain and its private key.
    pub identity: Option<(PathBuf, PathBuf)>,
    pub server_name: Option<String>,
}

impl Server {
    /// The subscription to this server, with its TLS files read and checked now.
    pub fn subscription(&self, merge_domains: bool) -> anyhow::Result<Subscription> {
        let server = &self.address;
        if server.contains("://") {
            anyhow::bail!("--xds-server {server}: HOST:PORT, without a scheme");
        }
        let host = match server.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                host.trim_start_matches('[').trim_end_matches(']')
            }
            _ => anyhow::bail!("--xds-server {server}: HOST:PORT expected"),
        };
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{server}"))
            .with_context(|| format!("--xds-server {server}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            let name = tls.server_name.as_deref().unwrap_or(host);
            endpoint = endpoint
                .tls_config(tls.config(name)?)
                .context("the xDS TLS configuration")?;
        }
        let metadata = self
            .node_metadata
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Ok(Subscription {
            server: server.clone(),
            endpoint,
            node: Node {
                id: self.node_id.clone(),
                metadata: Some(Struct { fields: metadata }),
                ..Default::default()
            },
            max_message_bytes: self.max_message_bytes,
            merge_domains,
        })
    }
}

impl Tls {
    /// The client configuration: the system's CAs and `ca`'s, the client certificate when
    /// given. The files are checked here, so that a bad one stops the start.
    fn config(&self, server_name: &str) -> anyhow::Result<ClientTlsConfig> {
        let mut roots = certs::system_roots();
        if let Some(path) = &self.ca {
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
        if let Some((cert, key)) = &self.identity {
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

    /// Follows the server for ever: every response is judged and handed to `apply` on a
    /// thread of its own (one at a time), then ACKed or NACKed. A lost stream is retried with
    /// backoff; `resubscribe` starts a new stream at once.
    pub async fn follow(
        self,
        apply: impl Fn(Snapshot) + Send + Sync + 'static,
        resubscribe: Arc<Notify>,
    ) {
        let judge = Arc::new(Judge {
            merge_domains: self.merge_domains,
            seen: Mutex::default(),
            apply: Box::new(apply),
        });
        let mut pause = FIRST_RETRY;
        let mut failing = false;
        loop {
            match self.stream(&judge, &resubscribe, &mut failing).await {
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
    async fn stream(&self, judge: &Arc<Judge>, resubscribe: &Notify, failing: &mut bool) -> Ended {
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
                let Some(reply) = self.answer(response, &mut acked, judge).await else {
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

    /// The ACK or NACK of `response`, once judged on a thread of its own, away from the runtime
    /// that answers probes; `None` for a type not asked for.
    async fn answer(
        &self,
        response: DiscoveryResponse,
        acked: &mut String,
        judge: &Arc<Judge>,
    ) -> Option<DiscoveryRequest> {
        if response.type_url != TYPE_URL {
            static OTHER_TYPE: Throttle = Throttle::new();
            if OTHER_TYPE.hit().is_some() {
                tracing::warn!(type_url = %response.type_url, "xDS response of a type not subscribed to: ignored");
            }
            return None;
        }
        let DiscoveryResponse {
            version_info: version,
            resources,
            nonce,
            ..
        } = response;
        let judged = {
            let (judge, version) = (judge.clone(), version.clone());
            on_own_thread(move || judge.judge(&version, resources))
        };
        let nack = judged
            .await
            .unwrap_or_else(|e| Some(format!("the response could not be judged: {e}")));
        if nack.is_none() {
            *acked = version;
        }
        Some(self.request(acked, &nonce, nack))
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

/// The rules of one xDS response, converted from protobuf straight into the typed rules: every
/// resource a `RateLimitConfig`, validated as a rule file named `xds:<resource name>` is; the
/// resources are kept as the rules' sources (`Resources`). The errors name the resource and the path of the
/// offending field (`descriptors[0].rate_limit.unit`). No resource at all is a valid, empty
/// configuration. `digests` are the SHA-256 of each resource's bytes. Public as the one entry
/// from protobuf into rules, for the fuzz targets.
pub fn convert(
    resources: Vec<Any>,
    digests: &[Digest],
    merge_domains: bool,
) -> Result<Loaded, Rejection> {
    let mut errors = Rejection::default();
    let mut loaded = Loaded::default();
    let mut kept = Vec::with_capacity(resources.len());
    for (i, (any, digest)) in resources.into_iter().zip(digests).enumerate() {
        if any.type_url != TYPE_URL {
            errors.add(|| format!("resource {i}: a {}, not a RateLimitConfig", any.type_url));
            continue;
        }
        let config = match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(config) => config,
            Err(e) => {
                errors.add(|| {
                    let named = Named::decode(any.value.as_slice()).unwrap_or_default();
                    let name = resource_name(&named.name, &named.domain, i);
                    format!("xds:{name}: not a RateLimitConfig: {}", compact(&e))
                });
                continue;
            }
        };
        kept.push(any);
        let file = PathBuf::from(format!(
            "xds:{}",
            resource_name(&config.name, &config.domain, i)
        ));
        loaded.files.push((file.clone(), hex(digest)));
        let mut resource = Resource {
            file: &file,
            domain: &config.domain,
            errors: &mut errors,
        };
        let descriptors = resource.descriptors(config.descriptors, None);
        if config.domain.is_empty() {
            resource.error(|| "domain".into(), "config file cannot have empty domain");
        } else if config.domain.len() > MOST_DOMAIN_BYTES {
            resource.error(|| "domain".into(), domain_too_long(config.domain.len()));
        }
        loaded.domains.push(DomainConfig {
            file,
            // A resource has no lines: line 0 says so wherever rules are shown.
            line: 0,
            domain: config.domain,
            descriptors,
            quota_buckets: Vec::new(),
        });
    }
    // While collisions are sought, a top-level rule's line is its index + 1: it names the rule.
    number_rules(&mut loaded.domains, true);
    for e in domain_collisions(&loaded.domains, merge_domains) {
        errors.add(|| {
            let path = match e.line {
                0 => "domain".to_owned(),
                line => format!("descriptors[{}]", line - 1),
            };
            format!("{}: {path}: {}", e.file.display(), e.message)
        });
    }
    number_rules(&mut loaded.domains, false);
    if errors.total > 0 {
        return Err(errors);
    }
    loaded.sources = Sources::Received(Box::new(Resources(kept)));
    Ok(loaded)
}

/// The resources of an accepted xDS response, kept as the rules' sources.
#[derive(Debug)]
struct Resources(Vec<Any>);

impl Received for Resources {
    fn domains(&self) -> Vec<DomainConfig> {
        // Digests name files in `Loaded`, which is not kept; domains may merge here as they did
        // when the resources were accepted.
        let digests = vec![Digest::default(); self.0.len()];
        convert(self.0.clone(), &digests, true)
            .map(|loaded| loaded.domains)
            .unwrap_or_default()
    }
}

/// Gives each top-level rule its index + 1 as its line (`numbered`), or line 0 (none).
fn number_rules(domains: &mut [DomainConfig], numbered: bool) {
    for d in domains {
        for (j, rule) in d.descriptors.iter_mut().enumerate() {
            rule.line = if numbered { j + 1 } else { 0 };
        }
    }
}

/// A resource's name: its `name`, else its domain, else its place in the response.
fn resource_name(name: &str, domain: &str, i: usize) -> String {
    [name, domain]
        .into_iter()
        .find(|n| !n.is_empty())
        .map_or_else(|| format!("#{i}"), str::to_owned)
}

/// The name and domain of a `RateLimitConfig` that does not decode in full, to name it in the
/// error: the descriptors (field 3) are skipped, not decoded.
#[derive(Clone, PartialEq, prost::Message)]
struct Named {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    domain: String,
}

/// A decoding error with each run of one field in its path said once, with its count: a message
/// nested a hundred times deep names its field once, not a hundred times.
fn compact(e: &prost::DecodeError) -> String {
    let text = e.to_string();
    let mut out = String::new();
    let mut parts = text.split(": ").peekable();
    while let Some(part) = parts.next() {
        let mut times = 1;
        while parts.peek() == Some(&part) {
            parts.next();
            times += 1;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(part);
        if times > 1 {
            let _ = write!(out, " (×{times})");
        }
    }
    out
}

/// Where a descriptor sits in its resource: its index among its siblings, under its parent,
/// `depth` levels down (1 at the top).
struct At<'a> {
    up: Option<&'a At<'a>>,
    depth: usize,
    index: usize,
    key: &'a str,
    value: Option<&'a str>,
}

impl At<'_> {
    /// The field path, `descriptors[0].descriptors[3]`.
    fn path(&self) -> String {
        let mut indices = Vec::new();
        let mut at = Some(self);
        while let Some(a) = at {
            indices.push(a.index);
            at = a.up;
        }
        let steps: Vec<String> = indices
            .iter()
            .rev()
            .map(|i| format!("descriptors[{i}]"))
            .collect();
        steps.join(".")
    }

    /// The composite key, as envoyproxy/ratelimit names a rule: `domain.key_value.key…`.
    fn composite(&self, domain: &str) -> String {
        let mut steps = Vec::new();
        let mut at = Some(self);
        while let Some(a) = at {
            steps.push(composite(a.key, a.value));
            at = a.up;
        }
        steps.push(domain.to_owned());
        steps.reverse();
        steps.join(".")
    }
}

/// Converts the descriptors of one resource into rules, validating them as a rule file's are.
struct Resource<'a> {
    file: &'a Path,
    domain: &'a str,
    errors: &'a mut Rejection,
}

impl Resource<'_> {
    fn error(&mut self, path: impl FnOnce() -> String, message: impl std::fmt::Display) {
        let file = self.file;
        self.errors
            .add(|| format!("{}: {}: {message}", file.display(), path()));
    }

    /// The rules of `protos`, the children of `up` (`None` at the top); a level deeper than
    /// `MOST_DESCRIPTOR_DEPTH` is an error and is not converted, so that this recursion is
    /// bounded whatever the resource holds.
    fn descriptors(
        &mut self,
        protos: Vec<RateLimitDescriptor>,
        up: Option<&At>,
    ) -> Vec<DescriptorConfig> {
        let mut rules = Vec::with_capacity(protos.len());
        for (index, mut proto) in protos.into_iter().enumerate() {
            let key = std::mem::take(&mut proto.key);
            let value = Some(std::mem::take(&mut proto.value)).filter(|v| !v.is_empty());
            let at = At {
                up,
                depth: up.map_or(1, |u| u.depth + 1),
                index,
                key: &key,
                value: value.as_deref(),
            };
            if key.is_empty() {
                self.error(|| at.path(), "descriptor has empty key");
            }
            let limits: Vec<RuleLimit> = proto
                .rate_limit
                .take()
                .and_then(|policy| self.limit(policy, &at))
                .into_iter()
                .collect();
            let metadata = proto.metadata.take().and_then(|m| self.metadata(m, &at));
            let descriptors = if proto.descriptors.is_empty() {
                Vec::new()
            } else if at.depth >= MOST_DESCRIPTOR_DEPTH {
                self.error(
                    || format!("{}.descriptors[0]", at.path()),
                    format_args!("descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels"),
                );
                Vec::new()
            } else {
                self.descriptors(std::mem::take(&mut proto.descriptors), Some(&at))
            };
            rules.push(DescriptorConfig {
                line: 0,
                key,
                value,
                limits: limits.into(),
                mode: match (proto.shadow_mode, proto.quota_mode) {
                    (true, true) => Mode::ShadowQuota,
                    (true, false) => Mode::Shadow,
                    (false, true) => Mode::Quota,
                    (false, false) => Mode::Enforce,
                },
                counting: None,
                lease: None,
                scope: None,
                share_threshold: false,
                detailed_metric: proto.detailed_metric,
                value_to_metric: false,
                metadata,
                hold: None,
                weights: Vec::new(),
                descriptors,
            });
        }
        let mut distinct = HashSet::with_capacity(rules.len());
        for (index, rule) in rules.iter().enumerate() {
            if !distinct.insert((rule.key.as_str(), rule.value.as_deref())) {
                let at = At {
                    up,
                    depth: up.map_or(1, |u| u.depth + 1),
                    index,
                    key: &rule.key,
                    value: rule.value.as_deref(),
                };
                let domain = self.domain;
                self.error(
                    || at.path(),
                    format_args!(
                        "duplicate descriptor composite key '{}'",
                        at.composite(domain)
                    ),
                );
            }
        }
        rules
    }

    /// The limit of `policy`, validated as a rule file's `rate_limit` is; `None` when invalid.
    fn limit(&mut self, policy: RateLimitPolicy, at: &At) -> Option<RuleLimit> {
        let errors_before = self.errors.total;
        let field = |name: &'static str| move || format!("{}.rate_limit{name}", at.path());
        // UNKNOWN is how a proto says "no unit": what an unlimited limit has.
        let (unit, unit_text) = match RateLimitUnit::try_from(policy.unit) {
            Ok(RateLimitUnit::Unknown) => (None, "UNKNOWN".to_owned()),
            Ok(unit) => (
                Unit::parse(unit.as_str_name()),
                unit.as_str_name().to_owned(),
            ),
            Err(_) => (None, policy.unit.to_string()),
        };
        let mut replaces = Vec::with_capacity(policy.replaces.len());
        for (j, r) in policy.replaces.into_iter().enumerate() {
            let at_replace = || format!("{}.rate_limit.replaces[{j}]", at.path());
            if r.name.is_empty() {
                self.error(at_replace, "should not have an empty replaces entry");
            } else if r.name == policy.name {
                self.error(
                    at_replace,
                    "replaces should not contain name of same descriptor",
                );
            }
            replaces.push(r.name);
        }
        let limit = if policy.unlimited {
            if unit.is_some() {
                self.error(
                    field(".unit"),
                    "should not specify rate limit unit when unlimited",
                );
            }
            None
        } else {
            let Some(unit) = unit else {
                self.error(
                    field(".unit"),
                    format_args!("invalid rate limit unit '{unit_text}'"),
                );
                return None;
            };
            Some(Limit {
                name: policy.name.clone(),
                requests_per_unit: policy.requests_per_unit,
                unit,
                unit_multiplier: 1,
                algorithm: Algorithm::FixedWindow,
                burst: policy.requests_per_unit,
                calendar: None,
            })
        };
        (self.errors.total == errors_before).then_some(RuleLimit {
            name: policy.name,
            replaces,
            limit,
        })
    }

    /// The metadata as JSON (a `Struct` needs no other validation); nested deeper than
    /// `MOST_METADATA_DEPTH` (the mapping itself is level 1), an error.
    fn metadata(&mut self, metadata: Struct, at: &At) -> Option<serde_json::Value> {
        let json = object(metadata, 1);
        if json.is_none() {
            self.error(
                || format!("{}.metadata", at.path()),
                format_args!("metadata nests deeper than {MOST_METADATA_DEPTH} levels"),
            );
        }
        json
    }
}

/// A `Struct` at nesting `depth` as JSON; `None` if it nests deeper than `MOST_METADATA_DEPTH`,
/// where the recursion stops.
fn object(s: Struct, depth: usize) -> Option<serde_json::Value> {
    if depth > MOST_METADATA_DEPTH {
        return None;
    }
    let mut map = serde_json::Map::with_capacity(s.fields.len());
    for (k, v) in s.fields {
        map.insert(k, json(v, depth)?);
    }
    Some(serde_json::Value::Object(map))
}

/// A `Value` inside a container at nesting `depth` as JSON.
fn json(v: Value, depth: usize) -> Option<serde_json::Value> {
    Some(match v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 2f64.powi(53) => {
            serde_json::Value::from(n as i64)
        }
        Some(Kind::NumberValue(n)) => serde_json::Value::from(n),
        Some(Kind::StringValue(s)) => serde_json::Value::from(s),
        Some(Kind::BoolValue(b)) => serde_json::Value::from(b),
        Some(Kind::StructValue(s)) => object(s, depth + 1)?,
        Some(Kind::ListValue(l)) => {
            if depth + 1 > MOST_METADATA_DEPTH {
                return None;
            }
            let items = l.values.into_iter().map(|v| json(v, depth + 1));
            serde_json::Value::Array(items.collect::<Option<_>>()?)
        }
    })
}

/// What one xDS response turned out to be, as `apply` sees it (on a thread of its own).
pub enum Snapshot<'a> {
    /// Valid rules, to put in force (then ACKed).
    Valid { version: &'a str, rules: Loaded },
    /// The very resources of the rules in force: ACKed without converting them again.
    Unchanged { version: &'a str },
    /// Rejected (then NACKed); `again` when these are the resources rejected last, recognised
    /// without converting them again.
    Rejected {
        version: &'a str,
        rejection: &'a Rejection,
        again: bool,
    },
}

/// Why a response was rejected: its first errors, each naming its resource and where in it, and
/// how many there were in all. Its text is bounded, whatever the response held.
#[derive(Debug, Default)]
pub struct Rejection {
    shown: Vec<String>,
    total: usize,
}

impl Rejection {
    /// Counts one error; `describe` is called only for the first `SHOWN_ERRORS`.
    fn add(&mut self, describe: impl FnOnce() -> String) {
        self.total += 1;
        if self.shown.len() < SHOWN_ERRORS {
            self.shown.push(clip(&describe()));
        }
    }

    /// The NACK's `error_detail.message`: the errors shown, one per line, then how many more.
    fn message(&self) -> String {
        let mut text = self.shown.join("\n");
        let hidden = self.total - self.shown.len();
        if hidden > 0 {
            let _ = write!(text, "\nand {hidden} more: {} errors in all", self.total);
        }
        text
    }

    /// How many errors, then those shown and how many more, on one line: for the log.
    pub fn summary(&self) -> String {
        let plural = if self.total == 1 { "" } else { "s" };
        let mut text = format!("{} error{plural}: {}", self.total, self.shown.join("; "));
        let hidden = self.total - self.shown.len();
        if hidden > 0 {
            let _ = write!(text, "; and {hidden} more");
        }
        text
    }
}

/// `error` as it is shown: control characters escaped (one error, one line), at most
/// `LONGEST_ERROR` bytes.
fn clip(error: &str) -> String {
    let mut out = String::with_capacity(error.len().min(LONGEST_ERROR));
    for c in error.chars() {
        let before = out.len();
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        if out.len() > LONGEST_ERROR {
            out.truncate(before);
            out.push('…');
            break;
        }
    }
    out
}

/// The SHA-256 of bytes.
pub type Digest = [u8; 32];

/// What the subscription has seen, by the digest of a response's resources (`snapshot_digest`).
#[derive(Default)]
struct Seen {
    /// The resources of the last valid response: those of the rules in force.
    in_force: Option<Digest>,
    /// The last rejected resources, and why.
    rejected: Option<(Digest, Rejection)>,
}

/// Turns responses into rules and hands them to `apply`, one at a time, on a thread of its own.
struct Judge {
    merge_domains: bool,
    seen: Mutex<Seen>,
    apply: Box<dyn Fn(Snapshot) + Send + Sync>,
}

impl Judge {
    /// Judges the resources of one response and hands the outcome to `apply`; `None` to ACK,
    /// else the NACK's message. Resources already seen, in force or rejected last, are
    /// recognised by their digest and not converted again.
    fn judge(&self, version: &str, resources: Vec<Any>) -> Option<String> {
        let digests: Vec<Digest> = resources
            .iter()
            .map(|r| Sha256::digest(&r.value).into())
            .collect();
        let digest = snapshot_digest(&resources, &digests);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.in_force == Some(digest) {
            (self.apply)(Snapshot::Unchanged { version });
            return None;
        }
        if let Some((rejected, rejection)) = &seen.rejected
            && *rejected == digest
        {
            (self.apply)(Snapshot::Rejected {
                version,
                rejection,
                again: true,
            });
            return Some(rejection.message());
        }
        match convert(resources, &digests, self.merge_domains) {
            Ok(rules) => {
                (self.apply)(Snapshot::Valid { version, rules });
                seen.in_force = Some(digest);
                None
            }
            Err(rejection) => {
                (self.apply)(Snapshot::Rejected {
                    version,
                    rejection: &rejection,
                    again: false,
                });
                let message = rejection.message();
                seen.rejected = Some((digest, rejection));
                Some(message)
            }
        }
    }
}

/// One digest for every resource of a response, in order: each one's type and the digest of
/// its bytes.
fn snapshot_digest(resources: &[Any], digests: &[Digest]) -> Digest {
    let mut h = Sha256::new();
    for (r, digest) in resources.iter().zip(digests) {
        h.update((r.type_url.len() as u64).to_le_bytes());
        h.update(r.type_url.as_bytes());
        h.update(digest);
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn digests(resources: &[Any]) -> Vec<Digest> {
        resources
            .iter()
            .map(|r| Sha256::digest(&r.value).into())
            .collect()
    }

    /// The rules of `resources`, or the errors shown.
    fn rules(resources: Vec<Any>, merge_domains: bool) -> Result<Loaded, Vec<String>> {
        let digests = digests(&resources);
        convert(resources, &digests, merge_domains).map_err(|r| r.shown)
    }

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
        let loaded = rules(vec![any(&config("default/eg/http", vec![route]))], false).unwrap();
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
            rules(vec![any(&bad_unit)], false).unwrap_err(),
            [
                "xds:d: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'"
            ]
        );
        let twice = config("d", vec![descriptor("k", "v", RateLimitUnit::Second, 1)]);
        assert_eq!(
            rules(vec![any(&twice), any(&twice)], false).unwrap_err(),
            ["xds:d: domain: duplicate domain 'd' in config file"]
        );
        assert!(rules(vec![any(&twice), any(&twice)], true).is_err());
        let not_a_config = Any {
            type_url: "type.googleapis.com/google.protobuf.Struct".into(),
            value: Vec::new(),
        };
        assert_eq!(
            rules(vec![not_a_config], false).unwrap_err(),
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
        let loaded = rules(vec![any(&config("d", vec![d]))], false).unwrap();
        let rule = &loaded.domains[0].descriptors[0].limits[0];
        assert_eq!(
            (rule.limit.is_none(), rule.replaces.as_slice()),
            (true, &["other".to_owned()][..])
        );
    }

    #[test]
    fn any_text_survives() {
        let odd = "a\"b\\c\n\t\u{7f}\u{85}\u{2028}\u{feff}é€😀: #x";
        let rule = descriptor(odd, odd, RateLimitUnit::Second, 1);
        let loaded = rules(vec![any(&config(odd, vec![rule]))], false).unwrap();
        let d = &loaded.domains[0];
        assert_eq!(d.domain, odd);
        assert_eq!(d.descriptors[0].key, odd);
        assert_eq!(d.descriptors[0].value.as_deref(), Some(odd));
    }

    #[test]
    fn no_resources_is_an_empty_configuration() {
        let loaded = rules(vec![], false).unwrap();
        assert!(loaded.domains.is_empty());
    }

    /// One rule under `levels` nested descriptors, with `metadata` on the deepest.
    fn nested(levels: usize, metadata: Option<Struct>) -> RateLimitConfig {
        let mut d = descriptor("k", "", RateLimitUnit::Hour, 1);
        d.metadata = metadata;
        for _ in 1..levels {
            d = RateLimitDescriptor {
                key: "k".into(),
                descriptors: vec![d],
                ..Default::default()
            };
        }
        config("deep", vec![d])
    }

    /// A mapping nesting `levels` mappings (itself included).
    fn deep_struct(levels: usize) -> Struct {
        let mut s = Struct::default();
        for _ in 1..levels {
            let value = Value {
                kind: Some(Kind::StructValue(s)),
            };
            s = Struct {
                fields: [("a".to_owned(), value)].into(),
            };
        }
        s
    }

    #[test]
    fn descriptors_and_metadata_nest_as_deep_as_the_bounds_and_no_deeper() {
        let deepest = rules(
            vec![any(&nested(
                MOST_DESCRIPTOR_DEPTH,
                Some(deep_struct(MOST_METADATA_DEPTH)),
            ))],
            false,
        )
        .unwrap();
        let mut d = &deepest.domains[0].descriptors[0];
        for _ in 1..MOST_DESCRIPTOR_DEPTH {
            d = &d.descriptors[0];
        }
        assert_eq!(d.limits.len(), 1);
        let mut depth = 0;
        let mut m = d.metadata.as_ref().unwrap();
        while let Some(inner) = m.get("a") {
            (m, depth) = (inner, depth + 1);
        }
        assert_eq!(depth + 1, MOST_METADATA_DEPTH);

        let errors = rules(vec![any(&nested(MOST_DESCRIPTOR_DEPTH + 1, None))], false);
        let path = vec!["descriptors[0]"; MOST_DESCRIPTOR_DEPTH + 1].join(".");
        assert_eq!(
            errors.unwrap_err(),
            [format!(
                "xds:deep: {path}: descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels"
            )]
        );
        let errors = rules(
            vec![any(&nested(2, Some(deep_struct(MOST_METADATA_DEPTH + 1))))],
            false,
        );
        assert_eq!(
            errors.unwrap_err(),
            [format!(
                "xds:deep: descriptors[0].descriptors[0].metadata: metadata nests deeper than {MOST_METADATA_DEPTH} levels"
            )]
        );
    }

    #[test]
    fn a_resource_too_deep_to_decode_is_named_and_its_error_compact() {
        let errors = rules(vec![any(&nested(1_000, None))], false).unwrap_err();
        assert_eq!(
            errors,
            [
                "xds:deep: not a RateLimitConfig: failed to decode Protobuf message: RateLimitDescriptor.descriptors (×100): RateLimitConfig.descriptors: recursion limit reached"
            ]
        );
    }

    #[test]
    fn validation_matches_rule_files() {
        let mut unlimited_with_unit = descriptor("a", "", RateLimitUnit::Second, 1);
        let policy = unlimited_with_unit.rate_limit.as_mut().unwrap();
        policy.unlimited = true;
        policy.name = "n".into();
        policy.replaces = vec![
            RateLimitReplace { name: "".into() },
            RateLimitReplace { name: "n".into() },
        ];
        let mut odd_unit = descriptor("b", "", RateLimitUnit::Second, 1);
        odd_unit.rate_limit.as_mut().unwrap().unit = 99;
        let nested_twice = RateLimitDescriptor {
            key: "p".into(),
            value: "1".into(),
            descriptors: vec![
                descriptor("c", "x", RateLimitUnit::Second, 1),
                descriptor("c", "x", RateLimitUnit::Minute, 1),
            ],
            ..Default::default()
        };
        let no_key = descriptor("", "", RateLimitUnit::Second, 1);
        let resource = config(
            "",
            vec![unlimited_with_unit, odd_unit, nested_twice, no_key],
        );
        assert_eq!(
            rules(vec![any(&resource)], false).unwrap_err(),
            [
                "xds:#0: descriptors[0].rate_limit.replaces[0]: should not have an empty replaces entry",
                "xds:#0: descriptors[0].rate_limit.replaces[1]: replaces should not contain name of same descriptor",
                "xds:#0: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
                "xds:#0: descriptors[1].rate_limit.unit: invalid rate limit unit '99'",
                "xds:#0: descriptors[2].descriptors[1]: duplicate descriptor composite key '.p_1.c_x'",
                "xds:#0: descriptors[3]: descriptor has empty key",
                "xds:#0: domain: config file cannot have empty domain",
            ]
        );
    }

    #[test]
    fn merged_domains_collide_on_a_top_level_rule_named_by_its_place() {
        let a = config("d", vec![descriptor("k", "v", RateLimitUnit::Second, 1)]);
        let mut b = config(
            "d",
            vec![
                descriptor("other", "", RateLimitUnit::Second, 1),
                descriptor("k", "v", RateLimitUnit::Minute, 1),
            ],
        );
        b.name = "b".into();
        assert_eq!(
            rules(vec![any(&a), any(&b)], true).unwrap_err(),
            ["xds:b: descriptors[1]: duplicate descriptor composite key 'd.k_v'"]
        );
        b.descriptors.pop();
        let loaded = rules(vec![any(&a), any(&b)], true).unwrap();
        assert!(
            loaded
                .domains
                .iter()
                .flat_map(|d| &d.descriptors)
                .all(|rule| rule.line == 0),
            "a resource has no lines"
        );
    }

    #[test]
    fn a_rejection_shows_its_first_errors_cut_short_and_counts_the_rest() {
        let mut rejection = Rejection::default();
        for i in 0..25 {
            rejection.add(|| format!("error {i}"));
        }
        rejection.shown[1] = clip(&format!("line\nbreak {}", "x".repeat(5000)));
        let message = rejection.message();
        let lines: Vec<&str> = message.lines().collect();
        assert_eq!(lines.len(), SHOWN_ERRORS + 1);
        assert_eq!(lines[0], "error 0");
        assert!(lines[1].starts_with("line\\nbreak xxx") && lines[1].ends_with('…'));
        assert!(lines[1].len() <= LONGEST_ERROR + '…'.len_utf8());
        assert_eq!(lines[SHOWN_ERRORS], "and 15 more: 25 errors in all");
        assert!(rejection.summary().starts_with("25 errors: error 0; line"));
        assert!(rejection.summary().ends_with("; error 9; and 15 more"));
    }

    #[test]
    fn resources_seen_before_are_recognised_without_converting_them() {
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let seen = outcomes.clone();
        let judge = Judge {
            merge_domains: false,
            seen: Mutex::default(),
            apply: Box::new(move |snapshot| {
                let outcome = match snapshot {
                    Snapshot::Valid { .. } => "valid",
                    Snapshot::Unchanged { .. } => "unchanged",
                    Snapshot::Rejected { again: false, .. } => "rejected",
                    Snapshot::Rejected { again: true, .. } => "rejected again",
                };
                seen.lock().unwrap().push(outcome);
            }),
        };
        let good = vec![any(&config(
            "d",
            vec![descriptor("k", "", RateLimitUnit::Hour, 1)],
        ))];
        let bad = vec![any(&config(
            "d",
            vec![descriptor("k", "", RateLimitUnit::Unknown, 1)],
        ))];
        assert_eq!(judge.judge("1", good.clone()), None);
        assert_eq!(judge.judge("2", good.clone()), None);
        let nack = judge.judge("3", bad.clone());
        assert_eq!(judge.judge("4", bad.clone()), nack);
        assert_eq!(judge.judge("5", good), None);
        assert_eq!(
            *outcomes.lock().unwrap(),
            [
                "valid",
                "unchanged",
                "rejected",
                "rejected again",
                "unchanged"
            ]
        );
    }
}
