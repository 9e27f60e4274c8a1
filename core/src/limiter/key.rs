//! Counter identities. A `CounterKey` encodes (domain, descriptor entries, limit identity) so that
//! different inputs never share a counter, whatever bytes their keys and values contain and
//! however long they are. A `RuleId` names the rule a counter belongs to.

use std::fmt;
use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};

use sha2::{Digest, Sha256};
use siphasher::sip::SipHasher13 as SipHasher64;
use siphasher::sip128::{Hasher128, SipHasher13};

/// Keys, values and domains longer than this many bytes count under their SHA-256 digest, so
/// that no request can make a counter's identity (and its Redis key) longer than about
/// `LONGEST_LITERAL` bytes per field.
pub const LONGEST_LITERAL: usize = 128;

/// The identity of one counter. Every field is either its bytes, length-prefixed
/// (`<len>:<bytes>`), or, above `LONGEST_LITERAL` bytes, `#` and the 64 hex digits of its SHA-256
/// (no length starts with `#`). The encoding can be read back unambiguously, so it is injective
/// up to SHA-256 collisions. The descriptor part (domain and entries) comes first; the stores may
/// use it alone to keep one descriptor's counters together.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CounterKey {
    bytes: Box<[u8]>,
    descriptor_len: usize,
}

impl CounterKey {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The part that names the descriptor, shared by all of its limits.
    pub(crate) fn descriptor(&self) -> &[u8] {
        &self.bytes[..self.descriptor_len]
    }
}

/// The descriptor part of a `CounterKey` (domain and entries), encoded once for all of the
/// descriptor's limits: a long value is digested once, not once per limit.
pub struct DescriptorKey(Vec<u8>);

impl DescriptorKey {
    pub fn new(domain: &[u8], entries: &[(&[u8], &[u8])]) -> Self {
        let field_len = |f: &[u8]| f.len().min(LONGEST_LITERAL) + 8;
        let mut bytes = Vec::with_capacity(
            16 + field_len(domain)
                + entries
                    .iter()
                    .map(|(k, v)| field_len(k) + field_len(v))
                    .sum::<usize>(),
        );
        push_field(&mut bytes, domain);
        push_field(&mut bytes, entries.len().to_string().as_bytes());
        for (key, value) in entries {
            push_field(&mut bytes, key);
            push_field(&mut bytes, value);
        }
        DescriptorKey(bytes)
    }

    /// The counter of this descriptor under the limit identity `limit`.
    pub fn counter(&self, limit: &str) -> CounterKey {
        let mut bytes = Vec::with_capacity(self.0.len() + limit.len() + 8);
        bytes.extend_from_slice(&self.0);
        push_field(&mut bytes, limit.as_bytes());
        CounterKey {
            bytes: bytes.into_boxed_slice(),
            descriptor_len: self.0.len(),
        }
    }
}

