//! Every listener is bounded: admin HTTP connections that never finish their headers and gRPC
//! connections that never call can neither take the file descriptors a new gRPC client needs nor
//! stay open for long, and a connection past `--grpc-max-connection-age` is told to go (GOAWAY)
//! while its client carries on. The descriptor limit is lowered (`ulimit -n 256`) so that a few
//! hundred connections are past it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{OK, Sluice, Wait, http, request};
use tonic::transport::Endpoint;

const RULES: &str = "\
domain: listeners
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 1000000
";

/// The process's file descriptor limit in these tests.
const LIMIT: &str = "ulimit -n 256;";
/// Connections a flood opens: past `LIMIT`.
const FLOOD: usize = 300;
/// What an admin client that never finishes its headers sends.
const SLOWLORIS: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-a: ";
/// The HTTP/2 client preface, then an empty SETTINGS frame: all a gRPC client sends before its
/// first call.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
/// HTTP/2's GOAWAY frame type.
const GOAWAY: u8 = 7;

async fn start_with(flags: &[&str], wrapper: Option<&str>) -> Sluice {
    let mut all = vec!["--store-timeout", "2s", "--threads", "2"];
    all.extend(flags);
    Sluice::spawn(&[("rules.yaml", RULES)], &all, wrapper, Wait::Serving).await
}

/// Opens `n` connections to `addr`, each sending `bytes` and nothing more; those the server
/// refuses or resets at once are left out.
async fn open(addr: SocketAddr, n: usize, bytes: &'static [u8]) -> Vec<TcpStream> {
    tokio::task::spawn_blocking(move || {
        (0..n)
            .filter_map(|_| {
                let mut stream = TcpStream::connect(addr).ok()?;
                stream.write_all(bytes).ok()?;
                Some(stream)
            })
            .collect()
    })
    .await
    .unwrap()
}

