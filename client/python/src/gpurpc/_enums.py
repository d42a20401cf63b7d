"""Numeric enums of the CUDA driver API with PyCUDA's names (``device_attribute`` ...).

Values are those of ``cuda.h``, so ``Device.get_attribute`` can look them up in the daemon's
``DeviceInfo.attributes`` map, which is keyed by the numeric ``CUdevice_attribute``.
"""
from __future__ import annotations

import enum

__all__ = [
    "device_attribute",
    "function_attribute",
    "ctx_flags",
    "event_flags",
    "stream_flags",
    "host_alloc_flags",
    "func_cache",
    "shared_config",
    "limit",
    "capture_mode",
    "capture_status",
    "jit_option",
    "jit_input_type",
    "jit_fallback",
]


class device_attribute(enum.IntEnum):  # noqa: N801 - PyCUDA's name
    """``CUdevice_attribute``: what ``Device.get_attribute`` accepts."""

    MAX_THREADS_PER_BLOCK = 1
    MAX_BLOCK_DIM_X = 2
    MAX_BLOCK_DIM_Y = 3
    MAX_BLOCK_DIM_Z = 4
    MAX_GRID_DIM_X = 5
    MAX_GRID_DIM_Y = 6
    MAX_GRID_DIM_Z = 7
    MAX_SHARED_MEMORY_PER_BLOCK = 8
    TOTAL_CONSTANT_MEMORY = 9
    WARP_SIZE = 10
    MAX_PITCH = 11
    MAX_REGISTERS_PER_BLOCK = 12
    CLOCK_RATE = 13
    TEXTURE_ALIGNMENT = 14
    GPU_OVERLAP = 15
    MULTIPROCESSOR_COUNT = 16
    KERNEL_EXEC_TIMEOUT = 17
    INTEGRATED = 18
    CAN_MAP_HOST_MEMORY = 19
    COMPUTE_MODE = 20
    MAXIMUM_TEXTURE1D_WIDTH = 21
    MAXIMUM_TEXTURE2D_WIDTH = 22
    MAXIMUM_TEXTURE2D_HEIGHT = 23
    MAXIMUM_TEXTURE3D_WIDTH = 24
    MAXIMUM_TEXTURE3D_HEIGHT = 25
    MAXIMUM_TEXTURE3D_DEPTH = 26
    MAXIMUM_TEXTURE2D_LAYERED_WIDTH = 27
    MAXIMUM_TEXTURE2D_LAYERED_HEIGHT = 28
    MAXIMUM_TEXTURE2D_LAYERED_LAYERS = 29
    SURFACE_ALIGNMENT = 30
    CONCURRENT_KERNELS = 31
    ECC_ENABLED = 32
    PCI_BUS_ID = 33
    PCI_DEVICE_ID = 34
    TCC_DRIVER = 35
    MEMORY_CLOCK_RATE = 36
    GLOBAL_MEMORY_BUS_WIDTH = 37
    L2_CACHE_SIZE = 38
    MAX_THREADS_PER_MULTIPROCESSOR = 39
    ASYNC_ENGINE_COUNT = 40
    UNIFIED_ADDRESSING = 41
    MAXIMUM_TEXTURE1D_LAYERED_WIDTH = 42
    MAXIMUM_TEXTURE1D_LAYERED_LAYERS = 43
    CAN_TEX2D_GATHER = 44
    MAXIMUM_TEXTURE2D_GATHER_WIDTH = 45
    MAXIMUM_TEXTURE2D_GATHER_HEIGHT = 46
    MAXIMUM_TEXTURE3D_WIDTH_ALTERNATE = 47
    MAXIMUM_TEXTURE3D_HEIGHT_ALTERNATE = 48
    MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE = 49
    PCI_DOMAIN_ID = 50
    TEXTURE_PITCH_ALIGNMENT = 51
    MAXIMUM_TEXTURECUBEMAP_WIDTH = 52
    MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH = 53
    MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS = 54
    MAXIMUM_SURFACE1D_WIDTH = 55
    MAXIMUM_SURFACE2D_WIDTH = 56
    MAXIMUM_SURFACE2D_HEIGHT = 57
    MAXIMUM_SURFACE3D_WIDTH = 58
    MAXIMUM_SURFACE3D_HEIGHT = 59
    MAXIMUM_SURFACE3D_DEPTH = 60
    MAXIMUM_SURFACE1D_LAYERED_WIDTH = 61
    MAXIMUM_SURFACE1D_LAYERED_LAYERS = 62
    MAXIMUM_SURFACE2D_LAYERED_WIDTH = 63
    MAXIMUM_SURFACE2D_LAYERED_HEIGHT = 64
    MAXIMUM_SURFACE2D_LAYERED_LAYERS = 65
    MAXIMUM_SURFACECUBEMAP_WIDTH = 66
    MAXIMUM_SURFACECUBEMAP_LAYERED_WIDTH = 67
    MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS = 68
    MAXIMUM_TEXTURE1D_LINEAR_WIDTH = 69
    MAXIMUM_TEXTURE2D_LINEAR_WIDTH = 70
    MAXIMUM_TEXTURE2D_LINEAR_HEIGHT = 71
    MAXIMUM_TEXTURE2D_LINEAR_PITCH = 72
    MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH = 73
    MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT = 74
    COMPUTE_CAPABILITY_MAJOR = 75
    COMPUTE_CAPABILITY_MINOR = 76
    MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH = 77
    STREAM_PRIORITIES_SUPPORTED = 78
    GLOBAL_L1_CACHE_SUPPORTED = 79
    LOCAL_L1_CACHE_SUPPORTED = 80
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
    MAX_REGISTERS_PER_MULTIPROCESSOR = 82
    MANAGED_MEMORY = 83
    MULTI_GPU_BOARD = 84
    MULTI_GPU_BOARD_GROUP_ID = 85
    HOST_NATIVE_ATOMIC_SUPPORTED = 86
    SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO = 87
    PAGEABLE_MEMORY_ACCESS = 88
    CONCURRENT_MANAGED_ACCESS = 89
    COMPUTE_PREEMPTION_SUPPORTED = 90
    CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
    CAN_USE_STREAM_MEM_OPS_V1 = 92
    CAN_USE_64_BIT_STREAM_MEM_OPS_V1 = 93
    CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94
    COOPERATIVE_LAUNCH = 95
    COOPERATIVE_MULTI_DEVICE_LAUNCH = 96
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    CAN_FLUSH_REMOTE_WRITES = 98
    HOST_REGISTER_SUPPORTED = 99
    PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100
    DIRECT_MANAGED_MEM_ACCESS_FROM_HOST = 101
    VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
    HANDLE_TYPE_WIN32_HANDLE_SUPPORTED = 104
    HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED = 105
    MAX_BLOCKS_PER_MULTIPROCESSOR = 106
    GENERIC_COMPRESSION_SUPPORTED = 107
    MAX_PERSISTING_L2_CACHE_SIZE = 108
    MAX_ACCESS_POLICY_WINDOW_SIZE = 109
    GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
    RESERVED_SHARED_MEMORY_PER_BLOCK = 111
    SPARSE_CUDA_ARRAY_SUPPORTED = 112
    READ_ONLY_HOST_REGISTER_SUPPORTED = 113
    TIMELINE_SEMAPHORE_INTEROP_SUPPORTED = 114
    MEMORY_POOLS_SUPPORTED = 115
    GPU_DIRECT_RDMA_SUPPORTED = 116
    GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = 117
    GPU_DIRECT_RDMA_WRITES_ORDERING = 118
    MEMPOOL_SUPPORTED_HANDLE_TYPES = 119
    CLUSTER_LAUNCH = 120
    DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED = 121
    CAN_USE_64_BIT_STREAM_MEM_OPS = 122
    CAN_USE_STREAM_WAIT_VALUE_NOR = 123
    DMA_BUF_SUPPORTED = 124
    IPC_EVENT_SUPPORTED = 125
    MEM_SYNC_DOMAIN_COUNT = 126
    TENSOR_MAP_ACCESS_SUPPORTED = 127
    HANDLE_TYPE_FABRIC_SUPPORTED = 128
    UNIFIED_FUNCTION_POINTERS = 129
    NUMA_CONFIG = 130
    NUMA_ID = 131
    MULTICAST_SUPPORTED = 132
    MPS_ENABLED = 133
    HOST_NUMA_ID = 134
    # PyCUDA's aliases.
    SHARED_MEMORY_PER_BLOCK = 8
    REGISTERS_PER_BLOCK = 12
    MAXIMUM_TEXTURE2D_ARRAY_WIDTH = 27
    MAXIMUM_TEXTURE2D_ARRAY_HEIGHT = 28
    MAXIMUM_TEXTURE2D_ARRAY_NUMSLICES = 29
    CAN_USE_STREAM_MEM_OPS = 92


