//! sluice: a global rate limit service for Envoy (`envoy.service.ratelimit.v3`), and a quota
//! service (`envoy.service.rate_limit_quota.v3`) that divides global limits among Envoys.
//!
//! Two crates: `sluice-core` (`core/`) holds the limits, the rules, the rule files and the
//! stores, with what they tell (`limiter`, `rules`, `config`, `store`, `observe`, `throttle`,
//! `certs`), and this one, the server, which names them by their crate (`sluice_core::store`):
//! a path says which side of the crate line it is on.
//!
//! A request travels top-down through these modules. Imports point down the path, and to the
//! limiter: it is the floor the others stand on, importing no other module; the stores build on
//! its types, and `service::decide` joins the two. No imports go round in a circle
//! (tests/embedded/layers.rs checks both).
//!
//! - [`service`] — the network surface: the gRPC `RateLimitService` (plus health and reflection)
//!   and the admin HTTP server, with the bounds of each edge and the readiness both report. It
//!   validates requests, resolves hits, has each request decided by `service::decide` (the local
//!   over-limit cache, else the store), turns one decision into one status per descriptor, and
//!   answers by `--on-store-error` when the store cannot decide; it loads and hot-reloads the
//!   rules and serves metrics, the rules in force and explanations of how they match a request
//!   (`service::explain`) on the admin HTTP server. `service::rlqs` is the quota service's gRPC
//!   face: it hands each stream to `quota`.
//! - [`sluice_core::rules`] — the matcher built from rule files: (domain, descriptor entries) → the limits that
//!   apply, with envoyproxy/ratelimit's exact / wildcard / key-only precedence, and the explain
//!   walk that tells how each entry matched; quota bucket ids are matched the same way. Its
//!   `plan` turns a request's descriptors into one `Check` (limit overrides and `replaces`
//!   applied, hits and modes set) and names the metric series each descriptor is counted in.
//! - [`quota`] — the quota service's protocol, on a thread of its own: each report of a bucket
//!   is answered with that Envoy's share of its limit, as a grant kept in the store that shrinks
//!   at once and grows only by what no stream on any replica holds, within bounds on what is
//!   tracked per stream, per client and for the whole process.
//! - [`sluice_core::limiter`] — what a limit is (`Limit`, `Algorithm`, `Mode`), each algorithm's math shared by
//!   every store, counter identities (`CounterKey`), the all-or-nothing `Check` → `Decision`, and
//!   the rules of the local over-limit cache that denies without a store call. Pure: no store,
//!   no metrics, no I/O.
//! - [`sluice_core::store`] — where counters live, built on the limiter's types: the embedded in-process store,
//!   or Redis through one Lua script per request (`lua/check.lua`), its connections
//!   (`store::redis::conn`) apart from its script calls (`store::redis::script`), refunding
//!   (`lua/undo.lua`) what it admitted for callers it did not answer; and the quota service's
//!   demands, shared by every replica (`lua/demand.lua`). Every call, to either, goes through one
//!   guard (`store::guard`): a deadline, a circuit breaker, and where requests queue, a bound
//!   past which they are shed.
//!
//! Beside the path: [`pb`] holds the protobuf types and gRPC servers generated from `proto/`,
//! [`sluice_core::config`] reads and validates rule files into typed structs at the edge, and [`xds`]
//! follows an xDS server's `RateLimitConfig` resources into the same structs,
//! [`telemetry`] sets up logging (and keeps events every request can hit from flooding it) and
//! makes the `Telemetry` handle the service, the quota service and the stores (through
//! [`sluice_core::observe`]) tell what they do, which holds the Prometheus metrics (`telemetry::metrics`: the registry,
//! per-rule series and their cap, envoyproxy/ratelimit's statsd stats through its
//! statsd_exporter mapping, the response-time summary; `telemetry::top`: who is being limited
//! right now, in sketches of a fixed size), [`cli`] holds the client commands:
//! `sluice load`'s load generator, `sluice top`'s terminal view, `sluice counters`, the command
//! line of a server's `/counters`, both asking the admin port through `cli::admin`.
//!
//! Before any of it: [`settings`] holds every command's flags, `serve`'s as one clap group per
//! concern (rules and xDS, listeners, TLS, counter store and Redis, deadlines and policy,
//! answers, quota service, metrics and logs, the top view, envoyproxy/ratelimit compatibility),
//! each with its help heading, its bounds and the typed values the modules receive
//! (`service::reload::Feed`, `store::Backend`, `service::Edges`…); and it turns
//! envoyproxy/ratelimit's environment into `serve` flags when sluice runs as `ratelimit`. Only the `sluice` command reads it: no module
//! imports it.
//!
//! Below them all: [`sluice_core::observe`], what the rules and the stores tell whoever runs them, and
//! [`sluice_core::log_throttle`], which keeps a log line every request can hit to one a second. `limiter`,
//! `rules`, `config`, `store`, `observe`, `throttle` and `certs` are the core a library could
//! embed, a crate of their own: they cannot import the server's modules.
//!
//! TLS: [`sluice_core::certs`] reads certificates and keys from PEM files for both edges that speak it, the
//! gRPC server (`service::tls`, mTLS and reload included) and the connections to Redis.

pub mod cli;
pub mod pb;
pub mod quota;
pub mod service;
pub mod settings;
pub mod telemetry;
pub mod xds;
