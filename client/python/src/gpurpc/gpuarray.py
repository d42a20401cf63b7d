"""``pycuda.gpuarray``: a numpy-like array in the daemon's device memory.

Supported dtypes: bool, int8..int64, uint8..uint64, float32, float64, complex64 and
complex128 (``pycuda::complex<T>``, which is CUDA's ``cuda::std::complex<T>``), and the CUDA
vector types of :class:`vec` (``float3``, ``int4``, ...; these are moved, filled, taken and
concatenated, but have no arithmetic).

Arrays may be strided views: ``__getitem__`` takes integers, slices with any step (also
negative), ``...`` and ``numpy.newaxis`` per axis, as PyCUDA's does; ``transpose``/``T``,
``squeeze`` and ``view`` make views too. ``get``/``set``/``copy``/``fill`` and assignment work
on any view. Like PyCUDA, arithmetic, comparisons, ``astype``, reductions and the other
kernels need contiguous (C or Fortran) arrays and raise ``RuntimeError`` otherwise; ``reshape``
copies when the array is not contiguous in the requested order (as numpy does).

Operations: ``get``/``set`` (and ``_async``), ``to_gpu``, ``empty``, ``zeros``, ``ones``,
``*_like``, ``arange``, ``fill``, ``copy``, ``astype``, ``reshape``/``ravel``/``view``/
``squeeze``/``transpose``, ``+ - * / **`` and unary ``-``/``abs`` with arrays (also 0-d ones,
broadcast as scalars), and scalars (also in place), comparisons (like PyCUDA they return an
array of the left operand's dtype holding 1 or 0), ``real``/``imag``/``conj``, ``reverse``,
``take``/``multi_take``/``multi_put``/``multi_take_put``, ``concatenate``/``stack``,
``if_positive``/``where``, ``maximum``/``minimum``, ``logical_and``/``or``/``not``, and the
reductions ``sum``, ``dot``, ``max``, ``min``, ``any``, ``all`` and their ``subset_`` forms.

Each operation launches a kernel generated with :class:`~gpurpc.elementwise.ElementwiseKernel`
or :class:`~gpurpc.reduction.ReductionKernel`, compiled once per session and dtype. Launches
are asynchronous and batched, so chains of operations cost no round trip until ``get()``.
Temporaries come from a per-session memory pool, so they cost no allocation round trip
either. Result dtypes follow numpy's promotion rules (``np.result_type``).
"""
from __future__ import annotations

import builtins
import numbers
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np

from . import _context, _memory
from . import driver as _drv
from ._core import SessionCore
from .compiler import SourceModule
from .elementwise import COMPLEX_PREAMBLE, ElementwiseKernel, splay
from .reduction import (ReductionKernel, _neutral_max, _neutral_min, get_dot_kernel,
                        get_minmax_kernel, get_sum_kernel)
from .tools import _session_pool, dtype_to_ctype, get_or_register_dtype

__all__ = [
    "GPUArray", "vec", "to_gpu", "to_gpu_async", "empty", "zeros", "ones", "empty_like",
    "zeros_like", "ones_like", "arange", "take", "multi_take", "multi_put", "multi_take_put",
    "concatenate", "stack", "transpose", "reshape", "if_positive", "where", "maximum",
    "minimum", "sum", "subset_sum", "dot", "subset_dot", "max", "min", "subset_max",
    "subset_min", "any", "all", "logical_and", "logical_or", "logical_not", "conj", "splay",
]


# =============================================================================================
# vector types

class vec:  # noqa: N801 - PyCUDA's name
    """CUDA's vector types as numpy dtypes (``pycuda.gpuarray.vec``).

    ``vec.float3`` is ``np.dtype([("x", np.float32), ("y", ...), ("z", ...)])``, registered
    under its C name, so ``"float3 *p"``/``"float3 v"`` work in kernel argument lists and
    arrays of it move between host and device. ``vec.make_float3(x, y, z)`` returns a numpy
    structured scalar of that dtype (PyCUDA returns a 0-d array; both pass to kernels and
    ``fill`` alike). Types: ``char``, ``uchar``, ``short``, ``ushort``, ``int``, ``uint``,
    ``long``, ``ulong``, ``float`` with 1 to 4 components; ``longlong``, ``ulonglong`` and
    ``double`` with 1 or 2 (``long`` is 64 bits, as on the daemon's Linux host).
    """

    # Filled in by _create_vector_types() below; listed for type checkers and readers.
    _names: Tuple[str, ...] = ()


def _make_vector_maker(name: str, dtype: np.dtype, count: int) -> Callable[..., np.void]:
    fields = ["x", "y", "z", "w"][:count]

    def make(*args: Any, **kwargs: Any) -> np.void:
        if len(args) + len(kwargs) != count or builtins.any(k not in fields for k in kwargs):
            raise TypeError(f"make_{name}() takes the {count} components "
                            f"{', '.join(fields)}")
        values = dict(zip(fields, args))
        values.update(kwargs)
        return np.array(tuple(values[f] for f in fields), dtype=dtype)[()]

    make.__name__ = f"make_{name}"
    make.__doc__ = f"A ``{name}`` numpy scalar from its components {', '.join(fields)}."
    return make


def _create_vector_types() -> None:
    names = []
    for base_name, base_type, counts in [
        ("char", np.int8, (1, 2, 3, 4)), ("uchar", np.uint8, (1, 2, 3, 4)),
        ("short", np.int16, (1, 2, 3, 4)), ("ushort", np.uint16, (1, 2, 3, 4)),
        ("int", np.int32, (1, 2, 3, 4)), ("uint", np.uint32, (1, 2, 3, 4)),
        ("long", np.int64, (1, 2, 3, 4)), ("ulong", np.uint64, (1, 2, 3, 4)),
        ("longlong", np.int64, (1, 2)), ("ulonglong", np.uint64, (1, 2)),
        ("float", np.float32, (1, 2, 3, 4)), ("double", np.float64, (1, 2)),
    ]:
        for count in counts:
            name = f"{base_name}{count}"
            dtype = np.dtype([(f, base_type) for f in ("x", "y", "z", "w")[:count]])
            get_or_register_dtype(name, dtype)
            setattr(vec, name, dtype)
            setattr(vec, "make_" + name, staticmethod(_make_vector_maker(name, dtype, count)))
            names.append(name)
    vec._names = tuple(names)


_create_vector_types()


# =============================================================================================
# helpers

def _default_allocator(core: Optional[SessionCore] = None) -> Callable[[int], Any]:
    """The session's GPUArray pool's ``allocate`` (``core``: the current session, when the
    caller has it already)."""
    return _session_pool(core or _context._current_core("gpuarray")).allocate


def _kernel(key: Tuple, build: Callable[[], Any]) -> Any:
    """Memoizes generated kernels per session."""
    core = _context._current_core("gpuarray")
    cache = core.caches.setdefault("gpuarray_kernels", {})
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = build()
    return kernel


class _Flags:
    """Read-only, as numpy's contiguity flags are: arrays of one dense layout share one."""

    __slots__ = ("c_contiguous", "f_contiguous", "forc")

    def __init__(self, c: bool, f: bool) -> None:
        object.__setattr__(self, "c_contiguous", c)
        object.__setattr__(self, "f_contiguous", f)
        object.__setattr__(self, "forc", c or f)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"GPUArray flags are read-only ({name})")

    def __repr__(self) -> str:
        return (f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}")


def _c_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    strides = []
    acc = itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= builtins.max(n, 1)
    return tuple(reversed(strides))


def _f_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    strides = []
    acc = itemsize
    for n in shape:
        strides.append(acc)
        acc *= builtins.max(n, 1)
    return tuple(strides)


_DENSE_LAYOUTS: Dict[Tuple[Tuple[int, ...], int, str], Tuple[Tuple[int, ...], "_Flags"]] = {}


def _dense_layout(shape: Tuple[int, ...], itemsize: int,
                  order: str) -> Tuple[Tuple[int, ...], "_Flags"]:
    """The strides and flags of a new dense array (memoized: a program makes arrays of few
    shapes, and every operator makes one). The flags object is shared: it is never changed."""
    key = (shape, itemsize, order)
    layout = _DENSE_LAYOUTS.get(key)
    if layout is None:
        strides = (_f_strides if order == "F" else _c_strides)(shape, itemsize)
        layout = (strides, _Flags(_is_contiguous(shape, strides, itemsize, False),
                                  _is_contiguous(shape, strides, itemsize, True)))
        if len(_DENSE_LAYOUTS) >= 4096:
            _DENSE_LAYOUTS.clear()
        _DENSE_LAYOUTS[key] = layout
    return layout


def _is_contiguous(shape: Tuple[int, ...], strides: Tuple[int, ...], itemsize: int,
                   fortran: bool) -> bool:
    """numpy's rule: no gaps in the given order; axes of length 1 may have any stride."""
    if 0 in shape:
        return True
    expected = itemsize
    axes = range(len(shape)) if fortran else range(len(shape) - 1, -1, -1)
    for axis in axes:
        n = shape[axis]
        if n != 1:
            if strides[axis] != expected:
                return False
            expected *= n
    return True


