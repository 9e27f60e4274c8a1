//! envoyproxy/ratelimit's environment, read when sluice runs as `ratelimit` (Envoy Gateway runs
//! `/bin/ratelimit` with no arguments): each of that project's variables, with its meaning and
//! default, becomes the `sluice serve` flags that do the same, parsed by clap like typed ones.
//! What sluice cannot do is named, to be logged once at start; what it must not pretend to do
//! (Memcached, Redis over a Unix socket) is an error.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// Reads one environment variable: `None` when unset.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The name sluice answers to as envoyproxy/ratelimit's drop-in.
pub const COMMAND: &str = "ratelimit";

/// Bytes of `LOCAL_CACHE_SIZE_IN_BYTES` per entry of sluice's local over-limit cache: about what
/// one entry costs envoyproxy/ratelimit's cache (a 24-byte header, a key of some 60 bytes, its
/// expiry).
pub const LOCAL_CACHE_BYTES_PER_ENTRY: u64 = 100;

/// Whether a process started as `argv0` runs as `ratelimit` (a link named so, for instance).
pub fn runs_as_ratelimit(argv0: &OsString) -> bool {
    Path::new(argv0).file_name().is_some_and(|n| n == COMMAND)
}

/// What an envoyproxy/ratelimit environment makes of sluice.
#[derive(Debug, Default, PartialEq)]
pub struct Translation {
    /// `serve` and its flags, as a user would type them.
    pub args: Vec<OsString>,
    /// Variables set to something sluice cannot do: each to be logged once, by name.
    pub unhonoured: Vec<Unhonoured>,
    /// Choices made where the environment is silent, to be logged at start.
    pub notes: Vec<String>,
    /// The variable behind each flag given a variable's value.
    pub sources: Vec<Source>,
}

/// The variable that gave a flag its value, to be named in an error about that value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub flag: &'static str,
    pub name: &'static str,
    /// What the variable holds.
    pub value: String,
}

/// A variable sluice reads but cannot honour (its value is not kept: some hold credentials).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unhonoured {
    pub name: &'static str,
    /// What sluice does instead.
    pub instead: &'static str,
}

impl std::fmt::Display for Unhonoured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is set but not honoured: {}", self.name, self.instead)
    }
}

/// The `sluice serve` arguments equivalent to the envoyproxy/ratelimit environment `env`, or
/// why it cannot be served (a value that project would refuse too, or a store sluice lacks).
pub fn translate(env: Env<'_>) -> Result<Translation, String> {
    let vars = Vars(env);
    let mut out = Translation {
        args: vec!["serve".into()],
        ..Translation::default()
    };
    addresses(&vars, &mut out)?;
    rules(&vars, &mut out)?;
    answering(&vars, &mut out)?;
    store(&vars, &mut out)?;
    grpc_tls(&vars, &mut out)?;
    connection_age(&vars, &mut out)?;
    health(&vars, &mut out)?;
    metrics(&vars, &mut out)?;
    statsd(&vars, &mut out)?;
    tracing(&vars, &mut out)?;
    logs(&vars, &mut out)?;
    out.unhonoured = unhonoured(&vars)?;
    Ok(out)
}

/// The environment, read with envoyproxy/ratelimit's parsing; an empty value counts as unset.
struct Vars<'a>(Env<'a>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.is_empty())
    }

    fn or(&self, name: &str, default: &str) -> String {
        self.get(name).unwrap_or_else(|| default.to_owned())
    }

    /// A boolean as Go's `strconv.ParseBool` reads it.
    fn flag(&self, name: &str) -> Result<bool, String> {
        match self.get(name).as_deref() {
            None => Ok(false),
            Some("1" | "t" | "T" | "TRUE" | "true" | "True") => Ok(true),
            Some("0" | "f" | "F" | "FALSE" | "false" | "False") => Ok(false),
            Some(other) => Err(format!("{name}={other}: not a boolean (true or false)")),
        }
    }

    /// A duration as Go's `time.ParseDuration` reads it, with the text it was read from (the
    /// default's when unset): at least 0.
    fn duration(&self, name: &str, default: &str) -> Result<(Duration, String), String> {
        let text = self.or(name, default);
        match go_duration(&text) {
            Some(Ok(d)) => Ok((d, text)),
            Some(Err(())) => Err(format!("{name}={text}: must not be negative")),
            None => Err(format!(
                "{name}={text}: not a duration (such as 300ms, 30s or 1h30m)"
            )),
        }
    }

    fn number(&self, name: &str, default: u64) -> Result<u64, String> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| format!("{name}={v}: not a whole number")),
        }
    }
}

