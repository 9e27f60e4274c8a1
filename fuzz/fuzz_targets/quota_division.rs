//! Any limit divided among any demands: the shares add up to the limit exactly while a demand is
//! not 0, and a demand of 0 gets the least share.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::limiter::share::divide;
use sluice::quota::MILLI;

fuzz_target!(|input: (u32, Vec<u64>)| {
    let (limit, demands) = input;
    let limit = u64::from(limit) * MILLI;
    let shares = divide(limit, &demands);
    assert_eq!(shares.len(), demands.len());
    let least = if limit >= demands.len() as u64 * MILLI {
        MILLI
    } else {
        0
    };
    if demands.iter().any(|&d| d > 0) {
        assert_eq!(shares.iter().sum::<u64>(), limit);
    }
    for (share, demand) in shares.iter().zip(&demands) {
        assert!(*share >= least);
        if *demand == 0 {
            assert_eq!(*share, least);
        }
    }
});
