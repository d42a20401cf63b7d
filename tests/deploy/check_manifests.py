#!/usr/bin/env python3
"""Checks a rendered gpurpc kustomization for what a schema cannot see.

kubernetes-validate knows the fields; this knows gpurpcd. For the daemon's DaemonSet it
reads the configuration file the pod will get (from the rendered ConfigMap) and checks the
two against each other and against what the daemon refuses at start:

* security: non-root (uid 10001), no privilege escalation, read-only root, every
  capability dropped, seccomp RuntimeDefault, no host namespaces or hostPath, no service
  account token;
* probes: native gRPC startup, readiness and liveness probes on the config's
  ``health_listen`` port; liveness slower to fail than the drain;
* drain: terminationGracePeriodSeconds > drain_timeout + 5 s (the daemon's stop);
* the command: gpurpcd with ``--config`` on the mounted ConfigMap and no flag that would
  override the file;
* paths: sockets and the compile cache one folder below an emptyDir (an emptyDir is mode
  0777 and root's: the daemon refuses such a folder for its socket or cache), the socket
  folder made by an init container (the daemon checks the folder above one it makes), the
  cache key
  under a writable mount, the credentials under the read-only Secret mount, with each key in
  the Secret, and the Secret's files not readable by others (the daemon refuses tokens
  others may read);
* resources: a GPU from the NVIDIA device plugin, CPU and memory requests, a memory limit;
* the headless Service and the PodDisruptionBudget select the pods (a DaemonSet's PDB: an
  integer minAvailable, the only form Kubernetes supports for it);
* metrics (``metrics_listen``, docs/METRICS.md): bound to 0.0.0.0 (or [::]) on a fixed port,
  the containerPort ``metrics`` and the pod's ``prometheus.io/{scrape,port,path}``
  annotations on that port and /metrics, the headless Service's port for it, no
  LoadBalancer or NodePort Service reaching it, and a NetworkPolicy selecting the pods that
  admits the metrics port only from selected namespaces or pods (the endpoint has no
  credentials and names tenants) while still admitting the gRPC and health ports; without
  ``metrics_listen`` no metrics port or scrape annotation.

    check_manifests.py RENDERED.yaml [--secret FILE] [--write-config DIR]

``--secret`` names a Secret manifest to check the credential keys against when the render
has none (the base: base/secret.example.yaml). ``--write-config`` writes each checked
configuration file there, for ``gpurpcd --config`` to parse. Prints one line per problem and
exits 1 when there is any.
"""
from __future__ import annotations

import argparse
import os
import posixpath
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

import yaml

Obj = Dict[str, Any]
STOP_SECONDS = 5  # after the drain: the daemon's server shutdown and the workers' stop
DAEMON = "/opt/gpurpc/bin/gpurpcd"


def strip_comment(line: str) -> str:
    """The line without its # comment (a # inside a "string" stays)."""
    quoted = False
    for i, char in enumerate(line):
        if char == '"' and (i == 0 or line[i - 1] != "\\"):
            quoted = not quoted
        elif char == "#" and not quoted:
            return line[:i]
    return line


def parse_config(text: str) -> Dict[str, str]:
    """The top-level scalar fields of a protobuf text-format DaemonConfig (the last of a
    repeated one); messages (quotas) are skipped. The daemon itself parses the whole file
    (check-kubernetes.sh runs it on the file this writes)."""
    fields: Dict[str, str] = {}
    depth = 0
    for raw in text.splitlines():
        line = strip_comment(raw).strip()
        if not line:
            continue
        if depth == 0:
            match = re.fullmatch(r'([a-z_]+)\s*:\s*("(?:[^"\\]|\\.)*"|[^\s{]+)', line)
            if match:
                value = match.group(2)
                fields[match.group(1)] = value[1:-1] if value.startswith('"') else value
        depth += line.count("{") - line.count("}")
    return fields


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 20s, 1m30s, 500ms (absl::ParseDuration's units)."""
    if text == "0":
        return 0.0
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration")
    return sum(float(n) * units[u] for n, u in parts)


def port_of(address: str) -> Optional[int]:
    match = re.fullmatch(r".*:(\d+)", address)
    return int(match.group(1)) if match else None


def labels_match(selector: Obj, labels: Dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    if "matchExpressions" in selector:
        return False  # not used here; refuse rather than guess
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def selector_is_empty(selector: Optional[Obj]) -> bool:
    """A LabelSelector that selects everything ({} or no labels and no expressions)."""
    return not (selector or {}).get("matchLabels") and not (selector or {}).get(
        "matchExpressions")


def split_host_port(address: str) -> Tuple[str, Optional[int]]:
    """HOST:PORT or [IPV6]:PORT as the daemon takes it: (host, port or None)."""
    match = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]*):(\d+)", address)
    if not match:
        return address, None
    return match.group(1), int(match.group(2))


