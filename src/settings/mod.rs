//! Settings read at the edge, before anything starts: every command's flags (`serve`'s grouped
//! by concern in `serve`), each turned into the typed values the rest of the program receives,
//! and envoyproxy/ratelimit's environment, turned into the `serve` flags it means when sluice
//! runs as `ratelimit` (`erl`). Only the `sluice` command reads this module.

mod check;
pub mod erl;
mod explain;
mod health;
mod serve;

use std::ffi::OsString;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};

use sluice_core::limiter::Counting;
use sluice_core::limiter::lease::Leasing;

pub use check::CheckArgs;
pub use explain::ExplainArgs;
pub use health::HealthArgs;
pub use serve::ServeArgs;

#[derive(Parser)]
#[command(version, about = "Envoy global rate limit service")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve the rate limit service over gRPC, with an admin HTTP server beside it.
    Serve(Box<ServeArgs>),
    /// Validate rule files: exit 0 when valid, else print `file:line: message` per error.
    CheckConfig(CheckArgs),
    /// Explain how rules match a request: each descriptor's walk through the rule tree, the
    /// limits, replaces and modes that apply, and the counters it would move (none is moved).
    Explain(ExplainArgs),
    /// Load a rate limit service (sluice or another) and report throughput and latency.
    Load(crate::cli::load::Options),
    /// Ask a running server's gRPC health service; exit 0 when it reports SERVING.
    Health(HealthArgs),
    /// Watch who a running server is limiting: its decision rate, store latency and policy
    /// answers, the values most denied and the rules most denied, from its admin /top.
    Top(crate::cli::top::Options),
    /// Show, reset, set or add to the counters one request would move, through a running
    /// server's admin /counters (a dry run unless --apply).
    Counters(Box<crate::cli::counters::Options>),
}

/// `--counting`'s values: the limiter's `Counting`, by name.
fn counting() -> impl TypedValueParser<Value = Counting> {
    PossibleValuesParser::new([
        PossibleValue::new("admitted")
            .help("only when the whole request is admitted, and only if they fit"),
        PossibleValue::new("always")
            .help("every charge lands, and a request is over when the count is above the limit"),
    ])
    .map(|name| Counting::parse(&name).unwrap_or_default())
}

/// `--lease`'s values: the limiter's `Leasing`, by name.
fn leasing() -> impl TypedValueParser<Value = Leasing> {
    PossibleValuesParser::new([
        PossibleValue::new("auto").help("decided from leased blocks where the algorithm allows it"),
        PossibleValue::new("off").help("every request asks the store"),
    ])
    .map(|name| Leasing::parse(&name).unwrap_or_default())
}

/// The command line; run as `ratelimit`, `serve` with the flags envoyproxy/ratelimit's
/// environment means (and any arguments given after them), with that translation. A value clap
/// refuses is named by the variable it came from.
pub fn parse() -> Result<(Cli, Option<erl::Translation>), String> {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    if !args.first().is_some_and(erl::runs_as_ratelimit) {
        return Ok((Cli::parse(), None));
    }
    let translation = erl::translate(&|name| std::env::var(name).ok())?;
    let given = args.split_off(1);
    let translated = translation.args.iter().cloned();
    match Cli::try_parse_from(args.into_iter().chain(translated).chain(given)) {
        Ok(cli) => Ok((cli, Some(translation))),
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let rendered = e.to_string();
            let first = rendered.lines().next().unwrap_or_default();
            Err(translation.blame(first.trim_start_matches("error: ")))
        }
    }
}
