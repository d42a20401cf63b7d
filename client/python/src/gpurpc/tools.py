"""``pycuda.tools``: dtype/C-type mapping, argument parsing for the kernel generators,
per-context memoization, memory pools, device data and occupancy, the default context and
pytest helpers.

What differs from PyCUDA:

* :class:`DeviceMemoryPool` and :class:`PageLockedMemoryPool` are client-side Python pools
  (PyCUDA's are C++). They bin sizes PyCUDA's way (:meth:`DeviceMemoryPool.bin_number`,
  :meth:`DeviceMemoryPool.alloc_size`: two mantissa bits, so a block is at most 25% larger
  than asked for) and have the same counters. A block given back is reused without a round
  trip to the daemon; freeing held blocks drops them, and the daemon frees them at the
  context's next call that already talks to it (nothing here makes an RPC from a finalizer).
  ``PooledDeviceAllocation.free()`` twice is harmless, as ``DeviceAllocation.free()`` is.
* :class:`PageLockedMemoryPool` hands out arrays backed by :func:`gpurpc.driver.pagelocked_empty`
  blocks, which are same-host regions when the context uses them (see ``gpurpc.driver``).
* :class:`DeviceData` reads what the daemon reports (``MAX_THREADS_PER_MULTIPROCESSOR``,
  ``MAX_BLOCKS_PER_MULTIPROCESSOR``, ``MAX_REGISTERS_PER_BLOCK`` ...) where PyCUDA uses
  per-generation constants, and falls back to PyCUDA's constants where an attribute is not
  reported (the fake backend reports few).
* :func:`make_default_context` also honours ``$GPURPC_DEVICE`` (before ``$CUDA_DEVICE`` and
  ``~/.cuda_device``).
"""
from __future__ import annotations

import functools
import gc
import math
import os
import re
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _context, _devices, _memory
from . import driver as _drv
from ._core import SessionCore
from ._errors import LogicError

__all__ = [
    "dtype_to_ctype", "register_dtype", "get_or_register_dtype", "parse_c_arg", "get_arg_type",
    "Argument", "VectorArg", "ScalarArg", "context_dependent_memoize", "clear_context_caches",
    "DeviceMemoryPool", "PooledDeviceAllocation", "PageLockedMemoryPool",
    "PageLockedAllocator", "PooledHostAllocation", "make_default_context", "get_default_device",
    "DeviceData", "OccupancyRecord", "bitlog2", "mark_cuda_test", "init_cuda_context_fixture",
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
    "signed short": np.dtype(np.int16), "signed short int": np.dtype(np.int16),
    "unsigned short": np.dtype(np.uint16), "unsigned short int": np.dtype(np.uint16),
    "short unsigned int": np.dtype(np.uint16),
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


def _names(c_names: Union[str, Sequence[str]]) -> List[str]:
    names = [c_names] if isinstance(c_names, str) else list(c_names)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"C type names must be non-empty strings, got {c_names!r}")
    return [" ".join(n.split()) for n in names]


def register_dtype(dtype: Any, c_names: Union[str, Sequence[str]], alias_ok: bool = False) -> None:
    """Registers a (struct) dtype under C type name(s) for :func:`dtype_to_ctype` and
    :func:`parse_c_arg`; the first name is the one :func:`dtype_to_ctype` answers.

    :raises RuntimeError: the dtype is registered under another name (unless ``alias_ok``),
        or a name already stands for another dtype.
    """
    dtype = np.dtype(dtype)
    names = _names(c_names)
    existing = _DTYPE_TO_CTYPE.get(dtype)
    if existing is not None and existing != names[0] and not alias_ok:
        raise RuntimeError(f"dtype {dtype} is already registered as {existing!r} (new name "
                           f"{names[0]!r}); pass alias_ok=True to add an alias")
    for name in names:
        other = _CTYPE_TO_DTYPE.get(name)
        if other is not None and other != dtype:
            raise RuntimeError(f"C type name {name!r} is already registered to dtype {other}")
    if existing is None:
        _DTYPE_TO_CTYPE[dtype] = names[0]
    for name in names:
        _CTYPE_TO_DTYPE[name] = dtype



