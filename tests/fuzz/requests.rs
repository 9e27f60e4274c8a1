//! `ShouldRateLimit` with any request a client could encode: any domain, descriptors and entries
//! of any bytes (empty, huge, not UTF-8), any hits and limit overrides, past the bounds or not.
//! Every request is answered (OK or OVER_LIMIT with a status per descriptor, or an error naming
//! what is wrong), the server lives on, and decisions are all-or-nothing: a request answered
//! with an error or denied moves no counter, as the same descriptors asked with 0 hits before
//! and after it show. The same holds in process, for any descriptors the rules plan and the
//! embedded store decides; and any `/json` body is explained or refused with a message.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic_prost::ProstCodec;

use sluice::service::explain;
use sluice::service::rls::{Answering, Bounds};
use sluice_core::config;
use sluice_core::limiter::Unit as Per;
use sluice_core::rules::RuleSet;
use sluice_core::store::{MemoryStore, Percent};

use super::fuzz;
use super::planned::{Planned, all_or_nothing};
use support::{HOUR, OK, OVER_LIMIT, Sluice, unix_ms};

const RULES: &str = r#"domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: path
    value: "/a*"
    rate_limit: {unit: day, requests_per_unit: 5, name: path}
  - key: ip
    descriptors:
      - key: path
        rate_limit: {unit: hour, requests_per_unit: 3, replaces: [{name: path}]}
  - key: plan
    value: free
    rate_limit: {unlimited: true}
  - key: tenant
    rate_limits:
      - {unit: hour, requests_per_unit: 10}
      - {unit: day, requests_per_unit: 20, algorithm: sliding_log}
"#;

const MAX_DESCRIPTORS: usize = 8;
const MAX_ENTRIES: usize = 4;

/// `RateLimitRequest` as it is on the wire, with `bytes` where the proto says `string`: a client
/// can send any bytes there.
#[derive(Clone, PartialEq, prost::Message)]
struct Request {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<Descriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Descriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<Entry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<Override>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Entry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Override {
    #[prost(uint32, tag = "1")]
    requests_per_unit: u32,
    #[prost(int32, tag = "2")]
    unit: i32,
}

/// Bytes as keys and values hold them: the rules' words, any bytes, or a lot of them.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => prop::sample::select(vec!["user", "path", "ip", "plan", "tenant", "free", "/a", "/abc", "", "*"])
            .prop_map(|s| s.as_bytes().to_vec()),
        3 => prop::collection::vec(any::<u8>(), 0..24),
        1 => (1..60_000usize, any::<u8>()).prop_map(|(n, b)| vec![b; n]),
    ]
}

fn overrides() -> impl Strategy<Value = Override> {
    (
        prop_oneof![Just(0u32), Just(1), Just(u32::MAX), any::<u32>()],
        prop_oneof![4 => 0..8i32, 1 => any::<i32>()],
    )
        .prop_map(|(requests_per_unit, unit)| Override {
            requests_per_unit,
            unit,
        })
}

fn descriptors() -> impl Strategy<Value = Descriptor> {
    (
        prop::collection::vec(
            (bytes(), bytes()).prop_map(|(key, value)| Entry { key, value }),
            0..MAX_ENTRIES + 2,
        ),
        prop::option::weighted(0.2, overrides()),
        prop::option::weighted(
            0.3,
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(1 << 32),
                any::<u64>()
            ],
        ),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(entries, limit, hits, is_negative_hits)| Descriptor {
            entries,
            limit,
            hits_addend: hits.map(|value| UInt64Value { value }),
            is_negative_hits,
        })
}

fn requests() -> impl Strategy<Value = Request> {
    (
        prop_oneof![8 => Just(b"web".to_vec()), 1 => Just(Vec::new()), 1 => bytes()],
        prop::collection::vec(descriptors(), 0..MAX_DESCRIPTORS + 2),
        prop_oneof![Just(0u32), Just(1), Just(u32::MAX), any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| Request {
            domain,
            descriptors,
            hits_addend,
        })
}

/// Whether the service takes `d` as it is (bounds and override units as `serve` sets them).
fn valid(d: &Descriptor) -> bool {
    !d.entries.is_empty()
        && d.entries.len() <= MAX_ENTRIES
        && d.entries.iter().all(|e| !e.key.is_empty())
        && d.limit.as_ref().is_none_or(|l| (1..=6).contains(&l.unit))
}

/// The same request's valid descriptors, each asked with 0 hits: it reads their counters
/// without moving them. `None` when nothing of it can be asked.
fn probe(request: &Request) -> Option<Request> {
    let descriptors: Vec<Descriptor> = request
        .descriptors
        .iter()
        .filter(|d| valid(d))
        .take(MAX_DESCRIPTORS)
        .map(|d| Descriptor {
            hits_addend: Some(UInt64Value { value: 0 }),
            is_negative_hits: false,
            ..d.clone()
        })
        .collect();
    let domain = !request.domain.is_empty() && request.domain.len() <= config::MOST_DOMAIN_BYTES;
    (domain && !descriptors.is_empty()).then(|| Request {
        domain: request.domain.clone(),
        descriptors,
        hits_addend: 0,
    })
}

/// Each descriptor's remaining requests, where its limit's window is an hour or longer (the
/// shorter ones may end between two probes).
fn remaining(response: &RateLimitResponse) -> Vec<Option<u32>> {
    response
        .statuses
        .iter()
        .map(|s| {
            let unit = s.current_limit.as_ref()?.unit;
            let long = ![Unit::Unknown, Unit::Second, Unit::Minute]
                .iter()
                .any(|u| *u as i32 == unit);
            long.then_some(s.limit_remaining)
        })
        .collect()
}

async fn send(channel: &Channel, request: Request) -> Result<RateLimitResponse, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.expect("the connection is ready");
    let path =
        PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    grpc.unary(tonic::Request::new(request), path, ProstCodec::default())
        .await
        .map(tonic::Response::into_inner)
}

