"""PyCUDA's CUDA arrays (``pycuda.driver`` "Arrays and Textures"), served by gpurpcd.

``gpurpc.driver`` re-exports everything here (``__all__``); use it from there:

* :class:`array_format`, :class:`array3d_flags`, :class:`ArrayDescriptor`,
  :class:`ArrayDescriptor3D` and :class:`Array` (``MemoryService.Allocate`` with an
  ``ArrayDescriptor``; ``Array.handle`` is the daemon's id of the array);
* the unstructured copies :func:`memcpy_htoa`, :func:`memcpy_atoh` (and their ``_async``
  forms), :func:`memcpy_dtoa`, :func:`memcpy_atod` and :func:`memcpy_atoa`;
* the helpers :func:`dtype_to_array_format`, :func:`matrix_to_array`, :func:`np_to_array`,
  :func:`gpuarray_to_array` and :func:`make_multichannel_2d_array`;
* ``Memcpy2D``/``Memcpy3D`` (``gpurpc._driver_extras``) take arrays through
  ``set_src_array``/``set_dst_array``; the copy is run here.

How copies travel. A copy between an array and device memory, or between two arrays, is one
``Copy3DCommand`` on the session's command stream (stream ordered, batched like every other
command). The daemon has no host-to-array copy: a copy between host memory and an array goes
through a temporary device buffer of the session, as large as the copied bytes: the host bytes
are uploaded into it by the paths ``memcpy_htod`` uses (same-host regions, the staging region,
inline or streamed gRPC), then one ``Copy3DCommand`` moves them into the array (the reverse for
a download). The buffer counts against the tenant's device-memory quota while the copy runs;
a synchronous copy frees it before returning, an ``_async`` one at the session's next
synchronising call or allocation (after the work that uses it).

Offsets of the unstructured copies. ``index`` is a byte offset into the array's elements in
row-major order, rows of ``width * element size`` bytes without padding, then slices (or
layers) one after the other: for a 1D array it is CUDA's ``dstOffset``/``srcOffset``; for a 2D
or 3D array a range that crosses rows (``memcpy_htoa(ary, 0, matrix)`` of a whole matrix) is
copied as up to five box copies. ``index`` and the length must be multiples of the element
size.

Every copy is checked before anything is sent (sizes, offsets, that each array is alive and
belongs to the copy's session, that a device side lies within one live allocation and a host
side within its buffer): a violation raises :class:`LogicError` naming the side and what was
wrong, and nothing is copied. The daemon checks again (INVALID_ARGUMENT, NOT_FOUND for an
unknown or freed array id; both :class:`LogicError`).
"""
from __future__ import annotations

import builtins
import enum
import gc
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _context, _core, _driver_extras, _memory
from ._core import SessionCore
from ._driver_extras import _Endpoint, _Geometry, _Size, memory_type
from ._errors import LogicError, MemoryError
from .v1 import execution_service_pb2 as _ex, memory_service_pb2 as _mem

__all__ = [
    "array_format", "array3d_flags", "ArrayDescriptor", "ArrayDescriptor3D", "Array",
    "dtype_to_array_format", "matrix_to_array", "np_to_array", "gpuarray_to_array",
    "make_multichannel_2d_array",
    "memcpy_htoa", "memcpy_atoh", "memcpy_htoa_async", "memcpy_atoh_async",
    "memcpy_dtoa", "memcpy_atod", "memcpy_atoa",
]

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND

#: The largest width, height and depth the daemon serves (memory_service.proto); devices
#: allow less, and the driver refuses beyond the device's maxima.
MAX_EXTENT = 1 << 20
#: CUDA_ARRAY3D_LAYERED | SURFACE_LDST | CUBEMAP | TEXTURE_GATHER.
_FLAGS_SERVED = 0x1 | 0x2 | 0x4 | 0x8


class array_format(enum.IntEnum):  # noqa: N801 - PyCUDA's name
    """``CUarray_format`` (``pycuda.driver.array_format``): the element type of an array."""

    UNSIGNED_INT8 = 1
    UNSIGNED_INT16 = 2
    UNSIGNED_INT32 = 3
    SIGNED_INT8 = 8
    SIGNED_INT16 = 9
    SIGNED_INT32 = 10
    HALF = 16
    FLOAT = 32


#: ``CUDA_ARRAY3D_*`` flags (``pycuda.driver.array3d_flags``) of :class:`ArrayDescriptor3D`;
#: combine them with ``|``. ``2DARRAY`` is the old name of ``ARRAY3D_LAYERED`` (reach it with
#: ``getattr(array3d_flags, "2DARRAY")``, as in PyCUDA).
array3d_flags = enum.IntEnum(
    "array3d_flags",
    [("ARRAY3D_LAYERED", 1), ("2DARRAY", 1), ("SURFACE_LDST", 2), ("CUBEMAP", 4),
     ("TEXTURE_GATHER", 8)],
    module=__name__)
array3d_flags.__doc__ = ("``CUDA_ARRAY3D_*`` flags (``pycuda.driver.array3d_flags``): "
                         "ARRAY3D_LAYERED (alias 2DARRAY), SURFACE_LDST, CUBEMAP, TEXTURE_GATHER")

# Bytes of one channel of each format.
_FORMAT_BYTES = {1: 1, 2: 2, 3: 4, 8: 1, 9: 2, 10: 4, 16: 2, 32: 4}

_DTYPE_FORMATS = {
    np.dtype(np.uint8): array_format.UNSIGNED_INT8,
    np.dtype(np.uint16): array_format.UNSIGNED_INT16,
    np.dtype(np.uint32): array_format.UNSIGNED_INT32,
    np.dtype(np.int8): array_format.SIGNED_INT8,
    np.dtype(np.int16): array_format.SIGNED_INT16,
    np.dtype(np.int32): array_format.SIGNED_INT32,
    np.dtype(np.float16): array_format.HALF,
    np.dtype(np.float32): array_format.FLOAT,
}


def _format_name(value: int) -> str:
    try:
        return array_format(value).name
    except ValueError:
        return str(value)


