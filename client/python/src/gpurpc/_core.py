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
"""
from __future__ import annotations

import collections
import os
import queue
import stat
import threading
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import grpc

from . import debug
from ._errors import (
    Error,
    LaunchError,
    LogicError,
    RuntimeError,
    error_from_rpc,
    error_from_status,
    status_code_from_int,
)
from .v1 import (
    admin_service_pb2,
    common_pb2,
    device_service_pb2,
    execution_service_pb2,
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
STREAMED_TRANSFER_BYTES = 8 << 20    # synchronous transfers above this use Upload/DownloadStream
SESSION_METADATA_KEY = "gpurpc-session"

# The client builds its callables from the service descriptors rather than the generated
# *_pb2_grpc stubs, which need grpcio >= 1.63: this works with any grpcio.
_SERVICE_MODULES = {
    "AdminService": admin_service_pb2,
    "DeviceService": device_service_pb2,
    "SessionService": session_service_pb2,
    "MemoryService": memory_service_pb2,
    "ModuleService": module_service_pb2,
    "ExecutionService": execution_service_pb2,
}


def _message_class(module: Any, descriptor: Any) -> Any:
    cls = getattr(module, descriptor.name, None)
    if cls is None:
        from google.protobuf import message_factory
        cls = message_factory.GetMessageClass(descriptor)
    return cls


def _make_callable(channel: grpc.Channel, name: str, request_serializer: Any = "default",
                   ) -> Callable:
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
    return factory(f"/{method.containing_service.full_name}/{method.name}",
                   request_serializer=request_serializer,
                   response_deserializer=_message_class(module, method.output_type).FromString)


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
    if target.startswith("/"):
        target = "unix:" + target
    return target


def resolve_address(address: Optional[str] = None) -> str:
    """The gRPC target for ``address``, else ``$GPURPC_ADDRESS``, else the first default
    daemon socket that exists (:func:`default_socket_paths`).

    A bare absolute path (``/run/gpurpc.sock``) means a Unix socket; ``unix:PATH`` and
    ``unix:///PATH`` are passed through, as are every other gRPC target syntax.

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


_TRUE = ("1", "true", "yes")


