"""CUDA arrays through ``gpurpc.driver`` (gpurpc._arrays, and Memcpy2D/Memcpy3D with array
sides) against a real daemon: round trips, layouts against numpy, offsets, hostile inputs and
the device-memory quota.

Every value is checked through the public API (host -> array -> host, or through device
memory), never through a backend's internals, so the same tests run on the fake backend (CI)
and on a GPU. A new CUDA array holds undefined bytes: tests that check that a refused copy
wrote nothing fill the destination first.
"""
from __future__ import annotations

import gc
import os
import pwd
import subprocess
from pathlib import Path
from typing import Iterator, List, Tuple

import grpc
import numpy as np
import pytest

import gpurpc.admin
import gpurpc.driver as cuda
import gpurpc.gpuarray as gpuarray
from gpurpc import _context, _core, _devices
from gpurpc.v1 import execution_service_pb2 as ex, memory_service_pb2 as mem

from conftest import REPO_ROOT, _wait_ready

rng = np.random.default_rng(20241201)
MiB = 1 << 20
F = cuda.array_format

# (numpy dtype of one channel, format, channels)
FORMATS = [
    (np.uint8, F.UNSIGNED_INT8, 1),
    (np.int8, F.SIGNED_INT8, 4),
    (np.uint16, F.UNSIGNED_INT16, 2),
    (np.int16, F.SIGNED_INT16, 1),
    (np.uint32, F.UNSIGNED_INT32, 4),
    (np.int32, F.SIGNED_INT32, 2),
    (np.float16, F.HALF, 2),
    (np.float32, F.FLOAT, 1),
    (np.float32, F.FLOAT, 4),
]
FORMAT_IDS = [f"{f.name}x{c}" for _, f, c in FORMATS]
# (width, height, depth) of ArrayDescriptor3D: 1D, 2D, 3D
SHAPES = [(37, 0, 0), (19, 7, 0), (9, 5, 3)]


# -- helpers ----------------------------------------------------------------------------------

