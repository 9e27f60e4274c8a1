//! Holds (`hold:`), as Envoy asks for them: the request-time call of a request (its
//! `request_id` entry, no hits of its own) holds the rule's estimate, at least, whatever smaller
//! cost it brings; the response-time call (the only one carrying the rule's settle entry,
//! `phase=response`) settles the hold at the real cost, weighed by the request's model and kind
//! of token (input and output settled by one call settle once), and a settle that finds no hold
//! is charged in full. A request-time call naming an id its counter
//! knows (held, settled, lapsed) is refused and charges nothing: a client reusing one id for
//! every request, or overlapping two requests under one, gets one request admitted per id, each
//! charged. A request that never settles is charged its estimate once its hold expires (or
//! nothing, with `on_expiry: release`). A table keeps `most` entries: settled requests' marks go,
//! oldest first, to make room, and only holds in flight fill it, refused with what the counter
//! really has left and when the next hold is due; a request refused for the holds in flight is
//! told to retry when the next hold is due, not at the window's end; on the embedded store one
//! user's holds never refuse another's. `/counters` shows what a held counter used (past its
//! limit too), held and how many holds; a reset frees the user and drops the holds. Holds live
//! in the store, so a replica killed while its requests hold loses none, and another replica
//! settles them; a Redis restarted empty loses the holds with the counts, a settle after it is
//! charged in full, and the budget starts over, never past its limit. `/explain` and
//! `sluice explain` show the hold of a rule and what a call holds or settles. Every store,
//! where the store matters.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::UInt64Value;
use serde_json::{Value, json};
use support::metrics::scrape;
use support::redis::Controlled;
use support::{HOUR, OVER_LIMIT, Sluice, Store, decide, in_one_window, request, unix_ms};
use tonic::transport::Channel;

/// Budgets of 10,000 an hour; each rule's request holds its estimate until it settles:
/// - `user`: 1,000 for at most 8 s, a big model's tokens 10 times a small one's, an output
///   token 4 times an input one;
/// - `quick` and `free`: 1,000 for at most 2 s, charged or released when a hold expires;
/// - `tenant`: 10 for at most 30 s (longer than any test), 50 entries at most;
/// - `team`: 10 for at most 30 s, 1,000 entries at most.
const RULES: &str = "\
domain: llm
descriptors:
  - key: user
    descriptors:
      - key: request_id
        hold: {estimate: 1000, settle: {key: phase, value: response}, ttl: 8s}
        weights:
          - key: model
            values: {big: 10, small: 1}
          - key: kind
            values: {input: 1, output: 4}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: quick
    descriptors:
      - key: request_id
        hold: {estimate: 1000, settle: {key: phase, value: response}, ttl: 2s}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: free
    descriptors:
      - key: request_id
        hold: {estimate: 1000, settle: {key: phase, value: response}, ttl: 2s, on_expiry: release}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: tenant
    descriptors:
      - key: request_id
        hold: {estimate: 10, settle: {key: phase, value: response}, ttl: 30s, most: 50}
        rate_limit: {unit: hour, requests_per_unit: 10000}
  - key: team
    descriptors:
      - key: request_id
        hold: {estimate: 10, settle: {key: phase, value: response}, ttl: 30s, most: 1000}
        rate_limit: {unit: hour, requests_per_unit: 10000}
";
/// The time to live of `user`'s holds, and of `quick`'s and `free`'s.
const TTL: Duration = Duration::from_secs(8);
const SHORT_TTL: Duration = Duration::from_secs(2);
/// The settle entry, which only the response-time call carries.
const RESPONSE: (&str, &str) = ("phase", "response");

on_every_store!(
    a_hold_settles_at_its_real_cost_and_an_id_the_counter_knows_is_never_held_again,
    a_client_reusing_one_request_id_gets_one_request_admitted_per_id_each_charged,
    request_time_costs_below_the_estimate_hold_the_estimate,
    a_request_that_never_settles_is_charged_its_estimate_when_its_hold_expires,
    with_on_expiry_release_a_request_that_never_settles_is_charged_nothing,
    a_hold_never_settled_is_charged_however_long_its_user_stays_away,
    marks_make_room_oldest_first_and_a_table_full_of_holds_says_what_is_left_and_when,
    a_request_refused_for_the_holds_in_flight_retries_when_the_next_hold_is_due,
    counters_shows_used_past_the_limit_held_and_holds_and_a_reset_drops_the_holds,
    a_weighted_settle_charges_its_models_tokens_from_one_budget,
);

