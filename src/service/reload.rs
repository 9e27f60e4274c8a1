//! Rule loading and hot reload. The rules under `--config` are reloaded on `SIGHUP` and on any
//! change under that path (a file written in place, renamed, added or removed, a Kubernetes
//! ConfigMap's `..data` symlink swapped), once the changes have settled for `SETTLE` (or
//! `LONGEST_SETTLE` after the first, if they never do). Reloads run on a thread of their own, one at
//! a time and at most one per `PACE`: what comes meanwhile (any number of SIGHUPs, changes) makes
//! one more. Every file is validated before anything changes; then the new rules replace the old
//! ones at once. A bad file is logged with `file:line`, counted, and the rules in force stay.
//! Counters live in the store, keyed by what a limit counts, so every limit a reload leaves
//! unchanged keeps its count.
//!
//! Rules over xDS (`--xds-server`) take the same swap: each valid snapshot replaces the rules at
//! once, an invalid one is counted and logged while the rules in force stay. Files are then not
//! watched; SIGHUP starts a new xDS stream, which brings the server's whole snapshot again.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::signal::unix::Signal;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::in_force::Rules;
use crate::telemetry::Telemetry;
use crate::xds::{Snapshot, Subscription};
use sluice_core::config::{self, Source};
use sluice_core::log_throttle::LogThrottle;
use sluice_core::observe::Observer;
use sluice_core::rules::RuleSet;

/// How long changes must stop before a reload: an editor's or kubelet's several writes make one.
const SETTLE: Duration = Duration::from_millis(200);
/// The longest a change waits for the changes after it to settle: a file rewritten without
/// pause is still reloaded.
const LONGEST_SETTLE: Duration = Duration::from_secs(1);
/// The least time from one reload to the next: a storm of SIGHUPs or changes is one reload per
/// `PACE`, the last of them never lost.
const PACE: Duration = Duration::from_millis(200);

/// Where the rules come from.
pub enum Feed {
    /// Rule files (`--config`), reloaded when they change; none at all is an error unless
    /// `allow_empty`.
    Files { source: Source, allow_empty: bool },
    /// An xDS server's snapshots (`--xds-server`).
    Xds(Box<Subscription>),
}

/// The rules of `feed`: read now from files (an error stops the start), or awaited from the xDS
/// server; then kept current until the process ends, SIGHUP (`hangup`) included; every load
/// told to `telemetry`, whose metrics count the rules' decisions.
pub fn start(feed: Feed, hangup: Signal, telemetry: Telemetry) -> anyhow::Result<Rules> {
    let observer: Arc<dyn Observer> = Arc::new(telemetry.clone());
    match feed {
        Feed::Xds(subscription) => {
            tracing::info!(
                server = subscription.server(),
                "rules over xDS: every request is refused (UNAVAILABLE) until the first configuration"
            );
            let rules = Rules::new(RuleSet::awaiting(observer));
            tokio::spawn(follow_xds(rules.clone(), *subscription, hangup, telemetry));
            Ok(rules)
        }
        Feed::Files {
            source,
            allow_empty,
        } => {
            let loaded = load(&source, allow_empty, observer)?;
            first(&loaded, &telemetry);
            let rules = Rules::new(loaded);
            if !rules.loaded() {
                tracing::warn!("no rules loaded: not ready until a reload finds some");
            }
            tokio::spawn(watch(rules.clone(), source, allow_empty, hangup, telemetry));
            Ok(rules)
        }
    }
}

/// Loads and validates the rules of `source`, counting into `observer`; none at all is an error
/// unless `allow_empty`. Errors are logged, one per line, as `file:line: message`.
fn load(
    source: &Source,
    allow_empty: bool,
    observer: Arc<dyn Observer>,
) -> anyhow::Result<RuleSet> {
    let path = source.path.as_path();
    match config::load(source) {
        Ok(loaded) if loaded.domains.is_empty() && !allow_empty => anyhow::bail!(
            "no rules in {}: no .yaml or .yml file with a domain (--allow-empty-config serves anyway, not ready until rules are loaded)",
            path.display()
        ),
        Ok(loaded) => {
            for w in &loaded.warnings {
                tracing::warn!("{w}");
            }
            Ok(RuleSet::from_loaded(loaded, false, observer))
        }
        Err(errors) => {
            for e in &errors {
                tracing::error!("{e}");
            }
            anyhow::bail!("{} error(s) in {}", errors.len(), path.display())
        }
    }
}

/// Puts the first rules in force: counted and logged as a load, not a reload.
fn first(rules: &RuleSet, telemetry: &Telemetry) {
    let origin = rules.origin();
    telemetry.rules_loaded(&origin.hash, false);
    tracing::info!(
        domains = rules.domains(),
        hash = %origin.hash,
        "rules loaded"
    );
}

/// Reloads `rules` from `source` on every SIGHUP (`hangup`) and file change, until the process
/// ends. Without a file watcher (one could not be set up), SIGHUP still reloads.
async fn watch(
    rules: Rules,
    source: Source,
    allow_empty: bool,
    mut hangup: Signal,
    telemetry: Telemetry,
) {
    let path = source.path.as_path();
    let changed = Arc::new(Notify::new());
    let _watcher = match watcher(path, changed.clone()) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                "cannot watch {} for changes ({e}): rules reload on SIGHUP only",
                path.display()
            );
            None
        }
    };
    loop {
        let trigger = tokio::select! {
            signal = hangup.recv() => {
                if signal.is_none() {
                    return;
                }
                "SIGHUP"
            }
            () = changed.notified() => {
                settle(&changed).await;
                "file change"
            }
        };
        // SIGHUPs meanwhile are coalesced into one by `hangup`, changes into one by `changed`.
        let (rules, source, told) = (rules.clone(), source.clone(), telemetry.clone());
        let reloading =
            config::on_own_thread(move || reload(&rules, &source, allow_empty, trigger, &told));
        if let Err(e) = reloading.await {
            telemetry.reload_failed();
            tracing::error!("{trigger}: the reload failed ({e}); the rules in force stay");
        }
        tokio::time::sleep(PACE).await;
    }
}

