"""PyCUDA's ``pycuda.driver`` API, served by a remote gpurpcd.

Replace ``import pycuda.driver as cuda`` with ``import gpurpc.driver as cuda`` and the usual
calls work against the daemon named by ``$GPURPC_ADDRESS`` (``host:port``, or a path or
``unix:PATH`` for a Unix socket; default: the daemon's own default socket, when it exists), or
the one given to :func:`init` (which also takes the credentials)::

    import numpy as np
    import gpurpc.autoinit                      # opens a session on device 0
    import gpurpc.driver as cuda
    from gpurpc.compiler import SourceModule

    mod = SourceModule('''
    __global__ void multiply_them(float *dest, float *a, float *b)
    { const int i = threadIdx.x; dest[i] = a[i] * b[i]; }''')
    multiply_them = mod.get_function("multiply_them")
    a = np.random.randn(400).astype(np.float32)
    b = np.random.randn(400).astype(np.float32)
    dest = np.zeros_like(a)
    multiply_them(cuda.Out(dest), cuda.In(a), cuda.In(b), block=(400, 1, 1), grid=(1, 1))

What differs from PyCUDA, and why:

* A *context* is a daemon session (one worker process, one CUDA context). ``make_context``
  opens it; ``push``/``pop`` only move it on a per-thread stack (a thread with an empty stack
  uses the most recently created context, so worker threads need no push); ``detach`` closes
  it. A context that is no longer referenced (nor any of its buffers, modules, streams or
  events) is closed when garbage collected, and every session is closed at interpreter exit.
* Launches, memsets, copies and event records are queued and sent in batches over one ordered
  command stream, so a launch costs microseconds, not a round trip. As in CUDA, an error of
  asynchronous work (a kernel fault, a bad address in ``memset_d32_async``) is raised by the
  next synchronising call (``synchronize``, a device-to-host copy, ``Event.query`` ...).
* Kernel arguments are packed PyCUDA's way, then placed at the offsets the kernel's parameter
  layout reports, so by-value ``float4``/struct arguments arrive intact; an argument whose
  size disagrees with its parameter raises :class:`LogicError` naming the parameter.
* ``In``/``Out``/``InOut`` arguments upload, launch and download in one batch: one round trip.
* ``time_kernel=True`` and ``prepared_timed_call`` time with events on the server.
* Host memory: on the daemon's host (a Unix-socket daemon) ``pagelocked_empty`` and friends
  return ndarrays backed by same-host regions, memory shared with the session's worker, and
  copies from and to them (``memcpy_*``, ``In``/``Out``, ``GPUArray.set``/``get``) are DMA
  without bytes through gRPC; large copies of other host memory go through a staging
  region. ``host_regions=`` of :func:`init`, ``$GPURPC_HOST_REGIONS`` (auto, on, off) and
  ``Context.host_regions`` choose (see ``gpurpc._regions``). Elsewhere host memory is
  ordinary. The ``_async`` copies accept any contiguous buffer; as in CUDA, one from a
  region-backed array reads it when its stream gets there (do not change it before), and
  ``memcpy_dtoh_async`` fills its destination when the stream (or context) is synchronised.
  A synchronous copy of 16 MiB or more through gRPC is split into parts, each on a
  connection of its own: ``transfer_connections=`` of :func:`init`,
  ``$GPURPC_TRANSFER_CONNECTIONS`` (1 to 16, default 4).
* After a kernel fault the session is dead (the daemon killed its worker): the faulting call
  raises :class:`LaunchError`, and so does every later call, with a message naming the cause.
  Open a new context to continue. Each context watches its session (one
  ``WatchSession`` stream): a fault it reports makes the next call raise at once, and
  ``Context.state``/``Context.fault`` tell without a call.
* Every call has a deadline: ``timeout=`` of :func:`init` (seconds; default
  ``$GPURPC_TIMEOUT``, else 300), ``Context.timeout`` per context, and ``timeout=`` of
  ``Context.synchronize``/``Stream.synchronize``/``Event.synchronize`` per call. A passed
  deadline raises :class:`CallTimeoutError` naming the call; it does not stop GPU work.
* When the daemon restarts, every session of its earlier run is gone: calls on such a context
  raise :class:`SessionLost` (a :class:`LogicError`) saying so; make a new context (the
  connection reconnects by itself). ``detach`` and the exit path never hang, also when the
  daemon is stopped or gone.
* Pitched memory (``mem_alloc_pitch``, ``Memcpy2D``/``Memcpy3D`` of linear memory,
  ``memset_d2d*``) is built from linear copies and memsets; see ``gpurpc._driver_extras``.
* CUDA arrays (``Array``, ``ArrayDescriptor``, ``ArrayDescriptor3D``, ``array_format``,
  ``array3d_flags``, ``memcpy_htoa``/``atoh`` (and ``_async``), ``memcpy_dtoa``/``atod``/
  ``atoa``, ``Memcpy2D``/``Memcpy3D`` with ``set_src_array``/``set_dst_array``,
  ``matrix_to_array``, ``np_to_array``, ``gpuarray_to_array``,
  ``make_multichannel_2d_array``, ``dtype_to_array_format``) are served: a copy between an
  array and device memory or another array is one stream-ordered command; one with host
  memory goes through a temporary device buffer of the session (see ``gpurpc._arrays``).
  ``Array.handle`` is the daemon's id of the array. Arrays count against the tenant's
  device-memory quota.
* :class:`Linker` gathers its inputs here and links them on the daemon in one
  ``ModuleService.LinkModule`` call (the driver's ``cuLink*`` there) when ``link_module`` is
  called; link errors surface then.
* IPC between contexts of one tenant (``mem_get_ipc_handle``, ``IPCMemoryHandle``;
  ``Event.ipc_handle``, ``Event.from_ipc_handle`` for events made with
  ``event_flags.INTERPROCESS | event_flags.DISABLE_TIMING``): each context is a session, a
  process on the daemon, so this is CUDA IPC there; the handle is an opaque token only the
  same tenant's sessions on the same device can open (see ``gpurpc._ipc``).
  ``start_profiler``/``stop_profiler`` mark the range a profiler attached to the daemon
  records.
* Not available: texture/surface references (so arrays cannot be bound to textures here),
  mipmapped arrays, managed and mapped memory, peer copies, ``register_host_memory``,
  ``initialize_profiler``. Asking for one raises :class:`AttributeError` saying why (so
  ``hasattr`` checks keep working).
"""
from __future__ import annotations

