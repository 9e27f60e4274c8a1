//! The two stores agree: random requests (every algorithm, limits, hits, check-only requests,
//! refunds, modes, both countings, a descriptor passing as a quota, a counter named twice,
//! scheduled instants, leased blocks, holds taken, settled, refused for a known id, settled unheld, expired and refused
//! by a full table, calendar windows crossing a boundary in a time zone) go through `lua/check.lua` on a real Redis and through the embedded store at
//! the instant the script read from Redis `TIME`; the answers (admitted, then eight numbers per
//! counter) and the stored state after every request (contents and expiry instants) must be
//! identical.

use std::collections::BTreeSet;
use std::time::Duration;

use fred::prelude::*;
use fred::types::CustomCommand;
use sluice_core::limiter::algorithm::{Verdict, gcra, window};
use sluice_core::limiter::calendar::Weekday;
use sluice_core::limiter::outcome::Outcome;
use sluice_core::limiter::{
    Algorithm, Calendar, Check, CounterKey, Counting, DescriptorKey, HoldAsk, HoldId, Item,
    ItemStep, Limit, Mode, OnExpiry, RuleId, Unit, lease,
};
use sluice_core::store::{MemoryStore, Percent, Stored};

const CHECK: &str = include_str!("../../lua/check.lua");

/// Reads, in one call and at one instant, what each key holds: Redis TIME in ms, then per key
/// its expiry instant (PEXPIRETIME; -2 when absent) and its contents as strings (a hash's fields
/// and values, or a sorted set's members and scores, in order).
const READ: &str = r#"
local t = redis.call('TIME')
local out = { tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) }
for _, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key).ok
  local contents = {}
  if kind == 'hash' then
    contents = redis.call('HGETALL', key)
  elseif kind == 'zset' then
    contents = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  end
  out[#out + 1] = { redis.call('PEXPIRETIME', key), contents }
end
return out
"#;

/// Expiry instants within this many ms of a read are not compared: Redis decides expiry on the
/// millisecond its call started, a hair before the instant TIME gives.
const BLUR_MS: u64 = 2;

/// xorshift64*: deterministic, so a failure replays from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One counter both stores keep: its Redis key, its key in the embedded store, its limit, and
/// the fixed windows it has been written in.
struct Counter {
    redis: String,
    key: CounterKey,
    limit: Limit,
    windows: BTreeSet<u64>,
}

/// Calendar boundaries the runs cross, one per seed: a time zone and a civil time in it where
/// calendar windows end (the year, month, Monday week and day in Berlin; the 23-hour day of a
/// change to summer time in New York, then its Monday week; 29 February, where months anchored
/// on the 29th to 31st start; the 25-hour day of Berlin's change to winter time, a Sunday).
const BOUNDARIES: [(&str, (i16, i8, i8)); 4] = [
    ("Europe/Berlin", (2029, 1, 1)),
    ("America/New_York", (2027, 3, 15)),
    ("UTC", (2028, 2, 29)),
    ("Europe/Berlin", (2027, 10, 31)),
];

/// The boundary of `seed`'s run: its zone and the instant, in ms.
fn boundary(seed: u64) -> (&'static str, u64) {
    let (zone, (y, m, d)) = BOUNDARIES[seed as usize % BOUNDARIES.len()];
    let instant = jiff::civil::date(y, m, d)
        .to_zoned(jiff::tz::TimeZone::get(zone).expect("a zone"))
        .expect("a midnight")
        .timestamp()
        .as_millisecond();
    (zone, instant as u64)
}

/// Ten counters, two per algorithm, and four fixed windows on the calendar of `zone` (a day, a
/// week, a month and a year), their clock set `clock_offset_ms` from the system's.
fn counters(rng: &mut Rng, seed: u64, zone: &str, clock_offset_ms: i64) -> Vec<Counter> {
    let algorithms = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
    ];
    let mut counters: Vec<Counter> = (0..10)
        .map(|i| {
            let algorithm = algorithms[i % algorithms.len()];
            let requests_per_unit = rng.below(7) as u32;
            let name = format!("c{i}");
            Counter {
                redis: format!("differential:{seed}:{{t}}:{name}"),
                key: DescriptorKey::new(b"differential", &[(b"k", name.as_bytes())])
                    .counter(algorithm.name()),
                limit: Limit {
                    name: String::new(),
                    requests_per_unit,
                    unit: Unit::Second,
                    unit_multiplier: 1 + rng.below(3) as u32,
                    algorithm,
                    burst: 1 + rng.below(6) as u32,
                    calendar: None,
                },
                windows: BTreeSet::new(),
            }
        })
        .collect();
    counters.extend(
        [Unit::Day, Unit::Week, Unit::Month, Unit::Year]
            .into_iter()
            .map(|unit| {
                let anchor_day = [1, 29, 31][rng.below(3) as usize];
                let week_starts = [Weekday::Monday, Weekday::Sunday][rng.below(2) as usize];
                let name = format!("calendar-{}", unit.name());
                Counter {
                    redis: format!("differential:{seed}:{{t}}:{name}"),
                    key: DescriptorKey::new(b"differential", &[(b"k", name.as_bytes())])
                        .counter(&name),
                    limit: Limit {
                        name: String::new(),
                        requests_per_unit: 4 + rng.below(20) as u32,
                        unit,
                        unit_multiplier: 1,
                        algorithm: Algorithm::FixedWindow,
                        burst: 1,
                        calendar: Some(
                            Calendar::new(zone, anchor_day, week_starts)
                                .expect("a calendar")
                                .offset_by(clock_offset_ms),
                        ),
                    },
                    windows: BTreeSet::new(),
                }
            }),
    );
    counters
}