/// The calls Envoy makes for the requests of one user of the rule of `key` (the descriptor's
/// first entry): a request-time call per request, and a response-time call, with the settle
/// entry, when its response is done.
struct User<'a> {
    sluice: &'a Sluice,
    key: &'static str,
    value: String,
    channel: Channel,
}

/// What a call was answered.
#[derive(Debug)]
struct Answer {
    over: bool,
    remaining: u32,
    reset: Duration,
}

impl<'a> User<'a> {
    /// A user of `key` that no other test names.
    async fn new(sluice: &'a Sluice, key: &'static str) -> User<'a> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        User {
            sluice,
            key,
            value: format!("u{}-{n}", unix_ms()),
            channel: sluice.channel().await,
        }
    }

    /// A call for request `id` with `hits`, the descriptor's entries `after` the request id's.
    async fn call(&self, id: &str, hits: u64, after: &[(&str, &str)]) -> Answer {
        let mut entries = vec![(self.key, self.value.as_str()), ("request_id", id)];
        entries.extend_from_slice(after);
        let mut call = request("llm", &[&entries]);
        call.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
        let answer = decide(&mut RateLimitServiceClient::new(self.channel.clone()), call).await;
        let status = &answer.statuses[0];
        let reset = status.duration_until_reset.expect("a reset");
        Answer {
            over: answer.overall_code == OVER_LIMIT,
            remaining: status.limit_remaining,
            reset: Duration::new(reset.seconds as u64, reset.nanos as u32),
        }
    }

    /// The request-time call of request `id`, as Envoy sends it (`hits_addend: 0`): refused or
    /// not, and what remains.
    async fn hold(&self, id: &str) -> (bool, u32) {
        let a = self.call(id, 0, &[]).await;
        (a.over, a.remaining)
    }

    /// The response-time call of request `id`, its response done at `cost`.
    async fn settle(&self, id: &str, cost: u64) -> (bool, u32) {
        let a = self.call(id, cost, &[RESPONSE]).await;
        (a.over, a.remaining)
    }

    /// `POST /counters` on the user's counter, asking `action`: its line.
    fn counters(&self, action: &str, apply: bool) -> Value {
        let body = json!({
            "domain": "llm",
            "descriptors": [{"entries": [
                {"key": self.key, "value": self.value}, {"key": "request_id", "value": "-"}]}],
            "action": action,
            "apply": apply,
            "by": "holds-test",
        });
        let (status, _, text) =
            support::http(self.sluice.http, "POST", "/counters", &body.to_string());
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("JSON");
        answer["counters"][0].clone()
    }

    /// What the user's counter holds now, as `/counters` shows it: used, held, holds, remaining.
    fn shown(&self) -> (u64, u64, u64, u64) {
        numbers(&self.counters("show", false)["before"])
    }
}

