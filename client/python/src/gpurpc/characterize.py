"""``pycuda.characterize``: facts about the platform and the current context's device.

* ``platform_bits()``: the pointer width of this (the client's) Python, 64 or 32, as PyCUDA's
  (device code is always 64-bit on the daemon's GPUs);
* ``has_stack()`` and ``has_double_support()``: from the compute capability of the current
  context's device, which the daemon reports (``gpurpc.driver.Device.compute_capability``);
* ``sizeof(type_name, preamble="")``: the size in bytes of a C/C++ type *in device code*,
  measured as PyCUDA does: a one-thread kernel writes ``sizeof(type_name)`` into device memory,
  and it is read back. The result is memoized per context (session) and arguments; the first
  call costs a compile (cached by the daemon) and a round trip.
"""
from __future__ import annotations

import struct

import numpy as np

from . import driver as _drv
from .compiler import SourceModule
from .tools import context_dependent_memoize

__all__ = ["platform_bits", "has_stack", "has_double_support", "sizeof"]

_SIZEOF_KERNEL = "gpurpc_write_size"


def platform_bits() -> int:
    """The pointer width of this Python process in bits (64 on every supported platform)."""
    return struct.calcsize("P") * 8


def has_stack() -> bool:
    """Whether the current context's device has a call stack (compute capability >= 2.0)."""
    return _drv.Context.get_device().compute_capability() >= (2, 0)


def has_double_support() -> bool:
    """Whether the current context's device computes in double precision
    (compute capability >= 1.3)."""
    return _drv.Context.get_device().compute_capability() >= (1, 3)


def _sizeof_source(type_name: str, preamble: str) -> str:
    return f"""
{preamble}

extern "C" __global__ void {_SIZEOF_KERNEL}(unsigned long long *output)
{{
  *output = (unsigned long long)sizeof({type_name});
}}
"""


@context_dependent_memoize
def _sizeof(type_name: str, preamble: str) -> int:
    from . import gpuarray

    mod = SourceModule(_sizeof_source(type_name, preamble), no_extern_c=True)
    output = gpuarray.empty((), dtype=np.uint64)
    mod.get_function(_SIZEOF_KERNEL)(output.gpudata, block=(1, 1, 1), grid=(1, 1))
    return int(output.get())


def sizeof(type_name: str, preamble: str = "") -> int:
    """The size in bytes of the C/C++ type ``type_name`` in device code; ``preamble`` is
    source placed before (``#include`` lines, struct definitions).

    :raises CompileError: ``type_name`` is not a type there (the NVRTC log says why).
    """
    if not isinstance(type_name, str) or not type_name.strip():
        raise TypeError(f"sizeof: type_name must be a non-empty string naming a C type, got "
                        f"{type_name!r}")
    if not isinstance(preamble, str):
        raise TypeError(f"sizeof: preamble must be a string, got {type(preamble).__name__}")
    return _sizeof(type_name.strip(), preamble)
