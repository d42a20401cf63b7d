"""``pycuda.gpuarray``: a numpy-like array in the daemon's device memory.

Supported: contiguous arrays of bool, int8..int64, uint8..uint64, float32 and float64;
``get``/``set`` (and ``_async``), ``to_gpu``, ``empty``, ``zeros``, ``ones``, ``empty_like``,
``zeros_like``, ``ones_like``, ``arange``, ``fill``, ``copy``, ``astype``, ``reshape``/
``ravel``/``view``, slicing that keeps the array contiguous (integer or step-1 slices of the
first axis), ``+ - * / **`` and unary ``-``/``abs`` with arrays and scalars (also in place),
comparisons (like PyCUDA they return an array of the left operand's dtype holding 1 or 0),
and the reductions ``sum``, ``dot``, ``max``, ``min``.

Each operation launches a kernel generated with :class:`~gpurpc.elementwise.ElementwiseKernel`
or :class:`~gpurpc.reduction.ReductionKernel`, compiled once per session and dtype. Launches
are asynchronous and batched, so chains of operations cost no round trip until ``get()``.
Temporaries come from a per-session memory pool, so they cost no allocation round trip
either. Result dtypes follow numpy's promotion rules (``np.result_type``).
"""
from __future__ import annotations

import builtins
import numbers
from typing import Any, Callable, Literal, Optional, Tuple

import numpy as np

from . import driver as _drv
from .elementwise import ElementwiseKernel, splay
from .reduction import get_dot_kernel, get_minmax_kernel, get_sum_kernel
from .tools import _session_pool, dtype_to_ctype

__all__ = [
    "GPUArray", "to_gpu", "to_gpu_async", "empty", "zeros", "ones", "empty_like", "zeros_like",
    "ones_like", "arange", "sum", "dot", "max", "min", "maximum", "minimum", "splay",
]


def _default_allocator() -> Callable[[int], Any]:
    return _session_pool(_drv._current_core("gpuarray")).allocate


def _kernel(key: Tuple, build: Callable[[], Any]) -> Any:
    """Memoizes generated kernels per session."""
    core = _drv._current_core("gpuarray")
    cache = core.caches.setdefault("gpuarray_kernels", {})
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = build()
    return kernel


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "forc")

    def __init__(self, c: bool, f: bool) -> None:
        self.c_contiguous = c
        self.f_contiguous = f
        self.forc = c or f


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


