//! When hits are charged: sluice's default all-or-nothing admission (`counting: admitted`) against
//! envoyproxy/ratelimit's counting (`counting: always`, per rule or `--counting always`), which
//! response-phase costs such as token budgets rely on; global quota mode (`--quota-mode`) and a
//! rule in both shadow and quota mode. Every test runs on the embedded store, a standalone Redis
//! and a Redis Cluster, with hour windows, in one window each (`support::in_one_window`).

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use support::{OK, OVER_LIMIT, Sluice, Store, request};

on_every_store!(
    the_token_quota_scenario_allows_three_then_denies_when_charged_after_the_response,
    the_same_scenario_with_the_global_flag,
    admitted_counting_stops_the_third_request_of_the_same_scenario,
    a_charge_past_the_budget_lands_and_the_next_check_is_over,
    a_rule_counting_admitted_keeps_all_or_nothing_under_the_global_flag,
    a_denied_request_still_charges_the_descriptors_counted_always,
    global_quota_mode_denies_only_when_every_descriptor_is_over,
    a_rule_in_shadow_and_quota_mode_is_reported_ok_and_keeps_quotas_from_denying,
);

/// envoyproxy/ratelimit's `token-quota` integration scenario: `service_2` has 2 per minute (an
/// hour here, so that a window seldom ends during a test), in quota mode; Envoy checks it with
/// `hits_addend: 0` when the request comes and charges 1 when the response is done.
const TOKEN_QUOTA: &str = r#"
domain: rl
descriptors:
  - key: service
    value: service_2
    quota_mode: true
    counting: always
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: tokens
    counting: always
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: strict
    counting: admitted
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: free
    rate_limit: {unit: hour, requests_per_unit: 0}
"#;

/// The same rules without `counting`: the service's default decides.
const UNSAID: &str = r#"
domain: rl
descriptors:
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;

/// One descriptor `key: value` consuming `hits` (0: check only).
fn costing(key: &str, value: &str, hits: u64) -> RateLimitRequest {
    let mut r = request("rl", &[&[(key, value)]]);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    r
}

/// Envoy's two calls for one HTTP request: the check, then (its answer ignored) the charge.
async fn through(sluice: &Sluice, key: &str, value: &str, cost: u64) -> i32 {
    let code = sluice.ask(costing(key, value, 0)).await.overall_code;
    if code == OK {
        sluice.ask(costing(key, value, cost)).await;
    }
    code
}

async fn the_token_quota_scenario_allows_three_then_denies_when_charged_after_the_response(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rl.yaml", TOKEN_QUOTA)], &[]).await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(through(&sluice, "service", "service_2", 1).await);
    }
    assert_eq!(codes, [OK, OK, OK, OVER_LIMIT]);
}

async fn the_same_scenario_with_the_global_flag(store: Store) {
    let sluice = Sluice::on(store, &[("rl.yaml", UNSAID)], &["--counting", "always"]).await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(through(&sluice, "service", "service_2", 1).await);
    }
    assert_eq!(codes, [OK, OK, OK, OVER_LIMIT]);
}

async fn admitted_counting_stops_the_third_request_of_the_same_scenario(store: Store) {
    let sluice = Sluice::on(store, &[("rl.yaml", UNSAID)], &[]).await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(through(&sluice, "service", "service_2", 1).await);
    }
    assert_eq!(
        codes,
        [OK, OK, OVER_LIMIT],
        "a check-only request is over when not one more hit fits"
    );
}

async fn a_charge_past_the_budget_lands_and_the_next_check_is_over(store: Store) {
    let sluice = Sluice::on(store, &[("rl.yaml", TOKEN_QUOTA)], &[]).await;
    let spent = sluice.ask(costing("tokens", "alice", 990)).await;
    assert_eq!(spent.overall_code, OK);
    assert_eq!(spent.statuses[0].limit_remaining, 10);
    assert_eq!(
        through(&sluice, "tokens", "alice", 500).await,
        OK,
        "10 tokens left: the request goes through"
    );
    let after = sluice.ask(costing("tokens", "alice", 0)).await;
    assert_eq!(
        (after.overall_code, after.statuses[0].limit_remaining),
        (OVER_LIMIT, 0),
        "the 500 tokens were charged, past the budget"
    );
    let over = sluice.ask(costing("tokens", "alice", 1)).await;
    assert_eq!(over.overall_code, OVER_LIMIT);
    let other = sluice.ask(costing("tokens", "bob", 0)).await;
    assert_eq!(
        other.statuses[0].limit_remaining, 1000,
        "bob's budget is his own"
    );
}

