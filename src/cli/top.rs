//! `sluice top`: who a running sluice is limiting right now, read from its admin `/top` — the
//! decision rate, store latency and policy answers, then the values most denied and the rules
//! most denied — redrawn in place on the terminal every `--interval` until Ctrl-C, or printed
//! once with `--once`.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use anyhow::Context;

use super::admin::Admin;
use crate::telemetry::top::{Period, PeriodReport, Report, RuleRow, Values};

/// Moves the cursor home and clears the screen.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// What to watch and how.
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    #[command(flatten)]
    pub admin: Admin,
    /// How often the view is redrawn.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// The period shown: the last 1m or 10m.
    #[arg(long, value_enum, default_value_t = Period::Minute)]
    pub period: Period,
    /// Rows of each list.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub rows: u16,
    /// Print one view, without clearing the screen, and exit: 0 when the server answered.
    #[arg(long)]
    pub once: bool,
}

/// Shows the view once, or until Ctrl-C.
pub async fn run(options: Options) -> anyhow::Result<()> {
    if options.once {
        let report = ask(&options).await?;
        print!("{}", render(&report, &options));
        return Ok(());
    }
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let frame = tokio::select! {
            _ = &mut stop => return Ok(()),
            frame = async {
                tick.tick().await;
                match ask(&options).await {
                    Ok(report) => render(&report, &options),
                    Err(e) => format!("sluice top: {}: {e:#}\n", options.admin.addr),
                }
            } => frame,
        };
        let mut out = std::io::stdout().lock();
        write!(out, "{CLEAR}{frame}")?;
        out.flush()?;
    }
}

/// The period asked for, from the server's `/top`.
async fn ask(options: &Options) -> anyhow::Result<PeriodReport> {
    let path = format!("/top?period={}&n={}", options.period.name(), options.rows);
    let (status, body) = options.admin.ask("GET", &path, None).await?;
    if !status.is_success() {
        anyhow::bail!("{status}: {}", String::from_utf8_lossy(&body).trim());
    }
    let report: Report = serde_json::from_slice(&body).context("reading /top")?;
    report
        .periods
        .into_iter()
        .find(|p| p.period == options.period)
        .context("/top has no such period")
}

/// One view of `report`.
fn render(report: &PeriodReport, options: &Options) -> String {
    let mut out = String::new();
    let rows = usize::from(options.rows);
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3} ms"));
    let p = &report.policy_answers;
    let _ = writeln!(
        out,
        "sluice top — {}, the last {} ({:.0} s)",
        options.admin.addr,
        report.period.name(),
        report.seconds
    );
    let _ = writeln!(
        out,
        "decisions {:.1}/s   store p50 {} p99 {} ({} calls)   policy answers: error {} allow {} deny {}",
        report.decisions_per_second,
        ms(report.store_p50_ms),
        ms(report.store_p99_ms),
        report.store_calls,
        p.error,
        p.allow,
        p.deny
    );
    let _ = writeln!(out);
    if report.values == Values::Hide {
        let _ = writeln!(out, "values hidden (--top-values hide)");
    } else {
        let _ = writeln!(
            out,
            "{:>10} {:>10} {:>8}  {:<30} VALUE",
            "DENIED/S", "DENIED", "±ERROR", "DOMAIN/RULE"
        );
        for row in report.denied.iter().take(rows) {
            let _ = writeln!(
                out,
                "{:>10.2} {:>10} {:>8}  {:<30} {}",
                row.per_second,
                row.count,
                row.error,
                format!("{}/{}", row.domain, row.rule),
                printable(&row.value)
            );
        }
        if report.denied.is_empty() {
            let _ = writeln!(out, "(none denied)");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:>10} {:>10}  {:<30} WINDOW ENDS IN",
        "DENIED/S", "HITS/S", "DOMAIN/RULE"
    );
    for rule in rules(report).into_iter().take(rows) {
        let ends = rule.window_ends_in_seconds.map_or(String::new(), |s| {
            humantime::format_duration(Duration::from_secs(s)).to_string()
        });
        let _ = writeln!(
            out,
            "{:>10.2} {:>10.2}  {:<30} {ends}",
            rule.denied_per_second,
            rule.hits_per_second,
            format!("{}/{}", rule.domain, rule.rule)
        );
    }
    out
}

/// The rules most denied, then those most hit.
fn rules(report: &PeriodReport) -> Vec<&RuleRow> {
    let mut out: Vec<&RuleRow> = report.rules_by_denied.iter().collect();
    for rule in &report.rules_by_hits {
        if !out
            .iter()
            .any(|r| (&r.domain, &r.rule) == (&rule.domain, &rule.rule))
        {
            out.push(rule);
        }
    }
    out
}

/// A value safe to print on a terminal: control characters (escapes a client could send)
/// shown escaped.
fn printable(value: &str) -> String {
    value.chars().flat_map(char::escape_debug).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_cannot_move_the_cursor() {
        assert_eq!(printable("a\x1b[2Jb"), "a\\u{1b}[2Jb");
    }
}
