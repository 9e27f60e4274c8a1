//! Holds (`hold:`), as Envoy asks for them: the request-time call of a request (its
//! `request_id` entry, no hits of its own) holds the rule's estimate, the response-time call of
//! the same request settles the hold at the real cost, a third call charges nothing; a hold
//! unsettled past its time to live is released (nothing charged) and a settle after that is
//! charged in full; holds live in the store, so a replica killed while its requests hold loses
//! none, and another replica settles them; a Redis restarted empty loses the holds with the
//! counts, and the budget starts over, never past its limit. Every store, where the store
//! matters.

use super::common;

use std::time::Duration;

use common::metrics::scrape;
use common::redis::Controlled;
use common::{OVER_LIMIT, Sluice, Store, in_one_window, request, unix_ms};
use envoy_types::pb::google::protobuf::UInt64Value;

/// A budget of 10,000 an hour; a request holds 1,000 until it settles, for at most 4 s.
const RULES: &str = "\
domain: llm
descriptors:
  - key: user
    descriptors:
      - key: request_id
        hold: {estimate: 1000, ttl: 4s, most: 12}
        rate_limit: {unit: hour, requests_per_unit: 10000}
";
const TTL: Duration = Duration::from_secs(4);

on_every_store!(
    a_hold_settles_at_its_real_cost_and_a_second_settle_charges_nothing,
    an_expired_hold_is_released_within_its_bound_and_its_late_settle_charged_in_full,
    a_full_table_of_holds_refuses_a_new_hold_and_takes_settles,
);

/// A user no other test names.
fn user() -> String {
    format!("u{}", unix_ms())
}

/// One call for `user`'s request `id` with `hits`: whether it was denied, and what remains.
async fn ask(sluice: &Sluice, user: &str, id: &str, hits: u64) -> (bool, u32) {
    let mut call = request("llm", &[&[("user", user), ("request_id", id)]]);
    call.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    let answer = sluice.ask(call).await;
    (
        answer.overall_code == OVER_LIMIT,
        answer.statuses[0].limit_remaining,
    )
}

/// Calls on held counters that did `outcome`, and holds found expired, so far.
fn holds(sluice: &Sluice, outcome: &str) -> f64 {
    let metrics = scrape(sluice.http);
    let rule = [("domain", "llm"), ("rule", "user.request_id")];
    if outcome == "expired" {
        return metrics
            .get("sluice_holds_expired_total", &rule)
            .unwrap_or(0.0);
    }
    metrics
        .get(
            "sluice_holds_total",
            &[rule[0], rule[1], ("outcome", outcome)],
        )
        .unwrap_or(0.0)
}

async fn a_hold_settles_at_its_real_cost_and_a_second_settle_charges_nothing(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = user();
    assert_eq!(ask(&sluice, &user, "a", 0).await, (false, 9_000), "a holds");
    assert_eq!(ask(&sluice, &user, "b", 0).await, (false, 8_000), "b holds");
    assert_eq!(
        ask(&sluice, &user, "a", 300).await,
        (false, 8_700),
        "a settles at 300: its hold is released"
    );
    assert_eq!(
        ask(&sluice, &user, "a", 300).await,
        (false, 8_700),
        "a second settle charges nothing"
    );
    assert_eq!(
        ask(&sluice, &user, "b", 1_500).await,
        (false, 8_200),
        "b costs more than its estimate: charged in full"
    );
    assert_eq!(holds(&sluice, "held"), 2.0);
    assert_eq!(holds(&sluice, "settle"), 2.0);
    assert_eq!(holds(&sluice, "duplicate"), 1.0);
    // Eight more estimates do not fit on 1,800 spent.
    for i in 0..8 {
        assert!(!ask(&sluice, &user, &format!("n{i}"), 0).await.0);
    }
    assert_eq!(
        ask(&sluice, &user, "late", 0).await,
        (true, 0),
        "1,800 spent and 8,000 held: no room for 1,000 more"
    );
    assert_eq!(holds(&sluice, "denied"), 1.0);
}

async fn an_expired_hold_is_released_within_its_bound_and_its_late_settle_charged_in_full(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = user();
    assert_eq!(ask(&sluice, &user, "a", 0).await, (false, 9_000));
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(
        ask(&sluice, &user, "b", 0).await,
        (false, 8_000),
        "a still holds within its time to live"
    );
    tokio::time::sleep(TTL / 2 + Duration::from_millis(500)).await;
    assert_eq!(
        ask(&sluice, &user, "c", 0).await,
        (false, 8_000),
        "a's hold expired: released, nothing charged (b and c hold)"
    );
    assert_eq!(holds(&sluice, "expired"), 1.0);
    assert_eq!(
        ask(&sluice, &user, "a", 300).await,
        (false, 7_700),
        "a settles after its hold expired: charged in full"
    );
    assert_eq!(holds(&sluice, "unheld"), 1.0);
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    assert_eq!(
        ask(&sluice, &user, "d", 0).await,
        (false, 8_700),
        "b and c expired too: 300 spent, d holds"
    );
}

