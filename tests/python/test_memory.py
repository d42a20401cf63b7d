"""Device memory through gpurpc.driver against a real daemon (the fake backend suffices)."""
from __future__ import annotations

import gc

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import debug

MiB = 1 << 20
rng = np.random.default_rng(1234)


@pytest.mark.parametrize("nbytes", [1, 7, 4096, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 9 * MiB + 3])
def test_round_trip(ctx: cuda.Context, nbytes: int) -> None:
    host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    buf = cuda.mem_alloc(nbytes)
    cuda.memcpy_htod(buf, host)
    back = np.zeros_like(host)
    cuda.memcpy_dtoh(back, buf)
    assert np.array_equal(back, host)


def test_zero_byte_copies_are_no_ops(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(16)
    cuda.memcpy_htod(buf, np.zeros(0, np.float32))
    cuda.memcpy_dtoh(np.zeros(0, np.float32), buf)


def test_zero_byte_allocation_is_a_logic_error(ctx: cuda.Context) -> None:
    with pytest.raises(cuda.LogicError) as info:
        cuda.mem_alloc(0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_address_arithmetic(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(1024)
    cuda.memset_d8(buf, 0, 1024)
    cuda.memcpy_htod(int(buf) + 16, np.arange(4, dtype=np.float32))
    back = np.empty(8, np.float32)
    cuda.memcpy_dtoh(back, int(buf) + 8)
    assert back.tolist() == [0, 0, 0, 1, 2, 3, 0, 0]
    # numpy integer addresses work too
    cuda.memcpy_dtoh(back[:2], np.uintp(int(buf) + 24))
    assert back[:2].tolist() == [2, 3]


def test_out_of_bounds_write_is_a_logic_error_naming_the_range(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError) as info:
        cuda.memcpy_htod(int(buf) + 32, np.zeros(16, np.float32))  # 64 bytes at offset 32
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{int(buf) + 32:x}" in str(info.value).lower() or "range" in str(info.value).lower()
    # the session is still fine
    cuda.memcpy_htod(buf, np.ones(16, np.float32))


def test_out_of_bounds_read_is_a_logic_error(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError):
        cuda.memcpy_dtoh(np.empty(17, np.float32), buf)


def test_address_outside_every_buffer_is_a_logic_error(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    with pytest.raises(cuda.LogicError):
        cuda.memcpy_htod(int(buf) + (1 << 40), np.zeros(4, np.float32))


def test_allocation_too_large_is_memory_error_and_session_survives(ctx: cuda.Context) -> None:
    total = cuda.Device(0).total_memory()
    with pytest.raises(cuda.MemoryError) as info:
        cuda.mem_alloc(total * 4)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    buf = cuda.mem_alloc(1024)
    cuda.memcpy_htod(buf, np.arange(256, dtype=np.int32))
    back = np.empty(256, np.int32)
    cuda.memcpy_dtoh(back, buf)
    assert (back == np.arange(256)).all()


@pytest.mark.parametrize("fn,dtype,value", [
    (cuda.memset_d8, np.uint8, 0xAB),
    (cuda.memset_d16, np.uint16, 0xBEEF),
    (cuda.memset_d32, np.uint32, 0xDEADBEEF),
])
def test_memset(ctx: cuda.Context, fn, dtype, value) -> None:
    n = 1000
    buf = cuda.mem_alloc(n * np.dtype(dtype).itemsize + 64)
    cuda.memset_d8(buf, 0, n * np.dtype(dtype).itemsize + 64)
    fn(int(buf) + 32, value, n)
    back = np.empty(n + 32 // np.dtype(dtype).itemsize + 1, dtype)
    cuda.memcpy_dtoh(back, buf)
    head = 32 // np.dtype(dtype).itemsize
    assert (back[:head] == 0).all()
    assert (back[head:head + n] == value).all()
    assert back[head + n] == 0


def test_memset_async_errors_surface_at_the_next_synchronize(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(64)
    cuda.memset_d32_async(buf, 1, 1000)  # 4000 bytes into 64: queued, not checked yet
    with pytest.raises(cuda.LogicError) as info:
        ctx.synchronize()
    assert "memset_d32_async" in str(info.value)
    ctx.synchronize()  # reported once; the session goes on


def test_memcpy_dtod(ctx: cuda.Context) -> None:
    src = cuda.to_device(np.arange(100, dtype=np.float64))
    dst = cuda.mem_alloc(800)
    cuda.memset_d8(dst, 0, 800)
    cuda.memcpy_dtod(int(dst) + 80, int(src) + 160, 400)
    back = cuda.from_device(dst, (100,), np.float64)
    assert (back[10:60] == np.arange(20, 70)).all()
    assert (back[:10] == 0).all() and (back[60:] == 0).all()


def test_async_copies_on_streams(ctx: cuda.Context) -> None:
    stream = cuda.Stream()
    host = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB: several chunks
    buf = cuda.mem_alloc(host.nbytes)
    copy = cuda.mem_alloc(host.nbytes)
    cuda.memcpy_htod_async(buf, host, stream)
    cuda.memcpy_dtod_async(copy, buf, host.nbytes, stream)
    out = cuda.pagelocked_empty_like(host)
    out[:] = 0
    cuda.memcpy_dtoh_async(out, copy, stream)
    stream.synchronize()
    assert np.array_equal(out, host)
    assert stream.is_done()


def test_dtoh_async_fills_at_context_synchronize(ctx: cuda.Context) -> None:
    buf = cuda.to_device(np.full(32, 7, np.int32))
    out = np.zeros(32, np.int32)
    cuda.memcpy_dtoh_async(out, buf)
    ctx.synchronize()
    assert (out == 7).all()


def test_free_and_garbage_collection_release_memory(ctx: cuda.Context, backend: str) -> None:
    size = 64 * MiB
    free_before, total = cuda.mem_get_info()
    assert 0 < free_before <= total
    buf = cuda.mem_alloc(size)
    free_during, _ = cuda.mem_get_info()
    buf.free()
    buf.free()  # twice is harmless
    free_after_free, _ = cuda.mem_get_info()
    buf2 = cuda.mem_alloc(size)
    del buf2
    gc.collect()
    free_after_gc, _ = cuda.mem_get_info()
    if backend == "fake":  # exact accounting; a real GPU is shared and may pool memory
        assert free_during <= free_before - size
        assert free_after_free >= free_during + size
        assert free_after_gc >= free_during + size


def test_device_allocation_int_and_repr(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(100)
    assert int(buf) == buf.__index__() != 0
    assert buf.size >= 100
    assert f"{int(buf):x}" in repr(buf)
    with pytest.raises(cuda.LogicError, match="cannot be mapped"):
        buf.as_buffer(100)


def test_pagelocked_helpers_return_plain_arrays(ctx: cuda.Context) -> None:
    a = cuda.pagelocked_empty((3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32
    z = cuda.pagelocked_zeros(5, np.int16)
    assert (z == 0).all()
    assert cuda.pagelocked_zeros_like(a).shape == (3, 4)


def test_synchronous_small_copy_is_one_round_trip(ctx: cuda.Context) -> None:
    buf = cuda.mem_alloc(4096)
    host = np.arange(1024, dtype=np.float32)
    cuda.memcpy_htod(buf, host)  # warm: opens the command stream
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, host)
    out = np.empty_like(host)
    cuda.memcpy_dtoh(out, buf)
    assert debug.rpc_counts() == {debug.BATCH: 2}
    assert np.array_equal(out, host)


def test_large_transfers_use_streaming_rpcs(ctx: cuda.Context) -> None:
    ctx.host_regions = "off"  # the gRPC path (same-host regions: test_regions.py)
    host = rng.integers(0, 2**31, (20 * MiB) // 4, dtype=np.int32)
    buf = cuda.mem_alloc(host.nbytes)
    debug.reset_rpc_counts()
    cuda.memcpy_htod(buf, host)
    out = np.empty_like(host)
    cuda.memcpy_dtoh(out, buf)
    counts = debug.rpc_counts()
    assert counts.get("MemoryService.UploadStream") == 1
    assert counts.get("MemoryService.DownloadStream") == 1
    assert np.array_equal(out, host)


def test_progress_bar_is_optional(ctx: cuda.Context) -> None:
    import warnings

    host = rng.integers(0, 256, 10 * MiB, dtype=np.uint8)
    cuda.set_transfer_progress(True, min_bytes=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buf = cuda.to_device(host)
            out = cuda.from_device_like(buf, host)
        assert np.array_equal(out, host)
        try:
            import tqdm  # noqa: F401
        except ImportError:
            assert any("tqdm is not installed" in str(w.message) for w in caught)
    finally:
        cuda.set_transfer_progress(False)
