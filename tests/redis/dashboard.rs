//! deploy/grafana against a live sluice: every PromQL expression of the dashboard and the alert
//! rules names only series a running sluice exports (on the embedded store and on Redis), with
//! labels those series carry; and every alert says how long, how bad, and what it means.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use marked_yaml::Node;
use support::metrics::scrape;
use support::quota::{QuotaStream, bucket};
use support::{Sluice, Store, request};
use tokio::sync::OnceCell;

const DASHBOARD: &str = "deploy/grafana/sluice-dashboard.json";
const ALERTS: &str = "deploy/grafana/sluice-alerts.yaml";

/// Labels Prometheus attaches to every series it scrapes: never in `/metrics` itself.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

const RULES: &str = "domain: dash
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: probe
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: last
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: client
    rate_limit: {unit: hour, requests_per_unit: 1000}
quota_buckets:
  - bucket: {name: tenant}
    rate_limit: {unit: second, requests_per_unit: 10}
  - bucket: {name: trial}
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
";

/// Sample name (as Prometheus stores it: `_total`, `_bucket`, …) → the label names it carries.
type Exported = BTreeMap<String, BTreeSet<String>>;

/// What sluice exports once it has decided requests (within, near, over, shadow, denied from
/// the local cache, an unknown domain) and reloaded its rules (once failing, once not), on the
/// embedded store and on Redis (whose breakers and batches only a Redis store has): the union of
/// both scrapes, taken once for every test.
async fn exported() -> &'static Exported {
    static EXPORTED: OnceCell<Exported> = OnceCell::const_new();
    EXPORTED.get_or_init(scrape_both).await
}

async fn scrape_both() -> Exported {
    let mut all = Exported::new();
    for store in [Store::Memory, Store::Redis] {
        let sluice = Sluice::on(store, &[("dash.yaml", RULES)], &[]).await;
        for descriptor in [
            ("user", "a"),
            ("user", "a"),
            ("probe", "p"),
            ("last", "l"),
            ("client", "c"),
        ] {
            sluice.ask(request("dash", &[&[descriptor]])).await;
        }
        sluice.ask(request("elsewhere", &[&[("user", "a")]])).await;
        // An Envoy's quota stream: a bucket divided, a shadow one over its limit.
        let mut envoy = QuotaStream::open(&sluice, "dash").await;
        let (tenant, trial) = (bucket(&[("name", "tenant")]), bucket(&[("name", "trial")]));
        envoy.report(&[(&tenant, 1, 0), (&trial, 1, 0)]).await;
        envoy.answer().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        envoy.report(&[(&tenant, 5, 3), (&trial, 50, 0)]).await;
        envoy.answer().await;
        reload(&sluice, "domain: [", "failed").await;
        reload(&sluice, &RULES.replace("1000", "2000"), "ok").await;
        let m = scrape(sluice.http);
        let trial_rule = [("domain", "dash"), ("rule", "name_trial")];
        assert!(m.value("sluice_quota_shadow_denied_total", &trial_rule) > 0.0);
        for (series, descriptor, hits) in [
            ("sluice_rule_over_limit_total", "user", 2.0),
            ("sluice_rule_over_limit_with_local_cache_total", "user", 1.0),
            ("sluice_rule_shadow_mode_total", "probe", 1.0),
            ("sluice_rule_near_limit_total", "last", 1.0),
            ("sluice_rule_within_limit_total", "client", 1.0),
        ] {
            let labels = [("domain", "dash"), ("descriptor", descriptor)];
            assert_eq!(
                m.value(series, &labels),
                hits,
                "{series} {descriptor} on {store:?}"
            );
        }
        for (name, labels) in m.label_names() {
            all.entry(name.clone())
                .or_default()
                .extend(labels.iter().cloned());
        }
    }
    all
}

