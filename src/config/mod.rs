//! Rule files: envoyproxy/ratelimit's YAML format plus sluice's extensions, read from one file or a
//! directory of them, validated into typed `DomainConfig`s. Every problem is reported as
//! `file:line: message`; the caller keeps its previous rules when there is any. The same rules
//! can come over xDS instead (`xds`), validated the same way.

mod file;
pub mod xds;

use std::fmt;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use file::parse;

use crate::limiter::{Counting, Limit, Mode};

/// The deepest a rule file (or an xDS resource) may nest `descriptors`: deeper than any request
/// can reach under `--max-entries`' default, far from what would strain a stack.
pub const MOST_DESCRIPTOR_DEPTH: usize = 32;
/// The deepest a rule's `metadata` may nest: its answer as dynamic metadata stays well within the
/// 100 levels that protobuf decoders (Envoy's among them) accept.
pub const MOST_METADATA_DEPTH: usize = 16;
/// The most keys a quota bucket rule may match on.
pub const MOST_BUCKET_KEYS: usize = 32;

/// One domain, as one rule file declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct DomainConfig {
    pub file: PathBuf,
    /// The line of the `domain` key.
    pub line: usize,
    pub domain: String,
    pub descriptors: Vec<DescriptorConfig>,
    /// The quota bucket rules of the Rate Limit Quota Service (`quota_buckets`).
    pub quota_buckets: Vec<QuotaBucketConfig>,
}

/// A quota bucket rule: the bucket ids it matches and the global limit each of them gets, shared
/// out among the Envoys that report it.
#[derive(Clone, Debug, PartialEq)]
pub struct QuotaBucketConfig {
    pub line: usize,
    /// The bucket id's keys, sorted, each with the value to match: `None` matches any value; `*`
    /// in it matches any run of bytes.
    pub bucket: Vec<(String, Option<String>)>,
    /// `None` for `unlimited: true`.
    pub limit: Option<Limit>,
    /// Answer "allow all" and record what the limit would have denied.
    pub shadow: bool,
}

/// One node of a domain's descriptor tree.
#[derive(Clone, Debug, PartialEq)]
pub struct DescriptorConfig {
    pub line: usize,
    pub key: String,
    /// The value to match: `None` matches any value; `*` in it matches any run of bytes.
    pub value: Option<String>,
    pub limits: Vec<RuleLimit>,
    pub mode: Mode,
    /// When hits are charged (`counting`), if the rule says; else the service's default.
    pub counting: Option<Counting>,
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub metadata: Option<serde_json::Value>,
    pub descriptors: Vec<DescriptorConfig>,
}

/// A limit as a rule declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleLimit {
    pub name: String,
    pub replaces: Vec<String>,
    /// `None` for `unlimited: true`.
    pub limit: Option<Limit>,
}

/// Where the rules are read from, and how.
#[derive(Clone, Debug)]
pub struct Source {
    /// A rule file, or a directory of them.
    pub path: PathBuf,
    /// One domain may span several files (`--merge-domains`, envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`); else a domain declared twice is an error.
    pub merge_domains: bool,
}

/// A problem found in a rule file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
    }
}

/// What loading rule files produced: the domains when there is no error, and warnings (keys that
/// envoyproxy/ratelimit accepts but ignores where they stand) either way.
#[derive(Debug, Default)]
pub struct Loaded {
    pub domains: Vec<DomainConfig>,
    pub warnings: Vec<ConfigError>,
    /// Every file read, with the SHA-256 of its bytes (hex).
    pub files: Vec<(PathBuf, String)>,
}

impl Loaded {
    /// The SHA-256 (hex) of every file's name and digest, in order: equal for equal rules.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (file, digest) in &self.files {
            h.update(file.to_string_lossy().as_bytes());
            h.update([0]);
            h.update(digest.as_bytes());
            h.update([0]);
        }
        hex(&h.finalize())
    }
}

/// A quota bucket rule's name in metrics and dumps: its sorted keys as `key_value` (or `key`
/// alone for any value) joined by dots.
pub fn quota_path(bucket: &[(String, Option<String>)]) -> String {
    let steps: Vec<String> = bucket
        .iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}_{v}"),
            None => k.clone(),
        })
        .collect();
    steps.join(".")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Loads one rule file, or every `.yaml`/`.yml` file directly inside a directory (hidden entries,
/// such as a Kubernetes ConfigMap's `..data`, are skipped; symlinks are followed), in name order.
pub fn load(source: &Source) -> Result<Loaded, Vec<ConfigError>> {
    let path = source.path.as_path();
    let files = rule_files(path).map_err(|message| {
        vec![ConfigError {
            file: path.to_path_buf(),
            line: 0,
            message,
        }]
    })?;
    let mut loaded = Loaded::default();
    let mut errors = Vec::new();
    for file in files {
        let text = std::fs::read(&file).and_then(|bytes| {
            loaded
                .files
                .push((file.clone(), hex(&Sha256::digest(&bytes))));
            String::from_utf8(bytes)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        });
        match text {
            Ok(text) => match parse(&file, &text) {
                Ok((domain, warnings)) => {
                    loaded.warnings.extend(warnings);
                    loaded.domains.push(domain);
                }
                Err(mut e) => errors.append(&mut e),
            },
            Err(e) => errors.push(ConfigError {
                file,
                line: 0,
                message: format!("cannot read: {e}"),
            }),
        }
    }
    errors.extend(domain_collisions(&loaded.domains, source.merge_domains));
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// A domain declared twice: an error, unless `merge_domains`, which joins them unless they
/// define the same top-level rule.
fn domain_collisions(domains: &[DomainConfig], merge_domains: bool) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    for (i, d) in domains.iter().enumerate() {
        let earlier: Vec<_> = domains[..i]
            .iter()
            .filter(|o| o.domain == d.domain)
            .collect();
        if earlier.is_empty() {
            continue;
        }
        if merge_domains {
            errors.extend(merge_collisions(d, &earlier));
        } else {
            errors.push(ConfigError {
                file: d.file.clone(),
                line: d.line,
                message: format!("duplicate domain '{}' in config file", d.domain),
            });
        }
    }
    errors
}

/// The top-level rules of `d` that files read before it already define for its domain. Merged
/// files join at the top of the domain's tree, as envoyproxy/ratelimit joins them: a rule
/// defined twice is an error even when the two would nest different rules.
fn merge_collisions(d: &DomainConfig, earlier: &[&DomainConfig]) -> Vec<ConfigError> {
    d.descriptors
        .iter()
        .filter(|rule| {
            earlier
                .iter()
                .flat_map(|o| &o.descriptors)
                .any(|o| o.key == rule.key && o.value == rule.value)
        })
        .map(|rule| ConfigError {
            file: d.file.clone(),
            line: rule.line,
            message: format!(
                "duplicate descriptor composite key '{}.{}'",
                d.domain,
                file::composite(&rule.key, rule.value.as_deref())
            ),
        })
        .collect()
}

fn rule_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| format!("cannot list: {e}"))? {
        let entry = entry.map_err(|e| format!("cannot list: {e}"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_rules = name.ends_with(".yaml") || name.ends_with(".yml");
        if name.starts_with('.') || !is_rules {
            continue;
        }
        let file = entry.path();
        if std::fs::metadata(&file)
            .map(|m| m.is_file())
            .unwrap_or(false)
        {
            files.push(file);
        }
    }
    files.sort();
    Ok(files)
}
