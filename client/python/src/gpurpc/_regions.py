"""Same-host regions: host memory shared with the session's worker, so that copies between it
and device memory are DMA from pinned memory instead of bytes through gRPC.

Nothing here is public API: ``gpurpc.driver`` uses it for the ``pagelocked_*`` arrays, for
``memcpy_htod``/``memcpy_dtoh`` (and ``_async``), for ``In``/``Out``/``InOut`` arguments and,
through those, for ``GPUArray.set``/``get``.

Protocol (proto/gpurpc/v1/host_region_service.proto): the client makes a memfd of the
region's size, seals it against shrinking and growing and maps it shared;
``RegisterHostRegion`` reserves the region in the session and answers its id, a one-time
ticket and the path of the daemon's region socket; the client sends an
``AttachHostRegionRequest`` with the memfd (SCM_RIGHTS) as one datagram over that AF_UNIX
SOCK_SEQPACKET socket and reads one ``AttachHostRegionReply``, then closes its descriptor
(the mapping stays). Copies are ``RegionCopyCommand`` s in the session's command stream,
stream ordered and asynchronous like cuMemcpy*Async on pinned memory: a synchronous copy
queues the copy and a ``SyncCommand`` in one batch (one round trip).

When (per context: ``SessionCore.host_regions``, from ``host_regions=`` of ``init``/``Client``,
else ``$GPURPC_HOST_REGIONS``, else ``"auto"``; ``Context.host_regions`` changes it):

* ``"auto"``: on when the daemon is reached over a Unix socket (same host), off over TCP. A
  structural failure (the daemon serves no region socket or predates regions, its socket
  cannot be reached from here, it refuses the memfd, this platform has no memfd) turns
  regions off for the context, said once at debug level on the ``gpurpc`` logger; the call
  that met it falls back to gRPC. Running out of the region limits (RESOURCE_EXHAUSTED) only
  makes that one array an ordinary one (or that one transfer go through gRPC).
* ``"on"``: always; every failure raises.
* ``"off"``: no new regions (a region made before keeps serving its arrays).

What uses them:

* Every non-empty ``pagelocked_*`` array is backed by a region of its own (page-rounded). The
  array and every view of it keep the region alive (they all have its base array as
  ``.base``); when the last is garbage collected, ``weakref.finalize`` on that base array
  marks the region dead and defers its ``UnregisterHostRegion`` to the context's next
  synchronising call (no RPC from a finalizer; the daemon waits for queued copies that may
  still use it). After the context detaches, the arrays are ordinary memory.
* A copy whose host side lies entirely inside a live region of the context (found by the
  address range of its data) is a ``RegionCopyCommand``.
* A copy of at least ``STAGING_MIN_BYTES`` between device memory and any other contiguous host
  memory goes through the context's staging region, two halves of ``STAGING_HALF_BYTES``:
  chunk by chunk, alternating halves, each chunk's copy in a batch of its own that ends
  with a ``SyncCommand`` on the copy's stream, so an upload copies the next chunk into one
  half (``host_copy``: ``numpy.copyto`` split over a few threads) while the other half's DMA
  runs, and a half is reused once its batch is answered. A download's chunk is copied out
  of its half by the command stream's reader thread when that answer arrives (as a
  ``DownloadCommand`` 's bytes are). A staged ``_async`` copy therefore takes an upload's
  bytes at once, as the gRPC path does, and fills a download's destination when its stream
  is synchronised; the daemon waits for the copy's stream before it takes the context's
  later commands.

Thread safety: everything runs under the session lock (``SessionCore.lock``), except the
finalizers, which only flip a flag and append to the session's deferred releases, and the
pieces of a large ``host_copy``, which the process's copy threads run while the caller waits.
"""
from __future__ import annotations

import builtins
import errno
import functools
import logging
import mmap
import os
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _progress, debug
from ._core import CLEANUP_TIMEOUT_S, SessionCore, _is_unix, device_pointer
from ._framed import send_attach
from ._errors import (
    Error,
    LogicError,
    RuntimeError,
    error_from_status,
    status_code_from_int,
    timeout_error,
)
from .v1 import execution_service_pb2 as _ex
from .v1 import host_region_service_pb2 as _hr

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("gpurpc")