/// Writes `text` as the rule file and waits (at most 10 s) until `sluice_rule_reloads_total`
/// counts one more reload with `result`.
async fn reload(sluice: &Sluice, text: &str, result: &str) {
    let count =
        |s: &Sluice| scrape(s.http).value("sluice_rule_reloads_total", &[("result", result)]);
    let before = count(sluice);
    std::fs::write(sluice.rules.join("dash.yaml"), text).expect("the rule file is written");
    for _ in 0..100 {
        if count(sluice) > before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no {result} reload counted; log:\n{}", sluice.log_text());
}

/// What one PromQL expression references.
#[derive(Debug, Default, PartialEq)]
struct References {
    /// Each vector selector: its metric name and the label names its matchers use.
    selectors: Vec<(String, Vec<String>)>,
    /// Label names of `by`, `without`, `on`, `ignoring`, `group_left` and `group_right` lists.
    grouping: Vec<String>,
}

const AGGREGATIONS: &[&str] = &[
    "sum",
    "avg",
    "count",
    "min",
    "max",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
];
const FUNCTIONS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "avg_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "count_over_time",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_sum",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "max_over_time",
    "min_over_time",
    "minute",
    "month",
    "predict_linear",
    "present_over_time",
    "quantile_over_time",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev_over_time",
    "stdvar_over_time",
    "sum_over_time",
    "time",
    "timestamp",
    "vector",
    "year",
];

/// Reads `expr` as PromQL (Grafana's `$variables` allowed) and returns the metric names and
/// label names it uses; panics on what it cannot read, so that nothing escapes the check.
fn references(expr: &str) -> References {
    let s: Vec<char> = expr.chars().collect();
    let mut refs = References::default();
    let mut i = 0;
    let skip_space = |i: &mut usize| {
        while *i < s.len() && s[*i].is_whitespace() {
            *i += 1;
        }
    };
    let ident = |i: &mut usize| {
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == '_' || s[*i] == ':') {
            *i += 1;
        }
        s[start..*i].iter().collect::<String>()
    };
    let string = |i: &mut usize| {
        let quote = s[*i];
        *i += 1;
        while *i < s.len() && s[*i] != quote {
            *i += if s[*i] == '\\' { 2 } else { 1 };
        }
        assert!(*i < s.len(), "unterminated string in {expr}");
        *i += 1;
    };
    while i < s.len() {
        let c = s[i];
        if c.is_whitespace() {
            i += 1;
        } else if matches!(c, '"' | '\'' | '`') {
            string(&mut i);
        } else if c == '[' {
            // A range or subquery: durations and `$__rate_interval`, no names.
            i += s[i..]
                .iter()
                .position(|&c| c == ']')
                .expect("a closed range")
                + 1;
        } else if c == '$' {
            i += 1;
            if s.get(i) == Some(&'{') {
                i += s[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .expect("a closed ${…}")
                    + 1;
            } else {
                ident(&mut i);
            }
        } else if c.is_ascii_digit() || (c == '.' && s.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let word = ident(&mut i);
            let mut next = i;
            skip_space(&mut next);
            let open = s.get(next).copied();
            if GROUPING.contains(&word.as_str()) {
                if open == Some('(') {
                    let close = next
                        + s[next..]
                            .iter()
                            .position(|&c| c == ')')
                            .expect("a closed list");
                    let list: String = s[next + 1..close].iter().collect();
                    refs.grouping.extend(
                        list.split(',')
                            .map(str::trim)
                            .filter(|l| !l.is_empty())
                            .map(str::to_owned),
                    );
                    i = close + 1;
                }
            } else if KEYWORDS.contains(&word.as_str()) || AGGREGATIONS.contains(&word.as_str()) {
                // Operators and aggregations name no series.
            } else if open == Some('(') {
                assert!(
                    FUNCTIONS.contains(&word.as_str()),
                    "unknown function {word} in {expr}"
                );
            } else {
                let mut labels = Vec::new();
                if open == Some('{') {
                    i = next + 1;
                    loop {
                        skip_space(&mut i);
                        if s.get(i) == Some(&'}') {
                            i += 1;
                            break;
                        }
                        let label = ident(&mut i);
                        assert!(!label.is_empty(), "a label name expected at {i} in {expr}");
                        labels.push(label);
                        skip_space(&mut i);
                        while i < s.len() && matches!(s[i], '=' | '!' | '~') {
                            i += 1;
                        }
                        skip_space(&mut i);
                        assert!(
                            s.get(i).is_some_and(|c| matches!(c, '"' | '\'' | '`')),
                            "a quoted value expected at {i} in {expr}"
                        );
                        string(&mut i);
                        skip_space(&mut i);
                        if s.get(i) == Some(&',') {
                            i += 1;
                        }
                    }
                }
                refs.selectors.push((word, labels));
            }
        } else if c == '{' {
            panic!("a selector without a metric name in {expr}");
        } else {
            i += 1;
        }
    }
    refs
}

