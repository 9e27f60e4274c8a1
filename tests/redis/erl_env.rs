//! sluice run as `ratelimit` under envoyproxy/ratelimit's environment: the mapping of every
//! variable to `serve` flags (Envoy Gateway's exact environment included), and the binary run
//! through a link named `ratelimit` with nothing but such an environment, on a real
//! redis-server: its ports, endpoints, health, counting, TLS and unhonoured variables.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::UInt64Value;
use sluice::settings::erl::{Translation, translate};
use support::ratelimit::{ENVOY_GATEWAY, PATIENCE, Ratelimit};
use support::{MINUTE, OK, OVER_LIMIT, free_port, http, in_one_window, openssl, request};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;

fn translated(pairs: &[(&str, &str)]) -> Result<Translation, String> {
    let env = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    };
    translate(&env)
}

/// `serve` and the flags the environment `pairs` becomes.
fn args(pairs: &[(&str, &str)]) -> Vec<String> {
    strings(translated(pairs).expect("a valid environment").args)
}

fn strings(args: Vec<OsString>) -> Vec<String> {
    args.into_iter().map(|a| a.into_string().unwrap()).collect()
}

/// The variables of `pairs` that sluice names as unhonoured, in its order.
fn unhonoured(pairs: &[(&str, &str)]) -> Vec<&'static str> {
    let translation = translated(pairs).expect("a valid environment");
    translation.unhonoured.iter().map(|u| u.name).collect()
}

/// The value `args` give `flag` (as `flag=value`), if any.
fn value(pairs: &[(&str, &str)], flag: &str) -> Option<String> {
    args(pairs)
        .iter()
        .find_map(|a| a.strip_prefix(flag)?.strip_prefix('=').map(str::to_owned))
}

fn split(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

/// Envoy Gateway's tracing variables, set when its rate limit telemetry names a tracing provider.
const ENVOY_GATEWAY_TRACING: &[(&str, &str)] = &[
    ("TRACING_ENABLED", "true"),
    ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
    ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
    (
        "TRACING_SERVICE_INSTANCE_ID",
        "envoy-ratelimit-5d8f7c9b6-x2x7q",
    ),
    ("TRACING_SAMPLING_RATE", "1.0"),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "http://otel-collector.monitoring:4318",
    ),
];

#[test]
fn envoy_gateways_environment_becomes_these_serve_flags() {
    let t = translated(ENVOY_GATEWAY).unwrap();
    assert_eq!(
        strings(t.args),
        split(
            "serve --http-addr=0.0.0.0:8080 --grpc-addr=0.0.0.0:8081 --debug-addr=0.0.0.0:6070 \
             --xds-server=envoy-gateway:18001 --xds-node-id=envoy-ratelimit \
             --xds-tls-ca=/certs/ca.crt --xds-tls-cert=/certs/tls.crt --xds-tls-key=/certs/tls.key \
             --counting=always --local-cache-size=0 \
             --redis-url=redis://redis.redis-system.svc.cluster.local:6379 \
             --tls-cert=/certs/tls.crt --tls-key=/certs/tls.key \
             --grpc-max-connection-age=24h --grpc-max-connection-age-grace=1h \
             --healthcheck-without-rules \
             --metrics-addr=0.0.0.0:19001 --metrics-path=/metrics \
             --prometheus-mapper=/etc/statsd-exporter/conf.yaml \
             --log-level=info --log-format=text"
        )
    );
    assert_eq!(
        t.unhonoured,
        [],
        "nothing Envoy Gateway sets goes unhonoured"
    );
    assert_eq!(t.notes, Vec::<String>::new());
}