def is_loopback(host: str) -> bool:
    return host in ("localhost", "[::1]") or host.startswith("127.")


def rule_admits_port(rule: Obj, number: int, name: Optional[str]) -> bool:
    """Whether a NetworkPolicy ingress rule covers TCP port ``number`` (named ``name`` in
    the container): no ports means every port; a port entry without a port means every port
    of its protocol; a named port matches the container's name; endPort makes a range."""
    entries = rule.get("ports")
    if not entries:
        return True
    for entry in entries:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        port = entry.get("port")
        if port is None:
            return True
        if isinstance(port, str) and not port.isdigit():
            if name is not None and port == name:
                return True
            continue
        low = int(port)
        if low == number or low <= number <= int(entry.get("endPort", low)):
            return True
    return False


def peer_too_broad(peer: Obj) -> Optional[str]:
    """Why a NetworkPolicy peer admits more than chosen namespaces or pods, or None. A peer
    must name namespaces (a non-empty namespaceSelector, whose labels only those who may
    label namespaces can set) or, without a namespaceSelector, pods of the policy's own
    namespace by non-empty labels; an ipBlock may not be a /0."""
    if "ipBlock" in peer:
        cidr = str(peer["ipBlock"].get("cidr", ""))
        if cidr.endswith("/0"):
            return f"ipBlock {cidr} is every address"
        return None
    if "namespaceSelector" in peer:
        if selector_is_empty(peer["namespaceSelector"]):
            return "an empty namespaceSelector admits pods of every namespace"
        return None
    if "podSelector" in peer:
        if selector_is_empty(peer["podSelector"]):
            return "an empty podSelector admits every pod of the namespace"
        return None
    return "a peer without a selector"


def under(path: str, mount: str) -> bool:
    return posixpath.commonpath([path, mount]) == mount