def _format_list() -> str:
    return ", ".join(f"{m.name} = {int(m)}" for m in array_format)


# =============================================================================================
# Descriptors

class _Format:
    """The ``format`` attribute: an :class:`array_format` (an int that is none is kept, and
    refused by :class:`Array`, which names it)."""

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        return obj._format

    def __set__(self, obj: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{type(obj).__name__}.format must be an array_format, got "
                            f"{type(value).__name__}")
        value = int(value)
        try:
            obj._format = array_format(value)
        except ValueError:
            obj._format = value


class _DescriptorBase:
    __slots__ = ("_width", "_height", "_format", "_num_channels")

    width = _Size()
    height = _Size()
    format = _Format()
    num_channels = _Size()

    _FIELDS: Tuple[str, ...] = ("width", "height", "format", "num_channels")

    def __init__(self, **fields: Any) -> None:
        self._format: Any = 0
        for name in self._FIELDS:
            if name != "format":
                setattr(self, "_" + name, 0)
        for name, value in fields.items():
            if name not in self._FIELDS:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                                f"{name!r}")
            setattr(self, name, value)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        parts = []
        for name in self._FIELDS:
            value = getattr(self, name)
            if name == "format":
                value = f"array_format.{value.name}" if isinstance(value, array_format) else value
            parts.append(f"{name}={value}")
        return f"gpurpc.driver.{type(self).__name__}({', '.join(parts)})"


class ArrayDescriptor(_DescriptorBase):
    """The shape of a 1D or 2D array (``CUDA_ARRAY_DESCRIPTOR``,
    ``pycuda.driver.ArrayDescriptor``): ``width`` elements per row, ``height`` rows (0 for a
    1D array), ``format`` (an :class:`array_format`) and ``num_channels`` (1, 2 or 4).
    Set the attributes after ``ArrayDescriptor()``, or pass them as keywords."""

    __slots__ = ()


class ArrayDescriptor3D(_DescriptorBase):
    """The shape of any array (``CUDA_ARRAY3D_DESCRIPTOR``,
    ``pycuda.driver.ArrayDescriptor3D``): :class:`ArrayDescriptor`'s fields plus ``depth``
    (slices; layers with ``ARRAY3D_LAYERED``; 6 faces for a ``CUBEMAP``; 0 for 1D and 2D)
    and ``flags`` (:class:`array3d_flags` combined with ``|``)."""

    __slots__ = ("_depth", "_flags")

    depth = _Size()
    flags = _Size()

    _FIELDS = ("width", "height", "depth", "format", "num_channels", "flags")


Descriptor = Union[ArrayDescriptor, ArrayDescriptor3D]


def _descriptor_proto(descriptor: Any, label: str) -> _mem.ArrayDescriptor:
    """The wire form of a descriptor, checked against what the daemon serves."""
    if isinstance(descriptor, ArrayDescriptor3D):
        depth, flags = descriptor.depth, descriptor.flags
    elif isinstance(descriptor, ArrayDescriptor):
        depth = flags = 0
    else:
        raise TypeError(f"{label} takes an ArrayDescriptor or ArrayDescriptor3D, got "
                        f"{type(descriptor).__name__}")
    width, height = descriptor.width, descriptor.height
    fmt, channels = int(descriptor.format), descriptor.num_channels

    def refuse(why: str) -> LogicError:
        return LogicError(f"{label}: {why} (descriptor {descriptor!r})", code=_INVALID,
                          operation=label)

    if fmt not in _FORMAT_BYTES:
        raise refuse(f"format {fmt} is not an array_format ({_format_list()})" if fmt else
                     f"format is not set: give an array_format ({_format_list()})")
    if channels not in (1, 2, 4):
        raise refuse(f"num_channels must be 1, 2 or 4, got {channels}" +
                     (" (CUDA has no 3-channel arrays: use 4)" if channels == 3 else ""))
    if width == 0:
        raise refuse("width must be at least 1 element")
    for name, value in (("width", width), ("height", height), ("depth", depth)):
        if value > MAX_EXTENT:
            raise refuse(f"{name} {value} is larger than {MAX_EXTENT}, the most gpurpcd serves "
                         "(the device's own maxima are smaller)")
    if flags & ~_FLAGS_SERVED:
        raise refuse(f"flags 0x{flags:x} has bits other than ARRAY3D_LAYERED (1), "
                     "SURFACE_LDST (2), CUBEMAP (4) and TEXTURE_GATHER (8)")
    return _mem.ArrayDescriptor(width=width, height=height, depth=depth,
                                format=fmt,  # type: ignore[arg-type]
                                num_channels=channels, flags=flags)


# =============================================================================================
# Arrays

