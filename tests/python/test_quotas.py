"""Quotas as a PyCUDA user meets them: through ``gpurpc.driver`` and ``gpurpc.gpuarray``
against a daemon started here (fake backend) whose configuration gives the test's own user
(the Unix-socket tenant) small quotas.

Over quota is ``gpurpc.driver.MemoryError`` (RESOURCE_EXHAUSTED) with a message naming the
quota, the tenant's use and the request; nothing is lost, and freeing memory makes room.
"""
from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest

import gpurpc.admin
import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray
from gpurpc import _devices

from conftest import REPO_ROOT, _wait_ready

USER = pwd.getpwuid(os.getuid()).pw_name
MiB = 1 << 20


@pytest.fixture(scope="module")
def quota_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or os.environ.get("GPURPC_ADDRESS"):
            pytest.skip(f"gpurpcd binary {binary} not found: these tests start their own daemon")
        pytest.fail(f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN")
    tmp = tmp_path_factory.mktemp("quotas")
    config = tmp / "gpurpcd.conf"
    config.write_text(f"""
max_sessions: 8
tenant_quotas {{
  key: "{USER}"
  value {{ max_sessions: 2 max_device_memory_bytes: {64 * MiB} max_streams_per_session: 2 }}
}}
""")
    socket = tmp / "gpurpcd.sock"
    log_path = tmp / "gpurpcd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(binary), "--backend=fake", f"--config={config}",
                                 "--drain-timeout=0s",
                                 f"--unix-socket={socket}", "--listen=",
                                 f"--cache-dir={tmp / 'cache'}", "--session-idle-timeout=10s"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    address = f"unix:{socket}"
    _wait_ready(address, proc, log_path, deadline_s=30)
    saved = _devices._default_client
    cuda.init(address=address)
    yield address
    _devices._default_client = saved
    proc.terminate()
    proc.wait(timeout=15)


@pytest.fixture
def context(quota_daemon: str) -> Iterator[cuda.Context]:
    ctx = cuda.Device(0).make_context()
    yield ctx
    ctx.detach()


def test_server_info_reports_the_quota(context: cuda.Context) -> None:
    info = gpurpc.admin.server_info()
    assert info.tenant == USER
    assert info.auth_method == "unix-peer"
    assert info.quota.max_device_memory_bytes == 64 * MiB
    assert info.quota.max_sessions == 2


def test_device_memory_quota_through_mem_alloc_and_gpuarray(context: cuda.Context) -> None:
    first = cuda.mem_alloc(40 * MiB)
    with pytest.raises(cuda.MemoryError) as info:
        cuda.mem_alloc(30 * MiB)
    message = str(info.value)
    assert "max_device_memory_bytes" in message
    assert str(40 * MiB) in message and str(30 * MiB) in message
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # gpuarray allocations count too.
    with pytest.raises(cuda.MemoryError):
        gpuarray.zeros(8 * MiB, dtype=np.float32)  # 32 MiB
    # Nothing was lost: the first buffer still works, and freeing it makes room.
    data = np.arange(1024, dtype=np.float32)
    cuda.memcpy_htod(first, data)
    back = np.empty_like(data)
    cuda.memcpy_dtoh(back, first)
    np.testing.assert_array_equal(back, data)
    first.free()
    ones = np.ones(8 * MiB, dtype=np.float32)
    arr = gpuarray.to_gpu(ones)
    np.testing.assert_array_equal(arr.get()[-4:], ones[-4:])
    assert gpurpc.admin.server_info().device_memory_bytes == 32 * MiB
    del arr


def test_streams_per_session(context: cuda.Context) -> None:
    streams = [cuda.Stream(), cuda.Stream()]
    with pytest.raises(cuda.MemoryError, match="max_streams_per_session"):
        cuda.Stream()
    del streams


def test_sessions_per_tenant(quota_daemon: str) -> None:
    first = cuda.Device(0).make_context()
    second = cuda.Device(0).make_context()
    try:
        with pytest.raises(cuda.Error) as info:
            cuda.Device(0).make_context()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions" in str(info.value)
    finally:
        second.detach()
        first.detach()
    # The slots are back.
    again = cuda.Device(0).make_context()
    again.detach()
