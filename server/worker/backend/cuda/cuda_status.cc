#include "server/worker/backend/cuda/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace gpurpc::backend::cuda {
namespace {

// Names for the errors that can come before cuGetErrorName is resolved (e.g. from the
// toolkit's stub libcuda, whose cuGetProcAddress answers CUDA_ERROR_STUB_LIBRARY).
const char* FallbackErrorName(CUresult result) {
  switch (result) {
    case CUDA_ERROR_INVALID_VALUE:
      return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_INITIALIZED:
      return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_STUB_LIBRARY:
      return "CUDA_ERROR_STUB_LIBRARY";
    case CUDA_ERROR_NO_DEVICE:
      return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_NOT_SUPPORTED:
      return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
      return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case CUDA_ERROR_UNKNOWN:
      return "CUDA_ERROR_UNKNOWN";
    default:
      return nullptr;
  }
}

const char* FallbackErrorText(CUresult result) {
  return result == CUDA_ERROR_STUB_LIBRARY
             ? "libcuda is the CUDA toolkit's stub library, not the NVIDIA driver"
             : nullptr;
}

}  // namespace

absl::StatusCode StatusCodeForCuResult(CUresult result) {
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;

    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_INVALID_IMAGE:
    case CUDA_ERROR_INVALID_PTX:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_JIT_COMPILER_NOT_FOUND:
    case CUDA_ERROR_JIT_COMPILATION_DISABLED:
    case CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC:
    case CUDA_ERROR_INVALID_SOURCE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
    case CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
    case CUDA_ERROR_INVALID_CLUSTER_SIZE:
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      return absl::StatusCode::kInvalidArgument;

    case CUDA_ERROR_NOT_FOUND:
      return absl::StatusCode::kNotFound;

    // CUDA graph capture misuse and refused graph updates: the call was wrong for the
    // stream's or graph's state; never a fault of the context (the session goes on).
    case CUDA_ERROR_ILLEGAL_STATE:
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    case CUDA_ERROR_STREAM_CAPTURE_MERGE:
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED:
    case CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION:
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
    case CUDA_ERROR_CAPTURED_EVENT:
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
    case CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
      return absl::StatusCode::kFailedPrecondition;

    // Sticky: "any further CUDA work will return the same error" (cuda.h). The process
    // must exit (DESIGN §1: no in-process recovery).
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_CONTAINED:
    case CUDA_ERROR_TENSOR_MEMORY_LEAK:
    case CUDA_ERROR_EXTERNAL_DEVICE:
      return absl::StatusCode::kAborted;

    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_NVLINK_UNCORRECTABLE:
      return absl::StatusCode::kDataLoss;

    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_SYSTEM_NOT_READY:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
    // cuda.h has no CUDA_ERROR_INSUFFICIENT_DRIVER (that is the runtime API's name); a
    // driver that is too old answers one of these two.
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
    case CUDA_ERROR_NOT_READY:
      return absl::StatusCode::kUnavailable;

    default:
      return absl::StatusCode::kInternal;
  }
}

bool IsStickyCuResult(CUresult result) { return IsStickyFaultCode(StatusCodeForCuResult(result)); }

absl::Status CuResultToStatus(const DriverApi* api, CUresult result, absl::string_view call,
                              absl::string_view detail) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api != nullptr) {
    if (api->cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
    if (api->cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  }
  if (name == nullptr) name = FallbackErrorName(result);
  if (text == nullptr) text = FallbackErrorText(result);
  std::string message = name != nullptr
                            ? absl::StrCat(call, ": ", name)
                            : absl::StrCat(call, ": CUDA error ", static_cast<int>(result));
  if (text != nullptr) absl::StrAppend(&message, " (", text, ")");
  if (!detail.empty()) absl::StrAppend(&message, " - ", detail);
  return absl::Status(StatusCodeForCuResult(result), message);
}

}  // namespace gpurpc::backend::cuda