# Complex numbers: ``pycuda::complex<T>``, which gpurpc.elementwise defines over CUDA's own
# ``cuda::std::complex`` (and adds to every generated kernel that has a complex argument).
register_dtype(np.complex64, ["pycuda::complex<float>", "cuda::std::complex<float>",
                              "complex<float>"])
register_dtype(np.complex128, ["pycuda::complex<double>", "cuda::std::complex<double>",
                               "complex<double>"])

def get_or_register_dtype(c_names: Union[str, Sequence[str]], dtype: Any = None) -> np.dtype:
    """The dtype registered for C name(s); with ``dtype``, registers it under them first.

    :raises TypeError: no dtype is registered under the name (and none was given).
    :raises RuntimeError: a name already stands for another dtype.
    """
    names = _names(c_names)
    if dtype is None:
        missing = [n for n in names if n not in _CTYPE_TO_DTYPE]
        if missing:
            raise TypeError(f"unknown C type {missing[0]!r} (register it with "
                            "gpurpc.tools.get_or_register_dtype(name, dtype))")
        found = {_CTYPE_TO_DTYPE[n] for n in names}
        if len(found) > 1:
            raise RuntimeError(f"C type names {names!r} stand for different dtypes")
        return found.pop()
    dtype = np.dtype(dtype)
    register_dtype(dtype, names, alias_ok=True)
    return dtype


def dtype_to_ctype(dtype: Any, with_fp_tex_hack: bool = False) -> str:
    """The C type for a numpy dtype, e.g. ``float32 -> "float"``. With ``with_fp_tex_hack``,
    float32/float64 give PyCUDA's texture names ``fp_tex_float``/``fp_tex_double``."""
    if dtype is None:
        raise ValueError("dtype may not be None")
    dtype = np.dtype(dtype)
    if with_fp_tex_hack:
        if dtype == np.float32:
            return "fp_tex_float"
        if dtype == np.float64:
            return "fp_tex_double"
    try:
        return _DTYPE_TO_CTYPE[dtype]
    except KeyError:
        raise ValueError(f"unable to map dtype '{dtype}' to a C type (float16 arrays are not "
                         "supported by gpurpc's kernel generators; register struct dtypes "
                         "with gpurpc.tools.register_dtype)") from None


class Argument:
    """A kernel argument of a generated kernel: a dtype and a name."""

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
    """``"const float *x"`` -> VectorArg(float32, "x"); ``"int n"`` -> ScalarArg(int32, "n").

    :raises ValueError: not a C declaration.
    :raises TypeError: the type is not known (see :func:`get_or_register_dtype`).
    """
    decl = c_arg.strip()
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*(\[\s*\d*\s*\])?$", decl)
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
    """A comma-separated C argument list (or a list of Arguments) as Arguments."""
    if isinstance(arguments, str):
        return [parse_c_arg(a) for a in arguments.split(",") if a.strip()]
    return list(arguments)


def get_arg_type(c_arg: str) -> str:
    """The ``prepare`` format character of a C argument (``"float *x"`` -> ``"P"``)."""
    return parse_c_arg(c_arg).struct_char


# ---------------------------------------------------------------------------------------------
# Per-context memoization

_memoized_functions: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _current_key() -> SessionCore:
    return _context._current_core("context_dependent_memoize")


def context_dependent_memoize(func: Callable) -> Callable:
    """Caches ``func(*args, **kwargs)`` per current context (session), like PyCUDA's decorator.
    A cache entry goes with its session."""
    cache: "weakref.WeakKeyDictionary[SessionCore, Dict[Any, Any]]" = weakref.WeakKeyDictionary()

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        core = _current_key()
        key = (args, frozenset(kwargs.items())) if kwargs else args
        per_ctx = cache.get(core)
        if per_ctx is None:
            per_ctx = cache[core] = {}
        try:
            return per_ctx[key]
        except KeyError:
            result = per_ctx[key] = func(*args, **kwargs)
            return result

    wrapper.clear_cache = cache.clear  # type: ignore[attr-defined]
    _memoized_functions.add(wrapper)
    return wrapper


