//! envoyproxy/ratelimit's own rule-file fixtures (its `test/config/*.yaml`, copied into
//! `tests/fixtures/envoyproxy-ratelimit/` under its Apache-2.0 license): `sluice check-config`
//! loads the files its `config_test.go` loads and rejects the others with its exact message,
//! after sluice's `file:line: `; a running sluice answers, for the files that load, what that
//! test asks of the loaded configuration (each descriptor's limit, the rule it matches, the names
//! of its metrics). `--merge-domains` joins the merge fixtures as its `MERGE_DOMAIN_CONFIG` does.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use support::metrics::scrape;
use support::redis::signal;
use support::{MINUTE, OK, OVER_LIMIT, Sluice, http, in_one_window, request};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/envoyproxy-ratelimit")
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(fixtures().join(name)).expect("a fixture")
}

/// `sluice check-config [flags] path`: whether it succeeded, and what it printed on stdout.
fn check_config(path: &Path, flags: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("check-config")
        .args(flags)
        .arg(path)
        .output()
        .expect("sluice runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// `check-config` on a directory holding the given fixtures, each under the name given: its
/// success and output, with the directory's path cut from the output.
fn check_together(files: &[(&str, &str)], flags: &[&str]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    for (name, source) in files {
        std::fs::write(dir.path().join(name), fixture(source)).unwrap();
    }
    let (ok, out) = check_config(dir.path(), flags);
    (ok, out.replace(&format!("{}/", dir.path().display()), ""))
}

/// The fixtures `config_test.go` loads on their own.
const LOADING: &[&str] = &[
    "basic_config.yaml",
    "duplicate_domain.yaml",
    "merge_domain_key1.yaml",
    "merge_domain_key2.yaml",
    "metadata.yaml",
    "shadowmode_config.yaml",
    "share_threshold.yaml",
    "wildcard.yaml",
];

/// The fixtures it rejects on their own: (file, the line sluice names, envoyproxy/ratelimit's
/// message). sluice lists every error of a file where envoyproxy/ratelimit stops at the first:
/// `ALSO` has the further lines of the files that have more than one.
const FAILING: &[(&str, usize, &str)] = &[
    ("bad_limit_unit.yaml", 6, "invalid rate limit unit 'foo'"),
    (
        "bad_yaml.yaml",
        2,
        "error loading config file: yaml: line 2: found unexpected end of stream",
    ),
    (
        "duplicate_key.yaml",
        6,
        "duplicate descriptor composite key 'test-domain.key1_value1'",
    ),
    (
        "empty_domain.yaml",
        1,
        "config file cannot have empty domain",
    ),
    ("empty_key.yaml", 3, "descriptor has empty key"),
    (
        "misspelled_key.yaml",
        5,
        "config error, unknown key 'ratelimit'",
    ),
    (
        "misspelled_key2.yaml",
        7,
        "config error, unknown key 'requestsperunit'",
    ),
    (
        "non_map_list.yaml",
        3,
        "config error, yaml file contains list of type other than map: a",
    ),
    (
        "non_string_key.yaml",
        1,
        "config error, key is not of type string: 0.25",
    ),
    (
        "replaces_empty.yaml",
        10,
        "should not have an empty replaces entry",
    ),
    (
        "replaces_self.yaml",
        10,
        "replaces should not contain name of same descriptor",
    ),
    (
        "unlimited_with_unit.yaml",
        5,
        "should not specify rate limit unit when unlimited",
    ),
];

const ALSO: &[(&str, &[&str])] = &[
    (
        "non_map_list.yaml",
        &[
            "4: config error, yaml file contains list of type other than map: b",
            "5: config error, yaml file contains list of type other than map: c",
        ],
    ),
    // Its domain's key is the number 0.25: the file has no `domain`.
    (
        "non_string_key.yaml",
        &["1: config file cannot have empty domain"],
    ),
];

#[test]
fn every_fixture_is_asserted() {
    let mut listed: Vec<&str> = LOADING
        .iter()
        .copied()
        .chain(FAILING.iter().map(|(f, _, _)| *f))
        .collect();
    listed.sort();
    let mut present: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    present.sort();
    assert_eq!(listed, present);
}

#[test]
fn the_fixtures_envoy_ratelimit_loads_are_valid() {
    for name in LOADING {
        let path = fixtures().join(name);
        let (ok, out) = check_config(&path, &[]);
        assert!(ok, "{name}: {out}");
        assert_eq!(out, format!("{}: 1 domain(s) valid\n", path.display()));
    }
}

#[test]
fn each_broken_fixture_fails_with_envoy_ratelimits_message_at_its_line() {
    for (name, line, message) in FAILING {
        let path = fixtures().join(name);
        let (ok, out) = check_config(&path, &[]);
        assert!(!ok, "{name} must fail");
        let mut expected = vec![format!("{}:{line}: {message}", path.display())];
        for (_, more) in ALSO.iter().filter(|(f, _)| f == name) {
            expected.extend(more.iter().map(|m| format!("{}:{m}", path.display())));
        }
        assert_eq!(out.lines().collect::<Vec<_>>(), expected, "{name}");
    }
}

/// `TestDuplicateDomain`: basic_config.yaml and duplicate_domain.yaml both declare `test-domain`.
#[test]
fn a_domain_declared_by_a_second_file_is_a_duplicate_domain() {
    let (ok, out) = check_together(
        &[
            ("basic_config.yaml", "basic_config.yaml"),
            ("duplicate_domain.yaml", "duplicate_domain.yaml"),
        ],
        &[],
    );
    assert!(!ok);
    assert_eq!(
        out,
        "duplicate_domain.yaml:1: duplicate domain 'test-domain' in config file\n"
    );
}

/// `TestDomainMerge`: the two merge fixtures are one domain with `--merge-domains` (or its
/// environment twin), a duplicate domain without it.
#[test]
fn merge_domains_joins_the_files_of_one_domain() {
    let files = [
        ("merge_domain_key1.yaml", "merge_domain_key1.yaml"),
        ("merge_domain_key2.yaml", "merge_domain_key2.yaml"),
    ];
    let (ok, out) = check_together(&files, &[]);
    assert!(!ok);
    assert_eq!(
        out,
        "merge_domain_key2.yaml:2: duplicate domain 'test-domain' in config file\n"
    );
    let (ok, out) = check_together(&files, &["--merge-domains"]);
    assert!(ok, "{out}");
    assert!(out.ends_with(": 1 domain(s) valid\n"), "{out}");
}

/// `TestDuplicateKeyDomainMerge`: the same file loaded twice (here a copy, read second) defines
/// `key1_value1` twice; the error names the second file and the line of its rule.
#[test]
fn merge_domains_rejects_a_rule_that_two_files_define() {
    let (ok, out) = check_together(
        &[
            ("merge_domain_key1.yaml", "merge_domain_key1.yaml"),
            ("merge_domain_key1_copy.yaml", "merge_domain_key1.yaml"),
        ],
        &["--merge-domains"],
    );
    assert!(!ok);
    assert_eq!(
        out,
        "merge_domain_key1_copy.yaml:5: duplicate descriptor composite key 'test-domain.key1_value1'\n"
    );
}

/// A descriptor's entries.
type Entries<'a> = &'a [(&'a str, &'a str)];

/// The limit a status reports, as (requests per unit, unit); `None` when it reports none.
fn limit(r: &RateLimitResponse, i: usize) -> Option<(u32, Unit)> {
    let l = r.statuses[i].current_limit.as_ref()?;
    Some((l.requests_per_unit, Unit::try_from(l.unit).expect("a unit")))
}

/// Asks about one descriptor of `test-domain` with `hits` hits; the answer.
async fn ask(sluice: &Sluice, entries: &[(&str, &str)], hits: u32) -> RateLimitResponse {
    let mut r = request("test-domain", &[entries]);
    r.hits_addend = hits;
    sluice.ask(r).await
}

/// The limit the rule matching `entries` gives, asked once with one hit.
async fn limit_for(sluice: &Sluice, entries: &[(&str, &str)]) -> Option<(u32, Unit)> {
    limit(&ask(sluice, entries, 1).await, 0)
}

async fn start_fixture(name: &str) -> Sluice {
    Sluice::start_with(&[(name, &fixture(name))], &[]).await
}

fn hits(sluice: &Sluice, rule: &str) -> f64 {
    scrape(sluice.http)
        .get(
            "sluice_rule_hits_total",
            &[("domain", "test-domain"), ("descriptor", rule)],
        )
        .unwrap_or(0.0)
}

/// `TestBasicConfig`: each descriptor's limit, no limit where no rule or no limit applies, the
/// unlimited rule, and the metric names (a `detailed_metric` rule's named by the request's value).
/// An unlimited rule is answered without counting, as envoyproxy/ratelimit answers it.
#[tokio::test]
async fn basic_config_limits_each_descriptor_as_envoy_ratelimit_does() {
    let sluice = start_fixture("basic_config.yaml").await;
    let r = sluice
        .ask(request("foo_domain", &[&[("key1", "value1")]]))
        .await;
    assert_eq!((r.overall_code, limit(&r, 0)), (OK, None), "unknown domain");
    for no_limit in [
        &[("key1", "something")][..],
        &[("key1", "value1")],
        &[("key2", "value2"), ("subkey", "subvalue")],
        &[("key5", "value5"), ("subkey5", "subvalue")],
        &[("key2", "value3")],
    ] {
        assert_eq!(limit_for(&sluice, no_limit).await, None, "{no_limit:?}");
    }
    let cases: &[(Entries, (u32, Unit))] = &[
        (
            &[("key1", "value1"), ("subkey1", "something")],
            (5, Unit::Second),
        ),
        (
            &[("key1", "value1"), ("subkey1", "subvalue1")],
            (10, Unit::Second),
        ),
        (&[("key2", "something")], (20, Unit::Minute)),
        (&[("key2", "value2")], (30, Unit::Minute)),
        (&[("key3", "foo")], (1, Unit::Hour)),
        (&[("key4", "foo")], (1, Unit::Day)),
        (&[("key7", "unspecified_value")], (70, Unit::Minute)),
        (&[("key7", "another_value")], (70, Unit::Minute)),
    ];
    for (entries, expected) in cases {
        assert_eq!(
            limit_for(&sluice, entries).await,
            Some(*expected),
            "{entries:?}"
        );
    }
    let r = ask(&sluice, &[("key4", "foo")], 1).await;
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "key4_rate_limit"
    );
    let r = ask(&sluice, &[("key6", "foo")], 1).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, u32::MAX)
    );
    for (rule, count) in [
        ("key1_value1.subkey1", 1.0),
        ("key1_value1.subkey1_subvalue1", 1.0),
        ("key2", 1.0),
        ("key2_value2", 1.0),
        ("key3", 1.0),
        ("key4", 2.0),
        ("key7_unspecified_value", 1.0),
        ("key7_another_value", 1.0),
    ] {
        assert_eq!(hits(&sluice, rule), count, "{rule}");
    }
}

