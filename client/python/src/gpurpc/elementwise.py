"""``pycuda.elementwise.ElementwiseKernel``: a kernel from a C expression over array elements.

::

    lin_comb = ElementwiseKernel(
        "float a, float *x, float b, float *y, float *z",
        "z[i] = a*x[i] + b*y[i]",
        "linear_combination")
    lin_comb(np.float32(5), x_gpu, np.float32(6), y_gpu, z_gpu)

The generated kernel loops ``i`` over the elements of the first array argument (a grid-stride
loop, ``unsigned long long i``); ``range=slice(...)``/``slice=`` restrict it (then ``i`` is a
``long long``). Scalar arguments are converted by the prepared call's types, so plain Python
numbers work here, as in PyCUDA.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _context
from . import driver as _drv
from .compiler import SourceModule
from .tools import Argument, ScalarArg, VectorArg, dtype_to_ctype, parse_c_args

__all__ = ["ElementwiseKernel", "get_elwise_module", "get_elwise_range_module", "splay",
           "COMPLEX_PREAMBLE"]

# Complex numbers in generated kernels: CUDA's own ``cuda::std::complex`` (libcu++, which NVRTC
# finds), under PyCUDA's name ``pycuda::complex<T>`` so that kernels written for PyCUDA compile
# unchanged. ``real``, ``imag``, ``conj``, ``abs`` and the other functions of <complex> are
# found by argument-dependent lookup, and also as ``pycuda::...``. Like pycuda-complex.hpp it
# is wrapped in ``extern "C++"``, so it also works inside SourceModule's ``extern "C"`` block.
COMPLEX_PREAMBLE = """
#ifndef GPURPC_PYCUDA_COMPLEX
#define GPURPC_PYCUDA_COMPLEX
extern "C++" {
#include <cuda/std/complex>
namespace pycuda {
template <typename T> using complex = cuda::std::complex<T>;
using cuda::std::real; using cuda::std::imag; using cuda::std::conj; using cuda::std::abs;
using cuda::std::arg; using cuda::std::norm; using cuda::std::polar; using cuda::std::proj;
using cuda::std::exp; using cuda::std::log; using cuda::std::log10; using cuda::std::sqrt;
using cuda::std::pow; using cuda::std::sin; using cuda::std::cos; using cuda::std::tan;
using cuda::std::asin; using cuda::std::acos; using cuda::std::atan; using cuda::std::sinh;
using cuda::std::cosh; using cuda::std::tanh; using cuda::std::asinh; using cuda::std::acosh;
using cuda::std::atanh;
}
}
#endif
"""

# (gpurpc.tools registers complex64/complex128 under these names.)


def _with_complex(arguments: Sequence[Argument], preamble: str) -> str:
    """``preamble``, preceded by the complex header when an argument is complex."""
    if any(a.dtype.kind == "c" for a in arguments):
        return COMPLEX_PREAMBLE + preamble
    return preamble


def _splay(core: Any, n: int) -> Tuple[Tuple[int, int], Tuple[int, int, int]]:
    """:func:`splay` on the session's device, memoized per session."""
    cache = core.caches.get("splay")
    if cache is None:
        cache = core.caches["splay"] = {}
    result = cache.get(n)
    if result is None:
        if len(cache) > 4096:
            cache.clear()
        result = cache[n] = splay(n, _drv.Context.get_device())
    return result