def _extent(shape: Tuple[int, ...], strides: Tuple[int, ...], itemsize: int) -> Tuple[int, int]:
    """Byte offsets ``[lo, hi)`` (relative to the first element) that a view touches."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def _normalize_shape(shape: Any) -> Tuple[int, ...]:
    if isinstance(shape, np.ndarray) and shape.ndim == 0:
        shape = shape.item()
    if isinstance(shape, (numbers.Integral, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


# numpy 2 promotes a Python scalar by its type, not its value (NEP 50); numpy 1 looked at the
# value (np.float32 array * 1e300 gave float64), so there nothing is memoized by type.
_TYPE_ONLY_PROMOTION = int(np.__version__.split(".")[0]) >= 2


def _session_memo(name: str, core: Optional[SessionCore] = None) -> Dict[Tuple, Any]:
    caches = (core or _context._current_core("gpuarray")).caches
    memo = caches.get(name)
    if memo is None:
        memo = caches[name] = {}
    return memo


def _scalar_plans(core: SessionCore) -> Dict[Tuple, List[Any]]:
    """The session's memo of [result type, scalar's type, kernel or None until the first
    launch] per array-scalar operation."""
    return _session_memo("gpuarray_scalar_plans", core)


def _binary_plans(core: SessionCore) -> Dict[Tuple, List[Any]]:
    """The session's memo of [result type, kernel or None until the first launch] per
    array-array operation (array dtypes promote by type under numpy 1 and 2 alike)."""
    return _session_memo("gpuarray_binary_plans", core)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.void)


def _scalar_type(dtype: np.dtype, value: Any) -> Any:
    if dtype.kind == "V":  # a struct (vector type): a structured numpy scalar
        return np.array(value, dtype=dtype)[()]
    if dtype.kind != "c" and isinstance(value, (complex, np.complexfloating)):
        raise TypeError(f"cannot pass the complex value {value!r} as {dtype}")
    return dtype.type(value)


def _contiguity_error(what: str) -> RuntimeError:
    return RuntimeError(f"only contiguous arrays may be used as arguments to this operation "
                        f"({what}); make a contiguous copy with .copy() first")


def _require_forc_all(what: str, *arrays: Any) -> None:
    for a in arrays:
        if not a.flags.forc:
            raise _contiguity_error(what)


def _require_arithmetic(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in "biufc":
        raise TypeError(f"{what} is not defined for arrays of dtype {dtype} (only bool, "
                        "integer, floating and complex arrays have arithmetic)")


def _complex_preamble(*dtypes: np.dtype) -> str:
    return COMPLEX_PREAMBLE if builtins.any(d.kind == "c" for d in dtypes) else ""


def _real_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype == np.complex64 else np.dtype(np.float64)


def _launch_shape(n: int) -> Tuple[Tuple[int, int], Tuple[int, int, int]]:
    return splay(builtins.max(int(n), 1))


_WORD_TYPES = {8: "unsigned long long", 4: "unsigned int", 2: "unsigned short",
               1: "unsigned char"}


def _strided_copy_kernel(word: int, words: int, ndim: int) -> _drv.Function:
    """A kernel copying n elements of ``words`` words of ``word`` bytes between two strided
    layouts of the same shape (strides in bytes; a source stride of 0 repeats a value)."""
    def build() -> _drv.Function:
        t = _WORD_TYPES[word]
        params = ["char *dst", "const char *src", "unsigned long long n"]
        params += [f"unsigned long long n{d}" for d in range(ndim)]
        params += [f"long long ss{d}" for d in range(ndim)]
        params += [f"long long ds{d}" for d in range(ndim)]
        index = "".join(
            f"    k = rem % n{d}; rem /= n{d}; so += (long long)k * ss{d}; "
            f"dof += (long long)k * ds{d};\n" for d in range(ndim - 1, -1, -1))
        source = f"""
