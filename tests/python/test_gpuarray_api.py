"""GPUArray's PyCUDA surface beyond memory: vector types, complex arrays, strided views,
``__cuda_array_interface__`` (also as kernel arguments), take/put, concatenate/stack,
conditionals, logical operations and reductions.

Tests without the ``gpu`` mark run on the fake backend: shapes, dtypes, strides, flags, errors,
everything that moves memory (the fake keeps device memory in host memory), and every
generated kernel is compiled by the worker's NVRTC (:func:`compiles`: the fake then refuses to
run it, which proves it compiled and defines the kernel). Tests marked ``gpu`` compare results
with numpy on a real device. Several port the behaviour checks of PyCUDA's test_gpuarray.py.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import gpuarray
from gpurpc.compiler import SourceModule
from gpurpc.elementwise import ElementwiseKernel
from gpurpc.gpuarray import vec
from gpurpc.tools import dtype_to_ctype, parse_c_arg

rng = np.random.default_rng(7)

_FAKE_REFUSAL = "runs only its built-in host kernels"


def compiles(fn: Callable[[], Any]) -> Any:
    """Runs ``fn``. On the fake backend its generated kernel must compile with NVRTC and then
    be refused at get_function (the fake runs no device code); on a GPU it simply runs."""
    if not cuda.Context.get_device().is_fake:
        result = fn()
        cuda.Context.synchronize()
        return result
    with pytest.raises(cuda.LogicError, match=_FAKE_REFUSAL):
        fn()
    return None


def rand(shape: Any, dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        real = np.empty(0, dtype).real.dtype
        return (rng.random(shape).astype(real) + 1j * rng.random(shape).astype(real)).astype(dtype)
    if dtype.kind == "f":
        return rng.random(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "u":
        return rng.integers(0, 42, shape).astype(dtype)
    return rng.integers(-42, 42, shape).astype(dtype)


class CAIWrapper:
    """A foreign object that exposes only ``__cuda_array_interface__`` (as CuPy or Numba
    arrays do)."""

    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


# The fake backend runs these two kernels on the host, so CAI arguments are checked end to end.
_BUILTINS = r"""
extern "C" __global__ void fill_u32(unsigned* out, unsigned value, unsigned long long n)
{
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}
extern "C" __global__ void copy_bytes(char* dst, const char* src, unsigned long long n)
{
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
"""


# =============================================================================================
# vector types

def test_vec_dtypes_and_makers(ctx: cuda.Context) -> None:
    assert vec.float3 == np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32)])
    assert vec.int4.names == ("x", "y", "z", "w") and vec.int4.itemsize == 16
    assert vec.double2.itemsize == 16 and vec.uchar1.itemsize == 1
    assert vec.long4.fields["w"][0] == np.int64 and vec.ulonglong2.itemsize == 16
    for name in ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "float"):
        for n in (1, 2, 3, 4):
            assert getattr(vec, f"{name}{n}").itemsize == n * np.dtype(
                getattr(vec, f"{name}1")["x"]).itemsize
    f3 = vec.make_float3(1, 2.5, -3)
    assert isinstance(f3, np.void) and f3.dtype == vec.float3
    assert (f3["x"], f3["y"], f3["z"]) == (1.0, 2.5, -3.0)
    assert vec.make_int2(y=4, x=3)["y"] == 4
    with pytest.raises(TypeError, match="make_float3"):
        vec.make_float3(1, 2)
    # Registered under their C names, for kernel argument lists.
    assert dtype_to_ctype(vec.float4) == "float4"
    assert parse_c_arg("const float3 *p").dtype == vec.float3
    assert parse_c_arg("uint2 v").dtype == vec.uint2


def test_vec_arrays_move_and_fill(ctx: cuda.Context) -> None:
    host = np.zeros(50, vec.float3)
    host["x"] = np.arange(50)
    host["z"] = -np.arange(50)
    a = gpuarray.to_gpu(host)
    assert a.dtype == vec.float3 and np.array_equal(a.get(), host)
    # PyCUDA's test_vector_fill; zeros and repeated 4-byte patterns are memsets.
    b = gpuarray.GPUArray(100, dtype=vec.float3)
    b.fill(vec.make_float3(0.0, 0.0, 0.0))
    assert b.get().dtype == vec.float3 and not b.get()["y"].any()
    b.fill(vec.make_float3(2.0, 2.0, 2.0))
    assert (b.get()["z"] == 2).all()
    assert np.array_equal(a[10:20].get(), host[10:20])
    compiles(lambda: b.fill(vec.make_float3(1.0, 2.0, 3.0)))
    with pytest.raises(TypeError, match="not defined for arrays of dtype"):
        a + a
    with pytest.raises(TypeError, match="struct"):
        a.astype(np.float32)


def test_vec_kernel_arguments_compile(ctx: cuda.Context) -> None:
    compiles(lambda: ElementwiseKernel("float3 *z, float3 a, const int2 *p",
                                       "z[i].x = a.x + p[i].y; z[i].y = a.y; z[i].z = a.z"))


@pytest.mark.gpu
def test_vec_kernel_arguments(ctx: cuda.Context) -> None:
    p = np.zeros(10, vec.int2)
    p["y"] = np.arange(10)
    z = gpuarray.empty(10, vec.float3)
    k = ElementwiseKernel("float3 *z, float3 a, const int2 *p",
                          "z[i].x = a.x + p[i].y; z[i].y = a.y; z[i].z = a.z")
    k(z, vec.make_float3(1, 2, 3), gpuarray.to_gpu(p))
    out = z.get()
    assert np.array_equal(out["x"], 1 + np.arange(10, dtype=np.float32))
    assert (out["y"] == 2).all() and (out["z"] == 3).all()


# =============================================================================================
# complex

@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_memory_and_trivial_parts(ctx: cuda.Context, dtype) -> None:
    host = rand(37, dtype)
    a = gpuarray.to_gpu(host)
    assert np.array_equal(a.get(), host)
    z = gpuarray.zeros(3, dtype)  # PyCUDA's test_create_complex_zeros
    assert np.array_equal(z.get(), np.zeros(3, dtype))
    compiles(lambda: gpuarray.ones(4, dtype))  # 1+0j is no repeated 4-byte pattern
    r = gpuarray.to_gpu(np.arange(5, dtype=np.float32))
    assert r.real is r and r.conj() is r and gpuarray.conj(r) is r
    assert np.array_equal(r.imag.get(), np.zeros(5, np.float32))


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_kernels_compile(ctx: cuda.Context, dtype) -> None:
    a = gpuarray.to_gpu(rand(20, dtype))
    b = gpuarray.to_gpu(rand(20, dtype))
    f = gpuarray.to_gpu(rand(20, np.float64))
    for fn in [lambda: a + b, lambda: a * 2j, lambda: 3 - a, lambda: a / b, lambda: a ** 2,
               lambda: a ** b, lambda: -a, lambda: abs(a), lambda: a.real, lambda: a.imag,
               lambda: a.conj(), lambda: gpuarray.conj(a, out=a), lambda: a == b,
               lambda: a != 1j, lambda: a + f, lambda: f * a, lambda: a.astype(np.float32),
               lambda: f.astype(dtype), lambda: a.astype(np.bool_),
               lambda: a.astype(np.complex128 if dtype == np.complex64 else np.complex64),
               lambda: a.fill(1 + 2j), lambda: gpuarray.sum(a), lambda: gpuarray.dot(a, b),
               lambda: gpuarray.dot(a, f), lambda: gpuarray.any(a), lambda: gpuarray.all(a),
               lambda: gpuarray.where(a, f, f), lambda: gpuarray.logical_not(a),
               lambda: gpuarray.subset_sum(gpuarray.to_gpu(np.arange(5, dtype=np.int32)), a)]:
        compiles(fn)
    a_copy = a.copy()
    compiles(lambda: a_copy.__iadd__(b))
    compiles(lambda: a_copy.__imul__(2j))


def test_complex_errors(ctx: cuda.Context) -> None:
    a = gpuarray.to_gpu(rand(8, np.complex64))
    f = gpuarray.to_gpu(rand(8, np.float32))
    with pytest.raises(TypeError, match="ordering comparison"):
        a < a
    with pytest.raises(TypeError, match="ordering comparison"):
        a >= 1
    with pytest.raises(TypeError, match="in place"):
        f += a
    with pytest.raises(TypeError, match="complex"):
        f *= 1j
    with pytest.raises(TypeError, match="complex"):
        f.fill(1j)
    with pytest.raises(TypeError, match="max is not defined"):
        gpuarray.max(a)
    with pytest.raises(TypeError, match="if_positive"):
        gpuarray.if_positive(a, f, f)
    with pytest.raises(TypeError, match="maximum is not defined"):
        gpuarray.maximum(a, a)


def test_user_kernels_take_pycuda_complex(ctx: cuda.Context) -> None:
    # PyCUDA's spelling compiles unchanged: pycuda::complex<T> and its functions.
    compiles(lambda: ElementwiseKernel(
        "pycuda::complex<float> *z, const pycuda::complex<double> *x, float a",
        "z[i] = pycuda::complex<float>(pycuda::conj(x[i]) * (double)a) + abs(z[i]) "
        "+ exp(z[i])", "user_complex"))
    assert parse_c_arg("pycuda::complex<double> *x").dtype == np.complex128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_arithmetic(ctx: cuda.Context, dtype) -> None:
    # Also PyCUDA's test_multiply (complex64 by 2 and 2j) and test_complex_bits.
    rtol = 1e-5 if dtype == np.complex64 else 1e-12
    x, y = rand(1000, dtype), rand(1000, dtype) + 0.5
    f = rand(1000, np.float32)
    a, b, fg = gpuarray.to_gpu(x), gpuarray.to_gpu(y), gpuarray.to_gpu(f)
    np.testing.assert_allclose((a + b).get(), x + y, rtol=rtol)
    np.testing.assert_allclose((a * b).get(), x * y, rtol=rtol)
    np.testing.assert_allclose((a / b).get(), x / y, rtol=rtol)
    np.testing.assert_allclose((a - fg).get(), x - f, rtol=rtol)
    np.testing.assert_allclose((2j * a).get(), 2j * x, rtol=rtol)
    np.testing.assert_allclose((2 * a).get(), 2 * x, rtol=rtol)
    np.testing.assert_allclose((1 / a).get(), 1 / x, rtol=rtol)
    np.testing.assert_allclose((a ** 2).get(), x ** 2, rtol=10 * rtol)
    np.testing.assert_allclose((-a).get(), -x, rtol=rtol)
    assert (a + b).dtype == dtype and (a + fg).dtype == np.result_type(dtype, np.float32)
    m = abs(a)
    assert m.dtype == np.empty(0, dtype).real.dtype
    np.testing.assert_allclose(m.get(), np.abs(x), rtol=rtol)
    assert np.array_equal(a.real.get(), x.real) and np.array_equal(a.imag.get(), x.imag)
    assert np.array_equal(a.conj().get(), x.conj())
    assert np.array_equal((a == a).get(), np.ones(1000, dtype))
    out = a.astype(np.complex64)
    assert a.conj(out=out) is out
    np.testing.assert_allclose(out.get(), x.conj(), rtol=1e-6)
    assert np.array_equal(a.astype(np.float64).get(), x.real.astype(np.float64))
    c = a.copy()
    c *= 1j
    np.testing.assert_allclose(c.get(), x * 1j, rtol=rtol)
    np.testing.assert_allclose(gpuarray.sum(a).get(), x.sum(), rtol=1e-4)
    np.testing.assert_allclose(gpuarray.dot(a, b).get(), np.dot(x, y), rtol=1e-4)
    # contiguity is preserved (test_complex_bits)
    for order in ("C", "F"):
        z2 = gpuarray.to_gpu(rand((4, 5), dtype)).reshape((4, 5), order=order)
        attr = "c_contiguous" if order == "C" else "f_contiguous"
        for part in (z2.real, z2.imag, z2.conj()):
            assert getattr(part.flags, attr)


# =============================================================================================
# strided views

_INDEXES = [
    np.s_[1:5], np.s_[::2], np.s_[::-1], np.s_[5:1:-2], np.s_[3], np.s_[-1, ::3],
    np.s_[:, 2], np.s_[1:3, 1:3], np.s_[..., 1], np.s_[:, np.newaxis], np.s_[None, 2:4, ...],
    np.s_[::2, ::-3, 1:], np.s_[4:2], np.s_[2, 3, 1], np.s_[..., ::2, :],
]


@pytest.mark.parametrize("index", _INDEXES, ids=[str(i) for i in range(len(_INDEXES))])
def test_indexing_matches_numpy(ctx: cuda.Context, index) -> None:
    host = np.arange(6 * 7 * 5, dtype=np.float64).reshape(6, 7, 5)
    a = gpuarray.to_gpu(host)
    expected = host[index]
    view = a[index]
    assert view.shape == expected.shape and view.strides == expected.strides
    assert view.flags.c_contiguous == expected.flags.c_contiguous
    assert view.flags.f_contiguous == expected.flags.f_contiguous
    assert np.array_equal(view.get(), expected)  # a strided get (also on the fake)


def test_indexing_errors(ctx: cuda.Context) -> None:
    a = gpuarray.zeros((3, 4), np.float32)
    with pytest.raises(IndexError, match="out of bounds"):
        a[3]
    with pytest.raises(IndexError, match="out of bounds"):
        a[:, -5]
    with pytest.raises(IndexError, match="too many indices"):
        a[1, 2, 3]
    with pytest.raises(IndexError, match="single ellipsis"):
        a[..., ...]
    with pytest.raises(IndexError, match="take"):
        a[[0, 1]]


def test_pycuda_slice_tests(ctx: cuda.Context) -> None:
    # PyCUDA's test_slice, test_2d_slice_c, test_2d_slice_f, test_copy and test_get_set.
    a_host = rand(2000, np.float32)
    a = gpuarray.to_gpu(a_host)
    for _ in range(20):
        start = int(rng.integers(0, 2000))
        end = int(rng.integers(start, 2000))
        assert np.array_equal(a[start:end].get(), a_host[start:end])
    m_host = rand((100, 30), np.float32)
    m = gpuarray.to_gpu(m_host)
    f = gpuarray.GPUArray((30, 100), np.float32, gpudata=m.gpudata, order="F", base=m)
    f_host = f.get()
    assert np.array_equal(f_host, m_host.ravel().reshape((30, 100), order="F"))
    for _ in range(20):
        start = int(rng.integers(0, 100))
        end = int(rng.integers(start, 100))
        assert np.array_equal(m[start:end].get(), m_host[start:end])
        assert np.array_equal(f[:, start:end].get(), f_host[:, start:end])
    for shape in [(3, 3), (3, 1), (3, 3, 3)]:
        h = rand(shape, np.float32)
        g = gpuarray.to_gpu(h)
        for start, stop, step in [(0, 3, 1), (1, 2, 1), (0, 3, 2), (0, 3, 3)]:
            s = slice(start, stop, step)
            assert np.array_equal(g[s].get(), h[s])
            assert np.array_equal(g[s, s].get(), h[s, s])
    h = rand((3, 3, 3), np.float32).transpose((1, 2, 0))
    g = gpuarray.to_gpu(np.ascontiguousarray(h)).transpose((0, 1, 2))
    assert np.array_equal(g.get(), h)
    h4 = rand((4, 4, 4), np.float64)
    g4 = gpuarray.to_gpu(h4).transpose((1, 2, 0))
    assert np.array_equal(g4.get(), h4.transpose((1, 2, 0)))
    assert np.array_equal(g4[1:3, 1:3, 1:3].get(), h4.transpose((1, 2, 0))[1:3, 1:3, 1:3])


def test_transpose_squeeze_newaxis_view(ctx: cuda.Context) -> None:
    host = rand((10, 20, 30), np.float32)
    a = gpuarray.to_gpu(host)
    assert a.T.shape == (30, 20, 10) and a.T.strides == host.T.strides
    assert np.array_equal(a.T.get(), host.T)  # PyCUDA's test_transpose
    assert np.array_equal(gpuarray.transpose(a, (1, 0, 2)).get(), host.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="axes"):
        a.transpose((0, 1))
    b = a[:, np.newaxis]  # test_newaxis
    assert b.shape == host[:, np.newaxis].shape and b.strides == host[:, np.newaxis].strides
    # test_squeeze
    s_host = rand((40, 2, 5, 10), np.float64)
    s = gpuarray.to_gpu(s_host)
    piece = s[0:1, 1:2, :, :]
    assert piece.shape == (1, 1, 5, 10) and piece.flags.c_contiguous
    squeezed = piece.squeeze()
    assert squeezed.shape == (5, 10) and squeezed.flags.c_contiguous
    assert np.array_equal(squeezed.get(), s_host[0, 1])
    piece = s[:, :, 2:3, :]
    assert not piece.flags.c_contiguous
    squeezed = piece.squeeze()
    assert squeezed.shape == (40, 2, 10) and not squeezed.flags.c_contiguous
    assert np.array_equal(squeezed.get(), s_host[:, :, 2])
    assert s[:, :, 2:3].squeeze(2).shape == (40, 2, 10)
    with pytest.raises(ValueError, match="size not equal to one"):
        s.squeeze(0)
    # test_view and test_view_and_strides
    v = gpuarray.to_gpu(np.arange(128, dtype=np.float32).reshape(8, 16))
    assert v.view().shape == (8, 16)
    assert v.view(np.complex64).shape == (8, 8) and v.view(np.complex64).dtype == np.complex64
    assert v.view(np.int16).shape == (8, 32)
    x_host = rand((5, 10), np.float32)
    x = gpuarray.to_gpu(x_host)
    y = x[:3, :5].view()
    assert y.shape == (3, 5) and y.strides == x_host[:3, :5].strides
    assert np.array_equal(y.get(), x_host[:3, :5])
    with pytest.raises(ValueError, match="contiguous along one axis"):
        x[:, ::2].view(np.int16)


def test_reshape_rules(ctx: cuda.Context) -> None:
    # PyCUDA's test_reshape.
    host = np.arange(128, dtype=np.float32).reshape(8, 16)
    a = gpuarray.to_gpu(host)
    assert a.reshape(4, 32).shape == a.reshape((4, 32)).shape == a.reshape([4, 32]).shape
    assert a.reshape(-1, 32).shape == (4, 32)
    assert a.reshape((32, -1)).shape == (32, 4)
    assert a.reshape((8, -1, 4)).shape == (8, 4, 4)
    with pytest.raises(ValueError):
        a.reshape(-1, -1, 4)
    with pytest.raises(ValueError):
        a.reshape(-1, 5)
    view = a.reshape((4, 32), order="C")
    assert view.flags.c_contiguous and view.ptr == a.ptr
    assert np.array_equal(view.get(), host.reshape(4, 32))
    # Another order needs the elements laid out that way: a copy, as numpy makes.
    compiles(lambda: a.reshape(4, 32, order="F"))
    f = gpuarray.to_gpu(np.asfortranarray(host))
    g = f.reshape((4, 32), order="F")
    assert g.flags.f_contiguous and g.ptr == f.ptr
    assert np.array_equal(g.get(), host.reshape((4, 32), order="F"))
    assert np.array_equal(gpuarray.reshape(a, 2, 64).get(), host.reshape(2, 64))
    compiles(lambda: a[:, ::2].reshape(64))  # a strided view is copied first


@pytest.mark.gpu
def test_reshape_copies_match_numpy(ctx: cuda.Context) -> None:
    host = np.arange(128, dtype=np.float32).reshape(8, 16)
    a = gpuarray.to_gpu(host)
    r = a.reshape(4, 32, order="F")
    assert r.flags.f_contiguous
    assert np.array_equal(r.get(), host.reshape(4, 32, order="F"))
    assert np.array_equal(a[:, ::2].reshape(64).get(), host[:, ::2].reshape(64))
    assert np.array_equal(a.T.ravel().get(), host.T.ravel())


def test_contiguity_required(ctx: cuda.Context) -> None:
    a = gpuarray.to_gpu(rand((6, 8), np.float32))
    v = a[:, ::2]
    for fn in [lambda: v + 1, lambda: v * a[:, :4], lambda: -v, lambda: abs(v),
               lambda: v.astype(np.float64), lambda: v.reverse(),
               lambda: gpuarray.take(v, gpuarray.to_gpu(np.arange(3, dtype=np.int32))),
               lambda: gpuarray.maximum(v, 0.5), lambda: gpuarray.logical_not(v)]:
        with pytest.raises(RuntimeError, match="only contiguous arrays"):
            fn()
    for fn in [lambda: gpuarray.sum(v), lambda: gpuarray.dot(v, v), lambda: gpuarray.max(v),
               lambda: gpuarray.any(v)]:
        with pytest.raises(RuntimeError, match="only contiguous arrays"):
            fn()
    c = gpuarray.to_gpu(rand((6, 8), np.float32))
    fc = gpuarray.to_gpu(np.asfortranarray(rand((6, 8), np.float32)))
    with pytest.raises(ValueError, match="different orders"):
        c + fc


def test_strided_writes_and_copies_compile(ctx: cuda.Context) -> None:
    a = gpuarray.zeros((6, 8), np.float32)
    v = a[::2, 1::3]
    compiles(lambda: v.set(np.ones(v.shape, np.float32)))
    compiles(lambda: v.fill(3.0))
    compiles(lambda: v.copy())
    column = gpuarray.to_gpu(np.arange(6, dtype=np.float32))
    compiles(lambda: a.__setitem__((slice(None), 0), column))
    # A view spanning far more than its size is gathered on the device before the download.
    big = gpuarray.zeros(1 << 20, np.float32)
    compiles(lambda: big[::4096].get())


@pytest.mark.gpu
def test_strided_writes_and_copies(ctx: cuda.Context) -> None:
    host = rand((6, 8), np.float64)
    a = gpuarray.to_gpu(host)
    v = a[::2, 1::3]
    new = rand(v.shape, np.float64)
    v.set(new)
    host[::2, 1::3] = new
    assert np.array_equal(a.get(), host)
    a[1::2, ::-1] = 7.0
    host[1::2, ::-1] = 7.0
    assert np.array_equal(a.get(), host)
    c = a.T[2:5].copy()
    assert c.flags.c_contiguous and np.array_equal(c.get(), host.T[2:5])
    a[:, 0] = gpuarray.arange(6, dtype=np.float64)
    host[:, 0] = np.arange(6)
    assert np.array_equal(a.get(), host)
    big_host = rand(1 << 20, np.float32)
    big = gpuarray.to_gpu(big_host)
    assert np.array_equal(big[::4096].get(), big_host[::4096])
    assert np.array_equal(big[::-8192].get(), big_host[::-8192])


def test_like_constructors_orders(ctx: cuda.Context) -> None:
    # PyCUDA's test_zeros_like_etc (contiguous inputs).
    host = rand((16, 16), np.float32)
    for arr in [gpuarray.to_gpu(host), gpuarray.to_gpu(np.asfortranarray(host))]:
        for func in [gpuarray.empty_like, gpuarray.zeros_like, gpuarray.ones_like]:
            new = func(arr, order="A")
            assert new.flags.c_contiguous == arr.flags.c_contiguous
            assert new.flags.f_contiguous == arr.flags.f_contiguous
            new = func(arr, order="C")
            assert new.flags.c_contiguous and not new.flags.f_contiguous
            new = func(arr, order="F")
            assert new.flags.f_contiguous and not new.flags.c_contiguous
            new = func(arr, dtype=np.int16, order="K")
            assert new.dtype == np.int16 and new.shape == arr.shape
            assert new.flags.c_contiguous == arr.flags.c_contiguous
    assert np.array_equal(gpuarray.ones_like(gpuarray.to_gpu(host), order="F").get(),
                          np.ones((16, 16), np.float32))
    with pytest.raises(ValueError, match="order"):
        gpuarray.empty_like(gpuarray.to_gpu(host), order="X")


def test_truth_value_and_default_dtype(ctx: cuda.Context) -> None:
    # PyCUDA's test_truth_value, test_setitem_scalar and test_default_zero.
    for i in range(4):
        assert bool(gpuarray.ones((1,) * i, np.float32))
        assert not bool(gpuarray.zeros((1,) * i, np.float32))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(gpuarray.zeros(2, np.float32))
    a = gpuarray.zeros(5, "float32")
    a[...] = 1729
    assert np.array_equal(a.get(), np.full(5, 1729.0, np.float32))
    assert gpuarray.zeros(10).dtype == np.float64


# =============================================================================================
# __cuda_array_interface__ and kernel arguments

def test_cuda_array_interface(ctx: cuda.Context) -> None:
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = gpuarray.to_gpu(host)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (4, 6), "typestr": "<f4", "data": (a.ptr, False),
                   "strides": None, "version": 3}
    v = a[1:, ::2]
    cai = v.__cuda_array_interface__
    assert cai["strides"] == host[1:, ::2].strides and cai["shape"] == (3, 3)
    assert cai["data"] == (a.ptr + 6 * 4, False)
    assert a.T.__cuda_array_interface__["strides"] == host.T.strides
    assert gpuarray.empty(0, np.int64).__cuda_array_interface__["data"] == (0, False)
    assert gpuarray.empty(3, np.complex128).__cuda_array_interface__["typestr"] == "<c16"
    assert gpuarray.empty(3, vec.float3).__cuda_array_interface__["typestr"] == "|V12"


def test_cai_objects_are_kernel_arguments(ctx: cuda.Context) -> None:
    mod = SourceModule(_BUILTINS, no_extern_c=True)
    fill = mod.get_function("fill_u32")
    copy = mod.get_function("copy_bytes")
    a = gpuarray.zeros(64, np.uint32)
    fill(CAIWrapper(a[16:].__cuda_array_interface__), np.uint32(7), np.uint64(48),
         block=(64, 1, 1), grid=(1, 1))
    expected = np.zeros(64, np.uint32)
    expected[16:] = 7
    assert np.array_equal(a.get(), expected)
    # prepared calls take them too, and memcpy functions accept them as device pointers
    b = gpuarray.zeros(64, np.uint32)
    copy.prepare("PPQ").prepared_call((1, 1), (256, 1, 1), CAIWrapper(
        b.__cuda_array_interface__), CAIWrapper(a.__cuda_array_interface__), 256)
    assert np.array_equal(b.get(), expected)
    host = np.empty(64, np.uint32)
    cuda.memcpy_dtoh(host, CAIWrapper(b.__cuda_array_interface__))
    assert np.array_equal(host, expected)
    # a GPUArray view itself is checked through its base
    fill(a[:8], np.uint32(9), np.uint64(8), block=(8, 1, 1), grid=(1, 1))
    assert (a.get()[:8] == 9).all()


def test_foreign_pointers_are_refused(ctx: cuda.Context) -> None:
    mod = SourceModule(_BUILTINS, no_extern_c=True)
    fill = mod.get_function("fill_u32")
    fill_p = mod.get_function("fill_u32").prepare("PIQ")
    a = gpuarray.zeros(16, np.uint32)
    foreign = CAIWrapper({"shape": (16,), "typestr": "<u4", "data": (0x7f0000001000, False),
                          "version": 3})
    with pytest.raises(cuda.LogicError, match="not device memory of session"):
        fill(foreign, np.uint32(1), np.uint64(16), block=(16, 1, 1), grid=(1, 1))
    with pytest.raises(cuda.LogicError, match="not device memory of session"):
        fill_p.prepared_call((1, 1), (16, 1, 1), foreign, 1, 16)
    too_long = dict(a.__cuda_array_interface__, shape=(10 ** 6,))
    with pytest.raises(cuda.LogicError, match="extends past the end"):
        fill(CAIWrapper(too_long), np.uint32(1), np.uint64(16), block=(16, 1, 1), grid=(1, 1))
    with pytest.raises(TypeError, match="'data'"):
        fill(CAIWrapper({"shape": (1,), "typestr": "<u4", "version": 3}), np.uint32(1),
             np.uint64(1), block=(1, 1, 1), grid=(1, 1))

    other = cuda.Device(0).make_context()
    try:
        b = gpuarray.zeros(16, np.uint32)  # memory of the other session
        alloc = cuda.mem_alloc(64)
        b_cai = CAIWrapper(b.__cuda_array_interface__)
    finally:
        cuda.Context.pop()
    try:
        for arg in (b, b[2:], alloc):
            with pytest.raises(cuda.LogicError, match=f"session {other.session_id}"):
                fill(arg, np.uint32(1), np.uint64(4), block=(4, 1, 1), grid=(1, 1))
        with pytest.raises(cuda.LogicError, match=f"session {other.session_id}"):
            fill_p.prepared_call((1, 1), (4, 1, 1), b, 1, 4)
        if b.ptr != a.ptr:  # the two workers may hand out the same addresses
            with pytest.raises(cuda.LogicError, match="memory of gpurpc session"):
                fill(b_cai, np.uint32(1), np.uint64(4), block=(4, 1, 1), grid=(1, 1))
        assert not a.get().any()
    finally:
        del b, alloc
        other.detach()


# =============================================================================================
# take / put

def test_take_put_validation_and_compiles(ctx: cuda.Context) -> None:
    a = gpuarray.to_gpu(rand(100, np.float32))
    idx = gpuarray.to_gpu(np.arange(0, 100, 3, dtype=np.uint32))
    with pytest.raises(TypeError, match="integers"):
        gpuarray.take(a, gpuarray.zeros(3, np.float32))
    with pytest.raises(ValueError, match="one-dimensional"):
        gpuarray.take(a, gpuarray.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="one dtype"):
        gpuarray.multi_take([a, gpuarray.zeros(3, np.int32)], idx)
    with pytest.raises(ValueError, match="dest_shape or out"):
        gpuarray.multi_put([a], idx)
    with pytest.raises(TypeError, match="same dtype"):
        gpuarray.multi_take_put([a], idx, gpuarray.zeros(idx.shape, np.int64),
                                dest_shape=(10,))
    assert gpuarray.multi_take([], idx) == []
    compiles(lambda: gpuarray.take(a, idx))
    compiles(lambda: gpuarray.take(gpuarray.zeros(10, np.complex64), idx[:3]))
    compiles(lambda: gpuarray.multi_take([a, a], idx))
    compiles(lambda: gpuarray.multi_put([a[:34]], idx, dest_shape=(100,)))
    compiles(lambda: gpuarray.multi_take_put([a, a], idx, idx, dest_shape=(200,),
                                             src_offsets=[0, 1]))


@pytest.mark.gpu
def test_take_put(ctx: cuda.Context) -> None:
    # PyCUDA's test_take and test_take_put, with the results checked.
    idx = gpuarray.arange(0, 10000, 2, dtype=np.uint32)
    for dtype in [np.float32, np.complex64, vec.float3]:
        if dtype == vec.float3:
            host = np.zeros(60000, vec.float3)
            host["y"] = np.arange(60000)
        else:
            host = np.arange(60000).astype(dtype)
        a = gpuarray.to_gpu(host)
        assert np.array_equal(gpuarray.take(a, idx).get(), host[idx.get()])
    srcs = [gpuarray.to_gpu(rand(50, np.float64)) for _ in range(3)]
    taken = gpuarray.multi_take(srcs, gpuarray.to_gpu(np.array([4, 0, 49], np.int32)))
    for s, t in zip(srcs, taken):
        assert np.array_equal(t.get(), s.get()[[4, 0, 49]])
    dest = gpuarray.to_gpu(np.array([9, 3, 0], np.int64))
    put = gpuarray.multi_put(srcs, dest, out=[gpuarray.zeros(10) for _ in srcs])
    for s, p in zip(srcs, put):
        expected = np.zeros(10)
        expected[[9, 3, 0]] = s.get()[:3]
        assert np.array_equal(p.get(), expected)
    buf = gpuarray.to_gpu(np.arange(5 * 8, dtype=np.float32))
    dest_i = gpuarray.to_gpu(np.array([0, 1, 2, 3], np.uint32))
    src_i = gpuarray.to_gpu(np.array([7, 6, 5, 4], np.uint32))
    outs = gpuarray.multi_take_put([buf] * 5, dest_i, src_i, dest_shape=(4,),
                                   src_offsets=[i * 8 for i in range(5)])
    for i, o in enumerate(outs):
        assert np.array_equal(o.get(), np.arange(40, dtype=np.float32)[i * 8 + np.array(
            [7, 6, 5, 4])])


# =============================================================================================
# concatenate / stack

def test_concatenate_and_stack_along_axis_0(ctx: cuda.Context) -> None:
    # Contiguous blocks are device-to-device copies: checked on the fake backend too.
    hs = [rand((n, 15, 20), np.float32) for n in (5, 4, 3)]  # PyCUDA's test_concatenate
    cat = gpuarray.concatenate([gpuarray.to_gpu(h) for h in hs])
    assert cat.shape == (12, 15, 20) and np.array_equal(cat.get(), np.concatenate(hs))
    mixed = gpuarray.concatenate([gpuarray.to_gpu(np.arange(3, dtype=np.float64)),
                                  gpuarray.to_gpu(np.arange(2, dtype=np.float64))])
    assert np.array_equal(mixed.get(), np.array([0, 1, 2, 0, 1.0]))
    for ndim in (0, 1, 2):  # PyCUDA's test_stack, C order
        shape = (2, 2, 2)[:ndim]
        x, y = rand(shape, np.float64), rand(shape, np.float64)
        s = gpuarray.stack((gpuarray.to_gpu(x), gpuarray.to_gpu(y)))
        assert s.shape == (2,) + shape and np.array_equal(s.get(), np.stack((x, y)))
    with pytest.raises(ValueError, match="outside axis"):
        gpuarray.concatenate([gpuarray.zeros((2, 3)), gpuarray.zeros((2, 4))])
    with pytest.raises(ValueError, match="same shape"):
        gpuarray.stack([gpuarray.zeros(2), gpuarray.zeros(3)])
    with pytest.raises(ValueError, match="out of bounds"):
        gpuarray.concatenate([gpuarray.zeros(2)], axis=1)
    compiles(lambda: gpuarray.concatenate([gpuarray.zeros((2, 3)), gpuarray.zeros((2, 4))],
                                          axis=1))
    compiles(lambda: gpuarray.concatenate([gpuarray.zeros(3, np.int32), gpuarray.zeros(2)]))


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["F", "C"])
@pytest.mark.parametrize("ndim", [0, 1, 2])
def test_stack_orders(ctx: cuda.Context, order, ndim) -> None:
    shape = (2, 2, 2)[:ndim]
    axis = -1 if order == "F" else 0
    x, y = rand(shape, np.float64), rand(shape, np.float64)
    if order == "F":
        x, y = np.asfortranarray(x), np.asfortranarray(y)
    s = gpuarray.stack((gpuarray.to_gpu(x), gpuarray.to_gpu(y)), axis=axis)
    assert s.shape == np.stack((x, y), axis=axis).shape
    np.testing.assert_array_equal(s.get(), np.stack((x, y), axis=axis))


@pytest.mark.gpu
def test_concatenate_other_axes(ctx: cuda.Context) -> None:
    hs = [rand((4, n, 3), np.float32) for n in (1, 5, 2)]
    cat = gpuarray.concatenate([gpuarray.to_gpu(h) for h in hs], axis=1)
    assert np.array_equal(cat.get(), np.concatenate(hs, axis=1))
    cat = gpuarray.concatenate([gpuarray.to_gpu(h[:, :1]) for h in hs], axis=-1)
    assert np.array_equal(cat.get(), np.concatenate([h[:, :1] for h in hs], axis=-1))
    ints = gpuarray.concatenate([gpuarray.to_gpu(np.arange(3, dtype=np.int32)),
                                 gpuarray.to_gpu(np.ones(2))])
    assert ints.dtype == np.float64 and np.array_equal(ints.get(), [0, 1, 2, 1, 1])


# =============================================================================================
# conditionals, min/max, logical

def test_conditionals_and_logical_compile(ctx: cuda.Context) -> None:
    c = gpuarray.to_gpu(rand(20, np.int32))
    t = gpuarray.to_gpu(rand(20, np.float32))
    e = gpuarray.to_gpu(rand(20, np.float32))
    with pytest.raises(ValueError, match="shapes do not match"):
        gpuarray.if_positive(c, t, e[:10])
    with pytest.raises(ValueError, match="one dtype"):
        gpuarray.where(c, t, gpuarray.zeros(20))
    for fn in [lambda: gpuarray.if_positive(c, t, e), lambda: gpuarray.where(t, c, c),
               lambda: gpuarray.maximum(t, e), lambda: gpuarray.minimum(0, t),
               lambda: gpuarray.maximum(c, t), lambda: gpuarray.minimum(c, 2.5),
               lambda: gpuarray.logical_and(t, c), lambda: gpuarray.logical_or(t, 0.0),
               lambda: gpuarray.logical_not(c), lambda: t.reverse(),
               lambda: gpuarray.any(c), lambda: gpuarray.all(t),
               lambda: gpuarray.subset_max(gpuarray.to_gpu(np.arange(5, dtype=np.int32)), t),
               lambda: gpuarray.subset_min(gpuarray.to_gpu(np.arange(5, dtype=np.int32)), c),
               lambda: gpuarray.subset_dot(gpuarray.to_gpu(np.arange(5, dtype=np.int32)), t, e),
               lambda: t + gpuarray.to_gpu(np.array(2, np.float32)),
               lambda: gpuarray.to_gpu(np.array(2, np.float32)) - t,
               lambda: t.__ipow__(2)]:
        compiles(fn)
    # scalar-only logical operations need no kernel
    assert gpuarray.logical_and(1, 0).get() == np.False_
    assert gpuarray.logical_or(1, 0).get() == np.True_
    assert gpuarray.logical_not(0).get() == np.True_
    with pytest.raises(TypeError, match="logical_and"):
        gpuarray.logical_and(t, [1, 2])
    with pytest.raises(ValueError, match="zero-size"):
        gpuarray.subset_max(gpuarray.zeros(0, np.int32), t)


@pytest.mark.gpu
def test_conditionals_minmax_logical(ctx: cuda.Context) -> None:
    # PyCUDA's test_where, test_if_positive (maximum/minimum), test_minimum_maximum_scalar,
    # test_logical_and_or, test_logical_not, test_reverse.
    a, b, c = np.array([1, 0, -1]), np.array([2, 2, 2]), np.array([3, 3, 3])
    r = gpuarray.where(gpuarray.to_gpu(a), gpuarray.to_gpu(b), gpuarray.to_gpu(c))
    assert np.array_equal(r.get(), np.where(a, b, c))
    r = gpuarray.if_positive(gpuarray.to_gpu(a), gpuarray.to_gpu(b), gpuarray.to_gpu(c))
    assert np.array_equal(r.get(), np.where(a > 0, b, c))
    x, y = rand(20, np.float32), rand(20, np.float32)
    xg, yg = gpuarray.to_gpu(x), gpuarray.to_gpu(y)
    assert np.array_equal(gpuarray.maximum(xg, yg).get(), np.maximum(x, y))
    assert np.array_equal(gpuarray.minimum(xg, yg).get(), np.minimum(x, y))
    assert np.array_equal(gpuarray.maximum(xg, 0.5).get(), np.maximum(x, np.float32(0.5)))
    assert np.array_equal(gpuarray.minimum(0, xg).get(), np.minimum(0, x))
    i = rand(20, np.int32)
    m = gpuarray.maximum(gpuarray.to_gpu(i), yg)
    assert m.dtype == np.float64 and np.array_equal(m.get(), np.maximum(i, y))
    for op in ["logical_and", "logical_or"]:
        p, q = rng.random((10, 4)), rng.random((10, 4))
        p[p < 0.5] = 0
        pg, qg = gpuarray.to_gpu(p), gpuarray.to_gpu(q)
        fn = getattr(gpuarray, op)
        assert np.array_equal(fn(pg, qg).get(), getattr(np, op)(p, q))
        assert np.array_equal(fn(pg, 1.0).get(), getattr(np, op)(p, 1.0))
        assert np.array_equal(fn(pg, 0.0).get(), getattr(np, op)(p, 0.0))
        assert np.array_equal(fn(0.0, gpuarray.zeros((10, 4))).get(),
                              getattr(np, op)(0.0, np.zeros((10, 4))))
    p = rng.random((10, 4))
    p[p < 0.5] = 0
    assert np.array_equal(gpuarray.logical_not(gpuarray.to_gpu(p)).get(), np.logical_not(p))
    assert np.array_equal(xg.reverse().get(), x[::-1])


# =============================================================================================
# reductions and 0-d broadcasting

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.float32, np.float64,
                                   np.complex64])
def test_any_all(ctx: cuda.Context, dtype) -> None:
    # PyCUDA's test_any and test_all.
    arrays = [np.ones(10, dtype), np.zeros(1, dtype), np.ones(1, dtype), rand(10, dtype)]
    arrays += [np.array(p, dtype) for p in itertools.product([0, 1], [0, 1], [0, 1])]
    for ary in arrays:
        g = gpuarray.to_gpu(ary)
        for what in ("any", "all"):
            got = getattr(g, what)().get()
            assert got.dtype == np.bool_ and got == getattr(np, what)(ary)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
def test_subset_reductions(ctx: cuda.Context, dtype) -> None:
    # PyCUDA's test_subset_minmax, plus subset_sum and subset_dot.
    n, gran = 20000, 5
    a = rand(n, dtype) if dtype != np.int32 else rng.integers(-10 ** 6, 10 ** 6, n,
                                                              dtype=np.int32)
    b = rand(n, dtype)
    indices = np.array([i for i in range(n) if i % gran], np.int32)
    ag, bg, ig = gpuarray.to_gpu(a), gpuarray.to_gpu(b), gpuarray.to_gpu(indices)
    assert gpuarray.subset_min(ig, ag).get() == a[indices].min()
    assert gpuarray.subset_max(ig, ag).get() == a[indices].max()
    sub = a[indices]
    if dtype == np.int32:
        assert gpuarray.subset_sum(ig, ag, dtype=np.int64).get() == sub.astype(np.int64).sum()
    else:
        np.testing.assert_allclose(gpuarray.subset_sum(ig, ag).get(), sub.sum(), rtol=1e-4)
        np.testing.assert_allclose(gpuarray.subset_dot(ig, ag, bg).get(),
                                   np.dot(sub, b[indices]), rtol=1e-4)


@pytest.mark.gpu
def test_zero_d_arrays_broadcast(ctx: cuda.Context) -> None:
    # PyCUDA's test_multiply_array, test_addition_array, test_substract_array,
    # test_divide_array with a 0-d operand.
    a = np.arange(1, 11, dtype=np.float32)
    c = np.array(2, np.float32)
    ag, cg = gpuarray.to_gpu(a), gpuarray.to_gpu(c)
    assert np.array_equal((ag * cg).get(), a * c)
    assert np.array_equal((cg * ag).get(), c * a)
    assert np.array_equal((ag + cg).get(), a + c)
    assert np.array_equal((cg - ag).get(), c - a)
    np.testing.assert_allclose((cg / ag).get(), c / a, rtol=1e-6)
    ag += cg
    assert np.array_equal(ag.get(), a + c)
    p = gpuarray.to_gpu(a.copy())
    p **= 2
    np.testing.assert_allclose(p.get(), a ** 2, rtol=1e-6)


@pytest.mark.gpu
def test_operators_mixing_scalar_types_follow_numpy_each_time(ctx: cuda.Context) -> None:
    """The result type and kernel of ``array op scalar`` are memoized per (array dtype, scalar
    type, operator) in the session: interleaving scalar types and operators must give, every
    time, numpy's dtype and values -- a memo keyed too loosely would reuse the first one."""
    host_i = np.arange(-8, 8, dtype=np.int32)
    host_f = np.linspace(-2, 2, 16, dtype=np.float32)
    a_i, a_f = gpuarray.to_gpu(host_i), gpuarray.to_gpu(host_f)
    scalars = [2, 2.5, True, 1 + 2j, np.float32(2), np.int64(3), np.uint8(5), np.float64(0.5)]
    ops = {"x*s": lambda x, s: x * s, "s*x": lambda x, s: s * x, "x+s": lambda x, s: x + s,
           "s-x": lambda x, s: s - x, "x==s": lambda x, s: x == s, "x<s": lambda x, s: x < s}
    for _ in range(2):  # the second round runs on the memo
        for (a, host), scalar, (name, op) in itertools.product(
                [(a_i, host_i), (a_f, host_f)], scalars, ops.items()):
            if name == "x<s" and isinstance(scalar, complex):
                with pytest.raises(TypeError, match="ordering comparison"):
                    op(a, scalar)
                continue
            expected = op(host, scalar)
            if name in ("x==s", "x<s"):  # PyCUDA's comparisons give the array's dtype
                expected = expected.astype(a.dtype)
            got = op(a, scalar)
            assert got.dtype == expected.dtype, (name, a.dtype, scalar, expected.dtype)
            np.testing.assert_allclose(got.get(), expected, rtol=1e-6)
    b_i = gpuarray.to_gpu(host_i[::-1].copy())
    for _ in range(2):
        for x, y, hx, hy in [(a_i, a_f, host_i, host_f), (a_f, a_i, host_f, host_i),
                             (a_i, b_i, host_i, host_i[::-1])]:
            for got, expected in [(x + y, hx + hy), (y * x, hy * hx), (x - y, hx - hy)]:
                assert got.dtype == expected.dtype
                np.testing.assert_allclose(got.get(), expected, rtol=1e-6)
