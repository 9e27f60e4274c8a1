//! ACK or NACK: each response judged once, the resources already seen (in force, or rejected
//! last) recognised by their digest and not converted again.

use std::sync::{Mutex, PoisonError};

use envoy_types::pb::google::protobuf::Any;
use sha2::{Digest as _, Sha256};

use sluice_core::config::Loaded;

use super::Digest;
use super::convert::{Rejection, convert};

/// What one xDS response turned out to be, as `apply` sees it (on a thread of its own).
pub enum Snapshot<'a> {
    /// Valid rules, to put in force (then ACKed).
    Valid { version: &'a str, rules: Loaded },
    /// The very resources of the rules in force: ACKed without converting them again.
    Unchanged { version: &'a str },
    /// Rejected (then NACKed); `again` when these are the resources rejected last, recognised
    /// without converting them again.
    Rejected {
        version: &'a str,
        rejection: &'a Rejection,
        again: bool,
    },
}

/// What the subscription has seen, by the digest of a response's resources (`snapshot_digest`).
#[derive(Default)]
pub(super) struct SeenResources {
    /// The resources of the last valid response: those of the rules in force.
    in_force: Option<Digest>,
    /// The last rejected resources, and why.
    rejected: Option<(Digest, Rejection)>,
}

/// Turns responses into rules and hands them to `apply`, one at a time, on a thread of its own.
pub(super) struct Judge {
    pub(super) merge_domains: bool,
    pub(super) seen: Mutex<SeenResources>,
    pub(super) apply: Box<dyn Fn(Snapshot) + Send + Sync>,
}

impl Judge {
    /// Judges the resources of one response and hands the outcome to `apply`; `None` to ACK,
    /// else the NACK's message. Resources already seen, in force or rejected last, are
    /// recognised by their digest and not converted again.
    pub(super) fn judge(&self, version: &str, resources: Vec<Any>) -> Option<String> {
        let digests: Vec<Digest> = resources
            .iter()
            .map(|r| Sha256::digest(&r.value).into())
            .collect();
        let digest = snapshot_digest(&resources, &digests);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.in_force == Some(digest) {
            (self.apply)(Snapshot::Unchanged { version });
            return None;
        }
        if let Some((rejected, rejection)) = &seen.rejected
            && *rejected == digest
        {
            (self.apply)(Snapshot::Rejected {
                version,
                rejection,
                again: true,
            });
            return Some(rejection.message());
        }
        match convert(resources, &digests, self.merge_domains) {
            Ok(rules) => {
                (self.apply)(Snapshot::Valid { version, rules });
                seen.in_force = Some(digest);
                None
            }
            Err(rejection) => {
                (self.apply)(Snapshot::Rejected {
                    version,
                    rejection: &rejection,
                    again: false,
                });
                let message = rejection.message();
                seen.rejected = Some((digest, rejection));
                Some(message)
            }
        }
    }
}

/// One digest for every resource of a response, in order: each one's type and the digest of
/// its bytes.
fn snapshot_digest(resources: &[Any], digests: &[Digest]) -> Digest {
    let mut h = Sha256::new();
    for (r, digest) in resources.iter().zip(digests) {
        h.update((r.type_url.len() as u64).to_le_bytes());
        h.update(r.type_url.as_bytes());
        h.update(digest);
    }
    h.finalize().into()
}
