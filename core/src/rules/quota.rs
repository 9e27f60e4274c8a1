//! Quota bucket rules of the Rate Limit Quota Service. A bucket id, a map of keys to values, is
//! matched the way a descriptor is: its keys in sorted order, each by its exact value, then the
//! first `*` pattern of that key in file order, then the key alone; the rule is that of the node
//! matched by the last key. Values are bytes, as Envoy takes them from request headers.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Branches, Pattern};
use crate::config::{QuotaBucketConfig, quota_path};
use crate::limiter::Limit;

/// What a matched bucket gets.
#[derive(Debug)]
pub struct QuotaRule {
    /// The rule's name in metrics: its keys as `key_value` (or `key`) joined by dots.
    pub path: String,
    /// The global limit shared out among the Envoys; `None` for `unlimited`.
    pub limit: Option<Limit>,
    /// Allow all and record what the limit would have denied.
    pub shadow: bool,
}

/// One domain's quota bucket rules.
#[derive(Default)]
pub(super) struct QuotaLevel {
    by_key: HashMap<String, Branches<QuotaNode>>,
    /// Where each (key, pattern) sits in its key's `patterns`, so that adding a rule never
    /// scans them.
    pattern_at: HashMap<(String, String), usize>,
}

#[derive(Default)]
struct QuotaNode {
    rule: Option<Arc<QuotaRule>>,
    children: QuotaLevel,
}

impl QuotaLevel {
    /// Adds a rule; a second rule for the same bucket pattern (domains merged across files)
    /// leaves the first in force.
    pub(super) fn add(&mut self, config: &QuotaBucketConfig) {
        let mut level = self;
        for (at, (key, value)) in config.bucket.iter().enumerate() {
            let branches = level.by_key.entry(key.clone()).or_default();
            let node = match value {
                None => branches.any.get_or_insert_with(Box::default).as_mut(),
                Some(v) if v.contains('*') => {
                    let at = *level
                        .pattern_at
                        .entry((key.clone(), v.clone()))
                        .or_insert_with(|| {
                            branches
                                .patterns
                                .push((Pattern::new(v), QuotaNode::default()));
                            branches.patterns.len() - 1
                        });
                    &mut branches.patterns[at].1
                }
                Some(v) => branches.exact.entry(v.as_bytes().into()).or_default(),
            };
            if at + 1 == config.bucket.len() {
                node.rule.get_or_insert_with(|| {
                    Arc::new(QuotaRule {
                        path: quota_path(&config.bucket),
                        limit: config.limit.clone(),
                        shadow: config.shadow,
                    })
                });
            }
            level = &mut node.children;
        }
    }

    /// The rule for a bucket id whose entries are sorted by key.
    pub(super) fn resolve(&self, bucket: &[(&str, &[u8])]) -> Option<&Arc<QuotaRule>> {
        let mut level = self;
        let mut node = None;
        for (key, value) in bucket {
            let branches = level.by_key.get(*key)?;
            let (next, _) = branches.find(value)?;
            level = &next.children;
            node = Some(next);
        }
        node?.rule.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::rules::RuleSet;

    const RULES: &str = "
domain: d
quota_buckets:
  - bucket: {name: per-tenant, tenant: acme}
    rate_limit: {unit: second, requests_per_unit: 1}
  - bucket: {tenant: 'a*', name: per-tenant}
    rate_limit: {unit: second, requests_per_unit: 2}
  - bucket: {name: per-tenant, tenant: ~}
    rate_limit: {unit: second, requests_per_unit: 3}
  - bucket: {name: default}
    rate_limit: {unlimited: true}
  - bucket: {name: shadow}
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 4}
";

    fn limit_of(set: &RuleSet, bucket: &[(&str, &str)]) -> Option<Option<u32>> {
        let mut bucket: Vec<(&str, &[u8])> =
            bucket.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        bucket.sort();
        let rule = set.quota_rule(b"d", &bucket)?;
        Some(rule.limit.as_ref().map(|l| l.requests_per_unit))
    }

    fn rules() -> RuleSet {
        let (domain, _) = crate::config::parse(Path::new("t.yaml"), RULES).expect("valid rules");
        RuleSet::new(vec![domain])
    }

    #[test]
    fn bucket_ids_match_exact_then_wildcard_then_key_only_in_any_key_order() {
        let set = rules();
        assert_eq!(
            limit_of(&set, &[("tenant", "acme"), ("name", "per-tenant")]),
            Some(Some(1))
        );
        assert_eq!(
            limit_of(&set, &[("name", "per-tenant"), ("tenant", "abc")]),
            Some(Some(2))
        );
        assert_eq!(
            limit_of(&set, &[("name", "per-tenant"), ("tenant", "zed")]),
            Some(Some(3))
        );
        assert_eq!(
            limit_of(&set, &[("name", "default")]),
            Some(None),
            "unlimited"
        );
        let shadow = set
            .quota_rule(b"d", &[("name", b"shadow".as_slice())])
            .expect("a rule");
        assert!(shadow.shadow);
        assert_eq!(shadow.path, "name_shadow");
    }

    #[test]
    fn a_bucket_id_with_other_keys_or_values_matches_nothing() {
        let set = rules();
        assert_eq!(limit_of(&set, &[("name", "other")]), None);
        assert_eq!(limit_of(&set, &[("name", "default"), ("extra", "x")]), None);
        assert_eq!(limit_of(&set, &[("tenant", "acme")]), None);
        assert!(
            set.quota_rule(b"other", &[("name", b"default".as_slice())])
                .is_none()
        );
    }

    #[test]
    fn values_that_are_not_utf8_match_patterns_and_key_only_rules() {
        let set = rules();
        let rule = set
            .quota_rule(
                b"d",
                &[("name", b"per-tenant".as_slice()), ("tenant", b"a\xff")],
            )
            .expect("a rule");
        assert_eq!(rule.path, "name_per-tenant.tenant_a*");
        let rule = set
            .quota_rule(
                b"d",
                &[("name", b"per-tenant".as_slice()), ("tenant", b"\xc3\x28")],
            )
            .expect("a rule");
        assert_eq!(rule.path, "name_per-tenant.tenant");
    }
}
