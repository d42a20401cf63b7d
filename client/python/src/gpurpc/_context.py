"""Contexts (daemon sessions) for :mod:`gpurpc.driver`.

:class:`Context`, the per-thread context stack (``_tls``, ``_stack``), the process's most
recent context (``_last_context``), ``_current_core`` (the session a call without one runs
in), and the checks of enum and int arguments the driver's calls share. ``gpurpc.driver``
re-exports the public names; use them from there.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, List, Optional, Union

import grpc
import numpy as np

from . import _core, _regions
from ._core import SessionCore
from ._devices import Device, get_driver_version
from ._enums import func_cache, limit, shared_config
from ._errors import Error, LogicError
from .v1 import module_service_pb2 as _mod

__all__ = ["Context"]


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
    stack = getattr(_tls, "stack", None)
    if stack:  # the common case, on every kernel call and allocation: kept to one lookup
        ctx = stack[-1]
        if not ctx._core._state.closed:
            return ctx
    stack = _stack()
    inherited: Optional[SessionCore] = None  # a forked parent's context (_core._inherited)
    while stack and stack[-1]._core.closed:
        inherited = inherited or _forked_parents(stack[-1]._core)
        stack.pop()
    ctx = stack[-1] if stack else (_last_context() if _last_context is not None else None)
    if ctx is None or ctx._core.closed:
        inherited = inherited or (_forked_parents(ctx._core) if ctx is not None else None)
        if inherited is not None:
            raise _core.inherited_session_error(inherited.session_id,
                                                inherited._state.inherited_from or 0, what)
        raise LogicError(f"{what} failed: no current context; create one with "
                         "gpurpc.driver.Device(0).make_context() or `import gpurpc.autoinit`")
    return ctx


def _forked_parents(core: SessionCore) -> Optional[SessionCore]:
    """``core`` when it is a session this forked process inherited from its parent."""
    return core if core._state.inherited_from is not None else None


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


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
