#!/usr/bin/env python3
"""Checks every pod spec in the given rendered manifests against the "restricted" Pod Security
Standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/, the baseline
controls included), and the two rules this project adds: a read-only root filesystem and a
numeric non-root user. Prints each violation and exits 1 if there is any."""

import sys

import yaml

# Where each workload kind keeps its pod spec.
POD_SPEC_PATHS = {
    "Pod": ["spec"],
    "Deployment": ["spec", "template", "spec"],
    "StatefulSet": ["spec", "template", "spec"],
    "DaemonSet": ["spec", "template", "spec"],
    "ReplicaSet": ["spec", "template", "spec"],
    "ReplicationController": ["spec", "template", "spec"],
    "Job": ["spec", "template", "spec"],
    "CronJob": ["spec", "jobTemplate", "spec", "template", "spec"],
}
# Restricted: the only volume types allowed.
VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                "persistentVolumeClaim", "projected", "secret"}
# Baseline: the only sysctls allowed.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def pod_violations(pod):
    """The violations of one pod spec, each a sentence."""
    out = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} is true (baseline: host namespaces)")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {volume['name']} is a hostPath (baseline: hostPath volumes)")
        if not kinds <= VOLUME_TYPES:
            out.append(f"volume {volume['name']} has type {sorted(kinds - VOLUME_TYPES)} "
                       "(restricted: volume types)")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not a safe one (baseline: sysctls)")
    out += context_violations(psc)
    containers = [("container", c) for c in pod.get("containers") or []]
    containers += [("initContainer", c) for c in pod.get("initContainers") or []]
    containers += [("ephemeralContainer", c) for c in pod.get("ephemeralContainers") or []]
    for kind, container in containers:
        csc = container.get("securityContext") or {}
        where = f"{kind} {container.get('name')}"
        out += [f"{where}: {v}" for v in container_violations(container, csc, psc)]
        out += [f"{where}: {v}" for v in context_violations(csc)]
    return out


def context_violations(sc):
    """Baseline controls that apply alike to a pod's and a container's security context."""
    out = []
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("windowsOptions.hostProcess is true (baseline: HostProcess)")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("appArmorProfile is Unconfined (baseline: AppArmor)")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append("seLinuxOptions sets a user, role or type not allowed (baseline: SELinux)")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("seccompProfile is Unconfined (restricted: seccomp)")
    if sc.get("runAsUser") == 0:
        out.append("runAsUser is 0 (restricted: running as non-root user)")
    return out


def container_violations(container, csc, psc):
    """The controls that every container must meet, given its pod's security context."""
    out = []
    if csc.get("privileged"):
        out.append("privileged is true (baseline: privileged containers)")
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            out.append(f"hostPort {port['hostPort']} (baseline: host ports)")
    if csc.get("procMount") not in (None, "Default"):
        out.append("procMount is not Default (baseline: /proc mount type)")
    if csc.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation is not false (restricted: privilege escalation)")
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
        out.append("runAsNonRoot is not true in it or its pod (restricted: running as non-root)")
    seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append("seccompProfile is not RuntimeDefault or Localhost in it or its pod "
                   "(restricted: seccomp)")
    capabilities = csc.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        out.append("capabilities.drop lacks ALL (restricted: capabilities)")
    added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
    if added:
        out.append(f"capabilities.add has {sorted(added)} (restricted: capabilities)")
    if csc.get("readOnlyRootFilesystem") is not True:
        out.append("readOnlyRootFilesystem is not true (this project)")
    user = csc.get("runAsUser", psc.get("runAsUser"))
    if not isinstance(user, int) or user <= 0:
        out.append("no numeric non-root runAsUser in it or its pod (this project)")
    return out


def main(paths):
    failed = checked = 0
    for path in paths:
        with open(path) as f:
            documents = [d for d in yaml.safe_load_all(f) if d]
        for doc in documents:
            spec_path = POD_SPEC_PATHS.get(doc.get("kind"))
            if spec_path is None:
                continue
            pod = doc
            for key in spec_path:
                pod = (pod or {}).get(key)
            name = f"{path}: {doc['kind']}/{doc.get('metadata', {}).get('name')}"
            checked += 1
            for violation in pod_violations(pod or {}):
                print(f"{name}: {violation}", file=sys.stderr)
                failed += 1
    if checked == 0:
        print("no pod spec found in " + " ".join(paths), file=sys.stderr)
        return 1
    print(f"{checked} pod spec(s) checked against the restricted Pod Security Standard: "
          f"{failed} violation(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
