//! Rules over xDS: a State-of-the-World ADS client for envoyproxy/ratelimit's `RateLimitConfig`
//! resources, as Envoy Gateway serves them. Each response is converted from protobuf straight
//! into typed rules and validated as rule files are, on a thread of its own: a valid one is handed
//! on and ACKed, an invalid one is NACKed with a bounded summary of its errors and the rules in
//! force stay. Resources already seen (in force, or rejected last) are recognised by their digest
//! and not converted again. A lost stream is resubscribed, with backoff, from scratch.
//!
//! Here the ADS client (`Server`, `Subscription`); `convert` turns protobuf into rules, `judge`
//! decides each response's ACK or NACK.

use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status;
use rustls::{ClientConfig, RootCertStore};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Identity};

use sluice_core::certs::{self, PemFile};
use sluice_core::config::on_own_thread;
use sluice_core::log_throttle::LogThrottle;

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

mod convert;
mod judge;

pub use convert::{Rejection, convert};
use judge::Judge;
pub use judge::Snapshot;

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
            static OTHER_TYPE: LogThrottle = LogThrottle::new();
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

/// The SHA-256 of bytes.
pub type Digest = [u8; 32];

#[cfg(test)]
mod tests {
    use super::convert::*;
    use super::judge::*;
    use super::*;
    use envoy_types::pb::google::protobuf::Any;
    use envoy_types::pb::ratelimit::config::ratelimit::v3::{
        RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
    };
    use prost::Message;
    use sha2::{Digest as _, Sha256};
    use sluice_core::config::{Loaded, MOST_DESCRIPTOR_DEPTH, MOST_METADATA_DEPTH};

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
