//! Generated histories of split limits (`scope: split`, docs/rules.md): up to three replicas of
//! sluice on one real `redis-server`, each behind a proxy of its own, driven through events a
//! seeded generator picks (traffic on a replica, a replica started, stopped in good order,
//! killed, paused past its beat's life, cut off from Redis with its connections held open,
//! Redis paused, idle periods), checked at every answer and after every step:
//!
//! - the replicas together, every process that ran counted, admitted at most the limit in the
//!   window (the hour) whatever membership did;
//! - every answer states the share it was decided with (its limit), and a replica admits only
//!   while what it admitted is under that share, and denies only once it is not: its own count
//!   decides, with no store call; a replica that may not use a share answers by
//!   `--on-store-error` (an error);
//! - once the replicas are left alone for the bound (a beat's life, a newcomer's 3 s, two beats),
//!   every live replica's share of a per-second split limit is that limit divided by the live
//!   replicas, the remainder one each, and the shares add up to it exactly.
//!
//! CI runs the fixed `SEEDS`. `SPLIT_HISTORY_SEED=<u64>` replays one seed
//! (`SPLIT_HISTORY_STEPS=<n>` steps, 10 unless set); `SPLIT_HISTORY_MINUTES=<n>` runs fresh seeds
//! for n minutes. A failure prints the seed, the step and the history so far, in ms since it
//! began (with `--nocapture`, a history that passes prints it too).

use std::process::Command;
use std::time::{Duration, Instant};

use support::history::{Log, replay_label};
use support::proxy::Proxy;
use support::redis::Controlled;
use support::rng::Rng;
use support::{HOUR, OK, Sluice, Store, request};

const DOMAIN: &str = "hist";
/// The split limit of the hour, which the history runs in.
const LIMIT: u64 = 12;
/// The split limit of each second, whose division is checked once the replicas are left alone.
const EACH_SECOND: u64 = 10;
const SLOTS: usize = 3;
/// The seeds CI runs.
const SEEDS: [u64; 3] = [5, 2026, 11];
/// Steps of a generated history, unless `SPLIT_HISTORY_STEPS` says.
const STEPS: usize = 10;
/// How long the shares may take to settle once the replicas are left alone: a beat's life (3 s,
/// a killed replica's), a newcomer counted 3 s before a window begins, two beats, and the delays
/// of a busy 2-core machine.
const SETTLE: Duration = Duration::from_secs(10);

fn rules() -> String {
    format!(
        "domain: {DOMAIN}\ndescriptors:\n  - key: client\n    scope: split\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n  - key: each\n    scope: split\n    rate_limit: {{unit: second, requests_per_unit: {EACH_SECOND}}}\n"
    )
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Requests one after the other on a live replica.
    Traffic {
        slot: usize,
        requests: usize,
    },
    /// A replica not running started.
    Start(usize),
    /// SIGTERM: it takes its beat back.
    Stop(usize),
    /// SIGKILL: its beat lapses.
    Kill(usize),
    /// SIGSTOP for this long, then SIGCONT.
    Pause(usize, Duration),
    /// Its proxy to Redis stops forwarding for this long, its connections held open.
    Cut(usize, Duration),
    /// Redis SIGSTOPped for this long: no beat lands meanwhile.
    PauseRedis(Duration),
    Idle(Duration),
}

