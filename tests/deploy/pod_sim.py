#!/usr/bin/env python3
"""Runs gpurpcd as the rendered DaemonSet's pod would, on this machine, and uses it.

No cluster here, so this lays out what the kubelet would, under a scratch root: every
emptyDir as the kubelet makes it (mode 2777, root's, group fsGroup), the ConfigMap and the
Secret the way the kubelet writes them (files behind ``..data`` symlinks, the Secret with its
defaultMode, group fsGroup), the config file with each of its paths moved under the scratch
root; then starts the daemon as the pod's user and groups (uid 10001, when run as root) with
the pod's command, overriding only ``--backend=fake`` (no GPU) and ``--cuda-include-dir``
(the image's copy of the headers is not here), with its listeners (gRPC, health and, where the
config has ``metrics_listen``, metrics) on loopback ports.

Then, as a client outside the pod would: the gRPC health check the probes make answers
SERVING; ``gpurpc ping`` over TLS with the generated CA and token, checking the certificate
against the Service's DNS name; a wrong token is refused; a session compiles and loads a
kernel (the compile sandbox, the cache below the emptyDir, the cache key); SIGTERM turns
health NOT_SERVING while that session stays open; closing it lets the daemon exit 0 within
the drain. With ``metrics_listen``, as Prometheus would (a plain HTTP GET on the pod
annotations' ``prometheus.io/path``): the answer is the text format 0.0.4, parsed strictly,
with ``gpurpc_`` metrics; it counts the tenant's open session and the calls made, and shows
``gpurpc_draining 1`` after SIGTERM.

    pod_sim.py --daemon BIN --rendered OVERLAY.yaml --credentials DIR --tenant NAME --work DIR
"""
from __future__ import annotations

import argparse
import base64
import os
import posixpath
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

import grpc
import yaml

Obj = Dict[str, Any]
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"

CLIENT = r"""
import sys
import gpurpc.driver as cuda
from gpurpc.compiler import SourceModule
cuda.init()
ctx = cuda.Device(0).make_context()
# A name the fake backend knows (it runs no device code); NVRTC compiles it for real.
module = SourceModule("extern \"C\" __global__ void add_one_f32(float* x, unsigned long long n) "
                      "{ unsigned long long i = threadIdx.x; if (i < n) x[i] += 1.0f; }", no_extern_c=True)
module.get_function("add_one_f32")
print("session open", flush=True)
sys.stdin.readline()   # until told to close
ctx.detach()
print("session closed", flush=True)
"""


class SimError(Exception):
    pass


Sample = Tuple[str, Dict[str, str], float]
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
_LABEL_NC = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|Inf|NaN)"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL_NC}(?:,{_LABEL_NC})*,?)?)\}})? ({_VALUE})"
                     r"(?: -?[0-9]+)?")
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


def parse_exposition(text: str) -> List[Sample]:
    """The samples of a Prometheus text-format (0.0.4) answer, checked as a scraper would:
    every line a comment, a HELP or TYPE line, or a sample; each sample of a family whose
    TYPE came first (a histogram's _bucket, _sum and _count, and a summary's _sum and
    _count, belong to it); a histogram's buckets with an le label. SimError names the
    first line that is wrong."""
    types: Dict[str, str] = {}
    samples: List[Sample] = []
    if text and not text.endswith("\n"):
        raise SimError("the metrics text does not end in a newline")
    for number, line in enumerate(text.splitlines(), 1):
        where = f"metrics line {number} {line!r}"
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if not re.fullmatch(_NAME, parts[2]):
                    raise SimError(f"{where}: {parts[2]!r} is not a metric name")
                if parts[1] == "TYPE":
                    if len(parts) != 4 or parts[3] not in _TYPES:
                        raise SimError(f"{where}: not one of the types {_TYPES}")
                    if parts[2] in types:
                        raise SimError(f"{where}: a second TYPE for {parts[2]}")
                    types[parts[2]] = parts[3]
            continue
        match = _SAMPLE.fullmatch(line)
        if not match:
            raise SimError(f"{where}: not a sample (name{{labels}} value)")
        name, label_text, value = match.group(1), match.group(2) or "", match.group(3)
        labels: Dict[str, str] = {}
        for key, escaped in re.findall(_LABEL, label_text):
            if key in labels:
                raise SimError(f"{where}: label {key} twice")
            labels[key] = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1),
                                 escaped)
        family = name
        for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")),
                              ("_count", ("histogram", "summary"))):
            if name.endswith(suffix) and types.get(name[:-len(suffix)]) in kinds:
                family = name[:-len(suffix)]
        if family not in types:
            raise SimError(f"{where}: no TYPE line before the sample of {name}")
        if types[family] == "histogram" and name.endswith("_bucket") and "le" not in labels:
            raise SimError(f"{where}: a histogram bucket without le")
        samples.append((name, labels, float(value)))
    return samples


