//! `sluice explain` (CLI) and `POST /explain` (admin HTTP): each descriptor's walk through the
//! rule tree, the limits, `replaces`, modes, hits and counters the request path would use, and
//! that explaining moves no counter while the counter it names is the one a request moves.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{MINUTE, Sluice, Store, http, in_one_window, request};

/// Every kind of match and every rule feature an explanation shows, each rule on a known line.
const RULES: &str = "domain: web
descriptors:
  - key: path
    value: /exact
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*/avatar
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: client
    descriptors:
      - key: method
        value: GET
        rate_limit: {unit: minute, requests_per_unit: 4}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 10, name: per_ip}
  - key: user
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: per_ip}]}
  - key: canary
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: files
    value: '*'
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: internal
    rate_limit: {unlimited: true}
";

/// Runs `sluice explain` on a directory holding rule `files`, with `args` after the path and
/// `stdin` on its standard input; the rules directory is left out of what it prints.
fn run(files: &[(&str, &str)], args: &[&str], stdin: &str) -> (Output, String, String) {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("explain")
        .arg(dir.path())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sluice runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let strip =
        |b: &[u8]| String::from_utf8_lossy(b).replace(&format!("{}/", dir.path().display()), "");
    let (stdout, stderr) = (strip(&out.stdout), strip(&out.stderr));
    (out, stdout, stderr)
}

/// `sluice explain --json` on `RULES` with `args`, which must succeed.
fn explain(args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (out, stdout, stderr) = run(&[("rules.yaml", RULES)], &all, "");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    serde_json::from_str(&stdout).expect("JSON output")
}

/// The explanation of one descriptor of `web`.
fn one(descriptor: &str) -> Value {
    explain(&["--domain", "web", "--descriptor", descriptor])["descriptors"][0].clone()
}

