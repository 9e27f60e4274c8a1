//! envoyproxy/ratelimit's statsd stats pushed over UDP (`--statsd-addr`): every flush interval,
//! each counter's change since the last flush (none when it did not move) and each response
//! time seen, written as that project's statsd sink writes them, its extra tags in the name
//! (`.__key=value`) or, DogStatsD's way, after the line (`|#key:value`). Lines are packed into
//! datagrams of at most `PACKET` bytes, never split.
//!
//! Off the request path: the stats are read from the same atomics `/metrics` reads, the lines
//! are made on a blocking thread, and a statsd that is down, slow or unresolvable loses packets,
//! never a decision.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::UdpSocket;

use super::Telemetry;
use super::metrics::{RESPONSE_TIME, StatsdTotals};
use sluice_core::log_throttle::LogThrottle;

/// The most bytes of lines in one datagram: what fits an Ethernet frame, as statsd clients use.
const PACKET: usize = 1432;

/// Where and how the stats go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsdSettings {
    /// `host:port`, resolved at each flush until it resolves.
    pub addr: String,
    pub every: Duration,
    /// Added to every stat, sorted by key.
    pub tags: Vec<(String, String)>,
    /// Tags written DogStatsD's way.
    pub dogstatsd: bool,
}

/// `EXTRA_TAGS`' form, `key:value,key:value`: each pair of exactly two non-empty parts.
pub fn parse_tags(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut tags = Vec::new();
    for pair in text.split(',').filter(|p| !p.is_empty()) {
        match pair.split(':').collect::<Vec<_>>()[..] {
            [key, value] if !key.is_empty() && !value.is_empty() => {
                tags.push((key.to_owned(), value.to_owned()));
            }
            _ => return Err(format!("{pair:?} is not key:value")),
        }
    }
    tags.sort();
    Ok(tags)
}

