"""Helpers of ``pycuda.tools``: dtype/C-type mapping, argument parsing for the kernel
generators, per-context memoization, a device memory pool and ``make_default_context``."""
from __future__ import annotations

import functools
import os
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np

from . import driver as _drv
from ._core import SessionCore

__all__ = [
    "dtype_to_ctype", "register_dtype", "get_or_register_dtype", "parse_c_arg", "VectorArg",
    "ScalarArg", "context_dependent_memoize", "clear_context_caches", "DeviceMemoryPool",
    "PooledDeviceAllocation", "make_default_context", "DeviceData", "bitlog2",
]

# ---------------------------------------------------------------------------------------------
# dtypes and C types

_DTYPE_TO_CTYPE: Dict[np.dtype, str] = {
    np.dtype(np.bool_): "bool",
    np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.int16): "short",
    np.dtype(np.uint16): "unsigned short",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.int64): "long long",
    np.dtype(np.uint64): "unsigned long long",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}

_CTYPE_TO_DTYPE: Dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "char": np.dtype(np.int8), "signed char": np.dtype(np.int8),
    "unsigned char": np.dtype(np.uint8),
    "short": np.dtype(np.int16), "short int": np.dtype(np.int16),
    "signed short": np.dtype(np.int16),
    "unsigned short": np.dtype(np.uint16), "unsigned short int": np.dtype(np.uint16),
    "int": np.dtype(np.int32), "signed int": np.dtype(np.int32), "signed": np.dtype(np.int32),
    "unsigned": np.dtype(np.uint32), "unsigned int": np.dtype(np.uint32),
    "long": np.dtype(np.int64), "long int": np.dtype(np.int64), "signed long": np.dtype(np.int64),
    "unsigned long": np.dtype(np.uint64), "unsigned long int": np.dtype(np.uint64),
    "long long": np.dtype(np.int64), "long long int": np.dtype(np.int64),
    "unsigned long long": np.dtype(np.uint64), "unsigned long long int": np.dtype(np.uint64),
    "float": np.dtype(np.float32), "double": np.dtype(np.float64),
    "size_t": np.dtype(np.uint64), "ptrdiff_t": np.dtype(np.int64),
    "int8_t": np.dtype(np.int8), "uint8_t": np.dtype(np.uint8),
    "int16_t": np.dtype(np.int16), "uint16_t": np.dtype(np.uint16),
    "int32_t": np.dtype(np.int32), "uint32_t": np.dtype(np.uint32),
    "int64_t": np.dtype(np.int64), "uint64_t": np.dtype(np.uint64),
}


def register_dtype(dtype: Any, c_names: Union[str, List[str]]) -> None:
    """Registers a (struct) dtype under C type name(s) for ``dtype_to_ctype``/``parse_c_arg``."""
    dtype = np.dtype(dtype)
    names = [c_names] if isinstance(c_names, str) else list(c_names)
    _DTYPE_TO_CTYPE.setdefault(dtype, names[0])
    for name in names:
        _CTYPE_TO_DTYPE[name] = dtype


def get_or_register_dtype(c_names: Union[str, List[str]], dtype: Any = None) -> np.dtype:
    """The dtype registered for a C name, registering ``dtype`` under it if given."""
    if dtype is not None:
        register_dtype(dtype, c_names)
        return np.dtype(dtype)
    name = c_names if isinstance(c_names, str) else c_names[0]
    try:
        return _CTYPE_TO_DTYPE[name]
    except KeyError:
        raise TypeError(f"unknown C type {name!r}") from None


def dtype_to_ctype(dtype: Any, with_fp_tex_hack: bool = False) -> str:
    """The C type for a numpy dtype, e.g. ``float32 -> "float"``."""
    if dtype is None:
        raise ValueError("dtype may not be None")
    dtype = np.dtype(dtype)
    try:
        return _DTYPE_TO_CTYPE[dtype]
    except KeyError:
        raise ValueError(f"unable to map dtype '{dtype}' to a C type (complex and float16 "
                         "arrays are not supported by gpurpc's kernel generators)") from None


class Argument:
    def __init__(self, dtype: Any, name: str) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.dtype})"


class VectorArg(Argument):
    """A pointer argument (``float *x``); passed a GPUArray."""

    struct_char = "P"

    def declarator(self) -> str:
        """The C declaration, e.g. ``float *x``."""
        return f"{dtype_to_ctype(self.dtype)} *{self.name}"