from typing import Any

from ._arrays import (
    Array,
    ArrayDescriptor,
    ArrayDescriptor3D,
    array3d_flags,
    array_format,
    dtype_to_array_format,
    gpuarray_to_array,
    make_multichannel_2d_array,
    matrix_to_array,
    memcpy_atoa,
    memcpy_atod,
    memcpy_atoh,
    memcpy_atoh_async,
    memcpy_dtoa,
    memcpy_htoa,
    memcpy_htoa_async,
    np_to_array,
)
from ._context import Context
from ._core import Client, SessionCore, device_pointer, resolve_address
from ._devices import Device, get_driver_version, get_version, init, pick_device
from ._driver_extras import (
    Memcpy2D,
    Memcpy3D,
    aligned_empty,
    aligned_empty_like,
    aligned_zeros,
    aligned_zeros_like,
    mem_alloc_pitch,
    mem_get_address_range,
    memory_type,
    memset_d2d8,
    memset_d2d8_async,
    memset_d2d16,
    memset_d2d16_async,
    memset_d2d32,
    memset_d2d32_async,
    pointer_attribute,
)
from ._enums import (
    capture_mode,
    capture_status,
    ctx_flags,
    device_attribute,
    event_flags,
    func_cache,
    function_attribute,
    host_alloc_flags,
    jit_fallback,
    jit_input_type,
    jit_option,
    limit,
    shared_config,
    stream_flags,
)
from ._errors import (
    CallTimeoutError,
    CompileError,
    Error,
    LaunchError,
    LogicError,
    MemoryError,
    RuntimeError,
    SessionLost,
    timeout_error,
)
from ._functions import (
    ArgumentHandler,
    Function,
    In,
    InOut,
    Linker,
    Module,
    Out,
    module_from_buffer,
    module_from_file,
)
from ._graphs import Graph, GraphExec, GraphNode
from ._ipc import IPCMemoryHandle, ipc_mem_flags, mem_get_ipc_handle, start_profiler, stop_profiler
from ._memory import (
    DeviceAllocation,
    PointerHolderBase,
    from_device,
    from_device_like,
    mem_alloc,
    mem_alloc_like,
    mem_get_info,
    memcpy_dtod,
    memcpy_dtod_async,
    memcpy_dtoh,
    memcpy_dtoh_async,
    memcpy_htod,
    memcpy_htod_async,
    memset_d8,
    memset_d8_async,
    memset_d16,
    memset_d16_async,
    memset_d32,
    memset_d32_async,
    pagelocked_empty,
    pagelocked_empty_like,
    pagelocked_zeros,
    pagelocked_zeros_like,
    set_transfer_progress,
    to_device,
)
from ._streams import Event, Stream

