#include "server/worker/backend/cuda/staging_ring.h"

#include "absl/base/optimization.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {

absl::Status StagingRing::EnsureAllocated(ContextCore& core) {
  if (host_ != nullptr) return absl::OkStatus();
  const DriverApi& api = core.api();
  const size_t total_bytes = slot_bytes_ * slots_.size();
  void* host = nullptr;
  CUresult result = api.cuMemHostAlloc(&host, total_bytes, 0);
  if (result != CUDA_SUCCESS) {
    return core.Error(result, "cuMemHostAlloc",
                      absl::StrCat(total_bytes, " bytes of pinned staging memory"));
  }
  size_t created = 0;
  for (; created < slots_.size(); ++created) {
    result = api.cuEventCreate(&slots_[created].done, CU_EVENT_DISABLE_TIMING);
    if (result != CUDA_SUCCESS) break;
  }
  if (result != CUDA_SUCCESS) {
    absl::Status status = core.Error(result, "cuEventCreate", "staging event");
    for (size_t i = 0; i < created; ++i) {
      api.cuEventDestroy(slots_[i].done);
      slots_[i].done = nullptr;
    }
    api.cuMemFreeHost(host);
    return status;
  }
  host_ = host;
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].host = static_cast<uint8_t*>(host_) + i * slot_bytes_;
    slots_[i].pending = false;
  }
  return absl::OkStatus();
}

absl::Status StagingRing::WaitIdle(ContextCore& core, Slot& slot) {
  if (!slot.pending) return absl::OkStatus();
  const CUresult result = core.api().cuEventSynchronize(slot.done);
  // CUDA_ERROR_CAPTURED_EVENT: a stream capture that began while the copy was enqueued
  // recorded the copy and the event instead of running them; nothing on a stream reads
  // the slot, so it is free (without this, it would stay busy for good).
  if (result != CUDA_ERROR_CAPTURED_EVENT) {
    GPURPC_RETURN_IF_ERROR(core.Check(result, "cuEventSynchronize"));
  }
  slot.pending = false;
  return absl::OkStatus();
}

absl::Status StagingRing::MarkPending(ContextCore& core, Slot& slot, CUstream stream) {
  const CUresult result = core.api().cuEventRecord(slot.done, stream);
  if (ABSL_PREDICT_FALSE(result != CUDA_SUCCESS)) {
    // Without the event we cannot tell when the DMA stops reading the slot: wait.
    core.api().cuStreamSynchronize(stream);
    return core.Error(result, "cuEventRecord", "staging event");
  }
  slot.pending = true;
  return absl::OkStatus();
}

void StagingRing::Destroy(ContextCore& core) noexcept {
  if (host_ == nullptr) return;
  const DriverApi& api = core.api();
  for (Slot& slot : slots_) {
    if (slot.pending) {
      core.CleanUp("cuEventSynchronize", [&] { return api.cuEventSynchronize(slot.done); });
    }
    core.CleanUp("cuEventDestroy", [&] { return api.cuEventDestroy(slot.done); });
    slot = Slot{};
  }
  void* host = host_;
  core.CleanUp("cuMemFreeHost", [&] { return api.cuMemFreeHost(host); });
  host_ = nullptr;
}

}  // namespace gpurpc::backend::cuda