/// A `/counters` line's `before` or `after`: used, held, holds, remaining.
fn numbers(held: &Value) -> (u64, u64, u64, u64) {
    let n = |name: &str| {
        held[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {held}"))
    };
    (n("used"), n("held"), n("holds"), n("remaining"))
}

/// Calls on the held counters of the rule of `key` that did `outcome` (`expired`: holds found
/// expired), so far.
fn holds(sluice: &Sluice, key: &str, outcome: &str) -> f64 {
    let metrics = scrape(sluice.http);
    let rule = format!("{key}.request_id");
    let labels = [("domain", "llm"), ("rule", rule.as_str())];
    if outcome == "expired" {
        return metrics
            .get("sluice_holds_expired_total", &labels)
            .unwrap_or(0.0);
    }
    metrics
        .get(
            "sluice_holds_total",
            &[labels[0], labels[1], ("outcome", outcome)],
        )
        .unwrap_or(0.0)
}

async fn a_hold_settles_at_its_real_cost_and_an_id_the_counter_knows_is_never_held_again(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, "user").await;
    assert_eq!(user.hold("a").await, (false, 9_000), "a holds");
    assert_eq!(user.hold("b").await, (false, 8_000), "b holds");
    assert_eq!(
        user.settle("a", 300).await,
        (false, 8_700),
        "a settles at 300: its hold is released"
    );
    assert_eq!(
        user.settle("a", 300).await,
        (false, 8_400),
        "a second settle finds no hold: charged in full"
    );
    assert_eq!(
        user.hold("a").await,
        (true, 8_400),
        "a request-time call reusing a settled id is refused, charges nothing, says what is left"
    );
    assert_eq!(
        user.hold("b").await,
        (true, 8_400),
        "a request-time call reusing a held id is refused"
    );
    assert_eq!(
        user.settle("b", 1_500).await,
        (false, 7_900),
        "b costs more than its estimate: charged in full, its hold released"
    );
    assert_eq!(
        user.hold("c").await,
        (false, 6_900),
        "the refusals charged nothing"
    );
    for (outcome, n) in [
        ("held", 3.0),
        ("settle", 2.0),
        ("unheld", 1.0),
        ("reused", 2.0),
    ] {
        assert_eq!(holds(&sluice, "user", outcome), n, "{outcome}");
    }
    assert_eq!(user.shown(), (2_100, 1_000, 1, 6_900));
}

/// Before, a client naming one id for every request had all 20 admitted; and overlapping requests
/// under one id, the second settling the first's hold, ran free.
async fn a_client_reusing_one_request_id_gets_one_request_admitted_per_id_each_charged(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, "user").await;
    let mut admitted = 0;
    for _ in 0..20 {
        let (over, _) = user.hold("same").await;
        // A refused request reaches no model: its response brings no cost.
        let cost = if over { 0 } else { 1_000 };
        assert!(
            !user.settle("same", cost).await.0,
            "a settle is never refused"
        );
        admitted += usize::from(!over);
    }
    assert_eq!(admitted, 1, "one id, one request admitted");
    assert_eq!(
        user.shown(),
        (1_000, 0, 0, 9_000),
        "the one admitted is charged its 1,000"
    );
    // Overlapping pairs under one fresh id each, the second's response first in every other.
    let user = User::new(&sluice, "user").await;
    for pair in 0..4 {
        let id = format!("pair{pair}");
        assert!(
            !user.hold(&id).await.0,
            "pair {pair}: the first is admitted"
        );
        assert!(
            user.hold(&id).await.0,
            "pair {pair}: the second, under the first's id, is refused"
        );
        let (first, second) = ((id.as_str(), 1_000), (id.as_str(), 0));
        let order = if pair % 2 == 0 {
            [first, second]
        } else {
            [second, first]
        };
        for (id, cost) in order {
            assert!(!user.settle(id, cost).await.0);
        }
    }
    assert_eq!(
        user.shown(),
        (4_000, 0, 0, 6_000),
        "every request admitted is charged its cost"
    );
}

/// Before, a request-time cost of 2 held 2: all 40 racing requests were admitted.
async fn request_time_costs_below_the_estimate_hold_the_estimate(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, "user").await;
    let racer = &user;
    let answers = futures_util::future::join_all(
        (0..40).map(|i| async move { racer.call(&format!("r{i}"), 2, &[]).await.over }),
    )
    .await;
    let admitted = answers.iter().filter(|over| !**over).count();
    assert_eq!(
        admitted, 10,
        "10,000 holds ten estimates of 1,000, whatever smaller cost a request brings"
    );
    assert_eq!(user.shown(), (0, 10_000, 10, 0));
    assert_eq!(holds(&sluice, "user", "held"), 10.0);
    assert_eq!(holds(&sluice, "user", "denied"), 30.0);
    let larger = user.call("large", 3_000, &[]).await;
    assert!(larger.over, "a cost above the estimate holds it: no room");
}

