"""CUDA IPC between sessions of one tenant, and profiler control (``pycuda.driver``'s
``mem_get_ipc_handle``, ``IPCMemoryHandle``, ``start_profiler``/``stop_profiler``; IPC event
handles are ``Event.ipc_handle``/``Event.from_ipc_handle``, in ``gpurpc._streams``).

``gpurpc.driver`` re-exports these; use them from there.

IPC. Each gpurpc context is a session, and each session is its own process on the daemon, so
sharing device memory between two contexts is CUDA IPC on the daemon's side
(``SessionService.ExportMemory``/``OpenMemoryHandle``, session_service.proto).
:func:`mem_get_ipc_handle` answers an opaque 32-byte handle (``bytes``: pickle it, send it to
another process of yours) that only sessions of the same tenant on the same device of the same
daemon run can open; :class:`IPCMemoryHandle` opens it as device memory of the current
context. The exporter cannot free the memory while another session has it open
(:class:`LaunchError` naming those sessions); when the exporting session ends, the memory
opened from it is closed in the other sessions. The fake backend cannot share memory between
processes and raises :class:`Error` (UNIMPLEMENTED) on export.

Events are shared the same way (``SessionService.ExportEvent``/``OpenEventHandle``):
``Event(event_flags.INTERPROCESS | event_flags.DISABLE_TIMING)`` makes a shareable event
(INTERPROCESS needs DISABLE_TIMING, as in CUDA: :class:`LogicError` otherwise),
``Event.ipc_handle()`` answers its 32-byte handle (the same one each time), and
``Event.from_ipc_handle(handle)`` opens it in the current context as an :class:`Event` that
its streams record, wait on (``Stream.wait_for_event``: one context's stream waits for
another's work), query and synchronize; it has no timing. The same handle rules apply (same
tenant, same device, not the exporter's own context, open once per context). Destroying the
exported event (garbage collection) stops new opens, but the event lives on for the contexts
that opened it until the exporting context ends; then it is closed in those contexts too.
The fake backend cannot make interprocess events: :class:`Error` (UNIMPLEMENTED).

Profiling. :func:`start_profiler`/:func:`stop_profiler` are ``cuProfilerStart``/``Stop`` in the
session's worker: the range that a profiler the daemon's operator attached records (for
example ``nsys profile --capture-range=cudaProfilerApi gpurpcd ...``). Without one attached
they do nothing, as locally.
"""
from __future__ import annotations

import enum
from typing import Any, Union

from ._context import _current_core
from ._errors import LogicError
from ._memory import (DeviceAllocation, _address, _core_for, _find_allocation,
                      _register_allocation)
from .v1 import module_service_pb2 as _mod, session_service_pb2 as _ses

__all__ = ["ipc_mem_flags", "IPCMemoryHandle", "mem_get_ipc_handle", "start_profiler",
           "stop_profiler"]


class ipc_mem_flags(enum.IntFlag):  # noqa: N801 - PyCUDA's name
    """``CUipcMem_flags``: the daemon always opens with lazy peer access."""

    LAZY_ENABLE_PEER_ACCESS = 1


def mem_get_ipc_handle(devptr: Any) -> bytes:
    """An IPC handle for the allocation that ``devptr`` (a :class:`DeviceAllocation`, a
    GPUArray or an address in one) lies in (``cuIpcGetMemHandle``): 32 opaque bytes that
    another session of this tenant opens with :class:`IPCMemoryHandle`. The same allocation
    always gives the same handle.

    :raises LogicError: the pointer lies in no allocation of its session.
    :raises Error: the backend cannot share memory (the fake: UNIMPLEMENTED).
    """
    label = "mem_get_ipc_handle"
    core = _core_for(devptr, label)
    address = _address(devptr)
    alloc = _find_allocation(core, address)
    if alloc is None:
        raise LogicError(f"{label}: 0x{address:x} lies in no live allocation of session "
                         f"{core.session_id}", operation=label)
    reply = core.call("SessionService.ExportMemory",
                      _ses.ExportMemoryRequest(buffer_id=alloc.buffer_id), op=label)
    return bytes(reply.handle)


class IPCMemoryHandle(DeviceAllocation):
    """Device memory that another session of this tenant exported
    (``pycuda.driver.IPCMemoryHandle``), opened in the current context
    (``cuIpcOpenMemHandle``). Use it like a :class:`DeviceAllocation`: ``int()`` is its
    address in this context. :meth:`close` (or :meth:`free`, or garbage collection) unmaps it;
    the memory stays the exporter's.

    :raises LogicError: a handle this tenant cannot open (unknown, another tenant's, or its
        export ended), a handle of this context's own memory, of another device, or one this
        context has open already.
    """

    def __init__(self, ipc_handle: Union[bytes, bytearray, memoryview],
                 flags: Union[ipc_mem_flags, int] = ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS) -> None:
        if int(flags) not in (0, int(ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS)):
            raise LogicError(f"IPCMemoryHandle: flags {int(flags)} is not an ipc_mem_flags "
                             "value (LAZY_ENABLE_PEER_ACCESS = 1)")
        if not isinstance(ipc_handle, (bytes, bytearray, memoryview)):
            raise TypeError("IPCMemoryHandle: the handle is the bytes mem_get_ipc_handle "
                            f"returned, not {type(ipc_handle).__name__}")
        handle = bytes(ipc_handle)
        core = _current_core("IPCMemoryHandle")
        reply = core.call("SessionService.OpenMemoryHandle",
                          _ses.OpenMemoryHandleRequest(handle=handle), op="IPCMemoryHandle")
        info = reply.buffer
        super().__init__(core, info.buffer_id, info.device_address, info.size_bytes)
        _register_allocation(core, self)

    def close(self) -> None:
        """Unmaps the memory from this context (``cuIpcCloseMemHandle``); twice is a no-op."""
        self.free()

    def __repr__(self) -> str:
        return f"<gpurpc.driver.IPCMemoryHandle 0x{int(self):x} ({self.size} bytes)>"


def _set_profiling(enabled: bool, op: str) -> None:
    core = _current_core(op)
    core.call("ModuleService.SetProfiling", _mod.SetProfilingRequest(enabled=enabled), op=op)


def start_profiler() -> None:
    """``cuProfilerStart`` in the current context's worker (see the module notes)."""
    _set_profiling(True, "start_profiler")


def stop_profiler() -> None:
    """``cuProfilerStop`` in the current context's worker."""
    _set_profiling(False, "stop_profiler")