class Checker:
    def __init__(self, objs: List[Obj], extra_secret: Optional[Obj]):
        self.objs = objs
        self.extra_secret = extra_secret
        self.problems: List[str] = []
        self.configs: Dict[str, str] = {}

    def fail(self, what: str) -> None:
        self.problems.append(what)

    def find(self, kind: str, name: str) -> Optional[Obj]:
        for obj in self.objs:
            if obj.get("kind") == kind and obj["metadata"]["name"] == name:
                return obj
        if (kind == "Secret" and self.extra_secret is not None
                and self.extra_secret["metadata"]["name"] == name):
            return self.extra_secret
        return None

    def run(self) -> None:
        workloads = [o for o in self.objs if o.get("kind") in ("DaemonSet", "StatefulSet")]
        if len(workloads) != 1:
            self.fail(f"expected one DaemonSet or StatefulSet, found {len(workloads)}")
            return
        self.check_workload(workloads[0])

    def check_workload(self, ws: Obj) -> None:
        name = f"{ws['kind']} {ws['metadata']['name']}"
        template = ws["spec"]["template"]
        pod = template["spec"]
        pod_labels = template["metadata"].get("labels") or {}
        self.pod_annotations: Dict[str, str] = template["metadata"].get("annotations") or {}
        if not labels_match(ws["spec"]["selector"], pod_labels):
            self.fail(f"{name}: its selector does not match its pod labels")
        psc = pod.get("securityContext") or {}
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                self.fail(f"{name}: {key} is set")
        if pod.get("automountServiceAccountToken") is not False:
            self.fail(f"{name}: automountServiceAccountToken is not false (gpurpcd needs no "
                      "Kubernetes API)")
        if psc.get("runAsNonRoot") is not True:
            self.fail(f"{name}: pod securityContext.runAsNonRoot is not true")
        if psc.get("runAsUser") != 10001:
            self.fail(f"{name}: pod securityContext.runAsUser is {psc.get('runAsUser')}, not "
                      "the image's 10001")
        if psc.get("fsGroup") is None:
            self.fail(f"{name}: no fsGroup (the Secret's files would be root's alone)")
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        for volume in volumes.values():
            if "hostPath" in volume:
                self.fail(f"{name}: volume {volume['name']} is a hostPath")
        containers = [c for c in pod.get("containers") or []
                      if DAEMON in (c.get("command") or []) + (c.get("args") or [])]
        if len(containers) != 1:
            self.fail(f"{name}: expected one container running {DAEMON} (command), found "
                      f"{len(containers)}")
            return
        self.check_container(name, pod, psc, volumes, containers[0], pod_labels)

    def check_security(self, where: str, psc: Obj, c: Obj) -> None:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            self.fail(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            self.fail(f"{where}: readOnlyRootFilesystem is not true")
        if sc.get("privileged"):
            self.fail(f"{where}: privileged")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            self.fail(f"{where}: capabilities.drop lacks ALL")
        if caps.get("add"):
            self.fail(f"{where}: adds capabilities {caps['add']}")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp != "RuntimeDefault":
            self.fail(f"{where}: seccompProfile is {seccomp}, not RuntimeDefault")
        if sc.get("runAsUser", psc.get("runAsUser")) in (0, None):
            self.fail(f"{where}: runs as root")
        res = c.get("resources") or {}
        if "memory" not in (res.get("limits") or {}):
            self.fail(f"{where}: no memory limit")

    def check_container(self, name: str, pod: Obj, psc: Obj, volumes: Dict[str, Obj],
                        c: Obj, pod_labels: Dict[str, str]) -> None:
        where = f"{name} container {c['name']}"
        for other in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            self.check_security(f"{name} container {other['name']}", psc, other)

        # The command: gpurpcd --config=PATH and nothing else after it.
        argv = (c.get("command") or []) + (c.get("args") or [])
        after = argv[argv.index(DAEMON) + 1:]
        config_args = [a for a in after if a.startswith("--config=")]
        if len(config_args) != 1 or len(after) != 1:
            self.fail(f"{where}: {DAEMON} must get exactly --config=PATH (flags override the "
                      f"file); got {after}")
            return
        config_path = config_args[0][len("--config="):]

        mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
        for path, mount in mounts.items():
            if mount["name"] not in volumes:
                self.fail(f"{where}: mount {path} names no volume {mount['name']}")

        def mount_for(path: str) -> Optional[Tuple[str, Obj, Obj]]:
            best = None
            for mpath, mount in mounts.items():
                if under(path, mpath) and (best is None or len(mpath) > len(best[0])):
                    best = (mpath, mount, volumes.get(mount["name"], {}))
            return best

        found = mount_for(config_path)
        if found is None or "configMap" not in found[2]:
            self.fail(f"{where}: --config {config_path} is not on a ConfigMap mount")
            return
        mpath, _, volume = found
        cm_name = volume["configMap"]["name"]
        cm = self.find("ConfigMap", cm_name)
        key = posixpath.relpath(config_path, mpath)
        if cm is None or key not in (cm.get("data") or {}):
            self.fail(f"{where}: ConfigMap {cm_name} with key {key} (the config) is missing")
            return
        text = cm["data"][key]
        self.configs[cm_name] = text
        config = parse_config(text)

        # Ports and probes.
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        listen_port = port_of(config.get("listen", ""))
        health_port = port_of(config.get("health_listen", ""))
        if listen_port is None or ports.get("grpc") != listen_port:
            self.fail(f"{where}: containerPort grpc {ports.get('grpc')} is not the config's "
                      f"listen {config.get('listen')}")
        if health_port is None or ports.get("health") != health_port:
            self.fail(f"{where}: containerPort health {ports.get('health')} is not the config's "
                      f"health_listen {config.get('health_listen')}")
        if not config.get("health_listen", "").startswith("0.0.0.0:"):
            self.fail(f"{where}: health_listen {config.get('health_listen')} is not reachable "
                      "by the kubelet (0.0.0.0:PORT)")
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(probe_name)
            if not probe or "grpc" not in probe:
                self.fail(f"{where}: no native gRPC {probe_name}")
                continue
            if probe["grpc"].get("port") != health_port:
                self.fail(f"{where}: {probe_name} probes port {probe['grpc'].get('port')}, not "
                          f"the health listener's {health_port}")
            if probe["grpc"].get("service", ""):
                self.fail(f"{where}: {probe_name} asks for service "
                          f"{probe['grpc']['service']!r}; the daemon reports only \"\"")

        # Drain.
        try:
            drain = parse_duration(config.get("drain_timeout", "20s"))
        except ValueError as e:
            self.fail(f"{where}: drain_timeout: {e}")
            drain = 20.0
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= drain + STOP_SECONDS:
            self.fail(f"{name}: terminationGracePeriodSeconds {grace} does not exceed "
                      f"drain_timeout {drain:g} s + {STOP_SECONDS} s to stop: the kubelet "
                      "would kill the daemon mid-drain")
        live = c.get("livenessProbe") or {}
        window = live.get("periodSeconds", 10) * live.get("failureThreshold", 3)
        if live and window <= drain:
            self.fail(f"{where}: livenessProbe fails after {window} s of NOT_SERVING, within "
                      f"the {drain:g} s drain: it would restart a draining daemon")

        # Resources.
        res = c.get("resources") or {}
        gpus = (res.get("limits") or {}).get("nvidia.com/gpu")
        if not isinstance(gpus, int) or gpus < 1:
            self.fail(f"{where}: limits nvidia.com/gpu is {gpus!r}, not a count >= 1")
        for kind, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
            if key not in (res.get(kind) or {}):
                self.fail(f"{where}: no {kind}.{key}")

        # Writable paths: below an emptyDir, and the socket and cache folders strictly so.
        for field, strict in (("unix_socket", True), ("region_socket", True),
                              ("cache_dir", False), ("cache_key_file", True)):
            path = config.get(field)
            if not path:
                continue
            folder = path if field == "cache_dir" else posixpath.dirname(path)
            found = mount_for(folder)
            if found is None or "emptyDir" not in found[2] or found[1].get("readOnly"):
                self.fail(f"{where}: {field} {path} is not on a writable emptyDir")
            elif folder == found[0] and field != "cache_key_file":
                self.fail(f"{where}: {field} {path}: {folder} is the emptyDir itself (mode "
                          "0777, root's); the daemon refuses it: use a folder below it")
            elif field == "cache_key_file" and under(path, config.get("cache_dir", "/nonexistent")):
                self.fail(f"{where}: cache_key_file {path} is inside the cache")
            elif field.endswith("socket") and not any(
                    "mkdir" in posixpath.basename(str((i.get("command") or [""])[0]))
                    and folder in (i.get("command") or []) + (i.get("args") or [])
                    for i in pod.get("initContainers") or []):
                # The daemon checks the folder above one it creates: the emptyDir (0777).
                self.fail(f"{where}: {field} {path}: no init container makes {folder} (the "
                          "daemon would refuse the emptyDir above it)")
        for env in c.get("env") or []:
            if env.get("name") == "CUDA_CACHE_PATH":
                found = mount_for(env.get("value", ""))
                if found is None or "emptyDir" not in found[2]:
                    self.fail(f"{where}: CUDA_CACHE_PATH {env.get('value')} is not on an emptyDir")

        # Credentials.
        for field in ("tokens_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = config.get(field)
            if not path:
                if field in ("tokens_file", "tls_cert", "tls_key"):
                    self.fail(f"{where}: the config has no {field}")
                continue
            found = mount_for(path)
            if found is None or "secret" not in found[2]:
                self.fail(f"{where}: {field} {path} is not on a Secret mount")
                continue
            if not found[1].get("readOnly"):
                self.fail(f"{where}: the Secret mount {found[0]} is not readOnly")
            secret_volume = found[2]["secret"]
            mode = secret_volume.get("defaultMode", 0o644)
            if mode & 0o007:
                self.fail(f"{where}: Secret volume mode {mode:04o} lets others read the "
                          "credentials; the daemon refuses such a tokens file")
            secret = self.find("Secret", secret_volume["secretName"])
            key = posixpath.relpath(path, found[0])
            if secret is None:
                self.fail(f"{where}: no Secret {secret_volume['secretName']} to check {field} "
                          "against (give --secret)")
            elif key not in (secret.get("data") or {}) and key not in (secret.get("stringData")
                                                                      or {}):
                self.fail(f"{where}: Secret {secret_volume['secretName']} has no key {key} "
                          f"({field})")

        # Service and PodDisruptionBudget.
        services = [o for o in self.objs if o.get("kind") == "Service"]
        headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
        if not headless:
            self.fail("no headless Service (clusterIP: None)")
        for svc in services:
            if not labels_match(svc["spec"].get("selector") or {}, pod_labels):
                self.fail(f"Service {svc['metadata']['name']}: its selector misses the pods")
            for port in svc["spec"].get("ports") or []:
                target = port.get("targetPort", port["port"])
                if target not in ports and target not in ports.values():
                    self.fail(f"Service {svc['metadata']['name']}: targetPort {target} is no "
                              "port of the daemon")
        self.check_metrics(name, where, config, c, pod_labels, listen_port, health_port)
        pdbs = [o for o in self.objs if o.get("kind") == "PodDisruptionBudget"]
        if not pdbs:
            self.fail("no PodDisruptionBudget")
        for pdb in pdbs:
            spec = pdb["spec"]
            if not labels_match(spec.get("selector") or {}, pod_labels):
                self.fail(f"PodDisruptionBudget {pdb['metadata']['name']}: selector misses the "
                          "pods")
            if name.startswith("DaemonSet") and ("maxUnavailable" in spec
                                                 or not isinstance(spec.get("minAvailable"),
                                                                   int)):
                self.fail(f"PodDisruptionBudget {pdb['metadata']['name']}: a DaemonSet's pods "
                          "take only an integer minAvailable")

    def check_metrics(self, name: str, where: str, config: Dict[str, str], c: Obj,
                      pod_labels: Dict[str, str], listen_port: Optional[int],
                      health_port: Optional[int]) -> None:
        """metrics_listen against the pod's port and annotations, the Services and the
        NetworkPolicies (docs/METRICS.md: no credentials, and the metrics name tenants)."""
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        annotations = self.pod_annotations
        scrape = annotations.get("prometheus.io/scrape")
        address = config.get("metrics_listen", "")
        policies = [o for o in self.objs if o.get("kind") == "NetworkPolicy"]
        selecting = []
        for policy in policies:
            spec = policy.get("spec") or {}
            selector = spec.get("podSelector") or {}
            if not (selector_is_empty(selector) or labels_match(selector, pod_labels)):
                self.fail(f"NetworkPolicy {policy['metadata']['name']}: its podSelector "
                          "misses the pods")
                continue
            types = spec.get("policyTypes") or ["Ingress"]
            if "Ingress" in types:
                selecting.append(policy)
        # Whatever restricts the pods must still let the clients and the kubelet in.
        for port, port_name in ((listen_port, "grpc"), (health_port, "health")):
            if port is None or not selecting:
                continue
            if not any(rule_admits_port(rule, port, port_name)
                       for policy in selecting for rule in policy["spec"].get("ingress") or []):
                self.fail(f"NetworkPolicy {', '.join(p['metadata']['name'] for p in selecting)}"
                          f": no ingress rule admits the {port_name} port {port}")

        if not address:
            if "metrics" in ports:
                self.fail(f"{where}: containerPort metrics {ports['metrics']}, but the config "
                          "has no metrics_listen")
            if scrape == "true":
                self.fail(f"{name}: annotation prometheus.io/scrape is \"true\", but the config "
                          "has no metrics_listen")
            return
        host, port = split_host_port(address)
        if port is None or port == 0:
            self.fail(f"{where}: metrics_listen {address!r} needs a fixed HOST:PORT (the pod "
                      "declares the port)")
            return
        if is_loopback(host):
            # Inside the pod only (a sidecar could read it): nothing may point Prometheus at it.
            if "metrics" in ports or scrape == "true":
                self.fail(f"{where}: metrics_listen {address} is loopback, which Prometheus "
                          "cannot reach, yet the pod declares a metrics port or scrape annotation")
            return
        if host not in ("0.0.0.0", "[::]"):
            self.fail(f"{where}: metrics_listen {address}: bind 0.0.0.0:{port} (the pod's "
                      "address is not known beforehand)")
        if ports.get("metrics") != port:
            self.fail(f"{where}: containerPort metrics {ports.get('metrics')} is not the "
                      f"config's metrics_listen {address}")
        for key, wanted in (("prometheus.io/scrape", "true"), ("prometheus.io/port", str(port)),
                            ("prometheus.io/path", "/metrics")):
            if annotations.get(key) != wanted:
                self.fail(f"{name}: pod annotation {key} is {annotations.get(key)!r}, not "
                          f"{wanted!r} (metrics_listen {address})")
        scheme = annotations.get("prometheus.io/scheme", "http")
        if scheme != "http":
            self.fail(f"{name}: pod annotation prometheus.io/scheme is {scheme!r}; the "
                      "metrics endpoint speaks plain http")

        def targets_metrics(svc_port: Obj) -> bool:
            target = svc_port.get("targetPort", svc_port["port"])
            return target == "metrics" or target == port

        for svc in [o for o in self.objs if o.get("kind") == "Service"]:
            spec = svc["spec"]
            reaches = [p for p in spec.get("ports") or [] if targets_metrics(p)]
            if spec.get("clusterIP") == "None" and not reaches:
                self.fail(f"Service {svc['metadata']['name']}: no port for the metrics "
                          f"(targetPort metrics): a ServiceMonitor could not select it")
            if spec.get("type") in ("LoadBalancer", "NodePort") and reaches:
                self.fail(f"Service {svc['metadata']['name']}: {spec['type']} exposes the "
                          "metrics port (no credentials, names tenants) outside the cluster")

        # Every NetworkPolicy admits what any of them admits: each rule reaching the metrics
        # port must name its sources, and one must exist at all.
        if not selecting:
            self.fail(f"no NetworkPolicy selects the pods: metrics_listen {address} (no "
                      "credentials, names tenants) is open to every pod of the cluster")
            return
        admitted = False
        for policy in selecting:
            for index, rule in enumerate(policy["spec"].get("ingress") or []):
                if not rule_admits_port(rule, port, "metrics"):
                    continue
                here = (f"NetworkPolicy {policy['metadata']['name']} ingress rule {index} "
                        f"(admits the metrics port {port})")
                admitted = True
                peers = rule.get("from") or []
                if not peers:
                    self.fail(f"{here}: it has no 'from', so every source may scrape the "
                              "metrics (no credentials, names tenants)")
                    continue
                for peer in peers:
                    why = peer_too_broad(peer)
                    if why:
                        self.fail(f"{here}: {why}")
        if not admitted:
            self.fail(f"NetworkPolicy {', '.join(p['metadata']['name'] for p in selecting)}: "
                      f"no rule admits the metrics port {port}: Prometheus could not scrape")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rendered")
    parser.add_argument("--secret", help="a Secret manifest for the credential keys")
    parser.add_argument("--write-config", metavar="DIR")
    args = parser.parse_args(argv[1:])
    with open(args.rendered, encoding="utf-8") as f:
        objs = [o for o in yaml.safe_load_all(f) if o]
    secret = None
    if args.secret:
        with open(args.secret, encoding="utf-8") as f:
            secret = yaml.safe_load(f)
    checker = Checker(objs, secret)
    checker.run()
    for problem in checker.problems:
        print(f"{args.rendered}: {problem}")
    if args.write_config:
        os.makedirs(args.write_config, exist_ok=True)
        for name, text in checker.configs.items():
            with open(os.path.join(args.write_config, f"{name}.conf"), "w",
                      encoding="utf-8") as f:
                f.write(text)
    if not checker.configs and not checker.problems:
        print(f"{args.rendered}: no daemon configuration found")
        return 1
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
