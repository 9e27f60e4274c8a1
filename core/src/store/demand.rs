//! The quota buckets of the Rate Limit Quota Service, divided among the streams (one per Envoy)
//! that report them, whichever sluice replica serves them. Per stream, a bucket keeps the
//! stream's demand and its grant: the share of the limit its Envoy may be enforcing now. A grant
//! shrinks at once and grows only by what no stream holds, so that the grants of a bucket never
//! add up to more than its limit; a shrink counts at the grant before it until the replica says
//! it has reached its Envoy (by settling the bucket again). Redis keeps buckets with
//! `lua/demand.lua`; the embedded store keeps them here, with the same semantics, for a single
//! replica.

use std::collections::HashMap;
use std::sync::Mutex;

use super::StoreError;
use crate::limiter::share::{divide, settled};
use crate::limiter::{CounterIds, CounterKey, IdHasher};

/// What a settle call says of one of the replica's streams of a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// It reported: its demand is new.
    Report,
    /// As the store has it; as listed if the store lost it.
    Keep,
    /// It leaves the bucket: its grant is free at once.
    Leave,
}

/// One of the replica's streams of a bucket, as a settle call lists it.
#[derive(Clone, Copy, Debug)]
pub struct Listed<'a> {
    pub stream: &'a str,
    pub change: Change,
    /// Thousandths of a request per window.
    pub demand: u64,
    /// The most its Envoy may be enforcing, in thousandths of a request per window: what it was
    /// last sent, or more while a smaller grant sent to it may not have reached it.
    pub grant: u64,
    /// The replica had it counted in the store before: missing, its record was lost (a
    /// restarted Redis), and no grant of the bucket grows for `Settle::freeze_ms`, until every
    /// replica has listed its streams again. The embedded store loses nothing while the process
    /// lives, and does not read it.
    pub known: bool,
}

/// One replica's call to settle a bucket: its streams of it, all listed.
#[derive(Clone, Debug)]
pub struct Settle<'a> {
    /// The bucket's limit, in thousandths of a request per window.
    pub limit: u64,
    /// Whether the replica's streams may grow (not while it may be the only one to have told the
    /// store what its streams hold, after the store lost its records).
    pub grow: bool,
    /// How long a stream stays counted after its report, or after its grant moved: an
    /// assignment lives at most that long.
    pub stays_ms: u64,
    /// How long no grant of the bucket grows once a record is found lost.
    pub freeze_ms: u64,
    /// The store's time (ms) past which the call changes nothing, for its caller has given up
    /// (0: no bound): a call that reaches Redis late, held up by a reconnection, may list what
    /// its replica no longer holds. The embedded store answers every call at once.
    pub not_after_ms: u64,
    /// The store's time (ms) past which the call grows nothing (0: no bound): a call that late
    /// may have waited out a restart that emptied the store, and its `grow` be stale.
    pub grow_until_ms: u64,
    /// The server the replica last had an answer from for this bucket (`Division::server`): a
    /// call that meets another has found a restarted one, which lost what every replica's
    /// streams hold, and no grant of the bucket grows for `freeze_ms`, until every replica has
    /// listed its streams again. The embedded store is never another.
    pub heard: Option<u64>,
    pub streams: Vec<Listed<'a>>,
}

/// A bucket's streams after a settle call, and the store's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Division {
    pub now_ms: u64,
    /// The server that answered (the first 16 hex digits of a Redis run_id): another after a
    /// restart. None on the embedded store, or where Redis refuses `INFO`.
    pub server: Option<u64>,
    /// A shrink of the replica's streams is yet to reach their Envoys: once sent, the replica
    /// settles the bucket again, which frees it for the others.
    pub again: bool,
    /// When (store clock, ms) the first stream the replica did not list and that holds something
    /// stops being counted: what it holds is free then.
    pub lapse_ms: Option<u64>,
    /// Every stream counted, sorted by id.
    pub streams: Vec<Granted>,
}

/// One stream counted in a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Granted {
    pub stream: String,
    /// Thousandths of a request per window.
    pub demand: u64,
    /// Thousandths of a request per window.
    pub grant: u64,
    /// Its fair share of the limit, which its grant moves to as far as others free it.
    pub share: u64,
}