impl Translation {
    fn flag(&mut self, flag: &str) {
        self.args.push(flag.into());
    }

    /// `flag=value`, as one argument: a value can never be read as a flag (`-1`, `--x`).
    fn arg(&mut self, flag: &str, value: impl Into<OsString>) {
        let mut arg = OsString::from(flag);
        arg.push("=");
        arg.push(value.into());
        self.args.push(arg);
    }

    /// `flag` given what variable `name` holds.
    fn var(&mut self, flag: &'static str, name: &'static str, given: String) {
        self.arg(flag, &given);
        self.sources.push(Source {
            flag,
            name,
            value: given,
        });
    }

    /// `flag` given `value`, read from variable `name` holding `given`.
    fn var_as(&mut self, flag: &'static str, name: &'static str, given: String, value: &str) {
        self.arg(flag, value);
        self.sources.push(Source {
            flag,
            name,
            value: given,
        });
    }

    /// `message`, an error about a flag's value (clap's, naming `'--flag <VALUE>'`, or one
    /// starting `--flag:`), led by the variable that gave the flag its value, if one did:
    /// `NAME=value: message`.
    pub fn blame(&self, message: &str) -> String {
        let names = |source: &&Source| {
            message.match_indices(source.flag).any(|(at, flag)| {
                let after = message[at + flag.len()..].chars().next();
                !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
            })
        };
        match self.sources.iter().find(names) {
            Some(source) => format!("{}={}: {message}", source.name, source.value),
            None => message.to_owned(),
        }
    }
}

/// `HOST:PORT` (admin HTTP, with `/healthcheck` and `/json`), `GRPC_HOST:GRPC_PORT` and
/// `DEBUG_HOST:DEBUG_PORT` (`/rlconfig`).
fn addresses(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    for (flag, host, port, default_port) in [
        ("--http-addr", "HOST", "PORT", 8080),
        ("--grpc-addr", "GRPC_HOST", "GRPC_PORT", 8081),
        ("--debug-addr", "DEBUG_HOST", "DEBUG_PORT", 6070),
    ] {
        let at = vars.number(port, default_port)?;
        let at = u16::try_from(at).map_err(|_| format!("{port}={at}: not a port"))?;
        let addr =
            socket_addr(&vars.or(host, "0.0.0.0"), at).map_err(|e| format!("{host}: {e}"))?;
        out.arg(flag, addr.to_string());
    }
    Ok(())
}

/// `host` (an IP address, a name resolved now, or empty for every interface) and `port`.
fn socket_addr(host: &str, port: u16) -> Result<SocketAddr, String> {
    if host.is_empty() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host}: no address"))
}

/// `CONFIG_TYPE`: rule files under `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY`, or
/// xDS (then the `RUNTIME_*` variables are inert, as there).
fn rules(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    match vars.or("CONFIG_TYPE", "FILE").as_str() {
        "FILE" => {
            let dir = go_join(&[
                &vars.or("RUNTIME_ROOT", "/srv/runtime_data/current"),
                &vars.or("RUNTIME_SUBDIRECTORY", ""),
                &vars.or("RUNTIME_APPDIRECTORY", "config"),
            ]);
            out.arg("--config", dir);
            if vars.flag("FORCE_START_WITHOUT_INITIAL_CONFIG")? {
                out.flag("--allow-empty-config");
            }
        }
        "GRPC_XDS_SOTW" => xds(vars, out)?,
        other => {
            return Err(format!(
                "CONFIG_TYPE={other}: FILE or GRPC_XDS_SOTW (as envoyproxy/ratelimit takes it)"
            ));
        }
    }
    if vars.flag("MERGE_DOMAIN_CONFIG")? {
        out.flag("--merge-domains");
    }
    Ok(())
}

