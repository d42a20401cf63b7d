"""PyCUDA's pitched and structured memory calls, built from the linear operations gpurpcd serves.

``gpurpc.driver`` re-exports everything here (``__all__``); use it from there:

* :func:`mem_alloc_pitch`: a linear allocation with rows padded to the pitch alignment;
* :class:`Memcpy2D` and :class:`Memcpy3D`: pitched copies between host buffers, linear
  device memory and CUDA arrays (``gpurpc._arrays``), in every direction;
* :func:`memset_d2d8`, :func:`memset_d2d16`, :func:`memset_d2d32` and their ``_async`` forms;
* :func:`mem_get_address_range`, and the ``pointer_attribute`` and ``memory_type`` enums;
* :func:`aligned_empty`, :func:`aligned_zeros`, :func:`aligned_empty_like`,
  :func:`aligned_zeros_like`, which honour ``alignment``.

A 2D or 3D copy between linear device memory is one ``Copy3DCommand`` (``cuMemcpy3DAsync``)
when its rows or slices lie apart, except on a stream that captures a graph, which takes
plain copies only. Other copies of linear memory are sent as one copy (upload, download,
device-to-device copy or region copy) per run of contiguous bytes, queued in order on the
session's command stream: rows that touch on both sides merge, so a copy whose pitches equal
``width_in_bytes`` is one command. A synchronous call drains the stream once at the end, so
all its rows travel in as few batches as their size allows. A copy with a CUDA array on one side
(``set_src_array``/``set_dst_array``) is one ``Copy3DCommand`` (through a temporary device
buffer when the other side is host memory); ``gpurpc._arrays`` runs it.

Every copy and memset is checked before anything is sent: a device side must lie within one
live allocation of the session (the client's allocation registry; memory from
:func:`gpurpc.driver.mem_alloc` and what is built on it, not module globals), and a host side
within its buffer. A violation raises :class:`LogicError` naming the side and the bytes.

Not served: levels of detail of mipmapped arrays (``src_lod``/``dst_lod`` other than 0).
"""
from __future__ import annotations

import enum
import functools
import mmap
import operator
from typing import TYPE_CHECKING, Any, Iterator, Optional, Tuple

import grpc
import numpy as np

from . import _context, _core, _memory, _regions, _streams
from ._core import SessionCore, device_pointer
from ._enums import device_attribute
from ._errors import LogicError
from .v1 import execution_service_pb2 as _ex

if TYPE_CHECKING:  # pragma: no cover
    from .driver import DeviceAllocation, Stream

__all__ = [
    "pointer_attribute", "memory_type",
    "mem_alloc_pitch", "mem_get_address_range",
    "Memcpy2D", "Memcpy3D",
    "memset_d2d8", "memset_d2d16", "memset_d2d32",
    "memset_d2d8_async", "memset_d2d16_async", "memset_d2d32_async",
    "aligned_empty", "aligned_zeros", "aligned_empty_like", "aligned_zeros_like",
]

#: The row alignment of :func:`mem_alloc_pitch`: what ``cuMemAllocPitch`` uses on recent GPUs
#: (a device that reports a larger TEXTURE_PITCH_ALIGNMENT gets that).
PITCH_ALIGNMENT_BYTES = 512

_ACCESS_SIZES = (4, 8, 16)
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
# The largest linear pitch and rows per slice of a Copy3DCommand (kMaxCopy3DPitchBytes in
# common/array_shape.h, the driver's largest pitch).
_MAX_COPY_3D_PITCH = (1 << 31) - 1


class pointer_attribute(enum.IntEnum):  # noqa: N801 - PyCUDA's name
    """``CUpointer_attribute`` values PyCUDA exposes (``pycuda.driver.pointer_attribute``)."""

    CONTEXT = 1
    MEMORY_TYPE = 2
    DEVICE_POINTER = 3
    HOST_POINTER = 4


class memory_type(enum.IntEnum):  # noqa: N801 - PyCUDA's name
    """``CUmemorytype`` (``pycuda.driver.memory_type``); :class:`Memcpy2D` reports the kind of
    its source and destination with it."""

    HOST = 1
    DEVICE = 2
    ARRAY = 3
    UNIFIED = 4


def _drv() -> Any:
    """``gpurpc.driver``, imported when first needed (it re-exports this module)."""
    from . import driver
    return driver


def _size(value: Any, what: str) -> int:
    """A non-negative int (anything with ``__index__``), else TypeError / ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {n}")
    return n


# =============================================================================================
# Which session memory belongs to, and whether a range of it lies in one allocation

def _not_owned(core: SessionCore, address: int) -> str:
    """Why ``address`` is not memory of core's session (for an error message)."""
    others = [c.session_id for c in list(_memory._sessions_with_allocations)
              if c is not core and not c.closed
              and _memory._find_allocation(c, address) is not None]
    where = (f"it is inside memory of gpurpc session {others[0]}, but device addresses are "
             "valid only in the session that allocated them" if others else
             "only memory from mem_alloc of this session, not yet freed, can be used here")
    return f"is not inside any live allocation of session {core.session_id} ({where})"