def clear_context_caches() -> None:
    """Empties every ``context_dependent_memoize`` cache (releasing what they hold of any
    context, so that nothing of this module keeps a session's kernels alive)."""
    for f in list(_memoized_functions):
        f.clear_cache()


# ---------------------------------------------------------------------------------------------
# Memory pools

def bitlog2(n: int) -> int:
    """floor(log2(n)) for n >= 1; 0 for 0 (as PyCUDA's)."""
    n = int(n)
    if n < 0:
        raise ValueError(f"bitlog2 of a negative number ({n})")
    return max(n.bit_length() - 1, 0)


_MANTISSA_BITS = 2
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1


def _signed_shift_left(x: int, shift: int) -> int:
    return x << shift if shift >= 0 else x >> -shift


def _bin_number(size: int) -> int:
    size = int(size)
    if size < 0:
        raise ValueError(f"a memory pool cannot allocate a negative size ({size})")
    exponent = bitlog2(size)
    shifted = _signed_shift_left(size, _MANTISSA_BITS - exponent)
    return exponent << _MANTISSA_BITS | (shifted & _MANTISSA_MASK)


def _alloc_size(bin_nr: int) -> int:
    bin_nr = int(bin_nr)
    if bin_nr < 0:
        raise ValueError(f"bin numbers are not negative ({bin_nr})")
    exponent = bin_nr >> _MANTISSA_BITS
    mantissa = bin_nr & _MANTISSA_MASK
    ones = _signed_shift_left(1, exponent - _MANTISSA_BITS)
    if ones:
        ones -= 1
    head = _signed_shift_left((1 << _MANTISSA_BITS) | mantissa, exponent - _MANTISSA_BITS)
    return head | ones


class _PoolBase:
    """The binning and counting shared by the device and the host pool (PyCUDA's
    ``memory_pool``): a request of ``size`` bytes goes to bin ``bin_number(size)``, whose
    blocks are ``alloc_size(bin)`` bytes."""

    def __init__(self) -> None:
        self._bins: Dict[int, List[Any]] = {}
        self._holding = True
        self._active_blocks = 0
        self._managed_bytes = 0
        self._active_bytes = 0

    @staticmethod
    def bin_number(size: int) -> int:
        """The bin of a request of ``size`` bytes: ``bitlog2(size)`` and the two bits below
        the leading one (PyCUDA's scheme)."""
        return _bin_number(size)

    @staticmethod
    def alloc_size(bin_nr: int) -> int:
        """The size of the blocks of bin ``bin_nr``: the largest size that falls in it."""
        return _alloc_size(bin_nr)

    @property
    def held_blocks(self) -> int:
        """Blocks given back and kept for reuse."""
        return sum(len(v) for v in self._bins.values())

    @property
    def active_blocks(self) -> int:
        """Blocks handed out and not yet given back."""
        return self._active_blocks

    @property
    def managed_bytes(self) -> int:
        """Bytes of all blocks the pool has allocated and not freed (active and held)."""
        return self._managed_bytes

    @property
    def active_bytes(self) -> int:
        """Bytes asked for by the blocks now handed out."""
        return self._active_bytes

    # The size classes this pool uses (PyCUDA's bins; gpuarray's own pool rounds tighter).
    def _bin_of(self, size: int) -> int:
        return _bin_number(size)

    def _size_of(self, bin_nr: int) -> int:
        return _alloc_size(bin_nr)

    def _take(self, size: int) -> Tuple[int, Any]:
        bin_nr = self._bin_of(size)
        blocks = self._bins.get(bin_nr)
        if blocks:
            block = blocks.pop()
        else:
            block = self._allocate_block(self._size_of(bin_nr))
            self._managed_bytes += self._size_of(bin_nr)
        self._active_blocks += 1
        self._active_bytes += int(size)
        return bin_nr, block

    def _give_back(self, bin_nr: int, size: int, block: Any) -> None:
        self._active_blocks -= 1
        self._active_bytes -= size
        if self._holding and self._block_reusable(block):
            self._bins.setdefault(bin_nr, []).append(block)
        else:
            self._managed_bytes -= self._size_of(bin_nr)

    def free_held(self) -> None:
        """Frees every block the pool holds."""
        bins, self._bins = self._bins, {}
        for bin_nr, blocks in bins.items():
            self._managed_bytes -= self._size_of(bin_nr) * len(blocks)
            blocks.clear()  # dropping the last reference frees the block

    def stop_holding(self) -> None:
        """Frees held blocks, and frees blocks given back from now on instead of keeping them
        (a cleanup action when a pool falls out of use)."""
        self._holding = False
        self.free_held()

    def _allocate_block(self, nbytes: int) -> Any:
        raise NotImplementedError

    def _block_reusable(self, block: Any) -> bool:
        return True


