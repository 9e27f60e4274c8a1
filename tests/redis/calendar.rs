//! Calendar windows (`calendar:`), across their boundaries, on every store: sluice's calendar
//! clock is set (`--calendar-clock-offset-ms`, for tests) a few seconds before a boundary of
//! the test's choosing; the counters fill before it, free up at it, and the answer's reset,
//! `/explain` and the Redis key's expiry name the real calendar boundary: the end of a month in
//! Berlin, the 23- and 25-hour days of Berlin's and New York's clock changes, 29 February and a
//! month anchored on the 31st, weeks from Monday and from Sunday, and two replicas crossing one
//! boundary together. The cases of a store run at once, each with a sluice of its own: they
//! spend their time waiting for their boundaries.

use std::process::Command;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{OK, OVER_LIMIT, Sluice, Store, explained, redis_key, request, unix_ms};
use tonic::transport::Channel;

on_every_store!(calendar_windows_end_at_their_boundaries_in_their_zones);

async fn calendar_windows_end_at_their_boundaries_in_their_zones(store: Store) {
    let shared = async {
        if store != Store::Memory {
            two_replicas_cross_the_boundary_together_and_admit_the_limit_on_each_side(store).await;
        }
    };
    tokio::join!(
        a_month_in_berlin_ends_at_its_midnight_and_the_next_counts_afresh(store),
        the_day_of_berlins_change_to_summer_time_lasts_23_hours(store),
        the_day_of_new_yorks_change_to_winter_time_lasts_25_hours(store),
        on_29_february_a_month_anchored_on_the_31st_starts_and_lasts_until_31_march(store),
        a_week_from_sunday_ends_on_sunday_and_one_from_monday_a_day_later(store),
        shared,
    );
}

const DAY: u64 = 86_400;
const HOUR: u64 = 3_600;

/// How long before the boundary the calendar's clock is set when a case starts: time enough to
/// start its sluices and fill a counter on a busy machine.
const LEAD_MS: u64 = 8_000;

/// A calendar boundary a test crosses: midnight of a date in a zone, and where this machine's
/// clock will be when sluice's calendar reaches it.
struct Boundary {
    /// `--calendar-clock-offset-ms`: the calendar's clock less this machine's.
    offset: i64,
    /// The instant on this machine's clock at which the calendar reaches the boundary, in ms.
    real_ms: u64,
}

impl Boundary {
    /// Midnight starting `date` in `zone`, `LEAD_MS` from now.
    fn ahead(zone: &str, (y, m, d): (i16, i8, i8)) -> Boundary {
        let instant = jiff::civil::date(y, m, d)
            .in_tz(zone)
            .expect("a midnight in the zone")
            .timestamp()
            .as_millisecond();
        let real_ms = unix_ms() + LEAD_MS;
        Boundary {
            offset: instant - real_ms as i64,
            real_ms,
        }
    }

    fn flag(&self) -> String {
        format!("--calendar-clock-offset-ms={}", self.offset)
    }

    /// Sluice on `store`, its calendar's clock set before the boundary, with `rules`.
    async fn sluice(&self, store: Store, rules: &str, flags: &[&str]) -> Sluice {
        let pin = self.flag();
        let mut all = vec![pin.as_str()];
        all.extend_from_slice(flags);
        Sluice::on(store, &[("rules.yaml", rules)], &all).await
    }

    /// Asserts that the boundary is still ahead: what the test did before it counted in the
    /// window that ends there.
    fn still_ahead(&self, what: &str) {
        assert!(
            unix_ms() < self.real_ms,
            "{what} took past the boundary; the test machine is too slow for LEAD_MS"
        );
    }

    /// Waits until the calendar has passed the boundary.
    async fn pass(&self) {
        let wait = (self.real_ms + 300).saturating_sub(unix_ms());
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
}

/// The answer's first status: its code, what remains and the seconds to its reset.
fn first(answer: &RateLimitResponse) -> (i32, u32, u64) {
    let status = &answer.statuses[0];
    let reset = status
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds as u64);
    (status.code, status.limit_remaining, reset)
}