def splay(n: int, dev: Optional[_drv.Device] = None,
          ) -> Tuple[Tuple[int, int], Tuple[int, int, int]]:
    """PyCUDA's launch shape for n elements: ``((blocks, 1), (threads, 1, 1))``."""
    if dev is None:
        return _splay(_context._current_core("splay"), n)
    min_threads = dev.get_attribute(_drv.device_attribute.WARP_SIZE) or 32
    max_threads = 128
    mp = dev.get_attribute(_drv.device_attribute.MULTIPROCESSOR_COUNT) or 1
    major = dev.compute_capability()[0]
    blocks_per_mp = 8 if major < 3 else (16 if major < 5 else 32)
    max_blocks = 4 * blocks_per_mp * mp
    if n < min_threads:
        block_count, threads_per_block = 1, min_threads
    elif n < max_blocks * min_threads:
        block_count = (n + min_threads - 1) // min_threads
        threads_per_block = min_threads
    elif n < max_blocks * max_threads:
        block_count = max_blocks
        grp = (n + min_threads - 1) // min_threads
        threads_per_block = ((grp + max_blocks - 1) // max_blocks) * min_threads
    else:
        block_count, threads_per_block = max_blocks, max_threads
    return (block_count, 1), (threads_per_block, 1, 1)


_MODULE_TEMPLATE = """
%(preamble)s

__global__ void %(name)s(%(arguments)s)
{
  unsigned long long tid = threadIdx.x;
  unsigned long long total_threads = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long cta_start = (unsigned long long)blockDim.x * blockIdx.x;
  unsigned long long i;

  %(loop_prep)s;

  for (i = cta_start + tid; i < n; i += total_threads)
  {
    %(operation)s;
  }

  %(after_loop)s;
}
"""

_RANGE_TEMPLATE = """
%(preamble)s

__global__ void %(name)s(%(arguments)s)
{
  long long tid = threadIdx.x;
  long long total_threads = (long long)gridDim.x * blockDim.x;
  long long cta_start = (long long)blockDim.x * blockIdx.x;
  long long i;

  %(loop_prep)s;

  if (step < 0)
  {
    for (i = start + (cta_start + tid) * step; i > stop; i += total_threads * step)
    {
      %(operation)s;
    }
  }
  else
  {
    for (i = start + (cta_start + tid) * step; i < stop; i += total_threads * step)
    {
      %(operation)s;
    }
  }

  %(after_loop)s;
}
"""


def _declarators(arguments: Sequence[Argument]) -> str:
    return ", ".join(a.declarator() for a in arguments)  # type: ignore[attr-defined]


def get_elwise_module(arguments: Sequence[Argument], operation: str, name: str = "kernel",
                      keep: bool = False, options: Optional[Sequence[str]] = None,
                      preamble: str = "", loop_prep: str = "", after_loop: str = "",
                      ) -> SourceModule:
    """Compiles the loop kernel; ``arguments`` must end with the ``n`` argument."""
    return SourceModule(_MODULE_TEMPLATE % {
        "arguments": _declarators(arguments), "operation": operation, "name": name,
        "preamble": _with_complex(arguments, preamble), "loop_prep": loop_prep,
        "after_loop": after_loop,
    }, options=options, keep=keep)


def get_elwise_range_module(arguments: Sequence[Argument], operation: str, name: str = "kernel",
                            keep: bool = False, options: Optional[Sequence[str]] = None,
                            preamble: str = "", loop_prep: str = "", after_loop: str = "",
                            ) -> SourceModule:
    """Compiles the range variant; ``arguments`` must end with start, stop, step."""
    return SourceModule(_RANGE_TEMPLATE % {
        "arguments": _declarators(arguments), "operation": operation, "name": name,
        "preamble": _with_complex(arguments, preamble), "loop_prep": loop_prep,
        "after_loop": after_loop,
    }, options=options, keep=keep)


class ElementwiseKernel:
    """``ElementwiseKernel(arguments, operation, name="kernel", keep=False, options=None,
    preamble="", loop_prep="", after_loop="")``; call it with the arguments in order and
    optionally ``range=``, ``slice=`` and ``stream=``."""

    def __init__(self, arguments: Union[str, List[Argument]], operation: str,
                 name: str = "kernel", keep: bool = False,
                 options: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        self.arguments = parse_c_args(arguments)
        if not any(isinstance(a, VectorArg) for a in self.arguments):
            raise ValueError("ElementwiseKernel can only be used with functions that have at "
                             "least one vector argument")
        self.operation = operation
        self.name = name
        self.keep = keep
        self.options = options
        self.gen_kwargs = {k: kwargs.get(k, "") for k in ("preamble", "loop_prep", "after_loop")}
        unknown = set(kwargs) - set(self.gen_kwargs)
        if unknown:
            raise TypeError(f"unknown keyword arguments: {', '.join(sorted(unknown))}")
        self._funcs: Dict[Any, _drv.Function] = {}
        # (session, n) -> (function, launch prefix) of _launch_dense
        self._dense: Dict[Any, Tuple[_drv.Function, bytes]] = {}
        self._vector_positions = tuple(i for i, a in enumerate(self.arguments)
                                       if isinstance(a, VectorArg))
        self._get_func(False)  # compile now: errors show where the kernel is defined

    def _get_func(self, use_range: bool) -> _drv.Function:
        core = _context._current_core("ElementwiseKernel")
        key = (core, use_range)
        func = self._funcs.get(key)  # type: ignore[arg-type]
        if func is None:
            if use_range:
                args = self.arguments + [ScalarArg(np.int64, "start"), ScalarArg(np.int64, "stop"),
                                         ScalarArg(np.int64, "step")]
                mod = get_elwise_range_module(args, self.operation, self.name, self.keep,
                                              self.options, **self.gen_kwargs)
            else:
                args = self.arguments + [ScalarArg(np.uint64, "n")]
                mod = get_elwise_module(args, self.operation, self.name, self.keep,
                                        self.options, **self.gen_kwargs)
            func = mod.get_function(self.name)
            func.prepare("".join(a.struct_char for a in args))  # type: ignore[attr-defined]
            self._funcs[key] = func  # type: ignore[index]
        return func

    def get_texref(self, name: str, use_range: bool = False) -> Any:
        """Not available: raises LogicError."""
        raise _drv.LogicError("texture references are not available (removed in CUDA 12)")

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """Launches over the elements of the first array argument (asynchronously)."""
        # The hot path of every gpuarray operator: one context lookup, no per-argument
        # isinstance on the declarations.
        range_ = kwargs.pop("range", None)
        slice_ = kwargs.pop("slice", None)
        stream = kwargs.pop("stream", None)
        if kwargs:
            raise TypeError("invalid keyword arguments: " + ", ".join(kwargs))
        if len(args) != len(self.arguments):
            raise TypeError(f"{self.name}: takes {len(self.arguments)} arguments, "
                            f"{len(args)} given")
        invocation_args = list(args)
        for i in self._vector_positions:
            arg = args[i]
            flags = getattr(arg, "flags", None)
            if flags is not None and not flags.forc:
                raise RuntimeError("elementwise kernel cannot deal with non-contiguous arrays")
            try:
                gpudata = arg.gpudata
            except AttributeError:
                raise TypeError(f"{self.name}: argument {self.arguments[i].name!r} must be a "
                                "GPUArray") from None
            invocation_args[i] = gpudata if gpudata is not None else 0
        repr_vec = args[self._vector_positions[0]]
        if slice_ is not None:
            if range_ is not None:
                raise TypeError("may not specify both range and slice keyword arguments")
            range_ = slice(*slice_.indices(repr_vec.size))
        if range_ is not None:
            start = 0 if range_.start is None else range_.start
            stop = range_.stop
            step = 1 if range_.step is None else range_.step
            if stop is None:
                raise ValueError("range needs a stop")
            count = max(0, (stop - start + step - (1 if step > 0 else -1)) // step)
            if count == 0:
                return
            core = _context._current_core("ElementwiseKernel")
            grid, block = _splay(core, count)
            invocation_args += [start, stop, step]
            func = self._funcs.get((core, True)) or self._get_func(True)
        else:
            size = repr_vec.size
            if size == 0:
                return
            core = _context._current_core("ElementwiseKernel")
            grid, block = _splay(core, size)
            invocation_args.append(size)
            func = self._funcs.get((core, False)) or self._get_func(False)
        func.prepared_async_call(grid, block, stream, *invocation_args)


    def _launch_dense(self, core: Any, size: int, *args: Any) -> None:
        """The gpuarray operators' launch (their hot path): over ``size`` > 0 elements, on the
        default stream of ``core``, the current session; ``args`` are the kernel's arguments
        with each array's ``gpudata`` in its place (contiguous arrays, which the caller has
        checked). The same launch as ``self(*arrays)``, its shape and prefix made once per
        session and size."""
        launch = self._dense.get((core, size))
        if launch is None:
            func = self._funcs.get((core, False)) or self._get_func(False)
            grid, block = _splay(core, size)
            if len(self._dense) > 256:
                self._dense.clear()
            launch = self._dense[(core, size)] = (func, func._launch_prefix(grid, block, 0))
        launch[0]._launch_with(launch[1], (*args, size))


def get_ctype(dtype: Any) -> str:
    return dtype_to_ctype(dtype)
