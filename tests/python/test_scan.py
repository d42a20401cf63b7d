"""gpurpc.scan (pycuda.scan): the kernels compile for every kind of element (fake backend),
arguments are checked, the level plan is right; the scans themselves need a GPU (marked gpu)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import gpuarray, scan
from gpurpc.compiler import CompileError, SourceModule
from gpurpc.scan import ExclusiveScanKernel, InclusiveScanKernel
from gpurpc.tools import dtype_to_ctype, register_dtype

rng = np.random.default_rng(99)

# A non-commutative associative operation: composition of affine maps x -> m*x + c (mod 2**32),
# "a then b".
AFFINE = np.dtype([("m", np.uint32), ("c", np.uint32)])
register_dtype(AFFINE, "gpurpc_test_affine")
AFFINE_PREAMBLE = """
struct gpurpc_test_affine { unsigned int m; unsigned int c; };
__device__ gpurpc_test_affine affine_then(gpurpc_test_affine a, gpurpc_test_affine b)
{
  gpurpc_test_affine r;
  r.m = b.m * a.m;
  r.c = b.m * a.c + b.c;
  return r;
}
__device__ gpurpc_test_affine affine_identity()
{
  gpurpc_test_affine r;
  r.m = 1u;
  r.c = 0u;
  return r;
}
"""

VARIANTS = [
    (np.int32, "a+b", "0", ""),
    (np.uint8, "max(a, b)", "0", ""),
    (np.int64, "a*b", "1", ""),
    (np.float32, "a+b", "0.0f", ""),
    (np.float64, "fmin(a, b)", "__longlong_as_double(0x7ff0000000000000ULL)", ""),
    (np.bool_, "a || b", "false", ""),
    (AFFINE, "affine_then(a, b)", "affine_identity()", AFFINE_PREAMBLE),
]


# -- compiles (fake backend: NVRTC really runs) ---------------------------------------------

@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("dtype,expr,neutral,preamble", VARIANTS)
def test_scan_source_compiles(ctx: cuda.Context, dtype, expr, neutral, preamble,
                              exclusive: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an NVRTC warning fails the test too
        source = scan._scan_source(np.dtype(dtype), expr, neutral if exclusive else None,
                                   "pfx", preamble, exclusive)
        mod = SourceModule(source, no_extern_c=True)
    assert mod.cubin
    assert ("pfx_scan_tiles_exclusive" in source) == exclusive
    assert "pfx_scan_tiles(" in source and "pfx_final_update(" in source


def test_kernel_objects_compile_at_construction(ctx: cuda.Context) -> None:
    knl = InclusiveScanKernel(np.int32, "a+b")
    assert knl.dtype == np.dtype(np.int32) and knl.neutral is None
    ex = ExclusiveScanKernel(np.float64, "a+b", 0, name_prefix="my_scan", options=["-DX=1"])
    assert ex.neutral == "0" and ex.name_prefix == "my_scan"
    InclusiveScanKernel(AFFINE, "affine_then(a, b)", preamble=AFFINE_PREAMBLE, devices=None)
    with pytest.raises(CompileError, match="NVRTC compilation"):
        InclusiveScanKernel(np.int32, "a +* b")
    with pytest.raises(CompileError):
        ExclusiveScanKernel(np.int32, "a+b", "no_such_neutral")


def test_constructor_checks(ctx: cuda.Context) -> None:
    with pytest.raises(ValueError, match="neutral element is required for exclusive scan"):
        ExclusiveScanKernel(np.int32, "a+b")
    with pytest.raises(ValueError, match="name_prefix must be a C identifier"):
        InclusiveScanKernel(np.int32, "a+b", name_prefix="my scan")
    with pytest.raises(ValueError, match="scan_expr"):
        InclusiveScanKernel(np.int32, "  ")
    with pytest.raises(ValueError, match="unable to map dtype"):
        InclusiveScanKernel(np.dtype([("x", np.int32), ("y", np.int8)]), "a+b")


def _complex_supported() -> bool:
    try:
        dtype_to_ctype(np.complex64)
        return True
    except ValueError:
        return False


def test_complex_scans_follow_the_kernel_generators(ctx: cuda.Context) -> None:
    # Complex elements are scanned when the kernel generators have a complex C type (its
    # constructors are why the tile lives in raw shared storage); otherwise the error says so.
    if not _complex_supported():
        with pytest.raises(ValueError, match="unable to map dtype 'complex64'"):
            InclusiveScanKernel(np.complex64, "a+b")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (np.complex64, np.complex128):
            InclusiveScanKernel(dtype, "a*b")
            ExclusiveScanKernel(dtype, "a+b", "0")


# -- calls: argument checks and results that need no kernel ----------------------------------

def test_empty_arrays_and_output_choice(ctx: cuda.Context) -> None:
    knl = InclusiveScanKernel(np.int32, "a+b")
    x = gpuarray.empty(0, np.int32)
    assert knl(x) is x                       # in place by default, as PyCUDA
    new = knl(x, "new")
    assert new is not x and new.shape == (0,) and new.dtype == np.int32
    out = gpuarray.empty(0, np.int32)
    assert knl(x, out, stream=cuda.Stream()) is out
    ex = ExclusiveScanKernel(np.int32, "a+b", "0")
    assert ex(x, output_ary="new").shape == (0,)


def test_call_checks(ctx: cuda.Context) -> None:
    knl = InclusiveScanKernel(np.int32, "a+b")
    x = gpuarray.zeros(10, np.int32)
    with pytest.raises(TypeError, match="the input has dtype float32, but the kernel was made "
                                        "for int32"):
        knl(gpuarray.zeros(10, np.float32))
    with pytest.raises(TypeError, match="the output has dtype int64"):
        knl(x, gpuarray.zeros(10, np.int64))
    with pytest.raises(ValueError, match="input and output must have the same shape"):
        knl(x, gpuarray.zeros(11, np.int32))
    with pytest.raises(ValueError, match="must be 1-dimensional"):
        knl(gpuarray.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match='output_ary must be a GPUArray, None or "new"'):
        knl(x, "old")
    with pytest.raises(TypeError, match="the input must be a GPUArray, got ndarray"):
        knl(np.zeros(10, np.int32))

    class NonContiguous(gpuarray.GPUArray):
        @property
        def flags(self):  # type: ignore[override]
            return gpuarray._Flags(False, False)

    strided = NonContiguous((10,), np.int32, gpudata=x.gpudata, base=x)
    with pytest.raises(RuntimeError, match="cannot deal with non-contiguous arrays"):
        knl(strided)


# -- the plan -------------------------------------------------------------------------------

def test_levels() -> None:
    t = 2048
    assert scan._levels(1, t) == [(1, 1)]
    assert scan._levels(t, t) == [(t, 1)]
    assert scan._levels(t + 1, t) == [(t + 1, 2), (2, 1)]
    assert scan._levels(t * t, t) == [(t * t, t), (t, 1)]
    assert scan._levels(t * t + 1, t) == [(t * t + 1, t + 1), (t + 1, 2), (2, 1)]
    with pytest.raises(ValueError, match="too many for one scan"):
        scan._levels(((1 << 31) - 1) * t + 1, t)


def test_tile_shape_fits_shared_memory() -> None:
    assert scan._tile_shape(4) == (256, 8)
    assert scan._tile_shape(8) == (256, 8)
    for itemsize in (1, 2, 4, 8, 16, 24, 32, 48, 64, 100, 128, 256, 512):
        wg, k = scan._tile_shape(itemsize)
        tile = wg * k
        assert itemsize * (tile + tile // 32 + wg) <= scan._MAX_TILE_BYTES
        assert wg >= 32 and wg & (wg - 1) == 0 and k >= 1
    with pytest.raises(ValueError, match="too large for a scan tile"):
        scan._tile_shape(4096)


# -- numbers (a real GPU) ---------------------------------------------------------------------

SIZES = [1, 2, 31, 255, 256, 2047, 2048, 2049, 5000, 2048 * 2048 + 17]


def _exclusive(inclusive: np.ndarray, neutral) -> np.ndarray:
    return np.concatenate([np.array([neutral], inclusive.dtype), inclusive[:-1]])


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_int_sum_scans(ctx: cuda.Context, n: int) -> None:
    host = rng.integers(0, 10, n).astype(np.int32)
    want = np.cumsum(host, dtype=np.int32)
    inc = InclusiveScanKernel(np.int32, "a+b")
    exc = ExclusiveScanKernel(np.int32, "a+b", "0")

    x = gpuarray.to_gpu(host)
    assert inc(x) is x
    np.testing.assert_array_equal(x.get(), want)

    x = gpuarray.to_gpu(host)
    out = exc(x, "new")
    np.testing.assert_array_equal(out.get(), _exclusive(want, 0))
    np.testing.assert_array_equal(x.get(), host)  # the input is left alone

    x = gpuarray.to_gpu(host)
    assert exc(x) is x
    np.testing.assert_array_equal(x.get(), _exclusive(want, 0))


@pytest.mark.gpu
def test_float_scan_with_output_and_stream(ctx: cuda.Context) -> None:
    host = rng.standard_normal(300_001)
    x = gpuarray.to_gpu(host)
    out = gpuarray.empty_like(x)
    stream = cuda.Stream()
    assert InclusiveScanKernel(np.float64, "a+b")(x, out, stream=stream) is out
    stream.synchronize()
    np.testing.assert_allclose(out.get(), np.cumsum(host), rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [7, 2049, 1_000_003])
def test_max_and_min_scans(ctx: cuda.Context, n: int) -> None:
    host = rng.integers(-(1 << 40), 1 << 40, n).astype(np.int64)
    x = gpuarray.to_gpu(host)
    np.testing.assert_array_equal(InclusiveScanKernel(np.int64, "max(a, b)")(x, "new").get(),
                                  np.maximum.accumulate(host))
    neutral = "(-9223372036854775807LL - 1)"
    got = ExclusiveScanKernel(np.int64, "max(a, b)", neutral)(x, "new").get()
    np.testing.assert_array_equal(got, _exclusive(np.maximum.accumulate(host),
                                                  np.iinfo(np.int64).min))
    f = rng.standard_normal(n).astype(np.float32)
    got = InclusiveScanKernel(np.float32, "fminf(a, b)")(gpuarray.to_gpu(f), "new").get()
    np.testing.assert_array_equal(got, np.minimum.accumulate(f))


def _affine_scan(items: np.ndarray) -> np.ndarray:
    out = np.empty_like(items)
    m, c = 1, 0
    for i, (bm, bc) in enumerate(zip(items["m"].tolist(), items["c"].tolist())):
        m, c = (bm * m) & 0xFFFFFFFF, (bm * c + bc) & 0xFFFFFFFF
        out[i] = (m, c)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 2048, 70_001])
def test_non_commutative_struct_scan(ctx: cuda.Context, n: int) -> None:
    items = np.empty(n, AFFINE)
    items["m"] = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) | 1
    items["c"] = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    want = _affine_scan(items)
    x = gpuarray.to_gpu(items)
    got = InclusiveScanKernel(AFFINE, "affine_then(a, b)", preamble=AFFINE_PREAMBLE)(x, "new")
    assert np.array_equal(got.get(), want)
    ex = ExclusiveScanKernel(AFFINE, "affine_then(a, b)", "affine_identity()",
                             preamble=AFFINE_PREAMBLE)
    identity = np.array([(1, 0)], AFFINE)
    assert np.array_equal(ex(x).get(), np.concatenate([identity, want[:-1]]))


@pytest.mark.gpu
def test_complex_scan(ctx: cuda.Context) -> None:
    if not _complex_supported():
        pytest.skip("the kernel generators have no complex C type in this tree")
    host = (rng.standard_normal(10_007) + 1j * rng.standard_normal(10_007)).astype(np.complex128)
    got = InclusiveScanKernel(np.complex128, "a+b")(gpuarray.to_gpu(host), "new").get()
    np.testing.assert_allclose(got, np.cumsum(host), rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_scan_of_a_view(ctx: cuda.Context) -> None:
    host = rng.integers(0, 100, 10_000).astype(np.int64)
    x = gpuarray.to_gpu(host)
    InclusiveScanKernel(np.int64, "a+b")(x[1000:9000])
    want = host.copy()
    want[1000:9000] = np.cumsum(host[1000:9000])
    np.testing.assert_array_equal(x.get(), want)