/// `TestWildcardConfig`: `*` anywhere in a value, matching any run (also an empty one); values
/// matching one pattern count apart but under the pattern's metric; a value without `*` never
/// matches a longer one.
#[tokio::test]
async fn wildcard_patterns_match_anywhere_and_name_their_metric_by_the_pattern() {
    in_one_window(MINUTE, async || {
        let sluice = start_fixture("wildcard.yaml").await;
        for matching in [
            &[("noVal", "foo1")][..],
            &[("wild", "foo1")],
            &[("wild", "foo2")],
            &[("nestedWild", "val1"), ("wild", "goo2")],
            &[("midWild", "barab")],
            &[("midWild", "bar123b")],
            &[("midWild", "barb")],
            &[("multiWild", "foo123bar456baz")],
            &[("multiWild", "foobarbaz")],
        ] {
            assert!(limit_for(&sluice, matching).await.is_some(), "{matching:?}");
        }
        for not_matching in [
            &[("wild", "bar")][..],
            &[("noWild", "foo1")],
            &[("midWild", "bara")],
            &[("midWild", "xbarb")],
            &[("multiWild", "foo123baz")],
            &[("multiWild", "bar456baz")],
        ] {
            assert_eq!(
                limit_for(&sluice, not_matching).await,
                None,
                "{not_matching:?}"
            );
        }
        let r = ask(&sluice, &[("wild", "foo1")], 18).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 1,
            "foo1's own counter: 1 + 18 of 20"
        );
        let r = ask(&sluice, &[("wild", "foo2")], 1).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 18,
            "foo2 counts apart: 2 of 20"
        );
        for (rule, count) in [
            ("noVal", 1.0),
            ("wild_foo*", 21.0),
            ("nestedWild_val1.wild_goo*", 1.0),
            ("midWild_bar*b", 3.0),
            ("multiWild_foo*bar*baz", 2.0),
        ] {
            assert_eq!(hits(&sluice, rule), count, "{rule}");
        }
    })
    .await;
}

