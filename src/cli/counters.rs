//! `sluice counters`: shows, resets, sets or adds to the counters one request would move, through
//! a running server's admin `POST /counters` (a dry run unless `--apply`).

use std::fmt::Write as _;

use anyhow::Context;
use serde_json::{Value, json};

use super::admin::Admin;

/// What to do to the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Action {
    /// Show what they hold.
    Show,
    /// Delete them: a window counts nothing, a log holds no entry, a bucket is full.
    Reset,
    /// Reset them, then charge `--hits`.
    Set,
    /// Charge `--hits`, or give them back when negative.
    Add,
}

/// Which counters, and what to do to them.
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    #[arg(value_enum)]
    pub action: Action,
    /// The request's domain.
    #[arg(long)]
    pub domain: String,
    /// One request descriptor as key=value[,key=value…] (each entry split at its first `=`),
    /// as Envoy sends it; repeat for several descriptors.
    #[arg(long = "descriptor", value_parser = super::parse_descriptor, required = true)]
    pub descriptors: Vec<Vec<(String, String)>>,
    /// Hits to set the counters to (`set`) or add to them (`add`, negative to give back).
    #[arg(long, allow_hyphen_values = true)]
    pub hits: Option<i64>,
    /// An RFC 3339 instant naming the window of `fixed_window` counters (else: the window now).
    #[arg(long)]
    pub at: Option<String>,
    /// Only the counters of limits with this name.
    #[arg(long)]
    pub limit: Option<String>,
    /// Change the counters; without it, a dry run shows what the action would make of them.
    #[arg(long)]
    pub apply: bool,
    /// Who asks, for the server's audit line (which says `unknown` when it is empty).
    #[arg(long, env = "USER", default_value = "")]
    pub by: String,
    /// Print the server's answer as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub admin: Admin,
}

/// Asks the server and prints its answer.
pub async fn run(options: Options) -> anyhow::Result<()> {
    let descriptors: Vec<Value> = options
        .descriptors
        .iter()
        .map(|entries| {
            let entries: Vec<Value> = entries
                .iter()
                .map(|(key, value)| json!({"key": key, "value": value}))
                .collect();
            json!({ "entries": entries })
        })
        .collect();
    let action = match options.action {
        Action::Show => "show",
        Action::Reset => "reset",
        Action::Set => "set",
        Action::Add => "add",
    };
    let body = json!({
        "domain": options.domain,
        "descriptors": descriptors,
        "action": action,
        "hits": options.hits,
        "at": options.at,
        "limit": options.limit,
        "apply": options.apply,
        "by": options.by,
    });
    let (status, answer) = options
        .admin
        .ask("POST", "/counters", Some(body.to_string().into_bytes()))
        .await?;
    if !status.is_success() {
        anyhow::bail!("{status}: {}", String::from_utf8_lossy(&answer).trim());
    }
    if options.json {
        print!("{}", String::from_utf8_lossy(&answer));
        return Ok(());
    }
    let answer: Value = serde_json::from_slice(&answer).context("reading /counters")?;
    print!("{}", render(&answer));
    Ok(())
}

/// The answer in words: the action, then each counter, before and after.
fn render(answer: &Value) -> String {
    let mut out = String::new();
    let action = answer["action"].as_str().unwrap_or_default();
    let hits = match &answer["hits"] {
        Value::Null => String::new(),
        hits => format!(" {hits}"),
    };
    let applied = if answer["applied"] == json!(true) {
        "applied"
    } else if action == "show" {
        "nothing changed"
    } else {
        "dry run: nothing changed, --apply to change"
    };
    let _ = writeln!(out, "{action}{hits} ({applied})");
    let counters = answer["counters"].as_array().map_or(&[][..], Vec::as_slice);
    if counters.is_empty() {
        out.push_str("no counter: no limit applies to the request\n");
    }
    for c in counters {
        let limit = &c["limit"];
        let _ = writeln!(
            out,
            "descriptor {}: {} per {}, {}{}",
            c["descriptor"],
            limit["requests_per_unit"],
            limit["unit"].as_str().unwrap_or_default(),
            limit["algorithm"].as_str().unwrap_or_default(),
            match limit["name"].as_str() {
                Some(name) if !name.is_empty() => format!(", name {name}"),
                _ => String::new(),
            }
        );
        let _ = writeln!(out, "  {}", c["counter"].as_str().unwrap_or_default());
        if let Some(key) = c["redis_key"].as_str() {
            let _ = writeln!(out, "  redis key {key}");
        }
        if let Some(window) = c["window"].as_object() {
            let _ = writeln!(
                out,
                "  window {} to {}",
                window["start"].as_str().unwrap_or_default(),
                window["end"].as_str().unwrap_or_default()
            );
        }
        let _ = writeln!(
            out,
            "  used {} -> {}, remaining {} -> {}",
            c["before"]["used"],
            c["after"]["used"],
            c["before"]["remaining"],
            c["after"]["remaining"]
        );
        // A held rule's counter: what its requests in flight hold.
        if c["before"]["held"].is_number() {
            let _ = writeln!(
                out,
                "  held {} -> {} by {} -> {} requests in flight",
                c["before"]["held"], c["after"]["held"], c["before"]["holds"], c["after"]["holds"]
            );
        }
    }
    out
}