/// A request whose response never settles: charged `charged` of its estimate of 1,000 once its
/// hold expires, by the first call after its time to live; its late settle is charged the rest
/// of its cost.
async fn expires(store: Store, key: &'static str, charged: u32) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, key).await;
    let start = Instant::now();
    assert_eq!(user.hold("a").await, (false, 9_000));
    tokio::time::sleep(SHORT_TTL / 2).await;
    assert_eq!(
        user.hold("b").await,
        (false, 8_000),
        "a still holds within its time to live"
    );
    assert!(start.elapsed() < SHORT_TTL, "the test ran too slowly");
    assert_eq!(user.settle("b", 100).await, (false, 8_900));
    assert_eq!(user.shown(), (100, 1_000, 1, 8_900));
    tokio::time::sleep((SHORT_TTL + Duration::from_millis(300)).saturating_sub(start.elapsed()))
        .await;
    assert_eq!(
        user.hold("c").await,
        (false, 8_900 - charged),
        "a's hold expired: {charged} charged (c holds)"
    );
    let left = u64::from(8_900 - charged);
    assert_eq!(user.shown(), (100 + u64::from(charged), 1_000, 1, left));
    assert_eq!(
        user.settle("a", 1_500).await,
        (false, 7_400),
        "a settles late: what it costs is charged in all, whatever its expiry charged"
    );
    assert_eq!(
        user.hold("a").await,
        (true, 7_400),
        "a lapsed id is never held again"
    );
    // c, held after a's time to live, holds still.
    assert!(
        start.elapsed() < 2 * SHORT_TTL,
        "the test ran too slowly: c may have expired"
    );
    for (outcome, n) in [("expired", 1.0), ("unheld", 1.0), ("reused", 1.0)] {
        assert_eq!(holds(&sluice, key, outcome), n, "{outcome}");
    }
}

async fn a_request_that_never_settles_is_charged_its_estimate_when_its_hold_expires(store: Store) {
    expires(store, "quick", 1_000).await;
}

async fn with_on_expiry_release_a_request_that_never_settles_is_charged_nothing(store: Store) {
    expires(store, "free", 0).await;
}

/// A request that never settles, its user away past twice its time to live (when its table
/// would have gone, and the hold with it, uncharged): the user's next call in the window finds
/// the hold expired and charges it.
async fn a_hold_never_settled_is_charged_however_long_its_user_stays_away(store: Store) {
    in_one_window(HOUR, async || {
        let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
        let user = User::new(&sluice, "quick").await;
        assert_eq!(user.hold("a").await, (false, 9_000));
        tokio::time::sleep(2 * SHORT_TTL + Duration::from_millis(500)).await;
        assert_eq!(
            user.hold("b").await,
            (false, 8_000),
            "a's estimate charged, b held"
        );
        assert_eq!(holds(&sluice, "quick", "expired"), 1.0);
    })
    .await;
}

/// `tenant`'s table keeps 50 entries. Before, 50 settled requests filled it (refused new holds
/// until their marks were forgotten), and a table full of holds answered remaining 0 and the
/// hour's end.
async fn marks_make_room_oldest_first_and_a_table_full_of_holds_says_what_is_left_and_when(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let tenant = User::new(&sluice, "tenant").await;
    for i in 0..50 {
        let id = format!("m{i}");
        assert!(!tenant.hold(&id).await.0);
        assert!(!tenant.settle(&id, 10).await.0);
    }
    let first = Instant::now();
    for i in 0..25 {
        assert!(
            !tenant.hold(&format!("h{i}")).await.0,
            "hold {i}: 50 marks make room"
        );
    }
    assert!(
        tenant.hold("m49").await.0,
        "the newest mark is kept: its id is refused"
    );
    assert!(
        !tenant.hold("m0").await.0,
        "the oldest mark went first: its id is new to the table"
    );
    for i in 25..49 {
        assert!(!tenant.hold(&format!("h{i}")).await.0, "hold {i}");
    }
    assert_eq!(tenant.shown(), (500, 500, 50, 9_000));
    let full = tenant.call("one-more", 0, &[]).await;
    assert!(full.over, "50 holds in flight fill the table: {full:?}");
    assert_eq!(
        full.remaining, 9_000,
        "the answer says what the counter really has left"
    );
    // Or when the hour ends, if it ends first: a new window makes room too.
    let hour_ends = Duration::from_millis(3_600_000 - support::unix_ms() % 3_600_000);
    let due = Duration::from_secs(30)
        .saturating_sub(first.elapsed())
        .min(hour_ends);
    assert!(
        full.reset <= Duration::from_secs(30) && full.reset + Duration::from_secs(2) >= due,
        "retry when the next hold is due (or the hour ends), about {due:?}: {full:?}"
    );
    assert_eq!(holds(&sluice, "tenant", "full"), 1.0);
    assert_eq!(holds(&sluice, "tenant", "reused"), 1.0);
    assert_eq!(
        tenant.settle("h0", 10).await,
        (false, 9_000),
        "a settle lands on a full table"
    );
    assert_eq!(
        tenant.hold("one-more").await,
        (false, 8_990),
        "its mark makes room"
    );
}

