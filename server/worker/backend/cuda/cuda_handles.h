// The CUDA backend's streams, events, host registrations and arrays (backend.h's Stream,
// Event, HostRegistration and Array): move-free owners of one driver object each, made by
// the Context (cuda_backend.cc).
//
// Each holds the ContextCore (context_core.h), so the primary context outlives it, and
// releases its driver object when destroyed (cuStreamDestroy, cuEventDestroy,
// cuMemHostUnregister, cuArrayDestroy), skipped on a poisoned context, whose process is about to
// end.
//
// Threading: immutable after construction; the handles may be read from any thread.
// Errors: none; destructors log a failed release (ContextCore::CleanUp).
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_HANDLES_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_HANDLES_H_

#include <cuda.h>

#include <memory>
#include <utility>

#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/context_core.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {

class CudaStream final : public Stream {
 public:
  CudaStream(std::shared_ptr<ContextCore> core, CUstream stream)
      : core_(std::move(core)), stream_(stream) {}

  // cuStreamDestroy returns at once; the driver frees the stream after its queued work.
  ~CudaStream() override {
    const DriverApi& api = core_->api();
    core_->CleanUp("cuStreamDestroy", [&] { return api.cuStreamDestroy(stream_); });
  }

  CUstream handle() const { return stream_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  const CUstream stream_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<ContextCore> core, CUevent event, bool timing_enabled)
      : core_(std::move(core)), event_(event), timing_enabled_(timing_enabled) {}

  ~CudaEvent() override {
    const DriverApi& api = core_->api();
    core_->CleanUp("cuEventDestroy", [&] { return api.cuEventDestroy(event_); });
  }

  CUevent handle() const { return event_; }
  bool timing_enabled() const { return timing_enabled_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  const CUevent event_;
  const bool timing_enabled_;
};

// A cuArray3DCreate'd array. Destroying it waits for the context's queued work first (a
// copy may still use it; backend.h promises what cuMemFree does), then destroys it with the
// context current (both skipped on a poisoned context, whose process is about to end).
class CudaArray final : public Array {
 public:
  CudaArray(std::shared_ptr<ContextCore> core, CUarray array)
      : core_(std::move(core)), array_(array) {}
  ~CudaArray() override {
    core_->CleanUp("cuCtxSynchronize",
                   [&] { return core_->api().cuCtxSynchronize(core_->context()); });
    core_->CleanUp("cuArrayDestroy", [&] { return core_->api().cuArrayDestroy(array_); });
  }
  CUarray handle() const { return array_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  const CUarray array_;
};

// Backend objects come only from this backend (the session layer never mixes backends),
// hence the static_casts.
inline CUstream ToCuStream(Stream* stream) {
  return stream == nullptr ? nullptr : static_cast<CudaStream*>(stream)->handle();
}

// A cuMemHostRegister'ed range, unregistered when destroyed (skipped on a poisoned context,
// whose process is about to end).
class CudaHostRegistration final : public HostRegistration {
 public:
  CudaHostRegistration(std::shared_ptr<ContextCore> core, void* host)
      : core_(std::move(core)), host_(host) {}
  ~CudaHostRegistration() override {
    core_->CleanUp("cuMemHostUnregister", [&] { return core_->api().cuMemHostUnregister(host_); });
  }

 private:
  const std::shared_ptr<ContextCore> core_;
  void* const host_;
};

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_HANDLES_H_