#[test]
fn envoy_gateways_tracing_variables_become_tracing_flags() {
    let env: Vec<_> = ENVOY_GATEWAY
        .iter()
        .chain(ENVOY_GATEWAY_TRACING)
        .copied()
        .collect();
    let t = translated(&env).unwrap();
    assert_eq!(t.unhonoured, [], "every tracing variable is honoured");
    let args = strings(t.args);
    for expected in [
        "--tracing=http",
        "--tracing-service-name=envoy-ratelimit",
        "--tracing-service-namespace=envoy-gateway-system",
        "--tracing-service-instance-id=envoy-ratelimit-5d8f7c9b6-x2x7q",
        "--tracing-sampling-rate=1",
    ] {
        assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
    }
    // The exporter reads OTEL_EXPORTER_OTLP_ENDPOINT itself, as that project's does.
    assert!(
        !args.iter().any(|a| a.starts_with("--tracing-endpoint")),
        "{args:?}"
    );

    let mut env = ENVOY_GATEWAY.to_vec();
    env.extend([
        ("TRACING_ENABLED", "true"),
        ("TRACING_EXPORTER_PROTOCOL", "grpc"),
        ("TRACING_SAMPLING_RATE", "2.5"),
    ]);
    assert_eq!(value(&env, "--tracing").as_deref(), Some("grpc"));
    assert_eq!(
        value(&env, "--tracing-service-name").as_deref(),
        Some("RateLimit")
    );
    assert_eq!(
        value(&env, "--tracing-sampling-rate").as_deref(),
        Some("1"),
        "past 1: all"
    );

    env.push(("TRACING_EXPORTER_PROTOCOL", "udp"));
    let env: Vec<_> = env
        .into_iter()
        .filter(|(k, v)| *k != "TRACING_EXPORTER_PROTOCOL" || *v == "udp")
        .collect();
    assert_eq!(
        translated(&env).unwrap_err(),
        "TRACING_EXPORTER_PROTOCOL=udp: not http or grpc"
    );
}

#[test]
fn envoy_gateways_redis_tls_becomes_a_rediss_url_with_the_client_certificate() {
    let mut env = ENVOY_GATEWAY.to_vec();
    env.extend([
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CLIENT_CERT", "/redis-certs/tls.crt"),
        ("REDIS_TLS_CLIENT_KEY", "/redis-certs/tls.key"),
    ]);
    assert_eq!(
        value(&env, "--redis-url").as_deref(),
        Some("rediss://redis.redis-system.svc.cluster.local:6379")
    );
    assert_eq!(
        value(&env, "--redis-cert").as_deref(),
        Some("/redis-certs/tls.crt")
    );
    assert_eq!(
        value(&env, "--redis-key").as_deref(),
        Some("/redis-certs/tls.key")
    );
    assert_eq!(value(&env, "--redis-ca"), None, "no CA: the system's");
}

#[test]
fn an_empty_environment_gets_envoyproxy_ratelimits_defaults_on_the_embedded_store() {
    let t = translated(&[]).unwrap();
    assert_eq!(
        strings(t.args),
        split(
            "serve --http-addr=0.0.0.0:8080 --grpc-addr=0.0.0.0:8081 --debug-addr=0.0.0.0:6070 \
             --config=/srv/runtime_data/current/config --counting=always --local-cache-size=0 \
             --grpc-max-connection-age=24h --grpc-max-connection-age-grace=1h \
             --healthcheck-without-rules \
             --statsd-addr=localhost:8125 --statsd-flush-interval=10s \
             --log-level=warn --log-format=text"
        )
    );
    assert_eq!(t.notes.len(), 1);
    assert!(
        t.notes[0].starts_with("REDIS_URL is not set"),
        "{:?}",
        t.notes
    );
}

#[test]
fn file_config_is_read_from_root_subdirectory_and_app_directory() {
    let env = [
        ("RUNTIME_ROOT", "/srv/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_APPDIRECTORY", "rules"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "T"),
        ("MERGE_DOMAIN_CONFIG", "1"),
    ];
    assert_eq!(
        value(&env, "--config").as_deref(),
        Some("/srv/data/ratelimit/rules")
    );
    let args = args(&env);
    assert!(args.contains(&"--allow-empty-config".to_owned()));
    assert!(args.contains(&"--merge-domains".to_owned()));
    let under_xds = [("CONFIG_TYPE", "GRPC_XDS_SOTW"), ("RUNTIME_ROOT", "/data")];
    assert_eq!(
        value(&under_xds, "--config"),
        None,
        "RUNTIME_* are inert under xDS"
    );
    assert!(!self::args(&under_xds).contains(&"--allow-empty-config".to_owned()));
}

