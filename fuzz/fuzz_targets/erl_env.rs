//! Any envoyproxy/ratelimit environment: translated into `serve` flags, or refused naming a
//! variable. Run with `-dict=fuzz/erl_env.dict`, which holds the variables' names.
#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use sluice::settings::erl::translate;

/// Variables whose value, when not an IP address, is a name to resolve: left out, so that a
/// run makes no DNS queries.
const HOSTS: &[&str] = &["HOST", "GRPC_HOST", "DEBUG_HOST"];

fuzz_target!(|env: Vec<(String, String)>| {
    let resolves = |(name, value): &(String, String)| {
        HOSTS.contains(&name.as_str())
            && !value.is_empty()
            && value.trim_matches(['[', ']']).parse::<IpAddr>().is_err()
    };
    if env.iter().any(resolves) {
        return;
    }
    let read = |name: &str| {
        env.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    if let Err(message) = translate(&read) {
        assert!(
            env.iter()
                .any(|(name, value)| !value.is_empty() && message.contains(name.as_str())),
            "{message:?} names no variable set"
        );
    }
});