class function_attribute(enum.IntEnum):  # noqa: N801
    """``CUfunction_attribute``: what ``Function.get_attribute`` accepts; ``Function.set_attribute``
    sets ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` and ``PREFERRED_SHARED_MEMORY_CARVEOUT``."""

    MAX_THREADS_PER_BLOCK = 0
    SHARED_SIZE_BYTES = 1
    CONST_SIZE_BYTES = 2
    LOCAL_SIZE_BYTES = 3
    NUM_REGS = 4
    PTX_VERSION = 5
    BINARY_VERSION = 6
    CACHE_MODE_CA = 7
    MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    PREFERRED_SHARED_MEMORY_CARVEOUT = 9


class ctx_flags(enum.IntFlag):  # noqa: N801
    """``CUctx_flags`` (accepted by ``Device.make_context`` and ignored: the daemon owns it)."""

    SCHED_AUTO = 0
    SCHED_SPIN = 1
    SCHED_YIELD = 2
    SCHED_BLOCKING_SYNC = 4
    BLOCKING_SYNC = 4
    SCHED_MASK = 7
    MAP_HOST = 8
    LMEM_RESIZE_TO_MAX = 16
    FLAGS_MASK = 31


class event_flags(enum.IntFlag):  # noqa: N801
    """``CUevent_flags`` for ``Event(flags)``."""

    DEFAULT = 0
    BLOCKING_SYNC = 1
    DISABLE_TIMING = 2
    INTERPROCESS = 4


