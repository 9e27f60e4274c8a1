//! The tests that need `redis-server` (and `redis-cli`): standalone Redis, Sentinel, Cluster,
//! leases, the quota service on Redis, and whatever else runs on every store; one shared
//! standalone server and one shared Cluster per run, and servers of their own for the tests that
//! stop, reconfigure or read the statistics of one. Those that fail Redis over, or fail it under
//! paced load, are `tests/faults`. Under 6 minutes of tests on 2 cores.

#[macro_use]
extern crate support;

mod algorithms;
mod answers;
mod calendar;
mod cluster;
mod counters;
mod counting;
mod dashboard;
mod data_errors;
mod differential;
mod erl_env;
mod erl_examples;
mod explain;
mod holds;
mod leases;
mod local_cache;
mod metrics_mapper;
mod operate;
mod redis;
mod reload;
mod rlqs;
mod rlqs_grants;
mod rls;
mod scope;
mod statsd;
mod store_budgets;
mod xds;
