//! The wall clock that sluice's windows are aligned to, and running a test within one window.

use std::time::Duration;

/// The wall clock, in ms since the Unix epoch (the clock sluice's windows are aligned to).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sleeps until the wall clock reads `at` (ms since the Unix epoch).
pub async fn sleep_until_unix_ms(at: u64) {
    tokio::time::sleep(Duration::from_millis(at.saturating_sub(unix_ms()))).await;
}

/// A minute and an hour: the windows most tests count in.
pub const MINUTE: Duration = Duration::from_secs(60);
pub const HOUR: Duration = Duration::from_secs(3600);

/// Runs `test`, whose assertions hold only while no epoch-aligned `window` ends, and runs it once
/// more only when it failed and one did end (each run counts from fresh counters: a sluice or
/// values of its own). A failure within one window is the verdict, and so is the second run's:
/// two runs that together last less than a window cannot both see one of its ends. No test
/// waits for the wall clock.
pub async fn in_one_window(window: Duration, mut test: impl AsyncFnMut()) {
    use futures_util::FutureExt;
    let window = window.as_millis() as u64;
    let began = unix_ms() / window;
    let Err(failure) = std::panic::AssertUnwindSafe(test()).catch_unwind().await else {
        return;
    };
    if unix_ms() / window == began {
        std::panic::resume_unwind(failure);
    }
    eprintln!("a window ended while the test ran, which its assertions rule out: it runs again");
    test().await;
}
