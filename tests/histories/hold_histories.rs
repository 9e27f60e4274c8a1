//! Generated histories of holds (`hold:`, docs/llm-budgets.md): two replicas of sluice on one
//! real `redis-server`, driven through events a seeded generator picks (requests started
//! together on both replicas, each holding the estimate; settles at a random cost, up to three
//! times the estimate, on either replica; second settles; idle past the holds' time to live; a
//! replica killed and started again; Redis restarted empty), with the budget read from Redis
//! after every step:
//!
//! - the counter holds exactly what the settles charged: each request's first settle, on
//!   whichever replica, whether its hold had expired or not; a second settle charges nothing;
//! - what is spent and held never passes the limit but by what settles cost over their
//!   estimates (in full for a settle whose hold may have expired): requests started together on
//!   both replicas never hold more than there is room for;
//! - what is held is never more than the holds taken and not settled, nor less than those that
//!   surely still live.
//!
//! CI runs the fixed `SEEDS`. `HOLD_HISTORY_SEED=<u64>` replays one seed
//! (`HOLD_HISTORY_STEPS=<n>` steps, 16 unless set); `HOLD_HISTORY_MINUTES=<n>` runs fresh seeds for
//! n minutes. A failure prints the seed, the step and the history so far, in ms since it began
//! (with `--nocapture`, a history that passes prints it too).

use super::common;

use std::time::{Duration, Instant};

use common::redis::Controlled;
use common::rng::Rng;
use common::{HOUR, OVER_LIMIT, Sluice, Store, request};
use envoy_types::pb::google::protobuf::UInt64Value;

const DOMAIN: &str = "hist";
const LIMIT: u64 = 2_000;
const ESTIMATE: u64 = 100;
/// The holds' time to live (the rule's `ttl`).
const TTL: Duration = Duration::from_secs(2);
/// Around a hold's expiry, what a busy 2-core machine may blur: a hold younger than
/// `TTL - SLACK` surely still holds, and one settled before `2 × TTL - SLACK` is surely charged.
const SLACK: Duration = Duration::from_millis(500);
const REPLICAS: usize = 2;
/// The seeds CI runs.
const SEEDS: [u64; 2] = [38, 2026];
/// Steps of a generated history, unless `HOLD_HISTORY_STEPS` says.
const STEPS: usize = 16;
/// The users whose budgets the requests of a history spend: each start of requests is one
/// user's.
const USERS: [&str; 3] = ["u0", "u1", "u2"];

fn rules() -> String {
    format!(
        "domain: {DOMAIN}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: request_id\n        hold: {{estimate: {ESTIMATE}, ttl: 2s}}\n        rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
    )
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Requests started together, spread over the live replicas: each holds the estimate.
    Start(usize),
    /// Requests in flight settle, each at a random cost on a random live replica.
    Settle(usize),
    /// A settled request settles again.
    Again,
    Idle(Duration),
    /// A replica killed (the other one lives on).
    Kill(usize),
    /// A killed replica started again.
    Revive(usize),
    /// Redis restarted empty.
    RestartRedis,
}

/// A request of the history, as the model knows it.
struct Asked {
    user: usize,
    id: String,
    /// What its hold holds.
    held: u64,
    since: Instant,
    state: State,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Its hold was taken.
    Held,
    /// Its hold did not fit.
    Denied,
    Settled,
    /// Its hold, or the mark of its settle, was in a Redis restarted empty.
    Lost,
    /// The settle of a lost request, which the store took for a new request: it holds its cost.
    Phantom,
}

/// The history so far and the model of the budget.
struct History {
    seed: u64,
    began: Instant,
    log: Vec<String>,
    asked: Vec<Asked>,
    /// What the settles charged each user's budget since Redis last started.
    spent: [u64; USERS.len()],
    /// What the settles may have cost past their holds since then, per user.
    excess: [u64; USERS.len()],
    next_id: u64,
}

impl History {
    fn note(&mut self, what: String) {
        let at = self.began.elapsed().as_millis();
        self.log.push(format!("{at:>6} ms  {what}"));
    }

    fn fail(&self, step: usize, what: String) -> ! {
        panic!(
            "hold history, seed {} (HOLD_HISTORY_SEED={}), step {step}: {what}\n{}",
            self.seed,
            self.seed,
            self.log.join("\n")
        )
    }
}

/// One call for `user`'s request `id` with `hits`: admitted or not, and what remains.
async fn ask(sluice: &Sluice, user: usize, id: &str, hits: u64) -> (bool, u32) {
    let mut call = request(DOMAIN, &[&[("user", USERS[user]), ("request_id", id)]]);
    call.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    let answer = sluice.ask(call).await;
    (
        answer.overall_code != OVER_LIMIT,
        answer.statuses[0].limit_remaining,
    )
}

