"""The connection to the daemon(s) and its devices, for :mod:`gpurpc.driver`.

:func:`init` (the process's connection, ``_default_client``, guarded by ``_client_lock``),
the version calls, :class:`Device`, and where a new session goes (:func:`pick_device`,
``_place``). ``gpurpc.driver`` re-exports the public names; use them from there.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import grpc

from . import _core
from ._core import Client, SessionCore, resolve_address
from ._enums import device_attribute
from ._errors import Error, LogicError, RuntimeError

if TYPE_CHECKING:  # pragma: no cover
    from ._context import Context

__all__ = ["init", "get_version", "get_driver_version", "Device", "pick_device"]


_client_lock = threading.Lock()
_default_client: Optional[Client] = None
# In a child of fork(): the connection the parent had (inherited, never used here); the
# child's first connection goes to the same daemon with the same settings.
_parents_client: Optional[Client] = None
# In a child of fork(): the connections made here for inherited devices of other clients
# than the parent's default (``_reconnected``), one per daemon and settings, so that the
# devices of one daemon share one. Never the default client. Guarded by _reconnect_lock.
_reconnect_lock = threading.Lock()
_reconnected_clients: Dict[Tuple[Any, ...], Client] = {}


def init(flags: int = 0, address: Optional[str] = None, *, token: Optional[str] = None,
         root_certificates: Optional[bytes] = None, tls: Optional[bool] = None,
         certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
         server_name: Optional[str] = None, timeout: Optional[float] = None,
         host_regions: Optional[str] = None,
         transfer_connections: Optional[int] = None) -> None:
    """Connects to the daemon (``cuInit``). Called implicitly by the first call that needs it.

    Devices, contexts and everything else use this connection afterwards. Calling it again
    with nothing, or with the same address and credentials, keeps the connection (a
    ``timeout`` or ``host_regions`` given then applies to contexts made afterwards, a
    ``transfer_connections`` to transfers started afterwards); anything else replaces it
    (objects made before keep theirs).

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
    :param transfer_connections: connections a large transfer through gRPC is split over, 1
        to 16 (default ``$GPURPC_TRANSFER_CONNECTIONS``, else 4): a synchronous copy of 16 MiB
        or more goes as parts of at least 8 MiB, each on a connection of its own.
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
            # Every value is checked before any is applied: a bad one changes nothing.
            new_timeout = None if timeout is None else _core.resolve_timeout(timeout)
            regions = None if host_regions is None else _core.resolve_host_regions(host_regions)
            connections = None if transfer_connections is None else \
                _core.resolve_transfer_connections(transfer_connections)
            if new_timeout is not None:
                _default_client.timeout = new_timeout
            if regions is not None:
                _default_client.host_regions = regions
            if connections is not None:
                _default_client.transfer_connections = connections
            _default_client.list_devices()
            return
        client = Client(address, token=token, root_certificates=root_certificates, tls=tls,
                        certificate_chain=certificate_chain, private_key=private_key,
                        server_name=server_name, timeout=timeout, host_regions=host_regions,
                        transfer_connections=transfer_connections)
        try:
            client.list_devices()
        except BaseException:
            client.close()
            raise
        _default_client = client


def _after_fork_in_child() -> None:
    """A child of fork() connects anew: the parent's connection is not its to use
    (``_core._after_fork_in_child``)."""
    global _client_lock, _default_client, _parents_client, _reconnect_lock
    global _reconnected_clients
    _client_lock = threading.Lock()  # a parent's thread may have held it at the fork
    _reconnect_lock = threading.Lock()
    _parents_client = _default_client or _parents_client
    _default_client = None
    _reconnected_clients = {}  # the parent's: inherited too, reconnected again if used


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _from_client(inherited: Client, client: Client) -> bool:
    """Whether ``inherited`` is ``client`` or one of its daemons' clients (read without
    ``client``'s lock: an inherited lock may have been held at the fork)."""
    return inherited is client or any(
        member is inherited for member in list(client._members.values()))


def _reconnected(inherited: Client) -> Client:
    """This process's connection to the daemon of ``inherited``, a client of one daemon that
    it inherited over fork (an inherited ``Device``'s).

    A device of the parent's default connection (:func:`init`'s, or one of its daemons) goes
    through this process's default connection, made as :func:`_client` makes it (to where
    the parent's went, with the same settings) unless :func:`init` has already made one here
    to the same address with the same credentials. Any other device gets a connection of
    its own, with the same address and settings as ``inherited`` (``Client.reopened``),
    shared by every inherited device of that daemon with those settings; the default
    connection stays what it is.
    """
    parents = _parents_client
    if parents is not None and _from_client(inherited, parents):
        fresh = _client()
        if (fresh.target == parents.target
                and fresh.explicit_credentials == parents.explicit_credentials):
            if inherited is parents and not fresh.multi_daemon:
                return fresh
            if inherited is not parents and fresh.multi_daemon:
                return fresh._member(inherited.target, inherited._tls_name)
    key = (inherited.target, inherited.explicit_credentials, inherited._tls_name)
    with _reconnect_lock:
        client = _reconnected_clients.get(key)
        if client is None:
            client = _reconnected_clients[key] = inherited.reopened()
        return client


def _client() -> Client:
    """This process's connection (:func:`init` makes it when there is none; in a child of
    fork(), to where the parent's went, with the same settings)."""
    client = _default_client
    if client is None:
        parents = _parents_client
        if parents is None:
            init()
        else:
            token, roots, tls, chain, key, name = parents.explicit_credentials
            init(address=parents.target, token=token, root_certificates=roots, tls=tls,
                 certificate_chain=chain, private_key=key, server_name=name,
                 timeout=parents.timeout, host_regions=parents.host_regions)
        client = _default_client
    assert client is not None
    return client


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
        from ._context import Context  # the layer above this one
        label = f"python gpurpc on {socket.gethostname()} pid {os.getpid()}"
        if self._client.inherited_from is not None:
            self._client = _reconnected(self._client)
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


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
