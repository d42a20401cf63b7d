// The CUDA driver API, loaded at run time.
//
// gpurpc never links libcuda: a binary that does will not even start on a machine without
// the NVIDIA driver (DESIGN §1). LoadDriverApi() dlopens libcuda.so.1 once per process,
// looks up cuGetProcAddress_v2 with dlsym and resolves every other entry point through it
// for CUDA 13.0, then calls cuInit(0). The library is never closed.
//
// Only the CUDA backend includes this header (and with it <cuda.h>).
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_DRIVER_API_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_DRIVER_API_H_

#include <cuda.h>
#include <cudaProfilerTypedefs.h>
#include <cudaTypedefs.h>

#include "absl/status/statusor.h"

namespace gpurpc::backend::cuda {

// The CUDA version whose ABI we ask cuGetProcAddress for, and the oldest driver we accept:
// requesting a version newer than the driver fails, and the NVRTC 13 output that the
// workers load needs a CUDA 13 driver anyway.
inline constexpr int kCudaApiVersion = 13000;

// X(name, version): every driver entry point the backend uses, with the version suffix of
// its PFN_ typedef in <cudaTypedefs.h>. That suffix must be the newest one that is
// <= kCudaApiVersion, because that is the variant cuGetProcAddress returns for
// kCudaApiVersion (e.g. cuCtxSynchronize resolves to the CUDA 13 variant that takes a
// context). A wrong suffix does not compile unless the typedef exists, so review the
// suffixes when raising kCudaApiVersion.
//
// Note: <cuda.h> #defines some names to their _v2 symbols (cuMemAlloc -> cuMemAlloc_v2).
// The member names below go through the same macros wherever they are used, so they stay
// consistent; the looked-up name is taken with # before expansion ("cuMemAlloc"), which is
// the base name cuGetProcAddress wants.
#define GPURPC_CUDA_DRIVER_FUNCTIONS(X)  \
  X(cuGetErrorName, 6000)                \
  X(cuGetErrorString, 6000)              \
  X(cuInit, 2000)                        \
  X(cuDeviceGet, 2000)                   \
  X(cuDeviceGetCount, 2000)              \
  X(cuDeviceGetName, 2000)               \
  X(cuDeviceTotalMem, 3020)              \
  X(cuDeviceGetAttribute, 2000)          \
  X(cuDeviceGetPCIBusId, 4010)           \
  X(cuDevicePrimaryCtxRetain, 7000)      \
  X(cuDevicePrimaryCtxRelease, 11000)    \
  X(cuCtxGetCurrent, 4000)               \
  X(cuCtxSetCurrent, 4000)               \
  X(cuCtxSynchronize, 13000)             \
  X(cuCtxSetLimit, 3010)                 \
  X(cuCtxGetLimit, 3010)                 \
  X(cuCtxSetCacheConfig, 3020)           \
  X(cuCtxGetCacheConfig, 3020)           \
  X(cuMemAlloc, 3020)                    \
  X(cuMemFree, 3020)                     \
  X(cuMemGetInfo, 3020)                  \
  X(cuMemHostAlloc, 2020)                \
  X(cuMemFreeHost, 2000)                 \
  X(cuMemHostRegister, 6050)             \
  X(cuMemHostUnregister, 4000)           \
  X(cuMemcpyHtoDAsync, 3020)             \
  X(cuMemcpyDtoHAsync, 3020)             \
  X(cuMemcpyDtoDAsync, 3020)             \
  X(cuMemsetD8Async, 3020)               \
  X(cuMemsetD16Async, 3020)              \
  X(cuMemsetD32Async, 3020)              \
  X(cuArray3DCreate, 3020)               \
  X(cuArrayDestroy, 2000)                \
  X(cuMemcpy3DAsync, 3020)               \
  X(cuIpcGetMemHandle, 4010)             \
  X(cuIpcOpenMemHandle, 11000)           \
  X(cuIpcCloseMemHandle, 4010)           \
  X(cuIpcGetEventHandle, 4010)           \
  X(cuIpcOpenEventHandle, 4010)          \
  X(cuProfilerStart, 4000)               \
  X(cuProfilerStop, 4000)                \
  X(cuModuleLoadDataEx, 2010)            \
  X(cuModuleUnload, 2000)                \
  X(cuLinkCreate, 6050)                  \
  X(cuLinkAddData, 6050)                 \
  X(cuLinkComplete, 5050)                \
  X(cuLinkDestroy, 5050)                 \
  X(cuModuleGetFunction, 2000)           \
  X(cuModuleGetGlobal, 3020)             \
  X(cuFuncLoad, 12040)                   \
  X(cuFuncGetAttribute, 2020)            \
  X(cuFuncSetAttribute, 9000)            \
  X(cuFuncSetCacheConfig, 3000)          \
  X(cuFuncGetParamInfo, 12040)           \
  X(cuLaunchKernel, 4000)                \
  X(cuStreamCreate, 2000)                \
  X(cuStreamDestroy, 4000)               \
  X(cuStreamSynchronize, 2000)           \
  X(cuStreamQuery, 2000)                 \
  X(cuStreamWaitEvent, 3020)             \
  X(cuEventCreate, 2000)                 \
  X(cuEventDestroy, 4000)                \
  X(cuEventRecord, 2000)                 \
  X(cuEventQuery, 2000)                  \
  X(cuEventSynchronize, 2000)            \
  X(cuEventElapsedTime, 12080)           \
  X(cuStreamBeginCapture, 10010)         \
  X(cuStreamEndCapture, 10000)           \
  X(cuStreamIsCapturing, 10000)          \
  X(cuGraphDestroy, 10000)               \
  X(cuGraphGetNodes, 10000)              \
  X(cuGraphGetRootNodes, 10000)          \
  X(cuGraphNodeGetType, 10000)           \
  X(cuGraphNodeGetDependentNodes, 12030) \
  X(cuGraphInstantiateWithFlags, 11040)  \
  X(cuGraphExecDestroy, 10000)           \
  X(cuGraphLaunch, 10000)                \
  X(cuGraphExecUpdate, 12000)            \
  X(cuGraphExecKernelNodeSetParams, 12000)

// The resolved entry points. Every pointer is non-null once LoadDriverApi() succeeded.
// Immutable after loading; safe to use from any thread.
struct DriverApi {
#define GPURPC_CUDA_DECLARE_MEMBER(name, version) PFN_##name##_v##version name = nullptr;
  GPURPC_CUDA_DRIVER_FUNCTIONS(GPURPC_CUDA_DECLARE_MEMBER)
#undef GPURPC_CUDA_DECLARE_MEMBER

  // cuDriverGetVersion, e.g. 13000.
  int driver_version = 0;
};

// Loads and initialises the driver the first time it is called; later calls return the
// same result (the process-wide DriverApi, never freed, or the same error). Thread-safe.
// UNAVAILABLE, naming the cause, when libcuda.so.1 cannot be loaded (with dlerror's text),
// the driver is older than CUDA 13.0, an entry point is missing, or cuInit fails (with the
// CUDA error name, e.g. CUDA_ERROR_NO_DEVICE).
absl::StatusOr<const DriverApi*> LoadDriverApi();

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_DRIVER_API_H_
