#!/usr/bin/env python3
"""Validates the Envoy configurations of the repository with a real Envoy (`--mode validate`):
every bootstrap under the given directories (a YAML file with `static_resources`), and the
filter, cluster and descriptor actions each Istio EnvoyFilter adds, assembled into a bootstrap.
Istio and Envoy Gateway resources have no schema in kubernetes-validate (their CRDs are not
Kubernetes'), so their YAML is checked for the kinds expected of it.

    envoy-configs.py ENVOY SCRATCH_DIR DIR…

Runs Envoy with SCRATCH_DIR as its working directory, so relative paths (examples/tls/certs/…)
are read from there. Prints each failure and exits 1 if there is any."""

import json
import pathlib
import subprocess
import sys

import yaml

# The kinds each directory may hold, by apiVersion.
EXPECTED_KINDS = {
    "deploy/istio": {("networking.istio.io/v1alpha3", "EnvoyFilter"),
                     ("kustomize.config.k8s.io/v1beta1", "Kustomization")},
    "deploy/envoy-gateway": {("gateway.envoyproxy.io/v1alpha1", "EnvoyGateway"),
                             ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy")},
}


def envoy_validate(envoy, scratch, config, label):
    """Runs `envoy --mode validate` on `config` (a path); returns a failure sentence or None."""
    run = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(config), "--disable-hot-restart", "-l", "error"],
        cwd=scratch, capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        return f"{label}: Envoy rejects it:\n{run.stdout}{run.stderr}"
    print(f"{label}: Envoy accepts it")
    return None


def envoy_filter_bootstrap(doc):
    """A bootstrap holding what an EnvoyFilter adds: its HTTP filters before the router, its
    clusters, and its virtual host fields on a route to a stand-in upstream."""
    filters, clusters, vhost = [], [], {}
    for patch in doc["spec"]["configPatches"]:
        value = patch["patch"]["value"]
        if patch["applyTo"] == "HTTP_FILTER":
            filters.append(value)
        elif patch["applyTo"] == "CLUSTER":
            clusters.append(value)
        elif patch["applyTo"] == "VIRTUAL_HOST":
            vhost.update(value)
        else:
            raise ValueError(f"a patch of {patch['applyTo']}, which this check does not assemble")
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"virtual_hosts": [dict(
            vhost, name="all", domains=["*"],
            routes=[{"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}])]},
        "http_filters": filters + [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/"
                                      "envoy.extensions.filters.http.router.v3.Router"}}],
    }
    upstream = {"name": "upstream", "type": "STATIC", "load_assignment": {
        "cluster_name": "upstream", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}
    return {"static_resources": {
        "listeners": [{"name": "ingress", "address": {"socket_address": {
            "address": "127.0.0.1", "port_value": 10000}}, "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": hcm}]}]}],
        "clusters": clusters + [upstream]}}


def main(envoy, scratch, roots):
    failures, bootstraps = [], 0
    for root in roots:
        for path in sorted(pathlib.Path(root).rglob("*.yaml")):
            try:
                docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
            except yaml.YAMLError as e:
                failures.append(f"{path}: not YAML: {e}")
                continue
            expected = next((kinds for prefix, kinds in EXPECTED_KINDS.items()
                             if path.as_posix().startswith(prefix + "/")), None)
            for doc in docs:
                # Rule files (a `domain`, no kind) are sluice's to check (tests/envoy/deploy.rs).
                if not isinstance(doc, dict) or ("domain" in doc and "kind" not in doc):
                    continue
                kind = (doc.get("apiVersion"), doc.get("kind"))
                if "static_resources" in doc:
                    bootstraps += 1
                    failures.append(envoy_validate(envoy, scratch, path.resolve(), str(path)))
                elif kind == ("networking.istio.io/v1alpha3", "EnvoyFilter"):
                    bootstraps += 1
                    assembled = pathlib.Path(scratch) / f"{path.stem}-bootstrap.json"
                    try:
                        assembled.write_text(json.dumps(envoy_filter_bootstrap(doc)))
                    except (KeyError, TypeError, ValueError) as e:
                        failures.append(f"{path}: an EnvoyFilter this check cannot read: {e!r}")
                        continue
                    label = f"{path} (EnvoyFilter {doc['metadata']['name']})"
                    failures.append(envoy_validate(envoy, scratch, assembled.resolve(), label))
                if expected is not None and kind not in expected:
                    failures.append(f"{path}: {kind[0]} {kind[1]} is not one of the kinds "
                                    f"expected here: {sorted(expected)}")
                elif expected is not None:
                    print(f"{path}: {kind[1]} ({kind[0]})")
    failures = [f for f in failures if f]
    for failure in failures:
        print(failure, file=sys.stderr)
    if bootstraps == 0:
        print("no Envoy configuration found under " + " ".join(roots), file=sys.stderr)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