def _check_device_range(core: SessionCore, address: int, lo: int, hi: int, side: str,
                        label: str) -> None:
    """Checks that bytes [address + lo, address + hi) lie within one live allocation of core's
    session; LogicError naming ``side`` and the bytes otherwise."""
    start = address + lo
    alloc = _memory._find_allocation(core, start)
    if alloc is None:
        raise LogicError(f"{label}: the {side} (first byte at 0x{start:x}) "
                         f"{_not_owned(core, start)}", code=_INVALID, operation=label)
    end = alloc._ptr + alloc._size
    if address + hi > end:
        raise LogicError(
            f"{label}: the {side} runs past the end of its allocation: its last byte would be "
            f"at offset {address + hi - alloc._ptr - 1} of the {alloc._size}-byte allocation "
            f"at 0x{alloc._ptr:x} ({address + hi - end} bytes too far; the {side} spans bytes "
            f"{lo} to {hi} from 0x{address:x}); nothing was copied",
            code=_INVALID, operation=label)


def _check_host_range(nbytes: int, lo: int, hi: int, side: str, label: str) -> None:
    if hi > nbytes:
        raise LogicError(
            f"{label}: the {side} runs past the end of its host buffer: its last row ends at "
            f"byte {hi}, but the buffer has {nbytes} bytes ({hi - nbytes} bytes too far; the "
            f"{side} spans bytes {lo} to {hi}); nothing was copied",
            code=_INVALID, operation=label)


def _stream_for(core: SessionCore, stream: Any, label: str) -> int:
    """The stream id of ``stream`` (None: the default stream); it must be core's."""
    drv = _drv()
    if isinstance(stream, drv.Stream) and stream._core is not core:
        raise LogicError(f"{label}: the stream belongs to gpurpc session "
                         f"{stream._core.session_id}, but the memory to session "
                         f"{core.session_id}", code=_INVALID, operation=label)
    return _streams._stream_id(stream)


# =============================================================================================
# Pitched allocations and address ranges

def _pitch_alignment(core: SessionCore) -> int:
    reported = int(core.device_info.attributes.get(
        int(device_attribute.TEXTURE_PITCH_ALIGNMENT), 0))
    return max(PITCH_ALIGNMENT_BYTES, reported)


