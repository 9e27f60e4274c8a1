//! The tests that need only the sluice binary, on its embedded store (no Redis, no Envoy), and the
//! checks that read the sources and docs: the fast inner loop, `cargo test --test embedded`,
//! about a minute of tests on 2 cores.

#[path = "../common/mod.rs"]
mod common;

mod admin_auth;
mod algorithm_tables;
mod check_config;
mod docs;
mod erl_fixtures;
mod holds;
mod http;
mod invalid;
mod layers;
mod lifecycle;
mod listeners;
mod load;
mod rule_files_hostile;
mod top;