/// The rules from an xDS server (`CONFIG_GRPC_XDS_*`), over TLS when
/// `CONFIG_GRPC_XDS_SERVER_USE_TLS` says.
fn xds(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    out.var(
        "--xds-server",
        "CONFIG_GRPC_XDS_SERVER_URL",
        vars.or("CONFIG_GRPC_XDS_SERVER_URL", "localhost:18000"),
    );
    out.var(
        "--xds-node-id",
        "CONFIG_GRPC_XDS_NODE_ID",
        vars.or("CONFIG_GRPC_XDS_NODE_ID", "default"),
    );
    if let Some(metadata) = vars.get("CONFIG_GRPC_XDS_NODE_METADATA") {
        out.var(
            "--xds-node-metadata",
            "CONFIG_GRPC_XDS_NODE_METADATA",
            metadata,
        );
    }
    if vars.flag("CONFIG_GRPC_XDS_SERVER_USE_TLS")? {
        let ca = vars.get("CONFIG_GRPC_XDS_SERVER_TLS_CACERT").ok_or(
            "CONFIG_GRPC_XDS_SERVER_USE_TLS=true needs CONFIG_GRPC_XDS_SERVER_TLS_CACERT: the CA \
             of the xDS server's certificate",
        )?;
        out.var("--xds-tls-ca", "CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca);
        let cert = vars.get("CONFIG_GRPC_XDS_CLIENT_TLS_CERT");
        let key = vars.get("CONFIG_GRPC_XDS_CLIENT_TLS_KEY");
        if let (Some(cert), Some(key)) = (cert, key) {
            out.var("--xds-tls-cert", "CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert);
            out.var("--xds-tls-key", "CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key);
        }
        if let Some(san) = vars.get("CONFIG_GRPC_XDS_SERVER_TLS_SAN") {
            out.var(
                "--xds-tls-server-name",
                "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
                san,
            );
        }
    }
    let max = vars.number("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", 0)?;
    if max > 0 {
        out.var(
            "--xds-max-message-bytes",
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
            max.to_string(),
        );
    }
    Ok(())
}

/// How requests are answered and counted.
fn answering(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    for (var, flag) in [
        ("SHADOW_MODE", "--shadow-mode"),
        ("QUOTA_MODE", "--quota-mode"),
        ("RESPONSE_DYNAMIC_METADATA", "--response-dynamic-metadata"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "--limit-response-headers"),
    ] {
        if vars.flag(var)? {
            out.flag(flag);
        }
    }
    for (var, flag) in [
        ("LIMIT_LIMIT_HEADER", "--limit-limit-header"),
        ("LIMIT_REMAINING_HEADER", "--limit-remaining-header"),
        ("LIMIT_RESET_HEADER", "--limit-reset-header"),
    ] {
        if let Some(name) = vars.get(var) {
            out.var(flag, var, name);
        }
    }
    // Unset, envoyproxy/ratelimit charges every hit, denied or not (Envoy Gateway's request and
    // response costs depend on it); set, sluice's all-or-nothing is the closest it has.
    let counting = if vars.flag("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")? {
        "admitted"
    } else {
        "always"
    };
    out.arg("--counting", counting);
    if let Some(ratio) = vars.get("NEAR_LIMIT_RATIO") {
        ratio
            .parse::<f64>()
            .map_err(|_| format!("NEAR_LIMIT_RATIO={ratio}: not a number"))?;
        out.var("--near-limit-ratio", "NEAR_LIMIT_RATIO", ratio);
    }
    let bytes = vars.number("LOCAL_CACHE_SIZE_IN_BYTES", 0)?;
    let entries = bytes.div_ceil(LOCAL_CACHE_BYTES_PER_ENTRY);
    out.arg("--local-cache-size", entries.to_string());
    Ok(())
}

/// Where counters live: Redis (`BACKEND_TYPE=redis`, the default) as `REDIS_*` describes it, or,
/// without a `REDIS_URL`, the embedded store.
fn store(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    match vars.or("BACKEND_TYPE", "redis").as_str() {
        "redis" => {}
        "memcache" => {
            return Err(
                "BACKEND_TYPE=memcache: sluice keeps counters in Redis or in its \
                        embedded store, not in Memcached"
                    .into(),
            );
        }
        other => {
            return Err(format!(
                "BACKEND_TYPE={other}: redis (memcache is not supported)"
            ));
        }
    }
    // A connection that answers READONLY (a primary demoted behind a fixed address) is always
    // dropped and made again: the opt-in asks for what sluice does anyway.
    vars.flag("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR")?;
    let Some(url) = vars.get("REDIS_URL") else {
        out.notes.push(
            "REDIS_URL is not set: counters are kept in this process's embedded store, not \
             shared with other replicas"
                .into(),
        );
        return Ok(());
    };
    out.arg("--redis-url", redis_url(vars, &url)?);
    if let Some(prefix) = vars.get("CACHE_KEY_PREFIX") {
        out.var("--redis-key-prefix", "CACHE_KEY_PREFIX", prefix);
    }
    if vars.flag("REDIS_TLS")? {
        if let Some(ca) = vars.get("REDIS_TLS_CACERT") {
            out.var("--redis-ca", "REDIS_TLS_CACERT", ca);
        }
        let cert = vars.get("REDIS_TLS_CLIENT_CERT");
        let key = vars.get("REDIS_TLS_CLIENT_KEY");
        if let (Some(cert), Some(key)) = (cert, key) {
            out.var("--redis-cert", "REDIS_TLS_CLIENT_CERT", cert);
            out.var("--redis-key", "REDIS_TLS_CLIENT_KEY", key);
        }
    }
    if vars.get("REDIS_TIMEOUT").is_some() {
        let (timeout, given) = vars.duration("REDIS_TIMEOUT", "")?;
        out.var_as(
            "--store-timeout",
            "REDIS_TIMEOUT",
            given,
            &flag_duration(timeout),
        );
    }
    Ok(())
}

/// sluice's URL for envoyproxy/ratelimit's `REDIS_URL` (`host:port`; for a Cluster, a comma
/// list of nodes; for Sentinel, the primary's name then the sentinels), `REDIS_TYPE`,
/// `REDIS_TLS`, `REDIS_AUTH` (`password` or `user:password`) and `REDIS_SENTINEL_AUTH`.
fn redis_url(vars: &Vars, url: &str) -> Result<String, String> {
    match vars.or("REDIS_SOCKET_TYPE", "unix").as_str() {
        "tcp" | "tcp4" | "tcp6" => {}
        "unix" => {
            return Err(
                "REDIS_SOCKET_TYPE=unix (its default): sluice reaches Redis over TCP \
                        only; set REDIS_SOCKET_TYPE=tcp and REDIS_URL=host:port"
                    .into(),
            );
        }
        other => return Err(format!("REDIS_SOCKET_TYPE={other}: tcp")),
    }
    let tls = if vars.flag("REDIS_TLS")? { "s" } else { "" };
    let auth = match vars.get("REDIS_AUTH") {
        None => String::new(),
        Some(auth) => format!("{}@", userinfo(&auth)),
    };
    let nodes: Vec<&str> = url.split(',').map(str::trim).collect();
    let others = |nodes: &[&str]| -> String {
        nodes
            .iter()
            .map(|n| format!("node={}", encode(n)))
            .collect::<Vec<_>>()
            .join("&")
    };
    match vars
        .or("REDIS_TYPE", "SINGLE")
        .to_ascii_lowercase()
        .as_str()
    {
        "single" => Ok(format!("redis{tls}://{auth}{url}")),
        "cluster" => {
            let mut out = format!("redis{tls}-cluster://{auth}{}", nodes[0]);
            if nodes.len() > 1 {
                out.push('?');
                out.push_str(&others(&nodes[1..]));
            }
            Ok(out)
        }
        "sentinel" => {
            let [primary, first, rest @ ..] = nodes.as_slice() else {
                return Err(format!(
                    "REDIS_URL={url}: with REDIS_TYPE=sentinel, the primary's name and then the \
                     sentinels: <name>,<host:port>[,<host:port>…]"
                ));
            };
            let mut out = format!(
                "redis{tls}-sentinel://{auth}{first}?sentinelServiceName={}",
                encode(primary)
            );
            if !rest.is_empty() {
                out.push('&');
                out.push_str(&others(rest));
            }
            if let Some(sentinel_auth) = vars.get("REDIS_SENTINEL_AUTH") {
                match sentinel_auth.split_once(':') {
                    Some((user, password)) => out.push_str(&format!(
                        "&sentinelUsername={}&sentinelPassword={}",
                        encode(user),
                        encode(password)
                    )),
                    None => out.push_str(&format!("&sentinelPassword={}", encode(&sentinel_auth))),
                }
            }
            Ok(out)
        }
        _ => Err(format!(
            "REDIS_TYPE={}: single, sentinel or cluster",
            vars.or("REDIS_TYPE", "")
        )),
    }
}

/// `user:password` or `password` (as envoyproxy/ratelimit splits `REDIS_AUTH`), for a URL.
fn userinfo(auth: &str) -> String {
    match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}", encode(user), encode(password)),
        None => format!(":{}", encode(auth)),
    }
}

/// Percent-encodes every byte but RFC 3986's unreserved ones: safe in a URL's user, password
/// and query values.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// gRPC over TLS (`GRPC_SERVER_USE_TLS`), mTLS with `GRPC_CLIENT_TLS_CACERT`. Envoy Gateway's
/// `GRPC_SERVER_TLS_CA_CERT` is no variable of envoyproxy/ratelimit, which ignores it: so does
/// sluice, and requires no client certificate for it.
fn grpc_tls(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    if !vars.flag("GRPC_SERVER_USE_TLS")? {
        return Ok(());
    }
    let (Some(cert), Some(key)) = (
        vars.get("GRPC_SERVER_TLS_CERT"),
        vars.get("GRPC_SERVER_TLS_KEY"),
    ) else {
        return Err(
            "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY".into(),
        );
    };
    out.var("--tls-cert", "GRPC_SERVER_TLS_CERT", cert);
    out.var("--tls-key", "GRPC_SERVER_TLS_KEY", key);
    if let Some(ca) = vars.get("GRPC_CLIENT_TLS_CACERT") {
        out.var("--tls-client-ca", "GRPC_CLIENT_TLS_CACERT", ca);
    }
    Ok(())
}

/// gRPC keepalive's MaxConnectionAge (`GRPC_MAX_CONNECTION_AGE`, 24h there by default) and
/// MaxConnectionAgeGrace (`GRPC_MAX_CONNECTION_AGE_GRACE`, 1h), where 0 means none: no maximum
/// age, or no forced close after it.
fn connection_age(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    let (age, given) = vars.duration("GRPC_MAX_CONNECTION_AGE", "24h")?;
    let (grace, given_grace) = vars.duration("GRPC_MAX_CONNECTION_AGE_GRACE", "1h")?;
    if age.is_zero() {
        return Ok(());
    }
    out.var_as(
        "--grpc-max-connection-age",
        "GRPC_MAX_CONNECTION_AGE",
        given,
        &flag_duration(age),
    );
    if !grace.is_zero() {
        out.var_as(
            "--grpc-max-connection-age-grace",
            "GRPC_MAX_CONNECTION_AGE_GRACE",
            given_grace,
            &flag_duration(grace),
        );
    }
    Ok(())
}

/// envoyproxy/ratelimit's `/healthcheck` model: healthy without rules unless
/// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`; failing in a Redis outage only with
/// `REDIS_HEALTH_CHECK_ACTIVE_CONNECTION`.
fn health(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    if !vars.flag("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")? {
        out.flag("--healthcheck-without-rules");
    }
    if vars.flag("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION")? {
        out.flag("--healthcheck-follows-store");
    }
    Ok(())
}

/// Prometheus on a port of its own (`USE_PROMETHEUS`, `PROMETHEUS_ADDR`, `PROMETHEUS_PATH`),
/// named through `PROMETHEUS_MAPPER_YAML`; `DISABLE_STATS` switches every sink off first.
fn metrics(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    if vars.flag("DISABLE_STATS")? || !vars.flag("USE_PROMETHEUS")? {
        return Ok(());
    }
    let addr = vars.or("PROMETHEUS_ADDR", ":9090");
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| format!("PROMETHEUS_ADDR={addr}: host:port or :port"))?;
    let port = port
        .parse()
        .map_err(|_| format!("PROMETHEUS_ADDR={addr}: not a port"))?;
    let addr = socket_addr(host, port).map_err(|e| format!("PROMETHEUS_ADDR: {e}"))?;
    out.arg("--metrics-addr", addr.to_string());
    out.var(
        "--metrics-path",
        "PROMETHEUS_PATH",
        vars.or("PROMETHEUS_PATH", "/metrics"),
    );
    if let Some(mapper) = vars.get("PROMETHEUS_MAPPER_YAML") {
        out.var("--prometheus-mapper", "PROMETHEUS_MAPPER_YAML", mapper);
    }
    Ok(())
}

