//! The Rate Limit Quota Service's protocol: how much of a bucket's global limit each Envoy may
//! enforce. Each stream (one Envoy) reports every few seconds what each of its buckets let through
//! and denied; its demand is that per window, on sluice's clock. The limit is divided among every
//! stream counted in the bucket, on any replica, through the store, by max-min fairness
//! (`limiter::share`), and each stream gets its share as a token bucket its Envoy enforces alone.
//!
//! One (stream, bucket) pair is a small state machine, and the store (`store::demand`,
//! `lua/demand.lua`) keeps its grant beside its demand:
//!
//! - **untracked**: a bound was full (`bounds`): denied, never counted, never given a share;
//! - **fixed**: its rule does not divide (no rule, unlimited, a limit of 0): a blanket answer;
//! - **waiting**: counted, with a share the others still hold: not answered until it has some;
//! - **granted**: its Envoy enforces its grant, at most its share;
//! - **shrinking**: a smaller grant is on its way to its Envoy; the store counts the larger one
//!   (`held`) until the replica settles again once the shrink is taken;
//! - **gone**: out of the division: left (its stream ended, it was abandoned, its rule stopped
//!   dividing), at once; or lapsed (its replica died), once its record is no longer counted.
//!
//! What moves it: its report (`stream`, `subscription`), a division another stream moved
//! (`grants`: pushed on this replica, told through the store to the others), a reload
//! (`reload`), the store reconnecting (`replica`: no grant grows until every replica has listed
//! its own again), and time (a record lapsing). The invariant every move keeps: the grants of a
//! bucket, each counted at what its Envoy may still be enforcing, add up to at most the limit; a
//! grant shrinks at once and grows only by what no stream on any replica holds; and a stream
//! that asks for nothing gets the least share and nothing on top.
//! `tests/histories/rlqs_histories.rs` checks it at every answer of generated histories.
//!
//! - `replica`: this replica's streams of each bucket, its store, thread and allowances;
//! - `stream`: one Envoy's stream, its reports and answers;
//! - `subscription`: a stream's buckets, from subscription to departure;
//! - `grants`: settling a bucket in the store and sending the grants that moved;
//! - `reload`: a changed rule re-divides, or ends the division of, its buckets at once;
//! - `bounds`: what is tracked, per stream, per client and per process, and the paces;
//! - `assignment`: what an Envoy is told, and how it goes on the wire;
//! - `tally`: what a report adds to the metrics.

mod assignment;
mod bounds;
mod clock;
mod grants;
mod reload;
mod replica;
mod stream;
mod subscription;
mod tally;

use std::time::Duration;

pub use assignment::{Assignment, demand};
pub use replica::Quotas;
pub use stream::QuotaStream;