/// Before, a request refused for the holds in flight was told to retry at the hour's end.
async fn a_request_refused_for_the_holds_in_flight_retries_when_the_next_hold_is_due(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, "user").await;
    let first = Instant::now();
    for i in 0..10 {
        assert!(!user.hold(&format!("r{i}")).await.0);
    }
    let refused = user.call("next", 0, &[]).await;
    let due = TTL.saturating_sub(first.elapsed());
    assert!(refused.over && refused.remaining == 0, "{refused:?}");
    assert!(
        refused.reset <= TTL && refused.reset + Duration::from_secs(2) >= due,
        "10 holds of 1,000 in flight: retry when the first is due, about {due:?}: {refused:?}"
    );
    // Spent, not held: the window's end.
    for i in 0..10 {
        assert!(!user.settle(&format!("r{i}"), 1_000).await.0);
    }
    let spent = user.call("later", 0, &[]).await;
    let hour_end =
        Duration::from_millis(HOUR.as_millis() as u64 - unix_ms() % HOUR.as_millis() as u64);
    assert!(spent.over, "{spent:?}");
    assert!(
        spent.reset.abs_diff(hour_end) <= Duration::from_secs(2),
        "10,000 spent: retry when the hour ends, in {hour_end:?}: {spent:?}"
    );
    assert_eq!(holds(&sluice, "user", "denied"), 2.0);
}

/// Before, `/counters` showed `used` up to the limit only, and no holds; a reset left the holds
/// in flight holding.
async fn counters_shows_used_past_the_limit_held_and_holds_and_a_reset_drops_the_holds(
    store: Store,
) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &["--trust-admin-port"]).await;
    let user = User::new(&sluice, "user").await;
    for i in 0..10 {
        assert!(!user.hold(&format!("r{i}")).await.0);
    }
    assert_eq!(user.shown(), (0, 10_000, 10, 0));
    for i in 0..10 {
        assert!(!user.settle(&format!("r{i}"), 3_000).await.0);
    }
    assert_eq!(
        user.shown(),
        (30_000, 0, 0, 0),
        "ten settles at 3,000: used past the limit"
    );
    assert!(user.hold("n0").await.0);
    let reset = user.counters("reset", true);
    assert_eq!(numbers(&reset["before"]), (30_000, 0, 0, 0), "{reset}");
    assert_eq!(numbers(&reset["after"]), (0, 0, 0, 10_000), "{reset}");
    assert_eq!(
        user.hold("n1").await,
        (false, 9_000),
        "the reset frees the user at once"
    );
    for i in 2..11 {
        assert!(!user.hold(&format!("n{i}")).await.0);
    }
    assert!(user.hold("n11").await.0);
    let dry = user.counters("reset", false);
    assert_eq!(numbers(&dry["before"]), (0, 10_000, 10, 0), "{dry}");
    assert_eq!(
        numbers(&dry["after"]),
        (0, 0, 0, 10_000),
        "a reset would drop the holds: {dry}"
    );
    assert!(user.hold("n12").await.0, "a dry run changes nothing");
    let reset = user.counters("reset", true);
    assert_eq!(
        numbers(&reset["after"]),
        (0, 0, 0, 10_000),
        "the holds in flight are dropped: {reset}"
    );
    assert_eq!(user.hold("n13").await, (false, 9_000));
    assert_eq!(
        user.settle("n1", 500).await,
        (false, 8_500),
        "a hold dropped: its settle finds none, charged in full"
    );
    assert_eq!(user.shown(), (500, 1_000, 1, 8_500));
}