/// envoyproxy/ratelimit's statsd: `USE_STATSD` (on by default there; sluice takes it off when
/// unset and `USE_PROMETHEUS` asks for Prometheus instead, a pair that project refuses),
/// `USE_DOG_STATSD`, `STATSD_HOST`:`STATSD_PORT` (localhost:8125), `STATS_FLUSH_INTERVAL` (10s) and
/// `EXTRA_TAGS`; none with `DISABLE_STATS`.
fn statsd(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    if !statsd_on(vars)? {
        return Ok(());
    }
    let host = vars.or("STATSD_HOST", "localhost");
    let port = vars.number("STATSD_PORT", 8125)?;
    if port > u64::from(u16::MAX) {
        return Err(format!("STATSD_PORT={port}: not a port"));
    }
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    out.arg("--statsd-addr", format!("{host}:{port}"));
    let (every, text) = vars.duration("STATS_FLUSH_INTERVAL", "10s")?;
    out.var_as(
        "--statsd-flush-interval",
        "STATS_FLUSH_INTERVAL",
        text,
        &flag_duration(every),
    );
    if let Some(tags) = vars.get("EXTRA_TAGS") {
        out.var("--statsd-tags", "EXTRA_TAGS", tags);
    }
    if vars.flag("USE_DOG_STATSD")? {
        out.flag("--statsd-dogstatsd");
    }
    Ok(())
}