/// The window argument of a counter: its length in ms, or on the calendar the boundaries of
/// three windows around this process's clock.
fn window_arg(limit: &Limit) -> Value {
    match &limit.calendar {
        Some(calendar) => {
            let [b0, b1, b2, b3] = calendar.around(limit.unit, support::unix_ms());
            Value::from(format!("{b0} {b1} {b2} {b3}"))
        }
        None => (limit.window_ms() as i64).into(),
    }
}

/// The check script's arguments for one request, per its header (the node's replication ID not
/// asked for).
fn args(check: &Check, counters: &[&Counter]) -> Vec<Value> {
    let mut args: Vec<Value> = vec![Value::from("0"), (counters.len() as i64).into()];
    args.push((check.at.unwrap_or(0) as i64).into());
    args.push(Value::from(if check.quota_passes { "0" } else { "1" }));
    for item in &check.items {
        let kind = match item.limit.algorithm {
            Algorithm::FixedWindow if item.limit.calendar.is_some() => "c",
            Algorithm::FixedWindow => "f",
            Algorithm::SlidingWindow => "s",
            Algorithm::SlidingLog => "l",
            Algorithm::TokenBucket | Algorithm::LeakyBucket => "b",
        };
        let mode = match item.mode {
            Mode::Enforce => "e",
            Mode::Shadow => "s",
            Mode::Quota => "q",
            Mode::ShadowQuota => "p",
        };
        args.extend([
            Value::from(kind),
            i64::from(item.limit.requests_per_unit).into(),
            window_arg(&item.limit),
            i64::from(item.limit.burst).into(),
            (item.hits as i64).into(),
            Value::from(match item.step {
                ItemStep::Hits => (if item.refund { "1" } else { "0" }).to_owned(),
                ItemStep::Take { least } => format!("u{least}"),
                ItemStep::Return { window } => format!("r{window}"),
                ItemStep::Held(held) => format!(
                    "h{} {} {} {} {} {}",
                    held.estimate,
                    held.ttl_ms,
                    u8::from(held.on_expiry == OnExpiry::Charge),
                    held.most,
                    u8::from(held.settle),
                    held.id.hex()
                ),
            }),
            Value::from(mode),
            Value::from(match item.counting {
                Counting::Admitted => "0",
                Counting::Always => "1",
            }),
        ]);
    }
    args
}