async fn a_full_table_of_holds_refuses_a_new_hold_and_takes_settles(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = user();
    for i in 0..12 {
        assert!(!ask(&sluice, &user, &format!("r{i}"), 2).await.0);
    }
    assert!(
        ask(&sluice, &user, "next", 0).await.0,
        "12 holds is the rule's most: the next is over"
    );
    assert_eq!(holds(&sluice, "full"), 1.0);
    assert_eq!(
        ask(&sluice, &user, "r0", 5).await,
        (false, 10_000 - 5 - 11 * 2),
        "a settle still lands on a full table"
    );
}

/// Holds are in Redis: replica A takes five and is killed; replica B counts them, settles them
/// at their real cost, and the budget ends holding exactly what was spent.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_killed_holding_holds_loses_none_and_another_settles_them() {
    in_one_window(common::HOUR, async || {
        let prefix = format!("holds{}-killed:", std::process::id());
        let flags = ["--redis-key-prefix", prefix.as_str()];
        let mut a = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &flags).await;
        let b = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &flags).await;
        let user = user();
        for i in 0..5 {
            assert!(!ask(&a, &user, &format!("r{i}"), 0).await.0);
        }
        a.kill();
        assert_eq!(
            ask(&b, &user, "new", 0).await,
            (false, 4_000),
            "the other replica counts the dead one's holds"
        );
        for i in 0..5 {
            assert!(!ask(&b, &user, &format!("r{i}"), 300).await.0);
        }
        assert_eq!(
            ask(&b, &user, "new", 200).await,
            (false, 10_000 - 5 * 300 - 200),
            "settled by the other replica: the budget holds exactly what was spent"
        );
        assert_eq!(holds(&b, "settle"), 6.0);
    })
    .await;
}

/// A Redis restarted empty loses the holds with the counts: the budget starts over, and the
/// settle of a request held before the restart holds (its id is new to the store) until it
/// expires, charging nothing; nothing ever passes the limit.
#[tokio::test(flavor = "multi_thread")]
async fn a_redis_restarted_empty_starts_the_budget_over_and_never_passes_it() {
    in_one_window(common::HOUR, async || {
        let mut redis = Controlled::started();
        let flags = ["--redis-url", redis.url.as_str(), "--store-timeout", "1s"];
        let sluice = Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &flags).await;
        let user = user();
        for i in 0..5 {
            assert!(!ask(&sluice, &user, &format!("r{i}"), 0).await.0);
        }
        redis.kill();
        redis.start();
        // A call fails until its connection has seen the new Redis: wait until 32 in a row, 8
        // at a time, are decided, for a user of their own (the answers, each a hold, do not
        // matter).
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let mut in_a_row = 0;
        while in_a_row < 32 {
            let probes = (0..8).map(|i| {
                let sluice = &sluice;
                async move {
                    let id = format!("p{in_a_row}-{i}");
                    let probe = request("llm", &[&[("user", "probe"), ("request_id", &id)]]);
                    sluice.client().await.should_rate_limit(probe).await.is_ok()
                }
            });
            if futures_util::future::join_all(probes)
                .await
                .iter()
                .all(|ok| *ok)
            {
                in_a_row += 8;
            } else {
                in_a_row = 0;
                assert!(
                    std::time::Instant::now() < deadline,
                    "sluice reaches the new Redis"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        assert_eq!(
            ask(&sluice, &user, "r0", 300).await,
            (false, 10_000 - 300),
            "r0's hold is gone with the counts: its settle holds its cost"
        );
        let mut admitted = 0;
        for i in 0..12 {
            if !ask(&sluice, &user, &format!("after{i}"), 0).await.0 {
                admitted += 1;
            }
        }
        assert_eq!(
            admitted, 9,
            "the budget starts over, and holds 10,000 at most"
        );
        tokio::time::sleep(TTL + Duration::from_millis(200)).await;
        assert_eq!(
            ask(&sluice, &user, "last", 0).await,
            (false, 9_000),
            "every hold expired, released: nothing was charged"
        );
    })
    .await;
}

/// `/explain` shows the rule's hold, and one counter for every request of a user: the request
/// id is left out of it.
#[tokio::test(flavor = "multi_thread")]
async fn explain_shows_the_hold_and_one_counter_for_every_request_of_a_user() {
    let sluice = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &[]).await;
    let explain = |id: &str| {
        let body = serde_json::json!({"domain": "llm", "descriptors": [{"entries": [
            {"key": "user", "value": "ann"}, {"key": "request_id", "value": id}]}]});
        let (status, _, text) = common::http(sluice.http, "POST", "/explain", &body.to_string());
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<serde_json::Value>(&text).expect("JSON")["descriptors"][0].clone()
    };
    let (a, b) = (explain("a"), explain("b"));
    assert_eq!(
        a["rule"]["modes"]["hold"],
        serde_json::json!({"estimate": 1000, "ttl": "4s", "on_expiry": "release", "most": 12, "largest": "100%"})
    );
    let key = |d: &serde_json::Value| d["counters"][0]["redis_key"].as_str().map(str::to_owned);
    assert!(key(&a).is_some(), "{a}");
    assert_eq!(key(&a), key(&b), "one counter for both requests");
}
