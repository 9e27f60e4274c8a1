//! Rule files written to hurt: nesting deep enough to overflow a stack, `metadata` too deep for
//! a protobuf decoder, files large enough to stall the process that parses them, reload storms
//! and entries that cannot be read. `check-config` reports each at its `file:line` and exits 1;
//! a running sluice refuses it on reload, keeps the rules in force and keeps answering.

use std::net::SocketAddr;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use envoy_types::pb::google::protobuf::{Struct, value::Kind};
use support::metrics::scrape;
use support::redis::signal;
use support::{
    FREED_PAGES_RETURNED, HOUR, OK, OVER_LIMIT, Sluice, Wait, bytes_per_rule, eventually, http,
    in_one_window, linked_from_outside, outside_file, request, settled_resident_kb, steady,
};

/// The deepest `descriptors`, `metadata` and YAML nesting a rule file may have, and the most
/// keys of a quota bucket (as sluice names them).
const MOST_DESCRIPTOR_DEPTH: usize = 32;
const MOST_METADATA_DEPTH: usize = 16;
const MOST_BUCKET_KEYS: usize = 32;
const MOST_YAML_DEPTH: usize = 1 + 2 * MOST_DESCRIPTOR_DEPTH + MOST_METADATA_DEPTH;

const WEB: &str = "domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2}
";

/// `sluice check-config` on a directory holding `files` (name, text), with extra `flags`: its
/// exit status and its output, the directory's path taken out.
fn check(files: &[(&str, &str)], flags: &[&str]) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    check_dir(dir.path(), flags)
}

fn check_dir(dir: &Path, flags: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("check-config")
        .arg(dir)
        .args(flags)
        .output()
        .expect("sluice runs");
    let text = String::from_utf8_lossy(&out.stdout).replace(&format!("{}/", dir.display()), "");
    (out.status, text)
}

/// Writes `text` to `dir/name` as an editor or kubelet replaces a file: written beside it, then
/// renamed over it, so that a reload never reads it half written.
fn replace(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("file written");
    std::fs::rename(&tmp, dir.join(name)).expect("file renamed");
}

/// Failed reloads so far.
fn failed_reloads(sluice: &Sluice) -> f64 {
    scrape(sluice.http)
        .get("sluice_rule_reloads_total", &[("result", "failed")])
        .unwrap_or(0.0)
}