/// `TestShareThreshold`: every value matching a `share_threshold` pattern spends one counter; an
/// exact value beside the pattern keeps its own limit and counter; metric names keep the pattern.
#[tokio::test]
async fn share_threshold_patterns_share_one_counter() {
    in_one_window(MINUTE, async || {
        let sluice = start_fixture("share_threshold.yaml").await;
        let r = ask(&sluice, &[("files", "files/a.pdf")], 99).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 1));
        let r = ask(&sluice, &[("files", "files/b.csv")], 1).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));
        let r = ask(&sluice, &[("files", "files/c.txt")], 1).await;
        assert_eq!(
            (r.overall_code, limit(&r, 0)),
            (OVER_LIMIT, Some((100, Unit::Minute))),
            "the third value finds the shared counter full"
        );
        let cases: &[(Entries, u32)] = &[
            (&[("nested", "parent"), ("files", "nested/file1.txt")], 200),
            (
                &[("files", "top/file1.txt"), ("files", "nested/file1.txt")],
                300,
            ),
            (&[("route", "api/v1"), ("method", "GET")], 60),
            (&[("service", "svc/user"), ("endpoint", "get")], 80),
            (
                &[("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")],
                120,
            ),
            (
                &[
                    ("user", "user/alice"),
                    ("resource", "res/file1"),
                    ("action", "read"),
                ],
                150,
            ),
            (&[("file", "test1")], 50),
            (&[("file", "test2")], 100),
            (&[("midpath", "/api/v1")], 100),
            (&[("multiroute", "svcAepBrpc")], 50),
            (&[("midroute", "/api/v2")], 80),
            (&[("tenant", "t1prod"), ("resource", "resAv2")], 60),
        ];
        for (entries, expected) in cases {
            assert_eq!(
                limit_for(&sluice, entries).await.map(|(n, _)| n),
                Some(*expected),
                "{entries:?}"
            );
        }
        for not_matching in [
            &[("midpath", "/api/v2")][..],
            &[("multiroute", "svcABCrpc")],
        ] {
            assert_eq!(
                limit_for(&sluice, not_matching).await,
                None,
                "{not_matching:?}"
            );
        }
        let r = ask(&sluice, &[("file", "test23")], 99).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 0,
            "test2 and test23 share test*'s counter"
        );
        let r = ask(&sluice, &[("file", "test1")], 49).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 0,
            "test1 counts alone: 1 + 49 of 50"
        );
        for (rule, count) in [
            ("files_files/*", 101.0),
            ("route_api/*.method", 1.0),
            ("service_svc/*.endpoint_get", 1.0),
            ("path_path/*.file_file/*.type", 1.0),
            ("user_user/*.resource_res/*.action", 1.0),
            ("file_test1", 50.0),
            ("file_test*", 100.0),
            ("midroute_/api*v2", 1.0),
        ] {
            assert_eq!(hits(&sluice, rule), count, "{rule}");
        }
    })
    .await;
}