class PooledDeviceAllocation:
    """A block of a :class:`DeviceMemoryPool`; ``int()`` is its address, ``len()`` the size
    asked for, and ``free()`` (or garbage collection) gives it back to the pool."""

    # A block is made and given back on every GPUArray temporary: it costs no weakref
    # finalizer (__del__ does that job), and int() is a stored field.
    __slots__ = ("_pool", "_alloc", "_size", "_bin", "_ptr", "__weakref__")

    def __init__(self, pool: "DeviceMemoryPool", alloc: Any, size: int, bin_nr: int) -> None:
        self._pool = pool
        self._alloc = alloc
        self._size = size
        self._bin = bin_nr
        self._ptr = int(alloc)

    def __int__(self) -> int:
        return self._ptr

    __index__ = __int__

    def __len__(self) -> int:
        return self._size

    @property
    def size(self) -> int:
        """The size asked for, in bytes (the block may be larger)."""
        return self._size

    def free(self) -> None:
        """Gives the block back to its pool now (twice, or from two threads, is harmless)."""
        try:
            pool = self._pool
            del self._pool  # one atomic step: of two racing calls, one gives the block back
        except AttributeError:
            return
        pool._give_back(self._bin, self._size, self._alloc)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 -- at interpreter exit the pool may be half torn down
            pass

    def __repr__(self) -> str:
        return f"<PooledDeviceAllocation 0x{int(self._alloc):x} ({self._size} bytes)>"


class DeviceMemoryPool(_PoolBase):
    """Keeps freed device blocks by size class so that reallocating costs no round trip
    (``pycuda.tools.DeviceMemoryPool``).

    ``allocator`` (default :func:`gpurpc.driver.mem_alloc`) makes a block of a given size.
    Like PyCUDA's pool, blocks are reused without regard to streams: a block given back while
    a kernel on another stream still uses it can be handed out again. When the allocator runs
    out of memory, the pool frees what it holds and tries once more.
    """

    def __init__(self, allocator: Optional[Callable[[int], Any]] = None) -> None:
        super().__init__()
        self._allocator = allocator or _drv.mem_alloc

    def allocate(self, size: int) -> PooledDeviceAllocation:
        """A block of at least ``size`` bytes.

        :raises MemoryError: the device has no room, also after the held blocks were freed.
        """
        size = int(size)
        bin_nr, block = self._take(size)
        return PooledDeviceAllocation(self, block, size, bin_nr)

    __call__ = allocate

    def _allocate_block(self, nbytes: int) -> Any:
        try:
            return self._allocator(nbytes)
        except _drv.MemoryError:
            gc.collect()  # blocks of dropped arrays come back (PyCUDA's try_release_blocks)
            self.free_held()
            return self._allocator(nbytes)

    def _block_reusable(self, block: Any) -> bool:
        # A block whose own finalizer ran is freed: when a pooled block and its allocation
        # are garbage together (in a reference cycle), the garbage collector runs the
        # allocation's weakref finalizer before the pooled block's __del__ gives it back.
        finalizer = getattr(block, "_finalizer", None)
        if finalizer is not None and not finalizer.alive:
            return False
        core = getattr(block, "_core", None)
        return core is None or not core.closed


