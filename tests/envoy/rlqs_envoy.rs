//! Real Envoys with the `rate_limit_quota` filter asking sluice over RLQS: one tenant's global limit
//! is divided among the Envoys that want it, follows their demand, holds across sluice replicas
//! sharing Redis, and across a sluice restart. Envoy 1.40 reports every 5 s whatever its config
//! says, so each test runs for tens of seconds. Needs the Envoy binary, as `tests/envoy/envoy.rs`.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::{Duration, Instant};

use support::envoy::{Envoy, Upstream, envoy_binary};
use support::rlqs::{Load, Tally, quota_envoys, rules, tenant_metric};
use support::{Sluice, Store};

/// The tenant every load sends as `x-tenant`.
const TENANT: &str = "acme";

/// The tenant's global limit, per second, shared by every Envoy.
const LIMIT: u32 = 20;

/// What each Envoy is asked for: more than the whole limit, so every Envoy always wants more than
/// its share.
const RATE: u32 = 30;

/// How long Envoy 1.40 waits between two usage reports (hard-coded).
const REPORT_INTERVAL: Duration = Duration::from_secs(5);

/// What may be admitted beyond `LIMIT` per second over a run, once, when every Envoy subscribes
/// at its start: each assignment starts as a full token bucket, and the shares of one bucket add
/// up to one second's limit, so Σ max_tokens = `LIMIT`.
const BURST: u64 = LIMIT as u64;

/// By when every Envoy enforces an assignment, from the load's origin: Envoy sends a new
/// bucket's first report on its own time (up to 2 s measured on a loaded host, letting everything
/// through meanwhile), and the answer takes a round trip; one report interval at most.
const ENFORCING_WITHIN: usize = REPORT_INTERVAL.as_secs() as usize;

/// Starts sluice on `store` with the quota rules of `LIMIT` and the given `flags`.
async fn sluice_on(store: Store, flags: &[&str]) -> Sluice {
    Sluice::on(store, &[("quota.yaml", &rules(LIMIT))], flags).await
}

/// Starts one load of `RATE` per second on each Envoy, from one origin, for `length`.
fn load_each(envoys: &[Envoy], origin: Instant, length: Duration) -> Vec<Load> {
    envoys
        .iter()
        .map(|envoy| Load::start(envoy.listener, TENANT, RATE, origin, length))
        .collect()
}

async fn finish_all(loads: Vec<Load>) -> Vec<Tally> {
    let mut tallies = Vec::new();
    for load in loads {
        tallies.push(load.finish().await);
    }
    tallies
}

/// The requests admitted across `tallies`.
fn admitted(tallies: &[Tally]) -> u64 {
    tallies.iter().map(Tally::admitted).sum()
}

/// Sleeps until `origin + after`.
async fn sleep_until(origin: Instant, after: Duration) {
    tokio::time::sleep_until((origin + after).into()).await;
}