/// The events of a history of `steps` from `seed`, which keep a replica alive throughout.
fn generate(seed: u64, steps: usize) -> Vec<Event> {
    let mut rng = Rng(seed);
    let mut alive = [true; REPLICAS];
    let mut events = Vec::with_capacity(steps);
    while events.len() < steps {
        let event = match rng.weighted(&[6, 5, 2, 2, 1, 1, 1]) {
            0 => Event::Start(rng.range(1, 30) as usize),
            1 => Event::Settle(rng.range(1, 12) as usize),
            2 => Event::Again,
            3 => Event::Idle(Duration::from_millis(rng.range(200, 2_600))),
            4 => {
                let i = rng.index(REPLICAS);
                if !alive[i] || alive.iter().filter(|a| **a).count() < 2 {
                    continue;
                }
                alive[i] = false;
                Event::Kill(i)
            }
            5 => match alive.iter().position(|a| !a) {
                Some(i) => {
                    alive[i] = true;
                    Event::Revive(i)
                }
                None => continue,
            },
            _ => Event::RestartRedis,
        };
        events.push(event);
    }
    events
}

/// What the store holds for the user's budget now: (charged, held) in the current hour.
fn read(redis: &Controlled, key: &str) -> (u64, u64) {
    let hour = common::unix_ms() / HOUR.as_millis() as u64;
    let charged = redis
        .cli(&["HGET", key, &hour.to_string()])
        .trim()
        .parse()
        .unwrap_or(0);
    let table = format!("{key}~h");
    let head = redis.cli(&["HGET", &table, "~"]);
    let held = match head.trim().split_once(' ') {
        Some((window, held)) if window == hour.to_string() => held.parse().unwrap_or(0),
        _ => 0,
    };
    (charged, held)
}

