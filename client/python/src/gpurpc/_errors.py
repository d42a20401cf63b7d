"""Exception classes of gpurpc (PyCUDA's names) and the mapping from gRPC status codes.

PyCUDA users catch ``pycuda.driver.Error`` and its subclasses; gpurpc keeps those names and
maps the daemon's status codes onto them:

================================  ================  ===========================================
gRPC status                       exception         PyCUDA equivalent
================================  ================  ===========================================
INVALID_ARGUMENT, NOT_FOUND,      LogicError        invalid value / handle, bad launch config
OUT_OF_RANGE, ALREADY_EXISTS
NOT_FOUND for the session itself  SessionLost       (none: the session is gone: closed,
                                  (a LogicError)    reclaimed, or the daemon restarted)
RESOURCE_EXHAUSTED                MemoryError       CUDA_ERROR_OUT_OF_MEMORY
ABORTED                           LaunchError       the call that observed a kernel fault
FAILED_PRECONDITION               LaunchError       the session was killed by an earlier fault;
                                                    like CUDA's sticky error, every later call
                                                    fails, and the message names the cause
FAILED_PRECONDITION of CUDA       LogicError        CUDA_ERROR_STREAM_CAPTURE_*: work a capture
graph misuse (is_graph_misuse)                      cannot record, a refused graph update; the
                                                    session lives
DEADLINE_EXCEEDED from the        LaunchError       CUDA_ERROR_LAUNCH_TIMEOUT: the daemon's
daemon                                              kernel watchdog ended the session
DEADLINE_EXCEEDED of the client   CallTimeoutError  (none: the call's own deadline passed; also
                                                    a builtins.TimeoutError)
UNAVAILABLE                       RuntimeError      no daemon / device (CUDA_ERROR_NO_DEVICE);
                                                    also a failed TLS handshake
UNAUTHENTICATED,                  Error             (none: missing or refused credentials; the
PERMISSION_DENIED,                                  admin calls of a tenant that is no admin)
anything else                     Error             CUDA_ERROR_UNKNOWN
================================  ================  ===========================================

PyCUDA reports an illegal address as ``LogicError`` (it maps every CUDA error it does not
know to LogicError). A remote session cannot tell the flavours of a fault apart reliably, so
every kernel fault, and every call refused afterwards, is a :class:`LaunchError` — what code
that retries launches (``except LaunchError``) expects.

Every exception carries ``code`` (the :class:`grpc.StatusCode`, or None for client-side
errors), ``details`` (the daemon's message) and ``operation`` (the RPC or API call).
"""
from __future__ import annotations

import builtins
from typing import Optional, Sequence

import grpc

__all__ = [
    "Error",
    "LogicError",
    "LaunchError",
    "MemoryError",
    "RuntimeError",
    "CompileError",
    "SessionLost",
    "CallTimeoutError",
    "status_code_from_int",
    "error_from_status",
]


