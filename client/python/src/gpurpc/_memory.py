"""Device memory and host buffers for :mod:`gpurpc.driver`.

Pointers (:class:`DeviceAllocation`, :class:`PointerHolderBase`, ``_address``), which session
a pointer belongs to (the allocation registry), host buffer views, allocation, the transfers
(``_upload``/``_download``, streamed for large ones, in parts on several connections for the
largest), ``memcpy_*``/``memset_*`` and the ``pagelocked_*`` arrays. ``gpurpc.driver``
re-exports the public names; use them from there.
"""
from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any, Callable, Iterator, List, Literal, Optional, Tuple

import grpc
import numpy as np

from . import _core, _progress, _regions
from ._core import SessionCore, device_pointer
from ._context import Context, _current_core
from ._errors import Error, LogicError, MemoryError, timeout_error
from ._streams import Stream, _stream_id
from .v1 import execution_service_pb2 as _ex, memory_service_pb2 as _mem

__all__ = [
    "PointerHolderBase", "DeviceAllocation", "mem_alloc", "mem_alloc_like", "mem_get_info",
    "memcpy_htod", "memcpy_htod_async", "memcpy_dtoh", "memcpy_dtoh_async", "memcpy_dtod",
    "memcpy_dtod_async", "memset_d8", "memset_d16", "memset_d32", "memset_d8_async",
    "memset_d16_async", "memset_d32_async", "to_device", "from_device", "from_device_like",
    "pagelocked_empty", "pagelocked_zeros", "pagelocked_empty_like", "pagelocked_zeros_like",
    "set_transfer_progress",
]


# =============================================================================================
# Pointers and host buffers

class PointerHolderBase:
    """Subclass and implement ``get_pointer()`` to pass your own objects as device pointers."""

    def get_pointer(self) -> int:
        """The device address this object stands for."""
        raise NotImplementedError

    def __int__(self) -> int:
        return int(self.get_pointer())

    __index__ = __int__


class DeviceAllocation:
    """Device memory from :func:`mem_alloc` (``pycuda.driver.DeviceAllocation``).

    ``int(alloc)`` is the device address, valid for pointer arithmetic (``int(a) + 16``),
    in structs uploaded to the device, and anywhere this module takes a device pointer.
    The memory is freed by :meth:`free` or when the object is garbage collected.
    """

    __slots__ = ("_core", "_id", "_ptr", "_size", "_finalizer", "__weakref__")

    def __init__(self, core: SessionCore, buffer_id: int, address: int, size: int) -> None:
        self._core = core
        self._id = buffer_id
        self._ptr = address
        self._size = size
        self._finalizer = weakref.finalize(self, core.defer_release, "buffer", buffer_id)
        self._finalizer.atexit = False

    def __int__(self) -> int:
        return self._ptr

    __index__ = __int__

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    @property
    def buffer_id(self) -> int:
        """The daemon's handle for this buffer."""
        return self._id

    def free(self) -> None:
        """Frees the memory now (after the work queued before it). Freeing twice is a no-op."""
        if self._finalizer.detach() is None:
            return
        core = self._core
        if core.closed:
            return
        with core.lock:
            core.drain()
            core.call("MemoryService.Free", _mem.FreeRequest(buffer_id=self._id),
                      op="DeviceAllocation.free")

    def as_buffer(self, size: int, offset: int = 0) -> Any:
        """Not available: raises LogicError."""
        raise LogicError("DeviceAllocation.as_buffer is not available: device memory of a remote "
                         "daemon cannot be mapped into this process")

    def __repr__(self) -> str:
        return f"<gpurpc.driver.DeviceAllocation 0x{self._ptr:x} ({self._size} bytes)>"


def _address(obj: Any, what: str = "device pointer") -> int:
    """The device address of a DeviceAllocation, int, GPUArray or PointerHolderBase."""
    if isinstance(obj, DeviceAllocation):
        return obj._ptr
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        return int(obj)
    gpudata = getattr(obj, "gpudata", None)
    if gpudata is not None:
        return _address(gpudata, what)
    get_pointer = getattr(obj, "get_pointer", None)
    if callable(get_pointer):
        return int(get_pointer())
    try:
        return int(obj.__index__())
    except (AttributeError, TypeError):
        pass
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_address(cai, type(obj).__name__)
    raise TypeError(f"expected a {what} (DeviceAllocation, int address, GPUArray or an object "
                    f"with __cuda_array_interface__), got {type(obj).__name__}")


