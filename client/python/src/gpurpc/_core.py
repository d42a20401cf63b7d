"""Connection, session and command-stream machinery shared by the public modules.

Nothing here is public API: ``gpurpc.driver`` wraps it in PyCUDA's vocabulary.

Ordering model. Every stream-ordered operation of a session (launch, memset, copies, inline
uploads and downloads, event records, stream waits) goes through one bidirectional
``ExecutionService.CommandStream`` per session, in order. Commands are buffered client-side
and sent as a ``CommandBatch`` when the batch is full (1024 commands or 8 MiB), when no batch
is in flight (so a lone launch starts at once), or when the caller needs a result. A background
thread reads the replies (exactly one per batch), delivers download data and records errors;
errors of asynchronous commands are raised at the next synchronising call, like CUDA's.
Unary RPCs that must observe earlier work (frees, event queries, streaming transfers) first
*drain* the command stream: every batch sent is acknowledged, hence enqueued on the server.

Deadlines. Every call that waits for the daemon has one: the call timeout (``timeout=`` of
``Client``/``driver.init``, else ``$GPURPC_TIMEOUT``, else 300 s; per session
``SessionCore.timeout``). A unary call gets it as its gRPC deadline; the command stream,
which lives as long as the session, gets it per wait (a drain, and the wait for room when
too many batches are unanswered); a streamed transfer gets it per step (no chunk moved for
that long cancels it). A passed deadline raises :class:`CallTimeoutError`.

Liveness. Each session holds one ``SessionService.WatchSession`` stream open, read by one
daemon thread per session, and re-opens it with a backoff while the session is open. The
watch records faults and the loss of the session (NOT_FOUND: reclaimed, closed, or the
daemon restarted); later calls raise the recorded error at once.
"""
from __future__ import annotations

import collections
import math
import operator
import os
import re
import socket
import stat
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import grpc

from . import _framed, debug
from ._errors import (
    CallTimeoutError,
    Error,
    LaunchError,
    LogicError,
    RuntimeError,
    SessionLost,
    error_from_rpc,
    error_from_status,
    session_lost_error,
    status_code_from_int,
    timeout_error,
)
from .v1 import (
    admin_service_pb2,
    common_pb2,
    device_service_pb2,
    execution_service_pb2,
    host_region_service_pb2,
    memory_service_pb2,
    module_service_pb2,
    session_service_pb2,
)

MAX_MESSAGE_BYTES = 80 << 20
UPLOAD_CHUNK_BYTES = 1 << 20         # one inline UploadCommand / UploadStream message
DOWNLOAD_CHUNK_BYTES = 1 << 20       # DownloadStream chunk size
MAX_BATCH_COMMANDS = 1024            # a batch is sent once it holds this many commands
FLUSH_BATCH_BYTES = 8 << 20          # ... or this many bytes (asynchronous work)
MAX_BATCH_BYTES = 64 << 20           # hard limit of one batch message (In/Out batches)
MAX_BATCH_DOWNLOAD_BYTES = 64 << 20  # DownloadCommand bytes per batch (the daemon's limit)
MAX_INFLIGHT_BATCHES = 64            # unacknowledged batches before the sender waits
MAX_INFLIGHT_DOWNLOAD_BYTES = 256 << 20
# Commands queued behind a batch in flight are sent by the reader thread once it is answered
# (CommandStream._send_left_behind); it waits at most this long for the session lock.
LEFT_BEHIND_WAIT_S = 0.05
# How long the reader of a framed channel that the worker ended without a reply waits for the
# session's watch to say why (the front end sees the worker's end within moments).
FRAMED_CAUSE_WAIT_S = 2.0
# A synchronising call's small pending work (a download, a memset, a small upload) joins the
# last batch when gRPC's sending thread has not taken it yet (CommandStream.drain): at most
# this much, so that only small work waits behind the join.
JOIN_MAX_BYTES = 64 << 10
JOIN_MAX_DOWNLOAD_BYTES = 1 << 20
STREAMED_TRANSFER_BYTES = 8 << 20    # synchronous transfers above this use Upload/DownloadStream
# A streamed transfer of at least twice MIN_TRANSFER_PART_BYTES is split into parts moved at
# once, each on a connection of its own (Client.transfer_connections; the C++ client's
# ConnectOptions::transfer_connections, with the same values): one gRPC connection carries
# one message at a time per stream, which bounds a transfer to a few GB/s.
DEFAULT_TRANSFER_CONNECTIONS = 4
MAX_TRANSFER_CONNECTIONS = 16
MIN_TRANSFER_PART_BYTES = 8 << 20
ADDRESS_SEPARATOR = ","              # between the targets of an address list (several daemons)
# Placement of new sessions over several daemons (Client.daemons, rank_devices): free memory
# counts in steps of 1 << this (256 MiB), and the daemons' ListDevices get at most this long
# (or the call timeout when shorter). The C++ client uses the same values.
PLACEMENT_MEMORY_STEP_SHIFT = 28
PLACEMENT_PROBE_TIMEOUT_S = 5.0
# An open that fails with one of these passes on to the next candidate device.
PLACEMENT_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.DEADLINE_EXCEEDED)
# debug counters of the parts of split transfers (a streamed transfer itself counts once
# under its method's name, as before it could be split).
UPLOAD_PARTS = "MemoryService.UploadStream/parts"
DOWNLOAD_PARTS = "MemoryService.DownloadStream/parts"
SESSION_METADATA_KEY = "gpurpc-session"
INSTANCE_METADATA_KEY = "gpurpc-instance"

DEFAULT_TIMEOUT_S = 300.0            # the call timeout without timeout= or GPURPC_TIMEOUT
CLOSE_TIMEOUT_S = 5.0                # CloseSession (or the call timeout when shorter)
KEEPALIVE_TIMEOUT_S = 10.0           # an explicit KeepAlive (likewise)
CLEANUP_TIMEOUT_S = 10.0             # frees of garbage-collected handles (likewise)
RECONNECT_TIMEOUT_S = 10.0           # a retried call's wait for a lost connection
WATCH_INITIAL_BACKOFF_S = 0.05       # first wait before re-opening a broken watch; doubles

# Callables are built from the service descriptors, not the generated *_pb2_grpc stubs: the
# command stream sends batches serialised here (request_serializer=None), which the stubs
# cannot express. The *_pb2_grpc modules ship for users calling the API with plain grpcio.
_SERVICE_MODULES = {
    "AdminService": admin_service_pb2,
    "DeviceService": device_service_pb2,
    "SessionService": session_service_pb2,
    "MemoryService": memory_service_pb2,
    "ModuleService": module_service_pb2,
    "ExecutionService": execution_service_pb2,
    "HostRegionService": host_region_service_pb2,
}


def _message_class(module: Any, descriptor: Any) -> Any:
    cls = getattr(module, descriptor.name, None)
    if cls is None:
        from google.protobuf import message_factory
        cls = message_factory.GetMessageClass(descriptor)
    return cls


def _make_callable(channel: grpc.Channel, name: str, request_serializer: Any = "default",
                   response_deserializer: Any = "default") -> Callable:
    service, rpc = name.split(".", 1)
    module = _SERVICE_MODULES[service]
    method = module.DESCRIPTOR.services_by_name[service].methods_by_name[rpc]
    factory: Callable[..., Callable] = {  # type: ignore[assignment]
        (False, False): channel.unary_unary,
        (True, False): channel.stream_unary,
        (False, True): channel.unary_stream,
        (True, True): channel.stream_stream,
    }[(bool(method.client_streaming), bool(method.server_streaming))]
    if request_serializer == "default":
        request_serializer = _message_class(module, method.input_type).SerializeToString
    if response_deserializer == "default":
        response_deserializer = _message_class(module, method.output_type).FromString
    return factory(f"/{method.containing_service.full_name}/{method.name}",
                   request_serializer=request_serializer,
                   response_deserializer=response_deserializer)


def default_socket_paths() -> List[str]:
    """Where gpurpcd puts its Unix socket by default, in the order they are tried:
    ``$XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock`` (when XDG_RUNTIME_DIR is set),
    ``/run/gpurpc/gpurpcd.sock`` and ``/tmp/gpurpc-<uid>/gpurpcd.sock``."""
    paths = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        paths.append(os.path.join(xdg, "gpurpc", "gpurpcd.sock"))
    paths.append("/run/gpurpc/gpurpcd.sock")
    paths.append(f"/tmp/gpurpc-{os.getuid()}/gpurpcd.sock")
    return paths


def _normalize(target: str) -> str:
    target = target.strip()
    if not target:
        return ""
    entries = []
    for entry in target.split(ADDRESS_SEPARATOR):
        entry = entry.strip()
        if entry.startswith("/"):
            entry = "unix:" + entry
        entries.append(entry)
    return ADDRESS_SEPARATOR.join(entries)


