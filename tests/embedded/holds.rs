//! Held rules as `sluice check-config` and `sluice explain` read them: a held rule without its
//! estimate, or without the settle entry that only Envoy's response-time call carries, is an
//! error at its line that says what to add (to the rule, and to Envoy); a weight under the settle
//! entry's key is one too. The example rules (examples/rules/llm.yaml) are valid: a request-time
//! call holds the estimate, the response-time call settles at the model's weighed tokens, and
//! every request of a user counts in one counter.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

/// `sluice check-config` on a directory holding `rules.yaml`: whether it passed, and what it
/// printed, the directory's path taken out.
fn check(rules: &str) -> (bool, String) {
    let (status, text) = super::check_config::check(&[("rules.yaml", rules)]);
    (status.success(), text)
}

#[test]
fn a_held_rule_without_its_estimate_or_settle_entry_is_an_error_saying_what_to_add() {
    let (passed, out) = check(
        "\
domain: llm
descriptors:
  - key: user
    descriptors:
      - key: request_id
        hold: {}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: team
    descriptors:
      - key: request_id
        hold: {estimate: 1000}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: org
    descriptors:
      - key: request_id
        hold: {estimate: 1000, settle: {key: phase, value: response}}
        weights:
          - key: phase
            values: {response: 2}
        rate_limit: {unit: hour, requests_per_unit: 10000}
",
    );
    assert!(!passed, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].starts_with("rules.yaml:6: hold: 'estimate' is needed"),
        "{out}"
    );
    assert!(
        lines[1].starts_with("rules.yaml:11: hold: 'settle' is needed")
            && lines[1].contains("add 'settle: {key: phase, value: response}' here")
            && lines[1]
                .contains("'- generic_key: {descriptor_key: phase, descriptor_value: response}'")
            && lines[1].contains("apply_on_stream_done"),
        "the error says what to add to the rule and to Envoy: {out}"
    );
    assert!(
        lines[2].starts_with(
            "rules.yaml:18: weights: key 'phase' is the key of the rule's settle entry"
        ),
        "{out}"
    );
}

/// `sluice explain --json` on examples/rules for `request` (a request's JSON): its first
/// descriptor.
fn explain_example(request: &Value) -> Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("explain")
        .arg(support::repo_file("examples/rules"))
        .args(["--json", "--request", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sluice runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let explained: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    explained["descriptors"][0].clone()
}

/// The descriptor Envoy sends for `ann`'s request `r1` to `model` with `tokens`, and the
/// response-time call's entry when `settle`.
fn llm_call(model: &str, tokens: u64, settle: bool) -> Value {
    let mut entries = vec![
        json!({"key": "user", "value": "ann"}),
        json!({"key": "request_id", "value": "r1"}),
        json!({"key": "model", "value": model}),
    ];
    if settle {
        entries.push(json!({"key": "phase", "value": "response"}));
    }
    json!({"domain": "llm", "descriptors": [{"entries": entries, "hitsAddend": tokens}]})
}

#[test]
fn the_example_llm_rules_hold_the_estimate_and_settle_a_models_weighed_tokens() {
    let (passed, out) = check(
        &std::fs::read_to_string(support::repo_file("examples/rules/llm.yaml"))
            .expect("examples/rules/llm.yaml"),
    );
    assert!(passed, "{out}");
    let held = explain_example(&llm_call("gpt-4o-mini", 0, false));
    assert_eq!(
        held["rule"]["modes"]["hold"]["settle"],
        json!({"key": "phase", "value": "response"}),
        "{held}"
    );
    assert_eq!(
        held["counters"][0]["hold"],
        json!({"holds": 1000}),
        "{held}"
    );
    for (model, settles) in [("gpt-4o-mini", 100), ("gpt-4o", 1_000), ("unlisted", 1_000)] {
        let settle = explain_example(&llm_call(model, 100, true));
        assert_eq!(
            settle["counters"][0]["hold"],
            json!({"settles": settles}),
            "100 tokens of {model}: {settle}"
        );
        let taken: Vec<&str> = settle["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["match"].as_str().unwrap())
            .collect();
        assert_eq!(taken, ["key", "key", "taken", "taken"], "{settle}");
        assert_eq!(
            settle["counters"][0]["counter"], held["counters"][0]["counter"],
            "one counter for the user's every request, model and phase"
        );
    }
}
