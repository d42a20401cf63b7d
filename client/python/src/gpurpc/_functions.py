"""Modules and kernels for :mod:`gpurpc.driver`.

:class:`Module` (``module_from_buffer``/``module_from_file``), :class:`Function` (launches,
prepared calls), PyCUDA's argument packing (``_pack_arg``, struct formats) and the
:class:`In`/:class:`Out`/:class:`InOut` handlers, and :class:`Linker`. ``gpurpc.driver``
re-exports the public names; use them from there.
"""
from __future__ import annotations

import functools
import os
import re
import struct
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _core, _regions
from ._core import SessionCore, device_pointer
from ._context import _current_core, _enum_arg, _int_arg
from ._enums import func_cache, function_attribute, jit_input_type, shared_config
from ._errors import CompileError, Error, LogicError
from ._memory import (
    _DOWNLOAD_COMMAND_BYTES,
    DeviceAllocation,
    _address,
    _alloc,
    _readable,
    _session_pointer,
    _writable,
    _write_into,
)
from ._streams import Event, Stream, _stream_id
from .v1 import execution_service_pb2 as _ex, module_service_pb2 as _mod

__all__ = [
    "Module", "module_from_buffer", "module_from_file", "ArgumentHandler", "In", "Out", "InOut",
    "Function", "Linker",
]


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

    def _launch_prefix(self, grid: Any, block: Any, stream_id: int) -> bytes:
        """What :meth:`_launch_with` takes: the launch's fields up to its packed arguments
        (the dimensions checked as for any launch)."""
        with self._core.lock:
            return self._prefix(grid, block, 0, stream_id) + self._args_tag

    def _launch_with(self, prefix: bytes, args: Sequence[Any]) -> None:
        """A prepared launch whose prefix (:meth:`_launch_prefix`) the caller keeps: the same
        launch as :meth:`prepared_async_call`, without looking the prefix up again (the
        gpuarray operators' hot path)."""
        blob = self._pack_prepared(args)
        core = self._core
        with core.lock:
            core.check_open(self._label)
            core.commands.add_launch(prefix + blob, self._label)

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


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
