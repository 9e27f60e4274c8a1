//! `sluice check-config`: exit 0 for valid rules, else one `file:line: message` per error and a
//! non-zero exit.

use std::process::Command;

fn check(files: &[(&str, &str)]) -> (bool, String) {
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
    (out.status.success(), text)
}

#[test]
fn valid_rules_exit_zero() {
    let (ok, out) = check(&[(
        "a.yaml",
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )]);
    assert!(ok, "{out}");
}

#[test]
fn a_broken_file_prints_file_and_line_and_exits_non_zero() {
    let (ok, out) = check(&[
        ("good.yaml", "domain: a\ndescriptors:\n  - key: k\n"),
        (
            "bad.yaml",
            "domain: b\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n",
        ),
    ]);
    assert!(!ok);
    assert_eq!(
        out.trim(),
        "bad.yaml:5: invalid rate limit unit 'fortnight'"
    );
}

#[test]
fn every_error_of_every_file_is_listed() {
    let (ok, out) = check(&[
        ("one.yaml", "domain: \"\"\n"),
        (
            "two.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    bogus: 1\n  - value: v\n",
        ),
        ("three.yml", "domain: d\n"),
        ("four.yaml", "\ndomain: d\n"),
        ("ignored.txt", "not: rules"),
    ]);
    assert!(!ok);
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
fn a_missing_path_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check-config", "/nonexistent/rules"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("/nonexistent/rules:0: cannot read"));
}