class Array:
    """A CUDA array (``pycuda.driver.Array``): opaque device memory laid out for texture
    hardware, created in the current context from an :class:`ArrayDescriptor` (1D, 2D) or
    :class:`ArrayDescriptor3D` (any, with flags). Kernels cannot address it; copy into and out
    of it with ``memcpy_*toa``/``memcpy_ato*`` and ``Memcpy2D``/``Memcpy3D``.

    ``handle`` is the daemon's id of the array (valid in its session only). The array is
    freed by :meth:`free`, at the end of a ``with`` block, or when garbage collected; it counts
    against the tenant's device-memory quota until then (as rows of ``width * element size``
    rounded up to 512 bytes, times the height padded as the driver's tiles are (1 for 1D),
    times the depth padded likewise; memory_service.proto has the rule). The driver's shape rules are checked by the daemon: a ``CUBEMAP`` is
    square with depth 6 (a multiple of 6 when layered), ``TEXTURE_GATHER`` is 2D only, a
    layered array has depth >= 1, and only a layered 1D array has depth without height.

    :raises LogicError: a descriptor the daemon does not serve (format, channels, extents,
        flags; the message names the field), or one the driver refuses.
    :raises MemoryError: not enough device memory, or over the tenant's quota (the message
        names it).
    """

    __slots__ = ("_core", "_id", "_shape", "_charged", "_finalizer", "__weakref__")

    def __init__(self, descriptor: Descriptor) -> None:
        label = "Array"
        proto = _descriptor_proto(descriptor, label)
        core = _context._current_core(label)
        info = _allocate(core, proto, label)
        self._init(core, info)

    def _init(self, core: SessionCore, info: _mem.BufferInfo) -> None:
        self._core = core
        self._id = int(info.buffer_id)
        shape = _mem.ArrayDescriptor()
        shape.CopyFrom(info.array)
        self._shape = shape
        self._charged = int(info.size_bytes)
        self._finalizer = weakref.finalize(self, core.defer_release, "buffer", self._id)
        self._finalizer.atexit = False

    @classmethod
    def _create(cls, core: SessionCore, descriptor: Descriptor, label: str) -> "Array":
        """An array in ``core``'s session (not necessarily the current context's)."""
        proto = _descriptor_proto(descriptor, label)
        array = cls.__new__(cls)
        array._init(core, _allocate(core, proto, label))
        return array

    @property
    def handle(self) -> int:
        """The daemon's id of the array (``Copy3DEndpoint.array_id``)."""
        return self._id

    def free(self) -> None:
        """Frees the array now (after the work queued before it that uses it). Freeing twice
        is a no-op; any other use afterwards raises :class:`LogicError`."""
        if self._finalizer.detach() is None:
            return
        core = self._core
        if core.closed:
            return
        with core.lock:
            core.drain()
            core.call("MemoryService.Free", _mem.FreeRequest(buffer_id=self._id),
                      op="Array.free")

    def __enter__(self) -> "Array":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def _check_alive(self, what: str, label: str) -> None:
        if not self._finalizer.alive:
            raise LogicError(f"{label}: {what} (array {self._id}) was freed; an Array cannot be "
                             "used after free()", code=_NOT_FOUND, operation=label)
        self._core.check_attached(label)

    def get_descriptor(self) -> ArrayDescriptor:
        """Width, height, format and channels (``cuArrayGetDescriptor``); of a 3D or
        layered array too (its depth and flags are in :meth:`get_descriptor_3d`)."""
        self._check_alive("the array", "Array.get_descriptor")
        s = self._shape
        return ArrayDescriptor(width=s.width, height=s.height, format=int(s.format),
                               num_channels=s.num_channels)

    def get_descriptor_3d(self) -> ArrayDescriptor3D:
        """Width, height, depth, format, channels and flags (``cuArray3DGetDescriptor``)."""
        self._check_alive("the array", "Array.get_descriptor_3d")
        s = self._shape
        return ArrayDescriptor3D(width=s.width, height=s.height, depth=s.depth,
                                 format=int(s.format), num_channels=s.num_channels,
                                 flags=s.flags)

    # -- geometry (bytes per row, rows per slice, slices) -----------------------------------

    @property
    def _element_bytes(self) -> int:
        return _FORMAT_BYTES[int(self._shape.format)] * self._shape.num_channels

    @property
    def _row_bytes(self) -> int:
        return self._shape.width * self._element_bytes

    @property
    def _rows(self) -> int:
        return max(self._shape.height, 1)

    @property
    def _slices(self) -> int:
        return max(self._shape.depth, 1)

    @property
    def _nbytes(self) -> int:
        return self._row_bytes * self._rows * self._slices

    def _describe(self) -> str:
        s = self._shape
        dims = [str(s.width)] + ([str(s.height)] if s.height or s.depth else []) + \
            ([str(s.depth)] if s.depth else [])
        flags = ""
        if s.flags:
            names = [m.name for m in array3d_flags if s.flags & int(m) and m.name != "2DARRAY"]
            flags = " " + "|".join(names)
        return (f"array {self._id}: {'x'.join(dims)} elements of {_format_name(s.format)} x "
                f"{s.num_channels} ({self._element_bytes} bytes each){flags}")

    def __repr__(self) -> str:
        state = "" if self._finalizer.alive else ", freed"
        return f"<gpurpc.driver.Array {self._describe()}{state}>"


def _allocate(core: SessionCore, proto: _mem.ArrayDescriptor, label: str) -> _mem.BufferInfo:
    """Creates the array, retrying once after freeing what garbage collection and the memory
    pools can give back (as ``mem_alloc`` does)."""
    with core.lock:
        core.check_open(label)
        if core.has_releases:
            core.drain()
            core.process_releases()
        try:
            return core.allocate_array(proto, op=label)
        except MemoryError:
            gc.collect()
            for release in list(core.caches.get("oom_handlers", ())):
                release()
            core.drain()
            core.process_releases()
            return core.allocate_array(proto, op=label)


def _array_arg(ary: Any, what: str, label: str) -> Array:
    if not isinstance(ary, Array):
        raise TypeError(f"{label}: {what} must be a gpurpc.driver.Array, got "
                        f"{type(ary).__name__}")
    return ary


def _check_session(array: Array, core: SessionCore, what: str, label: str) -> None:
    array._check_alive(what, label)
    if array._core is not core:
        raise LogicError(f"{label}: {what} (array {array._id}) belongs to gpurpc session "
                         f"{array._core.session_id}, but the copy runs in session "
                         f"{core.session_id}; an array is usable only in the session (context) "
                         "that created it", code=_INVALID, operation=label)


# =============================================================================================
# The copy engine

