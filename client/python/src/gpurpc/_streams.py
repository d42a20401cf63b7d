"""Streams and events for :mod:`gpurpc.driver`: :class:`Stream` (with CUDA graph capture),
:class:`Event`, and ``_stream_id`` (a stream argument as the daemon's stream id).
``gpurpc.driver`` re-exports the public names; use them from there.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Union

import grpc
import numpy as np

from . import _core
from ._core import SessionCore
from ._context import _current_core
from ._enums import capture_mode, capture_status, event_flags
from ._errors import Error, LaunchError, LogicError
from .v1 import execution_service_pb2 as _ex, session_service_pb2 as _sess

if TYPE_CHECKING:  # pragma: no cover
    from ._graphs import Graph

__all__ = ["Stream", "Event"]

# The session cache key of the ids of streams that capture a graph (between this client's
# begin_capture and end_capture).
_CAPTURING = "capturing_streams"


def capturing_streams(core: SessionCore) -> "set[int]":
    """The ids of the session's streams that capture a graph now, as far as this client knows
    (it begins and ends every capture)."""
    return core.caches.get(_CAPTURING, set())


class Stream:
    """A stream of the session (``pycuda.driver.Stream``); ``handle`` is its id."""

    def __init__(self, flags: int = 0, *, _core: Optional[SessionCore] = None) -> None:
        core = _core or _current_core("Stream")
        reply = core.call("ExecutionService.CreateStream",
                          _ex.CreateStreamRequest(non_blocking=bool(int(flags) & 1)),
                          op="Stream")
        self._core = core
        self.handle: int = reply.stream_id
        finalizer = weakref.finalize(self, core.defer_release, "stream", self.handle)
        finalizer.atexit = False

    def synchronize(self, *, timeout: Optional[float] = None) -> None:
        """Waits for the stream's work; raises any pending asynchronous error. Waits at most
        ``timeout`` seconds (default: the context's call timeout; then
        :class:`CallTimeoutError`, and the work goes on)."""
        core = self._core
        with core.lock:
            core.check_open("Stream.synchronize")
            limit = _core.resolve_timeout(timeout) if timeout is not None else None
            core.commands.sync(self.handle, label="Stream.synchronize", timeout=limit)
            if core.has_releases:
                core.process_releases()

    def is_done(self) -> bool:
        """True when all work queued on the stream has completed."""
        core = self._core
        with core.lock:
            core.drain()
            return bool(core.call("ExecutionService.QueryStream",
                                  _ex.QueryStreamRequest(stream_id=self.handle),
                                  op="Stream.is_done").done)

    def wait_for_event(self, evt: "Event") -> None:
        """Makes later work on this stream wait for ``evt``."""
        core = self._core
        with core.lock:
            core.check_open("Stream.wait_for_event")
            core.commands.add("Stream.wait_for_event", wait_event=_ex.WaitEventCommand(
                event_id=evt.handle, stream_id=self.handle))

    # -- CUDA graphs ----------------------------------------------------------------------

    def begin_capture(self, capture_mode: int = capture_mode.GLOBAL) -> None:
        """Starts capturing this stream's work into a graph (``cuStreamBeginCapture``).

        Until :meth:`end_capture`, kernel launches, memsets and device-to-device copies on this
        stream do not run: they become the graph's nodes. Work queued before runs first (its
        errors raise here). Meanwhile the daemon refuses other work on this stream (host
        copies, event records and waits, ``synchronize``) with :class:`LogicError` and the
        capture goes on; while a blocking stream (``Stream()`` without
        ``stream_flags.NON_BLOCKING``) captures, the default stream cannot be used, nor
        ``Context.synchronize`` while any stream captures. ``capture_mode`` is checked and
        otherwise ignored: the daemon always captures in RELAXED mode.
        """
        mode = int(capture_mode)
        core = self._core
        with core.lock:
            core.check_open("Stream.begin_capture")
            core.drain()
            core.call("ExecutionService.BeginCapture",
                      _ex.BeginCaptureRequest(stream_id=self.handle, mode=mode),
                      op="Stream.begin_capture")
            core.caches.setdefault(_CAPTURING, set()).add(self.handle)

    def end_capture(self) -> "Graph":
        """Ends the capture (``cuStreamEndCapture``) and returns the :class:`Graph` of what it
        recorded (after sending the work queued before)."""
        core = self._core
        with core.lock:
            core.check_open("Stream.end_capture")
            core.drain()
            try:
                reply = core.call("ExecutionService.EndCapture",
                                  _ex.EndCaptureRequest(stream_id=self.handle),
                                  op="Stream.end_capture")
            finally:
                # Over either way: cuStreamEndCapture ends a capture that it reports failed.
                core.caches.get(_CAPTURING, set()).discard(self.handle)
        from ._graphs import Graph  # the layer above this one
        return Graph(core, reply.graph_id, reply.node_count)

    def is_capturing(self) -> bool:
        """True while the stream captures (``cuStreamIsCapturing``)."""
        return self.get_capture_status() != capture_status.NONE

    def get_capture_status(self) -> capture_status:
        """The stream's :class:`capture_status` (INVALIDATED: the driver gave up the capture;
        :meth:`end_capture` then raises)."""
        core = self._core
        with core.lock:
            core.check_open("Stream.get_capture_status")
            core.drain()
            reply = core.call("ExecutionService.GetCaptureInfo",
                              _ex.GetCaptureInfoRequest(stream_id=self.handle),
                              op="Stream.get_capture_status")
        return capture_status(reply.status)

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Stream {self.handle}>"


class Event:
    """An event (``pycuda.driver.Event``); times are measured by the server's GPU.

    ``Event(event_flags.INTERPROCESS | event_flags.DISABLE_TIMING)`` can be shared with the
    tenant's other contexts: :meth:`ipc_handle` exports it, :meth:`from_ipc_handle` opens it
    there (see ``gpurpc._ipc``). INTERPROCESS without DISABLE_TIMING is a
    :class:`LogicError`, as in CUDA.
    """

    def __init__(self, flags: int = 0, *, _core: Optional[SessionCore] = None) -> None:
        core = _core or _current_core("Event")
        flags = int(flags)
        reply = core.call("ExecutionService.CreateEvent", _ex.CreateEventRequest(
            disable_timing=bool(flags & event_flags.DISABLE_TIMING),
            blocking_sync=bool(flags & event_flags.BLOCKING_SYNC),
            interprocess=bool(flags & event_flags.INTERPROCESS)), op="Event")
        self._register(core, reply.event_id)

    def _register(self, core: SessionCore, event_id: int) -> None:
        """Makes this object event ``event_id`` of ``core``, destroyed (deferred) when it is
        garbage collected."""
        self._core = core
        self.handle: int = event_id
        finalizer = weakref.finalize(self, core.defer_release, "event", self.handle)
        finalizer.atexit = False

    def ipc_handle(self) -> bytes:
        """An IPC handle for this event (``cuIpcGetEventHandle``): 32 opaque bytes that another
        context of this tenant on the same device opens with :meth:`from_ipc_handle`. The same
        event always gives the same handle. Destroying this event (garbage collection) stops
        new opens; contexts that opened it keep using it until this context ends.

        :raises LogicError: the event was not created with ``event_flags.INTERPROCESS |
            event_flags.DISABLE_TIMING`` (on the fake backend, which cannot share events,
            creating such an event already raises :class:`Error`, UNIMPLEMENTED), or was
            itself opened from a handle.
        :raises MemoryError: this context has exported 4096 events (each lasts until the
            context ends).
        """
        core = self._core
        with core.lock:
            core.check_open("Event.ipc_handle")
            core.drain()
            reply = core.call("SessionService.ExportEvent",
                              _sess.ExportEventRequest(event_id=self.handle),
                              op="Event.ipc_handle")
        return bytes(reply.handle)

    @staticmethod
    def from_ipc_handle(handle: Union[bytes, bytearray, memoryview]) -> "Event":
        """Opens in the current context an event that another context of this tenant exported
        with :meth:`ipc_handle` (``cuIpcOpenEventHandle``). The result is an :class:`Event` of
        this context: record it, wait on it (:meth:`Stream.wait_for_event`), query and
        synchronize it; it has no timing (:meth:`time_since` raises :class:`LogicError`).
        Garbage collection closes it. When the exporting context ends it is closed here too
        (using it then raises :class:`LogicError`).

        :raises TypeError: ``handle`` is not bytes-like.
        :raises LogicError: a handle this tenant cannot open (unknown, another tenant's, a
            memory handle, or its event was destroyed or its context ended), a handle of this
            context's own event, of another device, or one this context has open already.
        :raises MemoryError: the context has as many events as its tenant's quota allows.
        """
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError("Event.from_ipc_handle: the handle is the bytes Event.ipc_handle "
                            f"returned, not {type(handle).__name__}")
        core = _current_core("Event.from_ipc_handle")
        reply = core.call("SessionService.OpenEventHandle",
                          _sess.OpenEventHandleRequest(handle=bytes(handle)),
                          op="Event.from_ipc_handle")
        event = Event.__new__(Event)
        event._register(core, reply.event_id)
        return event

    def record(self, stream: Optional[Stream] = None) -> "Event":
        """Records the event on ``stream`` (default stream if None); returns self."""
        core = self._core
        with core.lock:
            core.check_open("Event.record")
            core.commands.add("Event.record", record_event=_ex.RecordEventCommand(
                event_id=self.handle, stream_id=_stream_id(stream)))
        return self

    def synchronize(self, *, timeout: Optional[float] = None) -> "Event":
        """Waits for the event; returns self. Waits at most ``timeout`` seconds (default: the
        context's call timeout; then :class:`CallTimeoutError`, and the work goes on)."""
        core = self._core
        limit = _core.resolve_timeout(timeout) if timeout is not None else None
        with core.lock:
            core.check_open("Event.synchronize")
            # One sync marker on the command stream, after the queued work: one round trip.
            core.commands.sync(label="Event.synchronize", timeout=limit, event_id=self.handle)
            if core.has_releases:
                core.process_releases()
        return self

    def query(self) -> bool:
        """True when the event has completed (or was never recorded)."""
        core = self._core
        with core.lock:
            core.drain()
            return bool(core.call("ExecutionService.QueryEvent",
                                  _ex.QueryEventRequest(event_id=self.handle),
                                  op="Event.query").done)

    def _elapsed_ms(self, start: "Event", end: "Event", label: str) -> float:
        core = self._core
        with core.lock:
            core.drain()
            request = _ex.EventElapsedTimeRequest(start_event_id=start.handle,
                                                  end_event_id=end.handle)
            try:
                return float(core.call("ExecutionService.EventElapsedTime", request,
                                       op=label).elapsed_ms)
            except LaunchError as e:
                # FAILED_PRECONDITION here usually means "not recorded / timing disabled"
                # (CUDA_ERROR_INVALID_HANDLE: a LogicError), unless the session faulted.
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and not _session_faulted(core):
                    raise LogicError(str(e), code=e.code, details=e.details,
                                     operation=e.operation) from None
                raise

    def time_since(self, event: "Event") -> float:
        """Milliseconds from ``event`` to this event (both must have completed)."""
        return self._elapsed_ms(event, self, "Event.time_since")

    def time_till(self, event: "Event") -> float:
        """Milliseconds from this event to ``event``."""
        return self._elapsed_ms(self, event, "Event.time_till")

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Event {self.handle}>"


def _session_faulted(core: SessionCore) -> bool:
    if core.health != "active":
        return True
    try:
        reply = core.client.call("SessionService.KeepAlive", _sess.KeepAliveRequest(),
                                 core.metadata,
                                 timeout=min(core.timeout, _core.KEEPALIVE_TIMEOUT_S))
    except Error:
        return True
    if reply.state == _sess.SESSION_STATE_FAULTED:
        core.fault.setdefault("cause", reply.fault_cause)
        return True
    return False


def _stream_id(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    raise TypeError(f"stream must be a gpurpc.driver.Stream or None, got {type(stream).__name__}")


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
