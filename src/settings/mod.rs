//! Settings read at the edge, before anything starts: envoyproxy/ratelimit's environment, turned
//! into the `serve` flags it means when sluice runs as `ratelimit` (`erl`).

pub mod erl;