class _TightDeviceMemoryPool(DeviceMemoryPool):
    """GPUArray's own pool: its classes are the request rounded up to 1/8 of its leading
    power of two (at least 256 bytes), so a block is at most 12.5% larger and an exact size
    such as 32 MiB stays exact -- every byte counts against the tenant's device-memory quota,
    which PyCUDA's bins (up to 25% more) would eat into. The class is the block size."""

    def __init__(self, allocator: Optional[Callable[[int], Any]] = None) -> None:
        super().__init__(allocator)
        self._bin_cache: Dict[int, int] = {}  # size -> class: arrays come in few sizes

    def _bin_of(self, size: int) -> int:
        bin_nr = self._bin_cache.get(size)
        if bin_nr is None:
            n = max(int(size), 1)
            granule = max(256, 1 << max(bitlog2(n) - 3, 0))
            bin_nr = (n + granule - 1) // granule * granule
            if len(self._bin_cache) >= 1024:
                self._bin_cache.clear()
            self._bin_cache[size] = bin_nr
        return bin_nr

    def _size_of(self, bin_nr: int) -> int:
        return bin_nr


def _session_pool(core: SessionCore) -> DeviceMemoryPool:
    pool = core.caches.get("gpuarray_pool")
    if pool is None:
        pool = core.caches["gpuarray_pool"] = _TightDeviceMemoryPool(
            functools.partial(_memory._alloc, core))
        core.caches.setdefault("oom_handlers", []).append(pool.free_held)
    return pool


class PooledHostAllocation:
    """A block of a :class:`PageLockedMemoryPool`, the ``.base`` of the array that
    :meth:`PageLockedMemoryPool.allocate` returns; ``len()`` is its size in bytes and
    ``free()`` (or garbage collection of the array) gives it back to the pool."""

    __slots__ = ("_block", "_size", "_finalizer", "__array_interface__", "__weakref__")

    def __init__(self, pool: "PageLockedMemoryPool", block: np.ndarray, size: int, bin_nr: int,
                 shape: Tuple[int, ...], dtype: np.dtype, order: str) -> None:
        self._block = block
        self._size = size
        strides = None
        if order == "F" and len(shape) > 1:
            acc, f_strides = dtype.itemsize, []
            for n in shape:
                f_strides.append(acc)
                acc *= max(n, 1)
            strides = tuple(f_strides)
        self.__array_interface__ = {
            "version": 3, "shape": shape, "typestr": dtype.str,
            "descr": dtype.descr if dtype.fields is not None else [("", dtype.str)],
            "data": (int(block.__array_interface__["data"][0]), False), "strides": strides,
        }
        self._finalizer = weakref.finalize(self, pool._give_back, bin_nr, size, block)
        self._finalizer.atexit = False

    def __len__(self) -> int:
        return self._size

    def free(self) -> None:
        """Gives the block back to its pool now (an array still using it then shares its
        memory with the next allocation; twice is harmless)."""
        self._finalizer()


class PageLockedAllocator:
    """Makes the blocks of a :class:`PageLockedMemoryPool`: :func:`gpurpc.driver.pagelocked_empty`
    byte arrays (``flags`` are :class:`gpurpc.driver.host_alloc_flags`, accepted as there)."""

    def __init__(self, flags: int = 0) -> None:
        self.flags = int(flags)

    def __call__(self, nbytes: int) -> np.ndarray:
        return _drv.pagelocked_empty((int(nbytes),), np.uint8, mem_flags=self.flags)


