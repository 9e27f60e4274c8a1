//! Hot reload: a ConfigMap swapped under load changes a limit within 2 s without failing a call,
//! a broken version is reported at its line and the rules in force stay, and SIGHUP reloads while
//! limits keep their counts. Every limit is per hour, and a test counting against one runs
//! `in_one_window` of an hour.

use std::ops::Range;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::metrics::scrape;
use support::redis::signal;
use support::{
    HOUR, OK, OVER_LIMIT, Sluice, eventually, in_one_window, linked_from_outside, outside_file,
    request,
};

use super::operate::{get_text, limit_of};

/// The limit sluice reports for `key=value` in `domain`, asked without consuming a hit.
async fn reported_limit(sluice: &Sluice, domain: &str, key: &str, value: &str) -> u32 {
    let mut check = request(domain, &[&[(key, value)]]);
    check.descriptors[0].hits_addend =
        Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    limit_of(&sluice.ask(check).await.statuses[0])
}

fn limit_rules(domain: &str, limit: u32) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// Puts `yaml` in force in `dir` as the kubelet updates a ConfigMap volume: the file in a new
/// hidden directory `..<version>`, then `..data` pointed at it by one atomic rename; `rules.yaml`
/// links through `..data` (made with the first version).
fn configmap_version(dir: &Path, version: &str, yaml: &str) {
    let versioned = dir.join(format!("..{version}"));
    std::fs::create_dir(&versioned).expect("version directory");
    std::fs::write(versioned.join("rules.yaml"), yaml).expect("rule file written");
    symlink(format!("..{version}"), dir.join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("..data swapped");
    if std::fs::symlink_metadata(dir.join("rules.yaml")).is_err() {
        symlink("..data/rules.yaml", dir.join("rules.yaml")).expect("rules.yaml link");
    }
}

/// One caller's answers: when each call was sent and answered, and the limit it reported or its
/// error.
type Answers = Vec<(Range<Instant>, Result<u32, String>)>;

/// Four callers ask without pause while `..data` is swapped to a version with twice the limit:
/// no call fails, every answer to a call made before the swap has the old limit, every one made
/// from 2 s after it the new limit, and no caller sees the old limit again once it has seen the
/// new one.
#[tokio::test(flavor = "multi_thread")]
async fn a_configmap_swap_under_load_changes_the_limit_within_2s_without_failing_a_call() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start_prepared(
            |dir| configmap_version(dir, "v1", &limit_rules("cm", 100_000)),
            &[],
        )
        .await;
        let answered: Arc<[AtomicUsize; 4]> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let mut callers = Vec::new();
        for n in 0..4 {
            let mut client = sluice.client().await;
            let (answered, stop) = (answered.clone(), stop.clone());
            callers.push(tokio::spawn(async move {
                let mut answers: Answers = Vec::new();
                let value = n.to_string();
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let answer = client
                        .should_rate_limit(request("cm", &[&[("user", value.as_str())]]))
                        .await
                        .map(|r| limit_of(&r.get_ref().statuses[0]))
                        .map_err(|e| e.to_string());
                    answers.push((started..Instant::now(), answer));
                    answered[n].fetch_add(1, Ordering::Relaxed);
                }
                answers
            }));
        }
        eventually(
            "every caller is answered under the first version",
            Duration::from_secs(10),
            async || answered.iter().all(|a| a.load(Ordering::Relaxed) >= 10),
        )
        .await;
        let swapping = Instant::now();
        configmap_version(&sluice.rules, "v2", &limit_rules("cm", 200_000));
        let swapped = Instant::now();
        let end = swapped + Duration::from_secs(4);
        tokio::time::sleep_until(end.into()).await;
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for caller in callers {
            all.push(caller.await.expect("a caller runs to the end"));
        }

        for (n, answers) in all.iter().enumerate() {
            let failed: Vec<_> = answers
                .iter()
                .filter_map(|(_, a)| a.as_ref().err())
                .collect();
            assert!(
                failed.is_empty(),
                "caller {n}: {} failed: {failed:?}",
                failed.len()
            );
            // The limits of the calls sent and answered between `from` and `to`.
            let limits = |from: Instant, to: Instant| -> Vec<u32> {
                answers
                    .iter()
                    .filter(|(at, _)| at.start >= from && at.end < to)
                    .map(|(_, a)| *a.as_ref().unwrap())
                    .collect()
            };
            let far_past = answers[0].0.start;
            let before = limits(far_past, swapping);
            assert!(!before.is_empty(), "caller {n} asked before the swap");
            assert!(
                before.iter().all(|l| *l == 100_000),
                "caller {n}: {before:?}"
            );
            let settled = limits(swapped + Duration::from_secs(2), end + HOUR);
            assert!(!settled.is_empty(), "caller {n} asked 2 s after the swap");
            assert!(
                settled.iter().all(|l| *l == 200_000),
                "caller {n}, from 2 s after the swap: {:?}",
                settled.iter().filter(|l| **l != 200_000).count()
            );
            let in_order: Vec<u32> = answers.iter().map(|(_, a)| *a.as_ref().unwrap()).collect();
            let first_new = in_order.iter().position(|l| *l == 200_000).unwrap();
            assert!(
                in_order[first_new..].iter().all(|l| *l == 200_000),
                "caller {n} saw the old limit after the new one"
            );
        }
        assert_eq!(
            scrape(sluice.http).value("sluice_rule_reloads_total", &[("result", "ok")]),
            1.0
        );
    })
    .await;
}

