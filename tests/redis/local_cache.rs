//! The local over-limit cache, on Redis: a counter full in a window is denied from the cache
//! without a script call; without the cache every denied request calls the script; shadow mode
//! and refunds still reach the store.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
use support::metrics::scrape;
use support::redis::evalsha_calls;
use support::{HOUR, OK, OVER_LIMIT, Sluice, in_one_window, request};

use super::operate::limit_of;

/// What is left of the current hour by the wall clock.
fn left_of_hour() -> Duration {
    let hour = HOUR.as_millis() as u64;
    Duration::from_millis(hour - support::unix_ms() % hour)
}

fn reset_of(s: &DescriptorStatus) -> Duration {
    let d = s.duration_until_reset.expect("a duration until reset");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

const HOT: &str = "domain: hot
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: probe
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
";

/// A sluice on a Redis of the test's own (whose statistics no other test moves).
async fn on_own_redis(flags: &[&str]) -> (Sluice, support::redis::Redis) {
    let own = support::redis::dedicated();
    let sluice = Sluice::on_own_redis(&own, &[("rules.yaml", HOT)], flags).await;
    (sluice, own)
}

/// 3 of 3 admitted, the third filling the counter; then 50 requests are denied from the local
/// cache without one more script call, each with nothing remaining and a duration until reset
/// (whole seconds) that never grows and never passes the window's end. A request whose other descriptor is
/// fresh is denied too, without evaluating (or consuming) that one.
#[tokio::test(flavor = "multi_thread")]
async fn on_redis_a_full_counter_is_denied_from_the_local_cache_without_script_calls() {
    in_one_window(HOUR, async || {
        let (sluice, own) = on_own_redis(&[]).await;
        let u = || request("hot", &[&[("user", "u")]]);
        let before = evalsha_calls(&own.ports);
        for remaining in [2, 1, 0] {
            let r = sluice.ask(u()).await;
            assert_eq!(
                (r.overall_code, r.statuses[0].limit_remaining),
                (OK, remaining)
            );
        }
        assert_eq!(
            evalsha_calls(&own.ports) - before,
            3,
            "one call per request"
        );

        let before = evalsha_calls(&own.ports);
        let mut resets = Vec::new();
        for n in 0..50 {
            let left = left_of_hour();
            let r = sluice.ask(u()).await;
            let s = &r.statuses[0];
            assert_eq!(
                (r.overall_code, s.code),
                (OVER_LIMIT, OVER_LIMIT),
                "request {n}"
            );
            assert_eq!((s.limit_remaining, limit_of(s)), (0, 3), "request {n}");
            let reset = reset_of(s);
            let whole_left = Duration::from_secs(
                (left + Duration::from_millis(5)).as_millis().div_ceil(1000) as u64,
            );
            assert!(
                reset >= Duration::from_secs(1) && reset <= whole_left,
                "request {n}: reset in {reset:?}, but the window ends in {left:?}"
            );
            if let Some(last) = resets.last() {
                assert!(reset <= *last, "request {n}: {reset:?} after {last:?}");
            }
            resets.push(reset);
        }

        let both = sluice
            .ask(request("hot", &[&[("user", "u")], &[("user", "fresh")]]))
            .await;
        assert_eq!(both.overall_code, OVER_LIMIT);
        assert_eq!(both.statuses[0].code, OVER_LIMIT);
        assert_eq!(
            (
                both.statuses[1].code,
                both.statuses[1].current_limit.clone()
            ),
            (OK, None),
            "the fresh descriptor was not evaluated"
        );
        assert_eq!(
            evalsha_calls(&own.ports) - before,
            0,
            "no script call for 51 denied requests"
        );
        let fresh = sluice.ask(request("hot", &[&[("user", "fresh")]])).await;
        assert_eq!(
            (fresh.overall_code, fresh.statuses[0].limit_remaining),
            (OK, 2),
            "the denied request consumed nothing of user=fresh"
        );

        let m = scrape(sluice.http);
        let user = [("domain", "hot"), ("descriptor", "user")];
        assert_eq!(
            m.value("sluice_rule_over_limit_with_local_cache_total", &user),
            51.0
        );
        assert_eq!(m.value("sluice_rule_over_limit_total", &user), 51.0);
        assert_eq!(m.value("sluice_rule_within_limit_total", &user), 4.0);
        assert_eq!(m.value("sluice_rule_hits_total", &user), 55.0);
        assert_eq!(m.value("sluice_local_cache_entries", &[]), 1.0);
        assert_eq!(m.value("sluice_store_breakers_open", &[]), 0.0);
    })
    .await;
}

/// With `--local-cache-size 0` every request, denied or not, is one script call.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_local_cache_every_denied_request_calls_the_script() {
    in_one_window(HOUR, async || {
        let (sluice, own) = on_own_redis(&["--local-cache-size", "0"]).await;
        let u = || request("hot", &[&[("user", "u")]]);
        for _ in 0..3 {
            assert_eq!(sluice.ask(u()).await.overall_code, OK);
        }
        let before = evalsha_calls(&own.ports);
        for _ in 0..10 {
            assert_eq!(sluice.ask(u()).await.overall_code, OVER_LIMIT);
        }
        assert_eq!(evalsha_calls(&own.ports) - before, 10);
        let m = scrape(sluice.http);
        let user = [("domain", "hot"), ("descriptor", "user")];
        assert_eq!(m.value("sluice_rule_over_limit_total", &user), 10.0);
        assert_eq!(
            m.value("sluice_rule_over_limit_with_local_cache_total", &user),
            0.0
        );
        assert_eq!(
            m.get("sluice_local_cache_entries", &[]).unwrap_or(0.0),
            0.0,
            "the cache is off"
        );
    })
    .await;
}