/// Fills `entries`' counter of `limit` before the boundary: every answer's reset is the time
/// left to the boundary (within the lead), the one past the limit is denied.
async fn fill_before(
    sluice: &Sluice,
    boundary: &Boundary,
    domain: &str,
    entries: &[(&str, &str)],
    limit: u32,
) {
    for n in 1..=limit {
        let (code, remaining, reset) = first(&sluice.ask(request(domain, &[entries])).await);
        assert_eq!(
            (code, remaining),
            (OK, limit - n),
            "{entries:?} request {n}"
        );
        assert!(
            (1..=LEAD_MS / 1000 + 1).contains(&reset),
            "{entries:?}: the reset is the time left to the boundary, not {reset} s"
        );
    }
    let (code, _, reset) = first(&sluice.ask(request(domain, &[entries])).await);
    assert_eq!(
        code, OVER_LIMIT,
        "{entries:?}: past the limit before the boundary"
    );
    assert!(
        reset <= LEAD_MS / 1000 + 1,
        "{entries:?}: denied until the boundary, not {reset} s"
    );
    boundary.still_ahead("filling the counter");
}

/// After the boundary: `entries`' counter is fresh, and resets at the end of a window of
/// `length` seconds (within two seconds of the test's own pace).
/// How late after a boundary a request may be asked on a loaded machine (the suite's lanes side
/// by side): its reset is then that much short of the window's length, never a window off.
const LATE_S: u64 = 10;

async fn fresh_after(
    sluice: &Sluice,
    domain: &str,
    entries: &[(&str, &str)],
    limit: u32,
    length: u64,
) {
    let (code, remaining, reset) = first(&sluice.ask(request(domain, &[entries])).await);
    assert_eq!(
        (code, remaining),
        (OK, limit - 1),
        "{entries:?}: a fresh window"
    );
    assert!(
        reset <= length && reset + LATE_S >= length,
        "{entries:?}: the new window lasts {length} s; its reset is {reset} s"
    );
}

const MONTH: &str = "\
domain: billing
descriptors:
  - key: tenant
    rate_limit:
      unit: month
      requests_per_unit: 3
      calendar: {time_zone: Europe/Berlin}
";

async fn a_month_in_berlin_ends_at_its_midnight_and_the_next_counts_afresh(store: Store) {
    // 1 February 2027 at 00:00 in Berlin is 31 January at 23:00 UTC.
    let boundary = Boundary::ahead("Europe/Berlin", (2027, 2, 1));
    let sluice = boundary.sluice(store, MONTH, &[]).await;
    let tenant = [("tenant", "acme")];
    fill_before(&sluice, &boundary, "billing", &tenant, 3).await;
    let explained = explained(&sluice, "billing", &tenant);
    let window = &explained["descriptors"][0]["counters"][0]["window"];
    assert_eq!(
        window["start"], "2027-01-01T00:00:00+01:00[Europe/Berlin]",
        "{explained}"
    );
    assert_eq!(
        window["end"], "2027-02-01T00:00:00+01:00[Europe/Berlin]",
        "{explained}"
    );
    assert!(window["ends_in_seconds"].as_u64().unwrap() <= LEAD_MS / 1000 + 1);
    if let Some(redis) = store.redis() {
        // The key expires at the boundary itself, on Redis' clock: no later.
        let key = redis_key(&sluice, "billing", &tenant);
        let expiry = pexpiretime(&redis.ports, &key);
        assert!(
            expiry.abs_diff(boundary.real_ms as i64) <= 50,
            "{key} expires at {expiry}, the boundary is at {}",
            boundary.real_ms
        );
    }
    boundary.still_ahead("reading the counter");
    boundary.pass().await;
    // February 2027 has 28 days.
    fresh_after(&sluice, "billing", &tenant, 3, 28 * DAY).await;
}