/// Polls `ready` every 200 ms for at most `limit`; panics saying `what` when it never holds.
async fn eventually(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The seconds, from the load's origin, from which every Envoy of `tallies` enforces an
/// assignment: from the second after the last of them first denied a request (each asks for
/// more than the whole limit, so each denies once it enforces its share) to `end`. Asserts that
/// they all do within `ENFORCING_WITHIN`.
fn enforcing(tallies: &[Tally], end: usize) -> Range<usize> {
    let firsts: Vec<Option<usize>> = tallies.iter().map(Tally::first_denied).collect();
    let last = firsts
        .iter()
        .map(|f| f.unwrap_or(usize::MAX))
        .max()
        .unwrap_or(0);
    assert!(
        last <= ENFORCING_WITHIN,
        "every Envoy enforces an assignment within {ENFORCING_WITHIN} s: first denials in \
         seconds {firsts:?}; per second: {:?}",
        tallies
            .iter()
            .map(Tally::admitted_per_second)
            .collect::<Vec<_>>()
    );
    last + 1..end
}

/// Asserts that `tallies`, run for `run`, admitted `LIMIT` per second plus at most a burst,
/// within 10 %, once every Envoy enforces an assignment (`enforcing`):
/// `0.9 × LIMIT × s ≤ admitted ≤ 1.1 × LIMIT × s + BURST` over those `s` seconds; and that no
/// Envoy starved: each admitted at least 3/4 of its fair share, `LIMIT × s / N`.
fn assert_global_limit_held(tallies: &[Tally], run: Duration, what: &str) {
    let seconds = enforcing(tallies, run.as_secs() as usize);
    let n = tallies.len() as u64;
    let nominal = u64::from(LIMIT) * seconds.len() as u64;
    let (low, high) = (nominal * 9 / 10, nominal * 11 / 10 + BURST);
    let total: u64 = tallies.iter().map(|t| t.admitted_in(seconds.clone())).sum();
    let each: Vec<u64> = tallies
        .iter()
        .map(|t| t.admitted_in(seconds.clone()))
        .collect();
    eprintln!(
        "{what}: admitted {total} (each {each:?}) in seconds {seconds:?}, {} in all of {} sent; \
         nominal {nominal}, bounds {low}..={high}",
        admitted(tallies),
        admitted(tallies) + tallies.iter().map(Tally::denied).sum::<u64>()
    );
    assert!(
        (low..=high).contains(&total),
        "{what}: {total} admitted in seconds {seconds:?}, outside {low}..={high}; per second: {:?}",
        tallies
            .iter()
            .map(Tally::admitted_per_second)
            .collect::<Vec<_>>()
    );
    let fair = nominal / n;
    for (i, admitted) in each.iter().enumerate() {
        assert!(
            *admitted >= fair * 3 / 4,
            "{what}: Envoy {i} starved: {admitted} admitted in seconds {seconds:?}, fair share \
             {fair}; per second: {:?}",
            tallies[i].admitted_per_second()
        );
    }
}

/// Asserts that during `seconds` (from the load's origin, while all are subscribed to one sluice
/// replica and enforce an assignment) the Envoys of `tallies` admitted together no more than
/// `LIMIT` per second, plus what their buckets held at the start (at most Σ max_tokens =
/// `LIMIT`) and one request per Envoy still in flight at the end. So the shares add up to the
/// limit as soon as every Envoy has subscribed: each subscription re-divides the bucket and
/// pushes the new shares at once to the Envoys subscribed before it, however close together they
/// subscribe.
fn assert_shares_add_up(tallies: &[Tally], seconds: Range<usize>) {
    let total: u64 = tallies.iter().map(|t| t.admitted_in(seconds.clone())).sum();
    let most = u64::from(LIMIT) * (seconds.len() as u64 + 1) + tallies.len() as u64;
    assert!(
        total <= most,
        "{total} admitted in seconds {seconds:?}, more than {most}: an Envoy kept a share larger \
         than its part; per second: {:?}",
        tallies
            .iter()
            .map(Tally::admitted_per_second)
            .collect::<Vec<_>>()
    );
}

/// Waits (at most two report intervals) until the sluices at `http` have been told, together,
/// of exactly `admitted` requests admitted in the tenant's bucket.
async fn assert_reported(http: &[SocketAddr], admitted: u64) {
    let reported = || {
        http.iter()
            .map(|&h| tenant_metric(h, "sluice_quota_reported_allowed_total"))
            .sum::<f64>()
    };
    eventually(
        &format!("sluice_quota_reported_allowed_total reaches {admitted}"),
        REPORT_INTERVAL * 2 + Duration::from_secs(2),
        || reported() as u64 == admitted,
    )
    .await;
}

/// Every Envoy asks for more than the whole limit of one tenant, for 30 s: together they get the
/// limit (plus the initial burst) and each gets about its fair share.
async fn envoys_over_the_limit_share_it_fairly(n: usize) {
    const RUN: Duration = Duration::from_secs(30);
    let binary = envoy_binary();
    let sluice = sluice_on(Store::Memory, &[]).await;
    let upstream = Upstream::start();
    let envoys = quota_envoys(&binary, upstream.addr, &vec![sluice.grpc; n]);

    let origin = Instant::now();
    let loads = load_each(&envoys, origin, RUN);
    sleep_until(origin, RUN / 2).await;
    assert_eq!(
        tenant_metric(sluice.http, "sluice_quota_streams"),
        n as f64,
        "one stream per Envoy subscribes to the tenant's bucket"
    );
    let assigned = tenant_metric(sluice.http, "sluice_quota_assigned_rate");
    assert!(
        (assigned - f64::from(LIMIT)).abs() < 0.01,
        "the shares add up to the limit: {assigned}"
    );
    let tallies = finish_all(loads).await;

    assert_global_limit_held(&tallies, RUN, &format!("{n} Envoys"));
    assert_shares_add_up(&tallies, enforcing(&tallies, RUN.as_secs() as usize));
    assert_reported(&[sluice.http], admitted(&tallies)).await;
}

/// Envoys over the limit share it fairly, side by side (each run is mostly waiting): two Envoys
/// on one sluice, three on another, and two each on a replica of its own sharing Redis.
#[tokio::test(flavor = "multi_thread")]
async fn envoys_over_the_limit_share_the_global_limit_fairly_on_one_replica_or_across_two() {
    tokio::join!(
        envoys_over_the_limit_share_it_fairly(2),
        envoys_over_the_limit_share_it_fairly(3),
        two_replicas_sharing_redis_hold_the_global_limit_across_their_envoys(),
    );
}

/// Shares follow the Envoys, side by side (each run is mostly waiting): an Envoy going idle, and
/// sluice restarting under two busy ones.
#[tokio::test(flavor = "multi_thread")]
async fn shares_follow_an_envoy_going_idle_and_hold_while_sluice_restarts() {
    tokio::join!(
        an_idle_envoys_share_goes_to_the_busy_one_on_its_replica_or_another(),
        envoys_keep_their_last_assignment_while_sluice_restarts_and_the_limit_holds(),
    );
}

/// Two Envoys share the limit; one stops. Its next report shows its demand falling and the one
/// after shows none, so within two report intervals (plus 2 s) of the stop the busy Envoy admits
/// about the whole limit: at least 85 %, over the next 10 s. On one replica, and side by side
/// (each run is mostly waiting) with each Envoy on a replica of its own, sharing Redis: there the
/// stopped Envoy's replica gives its share back and the store tells the other replica, which
/// grows its Envoy's share at once, without waiting for that Envoy's next report.
async fn an_idle_envoys_share_goes_to_the_busy_one_on_its_replica_or_another() {
    let sluice = sluice_on(Store::Memory, &[]).await;
    let prefix = format!("rlqs{}-moving:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let replicas = [
        sluice_on(Store::Redis, &flags).await,
        sluice_on(Store::Redis, &flags).await,
    ];
    tokio::join!(
        idle_share_moves([&sluice, &sluice], "one replica"),
        idle_share_moves([&replicas[0], &replicas[1]], "two replicas")
    );
}

/// Two Envoys, asking `sluices` in that order, share the limit for 15 s; then the second stops.
/// Prints when the first first admitted 90 % of the limit in a second after the stop.
async fn idle_share_moves(sluices: [&Sluice; 2], what: &str) {
    const BOTH: Duration = Duration::from_secs(15);
    const MOVED: Duration = Duration::from_secs(15 + 12);
    const WATCHED: u64 = 10;
    let binary = envoy_binary();
    let upstream = Upstream::start();
    let envoys = quota_envoys(&binary, upstream.addr, &[sluices[0].grpc, sluices[1].grpc]);

    let origin = Instant::now();
    let busy = Load::start(
        envoys[0].listener,
        TENANT,
        RATE,
        origin,
        MOVED + Duration::from_secs(WATCHED),
    );
    let stopping = Load::start(envoys[1].listener, TENANT, RATE, origin, BOTH);
    let stopped = stopping.finish().await;
    let busy = busy.finish().await;

    let limit = u64::from(LIMIT);
    // From one report interval in (the shares settled) until the stop.
    let shared = 5..BOTH.as_secs() as usize;
    let before = busy.admitted_in(shared.clone()) as f64 / shared.len() as f64;
    let watched = MOVED.as_secs() as usize..(MOVED.as_secs() + WATCHED) as usize;
    let after = busy.admitted_in(watched.clone());
    let per_second = busy.admitted_per_second();
    let followed = per_second
        .iter()
        .enumerate()
        .skip(BOTH.as_secs() as usize)
        .find(|(_, n)| **n * 10 >= limit * 9)
        .map(|(second, _)| second - BOTH.as_secs() as usize);
    eprintln!(
        "demand moves ({what}): busy Envoy {before:.1}/s while shared, {after} in {WATCHED} s from {MOVED:?}, \
         90 % of the limit from {followed:?} s after the stop; the other admitted {}; busy per second: {per_second:?}",
        stopped.admitted(),
    );
    assert!(
        (0.4..=0.6).contains(&(before / f64::from(LIMIT))),
        "while both are busy, each gets about half of {LIMIT}/s: {before:.1}/s; per second: {per_second:?}",
    );
    assert!(
        (limit * WATCHED * 85 / 100..=limit * WATCHED + limit).contains(&after),
        "from {MOVED:?} the busy Envoy admits about the whole limit: {after} in {WATCHED} s; per second: {per_second:?}",
    );
}

/// Two sluice replicas share one Redis and each Envoy asks a different one: the global limit
/// holds as with one replica, within 2 %. A share grows only by what no stream on either replica
/// holds, so the second subscriber waits for the first to give its half back (a few ms, told
/// through Redis) rather than both holding shares that add up to more than the limit.
async fn two_replicas_sharing_redis_hold_the_global_limit_across_their_envoys() {
    const RUN: Duration = Duration::from_secs(30);
    let prefix = format!("rlqs{}-replicas:", std::process::id());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let binary = envoy_binary();
    let replicas = [
        sluice_on(Store::Redis, &flags).await,
        sluice_on(Store::Redis, &flags).await,
    ];
    let upstream = Upstream::start();
    let envoys = quota_envoys(
        &binary,
        upstream.addr,
        &[replicas[0].grpc, replicas[1].grpc],
    );

    let origin = Instant::now();
    let loads = load_each(&envoys, origin, RUN);
    sleep_until(origin, RUN / 2).await;
    let assigned: Vec<f64> = replicas
        .iter()
        .map(|r| tenant_metric(r.http, "sluice_quota_assigned_rate"))
        .collect();
    for (i, replica) in replicas.iter().enumerate() {
        assert_eq!(
            tenant_metric(replica.http, "sluice_quota_streams"),
            1.0,
            "replica {i} holds its Envoy's stream"
        );
    }
    assert!(
        (assigned.iter().sum::<f64>() - f64::from(LIMIT)).abs() < 0.01,
        "the replicas' assignments add up to the limit: {assigned:?}"
    );
    let tallies = finish_all(loads).await;

    assert_global_limit_held(&tallies, RUN, "2 replicas");
    let seconds = enforcing(&tallies, RUN.as_secs() as usize);
    let nominal = u64::from(LIMIT) * seconds.len() as u64;
    let total: u64 = tallies.iter().map(|t| t.admitted_in(seconds.clone())).sum();
    let (low, high) = (nominal * 98 / 100, nominal * 102 / 100 + BURST);
    assert!(
        (low..=high).contains(&total),
        "2 replicas: {total} admitted in seconds {seconds:?}, outside {low}..={high} (2 % of \
         {nominal} and the bursts)"
    );
    assert_reported(&[replicas[0].http, replicas[1].http], admitted(&tallies)).await;
}

/// sluice (on Redis) is killed while two Envoys are busy, their shares adding up to the limit,
/// and started again on its port 5 s later. Meanwhile the Envoys keep enforcing their last
/// assignment (valid for 30 s): together they admit about the limit per second, not everything.
/// They reconnect at their next report; the dead process's streams still hold their grants in
/// Redis (for as long as an assignment lives), so the new streams wait for them and are told
/// nothing: the Envoys keep enforcing what the dead streams' grants stand for, then get their new
/// grants as the old ones lapse. So the Envoys admit the limit per second all along, and never
/// more. Killed between two reports: a kill between a report's record and its answer leaves that
/// Envoy's record counted a report longer than the assignment it holds (docs/quota-service.md).
async fn envoys_keep_their_last_assignment_while_sluice_restarts_and_the_limit_holds() {
    const RUN: Duration = Duration::from_secs(55);
    const KILLED: Duration = Duration::from_millis(17_500);
    const DOWN: Duration = Duration::from_secs(5);
    let binary = envoy_binary();
    let mut sluice = sluice_on(Store::Redis, &[]).await;
    let upstream = Upstream::start();
    let envoys = quota_envoys(&binary, upstream.addr, &[sluice.grpc, sluice.grpc]);

    let origin = Instant::now();
    let loads = load_each(&envoys, origin, RUN);
    sleep_until(origin, KILLED).await;
    sluice.kill();
    sleep_until(origin, KILLED + DOWN).await;
    sluice.start_again().await;
    let restarted = origin.elapsed();
    eventually(
        "both Envoys subscribe again",
        REPORT_INTERVAL * 2 + Duration::from_secs(2),
        || tenant_metric(sluice.http, "sluice_quota_streams") == 2.0,
    )
    .await;
    let reconnected = origin.elapsed();
    let tallies = finish_all(loads).await;

    assert_shares_add_up(&tallies, enforcing(&tallies, KILLED.as_secs() as usize));
    let per_second = |seconds: Range<usize>| {
        let admitted: u64 = tallies.iter().map(|t| t.admitted_in(seconds.clone())).sum();
        admitted as f64 / seconds.len() as f64
    };
    // Whole seconds with sluice down, and none of its first second up.
    let down = (KILLED.as_secs() + 1) as usize..(KILLED + DOWN).as_secs() as usize;
    // From its second second up to the end: the dead streams' grants lapse on the way.
    let after = (KILLED + DOWN).as_secs() as usize + 1..RUN.as_secs() as usize;
    eprintln!(
        "restart: {:.1}/s admitted while down (seconds {down:?}), {:.1}/s after (seconds \
         {after:?}); restarted at {restarted:?}, both subscribed again by {reconnected:?}; per \
         second: {:?}",
        per_second(down.clone()),
        per_second(after.clone()),
        tallies
            .iter()
            .map(Tally::admitted_per_second)
            .collect::<Vec<_>>()
    );
    for (when, seconds) in [("while sluice is down", down), ("after it is back", after)] {
        let rate = per_second(seconds.clone());
        assert!(
            (0.75..=1.25).contains(&(rate / f64::from(LIMIT))),
            "{when} the Envoys keep to their shares, {LIMIT}/s together: {rate:.1}/s in \
             seconds {seconds:?}; per second: {:?}",
            tallies
                .iter()
                .map(Tally::admitted_per_second)
                .collect::<Vec<_>>()
        );
    }
    assert_global_limit_held(&tallies, RUN, "restart");
}