/// Waits until a reload has failed with `error` logged, then checks that the process runs and
/// that the rule of `WEB` still holds: 2 per hour.
async fn refused_and_rules_stay(sluice: &mut Sluice, error: &str) {
    eventually(
        "the reload is refused",
        Duration::from_secs(20),
        async || sluice.log_text().contains(error) && failed_reloads(sluice) >= 1.0,
    )
    .await;
    assert!(sluice.alive(), "sluice still runs");
    // A value of its own each run: a run that saw the hour end counts nothing into the next.
    let mut run = 0;
    in_one_window(HOUR, async || {
        run += 1;
        let value = format!("u{run}");
        let user = || request("web", &[&[("user", value.as_str())]]);
        assert_eq!(sluice.ask(user()).await.overall_code, OK);
        assert_eq!(sluice.ask(user()).await.overall_code, OK);
        assert_eq!(
            sluice.ask(user()).await.overall_code,
            OVER_LIMIT,
            "the limit of 2 in force before holds"
        );
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Nesting

/// The file: 40,000 block sequences nested in one line of `metadata` (80 KB).
fn deep_sequences() -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: k\n    metadata:\n      - {}1\n",
        "- ".repeat(40_000)
    )
}

/// `levels` mappings nested under an unknown top-level key, one per line from line 3.
fn deep_mappings_under_an_unknown_key(levels: usize) -> String {
    let mut text = String::from("domain: d\nextra:\n");
    for i in 0..levels {
        text.push_str(&format!("{}a:\n", "  ".repeat(i + 1)));
    }
    text
}

#[test]
fn check_config_refuses_yaml_nested_past_the_cap_at_the_line_that_passes_it() {
    let past_the_cap = |line: usize| {
        format!("rules.yaml:{line}: YAML collections nest deeper than {MOST_YAML_DEPTH} levels")
    };
    let (status, out) = check(&[("rules.yaml", &deep_sequences())], &[]);
    assert_eq!(status.code(), Some(1), "{status}: {out}");
    assert_eq!(out.trim(), past_the_cap(5));

    let under_unknown_key = format!("domain: d\nextra:\n  {}1\n", "- ".repeat(40_000));
    let (status, out) = check(&[("rules.yaml", &under_unknown_key)], &[]);
    assert_eq!(status.code(), Some(1), "{status}: {out}");
    assert_eq!(out.trim(), past_the_cap(3));

    // The top mapping is level 1 and `extra`'s value level 2, on line 3: the mapping on line
    // n is level n - 1.
    let (status, out) = check(
        &[("rules.yaml", &deep_mappings_under_an_unknown_key(300))],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{status}: {out}");
    assert_eq!(out.trim(), past_the_cap(MOST_YAML_DEPTH + 2));
}

/// Rules nested `levels` deep, each rule on its own lines, the deepest with a limit.
fn nested_rules(levels: usize) -> String {
    let mut text = String::from("domain: d\ndescriptors:\n");
    for i in 0..levels {
        let indent = "    ".repeat(i);
        text.push_str(&format!("{indent}  - key: k{i}\n"));
        if i + 1 < levels {
            text.push_str(&format!("{indent}    descriptors:\n"));
        } else {
            text.push_str(&format!(
                "{indent}    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
            ));
        }
    }
    text
}

/// A rule whose `metadata` nests `levels` deep, one mapping per line from line 5: a list at
/// the deepest level.
fn rule_with_metadata(levels: usize) -> String {
    let mut text = String::from(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 100}\n    metadata:\n",
    );
    for i in 1..levels {
        text.push_str(&format!("{}m{i}:\n", "  ".repeat(i + 2)));
    }
    text.push_str(&format!("{}- deepest\n", "  ".repeat(levels + 2)));
    text
}

/// A quota bucket rule matching `keys` keys.
fn bucket_of(keys: usize) -> String {
    let bucket: Vec<String> = (0..keys).map(|i| format!("k{i}: v")).collect();
    format!(
        "domain: d\nquota_buckets:\n  - rate_limit: {{unit: minute, requests_per_unit: 1}}\n    bucket: {{{}}}\n",
        bucket.join(", ")
    )
}

#[test]
fn rules_at_each_cap_are_valid_and_one_level_past_it_is_an_error_at_its_line() {
    for valid in [
        nested_rules(MOST_DESCRIPTOR_DEPTH),
        rule_with_metadata(MOST_METADATA_DEPTH),
        bucket_of(MOST_BUCKET_KEYS),
    ] {
        let (status, out) = check(&[("rules.yaml", &valid)], &[]);
        assert!(status.success(), "{out}\n{valid}");
    }

    let (status, out) = check(
        &[("rules.yaml", &nested_rules(MOST_DESCRIPTOR_DEPTH + 1))],
        &[],
    );
    assert_eq!(status.code(), Some(1));
    // Rule n (from 0) is on line 3 + 2n.
    assert_eq!(
        out.trim(),
        format!(
            "rules.yaml:{}: descriptors nest deeper than {MOST_DESCRIPTOR_DEPTH} levels",
            3 + 2 * MOST_DESCRIPTOR_DEPTH
        )
    );

    let (status, out) = check(
        &[("rules.yaml", &rule_with_metadata(MOST_METADATA_DEPTH + 1))],
        &[],
    );
    assert_eq!(status.code(), Some(1));
    // Level 1 is the value of `metadata`, on line 6; level n on line n + 5.
    assert_eq!(
        out.trim(),
        format!(
            "rules.yaml:{}: metadata nests deeper than {MOST_METADATA_DEPTH} levels",
            MOST_METADATA_DEPTH + 6
        )
    );

    let (status, out) = check(&[("rules.yaml", &bucket_of(MOST_BUCKET_KEYS + 1))], &[]);
    assert_eq!(status.code(), Some(1));
    assert_eq!(
        out.trim(),
        format!(
            "rules.yaml:4: a quota bucket matches at most {MOST_BUCKET_KEYS} keys, this one {}",
            MOST_BUCKET_KEYS + 1
        )
    );
}

/// The file, dropped into `--config` of a running sluice: refused at its line, and the
/// process keeps serving its rules.
#[tokio::test]
async fn deep_nesting_landing_in_config_is_refused_and_the_rules_in_force_stay() {
    let mut sluice = Sluice::start(WEB).await;
    replace(&sluice.rules, "deep.yaml", &deep_sequences());
    let error = format!(
        "{}:5: YAML collections nest deeper than {MOST_YAML_DEPTH} levels",
        sluice.rules.join("deep.yaml").display()
    );
    refused_and_rules_stay(&mut sluice, &error).await;
}

// ---------------------------------------------------------------------------------------------
// Metadata

/// How deep a protobuf `Struct` nests, counting each message (a `Struct`, `Value` or
/// `ListValue`) as one level, as protobuf decoders count their recursion.
fn struct_depth(s: &Struct) -> usize {
    1 + s.fields.values().map(value_depth).max().unwrap_or(0)
}

fn value_depth(v: &envoy_types::pb::google::protobuf::Value) -> usize {
    1 + match &v.kind {
        Some(Kind::StructValue(s)) => struct_depth(s),
        Some(Kind::ListValue(l)) => 1 + l.values.iter().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// With `--response-dynamic-metadata`, metadata at the cap under rules nested to the cap comes
/// back to a protobuf client (prost, which like Envoy refuses more than 100 levels); metadata
/// one level deeper is refused on reload at its line, and the rules in force stay.
#[tokio::test]
async fn metadata_at_the_cap_reaches_a_protobuf_client_and_deeper_metadata_is_refused() {
    let mut deepest = nested_rules(MOST_DESCRIPTOR_DEPTH);
    let indent = "    ".repeat(MOST_DESCRIPTOR_DEPTH - 1);
    deepest.push_str(&format!("{indent}    metadata:\n"));
    for i in 1..MOST_METADATA_DEPTH {
        deepest.push_str(&format!("{indent}{}m{i}:\n", "  ".repeat(i + 2)));
    }
    deepest.push_str(&format!(
        "{indent}{}- deepest\n",
        "  ".repeat(MOST_METADATA_DEPTH + 2)
    ));
    let mut sluice = Sluice::start_with(
        &[("rules.yaml", &deepest), ("web.yaml", WEB)],
        &["--response-dynamic-metadata"],
    )
    .await;
    let keys: Vec<String> = (0..MOST_DESCRIPTOR_DEPTH)
        .map(|i| format!("k{i}"))
        .collect();
    let entries: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "x")).collect();
    let answer = sluice.ask(request("d", &[&entries])).await;
    assert_eq!(answer.overall_code, OK);
    let metadata = answer.dynamic_metadata.expect("dynamic metadata");
    let Some(Kind::StructValue(rule)) = metadata.fields["metadata"].kind.as_ref() else {
        panic!("the rule's metadata: {metadata:?}");
    };
    // The rule's metadata is a mapping MOST_METADATA_DEPTH collections deep: each level one
    // Struct or ListValue and the Value holding it.
    assert_eq!(struct_depth(rule), 2 * MOST_METADATA_DEPTH);
    assert!(struct_depth(&metadata) < 100);

    replace(
        &sluice.rules,
        "rules.yaml",
        &rule_with_metadata(MOST_METADATA_DEPTH + 1),
    );
    let error = format!(
        "{}:{}: metadata nests deeper than {MOST_METADATA_DEPTH} levels",
        sluice.rules.join("rules.yaml").display(),
        MOST_METADATA_DEPTH + 6
    );
    refused_and_rules_stay(&mut sluice, &error).await;
}

// ---------------------------------------------------------------------------------------------
// /config

/// Sends GET `path` to `addr` and returns the status, the body's length and how long it took.
fn timed_get(addr: SocketAddr, path: &str) -> (u16, usize, Duration) {
    let started = Instant::now();
    let (status, _, body) = http(addr, "GET", path, "");
    (status, body.len(), started.elapsed())
}

/// `rules` rules, each with metadata nested `MOST_METADATA_DEPTH` deep in flow style.
fn rules_with_metadata_at_the_cap(rules: usize) -> String {
    let mut metadata = String::from("x");
    for i in 0..MOST_METADATA_DEPTH {
        metadata = format!("{{m{i}: {metadata}}}");
    }
    let mut text = String::from("domain: meta\ndescriptors:\n");
    for n in 0..rules {
        text.push_str(&format!(
            "  - key: k\n    value: v{n}\n    rate_limit: {{unit: hour, requests_per_unit: 5}}\n    metadata: {metadata}\n"
        ));
    }
    text
}

/// A rule whose metadata nests 5,000 levels (10 KB, which `/config` would render as hundreds of
/// MB) is refused. `/config` of a file whose metadata sits at the cap is a few times the file's
/// size, and `/healthz` answers within 1 s while `/config` renders.
#[tokio::test]
async fn config_renders_in_size_linear_in_the_file_and_healthz_answers_meanwhile() {
    let rules = rules_with_metadata_at_the_cap(2_000);
    let mut sluice = Sluice::start_with(&[("meta.yaml", &rules), ("web.yaml", WEB)], &[]).await;
    let deep = format!(
        "domain: deep\ndescriptors:\n  - key: k\n    metadata:\n      a:\n        {}1\n",
        "- ".repeat(5_000)
    );
    replace(&sluice.rules, "deep.yaml", &deep);
    let error = format!(
        "{}:6: YAML collections nest deeper than {MOST_YAML_DEPTH} levels",
        sluice.rules.join("deep.yaml").display()
    );
    refused_and_rules_stay(&mut sluice, &error).await;

    let files = rules.len() + WEB.len();
    let http = sluice.http;
    let renders: Vec<_> = (0..3)
        .map(|_| std::thread::spawn(move || timed_get(http, "/config")))
        .collect();
    let probes = std::thread::spawn(move || {
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let (status, _, took) = timed_get(http, "/healthz");
            assert_eq!(status, 200);
            slowest = slowest.max(took);
            std::thread::sleep(Duration::from_millis(25));
        }
        slowest
    });
    for render in renders {
        let (status, size, _) = render.join().unwrap();
        assert_eq!(status, 200);
        assert!(
            size < 20 * files,
            "/config is {size} bytes for files of {files}"
        );
    }
    let slowest = probes.join().unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "/healthz took {slowest:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Large files

/// `rules` rules, one per value, as a generated rule file has them.
fn many_rules(domain: &str, rules: usize) -> String {
    let mut text = format!("domain: {domain}\ndescriptors:\n");
    for n in 0..rules {
        text.push_str(&format!(
            "  - key: k\n    value: v{n:07}\n    rate_limit: {{unit: second, requests_per_unit: 5}}\n"
        ));
    }
    text
}

/// While a large rule file (2 MB, 28,000 rules) is loaded, `/healthz` and a decision on the
/// rules already loaded each answer within 1 s, every 100 ms, until the new rules are in force.
#[tokio::test(flavor = "multi_thread")]
async fn healthz_and_decisions_answer_while_a_large_rule_file_loads() {
    let sluice = Sluice::start_with(&[("web.yaml", WEB)], &["--log-level", "info"]).await;
    let big = many_rules("big", 28_000);
    assert!(big.len() > 2_000_000);
    let mut client = sluice.client().await;
    let http = sluice.http;
    replace(&sluice.rules, "big.yaml", &big);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut probes = 0;
    while !sluice.log_text().contains("file change: rules reloaded") {
        assert!(
            Instant::now() < deadline,
            "the large file is loaded within 120 s"
        );
        let (status, _, took) = tokio::task::spawn_blocking(move || timed_get(http, "/healthz"))
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
        let started = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_secs(1),
            client.should_rate_limit(request("web", &[&[("other", "o")]])),
        )
        .await;
        assert!(
            answer.is_ok_and(|a| a.is_ok()),
            "a decision within 1 s (took {:?})",
            started.elapsed()
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(probes > 0);
    let answer = sluice.ask(request("big", &[&[("k", "v0027999")]])).await;
    assert_eq!(
        answer.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(5)
    );
}

/// Rules loaded to measure what each one holds.
const MEASURED_RULES: usize = 20_000;
/// The most resident memory one rule of `many_rules` may add, in bytes.
const MOST_BYTES_PER_RULE: u64 = 450;

/// 20,000 rules add under `MOST_BYTES_PER_RULE` each to the resident memory of a sluice started
/// with them, against one started with one rule, the allocator told to return freed pages at
/// once so that only what the rules hold counts.
#[tokio::test(flavor = "multi_thread")]
async fn a_rule_holds_under_450_bytes() {
    let resident_kb = async |rules: usize| {
        let files = [("big.yaml", many_rules("big", rules))];
        let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (*n, t.as_str())).collect();
        let sluice = Sluice::spawn(&files, &[], FREED_PAGES_RETURNED, Wait::Serving).await;
        settled_resident_kb(sluice.pid()).await
    };
    let per_rule = bytes_per_rule(MEASURED_RULES, 1, resident_kb).await;
    assert!(per_rule < MOST_BYTES_PER_RULE, "{per_rule} bytes a rule");
}

/// The most resident memory one rule of `many_rules` may add when reloaded: the rule and what
/// the allocator keeps of the reload's reading and building.
const MOST_BYTES_PER_RELOADED_RULE: u64 = 800;

/// The same 20,000 rules, reloaded in place of one, add under `MOST_BYTES_PER_RELOADED_RULE`
/// each once in force and settled: the thread that read and built them has ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_rule_reloaded_holds_under_800_bytes() {
    let resident_kb = async |rules: usize| {
        let one = many_rules("big", 1);
        let files = [("big.yaml", one.as_str())];
        let sluice = Sluice::spawn(&files, &[], FREED_PAGES_RETURNED, Wait::Serving).await;
        if rules > 1 {
            replace(&sluice.rules, "big.yaml", &many_rules("big", rules));
            let last = format!("v{:07}", rules - 1);
            eventually(
                "the new rules decide",
                Duration::from_secs(20),
                async || {
                    let answer = sluice.ask(request("big", &[&[("k", &last)]])).await;
                    answer.statuses[0].current_limit.is_some()
                },
            )
            .await;
        }
        settled_resident_kb(sluice.pid()).await
    };
    let per_rule = bytes_per_rule(MEASURED_RULES, 1, resident_kb).await;
    assert!(
        per_rule < MOST_BYTES_PER_RELOADED_RULE,
        "{per_rule} bytes a rule"
    );
}