#[test]
fn any_request_is_answered_and_one_refused_or_denied_moves_no_counter() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let max_descriptors = MAX_DESCRIPTORS.to_string();
    let max_entries = MAX_ENTRIES.to_string();
    let mut sluice = runtime.block_on(Sluice::start_with(
        &[("rules.yaml", RULES)],
        &[
            "--max-descriptors",
            &max_descriptors,
            "--max-entries",
            &max_entries,
        ],
    ));
    let channel = runtime.block_on(sluice.channel());
    fuzz(
        "requests::any_request",
        1_500,
        Duration::from_secs(15),
        requests(),
        |request| {
            runtime.block_on(async {
                let hour = unix_ms() / HOUR.as_millis() as u64;
                let mut probe = probe(&request);
                let mut before = None;
                if let Some(p) = &probe {
                    match send(&channel, p.clone()).await {
                        Ok(response) => before = Some(response),
                        // Past --max-request-bytes: the request itself is too.
                        Err(status) if status.code() == Code::OutOfRange => probe = None,
                        Err(status) => {
                            return Err(TestCaseError::fail(format!("probe: {status:?}")));
                        }
                    }
                }
                let answer = send(&channel, request.clone()).await;
                let charged_nothing = match &answer {
                    Ok(response) => {
                        prop_assert!(
                            [OK, OVER_LIMIT].contains(&response.overall_code),
                            "overall code {}",
                            response.overall_code
                        );
                        prop_assert_eq!(response.statuses.len(), request.descriptors.len());
                        response.overall_code == OVER_LIMIT
                    }
                    Err(status) => {
                        prop_assert!(
                            [Code::InvalidArgument, Code::OutOfRange].contains(&status.code()),
                            "{status:?}"
                        );
                        prop_assert!(!status.message().is_empty(), "{status:?}");
                        true
                    }
                };
                let (Some(probe), Some(before)) = (probe, before) else {
                    return Ok(());
                };
                let after = send(&channel, probe)
                    .await
                    .expect("a valid probe is answered");
                if charged_nothing && unix_ms() / HOUR.as_millis() as u64 == hour {
                    // A descriptor left unevaluated (another one denied from the local
                    // over-limit cache) has no limit in its status.
                    let moved = remaining(&before)
                        .into_iter()
                        .zip(remaining(&after))
                        .position(|pair| matches!(pair, (Some(a), Some(b)) if a != b));
                    prop_assert!(
                        moved.is_none(),
                        "descriptor {:?} moved for a request answered {:?}",
                        moved,
                        answer.map(|r| r.overall_code)
                    );
                }
                Ok(())
            })
        },
    );
    assert!(sluice.alive(), "sluice still runs:\n{}", sluice.log_text());
}

/// A domain and descriptors as the rules plan them: any entries, hits and limit overrides.
fn planned() -> impl Strategy<Value = (Vec<u8>, Vec<Planned>)> {
    let units = "second minute hour day week month year".split(' ');
    let per = prop::sample::select(
        units
            .map(|u| Per::parse(u).expect("a unit"))
            .collect::<Vec<_>>(),
    );
    let descriptor = (
        prop::collection::vec((bytes(), bytes()), 1..=MAX_ENTRIES),
        prop_oneof![Just(0u64), Just(1), Just(1 << 32), 0..=1u64 << 32],
        prop::bool::weighted(0.1),
        prop::option::weighted(0.2, (any::<u32>(), per)),
    );
    (
        prop_oneof![8 => Just(b"web".to_vec()), 1 => bytes()],
        prop::collection::vec(descriptor, 1..=MAX_DESCRIPTORS),
    )
}

