"""Exception classes of gpurpc (PyCUDA's names) and the mapping from gRPC status codes.

PyCUDA users catch ``pycuda.driver.Error`` and its subclasses; gpurpc keeps those names and
maps the daemon's status codes onto them:

================================  ==============  =============================================
gRPC status                       exception       PyCUDA equivalent
================================  ==============  =============================================
INVALID_ARGUMENT, NOT_FOUND,      LogicError      invalid value / handle, bad launch config
OUT_OF_RANGE, ALREADY_EXISTS
RESOURCE_EXHAUSTED                MemoryError     CUDA_ERROR_OUT_OF_MEMORY
ABORTED                           LaunchError     the call that observed a kernel fault
FAILED_PRECONDITION               LaunchError     the session was killed by an earlier fault;
                                                  like CUDA's sticky error, every later call
                                                  fails, and the message names the cause
UNAVAILABLE                       RuntimeError    no daemon / device (CUDA_ERROR_NO_DEVICE);
                                                  also a failed TLS handshake
UNAUTHENTICATED,                  Error           (none: missing or refused credentials; the
PERMISSION_DENIED,                                admin calls of a tenant that is no admin)
anything else                     Error           CUDA_ERROR_UNKNOWN
================================  ==============  =============================================

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
    grpc.StatusCode.UNAVAILABLE: RuntimeError,
}

# Words of gRPC's messages for a failed TLS handshake.
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate")

_FAULT_HINT = ("the session is unusable after this fault; open a new one "
               "(Device(n).make_context()) to continue")


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
        cls = _CLASS_BY_CODE.get(code, Error)
    message = f"{operation} failed: {details or code.name}"
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION) and \
            issubclass(cls, LaunchError):
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