def random_bytes(n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def element_bytes(fmt: int, channels: int) -> int:
    return {1: 1, 2: 2, 3: 4, 8: 1, 9: 2, 10: 4, 16: 2, 32: 4}[int(fmt)] * channels


def make_array(width: int, height: int = 0, depth: int = 0, fmt: int = F.FLOAT,
               channels: int = 1, flags: int = 0) -> cuda.Array:
    desc = cuda.ArrayDescriptor3D()
    desc.width, desc.height, desc.depth = width, height, depth
    desc.format, desc.num_channels, desc.flags = fmt, channels, flags
    return cuda.Array(desc)


def nbytes_of(ary: cuda.Array) -> int:
    d = ary.get_descriptor_3d()
    return d.width * element_bytes(d.format, d.num_channels) * max(d.height, 1) * max(d.depth, 1)


def read_via_device(ary: cuda.Array) -> np.ndarray:
    """All bytes of the array in row-major order, through device memory (array -> device ->
    host: no host staging on the array side)."""
    n = nbytes_of(ary)
    dev = cuda.mem_alloc(n)
    cuda.memcpy_atod(dev, ary, 0, n)
    out = np.empty(n, np.uint8)
    cuda.memcpy_dtoh(out, dev)
    dev.free()
    return out


def write_via_device(ary: cuda.Array, data: np.ndarray) -> None:
    dev = cuda.to_device(data)
    cuda.memcpy_dtoa(ary, 0, dev, data.nbytes)
    dev.free()


def filled(width: int, height: int = 0, depth: int = 0, fmt: int = F.UNSIGNED_INT8,
           channels: int = 1, flags: int = 0) -> Tuple[cuda.Array, np.ndarray]:
    """A new array with known random contents, and those contents (bytes, row-major)."""
    ary = make_array(width, height, depth, fmt, channels, flags)
    data = random_bytes(nbytes_of(ary))
    cuda.memcpy_htoa(ary, 0, data)
    return ary, data


def _pad(n: int, block: int) -> int:
    if n >= block:
        return -(-n // block) * block
    padded = 1
    while padded < n:
        padded <<= 1
    return padded


def charge(width: int, height: int, depth: int, element: int, layered: bool = False) -> int:
    """The quota charge of memory_service.proto's ArrayDescriptor."""
    row = -(-width * element // 512) * 512
    rows = 1 if height == 0 else max(32, _pad(height, 256))
    slices = 1 if depth == 0 else (depth if layered else _pad(depth, 32))
    return row * rows * slices


def queue_raw(core: _core.SessionCore, dst: ex.Copy3DEndpoint, src: ex.Copy3DEndpoint,
              w: int, h: int = 1, d: int = 1) -> None:
    """A Copy3DCommand straight onto the wire (no client-side checks), drained."""
    core.commands.add("raw copy_3d", copy_3d=_core.copy_3d_command(dst, src, w, h, d, 0))
    core.commands.drain(label="raw copy_3d")


@pytest.fixture
def kinds(ctx: cuda.Context, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The kinds of the commands the context queues from now on."""
    seen: List[str] = []
    original = ctx._core.commands.add

    def add(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.extend(k for k in kwargs if k in ex.Command.DESCRIPTOR.fields_by_name)
        return original(*args, **kwargs)

    monkeypatch.setattr(ctx._core.commands, "add", add)
    return seen


@pytest.fixture
def other(daemon: str, ctx: cuda.Context) -> Iterator[cuda.Context]:
    """A second session; ``ctx`` stays current."""
    second = cuda.Device(0).retain_primary_context()
    try:
        yield second
    finally:
        second.detach()


# -- names, enums, descriptors ----------------------------------------------------------------

def test_names_are_served_and_exported() -> None:
    names = ["Array", "ArrayDescriptor", "ArrayDescriptor3D", "array_format", "array3d_flags",
             "dtype_to_array_format", "matrix_to_array", "np_to_array", "gpuarray_to_array",
             "make_multichannel_2d_array", "memcpy_htoa", "memcpy_atoh", "memcpy_htoa_async",
             "memcpy_atoh_async", "memcpy_dtoa", "memcpy_atod", "memcpy_atoa"]
    for name in names:
        assert hasattr(cuda, name), name
        assert name in cuda.__all__, name
        assert name not in cuda._NOT_AVAILABLE, name
        assert getattr(cuda, name).__module__ == "gpurpc.driver", name
    # Texture references stay unavailable, saying why.
    for name in ("TextureReference", "SurfaceReference", "bind_array_to_texref"):
        assert not hasattr(cuda, name)
        with pytest.raises(AttributeError, match="CUDA 12"):
            getattr(cuda, name)


def test_enum_values_are_cudas() -> None:
    assert {m.name: int(m) for m in cuda.array_format} == {
        "UNSIGNED_INT8": 1, "UNSIGNED_INT16": 2, "UNSIGNED_INT32": 3, "SIGNED_INT8": 8,
        "SIGNED_INT16": 9, "SIGNED_INT32": 10, "HALF": 16, "FLOAT": 32}
    flags = cuda.array3d_flags
    assert (flags.ARRAY3D_LAYERED, flags.SURFACE_LDST, flags.CUBEMAP,
            flags.TEXTURE_GATHER) == (1, 2, 4, 8)
    assert getattr(flags, "2DARRAY") == flags.ARRAY3D_LAYERED  # PyCUDA's old name
    assert flags.SURFACE_LDST | flags.ARRAY3D_LAYERED == 3


def test_dtype_to_array_format() -> None:
    pairs = [(np.uint8, F.UNSIGNED_INT8), (np.uint16, F.UNSIGNED_INT16),
             (np.uint32, F.UNSIGNED_INT32), (np.int8, F.SIGNED_INT8),
             (np.int16, F.SIGNED_INT16), (np.int32, F.SIGNED_INT32), (np.float32, F.FLOAT),
             (np.float16, F.HALF), ("f4", F.FLOAT), (np.dtype("<u2"), F.UNSIGNED_INT16)]
    for dtype, fmt in pairs:
        assert cuda.dtype_to_array_format(dtype) is fmt
    for dtype in (np.float64, np.int64, np.uint64, np.complex64, np.bool_, ">f4"):
        with pytest.raises(TypeError, match="cannot convert dtype"):
            cuda.dtype_to_array_format(dtype)


def test_descriptors_behave_like_pycudas() -> None:
    d2 = cuda.ArrayDescriptor()
    assert (d2.width, d2.height, d2.format, d2.num_channels) == (0, 0, 0, 0)
    d2.width, d2.height, d2.format, d2.num_channels = 16, 8, cuda.array_format.FLOAT, 2
    assert d2.format is F.FLOAT
    d2.format = 3  # a plain int becomes the enum
    assert d2.format is F.UNSIGNED_INT32
    assert not hasattr(d2, "depth")
    with pytest.raises(AttributeError):
        d2.depth = 3  # a 2D descriptor has no depth (a typo is not silently accepted)
    d3 = cuda.ArrayDescriptor3D(width=4, height=3, depth=2, format=F.HALF, num_channels=4,
                                flags=cuda.array3d_flags.SURFACE_LDST)
    assert (d3.width, d3.height, d3.depth, d3.flags) == (4, 3, 2, 2)
    assert d3 == cuda.ArrayDescriptor3D(width=4, height=3, depth=2, format=16, num_channels=4,
                                        flags=2)
    assert "HALF" in repr(d3) and "depth=2" in repr(d3)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises((TypeError, ValueError)):
            d3.width = bad
    with pytest.raises(TypeError, match="format must be an array_format"):
        d3.format = "FLOAT"
    with pytest.raises(TypeError, match="unexpected keyword"):
        cuda.ArrayDescriptor(depth=3)


def test_range_boxes_cover_row_major_ranges() -> None:
    """The boxes of an unstructured copy cover exactly its bytes, in row-major order, with
    at most five boxes (no daemon needed)."""
    from gpurpc import _arrays

    class Shape:  # what _range_boxes reads of an Array
        def __init__(self, row: int, rows: int, slices: int) -> None:
            self._row_bytes, self._rows, self._slices = row, rows, slices

    for row, rows, slices in [(12, 1, 1), (12, 5, 1), (8, 3, 4), (4, 1, 6), (20, 7, 3)]:
        total = row * rows * slices
        for _ in range(60):
            index = int(rng.integers(0, total))
            n = int(rng.integers(0, total - index + 1))
            boxes = _arrays._range_boxes(Shape(row, rows, slices), index, n)  # type: ignore
            assert len(boxes) <= 5
            seen = np.full((slices, rows, row), -1, np.int64)
            for x, y, z, w, h, d, offset in boxes:
                box = np.arange(w * h * d).reshape(d, h, w)  # a dense linear run
                assert (seen[z:z + d, y:y + h, x:x + w] == -1).all()
                assert x + w <= row and y + h <= rows and z + d <= slices
                seen[z:z + d, y:y + h, x:x + w] = offset + (box // (w * h)) * row * rows + \
                    (box // w % h) * row + box % w
            flat = seen.reshape(-1)
            expect = np.full(total, -1, np.int64)
            expect[index:index + n] = np.arange(n)
            np.testing.assert_array_equal(flat, expect)


def test_pitched_strides_of_gpuarray_views() -> None:
    from gpurpc import _arrays
    ps = _arrays._pitched_strides
    assert ps((5, 7), (28, 4), 4, "C") == (28, 5)
    assert ps((5, 7), (200, 4), 4, "C") == (200, 5)  # a row slice of a wider array
    assert ps((5, 7), (4, 20), 4, "C") is None  # F-ordered, read as C
    assert ps((5, 7), (4, 20), 4, "F") == (20, 7)
    assert ps((5, 7), (56, 8), 4, "C") is None  # every other column
    assert ps((3, 4, 5), (80, 20, 4), 4, "C") == (20, 4)
    assert ps((3, 4, 5), (120, 20, 4), 4, "C") == (20, 6)  # slices padded by two rows
    assert ps((3, 4, 5), (90, 20, 4), 4, "C") is None  # slices not whole rows apart
    assert ps((3, 4, 5), (4, 12, 48), 4, "F") == (12, 4)
    assert ps((5, 7), (-28, 4), 4, "C") is None  # reversed rows


# -- creation, descriptors back, release ------------------------------------------------------

@pytest.mark.parametrize("width, height, depth", SHAPES + [(5, 4, 3)])
def test_array_reports_its_descriptor(ctx: cuda.Context, width: int, height: int,
                                      depth: int) -> None:
    flags = cuda.array3d_flags.ARRAY3D_LAYERED if (width, height, depth) == (5, 4, 3) else 0
    ary = make_array(width, height, depth, F.SIGNED_INT16, 2, flags)
    assert isinstance(ary.handle, int) and ary.handle > 0
    d3 = ary.get_descriptor_3d()
    assert isinstance(d3, cuda.ArrayDescriptor3D)
    assert (d3.width, d3.height, d3.depth, d3.format, d3.num_channels, d3.flags) == \
        (width, height, depth, F.SIGNED_INT16, 2, flags)
    d2 = ary.get_descriptor()
    assert isinstance(d2, cuda.ArrayDescriptor)
    assert (d2.width, d2.height, d2.format, d2.num_channels) == (width, height,
                                                                 F.SIGNED_INT16, 2)
    assert f"array {ary.handle}" in repr(ary)
    # The daemon describes it as an array (GetAllocation by id), charged as the proto says.
    info = ctx._core.call("MemoryService.GetAllocation",
                          mem.GetAllocationRequest(buffer_id=ary.handle)).buffer
    assert info.HasField("array") and info.device_address == 0
    assert (info.array.width, info.array.height, info.array.depth, info.array.flags) == \
        (width, height, depth, flags)
    assert info.size_bytes == charge(width, height, depth, 4, layered=bool(flags & 1))
    ary.free()


def test_a_2d_descriptor_makes_a_2d_array(ctx: cuda.Context) -> None:
    desc = cuda.ArrayDescriptor()
    desc.width, desc.height, desc.format, desc.num_channels = 24, 10, F.UNSIGNED_INT8, 4
    ary = cuda.Array(desc)
    assert ary.get_descriptor() == desc
    d3 = ary.get_descriptor_3d()
    assert (d3.depth, d3.flags) == (0, 0)
    data = random_bytes(24 * 4 * 10)
    cuda.memcpy_htoa(ary, 0, data)
    back = np.empty_like(data)
    cuda.memcpy_atoh(back, ary, 0)
    np.testing.assert_array_equal(back, data)


def test_free_twice_context_manager_and_garbage_collection(ctx: cuda.Context) -> None:
    core = ctx._core
    ary = make_array(64, 4)
    handle = ary.handle
    ary.free()
    ary.free()  # a no-op, as in PyCUDA
    with pytest.raises(cuda.LogicError):
        core.call("MemoryService.GetAllocation", mem.GetAllocationRequest(buffer_id=handle))
    with make_array(8, 2) as scoped:
        inner = scoped.handle
        cuda.memcpy_htoa(scoped, 0, np.zeros(16, np.float32))
    with pytest.raises(cuda.LogicError, match="freed"):
        cuda.memcpy_htoa(scoped, 0, np.zeros(16, np.float32))
    with pytest.raises(cuda.LogicError):
        core.call("MemoryService.GetAllocation", mem.GetAllocationRequest(buffer_id=inner))
    # Dropped: freed at the context's next synchronising call.
    dropped = make_array(32, 3).handle
    gc.collect()
    ctx.synchronize()
    with pytest.raises(cuda.LogicError):
        core.call("MemoryService.GetAllocation", mem.GetAllocationRequest(buffer_id=dropped))


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype, fmt, channels", FORMATS, ids=FORMAT_IDS)
def test_round_trip_host_array_host(ctx: cuda.Context, shape: Tuple[int, int, int], dtype,
                                    fmt: int, channels: int) -> None:
    width, height, depth = shape
    ary = make_array(width, height, depth, fmt, channels)
    dims = [n for n in (depth, height) if n] + [width, channels]
    if np.dtype(dtype).kind == "f":
        host = rng.standard_normal(dims).astype(dtype)
    else:
        info = np.iinfo(dtype)
        host = rng.integers(info.min, info.max, dims, dtype=dtype, endpoint=True)
    cuda.memcpy_htoa(ary, 0, host)
    back = np.zeros_like(host)
    cuda.memcpy_atoh(back, ary, 0)
    np.testing.assert_array_equal(back, host)
    # The same bytes through device memory (no host staging on the array side).
    np.testing.assert_array_equal(read_via_device(ary), host.reshape(-1).view(np.uint8))
    # And through Memcpy3D both ways.
    row = width * host.itemsize * channels
    copy = cuda.Memcpy3D()
    copy.set_src_array(ary)
    again = np.zeros_like(host)
    copy.set_dst_host(again)
    copy.width_in_bytes = copy.dst_pitch = row
    copy.height = copy.dst_height = max(height, 1)
    copy.depth = max(depth, 1)
    copy()
    np.testing.assert_array_equal(again, host)


def test_large_round_trip_streams(ctx: cuda.Context) -> None:
    """More than one batch / streamed transfer on the host side (9 MiB)."""
    ary = make_array(768, 768, 4, F.FLOAT)  # 768 * 768 * 4 * 4 bytes = 9 MiB
    host = rng.standard_normal((4, 768, 768)).astype(np.float32)
    cuda.memcpy_htoa(ary, 0, host)
    back = np.empty_like(host)
    cuda.memcpy_atoh(back, ary, 0)
    np.testing.assert_array_equal(back, host)


def test_region_backed_host_arrays(ctx: cuda.Context) -> None:
    host = cuda.pagelocked_empty((6, 40), np.uint16)
    host[:] = rng.integers(0, 1 << 16, host.shape, dtype=np.uint16)
    ary = cuda.matrix_to_array(host, "C")
    back = cuda.pagelocked_zeros((6, 40), np.uint16)
    cuda.memcpy_atoh(back, ary, 0)
    np.testing.assert_array_equal(back, host)


def test_async_copies_on_a_stream(ctx: cuda.Context) -> None:
    stream = cuda.Stream()
    ary = make_array(100, 3, 0, F.UNSIGNED_INT32)
    host = rng.integers(0, 1 << 32, (3, 100), dtype=np.uint32)
    cuda.memcpy_htoa_async(ary, 0, host, stream)
    back = np.zeros_like(host)
    cuda.memcpy_atoh_async(back, ary, 0, stream)
    stream.synchronize()
    np.testing.assert_array_equal(back, host)
    # Memcpy2D(stream) with an array side; the host part of a row in the middle.
    part = np.zeros((2, 10), np.uint32)
    copy = cuda.Memcpy2D()
    copy.set_src_array(ary)
    copy.set_dst_host(part)
    copy.src_x_in_bytes, copy.src_y = 40, 1
    copy.width_in_bytes, copy.height, copy.dst_pitch = 40, 2, 40
    copy(stream)
    stream.synchronize()
    np.testing.assert_array_equal(part, host[1:3, 10:20])
    # The default stream (None) too.
    cuda.memcpy_htoa_async(ary, 0, np.zeros(300, np.uint32))
    cuda.memcpy_atoh_async(back, ary, 0)
    cuda.Context.synchronize()
    assert not back.any()


# -- layouts against numpy ---------------------------------------------------------------------

def test_matrix_to_array_orders(ctx: cuda.Context) -> None:
    m = rng.standard_normal((5, 7)).astype(np.float32)  # C: 5 rows of 7
    c = cuda.matrix_to_array(m, "C")
    d = c.get_descriptor()
    assert (d.width, d.height, d.format, d.num_channels) == (7, 5, F.FLOAT, 1)
    np.testing.assert_array_equal(read_via_device(c).view(np.float32), m.ravel(order="C"))
    f = cuda.matrix_to_array(m, "F")  # F: the matrix is (width, height): element (x, y) = m[x, y]
    d = f.get_descriptor()
    assert (d.width, d.height) == (5, 7)
    rows = read_via_device(f).view(np.float32).reshape(7, 5)  # rows (y) of width (x)
    np.testing.assert_array_equal(rows, m.T)
    # A C-ordered matrix given as "F" (and the other way round) is laid out first.
    np.testing.assert_array_equal(
        read_via_device(cuda.matrix_to_array(np.asfortranarray(m), "c")).view(np.float32),
        m.ravel())
    # The double hack: float64 as int2.
    dbl = rng.standard_normal((3, 4))
    with pytest.raises(TypeError, match="cannot convert dtype"):
        cuda.matrix_to_array(dbl, "C")
    h = cuda.matrix_to_array(dbl, "C", allow_double_hack=True)
    d = h.get_descriptor()
    assert (d.width, d.height, d.format, d.num_channels) == (4, 3, F.SIGNED_INT32, 2)
    np.testing.assert_array_equal(read_via_device(h).view(np.float64).reshape(3, 4), dbl)
    with pytest.raises(cuda.LogicError, match="order must be either F or C"):
        cuda.matrix_to_array(m, "K")


@pytest.mark.parametrize("order", ["C", "F"])
def test_np_to_array_2d_and_3d(ctx: cuda.Context, order: str) -> None:
    two = rng.integers(-100, 100, (6, 9), dtype=np.int16)
    a2 = cuda.np_to_array(two, order)
    d = a2.get_descriptor_3d()
    w, h = (9, 6) if order == "C" else (6, 9)
    assert (d.width, d.height, d.depth, d.format, d.flags) == (w, h, 0, F.SIGNED_INT16, 0)
    rows = read_via_device(a2).view(np.int16).reshape(h, w)
    np.testing.assert_array_equal(rows, two if order == "C" else two.T)

    three = rng.standard_normal((3, 4, 5)).astype(np.float32)
    a3 = cuda.np_to_array(three, order)
    d = a3.get_descriptor_3d()
    w, h, z = (5, 4, 3) if order == "C" else (3, 4, 5)
    assert (d.width, d.height, d.depth) == (w, h, z)
    boxes = read_via_device(a3).view(np.float32).reshape(z, h, w)  # [z, y, x]
    np.testing.assert_array_equal(boxes, three if order == "C" else three.transpose(2, 1, 0))


def test_np_to_array_flags_and_element_types(ctx: cuda.Context) -> None:
    img = rng.integers(0, 255, (8, 8), dtype=np.uint8)
    surf = cuda.np_to_array(img, "C", allowSurfaceBind=True)
    d = surf.get_descriptor_3d()
    assert (d.width, d.height, d.depth, d.flags) == (8, 8, 1, cuda.array3d_flags.SURFACE_LDST)
    np.testing.assert_array_equal(read_via_device(surf), img.ravel())
    stack = rng.standard_normal((4, 6, 10)).astype(np.float32)  # 4 layers of 6 x 10
    layered = cuda.np_to_array(stack, "C", layered=True)
    d = layered.get_descriptor_3d()
    assert (d.width, d.height, d.depth, d.flags) == (10, 6, 4, 1)
    np.testing.assert_array_equal(read_via_device(layered).view(np.float32), stack.ravel())
    both = cuda.np_to_array(stack, "C", allowSurfaceBind=True, layered=True)
    assert both.get_descriptor_3d().flags == 3
    # A 2D array with layered only is a plain 2D array, as in PyCUDA.
    assert cuda.np_to_array(img, "C", layered=True).get_descriptor_3d().flags == 0
    # float64 and complex64 as int2, complex128 as int4.
    for dtype, channels in ((np.float64, 2), (np.complex64, 2), (np.complex128, 4)):
        host = (rng.standard_normal((3, 5)) + 1j * rng.standard_normal((3, 5))).astype(dtype) \
            if np.dtype(dtype).kind == "c" else rng.standard_normal((3, 5)).astype(dtype)
        ary = cuda.np_to_array(host, "C")
        d = ary.get_descriptor_3d()
        assert (d.format, d.num_channels) == (F.SIGNED_INT32, channels)
        np.testing.assert_array_equal(read_via_device(ary).view(dtype).reshape(3, 5), host)
    with pytest.raises(TypeError, match="cannot convert dtype"):
        cuda.np_to_array(np.zeros((2, 2), np.bool_), "C")
    with pytest.raises(cuda.LogicError, match="dimensions"):
        cuda.np_to_array(np.zeros(5, np.float32), "C")
    with pytest.raises(cuda.LogicError, match="order must be either F or C"):
        cuda.np_to_array(img, "X")


@pytest.mark.parametrize("order", ["C", "F"])
def test_gpuarray_to_array(ctx: cuda.Context, order: str) -> None:
    host = rng.standard_normal((5, 6, 7)).astype(np.float32)
    g = gpuarray.to_gpu(np.asarray(host, order=order))  # type: ignore[call-overload]
    ary = cuda.gpuarray_to_array(g, order)
    w, h, z = (7, 6, 5) if order == "C" else (5, 6, 7)
    d = ary.get_descriptor_3d()
    assert (d.width, d.height, d.depth) == (w, h, z)
    boxes = read_via_device(ary).view(np.float32).reshape(z, h, w)
    np.testing.assert_array_equal(boxes, host if order == "C" else host.transpose(2, 1, 0))
    two = gpuarray.to_gpu(np.asarray(host[0], order=order))  # type: ignore[call-overload]
    a2 = cuda.gpuarray_to_array(two, order, allowSurfaceBind=True)
    d = a2.get_descriptor_3d()
    assert d.flags == cuda.array3d_flags.SURFACE_LDST and d.depth == 1
    rows = read_via_device(a2).view(np.float32).reshape(d.height, d.width)
    np.testing.assert_array_equal(rows, host[0] if order == "C" else host[0].T)


def test_gpuarray_to_array_of_a_pitched_view(ctx: cuda.Context, kinds: List[str]) -> None:
    wide = rng.integers(0, 1000, (8, 50), dtype=np.int32)
    g = gpuarray.to_gpu(wide)
    view = g[2:7, 3:20]  # rows 200 bytes apart: one pitched copy, no kernel
    kinds.clear()
    ary = cuda.gpuarray_to_array(view, "C")
    assert kinds == ["copy_3d"]
    rows = read_via_device(ary).view(np.int32).reshape(5, 17)
    np.testing.assert_array_equal(rows, wide[2:7, 3:20])


@pytest.mark.gpu
def test_gpuarray_to_array_of_a_strided_view(ctx: cuda.Context) -> None:
    """A layout that is no pitched copy (every other column) is made contiguous first (a
    kernel: real GPUs only)."""
    wide = rng.standard_normal((6, 20)).astype(np.float32)
    view = gpuarray.to_gpu(wide)[:, ::2]
    ary = cuda.gpuarray_to_array(view, "C")
    rows = read_via_device(ary).view(np.float32).reshape(6, 10)
    np.testing.assert_array_equal(rows, wide[:, ::2])


@pytest.mark.parametrize("order", ["C", "F"])
def test_make_multichannel_2d_array(ctx: cuda.Context, order: str) -> None:
    h, w, c = 4, 6, 4
    img = rng.integers(0, 255, (h, w, c), dtype=np.uint8)  # [y, x, channel]
    given = img if order == "C" else np.asfortranarray(img.transpose(2, 1, 0))  # [c, x, y]
    ary = cuda.make_multichannel_2d_array(given, order)
    d = ary.get_descriptor()
    assert (d.width, d.height, d.format, d.num_channels) == (w, h, F.UNSIGNED_INT8, c)
    np.testing.assert_array_equal(read_via_device(ary).reshape(h, w, c), img)
    with pytest.raises(cuda.LogicError, match="num_channels must be 1, 2 or 4"):
        cuda.make_multichannel_2d_array(np.zeros((4, 4, 3), np.float32), "C")


# -- unstructured copies with offsets ---------------------------------------------------------

def test_memcpy_dtoa_atod_atoa_with_offsets_1d(ctx: cuda.Context, kinds: List[str]) -> None:
    a, a_data = filled(64, fmt=F.FLOAT)  # 256 bytes
    src = random_bytes(100)
    dev = cuda.to_device(src)
    kinds.clear()
    cuda.memcpy_dtoa(a, 40, int(dev) + 4, 64)  # 16 floats from byte 4 of dev to byte 40
    assert kinds == ["copy_3d"]
    a_data[40:104] = src[4:68]
    np.testing.assert_array_equal(read_via_device(a), a_data)
    out = cuda.to_device(np.zeros(80, np.uint8))
    cuda.memcpy_atod(int(out) + 8, a, 100, 32)
    expect = np.zeros(80, np.uint8)
    expect[8:40] = a_data[100:132]
    back = np.empty(80, np.uint8)
    cuda.memcpy_dtoh(back, out)
    np.testing.assert_array_equal(back, expect)
    b, b_data = filled(16, fmt=F.FLOAT)  # 64 bytes
    kinds.clear()
    cuda.memcpy_atoa(b, 8, a, 200, 48)
    assert kinds == ["copy_3d"]
    b_data[8:56] = a_data[200:248]
    np.testing.assert_array_equal(read_via_device(b), b_data)
    host = np.empty(24, np.uint8)
    cuda.memcpy_atoh(host, a, 12)
    np.testing.assert_array_equal(host, a_data[12:36])
    cuda.memcpy_htoa(a, 252, np.array([1.5], np.float32))
    a_data[252:256] = np.array([1.5], np.float32).view(np.uint8)
    np.testing.assert_array_equal(read_via_device(a), a_data)
    # Nothing to copy: nothing queued.
    kinds.clear()
    cuda.memcpy_dtoa(a, 0, dev, 0)
    cuda.memcpy_htoa(a, 256, b"")
    assert kinds == []


def test_ranges_crossing_rows_and_slices(ctx: cuda.Context, kinds: List[str]) -> None:
    """``index`` counts bytes of the elements in row-major order: a range may cross rows and
    slices (up to five box copies)."""
    a, a_data = filled(6, 4, 3, F.UNSIGNED_INT16, 2)  # rows of 24 bytes, slices of 96
    chunk = random_bytes(4 + 24 * 2 + 96 + 24 + 8)  # partial row, rows, slice, row, partial row
    start = 96 - 24 * 2 - 4  # 4 bytes before the end of row 1 of slice 0
    kinds.clear()
    cuda.memcpy_htoa(a, start, chunk)
    assert kinds.count("copy_3d") == 5
    a_data[start:start + chunk.size] = chunk
    np.testing.assert_array_equal(read_via_device(a), a_data)
    back = np.empty(152, np.uint8)
    cuda.memcpy_atoh(back, a, 36)
    np.testing.assert_array_equal(back, a_data[36:188])
    # Device to array across rows, array to array with differing row lengths.
    dev = cuda.to_device(random_bytes(120))
    cuda.memcpy_dtoa(a, 16, dev, 120)
    a_data[16:136] = read_via_device(a)[16:136]
    expect = np.empty(120, np.uint8)
    cuda.memcpy_dtoh(expect, dev)
    np.testing.assert_array_equal(a_data[16:136], expect)
    b, b_data = filled(10, 5, 0, F.UNSIGNED_INT8, 4)  # rows of 40 bytes
    cuda.memcpy_atoa(b, 8, a, 20, 100)
    b_data[8:108] = a_data[20:120]
    np.testing.assert_array_equal(read_via_device(b), b_data)
    out = cuda.to_device(np.zeros(200, np.uint8))
    cuda.memcpy_atod(out, b, 4, 196)
    got = np.empty(200, np.uint8)
    cuda.memcpy_dtoh(got, out)
    np.testing.assert_array_equal(got[:196], b_data[4:200])


# -- Memcpy2D / Memcpy3D with array sides ------------------------------------------------------

def test_memcpy2d_host_to_array_box_with_offsets(ctx: cuda.Context, kinds: List[str]) -> None:
    a, a_data = filled(20, 10, 0, F.FLOAT)  # rows of 80 bytes
    host = rng.standard_normal((7, 12)).astype(np.float32)  # pitch 48 bytes
    copy = cuda.Memcpy2D()
    copy.set_src_host(host)
    copy.set_dst_array(a)
    assert copy.dst_memory_type == cuda.memory_type.ARRAY
    assert copy.src_memory_type == cuda.memory_type.HOST
    copy.src_x_in_bytes, copy.src_y, copy.src_pitch = 8, 1, 48  # host[1:, 2:]
    copy.dst_x_in_bytes, copy.dst_y = 36, 4  # array rows 4.., elements 9..
    copy.width_in_bytes, copy.height = 40, 5  # 10 floats x 5 rows
    kinds.clear()
    copy()
    assert kinds.count("copy_3d") == 1
    rows = a_data.view(np.float32).reshape(10, 20)
    rows[4:9, 9:19] = host[1:6, 2:12]
    np.testing.assert_array_equal(read_via_device(a), a_data)

    # Array -> pitched host box: only the box is written.
    out = np.full((9, 30), -1.0, np.float32)
    down = cuda.Memcpy2D()
    down.set_src_array(a)
    down.set_dst_host(out)
    down.src_x_in_bytes, down.src_y = 4, 2
    down.dst_x_in_bytes, down.dst_y, down.dst_pitch = 12, 3, 120
    down.width_in_bytes, down.height = 60, 6
    down()
    expect = np.full((9, 30), -1.0, np.float32)
    expect[3:9, 3:18] = rows[2:8, 1:16]
    np.testing.assert_array_equal(out, expect)


def test_memcpy2d_device_and_array_sides_are_one_command(ctx: cuda.Context,
                                                         kinds: List[str]) -> None:
    a, a_data = filled(32, 8, 0, F.UNSIGNED_INT8, 2)  # rows of 64 bytes
    dev, pitch = cuda.mem_alloc_pitch(48, 6, 4)
    dev_data = random_bytes(pitch * 6)
    cuda.memcpy_htod(dev, dev_data)
    copy = cuda.Memcpy2D()
    copy.set_src_device(dev)
    copy.set_dst_array(a)
    copy.src_x_in_bytes, copy.src_y, copy.src_pitch = 4, 1, pitch
    copy.dst_x_in_bytes, copy.dst_y = 10, 2
    copy.width_in_bytes, copy.height = 40, 5
    kinds.clear()
    copy()
    assert kinds == ["copy_3d"]
    rows = a_data.reshape(8, 64)
    rows[2:7, 10:50] = dev_data.reshape(6, pitch)[1:6, 4:44]
    np.testing.assert_array_equal(read_via_device(a), a_data)
    # Array -> pitched device memory.
    back = cuda.mem_alloc(pitch * 6)
    cuda.memset_d8(back, 7, pitch * 6)
    up = cuda.Memcpy2D()
    up.set_src_array(a)
    up.set_dst_device(back)
    up.src_y, up.dst_x_in_bytes, up.dst_y, up.dst_pitch = 3, 2, 1, pitch
    up.width_in_bytes, up.height = 64, 4
    kinds.clear()
    up()
    assert kinds == ["copy_3d"]
    got = np.empty(pitch * 6, np.uint8)
    cuda.memcpy_dtoh(got, back)
    expect = np.full((6, pitch), 7, np.uint8)
    expect[1:5, 2:66] = rows[3:7]
    np.testing.assert_array_equal(got.reshape(6, pitch), expect)
    # Array -> array.
    b, b_data = filled(40, 10, 0, F.UNSIGNED_INT8, 2)
    aa = cuda.Memcpy2D()
    aa.set_src_array(a)
    aa.set_dst_array(b)
    aa.src_x_in_bytes, aa.src_y, aa.dst_x_in_bytes, aa.dst_y = 2, 1, 30, 5
    aa.width_in_bytes, aa.height = 24, 4
    kinds.clear()
    aa()
    assert kinds == ["copy_3d"]
    b_data.reshape(10, 80)[5:9, 30:54] = rows[1:5, 2:26]
    np.testing.assert_array_equal(read_via_device(b), b_data)


def test_memcpy3d_with_array_sides(ctx: cuda.Context, kinds: List[str]) -> None:
    w, h, d = 8, 6, 5
    a, a_data = filled(w, h, d, F.SIGNED_INT32)  # rows of 32 bytes
    boxes = a_data.view(np.int32).reshape(d, h, w)
    # Host (pitched, padded slices) -> array box at (x 2, y 1, z 1).
    host = rng.integers(-9, 9, (4, 7, 10), dtype=np.int32)  # slices of 7 rows of 40 bytes
    copy = cuda.Memcpy3D()
    copy.set_src_host(host)
    copy.set_dst_array(a)
    copy.src_x_in_bytes, copy.src_y, copy.src_z = 4, 2, 1
    copy.src_pitch, copy.src_height = 40, 7
    copy.dst_x_in_bytes, copy.dst_y, copy.dst_z = 8, 1, 1
    copy.width_in_bytes, copy.height, copy.depth = 20, 4, 3
    kinds.clear()
    copy()
    assert kinds.count("copy_3d") == 1
    boxes[1:4, 1:5, 2:7] = host[1:4, 2:6, 1:6]
    np.testing.assert_array_equal(read_via_device(a), a_data)
    # Array box -> pitched device memory with its own slice height.
    dev = cuda.to_device(np.zeros((3, 9, 16), np.int32))
    down = cuda.Memcpy3D()
    down.set_src_array(a)
    down.set_dst_device(dev)
    down.src_z, down.src_y = 2, 2
    down.dst_pitch, down.dst_height, down.dst_z, down.dst_y, down.dst_x_in_bytes = 64, 9, 1, 3, 4
    down.width_in_bytes, down.height, down.depth = 32, 4, 2
    kinds.clear()
    down()
    assert kinds == ["copy_3d"]
    got = np.empty((3, 9, 16), np.int32)
    cuda.memcpy_dtoh(got, dev)
    expect = np.zeros((3, 9, 16), np.int32)
    expect[1:3, 3:7, 1:9] = boxes[2:4, 2:6, :]
    np.testing.assert_array_equal(got, expect)
    # lod must stay 0 (no mipmapped arrays).
    down.src_lod = 1
    with pytest.raises(cuda.LogicError, match="src_lod"):
        down()


def test_layered_array_copies_per_layer(ctx: cuda.Context) -> None:
    layers = rng.standard_normal((3, 4, 5)).astype(np.float32)
    ary = make_array(5, 4, 3, F.FLOAT, 1, cuda.array3d_flags.ARRAY3D_LAYERED)
    cuda.memcpy_htoa(ary, 0, layers)
    one = np.empty((4, 5), np.float32)
    copy = cuda.Memcpy3D()
    copy.set_src_array(ary)
    copy.set_dst_host(one)
    copy.src_z = 2
    copy.width_in_bytes = copy.dst_pitch = 20
    copy.height = copy.dst_height = 4
    copy.depth = 1
    copy()
    np.testing.assert_array_equal(one, layers[2])
    with pytest.raises(cuda.LogicError, match="layers"):
        copy.src_z = 3
        copy()


# -- hostile inputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("fields, match", [
    (dict(format=0), "format is not set"),
    (dict(format=5), "format 5 is not an array_format"),
    (dict(format=64), "format 64 is not an array_format"),
    (dict(num_channels=3), "num_channels must be 1, 2 or 4, got 3"),
    (dict(num_channels=0), "num_channels must be 1, 2 or 4"),
    (dict(num_channels=8), "num_channels must be 1, 2 or 4"),
    (dict(width=0), "width must be at least 1"),
    (dict(width=(1 << 20) + 1), "width 1048577 is larger than 1048576"),
    (dict(height=(1 << 20) + 1), "height 1048577 is larger than 1048576"),
    (dict(depth=(1 << 20) + 1), "depth 1048577 is larger than 1048576"),
    (dict(flags=16), "flags 0x10"),
])
def test_bad_descriptors_are_refused(ctx: cuda.Context, fields: dict, match: str) -> None:
    base = dict(width=16, height=4, depth=2, format=F.FLOAT, num_channels=1, flags=0)
    base.update(fields)
    with pytest.raises(cuda.LogicError, match=match) as info:
        cuda.Array(cuda.ArrayDescriptor3D(**base))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # The daemon refuses the same descriptor on the wire (INVALID_ARGUMENT: a LogicError).
    with pytest.raises(cuda.LogicError) as wire:
        ctx._core.allocate_array(mem.ArrayDescriptor(**base))
    assert wire.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # The session lives on.
    ary, data = filled(8, 2)
    np.testing.assert_array_equal(read_via_device(ary), data)


def test_other_descriptor_misuse(ctx: cuda.Context) -> None:
    with pytest.raises(TypeError, match="ArrayDescriptor"):
        cuda.Array(object())  # type: ignore[arg-type]
    # Wire-only combinations: size_bytes together with an array, a 3D shape without a height.
    with pytest.raises(cuda.LogicError):
        ctx._core.call("MemoryService.Allocate", mem.AllocateRequest(
            size_bytes=64, array=mem.ArrayDescriptor(width=4, format=32, num_channels=1)))
    with pytest.raises(cuda.LogicError, match="height"):
        cuda.Array(cuda.ArrayDescriptor3D(width=4, height=0, depth=3, format=F.FLOAT,
                                          num_channels=1))


def test_wrong_dtypes_and_offsets(ctx: cuda.Context) -> None:
    a, a_data = filled(16, 0, 0, F.FLOAT)
    with pytest.raises(cuda.LogicError, match="index 2 is not a multiple of the element size"):
        cuda.memcpy_htoa(a, 2, np.zeros(4, np.float32))
    with pytest.raises(cuda.LogicError, match="length 6 bytes is not a multiple"):
        cuda.memcpy_htoa(a, 0, np.zeros(6, np.uint8))
    with pytest.raises(TypeError, match="must be a gpurpc.driver.Array"):
        cuda.memcpy_htoa(np.zeros(4), 0, np.zeros(4))  # type: ignore[arg-type]
    dev = cuda.mem_alloc(64)
    with pytest.raises(TypeError, match="device memory; use memcpy_dtoa"):
        cuda.memcpy_htoa(a, 0, dev)
    with pytest.raises(TypeError, match="host memory"):
        cuda.memcpy_dtoa(a, 0, np.zeros(4, np.float32), 16)
    with pytest.raises(ValueError, match="index must not be negative"):
        cuda.memcpy_atoh(np.zeros(4, np.float32), a, -4)
    copy = cuda.Memcpy2D()
    with pytest.raises(TypeError, match="takes a gpurpc.driver.Array"):
        copy.set_src_array(np.zeros(4))
    with pytest.raises(TypeError, match="for linear device memory use Memcpy2D.set_dst_device"):
        copy.set_dst_array(dev)
    with pytest.raises(TypeError, match="use Memcpy2D.set_src_array"):
        copy.set_src_host(a)
    with pytest.raises(TypeError, match="use Memcpy2D.set_dst_array"):
        copy.set_dst_device(a)
    copy.set_src_array(a)
    copy.set_dst_host(np.zeros(16, np.float32))
    copy.width_in_bytes, copy.height, copy.src_x_in_bytes = 8, 1, 6
    with pytest.raises(cuda.LogicError, match="x offset 6 bytes is not a multiple"):
        copy()
    copy.src_x_in_bytes, copy.width_in_bytes = 0, 10
    with pytest.raises(cuda.LogicError, match="width 10 bytes is not a multiple"):
        copy()
    np.testing.assert_array_equal(read_via_device(a), a_data)


def test_out_of_bounds_copies_write_nothing(ctx: cuda.Context, kinds: List[str]) -> None:
    a, a_data = filled(10, 4, 0, F.FLOAT)  # 160 bytes, rows of 40
    b, b_data = filled(4, 0, 0, F.FLOAT)
    dev = cuda.to_device(random_bytes(64))
    small = cuda.to_device(np.full(32, 0xCD, np.uint8))
    kinds.clear()
    with pytest.raises(cuda.LogicError, match="run past its end: it holds 160 bytes"):
        cuda.memcpy_htoa(a, 120, np.ones(12, np.float32))
    with pytest.raises(cuda.LogicError, match="run past its end"):
        cuda.memcpy_dtoa(a, 128, dev, 64)
    with pytest.raises(cuda.LogicError, match="runs past the end of its allocation"):
        cuda.memcpy_dtoa(a, 0, int(dev) + 16, 64)  # the device source is too short
    dest = np.full(48, 0xAB, np.uint8)
    with pytest.raises(cuda.LogicError, match="run past its end"):
        cuda.memcpy_atoh(dest, a, 120)
    assert (dest == 0xAB).all()
    with pytest.raises(cuda.LogicError, match="runs past the end of its allocation"):
        cuda.memcpy_atod(small, a, 0, 64)
    with pytest.raises(cuda.LogicError, match="destination .*run past its end"):
        cuda.memcpy_atoa(b, 8, a, 0, 12)
    with pytest.raises(cuda.LogicError, match="source .*run past its end"):
        cuda.memcpy_atoa(b, 0, a, 152, 16)
    # Boxes of Memcpy2D / Memcpy3D.
    copy = cuda.Memcpy2D()
    copy.set_src_host(np.ones((4, 10), np.float32))
    copy.set_dst_array(a)
    copy.src_pitch, copy.width_in_bytes, copy.height = 40, 40, 4
    copy.dst_x_in_bytes = 4
    with pytest.raises(cuda.LogicError, match="runs past the end of its rows of 40 bytes"):
        copy()
    copy.dst_x_in_bytes, copy.dst_y = 0, 1
    with pytest.raises(cuda.LogicError, match=r"y 1 \+ height 4 rows runs past its 4 rows"):
        copy()
    copy.dst_y, copy.src_y = 0, 1  # the host source now runs past its buffer
    with pytest.raises(cuda.LogicError, match="past the end of its host buffer"):
        copy()
    cube = cuda.Memcpy3D()
    cube.set_src_array(a)
    cube.set_dst_device(small)
    cube.width_in_bytes, cube.height, cube.depth = 8, 1, 2
    cube.dst_pitch, cube.dst_height = 8, 1
    with pytest.raises(cuda.LogicError, match="z 0 \\+ depth 2 runs past its 1 slices"):
        cube()
    assert kinds == []  # nothing was sent
    np.testing.assert_array_equal(read_via_device(a), a_data)
    np.testing.assert_array_equal(read_via_device(b), b_data)
    got = np.empty(32, np.uint8)
    cuda.memcpy_dtoh(got, small)
    assert (got == 0xCD).all()


def test_the_daemon_checks_copy_3d_itself(ctx: cuda.Context) -> None:
    """Commands that skip the client's checks: refused (LogicError), nothing written, and the
    session lives on."""
    core = ctx._core
    a, a_data = filled(8, 3, 0, F.FLOAT)  # rows of 32 bytes
    buf = cuda.to_device(random_bytes(256))
    array_end = _core.copy_3d_array_end
    linear_end = _core.copy_3d_linear_end
    cases = [
        # past the end of the rows / rows / slices
        (array_end(a.handle, 16), linear_end(int(buf)), 32, 1, 1),
        (array_end(a.handle, 0, 2), linear_end(int(buf)), 32, 2, 1),
        (array_end(a.handle, 0, 0, 1), linear_end(int(buf)), 32, 1, 1),
        # x not a multiple of the element size
        (array_end(a.handle, 2), linear_end(int(buf)), 4, 1, 1),
        # the linear source leaves its buffer
        (array_end(a.handle), linear_end(int(buf) + 240), 32, 1, 1),
        (array_end(a.handle), linear_end(int(buf), 240, 0), 32, 2, 1),
        # an array end with a pitch; a linear end with a y offset
        (ex.Copy3DEndpoint(array_id=a.handle, pitch_bytes=32), linear_end(int(buf)), 32, 1, 1),
        (array_end(a.handle), ex.Copy3DEndpoint(device=_core.device_pointer(int(buf)), y=1),
         32, 1, 1),
        # neither end set; a pitch smaller than the width
        (array_end(a.handle), ex.Copy3DEndpoint(), 32, 1, 1),
        (array_end(a.handle), linear_end(int(buf), 16, 0), 32, 2, 1),
        # a linear buffer's id as an array id; an id nobody has
        (array_end(buf.buffer_id), linear_end(int(buf)), 32, 1, 1),
        (array_end(a.handle + 100000), linear_end(int(buf)), 32, 1, 1),
    ]
    for dst, src, w, h, d in cases:
        with pytest.raises(cuda.LogicError) as info:
            queue_raw(core, dst, src, w, h, d)
        assert info.value.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                   grpc.StatusCode.NOT_FOUND), (dst, src, info.value)
    np.testing.assert_array_equal(read_via_device(a), a_data)


def test_use_after_free(ctx: cuda.Context) -> None:
    core = ctx._core
    a, _ = filled(16, 2, 0, F.FLOAT)
    handle = a.handle
    dev = cuda.to_device(random_bytes(128))
    a.free()
    for call in (lambda: cuda.memcpy_htoa(a, 0, np.zeros(4, np.float32)),
                 lambda: cuda.memcpy_atoh(np.zeros(4, np.float32), a, 0),
                 lambda: cuda.memcpy_dtoa(a, 0, dev, 16),
                 lambda: cuda.memcpy_atod(dev, a, 0, 16),
                 lambda: cuda.memcpy_atoa(a, 0, a, 0, 4),
                 a.get_descriptor, a.get_descriptor_3d,
                 lambda: cuda.Memcpy2D().set_dst_array(a)):
        with pytest.raises(cuda.LogicError, match=f"array {handle}\\) was freed"):
            call()
    # A copy set up before the free fails at copy time.
    b, _ = filled(4, 0, 0, F.FLOAT)
    copy = cuda.Memcpy2D()
    copy.set_src_array(b)
    copy.set_dst_host(np.zeros(4, np.float32))
    copy.width_in_bytes, copy.height = 16, 1
    b.free()
    with pytest.raises(cuda.LogicError, match="was freed"):
        copy()
    # The daemon: the freed id is unknown.
    with pytest.raises(cuda.LogicError) as info:
        queue_raw(core, _core.copy_3d_linear_end(int(dev)), _core.copy_3d_array_end(handle), 16)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(cuda.LogicError) as info:
        core.call("MemoryService.Free", mem.FreeRequest(buffer_id=handle))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "freed" in repr(a)


def test_arrays_of_another_session(ctx: cuda.Context, other: cuda.Context) -> None:
    other.push()
    try:
        foreign, foreign_data = filled(16, 2, 0, F.UNSIGNED_INT8)
    finally:
        cuda.Context.pop()
    assert foreign._core is other._core
    mine, mine_data = filled(16, 2, 0, F.UNSIGNED_INT8)
    dev = cuda.to_device(random_bytes(64))
    with pytest.raises(cuda.LogicError, match="session"):
        cuda.memcpy_dtoa(foreign, 0, dev, 16)  # dev is memory of ctx
    with pytest.raises(cuda.LogicError, match="belongs to gpurpc session"):
        cuda.memcpy_atoa(mine, 0, foreign, 0, 16)
    copy = cuda.Memcpy2D()
    copy.set_src_array(foreign)
    copy.set_dst_device(dev)
    copy.width_in_bytes, copy.height = 16, 1
    with pytest.raises(cuda.LogicError, match="session"):
        copy()
    stream = cuda.Stream()  # of ctx
    with pytest.raises(cuda.LogicError, match="stream belongs to gpurpc session"):
        cuda.memcpy_htoa_async(foreign, 0, np.zeros(4, np.uint8), stream)
    # On the wire, ctx's session does not know the other's id.
    core = ctx._core
    with pytest.raises(cuda.LogicError) as info:
        queue_raw(core, _core.copy_3d_array_end(foreign.handle), _core.copy_3d_linear_end(
            int(dev)), 16)
    assert info.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(cuda.LogicError) as info:
        core.call("MemoryService.Free", mem.FreeRequest(buffer_id=foreign.handle))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    # Both arrays are intact and usable in their own sessions.
    np.testing.assert_array_equal(read_via_device(mine), mine_data)
    back = np.empty(32, np.uint8)
    cuda.memcpy_atoh(back, foreign, 0)  # the array's own session, whatever is current
    np.testing.assert_array_equal(back, foreign_data)


# -- the device-memory quota -------------------------------------------------------------------

USER = pwd.getpwuid(os.getuid()).pw_name
QUOTA = 64 * MiB


@pytest.fixture(scope="module")
def quota_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = Path(os.environ.get("GPURPCD_BIN", REPO_ROOT / "build" / "server" / "gpurpcd"))
    if not binary.is_file():
        if os.environ.get("GPURPC_SKIP_DAEMON_TESTS") or os.environ.get("GPURPC_ADDRESS"):
            pytest.skip(f"gpurpcd binary {binary} not found: these tests start their own daemon")
        pytest.fail(f"gpurpcd binary {binary} not found: build it or set GPURPCD_BIN")
    tmp = tmp_path_factory.mktemp("array-quotas")
    config = tmp / "gpurpcd.conf"
    config.write_text(f"""
max_sessions: 8
tenant_quotas {{
  key: "{USER}"
  value {{ max_sessions: 2 max_device_memory_bytes: {QUOTA} }}
}}
""")
    socket = tmp / "gpurpcd.sock"
    log_path = tmp / "gpurpcd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPURPC_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(binary), "--backend=fake", f"--config={config}",
                                 "--drain-timeout=0s", f"--unix-socket={socket}", "--listen=",
                                 f"--cache-dir={tmp / 'cache'}", "--session-idle-timeout=10s"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        address = f"unix:{socket}"
        _wait_ready(address, proc, log_path, deadline_s=30)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture
def quota_ctx(quota_daemon: str) -> Iterator[cuda.Context]:
    """A session on the quota daemon, current; the test daemon's connection afterwards."""
    saved = _devices._default_client
    cuda.init(address=quota_daemon)
    context = cuda.Device(0).make_context()
    try:
        yield context
    finally:
        while cuda.Context.get_current() is context and _context._stack():
            cuda.Context.pop()
        context.detach()
        _devices._default_client = saved


def test_arrays_count_against_the_quota(quota_ctx: cuda.Context) -> None:
    assert gpurpc.admin.server_info().device_memory_bytes == 0
    # 2048 floats a row (8 KiB), 4096 rows: 32 MiB charged.
    big = make_array(2048, 4096, 0, F.FLOAT)
    charged = charge(2048, 4096, 0, 4)
    assert charged == 32 * MiB
    assert gpurpc.admin.server_info().device_memory_bytes == charged
    # 40 MiB more does not fit: refused naming the quota; nothing is lost.
    with pytest.raises(cuda.MemoryError) as info:
        make_array(2048, 5120, 0, F.FLOAT)
    assert "max_device_memory_bytes" in str(info.value)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gpurpc.admin.server_info().device_memory_bytes == charged
    # Linear memory and arrays share the quota.
    with pytest.raises(cuda.MemoryError, match="max_device_memory_bytes"):
        cuda.mem_alloc(QUOTA - charged + 1)
    # A 1D array is one row: 4096 bytes.
    line = make_array(1024, 0, 0, F.FLOAT)
    assert gpurpc.admin.server_info().device_memory_bytes == charged + 4096
    line.free()
    cuda.memcpy_htoa(big, 4096, np.arange(8, dtype=np.float32))
    back = np.empty(8, np.float32)
    cuda.memcpy_atoh(back, big, 4096)
    np.testing.assert_array_equal(back, np.arange(8, dtype=np.float32))
    # The temporary buffers of host copies are given back too.
    assert gpurpc.admin.server_info().device_memory_bytes == charged
    # Freeing gives the bytes back: now the 40 MiB array fits.
    big.free()
    assert gpurpc.admin.server_info().device_memory_bytes == 0
    bigger = make_array(2048, 5120, 0, F.FLOAT)
    assert gpurpc.admin.server_info().device_memory_bytes == charge(2048, 5120, 0, 4)
    bigger.free()
    assert gpurpc.admin.server_info().device_memory_bytes == 0


def test_host_copy_staging_over_the_quota_is_a_clear_memory_error(
        quota_ctx: cuda.Context) -> None:
    big = make_array(2048, 7680, 0, F.FLOAT)  # 60 MiB of the 64
    with pytest.raises(cuda.MemoryError, match="temporary|device buffer"):
        cuda.memcpy_htoa(big, 0, np.zeros(8 * MiB // 4, np.float32))  # 8 MiB staging
    # Device memory is still fine for what fits.
    cuda.memcpy_htoa(big, 0, np.ones(1024, np.float32))
    back = np.empty(1024, np.float32)
    cuda.memcpy_atoh(back, big, 0)
    assert (back == 1).all()
    big.free()
