"""CUDA IPC between contexts of one tenant (``mem_get_ipc_handle``, ``IPCMemoryHandle``,
``Event.ipc_handle``, ``Event.from_ipc_handle``) and profiler control, against the test
daemon. Each context is its own session (a process on the daemon). The fake backend cannot
share memory or events between processes: export (and an interprocess event) raises there,
and the sharing tests are marked ``gpu``."""
from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
import secrets
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Tuple

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _context, _devices
from gpurpc.compiler import SourceModule

from conftest import REPO_ROOT, _free_port, _token_line, _wait_ready
from kernels import FAKE_KERNELS

# What PyCUDA users write for an event another process waits on (CUDA needs DISABLE_TIMING).
IPC_EVENT = cuda.event_flags.INTERPROCESS | cuda.event_flags.DISABLE_TIMING


@pytest.fixture
def second_ctx(ctx: cuda.Context) -> Iterator[cuda.Context]:
    """Another session of the same tenant on device 0; ``ctx`` is current again after."""
    other = cuda.Device(0).make_context()
    try:
        yield other
    finally:
        while cuda.Context.get_current() is other and _context._stack():
            cuda.Context.pop()
        other.detach()


@contextlib.contextmanager
def _current(context: cuda.Context) -> Iterator[None]:
    """``context`` is current inside (pushed on entry, popped on exit)."""
    context.push()
    try:
        yield
    finally:
        cuda.Context.pop()


def _error(fn: Callable[..., object], *args: object) -> Tuple[grpc.StatusCode, str]:
    """Runs ``fn(*args)``, which must raise :class:`LogicError`: its code and message. (Not
    the exception: its traceback would keep the objects of ``fn``'s frames alive.)"""
    with pytest.raises(cuda.LogicError) as info:
        fn(*args)
    return info.value.code, str(info.value)


def test_handles_that_name_no_export_are_refused(ctx: cuda.Context) -> None:
    with pytest.raises(cuda.LogicError, match="no export"):
        cuda.IPCMemoryHandle(b"\x01" * 32)
    with pytest.raises(cuda.LogicError, match="32 bytes"):
        cuda.IPCMemoryHandle(b"short")
    with pytest.raises(TypeError, match="mem_get_ipc_handle"):
        cuda.IPCMemoryHandle(12345)  # type: ignore[arg-type]
    with pytest.raises(cuda.LogicError, match="ipc_mem_flags"):
        cuda.IPCMemoryHandle(b"\x01" * 32, flags=7)
    with pytest.raises(cuda.LogicError, match="no live allocation"):
        cuda.mem_get_ipc_handle(0x1234)
    # The context is unharmed.
    cuda.mem_alloc(64).free()


def test_ipc_names(ctx: cuda.Context) -> None:
    assert cuda.ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS == 1
    assert cuda.event_flags.INTERPROCESS == 4
    # PyCUDA has no IPCEventHandle class: the message points at what it has instead.
    with pytest.raises(AttributeError, match=r"Event\.from_ipc_handle"):
        cuda.IPCEventHandle  # noqa: B018
    assert callable(cuda.Event.ipc_handle) and callable(cuda.Event.from_ipc_handle)
    with pytest.raises(AttributeError, match="removed in CUDA 12"):
        cuda.initialize_profiler  # noqa: B018


def test_the_fake_backend_says_it_cannot_share(ctx: cuda.Context, is_fake: bool) -> None:
    if not is_fake:
        pytest.skip("the CUDA backend shares memory: test_another_context_* covers it")
    buf = cuda.mem_alloc(4096)
    with pytest.raises(cuda.Error, match="CUDA IPC") as info:
        cuda.mem_get_ipc_handle(buf)
    assert info.value.code.name == "UNIMPLEMENTED"
    buf.free()


# -- IPC event handles, on every backend --------------------------------------------------------

def test_an_interprocess_event_needs_disable_timing(ctx: cuda.Context) -> None:
    for flags in (cuda.event_flags.INTERPROCESS,
                  cuda.event_flags.INTERPROCESS | cuda.event_flags.BLOCKING_SYNC):
        code, message = _error(cuda.Event, flags)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "disable_timing" in message.lower()
    # The context is unharmed.
    cuda.Event(cuda.event_flags.DISABLE_TIMING).record().synchronize()


def test_the_fake_backend_says_it_cannot_share_events(ctx: cuda.Context, is_fake: bool) -> None:
    if not is_fake:
        pytest.skip("the CUDA backend shares events: test_another_context_waits_* covers it")
    with pytest.raises(cuda.Error, match="CUDA IPC") as info:
        cuda.Event(IPC_EVENT)
    assert info.value.code.name == "UNIMPLEMENTED"
    cuda.Event(cuda.event_flags.DISABLE_TIMING).record().synchronize()