class Error(Exception):
    """Base class of every gpurpc error (``pycuda.driver.Error``)."""

    code: Optional[grpc.StatusCode]
    details: str
    operation: str

    def __init__(self, message: str = "", *, code: Optional[grpc.StatusCode] = None,
                 details: str = "", operation: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details or message
        self.operation = operation


class LogicError(Error):
    """A call was made with invalid arguments or handles (``pycuda.driver.LogicError``)."""


class LaunchError(Error):
    """A kernel faulted, or the session is dead after a fault (``pycuda.driver.LaunchError``)."""


class SessionLost(LogicError):
    """The session is gone: the daemon restarted (which ends every session of its earlier
    run), or the session was closed or reclaimed. Every later call on it raises this too;
    make a new context (``Device(n).make_context()``) to continue. ``code`` is NOT_FOUND."""


class CallTimeoutError(Error, builtins.TimeoutError):
    """A call's own deadline passed (``code`` DEADLINE_EXCEEDED; the message names the call and
    the timeout). The session stays usable, and a deadline on a synchronising call does not
    stop GPU work: it goes on, and a later synchronising call waits for it. Also a
    :class:`builtins.TimeoutError`."""


class MemoryError(Error):  # noqa: A001 - PyCUDA's name
    """Device memory (or the session's quota) is exhausted (``pycuda.driver.MemoryError``)."""


class RuntimeError(Error):  # noqa: A001 - PyCUDA's name
    """The daemon or device is unavailable (``pycuda.driver.RuntimeError``)."""


class CompileError(Error):
    """NVRTC rejected the source. ``str()`` shows the message, command line and log.

    Attributes mirror PyCUDA's: ``msg``, ``command_line`` (the NVRTC options actually used),
    ``stdout`` (always empty: NVRTC has none) and ``stderr`` (the NVRTC log).
    """

    def __init__(self, msg: str, command_line: Sequence[str] = (), stdout: str = "",
                 stderr: str = "") -> None:
        super().__init__(msg, operation="ModuleService.Compile", details=stderr or msg)
        self.msg = msg
        self.command_line = list(command_line)
        self.stdout = stdout
        self.stderr = stderr

    def __str__(self) -> str:
        result = self.msg
        if self.command_line:
            result += "\n[command: %s]" % " ".join(self.command_line)
        if self.stdout:
            result += "\n[stdout:\n%s]" % self.stdout
        if self.stderr:
            result += "\n[stderr:\n%s]" % self.stderr
        return result


_BY_INT = {c.value[0]: c for c in grpc.StatusCode}

_CLASS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: LogicError,
    grpc.StatusCode.NOT_FOUND: LogicError,
    grpc.StatusCode.OUT_OF_RANGE: LogicError,
    grpc.StatusCode.ALREADY_EXISTS: LogicError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MemoryError,
    grpc.StatusCode.ABORTED: LaunchError,
    grpc.StatusCode.FAILED_PRECONDITION: LaunchError,
    # From the daemon, DEADLINE_EXCEEDED is its kernel watchdog (the session is FAULTED); a
    # call's own deadline becomes CallTimeoutError where the call is made.
    grpc.StatusCode.DEADLINE_EXCEEDED: LaunchError,
    grpc.StatusCode.UNAVAILABLE: RuntimeError,
}

# Words of gRPC's messages for a failed TLS handshake.
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate")

_FAULT_HINT = ("the session is unusable after this fault; open a new one "
               "(Device(n).make_context()) to continue")
_RESTART_HINT = ("the daemon restarted, which ended every session of its earlier run: make a "
                 "new context (Device(n).make_context()) to continue")
_LOST_HINT = ("the session is gone: make a new context (Device(n).make_context()) to "
              "continue")


# What the daemon's FAILED_PRECONDITION says for CUDA graph misuse (a capturing stream,
# a stream that does or does not capture, a refused graph update): not a fault.
_GRAPH_MISUSE_MARKERS = ("capturing a graph", "is not capturing", "already capturing",
                         "CUDA_ERROR_STREAM_CAPTURE", "CUDA_ERROR_CAPTURED_EVENT",
                         "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the same topology",
                         "the capture is over")


def is_graph_misuse(details: str) -> bool:
    """True for the daemon's FAILED_PRECONDITION of CUDA graph misuse (see above), which
    :class:`LogicError` reports, as PyCUDA does, rather than a fault."""
    return "FAULTED" not in (details or "") and any(
        marker in (details or "") for marker in _GRAPH_MISUSE_MARKERS)


def says_daemon_restarted(details: str) -> bool:
    """True for the daemon's NOT_FOUND of a session from an earlier run of the daemon."""
    return "restarted" in (details or "").lower()


def session_lost_error(details: str, operation: str, target: str = "") -> SessionLost:
    """The :class:`SessionLost` for a NOT_FOUND that says the session itself is gone."""
    hint = _RESTART_HINT if says_daemon_restarted(details) else _LOST_HINT
    return SessionLost(f"{operation} failed: {details or 'NOT_FOUND'} ({hint}) [NOT_FOUND]",
                       code=grpc.StatusCode.NOT_FOUND, details=details, operation=operation)


