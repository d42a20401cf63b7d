"""PyCUDA's ``pycuda.driver`` API, served by a remote gpurpcd.

Replace ``import pycuda.driver as cuda`` with ``import gpurpc.driver as cuda`` and the usual
calls work against the daemon named by ``$GPURPC_ADDRESS`` (``host:port``, or a path or
``unix:PATH`` for a Unix socket; default: the daemon's own default socket, when it exists), or
the one given to :func:`init` (which also takes the credentials)::

    import numpy as np
    import gpurpc.autoinit                      # opens a session on device 0
    import gpurpc.driver as cuda
    from gpurpc.compiler import SourceModule

    mod = SourceModule('''
    __global__ void multiply_them(float *dest, float *a, float *b)
    { const int i = threadIdx.x; dest[i] = a[i] * b[i]; }''')
    multiply_them = mod.get_function("multiply_them")
    a = np.random.randn(400).astype(np.float32)
    b = np.random.randn(400).astype(np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1), grid=(1, 1))

What differs from PyCUDA, and why:

* A *context* is a daemon session (one worker process, one CUDA context). ``make_context``
  opens it; ``push``/``pop`` only move it on a per-thread stack (a thread with an empty stack
  uses the most recently created context, so worker threads need no push); ``detach`` closes
  it. A context that is no longer referenced (nor any of its buffers, modules, streams or
  events) is closed when garbage collected, and every session is closed at interpreter exit.
* Launches, memsets, copies and event records are queued and sent in batches over one ordered
  command stream, so a launch costs microseconds, not a round trip. As in CUDA, an error of
  asynchronous work (a kernel fault, a bad address in ``memset_d32_async``) is raised by the
  next synchronising call (``synchronize``, a device-to-host copy, ``Event.query`` ...).
* Kernel arguments are packed PyCUDA's way, then placed at the offsets the kernel's parameter
  layout reports, so by-value ``float4``/struct arguments arrive intact; an argument whose
  size disagrees with its parameter raises :class:`LogicError` naming the parameter.
* ``In``/``Out``/``InOut`` arguments upload, launch and download in one batch: one round trip.
* ``time_kernel=True`` and ``prepared_timed_call`` time with events on the server.
* Host memory: on the daemon's host (a Unix-socket daemon) ``pagelocked_empty`` and friends
  return ndarrays backed by same-host regions, memory shared with the session's worker, and
  copies from and to them (``memcpy_*``, ``In``/``Out``, ``GPUArray.set``/``get``) are DMA
  without bytes through gRPC; large copies of other host memory go through a staging
  region. ``host_regions=`` of :func:`init`, ``$GPURPC_HOST_REGIONS`` (auto, on, off) and
  ``Context.host_regions`` choose (see ``gpurpc._regions``). Elsewhere host memory is
  ordinary. The ``_async`` copies accept any contiguous buffer; as in CUDA, one from a
  region-backed array reads it when its stream gets there (do not change it before), and
  ``memcpy_dtoh_async`` fills its destination when the stream (or context) is synchronised.
* After a kernel fault the session is dead (the daemon killed its worker): the faulting call
  raises :class:`LaunchError`, and so does every later call, with a message naming the cause.
  Open a new context to continue. Each context watches its session (one
  ``WatchSession`` stream): a fault it reports makes the next call raise at once, and
  ``Context.state``/``Context.fault`` tell without a call.
* Every call has a deadline: ``timeout=`` of :func:`init` (seconds; default
  ``$GPURPC_TIMEOUT``, else 300), ``Context.timeout`` per context, and ``timeout=`` of
  ``Context.synchronize``/``Stream.synchronize``/``Event.synchronize`` per call. A passed
  deadline raises :class:`CallTimeoutError` naming the call; it does not stop GPU work.
* When the daemon restarts, every session of its earlier run is gone: calls on such a context
  raise :class:`SessionLost` (a :class:`LogicError`) saying so; make a new context (the
  connection reconnects by itself). ``detach`` and the exit path never hang, also when the
  daemon is stopped or gone.
* Pitched memory (``mem_alloc_pitch``, ``Memcpy2D``/``Memcpy3D`` of linear memory,
  ``memset_d2d*``) is built from linear copies and memsets; see ``gpurpc._driver_extras``.
* :class:`Linker` gathers its inputs here and links them on the daemon in one
  ``ModuleService.LinkModule`` call (the driver's ``cuLink*`` there) when ``link_module`` is
  called; link errors surface then.
* Not available: texture/surface references, CUDA arrays, managed and
  mapped memory, IPC handles, peer copies, ``register_host_memory``. Asking for one raises :class:`AttributeError` saying why (so ``hasattr``
  checks keep working).
"""
from __future__ import annotations

import functools
import gc
import os
import re
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _core, _progress, _regions
from ._core import Client, SessionCore, device_pointer, resolve_address
from ._driver_extras import (
    Memcpy2D,
    Memcpy3D,
    aligned_empty,
    aligned_empty_like,
    aligned_zeros,
    aligned_zeros_like,
    mem_alloc_pitch,
    mem_get_address_range,
    memory_type,
    memset_d2d8,
    memset_d2d8_async,
    memset_d2d16,
    memset_d2d16_async,
    memset_d2d32,
    memset_d2d32_async,
    pointer_attribute,
)
from ._enums import (
    capture_mode,
    capture_status,
    ctx_flags,
    device_attribute,
    event_flags,
    func_cache,
    function_attribute,
    host_alloc_flags,
    jit_fallback,
    jit_input_type,
    jit_option,
    limit,
    shared_config,
    stream_flags,
)
from ._errors import (
    CallTimeoutError,
    CompileError,
    Error,
    LaunchError,
    LogicError,
    MemoryError,
    RuntimeError,
    SessionLost,
    timeout_error,
)
from .v1 import (
    execution_service_pb2 as _ex,
    memory_service_pb2 as _mem,
    module_service_pb2 as _mod,
    session_service_pb2 as _sess,
)

__all__ = [
    # errors
    "Error", "LogicError", "LaunchError", "MemoryError", "RuntimeError", "CompileError",
    "SessionLost", "CallTimeoutError",
    # enums
    "device_attribute", "function_attribute", "ctx_flags", "event_flags", "stream_flags",
    "host_alloc_flags", "func_cache", "shared_config", "limit", "capture_mode", "capture_status",
    "pointer_attribute", "memory_type", "jit_option", "jit_input_type", "jit_fallback",
    # init / devices / contexts
    "init", "get_version", "get_driver_version", "Device", "Context", "pick_device",
    # memory
    "mem_alloc", "mem_alloc_like", "mem_get_info", "DeviceAllocation", "PointerHolderBase",
    "mem_alloc_pitch", "mem_get_address_range", "Memcpy2D", "Memcpy3D",
    "memset_d2d8", "memset_d2d16", "memset_d2d32", "memset_d2d8_async", "memset_d2d16_async",
    "memset_d2d32_async",
    "to_device", "from_device", "from_device_like",
    "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_htod_async", "memcpy_dtoh_async",
    "memcpy_dtod_async", "memset_d8", "memset_d16", "memset_d32", "memset_d8_async",
    "memset_d16_async", "memset_d32_async",
    "pagelocked_empty", "pagelocked_zeros", "pagelocked_empty_like", "pagelocked_zeros_like",
    "aligned_empty", "aligned_zeros", "aligned_empty_like", "aligned_zeros_like",
    # execution
    "Stream", "Event", "Module", "Function", "module_from_buffer", "module_from_file",
    "Linker",
    "ArgumentHandler", "In", "Out", "InOut",
    # CUDA graphs
    "Graph", "GraphExec", "GraphNode",
    # gpurpc extras
    "set_transfer_progress",
]

# =============================================================================================
# Connection and devices

_client_lock = threading.Lock()
_default_client: Optional[Client] = None


def init(flags: int = 0, address: Optional[str] = None, *, token: Optional[str] = None,
         root_certificates: Optional[bytes] = None, tls: Optional[bool] = None,
         certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
         server_name: Optional[str] = None, timeout: Optional[float] = None,
         host_regions: Optional[str] = None) -> None:
    """Connects to the daemon (``cuInit``). Called implicitly by the first call that needs it.

    Devices, contexts and everything else use this connection afterwards. Calling it again
    with nothing, or with the same address and credentials, keeps the connection (a
    ``timeout`` or ``host_regions`` given then applies to contexts made afterwards); anything
    else replaces it (objects made before keep theirs).

    :param flags: accepted for PyCUDA compatibility (must be 0 in CUDA; ignored).
    :param address: gRPC target (``host:port``, ``unix:PATH`` or an absolute socket path);
        default ``$GPURPC_ADDRESS``, else the first of ``$XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock``,
        ``/run/gpurpc/gpurpcd.sock`` and ``/tmp/gpurpc-<uid>/gpurpcd.sock`` that exists.
        Several daemons: targets separated by commas, and ``dns:///NAME:PORT`` for every
        address NAME resolves to; their devices are numbered as one list and new sessions
        placed over them (see :func:`pick_device`); init then succeeds when one answers.
    :param token: bearer token; default ``$GPURPC_TOKEN``, else the contents of the file named
        by ``$GPURPC_TOKEN_FILE``. Not needed on a Unix socket.
    :param tls: use TLS; default ``$GPURPC_TLS=1``, or on when any certificate is given.
    :param root_certificates: PEM roots that verify the daemon (default: the file named by
        ``$GPURPC_TLS_CA``, else the system roots).
    :param certificate_chain: PEM client certificate for mutual TLS (default: the file named
        by ``$GPURPC_TLS_CERT``); its common name is the tenant.
    :param private_key: PEM key of that certificate (default: ``$GPURPC_TLS_KEY``).
    :param server_name: the name the daemon's certificate carries when it differs from the
        address (default ``$GPURPC_TLS_SERVER_NAME``).
    :param timeout: the call timeout in seconds (default ``$GPURPC_TIMEOUT``, else 300;
        ``math.inf``: no deadline): every call waits at most this long, then raises
        :class:`CallTimeoutError`.
    :param host_regions: ``"auto"`` (default ``$GPURPC_HOST_REGIONS``, else auto: same-host
        regions when the daemon is reached over a Unix socket), ``"on"`` (always; failures
        raise) or ``"off"``, for contexts made afterwards.
    :raises RuntimeError: the daemon cannot be reached (or no address is known; with
        several daemons: none answered, the message says why for each).
    :raises Error: with ``code`` UNAUTHENTICATED when the daemon refuses the credentials.
    :raises LogicError: unusable settings (an unreadable token or certificate file, ...).
    """
    global _default_client
    explicit = (token, root_certificates, tls, certificate_chain, private_key, server_name)
    with _client_lock:
        if _default_client is not None and (
                address is None or resolve_address(address) == _default_client.target) and (
                all(v is None for v in explicit)
                or explicit == _default_client.explicit_credentials):
            if timeout is not None:
                _default_client.timeout = _core.resolve_timeout(timeout)
            if host_regions is not None:
                _default_client.host_regions = _core.resolve_host_regions(host_regions)
            _default_client.list_devices()
            return
        client = Client(address, token=token, root_certificates=root_certificates, tls=tls,
                        certificate_chain=certificate_chain, private_key=private_key,
                        server_name=server_name, timeout=timeout, host_regions=host_regions)
        try:
            client.list_devices()
        except BaseException:
            client.close()
            raise
        _default_client = client


