//! A rule file's `quota_buckets`: each bucket's id and limit, for the quota service.

use super::*;

impl Parser<'_> {
    pub(super) fn quota_buckets(&mut self, map: &MarkedMappingNode) -> Vec<QuotaBucketConfig> {
        let mut out: Vec<QuotaBucketConfig> = Vec::new();
        // Each bucket already defined, with its line.
        let mut seen = HashMap::new();
        for q in self.maps(map, "quota_buckets") {
            let Some(rule) = self.quota_bucket(q) else {
                continue;
            };
            if let Some(first) = seen.get(&rule.bucket) {
                self.error(
                    rule.line,
                    format!(
                        "duplicate quota bucket '{}' (first at line {first})",
                        crate::config::quota_path(&rule.bucket),
                    ),
                );
                continue;
            }
            seen.insert(rule.bucket.clone(), rule.line);
            out.push(rule);
        }
        out
    }

    pub(super) fn quota_bucket(&mut self, map: &MarkedMappingNode) -> Option<QuotaBucketConfig> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, QUOTA_KEYS);
        let errors_before = self.errors.len();
        let mut bucket = Vec::new();
        match map.get_node("bucket") {
            None => self.error(
                line,
                "a quota bucket needs 'bucket', a mapping of keys to values",
            ),
            Some(node) => match node.as_mapping() {
                Some(m) if m.len() > MOST_BUCKET_KEYS => self.error(
                    line_of(node),
                    format!(
                        "a quota bucket matches at most {MOST_BUCKET_KEYS} keys, this one {}",
                        m.len()
                    ),
                ),
                Some(m) if !m.is_empty() => {
                    for (key, value) in m.iter() {
                        let value = match value.as_scalar() {
                            Some(s) if is_null(s) => None,
                            Some(s) if s.as_str().is_empty() => None,
                            Some(s) => Some(s.as_str().to_owned()),
                            None => {
                                self.error(
                                    line_of(value),
                                    format!(
                                        "the value of bucket key '{}' must be a string, or ~ for any value",
                                        key.as_str()
                                    ),
                                );
                                None
                            }
                        };
                        if key.as_str().is_empty() {
                            self.error(scalar_line(key), "a bucket key cannot be empty");
                        }
                        bucket.push((key.as_str().to_owned(), value));
                    }
                }
                _ => self.error(
                    line_of(node),
                    "'bucket' must be a mapping of keys to values, with one key at least",
                ),
            },
        }
        bucket.sort();
        let limit = match map.get_node("rate_limit").map(|n| (n, n.as_mapping())) {
            None => {
                self.error(line, "a quota bucket needs a 'rate_limit'");
                None
            }
            Some((_, Some(m))) => {
                for key in m.keys() {
                    if NOT_FOR_QUOTA.contains(&key.as_str()) {
                        self.error(
                            scalar_line(key),
                            format!(
                                "'{}' does not apply to a quota bucket's limit",
                                key.as_str()
                            ),
                        );
                    }
                }
                self.limit(m)
            }
            Some((node, None)) => {
                self.error(line_of(node), "'rate_limit' must be a mapping");
                None
            }
        };
        let shadow = self.flag(map, "shadow_mode");
        let limit = limit?;
        (self.errors.len() == errors_before).then_some(QuotaBucketConfig {
            line,
            bucket,
            limit: limit.limit,
            shadow,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{errors, ok};

    #[test]
    fn quota_buckets_parse_with_sorted_keys_and_any_value_keys() {
        let d = ok(
            "domain: d\nquota_buckets:\n  - bucket: {tenant: ~, name: per-tenant}\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 60}\n  - bucket: {name: open}\n    rate_limit: {unlimited: true}\n",
        );
        assert_eq!(d.quota_buckets.len(), 2);
        let q = &d.quota_buckets[0];
        assert_eq!(q.line, 3);
        assert_eq!(
            q.bucket,
            [
                ("name".into(), Some("per-tenant".into())),
                ("tenant".into(), None)
            ]
        );
        assert!(q.shadow);
        assert_eq!(q.limit.as_ref().map(|l| l.requests_per_unit), Some(60));
        assert!(d.quota_buckets[1].limit.is_none());
    }

    #[test]
    fn bad_quota_buckets_are_errors_at_their_lines() {
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - rate_limit: {unit: second, requests_per_unit: 1}\n"
            ),
            ["r.yaml:3: a quota bucket needs 'bucket', a mapping of keys to values"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {}\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
            ),
            ["r.yaml:3: 'bucket' must be a mapping of keys to values, with one key at least"]
        );
        assert_eq!(
            errors("domain: d\nquota_buckets:\n  - bucket: {name: a}\n"),
            ["r.yaml:3: a quota bucket needs a 'rate_limit'"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit:\n      unit: second\n      algorithm: sliding_log\n"
            ),
            ["r.yaml:6: 'algorithm' does not apply to a quota bucket's limit"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit: {unit: fortnight}\n"
            ),
            ["r.yaml:4: invalid rate limit unit 'fortnight'"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a, t: [1]}\n    rate_limit: {unit: second}\n"
            ),
            ["r.yaml:3: the value of bucket key 't' must be a string, or ~ for any value"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {b: x, a: y}\n    rate_limit: {unit: second}\n  - bucket: {a: y, b: x}\n    rate_limit: {unit: minute}\n"
            ),
            ["r.yaml:5: duplicate quota bucket 'a_y.b_x' (first at line 3)"]
        );
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {name: a}\n    rate_limit: {unit: second}\n    colour: red\n"
            ),
            ["r.yaml:5: config error, unknown key 'colour'"]
        );
    }
}