def timeout_error(operation: str, timeout: Optional[float], detail: str = "") -> CallTimeoutError:
    """The :class:`CallTimeoutError` of a call that did not finish within ``timeout`` s."""
    what = f"{timeout:g} s" if timeout is not None else "its deadline"
    message = f"{operation} did not finish within {what}"
    if detail:
        message += f"; {detail}"
    message += (" (the call timeout: timeout= of init()/Client(), Context.timeout, a call's "
                "timeout=, or GPURPC_TIMEOUT) [DEADLINE_EXCEEDED]")
    return CallTimeoutError(message, code=grpc.StatusCode.DEADLINE_EXCEEDED, details=message,
                            operation=operation)


def status_code_from_int(value: int) -> grpc.StatusCode:
    """Maps a google.rpc.Code number (as in CommandError.code) to a grpc.StatusCode."""
    return _BY_INT.get(int(value), grpc.StatusCode.UNKNOWN)


def _unavailable_hint(details: str, target: str, tls: Optional[bool]) -> str:
    """What to check when the daemon at ``target`` could not be reached."""
    lowered = details.lower()
    if any(word in lowered for word in _TLS_WORDS):
        return (f" (TLS with the daemon at {target!r} failed: check the roots (GPURPC_TLS_CA or "
                "root_certificates=), the name its certificate carries (GPURPC_TLS_SERVER_NAME "
                "or server_name=), the client certificate, and that the daemon serves TLS)")
    if "socket closed" in lowered and tls is False:
        return (f" (the daemon at {target!r} closed the connection: if it serves TLS, set "
                "GPURPC_TLS=1 or GPURPC_TLS_CA, or pass tls=True)")
    if "socket closed" in lowered and tls:
        return (f" (the daemon at {target!r} closed the connection during the TLS handshake: "
                "does it want a client certificate it trusts (GPURPC_TLS_CERT and "
                "GPURPC_TLS_KEY, or certificate_chain= and private_key=)?)")
    return f" (daemon at {target!r}; set GPURPC_ADDRESS or pass address=)"


def error_from_status(code: grpc.StatusCode, details: str, operation: str,
                      cls: Optional[type] = None, target: str = "",
                      tls: Optional[bool] = None) -> Error:
    """Builds the exception for a failed call, with a PyCUDA-like message.

    ``cls`` overrides the class chosen from the code (some RPCs use a code differently);
    ``target`` and ``tls`` (whether the channel uses TLS, None if unknown) tune the hint.
    """
    if cls is None:
        if code == grpc.StatusCode.NOT_FOUND and says_daemon_restarted(details):
            return session_lost_error(details, operation, target)
        cls = _CLASS_BY_CODE.get(code, Error)
        if code == grpc.StatusCode.FAILED_PRECONDITION and is_graph_misuse(details):
            cls = LogicError  # the call was wrong for a stream or graph; the session lives
    message = f"{operation} failed: {details or code.name}"
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.DEADLINE_EXCEEDED) and issubclass(cls, LaunchError):
        message += f" ({_FAULT_HINT})"
    elif code == grpc.StatusCode.UNAVAILABLE and target:
        message += _unavailable_hint(details or "", target, tls)
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        message += (" (credentials: token=, GPURPC_TOKEN or GPURPC_TOKEN_FILE, or a TLS client "
                    "certificate; a Unix socket needs none)")
    message += f" [{code.name}]"
    return cls(message, code=code, details=details, operation=operation)


def error_from_rpc(err: grpc.RpcError, operation: str, cls: Optional[type] = None,
                   target: str = "", tls: Optional[bool] = None) -> Error:
    """Converts a grpc.RpcError (raised by a stub) into a gpurpc exception."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    return error_from_status(code, details or "", operation, cls, target, tls)


# builtins are shadowed above on purpose; keep a handle for internal use.
BuiltinRuntimeError = builtins.RuntimeError
BuiltinMemoryError = builtins.MemoryError
