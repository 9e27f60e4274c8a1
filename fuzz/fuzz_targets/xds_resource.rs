//! Any bytes as an xDS `RateLimitConfig` resource: converted into rules, or rejected with
//! errors naming it.
#![no_main]

use envoy_types::pb::google::protobuf::Any;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use sluice::xds::{TYPE_URL, convert};
use sluice::rules::RuleSet;

fuzz_target!(|data: &[u8]| {
    let digest = Sha256::digest(data).into();
    let resource = Any {
        type_url: TYPE_URL.into(),
        value: data.to_vec(),
    };
    match convert(vec![resource], &[digest], false) {
        Ok(loaded) => {
            RuleSet::new(loaded.domains);
        }
        Err(rejection) => assert!(rejection.summary().contains("xds:")),
    }
});