impl Granted {
    /// Nothing granted yet of a share that is not nothing: what it is to have is still held by
    /// others (a new stream, or streams of a replica that died and are still counted). Its Envoy
    /// is told nothing until it has some: it keeps the assignment it has, which is what the
    /// others' grants stand for when it reconnected from one of them.
    pub fn waiting(&self) -> bool {
        self.grant == 0 && self.share > 0
    }
}

impl Division {
    /// `stream`, if it is counted.
    pub fn of(&self, stream: &str) -> Option<&Granted> {
        self.streams
            .binary_search_by(|s| s.stream.as_str().cmp(stream))
            .ok()
            .map(|at| &self.streams[at])
    }
}

/// One stream counted in a bucket.
struct Standing {
    stream: Box<str>,
    demand: u64,
    grant: u64,
    /// At least `grant`; after a shrink, the grant before it, until the shrink reaches its Envoy.
    held: u64,
    /// When it stops being counted (ms).
    until_ms: u64,
}

/// The embedded store's buckets: per bucket, indexed by the keyed 128-bit hash of its key (as
/// the embedded store indexes counters), the streams counted, sorted by id. Most buckets have
/// one stream, so a bucket takes about a hundred bytes.
pub(crate) struct DemandBoard {
    buckets: Mutex<HashMap<u128, Vec<Standing>, IdHasher>>,
    ids: CounterIds,
    max_buckets: usize,
}

impl DemandBoard {
    /// A board for at most `max_buckets` buckets with a stream counted at once.
    pub(crate) fn new(max_buckets: usize) -> Self {
        DemandBoard {
            buckets: Mutex::default(),
            ids: CounterIds::new(),
            max_buckets,
        }
    }

    /// Settles `bucket` for one replica at `now_ms`, as `lua/demand.lua` does.
    pub(crate) fn settle(
        &self,
        bucket: &CounterKey,
        call: &Settle,
        now_ms: u64,
    ) -> Result<Division, StoreError> {
        let id = self.ids.id(bucket, 0);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !buckets.contains_key(&id) {
            if call.streams.iter().all(|s| s.change == Change::Leave) {
                return Ok(Division {
                    now_ms,
                    server: None,
                    again: false,
                    lapse_ms: None,
                    streams: Vec::new(),
                });
            }
            if buckets.len() >= self.max_buckets {
                return Err(StoreError::Full {
                    max_keys: self.max_buckets,
                });
            }
        }
        let streams = buckets.entry(id).or_insert_with(|| Vec::with_capacity(1));
        streams.retain(|s| s.until_ms > now_ms);
        let mine = record(streams, call, now_ms);
        let is_mine = |s: &Standing| mine.contains(&&*s.stream);
        let wants: Vec<u64> = streams.iter().map(|s| s.demand).collect();
        let shares = divide(call.limit, &wants);
        shrink(streams, &shares, &is_mine, call, now_ms);
        let again = grow(streams, &shares, &is_mine, call, now_ms);
        let lapse_ms = streams
            .iter()
            .filter(|s| !is_mine(s) && s.held > 0)
            .map(|s| s.until_ms)
            .min();
        let division = Division {
            now_ms,
            server: None,
            again,
            lapse_ms,
            streams: streams
                .iter()
                .zip(&shares)
                .map(|(s, &share)| Granted {
                    stream: s.stream.to_string(),
                    demand: s.demand,
                    grant: s.grant,
                    share,
                })
                .collect(),
        };
        if streams.is_empty() {
            buckets.remove(&id);
        }
        Ok(division)
    }

