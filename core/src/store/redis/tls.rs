//! TLS to Redis (`rediss://` and the other TLS schemes): the CAs sluice trusts (`--redis-ca`, else
//! the system's) and the client certificate it presents (`--redis-cert`, `--redis-key`), read once
//! at start into one rustls configuration that every connection shares.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use fred::types::config::{TlsConfig, TlsConnector};
use rustls::ClientConfig;

use crate::certs::{self, PemFile};

/// How sluice speaks TLS to Redis.
#[derive(Clone)]
pub struct RedisTls(Arc<ClientConfig>);

impl RedisTls {
    /// The TLS configuration for `url`: trusting the CAs of the PEM file `ca` (`--redis-ca`,
    /// else the system's) and presenting the certificate chain and key of `identity`
    /// (`--redis-cert`, `--redis-key`) when given; `None` for a URL without TLS, which takes
    /// none of them.
    pub fn load(
        url: &str,
        ca: Option<&Path>,
        identity: Option<(&Path, &Path)>,
    ) -> anyhow::Result<Option<RedisTls>> {
        if !uses_tls(url) {
            let given = match (ca, identity) {
                (Some(_), _) => "--redis-ca",
                (None, Some(_)) => "--redis-cert and --redis-key",
                (None, None) => return Ok(None),
            };
            anyhow::bail!("{given}: only for a TLS --redis-url (rediss://…)");
        }
        let roots = match ca {
            Some(path) => {
                let file = PemFile::new("--redis-ca", path);
                file.roots(&file.read()?)?
            }
            None => {
                let roots = certs::system_roots();
                if roots.is_empty() {
                    anyhow::bail!(
                        "a TLS --redis-url without --redis-ca: no CA certificates found on the system to trust"
                    );
                }
                roots
            }
        };
        let builder = ClientConfig::builder_with_provider(certs::provider())
            .with_safe_default_protocol_versions()
            .context("the TLS provider")?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let (cert, key) = (
                    PemFile::new("--redis-cert", cert),
                    PemFile::new("--redis-key", key),
                );
                let chain = cert.certificates(&cert.read()?)?;
                builder
                    .with_client_auth_cert(chain, key.key(&key.read()?)?)
                    .map_err(|e| certs::refused_pair(&cert, &key, e))?
            }
        };
        Ok(Some(RedisTls(Arc::new(config))))
    }

    /// The connector fred makes its TLS connections with.
    pub(super) fn connector(&self) -> TlsConfig {
        TlsConnector::from(tokio_rustls::TlsConnector::from(self.0.clone())).into()
    }
}

/// Whether fred connects to `url` over TLS: its scheme starts with `rediss` or `valkeys`
/// (`rediss://`, `rediss-cluster://`, `rediss-sentinel://`…), as fred reads it.
fn uses_tls(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    let scheme = scheme.to_ascii_lowercase();
    scheme.starts_with("rediss") || scheme.starts_with("valkeys")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_schemes_are_told_from_plain_ones() {
        for url in [
            "rediss://h:6379",
            "rediss-cluster://h:1?node=h:2",
            "REDISS-SENTINEL://h:26379",
            "valkeys://h",
        ] {
            assert!(uses_tls(url), "{url}");
        }
        for url in [
            "redis://h:6379",
            "redis-cluster://h:1",
            "redis-sentinel://h",
            "h:6379",
        ] {
            assert!(!uses_tls(url), "{url}");
        }
    }

    #[test]
    fn tls_files_with_a_plain_url_are_refused() {
        let ca = Some(Path::new("ca.pem"));
        let error = RedisTls::load("redis://127.0.0.1:6379", ca, None)
            .err()
            .unwrap();
        assert_eq!(
            error.to_string(),
            "--redis-ca: only for a TLS --redis-url (rediss://…)"
        );
        assert!(
            RedisTls::load("redis://127.0.0.1:6379", None, None)
                .unwrap()
                .is_none()
        );
    }
}