def _client() -> Client:
    if _default_client is None:
        init()
    assert _default_client is not None
    return _default_client


def _flat_devices(client: Client) -> Tuple[List[Tuple[Client, Any]], List[_core.DaemonStatus]]:
    """The devices of a client of several daemons as one list of ``(daemon's client,
    DeviceInfo)`` (the daemons asked now), and the daemons.

    :raises Error: no daemon answered (naming each and why).
    """
    daemons = client.daemons()
    if not any(d.ok for d in daemons):
        raise client.unreachable_error(daemons)
    entries = [(d.client, device) for d in daemons if d.ok and d.client is not None
               for device in d.devices.devices]  # type: ignore[union-attr]
    return entries, daemons


def get_driver_version() -> int:
    """The daemon's CUDA driver version (``cuDriverGetVersion``, e.g. 13000; 0 for the fake)."""
    return int(_client().list_devices().driver_version)


def get_version() -> Tuple[int, int, int]:
    """The CUDA version as a tuple, e.g. ``(13, 0, 0)`` (derived from the daemon's driver)."""
    v = get_driver_version()
    return (v // 1000, (v % 1000) // 10, 0)


_ATTRIBUTE_FIELDS: Dict[int, Callable[[Any], int]] = {
    device_attribute.MAX_THREADS_PER_BLOCK: lambda d: d.max_threads_per_block,
    device_attribute.MAX_BLOCK_DIM_X: lambda d: d.max_block_dim.x,
    device_attribute.MAX_BLOCK_DIM_Y: lambda d: d.max_block_dim.y,
    device_attribute.MAX_BLOCK_DIM_Z: lambda d: d.max_block_dim.z,
    device_attribute.MAX_GRID_DIM_X: lambda d: d.max_grid_dim.x,
    device_attribute.MAX_GRID_DIM_Y: lambda d: d.max_grid_dim.y,
    device_attribute.MAX_GRID_DIM_Z: lambda d: d.max_grid_dim.z,
    device_attribute.MAX_SHARED_MEMORY_PER_BLOCK: lambda d: d.max_shared_memory_per_block_bytes,
    device_attribute.WARP_SIZE: lambda d: d.warp_size,
    device_attribute.MULTIPROCESSOR_COUNT: lambda d: d.multiprocessor_count,
    device_attribute.COMPUTE_CAPABILITY_MAJOR: lambda d: d.compute_capability_major,
    device_attribute.COMPUTE_CAPABILITY_MINOR: lambda d: d.compute_capability_minor,
    device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
        lambda d: d.max_shared_memory_per_block_optin_bytes,
}


class Device:
    """A device of the daemon (``pycuda.driver.Device``).

    ``Device(n)`` takes an ordinal, or a PCI bus id string. Attributes are read once from
    the daemon's inventory; ``dev.multiprocessor_count`` and friends work like in PyCUDA.

    Several daemons (an address list, see :func:`init`): the devices form one list, the
    daemons in the order given (a dns:/// name's addresses sorted), each daemon's devices
    in ordinal order; a daemon that does not answer contributes none. ``Device(n)`` is the
    n-th of that list, asked of the daemons anew, with its attributes from its daemon;
    ``make_context`` opens the session there, and every call of that context goes to that
    daemon. ``ordinal`` is its ordinal on its daemon, ``daemon_target`` that daemon.
    """

    def __init__(self, number: Union[int, str]) -> None:
        client = _client()
        if client.multi_daemon:
            self._init_several(client, number)
            return
        devices = client.list_devices().devices
        if isinstance(number, str):
            matches = [d for d in devices if d.pci_bus_id.lower() == number.lower()]
            if not matches:
                raise LogicError(f"cuDeviceGetByPCIBusId failed: no device with PCI bus id "
                                 f"{number!r} at {client.target}")
            number = matches[0].ordinal
        ordinal = int(number)
        if not 0 <= ordinal < len(devices):
            raise LogicError(f"cuDeviceGet failed: invalid device ordinal {ordinal} "
                             f"(the daemon at {client.target} serves {len(devices)})")
        self._client = client
        self._ordinal = ordinal
        self._info = devices[ordinal]

    def _init_several(self, client: Client, number: Union[int, str]) -> None:
        entries, daemons = _flat_devices(client)
        if isinstance(number, str):
            matches = [i for i, (_c, d) in enumerate(entries)
                       if d.pci_bus_id and d.pci_bus_id.lower() == number.lower()]
            if not matches:
                raise LogicError(f"cuDeviceGetByPCIBusId failed: no device with PCI bus id "
                                 f"{number!r} at any daemon of {client.target}")
            number = matches[0]
        index = int(number)
        if not 0 <= index < len(entries):
            answering = sum(1 for d in daemons if d.ok)
            why = _core.describe_unavailable([d for d in daemons if not d.ok])
            raise LogicError(f"cuDeviceGet failed: invalid device ordinal {index} (the "
                             f"{answering} answering daemons of {client.target} serve "
                             f"{len(entries)}{'; ' + why if why else ''})")
        self._client, self._info = entries[index]
        self._ordinal = int(self._info.ordinal)

    @classmethod
    def _on(cls, client: Client, info: Any) -> "Device":
        """The device ``info`` (a ``DeviceInfo``) of the daemon of ``client``."""
        device = cls.__new__(cls)
        device._client = client
        device._ordinal = int(info.ordinal)
        device._info = info
        return device

    @staticmethod
    def count() -> int:
        """Number of devices the daemon serves; with several daemons, of all the daemons
        that answer now (asked anew at each call)."""
        client = _client()
        if client.multi_daemon:
            return len(_flat_devices(client)[0])
        return len(client.list_devices().devices)

    @property
    def daemon_target(self) -> str:
        """The gRPC target of the daemon that serves this device (gpurpc addition)."""
        return self._client.target

    def name(self) -> str:
        """The device's name, e.g. ``NVIDIA H200``."""
        return self._info.name

    def compute_capability(self) -> Tuple[int, int]:
        """``(major, minor)``."""
        return (self._info.compute_capability_major, self._info.compute_capability_minor)

    def total_memory(self) -> int:
        """Device memory in bytes."""
        return int(self._info.total_memory_bytes)

    def pci_bus_id(self) -> str:
        """PCI bus id (empty for the fake backend)."""
        return self._info.pci_bus_id

    @property
    def ordinal(self) -> int:
        """The device ordinal on the daemon."""
        return self._ordinal

    @property
    def is_fake(self) -> bool:
        """True for the daemon's fake backend (host memory, runs no device code)."""
        return bool(self._info.is_fake)

    @property
    def backend(self) -> str:
        """The daemon's backend: ``"cuda"`` or ``"fake"``."""
        return self._client.list_devices().backend

    def get_attribute(self, attr: Union[device_attribute, int]) -> int:
        """``cuDeviceGetAttribute``.

        :raises LogicError: the daemon does not report that attribute.
        """
        key = int(attr)
        if key in self._info.attributes:
            return int(self._info.attributes[key])
        field = _ATTRIBUTE_FIELDS.get(key)
        if field is not None:
            return int(field(self._info))
        name = device_attribute(key).name if key in device_attribute._value2member_map_ else key
        raise LogicError(f"cuDeviceGetAttribute failed: the daemon does not report {name}",
                         code=grpc.StatusCode.INVALID_ARGUMENT)

    def get_attributes(self) -> Dict[Any, int]:
        """Every attribute the daemon reports, keyed by :class:`device_attribute`."""
        result: Dict[Any, int] = {}
        for key, field in _ATTRIBUTE_FIELDS.items():
            result[device_attribute(key)] = int(field(self._info))
        for key, value in self._info.attributes.items():
            try:
                result[device_attribute(key)] = int(value)
            except ValueError:
                result[key] = int(value)
        return result

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            attr = device_attribute[name.upper()]
        except KeyError:
            raise AttributeError(name) from None
        return self.get_attribute(attr)

    def make_context(self, flags: int = 0) -> "Context":
        """Opens a session on this device and makes it current (pushes it)."""
        ctx = self.retain_primary_context()
        ctx.push()
        return ctx

    def retain_primary_context(self) -> "Context":
        """Opens a session on this device without pushing it."""
        label = f"python gpurpc on {socket.gethostname()} pid {os.getpid()}"
        core = SessionCore(self._client, self._ordinal, label)
        return Context(core, self)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Device) and other._ordinal == self._ordinal
                and other._client is self._client)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self._client.target, self._ordinal))

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Device {self._ordinal} {self.name()!r} at {self._client.target}>"


