//! The client commands: what `sluice check-config`, `load`, `top`, `counters` and `health` do
//! once their flags are read (`settings`), each answering with the exit status the command ends
//! with. `load` drives a running service, `top` and `counters` ask its admin port (`admin`).

pub mod admin;
pub mod counters;
pub mod load;
pub mod top;

use std::process::ExitCode;
use std::time::Duration;

use sluice_core::config;

/// A descriptor from `key=value[,key=value…]`, each entry split at its first `=`: the
/// `--descriptor` of `load`, `counters` and `explain`.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!("'{pair}' is not key=value")),
        })
        .collect()
}

/// `sluice check-config`: the rule files of `source` read and checked, every error at its line.
pub fn check_config(source: &config::Source) -> ExitCode {
    match config::load(source) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                eprintln!("{w} (warning)");
            }
            let domains: std::collections::HashSet<_> =
                loaded.domains.iter().map(|d| &d.domain).collect();
            if domains.is_empty() {
                println!(
                    "{}: no .yaml or .yml file with a domain (serve refuses to start on it without --allow-empty-config)",
                    source.path.display()
                );
                return ExitCode::FAILURE;
            }
            let quota_buckets: usize = loaded.domains.iter().map(|d| d.quota_buckets.len()).sum();
            let quota = match quota_buckets {
                0 => String::new(),
                n => format!(", {n} quota bucket rule(s)"),
            };
            println!(
                "{}: {} domain(s) valid{quota}",
                source.path.display(),
                domains.len()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors {
                println!("{e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// `sluice load`: its report, as text or JSON.
#[tokio::main]
pub async fn load(options: load::Options) -> ExitCode {
    let json = options.json;
    match load::run(options).await {
        Ok(report) if json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).expect("a report serializes")
            );
            ExitCode::SUCCESS
        }
        Ok(report) => {
            print!("{}", report.render());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice load: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice top`.
#[tokio::main(flavor = "current_thread")]
pub async fn top(options: top::Options) -> ExitCode {
    match top::run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice top: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice counters`.
#[tokio::main(flavor = "current_thread")]
pub async fn counters(options: counters::Options) -> ExitCode {
    match counters::run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice counters: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// How long `sluice health` waits for an answer.
const HEALTH_WAIT: Duration = Duration::from_secs(5);

/// `sluice health`: the gRPC health of the service at `endpoint`, printed; success only when
/// it is serving.
#[tokio::main(flavor = "current_thread")]
pub async fn health(endpoint: anyhow::Result<tonic::transport::Endpoint>) -> ExitCode {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let ask = async {
        let channel = endpoint?.connect().await?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest::default())
            .await?;
        anyhow::Ok(reply.into_inner().status())
    };
    match tokio::time::timeout(HEALTH_WAIT, ask).await {
        Ok(Ok(status)) => {
            println!("{}", status.as_str_name());
            if status == ServingStatus::Serving {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Ok(Err(e)) => {
            // Each cause once: the transport's chain repeats some.
            let mut causes: Vec<String> = e.chain().map(ToString::to_string).collect();
            causes.dedup();
            println!("UNREACHABLE: {}", causes.join(": "));
            ExitCode::FAILURE
        }
        Err(_) => {
            println!("UNREACHABLE: no answer within 5 s");
            ExitCode::FAILURE
        }
    }
}