def resolve_address(address: Optional[str] = None) -> str:
    """The gRPC target for ``address``, else ``$GPURPC_ADDRESS``, else the first default
    daemon socket that exists (:func:`default_socket_paths`).

    A bare absolute path (``/run/gpurpc.sock``) means a Unix socket; ``unix:PATH`` and
    ``unix:///PATH`` are passed through, as are every other gRPC target syntax. Several
    targets separated by commas (``gpu1:50051,gpu2:50051``) name several daemons: each entry
    is normalized and the list returned joined by commas (:func:`parse_targets` checks it).

    :raises RuntimeError: nothing given and no default socket exists (the message names
        every place looked at).
    """
    target = _normalize(address or "") or _normalize(os.environ.get("GPURPC_ADDRESS") or "")
    if target:
        return target
    paths = default_socket_paths()
    tmp_prefix = f"/tmp/gpurpc-{os.getuid()}/"
    for path in paths:
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                continue
            if path.startswith(tmp_prefix):
                # Anyone may create a folder in /tmp: it counts only when it is the user's own
                # and only the user may write it (else another user could squat it).
                folder = os.lstat(os.path.dirname(path))
                if (not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid()
                        or folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                    continue
            return "unix:" + path
        except OSError:
            continue
    raise RuntimeError(
        "no gpurpcd address given and no daemon socket found at " + ", ".join(paths)
        + " (GPURPC_ADDRESS is not set): set GPURPC_ADDRESS (e.g. gpubox:50051 or "
        "unix:/path/to/gpurpcd.sock) or pass address=",
        code=grpc.StatusCode.UNAVAILABLE, operation="connect")


class TargetSpec(NamedTuple):
    """One entry of an address list (:func:`parse_targets`)."""

    target: str                 # the normalized gRPC target, as given
    host: Optional[str] = None  # of a ``dns:///HOST:PORT`` entry: every address HOST has
    port: Optional[str] = None

    @property
    def resolve(self) -> bool:
        """True for a ``dns:///HOST:PORT`` entry, which stands for every address of HOST."""
        return self.host is not None


def _bad_entry(address: str, index: int, entry: str, why: str) -> LogicError:
    return LogicError(f"address {entry[:256]!r} (entry {index} of {address[:512]!r}) {why}",
                      code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")


# Target schemes passed to gRPC as they are (besides dns:///, which parse_targets expands).
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:", "xds:")


def _check_port(port: str) -> bool:
    return port.isdigit() and 0 < int(port) < 65536


def parse_targets(address: str) -> List[TargetSpec]:
    """The entries of an address list: targets separated by commas, each normalized (a bare
    absolute path is a Unix socket). ``dns:///HOST:PORT`` stands for every address HOST
    resolves to (:func:`resolve_all`); any other entry is one gRPC target.

    :raises LogicError: (INVALID_ARGUMENT) an empty entry (``a,,b``, a trailing comma), an
        entry with blanks inside, ``unix:`` without a path, ``HOST:PORT`` without a host or
        with a port that is not 1-65535, or a ``dns:///`` entry without a host or a port;
        the message names the entry and its position.
    """
    specs: List[TargetSpec] = []
    for index, raw in enumerate(address.split(ADDRESS_SEPARATOR), start=1):
        entry = raw.strip()
        if not entry:
            raise LogicError(
                f"the address list {address[:512]!r} has an empty entry (entry {index}): "
                "separate targets with one comma, e.g. gpu1:50051,gpu2:50051",
                code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
        if entry.startswith("/"):
            entry = "unix:" + entry
        if any(c.isspace() for c in entry):
            raise _bad_entry(address, index, entry, "contains blanks: separate targets with "
                             "commas, e.g. gpu1:50051,gpu2:50051")
        if entry.startswith("dns:///"):
            rest = entry[len("dns:///"):]
            colon = rest.rfind(":")
            bracket = rest.rfind("]")
            if colon <= 0 or colon < bracket or colon + 1 == len(rest):
                raise _bad_entry(address, index, entry, "needs a host and a port: "
                                 "dns:///HOST:PORT")
            host, port = rest[:colon], rest[colon + 1:]
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if not host or not _check_port(port):
                raise _bad_entry(address, index, entry, "needs a host and a port (1-65535): "
                                 "dns:///HOST:PORT")
            specs.append(TargetSpec(entry, host, port))
            continue
        if entry in ("unix:", "unix://", "unix:///", "unix-abstract:"):
            raise _bad_entry(address, index, entry, "names no socket: unix:/PATH")
        if not entry.startswith(_SCHEMES):
            # HOST, HOST:PORT, [V6] or [V6]:PORT.
            if entry.startswith("["):
                close = entry.find("]")
                host = entry[1:close] if close > 0 else ""
                tail = entry[close + 1:] if close > 0 else ""
                port = tail[1:] if tail.startswith(":") else ("443" if not tail else "")
            elif ":" in entry:
                host, _, port = entry.rpartition(":")
            else:
                host, port = entry, "443"
            if not host or "/" in host or not _check_port(port):
                raise _bad_entry(address, index, entry, "is not a daemon address: give "
                                 "HOST:PORT, unix:/PATH or dns:///HOST:PORT")
        specs.append(TargetSpec(entry))
    return specs


def resolve_all(host: str, port: str) -> List[str]:
    """Every address ``host`` resolves to for TCP (``socket.getaddrinfo``), as gRPC targets
    (``ipv4:10.0.0.7:50051``, ``ipv6:[fd00::7]:50051``), deduplicated and sorted (as text:
    the order the C++ client uses too).

    :raises RuntimeError: (UNAVAILABLE) the name does not resolve.
    """
    try:
        found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise RuntimeError(f"cannot resolve {host}:{port}: {getattr(e, 'strerror', None) or e}",
                           code=grpc.StatusCode.UNAVAILABLE, operation="connect") from None
    targets = set()
    for family, _type, _proto, _name, sockaddr in found:
        ip = str(sockaddr[0]).split("%", 1)[0]
        if family == socket.AF_INET:
            targets.add(f"ipv4:{ip}:{sockaddr[1]}")
        elif family == socket.AF_INET6:
            targets.add(f"ipv6:[{ip}]:{sockaddr[1]}")
    if not targets:
        raise RuntimeError(f"{host}:{port} resolves to no address",
                           code=grpc.StatusCode.UNAVAILABLE, operation="connect")
    return sorted(targets)


def _is_unix(target: str) -> bool:
    return target.startswith("unix:") or target.startswith("unix-abstract:")


def _is_loopback(target: str) -> bool:
    host = target
    if _is_unix(host):
        return True
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if host.startswith(prefix):
            host = host[len(prefix):]
    if host.startswith("["):
        host = host[1:host.find("]")]
    else:
        host = host.rsplit(":", 1)[0]
    return host in ("localhost", "::1") or host.startswith("127.")


def _read_file(path: str, what: str) -> bytes:
    """A file's bytes; the error names the file and why, never its contents."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise LogicError(f"cannot read {what} {path}: {e.strerror or e}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect") from None


def _check_token(token: str, origin: str) -> str:
    token = token.strip()
    if not token:
        raise LogicError(f"the token from {origin} is empty",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise LogicError(f"the token from {origin} contains characters that cannot be sent "
                         "(only printable ASCII without spaces)",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
    return token


def resolve_token(token: Optional[str] = None) -> Optional[str]:
    """``token``, else ``$GPURPC_TOKEN``, else the contents of the file named by
    ``$GPURPC_TOKEN_FILE`` (whitespace stripped); None when none is configured."""
    if token:
        return _check_token(token, "token=")
    env = os.environ.get("GPURPC_TOKEN")
    if env:
        return _check_token(env, "GPURPC_TOKEN")
    path = os.environ.get("GPURPC_TOKEN_FILE")
    if path:
        data = _read_file(path, "the token file named by GPURPC_TOKEN_FILE,")
        return _check_token(data.decode("utf-8", errors="replace"),
                            f"the token file {path}")
    return None


_TIMEOUT_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def resolve_timeout(timeout: Optional[float] = None) -> float:
    """The call timeout in seconds: ``timeout``, else ``$GPURPC_TIMEOUT`` (seconds, e.g. ``90``,
    or with a unit: ``500ms``, ``90s``, ``10m``, ``1h``), else 300. ``math.inf`` means no
    deadline at all (then a hung daemon hangs the caller).

    :raises LogicError: a timeout that is not a positive number (naming where it came from).
    """
    origin = "timeout="
    if timeout is None:
        env = (os.environ.get("GPURPC_TIMEOUT") or "").strip()
        if not env:
            return DEFAULT_TIMEOUT_S
        origin = "GPURPC_TIMEOUT"
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|min|m|h)?", env)
        if match is None:
            raise LogicError(f"GPURPC_TIMEOUT={env[:64]!r} is not a timeout: give seconds (e.g. "
                             "90) or a duration (e.g. 90s, 10m, 1h)",
                             code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
        timeout = float(match.group(1)) * _TIMEOUT_UNITS[match.group(2) or "s"]
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise LogicError(f"{origin} must be a number of seconds, got {timeout!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect") from None
    if not value > 0:  # also NaN
        raise LogicError(f"{origin} must be positive (seconds; math.inf for none), got {value!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
    return value


def grpc_timeout(timeout: float) -> Optional[float]:
    """gRPC's ``timeout=`` for a timeout in seconds (None: no deadline)."""
    return None if math.isinf(timeout) else timeout


HOST_REGION_MODES = ("auto", "on", "off")


def resolve_host_regions(mode: Optional[str] = None) -> str:
    """Whether sessions use same-host regions (``gpurpc._regions``): ``mode``, else
    ``$GPURPC_HOST_REGIONS``, else ``"auto"`` (on for a Unix-socket daemon, off over TCP);
    ``"on"`` forces them (their failures raise), ``"off"`` never uses them.

    :raises LogicError: a value other than auto, on or off (naming where it came from).
    """
    origin = "host_regions="
    if mode is None:
        mode = (os.environ.get("GPURPC_HOST_REGIONS") or "").strip()
        if not mode:
            return "auto"
        origin = "GPURPC_HOST_REGIONS"
    value = mode.strip().lower() if isinstance(mode, str) else mode
    if value not in HOST_REGION_MODES:
        raise LogicError(f"{origin} must be one of auto, on, off, got {str(mode)[:64]!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
    return value


def resolve_transfer_connections(connections: Optional[int] = None) -> int:
    """How many connections a large streamed transfer is split over: ``connections``, else
    ``$GPURPC_TRANSFER_CONNECTIONS``, else 4; 1 to 16 (1: every transfer on the one
    connection of the client).

    :raises LogicError: (INVALID_ARGUMENT) a value that is not a whole number from 1 to 16,
        naming where it came from and the value.
    """
    limit = MAX_TRANSFER_CONNECTIONS
    if connections is None:
        env = (os.environ.get("GPURPC_TRANSFER_CONNECTIONS") or "").strip()
        if not env:
            return DEFAULT_TRANSFER_CONNECTIONS
        if re.fullmatch(r"\+?[0-9]{1,9}", env) is None or not 1 <= int(env) <= limit:
            raise LogicError(f"GPURPC_TRANSFER_CONNECTIONS={env[:64]!r} is not a number of "
                             f"connections from 1 to {limit}",
                             code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
        return int(env)
    try:
        if isinstance(connections, bool):
            raise TypeError
        value = operator.index(connections)  # an int, or a numpy integer
    except TypeError:
        raise LogicError(f"transfer_connections= must be a whole number from 1 to {limit}, got "
                         f"{str(connections)[:64]!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect") from None
    if not 1 <= value <= limit:
        raise LogicError(f"transfer_connections= is {value}; give 1 to {limit}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation="connect")
    return value


# How long past its deadline a call may take to report it before it is abandoned.
ABANDON_MARGIN_S = 0.25


# Unary requests up to this size are made as blocking calls, in the calling thread. Larger
# ones go through ``.future()`` and :func:`_finish` (see there): a future costs a hand-off to
# grpcio's polling thread and back, about twice a small call's CPU time, and only a request
# big enough to wait for HTTP/2 flow control needs it (the window is 64 KiB at least).
BLOCKING_REQUEST_MAX_BYTES = 16 * 1024


def _unary(method: Any, request: Any, metadata: Tuple, timeout: float, operation: str,
           wait_for_ready: Optional[bool] = None) -> Any:
    """Makes a unary call with a deadline ``timeout`` s from now (``math.inf``: none)."""
    if request.ByteSize() <= BLOCKING_REQUEST_MAX_BYTES:
        return method(request, metadata=metadata, timeout=grpc_timeout(timeout),
                      wait_for_ready=wait_for_ready)
    return _finish(method.future(request, metadata=metadata, timeout=grpc_timeout(timeout),
                                 wait_for_ready=wait_for_ready), operation, timeout)


def _finish(future: Any, operation: str, timeout: float) -> Any:
    """The result of a unary call started with ``.future()``, waited for at most its deadline.

    A blocking call would wait past its deadline when its request is stuck behind HTTP/2 flow
    control (gRPC completes it only once the peer reads again: never, for a stopped daemon);
    this one is cancelled and abandoned then, and :class:`CallTimeoutError` raised at once.
    """
    try:
        return future.result(timeout=None if math.isinf(timeout)
                             else timeout + ABANDON_MARGIN_S)
    except grpc.FutureTimeoutError:
        future.cancel()
        raise timeout_error(operation, timeout) from None


_TRUE = ("1", "true", "yes")


# fork(): a child inherits its parent's clients and sessions, but not their threads, and
# their connections and sockets are the parent's. Nothing inherited may be used or closed in
# the child (a CloseSession or a stray message would end or corrupt the parent's session), so
# the child marks them inherited (_after_fork_in_child) and its own calls open anew (CUDA
# has the same rule: a context does not survive fork).
_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_live_sessions: "weakref.WeakSet[SessionCore]" = weakref.WeakSet()
# What a child inherited, kept for the life of the process: a channel that is garbage
# collected would shut its parent's connection down.
_inherited: List[Any] = []


def inherited_client_error(client: "Client", operation: str) -> LogicError:
    return LogicError(
        f"{operation}: this connection to {client.target} belongs to process "
        f"{client.inherited_from}, the parent of this forked process, and cannot be used "
        "here; call gpurpc.driver.init() (or make a new Client) in this process",
        operation=operation)


def inherited_session_error(session_id: int, parent: int, operation: str) -> LogicError:
    return LogicError(
        f"{operation}: the context (session {session_id}) belongs to process {parent}, the "
        "parent of this forked process; a context does not survive fork() (as in CUDA): make "
        "a new one in this process (gpurpc.driver.Device(n).make_context()), or start "
        "worker processes with multiprocessing's 'spawn' method", operation=operation)


_GRPC_FORK_SUPPORT_AT_IMPORT = (
    os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "0").strip().lower() in _TRUE)
# Whether this process, or the one it was forked from, has opened a gRPC channel (gRPC
# was in use), and whether this process is a child of fork() made after that.
_grpc_used = False
_forked_after_grpc_used = False


def _grpc_fork_support() -> bool:
    """Whether gRPC's fork support is on in this process (``GRPC_ENABLE_FORK_SUPPORT``, which
    gRPC reads once, when it is imported)."""
    try:
        from grpc._cython import cygrpc
        return bool(cygrpc.is_fork_support_enabled())
    except (ImportError, AttributeError):  # a gRPC without it: the variable as gRPC reads it
        return _GRPC_FORK_SUPPORT_AT_IMPORT


def check_connect_after_fork(target: str) -> None:
    """Raises in a child of fork() made after gRPC was in use, unless gRPC's fork support is
    on: a new connection there may fail at random, or abort the process inside gRPC.

    :raises LogicError: naming ``GRPC_ENABLE_FORK_SUPPORT=1``.
    """
    if _forked_after_grpc_used and not _grpc_fork_support():
        raise LogicError(
            f"cannot connect to {target} here: this process is a child of fork() (parent "
            f"{os.getppid()}) made after gRPC connections were open, and gRPC's fork support "
            "is off, so a new connection in this process may fail at random or abort it "
            "inside gRPC. Set GRPC_ENABLE_FORK_SUPPORT=1 in the environment before grpc is "
            "imported (in the parent, before it connects), or start worker processes with "
            "multiprocessing's 'spawn' method", operation="connect")


def _after_fork_in_child() -> None:
    global _forked_after_grpc_used
    _forked_after_grpc_used = _grpc_used
    parent = os.getppid()
    for client in list(_live_clients):
        client.inherited_from = parent
        _inherited.append(client)
    _live_clients.clear()
    for core in list(_live_sessions):
        core.inherit_after_fork(parent)
        _inherited.append(core)
    _live_sessions.clear()


class Client:
    """One gRPC channel to a gpurpcd, with its stubs; or the daemons of an address list.
    Thread-safe.

    Where: ``address``, else ``$GPURPC_ADDRESS``, else the first default socket that exists
    (see :func:`resolve_address`).

    Several daemons: ``address`` may list targets separated by commas, and a
    ``dns:///NAME:PORT`` target (e.g. a Kubernetes headless Service) stands for every
    address NAME resolves to (TCP, deduplicated, sorted), resolved anew at each
    :meth:`daemons`; over TLS those daemons' certificates are checked against NAME unless
    ``server_name`` (or ``$GPURPC_TLS_SERVER_NAME``) says otherwise. When the list has
    several entries, or its one dns:/// name resolves to several addresses,
    ``multi_daemon`` is true: the client has no channel of its own, each daemon gets a
    client of its own with the same credentials and settings, :meth:`daemons` asks all of
    them for their devices' load, and the client's own calls (:meth:`call`,
    :meth:`list_devices`, :meth:`server_info`, the admin calls) go to :meth:`primary`, the
    first daemon that answered. Addresses that reach one daemon (same ``daemon_instance``)
    count once. With one target (a dns:/// name with one address included) the client is one
    channel, exactly as without a list. ``gpurpc.driver`` numbers and places devices over
    the daemons (see ``gpurpc.driver.pick_device``).

    Deadlines: ``timeout`` (seconds; default ``$GPURPC_TIMEOUT``, else 300; ``math.inf``: none)
    bounds every call of this client and of the sessions opened afterwards (see the module
    docstring); the attribute ``timeout`` may be changed later.

    Same-host regions: ``host_regions`` (``"auto"``, ``"on"`` or ``"off"``; default
    ``$GPURPC_HOST_REGIONS``, else ``"auto"``: on for a Unix-socket daemon) is what sessions
    opened afterwards start with (``gpurpc._regions``); the attribute may be changed later.

    Transfer connections: ``transfer_connections`` (1 to 16; default
    ``$GPURPC_TRANSFER_CONNECTIONS``, else 4) is how many connections a large streamed
    transfer (a synchronous copy of 16 MiB or more that takes no same-host region) is split
    over: parts of at least 8 MiB moved at once, the first on the client's own channel, each
    other on a channel of its own (same target, credentials and options, opened when a
    transfer first needs it, closed with the client). One gRPC connection carries one message
    at a time per stream, which bounds one transfer to a few GB/s; parts on several
    connections add up. 1: every transfer on the one channel. With several daemons every
    transfer keeps to its session's channel (as in the C++ client). The attribute may be
    changed later.

    Credentials (a Unix socket needs none: the daemon knows the caller's uid):

    * ``token`` (default ``$GPURPC_TOKEN``, else the file named by ``$GPURPC_TOKEN_FILE``) is
      sent as ``authorization: Bearer`` metadata on every call. It is never logged, printed
      or put in an exception message.
    * TLS is used when ``tls`` is true (default ``$GPURPC_TLS=1``) or when any certificate is
      given: ``root_certificates`` (PEM bytes verifying the daemon; default the file named by
      ``$GPURPC_TLS_CA``, else the system roots), ``certificate_chain`` and ``private_key``
      (PEM bytes of a client certificate for mutual TLS, whose common name the daemon takes
      as the tenant; default the files named by ``$GPURPC_TLS_CERT`` and ``$GPURPC_TLS_KEY``)
      and ``server_name`` (the name the daemon's certificate must carry when it differs from
      the address, gRPC's ``grpc.ssl_target_name_override``; default
      ``$GPURPC_TLS_SERVER_NAME``). TLS settings from the environment are not applied to a
      Unix-socket target (the daemon serves it plain); parameters are.
    """

    # The pid of the process that made this client, when this process is a child of fork()
    # that inherited it (_after_fork_in_child): its channel's connection is the parent's.
    inherited_from: Optional[int] = None
    # A client of one daemon of a client of several (_member), and the name that daemon's
    # certificate is checked against when its address came from a dns:/// name.
    _is_member: bool = False
    _tls_name: Optional[str] = None
    # Connections a large streamed transfer is split over (resolve_transfer_connections); a
    # client of one daemon of a client of several keeps to 1, as the C++ client does. The
    # further channels of the transfers (transfer_method), opened when first needed.
    _transfer_connections: int = 1
    _transfer_channels: Tuple[Any, ...] = ()
    _closed: bool = False

    def __init__(self, address: Optional[str] = None, *, token: Optional[str] = None,
                 root_certificates: Optional[bytes] = None, tls: Optional[bool] = None,
                 certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 server_name: Optional[str] = None, timeout: Optional[float] = None,
                 host_regions: Optional[str] = None,
                 transfer_connections: Optional[int] = None) -> None:
        self.target = resolve_address(address)
        self.specs: List[TargetSpec] = parse_targets(self.target)
        check_connect_after_fork(self.target)
        # Shared with the per-daemon clients of a client of several daemons.
        self._settings = _Settings(resolve_timeout(timeout), resolve_host_regions(host_regions))
        self._transfer_connections = resolve_transfer_connections(transfer_connections)
        _live_clients.add(self)
        # What was asked for explicitly (driver.init reuses a client asked for the same).
        self.explicit_credentials: Tuple[Any, ...] = (
            token, root_certificates, tls, certificate_chain, private_key, server_name)
        self._token = resolve_token(token)
        self._lock = threading.Lock()
        self._devices: Optional[device_service_pb2.ListDevicesResponse] = None
        self._methods: Dict[str, Callable] = {}
        self._members: Dict[str, "Client"] = {}
        self._primary: Optional["Client"] = None
        several = len(self.specs) > 1
        if not several and self.specs[0].resolve:
            try:
                several = len(resolve_all(self.specs[0].host or "", self.specs[0].port or "")) > 1
            except Error:
                several = False  # gRPC reports the name when it connects, as ever
        self.multi_daemon: bool = several
        if not several:
            self._open_channel(self.target, None)
            return
        # Several daemons: no channel of its own. Check the credentials now, for every kind
        # of target, so that unusable settings fail here as with one daemon.
        tls_any = False
        cert_any = False
        for spec in self.specs:
            _creds, _options, spec_tls, has_cert = self._channel_settings(
                spec.target, spec.host)
            tls_any = tls_any or spec_tls
            cert_any = cert_any or has_cert
        self.tls = tls_any
        self.channel: Any = None
        self.command_stream: Any = None
        self.has_credentials = bool(self._token) or cert_any
        self.auth_metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", "Bearer " + self._token),) if self._token else ())

    @property
    def timeout(self) -> float:
        """The call timeout of this client's calls and of sessions opened afterwards,
        seconds (``math.inf``: none). Settable; shared by the daemons of a client of several."""
        return self._settings.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._settings.timeout = value

    @property
    def host_regions(self) -> str:
        """``"auto"``, ``"on"`` or ``"off"`` for sessions opened afterwards (settable)."""
        return self._settings.host_regions

    @host_regions.setter
    def host_regions(self, value: str) -> None:
        self._settings.host_regions = value

    @property
    def transfer_connections(self) -> int:
        """How many connections a large streamed transfer is split over, 1 to 16 (settable;
        None: ``$GPURPC_TRANSFER_CONNECTIONS``, else 4). 1 for the client of one daemon of a
        client of several."""
        return self._transfer_connections

    @transfer_connections.setter
    def transfer_connections(self, value: Optional[int]) -> None:
        connections = resolve_transfer_connections(value)
        if not self._is_member:
            self._transfer_connections = connections

    def _channel_settings(self, target: str, tls_name: Optional[str],
                          ) -> Tuple[Any, List[Tuple[str, Any]], bool, bool]:
        """The credentials (None: plaintext), channel options, TLS flag and whether a client
        certificate is sent, for one daemon's ``target``. ``tls_name``: the name the daemon's
        certificate must carry when ``target`` is an address a dns:/// name resolved to
        (unless a server name is given)."""
        (_token, root_certificates, tls, certificate_chain, private_key,
         server_name) = self.explicit_credentials
        options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # Reconnect soon after the daemon comes back (gRPC's default backoff grows to
            # 120 s): a session's watch must re-attach within the daemon's grace.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if _is_loopback(target):
            # An http_proxy in the environment must not capture loopback traffic.
            options.append(("grpc.enable_http_proxy", 0))
        env = {} if _is_unix(target) else os.environ
        if root_certificates is None and env.get("GPURPC_TLS_CA"):
            root_certificates = _read_file(env["GPURPC_TLS_CA"],
                                           "the TLS roots named by GPURPC_TLS_CA,")
        if certificate_chain is None and env.get("GPURPC_TLS_CERT"):
            certificate_chain = _read_file(env["GPURPC_TLS_CERT"],
                                           "the TLS client certificate named by GPURPC_TLS_CERT,")
        if private_key is None and env.get("GPURPC_TLS_KEY"):
            private_key = _read_file(env["GPURPC_TLS_KEY"],
                                     "the TLS client key named by GPURPC_TLS_KEY,")
        if (certificate_chain is None) != (private_key is None):
            raise LogicError("mutual TLS needs both a client certificate and its private key "
                             "(certificate_chain= and private_key=, or GPURPC_TLS_CERT and "
                             "GPURPC_TLS_KEY)", code=grpc.StatusCode.INVALID_ARGUMENT,
                             operation="connect")
        if server_name is None:
            server_name = env.get("GPURPC_TLS_SERVER_NAME") or tls_name or None
        if tls is None:
            tls = (env.get("GPURPC_TLS", "").strip().lower() in _TRUE
                   or root_certificates is not None or certificate_chain is not None)
        creds = None
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                                 private_key=private_key,
                                                 certificate_chain=certificate_chain)
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
        return creds, options, bool(tls), certificate_chain is not None

    def _open_channel(self, target: str, tls_name: Optional[str]) -> None:
        global _grpc_used
        check_connect_after_fork(target)
        _live_clients.add(self)
        creds, options, tls, has_cert = self._channel_settings(target, tls_name)
        self.tls = tls
        if creds is not None:
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        # What the transfer channels are made with (transfer_method).
        self._channel_args: Tuple[Any, List[Tuple[str, Any]]] = (creds, options)
        self._transfer_lock = threading.Lock()
        self._transfer_methods: Dict[Tuple[int, str, bool, bool], Callable] = {}
        _grpc_used = True
        self.has_credentials = bool(self._token) or has_cert
        # Added to the metadata of every call (unary, streaming and the command stream).
        self.auth_metadata = (("authorization", "Bearer " + self._token),) if self._token else ()
        # Raw-bytes request serializer: the command stream encodes batches itself.
        self.command_stream = _make_callable(self.channel, "ExecutionService.CommandStream",
                                             request_serializer=None)

    def _member(self, target: str, tls_name: Optional[str]) -> "Client":
        """The client of one daemon of this client of several (made once, then kept):
        the same credentials and settings, its own channel."""
        with self._lock:
            member = self._members.get(target)
            if member is not None:
                return member
            member = Client._one_daemon(target, tls_name, self._settings,
                                        self.explicit_credentials, self._token)
            self._members[target] = member
            return member

    @staticmethod
    def _one_daemon(target: str, tls_name: Optional[str], settings: "_Settings",
                    explicit_credentials: Tuple[Any, ...], token: Optional[str],
                    ) -> "Client":
        """A client of one daemon of a client of several (:meth:`_member`), or a new one
        like it (:meth:`reopened`)."""
        member = Client.__new__(Client)
        member.target = target
        member.specs = [TargetSpec(target)]
        member._settings = settings
        member.explicit_credentials = explicit_credentials
        member._token = token
        member._lock = threading.Lock()
        member._devices = None
        member._methods = {}
        member._members = {}
        member._primary = None
        member.multi_daemon = False
        member._is_member = True
        member._tls_name = tls_name
        member._open_channel(target, tls_name)
        return member

    def reopened(self) -> "Client":
        """A new client of this client's daemon(s), with the same address, credentials and
        settings (call timeout, host regions: copied, not shared) and a channel of its own.
        A child of fork() reaches the devices of a client it inherited through it
        (``gpurpc._devices._reconnected``)."""
        if self._is_member:
            return Client._one_daemon(self.target, self._tls_name,
                                      _Settings(self.timeout, self.host_regions),
                                      self.explicit_credentials, self._token)
        token, roots, tls, chain, key, name = self.explicit_credentials
        return Client(self.target, token=token, root_certificates=roots, tls=tls,
                      certificate_chain=chain, private_key=key, server_name=name,
                      timeout=self.timeout, host_regions=self.host_regions,
                      transfer_connections=self.transfer_connections)

    def _addresses(self) -> List[Tuple[str, Optional[str], Optional[Error]]]:
        """Every daemon address in order: (target, the dns:/// name it came from, why the
        name did not resolve); dns:/// names resolved now, a target listed again left out."""
        addresses: List[Tuple[str, Optional[str], Optional[Error]]] = []
        seen = set()
        for spec in self.specs:
            if not spec.resolve:
                if spec.target not in seen:
                    seen.add(spec.target)
                    addresses.append((spec.target, None, None))
                continue
            try:
                resolved = resolve_all(spec.host or "", spec.port or "")
            except Error as e:
                addresses.append((spec.target, None, e))
                continue
            for target in resolved:
                if target not in seen:
                    seen.add(target)
                    addresses.append((target, spec.host, None))
        return addresses

    def daemons(self, timeout: Optional[float] = None) -> List["DaemonStatus"]:
        """Every daemon of this client, in order, each with its devices and their load
        (``ListDevices``, asked of all at once, each within ``timeout``; default the call
        timeout, at most 5 s), or why it did not answer. dns:/// names are resolved anew;
        a daemon reached again under another address (same ``daemon_instance``) is listed
        once, under its first address. Never raises for an unreachable daemon."""
        limit = min(self.timeout, PLACEMENT_PROBE_TIMEOUT_S) if timeout is None else timeout
        request = device_service_pb2.ListDevicesRequest()
        if not self.multi_daemon:
            try:
                reply = self.call("DeviceService.ListDevices", request, timeout=limit)
            except Error as e:
                return [DaemonStatus(self.target, self, None, e)]
            with self._lock:
                self._devices = reply
            return [DaemonStatus(self.target, self, reply, None)]
        pending: List[Tuple[str, Optional["Client"], Any, Optional[Error]]] = []
        for target, tls_name, error in self._addresses():
            if error is not None:
                pending.append((target, None, None, error))
                continue
            member = self._member(target, tls_name)
            debug.count("DeviceService.ListDevices")
            # Not wait_for_ready: a daemon that refuses connections (down) answers at once.
            future = member.method("DeviceService.ListDevices").future(
                request, metadata=member.auth_metadata, timeout=grpc_timeout(limit))
            pending.append((target, member, future, None))
        daemons: List[DaemonStatus] = []
        instances = set()
        for target, member, future, error in pending:
            if member is None:
                daemons.append(DaemonStatus(target, None, None, error))
                continue
            try:
                reply = _finish(future, "DeviceService.ListDevices", limit)
            except CallTimeoutError:
                daemons.append(DaemonStatus(target, member, None, RuntimeError(
                    f"no answer within {limit:g} s", code=grpc.StatusCode.UNAVAILABLE,
                    operation="DeviceService.ListDevices")))
                continue
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    failure: Error = RuntimeError(
                        f"no answer within {limit:g} s", code=grpc.StatusCode.UNAVAILABLE,
                        operation="DeviceService.ListDevices")
                else:
                    failure = error_from_rpc(e, "DeviceService.ListDevices", None, target,
                                             member.tls)
                daemons.append(DaemonStatus(target, member, None, failure))
                continue
            if reply.daemon_instance:
                if reply.daemon_instance in instances:
                    continue  # the same daemon under another address: counted once
                instances.add(reply.daemon_instance)
            with member._lock:
                member._devices = reply
            daemons.append(DaemonStatus(target, member, reply, None))
        return daemons

    def unreachable_error(self, daemons: Sequence["DaemonStatus"]) -> Error:
        """The error for a client none of whose daemons answered: UNAUTHENTICATED when one
        refused the credentials, else UNAVAILABLE; the message names every daemon and why."""
        why = describe_unavailable(daemons)
        for daemon in daemons:
            if daemon.error is not None and daemon.error.code == grpc.StatusCode.UNAUTHENTICATED:
                hint = "" if self.has_credentials else (
                    " (no credentials were given: token=, GPURPC_TOKEN or GPURPC_TOKEN_FILE, "
                    "or a TLS client certificate)")
                return Error(f"gpurpcd at {daemon.target} refused the connection's "
                             f"credentials{hint}; every daemon: {why} [UNAUTHENTICATED]",
                             code=grpc.StatusCode.UNAUTHENTICATED, details=why,
                             operation="connect")
        return RuntimeError(f"cannot reach any of the {len(daemons)} gpurpcd addresses"
                            f"{' over TLS' if self.tls else ''} of {self.target!r}: {why} "
                            "[UNAVAILABLE]", code=grpc.StatusCode.UNAVAILABLE, details=why,
                            operation="connect")

    def primary(self) -> "Client":
        """The daemon that gets this client's own calls (``call``, ``list_devices``,
        ``server_info``, the admin calls): the client itself with one daemon; with several,
        the first that answered when it was first needed (found then, and kept).

        :raises Error: no daemon answered (:meth:`unreachable_error`).
        """
        if not self.multi_daemon:
            return self
        primary = self._primary
        if primary is None:
            daemons = self.daemons()
            for daemon in daemons:
                if daemon.ok and daemon.client is not None:
                    primary = daemon.client
                    break
            if primary is None:
                raise self.unreachable_error(daemons)
            with self._lock:
                if self._primary is None:
                    self._primary = primary
                primary = self._primary
        return primary

    def __repr__(self) -> str:
        several = f" ({len(self.specs)} targets)" if self.multi_daemon else ""
        return (f"<gpurpc Client {self.target!r}{several}{' tls' if self.tls else ''}"
                f"{' with credentials' if self.has_credentials else ''}>")

    def method(self, name: str) -> Callable:
        """The gRPC callable of ``Service.Method`` (with several daemons: of :meth:`primary`)."""
        if self.inherited_from is not None:
            raise inherited_client_error(self, name)
        if self.multi_daemon:
            return self.primary().method(name)
        fn = self._methods.get(name)
        if fn is None:
            fn = self._methods[name] = _make_callable(self.channel, name)
        return fn

    def transfer_method(self, connection: int, name: str, raw_requests: bool = False,
                        raw_responses: bool = False) -> Callable:
        """The gRPC callable of ``Service.Method`` on transfer connection ``connection``: 0 is
        the client's own channel (:meth:`method`); 1 and up are channels of their own to the
        same target, with the same credentials and options plus
        ``grpc.use_local_subchannel_pool`` (else gRPC would share the one connection among
        them), opened when first asked for and closed by :meth:`close`. Thread-safe.
        ``raw_requests``: the callable sends requests that are serialized already (bytes).
        ``raw_responses``: it returns replies as gRPC received them (serialized, bytes).

        :raises LogicError: a client inherited over fork (never connects anew there).
        :raises ValueError: the client was closed (as gRPC says of a closed channel).
        """
        global _grpc_used
        if connection == 0 and not raw_requests and not raw_responses:
            return self.method(name)
        if self.inherited_from is not None:
            raise inherited_client_error(self, name)
        if self.multi_daemon:
            raise LogicError(f"{name}: a client of several daemons has no transfer channels",
                             operation=name)
        with self._transfer_lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC: the gpurpc client was closed")
            key = (connection, name, raw_requests, raw_responses)
            fn = self._transfer_methods.get(key)
            if fn is not None:
                return fn
            serializer = None if raw_requests else "default"
            deserializer = None if raw_responses else "default"
            if connection == 0:
                fn = self._transfer_methods[key] = _make_callable(self.channel, name, serializer,
                                                                  deserializer)
                return fn
            check_connect_after_fork(self.target)
            creds, options = self._channel_args
            options = options + [("grpc.use_local_subchannel_pool", 1)]
            channels = self._transfer_channels
            while len(channels) < connection:
                if creds is not None:
                    channel = grpc.secure_channel(self.target, creds, options=options)
                else:
                    channel = grpc.insecure_channel(self.target, options=options)
                _grpc_used = True
                channels = channels + (channel,)
            self._transfer_channels = channels
            fn = self._transfer_methods[key] = _make_callable(
                channels[connection - 1], name, serializer, deserializer)
            return fn

    def call(self, name: str, request: Any, metadata: Tuple = (), timeout: Optional[float] = None,
             cls: Optional[type] = None, op: Optional[str] = None,
             reconnect: bool = False) -> Any:
        """Calls a unary RPC ``Service.Method`` with a deadline ``timeout`` seconds from now
        (default: the client's call timeout); a failure raises the mapped gpurpc error, a
        passed deadline :class:`CallTimeoutError` naming the call and the timeout. With
        several daemons the call goes to :meth:`primary`.

        ``reconnect``: after UNAVAILABLE (e.g. the daemon just restarted and gRPC waits
        before reconnecting), try once more, waiting at most 10 s for the connection.
        """
        if self.multi_daemon:
            return self.primary().call(name, request, metadata, timeout, cls, op, reconnect)
        debug.count(name)
        limit = self.timeout if timeout is None else timeout
        method = self.method(name)
        started = time.monotonic()
        try:
            return _unary(method, request, metadata + self.auth_metadata, limit, op or name)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and \
                    time.monotonic() - started >= limit * 0.999:
                raise timeout_error(op or name, limit) from None
            if not (reconnect and code == grpc.StatusCode.UNAVAILABLE):
                raise error_from_rpc(e, op or name, cls, self.target, self.tls) from None
            first = e
        wait = min(limit, RECONNECT_TIMEOUT_S)
        started = time.monotonic()
        try:
            return _unary(method, request, metadata + self.auth_metadata, wait, op or name,
                          wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and \
                    time.monotonic() - started >= wait * 0.999:
                # Never connected: report why the first attempt could not.
                raise error_from_rpc(first, op or name, cls, self.target, self.tls) from None
            raise error_from_rpc(e, op or name, cls, self.target, self.tls) from None

    def list_devices(self, refresh: bool = False) -> device_service_pb2.ListDevicesResponse:
        """The daemon's device inventory (cached after the first call; with several daemons,
        :meth:`primary`'s: :meth:`daemons` has every daemon's)."""
        if self.multi_daemon:
            return self.primary().list_devices(refresh)
        with self._lock:
            if self._devices is None or refresh:
                self._devices = self.call("DeviceService.ListDevices",
                                          device_service_pb2.ListDevicesRequest())
            return self._devices

    def server_info(self) -> device_service_pb2.GetServerInfoResponse:
        """The daemon as this client sees it: tenant, auth method, admin flag, quota, usage,
        compile sandbox, daemon instance and start time (``DeviceService.GetServerInfo``)."""
        return self.call("DeviceService.GetServerInfo",
                         device_service_pb2.GetServerInfoRequest(), reconnect=True)

    def admin_list_sessions(self, tenant: str = "") -> admin_service_pb2.ListSessionsResponse:
        """Every open session (of ``tenant`` only, when given). Admin tenants only."""
        return self.call("AdminService.ListSessions",
                         admin_service_pb2.ListSessionsRequest(tenant=tenant))

    def admin_close_session(self, session_id: int) -> admin_service_pb2.AdminCloseSessionResponse:
        """Closes any tenant's session. Admin tenants only."""
        return self.call("AdminService.CloseSession",
                         admin_service_pb2.AdminCloseSessionRequest(session_id=int(session_id)))

    def close(self) -> None:
        """Closes the channel (and those of a client of several daemons). In a child of fork()
        a client it inherited is left alone: closing it would end its parent's connection."""
        if self.inherited_from is not None:
            return
        with self._lock:
            members = list(self._members.values())
        for member in members:
            member.close()
        if self.channel is not None:
            with self._transfer_lock:
                self._closed = True
                transfer_channels, self._transfer_channels = self._transfer_channels, ()
                self._transfer_methods.clear()
            for channel in transfer_channels:
                channel.close()
            self.channel.close()


class _Settings:
    """A client's call timeout and same-host region mode, shared with its per-daemon
    clients when it has several daemons."""

    __slots__ = ("timeout", "host_regions")

    def __init__(self, timeout: float, host_regions: str) -> None:
        self.timeout = timeout
        self.host_regions = host_regions


class DaemonStatus:
    """One daemon of a client (:meth:`Client.daemons`): its gRPC ``target``, its ``client``
    (None when its dns:/// name did not resolve), and either ``devices`` (its
    ``ListDevicesResponse``: devices with their load, ``daemon_instance``,
    ``accepting_sessions``) or ``error`` (why it did not answer)."""

    __slots__ = ("target", "client", "devices", "error")

    def __init__(self, target: str, client: Optional[Client],
                 devices: Optional[device_service_pb2.ListDevicesResponse],
                 error: Optional[Error]) -> None:
        self.target = target
        self.client = client
        self.devices = devices
        self.error = error

    @property
    def ok(self) -> bool:
        """True when it answered."""
        return self.devices is not None

    @property
    def accepting(self) -> bool:
        """True when it answered and takes new sessions (not draining). A daemon too old to
        report it (no ``daemon_instance``) counts as accepting."""
        return self.devices is not None and (
            self.devices.accepting_sessions or not self.devices.daemon_instance)

    def why(self) -> str:
        """Why it is no candidate for a new session ("" when it is one)."""
        if self.error is not None:
            details = self.error.details or str(self.error)
            code = self.error.code.name if self.error.code is not None else "UNKNOWN"
            return f"{code}: {details}"
        if not self.accepting:
            return "draining (accepts no new session)"
        if self.devices is not None and not self.devices.devices:
            return "serves no device"
        return ""

    def __repr__(self) -> str:
        why = self.why()
        return (f"<gpurpc DaemonStatus {self.target!r} {'ok' if self.ok else 'failed'}"
                f"{': ' + why if why else ''}>")


def describe_unavailable(daemons: Sequence[DaemonStatus]) -> str:
    """"A: why; B: why" for the daemons that did not answer, are draining or serve no
    device."""
    return "; ".join(f"{d.target}: {d.why()}" for d in daemons if d.why())


def device_load(device: Any) -> Tuple[int, int]:
    """``(free memory bytes, sessions)`` of a ``DeviceInfo`` (a daemon too old to report
    its load: all of its memory, no session)."""
    if device.HasField("load"):
        return int(device.load.free_memory_bytes), int(device.load.sessions)
    return int(device.total_memory_bytes), 0


def placement_key(free_memory_bytes: int, sessions: int, daemon: int, ordinal: int,
                  ) -> Tuple[int, int, int, int]:
    """The rank of a device for a new session, smallest first: most free memory in steps of
    256 MiB, then fewest sessions, then daemon order, then ordinal."""
    return (-(free_memory_bytes >> PLACEMENT_MEMORY_STEP_SHIFT), sessions, daemon, ordinal)


def rank_devices(daemons: Sequence[DaemonStatus]) -> List[Tuple[DaemonStatus, Any]]:
    """The devices of the daemons that answered and accept sessions as ``(daemon,
    DeviceInfo)``, best first (:func:`placement_key`, the daemon's position in ``daemons``)."""
    ranked = []
    for position, daemon in enumerate(daemons):
        if not daemon.accepting or daemon.devices is None:
            continue
        for device in daemon.devices.devices:
            free, sessions = device_load(device)
            ranked.append((placement_key(free, sessions, position, int(device.ordinal)),
                           daemon, device))
    ranked.sort(key=lambda item: item[0])
    return [(daemon, device) for _key, daemon, device in ranked]


# ---------------------------------------------------------------------------------------------
# Protobuf wire helpers for the launch fast path. A CommandBatch is the concatenation of its
# commands as field 1; a Command is sequence (field 1) + launch (field 2). Building the bytes
# directly saves constructing three nested messages per launch.

def _varint_slow(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL_VARINTS = [_varint_slow(i) for i in range(1 << 14)]


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer."""
    if n < 16384:
        return _SMALL_VARINTS[n]
    if n < 2097152:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    return _varint_slow(n)


TAG_LAUNCH = b"\x12"  # Command.launch = 2, length-delimited
TAG_PACKED_ARGS = b"\x32"  # LaunchCommand.packed_args = 6


def dim3(dims: Any, what: str) -> common_pb2.Dim3:
    """A Dim3 from a 1..3-tuple of positive ints (missing extents are 1)."""
    try:
        values = [int(v) for v in dims]
    except TypeError:
        values = [int(dims)]
    if not 1 <= len(values) <= 3:
        raise ValueError(f"{what} must have 1 to 3 extents, got {dims!r}")
    if any(v < 1 for v in values):
        raise LogicError(f"{what} extents must be >= 1, got {tuple(values)}",
                         code=grpc.StatusCode.INVALID_ARGUMENT)
    values += [1] * (3 - len(values))
    return common_pb2.Dim3(x=values[0], y=values[1], z=values[2])


def launch_prefix(function_id: int, grid: Any, block: Any, shared: int, stream_id: int) -> bytes:
    """Serialized LaunchCommand without packed_args (appended by the caller)."""
    return execution_service_pb2.LaunchCommand(
        function_id=function_id, grid=dim3(grid, "grid"), block=dim3(block, "block"),
        shared_memory_bytes=int(shared), stream_id=stream_id).SerializeToString()


def device_pointer(address: int) -> common_pb2.DevicePointer:
    return common_pb2.DevicePointer(device_address=address)


def copy_3d_array_end(array_id: int, x_bytes: int = 0, y: int = 0,
                      z: int = 0) -> execution_service_pb2.Copy3DEndpoint:
    """One side of a Copy3DCommand: the CUDA array ``array_id``, from element byte ``x_bytes``
    of row ``y`` of slice (or layer) ``z``."""
    return execution_service_pb2.Copy3DEndpoint(array_id=array_id, x_bytes=x_bytes, y=y, z=z)


def copy_3d_linear_end(address: int, pitch_bytes: int = 0,
                       height: int = 0) -> execution_service_pb2.Copy3DEndpoint:
    """One side of a Copy3DCommand: linear device memory from ``address`` (the copy's first
    byte), rows ``pitch_bytes`` apart (0: the copy's width) and slices ``height`` rows apart
    (0: the copy's height)."""
    return execution_service_pb2.Copy3DEndpoint(device=device_pointer(address),
                                                pitch_bytes=pitch_bytes, height=height)


def copy_3d_command(destination: execution_service_pb2.Copy3DEndpoint,
                    source: execution_service_pb2.Copy3DEndpoint, width_bytes: int, height: int,
                    depth: int, stream_id: int) -> execution_service_pb2.Copy3DCommand:
    """A stream-ordered copy of ``depth`` slices of ``height`` rows of ``width_bytes`` bytes
    between two endpoints (queue it with ``CommandStream.add(label, copy_3d=...)``)."""
    return execution_service_pb2.Copy3DCommand(
        destination=destination, source=source, width_bytes=width_bytes, height=height,
        depth=depth, stream_id=stream_id)


# ---------------------------------------------------------------------------------------------

class _Batch:
    __slots__ = ("first_seq", "labels", "sinks", "download_bytes", "done", "call", "settled")

    def __init__(self, first_seq: int, labels: List[str], sinks: Dict[int, Callable],
                 download_bytes: int, done: List[Callable[[], None]]) -> None:
        self.first_seq = first_seq
        self.labels = labels
        self.sinks = sinks
        self.download_bytes = download_bytes
        self.done = done  # run by the reader once the batch is answered without an error
        # The stream it was sent on: a stream's replies answer its own batches, in order, and
        # a stream that ends drops its own unanswered ones, never another stream's.
        self.call: Any = None
        # Answered or dropped. Batches leave the in-flight queue in the order they were sent
        # (acked_batches counts them so), once every batch before them has settled too: a
        # newer stream may settle its batches before an older stream's end is read.
        self.settled = False

    def label(self, seq: int) -> str:
        i = seq - self.first_seq
        if 0 <= i < len(self.labels):
            return self.labels[i]
        return f"command #{seq}"


class _Outbox:
    """The batches waiting for gRPC's request-iterator thread (the command stream's sending
    side; it iterates this object). The last one may still grow while that thread has not
    taken it (:meth:`CommandStream.drain` adds small pending work to it): then a launch that was
    sent because the stream was idle and the synchronize that follows it travel as one batch,
    one message and one reply, as in the C++ client.
    """

    __slots__ = ("_cv", "_items", "_closed")

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._items: Deque[List[Any]] = collections.deque()  # [payload, batch]
        self._closed = False

    def put(self, payload: bytes, batch: "_Batch") -> None:
        with self._cv:
            self._items.append([payload, batch])
            self._cv.notify()

    def close(self) -> None:
        """No more batches: iteration ends once the queued ones are taken."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def extend_last(self, batch: "_Batch", payload: bytes, on_extend: Callable[[], None]) -> bool:
        """Appends ``payload`` to ``batch`` when it is the last one and not taken yet, running
        ``on_extend()`` first (under the lock: the batch cannot be sent, so not answered,
        before it has run). False when it was taken."""
        with self._cv:
            if not self._items or self._items[-1][1] is not batch:
                return False
            on_extend()
            self._items[-1][0] += payload
            return True

    def __iter__(self) -> "_Outbox":
        return self

    def __next__(self) -> bytes:
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if not self._items:
                raise StopIteration
            return self._items.popleft()[0]


class CommandStream:
    """The session's ordered command stream (one bidi RPC, reopened after it ends).

    Callers hold the session lock for every method; the reader thread only touches the state
    guarded by ``_cv``.
    """

    def __init__(self, client: Client, metadata: Tuple, session_id: int,
                 fault: Dict[str, str], state: "_SessionState",
                 session_lock: Optional[Any] = None) -> None:
        # No reference to the SessionCore: the session's finalizer reaches this object, and
        # a reference back would keep the session alive forever. ``session_lock`` is the
        # lock its callers hold (SessionCore.lock): the reader thread takes it to send what
        # was queued behind an answered batch (_send_left_behind).
        self._session_lock = session_lock
        self._client = client
        self._metadata = metadata
        self._session_id = session_id
        self._fault = fault
        self._state = state  # the session's call timeout and closed flag
        self._closed = False
        # Reentrant: the garbage collector may run the session's finalizer (close()) on the
        # reader thread while that thread holds it.
        self._cv = threading.Condition(threading.RLock())
        self._queue: Any = None  # the _Outbox of the gRPC stream, or the FramedCall
        self._call: Any = None
        # Opens the session's framed command channel (a FramedCall, or None to stay on
        # gRPC); set by the session when it may use same-host features, tried once, by the
        # first flush (outside _cv: opening makes calls, and close() must not wait for them).
        # Its end, or a failure to open it, leaves the session on gRPC streams.
        self.framed_opener: Optional[Callable[[], Any]] = None
        self._framed_call: Any = None  # opened, for _open
        self._broken = True  # no stream open yet
        self._seq = 0
        self._cmds: List[bytes] = []
        self._labels: List[str] = []
        self._sinks: Dict[int, Callable] = {}
        self._bytes = 0
        self._download_bytes = 0
        self._first_seq = 1
        self._inflight: Deque[_Batch] = collections.deque()
        self._inflight_download_bytes = 0
        self._error: Optional[Error] = None
        self._done: List[Callable[[], None]] = []
        # Batches sent over the session's life, and how many of them were answered (or
        # dropped with a broken stream): batch k (1-based) is done once acked_batches >= k.
        self.sent_batches = 0
        self.acked_batches = 0

    # -- building batches -----------------------------------------------------------------

    def next_seq(self) -> int:
        self._seq += 1
        if not self._cmds:
            self._first_seq = self._seq
        return self._seq

    def _make_room(self, size: int, download_bytes: int) -> None:
        if self._cmds and (len(self._cmds) >= MAX_BATCH_COMMANDS
                           or self._bytes + size > MAX_BATCH_BYTES
                           or self._download_bytes + download_bytes > MAX_BATCH_DOWNLOAD_BYTES):
            self.flush()

    def _after_add(self, auto: bool) -> None:
        if auto and (len(self._cmds) >= MAX_BATCH_COMMANDS or self._bytes >= FLUSH_BATCH_BYTES
                     or not self._inflight):
            self.flush()

    def add_launch(self, launch_bytes: bytes, label: str, auto: bool = True) -> None:
        """Queues a serialized LaunchCommand (the hot path: kept free of helper calls)."""
        cmds = self._cmds
        if cmds and (len(cmds) >= MAX_BATCH_COMMANDS
                     or self._bytes + len(launch_bytes) + 16 > MAX_BATCH_BYTES):
            self.flush()
            cmds = self._cmds
        self._seq += 1
        seq = self._seq
        if not cmds:
            self._first_seq = seq
        cmd = b"\x08" + varint(seq) + TAG_LAUNCH + varint(len(launch_bytes)) + launch_bytes
        framed = b"\x0a" + varint(len(cmd)) + cmd
        cmds.append(framed)
        self._labels.append(label)
        self._bytes += len(framed)
        if auto and (len(cmds) >= MAX_BATCH_COMMANDS or self._bytes >= FLUSH_BATCH_BYTES
                     or not self._inflight):
            self.flush()

    def add(self, label: str, auto: bool = True, sink: Optional[Callable[[bytes], None]] = None,
            download_bytes: int = 0, payload_bytes: int = 0, **kind: Any) -> int:
        """Queues one Command given as ``kind=message`` (e.g. ``memset=MemsetCommand(...)``)."""
        self._make_room(payload_bytes + 64, download_bytes)
        seq = self.next_seq()
        framed = execution_service_pb2.CommandBatch(
            commands=[execution_service_pb2.Command(sequence=seq, **kind)]).SerializeToString()
        self._cmds.append(framed)
        self._labels.append(label)
        self._bytes += len(framed)
        if sink is not None:
            self._sinks[seq] = sink
            self._download_bytes += download_bytes
        self._after_add(auto)
        return seq

    @property
    def has_pending(self) -> bool:
        return bool(self._cmds) or bool(self._inflight)

    @property
    def last_batch(self) -> int:
        """The number (as ``sent_batches`` counts) of the batch that carries, or will carry,
        the commands queued so far."""
        return self.sent_batches + (1 if self._cmds else 0)

    @property
    def has_error(self) -> bool:
        """An error of queued work waits to be raised by the next drain."""
        return self._error is not None

    # -- sending and receiving ------------------------------------------------------------

    def _open(self) -> None:
        if self._queue is not None:
            self._queue.close()  # the broken stream's iterator ends
        call, self._framed_call = self._framed_call, None
        if call is not None:
            q: Any = call
        else:
            q = _Outbox()
            call = self._client.command_stream(
                q, metadata=self._metadata + self._client.auth_metadata)
        debug.count(debug.STREAM_OPEN)
        self._queue = q
        self._call = call
        self._broken = False
        threading.Thread(target=self._reader, args=(call,), daemon=True,
                         name=f"gpurpc-commands-{self._session_id}").start()

    def flush(self, timeout: Optional[float] = None, label: str = "sending queued commands",
              ) -> None:
        """Sends the pending commands as one batch (does not wait for its reply; waits at most
        ``timeout`` s, default the session's call timeout, for room when too many batches
        are unanswered)."""
        if not self._cmds:
            return
        if self.framed_opener is not None and self._broken and not self._closed:
            opener, self.framed_opener = self.framed_opener, None
            self._framed_call = opener()
        limit = self._state.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cv:
            while (len(self._inflight) >= MAX_INFLIGHT_BATCHES or (
                    self._inflight and self._inflight_download_bytes + self._download_bytes
                    > MAX_INFLIGHT_DOWNLOAD_BYTES)) and not self._broken:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error(label, limit, "the daemon answers no batches; the "
                                        "commands stay queued")
                self._cv.wait(None if math.isinf(remaining) else remaining)
            if self._closed:
                if self._framed_call is not None:  # opened while close() ran
                    self._framed_call.discard()
                    self._framed_call = None
                raise LogicError(f"{label}: the context (session {self._session_id}) was "
                                 "detached; its memory, modules, streams and events are gone")
            batch = _Batch(self._first_seq, self._labels, self._sinks, self._download_bytes,
                           self._done)
            payload = b"".join(self._cmds)
            self._cmds = []
            self._labels = []
            self._sinks = {}
            self._done = []
            self._bytes = 0
            self._download_bytes = 0
            if self._broken:
                self._open()
            batch.call = self._call
            self._inflight.append(batch)
            self.sent_batches += 1
            self._inflight_download_bytes += batch.download_bytes
            q = self._queue
        debug.count(debug.BATCH)
        q.put(payload, batch)  # type: ignore[union-attr]

    def drain(self, timeout: Optional[float] = None, label: str = "waiting for queued commands",
              ) -> None:
        """Sends pending commands and waits until every batch is acknowledged, at most
        ``timeout`` s (default: the session's call timeout; then :class:`CallTimeoutError`
        naming ``label``, and the work goes on).

        Raises the first error reported since the last drain (asynchronous errors included).
        """
        limit = self._state.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        if not self._join_last():
            self.flush(limit, label)
        with self._cv:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error(
                        label, limit, "a deadline does not cancel GPU work: it goes on, and a "
                        "later synchronising call waits for it")
                self._cv.wait(None if math.isinf(remaining) else remaining)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _join_last(self) -> bool:
        """Appends the pending commands to the last batch sent when gRPC's sending thread has
        not taken it yet and they are small (JOIN_MAX_*): a launch that went out at once on
        an idle stream and the download of ``float(gpuarray.sum(a))`` that follows it travel
        as one message with one reply. True when joined (nothing is pending then).

        Joined commands share the batch's fate: the worker skips the rest of a batch after a
        failed command, so a download behind a failed launch is not made, and the drain that
        follows raises the launch's error, as it would have anyway."""
        if (not self._cmds or not self._inflight or self._queue is None or self._broken
                or self._bytes > JOIN_MAX_BYTES
                or self._download_bytes > JOIN_MAX_DOWNLOAD_BYTES):
            return False
        batch = self._inflight[-1]
        if (batch.first_seq + len(batch.labels) != self._first_seq
                or batch.download_bytes + self._download_bytes > MAX_BATCH_DOWNLOAD_BYTES):
            return False
        payload = b"".join(self._cmds)

        def join() -> None:
            # Under the outbox's lock: the batch cannot be sent, so not answered, meanwhile.
            batch.labels.extend(self._labels)
            batch.sinks.update(self._sinks)
            batch.done.extend(self._done)
            with self._cv:
                batch.download_bytes += self._download_bytes
                self._inflight_download_bytes += self._download_bytes

        if not self._queue.extend_last(batch, payload, join):
            return False
        self._cmds = []
        self._labels = []
        self._sinks = {}
        self._done = []
        self._bytes = 0
        self._download_bytes = 0
        return True

    def sync(self, stream_id: int = 0, whole_session: bool = False, label: str = "synchronize",
             timeout: Optional[float] = None, event_id: int = 0) -> None:
        """Queues a SyncCommand and drains: returns once the work is done on the server, or
        raises :class:`CallTimeoutError` after ``timeout`` s (default: the call timeout).

        The marker (with any small work queued before it) joins the last batch sent when
        gRPC's sending thread has not taken it yet (:meth:`drain`, :meth:`_join_last`): the
        usual launch-then-synchronize, whose launch went out at once on an idle stream, is
        one message and one round trip. ``event_id``: waits for that event instead (the
        event's id goes as ``stream_id`` too: see SyncCommand.event_id)."""
        sync = execution_service_pb2.SyncCommand(
            stream_id=event_id or stream_id, whole_session=whole_session, event_id=event_id)
        self.add(label, auto=False, sync=sync)
        self.drain(timeout, label)

    def add_on_done(self, callback: Callable[[], None]) -> None:
        """Runs ``callback()`` on the reader thread once the batch that will carry the
        commands queued so far is answered without an error (before waiters see it answered);
        a failed or dropped batch skips it (its error is raised at the next drain). Call it
        after queueing that batch's last command; an exception it raises is recorded."""
        self._done.append(callback)

    def wait_batches(self, count: int, timeout: Optional[float] = None,
                     label: str = "waiting for queued commands") -> None:
        """Waits until the first ``count`` batches sent (``sent_batches``) are answered or
        dropped, at most ``timeout`` s (default: the session's call timeout). An error
        reported meanwhile is raised as by :meth:`drain` (after the rest is answered)."""
        limit = self._state.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cv:
            while self.acked_batches < count and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error(
                        label, limit, "a deadline does not cancel GPU work: it goes on, and a "
                        "later synchronising call waits for it")
                self._cv.wait(None if math.isinf(remaining) else remaining)
            failed = self._error is not None
        if failed:
            self.drain(timeout, label)

    def _record(self, error: Error) -> None:
        # Caller holds _cv. The first error wins: it is the one that explains the others.
        if self._error is None:
            self._error = error

    def _reader(self, call: Any) -> None:
        end_error: Optional[Error] = None
        try:
            for reply in call:
                with self._cv:
                    # Popped only once its bytes are delivered: a drain that looks meanwhile
                    # must still see it in flight.
                    batch = self._oldest_unsettled(call)
                if batch is None:
                    continue
                if reply.device_output:
                    try:
                        print_device_output(reply.device_output)
                    except Exception as e:  # noqa: BLE001 - reported at the next drain
                        with self._cv:
                            self._record(LogicError(f"printing device output: {e}"))
                for result in reply.downloads:
                    sink = batch.sinks.get(result.sequence)
                    if sink is not None:
                        try:
                            sink(result.data)
                        except Exception as e:  # noqa: BLE001 - reported at the next drain
                            with self._cv:
                                self._record(LogicError(f"delivering downloaded bytes: {e}"))
                error = None
                if reply.HasField("error"):
                    code = status_code_from_int(reply.error.code)
                    error = session_error(code, reply.error.message,
                                          batch.label(reply.error.sequence), self._client.target,
                                          self._session_id)
                    note_fault(self._fault, code, reply.error.message)
                else:
                    for callback in batch.done:
                        try:
                            callback()
                        except Exception as e:  # noqa: BLE001 - reported at the next drain
                            with self._cv:
                                self._record(LogicError(f"delivering a finished copy: {e}"))
                with self._cv:
                    if error is not None:
                        self._record(error)
                        if error.code == grpc.StatusCode.ABORTED and self._call is call:
                            # A fault ends this stream; later batches must go to a new one
                            # (which the daemon refuses with the fault's cause).
                            self._broken = True
                    batch.settled = True
                    self._pop_settled()
                    self._cv.notify_all()
                    left_behind = not self._inflight and bool(self._cmds)
                if left_behind:
                    self._send_left_behind()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            if code != grpc.StatusCode.CANCELLED or self._call is call:
                details = (e.details() if hasattr(e, "details") else "") or ""
                end_error = session_error(code, details, "ExecutionService.CommandStream",
                                          self._client.target, self._session_id)
                note_fault(self._fault, code, details)
        if (isinstance(call, _framed.FramedCall) and end_error is not None
                and end_error.code == grpc.StatusCode.UNAVAILABLE):
            # The worker ended the framed channel without a word: it died (a crash, the
            # kernel watchdog, its daemon gone). The front end tells the session's watch why.
            with self._cv:
                waiting = self._error is None and self._oldest_unsettled(call) is not None
            if waiting:
                end_error = self._cause_from_watch() or end_error
        with self._cv:
            if self._call is call:
                self._broken = True
            dropped = False
            for batch in self._inflight:
                if batch.call is call and not batch.settled:
                    batch.settled = dropped = True
            if dropped:
                if end_error is None:
                    end_error = LaunchError(
                        "ExecutionService.CommandStream ended before answering every batch",
                        code=grpc.StatusCode.UNKNOWN, operation="ExecutionService.CommandStream")
                self._record(end_error)
                self._pop_settled()
            self._cv.notify_all()

    def _cause_from_watch(self) -> Optional[Error]:
        """The session's FAULTED or lost error once its watch has it, within
        FRAMED_CAUSE_WAIT_S; None if it has not by then."""
        unusable = getattr(self._state, "unusable_error", None)
        if unusable is None:
            return None
        deadline = time.monotonic() + FRAMED_CAUSE_WAIT_S
        while True:
            error = unusable("ExecutionService.CommandStream")
            if error is not None or time.monotonic() >= deadline or self._closed:
                return error
            time.sleep(0.02)

    def _oldest_unsettled(self, call: Any) -> Optional[_Batch]:
        """The batch that ``call``'s next reply answers. Caller holds _cv."""
        for batch in self._inflight:
            if batch.call is call and not batch.settled:
                return batch
        return None

    def _pop_settled(self) -> None:
        """Takes the settled batches off the front of the in-flight queue. Caller holds _cv."""
        while self._inflight and self._inflight[0].settled:
            self._inflight_download_bytes -= self._inflight.popleft().download_bytes
            self.acked_batches += 1

    def _send_left_behind(self) -> None:
        """Sends, from the reader thread, the commands queued while the batch just answered
        was in flight. A call made then only queues them (a batch is sent at once only on an
        idle stream); without this they would wait for the caller's next call, and a program
        that launches a few kernels and then computes on the CPU would leave the GPU idle.

        Needs the session lock, which a caller may hold: tries for a short while (a caller
        that queued just before the answer releases it within microseconds), and gives up
        while a caller holds it longer -- that caller's next queued command or synchronising
        call sends them, as before. A batch sent meanwhile (the stream is busy again) or a
        broken or closed stream also ends the attempt."""
        lock = self._session_lock
        if lock is None:
            return
        give_up = time.monotonic() + LEFT_BEHIND_WAIT_S
        while True:
            with self._cv:
                if self._inflight or not self._cmds or self._broken or self._closed:
                    return
            if lock.acquire(timeout=0.001):
                try:
                    with self._cv:
                        ready = not (self._inflight or self._broken or self._closed)
                    if ready and self._cmds:
                        self.flush(label="sending commands queued behind an answered batch")
                except Exception as e:  # noqa: BLE001 - reported by the next synchronising call
                    with self._cv:
                        self._record(e if isinstance(e, Error) else LogicError(
                            f"sending commands queued behind an answered batch: {e!r}"))
                finally:
                    lock.release()
                return
            if time.monotonic() >= give_up:
                return

    def inherit_after_fork(self, session_lock: Any) -> None:
        """In a child of fork(): forgets the parent's stream without touching it (its socket
        and call are the parent's; a cancel or shutdown here would end them there too)."""
        self._session_lock = session_lock
        self._cv = threading.Condition(threading.RLock())
        self._closed = True
        self._broken = True
        self.framed_opener = None
        # Kept: a gRPC call garbage collected here would be cancelled on the parent's
        # connection.
        _inherited.extend(x for x in (self._queue, self._call, self._framed_call) if x)
        self._queue = self._call = self._framed_call = None
        self._cmds = []
        self._labels = []
        self._sinks = {}
        self._inflight.clear()
        self._done = []

    def close(self) -> None:
        """Ends the stream at once (never waits: closing the session frees everything, so
        what is still queued is dropped), and wakes every waiter."""
        with self._cv:
            q, call = self._queue, self._call
            self._closed = True
            self._broken = True
            self._call = None
            if self._inflight:
                self._record(LogicError(
                    f"the context (session {self._session_id}) was detached before its queued "
                    "work was answered"))
                self.acked_batches += len(self._inflight)
                self._inflight.clear()
                self._inflight_download_bytes = 0
            self._cv.notify_all()
        if q is not None:
            q.close()
        if call is not None:
            call.cancel()


def print_device_output(data: bytes) -> None:
    """Writes what the session's kernels printf'ed (a synchronising answer's
    ``device_output``) to ``sys.stdout``, as a local GPU's driver writes it to the process's
    stdout; before the synchronising call returns."""
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()


def note_fault(fault: Dict[str, str], code: grpc.StatusCode, message: str) -> None:
    """Remembers the first fault reported on any path, for later messages."""
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
        fault.setdefault("cause", message)


class ProgressDeadline:
    """The deadline of a streamed transfer: cancels its call when no step (a chunk sent or
    received) was made for ``timeout`` seconds. A transfer's size has no bound, so the call
    as a whole has none. One short-lived thread per streamed transfer (they move >= 8 MiB).

    Use as a context manager; ``attach(call)`` once the call exists, ``progress()`` after
    every step; ``fired`` tells whether it cancelled the call.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.fired = False
        self._cv = threading.Condition(threading.Lock())
        self._last = time.monotonic()
        self._call: Any = None
        self._done = False
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "ProgressDeadline":
        if not math.isinf(self.timeout):
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="gpurpc-transfer-deadline")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cv:
            self._done = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def attach(self, call: Any) -> None:
        with self._cv:
            self._call = call
            self._last = time.monotonic()
            if self.fired:
                call.cancel()

    def progress(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        with self._cv:
            while not self._done:
                remaining = self._last + self.timeout - time.monotonic()
                if remaining <= 0:
                    self.fired = True
                    if self._call is not None:
                        self._call.cancel()
                    return
                self._cv.wait(remaining)


def session_error(code: grpc.StatusCode, details: str, operation: str, target: str,
                  session_id: int) -> Error:
    """The exception of a session-scoped call's failure: :class:`SessionLost` when the
    NOT_FOUND is about the session itself (the daemon restarted, or the session was closed or
    reclaimed), else as :func:`error_from_status`."""
    if code == grpc.StatusCode.NOT_FOUND and (details or "").startswith(f"no session {session_id}"):
        return session_lost_error(details, operation, target)
    return error_from_status(code, details, operation, target=target)


class _SessionState:
    """What a session's finalizer, watch thread and command stream share, without a
    reference to the session itself (which would keep it alive forever)."""

    def __init__(self, client: Client, metadata: Tuple, session_id: int,
                 backoff_cap_s: float) -> None:
        self.client = client
        self.metadata = metadata
        self.session_id = session_id
        self.timeout: float = client.timeout  # the session's call timeout, seconds
        self.backoff_cap_s = backoff_cap_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.closed = False
        self.commands: Optional[CommandStream] = None
        self.watch_call: Any = None
        # What the watch reported: FAULTED (code and cause) or lost (the NOT_FOUND message).
        self.fault_code: Optional[grpc.StatusCode] = None
        self.fault_cause = ""
        # "auto", "on" or "off" (SessionCore.host_regions).
        self.host_regions = client.host_regions
        self.lost: Optional[str] = None
        # The parent's pid, in a child of fork() that inherited this session (closed there).
        self.inherited_from: Optional[int] = None

    def on_event(self, event: Any) -> None:
        if event.state != session_service_pb2.SESSION_STATE_FAULTED:
            return
        with self.lock:
            if self.fault_code is None and self.lost is None:
                code = status_code_from_int(event.fault_code) if event.fault_code else \
                    grpc.StatusCode.FAILED_PRECONDITION
                if code == grpc.StatusCode.UNKNOWN and event.fault_code != 2:
                    code = grpc.StatusCode.FAILED_PRECONDITION
                self.fault_code = code
                self.fault_cause = event.fault_cause[:4096]

    def on_watch_end(self, code: grpc.StatusCode, details: str) -> None:
        with self.lock:
            if code == grpc.StatusCode.NOT_FOUND:
                self.lost = details or f"no session {self.session_id}"
            elif code == grpc.StatusCode.OK:
                self.lost = (f"no session {self.session_id}: it was closed or reclaimed by the "
                             "daemon (it ended the session's WatchSession stream)")

    @property
    def health(self) -> str:
        if self.closed:
            return "closed"
        if self.lost is not None:
            return "lost"
        if self.fault_code is not None:
            return "faulted"
        return "active"

    def unusable_error(self, operation: str) -> Optional[Error]:
        """The error every call raises now (None while the session is usable)."""
        with self.lock:
            lost, code, cause = self.lost, self.fault_code, self.fault_cause
        if lost is not None:
            return session_lost_error(lost, operation, self.client.target)
        if code is not None:
            # The daemon's own words for a call on a FAULTED session.
            return error_from_status(
                code, f"session {self.session_id} is FAULTED: {cause}; close it and open a "
                "new session", operation, target=self.client.target)
        return None


def _close_session(state: _SessionState) -> None:
    """Closes a session and never waits long: the watch and the command stream end at once,
    then CloseSession gets at most 5 s (or the call timeout when shorter). Never raises."""
    with state.lock:
        if state.closed:
            return
        state.closed = True
        watch = state.watch_call
    state.stop.set()
    if watch is not None:
        watch.cancel()
    if state.commands is not None:
        state.commands.close()
    try:
        state.client.call("SessionService.CloseSession",
                          session_service_pb2.CloseSessionRequest(), state.metadata,
                          timeout=min(state.timeout, CLOSE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - closing is best effort (daemon gone, stopped, restarted)
        pass


# Watch outcomes that end the watch for good: retrying cannot change them.
_WATCH_FINAL = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED)


def _watch_loop(state: _SessionState) -> None:
    """Holds the session's WatchSession stream open while the session is, re-opening it with a
    backoff (50 ms doubling to a quarter of the daemon's grace, at most 2 s) after it breaks,
    so that a network drop shorter than the grace keeps the session."""
    request = session_service_pb2.WatchSessionRequest()
    method = state.client.method("SessionService.WatchSession")
    backoff = WATCH_INITIAL_BACKOFF_S
    while not state.stop.is_set():
        debug.count(debug.WATCH_OPEN)
        try:
            # No deadline: the stream is meant to stay open as long as the session is used.
            call = method(request, metadata=state.metadata + state.client.auth_metadata)
        except ValueError:  # the Client's channel was closed: nothing to watch with
            return
        with state.lock:
            if state.closed:
                call.cancel()
                return
            state.watch_call = call
        try:
            for event in call:
                backoff = WATCH_INITIAL_BACKOFF_S
                state.on_event(event)
            state.on_watch_end(grpc.StatusCode.OK, "")  # the daemon ended it
            return
        except grpc.RpcError as e:
            if state.stop.is_set():
                return
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            if code in _WATCH_FINAL:
                state.on_watch_end(code, (e.details() if hasattr(e, "details") else "") or "")
                return
        except Exception:  # noqa: BLE001 - a daemon thread must not die noisily
            pass
        finally:
            with state.lock:
                if state.watch_call is call:
                    state.watch_call = None
        if state.stop.wait(backoff):
            return
        backoff = min(backoff * 2, state.backoff_cap_s)


class SessionCore:
    """One open session: id, metadata, lock, command stream, watch and deferred releases.

    Resources (buffers, modules, streams, events) hold a reference to their core, which keeps
    the session open while they live; the session closes at ``close()``, when the core is
    garbage collected, or at interpreter exit.
    """

    def __init__(self, client: Client, device_ordinal: int, label: str) -> None:
        # A session lives on one daemon: with several, the client of the one it opens on.
        client = client.primary()
        reply = client.call("SessionService.OpenSession",
                            session_service_pb2.OpenSessionRequest(
                                device_ordinal=device_ordinal, client_label=label),
                            reconnect=True)
        self.client = client
        self.session_id: int = reply.session_id
        self.device_info = reply.device
        self.device_ordinal = device_ordinal
        self.daemon_instance: str = reply.daemon_instance
        metadata = [(SESSION_METADATA_KEY, str(reply.session_id))]
        if reply.daemon_instance:
            metadata.append((INSTANCE_METADATA_KEY, reply.daemon_instance))
        self.metadata: Tuple[Tuple[str, str], ...] = tuple(metadata)
        self.lock = threading.RLock()
        self.fault: Dict[str, str] = {}
        self._releases: Deque[Tuple[str, int]] = collections.deque()
        self.caches: Dict[Any, Any] = {}  # per-session memo (compiled kernels, scratch, ...)
        self.idle_timeout_ms: int = reply.idle_timeout_ms or 0
        self.grace_ms: int = reply.grace_ms or 0
        backoff_cap = min(max(self.grace_ms / 4000.0, 0.1), 2.0) if self.grace_ms else 2.0
        self._state = _SessionState(client, self.metadata, self.session_id, backoff_cap)
        self.host_regions = client.host_regions
        self.commands = CommandStream(client, self.metadata, self.session_id, self.fault,
                                      self._state, self.lock)
        self._state.commands = self.commands
        if _framed.SUPPORTED and _is_unix(client.target):
            # Locals only: a reference to this object would keep the session open forever.
            state, metadata, session_id = self._state, self.metadata, self.session_id
            self.commands.framed_opener = lambda: None if state.host_regions == "off" else \
                _framed.open_framed_call(client, metadata, session_id, state.timeout)
        self._finalizer = weakref.finalize(self, _close_session, self._state)
        _live_sessions.add(self)
        threading.Thread(target=_watch_loop, args=(self._state,), daemon=True,
                         name=f"gpurpc-watch-{self.session_id}").start()

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def timeout(self) -> float:
        """The call timeout of this session's calls, seconds (``math.inf``: none)."""
        return self._state.timeout

    @timeout.setter
    def timeout(self, value: Optional[float]) -> None:
        self._state.timeout = resolve_timeout(value) if value is not None else self.client.timeout

    @property
    def host_regions(self) -> str:
        """"auto", "on" or "off": whether this session uses same-host regions (_regions) and
        the framed command channel (_framed; decided when its first stream opens)."""
        return self._state.host_regions

    @host_regions.setter
    def host_regions(self, value: str) -> None:
        self._state.host_regions = value

    @property
    def health(self) -> str:
        """"active", "faulted", "lost" or "closed", as far as the watch knows."""
        return self._state.health

    def unusable_error(self, operation: str) -> Optional[Error]:
        """The error calls on this session raise now, or None while it is usable."""
        return self._state.unusable_error(operation)

    def close(self) -> None:
        """Closes the session on the daemon (idempotent, never raises, never waits long; does
        not take the session lock, so it also ends a call that another thread waits on)."""
        self._finalizer()

    def inherit_after_fork(self, parent: int) -> None:
        """In a child of fork(): this session is the parent's. It is closed here without a
        word to the daemon (the parent goes on using it), its releases are dropped, and its
        locks are new (a parent's thread may have held them at the fork)."""
        self._finalizer.detach()
        state = self._state
        state.lock = threading.Lock()
        state.stop = threading.Event()
        state.stop.set()
        if state.watch_call is not None:
            _inherited.append(state.watch_call)  # collected, it would cancel on the parent's
        state.watch_call = None
        state.inherited_from = parent
        state.closed = True
        self.lock = threading.RLock()
        self._releases.clear()
        self.commands.inherit_after_fork(self.lock)

    def check_attached(self, what: str = "this call") -> None:
        """Raises when the session is detached (or is a forked parent's)."""
        if self._state.inherited_from is not None:
            raise inherited_session_error(self.session_id, self._state.inherited_from, what)
        if self._state.closed:
            raise LogicError(f"{what}: the context (session {self.session_id}) was detached; "
                             "its memory, modules, streams and events are gone")

    def check_open(self, what: str = "this call") -> None:
        """Raises when the session is detached, or when the watch found it FAULTED or gone
        (unless queued work has an error of its own to report first, at the next drain)."""
        self.check_attached(what)
        if self._state.fault_code is not None or self._state.lost is not None:
            if not self.commands.has_error:
                error = self._state.unusable_error(what)
                if error is not None:
                    raise error

    def note_status(self, code: grpc.StatusCode, message: str) -> None:
        """Remembers a fault reported by any path, for later messages."""
        note_fault(self.fault, code, message)
        if code == grpc.StatusCode.NOT_FOUND and (
                message.startswith(f"no session {self.session_id}")
                or "restarted" in message.lower()):
            self._state.on_watch_end(code, message)

    def call(self, name: str, request: Any, cls: Optional[type] = None, op: Optional[str] = None,
             timeout: Optional[float] = None) -> Any:
        """A session-scoped unary RPC (carries the session metadata; deadline ``timeout``,
        default the session's call timeout)."""
        self.check_open(op or name)
        try:
            return self.client.call(name, request, self.metadata,
                                    timeout=self._state.timeout if timeout is None else timeout,
                                    cls=cls, op=op)
        except Error as e:
            if e.code is not None:
                self.note_status(e.code, e.details)
            if e.code == grpc.StatusCode.NOT_FOUND and not isinstance(e, SessionLost) and \
                    e.details.startswith(f"no session {self.session_id}"):
                raise session_lost_error(e.details, op or name, self.client.target) from None
            raise

    def allocate_array(self, descriptor: memory_service_pb2.ArrayDescriptor,
                       op: str = "Array") -> memory_service_pb2.BufferInfo:
        """Creates a CUDA array (``MemoryService.Allocate`` with ``array`` set); its BufferInfo
        (buffer_id = the array's handle, size_bytes = what it is charged, array = its shape).
        Freed with ``MemoryService.Free`` like a buffer (release kind "buffer")."""
        reply = self.call("MemoryService.Allocate",
                          memory_service_pb2.AllocateRequest(array=descriptor), op=op)
        return reply.buffer

    def drain(self, timeout: Optional[float] = None) -> None:
        """Waits until every queued command is enqueued on the server (errors raise here), at
        most ``timeout`` s (default: the session's call timeout)."""
        self.commands.drain(timeout)

    # -- deferred releases of garbage-collected handles -------------------------------------

    def defer_release(self, kind: str, handle: int) -> None:
        """Called from finalizers (any thread, maybe inside our own code): no RPC here."""
        self._releases.append((kind, handle))

    _RELEASE_RPCS = {
        "buffer": ("MemoryService.Free", memory_service_pb2.FreeRequest, "buffer_id"),
        "stream": ("ExecutionService.DestroyStream", execution_service_pb2.DestroyStreamRequest,
                   "stream_id"),
        "event": ("ExecutionService.DestroyEvent", execution_service_pb2.DestroyEventRequest,
                  "event_id"),
        "module": ("ModuleService.UnloadModule", module_service_pb2.UnloadModuleRequest,
                   "module_id"),
        "graph": ("ExecutionService.DestroyGraph", execution_service_pb2.DestroyGraphRequest,
                  "graph_id"),
        "graph_exec": ("ExecutionService.DestroyGraphExec",
                       execution_service_pb2.DestroyGraphExecRequest, "graph_exec_id"),
        "region": ("HostRegionService.UnregisterHostRegion",
                   host_region_service_pb2.UnregisterHostRegionRequest, "region_id"),
    }

    def process_releases(self) -> None:
        """Frees garbage-collected handles. The command stream must be drained already, so
        that no queued command still names them."""
        if self._state.closed or self._state.health != "active":
            self._releases.clear()  # a closed, dead or faulted session frees everything
            return
        while self._releases:
            kind, handle = self._releases.popleft()
            name, req_cls, field = self._RELEASE_RPCS[kind]
            try:
                self.client.call(name, req_cls(**{field: handle}), self.metadata,
                                 timeout=min(self._state.timeout, CLEANUP_TIMEOUT_S))
            except Error:
                pass  # a dead or faulted session frees everything anyway; never spam

    @property
    def has_releases(self) -> bool:
        return bool(self._releases)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
