//! The `openssl` command, for the certificates and keys the TLS tests need.

use std::process::{Command, Stdio};

/// Runs `openssl` with `args`, which must succeed.
pub fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("openssl runs (install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