class PageLockedMemoryPool(_PoolBase):
    """Keeps freed page-locked host blocks by size class (``pycuda.tools.PageLockedMemoryPool``).
    Blocks are :func:`gpurpc.driver.pagelocked_empty` arrays of the context current when they
    were made: same-host regions, copied by DMA, when that context uses them."""

    def __init__(self, allocator: Optional[Callable[[int], np.ndarray]] = None) -> None:
        super().__init__()
        self._allocator = allocator if allocator is not None else PageLockedAllocator()

    def allocate(self, shape: Any, dtype: Any, order: str = "C") -> np.ndarray:
        """An uninitialized array of ``shape``/``dtype``/``order`` whose ``.base`` is a
        :class:`PooledHostAllocation`.

        :raises ValueError: a negative dimension, an object dtype or an order other than
            "C"/"F".
        """
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ValueError("a page-locked pool cannot hold Python objects")
        if order not in ("C", "F"):
            raise ValueError(f"order must be 'C' or 'F', got {order!r}")
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(
            int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"negative dimensions are not allowed: {dims}")
        nbytes = dtype.itemsize * math.prod(dims)
        bin_nr, block = self._take(nbytes)
        holder = PooledHostAllocation(self, block, nbytes, bin_nr, dims, dtype, order)
        return np.asarray(holder)

    __call__ = allocate

    def _allocate_block(self, nbytes: int) -> np.ndarray:
        block = self._allocator(nbytes)
        if not isinstance(block, np.ndarray) or block.nbytes < nbytes or not (
                block.flags.c_contiguous):
            raise TypeError(f"the allocator of a PageLockedMemoryPool must return a contiguous "
                            f"numpy array of at least {nbytes} bytes, got {block!r:.80}")
        return block


# ---------------------------------------------------------------------------------------------
# Contexts and devices

def _device_from_environment() -> Optional[int]:
    for variable in ("GPURPC_DEVICE", "CUDA_DEVICE"):
        value = os.environ.get(variable)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise TypeError(f"${variable} must be an integer device number, got "
                                f"{value!r}") from None
    home = os.environ.get("HOME")
    if home:
        path = os.path.join(home, ".cuda_device")
        if os.path.isfile(path):
            with open(path) as f:
                text = f.read().strip()
            try:
                return int(text)
            except ValueError:
                raise TypeError(f"{path} must hold an integer device number, got "
                                f"{text!r}") from None
    return None


def make_default_context(ctx_maker: Optional[Callable[[_drv.Device], _drv.Context]] = None,
                         ) -> _drv.Context:
    """Opens a context with ``ctx_maker`` (default: ``dev.make_context()``) on the device
    named by ``$GPURPC_DEVICE``, ``$CUDA_DEVICE`` or ``~/.cuda_device``; else places it
    (:func:`gpurpc.driver.pick_device`): on the device with the most free memory (in 256 MiB
    steps), then the fewest sessions, then the first, over every daemon of the connection,
    passing on to the next device when ``ctx_maker`` fails with UNAVAILABLE,
    RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (any other error is raised at once).

    :raises RuntimeError: the daemon serves no device, no daemon answered or can take a
        session, or every device failed (the last error's class, naming each device tried).
    """
    if ctx_maker is None:
        def ctx_maker(dev: _drv.Device) -> _drv.Context:
            return dev.make_context()
    _drv.init()
    client = _devices._client()
    if not client.multi_daemon and not client.list_devices().devices:
        raise _drv.RuntimeError("make_default_context(): the daemon serves no device")
    chosen = _device_from_environment()
    if chosen is not None:
        return ctx_maker(_drv.Device(chosen))
    return _devices._place(ctx_maker, "make_default_context()")


def get_default_device(default: int = 0) -> _drv.Device:
    """Deprecated (as in PyCUDA): the device :func:`make_default_context` would pick by the
    environment, else ``default``."""
    warnings.warn("get_default_device() is deprecated; use make_default_context() instead",
                  DeprecationWarning, stacklevel=2)
    chosen = _device_from_environment()
    return _drv.Device(default if chosen is None else chosen)


def _int_ceiling(value: float, multiple_of: int = 1) -> int:
    return int(math.ceil(value / multiple_of)) * multiple_of


def _int_floor(value: float, multiple_of: int = 1) -> int:
    return int(math.floor(value / multiple_of)) * multiple_of