fn push_field(out: &mut Vec<u8>, field: &[u8]) {
    if field.len() > LONGEST_LITERAL {
        let mut digest = String::with_capacity(65);
        digest.push('#');
        for b in Sha256::digest(field) {
            write!(digest, "{b:02x}").expect("writing to a String succeeds");
        }
        out.extend_from_slice(digest.as_bytes());
        return;
    }
    out.extend_from_slice(field.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(field);
}

impl fmt::Debug for CounterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CounterKey({:?})", String::from_utf8_lossy(&self.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(entries: &[(&str, &str)], limit: &str) -> CounterKey {
        let entries: Vec<(&[u8], &[u8])> = entries
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        DescriptorKey::new(b"d", &entries).counter(limit)
    }

    #[test]
    fn joined_strings_do_not_collide() {
        assert_ne!(key(&[("a_b", "c")], "l"), key(&[("a", "b_c")], "l"));
    }

    #[test]
    fn entry_boundaries_do_not_collide() {
        let one = key(&[("k", "v"), ("k2", "")], "l");
        let two = key(&[("k", "v")], "2:k20:");
        assert_ne!(one, two);
        let tricky = key(&[("k", "1:v")], "l");
        let plain = key(&[("k", "")], "1:v1:l");
        assert_ne!(tricky, plain);
    }

    #[test]
    fn special_bytes_are_kept_apart() {
        let values: [&[u8]; 10] = [
            b"",
            b"{",
            b"}",
            b":",
            b"\n",
            b" ",
            b"a:b",
            b"{x}",
            b"\xff",
            b"\xfe\xff",
        ];
        let keys: std::collections::HashSet<_> = values
            .iter()
            .map(|v| DescriptorKey::new(b"d", &[(b"k", v)]).counter("l"))
            .collect();
        assert_eq!(keys.len(), values.len());
    }

    #[test]
    fn limits_of_one_descriptor_share_the_descriptor_part() {
        let a = key(&[("k", "v")], "fixed_window:second:1");
        let b = key(&[("k", "v")], "sliding_window:hour:1");
        assert_ne!(a, b);
        assert_eq!(a.descriptor(), b.descriptor());
    }

    #[test]
    fn long_values_count_under_a_bounded_digest() {
        let long = "x".repeat(40 * 1024);
        let mut other = long.clone();
        other.pop();
        other.push('y');
        let a = key(&[("k", &long)], "l");
        let b = key(&[("k", &other)], "l");
        assert_ne!(a, b, "values differing in their last byte count apart");
        assert_eq!(
            a,
            key(&[("k", &long)], "l"),
            "the same value, the same counter"
        );
        assert!(a.as_bytes().len() < 100, "{a:?}");
    }

    #[test]
    fn a_digest_never_equals_a_literal_value() {
        let long = "v".repeat(LONGEST_LITERAL + 1);
        let digested = key(&[("k", &long)], "l");
        let text = String::from_utf8_lossy(digested.as_bytes()).into_owned();
        let digest = text
            .split("1:k")
            .nth(1)
            .and_then(|rest| rest.strip_suffix("1:l"))
            .expect("the digest sits between the key and the limit")
            .to_owned();
        assert!(digest.starts_with('#'));
        assert_ne!(digested, key(&[("k", &digest)], "l"));
        let at_bound = "v".repeat(LONGEST_LITERAL);
        assert!(
            String::from_utf8_lossy(key(&[("k", &at_bound)], "l").as_bytes()).contains(&at_bound),
            "a value of exactly the bound is kept as it is"
        );
    }
}

/// The rule a counter belongs to, which the embedded store gives a share of its counters: a hash
/// of the domain and the rule's path (`key_value.key…`), the same across reloads so that a rule
/// keeps its count. Rule paths come from rule files, not from requests, so the hash needs no key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RuleId(u64);

impl RuleId {
    pub(crate) fn of(domain: &[u8], path: &[u8]) -> RuleId {
        let mut h = SipHasher64::new();
        h.write_usize(domain.len());
        h.write(domain);
        h.write(path);
        RuleId(h.finish())
    }

    pub(crate) fn bits(self) -> u64 {
        self.0
    }
}

/// Keyed 128-bit ids of counters (SipHash-1-3 with keys chosen at random per process): no input
/// can make two counters collide, and a billion of them collide by chance with a probability
/// under 10⁻²⁰.
pub struct CounterIds {
    keys: (u64, u64),
}

impl CounterIds {
    pub fn new() -> Self {
        CounterIds {
            keys: (
                std::hash::RandomState::new().hash_one(0u8),
                std::hash::RandomState::new().hash_one(1u8),
            ),
        }
    }

    /// The id of `key`, told apart further by `salt`.
    pub fn id(&self, key: &CounterKey, salt: u64) -> u128 {
        self.salted_id_of_bytes(key.as_bytes(), salt)
    }

    /// The id of the key whose bytes are `key`, told apart further by `salt`.
    pub fn salted_id_of_bytes(&self, key: &[u8], salt: u64) -> u128 {
        let mut h = SipHasher13::new_with_keys(self.keys.0, self.keys.1);
        h.write(key);
        if salt != 0 {
            h.write_u64(salt);
        }
        h.finish128().as_u128()
    }

    /// The id (unsalted) of the key whose bytes are `key`, as the store names it.
    pub fn id_of_bytes(&self, key: &[u8]) -> u128 {
        self.salted_id_of_bytes(key, 0)
    }
}

impl Default for CounterIds {
    fn default() -> Self {
        CounterIds::new()
    }
}

/// Hashes a map of counter ids by their own bits: they are uniform hashes already.
#[derive(Clone, Copy, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }

    fn write_u128(&mut self, id: u128) {
        self.0 = id as u64;
    }
}

impl BuildHasher for IdHasher {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}
