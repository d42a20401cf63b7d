#!/usr/bin/env python3
"""A small kustomize: renders the kustomizations under deploy/kubernetes offline.

Neither Debian 12 nor PyPI carries kustomize (or kubectl, which embeds it), so CI renders
with this. It implements exactly the part of kustomize that deploy/kubernetes uses, the way
kustomize v5 does it, and refuses everything else by name, so that a kustomization growing a
feature it does not know fails loudly instead of rendering wrong:

* ``resources``: manifest files and folders holding a kustomization (rendered first);
* ``configMapGenerator`` / ``secretGenerator``: ``files`` (``KEY=PATH`` or ``PATH``),
  ``type`` for secrets, ``behavior`` ``create`` or ``replace``; the name gets kustomize's
  content hash suffix and every reference from a pod template follows it;
* ``patches``: inline JSON 6902 patches (add, remove, replace, test) with a ``target`` of
  ``kind`` and ``name``;
* ``namespace``: set on every namespaced resource;
* ``images``: ``name`` with ``newName``, ``newTag`` and/or ``digest``.

Where kubectl (kustomize) is installed, tests/deploy/check-kubernetes.sh renders with both and
requires the same objects, which keeps this file honest.

    python3 tests/deploy/kustomize_render.py deploy/kubernetes/overlays/example > out.yaml
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import yaml

Obj = Dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator",
                "secretGenerator", "patches", "images"}
# Kinds without a namespace among those a kustomization here may hold.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "RuntimeClass", "StorageClass", "PersistentVolume",
                  "CustomResourceDefinition"}
WORKLOAD_KINDS = {"DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"}


class RenderError(Exception):
    """A kustomization this renderer cannot render (or that kustomize would refuse)."""


def _load_yaml_documents(path: str) -> List[Obj]:
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "metadata" not in doc:
            raise RenderError(f"{path}: a document is not a Kubernetes object "
                              "(no kind or metadata)")
    return docs


def _kustomization_path(folder: str) -> str:
    for name in KUSTOMIZATION_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise RenderError(f"{folder}: no kustomization.yaml")


def kustomize_hash(obj: Obj) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret (api/hasher): SHA-256 of
    Go's JSON encoding of {kind, name, data[, type]}, first 10 hex digits with 0 1 3 a e
    replaced by g h k m t (no vowels, no look-alikes).

    The name in that encoding is always "": kustomize looks it up with the single path
    element "metadata/name", which matches no field (checked against kustomize v5.5), so two
    generators differing only in name get the same suffix."""
    encoded: Obj = {"kind": obj["kind"], "name": "", "data": obj.get("data") or {}}
    if obj["kind"] == "Secret":
        encoded["type"] = obj.get("type", "Opaque")
    elif obj["kind"] != "ConfigMap":
        raise RenderError(f"no content hash for kind {obj['kind']}")
    if obj.get("binaryData"):
        encoded["binaryData"] = obj["binaryData"]
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # encoding/json escapes these as well.
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def kustomize_base64(data: bytes) -> str:
    """Base64 the way kustomize's secretGenerator writes it (kyaml's encodeBase64): when the
    text is 70 characters or more, every 70-character line, the last one too, ends in a
    newline (the API server's decoder skips them); shorter text has none. The content hash
    covers these newlines, so they matter."""
    text = base64.b64encode(data).decode("ascii")
    if len(text) // 70 + 1 == 1:
        return text
    return "".join(text[i:i + 70] + "\n" for i in range(0, len(text), 70))


def _generator_data(folder: str, spec: Obj, where: str) -> Dict[str, bytes]:
    unknown = set(spec) - {"name", "files", "behavior", "type"}
    if unknown:
        raise RenderError(f"{where}: fields not supported here: {sorted(unknown)}")
    if not spec.get("files"):
        raise RenderError(f"{where}: needs files")
    data: Dict[str, bytes] = {}
    for item in spec["files"]:
        key, _, rel = str(item).rpartition("=")
        key = key or os.path.basename(rel)
        path = os.path.normpath(os.path.join(folder, rel))
        if not os.path.isfile(path):
            raise RenderError(f"{where}: file {rel} not found (in {folder})")
        if key in data:
            raise RenderError(f"{where}: key {key} given twice")
        with open(path, "rb") as f:
            data[key] = f.read()
    return data