def _attribute(dev: _drv.Device, attr: Any, default: int) -> int:
    try:
        value = dev.get_attribute(attr)
    except LogicError:
        return default
    return int(value) if value else default


class DeviceData:
    """Launch-shaping facts of a device (``pycuda.tools.DeviceData``); ``dev`` defaults to the
    current context's device.

    ``max_threads``, ``warp_size``, ``warps_per_mp``, ``thread_blocks_per_mp``, ``registers``
    (per block), ``shared_memory`` (per block), ``smem_granularity`` (threads of one banked
    access), ``smem_alloc_granularity`` (smallest shared allocation) and
    ``register_allocation_unit`` ("warp" or "block").
    """

    def __init__(self, dev: Optional[_drv.Device] = None) -> None:
        if dev is None:
            dev = _drv.Context.get_device()
        attr = _drv.device_attribute
        cc = dev.compute_capability()
        self.max_threads = _attribute(dev, attr.MAX_THREADS_PER_BLOCK, 1024)
        self.warp_size = _attribute(dev, attr.WARP_SIZE, 32)
        if cc >= (3, 0):
            warps = 64
        elif cc >= (2, 0):
            warps = 48
        elif cc >= (1, 2):
            warps = 32
        else:
            warps = 24 if cc > (0, 0) else 64  # the fake backend reports 0.0
        threads_per_mp = _attribute(dev, attr.MAX_THREADS_PER_MULTIPROCESSOR, 0)
        self.warps_per_mp = threads_per_mp // self.warp_size if threads_per_mp else warps
        self.thread_blocks_per_mp = _attribute(dev, attr.MAX_BLOCKS_PER_MULTIPROCESSOR, 8)
        self.registers = _attribute(dev, attr.MAX_REGISTERS_PER_BLOCK, 65536)
        self.shared_memory = _attribute(dev, attr.MAX_SHARED_MEMORY_PER_BLOCK, 49152)
        old = (0, 0) < cc < (2, 0)
        self.smem_alloc_granularity = 512 if old else 128
        self.smem_granularity = 16 if old else 32
        self.register_allocation_unit = "block" if old else "warp"

    def align(self, bytes: int, word_size: int = 4) -> int:  # noqa: A002 - PyCUDA's name
        """``bytes`` rounded up to :meth:`align_bytes`."""
        return _int_ceiling(bytes, self.align_bytes(word_size))

    def align_dtype(self, elements: int, dtype_size: int) -> int:
        """``elements`` rounded up so that they span a multiple of :meth:`align_bytes`."""
        return _int_ceiling(elements, self.align_words(dtype_size))

    def align_words(self, word_size: int) -> int:
        """:meth:`align_bytes` in words of ``word_size`` bytes."""
        quotient, remainder = divmod(self.align_bytes(word_size), word_size)
        if remainder:
            raise ValueError(f"alignment is not a whole number of {word_size}-byte words")
        return quotient

    def align_bytes(self, word_size: int = 4) -> int:
        """The distance between base addresses that lets accesses of ``word_size`` bytes
        coalesce.

        :raises ValueError: ``word_size`` is not 4, 8 or 16.
        """
        if word_size == 4:
            return 64
        if word_size in (8, 16):
            return 128
        raise ValueError(f"no alignment possible for fetches of size {word_size}")

    def coalesce(self, thread_count: int) -> int:
        """``thread_count`` rounded up to a multiple of 16."""
        return _int_ceiling(thread_count, 16)

    @staticmethod
    def make_valid_tex_channel_count(size: int) -> int:
        """``size`` rounded up to a texture channel count (1, 2 or 4)."""
        for valid in (1, 2, 4):
            if size <= valid:
                return valid
        raise ValueError(f"could not enlarge {size} to a valid channel count (1, 2, 4)")


