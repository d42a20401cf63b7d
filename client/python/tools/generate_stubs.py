#!/usr/bin/env python3
"""Regenerates the gRPC/protobuf stubs of the ``gpurpc.v1`` package from ``proto/``.

The stubs are committed (src/gpurpc/v1/) so that ``pip install ./client/python`` needs
nothing but pip. They are generated with one pinned grpcio-tools version, chosen old enough
that its output loads on every protobuf runtime from 5.26.1 to the newest (protobuf checks
that the runtime is not older than the generator; newer runtimes accept older gencode).
``tools/check_stubs.py`` regenerates them the same way and fails when they differ.

If the running interpreter does not have exactly that grpcio-tools version, a private
virtual environment with it is created once under the user cache directory
(``$XDG_CACHE_HOME/gpurpc``, default ``~/.cache/gpurpc``) with pip.

Usage: python3 client/python/tools/generate_stubs.py [--out DIR] [--python PYTHON]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# grpcio-tools 1.63.x bundles protoc from protobuf 5.26.1: its gencode has no runtime
# version check and its *_pb2_grpc.py needs grpcio >= 1.63 (``_registered_method``).
GRPCIO_TOOLS_VERSION = "1.63.2"

PYTHON_DIR = Path(__file__).resolve().parents[1]  # client/python
REPO_ROOT = PYTHON_DIR.parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = PROTO_ROOT / "gpurpc" / "v1"
STUB_DIR = PYTHON_DIR / "src" / "gpurpc" / "v1"

INIT_TEXT = '''"""Generated gRPC stubs of the gpurpc.v1 API (from proto/gpurpc/v1/*.proto).

Do not edit: regenerate with ``client/python/tools/generate_stubs.py``. Every RPC and field
is documented in the .proto files.
"""
'''


def _installed_tools_version(python: str) -> str | None:
    probe = (
        "import importlib.metadata as m\n"
        "try:\n"
        "    print(m.version('grpcio-tools'))\n"
        "except m.PackageNotFoundError:\n"
        "    print('')\n"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.strip() or None


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpurpc"


def _target_dir_python(target: Path) -> tuple[str, dict[str, str]]:
    """Fallback when ``python -m venv`` is unavailable (Debian without python3-venv): install
    into a plain directory and put it first on PYTHONPATH of the protoc subprocess."""
    env = dict(os.environ, PYTHONPATH=str(target) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; "
                            "print(m.version('grpcio-tools'))"], capture_output=True, text=True,
                           env=env)
    if probe.returncode != 0 or probe.stdout.strip() != GRPCIO_TOOLS_VERSION:
        print(f"installing grpcio-tools=={GRPCIO_TOOLS_VERSION} into {target}", file=sys.stderr)
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--target", str(target), f"grpcio-tools=={GRPCIO_TOOLS_VERSION}"],
            check=True, env=dict(os.environ, PIP_BREAK_SYSTEM_PACKAGES="1"))
    return sys.executable, env


def generator_python(explicit: str | None = None) -> tuple[str, dict[str, str]]:
    """An interpreter and environment with the pinned grpcio-tools, made if needed."""
    env = dict(os.environ)
    if explicit:
        found = _installed_tools_version(explicit)
        if found != GRPCIO_TOOLS_VERSION:
            raise SystemExit(
                f"{explicit} has grpcio-tools {found or '(none)'}, need {GRPCIO_TOOLS_VERSION}"
            )
        return explicit, env
    if _installed_tools_version(sys.executable) == GRPCIO_TOOLS_VERSION:
        return sys.executable, env
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    venv_dir = _cache_root() / f"stubgen-grpcio-tools-{GRPCIO_TOOLS_VERSION}-{tag}"
    python = venv_dir / "bin" / "python"
    if python.exists() and _installed_tools_version(str(python)) == GRPCIO_TOOLS_VERSION:
        return str(python), env
    print(f"creating {venv_dir} with grpcio-tools=={GRPCIO_TOOLS_VERSION}", file=sys.stderr)
    shutil.rmtree(venv_dir, ignore_errors=True)
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        shutil.rmtree(venv_dir, ignore_errors=True)
        return _target_dir_python(_cache_root() / f"stubgen-target-{GRPCIO_TOOLS_VERSION}-{tag}")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"grpcio-tools=={GRPCIO_TOOLS_VERSION}"],
        check=True,
    )
    return str(python), env


def generate(out_dir: Path, python: str | None = None) -> None:
    """Writes the generated gpurpc/v1 modules (and __init__.py) into out_dir."""
    protos = sorted(PROTO_PACKAGE_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_PACKAGE_DIR}")
    gen_python, env = generator_python(python)
    with tempfile.TemporaryDirectory(prefix="gpurpc-stubs-") as tmp:
        cmd = [
            gen_python, "-m", "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        subprocess.run(cmd, check=True, cwd=PROTO_ROOT, env=env)
        produced = Path(tmp) / "gpurpc" / "v1"
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*_pb2*.py*"):
            old.unlink()
        for f in sorted(produced.iterdir()):
            shutil.copyfile(f, out_dir / f.name)
        (out_dir / "__init__.py").write_text(INIT_TEXT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUB_DIR, help="output directory")
    parser.add_argument("--python", help="an interpreter that already has the pinned grpcio-tools")
    args = parser.parse_args()
    generate(args.out, args.python)
    print(f"generated stubs in {args.out} with grpcio-tools {GRPCIO_TOOLS_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
