//! Who is being limited right now: under a load where three clients exceed their limit among
//! 10,000 others, `/top` and `sluice top --once` name those three first, with counts and rates
//! within the error they state; `--top-values hash` and `hide` never show a value;
//! `--top-capacity 0` switches the view off; a rule on the calendar shows the time to its
//! window's end; forty clients reading it at once share its renders,
//! leaving the probes quick and the memory bounded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use support::{HOUR, OVER_LIMIT, Sluice, http, in_one_window, memory_kb, request, reset_peak};

const RULES: &str = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: hour, requests_per_unit: 20}\n";

/// The three clients over their limit, with the requests each sends.
const HEAVY: [(&str, u64); 3] = [("10.9.0.1", 300), ("10.9.0.2", 200), ("10.9.0.3", 100)];
/// The others, each sending one request, or two for every tenth of them.
const OTHERS: u64 = 10_000;
/// Requests in flight at once.
const CONCURRENCY: usize = 32;

fn ask(address: &str) -> RateLimitRequest {
    request("edge", &[&[("remote_address", address)]])
}

/// Every request of the load, the heavy clients' spread among the others'.
fn load() -> Vec<RateLimitRequest> {
    let mut out: Vec<RateLimitRequest> = (0..OTHERS)
        .flat_map(|n| {
            let address = format!("10.{}.{}.{}", n / 65_536, n / 256 % 256, n % 256);
            let times = if n % 10 == 0 { 2 } else { 1 };
            (0..times).map(move |_| ask(&address))
        })
        .collect();
    for (address, requests) in HEAVY {
        for i in 0..requests {
            let at = (i as usize * 7_919 + address.len()) % out.len();
            out.insert(at, ask(address));
        }
    }
    out
}

/// Sends `requests` over gRPC, `CONCURRENCY` at a time; how many were denied.
async fn send(sluice: &Sluice, requests: Vec<RateLimitRequest>) -> usize {
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicUsize::new(0));
    let denied = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (requests, next, denied) = (requests.clone(), next.clone(), denied.clone());
        let mut client = sluice.client().await;
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(r) = requests.get(i) else { break };
                let answer = client.should_rate_limit(r.clone()).await.expect("answered");
                if answer.into_inner().overall_code == OVER_LIMIT {
                    denied.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    denied.load(Ordering::Relaxed)
}

/// `/top` as JSON.
fn top(sluice: &Sluice, query: &str) -> serde_json::Value {
    let (status, _, body) = http(sluice.http, "GET", &format!("/top?{query}"), "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("/top answers JSON")
}

/// `sluice top --once` against `admin`: its exit status and output.
fn sluice_top(admin: SocketAddr, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["top", "--once", "--admin", &format!("http://{admin}")])
        .args(args)
        .output()
        .expect("sluice top runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread")]
