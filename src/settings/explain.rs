//! `explain`'s arguments: the rule files, the request (from flags, a JSON file or standard
//! input), and the `serve` flags that change what a request's answer would be.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::service::explain::Request;
use crate::service::rls::{Answering, Bounds};
use sluice_core::config;
use sluice_core::limiter::{Counting, LONGEST_WINDOW_SECONDS};

#[derive(Args)]
pub struct ExplainArgs {
    /// A rule file, or a directory of them (one domain per file).
    path: PathBuf,
    /// The request's domain.
    #[arg(long, required_unless_present = "request")]
    domain: Option<String>,
    /// One request descriptor as key=value[,key=value…] (each entry split at its first `=`);
    /// repeat for several descriptors, in order.
    #[arg(long = "descriptor", value_parser = crate::cli::parse_descriptor, requires = "domain")]
    descriptors: Vec<Vec<(String, String)>>,
    /// The request as protobuf JSON, as `/json` takes it: a file, or `-` for standard input.
    #[arg(long, conflicts_with_all = ["domain", "descriptors"])]
    request: Option<PathBuf>,
    /// Prefix of the Redis keys shown.
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// Explain as `serve --merge-domains` loads the rules.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS")]
    merge_domains: bool,
    /// The most bytes the rule files may hold together, as `serve --max-config-bytes`.
    #[arg(long, env = "SLUICE_MAX_CONFIG_BYTES", default_value_t = config::DEFAULT_MAX_CONFIG_BYTES)]
    max_config_bytes: u64,
    /// Explain as `serve --quota-mode` answers.
    #[arg(long, env = "SLUICE_QUOTA_MODE")]
    quota_mode: bool,
    /// Explain as `serve --counting` counts rules that do not say.
    #[arg(long, env = "SLUICE_COUNTING", value_parser = super::counting(), default_value = "admitted")]
    counting: Counting,
    /// Explain as a replica of `serve --cluster-name` counts: the keys of `scope: cluster`
    /// rules carry the name.
    #[arg(long, env = "SLUICE_CLUSTER_NAME", value_parser = super::serve::parse_cluster_name)]
    cluster_name: Option<String>,
    /// Print the explanation as JSON (as `POST /explain` answers) instead of a text tree.
    #[arg(long)]
    json: bool,
}

impl ExplainArgs {
    /// The rule files to explain with.
    pub fn source(&self) -> config::Source {
        config::Source {
            path: self.path.clone(),
            merge_domains: self.merge_domains,
            max_bytes: self.max_config_bytes,
            calendar_offset_ms: 0,
        }
    }

    /// The request to explain, from the flags or read from `--request`; else why it cannot be
    /// read, as a line to print.
    pub fn request(&self) -> Result<Request, String> {
        let Some(path) = &self.request else {
            let domain = self.domain.as_deref().unwrap_or_default();
            return Ok(Request::new(domain, &self.descriptors));
        };
        let mut body = Vec::new();
        let read = if path.as_os_str() == "-" {
            std::io::stdin().read_to_end(&mut body).map(drop)
        } else {
            std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut body).map(drop))
        };
        read.map_err(|e| format!("--request {}: {e}\n", path.display()))
            .and_then(|()| Request::from_json(&body))
    }

    /// Explaining is not serving: no --max-* bound applies.
    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_descriptors: usize::MAX,
            max_entries: usize::MAX,
            max_schedule_ahead: Duration::from_secs(LONGEST_WINDOW_SECONDS),
        }
    }

    pub fn answering(&self) -> Answering {
        Answering {
            quota_mode: self.quota_mode,
            counting: self.counting,
            cluster_name: self.cluster_name.clone(),
            ..Answering::default()
        }
    }

    pub fn redis_key_prefix(&self) -> &str {
        &self.redis_key_prefix
    }

    /// Print JSON rather than a text tree.
    pub fn json(&self) -> bool {
        self.json
    }
}