/// The events of a history of `steps` from `seed`, which keep a replica running throughout.
fn generate(seed: u64, steps: usize) -> Vec<Event> {
    let mut rng = Rng(seed);
    let mut running = [true, true, false];
    let mut events = Vec::with_capacity(steps);
    while events.len() < steps {
        let live: Vec<usize> = (0..SLOTS).filter(|&i| running[i]).collect();
        let down: Vec<usize> = (0..SLOTS).filter(|&i| !running[i]).collect();
        let event = match rng.weighted(&[6, 3, 2, 2, 2, 2, 1, 1]) {
            0 => Event::Traffic {
                slot: live[rng.index(live.len())],
                requests: rng.range(1, 10) as usize,
            },
            1 if !down.is_empty() => {
                let slot = down[rng.index(down.len())];
                running[slot] = true;
                Event::Start(slot)
            }
            2 | 3 if live.len() > 1 => {
                let slot = live[rng.index(live.len())];
                running[slot] = false;
                if rng.chance(50) {
                    Event::Stop(slot)
                } else {
                    Event::Kill(slot)
                }
            }
            4 => Event::Pause(live[rng.index(live.len())], rng.millis(500, 5_500)),
            5 => Event::Cut(live[rng.index(live.len())], rng.millis(500, 6_000)),
            6 => Event::PauseRedis(rng.millis(500, 2_500)),
            7 => Event::Idle(rng.millis(100, 2_000)),
            _ => continue,
        };
        events.push(event);
    }
    events
}

/// One replica slot: its process, its proxy to Redis, and what it admitted since it last
/// started.
struct Slot {
    sluice: Option<Sluice>,
    proxy: Proxy,
    running: bool,
    admitted: u64,
}