def _normalize_shape(shape: Any) -> Tuple[int, ...]:
    if isinstance(shape, (numbers.Integral, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.void)


def _scalar_type(dtype: np.dtype, value: Any) -> Any:
    return dtype.type(value)


class GPUArray:
    """A contiguous n-dimensional array in device memory (``pycuda.gpuarray.GPUArray``).

    ``gpudata`` is the device memory (a DeviceAllocation, a pool block, or an int address
    for views); ``int(a.gpudata)`` is its address.
    """

    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any, allocator: Optional[Callable[[int], Any]] = None,
                 base: Any = None, gpudata: Any = None, strides: Any = None,
                 order: Literal["C", "F"] = "C") -> None:
        self.shape: Tuple[int, ...] = _normalize_shape(shape)
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise TypeError("GPUArray cannot hold Python objects")
        size = 1
        for n in self.shape:
            size *= n
        self.size = int(size)
        c_strides = _c_strides(self.shape, self.dtype.itemsize)
        f_strides = _f_strides(self.shape, self.dtype.itemsize)
        if strides is None:
            strides = f_strides if order == "F" else c_strides
        strides = tuple(int(s) for s in strides)
        if strides not in (c_strides, f_strides) and self.size > 1:
            raise NotImplementedError("gpurpc GPUArrays must be contiguous")
        self.strides = strides
        # Shape and strides never change after construction (views are new arrays): the
        # flags are computed once, not on every kernel call that checks contiguity.
        self._flags = _Flags(strides == c_strides or self.size <= 1,
                             strides == f_strides or self.size <= 1)
        self.allocator = allocator
        if gpudata is None:
            if self.size:
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
        return 0 if self.gpudata is None else _drv._address(self.gpudata)

    @property
    def flags(self) -> _Flags:
        return self._flags

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
        """Copies a host array (same size and dtype) into this array."""
        async_ = async_ or kwargs.pop("async", False)
        ary = self._check_host(ary)
        if self.size == 0:
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
        """Copies the array to the host (into ``ary`` if given) and returns it."""
        async_ = async_ or kwargs.pop("async", False)
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
        if async_:
            _drv.memcpy_dtoh_async(ary, self.gpudata, stream)
        else:
            _drv.memcpy_dtoh(ary, self.gpudata)
        return ary

    def get_async(self, stream: Optional[_drv.Stream] = None,
                  ary: Optional[np.ndarray] = None) -> np.ndarray:
        """Queues a copy to the host; the array is filled when ``stream`` is synchronised."""
        return self.get(ary=ary, async_=True, stream=stream)

    def copy(self) -> "GPUArray":
        """A new array with the same contents (a device-to-device copy)."""
        new = self._new_like_me()
        if self.size:
            _drv.memcpy_dtod_async(new.gpudata, self.gpudata, self.nbytes)
        return new

    def _fortran_only(self) -> bool:
        flags = self.flags
        return flags.f_contiguous and not flags.c_contiguous

    def _new_like_me(self, dtype: Any = None) -> "GPUArray":
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        order: Literal["C", "F"] = "F" if self._fortran_only() else "C"
        return GPUArray(self.shape, dtype, allocator=self.allocator, order=order)

    # -- fill / astype ------------------------------------------------------------------

    def fill(self, value: Any, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """Sets every element to ``value``; returns self."""
        if self.size == 0:
            return self
        raw = np.array(value, dtype=self.dtype).tobytes()
        size = self.dtype.itemsize
        if size == 1:
            _drv.memset_d8_async(self.gpudata, raw[0], self.size, stream)
        elif size == 2:
            _drv.memset_d16_async(self.gpudata, int.from_bytes(raw, "little"), self.size, stream)
        elif size == 4:
            _drv.memset_d32_async(self.gpudata, int.from_bytes(raw, "little"), self.size, stream)
        elif size == 8 and raw[:4] == raw[4:]:
            _drv.memset_d32_async(self.gpudata, int.from_bytes(raw[:4], "little"),
                                  2 * self.size, stream)
        else:
            _fill_kernel(self.dtype)(self, _scalar_type(self.dtype, value), stream=stream)
        return self

    def astype(self, dtype: Any, stream: Optional[_drv.Stream] = None) -> "GPUArray":
        """A copy converted to ``dtype`` (a plain copy if it is the same)."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self.copy()
        result = self._new_like_me(dtype)
        if self.size:
            _convert_kernel(self.dtype, dtype)(self, result, stream=stream)
        return result

    # -- shape --------------------------------------------------------------------------

    def reshape(self, *shape: Any, order: Literal["C", "F"] = "C") -> "GPUArray":
        """A view with a new shape (one dimension may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], (numbers.Integral, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = 1
            for s in shape:
                if s != -1:
                    known *= s
            if shape.count(-1) > 1 or (known == 0 or self.size % known):
                raise ValueError(f"cannot reshape array of size {self.size} into {shape}")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        total = 1
        for s in shape:
            total *= s
        if total != self.size:
            raise ValueError(f"cannot reshape array of size {self.size} into shape {shape}")
        if order not in ("C", "F"):
            raise ValueError("order must be 'C' or 'F'")
        flags = self.flags
        if self.ndim > 1 and not (flags.c_contiguous if order == "C" else flags.f_contiguous):
            raise NotImplementedError("reshape in another memory order than the array's")
        return GPUArray(shape, self.dtype, allocator=self.allocator, base=self,
                        gpudata=self.gpudata, order=order)

    def ravel(self) -> "GPUArray":
        """A 1-d view."""
        return self.reshape(self.size)

    def view(self, dtype: Any = None) -> "GPUArray":
        """A view of the same memory, optionally as another dtype of the same total size."""
        if dtype is None:
            dtype = self.dtype
        dtype = np.dtype(dtype)
        if dtype.itemsize == self.dtype.itemsize:
            shape = self.shape
        else:
            if not self.shape or (self.shape[-1] * self.itemsize) % dtype.itemsize:
                raise ValueError("new dtype does not divide the last axis")
            shape = self.shape[:-1] + (self.shape[-1] * self.itemsize // dtype.itemsize,)
        return GPUArray(shape, dtype, allocator=self.allocator, base=self, gpudata=self.gpudata)

    def _offset_view(self, offset_elems: int, shape: Tuple[int, ...]) -> "GPUArray":
        size = 1
        for s in shape:
            size *= s
        gpudata = None
        if size and self.gpudata is not None:
            gpudata = _drv._address(self.gpudata) + offset_elems * self.itemsize
        return GPUArray(shape, self.dtype, allocator=self.allocator, base=self, gpudata=gpudata)

    def __getitem__(self, index: Any) -> "GPUArray":
        """Integer or step-1 slice indexing of the first axis (the result stays contiguous)."""
        if not self.flags.c_contiguous:
            raise NotImplementedError("indexing is supported for C-contiguous arrays only")
        if not isinstance(index, tuple):
            index = (index,)
        if not self.shape:
            raise IndexError("too many indices for a 0-dimensional array")
        rest = index[1:]
        for i, r in enumerate(rest, start=1):
            if not (isinstance(r, slice) and r == slice(None)) and r is not Ellipsis:
                raise NotImplementedError("only the first axis can be indexed (results must stay "
                                          "contiguous)")
        first = index[0]
        row = self.size // self.shape[0] if self.shape[0] else 0
        if isinstance(first, (numbers.Integral, np.integer)):
            i = int(first)
            if i < 0:
                i += self.shape[0]
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"index {int(first)} is out of bounds for axis 0 with size "
                                 f"{self.shape[0]}")
            return self._offset_view(i * row, self.shape[1:])
        if isinstance(first, slice):
            start, stop, step = first.indices(self.shape[0])
            if step != 1:
                raise NotImplementedError("only slices with step 1 are supported (the result "
                                          "must stay contiguous)")
            length = builtins.max(0, stop - start)
            return self._offset_view(start * row, (length,) + self.shape[1:])
        if first is Ellipsis:
            return self
        raise TypeError(f"unsupported index {first!r}")

    def __setitem__(self, index: Any, value: Any) -> None:
        target = self[index]
        if isinstance(value, GPUArray):
            if value.size != target.size or value.dtype != target.dtype:
                raise ValueError("shape or dtype mismatch in assignment")
            if target.size:
                _drv.memcpy_dtod_async(target.gpudata, value.gpudata, target.nbytes)
        elif _is_scalar(value):
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

    def _binary(self, other: Any, op: str, reverse: bool = False,
                out_dtype: Any = None) -> "GPUArray":
        if isinstance(other, GPUArray):
            self._check_other(other)
            dtype = np.dtype(out_dtype) if out_dtype is not None else _result_dtype(
                self.dtype, other.dtype, op)
            result = self._new_like_me(dtype)
            if self.size:
                x, y = (other, self) if reverse else (self, other)
                _binary_kernel(op, x.dtype, y.dtype, dtype)(x, y, result)
            return result
        if _is_scalar(other):
            dtype = np.dtype(out_dtype) if out_dtype is not None else _result_dtype(
                self.dtype, other, op)
            result = self._new_like_me(dtype)
            if self.size:
                compute = _compute_dtype(self.dtype, dtype, other, op)
                _scalar_kernel(op, self.dtype, compute, dtype, reverse)(
                    self, _scalar_type(compute, other), result)
            return result
        return NotImplemented

    def _inplace(self, other: Any, op: str) -> "GPUArray":
        if isinstance(other, GPUArray):
            self._check_other(other)
            if self.size:
                _inplace_kernel(op, self.dtype, other.dtype)(self, other)
            return self
        if _is_scalar(other):
            if self.size:
                compute = _compute_dtype(self.dtype, self.dtype, other, op)
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

    def __neg__(self) -> "GPUArray":
        result = self._new_like_me()
        if self.size:
            _unary_kernel("neg", self.dtype)(self, result)
        return result

    def __abs__(self) -> "GPUArray":
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


def _ctype(dtype: np.dtype) -> str:
    return dtype_to_ctype(dtype)


def _expr(op: str, x: str, y: str, ctype: str, kind: str) -> str:
    if op == "**":
        if kind == "f":
            return f"pow(({ctype}){x}, ({ctype}){y})"
        return f"({ctype})pow((double){x}, (double){y})"
    if op in _COMPARISONS:
        return f"({x} {op} {y})"
    return f"({ctype}){x} {op} ({ctype}){y}"


# =============================================================================================
# kernels (memoized per session)

def _fill_kernel(dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("fill", dtype), lambda: ElementwiseKernel(
        f"{t} *z, {t} a", "z[i] = a", "gpurpc_fill"))


def _convert_kernel(src: np.dtype, dst: np.dtype) -> ElementwiseKernel:
    return _kernel(("astype", src, dst), lambda: ElementwiseKernel(
        f"const {_ctype(src)} *x, {_ctype(dst)} *z", f"z[i] = ({_ctype(dst)})x[i]",
        "gpurpc_astype"))


def _binary_kernel(op: str, dx: np.dtype, dy: np.dtype, dz: np.dtype) -> ElementwiseKernel:
    tz = _ctype(dz)
    compute = np.result_type(dx, dy) if op in _COMPARISONS else dz
    return _kernel(("binary", op, dx, dy, dz), lambda: ElementwiseKernel(
        f"const {_ctype(dx)} *x, const {_ctype(dy)} *y, {tz} *z",
        f"z[i] = ({tz})({_expr(op, 'x[i]', 'y[i]', _ctype(compute), compute.kind)})",
        "gpurpc_binary"))


def _scalar_kernel(op: str, dx: np.dtype, ds: np.dtype, dz: np.dtype,
                   reverse: bool) -> ElementwiseKernel:
    tz = _ctype(dz)
    compute = ds if op in _COMPARISONS else dz
    a, b = ("s", "x[i]") if reverse else ("x[i]", "s")
    return _kernel(("scalar", op, dx, ds, dz, reverse), lambda: ElementwiseKernel(
        f"const {_ctype(dx)} *x, {_ctype(ds)} s, {tz} *z",
        f"z[i] = ({tz})({_expr(op, a, b, _ctype(compute), compute.kind)})",
        "gpurpc_scalar_op"))


def _inplace_kernel(op: str, dx: np.dtype, dy: np.dtype) -> ElementwiseKernel:
    tx = _ctype(dx)
    compute = np.result_type(dx, dy)
    if op == "/" and compute.kind in "iub":
        compute = np.dtype(np.float64)
    return _kernel(("inplace", op, dx, dy), lambda: ElementwiseKernel(
        f"{tx} *x, const {_ctype(dy)} *y",
        f"x[i] = ({tx})({_expr(op, 'x[i]', 'y[i]', _ctype(compute), compute.kind)})",
        "gpurpc_inplace"))


def _inplace_scalar_kernel(op: str, dx: np.dtype, ds: np.dtype) -> ElementwiseKernel:
    tx = _ctype(dx)
    compute = ds
    if op == "/" and compute.kind in "iub":
        compute = np.dtype(np.float64)
    return _kernel(("inplace_scalar", op, dx, ds), lambda: ElementwiseKernel(
        f"{tx} *x, {_ctype(ds)} s",
        f"x[i] = ({tx})({_expr(op, 'x[i]', 's', _ctype(compute), compute.kind)})",
        "gpurpc_inplace_scalar"))


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
        f"const {t} *x, {t} *z", f"z[i] = {expr}", "gpurpc_unary"))


