"""gpurpc.tools: dtype registry, memory pools (PyCUDA's binning and counters), DeviceData and
OccupancyRecord, make_default_context and the pytest helpers.

Everything here runs on the fake backend too (no device code runs)."""
from __future__ import annotations

import gc
import random
import struct
import sys
import threading

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import debug, tools


# -- dtypes and C arguments ------------------------------------------------------------------

def test_register_dtype_and_parse_c_arg_of_a_struct() -> None:
    pair = np.dtype([("a", np.float32), ("b", np.int32)])
    tools.register_dtype(pair, ["gpurpc_test_pair", "struct gpurpc_test_pair"])
    assert tools.dtype_to_ctype(pair) == "gpurpc_test_pair"
    arg = tools.parse_c_arg("const gpurpc_test_pair *pairs")
    assert isinstance(arg, tools.VectorArg) and arg.dtype == pair
    scalar = tools.parse_c_arg("struct gpurpc_test_pair p")
    assert isinstance(scalar, tools.ScalarArg) and scalar.struct_char == "8s"
    assert tools.get_or_register_dtype("gpurpc_test_pair") == pair
    # The same name for another dtype, or another first name without alias_ok, is refused.
    with pytest.raises(RuntimeError, match="already registered to dtype"):
        tools.register_dtype(np.dtype([("gpurpc_q", np.float64)]), "gpurpc_test_pair")
    with pytest.raises(RuntimeError, match="alias_ok"):
        tools.register_dtype(pair, "gpurpc_other_name")
    tools.register_dtype(pair, "gpurpc_other_name", alias_ok=True)
    assert tools.dtype_to_ctype(pair) == "gpurpc_test_pair"
    assert tools.parse_c_arg("gpurpc_other_name q").dtype == pair


def test_get_or_register_dtype() -> None:
    assert tools.get_or_register_dtype("unsigned int") == np.uint32
    assert tools.get_or_register_dtype(["long long", "int64_t"]) == np.int64
    with pytest.raises(RuntimeError, match="different dtypes"):
        tools.get_or_register_dtype(["int", "float"])
    with pytest.raises(TypeError, match="unknown C type 'gpurpc_nothing'"):
        tools.get_or_register_dtype("gpurpc_nothing")
    u = np.dtype([("u", np.uint16)])
    assert tools.get_or_register_dtype("gpurpc_u16_t", u) == u
    assert tools.get_or_register_dtype("gpurpc_u16_t") == u
    with pytest.raises(ValueError, match="non-empty"):
        tools.get_or_register_dtype([])


def test_dtype_to_ctype_and_arg_types() -> None:
    assert tools.dtype_to_ctype(np.float32, with_fp_tex_hack=True) == "fp_tex_float"
    assert tools.dtype_to_ctype(np.float64, with_fp_tex_hack=True) == "fp_tex_double"
    assert tools.dtype_to_ctype(np.int16) == "short"
    with pytest.raises(ValueError, match="may not be None"):
        tools.dtype_to_ctype(None)
    assert tools.get_arg_type("float *x") == "P"
    assert tools.get_arg_type("double a") == "d"
    assert tools.get_arg_type("unsigned short n") == "H"
    assert tools.parse_c_arg("float x[16]").__class__ is tools.VectorArg
    with pytest.raises(ValueError, match="cannot parse"):
        tools.parse_c_arg("float *")


# -- memory pool binning (PyCUDA's mantissa-bits scheme) -----------------------------------