class _Side:
    """One side of a copy that involves an array: the array at element byte ``x`` of row
    ``y`` of slice ``z``, or linear memory (device or host) whose first byte is ``offset``
    bytes after ``address`` (host: byte ``offset`` of ``view``), rows ``pitch`` bytes and
    slices ``rows`` rows apart."""

    __slots__ = ("name", "kind", "array", "view", "address", "owner", "x", "y", "z", "offset",
                 "pitch", "rows")

    def __init__(self, name: str, kind: memory_type) -> None:
        self.name = name
        self.kind = kind
        self.array: Optional[Array] = None
        self.view: Optional[memoryview] = None
        self.address = 0
        self.owner: Optional[SessionCore] = None
        self.x = self.y = self.z = 0
        self.offset = self.pitch = self.rows = 0

    @classmethod
    def of_array(cls, name: str, array: Array, x: int, y: int, z: int) -> "_Side":
        side = cls(name, memory_type.ARRAY)
        side.array, side.owner = array, array._core
        side.x, side.y, side.z = x, y, z
        return side

    @classmethod
    def linear(cls, name: str, kind: memory_type, offset: int, pitch: int, rows: int,
               address: int = 0, view: Optional[memoryview] = None,
               owner: Optional[SessionCore] = None) -> "_Side":
        side = cls(name, kind)
        side.offset, side.pitch, side.rows = offset, pitch, rows
        side.address, side.view, side.owner = address, view, owner
        return side

    def extent(self, w: int, h: int, d: int) -> Tuple[int, int]:
        """[first byte, end) of a linear side, from its base."""
        return self.offset, self.offset + (d - 1) * self.pitch * self.rows + \
            (h - 1) * self.pitch + w


def _check_box(side: _Side, w: int, h: int, d: int, label: str) -> None:
    """The box [x, x + w) x [y, y + h) x [z, z + d) lies in the side's array."""
    array = side.array
    assert array is not None
    element = array._element_bytes

    def refuse(why: str) -> LogicError:
        return LogicError(f"{label}: the {side.name} ({array._describe()}): {why}; nothing was "
                          "copied", code=_INVALID, operation=label)

    if side.x % element:
        raise refuse(f"the x offset {side.x} bytes is not a multiple of the element size "
                     f"({element} bytes)")
    if w % element:
        raise refuse(f"the width {w} bytes is not a multiple of the element size ({element} "
                     "bytes)")
    if side.x + w > array._row_bytes:
        raise refuse(f"x {side.x} + width {w} bytes runs past the end of its rows of "
                     f"{array._row_bytes} bytes")
    if side.y + h > array._rows:
        raise refuse(f"y {side.y} + height {h} rows runs past its {array._rows} rows")
    if side.z + d > array._slices:
        raise refuse(f"z {side.z} + depth {d} runs past its {array._slices} "
                     f"{'layers' if array._shape.flags & 1 else 'slices'}")


def _endpoint(side: _Side, temp: int, h: int, d: int) -> _ex.Copy3DEndpoint:
    if side.kind == memory_type.ARRAY:
        assert side.array is not None
        return _core.copy_3d_array_end(side.array._id, side.x, side.y, side.z)
    # Linear: the pitch matters with several rows or slices, the slice height with several
    # slices (0 = the copy's own, which the daemon takes as it is).
    base = temp if side.kind == memory_type.HOST else side.address
    return _core.copy_3d_linear_end(base + side.offset, side.pitch if h > 1 or d > 1 else 0,
                                    side.rows if d > 1 else 0)


class _Piece:
    """One Copy3DCommand of a copy."""

    __slots__ = ("dst", "src", "w", "h", "d")

    def __init__(self, dst: _Side, src: _Side, w: int, h: int, d: int) -> None:
        self.dst, self.src, self.w, self.h, self.d = dst, src, w, h, d


def _temp_buffer(core: SessionCore, nbytes: int, label: str) -> Any:
    try:
        return _memory._alloc(core, nbytes)
    except MemoryError as e:
        raise MemoryError(f"{label}: a copy between host memory and a CUDA array goes through a "
                          f"device buffer as large as the copy ({nbytes} bytes), and there is "
                          f"no room for it: {e}", code=e.code, details=e.details,
                          operation=label) from None


def _run(core: SessionCore, label: str, stream_id: int, sync: bool, pieces: Sequence[_Piece],
         temp_bytes: int = 0, stage_in: Optional[Tuple[memoryview, _Geometry]] = None,
         stage_out: Optional[Tuple[memoryview, _Geometry]] = None) -> None:
    """Queues the pieces (HOST sides stand for a temporary device buffer of ``temp_bytes``,
    filled from ``stage_in`` first or emptied into ``stage_out`` after) and, when ``sync``,
    waits as PyCUDA's synchronous copies do."""
    with core.lock:
        core.check_open(label)
        temp = _temp_buffer(core, temp_bytes, label) if temp_bytes else None
        taddr = 0 if temp is None else temp._ptr
        done = False
        try:
            commands = core.commands
            if stage_in is not None:
                view, geometry = stage_in
                lo, hi = geometry.extent(geometry.src, geometry.src_pitch, geometry.src_slice)
                _driver_extras._copy_htod(core, geometry, view, taddr, lo, hi, stream_id, False,
                                          label)
            for p in pieces:
                commands.add(label, auto=not sync, copy_3d=_core.copy_3d_command(
                    _endpoint(p.dst, taddr, p.h, p.d), _endpoint(p.src, taddr, p.h, p.d),
                    p.w, p.h, p.d, stream_id))
            if stage_out is not None:
                view, geometry = stage_out
                lo, hi = geometry.extent(geometry.dst, geometry.dst_pitch, geometry.dst_slice)
                _driver_extras._copy_dtoh(core, geometry, taddr, view, lo, hi, stream_id, sync,
                                          label)
            elif sync:
                if stage_in is not None:
                    # A region copy reads the host buffer when the stream gets there.
                    commands.sync(stream_id, label=label)
                else:
                    commands.drain(label=label)
            done = True
        finally:
            if temp is not None:
                if done and sync:
                    temp.free()
                else:
                    # Freed at the next synchronising call or allocation, after a drain (the
                    # daemon lets the queued work that uses it finish first).
                    temp._finalizer()


