"""Devices, contexts (sessions), keep-alive, isolation and autoinit against a real daemon."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _context, debug
from gpurpc._core import _make_callable
from gpurpc.v1 import session_service_pb2

from conftest import CLIENT_SRC


def _session_state(address: str, session_id: int) -> session_service_pb2.KeepAliveResponse:
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        keep_alive = _make_callable(channel, "SessionService.KeepAlive")
        return keep_alive(session_service_pb2.KeepAliveRequest(),
                          metadata=(("gpurpc-session", str(session_id)),), timeout=10)


# -- devices -------------------------------------------------------------------------------

def test_device_count_and_identity(daemon: str) -> None:
    assert cuda.Device.count() >= 1
    dev = cuda.Device(0)
    assert dev == cuda.Device(0)
    assert hash(dev) == hash(cuda.Device(0))
    assert isinstance(dev.name(), str) and dev.name()
    assert dev.total_memory() > 0


def test_fake_device_says_it_is_not_a_gpu(daemon: str, backend: str) -> None:
    dev = cuda.Device(0)
    assert dev.backend == backend
    if backend == "fake":
        assert dev.is_fake
        assert "not a GPU" in dev.name()
        assert dev.compute_capability() == (0, 0)
    else:
        assert not dev.is_fake
        assert dev.compute_capability()[0] >= 3


def test_device_attributes(daemon: str) -> None:
    dev = cuda.Device(0)
    mp = dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
    assert mp == dev.multiprocessor_count
    assert dev.get_attribute(cuda.device_attribute.WARP_SIZE) == dev.warp_size
    attrs = dev.get_attributes()
    assert attrs[cuda.device_attribute.MULTIPROCESSOR_COUNT] == mp
    assert attrs[cuda.device_attribute.COMPUTE_CAPABILITY_MAJOR] == dev.compute_capability()[0]
    assert all(isinstance(v, int) for v in attrs.values())
    with pytest.raises(AttributeError):
        dev.no_such_attribute_anywhere


def test_invalid_device_ordinal_is_a_logic_error(daemon: str) -> None:
    with pytest.raises(cuda.LogicError, match="invalid device ordinal 4096"):
        cuda.Device(4096)


def test_versions(daemon: str, backend: str) -> None:
    version = cuda.get_driver_version()
    assert isinstance(version, int)
    if backend == "cuda":
        assert version >= 12000
        assert cuda.get_version()[0] >= 12


# -- contexts / sessions ---------------------------------------------------------------------

def test_make_context_pushes_and_detach_closes(daemon: str) -> None:
    ctx = cuda.Device(0).make_context()
    try:
        assert cuda.Context.get_current() is ctx
        assert cuda.Context.get_device() == cuda.Device(0)
        assert _session_state(daemon, ctx.session_id).state == \
            session_service_pb2.SESSION_STATE_ACTIVE
    finally:
        cuda.Context.pop()
        ctx.detach()
    with pytest.raises(grpc.RpcError) as info:
        _session_state(daemon, ctx.session_id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_push_pop_stack_is_per_thread(ctx: cuda.Context) -> None:
    other = cuda.Device(0).make_context()
    try:
        assert cuda.Context.get_current() is other
        seen = []
        t = threading.Thread(target=lambda: seen.append(cuda.Context.get_current()))
        t.start()
        t.join()
        # A thread with an empty stack uses the most recently created context.
        assert seen == [other]
        cuda.Context.pop()
        assert cuda.Context.get_current() is ctx
    finally:
        other.detach()


def test_pop_with_empty_stack_is_a_logic_error(daemon: str) -> None:
    def pop() -> None:
        with pytest.raises(cuda.LogicError, match="cannot pop non-current context"):
            cuda.Context.pop()
    t = threading.Thread(target=pop)
    t.start()
    t.join()


def test_synchronize_works_as_static_and_bound_method(ctx: cuda.Context) -> None:
    cuda.Context.synchronize()
    ctx.synchronize()


def test_use_after_detach_is_a_clear_logic_error(daemon: str) -> None:
    ctx = cuda.Device(0).make_context()
    buf = cuda.mem_alloc(64)
    cuda.Context.pop()
    ctx.detach()
    with pytest.raises(cuda.LogicError, match="was detached"):
        cuda.memcpy_htod(buf, np.zeros(16, np.float32))
    buf.free()  # harmless after the session is gone


def test_two_sessions_are_isolated(daemon: str) -> None:
    a = cuda.Device(0).make_context()
    try:
        buf_a = cuda.mem_alloc(256)
        cuda.memcpy_htod(buf_a, np.arange(64, dtype=np.float32))
        b = cuda.Device(0).make_context()
        try:
            assert b.session_id != a.session_id
            # Session b does not know a's address: the daemon must refuse, not read a's memory.
            out = np.empty(64, np.float32)
            with pytest.raises(cuda.LogicError):
                cuda.memcpy_dtoh(out, int(buf_a))
            # ... nor a's buffer handle
            with pytest.raises(cuda.LogicError):
                b._core.call("MemoryService.Free", __import__(
                    "gpurpc.v1.memory_service_pb2", fromlist=["x"]).FreeRequest(
                        buffer_id=buf_a.buffer_id))
        finally:
            cuda.Context.pop()
            b.detach()
        # a is untouched
        out = np.empty(64, np.float32)
        cuda.memcpy_dtoh(out, buf_a)
        assert (out == np.arange(64)).all()
    finally:
        cuda.Context.pop()
        a.detach()


def test_keepalive_outlives_the_idle_timeout(ctx: cuda.Context) -> None:
    idle_s = ctx._core.idle_timeout_ms / 1000
    if not 0 < idle_s <= 10:
        pytest.skip(f"the daemon's idle timeout ({idle_s:.0f} s) is too long to wait for here")
    buf = cuda.mem_alloc(16)
    time.sleep(idle_s * 1.3)  # longer than the daemon waits before reclaiming an idle session
    cuda.memcpy_htod(buf, np.arange(4, dtype=np.float32))
    # The session's WatchSession stream keeps it, not periodic KeepAlive calls.
    assert debug.rpc_counts(include_keepalive=True).get(debug.WATCH_OPEN, 0) >= 1


def test_garbage_collected_context_closes_its_session(daemon: str) -> None:
    ctx = cuda.Device(0).retain_primary_context()  # not pushed
    session_id = ctx.session_id
    del ctx
    gc.collect()
    with pytest.raises(grpc.RpcError) as info:
        _session_state(daemon, session_id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_no_current_context_message(daemon: str) -> None:
    gc.collect()
    errors = []

    def run() -> None:
        saved = _context._last_context
        _context._last_context = None
        try:
            cuda.mem_alloc(16)
        except cuda.LogicError as e:
            errors.append(str(e))
        finally:
            _context._last_context = saved
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors and "no current context" in errors[0] and "make_context" in errors[0]


def _run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(CLIENT_SRC))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_autoinit_opens_a_session_and_closes_it_at_exit(daemon: str) -> None:
    result = _run_python(
        "import gpurpc.autoinit as a, gpurpc.driver as cuda\n"
        "assert cuda.Context.get_current() is a.context\n"
        "assert a.device == cuda.Device(0)\n"
        "x = cuda.mem_alloc(64)\n"
        "print(a.context.session_id)\n")
    assert result.returncode == 0, result.stderr
    session_id = int(result.stdout.strip())
    with pytest.raises(grpc.RpcError) as info:
        _session_state(daemon, session_id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_autoinit_reports_an_unreachable_daemon_clearly(daemon: str) -> None:
    env_code = ("import os; os.environ['GPURPC_ADDRESS'] = 'unix:/nonexistent/gpurpcd.sock'\n"
                "import gpurpc.autoinit\n")
    result = _run_python(env_code)
    assert result.returncode != 0
    assert "gpurpc._errors.RuntimeError" in result.stderr or "RuntimeError" in result.stderr
    assert "unix:/nonexistent/gpurpcd.sock" in result.stderr


def test_unix_socket_address(unix_socket: str) -> None:
    for address in (unix_socket, "unix:" + unix_socket):
        result = _run_python(
            "import os, gpurpc.driver as cuda, numpy as np\n"
            f"cuda.init(address={address!r})\n"
            "ctx = cuda.Device(0).make_context()\n"
            "buf = cuda.to_device(np.arange(5, dtype=np.int32))\n"
            "print(cuda.from_device(buf, 5, np.int32).tolist())\n")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[0, 1, 2, 3, 4]"


def test_threads_share_a_context_safely(ctx: cuda.Context) -> None:
    errors = []

    def work(seed: int) -> None:
        try:
            local = np.random.default_rng(seed)
            for _ in range(20):
                host = local.integers(0, 1000, local.integers(1, 300_000), dtype=np.int32)
                buf = cuda.to_device(host)
                assert np.array_equal(cuda.from_device_like(buf, host), host)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