const DAYS: &str = "\
domain: days
descriptors:
  - key: zone
    value: berlin
    rate_limit: {unit: day, requests_per_unit: 2, calendar: {time_zone: Europe/Berlin}}
  - key: zone
    value: new_york
    rate_limit: {unit: day, requests_per_unit: 2, calendar: {time_zone: America/New_York}}
";

async fn the_day_of_berlins_change_to_summer_time_lasts_23_hours(store: Store) {
    // Berlin moves its clocks forward on 28 March 2027.
    let berlin = Boundary::ahead("Europe/Berlin", (2027, 3, 28));
    let sluice = berlin.sluice(store, DAYS, &[]).await;
    fill_before(&sluice, &berlin, "days", &[("zone", "berlin")], 2).await;
    berlin.pass().await;
    fresh_after(&sluice, "days", &[("zone", "berlin")], 2, 23 * HOUR).await;
}

async fn the_day_of_new_yorks_change_to_winter_time_lasts_25_hours(store: Store) {
    // New York moves its clocks back on 7 November 2027.
    let new_york = Boundary::ahead("America/New_York", (2027, 11, 7));
    let sluice = new_york.sluice(store, DAYS, &[]).await;
    fill_before(&sluice, &new_york, "days", &[("zone", "new_york")], 2).await;
    new_york.pass().await;
    fresh_after(&sluice, "days", &[("zone", "new_york")], 2, 25 * HOUR).await;
}

const ANCHORED: &str = "\
domain: anchored
descriptors:
  - key: plan
    value: monthly
    rate_limit: {unit: month, requests_per_unit: 2, calendar: {anchor_day: 31}}
  - key: plan
    value: daily
    rate_limit: {unit: day, requests_per_unit: 2, calendar: true}
";

async fn on_29_february_a_month_anchored_on_the_31st_starts_and_lasts_until_31_march(store: Store) {
    // A month anchored on the 31st: 31 January to 29 February 2028 (February's last day stands
    // for its 31st), then to 31 March.
    let boundary = Boundary::ahead("UTC", (2028, 2, 29));
    let sluice = boundary.sluice(store, ANCHORED, &[]).await;
    fill_before(&sluice, &boundary, "anchored", &[("plan", "monthly")], 2).await;
    fill_before(&sluice, &boundary, "anchored", &[("plan", "daily")], 2).await;
    boundary.pass().await;
    fresh_after(&sluice, "anchored", &[("plan", "monthly")], 2, 31 * DAY).await;
    // 29 February 2028 is a day like any other.
    fresh_after(&sluice, "anchored", &[("plan", "daily")], 2, DAY).await;
}

const WEEKS: &str = "\
domain: weeks
descriptors:
  - key: from
    value: sunday
    rate_limit: {unit: week, requests_per_unit: 2, calendar: {week_starts: sunday}}
  - key: from
    value: monday
    rate_limit: {unit: week, requests_per_unit: 2, calendar: {week_starts: monday}}
";

async fn a_week_from_sunday_ends_on_sunday_and_one_from_monday_a_day_later(store: Store) {
    // 3 January 2027 is a Sunday.
    let boundary = Boundary::ahead("UTC", (2027, 1, 3));
    let sluice = boundary.sluice(store, WEEKS, &[]).await;
    fill_before(&sluice, &boundary, "weeks", &[("from", "sunday")], 2).await;
    for _ in 0..2 {
        sluice.ask(request("weeks", &[&[("from", "monday")]])).await;
    }
    boundary.still_ahead("filling the counters");
    boundary.pass().await;
    fresh_after(&sluice, "weeks", &[("from", "sunday")], 2, 7 * DAY).await;
    // The week from Monday is full until Monday.
    let (code, _, reset) = first(&sluice.ask(request("weeks", &[&[("from", "monday")]])).await);
    assert_eq!(code, OVER_LIMIT, "the week from Monday goes on");
    assert!(
        reset <= DAY && reset + LATE_S >= DAY,
        "until Monday: {reset} s"
    );
}