extern "C" __global__ void gpurpc_strided_copy({", ".join(params)})
{{
  unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
       i < n; i += step)
  {{
    unsigned long long rem = i, k = 0;
    long long so = 0, dof = 0;
{index}    (void)rem; (void)k;
    const {t} *s = (const {t} *)(src + so);
    {t} *d = ({t} *)(dst + dof);
    for (int w = 0; w < {words}; ++w)
      d[w] = s[w];
  }}
}}
"""
        func = SourceModule(source, no_extern_c=True).get_function("gpurpc_strided_copy")
        return func.prepare("PPQ" + "Q" * ndim + "q" * (2 * ndim))
    return _kernel(("strided_copy", word, words, ndim), build)


def _copy_layout(dst_ptr: int, dst_strides: Tuple[int, ...], src_ptr: int,
                 src_strides: Tuple[int, ...], shape: Tuple[int, ...], itemsize: int,
                 stream: Optional[_drv.Stream]) -> None:
    """Copies the elements of a strided source layout into a strided destination layout."""
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return
    # Axes of length 1 contribute nothing to an address.
    kept = [(s, a, b) for s, a, b in zip(shape, src_strides, dst_strides) if s != 1]
    word = 8
    for value in [itemsize, src_ptr, dst_ptr] + [a for _, a, _ in kept] + \
            [b for _, _, b in kept]:
        while word > 1 and value % word:
            word //= 2
    func = _strided_copy_kernel(word, itemsize // word, len(kept))
    grid, block = _launch_shape(n)
    func.prepared_async_call(grid, block, stream, dst_ptr, src_ptr, n,
                             *[s for s, _, _ in kept], *[a for _, a, _ in kept],
                             *[b for _, _, b in kept])


class GPUArray:
    """An n-dimensional array in device memory (``pycuda.gpuarray.GPUArray``).

    ``gpudata`` is the device memory (a DeviceAllocation, a pool block, or an int address
    for views); ``int(a.gpudata)`` is its address. ``strides`` may describe any view
    (gaps, negative steps, transposed axes); see the module docstring for what needs a
    contiguous array.
    """

    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any, allocator: Optional[Callable[[int], Any]] = None,
                 base: Any = None, gpudata: Any = None, strides: Any = None,
                 order: Literal["C", "F"] = "C") -> None:
        self.shape: Tuple[int, ...] = _normalize_shape(shape)
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise TypeError("GPUArray cannot hold Python objects")
        if builtins.any(n < 0 for n in self.shape):
            raise ValueError(f"negative dimensions are not allowed: {self.shape}")
        if order not in ("C", "F"):
            raise ValueError(f"invalid order: {order!r} (must be 'C' or 'F')")
        size = 1
        for n in self.shape:
            size *= n
        self.size = int(size)
        itemsize = self.dtype.itemsize
        if strides is None:
            self.strides, self._flags = _dense_layout(self.shape, itemsize, order)
        else:
            strides = tuple(int(s) for s in strides)
            if len(strides) != len(self.shape):
                raise ValueError(f"strides {strides} do not match shape {self.shape}")
            self.strides = strides
            # Shape and strides never change after construction (views are new arrays): the
            # flags are computed once, not on every kernel call that checks contiguity.
            self._flags = _Flags(_is_contiguous(self.shape, strides, itemsize, False),
                                 _is_contiguous(self.shape, strides, itemsize, True))
        self.allocator = allocator
        if gpudata is None:
            if self.size:
                if base is not None:
                    raise ValueError("a view (base given) needs gpudata")
                gpudata = (allocator or _default_allocator())(self.nbytes)
        self.gpudata = gpudata
        self.base = base

    @property
    def _grid(self) -> Tuple[int, int]:
        return splay(builtins.max(self.size, 1))[0]

    @property
    def _block(self) -> Tuple[int, int, int]:
        return splay(builtins.max(self.size, 1))[1]

    # -- properties ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def mem_size(self) -> int:
        return self.size

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def ptr(self) -> int:
        """The device address (0 for an empty array)."""
        return 0 if self.gpudata is None else _memory._address(self.gpudata)

    @property
    def flags(self) -> _Flags:
        return self._flags

    @property
    def __cuda_array_interface__(self) -> dict:
        """The CUDA Array Interface (version 3) of this array: ``shape``, ``typestr``,
        ``data`` = ``(address, False)`` (read-write), ``strides`` (None when C-contiguous, as
        the interface specifies) and ``version``.

        The address is a device address in the daemon's worker process of this array's
        session, not in this process: it is valid only as an argument of gpurpc kernels and
        copies of the same session (``Function.__call__``/``prepared_call`` accept any object
        exposing this interface and check that its memory belongs to the kernel's session).
        Local CUDA libraries (CuPy, Numba, PyTorch) cannot use it.
        """
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None if self.flags.c_contiguous else self.strides,
            "version": 3,
        }

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def _scalar(self, kind: str) -> Any:
        # As numpy: only an array of one element converts, with one download.
        if self.size != 1:
            raise TypeError(f"only arrays of one element can be converted to Python scalars "
                            f"({kind}() of a GPUArray of shape {self.shape})")
        return self.get().reshape(())[()]

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __complex__(self) -> complex:
        return complex(self._scalar("complex"))

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self.get().reshape(())[()])

    def __repr__(self) -> str:
        return repr(self.get())

    def __str__(self) -> str:
        return str(self.get())

    __hash__ = None  # type: ignore[assignment]

    # -- transfers ----------------------------------------------------------------------

    def _check_host(self, ary: Any) -> np.ndarray:
        ary = np.asarray(ary)
        if ary.size != self.size:
            raise ValueError(f"array size mismatch: device {self.shape}, host {ary.shape}")
        if ary.dtype != self.dtype:
            raise ValueError(f"array dtype mismatch: device {self.dtype}, host {ary.dtype}")
        return ary

    def set(self, ary: Any, async_: bool = False, stream: Optional[_drv.Stream] = None,
            **kwargs: Any) -> None:
        """Copies a host array (same size and dtype) into this array (also into a strided
        view: the data goes to a contiguous temporary, then a kernel scatters it)."""
        async_ = async_ or kwargs.pop("async", False)
        if kwargs:
            raise TypeError("unexpected keyword arguments: " + ", ".join(kwargs))
        ary = self._check_host(ary)
        if self.size == 0:
            return
        if not self.flags.forc:
            staging = GPUArray(self.shape, self.dtype, allocator=self.allocator)
            staging.set(ary.reshape(self.shape), async_=async_, stream=stream)
            _copy_layout(self.ptr, self.strides, staging.ptr, staging.strides, self.shape,
                         self.itemsize, stream)
            return
        if self.flags.c_contiguous:
            ary = np.ascontiguousarray(ary).reshape(self.shape)
        else:
            ary = np.asfortranarray(ary.reshape(self.shape))
        if async_:
            _drv.memcpy_htod_async(self.gpudata, ary, stream)
        else:
            _drv.memcpy_htod(self.gpudata, ary)

    def set_async(self, ary: Any, stream: Optional[_drv.Stream] = None) -> None:
        """Queues ``set`` on ``stream``."""
        self.set(ary, async_=True, stream=stream)

    def get(self, ary: Optional[np.ndarray] = None, pagelocked: bool = False,
            async_: bool = False, stream: Optional[_drv.Stream] = None,
            **kwargs: Any) -> np.ndarray:
        """Copies the array to the host (into ``ary`` if given) and returns it.

        A strided view downloads the bytes it spans when they are at most four times its
        size (or 1 MiB), else a kernel gathers it into a contiguous temporary first; either
        way the copy of a strided view completes before ``get`` returns, also with
        ``async_``.
        """
        async_ = async_ or kwargs.pop("async", False)
        if kwargs:
            raise TypeError("unexpected keyword arguments: " + ", ".join(kwargs))
        if ary is None:
            order: Literal["C", "F"] = "F" if self._fortran_only() else "C"
            if pagelocked:  # region-backed on the daemon's host (see gpurpc._regions)
                ary = _drv.pagelocked_empty(self.shape, self.dtype, order=order)
            else:
                ary = np.empty(self.shape, self.dtype, order=order)
        else:
            if ary.size != self.size or ary.dtype != self.dtype:
                raise TypeError("'ary' has non-matching size or dtype")
        if self.size == 0:
            return ary
        if not self.flags.forc:
            self._get_strided(ary, stream)
            return ary
        if async_:
            _drv.memcpy_dtoh_async(ary, self.gpudata, stream)
        else:
            _drv.memcpy_dtoh(ary, self.gpudata)
        return ary

    def _get_strided(self, ary: np.ndarray, stream: Optional[_drv.Stream]) -> None:
        lo, hi = _extent(self.shape, self.strides, self.itemsize)
        span = hi - lo
        if span <= builtins.max(4 * self.nbytes, 1 << 20):
            if stream is not None:
                stream.synchronize()
            raw = np.empty(span, np.uint8)
            _drv.memcpy_dtoh(raw, self.ptr + lo)
            host = np.ndarray(self.shape, self.dtype, buffer=raw, offset=-lo,
                              strides=self.strides)
        else:
            contiguous = self.copy(stream=stream)
            if stream is not None:
                stream.synchronize()
            host = contiguous.get()
        target = ary if ary.shape == self.shape else ary.reshape(self.shape)
        target[...] = host

    def get_async(self, stream: Optional[_drv.Stream] = None,
                  ary: Optional[np.ndarray] = None) -> np.ndarray:
        """Queues a copy to the host; the array is filled when ``stream`` is synchronised."""
        return self.get(ary=ary, async_=True, stream=stream)

    def copy(self, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """A new array with the same contents (a device-to-device copy; a strided view
        becomes a C-contiguous array)."""
        new = self._new_like_me()
        if self.size:
            if self.flags.forc:
                _drv.memcpy_dtod_async(new.gpudata, self.gpudata, self.nbytes, stream)
            else:
                _copy_layout(new.ptr, new.strides, self.ptr, self.strides, self.shape,
                             self.itemsize, stream)
        return new

    def _fortran_only(self) -> bool:
        flags = self.flags
        return flags.f_contiguous and not flags.c_contiguous

    def _new_like_me(self, dtype: Any = None, order: Optional[str] = None,
                     core: Optional[SessionCore] = None) -> "GPUArray":
        """An uninitialised array of this shape (``core``: the current session, when the
        caller has it already)."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if order is None:
            order = "F" if self._fortran_only() else "C"
        if not self.size or dtype.hasobject or order not in ("C", "F"):
            return GPUArray(self.shape, dtype, allocator=self.allocator,
                            order=order)  # type: ignore[arg-type]
        # The result of every operator: this array's shape is already checked, so the new one
        # skips __init__'s validation (a third of an elementwise expression's client time).
        new = GPUArray.__new__(GPUArray)
        new.shape = self.shape
        new.dtype = dtype
        new.size = self.size
        new.strides, new._flags = _dense_layout(self.shape, dtype.itemsize, order)
        new.allocator = allocator = self.allocator
        new.gpudata = (allocator or _default_allocator(core))(self.size * dtype.itemsize)
        new.base = None
        return new

    def _require_forc(self, what: str) -> None:
        if not self.flags.forc:
            raise _contiguity_error(what)

    # -- fill / astype ------------------------------------------------------------------

    def fill(self, value: Any, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """Sets every element to ``value``; returns self (also for a strided view)."""
        if self.size == 0:
            return self
        if self.dtype.kind != "c" and isinstance(value, (complex, np.complexfloating)):
            raise TypeError(f"cannot fill an array of {self.dtype} with the complex value "
                            f"{value!r}")
        raw = np.array(value, dtype=self.dtype).tobytes()
        if not self.flags.forc:
            one = GPUArray((), self.dtype, allocator=self.allocator)
            _drv.memcpy_htod_async(one.gpudata, np.frombuffer(raw, np.uint8), stream)
            _copy_layout(self.ptr, self.strides, one.ptr, (0,) * self.ndim, self.shape,
                         self.itemsize, stream)
            return self
        size = self.dtype.itemsize
        if size == 1:
            _drv.memset_d8_async(self.gpudata, raw[0], self.size, stream)
        elif size == 2:
            _drv.memset_d16_async(self.gpudata, int.from_bytes(raw, "little"), self.size, stream)
        elif size == 4:
            _drv.memset_d32_async(self.gpudata, int.from_bytes(raw, "little"), self.size, stream)
        elif size % 4 == 0 and raw == raw[:4] * (size // 4):
            _drv.memset_d32_async(self.gpudata, int.from_bytes(raw[:4], "little"),
                                  self.size * (size // 4), stream)
        else:
            _fill_kernel(self.dtype)(self, _scalar_type(self.dtype, value), stream=stream)
        return self

    def astype(self, dtype: Any, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """A copy converted to ``dtype`` (a plain copy if it is the same)."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self.copy(stream=stream)
        self._require_forc("astype")
        if self.dtype.kind == "V" or dtype.kind == "V":
            raise TypeError(f"astype cannot convert between {self.dtype} and {dtype} (struct "
                            "dtypes only convert to themselves; use view())")
        result = self._new_like_me(dtype)
        if self.size:
            _convert_kernel(self.dtype, dtype)(self, result, stream=stream)
        return result

    # -- shape --------------------------------------------------------------------------

    def reshape(self, *shape: Any, order: Literal["C", "F"] = "C") -> "GPUArray":
        """An array with a new shape (one dimension may be -1), read and placed in ``order``.

        A view when the array is contiguous in ``order`` (or has at most one dimension
        longer than 1), else, as numpy does, a copy.
        """
        if len(shape) == 1 and not isinstance(shape[0], (numbers.Integral, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if order not in ("C", "F"):
            raise ValueError("order must be 'C' or 'F'")
        if shape.count(-1) > 1:
            raise ValueError("can only specify one unknown dimension")
        if builtins.any(s < -1 for s in shape):
            raise ValueError(f"invalid shape {shape}")
        if -1 in shape:
            known = 1
            for s in shape:
                if s != -1:
                    known *= s
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape array of size {self.size} into shape "
                                 f"{shape}")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        total = 1
        for s in shape:
            total *= s
        if total != self.size:
            raise ValueError(f"cannot reshape array of size {self.size} into shape {shape}")
        flags = self.flags
        source = self
        if not (flags.c_contiguous if order == "C" else flags.f_contiguous):
            # Elements in `order` are not consecutive in memory: lay them out that way first.
            source = self._new_like_me(order=order)
            if self.size:
                _copy_layout(source.ptr, source.strides, self.ptr, self.strides, self.shape,
                             self.itemsize, None)
        return GPUArray(shape, self.dtype, allocator=self.allocator, base=source,
                        gpudata=source.gpudata, order=order)

    def ravel(self) -> "GPUArray":
        """A 1-d array of the elements in C order (a view when possible)."""
        return self.reshape(self.size)

    def view(self, dtype: Any = None) -> "GPUArray":
        """A view of the same memory, optionally as another dtype: with another item size,
        the axis of stride ``itemsize`` changes length (the last one of a C array)."""
        if dtype is None:
            dtype = self.dtype
        dtype = np.dtype(dtype)
        old = self.dtype.itemsize
        if dtype.itemsize == old:
            return GPUArray(self.shape, dtype, allocator=self.allocator, base=self,
                            gpudata=self.gpudata, strides=self.strides)
        if not self.shape:
            raise ValueError("changing the dtype of a 0-d array needs the same item size")
        if self.flags.c_contiguous:
            axis = self.ndim - 1
        elif self.flags.f_contiguous:
            axis = 0
        else:
            candidates = [a for a in range(self.ndim) if self.strides[a] == old]
            if not candidates:
                raise ValueError("to change to a dtype of a different size, the array must be "
                                 "contiguous along one axis")
            axis = candidates[-1]
        if (self.shape[axis] * old) % dtype.itemsize:
            raise ValueError(f"new dtype {dtype} does not divide axis {axis} of length "
                             f"{self.shape[axis]} x {old} bytes")
        shape = list(self.shape)
        strides = list(self.strides)
        shape[axis] = self.shape[axis] * old // dtype.itemsize
        strides[axis] = dtype.itemsize
        return GPUArray(tuple(shape), dtype, allocator=self.allocator, base=self,
                        gpudata=self.gpudata, strides=tuple(strides))

    def squeeze(self, axis: Any = None) -> "GPUArray":
        """A view without the axes of length 1 (or only those in ``axis``)."""
        if axis is None:
            drop = {a for a, n in enumerate(self.shape) if n == 1}
        else:
            axes = (axis,) if isinstance(axis, (numbers.Integral, np.integer)) else axis
            drop = set()
            for a in axes:
                a = int(a)
                if not -self.ndim <= a < self.ndim:
                    raise ValueError(f"axis {a} is out of bounds for an array of dimension "
                                     f"{self.ndim}")
                a %= self.ndim
                if self.shape[a] != 1:
                    raise ValueError("cannot select an axis to squeeze out which has size "
                                     "not equal to one")
                drop.add(a)
        keep = [a for a in range(self.ndim) if a not in drop]
        return self._strided_view(0, tuple(self.shape[a] for a in keep),
                                  tuple(self.strides[a] for a in keep))

    def transpose(self, axes: Any = None) -> "GPUArray":
        """A view with the axes permuted (reversed by default)."""
        if axes is None:
            axes = tuple(range(self.ndim - 1, -1, -1))
        else:
            axes = tuple(int(a) % self.ndim if self.ndim else int(a) for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} don't match an array of {self.ndim} dimensions")
        return self._strided_view(0, tuple(self.shape[a] for a in axes),
                                  tuple(self.strides[a] for a in axes))

    @property
    def T(self) -> "GPUArray":  # noqa: N802 - numpy's name
        """``transpose()``."""
        return self.transpose()

    def _offset_view(self, offset_elems: int, shape: Tuple[int, ...]) -> "GPUArray":
        return self._strided_view(offset_elems * self.itemsize, shape,
                                  _c_strides(shape, self.itemsize))

    def _strided_view(self, offset_bytes: int, shape: Tuple[int, ...],
                      strides: Tuple[int, ...]) -> "GPUArray":
        size = 1
        for s in shape:
            size *= s
        gpudata = None
        if size and self.gpudata is not None:
            gpudata = _memory._address(self.gpudata) + offset_bytes
            if offset_bytes == 0 and shape == self.shape and strides == self.strides:
                gpudata = self.gpudata
        return GPUArray(shape, self.dtype, allocator=self.allocator, base=self, gpudata=gpudata,
                        strides=strides)

    def __getitem__(self, index: Any) -> "GPUArray":
        """A view: per axis an integer, a slice (any step), ``...`` or ``numpy.newaxis``."""
        if not isinstance(index, tuple):
            index = (index,)
        if builtins.sum(1 for e in index if e is Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        consumed = builtins.sum(1 for e in index if e is not Ellipsis and e is not None)
        if consumed > self.ndim:
            raise IndexError(f"too many indices for array: array is {self.ndim}-dimensional, "
                             f"but {consumed} were indexed")
        shape: List[int] = []
        strides: List[int] = []
        offset = 0
        axis = 0
        for entry in index:
            if entry is Ellipsis:
                for _ in range(self.ndim - consumed):
                    shape.append(self.shape[axis])
                    strides.append(self.strides[axis])
                    axis += 1
            elif entry is None:
                shape.append(1)
                strides.append(0)
            elif isinstance(entry, slice):
                start, stop, step = entry.indices(self.shape[axis])
                shape.append(len(range(start, stop, step)))
                strides.append(step * self.strides[axis])
                offset += start * self.strides[axis]
                axis += 1
            elif isinstance(entry, (numbers.Integral, np.integer)) and \
                    not isinstance(entry, (bool, np.bool_)):
                i = int(entry)
                n = self.shape[axis]
                if i < 0:
                    i += n
                if not 0 <= i < n:
                    raise IndexError(f"index {int(entry)} is out of bounds for axis {axis} "
                                     f"with size {n}")
                offset += i * self.strides[axis]
                axis += 1
            else:
                raise IndexError(f"unsupported index {entry!r} for axis {axis}: GPUArray "
                                 "takes integers, slices, '...' and numpy.newaxis (use take() "
                                 "to gather by an index array)")
        shape.extend(self.shape[axis:])
        strides.extend(self.strides[axis:])
        return self._strided_view(offset, tuple(shape), tuple(strides))

    def __setitem__(self, index: Any, value: Any) -> None:
        target = self[index]
        if isinstance(value, GPUArray):
            if value.dtype != target.dtype:
                value = value.astype(target.dtype)
            if value.size != target.size:
                raise ValueError(f"could not assign an array of shape {value.shape} to a "
                                 f"selection of shape {target.shape}")
            if not target.size:
                return
            _copy_into(target, value)
        elif _is_scalar(value) or isinstance(value, np.void):
            target.fill(value)
        else:
            target.set(np.broadcast_to(np.asarray(value, dtype=target.dtype), target.shape))

    # -- arithmetic ---------------------------------------------------------------------

    def _check_other(self, other: "GPUArray") -> None:
        if other.shape != self.shape and other.size != self.size:
            raise ValueError(f"operands could not be combined: shapes {self.shape} and "
                             f"{other.shape}")
        if not (self.flags.forc and other.flags.forc):
            raise RuntimeError("only contiguous arrays may be used as arguments to this operation")
        if self.ndim > 1 and other.ndim > 1 and self.shape == other.shape and (
                self._fortran_only() != other._fortran_only()):
            raise ValueError("operands are contiguous in different orders (C and Fortran): "
                             "make a copy in one order first (reshape(..., order=...))")

    def _binary(self, other: Any, op: str, reverse: bool = False,
                out_dtype: Any = None) -> "GPUArray":
        _require_arithmetic(self.dtype, f"operator {op}")
        if isinstance(other, GPUArray):
            _require_arithmetic(other.dtype, f"operator {op}")
            # A 0-d array combines with any array as a scalar would (PyCUDA does so too).
            x_scalar = self.shape == () and other.shape != ()
            y_scalar = other.shape == () and self.shape != ()
            if not (x_scalar or y_scalar):
                self._check_other(other)
            elif not (self.flags.forc and other.flags.forc):
                raise _contiguity_error(f"operator {op}")
            x, y = (other, self) if reverse else (self, other)
            xs, ys = (y_scalar, x_scalar) if reverse else (x_scalar, y_scalar)
            key = (x.dtype, y.dtype, op, xs, ys, out_dtype)
            core = _context._current_core("gpuarray")
            plans = _binary_plans(core)
            plan = plans.get(key)
            if plan is None:  # as for scalars: decided once per types and session
                _check_complex_op(op, self.dtype, other.dtype)
                dtype = np.dtype(out_dtype) if out_dtype is not None else _result_dtype(
                    self.dtype, other.dtype, op)
                plan = plans[key] = [dtype, None]  # the kernel: made by the first launch
            dtype = plan[0]
            result = (other if x_scalar else self)._new_like_me(dtype, core=core)
            if result.size:
                kernel = plan[1]
                if kernel is None:
                    kernel = plan[1] = _binary_kernel(op, x.dtype, y.dtype, dtype, xs, ys)
                # Both contiguous (checked above): kernel(x, y, result), or with a 0-d
                # operand kernel(result, x, y), launched without __call__'s checks.
                if xs or ys:
                    kernel._launch_dense(core, result.size, result.gpudata, x.gpudata,
                                         y.gpudata)
                else:
                    kernel._launch_dense(core, result.size, x.gpudata, y.gpudata,
                                         result.gpudata)
            return result
        if _is_scalar(other):
            if not self._flags.forc:
                raise _contiguity_error(f"operator {op}")
            # The types and the kernel depend on the scalar's type alone (numpy 2's rule,
            # NEP 50), so they are looked up once per (dtypes, scalar type, operator) and
            # session: `a * 2 + 1` in a loop spends its time launching, not deciding.
            key = (self.dtype, type(other), op, reverse, out_dtype)
            core = _context._current_core("gpuarray")
            plans = _scalar_plans(core)
            plan = plans.get(key)
            if plan is None:
                dtype = np.dtype(out_dtype) if out_dtype is not None else _result_dtype(
                    self.dtype, other, op)
                compute = _compute_dtype(self.dtype, dtype, other, op)
                _check_complex_op(op, self.dtype, compute)
                plan = [dtype, compute, None]  # the kernel: made by the first launch
                if _TYPE_ONLY_PROMOTION:
                    plans[key] = plan
            dtype, compute, kernel = plan
            value = _scalar_type(compute, other)
            result = self._new_like_me(dtype, core=core)
            if self.size:
                if kernel is None:
                    kernel = plan[2] = _scalar_kernel(op, self.dtype, compute, dtype, reverse)
                # kernel(self, value, result), launched without __call__'s checks (self is
                # contiguous, checked above).
                kernel._launch_dense(core, self.size, self.gpudata, value, result.gpudata)
            return result
        return NotImplemented

    def _inplace(self, other: Any, op: str) -> "GPUArray":
        _require_arithmetic(self.dtype, f"operator {op}=")
        if isinstance(other, GPUArray):
            _require_arithmetic(other.dtype, f"operator {op}=")
            if other.shape == () and self.shape != ():
                if not (self.flags.forc and other.flags.forc):
                    raise _contiguity_error(f"operator {op}=")
                _check_inplace(op, self.dtype, _result_dtype(self.dtype, other.dtype, op))
                if self.size:
                    _inplace_kernel(op, self.dtype, other.dtype, y_scalar=True)(self, other)
                return self
            self._check_other(other)
            _check_inplace(op, self.dtype, _result_dtype(self.dtype, other.dtype, op))
            if self.size:
                _inplace_kernel(op, self.dtype, other.dtype)(self, other)
            return self
        if _is_scalar(other):
            self._require_forc(f"operator {op}=")
            compute = _compute_dtype(self.dtype, self.dtype, other, op)
            if isinstance(other, (complex, np.complexfloating)) and self.dtype.kind != "c":
                raise TypeError(f"cannot apply {op}= with a complex scalar to an array of "
                                f"{self.dtype} in place")
            if self.size:
                _inplace_scalar_kernel(op, self.dtype, compute)(
                    self, _scalar_type(compute, other))
            return self
        return NotImplemented

    def __add__(self, other: Any) -> "GPUArray":
        return self._binary(other, "+")

    __radd__ = __add__

    def __sub__(self, other: Any) -> "GPUArray":
        return self._binary(other, "-")

    def __rsub__(self, other: Any) -> "GPUArray":
        return self._binary(other, "-", reverse=True)

    def __mul__(self, other: Any) -> "GPUArray":
        return self._binary(other, "*")

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> "GPUArray":
        return self._binary(other, "/")

    def __rtruediv__(self, other: Any) -> "GPUArray":
        return self._binary(other, "/", reverse=True)

    __div__ = __truediv__
    __rdiv__ = __rtruediv__

    def __pow__(self, other: Any) -> "GPUArray":
        return self._binary(other, "**")

    def __rpow__(self, other: Any) -> "GPUArray":
        return self._binary(other, "**", reverse=True)

    def __iadd__(self, other: Any) -> "GPUArray":
        return self._inplace(other, "+")

    def __isub__(self, other: Any) -> "GPUArray":
        return self._inplace(other, "-")

    def __imul__(self, other: Any) -> "GPUArray":
        return self._inplace(other, "*")

    def __itruediv__(self, other: Any) -> "GPUArray":
        return self._inplace(other, "/")

    __idiv__ = __itruediv__

    def __ipow__(self, other: Any) -> "GPUArray":
        return self._inplace(other, "**")

    def __neg__(self) -> "GPUArray":
        _require_arithmetic(self.dtype, "negation")
        self._require_forc("negation")
        result = self._new_like_me()
        if self.size:
            _unary_kernel("neg", self.dtype)(self, result)
        return result

    def __abs__(self) -> "GPUArray":
        """Absolute values (of a complex array: its magnitudes, as real numbers)."""
        _require_arithmetic(self.dtype, "abs")
        self._require_forc("abs")
        if self.dtype.kind == "c":
            return _complex_part(self, "abs")
        result = self._new_like_me()
        if self.size:
            _unary_kernel("abs", self.dtype)(self, result)
        return result

    def __pos__(self) -> "GPUArray":
        return self

    def _compare(self, other: Any, op: str) -> "GPUArray":
        return self._binary(other, op, out_dtype=self.dtype)

    def __eq__(self, other: Any) -> "GPUArray":  # type: ignore[override]
        return self._compare(other, "==")

    def __ne__(self, other: Any) -> "GPUArray":  # type: ignore[override]
        return self._compare(other, "!=")

    def __lt__(self, other: Any) -> "GPUArray":
        return self._compare(other, "<")

    def __le__(self, other: Any) -> "GPUArray":
        return self._compare(other, "<=")

    def __gt__(self, other: Any) -> "GPUArray":
        return self._compare(other, ">")

    def __ge__(self, other: Any) -> "GPUArray":
        return self._compare(other, ">=")

    def mul_add(self, selffac: Any, other: "GPUArray", otherfac: Any,
                add_timer: Any = None, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """``selffac * self + otherfac * other``."""
        return self * selffac + other * otherfac

    def reverse(self, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """The elements in reversed order (the array is treated as one-dimensional)."""
        self._require_forc("reverse")
        result = self._new_like_me()
        if self.size:
            t = _ctype(self.dtype)
            _kernel(("reverse", self.dtype), lambda: ElementwiseKernel(
                f"const {t} *x, {t} *z", "z[i] = x[n - 1 - i]", "gpurpc_reverse"))(
                self, result, stream=stream)
        return result

    # -- complex ------------------------------------------------------------------------

    @property
    def real(self) -> "GPUArray":
        """The real part (a new array), or self if the array is not complex."""
        if self.dtype.kind != "c":
            return self
        self._require_forc("real")
        return _complex_part(self, "real")

    @property
    def imag(self) -> "GPUArray":
        """The imaginary part (a new array), or zeros like self if it is not complex."""
        if self.dtype.kind != "c":
            return zeros_like(self)
        self._require_forc("imag")
        return _complex_part(self, "imag")

    def conj(self, out: Optional["GPUArray"] = None) -> "GPUArray":
        """The complex conjugate (into ``out`` if given; ``out=self`` works in place), or
        self if the array is not complex."""
        if self.dtype.kind != "c":
            return self
        self._require_forc("conj")
        return _complex_part(self, "conj", out)

    conjugate = conj

    # -- reductions ---------------------------------------------------------------------

    def sum(self, dtype: Any = None, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """``gpuarray.sum(self)``."""
        return sum(self, dtype=dtype, stream=stream)

    def dot(self, other: "GPUArray", dtype: Any = None,
            stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """``gpuarray.dot(self, other)``."""
        return dot(self, other, dtype=dtype, stream=stream)

    def max(self, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """``gpuarray.max(self)``."""
        return max(self, stream=stream)

    def min(self, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """``gpuarray.min(self)``."""
        return min(self, stream=stream)

    def any(self, stream: Optional[_drv.Stream] = None, allocator: Any = None) -> "GPUArray":
        """``gpuarray.any(self)``."""
        return any(self, stream=stream, allocator=allocator)

    def all(self, stream: Optional[_drv.Stream] = None, allocator: Any = None) -> "GPUArray":
        """``gpuarray.all(self)``."""
        return all(self, stream=stream, allocator=allocator)


def _copy_into(target: GPUArray, value: GPUArray) -> None:
    """Copies ``value`` (same dtype and size) into ``target``, for any strides of either."""
    tf, vf = target.flags, value.flags
    if (tf.c_contiguous and vf.c_contiguous) or (
            target.shape == value.shape and tf.f_contiguous and vf.f_contiguous):
        _drv.memcpy_dtod_async(target.gpudata, value.gpudata, target.nbytes)
        return
    if value.shape != target.shape:
        if not value.flags.forc:
            raise ValueError(f"could not assign a strided array of shape {value.shape} to a "
                             f"selection of shape {target.shape}")
        value = value.reshape(target.shape)
    _copy_layout(target.ptr, target.strides, value.ptr, value.strides, target.shape,
                 target.itemsize, None)


# =============================================================================================
# dtype rules

_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")


def _result_dtype(a: np.dtype, b: Any, op: str) -> np.dtype:
    if isinstance(b, np.dtype):
        dtype = np.result_type(a, b)
    else:
        dtype = np.result_type(a, b) if not isinstance(b, bool) else np.result_type(a, np.bool_)
    if op == "/" and dtype.kind in "iub":
        return np.dtype(np.float64)
    return dtype


def _compute_dtype(array_dtype: np.dtype, result: np.dtype, scalar: Any, op: str) -> np.dtype:
    """The type a scalar is passed as: the result type, except for comparisons."""
    if op in _COMPARISONS:
        return np.result_type(array_dtype, scalar) if not isinstance(scalar, bool) \
            else array_dtype
    return result


def _check_complex_op(op: str, *dtypes: np.dtype) -> None:
    if op in ("<", "<=", ">", ">=") and builtins.any(d.kind == "c" for d in dtypes):
        raise TypeError(f"ordering comparison {op} is not defined for complex numbers")


def _check_inplace(op: str, target: np.dtype, result: np.dtype) -> None:
    if result.kind == "c" and target.kind != "c":
        raise TypeError(f"cannot store the complex result of {op}= in an array of {target} "
                        "in place")


def _ctype(dtype: np.dtype) -> str:
    return dtype_to_ctype(dtype)


def _expr(op: str, x: str, y: str, ctype: str, kind: str) -> str:
    if op == "**":
        if kind == "c":
            return f"pycuda::pow(({ctype}){x}, ({ctype}){y})"
        if kind == "f":
            return f"pow(({ctype}){x}, ({ctype}){y})"
        return f"({ctype})pow((double){x}, (double){y})"
    if op in _COMPARISONS:
        if kind == "c":
            return f"(({ctype}){x} {op} ({ctype}){y})"
        return f"({x} {op} {y})"
    return f"({ctype}){x} {op} ({ctype}){y}"


def _store(tz: str, dz: np.dtype, expr: str, de: np.dtype) -> str:
    """``expr`` (of dtype ``de``) converted to the stored type: a complex value stored into
    a real array keeps its real part (numpy's astype), into bool its non-zero test."""
    if de.kind == "c" and dz.kind != "c":
        if dz.kind == "b":
            return f"(({expr}) != ({_ctype(de)})0)"
        return f"({tz})pycuda::real({expr})"
    return f"({tz})({expr})"


# =============================================================================================
# kernels (memoized per session)

def _fill_kernel(dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("fill", dtype), lambda: ElementwiseKernel(
        f"{t} *z, {t} a", "z[i] = a", "gpurpc_fill"))


def _convert_kernel(src: np.dtype, dst: np.dtype) -> ElementwiseKernel:
    return _kernel(("astype", src, dst), lambda: ElementwiseKernel(
        f"const {_ctype(src)} *x, {_ctype(dst)} *z",
        f"z[i] = {_store(_ctype(dst), dst, 'x[i]', src)}", "gpurpc_astype",
        preamble=_complex_preamble(src, dst)))


def _binary_kernel(op: str, dx: np.dtype, dy: np.dtype, dz: np.dtype, x_scalar: bool = False,
                   y_scalar: bool = False) -> ElementwiseKernel:
    """z = x op y; with ``x_scalar``/``y_scalar`` that operand is a 0-d array read at [0], and
    the kernel's arguments are ``(z, x, y)`` (it loops over z)."""
    tz = _ctype(dz)
    compute = np.result_type(dx, dy) if op in _COMPARISONS else dz
    if op in _COMPARISONS:
        de = np.dtype(np.bool_)
    else:
        de = compute
    xi = "x[0]" if x_scalar else "x[i]"
    yi = "y[0]" if y_scalar else "y[i]"
    body = f"z[i] = {_store(tz, dz, _expr(op, xi, yi, _ctype(compute), compute.kind), de)}"
    if x_scalar or y_scalar:
        args = f"{tz} *z, const {_ctype(dx)} *x, const {_ctype(dy)} *y"
    else:
        args = f"const {_ctype(dx)} *x, const {_ctype(dy)} *y, {tz} *z"
    return _kernel(("binary", op, dx, dy, dz, x_scalar, y_scalar), lambda: ElementwiseKernel(
        args, body, "gpurpc_binary", preamble=_complex_preamble(dx, dy, dz)))


def _scalar_kernel(op: str, dx: np.dtype, ds: np.dtype, dz: np.dtype,
                   reverse: bool) -> ElementwiseKernel:
    tz = _ctype(dz)
    compute = ds if op in _COMPARISONS else dz
    de = np.dtype(np.bool_) if op in _COMPARISONS else compute
    a, b = ("s", "x[i]") if reverse else ("x[i]", "s")
    return _kernel(("scalar", op, dx, ds, dz, reverse), lambda: ElementwiseKernel(
        f"const {_ctype(dx)} *x, {_ctype(ds)} s, {tz} *z",
        f"z[i] = {_store(tz, dz, _expr(op, a, b, _ctype(compute), compute.kind), de)}",
        "gpurpc_scalar_op", preamble=_complex_preamble(dx, ds, dz)))


def _inplace_kernel(op: str, dx: np.dtype, dy: np.dtype,
                    y_scalar: bool = False) -> ElementwiseKernel:
    tx = _ctype(dx)
    compute = np.result_type(dx, dy)
    if op == "/" and compute.kind in "iub":
        compute = np.dtype(np.float64)
    yi = "y[0]" if y_scalar else "y[i]"
    return _kernel(("inplace", op, dx, dy, y_scalar), lambda: ElementwiseKernel(
        f"{tx} *x, const {_ctype(dy)} *y",
        f"x[i] = {_store(tx, dx, _expr(op, 'x[i]', yi, _ctype(compute), compute.kind), compute)}",
        "gpurpc_inplace", preamble=_complex_preamble(dx, dy)))


def _inplace_scalar_kernel(op: str, dx: np.dtype, ds: np.dtype) -> ElementwiseKernel:
    tx = _ctype(dx)
    compute = ds
    if op == "/" and compute.kind in "iub":
        compute = np.dtype(np.float64)
    return _kernel(("inplace_scalar", op, dx, ds), lambda: ElementwiseKernel(
        f"{tx} *x, {_ctype(ds)} s",
        f"x[i] = {_store(tx, dx, _expr(op, 'x[i]', 's', _ctype(compute), compute.kind), compute)}",
        "gpurpc_inplace_scalar", preamble=_complex_preamble(dx, ds)))


def _unary_kernel(what: str, dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    if what == "neg":
        expr = f"({t})(-x[i])"
    elif dtype.kind == "f":
        expr = "fabsf(x[i])" if dtype == np.float32 else "fabs(x[i])"
    elif dtype.kind == "i":
        expr = f"(x[i] < 0 ? ({t})(-x[i]) : x[i])"
    else:
        expr = "x[i]"
    return _kernel(("unary", what, dtype), lambda: ElementwiseKernel(
        f"const {t} *x, {t} *z", f"z[i] = {expr}", "gpurpc_unary",
        preamble=_complex_preamble(dtype)))


def _complex_part(a: GPUArray, what: str, out: Optional[GPUArray] = None) -> GPUArray:
    """real/imag/abs (real results) or conj (complex result) of a contiguous complex array."""
    dtype = a.dtype
    out_dtype = dtype if what == "conj" else _real_dtype(dtype)
    if out is None:
        out = a._new_like_me(out_dtype)
    elif out.shape != a.shape and out.size != a.size:
        raise ValueError(f"out has shape {out.shape}, expected {a.shape}")
    elif not out.flags.forc:
        raise _contiguity_error(what)
    tz = _ctype(out.dtype)
    expr = {"real": "pycuda::real(x[i])", "imag": "pycuda::imag(x[i])",
            "abs": "pycuda::abs(x[i])", "conj": "pycuda::conj(x[i])"}[what]
    if a.size:
        _kernel(("complex_part", what, dtype, out.dtype), lambda: ElementwiseKernel(
            f"const {_ctype(dtype)} *x, {tz} *z",
            f"z[i] = {_store(tz, out.dtype, expr, out_dtype)}", f"gpurpc_{what}",
            preamble=COMPLEX_PREAMBLE))(a, out)
    return out


def _arange_kernel(dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("arange", dtype), lambda: ElementwiseKernel(
        f"{t} *z, {t} start, {t} step", f"z[i] = ({t})(start + ({t})i * step)",
        "gpurpc_arange", preamble=_complex_preamble(dtype)))


def _minmax_elementwise(what: str, dtype: np.dtype, other: Optional[np.dtype] = None,
                        out: Optional[np.dtype] = None,
                        scalar: bool = False) -> ElementwiseKernel:
    """z = max/min(a, b) of two arrays, or of an array and a scalar ``b`` (``scalar``)."""
    other = dtype if other is None else other
    out = dtype if out is None else out
    t = _ctype(out)
    op = ">" if what == "max" else "<"
    b = "b" if scalar else "b[i]"
    b_decl = f"{_ctype(other)} b" if scalar else f"const {_ctype(other)} *b"
    if (dtype, other, out) == (dtype, dtype, dtype) and not scalar:
        body = f"z[i] = (a[i] {op} b[i]) ? a[i] : b[i]"
    else:
        body = f"z[i] = (({t})a[i] {op} ({t}){b}) ? ({t})a[i] : ({t}){b}"
    return _kernel(("elwise_minmax", what, dtype, other, out, scalar), lambda: ElementwiseKernel(
        f"const {_ctype(dtype)} *a, {b_decl}, {t} *z", body, f"gpurpc_{what}imum"))


def _truth(expr: str, dtype: np.dtype) -> str:
    """A C expression that is true where ``expr`` (of ``dtype``) is non-zero."""
    if dtype.kind == "b":
        return f"({expr})"
    if dtype.kind == "c":
        return f"(({expr}) != ({_ctype(dtype)})0)"
    return f"(({expr}) != 0)"


# =============================================================================================
# constructors

def empty(shape: Any, dtype: Any, allocator: Optional[Callable[[int], Any]] = None,
          order: Literal["C", "F"] = "C") -> GPUArray:
    """An uninitialised array."""
    return GPUArray(shape, dtype, allocator, order=order)


def zeros(shape: Any, dtype: Any = np.float64, allocator: Optional[Callable[[int], Any]] = None,
          order: Literal["C", "F"] = "C") -> GPUArray:
    """An array of zeros."""
    return empty(shape, dtype, allocator, order).fill(0)


def ones(shape: Any, dtype: Any = np.float64, allocator: Optional[Callable[[int], Any]] = None,
         order: Literal["C", "F"] = "C") -> GPUArray:
    """An array of ones."""
    return empty(shape, dtype, allocator, order).fill(1)


def _like_order(other: GPUArray, order: str) -> str:
    if order in ("A", "K"):
        return "F" if other._fortran_only() else "C"
    if order not in ("C", "F"):
        raise ValueError(f"unsupported order: {order!r} (C, F, A or K)")
    return order


def empty_like(other: GPUArray, dtype: Any = None, order: str = "K") -> GPUArray:
    """An uninitialised array like ``other`` (``order``: C, F, A or K; K and A keep a
    Fortran array's order, and give a C array for a strided view)."""
    return other._new_like_me(dtype, order=_like_order(other, order))


def zeros_like(other: GPUArray, dtype: Any = None, order: str = "K") -> GPUArray:
    """An array of zeros like ``other``."""
    return empty_like(other, dtype, order).fill(0)


def ones_like(other: GPUArray, dtype: Any = None, order: str = "K") -> GPUArray:
    """An array of ones like ``other``."""
    return empty_like(other, dtype, order).fill(1)


def to_gpu(ary: Any, allocator: Optional[Callable[[int], Any]] = None) -> GPUArray:
    """A device copy of a host array."""
    ary = np.asarray(ary)
    order: Literal["C", "F"] = (
        "F" if (ary.flags.f_contiguous and not ary.flags.c_contiguous) else "C")
    result = GPUArray(ary.shape, ary.dtype, allocator, order=order)
    if not (ary.flags.c_contiguous or ary.flags.f_contiguous):
        ary = np.ascontiguousarray(ary)
    result.set(ary)
    return result


def to_gpu_async(ary: Any, allocator: Optional[Callable[[int], Any]] = None,
                 stream: Optional[_drv.Stream] = None) -> GPUArray:
    """A device copy of a host array, queued on ``stream``."""
    ary = np.ascontiguousarray(ary)
    result = GPUArray(ary.shape, ary.dtype, allocator)
    result.set_async(ary, stream)
    return result


def arange(*args: Any, **kwargs: Any) -> GPUArray:
    """``arange([start,] stop[, step], dtype=None)`` like numpy's."""
    dtype = kwargs.pop("dtype", None)
    stream = kwargs.pop("stream", None)
    allocator = kwargs.pop("allocator", None)
    start = kwargs.pop("start", None)
    stop = kwargs.pop("stop", None)
    step = kwargs.pop("step", None)
    if kwargs:
        raise TypeError("unexpected keyword arguments: " + ", ".join(kwargs))
    if len(args) == 1:
        stop = args[0]
    elif len(args) == 2:
        start, stop = args
    elif len(args) == 3:
        start, stop, step = args
    elif len(args) > 3:
        raise TypeError("arange takes at most 3 positional arguments")
    start = 0 if start is None else start
    step = 1 if step is None else step
    if stop is None:
        raise ValueError("arange needs a stop value")
    if dtype is None:
        dtype = np.result_type(start, stop, step)
    dtype = np.dtype(dtype)
    size = int(np.ceil((stop - start) / step)) if step else 0
    size = size if size > 0 else 0
    result = GPUArray((size,), dtype, allocator)
    if size:
        _arange_kernel(dtype)(result, _scalar_type(dtype, start), _scalar_type(dtype, step),
                              stream=stream)
    return result


# =============================================================================================
# take / put

def _check_indices(indices: GPUArray, what: str) -> None:
    if not isinstance(indices, GPUArray):
        raise TypeError(f"{what}: indices must be a GPUArray, got {type(indices).__name__}")
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{what}: indices must be integers, got {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"{what}: indices must be one-dimensional, got shape {indices.shape}")
    if not indices.flags.forc:
        raise _contiguity_error(what)


def _single_dtype(arrays: Sequence[GPUArray], what: str) -> np.dtype:
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1:
        raise TypeError(f"{what}: all arrays must have one dtype, got "
                        f"{', '.join(sorted(str(d) for d in dtypes))}")
    return dtypes.pop()


def _take_kernel(dtype: np.dtype, idx: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("take", dtype, idx), lambda: ElementwiseKernel(
        f"const {_ctype(idx)} *idx, {t} *out, const {t} *a", "out[i] = a[idx[i]]",
        "gpurpc_take"))


def _put_kernel(dtype: np.dtype, idx: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("put", dtype, idx), lambda: ElementwiseKernel(
        f"const {_ctype(idx)} *dest_idx, {t} *out, const {t} *a", "out[dest_idx[i]] = a[i]",
        "gpurpc_put"))


def _take_put_kernel(dtype: np.dtype, idx: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    ti = _ctype(idx)
    return _kernel(("take_put", dtype, idx), lambda: ElementwiseKernel(
        f"const {ti} *dest_idx, const {ti} *src_idx, {t} *out, const {t} *a, long long offset",
        "out[dest_idx[i]] = a[offset + src_idx[i]]", "gpurpc_take_put"))


def take(a: GPUArray, indices: GPUArray, out: Optional[GPUArray] = None,
         stream: Optional[_drv.Stream] = None) -> GPUArray:
    """``[a[indices[0]], ..., a[indices[n-1]]]`` (``a`` read as a flat contiguous array).

    Indices are not bounds-checked on the device, as in PyCUDA: an index outside ``a``
    reads memory outside it (and may fault the session).
    """
    _check_indices(indices, "take")
    if not a.flags.forc:
        raise _contiguity_error("take")
    if out is None:
        out = GPUArray(indices.shape, a.dtype, a.allocator)
    elif out.dtype != a.dtype or out.size != indices.size:
        raise ValueError(f"take: out must have dtype {a.dtype} and {indices.size} elements")
    if indices.size:
        _take_kernel(a.dtype, indices.dtype)(indices, out, a, stream=stream)
    return out


def multi_take(arrays: Sequence[GPUArray], indices: GPUArray,
               out: Optional[Sequence[GPUArray]] = None,
               stream: Optional[_drv.Stream] = None) -> List[GPUArray]:
    """``[take(a, indices) for a in arrays]``, into ``out`` if given."""
    if not len(arrays):
        return []
    dtype = _single_dtype(arrays, "multi_take")
    _check_indices(indices, "multi_take")
    if out is None:
        out = [GPUArray(indices.shape, dtype, arrays[0].allocator) for _ in arrays]
    elif len(out) != len(arrays):
        raise ValueError("multi_take: out and arrays must have the same length")
    return [take(a, indices, o, stream) for a, o in zip(arrays, out)]


def _put_targets(arrays: Sequence[GPUArray], dest_shape: Any,
                 out: Optional[Sequence[GPUArray]], what: str) -> List[GPUArray]:
    dtype = _single_dtype(arrays, what)
    if out is None:
        if dest_shape is None:
            raise ValueError(f"{what}: give dest_shape or out")
        return [GPUArray(dest_shape, dtype, arrays[0].allocator) for _ in arrays]
    if len(out) != len(arrays):
        raise ValueError(f"{what}: out and arrays must have the same length")
    if _single_dtype(list(out), what) != dtype:
        raise TypeError(f"{what}: arrays and out must have the same dtype")
    for o in out:
        if not o.flags.forc:
            raise _contiguity_error(what)
    return list(out)


def multi_put(arrays: Sequence[GPUArray], dest_indices: GPUArray, dest_shape: Any = None,
              out: Optional[Sequence[GPUArray]] = None,
              stream: Optional[_drv.Stream] = None) -> List[GPUArray]:
    """For each k: ``out[k][dest_indices[i]] = arrays[k][i]`` (new arrays of ``dest_shape``
    unless ``out`` is given; elements not written stay uninitialised)."""
    if not len(arrays):
        return []
    _check_indices(dest_indices, "multi_put")
    targets = _put_targets(arrays, dest_shape, out, "multi_put")
    for a, o in zip(arrays, targets):
        if not a.flags.forc:
            raise _contiguity_error("multi_put")
        if a.size < dest_indices.size:
            raise ValueError(f"multi_put: an array has {a.size} elements, fewer than the "
                             f"{dest_indices.size} indices")
        if dest_indices.size:
            _put_kernel(a.dtype, dest_indices.dtype)(dest_indices, o, a, stream=stream)
    return targets


def multi_take_put(arrays: Sequence[GPUArray], dest_indices: GPUArray, src_indices: GPUArray,
                   dest_shape: Any = None, out: Optional[Sequence[GPUArray]] = None,
                   stream: Optional[_drv.Stream] = None,
                   src_offsets: Optional[Sequence[int]] = None) -> List[GPUArray]:
    """For each k: ``out[k][dest_indices[i]] = arrays[k][src_offsets[k] + src_indices[i]]``."""
    if not len(arrays):
        return []
    _check_indices(dest_indices, "multi_take_put")
    _check_indices(src_indices, "multi_take_put")
    if src_indices.dtype != dest_indices.dtype:
        raise TypeError("multi_take_put: src_indices and dest_indices must have the same dtype")
    if src_indices.shape != dest_indices.shape:
        raise ValueError("multi_take_put: src_indices and dest_indices must have the same shape")
    if src_offsets is None:
        src_offsets = [0] * len(arrays)
    elif len(src_offsets) != len(arrays):
        raise ValueError("multi_take_put: src_offsets and arrays must have the same length")
    targets = _put_targets(arrays, dest_shape, out, "multi_take_put")
    for a, o, offset in zip(arrays, targets, src_offsets):
        if not a.flags.forc:
            raise _contiguity_error("multi_take_put")
        if src_indices.size:
            _take_put_kernel(a.dtype, src_indices.dtype)(
                dest_indices, src_indices, o, a, np.int64(offset), stream=stream)
    return targets


# =============================================================================================
# shape manipulation

def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of bounds for {ndim} dimensions")
    return axis % ndim


def concatenate(arrays: Sequence[GPUArray], axis: int = 0,
                allocator: Optional[Callable[[int], Any]] = None) -> GPUArray:
    """Joins arrays along an existing axis (numpy's dtype promotion)."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    first = arrays[0]
    if first.ndim == 0:
        raise ValueError("zero-dimensional arrays cannot be concatenated")
    axis = _normalize_axis(axis, first.ndim, "concatenate")
    shape = list(first.shape)
    for i, ary in enumerate(arrays[1:], start=1):
        if ary.ndim != first.ndim:
            raise ValueError(f"array {i} has {ary.ndim} dimensions, array 0 has {first.ndim}")
        if ary.shape[:axis] + ary.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError(f"array {i} of shape {ary.shape} does not match array 0 of shape "
                             f"{first.shape} outside axis {axis}")
        shape[axis] += ary.shape[axis]
    dtype = np.result_type(*(a.dtype for a in arrays))
    result = empty(tuple(shape), dtype, allocator=allocator or first.allocator)
    base = 0
    for ary in arrays:
        n = ary.shape[axis]
        result[(slice(None),) * axis + (slice(base, base + n),)] = ary
        base += n
    return result


def stack(arrays: Sequence[GPUArray], axis: int = 0,
          allocator: Optional[Callable[[int], Any]] = None) -> GPUArray:
    """Joins arrays of one shape along a new axis."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to stack")
    shape = arrays[0].shape
    if builtins.any(a.shape != shape for a in arrays[1:]):
        raise ValueError("all input arrays must have the same shape")
    axis = _normalize_axis(axis, len(shape) + 1, "stack")
    result_shape = shape[:axis] + (len(arrays),) + shape[axis:]
    dtype = np.result_type(*(a.dtype for a in arrays))
    result = empty(result_shape, dtype, allocator=allocator or arrays[0].allocator,
                   order="C" if axis == 0 else "F")
    for i, ary in enumerate(arrays):
        result[(slice(None),) * axis + (i,)] = ary
    return result


def transpose(a: GPUArray, axes: Any = None) -> GPUArray:
    """``a.transpose(axes)``: a view with the axes permuted."""
    return a.transpose(axes)


def reshape(a: GPUArray, *shape: Any, **kwargs: Any) -> GPUArray:
    """``a.reshape(*shape, order=...)``."""
    return a.reshape(*shape, **kwargs)


def conj(a: GPUArray, out: Optional[GPUArray] = None) -> GPUArray:
    """``a.conj(out)``: the complex conjugate (``a`` itself if it is not complex)."""
    return a.conj(out=out)


# =============================================================================================
# conditionals and logical operations

def _check_same(what: str, *arrays: GPUArray) -> None:
    shape = arrays[0].shape
    for a in arrays:
        if not isinstance(a, GPUArray):
            raise TypeError(f"{what}: expected GPUArrays, got {type(a).__name__}")
        if a.shape != shape:
            shapes = ", ".join(str(x.shape) for x in arrays)
            raise ValueError(f"{what}: shapes do not match ({shapes})")
        if not a.flags.forc:
            raise _contiguity_error(what)
    orders = {a._fortran_only() for a in arrays if a.ndim > 1}
    if len(orders) > 1:
        raise ValueError(f"{what}: arrays are contiguous in different orders (C and Fortran)")


def _select(what: str, test: str, criterion: GPUArray, then_: GPUArray, else_: GPUArray,
            out: Optional[GPUArray], stream: Optional[_drv.Stream]) -> GPUArray:
    _check_same(what, criterion, then_, else_)
    if then_.dtype != else_.dtype:
        raise ValueError(f"{what}: then_ and else_ must have one dtype, got {then_.dtype} "
                         f"and {else_.dtype}")
    if out is None:
        out = empty_like(then_)
    else:
        _check_same(what, criterion, out)
        if out.dtype != then_.dtype:
            raise ValueError(f"{what}: out must have dtype {then_.dtype}")
    t = _ctype(then_.dtype)
    tc = _ctype(criterion.dtype)
    if criterion.size:
        _kernel(("select", what, criterion.dtype, then_.dtype), lambda: ElementwiseKernel(
            f"const {tc} *crit, const {t} *then_, const {t} *else_, {t} *result",
            f"result[i] = {test} ? then_[i] : else_[i]", f"gpurpc_{what}",
            preamble=_complex_preamble(criterion.dtype, then_.dtype)))(
            criterion, then_, else_, out, stream=stream)
    return out


def if_positive(criterion: GPUArray, then_: GPUArray, else_: GPUArray,
                out: Optional[GPUArray] = None, stream: Optional[_drv.Stream] = None) -> GPUArray:
    """``then_[i]`` where ``criterion[i] > 0``, else ``else_[i]``."""
    if criterion.dtype.kind not in "biuf":
        raise TypeError(f"if_positive: criterion must be real, got {criterion.dtype}")
    return _select("if_positive", "(crit[i] > 0)", criterion, then_, else_, out, stream)


def where(criterion: GPUArray, then_: GPUArray, else_: GPUArray,
          out: Optional[GPUArray] = None, stream: Optional[_drv.Stream] = None) -> GPUArray:
    """``then_[i]`` where ``criterion[i]`` is non-zero, else ``else_[i]``."""
    if criterion.dtype.kind not in "biufc":
        raise TypeError(f"where: criterion must be numeric, got {criterion.dtype}")
    return _select("where", _truth("crit[i]", criterion.dtype), criterion, then_, else_, out,
                   stream)


def _logical(what: str, op: str, x1: Any, x2: Any, out: Optional[GPUArray],
             allocator: Any) -> GPUArray:
    if _is_scalar(x1) and _is_scalar(x2):
        value = np.logical_and(x1, x2) if op == "&&" else np.logical_or(x1, x2)
        if out is None:
            out = empty((), np.bool_, allocator=allocator)
        return out.fill(bool(value))
    if _is_scalar(x1):
        x1, x2 = x2, x1
    if not isinstance(x1, GPUArray):
        raise TypeError(f"{what} takes GPUArrays or scalars, got {type(x1).__name__}")
    if not x1.flags.forc:
        raise _contiguity_error(what)
    if out is None:
        out = x1._new_like_me(np.bool_) if allocator is None else GPUArray(
            x1.shape, np.bool_, allocator, order="F" if x1._fortran_only() else "C")
    if out.shape != x1.shape or out.dtype != np.bool_ or not out.flags.forc:
        raise ValueError(f"{what}: out must be a contiguous bool array of shape {x1.shape}")
    if not x1.size:
        return out
    if _is_scalar(x2):
        if isinstance(x2, (complex, np.complexfloating)):
            s = bool(x2 != 0)
        else:
            s = bool(x2)
        _kernel(("logical_scalar", op, x1.dtype), lambda: ElementwiseKernel(
            f"const {_ctype(x1.dtype)} *x, bool s, bool *z",
            f"z[i] = {_truth('x[i]', x1.dtype)} {op} s", f"gpurpc_{what}",
            preamble=_complex_preamble(x1.dtype)))(x1, np.bool_(s), out)
        return out
    if not isinstance(x2, GPUArray):
        raise TypeError(f"{what} takes GPUArrays or scalars, got {type(x2).__name__}")
    _check_same(what, x1, x2, out)
    _kernel(("logical", op, x1.dtype, x2.dtype), lambda: ElementwiseKernel(
        f"const {_ctype(x1.dtype)} *x, const {_ctype(x2.dtype)} *y, bool *z",
        f"z[i] = {_truth('x[i]', x1.dtype)} {op} {_truth('y[i]', x2.dtype)}", f"gpurpc_{what}",
        preamble=_complex_preamble(x1.dtype, x2.dtype)))(x1, x2, out)
    return out


def logical_and(x1: Any, x2: Any, out: Optional[GPUArray] = None, *,
                allocator: Any = None) -> GPUArray:
    """Elementwise ``x1 and x2`` as a bool array (either may be a scalar)."""
    return _logical("logical_and", "&&", x1, x2, out, allocator)


def logical_or(x1: Any, x2: Any, out: Optional[GPUArray] = None, *,
               allocator: Any = None) -> GPUArray:
    """Elementwise ``x1 or x2`` as a bool array (either may be a scalar)."""
    return _logical("logical_or", "||", x1, x2, out, allocator)


def logical_not(x: Any, out: Optional[GPUArray] = None, *, allocator: Any = None) -> GPUArray:
    """Elementwise ``not x`` as a bool array."""
    if _is_scalar(x):
        if out is None:
            out = empty((), np.bool_, allocator=allocator)
        return out.fill(not bool(x))
    if not isinstance(x, GPUArray):
        raise TypeError(f"logical_not takes a GPUArray or a scalar, got {type(x).__name__}")
    if not x.flags.forc:
        raise _contiguity_error("logical_not")
    if out is None:
        out = GPUArray(x.shape, np.bool_, allocator or x.allocator,
                       order="F" if x._fortran_only() else "C")
    _check_same("logical_not", x, out)
    if out.dtype != np.bool_:
        raise ValueError("logical_not: out must be a bool array")
    if x.size:
        _kernel(("logical_not", x.dtype), lambda: ElementwiseKernel(
            f"const {_ctype(x.dtype)} *x, bool *z", f"z[i] = !{_truth('x[i]', x.dtype)}",
            "gpurpc_logical_not", preamble=_complex_preamble(x.dtype)))(x, out)
    return out


# =============================================================================================
# reductions and other functions

def _reduction(key: Tuple, dtype_out: np.dtype, neutral: str, reduce_expr: str, map_expr: str,
               arguments: str, name: str, *dtypes: np.dtype) -> ReductionKernel:
    return _kernel(key, lambda: ReductionKernel(
        dtype_out, neutral, reduce_expr, map_expr=map_expr, arguments=arguments, name=name,
        preamble=_complex_preamble(dtype_out, *dtypes)))


def sum(a: GPUArray, dtype: Any = None, stream: Optional[_drv.Stream] = None,  # noqa: A001
        allocator: Any = None) -> GPUArray:
    """A 0-d array holding the sum (in ``dtype``, default ``a.dtype``)."""
    _require_forc_all("sum", a)
    _require_arithmetic(a.dtype, "sum")
    dtype_out = np.dtype(dtype) if dtype is not None else a.dtype
    if dtype_out.kind == "b":
        dtype_out = np.dtype(np.int64)
    if dtype_out.kind == "c" or a.dtype.kind == "c":
        out_t = _ctype(dtype_out)
        krnl = _reduction(("sum", dtype_out, a.dtype), dtype_out, f"({out_t})0", "a+b",
                          _store(out_t, dtype_out, "in[i]", a.dtype),
                          f"const {_ctype(a.dtype)} *in", "sum", a.dtype)
    else:
        krnl = _kernel(("sum", dtype_out, a.dtype), lambda: get_sum_kernel(dtype_out, a.dtype))
    return krnl(a, stream=stream, allocator=allocator)


def subset_sum(subset: GPUArray, a: GPUArray, dtype: Any = None,
               stream: Optional[_drv.Stream] = None, allocator: Any = None) -> GPUArray:
    """A 0-d array holding ``sum(a[subset])``."""
    _require_forc_all("subset_sum", subset, a)
    _check_indices(subset, "subset_sum")
    _require_arithmetic(a.dtype, "subset_sum")
    dtype_out = np.dtype(dtype) if dtype is not None else a.dtype
    if dtype_out.kind == "b":
        dtype_out = np.dtype(np.int64)
    out_t = _ctype(dtype_out)
    krnl = _reduction(("subset_sum", dtype_out, subset.dtype, a.dtype), dtype_out,
                      f"({out_t})0", "a+b",
                      _store(out_t, dtype_out, "in[lookup_tbl[i]]", a.dtype),
                      f"const {_ctype(subset.dtype)} *lookup_tbl, const {_ctype(a.dtype)} *in",
                      "subset_sum", a.dtype)
    return krnl(subset, a, stream=stream, allocator=allocator)


def dot(a: GPUArray, b: GPUArray, dtype: Any = None, stream: Optional[_drv.Stream] = None,
        allocator: Any = None) -> GPUArray:
    """A 0-d array holding ``sum(a*b)`` (no conjugation, like numpy's ``dot``)."""
    _require_forc_all("dot", a, b)
    if a.size != b.size:
        raise ValueError(f"dot: sizes differ ({a.size} and {b.size})")
    _require_arithmetic(a.dtype, "dot")
    _require_arithmetic(b.dtype, "dot")
    dtype_out = np.dtype(dtype) if dtype is not None else np.result_type(a.dtype, b.dtype)
    if builtins.any(d.kind == "c" for d in (dtype_out, a.dtype, b.dtype)):
        out_t = _ctype(dtype_out)
        product = _store(out_t, dtype_out, f"({out_t})a[i]*({out_t})b[i]", dtype_out)
        krnl = _reduction(("dot", dtype_out, a.dtype, b.dtype), dtype_out, f"({out_t})0", "a+b",
                          product, f"const {_ctype(a.dtype)} *a, const {_ctype(b.dtype)} *b",
                          "dot", a.dtype, b.dtype)
    else:
        krnl = _kernel(("dot", dtype_out, a.dtype, b.dtype),
                       lambda: get_dot_kernel(dtype_out, a.dtype, b.dtype))
    return krnl(a, b, stream=stream, allocator=allocator)


def subset_dot(subset: GPUArray, a: GPUArray, b: GPUArray, dtype: Any = None,
               stream: Optional[_drv.Stream] = None, allocator: Any = None) -> GPUArray:
    """A 0-d array holding ``sum(a[subset]*b[subset])``."""
    _require_forc_all("subset_dot", subset, a, b)
    _check_indices(subset, "subset_dot")
    _require_arithmetic(a.dtype, "subset_dot")
    _require_arithmetic(b.dtype, "subset_dot")
    dtype_out = np.dtype(dtype) if dtype is not None else np.result_type(a.dtype, b.dtype)
    out_t = _ctype(dtype_out)
    krnl = _reduction(("subset_dot", dtype_out, subset.dtype, a.dtype, b.dtype), dtype_out,
                      f"({out_t})0", "a+b",
                      f"({out_t})a[lookup_tbl[i]]*({out_t})b[lookup_tbl[i]]",
                      f"const {_ctype(subset.dtype)} *lookup_tbl, const {_ctype(a.dtype)} *a, "
                      f"const {_ctype(b.dtype)} *b", "subset_dot", a.dtype, b.dtype)
    return krnl(subset, a, b, stream=stream, allocator=allocator)


def _minmax(what: str, a: GPUArray, stream: Optional[_drv.Stream]) -> GPUArray:
    _require_forc_all(what, a)
    if a.size == 0:
        raise ValueError(f"zero-size array to reduction operation {what} which has no identity")
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{what} is not defined for arrays of dtype {a.dtype}")
    dtype = a.dtype
    src = a
    if dtype.kind == "b":
        src = a.view(np.uint8)
        dtype = np.dtype(np.uint8)
    krnl = _kernel(("minmax", what, dtype), lambda: get_minmax_kernel(what, dtype))
    result = krnl(src, stream=stream)
    return result.view(a.dtype) if result.dtype != a.dtype else result


def max(a: GPUArray, stream: Optional[_drv.Stream] = None) -> GPUArray:  # noqa: A001
    """A 0-d array holding the largest element."""
    return _minmax("max", a, stream)


def min(a: GPUArray, stream: Optional[_drv.Stream] = None) -> GPUArray:  # noqa: A001
    """A 0-d array holding the smallest element."""
    return _minmax("min", a, stream)


def _subset_minmax(what: str, subset: GPUArray, a: GPUArray,
                   stream: Optional[_drv.Stream]) -> GPUArray:
    _check_indices(subset, f"subset_{what}")
    _require_forc_all(f"subset_{what}", a)
    if subset.size == 0:
        raise ValueError(f"zero-size subset to reduction operation {what} which has no "
                         "identity")
    if a.dtype.kind not in "biuf":
        raise TypeError(f"subset_{what} is not defined for arrays of dtype {a.dtype}")
    dtype = a.dtype
    src = a
    if dtype.kind == "b":
        src = a.view(np.uint8)
        dtype = np.dtype(np.uint8)
    if dtype.kind == "f":
        reduce_expr = f"f{what}{'f' if dtype == np.float32 else ''}(a,b)"
    else:
        reduce_expr = f"((a {'>' if what == 'max' else '<'} b) ? a : b)"
    neutral = _neutral_min(dtype) if what == "max" else _neutral_max(dtype)
    krnl = _reduction(("subset_minmax", what, subset.dtype, dtype), dtype, neutral, reduce_expr,
                      "in[lookup_tbl[i]]",
                      f"const {_ctype(subset.dtype)} *lookup_tbl, const {_ctype(dtype)} *in",
                      f"subset_{what}")
    result = krnl(subset, src, stream=stream)
    return result.view(a.dtype) if result.dtype != a.dtype else result


def subset_max(subset: GPUArray, a: GPUArray, stream: Optional[_drv.Stream] = None) -> GPUArray:
    """A 0-d array holding the largest of ``a[subset]``."""
    return _subset_minmax("max", subset, a, stream)


def subset_min(subset: GPUArray, a: GPUArray, stream: Optional[_drv.Stream] = None) -> GPUArray:
    """A 0-d array holding the smallest of ``a[subset]``."""
    return _subset_minmax("min", subset, a, stream)


def _any_all(what: str, a: GPUArray, stream: Optional[_drv.Stream], allocator: Any) -> GPUArray:
    _require_forc_all(what, a)
    if a.dtype.kind not in "biufc":
        raise TypeError(f"{what} is not defined for arrays of dtype {a.dtype}")
    neutral, reduce_expr = ("false", "a || b") if what == "any" else ("true", "a && b")
    krnl = _reduction((what, a.dtype), np.dtype(np.bool_), neutral, reduce_expr,
                      _truth("in[i]", a.dtype), f"const {_ctype(a.dtype)} *in", what, a.dtype)
    return krnl(a, stream=stream, allocator=allocator)


def any(a: GPUArray, stream: Optional[_drv.Stream] = None,  # noqa: A001
        allocator: Any = None) -> GPUArray:
    """A 0-d bool array: whether any element is non-zero."""
    return _any_all("any", a, stream, allocator)


def all(a: GPUArray, stream: Optional[_drv.Stream] = None,  # noqa: A001
        allocator: Any = None) -> GPUArray:
    """A 0-d bool array: whether every element is non-zero."""
    return _any_all("all", a, stream, allocator)


def maximum(a: Any, b: Any, out: Optional[GPUArray] = None,
            stream: Optional[_drv.Stream] = None) -> GPUArray:
    """Elementwise maximum of two arrays, or of an array and a scalar."""
    return _elementwise_minmax("max", a, b, out, stream)


def minimum(a: Any, b: Any, out: Optional[GPUArray] = None,
            stream: Optional[_drv.Stream] = None) -> GPUArray:
    """Elementwise minimum of two arrays, or of an array and a scalar."""
    return _elementwise_minmax("min", a, b, out, stream)


def _elementwise_minmax(what: str, a: Any, b: Any, out: Optional[GPUArray],
                        stream: Optional[_drv.Stream]) -> GPUArray:
    if not isinstance(a, GPUArray):
        if not isinstance(b, GPUArray):
            raise TypeError(f"{what}imum needs at least one GPUArray")
        a, b = b, a  # min/max are symmetric
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{what}imum is not defined for arrays of dtype {a.dtype}")
    if isinstance(b, GPUArray):
        if b.dtype.kind not in "biuf":
            raise TypeError(f"{what}imum is not defined for arrays of dtype {b.dtype}")
        a._check_other(b)
        dtype = np.result_type(a.dtype, b.dtype)
        if out is None:
            out = a._new_like_me(dtype)
        if a.size:
            _minmax_elementwise(what, a.dtype, b.dtype, out.dtype)(a, b, out, stream=stream)
        return out
    if not _is_scalar(b) or isinstance(b, (complex, np.complexfloating)):
        raise TypeError(f"{what}imum takes GPUArrays or real scalars, got {type(b).__name__}")
    a._require_forc(f"{what}imum")
    dtype = np.result_type(a.dtype, b)
    if out is None:
        out = a._new_like_me(dtype)
    if a.size:
        _minmax_elementwise(what, a.dtype, dtype, out.dtype, scalar=True)(
            a, dtype.type(b), out, stream=stream)
    return out
