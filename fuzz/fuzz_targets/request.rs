//! Any descriptors, hits and limit overrides, planned by the rules and decided by the embedded
//! store: decided all or nothing (`tests/fuzz/planned.rs`, shared with the stable suite).
#![no_main]

mod rules;

#[path = "../../tests/fuzz/planned.rs"]
mod planned;

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use rules::RULE_SET;
use sluice::limiter::Unit;
use sluice::store::{MemoryStore, Percent};

static STORE: LazyLock<MemoryStore> = LazyLock::new(|| MemoryStore::new(10_000, Percent(50)));

type Descriptor = (Vec<(Vec<u8>, Vec<u8>)>, u64, bool, Option<(u32, u8)>);

fuzz_target!(|input: (Vec<u8>, Vec<Descriptor>)| {
    let (domain, descriptors) = input;
    let units = ["second", "minute", "hour", "day", "week", "month", "year"];
    let descriptors: Vec<planned::Planned> = descriptors
        .into_iter()
        .map(|(entries, hits, refund, limit)| {
            let limit = limit.and_then(|(n, u)| Some((n, Unit::parse(units[usize::from(u) % 7])?)));
            (entries, hits.min(1 << 32), refund, limit)
        })
        .collect();
    if let Err(e) = planned::all_or_nothing(&RULE_SET, &STORE, &domain, &descriptors) {
        panic!("{e}");
    }
});