/// Whether the environment asks for statsd stats.
fn statsd_on(vars: &Vars) -> Result<bool, String> {
    if vars.flag("DISABLE_STATS")? {
        return Ok(false);
    }
    let plain = match vars.get("USE_STATSD") {
        Some(_) => vars.flag("USE_STATSD")?,
        None => !vars.flag("USE_PROMETHEUS")?,
    };
    Ok(plain || vars.flag("USE_DOG_STATSD")?)
}

/// `TRACING_ENABLED` and its settings: OTLP over `TRACING_EXPORTER_PROTOCOL` (http by default)
/// to where the `OTEL_EXPORTER_OTLP_*` variables say, which the exporter reads as that project's
/// does; service `RateLimit` by default; a sampling rate past 1 samples all, below 0 none.
fn tracing(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    if !vars.flag("TRACING_ENABLED")? {
        return Ok(());
    }
    let protocol = vars.or("TRACING_EXPORTER_PROTOCOL", "http");
    match protocol.as_str() {
        "http" | "grpc" => out.var_as(
            "--tracing",
            "TRACING_EXPORTER_PROTOCOL",
            protocol.clone(),
            &protocol,
        ),
        other => {
            return Err(format!(
                "TRACING_EXPORTER_PROTOCOL={other}: not http or grpc"
            ));
        }
    }
    match vars.get("TRACING_SERVICE_NAME") {
        Some(name) => out.var("--tracing-service-name", "TRACING_SERVICE_NAME", name),
        None => out.arg("--tracing-service-name", "RateLimit"),
    }
    for (flag, name) in [
        ("--tracing-service-namespace", "TRACING_SERVICE_NAMESPACE"),
        (
            "--tracing-service-instance-id",
            "TRACING_SERVICE_INSTANCE_ID",
        ),
    ] {
        if let Some(value) = vars.get(name) {
            out.var(flag, name, value);
        }
    }
    if let Some(rate) = vars.get("TRACING_SAMPLING_RATE") {
        let parsed: f64 = rate
            .trim()
            .parse()
            .map_err(|_| format!("TRACING_SAMPLING_RATE={rate}: not a number"))?;
        out.var_as(
            "--tracing-sampling-rate",
            "TRACING_SAMPLING_RATE",
            rate,
            &parsed.clamp(0.0, 1.0).to_string(),
        );
    }
    Ok(())
}