/// Descriptors planned by the rules and decided by the embedded store at one instant are
/// decided all or nothing (`planned::all_or_nothing`).
#[test]
fn planned_requests_on_the_embedded_store_are_all_or_nothing() {
    let (domain, _) =
        config::parse(std::path::Path::new("rules.yaml"), RULES).expect("valid rules");
    let rules = RuleSet::new(vec![domain]);
    let store = MemoryStore::new(10_000, Percent(50));
    fuzz(
        "requests::planned",
        2_000,
        Duration::from_secs(5),
        planned(),
        |(domain, descriptors)| {
            all_or_nothing(&rules, &store, &domain, &descriptors).map_err(TestCaseError::fail)
        },
    );
}

/// JSON as `/json` and `/explain` might get it: the request's fields (in both spellings), and
/// others, holding values of any type.
fn json_bodies() -> impl Strategy<Value = serde_json::Value> {
    let names = "domain descriptors entries key value limit requests_per_unit requestsPerUnit unit \
        hits_addend hitsAddend is_negative_hits at x";
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        prop::sample::select(vec![
            "web",
            "user",
            "",
            "SECOND",
            "HOUR",
            "YEAR",
            "UNKNOWN",
            "4294967296",
            "18446744073709551616",
            "-1",
            "2026-11-22T11:11:11Z",
            "9999-12-31T23:59:59Z",
            "AAEC",
        ])
        .prop_map(serde_json::Value::from),
        any::<String>().prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(5, 48, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::vec(
                (
                    prop::sample::select(names.split_whitespace().collect::<Vec<_>>()),
                    inner
                ),
                0..5
            )
            .prop_map(|fields| {
                let object: serde_json::Map<_, _> =
                    fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
                serde_json::Value::from(object)
            }),
        ]
    })
}

/// Requests in protobuf JSON, their fields holding values of the right type or not.
fn json_requests() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let text = || {
        prop_oneof![
            12 => "[a-z/*_]{0,6}".prop_map(Value::from),
            2 => any::<String>().prop_map(Value::from),
            1 => json_bodies(),
        ]
    };
    let number = || {
        prop_oneof![
            8 => any::<u32>().prop_map(Value::from),
            2 => any::<u64>().prop_map(|n| Value::from(n.to_string())),
            1 => json_bodies(),
        ]
    };
    let unit = prop_oneof![
        12 => prop::sample::select(vec!["SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "YEAR", "WEEK", "UNKNOWN"])
            .prop_map(Value::from),
        1 => json_bodies(),
    ];
    let entry =
        (text(), text()).prop_map(|(key, value)| serde_json::json!({"key": key, "value": value}));
    let descriptor = (
        prop::collection::vec(entry, 1..=MAX_ENTRIES),
        prop::option::of((number(), unit)),
        prop::option::of(number()),
    )
        .prop_map(|(entries, limit, hits)| {
            let mut d = serde_json::json!({"entries": entries});
            if let Some((requests, unit)) = limit {
                d["limit"] = serde_json::json!({"requests_per_unit": requests, "unit": unit});
            }
            if let Some(hits) = hits {
                d["hits_addend"] = hits;
            }
            d
        });
    let at = prop_oneof![
        12 => prop::sample::select(vec!["2026-11-22T11:11:11Z", "1969-12-31T23:59:59Z", "9999-12-31T23:59:59Z", "now"])
            .prop_map(Value::from),
        1 => json_bodies(),
    ];
    (
        prop_oneof![3 => Just(Value::from("web")), 1 => text()],
        prop::collection::vec(descriptor, 1..=MAX_DESCRIPTORS),
        prop::option::of(at),
    )
        .prop_map(|(domain, descriptors, at)| {
            let mut request = serde_json::json!({"domain": domain, "descriptors": descriptors});
            if let Some(at) = at {
                request["at"] = at;
            }
            request
        })
}

#[test]
fn any_json_body_is_explained_or_refused_with_a_message() {
    let (domain, _) =
        config::parse(std::path::Path::new("rules.yaml"), RULES).expect("valid rules");
    let rules = RuleSet::new(vec![domain]);
    let bounds = Bounds {
        max_descriptors: MAX_DESCRIPTORS,
        max_entries: MAX_ENTRIES,
        max_schedule_ahead: Duration::from_secs(31 * 86_400),
    };
    fuzz(
        "requests::json",
        2_000,
        Duration::from_secs(5),
        prop_oneof![
            4 => json_requests().prop_map(|v| v.to_string().into_bytes()),
            1 => json_bodies().prop_map(|v| v.to_string().into_bytes()),
            1 => prop::collection::vec(any::<u8>(), 0..64),
        ],
        |body| {
            let request = match explain::Request::from_json(&body) {
                Ok(request) => request,
                Err(message) => {
                    prop_assert!(!message.trim().is_empty());
                    return Ok(());
                }
            };
            match explain::explain(&rules, &request, &bounds, &Answering::default(), Some("p:")) {
                Ok(explanation) => {
                    let json: Result<serde_json::Value, _> =
                        serde_json::from_str(&explanation.to_json());
                    prop_assert!(json.is_ok(), "{:?}", json);
                    prop_assert!(!explanation.render().is_empty());
                }
                Err(message) => prop_assert!(!message.is_empty()),
            }
            Ok(())
        },
    );
}
