//! Black-box specification of the algorithms: the real binary over gRPC and `/json`, each limit
//! of a second or a few, and the same admissions, `limit_remaining` and `duration_until_reset`
//! on the embedded store, a standalone Redis and a Redis Cluster. Timed assertions bound a reset
//! (whole seconds, rounded up, at least 1) by the instants the requests were sent and answered,
//! and every sleep leaves a second or more of slack; the scheduled instants of `/json` need no
//! clock at all.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::redis::signal;
use support::{
    HOUR, OK, OVER_LIMIT, Sluice, Store, eventually, http, in_one_window, request,
    sleep_until_unix_ms, unix_ms,
};
use tonic::transport::Channel;

on_every_store!(
    a_fixed_window_admits_its_limit_per_window_and_starts_afresh_in_the_next,
    a_sliding_window_still_weighs_the_previous_window_after_its_edge,
    a_sliding_log_admits_again_only_once_its_oldest_entry_is_a_window_old,
    a_token_bucket_admits_its_burst_at_once_then_a_token_per_interval,
    a_leaky_bucket_admits_its_default_burst_then_drains_one_per_interval,
    a_mixed_list_names_the_limit_that_denied_else_the_least_left_and_denials_consume_nothing,
    scheduled_messages_keep_one_a_minute_five_an_hour_and_ten_a_day,
);

const RULES: &str = r#"
domain: alg
descriptors:
  - key: fixed
    rate_limit: {unit: second, unit_multiplier: 2, requests_per_unit: 3}
  - key: sliding
    rate_limit: {unit: second, unit_multiplier: 3, requests_per_unit: 2, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: second, unit_multiplier: 3, requests_per_unit: 3, algorithm: sliding_log}
  - key: token
    rate_limit: {unit: second, unit_multiplier: 2, requests_per_unit: 1, algorithm: token_bucket, burst: 5}
  - key: leaky
    rate_limit: {unit: second, unit_multiplier: 4, requests_per_unit: 2, algorithm: leaky_bucket}
  - key: mixed
    rate_limits:
      - {unit: second, unit_multiplier: 2, requests_per_unit: 2, algorithm: sliding_log, name: log}
      - {unit: second, unit_multiplier: 4, requests_per_unit: 1, algorithm: token_bucket, burst: 3, name: bucket}
      - {unit: hour, requests_per_unit: 4, name: window}
"#;

/// The wall clock and the store's clock may disagree by a millisecond of rounding each, and
/// drift a little apart over a test.
const CLOCKS: u64 = 5;

type Client = RateLimitServiceClient<Channel>;

/// What the status of a request's one descriptor said, and when (Unix ms) the request was sent
/// and its answer arrived.
#[derive(Debug)]
struct Answer {
    code: i32,
    remaining: u32,
    reset: Duration,
    name: String,
    sent: u64,
    answered: u64,
}

impl Answer {
    fn reset_ms(&self) -> u64 {
        self.reset.as_millis() as u64
    }
}

/// Sends one hit for `key=v` in domain `alg` over `client`'s connection.
async fn hit(client: &mut Client, key: &str) -> Answer {
    let sent = unix_ms();
    let response = client
        .should_rate_limit(request("alg", &[&[(key, "v")]]))
        .await
        .expect("ShouldRateLimit succeeds")
        .into_inner();
    let answered = unix_ms();
    let status = &response.statuses[0];
    assert_eq!(response.overall_code, status.code, "one descriptor decides");
    let reset = status.duration_until_reset.expect("duration_until_reset");
    assert!(
        reset.seconds >= 1 && reset.nanos == 0,
        "a reset is whole seconds, at least 1: {reset:?}"
    );
    Answer {
        code: status.code,
        remaining: status.limit_remaining,
        reset: Duration::new(reset.seconds as u64, reset.nanos as u32),
        name: status
            .current_limit
            .as_ref()
            .expect("current_limit")
            .name
            .clone(),
        sent,
        answered,
    }
}

