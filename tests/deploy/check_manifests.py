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
  integer minAvailable, the only form Kubernetes supports for it).

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