def _copy_sides(core: SessionCore, src: _Side, dst: _Side, w: int, h: int, d: int,
                stream_id: int, sync: bool, label: str) -> None:
    """A box copy of ``d`` slices of ``h`` rows of ``w`` bytes where one side at least is an
    array: checks both sides, then one Copy3DCommand (via a temporary buffer for a host
    side)."""
    for side in (src, dst):
        if side.kind == memory_type.ARRAY:
            assert side.array is not None
            _check_session(side.array, core, f"the {side.name} array", label)
    if w == 0 or h == 0 or d == 0:
        return
    for side in (src, dst):
        if side.kind == memory_type.ARRAY:
            _check_box(side, w, h, d, label)
        else:
            lo, hi = side.extent(w, h, d)
            if side.kind == memory_type.HOST:
                assert side.view is not None
                _driver_extras._check_host_range(side.view.nbytes, lo, hi, side.name, label)
            else:
                _driver_extras._check_device_range(core, side.address, lo, hi, side.name,
                                                   label)
    if src.kind == memory_type.HOST:
        # Host rows -> a dense temporary buffer (w * h * d) -> the array.
        assert src.view is not None
        staged = _Side.linear(src.name, memory_type.HOST, 0, w, h)
        geometry = _Geometry(w, h, d, src.offset, src.pitch, src.pitch * src.rows,
                             0, w, w * h)
        _run(core, label, stream_id, sync, [_Piece(dst, staged, w, h, d)], w * h * d,
             stage_in=(src.view, geometry))
    elif dst.kind == memory_type.HOST:
        assert dst.view is not None
        staged = _Side.linear(dst.name, memory_type.HOST, 0, w, h)
        geometry = _Geometry(w, h, d, 0, w, w * h, dst.offset, dst.pitch,
                             dst.pitch * dst.rows)
        _run(core, label, stream_id, sync, [_Piece(staged, src, w, h, d)], w * h * d,
             stage_out=(dst.view, geometry))
    else:
        _run(core, label, stream_id, sync, [_Piece(dst, src, w, h, d)])


def execute_memcpy(copy: Any, src: _Endpoint, dst: _Endpoint, stream: Any, sync: bool,
                   label: str) -> None:
    """Runs a ``Memcpy2D``/``Memcpy3D`` one of whose sides is an array (called by
    ``Memcpy2D._execute``)."""
    w, h = copy.width_in_bytes, copy.height
    is_3d = hasattr(copy, "depth")
    d = copy.depth if is_3d else 1
    sides = []
    for prefix, name, end in (("src", "source", src), ("dst", "destination", dst)):
        x = getattr(copy, prefix + "_x_in_bytes")
        y = getattr(copy, prefix + "_y")
        z = getattr(copy, prefix + "_z") if is_3d else 0
        if is_3d and getattr(copy, prefix + "_lod"):
            raise LogicError(f"{label}: {prefix}_lod applies to CUDA arrays' levels of detail "
                             "(mipmapped arrays), which are not served; it must be 0",
                             code=_INVALID, operation=label)
        if end.kind == memory_type.ARRAY:
            sides.append(_Side.of_array(name, end.obj, x, y, z))
            continue
        pitch = getattr(copy, prefix + "_pitch")
        rows = getattr(copy, prefix + "_height") if is_3d else h
        if (h > 1 or d > 1) and pitch < w:
            raise LogicError(f"{label}: {prefix}_pitch ({pitch}) is smaller than "
                             f"width_in_bytes ({w})", code=_INVALID, operation=label)
        if d > 1 and rows < h:
            raise LogicError(f"{label}: {prefix}_height ({rows}) is smaller than height ({h}); "
                             f"it is the rows per slice of the {prefix} side", code=_INVALID,
                             operation=label)
        offset = x + y * pitch + z * pitch * rows
        sides.append(_Side.linear(name, end.kind, offset, pitch, rows, address=end.address,
                                  view=end.view, owner=end.owner))
    core = copy._session(src, dst, stream, label)
    assert core is not None
    stream_id = _driver_extras._stream_for(core, stream, label)
    _copy_sides(core, sides[0], sides[1], w, h, d, stream_id, sync, label)


# -- unstructured copies: a byte range of an array in row-major order ---------------------------

def _check_range(array: Array, index: int, n: int, what: str, label: str) -> None:
    element = array._element_bytes

    def refuse(why: str) -> LogicError:
        return LogicError(f"{label}: the {what} ({array._describe()}): {why}; nothing was "
                          "copied", code=_INVALID, operation=label)

    if index % element:
        raise refuse(f"the index {index} is not a multiple of the element size ({element} "
                     "bytes)")
    if n % element:
        raise refuse(f"the length {n} bytes is not a multiple of the element size ({element} "
                     "bytes)")
    if index + n > array._nbytes:
        raise refuse(f"bytes {index} to {index + n} run past its end: it holds "
                     f"{array._nbytes} bytes ({index + n - array._nbytes} bytes too far)")