/// A sluice on `store` with `RULES`, and a client of it.
async fn started(store: Store) -> (Sluice, Client) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let client = sluice.client().await;
    (sluice, client)
}

/// Sends one hit for `key=v`, which must be denied with nothing remaining.
async fn hit_denied(client: &mut Client, key: &str) -> Answer {
    let denied = hit(client, key).await;
    assert_eq!((denied.code, denied.remaining), (OVER_LIMIT, 0));
    denied
}

/// Sends one hit for `key=v` once the reset `denied` reported (and 100 ms) has passed.
async fn hit_after_reset(client: &mut Client, key: &str, denied: &Answer) -> Answer {
    sleep_ms(denied.reset_ms() + 100).await;
    hit(client, key).await
}

/// A time in ms as a status reports it: whole seconds, rounded up, at least 1.
fn whole_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// Asserts that `answer`'s reset is a time between `low` and `high` ms, in whole seconds.
fn assert_reset_between(answer: &Answer, low: u64, high: u64, what: &str) {
    let (low, high) = (whole_seconds(low), whole_seconds(high));
    let reset = answer.reset.as_secs();
    assert!(
        (low..=high).contains(&reset),
        "reset {reset} s should be {what}: within {low}..={high} s"
    );
}

/// Asserts that `later`'s reset is `period_ms` counted from `earlier`'s hit: `period_ms` less the
/// time between the two requests, as closely as their send and answer instants bound it.
fn assert_reset_counts_from(earlier: &Answer, later: &Answer, period_ms: u64) {
    let low = period_ms.saturating_sub(later.answered - earlier.sent + CLOCKS);
    let high = period_ms.saturating_sub(later.sent.saturating_sub(earlier.answered)) + CLOCKS;
    let what = format!("{period_ms} ms from the earlier hit");
    assert_reset_between(later, low, high, &what);
}

/// Asserts that `answer`'s reset is the time until `end` (Unix ms), as closely as its send and
/// answer instants bound it.
fn assert_reset_until(answer: &Answer, end: u64) {
    let low = end.saturating_sub(answer.answered + CLOCKS);
    let high = end.saturating_sub(answer.sent) + CLOCKS;
    assert_reset_between(answer, low, high, &format!("until {end}"));
}

/// Sleeps until 50 ms into the next window of `window_ms` aligned to the Unix epoch, and returns
/// when that window starts.
async fn at_the_start_of_a_window(window_ms: u64) -> u64 {
    let start = (unix_ms() / window_ms + 1) * window_ms;
    sleep_until_unix_ms(start + 50).await;
    start
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// 3 per 2 s.
async fn a_fixed_window_admits_its_limit_per_window_and_starts_afresh_in_the_next(store: Store) {
    let (_sluice, mut client) = started(store).await;
    let start = at_the_start_of_a_window(2_000).await;
    for expected in [2, 1, 0] {
        let a = hit(&mut client, "fixed").await;
        assert_eq!((a.code, a.remaining), (OK, expected), "{a:?}");
        assert_reset_until(&a, start + 2_000);
    }
    let denied = hit_denied(&mut client, "fixed").await;
    // The local cache may answer (the window was filled): its reset runs from when it learnt.
    assert_reset_between(
        &denied,
        1,
        start + 2_000 - denied.sent + CLOCKS,
        "in the window",
    );

    sleep_until_unix_ms(start + 2_050).await;
    let a = hit(&mut client, "fixed").await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 2),
        "the next window forgets the last"
    );
    assert_reset_until(&a, start + 4_000);
}