    /// Drops the streams that stopped reporting, and the buckets left without one.
    pub(crate) fn sweep(&self, now_ms: u64) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        buckets.retain(|_, streams| {
            streams.retain(|s| s.until_ms > now_ms);
            !streams.is_empty()
        });
    }

    /// Buckets with a stream counted.
    #[cfg(test)]
    fn buckets(&self) -> usize {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Records the streams `call` lists in `streams` (sorted by id) at `now_ms`: a report's demand, a
/// stream new to the bucket, a departure. The listed streams still counted.
fn record<'a>(streams: &mut Vec<Standing>, call: &Settle<'a>, now_ms: u64) -> Vec<&'a str> {
    let mut mine = Vec::with_capacity(call.streams.len());
    for listed in &call.streams {
        let at = streams.binary_search_by(|s| (*s.stream).cmp(listed.stream));
        let at = match (listed.change, at) {
            (Change::Leave, Ok(at)) => {
                streams.remove(at);
                continue;
            }
            (Change::Leave, Err(_)) => continue,
            (Change::Report, Ok(at)) => {
                streams[at].demand = listed.demand;
                streams[at].until_ms = now_ms + call.stays_ms;
                at
            }
            (Change::Keep, Ok(at)) => at,
            (_, Err(at)) => {
                streams.insert(
                    at,
                    Standing {
                        stream: listed.stream.into(),
                        demand: listed.demand,
                        grant: listed.grant,
                        held: listed.grant,
                        until_ms: now_ms + call.stays_ms,
                    },
                );
                at
            }
        };
        streams[at].held = streams[at].grant.max(listed.grant);
        mine.push(listed.stream);
    }
    mine
}

/// Shrinks this replica's grants above their `shares`. A grant within 2 % of its share stays,
/// unless the grants add up to more than the limit (a lowered limit), or a stream is short of its
/// share by more: then every grant above its share shrinks, so that the short one finds room.
fn shrink(
    streams: &mut [Standing],
    shares: &[u64],
    is_mine: &impl Fn(&Standing) -> bool,
    call: &Settle,
    now_ms: u64,
) {
    let over = streams.iter().map(|s| s.held).sum::<u64>() > call.limit;
    let short = streams
        .iter()
        .zip(shares)
        .any(|(s, &share)| s.grant < share && !settled(s.grant, share));
    let shrink = over || short;
    for (s, &share) in streams.iter_mut().zip(shares) {
        if is_mine(s) && s.grant > share && (shrink || !settled(s.grant, share)) {
            s.grant = share;
            s.until_ms = s.until_ms.max(now_ms + call.stays_ms);
        }
    }
}