class OccupancyRecord:
    """Occupancy of a kernel of ``threads`` threads per block using ``shared_mem`` bytes of
    shared memory and ``registers`` registers per thread (``pycuda.tools.OccupancyRecord``).

    ``tb_per_mp`` (thread blocks per multiprocessor), ``limited_by`` (``"device"``,
    ``"warps"``, ``"regs"`` or ``"smem"``), ``warps_per_mp``, ``occupancy`` (0..1) and
    ``tb_per_mp_limits`` (every limit, as ``(blocks, reason)``).

    :raises ValueError: the block does not fit (too many threads, registers or shared memory).
    """

    def __init__(self, devdata: DeviceData, threads: int, shared_mem: int = 0,
                 registers: int = 0) -> None:
        if threads <= 0:
            raise ValueError(f"a block needs at least one thread, got {threads}")
        if threads > devdata.max_threads:
            raise ValueError(f"too many threads: {threads} > {devdata.max_threads} per block")
        alloc_warps = _int_ceiling(threads / devdata.warp_size)
        alloc_smem = _int_ceiling(shared_mem, devdata.smem_alloc_granularity)
        if devdata.register_allocation_unit == "warp":
            alloc_regs = alloc_warps * 32 * registers
        elif devdata.register_allocation_unit == "block":
            alloc_regs = _int_ceiling(alloc_warps * 2, 4) * 16 * registers
        else:
            raise ValueError("improper register allocation unit: "
                             f"{devdata.register_allocation_unit!r}")
        if alloc_regs > devdata.registers:
            raise ValueError(f"too many registers: {alloc_regs} > {devdata.registers} per block")
        if alloc_smem > devdata.shared_memory:
            raise ValueError(f"too much shared memory: {alloc_smem} > {devdata.shared_memory} "
                             "bytes per block")
        self.tb_per_mp_limits: List[Tuple[int, str]] = [
            (devdata.thread_blocks_per_mp, "device"),
            (_int_floor(devdata.warps_per_mp / alloc_warps), "warps"),
        ]
        if registers > 0:
            self.tb_per_mp_limits.append((_int_floor(devdata.registers / alloc_regs), "regs"))
        if shared_mem > 0:
            self.tb_per_mp_limits.append((_int_floor(devdata.shared_memory / alloc_smem), "smem"))
        self.tb_per_mp, self.limited_by = min(self.tb_per_mp_limits)
        self.warps_per_mp = self.tb_per_mp * alloc_warps
        self.occupancy = self.warps_per_mp / devdata.warps_per_mp

    def __repr__(self) -> str:
        return (f"<OccupancyRecord {self.tb_per_mp} blocks/MP limited by {self.limited_by}, "
                f"occupancy {self.occupancy:.2f}>")


# ---------------------------------------------------------------------------------------------
# pytest helpers

def _open_test_context() -> _drv.Context:
    _drv.init()
    ctx = make_default_context()
    device = ctx.get_device()
    assert isinstance(device.name(), str)
    assert isinstance(device.compute_capability(), tuple)
    assert isinstance(device.get_attributes(), dict)
    return ctx


def _close_test_context(ctx: _drv.Context) -> None:
    try:
        if _drv.Context.get_current() is ctx and _context._stack():
            _drv.Context.pop()
    finally:
        ctx.detach()  # a gpurpc context is a session: close it, as PyCUDA's pop destroys it
        clear_context_caches()
        gc.collect()


def mark_cuda_test(inner_f: Callable) -> Callable:
    """Decorates a test to run in a fresh context from :func:`make_default_context`, closed
    afterwards, and marks it ``cuda`` for pytest (as PyCUDA's)."""

    @functools.wraps(inner_f)
    def f(*args: Any, **kwargs: Any) -> Any:
        ctx = _open_test_context()
        try:
            return inner_f(*args, **kwargs)
        finally:
            _close_test_context(ctx)

    try:
        import pytest
    except ImportError:
        return f
    return pytest.mark.cuda(f)


def init_cuda_context_fixture() -> Iterator[None]:
    """A generator for a pytest fixture that gives each test a fresh context (PyCUDA's)::

        @pytest.fixture(autouse=True)
        def init_cuda_context():
            yield from init_cuda_context_fixture()
    """
    ctx = _open_test_context()
    try:
        yield
    finally:
        _close_test_context(ctx)
