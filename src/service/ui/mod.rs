//! `/ui`: the admin console, one page served from the binary (its script and style beside it,
//! nothing from elsewhere), and `/status`, what it shows of the store, the `split` replicas and
//! the quota service. The page reads `/top`, `/status` and `/config`, asks `/explain` and
//! `/counters`, and sends the admin token the operator enters (kept for the tab only); it sets
//! every value as text, and its Content-Security-Policy lets nothing run or load from elsewhere.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::auth::{AdminAccess, guarded};
use super::gauges::Gauges;
use super::in_force::Rules;
use sluice_core::store::unix_ms;

const PAGE: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("app.css");

/// What the console's page, script and style may do: load themselves and call the admin port,
/// nothing else (no inline script or style, no frame, no form sent anywhere).
pub(super) const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The console's routes: the page and its assets, open (they hold no data), and `/status`,
/// guarded as `/top` is.
pub(super) fn console(gauges: Gauges, rules: Rules, access: &AdminAccess) -> Router {
    Router::new()
        .route(
            "/ui",
            get(|| async { asset(PAGE, "text/html; charset=utf-8") }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        )
        .route(
            "/status",
            guarded(
                get(move || {
                    let (gauges, rules) = (gauges.clone(), rules.clone());
                    async move { axum::Json(status(&gauges, &rules)) }
                }),
                access,
            ),
        )
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The store, the `split` replicas and the quota service, as the console shows them, and when
/// the calendar window of each rule on the calendar ends (ms since the Unix epoch); a field that
/// does not apply to the store in use is null.
fn status(gauges: &Gauges, rules: &Rules) -> Value {
    let backend = &gauges.backend;
    let (buckets, streams) = gauges.quotas.tracked();
    let quota_rules: Vec<Value> = gauges
        .quotas
        .by_rule()
        .into_iter()
        .map(|(labels, subscribed, rate)| {
            let mut row: serde_json::Map<String, Value> = labels
                .into_iter()
                .map(|(name, value)| (name.to_owned(), json!(value)))
                .collect();
            row.insert("subscribed".into(), json!(subscribed));
            row.insert("rate".into(), json!(rate));
            Value::Object(row)
        })
        .collect();
    let in_force = rules.in_force();
    let calendar_ends: Vec<Value> = in_force
        .calendar_ends(unix_ms())
        .into_iter()
        .map(|((domain, rule), end_ms)| json!({"domain": domain, "rule": rule, "ends_ms": end_ms}))
        .collect();
    json!({
        "rules_hash": in_force.origin().hash,
        "calendar_ends": calendar_ends,
        "store": {
            "kind": backend.kind(),
            "reachable": backend.reachable(),
            "breakers_open": backend.open_breakers(),
            "unreplicated_primaries": backend.unreplicated_primaries(),
            "clock_skew_ms": backend.clock_skew_ms(),
            "live_counters": backend.live_counters(),
        },
        "replicas": { "live": backend.live_replicas() },
        "quota": { "buckets": buckets, "streams": streams, "rules": quota_rules },
    })
}