/// A big model's token counts for 10 of the budget, a small one's for 1; a model not listed as
/// the dearest; an output token for 4 input ones. The model's entry follows the request id,
/// before or after the settle entry.
async fn a_weighted_settle_charges_its_models_tokens_from_one_budget(store: Store) {
    let sluice = Sluice::on(store, &[("rules.yaml", RULES)], &[]).await;
    let user = User::new(&sluice, "user").await;
    let (big, small, other) = (("model", "big"), ("model", "small"), ("model", "other"));
    let asked = |a: Answer| (a.over, a.remaining);
    assert_eq!(asked(user.call("b", 0, &[big]).await), (false, 9_000));
    assert_eq!(
        asked(user.call("b", 200, &[big, RESPONSE]).await),
        (false, 8_000),
        "200 tokens of the big model: 2,000"
    );
    assert_eq!(asked(user.call("s", 0, &[small]).await), (false, 7_000));
    assert_eq!(
        asked(user.call("s", 200, &[small, RESPONSE]).await),
        (false, 7_800),
        "200 tokens of the small one: 200"
    );
    assert!(!user.hold("n").await.0);
    assert_eq!(
        user.settle("n", 100).await,
        (false, 7_700),
        "no model: a token counts 1"
    );
    assert!(!user.call("o", 0, &[other]).await.over);
    assert_eq!(
        asked(user.call("o", 10, &[RESPONSE, other]).await),
        (false, 7_600),
        "a model not listed counts as the dearest, the settle entry first"
    );
    assert_eq!(
        asked(user.call("m", 150, &[big]).await),
        (false, 6_100),
        "150 tokens of the big model asked at the request: a hold of 1,500"
    );
    assert_eq!(
        asked(user.call("m", 100, &[RESPONSE, big]).await),
        (false, 6_600)
    );
    assert_eq!(
        user.shown(),
        (3_400, 0, 0, 6_600),
        "one budget, drawn by each model in proportion"
    );
    // Input and output tokens priced apart: one response-time call, a descriptor for each kind
    // (Envoy's two rate limits applied when the stream is done), settles the hold once.
    assert_eq!(asked(user.call("k", 0, &[big]).await), (false, 5_600));
    let kind = |kind: &'static str, tokens: u64| {
        let mut d = support::descriptor(&[
            (user.key, user.value.as_str()),
            ("request_id", "k"),
            big,
            ("kind", kind),
            RESPONSE,
        ]);
        d.hits_addend = Some(UInt64Value { value: tokens });
        d
    };
    let mut both = request("llm", &[]);
    both.descriptors = vec![kind("input", 100), kind("output", 50)];
    let answer = decide(&mut RateLimitServiceClient::new(user.channel.clone()), both).await;
    assert_ne!(answer.overall_code, OVER_LIMIT, "{answer:?}");
    assert_eq!(
        user.shown(),
        (6_400, 0, 0, 3_600),
        "(100 input + 50 output × 4) × 10 for the big model"
    );
    assert_eq!(
        holds(&sluice, "user", "settle"),
        6.0,
        "one settle per request"
    );
    assert_eq!(holds(&sluice, "user", "unheld"), 0.0);
}

/// The embedded store keeps at most `--max-keys` entries of holds in all: one user's 100 holds
/// in flight never refuse another user's hold (before, bounded per shard: 9 of 300 refused).
#[tokio::test(flavor = "multi_thread")]
async fn on_the_embedded_store_one_users_holds_never_refuse_another_users() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::on(
            Store::Memory,
            &[("rules.yaml", RULES)],
            &["--max-keys", "6400"],
        )
        .await;
        let team = User::new(&sluice, "team").await;
        for i in 0..100 {
            assert!(!team.hold(&format!("r{i}")).await.0, "team's hold {i}");
        }
        let mut refused = 0;
        for _ in 0..300 {
            let other = User::new(&sluice, "user").await;
            refused += usize::from(other.hold("r0").await.0);
        }
        assert_eq!(refused, 0, "of 300 other users' holds");
        assert_eq!(holds(&sluice, "user", "full"), 0.0);
        assert_eq!(team.shown(), (0, 1_000, 100, 9_000));
    })
    .await;
}

