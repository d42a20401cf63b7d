"""Tests that need real kernels: PyCUDA-style scripts on a CUDA-backed daemon.

All are marked ``gpu`` and skipped (with the reason) on the fake backend. On the H200:
``GPURPC_ADDRESS=... python3 -m pytest tests/python -q -m gpu``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import gpuarray
from gpurpc.compiler import SourceModule
from gpurpc.elementwise import ElementwiseKernel
from gpurpc.reduction import ReductionKernel

from conftest import CLIENT_SRC, REPO_ROOT

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(2024)
EXAMPLES = REPO_ROOT / "client" / "python" / "examples"


def _random(shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "u":
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.integers(-100, 100, shape).astype(dtype)


# -- driver-level PyCUDA scripts ---------------------------------------------------------------

def test_pycuda_hello_gpu(ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __global__ void multiply_them(float *dest, float *a, float *b)
    {
      const int i = threadIdx.x;
      dest[i] = a[i] * b[i];
    }
    """)
    multiply_them = mod.get_function("multiply_them")
    a = _random(400, np.float32)
    b = _random(400, np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1), grid=(1, 1))
    assert np.array_equal(dest, a * b)
    multiply_them(cuda.InOut(a), cuda.In(a.copy()), cuda.In(b), block=(400, 1, 1))
    assert np.array_equal(a, dest)


def test_kernel_in_a_loop_on_device_memory(ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __global__ void scale(float *a, float factor, int n)
    {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) a[i] *= factor;
    }
    """)
    scale = mod.get_function("scale")
    host = _random(100_000, np.float32)
    a = cuda.to_device(host)
    for _ in range(100):
        scale(a, np.float32(1.01), np.int32(host.size), block=(256, 1, 1),
              grid=((host.size + 255) // 256, 1))
    out = cuda.from_device_like(a, host)
    np.testing.assert_allclose(out, host * np.float32(1.01) ** 100, rtol=1e-4)


def test_constant_memory_through_get_global(ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __constant__ float coeffs[4];
    __global__ void poly(float *out, const float *x, int n)
    {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) {
        float v = x[i];
        out[i] = coeffs[0] + v * (coeffs[1] + v * (coeffs[2] + v * coeffs[3]));
      }
    }
    """)
    address, size = mod.get_global("coeffs")
    assert size == 16
    coeffs = np.array([1.0, -2.0, 0.5, 0.25], np.float32)
    cuda.memcpy_htod(address, coeffs)
    x = _random(1000, np.float32)
    out = np.empty_like(x)
    mod.get_function("poly")(cuda.Out(out), cuda.In(x), np.int32(x.size), block=(256, 1, 1),
                             grid=(4, 1))
    expected = coeffs[0] + x * (coeffs[1] + x * (coeffs[2] + x * coeffs[3]))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_struct_of_device_pointers(ctx: cuda.Context) -> None:
    arrays = [_random(n, np.float32) for n in (3, 1000, 17)]
    devs = [cuda.to_device(a) for a in arrays]
    record = np.dtype([("datalen", np.int32), ("pad", np.int32), ("ptr", np.uintp)])
    table = np.array([(a.size, 0, int(d)) for a, d in zip(arrays, devs)], dtype=record)
    table_gpu = cuda.to_device(table)
    mod = SourceModule("""
    struct DoubleOperation { int datalen, __padding; float *ptr; };
    __global__ void double_array(DoubleOperation *a)
    {
      a = &a[blockIdx.x];
      for (int idx = threadIdx.x; idx < a->datalen; idx += blockDim.x)
        a->ptr[idx] *= 2;
    }
    """)
    mod.get_function("double_array")(table_gpu, block=(32, 1, 1), grid=(len(arrays), 1))
    for a, d in zip(arrays, devs):
        assert np.array_equal(cuda.from_device_like(d, a), a * 2)