const SHARED: &str = "\
domain: shared
descriptors:
  - key: tenant
    rate_limit: {unit: day, requests_per_unit: 6, calendar: {time_zone: Asia/Kolkata}}
  - key: leased
    lease: auto
    rate_limit: {unit: day, requests_per_unit: 40, calendar: {time_zone: Asia/Kolkata}}
";

async fn two_replicas_cross_the_boundary_together_and_admit_the_limit_on_each_side(store: Store) {
    let boundary = Boundary::ahead("Asia/Kolkata", (2027, 6, 1));
    let prefix = format!("calendar-{}-{}:", std::process::id(), unix_ms());
    let flags = ["--redis-key-prefix", prefix.as_str()];
    let one = boundary.sluice(store, SHARED, &flags).await;
    let two = boundary.sluice(store, SHARED, &flags).await;
    let admitted = async |key: &str, requests: usize| {
        let mut admitted = 0;
        for n in 0..requests {
            let replica = if n % 2 == 0 { &one } else { &two };
            let answer = replica.ask(request("shared", &[&[(key, "t")]])).await;
            admitted += u32::from(answer.overall_code == OK);
        }
        admitted
    };
    assert_eq!(
        admitted("tenant", 10).await,
        6,
        "the day's limit, across both replicas"
    );
    // Leased blocks: never past the limit, and none spent past the window they were taken in.
    let leased = admitted("leased", 60).await;
    assert!(
        (1..=40).contains(&leased),
        "{leased} of 40 admitted from leased blocks"
    );
    boundary.still_ahead("filling the counters");
    boundary.pass().await;
    assert_eq!(
        admitted("tenant", 10).await,
        6,
        "the next day's, across both replicas"
    );
    let leased = admitted("leased", 60).await;
    assert!(
        (1..=40).contains(&leased),
        "{leased} of the next day's 40 admitted from blocks leased in it"
    );
}

/// A replica whose clock is more than a window from Redis' sends boundaries that do not hold
/// Redis' clock: its request is answered as one that cannot be read, and writes nothing.
#[tokio::test]
async fn a_replica_more_than_a_window_from_redis_clock_fails_its_request_and_writes_nothing() {
    use fred::prelude::*;
    let redis = support::redis::standalone();
    let client = Builder::from_config(Config::from_url(&redis.url).expect("a Redis URL"))
        .build()
        .expect("a client");
    client.init().await.expect("Redis answers");
    let key = format!("calendar-skew-{}", unix_ms());
    let day = 86_400_000;
    let yesterday = unix_ms() - 2 * day;
    let boundaries = format!(
        "{} {} {} {}",
        yesterday - 2 * day,
        yesterday - day,
        yesterday,
        yesterday + day / 2
    );
    let mut command: Vec<Value> = vec![CHECK.into(), 1.into(), key.clone().into()];
    for arg in [
        "0",
        "1",
        "0",
        "1",
        "c",
        "5",
        &boundaries,
        "1",
        "1",
        "0",
        "e",
        "0",
    ] {
        command.push(arg.into());
    }
    let reply: Vec<Value> = client
        .custom(
            fred::types::CustomCommand::new_static("EVAL", None, false),
            command,
        )
        .await
        .expect("the script runs");
    assert_eq!(
        reply[2..].iter().map(|v| v.as_string()).collect::<Vec<_>>(),
        [
            Some("-1".to_owned()),
            Some("1".to_owned()),
            Some("calendar".to_owned()),
            Some(String::new()),
        ]
    );
    let exists: i64 = client.exists(&key).await.expect("EXISTS");
    assert_eq!(exists, 0, "nothing written");
}

const CHECK: &str = include_str!("../../lua/check.lua");