class Client:
    """One gRPC channel to a gpurpcd, with its stubs. Thread-safe.

    Where: ``address``, else ``$GPURPC_ADDRESS``, else the first default socket that exists
    (see :func:`resolve_address`).

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

    def __init__(self, address: Optional[str] = None, *, token: Optional[str] = None,
                 root_certificates: Optional[bytes] = None, tls: Optional[bool] = None,
                 certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 server_name: Optional[str] = None) -> None:
        self.target = resolve_address(address)
        # What was asked for explicitly (driver.init reuses a client asked for the same).
        self.explicit_credentials: Tuple[Any, ...] = (
            token, root_certificates, tls, certificate_chain, private_key, server_name)
        token = resolve_token(token)
        options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        if _is_loopback(self.target):
            # An http_proxy in the environment must not capture loopback traffic.
            options.append(("grpc.enable_http_proxy", 0))
        env = {} if _is_unix(self.target) else os.environ
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
            server_name = env.get("GPURPC_TLS_SERVER_NAME") or None
        if tls is None:
            tls = (env.get("GPURPC_TLS", "").strip().lower() in _TRUE
                   or root_certificates is not None or certificate_chain is not None)
        self.tls = bool(tls)
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                                 private_key=private_key,
                                                 certificate_chain=certificate_chain)
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.secure_channel(self.target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(self.target, options=options)
        self.has_credentials = bool(token) or certificate_chain is not None
        # Added to the metadata of every call (unary, streaming and the command stream).
        self.auth_metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", "Bearer " + token),) if token else ())
        self._methods: Dict[str, Callable] = {}
        # Raw-bytes request serializer: the command stream encodes batches itself.
        self.command_stream = _make_callable(self.channel, "ExecutionService.CommandStream",
                                             request_serializer=None)
        self._devices: Optional[device_service_pb2.ListDevicesResponse] = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"<gpurpc Client {self.target!r}{' tls' if self.tls else ''}"
                f"{' with credentials' if self.has_credentials else ''}>")

    def method(self, name: str) -> Callable:
        """The gRPC callable of ``Service.Method``."""
        fn = self._methods.get(name)
        if fn is None:
            fn = self._methods[name] = _make_callable(self.channel, name)
        return fn

    def call(self, name: str, request: Any, metadata: Tuple = (), timeout: Optional[float] = None,
             cls: Optional[type] = None, op: Optional[str] = None) -> Any:
        """Calls a unary RPC ``Service.Method``; a failure raises the mapped gpurpc error."""
        debug.count(name)
        try:
            return self.method(name)(request, metadata=metadata + self.auth_metadata,
                                     timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, op or name, cls, self.target, self.tls) from None

    def list_devices(self, refresh: bool = False) -> device_service_pb2.ListDevicesResponse:
        """The daemon's device inventory (cached after the first call)."""
        with self._lock:
            if self._devices is None or refresh:
                self._devices = self.call("DeviceService.ListDevices",
                                          device_service_pb2.ListDevicesRequest(), timeout=30)
            return self._devices

    def server_info(self) -> device_service_pb2.GetServerInfoResponse:
        """The daemon as this client sees it: tenant, auth method, admin flag, quota, usage
        and compile sandbox (``DeviceService.GetServerInfo``)."""
        return self.call("DeviceService.GetServerInfo",
                         device_service_pb2.GetServerInfoRequest(), timeout=30)

    def admin_list_sessions(self, tenant: str = "") -> admin_service_pb2.ListSessionsResponse:
        """Every open session (of ``tenant`` only, when given). Admin tenants only."""
        return self.call("AdminService.ListSessions",
                         admin_service_pb2.ListSessionsRequest(tenant=tenant), timeout=30)

    def admin_close_session(self, session_id: int) -> admin_service_pb2.AdminCloseSessionResponse:
        """Closes any tenant's session. Admin tenants only."""
        return self.call("AdminService.CloseSession",
                         admin_service_pb2.AdminCloseSessionRequest(session_id=int(session_id)),
                         timeout=30)

    def close(self) -> None:
        self.channel.close()


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


def frame_command(seq: int, kind_tag: bytes, body: bytes) -> bytes:
    """CommandBatch field-1 entry for a Command with ``sequence`` and one ``kind`` field."""
    cmd = b"\x08" + varint(seq) + kind_tag + varint(len(body)) + body
    return b"\x0a" + varint(len(cmd)) + cmd


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


# ---------------------------------------------------------------------------------------------

class _Batch:
    __slots__ = ("first_seq", "labels", "sinks", "download_bytes")

    def __init__(self, first_seq: int, labels: List[str], sinks: Dict[int, Callable],
                 download_bytes: int) -> None:
        self.first_seq = first_seq
        self.labels = labels
        self.sinks = sinks
        self.download_bytes = download_bytes

    def label(self, seq: int) -> str:
        i = seq - self.first_seq
        if 0 <= i < len(self.labels):
            return self.labels[i]
        return f"command #{seq}"