def mem_alloc_pitch(width: int, height: int, access_size: int) -> Tuple["DeviceAllocation", int]:
    """Allocates ``height`` rows of at least ``width`` bytes (``cuMemAllocPitch``).

    Returns ``(allocation, pitch)``: row ``i`` starts at ``int(allocation) + i * pitch``;
    ``pitch`` is ``width`` rounded up to 512 bytes (or to the device's
    TEXTURE_PITCH_ALIGNMENT when it reports more), so rows accessed with elements of
    ``access_size`` bytes coalesce.

    :raises LogicError: ``access_size`` is not 4, 8 or 16 (as in CUDA), ``width`` or ``height``
        is 0, or the pitch exceeds the device's MAX_PITCH.
    :raises MemoryError: not enough device memory.
    """
    label = "mem_alloc_pitch"
    width = _size(width, f"{label}: width")
    height = _size(height, f"{label}: height")
    if isinstance(access_size, bool) or not isinstance(access_size, (int, np.integer)):
        raise TypeError(f"{label}: access_size must be an int (4, 8 or 16), got "
                        f"{type(access_size).__name__}")
    if int(access_size) not in _ACCESS_SIZES:
        raise LogicError(f"cuMemAllocPitch failed: access_size must be 4, 8 or 16 bytes "
                         f"(ElementSizeBytes), got {int(access_size)}", code=_INVALID,
                         operation=label)
    if width == 0 or height == 0:
        raise LogicError(f"cuMemAllocPitch failed: width and height must be positive, got "
                         f"width={width}, height={height}", code=_INVALID, operation=label)
    core = _context._current_core(label)
    alignment = _pitch_alignment(core)
    pitch = -(-width // alignment) * alignment
    max_pitch = int(core.device_info.attributes.get(int(device_attribute.MAX_PITCH), 0))
    if max_pitch and pitch > max_pitch:
        raise LogicError(f"cuMemAllocPitch failed: a pitch of {pitch} bytes (width {width}) "
                         f"exceeds the device's MAX_PITCH of {max_pitch}", code=_INVALID,
                         operation=label)
    return _memory._alloc(core, pitch * height), pitch


def mem_get_address_range(ptr: Any) -> Tuple[int, int]:
    """``(base, size)`` of the allocation that contains device address ``ptr``
    (``cuMemGetAddressRange``), from the session's allocation registry.

    :raises LogicError: ``ptr`` is not inside a live allocation of the session it is used in
        (its own session for a DeviceAllocation, GPUArray or pool block; the current context's
        for a plain int); the message names the session it belongs to, when it is known.
    """
    label = "mem_get_address_range"
    address = _memory._address(ptr)
    core = _memory._core_for(ptr, label)
    alloc = _memory._find_allocation(core, address)
    if alloc is None:
        raise LogicError(f"cuMemGetAddressRange failed: 0x{address:x} "
                         f"{_not_owned(core, address)}", code=_INVALID, operation=label)
    return alloc._ptr, alloc._size


# =============================================================================================
# 2D memsets

def _memset_2d(dest: Any, pitch: Any, data: Any, width: Any, height: Any, element_size: int,
               stream: Any, sync: bool, label: str) -> None:
    pitch = _size(pitch, f"{label}: pitch")
    width = _size(width, f"{label}: width")
    height = _size(height, f"{label}: height")
    if isinstance(data, bool):
        raise TypeError(f"{label}: data must be an int, got bool")
    try:
        value = operator.index(data)
    except TypeError:
        raise TypeError(f"{label}: data must be an int, got {type(data).__name__}") from None
    bits = 8 * element_size
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise ValueError(f"{label}: data {value} does not fit in {bits} bits")
    address = _memory._address(dest)
    core = _memory._core_for(dest, label)
    stream_id = _stream_for(core, stream, label)
    row = width * element_size
    if width == 0 or height == 0:
        return
    if height > 1 and pitch < row:
        raise LogicError(f"{label}: pitch ({pitch} bytes) is smaller than a row of {width} "
                         f"{element_size}-byte elements ({row} bytes)", code=_INVALID,
                         operation=label)
    if element_size > 1 and (address % element_size or (height > 1 and pitch % element_size)):
        raise LogicError(f"{label}: the address 0x{address:x} and the pitch {pitch} must be "
                         f"multiples of the element size {element_size}", code=_INVALID,
                         operation=label)
    _check_device_range(core, address, 0, (height - 1) * pitch + row, "destination", label)
    value &= (1 << bits) - 1
    with core.lock:
        core.check_open(label)
        add = core.commands.add
        if height == 1 or pitch == row:
            add(label, auto=not sync, memset=_ex.MemsetCommand(
                destination=device_pointer(address), value=value,
                element_size_bytes=element_size, count=width * height, stream_id=stream_id))
        else:
            for j in range(height):
                add(label, auto=not sync, memset=_ex.MemsetCommand(
                    destination=device_pointer(address + j * pitch), value=value,
                    element_size_bytes=element_size, count=width, stream_id=stream_id))
        if sync:
            core.commands.drain(label=label)


def memset_d2d8(dest: Any, pitch: int, data: int, width: int, height: int) -> None:
    """Sets ``width`` bytes of each of ``height`` rows, ``pitch`` bytes apart, to ``data``."""
    _memset_2d(dest, pitch, data, width, height, 1, None, True, "memset_d2d8")


def memset_d2d16(dest: Any, pitch: int, data: int, width: int, height: int) -> None:
    """Like :func:`memset_d2d8` with 16-bit elements (``width`` counts elements; ``dest`` and
    ``pitch`` must be 2-byte aligned)."""
    _memset_2d(dest, pitch, data, width, height, 2, None, True, "memset_d2d16")


def memset_d2d32(dest: Any, pitch: int, data: int, width: int, height: int) -> None:
    """Like :func:`memset_d2d8` with 32-bit elements (``width`` counts elements; ``dest`` and
    ``pitch`` must be 4-byte aligned)."""
    _memset_2d(dest, pitch, data, width, height, 4, None, True, "memset_d2d32")


def memset_d2d8_async(dest: Any, pitch: int, data: int, width: int, height: int,
                      stream: Optional["Stream"] = None) -> None:
    """Queues :func:`memset_d2d8` on ``stream``."""
    _memset_2d(dest, pitch, data, width, height, 1, stream, False, "memset_d2d8_async")


def memset_d2d16_async(dest: Any, pitch: int, data: int, width: int, height: int,
                       stream: Optional["Stream"] = None) -> None:
    """Queues :func:`memset_d2d16` on ``stream``."""
    _memset_2d(dest, pitch, data, width, height, 2, stream, False, "memset_d2d16_async")


def memset_d2d32_async(dest: Any, pitch: int, data: int, width: int, height: int,
                       stream: Optional["Stream"] = None) -> None:
    """Queues :func:`memset_d2d32` on ``stream``."""
    _memset_2d(dest, pitch, data, width, height, 4, stream, False, "memset_d2d32_async")


# =============================================================================================
# Structured copies

class _Endpoint:
    """One side of a structured copy: a host buffer (flat byte view), a device address or a
    CUDA array (``obj``)."""

    __slots__ = ("kind", "obj", "view", "address", "owner")

    def __init__(self, kind: memory_type, obj: Any, view: Optional[memoryview] = None,
                 address: int = 0, owner: Optional[SessionCore] = None) -> None:
        self.kind = kind
        self.obj = obj          # kept alive while set
        self.view = view        # host: flat byte view
        self.address = address  # device: the address
        self.owner = owner      # device: the session the object says it belongs to


def _is_device_like(obj: Any) -> bool:
    drv = _drv()
    if isinstance(obj, (np.ndarray, bytes, bytearray, memoryview)):
        return False
    return (isinstance(obj, (drv.DeviceAllocation, drv.PointerHolderBase, np.integer))
            or (isinstance(obj, int) and not isinstance(obj, bool))
            or _memory._owner_core(obj) is not None or hasattr(obj, "gpudata")
            or hasattr(obj, "__cuda_array_interface__"))


def _no_array(obj: Any, what: str) -> None:
    if isinstance(obj, _drv().Array):
        method = what.rsplit(".", 1)[-1]
        raise TypeError(f"{what} takes {'host' if 'host' in method else 'device'} memory, got a "
                        f"CUDA Array; use {what.rsplit('_', 1)[0]}_array")


def _host_endpoint(buffer: Any, writable: bool, what: str) -> _Endpoint:
    _no_array(buffer, what)
    if _is_device_like(buffer):
        raise TypeError(f"{what} takes a host buffer (numpy array, bytes, bytearray, ...), got "
                        f"{type(buffer).__name__}, which is device memory; use "
                        f"{what.replace('host', 'device')}")
    if isinstance(buffer, np.ndarray):
        if not (buffer.flags.c_contiguous or buffer.flags.f_contiguous):
            raise ValueError(f"{what}: the host array must be contiguous (its pitch and offsets "
                             "are in bytes of its memory)")
    else:
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(f"{what} takes an object with the buffer interface, got "
                            f"{type(buffer).__name__}") from None
        if not (view.c_contiguous or view.f_contiguous):
            raise ValueError(f"{what}: the host buffer must be contiguous")
    flat = _memory._writable(buffer, what) if writable else _memory._readable(buffer)
    return _Endpoint(memory_type.HOST, buffer, view=flat)


def _device_endpoint(devptr: Any, what: str) -> _Endpoint:
    _no_array(devptr, what)
    if isinstance(devptr, (np.ndarray, bytes, bytearray, memoryview)):
        raise TypeError(f"{what} takes a device pointer (DeviceAllocation, int address, "
                        f"GPUArray), got host memory ({type(devptr).__name__}); use "
                        f"{what.replace('device', 'host')}")
    address = _memory._address(devptr)
    return _Endpoint(memory_type.DEVICE, devptr, address=address, owner=_memory._owner_core(devptr))


class _Size:
    """A non-negative int attribute of a copy descriptor (default 0), checked when set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = "_" + name

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, _size(value, f"{type(obj).__name__}.{self.name}"))


class _Geometry:
    """Where the rows of a copy are: offsets from each side's base, in bytes."""

    __slots__ = ("w", "h", "d", "src", "dst", "src_pitch", "dst_pitch", "src_slice",
                 "dst_slice")

    def __init__(self, w: int, h: int, d: int, src: int, src_pitch: int, src_slice: int,
                 dst: int, dst_pitch: int, dst_slice: int) -> None:
        self.w, self.h, self.d = w, h, d
        self.src, self.src_pitch, self.src_slice = src, src_pitch, src_slice
        self.dst, self.dst_pitch, self.dst_slice = dst, dst_pitch, dst_slice

    def extent(self, start: int, pitch: int, slice_pitch: int) -> Tuple[int, int]:
        """[first byte, end) of one side."""
        return start, start + (self.d - 1) * slice_pitch + (self.h - 1) * pitch + self.w

    @property
    def rows_merge(self) -> bool:
        """The rows of a slice are contiguous on both sides."""
        return self.h == 1 or (self.src_pitch == self.w and self.dst_pitch == self.w)

    @property
    def single(self) -> bool:
        """The whole copy is one contiguous run on both sides."""
        block = self.w * self.h
        return self.rows_merge and (self.d == 1 or (self.src_slice == block
                                                    and self.dst_slice == block))

    def runs(self) -> Iterator[Tuple[int, int, int]]:
        """``(src_offset, dst_offset, nbytes)`` of each contiguous run, in order."""
        w, h = self.w, self.h
        if self.single:
            yield self.src, self.dst, w * h * self.d
            return
        merge = self.rows_merge
        for k in range(self.d):
            s0 = self.src + k * self.src_slice
            d0 = self.dst + k * self.dst_slice
            if merge:
                yield s0, d0, w * h
                continue
            for j in range(h):
                yield s0 + j * self.src_pitch, d0 + j * self.dst_pitch, w

    def strided(self, buf: np.ndarray, start: int, pitch: int, slice_pitch: int) -> np.ndarray:
        """A (depth, height, width) byte view of ``buf`` from ``start`` with these pitches."""
        return np.lib.stride_tricks.as_strided(
            buf[start:], shape=(self.d, self.h, self.w), strides=(slice_pitch, pitch, 1))


def _scatter(geometry: _Geometry, dest: memoryview, src: Any, src_base: int) -> None:
    """Copies the rows from the byte buffer ``src`` (whose byte 0 is source offset
    ``src_base``) into the destination host view, on the host."""
    source = np.frombuffer(src, np.uint8)
    target = np.asarray(dest)
    geometry.strided(target, geometry.dst, geometry.dst_pitch, geometry.dst_slice)[...] = \
        geometry.strided(source, geometry.src - src_base, geometry.src_pitch,
                         geometry.src_slice)


def _span_sink(geometry: _Geometry, dest: memoryview, src_base: int, size: int,
               data: bytes) -> None:
    if len(data) != size:
        raise ValueError(f"expected {size} bytes, the daemon sent {len(data)}")
    _scatter(geometry, dest, data, src_base)


class Memcpy2D:
    """A pitched copy between host buffers and linear device memory (``pycuda.driver.Memcpy2D``).

    Set the source with :meth:`set_src_host` or :meth:`set_src_device` and the destination with
    :meth:`set_dst_host` or :meth:`set_dst_device`, then ``width_in_bytes``, ``height``, the
    pitches (bytes from one row to the next; needed when ``height`` > 1) and optionally the
    origins ``src_x_in_bytes``/``src_y`` and ``dst_x_in_bytes``/``dst_y``. ``copy()`` copies
    and waits; ``copy(stream)`` queues the copy on ``stream``. Host bytes are read when the
    copy is called (or, from a region-backed ``pagelocked_*`` array, when the stream gets
    there); a downloaded destination is filled when the stream (or context) is synchronised.

    A side may be a CUDA array (:meth:`set_src_array`, :meth:`set_dst_array`): its origin is
    ``*_x_in_bytes`` (a multiple of the element size), ``*_y`` (and ``*_z`` for Memcpy3D), and
    its pitch and height are the array's own (``*_pitch``/``*_height`` are ignored).

    Both sides are checked before anything is sent (see the module docstring).
    """

    __slots__ = ("_src", "_dst", "_src_x_in_bytes", "_src_y", "_src_pitch", "_dst_x_in_bytes",
                 "_dst_y", "_dst_pitch", "_width_in_bytes", "_height", "__weakref__")

    src_x_in_bytes = _Size()
    src_y = _Size()
    src_pitch = _Size()
    dst_x_in_bytes = _Size()
    dst_y = _Size()
    dst_pitch = _Size()
    width_in_bytes = _Size()
    height = _Size()

    def __init__(self) -> None:
        self._src: Optional[_Endpoint] = None
        self._dst: Optional[_Endpoint] = None
        for name in ("src_x_in_bytes", "src_y", "src_pitch", "dst_x_in_bytes", "dst_y",
                     "dst_pitch", "width_in_bytes", "height"):
            setattr(self, "_" + name, 0)

    # -- endpoints ------------------------------------------------------------------------

    def _what(self, method: str) -> str:
        return f"{type(self).__name__}.{method}"

    def set_src_host(self, buffer: Any) -> None:
        """The source is the contiguous host buffer ``buffer`` (offsets in bytes of it)."""
        self._src = _host_endpoint(buffer, False, self._what("set_src_host"))

    def set_dst_host(self, buffer: Any) -> None:
        """The destination is the contiguous, writable host buffer ``buffer``."""
        self._dst = _host_endpoint(buffer, True, self._what("set_dst_host"))

    def set_src_device(self, devptr: Any) -> None:
        """The source is device memory at ``devptr`` (DeviceAllocation, int address, GPUArray,
        pool block, or PointerHolderBase)."""
        self._src = _device_endpoint(devptr, self._what("set_src_device"))

    def set_dst_device(self, devptr: Any) -> None:
        """The destination is device memory at ``devptr``."""
        self._dst = _device_endpoint(devptr, self._what("set_dst_device"))

    def set_src_unified(self, buffer: Any) -> None:
        """:meth:`set_src_device` for device memory (an allocation, GPUArray or int address),
        else :meth:`set_src_host`."""
        if _is_device_like(buffer):
            self.set_src_device(buffer)
        else:
            self.set_src_host(buffer)

    def set_dst_unified(self, buffer: Any) -> None:
        """:meth:`set_dst_device` for device memory, else :meth:`set_dst_host`."""
        if _is_device_like(buffer):
            self.set_dst_device(buffer)
        else:
            self.set_dst_host(buffer)

    def _array_endpoint(self, array: Any, method: str) -> _Endpoint:
        what = self._what(method)
        if not isinstance(array, _drv().Array):
            raise TypeError(f"{what} takes a gpurpc.driver.Array, got {type(array).__name__}"
                            + ("; for linear device memory use "
                               f"{what.rsplit('_', 1)[0]}_device" if _is_device_like(array)
                               else ""))
        array._check_alive("the array", what)
        return _Endpoint(memory_type.ARRAY, array, owner=array._core)

    def set_src_array(self, array: Any) -> None:
        """The source is the CUDA array ``array`` (a :class:`gpurpc.driver.Array`)."""
        self._src = self._array_endpoint(array, "set_src_array")

    def set_dst_array(self, array: Any) -> None:
        """The destination is the CUDA array ``array``."""
        self._dst = self._array_endpoint(array, "set_dst_array")

    @property
    def src_memory_type(self) -> int:
        """:class:`memory_type` of the source (0 while none is set)."""
        return 0 if self._src is None else self._src.kind

    @property
    def dst_memory_type(self) -> int:
        """:class:`memory_type` of the destination (0 while none is set)."""
        return 0 if self._dst is None else self._dst.kind

    @property
    def src_device(self) -> int:
        """The source's device address (0 unless the source is device memory); settable."""
        src = self._src
        return src.address if src is not None and src.kind == memory_type.DEVICE else 0

    @src_device.setter
    def src_device(self, devptr: Any) -> None:
        self.set_src_device(devptr)

    @property
    def dst_device(self) -> int:
        """The destination's device address (0 unless it is device memory); settable."""
        dst = self._dst
        return dst.address if dst is not None and dst.kind == memory_type.DEVICE else 0

    @dst_device.setter
    def dst_device(self, devptr: Any) -> None:
        self.set_dst_device(devptr)

    # -- the copy ---------------------------------------------------------------------------

    def _geometry(self, label: str) -> _Geometry:
        w, h = self.width_in_bytes, self.height
        for side in ("src", "dst"):
            pitch = getattr(self, side + "_pitch")
            if h > 1 and pitch < w:
                raise LogicError(f"{label}: {side}_pitch ({pitch}) is smaller than "
                                 f"width_in_bytes ({w})", code=_INVALID, operation=label)
        return _Geometry(w, h, 1,
                         self.src_x_in_bytes + self.src_y * self.src_pitch, self.src_pitch, 0,
                         self.dst_x_in_bytes + self.dst_y * self.dst_pitch, self.dst_pitch, 0)

    def __call__(self, aligned: Any = False) -> None:
        """``copy()`` or ``copy(aligned)``: copies and waits (``aligned`` is accepted and
        ignored: the daemon copies linear memory). ``copy(stream)``: queues the copy on the
        :class:`Stream` ``stream``.

        :raises LogicError: a side is missing, a pitch is smaller than ``width_in_bytes``, a
            side runs past the end of its allocation, host buffer or CUDA array, an offset or
            width into an array is not a multiple of its element size, a freed array, memory
            or an array of another session, or a stream of another session.
        """
        drv = _drv()
        if isinstance(aligned, drv.Stream):
            self._execute(aligned, False)
        elif aligned is None or isinstance(aligned, (bool, int, np.bool_, np.integer)):
            self._execute(None, True)
        else:
            raise TypeError(f"{type(self).__name__}(): expected a Stream (asynchronous copy) or "
                            f"a bool (aligned), got {type(aligned).__name__}")

    def _execute(self, stream: Optional["Stream"], sync: bool) -> None:
        label = type(self).__name__ if sync else f"{type(self).__name__}(stream)"
        src, dst = self._src, self._dst
        if src is None or dst is None:
            missing = "source" if src is None else "destination"
            kind = "src" if src is None else "dst"
            raise LogicError(f"{label}: no {missing} was set (call set_{kind}_host, "
                             f"set_{kind}_device or set_{kind}_array first)", code=_INVALID,
                             operation=label)
        if src.kind == memory_type.ARRAY or dst.kind == memory_type.ARRAY:
            from . import _arrays
            _arrays.execute_memcpy(self, src, dst, stream, sync, label)
            return
        geometry = self._geometry(label)
        core = self._session(src, dst, stream, label)
        stream_id = 0 if core is None else _stream_for(core, stream, label)
        if geometry.w == 0 or geometry.h == 0 or geometry.d == 0:
            return
        src_lo, src_hi = geometry.extent(geometry.src, geometry.src_pitch, geometry.src_slice)
        dst_lo, dst_hi = geometry.extent(geometry.dst, geometry.dst_pitch, geometry.dst_slice)
        for end, lo, hi, name in ((src, src_lo, src_hi, "source"),
                                  (dst, dst_lo, dst_hi, "destination")):
            if end.kind == memory_type.HOST:
                _check_host_range(end.view.nbytes, lo, hi, name, label)  # type: ignore
            else:
                assert core is not None
                _check_device_range(core, end.address, lo, hi, name, label)
        if src.kind == memory_type.HOST and dst.kind == memory_type.HOST:
            if stream is not None:
                stream.synchronize()  # stream order: after the work queued before
            _scatter(geometry, dst.view, src.view, 0)  # type: ignore[arg-type]
            return
        assert core is not None
        if src.kind == memory_type.DEVICE and dst.kind == memory_type.DEVICE:
            _copy_dtod(core, geometry, src.address, dst.address, stream_id, sync, label)
        elif dst.kind == memory_type.DEVICE:
            _copy_htod(core, geometry, src.view, dst.address, src_lo, src_hi,  # type: ignore
                       stream_id, sync, label)
        else:
            _copy_dtoh(core, geometry, src.address, dst.view, dst_lo, dst_hi,  # type: ignore
                       stream_id, sync, label)

    def _session(self, src: _Endpoint, dst: _Endpoint, stream: Any,
                 label: str) -> Optional[SessionCore]:
        """The session the copy runs in: the device sides' own, else the stream's, else the
        current context's; None for a host-to-host copy without a stream."""
        owners = [(name, e.owner) for name, e in (("source", src), ("destination", dst))
                  if e.kind in (memory_type.DEVICE, memory_type.ARRAY) and e.owner is not None]
        if len(owners) == 2 and owners[0][1] is not owners[1][1]:
            raise LogicError(f"{label}: the source is memory of gpurpc session "
                             f"{owners[0][1].session_id} and the destination of session "
                             f"{owners[1][1].session_id}; a copy stays within one session",
                             code=_INVALID, operation=label)
        if owners:
            return owners[0][1]
        if stream is not None:
            return stream._core
        if src.kind == memory_type.HOST and dst.kind == memory_type.HOST:
            return None
        return _context._current_core(label)


class Memcpy3D(Memcpy2D):
    """A pitched 3D copy (``pycuda.driver.Memcpy3D``): :class:`Memcpy2D` plus ``depth``
    slices; slice ``k`` of a side starts ``k * pitch * height`` bytes after the first, with
    ``src_height``/``dst_height`` the rows per slice of each side (needed when ``depth`` > 1),
    and ``src_z``/``dst_z`` the first slice (of a CUDA array: the first slice or layer).
    ``depth`` starts at 0, as in PyCUDA: set it. ``src_lod``/``dst_lod`` (levels of detail of
    mipmapped arrays, which are not served) must stay 0.
    """

    __slots__ = ("_src_z", "_src_height", "_src_lod", "_dst_z", "_dst_height", "_dst_lod",
                 "_depth")

    src_z = _Size()
    src_height = _Size()
    src_lod = _Size()
    dst_z = _Size()
    dst_height = _Size()
    dst_lod = _Size()
    depth = _Size()

    def __init__(self) -> None:
        super().__init__()
        for name in ("src_z", "src_height", "src_lod", "dst_z", "dst_height", "dst_lod",
                     "depth"):
            setattr(self, "_" + name, 0)

    def _geometry(self, label: str) -> _Geometry:
        w, h, d = self.width_in_bytes, self.height, self.depth
        for side in ("src", "dst"):
            if getattr(self, side + "_lod"):
                raise LogicError(f"{label}: {side}_lod applies to CUDA arrays' levels of "
                                 "detail (mipmapped arrays), which are not served; it must be 0",
                                 code=_INVALID, operation=label)
            pitch = getattr(self, side + "_pitch")
            if (h > 1 or d > 1) and pitch < w:
                raise LogicError(f"{label}: {side}_pitch ({pitch}) is smaller than "
                                 f"width_in_bytes ({w})", code=_INVALID, operation=label)
            rows = getattr(self, side + "_height")
            if d > 1 and rows < h:
                raise LogicError(f"{label}: {side}_height ({rows}) is smaller than height "
                                 f"({h}); it is the rows per slice of the {side} side",
                                 code=_INVALID, operation=label)
        src_slice = self.src_pitch * self.src_height
        dst_slice = self.dst_pitch * self.dst_height
        return _Geometry(
            w, h, d,
            self.src_x_in_bytes + self.src_y * self.src_pitch + self.src_z * src_slice,
            self.src_pitch, src_slice,
            self.dst_x_in_bytes + self.dst_y * self.dst_pitch + self.dst_z * dst_slice,
            self.dst_pitch, dst_slice)


def _region_of_view(core: SessionCore, view: memoryview, lo: int,
                    hi: int) -> Optional[Tuple[int, int]]:
    """``(region_id, offset of view byte lo)`` when bytes [lo, hi) of the host view lie in a
    live region of core's context."""
    mgr = core.caches.get(_regions._KEY)
    if mgr is None or not mgr.spans:
        return None
    found = mgr.find(_regions._address_of(view) + lo, hi - lo)
    return None if found is None else (found[0].region_id, found[1])


def _pitched_endpoint(address: int, pitch: int, slice_pitch: int,
                      geometry: _Geometry) -> Optional[_ex.Copy3DEndpoint]:
    """Linear device memory at ``address`` as a Copy3DCommand side, or None when the daemon's
    3D copy cannot express it (a pitch over its largest, slices that are not whole rows)."""
    if not geometry.w <= pitch <= _MAX_COPY_3D_PITCH:
        return None
    rows = geometry.h
    if geometry.d > 1:
        if slice_pitch % pitch:
            return None
        rows = slice_pitch // pitch
        if not geometry.h <= rows <= _MAX_COPY_3D_PITCH:
            return None
    return _ex.Copy3DEndpoint(device=device_pointer(address), pitch_bytes=pitch, height=rows)


def _copy_dtod(core: SessionCore, geometry: _Geometry, src: int, dst: int, stream_id: int,
               sync: bool, label: str) -> None:
    with core.lock:
        core.check_open(label)
        add = core.commands.add
        # Rows or slices apart (not one run): one 3D copy (cuMemcpy3DAsync), except on a
        # capturing stream, whose graph takes plain copies only (the daemon refuses it there).
        ends = (None, None)
        if not geometry.single and stream_id not in _streams.capturing_streams(core):
            ends = (_pitched_endpoint(dst + geometry.dst, geometry.dst_pitch, geometry.dst_slice,
                                      geometry),
                    _pitched_endpoint(src + geometry.src, geometry.src_pitch, geometry.src_slice,
                                      geometry))
        if ends[0] is not None and ends[1] is not None:
            add(label, auto=not sync, copy_3d=_core.copy_3d_command(
                ends[0], ends[1], geometry.w, geometry.h, geometry.d, stream_id))
        else:
            for s, d, n in geometry.runs():
                add(label, auto=not sync, copy=_ex.CopyCommand(
                    destination=device_pointer(dst + d), source=device_pointer(src + s),
                    size_bytes=n, stream_id=stream_id))
        if sync:
            core.commands.drain(label=label)


def _copy_htod(core: SessionCore, geometry: _Geometry, view: memoryview, dst: int, lo: int,
               hi: int, stream_id: int, sync: bool, label: str) -> None:
    if geometry.single:  # one run: memcpy_htod's path (regions, staging, streaming)
        _memory._upload(core, dst + geometry.dst, view[lo:hi], stream_id, sync, label)
        return
    with core.lock:
        core.check_open(label)
        commands = core.commands
        region = _region_of_view(core, view, lo, hi)
        chunk = _core.UPLOAD_CHUNK_BYTES
        for s, d, n in geometry.runs():
            if region is not None:
                _regions._queue_copy(commands, label, region[0], region[1] + s - lo, dst + d, n,
                                     True, stream_id, auto=not sync)
                continue
            for o in range(0, n, chunk):
                piece = view[s + o:s + min(o + chunk, n)].tobytes()
                commands.add(label, auto=not sync, payload_bytes=len(piece),
                             upload=_ex.UploadCommand(destination=device_pointer(dst + d + o),
                                                      data=piece, stream_id=stream_id))
        if sync:
            if region is not None:
                commands.sync(stream_id, label=label)  # the worker reads the region
            else:
                commands.drain(label=label)


def _copy_dtoh(core: SessionCore, geometry: _Geometry, src: int, view: memoryview, lo: int,
               hi: int, stream_id: int, sync: bool, label: str) -> None:
    if geometry.single:  # one run: memcpy_dtoh's path (regions, staging, streaming)
        _memory._download(core, src + geometry.src, view[lo:hi], stream_id, sync, label)
        return
    src_lo, src_hi = geometry.extent(geometry.src, geometry.src_pitch, geometry.src_slice)
    useful = geometry.w * geometry.h * geometry.d
    span = src_hi - src_lo
    with core.lock:
        core.check_open(label)
        commands = core.commands
        region = _region_of_view(core, view, lo, hi)
        if region is None and span <= 2 * useful and span <= _memory._DOWNLOAD_COMMAND_BYTES:
            # Dense rows: one download of the whole source span, scattered on arrival.
            commands.add(label, auto=not sync,
                         sink=functools.partial(_span_sink, geometry, view, src_lo, span),
                         download_bytes=span,
                         download=_ex.DownloadCommand(source=device_pointer(src + src_lo),
                                                      size_bytes=span, stream_id=stream_id))
        else:
            step = _memory._DOWNLOAD_COMMAND_BYTES
            for s, d, n in geometry.runs():
                if region is not None:
                    _regions._queue_copy(commands, label, region[0], region[1] + d - lo,
                                         src + s, n, False, stream_id, auto=not sync)
                    continue
                for o in range(0, n, step):
                    size = min(step, n - o)
                    commands.add(label, auto=not sync,
                                 sink=functools.partial(_memory._write_into, view, d + o, size),
                                 download_bytes=size,
                                 download=_ex.DownloadCommand(
                                     source=device_pointer(src + s + o), size_bytes=size,
                                     stream_id=stream_id))
        if sync:
            if region is not None:
                commands.sync(stream_id, label=label)  # the worker writes the region
            else:
                commands.drain(label=label)


# =============================================================================================
# Aligned host arrays

def _aligned(shape: Any, dtype: Any, order: str, alignment: Any, zero: bool,
             label: str) -> np.ndarray:
    alignment = _size(alignment, f"{label}: alignment")
    if alignment == 0:
        raise ValueError(f"{label}: alignment must be positive, got 0")
    if order not in ("C", "F"):
        raise ValueError(f"{label}: order must be 'C' or 'F', got {order!r}")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"{label}: an object dtype cannot live in raw aligned memory")
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        dims = (operator.index(shape),)
    if any(d < 0 for d in dims):
        raise ValueError(f"{label}: negative dimensions are not allowed: {dims}")
    drv = _drv()
    ctx = drv.Context.get_current()
    if ctx is not None and mmap.PAGESIZE % alignment == 0:
        # A region-backed array (fast DMA) starts on a page; plain memory when regions are off.
        array = _regions.host_array(ctx._core, dims, dtype, order, zero, label)
        if array.__array_interface__["data"][0] % alignment == 0:
            return array
    nbytes = dtype.itemsize
    for d in dims:
        nbytes *= d
    raw = (np.zeros if zero else np.empty)(nbytes + alignment, np.uint8)
    offset = (-raw.__array_interface__["data"][0]) % alignment
    return np.ndarray(dims, dtype, buffer=raw, offset=offset, order=order)