/// 2 per 3 s: 50 ms past the edge, the previous window's 2 still weigh ⌊2 × 2950 / 3000⌋ = 1,
/// until half the window has passed.
async fn a_sliding_window_still_weighs_the_previous_window_after_its_edge(store: Store) {
    let (_sluice, mut client) = started(store).await;
    let start = at_the_start_of_a_window(3_000).await;
    for expected in [1, 0] {
        let a = hit(&mut client, "sliding").await;
        assert_eq!((a.code, a.remaining), (OK, expected), "{a:?}");
        assert_reset_until(&a, start + 3_000);
    }
    let denied = hit_denied(&mut client, "sliding").await;
    assert_reset_until(&denied, start + 3_001);

    let next = start + 3_000;
    sleep_until_unix_ms(next + 50).await;
    let a = hit(&mut client, "sliding").await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "one fits beside the weighted 1"
    );
    let denied = hit_denied(&mut client, "sliding").await;
    assert_reset_until(&denied, next + 1_501);

    let a = hit_after_reset(&mut client, "sliding", &denied).await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "past the middle, the previous window weighs nothing"
    );
}

/// 3 per 3 s: one hit, 1.55 s later two more; the fourth fits once the first is 3 s old, the
/// fifth once the second is.
async fn a_sliding_log_admits_again_only_once_its_oldest_entry_is_a_window_old(store: Store) {
    let (_sluice, mut client) = started(store).await;
    let first = hit(&mut client, "log").await;
    assert_eq!((first.code, first.remaining), (OK, 2));
    assert_eq!(
        first.reset,
        Duration::from_secs(3),
        "the log is empty one window after its newest entry"
    );
    sleep_ms(1_550).await;
    let second = hit(&mut client, "log").await;
    assert_eq!((second.code, second.remaining), (OK, 1));
    assert_eq!(second.reset, Duration::from_secs(3));
    let third = hit(&mut client, "log").await;
    assert_eq!((third.code, third.remaining), (OK, 0));
    let denied = hit_denied(&mut client, "log").await;
    assert_reset_counts_from(&first, &denied, 3_000);

    // Once the first entry is a window old (not at the rounded-up reset, which would leave less
    // than a second before the second entry leaves too).
    sleep_until_unix_ms(first.answered + 3_000 + 100).await;
    let a = hit(&mut client, "log").await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "the first entry left; the second and third still count"
    );
    let denied = hit_denied(&mut client, "log").await;
    assert_reset_counts_from(&second, &denied, 3_000);
}

/// A token every 2 s, up to 5.
async fn a_token_bucket_admits_its_burst_at_once_then_a_token_per_interval(store: Store) {
    let (_sluice, mut client) = started(store).await;
    let first = hit(&mut client, "token").await;
    assert_eq!((first.code, first.remaining), (OK, 4));
    assert_eq!(
        first.reset,
        Duration::from_secs(2),
        "one token to refill: full again in 2 s"
    );
    for (tokens, expected) in [(2, 3), (3, 2), (4, 1), (5, 0)] {
        let a = hit(&mut client, "token").await;
        assert_eq!((a.code, a.remaining), (OK, expected), "{a:?}");
        assert_reset_counts_from(&first, &a, 2_000 * tokens);
    }
    let denied = hit_denied(&mut client, "token").await;
    assert_reset_counts_from(&first, &denied, 2_000);

    let a = hit_after_reset(&mut client, "token", &denied).await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "one token came back, and is taken"
    );
    let denied = hit_denied(&mut client, "token").await;
    assert!(
        denied.reset > Duration::ZERO && denied.reset <= Duration::from_secs(2),
        "{denied:?}"
    );
}

/// 2 per 4 s, so a burst of 2 (the default) draining one every 2 s.
async fn a_leaky_bucket_admits_its_default_burst_then_drains_one_per_interval(store: Store) {
    let (_sluice, mut client) = started(store).await;
    let first = hit(&mut client, "leaky").await;
    assert_eq!((first.code, first.remaining), (OK, 1));
    assert_eq!(
        first.reset,
        Duration::from_secs(2),
        "one hit in the bucket: empty again in 2 s"
    );
    let second = hit(&mut client, "leaky").await;
    assert_eq!((second.code, second.remaining), (OK, 0));
    assert_reset_counts_from(&first, &second, 4_000);
    let denied = hit_denied(&mut client, "leaky").await;
    assert_reset_counts_from(&first, &denied, 2_000);

    let a = hit_after_reset(&mut client, "leaky", &denied).await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "one hit drained, and one fills its place"
    );
    hit_denied(&mut client, "leaky").await;
}