/// Pushes the stats every `settings.every` until `stop`, then once more.
pub async fn push(settings: StatsdSettings, telemetry: Telemetry, stop: impl Future<Output = ()>) {
    let socket = match UdpSocket::bind(("0.0.0.0", 0)).await {
        Ok(socket) => socket,
        Err(e) => {
            tracing::warn!("statsd: no UDP socket, no stats will be sent: {e}");
            return;
        }
    };
    let mut lines = Lines::new(&settings);
    let mut target = None;
    let mut ticks = tokio::time::interval(settings.every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    tokio::pin!(stop);
    loop {
        let last = tokio::select! {
            _ = ticks.tick() => false,
            () = &mut stop => true,
        };
        let told = telemetry.clone();
        let made = tokio::task::spawn_blocking(move || {
            let packets = lines.packets(told.metrics().statsd_totals());
            (lines, packets)
        })
        .await;
        let packets;
        (lines, packets) = match made {
            Ok(made) => made,
            Err(e) => {
                tracing::warn!("statsd: the stats could not be gathered: {e}");
                return;
            }
        };
        if target.is_none() {
            target = resolve(&settings.addr).await;
        }
        if let Some(to) = target {
            send(&socket, to, &packets).await;
        }
        if last {
            return;
        }
    }
}

async fn resolve(addr: &str) -> Option<SocketAddr> {
    static FAILED: LogThrottle = LogThrottle::new();
    match tokio::net::lookup_host(addr).await.map(|mut a| a.next()) {
        Ok(Some(to)) => Some(to),
        Ok(None) => {
            if let Some(times) = FAILED.hit() {
                tracing::warn!(times, "statsd: {addr} resolves to no address");
            }
            None
        }
        Err(e) => {
            if let Some(times) = FAILED.hit() {
                tracing::warn!(times, "statsd: {addr} does not resolve: {e}");
            }
            None
        }
    }
}

async fn send(socket: &UdpSocket, to: SocketAddr, packets: &[Vec<u8>]) {
    static FAILED: LogThrottle = LogThrottle::new();
    for packet in packets {
        if let Err(e) = socket.send_to(packet, to).await
            && let Some(times) = FAILED.hit()
        {
            tracing::warn!(times, "statsd: a packet to {to} was lost: {e}");
        }
    }
}

/// The lines of each flush: what every counter and response time stood at the last one.
struct Lines {
    /// `.__key=value…` (in the name) or `|#key:value,…` (after the line).
    tags: String,
    dogstatsd: bool,
    counters: HashMap<String, u64>,
    response_times: HashMap<u64, u64>,
}

impl Lines {
    fn new(settings: &StatsdSettings) -> Self {
        let tags = if settings.dogstatsd {
            let pairs: Vec<String> = settings
                .tags
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect();
            if pairs.is_empty() {
                String::new()
            } else {
                format!("|#{}", pairs.join(","))
            }
        } else {
            settings
                .tags
                .iter()
                .map(|(k, v)| format!(".__{k}={}", v.replace(['.', ':', '|'], "_")))
                .collect()
        };
        Lines {
            tags,
            dogstatsd: settings.dogstatsd,
            counters: HashMap::new(),
            response_times: HashMap::new(),
        }
    }

    /// One stat's line: `name:value|kind`, tagged.
    fn line(&self, out: &mut Vec<String>, name: &str, value: &str) {
        if self.dogstatsd {
            out.push(format!("{name}:{value}{}", self.tags));
        } else {
            out.push(format!("{name}{}:{value}", self.tags));
        }
    }

    /// The lines since the last flush, for the running totals `now`.
    fn lines(&mut self, now: StatsdTotals) -> Vec<String> {
        let mut out = Vec::new();
        for (name, total) in now.counters {
            let before = self.counters.insert(name.clone(), total).unwrap_or(0);
            // A series forgotten and made again (a reload) starts from 0.
            let moved = if total >= before {
                total - before
            } else {
                total
            };
            if moved > 0 {
                self.line(&mut out, &name, &format!("{moved}|c"));
            }
        }
        for (ms, total) in now.response_times {
            let before = self.response_times.insert(ms, total).unwrap_or(0);
            let mut calls = total.saturating_sub(before);
            if calls > 1 {
                // One line for many calls, sampled at 1/calls, which statsd reads as that many
                // (whole, as statsd_exporter truncates 1/rate); single lines for what it does
                // not read.
                let rate = 1.0 / calls as f64;
                let read = ((1.0 / rate) as u64).min(calls);
                self.line(&mut out, RESPONSE_TIME, &format!("{ms}|ms|@{rate}"));
                calls -= read;
            }
            for _ in 0..calls {
                self.line(&mut out, RESPONSE_TIME, &format!("{ms}|ms"));
            }
        }
        out
    }

    /// The lines since the last flush, packed into datagrams.
    fn packets(&mut self, now: StatsdTotals) -> Vec<Vec<u8>> {
        let mut packets: Vec<Vec<u8>> = Vec::new();
        for line in self.lines(now) {
            let fits = packets
                .last()
                .is_some_and(|packet| packet.len() + line.len() < PACKET);
            if !fits {
                packets.push(Vec::with_capacity(PACKET));
            }
            let packet = packets.last_mut().expect("a packet to fill");
            packet.extend_from_slice(line.as_bytes());
            packet.push(b'\n');
        }
        packets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(tags: &str, dogstatsd: bool) -> StatsdSettings {
        StatsdSettings {
            addr: "localhost:8125".into(),
            every: Duration::from_secs(10),
            tags: parse_tags(tags).unwrap(),
            dogstatsd,
        }
    }

    fn totals(counters: &[(&str, u64)], times: &[(u64, u64)]) -> StatsdTotals {
        StatsdTotals {
            counters: counters.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
            response_times: times.to_vec(),
        }
    }

    #[test]
    fn counters_go_as_their_change_and_response_times_as_each_call() {
        let mut lines = Lines::new(&settings("", false));
        let first = lines.lines(totals(&[("a.b", 3), ("a.c", 0)], &[(1, 1), (4, 3)]));
        assert_eq!(
            first,
            [
                "a.b:3|c",
                "ratelimit_server.ShouldRateLimit.response_time:1|ms",
                "ratelimit_server.ShouldRateLimit.response_time:4|ms|@0.3333333333333333",
            ]
        );
        let second = lines.lines(totals(&[("a.b", 5), ("a.c", 0)], &[(1, 1), (4, 3)]));
        assert_eq!(second, ["a.b:2|c"], "what did not move is not sent");
    }

    #[test]
    fn extra_tags_go_in_the_name_or_after_the_line() {
        let now = || totals(&[("a.b", 1)], &[]);
        let mut plain = Lines::new(&settings("zone:eu.1,app:x", false));
        assert_eq!(plain.lines(now()), ["a.b.__app=x.__zone=eu_1:1|c"]);
        let mut dog = Lines::new(&settings("zone:eu.1,app:x", true));
        assert_eq!(dog.lines(now()), ["a.b:1|c|#app:x,zone:eu.1"]);
        assert!(parse_tags("a:b:c").is_err());
        assert!(parse_tags("a").is_err());
    }

    #[test]
    fn lines_are_packed_into_datagrams_never_split() {
        let mut lines = Lines::new(&settings("", false));
        let names: Vec<String> = (0..200).map(|i| format!("stat.number.{i:04}")).collect();
        let counters: Vec<(&str, u64)> = names.iter().map(|n| (n.as_str(), 1)).collect();
        let packets = lines.packets(totals(&counters, &[]));
        assert!(packets.len() > 1);
        let mut seen = 0;
        for packet in &packets {
            assert!(packet.len() <= PACKET);
            let text = std::str::from_utf8(packet).unwrap();
            assert!(text.ends_with('\n'));
            seen += text.lines().filter(|l| l.ends_with(":1|c")).count();
        }
        assert_eq!(seen, 200);
    }
}
