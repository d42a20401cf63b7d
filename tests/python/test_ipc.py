"""CUDA IPC between contexts of one tenant (``mem_get_ipc_handle``, ``IPCMemoryHandle``) and
profiler control, against the test daemon. Each context is its own session (a process on the
daemon). The fake backend cannot share memory between processes: export raises there, and
the sharing tests are marked ``gpu``."""
from __future__ import annotations

import pickle
import time
from typing import Iterator

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _context


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
    with pytest.raises(AttributeError, match="IPC event handles are not served"):
        cuda.IPCEventHandle  # noqa: B018
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
