// CUresult -> absl::Status, following the error contract of backend.h.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_STATUS_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_STATUS_H_

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {

// The absl code for a failed driver call:
// - RESOURCE_EXHAUSTED: out of memory.
// - INVALID_ARGUMENT: a rejected value, handle, image or launch configuration.
// - NOT_FOUND: a missing name (kernel, global).
// - FAILED_PRECONDITION: CUDA graph capture misuse (CUDA_ERROR_STREAM_CAPTURE_*,
//   CUDA_ERROR_CAPTURED_EVENT, CUDA_ERROR_ILLEGAL_STATE) or a refused graph update
//   (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE). Not sticky.
// - ABORTED: a sticky execution fault; the context (in fact the process) is unusable.
// - DATA_LOSS: an uncorrectable ECC or NVLink error (also sticky).
// - UNAVAILABLE: no driver or device, or not ready yet (CUDA_ERROR_NOT_READY).
// - INTERNAL: anything else.
// `result` must not be CUDA_SUCCESS.
absl::StatusCode StatusCodeForCuResult(CUresult result);

// True for the errors after which the context cannot be used any more: those whose code
// above is a sticky fault (IsStickyFaultCode, common/grpc_status.h: ABORTED or DATA_LOSS).
bool IsStickyCuResult(CUresult result);

// "<call>: <CUDA_ERROR_NAME> (<cuGetErrorString text>)[ - <detail>]" with the code of
// StatusCodeForCuResult. `api` may be null (names are then unavailable). Call it only on
// failure: it builds strings.
absl::Status CuResultToStatus(const DriverApi* api, CUresult result, absl::string_view call,
                              absl::string_view detail = {});

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_STATUS_H_