fn matches(d: &Value) -> Vec<&str> {
    d["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["match"].as_str().unwrap())
        .collect()
}

#[test]
fn exact_beats_wildcard_beats_key_only_and_each_names_its_rule() {
    let d = one("path=/exact");
    assert_eq!(matches(&d), ["exact"]);
    assert_eq!(d["entries"][0]["rule"], "rules.yaml:3");
    assert_eq!(d["rule"]["limits"][0]["requests_per_unit"], 1);

    let d = one("path=/api/42/avatar");
    assert_eq!(matches(&d), ["wildcard"]);
    assert_eq!(d["entries"][0]["pattern"], "/api/*/avatar");
    assert_eq!(d["entries"][0]["rule"], "rules.yaml:6");
    assert_eq!(d["rule"]["limits"][0]["requests_per_unit"], 2);

    let d = one("path=/api/42/avatar.png");
    assert_eq!(
        matches(&d),
        ["key"],
        "the pattern must match the whole value"
    );
    assert_eq!(d["entries"][0]["rule"], "rules.yaml:9");
    assert_eq!(d["result"], "limited");
    assert_eq!(
        d["counters"][0]["limit"],
        serde_json::json!({"unit": "minute", "requests_per_unit": 3, "unit_multiplier": 1, "algorithm": "fixed_window"})
    );
}

#[test]
fn a_walk_that_stops_says_at_which_entry_and_why() {
    let d = one("client=x,method=POST");
    assert_eq!(matches(&d), ["key", "none"]);
    assert_eq!(d["stop"]["entry"], 1);
    assert_eq!(d["stop"]["reason"], "no_rule_for_value");
    assert_eq!(d["result"], "no_limit");
    assert_eq!(d["counters"], serde_json::json!([]));

    let d = one("client=x,colour=red");
    assert_eq!(d["stop"]["reason"], "no_rule_for_key");

    let d = one("path=/exact,extra=1,more=2");
    assert_eq!(matches(&d), ["exact", "none", "not_reached"]);
    assert_eq!(d["stop"]["reason"], "deeper_than_rules");
    assert!(
        d["rule"].is_null(),
        "more entries than the tree: no rule applies"
    );

    let d = one("client=x");
    assert_eq!(matches(&d), ["key"]);
    assert!(d["stop"].is_null());
    assert_eq!(
        d["result"], "no_limit",
        "the rule of the last entry has no limit"
    );
    let d = one("client=x,method=GET");
    assert_eq!(d["rule"]["path"], "client.method_GET");
    assert_eq!(d["rule"]["source"], "rules.yaml:13");
}

#[test]
fn unlimited_shadow_and_quota_modes_are_shown() {
    let d = one("internal=a");
    assert_eq!(d["result"], "unlimited");
    assert_eq!(d["rule"]["limits"][0]["unlimited"], true);
    assert_eq!(d["counters"], serde_json::json!([]));

    let d = one("canary=a");
    assert_eq!(d["rule"]["modes"]["shadow_mode"], true);
    assert_eq!(d["rule"]["modes"]["quota_mode"], false);
    assert_eq!(d["counters"][0]["modes"]["shadow_mode"], true);

    let d = one("user=ann");
    assert_eq!(d["rule"]["modes"]["quota_mode"], true);
    assert_eq!(d["counters"][0]["modes"]["quota_mode"], true);
}

#[test]
fn replaces_drops_a_limit_of_another_descriptor_and_names_who_did() {
    let both = explain(&[
        "--domain",
        "web",
        "--descriptor",
        "ip=10.0.0.1",
        "--descriptor",
        "user=ann",
    ]);
    let ip = &both["descriptors"][0];
    assert_eq!(ip["replaced"][0]["name"], "per_ip");
    assert_eq!(ip["replaced"][0]["by"], serde_json::json!([1]));
    assert_eq!(ip["result"], "no_limit");
    assert_eq!(ip["counters"], serde_json::json!([]));
    assert_eq!(
        both["descriptors"][1]["counters"].as_array().unwrap().len(),
        1
    );

    let alone = one("ip=10.0.0.1");
    assert_eq!(alone["replaced"], serde_json::json!([]));
    assert_eq!(alone["result"], "limited");
}

#[test]
fn share_threshold_counts_every_matching_value_under_one_counter() {
    let a = one("files=a.txt");
    let b = one("files=b.txt");
    assert_eq!(a["entries"][0]["counted_value"], "*");
    assert_eq!(a["shared_counter"], true);
    assert_eq!(a["counters"][0]["counter"], b["counters"][0]["counter"]);
    assert_eq!(a["counters"][0]["redis_key"], b["counters"][0]["redis_key"]);

    let x = one("path=/x");
    let y = one("path=/y");
    assert_eq!(x["shared_counter"], false);
    assert_ne!(x["counters"][0]["counter"], y["counters"][0]["counter"]);
}

#[test]
fn a_request_from_json_shows_its_override_hits_and_redis_keys_under_the_prefix() {
    let body = r#"{"domain":"web","hitsAddend":3,"descriptors":[
        {"entries":[{"key":"path","value":"/exact"}],"limit":{"requestsPerUnit":7,"unit":"HOUR"}},
        {"entries":[{"key":"path","value":"/x"}],"hitsAddend":0}]}"#;
    let (out, stdout, stderr) = run(
        &[("rules.yaml", RULES)],
        &["--request", "-", "--json", "--redis-key-prefix", "rl:"],
        body,
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let x: Value = serde_json::from_str(&stdout).unwrap();
    let o = &x["descriptors"][0];
    assert_eq!(
        o["override"],
        serde_json::json!({"requests_per_unit": 7, "unit": "hour"})
    );
    assert_eq!(o["counters"][0]["source"], "override");
    assert_eq!(o["counters"][0]["limit"]["requests_per_unit"], 7);
    assert!(
        o["counters"][0]["counter"]
            .as_str()
            .unwrap()
            .ends_with("override:fixed_window:hour:7"),
        "{o}"
    );
    assert_eq!(
        (o["hits"].as_u64(), o["hits_from"].as_str()),
        (Some(3), Some("request"))
    );
    let d = &x["descriptors"][1];
    assert_eq!(
        (d["hits"].as_u64(), d["hits_from"].as_str()),
        (Some(0), Some("descriptor"))
    );
    let key = d["counters"][0]["redis_key"].as_str().unwrap();
    assert!(key.starts_with("rl:{"), "{key}");
    assert!(
        key.ends_with("}3:web1:14:path2:/x21:fixed_window:minute:1"),
        "{key}"
    );
}

#[test]
fn an_unknown_domain_is_ok_with_no_limit() {
    let x = explain(&["--domain", "nowhere", "--descriptor", "path=/exact"]);
    assert_eq!(x["known_domain"], false);
    let d = &x["descriptors"][0];
    assert_eq!(d["stop"]["reason"], "unknown_domain");
    assert_eq!(d["result"], "no_limit");
    assert_eq!(matches(d), ["none"]);
}

