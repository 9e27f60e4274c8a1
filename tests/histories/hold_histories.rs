//! Generated histories of holds (`hold:`, docs/llm-budgets.md): two replicas of sluice on one
//! real `redis-server`, driven through events a seeded generator picks, checked at every answer
//! and, against what Redis holds, after every step.
//!
//! The rule: a limit of 2,000 an hour per user, each request holding its estimate of 100 (or a
//! request-time cost above it, up to `largest`: 10 %, 200) for a `ttl` of 1 s, at most `most` = 8
//! entries per counter, `on_expiry` left to its default (charge). The events: honest requests
//! started together on the live replicas (most at no cost, some naming a cost above the
//! estimate), settled later one by one on either replica at a cost from 0 to 3 × the estimate
//! (the settle carries `phase: response` after the request id), some never; settled requests
//! settled again; and a hostile client: request-time calls naming ids the counter knows (held,
//! settled, lapsed) or knew (lost with Redis, forgotten), or another user's; several calls under
//! one fresh id together; request-time costs below the estimate (2 hits); floods of fresh ids
//! past `most`, never settled; settles of ids never held; idle time (up to 2.5 × the ttl); a
//! replica killed and started again; Redis restarted empty (the budget starts over).
//!
//! The model keeps every call's span `[s, r]` (the wall clock when it was sent and when it was
//! answered, in ms; the script reads Redis' clock, the same clock, once, within it) and what it
//! was answered. A hold taken by a call over `[s, r]` is due within `[s + ttl, r + ttl]`; a later
//! call on its counter over `[s', r']` may have found it expired if `r'` reaches its earliest due,
//! and surely has if `s'` is past its latest due and at most 16 holds not surely found expired
//! may be due as early (the tidy bound: 16 holds a call, earliest due first). Marks likewise: made
//! within the span of a settle, or of a lapse (from the hold's earliest due to the call that surely
//! found it expired), forgotten one ttl after (16 a call), or earlier, by a call that may make room
//! for a new hold in a table that may hold `most` entries. Per counter, with `U` = what it is
//! charged plus what its holds hold (Redis: the window's count plus the table's `~`):
//!
//! - an admitted request-time call adds `a` (what its hold holds) to `U`; a hold found expired
//!   moves `a` from held to charged and leaves `U` as it is;
//! - a settle at cost `c` adds `c - a` if it finds its hold, `max(c - a, 0)` if it finds the
//!   lapse's mark, `c` if it finds nothing (an id never held, already settled, lost with Redis,
//!   its mark forgotten): every settle lands, an unheld one in full.
//!
//! The model keeps the lowest and highest `U` the spans allow (`[U_lo, U_hi]`: one value when each
//! settle surely came before its hold's due, or surely after with its mark surely kept or surely
//! gone, as the generator mostly arranges). Checked:
//!
//! - the bound, after every step: `U_lo <= charged + held <= U_hi`, with `held` between what the
//!   holds surely in flight hold (taken, not settled, no call since their earliest due) and what
//!   those neither settled nor surely found expired hold (so `charged >= U_lo - held_hi`: every
//!   settle landed and every hold surely found expired charged its estimate), as many holds;
//!   the table's entries within the model's (a mark once due may go with its table, which
//!   expires once every entry is due), never more than `most`;
//! - the budget: an admitted request-time call had `U_lo + a <= LIMIT` (calls sent together: `U_lo`
//!   plus all they hold); after every step `charged + held <= LIMIT + S`, `S` what the settles
//!   since the counter's last admitted hold added at most: spent and held pass the limit only by
//!   what settles cost over the holds they release (an unheld settle: its whole cost);
//! - the ids: a request-time call naming an id the counter surely knows (its hold in flight, or its
//!   mark surely kept) is refused; of calls under one id sent together at most one is admitted; an
//!   id it surely does not know (never held since Redis started, its mark surely forgotten) is
//!   admitted when `U_hi + a <= LIMIT` and the holds possibly in flight once the call found those
//!   due expired cannot fill `most` (only holds in flight fill a table), refused when the holds
//!   surely in flight fill it;
//! - the answers: told `LIMIT - U - a` left if admitted, 0 if refused for the budget, `LIMIT - U`
//!   if refused for its id or a full table, `LIMIT - U` after a settle, which is never refused; a
//!   refusal for a table surely full of holds in flight, or surely for the holds in flight alone
//!   (the count alone has room: `U - held + a <= LIMIT`), retries within the ttl (the next due);
//! - each request charged once, at the end: idle until every hold is due, then tidy every counter
//!   (settles of fresh ids at no cost): within one call per 16 holds and two more nothing is held,
//!   and the counter holds `U`: over admitted requests, `c` if settled while held, else
//!   `a + max(c - a, 0)` (its mark found) or `a + c` (forgotten), or `a` if never settled; plus
//!   each settle of an id no one held.
//!
//! Found by these histories, each now a hand-picked history in `CASES`: a counter's table
//! expired 2 × ttl after its last change with the holds still in it, never charged, so a client
//! that let its requests go unsettled and stayed away 2 × ttl got them free (fixed in a5b7a67: the
//! table lives until the window in which its newest hold may expire ends); a call that found
//! expired every hold of a table full of holds refused its own hold `full`, the marks it had just
//! made not being forgotten, and, no hold left in flight, said to retry at the window's end (fixed
//! in 4e00089). The first of `CASES` is one the differential test found meanwhile (fixed in
//! cca0fae): on Redis, a request refused for the holds in flight alone was told to retry at the
//! window's end when its count plus twice its hold passed the limit.
//!
//! CI runs the hand-picked `CASES` and the fixed `SEEDS` (in two tests side by side), every one
//! even past a failing one.
//! `HOLD_HISTORY_SEED=<u64>` replays one seed (`HOLD_HISTORY_STEPS=<n>` steps, 24 unless set);
//! `HOLD_HISTORY_MINUTES=<n>` runs fresh seeds for n minutes, goes on past a failing one, prints
//! the figures at the end (histories, steps, answers checked, settles the model could only
//! bound, histories ending with `U` exact), then fails naming the seeds that failed
//! (`HOLD_HISTORY_MINUTES=30 cargo test --test histories hold_histories`, `-- --nocapture` to
//! see each history). A failure prints the seed, the step and the history so far (every call,
//! its span and its answer, in ms since the history began); with `--nocapture`, a history that
//! passes prints it too.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use envoy_types::pb::google::protobuf::UInt64Value;
use futures_util::FutureExt;

