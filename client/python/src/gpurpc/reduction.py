"""``pycuda.reduction.ReductionKernel``: map each element, then reduce, in two stages.

::

    dot = ReductionKernel(np.float32, neutral="0", reduce_expr="a+b",
                          map_expr="x[i]*y[i]", arguments="float *x, float *y")
    result = dot(x_gpu, y_gpu).get()

``map_expr`` sees the arguments and the index ``i``; ``reduce_expr`` combines ``a`` and ``b``.
The call returns a 0-dimensional GPUArray (``out=`` to reuse one). Stage 1 reduces blocks of
512 threads, stage 2 (one block) reduces the partial results.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _context, _memory
from . import driver as _drv
from . import elementwise
from .compiler import SourceModule
from .tools import Argument, VectorArg, dtype_to_ctype, parse_c_args

__all__ = ["ReductionKernel", "get_sum_kernel", "get_dot_kernel", "get_minmax_kernel"]

BLOCK_SIZE = 512
SMALL_SEQ_COUNT = 4
MAX_BLOCK_COUNT = 1024

_SOURCE = """
#define BLOCK_SIZE %(block_size)d
#define READ_AND_MAP(i) (%(map_expr)s)
#define REDUCE(a, b) (%(reduce_expr)s)

%(preamble)s

typedef %(out_type)s out_type;

extern "C" __global__ void %(name)s(out_type *out, %(arguments)s
  unsigned long long seq_count, unsigned long long n)
{
  __shared__ out_type sdata[BLOCK_SIZE];
  unsigned int tid = threadIdx.x;
  unsigned long long i = (unsigned long long)blockIdx.x * BLOCK_SIZE * seq_count + tid;

  out_type acc = %(neutral)s;
  for (unsigned long long s = 0; s < seq_count; ++s)
  {
    if (i >= n)
      break;
    acc = REDUCE(acc, READ_AND_MAP(i));
    i += BLOCK_SIZE;
  }
  sdata[tid] = acc;
  __syncthreads();

  for (unsigned int stride = BLOCK_SIZE / 2; stride > 0; stride >>= 1)
  {
    if (tid < stride)
      sdata[tid] = REDUCE(sdata[tid], sdata[tid + stride]);
    __syncthreads();
  }

  if (tid == 0)
    out[blockIdx.x] = sdata[0];
}
"""


def _stage(out_type: str, arguments: Sequence[Argument], map_expr: str, reduce_expr: str,
           neutral: str, name: str, preamble: str, keep: bool,
           options: Optional[Sequence[str]]) -> _drv.Function:
    decls = "".join(a.declarator() + ", " for a in arguments)  # type: ignore[attr-defined]
    if "complex" in out_type or any(a.dtype.kind == "c" for a in arguments):
        # The complex header, as ElementwiseKernel adds it (guarded: twice is harmless).
        preamble = elementwise.COMPLEX_PREAMBLE + preamble
    source = _SOURCE % {
        "block_size": BLOCK_SIZE, "map_expr": map_expr, "reduce_expr": reduce_expr,
        "preamble": preamble, "out_type": out_type, "name": name, "arguments": decls,
        "neutral": neutral,
    }
    mod = SourceModule(source, options=options, keep=keep, no_extern_c=True)
    func = mod.get_function(name)
    chars = "".join(a.struct_char for a in arguments)  # type: ignore[attr-defined]
    func.prepare("P" + chars + "QQ")
    return func


class ReductionKernel:
    """``ReductionKernel(dtype_out, neutral, reduce_expr, map_expr=None, arguments=None,
    name="reduce_kernel", keep=False, options=None, preamble="", allocator=None)``;
    call it with the arguments and optionally ``stream=``, ``out=``, ``range=``/``slice=``."""

    def __init__(self, dtype_out: Any, neutral: str, reduce_expr: str,
                 map_expr: Optional[str] = None, arguments: Union[str, List[Argument], None] = None,
                 name: str = "reduce_kernel", keep: bool = False,
                 options: Optional[Sequence[str]] = None, preamble: str = "",
                 allocator: Any = None) -> None:
        self.dtype_out = np.dtype(dtype_out)
        if arguments is None:
            raise ValueError("ReductionKernel needs arguments")
        self.arguments = parse_c_args(arguments)
        if not any(isinstance(a, VectorArg) for a in self.arguments):
            raise ValueError("ReductionKernel can only be used with functions that have at "
                             "least one vector argument")
        if map_expr is None:
            vectors = [a for a in self.arguments if isinstance(a, VectorArg)]
            if len(vectors) != 1:
                raise ValueError("map_expr is needed with more than one vector argument")
            map_expr = f"{vectors[0].name}[i]"
        self.neutral = neutral
        self.reduce_expr = reduce_expr
        self.map_expr = map_expr
        self.name = name
        self.keep = keep
        self.options = options
        self.preamble = preamble
        self.allocator = allocator
        self._funcs: Dict[Any, Tuple[_drv.Function, _drv.Function]] = {}
        self._get_funcs()

    def _get_funcs(self) -> Tuple[_drv.Function, _drv.Function]:
        core = _context._current_core("ReductionKernel")
        funcs = self._funcs.get(core)  # type: ignore[call-overload]
        if funcs is None:
            out_type = dtype_to_ctype(self.dtype_out)
            stage1 = _stage(out_type, self.arguments, self.map_expr, self.reduce_expr,
                            self.neutral, self.name + "_stage1", self.preamble, self.keep,
                            self.options)
            stage2 = _stage(out_type, [VectorArg(self.dtype_out, "pycuda_reduction_inp")],
                            "pycuda_reduction_inp[i]", self.reduce_expr, self.neutral,
                            self.name + "_stage2", self.preamble, self.keep, self.options)
            funcs = self._funcs[core] = (stage1, stage2)  # type: ignore[index]
        return funcs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Reduces; returns a 0-d GPUArray (``out`` if given)."""
        from . import gpuarray

        stream = kwargs.pop("stream", None)
        out = kwargs.pop("out", None)
        allocator = kwargs.pop("allocator", self.allocator)
        range_ = kwargs.pop("range", None)
        slice_ = kwargs.pop("slice", None)
        if kwargs:
            raise TypeError("invalid keyword arguments: " + ", ".join(kwargs))
        if len(args) != len(self.arguments):
            raise TypeError(f"{self.name}: takes {len(self.arguments)} arguments, "
                            f"{len(args)} given")
        stage1, stage2 = self._get_funcs()

        invocation_args: List[Any] = []
        vectors = []
        for arg, descr in zip(args, self.arguments):
            if isinstance(descr, VectorArg):
                if hasattr(arg, "flags") and not arg.flags.forc:
                    raise RuntimeError("ReductionKernel cannot deal with non-contiguous arrays")
                vectors.append(arg)
                invocation_args.append(arg.gpudata if arg.gpudata is not None else 0)
            else:
                invocation_args.append(arg)
        repr_vec = vectors[0]
        start = 0
        size = repr_vec.size
        if slice_ is not None:
            range_ = slice(*slice_.indices(repr_vec.size))
        if range_ is not None:
            if range_.step not in (None, 1):
                raise ValueError("ReductionKernel supports only ranges with step 1")
            start = range_.start or 0
            size = max(0, range_.stop - start)
        if start:
            # Shift every vector argument: the kernel indexes from 0.
            shifted = []
            for arg, descr, value in zip(args, self.arguments, invocation_args):
                if isinstance(descr, VectorArg):
                    value = _memory._address(value) + start * descr.dtype.itemsize
                shifted.append(value)
            invocation_args = shifted

        func = stage1
        while True:
            if size <= BLOCK_SIZE * SMALL_SEQ_COUNT * MAX_BLOCK_COUNT:
                total_block_size = SMALL_SEQ_COUNT * BLOCK_SIZE
                block_count = (size + total_block_size - 1) // total_block_size
                seq_count = SMALL_SEQ_COUNT
            else:
                block_count = MAX_BLOCK_COUNT
                macroblock_size = block_count * BLOCK_SIZE
                seq_count = (size + macroblock_size - 1) // macroblock_size
            block_count = max(block_count, 1)
            if block_count == 1 and out is not None:
                result = out
            elif block_count == 1:
                result = gpuarray.empty((), self.dtype_out, allocator=allocator)
            else:
                result = gpuarray.empty((block_count,), self.dtype_out, allocator=allocator)
            func.prepared_async_call((block_count, 1), (BLOCK_SIZE, 1, 1), stream,
                                     result.gpudata, *invocation_args, seq_count, size)
            if block_count == 1:
                return result
            func = stage2
            invocation_args = [result.gpudata]
            size = result.size