#[test]
fn the_text_tree_tells_the_walk() {
    let (out, stdout, stderr) = run(
        &[("rules.yaml", RULES)],
        &[
            "--domain",
            "web",
            "--descriptor",
            "path=/api/1/avatar",
            "--descriptor",
            "client=x,method=PUT",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    for line in [
        "descriptor 0",
        "  path = \"/api/1/avatar\": wildcard \"/api/*/avatar\" (rules.yaml:6)",
        "    limit 2 per minute, fixed_window",
        "    redis key sluice:{",
        "  method = \"PUT\": none",
        "  result: no limit",
    ] {
        assert!(stdout.contains(line), "{line:?} in:\n{stdout}");
    }
}

#[test]
fn a_malformed_request_exits_2() {
    let files = [("rules.yaml", RULES)];
    for args in [
        &["--domain", "web", "--descriptor", "path"][..],
        &["--domain", "web", "--descriptor", "=v"],
        &["--request", "-"],
        &["--domain", "web"],
    ] {
        let stdin = "{not json";
        let (out, _, stderr) = run(&files, args, stdin);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.is_empty());
    }
}

#[test]
fn broken_rules_exit_1_with_file_and_line() {
    let (out, _, stderr) = run(
        &[(
            "bad.yaml",
            "domain: b\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n",
        )],
        &["--domain", "b", "--descriptor", "k=v"],
        "",
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr.trim(),
        "bad.yaml:5: invalid rate limit unit 'fortnight'"
    );
}

/// `POST /explain` on the admin port, as JSON.
fn post(sluice: &Sluice, body: &str) -> (u16, String) {
    let (status, _, text) = http(sluice.http, "POST", "/explain", body);
    (status, text)
}

const ONE_PATH: &str =
    r#"{"domain":"web","descriptors":[{"entries":[{"key":"path","value":"/api/1/avatar"}]}]}"#;

#[tokio::test]
async fn http_explain_answers_for_the_rules_in_force_and_follows_a_reload() {
    let sluice = Sluice::start(RULES).await;
    let (status, text) = post(&sluice, ONE_PATH);
    assert_eq!(status, 200, "{text}");
    let x: Value = serde_json::from_str(&text).unwrap();
    let d = &x["descriptors"][0];
    assert_eq!(matches(d), ["wildcard"]);
    assert!(
        d["entries"][0]["rule"]
            .as_str()
            .unwrap()
            .ends_with("rules.yaml:6")
    );
    assert!(
        x["redis_key_prefix"].is_null() && d["counters"][0]["redis_key"].is_null(),
        "the embedded store has no Redis keys"
    );

    std::fs::write(
        sluice.rules.join("rules.yaml"),
        "domain: web\ndescriptors:\n  - key: path\n    rate_limit: {unit: second, requests_per_unit: 9}\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let x: Value = serde_json::from_str(&post(&sluice, ONE_PATH).1).unwrap();
        if x["descriptors"][0]["entries"][0]["match"] == "key" {
            assert_eq!(
                x["descriptors"][0]["rule"]["limits"][0]["requests_per_unit"],
                9
            );
            break;
        }
        assert!(Instant::now() < deadline, "the reload never showed: {x}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn http_explain_answers_400_to_a_malformed_body_and_413_past_the_bound() {
    let sluice =
        Sluice::start_with(&[("rules.yaml", RULES)], &["--max-request-bytes", "1024"]).await;
    let (status, text) = post(&sluice, "{not json");
    assert_eq!(status, 400);
    assert!(text.contains("invalid RateLimitRequest JSON"), "{text}");
    let (status, text) = post(&sluice, r#"{"domain":"web","descriptors":[]}"#);
    assert_eq!(status, 400);
    assert!(text.contains("descriptor list must not be empty"), "{text}");
    let big = format!(
        r#"{{"domain":"{}","descriptors":[{{"entries":[{{"key":"k","value":"v"}}]}}]}}"#,
        "d".repeat(2048)
    );
    assert_eq!(post(&sluice, &big).0, 413);
    assert_eq!(post(&sluice, ONE_PATH).0, 200);
}

#[tokio::test]
async fn explain_stays_on_the_admin_port_when_json_is_switched_off() {
    let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--json-addr", "off"]).await;
    assert_eq!(http(sluice.http, "POST", "/json", ONE_PATH).0, 404);
    assert_eq!(post(&sluice, ONE_PATH).0, 200);
}

/// The Redis key `/explain` names is the very key a request moves, and explaining moves none.
#[tokio::test(flavor = "multi_thread")]
async fn the_redis_key_explain_names_is_the_one_a_request_counts_in() {
    let sluice = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &[]).await;
    let port = Store::Redis.redis().unwrap().ports[0];
    let (status, text) = post(&sluice, ONE_PATH);
    assert_eq!(status, 200, "{text}");
    let x: Value = serde_json::from_str(&text).unwrap();
    let prefix = x["redis_key_prefix"].as_str().expect("the server's prefix");
    let key = x["descriptors"][0]["counters"][0]["redis_key"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(key.starts_with(prefix), "{key}");
    assert_eq!(
        support::redis::cli(port, &["EXISTS", &key]).trim(),
        "0",
        "explaining counts nothing"
    );

    let answer = sluice
        .ask(request("web", &[&[("path", "/api/1/avatar")]]))
        .await;
    assert_eq!(answer.statuses[0].limit_remaining, 1);
    let fields = support::redis::cli(port, &["HVALS", &key]);
    assert_eq!(
        fields.split_whitespace().collect::<Vec<_>>(),
        ["1"],
        "{key}"
    );
}

/// On the embedded store, an explanation between two requests leaves the count as it was.
#[tokio::test]
async fn explaining_leaves_the_embedded_counts_unchanged() {
    in_one_window(MINUTE, async || {
        let sluice = Sluice::start(RULES).await;
        let remaining = |text: String| {
            let v: Value = serde_json::from_str(&text).unwrap();
            v["statuses"][0]["limitRemaining"].as_u64().unwrap_or(0)
        };
        let (status, _, text) = http(sluice.http, "POST", "/json", ONE_PATH);
        assert_eq!(status, 200, "{text}");
        assert_eq!(remaining(text), 1);
        for _ in 0..3 {
            assert_eq!(post(&sluice, ONE_PATH).0, 200);
        }
        let (status, _, text) = http(sluice.http, "POST", "/json", ONE_PATH);
        assert_eq!(status, 200, "{text}");
        assert_eq!(remaining(text), 0, "the second request is the second hit");
    })
    .await;
}

/// The block between the ```` ```lang ```` line after `after` and its closing fence, in `page`.
fn block_after<'a>(page: &'a str, after: &str, lang: &str) -> &'a str {
    let from = page.find(after).expect("the sample's text") + after.len();
    let open = format!("```{lang}\n");
    let start = from + page[from..].find(&open).expect("its block") + open.len();
    let end = start + page[start..].find("```").expect("the block's end");
    &page[start..end]
}

/// docs/rules.md's sample of `sluice explain` is what the command prints for its rules.
#[test]
fn the_manuals_explain_sample_is_what_explain_prints() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/rules.md"))
        .expect("docs/rules.md");
    let command = block_after(&page, "## Explaining a match", "sh").replace("\\\n", " ");
    let rules = block_after(&page, "With these rules in `web.yaml`", "yaml");
    let printed = block_after(&page, "it prints", "");
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("web.yaml"), rules).expect("web.yaml");
    let args: Vec<&str> = command.split_whitespace().skip(1).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .current_dir(dir.path())
        .output()
        .expect("sluice explain runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), printed);
}

/// Offline, `--cluster-name` explains as a replica of that cluster counts: a `scope: cluster`
/// rule's counter and Redis key carry the name, as `/explain` of a replica started with it
/// shows them; without it they carry none.
#[tokio::test]
async fn offline_explain_names_a_cluster_rules_key_as_a_replica_of_that_cluster_does() {
    const SCOPED: &str = "domain: d\ndescriptors:\n  - key: k\n    scope: cluster\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";
    let offline = |args: &[&str]| {
        let mut all = vec!["--json", "--domain", "d", "--descriptor", "k=v"];
        all.extend_from_slice(args);
        let (out, stdout, stderr) = run(&[("rules.yaml", SCOPED)], &all, "");
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let x: Value = serde_json::from_str(&stdout).expect("JSON output");
        x["descriptors"][0]["counters"][0]["redis_key"]
            .as_str()
            .expect("a Redis key")
            .to_owned()
    };
    let named = offline(&["--cluster-name", "eu", "--redis-key-prefix", "p:"]);
    let sluice = Sluice::on(
        Store::Redis,
        &[("rules.yaml", SCOPED)],
        &["--cluster-name", "eu", "--redis-key-prefix", "p:"],
    )
    .await;
    let (status, text) = post(
        &sluice,
        r#"{"domain":"d","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#,
    );
    assert_eq!(status, 200, "{text}");
    let served: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        served["descriptors"][0]["counters"][0]["redis_key"].as_str(),
        Some(named.as_str()),
        "offline and served name one key"
    );
    assert!(named.contains("eu"), "{named}");
    let unnamed = offline(&["--redis-key-prefix", "p:"]);
    assert_ne!(unnamed, named);
}