/// A sliding log of 2 per 2 s, a token bucket of 1 per 4 s holding 3 and a fixed window of 4 an
/// hour on one descriptor, all within one hour.
async fn a_mixed_list_names_the_limit_that_denied_else_the_least_left_and_denials_consume_nothing(
    store: Store,
) {
    in_one_window(HOUR, async || {
        let (_sluice, mut client) = started(store).await;
        let shown = |a: &Answer| (a.code, a.name.clone(), a.remaining);

        let first = hit(&mut client, "mixed").await;
        assert_eq!(
            shown(&first),
            (OK, "log".into(), 1),
            "log 1 left, bucket 2, window 3"
        );
        let second = hit(&mut client, "mixed").await;
        assert_eq!(
            shown(&second),
            (OK, "log".into(), 0),
            "log 0 left, bucket 1, window 2"
        );
        let denied = hit(&mut client, "mixed").await;
        assert_eq!(shown(&denied), (OVER_LIMIT, "log".into(), 0));
        assert_reset_counts_from(&first, &denied, 2_000);
        for _ in 0..2 {
            let again = hit(&mut client, "mixed").await;
            assert_eq!(shown(&again), (OVER_LIMIT, "log".into(), 0));
        }

        sleep_until_unix_ms(second.answered + 2_100).await;
        let a = hit(&mut client, "mixed").await;
        assert_eq!(
            shown(&a),
            (OK, "bucket".into(), 0),
            "the log's 3 denials took nothing: the bucket had 1 token left (log 1 left, window 1)"
        );
        let denied = hit(&mut client, "mixed").await;
        assert_eq!(shown(&denied), (OVER_LIMIT, "bucket".into(), 0));
        assert_reset_counts_from(&first, &denied, 4_000);
        let again = hit(&mut client, "mixed").await;
        assert_eq!(shown(&again), (OVER_LIMIT, "bucket".into(), 0));

        let a = hit_after_reset(&mut client, "mixed", &denied).await;
        assert_eq!(
            (a.code, a.remaining),
            (OK, 0),
            "the bucket's 2 denials took nothing: the window had 1 left"
        );
        let denied = hit(&mut client, "mixed").await;
        assert_eq!(
            (denied.code, denied.name.as_str()),
            (OVER_LIMIT, "window"),
            "the window and the bucket deny: the status names the one that admits last"
        );
        let hour_ends = (denied.sent / 3_600_000 + 1) * 3_600_000;
        assert_reset_until(&denied, hour_ends);
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Scheduled instants (`/json` with "at")

const MESSAGES: &str = r#"
domain: messages
descriptors:
  - key: user
    rate_limits:
      - {unit: minute, requests_per_unit: 1, algorithm: sliding_log, name: per_minute}
      - {unit: hour, requests_per_unit: 5, algorithm: sliding_log, name: per_hour}
      - {unit: day, requests_per_unit: 10, name: per_day}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
  - key: fixed
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;

const DAY_MS: u64 = 86_400_000;

/// The UTC date (`YYYY-MM-DD`) of the day starting at `day_ms`.
fn date(day_ms: u64) -> String {
    let midnight = jiff::Timestamp::from_millisecond(day_ms as i64).expect("a valid instant");
    midnight.to_string()[..10].to_owned()
}

/// What `/json` answered: the HTTP status, and the status of the request's one descriptor.
#[derive(Debug)]
struct Json {
    status: u16,
    name: String,
    remaining: u64,
    body: String,
}

/// Posts one request for `key=value` in domain `messages` to `/json`, with `"at": at`, a JSON
/// value (such as `"\"2030-01-01T11:11:11Z\""`).
fn post(sluice: &Sluice, key: &str, value: &str, at: &str) -> Json {
    let body = format!(
        r#"{{"domain":"messages","descriptors":[{{"entries":[{{"key":"{key}","value":"{value}"}}]}}],"at":{at}}}"#
    );
    let (status, _, body) = http(sluice.http, "POST", "/json", &body);
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let descriptor = &answer["statuses"][0];
    Json {
        status,
        name: descriptor["currentLimit"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        // Protobuf JSON leaves out a remaining of 0.
        remaining: descriptor["limitRemaining"].as_u64().unwrap_or(0),
        body,
    }
}

/// The issue's example: at most one message a minute, 5 an hour and 10 a day for one user, each
/// message counted at the instant it is scheduled for, on the day after tomorrow (UTC).
async fn scheduled_messages_keep_one_a_minute_five_an_hour_and_ten_a_day(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", MESSAGES)], &[]).await;
    let day = (unix_ms() / DAY_MS + 2) * DAY_MS;
    let (on, after) = (date(day), date(day + DAY_MS));
    let send = |time: &str| post(&sluice, "user", "alice", &format!("\"{on}T{time}\""));
    let expect = |time: &str, status: u16, name: &str, remaining: u64| {
        let answer = send(time);
        assert_eq!(
            (answer.status, answer.name.as_str(), answer.remaining),
            (status, name, remaining),
            "at {time}: {}",
            answer.body
        );
    };

    expect("11:11:11Z", 200, "per_minute", 0);
    expect("11:11:12Z", 429, "per_minute", 0);
    expect("12:11:12+01:00", 429, "per_minute", 0);
    expect("11:12:10.999Z", 429, "per_minute", 0);
    expect("11:12:12Z", 200, "per_minute", 0);
    for time in ["11:13:13Z", "11:14:14Z", "11:15:15Z"] {
        let answer = send(time);
        assert_eq!((answer.status, answer.remaining), (200, 0), "at {time}");
    }
    expect("11:16:16Z", 429, "per_hour", 0);
    expect("12:11:10.999Z", 429, "per_hour", 0);
    // Earlier than every message so far, but the hour from then holds all five.
    expect("11:01:00Z", 429, "per_hour", 0);
    let hour_on = send("12:11:11Z");
    assert_eq!(
        (hour_on.status, hour_on.remaining),
        (200, 0),
        "an hour after the first message, it has left every hour holding the instant: {}",
        hour_on.body
    );
    for (time, left) in [("13:20:00Z", 3), ("13:21:00Z", 2), ("13:22:00Z", 1)] {
        let answer = send(time);
        assert_eq!(
            (answer.status, answer.remaining),
            (200, 0),
            "at {time}: per_minute 0 left, per_day {left}"
        );
    }
    let tenth = send("13:23:00Z");
    assert_eq!(
        (tenth.status, tenth.remaining),
        (200, 0),
        "the day's tenth: the refusals before consumed nothing"
    );
    expect("16:00:00Z", 429, "per_day", 0);
    expect("23:59:59.999Z", 429, "per_day", 0);
    let next_day = post(&sluice, "user", "alice", &format!("\"{after}T00:00:00Z\""));
    assert_eq!(
        (next_day.status, next_day.name.as_str()),
        (200, "per_minute"),
        "the next UTC day has a window of its own: {}",
        next_day.body
    );
    let other = post(&sluice, "user", "bob", &format!("\"{on}T11:11:12Z\""));
    assert_eq!(other.status, 200, "each user counts apart");
}

#[tokio::test]
async fn at_on_a_bucket_or_a_sliding_window_is_400_naming_the_algorithm() {
    let sluice = Sluice::start(MESSAGES).await;
    let tomorrow = format!("\"{}T11:11:11Z\"", date((unix_ms() / DAY_MS + 1) * DAY_MS));
    for (key, algorithm) in [("bucket", "token_bucket"), ("sliding", "sliding_window")] {
        let answer = post(&sluice, key, "k", &tomorrow);
        assert_eq!(answer.status, 400, "{key}: {}", answer.body);
        assert!(
            answer.body.contains("only fixed_window and sliding_log")
                && answer.body.contains(algorithm),
            "{}",
            answer.body
        );
    }
    let without = post(&sluice, "bucket", "k", "null");
    assert_eq!(
        (without.status, without.remaining),
        (200, 4),
        "without an instant, the bucket counts now"
    );
}

#[tokio::test]
async fn an_at_that_is_not_an_rfc_3339_instant_or_past_the_schedule_horizon_is_400() {
    let sluice = Sluice::start(MESSAGES).await;
    let far = |days: u64| {
        let day = (unix_ms() / DAY_MS + days) * DAY_MS;
        format!("\"{}T00:00:00Z\"", date(day))
    };
    for (at, says) in [
        ("\"tomorrow\"", "not an RFC 3339 instant"),
        ("\"2030-01-01T11:11:11\"", "not an RFC 3339 instant"),
        ("\"2030-13-01T11:11:11Z\"", "not an RFC 3339 instant"),
        ("1893496271000", "must be an RFC 3339 instant in a string"),
        (
            far(32).as_str(),
            "more than --max-schedule-ahead (31d) ahead",
        ),
        (
            far(3_652).as_str(),
            "more than --max-schedule-ahead (31d) ahead",
        ),
    ] {
        let answer = post(&sluice, "fixed", "k", at);
        assert_eq!(answer.status, 400, "{at}: {}", answer.body);
        assert!(answer.body.contains(says), "{at}: {}", answer.body);
    }
    let within = post(&sluice, "fixed", "k", &far(30));
    assert_eq!(
        (within.status, within.remaining),
        (200, 1),
        "up to 31 days ahead is fine, and the rejected requests consumed nothing: {}",
        within.body
    );
}

#[tokio::test]
async fn an_at_already_past_counts_as_now() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start(MESSAGES).await;
        let past = post(&sluice, "fixed", "k", "\"2001-01-01T00:00:00Z\"");
        assert_eq!((past.status, past.remaining), (200, 1), "{}", past.body);
        let now = sluice.ask(request("messages", &[&[("fixed", "k")]])).await;
        assert_eq!(
            (now.overall_code, now.statuses[0].limit_remaining),
            (OK, 0),
            "the past instant counted in this hour's window"
        );
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Reload

const BUCKET: &str = "domain: alg
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 1
      algorithm: token_bucket
      burst: 2
";

#[tokio::test]
async fn a_reload_breaking_an_algorithms_bounds_is_reported_at_its_lines_and_the_rules_stay() {
    let mut sluice = Sluice::start(BUCKET).await;
    let mut client = sluice.client().await;
    assert_eq!(hit(&mut client, "user").await.remaining, 1);
    std::fs::write(
        sluice.rules.join("rules.yaml"),
        "domain: alg
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 1
      algorithm: token_bucket
      burst: 0
  - key: log
    rate_limit:
      unit: hour
      requests_per_unit: 1001
      algorithm: sliding_log
",
    )
    .unwrap();
    signal(sluice.pid(), "HUP");
    let reported = [
        "rules.yaml:8: burst must be at least 1",
        "rules.yaml:12: sliding_log",
    ];
    eventually(
        "both errors are logged at their lines",
        Duration::from_secs(10),
        async || reported.iter().all(|r| sluice.log_text().contains(r)),
    )
    .await;
    let a = hit(&mut client, "user").await;
    assert_eq!(
        (a.code, a.remaining),
        (OK, 0),
        "the bucket of 2 is still in force"
    );
    assert_eq!(hit(&mut client, "user").await.code, OVER_LIMIT);
    assert!(sluice.alive());
}