#[test]
fn xds_variables_become_the_xds_flags() {
    let env = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "cluster=eu,zone=a"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/ca.pem"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds.example"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "16777216"),
    ];
    assert_eq!(
        value(&env, "--xds-server").as_deref(),
        Some("localhost:18000")
    );
    assert_eq!(value(&env, "--xds-node-id").as_deref(), Some("default"));
    assert_eq!(
        value(&env, "--xds-node-metadata").as_deref(),
        Some("cluster=eu,zone=a")
    );
    assert_eq!(value(&env, "--xds-tls-ca").as_deref(), Some("/ca.pem"));
    assert_eq!(value(&env, "--xds-tls-cert"), None);
    assert_eq!(
        value(&env, "--xds-tls-server-name").as_deref(),
        Some("xds.example")
    );
    assert_eq!(
        value(&env, "--xds-max-message-bytes").as_deref(),
        Some("16777216")
    );
    let no_ca = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
    ];
    assert!(
        translated(&no_ca)
            .unwrap_err()
            .contains("CONFIG_GRPC_XDS_SERVER_TLS_CACERT")
    );
    let wrong = translated(&[("CONFIG_TYPE", "file")]).unwrap_err();
    assert!(wrong.starts_with("CONFIG_TYPE=file"), "{wrong}");
}