async fn eval(client: &Client, script: &str, keys: Vec<String>, args: Vec<Value>) -> Value {
    let mut command: Vec<Value> = vec![script.into(), (keys.len() as i64).into()];
    command.extend(keys.into_iter().map(Value::from));
    command.extend(args);
    client
        .custom(CustomCommand::new_static("EVAL", None, false), command)
        .await
        .expect("the script runs")
}

fn numbers(value: Value) -> Vec<i64> {
    value
        .into_array()
        .into_iter()
        .map(|v| v.as_i64().expect("a number"))
        .collect()
}

fn strings(value: Value) -> Vec<String> {
    value
        .into_array()
        .into_iter()
        .map(|v| v.as_string().expect("a string"))
        .collect()
}

/// What the Redis key of `counter` holds, as the embedded store would hold it for the window
/// `index` (fixed windows) or at all (others): `None` when nothing live.
fn from_redis(counter: &Counter, contents: &[String], index: u64) -> Option<Stored> {
    let field = |name: &str| {
        contents
            .chunks(2)
            .find(|pair| pair[0] == name)
            .map(|pair| pair[1].parse::<u64>().expect("a whole number"))
    };
    match counter.limit.algorithm {
        Algorithm::FixedWindow => field(&index.to_string()).map(|count| {
            Stored::Window(window::State {
                window: index,
                count,
                previous: 0,
            })
        }),
        Algorithm::SlidingWindow => field("w").map(|w| {
            Stored::Window(window::State {
                window: w,
                count: field("c").expect("c beside w"),
                previous: field("p").expect("p beside w"),
            })
        }),
        Algorithm::TokenBucket | Algorithm::LeakyBucket => field("t").map(|t| {
            Stored::Bucket(gcra::State {
                stamp_ms: t,
                level: field("l").expect("l beside t"),
            })
        }),
        Algorithm::SlidingLog => {
            if contents.is_empty() {
                return None;
            }
            let mut entries: Vec<u64> = Vec::new();
            for pair in contents.chunks(2) {
                let at: u64 = pair[1].parse().expect("a whole score");
                let n = entries.iter().filter(|&&e| e == at).count() + 1;
                assert_eq!(pair[0], format!("{at}:{n:04}"), "members are canonical");
                entries.push(at);
            }
            Some(Stored::Log(entries))
        }
    }
}

/// Requires both stores to hold the same for every counter, read at one instant.
async fn same_state(client: &Client, memory: &MemoryStore, counters: &[Counter], step: &str) {
    let keys = counters.iter().map(|c| c.redis.clone()).collect();
    let mut read = eval(client, READ, keys, Vec::new())
        .await
        .into_array()
        .into_iter();
    let now = read.next().and_then(|v| v.as_i64()).expect("TIME") as u64;
    let near = |instant: u64| instant.abs_diff(now) <= BLUR_MS;
    for (counter, found) in counters.iter().zip(read) {
        let mut found = found.into_array().into_iter();
        let expiry = found.next().and_then(|v| v.as_i64()).expect("PEXPIRETIME");
        let contents = strings(found.next().expect("contents"));
        let limit = &counter.limit;
        let indexes: Vec<u64> = match limit.algorithm {
            Algorithm::FixedWindow => counter
                .windows
                .iter()
                .copied()
                .filter(|&i| i >= limit.window_at(now))
                .collect(),
            _ => vec![0],
        };
        let mut latest_expiry = None;
        for index in indexes {
            // An instant in the window: a calendar window's start names it.
            let within = match limit.calendar {
                Some(_) => index,
                None => index * limit.window_ms(),
            };
            let kept = memory.stored(&counter.key, limit, within, now);
            if kept.as_ref().is_some_and(|(_, e)| near(*e)) || near(expiry.max(0) as u64) {
                continue;
            }
            let held = from_redis(counter, &contents, index);
            assert_eq!(
                held,
                kept.as_ref().map(|(s, _)| s.clone()),
                "{step}: {} ({}) window {index}",
                counter.redis,
                counter.limit.algorithm.name()
            );
            if let Some((_, e)) = kept {
                latest_expiry = latest_expiry.max(Some(e));
            }
        }
        if let Some(e) = latest_expiry
            && !near(e)
        {
            assert_eq!(expiry, e as i64, "{step}: {} expires at", counter.redis);
        }
    }
}

