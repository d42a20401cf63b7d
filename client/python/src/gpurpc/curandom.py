"""``pycuda.curandom``: random numbers on the daemon's GPU.

* :func:`rand` (PyCUDA's) and :func:`randn` fill a new GPUArray with uniform ``[0, 1)`` (or
  raw integer bits) and standard normal numbers. PyCUDA's ``rand`` hashes indices with MD5;
  here both use a counter-based Philox4x32-10 generator (Salmon et al., SC'11) written out in
  the kernel: output word ``j`` of counter ``g`` (key = the 64-bit seed) is element
  ``4*g + j`` (32-bit outputs) or feeds element ``2*g + j//2`` (64-bit outputs, two words
  each). The kernels include no header, so they compile fast. ``seed=`` (a gpurpc
  addition) fixes the key; by default it is drawn from ``numpy.random`` as PyCUDA draws its
  seed.
* The generator classes run CURAND's device API: the kernels ``#include <curand_kernel.h>``
  and are compiled by the daemon's NVRTC (once per session and class). As in PyCUDA there is
  one generator state per thread of ``block_count`` (the multiprocessor count) blocks of
  ``generators_per_block`` threads, and ``fill_*`` lets generator ``t`` write elements
  ``t, t + total, t + 2*total, ...``. ``PhiloxRandomNumberGenerator`` (CURAND's
  Philox4_32_10) is a gpurpc addition; PyCUDA has no Philox class.
* Sobol direction vectors and scramble constants are made on this machine, as PyCUDA makes
  them with CURAND's host library. The source, in order: CURAND's own tables from a
  ``libcurand`` this process can load (``$GPURPC_LIBCURAND``, the library path, or
  ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda``; these host functions need no GPU), else
  the Joe-Kuo ``new-joe-kuo-6.21201`` direction numbers that SciPy ships
  (``scipy/stats/_sobol_direction_numbers.npz``, read without importing SciPy), from which
  the direction vectors are computed here with the Sobol recurrence, which gives exactly
  CURAND's ``*_JOEKUO6`` vectors. Without libcurand, the scrambled sets are that table's
  vectors times a random unit lower-triangular binary matrix per dimension (Matousek's
  linear scrambling, the kind CURAND's scrambled tables hold) and the scramble constants are
  random, both from a fixed seed: valid scrambled Sobol sequences, but not CURAND's bits.
  With neither source, the Sobol classes raise :class:`gpurpc.LogicError` saying so (pass
  ``dir_vector=`` to use your own). As in CURAND/PyCUDA, dimension ``d`` of 20000 is used by
  the generators ``d, d + 20000, ...``.

Differences from PyCUDA, besides the above: element counts and skips are 64-bit (PyCUDA's
kernels take ``int``); ``call_skip_ahead``/``call_skip_ahead_array`` reach every generator
(PyCUDA's reach only those of the first block); 32-bit output of a 64-bit Sobol generator is
the high half of each 64-bit value (PyCUDA stores the low half, which is zero for the first
2**32 points); ``Context.set_limit`` is not needed (CURAND's in-place init needs no big
stack).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import importlib.util
import math
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _context
from . import driver as _drv
from . import gpuarray as _ga
from ._errors import LogicError
from .compiler import SourceModule

__all__ = [
    "rand", "randn", "get_curand_version", "seed_getter_uniform", "seed_getter_unique",
    "direction_vector_set", "generate_direction_vectors", "generate_scramble_constants32",
    "generate_scramble_constants64", "XORWOWRandomNumberGenerator",
    "MRG32k3aRandomNumberGenerator", "PhiloxRandomNumberGenerator",
    "Sobol32RandomNumberGenerator", "ScrambledSobol32RandomNumberGenerator",
    "Sobol64RandomNumberGenerator", "ScrambledSobol64RandomNumberGenerator",
]


def get_curand_version() -> Tuple[int, int, int]:
    """The daemon's CUDA version, e.g. ``(13, 0, 0)``: its toolkit's ``curand_kernel.h`` is
    what the generators compile against (``(0, 0, 0)`` for the fake backend)."""
    return _drv.get_version()


# =============================================================================================
# rand / randn: Philox4x32-10 written out, no header

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85

_RAND_SOURCE = r"""
__device__ __forceinline__ uint4 gpurpc_philox4x32_10(unsigned long long g, unsigned int k0,
                                                      unsigned int k1)
{
  unsigned int c0 = (unsigned int)g, c1 = (unsigned int)(g >> 32), c2 = 0u, c3 = 0u;
  #pragma unroll
  for (int r = 0; r < 10; ++r)
  {
    const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ float gpurpc_u01_f32(unsigned int w)  /* [0, 1) */
{ return (float)(w >> 8) * 5.9604644775390625e-08f; }

__device__ __forceinline__ double gpurpc_u01_f64(unsigned int hi, unsigned int lo)  /* [0, 1) */
{ return ((double)(hi >> 5) * 67108864.0 + (double)(lo >> 6)) * 1.1102230246251565e-16; }

#define GPURPC_RAND_LOOP(PER) \
  const unsigned long long total = (unsigned long long)gridDim.x * blockDim.x; \
  for (unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
       g * PER < n; g += total)

__global__ void gpurpc_rand_u32(unsigned int *d, unsigned long long n, unsigned int k0,
                                unsigned int k1)
{
  GPURPC_RAND_LOOP(4ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    const unsigned int v[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j)
      if (g * 4 + j < n) d[g * 4 + j] = v[j];
  }
}

__global__ void gpurpc_rand_u64(unsigned long long *d, unsigned long long n, unsigned int k0,
                                unsigned int k1)
{
  GPURPC_RAND_LOOP(2ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    d[g * 2] = ((unsigned long long)w.x << 32) | w.y;
    if (g * 2 + 1 < n) d[g * 2 + 1] = ((unsigned long long)w.z << 32) | w.w;
  }
}

__global__ void gpurpc_rand_f32(float *d, unsigned long long n, unsigned int k0,
                                unsigned int k1)
{
  GPURPC_RAND_LOOP(4ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    const unsigned int v[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j)
      if (g * 4 + j < n) d[g * 4 + j] = gpurpc_u01_f32(v[j]);
  }
}

__global__ void gpurpc_rand_f64(double *d, unsigned long long n, unsigned int k0,
                                unsigned int k1)
{
  GPURPC_RAND_LOOP(2ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    d[g * 2] = gpurpc_u01_f64(w.x, w.y);
    if (g * 2 + 1 < n) d[g * 2 + 1] = gpurpc_u01_f64(w.z, w.w);
  }
}

/* Box-Muller: u1 in (0, 1] for the logarithm, u2 in [0, 1) for the angle. */
__global__ void gpurpc_randn_f32(float *d, unsigned long long n, unsigned int k0,
                                 unsigned int k1)
{
  GPURPC_RAND_LOOP(4ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    const unsigned int v[4] = {w.x, w.y, w.z, w.w};
    for (int p = 0; p < 2; ++p)
    {
      const float u1 = (float)((v[2 * p] >> 8) + 1u) * 5.9604644775390625e-08f;
      const float u2 = gpurpc_u01_f32(v[2 * p + 1]);
      const float r = sqrtf(-2.0f * logf(u1));
      float s, c;
      sincospif(2.0f * u2, &s, &c);
      const unsigned long long e = g * 4 + 2 * p;
      if (e < n) d[e] = r * c;
      if (e + 1 < n) d[e + 1] = r * s;
    }
  }
}

__global__ void gpurpc_randn_f64(double *d, unsigned long long n, unsigned int k0,
                                 unsigned int k1)
{
  GPURPC_RAND_LOOP(2ull)
  {
    const uint4 w = gpurpc_philox4x32_10(g, k0, k1);
    const double u1 = 1.0 - gpurpc_u01_f64(w.x, w.y);
    const double u2 = gpurpc_u01_f64(w.z, w.w);
    const double r = sqrt(-2.0 * log(u1));
    double s, c;
    sincospi(2.0 * u2, &s, &c);
    d[g * 2] = r * c;
    if (g * 2 + 1 < n) d[g * 2 + 1] = r * s;
  }
}
"""

# dtype -> (kernel, elements per Philox counter)
_RAND_KERNELS: Dict[np.dtype, Tuple[str, int]] = {
    np.dtype(np.float32): ("gpurpc_rand_f32", 4),
    np.dtype(np.float64): ("gpurpc_rand_f64", 2),
    np.dtype(np.uint32): ("gpurpc_rand_u32", 4),
    np.dtype(np.int32): ("gpurpc_rand_u32", 4),
    np.dtype(np.uint64): ("gpurpc_rand_u64", 2),
    np.dtype(np.int64): ("gpurpc_rand_u64", 2),
}
_RANDN_KERNELS: Dict[np.dtype, Tuple[str, int]] = {
    np.dtype(np.float32): ("gpurpc_randn_f32", 4),
    np.dtype(np.float64): ("gpurpc_randn_f64", 2),
}


def _session_cache(name: str) -> Dict[Any, Any]:
    core = _context._current_core("gpurpc.curandom")
    return core.caches.setdefault(name, {})


def _rand_module() -> SourceModule:
    cache = _session_cache("curandom_rand")
    module = cache.get("module")
    if module is None:
        module = cache["module"] = SourceModule(_RAND_SOURCE)
    return module


def _seed_key(seed: Optional[int]) -> Tuple[int, int]:
    if seed is None:
        seed = int(np.random.randint(0, 2**31 - 1)) | (int(np.random.randint(0, 2**31 - 1)) << 31)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not (
            0 <= int(seed) < 2**64):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    return seed & 0xFFFFFFFF, seed >> 32


def _philox_fill(result: _ga.GPUArray, table: Dict[np.dtype, Tuple[str, int]], what: str,
                 seed: Optional[int], stream: Optional[_drv.Stream]) -> _ga.GPUArray:
    try:
        name, per = table[result.dtype]
    except KeyError:
        kinds = ", ".join(sorted(str(d) for d in table))
        raise NotImplementedError(f"{what} does not make {result.dtype} numbers (it makes "
                                  f"{kinds})") from None
    k0, k1 = _seed_key(seed)
    n = result.size
    if n == 0:
        return result
    func = _rand_module().get_function(name)
    if getattr(func, "arg_format", None) != "PQII":
        func.prepare("PQII")
    groups = -(-n // per)
    dev = _drv.Context.get_device()
    mp = dev.get_attribute(_drv.device_attribute.MULTIPROCESSOR_COUNT) or 1
    threads = 256
    blocks = max(1, min(-(-groups // threads), 8 * mp))
    func.prepared_async_call((blocks, 1), (threads, 1, 1), stream, result.gpudata, n, k0, k1)
    return result


def rand(shape: Any, dtype: Any = np.float32, stream: Optional[_drv.Stream] = None, *,
         seed: Optional[int] = None) -> _ga.GPUArray:
    """A new GPUArray of uniform numbers in ``[0, 1)`` (float32, float64) or of uniformly
    random bits (int32, uint32, int64, uint64), made on the GPU (see the module docstring).

    :raises NotImplementedError: another dtype.
    :raises ValueError: ``seed`` is not an integer in ``[0, 2**64)``.
    """
    result = _ga.empty(shape, dtype)
    return _philox_fill(result, _RAND_KERNELS, "rand", seed, stream)


def randn(shape: Any, dtype: Any = np.float32, stream: Optional[_drv.Stream] = None, *,
          seed: Optional[int] = None) -> _ga.GPUArray:
    """A new GPUArray (float32 or float64) of standard normal numbers (Box-Muller on the
    Philox stream of :func:`rand`).

    :raises NotImplementedError: another dtype.
    :raises ValueError: ``seed`` is not an integer in ``[0, 2**64)``.
    """
    result = _ga.empty(shape, dtype)
    return _philox_fill(result, _RANDN_KERNELS, "randn", seed, stream)


def philox4x32_10(counters: np.ndarray, key: Tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 on the host: ``counters`` is an ``(n, 4)`` uint32 array, ``key`` two
    32-bit words; returns the ``(n, 4)`` uint32 outputs (the reference of :func:`rand`)."""
    c = np.asarray(counters, dtype=np.uint64).reshape(-1, 4) & 0xFFFFFFFF
    c0, c1, c2, c3 = (c[:, i].copy() for i in range(4))
    k0, k1 = np.uint64(int(key[0]) & 0xFFFFFFFF), np.uint64(int(key[1]) & 0xFFFFFFFF)
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    for _ in range(10):
        p0 = np.uint64(PHILOX_M0) * c0
        p1 = np.uint64(PHILOX_M1) * c2
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & mask, (p0 >> shift) ^ c3 ^ k1, p0 & mask
        k0 = (k0 + np.uint64(PHILOX_W0)) & mask
        k1 = (k1 + np.uint64(PHILOX_W1)) & mask
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


# =============================================================================================
# Seeds

def seed_getter_uniform(N: int) -> _ga.GPUArray:  # noqa: N803 - PyCUDA's name
    """An int32 GPUArray of ``N`` copies of one random seed (all generators on one seed,
    each on its own subsequence)."""
    value = int(np.random.randint(0, 2**31 - 1))
    return _ga.empty([int(N)], np.int32).fill(value)


def seed_getter_unique(N: int) -> _ga.GPUArray:  # noqa: N803 - PyCUDA's name
    """An int32 GPUArray of ``N`` random seeds."""
    return _ga.to_gpu(np.random.randint(0, 2**31 - 1, int(N)).astype(np.int32))


# =============================================================================================
# Sobol direction vectors and scramble constants

class direction_vector_set(enum.IntEnum):  # noqa: N801 - PyCUDA's name
    """CURAND's direction vector sets (``curandDirectionVectorSet_t``)."""

    VECTOR_32 = 101
    SCRAMBLED_VECTOR_32 = 102
    VECTOR_64 = 103
    SCRAMBLED_VECTOR_64 = 104


_CURAND_DIMENSIONS = 20000   # CURAND's tables hold this many dimensions; larger counts cycle
_SCRAMBLE_SEEDS = {102: 0x67707270_63757233, 104: 0x67707270_63757264}  # fixed, see docstring
_CONSTANT_SEEDS = {32: 0x67707270_73633332, 64: 0x67707270_73633634}
_tables_lock = threading.Lock()
_libcurand_cache: List[Optional[ctypes.CDLL]] = []
_joe_kuo_cache: List[Optional[Tuple[np.ndarray, np.ndarray]]] = []


def _libcurand() -> Optional[ctypes.CDLL]:
    """CURAND's host library if this process can load one (no GPU needed), else None."""
    with _tables_lock:
        if _libcurand_cache:
            return _libcurand_cache[0]
        candidates: List[str] = []
        explicit = os.environ.get("GPURPC_LIBCURAND")
        if explicit:
            candidates.append(explicit)
        found = ctypes.util.find_library("curand")
        if found:
            candidates.append(found)
        candidates += ["libcurand.so", "libcurand.so.10"]
        for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if root:
                candidates += [os.path.join(root, "lib64", "libcurand.so"),
                               os.path.join(root, "lib", "libcurand.so")]
        lib = None
        for name in candidates:
            try:
                candidate = ctypes.CDLL(name)
                candidate.curandGetDirectionVectors32  # noqa: B018 - must have these
                candidate.curandGetScrambleConstants64  # noqa: B018
            except (OSError, AttributeError):
                continue
            lib = candidate
            break
        _libcurand_cache.append(lib)
        return lib


def _joe_kuo_table() -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """``(poly, vinit)`` of new-joe-kuo-6.21201 from SciPy's data file, else None."""
    with _tables_lock:
        if _joe_kuo_cache:
            return _joe_kuo_cache[0]
        table = None
        try:
            spec = importlib.util.find_spec("scipy")
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            path = os.path.join(location, "stats", "_sobol_direction_numbers.npz")
            if os.path.isfile(path):
                with np.load(path) as data:
                    table = (np.asarray(data["poly"], dtype=np.int64),
                             np.asarray(data["vinit"], dtype=np.int64))
                break
        _joe_kuo_cache.append(table)
        return table


def direction_vector_source() -> Optional[str]:
    """Where Sobol direction vectors come from here: ``"libcurand"``, ``"scipy-joe-kuo"``, or
    None when neither is available (then pass ``dir_vector=`` to the Sobol classes)."""
    if _libcurand() is not None:
        return "libcurand"
    if _joe_kuo_table() is not None:
        return "scipy-joe-kuo"
    return None


def sobol_direction_vectors(poly: np.ndarray, vinit: np.ndarray, bits: int) -> np.ndarray:
    """Sobol direction vectors from direction numbers: ``poly[d]`` is dimension ``d`` 's
    primitive polynomial as an integer (leading and constant terms included; 1 for the first
    dimension, which is the van der Corput sequence), ``vinit[d, :s]`` its initial ``m_k``
    (``s`` its degree). Returns ``(len(poly), bits)`` uint32 (bits=32) or uint64 (bits=64)
    vectors ``v_k = m_k << (bits - 1 - k)`` with ``m_k = 2 a_1 m_{k-1} ^ ... ^
    2^s m_{k-s} ^ m_{k-s}`` (Bratley and Fox, Joe and Kuo)."""
    if bits not in (32, 64):
        raise ValueError(f"bits must be 32 or 64, got {bits}")
    poly = np.asarray(poly, dtype=np.int64)
    vinit = np.asarray(vinit, dtype=np.int64)
    dims = poly.shape[0]
    degree = np.array([int(p).bit_length() - 1 for p in poly], dtype=np.int64)
    if (degree < 0).any() or vinit.ndim != 2 or vinit.shape[0] != dims or (
            vinit.shape[1] < degree.max(initial=0)):
        raise ValueError("poly must be positive integers and vinit hold degree(poly) initial "
                         "direction numbers per dimension")
    m = np.zeros((dims, bits), dtype=np.uint64)
    rows = np.arange(dims)
    max_degree = int(degree.max(initial=0))
    for i in range(bits):
        initial = i < degree
        if initial.any():
            m[initial, i] = vinit[initial, i].astype(np.uint64)
        rec = (~initial) & (degree > 0)
        if rec.any():
            r = rows[rec]
            s = degree[rec]
            value = m[r, i - s].copy()
            for k in range(1, max_degree + 1):
                use = k <= s
                coefficient = (poly[rec] >> np.maximum(s - k, 0)) & 1
                use &= coefficient.astype(bool)
                if use.any():
                    value[use] ^= m[r[use], i - k] << np.uint64(k)
            m[r, i] = value
    m[degree == 0, :] = 1
    shifts = np.array([bits - 1 - i for i in range(bits)], dtype=np.uint64)
    vectors = m << shifts
    return vectors.astype(np.uint32) if bits == 32 else vectors


def _parity(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        x ^= x >> np.uint64(s)
    return x & np.uint64(1)


def _linear_scramble(vectors: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """Each dimension's vectors times a random unit lower-triangular binary matrix: output
    digit j (from the most significant) is digit j plus a random set of the digits above."""
    rng = np.random.default_rng(seed)
    dims = vectors.shape[0]
    v = vectors.astype(np.uint64)
    out = np.zeros_like(v)
    for j in range(bits):
        position = bits - 1 - j
        row = np.full(dims, 1 << position, dtype=np.uint64)
        if j:
            above = rng.integers(0, 2**j, size=dims, dtype=np.uint64)
            row |= above << np.uint64(position + 1)
        out |= _parity(v & row[:, None]) << np.uint64(position)
    return out.astype(vectors.dtype)


def _table_vectors(direction: int, dims: int) -> np.ndarray:
    bits = 64 if direction in (103, 104) else 32
    lib = _libcurand()
    if lib is not None:
        ctype = ctypes.c_uint32 if bits == 32 else ctypes.c_uint64
        pointer = ctypes.POINTER(ctype)()
        getter = lib.curandGetDirectionVectors32 if bits == 32 else lib.curandGetDirectionVectors64
        status = getter(ctypes.byref(pointer), ctypes.c_int(direction))
        if status != 0:
            raise LogicError(f"curandGetDirectionVectors{bits} failed with CURAND status "
                             f"{status} for set {direction}")
        return np.ctypeslib.as_array(pointer, shape=(_CURAND_DIMENSIONS, bits))[:dims].copy()
    table = _joe_kuo_table()
    if table is None:
        raise LogicError(
            "Sobol direction vectors need CURAND's host library (libcurand, loadable here; "
            "set $GPURPC_LIBCURAND to its path) or SciPy (its Joe-Kuo direction numbers): "
            "neither is available on this machine; install one, or pass dir_vector=")
    poly, vinit = table
    vectors = sobol_direction_vectors(poly[:dims], vinit[:dims], bits)
    if direction in _SCRAMBLE_SEEDS:
        vectors = _linear_scramble(vectors, bits, _SCRAMBLE_SEEDS[direction])
    return vectors


def _cycled(table: np.ndarray, count: int) -> np.ndarray:
    reps = -(-count // table.shape[0]) if count else 0
    return np.concatenate([table] * max(reps, 1))[:count] if count else table[:0]


def _check_count(count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    return int(count)


def host_direction_vectors(count: int,
                           direction: int = direction_vector_set.VECTOR_32) -> np.ndarray:
    """:func:`generate_direction_vectors` on the host: a ``(count, 32)`` uint32 or
    ``(count, 64)`` uint64 array (dimensions cycle every 20000, as CURAND's tables)."""
    count = _check_count(count)
    try:
        direction = int(direction_vector_set(int(direction)))
    except ValueError:
        raise ValueError(f"unknown direction vector set {direction!r} (use "
                         "gpurpc.curandom.direction_vector_set)") from None
    dims = min(count, _CURAND_DIMENSIONS)
    return _cycled(_table_vectors(direction, max(dims, 1)), count)


def host_scramble_constants(count: int, bits: int) -> np.ndarray:
    """:func:`generate_scramble_constants32`/``64`` on the host (cycle every 20000)."""
    count = _check_count(count)
    if bits not in (32, 64):
        raise ValueError(f"bits must be 32 or 64, got {bits}")
    lib = _libcurand()
    dtype = np.uint32 if bits == 32 else np.uint64
    if lib is not None:
        ctype = ctypes.c_uint32 if bits == 32 else ctypes.c_uint64
        pointer = ctypes.POINTER(ctype)()
        getter = lib.curandGetScrambleConstants32 if bits == 32 else (
            lib.curandGetScrambleConstants64)
        status = getter(ctypes.byref(pointer))
        if status != 0:
            raise LogicError(f"curandGetScrambleConstants{bits} failed with CURAND status "
                             f"{status}")
        table = np.ctypeslib.as_array(pointer, shape=(_CURAND_DIMENSIONS,)).copy()
    else:
        rng = np.random.default_rng(_CONSTANT_SEEDS[bits])
        table = rng.integers(0, np.iinfo(dtype).max, size=_CURAND_DIMENSIONS, dtype=dtype,
                             endpoint=True)
    return _cycled(table.astype(dtype), count)


def generate_direction_vectors(count: int, direction: int = direction_vector_set.VECTOR_32,
                               ) -> _ga.GPUArray:
    """A GPUArray of ``count`` direction vectors (``(count, 32)`` uint32 for the 32-bit sets,
    ``(count, 64)`` uint64 for the 64-bit ones) to initialize Sobol generators."""
    return _ga.to_gpu(host_direction_vectors(count, direction))


def generate_scramble_constants32(count: int) -> _ga.GPUArray:
    """A GPUArray of ``count`` uint32 scramble constants for
    :class:`ScrambledSobol32RandomNumberGenerator`."""
    return _ga.to_gpu(host_scramble_constants(count, 32))


def generate_scramble_constants64(count: int) -> _ga.GPUArray:
    """A GPUArray of ``count`` uint64 scramble constants for
    :class:`ScrambledSobol64RandomNumberGenerator`."""
    return _ga.to_gpu(host_scramble_constants(count, 64))


# =============================================================================================
# CURAND generators: kernel sources

_LOOP_TEMPLATE = """
__global__ void %(name)s(%(state_type)s *s, %(out_type)s *d, %(params)sunsigned long long n)
{
  const unsigned long long tidx = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long delta = (unsigned long long)blockDim.x * gridDim.x;
  if (tidx >= n) return;
  %(state_type)s st = s[tidx];
  for (unsigned long long idx = tidx; idx < n; idx += delta)
    d[idx] = %(expr)s;
  s[tidx] = st;
}
"""

_SKIP_TEMPLATE = """
__global__ void %(name)s(%(state_type)s *s, const unsigned long long n, const %(skip_type)s skip)
{
  const unsigned long long idx = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < n) %(function)s(skip, &s[idx]);
}

__global__ void %(name)s_array(%(state_type)s *s, const unsigned long long n,
                               const %(skip_type)s *skip)
{
  const unsigned long long idx = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < n) %(function)s(skip[idx], &s[idx]);
}
"""

_PSEUDO_PREPARE = """
__global__ void prepare(%(state_type)s *s, const unsigned long long n, const unsigned int *v,
                        const unsigned long long o)
{
  const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (id < n) curand_init(v[id], id, o, &s[id]);
}
"""

_SOBOL_PREPARE = """
__global__ void prepare(%(state_type)s *s, const unsigned long long n, %(word)s *v,
                        const %(word)s o)
{
  const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (id < n) curand_init(v + id * %(bits)d, o, &s[id]);
}
"""

_SCRAMBLED_SOBOL_PREPARE = """
__global__ void prepare(%(state_type)s *s, const unsigned long long n, %(word)s *v,
                        const %(word)s *scramble, const %(word)s o)
{
  const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (id < n) curand_init(v + id * %(bits)d, scramble[id], o, &s[id]);
}
"""


def _generator_source(cls: type) -> str:
    """The CUDA source of a generator class's module (compiled with ``no_extern_c``)."""
    state = cls.state_type_name
    bits = cls.generator_bits
    word = "unsigned int" if bits == 32 else "unsigned long long"
    loops: List[Dict[str, str]] = []

    def loop(name: str, out: str, expr: str, params: str = "") -> None:
        loops.append({"name": name, "out_type": out, "expr": expr, "params": params})

    raw = "(unsigned int)(curand(&st) >> 32)" if cls._raw_is_64 else "curand(&st)"
    loop("uniform_int", "unsigned int", raw)
    if cls._raw_is_64:
        loop("uniform_long", "unsigned long long", "curand(&st)")
    loop("uniform_float", "float", "curand_uniform(&st)")
    loop("uniform_double", "double", "curand_uniform_double(&st)")
    loop("normal_float", "float", "curand_normal(&st)")
    loop("normal_double", "double", "curand_normal_double(&st)")
    if cls.has_box_muller:
        loop("normal_float2", "float2", "curand_normal2(&st)")
        loop("normal_double2", "double2", "curand_normal2_double(&st)")
    loop("normal_log_float", "float", "curand_log_normal(&st, mean, stddev)",
         "float mean, float stddev, ")
    loop("normal_log_double", "double", "curand_log_normal_double(&st, mean, stddev)",
         "double mean, double stddev, ")
    if cls.has_box_muller:
        loop("normal_log_float2", "float2", "curand_log_normal2(&st, mean, stddev)",
             "float mean, float stddev, ")
        loop("normal_log_double2", "double2", "curand_log_normal2_double(&st, mean, stddev)",
             "double mean, double stddev, ")
    loop("poisson_int", "unsigned int", "curand_poisson(&st, lambda)", "double lambda, ")
    parts = [_LOOP_TEMPLATE % dict(spec, state_type=state) for spec in loops]
    skip_type = "unsigned int" if cls._skip_bits == 32 else "unsigned long long"
    for name, function in cls._skip_kernels:
        parts.append(_SKIP_TEMPLATE % {"name": name, "state_type": state,
                                       "skip_type": skip_type, "function": function})
    parts.append(cls._prepare_source % {"state_type": state, "word": word, "bits": bits})
    return ("// gpurpc.curandom: CURAND device API (C++ overloads, so no extern \"C\" around "
            "the header)\n#include <curand_kernel.h>\n\nextern \"C\" {\n"
            f"__device__ char gpurpc_state_size[sizeof({state})];\n"
            + "".join(parts) + "}\n")


# name -> prepare() format (kernel parameters after state and data pointers end in n)
def _loop_format(name: str) -> str:
    if name.startswith("normal_log_"):
        return "PPddQ" if "double" in name else "PPffQ"
    if name == "poisson_int":
        return "PPdQ"
    return "PPQ"


def _array_info(data: Any, what: str) -> Tuple[np.dtype, int]:
    if not isinstance(data, _ga.GPUArray):
        raise TypeError(f"{what} needs a gpurpc.gpuarray.GPUArray, got {type(data).__name__}")
    return data.dtype, data.size


def _check_real(value: Any, name: str) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


class _RandomNumberGeneratorBase:
    """CURAND device-API generators: one state per thread of ``block_count`` blocks of
    ``generators_per_block`` threads (PyCUDA's layout)."""

    state_type_name = ""
    generator_bits = 32
    has_box_muller = False
    _raw_is_64 = False
    _skip_bits = 64
    _skip_kernels: Sequence[Tuple[str, str]] = (("skip_ahead", "skipahead"),)
    _prepare_source = ""

    def __init__(self) -> None:
        self._core = _context._current_core(type(self).__name__)
        dev = _drv.Context.get_device()
        self.block_count: int = dev.get_attribute(
            _drv.device_attribute.MULTIPROCESSOR_COUNT) or 1
        self.module = self._module()
        self.state_type = self.state_type_name
        self.generators: Dict[str, _drv.Function] = {}
        for name in self.kernel_names():
            if name == "prepare" or name.startswith("skip_ahead"):
                continue
            self.generators[name] = self.module.get_function(name).prepare(_loop_format(name))
        skip_char = "I" if self._skip_bits == 32 else "Q"
        self._skip_functions: Dict[str, _drv.Function] = {}
        for name, _ in self._skip_kernels:
            self._skip_functions[name] = self.module.get_function(name).prepare(
                "PQ" + skip_char)
            self._skip_functions[name + "_array"] = self.module.get_function(
                name + "_array").prepare("PQP")
        self._prepare_function = self.module.get_function("prepare")
        self.state_size: int = self.module.get_global("gpurpc_state_size")[1]
        self._state: Optional[_drv.DeviceAllocation] = None
        self.generators_per_block: int = min(f.max_threads_per_block for f in self._kernels())

    @classmethod
    def source(cls) -> str:
        """The CUDA source of this class's kernels."""
        return _generator_source(cls)

    @classmethod
    def kernel_names(cls) -> List[str]:
        """The kernels this class's module defines."""
        names = ["uniform_int"] + (["uniform_long"] if cls._raw_is_64 else []) + [
            "uniform_float", "uniform_double", "normal_float", "normal_double"]
        if cls.has_box_muller:
            names += ["normal_float2", "normal_double2"]
        names += ["normal_log_float", "normal_log_double"]
        if cls.has_box_muller:
            names += ["normal_log_float2", "normal_log_double2"]
        names.append("poisson_int")
        for name, _ in cls._skip_kernels:
            names += [name, name + "_array"]
        names.append("prepare")
        return names

    def _module(self) -> SourceModule:
        cache = _session_cache("curandom_generators")
        key = type(self).__name__
        module = cache.get(key)
        if module is None:
            module = cache[key] = SourceModule(self.source(), no_extern_c=True)
        return module

    def _kernels(self) -> List[_drv.Function]:
        return (list(self.generators.values()) + list(self._skip_functions.values())
                + [self._prepare_function])

    @property
    def generator_count(self) -> int:
        """``block_count * generators_per_block``: the number of generator states."""
        return self.block_count * self.generators_per_block

    @property
    def state(self) -> _drv.DeviceAllocation:
        """Device memory of the generator states (allocated on first use)."""
        if self._state is None:
            self._state = _drv.mem_alloc(self.generator_count * self.state_size)
        return self._state

    def _launch(self, func: _drv.Function, stream: Optional[_drv.Stream], *args: Any) -> None:
        func.prepared_async_call((self.block_count, 1), (self.generators_per_block, 1, 1),
                                 stream, *args)

    # -- argument dispatch (class methods: checked before anything runs) --------------------

    @classmethod
    def uniform_kernel(cls, dtype: Any) -> str:
        """The kernel ``fill_uniform`` uses for ``dtype``.

        :raises NotImplementedError: this generator does not make ``dtype`` numbers.
        """
        dtype = np.dtype(dtype)
        if dtype == np.float32:
            return "uniform_float"
        if dtype == np.float64:
            return "uniform_double"
        if dtype in (np.int32, np.uint32):
            return "uniform_int"
        if dtype in (np.int64, np.uint64):
            if cls._raw_is_64:
                return "uniform_long"
            raise NotImplementedError(f"{cls.__name__} makes 32-bit integers (int32, uint32); "
                                      f"{dtype} needs a 64-bit Sobol generator")
        raise NotImplementedError(f"{cls.__name__}.fill_uniform makes float32, float64, int32 "
                                  f"and uint32{', int64 and uint64' if cls._raw_is_64 else ''}"
                                  f" numbers, not {dtype}")

    @classmethod
    def normal_kernel(cls, dtype: Any, size: int, address: int, log: bool = False
                      ) -> Tuple[str, int]:
        """The kernel and element count for normal (``log``: log-normal) numbers of
        ``dtype`` into ``size`` elements at ``address``: the two-at-a-time Box-Muller kernel
        when the generator has one, ``size`` is even and the address fits its vector type.

        :raises NotImplementedError: ``dtype`` is not float32 or float64.
        """
        dtype = np.dtype(dtype)
        prefix = "normal_log_" if log else "normal_"
        if dtype == np.float32:
            name = prefix + "float"
        elif dtype == np.float64:
            name = prefix + "double"
        else:
            what = "fill_log_normal" if log else "fill_normal"
            raise NotImplementedError(f"{cls.__name__}.{what} makes float32 and float64 "
                                      f"numbers, not {dtype}")
        if cls.has_box_muller and size % 2 == 0 and address % (2 * dtype.itemsize) == 0:
            return name + "2", size // 2
        return name, size

    @classmethod
    def poisson_kernel(cls, dtype: Any) -> str:
        """The kernel of ``fill_poisson`` for ``dtype``.

        :raises NotImplementedError: ``dtype`` is not uint32.
        """
        if np.dtype(dtype) != np.uint32:
            raise NotImplementedError(f"{cls.__name__}.fill_poisson makes uint32 numbers, not "
                                      f"{np.dtype(dtype)}")
        return "poisson_int"

    # -- PyCUDA's methods -----------------------------------------------------------------

    def fill_uniform(self, data: _ga.GPUArray, stream: Optional[_drv.Stream] = None) -> None:
        """Fills ``data`` with uniform numbers: (0, 1] for floats (CURAND's convention),
        uniformly random bits for integers."""
        dtype, size = _array_info(data, "fill_uniform")
        func = self.generators[self.uniform_kernel(dtype)]
        if size:
            self._launch(func, stream, self.state, data.gpudata, size)

    def gen_uniform(self, shape: Any, dtype: Any, stream: Optional[_drv.Stream] = None,
                    ) -> _ga.GPUArray:
        """A new GPUArray filled by :meth:`fill_uniform`."""
        self.uniform_kernel(dtype)
        result = _ga.empty(shape, dtype)
        self.fill_uniform(result, stream)
        return result

    def fill_normal(self, data: _ga.GPUArray, stream: Optional[_drv.Stream] = None) -> None:
        """Fills ``data`` (float32/float64) with standard normal numbers."""
        dtype, size = _array_info(data, "fill_normal")
        name, count = self.normal_kernel(dtype, size, int(data.gpudata))
        if count:
            self._launch(self.generators[name], stream, self.state, data.gpudata, count)

    def gen_normal(self, shape: Any, dtype: Any, stream: Optional[_drv.Stream] = None,
                   ) -> _ga.GPUArray:
        """A new GPUArray filled by :meth:`fill_normal`."""
        self.normal_kernel(dtype, 0, 0)
        result = _ga.empty(shape, dtype)
        self.fill_normal(result, stream)
        return result

    def fill_log_normal(self, data: _ga.GPUArray, mean: float, stddev: float,
                        stream: Optional[_drv.Stream] = None) -> None:
        """Fills ``data`` (float32/float64) with log-normal numbers: ``exp`` of normal numbers
        of mean ``mean`` and standard deviation ``stddev``.

        :raises ValueError: ``stddev`` is not positive, or either is not finite.
        """
        dtype, size = _array_info(data, "fill_log_normal")
        mean = _check_real(mean, "mean")
        stddev = _check_real(stddev, "stddev")
        if stddev <= 0:
            raise ValueError(f"stddev must be positive, got {stddev}")
        name, count = self.normal_kernel(dtype, size, int(data.gpudata), log=True)
        if count:
            self._launch(self.generators[name], stream, self.state, data.gpudata, mean, stddev,
                         count)

    def gen_log_normal(self, shape: Any, dtype: Any, mean: float, stddev: float,
                       stream: Optional[_drv.Stream] = None) -> _ga.GPUArray:
        """A new GPUArray filled by :meth:`fill_log_normal`."""
        self.normal_kernel(dtype, 0, 0, log=True)
        result = _ga.empty(shape, dtype)
        self.fill_log_normal(result, mean, stddev, stream)
        return result

    def fill_poisson(self, data: _ga.GPUArray, lambda_value: float,
                     stream: Optional[_drv.Stream] = None) -> None:
        """Fills ``data`` (uint32) with Poisson numbers of mean ``lambda_value``.

        :raises ValueError: ``lambda_value`` is not a positive finite number.
        """
        dtype, size = _array_info(data, "fill_poisson")
        func = self.generators[self.poisson_kernel(dtype)]
        lam = _check_real(lambda_value, "lambda_value")
        if lam <= 0:
            raise ValueError(f"lambda_value must be positive, got {lambda_value!r}")
        if size:
            self._launch(func, stream, self.state, data.gpudata, lam, size)

    def gen_poisson(self, shape: Any, dtype: Any, lambda_value: float,
                    stream: Optional[_drv.Stream] = None) -> _ga.GPUArray:
        """A new GPUArray filled by :meth:`fill_poisson`."""
        self.poisson_kernel(dtype)
        result = _ga.empty(shape, dtype)
        self.fill_poisson(result, lambda_value, stream)
        return result

    def _skip(self, name: str, i: Any, stream: Optional[_drv.Stream]) -> None:
        bits = self._skip_bits if name == "skip_ahead" else 64
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not (
                0 <= int(i) < 2**bits):
            raise ValueError(f"{name}: the skip must be an integer in [0, 2**{bits}), "
                             f"got {i!r}")
        self._launch(self._skip_functions[name], stream, self.state, self.generator_count,
                     int(i))

    def _skip_array(self, name: str, i: Any, stream: Optional[_drv.Stream]) -> None:
        bits = self._skip_bits if name == "skip_ahead" else 64
        expected = (np.uint32, np.int32) if bits == 32 else (np.uint64, np.int64)
        if not isinstance(i, _ga.GPUArray) or i.dtype not in expected or (
                i.size != self.generator_count):
            raise TypeError(f"{name}_array needs a GPUArray of {self.generator_count} "
                            f"{np.dtype(expected[0])} skips (one per generator), got "
                            f"{_describe(i)}")
        self._launch(self._skip_functions[name + "_array"], stream, self.state,
                     self.generator_count, i.gpudata)

    def call_skip_ahead(self, i: int, stream: Optional[_drv.Stream] = None) -> None:
        """Makes every generator skip ``i`` values (as if it made and dropped them)."""
        self._skip("skip_ahead", i, stream)

    def call_skip_ahead_array(self, i: _ga.GPUArray, stream: Optional[_drv.Stream] = None,
                              ) -> None:
        """Makes generator ``t`` skip ``i[t]`` values (``i``: one skip per generator)."""
        self._skip_array("skip_ahead", i, stream)


def _describe(obj: Any) -> str:
    if isinstance(obj, _ga.GPUArray):
        return f"a GPUArray of {obj.size} {obj.dtype}"
    return type(obj).__name__


class _PseudoRandomNumberGeneratorBase(_RandomNumberGeneratorBase):
    """Generators seeded per state: ``curand_init(seed[t], t, offset)`` puts generator ``t``
    on subsequence ``t`` of its seed's sequence, ``offset`` values in."""

    has_box_muller = True
    _skip_kernels = (("skip_ahead", "skipahead"), ("skip_ahead_sequence", "skipahead_sequence"))
    _prepare_source = _PSEUDO_PREPARE

    def __init__(self, seed_getter: Optional[Callable[[int], _ga.GPUArray]] = None,
                 offset: int = 0) -> None:
        """:arg seed_getter: given a count, returns an int32 GPUArray of that many seeds
        (default: :func:`seed_getter_unique`-like random seeds).
        :arg offset: how many values each generator skips first.

        :raises TypeError: the seeds are not an int32 GPUArray of the right length.
        :raises ValueError: ``offset`` is not an integer in [0, 2**64).
        """
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not (
                0 <= int(offset) < 2**64):
            raise ValueError(f"offset must be an integer in [0, 2**64), got {offset!r}")
        super().__init__()
        count = self.generator_count
        seed = seed_getter_unique(count) if seed_getter is None else seed_getter(count)
        if not (isinstance(seed, _ga.GPUArray) and seed.dtype in (np.int32, np.uint32)
                and seed.size == count):
            raise TypeError(f"seed_getter({count}) must return an int32 GPUArray of {count} "
                            f"seeds, got {_describe(seed)}")
        self._prepare_function.prepare("PQPQ")
        self._launch(self._prepare_function, None, self.state, count, seed.gpudata, int(offset))

    def call_skip_ahead_sequence(self, i: int, stream: Optional[_drv.Stream] = None) -> None:
        """Makes every generator skip ``i`` subsequences (``i * 2**67`` values for XORWOW)."""
        self._skip("skip_ahead_sequence", i, stream)

    def call_skip_ahead_sequence_array(self, i: _ga.GPUArray,
                                       stream: Optional[_drv.Stream] = None) -> None:
        """Makes generator ``t`` skip ``i[t]`` subsequences."""
        self._skip_array("skip_ahead_sequence", i, stream)


class XORWOWRandomNumberGenerator(_PseudoRandomNumberGeneratorBase):
    """CURAND's XORWOW generator (``curandStateXORWOW``; period at least 2**190)."""

    state_type_name = "curandStateXORWOW"


class MRG32k3aRandomNumberGenerator(_PseudoRandomNumberGeneratorBase):
    """CURAND's MRG32k3a generator (``curandStateMRG32k3a``; period about 2**191)."""

    state_type_name = "curandStateMRG32k3a"
    _skip_kernels = (("skip_ahead", "skipahead"), ("skip_ahead_sequence", "skipahead_sequence"),
                     ("skip_ahead_subsequence", "skipahead_subsequence"))

    def call_skip_ahead_subsequence(self, i: int, stream: Optional[_drv.Stream] = None) -> None:
        """Makes every generator skip ``i`` subsequences of 2**76 values."""
        self._skip("skip_ahead_subsequence", i, stream)

    def call_skip_ahead_subsequence_array(self, i: _ga.GPUArray,
                                          stream: Optional[_drv.Stream] = None) -> None:
        """Makes generator ``t`` skip ``i[t]`` subsequences of 2**76 values."""
        self._skip_array("skip_ahead_subsequence", i, stream)


class PhiloxRandomNumberGenerator(_PseudoRandomNumberGeneratorBase):
    """CURAND's Philox4_32_10 counter-based generator (``curandStatePhilox4_32_10``; a gpurpc
    addition: PyCUDA has no Philox class). Subsequences are 2**66 values apart."""

    state_type_name = "curandStatePhilox4_32_10"


class _SobolBase(_RandomNumberGeneratorBase):
    """Quasirandom generators: generator ``t`` walks Sobol dimension ``t`` (of its direction
    vectors) in Gray-code order from point ``offset``."""

    _direction_set = direction_vector_set.VECTOR_32
    _scrambled = False

    def __init__(self, dir_vector: Optional[_ga.GPUArray] = None,
                 scramble_vector: Optional[_ga.GPUArray] = None, offset: int = 0) -> None:
        limit = 2**self.generator_bits
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not (
                0 <= int(offset) < limit):
            raise ValueError(f"offset must be an integer in [0, 2**{self.generator_bits}), "
                             f"got {offset!r}")
        super().__init__()
        count = self.generator_count
        bits = self.generator_bits
        words = (np.uint32, np.int32) if bits == 32 else (np.uint64, np.int64)
        if dir_vector is None:
            dir_vector = generate_direction_vectors(count, self._direction_set)
        if not (isinstance(dir_vector, _ga.GPUArray) and dir_vector.dtype in words
                and dir_vector.shape == (count, bits)):
            raise TypeError(f"dir_vector must be a GPUArray of shape ({count}, {bits}) and "
                            f"dtype {np.dtype(words[0])}, got {_describe(dir_vector)}"
                            + (f" of shape {dir_vector.shape}"
                               if isinstance(dir_vector, _ga.GPUArray) else ""))
        self.dir_vector = dir_vector
        args: List[Any] = [self.state, count, dir_vector.gpudata]
        if self._scrambled:
            if scramble_vector is None:
                scramble_vector = (generate_scramble_constants32 if bits == 32
                                   else generate_scramble_constants64)(count)
            if not (isinstance(scramble_vector, _ga.GPUArray) and scramble_vector.dtype in words
                    and scramble_vector.shape == (count,)):
                raise TypeError(f"scramble_vector must be a GPUArray of {count} "
                                f"{np.dtype(words[0])}, got {_describe(scramble_vector)}")
            self.scramble_vector = scramble_vector
            args.append(scramble_vector.gpudata)
        args.append(int(offset))
        word = "I" if bits == 32 else "Q"
        self._prepare_function.prepare("PQP" + ("P" if self._scrambled else "") + word)
        self._launch(self._prepare_function, None, *args)


class Sobol32RandomNumberGenerator(_SobolBase):
    """CURAND's 32-bit Sobol quasirandom generator (period 2**32)."""

    state_type_name = "curandStateSobol32"
    _skip_bits = 32
    _prepare_source = _SOBOL_PREPARE

    def __init__(self, dir_vector: Optional[_ga.GPUArray] = None, offset: int = 0) -> None:
        """:arg dir_vector: a ``(generator_count, 32)`` uint32 GPUArray of direction vectors
        (default: :func:`generate_direction_vectors` of ``VECTOR_32``).
        :arg offset: the first point of each generator."""
        super().__init__(dir_vector, None, offset)


class ScrambledSobol32RandomNumberGenerator(_SobolBase):
    """CURAND's scrambled 32-bit Sobol quasirandom generator."""

    state_type_name = "curandStateScrambledSobol32"
    _skip_bits = 32
    _prepare_source = _SCRAMBLED_SOBOL_PREPARE
    _direction_set = direction_vector_set.SCRAMBLED_VECTOR_32
    _scrambled = True

    def __init__(self, dir_vector: Optional[_ga.GPUArray] = None,
                 scramble_vector: Optional[_ga.GPUArray] = None, offset: int = 0) -> None:
        """:arg dir_vector: as for :class:`Sobol32RandomNumberGenerator` (default: the
        ``SCRAMBLED_VECTOR_32`` set).
        :arg scramble_vector: ``generator_count`` uint32 constants XORed into the points
        (default: :func:`generate_scramble_constants32`).
        :arg offset: the first point of each generator."""
        super().__init__(dir_vector, scramble_vector, offset)


class Sobol64RandomNumberGenerator(_SobolBase):
    """CURAND's 64-bit Sobol quasirandom generator (period 2**64)."""

    state_type_name = "curandStateSobol64"
    generator_bits = 64
    _raw_is_64 = True
    _prepare_source = _SOBOL_PREPARE
    _direction_set = direction_vector_set.VECTOR_64

    def __init__(self, dir_vector: Optional[_ga.GPUArray] = None, offset: int = 0) -> None:
        """:arg dir_vector: a ``(generator_count, 64)`` uint64 GPUArray of direction vectors
        (default: :func:`generate_direction_vectors` of ``VECTOR_64``).
        :arg offset: the first point of each generator."""
        super().__init__(dir_vector, None, offset)


class ScrambledSobol64RandomNumberGenerator(_SobolBase):
    """CURAND's scrambled 64-bit Sobol quasirandom generator."""

    state_type_name = "curandStateScrambledSobol64"
    generator_bits = 64
    _raw_is_64 = True
    _prepare_source = _SCRAMBLED_SOBOL_PREPARE
    _direction_set = direction_vector_set.SCRAMBLED_VECTOR_64
    _scrambled = True

    def __init__(self, dir_vector: Optional[_ga.GPUArray] = None,
                 scramble_vector: Optional[_ga.GPUArray] = None, offset: int = 0) -> None:
        """:arg dir_vector: as for :class:`Sobol64RandomNumberGenerator` (default: the
        ``SCRAMBLED_VECTOR_64`` set).
        :arg scramble_vector: ``generator_count`` uint64 constants XORed into the points
        (default: :func:`generate_scramble_constants64`).
        :arg offset: the first point of each generator."""
        super().__init__(dir_vector, scramble_vector, offset)


GENERATOR_CLASSES = (XORWOWRandomNumberGenerator, MRG32k3aRandomNumberGenerator,
                     PhiloxRandomNumberGenerator, Sobol32RandomNumberGenerator,
                     ScrambledSobol32RandomNumberGenerator, Sobol64RandomNumberGenerator,
                     ScrambledSobol64RandomNumberGenerator)
