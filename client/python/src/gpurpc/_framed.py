"""The framed command channel: a same-host session's command stream on a socket of its own,
straight to the session's worker and without gRPC (``host_region_service.proto``,
``OpenDirectChannel`` and ``AttachHostRegionRequest.framed_commands``).

grpcio costs about 190 us of CPU per call on top of the round trip itself (docs/DESIGN.md
section 7.2), which bounds every synchronising call of a Python program. On this channel a
batch is one ``send`` from the calling thread and a reply one ``recv`` on the reader thread:

- each message is a 4-byte little-endian length followed by that many bytes, a serialised
  ``CommandBatch`` from us and a ``CommandReply`` from the worker, one reply per batch, in
  order, with the meaning ``ExecutionService.CommandStream`` gives them;
- the worker ends the channel after a reply that reports a sticky fault or a protocol error,
  as ``CommandStream`` would end the call.

:class:`FramedCall` stands where :class:`~gpurpc._core.CommandStream` otherwise holds the
gRPC call and its request iterator (``_Outbox``): ``put`` sends, iterating yields replies,
``close`` half-closes and ``cancel`` ends it. A batch is sent on the calling thread when the
socket takes it at once; what it cannot take yet (a large batch while the worker is busy) goes
to a writer thread, so that queueing asynchronous work never blocks on the worker.

The channel is opened once per session, on its first batch, when the session uses same-host
features (``host_regions`` not "off", a Unix socket target); any failure to open it leaves the
session on the gRPC stream, and so does the end of the channel.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from typing import Any, Callable, Deque, Optional

import grpc

from .v1 import execution_service_pb2, host_region_service_pb2

__all__ = ["FramedCall", "FramedEnd", "open_framed_call", "SUPPORTED"]

log = logging.getLogger("gpurpc")

HEADER = struct.Struct("<I")
# The longest reply accepted: the daemon's message limit (kMaxMessageBytes). A longer
# announcement ends the channel.
MAX_REPLY_BYTES = 80 << 20
_READ_BYTES = 256 << 10          # one recv of the reader (more than a small reply)
_ATTACH_REPLY_MAX_BYTES = 4096  # an AttachHostRegionReply datagram
OPEN_TIMEOUT_S = 2.0            # opening the channel (or the call timeout when shorter)

SUPPORTED = hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX") \
    and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "MSG_DONTWAIT")


class FramedEnd(grpc.RpcError):
    """How a framed channel ended, shaped like the ``grpc.RpcError`` of a gRPC stream (the
    command stream's reader handles both alike)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FramedCall:
    """One framed channel: the command stream's request sink and reply iterator at once."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        # Reentrant: the garbage collector may close a dropped session (and so this channel)
        # on a thread that holds it.
        self._cv = threading.Condition(threading.RLock())
        self._backlog: Deque[memoryview] = collections.deque()  # for the writer thread
        self._writing = False      # the writer thread holds bytes it has not sent yet
        self._writer: Optional[threading.Thread] = None
        self._half_closed = False  # close(): no more batches
        self._cancelled = False    # cancel(): the stream is abandoned
        self._ended = False        # the reader is done: nothing is sent any more
        self._send_failed = ""     # why a send failed
        self._buffer = bytearray(_READ_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    # -- the sending side (the command stream's outbox) ------------------------------------

    def put(self, payload: bytes, batch: Any = None) -> None:
        """Sends one batch: on this thread when the socket takes all of it now, otherwise
        through the writer thread (in order either way). A channel that cannot be written any
        more is shut down, so that the reader ends it and reports the batches in flight."""
        header = HEADER.pack(len(payload))
        with self._cv:
            if self._half_closed or self._send_failed or self._ended:
                return
            try:
                if not self._backlog and not self._writing:
                    try:
                        sent = self._sock.sendmsg([header, payload], (), socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    except OSError as e:
                        self._fail_sending(str(e))
                        return
                    if sent == len(header) + len(payload):
                        return
                    if sent < len(header):
                        self._backlog.append(memoryview(header)[sent:])
                        self._backlog.append(memoryview(payload))
                    else:
                        self._backlog.append(memoryview(payload)[sent - len(header):])
                else:
                    self._backlog.append(memoryview(header))
                    self._backlog.append(memoryview(payload))
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                    name="gpurpc-framed-writer")
                    self._writer.start()
                self._cv.notify_all()
            except Exception as e:  # noqa: BLE001 - e.g. a writer thread that cannot start
                # Half a message may be on the wire: end the channel (the reader reports its
                # batches; the session goes on over gRPC).
                self._fail_sending(f"{type(e).__name__}: {e}")
            except BaseException as e:
                # An interrupt between a partial send and queueing the rest: the same.
                self._fail_sending(f"interrupted by {type(e).__name__}")
                raise

    def extend_last(self, batch: Any, payload: bytes, on_extend: Callable[[], None]) -> bool:
        """Batches are sent at once: the last one is never waiting to grow."""
        return False

    def _fail_sending(self, why: str) -> None:
        # Caller holds _cv.
        self._send_failed = f"sending a batch on the framed command channel: {why}"
        self._backlog.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._cv.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._backlog and not (self._half_closed or self._send_failed
                                                 or self._cancelled or self._ended):
                    self._cv.wait()
                if not self._backlog:
                    if self._half_closed and not (self._send_failed or self._cancelled):
                        self._shutdown(socket.SHUT_WR)
                    self._writer = None
                    return
                piece = self._backlog.popleft()
                self._writing = True
            failed = ""
            try:
                self._sock.sendall(piece)
            except OSError as e:
                failed = str(e) or type(e).__name__
            with self._cv:
                self._writing = False
                if failed:
                    self._fail_sending(failed)
                self._cv.notify_all()

    def _shutdown(self, how: int) -> None:
        try:
            self._sock.shutdown(how)
        except OSError:
            pass

    def close(self) -> None:
        """No more batches (the gRPC stream's half-close): the worker answers what it has and
        ends the channel; the reader reads those answers."""
        with self._cv:
            if self._half_closed:
                return
            self._half_closed = True
            if not self._backlog and not self._writing:
                self._shutdown(socket.SHUT_WR)
            self._cv.notify_all()

    def cancel(self) -> None:
        """Abandons the channel at once (the reader ends with CANCELLED)."""
        with self._cv:
            self._cancelled = True
            self._backlog.clear()
            self._shutdown(socket.SHUT_RDWR)
            self._cv.notify_all()

    def discard(self) -> None:
        """Ends and closes a channel that no reader ever iterated."""
        self.cancel()
        self._sock.close()

    # -- the receiving side (the command stream's reader) ----------------------------------

    def __iter__(self) -> "FramedCall":
        return self

    def _fill(self, need: int) -> bool:
        """Reads until ``need`` bytes are buffered; False at a clean end of the channel (no
        byte of a new message), FramedEnd for an end mid-message or an error."""
        while self._end - self._start < need:
            if self._start and (self._end == self._start or len(self._buffer) - self._start
                                < need):
                left = self._end - self._start
                self._view[:left] = self._view[self._start:self._end]
                self._start, self._end = 0, left
            if need > len(self._buffer):
                grown = bytearray(need)
                grown[:self._end] = self._view[:self._end]
                self._view.release()
                self._buffer = grown
                self._view = memoryview(grown)
            try:
                n = self._sock.recv_into(self._view[self._end:])
            except InterruptedError:
                continue
            except OSError as e:
                raise self._end_error(f"reading from the framed command channel: {e}") from None
            if n == 0:
                if self._end == self._start:
                    return False
                raise self._end_error("the daemon closed the framed command channel mid-message")
            self._end += n
        return True

    def _end_error(self, details: str) -> FramedEnd:
        if self._cancelled:
            return FramedEnd(grpc.StatusCode.CANCELLED, "the command stream was cancelled")
        return FramedEnd(grpc.StatusCode.UNAVAILABLE, details)

    def __next__(self) -> Any:
        try:
            if not self._fill(HEADER.size):
                if self._cancelled:
                    raise FramedEnd(grpc.StatusCode.CANCELLED, "the command stream was cancelled")
                if self._send_failed:
                    raise FramedEnd(grpc.StatusCode.UNAVAILABLE, self._send_failed)
                if not self._half_closed:
                    # The worker ended the channel: after a reply that ended the stream, or
                    # it is gone (the command stream asks the session's watch why).
                    raise FramedEnd(grpc.StatusCode.UNAVAILABLE,
                                    "the session's worker ended the framed command channel")
                raise StopIteration
            (length,) = HEADER.unpack_from(self._buffer, self._start)
            if length > MAX_REPLY_BYTES:
                raise self._end_error(f"the daemon announced a reply of {length} bytes on the "
                                  f"framed command channel, more than {MAX_REPLY_BYTES}")
            if not self._fill(HEADER.size + length):
                raise self._end_error("the daemon closed the framed command channel mid-message")
            begin = self._start + HEADER.size
            data = self._view[begin:begin + length]
            try:
                try:
                    message = execution_service_pb2.CommandReply.FromString(data)
                except TypeError:  # a protobuf that parses bytes only
                    message = execution_service_pb2.CommandReply.FromString(bytes(data))
            except Exception:  # noqa: BLE001 - protobuf's DecodeError differs between versions
                raise self._end_error(f"the daemon sent {length} bytes that are no CommandReply on "
                                  "the framed command channel") from None
            finally:
                data.release()
            self._start = begin + length
            if len(self._buffer) > _READ_BYTES and self._start == self._end:
                # A large reply's buffer is not kept.
                self._view.release()
                self._buffer = bytearray(_READ_BYTES)
                self._view = memoryview(self._buffer)
                self._start = self._end = 0
            return message
        except BaseException:
            self._finish()
            raise

    def _finish(self) -> None:
        """The reader is done: ends the writer and closes the socket."""
        with self._cv:
            self._ended = True
            self._backlog.clear()
            self._shutdown(socket.SHUT_RDWR)
            writer = self._writer
            self._cv.notify_all()
        if writer is not None and writer is not threading.current_thread():
            writer.join()
        self._sock.close()


def send_attach(path: str, request: bytes, fd: int, timeout: float) -> bytes:
    """The attach exchange of host_region_service.proto on the region socket at ``path``: one
    datagram of ``request`` (a serialised AttachHostRegionRequest) with ``fd`` attached, then
    the answer's bytes (empty when the daemon closed without one). Shared by regions
    (_regions._attach) and the framed channel; each reads the answer its own way. Raises
    OSError (socket.timeout after ``timeout`` seconds) as the socket does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        socket.send_fds(sock, [request], [fd])
        return sock.recv(_ATTACH_REPLY_MAX_BYTES)


def open_framed_call(client: Any, metadata: Any, session_id: int,
                     timeout: float) -> Optional[FramedCall]:
    """Opens the framed command channel of session ``session_id``: a ticket from
    ``HostRegionService.OpenDirectChannel`` (on the session's gRPC channel), then one end of a
    socketpair sent on the daemon's region socket, both within OPEN_TIMEOUT_S (or ``timeout``
    when shorter): the first batch waits for this, and a daemon too slow to answer is better
    left to the gRPC stream. None, with the reason logged at debug level, when any step
    fails: the session then keeps the gRPC stream."""
    from ._core import _unary  # a late import: _core imports this module
    deadline = time.monotonic() + min(timeout, OPEN_TIMEOUT_S)
    ours: Optional[socket.socket] = None
    try:
        method = client.method("HostRegionService.OpenDirectChannel")
        opened = _unary(method, host_region_service_pb2.OpenDirectChannelRequest(),
                        tuple(metadata) + tuple(client.auth_metadata),
                        max(deadline - time.monotonic(), 0.001),
                        "HostRegionService.OpenDirectChannel")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            request = host_region_service_pb2.AttachHostRegionRequest(
                session_id=session_id, ticket=opened.attach_ticket, direct_channel=True,
                framed_commands=True).SerializeToString()
            data = send_attach(opened.region_socket, request, theirs.fileno(),
                               max(deadline - time.monotonic(), 0.001))
        finally:
            theirs.close()
        answer = host_region_service_pb2.AttachHostRegionReply.FromString(data)
        if not data or answer.code != 0:
            log.debug("gpurpc: session %d keeps the gRPC command stream: the framed channel "
                      "was refused: %s (code %d)", session_id,
                      answer.message if data else "no answer", answer.code)
            ours.close()
            return None
    except Exception as e:  # noqa: BLE001 - any failure only costs the faster path
        why = e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else e
        log.debug("gpurpc: session %d keeps the gRPC command stream: opening the framed "
                  "channel: %s", session_id, why)
        if ours is not None:
            ours.close()
        return None
    except BaseException:  # an interrupt: nothing is left open
        if ours is not None:
            ours.close()
        raise
    return FramedCall(ours)
