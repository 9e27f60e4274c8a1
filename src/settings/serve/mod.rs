//! `serve`'s flags, one clap group per concern, each under a heading of its own in `--help`,
//! with its bounds checked beside its fields and the typed values it gives the rest of the
//! program. A new flag goes into the group of its concern.

mod answers;
mod compat;
mod listen;
mod policy;
mod quota;
mod rules;
mod store;
mod telemetry;
mod tls;
mod xds;

use clap::Args;

use crate::service::Addrs;

pub use answers::AnswerFlags;
pub use compat::ErlFlags;
pub use listen::ListenerFlags;
pub use policy::PolicyFlags;
pub use quota::QuotaFlags;
pub use rules::RuleFlags;
pub use store::StoreFlags;
pub use telemetry::TelemetryFlags;
pub use tls::TlsFlags;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub rules: RuleFlags,
    #[command(flatten)]
    pub listen: ListenerFlags,
    #[command(flatten)]
    pub tls: TlsFlags,
    #[command(flatten)]
    pub store: StoreFlags,
    #[command(flatten)]
    pub policy: PolicyFlags,
    #[command(flatten)]
    pub answers: AnswerFlags,
    #[command(flatten)]
    pub quota: QuotaFlags,
    #[command(flatten)]
    pub telemetry: TelemetryFlags,
    #[command(flatten)]
    pub erl: ErlFlags,
}

impl ServeArgs {
    /// Rejects flag values no request could be served with, or whose arithmetic could overflow.
    pub fn check(&self) -> anyhow::Result<()> {
        self.rules.check()?;
        self.listen.check()?;
        self.store.check()?;
        self.policy.check()?;
        self.answers.check()?;
        self.quota.check()
    }

    /// Every address served: the listeners', the metrics' own, envoyproxy/ratelimit's debug port.
    pub fn addrs(&self) -> Addrs {
        self.listen
            .addrs(self.telemetry.metrics_at(), self.erl.debug_addr())
    }
}

/// A count that must not be 0.
fn at_least_one(flag: &str, value: usize) -> anyhow::Result<()> {
    if value == 0 {
        anyhow::bail!("{flag}: must be at least 1");
    }
    Ok(())
}