async fn a_rule_counting_admitted_keeps_all_or_nothing_under_the_global_flag(store: Store) {
    let sluice = Sluice::on(
        store,
        &[("rl.yaml", TOKEN_QUOTA)],
        &["--counting", "always"],
    )
    .await;
    assert_eq!(sluice.ask(costing("strict", "s", 2)).await.overall_code, OK);
    let denied = sluice.ask(costing("strict", "s", 1)).await;
    assert_eq!(denied.overall_code, OVER_LIMIT);
    let check = sluice.ask(costing("strict", "s", 0)).await;
    assert_eq!(
        check.overall_code, OVER_LIMIT,
        "full: not one more fits, and the denied hit was not charged"
    );
    let mut refund = costing("strict", "s", 1);
    refund.descriptors[0].is_negative_hits = true;
    sluice.ask(refund).await;
    assert_eq!(
        sluice.ask(costing("strict", "s", 1)).await.overall_code,
        OK,
        "one given back is one that fits: nothing else was charged"
    );
}

async fn a_denied_request_still_charges_the_descriptors_counted_always(store: Store) {
    let sluice = Sluice::on(store, &[("rl.yaml", TOKEN_QUOTA)], &[]).await;
    let mut both = request("rl", &[&[("tokens", "carol")], &[("free", "x")]]);
    both.hits_addend = 7;
    let r = sluice.ask(both).await;
    assert_eq!(r.overall_code, OVER_LIMIT, "the free tier allows nothing");
    assert_eq!(
        (r.statuses[0].code, r.statuses[0].limit_remaining),
        (OK, 993),
        "the status reports the budget after the charge that landed"
    );
    let after: RateLimitResponse = sluice.ask(costing("tokens", "carol", 0)).await;
    assert_eq!(
        after.statuses[0].limit_remaining, 993,
        "the tokens were charged although the request was denied"
    );
}

const QUOTAS: &str = r#"
domain: q
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: soft
    shadow_mode: true
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: hard
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

async fn global_quota_mode_denies_only_when_every_descriptor_is_over(store: Store) {
    let sluice = Sluice::on(store, &[("q.yaml", QUOTAS)], &["--quota-mode"]).await;
    let pair = || request("q", &[&[("a", "1")], &[("b", "1")]]);
    assert_eq!(sluice.ask(pair()).await.overall_code, OK);
    let one_over = sluice.ask(pair()).await;
    assert_eq!(
        (
            one_over.overall_code,
            one_over.statuses[0].code,
            one_over.statuses[1].code
        ),
        (OK, OVER_LIMIT, OK),
        "a over, b not: still OK"
    );
    let with_unknown = sluice
        .ask(request(
            "q",
            &[&[("a", "1")], &[("b", "1")], &[("nobody", "x")]],
        ))
        .await;
    assert_eq!(
        with_unknown.overall_code, OK,
        "a descriptor without a limit counts as a quota within its limit"
    );
    let both_over = sluice.ask(pair()).await;
    assert_eq!(both_over.overall_code, OVER_LIMIT, "a and b both over");
}

async fn a_rule_in_shadow_and_quota_mode_is_reported_ok_and_keeps_quotas_from_denying(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("q.yaml", QUOTAS)], &[]).await;
    let both = || request("q", &[&[("hard", "1")], &[("soft", "1")]]);
    assert_eq!(sluice.ask(both()).await.overall_code, OK);
    let over = sluice.ask(both()).await;
    assert_eq!(
        (
            over.overall_code,
            over.statuses[0].code,
            over.statuses[1].code
        ),
        (OK, OVER_LIMIT, OK),
        "both over, but the shadow quota is reported OK and counts as one that passed"
    );
    let hard_alone = sluice.ask(request("q", &[&[("hard", "1")]])).await;
    assert_eq!(hard_alone.overall_code, OVER_LIMIT);
}
