//! `serve`'s flags, one clap group per concern, each under a heading of its own in `--help`,
//! with its bounds checked beside its fields and the typed values it gives the rest of the
//! program. A new flag goes into the group of its concern.

mod admin;
mod answers;
pub(super) use answers::parse_cluster_name;
mod compat;
mod listen;
mod policy;
mod quota;
mod rules;
mod store;
mod telemetry;
mod tls;
mod top;
mod xds;

use clap::Args;

use crate::service::Addrs;
use admin::AdminFlags;
use answers::AnswerFlags;
use compat::ErlFlags;
use listen::ListenerFlags;
use policy::PolicyFlags;
use quota::QuotaFlags;
use rules::RuleFlags;
use store::StoreFlags;
use telemetry::TelemetryFlags;
use tls::TlsFlags;
use top::TopFlags;

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
    pub top: TopFlags,
    #[command(flatten)]
    pub erl: ErlFlags,
    #[command(flatten)]
    pub admin: AdminFlags,
}

impl ServeArgs {
    /// Rejects flag values no request could be served with, or whose arithmetic could overflow.
    pub fn check(&self) -> anyhow::Result<()> {
        self.rules.check()?;
        self.listen.check()?;
        self.store.check()?;
        self.policy.check()?;
        self.answers.check()?;
        self.quota.check()?;
        self.telemetry.check()?;
        self.top.check()
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

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use clap::CommandFactory;

    use crate::settings::Cli;

    #[test]
    fn every_command_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// A group without a heading of its own would show its flags under the previous group's.
    #[test]
    fn every_group_of_serve_flags_has_a_heading_of_its_own() {
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").expect("serve is a command");
        let mut owners = HashMap::new();
        for group in serve.get_groups() {
            let headings: HashSet<_> = serve
                .get_arguments()
                .filter(|arg| group.get_args().any(|id| id == arg.get_id()))
                .map(|arg| arg.get_help_heading())
                .collect();
            for heading in headings {
                let heading =
                    heading.unwrap_or_else(|| panic!("{} has no heading", group.get_id()));
                let owner = owners.insert(heading, group.get_id());
                assert!(
                    owner.is_none(),
                    "{heading}: {owner:?} and {}",
                    group.get_id()
                );
            }
        }
        let loose: Vec<_> = serve
            .get_arguments()
            .filter(|arg| arg.get_id() != "help" && arg.get_help_heading().is_none())
            .map(|arg| arg.get_id().to_string())
            .collect();
        assert!(loose.is_empty(), "flags without a heading: {loose:?}");
    }
}
