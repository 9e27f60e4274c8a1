//! Any bytes as a rule file: parsed into rules that build a rule set, or refused with errors
//! that each name a line of the file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sluice::config;
use sluice::rules::RuleSet;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match config::parse(Path::new("fuzz.yaml"), text) {
        Ok((domain, _)) => {
            RuleSet::new(vec![domain]);
        }
        Err(errors) => {
            assert!(!errors.is_empty());
            assert!(errors.iter().all(|e| e.line >= 1), "{errors:?}");
        }
    }
});
