//! Generated inputs against every edge that reads what others write: rule files, requests, xDS
//! resources, quota reports, what Redis holds and envoyproxy/ratelimit's environment. Each property runs a fixed
//! number of cases from a fixed seed, and stops early at its time budget, so a run is repeatable
//! and bounded; `fuzz/` holds `cargo fuzz` targets on the same entry points for longer runs.

mod erl_env;
mod matching;
mod planned;
mod quota;
mod requests;
mod rule_files;
mod store_data;
mod xds;

use std::fmt::Debug;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, RngSeed, TestCaseError, TestRunner};

/// The seed every property starts from: a failure seen once is seen on every run.
/// `SLUICE_FUZZ_SEED` replaces it, to explore other cases.
const SEED: u64 = 0x005e_ed51;
/// The most time spent shrinking a failing case to a smaller one.
const SHRINKING: Duration = Duration::from_secs(20);

/// Runs `property` on `cases` values of `strategy`, or on as many as `budget` leaves time for,
/// and fails with the smallest failing value it finds (panics count as failures).
/// `SLUICE_FUZZ_SCALE=N` multiplies both, for a longer run.
pub fn fuzz<S: Strategy>(
    name: &str,
    cases: u32,
    budget: Duration,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: Debug,
{
    let setting = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| v.parse::<u64>().expect(name))
    };
    let scale = setting("SLUICE_FUZZ_SCALE").unwrap_or(1);
    let cases = cases.saturating_mul(u32::try_from(scale).unwrap_or(u32::MAX));
    let budget = budget.saturating_mul(u32::try_from(scale).unwrap_or(u32::MAX));
    let config = Config {
        failure_persistence: None,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(setting("SLUICE_FUZZ_SEED").unwrap_or(SEED)),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let fails = |value| match catch_unwind(AssertUnwindSafe(|| property(value))) {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(panic) => Some(
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into()),
        ),
    };
    let started = Instant::now();
    let mut ran = 0;
    while ran < cases && started.elapsed() < budget {
        let mut tree = strategy.new_tree(&mut runner).expect("a value");
        ran += 1;
        let Some(mut failure) = fails(tree.current()) else {
            continue;
        };
        let mut smallest = tree.current();
        // proptest's own search: simplify while it still fails, complicate back when it passes.
        let shrinking = Instant::now();
        let mut simpler = tree.simplify();
        while simpler && shrinking.elapsed() < SHRINKING {
            match fails(tree.current()) {
                Some(e) => {
                    failure = e;
                    smallest = tree.current();
                    simpler = tree.simplify();
                }
                None => simpler = tree.complicate(),
            }
        }
        panic!("{name}: case {ran} fails: {failure}\nsmallest failing input: {smallest:#?}");
    }
    eprintln!(
        "{name}: {ran} case(s) of {cases} in {:.1?}",
        started.elapsed()
    );
}