class stream_flags(enum.IntFlag):  # noqa: N801
    """``CUstream_flags`` for ``Stream(flags)``."""

    DEFAULT = 0
    NON_BLOCKING = 1


class host_alloc_flags(enum.IntFlag):  # noqa: N801
    """``pagelocked_empty(mem_flags=...)``; accepted and ignored (host memory is ordinary)."""

    PORTABLE = 1
    DEVICEMAP = 2
    WRITECOMBINED = 4


class func_cache(enum.IntEnum):  # noqa: N801
    """``CUfunc_cache``, for ``Context.set_cache_config`` and ``Function.set_cache_config``
    (a preference the driver may ignore)."""

    PREFER_NONE = 0
    PREFER_SHARED = 1
    PREFER_L1 = 2
    PREFER_EQUAL = 3


class shared_config(enum.IntEnum):  # noqa: N801
    """``CUsharedconfig`` (deprecated by CUDA: every device CUDA 13 supports has fixed 4-byte
    banks, so ``set_shared_config`` is checked and ignored, as by the driver)."""

    DEFAULT_BANK_SIZE = 0
    FOUR_BYTE_BANK_SIZE = 1
    EIGHT_BYTE_BANK_SIZE = 2


class limit(enum.IntEnum):  # noqa: N801
    """``CUlimit``, for ``Context.get_limit``/``set_limit`` (the daemon bounds the sizes)."""

    STACK_SIZE = 0
    PRINTF_FIFO_SIZE = 1
    MALLOC_HEAP_SIZE = 2
    DEV_RUNTIME_SYNC_DEPTH = 3
    DEV_RUNTIME_PENDING_LAUNCH_COUNT = 4
    MAX_L2_FETCH_GRANULARITY = 5
    PERSISTING_L2_CACHE_SIZE = 6


class capture_mode(enum.IntEnum):  # noqa: N801
    """``CUstreamCaptureMode``, for ``Stream.begin_capture`` (the daemon always captures in
    RELAXED mode: a session's calls run on many threads of its worker)."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


class capture_status(enum.IntEnum):  # noqa: N801
    """``CUstreamCaptureStatus``: what ``Stream.get_capture_status`` answers."""

    NONE = 0
    ACTIVE = 1
    INVALIDATED = 2


class jit_option(enum.IntEnum):  # noqa: N801
    """``CUjit_option`` (PyCUDA's ``jit_option``). Accepted by :class:`Linker` and
    :func:`module_from_buffer` and ignored: the daemon picks the JIT options."""

    MAX_REGISTERS = 0
    THREADS_PER_BLOCK = 1
    WALL_TIME = 2
    INFO_LOG_BUFFER = 3
    INFO_LOG_BUFFER_SIZE_BYTES = 4
    ERROR_LOG_BUFFER = 5
    ERROR_LOG_BUFFER_SIZE_BYTES = 6
    OPTIMIZATION_LEVEL = 7
    TARGET_FROM_CUCONTEXT = 8
    TARGET = 9
    FALLBACK_STRATEGY = 10
    GENERATE_DEBUG_INFO = 11
    LOG_VERBOSE = 12
    GENERATE_LINE_INFO = 13
    CACHE_MODE = 14


class jit_input_type(enum.IntEnum):  # noqa: N801
    """``CUjitInputType`` (PyCUDA's ``jit_input_type``): what :meth:`Linker.add_data` gets."""

    CUBIN = 0
    PTX = 1
    FATBINARY = 2
    OBJECT = 3
    LIBRARY = 4


class jit_fallback(enum.IntEnum):  # noqa: N801
    """``CUjit_fallback`` (PyCUDA's ``jit_fallback``)."""

    PREFER_PTX = 0
    PREFER_BINARY = 1