class ScalarArg(Argument):
    """A by-value argument (``float a``)."""

    @property
    def struct_char(self) -> str:
        if self.dtype.kind == "V":
            return f"{self.dtype.itemsize}s"
        return self.dtype.char

    def declarator(self) -> str:
        """The C declaration, e.g. ``float a``."""
        return f"{dtype_to_ctype(self.dtype)} {self.name}"


_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")


def parse_c_arg(c_arg: str) -> Argument:
    """``"const float *x"`` -> VectorArg(float32, "x"); ``"int n"`` -> ScalarArg(int32, "n")."""
    decl = c_arg.strip()
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*(\[\s*\])?$", decl)
    if m is None:
        raise ValueError(f"cannot parse C argument {c_arg!r}")
    type_part, name, brackets = m.group(1), m.group(2), m.group(3)
    is_pointer = "*" in type_part or brackets is not None
    ctype = " ".join(_QUALIFIERS.sub(" ", type_part.replace("*", " ")).split())
    if not ctype:
        raise ValueError(f"cannot parse C argument {c_arg!r}: no type")
    dtype = get_or_register_dtype(ctype)
    return VectorArg(dtype, name) if is_pointer else ScalarArg(dtype, name)


def parse_c_args(arguments: Union[str, List[Any]]) -> List[Argument]:
    if isinstance(arguments, str):
        return [parse_c_arg(a) for a in arguments.split(",") if a.strip()]
    return list(arguments)


# ---------------------------------------------------------------------------------------------
# Per-context memoization

_memoized_functions: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _current_key() -> SessionCore:
    return _drv._current_core("context_dependent_memoize")


def context_dependent_memoize(func: Callable) -> Callable:
    """Caches ``func(*args)`` per current context (session), like PyCUDA's decorator."""
    cache: "weakref.WeakKeyDictionary[SessionCore, Dict[Any, Any]]" = weakref.WeakKeyDictionary()

    @functools.wraps(func)
    def wrapper(*args: Any) -> Any:
        core = _current_key()
        per_ctx = cache.get(core)
        if per_ctx is None:
            per_ctx = cache[core] = {}
        try:
            return per_ctx[args]
        except KeyError:
            result = per_ctx[args] = func(*args)
            return result

    wrapper.clear_cache = cache.clear  # type: ignore[attr-defined]
    _memoized_functions.add(wrapper)
    return wrapper


def clear_context_caches() -> None:
    """Empties every ``context_dependent_memoize`` cache."""
    for f in list(_memoized_functions):
        f.clear_cache()


# ---------------------------------------------------------------------------------------------
# Memory pool

def bitlog2(n: int) -> int:
    """floor(log2(n)) for n >= 1."""
    return int(n).bit_length() - 1