def _neutral_min(dtype: np.dtype) -> str:
    if dtype == np.float32:
        return "__int_as_float(0xff800000)"
    if dtype == np.float64:
        return "__longlong_as_double(0xfff0000000000000ULL)"
    info = np.iinfo(dtype)
    return _int_literal(int(info.min), dtype)


def _neutral_max(dtype: np.dtype) -> str:
    if dtype == np.float32:
        return "__int_as_float(0x7f800000)"
    if dtype == np.float64:
        return "__longlong_as_double(0x7ff0000000000000ULL)"
    info = np.iinfo(dtype)
    return _int_literal(int(info.max), dtype)


def _int_literal(value: int, dtype: np.dtype) -> str:
    ctype = dtype_to_ctype(dtype)
    if value < 0:
        return f"(({ctype})({value + 1}LL - 1))"
    return f"(({ctype}){value}ULL)"


def get_sum_kernel(dtype_out: Any, dtype_in: Any) -> ReductionKernel:
    """The ReductionKernel behind ``gpuarray.sum``."""
    dtype_out = np.dtype(dtype_out)
    return ReductionKernel(dtype_out, "0", "a+b",
                           map_expr=f"({dtype_to_ctype(dtype_out)})in[i]",
                           arguments=f"const {dtype_to_ctype(dtype_in)} *in", name="sum")


def get_dot_kernel(dtype_out: Any, dtype_a: Any, dtype_b: Any) -> ReductionKernel:
    """The ReductionKernel behind ``gpuarray.dot``."""
    dtype_out = np.dtype(dtype_out)
    out_type = dtype_to_ctype(dtype_out)
    return ReductionKernel(dtype_out, "0", "a+b",
                           map_expr=f"({out_type})a[i]*({out_type})b[i]",
                           arguments=f"const {dtype_to_ctype(dtype_a)} *a, "
                                     f"const {dtype_to_ctype(dtype_b)} *b", name="dot")


def get_minmax_kernel(what: str, dtype: Any) -> ReductionKernel:
    """The ReductionKernel behind ``gpuarray.max``/``min`` (``what`` is "max" or "min")."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        reduce_expr = f"f{what}(a,b)"
    elif dtype == np.float32:
        reduce_expr = f"f{what}f(a,b)"
    elif dtype.kind in "iub":
        op = ">" if what == "max" else "<"
        reduce_expr = f"((a {op} b) ? a : b)"
    else:
        raise TypeError(f"unsupported dtype for {what}: {dtype}")
    neutral = _neutral_min(dtype) if what == "max" else _neutral_max(dtype)
    return ReductionKernel(dtype, neutral, reduce_expr, map_expr="in[i]",
                           arguments=f"const {dtype_to_ctype(dtype)} *in", name=what)
