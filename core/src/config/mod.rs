//! Rule files: envoyproxy/ratelimit's YAML format plus sluice's extensions, read from one file or a
//! directory of them, validated into typed `DomainConfig`s. Every problem is reported as
//! `file:line: message`; the caller keeps its previous rules when there is any. The same rules
//! can come over xDS instead (the server's `xds`), validated by the same checks, which it takes
//! from here.

mod file;
mod nesting;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use file::parse_with_clock;
pub use file::{composite, parse};

use crate::limiter::lease::Leasing;
use crate::limiter::{Counting, Limit, Mode, OnExpiry, Scope};

/// The deepest a rule file (or an xDS resource) may nest `descriptors`: deeper than any request
/// can reach under `--max-entries`' default, far from what would strain a stack.
pub const MOST_DESCRIPTOR_DEPTH: usize = 32;
/// The deepest a rule's `metadata` may nest: its answer as dynamic metadata stays well within the
/// 100 levels that protobuf decoders (Envoy's among them) accept.
pub const MOST_METADATA_DEPTH: usize = 16;
/// The longest a rate limit domain may be, in a rule file or a request: far above any domain
/// Envoy's route configuration names, and what keeps the bytes a request's domain makes sluice
/// log, trace and hash small.
pub const MOST_DOMAIN_BYTES: usize = 1024;
/// The most keys a quota bucket rule may match on.
pub const MOST_BUCKET_KEYS: usize = 32;
/// The deepest YAML collections may nest anywhere in a rule file: room for the deepest valid
/// rule (the top mapping, then a `descriptors` list and a rule per level down to
/// `MOST_DESCRIPTOR_DEPTH`, then `metadata` `MOST_METADATA_DEPTH` deep) and no more, so that
/// nothing reading the file's tree recurses deeper than that.
pub(crate) const MOST_YAML_DEPTH: usize = 1 + 2 * MOST_DESCRIPTOR_DEPTH + MOST_METADATA_DEPTH;
/// The default of `--max-config-bytes`: the most bytes the rule files under `--config` may hold
/// together. Loading takes about 45 bytes of memory per byte of rules at its peak (4 MiB: about
/// 230 MB; about 100 for a file of tiny list items), and a Kubernetes ConfigMap holds 1 MiB at
/// most.
pub const DEFAULT_MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// Why a domain of `bytes` bytes is refused, in a rule file or a request.
pub fn domain_too_long(bytes: usize) -> String {
    format!(
        "domain of {bytes} bytes is longer than the most a domain may be ({MOST_DOMAIN_BYTES} bytes)"
    )
}

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
    /// Shared with the rule built from it, and with every rule of the set that has the same.
    pub limits: Arc<[RuleLimit]>,
    pub mode: Mode,
    /// When hits are charged (`counting`), if the rule says; else the service's default.
    pub counting: Option<Counting>,
    /// Whether the rule's counters are leased (`lease`), if it says; else `--lease`.
    pub lease: Option<Leasing>,
    /// Where the rule's counters are counted (`scope`), if it says; else global.
    pub scope: Option<Scope>,
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub metadata: Option<serde_json::Value>,
    /// Its hits held at the request and settled at the response (`hold`), if it says.
    pub hold: Option<HoldRule>,
    /// Its hits weighed by entries of the descriptor (`weights`).
    pub weights: Vec<Weights>,
    pub descriptors: Vec<DescriptorConfig>,
}

/// A rule whose hits are held at the request and settled at the response (`hold`): its own
/// entry's value names the request (an `x-request-id`), and is left out of the counter.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HoldRule {
    /// What a hold takes at least: a request-time call that brings more (an estimate of its
    /// own, from a `max_tokens` header) holds that, up to `largest`.
    pub estimate: u64,
    /// How long a hold lives at most (and a mark of its settle after it), in ms.
    pub ttl_ms: u64,
    pub on_expiry: OnExpiry,
    /// The most holds and marks one counter keeps.
    pub most: u32,
    /// The largest part of the limit one hold takes, in percent: a larger estimate holds that.
    pub largest: u8,
    /// The entry only the response-time call carries, which the route configuration adds and
    /// no client can: a call with it settles.
    pub settle: SettleEntry,
}

/// The entry that marks a settle (`hold.settle`): a key and its value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SettleEntry {
    pub key: String,
    pub value: String,
}

impl HoldRule {
    /// Its settings as a rule file writes them.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "estimate": self.estimate,
            "settle": {"key": self.settle.key, "value": self.settle.value},
            "ttl": humantime::format_duration(std::time::Duration::from_millis(self.ttl_ms))
                .to_string(),
            "on_expiry": self.on_expiry.name(),
            "most": self.most,
            "largest": format!("{}%", self.largest),
        })
    }

    /// How long a hold lives when its rule does not say.
    pub const TTL_MS: u64 = 60_000;
    /// The most holds and marks a counter keeps when its rule does not say.
    pub const MOST: u32 = 10_000;
    /// The longest time to live a rule may give its holds.
    pub const LONGEST_TTL_MS: u64 = 3_600_000;
}

