//! The tests that need only the sluice binary, on its embedded store (no Redis, no Envoy), and the
//! checks that read the sources and docs: the fast inner loop, `cargo test --test embedded`,
//! seconds of tests on 2 cores. Those that take seconds each are `tests/embedded_slow`.

mod algorithm_tables;
mod check_config;
mod docs;
mod holds;
mod http;
mod invalid;
mod layers;
mod lifecycle;
mod load;
mod ui;