def _generate(folder: str, spec: Obj, kind: str, index: int) -> Obj:
    where = f"{_kustomization_path(folder)}: {kind[0].lower() + kind[1:]}Generator[{index}]"
    if not spec.get("name"):
        raise RenderError(f"{where}: needs a name")
    data = _generator_data(folder, spec, where)
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}}
    if kind == "ConfigMap":
        if "type" in spec:
            raise RenderError(f"{where}: a ConfigMap has no type")
        try:
            obj["data"] = {k: v.decode("utf-8") for k, v in data.items()}
        except UnicodeDecodeError as e:
            raise RenderError(f"{where}: not UTF-8 text ({e}); binaryData is not supported")
    else:
        obj["type"] = spec.get("type", "Opaque")
        obj["data"] = {k: kustomize_base64(v) for k, v in data.items()}
    behavior = spec.get("behavior", "create")
    if behavior not in ("create", "replace"):
        raise RenderError(f"{where}: behavior {behavior!r} is not supported (create, replace)")
    obj["_behavior"] = behavior
    return obj


# ----------------------------------------------------------------------------- JSON 6902

def _pointer(path: str, where: str) -> List[str]:
    if not path.startswith("/"):
        raise RenderError(f"{where}: path {path!r} does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: List[str], where: str, path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict):
            if part not in doc:
                raise RenderError(f"{where}: path {path}: no {part!r}")
            doc = doc[part]
        elif isinstance(doc, list):
            if not part.isdigit() or int(part) >= len(doc):
                raise RenderError(f"{where}: path {path}: no index {part!r}")
            doc = doc[int(part)]
        else:
            raise RenderError(f"{where}: path {path}: {part!r} below a scalar")
    return doc


def apply_json6902(obj: Obj, ops: List[Obj], where: str) -> None:
    """RFC 6902 add, remove, replace and test, in place."""
    if not isinstance(ops, list):
        raise RenderError(f"{where}: a JSON 6902 patch is a list of operations")
    for number, op in enumerate(ops):
        here = f"{where} operation {number}"
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise RenderError(f"{here}: needs op and path")
        kind = op["op"]
        parts = _pointer(op["path"], here)
        parent = _walk(obj, parts[:-1], here, op["path"])
        last = parts[-1]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise RenderError(f"{here}: {kind} needs a value")
        value = copy.deepcopy(op.get("value"))
        if kind == "test":
            if _walk(parent, [last], here, op["path"]) != value:
                raise RenderError(f"{here}: test failed at {op['path']}")
        elif kind == "add":
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif last.isdigit() and int(last) <= len(parent):
                    parent.insert(int(last), value)
                else:
                    raise RenderError(f"{here}: path {op['path']}: no index {last!r}")
            elif isinstance(parent, dict):
                parent[last] = value
            else:
                raise RenderError(f"{here}: path {op['path']}: cannot add below a scalar")
        elif kind in ("remove", "replace"):
            _walk(parent, [last], here, op["path"])  # must exist
            if isinstance(parent, list):
                if kind == "remove":
                    del parent[int(last)]
                else:
                    parent[int(last)] = value
            elif kind == "remove":
                del parent[last]
            else:
                parent[last] = value
        else:
            raise RenderError(f"{here}: op {kind!r} is not supported (add, remove, replace, "
                              "test)")


# ----------------------------------------------------------------------------- transformers

def _pod_spec(obj: Obj) -> Optional[Obj]:
    if obj["kind"] in WORKLOAD_KINDS:
        return obj.get("spec", {}).get("template", {}).get("spec")
    if obj["kind"] == "Pod":
        return obj.get("spec")
    return None


def _containers(obj: Obj) -> List[Obj]:
    spec = _pod_spec(obj) or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _split_image(image: str) -> Tuple[str, str, str]:
    """(name, ':tag' or '', '@digest' or '')."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, at + digest


def apply_images(objs: List[Obj], images: List[Obj], where: str) -> None:
    for index, image in enumerate(images):
        unknown = set(image) - {"name", "newName", "newTag", "digest"}
        if unknown or "name" not in image:
            raise RenderError(f"{where}: images[{index}]: needs name; not supported: "
                              f"{sorted(unknown)}")
        for obj in objs:
            for container in _containers(obj):
                name, tag, digest = _split_image(container.get("image", ""))
                if name != image["name"]:
                    continue
                name = image.get("newName", name)
                if "digest" in image:
                    tag, digest = "", "@" + image["digest"]
                elif "newTag" in image:
                    tag, digest = ":" + str(image["newTag"]), ""
                container["image"] = name + tag + digest


def _rename_references(objs: List[Obj], renames: Dict[Tuple[str, str], str]) -> None:
    """Pod templates' references to generated ConfigMaps and Secrets follow their new names."""
    def rename(kind: str, name: str) -> str:
        return renames.get((kind, name), name)

    for obj in objs:
        spec = _pod_spec(obj)
        if spec is None:
            continue
        for volume in spec.get("volumes") or []:
            if "configMap" in volume:
                volume["configMap"]["name"] = rename("ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                volume["secret"]["secretName"] = rename("Secret", volume["secret"]["secretName"])
            for source in (volume.get("projected") or {}).get("sources") or []:
                if "configMap" in source:
                    source["configMap"]["name"] = rename("ConfigMap", source["configMap"]["name"])
                if "secret" in source:
                    source["secret"]["name"] = rename("Secret", source["secret"]["name"])
        for pull in spec.get("imagePullSecrets") or []:
            pull["name"] = rename("Secret", pull["name"])
        for container in _containers(obj):
            for env in container.get("env") or []:
                ref = (env.get("valueFrom") or {})
                if "configMapKeyRef" in ref:
                    ref["configMapKeyRef"]["name"] = rename("ConfigMap",
                                                            ref["configMapKeyRef"]["name"])
                if "secretKeyRef" in ref:
                    ref["secretKeyRef"]["name"] = rename("Secret", ref["secretKeyRef"]["name"])
            for env_from in container.get("envFrom") or []:
                if "configMapRef" in env_from:
                    env_from["configMapRef"]["name"] = rename("ConfigMap",
                                                              env_from["configMapRef"]["name"])
                if "secretRef" in env_from:
                    env_from["secretRef"]["name"] = rename("Secret", env_from["secretRef"]["name"])


# ----------------------------------------------------------------------------- build

def _build(folder: str, stack: Tuple[str, ...]) -> List[Obj]:
    """The objects of one kustomization; generated ones keep their plain name and carry
    ``_generated`` until the top level names them."""
    folder = os.path.realpath(folder)
    if folder in stack:
        raise RenderError(f"{folder}: kustomization cycle through {' -> '.join(stack)}")
    path = _kustomization_path(folder)
    with open(path, encoding="utf-8") as f:
        k = yaml.safe_load(f) or {}
    if not isinstance(k, dict):
        raise RenderError(f"{path}: not a mapping")
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{path}: fields this renderer does not implement: "
                          f"{sorted(unknown)} (tests/deploy/kustomize_render.py)")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{path}: kind is {k.get('kind')!r}, not Kustomization")

    objs: List[Obj] = []
    for rel in k.get("resources") or []:
        target = os.path.normpath(os.path.join(folder, rel))
        if os.path.isdir(target):
            objs.extend(_build(target, stack + (folder,)))
        elif os.path.isfile(target):
            objs.extend(_load_yaml_documents(target))
        else:
            raise RenderError(f"{path}: resource {rel} not found")

    def find(kind: str, name: str) -> Optional[Obj]:
        for obj in objs:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
        return None

    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for index, spec in enumerate(k.get(field) or []):
            generated = _generate(folder, spec, kind, index)
            behavior = generated.pop("_behavior")
            existing = find(kind, generated["metadata"]["name"])
            if behavior == "create":
                if existing is not None:
                    raise RenderError(f"{path}: {field}[{index}]: {kind} "
                                      f"{generated['metadata']['name']} exists already "
                                      "(behavior: replace?)")
                generated["_generated"] = True
                objs.append(generated)
            else:
                if existing is None or not existing.get("_generated"):
                    raise RenderError(f"{path}: {field}[{index}]: nothing generated named "
                                      f"{generated['metadata']['name']} to replace")
                existing["data"] = generated["data"]
                if kind == "Secret":
                    existing["type"] = generated["type"]

    for index, patch in enumerate(k.get("patches") or []):
        where = f"{path}: patches[{index}]"
        unknown = set(patch) - {"patch", "target"}
        if unknown or "patch" not in patch:
            raise RenderError(f"{where}: only inline JSON 6902 patches with a target "
                              f"(patch, target) are supported; got {sorted(patch)}")
        target = patch.get("target") or {}
        if set(target) - {"kind", "name"} or not target.get("kind") or not target.get("name"):
            raise RenderError(f"{where}: target needs kind and name, and nothing else")
        obj = find(target["kind"], target["name"])
        if obj is None:
            raise RenderError(f"{where}: no {target['kind']} {target['name']} to patch")
        ops = yaml.safe_load(patch["patch"])
        apply_json6902(obj, ops, where)

    if "namespace" in k:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    apply_images(objs, k.get("images") or [], path)
    return objs


def render(folder: str) -> List[Obj]:
    """The objects `kustomize build folder` makes (in the order of the kustomization)."""
    objs = _build(folder, ())
    renames: Dict[Tuple[str, str], str] = {}
    for obj in objs:
        if obj.pop("_generated", False):
            old = obj["metadata"]["name"]
            obj["metadata"]["name"] = f"{old}-{kustomize_hash(obj)}"
            renames[(obj["kind"], old)] = obj["metadata"]["name"]
    _rename_references(objs, renames)
    seen = set()
    for obj in objs:
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{folder}: two objects {key}")
        seen.add(key)
    return objs


def main(argv: List[str]) -> int:
    if len(argv) != 2 or argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        objs = render(argv[1])
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"kustomize_render.py: {e}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(objs, sys.stdout, sort_keys=False, default_flow_style=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
