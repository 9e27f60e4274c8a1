//! What a limit is and how a request is decided, with no store in sight: `Limit` and its
//! `Algorithm`, the `Check` that gathers every counter a request touches, the all-or-nothing rule
//! that turns what a store found into one `Decision`, and the over-limit cache's rules.

pub mod algorithm;
mod cache;
pub mod calendar;
pub mod hold;
mod key;
pub mod lease;
pub mod outcome;
pub mod share;

use std::time::Duration;

pub use algorithm::Algorithm;
pub use cache::OverLimitCache;
pub use calendar::Calendar;
pub use hold::{HoldAsk, HoldId, OnExpiry};
pub use key::{CounterIds, CounterKey, DescriptorKey, IdHasher, LONGEST_LITERAL, RuleId};

/// The time unit of a limit. Months are 30 days and years 365 days, as envoyproxy/ratelimit has it,
/// unless the limit is on the calendar (`calendar`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// Parses a rule-file unit, case-insensitively as envoyproxy/ratelimit does.
    pub fn parse(name: &str) -> Option<Unit> {
        Some(match name.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// One limit: so many requests per window, counted by an algorithm.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    pub name: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub unit_multiplier: u32,
    pub algorithm: Algorithm,
    /// What a bucket holds at most (`token_bucket`, `leaky_bucket`); `requests_per_unit`
    /// unless a rule says otherwise, and unused by other algorithms.
    pub burst: u32,
    /// The calendar its windows follow (a `fixed_window` of a day, week, month or year), or
    /// none: windows of the unit's length aligned to the Unix epoch.
    pub calendar: Option<Calendar>,
}

/// The longest window a limit may have (`unit` × `unit_multiplier`): ten years, which keeps every
/// window and expiry far inside the ranges both stores compute in.
pub const LONGEST_WINDOW_SECONDS: u64 = 10 * 365 * 86_400;

impl Limit {
    /// The window in ms; rule files and overrides keep it within `LONGEST_WINDOW_SECONDS`.
    pub fn window_ms(&self) -> u64 {
        self.unit.seconds() * 1000 * u64::from(self.unit_multiplier)
    }

    /// The calendar window holding `at_ms`, for a limit on the calendar.
    pub fn calendar_span(&self, at_ms: u64) -> Option<calendar::Span> {
        self.calendar.as_ref().map(|c| c.span(self.unit, at_ms))
    }

    /// What names the window holding `at_ms` among the limit's windows: its index from the
    /// Unix epoch (`at_ms / window`), or a calendar window's start.
    pub fn window_at(&self, at_ms: u64) -> u64 {
        match self.calendar_span(at_ms) {
            Some(span) => span.start,
            None => at_ms / self.window_ms(),
        }
    }

    /// When the span began whose hits still weigh on a decision at `at_ms`: the window's start
    /// for a fixed (or calendar) window, the previous window's for a sliding window, a window
    /// back for a sliding log, and for a bucket the time it takes to refill (drain) from full.
    pub fn counted_since(&self, at_ms: u64) -> u64 {
        let window = self.window_ms();
        if let Some(span) = self.calendar_span(at_ms) {
            return span.start;
        }
        let back = match self.algorithm {
            Algorithm::FixedWindow => at_ms % window,
            Algorithm::SlidingWindow => at_ms % window + window,
            Algorithm::SlidingLog => window,
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                let rate = u64::from(self.requests_per_unit.max(1));
                window.saturating_mul(u64::from(self.burst)).div_ceil(rate)
            }
        };
        at_ms.saturating_sub(back)
    }

    /// Whether a request may name the instant it counts at: `fixed_window` and `sliding_log`,
    /// off the calendar.
    pub fn schedulable(&self) -> bool {
        self.algorithm.schedulable() && self.calendar.is_none()
    }

    /// The most hits the counter can hold at once: a bucket's `burst`, else the limit.
    pub fn capacity(&self) -> u32 {
        if self.algorithm.is_bucket() {
            self.burst
        } else {
            self.requests_per_unit
        }
    }
}

/// How a limit takes part in the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Over the limit denies the request.
    Enforce,
    /// Counted and reported, never denies.
    Shadow,
    /// Denies only when every quota limit of the request is over (envoyproxy/ratelimit's
    /// `quota_mode`).
    Quota,
    /// Both `shadow_mode` and `quota_mode`, as envoyproxy/ratelimit takes them: reported as in
    /// shadow mode, and counted among the request's quota limits as one that is never over, so
    /// that the quota limits of a request holding it never deny.
    ShadowQuota,
}

impl Mode {
    /// Never denies, and is reported as never over.
    pub fn is_shadow(self) -> bool {
        matches!(self, Mode::Shadow | Mode::ShadowQuota)
    }