/// Past `--max-config-bytes` (across the directory), a reload is refused with an error naming
/// the file, the size and the flag, before the file is read; `check-config` says the same.
#[tokio::test]
async fn rule_files_past_max_config_bytes_are_refused_naming_file_size_and_flag() {
    let big = many_rules("big", 300);
    assert!(big.len() > 20_000);
    let (status, out) = check(
        &[("big.yaml", &big), ("web.yaml", WEB)],
        &["--max-config-bytes", "20000"],
    );
    assert_eq!(status.code(), Some(1), "{out}");
    assert_eq!(
        out.trim(),
        format!(
            "big.yaml:0: the rule files come to {} bytes with this one ({} bytes), more than --max-config-bytes (20000)",
            big.len(),
            big.len()
        )
    );

    // Read after web.yaml, which counts towards the bound.
    let mut sluice =
        Sluice::start_with(&[("web.yaml", WEB)], &["--max-config-bytes", "20000"]).await;
    replace(&sluice.rules, "x-big.yaml", &big);
    let error = format!(
        "{}:0: the rule files come to {} bytes with this one ({} bytes), more than --max-config-bytes (20000)",
        sluice.rules.join("x-big.yaml").display(),
        big.len() + WEB.len(),
        big.len()
    );
    refused_and_rules_stay(&mut sluice, &error).await;
}

