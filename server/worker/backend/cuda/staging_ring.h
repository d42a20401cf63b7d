// Pinned host staging buffers for the CUDA backend's Upload and Download (cuda_backend.cc):
// copies from and into pageable caller memory go through them, so that the DMA reads or
// writes page-locked memory and the caller's buffer is free when the call returns.
//
// A ring is one cuMemHostAlloc allocation cut into `slot_count` slots of `slot_bytes`, each
// with an event (CU_EVENT_DISABLE_TIMING) recorded after the copy that uses it; a slot is
// reused only after its event has completed. The memory and the events are made on first use
// (EnsureAllocated) and freed by Destroy.
//
// Threading: all methods except the constructor, mutex() and slot_bytes() require mutex()
// held (ABSL_EXCLUSIVE_LOCKS_REQUIRED), and all but the slot accessors also the context
// current (ContextCore::MakeCurrent). One copy holds the mutex from its first slot to its
// last.
// Errors: the failed driver call's status (ContextCore::Error): RESOURCE_EXHAUSTED when the
// pinned memory cannot be allocated, ABORTED / DATA_LOSS for a sticky fault of the copy a
// slot waits for. Destroy only logs.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_STAGING_RING_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_STAGING_RING_H_

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/worker/backend/cuda/context_core.h"

namespace gpurpc::backend::cuda {

class StagingRing {
 public:
  struct Slot {
    uint8_t* host = nullptr;
    CUevent done = nullptr;
    bool pending = false;  // `done` was recorded and not yet waited for.
  };

  StagingRing(size_t slot_bytes, int slot_count)
      : slot_bytes_(slot_bytes), slots_(static_cast<size_t>(slot_count)) {}

  absl::Mutex& mutex() ABSL_LOCK_RETURNED(mu_) { return mu_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t slot_count() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return slots_.size(); }
  Slot& slot(uint64_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return slots_[index % slots_.size()];
  }
  Slot& NextSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return slots_[next_++ % slots_.size()]; }

  // Allocates the pinned memory and the slots' events unless that was done already.
  absl::Status EnsureAllocated(ContextCore& core) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Waits until the last copy that used `slot` has completed.
  absl::Status WaitIdle(ContextCore& core, Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Marks `slot` busy until the work just queued on `stream` completes.
  absl::Status MarkPending(ContextCore& core, Slot& slot, CUstream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Waits for in-flight copies, then frees the events and the pinned memory. Never throws.
  void Destroy(ContextCore& core) noexcept ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  absl::Mutex mu_;
  const size_t slot_bytes_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  void* host_ ABSL_GUARDED_BY(mu_) = nullptr;  // One allocation; the slots are slices of it.
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_STAGING_RING_H_
