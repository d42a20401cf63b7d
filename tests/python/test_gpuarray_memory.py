"""GPUArray's memory side (transfers, views, fill by memset, copies), which the fake backend
runs; arithmetic and reductions need real kernels and live in test_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import debug, gpuarray

rng = np.random.default_rng(7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.int64])
def test_to_gpu_get_round_trip(ctx: cuda.Context, dtype) -> None:
    host = (rng.standard_normal((37, 11)) * 100).astype(dtype)
    a = gpuarray.to_gpu(host)
    assert a.shape == (37, 11) and a.dtype == np.dtype(dtype)
    assert a.size == host.size and a.nbytes == host.nbytes and len(a) == 37
    assert a.strides == host.strides
    assert np.array_equal(a.get(), host)


def test_fortran_order_round_trip(ctx: cuda.Context) -> None:
    host = np.asfortranarray(rng.standard_normal((5, 7)))
    a = gpuarray.to_gpu(host)
    assert a.flags.f_contiguous and a.strides == host.strides
    assert np.array_equal(a.get(), host)


def test_set_and_get_into(ctx: cuda.Context) -> None:
    a = gpuarray.empty((4, 4), np.float32)
    host = rng.standard_normal((4, 4)).astype(np.float32)
    a.set(host)
    out = np.empty((4, 4), np.float32)
    assert a.get(out) is out and np.array_equal(out, host)
    with pytest.raises(ValueError):
        a.set(np.zeros(5, np.float32))
    with pytest.raises(ValueError):
        a.set(np.zeros((4, 4), np.float64))


def test_gpudata_is_a_device_address(ctx: cuda.Context) -> None:
    a = gpuarray.to_gpu(np.arange(10, dtype=np.int32))
    out = np.empty(10, np.int32)
    cuda.memcpy_dtoh(out, a.gpudata)
    assert (out == np.arange(10)).all()
    assert a.ptr == int(a.gpudata) != 0


@pytest.mark.parametrize("dtype,value", [(np.float32, 0), (np.float32, -2.5), (np.int16, 7),
                                         (np.uint8, 200), (np.float64, 0), (np.int64, -1)])
def test_zeros_and_fill_use_memset(ctx: cuda.Context, dtype, value) -> None:
    z = gpuarray.zeros(1000, dtype)
    assert (z.get() == 0).all()
    assert z.fill(value) is z
    assert (z.get() == np.array(value, dtype)).all()


def test_empty_arrays(ctx: cuda.Context) -> None:
    e = gpuarray.empty((0, 3), np.float32)
    assert e.size == 0 and e.gpudata is None and len(e) == 0
    assert e.get().shape == (0, 3)
    assert gpuarray.to_gpu(np.zeros(0)).get().shape == (0,)


def test_arithmetic_on_empty_arrays_makes_no_kernel(ctx: cuda.Context) -> None:
    """An operator on an empty array launches nothing, so it needs no kernel (the fake backend
    would refuse one): also when its result type is memoized, before and after a launch."""
    e = gpuarray.empty((0, 3), np.float32)
    for _ in range(2):
        for result, dtype in [(e * 2 + 1, np.float32), (e + e, np.float32),
                              (e * 2.5, np.float32), (e.astype(np.int32) * 2.5, np.float64),
                              (e - gpuarray.empty((0, 3), np.float64), np.float64)]:
            assert result.shape == (0, 3) and result.dtype == np.dtype(dtype)
            assert result.get().shape == (0, 3)


def test_slicing_views_share_memory(ctx: cuda.Context) -> None:
    host = np.arange(60, dtype=np.float32).reshape(6, 10)
    a = gpuarray.to_gpu(host)
    assert np.array_equal(a[2:4].get(), host[2:4])
    assert np.array_equal(a[-1].get(), host[-1])
    assert np.array_equal(a[3].get(), host[3])
    assert a[1:].shape == (5, 10)
    flat = gpuarray.to_gpu(np.arange(100, dtype=np.int32))
    view = flat[10:20]
    assert int(view.gpudata) == int(flat.gpudata) + 40
    view.fill(-1)
    expected = np.arange(100, dtype=np.int32)
    expected[10:20] = -1
    assert np.array_equal(flat.get(), expected)
    v = flat[::2]  # a strided view of the same memory
    assert v.strides == (8,) and not v.flags.forc
    assert int(v.gpudata) == int(flat.gpudata)
    with pytest.raises(IndexError):
        a[6]


def test_setitem(ctx: cuda.Context) -> None:
    a = gpuarray.zeros(10, np.float32)
    a[2:5] = 3.0
    a[5:8] = gpuarray.to_gpu(np.array([7, 8, 9], np.float32))
    a[8:] = np.array([1, 2], np.float32)
    assert a.get().tolist() == [0, 0, 3, 3, 3, 7, 8, 9, 1, 2]


def test_copy_reshape_ravel_view(ctx: cuda.Context) -> None:
    host = rng.standard_normal(24).astype(np.float32)
    a = gpuarray.to_gpu(host)
    b = a.copy()
    a.fill(0)
    assert np.array_equal(b.get(), host)
    r = b.reshape(2, 3, 4)
    assert r.shape == (2, 3, 4) and np.array_equal(r.get(), host.reshape(2, 3, 4))
    assert b.reshape((4, -1)).shape == (4, 6)
    assert r.ravel().shape == (24,)
    assert np.array_equal(b.view(np.uint32).get(), host.view(np.uint32))
    with pytest.raises(ValueError):
        b.reshape(5, 5)


def test_like_constructors(ctx: cuda.Context) -> None:
    a = gpuarray.to_gpu(np.ones((3, 2), np.float64))
    assert gpuarray.empty_like(a).shape == (3, 2)
    z = gpuarray.zeros_like(a)
    assert z.dtype == np.float64 and (z.get() == 0).all()
    o = gpuarray.ones_like(a, dtype=np.int32)
    assert o.dtype == np.int32 and (o.get() == 1).all()


@pytest.mark.parametrize("shape,order", [((5,), "C"), ((3, 4), "C"), ((3, 4), "F"),
                                         ((1, 7), "F"), ((2, 1, 3), "C"), ((2, 1, 3), "F")])
def test_like_arrays_are_laid_out_as_new_arrays(ctx: cuda.Context, shape, order) -> None:
    """empty_like (and every operator's result) takes a shortcut past GPUArray's checks: its
    strides, flags and memory must be what a new array of that shape, dtype and order has."""
    src = gpuarray.empty(shape, np.float32, order=order)
    # An array that is both C and F contiguous (a (1, 7) one) gives a C array, as before.
    kept = "F" if src.flags.f_contiguous and not src.flags.c_contiguous else "C"
    for dtype in (np.float32, np.float64, np.int8, np.complex128):
        like = gpuarray.empty_like(src, dtype=dtype)
        new = gpuarray.empty(shape, dtype, order=kept)
        host = np.empty(shape, dtype, order=kept)
        assert (like.shape, like.dtype, like.size, like.nbytes) == (
            shape, np.dtype(dtype), host.size, host.nbytes)
        assert like.strides == new.strides == host.strides
        assert (like.flags.c_contiguous, like.flags.f_contiguous) == (
            host.flags.c_contiguous, host.flags.f_contiguous)
        assert like.base is None and like.allocator is src.allocator
        assert like.ptr not in (src.ptr, new.ptr)
        data = (np.arange(host.size) % 100).astype(dtype).reshape(shape, order=order)
        like.set(data)
        assert np.array_equal(like.get(), data)


def test_temporaries_come_from_the_pool(ctx: cuda.Context) -> None:
    for _ in range(3):
        gpuarray.empty(1000, np.float32)
    cuda.Context.synchronize()
    debug.reset_rpc_counts()
    for _ in range(20):
        gpuarray.empty(1000, np.float32)  # freed at once, the block goes back to the pool
    assert "MemoryService.Allocate" not in debug.rpc_counts()


def test_async_get_and_set_on_a_stream(ctx: cuda.Context) -> None:
    stream = cuda.Stream()
    host = rng.standard_normal(5000)
    a = gpuarray.to_gpu_async(host, stream=stream)
    out = a.get_async(stream)
    stream.synchronize()
    assert np.array_equal(out, host)


def test_one_element_arrays_convert_to_python_scalars(ctx: cuda.Context) -> None:
    assert float(gpuarray.to_gpu(np.array(2.5, np.float32))) == 2.5
    assert int(gpuarray.to_gpu(np.array([7], np.int64))) == 7
    assert complex(gpuarray.to_gpu(np.array([[1 + 2j]], np.complex64))) == 1 + 2j
    with pytest.raises(TypeError, match=r"one element.*shape \(3,\)"):
        float(gpuarray.to_gpu(np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="one element"):
        int(gpuarray.to_gpu(np.zeros(0, np.int32)))