#[test]
fn stop_cache_key_increment_when_overlimit_chooses_the_counting() {
    assert_eq!(value(&[], "--counting").as_deref(), Some("always"));
    let stop = [("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "true")];
    assert_eq!(value(&stop, "--counting").as_deref(), Some("admitted"));
    let no = [("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "False")];
    assert_eq!(value(&no, "--counting").as_deref(), Some("always"));
}

#[test]
fn answering_variables_become_their_flags() {
    let env = [
        ("SHADOW_MODE", "true"),
        ("QUOTA_MODE", "t"),
        ("RESPONSE_DYNAMIC_METADATA", "TRUE"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "True"),
        ("LIMIT_LIMIT_HEADER", "X-RateLimit-Limit"),
        ("LIMIT_REMAINING_HEADER", "X-RateLimit-Remaining"),
        ("LIMIT_RESET_HEADER", "X-RateLimit-Reset"),
        ("NEAR_LIMIT_RATIO", "0.9"),
        ("LOCAL_CACHE_SIZE_IN_BYTES", "1048576"),
        ("LOG_LEVEL", "WARNING"),
        ("LOG_FORMAT", "JSON"),
    ];
    let args = args(&env);
    for flag in [
        "--shadow-mode",
        "--quota-mode",
        "--response-dynamic-metadata",
        "--limit-response-headers",
    ] {
        assert!(args.contains(&flag.to_owned()), "{flag} in {args:?}");
    }
    assert_eq!(
        value(&env, "--limit-limit-header").as_deref(),
        Some("X-RateLimit-Limit")
    );
    assert_eq!(
        value(&env, "--limit-remaining-header").as_deref(),
        Some("X-RateLimit-Remaining")
    );
    assert_eq!(
        value(&env, "--limit-reset-header").as_deref(),
        Some("X-RateLimit-Reset")
    );
    assert_eq!(value(&env, "--near-limit-ratio").as_deref(), Some("0.9"));
    assert_eq!(value(&env, "--local-cache-size").as_deref(), Some("10486"));
    assert_eq!(value(&env, "--log-level").as_deref(), Some("warn"));
    assert_eq!(value(&env, "--log-format").as_deref(), Some("json"));
    assert_eq!(
        value(&[("LOG_LEVEL", "Fatal")], "--log-level").as_deref(),
        Some("error")
    );
    assert!(
        translated(&[("LOG_LEVEL", "loud")])
            .unwrap_err()
            .starts_with("LOG_LEVEL=loud")
    );
    assert_eq!(
        translated(&[("SHADOW_MODE", "yes")]).unwrap_err(),
        "SHADOW_MODE=yes: not a boolean (true or false)"
    );
}

#[test]
fn addresses_join_host_and_port() {
    let env = [
        ("HOST", "127.0.0.1"),
        ("PORT", "9080"),
        ("GRPC_HOST", "::1"),
        ("GRPC_PORT", "9081"),
        ("DEBUG_PORT", "9070"),
    ];
    assert_eq!(
        value(&env, "--http-addr").as_deref(),
        Some("127.0.0.1:9080")
    );
    assert_eq!(value(&env, "--grpc-addr").as_deref(), Some("[::1]:9081"));
    assert_eq!(value(&env, "--debug-addr").as_deref(), Some("0.0.0.0:9070"));
    assert!(
        translated(&[("PORT", "80800")])
            .unwrap_err()
            .starts_with("PORT=80800")
    );
}

#[test]
fn redis_variables_become_one_url_in_sluices_forms() {
    let tcp = ("REDIS_SOCKET_TYPE", "tcp");
    let single = [tcp, ("REDIS_URL", "r:6379"), ("REDIS_AUTH", "s3cr@t")];
    assert_eq!(
        value(&single, "--redis-url").as_deref(),
        Some("redis://:s3cr%40t@r:6379")
    );
    let user = [tcp, ("REDIS_URL", "r:6379"), ("REDIS_AUTH", "app:p/w:x")];
    assert_eq!(
        value(&user, "--redis-url").as_deref(),
        Some("redis://app:p%2Fw%3Ax@r:6379"),
        "REDIS_AUTH splits at its first colon"
    );
    let cluster = [
        tcp,
        ("REDIS_TYPE", "CLUSTER"),
        ("REDIS_URL", "a:7000,b:7001,c:7002"),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CACERT", "/ca.pem"),
    ];
    assert_eq!(
        value(&cluster, "--redis-url").as_deref(),
        Some("rediss-cluster://a:7000?node=b%3A7001&node=c%3A7002")
    );
    assert_eq!(value(&cluster, "--redis-ca").as_deref(), Some("/ca.pem"));
    let sentinel = [
        tcp,
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
        ("REDIS_AUTH", "pw"),
        ("REDIS_SENTINEL_AUTH", "watcher:spw+"),
    ];
    assert_eq!(
        value(&sentinel, "--redis-url").as_deref(),
        Some(
            "redis-sentinel://:pw@s1:26379?sentinelServiceName=mymaster&node=s2%3A26379\
             &sentinelUsername=watcher&sentinelPassword=spw%2B"
        )
    );
    let timeout = [tcp, ("REDIS_URL", "r:6379"), ("REDIS_TIMEOUT", "500ms")];
    assert_eq!(value(&timeout, "--store-timeout").as_deref(), Some("500ms"));
    let prefixed = [tcp, ("REDIS_URL", "r:6379"), ("CACHE_KEY_PREFIX", "eg:rl:")];
    assert_eq!(
        value(&prefixed, "--redis-key-prefix").as_deref(),
        Some("eg:rl:")
    );
    assert_eq!(
        value(&[tcp, ("REDIS_URL", "r:6379")], "--redis-key-prefix"),
        None,
        "unset, sluice's own prefix"
    );
}

#[test]
fn stores_sluice_cannot_reach_are_refused_at_start() {
    let unix = translated(&[("REDIS_URL", "/var/run/nutcracker/ratelimit.sock")]).unwrap_err();
    assert!(unix.starts_with("REDIS_SOCKET_TYPE=unix"), "{unix}");
    let memcache = translated(&[("BACKEND_TYPE", "memcache")]).unwrap_err();
    assert!(memcache.starts_with("BACKEND_TYPE=memcache"), "{memcache}");
    let kind = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "r:6379"),
        ("REDIS_TYPE", "ring"),
    ];
    assert!(
        translated(&kind)
            .unwrap_err()
            .starts_with("REDIS_TYPE=ring")
    );
    let lone = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", "s1:26379"),
    ];
    assert!(
        translated(&lone)
            .unwrap_err()
            .starts_with("REDIS_URL=s1:26379")
    );
}

#[test]
fn grpc_tls_variables_become_the_tls_flags_and_eg_ca_cert_is_ignored() {
    let env = [
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/c.pem"),
        ("GRPC_SERVER_TLS_KEY", "/k.pem"),
        ("GRPC_SERVER_TLS_CA_CERT", "/eg-ca.pem"),
    ];
    assert_eq!(value(&env, "--tls-cert").as_deref(), Some("/c.pem"));
    assert_eq!(value(&env, "--tls-key").as_deref(), Some("/k.pem"));
    assert_eq!(value(&env, "--tls-client-ca"), None);
    let mtls = [
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/c.pem"),
        ("GRPC_SERVER_TLS_KEY", "/k.pem"),
        ("GRPC_CLIENT_TLS_CACERT", "/clients.pem"),
    ];
    assert_eq!(
        value(&mtls, "--tls-client-ca").as_deref(),
        Some("/clients.pem")
    );
    let off = [
        ("GRPC_SERVER_TLS_CERT", "/c.pem"),
        ("GRPC_SERVER_TLS_KEY", "/k.pem"),
    ];
    assert_eq!(
        value(&off, "--tls-cert"),
        None,
        "only with GRPC_SERVER_USE_TLS"
    );
    let missing = translated(&[("GRPC_SERVER_USE_TLS", "true")]).unwrap_err();
    assert!(
        missing.starts_with("GRPC_SERVER_USE_TLS=true needs"),
        "{missing}"
    );
}

#[test]
fn health_variables_choose_what_healthcheck_requires() {
    assert!(args(&[]).contains(&"--healthcheck-without-rules".to_owned()));
    let config = [("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true")];
    assert!(!args(&config).contains(&"--healthcheck-without-rules".to_owned()));
    assert!(!args(&[]).contains(&"--healthcheck-follows-store".to_owned()));
    let active = [("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "true")];
    assert!(args(&active).contains(&"--healthcheck-follows-store".to_owned()));
}

#[test]
fn only_variables_set_to_what_would_matter_are_unhonoured() {
    let harmless = [
        ("USE_STATSD", "false"),
        ("REDIS_POOL_SIZE", "10"),
        ("EXPIRATION_JITTER_MAX_SECONDS", "300"),
        ("TRACING_SERVICE_NAME", "x"),
        ("GRPC_CLIENT_TLS_SAN", "client"),
    ];
    assert_eq!(unhonoured(&harmless), Vec::<&str>::new());
    let mattering = [
        ("USE_STATSD", "true"),
        ("STATSD_PROTOCOL", "tcp"),
        ("REDIS_POOL_SIZE", "20"),
        ("GRPC_UDS", "/tmp/rl.sock"),
        ("REDIS_PERSECOND", "true"),
    ];
    assert_eq!(
        unhonoured(&mattering),
        [
            "GRPC_UDS",
            "STATSD_PROTOCOL",
            "REDIS_POOL_SIZE",
            "REDIS_PERSECOND"
        ]
    );
}

/// statsd is on by default, as in envoyproxy/ratelimit, to localhost:8125 every 10 s; off with
/// `USE_STATSD=false`, `DISABLE_STATS`, or `USE_PROMETHEUS` with `USE_STATSD` unset (a pair that
/// project refuses to start with); `EXTRA_TAGS` and `USE_DOG_STATSD` carried over.
#[test]
fn statsd_variables_become_the_statsd_flags() {
    let statsd = |env: &[(&str, &str)]| -> Vec<String> {
        args(env)
            .into_iter()
            .filter(|a| a.starts_with("--statsd"))
            .collect()
    };
    assert_eq!(
        statsd(&[]),
        [
            "--statsd-addr=localhost:8125",
            "--statsd-flush-interval=10s"
        ]
    );
    assert_eq!(
        statsd(&[
            ("USE_DOG_STATSD", "true"),
            ("USE_STATSD", "false"),
            ("STATSD_HOST", "::1"),
            ("STATSD_PORT", "9125"),
            ("STATS_FLUSH_INTERVAL", "500ms"),
            ("EXTRA_TAGS", "zone:eu,app:rl"),
        ]),
        [
            "--statsd-addr=[::1]:9125",
            "--statsd-flush-interval=500ms",
            "--statsd-tags=zone:eu,app:rl",
            "--statsd-dogstatsd"
        ]
    );
    for off in [
        &[("USE_STATSD", "false")][..],
        &[("DISABLE_STATS", "true")],
        &[("USE_PROMETHEUS", "true")],
    ] {
        assert_eq!(statsd(off), Vec::<String>::new(), "{off:?}");
    }
}

/// envoyproxy/ratelimit's opt-in to drop a connection that answers READONLY (a primary demoted
/// behind a fixed address) is what sluice always does: accepted without a word, whatever its
/// value, and refused at start when it is not a boolean, as there.
#[test]
fn redis_close_connection_on_readonly_error_is_accepted_as_what_sluice_always_does() {
    let redis = [("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "r:6379")];
    for value in ["true", "false"] {
        let mut env = redis.to_vec();
        env.push(("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", value));
        let translation = translated(&env).expect("a valid environment");
        assert_eq!(translation.unhonoured, [], "{value}");
        assert_eq!(translation.args, translated(&redis).unwrap().args);
    }
    let mut env = redis.to_vec();
    env.push(("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", "maybe"));
    let refused = translated(&env).unwrap_err();
    assert!(
        refused.starts_with("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR=maybe"),
        "{refused}"
    );
}

#[test]
fn runtime_directories_are_joined_as_gos_filepath_join_joins_them() {
    let config = |root: &str, sub: &str, app: &str| {
        let env = [
            ("RUNTIME_ROOT", root),
            ("RUNTIME_SUBDIRECTORY", sub),
            ("RUNTIME_APPDIRECTORY", app),
        ];
        value(&env, "--config").unwrap()
    };
    // An absolute part does not restart the path.
    assert_eq!(
        config("/srv/data", "/sub", "config"),
        "/srv/data/sub/config"
    );
    assert_eq!(
        config("/srv/data/", "sub/", "/rules/"),
        "/srv/data/sub/rules"
    );
    assert_eq!(
        config("/srv/data", "./a/../b", "config"),
        "/srv/data/b/config"
    );
    assert_eq!(config("/srv", "../..", "config"), "/config");
    assert_eq!(config("data", "../..", "config"), "../config");
}

#[test]
fn connection_age_variables_become_the_connection_age_flags_with_their_defaults() {
    assert_eq!(
        value(&[], "--grpc-max-connection-age").as_deref(),
        Some("24h")
    );
    assert_eq!(
        value(&[], "--grpc-max-connection-age-grace").as_deref(),
        Some("1h")
    );
    // Go's durations: fractions and several units.
    let env = [
        ("GRPC_MAX_CONNECTION_AGE", "1.5h"),
        ("GRPC_MAX_CONNECTION_AGE_GRACE", "1m30s"),
    ];
    assert_eq!(
        value(&env, "--grpc-max-connection-age").as_deref(),
        Some("90m")
    );
    assert_eq!(
        value(&env, "--grpc-max-connection-age-grace").as_deref(),
        Some("90s")
    );
    // 0 is gRPC's "none": no maximum age, or no forced close after it.
    let no_age = [("GRPC_MAX_CONNECTION_AGE", "0")];
    assert_eq!(value(&no_age, "--grpc-max-connection-age"), None);
    assert_eq!(value(&no_age, "--grpc-max-connection-age-grace"), None);
    let no_grace = [("GRPC_MAX_CONNECTION_AGE_GRACE", "0s")];
    assert_eq!(value(&no_grace, "--grpc-max-connection-age-grace"), None);
    assert_eq!(
        translated(&[("GRPC_MAX_CONNECTION_AGE", "10 minutes")]).unwrap_err(),
        "GRPC_MAX_CONNECTION_AGE=10 minutes: not a duration (such as 300ms, 30s or 1h30m)"
    );
    assert_eq!(
        translated(&[("GRPC_MAX_CONNECTION_AGE_GRACE", "-1s")]).unwrap_err(),
        "GRPC_MAX_CONNECTION_AGE_GRACE=-1s: must not be negative"
    );
    assert_eq!(unhonoured(&env), Vec::<&str>::new(), "both are honoured");
}

#[test]
fn a_value_starting_with_a_dash_reaches_its_flag_as_its_value() {
    let args = args(&[("NEAR_LIMIT_RATIO", "-1")]);
    assert!(
        args.contains(&"--near-limit-ratio=-1".to_owned()),
        "{args:?}"
    );
}

// ---- the binary, run as `ratelimit` ----

/// A rule file in envoyproxy/ratelimit's format.
const RULES: &str = "\
domain: erl
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: path
    value: /login
    shadow_mode: true
    rate_limit:
      unit: hour
      requests_per_unit: 10
";

/// An ERL environment on the shared redis-server, keys under a prefix of this run's `test`.
fn on_redis(test: &str) -> Vec<(&'static str, String)> {
    let redis = support::redis::standalone();
    vec![
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.ports[0])),
        ("CACHE_KEY_PREFIX", prefix(test)),
        ("LOG_LEVEL", "info".to_owned()),
        // sluice's --store-timeout: a loaded test machine may take longer than its 10 ms.
        ("REDIS_TIMEOUT", "2s".to_owned()),
    ]
}

/// A key prefix no other test or run shares.
fn prefix(test: &str) -> String {
    format!(
        "erl-env-{test}-{}-{}:",
        std::process::id(),
        support::unix_ms()
    )
}

fn pairs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test]
async fn as_ratelimit_grpc_decides_on_redis_counting_as_envoyproxy_ratelimit() {
    in_one_window(MINUTE, async || {
        let env = on_redis("counting");
        let (_ratelimit, channel) = Ratelimit::serving(RULES, &pairs(&env)).await;
        let mut client = RateLimitServiceClient::new(channel);
        let mut ask = async |r| support::decide(&mut client, r).await.overall_code;
        let alice = || request("erl", &[&[("user", "alice")]]);
        assert_eq!(ask(alice()).await, OK);
        assert_eq!(ask(alice()).await, OK);
        let mut check_only = alice();
        check_only.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
        assert_eq!(
            ask(check_only.clone()).await,
            OK,
            "a check at the limit is OK: over only when the count is above it"
        );
        assert_eq!(ask(alice()).await, OVER_LIMIT);
        assert_eq!(ask(check_only).await, OVER_LIMIT);
        let port = support::redis::standalone().ports[0];
        let prefix = &env[2].1;
        let keys = support::redis::cli(port, &["KEYS", &format!("{prefix}*")]);
        assert_eq!(keys.lines().count(), 1, "one counter in Redis: {keys}");
    })
    .await;
}

#[tokio::test]
async fn as_ratelimit_http_serves_healthcheck_and_json_and_debug_serves_rlconfig() {
    let env = on_redis("http");
    let rl = Ratelimit::start(RULES, &pairs(&env));
    assert!(
        rl.wait_serving(|| Channel::from_shared(format!("http://{}", rl.grpc))
            .unwrap()
            .connect_lazy())
            .await
    );
    let (http, debug) = (rl.http, rl.debug);
    let (health, json, rlconfig, index) = tokio::task::spawn_blocking(move || {
        (
            http_get(http, "/healthcheck"),
            support::http(
                http,
                "POST",
                "/json",
                r#"{"domain":"erl","descriptors":[{"entries":[{"key":"path","value":"/login"}]}]}"#,
            ),
            http_get(debug, "/rlconfig"),
            http_get(debug, "/"),
        )
    })
    .await
    .unwrap();
    assert_eq!((health.0, health.2.as_str()), (200, "OK"));
    assert_eq!(json.0, 200, "{}\n{}", json.2, rl.log_text());
    assert!(json.2.contains(r#""overallCode":"OK""#), "{}", json.2);
    let mut lines: Vec<_> = rlconfig.2.lines().collect();
    lines.sort();
    // What envoyproxy/ratelimit's Dump prints for these rules (in its map order).
    assert_eq!(
        lines,
        [
            "erl.path_/login: unit=HOUR requests_per_unit=10, shadow_mode: true, quota_mode: false",
            "erl.user: unit=MINUTE requests_per_unit=2, shadow_mode: false, quota_mode: false",
        ]
    );
    assert_eq!(
        index.2,
        "/rlconfig: print out the currently loaded configuration for debugging\n"
    );
}

fn http_get(addr: SocketAddr, path: &str) -> (u16, Vec<(String, String)>, String) {
    http(addr, "GET", path, "")
}

#[tokio::test]
async fn as_ratelimit_grpc_health_reports_serving_for_service_ratelimit() {
    let env = on_redis("health");
    let (_ratelimit, channel) = Ratelimit::serving(RULES, &pairs(&env)).await;
    for service in [
        "ratelimit",
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        assert_eq!(
            Ratelimit::health(channel.clone(), service).await,
            Some(ServingStatus::Serving),
            "{service:?}"
        );
    }
}

#[tokio::test]
async fn as_ratelimit_unhonoured_variables_are_logged_once_by_name() {
    let mut env = on_redis("log");
    env.extend([
        ("USE_STATSD", "false".to_owned()),
        (
            "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
            "true".to_owned(),
        ),
        ("REDIS_POOL_SIZE", "64".to_owned()),
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt".to_owned()),
    ]);
    let (rl, _channel) = Ratelimit::serving(RULES, &pairs(&env)).await;
    let log = rl.log_text();
    assert_eq!(
        log.matches("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches("REDIS_POOL_SIZE").count(), 1, "{log}");
    assert!(!log.contains("USE_STATSD"), "{log}");
    assert!(!log.contains("GRPC_SERVER_TLS_CA_CERT"), "{log}");
}

#[tokio::test]
async fn as_ratelimit_healthcheck_answers_at_once_while_redis_is_unreachable() {
    let closed = free_port().to_string();
    let env = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", &format!("127.0.0.1:{closed}")),
    ];
    let rl = Ratelimit::start(RULES, &env);
    let http = rl.http;
    let (status, took) = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        (http_get(http, "/healthcheck").0, started.elapsed())
    })
    .await
    .unwrap();
    assert_eq!(status, 500, "Redis never reached: unhealthy");
    assert!(took < Duration::from_millis(1500), "answered in {took:?}");
}

#[tokio::test]
async fn as_ratelimit_grpc_server_use_tls_serves_tls_with_an_rsa_private_key() {
    let certs = tempfile::tempdir().unwrap();
    let (key, cert) = (certs.path().join("tls.key"), certs.path().join("tls.crt"));
    let text = |p: &Path| p.to_str().unwrap().to_owned();
    openssl(&["genrsa", "-traditional", "-out", &text(&key), "2048"]);
    let pem = std::fs::read_to_string(&key).unwrap();
    assert!(pem.starts_with("-----BEGIN RSA PRIVATE KEY-----"), "PKCS#1");
    openssl(&[
        "req",
        "-x509",
        "-new",
        "-key",
        &text(&key),
        "-out",
        &text(&cert),
        "-days",
        "2",
        "-subj",
        "/CN=localhost",
        "-addext",
        "subjectAltName=DNS:localhost",
        "-addext",
        "basicConstraints=critical,CA:FALSE",
    ]);
    let mut env = on_redis("tls");
    env.extend([
        ("GRPC_SERVER_USE_TLS", "true".to_owned()),
        ("GRPC_SERVER_TLS_CERT", text(&cert)),
        ("GRPC_SERVER_TLS_KEY", text(&key)),
        ("GRPC_SERVER_TLS_CA_CERT", text(&cert)),
    ]);
    let rl = Ratelimit::start(RULES, &pairs(&env));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&cert).unwrap()))
        .domain_name("localhost");
    let endpoint = Endpoint::from_shared(format!("https://{}", rl.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(PATIENCE);
    let channel = tokio::time::timeout(PATIENCE, endpoint.connect())
        .await
        .expect("connects in time")
        .expect("a TLS connection, with no client certificate");
    assert!(
        rl.wait_serving(|| channel.clone()).await,
        "{}",
        rl.log_text()
    );
    let plaintext = Channel::from_shared(format!("http://{}", rl.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    assert_eq!(
        Ratelimit::health(plaintext, "ratelimit").await,
        None,
        "plaintext is refused"
    );
}

#[tokio::test]
async fn as_ratelimit_serves_as_uid_65534_without_home_or_working_directory() {
    let (rl, channel) = Ratelimit::serving_as(
        RULES,
        &[("HOME", "/nonexistent"), ("TMPDIR", "/nonexistent")],
        Some(&["--reuid", "65534", "--regid", "65534", "--clear-groups"]),
    )
    .await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", rl.pid())).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid.split_whitespace().skip(1).all(|u| u == "65534"),
        "{uid}"
    );
    let mut client = RateLimitServiceClient::new(channel);
    let answer = client
        .should_rate_limit(request("erl", &[&[("user", "bob")]]))
        .await
        .expect("ShouldRateLimit succeeds");
    assert_eq!(answer.into_inner().overall_code, OK);
}

#[test]
fn as_ratelimit_a_value_sluice_refuses_is_an_error_naming_its_variable() {
    let (status, stderr) = Ratelimit::refusal(RULES, &[("NEAR_LIMIT_RATIO", "-1")]);
    assert!(!status.success());
    assert!(
        stderr.contains("NEAR_LIMIT_RATIO=-1: --near-limit-ratio: must be more than 0"),
        "{stderr}"
    );
    let (status, stderr) = Ratelimit::refusal(
        RULES,
        &[("USE_PROMETHEUS", "true"), ("PROMETHEUS_PATH", "metrics")],
    );
    assert!(!status.success());
    assert!(
        stderr.starts_with("ratelimit: PROMETHEUS_PATH=metrics: invalid value 'metrics'"),
        "{stderr}"
    );
}