/// `TestShadowModeConfig`: a `shadow_mode` rule answers OK over its limit and counts what it
/// would have denied; the rules beside it still deny.
#[tokio::test]
async fn shadow_mode_rules_answer_ok_over_their_limit_and_the_others_deny() {
    let sluice = start_fixture("shadowmode_config.yaml").await;
    let r = ask(&sluice, &[("key2", "something")], 21).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].code, limit(&r, 0)),
        (OK, OK, Some((20, Unit::Minute))),
        "the descriptor's status is OK too, as envoyproxy/ratelimit answers it"
    );
    let r = ask(&sluice, &[("key2", "value2")], 31).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((30, Unit::Minute)))
    );
    let r = ask(&sluice, &[("key1", "value1"), ("subkey1", "subvalue1")], 11).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OK, Some((10, Unit::Second)))
    );
    let r = ask(&sluice, &[("key1", "value1"), ("subkey1", "something")], 6).await;
    assert_eq!(
        (r.overall_code, limit(&r, 0)),
        (OVER_LIMIT, Some((5, Unit::Second)))
    );
    let shadow = |rule| {
        scrape(sluice.http)
            .get(
                "sluice_rule_shadow_mode_total",
                &[("domain", "test-domain"), ("descriptor", rule)],
            )
            .unwrap_or(0.0)
    };
    assert_eq!(shadow("key2"), 21.0);
    assert_eq!(shadow("key1_value1.subkey1_subvalue1"), 11.0);
    assert_eq!(shadow("key2_value2"), 0.0);
    assert_eq!(shadow("key1_value1.subkey1"), 0.0);
}