def sample_sum(samples: List[Sample], name: str, **labels: str) -> Optional[float]:
    """The sum of the samples of ``name`` whose labels include ``labels``; None if none."""
    values = [v for n, ls, v in samples
              if n == name and all(ls.get(k) == want for k, want in labels.items())]
    return sum(values) if values else None


def scrape(url: str) -> List[Sample]:
    """GET url as Prometheus does: HTTP 200, the text format's Content-Type, parsed."""
    request = urllib.request.Request(url, headers={
        "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"})
    # Straight to the pod, as Prometheus does: no http_proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=5) as answer:
            status = answer.status
            content_type = answer.headers.get("Content-Type", "")
            body = answer.read().decode("utf-8")
    except (urllib.error.URLError, OSError, UnicodeDecodeError) as e:
        raise SimError(f"GET {url}: {e}")
    if status != 200:
        raise SimError(f"GET {url}: HTTP {status}")
    media = [p.strip() for p in content_type.split(";")]
    if media[0] != "text/plain" or "version=0.0.4" not in media[1:]:
        raise SimError(f"GET {url}: Content-Type {content_type!r} is not the Prometheus text "
                       "format (text/plain; version=0.0.4)")
    samples = parse_exposition(body)
    if not any(name.startswith("gpurpc_") for name, _, _ in samples):
        raise SimError(f"GET {url}: no gpurpc_ metric in the answer:\n{body[:2000]}")
    return samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(address: str) -> Optional[bytes]:
    """The health service's answer for service "" (what a grpc probe asks), None if none."""
    with grpc.insecure_channel(address) as channel:
        try:
            return channel.unary_unary(HEALTH_CHECK)(b"", timeout=2)
        except grpc.RpcError:
            return None


def write_projected(folder: str, files: Dict[str, bytes], mode: int, gid: Optional[int]) -> None:
    """A ConfigMap or Secret volume as the kubelet writes it (atomic writer layout)."""
    stamp = os.path.join(folder, "..2025_01_01_00_00_00.000000001")
    os.makedirs(stamp)
    for key, data in files.items():
        path = os.path.join(stamp, key)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, 0, gid)
            os.chmod(path, mode | 0o440)  # the kubelet adds group read for fsGroup
    os.symlink(os.path.basename(stamp), os.path.join(folder, "..data"))
    for key in files:
        os.symlink(os.path.join("..data", key), os.path.join(folder, key))


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--rendered", required=True)
    parser.add_argument("--credentials", required=True, help="make-credentials.sh's OUTDIR")
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--work", required=True, help="an empty scratch folder (short path)")
    parser.add_argument("--cuda-include-dir", default="/usr/local/cuda/include")
    args = parser.parse_args(argv[1:])
    try:
        run(args)
    except SimError as e:
        print(f"pod_sim.py: FAILED: {e}", file=sys.stderr)
        return 1
    print("pod_sim.py: ok")
    return 0