/// A shadow-mode rule over its limit is never answered from the cache: every request still
/// calls the script (and is counted) and is answered OK.
#[tokio::test(flavor = "multi_thread")]
async fn a_shadow_mode_rule_over_its_limit_keeps_calling_the_store_and_answers_ok() {
    in_one_window(HOUR, async || {
        let (sluice, own) = on_own_redis(&[]).await;
        let before = evalsha_calls(&own.ports);
        for n in 0..6 {
            let r = sluice.ask(request("hot", &[&[("probe", "p")]])).await;
            assert_eq!(
                (r.overall_code, r.statuses[0].code),
                (OK, OK),
                "request {n}"
            );
            assert_eq!(limit_of(&r.statuses[0]), 1);
        }
        assert_eq!(evalsha_calls(&own.ports) - before, 6);
        let m = scrape(sluice.http);
        let probe = [("domain", "hot"), ("descriptor", "probe")];
        assert_eq!(m.value("sluice_rule_shadow_mode_total", &probe), 5.0);
        assert_eq!(m.value("sluice_rule_over_limit_total", &probe), 5.0);
        assert_eq!(
            m.value("sluice_rule_over_limit_with_local_cache_total", &probe),
            0.0
        );
        assert_eq!(m.value("sluice_local_cache_entries", &[]), 0.0);
    })
    .await;
}

/// A refund (`is_negative_hits`) of a full counter is never answered from the cache: it reaches
/// the store, and the hit it gives back admits the next request.
#[tokio::test(flavor = "multi_thread")]
async fn a_refund_of_a_full_counter_reaches_the_store_and_frees_a_hit() {
    in_one_window(HOUR, async || {
        let (sluice, own) = on_own_redis(&[]).await;
        let u = || request("hot", &[&[("user", "u")]]);
        for _ in 0..3 {
            assert_eq!(sluice.ask(u()).await.overall_code, OK);
        }
        assert_eq!(sluice.ask(u()).await.overall_code, OVER_LIMIT);
        let before = evalsha_calls(&own.ports);
        let mut refund = u();
        refund.descriptors[0].is_negative_hits = true;
        sluice.ask(refund).await;
        assert_eq!(
            evalsha_calls(&own.ports) - before,
            1,
            "the refund reached Redis"
        );
        let r = sluice.ask(u()).await;
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (OK, 0),
            "the hit given back is taken again"
        );
        assert_eq!(sluice.ask(u()).await.overall_code, OVER_LIMIT);
    })
    .await;
}