/// A ConfigMap version with invalid YAML is logged as `file:line`, counted as a failed reload,
/// and changes nothing: the limit in force still denies. The next valid version is put in force
/// (its raised limit admitting at once, though the local cache knew the counter full under the
/// old one).
#[tokio::test]
async fn a_broken_configmap_version_is_reported_at_its_line_and_the_rules_in_force_stay() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start_prepared(
            |dir| configmap_version(dir, "v1", &limit_rules("cm", 2)),
            &[],
        )
        .await;
        let x = || request("cm", &[&[("user", "x")]]);
        assert_eq!(sluice.ask(x()).await.statuses[0].limit_remaining, 1);
        let before = get_text(&sluice, "/rlconfig");

        configmap_version(
            &sluice.rules,
            "v2",
            "domain: cm\ndescriptors:\n  - key: user\n   bad: indent\n",
        );
        let at_line = format!(
            "{}:4: error loading config file",
            sluice.rules.join("rules.yaml").display()
        );
        let summary = format!(
            "file change: 1 error(s) in {}; the rules in force stay",
            sluice.rules.display()
        );
        eventually(
            "the broken file is reported",
            Duration::from_secs(10),
            async || {
                let log = sluice.log_text();
                log.contains(&at_line) && log.contains(&summary)
            },
        )
        .await;
        let m = scrape(sluice.http);
        assert!(m.value("sluice_rule_reloads_total", &[("result", "failed")]) >= 1.0);
        assert!(m.value("ratelimit_service_config_load_error", &[]) >= 1.0);
        assert_eq!(
            m.get("sluice_rule_reloads_total", &[("result", "ok")])
                .unwrap_or(0.0),
            0.0,
            "no reload succeeded"
        );
        assert_eq!(get_text(&sluice, "/rlconfig"), before);
        let r = sluice.ask(x()).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));
        let r = sluice.ask(x()).await;
        assert_eq!(
            (r.overall_code, limit_of(&r.statuses[0])),
            (OVER_LIMIT, 2),
            "the limit of 2 holds"
        );

        configmap_version(&sluice.rules, "v3", &limit_rules("cm", 5));
        eventually(
            "the next valid version is in force",
            Duration::from_secs(10),
            async || get_text(&sluice, "/rlconfig").contains("requests_per_unit=5,"),
        )
        .await;
        let r = sluice.ask(x()).await;
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (OK, 2),
            "2 of 5 used: the count is kept and the raised limit admits at once"
        );
    })
    .await;
}

fn two_limits(user: u32) -> String {
    format!(
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {{unit: hour, requests_per_unit: {user}}}\n  - key: other\n    rate_limit: {{unit: hour, requests_per_unit: 10}}\n"
    )
}

/// SIGHUP reloads; a limit whose unit and algorithm did not change keeps its count (also when only
/// its requests_per_unit changed); a SIGHUP with nothing changed says so and reloads nothing.
#[tokio::test]
async fn sighup_reloads_and_limits_keep_their_counts_across_it() {
    in_one_window(HOUR, async || {
        let sluice =
            Sluice::start_prepared(linked_from_outside(two_limits(5)), &["--log-level", "info"])
                .await;
        let user = || request("web", &[&[("user", "u")]]);
        let other = || request("web", &[&[("other", "o")]]);
        for _ in 0..3 {
            sluice.ask(user()).await;
        }
        for _ in 0..4 {
            sluice.ask(other()).await;
        }

        std::fs::write(outside_file(&sluice.rules), two_limits(6)).unwrap();
        signal(sluice.pid(), "HUP");
        eventually("SIGHUP reloads", Duration::from_secs(10), async || {
            sluice.log_text().contains("SIGHUP: rules reloaded")
        })
        .await;
        assert_eq!(reported_limit(&sluice, "web", "user", "u").await, 6);
        let r = sluice.ask(user()).await;
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (OK, 2),
            "4 of 6 used: the 3 used before the reload count"
        );
        let r = sluice.ask(other()).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 5,
            "5 of 10 used: the unchanged rule kept its count"
        );

        signal(sluice.pid(), "HUP");
        eventually(
            "SIGHUP finds nothing changed",
            Duration::from_secs(10),
            async || sluice.log_text().contains("SIGHUP: rules unchanged"),
        )
        .await;
        assert_eq!(
            scrape(sluice.http).value("sluice_rule_reloads_total", &[("result", "ok")]),
            1.0
        );
    })
    .await;
}
