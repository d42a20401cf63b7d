"""pytest setup for the gpurpc Python client.

Tests that need a daemon use the ``daemon`` fixture (or ``ctx``, which opens a session):

* if ``$GPURPC_ADDRESS`` is set, that daemon is used (the GPU run: a CUDA-backed gpurpcd);
* otherwise one ``gpurpcd --backend=fake`` is started for the whole test session from
  ``$GPURPCD_BIN`` (default ``build/server/gpurpcd``) on a Unix socket in a temporary
  directory. A missing binary fails those tests (set ``GPURPC_SKIP_DAEMON_TESTS=1`` to skip
  them instead).

Credentials for a daemon given by ``$GPURPC_ADDRESS`` come from the environment
(``GPURPC_TOKEN``, ``GPURPC_TOKEN_FILE``, ``GPURPC_TLS*``), as for any gpurpc program.

Tests marked ``gpu`` need real kernels and are skipped, with the reason printed, when the
daemon's backend is "fake".
"""
from __future__ import annotations

import hashlib
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_SRC = REPO_ROOT / "client" / "python" / "src"
# Test the working tree, also when an older gpurpc is installed.
sys.path.insert(0, str(CLIENT_SRC))

import grpc  # noqa: E402

import gpurpc.driver as cuda  # noqa: E402
from gpurpc import _context  # noqa: E402
from gpurpc._core import Client  # noqa: E402
from gpurpc.v1 import device_service_pb2  # noqa: E402

_backend: Optional[str] = None
_unix_socket: Optional[str] = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a daemon with a real GPU (skipped on the fake backend)")
    config.addinivalue_line("markers", "cuda: PyCUDA's mark_cuda_test tag (gpurpc.tools)")
    # Print skip reasons in the summary, so "needs a real GPU" is visible in CI logs.
    chars = getattr(config.option, "reportchars", "") or ""
    if "s" not in chars and "a" not in chars and "A" not in chars:
        config.option.reportchars = chars + "s"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _list_devices(address: str, timeout: float) -> device_service_pb2.ListDevicesResponse:
    # The client's own channel: credentials from the environment (GPURPC_TOKEN, GPURPC_TLS*)
    # apply to a daemon given by $GPURPC_ADDRESS.
    client = Client(address)
    try:
        return client.method("DeviceService.ListDevices")(
            device_service_pb2.ListDevicesRequest(), metadata=client.auth_metadata,
            timeout=timeout)
    finally:
        client.close()


def _token_line(tenant: str, token: str) -> str:
    """A --tokens-file line for `tenant` holding `token` (salted SHA-256, as the daemon reads
    it)."""
    salt = secrets.token_bytes(16)
    return f"{tenant}:{salt.hex()}:{hashlib.sha256(salt + token.encode()).hexdigest()}"


def _wait_ready(address: str, proc: Optional[subprocess.Popen], log_path: Optional[Path],
                deadline_s: float = 60.0) -> device_service_pb2.ListDevicesResponse:
    deadline = time.monotonic() + deadline_s
    last_error: Exception = RuntimeError("not tried")
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            log = log_path.read_text(errors="replace")[-4000:] if log_path else ""
            pytest.fail(f"gpurpcd exited with status {proc.returncode} before it was ready:\n{log}")
        try:
            return _list_devices(address, timeout=2)
        except grpc.RpcError as e:
            last_error = e
            time.sleep(0.1)
    log = log_path.read_text(errors="replace")[-4000:] if log_path else ""
    pytest.fail(f"gpurpcd at {address} not ready after {deadline_s:.0f}s: {last_error}\n{log}")


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The daemon's address; the process is started once per test session if needed."""
    global _backend, _unix_socket
    address = os.environ.get("GPURPC_ADDRESS")
    if address:
        reply = _wait_ready(address, None, None, deadline_s=30)
        _backend = reply.backend
        cuda.init(address=address)
        yield address
        return
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        message = (f"gpurpcd binary {binary} not found: build it (cmake --build build) or set "
                   "GPURPCD_BIN / GPURPC_ADDRESS")
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS"):
            pytest.skip(message)
        pytest.fail(message)
    tmp = tmp_path_factory.mktemp("gpurpcd")
    log_path = tmp / "gpurpcd.log"
    socket_path = str(tmp / "gpurpcd.sock")
    # Unix socket only: the daemon knows the caller from the kernel, no credentials needed
    # (TCP needs a token or TLS; tests/python/test_auth.py starts daemons for that).
    address = "unix:" + socket_path
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--backend=fake", "--listen=", "--session-idle-timeout=5s",
             "--drain-timeout=0s",
             f"--cache-dir={tmp / 'cache'}", f"--unix-socket={socket_path}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        reply = _wait_ready(address, proc, log_path)
        _backend = reply.backend
        _unix_socket = socket_path
        os.environ["GPURPC_ADDRESS"] = address  # for subprocesses (examples, autoinit)
        cuda.init(address=address)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.environ.pop("GPURPC_ADDRESS", None)


@pytest.fixture(scope="session")
def backend(daemon: str) -> str:
    """"cuda" or "fake"."""
    assert _backend is not None
    return _backend


@pytest.fixture(scope="session")
def unix_socket(daemon: str) -> str:
    """The Unix socket of the test daemon (skips when the daemon was started elsewhere)."""
    if _unix_socket is None:
        pytest.skip("the daemon was started elsewhere ($GPURPC_ADDRESS); its Unix socket is "
                    "unknown")
    return _unix_socket


@pytest.fixture
def ctx(daemon: str) -> Iterator[cuda.Context]:
    """A fresh session on device 0, current in this thread, closed afterwards."""
    context = cuda.Device(0).make_context()
    try:
        yield context
    finally:
        while cuda.Context.get_current() is context and _context._stack():
            cuda.Context.pop()
        context.detach()


@pytest.fixture
def is_fake(backend: str) -> bool:
    return backend == "fake"


@pytest.fixture(autouse=True)
def _gpu_gate(request: pytest.FixtureRequest) -> None:
    """Skips ``@pytest.mark.gpu`` tests, with the reason, unless the backend is "cuda"."""
    if request.node.get_closest_marker("gpu") is not None:
        address = request.getfixturevalue("daemon")
        if _backend != "cuda":
            pytest.skip(f"needs a real GPU: the daemon at {address} runs the {_backend!r} "
                        "backend")
