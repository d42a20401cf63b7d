"""The direct channel: a same-host session's command stream straight to its worker.

A client on the daemon's host may skip the front end's relay for its launches and
synchronisations (``HostRegionService.OpenDirectChannel``, docs/DESIGN.md §7.2): it hands the
session's worker one end of a connected Unix stream socket over the region socket, and the
worker serves ``ExecutionService`` on it as a second gRPC server whose calls stand for the
session. The C++ client makes a socketpair; grpcio cannot make a channel from a descriptor, so
here:

1. ``OpenDirectChannel`` (through the session, so the front end authenticates it) answers a
   one-time ticket and the region socket's path;
2. a listening socket in a fresh private directory (``tempfile.mkdtemp``: mode 0700, so only
   this user can reach it) takes grpcio's connection to ``unix:<that path>``; the accepted end
   must come from this very process (``SO_PEERCRED``), or it is dropped and waited for again;
3. the accepted end goes to the worker with the ticket (``AttachHostRegionRequest`` with
   ``direct_channel``, the descriptor attached with ``SCM_RIGHTS``), the listener and its
   directory are removed at once (nothing can connect again, and grpcio cannot reconnect
   elsewhere), and the channel is used once grpcio sees the worker's HTTP/2 settings.

``attach_exchange`` is the region socket's exchange, shared with ``_regions``.
"""
from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any, List, Tuple

import grpc

from ._errors import status_code_from_int
from .v1 import host_region_service_pb2 as _hr

REPLY_MAX_BYTES = 4096
OPEN_TIMEOUT_S = 5.0  # the whole opening (or the call timeout when shorter)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def attach_exchange(path: str, request: bytes, fd: int, timeout: float) -> bytes:
    """Sends one ``AttachHostRegionRequest`` datagram with ``fd`` attached over the region
    socket ``path`` and returns the answer's bytes (empty: the daemon hung up). Raises
    ``socket.timeout`` or ``OSError``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        socket.send_fds(sock, [request], [fd])
        return sock.recv(REPLY_MAX_BYTES)


class DirectChannelError(Exception):
    """Why no direct channel could be opened (the caller keeps the relay)."""


def open_direct_channel(reply: Any, session_id: int, options: List[Tuple[str, Any]],
                        timeout: float) -> grpc.Channel:
    """A gRPC channel to the session's worker, from ``reply`` (OpenDirectChannelResponse).
    Raises DirectChannelError naming the step that failed."""
    deadline = time.monotonic() + timeout
    folder = tempfile.mkdtemp(prefix="gpurpc-direct-")
    path = os.path.join(folder, "worker.sock")
    channel = None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            channel = grpc.insecure_channel(
                "unix:" + path, options=options + [("grpc.use_local_subchannel_pool", 1)])
            ready = grpc.channel_ready_future(channel)  # starts connecting
            accepted = _accept_own(listener, deadline)
        os.unlink(path)  # nothing can connect again
        with accepted:
            request = _hr.AttachHostRegionRequest(
                session_id=session_id, ticket=reply.attach_ticket,
                direct_channel=True).SerializeToString()
            try:
                data = attach_exchange(reply.region_socket, request, accepted.fileno(),
                                       max(deadline - time.monotonic(), 0.001))
            except OSError as e:  # socket.timeout included
                raise DirectChannelError(f"the region socket {reply.region_socket!r}: "
                                         f"{e.strerror or e}") from None
        if not data:
            raise DirectChannelError("the daemon closed the region socket without an answer")
        try:
            answer = _hr.AttachHostRegionReply.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError differs between versions
            raise DirectChannelError(f"the daemon answered {len(data)} bytes that are no "
                                     "AttachHostRegionReply") from None
        if answer.code != 0:
            raise DirectChannelError(f"the daemon refused it: {answer.message} "
                                     f"[{status_code_from_int(answer.code).name}]")
        try:
            ready.result(timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.FutureTimeoutError:
            raise DirectChannelError(f"the worker did not answer on it within {timeout:g} s"
                                     ) from None
        result, channel = channel, None
        return result
    except OSError as e:
        raise DirectChannelError(f"the private socket {path!r}: {e.strerror or e}") from None
    finally:
        if channel is not None:
            channel.close()
        shutil.rmtree(folder, ignore_errors=True)


def _accept_own(listener: socket.socket, deadline: float) -> socket.socket:
    """The first connection from this process (another one, only possible for this user, is
    closed)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DirectChannelError("grpcio did not connect to the private socket in time")
        listener.settimeout(remaining)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        pid, _uid, _gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if pid == os.getpid():
            conn.settimeout(None)
            return conn
        conn.close()

