//! Asking a running server's admin HTTP port, as `sluice top` and `sluice counters` do: its
//! address, and the admin token when the server asks for one (`--admin-token-file`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long one ask may take, connection included.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read.
const MOST_ANSWER_BYTES: usize = 16 << 20;

/// A server's admin port, and how to be let in.
#[derive(clap::Args, Clone, Debug)]
pub struct Admin {
    /// The admin HTTP address of the server, HOST:PORT or http://HOST:PORT (an unspecified IP
    /// such as 0.0.0.0 asked on loopback).
    #[arg(long = "admin", env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:8080", value_parser = parse_admin)]
    pub addr: String,
    /// A file holding the server's admin token (its first line), sent as
    /// `Authorization: Bearer <token>`.
    #[arg(long, env = "SLUICE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

impl Admin {
    /// Asks `method path` with a JSON `body`: the status and the answer's body.
    pub async fn ask(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let token = match &self.admin_token_file {
            Some(file) => {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("--admin-token-file {}", file.display()))?;
                Some(text.lines().next().unwrap_or_default().trim().to_owned())
            }
            None => None,
        };
        let exchange = async {
            let stream = TcpStream::connect(&self.addr).await?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(connection);
            let mut request = Request::builder()
                .method(method)
                .uri(path)
                .header(HOST, &self.addr);
            if let Some(token) = &token {
                request = request.header(AUTHORIZATION, format!("Bearer {token}"));
            }
            if body.is_some() {
                request = request.header(CONTENT_TYPE, "application/json");
            }
            let request = request.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
            let response = sender.send_request(request).await?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MOST_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("reading {path}: {e}"))?
                .to_bytes();
            anyhow::Ok((status, body))
        };
        tokio::time::timeout(ASK_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "no answer within {}",
                    humantime::format_duration(ASK_TIMEOUT)
                )
            })?
    }
}

/// `HOST:PORT` from an admin address or an `http://` URL, an unspecified IP made loopback.
fn parse_admin(text: &str) -> Result<String, String> {
    let rest = text.strip_prefix("http://").unwrap_or(text);
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() || authority.contains('@') || text.starts_with("https://") {
        return Err(format!("'{text}' is not HOST:PORT or http://HOST:PORT"));
    }
    match authority.parse::<SocketAddr>() {
        Ok(mut addr) if addr.ip().is_unspecified() => {
            addr.set_ip(match addr {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
            Ok(addr.to_string())
        }
        Ok(addr) => Ok(addr.to_string()),
        Err(_) if authority.contains(':') => Ok(authority.to_owned()),
        Err(_) => Ok(format!("{authority}:80")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admin_address_is_read_from_an_address_or_a_url() {
        assert_eq!(parse_admin("127.0.0.1:6070").unwrap(), "127.0.0.1:6070");
        assert_eq!(
            parse_admin("http://0.0.0.0:8080/").unwrap(),
            "127.0.0.1:8080"
        );
        assert_eq!(parse_admin("http://admin.local").unwrap(), "admin.local:80");
        assert!(parse_admin("https://x:1").is_err());
        assert!(parse_admin("http://u@x:1").is_err());
    }
}