STAGING_HALF_BYTES = 32 << 20   # one half of a context's staging region
# Transfers from or to other memory are staged from this size on. Measured against the fake
# backend over its Unix socket (synchronous copies, median): at 64 KiB staging and gRPC take
# about the same (0.3 ms), at 256 KiB staging is 2.6x (upload) and 1.8x (download) faster, at
# 1 MiB 4.5x and 2.8x; below 64 KiB the inline gRPC copy is as fast and keeps an
# asynchronous copy from waiting on its stream.
STAGING_MIN_BYTES = 256 << 10
# Host copies into and out of the staging region (numpy.copyto, which releases the GIL) are
# split over up to 4 threads (GPURPC_COPY_THREADS; 1: the calling thread only), in pieces of
# at least COPY_PIECE_MIN_BYTES: with one thread, a staged 1 GiB transfer of an ordinary array
# moved about 6 GB/s on the H200, against about 50 GB/s of DMA (docs/DESIGN.md section 7.2).
COPY_PIECE_MIN_BYTES = 4 << 20
ATTACH_TIMEOUT_S = 30.0         # the attach exchange (or the call timeout when shorter)
ATTACH_COUNTER = "HostRegionService/attach"  # gpurpc.debug counter of attach exchanges
PAGE_BYTES = mmap.PAGESIZE
_KEY = "host_regions"           # SessionCore.caches key of the context's _Manager


def _missing_support() -> Optional[str]:
    """Why this platform cannot make regions, or None."""
    missing = [name for name, present in (
        ("os.memfd_create", hasattr(os, "memfd_create")),
        ("fcntl.F_ADD_SEALS", fcntl is not None and hasattr(fcntl, "F_ADD_SEALS")),
        ("socket.send_fds", hasattr(socket, "send_fds")),
        ("socket.SOCK_SEQPACKET", hasattr(socket, "SOCK_SEQPACKET"))) if not present]
    if not missing:
        return None
    return f"this platform lacks {', '.join(missing)} (Linux and Python >= 3.9 are needed)"


_UNSUPPORTED = _missing_support()


class _Fallback(Exception):
    """A failure that makes auto mode use gRPC; ``structural``: for the rest of the context."""

    def __init__(self, error: Error, structural: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.structural = structural


class _Region:
    """One attached region: its id and the address range of the client's mapping."""

    __slots__ = ("region_id", "start", "end", "alive", "__weakref__")

    def __init__(self, region_id: int, start: int, size: int) -> None:
        self.region_id = region_id
        self.start = start
        self.end = start + size
        self.alive = True


def _region_gone(region: _Region, core_ref: "weakref.ref[SessionCore]") -> None:
    """Finalizer of a region's base array (any thread, maybe inside our own code): no RPC,
    no lock; the unregistration waits for the context's next synchronising call."""
    region.alive = False
    core = core_ref()
    if core is not None and not core.closed:
        core.defer_release("region", region.region_id)


def _copy_threads() -> int:
    value = os.environ.get("GPURPC_COPY_THREADS", "")
    if not value:
        return max(1, min(4, os.cpu_count() or 1))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= 64:
        raise LogicError(f"GPURPC_COPY_THREADS={value!r}: expected a whole number from 1 to 64")
    return threads


class _CopyPool:
    """The process's host-copy threads, made at the first large copy (and again in a child
    after ``fork``, which inherits the pool's object but not its threads)."""

    _lock = threading.Lock()
    _pool: Optional[ThreadPoolExecutor] = None
    _pid = 0
    _threads = 0

    @classmethod
    def _after_fork_in_child(cls) -> None:
        cls._lock = threading.Lock()  # a parent thread may have held it at the fork

    @classmethod
    def get(cls) -> Tuple[Optional[ThreadPoolExecutor], int]:
        with cls._lock:
            if cls._pid != os.getpid():
                cls._threads = _copy_threads()
                cls._pool = (ThreadPoolExecutor(cls._threads - 1,
                                                thread_name_prefix="gpurpc-copy")
                             if cls._threads > 1 else None)
                cls._pid = os.getpid()
            return cls._pool, cls._threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_CopyPool._after_fork_in_child)