/// How often Envoy reports (fixed at 5 s in Envoy 1.40, whatever the bucket says).
const REPORT_INTERVAL: Duration = Duration::from_secs(5);
/// How long a stream's demand stays counted without a new report: three report intervals, so
/// that one late or lost report does not take its share away.
const DEMAND_STAYS: Duration = Duration::from_secs(3 * REPORT_INTERVAL.as_secs());
/// How soon after it is sent a settle call that names no server may grow a grant (on the store's
/// clock): one that took longer may have waited out a restart that emptied the store, which it
/// cannot tell from a bucket no stream holds yet. Far longer than a call takes, far shorter than
/// a restart. A call that names the server it last heard from needs no such bound: the store
/// grows nothing for one that meets another, whenever it gets there.
const GROWS_WITHIN: Duration = Duration::from_millis(100);
/// The most a demand record may take. No request waits for it: the Envoy keeps enforcing its
/// last assignment meanwhile.
const STORE_DEADLINE: Duration = Duration::from_secs(1);
/// Buckets one stream may hold, and the bytes of their ids; a bucket reported past either is
/// answered without being tracked or divided: denied (its limit may be divided among others
/// already, on any replica). `--quota-max-buckets` and `--quota-max-streams` bound the same for
/// the whole process, `--quota-max-buckets-per-client` and `--quota-max-streams-per-client` for
/// each client, so that one client's made-up bucket values do not use the process's bounds up.
const MOST_BUCKETS_PER_STREAM: usize = 10_000;
const MOST_BUCKET_BYTES_PER_STREAM: usize = 16 << 20;
/// Demand records (store calls) in flight at once on this replica, over every stream: a flood
/// of reports waits its turn here, not in Redis ahead of the rate limit checks.
const RECORDS_IN_FLIGHT: usize = 64;
/// Buckets of a report handled at a time, and answered in one message: between two such turns
/// the other streams have theirs, and no answer takes its connection's event loop long to encode.
const BUCKETS_AT_A_TIME: usize = 256;
/// Buckets that may be divided at once on one replica (their ids hashed to as many turns).
const TURNS: usize = 256;
/// Settle calls one division may take: its own, then one after each round of shrinks sent.
const SETTLE_ROUNDS: usize = 3;
/// How long a settle call waits for the shrinks it sent to be taken by their connections before
/// it settles again, which frees them for the others.
const TAKEN_WITHIN: Duration = Duration::from_millis(100);
/// How long no grant grows on this replica once its store connection is made again: a restarted
/// store has lost what every replica's streams hold, and every replica lists its own again (at
/// once, on its reconnection) before any grows.
const FROZEN_AFTER_RECONNECTION: Duration = Duration::from_secs(2);
/// How often the rules in force are read for a reload that changed a divided bucket's rule.
const RULES_READ: Duration = Duration::from_millis(100);
/// The shortest life of an assignment (Envoy reads whole seconds).
const ONE_SECOND: Duration = Duration::from_secs(1);
/// How long after a stream of another replica lapses its bucket is settled again.
const WAKE_SLACK: Duration = Duration::from_millis(20);
/// How soon a bucket with a stream short of its share is settled again after a call held to
/// `GROWS_WITHIN` that took longer, which may have grown nothing for it.
const LATE_RETRY: Duration = Duration::from_millis(250);
/// Answers waiting to be written to one stream (each of at most `BUCKETS_AT_A_TIME` buckets); a
/// push that finds it full is dropped (the stream's next report is answered anyway), and an answer
/// to a report waits, holding back the rest of the report.
const OUTBOX: usize = 8;

/// What a bucket no rule matches gets (`--quota-unmatched`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Unmatched {
    Allow,
    Deny,
}

impl Unmatched {
    fn assignment(self) -> Assignment {
        match self {
            Unmatched::Allow => Assignment::AllowAll,
            Unmatched::Deny => Assignment::DenyAll,
        }
    }
}

/// The assignment of a bucket matched by `rule` (none: unmatched) that needs no division:
/// `--quota-unmatched`'s for none, allow all for an unlimited rule, deny all for a limit of 0.
fn fixed_answer(
    unmatched: Unmatched,
    rule: Option<&sluice_core::rules::QuotaRule>,
) -> Option<Assignment> {
    let Some(rule) = rule else {
        return Some(unmatched.assignment());
    };
    match &rule.limit {
        None => Some(Assignment::AllowAll),
        Some(limit) if limit.requests_per_unit == 0 => Some(Assignment::DenyAll),
        Some(_) => None,
    }
}

/// How the quota service answers.
#[derive(Clone, Copy, Debug)]
pub struct QuotaSettings {
    pub unmatched: Unmatched,
    /// Each assignment's time to live, in whole seconds (Envoy reads no fraction).
    pub ttl: Duration,
    /// Reports of nothing in a row after which a stream is told to abandon a bucket.
    pub abandon_after: u32,
    /// Most buckets tracked at once over every stream (a bucket two streams report counts twice).
    pub max_buckets: usize,
    /// Most streams tracked at once.
    pub max_streams: usize,
    /// Most buckets and streams tracked at once for one client (an address; an IPv6 one by its
    /// /64).
    pub max_buckets_per_client: usize,
    pub max_streams_per_client: usize,
    /// Demand records a second this replica sends the store, at most (for as many tracked
    /// buckets as fit in it; past that, each bucket is recorded less often).
    pub max_records: u32,
    /// Bucket reports a second this replica takes from its streams, at most.
    pub max_reports: u32,
}
