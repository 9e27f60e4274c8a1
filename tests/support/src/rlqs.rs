//! Real Envoys asking sluice for quota over RLQS (the `rate_limit_quota` filter): one bucket per
//! `x-tenant` header, and a paced load of one tenant's requests on one Envoy, tallied second by
//! second.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::envoy::{Envoy, Front, bootstrap_with};

/// The filter's `domain`.
pub const DOMAIN: &str = "rlqs-e2e";

/// The `rule` label of the per-tenant rule in sluice's quota metrics (see `rules`).
pub const TENANT_RULE: &str = "name_per-tenant.tenant_*";

/// Rules for `DOMAIN`: each tenant's bucket holds `per_second` requests per second across every
/// Envoy; the bucket of requests without `x-tenant` (Envoy's readiness probe) is unlimited.
pub fn rules(per_second: u32) -> String {
    format!(
        "domain: {DOMAIN}
quota_buckets:
  - bucket: {{name: per-tenant, tenant: \"*\"}}
    rate_limit: {{unit: second, requests_per_unit: {per_second}}}
  - bucket: {{name: default}}
    rate_limit: {{unlimited: true}}
"
    )
}

/// The `rate_limit_quota` filter asking the cluster `ratelimit` (HTTP/2, at sluice's gRPC address)
/// for `DOMAIN`, as a one-entry list of HTTP filters. A request with `x-tenant: T` falls in the
/// bucket `{name: per-tenant, tenant: T}`, any other in `{name: default}`; both let requests
/// through until their first assignment arrives, and a denied request gets 429.
fn quota_filter() -> String {
    const SETTINGS: &str = "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings";
    const HEADER_INPUT: &str =
        "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput";
    format!(
        r#"- name: envoy.filters.http.rate_limit_quota
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
    rlqs_server:
      envoy_grpc: {{ cluster_name: ratelimit }}
      timeout: 1s
    domain: {DOMAIN}
    bucket_matchers:
      matcher_list:
        matchers:
          - predicate:
              single_predicate:
                input:
                  name: x-tenant
                  typed_config:
                    "@type": {HEADER_INPUT}
                    header_name: x-tenant
                value_match:
                  safe_regex: {{ google_re2: {{}}, regex: ".+" }}
            on_match:
              action:
                name: per-tenant
                typed_config:
                  "@type": {SETTINGS}
                  bucket_id_builder:
                    bucket_id_builder:
                      name: {{ string_value: per-tenant }}
                      tenant:
                        custom_value:
                          name: tenant
                          typed_config:
                            "@type": {HEADER_INPUT}
                            header_name: x-tenant
                  reporting_interval: 1s
                  no_assignment_behavior:
                    fallback_rate_limit: {{ blanket_rule: ALLOW_ALL }}
                  deny_response_settings:
                    http_status: {{ code: 429 }}
      on_no_match:
        action:
          name: default
          typed_config:
            "@type": {SETTINGS}
            bucket_id_builder:
              bucket_id_builder:
                name: {{ string_value: default }}
            reporting_interval: 1s
            no_assignment_behavior:
              fallback_rate_limit: {{ blanket_rule: ALLOW_ALL }}"#
    )
}

/// Starts one Envoy per address in `sluices` (in parallel), each routing every request to
/// `upstream` through the `rate_limit_quota` filter that asks the sluice at that address, and
/// waits until all of them route.
pub fn quota_envoys(binary: &Path, upstream: SocketAddr, sluices: &[SocketAddr]) -> Vec<Envoy> {
    let front = Front {
        routes: "- match: { prefix: / }\n  route: { cluster: upstream }",
        filters: &quota_filter(),
    };
    std::thread::scope(|scope| {
        let starting: Vec<_> = sluices
            .iter()
            .map(|&sluice| {
                let front = &front;
                scope.spawn(move || {
                    Envoy::launch(binary, &|listener, admin| {
                        bootstrap_with(listener, admin, upstream, sluice, front, None)
                    })
                })
            })
            .collect();
        starting
            .into_iter()
            .map(|envoy| envoy.join().expect("Envoy starts"))
            .collect()
    })
}

/// How many keep-alive connections a load spreads its requests over, so that one slow answer
/// does not hold back the pace.
const CONNECTIONS: u32 = 3;

/// How long one request may take before the load gives up on the test.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Requests of one tenant sent to one Envoy at a steady pace, in background threads.
pub struct Load {
    threads: Vec<JoinHandle<Vec<(usize, u16)>>>,
}

impl Load {
    /// Sends `GET /` with `x-tenant: tenant` to `listener`, `rate` requests per second from
    /// `origin` for `length`, each request at its own instant (`origin + k / rate`) or as soon as
    /// its connection is free, over `CONNECTIONS` keep-alive connections.
    pub fn start(
        listener: SocketAddr,
        tenant: &str,
        rate: u32,
        origin: Instant,
        length: Duration,
    ) -> Load {
        let request =
            format!("GET / HTTP/1.1\r\nHost: localhost\r\nx-tenant: {tenant}\r\n\r\n").into_bytes();
        let count = (length.as_secs_f64() * f64::from(rate)).ceil() as u32;
        let threads = (0..CONNECTIONS)
            .map(|connection| {
                let request = request.clone();
                let due: Vec<Duration> = (connection..count)
                    .step_by(CONNECTIONS as usize)
                    .map(|k| Duration::from_secs_f64(f64::from(k) / f64::from(rate)))
                    .collect();
                std::thread::spawn(move || drive(listener, &request, origin, &due))
            })
            .collect();
        Load { threads }
    }

    /// Waits until every request has been answered, and tallies the answers.
    pub async fn finish(self) -> Tally {
        tokio::task::spawn_blocking(move || {
            let mut tally = Tally::default();
            for thread in self.threads {
                for (second, status) in thread.join().expect("the load runs to its end") {
                    tally.count(second, status);
                }
            }
            tally
        })
        .await
        .expect("the load is tallied")
    }
}

/// Sends `request` on one keep-alive connection to `listener` at each instant `origin + due[k]`
/// (or as soon as the previous answer is in), and returns (second since `origin` when sent,
/// status) for each. A connection that Envoy closes is opened again; any other failure panics.
fn drive(
    listener: SocketAddr,
    request: &[u8],
    origin: Instant,
    due: &[Duration],
) -> Vec<(usize, u16)> {
    let mut answers = Vec::with_capacity(due.len());
    let mut connection: Option<BufReader<TcpStream>> = None;
    for &at in due {
        std::thread::sleep((origin + at).saturating_duration_since(Instant::now()));
        let second = origin.elapsed().as_secs() as usize;
        let reader = connection.get_or_insert_with(|| connect(listener));
        let (status, close) = exchange(reader, request)
            .unwrap_or_else(|e| panic!("a request to Envoy at {listener} fails: {e}"));
        if close {
            connection = None;
        }
        answers.push((second, status));
    }
    answers
}

fn connect(listener: SocketAddr) -> BufReader<TcpStream> {
    let stream = TcpStream::connect_timeout(&listener, REQUEST_TIMEOUT)
        .unwrap_or_else(|e| panic!("Envoy at {listener} accepts a connection: {e}"));
    stream.set_read_timeout(Some(REQUEST_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(REQUEST_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    BufReader::new(stream)
}

/// Sends `request` and reads its response; returns the status and whether the server closes the
/// connection after it. The body is read (by `content-length`, or chunked) and dropped.
fn exchange(reader: &mut BufReader<TcpStream>, request: &[u8]) -> std::io::Result<(u16, bool)> {
    reader.get_mut().write_all(request)?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line: {line:?}")))?;
    let (mut length, mut chunked, mut close) = (0usize, false, false);
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim().to_ascii_lowercase();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => length = value.parse().map_err(std::io::Error::other)?,
            "transfer-encoding" => chunked = value.contains("chunked"),
            "connection" => close = value == "close",
            _ => {}
        }
    }
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(std::io::Error::other)?;
            // The chunk and its CRLF; the last (empty) chunk is followed by one more CRLF.
            std::io::copy(
                &mut reader.by_ref().take(size as u64 + 2),
                &mut std::io::sink(),
            )?;
            if size == 0 {
                break;
            }
        }
    } else {
        std::io::copy(
            &mut reader.by_ref().take(length as u64),
            &mut std::io::sink(),
        )?;
    }
    Ok((status, close))
}

/// What a load's requests got, by the second (since the load's origin) in which each was sent.
#[derive(Debug, Default)]
pub struct Tally {
    /// (admitted: 200, denied: 429) per second.
    seconds: Vec<(u64, u64)>,
}

impl Tally {
    fn count(&mut self, second: usize, status: u16) {
        if self.seconds.len() <= second {
            self.seconds.resize(second + 1, (0, 0));
        }
        match status {
            200 => self.seconds[second].0 += 1,
            429 => self.seconds[second].1 += 1,
            other => panic!("Envoy answered {other}, neither admitted (200) nor denied (429)"),
        }
    }

    /// Requests admitted (200) in all.
    pub fn admitted(&self) -> u64 {
        self.admitted_in(0..self.seconds.len())
    }

    /// Requests denied (429) in all.
    pub fn denied(&self) -> u64 {
        self.seconds.iter().map(|s| s.1).sum()
    }

    /// Requests sent during `seconds` (since the origin) that were admitted.
    pub fn admitted_in(&self, seconds: Range<usize>) -> u64 {
        self.seconds
            .iter()
            .skip(seconds.start)
            .take(seconds.len())
            .map(|s| s.0)
            .sum()
    }

    /// The first second in which a request was denied: its Envoy enforced an assignment by then
    /// (before its first, it lets everything through).
    pub fn first_denied(&self) -> Option<usize> {
        self.seconds.iter().position(|s| s.1 > 0)
    }

    /// The admitted count of each second, for failure messages.
    pub fn admitted_per_second(&self) -> Vec<u64> {
        self.seconds.iter().map(|s| s.0).collect()
    }
}

/// The value of sluice's quota metric `name` (a sample name, such as
/// `sluice_quota_reported_allowed_total`) for the per-tenant rule, on the admin address `http`;
/// 0 while it is not written.
pub fn tenant_metric(http: SocketAddr, name: &str) -> f64 {
    super::metrics::scrape(http)
        .get(name, &[("domain", DOMAIN), ("rule", TENANT_RULE)])
        .unwrap_or(0.0)
}
