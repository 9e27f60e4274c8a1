//! A rule's limits: `rate_limit` and `rate_limits`, each limit's unit, algorithm and bounds, and
//! its `calendar`.

use super::*;

impl Parser<'_> {
    pub(super) fn limits(&mut self, map: &MarkedMappingNode) -> Vec<RuleLimit> {
        let single = map.get_node("rate_limit");
        let many = map.get_node("rate_limits");
        if let (Some(_), Some(node)) = (single, many) {
            self.error(
                line_of(node),
                "use either rate_limit or rate_limits, not both",
            );
            return Vec::new();
        }
        if let Some(node) = single {
            if node.as_scalar().is_some_and(is_null) {
                return Vec::new();
            }
            return match node.as_mapping() {
                Some(m) => self.limit(m).into_iter().collect(),
                None => {
                    self.error(line_of(node), "'rate_limit' must be a mapping");
                    Vec::new()
                }
            };
        }
        let mut out: Vec<RuleLimit> = Vec::new();
        let mut windows = HashSet::new();
        for m in self.maps(map, "rate_limits") {
            let line = m.span().start().map(|m| m.line()).unwrap_or(1);
            let Some(limit) = self.limit(m) else { continue };
            let Some(l) = &limit.limit else {
                self.error(line, "unlimited cannot be one of several rate_limits");
                continue;
            };
            if !windows.insert((l.algorithm, l.unit, l.unit_multiplier, l.calendar.clone())) {
                self.error(
                    line,
                    "rate_limits has two limits with the same algorithm and window",
                );
                continue;
            }
            out.push(limit);
        }
        out
    }

    pub(super) fn limit(&mut self, map: &MarkedMappingNode) -> Option<RuleLimit> {
        let line = map.span().start().map(|m| m.line()).unwrap_or(1);
        self.check_keys(map, LIMIT_KEYS);
        let errors_before = self.errors.len();
        let unlimited = self.flag(map, "unlimited");
        let unit_text = self.string(map, "unit").unwrap_or_default();
        let unit = Unit::parse(&unit_text);
        let name = self.string(map, "name").unwrap_or_default();
        let replaces = self.replaces(map, line, &name);
        let requests_per_unit = self.number(map, "requests_per_unit").unwrap_or(0);
        let unit_multiplier = self.unit_multiplier(map, line, unit);
        let algorithm = self.algorithm(map, line);
        let requests_line = map
            .get_node("requests_per_unit")
            .map(line_of)
            .unwrap_or(line);
        let burst_line = map.get_node("burst").map(line_of).unwrap_or(requests_line);
        let burst = self.number(map, "burst");
        if let (Some(algorithm), Some(unit)) = (algorithm, unit) {
            let window_ms = (unit.seconds() * 1000).saturating_mul(u64::from(unit_multiplier));
            self.algorithm_bounds(
                algorithm,
                requests_per_unit,
                burst,
                window_ms,
                requests_line,
                burst_line,
            );
        }
        let calendar = map
            .get_node("calendar")
            .and_then(|node| self.calendar(node, unit, unit_multiplier, algorithm, unlimited));
        if unlimited {
            if unit.is_some() {
                self.error(line, "should not specify rate limit unit when unlimited");
            }
            return (self.errors.len() == errors_before).then_some(RuleLimit {
                name,
                replaces,
                limit: None,
            });
        }
        let Some(unit) = unit else {
            self.error(
                map.get_node("unit").map(line_of).unwrap_or(line),
                format!("invalid rate limit unit '{unit_text}'"),
            );
            return None;
        };
        let limit = Limit {
            name: name.clone(),
            requests_per_unit,
            unit,
            unit_multiplier,
            algorithm: algorithm?,
            burst: burst.unwrap_or(requests_per_unit),
            calendar,
        };
        (self.errors.len() == errors_before).then_some(RuleLimit {
            name,
            replaces,
            limit: Some(limit),
        })
    }

    /// A limit's `replaces`: the names of the limits it replaces, none its own `name`.
    fn replaces(&mut self, map: &MarkedMappingNode, line: usize, name: &str) -> Vec<String> {
        let mut replaces = Vec::new();
        for r in self.maps(map, "replaces") {
            let r_line = r.span().start().map(|m| m.line()).unwrap_or(line);
            self.check_keys(r, REPLACES_KEYS);
            let replaced = self.string(r, "name").unwrap_or_default();
            if replaced.is_empty() {
                self.error(r_line, "should not have an empty replaces entry");
            } else if replaced == name {
                self.error(
                    r_line,
                    "replaces should not contain name of same descriptor",
                );
            }
            replaces.push(replaced);
        }
        replaces
    }

    /// A limit's `unit_multiplier` (1 unless it says), at least 1 and within the longest window.
    fn unit_multiplier(&mut self, map: &MarkedMappingNode, line: usize, unit: Option<Unit>) -> u32 {
        let multiplier_node = map.get_node("unit_multiplier").map(line_of);
        let unit_multiplier = self.number(map, "unit_multiplier").unwrap_or(1);
        if unit_multiplier == 0 {
            self.error(
                multiplier_node.unwrap_or(line),
                "unit_multiplier must be at least 1",
            );
        } else if unit
            .is_some_and(|u| u.seconds() * u64::from(unit_multiplier) > LONGEST_WINDOW_SECONDS)
        {
            self.error(
                multiplier_node.unwrap_or(line),
                format!(
                    "unit_multiplier {unit_multiplier} makes the window longer than {} days (10 years)",
                    LONGEST_WINDOW_SECONDS / 86_400
                ),
            );
        }
        unit_multiplier
    }

    /// A limit's `algorithm` (`fixed_window` unless it says); `None` for one unknown.
    fn algorithm(&mut self, map: &MarkedMappingNode, line: usize) -> Option<Algorithm> {
        let algorithm_text = self.string(map, "algorithm");
        let algorithm = match algorithm_text.as_deref() {
            None => Some(Algorithm::FixedWindow),
            Some(a) => Algorithm::parse(a),
        };
        if algorithm.is_none() {
            self.error(
                map.get_node("algorithm").map(line_of).unwrap_or(line),
                format!(
                    "invalid algorithm '{}' (expected {})",
                    algorithm_text.unwrap_or_default(),
                    Algorithm::NAMES
                ),
            );
        }
        algorithm
    }

    /// A limit's `calendar`: `true` (UTC, months from the 1st, weeks from Monday) or a mapping
    /// of `time_zone`, `anchor_day` (a month's) and `week_starts` (a week's), for a
    /// `fixed_window` of one day, week, month or year.
    pub(super) fn calendar(
        &mut self,
        node: &Node,
        unit: Option<Unit>,
        unit_multiplier: u32,
        algorithm: Option<Algorithm>,
        unlimited: bool,
    ) -> Option<Calendar> {
        let line = line_of(node);
        let (zone, anchor_day, week_starts) = match (node.as_scalar(), node.as_mapping()) {
            (Some(s), _) if is_null(s) => return None,
            (Some(s), _) => match s.as_bool() {
                Some(false) => return None,
                Some(true) => ("UTC".to_owned(), 1, Weekday::Monday),
                None => {
                    self.error(line, CALENDAR_SHAPE);
                    return None;
                }
            },
            (None, Some(map)) => self.calendar_mapping(map, line, unit)?,
            (None, None) => {
                self.error(line, CALENDAR_SHAPE);
                return None;
            }
        };
        if !self.calendar_window_fits(line, unit, unit_multiplier, algorithm, unlimited) {
            return None;
        }
        match Calendar::new(&zone, anchor_day, week_starts) {
            Ok(calendar) => Some(calendar.offset_by(self.calendar_offset_ms)),
            Err(message) => {
                let at = node
                    .as_mapping()
                    .and_then(|m| m.get_node("time_zone"))
                    .map_or(line, line_of);
                self.error(at, format!("calendar: {message}"));
                None
            }
        }
    }

    /// A limit's `calendar` as a mapping at `line`: its zone, a month's anchor day and a week's
    /// first day, each checked against the limit's `unit`.
    fn calendar_mapping(
        &mut self,
        map: &MarkedMappingNode,
        line: usize,
        unit: Option<Unit>,
    ) -> Option<(String, u8, Weekday)> {
        self.check_keys(map, CALENDAR_KEYS);
        let at = |key: &str| map.get_node(key).map_or(line, line_of);
        let zone = self
            .string(map, "time_zone")
            .unwrap_or_else(|| "UTC".to_owned());
        let anchor_day = self.number(map, "anchor_day");
        if anchor_day.is_some() && unit != Some(Unit::Month) {
            self.error(
                at("anchor_day"),
                "calendar: anchor_day applies to unit: month",
            );
        }
        let anchor_day = match anchor_day {
            None => 1,
            Some(day @ 1..=31) => day as u8,
            Some(day) => {
                self.error(
                    at("anchor_day"),
                    format!("calendar: anchor_day must be from 1 to 31, not {day} (a month too short for it starts on its last day)"),
                );
                return None;
            }
        };
        let week_starts = match self.string(map, "week_starts") {
            None => Weekday::Monday,
            Some(day) => {
                if unit != Some(Unit::Week) {
                    self.error(
                        at("week_starts"),
                        "calendar: week_starts applies to unit: week",
                    );
                }
                let Some(weekday) = calendar::parse_weekday(&day) else {
                    self.error(
                        at("week_starts"),
                        format!("calendar: invalid week_starts '{day}' (monday to sunday)"),
                    );
                    return None;
                };
                weekday
            }
        };
        Some((zone, anchor_day, week_starts))
    }

    /// Whether a limit of `unit` × `unit_multiplier` counted by `algorithm` (`unlimited` or not)
    /// can be on the calendar; errors at `line` where it cannot.
    fn calendar_window_fits(
        &mut self,
        line: usize,
        unit: Option<Unit>,
        unit_multiplier: u32,
        algorithm: Option<Algorithm>,
        unlimited: bool,
    ) -> bool {
        if unlimited {
            self.error(line, "should not specify a calendar when unlimited");
            return false;
        }
        match unit {
            Some(Unit::Day | Unit::Week | Unit::Month | Unit::Year) => {}
            Some(other) => {
                self.error(
                    line,
                    format!(
                        "a calendar window is a day, a week, a month or a year, not {} {}",
                        if other == Unit::Hour { "an" } else { "a" },
                        other.name()
                    ),
                );
                return false;
            }
            None => return false,
        }
        if unit_multiplier != 1 {
            self.error(
                line,
                format!(
                    "a calendar window is one {}: unit_multiplier must be 1, not {unit_multiplier}",
                    unit.map_or("", Unit::name)
                ),
            );
        }
        if let Some(other) = algorithm.filter(|&a| a != Algorithm::FixedWindow) {
            self.error(
                line,
                format!(
                    "calendar windows count with fixed_window, not {} ({})",
                    other.name(),
                    match other {
                        Algorithm::SlidingWindow => "a sliding window weighs windows of one length",
                        Algorithm::SlidingLog => "a log has no window to start",
                        _ => "a bucket has no window to start",
                    }
                ),
            );
        }
        true
    }

    /// What each algorithm bounds: `burst` belongs to buckets, at least 1 and small enough for
    /// exact bucket arithmetic; a sliding log's limit bounds the entries it keeps.
    pub(super) fn algorithm_bounds(
        &mut self,
        algorithm: Algorithm,
        requests_per_unit: u32,
        burst: Option<u32>,
        window_ms: u64,
        requests_line: usize,
        burst_line: usize,
    ) {
        if burst.is_some() && !algorithm.is_bucket() {
            self.error(
                burst_line,
                format!(
                    "burst applies to token_bucket and leaky_bucket, not {}",
                    algorithm.name()
                ),
            );
        }
        if burst == Some(0) {
            self.error(burst_line, "burst must be at least 1");
        }
        let held = u64::from(burst.unwrap_or(requests_per_unit));
        if algorithm.is_bucket() && held.saturating_mul(window_ms) > gcra::MOST_UNITS {
            self.error(
                burst_line,
                format!(
                    "a {} holding {held} over a {} s window is beyond exact arithmetic (burst × window in ms must be at most 2^51)",
                    algorithm.name(),
                    window_ms / 1000
                ),
            );
        }
        if algorithm == Algorithm::SlidingLog && requests_per_unit > log::MOST_ENTRIES {
            self.error(
                requests_line,
                format!(
                    "sliding_log keeps an entry per hit: requests_per_unit must be at most {} (this one is {requests_per_unit})",
                    log::MOST_ENTRIES
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{errors, ok};
    use super::*;

    #[test]
    fn a_lease_applies_to_window_limits_only() {
        let rule = |algorithm: &str, lease: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: k\n    lease: {lease}\n    rate_limit: {{unit: second, requests_per_unit: 5, algorithm: {algorithm}}}\n"
            )
        };
        assert_eq!(
            ok(&rule("sliding_window", "auto")).descriptors[0].lease,
            Some(Leasing::Auto)
        );
        assert!(errors(&rule("fixed_window", "off")).is_empty());
        assert_eq!(
            errors(&rule("token_bucket", "auto")),
            [
                "r.yaml:4: lease: auto cannot apply to a token_bucket limit: only fixed_window and sliding_window limits can be leased"
            ]
        );
        assert_eq!(
            errors(&rule("fixed_window", "always")),
            ["r.yaml:4: invalid lease 'always': auto or off"]
        );
    }

    #[test]
    fn a_calendar_window_reads_its_zone_anchor_and_first_weekday() {
        let rules = ok(
            "domain: d\ndescriptors:\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 5, calendar: {time_zone: Europe/Berlin, anchor_day: 31}}\n  - key: w\n    rate_limit: {unit: week, requests_per_unit: 5, calendar: {week_starts: Sunday}}\n  - key: d\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: true}\n  - key: off\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: false}\n",
        );
        let calendar = |i: usize| {
            rules.descriptors[i].limits[0]
                .limit
                .as_ref()
                .unwrap()
                .calendar
                .clone()
        };
        let month = calendar(0).expect("on the calendar");
        assert_eq!(
            (month.time_zone(), month.anchor_day()),
            ("Europe/Berlin", 31)
        );
        let week = calendar(1).expect("on the calendar");
        assert_eq!(
            (week.time_zone(), week.week_starts()),
            ("UTC", Weekday::Sunday)
        );
        assert_eq!(calendar(2).expect("on the calendar").time_zone(), "UTC");
        assert_eq!(calendar(3), None);
    }

    #[test]
    fn a_calendar_window_that_makes_no_sense_is_an_error_at_its_line() {
        let rule = |limit: &str| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      {limit}\n")
        };
        let cases = [
            (
                "{unit: second, requests_per_unit: 5, calendar: true}",
                "a calendar window is a day, a week, a month or a year, not a second",
            ),
            (
                "{unit: hour, requests_per_unit: 5, calendar: {time_zone: UTC}}",
                "a calendar window is a day, a week, a month or a year, not an hour",
            ),
            (
                "{unit: day, requests_per_unit: 5, unit_multiplier: 2, calendar: true}",
                "a calendar window is one day: unit_multiplier must be 1, not 2",
            ),
            (
                "{unit: month, requests_per_unit: 5, algorithm: sliding_window, calendar: true}",
                "calendar windows count with fixed_window, not sliding_window (a sliding window weighs windows of one length)",
            ),
            (
                "{unit: month, requests_per_unit: 5, algorithm: token_bucket, calendar: true}",
                "calendar windows count with fixed_window, not token_bucket (a bucket has no window to start)",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {time_zone: Europe/Berln}}",
                "calendar: unknown time zone 'Europe/Berln' (an IANA name such as Europe/Berlin, or UTC)",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {anchor_day: 32}}",
                "calendar: anchor_day must be from 1 to 31, not 32 (a month too short for it starts on its last day)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {anchor_day: 3}}",
                "calendar: anchor_day applies to unit: month",
            ),
            (
                "{unit: month, requests_per_unit: 5, calendar: {week_starts: sunday}}",
                "calendar: week_starts applies to unit: week",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {week_starts: someday}}",
                "calendar: invalid week_starts 'someday' (monday to sunday)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: weekly}",
                "'calendar' must be true or a mapping (time_zone, anchor_day, week_starts)",
            ),
            (
                "{unit: week, requests_per_unit: 5, calendar: {zone: UTC}}",
                "config error, unknown key 'zone'",
            ),
            (
                "{unlimited: true, calendar: true}",
                "should not specify a calendar when unlimited",
            ),
        ];
        for (limit, message) in cases {
            assert_eq!(
                errors(&rule(limit)),
                [format!("r.yaml:5: {message}")],
                "{limit}"
            );
        }
        assert_eq!(
            errors(
                "domain: d\nquota_buckets:\n  - bucket: {k: ~}\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: true}\n"
            ),
            ["r.yaml:4: 'calendar' does not apply to a quota bucket's limit"]
        );
    }
}
