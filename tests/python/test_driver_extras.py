"""Pitched allocations, Memcpy2D/Memcpy3D, memset_d2d*, mem_get_address_range and aligned host
arrays (gpurpc._driver_extras, re-exported by gpurpc.driver) against a real daemon.

The fake backend keeps device memory in host memory and really executes copies and memsets,
so every value here is checked on it, against numpy slicing.
"""
from __future__ import annotations

import mmap
from typing import Iterator, List

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import _core, _regions, debug
from gpurpc.v1 import execution_service_pb2 as ex

rng = np.random.default_rng(20240611)
MiB = 1 << 20


@pytest.fixture
def kinds(ctx: cuda.Context, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The kinds of the commands the context queues from now on ("copy", "upload",
    "download", "memset", "region_copy", "sync" ...)."""
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


def device_bytes(alloc: cuda.DeviceAllocation, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    cuda.memcpy_dtoh(out, alloc)
    return out


def random_bytes(n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def pitched_view(flat: np.ndarray, start: int, pitch: int, width: int,
                 height: int) -> np.ndarray:
    """Rows ``[start + j * pitch, + width)`` of a flat byte array, as a (height, width) copy."""
    return np.stack([flat[start + j * pitch:start + j * pitch + width] for j in range(height)])


# -- mem_alloc_pitch --------------------------------------------------------------------------

@pytest.mark.parametrize("width, expected", [(1, 512), (511, 512), (512, 512), (513, 1024),
                                             (4000, 4096)])
def test_mem_alloc_pitch_rounds_rows_up(ctx: cuda.Context, width: int, expected: int) -> None:
    alloc, pitch = cuda.mem_alloc_pitch(width, 7, 4)
    aligned = max(512, ctx._core.device_info.attributes.get(
        int(cuda.device_attribute.TEXTURE_PITCH_ALIGNMENT), 0))
    assert pitch == -(-width // aligned) * aligned
    if aligned == 512:
        assert pitch == expected
    assert isinstance(alloc, cuda.DeviceAllocation) and isinstance(pitch, int)
    base, size = cuda.mem_get_address_range(alloc)
    assert base == int(alloc) and size >= pitch * 7
    # The whole pitched area is usable.
    data = random_bytes(pitch * 7)
    cuda.memcpy_htod(alloc, data)
    assert np.array_equal(device_bytes(alloc, pitch * 7), data)


@pytest.mark.parametrize("access_size", [0, 1, 2, 3, 5, 32])
def test_mem_alloc_pitch_refuses_other_access_sizes(ctx: cuda.Context, access_size: int) -> None:
    with pytest.raises(cuda.LogicError, match="access_size must be 4, 8 or 16") as info:
        cuda.mem_alloc_pitch(64, 2, access_size)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_mem_alloc_pitch_hostile_arguments(ctx: cuda.Context) -> None:
    for size in (8, 16):
        assert cuda.mem_alloc_pitch(10, 1, size)[1] >= 10
    with pytest.raises(cuda.LogicError, match="positive"):
        cuda.mem_alloc_pitch(0, 4, 4)
    with pytest.raises(cuda.LogicError, match="positive"):
        cuda.mem_alloc_pitch(16, 0, 4)
    with pytest.raises(ValueError, match="width must not be negative"):
        cuda.mem_alloc_pitch(-1, 4, 4)
    with pytest.raises(ValueError, match="height must not be negative"):
        cuda.mem_alloc_pitch(16, -4, 4)
    with pytest.raises(TypeError, match="width must be an int"):
        cuda.mem_alloc_pitch(16.0, 4, 4)
    with pytest.raises(TypeError, match="access_size must be an int"):
        cuda.mem_alloc_pitch(16, 4, 4.0)
    with pytest.raises(TypeError, match="height must be an int"):
        cuda.mem_alloc_pitch(16, "4", 4)
    with pytest.raises(cuda.MemoryError):
        cuda.mem_alloc_pitch(1 << 20, 1 << 30, 4)  # 1 PiB
    max_pitch = ctx._core.device_info.attributes.get(int(cuda.device_attribute.MAX_PITCH), 0)
    if max_pitch:  # a real GPU reports it (the fake does not)
        with pytest.raises(cuda.LogicError, match="exceeds the device's MAX_PITCH"):
            cuda.mem_alloc_pitch(max_pitch + 1, 2, 4)
    # The session is fine afterwards.
    assert cuda.mem_alloc_pitch(16, 2, 4)[1] >= 16


# -- Memcpy2D: values -------------------------------------------------------------------------

def test_memcpy2d_host_to_pitched_device_and_back(ctx: cuda.Context) -> None:
    h, w = 37, 50
    host = rng.standard_normal((h, w)).astype(np.float32)
    alloc, pitch = cuda.mem_alloc_pitch(w * 4, h, 4)
    cuda.memset_d8(alloc, 0xAB, pitch * h)
    up = cuda.Memcpy2D()
    up.set_src_host(host)
    up.set_dst_device(alloc)
    up.src_pitch = w * 4
    up.dst_pitch = pitch
    up.width_in_bytes = w * 4
    up.height = h
    up(False)
    raw = device_bytes(alloc, pitch * h).reshape(h, pitch)
    assert np.array_equal(raw[:, :w * 4].copy().view(np.float32), host)
    assert (raw[:, w * 4:] == 0xAB).all()  # the padding is untouched

    back = np.zeros_like(host)
    down = cuda.Memcpy2D()
    down.set_src_device(alloc)
    down.set_dst_host(back)
    down.src_pitch = pitch
    down.dst_pitch = w * 4
    down.width_in_bytes = w * 4
    down.height = h
    down()
    assert np.array_equal(back, host)


@pytest.mark.parametrize("host_kind", ["plain", "pagelocked"])
@pytest.mark.parametrize("src_pitch", [24, 40, 200])  # dense span download, and row by row
def test_memcpy2d_sub_rectangles_match_numpy_slicing(ctx: cuda.Context, host_kind: str,
                                                     src_pitch: int) -> None:
    # Device (rows of src_pitch bytes) -> host sub-block, offsets on both sides.
    rows = 12
    dev_data = random_bytes(src_pitch * rows)
    dev = cuda.to_device(dev_data)
    host_shape = (15, 64)
    make = cuda.pagelocked_zeros if host_kind == "pagelocked" else np.zeros
    host = make(host_shape, np.uint8)
    host[:] = 7
    expected = host.copy()
    copy = cuda.Memcpy2D()
    copy.set_src_device(dev)
    copy.set_dst_host(host)
    copy.src_x_in_bytes, copy.src_y, copy.src_pitch = 3, 2, src_pitch
    copy.dst_x_in_bytes, copy.dst_y, copy.dst_pitch = 10, 4, host_shape[1]
    copy.width_in_bytes, copy.height = 17, 9
    copy()
    source = dev_data.reshape(rows, src_pitch)
    expected[4:13, 10:27] = source[2:11, 3:20]
    assert np.array_equal(host, expected)

    # And host sub-block -> device sub-rectangle.
    target = cuda.mem_alloc(src_pitch * rows)
    cuda.memset_d8(target, 0x5A, src_pitch * rows)
    host[:] = rng.integers(0, 256, host_shape, dtype=np.uint8)
    up = cuda.Memcpy2D()
    up.set_src_host(host)
    up.set_dst_device(target)
    up.src_x_in_bytes, up.src_y, up.src_pitch = 10, 4, host_shape[1]
    up.dst_x_in_bytes, up.dst_y, up.dst_pitch = 3, 2, src_pitch
    up.width_in_bytes, up.height = 17, 9
    up()
    want = np.full((rows, src_pitch), 0x5A, np.uint8)
    want[2:11, 3:20] = host[4:13, 10:27]
    assert np.array_equal(device_bytes(target, src_pitch * rows).reshape(rows, src_pitch), want)


def test_memcpy2d_device_to_device_between_pitches(ctx: cuda.Context) -> None:
    h, w = 20, 24
    src_pitch, dst_pitch = 64, 96
    src_data = random_bytes(src_pitch * h)
    src = cuda.to_device(src_data)
    dst = cuda.mem_alloc(dst_pitch * h)
    cuda.memset_d8(dst, 0, dst_pitch * h)
    copy = cuda.Memcpy2D()
    copy.set_src_device(src)
    copy.set_dst_device(int(dst))  # a plain int address of the current context
    copy.src_x_in_bytes, copy.src_y, copy.src_pitch = 8, 1, src_pitch
    copy.dst_x_in_bytes, copy.dst_y, copy.dst_pitch = 40, 3, dst_pitch
    copy.width_in_bytes, copy.height = w, h - 3
    copy()
    want = np.zeros((h, dst_pitch), np.uint8)
    want[3:h, 40:40 + w] = src_data.reshape(h, src_pitch)[1:h - 2, 8:8 + w]
    assert np.array_equal(device_bytes(dst, dst_pitch * h).reshape(h, dst_pitch), want)


def test_memcpy2d_rows_larger_than_an_upload_chunk(ctx: cuda.Context) -> None:
    ctx.host_regions = "off"  # the gRPC path, chunked
    w = _core.UPLOAD_CHUNK_BYTES + MiB // 2
    pitch, h = 2 * MiB, 3
    host = random_bytes(w * h).reshape(h, w)
    dev = cuda.mem_alloc(pitch * h)
    cuda.memset_d8(dev, 1, pitch * h)
    copy = cuda.Memcpy2D()
    copy.set_src_host(host)
    copy.set_dst_device(dev)
    copy.src_pitch, copy.dst_pitch, copy.width_in_bytes, copy.height = w, pitch, w, h
    copy()
    raw = device_bytes(dev, pitch * h).reshape(h, pitch)
    assert np.array_equal(raw[:, :w], host) and (raw[:, w:] == 1).all()
    back = np.zeros((h, w + 5), np.uint8)
    down = cuda.Memcpy2D()
    down.set_src_device(dev)
    down.set_dst_host(back)
    down.src_pitch, down.dst_pitch, down.width_in_bytes, down.height = pitch, w + 5, w, h
    down()
    assert np.array_equal(back[:, :w], host) and not back[:, w:].any()


def test_memcpy2d_host_to_host_and_unified_setters(ctx: cuda.Context) -> None:
    a = rng.integers(0, 1000, (6, 9), dtype=np.int32)
    b = np.zeros((8, 12), np.int32)
    copy = cuda.Memcpy2D()
    copy.set_src_unified(a)
    copy.set_dst_unified(b)
    assert copy.src_memory_type == cuda.memory_type.HOST == copy.dst_memory_type
    copy.src_x_in_bytes, copy.src_pitch = 4, a.strides[0]
    copy.dst_x_in_bytes, copy.dst_y, copy.dst_pitch = 8, 1, b.strides[0]
    copy.width_in_bytes, copy.height = 5 * 4, 6
    copy()
    want = np.zeros_like(b)
    want[1:7, 2:7] = a[:, 1:6]
    assert np.array_equal(b, want)

    dev = cuda.mem_alloc(a.nbytes)
    to_dev = cuda.Memcpy2D()
    to_dev.set_src_unified(a)
    to_dev.set_dst_unified(dev)
    assert to_dev.dst_memory_type == cuda.memory_type.DEVICE
    assert to_dev.dst_device == int(dev) and to_dev.src_device == 0
    to_dev.src_pitch = to_dev.dst_pitch = to_dev.width_in_bytes = a.strides[0]
    to_dev.height = a.shape[0]
    to_dev()
    assert np.array_equal(device_bytes(dev, a.nbytes).view(np.int32).reshape(a.shape), a)


def test_memcpy2d_async_on_streams(ctx: cuda.Context) -> None:
    s1, s2 = cuda.Stream(), cuda.Stream()
    h, w, pitch = 16, 40, 128
    host = random_bytes(h * w).reshape(h, w)
    dev = cuda.mem_alloc(pitch * h)
    cuda.memset_d8(dev, 0, pitch * h)
    up = cuda.Memcpy2D()
    up.set_src_host(host)
    up.set_dst_device(dev)
    up.src_pitch, up.dst_pitch, up.width_in_bytes, up.height = w, pitch, w, h
    up(s1)
    host_copy = host.copy()
    host[:] = 0  # the bytes were taken when the copy was queued (plain host memory)
    done = cuda.Event().record(s1)
    s2.wait_for_event(done)
    back = np.zeros((h, w), np.uint8)
    down = cuda.Memcpy2D()
    down.set_src_device(dev)
    down.set_dst_host(back)
    down.src_pitch, down.dst_pitch, down.width_in_bytes, down.height = pitch, w, w, h
    down(s2)
    s2.synchronize()
    assert np.array_equal(back, host_copy)


# -- Memcpy2D: command count ------------------------------------------------------------------

def test_equal_pitches_are_one_command(ctx: cuda.Context, kinds: List[str]) -> None:
    h, w = 64, 256
    src = cuda.to_device(random_bytes(h * w))
    dst = cuda.mem_alloc(h * w)
    copy = cuda.Memcpy2D()
    copy.set_src_device(src)
    copy.set_dst_device(dst)
    copy.src_pitch = copy.dst_pitch = copy.width_in_bytes = w
    copy.height = h
    kinds.clear()
    debug.reset_rpc_counts()
    copy()
    assert kinds == ["copy"]
    assert debug.rpc_counts().get(debug.BATCH) == 1 and debug.round_trips() == 1
    assert np.array_equal(device_bytes(dst, h * w), device_bytes(src, h * w))

    host = random_bytes(h * w)
    up = cuda.Memcpy2D()
    up.set_src_host(host)
    up.set_dst_device(dst)
    up.src_pitch = up.dst_pitch = up.width_in_bytes = w
    up.height = h
    kinds.clear()
    up()
    assert kinds == ["upload"]
    assert np.array_equal(device_bytes(dst, h * w), host)


def test_pitched_device_rows_are_one_3d_copy(ctx: cuda.Context, kinds: List[str]) -> None:
    h, w, pitch, dst_pitch = 50, 100, 512, 256
    src_data = random_bytes(pitch * h)
    src = cuda.to_device(src_data)
    dst = cuda.mem_alloc(dst_pitch * h)
    cuda.memset_d8(dst, 9, dst_pitch * h)
    copy = cuda.Memcpy2D()
    copy.set_src_device(src)
    copy.set_dst_device(dst)
    copy.src_pitch, copy.dst_pitch = pitch, dst_pitch
    copy.width_in_bytes, copy.height = w, h
    kinds.clear()
    debug.reset_rpc_counts()
    copy()
    assert kinds == ["copy_3d"]
    assert debug.rpc_counts().get(debug.BATCH) == 1 and debug.round_trips() == 1
    want = np.full((h, dst_pitch), 9, np.uint8)
    want[:, :w] = src_data.reshape(h, pitch)[:, :w]
    assert np.array_equal(device_bytes(dst, dst_pitch * h).reshape(h, dst_pitch), want)
    # Height 1: one row, one plain copy whatever the pitches.
    copy.height, copy.src_pitch, copy.dst_pitch = 1, 0, 0
    kinds.clear()
    copy()
    assert kinds == ["copy"]


def test_memcpy3d_between_device_volumes_is_one_3d_copy(ctx: cuda.Context,
                                                        kinds: List[str]) -> None:
    d, h, pitch = 4, 6, 48  # the source: 4 slices of 6 rows of 48 bytes
    src_data = random_bytes(d * h * pitch)
    src = cuda.to_device(src_data)
    dst_pitch, dst_rows, dst_d = 64, 9, 5
    dst = cuda.mem_alloc(dst_pitch * dst_rows * dst_d)
    cuda.memset_d8(dst, 0, dst_pitch * dst_rows * dst_d)
    copy = cuda.Memcpy3D()
    copy.set_src_device(src)
    copy.set_dst_device(dst)
    copy.src_x_in_bytes, copy.src_y, copy.src_z = 4, 1, 1
    copy.src_pitch, copy.src_height = pitch, h
    copy.dst_x_in_bytes, copy.dst_y, copy.dst_z = 16, 2, 1
    copy.dst_pitch, copy.dst_height = dst_pitch, dst_rows
    copy.width_in_bytes, copy.height, copy.depth = 40, 4, 3
    kinds.clear()
    copy()
    assert kinds == ["copy_3d"]
    raw = device_bytes(dst, dst_pitch * dst_rows * dst_d).reshape(dst_d, dst_rows, dst_pitch)
    want = np.zeros_like(raw)
    want[1:4, 2:6, 16:56] = src_data.reshape(d, h, pitch)[1:4, 1:5, 4:44]
    assert np.array_equal(raw, want)
    # Asynchronous on a stream: the same one command, ordered on that stream.
    stream = cuda.Stream()
    cuda.memset_d8(dst, 0, dst_pitch * dst_rows * dst_d)
    kinds.clear()
    copy(stream)
    stream.synchronize()
    assert kinds == ["copy_3d", "sync"]
    assert np.array_equal(
        device_bytes(dst, dst_pitch * dst_rows * dst_d).reshape(dst_d, dst_rows, dst_pitch), want)


def test_pitches_a_3d_copy_cannot_express_go_row_by_row(ctx: cuda.Context) -> None:
    from gpurpc import _driver_extras as extras
    flat = extras._Geometry(8, 2, 1, 0, 16, 0, 0, 16, 0)
    assert extras._pitched_endpoint(0x1000, 16, 0, flat) is not None
    assert extras._pitched_endpoint(0x1000, extras._MAX_COPY_3D_PITCH + 1, 0, flat) is None
    deep = extras._Geometry(8, 2, 3, 0, 16, 40, 0, 16, 48)
    assert extras._pitched_endpoint(0x1000, 16, 40, deep) is None  # 2.5 rows per slice
    endpoint = extras._pitched_endpoint(0x1000, 16, 48, deep)
    assert endpoint is not None and endpoint.height == 3 and endpoint.pitch_bytes == 16


def test_pitched_upload_from_a_region_backed_array_uses_region_copies(
        ctx: cuda.Context, kinds: List[str]) -> None:
    h, w, pitch = 8, 300, 512
    host = cuda.pagelocked_empty((h, w), np.uint8)
    host[:] = rng.integers(0, 256, (h, w), dtype=np.uint8)
    in_region = _regions.region_of(ctx._core, host) is not None
    dev = cuda.mem_alloc(pitch * h)
    cuda.memset_d8(dev, 9, pitch * h)
    copy = cuda.Memcpy2D()
    copy.set_src_host(host)
    copy.set_dst_device(dev)
    copy.src_pitch, copy.dst_pitch, copy.width_in_bytes, copy.height = w, pitch, w, h
    kinds.clear()
    copy()
    if in_region:  # a Unix-socket daemon: no bytes through gRPC
        assert kinds == ["region_copy"] * h + ["sync"]
    else:
        assert kinds == ["upload"] * h
    raw = device_bytes(dev, pitch * h).reshape(h, pitch)
    assert np.array_equal(raw[:, :w], host) and (raw[:, w:] == 9).all()


# -- Memcpy2D: refused before anything is sent -------------------------------------------------

def make_copy(src, dst, width: int, height: int, src_pitch: int, dst_pitch: int) -> cuda.Memcpy2D:
    copy = cuda.Memcpy2D()
    (copy.set_src_host if isinstance(src, np.ndarray) else copy.set_src_device)(src)
    (copy.set_dst_host if isinstance(dst, np.ndarray) else copy.set_dst_device)(dst)
    copy.width_in_bytes, copy.height = width, height
    copy.src_pitch, copy.dst_pitch = src_pitch, dst_pitch
    return copy


def test_last_device_row_past_the_allocation_is_refused(ctx: cuda.Context,
                                                        kinds: List[str]) -> None:
    dev, pitch = cuda.mem_alloc_pitch(100, 4, 4)
    cuda.memset_d8(dev, 3, pitch * 4)
    host = random_bytes(100 * 5).reshape(5, 100)
    kinds.clear()
    copy = make_copy(host, dev, 100, 5, 100, pitch)  # one row too many
    with pytest.raises(cuda.LogicError) as info:
        copy()
    message = str(info.value)
    assert "destination" in message and "past the end of its allocation" in message
    assert f"{pitch * 4}-byte allocation" in message and f"0x{int(dev):x}" in message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert kinds == []  # nothing was sent
    assert (device_bytes(dev, pitch * 4) == 3).all()
    # An x offset that pushes the last row over the end, and a source side.
    copy = make_copy(host, dev, 100, 4, 100, pitch)
    copy.dst_x_in_bytes = pitch - 99
    with pytest.raises(cuda.LogicError, match="destination runs past the end"):
        copy()
    back = np.zeros((4, 100), np.uint8)
    down = make_copy(dev, back, 100, 4, pitch, 100)
    down.src_y = 1
    with pytest.raises(cuda.LogicError, match="source runs past the end of its allocation"):
        down()
    kinds.clear()
    down.src_y = 0
    down()  # in bounds: fine
    assert (back == 3).all() and kinds


def test_last_host_row_past_the_buffer_is_refused(ctx: cuda.Context, kinds: List[str]) -> None:
    dev = cuda.mem_alloc(4096)
    host = random_bytes(1000)
    copy = make_copy(host, dev, 100, 10, 101, 100)  # the last row ends at byte 1009
    kinds.clear()
    with pytest.raises(cuda.LogicError) as info:
        copy()
    message = str(info.value)
    assert "source" in message and "host buffer" in message and "1009" in message
    assert "1000 bytes" in message
    back = np.zeros(999, np.uint8)
    down = make_copy(dev, back, 100, 10, 100, 100)
    with pytest.raises(cuda.LogicError, match="destination runs past the end of its host buffer"):
        down()
    assert kinds == []
    copy.src_pitch = 100
    copy()  # 1000 bytes exactly: fine


def test_pitch_smaller_than_width_is_refused(ctx: cuda.Context) -> None:
    dev = cuda.mem_alloc(4096)
    host = random_bytes(4096)
    with pytest.raises(cuda.LogicError, match=r"src_pitch \(50\) is smaller than width_in_bytes"):
        make_copy(host, dev, 64, 4, 50, 64)()
    with pytest.raises(cuda.LogicError, match=r"dst_pitch \(0\) is smaller"):
        make_copy(host, dev, 64, 4, 64, 0)()
    make_copy(host, dev, 64, 1, 0, 0)()  # one row: the pitches are not used


def test_hostile_descriptor_values(ctx: cuda.Context) -> None:
    copy = cuda.Memcpy2D()
    for name in ("src_x_in_bytes", "src_y", "src_pitch", "dst_x_in_bytes", "dst_y", "dst_pitch",
                 "width_in_bytes", "height"):
        assert getattr(copy, name) == 0
        with pytest.raises(ValueError, match=f"Memcpy2D.{name} must not be negative"):
            setattr(copy, name, -1)
        with pytest.raises(TypeError, match=f"Memcpy2D.{name} must be an int"):
            setattr(copy, name, 1.5)
        with pytest.raises(TypeError):
            setattr(copy, name, "8")
        setattr(copy, name, np.int64(8))
        assert getattr(copy, name) == 8
    with pytest.raises(AttributeError):
        copy.src_pich = 8  # a typo is not silently accepted
    with pytest.raises(cuda.LogicError, match="no source was set"):
        copy()
    copy.set_src_host(np.zeros(100, np.uint8))
    with pytest.raises(cuda.LogicError, match="no destination was set"):
        copy()
    with pytest.raises(TypeError, match="expected a Stream"):
        copy("stream")
    with pytest.raises(TypeError, match="takes a gpurpc.driver.Array"):
        copy.set_src_array(object())
    with pytest.raises(TypeError, match="takes a gpurpc.driver.Array"):
        copy.set_dst_array(object())
    dev = cuda.mem_alloc(64)
    with pytest.raises(TypeError, match="device memory; use Memcpy2D.set_src_device"):
        copy.set_src_host(dev)
    with pytest.raises(TypeError, match="host memory"):
        copy.set_dst_device(np.zeros(4))
    with pytest.raises(TypeError, match="buffer interface"):
        copy.set_src_host(object())
    with pytest.raises(TypeError, match="expected a device pointer"):
        copy.set_dst_device("0x1000")
    with pytest.raises(ValueError, match="read-only"):
        copy.set_dst_host(b"\0" * 64)
    with pytest.raises(ValueError, match="contiguous"):
        copy.set_src_host(np.zeros((8, 8))[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        copy.set_dst_host(np.zeros((8, 8))[::2])


def test_memory_of_another_session_is_refused(ctx: cuda.Context, other: cuda.Context,
                                              kinds: List[str]) -> None:
    mine = cuda.mem_alloc(4096)
    other.push()
    try:
        # Sessions may hand out the same addresses: this one's lies beyond all of ctx's.
        pad = cuda.mem_alloc(4 * MiB)
        theirs = cuda.mem_alloc(4096)
        their_stream = cuda.Stream()
    finally:
        cuda.Context.pop()
    other_id = other.session_id
    assert pad.size == 4 * MiB
    kinds.clear()
    copy = make_copy(mine, theirs, 64, 4, 64, 64)
    with pytest.raises(cuda.LogicError, match=f"session {ctx.session_id} and the destination of "
                                              f"session {other.session_id}"):
        copy()
    # A plain int address of the other session, used in this context.
    copy = make_copy(mine, int(theirs), 64, 4, 64, 64)
    with pytest.raises(cuda.LogicError, match=f"inside memory of gpurpc session {other_id}"):
        copy()
    copy = make_copy(np.zeros(256, np.uint8), int(theirs), 64, 4, 64, 64)
    with pytest.raises(cuda.LogicError, match=f"inside memory of gpurpc session {other_id}"):
        copy()
    with pytest.raises(cuda.LogicError, match=f"inside memory of gpurpc session {other_id}"):
        cuda.mem_get_address_range(int(theirs))
    with pytest.raises(cuda.LogicError, match=f"inside memory of gpurpc session {other_id}"):
        cuda.memset_d2d8(int(theirs), 64, 1, 64, 4)
    # A stream of the other session with this session's memory.
    copy = make_copy(np.zeros(256, np.uint8), mine, 64, 4, 64, 64)
    with pytest.raises(cuda.LogicError, match="the stream belongs to gpurpc session"):
        copy(their_stream)
    with pytest.raises(cuda.LogicError, match="the stream belongs to gpurpc session"):
        cuda.memset_d2d8_async(mine, 64, 1, 64, 4, their_stream)
    assert kinds == []
    # Its own memory is fine in its own session.
    assert cuda.mem_get_address_range(theirs) == (int(theirs), theirs.size)


def test_freed_and_unknown_addresses_are_refused(ctx: cuda.Context) -> None:
    dev = cuda.mem_alloc(1024)
    address = int(dev)
    dev.free()
    copy = make_copy(np.zeros(1024, np.uint8), address, 64, 4, 64, 64)
    with pytest.raises(cuda.LogicError, match="not inside any live allocation"):
        copy()
    with pytest.raises(cuda.LogicError, match="cuMemGetAddressRange failed"):
        cuda.mem_get_address_range(address)
    with pytest.raises(cuda.LogicError, match="not inside any live allocation"):
        cuda.mem_get_address_range(8)


# -- Memcpy3D ---------------------------------------------------------------------------------

def test_memcpy3d_box_matches_numpy_slicing(ctx: cuda.Context, kinds: List[str]) -> None:
    d, h, w = 5, 6, 7  # the source volume, float32
    vol = rng.standard_normal((d, h, w)).astype(np.float32)
    pitch, dev_h, dev_d = 64, 8, 6  # device layout: rows of 64 bytes, 8 rows per slice
    dev = cuda.mem_alloc(pitch * dev_h * dev_d)
    cuda.memset_d8(dev, 0, pitch * dev_h * dev_d)
    up = cuda.Memcpy3D()
    assert up.depth == 0 and up.src_lod == 0
    up.set_src_host(vol)
    up.set_dst_device(dev)
    up.src_x_in_bytes, up.src_y, up.src_z = 4, 1, 1
    up.src_pitch, up.src_height = w * 4, h
    up.dst_x_in_bytes, up.dst_y, up.dst_z = 8, 2, 0
    up.dst_pitch, up.dst_height = pitch, dev_h
    up.width_in_bytes, up.height, up.depth = 5 * 4, 4, 3
    up()
    raw = device_bytes(dev, pitch * dev_h * dev_d).reshape(dev_d, dev_h, pitch)
    want = np.zeros((dev_d, dev_h, pitch), np.uint8)
    want[0:3, 2:6, 8:28] = vol[1:4, 1:5, 1:6].copy().view(np.uint8).reshape(3, 4, 20)
    assert np.array_equal(raw, want)

    back = np.zeros((4, 5, 6), np.float32)
    down = cuda.Memcpy3D()
    down.set_src_device(dev)
    down.set_dst_host(back)
    down.src_x_in_bytes, down.src_y, down.src_z = 8, 2, 0
    down.src_pitch, down.src_height = pitch, dev_h
    down.dst_x_in_bytes, down.dst_y, down.dst_z = 4, 1, 1
    down.dst_pitch, down.dst_height = 6 * 4, 5
    down.width_in_bytes, down.height, down.depth = 5 * 4, 4, 3
    down()
    want_back = np.zeros_like(back)
    want_back[1:4, 1:5, 1:6] = vol[1:4, 1:5, 1:6]
    assert np.array_equal(back, want_back)

    # Contiguous slices on both sides: one command for the whole volume.
    dst = cuda.mem_alloc(vol.nbytes)
    whole = cuda.Memcpy3D()
    whole.set_src_host(vol)
    whole.set_dst_device(dst)
    whole.src_pitch = whole.dst_pitch = whole.width_in_bytes = w * 4
    whole.src_height = whole.dst_height = whole.height = h
    whole.depth = d
    kinds.clear()
    whole()
    assert kinds == ["upload"]
    assert np.array_equal(device_bytes(dst, vol.nbytes).view(np.float32).reshape(vol.shape), vol)
    # Contiguous rows but padded slices: one command per slice.
    padded = cuda.mem_alloc(w * 4 * (h + 2) * d)
    whole.set_dst_device(padded)
    whole.dst_height = h + 2
    kinds.clear()
    whole()
    assert kinds == ["upload"] * d


def test_memcpy3d_checks(ctx: cuda.Context, kinds: List[str]) -> None:
    dev = cuda.mem_alloc(4096)
    host = np.zeros(4096, np.uint8)
    copy = cuda.Memcpy3D()
    copy.set_src_host(host)
    copy.set_dst_device(dev)
    copy.width_in_bytes, copy.height = 16, 4
    copy.src_pitch = copy.dst_pitch = 16
    kinds.clear()
    copy()  # depth 0 (PyCUDA's initial value): nothing to copy
    assert kinds == []
    copy.depth = 2
    copy.src_height, copy.dst_height = 3, 4
    with pytest.raises(cuda.LogicError, match=r"src_height \(3\) is smaller than height"):
        copy()
    copy.src_height = 4
    copy.dst_lod = 1
    with pytest.raises(cuda.LogicError, match="dst_lod applies to CUDA arrays"):
        copy()
    copy.dst_lod = 0
    copy.dst_z = 32  # slices 32 and 33 of 64 bytes each: bytes 2048 to 2176, fine
    copy()
    copy.dst_z = 63  # slices 63 and 64: the last one runs past the 4096 bytes
    with pytest.raises(cuda.LogicError, match="destination runs past the end"):
        copy()
    with pytest.raises(ValueError, match="Memcpy3D.depth must not be negative"):
        copy.depth = -2
    with pytest.raises(AttributeError):
        cuda.Memcpy3DPeer  # noqa: B018 - still not served


# -- memset_d2d -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, dtype, value", [
    (cuda.memset_d2d8, np.uint8, 0xC3),
    (cuda.memset_d2d16, np.uint16, 0xBEEF),
    (cuda.memset_d2d32, np.uint32, 0xDEADBEEF),
])
def test_memset_d2d(ctx: cuda.Context, kinds: List[str], fn, dtype, value) -> None:
    item = np.dtype(dtype).itemsize
    h, width = 9, 13  # width in elements
    alloc, pitch = cuda.mem_alloc_pitch(width * item, h, 4)
    cuda.memset_d8(alloc, 0, pitch * h)
    kinds.clear()
    fn(int(alloc) + pitch, pitch, value, width, h - 2)  # rows 1 .. h-2
    assert kinds == ["memset"] * (h - 2)
    raw = device_bytes(alloc, pitch * h).reshape(h, pitch)
    want = np.zeros((h, pitch), np.uint8)
    want[1:h - 1, :width * item] = np.full((h - 2, width), value, dtype).view(np.uint8)
    assert np.array_equal(raw, want)
    # Rows that touch: one memset.
    kinds.clear()
    fn(alloc, width * item, 0, width, h)
    assert kinds == ["memset"]
    assert not device_bytes(alloc, width * item * h).any()
    # Negative values are the two's complement pattern.
    fn(alloc, pitch, -1, width, 1)
    assert (device_bytes(alloc, width * item) == 0xFF).all()


@pytest.mark.parametrize("fn, item", [(cuda.memset_d2d8_async, 1), (cuda.memset_d2d16_async, 2),
                                      (cuda.memset_d2d32_async, 4)])
def test_memset_d2d_async_on_a_stream(ctx: cuda.Context, fn, item: int) -> None:
    stream = cuda.Stream()
    h, width, pitch = 6, 10, 64
    dev = cuda.mem_alloc(pitch * h)
    cuda.memset_d8(dev, 0, pitch * h)
    fn(dev, pitch, 0x11, width, h, stream)
    fn(dev, pitch, 0x22, width, 2)  # default stream
    ctx.synchronize()
    raw = device_bytes(dev, pitch * h).reshape(h, pitch)
    elements = raw[:, :width * item].copy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[item])
    assert (elements[:2] == 0x22).all() and (elements[2:] == 0x11).all()
    assert not raw[:, width * item:].any()


def test_memset_d2d_hostile_arguments(ctx: cuda.Context, kinds: List[str]) -> None:
    dev = cuda.mem_alloc(1024)
    kinds.clear()
    with pytest.raises(cuda.LogicError, match=r"pitch \(30 bytes\) is smaller than a row"):
        cuda.memset_d2d32(dev, 30, 0, 8, 4)
    with pytest.raises(cuda.LogicError, match="multiples of the element size 4"):
        cuda.memset_d2d32(dev, 66, 0, 8, 4)
    with pytest.raises(cuda.LogicError, match="multiples of the element size 2"):
        cuda.memset_d2d16(int(dev) + 1, 64, 0, 8, 4)
    with pytest.raises(cuda.LogicError, match="destination runs past the end of its allocation"):
        cuda.memset_d2d8(dev, 128, 0, 128, 9)
    with pytest.raises(ValueError, match="does not fit in 8 bits"):
        cuda.memset_d2d8(dev, 64, 256, 8, 4)
    with pytest.raises(ValueError, match="does not fit in 16 bits"):
        cuda.memset_d2d16(dev, 64, -40000, 8, 4)
    with pytest.raises(TypeError, match="data must be an int"):
        cuda.memset_d2d32(dev, 64, 1.5, 8, 4)
    with pytest.raises(ValueError, match="height must not be negative"):
        cuda.memset_d2d8(dev, 64, 0, 8, -1)
    with pytest.raises(TypeError, match="pitch must be an int"):
        cuda.memset_d2d8(dev, None, 0, 8, 1)
    with pytest.raises(TypeError, match="stream must be"):
        cuda.memset_d2d8_async(dev, 64, 0, 8, 1, "stream")
    assert kinds == []
    cuda.memset_d2d8(dev, 128, 0, 128, 8)  # exactly the allocation: fine
    cuda.memset_d2d8(dev, 0, 0, 0, 5)  # nothing to set


# -- address ranges, pointer attributes -------------------------------------------------------

def test_mem_get_address_range(ctx: cuda.Context) -> None:
    a = cuda.mem_alloc(1000)
    b = cuda.mem_alloc(3000)
    assert cuda.mem_get_address_range(a) == (int(a), a.size)
    assert cuda.mem_get_address_range(int(b) + 2999) == (int(b), b.size)
    assert cuda.mem_get_address_range(np.uintp(int(b) + 17)) == (int(b), b.size)
    assert a.size >= 1000 and b.size >= 3000
    with pytest.raises(cuda.LogicError, match="not inside any live allocation") as info:
        cuda.mem_get_address_range(int(b) + b.size + (1 << 30))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(TypeError):
        cuda.mem_get_address_range("a")


def test_mem_get_address_range_of_pool_blocks_and_gpuarray_views(ctx: cuda.Context) -> None:
    import gpurpc.gpuarray as gpuarray
    from gpurpc import tools

    pool = tools.DeviceMemoryPool()
    block = pool.allocate(1000)
    base, size = cuda.mem_get_address_range(block)
    assert base == int(block) and size >= 1000  # the pool's whole block, as in CUDA
    a = gpuarray.to_gpu(np.arange(100, dtype=np.float32))
    view = a[10:]
    base, size = cuda.mem_get_address_range(view)
    assert base <= int(a.gpudata) and int(view.gpudata) + view.nbytes <= base + size
    assert cuda.mem_get_address_range(view.gpudata) == (base, size)


def test_pointer_attribute_and_memory_type_enums() -> None:
    # CUDA's values (CUpointer_attribute, CUmemorytype).
    assert [(a.name, int(a)) for a in cuda.pointer_attribute] == [
        ("CONTEXT", 1), ("MEMORY_TYPE", 2), ("DEVICE_POINTER", 3), ("HOST_POINTER", 4)]
    assert [(m.name, int(m)) for m in cuda.memory_type] == [
        ("HOST", 1), ("DEVICE", 2), ("ARRAY", 3), ("UNIFIED", 4)]
    assert issubclass(cuda.PointerHolderBase, object)


def test_pointer_holder_and_gpuarray_sides(ctx: cuda.Context) -> None:
    import gpurpc.gpuarray as gpuarray

    class Holder(cuda.PointerHolderBase):
        def __init__(self, alloc: cuda.DeviceAllocation) -> None:
            self.alloc = alloc

        def get_pointer(self) -> int:
            return int(self.alloc)

    a = gpuarray.to_gpu(np.arange(64, dtype=np.float32).reshape(8, 8))
    dest = cuda.mem_alloc(8 * 4 * 4)
    copy = cuda.Memcpy2D()
    copy.set_src_device(a)  # a GPUArray
    copy.set_dst_device(Holder(dest))
    copy.src_x_in_bytes, copy.src_pitch = 4 * 4, 8 * 4  # columns 4..7
    copy.dst_pitch, copy.width_in_bytes, copy.height = 4 * 4, 4 * 4, 8
    copy()
    out = np.empty((8, 4), np.float32)
    cuda.memcpy_dtoh(out, dest)
    assert np.array_equal(out, a.get()[:, 4:])


# -- aligned host arrays ----------------------------------------------------------------------

@pytest.mark.parametrize("regions", ["auto", "off"])
@pytest.mark.parametrize("alignment", [1, 3, 16, 64, 256, 4096, 8192, 1 << 16])
def test_aligned_arrays_honour_the_alignment(ctx: cuda.Context, regions: str,
                                             alignment: int) -> None:
    ctx.host_regions = regions
    for shape, dtype, order in [((3, 5), np.float64, "C"), (1000, np.complex64, "C"),
                                ((4, 6, 2), np.int16, "F"), (0, np.float32, "C")]:
        empty = cuda.aligned_empty(shape, dtype, order, alignment)
        zeros = cuda.aligned_zeros(shape, dtype, order=order, alignment=alignment)
        like = cuda.aligned_empty_like(zeros, alignment=alignment)
        zlike = cuda.aligned_zeros_like(empty, alignment)
        for array in (empty, zeros, like, zlike):
            assert array.ctypes.data % alignment == 0, (shape, dtype, order, alignment)
            assert array.shape == (shape if isinstance(shape, tuple) else (shape,))
            assert array.dtype == dtype
            assert array.flags.writeable
            if array.ndim > 1 and order == "F":
                assert array.flags.f_contiguous
            else:
                assert array.flags.c_contiguous
        assert not zeros.any() and not zlike.any()
    # The default is a page.
    assert cuda.aligned_empty(10, np.float32).ctypes.data % 4096 == 0
    assert cuda.aligned_zeros((2, 2), np.uint8).ctypes.data % mmap.PAGESIZE == 0


def test_aligned_arrays_round_trip_and_hostile_arguments(ctx: cuda.Context) -> None:
    a = cuda.aligned_empty((16, 16), np.float32, alignment=128)
    a[:] = rng.standard_normal((16, 16))
    dev = cuda.to_device(a)
    b = cuda.aligned_zeros_like(a, 512)
    cuda.memcpy_dtoh(b, dev)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="alignment must be positive"):
        cuda.aligned_empty(4, np.float32, "C", 0)
    with pytest.raises(ValueError, match="alignment must not be negative"):
        cuda.aligned_empty(4, np.float32, "C", -64)
    with pytest.raises(TypeError, match="alignment must be an int"):
        cuda.aligned_zeros(4, np.float32, "C", 64.0)
    with pytest.raises(ValueError, match="negative dimensions"):
        cuda.aligned_empty((2, -1), np.float32)
    with pytest.raises(ValueError, match="order must be"):
        cuda.aligned_empty(4, np.float32, "K")
    with pytest.raises(TypeError, match="object dtype"):
        cuda.aligned_empty(4, object)
    with pytest.raises(ValueError, match="could not detect array order"):
        cuda.aligned_empty_like(np.zeros((4, 4))[:, ::2])
    with pytest.raises(TypeError):
        cuda.aligned_empty(4, "no such dtype")