/// What `refs` names that `exported` lacks: a metric no sample is written under, a matcher's
/// label its metric does not carry, a grouping label none of the expression's metrics carries.
fn missing(refs: &References, exported: &Exported) -> Vec<String> {
    let mut out = Vec::new();
    let mut carried: BTreeSet<&str> = TARGET_LABELS.into_iter().collect();
    for (name, labels) in &refs.selectors {
        let Some(has) = exported.get(name) else {
            out.push(format!("metric {name}"));
            continue;
        };
        carried.extend(has.iter().map(String::as_str));
        for label in labels {
            if !has.contains(label) && !TARGET_LABELS.contains(&label.as_str()) {
                out.push(format!("label {label} on {name}"));
            }
        }
    }
    for label in &refs.grouping {
        if !carried.contains(label.as_str()) {
            out.push(format!("grouping label {label}"));
        }
    }
    out
}

/// A Grafana variable query: `label_values(SELECTOR, LABEL)` reads as the selector with LABEL
/// among its labels; anything else as PromQL.
fn variable_references(query: &str) -> References {
    let Some(args) = query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
    else {
        return references(query);
    };
    let (selector, label) = args
        .rsplit_once(',')
        .expect("label_values(SELECTOR, LABEL)");
    let mut refs = references(selector);
    assert_eq!(refs.selectors.len(), 1, "one metric in {query}");
    refs.selectors[0].1.push(label.trim().to_owned());
    refs
}

fn read(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every expression of the dashboard, with where it is: each panel's targets (every panel but a
/// row has at least one) and each query variable.
fn dashboard_expressions() -> Vec<(String, References)> {
    let dashboard: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).expect("JSON");
    let mut out = Vec::new();
    let mut panels: Vec<&serde_json::Value> = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        panels.push(panel);
        panels.extend(panel["panels"].as_array().into_iter().flatten());
    }
    for panel in panels.into_iter().filter(|p| p["type"] != "row") {
        let title = panel["title"].as_str().expect("a title");
        let targets = panel["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("a PromQL target");
            out.push((format!("panel {title:?}: {expr}"), references(expr)));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if variable["type"] == "query" {
            let query = &variable["query"];
            let query = query["query"].as_str().or(query.as_str()).expect("a query");
            out.push((
                format!("variable {}: {query}", variable["name"]),
                variable_references(query),
            ));
        }
    }
    out
}

fn yaml(path: &str) -> Node {
    marked_yaml::parse_yaml(0, read(path)).expect("YAML")
}

fn text<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    Some(node.as_mapping()?.get_scalar(key)?.as_str())
}

/// Every alerting rule of the alert file.
fn alerts() -> Vec<Node> {
    let root = yaml(ALERTS);
    let groups = root
        .as_mapping()
        .and_then(|m| m.get_sequence("groups"))
        .expect("groups:");
    groups
        .iter()
        .flat_map(|g| {
            g.as_mapping()
                .and_then(|m| m.get_sequence("rules"))
                .expect("rules:")
                .iter()
        })
        .cloned()
        .collect()
}

