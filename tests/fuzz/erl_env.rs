//! envoyproxy/ratelimit's environment, any value in any of its variables: sluice run as
//! `ratelimit` either gets `serve` flags that clap and `serve`'s checks accept, or an error that
//! names a variable set, as it does at start.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::IpAddr;
use std::time::Duration;

use clap::Parser;
use proptest::prelude::*;
use sluice::settings::erl::translate;
use sluice::settings::{Cli, Command};

use super::fuzz;

/// Every variable sluice reads as `ratelimit`, but the hosts, which are resolved when not an IP
/// address (and a test resolves no names).
const VARIABLES: &[&str] = &[
    "BACKEND_TYPE",
    "CACHE_KEY_PREFIX",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_TYPE",
    "DEBUG_PORT",
    "DISABLE_STATS",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "EXTRA_TAGS",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "GRPC_PORT",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_SERVER_USE_TLS",
    "GRPC_UDS",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "MERGE_DOMAIN_CONFIG",
    "NEAR_LIMIT_RATIO",
    "PORT",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_PATH",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "QUOTA_MODE",
    "REDIS_AUTH",
    "REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_PERSECOND",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_POOL_SIZE",
    "REDIS_SENTINEL_AUTH",
    "REDIS_SOCKET_TYPE",
    "REDIS_TIMEOUT",
    "REDIS_TLS",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_TYPE",
    "REDIS_URL",
    "RESPONSE_DYNAMIC_METADATA",
    "RUNTIME_APPDIRECTORY",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "SHADOW_MODE",
    "STATSD_HOST",
    "STATSD_PORT",
    "STATSD_PROTOCOL",
    "STATS_FLUSH_INTERVAL",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "TRACING_ENABLED",
    "TRACING_EXPORTER_PROTOCOL",
    "TRACING_SAMPLING_RATE",
    "TRACING_SERVICE_INSTANCE_ID",
    "TRACING_SERVICE_NAME",
    "TRACING_SERVICE_NAMESPACE",
    "USE_DOG_STATSD",
    "USE_PROMETHEUS",
    "USE_STATSD",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
];

/// The variables naming a host to listen on.
const HOSTS: &[&str] = &["HOST", "GRPC_HOST", "DEBUG_HOST"];

/// Values of the kinds the variables take (booleans, numbers, durations, addresses, URLs, paths),
/// at and past their bounds, and any text.
fn values() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "", "0", "1", "-1", "true", "false", "TRUE", "t", "yes", "0.8", "1.5", "-0.1", "NaN",
            "inf", "1e400", "65535", "65536", "4294967296", "18446744073709551616", "0s", "1ms",
            "30s", "1h30m", "-5s", "1.5h", "9999999999h", "h", "FILE", "GRPC_XDS_SOTW", "redis",
            "memcache", "SINGLE", "single", "cluster", "sentinel", "tcp", "unix", "127.0.0.1:6379",
            "localhost:6379", "a:1,b:2", "m,a:1", "redis://x", "/", "/tmp", "../x", "json", "text",
            "debug", "WARN", "grpc", "http", "k:v,k2:v2", "a=b", "=", ":", ",", "%", "@",
        ])
        .prop_map(str::to_owned),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<String>(),
    ]
}

/// Hosts that need no name resolved: IP addresses, bracketed or not, or nothing.
fn hosts() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        any::<IpAddr>().prop_map(|ip| ip.to_string()),
        any::<std::net::Ipv6Addr>().prop_map(|ip| format!("[{ip}]")),
    ]
}

fn environments() -> impl Strategy<Value = BTreeMap<String, String>> {
    (
        prop::collection::btree_map(
            prop::sample::select(VARIABLES).prop_map(str::to_owned),
            values(),
            0..12,
        ),
        prop::collection::btree_map(
            prop::sample::select(HOSTS).prop_map(str::to_owned),
            hosts(),
            0..3,
        ),
    )
        .prop_map(|(mut env, hosts)| {
            env.extend(hosts);
            env
        })
}

/// Whether `message` leads with a variable of `env` set to something, as `NAME=` or `NAME:`.
fn names_a_variable(env: &BTreeMap<String, String>, message: &str) -> bool {
    env.iter()
        .filter(|(_, value)| !value.is_empty())
        .any(|(name, _)| {
            message.contains(&format!("{name}=")) || message.contains(&format!("{name}:"))
        })
}

#[test]
fn any_environment_becomes_accepted_flags_or_an_error_naming_a_variable() {
    fuzz(
        "erl_env::any_environment",
        1_500,
        Duration::from_secs(8),
        environments(),
        |env| {
            let read = |name: &str| env.get(name).cloned();
            let translation = match translate(&read) {
                Ok(translation) => translation,
                Err(message) => {
                    prop_assert!(
                        names_a_variable(&env, &message),
                        "{message:?} names no variable set"
                    );
                    return Ok(());
                }
            };
            let argv = std::iter::once(OsString::from("ratelimit")).chain(translation.args.clone());
            let cli = match Cli::try_parse_from(argv) {
                Ok(cli) => cli,
                Err(e) => {
                    let rendered = e.to_string();
                    let first = rendered.lines().next().unwrap_or_default();
                    let blamed = translation.blame(first.trim_start_matches("error: "));
                    prop_assert!(
                        names_a_variable(&env, &blamed),
                        "clap: {blamed:?} names no variable set"
                    );
                    return Ok(());
                }
            };
            let Command::Serve(args) = cli.command else {
                return Err(TestCaseError::fail("not serve"));
            };
            if let Err(e) = args.check() {
                let blamed = translation.blame(&format!("{e:#}"));
                prop_assert!(
                    names_a_variable(&env, &blamed),
                    "check: {blamed:?} names no variable set"
                );
            }
            Ok(())
        },
    );
}