use support::history::{Log, replay_label};
use support::redis::Controlled;
use support::rng::Rng;
use support::{HOUR, OVER_LIMIT, Sluice, Store, request};

const DOMAIN: &str = "hist";
const LIMIT: u64 = 2_000;
const ESTIMATE: u64 = 100;
/// The rule's `largest` (10 %): the most one hold takes, whatever the request-time cost.
const LARGEST: u64 = LIMIT / 10;
/// The holds' time to live (the rule's `ttl`), in ms.
const TTL_MS: u64 = 1_000;
/// The entries (holds and marks) a counter's table keeps (the rule's `most`).
const MOST: usize = 8;
/// The most due holds, and due marks, one call tidies (`hold::MOST_DUE`).
const MOST_DUE: usize = 16;
/// How far ahead of a hold's due instant the generator sends a settle it means to come before
/// it, and how long after the hold is surely due one it means to come after.
const GUARD_MS: u64 = 250;
const REPLICAS: usize = 2;
/// The seeds CI runs: the first two this file's earlier histories ran; the last three, from a
/// 30-minute run, each with Redis restarted, a replica killed, floods and calls under one id
/// together (the last with settles the model could only bound, and 18 holds left unsettled on
/// counters then idle past 2 × ttl: those the expired tables took).
const SEEDS: [u64; 8] = [
    38,
    2026,
    7,
    4242,
    90_125,
    4_558_846_116_804_159_425,
    15_120_929_585_925_474_712,
    9_487_147_933_066_959_983,
];
/// Hand-picked histories, which CI runs beside the seeds.
const CASES: [(&str, &[Event]); 3] = [
    (
        "a request refused for the holds in flight alone, the count alone having room, is told \
         to retry when the next hold is due",
        &[
            Event::Charge {
                user: 0,
                cost: LIMIT - 2 * ESTIMATE + 50,
            },
            Event::Cheap { user: 0, n: 1 },
            Event::Cheap { user: 0, n: 1 },
        ],
    ),
    (
        "a table whose holds all expired takes a new hold: only holds in flight fill a table",
        &[
            Event::Flood { user: 0, n: MOST },
            Event::Idle(TTL_MS + 300),
            Event::Cheap { user: 0, n: 1 },
        ],
    ),
    (
        "holds never settled are charged their estimate however long their counter then stays \
         idle",
        &[
            Event::Cheap { user: 0, n: 2 },
            Event::Idle(2 * TTL_MS + 300),
            Event::Charge { user: 0, cost: 0 },
        ],
    ),
];
/// Steps of a generated history, unless `HOLD_HISTORY_STEPS` says.
const STEPS: usize = 24;
/// One counter per user: honest requests and the hostile client's share them.
const USERS: [&str; 3] = ["u0", "u1", "u2"];

fn rules() -> String {
    format!(
        "domain: {DOMAIN}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: request_id\n        hold: {{estimate: {ESTIMATE}, settle: {{key: phase, value: response}}, ttl: 1s, most: {MOST}, largest: 10%}}\n        rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
    )
}

/// What a request-time call of `hits` holds.
fn amount(hits: u64) -> u64 {
    ESTIMATE.max(hits).min(LARGEST)
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Honest requests started together on the live replicas, one user's.
    Start {
        user: usize,
        n: usize,
    },
    /// Requests in flight settle, one after the other, each on a live replica.
    Settle(usize),
    /// Settled requests settle again.
    Again(usize),
    /// Hostile: request-time calls naming ids a user's counter knows or knew.
    Reuse(usize),
    /// Hostile: `k` request-time calls under one fresh id, together.
    Overlap {
        user: usize,
        k: usize,
    },
    /// Hostile: request-time calls at a cost below the estimate, one after the other.
    Cheap {
        user: usize,
        n: usize,
    },
    /// Hostile: `n` fresh ids, four at a time, never settled.
    Flood {
        user: usize,
        n: usize,
    },
    /// Hostile: settles of ids never held.
    Stranger(usize),
    /// A settle of an id never held at `cost` on `user`'s counter (hand-picked histories).
    Charge {
        user: usize,
        cost: u64,
    },
    Idle(u64),
    /// A replica killed (the other one lives on).
    Kill(usize),
    /// A killed replica started again.
    Revive(usize),
    /// Redis restarted empty.
    RestartRedis,
}