/// Waits until the changes have stopped for `SETTLE`, or for `LONGEST_SETTLE` since the first.
async fn settle(changed: &Notify) {
    let give_up = Instant::now() + LONGEST_SETTLE;
    loop {
        let quiet_until = give_up.min(Instant::now() + SETTLE);
        let stopped = tokio::time::timeout_at(quiet_until, changed.notified())
            .await
            .is_err();
        if stopped || Instant::now() >= give_up {
            return;
        }
    }
}

/// A watcher telling `changed` of every write, creation, removal or rename of a rule file
/// (`.yaml`, `.yml`) or a hidden entry (a ConfigMap's `..data`) under `path` (its directory, for
/// a single file). Reads and metadata changes (a read can move the access time) are ignored:
/// reloading reads the files; so are other files, such as a log written beside the rules.
fn watcher(path: &Path, changed: Arc<Notify>) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let relevant = match event {
            Ok(e) => {
                let kind = match e.kind {
                    EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
                    EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_)) => false,
                    _ => true,
                };
                kind && e.paths.iter().any(|p| is_rules_entry(p))
            }
            // An overflowed queue lost events: look again.
            Err(_) => true,
        };
        if relevant {
            changed.notify_one();
        }
    })?;
    if path.is_dir() {
        watcher.watch(path, RecursiveMode::Recursive)?;
    } else {
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        watcher.watch(parent, RecursiveMode::NonRecursive)?;
    }
    Ok(watcher)
}

fn is_rules_entry(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    name.starts_with("..") || name.ends_with(".yaml") || name.ends_with(".yml")
}

/// Loads the rules again; puts them in force when they are valid and differ from those in force.
fn reload(rules: &Rules, source: &Source, allow_empty: bool, trigger: &str, telemetry: &Telemetry) {
    match load(source, allow_empty, rules.in_force().observer()) {
        Ok(loaded) => {
            let hash = loaded.origin().hash.clone();
            if rules.in_force().origin().hash == hash {
                if trigger == "SIGHUP" {
                    tracing::info!(%hash, "{trigger}: rules unchanged");
                }
                return;
            }
            swap(rules, loaded, trigger, telemetry);
        }
        Err(e) => {
            telemetry.reload_failed();
            tracing::error!("{trigger}: {e:#}; the rules in force stay");
        }
    }
}

/// Puts `loaded` in place of the rules in force, counted as a reload.
fn swap(rules: &Rules, loaded: RuleSet, trigger: &str, telemetry: &Telemetry) {
    let hash = loaded.origin().hash.clone();
    telemetry.rules_loaded(&hash, true);
    let paths = loaded.rule_paths();
    telemetry.rules_kept(|domain, rule| paths.contains(domain, rule));
    drop(paths);
    let domains = loaded.domains();
    rules.replace(loaded);
    tracing::info!(domains, %hash, "{trigger}: rules reloaded");
}

/// Follows the xDS server of `subscription` until the process ends: the first valid snapshot
/// is counted and logged as a load, the next ones as reloads (one that changes nothing is not
/// swapped), an invalid one as a failed reload. Snapshots are converted, and the rules built and
/// swapped, on a thread of their own; rejections are logged at most once a second. SIGHUP
/// (`hangup`) starts a new stream at once.
async fn follow_xds(
    rules: Rules,
    subscription: Subscription,
    mut hangup: Signal,
    telemetry: Telemetry,
) {
    let resubscribe = Arc::new(Notify::new());
    let on_hangup = resubscribe.clone();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            on_hangup.notify_one();
        }
    });
    let apply = move |snapshot: Snapshot| match snapshot {
        Snapshot::Valid {
            version,
            rules: loaded,
        } => {
            let loaded = RuleSet::from_loaded(loaded, true, rules.in_force().observer());
            let in_force = rules.in_force();
            if in_force.is_awaiting() {
                first(&loaded, &telemetry);
                rules.replace(loaded);
            } else if in_force.origin().hash == loaded.origin().hash {
                tracing::debug!(%version, "xDS snapshot: rules unchanged");
            } else {
                swap(
                    &rules,
                    loaded,
                    &format!("xDS version {version}"),
                    &telemetry,
                );
            }
        }
        Snapshot::Unchanged { version } => {
            static UNCHANGED: LogThrottle = LogThrottle::new();
            if UNCHANGED.hit().is_some() {
                tracing::info!(
                    "xDS version {version}: the resources in force, not converted again"
                );
            }
        }
        Snapshot::Rejected {
            version,
            rejection,
            again,
        } => {
            telemetry.reload_failed();
            static REJECTED: LogThrottle = LogThrottle::new();
            if let Some(rejected) = REJECTED.hit() {
                let seen = if again { ", as last time" } else { "" };
                tracing::error!(
                    rejected_since_last_line = rejected,
                    "xDS version {version} rejected (NACK){seen}, the rules in force stay: {}",
                    rejection.summary()
                );
            }
        }
    };
    subscription.follow(apply, resubscribe).await;
}
