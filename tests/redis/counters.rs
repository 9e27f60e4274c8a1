//! The operator's `/counters`, on every store: a reset frees a blocked client at once on every
//! replica (the local over-limit cache of each forgets the counter, leased blocks are dropped,
//! not spent past the limit); a dry run shows and changes nothing; every algorithm's counter is
//! fresh after a reset; `set` and `add` move it by their hits, never past its limit's room;
//! without the admin token a reset is refused and changes nothing; every change is an audit line
//! no caller can forge, a bounded number per call; `at` names the window now or a later one,
//! never a past one; an unknown domain is said; a reset whose outcome is unknown says so, and so
//! does its audit line; `sluice counters` speaks to it.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::{OK, OVER_LIMIT, Sluice, Store, exchange, request, unix_ms};

on_every_store!(
    a_reset_frees_a_blocked_client_at_once_on_every_replica,
    every_algorithm_is_fresh_after_a_reset_and_a_dry_run_changes_nothing,
    set_and_add_move_a_counter_by_their_hits,
    without_the_token_a_reset_is_refused_and_changes_nothing,
    audit_lines_quote_what_callers_send_and_are_bounded_per_call,
    at_names_the_window_now_or_a_later_one_never_a_past_one,
    set_and_add_never_take_a_counter_past_its_room,
    an_unknown_domain_is_said_and_the_command_fails,
);

const RULES: &str = "\
domain: ops
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: leased
    lease: auto
    rate_limit: {unit: hour, requests_per_unit: 20}
  - key: sliding
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: sliding_log}
  - key: token
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: token_bucket}
  - key: leaky
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: leaky_bucket}
";

/// `POST /counters` with `body`, with the admin `token` if given: the status and the answer.
fn counters(addr: SocketAddr, token: Option<&str>, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let authorization =
        token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "POST /counters HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{authorization}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, _, text) = exchange(addr, request.as_bytes());
    (status, text)
}

/// A `/counters` call on the counters of `key`=`value`, asking `action`.
fn call(key: &str, value: &str, action: &str, apply: bool) -> Value {
    json!({
        "domain": "ops",
        "descriptors": [{"entries": [{"key": key, "value": value}]}],
        "action": action,
        "apply": apply,
        "by": "ops-test",
    })
}

/// Asks `key`=`value` of `sluice` `n` times: how many were admitted.
async fn admitted(sluice: &Sluice, key: &str, value: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        let answer = sluice.ask(request("ops", &[&[(key, value)]])).await;
        admitted += usize::from(answer.overall_code == OK);
    }
    admitted
}

/// Two replicas sharing the store's counters (one on the embedded store, which serves one).
async fn replicas(store: Store, flags: &[&str]) -> Vec<Sluice> {
    let prefix = format!("counters-{}-{}:", std::process::id(), unix_ms());
    let mut all = vec!["--redis-key-prefix", prefix.as_str()];
    if !flags.contains(&"--admin-token-file") {
        all.push("--trust-admin-port");
    }
    all.extend_from_slice(flags);
    let count = if store == Store::Memory { 1 } else { 2 };
    let mut replicas = Vec::new();
    for _ in 0..count {
        replicas.push(Sluice::on(store, &[("rules.yaml", RULES)], &all).await);
    }
    replicas
}

