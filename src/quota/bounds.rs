//! The bounds of what the quota service tracks and does: buckets and streams per process and
//! per client (an address), the paces of demand records and bucket reports, and the bound a
//! bucket answered untracked was past.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::ONE_SECOND;

/// A process-wide allowance of things tracked: streams or buckets, at most `most` at once.
pub(super) struct Allowance {
    pub(super) most: usize,
    pub(super) taken: AtomicUsize,
}

impl Allowance {
    pub(super) fn new(most: usize) -> Self {
        Allowance {
            most,
            taken: AtomicUsize::new(0),
        }
    }

    /// Takes one, if one is left.
    pub(super) fn take(&self) -> bool {
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.most).then_some(n + 1)
            })
            .is_ok()
    }

    pub(super) fn give_back(&self, n: usize) {
        self.taken.fetch_sub(n, Ordering::AcqRel);
    }

    pub(super) fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }
}

/// What each client has tracked, within its budgets (`--quota-max-buckets-per-client`,
/// `--quota-max-streams-per-client`). A client is known while it has a stream counted: at most
/// `--quota-max-streams` of them.
pub(super) struct Clients {
    pub(super) most_buckets: usize,
    pub(super) most_streams: usize,
    pub(super) by_address: Mutex<HashMap<IpAddr, Tracking>>,
}

/// What one client has tracked.
#[derive(Default)]
pub(super) struct Tracking {
    pub(super) streams: usize,
    pub(super) buckets: usize,
}

impl Clients {
    pub(super) fn by_address(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Tracking>> {
        self.by_address.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a stream of `client`, if its budget has one left.
    pub(super) fn take_stream(&self, client: IpAddr) -> bool {
        let mut by_address = self.by_address();
        let tracking = by_address.entry(client).or_default();
        let taken = tracking.streams < self.most_streams;
        tracking.streams += usize::from(taken);
        if tracking.streams == 0 && tracking.buckets == 0 {
            by_address.remove(&client);
        }
        taken
    }

    /// Takes a bucket of `client` (which has a stream counted), if its budget has one left.
    pub(super) fn take_bucket(&self, client: IpAddr) -> bool {
        let mut by_address = self.by_address();
        let tracking = by_address.entry(client).or_default();
        let taken = tracking.buckets < self.most_buckets;
        tracking.buckets += usize::from(taken);
        taken
    }

    /// Gives back `streams` streams and `buckets` buckets of `client`.
    pub(super) fn give_back(&self, client: IpAddr, streams: usize, buckets: usize) {
        let mut by_address = self.by_address();
        if let Some(tracking) = by_address.get_mut(&client) {
            tracking.streams = tracking.streams.saturating_sub(streams);
            tracking.buckets = tracking.buckets.saturating_sub(buckets);
            if tracking.streams == 0 && tracking.buckets == 0 {
                by_address.remove(&client);
            }
        }
    }
}

/// The client a stream's budget is kept under: its address, an IPv4 one mapped into IPv6 as
/// itself, and an IPv6 one by its /64 (what one host is usually given).
pub(super) fn client_of(peer: Option<IpAddr>) -> IpAddr {
    match peer {
        Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        },
        Some(v4) => v4,
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// A pace of so many a second, at most a second's worth at once: the demand records a replica
/// may send (`--quota-max-records`), and the bucket reports its streams may take
/// (`--quota-max-reports`). It keeps when what was taken so far is paid for at that pace.
pub(super) struct Pace {
    pub(super) each: Duration,
    paid_until: Mutex<Instant>,
}

impl Pace {
    pub(super) fn new(per_second: u32) -> Self {
        Pace {
            each: Duration::from_secs(1) / per_second.max(1),
            paid_until: Mutex::new(Instant::now()),
        }
    }

    /// Takes `n`: when that puts the pace more than a second's worth ahead, the instant to wait
    /// for before using them.
    pub(super) fn take(&self, n: usize) -> Option<Instant> {
        let mut paid = self.paid_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        *paid = (*paid).max(now) + self.each * u32::try_from(n).unwrap_or(u32::MAX);
        (*paid > now + ONE_SECOND).then(|| *paid - ONE_SECOND)
    }

    /// Takes one, if it is within a second's worth ahead; with `must`, takes it anyway (a record
    /// that would otherwise lapse), owing at most another second's worth.
    pub(super) fn try_take(&self, must: bool) -> bool {
        let mut paid = self.paid_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let next = (*paid).max(now) + self.each;
        let taken = must || next <= now + ONE_SECOND;
        if taken {
            *paid = next.min(now + 2 * ONE_SECOND);
        }
        taken
    }
}

/// The bound that was full when a bucket was answered untracked, as the metrics name it.
#[derive(Clone, Copy)]
pub(super) enum FullBound {
    /// The stream's own (`MOST_BUCKETS_PER_STREAM`, `MOST_BUCKET_BYTES_PER_STREAM`).
    StreamBuckets,
    /// `--quota-max-buckets-per-client`.
    ClientBuckets,
    /// `--quota-max-streams-per-client`.
    ClientStreams,
    /// `--quota-max-buckets`.
    Buckets,
    /// `--quota-max-streams`.
    Streams,
}

impl FullBound {
    pub(super) const ALL: [FullBound; 5] = [
        FullBound::StreamBuckets,
        FullBound::ClientBuckets,
        FullBound::ClientStreams,
        FullBound::Buckets,
        FullBound::Streams,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            FullBound::StreamBuckets => "stream_buckets",
            FullBound::ClientBuckets => "client_buckets",
            FullBound::ClientStreams => "client_streams",
            FullBound::Buckets => "buckets",
            FullBound::Streams => "streams",
        }
    }

    /// Its name in the log.
    pub(super) fn described(self) -> &'static str {
        match self {
            FullBound::StreamBuckets => "the stream's bound (10,000 buckets, 16 MiB of bucket ids)",
            FullBound::ClientBuckets => "--quota-max-buckets-per-client",
            FullBound::ClientStreams => "--quota-max-streams-per-client",
            FullBound::Buckets => "--quota-max-buckets",
            FullBound::Streams => "--quota-max-streams",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_gives_a_seconds_worth_at_once_and_must_owes_at_most_another() {
        let pace = Pace::new(1);
        assert!(pace.try_take(false), "a second's worth at once");
        assert!(!pace.try_take(false), "then nothing until it is paid for");
        assert!(pace.try_take(true), "a record that must go is taken");
        assert!(pace.try_take(true), "and another");
        let wait = pace.take(0).expect("two seconds ahead of its pace");
        assert!(
            wait <= Instant::now() + ONE_SECOND,
            "owing a second at most"
        );
    }

    #[test]
    fn reports_past_a_seconds_worth_wait_for_their_turn() {
        let start = Instant::now();
        let pace = Pace::new(1000);
        assert_eq!(pace.take(1000), None, "a second's worth at once");
        let at = pace.take(500).expect("half a second past it");
        let half = Duration::from_millis(500);
        assert!(at >= start + half && at <= Instant::now() + half);
    }
}