def _placement(client: Client) -> List[Device]:
    """The candidate devices for a new session, best first (see :func:`pick_device`)."""
    if not client.multi_daemon:
        devices = client.list_devices().devices
        if len(devices) == 1:
            return [Device._on(client, devices[0])]  # nothing to rank: no round trip
    daemons = client.daemons()
    if not any(d.ok for d in daemons):
        if not client.multi_daemon and daemons and daemons[0].error is not None:
            raise daemons[0].error  # one daemon: its own error, as ever
        raise client.unreachable_error(daemons)
    ranked = _core.rank_devices(daemons)
    if not ranked:
        why = _core.describe_unavailable(daemons)
        raise RuntimeError(f"no daemon can take a new session{': ' + why if why else ''} "
                           "[UNAVAILABLE]", code=grpc.StatusCode.UNAVAILABLE, details=why,
                           operation="pick_device")
    return [Device._on(daemon.client, info) for daemon, info in ranked]  # type: ignore[arg-type]


def pick_device() -> Device:
    """The device a new session should go to (gpurpc addition; what ``gpurpc.autoinit`` and
    ``gpurpc.tools.make_default_context()`` use when no device is named).

    Every daemon of the connection (:func:`init`; a ``dns:///`` name resolved anew) is asked
    for its devices' load at once (``ListDevices``, within the call timeout or 5 s, whichever
    is shorter); daemons that do not answer or are draining (shutting down) are passed
    over. Of the devices left, the one with the most free memory in steps of 256 MiB wins,
    then the one with the fewest sessions (open or opening, every tenant's), then the first
    in order (daemons in the order given, then ordinal). With one daemon its devices are
    ranked the same way; one daemon with one device is returned without asking.

    It only chooses: ``pick_device().make_context()`` opens there. ``make_default_context()``
    and ``gpurpc.autoinit`` also pass on to the next device when the open fails with
    UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED.

    :raises RuntimeError: no daemon answered (the message names each and why), or none that
        answered can take a session (draining, no device).
    """
    return _placement(_client())[0]


def _place(open_on: Callable[[Device], Any], what: str) -> Any:
    """``open_on(device)`` on the best device for a new session (:func:`pick_device`'s
    order), passing on to the next when it fails with UNAVAILABLE, RESOURCE_EXHAUSTED or
    DEADLINE_EXCEEDED; any other error is raised at once. When every device failed, the last
    error is raised (same class and code), naming every device tried and why."""
    candidates = _placement(_client())
    if len(candidates) == 1:
        return open_on(candidates[0])  # the error as it is
    last: Optional[Error] = None
    tried: List[str] = []
    for device in candidates:
        try:
            return open_on(device)
        except Error as e:
            if e.code not in _core.PLACEMENT_RETRY_CODES:
                raise
            last = e
            tried.append(f"{device.daemon_target} device {device.ordinal}: "
                         f"{e.details or e}")
    assert last is not None and last.code is not None
    raise type(last)(f"{what}: no device took the session (tried {'; '.join(tried)}) "
                     f"[{last.code.name}]", code=last.code, details=last.details,
                     operation=last.operation) from last


# =============================================================================================
# Contexts (sessions)

_tls = threading.local()
_last_context: Optional["weakref.ref[Context]"] = None


def _stack() -> List["Context"]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


