// The retained primary context of one device, shared by the CUDA backend's Context and every
// object it creates (cuda_backend.cc).
//
// Each holds the ContextCore through a shared_ptr, so the primary context is released
// (cuDevicePrimaryCtxRelease) only after the last of them is gone. Before each driver call the
// caller makes the context current on its thread (MakeCurrent: gRPC calls arrive on a thread
// pool); failed calls become statuses through Check / Error (cuda_status.h), and Error
// remembers when a sticky fault has poisoned the context, after which CleanUp (for
// destructors) skips its driver calls.
//
// Threading: every method may be called from any thread at once; the only mutable state is
// the poisoned flag, an atomic.
// Errors: MakeCurrent, Check and Error return backend.h's codes for the failed call (see
// CuResultToStatus); CleanUp and the destructor only log.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_CONTEXT_CORE_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_CONTEXT_CORE_H_

#include <cuda.h>

#include <atomic>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "spdlog/spdlog.h"

namespace gpurpc::backend::cuda {

class ContextCore {
 public:
  // Takes over one reference to the primary context of `device` (released by the
  // destructor).
  ContextCore(const DriverApi& api, CUdevice device, CUcontext context, int ordinal)
      : api_(api), device_(device), context_(context), ordinal_(ordinal) {}

  ContextCore(const ContextCore&) = delete;
  ContextCore& operator=(const ContextCore&) = delete;

  ~ContextCore();

  const DriverApi& api() const { return api_; }
  CUcontext context() const { return context_; }
  int ordinal() const { return ordinal_; }
  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }

  // Makes the context current on the calling thread. The process owns one context, so it
  // is left current afterwards; the usual cost is one cuCtxGetCurrent (a thread-local
  // read in the driver).
  absl::Status MakeCurrent() {
    CUcontext current = nullptr;
    CUresult result = api_.cuCtxGetCurrent(&current);
    if (ABSL_PREDICT_TRUE(result == CUDA_SUCCESS && current == context_)) {
      return absl::OkStatus();
    }
    if (result != CUDA_SUCCESS) return Error(result, "cuCtxGetCurrent");
    result = api_.cuCtxSetCurrent(context_);
    if (ABSL_PREDICT_FALSE(result != CUDA_SUCCESS)) return Error(result, "cuCtxSetCurrent");
    return absl::OkStatus();
  }

  absl::Status Check(CUresult result, const char* call) {
    if (ABSL_PREDICT_TRUE(result == CUDA_SUCCESS)) return absl::OkStatus();
    return Error(result, call);
  }

  // The status for a failed call (see CuResultToStatus). A sticky fault poisons the
  // context. Failure path only.
  ABSL_ATTRIBUTE_NOINLINE absl::Status Error(CUresult result, const char* call,
                                             absl::string_view detail = {});

  // For destructors: runs `release` (returning a CUresult) with the context current, unless
  // the context is poisoned. Logs failures; never throws.
  template <typename F>
  void CleanUp(const char* call, const F& release) noexcept {
    if (poisoned()) {
      spdlog::debug("{} skipped: the CUDA context on device {} is poisoned", call, ordinal_);
      return;
    }
    absl::Status status = MakeCurrent();
    if (status.ok()) status = Check(release(), call);
    if (status.ok()) return;
    if (poisoned()) {
      spdlog::debug("{} (cleanup abandoned)", status.ToString());
    } else {
      spdlog::warn("cleanup failed: {}", status.ToString());
    }
  }

 private:
  const DriverApi& api_;
  const CUdevice device_;
  const CUcontext context_;
  const int ordinal_;
  std::atomic<bool> poisoned_{false};
};

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_CONTEXT_CORE_H_
