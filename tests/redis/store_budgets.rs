//! Budgets no client can move: one rule keyed on client values cannot take the whole embedded
//! store, counters for scheduled instants (`/json` with `"at"`) cannot crowd out the present
//! ones, and no scheduled counter lives in Redis longer than `--max-schedule-ahead` plus its
//! window. Stores are scaled down with a small `--max-keys`; the process stays up in every test.

use std::net::SocketAddr;

use support::metrics::scrape;
use support::{HOUR, OK, OVER_LIMIT, Sluice, Store, http, in_one_window, request, unix_ms};
use tonic::Code;

const DAY_MS: u64 = 86_400_000;

/// `user` and `path`, two rules keyed on whatever value a client sends; `user` also takes
/// scheduled instants (a fixed window per day, and a sliding log).
const RULES: &str = r#"
domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 20}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 20}
  - key: other
    rate_limit: {unit: hour, requests_per_unit: 20}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 10}
  - key: log
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: sliding_log}
"#;

/// How a flood of requests was answered.
#[derive(Debug, Default)]
struct Tally {
    /// OK, and counted: the descriptor's status carries its limit.
    counted: usize,
    over: usize,
    /// gRPC errors, and the code of the first.
    errors: usize,
    first_error: Option<Code>,
}

/// Sends one request for `key=<prefix><i>` per `i` in `0..n`, from 8 callers at once.
async fn flood(sluice: &Sluice, key: &'static str, prefix: &'static str, n: usize) -> Tally {
    let callers = 8;
    let mut tasks = Vec::new();
    for c in 0..callers {
        let mut client = sluice.client().await;
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            for i in (c..n).step_by(callers) {
                let value = format!("{prefix}{i}");
                match client
                    .should_rate_limit(request("web", &[&[(key, &value)]]))
                    .await
                {
                    Ok(r) if r.get_ref().overall_code == OVER_LIMIT => tally.over += 1,
                    Ok(r) if r.get_ref().statuses[0].current_limit.is_some() => tally.counted += 1,
                    Ok(r) => panic!("an OK answer without a limit: {r:?}"),
                    Err(status) => {
                        tally.errors += 1;
                        tally.first_error.get_or_insert(status.code());
                    }
                }
            }
            tally
        }));
    }
    let mut all = Tally::default();
    for task in tasks {
        let t = task.await.expect("a caller runs to the end");
        all.counted += t.counted;
        all.over += t.over;
        all.errors += t.errors;
        all.first_error = all.first_error.or(t.first_error);
    }
    all
}

/// Posts `/json` requests for `key=<prefix><i>` (`i` in `0..n`), each at the instant `at`
/// (RFC 3339), from 8 threads; the HTTP statuses answered, in no order.
async fn post_scheduled(
    addr: SocketAddr,
    key: &'static str,
    prefix: &'static str,
    n: usize,
    at: String,
) -> Vec<u16> {
    let callers = 8;
    let mut tasks = Vec::new();
    for c in 0..callers {
        let at = at.clone();
        tasks.push(tokio::task::spawn_blocking(move || {
            (c..n)
                .step_by(callers)
                .map(|i| scheduled(addr, key, &format!("{prefix}{i}"), &at).0)
                .collect::<Vec<u16>>()
        }));
    }
    support::gather(tasks).await
}

/// Posts one `/json` request for `key=value` at the instant `at`; the status and the body.
fn scheduled(addr: SocketAddr, key: &str, value: &str, at: &str) -> (u16, String) {
    let body = format!(
        r#"{{"domain":"web","descriptors":[{{"entries":[{{"key":"{key}","value":"{value}"}}]}}],"at":"{at}"}}"#
    );
    let (status, _, body) = http(addr, "POST", "/json", &body);
    (status, body)
}

/// Midnight (UTC) `days` days from today, as RFC 3339.
fn days_ahead(days: u64) -> String {
    let ms = (unix_ms() / DAY_MS + days) * DAY_MS;
    jiff::Timestamp::from_millisecond(ms as i64)
        .expect("a valid instant")
        .to_string()
}

