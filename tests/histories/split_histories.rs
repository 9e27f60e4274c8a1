//! Generated histories of split limits (`scope: split`, docs/rules.md): up to three replicas of
//! sluice on one real `redis-server`, driven through events a seeded generator picks (traffic on
//! a replica, a replica started, stopped in good order, killed, or paused past its beat's life,
//! Redis paused, idle periods), checked at every answer and after every step:
//!
//! - every answer states the share it was decided with (its limit), and a replica admits only
//!   while what it admitted is under that share, and denies only once it is not: its own count
//!   decides, with no store call;
//! - once the replicas are left alone for the bound (a beat's life and two beats), every live
//!   replica's share is the limit divided by the live replicas, the remainder one each, and the
//!   shares add up to the limit exactly.
//!
//! CI runs the fixed `SEEDS`. `SPLIT_HISTORY_SEED=<u64>` replays one seed
//! (`SPLIT_HISTORY_STEPS=<n>` steps, 10 unless set); `SPLIT_HISTORY_MINUTES=<n>` runs fresh seeds
//! for n minutes. A failure prints the seed, the step and the history so far, in ms since it
//! began (with `--nocapture`, a history that passes prints it too).

use super::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::redis::Controlled;
use common::rng::Rng;
use common::{HOUR, OK, Sluice, Store, request};

const DOMAIN: &str = "hist";
const LIMIT: u64 = 12;
const SLOTS: usize = 3;
/// The seeds CI runs.
const SEEDS: [u64; 2] = [5, 2026];
/// Steps of a generated history, unless `SPLIT_HISTORY_STEPS` says.
const STEPS: usize = 10;
/// How long the shares may take to settle once the replicas are left alone: a beat's life (3 s,
/// a killed replica's), two beats, and the delays of a busy 2-core machine.
const SETTLE: Duration = Duration::from_secs(8);

fn rules() -> String {
    format!(
        "domain: {DOMAIN}\ndescriptors:\n  - key: client\n    scope: split\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
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
        let event = match rng.weighted(&[6, 3, 2, 2, 2, 1, 1]) {
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
            4 => Event::Pause(live[rng.index(live.len())], rng.millis(500, 4_500)),
            5 => Event::PauseRedis(rng.millis(500, 2_500)),
            6 => Event::Idle(rng.millis(100, 2_000)),
            _ => continue,
        };
        events.push(event);
    }
    events
}

/// One replica slot: its process, and what it admitted since it last started.
struct Slot {
    sluice: Option<Sluice>,
    running: bool,
    admitted: u64,
}

struct History {
    seed: u64,
    began: Instant,
    log: Vec<String>,
}

impl History {
    fn note(&mut self, what: String) {
        let at = self.began.elapsed().as_millis();
        self.log.push(format!("{at:>6} ms  {what}"));
    }

    fn fail(&self, step: usize, what: String) -> ! {
        panic!(
            "split history, seed {} (SPLIT_HISTORY_SEED={}), step {step}: {what}\n{}",
            self.seed,
            self.seed,
            self.log.join("\n")
        )
    }
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
    let flags = ["--redis-url", redis.url.as_str(), "--store-timeout", "2s"];
    let mut slots: Vec<Slot> = Vec::new();
    for i in 0..SLOTS {
        let sluice = if i < 2 {
            Some(Sluice::on(Store::Memory, &[("rules.yaml", &rules)], &flags).await)
        } else {
            None
        };
        slots.push(Slot {
            running: sluice.is_some(),
            sluice,
            admitted: 0,
        });
    }
    let mut h = History {
        seed,
        began: Instant::now(),
        log: Vec::new(),
    };
    for (step, event) in events.into_iter().enumerate() {
        h.note(format!("step {step}: {event:?}"));
        match event {
            Event::Traffic { slot, requests } => {
                for _ in 0..requests {
                    let s = &mut slots[slot];
                    let sluice = s.sluice.as_ref().expect("running");
                    let answer = sluice.ask(request(DOMAIN, &[&[("client", "c")]])).await;
                    let share = answer.statuses[0]
                        .current_limit
                        .as_ref()
                        .map_or(0, |l| u64::from(l.requests_per_unit));
                    let admitted = answer.overall_code == OK;
                    let before = s.admitted;
                    s.admitted += u64::from(admitted);
                    h.note(format!(
                        "  r{slot}: {} with a share of {share}, {before} admitted before",
                        if admitted { "admitted" } else { "denied" }
                    ));
                    if admitted && before >= share {
                        h.fail(step, format!("r{slot} admitted past its share of {share}"));
                    }
                    if !admitted && before < share {
                        h.fail(step, format!("r{slot} denied under its share of {share}"));
                    }
                }
            }
            Event::Start(slot) => {
                let s = &mut slots[slot];
                match &mut s.sluice {
                    Some(sluice) => sluice.start_again().await,
                    None => {
                        s.sluice = Some(
                            Sluice::on(Store::Memory, &[("rules.yaml", &rules)], &flags).await,
                        );
                    }
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
                    h.fail(step, format!("r{slot} did not stop on SIGTERM"));
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
            Event::PauseRedis(t) => {
                redis.pause();
                tokio::time::sleep(t).await;
                redis.resume();
            }
            Event::Idle(t) => tokio::time::sleep(t).await,
        }
        settled(&mut h, step, &slots).await;
    }
    println!("split history, seed {seed}:\n{}", h.log.join("\n"));
}

/// Waits, at most `SETTLE`, until the running replicas' shares are the limit divided among
/// them, adding up to it.
async fn settled(h: &mut History, step: usize, slots: &[Slot]) {
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
            .map(|s| common::counted_limit(s, DOMAIN, "client", "probe"))
            .collect();
        let even = shares
            .iter()
            .all(|s| s.is_some_and(|s| s == LIMIT / n || s == LIMIT.div_ceil(n)));
        let sum: u64 = shares.iter().flatten().sum();
        if even && sum == LIMIT {
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
                    "the shares of the {n} running replicas are {shares:?} after {SETTLE:?}, not {LIMIT} divided among them"
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_histories_decide_each_share_alone_and_divide_the_limit_among_the_live() {
    common::histories("SPLIT", &SEEDS, STEPS, HOUR, run).await;
}
