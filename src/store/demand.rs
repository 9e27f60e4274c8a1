//! Demand for the quota buckets of the Rate Limit Quota Service: what each stream (one Envoy)
//! last reported wanting of a bucket, kept beside every other stream's, whichever sluice replica
//! serves it, so that every replica shares a bucket's limit out from the same figures. Redis keeps
//! it with `lua/demand.lua`; the embedded store keeps it here, with the same semantics, for a
//! single replica.

use std::collections::HashMap;
use std::sync::Mutex;

use super::StoreError;
use crate::limiter::{CounterIds, CounterKey, IdHasher};

/// Every stream counted in a bucket after a report, and the store's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demands {
    pub now_ms: u64,
    /// Per stream, its id and demand (thousandths of a request per window), sorted by id.
    pub streams: Vec<(String, u64)>,
}

/// One stream's report for one bucket.
#[derive(Clone, Copy, Debug)]
pub struct Report<'a> {
    pub stream: &'a str,
    /// Thousandths of a request per window; `None` when the stream leaves the bucket.
    pub demand: Option<u64>,
    /// How long the stream stays counted without reporting again.
    pub stays_ms: u64,
}

/// One stream counted in a bucket.
struct Standing {
    stream: Box<str>,
    /// Thousandths of a request per window.
    demand: u64,
    /// When it stops being counted (ms).
    until_ms: u64,
}

/// The embedded store's demands: per bucket, indexed by the keyed 128-bit hash of its key (as
/// the embedded store indexes counters), the streams counted, sorted by id. Most buckets have
/// one stream, so a bucket takes about a hundred bytes.
pub struct DemandBoard {
    buckets: Mutex<HashMap<u128, Vec<Standing>, IdHasher>>,
    ids: CounterIds,
    max_buckets: usize,
}

impl DemandBoard {
    /// A board for at most `max_buckets` buckets with a stream counted at once.
    pub fn new(max_buckets: usize) -> Self {
        DemandBoard {
            buckets: Mutex::default(),
            ids: CounterIds::new(),
            max_buckets,
        }
    }

    /// Records `report` for `bucket` at `now_ms` and answers every stream counted in it.
    pub fn record(
        &self,
        bucket: &CounterKey,
        report: Report,
        now_ms: u64,
    ) -> Result<Demands, StoreError> {
        let id = self.ids.id(bucket, 0);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !buckets.contains_key(&id) {
            if report.demand.is_none() {
                return Ok(Demands {
                    now_ms,
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
        let at = streams.binary_search_by(|s| (*s.stream).cmp(report.stream));
        match (report.demand, at) {
            (Some(demand), Ok(at)) => {
                streams[at].demand = demand;
                streams[at].until_ms = now_ms + report.stays_ms;
            }
            (Some(demand), Err(at)) => streams.insert(
                at,
                Standing {
                    stream: report.stream.into(),
                    demand,
                    until_ms: now_ms + report.stays_ms,
                },
            ),
            (None, Ok(at)) => {
                streams.remove(at);
            }
            (None, Err(_)) => {}
        }
        let counted = streams
            .iter()
            .map(|s| (s.stream.to_string(), s.demand))
            .collect();
        if streams.is_empty() {
            buckets.remove(&id);
        }
        Ok(Demands {
            now_ms,
            streams: counted,
        })
    }

    /// Drops the streams that stopped reporting, and the buckets left without one.
    pub fn sweep(&self, now_ms: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::DescriptorKey;

    fn bucket(name: &str) -> CounterKey {
        DescriptorKey::new(b"d", &[(b"name", name.as_bytes())]).counter("rlqs")
    }

    fn report(stream: &str, demand: Option<u64>) -> Report<'_> {
        Report {
            stream,
            demand,
            stays_ms: 15_000,
        }
    }

    #[test]
    fn every_stream_is_counted_once_with_its_last_demand_until_it_leaves_or_goes_quiet() {
        let board = DemandBoard::new(10);
        let b = bucket("b");
        board.record(&b, report("s1", Some(5)), 1_000).unwrap();
        board.record(&b, report("s2", Some(7)), 2_000).unwrap();
        let d = board.record(&b, report("s1", Some(9)), 3_000).unwrap();
        assert_eq!(d.streams, [("s1".into(), 9), ("s2".into(), 7)]);
        let d = board.record(&b, report("s1", None), 4_000).unwrap();
        assert_eq!(d.streams, [("s2".into(), 7)]);
        let d = board.record(&b, report("s3", Some(1)), 17_000).unwrap();
        assert_eq!(d.streams, [("s3".into(), 1)], "s2 went quiet 15 s ago");
        board.sweep(40_000);
        assert_eq!(board.buckets(), 0);
    }

    #[test]
    fn a_full_board_refuses_new_buckets_but_serves_the_ones_it_has() {
        let board = DemandBoard::new(1);
        board.record(&bucket("a"), report("s", Some(1)), 0).unwrap();
        assert_eq!(
            board.record(&bucket("b"), report("s", Some(1)), 0),
            Err(StoreError::Full { max_keys: 1 })
        );
        assert!(board.record(&bucket("b"), report("s", None), 0).is_ok());
        assert!(board.record(&bucket("a"), report("t", Some(1)), 0).is_ok());
    }
}