def run(args: argparse.Namespace) -> None:
    with open(args.rendered, encoding="utf-8") as f:
        objs = [o for o in yaml.safe_load_all(f) if o]
    ds = next((o for o in objs if o["kind"] == "DaemonSet"), None)
    if ds is None:
        raise SimError(f"{args.rendered} has no DaemonSet")
    namespace = ds["metadata"]["namespace"]
    service = next(o for o in objs if o["kind"] == "Service"
                   and o["spec"].get("clusterIP") == "None")["metadata"]["name"]
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    psc = pod["securityContext"]
    as_root = os.geteuid() == 0
    gid = psc["fsGroup"] if as_root else None
    volumes = {v["name"]: v for v in pod["volumes"]}

    root = os.path.realpath(args.work)
    if os.listdir(root):
        raise SimError(f"--work {root} is not empty")
    os.chmod(root, 0o755)
    if as_root:  # the pod's user must reach the scratch root
        for folder in [os.path.dirname(root)] + [p for p in _ancestors(root)]:
            if not os.stat(folder).st_mode & 0o001:
                raise SimError(f"{folder} is not searchable by others: the daemon's user "
                               f"{psc['runAsUser']} could not reach --work {root}")
    config_path = None
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        folder = root + mount["mountPath"]
        os.makedirs(os.path.dirname(folder), mode=0o755, exist_ok=True)
        if "emptyDir" in volume:
            os.makedirs(folder)
            os.chmod(folder, 0o2777 if gid is not None else 0o777)
            if gid is not None:
                os.chown(folder, 0, gid)
        elif "configMap" in volume:
            cm = next(o for o in objs if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"] == volume["configMap"]["name"])
            files = {k: v.encode() for k, v in cm["data"].items()}
            os.makedirs(folder)
            write_projected(folder, files, volume["configMap"].get("defaultMode", 0o644), gid)
        elif "secret" in volume:
            secret = next(o for o in objs if o["kind"] == "Secret"
                          and o["metadata"]["name"] == volume["secret"]["secretName"])
            files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
            os.makedirs(folder)
            write_projected(folder, files, volume["secret"].get("defaultMode", 0o644), gid)
        else:
            raise SimError(f"volume {mount['name']}: a kind this simulation does not lay out")
    argv = container["command"]
    daemon_at = argv.index("/opt/gpurpc/bin/gpurpcd")
    config_arg = argv[daemon_at + 1]
    config_path = config_arg[len("--config="):]

    # The config, its paths moved under the scratch root and its listeners onto loopback.
    mount_paths = [m["mountPath"] for m in container["volumeMounts"]]
    with open(root + config_path, encoding="utf-8") as f:
        text = f.read()

    def move(match: "re.Match[str]") -> str:
        path = match.group(1)
        if any(posixpath.commonpath([path, m]) == m for m in mount_paths):
            return f'"{root}{path}"'
        return match.group(0)

    text = re.sub(r'"(/[^"]*)"', move, text)
    port, health_port = free_port(), free_port()
    text = re.sub(r'(?m)^listen: "[^"]*"', f'listen: "127.0.0.1:{port}"', text)
    text = re.sub(r'(?m)^health_listen: "[^"]*"', f'health_listen: "127.0.0.1:{health_port}"',
                  text)
    # The metrics listener too, where there is one; Prometheus's URL from the annotations.
    metrics_url = None
    configured = re.findall(r'(?m)^metrics_listen:\s*"([^"]*)"', text)
    if configured and configured[-1]:
        metrics_port = free_port()
        text = re.sub(r'(?m)^metrics_listen:\s*"[^"]*"',
                      f'metrics_listen: "127.0.0.1:{metrics_port}"', text)
        annotations = ds["spec"]["template"]["metadata"].get("annotations") or {}
        path = annotations.get("prometheus.io/path", "/metrics")
        metrics_url = f"http://127.0.0.1:{metrics_port}{path}"
    sim_config = os.path.join(root, "sim-gpurpcd.conf")
    with open(sim_config, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(sim_config, 0o644)

    setpriv = (["setpriv", f"--reuid={psc['runAsUser']}", f"--regid={psc['runAsGroup']}",
                f"--groups={psc['fsGroup']}", "--no-new-privs", "--"] if as_root else [])
    # The init containers' commands, their paths moved too.
    for init in pod.get("initContainers") or []:
        init_argv = [root + a if any(a.startswith(m + "/") or a == m for m in mount_paths)
                     else a for a in (init.get("command") or []) + (init.get("args") or [])]
        done = subprocess.run(setpriv + init_argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise SimError(f"init container {init['name']}: {init_argv}: {done.stderr}")
        print(f"pod_sim.py: init container {init['name']}: {' '.join(init_argv)}")

    command = [args.daemon, f"--config={sim_config}", "--backend=fake",
               f"--cuda-include-dir={args.cuda_include_dir}"]
    command = setpriv + command
    log_path = os.path.join(root, "daemon.log")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LD_LIBRARY_PATH")}
    env["HOME"] = "/nonexistent"
    for item in container.get("env") or []:
        value = item["value"]
        env[item["name"]] = root + value if value.startswith("/") else value
    print("pod_sim.py: " + " ".join(command))
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd="/")
    client = None
    try:
        health_address = f"127.0.0.1:{health_port}"
        deadline = time.monotonic() + 60
        while health(health_address) != SERVING:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SimError("the daemon did not become SERVING:\n" + tail(log_path))
            time.sleep(0.2)
        print("pod_sim.py: health (the probes' call) answers SERVING")
        if metrics_url is not None:
            samples = scrape(metrics_url)
            backend = [ls.get("backend") for n, ls, _ in samples if n == "gpurpc_build_info"]
            if backend != ["fake"]:
                raise SimError(f"GET {metrics_url}: gpurpc_build_info's backend is {backend}, "
                               "not the simulation's ['fake']")
            print(f"pod_sim.py: GET {metrics_url} (as Prometheus, over HTTP): "
                  f"{len(samples)} samples of the text format 0.0.4, "
                  f"{len({n for n, _, _ in samples if n.startswith('gpurpc_')})} gpurpc_ names")

        client_env = dict(os.environ)
        for name in list(client_env):
            if name.startswith("GPURPC"):
                del client_env[name]
        client_env.update({
            "GPURPC_ADDRESS": f"127.0.0.1:{port}", "GPURPC_TLS": "1",
            "GPURPC_TLS_CA": os.path.join(args.credentials, "ca.crt"),
            "GPURPC_TLS_SERVER_NAME": f"{service}.{namespace}.svc.cluster.local",
            "GPURPC_TOKEN_FILE": os.path.join(args.credentials, f"token.{args.tenant}"),
        })
        ping = subprocess.run([sys.executable, "-m", "gpurpc", "ping", "-n", "2"],
                              env=client_env, capture_output=True, text=True, timeout=60)
        if ping.returncode != 0:
            raise SimError(f"gpurpc ping over TLS with the token failed:\n{ping.stdout}"
                           f"{ping.stderr}\n{tail(log_path)}")
        print("pod_sim.py: gpurpc ping over TLS (certificate checked as "
              f"{service}.{namespace}.svc.cluster.local) with {args.tenant}'s token: ok")
        wrong = subprocess.run([sys.executable, "-m", "gpurpc", "--token", "gpurpc_" + "0" * 64,
                                "ping", "-n", "1"], env=client_env, capture_output=True,
                               text=True, timeout=60)
        if wrong.returncode == 0 or "UNAUTHENTICATED" not in (wrong.stdout + wrong.stderr):
            raise SimError("a wrong token was not refused as UNAUTHENTICATED:\n"
                           f"{wrong.stdout}{wrong.stderr}")
        print("pod_sim.py: a wrong token: UNAUTHENTICATED")

        client = subprocess.Popen([sys.executable, "-c", CLIENT], env=client_env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        line = client.stdout.readline()
        if line.strip() != "session open":
            raise SimError(f"the session did not open and compile: {line}{client.stdout.read()}"
                           f"\n{tail(log_path)}")
        print("pod_sim.py: a session compiled and loaded a kernel")
        if metrics_url is not None:
            samples = scrape(metrics_url)
            tenant = args.tenant
            wanted = [
                ("gpurpc_sessions", {"tenant": tenant, "state": "active"}, lambda v: v == 1,
                 "1 (the open session)"),
                ("gpurpc_sessions_opened_total", {"tenant": tenant}, lambda v: v == 1, "1"),
                ("gpurpc_rpcs_total",
                 {"method": "/gpurpc.v1.DeviceService/GetServerInfo", "code": "OK"},
                 lambda v: v >= 2, ">= 2 (gpurpc ping -n 2)"),
            ]
            for name, labels, good, meaning in wanted:
                value = sample_sum(samples, name, **labels)
                if value is None or not good(value):
                    raise SimError(f"GET {metrics_url}: {name}{labels} is {value}, not "
                                   f"{meaning}")
            compiles = ((sample_sum(samples, "gpurpc_compile_cache_hits_total") or 0)
                        + (sample_sum(samples, "gpurpc_compile_cache_misses_total") or 0))
            if compiles < 1:
                raise SimError(f"GET {metrics_url}: the compile was not counted (hits + misses "
                               f"{compiles})")
            print(f"pod_sim.py: the metrics count {tenant}'s open session, the pings and the "
                  "compile")
        daemon.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while health(health_address) != NOT_SERVING:
            if time.monotonic() > deadline:
                raise SimError("after SIGTERM health did not turn NOT_SERVING:\n"
                               + tail(log_path))
            time.sleep(0.1)
        if daemon.poll() is not None:
            raise SimError("the daemon exited at SIGTERM with a session open (no drain)")
        print("pod_sim.py: SIGTERM: health NOT_SERVING, the open session goes on (drain)")
        if metrics_url is not None:
            # The daemon turns health NOT_SERVING first, then starts the drain: poll briefly.
            deadline = time.monotonic() + 5
            while (draining := sample_sum(scrape(metrics_url), "gpurpc_draining")) != 1:
                if time.monotonic() > deadline:
                    raise SimError(f"GET {metrics_url} while draining: gpurpc_draining is "
                                   f"{draining}, not 1")
                time.sleep(0.1)
            print("pod_sim.py: while draining the metrics are still served: gpurpc_draining 1")
        client.stdin.write("\n")
        client.stdin.flush()
        out = client.communicate(timeout=30)[0]
        if client.returncode != 0:
            raise SimError(f"closing the session failed: {out}")
        try:
            code = daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise SimError("the daemon did not exit after its last session closed:\n"
                           + tail(log_path))
        if code != 0:
            raise SimError(f"the daemon exited {code}:\n{tail(log_path)}")
        print("pod_sim.py: the session closed, the daemon exited 0")
        log = open(log_path, encoding="utf-8", errors="replace").read()
        sandbox = re.search(r"compile sandbox: (.*)", log)
        print(f"pod_sim.py: the daemon reported compile sandbox: "
              f"{sandbox.group(1) if sandbox else '(not logged)'}")
    finally:
        for proc in (client, daemon):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _ancestors(path: str) -> List[str]:
    parts = []
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        parts.append(path)
    return parts


def tail(path: str, lines: int = 30) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