async fn a_reset_frees_a_blocked_client_at_once_on_every_replica(store: Store) {
    let replicas = replicas(store, &[]).await;
    // Each replica is denied, and its over-limit cache learns the counter full until the hour
    // ends.
    let mut filled = 0;
    for sluice in &replicas {
        filled += admitted(sluice, "user", "ann", 4).await;
        assert_eq!(
            sluice
                .ask(request("ops", &[&[("user", "ann")]]))
                .await
                .overall_code,
            OVER_LIMIT
        );
    }
    assert_eq!(filled, 3, "the limit, across the replicas");
    // Leased blocks held on each replica before the reset.
    for sluice in &replicas {
        admitted(sluice, "leased", "ann", 3).await;
    }
    let (status, text) = counters(replicas[0].http, None, &call("user", "ann", "reset", true));
    assert_eq!(status, 200, "{text}");
    let (status, text) = counters(
        replicas[0].http,
        None,
        &call("leased", "ann", "reset", true),
    );
    assert_eq!(status, 200, "{text}");
    // The replica that reset admits at once; the others as soon as the store tells them.
    let start = std::time::Instant::now();
    let mut freed = 0;
    for sluice in &replicas {
        loop {
            let answer = sluice.ask(request("ops", &[&[("user", "ann")]])).await;
            if answer.overall_code == OK {
                freed += 1;
                break;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(1),
                "a replica still denies a second after the reset"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    assert_eq!(freed, replicas.len());
    let mut more = 0;
    for sluice in &replicas {
        more += admitted(sluice, "user", "ann", 4).await;
    }
    assert_eq!(
        freed + more,
        3,
        "after the reset, the limit again across the replicas, not more"
    );
    // The blocks held before the reset are dropped: never past the limit after it.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut leased = 0;
    for _ in 0..20 {
        for sluice in &replicas {
            leased += admitted(sluice, "leased", "ann", 1).await;
        }
    }
    assert!(
        (1..=20).contains(&leased),
        "{leased} of 20 admitted from blocks leased after the reset"
    );
}

async fn every_algorithm_is_fresh_after_a_reset_and_a_dry_run_changes_nothing(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    for key in ["user", "sliding", "log", "token", "leaky"] {
        assert_eq!(admitted(sluice, key, "bo", 5).await, 3, "{key}");
        let (status, text) = counters(sluice.http, None, &call(key, "bo", "reset", false));
        assert_eq!(status, 200, "{key}: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["applied"], json!(false), "{key}: {text}");
        let counter = &answer["counters"][0];
        assert_eq!(counter["before"]["used"], json!(3), "{key}: {text}");
        assert_eq!(counter["before"]["remaining"], json!(0), "{key}: {text}");
        assert_eq!(counter["after"]["used"], json!(0), "{key}: {text}");
        assert!(counter["limit"]["algorithm"].is_string(), "{text}");
        if store != Store::Memory {
            assert!(counter["redis_key"].as_str().is_some(), "{text}");
        }
        assert_eq!(
            admitted(sluice, key, "bo", 1).await,
            0,
            "{key}: the dry run changed nothing"
        );
        let (status, text) = counters(sluice.http, None, &call(key, "bo", "reset", true));
        assert_eq!(status, 200, "{key}: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["applied"], json!(true), "{key}: {text}");
        assert_eq!(answer["counters"][0]["after"]["used"], json!(0), "{text}");
        assert_eq!(
            answer["counters"][0]["after"]["remaining"],
            json!(3),
            "{text}"
        );
        assert_eq!(
            admitted(sluice, key, "bo", 5).await,
            3,
            "{key}: a fresh counter after the reset"
        );
    }
    let log = sluice.log_text();
    assert!(
        log.contains("counter changed through /counters") && log.contains("ops-test"),
        "an audit line per change: {log}"
    );
}

async fn set_and_add_move_a_counter_by_their_hits(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    let with_hits = |action: &str, hits: i64| {
        let mut body = call("user", "cy", action, true);
        body["hits"] = json!(hits);
        let (status, text) = counters(sluice.http, None, &body);
        assert_eq!(status, 200, "{action} {hits}: {text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let set = with_hits("set", 2);
    assert_eq!(set["counters"][0]["after"]["used"], json!(2), "{set}");
    assert_eq!(
        admitted(sluice, "user", "cy", 3).await,
        1,
        "3 less the 2 set"
    );
    // A grant: one hit given back lets one more request through.
    let grant = with_hits("add", -1);
    assert_eq!(grant["counters"][0]["before"]["used"], json!(3), "{grant}");
    assert_eq!(grant["counters"][0]["after"]["used"], json!(2), "{grant}");
    assert_eq!(
        admitted(sluice, "user", "cy", 3).await,
        1,
        "the one granted"
    );
    let (status, text) = counters(sluice.http, None, &call("user", "cy", "reset", true));
    assert_eq!(status, 200, "{text}");
    let charged = with_hits("add", 3);
    assert_eq!(
        charged["counters"][0]["after"]["remaining"],
        json!(0),
        "{charged}"
    );
    assert_eq!(admitted(sluice, "user", "cy", 1).await, 0, "charged full");
    // Malformed calls change nothing.
    for body in [
        json!({"domain": "ops", "descriptors": [{"entries": [{"key": "user", "value": "cy"}]}], "action": "set"}),
        json!({"domain": "ops", "descriptors": [{"entries": [{"key": "user", "value": "cy"}]}], "action": "drop", "apply": true}),
        json!({"domain": "ops", "descriptors": [{"entries": [{"key": "log", "value": "cy"}]}], "action": "reset", "at": "2026-01-01T00:00:00Z", "apply": true}),
        json!([1, 2]),
    ] {
        let (status, text) = counters(sluice.http, None, &body);
        assert_eq!(status, 400, "{body}: {text}");
    }
    assert_eq!(admitted(sluice, "user", "cy", 1).await, 0, "still full");
}

async fn without_the_token_a_reset_is_refused_and_changes_nothing(store: Store) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, "s3cret\n").unwrap();
    let path = file.to_str().unwrap().to_owned();
    let replicas = replicas(store, &["--admin-token-file", &path]).await;
    let sluice = &replicas[0];
    assert_eq!(admitted(sluice, "user", "di", 4).await, 3);
    for token in [None, Some("wrong")] {
        let (status, _) = counters(sluice.http, token, &call("user", "di", "reset", true));
        assert_eq!(status, 401, "{token:?}");
        // A peer refused the token waits a second before it is checked again.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    assert_eq!(
        admitted(sluice, "user", "di", 1).await,
        0,
        "a refused reset changes nothing"
    );
    // `sluice counters`, with the token file: a dry run, then the reset.
    let cli = |apply: bool| {
        let mut args = vec![
            "counters",
            "reset",
            "--domain",
            "ops",
            "--descriptor",
            "user=di",
            "--admin-token-file",
            &path,
            "--by",
            "cli-test",
        ];
        if apply {
            args.push("--apply");
        }
        let admin = sluice.http.to_string();
        let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(&args)
            .args(["--admin", &admin])
            .output()
            .expect("sluice runs");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let dry = cli(false);
    assert!(
        dry.contains("dry run") && dry.contains("used 3 -> 0"),
        "{dry}"
    );
    assert_eq!(admitted(sluice, "user", "di", 1).await, 0, "a dry run");
    let applied = cli(true);
    assert!(applied.contains("applied"), "{applied}");
    assert_eq!(admitted(sluice, "user", "di", 4).await, 3, "reset");
    assert!(
        sluice.log_text().contains("cli-test"),
        "the audit line names who"
    );
}

async fn audit_lines_quote_what_callers_send_and_are_bounded_per_call(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    // A `by` made to pass for other fields, and to break or turn the line.
    let forged = "mallory peer=10.0.0.9 action=show\u{2028}by=admin\u{202e}\u{200b}";
    let mut body = call("user", "forger", "add", true);
    body["hits"] = json!(-1);
    body["by"] = json!(forged);
    let (status, text) = counters(sluice.http, None, &body);
    assert_eq!(status, 200, "{text}");
    let log = sluice.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("counter changed through /counters") && l.contains("forger"))
        .unwrap_or_else(|| panic!("an audit line: {log}"));
    assert!(
        line.contains(r#"by="mallory peer=10.0.0.9 action=show\u{2028}by=admin\u{202e}\u{200b}""#),
        "by quoted, its separators and bidirectional controls escaped: {line}"
    );
    for raw in ['\u{2028}', '\u{202e}', '\u{200b}'] {
        assert!(!log.contains(raw), "{raw:?} written as it is: {line}");
    }
    assert!(
        line.contains(r#"\u{200b}" peer="127.0.0.1" action="add""#),
        "the real fields follow the quoted by: {line}"
    );
    assert!(
        line.contains("hits=-1") && !line.contains("Some("),
        "{line}"
    );
    assert!(
        line.contains("outcome=\"applied\"") || line.contains("outcome=applied"),
        "{line}"
    );
    // Without `by`: said unknown, not empty.
    let mut anonymous = call("user", "nobody", "reset", true);
    anonymous.as_object_mut().unwrap().remove("by");
    assert_eq!(counters(sluice.http, None, &anonymous).0, 200);
    let log = sluice.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("nobody") && l.contains("by=\"unknown\"")),
        "{log}"
    );
    // A call naming 40 counters: 16 lines, then one counting the 24 others.
    let descriptors: Vec<Value> = (0..40)
        .map(|i| json!({"entries": [{"key": "user", "value": format!("many{i}")}]}))
        .collect();
    let many = json!({"domain": "ops", "descriptors": descriptors, "action": "reset", "apply": true, "by": "bulk"});
    let (status, text) = counters(sluice.http, None, &many);
    assert_eq!(status, 200, "{text}");
    let log = sluice.log_text();
    let named = log
        .lines()
        .filter(|l| l.contains("by=\"bulk\"") && l.contains("counter changed through"))
        .count();
    assert_eq!(named, 16, "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("by=\"bulk\"") && l.contains("more_counters=24")),
        "{log}"
    );
}

async fn at_names_the_window_now_or_a_later_one_never_a_past_one(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    let mut set = call("user", "past", "set", true);
    set["hits"] = json!(2);
    assert_eq!(counters(sluice.http, None, &set).0, 200);
    for (action, hits) in [
        ("set", Some(1)),
        ("reset", None),
        ("show", None),
        ("add", Some(-1)),
    ] {
        let mut body = call("user", "past", action, true);
        if let Some(hits) = hits {
            body["hits"] = json!(hits);
        }
        body["at"] = json!("2001-02-03T04:05:06Z");
        let (status, text) = counters(sluice.http, None, &body);
        assert_eq!(status, 400, "{action} at a past window: {text}");
        assert!(
            text.contains("past window") || text.contains("window before"),
            "{text}"
        );
    }
    let (status, text) = counters(sluice.http, None, &call("user", "past", "show", false));
    assert_eq!(status, 200, "{text}");
    let shown: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        shown["counters"][0]["before"]["used"],
        json!(2),
        "the refused calls changed nothing: {shown}"
    );
    // Within the window now, an earlier instant names it.
    let mut body = call("user", "past", "show", false);
    body["at"] = json!(rfc3339(unix_ms() - 1));
    let (status, text) = counters(sluice.http, None, &body);
    assert_eq!(status, 200, "{text}");
}

/// `ms` since the Unix epoch as an RFC 3339 instant (UTC, milliseconds).
fn rfc3339(ms: u64) -> String {
    jiff::Timestamp::from_millisecond(ms as i64)
        .unwrap()
        .to_string()
}

async fn set_and_add_never_take_a_counter_past_its_room(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    for key in ["user", "token"] {
        for (action, hits) in [("set", 4_i64), ("add", 4), ("add", 4_294_967_295)] {
            let mut body = call(key, "room", action, true);
            body["hits"] = json!(hits);
            let (status, text) = counters(sluice.http, None, &body);
            assert_eq!(status, 400, "{key} {action} {hits}: {text}");
            assert!(text.contains("past its room of 3"), "{text}");
        }
        assert_eq!(
            admitted(sluice, key, "room", 4).await,
            3,
            "{key}: nothing was charged"
        );
    }
}

async fn an_unknown_domain_is_said_and_the_command_fails(store: Store) {
    let replicas = replicas(store, &[]).await;
    let sluice = &replicas[0];
    let mut body = call("user", "x", "show", false);
    body["domain"] = json!("opz");
    let (status, text) = counters(sluice.http, None, &body);
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("no rules in force for the domain"), "{text}");
    let admin = sluice.http.to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "counters",
            "show",
            "--domain",
            "opz",
            "--descriptor",
            "user=x",
        ])
        .args(["--admin", &admin])
        .output()
        .expect("sluice runs");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no rules in force"),
        "{output:?}"
    );
}