/// The store's marks are bounded apart from its holds: with `--max-keys 64`, one user's 64
/// settled requests fill the marks the store keeps, and another user's first hold is taken all
/// the same (its marks forgotten first, the oldest of the table that makes a new one).
#[tokio::test(flavor = "multi_thread")]
async fn on_the_embedded_store_one_users_marks_never_refuse_another_users_hold() {
    in_one_window(HOUR, async || {
        let sluice = Sluice::on(
            Store::Memory,
            &[("rules.yaml", RULES)],
            &["--max-keys", "64"],
        )
        .await;
        let team = User::new(&sluice, "team").await;
        for i in 0..64 {
            let id = format!("r{i}");
            assert!(!team.hold(&id).await.0, "team's hold {i}");
            team.settle(&id, 1).await;
        }
        let other = User::new(&sluice, "user").await;
        assert!(!other.hold("r0").await.0, "another user's first hold");
        assert!(!team.hold("r64").await.0, "the team's next hold");
        assert_eq!(holds(&sluice, "user", "full"), 0.0);
    })
    .await;
}

/// Holds are in Redis: replica A takes five and is killed; replica B counts them, settles them
/// at their real cost, and the budget ends holding exactly what was spent.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_killed_holding_holds_loses_none_and_another_settles_them() {
    in_one_window(HOUR, async || {
        let prefix = format!("holds{}-killed-{}:", std::process::id(), unix_ms());
        let flags = ["--redis-key-prefix", prefix.as_str()];
        let mut a = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &flags).await;
        let b = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &flags).await;
        let on_a = User::new(&a, "user").await;
        for i in 0..5 {
            assert!(!on_a.hold(&format!("r{i}")).await.0);
        }
        let on_b = User {
            sluice: &b,
            key: "user",
            value: on_a.value.clone(),
            channel: b.channel().await,
        };
        a.kill();
        assert_eq!(
            on_b.hold("new").await,
            (false, 4_000),
            "the other replica counts the dead one's holds"
        );
        for i in 0..5 {
            assert!(!on_b.settle(&format!("r{i}"), 300).await.0);
        }
        assert_eq!(
            on_b.settle("new", 200).await,
            (false, 10_000 - 5 * 300 - 200),
            "settled by the other replica: the budget holds exactly what was spent"
        );
        assert_eq!(holds(&b, "user", "settle"), 6.0);
        assert_eq!(holds(&b, "user", "unheld"), 0.0);
    })
    .await;
}