__all__ = [
    # errors
    "Error", "LogicError", "LaunchError", "MemoryError", "RuntimeError", "CompileError",
    "SessionLost", "CallTimeoutError",
    # enums
    "device_attribute", "function_attribute", "ctx_flags", "event_flags", "stream_flags",
    "host_alloc_flags", "func_cache", "shared_config", "limit", "capture_mode", "capture_status",
    "pointer_attribute", "memory_type", "jit_option", "jit_input_type", "jit_fallback",
    "array_format", "array3d_flags",
    # init / devices / contexts
    "init", "get_version", "get_driver_version", "Device", "Context", "pick_device",
    # memory
    "mem_alloc", "mem_alloc_like", "mem_get_info", "DeviceAllocation", "PointerHolderBase",
    "mem_alloc_pitch", "mem_get_address_range", "Memcpy2D", "Memcpy3D",
    "memset_d2d8", "memset_d2d16", "memset_d2d32", "memset_d2d8_async", "memset_d2d16_async",
    "memset_d2d32_async",
    "to_device", "from_device", "from_device_like",
    "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_htod_async", "memcpy_dtoh_async",
    "memcpy_dtod_async", "memset_d8", "memset_d16", "memset_d32", "memset_d8_async",
    "memset_d16_async", "memset_d32_async",
    "pagelocked_empty", "pagelocked_zeros", "pagelocked_empty_like", "pagelocked_zeros_like",
    "aligned_empty", "aligned_zeros", "aligned_empty_like", "aligned_zeros_like",
    # CUDA arrays
    "Array", "ArrayDescriptor", "ArrayDescriptor3D", "dtype_to_array_format",
    "matrix_to_array", "np_to_array", "gpuarray_to_array", "make_multichannel_2d_array",
    "memcpy_htoa", "memcpy_atoh", "memcpy_htoa_async", "memcpy_atoh_async", "memcpy_dtoa",
    "memcpy_atod", "memcpy_atoa",
    # IPC and profiling
    "ipc_mem_flags", "IPCMemoryHandle", "mem_get_ipc_handle", "start_profiler", "stop_profiler",
    # execution
    "Stream", "Event", "Module", "Function", "module_from_buffer", "module_from_file",
    "Linker",
    "ArgumentHandler", "In", "Out", "InOut",
    # CUDA graphs
    "Graph", "GraphExec", "GraphNode",
    # gpurpc extras
    "set_transfer_progress",
]

# Also importable from here, as before the split into private modules (not in __all__).
_ALSO_EXPORTED = (Client, SessionCore, device_pointer, resolve_address, timeout_error)


# PyCUDA names that a remote session cannot honour (yet), with the reason: asking for one
# says so instead of a bare "no attribute". (AttributeError still, so hasattr() feature checks
# keep working.)
_NOT_AVAILABLE = {
    "Memcpy3DPeer": "copies between contexts (sessions) are not served by gpurpcd yet; within "
                    "one context use Memcpy3D",
    **dict.fromkeys(
        ["TextureReference", "SurfaceReference", "bind_array_to_texref", "address_mode",
         "filter_mode", "TRSA_OVERRIDE_FORMAT", "TRSF_READ_AS_INTEGER",
         "TRSF_NORMALIZED_COORDINATES", "TR_DEFAULT"],
        "texture and surface references were removed in CUDA 12 (CUDA arrays are served: "
        "Array, memcpy_htoa, Memcpy2D.set_dst_array ...)"),
    "MipmappedArray": "mipmapped CUDA arrays are not served by gpurpcd (Array is)",
    **dict.fromkeys(
        ["managed_empty", "managed_zeros", "managed_empty_like", "managed_zeros_like",
         "mem_alloc_managed"],
        "managed memory would have to be shared between the daemon's GPU and this process's "
        "host memory, which are on different machines (or processes)"),
    "IPCEventHandle": "there is no such class, in PyCUDA either: an event's IPC handle is "
                      "Event.ipc_handle(), opened with Event.from_ipc_handle(handle)",
    "initialize_profiler": "cuProfilerInitialize was removed in CUDA 12; start_profiler and "
                           "stop_profiler mark the range a profiler attached to the daemon "
                           "records",
    **dict.fromkeys(
        ["memcpy_peer", "memcpy_peer_async"],
        "peer copies between devices are not served by gpurpcd yet"),
    **dict.fromkeys(
        ["register_host_memory", "RegisteredHostMemory", "mem_host_register_flags"],
        "host memory of this process cannot be pinned by the daemon; use pagelocked_empty/"
        "pagelocked_zeros, which are backed by same-host shared regions"),
}


def __getattr__(name: str) -> Any:
    reason = _NOT_AVAILABLE.get(name)
    if reason is not None:
        raise AttributeError(f"gpurpc.driver.{name} is not available: {reason}")
    raise AttributeError(f"module 'gpurpc.driver' has no attribute {name!r}")