/// Runs `steps` random requests from `seed` (`held`: every counter a window of 10 to 40, every
/// item held); what the held counters did, by reply code (the outcome's, and 8 for a call that
/// found a hold expired).
async fn run(client: &Client, seed: u64, steps: usize, held_only: bool) -> BTreeSet<i64> {
    let mut holds = BTreeSet::new();
    let mut rng = Rng(seed);
    // The calendar reads its clock as if the run started three seconds before the boundary.
    let (zone, instant) = boundary(seed);
    let offset = instant as i64 - 3_000 - support::unix_ms() as i64;
    let mut counters = counters(&mut rng, seed, zone, offset);
    if held_only {
        for (i, counter) in counters.iter_mut().enumerate() {
            if counter.limit.calendar.is_some() {
                continue;
            }
            counter.limit.algorithm = if i % 2 == 0 {
                Algorithm::FixedWindow
            } else {
                Algorithm::SlidingWindow
            };
            counter.limit.requests_per_unit = 10 + rng.below(30) as u32;
        }
    }
    let memory = MemoryStore::new(10_000, Percent(100));
    let mut now = 0;
    for step in 0..steps {
        let n = 1 + rng.below(3) as usize;
        let picked: Vec<usize> = (0..n)
            .map(|_| rng.below(counters.len() as u64) as usize)
            .collect();
        let schedulable = picked.iter().all(|&i| counters[i].limit.schedulable());
        let at = (schedulable && !held_only && now > 0 && rng.chance(40)).then(|| {
            if rng.chance(15) {
                now - 500
            } else {
                now + rng.below(4_000)
            }
        });
        let refund = rng.chance(10);
        let mut items: Vec<Item> = picked
            .iter()
            .map(|&i| Item {
                key: counters[i].key.clone(),
                rule: RuleId::default(),
                limit: counters[i].limit.clone(),
                mode: match rng.below(12) {
                    0 => Mode::Shadow,
                    1 | 2 => Mode::Quota,
                    3 => Mode::ShadowQuota,
                    _ => Mode::Enforce,
                },
                hits: if rng.chance(5) { 1 << 32 } else { rng.below(4) },
                refund,
                counting: if rng.chance(35) {
                    Counting::Always
                } else {
                    Counting::Admitted
                },
                leased: false,
                scope: Default::default(),
                step: ItemStep::Hits,
            })
            .collect();
        // A counter named twice is one rule's: its items share the rule's mode and counting.
        for j in 1..items.len() {
            if let Some(i) = (0..j).find(|&i| items[i].key == items[j].key) {
                (items[j].mode, items[j].counting) = (items[i].mode, items[i].counting);
            }
        }
        // The plan names a held counter once per request.
        let mut held: Vec<CounterKey> = Vec::new();
        for item in &mut items {
            // Leased blocks: taken up to a share of what remains, and given back to their
            // window only (this one or the one before).
            if lease::leasable(item.limit.algorithm) && rng.chance(15) {
                item.step = if refund {
                    let window = match item.limit.calendar_span(now) {
                        Some(span) if rng.chance(50) => item.limit.window_at(span.start - 1),
                        Some(span) => span.start,
                        None => (now / item.limit.window_ms()).saturating_sub(rng.below(2)),
                    };
                    ItemStep::Return { window }
                } else {
                    item.mode = Mode::Enforce;
                    item.counting = Counting::Admitted;
                    item.hits = rng.below(60);
                    ItemStep::Take {
                        least: rng.below(4),
                    }
                };
            } else if lease::leasable(item.limit.algorithm)
                && at.is_none()
                && (held_only || rng.chance(30))
                && !held.contains(&item.key)
            {
                held.push(item.key.clone());
                // Few requests (settled again) or many (left to expire).
                let requests = if rng.chance(50) { 2 } else { 8 };
                if held_only {
                    item.hits = rng.below(9);
                }
                // Held: a few requests, each held (or refused: its id known, its table full of
                // holds) or settled (its hold found, expired or gone), with times to live that
                // end within the run.
                item.step = ItemStep::Held(HoldAsk {
                    id: HoldId::of(&[rng.below(requests) as u8]),
                    estimate: rng.below(4) + u64::from(held_only),
                    ttl_ms: 500 + rng.below(2_000),
                    on_expiry: if rng.chance(50) {
                        OnExpiry::Charge
                    } else {
                        OnExpiry::Release
                    },
                    most: 1 + rng.below(6) as u32,
                    settle: rng.chance(45),
                });
                item.refund = false;
            }
        }
        let check = Check {
            items,
            at,
            quota_passes: rng.chance(10),
        };
        let chosen: Vec<&Counter> = picked.iter().map(|&i| &counters[i]).collect();
        let keys = chosen.iter().map(|c| c.redis.clone()).collect();
        let mut reply = eval(client, CHECK, keys, args(&check, &chosen))
            .await
            .into_array();
        assert_eq!(
            reply.remove(1).as_str().as_deref(),
            Some(""),
            "no replication ID asked for"
        );
        let reply = numbers(Value::Array(reply));
        now = reply[0] as u64;
        let (admitted, verdicts) = memory.decide_at(&check, now).expect("room");
        let mut expected = vec![i64::from(admitted)];
        for v in &verdicts {
            let Verdict {
                over,
                remaining_after,
                remaining_before,
                reset_after_ms,
                reset_before_ms,
                charged,
                window,
                hold,
            } = *v;
            let hold = hold.map_or(0, |seen| {
                let outcome = match seen.outcome {
                    Outcome::Hold => 1,
                    Outcome::Settle => 2,
                    Outcome::Reused => 3,
                    Outcome::Unheld => 4,
                    Outcome::Full => 5,
                };
                outcome + 8 * seen.expired as i64
            });
            if hold > 0 {
                holds.insert(hold % 8);
                if hold >= 8 {
                    holds.insert(8);
                }
            }
            expected.extend([
                i64::from(over),
                remaining_after as i64,
                remaining_before as i64,
                reset_after_ms as i64,
                reset_before_ms as i64,
                charged as i64,
                window as i64,
                hold,
            ]);
        }
        let what = format!("seed {seed} step {step}: {check:?}");
        assert_eq!(reply[1..], expected[..], "{what}");
        let instant = at.map_or(now, |at| at.max(now));
        for &i in &picked {
            let limit = &counters[i].limit;
            let (at, clock) = (limit.window_at(instant), limit.window_at(now));
            // A held counter counts at the clock.
            counters[i].windows.extend([at, clock]);
        }
        same_state(client, &memory, &counters, &what).await;
        tokio::time::sleep(Duration::from_millis(rng.below(120))).await;
    }
    let day = counters
        .iter()
        .find(|c| c.limit.calendar.is_some() && c.limit.unit == Unit::Day)
        .expect("a day on the calendar");
    assert!(
        day.windows.len() >= 2,
        "seed {seed}: the day on the calendar was counted on both sides of its boundary"
    );
    holds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_get_the_same_answers_and_leave_the_same_state_in_both_stores() {
    let redis = support::redis::standalone();
    let config = Config::from_url(&redis.url).expect("a Redis URL");
    let client = Builder::from_config(config).build().expect("a client");
    client.init().await.expect("Redis answers");
    // The runs side by side: each has its own counters and its own embedded store, and mostly
    // waits between its steps for time to pass.
    let runs = [0x5eed_0001, 0x5eed_0002, 0x5eed_0003, 0x5eed_0004]
        .map(|seed| run(&client, seed, 120, false))
        .into_iter()
        .chain([0x5eed_0005, 0x5eed_0006].map(|seed| run(&client, seed, 120, true)));
    let ran = futures_util::future::join_all(runs).await;
    let holds: BTreeSet<i64> = ran[4..].iter().flatten().copied().collect();
    assert_eq!(
        holds,
        BTreeSet::from([1, 2, 3, 4, 5, 8]),
        "held counters were held, settled, refused for an id they knew, settled with no hold, \
         refused by a table full of holds, and found holds expired"
    );
}