    /// The mode under global quota mode (`--quota-mode`), where every limit is a quota limit.
    pub(crate) fn as_quota(self) -> Mode {
        match self {
            Mode::Enforce | Mode::Quota => Mode::Quota,
            Mode::Shadow | Mode::ShadowQuota => Mode::ShadowQuota,
        }
    }
}

/// When a request's hits are charged to a limit's counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Counting {
    /// Only when the whole request is admitted, and only if they fit: a check-only request is
    /// over when not one more hit fits (sluice's all-or-nothing admission).
    #[default]
    Admitted,
    /// Always, admitted or not, fitting or not (a charge past the limit is debt that the window
    /// or the bucket's drain must clear), and a request is over when the count, its hits added,
    /// is above the limit: a check-only request at the limit is not over (envoyproxy/ratelimit's
    /// counting, which response-phase costs such as LLM token budgets rely on).
    Always,
}

impl Counting {
    pub fn parse(name: &str) -> Option<Counting> {
        match name {
            "admitted" => Some(Counting::Admitted),
            "always" => Some(Counting::Always),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Counting::Admitted => "admitted",
            Counting::Always => "always",
        }
    }
}

/// Where a rule's counters are counted (`scope`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scope {
    /// One counter in the store, shared by every replica.
    #[default]
    Global,
    /// One counter in the store per cluster (`--cluster-name`), shared by its replicas.
    Cluster,
    /// One counter per replica, in its own memory: no store call.
    Replica,
    /// One counter per replica, in its own memory, each holding its share of the limit: the
    /// limit divided among the replicas live now.
    Split,
}

impl Scope {
    pub fn parse(name: &str) -> Option<Scope> {
        match name {
            "global" => Some(Scope::Global),
            "cluster" => Some(Scope::Cluster),
            "replica" => Some(Scope::Replica),
            "split" => Some(Scope::Split),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Cluster => "cluster",
            Scope::Replica => "replica",
            Scope::Split => "split",
        }
    }

    /// Counted in the replica's own memory, never in the shared store.
    pub fn is_local(self) -> bool {
        matches!(self, Scope::Replica | Scope::Split)
    }
}

/// One counter a request touches.
#[derive(Clone, Debug)]
pub struct Item {
    pub key: CounterKey,
    /// The rule the counter belongs to, whose share of the embedded store it takes.
    pub rule: RuleId,
    pub limit: Limit,
    pub mode: Mode,
    /// Hits to add when the request is admitted; 0 checks without consuming.
    pub hits: u64,
    /// Give `hits` back instead of consuming them.
    pub refund: bool,
    pub counting: Counting,
    /// The rule lets a replica decide this counter from a leased block (`lease: auto`).
    pub leased: bool,
    /// Where the counter is counted.
    pub scope: Scope,
    /// What the item does to its counter: a request's hits, or a lease's block taken or given
    /// back.
    pub step: ItemStep,
}

/// What an item does to its counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ItemStep {
    /// A request's own hits: all of them or none (given back, with `refund`).
    #[default]
    Hits,
    /// A lease's block: as many of `hits` as fit in a share of what remains (`lease::SHARE`),
    /// and at least `least`; over when `least` do not fit.
    Take { least: u64 },
    /// Gives `hits` of a block back (with `refund`), in window `window` only: a block taken in
    /// a window that is over was counted there, and giving it back now would free what the
    /// window now counting never held.
    Return { window: u64 },
    /// A held rule's item (`hold`): holds an estimate for a request, or settles its hold at
    /// `hits` (see `hold`).
    Held(HoldAsk),
}

/// Every counter of one request, decided together.
#[derive(Clone, Debug, Default)]
pub struct Check {
    pub items: Vec<Item>,
    /// The instant the request counts at (ms since the Unix epoch), when it names one: only
    /// `fixed_window` and `sliding_log` limits take it, an instant already past counts as the
    /// store's now, and the service takes none more than `--max-schedule-ahead` ahead.
    pub at: Option<u64>,
    /// A descriptor outside the check counts as a quota limit that is never over, so the quota
    /// limits of the check never deny (envoyproxy/ratelimit's global quota mode counts a
    /// descriptor without a limit so).
    pub quota_passes: bool,
}

/// What the store found for one item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// This item alone would exceed its limit.
    pub over: bool,
    /// Requests left in the window after this request (0 when over).
    pub remaining: u64,
    /// Requests left before this request's hits (0 once the count has reached the limit):
    /// where a charge that lands over the limit started from.
    pub left_before: u64,
    /// Time until the counter frees up: the end of the window, or when one more hit fits.
    pub reset: Duration,
    /// Not one more hit fits until `reset`.
    pub full: bool,
    pub source: Source,
    /// The window it counted in, for the window algorithms (`Verdict::window`).
    pub window: u64,
    /// What a held counter's item did (`hold`).
    pub hold: Option<outcome::HoldSeen>,
}