// ---------------------------------------------------------------------------------------------
// Reloading

/// 1,000 SIGHUPs, about 1 ms apart, make one reload per 200 ms at most (and one more for the
/// last), not one each. The file is broken, so each reload is counted as a failed one.
#[tokio::test]
async fn a_storm_of_sighups_is_coalesced_into_one_reload_per_200ms() {
    let sluice = Sluice::start_prepared(linked_from_outside(WEB), &[]).await;
    std::fs::write(outside_file(&sluice.rules), "domain: web\n  bad: indent\n").unwrap();
    let started = Instant::now();
    for _ in 0..1_000 {
        signal(sluice.pid(), "HUP");
    }
    let took = started.elapsed();
    // Every signal is taken: the last reload comes at most 200 ms after the last one, so the
    // count is final once it has not moved for half a second.
    let reloads = steady(Duration::from_millis(500), Duration::from_secs(10), || {
        failed_reloads(&sluice)
    })
    .await;
    let most = 2.0 + (took.as_millis() / 200) as f64;
    assert!(
        (1.0..=most).contains(&reloads),
        "{reloads} reloads for 1,000 SIGHUPs in {took:?} (at most {most})"
    );
}

/// A file rewritten every 50 ms never settles for 200 ms: it is reloaded all the same, within
/// the longest wait after the first change.
#[tokio::test]
async fn a_file_rewritten_without_pause_is_reloaded_within_the_longest_wait() {
    let sluice = Sluice::start(WEB).await;
    let changed = WEB.replace("requests_per_unit: 2", "requests_per_unit: 3");
    let until = Instant::now() + Duration::from_secs(8);
    let rules = sluice.rules.clone();
    let writer = std::thread::spawn(move || {
        while Instant::now() < until {
            replace(&rules, "rules.yaml", &changed);
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let limit = async || {
        let mut check = request("web", &[&[("user", "probe")]]);
        check.descriptors[0].hits_addend =
            Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
        let answer = sluice.ask(check).await;
        answer.statuses[0]
            .current_limit
            .as_ref()
            .map_or(0, |l| l.requests_per_unit)
    };
    let started = Instant::now();
    while limit().await != 3 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the new limit is in force within 5 s while the file keeps changing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(Instant::now() < until, "reloaded while the writes went on");
    writer.join().unwrap();
}

/// A directory named like a rule file, a symlink loop and a link to nothing are errors at line
/// 0, for `check-config` and for a reload alike; none is skipped without a word.
#[tokio::test]
async fn entries_that_cannot_be_read_are_reported_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("web.yaml"), WEB).unwrap();
    std::fs::create_dir(dir.path().join("dir.yaml")).unwrap();
    symlink("loop-b.yaml", dir.path().join("loop-a.yaml")).unwrap();
    symlink("loop-a.yaml", dir.path().join("loop-b.yaml")).unwrap();
    symlink("nowhere", dir.path().join("gone.yml")).unwrap();
    let (status, out) = check_dir(dir.path(), &[]);
    assert_eq!(status.code(), Some(1), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[0].starts_with("dir.yaml:0: not a file"), "{out}");
    assert!(lines[1].starts_with("gone.yml:0: cannot read: "), "{out}");
    assert!(
        lines[2].starts_with("loop-a.yaml:0: cannot read: "),
        "{out}"
    );
    assert!(
        lines[3].starts_with("loop-b.yaml:0: cannot read: "),
        "{out}"
    );

    let mut sluice = Sluice::start(WEB).await;
    std::fs::create_dir(sluice.rules.join("dir.yaml")).unwrap();
    let error = format!("{}:0: not a file", sluice.rules.join("dir.yaml").display());
    refused_and_rules_stay(&mut sluice, &error).await;
}