/// The expiry instant of `key` (ms), asked of the nodes at `ports` (following a Cluster's
/// redirection).
fn pexpiretime(ports: &[u16], key: &str) -> i64 {
    let out = Command::new("redis-cli")
        .args(["-c", "-p", &ports[0].to_string(), "PEXPIRETIME", key])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("an expiry instant")
}

/// A replica whose clock reads two days ahead of Redis' (`--clock-skew-ms`, for tests): four
/// callers of a daily calendar rule and one of a plain rule, for 3 s. Every calendar request
/// fails (answered by `--on-store-error`, here `error`), and counts nothing against the
/// store's health: every plain request is decided, and Redis stays marked up. `/readyz` says
/// not ready, naming the skew, and the metric shows it; the replica whose clock agrees with
/// Redis' serves both.
#[tokio::test(flavor = "multi_thread")]
async fn a_skewed_replica_fails_only_its_calendar_requests_and_is_not_ready() {
    const RULES: &str = "\
domain: skew
descriptors:
  - key: cal
    rate_limit: {unit: day, requests_per_unit: 1000000, calendar: {time_zone: Europe/Berlin}}
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 1000000}
";
    let two_days = (2 * DAY * 1000).to_string();
    let skew = format!("--clock-skew-ms={two_days}");
    let skewed = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &[skew.as_str()]).await;
    let agreed = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &[]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let not_ready = loop {
        let (status, _, text) = support::http(skewed.http, "GET", "/readyz", "");
        if status == 503 {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/readyz still {status} after 10 s: {text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        not_ready.contains("172800.") && not_ready.contains("ahead of Redis' clock"),
        "{not_ready}"
    );
    let skew_metric = support::metrics::scrape(skewed.http)
        .get("sluice_clock_skew_seconds", &[])
        .expect("the skew is a metric");
    assert!((skew_metric + 172_800.0).abs() < 5.0, "{skew_metric}");

    let until = std::time::Instant::now() + Duration::from_secs(3);
    let calendar = |mut client: RateLimitServiceClient<Channel>| async move {
        let (mut failed, mut decided) = (0, 0);
        while std::time::Instant::now() < until {
            match client
                .should_rate_limit(request("skew", &[&[("cal", "c")]]))
                .await
            {
                Ok(_) => decided += 1,
                Err(_) => failed += 1,
            }
        }
        (failed, decided)
    };
    let plain = |mut client: RateLimitServiceClient<Channel>| async move {
        let (mut failed, mut decided) = (0, 0);
        while std::time::Instant::now() < until {
            match client
                .should_rate_limit(request("skew", &[&[("plain", "p")]]))
                .await
            {
                Ok(answer) if answer.get_ref().overall_code == OK => decided += 1,
                _ => failed += 1,
            }
        }
        (failed, decided)
    };
    let (c1, c2, c3, c4, p) = tokio::join!(
        calendar(skewed.client().await),
        calendar(skewed.client().await),
        calendar(skewed.client().await),
        calendar(skewed.client().await),
        plain(skewed.client().await)
    );
    let calendar_decided = c1.1 + c2.1 + c3.1 + c4.1;
    assert_eq!(calendar_decided, 0, "no calendar request is placed");
    assert!(c1.0 + c2.0 + c3.0 + c4.0 > 20, "the calendar callers ran");
    assert_eq!(p.0, 0, "every plain request decided ({} of them)", p.1);
    assert!(p.1 > 20, "the plain caller ran: {}", p.1);
    assert_eq!(
        support::metrics::scrape(skewed.http)
            .get("sluice_store_reachable", &[])
            .unwrap_or(0.0),
        1.0,
        "the calendar failures did not mark Redis down"
    );
    // The replica whose clock agrees serves both, and is ready.
    assert_eq!(support::http(agreed.http, "GET", "/readyz", "").0, 200);
    for entries in [[("cal", "c")], [("plain", "p")]] {
        let answer = agreed.ask(request("skew", &[&entries])).await;
        assert_eq!(answer.overall_code, OK, "{entries:?}");
    }
}
