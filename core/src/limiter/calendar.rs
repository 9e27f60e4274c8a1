//! Calendar windows: a day, a week, a month or a year as people bill them, from midnight in a
//! time zone. A calendar window has no fixed length (a day in a zone that changes its clocks
//! lasts 23 or 25 hours, a month 28 to 31 days), so it is named by its start and ends where the
//! next one starts, both worked out here from the zone's rules (the time zone database bundled
//! in the binary: every replica of one build reads the same rules).
//!
//! - A day starts at midnight; when midnight does not exist (a zone that moves its clocks at
//!   midnight), at the first instant after the gap.
//! - A week starts on its first day (`week_starts`, Monday by default).
//! - A month starts on its anchor day (the 1st by default); a month too short for the anchor
//!   (the 31st in April, the 29th in a February) starts on its last day instead.
//! - A year starts on the 1st of January.
//!
//! The Redis store is given the boundaries of the window around the replica's clock and the
//! ones on either side (`around`), and its script counts in the one holding Redis' clock: the
//! replicas agree on the window whatever their own clocks say, as long as each is less than a
//! window from Redis'.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use jiff::civil::Date;
pub use jiff::civil::Weekday;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

use super::Unit;

/// A calendar: the zone its days start in, the day its months start on, the day its weeks
/// start on.
#[derive(Clone, Debug)]
pub struct Calendar {
    zone: TimeZone,
    zone_name: Arc<str>,
    anchor_day: u8,
    week_starts: Weekday,
    /// How far its clock is set from the system's, in ms: 0 but in tests
    /// (`--calendar-clock-offset-ms`, `Calendar::offset_by`), which run windows across
    /// boundaries of their choosing. Every window is worked out at the clock plus this offset,
    /// then moved back by it: the stores count, expire and reset in their own clock's time as if
    /// it were that instant.
    offset_ms: i64,
    /// The windows worked out last, shared by every clone (a rule's limit is cloned into each
    /// request): until the window in force ends, a request reads them instead of the zone's
    /// rules.
    recent: Arc<ArcSwapOption<Recent>>,
}

/// The boundaries around an instant (`Calendar::around`), for windows of `unit`.
#[derive(Debug)]
struct Recent {
    unit: Unit,
    around: [u64; 4],
}

/// One calendar window: from `start` up to `end`, in ms since the Unix epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: u64,
}

/// The last instant windows are worked out for (the year 9000): the stores' clocks and any
/// instant a request can name stay far inside it.
const LAST_MS: i64 = 221_845_392_000_000;

impl Calendar {
    /// The calendar of `time_zone` (an IANA name such as `Europe/Berlin`, or `UTC`) whose months
    /// start on `anchor_day` (1 to 31) and weeks on `week_starts`.
    pub fn new(time_zone: &str, anchor_day: u8, week_starts: Weekday) -> Result<Self, String> {
        let zone = TimeZone::get(time_zone).map_err(|_| {
            format!("unknown time zone '{time_zone}' (an IANA name such as Europe/Berlin, or UTC)")
        })?;
        if !(1..=31).contains(&anchor_day) {
            return Err(format!("anchor_day must be 1 to 31, not {anchor_day}"));
        }
        Ok(Calendar {
            zone,
            zone_name: time_zone.into(),
            anchor_day,
            week_starts,
            offset_ms: 0,
            recent: Arc::default(),
        })
    }

    /// The calendar with its clock set `offset_ms` from the system's (tests only).
    pub fn offset_by(self, offset_ms: i64) -> Self {
        Calendar {
            offset_ms,
            recent: Arc::default(),
            ..self
        }
    }

    pub fn time_zone(&self) -> &str {
        &self.zone_name
    }

    pub fn anchor_day(&self) -> u8 {
        self.anchor_day
    }

    pub fn week_starts(&self) -> Weekday {
        self.week_starts
    }

    /// What sets its windows of `unit` apart in a counter's identity:
    /// `:calendar:Europe/Berlin`, with `:15` for a month's anchor day, `:sunday` for a week's
    /// first day.
    pub fn identity(&self, unit: Unit) -> String {
        match unit {
            Unit::Month => format!(":calendar:{}:{}", self.zone_name, self.anchor_day),
            Unit::Week => format!(
                ":calendar:{}:{}",
                self.zone_name,
                weekday_name(self.week_starts)
            ),
            _ => format!(":calendar:{}", self.zone_name),
        }
    }

