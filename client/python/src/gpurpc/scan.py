"""``pycuda.scan``: prefix sums (scans) with any associative operation.

::

    knl = InclusiveScanKernel(np.int32, "a+b")
    knl(dev_data)                               # in place: dev_data[i] = sum(dev_data[:i+1])
    out = ExclusiveScanKernel(np.float64, "a+b", "0")(x_gpu, "new")   # out[i] = sum(x[:i])

``scan_expr`` combines the earlier operand ``a`` with the later ``b`` and must be associative
(it need not be commutative: the order of operands is always kept). ``neutral`` is its neutral
element, required for the exclusive scan (it is ``out[0]``).

The algorithm (ours, three kernels per level):

1. ``<name_prefix>_scan_tiles``: each block scans one tile of ``WG*K`` consecutive elements
   (each thread scans ``K`` elements sequentially, the block scans the thread totals in shared
   memory, each thread adds the total of the threads before it) and writes the tile's total
   to ``tile_sums``;
2. the tile totals are scanned the same way (recursively, until one tile holds them);
3. ``<name_prefix>_final_update`` combines every element of tile ``t > 0`` with the scanned
   total of tiles ``0..t-1``.

For the exclusive scan, the tile kernel writes the exclusive scan of its tile (starting from
``neutral``); the update step is the same. Arrays of any length work (indices are 64-bit);
``input`` and ``output`` may be the same array. Everything is queued on ``stream`` with no
round trip; temporaries come from ``allocator`` (default: the input's, else the session pool).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _context
from . import driver as _drv
from . import elementwise as _elementwise
from .compiler import SourceModule
from .tools import dtype_to_ctype

__all__ = ["InclusiveScanKernel", "ExclusiveScanKernel"]

# Shared memory per block used for one tile (the items, their padding and the thread totals).
_MAX_TILE_BYTES = 40 * 1024
_MAX_GRID_X = (1 << 31) - 1

_SOURCE = r"""
#define SCAN_EXPR(a, b) (%(scan_expr)s)
#define SCAN_WG %(wg)d
#define SCAN_K %(k)d
#define SCAN_TILE (SCAN_WG * SCAN_K)
// One padding slot per 32 items, against shared-memory bank conflicts of the strided reads.
#define SCAN_PAD(j) ((j) + ((j) >> 5))

%(preamble)s

typedef %(scan_type)s scan_type;

