//! `/metrics` as Prometheus reads it: the body is parsed by the reference OpenMetrics parser
//! (Python's `prometheus_client`, which `scripts/test` installs), so a test fails on any text
//! a real scraper would reject.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

/// Reads OpenMetrics text on stdin and prints `{"samples": {"name{k="v",…}": value},
/// "families": {name: type}, "labels": {sample name: [label name, …]}}`, labels sorted; exits
/// non-zero on text the parser rejects or a sample written twice.
const PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
samples, families, names = {}, {}, {}
for family in text_string_to_metric_families(sys.stdin.read()):
    families[family.name] = family.type
    for s in family.samples:
        labels = ",".join('%s="%s"' % (k, v) for k, v in sorted(s.labels.items()))
        key = "%s{%s}" % (s.name, labels)
        if key in samples:
            sys.exit("sample written twice: " + key)
        samples[key] = s.value
        names.setdefault(s.name, set()).update(s.labels)
labels = {name: sorted(keys) for name, keys in names.items()}
print(json.dumps({"samples": samples, "families": families, "labels": labels}))
"#;

/// One scrape of `/metrics`, as the parser read it.
pub struct Scrape {
    /// `name{k="v",…}` (labels sorted by name) → value.
    samples: BTreeMap<String, f64>,
    /// Family name → its type (`counter`, `gauge`, `histogram`, `info`, `unknown`, …).
    families: BTreeMap<String, String>,
    /// Sample name → every label name its samples carry.
    labels: BTreeMap<String, BTreeSet<String>>,
    /// The text as served.
    pub text: String,
}

impl Scrape {
    /// The value of the sample `name` with exactly `labels`, if written.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples.get(&key(name, labels)).copied()
    }

    /// The value of the sample `name` with exactly `labels`; panics, listing the samples of that
    /// name, when it is not written.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| {
            let written: Vec<_> = self
                .samples
                .keys()
                .filter(|k| k.starts_with(&format!("{name}{{")))
                .collect();
            panic!(
                "no sample {}; samples of that name: {written:#?}",
                key(name, labels)
            )
        })
    }

    /// Every sample of `name`, as (`k="v",…`, value).
    pub fn samples_of(&self, name: &str) -> Vec<(String, f64)> {
        let prefix = format!("{name}{{");
        self.samples
            .iter()
            .filter_map(|(k, v)| {
                let labels = k.strip_prefix(&prefix)?.strip_suffix('}')?;
                Some((labels.to_owned(), *v))
            })
            .collect()
    }

    /// The type of the family `name`, if it has samples.
    pub fn family_type(&self, name: &str) -> Option<&str> {
        self.families.get(name).map(String::as_str)
    }

    /// Every sample name written (a histogram's `_bucket`, `_sum`, `_count`, a counter's
    /// `_total`), with the label names its samples carry.
    pub fn label_names(&self) -> &BTreeMap<String, BTreeSet<String>> {
        &self.labels
    }
}

fn key(name: &str, labels: &[(&str, &str)]) -> String {
    let mut labels = labels.to_vec();
    labels.sort();
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", labels.join(","))
}

/// GETs `/metrics` from the admin address `http`, checks that it answers 200 in the OpenMetrics
/// format, and parses it.
pub fn scrape(http: SocketAddr) -> Scrape {
    scrape_at(http, "/metrics")
}

/// `scrape`, of `path` on `addr`.
pub fn scrape_at(addr: SocketAddr, path: &str) -> Scrape {
    let (status, headers, text) = super::http(addr, "GET", path, "");
    assert_eq!(status, 200, "{text}");
    let content_type = headers
        .iter()
        .find(|(k, _)| k == "content-type")
        .map(|(_, v)| v.as_str());
    assert!(
        content_type.is_some_and(|t| t.starts_with("application/openmetrics-text; version=1.0.0")),
        "content type {content_type:?}"
    );
    let parsed = parse(&text);
    Scrape {
        samples: serde_json::from_value(parsed["samples"].clone()).expect("samples"),
        families: serde_json::from_value(parsed["families"].clone()).expect("families"),
        labels: serde_json::from_value(parsed["labels"].clone()).expect("labels"),
        text,
    }
}

/// Runs the parser on `text`.
fn parse(text: &str) -> serde_json::Value {
    let present = Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        present,
        "python3 with prometheus_client is needed to parse /metrics: \
         `python3 -m pip install prometheus-client` (scripts/test installs it)"
    );
    let mut python = Command::new("python3")
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut stdin = python.stdin.take().expect("stdin is piped");
    let input = text.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = python.wait_with_output().expect("python3 finishes");
    let written = writer.join().expect("the writer runs");
    assert!(
        out.status.success(),
        "the OpenMetrics parser rejects /metrics: {}\n--- the text:\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    written.expect("the text reaches python3");
    serde_json::from_slice(&out.stdout).expect("the parser's JSON")
}