def _core_for(obj: Any, what: str) -> SessionCore:
    """The session an operation on obj runs in: obj's own, else the current context's."""
    return _owner_core(obj) or _current_core(what)


# -- which session a pointer belongs to --------------------------------------------------------
#
# A device address means something only in the worker process of the session that allocated
# it (two sessions' workers may even hand out the same addresses). An object knows its session
# when it is, or wraps, a DeviceAllocation (pool blocks and GPUArrays and their views do); for
# anything else that exposes __cuda_array_interface__ the address is looked up among the live
# allocations of the kernel's session.

_sessions_with_allocations: "weakref.WeakSet[SessionCore]" = weakref.WeakSet()


def _register_allocation(core: SessionCore, alloc: DeviceAllocation) -> None:
    registry = core.caches.get("allocations")
    if registry is None:
        registry = core.caches["allocations"] = weakref.WeakValueDictionary()
        _sessions_with_allocations.add(core)
    registry[alloc._ptr] = alloc


def _find_allocation(core: SessionCore, address: int) -> Optional[DeviceAllocation]:
    """The live allocation of core's session that contains address, if any."""
    registry = core.caches.get("allocations")
    if not registry:
        return None
    for alloc in list(registry.values()):
        if alloc._ptr <= address < alloc._ptr + alloc._size and alloc._finalizer.alive:
            return alloc
    return None


def _owner_core(obj: Any) -> Optional[SessionCore]:
    """The session whose memory obj is, when obj says so: a DeviceAllocation, a memory-pool
    block, or an object whose ``gpudata`` (or whose ``base``, for views) leads to one."""
    for _ in range(64):  # views of views: a bounded walk
        if obj is None or isinstance(obj, (int, np.integer)):
            return None
        if isinstance(obj, DeviceAllocation):
            return obj._core
        alloc = getattr(obj, "_alloc", None)
        if isinstance(alloc, DeviceAllocation):
            return alloc._core
        gpudata = getattr(obj, "gpudata", None)
        if gpudata is not None and not isinstance(gpudata, (int, np.integer)):
            obj = gpudata
        elif hasattr(obj, "gpudata"):
            obj = getattr(obj, "base", None)
        else:
            return None
    return None


def _cai_address(cai: Any, owner: str) -> int:
    data = cai.get("data") if isinstance(cai, dict) else None
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError(f"the __cuda_array_interface__ of {owner} has no 'data' entry "
                        "(address, read_only)")
    return int(data[0] or 0)


def _cai_extent(cai: dict, owner: str) -> Tuple[int, int]:
    """Byte offsets [lo, hi) around the CAI data pointer that the described array touches."""
    try:
        shape = tuple(int(n) for n in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError) as e:
        raise TypeError(f"the __cuda_array_interface__ of {owner} is malformed: {e}") from None
    if strides is None:
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= max(n, 1)
    lo = hi = 0
    for n, stride in zip(shape, strides):
        if n == 0:
            return 0, 0
        if stride < 0:
            lo += (n - 1) * int(stride)
        else:
            hi += (n - 1) * int(stride)
    return lo, hi + itemsize


def _session_pointer(core: SessionCore, index: int, arg: Any, kernel: str) -> int:
    """The address of a pointer argument that is not a plain int: checks that its memory
    belongs to core's session (objects with gpudata, pool blocks, CAI exporters)."""
    owner = _owner_core(arg)
    cai = None
    if owner is None and not hasattr(arg, "gpudata"):
        cai = getattr(arg, "__cuda_array_interface__", None)
    if cai is not None:
        what = type(arg).__name__
        address = _cai_address(cai, what)
        if address == 0:
            return 0  # an empty array
        lo, hi = _cai_extent(cai, what)
        alloc = _find_allocation(core, address + lo)
        if alloc is None:
            others = [c.session_id for c in list(_sessions_with_allocations)
                      if c is not core and _find_allocation(c, address + lo) is not None]
            where = (f"it is memory of gpurpc session {others[0]}" if others else
                     "no live allocation of this session contains it (memory of another "
                     "process, library or session cannot be used)")
            raise LogicError(f"{kernel}: parameter #{index} (0-based): the "
                             f"__cuda_array_interface__ address 0x{address:x} of {what} is not "
                             f"device memory of session {core.session_id}: {where}",
                             code=grpc.StatusCode.INVALID_ARGUMENT)
        if address + hi > alloc._ptr + alloc._size:
            raise LogicError(f"{kernel}: parameter #{index} (0-based): the array described by "
                             f"the __cuda_array_interface__ of {what} extends past the end of "
                             f"its allocation ({alloc._size} bytes at 0x{alloc._ptr:x})",
                             code=grpc.StatusCode.INVALID_ARGUMENT)
        return address
    if owner is not None and owner is not core:
        raise LogicError(f"{kernel}: parameter #{index} (0-based) is memory of gpurpc session "
                         f"{owner.session_id}, but the kernel belongs to session "
                         f"{core.session_id}; device addresses are valid only in the session "
                         "that allocated them", code=grpc.StatusCode.INVALID_ARGUMENT)
    if hasattr(arg, "gpudata"):
        return 0 if arg.gpudata is None else _address(arg.gpudata)
    return _address(arg)