async fn top_names_the_three_clients_over_their_limit_first_among_ten_thousand() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--top-capacity", "256"]).await;
        let requests = load();
        let total = requests.len() as u64;
        let denied = send(&sluice, requests).await;
        let over: Vec<u64> = HEAVY.iter().map(|(_, n)| n - 20).collect();
        assert_eq!(denied as u64, over.iter().sum::<u64>());

        for period in ["1m", "10m"] {
            let report = top(&sluice, &format!("period={period}&n=5"));
            let p = &report["periods"][0];
            assert_eq!(p["period"], period);
            assert_eq!(p["decisions"], total);
            let seconds = p["seconds"].as_f64().unwrap();
            let rows = p["denied"].as_array().unwrap();
            assert_eq!(rows.len(), 3, "only the three were denied: {p}");
            for (row, ((address, _), over)) in rows.iter().zip(HEAVY.iter().zip(&over)) {
                assert_eq!(row["value"], format!("remote_address={address}"), "{p}");
                assert_eq!(
                    (&row["domain"], &row["rule"]),
                    (&"edge".into(), &"remote_address".into())
                );
                let (count, error) = (
                    row["count"].as_u64().unwrap(),
                    row["error"].as_u64().unwrap(),
                );
                assert!(count >= *over && count - error <= *over, "{row}");
                let rate = row["per_second"].as_f64().unwrap();
                assert!((rate - count as f64 / seconds).abs() < 0.01, "{row}");
            }
            // The most hit are the same three: each one's count within its error of the truth.
            let hits = p["hits"].as_array().unwrap();
            for (row, (address, sent)) in hits.iter().zip(HEAVY) {
                assert_eq!(row["value"], format!("remote_address={address}"), "{p}");
                let (count, error) = (
                    row["count"].as_u64().unwrap(),
                    row["error"].as_u64().unwrap(),
                );
                assert!(count >= sent && count - error <= sent, "{row}");
            }
            let rule = &p["rules_by_denied"][0];
            assert_eq!(rule["denied"], denied);
            assert_eq!(p["rules_by_hits"][0]["hits"], total);
        }

        assert_eq!(http(sluice.http, "GET", "/top?period=5m", "").0, 400);
        let (ok, out) = sluice_top(sluice.http, &["--rows", "3"]);
        assert!(ok, "{out}");
        let shown: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split_whitespace().last())
            .filter(|v| v.starts_with("remote_address="))
            .collect();
        assert_eq!(
            shown,
            HEAVY.map(|(a, _)| format!("remote_address={a}")),
            "{out}"
        );
        assert!(out.contains("edge/remote_address"), "{out}");
        assert!(out.lines().any(|l| l.starts_with("decisions ")), "{out}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rule_on_the_calendar_shows_when_its_window_ends() {
    let rules = "domain: billing\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: month, requests_per_unit: 1, calendar: {time_zone: Pacific/Auckland}}\n";
    let sluice = Sluice::start_with(&[("rules.yaml", rules)], &[]).await;
    for _ in 0..2 {
        sluice
            .ask(request("billing", &[&[("tenant", "acme")]]))
            .await;
    }
    let now = jiff::Timestamp::now().to_zoned(jiff::tz::TimeZone::get("Pacific/Auckland").unwrap());
    let month_end = now.first_of_month().unwrap().start_of_day().unwrap() + jiff::ToSpan::month(1);
    let expected = (month_end.timestamp() - now.timestamp()).get_seconds() as u64;
    let report = top(&sluice, "period=1m");
    let rule = &report["periods"][0]["rules_by_denied"][0];
    assert_eq!(
        (&rule["domain"], &rule["rule"]),
        (&"billing".into(), &"tenant".into())
    );
    let ends = rule["window_ends_in_seconds"]
        .as_u64()
        .expect("a calendar window's end");
    assert!(
        ends.abs_diff(expected) <= 2,
        "{rule}: the month in Auckland ends in {expected} s"
    );
    let (ok, out) = sluice_top(sluice.http, &[]);
    assert!(ok, "{out}");
    let shown = humantime::format_duration(Duration::from_secs(ends / 60 * 60)).to_string();
    let line = out
        .lines()
        .find(|l| l.contains("billing/tenant") && !l.contains("tenant="))
        .unwrap_or_default();
    assert!(line.contains(shown.split(' ').next().unwrap()), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn hashed_and_hidden_values_are_never_shown() {
    in_one_window(HOUR, async || {
        for values in ["hash", "hide"] {
            let sluice =
                Sluice::start_with(&[("rules.yaml", RULES)], &["--top-values", values]).await;
            let secret = "192.0.2.77";
            let denied = send(&sluice, (0..30).map(|_| ask(secret)).collect()).await;
            assert_eq!(denied, 10);
            let (status, _, body) = http(sluice.http, "GET", "/top", "");
            assert_eq!(status, 200);
            assert!(!body.contains(secret), "{values}: {body}");
            let report: serde_json::Value = serde_json::from_str(&body).unwrap();
            for p in report["periods"].as_array().unwrap() {
                assert_eq!(p["rules_by_denied"][0]["denied"], 10, "{values}: {p}");
                let rows = p["denied"].as_array().unwrap();
                match values {
                    "hash" => {
                        let shown = rows[0]["value"].as_str().unwrap();
                        assert!(shown.len() == 16 && shown.chars().all(|c| c.is_ascii_hexdigit()));
                    }
                    _ => assert!(rows.is_empty() && p["hits"].as_array().unwrap().is_empty()),
                }
            }
            let (ok, out) = sluice_top(sluice.http, &[]);
            assert!(ok && !out.contains(secret), "{values}: {out}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_capacity_of_zero_switches_the_view_off() {
    let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--top-capacity", "0"]).await;
    assert_eq!(send(&sluice, vec![ask("10.0.0.1")]).await, 0);
    assert_eq!(http(sluice.http, "GET", "/top", "").0, 404);
    let (ok, out) = sluice_top(sluice.http, &[]);
    assert!(!ok && out.contains("404"), "{out}");
}

/// Rules of the populated view, each with a sketch of its own.
const FULL_RULES: usize = 8;
/// Clients reading `/top?n=1000` at once, and the reads of each.
const READERS: usize = 40;
const READS: usize = 2;

#[tokio::test(flavor = "multi_thread")]
async fn forty_clients_reading_a_full_top_view_at_once_leave_probes_quick_and_memory_bounded() {
    let rules: String = (0..FULL_RULES)
        .map(|k| format!("  - key: k{k}\n    rate_limit: {{unit: hour, requests_per_unit: 0}}\n"))
        .collect();
    let rules = format!("domain: full\ndescriptors:\n{rules}");
    let flags = [
        "--top-capacity",
        "1024",
        "--top-rules",
        &FULL_RULES.to_string(),
    ];
    let sluice = Sluice::start_with(&[("rules.yaml", &rules)], &flags).await;
    // Every counter of every rule's sketches taken (denied and hit), by values of 250 bytes.
    let requests = (0..1_500)
        .map(|n| {
            let value = format!("{n:0>250}");
            let keys: Vec<String> = (0..FULL_RULES).map(|k| format!("k{k}")).collect();
            let descriptors: Vec<[(&str, &str); 1]> = keys
                .iter()
                .map(|k| [(k.as_str(), value.as_str())])
                .collect();
            let descriptors: Vec<&[(&str, &str)]> = descriptors.iter().map(|d| &d[..]).collect();
            request("full", &descriptors)
        })
        .collect();
    assert_eq!(send(&sluice, requests).await, 1_500);
    let minute = top(&sluice, "period=1m&n=1000");
    assert_eq!(
        minute["periods"][0]["denied"].as_array().unwrap().len(),
        1_000
    );

    let pid = sluice.pid();
    let before_kb = memory_kb(pid, "VmRSS");
    reset_peak(pid);
    let admin = sluice.http;
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..READS {
                    let (status, _, body) = http(admin, "GET", "/top?n=1000", "");
                    assert_eq!(status, 200, "{body}");
                }
            })
        })
        .collect();
    let mut probes = Vec::new();
    while readers.iter().any(|r| !r.is_finished()) {
        let asked = Instant::now();
        assert_eq!(http(admin, "GET", "/healthz", "").0, 200);
        probes.push(asked.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        reader.join().expect("every read answered");
    }
    let grown_mb = memory_kb(pid, "VmHWM").saturating_sub(before_kb) / 1024;
    let slowest = probes.iter().max().expect("probed");
    // One render at a time: a few MB, where forty at once took hundreds.
    assert!(grown_mb < 64, "the peak RSS grew by {grown_mb} MB");
    // Generous for a busy machine: a probe waited seconds behind forty renders.
    assert!(
        slowest < &Duration::from_secs(2),
        "/healthz took {slowest:?}: {probes:?}"
    );
}