def test_bin_number_and_alloc_size_follow_the_definition() -> None:
    pool = tools.DeviceMemoryPool
    # 1000 = 0b1111101000: exponent 9, the two bits after the leading one are 11 -> bin 39,
    # whose largest size is 0b1111111111.
    assert pool.bin_number(1000) == 9 << 2 | 3
    assert pool.alloc_size(39) == 1023
    assert pool.bin_number(1024) == 40 and pool.alloc_size(40) == 0b10011111111
    assert [pool.alloc_size(pool.bin_number(n)) for n in range(1, 9)] == [1, 2, 3, 4, 5, 6, 7, 9]
    assert pool.bin_number(0) == 0 and pool.alloc_size(0) == 1
    rng = random.Random(7)
    sizes = list(range(1, 5000)) + [rng.randrange(1, 1 << 40) for _ in range(2000)]
    for n in sizes:
        b = pool.bin_number(n)
        size = pool.alloc_size(b)
        assert n <= size <= n + n // 4 + 1, n
        assert pool.bin_number(size) == b, n
        assert pool.bin_number(size + 1) > b, n  # the bins tile the sizes, in order
    assert tools.PageLockedMemoryPool.bin_number(1000) == 39
    with pytest.raises(ValueError, match="negative"):
        pool.bin_number(-1)


class _Block:
    """A device block of a test allocator."""

    def __init__(self, size: int, address: int) -> None:
        self.size = size
        self.address = address

    def __int__(self) -> int:
        return self.address


def _counting_allocator(made: list, fail_first: int = 0):
    failures = [fail_first]

    def allocate(n: int) -> _Block:
        if failures[0] > 0:
            failures[0] -= 1
            raise cuda.MemoryError("out of memory (test)")
        block = _Block(n, 0x1000 * (len(made) + 1))
        made.append(block)
        return block
    return allocate


def test_device_pool_counters_and_reuse() -> None:
    made: list = []
    pool = tools.DeviceMemoryPool(_counting_allocator(made))
    a = pool.allocate(1000)
    b = pool(1000)
    assert [m.size for m in made] == [1023, 1023]
    assert len(a) == 1000 and a.size == 1000 and int(a) == made[0].address
    assert (pool.active_blocks, pool.held_blocks) == (2, 0)
    assert pool.active_bytes == 2000 and pool.managed_bytes == 2046
    a.free()
    a.free()  # twice is harmless
    assert (pool.active_blocks, pool.held_blocks, pool.active_bytes) == (1, 1, 1000)
    c = pool.allocate(900)  # same bin (896..1023): the held block, no new allocation
    assert int(c) == made[0].address and len(made) == 2
    del b
    gc.collect()
    assert (pool.active_blocks, pool.held_blocks) == (1, 1)
    d = pool.allocate(2000)
    assert made[-1].size == pool.alloc_size(pool.bin_number(2000))
    assert pool.managed_bytes == 2046 + made[-1].size
    pool.free_held()
    assert pool.held_blocks == 0 and pool.managed_bytes == 1023 + made[-1].size
    pool.stop_holding()
    c.free()
    d.free()
    assert (pool.active_blocks, pool.held_blocks, pool.managed_bytes, pool.active_bytes) == (
        0, 0, 0, 0)


