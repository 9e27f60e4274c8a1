//! `sluice check-config`: exit 0 for valid rules, else one `file:line: message` per error and a
//! non-zero exit.

use std::process::{Command, ExitStatus};

pub(crate) fn check(files: &[(&str, &str)]) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("check-config")
        .arg(dir.path())
        .output()
        .expect("sluice runs");
    let text =
        String::from_utf8_lossy(&out.stdout).replace(&format!("{}/", dir.path().display()), "");
    (out.status, text)
}

#[test]
fn valid_rules_exit_zero() {
    let (status, out) = check(&[(
        "a.yaml",
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )]);
    assert!(status.success(), "{out}");
}

#[test]
fn a_broken_file_prints_file_and_line_and_exits_non_zero() {
    let (status, out) = check(&[
        ("good.yaml", "domain: a\ndescriptors:\n  - key: k\n"),
        (
            "bad.yaml",
            "domain: b\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n",
        ),
    ]);
    assert!(!status.success());
    assert_eq!(
        out.trim(),
        "bad.yaml:5: invalid rate limit unit 'fortnight'"
    );
}

#[test]
fn every_error_of_every_file_is_listed() {
    let (status, out) = check(&[
        ("one.yaml", "domain: \"\"\n"),
        (
            "two.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    bogus: 1\n  - value: v\n",
        ),
        ("three.yml", "domain: d\n"),
        ("four.yaml", "\ndomain: d\n"),
        ("ignored.txt", "not: rules"),
    ]);
    assert!(!status.success());
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "one.yaml:1: config file cannot have empty domain",
            "two.yaml:4: config error, unknown key 'bogus'",
            "two.yaml:5: descriptor has empty key",
            "three.yml:1: duplicate domain 'd' in config file",
        ]
    );
}

#[test]
fn a_unit_multiplier_making_the_window_longer_than_ten_years_is_an_error_at_its_line() {
    let (status, out) = check(&[
        (
            "long.yaml",
            "\
domain: long
descriptors:
  - key: days
    rate_limit:
      unit: day
      unit_multiplier: 3651
  - key: seconds
    rate_limits:
      - unit: second
        requests_per_unit: 1
        unit_multiplier: 4294967295
",
        ),
        // Exactly ten years is the longest window allowed.
        (
            "ten.yaml",
            "domain: ten\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, unit_multiplier: 10}\n",
        ),
    ]);
    assert_eq!(status.code(), Some(1), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "long.yaml:6: unit_multiplier 3651 makes the window longer than 3650 days (10 years)",
            "long.yaml:11: unit_multiplier 4294967295 makes the window longer than 3650 days (10 years)",
        ]
    );
}

#[test]
fn a_missing_path_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check-config", "/nonexistent/rules"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("/nonexistent/rules:0: cannot read"));
}

/// `burst` belongs to buckets and is at least 1; a bucket holds at most 2^51 units (burst × window
/// in ms: a day's leaky bucket of 26,062,497 is the largest); a sliding log keeps at most 1,000.
#[test]
fn an_algorithms_bounds_are_errors_at_their_lines() {
    let (status, out) = check(&[(
        "algorithms.yaml",
        "\
domain: algorithms
descriptors:
  - key: fixed
    rate_limit:
      unit: second
      requests_per_unit: 5
      burst: 10
  - key: empty
    rate_limit:
      unit: second
      requests_per_unit: 5
      algorithm: token_bucket
      burst: 0
  - key: logs
    rate_limits:
      - {unit: hour, requests_per_unit: 1000, algorithm: sliding_log}
      - {unit: day, requests_per_unit: 1001, algorithm: sliding_log}
  - key: buckets
    rate_limits:
      - {unit: day, requests_per_unit: 26062497, algorithm: leaky_bucket}
      - {unit: hour, requests_per_unit: 1, algorithm: token_bucket, burst: 625499949}
  - key: huge
    rate_limit:
      unit: year
      requests_per_unit: 4000000000
      algorithm: token_bucket
  - key: other
    rate_limits:
      - {unit: second, requests_per_unit: 1, algorithm: sliding_window, burst: 2}
      - {unit: minute, requests_per_unit: 1, algorithm: gcra}
",
    )]);
    assert_eq!(status.code(), Some(1), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "algorithms.yaml:7: burst applies to token_bucket and leaky_bucket, not fixed_window",
            "algorithms.yaml:13: burst must be at least 1",
            "algorithms.yaml:17: sliding_log keeps an entry per hit: requests_per_unit must be at most 1000 (this one is 1001)",
            "algorithms.yaml:21: a token_bucket holding 625499949 over a 3600 s window is beyond exact arithmetic (burst × window in ms must be at most 2^51)",
            "algorithms.yaml:25: a token_bucket holding 4000000000 over a 31536000 s window is beyond exact arithmetic (burst × window in ms must be at most 2^51)",
            "algorithms.yaml:29: burst applies to token_bucket and leaky_bucket, not sliding_window",
            "algorithms.yaml:30: invalid algorithm 'gcra' (expected fixed_window, sliding_window, sliding_log, token_bucket or leaky_bucket)",
        ]
    );
}

