//! Certificates and private keys read from PEM files for TLS, on the gRPC server and towards
//! Redis and the xDS server alike: every error names the flag and the file it came from. Also
//! the system's CAs, and the one crypto provider that every TLS configuration of sluice uses.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// ring: the provider the Redis client is built with, so one crypto library serves every
/// connection.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The system's trusted CAs (none when it has none); certificates it cannot parse are skipped,
/// as other TLS clients do.
pub fn system_roots() -> RootCertStore {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!("reading the system's CA certificates: {e}");
    }
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    roots
}

/// A PEM file, and the flag that named it.
#[derive(Clone, Debug)]
pub struct PemFile {
    flag: &'static str,
    path: PathBuf,
}

impl fmt::Display for PemFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.flag, self.path.display())
    }
}

impl PemFile {
    pub fn new(flag: &'static str, path: &Path) -> Self {
        PemFile {
            flag,
            path: path.to_owned(),
        }
    }

    /// The file's bytes.
    pub fn read(&self) -> anyhow::Result<Vec<u8>> {
        std::fs::read(&self.path).with_context(|| format!("{self}: cannot read the file"))
    }

    /// The certificates in `pem`, in file order (for a chain: the leaf first).
    pub fn certificates(&self, pem: &[u8]) -> anyhow::Result<Vec<CertificateDer<'static>>> {
        let certificates = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("{self}: not a PEM file"))?;
        if certificates.is_empty() {
            anyhow::bail!("{self}: no certificate (BEGIN CERTIFICATE) in the file");
        }
        Ok(certificates)
    }

    /// The CA certificates in `pem`, as the roots a peer's certificate must chain to.
    pub fn roots(&self, pem: &[u8]) -> anyhow::Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        for certificate in self.certificates(pem)? {
            roots
                .add(certificate)
                .with_context(|| format!("{self}: not a usable CA certificate"))?;
        }
        Ok(roots)
    }

    /// The first private key in `pem`: PKCS#8, PKCS#1 (RSA) or SEC1 (EC), unencrypted.
    pub fn key(&self, pem: &[u8]) -> anyhow::Result<PrivateKeyDer<'static>> {
        PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
            pem::Error::NoItemsFound => anyhow!(
                "{self}: no unencrypted private key (BEGIN PRIVATE KEY, RSA PRIVATE KEY or \
                 EC PRIVATE KEY) in the file"
            ),
            e => anyhow!("{self}: not a PEM file: {e}"),
        })
    }
}

/// Why rustls refused the certificate chain of `cert` with the key of `key`.
pub fn refused_pair(cert: &PemFile, key: &PemFile, error: rustls::Error) -> anyhow::Error {
    match error {
        rustls::Error::InconsistentKeys(_) => {
            anyhow!("{key}: not the private key of the certificate in {cert}")
        }
        error => anyhow!("{cert} with {key}: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_flag_and_the_file() {
        let file = PemFile::new("--tls-cert", Path::new("/nowhere/cert.pem"));
        let read = file.read().unwrap_err();
        assert!(
            format!("{read:#}").starts_with("--tls-cert /nowhere/cert.pem: cannot read"),
            "{read:#}"
        );
        let empty = file.certificates(b"").unwrap_err();
        assert_eq!(
            empty.to_string(),
            "--tls-cert /nowhere/cert.pem: no certificate (BEGIN CERTIFICATE) in the file"
        );
        let key = PemFile::new("--tls-key", Path::new("k.pem"));
        let cert_as_key = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let error = key.key(cert_as_key).unwrap_err().to_string();
        assert!(
            error.starts_with("--tls-key k.pem: no unencrypted private key"),
            "{error}"
        );
    }
}