/// A table of weights (`weights`): a call's hits are multiplied by the weight of the value of
/// its entry `key` (a model's name, a kind of token), so that a budget counts money.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Weights {
    pub key: String,
    /// Each value's weight, in thousandths.
    pub values: std::collections::BTreeMap<String, u64>,
    /// The weight of a value not listed, in thousandths; without one, the dearest listed.
    pub default: Option<u64>,
}

impl Weights {
    /// The most weight tables a rule has.
    pub const MOST_TABLES: usize = 4;
    /// The most values one table lists.
    pub const MOST_VALUES: usize = 10_000;
    /// The largest weight, in thousandths.
    pub const LARGEST: u64 = 1_000_000_000;

    /// The weight of `value`, in thousandths.
    pub fn of(&self, value: &[u8]) -> u64 {
        std::str::from_utf8(value)
            .ok()
            .and_then(|v| self.values.get(v))
            .copied()
            .or(self.default)
            .unwrap_or_else(|| self.values.values().copied().max().unwrap_or(1_000))
    }

    /// The table as a rule file writes it.
    pub fn json(&self) -> serde_json::Value {
        let weight = |milli: u64| serde_json::json!(milli as f64 / 1000.0);
        let values: serde_json::Map<String, serde_json::Value> = self
            .values
            .iter()
            .map(|(k, v)| (k.clone(), weight(*v)))
            .collect();
        let mut table = serde_json::json!({"key": self.key, "values": values});
        if let Some(d) = self.default {
            table["default"] = weight(d);
        }
        table
    }
}

/// A limit as a rule declares it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    /// The most bytes the rule files may hold together (`--max-config-bytes`).
    pub max_bytes: u64,
    /// How far the calendars' clock is set from the system's, in ms: 0 but in tests
    /// (`--calendar-clock-offset-ms`).
    pub calendar_offset_ms: i64,
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
    /// The bytes the domains were made from.
    pub sources: Sources,
}

/// What rules were made from, kept with them so that they can be shown as declared (`/config`,
/// `/rlconfig`) without being kept twice: the bytes read, parsed again when shown (a rule file's
/// text or an xDS resource is a fraction of the rules it makes), or the domains themselves when
/// there are no bytes.
#[derive(Debug)]
pub enum Sources {
    /// Each rule file's text.
    Files(Vec<(PathBuf, Box<str>)>),
    /// What a source other than files sent (an xDS response's resources), kept as it came.
    Received(Box<dyn Received>),
    /// Domains made without reading anything.
    Domains(Vec<DomainConfig>),
}

impl Default for Sources {
    fn default() -> Self {
        Sources::Domains(Vec::new())
    }
}

impl Sources {
    /// The domains, as they were when the rules were made: the bytes made valid rules then, so
    /// they do again.
    pub(crate) fn domains(&self) -> Vec<DomainConfig> {
        match self {
            Sources::Files(files) => files
                .iter()
                .filter_map(|(file, text)| parse(file, text).ok())
                .map(|(domain, _)| domain)
                .collect(),
            Sources::Received(received) => received.domains(),
            Sources::Domains(domains) => domains.clone(),
        }
    }
}

/// Rules as a source other than files sent them, which made valid domains when they came and
/// make them again when shown.
pub trait Received: fmt::Debug + Send + Sync {
    fn domains(&self) -> Vec<DomainConfig>;
}

impl Loaded {
    /// The SHA-256 (hex) of every file's name and digest, in order: equal for equal rules.
    pub(crate) fn hash(&self) -> String {
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
pub(crate) fn quota_path(bucket: &[(String, Option<String>)]) -> String {
    let steps: Vec<String> = bucket
        .iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}_{v}"),
            None => k.clone(),
        })
        .collect();
    steps.join(".")
}