def test_float4_by_value_arrives_intact(ctx: cuda.Context) -> None:
    # PyCUDA packs this with numpy alignment and the kernel sees (3, 4, 0, 0) (#143, #484).
    mod = SourceModule("""
    __global__ void store(float *out, float4 v)
    { out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w; }
    """)
    f = mod.get_function("store")
    assert f.param_layout == [(0, 8), (16, 16)]
    float4 = np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32), ("w", np.float32)])
    out = np.zeros(4, np.float32)
    f(cuda.Out(out), np.array((1, 2, 3, 4), dtype=float4)[()], block=(1, 1, 1))
    assert out.tolist() == [1, 2, 3, 4]
    f.prepare([np.intp, float4])
    buf = cuda.mem_alloc(16)
    f.prepared_call((1, 1), (1, 1, 1), buf, np.array((5, 6, 7, 8), dtype=float4)[()])
    assert cuda.from_device(buf, 4, np.float32).tolist() == [5, 6, 7, 8]


def test_streams_events_and_async_copies(ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __global__ void add(float *a, float v, int n)
    { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] += v; }
    """)
    add = mod.get_function("add").prepare("Pfi")
    n = 1 << 20
    streams = [cuda.Stream() for _ in range(3)]
    hosts = [_random(n, np.float32) for _ in streams]
    outs = [cuda.pagelocked_empty_like(h) for h in hosts]
    bufs = [cuda.mem_alloc(h.nbytes) for h in hosts]
    start, end = cuda.Event(), cuda.Event()
    start.record()
    for k, (s, h, o, b) in enumerate(zip(streams, hosts, outs, bufs)):
        cuda.memcpy_htod_async(b, h, s)
        add.prepared_async_call((n // 256, 1), (256, 1, 1), s, b, np.float32(k), n)
        cuda.memcpy_dtoh_async(o, b, s)
    for s in streams:
        s.synchronize()
    end.record().synchronize()
    assert end.time_since(start) > 0
    for k, (h, o) in enumerate(zip(hosts, outs)):
        assert np.array_equal(o, h + np.float32(k))


def test_prepared_calls_and_timed_call(ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __global__ void saxpy(float a, const float *x, float *y, int n)
    { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }
    """)
    saxpy = mod.get_function("saxpy").prepare([np.float32, np.intp, np.intp, np.int32])
    n = 50_000
    x, y = _random(n, np.float32), _random(n, np.float32)
    x_gpu, y_gpu = cuda.to_device(x), cuda.to_device(y)
    saxpy.prepared_call(((n + 255) // 256, 1), (256, 1, 1), 3.0, x_gpu, y_gpu, n)
    get_time = saxpy.prepared_timed_call(((n + 255) // 256, 1), (256, 1, 1), 1.0, x_gpu, y_gpu, n)
    assert 0 < get_time() < 1.0
    np.testing.assert_allclose(cuda.from_device_like(y_gpu, y), y + 4 * x, rtol=1e-5, atol=1e-5)
    seconds = mod.get_function("saxpy")(np.float32(0), x_gpu, y_gpu, np.int32(n),
                                        block=(256, 1, 1), grid=((n + 255) // 256, 1),
                                        time_kernel=True)
    assert 0 < seconds < 1.0


def test_out_of_bounds_launch_is_a_launch_error_and_the_session_then_refuses_work(
        ctx: cuda.Context) -> None:
    mod = SourceModule("""
    __global__ void wild_write(float *a) { a[(1ULL << 40) + threadIdx.x] = 1.0f; }
    """)
    buf = cuda.mem_alloc(1024)
    mod.get_function("wild_write")(buf, block=(32, 1, 1))
    with pytest.raises(cuda.LaunchError) as first:
        ctx.synchronize()
    assert "ILLEGAL_ADDRESS" in str(first.value)
    with pytest.raises(cuda.LaunchError) as later:
        cuda.memcpy_dtoh(np.empty(4, np.float32), buf)
    assert "ILLEGAL_ADDRESS" in str(later.value) and "make_context" in str(later.value)
    with pytest.raises(cuda.LaunchError) as last:
        cuda.mem_alloc(16)
    assert last.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_compile_error_shows_the_nvrtc_log(ctx: cuda.Context) -> None:
    with pytest.raises(cuda.CompileError) as info:
        SourceModule("__global__ void f(float *a) { a[0] = missing_symbol; }")
    assert "missing_symbol" in str(info.value)
    assert "[command:" in str(info.value)


# -- gpuarray ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_gpuarray_arithmetic_matches_numpy(ctx: cuda.Context, dtype) -> None:
    a, b = _random(10_001, dtype), _random(10_001, dtype)
    if np.dtype(dtype).kind == "i":
        b[b == 0] = 1
    ga, gb = gpuarray.to_gpu(a), gpuarray.to_gpu(b)
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    for got, want in [(ga + gb, a + b), (ga - gb, a - b), (ga * gb, a * b), (ga / gb, a / b),
                      (ga + 2, a + 2), (3 - ga, 3 - a), (ga * 1.5, a * 1.5),
                      (ga / 4, a / 4), (2 / gb, 2 / b), (-ga, -a), (abs(ga), abs(a))]:
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_allclose(got.get(), want, rtol=rtol)
    c = ga.copy()
    c += gb
    c *= 2
    c -= 1
    np.testing.assert_allclose(c.get(), (a + b) * 2 - 1, rtol=rtol)


def test_gpuarray_pow(ctx: cuda.Context) -> None:
    a = np.abs(_random(1000, np.float32)) + 0.1
    ga = gpuarray.to_gpu(a)
    np.testing.assert_allclose((ga ** 2).get(), a ** 2, rtol=1e-5)
    np.testing.assert_allclose((ga ** ga).get(), a ** a, rtol=1e-5)
    np.testing.assert_allclose((2 ** ga).get(), 2 ** a, rtol=1e-5)


def test_gpuarray_comparisons(ctx: cuda.Context) -> None:
    a, b = _random(5000, np.float32), _random(5000, np.float32)
    ga, gb = gpuarray.to_gpu(a), gpuarray.to_gpu(b)
    for got, want in [(ga < gb, a < b), (ga >= gb, a >= b), (ga == ga, a == a),
                      (ga != gb, a != b), (ga > 0, a > 0), (ga <= 0.5, a <= 0.5)]:
        assert got.dtype == ga.dtype  # PyCUDA: same dtype as the left operand, 1 or 0
        assert np.array_equal(got.get().astype(bool), want)


def test_gpuarray_fill_astype_arange(ctx: cuda.Context) -> None:
    g = gpuarray.empty(1000, np.float64).fill(1.25)
    assert (g.get() == 1.25).all()
    a = _random(1000, np.float64) * 10
    assert np.array_equal(gpuarray.to_gpu(a).astype(np.int32).get(), a.astype(np.int32))
    assert np.array_equal(gpuarray.arange(0, 100, 3, dtype=np.int32).get(),
                          np.arange(0, 100, 3, dtype=np.int32))
    np.testing.assert_allclose(gpuarray.arange(1.5, 10.0, 0.5, dtype=np.float32).get(),
                               np.arange(1.5, 10.0, 0.5, dtype=np.float32))


@pytest.mark.parametrize("n", [1, 511, 2048, 100_003, 3_000_001])
def test_gpuarray_reductions_match_numpy(ctx: cuda.Context, n: int) -> None:
    a, b = _random(n, np.float32), _random(n, np.float32)
    ga, gb = gpuarray.to_gpu(a), gpuarray.to_gpu(b)
    s = gpuarray.sum(ga)
    assert s.shape == () and s.dtype == np.float32
    np.testing.assert_allclose(s.get(), a.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(gpuarray.dot(ga, gb).get(), np.dot(a.astype(np.float64), b),
                               rtol=1e-4, atol=1e-3)
    assert gpuarray.max(ga).get() == a.max()
    assert gpuarray.min(ga).get() == a.min()
    assert ga.sum().get() == s.get()
    assert float(s) == float(s.get())  # one synchronising call, as with CuPy


def test_gpuarray_integer_reductions(ctx: cuda.Context) -> None:
    a = _random(77_777, np.int64)
    ga = gpuarray.to_gpu(a)
    assert gpuarray.sum(ga).get() == a.sum()
    assert gpuarray.max(ga).get() == a.max() and gpuarray.min(ga).get() == a.min()
    assert gpuarray.dot(ga, ga).get() == np.dot(a, a)


def test_gpuarray_views_feed_kernels(ctx: cuda.Context) -> None:
    a = _random((100, 10), np.float32)
    ga = gpuarray.to_gpu(a)
    np.testing.assert_allclose((ga[10:20] * 2).get(), a[10:20] * 2)
    np.testing.assert_allclose(gpuarray.sum(ga[50:]).get(), a[50:].sum(), rtol=1e-4)


def test_maximum_minimum(ctx: cuda.Context) -> None:
    a, b = _random(3000, np.float64), _random(3000, np.float64)
    ga, gb = gpuarray.to_gpu(a), gpuarray.to_gpu(b)
    assert np.array_equal(gpuarray.maximum(ga, gb).get(), np.maximum(a, b))
    assert np.array_equal(gpuarray.minimum(ga, gb).get(), np.minimum(a, b))


# -- ElementwiseKernel / ReductionKernel --------------------------------------------------------

def test_elementwise_kernel(ctx: cuda.Context) -> None:
    lin_comb = ElementwiseKernel(
        "float a, float *x, float b, float *y, float *z",
        "z[i] = a*x[i] + b*y[i]",
        "linear_combination")
    x, y = _random(50_000, np.float32), _random(50_000, np.float32)
    gx, gy = gpuarray.to_gpu(x), gpuarray.to_gpu(y)
    gz = gpuarray.empty_like(gx)
    lin_comb(np.float32(5), gx, 6, gy, gz)  # scalars convert like PyCUDA's prepared calls
    np.testing.assert_allclose(gz.get(), 5 * x + 6 * y, rtol=1e-5, atol=1e-5)
    gz.fill(0)
    lin_comb(5, gx, 6, gy, gz, range=slice(100, 200, 2))
    expected = np.zeros_like(x)
    expected[100:200:2] = (5 * x + 6 * y)[100:200:2]
    np.testing.assert_allclose(gz.get(), expected, rtol=1e-5, atol=1e-5)


def test_elementwise_kernel_with_preamble_and_stream(ctx: cuda.Context) -> None:
    knl = ElementwiseKernel("double *x, double *out", "out[i] = square(x[i]) + i",
                            "square_plus_index",
                            preamble="__device__ double square(double v) { return v * v; }")
    x = _random(1000, np.float64)
    gx = gpuarray.to_gpu(x)
    out = gpuarray.empty_like(gx)
    stream = cuda.Stream()
    knl(gx, out, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(out.get(), x * x + np.arange(1000), rtol=1e-12)


def test_reduction_kernel(ctx: cuda.Context) -> None:
    dot = ReductionKernel(np.float64, neutral="0", reduce_expr="a+b",
                          map_expr="(double)x[i]*y[i]", arguments="float *x, float *y")
    x, y = _random(1_000_000, np.float32), _random(1_000_000, np.float32)
    result = dot(gpuarray.to_gpu(x), gpuarray.to_gpu(y))
    assert result.shape == () and result.dtype == np.float64
    np.testing.assert_allclose(result.get(), np.dot(x.astype(np.float64), y), rtol=1e-9)
    count_positive = ReductionKernel(np.int32, "0", "a+b", "x[i] > 0 ? 1 : 0", "const float *x")
    assert count_positive(gpuarray.to_gpu(x)).get() == (x > 0).sum()


# -- examples --------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(daemon: str, example: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(CLIENT_SRC), GPURPC_ADDRESS=daemon)
    result = subprocess.run([sys.executable, str(EXAMPLES / example)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip()
