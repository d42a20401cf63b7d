"""Context limits, cache and shared memory configuration and function attributes through the
Python client (``Context.set_limit``/``get_limit``, ``set_cache_config``, ``set_shared_config``,
``Function.set_attribute``/``set_cache_config``/``set_shared_config``; PyCUDA's names), against
a real daemon.

The fake backend keeps the values and enforces the daemon's bounds, so the round trips and
errors run in CI; the tests marked ``gpu`` read the real driver's values and run kernels that
need the new limits (device malloc, more than 48 KiB of dynamic shared memory).
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc.compiler import SourceModule

from kernels import FAKE_KERNELS

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@pytest.fixture
def mod(ctx: cuda.Context) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


# ---- context limits

def test_limits_round_trip(ctx: cuda.Context, is_fake: bool) -> None:
    cuda.Context.set_limit(cuda.limit.MALLOC_HEAP_SIZE, 64 * MiB)
    assert cuda.Context.get_limit(cuda.limit.MALLOC_HEAP_SIZE) >= 64 * MiB
    cuda.Context.set_limit(cuda.limit.PRINTF_FIFO_SIZE, 4 * MiB)
    assert cuda.Context.get_limit(cuda.limit.PRINTF_FIFO_SIZE) >= 4 * MiB
    cuda.Context.set_limit(cuda.limit.STACK_SIZE, 4 * KiB)
    assert cuda.Context.get_limit(cuda.limit.STACK_SIZE) >= 4 * KiB
    # Plain ints work as in PyCUDA.
    cuda.Context.set_limit(2, 32 * MiB)
    assert cuda.Context.get_limit(2) >= 32 * MiB
    if is_fake:  # the fake keeps exactly what was set
        assert cuda.Context.get_limit(cuda.limit.MALLOC_HEAP_SIZE) == 32 * MiB
        assert cuda.Context.get_limit(cuda.limit.STACK_SIZE) == 4 * KiB
        cuda.Context.set_limit(cuda.limit.MAX_L2_FETCH_GRANULARITY, 64)
        assert cuda.Context.get_limit(cuda.limit.MAX_L2_FETCH_GRANULARITY) == 64


@pytest.mark.parametrize("lim, value, says", [
    (cuda.limit.MALLOC_HEAP_SIZE, GiB + 1, "LIMIT_MALLOC_HEAP_SIZE = 1073741825 is outside"),
    (cuda.limit.MALLOC_HEAP_SIZE, 0, "LIMIT_MALLOC_HEAP_SIZE = 0 is outside"),
    (cuda.limit.PRINTF_FIFO_SIZE, 64 * MiB + 1, "LIMIT_PRINTF_FIFO_SIZE"),
    (cuda.limit.STACK_SIZE, 64 * KiB + 1, "LIMIT_STACK_SIZE = 65537 is outside 1..65536"),
    (cuda.limit.DEV_RUNTIME_PENDING_LAUNCH_COUNT, 1 << 20, "outside 1..32768"),
    (cuda.limit.MAX_L2_FETCH_GRANULARITY, 129, "outside 0..128"),
])
def test_limits_out_of_bounds_are_refused(ctx: cuda.Context, lim: cuda.limit, value: int,
                                          says: str) -> None:
    before = cuda.Context.get_limit(lim)
    with pytest.raises(cuda.LogicError, match=says) as info:
        cuda.Context.set_limit(lim, value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert cuda.Context.get_limit(lim) == before


def test_limit_arguments_are_checked(ctx: cuda.Context) -> None:
    with pytest.raises(cuda.LogicError, match=r"limit 7 is not a limit"):
        cuda.Context.set_limit(7, 1)
    with pytest.raises(cuda.LogicError, match=r"limit 99 is not a limit"):
        cuda.Context.get_limit(99)
    with pytest.raises(cuda.LogicError, match=r"value -1 is outside"):
        cuda.Context.set_limit(cuda.limit.STACK_SIZE, -1)
    with pytest.raises(cuda.LogicError, match=r"must be an int"):
        cuda.Context.set_limit(cuda.limit.STACK_SIZE, 1.5)
    with pytest.raises(cuda.LogicError, match=r"must be a limit or an int"):
        cuda.Context.set_limit("STACK_SIZE", 1024)


# ---- cache and shared memory configuration

def test_cache_config_round_trips(ctx: cuda.Context) -> None:
    assert cuda.Context.get_cache_config() == cuda.func_cache.PREFER_NONE
    for cc in (cuda.func_cache.PREFER_SHARED, cuda.func_cache.PREFER_L1,
               cuda.func_cache.PREFER_EQUAL, cuda.func_cache.PREFER_NONE):
        cuda.Context.set_cache_config(cc)
        got = cuda.Context.get_cache_config()
        assert isinstance(got, cuda.func_cache)
        assert got == cc
    with pytest.raises(cuda.LogicError, match=r"cache config 4 is not a func_cache"):
        cuda.Context.set_cache_config(4)


def test_shared_config_answers_the_fixed_bank_width(ctx: cuda.Context) -> None:
    assert cuda.Context.get_shared_config() == cuda.shared_config.FOUR_BYTE_BANK_SIZE
    cuda.Context.set_shared_config(cuda.shared_config.EIGHT_BYTE_BANK_SIZE)
    assert cuda.Context.get_shared_config() == cuda.shared_config.FOUR_BYTE_BANK_SIZE
    with pytest.raises(cuda.LogicError, match=r"shared config 3 is not a shared_config"):
        cuda.Context.set_shared_config(3)


# ---- function attributes

def test_function_attributes(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32")
    fill.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * KiB)
    assert fill.get_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES) == 64 * KiB
    assert fill.max_dynamic_shared_size_bytes == 64 * KiB
    assert fill.get_attribute(cuda.function_attribute.PREFERRED_SHARED_MEMORY_CARVEOUT) == -1
    fill.set_attribute(cuda.function_attribute.PREFERRED_SHARED_MEMORY_CARVEOUT, 50)
    assert fill.get_attribute(cuda.function_attribute.PREFERRED_SHARED_MEMORY_CARVEOUT) == 50
    fill.set_cache_config(cuda.func_cache.PREFER_SHARED)
    fill.set_shared_config(cuda.shared_config.FOUR_BYTE_BANK_SIZE)

    optin = cuda.Context.get_device().get_attribute(
        cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    with pytest.raises(cuda.LogicError, match=r"MAX_DYNAMIC_SHARED_SIZE_BYTES = .* is outside"):
        fill.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, optin + 1)
    with pytest.raises(cuda.LogicError, match=r"is outside -1..100"):
        fill.set_attribute(cuda.function_attribute.PREFERRED_SHARED_MEMORY_CARVEOUT, 101)
    with pytest.raises(cuda.LogicError, match=r"FUNCTION_ATTRIBUTE_NUM_REGS is read-only"):
        fill.set_attribute(cuda.function_attribute.NUM_REGS, 32)
    with pytest.raises(cuda.LogicError, match=r"attribute 10 is not a function_attribute"):
        fill.set_attribute(10, 1)
    with pytest.raises(cuda.LogicError, match=r"cache config 9 is not a func_cache"):
        fill.set_cache_config(9)
    with pytest.raises(cuda.LogicError, match=r"shared config 5 is not a shared_config"):
        fill.set_shared_config(5)
    # Unchanged by the refusals.
    assert fill.max_dynamic_shared_size_bytes == 64 * KiB


def test_dynamic_shared_memory_follows_the_attribute_on_the_fake(mod: SourceModule,
                                                                  is_fake: bool) -> None:
    if not is_fake:
        pytest.skip("the CUDA backend raises the attribute itself for a launch that needs more")
    fill = mod.get_function("fill_u32")
    out = cuda.mem_alloc(256 * 4)
    args = (out, np.uint32(3), np.uint64(256))
    with pytest.raises(cuda.LogicError, match=r"shared memory"):
        fill(*args, block=(256, 1, 1), shared=48 * KiB + 1)
        cuda.Context.synchronize()
    fill.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, 96 * KiB)
    fill(*args, block=(256, 1, 1), shared=96 * KiB)
    cuda.Context.synchronize()


# ---- on a GPU

HEAP_SOURCE = r"""
extern "C" __global__ void heap_fill(unsigned long long* out, unsigned n_per_thread) {
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned* scratch = (unsigned*)malloc(n_per_thread * sizeof(unsigned));
    if (scratch == nullptr) { out[t] = ~0ull; return; }
    for (unsigned i = 0; i < n_per_thread; ++i) scratch[i] = t + i;
    unsigned long long sum = 0;
    for (unsigned i = 0; i < n_per_thread; ++i) sum += scratch[i];
    free(scratch);
    out[t] = sum;
}
"""

SHARED_SOURCE = r"""
extern "C" __global__ void reverse_shared(unsigned* out, unsigned n) {
    extern __shared__ unsigned words[];
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) words[i] = i;
    __syncthreads();
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) out[i] = words[n - 1 - i];
}
"""


@pytest.mark.gpu
def test_gpu_limits_read_back_from_the_driver(ctx: cuda.Context) -> None:
    cuda.Context.set_limit(cuda.limit.PRINTF_FIFO_SIZE, 8 * MiB)
    cuda.Context.set_limit(cuda.limit.MALLOC_HEAP_SIZE, 128 * MiB)
    cuda.Context.set_limit(cuda.limit.STACK_SIZE, 8 * KiB)
    # The driver may round up, never down.
    assert cuda.Context.get_limit(cuda.limit.PRINTF_FIFO_SIZE) >= 8 * MiB
    assert cuda.Context.get_limit(cuda.limit.MALLOC_HEAP_SIZE) >= 128 * MiB
    assert cuda.Context.get_limit(cuda.limit.STACK_SIZE) >= 8 * KiB
    cuda.Context.set_cache_config(cuda.func_cache.PREFER_L1)
    assert cuda.Context.get_cache_config() == cuda.func_cache.PREFER_L1
    cuda.Context.set_cache_config(cuda.func_cache.PREFER_NONE)


@pytest.mark.gpu
def test_gpu_device_malloc_after_raising_the_heap(ctx: cuda.Context) -> None:
    # 1024 threads x 64 KiB each = 64 MiB: more than the driver's default 8 MiB heap.
    threads, per_thread = 1024, 16 * KiB
    cuda.Context.set_limit(cuda.limit.MALLOC_HEAP_SIZE, 256 * MiB)
    fn = SourceModule(HEAP_SOURCE).get_function("heap_fill")
    out = np.zeros(threads, np.uint64)
    fn(cuda.Out(out), np.uint32(per_thread), block=(256, 1, 1), grid=(threads // 256, 1))
    t = np.arange(threads, dtype=np.uint64)
    n = np.uint64(per_thread)
    expected = t * n + n * (n - np.uint64(1)) // np.uint64(2)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.gpu
def test_gpu_kernel_with_more_than_48k_dynamic_shared_memory(ctx: cuda.Context) -> None:
    words = 20000  # 80 000 bytes
    fn = SourceModule(SHARED_SOURCE).get_function("reverse_shared")
    fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, words * 4)
    assert fn.get_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES) == words * 4
    out = np.zeros(words, np.uint32)
    fn(cuda.Out(out), np.uint32(words), block=(256, 1, 1), shared=words * 4)
    np.testing.assert_array_equal(out, np.arange(words, dtype=np.uint32)[::-1])