__device__ __forceinline__ void %(name_prefix)s_scan_tile(
    const scan_type *input, scan_type *output, scan_type *tile_sums,
    unsigned long long n, bool exclusive)
{
  // Raw storage: __shared__ arrays cannot hold types with constructors (complex, user structs).
  __shared__ __align__(alignof(scan_type))
      unsigned char items_storage[sizeof(scan_type) * SCAN_PAD(SCAN_TILE)];
  __shared__ __align__(alignof(scan_type))
      unsigned char totals_storage[sizeof(scan_type) * SCAN_WG];
  scan_type *items = reinterpret_cast<scan_type *>(items_storage);
  scan_type *totals = reinterpret_cast<scan_type *>(totals_storage);

  const unsigned int tid = threadIdx.x;
  const unsigned long long base = (unsigned long long)blockIdx.x * SCAN_TILE;
  const unsigned long long rest = n - base;
  const unsigned int count = rest < (unsigned long long)SCAN_TILE ? (unsigned int)rest : SCAN_TILE;

  // Coalesced load of the tile.
  for (unsigned int k = 0; k < SCAN_K; ++k)
  {
    const unsigned int j = k * SCAN_WG + tid;
    if (j < count)
      items[SCAN_PAD(j)] = input[base + j];
  }
  __syncthreads();

  // Each thread scans its SCAN_K consecutive items (inclusive) and keeps their total.
  const unsigned int first = tid * SCAN_K;
  const unsigned int mine = first < count ? min((unsigned int)SCAN_K, count - first) : 0u;
  if (mine > 0)
  {
    scan_type acc = items[SCAN_PAD(first)];
    for (unsigned int k = 1; k < mine; ++k)
    {
      acc = SCAN_EXPR(acc, items[SCAN_PAD(first + k)]);
      items[SCAN_PAD(first + k)] = acc;
    }
    totals[tid] = acc;
  }
  __syncthreads();

  // Inclusive scan of the totals of the active threads (a prefix of the block).
  const unsigned int active = (count + SCAN_K - 1) / SCAN_K;
  for (unsigned int offset = 1; offset < SCAN_WG; offset <<= 1)
  {
    const bool update = tid >= offset && tid < active;
    scan_type value;
    if (update)
      value = SCAN_EXPR(totals[tid - offset], totals[tid]);
    __syncthreads();
    if (update)
      totals[tid] = value;
    __syncthreads();
  }

  // Combine each item with the total of the threads before its thread.
  if (mine > 0)
  {
    if (exclusive)
    {
      const scan_type carry = tid > 0 ? totals[tid - 1] : (scan_type)(%(neutral)s);
      for (unsigned int k = mine - 1; k > 0; --k)
        items[SCAN_PAD(first + k)] = tid > 0 ? SCAN_EXPR(carry, items[SCAN_PAD(first + k - 1)])
                                        : items[SCAN_PAD(first + k - 1)];
      items[SCAN_PAD(first)] = carry;
    }
    else if (tid > 0)
    {
      const scan_type carry = totals[tid - 1];
      for (unsigned int k = 0; k < mine; ++k)
        items[SCAN_PAD(first + k)] = SCAN_EXPR(carry, items[SCAN_PAD(first + k)]);
    }
  }
  __syncthreads();

  for (unsigned int k = 0; k < SCAN_K; ++k)
  {
    const unsigned int j = k * SCAN_WG + tid;
    if (j < count)
      output[base + j] = items[SCAN_PAD(j)];
  }
  if (tid == 0 && tile_sums != 0)
    tile_sums[blockIdx.x] = totals[active - 1];
}