/// `LOG_LEVEL` (logrus' names, any case; `WARN` by default) and `LOG_FORMAT` (`json`, else text).
fn logs(vars: &Vars, out: &mut Translation) -> Result<(), String> {
    let level = vars.or("LOG_LEVEL", "WARN");
    let mapped = match level.to_ascii_lowercase().as_str() {
        "panic" | "fatal" | "error" => "error",
        "warn" | "warning" => "warn",
        "info" => "info",
        "debug" => "debug",
        "trace" => "trace",
        _ => {
            return Err(format!(
                "LOG_LEVEL={level}: one of trace, debug, info, warn, error, fatal, panic"
            ));
        }
    };
    out.arg("--log-level", mapped);
    let format = if vars.or("LOG_FORMAT", "text").eq_ignore_ascii_case("json") {
        "json"
    } else {
        "text"
    };
    out.arg("--log-format", format);
    Ok(())
}

/// Go's `filepath.Join`: the non-empty `parts` joined by `/` (an absolute part does not restart
/// the path, as Rust's `Path::join` would), cleaned lexically as Go's `filepath.Clean` does.
fn go_join(parts: &[&str]) -> String {
    let joined: Vec<&str> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    if joined.is_empty() {
        return String::new();
    }
    let path = joined.join("/");
    let rooted = path.starts_with('/');
    let mut kept: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." if kept.last().is_some_and(|last| *last != "..") => {
                kept.pop();
            }
            // `..` at the root stays at the root.
            ".." if rooted => {}
            part => kept.push(part),
        }
    }
    match (rooted, kept.join("/")) {
        (true, rest) => format!("/{rest}"),
        (false, rest) if rest.is_empty() => ".".to_owned(),
        (false, rest) => rest,
    }
}

