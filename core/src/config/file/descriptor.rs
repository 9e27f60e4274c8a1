//! A rule file's `descriptors`: each rule's key, value, limits and extensions, nested.

use super::*;

impl Parser<'_> {
    /// The rules of `map`'s `descriptors`, nested `depth` levels deep (1 at the top).
    pub(super) fn descriptors(
        &mut self,
        map: &MarkedMappingNode,
        parent: &str,
        depth: usize,
    ) -> Vec<DescriptorConfig> {
        let mut out: Vec<DescriptorConfig> = Vec::new();
        let rules = self.maps(map, "descriptors");
        if depth > MOST_DESCRIPTOR_DEPTH {
            if let Some(first) = rules.first() {
                self.error(
                    first.span().start().map_or(1, |m| m.line()),
                    format!("descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels"),
                );
            }
            return out;
        }
        let mut seen = HashSet::new();
        for d in rules {
            let Some(descriptor) = self.descriptor(d, parent, depth) else {
                continue;
            };
            if !seen.insert((descriptor.key.clone(), descriptor.value.clone())) {
                self.error(
                    descriptor.line,
                    format!(
                        "duplicate descriptor composite key '{parent}{}'",
                        composite(&descriptor.key, descriptor.value.as_deref())
                    ),
                );
                continue;
            }
            out.push(descriptor);
        }
        out
    }

    pub(super) fn descriptor(
        &mut self,
        map: &MarkedMappingNode,
        parent: &str,
        depth: usize,
    ) -> Option<DescriptorConfig> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, DESCRIPTOR_KEYS);
        let key = self.string(map, "key").unwrap_or_default();
        if key.is_empty() {
            self.error(line, "descriptor has empty key");
        }
        let value = self.string(map, "value").filter(|v| !v.is_empty());
        let share_threshold = self.flag(map, "share_threshold");
        if share_threshold && !value.as_deref().is_some_and(|v| v.contains('*')) {
            self.error(
                line,
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                    composite(&key, value.as_deref())
                ),
            );
        }
        let mode = self.mode(map);
        let counting = self.counting(map, line);
        let limits = self.limits(map);
        let lease = self.lease(map, line, &limits);
        let scope = self.scope(map, line, lease);
        let metadata = map.get_node("metadata").map(|node| {
            yaml_to_json(node, 0).unwrap_or_else(|line| {
                self.error(
                    line,
                    format!("metadata nests deeper than {MOST_METADATA_DEPTH} levels"),
                );
                serde_json::Value::Null
            })
        });
        let path = format!("{parent}{}.", composite(&key, value.as_deref()));
        let descriptors = self.descriptors(map, &path, depth + 1);
        let hold = map.get_node("hold").and_then(|node| {
            self.held_rule(node, value.as_deref(), &descriptors, &limits, lease, scope)
        });
        let weights = self.weights(map, &key, hold.as_ref(), &descriptors);
        Some(DescriptorConfig {
            line,
            key,
            value,
            limits: limits.into(),
            mode,
            counting,
            lease,
            scope,
            share_threshold,
            detailed_metric: self.flag(map, "detailed_metric"),
            value_to_metric: self.flag(map, "value_to_metric"),
            metadata,
            hold,
            weights,
            descriptors,
        })
    }

    /// A rule's mode, from `shadow_mode` and `quota_mode`.
    fn mode(&mut self, map: &MarkedMappingNode) -> Mode {
        match (self.flag(map, "shadow_mode"), self.flag(map, "quota_mode")) {
            (true, true) => Mode::ShadowQuota,
            (true, false) => Mode::Shadow,
            (false, true) => Mode::Quota,
            (false, false) => Mode::Enforce,
        }
    }

    /// A rule's `counting`, if it says.
    fn counting(&mut self, map: &MarkedMappingNode, line: usize) -> Option<Counting> {
        self.string(map, "counting").and_then(|name| {
            let counting = Counting::parse(&name);
            if counting.is_none() {
                let at = map.get_node("counting").map_or(line, line_of);
                self.error(at, format!("invalid counting '{name}': admitted or always"));
            }
            counting
        })
    }

    /// A rule's `lease`, if it says, which its `limits` must be able to take.
    fn lease(
        &mut self,
        map: &MarkedMappingNode,
        line: usize,
        limits: &[RuleLimit],
    ) -> Option<Leasing> {
        self.string(map, "lease").and_then(|name| {
            let at = map.get_node("lease").map_or(line, line_of);
            let Some(lease) = Leasing::parse(&name) else {
                self.error(at, format!("invalid lease '{name}': auto or off"));
                return None;
            };
            let unleasable = limits
                .iter()
                .filter_map(|l| l.limit.as_ref())
                .find(|l| !crate::limiter::lease::leasable(l.algorithm));
            if let (Leasing::Auto, Some(limit)) = (lease, unleasable) {
                self.error(
                    at,
                    format!(
                        "lease: auto cannot apply to a {} limit: only fixed_window and sliding_window limits can be leased",
                        limit.algorithm.name()
                    ),
                );
            }
            Some(lease)
        })
    }

    /// A rule's `scope`, if it says, which its `lease` must fit.
    fn scope(
        &mut self,
        map: &MarkedMappingNode,
        line: usize,
        lease: Option<Leasing>,
    ) -> Option<Scope> {
        self.string(map, "scope").and_then(|name| {
            let at = map.get_node("scope").map_or(line, line_of);
            let Some(scope) = Scope::parse(&name) else {
                self.error(
                    at,
                    format!("invalid scope '{name}': global, cluster, replica or split"),
                );
                return None;
            };
            if scope.is_local() && lease == Some(Leasing::Auto) {
                self.error(
                    at,
                    format!(
                        "scope: {name} counts in the replica's own memory, which takes no leased block (lease: auto)"
                    ),
                );
            }
            Some(scope)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::errors;
    use super::*;

    #[test]
    fn a_rule_names_its_scope_and_a_replica_scope_takes_no_lease() {
        let rule = |extra: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: k\n{extra}    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
            )
        };
        for name in ["global", "cluster", "replica", "split"] {
            let (domain, _) = parse(Path::new("r.yaml"), &rule(&format!("    scope: {name}\n")))
                .expect("a valid scope");
            assert_eq!(domain.descriptors[0].scope, Scope::parse(name));
        }
        assert_eq!(
            errors(&rule("    scope: region\n")),
            ["r.yaml:4: invalid scope 'region': global, cluster, replica or split"]
        );
        assert_eq!(
            errors(&rule("    scope: replica\n    lease: auto\n")),
            [
                "r.yaml:4: scope: replica counts in the replica's own memory, which takes no leased block (lease: auto)"
            ]
        );
        assert!(errors(&rule("    scope: cluster\n    lease: auto\n")).is_empty());
    }
}
