//! Any descriptors, hits and limit overrides, planned by the rules and decided by the embedded
//! store: decided all or nothing (`tests/fuzz/planned.rs`, shared with the stable suite).
#![no_main]

#[path = "../../tests/fuzz/planned.rs"]
mod planned;

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sluice::config;
use sluice::limiter::Unit;
use sluice::rules::RuleSet;
use sluice::store::{MemoryStore, Percent};

const RULES: &str = "domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value: /a*
    rate_limit: {unit: day, requests_per_unit: 5, algorithm: sliding_log}
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 3, algorithm: token_bucket}
";

static RULE_SET: LazyLock<RuleSet> = LazyLock::new(|| {
    let (domain, _) = config::parse(Path::new("rules.yaml"), RULES).expect("valid rules");
    RuleSet::new(vec![domain])
});
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