/// Asks for new values of `key`, one request each: every one is admitted and counted (a new
/// counter with one hit taken).
async fn new_counters_count(sluice: &Sluice, key: &str, prefix: &str, n: usize) {
    let mut client = sluice.client().await;
    for i in 0..n {
        let value = format!("{prefix}{i}");
        let r = client
            .should_rate_limit(request("web", &[&[(key, &value)]]))
            .await
            .unwrap_or_else(|s| panic!("{key}={value}: decided, not {s:?}"))
            .into_inner();
        assert_eq!(r.overall_code, OK, "{key}={value}: {r:?}");
        assert_eq!(
            r.statuses[0].limit_remaining,
            r.statuses[0]
                .current_limit
                .as_ref()
                .unwrap()
                .requests_per_unit
                - 1,
            "{key}={value} was counted in a new counter"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rule_flooded_with_unique_values_gets_over_limit_past_its_share_and_other_rules_carry_on()
{
    in_one_window(HOUR, async || {
        // 64 shards of 50 counters; a rule may hold half of each.
        let mut sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--max-keys", "3200"]).await;
        let mut client = sluice.client().await;
        let known = client
            .should_rate_limit(request("web", &[&[("user", "known")]]))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(known.statuses[0].limit_remaining, 19);

        let tally = flood(&sluice, "user", "flood-", 6_400).await;
        assert_eq!(
            tally.errors, 0,
            "a rule past its share is answered, never an error: {tally:?}"
        );
        assert!(
            tally.counted >= 1_200 && tally.counted <= 1_600,
            "the rule held about half of the store (at most 25 counters in each of 64 shards): {tally:?}"
        );
        assert_eq!(tally.counted + tally.over, 6_400);

        // The flooded rule's new values are over its limit, told to come back in a second.
        let refused = client
            .should_rate_limit(request("web", &[&[("user", "one-more")]]))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(refused.overall_code, OVER_LIMIT, "{refused:?}");
        let status = &refused.statuses[0];
        assert_eq!(status.code, OVER_LIMIT);
        assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 20);
        assert_eq!(status.limit_remaining, 0);
        assert_eq!(status.duration_until_reset.as_ref().unwrap().seconds, 1);
        let again = client
            .should_rate_limit(request("web", &[&[("user", "known")]]))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(
            again.statuses[0].limit_remaining, 18,
            "the rule's existing counters still count"
        );

        // Another rule creates new counters and decides normally, alone or beside the full rule.
        new_counters_count(&sluice, "path", "p", 200).await;
        let both = client
            .should_rate_limit(request(
                "web",
                &[&[("path", "p0")], &[("user", "yet-another")]],
            ))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(
            (
                both.overall_code,
                both.statuses[0].code,
                both.statuses[1].code
            ),
            (OVER_LIMIT, OK, OVER_LIMIT),
            "{both:?}"
        );
        assert_eq!(
            both.statuses[0].limit_remaining, 19,
            "a denied request consumed nothing"
        );

        let metrics = scrape(sluice.http);
        assert!(
            metrics.value("sluice_memory_refused_counters_total", &[("share", "rule")]) >= 4_800.0,
            "the refusals are counted"
        );
        assert!(sluice.alive());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn when_the_whole_store_is_full_a_rule_within_its_share_gets_the_on_store_error_answer() {
    in_one_window(HOUR, async || {
        // 64 shards of 10: two rules flooded to their half fill every shard.
        let mut sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--max-keys", "640"]).await;
        for key in ["user", "path"] {
            let tally = flood(&sluice, key, "flood-", 2_000).await;
            assert!(
                tally
                    .first_error
                    .is_none_or(|c| c == Code::ResourceExhausted),
                "{key}: {tally:?}"
            );
        }
        let mut client = sluice.client().await;
        let mut exhausted = 0;
        for i in 0..50 {
            let value = format!("o{i}");
            match client
                .should_rate_limit(request("web", &[&[("other", &value)]]))
                .await
            {
                Err(status) => {
                    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                    assert!(status.message().contains("--max-keys"), "{status:?}");
                    exhausted += 1;
                }
                Ok(r) => assert_eq!(r.get_ref().overall_code, OK),
            }
        }
        assert!(exhausted >= 45, "the store is full: {exhausted} of 50");
        let flooded = client
            .should_rate_limit(request("web", &[&[("user", "one-more")]]))
            .await
            .expect("a rule past its share is answered")
            .into_inner();
        assert_eq!(flooded.overall_code, OVER_LIMIT);
        assert!(sluice.alive());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn scheduled_counters_with_unique_values_never_crowd_out_new_present_counters() {
    in_one_window(HOUR, async || {
        // 64 shards of 50; scheduled counters may hold a quarter of each, a rule half of that.
        let mut sluice =
            Sluice::start_with(&[("rules.yaml", RULES)], &["--max-keys", "3200"]).await;
        let ahead = days_ahead(20);
        let mut statuses = post_scheduled(sluice.http, "daily", "f", 3_200, ahead.clone()).await;
        statuses.extend(post_scheduled(sluice.http, "log", "g", 3_200, ahead).await);
        // Present requests on new values of the same rules and of another one are decided.
        new_counters_count(&sluice, "daily", "d", 200).await;
        new_counters_count(&sluice, "log", "l", 200).await;
        new_counters_count(&sluice, "user", "u", 200).await;

        let admitted = statuses.iter().filter(|s| **s == 200).count();
        assert!(
            statuses.iter().all(|s| *s == 200 || *s == 429),
            "past their share, scheduled requests are over their limit: {:?}",
            statuses.iter().find(|s| **s != 200 && **s != 429)
        );
        assert!(
            admitted <= 64 * 13,
            "scheduled counters held at most 13 of each shard's 50 (a rule 7): {admitted}"
        );
        let refused = scheduled(sluice.http, "daily", "late", &days_ahead(20));
        assert_eq!(refused.0, 429, "{}", refused.1);
        assert!(sluice.alive());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_present_counter_given_a_scheduled_entry_counts_as_scheduled() {
    in_one_window(HOUR, async || {
        // A sliding log created now, then given an entry 20 days ahead, lives 20 days: it leaves the
        // rule's present share for the scheduled one, so it cannot hold a present slot that long.
        let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--max-keys", "3200"]).await;
        let ahead = days_ahead(20);
        let mut client = sluice.client().await;
        let mut moved = 0;
        for i in 0..3_200 {
            let value = format!("v{i}");
            let now = client
                .should_rate_limit(request("web", &[&[("log", &value)]]))
                .await
                .expect("decided")
                .into_inner();
            if now.overall_code != OK {
                break;
            }
            if scheduled(sluice.http, "log", &value, &ahead).0 == 200 {
                moved += 1;
            } else {
                break;
            }
        }
        assert!(moved < 3_200, "the scheduled share filled");
        new_counters_count(&sluice, "log", "l", 200).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instant_past_the_schedule_horizon_is_400_and_scheduled_redis_keys_expire_within_it() {
    let redis = Store::Redis.redis().expect("a Redis");
    let prefix = format!("budgets-{}:", std::process::id());
    let sluice = Sluice::on(
        Store::Redis,
        &[("rules.yaml", RULES)],
        &["--redis-key-prefix", &prefix],
    )
    .await;
    for far in [
        days_ahead(32),
        days_ahead(2 * 365),
        "2035-06-01T00:00:00Z".to_owned(),
    ] {
        let (status, body) = scheduled(sluice.http, "daily", "far", &far);
        assert_eq!(status, 400, "{far}: {body}");
        assert!(body.contains("--max-schedule-ahead"), "{body}");
    }
    assert_eq!(
        support::redis::cli(redis.ports[0], &["KEYS", &format!("{prefix}*")]).trim(),
        "",
        "a refused instant wrote nothing"
    );

    let (status, body) = scheduled(sluice.http, "daily", "near", &days_ahead(30));
    assert_eq!(status, 200, "{body}");
    let keys = support::redis::cli(redis.ports[0], &["KEYS", &format!("{prefix}*")]);
    let key = keys.trim();
    assert!(!key.is_empty() && !key.contains('\n'), "one key: {keys}");
    let ttl_ms: u64 = support::redis::cli(redis.ports[0], &["PTTL", key])
        .trim()
        .parse()
        .expect("a TTL");
    assert!(
        ttl_ms <= 31 * DAY_MS + DAY_MS,
        "at most --max-schedule-ahead (31 days) and the window (a day): {ttl_ms} ms"
    );
    assert!(
        ttl_ms > 30 * DAY_MS,
        "the scheduled window is kept: {ttl_ms} ms"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_schedule_horizon_is_set_by_a_flag() {
    let sluice =
        Sluice::start_with(&[("rules.yaml", RULES)], &["--max-schedule-ahead", "1h"]).await;
    let soon = jiff::Timestamp::from_millisecond((unix_ms() + 30 * 60_000) as i64)
        .unwrap()
        .to_string();
    assert_eq!(scheduled(sluice.http, "daily", "a", &soon).0, 200);
    let (status, body) = scheduled(sluice.http, "daily", "a", &days_ahead(2));
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("1h") && body.contains("--max-schedule-ahead"),
        "{body}"
    );
}