    /// As a rule file says it, for its windows of `unit`: the zone, and a month's anchor day or
    /// a week's first day.
    pub fn json(&self, unit: Unit) -> serde_json::Value {
        let mut json = serde_json::json!({ "time_zone": &*self.zone_name });
        match unit {
            Unit::Month => json["anchor_day"] = self.anchor_day.into(),
            Unit::Week => json["week_starts"] = weekday_name(self.week_starts).into(),
            _ => {}
        }
        json
    }

    /// The window of `unit` holding `at_ms` (ms since the Unix epoch, on the store's clock).
    pub fn span(&self, unit: Unit, at_ms: u64) -> Span {
        let [_, start, end, _] = self.around(unit, at_ms);
        Span { start, end }
    }

    /// The window of `unit` holding `at_ms`, from the zone's rules.
    fn work_out(&self, unit: Unit, at_ms: u64) -> Span {
        let offset = self.offset_ms;
        let (start, end) = self.window(unit, shifted(at_ms, offset));
        Span {
            start: unshifted(start, offset),
            end: unshifted(end, offset),
        }
    }

    /// The instant `at_ms` (on the store's clock) as a civil time in the zone, such as
    /// `2027-03-01T00:00:00+01:00[Europe/Berlin]`.
    pub fn civil(&self, at_ms: u64) -> String {
        let offset = self.offset_ms;
        Timestamp::from_millisecond(shifted(at_ms, offset).clamp(0, LAST_MS))
            .expect("an instant between 1970 and 9000")
            .to_zoned(self.zone.clone())
            .to_string()
    }

    /// The boundaries around `at_ms`: the start of the window before the one holding it, that
    /// window's start and end, and the end of the window after.
    pub fn around(&self, unit: Unit, at_ms: u64) -> [u64; 4] {
        if let Some(around) = self.recent(unit, at_ms) {
            return around;
        }
        let now = self.work_out(unit, at_ms);
        let before = self.work_out(unit, now.start.saturating_sub(1));
        let after = self.work_out(unit, now.end);
        let around = [before.start, now.start, now.end, after.end];
        self.recent.store(Some(Arc::new(Recent { unit, around })));
        around
    }

    /// The boundaries worked out last, if the window they hold in the middle holds `at_ms`.
    fn recent(&self, unit: Unit, at_ms: u64) -> Option<[u64; 4]> {
        let recent = self.recent.load();
        let recent = recent.as_ref()?;
        let [_, start, end, _] = recent.around;
        (recent.unit == unit && (start..end).contains(&at_ms)).then_some(recent.around)
    }

    /// The window holding the instant `at` (ms), as its start and end in ms.
    fn window(&self, unit: Unit, at: i64) -> (i64, i64) {
        let date = Timestamp::from_millisecond(at.clamp(0, LAST_MS))
            .expect("an instant between 1970 and 9000")
            .to_zoned(self.zone.clone())
            .date();
        let (start, end) = match unit {
            Unit::Week => {
                let start = date - i64::from(date.weekday().since(self.week_starts)).days();
                (start, start + 7.days())
            }
            Unit::Month => {
                let here = self.anchored(date.year(), date.month());
                if date >= here {
                    (here, self.next_anchor(here))
                } else {
                    let before = date.first_of_month() - 1.day();
                    (self.anchored(before.year(), before.month()), here)
                }
            }
            Unit::Year => {
                let start = date.first_of_year();
                (start, start + 1.year())
            }
            // Only days, weeks, months and years are on the calendar; rule files refuse the rest.
            Unit::Second | Unit::Minute | Unit::Hour | Unit::Day => (date, date + 1.day()),
        };
        (self.midnight(start), self.midnight(end))
    }

    /// The anchor day in a month, or the month's last day when it is shorter.
    fn anchored(&self, year: i16, month: i8) -> Date {
        let first = Date::new(year, month, 1).expect("the first of a month");
        let day = (self.anchor_day as i8).min(first.days_in_month());
        Date::new(year, month, day).expect("a day of the month")
    }

    /// The anchor day of the month after the one `anchor` is in.
    fn next_anchor(&self, anchor: Date) -> Date {
        let next = anchor.first_of_month() + 1.month();
        self.anchored(next.year(), next.month())
    }

    /// The first instant of `date` in the zone, in ms.
    fn midnight(&self, date: Date) -> i64 {
        date.to_zoned(self.zone.clone())
            .expect("a date between 1970 and 9000")
            .timestamp()
            .as_millisecond()
    }
}

