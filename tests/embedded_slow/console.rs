//! The console (`/ui`) in a real browser: Debian's chromium, driven through Selenium by
//! tests/browser/console.py (both installed by scripts/test). The page loads and updates as
//! traffic comes, explains a request, resets a counter after its dry run, shows a hostile value
//! as text with nothing of it run, and shows and changes nothing without the admin token.

use std::time::Duration;

use support::{HOUR, Sluice, in_one_window};
use tokio::process::Command;

/// `k` admits 2 requests an hour: the third is denied, and shows among the values most denied.
const RULES: &str =
    "domain: web\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
const TOKEN: &str = "console-test-token-0123456789";
/// The longest a scenario may take, the browser's start included.
const SCENARIO: Duration = Duration::from_secs(60);

/// Runs `scenario` of tests/browser/console.py against `sluice`'s admin port, with `token` if
/// given; fails with what the scenario said.
async fn browse(sluice: &Sluice, scenario: &str, token: Option<&str>) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/console.py");
    let admin = sluice.http.to_string();
    let mut command = Command::new("python3");
    command
        .args([script, scenario, "--admin", &admin])
        .kill_on_drop(true);
    if let Some(token) = token {
        command.args(["--token", token]);
    }
    let ran = tokio::time::timeout(SCENARIO, command.output())
        .await
        .unwrap_or_else(|_| panic!("{scenario} took over {SCENARIO:?}"))
        .expect(
            "python3 runs tests/browser/console.py (scripts/test installs Selenium and chromium)",
        );
    assert!(
        ran.status.success(),
        "{scenario}: {}{}",
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
}

/// sluice on `RULES` with the admin token `TOKEN` in force.
async fn with_token() -> (Sluice, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let path = file.display().to_string();
    let sluice = Sluice::start_with(&[("rules.yaml", RULES)], &["--admin-token-file", &path]).await;
    (sluice, dir)
}

/// Runs `scenario` against sluice on `RULES`, no token, within one window of its limit.
async fn open(scenario: &str) {
    in_one_window(HOUR, async || {
        let sluice = Sluice::start(RULES).await;
        browse(&sluice, scenario, None).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_loads_and_updates_as_traffic_comes() {
    open("updates").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_explains_a_request() {
    open("explains").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_resets_a_counter_only_after_its_dry_run() {
    in_one_window(HOUR, async || {
        let (sluice, _dir) = with_token().await;
        browse(&sluice, "resets", Some(TOKEN)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_shows_hostile_values_as_text_and_runs_none() {
    open("hostile").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_shows_and_changes_nothing_without_the_token() {
    let (sluice, _dir) = with_token().await;
    browse(&sluice, "refuses", Some(TOKEN)).await;
}
