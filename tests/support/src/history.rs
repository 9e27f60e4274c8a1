//! What the generated histories share: the label that says how to replay one, and the log of
//! every event and answer, in ms since the history began, printed when a check fails (and by a
//! history that passes, under `--nocapture`).

use std::fmt::Display;
use std::time::{Duration, Instant};

use super::{in_one_window, rng, unix_ms};

/// How to replay the history of `seed`: `seed S (replay: <NAME>_HISTORY_SEED=S
/// <NAME>_HISTORY_STEPS=N)`, the knobs `histories` reads.
pub fn replay_label(name: &str, seed: u64, steps: usize) -> String {
    format!("seed {seed} (replay: {name}_HISTORY_SEED={seed} {name}_HISTORY_STEPS={steps})")
}

/// A history's log, under its label: events, and their details (answers, reports).
pub struct Log {
    pub label: String,
    began: Instant,
    /// Each line, and whether it is a detail.
    lines: Vec<(bool, String)>,
}

impl Log {
    pub fn new(label: String) -> Log {
        Log {
            label,
            began: Instant::now(),
            lines: Vec::new(),
        }
    }

    /// Ms from the history's beginning to `at`.
    pub fn since(&self, at: Instant) -> u128 {
        at.saturating_duration_since(self.began).as_millis()
    }

    /// Notes the event `what`, at the time now.
    pub fn note(&mut self, what: impl Display) {
        let at = self.since(Instant::now());
        self.lines.push((false, format!("{at:>6} ms  {what}")));
    }

    /// Notes a detail `what` (an answer, a report), at the time now.
    pub fn detail(&mut self, what: impl Display) {
        self.detail_at(Instant::now(), what);
    }

    /// Notes a detail `what` that happened `at`.
    pub fn detail_at(&mut self, at: Instant, what: impl Display) {
        let at = self.since(at);
        self.lines.push((true, format!("{at:>6} ms    {what}")));
    }

    /// The whole log, a line per event or detail.
    pub fn text(&self) -> String {
        self.lines(true).collect::<Vec<_>>().join("\n")
    }

    /// The events, and the details too when `details`.
    pub fn lines(&self, details: bool) -> impl Iterator<Item = &str> {
        self.lines
            .iter()
            .filter(move |(detail, _)| details || !detail)
            .map(|(_, line)| line.as_str())
    }

    /// Prints the log and `state` (what the history holds now, or nothing), and fails the test,
    /// naming the label, the step and why.
    pub fn fail(&self, step: usize, why: impl Display, state: &str) -> ! {
        eprintln!("history of {}:\n{}\n{state}", self.label, self.text());
        panic!("{}, step {step}: {why}", self.label);
    }
}

/// Runs the generated histories of `name`: `run(seed, steps)` for the seed
/// `<NAME>_HISTORY_SEED` names, else for fresh seeds during `<NAME>_HISTORY_MINUTES` minutes,
/// else for `seeds`; each of `<NAME>_HISTORY_STEPS` steps (`steps` unless set), in one window of
/// `window`.
pub async fn histories(
    name: &str,
    seeds: &[u64],
    steps: usize,
    window: Duration,
    mut run: impl AsyncFnMut(u64, usize),
) {
    let knob = |what: &str| format!("{name}_HISTORY_{what}");
    let steps = env_number(&knob("STEPS")).unwrap_or(steps);
    if let Some(seed) = env_number::<u64>(&knob("SEED")) {
        return in_one_window(window, async || run(seed, steps).await).await;
    }
    let Some(minutes) = env_number::<u64>(&knob("MINUTES")) else {
        for &seed in seeds {
            in_one_window(window, async || run(seed, steps).await).await;
        }
        return;
    };
    let until = Instant::now() + Duration::from_secs(minutes * 60);
    let mut fresh = rng::Rng(unix_ms());
    let mut histories = 0;
    while Instant::now() < until {
        let seed = fresh.next();
        in_one_window(window, async || run(seed, steps).await).await;
        histories += 1;
    }
    println!("{histories} histories in {minutes} minutes");
}

/// Whether `<NAME>_HISTORY_SEED` or `<NAME>_HISTORY_MINUTES` is set: the generated test of
/// `name` runs what they say, and the tests that run the rest of its fixed seeds beside it run
/// nothing.
pub fn replaying(name: &str) -> bool {
    env_number::<u64>(&format!("{name}_HISTORY_SEED")).is_some()
        || env_number::<u64>(&format!("{name}_HISTORY_MINUTES")).is_some()
}

/// The number the environment variable `name` holds, if set (a generated test's knob); any
/// other value stops the test.
pub fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: not a number: {v}"))
    })
}