def _range_boxes(array: Array, index: int, n: int) -> List[Tuple[int, int, int, int, int, int,
                                                                int]]:
    """The boxes ``(x, y, z, w, h, d, offset)`` that cover bytes [index, index + n) of the
    array in row-major order (``offset``: of the box's first byte from ``index``): at most a
    partial row, whole rows, whole slices, whole rows and a partial row."""
    row, rows = array._row_bytes, array._rows
    slice_bytes = row * rows
    boxes = []
    pos, end = index, index + n
    while pos < end:
        z, rest = divmod(pos, slice_bytes)
        y, x = divmod(rest, row)
        if x or end - pos < row:
            w = min(row - x, end - pos)
            boxes.append((x, y, z, w, 1, 1, pos - index))
            pos += w
        elif y or end - pos < slice_bytes:
            k = min(rows - y, (end - pos) // row)
            boxes.append((0, y, z, row, k, 1, pos - index))
            pos += k * row
        else:
            k = (end - pos) // slice_bytes
            boxes.append((0, 0, z, row, rows, k, pos - index))
            pos += k * slice_bytes
    return boxes


def _range_pieces(array: Array, index: int, n: int, linear: _Side,
                  to_array: bool) -> List[_Piece]:
    """Pieces between bytes [index, index + n) of the array and a dense linear range (the
    ``linear`` side's offset is that of the range's first byte)."""
    pieces = []
    for x, y, z, w, h, d, offset in _range_boxes(array, index, n):
        side = _Side.of_array(linear.name, array, x, y, z)
        dense = _Side.linear(linear.name, linear.kind, linear.offset + offset, array._row_bytes,
                             array._rows, address=linear.address)
        pieces.append(_Piece(side, dense, w, h, d) if to_array else _Piece(dense, side, w, h, d))
    return pieces


def _index(value: Any, what: str) -> int:
    return _driver_extras._size(value, what)


def _host_to_array(ary: Any, index: Any, src: Any, stream: Any, sync: bool,
                   label: str) -> None:
    array = _array_arg(ary, "ary", label)
    core = array._core
    index = _index(index, f"{label}: index")
    if _driver_extras._is_device_like(src):
        raise TypeError(f"{label}: src must be a host buffer, got {type(src).__name__}, which "
                        "is device memory; use memcpy_dtoa")
    view = _memory._readable(src)
    stream_id = _driver_extras._stream_for(core, stream, label)
    _check_session(array, core, "the destination array", label)
    n = view.nbytes
    _check_range(array, index, n, "destination", label)
    if n == 0:
        return
    staged = _Side.linear("source", memory_type.HOST, 0, 0, 0)
    _run(core, label, stream_id, sync, _range_pieces(array, index, n, staged, True), n,
         stage_in=(view, _Geometry(n, 1, 1, 0, 0, 0, 0, 0, 0)))


def _array_to_host(dest: Any, ary: Any, index: Any, stream: Any, sync: bool,
                   label: str) -> None:
    array = _array_arg(ary, "ary", label)
    core = array._core
    index = _index(index, f"{label}: index")
    if _driver_extras._is_device_like(dest):
        raise TypeError(f"{label}: dest must be a host buffer, got {type(dest).__name__}, "
                        "which is device memory; use memcpy_atod")
    view = _memory._writable(dest, label)
    stream_id = _driver_extras._stream_for(core, stream, label)
    _check_session(array, core, "the source array", label)
    n = view.nbytes
    _check_range(array, index, n, "source", label)
    if n == 0:
        return
    staged = _Side.linear("destination", memory_type.HOST, 0, 0, 0)
    _run(core, label, stream_id, sync, _range_pieces(array, index, n, staged, False), n,
         stage_out=(view, _Geometry(n, 1, 1, 0, 0, 0, 0, 0, 0)))


def _device_side(devptr: Any, core: SessionCore, name: str, label: str) -> _Side:
    if isinstance(devptr, (np.ndarray, bytes, bytearray, memoryview)):
        raise TypeError(f"{label}: the {name} must be device memory (DeviceAllocation, int "
                        f"address, GPUArray), got host memory ({type(devptr).__name__})")
    if isinstance(devptr, Array):
        raise TypeError(f"{label}: the {name} must be linear device memory, got an Array; use "
                        "memcpy_atoa")
    address = _memory._address(devptr)
    owner = _memory._owner_core(devptr)
    if owner is not None and owner is not core:
        raise LogicError(f"{label}: the {name} is memory of gpurpc session {owner.session_id}, "
                         f"but the array belongs to session {core.session_id}; a copy stays "
                         "within one session", code=_INVALID, operation=label)
    return _Side.linear(name, memory_type.DEVICE, 0, 0, 0, address=address, owner=owner)


def memcpy_htoa(ary: Array, index: int, src: Any) -> None:
    """Copies the host buffer ``src`` (all of it) into ``ary`` from byte ``index``
    (``cuMemcpyHtoA``; see the module docstring for 2D and 3D arrays)."""
    _host_to_array(ary, index, src, None, True, "memcpy_htoa")


def memcpy_htoa_async(ary: Array, index: int, src: Any, stream: Any = None) -> None:
    """Queues :func:`memcpy_htoa` on ``stream``: the bytes are taken at once (from a
    region-backed ``pagelocked_*`` array: when the stream gets there)."""
    _host_to_array(ary, index, src, stream, False, "memcpy_htoa_async")


def memcpy_atoh(dest: Any, ary: Array, index: int) -> None:
    """Copies ``dest.nbytes`` bytes of ``ary`` from byte ``index`` into the host buffer
    ``dest`` (``cuMemcpyAtoH``)."""
    _array_to_host(dest, ary, index, None, True, "memcpy_atoh")


def memcpy_atoh_async(dest: Any, ary: Array, index: int, stream: Any = None) -> None:
    """Queues :func:`memcpy_atoh` on ``stream``; ``dest`` is filled when the stream (or
    context) is synchronised. Keep it alive until then."""
    _array_to_host(dest, ary, index, stream, False, "memcpy_atoh_async")


def memcpy_dtoa(ary: Array, index: int, src: Any, len: int) -> None:  # noqa: A002
    """Copies ``len`` bytes from device memory ``src`` into ``ary`` from byte ``index``
    (``cuMemcpyDtoA``)."""
    label = "memcpy_dtoa"
    array = _array_arg(ary, "ary", label)
    core = array._core
    index = _index(index, f"{label}: index")
    n = _index(len, f"{label}: len")
    side = _device_side(src, core, "source", label)
    _check_session(array, core, "the destination array", label)
    _check_range(array, index, n, "destination", label)
    if n == 0:
        return
    _driver_extras._check_device_range(core, side.address, 0, n, "source", label)
    _run(core, label, 0, True, _range_pieces(array, index, n, side, True))


def memcpy_atod(dest: Any, ary: Array, index: int, len: int) -> None:  # noqa: A002
    """Copies ``len`` bytes of ``ary`` from byte ``index`` to device memory ``dest``
    (``cuMemcpyAtoD``)."""
    label = "memcpy_atod"
    array = _array_arg(ary, "ary", label)
    core = array._core
    index = _index(index, f"{label}: index")
    n = _index(len, f"{label}: len")
    side = _device_side(dest, core, "destination", label)
    _check_session(array, core, "the source array", label)
    _check_range(array, index, n, "source", label)
    if n == 0:
        return
    _driver_extras._check_device_range(core, side.address, 0, n, "destination", label)
    _run(core, label, 0, True, _range_pieces(array, index, n, side, False))


def memcpy_atoa(dest: Array, dest_index: int, src: Array, src_index: int,
                len: int) -> None:  # noqa: A002
    """Copies ``len`` bytes from ``src`` (from byte ``src_index``) to ``dest`` (from byte
    ``dest_index``) (``cuMemcpyAtoA``). Ranges within one row of each array are one copy;
    others go through a temporary device buffer."""
    label = "memcpy_atoa"
    dst_array = _array_arg(dest, "dest", label)
    src_array = _array_arg(src, "src", label)
    core = dst_array._core
    dest_index = _index(dest_index, f"{label}: dest_index")
    src_index = _index(src_index, f"{label}: src_index")
    n = _index(len, f"{label}: len")
    _check_session(dst_array, core, "the destination array", label)
    _check_session(src_array, core, "the source array", label)
    _check_range(dst_array, dest_index, n, "destination", label)
    _check_range(src_array, src_index, n, "source", label)
    if n == 0:
        return
    dst_boxes = _range_boxes(dst_array, dest_index, n)
    src_boxes = _range_boxes(src_array, src_index, n)
    if _one_row(dst_boxes) and _one_row(src_boxes):
        dx, dy, dz = dst_boxes[0][:3]
        sx, sy, sz = src_boxes[0][:3]
        _run(core, label, 0, True, [_Piece(_Side.of_array("destination", dst_array, dx, dy, dz),
                                           _Side.of_array("source", src_array, sx, sy, sz),
                                           n, 1, 1)])
        return
    # Through a dense temporary buffer (queued and waited for as one batch).
    temp = _Side.linear("temporary buffer", memory_type.HOST, 0, 0, 0)
    pieces = _range_pieces(src_array, src_index, n, temp, False) + \
        _range_pieces(dst_array, dest_index, n, temp, True)
    _run(core, label, 0, True, pieces, n)


def _one_row(boxes: Sequence[Tuple[int, ...]]) -> bool:
    """Whether the boxes are one box within one row."""
    return builtins.len(boxes) == 1 and boxes[0][4] == 1 and boxes[0][5] == 1


# =============================================================================================
# numpy and GPUArray helpers

def dtype_to_array_format(dtype: Any) -> array_format:
    """The :class:`array_format` of a numpy dtype (``pycuda.driver.dtype_to_array_format``):
    uint8/16/32, int8/16/32 and float32, and float16 as HALF (which PyCUDA lacks).

    :raises TypeError: any other dtype.
    """
    dt = np.dtype(dtype)
    fmt = _DTYPE_FORMATS.get(dt)  # a non-native byte order has none: its values would be wrong
    if fmt is None:
        raise TypeError(f"cannot convert dtype '{dt}' to array format (uint8/16/32, "
                        "int8/16/32, float16 and float32 have one)")
    return fmt


def _order(order: Any, label: str) -> str:
    text = order.upper() if isinstance(order, str) else order
    if text not in ("C", "F"):
        raise LogicError(f"{label}: order must be either F or C, got {order!r}", code=_INVALID,
                         operation=label)
    return text


def _element_format(dtype: np.dtype, label: str) -> Tuple[int, int]:
    """(format, channels) of np_to_array/gpuarray_to_array: PyCUDA reads float64 and
    complex64 as two SIGNED_INT32 channels, complex128 as four."""
    if dtype == np.float64 or dtype == np.complex64:
        return array_format.SIGNED_INT32, 2
    if dtype == np.complex128:
        return array_format.SIGNED_INT32, 4
    return dtype_to_array_format(dtype), 1


def matrix_to_array(matrix: Any, order: str, allow_double_hack: bool = False) -> Array:
    """A 2D array holding ``matrix`` (``pycuda.driver.matrix_to_array``). Order "C": the
    matrix is (height, width), element (x, y) of the array is ``matrix[y, x]``; order "F":
    it is (width, height), element (x, y) is ``matrix[x, y]``. With ``allow_double_hack``
    a float64 matrix becomes two SIGNED_INT32 channels per element (``int2``).
    """
    label = "matrix_to_array"
    order = _order(order, label)
    matrix = np.asarray(matrix, order=order)  # type: ignore[call-overload]
    if matrix.ndim != 2:
        raise ValueError(f"{label}: expected a 2-d matrix, got shape {matrix.shape}")
    _not_empty(matrix.shape, label)
    if order == "C":
        h, w = matrix.shape
    else:
        w, h = matrix.shape
    if matrix.dtype == np.float64 and allow_double_hack:
        fmt, channels = array_format.SIGNED_INT32, 2
    else:
        fmt, channels = dtype_to_array_format(matrix.dtype), 1
    ary = Array(ArrayDescriptor(width=w, height=h, format=fmt, num_channels=channels))
    _fill_2d(ary, matrix, w * matrix.itemsize, h)
    return ary


def make_multichannel_2d_array(ndarray: Any, order: str) -> Array:
    """A 2D array of ``ndarray``'s channels (``pycuda.driver.make_multichannel_2d_array``):
    order "C": shape (height, width, channels); order "F": (channels, width, height).
    Channels must be 1, 2 or 4."""
    label = "make_multichannel_2d_array"
    order = _order(order, label)
    ndarray = np.asarray(ndarray, order=order)  # type: ignore[call-overload]
    if ndarray.ndim != 3:
        raise ValueError(f"{label}: expected a 3-d array, got shape {ndarray.shape}")
    _not_empty(ndarray.shape, label)
    if order == "C":
        h, w, channels = ndarray.shape
    else:
        channels, w, h = ndarray.shape
    ary = Array(ArrayDescriptor(width=w, height=h, format=dtype_to_array_format(ndarray.dtype),
                                num_channels=channels))
    _fill_2d(ary, ndarray, w * channels * ndarray.itemsize, h)
    return ary


def _fill_2d(ary: Array, host: np.ndarray, row_bytes: int, h: int) -> None:
    copy = _driver_extras.Memcpy2D()
    copy.set_src_host(host)
    copy.set_dst_array(ary)
    copy.width_in_bytes = copy.src_pitch = copy.dst_pitch = row_bytes
    copy.height = h
    copy(aligned=True)


def _not_empty(shape: Tuple[int, ...], label: str) -> None:
    if 0 in shape:
        raise LogicError(f"{label}: an array of shape {shape} is empty; a CUDA array has at "
                         "least one element", code=_INVALID, operation=label)


def _array_shape(shape: Tuple[int, ...], order: str, label: str) -> Tuple[int, int, int]:
    _not_empty(shape, label)
    if len(shape) == 2:
        h, w = shape if order == "C" else shape[::-1]
        return w, h, 1
    if len(shape) == 3:
        d, h, w = shape if order == "C" else shape[::-1]
        return w, h, d
    raise LogicError(f"{label}: cannot convert an array with {len(shape)} dimensions (2 or 3 "
                     "are)", code=_INVALID, operation=label)


def _descriptor_for(w: int, h: int, d: int, ndim: int, fmt: int, channels: int,
                    allow_surface_bind: bool, layered: bool) -> Descriptor:
    flags = (int(array3d_flags.SURFACE_LDST) if allow_surface_bind else 0) | \
        (int(array3d_flags.ARRAY3D_LAYERED) if layered else 0)
    if ndim == 2 and not allow_surface_bind:
        # As PyCUDA: a plain 2D array (its layered flag has no 2D descriptor to go to).
        return ArrayDescriptor(width=w, height=h, format=fmt, num_channels=channels)
    return ArrayDescriptor3D(width=w, height=h, depth=d, format=fmt, num_channels=channels,
                             flags=flags)


def np_to_array(nparray: Any, order: str, allowSurfaceBind: bool = False,  # noqa: N803
                layered: bool = False) -> Array:
    """A 2D or 3D array holding ``nparray`` (``pycuda.driver.np_to_array``).

    Order "C": the shape is (height, width) or (depth, height, width) and element (x, y, z)
    of the array is ``nparray[z, y, x]``; order "F": the shape is (width, height[, depth])
    and element (x, y, z) is ``nparray[x, y, z]``, as for :func:`matrix_to_array` (PyCUDA
    reads the shape as (height, width) in both orders, which agrees for square arrays only).
    The data is laid out in the given order first when it is not already.
    ``allowSurfaceBind`` adds SURFACE_LDST (and makes a 2D array a 3D descriptor of depth 1);
    ``layered`` makes a 3D array (and a 2D one with ``allowSurfaceBind``) layered. float64
    and complex64 become two SIGNED_INT32 channels, complex128 four.
    """
    label = "np_to_array"
    order = _order(order, label)
    nparray = np.asarray(nparray, order=order)  # type: ignore[call-overload]
    w, h, d = _array_shape(nparray.shape, order, label)
    fmt, channels = _element_format(nparray.dtype, label)
    ary = Array(_descriptor_for(w, h, d, nparray.ndim, fmt, channels, allowSurfaceBind, layered))
    row = w * nparray.itemsize
    if nparray.ndim == 2 and not allowSurfaceBind:
        _fill_2d(ary, nparray, row, h)
        return ary
    copy = _driver_extras.Memcpy3D()
    copy.set_src_host(nparray)
    copy.set_dst_array(ary)
    copy.width_in_bytes = copy.src_pitch = row
    copy.src_height = copy.height = h
    copy.depth = d
    copy()
    return ary


def gpuarray_to_array(gpuarray: Any, order: str, allowSurfaceBind: bool = False,  # noqa: N803
                      layered: bool = False) -> Array:
    """:func:`np_to_array` for a ``GPUArray`` (``pycuda.driver.gpuarray_to_array``): one
    device-to-array copy. A view whose rows (and slices) are evenly spaced is copied as it is;
    any other layout is first made contiguous in ``order`` on the device. The array is made
    in the GPUArray's session."""
    label = "gpuarray_to_array"
    order = _order(order, label)
    shape = tuple(int(n) for n in gpuarray.shape)
    w, h, d = _array_shape(shape, order, label)
    dtype = np.dtype(gpuarray.dtype)
    fmt, channels = _element_format(dtype, label)
    itemsize = dtype.itemsize
    strides = _pitched_strides(shape, tuple(int(s) for s in gpuarray.strides), itemsize, order)
    if strides is None:
        gpuarray = gpuarray.reshape(shape, order=order)  # a contiguous copy in that order
        strides = _pitched_strides(shape, tuple(int(s) for s in gpuarray.strides), itemsize,
                                   order)
        assert strides is not None
    pitch, slice_rows = strides
    core = _memory._owner_core(gpuarray) or _context._current_core(label)
    ary = Array._create(core, _descriptor_for(w, h, d, len(shape), fmt, channels,
                                              allowSurfaceBind, layered), label)
    copy = _driver_extras.Memcpy3D()
    copy.set_src_device(gpuarray)
    copy.set_dst_array(ary)
    copy.width_in_bytes = w * itemsize
    copy.src_pitch = pitch
    copy.height = h
    copy.src_height = slice_rows
    copy.depth = d
    copy()
    return ary


def _pitched_strides(shape: Tuple[int, ...], strides: Tuple[int, ...], itemsize: int,
                     order: str) -> Optional[Tuple[int, int]]:
    """``(pitch, rows per slice)`` when the elements lie as rows of a pitched copy (x the
    last axis for order C, the first for F), else None."""
    if order == "F":
        shape, strides = shape[::-1], strides[::-1]
    w = shape[-1]
    h = shape[-2]
    if w > 1 and strides[-1] != itemsize:
        return None
    pitch = strides[-2] if h > 1 else w * itemsize
    if pitch < w * itemsize:
        return None
    if len(shape) == 2 or shape[0] == 1:
        return pitch, h
    slice_stride = strides[0]
    if pitch == 0 or slice_stride % pitch or slice_stride // pitch < h:
        return None
    return pitch, slice_stride // pitch


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
