//! Any body of `/json` and `/explain`: decoded and explained, or refused with a message.
#![no_main]

use std::path::Path;
use std::sync::LazyLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sluice::config;
use sluice::rules::RuleSet;
use sluice::service::explain::{Request, explain};
use sluice::service::rls::{Answering, Bounds};

const RULES: &str = "domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value: /a*
    rate_limit: {unit: day, requests_per_unit: 5, algorithm: sliding_log}
";

static RULE_SET: LazyLock<RuleSet> = LazyLock::new(|| {
    let (domain, _) = config::parse(Path::new("rules.yaml"), RULES).expect("valid rules");
    RuleSet::new(vec![domain])
});

fuzz_target!(|body: &[u8]| {
    let bounds = Bounds {
        max_descriptors: 64,
        max_entries: 32,
        max_schedule_ahead: Duration::from_secs(31 * 86_400),
    };
    match Request::from_json(body) {
        Ok(request) => match explain(&RULE_SET, &request, &bounds, &Answering::default(), None) {
            Ok(explanation) => {
                serde_json::from_str::<serde_json::Value>(&explanation.to_json())
                    .expect("an explanation is JSON");
            }
            Err(message) => assert!(!message.is_empty()),
        },
        Err(message) => assert!(!message.is_empty()),
    }
});
