//! The rules the request targets plan against, loaded once.

use std::path::Path;
use std::sync::LazyLock;

use sluice::config;
use sluice::rules::RuleSet;

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

pub static RULE_SET: LazyLock<RuleSet> = LazyLock::new(|| {
    let (domain, _) = config::parse(Path::new("rules.yaml"), RULES).expect("valid rules");
    RuleSet::new(vec![domain])
});
