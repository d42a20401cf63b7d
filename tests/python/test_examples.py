"""Examples that also run on the fake backend (its multiply_them is PyCUDA's); test_gpu.py
runs every example on a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import CLIENT_SRC, REPO_ROOT

EXAMPLES = REPO_ROOT / "client" / "python" / "examples"


def _run(daemon: str, name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(CLIENT_SRC), GPURPC_ADDRESS=daemon)
    return subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_hello_gpu_example(daemon: str) -> None:
    result = _run(daemon, "hello_gpu.py")
    assert result.returncode == 0, result.stderr
    assert "max |dest - a*b| = 0.0" in result.stdout


def test_dump_properties_example(daemon: str, backend: str) -> None:
    result = _run(daemon, "dump_properties.py")
    assert result.returncode == 0, result.stderr
    assert "Device #0:" in result.stdout
    assert "MULTIPROCESSOR_COUNT:" in result.stdout
    if backend == "fake":
        assert "not a GPU" in result.stdout


def test_every_example_is_tested() -> None:
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert {"hello_gpu.py", "dump_properties.py", "streams_events.py", "demo_struct.py"} <= names