/// The events of a history of `steps` from `seed`, which keep a replica alive throughout.
fn generate(seed: u64, steps: usize) -> Vec<Event> {
    let mut rng = Rng(seed);
    let mut alive = [true; REPLICAS];
    let mut events = Vec::with_capacity(steps);
    let user = |rng: &mut Rng| rng.index(USERS.len());
    while events.len() < steps {
        let event = match rng.weighted(&[6, 6, 2, 3, 2, 2, 1, 2, 3, 1, 1, 1]) {
            0 => Event::Start {
                user: user(&mut rng),
                n: rng.range(1, 10) as usize,
            },
            1 => Event::Settle(rng.range(1, 8) as usize),
            2 => Event::Again(rng.range(1, 3) as usize),
            3 => Event::Reuse(rng.range(1, 4) as usize),
            4 => Event::Overlap {
                user: user(&mut rng),
                k: rng.range(2, 4) as usize,
            },
            5 => Event::Cheap {
                user: user(&mut rng),
                n: rng.range(1, 4) as usize,
            },
            6 => Event::Flood {
                user: user(&mut rng),
                n: rng.range(MOST as u64 + 1, 2 * MOST as u64) as usize,
            },
            7 => Event::Stranger(rng.range(1, 3) as usize),
            8 => Event::Idle(rng.range(100, 5 * TTL_MS / 2)),
            9 => {
                let i = rng.index(REPLICAS);
                if !alive[i] || alive.iter().filter(|a| **a).count() < 2 {
                    continue;
                }
                alive[i] = false;
                Event::Kill(i)
            }
            10 => match alive.iter().position(|a| !a) {
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

/// When a call was sent and answered (wall clock, ms since the Unix epoch): the script ran at an
/// instant of Redis' clock (the same clock) within.
#[derive(Clone, Copy, Debug)]
struct Span {
    s: u64,
    r: u64,
}

/// What a call was answered.
struct Answer {
    ok: bool,
    remaining: u64,
    reset_s: i64,
    at: Span,
}

/// One call for `user`'s request `id` with `hits`, a settle if `settle`.
async fn ask(
    sluice: &Sluice,
    user: usize,
    id: &str,
    hits: u64,
    settle: bool,
) -> Result<Answer, String> {
    let mut entries = vec![("user", USERS[user]), ("request_id", id)];
    if settle {
        entries.push(("phase", "response"));
    }
    let mut call = request(DOMAIN, &[&entries]);
    call.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    let mut client = sluice.client().await;
    let s = support::unix_ms();
    let answer = client.should_rate_limit(call).await;
    let r = support::unix_ms();
    let answer = answer
        .map_err(|e| format!("{id}: {:?} {}", e.code(), e.message()))?
        .into_inner();
    let status = answer.statuses.first().ok_or("no descriptor status")?;
    Ok(Answer {
        ok: answer.overall_code != OVER_LIMIT,
        remaining: u64::from(status.limit_remaining),
        reset_s: status
            .duration_until_reset
            .as_ref()
            .map_or(-1, |d| d.seconds),
        at: Span { s, r },
    })
}

/// A request admitted at request time: its hold, and what became of it, as far as the spans of
/// the calls on its counter tell.
struct Req {
    user: usize,
    id: String,
    /// The Redis it was held in (restarts so far).
    epoch: u32,
    amount: u64,
    at: Span,
    /// The generator never settles it.
    never: bool,
    settled: Option<Span>,
    /// A call may have found its hold expired (it ran at or after the hold's earliest due).
    maybe_tidied: bool,
    /// A call surely found it expired, answered then.
    tidied_by: Option<u64>,
    /// Its entry (its lapse's mark or its settle's) may be gone: forgotten, made room for, or
    /// never made (a settle that found no entry leaves none).
    maybe_gone: bool,
    surely_gone: bool,
}

impl Req {
    fn due_lo(&self) -> u64 {
        self.at.s + TTL_MS
    }

    fn due_hi(&self) -> u64 {
        self.at.r + TTL_MS
    }

    fn open(&self) -> bool {
        self.settled.is_none()
    }

    /// When its mark may have been made (earliest, latest if known), if it may have one.
    fn mark(&self) -> Option<(u64, Option<u64>)> {
        if self.surely_gone {
            return None;
        }
        match self.settled {
            Some(at) => Some((at.s, Some(at.r))),
            None if self.maybe_tidied => Some((self.due_lo(), self.tidied_by)),
            None => None,
        }
    }
}

/// What the model knows of one user's counter since Redis last started.
#[derive(Clone, Copy, Default)]
struct Counter {
    /// `U` (charged plus held) at its lowest and highest.
    lo: i64,
    hi: i64,
    /// What the settles since the last admitted hold added to `U`, at the highest.
    since: i64,
    /// The span of the last call on it.
    last: Option<Span>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    Not,
    Maybe,
    Surely,
}

/// The model: every admitted request, and what every counter may hold.
#[derive(Default)]
struct Model {
    epoch: u32,
    reqs: Vec<Req>,
    counters: [Counter; USERS.len()],
    /// Ids a user's counter never held (settled unheld, or refused): each user's.
    unheld: Vec<(usize, String)>,
}

impl Model {
    /// The requests held on `user`'s counter in the Redis of now.
    fn live(&self, user: usize) -> impl Iterator<Item = &Req> {
        self.reqs
            .iter()
            .filter(move |q| q.user == user && q.epoch == self.epoch)
    }

    fn live_indices(&self, user: usize) -> Vec<usize> {
        (0..self.reqs.len())
            .filter(|&i| self.reqs[i].user == user && self.reqs[i].epoch == self.epoch)
            .collect()
    }

    /// What a call on `user`'s counter over `at` may have tidied, as the script does first:
    /// at most `MOST_DUE` of the holds due (earliest due first), then at most `MOST_DUE` of the
    /// marks due (made before the call).
    fn tidy(&mut self, user: usize, at: Span) {
        let live = self.live_indices(user);
        let marks: Vec<(usize, u64, Option<u64>)> = live
            .iter()
            .filter_map(|&i| self.reqs[i].mark().map(|(lo, hi)| (i, lo, hi)))
            .collect();
        let maybe_due: Vec<u64> = live
            .iter()
            .map(|&i| &self.reqs[i])
            .filter(|q| q.open() && q.tidied_by.is_none() && q.due_lo() <= at.r)
            .map(Req::due_lo)
            .collect();
        for &i in &live {
            let q = &mut self.reqs[i];
            if !q.open() || q.tidied_by.is_some() || q.due_lo() > at.r {
                continue;
            }
            q.maybe_tidied = true;
            let due = q.due_hi();
            if due <= at.s && maybe_due.iter().filter(|lo| **lo <= due).count() <= MOST_DUE {
                q.tidied_by = Some(at.r);
            }
        }
        let maybe_due: Vec<u64> = marks
            .iter()
            .map(|(_, lo, _)| lo + TTL_MS)
            .filter(|due| *due <= at.r)
            .collect();
        for &(i, lo, hi) in &marks {
            if lo + TTL_MS > at.r {
                continue;
            }
            let q = &mut self.reqs[i];
            q.maybe_gone = true;
            if let Some(hi) = hi {
                let due = hi + TTL_MS;
                if due <= at.s && maybe_due.iter().filter(|d| **d <= due).count() <= MOST_DUE {
                    q.surely_gone = true;
                }
            }
        }
        self.counters[user].last = Some(at);
    }

    /// Whether `user`'s counter knows `id` (once the call is tidied).
    fn known(&self, user: usize, id: &str) -> Known {
        match self.live(user).filter(|q| q.id == id).last() {
            None => Known::Not,
            Some(q) if q.surely_gone => Known::Not,
            Some(q) if q.maybe_gone => Known::Maybe,
            Some(_) => Known::Surely,
        }
    }

    /// Holds in flight: (surely, at most). Once a call is tidied, those that fill a table: the
    /// marks it made of those it found expired make room as any other.
    fn in_flight(&self, user: usize) -> (usize, usize) {
        let open = || self.live(user).filter(|q| q.open());
        (
            open().filter(|q| !q.maybe_tidied).count(),
            open().filter(|q| q.tidied_by.is_none()).count(),
        )
    }

    /// Entries (holds and marks) of the table at `now`: (surely, at most). A mark that may be due
    /// may be gone with the table (which expires once every entry is due) even if no call came.
    fn entries(&self, user: usize, now: u64) -> (usize, usize) {
        let kept = |q: &&Req| q.mark().is_none_or(|(lo, _)| lo + TTL_MS > now);
        (
            self.live(user)
                .filter(|q| !q.maybe_gone)
                .filter(kept)
                .count(),
            self.live(user).filter(|q| !q.surely_gone).count(),
        )
    }

    /// What is held, and by how many holds: (least, most, fewest, most holds).
    fn held(&self, user: usize) -> (u64, u64, usize, usize) {
        let surely: Vec<u64> = self
            .live(user)
            .filter(|q| q.open() && !q.maybe_tidied)
            .map(|q| q.amount)
            .collect();
        let maybe: Vec<u64> = self
            .live(user)
            .filter(|q| q.open() && q.tidied_by.is_none())
            .map(|q| q.amount)
            .collect();
        (
            surely.iter().sum(),
            maybe.iter().sum(),
            surely.len(),
            maybe.len(),
        )
    }

    /// A call on `user`'s counter that may make room for a new hold: marks may be forgotten.
    fn may_make_room(&mut self, user: usize, pending: usize) {
        if self.entries(user, 0).1 + pending < MOST {
            return;
        }
        for i in self.live_indices(user) {
            if self.reqs[i].mark().is_some() {
                self.reqs[i].maybe_gone = true;
            }
        }
    }

    /// A settle of `id` at `cost` on `user`'s counter (tidied for it): what it adds to `U`,
    /// lowest and highest.
    fn settle(&mut self, user: usize, id: &str, cost: u64, at: Span) -> (i64, i64) {
        let c = cost as i64;
        let held = self
            .live_indices(user)
            .into_iter()
            .rfind(|&i| self.reqs[i].id == id && self.reqs[i].open());
        let latest = self
            .live_indices(user)
            .into_iter()
            .rfind(|&i| self.reqs[i].id == id);
        let (lo, hi) = match held.filter(|&i| Some(i) == latest) {
            Some(i) => {
                let q = &mut self.reqs[i];
                let a = q.amount as i64;
                let mut cases = Vec::new();
                // Found its hold; found the lapse's mark; found nothing.
                if q.tidied_by.is_none() {
                    cases.push(c - a);
                }
                if q.maybe_tidied && !q.surely_gone {
                    cases.push((c - a).max(0));
                }
                let unmarked = q.maybe_tidied && q.maybe_gone;
                if unmarked {
                    cases.push(c);
                }
                let only_unmarked = unmarked && q.tidied_by.is_some() && q.surely_gone;
                q.settled = Some(at);
                q.maybe_gone = unmarked;
                q.surely_gone = only_unmarked;
                (
                    *cases.iter().min().expect("a case"),
                    *cases.iter().max().expect("a case"),
                )
            }
            None => (c, c),
        };
        let counter = &mut self.counters[user];
        counter.lo += lo;
        counter.hi += hi;
        counter.since += hi;
        (lo, hi)
    }

    /// Whether a settle of `reqs[i]` sent now would surely find its hold, or surely find its
    /// lapse's mark (or surely nothing): its cost then known exactly.
    fn foreseeable(&self, i: usize, now: u64) -> bool {
        let q = &self.reqs[i];
        if q.epoch != self.epoch {
            return true;
        }
        if q.surely_gone || (now + GUARD_MS < q.due_lo() && !q.maybe_tidied) {
            return true;
        }
        let due_soon = self
            .live(q.user)
            .filter(|g| g.open() && g.tidied_by.is_none() && g.due_lo() <= now + GUARD_MS)
            .count();
        now >= q.due_hi() + GUARD_MS / 5
            && now + GUARD_MS < q.due_lo() + TTL_MS
            && !q.maybe_gone
            && due_soon <= MOST_DUE
    }
}

/// A request-time call to send: its id, cost, replica, and whether the generator settles it.
struct Asking {
    id: String,
    hits: u64,
    on: usize,
    never: bool,
}

/// What a history checked.
#[derive(Clone, Copy, Default, Debug)]
struct Figures {
    steps: u64,
    answers: u64,
    /// Settles whose cost the model could only bound.
    bounded: u64,
    /// Histories whose model ended with `U` exact on every counter.
    exact: u64,
}

/// The history so far, the model, and the processes.
struct History {
    began: u64,
    step: usize,
    /// Under the seed and how to replay it, or the hand-picked history's name.
    log: Log,
    model: Model,
    figures: Figures,
    rng: Rng,
    next_id: u64,
    redis: Controlled,
    replicas: Vec<Option<Sluice>>,
    killed: Vec<Option<Sluice>>,
    keys: Vec<String>,
}

/// What Redis holds for a counter: the window's count, the table's total held, entries, holds,
/// marks, and the table's time to live (ms; -2: none).
#[derive(Debug)]
struct Stored {
    charged: u64,
    held: u64,
    entries: usize,
    holds: usize,
    marks: usize,
    pttl: i64,
}

const READ: &str = "local c = redis.call('HGET', KEYS[1], ARGV[1]) or '0' \
    local h = redis.call('HGET', KEYS[2], '~') or '0' \
    return {c, h, redis.call('HLEN', KEYS[2]), redis.call('ZCARD', KEYS[3]), \
    redis.call('ZCARD', KEYS[4]), redis.call('PTTL', KEYS[2])}";

impl History {
    fn ms(&self, at: u64) -> i64 {
        at as i64 - self.began as i64
    }

    fn note(&mut self, what: String) {
        self.log.note(what);
    }

    fn fail(&self, what: String) -> ! {
        self.log.fail(self.step, what, "")
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}{}", self.next_id)
    }

    fn live(&self) -> Vec<usize> {
        (0..REPLICAS)
            .filter(|&i| self.replicas[i].is_some())
            .collect()
    }

    fn replica(&mut self) -> usize {
        let live = self.live();
        live[self.rng.index(live.len())]
    }

    fn span(&self, at: Span) -> String {
        format!("[{}..{}]", self.ms(at.s), self.ms(at.r))
    }

    fn model_of(&self, user: usize) -> String {
        let c = &self.model.counters[user];
        let (held_lo, held_hi, holds_lo, holds_hi) = self.model.held(user);
        let (entries_lo, entries_hi) = self.model.entries(user, support::unix_ms());
        format!(
            "the model: U in [{}, {}], held in [{held_lo}, {held_hi}] by {holds_lo}..{holds_hi} \
             holds, {entries_lo}..{entries_hi} entries, settles since the last hold added at \
             most {}",
            c.lo, c.hi, c.since
        )
    }

    /// Request-time calls on `user`'s counter, sent together (`same`: under one id).
    async fn hold(&mut self, user: usize, asking: Vec<Asking>, same: bool) {
        let calls = asking.iter().map(|a| {
            let sluice = self.replicas[a.on].as_ref().expect("alive");
            ask(sluice, user, &a.id, a.hits, false)
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut answers: Vec<Answer> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|e| self.fail(format!("a request-time call failed: {e}"))))
            .collect();
        let (lo, hi) = (self.model.counters[user].lo, self.model.counters[user].hi);
        for a in &answers {
            self.model.tidy(user, a.at);
        }
        let (sure, most) = self.model.in_flight(user);
        let known: Vec<Known> = asking
            .iter()
            .map(|a| self.model.known(user, &a.id))
            .collect();
        let (held_lo, ..) = self.model.held(user);
        let admitted: Vec<usize> = (0..answers.len()).filter(|&i| answers[i].ok).collect();
        let taken: u64 = admitted.iter().map(|&i| amount(asking[i].hits)).sum();
        for (i, (a, answer)) in asking.iter().zip(&answers).enumerate() {
            let amount = amount(a.hits);
            let others: u64 = taken - if answer.ok { amount } else { 0 };
            let others_n = admitted.len() - usize::from(answer.ok);
            let line = format!(
                "  hold {}/{} hits {} ({amount}) on r{} {}: {}, {} left, reset {} s",
                USERS[user],
                a.id,
                a.hits,
                a.on,
                self.span(answer.at),
                if answer.ok { "admitted" } else { "refused" },
                answer.remaining,
                answer.reset_s
            );
            self.note(line);
            let (lo, hi) = (lo.max(0) as u64, hi.max(0) as u64 + others);
            let reused = known[i] == Known::Surely && !same;
            let over = lo + amount > LIMIT;
            let full = sure >= MOST;
            let admissible =
                known[i] == Known::Not && !same && hi + amount <= LIMIT && most + others_n < MOST;
            self.figures.answers += 1;
            if answer.ok {
                if reused || over || full {
                    self.fail(format!(
                        "{} admitted: {}",
                        a.id,
                        if reused {
                            "its id is one the counter surely knows".to_owned()
                        } else if over {
                            format!("{lo} + {amount} pass the limit of {LIMIT}")
                        } else {
                            format!("{sure} holds in flight fill the table")
                        }
                    ));
                }
                let left = (LIMIT.saturating_sub(hi + amount), LIMIT - lo - amount);
                if answer.remaining < left.0 || answer.remaining > left.1 {
                    self.fail(format!(
                        "{} admitted, told {} left, not within {left:?}",
                        a.id, answer.remaining
                    ));
                }
                continue;
            }
            if admissible {
                self.fail(format!(
                    "{} refused: its id is new to the counter, U + {amount} <= {hi} + {amount} \
                     fits the limit of {LIMIT}, and at most {most} + {others_n} holds were in \
                     flight once the call found those due expired (only holds in flight fill a \
                     table)",
                    a.id
                ));
            }
            let maybe_reused = known[i] != Known::Not || same;
            let maybe_full = most + others_n >= MOST;
            if answer.remaining > 0 {
                let left = (LIMIT.saturating_sub(hi), LIMIT.saturating_sub(lo));
                if !(maybe_reused || maybe_full)
                    || answer.remaining < left.0
                    || answer.remaining > left.1
                {
                    self.fail(format!(
                        "{} refused, told {} left: only a reused id or a full table tell what \
                         is left ({left:?} then), and neither {} (at most {most} + {others_n} \
                         holds were in flight once the call found those due expired)",
                        a.id,
                        answer.remaining,
                        if maybe_reused || maybe_full {
                            "fits"
                        } else {
                            "may be"
                        }
                    ));
                }
            } else if hi + amount <= LIMIT && !((maybe_reused || maybe_full) && hi >= LIMIT) {
                self.fail(format!(
                    "{} refused, told 0 left, though U + {amount} <= {hi} + {amount} fits the \
                     limit of {LIMIT}",
                    a.id
                ));
            }
            let waits_for_holds =
                known[i] == Known::Not && !same && !maybe_full && over && held_lo > 0 && {
                    let charged = hi.saturating_sub(held_lo);
                    charged + amount <= LIMIT
                };
            let surely_full = known[i] == Known::Not && !same && full;
            if (waits_for_holds || surely_full) && answer.reset_s > TTL_MS.div_ceil(1000) as i64 {
                self.fail(format!(
                    "{} refused {}: told to retry in {} s, not when the next hold is due \
                     (within {TTL_MS} ms)",
                    a.id,
                    if surely_full {
                        "for a table full of holds"
                    } else {
                        "for the holds in flight alone (the count alone had room)"
                    },
                    answer.reset_s
                ));
            }
        }
        if taken > 0 && lo.max(0) as u64 + taken > LIMIT {
            self.fail(format!(
                "holds of {taken} admitted together on a counter of U >= {lo}: past the limit \
                 of {LIMIT}"
            ));
        }
        if sure + admitted.len() > MOST {
            self.fail(format!(
                "{} holds admitted together beside {sure} in flight: past most = {MOST}",
                admitted.len()
            ));
        }
        if same {
            let new = known[0] == Known::Not;
            let amount = amount(asking[0].hits);
            if admitted.len() > 1 {
                self.fail(format!(
                    "{} calls under one id admitted together",
                    admitted.len()
                ));
            }
            if new && admitted.is_empty() && hi.max(0) as u64 + amount <= LIMIT && most < MOST {
                self.fail("none of the calls under one new id admitted, with room".into());
            }
        }
        if asking
            .iter()
            .enumerate()
            .any(|(i, _)| known[i] != Known::Surely)
        {
            self.model.may_make_room(user, admitted.len());
        }
        for &i in &admitted {
            let a = &asking[i];
            // Its id was free: whatever the counter knew of it is gone.
            for q in self.model.reqs.iter_mut() {
                if q.user == user && q.epoch == self.model.epoch && q.id == a.id {
                    q.maybe_gone = true;
                    q.surely_gone = true;
                }
            }
            let amount = amount(a.hits);
            self.model.reqs.push(Req {
                user,
                id: a.id.clone(),
                epoch: self.model.epoch,
                amount,
                at: answers[i].at,
                never: a.never,
                settled: None,
                maybe_tidied: false,
                tidied_by: None,
                maybe_gone: false,
                surely_gone: false,
            });
            let c = &mut self.model.counters[user];
            c.lo += amount as i64;
            c.hi += amount as i64;
            c.since = 0;
        }
        for (i, a) in asking.iter().enumerate() {
            if !answers[i].ok && known[i] == Known::Not {
                self.model.unheld.push((user, a.id.clone()));
            }
        }
        answers.clear();
    }

    /// A settle of `id` on `user`'s counter at `cost` (`req`: the request it settles, if any).
    async fn settle(&mut self, user: usize, id: &str, cost: u64, req: Option<usize>) {
        let on = self.replica();
        let sluice = self.replicas[on].as_ref().expect("alive");
        let answer = ask(sluice, user, id, cost, true)
            .await
            .unwrap_or_else(|e| self.fail(format!("a settle failed: {e}")));
        self.model.tidy(user, answer.at);
        let (lo, hi) = self.model.settle(user, id, cost, answer.at);
        if let Some(i) = req
            && self.model.reqs[i].settled.is_none()
        {
            self.model.reqs[i].settled = Some(answer.at);
        }
        let added = if lo == hi {
            format!("{lo}")
        } else {
            self.figures.bounded += 1;
            format!("{lo}..{hi}")
        };
        let line = format!(
            "  settle {}/{id} at {cost} on r{on} {}: {}, {} left; adds {added}",
            USERS[user],
            self.span(answer.at),
            if answer.ok { "admitted" } else { "refused" },
            answer.remaining
        );
        self.note(line);
        self.figures.answers += 1;
        if !answer.ok {
            self.fail(format!("the settle of {id} was refused"));
        }
        let c = self.model.counters[user];
        let left = (
            LIMIT.saturating_sub(c.hi.max(0) as u64),
            LIMIT.saturating_sub(c.lo.max(0) as u64),
        );
        if answer.remaining < left.0 || answer.remaining > left.1 {
            self.fail(format!(
                "the settle of {id} told {} left, not within {left:?}",
                answer.remaining
            ));
        }
    }

    /// What Redis holds for `user`'s counter.
    fn read(&self, user: usize) -> Stored {
        let hour = support::unix_ms() / HOUR.as_millis() as u64;
        let key = &self.keys[user];
        let (table, holds, marks) = (format!("{key}~h"), format!("{key}~e"), format!("{key}~m"));
        let out = self.redis.cli(&[
            "EVAL",
            READ,
            "4",
            key,
            &table,
            &holds,
            &marks,
            &hour.to_string(),
        ]);
        let n: Vec<i64> = out
            .lines()
            .map(|l| {
                l.trim()
                    .parse()
                    .unwrap_or_else(|_| self.fail(format!("Redis read: {out}")))
            })
            .collect();
        if n.len() != 6 {
            self.fail(format!("Redis read: {out}"));
        }
        Stored {
            charged: n[0] as u64,
            held: n[1] as u64,
            entries: (n[2] - 1).max(0) as usize,
            holds: n[3] as usize,
            marks: n[4] as usize,
            pttl: n[5],
        }
    }

    /// The invariants on `user`'s counter, against what Redis holds now.
    fn check(&mut self, user: usize) -> Stored {
        let stored = self.read(user);
        let r = support::unix_ms();
        let c = self.model.counters[user];
        let (held_lo, held_hi, holds_lo, holds_hi) = self.model.held(user);
        let (entries_lo, entries_hi) = self.model.entries(user, r);
        let u = (stored.charged + stored.held) as i64;
        let since_last = c
            .last
            .map_or(-1, |l| support::unix_ms() as i64 - l.r as i64);
        let stated = format!(
            "{}: charged {}, held {} by {} holds, {} entries ({} marks), table ttl {} ms, last \
             call answered {since_last} ms ago; {}",
            USERS[user],
            stored.charged,
            stored.held,
            stored.holds,
            stored.entries,
            stored.marks,
            stored.pttl,
            self.model_of(user)
        );
        let broken = if stored.entries > MOST || stored.holds > MOST {
            Some(format!("the table keeps more than most = {MOST} entries"))
        } else if stored.held < held_lo || stored.holds < holds_lo {
            Some(if stored.pttl == -2 {
                "holds surely in flight are gone uncharged with their table".to_owned()
            } else {
                "less is held than the holds surely in flight".to_owned()
            })
        } else if stored.held > held_hi || stored.holds > holds_hi {
            Some("more is held than the holds not surely settled or expired".into())
        } else if stored.entries < entries_lo || stored.entries > entries_hi {
            Some("the table keeps other entries than the holds and marks it may".into())
        } else if u < c.lo || u > c.hi {
            Some(format!(
                "charged + held = {u} is not what the admitted requests and the settles cost"
            ))
        } else if u > LIMIT as i64 + c.since {
            Some(format!(
                "charged + held = {u} pass the limit of {LIMIT} by more than the settles since \
                 the last hold added"
            ))
        } else {
            None
        };
        if let Some(what) = broken {
            self.fail(format!("{what}: {stated}"));
        }
        stored
    }

    /// The open requests a settle may pick, preferring those whose cost it would know.
    fn pick_open(&mut self) -> Option<usize> {
        let now = support::unix_ms();
        let open: Vec<usize> = (0..self.model.reqs.len())
            .filter(|&i| self.model.reqs[i].open() && !self.model.reqs[i].never)
            .collect();
        let foreseeable: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| self.model.foreseeable(i, now))
            .collect();
        let pool = if self.rng.chance(85) && !foreseeable.is_empty() {
            foreseeable
        } else {
            open
        };
        (!pool.is_empty()).then(|| pool[self.rng.index(pool.len())])
    }

    async fn event(&mut self, event: Event) {
        match event {
            Event::Start { user, n } => {
                let asking = (0..n)
                    .map(|_| {
                        let hits = match self.rng.weighted(&[7, 1, 2]) {
                            0 => 0,
                            1 => self.rng.range(1, ESTIMATE - 1),
                            _ => self.rng.range(ESTIMATE + 1, 3 * ESTIMATE),
                        };
                        Asking {
                            id: self.fresh("r"),
                            hits,
                            on: self.replica(),
                            never: self.rng.chance(15),
                        }
                    })
                    .collect();
                self.hold(user, asking, false).await;
            }
            Event::Settle(n) => {
                for _ in 0..n {
                    let Some(i) = self.pick_open() else { break };
                    let (user, id) = (self.model.reqs[i].user, self.model.reqs[i].id.clone());
                    let cost = self.rng.range(0, 3 * ESTIMATE);
                    self.settle(user, &id, cost, Some(i)).await;
                }
            }
            Event::Again(n) => {
                for _ in 0..n {
                    let settled: Vec<usize> = (0..self.model.reqs.len())
                        .filter(|&i| !self.model.reqs[i].open())
                        .collect();
                    if settled.is_empty() {
                        break;
                    }
                    let i = settled[self.rng.index(settled.len())];
                    let (user, id) = (self.model.reqs[i].user, self.model.reqs[i].id.clone());
                    let cost = self.rng.range(0, 3 * ESTIMATE);
                    self.settle(user, &id, cost, None).await;
                }
            }
            Event::Reuse(n) => {
                for _ in 0..n {
                    let mut ids: Vec<(usize, String)> = self
                        .model
                        .reqs
                        .iter()
                        .map(|q| (q.user, q.id.clone()))
                        .collect();
                    ids.extend(self.model.unheld.iter().cloned());
                    if ids.is_empty() {
                        break;
                    }
                    let (mut user, id) = ids[self.rng.index(ids.len())].clone();
                    if self.rng.chance(15) {
                        // Another counter's id: this one knows it only if it held it too.
                        user = (user + 1 + self.rng.index(USERS.len() - 1)) % USERS.len();
                    }
                    let asking = vec![Asking {
                        id,
                        hits: 0,
                        on: self.replica(),
                        never: self.rng.chance(30),
                    }];
                    self.hold(user, asking, false).await;
                }
            }
            Event::Overlap { user, k } => {
                let id = self.fresh("o");
                let asking = (0..k)
                    .map(|_| Asking {
                        id: id.clone(),
                        hits: 0,
                        on: self.replica(),
                        never: false,
                    })
                    .collect();
                self.hold(user, asking, true).await;
            }
            Event::Cheap { user, n } => {
                for _ in 0..n {
                    let asking = vec![Asking {
                        id: self.fresh("c"),
                        hits: 2,
                        on: self.replica(),
                        never: self.rng.chance(50),
                    }];
                    self.hold(user, asking, false).await;
                }
            }
            Event::Flood { user, n } => {
                let mut left = n;
                while left > 0 {
                    let k = left.min(4);
                    left -= k;
                    let asking = (0..k)
                        .map(|_| Asking {
                            id: self.fresh("f"),
                            hits: 0,
                            on: self.replica(),
                            never: true,
                        })
                        .collect();
                    self.hold(user, asking, false).await;
                }
            }
            Event::Stranger(n) => {
                for _ in 0..n {
                    let user = self.rng.index(USERS.len());
                    let id = self.fresh("s");
                    let cost = self.rng.range(0, 3 * ESTIMATE);
                    self.settle(user, &id, cost, None).await;
                    self.model.unheld.push((user, id));
                }
            }
            Event::Charge { user, cost } => {
                let id = self.fresh("s");
                self.settle(user, &id, cost, None).await;
                self.model.unheld.push((user, id));
            }
            Event::Idle(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Event::Kill(i) => {
                let mut sluice = self.replicas[i].take().expect("alive");
                sluice.kill();
                self.killed[i] = Some(sluice);
            }
            Event::Revive(i) => {
                let mut sluice = self.killed[i].take().expect("killed");
                sluice.start_again().await;
                self.replicas[i] = Some(sluice);
            }
            Event::RestartRedis => {
                self.redis.kill();
                self.redis.start();
                until_deciding(&self.replicas).await;
                // Holds and marks went with Redis: the budget starts over.
                self.model.epoch += 1;
                self.model.counters = Default::default();
            }
        }
    }

    /// Idle until every hold is due, then tidy every counter (settles of ids never held, at no
    /// cost) until it holds nothing: each admitted request charged once.
    async fn finish(&mut self) {
        self.note("end: idle until every hold is due, then tidy".into());
        let due = self
            .model
            .reqs
            .iter()
            .filter(|q| q.open() && q.epoch == self.model.epoch)
            .map(Req::due_hi)
            .max();
        if let Some(due) = due {
            support::sleep_until_unix_ms(due + 20).await;
        }
        let mut exact = true;
        for (user, name) in USERS.iter().enumerate() {
            let (_, _, _, holds) = self.model.held(user);
            let most = holds / MOST_DUE + 2;
            let mut calls = 0;
            loop {
                let id = self.fresh("t");
                self.settle(user, &id, 0, None).await;
                calls += 1;
                let stored = self.check(user);
                if stored.held == 0 && stored.holds == 0 {
                    break;
                }
                if calls >= most {
                    self.fail(format!(
                        "{name}: {holds} holds due, not all found expired after {calls} calls \
                         (each finds 16): {stored:?}"
                    ));
                }
            }
            let c = self.model.counters[user];
            let stored = self.check(user);
            exact &= c.lo == c.hi;
            self.note(format!(
                "  {name}: charged {}, each admitted request once: the model's {}",
                stored.charged,
                if c.lo == c.hi {
                    format!("{}", c.lo)
                } else {
                    format!("[{}, {}]", c.lo, c.hi)
                }
            ));
        }
        self.figures.exact += u64::from(exact);
    }
}

/// Waits until every live replica decides again after Redis restarted, on every connection it
/// holds to Redis (a call on one that has not seen the restart yet fails): until 32 calls in a
/// row, 8 at a time, are decided, for a user of its own.
async fn until_deciding(replicas: &[Option<Sluice>]) {
    for sluice in replicas.iter().flatten() {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
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
                assert!(
                    std::time::Instant::now() < deadline,
                    "a replica decides again"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Runs `events` (`label`: what names them; `seed`: the runtime choices' seed).
async fn run(label: String, seed: u64, events: Vec<Event>) -> Figures {
    let steps = events.len();
    let redis = Controlled::started();
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
            support::redis_key(
                replicas[0].as_ref().expect("alive"),
                DOMAIN,
                &[("user", user), ("request_id", "any")],
            )
        })
        .collect();
    let mut h = History {
        began: support::unix_ms(),
        step: 0,
        log: Log::new(label),
        model: Model::default(),
        figures: Figures::default(),
        rng: Rng(seed ^ 0x5eed),
        next_id: 0,
        redis,
        replicas,
        killed: (0..REPLICAS).map(|_| None).collect(),
        keys,
    };
    for (step, event) in events.into_iter().enumerate() {
        h.step = step;
        h.note(format!("step {step}: {event:?}"));
        h.event(event).await;
        for user in 0..USERS.len() {
            h.check(user);
        }
        h.figures.steps += 1;
    }
    h.step = steps;
    h.finish().await;
    println!(
        "hold history {}: {} steps, {} answers checked, {} settles bounded, {}\n{}",
        h.log.label,
        h.figures.steps,
        h.figures.answers,
        h.figures.bounded,
        if h.figures.exact == 1 {
            "exact at the end"
        } else {
            "bounded at the end"
        },
        h.log.text()
    );
    h.figures
}

/// One seed's history, in one hour (run again if an hour ended while it failed).
async fn once(seed: u64, steps: usize) -> Figures {
    let label = replay_label("HOLD", seed, steps);
    let mut figures = Figures::default();
    support::in_one_window(HOUR, async || {
        figures = run(label.clone(), seed, generate(seed, steps)).await
    })
    .await;
    figures
}

/// A hand-picked history, in one hour.
async fn case(name: &str, events: &[Event]) -> Figures {
    let mut figures = Figures::default();
    support::in_one_window(HOUR, async || {
        figures = run(format!("'{name}'"), 0, events.to_vec()).await
    })
    .await;
    figures
}

/// What a history checked, or why it failed (the first line of its panic).
async fn caught(history: impl std::future::Future<Output = Figures>) -> Result<Figures, String> {
    AssertUnwindSafe(history)
        .catch_unwind()
        .await
        .map_err(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            why.lines().next().unwrap_or_default().to_owned()
        })
}

/// All the histories run: how many, what they checked, which failed.
#[derive(Default)]
struct Tally {
    histories: u64,
    all: Figures,
    failed: Vec<String>,
}

impl Tally {
    fn add(&mut self, outcome: Result<Figures, String>) {
        self.histories += 1;
        match outcome {
            Ok(f) => {
                self.all.steps += f.steps;
                self.all.answers += f.answers;
                self.all.bounded += f.bounded;
                self.all.exact += f.exact;
            }
            Err(why) => self.failed.push(why),
        }
    }

    /// Prints the figures of the histories run (`minutes`: fresh seeds for that long), then
    /// fails naming those that failed.
    fn report(self, minutes: Option<u64>) {
        let Tally {
            histories,
            all,
            failed,
        } = self;
        println!(
            "{histories} hold histories{}, {} passed: {} steps, {} answers checked, {} settles \
             bounded, {} ended exact",
            minutes.map_or(String::new(), |m| format!(" in {m} minutes")),
            histories - failed.len() as u64,
            all.steps,
            all.answers,
            all.bounded,
            all.exact
        );
        assert!(
            failed.is_empty(),
            "{} hold histories failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }
}

/// The hand-picked histories and the first half of the fixed seeds, or the seeds the knobs name.
#[tokio::test(flavor = "multi_thread")]
async fn generated_histories_never_hold_past_the_budget_and_charge_each_request_once() {
    let steps = support::env_number("HOLD_HISTORY_STEPS").unwrap_or(STEPS);
    if let Some(seed) = support::env_number::<u64>("HOLD_HISTORY_SEED") {
        once(seed, steps).await;
        return;
    }
    let minutes = support::env_number::<u64>("HOLD_HISTORY_MINUTES");
    let mut tally = Tally::default();
    match minutes {
        None => {
            for (name, events) in CASES {
                tally.add(caught(case(name, events)).await);
            }
            for seed in &SEEDS[..SEEDS.len() / 2] {
                tally.add(caught(once(*seed, steps)).await);
            }
        }
        Some(minutes) => {
            let until = std::time::Instant::now() + Duration::from_secs(minutes * 60);
            let mut fresh = Rng(support::unix_ms());
            while std::time::Instant::now() < until {
                tally.add(caught(once(fresh.next(), steps)).await);
            }
        }
    }
    tally.report(minutes);
}

/// The second half of the fixed seeds, beside the first (the test above runs the knobs' seeds).
#[tokio::test(flavor = "multi_thread")]
async fn the_second_half_of_the_fixed_seeds_never_hold_past_the_budget_nor_charge_twice() {
    if support::replaying("HOLD") {
        return;
    }
    let steps = support::env_number("HOLD_HISTORY_STEPS").unwrap_or(STEPS);
    let mut tally = Tally::default();
    for seed in &SEEDS[SEEDS.len() / 2..] {
        tally.add(caught(once(*seed, steps)).await);
    }
    tally.report(None);
}
