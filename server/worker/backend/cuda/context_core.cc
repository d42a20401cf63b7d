#include "server/worker/backend/cuda/context_core.h"

#include "absl/strings/str_cat.h"
#include "server/worker/backend/cuda/cuda_status.h"

namespace gpurpc::backend::cuda {

ContextCore::~ContextCore() {
  if (poisoned()) {
    spdlog::debug("cuDevicePrimaryCtxRelease skipped on device {}: the context is poisoned",
                  ordinal_);
    return;
  }
  const CUresult result = api_.cuDevicePrimaryCtxRelease(device_);
  if (result != CUDA_SUCCESS) {
    spdlog::warn("{}", CuResultToStatus(&api_, result, "cuDevicePrimaryCtxRelease",
                                        absl::StrCat("device ", ordinal_))
                           .ToString());
  }
}

absl::Status ContextCore::Error(CUresult result, const char* call, absl::string_view detail) {
  absl::Status status = CuResultToStatus(&api_, result, call, detail);
  if (IsStickyCuResult(result) && !poisoned_.exchange(true, std::memory_order_acq_rel)) {
    spdlog::error("the CUDA context on device {} is poisoned: {}", ordinal_, status.ToString());
  }
  return status;
}

}  // namespace gpurpc::backend::cuda