/// Waits until every live replica decides again after Redis restarted, on every connection it
/// holds to Redis (a call on one that has not seen the restart yet fails): until 32 calls in a
/// row, 8 at a time, are decided, for a user of its own.
async fn until_deciding(replicas: &[Option<Sluice>]) {
    for sluice in replicas.iter().flatten() {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut in_a_row = 0;
        while in_a_row < 32 {
            let probes = (0..8).map(|i| async move {
                let probe = request(
                    DOMAIN,
                    &[&[("user", "probe"), ("request_id", &i.to_string())]],
                );
                sluice.client().await.should_rate_limit(probe).await.is_ok()
            });
            let decided = futures_util::future::join_all(probes).await;
            if decided.iter().all(|ok| *ok) {
                in_a_row += decided.len();
            } else {
                in_a_row = 0;
                assert!(Instant::now() < deadline, "a replica decides again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn run(seed: u64, steps: usize) {
    let events = generate(seed, steps);
    let mut redis = Controlled::started();
    let rules = rules();
    let flags = ["--redis-url", redis.url.as_str(), "--store-timeout", "2s"];
    let mut replicas: Vec<Option<Sluice>> = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(Some(
            Sluice::on(Store::Memory, &[("rules.yaml", &rules)], &flags).await,
        ));
    }
    let keys: Vec<String> = USERS
        .iter()
        .map(|user| {
            common::redis_key(
                replicas[0].as_ref().expect("alive"),
                DOMAIN,
                &[("user", user), ("request_id", "any")],
            )
        })
        .collect();
    let mut killed: Vec<Option<Sluice>> = (0..REPLICAS).map(|_| None).collect();
    let mut h = History {
        seed,
        began: Instant::now(),
        log: Vec::new(),
        asked: Vec::new(),
        spent: [0; USERS.len()],
        excess: [0; USERS.len()],
        next_id: 0,
    };
    let mut rng = Rng(seed ^ 0x5eed);
    for (step, event) in events.into_iter().enumerate() {
        h.note(format!("step {step}: {event:?}"));
        let live: Vec<usize> = (0..REPLICAS).filter(|&i| replicas[i].is_some()).collect();
        match event {
            Event::Start(n) => {
                let user = rng.index(USERS.len());
                let ids: Vec<(String, usize)> = (0..n)
                    .map(|_| {
                        h.next_id += 1;
                        (format!("r{}", h.next_id), live[rng.index(live.len())])
                    })
                    .collect();
                let calls = ids
                    .iter()
                    .map(|(id, on)| ask(replicas[*on].as_ref().expect("alive"), user, id, 0));
                let answers = futures_util::future::join_all(calls).await;
                let now = Instant::now();
                let mut admitted = 0;
                for ((id, on), (ok, _)) in ids.into_iter().zip(answers) {
                    admitted += usize::from(ok);
                    h.asked.push(Asked {
                        user,
                        id: id.clone(),
                        held: ESTIMATE,
                        since: now,
                        state: if ok { State::Held } else { State::Denied },
                    });
                    h.note(format!(
                        "  {id} on r{on}: {}",
                        if ok { "held" } else { "denied" }
                    ));
                }
                h.note(format!("  {admitted} of {n} held for {}", USERS[user]));
            }
            Event::Settle(n) => {
                for _ in 0..n {
                    let now = Instant::now();
                    let open: Vec<usize> = (0..h.asked.len())
                        .filter(|&i| {
                            let a = &h.asked[i];
                            (a.state == State::Held
                                && now.duration_since(a.since) < 2 * TTL - SLACK)
                                || a.state == State::Lost
                        })
                        .collect();
                    if open.is_empty() {
                        break;
                    }
                    let i = open[rng.index(open.len())];
                    let cost = rng.range(0, 3 * ESTIMATE);
                    let on = live[rng.index(live.len())];
                    let (user, id) = (h.asked[i].user, h.asked[i].id.clone());
                    let sent = Instant::now();
                    let (ok, remaining) =
                        ask(replicas[on].as_ref().expect("alive"), user, &id, cost).await;
                    let a = &mut h.asked[i];
                    let age = sent.duration_since(a.since);
                    let what = if a.state == State::Lost {
                        // New to the store: taken for a request, it holds its cost (the rule's
                        // estimate for a cost of 0 or 1).
                        if ok {
                            a.state = State::Phantom;
                            a.held = if cost > 1 { cost } else { ESTIMATE };
                            a.since = sent;
                            "lost: holds its cost"
                        } else {
                            a.state = State::Denied;
                            "lost: its hold of its cost denied"
                        }
                    } else {
                        a.state = State::Settled;
                        h.spent[user] += cost;
                        if age + SLACK < TTL {
                            h.excess[user] += cost.saturating_sub(a.held);
                            "settled"
                        } else {
                            h.excess[user] += cost;
                            "settled, its hold maybe expired"
                        }
                    };
                    if !ok && !what.starts_with("lost") {
                        h.fail(step, format!("the settle of {id} was denied"));
                    }
                    h.note(format!(
                        "  {id} settles at {cost} on r{on} after {} ms: {what}; {remaining} left",
                        age.as_millis()
                    ));
                }
            }
            Event::Again => {
                let now = Instant::now();
                let settled: Vec<usize> = (0..h.asked.len())
                    .filter(|&i| {
                        h.asked[i].state == State::Settled
                            && now.duration_since(h.asked[i].since) < TTL - SLACK
                    })
                    .collect();
                if let Some(&i) = settled.get(rng.index(settled.len().max(1))) {
                    let (user, id) = (h.asked[i].user, h.asked[i].id.clone());
                    let on = live[rng.index(live.len())];
                    let (ok, remaining) =
                        ask(replicas[on].as_ref().expect("alive"), user, &id, ESTIMATE).await;
                    h.note(format!(
                        "  {id} settles again on r{on}: {ok}, {remaining} left"
                    ));
                }
            }
            Event::Idle(t) => tokio::time::sleep(t).await,
            Event::Kill(i) => {
                let mut sluice = replicas[i].take().expect("alive");
                sluice.kill();
                killed[i] = Some(sluice);
            }
            Event::Revive(i) => {
                let mut sluice = killed[i].take().expect("killed");
                sluice.start_again().await;
                replicas[i] = Some(sluice);
            }
            Event::RestartRedis => {
                redis.kill();
                redis.start();
                until_deciding(&replicas).await;
                h.spent = [0; USERS.len()];
                h.excess = [0; USERS.len()];
                // Holds and marks went with Redis: a request's next call is a new request's.
                for a in &mut h.asked {
                    if matches!(a.state, State::Held | State::Phantom | State::Settled) {
                        a.state = State::Lost;
                    }
                }
            }
        }
        for (user, key) in keys.iter().enumerate() {
            check(&h, step, &redis, user, key);
        }
    }
    println!("hold history, seed {seed}:\n{}", h.log.join("\n"));
}

/// The invariants on `user`'s budget, on what the store holds now at `key`.
fn check(h: &History, step: usize, redis: &Controlled, user: usize, key: &str) {
    let (charged, held) = read(redis, key);
    let now = Instant::now();
    let holding = |a: &&Asked| a.user == user && matches!(a.state, State::Held | State::Phantom);
    let most: u64 = h.asked.iter().filter(holding).map(|a| a.held).sum();
    let least: u64 = h
        .asked
        .iter()
        .filter(holding)
        .filter(|a| now.duration_since(a.since) + SLACK < TTL)
        .map(|a| a.held)
        .sum();
    let (spent, excess) = (h.spent[user], h.excess[user]);
    let stated = format!(
        "{}: charged {charged}, held {held} (the model: spent {spent}, holds between {least} and \
         {most}, excess {excess})",
        USERS[user]
    );
    if charged != spent {
        h.fail(
            step,
            format!("the counter holds other than the settles charged: {stated}"),
        );
    }
    if held > most || held < least {
        h.fail(
            step,
            format!("what is held is not what the holds hold: {stated}"),
        );
    }
    if charged + held > LIMIT + excess {
        h.fail(
            step,
            format!("spent and held pass the limit of {LIMIT}: {stated}"),
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_histories_never_hold_past_the_budget_and_charge_each_request_once() {
    common::histories("HOLD", &SEEDS, STEPS, HOUR, run).await;
}