def test_device_pool_block_goes_back_once() -> None:
    """free(), free() again, free() from racing threads and the garbage collector after
    free() give a block back once: a second give-back would hand it to two owners."""
    made: list = []
    pool = tools.DeviceMemoryPool(_counting_allocator(made))
    a = pool.allocate(1000)
    a.free()
    del a  # __del__ after free(): nothing more
    gc.collect()
    assert (pool.active_blocks, pool.held_blocks, pool.active_bytes) == (0, 1, 0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a check-then-set race would show
    try:
        _free_from_threads(pool)
    finally:
        sys.setswitchinterval(switch)
    assert len(made) == 1
    b, c = pool.allocate(1000), pool.allocate(1000)
    assert int(b) != int(c) and len(made) == 2


def _free_from_threads(pool: tools.DeviceMemoryPool) -> None:
    for _ in range(20):
        block = pool.allocate(1000)
        start = threading.Barrier(8)

        def free_it(block: tools.PooledDeviceAllocation) -> None:
            start.wait()
            for _ in range(100):
                block.free()

        threads = [threading.Thread(target=free_it, args=(block,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del block
        gc.collect()
        assert (pool.active_blocks, pool.held_blocks, pool.active_bytes) == (0, 1, 0)


def test_device_pool_drops_a_block_freed_with_it_in_a_reference_cycle(
        ctx: cuda.Context) -> None:
    """A pooled block and its DeviceAllocation that become garbage together (a cycle): the
    allocation's own finalizer frees the buffer first, so the block must not go back to the
    pool -- the next allocation would get a buffer the daemon is freeing."""
    pool = tools.DeviceMemoryPool()
    cycle: dict = {"block": pool.allocate(4096)}
    cycle["self"] = cycle
    address = int(cycle["block"])
    del cycle
    gc.collect()
    assert (pool.active_blocks, pool.held_blocks, pool.managed_bytes) == (0, 0, 0)
    again = pool.allocate(4096)
    data = np.arange(1024, dtype=np.float32)
    cuda.memcpy_htod(again, data)
    ctx.synchronize()  # the deferred free of the first buffer is made by now
    back = np.empty_like(data)
    cuda.memcpy_dtoh(back, again)
    assert np.array_equal(back, data), f"block at 0x{address:x} reused after it was freed"


def test_device_pool_frees_held_blocks_when_the_allocator_runs_out() -> None:
    made: list = []
    allocate = _counting_allocator(made)
    pool = tools.DeviceMemoryPool(allocate)
    pool.allocate(100).free()
    assert pool.held_blocks == 1
    failing = _counting_allocator(made, fail_first=1)
    pool._allocator = failing
    block = pool.allocate(5000)  # first try fails: held blocks go, the retry succeeds
    assert pool.held_blocks == 0 and len(block) == 5000
    pool._allocator = _counting_allocator(made, fail_first=2)
    with pytest.raises(cuda.MemoryError):
        pool.allocate(70000)


def test_page_locked_pool_with_a_host_allocator() -> None:
    pool = tools.PageLockedMemoryPool(lambda n: np.zeros(n, np.uint8))
    a = pool.allocate((3, 4), np.float32, order="F")
    assert isinstance(a.base, tools.PooledHostAllocation) and len(a.base) == 48
    assert a.shape == (3, 4) and a.flags.f_contiguous and a.dtype == np.float32
    a[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert a[2, 3] == 11
    address = a.__array_interface__["data"][0]
    assert (pool.active_blocks, pool.active_bytes, pool.managed_bytes) == (1, 48, 55)
    del a
    gc.collect()
    assert (pool.active_blocks, pool.held_blocks) == (0, 1)
    b = pool.allocate(50, np.uint8)  # 50 bytes: the same bin (48..55), the same memory
    assert b.__array_interface__["data"][0] == address and b.shape == (50,)
    s = pool.allocate(2, np.dtype([("x", np.int32), ("y", np.float64)]))
    s["y"] = [1.5, 2.5]
    assert s["y"].sum() == 4.0
    with pytest.raises(ValueError, match="order"):
        pool.allocate(4, np.float32, order="K")
    with pytest.raises(ValueError, match="negative"):
        pool.allocate((2, -1), np.float32)
    bad = tools.PageLockedMemoryPool(lambda n: b"x" * n)
    with pytest.raises(TypeError, match="contiguous numpy array"):
        bad.allocate(4, np.float32)


# -- DeviceData and occupancy ---------------------------------------------------------------

class _Device:
    """A stand-in device with H100-like attributes."""

    def __init__(self, attributes: dict, cc=(9, 0)) -> None:
        self._attributes = attributes
        self._cc = cc

    def compute_capability(self):
        return self._cc

    def get_attribute(self, attr):
        try:
            return self._attributes[int(attr)]
        except KeyError:
            raise cuda.LogicError(f"not reported: {attr}") from None


_H100 = {
    int(cuda.device_attribute.MAX_THREADS_PER_BLOCK): 1024,
    int(cuda.device_attribute.WARP_SIZE): 32,
    int(cuda.device_attribute.MAX_THREADS_PER_MULTIPROCESSOR): 2048,
    int(cuda.device_attribute.MAX_BLOCKS_PER_MULTIPROCESSOR): 32,
    int(cuda.device_attribute.MAX_REGISTERS_PER_BLOCK): 65536,
    int(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK): 49152,
}


def test_device_data_from_attributes_and_fallbacks() -> None:
    data = tools.DeviceData(_Device(_H100))
    assert (data.max_threads, data.warp_size, data.warps_per_mp, data.thread_blocks_per_mp,
            data.registers, data.shared_memory) == (1024, 32, 64, 32, 65536, 49152)
    assert (data.smem_granularity, data.smem_alloc_granularity,
            data.register_allocation_unit) == (32, 128, "warp")
    old = tools.DeviceData(_Device({}, cc=(1, 3)))  # nothing reported: PyCUDA's constants
    assert (old.warps_per_mp, old.thread_blocks_per_mp, old.smem_alloc_granularity,
            old.register_allocation_unit) == (32, 8, 512, "block")
    assert data.align_bytes(4) == 64 and data.align_bytes(8) == 128
    assert data.align(65) == 128 and data.align(64) == 64
    assert data.align_words(8) == 16 and data.align_dtype(17, 4) == 32
    assert data.coalesce(17) == 32
    assert tools.DeviceData.make_valid_tex_channel_count(3) == 4
    with pytest.raises(ValueError, match="fetches of size 3"):
        data.align_bytes(3)
    with pytest.raises(ValueError, match="channel count"):
        tools.DeviceData.make_valid_tex_channel_count(5)


def test_occupancy_record() -> None:
    data = tools.DeviceData(_Device(_H100))
    # 256 threads = 8 warps, 32 registers each: 8192 registers per block -> 8 blocks by
    # registers and 8 by warps (64 / 8); min() of (8, "regs") and (8, "warps") is "regs".
    rec = tools.OccupancyRecord(data, 256, registers=32)
    assert (rec.tb_per_mp, rec.limited_by, rec.warps_per_mp, rec.occupancy) == (
        8, "regs", 64, 1.0)
    # 128 threads with 40000 bytes of shared memory (40064 allocated): one block per MP.
    rec = tools.OccupancyRecord(data, 128, shared_mem=40000)
    assert (rec.tb_per_mp, rec.limited_by, rec.warps_per_mp) == (1, "smem", 4)
    assert rec.occupancy == pytest.approx(4 / 64)
    rec = tools.OccupancyRecord(data, 32)
    assert (rec.tb_per_mp, rec.limited_by) == (32, "device")
    assert (32, "device") in rec.tb_per_mp_limits
    with pytest.raises(ValueError, match="too many threads"):
        tools.OccupancyRecord(data, 2048)
    with pytest.raises(ValueError, match="too many registers"):
        tools.OccupancyRecord(data, 1024, registers=255)
    with pytest.raises(ValueError, match="too much shared memory"):
        tools.OccupancyRecord(data, 64, shared_mem=50000)


# -- against the daemon (fake or real) -------------------------------------------------------

def test_device_data_of_a_daemon_device(ctx: cuda.Context) -> None:
    dev = cuda.Context.get_device()
    data = tools.DeviceData()
    assert data.max_threads == dev.get_attribute(cuda.device_attribute.MAX_THREADS_PER_BLOCK)
    assert data.warp_size == dev.get_attribute(cuda.device_attribute.WARP_SIZE)
    assert data.shared_memory == dev.get_attribute(
        cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK)
    rec = tools.OccupancyRecord(data, 128)
    assert 0 < rec.occupancy <= 1


def test_device_pool_on_the_daemon_reuses_blocks_without_rpcs(ctx: cuda.Context) -> None:
    pool = tools.DeviceMemoryPool()
    first = pool.allocate(3000)
    address = int(first)
    data = np.arange(750, dtype=np.float32)
    cuda.memcpy_htod(first, data)
    back = np.empty_like(data)
    cuda.memcpy_dtoh(back, first)
    assert np.array_equal(back, data)
    first.free()
    debug.reset_rpc_counts()
    again = pool.allocate(2900)
    assert int(again) == address
    assert "MemoryService.Allocate" not in debug.rpc_counts()
    pool.stop_holding()
    again.free()
    assert pool.held_blocks == 0 and pool.managed_bytes == 0


def test_page_locked_pool_arrays_copy_to_and_from_the_device(ctx: cuda.Context) -> None:
    pool = tools.PageLockedMemoryPool()
    host = pool.allocate((64, 3), np.float64)
    host[:] = np.random.default_rng(1).standard_normal((64, 3))
    dev = cuda.mem_alloc(host.nbytes)
    cuda.memcpy_htod(dev, host)
    out = pool.allocate((64, 3), np.float64)
    cuda.memcpy_dtoh(out, dev)
    assert np.array_equal(out, host)
    assert pool.active_blocks == 2


def test_context_dependent_memoize_with_keywords(ctx: cuda.Context) -> None:
    calls = []

    @tools.context_dependent_memoize
    def build(x, scale=1):
        calls.append((x, scale))
        return x * scale

    assert build(2, scale=3) == 6 and build(2, scale=3) == 6 and build(2) == 2
    assert calls == [(2, 3), (2, 1)]
    tools.clear_context_caches()
    assert build(2, scale=3) == 6 and len(calls) == 3


def test_make_default_context_honours_the_environment(daemon: str, monkeypatch, tmp_path
                                                      ) -> None:
    monkeypatch.delenv("GPURPC_DEVICE", raising=False)
    monkeypatch.setenv("CUDA_DEVICE", "0")
    ctx = tools.make_default_context()
    try:
        assert cuda.Context.get_current() is ctx and ctx.get_device().ordinal == 0
    finally:
        ctx.detach()
    monkeypatch.setenv("CUDA_DEVICE", "zero")
    with pytest.raises(TypeError, match=r"\$CUDA_DEVICE must be an integer"):
        tools.make_default_context()
    monkeypatch.delenv("CUDA_DEVICE")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cuda_device").write_text(f"{cuda.Device.count()}\n")
    with pytest.raises(cuda.LogicError, match="invalid device ordinal"):
        tools.make_default_context()
    (tmp_path / ".cuda_device").write_text("0\n")
    made = []
    ctx = tools.make_default_context(lambda dev: made.append(dev) or dev.make_context())
    try:
        assert [d.ordinal for d in made] == [0]
    finally:
        ctx.detach()
    with pytest.warns(DeprecationWarning):
        assert tools.get_default_device().ordinal == 0


def test_mark_cuda_test_runs_in_a_fresh_context_and_closes_it(daemon: str) -> None:
    seen = []

    @tools.mark_cuda_test
    def body(x):
        ctx = cuda.Context.get_current()
        seen.append(ctx)
        assert x == 5
        return cuda.mem_alloc(16)

    assert body.__name__ == "body"
    assert any(m.name == "cuda" for m in getattr(body, "pytestmark", []))
    body(5)
    assert seen[0] is not None and seen[0].state != "active"


def test_init_cuda_context_fixture(daemon: str) -> None:
    gen = tools.init_cuda_context_fixture()
    next(gen)
    ctx = cuda.Context.get_current()
    assert ctx is not None and ctx.state == "active"
    buf = cuda.mem_alloc(64)
    assert int(buf)
    with pytest.raises(StopIteration):
        next(gen)
    assert ctx.state != "active"


def test_bitlog2() -> None:
    assert [tools.bitlog2(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]
    with pytest.raises(ValueError):
        tools.bitlog2(-3)
    assert struct.calcsize(tools.ScalarArg(np.int64, "n").struct_char) == 8
