//! The tests that stop, pause, kill and fail over Redis under paced load (`redis-server` and
//! `redis-cli`: standalone, Sentinel, Cluster, behind a proxy), whose timing bounds assume the
//! machine to themselves: one at a time (`support::ONE_AT_A_TIME`), in a binary of their own.

mod failover;
mod faults;
