//! Counter identities. A `CounterKey` encodes (domain, descriptor entries, limit identity) so that
//! different inputs never share a counter, whatever bytes their keys and values contain.

use std::fmt;

/// The identity of one counter: every field length-prefixed (`<len>:<bytes>`), so the encoding
/// can be read back unambiguously and is therefore injective. The descriptor part (domain and
/// entries) comes first; the stores may use it alone to keep one descriptor's counters together.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CounterKey {
    bytes: Box<[u8]>,
    descriptor_len: usize,
}

impl CounterKey {
    pub fn new(domain: &str, entries: &[(&str, &str)], limit: &str) -> Self {
        let mut bytes = Vec::with_capacity(
            16 + domain.len()
                + limit.len()
                + entries
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 8)
                    .sum::<usize>(),
        );
        push_field(&mut bytes, domain.as_bytes());
        push_field(&mut bytes, entries.len().to_string().as_bytes());
        for (key, value) in entries {
            push_field(&mut bytes, key.as_bytes());
            push_field(&mut bytes, value.as_bytes());
        }
        let descriptor_len = bytes.len();
        push_field(&mut bytes, limit.as_bytes());
        CounterKey {
            bytes: bytes.into_boxed_slice(),
            descriptor_len,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The part that names the descriptor, shared by all of its limits.
    pub fn descriptor(&self) -> &[u8] {
        &self.bytes[..self.descriptor_len]
    }
}

fn push_field(out: &mut Vec<u8>, field: &[u8]) {
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

    #[test]
    fn joined_strings_do_not_collide() {
        let a = CounterKey::new("d", &[("a_b", "c")], "l");
        let b = CounterKey::new("d", &[("a", "b_c")], "l");
        assert_ne!(a, b);
    }

    #[test]
    fn entry_boundaries_do_not_collide() {
        let one = CounterKey::new("d", &[("k", "v"), ("k2", "")], "l");
        let two = CounterKey::new("d", &[("k", "v")], "2:k20:");
        assert_ne!(one, two);
        let tricky = CounterKey::new("d", &[("k", "1:v")], "l");
        let plain = CounterKey::new("d", &[("k", "")], "1:v1:l");
        assert_ne!(tricky, plain);
    }

    #[test]
    fn special_bytes_are_kept_apart() {
        let values = ["", "{", "}", ":", "\n", " ", "a:b", "{x}"];
        let keys: std::collections::HashSet<_> = values
            .iter()
            .map(|v| CounterKey::new("d", &[("k", v)], "l"))
            .collect();
        assert_eq!(keys.len(), values.len());
    }

    #[test]
    fn limits_of_one_descriptor_share_the_descriptor_part() {
        let a = CounterKey::new("d", &[("k", "v")], "fixed_window:second:1");
        let b = CounterKey::new("d", &[("k", "v")], "sliding_window:hour:1");
        assert_ne!(a, b);
        assert_eq!(a.descriptor(), b.descriptor());
    }
}
