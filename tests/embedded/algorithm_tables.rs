//! Each algorithm's math on the embedded store, with a controlled clock: requests of so many hits
//! at given instants, and what the store answers (admitted, `limit_remaining`, reset).

use std::time::Duration;

use sluice_core::limiter::{
    Algorithm, Check, Counting, DescriptorKey, Item, Limit, Mode, RuleId, Unit,
};
use sluice_core::store::{MemoryStore, Percent};

/// A whole second, so that windows start at T0.
const T0: u64 = 1_700_000_000_000;

/// One request: ms after T0, hits, then what the store must answer: admitted, remaining and
/// reset in ms.
type Row = (u64, u64, bool, u64, u64);

fn limit(algorithm: Algorithm, requests_per_unit: u32, burst: u32) -> Limit {
    Limit {
        name: String::new(),
        requests_per_unit,
        unit: Unit::Second,
        unit_multiplier: 1,
        algorithm,
        burst,
        calendar: None,
    }
}

/// Runs `rows` in order against one counter of `limit` on a fresh store.
fn table(limit: Limit, rows: &[Row]) {
    let store = MemoryStore::new(1_000, Percent(100));
    let key = DescriptorKey::new(b"tables", &[(b"k", b"v")]).counter(limit.algorithm.name());
    for (i, &(at, hits, admitted, remaining, reset)) in rows.iter().enumerate() {
        let check = Check {
            items: vec![Item {
                key: key.clone(),
                rule: RuleId::default(),
                limit: limit.clone(),
                mode: Mode::Enforce,
                hits,
                refund: false,
                counting: Counting::Admitted,
                leased: false,
                scope: Default::default(),
                step: sluice_core::limiter::ItemStep::Hits,
            }],
            ..Check::default()
        };
        let decision = store.apply_at(&check, T0 + at).unwrap();
        let usage = decision.usages[0];
        assert_eq!(
            (decision.admitted, usage.remaining, usage.reset),
            (admitted, remaining, Duration::from_millis(reset)),
            "{}: row {i}, {hits} hit(s) at {at} ms",
            limit.algorithm.name()
        );
    }
}

#[test]
fn a_fixed_window_counts_until_its_window_ends() {
    table(
        limit(Algorithm::FixedWindow, 3, 3),
        &[
            (0, 1, true, 2, 1_000),
            (300, 2, true, 0, 700),
            (500, 1, false, 0, 500),
            (999, 0, false, 0, 1),
            (1_000, 3, true, 0, 1_000),
            (1_500, 1, false, 0, 500),
        ],
    );
}

#[test]
fn a_sliding_window_weighs_the_window_before_and_names_the_first_millisecond_that_fits() {
    table(
        limit(Algorithm::SlidingWindow, 4, 4),
        &[
            (0, 4, true, 0, 1_000),
            (500, 1, false, 0, 501),
            // 250 ms into the next window the 4 before still weigh floor(4 × 0.75) = 3.
            (1_250, 1, true, 0, 750),
            (1_250, 1, false, 0, 1),
            (1_251, 1, true, 0, 749),
        ],
    );
}

#[test]
fn a_sliding_log_holds_the_limit_in_every_window_ending_now() {
    table(
        limit(Algorithm::SlidingLog, 3, 3),
        &[
            (0, 1, true, 2, 1_000),
            (400, 2, true, 0, 1_000),
            (700, 1, false, 0, 300),
            (999, 1, false, 0, 1),
            (1_000, 1, true, 0, 1_000),
            (1_399, 1, false, 0, 1),
            (1_400, 2, true, 0, 1_000),
            (1_400, 0, false, 0, 600),
            (5_000, 0, true, 3, 0),
        ],
    );
}

#[test]
fn a_token_bucket_admits_its_burst_then_refills_at_the_rate() {
    table(
        limit(Algorithm::TokenBucket, 10, 10),
        &[
            (0, 1, true, 9, 100),
            (0, 8, true, 1, 900),
            (0, 1, true, 0, 1_000),
            (0, 1, false, 0, 100),
            (50, 1, false, 0, 50),
            (100, 1, true, 0, 1_000),
            (350, 2, true, 0, 950),
            (2_000, 0, true, 10, 0),
            (2_000, 11, false, 0, 1_000),
        ],
    );
}

#[test]
fn a_leaky_bucket_of_burst_one_spaces_hits_evenly() {
    table(
        limit(Algorithm::LeakyBucket, 2, 1),
        &[
            (0, 1, true, 0, 500),
            (200, 1, false, 0, 300),
            (500, 1, true, 0, 500),
            (600, 0, false, 0, 400),
            (2_000, 0, true, 1, 0),
        ],
    );
}