/// A duration written as Go's `time.ParseDuration` reads it (`0`, `300ms`, `1.5h`, `1h30m`,
/// `2us`): `None` when it is not one, `Some(Err(()))` when it is negative.
fn go_duration(text: &str) -> Option<Result<Duration, ()>> {
    let (negative, mut rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest == "0" {
        return Some(Ok(Duration::ZERO));
    }
    if rest.is_empty() {
        return None;
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let units = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(units);
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
            return None;
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        let mut part = whole.checked_mul(scale)?;
        let mut unit_fraction = scale;
        for digit in fraction.bytes() {
            unit_fraction /= 10;
            part += u128::from(digit - b'0') * unit_fraction;
        }
        nanos = nanos.checked_add(part)?;
        rest = after;
    }
    if negative && nanos > 0 {
        return Some(Err(()));
    }
    let nanos = u64::try_from(nanos).ok()?;
    Some(Ok(Duration::from_nanos(nanos)))
}

/// `duration` as a `serve` flag takes it, in its largest whole unit.
fn flag_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    let units: [(u128, &str); 5] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
    ];
    for (size, unit) in units {
        if nanos.is_multiple_of(size) {
            return format!("{}{unit}", nanos / size);
        }
    }
    format!("{nanos}ns")
}

/// Variables sluice cannot honour, when set to something that would matter.
fn unhonoured(vars: &Vars) -> Result<Vec<Unhonoured>, String> {
    let on = |name| vars.flag(name);
    let set = |name: &str| vars.get(name).is_some();
    let statsd = statsd_on(vars)?;
    let per_second = on("REDIS_PERSECOND")?;
    let xds = vars.or("CONFIG_TYPE", "FILE") == "GRPC_XDS_SOTW";
    let differs = |name: &str, harmless: &[&str]| {
        vars.get(name)
            .is_some_and(|v| !harmless.contains(&v.as_str()))
    };
    let mut checks: Vec<(&'static str, bool, &'static str)> = vec![
        (
            "GRPC_UDS",
            set("GRPC_UDS"),
            "gRPC is served on GRPC_HOST:GRPC_PORT only",
        ),
        (
            "GRPC_CLIENT_TLS_SAN",
            on("GRPC_SERVER_USE_TLS")? && set("GRPC_CLIENT_TLS_SAN"),
            "any client certificate signed by GRPC_CLIENT_TLS_CACERT is accepted",
        ),
        (
            "STATSD_PROTOCOL",
            statsd && differs("STATSD_PROTOCOL", &["udp", "udp4", "udp6"]),
            "statsd stats are sent over UDP",
        ),
        (
            "EXTRA_TAGS",
            !statsd && set("EXTRA_TAGS"),
            "only statsd stats carry EXTRA_TAGS, and statsd is off",
        ),
        (
            "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
            on("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS")?,
            "response times are observed in seconds, scaled as the mapping says",
        ),
        (
            "EXPIRATION_JITTER_MAX_SECONDS",
            differs("EXPIRATION_JITTER_MAX_SECONDS", &["0", "300"]),
            "every key expires when its window can no longer matter, without jitter",
        ),
        (
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            on("REDIS_TLS")? && on("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")?,
            "Redis' certificate must hold the host name of REDIS_URL",
        ),
        (
            "REDIS_POOL_SIZE",
            differs("REDIS_POOL_SIZE", &["10"]),
            "one connection per event loop, concurrent requests sharing script calls",
        ),
        (
            "REDIS_POOL_ON_EMPTY_BEHAVIOR",
            differs("REDIS_POOL_ON_EMPTY_BEHAVIOR", &["WAIT"]),
            "requests queue, bounded, and are answered by --on-store-error past the bound",
        ),
        (
            "REDIS_PIPELINE_WINDOW",
            differs("REDIS_PIPELINE_WINDOW", &["0", "0s"]),
            "requests that arrive while a script call is in flight share the next one",
        ),
        (
            "REDIS_PIPELINE_LIMIT",
            differs("REDIS_PIPELINE_LIMIT", &["0"]),
            "requests that arrive while a script call is in flight share the next one",
        ),
        (
            "REDIS_CLUSTER_PIPELINE_PARALLELISM",
            differs("REDIS_CLUSTER_PIPELINE_PARALLELISM", &["1"]),
            "on a Cluster, a request calls every slot group at once",
        ),
        (
            "REDIS_PERSECOND",
            per_second,
            "one Redis (REDIS_URL) keeps every window, per-second ones included",
        ),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            xds && set("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS"),
            "the xDS stream carries no extra headers",
        ),
        (
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
            xds && set("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL"),
            "the xDS client reconnects with its own backoff",
        ),
    ];
    for name in [
        "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
        "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
        "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
        "XDS_CLIENT_BACKOFF_JITTER",
    ] {
        checks.push((
            name,
            xds && set(name),
            "the xDS client reconnects with its own backoff",
        ));
    }
    Ok(checks
        .into_iter()
        .filter(|(_, unhonoured, _)| *unhonoured)
        .map(|(name, _, instead)| Unhonoured { name, instead })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn translate_from(pairs: &[(&str, &str)]) -> Result<Translation, String> {
        let env = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        };
        translate(&env)
    }

    #[test]
    fn percent_encodes_all_but_unreserved_bytes() {
        assert_eq!(encode("a-Z_0.~"), "a-Z_0.~");
        assert_eq!(encode("p@ss:w/rd+ %"), "p%40ss%3Aw%2Frd%2B%20%25");
    }

    #[test]
    fn a_bad_boolean_is_an_error_naming_the_variable() {
        let error = translate_from(&[("SHADOW_MODE", "yes")]).unwrap_err();
        assert_eq!(error, "SHADOW_MODE=yes: not a boolean (true or false)");
    }

    #[test]
    fn only_a_link_named_ratelimit_runs_as_ratelimit() {
        assert!(runs_as_ratelimit(&"/bin/ratelimit".into()));
        assert!(runs_as_ratelimit(&"ratelimit".into()));
        assert!(!runs_as_ratelimit(&"/usr/bin/sluice".into()));
        assert!(!runs_as_ratelimit(&"/bin/ratelimit-old".into()));
    }
}