/// A leased counter's reset (its blocks dropped, 1.1 s for the give-backs on their way, then the
/// delete) with Redis stopped 0.5 s into the call: the delete waits past the call's deadline, so
/// its outcome is unknown, and the answer says so (504), as the audit line does; once Redis runs
/// again the delete may land, which the answer allowed for.
#[tokio::test(flavor = "multi_thread")]
async fn a_reset_whose_outcome_is_unknown_says_so_and_is_audited() {
    let redis = support::redis::dedicated();
    let sluice = Sluice::on(
        Store::Memory,
        &[("rules.yaml", RULES)],
        &["--redis-url", redis.url.as_str(), "--trust-admin-port"],
    )
    .await;
    assert_eq!(admitted(&sluice, "leased", "paused", 5).await, 5);
    let addr = sluice.http;
    let reset =
        std::thread::spawn(move || counters(addr, None, &call("leased", "paused", "reset", true)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let paused = support::redis::Stopped::new(support::redis::pid_of(redis.ports[0]));
    let (status, text) = tokio::task::spawn_blocking(move || reset.join().unwrap())
        .await
        .unwrap();
    paused.resume();
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("outcome unknown"), "{text}");
    let log = sluice.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("counter changed through /counters")
                && l.contains("paused")
                && (l.contains("outcome=\"unknown\"") || l.contains("outcome=unknown"))),
        "{log}"
    );
}

