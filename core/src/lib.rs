//! sluice-core: what a rate limit is and where its counters live, apart from any server. The
//! `sluice` crate serves it to Envoy; a library could embed it as well.
//!
//! - [`limiter`] — what a limit is (`Limit`, `Algorithm`, `Mode`), each algorithm's math shared
//!   by every store, counter identities (`CounterKey`), the all-or-nothing `Check` → `Decision`,
//!   the rules of the local over-limit cache and the leased blocks. Pure: no store, no metrics,
//!   no I/O; the floor the others stand on.
//! - [`config`] — rule files (envoyproxy/ratelimit's YAML and sluice's extensions) read and
//!   validated into typed structs, every error as `file:line: message`; the checks any other
//!   source of rules shares, and the sources kept with the rules.
//! - [`rules`] — the matcher built from them: (domain, descriptor entries) → the limits that
//!   apply, with envoyproxy/ratelimit's precedence; request planning (`rules::plan`), quota
//!   bucket matching, the explain walk and the dumps of the rules in force.
//! - [`store`] — where counters live: the embedded store, or Redis through one Lua script per
//!   request (`lua/check.lua`, `lua/undo.lua`, and `lua/demand.lua` for the quota service's
//!   shares), every call behind one guard (deadline, bounded queue, circuit breaker).
//! - [`observe`] — what the rules and the stores tell whoever runs them (an `Observer` handed to
//!   them), [`log_throttle`] — a log line every request can hit, kept to one a second, and
//!   [`certs`] — certificates and keys from PEM files.
//!
//! A rule file, a request's descriptor planned against it, and the check decided by the
//! embedded store, all or nothing (Redis takes the same check, in one script call):
//!
//! ```
//! use std::path::Path;
//!
//! use sluice_core::config::parse;
//! use sluice_core::limiter::Counting;
//! use sluice_core::limiter::lease::Leasing;
//! use sluice_core::rules::RuleSet;
//! use sluice_core::rules::plan::{Asked, Global};
//! use sluice_core::store::{MemoryStore, Percent};
//!
//! let text = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
//! let (domain, _warnings) = parse(Path::new("api.yaml"), text).expect("valid rules");
//! let rules = RuleSet::new(vec![domain]);
//! let store = MemoryStore::new(10_000, Percent(100));
//! let global = Global { quota_mode: false, counting: Counting::Admitted, lease: Leasing::Off, cluster: None };
//! let asked = [Asked {
//!     entries: vec![(b"tenant".as_slice(), b"acme".as_slice())],
//!     hits: 1,
//!     refund: false,
//!     limit: None,
//! }];
//! for admitted in [true, true, false] {
//!     let (_plans, check) = rules.plan(b"api", &asked, global, false);
//!     let decision = store.apply(&check).expect("room for the counter");
//!     assert_eq!(decision.admitted, admitted);
//! }
//! ```

pub mod certs;
pub mod config;
pub mod limiter;
pub mod log_throttle;
pub mod observe;
pub mod rules;
pub mod store;