class CommandStream:
    """The session's ordered command stream (one bidi RPC, reopened after it ends).

    Callers hold the session lock for every method; the reader thread only touches the state
    guarded by ``_cv``.
    """

    def __init__(self, client: Client, metadata: Tuple, session_id: int,
                 fault: Dict[str, str]) -> None:
        # No reference to the SessionCore: the session's finalizer reaches this object, and
        # a reference back would keep the session alive forever.
        self._client = client
        self._metadata = metadata
        self._session_id = session_id
        self._fault = fault
        self._cv = threading.Condition(threading.Lock())
        self._queue: Optional[queue.SimpleQueue] = None
        self._call: Any = None
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

    # -- sending and receiving ------------------------------------------------------------

    def _open(self) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        call = self._client.command_stream(iter(q.get, None),
                                           metadata=self._metadata + self._client.auth_metadata)
        debug.count(debug.STREAM_OPEN)
        self._queue = q
        self._call = call
        self._broken = False
        threading.Thread(target=self._reader, args=(call,), daemon=True,
                         name=f"gpurpc-commands-{self._session_id}").start()

    def flush(self) -> None:
        """Sends the pending commands as one batch (does not wait for its reply)."""
        if not self._cmds:
            return
        batch = _Batch(self._first_seq, self._labels, self._sinks, self._download_bytes)
        payload = b"".join(self._cmds)
        self._cmds = []
        self._labels = []
        self._sinks = {}
        self._bytes = 0
        self._download_bytes = 0
        with self._cv:
            while (len(self._inflight) >= MAX_INFLIGHT_BATCHES or (
                    self._inflight and self._inflight_download_bytes + batch.download_bytes
                    > MAX_INFLIGHT_DOWNLOAD_BYTES)) and not self._broken:
                self._cv.wait()
            if self._broken:
                self._open()
            self._inflight.append(batch)
            self._inflight_download_bytes += batch.download_bytes
            q = self._queue
        debug.count(debug.BATCH)
        q.put(payload)  # type: ignore[union-attr]

    def drain(self) -> None:
        """Sends pending commands and waits until every batch is acknowledged.

        Raises the first error reported since the last drain (asynchronous errors included).
        """
        self.flush()
        with self._cv:
            while self._inflight:
                self._cv.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def sync(self, stream_id: int = 0, whole_session: bool = False, label: str = "synchronize",
             ) -> None:
        """Queues a SyncCommand and drains: returns once the work is done on the server."""
        self.add(label, auto=False,
                 sync=execution_service_pb2.SyncCommand(stream_id=stream_id,
                                                        whole_session=whole_session))
        self.drain()

    def _record(self, error: Error) -> None:
        # Caller holds _cv. The first error wins: it is the one that explains the others.
        if self._error is None:
            self._error = error

    def _reader(self, call: Any) -> None:
        end_error: Optional[Error] = None
        try:
            for reply in call:
                with self._cv:
                    batch = self._inflight.popleft() if self._inflight else None
                if batch is None:
                    continue
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
                    error = error_from_status(code, reply.error.message,
                                              batch.label(reply.error.sequence),
                                              target=self._client.target)
                    note_fault(self._fault, code, reply.error.message)
                with self._cv:
                    if error is not None:
                        self._record(error)
                        if error.code == grpc.StatusCode.ABORTED and self._call is call:
                            # A fault ends this stream; later batches must go to a new one
                            # (which the daemon refuses with the fault's cause).
                            self._broken = True
                    self._inflight_download_bytes -= batch.download_bytes
                    self._cv.notify_all()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            if code != grpc.StatusCode.CANCELLED or self._call is call:
                end_error = error_from_rpc(e, "ExecutionService.CommandStream",
                                           target=self._client.target)
                note_fault(self._fault, code, (e.details() if hasattr(e, "details") else "") or "")
        with self._cv:
            if self._call is call:
                self._broken = True
            if self._inflight:
                if end_error is None:
                    end_error = LaunchError(
                        "ExecutionService.CommandStream ended before answering every batch",
                        code=grpc.StatusCode.UNKNOWN, operation="ExecutionService.CommandStream")
                self._record(end_error)
                self._inflight.clear()
                self._inflight_download_bytes = 0
            self._cv.notify_all()

    def close(self) -> Any:
        """Half-closes the stream after sending what is pending (does not wait). Returns the
        call, for the caller to cancel once the session is closed."""
        try:
            self.flush()
        except Error:
            pass
        with self._cv:
            q, call = self._queue, self._call
            self._broken = True
            self._call = None
        if q is not None:
            q.put(None)
        return call


def note_fault(fault: Dict[str, str], code: grpc.StatusCode, message: str) -> None:
    """Remembers the first fault reported on any path, for later messages."""
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
        fault.setdefault("cause", message)


class _CloseState:
    """What a session's finalizer needs, without a reference to the session itself."""

    def __init__(self, client: Client, metadata: Tuple) -> None:
        self.client = client
        self.metadata = metadata
        self.stop = threading.Event()
        self.closed = False
        self.commands: Optional[CommandStream] = None


