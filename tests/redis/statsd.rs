//! envoyproxy/ratelimit's statsd stats over UDP (`--statsd-addr`): a UDP listener on loopback
//! receives that project's stat names and values for a known sequence of decisions, with and
//! without extra tags, in the name or DogStatsD's way; and run as `ratelimit` with that project's
//! environment (statsd on by default), the stats flow.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::ratelimit::Ratelimit;
use support::{MINUTE, OK, OVER_LIMIT, Sluice, Store, in_one_window, request};
use tokio::net::UdpSocket;

/// 2 a minute: of 3 requests, 2 within the limit and 1 over.
const RULES: &str = "
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 2}
";
const PREFIX: &str = "ratelimit.service.rate_limit.d.k";
const RESPONSE_TIME: &str = "ratelimit_server.ShouldRateLimit.response_time";

/// A statsd on loopback, and what it has received: counters summed by name (with their tags),
/// and the calls each timer line stands for (one, or 1/rate when sampled).
struct Statsd {
    socket: UdpSocket,
    counters: HashMap<String, u64>,
    timings: HashMap<String, u64>,
    lines: Vec<String>,
}

impl Statsd {
    async fn bind() -> Self {
        Statsd {
            socket: UdpSocket::bind("127.0.0.1:0").await.expect("a UDP port"),
            counters: HashMap::new(),
            timings: HashMap::new(),
            lines: Vec::new(),
        }
    }

    fn addr(&self) -> String {
        self.socket.local_addr().unwrap().to_string()
    }

    /// Receives until `done` holds, for at most 10 s; false if it never did.
    async fn until(&mut self, done: impl Fn(&Statsd) -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut buf = vec![0u8; 65_536];
        while !done(self) {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(received) = tokio::time::timeout(left, self.socket.recv(&mut buf)).await else {
                return false;
            };
            self.take_datagram(&buf[..received.expect("a datagram")]);
        }
        true
    }

    /// Receives everything sent for `span`.
    async fn receive_for(&mut self, span: Duration) {
        let deadline = Instant::now() + span;
        let mut buf = vec![0u8; 65_536];
        while let Ok(received) =
            tokio::time::timeout_at(deadline.into(), self.socket.recv(&mut buf)).await
        {
            self.take_datagram(&buf[..received.expect("a datagram")]);
        }
    }

    fn take_datagram(&mut self, datagram: &[u8]) {
        let n = datagram.len();
        assert!(n <= 1432, "a datagram of {n} bytes, more than 1432");
        for line in std::str::from_utf8(datagram).expect("UTF-8 lines").lines() {
            self.take(line);
        }
    }

    /// `name:value|type[|@rate][|#tags]`: a counter adds its value under `name` (and `|#tags`),
    /// a timer the calls it stands for.
    fn take(&mut self, line: &str) {
        self.lines.push(line.to_owned());
        let (name, rest) = match line.split_once("|#") {
            // DogStatsD: the tags follow the line; the name and value precede them.
            Some((head, tags)) => {
                let (name, rest) = head.rsplit_once(':').expect("name:value");
                (format!("{name}|#{tags}"), rest.to_owned())
            }
            None => {
                let (name, rest) = line.rsplit_once(':').expect("name:value");
                (name.to_owned(), rest.to_owned())
            }
        };
        let mut parts = rest.split('|');
        let value: u64 = parts.next().unwrap().parse().expect("a whole value");
        match parts.next() {
            Some("c") => *self.counters.entry(name).or_default() += value,
            Some("ms") => {
                let calls = parts
                    .next()
                    .and_then(|r| r.strip_prefix('@'))
                    .map_or(1, |rate| (1.0 / rate.parse::<f64>().unwrap()) as u64);
                *self.timings.entry(name).or_default() += calls;
            }
            other => panic!("unexpected type {other:?} in {line:?}"),
        }
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }
}