def host_copy(dest: np.ndarray, src: np.ndarray) -> None:
    """``numpy.copyto(dest, src)`` for two contiguous one-dimensional byte arrays of one size,
    split over the copy threads when it is large (see ``COPY_PIECE_MIN_BYTES``). Returns (or
    raises) only once no piece is being written any more."""
    n = src.size
    pieces = n // COPY_PIECE_MIN_BYTES
    if pieces < 2:
        np.copyto(dest, src)
        return
    pool, threads = _CopyPool.get()
    if pool is None:  # one thread
        np.copyto(dest, src)
        return
    pieces = min(pieces, threads)  # both at least 2
    step = -(-n // pieces)
    futures = []
    try:
        for at in range(step, n, step):
            futures.append(pool.submit(np.copyto, dest[at:at + step], src[at:at + step]))
    except builtins.RuntimeError:  # the interpreter is shutting down: no new threads
        wait(futures)
        np.copyto(dest, src)
        return
    try:
        np.copyto(dest[:step], src[:step])
    finally:
        wait(futures)  # also after an interrupt: nothing may still write into ``dest``
    for future in futures:
        future.result()


class _Staging:
    """The context's staging region: two halves used in turn (see the module docstring)."""

    def __init__(self, region: _Region, base: np.ndarray, half: int) -> None:
        self.region = region
        self.base = base          # keeps the mapping (and so the region) alive
        self.half = half
        self.busy = [0, 0]        # per half: the batch whose answer frees it
        self._next = 0

    def _take(self, commands: Any, label: str) -> int:
        """The next half, once its last copy is done."""
        h = self._next
        self._next ^= 1
        commands.wait_batches(self.busy[h], label=label)
        return h

    def upload(self, core: SessionCore, address: int, view: memoryview, stream_id: int,
               sync: bool, label: str) -> None:
        commands = core.commands
        src = np.frombuffer(view, np.uint8)
        n = src.size
        progress = _progress.bar(n, label)
        try:
            for offset in range(0, n, self.half):
                size = min(self.half, n - offset)
                h = self._take(commands, label)
                at = h * self.half
                host_copy(self.base[at:at + size], src[offset:offset + size])
                _queue_copy(commands, label, self.region.region_id, at, address + offset, size,
                            True, stream_id)
                commands.add(label, auto=False, sync=_ex.SyncCommand(stream_id=stream_id))
                self.busy[h] = commands.last_batch
                commands.flush(label=label)
                progress.update(size)
        finally:
            progress.close()
        if sync:
            commands.drain(label=label)

    def download(self, core: SessionCore, address: int, view: memoryview, stream_id: int,
                 sync: bool, label: str) -> None:
        commands = core.commands
        dest = np.frombuffer(view, np.uint8)
        n = dest.size
        progress = _progress.bar(n, label)
        try:
            for offset in range(0, n, self.half):
                size = min(self.half, n - offset)
                h = self._take(commands, label)
                at = h * self.half
                _queue_copy(commands, label, self.region.region_id, at, address + offset, size,
                            False, stream_id)
                commands.add(label, auto=False, sync=_ex.SyncCommand(stream_id=stream_id))
                commands.add_on_done(functools.partial(
                    host_copy, dest[offset:offset + size], self.base[at:at + size]))
                self.busy[h] = commands.last_batch
                commands.flush(label=label)
                progress.update(size)
        finally:
            progress.close()
        if sync:
            commands.drain(label=label)


class _Manager:
    """A context's regions (``SessionCore.caches[_KEY]``)."""

    def __init__(self) -> None:
        self.spans: Tuple[_Region, ...] = ()   # live regions of pagelocked arrays
        self.staging: Optional[_Staging] = None
        self.off_reason: Optional[str] = None  # auto mode: why regions are off here
        self.staging_off: Optional[str] = None  # auto mode: why there is no staging region
        self.closed = False

    def find(self, start: int, n: int) -> Optional[Tuple[_Region, int]]:
        """The live region holding [start, start + n), and the offset of start in it."""
        for region in self.spans:
            if region.start <= start and start + n <= region.end and region.alive:
                return region, start - region.start
        return None

    def add(self, region: _Region) -> None:
        self.spans = tuple(r for r in self.spans if r.alive) + (region,)

    def prune(self) -> None:
        if any(not r.alive for r in self.spans):
            self.spans = tuple(r for r in self.spans if r.alive)


def _manager(core: SessionCore) -> _Manager:
    mgr = core.caches.get(_KEY)
    if mgr is None:
        mgr = core.caches[_KEY] = _Manager()
    return mgr


def _origin(core: SessionCore) -> str:
    return f"host regions are {core.host_regions!r} (host_regions= or GPURPC_HOST_REGIONS)"


def _usable(core: SessionCore, mgr: _Manager) -> bool:
    """Whether new regions may be made for this context now."""
    mode = core.host_regions
    if mode == "off" or mgr.closed or core.closed:
        return False
    if mode == "auto":
        return (mgr.off_reason is None and _UNSUPPORTED is None
                and _is_unix(core.client.target))
    return True


def _give_up(core: SessionCore, mgr: _Manager, fallback: _Fallback) -> None:
    """Auto mode: log (once, for a structural failure) and remember; "on": raise."""
    if core.host_regions == "on":
        raise fallback.error
    if fallback.structural:
        if mgr.off_reason is None:
            mgr.off_reason = str(fallback.error)
            log.debug("gpurpc: session %d uses gRPC transfers, not same-host regions: %s",
                      core.session_id, mgr.off_reason)
    else:
        log.debug("gpurpc: session %d: no host region this time: %s", core.session_id,
                  fallback.error)


# -- making regions ---------------------------------------------------------------------------

def _map_memfd(size: int, name: str) -> Tuple[int, mmap.mmap]:
    """A sealed memfd of ``size`` bytes and its shared mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        assert fcntl is not None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def _register(core: SessionCore, size: int, label: str) -> Any:
    request = _hr.RegisterHostRegionRequest(size_bytes=size)
    op = f"{label}: RegisterHostRegion of {size} bytes"
    try:
        return core.call("HostRegionService.RegisterHostRegion", request, op=op)
    except Error as e:
        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            if e.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION) \
                    and core.health == "active":
                # The daemon serves no region socket, or predates regions: not a fault.
                raise _Fallback(LogicError(
                    f"{op} failed: {e.details} ({_origin(core)}) [{e.code.name}]",
                    code=e.code, details=e.details, operation=op), True) from None
            raise
    # Over a limit: regions of dead arrays may be waiting for their unregistration.
    import gc
    gc.collect()
    core.drain()
    core.process_releases()
    try:
        return core.call("HostRegionService.RegisterHostRegion", request, op=op)
    except Error as e:
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise _Fallback(e, False) from None
        raise


def _attach(core: SessionCore, reply: Any, fd: int, label: str) -> None:
    """Sends the memfd over the region socket; raises _Fallback or Error."""
    path = reply.region_socket
    op = f"{label}: attaching host region {reply.region_id} over the region socket {path!r}"
    request = _hr.AttachHostRegionRequest(session_id=core.session_id,
                                          region_id=reply.region_id,
                                          ticket=reply.attach_ticket).SerializeToString()
    timeout = min(core.timeout, ATTACH_TIMEOUT_S)
    debug.count(ATTACH_COUNTER)
    try:
        data = send_attach(path, request, fd, timeout)
    except socket.timeout:
        raise timeout_error(op, timeout, "the daemon did not answer on its region "
                            "socket") from None
    except OSError as e:
        why = e.strerror or str(e)
        hint = (" (is the daemon on another host or in another mount namespace? set "
                "GPURPC_HOST_REGIONS=off there)" if e.errno in (errno.ENOENT, errno.ECONNREFUSED,
                                                                  errno.EACCES) else "")
        raise _Fallback(RuntimeError(f"{op} failed: {why}{hint} [UNAVAILABLE]",
                                     code=grpc.StatusCode.UNAVAILABLE, details=why,
                                     operation=op), True) from None
    if not data:
        raise _Fallback(RuntimeError(
            f"{op} failed: the daemon closed the connection without an answer [UNAVAILABLE]",
            code=grpc.StatusCode.UNAVAILABLE, operation=op), True)
    try:
        answer = _hr.AttachHostRegionReply.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError differs between versions
        raise _Fallback(RuntimeError(
            f"{op} failed: the daemon answered {len(data)} bytes that are no "
            "AttachHostRegionReply [UNKNOWN]", code=grpc.StatusCode.UNKNOWN, operation=op),
            True) from None
    if answer.code == 0:
        return
    code = status_code_from_int(answer.code)
    error = error_from_status(code, answer.message or f"code {answer.code}", op,
                              target=core.client.target)
    raise _Fallback(error, code != grpc.StatusCode.RESOURCE_EXHAUSTED)


def _unregister_now(core: SessionCore, region_id: int) -> None:
    """Best effort: frees a region that could not be attached."""
    try:
        core.client.call("HostRegionService.UnregisterHostRegion",
                         _hr.UnregisterHostRegionRequest(region_id=region_id), core.metadata,
                         timeout=min(core.timeout, CLEANUP_TIMEOUT_S))
    except Error:
        pass  # the session ends it anyway


def _new_region(core: SessionCore, mgr: _Manager, nbytes: int,
                label: str) -> Tuple[_Region, np.ndarray]:
    """Makes, registers and attaches a region of at least ``nbytes``; returns it and its base
    array (a uint8 array over the whole mapping: keep it alive as long as the region is
    used). Raises _Fallback, or Error for what auto mode must not hide."""
    if _UNSUPPORTED is not None:
        raise _Fallback(LogicError(f"{label}: no host region: {_UNSUPPORTED} ({_origin(core)})",
                                   code=grpc.StatusCode.FAILED_PRECONDITION), True)
    size = -(-int(nbytes) // PAGE_BYTES) * PAGE_BYTES
    if core.has_releases:
        core.drain()
        core.process_releases()
    mgr.prune()
    try:
        fd, mm = _map_memfd(size, f"gpurpc-session-{core.session_id}")
    except OSError as e:
        structural = e.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL)
        raise _Fallback(RuntimeError(
            f"{label}: cannot make a shared memory region of {size} bytes here: "
            f"{e.strerror or e} (memfd_create, ftruncate, F_ADD_SEALS, mmap)",
            code=grpc.StatusCode.RESOURCE_EXHAUSTED), structural) from None
    try:
        reply = _register(core, size, label)
        try:
            _attach(core, reply, fd, label)
        except BaseException:
            _unregister_now(core, reply.region_id)
            raise
    finally:
        os.close(fd)  # the mapping stays, and the worker holds its own
    base = np.frombuffer(mm, np.uint8)  # holds the mapping; unmapped when base dies
    del mm
    region = _Region(reply.region_id, base.__array_interface__["data"][0], size)
    finalizer = weakref.finalize(base, _region_gone, region, weakref.ref(core))
    finalizer.atexit = False
    return region, base


# -- what gpurpc.driver calls -----------------------------------------------------------------

def host_array(core: Optional[SessionCore], shape: Any, dtype: Any, order: str, zero: bool,
               label: str) -> np.ndarray:
    """A new host array, backed by a region of ``core``'s context when regions are on there
    (else, and for empty or object arrays, an ordinary one). Zeroed either way when ``zero``
    (a new region is zero-filled already)."""
    make = np.zeros if zero else np.empty
    dtype = np.dtype(dtype)
    if core is None or dtype.hasobject or order not in ("C", "F"):
        return make(shape, dtype, order=order)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        dims = (int(shape),)
    if any(d < 0 for d in dims):
        return make(shape, dtype, order=order)  # numpy's own error
    nbytes = dtype.itemsize
    for d in dims:
        nbytes *= d
    if nbytes == 0:
        return make(dims, dtype, order=order)
    with core.lock:
        mgr = _manager(core)
        if not _usable(core, mgr) or core.health != "active":
            return make(dims, dtype, order=order)
        try:
            region, base = _new_region(core, mgr, nbytes, label)
        except _Fallback as fallback:
            _give_up(core, mgr, fallback)
            return make(dims, dtype, order=order)
        mgr.add(region)
    return base[:nbytes].view(dtype).reshape(dims, order=order)  # type: ignore[call-overload]


def region_of(core: SessionCore, array: Any) -> Optional[Tuple[int, int]]:
    """``(region_id, offset)`` of a contiguous host array that lies in a live region of the
    context, else None (for tests and diagnostics)."""
    mgr = core.caches.get(_KEY)
    if mgr is None or not mgr.spans:
        return None
    arr = np.asarray(array)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous) or arr.nbytes == 0:
        return None
    found = mgr.find(int(arr.__array_interface__["data"][0]), arr.nbytes)
    return None if found is None else (found[0].region_id, found[1])


def staging_region_id(core: SessionCore) -> Optional[int]:
    """The id of the context's staging region, if it has one (for tests and diagnostics)."""
    mgr = core.caches.get(_KEY)
    return None if mgr is None or mgr.staging is None else mgr.staging.region.region_id


def off_reason(core: SessionCore) -> Optional[str]:
    """Why auto mode turned regions off for the context, or None."""
    mgr = core.caches.get(_KEY)
    return None if mgr is None else mgr.off_reason


def mode_changed(core: SessionCore) -> None:
    """``Context.host_regions`` was set: forget what auto mode remembered."""
    mgr = core.caches.get(_KEY)
    if mgr is not None:
        mgr.off_reason = None
        mgr.staging_off = None


def detach(core: SessionCore) -> None:
    """The context detaches: its regions are gone with the session; arrays stay memory."""
    mgr = core.caches.get(_KEY)
    if mgr is None:
        return
    mgr.closed = True
    for region in mgr.spans:
        region.alive = False
    mgr.spans = ()
    mgr.staging = None


def _address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def _queue_copy(commands: Any, label: str, region_id: int, offset: int, address: int, n: int,
                to_device: bool, stream_id: int, auto: bool = False) -> None:
    commands.add(label, auto=auto, region_copy=_ex.RegionCopyCommand(
        region_id=region_id, region_offset_bytes=offset, device=device_pointer(address),
        size_bytes=n, to_device=to_device, stream_id=stream_id))


def _staging(core: SessionCore, mgr: _Manager, label: str) -> Optional[_Staging]:
    if core.host_regions == "off":
        return None
    if mgr.staging is not None:
        return mgr.staging
    if not _usable(core, mgr) or (mgr.staging_off is not None and core.host_regions != "on"):
        return None
    try:
        region, base = _new_region(core, mgr, 2 * STAGING_HALF_BYTES, label)
    except _Fallback as fallback:
        _give_up(core, mgr, fallback)
        mgr.staging_off = str(fallback.error)
        return None
    mgr.staging = _Staging(region, base, STAGING_HALF_BYTES)
    return mgr.staging


def _transfer(core: SessionCore, address: int, view: memoryview, stream_id: int, sync: bool,
              label: str, to_device: bool) -> bool:
    n = view.nbytes
    mgr = core.caches.get(_KEY)
    if mgr is None:
        if n < STAGING_MIN_BYTES or core.host_regions == "off":
            return False
        mgr = _manager(core)
    if mgr.spans:
        found = mgr.find(_address_of(view), n)
        if found is not None:
            region, offset = found
            _queue_copy(core.commands, label, region.region_id, offset, address, n, to_device,
                        stream_id, auto=not sync)
            if sync:
                core.commands.sync(stream_id, label=label)
            return True
    if n < STAGING_MIN_BYTES:
        return False
    staging = _staging(core, mgr, label)
    if staging is None:
        return False
    if to_device:
        staging.upload(core, address, view, stream_id, sync, label)
    else:
        staging.download(core, address, view, stream_id, sync, label)
    return True


def try_upload(core: SessionCore, address: int, view: memoryview, stream_id: int, sync: bool,
               label: str) -> bool:
    """Queues the copy of ``view`` (a flat byte view, not empty) to device ``address`` through
    a region when one applies (and drains when ``sync``); False: the caller uses gRPC. The
    caller holds the session lock."""
    return _transfer(core, address, view, stream_id, sync, label, True)


def try_download(core: SessionCore, address: int, view: memoryview, stream_id: int, sync: bool,
                 label: str) -> bool:
    """Like :func:`try_upload`, from device ``address`` into the writable ``view``."""
    return _transfer(core, address, view, stream_id, sync, label, False)


class LaunchCopies:
    """The region copies of one launch's ``In``/``Out``/``InOut`` arguments.

    Built under the session lock from each handler's ``(view, copies_in, copies_out)``; an
    argument inside a region is copied from and to it directly; one of at least
    ``STAGING_MIN_BYTES`` elsewhere is staged when it fits (ins and outs each have the whole
    staging region: the outs are copied after the launch, which follows every in). Then:
    :meth:`copy_in` / :meth:`copy_out` (False: queue the gRPC copy instead), the launch's
    synchronisation, :meth:`sent` (also when that raised), :meth:`deliver`.
    """

    __slots__ = ("_core", "_label", "_stream_id", "_ins", "_outs", "_staging")

    def __init__(self, core: SessionCore, views: Sequence[Tuple[memoryview, bool, bool]],
                 stream_id: int, label: str) -> None:
        self._core = core
        self._label = label
        self._stream_id = stream_id
        self._ins: List[Optional[Tuple[int, int, bool]]] = []
        self._outs: List[Optional[Tuple[int, int, bool]]] = []
        self._staging: Optional[_Staging] = None
        mgr = core.caches.get(_KEY)
        if mgr is None and (core.host_regions == "off"
                            or all(v.nbytes < STAGING_MIN_BYTES for v, _, _ in views)):
            return
        mgr = _manager(core)
        in_at = out_at = 0
        for view, copies_in, copies_out in views:
            n = view.nbytes
            plan: Optional[Tuple[int, int, bool]] = None
            found = mgr.find(_address_of(view), n) if mgr.spans and n else None
            if found is not None:
                plan = (found[0].region_id, found[1], False)
            elif n >= STAGING_MIN_BYTES:
                staging = self._staging or _staging(core, mgr, label)
                if staging is not None:
                    capacity = 2 * staging.half
                    fits_in = not copies_in or in_at + n <= capacity
                    fits_out = not copies_out or out_at + n <= capacity
                    if fits_in and fits_out:
                        if self._staging is None:
                            self._staging = staging
                            core.commands.wait_batches(max(staging.busy), label=label)
                        rid = staging.region.region_id
                        self._ins.append((rid, in_at, True) if copies_in else None)
                        self._outs.append((rid, out_at, True) if copies_out else None)
                        if copies_in:
                            in_at += (n + 255) & ~255
                        if copies_out:
                            out_at += (n + 255) & ~255
                        continue
            self._ins.append(plan)
            self._outs.append(plan)

    def copy_in(self, index: int, view: memoryview, address: int) -> bool:
        """Queues handler ``index`` 's copy to ``address``; False: not through a region."""
        plan = self._ins[index] if self._ins else None
        if plan is None:
            return False
        region_id, offset, staged = plan
        if staged:
            assert self._staging is not None
            n = view.nbytes
            host_copy(self._staging.base[offset:offset + n], np.frombuffer(view, np.uint8))
        _queue_copy(self._core.commands, self._label, region_id, offset, address, view.nbytes,
                    True, self._stream_id)
        if staged:
            self.sent()
        return True

    def copy_out(self, index: int, view: memoryview, address: int) -> bool:
        """Queues handler ``index`` 's copy back from ``address``; False: not through a
        region."""
        plan = self._outs[index] if self._outs else None
        if plan is None:
            return False
        region_id, offset, staged = plan
        _queue_copy(self._core.commands, self._label, region_id, offset, address, view.nbytes,
                    False, self._stream_id)
        if staged:
            self.sent()
        return True

    def sent(self) -> None:
        """The launch's commands are queued (or sent): the staging region is busy until the
        batch that carries them is answered."""
        if self._staging is not None:
            last = self._core.commands.last_batch
            self._staging.busy = [last, last]

    def deliver(self, views: Sequence[memoryview]) -> None:
        """After the launch's synchronisation: copies staged outs into their arrays."""
        if self._staging is None:
            return
        base = self._staging.base
        for plan, view in zip(self._outs, views):
            if plan is not None and plan[2]:
                offset = plan[1]
                host_copy(np.frombuffer(view, np.uint8), base[offset:offset + view.nbytes])