fn alert_expressions() -> Vec<(String, References)> {
    alerts()
        .iter()
        .map(|rule| {
            let name = text(rule, "alert").expect("an alert name");
            let expr = text(rule, "expr").expect("an expr");
            (format!("alert {name}: {expr}"), references(expr))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_dashboard_and_alert_expression_names_series_sluice_exports() {
    let exported = exported().await;
    let expressions: Vec<_> = dashboard_expressions()
        .into_iter()
        .chain(alert_expressions())
        .collect();
    assert!(
        expressions.len() > 40,
        "the dashboard and the alerts are read"
    );
    let mut wrong = Vec::new();
    let mut used = BTreeSet::new();
    for (place, refs) in &expressions {
        assert!(!refs.selectors.is_empty(), "{place} names no metric");
        used.extend(refs.selectors.iter().map(|(name, _)| name.as_str()));
        wrong.extend(
            missing(refs, exported)
                .into_iter()
                .map(|m| format!("{place}\n  not exported: {m}")),
        );
    }
    assert!(
        wrong.is_empty(),
        "{}\nexported: {exported:#?}",
        wrong.join("\n")
    );
    for name in [
        "sluice_store_breakers_open",
        "sluice_memory_counters",
        "sluice_rule_near_limit_total",
    ] {
        assert!(used.contains(name), "the dashboard charts {name}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_name_or_label_sluice_does_not_export_is_reported() {
    let exported = exported().await;
    let check = |expr: &str| missing(&references(expr), exported);
    assert_eq!(
        check(r#"sum by (kind) (rate(sluice_store_errors_total{job="x"}[5m]))"#),
        Vec::<String>::new()
    );
    assert_eq!(
        check("rate(sluice_rule_hit_total[5m])"),
        ["metric sluice_rule_hit_total"]
    );
    assert_eq!(
        check("sluice_rule_hits_bucket"),
        ["metric sluice_rule_hits_bucket"],
        "a counter has no buckets"
    );
    assert_eq!(
        check("sluice_rule_hits"),
        ["metric sluice_rule_hits"],
        "a counter's samples end in _total"
    );
    assert_eq!(
        check(r#"sluice_store_errors_total{reason="timeout"}"#),
        ["label reason on sluice_store_errors_total"]
    );
    assert_eq!(
        check("sum by (kind) (rate(sluice_policy_answers_total[5m]))"),
        ["grouping label kind"]
    );
}

#[test]
fn the_promql_reader_finds_every_metric_and_label() {
    let refs = references(
        r#"histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{job=~"$job", x!="}"}[$__rate_interval])))
           / on (job) group_left b offset 5m > bool 1e-3 and topk(3, sum(c) without (y)) unless d{z='q'}"#,
    );
    let selectors = [
        ("a_bucket", &["job", "x"][..]),
        ("b", &[]),
        ("c", &[]),
        ("d", &["z"]),
    ];
    let expected = References {
        selectors: selectors
            .iter()
            .map(|(n, l)| ((*n).to_owned(), l.iter().map(|l| (*l).to_owned()).collect()))
            .collect(),
        grouping: ["instance", "le", "job", "y"].map(str::to_owned).to_vec(),
    };
    assert_eq!(refs, expected);
    let variable =
        variable_references(r#"label_values(sluice_rule_hits_total{job=~"$job"}, domain)"#);
    assert_eq!(
        variable.selectors,
        [(
            "sluice_rule_hits_total".to_owned(),
            vec!["job".to_owned(), "domain".to_owned()]
        )]
    );
}

#[test]
fn every_alert_has_a_duration_a_severity_a_summary_and_a_description() {
    let alerts = alerts();
    assert!(
        alerts.len() >= 5,
        "store down, breaker, reload, errors, over limit"
    );
    for rule in &alerts {
        let name = text(rule, "alert").expect("an alert name");
        assert!(
            text(rule, "for").is_some_and(|d| d.ends_with('m') || d.ends_with('s')),
            "{name}: for"
        );
        let labels = rule
            .as_mapping()
            .and_then(|m| m.get_node("labels"))
            .expect("labels");
        assert!(
            text(labels, "severity").is_some_and(|s| ["critical", "warning"].contains(&s)),
            "{name}: severity critical or warning"
        );
        let annotations = rule
            .as_mapping()
            .and_then(|m| m.get_node("annotations"))
            .expect("annotations");
        for key in ["summary", "description"] {
            assert!(
                text(annotations, key).is_some_and(|t| !t.trim().is_empty()),
                "{name}: {key}"
            );
        }
    }
}