/// A client over its limit on two replicas (3 an hour), each replica's over-limit cache holding
/// it full until the hour ends; while its reset goes through one replica, the other's connection
/// to the reset channel is killed over and over for 2 s, so that it hears no notice. Its
/// reconnection tells it that resets may have been missed: it empties its over-limit cache, and
/// the client is admitted there again at once, not at the end of the hour.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_that_may_have_missed_a_reset_forgets_the_clients_it_knew_full() {
    let redis = support::redis::dedicated();
    let flags = ["--redis-url", redis.url.as_str(), "--trust-admin-port"];
    let a = Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &flags).await;
    let b = Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &flags).await;
    assert_eq!(admitted(&b, "user", "cut", 4).await, 3);
    assert_eq!(admitted(&a, "user", "cut", 1).await, 0);
    let port = redis.ports[0];
    let killing = std::thread::spawn(move || {
        let until = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < until {
            support::redis::cli(port, &["CLIENT", "KILL", "TYPE", "pubsub"]);
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let addr = a.http;
    let reset = tokio::task::spawn_blocking(move || {
        counters(addr, None, &call("user", "cut", "reset", true))
    });
    let (status, text) = reset.await.unwrap();
    assert_eq!(status, 200, "{text}");
    tokio::task::spawn_blocking(move || killing.join().unwrap())
        .await
        .unwrap();
    support::eventually(
        "the replica that missed the notice admits the client again",
        Duration::from_secs(5),
        async || admitted(&b, "user", "cut", 1).await == 1,
    )
    .await;
    assert!(
        b.log_text().contains("counter resets may have been missed"),
        "{}",
        b.log_text()
    );
}

/// A leased counter (200 an hour) on two replicas, `b` holding a block of it; while the counter
/// is reset through `a`, every connection of `b` to Redis is severed (a proxy), so that it hears
/// neither of the reset's notices. Its reconnection reads the counter's marker of changes by
/// hand: the block taken before the reset is dropped, and from the fresh counter the two admit at
/// most its 200, where the stale block let them admit more.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_that_may_have_missed_a_reset_drops_the_blocks_taken_before_it() {
    const LEASED: &str = "domain: ops\ndescriptors:\n  - key: leased\n    lease: auto\n    rate_limit: {unit: hour, requests_per_unit: 200}\n";
    support::in_one_window(support::HOUR, async || {
        let redis = support::redis::dedicated();
        let proxy = support::proxy::Proxy::start(redis.ports[0]).await;
        let through = format!("redis://127.0.0.1:{}", proxy.port);
        let flags = |url| {
            [
                "--redis-url",
                url,
                "--trust-admin-port",
                "--lease-idle",
                "1h",
            ]
        };
        let a = Sluice::on(Store::Memory, &[("rules.yaml", LEASED)], &flags(&redis.url)).await;
        let b = Sluice::on(Store::Memory, &[("rules.yaml", LEASED)], &flags(&through)).await;
        let before = admitted(&b, "leased", "stale", 20).await;
        assert_eq!(before, 20);
        proxy.sever();
        let addr = a.http;
        let reset = tokio::task::spawn_blocking(move || {
            counters(addr, None, &call("leased", "stale", "reset", true))
        });
        let (status, text) = reset.await.unwrap();
        assert_eq!(status, 200, "{text}");
        proxy.mend();
        support::eventually(
            "the replica that missed the notices read the markers",
            Duration::from_secs(10),
            async || b.log_text().contains("counter resets may have been missed"),
        )
        .await;
        let mut after = 0;
        for _ in 0..250 {
            after += admitted(&b, "leased", "stale", 1).await;
            after += admitted(&a, "leased", "stale", 1).await;
        }
        println!("after the reset: {after} admitted of 200");
        assert!(
            after <= 200,
            "{after} admitted after the reset of a counter of 200\n{}",
            b.log_text()
        );
        assert!(
            after >= 150,
            "{after} admitted after the reset: blocks stranded"
        );
    })
    .await;
}
