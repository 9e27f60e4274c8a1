//! Any limit divided among any demands: the shares add up to the limit exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::limiter::share::divide;
use sluice::quota::MILLI;

fuzz_target!(|input: (u32, Vec<u64>)| {
    let (limit, demands) = input;
    let limit = u64::from(limit) * MILLI;
    let shares = divide(limit, &demands);
    assert_eq!(shares.len(), demands.len());
    if !demands.is_empty() {
        assert_eq!(shares.iter().sum::<u64>(), limit);
    }
});