def _arange_kernel(dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    return _kernel(("arange", dtype), lambda: ElementwiseKernel(
        f"{t} *z, {t} start, {t} step", f"z[i] = ({t})(start + ({t})i * step)",
        "gpurpc_arange"))


def _minmax_elementwise(what: str, dtype: np.dtype) -> ElementwiseKernel:
    t = _ctype(dtype)
    op = ">" if what == "max" else "<"
    return _kernel(("elwise_minmax", what, dtype), lambda: ElementwiseKernel(
        f"const {t} *a, const {t} *b, {t} *z", f"z[i] = (a[i] {op} b[i]) ? a[i] : b[i]",
        f"gpurpc_{what}imum"))


# =============================================================================================
# constructors

def empty(shape: Any, dtype: Any, allocator: Optional[Callable[[int], Any]] = None,
          order: Literal["C", "F"] = "C") -> GPUArray:
    """An uninitialised array."""
    return GPUArray(shape, dtype, allocator, order=order)


def zeros(shape: Any, dtype: Any, allocator: Optional[Callable[[int], Any]] = None,
          order: Literal["C", "F"] = "C") -> GPUArray:
    """An array of zeros."""
    return empty(shape, dtype, allocator, order).fill(0)


def ones(shape: Any, dtype: Any = np.float64, allocator: Optional[Callable[[int], Any]] = None,
         order: Literal["C", "F"] = "C") -> GPUArray:
    """An array of ones."""
    return empty(shape, dtype, allocator, order).fill(1)


def empty_like(other: GPUArray, dtype: Any = None, order: str = "K") -> GPUArray:
    """An uninitialised array like ``other``."""
    return other._new_like_me(dtype)


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
# reductions and other functions

def sum(a: GPUArray, dtype: Any = None, stream: Optional[_drv.Stream] = None,  # noqa: A001
        allocator: Any = None) -> GPUArray:
    """A 0-d array holding the sum (in ``dtype``, default ``a.dtype``)."""
    dtype_out = np.dtype(dtype) if dtype is not None else a.dtype
    if dtype_out.kind == "b":
        dtype_out = np.dtype(np.int64)
    krnl = _kernel(("sum", dtype_out, a.dtype), lambda: get_sum_kernel(dtype_out, a.dtype))
    return krnl(a, stream=stream, allocator=allocator)


def dot(a: GPUArray, b: GPUArray, dtype: Any = None, stream: Optional[_drv.Stream] = None,
        allocator: Any = None) -> GPUArray:
    """A 0-d array holding ``sum(a*b)``."""
    if a.size != b.size:
        raise ValueError(f"dot: sizes differ ({a.size} and {b.size})")
    dtype_out = np.dtype(dtype) if dtype is not None else np.result_type(a.dtype, b.dtype)
    krnl = _kernel(("dot", dtype_out, a.dtype, b.dtype),
                   lambda: get_dot_kernel(dtype_out, a.dtype, b.dtype))
    return krnl(a, b, stream=stream, allocator=allocator)


def _minmax(what: str, a: GPUArray, stream: Optional[_drv.Stream]) -> GPUArray:
    if a.size == 0:
        raise ValueError(f"zero-size array to reduction operation {what} which has no identity")
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


def maximum(a: GPUArray, b: GPUArray, out: Optional[GPUArray] = None,
            stream: Optional[_drv.Stream] = None) -> GPUArray:
    """Elementwise maximum of two arrays of the same dtype."""
    return _elementwise_minmax("max", a, b, out, stream)


def minimum(a: GPUArray, b: GPUArray, out: Optional[GPUArray] = None,
            stream: Optional[_drv.Stream] = None) -> GPUArray:
    """Elementwise minimum of two arrays of the same dtype."""
    return _elementwise_minmax("min", a, b, out, stream)


def _elementwise_minmax(what: str, a: GPUArray, b: GPUArray, out: Optional[GPUArray],
                        stream: Optional[_drv.Stream]) -> GPUArray:
    if a.dtype != b.dtype:
        raise TypeError(f"{what}imum needs arrays of one dtype")
    a._check_other(b)
    if out is None:
        out = a._new_like_me()
    if a.size:
        _minmax_elementwise(what, a.dtype)(a, b, out, stream=stream)
    return out