/// Grows this replica's grants below their `shares` into what the grants held leave of the
/// limit, when `call` may grow; whether one of them still holds more than its grant (a shrink
/// that has not reached its Envoy), so that it is settled again.
fn grow(
    streams: &mut [Standing],
    shares: &[u64],
    is_mine: &impl Fn(&Standing) -> bool,
    call: &Settle,
    now_ms: u64,
) -> bool {
    let taken: u64 = streams.iter().map(|s| s.held).sum();
    let mut free = call.limit.saturating_sub(taken);
    let mut again = false;
    for (s, &share) in streams.iter_mut().zip(shares) {
        if !is_mine(s) {
            continue;
        }
        if call.grow && s.grant < share && !settled(s.grant, share) && free > 0 {
            let more = (share - s.grant).min(free);
            s.grant += more;
            s.held = s.held.max(s.grant);
            s.until_ms = s.until_ms.max(now_ms + call.stays_ms);
            free -= more;
        }
        again |= s.held > s.grant;
    }
    again
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::DescriptorKey;

    const LIMIT: u64 = 20_000;

    fn bucket(name: &str) -> CounterKey {
        DescriptorKey::new(b"d", &[(b"name", name.as_bytes())]).counter("quota")
    }

    fn settle(
        board: &DemandBoard,
        streams: &[(&'static str, Change, u64, u64)],
        now_ms: u64,
    ) -> Division {
        settle_with(board, true, streams, now_ms)
    }

    fn settle_with(
        board: &DemandBoard,
        grow: bool,
        streams: &[(&'static str, Change, u64, u64)],
        now_ms: u64,
    ) -> Division {
        let call = Settle {
            limit: LIMIT,
            grow,
            stays_ms: 15_000,
            freeze_ms: 2_000,
            not_after_ms: 0,
            grow_until_ms: 0,
            heard: None,
            streams: streams
                .iter()
                .map(|&(stream, change, demand, grant)| Listed {
                    stream,
                    change,
                    demand,
                    grant,
                    known: false,
                })
                .collect(),
        };
        board.settle(&bucket("b"), &call, now_ms).unwrap()
    }

    fn grants(division: &Division) -> Vec<(&str, u64)> {
        division
            .streams
            .iter()
            .map(|s| (s.stream.as_str(), s.grant))
            .collect()
    }

    #[test]
    fn a_grant_grows_only_once_the_shrink_that_frees_it_has_reached_its_envoy() {
        let board = DemandBoard::new(10);
        let d = settle(&board, &[("a", Change::Report, LIMIT, 0)], 0);
        assert_eq!(grants(&d), [("a", LIMIT)], "alone, all of it");
        // Another replica's stream subscribes: nothing is free yet.
        let d = settle(&board, &[("b", Change::Report, LIMIT, 0)], 10);
        assert_eq!(grants(&d), [("a", LIMIT), ("b", 0)]);
        assert!(d.of("b").unwrap().waiting(), "b's share is half");
        assert_eq!(
            d.lapse_ms,
            Some(15_000),
            "what a holds is free when a lapses"
        );
        // a's replica shrinks it; what it gave up counts until a's Envoy has it.
        let d = settle(&board, &[("a", Change::Keep, LIMIT, LIMIT)], 20);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 0)]);
        assert!(d.again);
        let d = settle(&board, &[("b", Change::Keep, LIMIT, 0)], 30);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 0)], "not free yet");
        let d = settle(&board, &[("a", Change::Keep, LIMIT, 10_000)], 40);
        assert!(!d.again);
        let d = settle(&board, &[("b", Change::Keep, LIMIT, 0)], 50);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 10_000)]);
    }

    #[test]
    fn a_limit_lowered_by_2_percent_shrinks_grants_the_keep_rule_would_keep() {
        let board = DemandBoard::new(10);
        settle(&board, &[("a", Change::Report, LIMIT, 0)], 0);
        settle(&board, &[("b", Change::Report, LIMIT, 0)], 10);
        settle(&board, &[("a", Change::Keep, LIMIT, LIMIT)], 20);
        settle(&board, &[("a", Change::Keep, LIMIT, 10_000)], 30);
        let d = settle(&board, &[("b", Change::Keep, LIMIT, 0)], 40);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 10_000)]);
        // 2 % less: each share is 9,800, within 2 % of each grant, which would stay.
        let call = Settle {
            limit: 19_600,
            grow: true,
            stays_ms: 15_000,
            freeze_ms: 2_000,
            not_after_ms: 0,
            grow_until_ms: 0,
            heard: None,
            streams: vec![
                Listed {
                    stream: "a",
                    change: Change::Keep,
                    demand: LIMIT,
                    grant: 10_000,
                    known: true,
                },
                Listed {
                    stream: "b",
                    change: Change::Keep,
                    demand: LIMIT,
                    grant: 10_000,
                    known: true,
                },
            ],
        };
        let d = board.settle(&bucket("b"), &call, 50).unwrap();
        assert_eq!(grants(&d), [("a", 9_800), ("b", 9_800)]);
    }

    #[test]
    fn a_stream_short_of_its_share_makes_a_grant_kept_above_its_own_shrink() {
        let board = DemandBoard::new(10);
        // Shares of 10,000: b holds 9,800 (short by more than 2 %), a 10,200 (within 2 % of its
        // share, which the keep rule would keep): nothing is free for b.
        settle_with(&board, false, &[("b", Change::Keep, LIMIT, 9_800)], 0);
        let d = settle_with(&board, false, &[("a", Change::Keep, LIMIT, 10_200)], 10);
        assert_eq!(
            grants(&d),
            [("a", 10_000), ("b", 9_800)],
            "a gives up what b is short of"
        );
        settle(&board, &[("a", Change::Keep, LIMIT, 10_000)], 20);
        let d = settle(&board, &[("b", Change::Keep, LIMIT, 9_800)], 30);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 10_000)]);
    }

    #[test]
    fn a_stream_that_leaves_frees_its_grant_at_once() {
        let board = DemandBoard::new(10);
        settle(&board, &[("a", Change::Report, LIMIT, 0)], 0);
        let d = settle(
            &board,
            &[("a", Change::Leave, 0, 0), ("b", Change::Report, LIMIT, 0)],
            10,
        );
        assert_eq!(grants(&d), [("b", LIMIT)]);
    }

    #[test]
    fn a_lost_record_is_listed_again_and_nothing_grows_until_every_replica_has_listed_its_own() {
        let board = DemandBoard::new(10);
        // The store lost both; b's replica lists b first, with the 12 of 20 it holds.
        let d = settle_with(&board, false, &[("b", Change::Keep, LIMIT, 12_000)], 0);
        assert_eq!(
            grants(&d),
            [("b", 12_000)],
            "alone as far as the store knows"
        );
        let d = settle_with(&board, false, &[("a", Change::Keep, LIMIT, 8_000)], 10);
        assert_eq!(grants(&d), [("a", 8_000), ("b", 12_000)]);
        let d = settle(&board, &[("b", Change::Keep, LIMIT, 12_000)], 20);
        assert_eq!(grants(&d), [("a", 8_000), ("b", 10_000)]);
        settle(&board, &[("b", Change::Keep, LIMIT, 10_000)], 30);
        let d = settle(&board, &[("a", Change::Keep, LIMIT, 8_000)], 40);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 10_000)]);
    }

    #[test]
    fn streams_that_stop_reporting_leave_the_division() {
        let board = DemandBoard::new(10);
        settle(&board, &[("a", Change::Report, 5_000, 0)], 0);
        let d = settle(&board, &[("b", Change::Report, 30_000, 0)], 16_000);
        assert_eq!(grants(&d), [("b", LIMIT)], "a went quiet 15 s ago");
        board.sweep(40_000);
        assert_eq!(board.buckets(), 0);
    }

    #[test]
    fn a_stream_sent_a_new_grant_stays_counted_as_long_as_the_grant_lives() {
        let board = DemandBoard::new(10);
        settle(&board, &[("a", Change::Report, LIMIT, 0)], 0);
        settle(&board, &[("b", Change::Report, LIMIT, 0)], 5_000);
        // a's replica shrinks it at 10 s, sending it the new grant, valid 15 s from then.
        let d = settle(&board, &[("a", Change::Keep, LIMIT, LIMIT)], 10_000);
        assert_eq!(grants(&d), [("a", 10_000), ("b", 0)]);
        let d = settle(&board, &[("b", Change::Report, LIMIT, 0)], 20_000);
        assert!(d.of("a").is_some(), "a counted until 25 s");
        // Listed again with its grant unchanged: nothing sent, not counted longer.
        settle(&board, &[("a", Change::Keep, LIMIT, 10_000)], 24_000);
        let d = settle(&board, &[("b", Change::Report, LIMIT, 0)], 25_001);
        assert_eq!(grants(&d), [("b", LIMIT)]);
    }

    #[test]
    fn a_full_board_refuses_new_buckets_but_serves_the_ones_it_has() {
        let board = DemandBoard::new(1);
        let call = |stream, change| Settle {
            limit: LIMIT,
            grow: true,
            stays_ms: 15_000,
            freeze_ms: 2_000,
            not_after_ms: 0,
            grow_until_ms: 0,
            heard: None,
            streams: vec![Listed {
                stream,
                change,
                demand: 1,
                grant: 0,
                known: false,
            }],
        };
        board
            .settle(&bucket("a"), &call("s", Change::Report), 0)
            .unwrap();
        assert_eq!(
            board.settle(&bucket("b"), &call("s", Change::Report), 0),
            Err(StoreError::Full { max_keys: 1 })
        );
        assert!(
            board
                .settle(&bucket("b"), &call("s", Change::Leave), 0)
                .is_ok()
        );
        assert!(
            board
                .settle(&bucket("a"), &call("t", Change::Report), 0)
                .is_ok()
        );
    }
}