def _close_session(state: _CloseState) -> None:
    if state.closed:
        return
    state.closed = True
    state.stop.set()
    call = state.commands.close() if state.commands is not None else None
    try:
        state.client.call("SessionService.CloseSession",
                          session_service_pb2.CloseSessionRequest(), state.metadata, timeout=10)
    except Exception:  # noqa: BLE001 - closing is best effort (daemon gone, already closed)
        pass
    if call is not None:
        call.cancel()


def _keepalive_loop(state: _CloseState, interval_s: float, fault: Dict[str, str]) -> None:
    request = session_service_pb2.KeepAliveRequest()
    while not state.stop.wait(interval_s):
        try:
            reply = state.client.call("SessionService.KeepAlive", request, state.metadata,
                                      timeout=max(5.0, interval_s))
        except Error as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                fault.setdefault("lost", e.details)
                return
            continue
        if reply.state == session_service_pb2.SESSION_STATE_FAULTED:
            fault.setdefault("cause", reply.fault_cause)


class SessionCore:
    """One open session: id, metadata, lock, command stream and deferred releases.

    Resources (buffers, modules, streams, events) hold a reference to their core, which keeps
    the session open while they live; the session closes at ``close()``, when the core is
    garbage collected, or at interpreter exit.
    """

    def __init__(self, client: Client, device_ordinal: int, label: str) -> None:
        reply = client.call("SessionService.OpenSession",
                            session_service_pb2.OpenSessionRequest(
                                device_ordinal=device_ordinal, client_label=label), timeout=60)
        self.client = client
        self.session_id: int = reply.session_id
        self.device_info = reply.device
        self.device_ordinal = device_ordinal
        self.metadata: Tuple[Tuple[str, str], ...] = (
            (SESSION_METADATA_KEY, str(reply.session_id)),)
        self.lock = threading.RLock()
        self.fault: Dict[str, str] = {}
        self._releases: Deque[Tuple[str, int]] = collections.deque()
        self.caches: Dict[Any, Any] = {}  # per-session memo (compiled kernels, scratch, ...)
        self._state = _CloseState(client, self.metadata)
        self.commands = CommandStream(client, self.metadata, self.session_id, self.fault)
        self._state.commands = self.commands
        self._finalizer = weakref.finalize(self, _close_session, self._state)
        idle_ms = reply.idle_timeout_ms or 0
        self.idle_timeout_ms: int = idle_ms
        if idle_ms:
            threading.Thread(target=_keepalive_loop,
                             args=(self._state, max(idle_ms / 3000.0, 0.05), self.fault),
                             daemon=True, name=f"gpurpc-keepalive-{self.session_id}").start()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Closes the session on the daemon (idempotent, never raises)."""
        with self.lock:
            self._finalizer()

    def check_open(self, what: str = "this call") -> None:
        if self._state.closed:
            raise LogicError(f"{what}: the context (session {self.session_id}) was detached; "
                             "its memory, modules, streams and events are gone")

    def note_status(self, code: grpc.StatusCode, message: str) -> None:
        """Remembers a fault reported by any path, for later messages."""
        note_fault(self.fault, code, message)

    def call(self, name: str, request: Any, cls: Optional[type] = None, op: Optional[str] = None,
             timeout: Optional[float] = None) -> Any:
        """A session-scoped unary RPC (carries the session metadata)."""
        self.check_open(op or name)
        try:
            return self.client.call(name, request, self.metadata, timeout=timeout, cls=cls, op=op)
        except Error as e:
            if e.code is not None:
                self.note_status(e.code, e.details)
            raise

    def drain(self) -> None:
        """Waits until every queued command is enqueued on the server (errors raise here)."""
        self.commands.drain()

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
    }

    def process_releases(self) -> None:
        """Frees garbage-collected handles. The command stream must be drained already, so
        that no queued command still names them."""
        if self._state.closed:
            self._releases.clear()
            return
        while self._releases:
            kind, handle = self._releases.popleft()
            name, req_cls, field = self._RELEASE_RPCS[kind]
            try:
                self.client.call(name, req_cls(**{field: handle}), self.metadata, timeout=30)
            except Error:
                pass  # a dead or faulted session frees everything anyway; never spam

    @property
    def has_releases(self) -> bool:
        return bool(self._releases)
