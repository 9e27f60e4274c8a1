//! The response's dynamic metadata (`--response-dynamic-metadata`), in envoyproxy/ratelimit's
//! shape: the request's domain, descriptors and hits, and the rule `metadata` of every descriptor
//! that passed, merged. Envoy stores it under its filter's namespace for logs and later filters.

use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use serde_json::Map;

use crate::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use sluice_core::config::MOST_METADATA_DEPTH;

/// The metadata of `request`, with `passed`: the rule metadata of the descriptors that were not
/// over their limit, in request order. Keys and values that are not UTF-8 are rendered lossily
/// (U+FFFD), so that no request can make the answer fail. The rules' metadata is sent at most
/// `MOST_METADATA_DEPTH` collections deep (deeper ones as null; no rule file can hold them): two
/// protobuf levels each, well within the 100 that protobuf decoders, Envoy's among them, accept.
pub(super) fn describe<'a>(
    request: &RateLimitRequest,
    passed: impl Iterator<Item = &'a Map<String, serde_json::Value>>,
) -> Struct {
    let mut fields = std::collections::HashMap::with_capacity(4);
    fields.insert(
        "domain".to_owned(),
        string(String::from_utf8_lossy(&request.domain).into_owned()),
    );
    fields.insert(
        "descriptors".to_owned(),
        list(request.descriptors.iter().map(descriptor).collect()),
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            number(f64::from(request.hits_addend)),
        );
    }
    let mut merged = Map::new();
    for metadata in passed {
        merge(&mut merged, metadata, 1);
    }
    if !merged.is_empty() {
        fields.insert(
            "metadata".to_owned(),
            json(serde_json::Value::Object(merged), 0),
        );
    }
    Struct { fields }
}

/// One descriptor: `entries` as `key=value`, the request's `limit` override and `hitsAddend`
/// when set.
fn descriptor(d: &RateLimitDescriptor) -> Value {
    let mut fields = std::collections::HashMap::with_capacity(3);
    let entries = d
        .entries
        .iter()
        .map(|e| {
            string(format!(
                "{}={}",
                String::from_utf8_lossy(&e.key),
                String::from_utf8_lossy(&e.value)
            ))
        })
        .collect();
    fields.insert("entries".to_owned(), list(entries));
    if let Some(limit) = &d.limit {
        let unit = RateLimitUnit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
        fields.insert(
            "limit".to_owned(),
            string(format!(
                "requests_per_unit:{} unit:{unit}",
                limit.requests_per_unit
            )),
        );
    }
    if let Some(hits) = &d.hits_addend {
        fields.insert("hitsAddend".to_owned(), number(hits.value as f64));
    }
    value(Kind::StructValue(Struct { fields }))
}

/// Adds `src` to `dest`, mappings `depth` collections deep, as envoyproxy/ratelimit merges rule
/// metadata: a key already there keeps its value, except that two mappings merge, recursively
/// (down to `MOST_METADATA_DEPTH`, past which nothing is sent).
fn merge(
    dest: &mut Map<String, serde_json::Value>,
    src: &Map<String, serde_json::Value>,
    depth: usize,
) {
    for (key, new) in src {
        match (dest.get_mut(key), new) {
            (Some(serde_json::Value::Object(old)), serde_json::Value::Object(new))
                if depth < MOST_METADATA_DEPTH =>
            {
                merge(old, new, depth + 1);
            }
            (Some(_), _) => {}
            (None, _) => {
                dest.insert(key.clone(), new.clone());
            }
        }
    }
}

/// `v` as a protobuf `Value`, inside `depth` collections: a collection that would be deeper than
/// `MOST_METADATA_DEPTH` is null.
fn json(v: serde_json::Value, depth: usize) -> Value {
    let deeper = depth + 1;
    value(match v {
        serde_json::Value::Array(_) | serde_json::Value::Object(_)
            if deeper > MOST_METADATA_DEPTH =>
        {
            Kind::NullValue(0)
        }
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(a) => Kind::ListValue(ListValue {
            values: a.into_iter().map(|v| json(v, deeper)).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(Struct {
            fields: o.into_iter().map(|(k, v)| (k, json(v, deeper))).collect(),
        }),
    })
}

fn value(kind: Kind) -> Value {
    Value { kind: Some(kind) }
}

fn string(s: String) -> Value {
    value(Kind::StringValue(s))
}

fn number(n: f64) -> Value {
    value(Kind::NumberValue(n))
}

fn list(values: Vec<Value>) -> Value {
    value(Kind::ListValue(ListValue { values }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: serde_json::Value) -> Map<String, serde_json::Value> {
        match v {
            serde_json::Value::Object(m) => m,
            _ => panic!("a mapping"),
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_are_rendered_lossily() {
        use crate::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
        let request = RateLimitRequest {
            domain: b"d\xff".to_vec(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: b"user".to_vec(),
                    value: b"mallory\xfe".to_vec(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        };
        let described = describe(&request, std::iter::empty());
        let text = |v: &Value| match &v.kind {
            Some(Kind::StringValue(s)) => s.clone(),
            other => panic!("a string: {other:?}"),
        };
        assert_eq!(text(&described.fields["domain"]), "d\u{fffd}");
        let Some(Kind::ListValue(descriptors)) = &described.fields["descriptors"].kind else {
            panic!("a list");
        };
        let Some(Kind::StructValue(first)) = &descriptors.values[0].kind else {
            panic!("a struct");
        };
        let Some(Kind::ListValue(entries)) = &first.fields["entries"].kind else {
            panic!("a list");
        };
        assert_eq!(text(&entries.values[0]), "user=mallory\u{fffd}");
        assert!(!described.fields.contains_key("metadata"));
    }

    #[test]
    fn mappings_merge_recursively_and_the_first_value_wins_otherwise() {
        let mut dest = map(serde_json::json!({"team": "a", "tier": {"x": 1}, "list": [1]}));
        let src = map(
            serde_json::json!({"team": "b", "tier": {"x": 2, "y": 3}, "list": [2], "new": true}),
        );
        merge(&mut dest, &src, 1);
        assert_eq!(
            serde_json::Value::Object(dest),
            serde_json::json!({"team": "a", "tier": {"x": 1, "y": 3}, "list": [1], "new": true})
        );
    }

    /// How many collections deep `v` nests.
    fn levels(v: &Value) -> usize {
        match &v.kind {
            Some(Kind::StructValue(s)) => 1 + s.fields.values().map(levels).max().unwrap_or(0),
            Some(Kind::ListValue(l)) => 1 + l.values.iter().map(levels).max().unwrap_or(0),
            _ => 0,
        }
    }

    #[test]
    fn metadata_deeper_than_the_cap_is_sent_as_null_past_it() {
        let mut deep = serde_json::json!(["leaf"]);
        for _ in 0..MOST_METADATA_DEPTH + 4 {
            deep = serde_json::json!({ "m": deep });
        }
        let request = RateLimitRequest {
            domain: b"d".to_vec(),
            ..Default::default()
        };
        let deep = map(deep);
        let described = describe(&request, [&deep, &deep].into_iter());
        assert_eq!(levels(&described.fields["metadata"]), MOST_METADATA_DEPTH);
    }
}
