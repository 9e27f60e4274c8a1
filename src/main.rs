//! The `sluice` command: `serve` runs the service, `explain` shows how rules match a request, and
//! the client commands (`check-config`, `load`, `health`, `top`, `counters`) are in `cli`. Run as
//! `ratelimit` (a link named so), it serves as envoyproxy/ratelimit does, from that project's
//! environment variables. The flags of each are in `settings`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use sluice::cli;
use sluice::quota::Quotas;
use sluice::service::{self, Setup, Shutdown, reload};
use sluice::settings::{self, Command, ExplainArgs, ServeArgs, erl};
use sluice::telemetry::traces::Traces;
use sluice::telemetry::{self, Telemetry, statsd};
use sluice_core::config;
use sluice_core::rules::RuleSet;

/// mimalloc: measurably less CPU per request than the system allocator on the request path, and
/// less memory held for the embedded store's many small counters.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let (cli, translation) = match settings::parse() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("{}: {message}", erl::COMMAND);
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::CheckConfig(args) => cli::check_config(&args.source()),
        Command::Health(args) => cli::health(args.endpoint()),
        Command::Explain(args) => explain(&args),
        Command::Load(options) => cli::load(options),
        Command::Top(options) => cli::top(options),
        Command::Counters(options) => cli::counters(*options),
        Command::Serve(args) => {
            let telemetry = Telemetry::new();
            let traces = args
                .telemetry
                .tracing()
                .map(|t| Traces::start(&t, &telemetry));
            let (traces, tracer, failed) = match traces {
                Some(Ok((traces, tracer))) => (Some(traces), Some(tracer), None),
                Some(Err(e)) => (None, None, Some(e)),
                None => (None, None, None),
            };
            telemetry::init(
                args.telemetry.log_format(),
                args.telemetry.log_level(),
                tracer,
            );
            if let Some(e) = failed {
                tracing::error!("tracing: {e:#}");
                return ExitCode::FAILURE;
            }
            if let Some(t) = &translation {
                for unhonoured in &t.unhonoured {
                    tracing::warn!("{unhonoured}");
                }
                for note in &t.notes {
                    tracing::warn!("{note}");
                }
            }
            // As `ratelimit`, a value out of bounds names the variable it came from.
            let checked = args.check().map_err(|e| match &translation {
                Some(t) => anyhow::anyhow!(t.blame(&format!("{e:#}"))),
                None => e,
            });
            let served = checked.and_then(|()| serve(*args, telemetry));
            if let Some(traces) = traces {
                traces.flush(TRACES_LAST_FLUSH);
            }
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Exit status of `explain` for a request it cannot read (as clap's for a malformed argument).
const MALFORMED_REQUEST: u8 = 2;
/// How long the statsd push has, once serving ends, to send what the drain counted.
const STATSD_LAST_FLUSH: Duration = Duration::from_secs(1);
/// How long the spans still queued at exit may take to reach the collector.
const TRACES_LAST_FLUSH: Duration = Duration::from_secs(1);

fn explain(args: &ExplainArgs) -> ExitCode {
    let request = args.request();
    let loaded = match config::load(&args.source()) {
        Ok(loaded) => loaded,
        Err(errors) => {
            for e in &errors {
                eprintln!("{e}");
            }
            return ExitCode::FAILURE;
        }
    };
    let rules = RuleSet::from_loaded(loaded, false, sluice_core::observe::unobserved());
    let explained = request.and_then(|request| {
        let (bounds, answering) = (args.bounds(), args.answering());
        let prefix = Some(args.redis_key_prefix());
        service::explain::explain(&rules, &request, &bounds, &answering, prefix)
            .map_err(|m| format!("{m}\n"))
    });
    match explained {
        Ok(explanation) if args.json() => {
            print!("{}", explanation.to_json());
            ExitCode::SUCCESS
        }
        Ok(explanation) => {
            print!("{}", explanation.render());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprint!("sluice explain: {message}");
            ExitCode::from(MALFORMED_REQUEST)
        }
    }
}

/// The main thread runs the listener, the admin HTTP server and the embedded store's sweeper; the
/// gRPC event loops run on threads of their own (see `service`).
fn serve(args: ServeArgs, telemetry: Telemetry) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args, telemetry))
}

/// Rules, then the store they are counted in, then the service that answers from both.
async fn run(args: ServeArgs, telemetry: Telemetry) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Before anything else: from here on a SIGHUP reloads instead of ending the process.
    let hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    if let Some(mapper) = args.erl.mapper()? {
        telemetry.use_mapper(mapper);
    }
    let top_view = args.top.settings().map(|settings| {
        let told = format!(
            "top view: {} counters per rule and slot, {} rules apart, at most {} MiB",
            settings.capacity,
            settings.rules,
            settings.most_bytes().div_ceil(1 << 20)
        );
        telemetry.start_top(settings);
        told
    });
    args.rules.set_clock_skew();
    let backend = args.store.backend(Arc::new(telemetry.clone()))?;
    let quotas = Quotas::start(args.quota.settings(), &backend, telemetry.clone())?;
    let setup = Setup {
        rules: reload::start(args.rules.feed()?, hangup, telemetry.clone())?,
        backend,
        cache: args.store.cache(),
        leases: Arc::new(args.answers.leases()),
        bounds: args.policy.bounds(),
        fallback: args.policy.fallback(),
        answering: args.answers.answering(),
        edges: args.listen.edges(),
        tls: args.tls.server_tls()?,
        healthcheck: args.erl.healthcheck(),
        quotas,
        telemetry: telemetry.clone(),
        admin: args.admin.access(args.addrs().json, telemetry.clone())?,
    };
    // Once the start has gone well so far: a failed one logs its error alone.
    if let Some(told) = top_view {
        tracing::info!("{told}");
    }
    let shutdown = on_signal(args.listen.shutdown_grace());
    let statsd = args.telemetry.statsd().map(|settings| {
        let stop = shutdown.clone().wait();
        tokio::spawn(statsd::push(settings, telemetry.clone(), stop))
    });
    let served = service::run(setup, args.addrs(), args.listen.loops(), shutdown)
        .await
        .context("serving");
    if let Some(statsd) = statsd {
        // The last flush, with what the drain counted.
        let _ = tokio::time::timeout(STATSD_LAST_FLUSH, statsd).await;
    }
    tracing::info!("stopped");
    served
}

/// Fires on SIGTERM or Ctrl-C: not ready, not accepting, draining in-flight calls; the process
/// ends within `grace`, drained or not.
fn on_signal(grace: Duration) -> Shutdown {
    use tokio::signal::unix::{SignalKind, signal};
    let (stop, shutdown) = Shutdown::new();
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!(
            "shutting down: not ready, not accepting, draining in-flight calls (at most {})",
            humantime::format_duration(grace)
        );
        let _ = stop.send(true);
        std::thread::spawn(move || {
            std::thread::sleep(grace);
            tracing::warn!("in-flight calls still running after --shutdown-grace: exiting");
            std::process::exit(0);
        });
    });
    shutdown
}