/// 3 requests for `k`, answered OK, OK, OVER_LIMIT.
async fn three_requests(sluice: &Sluice) {
    let mut client = sluice.client().await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        let answer = client
            .should_rate_limit(request("d", &[&[("k", "v")]]))
            .await
            .expect("an answer")
            .into_inner();
        codes.push(answer.overall_code);
    }
    assert_eq!(codes, [OK, OK, OVER_LIMIT]);
}

/// The stats of `three_requests`, each name followed by `tags` (in the name, or after it).
async fn the_stats_of_three_requests(flags: &[&str], tags: &str) {
    let mut statsd = Statsd::bind().await;
    let addr = statsd.addr();
    let mut all = vec![
        "--statsd-addr",
        addr.as_str(),
        "--statsd-flush-interval",
        "100ms",
    ];
    all.extend_from_slice(flags);
    let sluice = Sluice::on(Store::Memory, &[("rules.yaml", RULES)], &all).await;
    three_requests(&sluice).await;
    let named = |stat: &str| format!("{stat}{tags}");
    let expected = [
        (named(&format!("{PREFIX}.total_hits")), 3),
        (named(&format!("{PREFIX}.within_limit")), 2),
        (named(&format!("{PREFIX}.over_limit")), 1),
        (named("ratelimit_server.ShouldRateLimit.total_requests"), 3),
        (named("ratelimit.service.config_load_success"), 1),
    ];
    let timer = named(RESPONSE_TIME);
    let done = statsd
        .until(|s| {
            expected.iter().all(|(n, v)| s.counter(n) >= *v)
                && s.timings.get(&timer).copied().unwrap_or(0) >= 3
        })
        .await;
    assert!(done, "not all received in 10 s: {:#?}", statsd.lines);
    // A few flushes more: nothing that did not move is sent again.
    statsd.receive_for(Duration::from_millis(500)).await;
    for (name, value) in &expected {
        assert_eq!(statsd.counter(name), *value, "{name}: {:#?}", statsd.lines);
    }
    assert_eq!(statsd.timings[&timer], 3, "{:#?}", statsd.lines);
    for line in &statsd.lines {
        assert!(line.contains(tags), "{line:?} has no tags {tags:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn statsd_receives_envoyproxy_ratelimits_names_and_values_for_known_decisions() {
    in_one_window(MINUTE, async || the_stats_of_three_requests(&[], "").await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extra_tags_go_in_each_stats_name() {
    in_one_window(MINUTE, async || {
        the_stats_of_three_requests(
            &["--statsd-tags", "zone:eu.1,app:rl"],
            ".__app=rl.__zone=eu_1",
        )
        .await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn with_dogstatsd_extra_tags_follow_each_line() {
    in_one_window(MINUTE, async || {
        the_stats_of_three_requests(
            &["--statsd-tags", "zone:eu.1,app:rl", "--statsd-dogstatsd"],
            "|#app:rl,zone:eu.1",
        )
        .await
    })
    .await;
}

/// Run as `ratelimit` with envoyproxy/ratelimit's environment, which sends statsd by default:
/// besides Redis, only where it goes and how often are set.
#[tokio::test(flavor = "multi_thread")]
async fn as_ratelimit_the_stats_flow_by_default() {
    let mut statsd = Statsd::bind().await;
    let port = statsd.socket.local_addr().unwrap().port().to_string();
    let rules = "domain: erl\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 100}\n";
    let redis = support::redis::standalone();
    let url = format!("127.0.0.1:{}", redis.ports[0]);
    let prefix = format!("statsd-{}:", std::process::id());
    let env = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", url.as_str()),
        ("CACHE_KEY_PREFIX", prefix.as_str()),
        ("REDIS_TIMEOUT", "2s"),
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "100ms"),
    ];
    let (_ratelimit, channel) = Ratelimit::serving(rules, &env).await;
    RateLimitServiceClient::new(channel)
        .should_rate_limit(request("erl", &[&[("user", "alice")]]))
        .await
        .expect("an answer");
    let name = "ratelimit.service.rate_limit.erl.user.total_hits";
    assert!(
        statsd.until(|s| s.counter(name) == 1).await,
        "{name} never came: {:#?}",
        statsd.lines
    );
}
