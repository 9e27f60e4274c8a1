//! The files under deploy/ as they are shipped: the sidecar example's Envoy config (the very file
//! its ConfigMap is generated from) run by a real Envoy in front of sluice with the sidecar's
//! rules, and every rule file under deploy/ accepted by `sluice check-config`. The manifests
//! themselves are validated by scripts/validate-deploy.

use std::process::Command;

use support::envoy::{
    Envoy, UPSTREAM_BODY, Upstream, envoy_binary, get_with_headers, header, replaced_once,
};
use support::{MINUTE, Sluice, Store, in_one_window, repo_file};

/// The sidecar example, as kustomize reads it.
const SIDECAR: &str = "deploy/kubernetes/sidecar";

/// The sidecar's Envoy config made runnable on a test machine, by a textual substitution of
/// exactly these strings, each of which must appear once: the fixed ports of the pod (listener
/// 10000, admin 9901, the app 8000, sluice 8081) become free loopback ports, the listener's
/// 0.0.0.0 becomes 127.0.0.1, and the filter's 100 ms timeout (ample on a pod's loopback) becomes
/// 5 s, so that a debug build on a busy machine always answers: a late answer would let a
/// request through uncounted and make the counts below a matter of chance.
fn sidecar_envoy_config(listener: u16, admin: u16, app: u16, sluice: u16) -> String {
    replaced_once(
        &format!("{SIDECAR}/envoy.yaml"),
        &[
            ("port_value: 10000", format!("port_value: {listener}")),
            ("port_value: 9901", format!("port_value: {admin}")),
            ("port_value: 8000", format!("port_value: {app}")),
            ("port_value: 8081", format!("port_value: {sluice}")),
            ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
            ("timeout: 0.1s", "timeout: 5s".to_owned()),
        ],
    )
}

/// rules/app.yaml: 60 requests a minute per client address, of which 5 may be logins.
const PER_ADDRESS: usize = 60;
const LOGINS: usize = 5;

#[tokio::test(flavor = "multi_thread")]
async fn the_sidecar_envoy_config_limits_as_the_sidecar_rules_say() {
    in_one_window(MINUTE, async || {
        let binary = envoy_binary();
        let rules = std::fs::read_to_string(repo_file(&format!("{SIDECAR}/rules/app.yaml")))
            .expect("the sidecar's rules/app.yaml");
        let sluice = Sluice::on(Store::Memory, &[("app.yaml", &rules)], &[]).await;
        let upstream = Upstream::start();
        let envoy = Envoy::launch(&binary, &|listener, admin| {
            sidecar_envoy_config(
                listener.port(),
                admin.port(),
                upstream.addr.port(),
                sluice.grpc.port(),
            )
        });

        let served_before = upstream.served();
        let get = |path: &str| get_with_headers(envoy.listener, path, &[]);

        // Logins: their own limit of 5 is the tighter one, and each also spends the per-address one
        // (Envoy names the tightest, then every policy).
        for left in (0..LOGINS).rev() {
            let (status, headers, body) = get("/login");
            assert_eq!(status, 200, "login with {left} left: {headers:?} {body}");
            assert_eq!(body, UPSTREAM_BODY);
            assert_eq!(
                header(&headers, "x-ratelimit-limit"),
                Some(format!("{LOGINS}, {PER_ADDRESS};w=60, {LOGINS};w=60").as_str())
            );
            assert_eq!(
                header(&headers, "x-ratelimit-remaining"),
                Some(left.to_string().as_str())
            );
        }
        let (status, headers, _) = get("/login");
        assert_eq!(status, 429, "the sixth login: {headers:?}");
        assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));

        // Other paths: what the logins left of the 60 per address (a denied login charged nothing).
        for left in (0..PER_ADDRESS - LOGINS).rev() {
            let (status, headers, body) = get("/");
            assert_eq!(status, 200, "request with {left} left: {headers:?} {body}");
            assert_eq!(
                header(&headers, "x-ratelimit-remaining"),
                Some(left.to_string().as_str())
            );
        }
        let (status, headers, _) = get("/");
        assert_eq!(status, 429, "past 60 a minute: {headers:?}");
        assert_eq!(
            header(&headers, "x-ratelimit-limit"),
            Some(format!("{PER_ADDRESS}, {PER_ADDRESS};w=60").as_str())
        );

        // The probe route spends nothing and stays open.
        let (status, _, body) = get("/probe");
        assert_eq!((status, body.as_str()), (200, UPSTREAM_BODY));
        assert_eq!(
            upstream.served() - served_before,
            PER_ADDRESS + 1,
            "the upstream sees the admitted requests and the probe, nothing denied"
        );
        let stats = envoy.stats("cluster.app.ratelimit.");
        assert_eq!(stats.get("error").copied().unwrap_or(0), 0, "{stats:?}");
        assert_eq!(
            stats.get("failure_mode_allowed").copied().unwrap_or(0),
            0,
            "{stats:?}"
        );
    })
    .await;
}

#[test]
fn every_rule_directory_under_deploy_passes_check_config() {
    let mut dirs = Vec::new();
    let mut pending = vec![repo_file("deploy")];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|name| name == "rules") {
                    dirs.push(path.clone());
                }
                pending.push(path);
            }
        }
    }
    dirs.sort();
    assert!(
        dirs.len() >= 3,
        "the sidecar's, the standalone's and Istio's rules: {dirs:?}"
    );
    for dir in dirs {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("check-config")
            .arg(&dir)
            .output()
            .expect("sluice runs");
        assert!(
            out.status.success(),
            "{}: {}{}",
            dir.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