fn shifted(at_ms: u64, offset: i64) -> i64 {
    i64::try_from(at_ms)
        .unwrap_or(i64::MAX)
        .saturating_add(offset)
}

fn unshifted(at: i64, offset: i64) -> u64 {
    u64::try_from(at.saturating_sub(offset)).unwrap_or(0)
}

/// Calendars are the same when they say the same: the zone by name.
impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        (&self.zone_name, self.anchor_day, self.week_starts)
            == (&other.zone_name, other.anchor_day, other.week_starts)
    }
}

impl Eq for Calendar {}

impl Hash for Calendar {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (&self.zone_name, self.anchor_day, self.week_starts).hash(state);
    }
}

/// A weekday as rule files name it (`weekday_name`), in any case.
pub fn parse_weekday(name: &str) -> Option<Weekday> {
    Weekday::Monday
        .cycle_forward()
        .take(7)
        .find(|&day| weekday_name(day).eq_ignore_ascii_case(name))
}

/// A weekday as rule files name it.
pub fn weekday_name(day: Weekday) -> &'static str {
    match day {
        Weekday::Monday => "monday",
        Weekday::Tuesday => "tuesday",
        Weekday::Wednesday => "wednesday",
        Weekday::Thursday => "thursday",
        Weekday::Friday => "friday",
        Weekday::Saturday => "saturday",
        Weekday::Sunday => "sunday",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instant of a civil time in `zone`, in ms.
    fn at(zone: &str, y: i16, m: i8, d: i8, h: i8, min: i8) -> u64 {
        jiff::civil::date(y, m, d)
            .at(h, min, 0, 0)
            .in_tz(zone)
            .unwrap()
            .timestamp()
            .as_millisecond() as u64
    }

    fn calendar(zone: &str, anchor_day: u8, week_starts: Weekday) -> Calendar {
        Calendar::new(zone, anchor_day, week_starts).unwrap()
    }

    const HOUR: u64 = 3_600_000;

    #[test]
    fn a_day_in_berlin_is_23_hours_in_spring_and_25_in_autumn() {
        let berlin = calendar("Europe/Berlin", 1, Weekday::Monday);
        let spring = berlin.span(Unit::Day, at("Europe/Berlin", 2027, 3, 28, 12, 0));
        assert_eq!(spring.start, at("Europe/Berlin", 2027, 3, 28, 0, 0));
        assert_eq!(spring.end - spring.start, 23 * HOUR);
        let autumn = berlin.span(Unit::Day, at("Europe/Berlin", 2027, 10, 31, 12, 0));
        assert_eq!(autumn.end - autumn.start, 25 * HOUR);
        let plain = berlin.span(Unit::Day, at("Europe/Berlin", 2027, 6, 1, 0, 0));
        assert_eq!(plain.end - plain.start, 24 * HOUR);
    }

    #[test]
    fn a_day_in_new_york_follows_its_own_changes() {
        let ny = calendar("America/New_York", 1, Weekday::Monday);
        let spring = ny.span(Unit::Day, at("America/New_York", 2027, 3, 14, 5, 0));
        assert_eq!(spring.end - spring.start, 23 * HOUR);
        assert_eq!(spring.start, at("America/New_York", 2027, 3, 14, 0, 0));
        let autumn = ny.span(Unit::Day, at("America/New_York", 2027, 11, 7, 23, 59));
        assert_eq!(autumn.end - autumn.start, 25 * HOUR);
    }

    #[test]
    fn a_month_ends_at_midnight_of_the_next_in_its_zone() {
        let berlin = calendar("Europe/Berlin", 1, Weekday::Monday);
        let span = berlin.span(Unit::Month, at("Europe/Berlin", 2027, 1, 31, 23, 59));
        assert_eq!(span.start, at("Europe/Berlin", 2027, 1, 1, 0, 0));
        assert_eq!(span.end, at("Europe/Berlin", 2027, 2, 1, 0, 0));
        assert_eq!(span.end, at("UTC", 2027, 1, 31, 23, 0));
        let next = berlin.span(Unit::Month, span.end);
        assert_eq!(next.start, span.end);
    }

    #[test]
    fn february_has_29_days_in_a_leap_year() {
        let utc = calendar("UTC", 1, Weekday::Monday);
        let leap = utc.span(Unit::Month, at("UTC", 2028, 2, 29, 12, 0));
        assert_eq!(leap.end - leap.start, 29 * 24 * HOUR);
        let plain = utc.span(Unit::Month, at("UTC", 2027, 2, 28, 12, 0));
        assert_eq!(plain.end - plain.start, 28 * 24 * HOUR);
        let year = utc.span(Unit::Year, at("UTC", 2028, 2, 29, 12, 0));
        assert_eq!(year.end - year.start, 366 * 24 * HOUR);
    }

    #[test]
    fn an_anchor_day_a_month_lacks_stands_for_its_last_day() {
        let utc = calendar("UTC", 31, Weekday::Monday);
        // From 31 January to 28 February, then to 31 March.
        let jan = utc.span(Unit::Month, at("UTC", 2027, 2, 10, 0, 0));
        assert_eq!(jan.start, at("UTC", 2027, 1, 31, 0, 0));
        assert_eq!(jan.end, at("UTC", 2027, 2, 28, 0, 0));
        let feb = utc.span(Unit::Month, at("UTC", 2027, 3, 30, 23, 0));
        assert_eq!(feb.start, at("UTC", 2027, 2, 28, 0, 0));
        assert_eq!(feb.end, at("UTC", 2027, 3, 31, 0, 0));
        let leap = utc.span(Unit::Month, at("UTC", 2028, 2, 29, 0, 0));
        assert_eq!(leap.start, at("UTC", 2028, 2, 29, 0, 0));
        let fifteenth = calendar("UTC", 15, Weekday::Monday);
        let mid = fifteenth.span(Unit::Month, at("UTC", 2027, 1, 14, 23, 59));
        assert_eq!(mid.start, at("UTC", 2026, 12, 15, 0, 0));
        assert_eq!(mid.end, at("UTC", 2027, 1, 15, 0, 0));
    }

    #[test]
    fn a_week_starts_on_its_first_day() {
        // 2027-01-06 is a Wednesday.
        let monday =
            calendar("UTC", 1, Weekday::Monday).span(Unit::Week, at("UTC", 2027, 1, 6, 9, 0));
        assert_eq!(monday.start, at("UTC", 2027, 1, 4, 0, 0));
        let sunday =
            calendar("UTC", 1, Weekday::Sunday).span(Unit::Week, at("UTC", 2027, 1, 6, 9, 0));
        assert_eq!(sunday.start, at("UTC", 2027, 1, 3, 0, 0));
        let on_sunday =
            calendar("UTC", 1, Weekday::Monday).span(Unit::Week, at("UTC", 2027, 1, 3, 9, 0));
        assert_eq!(on_sunday.start, at("UTC", 2026, 12, 28, 0, 0));
        assert_eq!(on_sunday.end, at("UTC", 2027, 1, 4, 0, 0));
    }

    #[test]
    fn the_boundaries_around_an_instant_are_three_windows_in_a_row() {
        let berlin = calendar("Europe/Berlin", 1, Weekday::Monday);
        let b = berlin.around(Unit::Month, at("Europe/Berlin", 2027, 3, 31, 23, 0));
        assert_eq!(
            b,
            [
                at("Europe/Berlin", 2027, 2, 1, 0, 0),
                at("Europe/Berlin", 2027, 3, 1, 0, 0),
                at("Europe/Berlin", 2027, 4, 1, 0, 0),
                at("Europe/Berlin", 2027, 5, 1, 0, 0),
            ]
        );
    }

    #[test]
    fn windows_worked_out_once_serve_until_their_end_and_no_other_unit() {
        let berlin = calendar("Europe/Berlin", 1, Weekday::Monday);
        let june = at("Europe/Berlin", 2027, 6, 15, 12, 0);
        let month = berlin.span(Unit::Month, june);
        assert_eq!(berlin.span(Unit::Month, month.end - 1), month, "read again");
        assert_eq!(
            berlin.span(Unit::Month, month.end).start,
            month.end,
            "the next month"
        );
        let day = berlin.span(Unit::Day, june);
        assert_eq!(day.end - day.start, 24 * HOUR, "not the month read before");
        let clone = berlin.clone();
        assert_eq!(clone.span(Unit::Day, june), day, "a clone shares them");
    }

    #[test]
    fn an_unknown_zone_or_anchor_is_refused() {
        assert!(
            Calendar::new("Europe/Berln", 1, Weekday::Monday)
                .unwrap_err()
                .contains("unknown time zone")
        );
        assert!(Calendar::new("UTC", 32, Weekday::Monday).is_err());
        assert!(Calendar::new("UTC", 0, Weekday::Monday).is_err());
    }
}