/// A Redis restarted empty loses the holds with the counts: the budget starts over; the settle
/// of a request held before the restart finds no hold and is charged its cost in full, and the
/// holds taken after it are charged their estimates when they expire; nothing ever passes the
/// limit.
#[tokio::test(flavor = "multi_thread")]
async fn a_redis_restarted_empty_starts_the_budget_over_and_never_passes_it() {
    in_one_window(HOUR, async || {
        let mut redis = Controlled::started();
        let flags = ["--redis-url", redis.url.as_str(), "--store-timeout", "1s"];
        let sluice = Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &flags).await;
        let user = User::new(&sluice, "quick").await;
        for i in 0..5 {
            assert!(!user.hold(&format!("r{i}")).await.0);
        }
        redis.kill();
        redis.start();
        // A call fails until its connection has seen the new Redis: wait until 32 in a row, 8
        // at a time, are decided, for a user of their own (the answers, each a hold, do not
        // matter).
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut in_a_row = 0;
        while in_a_row < 32 {
            let probes = (0..8).map(|i| {
                let sluice = &sluice;
                async move {
                    let id = format!("p{in_a_row}-{i}");
                    let probe = request("llm", &[&[("quick", "probe"), ("request_id", &id)]]);
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
                assert!(Instant::now() < deadline, "sluice reaches the new Redis");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        assert_eq!(
            user.settle("r0", 300).await,
            (false, 10_000 - 300),
            "r0's hold is gone with the counts: its settle is charged in full"
        );
        let mut admitted = 0;
        for i in 0..12 {
            admitted += usize::from(!user.hold(&format!("after{i}")).await.0);
        }
        assert_eq!(
            admitted, 9,
            "the budget starts over, and holds 10,000 at most"
        );
        tokio::time::sleep(SHORT_TTL + Duration::from_millis(300)).await;
        assert_eq!(
            user.hold("last").await,
            (true, 0),
            "every hold expired unsettled, charged its estimate: 9,300 spent"
        );
        assert_eq!(user.shown(), (9_300, 0, 0, 700));
    })
    .await;
}

/// The descriptor of `user`'s request `id` with `hits`, the entries `after` the request id's,
/// as a request's JSON.
fn explained_request(id: &str, hits: u64, after: &[(&str, &str)]) -> Value {
    let mut entries = vec![
        json!({"key": "user", "value": "ann"}),
        json!({"key": "request_id", "value": id}),
    ];
    entries.extend(after.iter().map(|(k, v)| json!({"key": k, "value": v})));
    json!({"domain": "llm", "descriptors": [{"entries": entries, "hitsAddend": hits}]})
}

/// `/explain` shows the rule's hold, what a request-time call holds and what a settle charges,
/// the entries after the request id taken by the rule, and one counter for every request of a
/// user: the request id, the model and the settle entry are left out of it. `sluice explain`
/// says the same in words.
#[tokio::test(flavor = "multi_thread")]
async fn explain_shows_the_hold_what_a_call_holds_or_settles_and_one_counter_per_user() {
    let sluice = Sluice::on(Store::Redis, &[("rules.yaml", RULES)], &[]).await;
    let explain = |body: Value| {
        let (status, _, text) = support::http(sluice.http, "POST", "/explain", &body.to_string());
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).expect("JSON")["descriptors"][0].clone()
    };
    let held = explain(explained_request("a", 0, &[]));
    let larger = explain(explained_request("b", 150, &[("model", "big")]));
    let settle = explain(explained_request(
        "a",
        300,
        &[("model", "big"), ("phase", "response")],
    ));
    assert_eq!(
        held["rule"]["modes"]["hold"],
        json!({"estimate": 1000, "settle": {"key": "phase", "value": "response"}, "ttl": "8s",
            "on_expiry": "charge", "most": 10000, "largest": "100%"})
    );
    assert_eq!(
        held["counters"][0]["hold"],
        json!({"holds": 1000}),
        "{held}"
    );
    assert_eq!(
        larger["counters"][0]["hold"],
        json!({"holds": 1500}),
        "{larger}"
    );
    assert_eq!(
        settle["counters"][0]["hold"],
        json!({"settles": 3000}),
        "{settle}"
    );
    let matched: Vec<&str> = settle["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["match"].as_str().expect("a match"))
        .collect();
    assert_eq!(matched, ["key", "key", "taken", "taken"], "{settle}");
    assert_eq!(settle["result"], "limited", "{settle}");
    let key = |d: &Value| d["counters"][0]["redis_key"].as_str().map(str::to_owned);
    assert!(key(&held).is_some(), "{held}");
    assert_eq!(key(&held), key(&larger), "one counter for every request");
    assert_eq!(key(&held), key(&settle), "and for their settles");

    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("rules.yaml"), RULES).expect("rules.yaml");
    for (request, said) in [
        (
            explained_request("a", 0, &[]),
            "    holds 1000 until the response settles it",
        ),
        (
            explained_request("a", 300, &[("phase", "response"), ("model", "big")]),
            "    settles: charges 3000 and releases the request's hold",
        ),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("explain")
            .arg(dir.path())
            .args(["--request", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sluice runs");
        std::io::Write::write_all(
            &mut child.stdin.take().expect("stdin"),
            request.to_string().as_bytes(),
        )
        .expect("the request is written");
        let out = child.wait_with_output().expect("sluice explain ends");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for line in [
            "    hold: estimate 1000, settled by phase=response, ttl 8s, on expiry charge, at most 10000 entries, largest 100%",
            said,
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
        }
    }
}
