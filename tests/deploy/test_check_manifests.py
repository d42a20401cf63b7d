"""Tests of tests/deploy/check_manifests.py on the rendered deploy/kubernetes: the base and the
example overlay pass, and each way of breaking the metrics wiring (docs/METRICS.md) is caught
with a message that names it.

    python3 -m pytest tests/deploy -q -p no:cacheprovider
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_manifests as cm  # noqa: E402
import kustomize_render as kr  # noqa: E402

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
Obj = Dict[str, Any]


@pytest.fixture(scope="module")
def base() -> List[Obj]:
    return kr.render(str(K8S / "base"))


@pytest.fixture(scope="module")
def secret() -> Obj:
    with open(K8S / "base" / "secret.example.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def problems(objs: List[Obj], secret: Obj) -> List[str]:
    checker = cm.Checker(objs, secret)
    checker.run()
    return checker.problems


def one(objs: List[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def daemon(objs: List[Obj]) -> Obj:
    return one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def annotations(objs: List[Obj]) -> Dict[str, str]:
    return one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]


def set_config(objs: List[Obj], field: str, value: str) -> None:
    """Sets (or with value "" removes) a top-level field of the rendered gpurpcd.conf."""
    data = one(objs, "ConfigMap")["data"]
    text, count = re.subn(rf'(?m)^{field}:.*\n', f'{field}: "{value}"\n' if value else "",
                          data["gpurpcd.conf"])
    assert count == 1
    data["gpurpcd.conf"] = text


def metrics_port_entry(objs: List[Obj]) -> Obj:
    return next(p for p in daemon(objs)["ports"] if p["name"] == "metrics")


def policy(objs: List[Obj]) -> Obj:
    return one(objs, "NetworkPolicy")


def headless(objs: List[Obj]) -> Obj:
    return next(o for o in objs if o["kind"] == "Service" and o["spec"]["clusterIP"] == "None")


def test_the_base_passes_and_wires_metrics(base: List[Obj], secret: Obj) -> None:
    assert problems(base, secret) == []
    config = cm.parse_config(one(base, "ConfigMap")["data"]["gpurpcd.conf"])
    assert config["metrics_listen"] == "0.0.0.0:9464"
    assert metrics_port_entry(base)["containerPort"] == 9464
    assert annotations(base) == {"prometheus.io/scrape": "true", "prometheus.io/port": "9464",
                                 "prometheus.io/path": "/metrics"}
    assert policy(base)["metadata"]["namespace"] == "gpurpc"


def test_the_example_overlay_passes(tmp_path: Path) -> None:
    # Its secretGenerator reads credentials/ (made by make-credentials.sh, ignored by git):
    # any files do for the renderer and the keys.
    copy_root = tmp_path / "kubernetes"
    shutil.copytree(K8S, copy_root, ignore=shutil.ignore_patterns("credentials"))
    credentials = copy_root / "overlays" / "example" / "credentials"
    credentials.mkdir()
    for name in ("tls.crt", "tls.key", "tokens"):
        (credentials / name).write_text(f"{name}\n")
    objs = kr.render(str(copy_root / "overlays" / "example"))
    assert problems(objs, None) == []
    rule = policy(objs)["spec"]["ingress"][1]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "observability"}
    assert rule["ports"] == [{"port": 9464, "protocol": "TCP"}]


def _port(objs: List[Obj]) -> None:
    metrics_port_entry(objs)["containerPort"] = 9465


def _config_port(objs: List[Obj]) -> None:
    set_config(objs, "metrics_listen", "0.0.0.0:9465")


def _no_port(objs: List[Obj]) -> None:
    daemon(objs)["ports"].remove(metrics_port_entry(objs))


def _annotation_port(objs: List[Obj]) -> None:
    annotations(objs)["prometheus.io/port"] = "9465"


def _annotation_path(objs: List[Obj]) -> None:
    annotations(objs)["prometheus.io/path"] = "/"


def _no_scrape(objs: List[Obj]) -> None:
    del annotations(objs)["prometheus.io/scrape"]


def _https(objs: List[Obj]) -> None:
    annotations(objs)["prometheus.io/scheme"] = "https"


def _loopback_but_declared(objs: List[Obj]) -> None:
    set_config(objs, "metrics_listen", "127.0.0.1:9464")


def _specific_host(objs: List[Obj]) -> None:
    set_config(objs, "metrics_listen", "10.0.0.7:9464")


def _port_zero(objs: List[Obj]) -> None:
    set_config(objs, "metrics_listen", "0.0.0.0:0")


def _off_but_declared(objs: List[Obj]) -> None:
    set_config(objs, "metrics_listen", "")


def _no_policy(objs: List[Obj]) -> None:
    objs.remove(policy(objs))


def _policy_misses(objs: List[Obj]) -> None:
    policy(objs)["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] = "other"


def _egress_only(objs: List[Obj]) -> None:
    policy(objs)["spec"]["policyTypes"] = ["Egress"]


def _metrics_from_anywhere(objs: List[Obj]) -> None:
    del policy(objs)["spec"]["ingress"][1]["from"]


def _every_namespace(objs: List[Obj]) -> None:
    policy(objs)["spec"]["ingress"][1]["from"] = [{"namespaceSelector": {}}]


def _every_pod_here(objs: List[Obj]) -> None:
    policy(objs)["spec"]["ingress"][1]["from"] = [{"podSelector": {}}]


def _every_address(objs: List[Obj]) -> None:
    policy(objs)["spec"]["ingress"][1]["from"] = [{"ipBlock": {"cidr": "0.0.0.0/0"}}]


def _grpc_rule_all_ports(objs: List[Obj]) -> None:
    del policy(objs)["spec"]["ingress"][0]["ports"]


def _grpc_rule_range(objs: List[Obj]) -> None:
    # 50051-50052, and by mistake a range that holds the metrics port, from anywhere.
    policy(objs)["spec"]["ingress"][0]["ports"] = [{"port": 50051, "endPort": 50052},
                                                   {"port": 9000, "endPort": 9500}]


def _no_metrics_rule(objs: List[Obj]) -> None:
    del policy(objs)["spec"]["ingress"][1]


def _no_grpc_rule(objs: List[Obj]) -> None:
    del policy(objs)["spec"]["ingress"][0]


def _service_without_metrics(objs: List[Obj]) -> None:
    ports = headless(objs)["spec"]["ports"]
    ports[:] = [p for p in ports if p["name"] != "metrics"]


def _load_balancer_with_metrics(objs: List[Obj]) -> None:
    svc = copy.deepcopy(headless(objs))
    svc["metadata"]["name"] = "gpurpc-external"
    svc["spec"] = {"type": "LoadBalancer", "selector": svc["spec"]["selector"],
                   "ports": svc["spec"]["ports"]}
    objs.append(svc)


@pytest.mark.parametrize("breaks, message", [
    (_port, "containerPort metrics 9465 is not the config's metrics_listen 0.0.0.0:9464"),
    (_config_port, "containerPort metrics 9464 is not the config's metrics_listen "
                   "0.0.0.0:9465"),
    (_no_port, "containerPort metrics None is not the config's metrics_listen"),
    (_annotation_port, "pod annotation prometheus.io/port is '9465', not '9464'"),
    (_annotation_path, "pod annotation prometheus.io/path is '/', not '/metrics'"),
    (_no_scrape, "pod annotation prometheus.io/scrape is None, not 'true'"),
    (_https, "prometheus.io/scheme is 'https'"),
    (_loopback_but_declared, "metrics_listen 127.0.0.1:9464 is loopback"),
    (_specific_host, "metrics_listen 10.0.0.7:9464: bind 0.0.0.0:9464"),
    (_port_zero, "needs a fixed HOST:PORT"),
    (_off_but_declared, "containerPort metrics 9464, but the config has no metrics_listen"),
    (_no_policy, "no NetworkPolicy selects the pods"),
    (_policy_misses, "NetworkPolicy gpurpc: its podSelector misses the pods"),
    (_egress_only, "no NetworkPolicy selects the pods"),
    (_metrics_from_anywhere, "ingress rule 1 (admits the metrics port 9464): it has no 'from'"),
    (_every_namespace, "an empty namespaceSelector admits pods of every namespace"),
    (_every_pod_here, "an empty podSelector admits every pod of the namespace"),
    (_every_address, "ipBlock 0.0.0.0/0 is every address"),
    (_grpc_rule_all_ports, "ingress rule 0 (admits the metrics port 9464): it has no 'from'"),
    (_grpc_rule_range, "ingress rule 0 (admits the metrics port 9464): it has no 'from'"),
    (_no_metrics_rule, "no rule admits the metrics port 9464"),
    (_no_grpc_rule, "no ingress rule admits the grpc port 50051"),
    (_service_without_metrics, "Service gpurpc: no port for the metrics"),
    (_load_balancer_with_metrics, "Service gpurpc-external: LoadBalancer exposes the metrics"),
])
def test_broken_metrics_wiring_is_caught(base: List[Obj], secret: Obj,
                                         breaks: Callable[[List[Obj]], None],
                                         message: str) -> None:
    objs = copy.deepcopy(base)
    breaks(objs)
    found = problems(objs, secret)
    assert any(message in p for p in found), found


def test_metrics_off_needs_no_port_annotation_or_policy(base: List[Obj], secret: Obj) -> None:
    objs = copy.deepcopy(base)
    set_config(objs, "metrics_listen", "")
    _no_port(objs)
    del annotations(objs)["prometheus.io/scrape"]
    _service_without_metrics(objs)
    objs.remove(policy(objs))
    assert problems(objs, secret) == []
    # A scrape annotation with nothing behind it is still wrong.
    annotations(objs)["prometheus.io/scrape"] = "true"
    assert any("prometheus.io/scrape is \"true\", but the config has no metrics_listen" in p
               for p in problems(objs, secret))


def test_metrics_on_loopback_only_is_accepted(base: List[Obj], secret: Obj) -> None:
    objs = copy.deepcopy(base)
    set_config(objs, "metrics_listen", "127.0.0.1:9464")
    _no_port(objs)
    del annotations(objs)["prometheus.io/scrape"]
    _service_without_metrics(objs)
    assert problems(objs, secret) == []


def test_named_ports_and_ipv6_wildcard(base: List[Obj], secret: Obj) -> None:
    objs = copy.deepcopy(base)
    set_config(objs, "metrics_listen", "[::]:9464")
    rules = policy(objs)["spec"]["ingress"]
    rules[0]["ports"] = [{"port": "grpc"}, {"port": "health"}]
    rules[1]["ports"] = [{"port": "metrics"}]
    assert problems(objs, secret) == []
    rules[1]["ports"] = [{"port": "metrics", "protocol": "UDP"}]
    assert any("no rule admits the metrics port 9464" in p for p in problems(objs, secret))


def test_rule_admits_port() -> None:
    assert cm.rule_admits_port({}, 9464, "metrics")
    assert cm.rule_admits_port({"ports": [{"protocol": "TCP"}]}, 9464, None)
    assert cm.rule_admits_port({"ports": [{"port": 9000, "endPort": 9999}]}, 9464, None)
    assert not cm.rule_admits_port({"ports": [{"port": 9000, "endPort": 9400}]}, 9464, None)
    assert not cm.rule_admits_port({"ports": [{"port": "metrics"}]}, 9464, "other")
    assert not cm.rule_admits_port({"ports": [{"port": 9464, "protocol": "SCTP"}]}, 9464, None)


def test_split_host_port() -> None:
    assert cm.split_host_port("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert cm.split_host_port("[::]:9464") == ("[::]", 9464)
    assert cm.split_host_port("[::1]:1") == ("[::1]", 1)
    assert cm.split_host_port("9464") == ("9464", None)
    assert cm.split_host_port("::1:9464") == ("::1:9464", None)