fn signal(sluice: &Sluice, name: &str) {
    let status = Command::new("kill")
        .args([name, &sluice.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {name}");
}

async fn run(seed: u64, steps: usize) {
    let events = generate(seed, steps);
    let redis = Controlled::started();
    let rules = rules();
    let mut slots: Vec<Slot> = Vec::new();
    for i in 0..SLOTS {
        let proxy = Proxy::start(redis.port).await;
        let sluice = if i < 2 {
            Some(replica(&proxy, &rules).await)
        } else {
            None
        };
        slots.push(Slot {
            running: sluice.is_some(),
            sluice,
            proxy,
            admitted: 0,
        });
    }
    // What every process admitted in the hour, those gone included.
    let mut in_the_window = 0;
    let mut h = Log::new(format!(
        "split history, {}",
        replay_label("SPLIT", seed, steps)
    ));
    for (step, event) in events.into_iter().enumerate() {
        h.note(format!("step {step}: {event:?}"));
        match event {
            Event::Traffic { slot, requests } => {
                for _ in 0..requests {
                    let s = &mut slots[slot];
                    let sluice = s.sluice.as_ref().expect("running");
                    let asked = sluice
                        .client()
                        .await
                        .should_rate_limit(request(DOMAIN, &[&[("client", "c")]]))
                        .await;
                    let answer = match asked {
                        Ok(answer) => answer.into_inner(),
                        Err(status) => {
                            h.note(format!("  r{slot}: no share: {}", status.message()));
                            continue;
                        }
                    };
                    let share = answer.statuses[0]
                        .current_limit
                        .as_ref()
                        .map_or(0, |l| u64::from(l.requests_per_unit));
                    let admitted = answer.overall_code == OK;
                    let before = s.admitted;
                    s.admitted += u64::from(admitted);
                    in_the_window += u64::from(admitted);
                    h.note(format!(
                        "  r{slot}: {} with a share of {share}, {before} admitted before",
                        if admitted { "admitted" } else { "denied" }
                    ));
                    if admitted && before >= share {
                        h.fail(
                            step,
                            format!("r{slot} admitted past its share of {share}"),
                            "",
                        );
                    }
                    if !admitted && before < share {
                        h.fail(
                            step,
                            format!("r{slot} denied under its share of {share}"),
                            "",
                        );
                    }
                    if in_the_window > LIMIT {
                        h.fail(
                            step,
                            format!(
                                "the replicas admitted {in_the_window} in the hour, past {LIMIT}"
                            ),
                            "",
                        );
                    }
                }
            }
            Event::Start(slot) => {
                let s = &mut slots[slot];
                match &mut s.sluice {
                    Some(sluice) => sluice.start_again().await,
                    None => s.sluice = Some(replica(&s.proxy, &rules).await),
                }
                s.running = true;
                s.admitted = 0;
            }
            Event::Stop(slot) => {
                let s = &mut slots[slot];
                let sluice = s.sluice.as_mut().expect("running");
                signal(sluice, "-TERM");
                if sluice
                    .exited_within(Duration::from_secs(15))
                    .await
                    .is_none()
                {
                    h.fail(step, format!("r{slot} did not stop on SIGTERM"), "");
                }
                s.running = false;
            }
            Event::Kill(slot) => {
                let s = &mut slots[slot];
                s.sluice.as_mut().expect("running").kill();
                s.running = false;
            }
            Event::Pause(slot, t) => {
                let sluice = slots[slot].sluice.as_ref().expect("running");
                signal(sluice, "-STOP");
                tokio::time::sleep(t).await;
                signal(sluice, "-CONT");
            }
            Event::Cut(slot, t) => {
                slots[slot].proxy.cut();
                tokio::time::sleep(t).await;
                slots[slot].proxy.mend();
            }
            Event::PauseRedis(t) => {
                redis.pause();
                tokio::time::sleep(t).await;
                redis.resume();
            }
            Event::Idle(t) => tokio::time::sleep(t).await,
        }
        settled(&mut h, step, &slots).await;
    }
    println!("{}:\n{}", h.label, h.text());
}

/// A replica reaching Redis through `proxy`.
async fn replica(proxy: &Proxy, rules: &str) -> Sluice {
    let url = format!("redis://127.0.0.1:{}", proxy.port);
    let flags = ["--redis-url", url.as_str(), "--store-timeout", "2s"];
    Sluice::on(Store::Memory, &[("rules.yaml", rules)], &flags).await
}

/// Waits, at most `SETTLE`, until the running replicas' shares of the per-second limit are that
/// limit divided among them, adding up to it.
async fn settled(h: &mut Log, step: usize, slots: &[Slot]) {
    let running: Vec<&Sluice> = slots
        .iter()
        .filter(|s| s.running)
        .map(|s| s.sluice.as_ref().expect("running"))
        .collect();
    let n = running.len() as u64;
    let start = Instant::now();
    loop {
        let shares: Vec<Option<u64>> = running
            .iter()
            .map(|s| support::counted_limit(s, DOMAIN, "each", "probe"))
            .collect();
        let even = shares
            .iter()
            .all(|s| s.is_some_and(|s| s == EACH_SECOND / n || s == EACH_SECOND.div_ceil(n)));
        let sum: u64 = shares.iter().flatten().sum();
        if even && sum == EACH_SECOND {
            h.note(format!(
                "  settled in {} ms: shares {shares:?}",
                start.elapsed().as_millis()
            ));
            return;
        }
        if start.elapsed() > SETTLE {
            h.fail(
                step,
                format!(
                    "the shares of the {n} running replicas are {shares:?} after {SETTLE:?}, not {EACH_SECOND} divided among them"
                ),
                "",
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first fixed seed, or the seeds the knobs name.
#[tokio::test(flavor = "multi_thread")]
async fn generated_histories_admit_at_most_the_limit_and_divide_it_among_the_live() {
    support::histories("SPLIT", &SEEDS[..1], STEPS, HOUR, run).await;
}

/// The second fixed seed, beside the first (the test above runs the knobs' seeds).
#[tokio::test(flavor = "multi_thread")]
async fn the_second_fixed_seed_admits_at_most_the_limit_and_divides_it_among_the_live() {
    if !support::replaying("SPLIT") {
        support::histories("SPLIT", &SEEDS[1..2], STEPS, HOUR, run).await;
    }
}

/// The last fixed seed, beside the others.
#[tokio::test(flavor = "multi_thread")]
async fn the_last_fixed_seed_admits_at_most_the_limit_and_divides_it_among_the_live() {
    if !support::replaying("SPLIT") {
        support::histories("SPLIT", &SEEDS[2..], STEPS, HOUR, run).await;
    }
}