/// Where a `Usage` comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The store evaluated the counter.
    Store,
    /// The local over-limit cache knew the counter full.
    LocalCache,
    /// A block this replica leased from the store.
    Lease,
    /// Nobody looked: another counter denied the request from the local cache.
    Unknown,
}

impl Usage {
    /// The usage of a counter nobody looked at.
    pub fn unknown() -> Self {
        Usage {
            over: false,
            remaining: 0,
            left_before: 0,
            reset: Duration::ZERO,
            full: false,
            source: Source::Unknown,
            window: 0,
            hold: None,
        }
    }
}

/// The all-or-nothing verdict over a whole check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub admitted: bool,
    pub usages: Vec<Usage>,
}

impl Decision {
    /// What a store's `verdicts` on the items of `check` report, the request `admitted` or not.
    pub(crate) fn of(check: &Check, admitted: bool, verdicts: &[algorithm::Verdict]) -> Decision {
        // A counter counted `always` was charged either way: it reports what it holds now.
        let usages = verdicts
            .iter()
            .zip(&check.items)
            .map(|(v, item)| {
                let charged = admitted || item.counting == Counting::Always;
                v.usage(charged, item.limit.algorithm, item.hits)
            })
            .collect();
        Decision { admitted, usages }
    }
}

/// Whether `check` is admitted given which of its items are over: any enforced limit over, or
/// every quota limit over, denies. The Lua scripts implement the same rule.
pub fn admits(check: &Check, over: impl Fn(usize) -> bool) -> bool {
    let mut quotas = usize::from(check.quota_passes);
    let mut quotas_over = 0;
    for (i, item) in check.items.iter().enumerate() {
        match item.mode {
            Mode::Enforce if over(i) => return false,
            Mode::Quota => {
                quotas += 1;
                if over(i) {
                    quotas_over += 1;
                }
            }
            Mode::ShadowQuota => quotas += 1,
            Mode::Enforce | Mode::Shadow => {}
        }
    }
    quotas == 0 || quotas_over < quotas
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(mode: Mode) -> Item {
        Item {
            key: DescriptorKey::new(b"d", &[(b"k", b"v")]).counter("l"),
            rule: RuleId::default(),
            limit: Limit {
                name: String::new(),
                requests_per_unit: 1,
                unit: Unit::Second,
                unit_multiplier: 1,
                algorithm: Algorithm::FixedWindow,
                burst: 1,
                calendar: None,
            },
            mode,
            hits: 1,
            refund: false,
            counting: Counting::Admitted,
            leased: false,
            scope: Scope::Global,
            step: ItemStep::Hits,
        }
    }

    fn check(items: Vec<Item>) -> Check {
        Check {
            items,
            ..Check::default()
        }
    }

    #[test]
    fn an_enforced_limit_over_denies() {
        let both = check(vec![item(Mode::Enforce), item(Mode::Enforce)]);
        assert!(!admits(&both, |i| i == 1));
        assert!(admits(&both, |_| false));
    }

    #[test]
    fn a_shadow_limit_over_never_denies() {
        let both = check(vec![item(Mode::Shadow), item(Mode::Enforce)]);
        assert!(admits(&both, |i| i == 0));
    }

    #[test]
    fn quota_limits_deny_only_when_all_are_over() {
        let both = check(vec![item(Mode::Quota), item(Mode::Quota)]);
        assert!(admits(&both, |i| i == 0));
        assert!(!admits(&both, |_| true));
    }

    #[test]
    fn a_shadow_quota_limit_keeps_the_quota_limits_from_denying() {
        let both = check(vec![item(Mode::Quota), item(Mode::ShadowQuota)]);
        assert!(admits(&both, |_| true));
        let alone = check(vec![item(Mode::ShadowQuota)]);
        assert!(admits(&alone, |_| true));
    }

    #[test]
    fn a_descriptor_that_passes_as_a_quota_keeps_the_quota_limits_from_denying() {
        let mut quota = check(vec![item(Mode::Quota)]);
        assert!(!admits(&quota, |_| true));
        quota.quota_passes = true;
        assert!(admits(&quota, |_| true));
        quota.items[0].mode = Mode::Enforce;
        assert!(!admits(&quota, |_| true), "an enforced limit still denies");
    }

    #[test]
    fn units_have_envoy_ratelimit_lengths() {
        assert_eq!(Unit::parse("MONTH").map(Unit::seconds), Some(30 * 86_400));
        assert_eq!(Unit::parse("Year").map(Unit::seconds), Some(365 * 86_400));
        assert_eq!(Unit::parse("fortnight"), None);
    }
}