def _order_of(array: np.ndarray, label: str) -> str:
    if array.flags.c_contiguous:
        return "C"
    if array.flags.f_contiguous:
        return "F"
    raise ValueError(f"{label}: could not detect array order (the array is not contiguous)")


def aligned_empty(shape: Any, dtype: Any, order: str = "C", alignment: int = 4096) -> np.ndarray:
    """A host array whose data starts at a multiple of ``alignment`` bytes
    (``pycuda.driver.aligned_empty``); region-backed, like ``pagelocked_empty``, when the
    current context uses regions and ``alignment`` divides the page size."""
    return _aligned(shape, dtype, order, alignment, False, "aligned_empty")


def aligned_zeros(shape: Any, dtype: Any, order: str = "C", alignment: int = 4096) -> np.ndarray:
    """A zeroed :func:`aligned_empty`."""
    return _aligned(shape, dtype, order, alignment, True, "aligned_zeros")


def aligned_empty_like(array: np.ndarray, alignment: int = 4096) -> np.ndarray:
    """An :func:`aligned_empty` array of ``array`` 's shape, dtype and order (C or F)."""
    return _aligned(array.shape, array.dtype, _order_of(array, "aligned_empty_like"),
                    alignment, False, "aligned_empty_like")


def aligned_zeros_like(array: np.ndarray, alignment: int = 4096) -> np.ndarray:
    """A zeroed :func:`aligned_empty_like`."""
    return _aligned(array.shape, array.dtype, _order_of(array, "aligned_zeros_like"),
                    alignment, True, "aligned_zeros_like")