def _readable(src: Any) -> memoryview:
    """A flat byte view of a host buffer to send (a copy if it is not contiguous)."""
    if isinstance(src, np.ndarray):
        arr = src
        if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
            arr = np.ascontiguousarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.T
        return arr.reshape(-1).view(np.uint8).data
    view = memoryview(src)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _writable(dest: Any, what: str) -> memoryview:
    """A flat writable byte view of a contiguous host buffer."""
    if isinstance(dest, np.ndarray):
        if not (dest.flags.c_contiguous or dest.flags.f_contiguous):
            raise ValueError(f"{what}: the host array must be contiguous")
        if not dest.flags.writeable:
            raise ValueError(f"{what}: the host array is read-only")
        arr = dest if dest.flags.c_contiguous else dest.T
        return arr.reshape(-1).view(np.uint8).data
    view = memoryview(dest)
    if view.readonly:
        raise ValueError(f"{what}: the host buffer is read-only")
    if not view.c_contiguous:
        raise ValueError(f"{what}: the host buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# =============================================================================================
# Memory

def mem_alloc(bytes: int) -> DeviceAllocation:  # noqa: A002 - PyCUDA's parameter name
    """Allocates device memory (``cuMemAlloc``), retrying once after ``gc.collect()`` on OOM.

    :raises MemoryError: the device (or the session's quota) has not enough free memory.
    :raises LogicError: ``bytes`` is 0.
    """
    return _alloc(_current_core("mem_alloc"), bytes)


def _alloc(core: SessionCore, nbytes: int) -> DeviceAllocation:
    nbytes = int(nbytes)
    with core.lock:
        core.check_open("mem_alloc")
        if core.has_releases:
            core.drain()
            core.process_releases()
        request = _mem.AllocateRequest(size_bytes=nbytes)
        try:
            reply = core.call("MemoryService.Allocate", request, op="mem_alloc")
        except MemoryError:
            gc.collect()
            for release in list(core.caches.get("oom_handlers", ())):
                release()
            core.drain()
            core.process_releases()
            reply = core.call("MemoryService.Allocate", request, op="mem_alloc")
    info = reply.buffer
    alloc = DeviceAllocation(core, info.buffer_id, info.device_address, info.size_bytes)
    _register_allocation(core, alloc)
    return alloc


def mem_alloc_like(ary: Any) -> DeviceAllocation:
    """Device memory as large as ``ary.nbytes``."""
    return mem_alloc(ary.nbytes)


def mem_get_info() -> Tuple[int, int]:
    """``(free, total)`` device memory in bytes (``cuMemGetInfo``)."""
    core = _current_core("mem_get_info")
    with core.lock:
        if core.has_releases:
            core.drain()
            core.process_releases()
        reply = core.call("MemoryService.GetMemInfo", _mem.GetMemInfoRequest(), op="mem_get_info")
    return int(reply.free_bytes), int(reply.total_bytes)


def _upload(core: SessionCore, address: int, data: memoryview, stream_id: int, sync: bool,
            label: str) -> None:
    n = data.nbytes
    with core.lock:
        core.check_open(label)
        commands = core.commands
        if n == 0 or _regions.try_upload(core, address, data, stream_id, sync, label):
            return
        if sync and n > _core.STREAMED_TRANSFER_BYTES:
            commands.drain(label=label)
            _upload_stream(core, address, data, stream_id, label)
            return
        chunk = _core.UPLOAD_CHUNK_BYTES
        progress = _progress.bar(n, label) if n >= chunk * 4 else None
        for offset in range(0, n, chunk):
            piece = data[offset:offset + chunk].tobytes()
            commands.add(label, auto=not sync, payload_bytes=len(piece),
                         upload=_ex.UploadCommand(destination=device_pointer(address + offset),
                                                  data=piece, stream_id=stream_id))
            if progress is not None:
                progress.update(len(piece))
        if progress is not None:
            progress.close()
        if sync:
            commands.drain(label=label)


# -- streamed transfers, in parts on several connections --------------------------------------
#
# A synchronous transfer above _core.STREAMED_TRANSFER_BYTES that takes no same-host region is
# an UploadStream or a DownloadStream. One of at least twice _core.MIN_TRANSFER_PART_BYTES is
# split into parts moved at once, each on a connection of its own (Client.transfer_method),
# as the C++ client does (client.cc, InParts): one gRPC connection carries one message at a
# time per stream, which bounds a transfer to a few GB/s; parts on several connections add up.
# Parts after the first run on threads of their own, the first on the caller's. Every part
# runs to its end (a part that fails does not stop the others; each ends on its own, within
# the call timeout per step) and the first error in offset order is raised. Only a range that
# MemoryService.GetAllocation says lies inside one buffer is split: anything else goes as one
# stream, so that a bad range is refused whole, with the daemon's own error, before a byte is
# written (a part past the end would fail only after the parts before it wrote theirs).


class _SharedProgress:
    """A progress bar that the parts of a transfer update from their threads."""

    __slots__ = ("_bar", "_lock")

    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)