/// `TestMetadata`: the limits of metadata.yaml, and each rule's metadata kept with that rule (in
/// `/config`, at the rule's line).
#[tokio::test]
async fn metadata_stays_with_its_rule() {
    let sluice = start_fixture("metadata.yaml").await;
    assert_eq!(
        limit_for(&sluice, &[("key1", "value1"), ("subkey1", "something")]).await,
        Some((5, Unit::Second))
    );
    assert_eq!(
        limit_for(&sluice, &[("key2", "something")]).await,
        Some((20, Unit::Minute))
    );
    let (status, _, body) = http(sluice.http, "GET", "/config", "");
    assert_eq!(status, 200);
    let config: serde_json::Value = serde_json::from_str(&body).unwrap();
    let rules = &config["domains"][0]["descriptors"];
    let subkey1 = &rules[0]["descriptors"][0];
    assert_eq!(
        (&subkey1["line"], &subkey1["metadata"]),
        (
            &serde_json::json!(8),
            &serde_json::json!({"name": "service_1"})
        )
    );
    assert_eq!(
        (&rules[1]["line"], &rules[1]["metadata"]),
        (
            &serde_json::json!(22),
            &serde_json::json!({"service_with_quota": {"name": "service_2"}})
        )
    );
}

const MERGE_FLAGS: &[&str] = &["--merge-domains"];

fn merge_files() -> Vec<(&'static str, String)> {
    ["merge_domain_key1.yaml", "merge_domain_key2.yaml"]
        .map(|name| (name, fixture(name)))
        .to_vec()
}

/// `TestDomainMerge`, served: both files' rules apply in one domain, and `/config` shows each
/// rule's file and line.
#[tokio::test]
async fn merged_files_serve_one_domain_and_show_where_each_rule_comes_from() {
    let files = merge_files();
    let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let sluice = Sluice::start_with(&files, MERGE_FLAGS).await;
    assert_eq!(
        limit_for(&sluice, &[("key1", "value1")]).await,
        Some((10, Unit::Minute))
    );
    assert_eq!(
        limit_for(&sluice, &[("key2", "value2")]).await,
        Some((20, Unit::Minute))
    );
    let (_, _, body) = http(sluice.http, "GET", "/config", "");
    let config: serde_json::Value = serde_json::from_str(&body).unwrap();
    let origins: Vec<(String, String, u64)> = config["domains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let file = d["file"].as_str().unwrap();
            let name = Path::new(file).file_name().unwrap().to_string_lossy();
            let rule = &d["descriptors"][0];
            (
                format!("{}:{}", d["domain"].as_str().unwrap(), name),
                rule["key"].as_str().unwrap().to_owned(),
                rule["line"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        origins,
        [
            (
                "test-domain:merge_domain_key1.yaml".into(),
                "key1".into(),
                5
            ),
            (
                "test-domain:merge_domain_key2.yaml".into(),
                "key2".into(),
                5
            ),
        ]
    );
    let (_, _, text) = http(sluice.http, "GET", "/rlconfig", "");
    assert_eq!(
        text,
        "test-domain.key1_value1: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false\n\
         test-domain.key2_value2: unit=MINUTE requests_per_unit=20, shadow_mode: false, quota_mode: false\n"
    );
}

/// A file that makes two merged files collide is rejected on SIGHUP, at its line, and the rules
/// in force stay.
#[tokio::test]
async fn a_reload_that_makes_merged_files_collide_keeps_the_rules_in_force() {
    let files = merge_files();
    let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let sluice = Sluice::start_with(&files, MERGE_FLAGS).await;
    let collide = "domain: test-domain\ndescriptors:\n  - key: key2\n    value: value2\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    std::fs::write(sluice.rules.join("more.yaml"), collide).unwrap();
    signal(sluice.pid(), "HUP");
    let expected = format!(
        "{}:3: duplicate descriptor composite key 'test-domain.key2_value2'",
        sluice.rules.join("more.yaml").display()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sluice.log_text().contains(&expected) {
        assert!(
            Instant::now() < deadline,
            "no collision logged:\n{}",
            sluice.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        limit_for(&sluice, &[("key2", "value2")]).await,
        Some((20, Unit::Minute))
    );
    assert_eq!(
        limit_for(&sluice, &[("key1", "value1")]).await,
        Some((10, Unit::Minute))
    );
}