def test_an_event_not_created_interprocess_cannot_be_exported(ctx: cuda.Context) -> None:
    for event in (cuda.Event(), cuda.Event(cuda.event_flags.DISABLE_TIMING)):
        code, message = _error(event.ipc_handle)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "interprocess" in message and "Event.ipc_handle" in message
        event.record().synchronize()  # still an ordinary event


def test_event_handles_that_name_no_export_are_refused(ctx: cuda.Context) -> None:
    code, message = _error(cuda.Event.from_ipc_handle, b"x" * 5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "32 bytes" in message
    for handle in (b"\0" * 32, bytearray(b"\x01" * 32), memoryview(b"\x02" * 32)):
        code, message = _error(cuda.Event.from_ipc_handle, handle)
        assert code == grpc.StatusCode.NOT_FOUND, message
        assert "Event.from_ipc_handle" in message
    for wrong in (12345, "x" * 32, None):
        with pytest.raises(TypeError, match=rf"Event\.ipc_handle returned, not "
                                            rf"{type(wrong).__name__}"):
            cuda.Event.from_ipc_handle(wrong)  # type: ignore[arg-type]
    # The context is unharmed.
    cuda.Event().record().synchronize()


def test_profiler_starts_and_stops(ctx: cuda.Context) -> None:
    cuda.start_profiler()
    cuda.start_profiler()
    cuda.stop_profiler()
    cuda.stop_profiler()
    cuda.Context.synchronize()


@pytest.mark.gpu
def test_another_context_reads_and_writes_the_memory(ctx: cuda.Context,
                                                      second_ctx: cuda.Context) -> None:
    # second_ctx is current: make the memory in ctx.
    second_ctx.pop()
    data = np.arange(1 << 18, dtype=np.float32)
    buf = cuda.to_device(data)
    handle = cuda.mem_get_ipc_handle(buf)
    assert isinstance(handle, bytes) and len(handle) == 32
    assert cuda.mem_get_ipc_handle(int(buf) + 64) == handle  # any address in it
    # Handles travel as bytes (pickle, a pipe, a file).
    handle = pickle.loads(pickle.dumps(handle))
    second_ctx.push()
    opened = cuda.IPCMemoryHandle(handle)
    assert opened.size == data.nbytes
    np.testing.assert_array_equal(cuda.from_device(opened, data.shape, np.float32), data)
    cuda.memset_d32(int(opened) + 4 * 1000, 0, 10)
    cuda.Context.synchronize()
    with pytest.raises(cuda.LogicError, match="already"):
        cuda.IPCMemoryHandle(handle)
    second_ctx.pop()
    back = cuda.from_device(buf, data.shape, np.float32)
    expected = data.copy()
    expected[1000:1010] = 0
    np.testing.assert_array_equal(back, expected)
    # The exporter cannot free it while it is open over there.
    with pytest.raises(cuda.LaunchError, match="open in session"):
        buf.free()
    second_ctx.push()
    opened.close()
    opened.close()  # twice is a no-op
    second_ctx.pop()


@pytest.mark.gpu
def test_closing_the_exporter_closes_what_was_opened(ctx: cuda.Context,
                                                     second_ctx: cuda.Context) -> None:
    second_ctx.pop()
    exporter = cuda.Device(0).make_context()
    buf = cuda.mem_alloc(1 << 20)
    handle = cuda.mem_get_ipc_handle(buf)
    exporter.pop()
    second_ctx.push()
    opened = cuda.IPCMemoryHandle(handle)
    second_ctx.pop()
    exporter.detach()
    second_ctx.push()
    for _ in range(300):  # a bounded poll (30 s): the daemon closes it in the background
        try:
            cuda.from_device(opened, (16,), np.uint8)
        except cuda.LogicError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the opened memory was not closed after its exporter ended")
    with pytest.raises(cuda.LogicError, match="no export"):
        cuda.IPCMemoryHandle(handle)


# -- IPC event handles between contexts (CUDA backend) ----------------------------------------

@pytest.mark.gpu
def test_another_context_waits_for_the_event(ctx: cuda.Context,
                                            second_ctx: cuda.Context) -> None:
    # ctx (the exporter) writes a buffer after a slow kernel and records the event; second_ctx
    # makes its stream wait on the opened event, then snapshots the buffer on that stream.
    # Without the wait the snapshot would run during the slow kernel and see zeros.
    second_ctx.pop()
    mod = SourceModule(FAKE_KERNELS)
    spin, fill = mod.get_function("spin_us"), mod.get_function("fill_u32")
    n = 1 << 16
    buf = cuda.to_device(np.zeros(n, np.uint32))
    buf_handle = cuda.mem_get_ipc_handle(buf)
    event = cuda.Event(IPC_EVENT)
    handle = event.ipc_handle()
    assert isinstance(handle, bytes) and len(handle) == 32
    assert event.ipc_handle() == handle  # exporting again answers the same handle
    assert handle != buf_handle
    handle = pickle.loads(pickle.dumps(handle))  # handles travel as bytes
    with _current(second_ctx):
        shared = cuda.IPCMemoryHandle(buf_handle)
        opened = cuda.Event.from_ipc_handle(bytearray(handle))
        assert isinstance(opened, cuda.Event) and "Event" in repr(opened)
        snapshot = cuda.mem_alloc(4 * n)
        cuda.memset_d32(snapshot, 0, n)
        stream = cuda.Stream()
        cuda.Context.synchronize()
    work = cuda.Stream()
    cuda.Context.synchronize()  # the zeros are in place before the slow kernel starts
    spin(np.uint64(300_000), block=(1, 1, 1), stream=work)
    fill(buf, np.uint32(0xC0FFEE), np.uint64(n), block=(256, 1, 1), grid=(64, 1), stream=work)
    event.record(work)
    event.query()  # drains: the record is enqueued before the other context waits on it
    with _current(second_ctx):
        stream.wait_for_event(opened)
        cuda.memcpy_dtod_async(snapshot, shared, 4 * n, stream=stream)
        assert opened.synchronize() is opened
        assert opened.query()
    # The opened event completed with the exporter's: its synchronize waited for that work.
    assert event.query()
    with _current(second_ctx):
        stream.synchronize()
        seen = cuda.from_device(snapshot, (n,), np.uint32)
        assert (seen == 0xC0FFEE).all(), f"{np.count_nonzero(seen != 0xC0FFEE)} of {n} stale"
        # The opened event is an event of this context like any other.
        assert opened.record(stream) is opened
        opened.synchronize()
        assert opened.query()
        shared.close()


@pytest.mark.gpu
def test_event_handle_open_rules(ctx: cuda.Context, second_ctx: cuda.Context) -> None:
    second_ctx.pop()
    event = cuda.Event(IPC_EVENT)
    handle = event.ipc_handle()
    # Not in the context that exported it.
    code, message = _error(cuda.Event.from_ipc_handle, handle)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    with _current(second_ctx):
        opened = cuda.Event.from_ipc_handle(handle)
        first_id = opened.handle
        # Once per context: the message names the event that has it open.
        code, message = _error(cuda.Event.from_ipc_handle, handle)
        assert code == grpc.StatusCode.ALREADY_EXISTS, message
        assert re.search(rf"\b{first_id}\b", message), message
        # An opened event is exported where it was made, not again here.
        code, message = _error(opened.ipc_handle)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        # No timing: interprocess events are DISABLE_TIMING.
        timed = cuda.Event().record()
        opened.record().synchronize()
        code, message = _error(opened.time_since, timed)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, message
        code, message = _error(timed.time_till, opened)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, message
        # Releasing it (garbage collection, then a synchronising call) closes it: it opens again.
        del opened
        gc.collect()
        cuda.Context.synchronize()  # processes the release
        reopened = cuda.Event.from_ipc_handle(handle)
        reopened.record().synchronize()
        assert reopened.query()
    event.record().synchronize()  # the exporter's event is unaffected


@pytest.mark.gpu
def test_memory_and_event_handles_are_not_interchangeable(ctx: cuda.Context,
                                                          second_ctx: cuda.Context) -> None:
    second_ctx.pop()
    buf = cuda.mem_alloc(4096)
    memory_handle = cuda.mem_get_ipc_handle(buf)
    event = cuda.Event(IPC_EVENT)
    event_handle = event.ipc_handle()
    with _current(second_ctx):
        code, message = _error(cuda.Event.from_ipc_handle, memory_handle)
        assert code == grpc.StatusCode.NOT_FOUND, message
        code, message = _error(cuda.IPCMemoryHandle, event_handle)
        assert code == grpc.StatusCode.NOT_FOUND, message
        # Each opens as what it is.
        opened = cuda.Event.from_ipc_handle(event_handle)
        opened.synchronize()
        shared = cuda.IPCMemoryHandle(memory_handle)
        assert shared.size >= 4096
        shared.close()


@pytest.mark.gpu
def test_destroying_the_exported_event_stops_new_opens(ctx: cuda.Context,
                                                       second_ctx: cuda.Context) -> None:
    second_ctx.pop()
    spin = SourceModule(FAKE_KERNELS).get_function("spin_us")
    event = cuda.Event(IPC_EVENT)
    handle = event.ipc_handle()
    with _current(second_ctx):
        opened = cuda.Event.from_ipc_handle(handle)
    spin(np.uint64(50_000), block=(1, 1, 1))
    event.record()
    del event
    gc.collect()
    cuda.Context.synchronize()  # processes the release: DestroyEvent of the exported event
    # The driver's event lives on for the context that opened it ...
    with _current(second_ctx):
        opened.synchronize()
        assert opened.query()
        stream = cuda.Stream()
        stream.wait_for_event(opened)
        opened.record(stream)
        stream.synchronize()
        assert opened.query()
    # ... but no context opens the handle any more.
    third = cuda.Device(0).retain_primary_context()
    try:
        with _current(third):
            code, message = _error(cuda.Event.from_ipc_handle, handle)
            assert code == grpc.StatusCode.NOT_FOUND, message
    finally:
        third.detach()


@pytest.mark.gpu
def test_ending_the_exporter_closes_the_opened_events(ctx: cuda.Context,
                                                      second_ctx: cuda.Context) -> None:
    second_ctx.pop()
    exporter = cuda.Device(0).retain_primary_context()
    with _current(exporter):
        event = cuda.Event(IPC_EVENT)
        handle = event.ipc_handle()
    with _current(second_ctx):
        opened = cuda.Event.from_ipc_handle(handle)
        opened.record().synchronize()  # usable while the exporter lives
    del event
    exporter.detach()
    with _current(second_ctx):
        for _ in range(300):  # a bounded poll (30 s): the daemon closes it in the background
            try:
                opened.query()
            except cuda.LogicError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND, str(e)
                break
            time.sleep(0.1)
        else:
            pytest.fail("the opened event was not closed after its exporter ended")
        code, message = _error(cuda.Event.from_ipc_handle, handle)
        assert code == grpc.StatusCode.NOT_FOUND, message
        # The importing context itself is unharmed.
        cuda.Event().record().synchronize()


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Tuple[str, str, str]]:
    """A CUDA gpurpcd of this test's own on loopback TCP whose tokens file names two tenants:
    (address, alice's token, bob's token). Needs a local gpurpcd ($GPURPCD_BIN, default
    build/server/gpurpcd); skipped without one."""
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        pytest.skip(f"needs a local gpurpcd for a daemon with two tenants: {binary} not found "
                    "(set GPURPCD_BIN)")
    tokens = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("".join(_token_line(t, v) + "\n" for t, v in tokens.items()))
    tokens_file.chmod(0o600)
    address = f"127.0.0.1:{_free_port()}"
    log_path = tmp_path / "gpurpcd.log"
    socket_path = tmp_path / "gpurpcd.sock"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--backend=cuda", f"--listen={address}",
             f"--unix-socket={socket_path}", f"--tokens-file={tokens_file}",
             "--drain-timeout=0s", f"--cache-dir={tmp_path / 'cache'}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # Ready when it answers on its Unix socket (no credentials needed there).
        _wait_ready(f"unix:{socket_path}", proc, log_path)
        yield address, tokens["alice"], tokens["bob"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.gpu
def test_another_tenant_cannot_open_the_event(two_tenants: Tuple[str, str, str]) -> None:
    address, alice, bob = two_tenants
    saved = _devices._default_client
    contexts = []
    try:
        cuda.init(address=address, token=alice)
        exporter = cuda.Device(0).retain_primary_context()
        contexts.append(exporter)
        with _current(exporter):
            event = cuda.Event(IPC_EVENT)
            handle = event.ipc_handle()
        # Another context of alice's opens it ...
        same_tenant = cuda.Device(0).retain_primary_context()
        contexts.append(same_tenant)
        with _current(same_tenant):
            cuda.Event.from_ipc_handle(handle).synchronize()
        # ... one of bob's cannot: the same answer as for a handle nobody exported.
        cuda.init(address=address, token=bob)
        other_tenant = cuda.Device(0).retain_primary_context()
        contexts.append(other_tenant)
        with _current(other_tenant):
            code, message = _error(cuda.Event.from_ipc_handle, handle)
            assert code == grpc.StatusCode.NOT_FOUND, message
            assert bob not in message and alice not in message
        with _current(exporter):
            event.record().synchronize()  # alice's event is unaffected
    finally:
        while contexts and cuda.Context.get_current() in contexts and _context._stack():
            cuda.Context.pop()
        for context in contexts:
            context.detach()
        _devices._default_client = saved