class _hybridmethod:
    """A method that works on an instance or, called on the class, on the current context."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: Any) -> Callable:
        return functools.partial(self.func, obj)


def _current_context(what: str) -> "Context":
    stack = _stack()
    while stack and stack[-1]._core.closed:
        stack.pop()
    ctx = stack[-1] if stack else (_last_context() if _last_context is not None else None)
    if ctx is None or ctx._core.closed:
        raise LogicError(f"{what} failed: no current context; create one with "
                         "gpurpc.driver.Device(0).make_context() or `import gpurpc.autoinit`")
    return ctx


def _current_core(what: str) -> SessionCore:
    return _current_context(what)._core


def _enum_arg(call: str, what: str, value: Any, enum_type: type) -> int:
    """``value`` as an int of ``enum_type`` (a member or its number); :class:`LogicError`
    naming it otherwise (the daemon checks it again)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LogicError(f"{call}: {what} must be a {enum_type.__name__} or an int, "
                         f"got {type(value).__name__} {value!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    number = int(value)
    if number not in {int(member) for member in enum_type}:  # type: ignore[attr-defined]
        names = ", ".join(f"{m.name} = {int(m)}" for m in enum_type)  # type: ignore[attr-defined]
        raise LogicError(f"{call}: {what} {number} is not a {enum_type.__name__} ({names})",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    return number


def _uint_arg(call: str, what: str, value: Any, bits: int) -> int:
    """``value`` as an unsigned int of ``bits`` bits; :class:`LogicError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LogicError(f"{call}: {what} must be an int, got {type(value).__name__} {value!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    number = int(value)
    if not 0 <= number < (1 << bits):
        raise LogicError(f"{call}: {what} {number} is outside 0..{(1 << bits) - 1}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    return number


def _int_arg(call: str, what: str, value: Any, bits: int) -> int:
    """``value`` as a signed int of ``bits`` bits; :class:`LogicError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LogicError(f"{call}: {what} must be an int, got {type(value).__name__} {value!r}",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    number = int(value)
    if not -(1 << (bits - 1)) <= number < (1 << (bits - 1)):
        raise LogicError(f"{call}: {what} {number} does not fit {bits} signed bits",
                         code=grpc.StatusCode.INVALID_ARGUMENT, operation=call)
    return number


class Context:
    """A session on the daemon (``pycuda.driver.Context``).

    ``push``/``pop`` manage a per-thread stack like PyCUDA's and never close anything;
    ``detach`` closes the session. ``synchronize`` works on an instance or, as
    ``Context.synchronize()``, on the current context.

    gpurpc additions: ``timeout`` (the call timeout of this context's calls, seconds),
    ``state`` and ``fault`` (what the session's watch knows, without a call).
    """

    def __init__(self, core: SessionCore, device: Device) -> None:
        global _last_context
        self._core = core
        self._device = device
        _last_context = weakref.ref(self)

    @property
    def session_id(self) -> int:
        """The daemon's session id."""
        return self._core.session_id

    @property
    def handle(self) -> int:
        return self._core.session_id

    @property
    def timeout(self) -> float:
        """The call timeout of this context's calls in seconds (``math.inf``: none). Settable;
        ``None`` restores the connection's (``init(timeout=)``, ``$GPURPC_TIMEOUT``, 300)."""
        return self._core.timeout

    @timeout.setter
    def timeout(self, value: Optional[float]) -> None:
        self._core.timeout = value

    @property
    def host_regions(self) -> str:
        """``"auto"``, ``"on"`` or ``"off"``: whether this context uses same-host regions
        (pagelocked arrays, staged transfers). Settable (a new value forgets that auto mode
        found them unusable); ``None`` restores the connection's (``init(host_regions=)``,
        ``$GPURPC_HOST_REGIONS``, auto)."""
        return self._core.host_regions

    @host_regions.setter
    def host_regions(self, value: Optional[str]) -> None:
        with self._core.lock:
            self._core.host_regions = (self._core.client.host_regions if value is None
                                       else _core.resolve_host_regions(value))
            _regions.mode_changed(self._core)

    @property
    def state(self) -> str:
        """``"active"``; ``"faulted"`` after a kernel fault or the worker's death (or the
        daemon's kernel watchdog); ``"lost"`` when the session is gone (the daemon restarted,
        or closed or reclaimed it); ``"closed"`` after :meth:`detach`. Known from the
        session's watch, without a call."""
        return self._core.health

    @property
    def fault(self) -> Optional[Error]:
        """The exception calls on this context raise now (:class:`LaunchError` for a faulted
        session, :class:`SessionLost` for a lost one), or None while it is usable."""
        if self._core.closed:
            return LogicError(f"the context (session {self._core.session_id}) was detached")
        return self._core.unusable_error("Context")

    def push(self) -> None:
        """Makes this context current in the calling thread."""
        global _last_context
        self._core.check_attached("Context.push")  # a faulted or lost one raises at its calls
        _stack().append(self)
        _last_context = weakref.ref(self)

    @staticmethod
    def pop() -> None:
        """Removes the current context from the calling thread's stack (it stays open)."""
        stack = _stack()
        if not stack:
            raise LogicError("context::pop failed: cannot pop non-current context")
        stack.pop()

    def detach(self) -> None:
        """Closes the session: its memory, modules, streams and events are freed. Never hangs:
        work still queued is dropped, and the daemon gets at most 5 s to confirm (a daemon
        that is gone or stopped reclaims the session after its grace period)."""
        stack = _stack()
        stack[:] = [c for c in stack if c is not self]
        self._core.close()
        _regions.detach(self._core)

    def attach(self, flags: int = 0) -> "Context":
        """Returns self (PyCUDA compatibility). A gpurpc context is one session and is not
        reference-counted: ``detach`` closes it whatever ``attach`` was called."""
        return self

    @staticmethod
    def get_current() -> Optional["Context"]:
        """The calling thread's current context, or the process's most recent one, or None."""
        try:
            return _current_context("Context.get_current")
        except LogicError:
            return None

    @staticmethod
    def get_device() -> Device:
        """The device of the current context."""
        return _current_context("Context.get_device")._device

    @_hybridmethod
    def synchronize(self: Optional["Context"], *, timeout: Optional[float] = None) -> None:
        """Waits for all work of the context; raises any pending asynchronous error.

        Waits at most ``timeout`` seconds (default: the context's call timeout), then raises
        :class:`CallTimeoutError`; the GPU work is not stopped by that and a later
        synchronising call waits for it."""
        core = (self or _current_context("Context.synchronize"))._core
        with core.lock:
            core.check_open("Context.synchronize")
            limit = _core.resolve_timeout(timeout) if timeout is not None else None
            core.commands.sync(whole_session=True, label="Context.synchronize", timeout=limit)
            core.process_releases()

    def get_api_version(self) -> int:
        """The daemon's CUDA driver version."""
        return get_driver_version()

    @staticmethod
    def set_limit(lim: Union[limit, int], value: int) -> None:
        """``cuCtxSetLimit`` on the current context: ``lim`` is a :class:`limit`, ``value``
        its new value (bytes for the sizes).

        The daemon bounds what a tenant may reserve (the stack, printf FIFO and malloc heap
        are device memory the driver sets aside): at most 64 KiB of stack per thread (and 4
        GiB for all of the device's resident threads), a 64 MiB printf FIFO and a 1 GiB
        malloc heap, and the three together within the tenant's device-memory quota; a
        larger value raises :class:`LogicError` (or :class:`MemoryError` over the quota)
        naming the bound. The value the driver then reports may be rounded up: read it
        with :meth:`get_limit`."""
        core = _current_core("Context.set_limit")
        request = _mod.SetContextLimitRequest(
            limit=_enum_arg("Context.set_limit", "limit", lim, limit),
            value=_uint_arg("Context.set_limit", "value", value, 64))
        core.call("ModuleService.SetContextLimit", request, op="Context.set_limit")

    @staticmethod
    def get_limit(lim: Union[limit, int]) -> int:
        """``cuCtxGetLimit`` on the current context."""
        core = _current_core("Context.get_limit")
        request = _mod.GetContextLimitRequest(
            limit=_enum_arg("Context.get_limit", "limit", lim, limit))
        return int(core.call("ModuleService.GetContextLimit", request,
                             op="Context.get_limit").value)

    @staticmethod
    def set_cache_config(cc: Union[func_cache, int]) -> None:
        """``cuCtxSetCacheConfig`` on the current context (a preference)."""
        core = _current_core("Context.set_cache_config")
        request = _mod.SetCacheConfigRequest(
            config=_enum_arg("Context.set_cache_config", "cache config", cc, func_cache))
        core.call("ModuleService.SetCacheConfig", request, op="Context.set_cache_config")

    @staticmethod
    def get_cache_config() -> func_cache:
        """``cuCtxGetCacheConfig`` of the current context."""
        core = _current_core("Context.get_cache_config")
        reply = core.call("ModuleService.GetCacheConfig", _mod.GetCacheConfigRequest(),
                          op="Context.get_cache_config")
        return func_cache(reply.config)

    @staticmethod
    def set_shared_config(sc: Union[shared_config, int]) -> None:
        """``cuCtxSetSharedMemConfig`` (deprecated by CUDA). Checked by the daemon, then, as
        the driver does on every device CUDA 13 supports (fixed 4-byte banks), ignored."""
        core = _current_core("Context.set_shared_config")
        request = _mod.SetSharedConfigRequest(
            config=_enum_arg("Context.set_shared_config", "shared config", sc, shared_config))
        core.call("ModuleService.SetSharedConfig", request, op="Context.set_shared_config")

    @staticmethod
    def get_shared_config() -> shared_config:
        """``cuCtxGetSharedMemConfig``: ``FOUR_BYTE_BANK_SIZE``, the fixed bank width of every
        device CUDA 13 supports."""
        core = _current_core("Context.get_shared_config")
        reply = core.call("ModuleService.GetSharedConfig", _mod.GetSharedConfigRequest(),
                          op="Context.get_shared_config")
        return shared_config(reply.config)

    def __repr__(self) -> str:
        state = self._core.health
        return (f"<gpurpc.driver.Context session {self._core.session_id} ({state}) "
                f"on {self._device!r}>")


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


def _stream_id(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    raise TypeError(f"stream must be a gpurpc.driver.Stream or None, got {type(stream).__name__}")


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


def _upload_stream(core: SessionCore, address: int, data: memoryview, stream_id: int,
                   label: str) -> None:
    n = data.nbytes
    chunk = _core.UPLOAD_CHUNK_BYTES
    progress = _progress.bar(n, label)
    core.check_open(label)
    sent = 0
    deadline = _core.ProgressDeadline(core.timeout)

    def requests() -> Iterator[_mem.UploadStreamRequest]:
        nonlocal sent
        yield _mem.UploadStreamRequest(destination=device_pointer(address), total_size_bytes=n,
                                       stream_id=stream_id, data=data[:chunk].tobytes())
        sent = min(chunk, n)
        deadline.progress()
        progress.update(sent)
        for offset in range(chunk, n, chunk):
            piece = data[offset:offset + chunk].tobytes()
            yield _mem.UploadStreamRequest(data=piece)
            sent += len(piece)
            deadline.progress()
            progress.update(len(piece))

    _core.debug.count("MemoryService.UploadStream")
    try:
        with deadline:
            # No deadline on the call as a whole: each step has one (ProgressDeadline).
            future = core.client.method("MemoryService.UploadStream").future(
                requests(), metadata=core.metadata + core.client.auth_metadata)
            deadline.attach(future)
            try:
                future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                if deadline.fired:
                    raise timeout_error(label, core.timeout, f"no progress after {sent} of {n} "
                                        "bytes, so the transfer was cancelled") from None
                if not isinstance(e, grpc.RpcError):
                    raise
                err = _core.session_error(e.code(), e.details() or "", label,
                                          core.client.target, core.session_id)
                if err.code is not None:
                    core.note_status(err.code, err.details)
                raise err from None
    finally:
        progress.close()


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
    core.check_open(label)
    request = _mem.DownloadRequest(source=device_pointer(address), size_bytes=n,
                                   stream_id=stream_id,
                                   chunk_size_bytes=_core.DOWNLOAD_CHUNK_BYTES)
    _core.debug.count("MemoryService.DownloadStream")
    progress = _progress.bar(n, label)
    offset = 0
    deadline = _core.ProgressDeadline(core.timeout)
    try:
        with deadline:
            # No deadline on the call as a whole: each step has one (ProgressDeadline).
            replies = core.client.method("MemoryService.DownloadStream")(
                request, metadata=core.metadata + core.client.auth_metadata)
            deadline.attach(replies)
            for reply in replies:
                deadline.progress()
                piece = reply.data
                if offset + len(piece) > n:
                    replies.cancel()
                    raise Error(f"{label}: the daemon sent more than the {n} bytes asked for")
                dest[offset:offset + len(piece)] = piece
                offset += len(piece)
                progress.update(len(piece))
    except grpc.RpcError as e:
        if deadline.fired:
            raise timeout_error(label, core.timeout, f"no progress after {offset} of {n} bytes, "
                                "so the transfer was cancelled") from None
        err = _core.session_error(e.code(), e.details() or "", label, core.client.target,
                                  core.session_id)
        if err.code is not None:
            core.note_status(err.code, err.details)
        raise err from None
    finally:
        progress.close()
    if offset != n:
        raise Error(f"{label}: the daemon sent {offset} of {n} bytes")


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


# =============================================================================================
# Streams and events

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

    def end_capture(self) -> "Graph":
        """Ends the capture (``cuStreamEndCapture``) and returns the :class:`Graph` of what it
        recorded (after sending the work queued before)."""
        core = self._core
        with core.lock:
            core.check_open("Stream.end_capture")
            core.drain()
            reply = core.call("ExecutionService.EndCapture",
                              _ex.EndCaptureRequest(stream_id=self.handle),
                              op="Stream.end_capture")
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
    """An event (``pycuda.driver.Event``); times are measured by the server's GPU."""

    def __init__(self, flags: int = 0, *, _core: Optional[SessionCore] = None) -> None:
        core = _core or _current_core("Event")
        flags = int(flags)
        reply = core.call("ExecutionService.CreateEvent", _ex.CreateEventRequest(
            disable_timing=bool(flags & event_flags.DISABLE_TIMING),
            blocking_sync=bool(flags & event_flags.BLOCKING_SYNC)), op="Event")
        self._core = core
        self.handle: int = reply.event_id
        finalizer = weakref.finalize(self, core.defer_release, "event", self.handle)
        finalizer.atexit = False

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
        limit = _core.resolve_timeout(timeout) if timeout is not None else core.timeout
        with core.lock:
            started = time.monotonic()
            core.drain(limit)
            left = max(limit - (time.monotonic() - started), 0.001)
            try:
                reply = core.call("ExecutionService.SynchronizeEvent",
                                  _ex.SynchronizeEventRequest(event_id=self.handle),
                                  op="Event.synchronize", timeout=left)
            except CallTimeoutError:
                raise timeout_error("Event.synchronize", limit) from None
            _core.print_device_output(reply.device_output)
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


# =============================================================================================
# CUDA graphs

_NODE_TYPES = {_ex.GRAPH_NODE_TYPE_KERNEL: "kernel", _ex.GRAPH_NODE_TYPE_MEMSET: "memset",
               _ex.GRAPH_NODE_TYPE_MEMCPY: "memcpy"}


class GraphNode:
    """A node of a :class:`Graph` (``Graph.get_nodes()``), in capture order. Pass one (or its
    index) as ``kernel_node=`` of :meth:`GraphExec.kernel_node_set_params`.

    ``type`` is ``"kernel"``, ``"memset"`` or ``"memcpy"``; kernel nodes also have
    ``function_name``, ``function_id``, ``param_layout`` (``[(offset, size), ...]``), ``grid``,
    ``block`` and ``shared`` as captured.
    """

    def __init__(self, node: Any) -> None:
        self.index: int = node.index
        self.type: str = _NODE_TYPES.get(node.type, "unspecified")
        self.function_id: int = node.function_id
        self.function_name: str = node.kernel_name
        self.param_layout: List[Tuple[int, int]] = [(p.offset_bytes, p.size_bytes)
                                                    for p in node.params]
        self.grid: Tuple[int, int, int] = (node.grid.x, node.grid.y, node.grid.z)
        self.block: Tuple[int, int, int] = (node.block.x, node.block.y, node.block.z)
        self.shared: int = node.shared_memory_bytes

    def __index__(self) -> int:
        return self.index

    __int__ = __index__

    def __repr__(self) -> str:
        if self.type == "kernel":
            return f"<gpurpc.driver.GraphNode {self.index}: kernel {self.function_name}>"
        return f"<gpurpc.driver.GraphNode {self.index}: {self.type}>"


def _keeps(dims: Any) -> bool:
    """True for the "keep the node's" value of a dimension: None or an empty sequence."""
    return dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0)


def _graph_call(core: SessionCore, name: str, request: Any, op: str) -> Any:
    """A graph RPC after the queued commands. Capture misuse and refused updates
    (FAILED_PRECONDITION of a live session) raise :class:`LogicError`, as PyCUDA raises them."""
    with core.lock:
        core.check_open(op)
        core.drain()
        return core.call(name, request, op=op)


class Graph:
    """A captured graph (``Stream.end_capture()``); ``handle`` is its id. Freed when garbage
    collected (graph execs made from it stay usable)."""

    def __init__(self, core: SessionCore, graph_id: int, node_count: int) -> None:
        self._core = core
        self.handle: int = graph_id
        self.node_count: int = node_count
        finalizer = weakref.finalize(self, core.defer_release, "graph", graph_id)
        finalizer.atexit = False

    def instantiate(self) -> "GraphExec":
        """An executable graph of it (``cuGraphInstantiate``)."""
        reply = _graph_call(self._core, "ExecutionService.InstantiateGraph",
                            _ex.InstantiateGraphRequest(graph_id=self.handle),
                            "Graph.instantiate")
        return GraphExec(self._core, reply.graph_exec_id, self)

    def get_nodes(self) -> List[GraphNode]:
        """Its nodes, in capture order."""
        reply = _graph_call(self._core, "ExecutionService.GetGraphNodes",
                            _ex.GetGraphNodesRequest(graph_id=self.handle), "Graph.get_nodes")
        return [GraphNode(node) for node in reply.nodes]

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Graph {self.handle} ({self.node_count} nodes)>"


class GraphExec:
    """An executable graph (``Graph.instantiate()``); ``handle`` is its id. Freed when garbage
    collected (launches already queued still run)."""

    def __init__(self, core: SessionCore, exec_id: int, graph: Graph) -> None:
        self._core = core
        self.handle: int = exec_id
        # Kernel nodes' names and layouts, for kernel_node_set_params without func=.
        self._layouts: Optional[Dict[int, Tuple[str, List[Tuple[int, int]]]]] = None
        self._graph: Optional[Graph] = graph
        finalizer = weakref.finalize(self, core.defer_release, "graph_exec", exec_id)
        finalizer.atexit = False

    def launch(self, stream: Optional[Stream] = None) -> None:
        """Runs the graph's nodes in order on ``stream`` (default stream if None): one command
        of the command stream, asynchronous like a kernel launch."""
        core = self._core
        with core.lock:
            core.check_open("GraphExec.launch")
            core.commands.add("GraphExec.launch", launch_graph=_ex.LaunchGraphCommand(
                graph_exec_id=self.handle, stream_id=_stream_id(stream)))

    def update(self, graph: Graph) -> None:
        """Takes the parameters of ``graph`` (``cuGraphExecUpdate``): same nodes (count and
        types, in order), possibly other kernels, arguments and addresses."""
        _graph_call(self._core, "ExecutionService.UpdateGraphExec",
                    _ex.UpdateGraphExecRequest(graph_exec_id=self.handle, graph_id=graph.handle),
                    "GraphExec.update")
        self._graph = graph
        self._layouts = None

    def _node_layout(self, index: int) -> Tuple[str, List[Tuple[int, int]]]:
        if self._layouts is None:
            if self._graph is None:
                raise LogicError("GraphExec.kernel_node_set_params: the node's kernel is unknown "
                                 "here; pass func=")
            self._layouts = {node.index: (node.function_name, node.param_layout)
                             for node in self._graph.get_nodes() if node.type == "kernel"}
        layout = self._layouts.get(index)
        if layout is None:
            # The daemon names what is wrong (no such node, not a kernel node).
            return f"node {index}", []
        return layout

    def kernel_node_set_params(self, *args: Any, kernel_node: Any,
                               func: Optional["Function"] = None, block: Any = (),
                               grid: Any = (), shared: Optional[int] = None) -> None:
        """Sets the arguments (and optionally the kernel, dimensions and dynamic shared memory)
        of one kernel node for later launches (``cuGraphExecKernelNodeSetParams``).

        ``args`` follow a kernel call's rules (numpy scalars, device allocations; not
        ``In``/``Out``/``InOut``). ``kernel_node`` is a :class:`GraphNode` or its index;
        ``func`` another kernel (default: the node's); an empty ``block``/``grid`` or
        ``shared=None`` keeps the node's. Checked by the daemon exactly like a launch.
        """
        index = int(kernel_node)
        label = "GraphExec.kernel_node_set_params"
        if func is not None:
            name, params = func.name, func.param_layout
        else:
            name, params = self._node_layout(index)
        parts = []
        for i, arg in enumerate(args):
            packed = _pack_arg(i, arg)
            if packed is None:
                raise LogicError(f"{label}: parameter #{i} is {type(arg).__name__}; In/Out/InOut "
                                 "arguments cannot be set on a graph node, pass device memory",
                                 code=grpc.StatusCode.INVALID_ARGUMENT, operation=label)
            parts.append(packed)
        request = _ex.SetGraphExecKernelNodeArgsRequest(graph_exec_id=self.handle,
                                                        node_index=index)
        if params or not parts:
            if len(parts) != len(params):
                raise LogicError(f"{label}: {name} takes {len(params)} parameters, "
                                 f"{len(parts)} given", code=grpc.StatusCode.INVALID_ARGUMENT,
                                 operation=label)
            blob = bytearray(max((o + n for o, n in params), default=0))
            for i, (part, (offset, size)) in enumerate(zip(parts, params)):
                if len(part) != size:
                    raise LogicError(f"{label}: {name}: parameter #{i} (0-based) takes {size} "
                                     f"bytes in the kernel, but the argument is "
                                     f"{_describe(args[i])} of {len(part)} bytes",
                                     code=grpc.StatusCode.INVALID_ARGUMENT, operation=label)
                blob[offset:offset + size] = part
            request.packed_args = bytes(blob)
        else:
            request.packed_args = b"".join(parts)  # the daemon says what is wrong
        if func is not None:
            request.function_id = func.handle
        if not _keeps(block):
            request.block.CopyFrom(_core.dim3(block, "block"))
        if not _keeps(grid):
            request.grid.CopyFrom(_core.dim3(grid, "grid"))
        if shared is not None:
            request.shared_memory_bytes = int(shared)
        _graph_call(self._core, "ExecutionService.SetGraphExecKernelNodeArgs", request, label)
        if func is not None and self._layouts is not None:
            self._layouts[index] = (func.name, func.param_layout)

    def __repr__(self) -> str:
        return f"<gpurpc.driver.GraphExec {self.handle}>"


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


# =============================================================================================
# Modules and functions

class Module:
    """A loaded module (``pycuda.driver.Module``)."""

    def __init__(self, core: SessionCore, module_id: int) -> None:
        self._core = core
        self.handle = module_id
        self._functions: Dict[str, "Function"] = {}
        finalizer = weakref.finalize(self, core.defer_release, "module", module_id)
        finalizer.atexit = False

    def get_function(self, name: str) -> "Function":
        """The kernel called ``name`` (``cuModuleGetFunction``).

        :raises LogicError: no such kernel (message names it).
        """
        fn = self._functions.get(name)
        if fn is None:
            reply = self._core.call("ModuleService.GetFunction",
                                    _mod.GetFunctionRequest(module_id=self.handle, name=name),
                                    op=f"get_function({name!r})")
            fn = self._functions[name] = Function(self, name, reply)
        return fn

    def get_global(self, name: str) -> Tuple[int, int]:
        """``(device_address, size_bytes)`` of a ``__device__``/``__constant__`` variable."""
        reply = self._core.call("ModuleService.GetGlobal",
                                _mod.GetGlobalRequest(module_id=self.handle, name=name),
                                op=f"get_global({name!r})")
        return int(reply.device_address), int(reply.size_bytes)

    def get_texref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        raise LogicError("texture references are not available (removed in CUDA 12)")

    def get_surfref(self, name: str) -> Any:
        """Not available: raises LogicError."""
        raise LogicError("surface references are not available (removed in CUDA 12)")


def module_from_buffer(buffer: Any, options: Optional[Sequence] = None,
                       message_handler: Optional[Callable[[bool, str, str], None]] = None,
                       ) -> Module:
    """Loads PTX, cubin or fatbin bytes (``cuModuleLoadDataEx``).

    JIT ``options`` are accepted and ignored. ``message_handler(success, info_log, error_log)``
    is called like PyCUDA's.
    """
    core = _current_core("module_from_buffer")
    image = buffer.encode() if isinstance(buffer, str) else bytes(buffer)
    try:
        reply = core.call("ModuleService.LoadModule", _mod.LoadModuleRequest(image=image),
                          op="cuModuleLoadDataEx")
    except Error as e:
        if message_handler is not None:
            message_handler(False, "", e.details)
        raise
    if message_handler is not None:
        message_handler(True, "", "")
    return Module(core, reply.module_id)


def module_from_file(filename: str) -> Module:
    """Reads a PTX/cubin/fatbin file here and loads it on the daemon."""
    with open(filename, "rb") as f:
        return module_from_buffer(f.read())


class ArgumentHandler:
    """Base of :class:`In`, :class:`Out`, :class:`InOut`: a host array that a launch copies
    to a temporary device buffer and/or back, all in the launch's one round trip."""

    copies_in = False
    copies_out = False

    def __init__(self, array: Any) -> None:
        self.array = array
        if self.copies_out:
            self._view = _writable(array, type(self).__name__)
        else:
            self._view = _readable(array)
        self._device_address: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def get_device_alloc(self) -> int:
        """The temporary device address (valid only during the launch)."""
        if self._device_address is None:
            raise LogicError("the temporary device buffer exists only during the launch")
        return self._device_address


class In(ArgumentHandler):
    """Copy this host array to the device before the launch."""

    copies_in = True


class Out(ArgumentHandler):
    """Copy the device buffer back into this host array after the launch."""

    copies_out = True


class InOut(In, Out):
    """Copy in before and back out after the launch."""

    copies_in = True
    copies_out = True


_PTR = struct.Struct("<Q")
_SCRATCH_KEEP_BYTES = 64 << 20


def _describe(arg: Any) -> str:
    if isinstance(arg, np.void):
        return f"a struct of {arg.dtype.itemsize} bytes"
    if isinstance(arg, np.generic):
        return f"numpy.{arg.dtype.name}"
    if isinstance(arg, np.ndarray):
        return f"an ndarray passed by value ({arg.nbytes} bytes)"
    if isinstance(arg, ArgumentHandler):
        return f"{type(arg).__name__} (a device pointer)"
    return f"{type(arg).__name__} (a device pointer)"


def _pack_arg(index: int, arg: Any, core: Optional[SessionCore] = None,
              kernel: str = "kernel") -> Optional[bytes]:
    """PyCUDA's argument rules; None for In/Out/InOut (filled in later). With ``core``,
    device memory of another session is refused."""
    if isinstance(arg, DeviceAllocation):
        if core is not None and arg._core is not core:
            _session_pointer(core, index, arg, kernel)  # raises: another session's memory
        return _PTR.pack(arg._ptr)
    if isinstance(arg, np.generic):
        return arg.tobytes()
    if isinstance(arg, ArgumentHandler):
        return None
    if isinstance(arg, np.ndarray):
        return arg.tobytes()
    if isinstance(arg, (bool, int, float, complex)):
        raise TypeError(f"invalid type on parameter #{index} (0-based): a plain Python "
                        f"{type(arg).__name__} has no definite size; pass a numpy scalar such "
                        "as numpy.int32(x), numpy.uint64(x) or numpy.float32(x)")
    if core is not None and (hasattr(arg, "gpudata") or hasattr(arg, "_alloc") or
                             hasattr(arg, "__cuda_array_interface__")):
        return _PTR.pack(_session_pointer(core, index, arg, kernel))
    if hasattr(arg, "gpudata"):
        gpudata = arg.gpudata
        return _PTR.pack(0 if gpudata is None else _address(gpudata))
    get_pointer = getattr(arg, "get_pointer", None)
    if callable(get_pointer):
        return _PTR.pack(int(get_pointer()))
    if hasattr(arg, "__index__"):  # pool blocks and other pointer-like objects
        return _PTR.pack(arg.__index__())
    raise TypeError(f"invalid type on parameter #{index} (0-based): {type(arg).__name__}")


# struct format character -> (code in '<' mode, size, kind)
_FORMAT_ITEMS = {
    "c": ("c", 1, "num"), "b": ("b", 1, "num"), "B": ("B", 1, "num"), "?": ("?", 1, "num"),
    "h": ("h", 2, "num"), "H": ("H", 2, "num"), "i": ("i", 4, "num"), "I": ("I", 4, "num"),
    "l": ("q", 8, "num"), "L": ("Q", 8, "num"), "q": ("q", 8, "num"), "Q": ("Q", 8, "num"),
    "n": ("q", 8, "num"), "N": ("Q", 8, "num"), "e": ("e", 2, "num"), "f": ("f", 4, "num"),
    "d": ("d", 8, "num"), "P": ("Q", 8, "ptr"), "F": ("8s", 8, "complex64"),
    "D": ("16s", 16, "complex128"),
}
_FORMAT_RE = re.compile(r"\s*(\d*)([a-zA-Z?])")


def _type_char(arg_type: Any) -> str:
    if isinstance(arg_type, str):
        return arg_type
    try:
        dtype = np.dtype(arg_type)
    except TypeError:
        return "P"
    if dtype.kind == "V":
        return f"{dtype.itemsize}s"
    if dtype.kind == "O":
        return "P"
    return dtype.char


def _parse_format(fmt: str) -> List[Tuple[str, int, str]]:
    items: List[Tuple[str, int, str]] = []
    fmt = fmt.lstrip("@=")
    pos = 0
    while pos < len(fmt):
        if fmt[pos].isspace():
            pos += 1
            continue
        m = _FORMAT_RE.match(fmt, pos)
        if m is None:
            raise ValueError(f"bad argument format {fmt!r} at {fmt[pos:]!r}")
        pos = m.end()
        count = int(m.group(1)) if m.group(1) else 1
        char = m.group(2)
        if char == "s":
            items.append((f"{count}s", count, "bytes"))
        elif char == "x":
            continue
        elif char in _FORMAT_ITEMS:
            items.extend([_FORMAT_ITEMS[char]] * count)
        else:
            raise ValueError(f"bad argument format character {char!r} in {fmt!r}")
    return items


class Function:
    """A kernel (``pycuda.driver.Function``).

    Call it PyCUDA's way: ``func(*args, block=(x, y, z), grid=(x, y), stream=None, shared=0,
    time_kernel=False)``, or ``prepare`` it and use the ``prepared_*`` calls.
    """

    def __init__(self, module: Module, name: str, reply: _mod.GetFunctionResponse) -> None:
        self.module = module
        self._core = module._core
        self.name = name
        self.handle = reply.function_id
        self._params = [(p.offset_bytes, p.size_bytes) for p in reply.params]
        end = 0
        dense = True
        for offset, size in self._params:
            dense = dense and offset == end
            end = max(end, offset + size)
        self._args_size = end
        self._dense = dense
        self._sizes = [size for _, size in self._params]
        self._attributes = reply.attributes
        self._label = f"launch of {name}"
        self._prefixes: Dict[Any, bytes] = {}
        self._prepared: Optional[struct.Struct] = None
        self._prepared_items: List[Tuple[str, int, str]] = []
        self._args_tag = b""

    # -- attributes ---------------------------------------------------------------------

    def get_attribute(self, attr: Union[function_attribute, int]) -> int:
        """``cuFuncGetAttribute`` (from the values reported when the function was looked up,
        or by :meth:`set_attribute` since)."""
        a = self._attributes
        table: Dict[int, int] = {
            function_attribute.MAX_THREADS_PER_BLOCK: a.max_threads_per_block,
            function_attribute.SHARED_SIZE_BYTES: a.shared_size_bytes,
            function_attribute.CONST_SIZE_BYTES: a.const_size_bytes,
            function_attribute.LOCAL_SIZE_BYTES: a.local_size_bytes,
            function_attribute.NUM_REGS: a.num_regs,
            function_attribute.PTX_VERSION: a.ptx_version,
            function_attribute.BINARY_VERSION: a.binary_version,
            function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES: a.max_dynamic_shared_size_bytes,
            function_attribute.PREFERRED_SHARED_MEMORY_CARVEOUT:
                a.preferred_shared_memory_carveout,
        }
        key = int(attr)
        if key not in table:
            raise LogicError(f"cuFuncGetAttribute failed: {attr!r} is not reported by the daemon")
        return int(table[key])

    num_regs = property(lambda self: self.get_attribute(function_attribute.NUM_REGS))
    shared_size_bytes = property(
        lambda self: self.get_attribute(function_attribute.SHARED_SIZE_BYTES))
    const_size_bytes = property(
        lambda self: self.get_attribute(function_attribute.CONST_SIZE_BYTES))
    local_size_bytes = property(
        lambda self: self.get_attribute(function_attribute.LOCAL_SIZE_BYTES))
    max_threads_per_block = property(
        lambda self: self.get_attribute(function_attribute.MAX_THREADS_PER_BLOCK))
    ptx_version = property(lambda self: self.get_attribute(function_attribute.PTX_VERSION))
    binary_version = property(lambda self: self.get_attribute(function_attribute.BINARY_VERSION))
    max_dynamic_shared_size_bytes = property(
        lambda self: self.get_attribute(function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES))

    @property
    def param_layout(self) -> List[Tuple[int, int]]:
        """``[(offset_bytes, size_bytes), ...]`` of the kernel's parameters."""
        return list(self._params)

    def set_attribute(self, attr: Union[function_attribute, int], value: int) -> None:
        """``cuFuncSetAttribute``: ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` (0 to the device's
        opt-in maximum minus the kernel's static shared memory) or
        ``PREFERRED_SHARED_MEMORY_CARVEOUT`` (-1, or 0 to 100 percent); the other attributes
        are read-only (:class:`LogicError`). :meth:`get_attribute` reports the new value."""
        request = _mod.SetFunctionAttributeRequest(
            function_id=self.handle,
            attribute=_enum_arg("Function.set_attribute", "attribute", attr, function_attribute),
            value=_int_arg("Function.set_attribute", "value", value, 64))
        reply = self._core.call("ModuleService.SetFunctionAttribute", request,
                                op="Function.set_attribute")
        self._attributes = reply.attributes

    def set_cache_config(self, fc: Union[func_cache, int]) -> None:
        """``cuFuncSetCacheConfig`` (a preference)."""
        request = _mod.SetFunctionCacheConfigRequest(
            function_id=self.handle,
            config=_enum_arg("Function.set_cache_config", "cache config", fc, func_cache))
        self._core.call("ModuleService.SetFunctionCacheConfig", request,
                        op="Function.set_cache_config")

    def set_shared_config(self, sc: Union[shared_config, int]) -> None:
        """``cuFuncSetSharedMemConfig`` (deprecated by CUDA): checked by the daemon, then
        ignored, as the driver does on every device CUDA 13 supports (fixed 4-byte banks)."""
        request = _mod.SetSharedConfigRequest(
            function_id=self.handle,
            config=_enum_arg("Function.set_shared_config", "shared config", sc, shared_config))
        self._core.call("ModuleService.SetSharedConfig", request,
                        op="Function.set_shared_config")

    # -- argument layout ----------------------------------------------------------------

    def _size_error(self, index: int, expected: int, got: int, desc: str) -> LogicError:
        return LogicError(
            f"{self.name}: parameter #{index} (0-based) takes {expected} bytes in the kernel, "
            f"but the argument is {desc} of {got} bytes", code=grpc.StatusCode.INVALID_ARGUMENT,
            operation=self._label)

    def _count_error(self, given: int) -> LogicError:
        return LogicError(
            f"{self.name}: the kernel takes {len(self._params)} parameters, {given} given",
            code=grpc.StatusCode.INVALID_ARGUMENT, operation=self._label)

    def _layout(self, parts: List[bytes], args: Sequence[Any]) -> bytes:
        params = self._params
        if len(parts) != len(params):
            raise self._count_error(len(parts))
        if [len(p) for p in parts] != self._sizes:
            for i, (part, (_, size)) in enumerate(zip(parts, params)):
                if len(part) != size:
                    raise self._size_error(i, size, len(part), _describe(args[i]))
        if self._dense:
            return b"".join(parts)
        blob = bytearray(self._args_size)
        for part, (offset, size) in zip(parts, params):
            blob[offset:offset + size] = part
        return bytes(blob)

    def _prefix(self, grid: Any, block: Any, shared: int, stream_id: int) -> bytes:
        try:
            key = (grid, block, shared, stream_id)
            prefix = self._prefixes.get(key)
        except TypeError:  # lists
            key = (tuple(grid), tuple(block), shared, stream_id)
            prefix = self._prefixes.get(key)
        if prefix is None:
            self._check_dims(grid, block)
            prefix = _core.launch_prefix(self.handle, grid, block, shared, stream_id)
            if len(self._prefixes) > 256:
                self._prefixes.clear()
            self._prefixes[key] = prefix
        return prefix

    def _check_dims(self, grid: Any, block: Any) -> None:
        g = _core.dim3(grid, "grid")
        b = _core.dim3(block, "block")
        info = self._core.device_info
        limits = [("block", b.x, info.max_block_dim.x, "x"),
                  ("block", b.y, info.max_block_dim.y, "y"),
                  ("block", b.z, info.max_block_dim.z, "z"),
                  ("grid", g.x, info.max_grid_dim.x, "x"),
                  ("grid", g.y, info.max_grid_dim.y, "y"),
                  ("grid", g.z, info.max_grid_dim.z, "z")]
        for what, value, maximum, axis in limits:
            if maximum and value > maximum:
                raise LogicError(f"{self.name}: {what} {axis} = {value} exceeds the device limit "
                                 f"{maximum}", code=grpc.StatusCode.INVALID_ARGUMENT)
        threads = b.x * b.y * b.z
        maximum = self._attributes.max_threads_per_block or info.max_threads_per_block
        if maximum and threads > maximum:
            raise LogicError(f"{self.name}: a block of {threads} threads exceeds the limit "
                             f"{maximum} of this kernel on this device",
                             code=grpc.StatusCode.INVALID_ARGUMENT)

    def _body(self, grid: Any, block: Any, shared: int, stream_id: int, blob: bytes) -> bytes:
        prefix = self._prefix(grid, block, shared, stream_id)
        if not blob:
            return prefix
        return prefix + _core.TAG_PACKED_ARGS + _core.varint(len(blob)) + blob

    # -- launching ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Optional[float]:
        """Launches the kernel. Returns the kernel's time in seconds if ``time_kernel``."""
        grid = kwargs.pop("grid", (1, 1))
        stream = kwargs.pop("stream", None)
        block = kwargs.pop("block", None)
        shared = kwargs.pop("shared", 0)
        texrefs = kwargs.pop("texrefs", None)
        time_kernel = kwargs.pop("time_kernel", False)
        if kwargs:
            raise ValueError("extra keyword arguments: %s" % ",".join(kwargs))
        if block is None:
            raise ValueError("must specify block size")
        if texrefs:
            raise LogicError("texture references are not available (removed in CUDA 12)")
        parts: List[Any] = []
        handlers: List[Tuple[int, ArgumentHandler]] = []
        for i, arg in enumerate(args):
            # Inline fast paths for the common argument kinds.
            if isinstance(arg, np.generic):
                parts.append(arg.tobytes())
                continue
            if isinstance(arg, DeviceAllocation) and arg._core is self._core:
                parts.append(_PTR.pack(arg._ptr))
                continue
            packed = _pack_arg(i, arg, self._core, self.name)
            if packed is None:
                handlers.append((i, arg))
                packed = b"\0" * 8
            parts.append(packed)
        stream_id = 0 if stream is None else _stream_id(stream)
        if handlers:
            return self._launch_with_handlers(grid, block, int(shared), stream_id, parts, args,
                                              handlers, time_kernel)
        blob = self._layout(parts, args)
        return self._launch(grid, block, int(shared), stream_id, blob, time_kernel)

    def _launch(self, grid: Any, block: Any, shared: int, stream_id: int, blob: bytes,
                time_kernel: bool) -> Optional[float]:
        core = self._core
        with core.lock:
            core.check_open(self._label)
            body = self._body(grid, block, shared, stream_id, blob)
            if not time_kernel:
                core.commands.add_launch(body, self._label)
                return None
            start, end = _timing_events(core)
            commands = core.commands
            commands.add("time_kernel", auto=False, record_event=_ex.RecordEventCommand(
                event_id=start.handle, stream_id=stream_id))
            commands.add_launch(body, self._label, auto=False)
            commands.add("time_kernel", auto=False, record_event=_ex.RecordEventCommand(
                event_id=end.handle, stream_id=stream_id))
            commands.sync(stream_id, label=self._label)
            return end.time_since(start) / 1000.0

    def _launch_with_handlers(self, grid: Any, block: Any, shared: int, stream_id: int,
                              parts: List[bytes], args: Sequence[Any],
                              handlers: List[Tuple[int, ArgumentHandler]],
                              time_kernel: bool) -> Optional[float]:
        core = self._core
        with core.lock:
            core.check_open(self._label)
            offsets = []
            total = 0
            for _, h in handlers:
                offsets.append(total)
                total += (h.nbytes + 255) & ~255
            base, release = _scratch(core, total)
            try:
                for (i, h), offset in zip(handlers, offsets):
                    h._device_address = base + offset
                    parts[i] = _PTR.pack(base + offset)
                blob = self._layout(parts, args)
                body = self._body(grid, block, shared, stream_id, blob)
                commands = core.commands
                chunk = _core.UPLOAD_CHUNK_BYTES
                copies = _regions.LaunchCopies(
                    core, [(h._view, h.copies_in, h.copies_out) for _, h in handlers],
                    stream_id, self._label)
                for k, ((_, h), offset) in enumerate(zip(handlers, offsets)):
                    if not h.copies_in or copies.copy_in(k, h._view, base + offset):
                        continue
                    view = h._view
                    for o in range(0, view.nbytes, chunk):
                        piece = view[o:o + chunk].tobytes()
                        commands.add(self._label, auto=False, payload_bytes=len(piece),
                                     upload=_ex.UploadCommand(
                                         destination=device_pointer(base + offset + o),
                                         data=piece, stream_id=stream_id))
                if time_kernel:
                    start, end = _timing_events(core)
                    commands.add("time_kernel", auto=False, record_event=_ex.RecordEventCommand(
                        event_id=start.handle, stream_id=stream_id))
                commands.add_launch(body, self._label, auto=False)
                if time_kernel:
                    commands.add("time_kernel", auto=False, record_event=_ex.RecordEventCommand(
                        event_id=end.handle, stream_id=stream_id))
                for k, ((_, h), offset) in enumerate(zip(handlers, offsets)):
                    if not h.copies_out or copies.copy_out(k, h._view, base + offset):
                        continue
                    view = h._view
                    n = view.nbytes
                    for o in range(0, n, _DOWNLOAD_COMMAND_BYTES):
                        size = min(_DOWNLOAD_COMMAND_BYTES, n - o)
                        commands.add(self._label, auto=False,
                                     sink=functools.partial(_write_into, view, o, size),
                                     download_bytes=size,
                                     download=_ex.DownloadCommand(
                                         source=device_pointer(base + offset + o),
                                         size_bytes=size, stream_id=stream_id))
                try:
                    commands.sync(stream_id, label=self._label)
                finally:
                    copies.sent()
                copies.deliver([h._view for _, h in handlers])
            finally:
                for _, h in handlers:
                    h._device_address = None
                release()
            if time_kernel:
                return end.time_since(start) / 1000.0
            return None

    # -- prepared calls -----------------------------------------------------------------

    def prepare(self, arg_types: Any, block: Any = None, shared: Any = None,
                texrefs: Any = None) -> "Function":
        """Fixes the argument types: a struct format (``"PPfi"``) or a list of numpy types
        (a void dtype is a by-value struct; anything numpy cannot type is a pointer).

        :raises LogicError: the types disagree with the kernel's parameters (count or sizes).
        """
        if texrefs:
            raise LogicError("texture references are not available (removed in CUDA 12)")
        fmt = arg_types if isinstance(arg_types, str) else "".join(
            _type_char(t) for t in arg_types)
        items = _parse_format(fmt)
        params = self._params
        if len(items) != len(params):
            raise LogicError(f"{self.name}: prepared with {len(items)} argument types "
                             f"({fmt!r}), but the kernel takes {len(params)} parameters",
                             code=grpc.StatusCode.INVALID_ARGUMENT)
        codes = ["<"]
        cursor = 0
        for i, ((code, size, kind), (offset, psize)) in enumerate(zip(items, params)):
            if size != psize:
                raise self._size_error(i, psize, size, f"format {code!r}")
            if offset > cursor:
                codes.append(f"{offset - cursor}x")
            codes.append(code)
            cursor = offset + size
        self._prepared = struct.Struct("".join(codes))
        self._prepared_items = items
        self.arg_format = fmt
        args_len = self._prepared.size
        self._args_tag = (_core.TAG_PACKED_ARGS + _core.varint(args_len)) if args_len else b""
        return self

    def _pack_prepared(self, args: Sequence[Any]) -> bytes:
        packer = self._prepared
        if packer is None:
            raise LogicError(f"{self.name}: call prepare() before prepared_call()")
        try:
            return packer.pack(*args)
        except (struct.error, TypeError):
            pass
        items = self._prepared_items
        if len(args) != len(items):
            raise TypeError(f"{self.name}: prepared for {len(items)} arguments, "
                            f"{len(args)} given")
        converted = []
        for i, (arg, (code, size, kind)) in enumerate(zip(args, items)):
            try:
                if kind == "ptr":
                    value: Any = (arg if isinstance(arg, (int, np.integer))
                                  else _session_pointer(self._core, i, arg, self.name))
                elif kind == "bytes":
                    value = arg.tobytes() if hasattr(arg, "tobytes") else bytes(arg)
                    if len(value) != size:
                        raise self._size_error(i, size, len(value), _describe(arg))
                elif kind == "complex64":
                    value = np.complex64(arg).tobytes()
                elif kind == "complex128":
                    value = np.complex128(arg).tobytes()
                else:
                    value = arg.item() if isinstance(arg, (np.generic, np.ndarray)) else arg
                struct.pack("<" + code, value)
            except (struct.error, TypeError, ValueError) as e:
                if isinstance(e, LogicError):
                    raise
                raise TypeError(f"{self.name}: invalid value for parameter #{i} (0-based, "
                                f"format {code!r}): {arg!r} ({e})") from None
            converted.append(value)
        return packer.pack(*converted)

    def prepared_call(self, grid: Any, block: Any, *args: Any, shared_size: int = 0) -> None:
        """Launches on the default stream with prepared argument types (asynchronous)."""
        self._prepared_launch(grid, block, 0, args, shared_size)

    def prepared_async_call(self, grid: Any, block: Any, stream: Optional[Stream], *args: Any,
                            shared_size: int = 0) -> None:
        """Launches on ``stream`` with prepared argument types."""
        self._prepared_launch(grid, block, _stream_id(stream), args, shared_size)

    def _prepared_launch(self, grid: Any, block: Any, stream_id: int, args: Sequence[Any],
                         shared_size: int) -> None:
        blob = self._pack_prepared(args)
        core = self._core
        with core.lock:
            core.check_open(self._label)
            prefix = self._prefix(grid, block, shared_size, stream_id)
            core.commands.add_launch(prefix + self._args_tag + blob if blob else prefix,
                                     self._label)

    def prepared_timed_call(self, grid: Any, block: Any, *args: Any,
                            shared_size: int = 0) -> Callable[[], float]:
        """Launches and returns a callable that waits for the kernel and returns its time in
        seconds, measured by events on the server."""
        start, end = Event(_core=self._core), Event(_core=self._core)
        blob = self._pack_prepared(args)
        core = self._core
        with core.lock:
            core.check_open(self._label)
            prefix = self._prefix(grid, block, shared_size, 0)
            start.record()
            core.commands.add_launch(prefix + self._args_tag + blob if blob else prefix,
                                     self._label)
            end.record()

        def get_call_time() -> float:
            end.synchronize()
            return end.time_since(start) / 1000.0

        return get_call_time

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Function {self.name}>"


def _timing_events(core: SessionCore) -> Tuple[Event, Event]:
    pair = core.caches.get("timing_events")
    if pair is None:
        pair = core.caches["timing_events"] = (Event(_core=core), Event(_core=core))
    return pair


def _scratch(core: SessionCore, nbytes: int) -> Tuple[int, Callable[[], None]]:
    """A device buffer of at least nbytes for In/Out arguments, and its release function.

    Up to 64 MiB one buffer is kept per session and reused, so a warm In/Out launch makes no
    allocation round trip; larger requests get a buffer of their own, freed afterwards.
    """
    nbytes = max(int(nbytes), 256)
    if nbytes > _SCRATCH_KEEP_BYTES:
        alloc = _alloc(core, nbytes)
        return alloc._ptr, alloc.free
    scratch = core.caches.get("scratch")
    if scratch is None or scratch.size < nbytes:
        if scratch is not None:
            core.caches.pop("scratch", None)
            scratch.free()
        size = 1 << 20
        while size < nbytes:
            size <<= 1
        scratch = core.caches["scratch"] = _alloc(core, size)
    return scratch._ptr, _noop


def _noop() -> None:
    pass


_LINK_INPUT_TYPES = {
    jit_input_type.CUBIN: _mod.LINK_INPUT_TYPE_CUBIN,
    jit_input_type.PTX: _mod.LINK_INPUT_TYPE_PTX,
    jit_input_type.FATBINARY: _mod.LINK_INPUT_TYPE_FATBINARY,
    jit_input_type.OBJECT: _mod.LINK_INPUT_TYPE_OBJECT,
    jit_input_type.LIBRARY: _mod.LINK_INPUT_TYPE_LIBRARY,
}


class Linker:
    """PyCUDA's ``Linker(message_handler=None, options=None, log_verbose=False)``.

    ``add_data``/``add_file`` collect inputs here; :meth:`link_module` sends them all in one
    ``ModuleService.LinkModule`` call, where the daemon links them with the driver's JIT
    linker (``cuLinkCreate``/``cuLinkAddData``/``cuLinkComplete``) and loads the result.
    JIT ``options`` are accepted and ignored. ``message_handler(success, info_log,
    error_log)`` is called once the link is done, as PyCUDA's is. ``info_log`` and
    ``error_log`` hold the linker's logs afterwards.
    """

    def __init__(self, message_handler: Optional[Callable[[bool, str, str], None]] = None,
                 options: Optional[Sequence] = None, log_verbose: bool = False) -> None:
        self._core = _current_core("Linker")
        self._message_handler = message_handler
        self._log_verbose = bool(log_verbose)
        self._inputs: List[Any] = []
        self.info_log = ""
        self.error_log = ""

    def add_data(self, data: Any, input_type: Union[jit_input_type, int],
                 name: str = "unknown") -> None:
        """Adds PTX (``str`` or bytes) or binary bytes of the given :class:`jit_input_type`."""
        try:
            wire_type = _LINK_INPUT_TYPES[jit_input_type(int(input_type))]
        except (ValueError, TypeError):
            raise LogicError(f"Linker.add_data: {input_type!r} is not a jit_input_type "
                             "(CUBIN, PTX, FATBINARY, OBJECT or LIBRARY)") from None
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._inputs.append(_mod.LinkInput(data=_mod.LinkData(type=wire_type, data=raw,
                                                              name=str(name))))

    def add_file(self, filename: str, input_type: Union[jit_input_type, int]) -> None:
        """Reads ``filename`` here and adds its bytes (named by the file's base name)."""
        with open(filename, "rb") as f:
            self.add_data(f.read(), input_type, os.path.basename(filename))

    def _add_input(self, link_input: Any) -> None:
        self._inputs.append(link_input)

    def _link(self) -> Any:
        request = _mod.LinkModuleRequest(inputs=self._inputs, log_verbose=self._log_verbose)
        try:
            reply = self._core.call("ModuleService.LinkModule", request, op="cuLinkComplete")
        except Error as e:
            self.error_log = e.details
            if self._message_handler is not None:
                self._message_handler(False, "", self.error_log)
            raise
        if not reply.success:
            failed = reply.sources[-1]
            name = request.inputs[failed.input_index].source.program_name or "kernel.cu"
            self.error_log = failed.log
            if self._message_handler is not None:
                self._message_handler(False, "", self.error_log)
            raise CompileError(f"NVRTC compilation of {name} failed",
                               command_line=list(failed.effective_options), stdout="",
                               stderr=failed.log)
        self.info_log = reply.log
        if self._message_handler is not None:
            self._message_handler(True, self.info_log, "")
        return reply

    def link_module(self) -> "Module":
        """Links everything added and loads the result (``cuLinkComplete`` + load).

        :raises LogicError: an input the linker refused or a failed link (undefined or
            duplicate symbols; the message has the linker's error log).
        """
        return Module(self._core, self._link().module_id)


# PyCUDA names that a remote session cannot honour (yet), with the reason: asking for one
# says so instead of a bare "no attribute". (AttributeError still, so hasattr() feature checks
# keep working.)
_NOT_AVAILABLE = {
    **dict.fromkeys(
        ["Array", "ArrayDescriptor", "ArrayDescriptor3D", "matrix_to_array", "np_to_array",
         "gpuarray_to_array", "make_multichannel_2d_array", "memcpy_atoh", "memcpy_htoa",
         "memcpy_atod", "memcpy_dtoa", "memcpy_atoa"],
        "CUDA arrays are not served by gpurpcd yet (Memcpy2D/Memcpy3D copy linear memory)"),
    "Memcpy3DPeer": "copies between contexts (sessions) are not served by gpurpcd yet; within "
                    "one context use Memcpy3D",
    **dict.fromkeys(
        ["TextureReference", "SurfaceReference", "bind_array_to_texref"],
        "texture and surface references were removed in CUDA 12"),
    **dict.fromkeys(
        ["managed_empty", "managed_zeros", "managed_empty_like", "managed_zeros_like",
         "mem_alloc_managed"],
        "managed memory would have to be shared between the daemon's GPU and this process's "
        "host memory, which are on different machines (or processes)"),
    **dict.fromkeys(
        ["IPCMemoryHandle", "mem_get_ipc_handle", "IPCEventHandle"],
        "IPC handles between sessions are not served by gpurpcd yet"),
    **dict.fromkeys(
        ["memcpy_peer", "memcpy_peer_async"],
        "peer copies between devices are not served by gpurpcd yet"),
    **dict.fromkeys(
        ["register_host_memory", "RegisteredHostMemory", "mem_host_register_flags"],
        "host memory of this process cannot be pinned by the daemon; use pagelocked_empty/"
        "pagelocked_zeros, which are backed by same-host shared regions"),
}


def __getattr__(name: str) -> Any:
    reason = _NOT_AVAILABLE.get(name)
    if reason is not None:
        raise AttributeError(f"gpurpc.driver.{name} is not available: {reason}")
    raise AttributeError(f"module 'gpurpc.driver' has no attribute {name!r}")