/// The two messages whose wording names more than the offending entry, worded exactly as
/// envoyproxy/ratelimit's: a composite key from the domain down, a list element as Go prints it.
#[test]
fn composite_keys_and_non_map_elements_are_named_as_envoy_ratelimit_names_them() {
    let (status, out) = check(&[
        (
            "duplicate.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n  - key: key1\n    value: value1\n",
        ),
        (
            "list.yaml",
            "domain: list\ndescriptors:\n  - a\n  - [b, c]\n",
        ),
    ]);
    assert_eq!(status.code(), Some(1), "{out}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "duplicate.yaml:5: duplicate descriptor composite key 'test-domain.key1_value1'",
            "list.yaml:3: config error, yaml file contains list of type other than map: a",
            "list.yaml:4: config error, yaml file contains list of type other than map: [b c]",
        ]
    );
}

#[test]
fn counting_and_shadow_mode_with_quota_mode_are_accepted() {
    let (status, out) = check(&[(
        "r.yaml",
        "domain: d\ndescriptors:\n  - key: k\n    counting: always\n    shadow_mode: true\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: j\n    counting: admitted\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )]);
    assert!(status.success(), "{out}");
}

#[test]
fn an_unknown_counting_is_an_error_at_its_line() {
    let (status, out) = check(&[(
        "r.yaml",
        "domain: d\ndescriptors:\n  - key: k\n    counting: sometimes\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )]);
    assert!(!status.success());
    assert_eq!(
        out.trim(),
        "r.yaml:4: invalid counting 'sometimes': admitted or always"
    );
}

#[test]
fn a_files_errors_are_listed_in_line_order_whichever_check_found_them() {
    let (status, out) = check(&[(
        "a.yaml",
        "domain: a\ndescriptors:\n  - key: x\n    bogus: 2\n  - key: x\n    rate_limit: {unit: parsec, requests_per_unit: 1}\n",
    )]);
    assert!(!status.success());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "a.yaml:4: config error, unknown key 'bogus'",
            "a.yaml:5: duplicate descriptor composite key 'a.x'",
            "a.yaml:6: invalid rate limit unit 'parsec'",
        ]
    );
}

#[test]
fn a_directory_without_a_domain_is_refused_as_serve_refuses_it() {
    let (status, out) = check(&[("notes.txt", "not rules")]);
    assert!(!status.success(), "{out}");
    assert!(out.contains("no .yaml or .yml file with a domain"), "{out}");
}

#[test]
fn a_calendar_window_that_makes_no_sense_is_an_error_at_its_line() {
    let (status, out) = check(&[(
        "billing.yaml",
        "domain: billing\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: month\n      requests_per_unit: 1000000\n      calendar:\n        time_zone: Europe/Berln\n  - key: user\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      calendar: true\n  - key: team\n    rate_limit: {unit: week, requests_per_unit: 5, calendar: {week_starts: sunday, anchor_day: 3}}\n",
    )]);
    assert!(!status.success());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "billing.yaml:8: calendar: unknown time zone 'Europe/Berln' (an IANA name such as Europe/Berlin, or UTC)",
            "billing.yaml:13: a calendar window is a day, a week, a month or a year, not a second",
            "billing.yaml:15: calendar: anchor_day applies to unit: month",
        ]
    );
}
