"""Tests of tests/deploy/kustomize_render.py without kubectl: names and data recorded from
`kubectl kustomize` (kustomize v5.5.0) for small kustomizations, and the refusals.

    python3 -m pytest tests/deploy -q -p no:cacheprovider
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kustomize_render as kr  # noqa: E402


def write(folder: Path, files: dict) -> Path:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return folder


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def test_generated_names_and_data_match_kustomize(tmp_path: Path) -> None:
    # Recorded from kubectl kustomize (v5.5.0) of this very kustomization.
    write(tmp_path, {
        "a.conf": 'x: 1\nwhy: "a < b & c"\n',
        "s.bin": bytes(range(80)),
        "t.txt": "short",
        "kustomization.yaml": "configMapGenerator:\n  - name: cfg\n    files: [a.conf]\n"
                              "secretGenerator:\n  - name: sec\n    files: [s.bin, t.txt]\n",
    })
    objs = by_kind(kr.render(str(tmp_path)))
    assert objs["ConfigMap"]["metadata"]["name"] == "cfg-m7t9g4fc52"
    assert objs["Secret"]["metadata"]["name"] == "sec-6bbgmgg98d"
    assert objs["Secret"]["type"] == "Opaque"
    assert objs["Secret"]["data"] == {
        "s.bin": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMz\n"
                 "Q1Njc4OTo7PD0+P0BBQkNERUZHSElKS0xNTk8=\n",
        "t.txt": "c2hvcnQ=",
    }


def test_overlay_patches_images_namespace_and_references(tmp_path: Path) -> None:
    write(tmp_path, {
        "base/c.conf": "a: 1\n",
        "base/ds.yaml": yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "d"},
            "spec": {"template": {"spec": {
                "containers": [{"name": "c", "image": "img:1", "resources": {"limits": {}}}],
                "volumes": [{"name": "v", "configMap": {"name": "cfg"}}]}}}}),
        "base/kustomization.yaml": "namespace: one\nresources: [ds.yaml]\n"
                                   "configMapGenerator:\n  - name: cfg\n    files: [c.conf]\n",
        "over/c.conf": "a: 2\n",
        "over/kustomization.yaml": (
            "namespace: two\nresources: [../base]\n"
            "images:\n  - name: img\n    newName: reg/img\n    newTag: '2'\n"
            "configMapGenerator:\n  - name: cfg\n    behavior: replace\n    files: [c.conf]\n"
            "patches:\n  - target: {kind: DaemonSet, name: d}\n    patch: |-\n"
            "      - op: add\n        path: /spec/template/spec/containers/0/resources/"
            "limits/nvidia.com~1gpu\n        value: 2\n"),
    })
    objs = by_kind(kr.render(str(tmp_path / "over")))
    ds, cm = objs["DaemonSet"], objs["ConfigMap"]
    assert ds["metadata"]["namespace"] == cm["metadata"]["namespace"] == "two"
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/img:2"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert cm["data"] == {"c.conf": "a: 2\n"}
    assert cm["metadata"]["name"] == "cfg-" + kr.kustomize_hash(cm)
    assert ds["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == \
        cm["metadata"]["name"]


@pytest.mark.parametrize("kustomization, message", [
    ("commonLabels: {a: b}\n", "does not implement: ['commonLabels']"),
    ("resources: [missing.yaml]\n", "resource missing.yaml not found"),
    ("configMapGenerator:\n  - name: x\n    literals: [a=b]\n", "not supported here"),
    ("configMapGenerator:\n  - name: x\n    behavior: replace\n    files: [f]\n",
     "nothing generated named x to replace"),
    ("resources: [p.yaml]\npatches:\n  - target: {kind: Pod, name: p}\n    patch: |-\n"
     "      - op: replace\n        path: /spec/nothere\n        value: 1\n", "no 'nothere'"),
    ("resources: [p.yaml]\npatches:\n  - path: patch.yaml\n", "only inline JSON 6902"),
])
def test_refuses_what_it_does_not_render(tmp_path: Path, kustomization: str,
                                         message: str) -> None:
    write(tmp_path, {"kustomization.yaml": kustomization, "f": "x",
                     "p.yaml": "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {}\n"})
    with pytest.raises(kr.RenderError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kr.render(str(tmp_path))


def test_json6902_operations() -> None:
    doc = {"a": [1, 2], "b": {"c": 1}}
    kr.apply_json6902(doc, [{"op": "add", "path": "/a/-", "value": 3},
                            {"op": "add", "path": "/a/0", "value": 0},
                            {"op": "remove", "path": "/b/c"},
                            {"op": "test", "path": "/a/3", "value": 3}], "t")
    assert doc == {"a": [0, 1, 2, 3], "b": {}}
    with pytest.raises(kr.RenderError, match="test failed"):
        kr.apply_json6902(doc, [{"op": "test", "path": "/a/0", "value": 9}], "t")