/// Whether a new gRPC client, on a connection of its own, is answered OK within 10 s.
async fn a_new_client_decides(sluice: &Sluice) -> bool {
    let endpoint = Endpoint::from_shared(format!("http://{}", sluice.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    let ask = async {
        let mut client = RateLimitServiceClient::new(endpoint.connect().await.ok()?);
        let answer = client
            .should_rate_limit(request("listeners", &[&[("user", "a")]]))
            .await
            .ok()?;
        Some(answer.into_inner().overall_code)
    };
    tokio::time::timeout(Duration::from_secs(10), ask).await == Ok(Some(OK))
}

async fn healthz(sluice: &Sluice) -> u16 {
    let addr = sluice.http;
    tokio::task::spawn_blocking(move || http(addr, "GET", "/healthz", "").0)
        .await
        .unwrap()
}

/// Waits, until `deadline` at the latest, for `stream` to be closed by the server (whatever it
/// sent before); how long after `since` it was, or `None` if it is still open.
fn closed(stream: &mut TcpStream, since: Instant, deadline: Instant) -> Option<Duration> {
    let mut buffer = [0; 4096];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match stream.read(&mut buffer) {
            Ok(0) => return Some(since.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(since.elapsed());
            }
            Err(_) => return None,
        }
    }
}

/// How many of `streams` the server has closed by `deadline`.
async fn count_closed(streams: Vec<TcpStream>, since: Instant, deadline: Instant) -> usize {
    tokio::task::spawn_blocking(move || {
        streams
            .into_iter()
            .filter_map(|mut s| closed(&mut s, since, deadline))
            .count()
    })
    .await
    .unwrap()
}

/// Reads the HTTP/2 frames the server sends on `stream` until it closes it or `deadline`: how
/// long after `since` a GOAWAY came and the connection closed.
async fn goaway_then_close(
    mut stream: TcpStream,
    since: Instant,
    deadline: Instant,
) -> (Option<Duration>, Option<Duration>) {
    tokio::task::spawn_blocking(move || {
        let mut received = Vec::new();
        let mut goaway = None;
        let mut buffer = [0; 4096];
        loop {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return (goaway, None);
            };
            stream.set_read_timeout(Some(left)).unwrap();
            let n = match stream.read(&mut buffer) {
                Ok(0) => return (goaway, Some(since.elapsed())),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return (goaway, Some(since.elapsed()));
                }
                Err(_) => return (goaway, None),
            };
            received.extend_from_slice(&buffer[..n]);
            // Each frame: a 24-bit length, its type, flags, a stream id, then the payload.
            while received.len() >= 9 {
                let length = u32::from_be_bytes([0, received[0], received[1], received[2]]);
                let end = 9 + length as usize;
                if received.len() < end {
                    break;
                }
                if received[3] == GOAWAY && goaway.is_none() {
                    goaway = Some(since.elapsed());
                }
                received.drain(..end);
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn slowloris_admin_connections_neither_keep_grpc_clients_out_nor_outlive_the_header_timeout()
{
    let mut sluice = start_with(&[], Some(LIMIT)).await;
    let since = Instant::now();
    let flood = open(sluice.http, FLOOD, SLOWLORIS).await;
    let lone_since = Instant::now();
    let lone = open(sluice.http, 1, SLOWLORIS).await;
    let (opened, lone_opened) = (flood.len(), lone.len());
    for _ in 0..5 {
        assert!(
            a_new_client_decides(&sluice).await,
            "a new gRPC client is answered past {FLOOD} slowloris admin connections"
        );
    }
    assert_eq!(healthz(&sluice).await, 200);
    let lone_closed = count_closed(lone, lone_since, lone_since + Duration::from_secs(30));
    let flood_closed = count_closed(flood, since, since + Duration::from_secs(30));
    let (lone_closed, flood_closed) = tokio::join!(lone_closed, flood_closed);
    assert_eq!(flood_closed, opened, "every slowloris connection is closed");
    assert_eq!(
        lone_closed, lone_opened,
        "closed once its 5 s for headers are over"
    );
    assert!(sluice.alive());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slowloris_admin_connection_is_closed_once_its_5_s_for_headers_are_over() {
    let sluice = start_with(&[], None).await;
    let since = Instant::now();
    let mut lone = open(sluice.http, 1, SLOWLORIS)
        .await
        .pop()
        .expect("connects");
    let after = tokio::task::spawn_blocking(move || {
        closed(&mut lone, since, since + Duration::from_secs(30))
    })
    .await
    .unwrap()
    .expect("closed within 30 s");
    assert!(after >= Duration::from_secs(4), "closed after {after:?}");
    assert_eq!(healthz(&sluice).await, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_connections_that_never_call_neither_keep_a_new_client_out_nor_stop_healthz() {
    let mut sluice = start_with(&[], Some(LIMIT)).await;
    let flood = open(sluice.grpc, FLOOD, PREFACE).await;
    for _ in 0..5 {
        assert!(
            a_new_client_decides(&sluice).await,
            "a new gRPC client is answered past {FLOOD} gRPC connections that never call"
        );
    }
    assert_eq!(healthz(&sluice).await, 200);
    assert!(sluice.alive());
    drop(flood);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grpc_connection_that_never_calls_is_told_to_go_after_10_s_then_closed() {
    let sluice = start_with(&[], None).await;
    let since = Instant::now();
    let silent = open(sluice.grpc, 1, PREFACE).await.pop().expect("connects");
    let (goaway, closed) = goaway_then_close(silent, since, since + Duration::from_secs(30)).await;
    let goaway = goaway.expect("a GOAWAY within 30 s");
    assert!(goaway >= Duration::from_secs(9), "GOAWAY after {goaway:?}");
    assert!(closed.is_some(), "closed once the peer had 5 s to close");
    assert!(a_new_client_decides(&sluice).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn past_its_max_age_a_connection_is_told_to_go_and_a_tonic_client_carries_on() {
    let flags = [
        "--grpc-max-connection-age",
        "2s",
        "--grpc-max-connection-age-grace",
        "1s",
    ];
    let sluice = start_with(&flags, None).await;
    let since = Instant::now();
    let raw = open(sluice.grpc, 1, PREFACE).await.pop().expect("connects");
    let watched = tokio::spawn(goaway_then_close(
        raw,
        since,
        since + Duration::from_secs(15),
    ));
    // One client, asking every 100 ms for 6 s: across two or three ages of its connection.
    let mut client = sluice.client().await;
    for n in 0..60 {
        let ask = request("listeners", &[&[("user", "b")]]);
        let mut answer = client.should_rate_limit(ask.clone()).await;
        // A call the client sends as the GOAWAY reaches it is refused unprocessed, or dropped
        // unsent with the closing connection (a race in the client, which does not retry it):
        // asked again, up to twice, on the next connection.
        for _ in 0..2 {
            let transport = |e: &tonic::Status| {
                matches!(
                    e.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
                )
            };
            if !answer.as_ref().is_err_and(transport) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            answer = client.should_rate_limit(ask.clone()).await;
        }
        let answer = answer.unwrap_or_else(|e| panic!("call {n} failed: {e}"));
        assert_eq!(answer.into_inner().overall_code, OK);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (goaway, closed) = watched.await.unwrap();
    let goaway = goaway.expect("a GOAWAY");
    // 2 s, give or take 10 %, and well before the 10 s a connection has for its first call.
    assert!(
        goaway >= Duration::from_millis(1700) && goaway < Duration::from_secs(6),
        "GOAWAY after {goaway:?}"
    );
    let closed = closed.expect("closed");
    assert!(
        closed - goaway < Duration::from_secs(5),
        "closed {:?} after the GOAWAY, its grace being 1 s",
        closed - goaway
    );
}

/// Keeps `n` connections to `addr` each sending a `POST /counters` whose 1,000-byte body comes
/// one byte every 2 s, opening another whenever the server closes one, until `until`; how many
/// answers the server sent them, by status.
fn slow_bodies(
    addr: SocketAddr,
    n: usize,
    token: Option<&'static str>,
    until: Instant,
) -> std::thread::JoinHandle<std::collections::BTreeMap<u16, usize>> {
    std::thread::spawn(move || {
        let auth = token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
        let head = format!(
            "POST /counters HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        );
        let connect = || {
            let mut stream = TcpStream::connect(addr).ok()?;
            stream.write_all(head.as_bytes()).ok()?;
            stream.set_nonblocking(true).ok()?;
            Some(stream)
        };
        let mut open: Vec<Option<TcpStream>> = (0..n).map(|_| connect()).collect();
        let mut answers = std::collections::BTreeMap::new();
        let mut next_byte = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            let send = Instant::now() >= next_byte;
            if send {
                next_byte += Duration::from_secs(2);
            }
            for slot in open.iter_mut() {
                let mut gone = slot.is_none();
                if let Some(stream) = slot.as_mut() {
                    let mut buffer = [0; 1024];
                    match stream.read(&mut buffer) {
                        Ok(0) => gone = true,
                        Ok(read) => {
                            let text = String::from_utf8_lossy(&buffer[..read]);
                            if let Some(status) = text
                                .strip_prefix("HTTP/1.1 ")
                                .and_then(|t| t.get(..3))
                                .and_then(|t| t.parse().ok())
                            {
                                *answers.entry(status).or_insert(0) += 1;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => gone = true,
                    }
                    if send && stream.write_all(b" ").is_err() {
                        gone = true;
                    }
                }
                if gone {
                    *slot = connect();
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        answers
    })
}

/// `GET /healthz` on a connection of its own, given 1 s to connect and 1 s to answer: its status,
/// or 0 when it got none in time.
fn probe(addr: SocketAddr) -> u16 {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return 0;
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return 0;
    }
    let mut answer = [0; 64];
    match stream.read(&mut answer) {
        Ok(n) if n >= 12 => String::from_utf8_lossy(&answer[9..12]).parse().unwrap_or(0),
        _ => 0,
    }
}

/// 70 connections sending `/counters` bodies one byte every 2 s, more than the admin port's 64
/// connections: each is answered within 5 s (408, its body too slow) or at once (503, too many
/// bodies in flight) and closed, so that the kubelet's probe, every 250 ms for 12 s, is answered
/// every time; without the admin token and with a wrong one alike.
#[tokio::test(flavor = "multi_thread")]
async fn slow_bodies_on_every_admin_connection_never_starve_the_probes() {
    const ATTACKERS: usize = 70;
    const PROBES: usize = 48;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
    let path = file.display().to_string();
    let mut open_port = start_with(&[], None).await;
    let mut with_token = start_with(&["--admin-token-file", &path], None).await;
    let mut runs = Vec::new();
    for (sluice, token) in [(&open_port, None), (&with_token, Some("wrong"))] {
        let addr = sluice.http;
        let until = Instant::now() + Duration::from_secs(14);
        let attack = slow_bodies(addr, ATTACKERS, token, until);
        let probes = std::thread::spawn(move || {
            // Once every attacker is connected and sending.
            std::thread::sleep(Duration::from_secs(1));
            (0..PROBES)
                .map(|_| {
                    let status = probe(addr);
                    std::thread::sleep(Duration::from_millis(250));
                    status
                })
                .collect::<Vec<u16>>()
        });
        runs.push((token, attack, probes));
    }
    for (token, attack, probes) in runs {
        let probes = tokio::task::spawn_blocking(move || probes.join().unwrap())
            .await
            .unwrap();
        let answers = tokio::task::spawn_blocking(move || attack.join().unwrap())
            .await
            .unwrap();
        let answered = probes.iter().filter(|&&s| s == 200).count();
        assert_eq!(
            answered, PROBES,
            "token {token:?}: every probe answered past {ATTACKERS} slow bodies: {probes:?}; the \
             slow bodies got {answers:?}"
        );
        let timed_out = answers.get(&408).copied().unwrap_or(0);
        let busy = answers.get(&503).copied().unwrap_or(0);
        if token.is_none() {
            assert!(
                timed_out > 0 && busy > 0,
                "slow bodies are cut at 5 s, and the ones past half the connections at once: \
                 {answers:?}"
            );
        }
    }
    assert!(open_port.alive() && with_token.alive());
}
