//! What Redis holds is not trusted: each kind of counter's key is made to hold generated data of
//! any type (strings, lists, sets, sorted sets, hashes with sluice's own fields) and any value
//! (numbers past every range, negative, fractional, infinite, not numbers), then asked with any
//! hits. A request on it is decided or gets the `--on-store-error` answer naming the key;
//! requests on healthy keys are decided all along; no breaker opens and sluice lives on.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tonic::Code;

use super::fuzz;
use support::metrics::scrape;
use support::{OK, OVER_LIMIT, Sluice, Store, descriptor, redis_key, request};

const DOMAIN: &str = "data";

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "leaky_bucket",
];

/// A rule per algorithm, keyed on its name.
fn rules() -> String {
    let rules: String = ALGORITHMS
        .iter()
        .map(|a| {
            format!("  - key: {a}\n    rate_limit: {{unit: hour, requests_per_unit: 1000, algorithm: {a}}}\n")
        })
        .collect();
    format!("domain: {DOMAIN}\ndescriptors:\n{rules}")
}

/// Sends one command to the Redis server at `port` and reads its one-line reply.
fn command(port: u16, args: &[&[u8]]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("Redis answers");
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend(format!("${}\r\n", arg.len()).as_bytes());
        out.extend(*arg);
        out.extend(b"\r\n");
    }
    stream.write_all(&out).expect("the command is sent");
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .expect("Redis replies");
    reply
}

/// Values as a counter's fields might hold them, or not.
fn values() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "0", "1", "-1", "1000", "1001", "4294967296", "9223372036854775807",
            "9223372036854775808", "-9223372036854775808", "1e308", "1e309", "-1e309", "inf",
            "-inf", "nan", "0.5", "-0.5", "0x10", "", " 1", "1 ", "abc",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        1 => any::<i64>().prop_map(|n| n.to_string().into_bytes()),
        1 => any::<f64>().prop_map(|n| n.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..16),
    ]
}

/// One write of data that is not sluice's: a Redis command on the key, after its name.
fn writes() -> impl Strategy<Value = Vec<Vec<u8>>> {
    // The fields sluice's scripts read from hashes, and another.
    let field = prop::sample::select(vec!["w", "c", "p", "t", "l", "x"])
        .prop_map(|f| f.as_bytes().to_vec());
    prop_oneof![
        values().prop_map(|v| vec![b"SET".to_vec(), v]),
        prop::collection::vec((field, values()), 1..5).prop_map(|pairs| {
            let mut args = vec![b"HSET".to_vec()];
            args.extend(pairs.into_iter().flat_map(|(f, v)| [f, v]));
            args
        }),
        prop::collection::vec((values(), values()), 1..4).prop_map(|pairs| {
            let mut args = vec![b"ZADD".to_vec()];
            args.extend(
                pairs
                    .into_iter()
                    .flat_map(|(score, member)| [score, member]),
            );
            args
        }),
        values().prop_map(|v| vec![b"RPUSH".to_vec(), v]),
        values().prop_map(|v| vec![b"SADD".to_vec(), v]),
    ]
}

#[test]
fn any_data_in_a_counters_key_fails_only_the_requests_on_it() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = Store::Redis;
    let mut sluice = runtime.block_on(Sluice::on(store, &[("rules.yaml", &rules())], &[]));
    let port = store.redis().expect("a Redis server").ports[0];
    let keys: Vec<String> = ALGORITHMS
        .iter()
        .map(|a| redis_key(&sluice, DOMAIN, &[(a, "bad")]))
        .collect();
    let channel = runtime.block_on(sluice.channel());
    fuzz(
        "store_data::any_data",
        1_200,
        Duration::from_secs(12),
        (
            0..ALGORITHMS.len(),
            prop::collection::vec(writes(), 1..3),
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(1_000),
                Just(u64::MAX),
                any::<u64>()
            ],
        ),
        |(at, writes, hits)| {
            let key = &keys[at];
            command(port, &[b"DEL", key.as_bytes()]);
            for write in &writes {
                let mut args: Vec<&[u8]> = vec![&write[0], key.as_bytes()];
                args.extend(write[1..].iter().map(Vec::as_slice));
                command(port, &args);
            }
            let bad = RateLimitDescriptor {
                hits_addend: Some(UInt64Value { value: hits }),
                ..descriptor(&[(ALGORITHMS[at], "bad")])
            };
            let mut client = RateLimitServiceClient::new(channel.clone());
            runtime.block_on(async {
                let mut ask = request(DOMAIN, &[]);
                ask.descriptors.push(bad);
                match client
                    .should_rate_limit(ask)
                    .await
                    .map(tonic::Response::into_inner)
                {
                    Ok(answer) => {
                        prop_assert!(
                            [OK, OVER_LIMIT].contains(&answer.overall_code),
                            "{answer:?}"
                        );
                        prop_assert_eq!(answer.statuses.len(), 1);
                    }
                    Err(status) => {
                        prop_assert_eq!(status.code(), Code::Unavailable, "{:?}", status);
                        prop_assert!(
                            status.message().contains(key.as_str()),
                            "{status:?} does not name {key}"
                        );
                    }
                }
                // Asked with 0 hits, it is never full, whatever the number of cases.
                let mut healthy = request(DOMAIN, &[&[(ALGORITHMS[at], "healthy")]]);
                healthy.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
                let answer = client
                    .should_rate_limit(healthy)
                    .await
                    .map_err(|s| TestCaseError::fail(format!("a healthy key: {s:?}")))?
                    .into_inner();
                prop_assert_eq!(answer.overall_code, OK, "a healthy key: {:?}", answer);
                prop_assert!(answer.statuses[0].current_limit.is_some());
                Ok(())
            })
        },
    );
    let metrics = scrape(sluice.http);
    assert_eq!(metrics.value("sluice_store_breakers_open", &[]), 0.0);
    assert_eq!(metrics.value("sluice_store_reachable", &[]), 1.0);
    assert!(sluice.alive(), "sluice still runs:\n{}", sluice.log_text());
}