class PooledDeviceAllocation:
    """A block of a :class:`DeviceMemoryPool`; ``int()`` is its address, ``free()`` (or
    garbage collection) returns it to the pool."""

    __slots__ = ("_pool", "_alloc", "_size", "_finalizer", "__weakref__")

    def __init__(self, pool: "DeviceMemoryPool", alloc: _drv.DeviceAllocation, size: int) -> None:
        self._pool = pool
        self._alloc = alloc
        self._size = size
        self._finalizer = weakref.finalize(self, pool._give_back, alloc)
        self._finalizer.atexit = False

    def __int__(self) -> int:
        return int(self._alloc)

    __index__ = __int__

    @property
    def size(self) -> int:
        return self._size

    def free(self) -> None:
        """Returns the block to its pool now."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"<PooledDeviceAllocation 0x{int(self._alloc):x} ({self._size} bytes)>"


class DeviceMemoryPool:
    """Caches freed device blocks by size class so that reallocating costs no round trip.

    Like PyCUDA's pool, blocks are reused without regard to streams: a block freed while a
    kernel on another stream still uses it can be handed out again. The pool releases what it
    holds when an allocation runs out of memory, on ``free_held()`` and ``stop_holding()``.
    """

    def __init__(self, allocator: Optional[Callable[[int], _drv.DeviceAllocation]] = None) -> None:
        self._allocator = allocator or _drv.mem_alloc
        self._bins: Dict[int, List[_drv.DeviceAllocation]] = {}
        self._holding = True
        self.active_blocks = 0

    @staticmethod
    def alloc_size(size: int) -> int:
        """The size class of a request: at most 12.5% larger, multiple of 256."""
        size = max(int(size), 1)
        granule = max(256, 1 << max(bitlog2(size) - 3, 0))
        return (size + granule - 1) // granule * granule

    @property
    def held_blocks(self) -> int:
        return sum(len(v) for v in self._bins.values())

    def allocate(self, size: int) -> PooledDeviceAllocation:
        """A block of at least ``size`` bytes."""
        rounded = self.alloc_size(size)
        blocks = self._bins.get(rounded)
        if blocks:
            alloc = blocks.pop()
        else:
            try:
                alloc = self._allocator(rounded)
            except _drv.MemoryError:
                self.free_held()
                alloc = self._allocator(rounded)
        self.active_blocks += 1
        return PooledDeviceAllocation(self, alloc, int(size))

    __call__ = allocate

    def _give_back(self, alloc: _drv.DeviceAllocation) -> None:
        self.active_blocks -= 1
        if self._holding and not alloc._core.closed:
            self._bins.setdefault(alloc.size, []).append(alloc)

    def free_held(self) -> None:
        """Frees every block the pool holds."""
        bins, self._bins = self._bins, {}
        for blocks in bins.values():
            blocks.clear()  # garbage collection frees them (deferred, no RPC here)

    def stop_holding(self) -> None:
        """Frees held blocks and keeps no more."""
        self._holding = False
        self.free_held()


def _session_pool(core: SessionCore) -> DeviceMemoryPool:
    pool = core.caches.get("gpuarray_pool")
    if pool is None:
        pool = core.caches["gpuarray_pool"] = DeviceMemoryPool(
            functools.partial(_drv._alloc, core))
        core.caches.setdefault("oom_handlers", []).append(pool.free_held)
    return pool


# ---------------------------------------------------------------------------------------------
# Contexts and devices

def make_default_context(ctx_maker: Optional[Callable[[_drv.Device], _drv.Context]] = None,
                         ) -> _drv.Context:
    """Opens a context on ``$GPURPC_DEVICE``/``$CUDA_DEVICE`` or the first device that works."""
    if ctx_maker is None:
        def ctx_maker(dev: _drv.Device) -> _drv.Context:
            return dev.make_context()
    _drv.init()
    chosen = os.environ.get("GPURPC_DEVICE", os.environ.get("CUDA_DEVICE"))
    if chosen is not None:
        return ctx_maker(_drv.Device(int(chosen)))
    errors = []
    for i in range(_drv.Device.count()):
        try:
            return ctx_maker(_drv.Device(i))
        except _drv.Error as e:
            errors.append(str(e))
    raise _drv.RuntimeError("make_default_context(): no device could be used: " + "; ".join(errors))


class DeviceData:
    """Launch-shaping facts of a device (``pycuda.tools.DeviceData``)."""

    def __init__(self, dev: Optional[_drv.Device] = None) -> None:
        if dev is None:
            dev = _drv.Context.get_device()
        self.max_threads = dev.get_attribute(_drv.device_attribute.MAX_THREADS_PER_BLOCK) or 1024
        self.warp_size = dev.get_attribute(_drv.device_attribute.WARP_SIZE) or 32
        major = dev.compute_capability()[0]
        self.thread_blocks_per_mp = 8 if major < 3 else (16 if major < 5 else 32)
        self.warps_per_mp = 64 if major >= 3 else 32
        self.registers = 65536
        self.shared_memory = dev.get_attribute(
            _drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK) or 49152
        self.smem_granularity = 32
        self.smem_alloc_granularity = 128

    def align(self, bytes: int, word_size: int = 4) -> int:  # noqa: A002
        return _align(bytes, word_size, self.smem_granularity)

    def align_dtype(self, elements: int, dtype_size: int) -> int:
        """Rounds an element count up to the shared-memory granularity."""
        """Rounds a byte count up to the shared-memory granularity."""
        return _align(elements * dtype_size, dtype_size, self.smem_granularity) // dtype_size


def _align(nbytes: int, word_size: int, granularity: int) -> int:
    unit = word_size * granularity
    return (nbytes + unit - 1) // unit * unit
