//! envoyproxy/ratelimit's statsd stats for what sluice counted, rendered at scrape time through
//! its statsd_exporter mapping (`mapper`, `--prometheus-mapper`), so that its dashboards and
//! alerts keep working: the per-rule stats, the service's counters and the response-time timer.
//!
//! The statsd names are made here (`rule_series` for a rule's stats, `StatsdSeries::gather` for
//! the service's counters and the timer); `totals` gives the same names and values, unmapped, to
//! the statsd push (`telemetry::statsd`).

use std::collections::BTreeMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::Metrics;
use super::rules::{RULE_STATS, RuleSnapshot};
use crate::telemetry::mapper::{Kind, Mapper, Series};

/// What the mapping names each stat of the rule `descriptor` in `domain` (`None`: dropped), in
/// `RULE_STATS` order: envoyproxy/ratelimit's statsd name is
/// `ratelimit.service.rate_limit.<domain>.<descriptor>.<stat>`, the key sanitized.
pub(super) fn rule_series(mapper: &Mapper, domain: &str, descriptor: &str) -> Vec<Option<Series>> {
    let key = sanitize(&format!("{domain}.{descriptor}"));
    RULE_STATS
        .iter()
        .map(|(stat, _, _)| {
            mapper.map(
                &format!("ratelimit.service.rate_limit.{key}.{stat}"),
                Kind::Counter,
            )
        })
        .collect()
}

/// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` become `_`, and so do the dots of
/// IPv4 addresses.
fn sanitize(name: &str) -> String {
    let name = name.replace([':', '|'], "_");
    let bytes = name.as_bytes();
    let mut out = String::with_capacity(name.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = ipv4_at(&bytes[i..]) {
            out.push_str(&name[i..i + len].replace('.', "_"));
            i += len;
        } else {
            let c = name[i..].chars().next().expect("i is on a char boundary");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of the IPv4 address (four dot-separated runs of 1 to 3 digits) that `s` starts
/// with, if any.
fn ipv4_at(s: &[u8]) -> Option<usize> {
    let mut at = 0;
    for part in 0..4 {
        if part > 0 {
            if s.get(at) != Some(&b'.') {
                return None;
            }
            at += 1;
        }
        let digits = s[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if !(1..=3).contains(&digits) {
            return None;
        }
        at += digits;
    }
    Some(at)
}

/// The response-time timer's statsd name.
pub const RESPONSE_TIME: &str = "ratelimit_server.ShouldRateLimit.response_time";
/// The calls counter's statsd name.
const TOTAL_REQUESTS: &str = "ratelimit_server.ShouldRateLimit.total_requests";

/// envoyproxy/ratelimit's stats, unmapped, as its statsd sink would name them.
#[derive(Debug)]
pub struct StatsdTotals {
    /// Each counter's name and running total.
    pub counters: Vec<(String, u64)>,
    /// The response times seen: (whole milliseconds, calls), running totals.
    pub response_times: Vec<(u64, u64)>,
}

/// The service's counters (not per rule): statsd name and running total.
fn service_counters(metrics: &Metrics) -> [(&'static str, u64); 5] {
    [
        (
            "ratelimit.service.config_load_success",
            metrics.loads_ok.get(),
        ),
        (
            "ratelimit.service.config_load_error",
            metrics.loads_failed.get(),
        ),
        (
            "ratelimit.service.call.should_rate_limit.redis_error",
            metrics.redis_errors.get(),
        ),
        (
            "ratelimit.service.call.should_rate_limit.service_error",
            metrics.service_errors.get(),
        ),
        (
            "ratelimit.service.global_shadow_mode",
            metrics.global_shadow_mode.get(),
        ),
    ]
}

/// envoyproxy/ratelimit's stats for what `metrics` counted, per rule (`rules`) and for the
/// service, unmapped.
pub(super) fn totals(metrics: &Metrics, rules: &RuleSnapshot) -> StatsdTotals {
    let mut counters = Vec::new();
    for (domain, descriptor, values) in rules.values() {
        let key = sanitize(&format!("{domain}.{descriptor}"));
        for ((stat, _, _), value) in RULE_STATS.iter().zip(values) {
            counters.push((format!("ratelimit.service.rate_limit.{key}.{stat}"), value));
        }
    }
    counters.extend(
        service_counters(metrics)
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value)),
    );
    let response_times = metrics.response_times.seen();
    let calls = response_times.iter().map(|(_, n)| n).sum();
    counters.push((TOTAL_REQUESTS.to_owned(), calls));
    StatsdTotals {
        counters,
        response_times,
    }
}

/// envoyproxy/ratelimit's series as its mapping names them, gathered at scrape time: counters
/// of equal name and labels add up, as statsd_exporter adds them; a name already taken by a
/// series of the other type keeps its first one (statsd_exporter's conflict).
#[derive(Debug, Default)]
pub(super) struct StatsdSeries(BTreeMap<String, StatsdFamily>);

#[derive(Debug)]
struct StatsdFamily {
    help: String,
    values: StatsdValues,
}

type LabelPairs = Vec<(String, String)>;

#[derive(Debug)]
enum StatsdValues {
    Counters(BTreeMap<LabelPairs, u64>),
    Histograms(BTreeMap<LabelPairs, Observed>),
}

/// A histogram: per-bucket (not cumulative) counts, the last one past every bound.
#[derive(Debug)]
struct Observed {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
}

/// statsd_exporter's help for a mapping that gives none.
const DEFAULT_HELP: &str = "Metric autogenerated by statsd_exporter.";

impl StatsdSeries {
    /// envoyproxy/ratelimit's statsd stats for what `metrics` counted, through the mapping in
    /// force: the per-rule counters of `rules` (every one written, 0 included, when a mapping
    /// names it; an unmapped one once it counts, as statsd_exporter sees a stat only once it
    /// moves), the service's counters and the response-time timer.
    pub(super) fn gather(metrics: &Metrics, rules: &RuleSnapshot) -> Self {
        let mut out = StatsdSeries::default();
        for (series, value) in rules.mapped() {
            out.counter(series, value);
        }
        let m = metrics.mapper();
        for (name, value) in service_counters(metrics) {
            if let Some(series) = m.map(name, Kind::Counter) {
                out.counter(&series, value);
            }
        }
        let times = metrics.response_times.seen();
        let calls = times.iter().map(|(_, n)| n).sum();
        if let Some(series) = m.map(TOTAL_REQUESTS, Kind::Counter) {
            out.counter(&series, calls);
        }
        if let Some(series) = m.map(RESPONSE_TIME, Kind::Observer) {
            out.observations(&series, &times);
        }
        out
    }

    fn family(&mut self, series: &Series, values: StatsdValues) -> &mut StatsdFamily {
        self.0
            .entry(series.name.clone())
            .or_insert_with(|| StatsdFamily {
                help: series.help.clone().unwrap_or_else(|| DEFAULT_HELP.into()),
                values,
            })
    }

    fn counter(&mut self, series: &Series, value: u64) {
        if value == 0 && !series.mapped {
            return;
        }
        let family = self.family(series, StatsdValues::Counters(BTreeMap::new()));
        if let StatsdValues::Counters(c) = &mut family.values {
            *c.entry(series.labels.clone()).or_default() += value;
        }
    }

    /// Observations of `(value, times)` in whole milliseconds, scaled as `series` says.
    fn observations(&mut self, series: &Series, seen: &[(u64, u64)]) {
        if seen.is_empty() && !series.mapped {
            return;
        }
        let family = self.family(series, StatsdValues::Histograms(BTreeMap::new()));
        let StatsdValues::Histograms(h) = &mut family.values else {
            return;
        };
        let bounds = &series.buckets;
        let observed = h.entry(series.labels.clone()).or_insert_with(|| Observed {
            bounds: bounds.clone(),
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        });
        if observed.bounds != *bounds {
            return;
        }
        for &(ms, times) in seen {
            let value = ms as f64 * series.scale.unwrap_or(1.0);
            let bucket = bounds.partition_point(|b| *b < value);
            observed.counts[bucket] += times;
            observed.sum += value * times as f64;
        }
    }
}

impl Collector for StatsdSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, family) in &self.0 {
            match &family.values {
                // Untyped, so that a counter keeps its name (a typed one gains `_total`).
                StatsdValues::Counters(series) => {
                    let mut f =
                        encoder.encode_descriptor(name, &family.help, None, MetricType::Unknown)?;
                    for (labels, value) in series {
                        f.encode_family(labels)?.encode_gauge(value)?;
                    }
                }
                StatsdValues::Histograms(series) => {
                    let mut f = encoder.encode_descriptor(
                        name,
                        &family.help,
                        None,
                        MetricType::Histogram,
                    )?;
                    for (labels, h) in series {
                        let buckets: Vec<(f64, u64)> = h
                            .bounds
                            .iter()
                            .copied()
                            .chain([f64::INFINITY])
                            .zip(h.counts.iter().copied())
                            .collect();
                        let count = h.counts.iter().sum();
                        f.encode_family(labels)?
                            .encode_histogram::<NoLabelSet>(h.sum, count, &buckets, None)?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_names_are_sanitized_as_envoy_ratelimit_does() {
        assert_eq!(
            sanitize("d.remote_address_10.0.0.1"),
            "d.remote_address_10_0_0_1"
        );
        assert_eq!(sanitize("d.k_a:b|c"), "d.k_a_b_c");
        assert_eq!(
            sanitize("d.v_1.2.3"),
            "d.v_1.2.3",
            "three parts are no address"
        );
    }

    #[test]
    fn observations_fall_in_the_buckets_of_the_mapping_scaled() {
        let mut out = StatsdSeries::default();
        let series = Series {
            name: "t".into(),
            labels: Vec::new(),
            mapped: true,
            buckets: vec![0.005, 1.0],
            scale: Some(0.001),
            help: None,
        };
        out.observations(&series, &[(0, 2), (5, 1), (7, 1), (2000, 1)]);
        let StatsdValues::Histograms(h) = &out.0["t"].values else {
            panic!("a histogram");
        };
        let h = &h[&Vec::new()];
        assert_eq!(h.counts, [3, 1, 1], "le is inclusive: 5 ms is in 0.005");
        assert!((h.sum - 2.012).abs() < 1e-9);
    }
}