class _Parts:
    """The calls of a transfer's parts, so that all of them can be cancelled at once (when
    the caller is interrupted: nothing may go on behind its back)."""

    __slots__ = ("_lock", "_calls", "_cancelled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: List[Any] = []
        self._cancelled = False

    def attach(self, call: Any) -> None:
        with self._lock:
            self._calls.append(call)
            cancelled = self._cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()


def _transfer_parts(core: SessionCore, address: int, n: int, chunk: int,
                    label: str) -> List[Tuple[int, int]]:
    """The parts ``(offset, size)`` a streamed transfer of ``n`` bytes at ``address`` goes in:
    ``min(connections, n // 8 MiB)`` of them, whole chunks each but the last (which takes the
    rest); one when that is 1 or when GetAllocation does not say that the buffer holding
    ``address`` holds all of ``[address, address + n)``."""
    parts = min(core.client.transfer_connections, n // _core.MIN_TRANSFER_PART_BYTES)
    if parts <= 1:
        return [(0, n)]
    try:
        # GetAllocation finds the buffer holding any address inside it, not only its start.
        info = core.call("MemoryService.GetAllocation",
                         _mem.GetAllocationRequest(device_address=address), op=label).buffer
    except Error:
        return [(0, n)]  # the one stream gets the daemon's own answer
    if info.HasField("array") or not (
            info.device_address <= address
            and address - info.device_address + n <= info.size_bytes):
        return [(0, n)]
    per_part = ((n + chunk - 1) // chunk // parts) * chunk
    return [(per_part * i, per_part if i + 1 < parts else n - per_part * i)
            for i in range(parts)]


def _run_parts(parts: List[Tuple[int, int]], calls: _Parts,
               run: Callable[[int, int, int], None]) -> None:
    """Runs ``run(connection, offset, size)`` for every part: the first on this thread, the
    others on threads of their own (a part whose thread cannot start runs here, after the
    first). Raises the first error in offset order once every part has ended. Interrupted
    (KeyboardInterrupt), it cancels every part and waits for them before it re-raises."""
    errors: List[Optional[BaseException]] = [None] * len(parts)

    def work(index: int) -> None:
        try:
            run(index, *parts[index])
        except BaseException as e:  # noqa: BLE001 - raised by the caller, in offset order
            errors[index] = e

    threads: List[Optional[threading.Thread]] = []
    try:
        for index in range(1, len(parts)):
            thread: Optional[threading.Thread] = threading.Thread(
                target=work, args=(index,), daemon=True, name=f"gpurpc-transfer-part-{index}")
            try:
                thread.start()  # type: ignore[union-attr]
            except RuntimeError:  # no thread to be had: the part runs here, after the first
                thread = None
            threads.append(thread)
        try:
            run(0, *parts[0])
        except Exception as e:  # noqa: BLE001 - raised below, in offset order
            errors[0] = e
        for index, thread in enumerate(threads, start=1):
            if thread is None:
                work(index)
            else:
                thread.join()
    except BaseException:
        calls.cancel()
        for thread in threads:
            if thread is not None:
                thread.join()
        raise
    for error in errors:
        if error is not None:
            raise error


class _Streamed:
    """What the parts of one streamed transfer of ``n`` bytes share: the parts, their calls,
    the progress bar (shared between threads when there are several parts) and the call
    metadata. ``run(part)`` runs ``part(connection, offset, size)`` for every part and closes
    the bar."""

    __slots__ = ("parts", "calls", "progress", "metadata", "_bar")

    def __init__(self, core: SessionCore, address: int, n: int, chunk: int, method: str,
                 parts_counter: str, label: str) -> None:
        core.check_open(label)
        self.parts = _transfer_parts(core, address, n, chunk, label)
        self.calls = _Parts()
        _core.debug.count(method)
        if len(self.parts) > 1:
            _core.debug.count(parts_counter, len(self.parts))
        self._bar = _progress.bar(n, label)
        self.progress = _SharedProgress(self._bar) if len(self.parts) > 1 else self._bar
        self.metadata = core.metadata + core.client.auth_metadata

    def run(self, part: Callable[[int, int, int], None]) -> None:
        try:
            _run_parts(self.parts, self.calls, part)
        finally:
            self._bar.close()


def _stream_error(core: SessionCore, e: Any, deadline: "_core.ProgressDeadline",
                  label: str, moved: int, n: int) -> BaseException:
    """The error to raise for a streamed transfer's call that ended with ``e`` (a
    ``grpc.RpcError``, or the future's cancellation when its deadline fired) after ``moved``
    of ``n`` bytes: a timeout when its progress deadline cancelled it, else the session's
    reading of the status (noted on the session, as every call's is)."""
    if deadline.fired:
        return timeout_error(label, core.timeout, f"no progress after {moved} of {n} bytes, "
                             "so the transfer was cancelled")
    err = _core.session_error(e.code(), e.details() or "", label, core.client.target,
                              core.session_id)
    if err.code is not None:
        core.note_status(err.code, err.details)
    return err


# UploadStreamRequest.data = 4, length-delimited.
_UPLOAD_DATA_TAG = bytes(((_mem.UploadStreamRequest.DATA_FIELD_NUMBER << 3) | 2,))


def _upload_stream(core: SessionCore, address: int, data: memoryview, stream_id: int,
                   label: str) -> None:
    n = data.nbytes
    chunk = _core.UPLOAD_CHUNK_BYTES
    transfer = _Streamed(core, address, n, chunk, "MemoryService.UploadStream",
                         _core.UPLOAD_PARTS, label)
    progress = transfer.progress

    def part(connection: int, offset: int, size: int) -> None:
        part_data = data[offset:offset + size]
        sent = 0
        deadline = _core.ProgressDeadline(core.timeout)

        def requests() -> Iterator[bytes]:
            # Serialized here, each chunk copied once, straight from the caller's buffer:
            # the header fields, then the data field (the protobuf encoding of
            # UploadStreamRequest(data=piece) is its tag, its length and its bytes).
            nonlocal sent
            header = _mem.UploadStreamRequest(destination=device_pointer(address + offset),
                                              total_size_bytes=size,
                                              stream_id=stream_id).SerializeToString()
            for at in range(0, size, chunk):
                piece = part_data[at:at + chunk]
                yield b"".join((header, _UPLOAD_DATA_TAG, _core.varint(piece.nbytes), piece))
                header = b""
                sent += piece.nbytes
                deadline.progress()
                progress.update(piece.nbytes)

        with deadline:
            # No deadline on the call as a whole: each step has one (ProgressDeadline).
            future = core.client.transfer_method(
                connection, "MemoryService.UploadStream", raw_requests=True).future(
                    requests(), metadata=transfer.metadata)
            deadline.attach(future)
            transfer.calls.attach(future)
            try:
                future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                if not isinstance(e, grpc.RpcError) and not deadline.fired:
                    raise
                raise _stream_error(core, e, deadline, label, offset + sent, n) from None

    transfer.run(part)


def _write_into(view: memoryview, offset: int, size: int, data: bytes) -> None:
    if len(data) != size:
        raise ValueError(f"expected {size} bytes, the daemon sent {len(data)}")
    view[offset:offset + size] = data


_DOWNLOAD_COMMAND_BYTES = 16 << 20


def _download(core: SessionCore, address: int, dest: memoryview, stream_id: int, sync: bool,
              label: str) -> None:
    n = dest.nbytes
    with core.lock:
        core.check_open(label)
        commands = core.commands
        if n == 0 or _regions.try_download(core, address, dest, stream_id, sync, label):
            return
        if sync and n > _core.STREAMED_TRANSFER_BYTES:
            commands.drain(label=label)
            _download_stream(core, address, dest, stream_id, label)
            return
        for offset in range(0, n, _DOWNLOAD_COMMAND_BYTES):
            size = min(_DOWNLOAD_COMMAND_BYTES, n - offset)
            commands.add(label, auto=not sync,
                         sink=functools.partial(_write_into, dest, offset, size),
                         download_bytes=size,
                         download=_ex.DownloadCommand(source=device_pointer(address + offset),
                                                      size_bytes=size, stream_id=stream_id))
        if sync:
            commands.drain(label=label)


def _download_stream(core: SessionCore, address: int, dest: memoryview, stream_id: int,
                     label: str) -> None:
    n = dest.nbytes
    transfer = _Streamed(core, address, n, _core.DOWNLOAD_CHUNK_BYTES,
                         "MemoryService.DownloadStream", _core.DOWNLOAD_PARTS, label)
    parts, progress = transfer.parts, transfer.progress
    target = np.frombuffer(dest, np.uint8)

    def part(connection: int, offset: int, size: int) -> None:
        request = _mem.DownloadRequest(source=device_pointer(address + offset), size_bytes=size,
                                       stream_id=stream_id,
                                       chunk_size_bytes=_core.DOWNLOAD_CHUNK_BYTES)
        done = 0
        deadline = _core.ProgressDeadline(core.timeout)
        try:
            with deadline:
                # No deadline on the call as a whole: each step has one (ProgressDeadline).
                # Replies come serialized: each chunk's bytes go from gRPC's message straight
                # into dest, by a copy that lets go of the GIL, so the parts' threads copy at
                # once (parsed, a chunk was copied twice more, each time holding the GIL).
                replies = core.client.transfer_method(
                    connection, "MemoryService.DownloadStream", raw_responses=True)(
                        request, metadata=transfer.metadata)
                deadline.attach(replies)
                transfer.calls.attach(replies)
                for reply in replies:
                    deadline.progress()
                    try:
                        start, length = _download_data(reply, label)
                    except Error:
                        replies.cancel()  # nothing more of this call is read
                        raise
                    if done + length > size:
                        replies.cancel()
                        raise Error(f"{label}: the daemon sent more than the {size} bytes asked "
                                    f"for{_part_words(parts, connection)}")
                    at = offset + done
                    np.copyto(target[at:at + length],
                              np.frombuffer(reply, np.uint8, length, start))
                    done += length
                    progress.update(length)
        except grpc.RpcError as e:
            raise _stream_error(core, e, deadline, label, offset + done, n) from None
        if done != size:
            raise Error(f"{label}: the daemon sent {done} of {size} bytes"
                        f"{_part_words(parts, connection)}")

    transfer.run(part)


_DOWNLOAD_DATA_FIELD = _mem.DownloadResponse.DATA_FIELD_NUMBER


def _download_data(message: bytes, label: str) -> Tuple[int, int]:
    """``(start, length)`` of the data field's bytes in a serialized ``DownloadResponse``
    (``length`` 0 without one). Fields it does not know are skipped, as protobuf would, and
    of several data fields the last counts, as protobuf's parse keeps it. Groups (wire types
    3 and 4), which no daemon sends, are refused.

    :raises Error: ``message`` is not a valid encoding (naming what is wrong).
    """
    at, end = 0, len(message)
    start = length = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            if at >= end or shift > 63:
                raise Error(f"{label}: the daemon sent a malformed DownloadResponse (a varint "
                            f"runs past byte {at} of {end}, or past 10 bytes)")
            byte = message[at]
            at += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while at < end:
        key = varint()
        field, wire = key >> 3, key & 7
        if field == 0:
            raise Error(f"{label}: the daemon sent a malformed DownloadResponse (field number 0 "
                        f"at byte {at} of {end})")
        if wire == 0:
            varint()
            continue
        if wire == 2:
            size = varint()
            if size > end - at:
                raise Error(f"{label}: the daemon sent a malformed DownloadResponse (field "
                            f"{field} claims {size} bytes, {end - at} follow)")
            if field == _DOWNLOAD_DATA_FIELD:
                start, length = at, size
            at += size
            continue
        skip = {1: 8, 5: 4}.get(wire)
        if skip is None or skip > end - at:
            raise Error(f"{label}: the daemon sent a malformed DownloadResponse (field {field}, "
                        f"wire type {wire}, at byte {at} of {end})")
        at += skip
    return start, length


def _part_words(parts: List[Tuple[int, int]], index: int) -> str:
    """" (part 2 of 4, bytes 8388608 to 16777216)" of a transfer in parts, "" of one stream."""
    if len(parts) == 1:
        return ""
    offset, size = parts[index]
    return f" (part {index + 1} of {len(parts)}, bytes {offset} to {offset + size})"


def memcpy_htod(dest: Any, src: Any) -> None:
    """Copies the host buffer ``src`` (all of it) to device address ``dest``."""
    core = _core_for(dest, "memcpy_htod")
    _upload(core, _address(dest), _readable(src), 0, True, "memcpy_htod")


def memcpy_htod_async(dest: Any, src: Any, stream: Optional["Stream"] = None) -> None:
    """Queues a copy of ``src`` to ``dest`` on ``stream``. The bytes are taken at once, so
    ``src`` may be reused immediately (it need not be page-locked), except from a
    region-backed ``pagelocked_*`` array, which is read when the stream gets there (as CUDA
    reads page-locked memory): change it only after synchronising."""
    core = _core_for(dest, "memcpy_htod_async")
    _upload(core, _address(dest), _readable(src), _stream_id(stream), False, "memcpy_htod_async")


def memcpy_dtoh(dest: Any, src: Any) -> None:
    """Copies ``dest.nbytes`` bytes from device address ``src`` into the host buffer ``dest``."""
    core = _core_for(src, "memcpy_dtoh")
    _download(core, _address(src), _writable(dest, "memcpy_dtoh"), 0, True, "memcpy_dtoh")


def memcpy_dtoh_async(dest: Any, src: Any, stream: Optional["Stream"] = None) -> None:
    """Queues a copy into ``dest``; its bytes arrive when ``stream`` (or the context, or an
    event recorded after it) is synchronised. Keep ``dest`` alive until then."""
    core = _core_for(src, "memcpy_dtoh_async")
    _download(core, _address(src), _writable(dest, "memcpy_dtoh_async"), _stream_id(stream),
              False, "memcpy_dtoh_async")


def _copy(dest: Any, src: Any, size: int, stream_id: int, sync: bool, label: str) -> None:
    core = _core_for(dest, label)
    size = int(size)
    with core.lock:
        core.check_open(label)
        if size:
            core.commands.add(label, auto=not sync, copy=_ex.CopyCommand(
                destination=device_pointer(_address(dest)), source=device_pointer(_address(src)),
                size_bytes=size, stream_id=stream_id))
        if sync:
            core.commands.drain(label=label)


def memcpy_dtod(dest: Any, src: Any, size: int) -> None:
    """Copies ``size`` bytes between two device addresses of the session."""
    _copy(dest, src, size, 0, True, "memcpy_dtod")


def memcpy_dtod_async(dest: Any, src: Any, size: int, stream: Optional["Stream"] = None) -> None:
    """Queues a device-to-device copy on ``stream``."""
    _copy(dest, src, size, _stream_id(stream), False, "memcpy_dtod_async")


def _memset(dest: Any, value: int, count: int, element_size: int, stream_id: int, sync: bool,
            label: str) -> None:
    core = _core_for(dest, label)
    mask = (1 << (8 * element_size)) - 1
    with core.lock:
        core.check_open(label)
        if int(count):
            core.commands.add(label, auto=not sync, memset=_ex.MemsetCommand(
                destination=device_pointer(_address(dest)), value=int(value) & mask,
                element_size_bytes=element_size, count=int(count), stream_id=stream_id))
        if sync:
            core.commands.drain(label=label)


def memset_d8(dest: Any, data: int, count: int) -> None:
    """Sets ``count`` bytes at ``dest`` to ``data``."""
    _memset(dest, data, count, 1, 0, True, "memset_d8")


def memset_d16(dest: Any, data: int, count: int) -> None:
    """Sets ``count`` 16-bit words at ``dest`` (2-byte aligned) to ``data``."""
    _memset(dest, data, count, 2, 0, True, "memset_d16")


def memset_d32(dest: Any, data: int, count: int) -> None:
    """Sets ``count`` 32-bit words at ``dest`` (4-byte aligned) to ``data``."""
    _memset(dest, data, count, 4, 0, True, "memset_d32")


def memset_d8_async(dest: Any, data: int, count: int, stream: Optional["Stream"] = None) -> None:
    """Queues ``memset_d8`` on ``stream``."""
    _memset(dest, data, count, 1, _stream_id(stream), False, "memset_d8_async")


def memset_d16_async(dest: Any, data: int, count: int, stream: Optional["Stream"] = None) -> None:
    """Queues ``memset_d16`` on ``stream``."""
    _memset(dest, data, count, 2, _stream_id(stream), False, "memset_d16_async")


def memset_d32_async(dest: Any, data: int, count: int, stream: Optional["Stream"] = None) -> None:
    """Queues ``memset_d32`` on ``stream``."""
    _memset(dest, data, count, 4, _stream_id(stream), False, "memset_d32_async")


def to_device(bf_obj: Any) -> DeviceAllocation:
    """Allocates device memory and copies the host buffer into it."""
    data = _readable(bf_obj)
    alloc = mem_alloc(max(data.nbytes, 1))
    _upload(alloc._core, alloc._ptr, data, 0, True, "to_device")
    return alloc


def from_device(devptr: Any, shape: Any, dtype: Any, order: Literal["C", "F"] = "C") -> np.ndarray:
    """A new host array filled from device memory."""
    result = np.empty(shape, dtype, order=order)
    memcpy_dtoh(result, devptr)
    return result


def from_device_like(devptr: Any, other_ary: np.ndarray) -> np.ndarray:
    """A new host array like ``other_ary`` filled from device memory."""
    result = np.empty_like(other_ary)
    memcpy_dtoh(result, devptr)
    return result


def _host_array(shape: Any, dtype: Any, order: str, zero: bool, label: str) -> np.ndarray:
    ctx = Context.get_current()
    return _regions.host_array(None if ctx is None else ctx._core, shape, dtype, order, zero,
                               label)


def _like_order(array: np.ndarray) -> str:
    return "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"


def pagelocked_empty(shape: Any, dtype: Any, order: Literal["C", "F"] = "C",
                     mem_flags: int = 0) -> np.ndarray:
    """A host array that copies to and from the current context's device fastest: backed by a
    same-host region when the context uses them (see the module docstring), else ordinary.
    The region lives as long as the array or any view of it."""
    return _host_array(shape, dtype, order, False, "pagelocked_empty")


def pagelocked_zeros(shape: Any, dtype: Any, order: Literal["C", "F"] = "C",
                     mem_flags: int = 0) -> np.ndarray:
    """A zeroed :func:`pagelocked_empty`."""
    return _host_array(shape, dtype, order, True, "pagelocked_zeros")


def pagelocked_empty_like(array: np.ndarray, mem_flags: int = 0) -> np.ndarray:
    """A :func:`pagelocked_empty` array of ``array`` 's shape, dtype and layout."""
    return _host_array(array.shape, array.dtype, _like_order(array), False,
                       "pagelocked_empty_like")


def pagelocked_zeros_like(array: np.ndarray, mem_flags: int = 0) -> np.ndarray:
    """A zeroed :func:`pagelocked_empty_like`."""
    return _host_array(array.shape, array.dtype, _like_order(array), True,
                       "pagelocked_zeros_like")


def set_transfer_progress(enabled: bool = True, min_bytes: Optional[int] = None) -> None:
    """Shows a tqdm progress bar for transfers of at least ``min_bytes`` (default 64 MiB).

    tqdm is optional; without it a warning says so once. Same as ``GPURPC_PROGRESS=1``.
    """
    _progress.configure(enabled, min_bytes)


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
