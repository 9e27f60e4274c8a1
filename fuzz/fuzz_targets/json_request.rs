//! Any body of `/json` and `/explain`: decoded and explained, or refused with a message.
#![no_main]

mod rules;

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use rules::RULE_SET;
use sluice::service::explain::{Request, explain};
use sluice::service::rls::{Answering, Bounds};

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