/// `bytes` in lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Loads one rule file, or every `.yaml`/`.yml` file directly inside a directory (hidden entries,
/// such as a Kubernetes ConfigMap's `..data`, are skipped; symlinks are followed), in name order.
/// An entry that cannot be read (a directory, a symlink loop or a link to nothing) is an error
/// at line 0, as are files together larger than `max_bytes`, found before they are read.
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
    let mut texts = Vec::new();
    let mut errors = Vec::new();
    let mut total = 0u64;
    for (file, size) in files {
        let read = size.and_then(|size| {
            let budget = source.max_bytes.saturating_sub(total);
            let bytes = read_at_most(&file, size, budget)?;
            total += bytes.len() as u64;
            Ok(bytes)
        });
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(Unread::Cannot(message)) => {
                errors.push(ConfigError {
                    file,
                    line: 0,
                    message,
                });
                continue;
            }
            Err(Unread::TooLarge(size)) => {
                let message = format!(
                    "the rule files come to {} bytes with this one ({size} bytes), more than --max-config-bytes ({})",
                    total.saturating_add(size),
                    source.max_bytes
                );
                errors.push(ConfigError {
                    file,
                    line: 0,
                    message,
                });
                break;
            }
        };
        loaded
            .files
            .push((file.clone(), hex(&Sha256::digest(&bytes))));
        match String::from_utf8(bytes) {
            Ok(text) => match parse_with_clock(&file, &text, source.calendar_offset_ms) {
                Ok((domain, warnings)) => {
                    loaded.warnings.extend(warnings);
                    loaded.domains.push(domain);
                    texts.push((file, text.into_boxed_str()));
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
    // Each file's errors in line order, whichever check found them; the files in the order read.
    let mut order: HashMap<PathBuf, usize> = HashMap::new();
    for e in &errors {
        let next = order.len();
        order.entry(e.file.clone()).or_insert(next);
    }
    errors.sort_by_key(|e| (order[&e.file], e.line));
    loaded.sources = Sources::Files(texts);
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// Why a rule file was not read.
enum Unread {
    /// It cannot be: the reason.
    Cannot(String),
    /// It holds this many bytes (at least), more than the budget left.
    TooLarge(u64),
}

/// The bytes of `file`, `size` bytes by its metadata, if it holds no more than `budget`: a file
/// found larger (by its metadata, or growing while read) is not read past the budget.
fn read_at_most(file: &Path, size: u64, budget: u64) -> Result<Vec<u8>, Unread> {
    use std::io::Read;
    if size > budget {
        return Err(Unread::TooLarge(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    std::fs::File::open(file)
        .and_then(|f| f.take(budget.saturating_add(1)).read_to_end(&mut bytes))
        .map_err(|e| Unread::Cannot(format!("cannot read: {e}")))?;
    if bytes.len() as u64 > budget {
        return Err(Unread::TooLarge(bytes.len() as u64));
    }
    Ok(bytes)
}

/// A domain declared twice: an error, unless `merge_domains`, which joins them unless they
/// define the same top-level rule. Merged files join at the top of the domain's tree, as
/// envoyproxy/ratelimit joins them: a rule defined twice is an error even when the two would
/// nest different rules.
pub fn domain_collisions(domains: &[DomainConfig], merge_domains: bool) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    // Each domain's top-level rules (key, value), from the files read so far.
    let mut seen: HashMap<&str, HashSet<(&str, Option<&str>)>> = HashMap::new();
    for d in domains {
        let rules = d
            .descriptors
            .iter()
            .map(|rule| (rule.key.as_str(), rule.value.as_deref()));
        let Some(earlier) = seen.get_mut(d.domain.as_str()) else {
            let rules = if merge_domains {
                rules.collect()
            } else {
                HashSet::new()
            };
            seen.insert(&d.domain, rules);
            continue;
        };
        if !merge_domains {
            errors.push(ConfigError {
                file: d.file.clone(),
                line: d.line,
                message: format!("duplicate domain '{}' in config file", d.domain),
            });
            continue;
        }
        for rule in &d.descriptors {
            if earlier.contains(&(rule.key.as_str(), rule.value.as_deref())) {
                errors.push(ConfigError {
                    file: d.file.clone(),
                    line: rule.line,
                    message: format!(
                        "duplicate descriptor composite key '{}.{}'",
                        d.domain,
                        file::composite(&rule.key, rule.value.as_deref())
                    ),
                });
            }
        }
        earlier.extend(rules);
    }
    errors
}

/// A rule file found, with its size or why it cannot be read.
type Found = (PathBuf, Result<u64, Unread>);

/// The rule files under `path`: itself, or each `.yaml`/`.yml` entry directly inside the
/// directory, in name order.
fn rule_files(path: &Path) -> Result<Vec<Found>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_dir() {
        // Whatever it is (a pipe, say): read, within the budget.
        return Ok(vec![(path.to_path_buf(), Ok(meta.len()))]);
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
        let size = match std::fs::metadata(&file) {
            Ok(m) if m.is_file() => Ok(m.len()),
            Ok(m) if m.is_dir() => Err(Unread::Cannot("not a file: a directory".into())),
            Ok(_) => Err(Unread::Cannot("not a file".into())),
            Err(e) => Err(Unread::Cannot(format!("cannot read: {e}"))),
        };
        files.push((file, size));
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Past mimalloc's delay (10 ms) before it returns freed pages to the system.
const PURGE_DELAY: std::time::Duration = std::time::Duration::from_millis(50);

/// Runs `work` (loading rules, building them, putting them in force) on a thread of its own that
/// ends with it: the allocator keeps what a thread freed until that thread allocates again, so a
/// pooled thread left idle after a reload would keep a third more than the rules hold.
/// An error when the work panicked or no thread could be started.
pub async fn on_own_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sluice-rules".into())
        .spawn(move || {
            let _ = done.send(work());
            // The allocator returns freed pages `PURGE_DELAY` after they were freed, when
            // their thread next looks: ending sooner would leave them held.
            std::thread::sleep(PURGE_DELAY);
        })
        .map_err(|e| format!("no thread to load rules on: {e}"))?;
    result.await.map_err(|_| "it panicked".to_owned())
}