extern "C" __global__ void __launch_bounds__(SCAN_WG) %(name_prefix)s_scan_tiles(
    const scan_type *input, scan_type *output, scan_type *tile_sums, unsigned long long n)
{
  %(name_prefix)s_scan_tile(input, output, tile_sums, n, false);
}
%(exclusive_kernel)s
extern "C" __global__ void __launch_bounds__(SCAN_WG) %(name_prefix)s_final_update(
    scan_type *output, const scan_type *scanned_tile_sums, unsigned long long n)
{
  // Block b updates tile b + 1 (tile 0 needs no update).
  const unsigned long long tile = (unsigned long long)blockIdx.x + 1;
  const scan_type carry = scanned_tile_sums[tile - 1];
  const unsigned long long begin = tile * SCAN_TILE;
  const unsigned long long end = begin + SCAN_TILE < n ? begin + SCAN_TILE : n;
  for (unsigned long long i = begin + threadIdx.x; i < end; i += SCAN_WG)
    output[i] = SCAN_EXPR(carry, output[i]);
}
"""

_EXCLUSIVE_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(SCAN_WG) %(name_prefix)s_scan_tiles_exclusive(
    const scan_type *input, scan_type *output, scan_type *tile_sums, unsigned long long n)
{
  %(name_prefix)s_scan_tile(input, output, tile_sums, n, true);
}
"""

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _tile_shape(itemsize: int) -> Tuple[int, int]:
    """``(WG, K)``: threads per block and items per thread, so that a tile's shared memory
    stays within ``_MAX_TILE_BYTES``."""
    def nbytes(wg: int, k: int) -> int:
        tile = wg * k
        return itemsize * (tile + tile // 32 + wg)

    wg, k = 256, 8
    while k > 1 and nbytes(wg, k) > _MAX_TILE_BYTES:
        k //= 2
    while wg > 32 and nbytes(wg, k) > _MAX_TILE_BYTES:
        wg //= 2
    if nbytes(wg, k) > _MAX_TILE_BYTES:
        raise ValueError(f"scan: elements of {itemsize} bytes are too large for a scan tile in "
                         f"shared memory (at most {_MAX_TILE_BYTES // (32 + 1 + 32)} bytes)")
    return wg, k


def _scan_source(dtype: np.dtype, scan_expr: str, neutral: Optional[str], name_prefix: str,
                 preamble: str, exclusive: bool) -> str:
    """The CUDA source of a scan's kernels (one module)."""
    wg, k = _tile_shape(dtype.itemsize)
    if dtype.kind == "c":
        # The complex C++ type of the kernel generators (elementwise's header), when they have
        # one; dtype_to_ctype below says so when they do not.
        preamble = getattr(_elementwise, "COMPLEX_PREAMBLE", "") + preamble
    params = {
        "scan_expr": scan_expr, "wg": wg, "k": k, "preamble": preamble,
        "scan_type": dtype_to_ctype(dtype), "name_prefix": name_prefix,
        "neutral": neutral if neutral is not None else "scan_type()",
    }
    params["exclusive_kernel"] = _EXCLUSIVE_KERNEL % params if exclusive else ""
    return _SOURCE % params


def _levels(n: int, tile_size: int) -> List[Tuple[int, int]]:
    """``(length, tiles)`` of each level of a scan of n elements: level 0 is the array, each
    further level the tile sums of the one below, until one tile holds them."""
    levels = []
    length = n
    while True:
        count = (length + tile_size - 1) // tile_size
        if count > _MAX_GRID_X:
            raise ValueError(f"{n} elements are too many for one scan (at most "
                             f"{_MAX_GRID_X * tile_size})")
        levels.append((length, count))
        if count == 1:
            return levels
        length = count


class _ScanKernelBase:
    """The common part of :class:`InclusiveScanKernel` and :class:`ExclusiveScanKernel`."""

    _exclusive = False

    def __init__(self, dtype: Any, scan_expr: str, neutral: Optional[Any] = None,
                 name_prefix: str = "scan", options: Optional[Sequence[str]] = None,
                 preamble: str = "", devices: Any = None) -> None:
        self.dtype = np.dtype(dtype)
        if not isinstance(scan_expr, str) or not scan_expr.strip():
            raise ValueError("scan_expr must be a C expression in a and b, such as \"a+b\"")
        if self._exclusive and neutral is None:
            raise ValueError("neutral element is required for exclusive scan")
        if not isinstance(name_prefix, str) or not _IDENTIFIER.match(name_prefix):
            raise ValueError(f"name_prefix must be a C identifier, got {name_prefix!r}")
        self.scan_expr = scan_expr
        self.neutral = None if neutral is None else str(neutral)
        self.name_prefix = name_prefix
        self.options = options
        self.preamble = preamble
        # ``devices`` is PyOpenCL's; PyCUDA accepts and ignores it, and so do we.
        self.devices = devices
        self.wg_size, self.seq_count = _tile_shape(self.dtype.itemsize)
        self.tile_size = self.wg_size * self.seq_count
        self._modules: Dict[Any, SourceModule] = {}
        self._funcs: Dict[Any, Tuple[_drv.Function, Optional[_drv.Function], _drv.Function]] = {}
        self._get_module()  # compile now: errors show where the kernel is defined

    def _get_module(self) -> SourceModule:
        core = _context._current_core(type(self).__name__)
        mod = self._modules.get(core)  # type: ignore[call-overload]
        if mod is None:
            mod = self._modules[core] = SourceModule(  # type: ignore[index]
                _scan_source(self.dtype, self.scan_expr, self.neutral, self.name_prefix,
                             self.preamble, self._exclusive),
                options=self.options, no_extern_c=True)
        return mod

    def _get_funcs(self) -> Tuple[_drv.Function, Optional[_drv.Function], _drv.Function]:
        core = _context._current_core(type(self).__name__)
        funcs = self._funcs.get(core)  # type: ignore[call-overload]
        if funcs is None:
            mod = self._get_module()
            tiles = mod.get_function(self.name_prefix + "_scan_tiles")
            tiles.prepare("PPPQ")
            tiles_exclusive = None
            if self._exclusive:
                tiles_exclusive = mod.get_function(self.name_prefix + "_scan_tiles_exclusive")
                tiles_exclusive.prepare("PPPQ")
            update = mod.get_function(self.name_prefix + "_final_update")
            update.prepare("PPQ")
            funcs = self._funcs[core] = (tiles, tiles_exclusive, update)  # type: ignore[index]
        return funcs

    def _check_array(self, what: str, ary: Any) -> None:
        if not hasattr(ary, "gpudata") or not hasattr(ary, "flags"):
            raise TypeError(f"{type(self).__name__}: {what} must be a GPUArray, got "
                            f"{type(ary).__name__}")
        if not ary.flags.forc:
            raise RuntimeError(f"{type(self).__name__} cannot deal with non-contiguous arrays "
                               f"({what})")
        if ary.dtype != self.dtype:
            raise TypeError(f"{type(self).__name__}: {what} has dtype {ary.dtype}, but the "
                            f"kernel was made for {self.dtype}")
        if len(ary.shape) != 1:
            raise ValueError(f"{type(self).__name__}: {what} must be 1-dimensional, got shape "
                             f"{ary.shape} (scan a .ravel() view)")

    def __call__(self, input_ary: Any, output_ary: Any = None,
                 allocator: Optional[Callable[[int], Any]] = None,
                 stream: Optional[_drv.Stream] = None) -> Any:
        """Scans ``input_ary`` into ``output_ary`` and returns it: by default the input itself
        (in place), ``"new"`` for a new array, or a GPUArray of the same shape and dtype."""
        from . import gpuarray

        self._check_array("the input", input_ary)
        if allocator is None:
            allocator = input_ary.allocator
        if output_ary is None:
            output_ary = input_ary
        elif isinstance(output_ary, str):
            if output_ary != "new":
                raise ValueError(f"{type(self).__name__}: output_ary must be a GPUArray, None "
                                 f"or \"new\", got {output_ary!r}")
            output_ary = gpuarray.empty(input_ary.shape, self.dtype, allocator=allocator)
        else:
            self._check_array("the output", output_ary)
            if output_ary.shape != input_ary.shape:
                raise ValueError("input and output must have the same shape")
        n = input_ary.size
        if n == 0:
            return output_ary
        tiles, tiles_exclusive, update = self._get_funcs()

        # Level 0 scans the input into the output; every further level scans the tile sums of
        # the one below it in place. Then, from the top down, each level's tiles are combined
        # with the scanned sums of the tiles before them.
        levels = _levels(n, self.tile_size)
        data = [output_ary.gpudata]
        sums = [gpuarray.empty((count,), self.dtype, allocator=allocator)
                for _, count in levels[:-1]]
        data += [s.gpudata for s in sums]
        block = (self.wg_size, 1, 1)
        for level, (length, count) in enumerate(levels):
            func = tiles_exclusive if (level == 0 and self._exclusive) else tiles
            assert func is not None
            src = input_ary.gpudata if level == 0 else data[level]
            tile_sums = sums[level].gpudata if level < len(sums) else 0
            func.prepared_async_call((count, 1), block, stream, src, data[level], tile_sums,
                                     length)
        for level in range(len(levels) - 2, -1, -1):
            length, count = levels[level]
            update.prepared_async_call((count - 1, 1), block, stream, data[level],
                                       sums[level].gpudata, length)
        return output_ary


class InclusiveScanKernel(_ScanKernelBase):
    """``InclusiveScanKernel(dtype, scan_expr, neutral=None, name_prefix="scan", options=None,
    preamble="", devices=None)``: ``out[i] = in[0] (op) in[1] (op) ... (op) in[i]``.

    Call it as ``knl(input_ary, output_ary=None, allocator=None, stream=None)``."""

    _exclusive = False


class ExclusiveScanKernel(_ScanKernelBase):
    """``ExclusiveScanKernel(dtype, scan_expr, neutral, name_prefix="scan", options=None,
    preamble="", devices=None)``: ``out[0] = neutral``,
    ``out[i] = in[0] (op) ... (op) in[i-1]``.

    Call it as ``knl(input_ary, output_ary=None, allocator=None, stream=None)``."""

    _exclusive = True

