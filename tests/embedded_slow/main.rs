//! The tests that need only the sluice binary, on its embedded store (no Redis, no Envoy; Python's
//! `prometheus_client` where they read `/metrics`), but take seconds each: timeouts, floods of
//! connections, large rule files, ten thousand clients, envoyproxy/ratelimit's fixtures, the admin
//! token, the console in a real browser (chromium through Selenium). `tests/embedded` holds the
//! fast ones. About a minute of tests on 2 cores.

mod admin_auth;
mod console;
mod erl_fixtures;
mod listeners;
mod rule_files_hostile;
mod top;
