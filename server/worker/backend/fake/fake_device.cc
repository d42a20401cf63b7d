#include "server/worker/backend/fake/fake_device.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/fake/fake_graph.h"
#include "server/worker/backend/fake/fake_kernels.h"

namespace gpurpc::backend::fake {
namespace {

// Far from zero, so that a null or a small integer used as a pointer never resolves, and
// easy to recognise in logs.
constexpr DevicePtr kFirstAddress = 0x100000000000;
// cuMemAlloc's alignment guarantee.
constexpr uint64_t kAlignmentBytes = 256;
// Unmapped space after every allocation, so that running past the end of one buffer faults
// instead of landing silently in the next one.
constexpr uint64_t kGapBytes = uint64_t{1} << 20;

constexpr char kIllegalAddress[] =
    "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)";
constexpr char kMisalignedAddress[] = "CUDA_ERROR_MISALIGNED_ADDRESS (misaligned address)";
constexpr char kNotReady[] = "CUDA_ERROR_NOT_READY (device not ready)";
constexpr char kContextDestroyed[] = "CUDA_ERROR_CONTEXT_IS_DESTROYED (context is destroyed)";

// The longest spin_us honoured (about 35 years): beyond it a kernel spins until its context is
// destroyed.
constexpr uint64_t kMaxSpinUs = uint64_t{1} << 50;

// Bounds on what may wait in the queues (EnqueueLocked): pieces of work per stream, and
// upload and kernel-argument bytes per context.
constexpr size_t kMaxQueuedWork = 1024;
constexpr uint64_t kMaxQueuedBytes = uint64_t{64} << 20;

std::string Hex(DevicePtr ptr) { return absl::StrFormat("0x%x", ptr); }

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return std::nullopt;
  return a * b;
}

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  return CheckedMul(a, b).value_or(std::numeric_limits<uint64_t>::max());
}

absl::Status CheckLaunchConfig(const FakeFunction& function, const LaunchConfig& config) {
  const std::array<uint32_t, 3> grid = {config.grid.x, config.grid.y, config.grid.z};
  const std::array<uint32_t, 3> block = {config.block.x, config.block.y, config.block.z};
  const auto describe = [&] {
    return absl::StrFormat("grid (%u, %u, %u), block (%u, %u, %u)", grid[0], grid[1], grid[2],
                           block[0], block[1], block[2]);
  };
  for (size_t d = 0; d < 3; ++d) {
    if (grid[d] == 0 || grid[d] > static_cast<uint32_t>(kMaxGridDim[d]) || block[d] == 0 ||
        block[d] > static_cast<uint32_t>(kMaxBlockDim[d])) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuLaunchKernel: ", kInvalidValue, ": ", describe(),
                       " is outside the fake device's limits for kernel '", function.name(), "'"));
    }
  }
  const uint64_t block_threads = uint64_t{block[0]} * block[1] * block[2];
  if (block_threads > static_cast<uint64_t>(function.attributes().max_threads_per_block)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuLaunchKernel: ", kInvalidValue, ": ", describe(), " has ", block_threads,
        " threads per block, more than the ", function.attributes().max_threads_per_block,
        " that kernel '", function.name(), "' allows"));
  }
  // The driver refuses more dynamic shared memory than the function's
  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (48 KiB until raised).
  const int dynamic_limit = function.max_dynamic_shared_bytes();
  if (config.shared_memory_bytes > static_cast<uint32_t>(std::max(0, dynamic_limit))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuLaunchKernel: ", kInvalidValue, ": ", config.shared_memory_bytes,
        " bytes of dynamic shared memory, more than the ", dynamic_limit, " kernel '",
        function.name(),
        "' may use (its CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; a block may use ",
        kSharedMemoryPerBlockBytes, " without opting in)"));
  }
  return absl::OkStatus();
}

FakeStream::~FakeStream() { state_->DestroyQueue(queue_); }

FakeEvent::~FakeEvent() { state_->DestroyEvent(id_); }

DeviceState::DeviceState(uint64_t total_memory_bytes)
    : total_memory_bytes_(total_memory_bytes), next_address_(kFirstAddress) {
  absl::MutexLock lock(&mu_);
  auto legacy = std::make_unique<Queue>();
  legacy->legacy = true;
  Queue* const queue = legacy.get();
  queues_.emplace(kLegacyQueue, std::move(legacy));
  // If the host cannot start one thread, nothing else would work either.
  queue->thread = std::thread(&DeviceState::RunQueue, this, kLegacyQueue);
}

void DeviceState::Shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    for (auto& [id, queue] : queues_) {
      if (queue->thread.joinable()) threads.push_back(std::move(queue->thread));
    }
  }
  for (std::thread& thread : threads) thread.join();
  absl::MutexLock lock(&mu_);
  queues_.clear();
}

absl::Status DeviceState::CheckHealthy(absl::string_view call) {
  absl::MutexLock lock(&mu_);
  return StickyErrorLocked(call);
}

// --- Memory ----------------------------------------------------------------------------------

absl::StatusOr<DevicePtr> DeviceState::Alloc(absl::string_view call, uint64_t size_bytes) {
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  if (size_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", kInvalidValue, ": cannot allocate 0 bytes"));
  }
  const uint64_t free_bytes = total_memory_bytes_ - used_bytes_;
  if (size_bytes > free_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(call, ": fake device out of memory: asked for ", size_bytes, " bytes, ",
                     free_bytes, " of ", total_memory_bytes_, " free"));
  }
  // calloc takes large blocks straight from mmap: zero pages that cost nothing until
  // touched, so multi-GiB fake buffers are cheap.
  void* host = std::calloc(size_bytes, 1);
  if (host == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(call, ": the host cannot back ", size_bytes, " bytes of fake device memory"));
  }
  // Addresses only grow, so a freed address never comes back: a stale pointer misses
  // instead of reaching a newer buffer.
  const DevicePtr ptr = next_address_;
  next_address_ = AlignUp(ptr + size_bytes + kGapBytes, kAlignmentBytes);
  allocations_.emplace(ptr, Allocation{size_bytes, HostMemory(static_cast<uint8_t*>(host))});
  used_bytes_ += size_bytes;
  return ptr;
}

absl::Status DeviceState::Free(DevicePtr ptr) {
  constexpr absl::string_view kCall = "cuMemFree";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  if (allocations_.find(ptr) == allocations_.end()) return NoAllocation(ptr);
  GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, AllQueuesLocked()));
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  // Another thread may have freed it while this one waited.
  if (!ReleaseLocked(ptr)) return NoAllocation(ptr);
  return absl::OkStatus();
}

void DeviceState::Release(DevicePtr ptr) {
  absl::MutexLock lock(&mu_);
  WaitLocked("cuModuleUnload", AllQueuesLocked()).IgnoreError();
  ReleaseLocked(ptr);
}

void DeviceState::ReleaseAll() {
  absl::MutexLock lock(&mu_);
  allocations_.clear();
  used_bytes_ = 0;
}

absl::StatusOr<MemInfo> DeviceState::GetMemInfo() {
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked("cuMemGetInfo"));
  return MemInfo{total_memory_bytes_ - used_bytes_, total_memory_bytes_};
}

// --- Stream-ordered work ---------------------------------------------------------------------

absl::Status DeviceState::Upload(DevicePtr dst, const void* src, uint64_t size_bytes,
                                 Stream* stream) {
  constexpr absl::string_view kCall = "cuMemcpyHtoDAsync";
  Work work;
  work.kind = WorkKind::kUpload;
  work.dst = dst;
  work.size_bytes = size_bytes;
  // `src` may be reused as soon as this returns: the bytes travel with the work.
  const auto* bytes = static_cast<const uint8_t*>(src);
  if (size_bytes > 0) work.bytes.assign(bytes, bytes + size_bytes);
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  // Like CUDA, an empty copy succeeds whatever the address.
  if (size_bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, size_bytes));
  GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, dst, size_bytes).status());
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream) {
  constexpr absl::string_view kCall = "cuMemcpyDtoHAsync";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  if (size_bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, src, size_bytes).status());
  Work work;
  work.kind = WorkKind::kDownload;
  work.src = src;
  work.size_bytes = size_bytes;
  work.host = dst;
  const uint64_t seq = EnqueueLocked(queue, std::move(work));
  GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, {Point{queue, seq}}));
  // A fault before the copy skipped it.
  return StickyErrorLocked(kCall);
}

// --- Registered host memory (same-host regions) ----------------------------------------------

absl::Status DeviceState::RegisterHost(const void* host, uint64_t size_bytes) {
  constexpr absl::string_view kCall = "cuMemHostRegister";
  const auto start = reinterpret_cast<uintptr_t>(host);
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  if (host == nullptr || size_bytes == 0 || start + size_bytes < start) {
    return absl::InvalidArgumentError(
        absl::StrCat(kCall, ": ", kInvalidValue, ": an empty or wrapping host range"));
  }
  // Overlap with a registered range: the one starting after `start`, or the one before.
  auto next = registered_.lower_bound(start);
  const bool overlaps_next = next != registered_.end() && next->first < start + size_bytes;
  const bool overlaps_prev =
      next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > start;
  if (overlaps_next || overlaps_prev) {
    return absl::InvalidArgumentError(absl::StrCat(
        kCall, ": CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (part of the range is registered)"));
  }
  registered_.emplace(start, size_bytes);
  return absl::OkStatus();
}

void DeviceState::UnregisterHost(const void* host) {
  absl::MutexLock lock(&mu_);
  WaitLocked("cuMemHostUnregister", AllQueuesLocked()).IgnoreError();
  registered_.erase(reinterpret_cast<uintptr_t>(host));
}

absl::Status DeviceState::CopyHostAsync(bool to_device, DevicePtr device, void* host,
                                        uint64_t size_bytes, Stream* stream) {
  const absl::string_view call = to_device ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(call, stream));
  if (size_bytes == 0) return absl::OkStatus();
  const auto start = reinterpret_cast<uintptr_t>(host);
  auto range = registered_.upper_bound(start);
  if (range == registered_.begin() || start + size_bytes < start ||
      std::prev(range)->first + std::prev(range)->second < start + size_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", kInvalidValue, ": the host range is not registered host memory"));
  }
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(call, queue, 0));
  GPURPC_RETURN_IF_ERROR(ResolveLocked(call, device, size_bytes).status());
  Work work;
  work.kind = to_device ? WorkKind::kUploadFromHost : WorkKind::kDownload;
  work.dst = to_device ? device : 0;
  work.src = to_device ? 0 : device;
  work.size_bytes = size_bytes;
  work.host = host;
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes,
                                 uint64_t count, Stream* stream) {
  absl::string_view call = "cuMemsetAsync";
  if (element_size_bytes == 1) call = "cuMemsetD8Async";
  if (element_size_bytes == 2) call = "cuMemsetD16Async";
  if (element_size_bytes == 4) call = "cuMemsetD32Async";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(call, stream, kCapturable));
  if (element_size_bytes != 1 && element_size_bytes != 2 && element_size_bytes != 4) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": element size ",
                                                   element_size_bytes,
                                                   " bytes; it must be 1, 2 or 4"));
  }
  const std::optional<uint64_t> size_bytes = CheckedMul(count, element_size_bytes);
  if (!size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": ", count,
                                                   " elements overflow the address space"));
  }
  // Like an empty copy (and the CUDA backend), an empty memset succeeds whatever the address.
  if (*size_bytes == 0) return absl::OkStatus();
  // cuMemsetD16/D32 require an address aligned to the element.
  if (dst % element_size_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": address ",
                                                   Hex(dst), " is not aligned to ",
                                                   element_size_bytes, " bytes"));
  }
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(call, queue, 0));
  GPURPC_RETURN_IF_ERROR(ResolveLocked(call, dst, *size_bytes).status());
  Work work;
  work.kind = WorkKind::kMemset;
  work.dst = dst;
  work.value = value;
  work.element_size_bytes = element_size_bytes;
  work.count = count;
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes,
                                             Stream* stream) {
  constexpr absl::string_view kCall = "cuMemcpyDtoDAsync";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream, kCapturable));
  if (size_bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, dst, size_bytes).status());
  GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, src, size_bytes).status());
  Work work;
  work.kind = WorkKind::kCopy;
  work.dst = dst;
  work.src = src;
  work.size_bytes = size_bytes;
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::Copy3D(const Layout& dst, const Layout& src, uint64_t width_bytes,
                                 uint64_t height, uint64_t depth, Stream* stream) {
  constexpr absl::string_view kCall = "cuMemcpy3DAsync";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  if (width_bytes == 0 || height == 0 || depth == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  // Both ends' first and last rows lie in one allocation each (the rows between them
  // then do too: an allocation is contiguous).
  for (const Layout* end : {&dst, &src}) {
    const uint64_t last = (depth - 1) * end->slice + (height - 1) * end->pitch;
    GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, end->address, width_bytes).status());
    GPURPC_RETURN_IF_ERROR(ResolveLocked(kCall, end->address + last, width_bytes).status());
    if (FindLocked(end->address, last + width_bytes) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kInvalidValue, ": the copy's rows at ", Hex(end->address),
                       " do not lie within one live fake allocation"));
    }
  }
  Work work;
  work.kind = WorkKind::kCopy3D;
  work.dst = dst.address;
  work.src = src.address;
  work.size_bytes = width_bytes;
  work.dst_pitch = dst.pitch;
  work.dst_slice = dst.slice;
  work.src_pitch = src.pitch;
  work.src_slice = src.slice;
  work.rows = height;
  work.count = depth;
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::Launch(Function* function, const LaunchConfig& config,
                                 absl::Span<const uint8_t> packed_args, Stream* stream) {
  constexpr absl::string_view kCall = "cuLaunchKernel";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream, kCapturable));
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, packed_args.size()));
  const auto* fake = dynamic_cast<const FakeFunction*>(function);
  if (fake == nullptr || fake->owner() != this) {
    return absl::InvalidArgumentError(absl::StrCat(
        kCall, ": ", kInvalidHandle, ": the function was not loaded by this fake context"));
  }
  GPURPC_RETURN_IF_ERROR(CheckLaunchConfig(*fake, config));
  const BuiltinKernel& kernel = fake->kernel();
  if (packed_args.size() != PackedSizeBytes(kernel)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kCall, ": ", kInvalidValue, ": kernel '", kernel.name, "' takes ", PackedSizeBytes(kernel),
        " bytes of packed arguments, got ", packed_args.size()));
  }
  Work work;
  work.kind = WorkKind::kKernel;
  work.kernel = &kernel;
  work.count = SaturatingMul(SaturatingMul(uint64_t{config.grid.x} * config.grid.y, config.grid.z),
                             uint64_t{config.block.x} * config.block.y * config.block.z);
  work.bytes.assign(packed_args.begin(), packed_args.end());
  // A fault surfaces at a later call, as it does asynchronously on a GPU.
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

// --- Streams and events ----------------------------------------------------------------------

absl::StatusOr<uint64_t> DeviceState::CreateQueue(absl::string_view call, bool non_blocking) {
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  GPURPC_RETURN_IF_ERROR(CheckAliveLocked(call));
  const uint64_t id = next_queue_id_++;
  auto queue = std::make_unique<Queue>();
  queue->non_blocking = non_blocking;
  Queue* const raw = queue.get();
  queues_.emplace(id, std::move(queue));
  try {
    // The thread waits for the lock this call holds before it looks at its queue.
    raw->thread = std::thread(&DeviceState::RunQueue, this, id);
  } catch (const std::system_error& error) {
    queues_.erase(id);
    return absl::ResourceExhaustedError(
        absl::StrCat(call, ": the host cannot start a thread for a fake stream: ", error.what()));
  }
  return id;
}

void DeviceState::DestroyQueue(uint64_t id) {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    const auto it = queues_.find(id);
    if (it == queues_.end()) return;  // after Shutdown
    it->second->closing = true;
    thread = std::move(it->second->thread);
  }
  // The thread ends once its queue is empty (or at Shutdown).
  if (thread.joinable()) thread.join();
  absl::MutexLock lock(&mu_);
  queues_.erase(id);
}

absl::Status DeviceState::SynchronizeStream(Stream* stream) {
  constexpr absl::string_view kCall = "cuStreamSynchronize";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, StreamPointsLocked(queue)));
  return StickyErrorLocked(kCall);
}

absl::StatusOr<bool> DeviceState::QueryStream(Stream* stream) {
  constexpr absl::string_view kCall = "cuStreamQuery";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  return AllDoneLocked(StreamPointsLocked(queue));
}

absl::Status DeviceState::StreamWaitEvent(Stream* stream, Event* event) {
  constexpr absl::string_view kCall = "cuStreamWaitEvent";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  GPURPC_ASSIGN_OR_RETURN(EventState* const state, EventOfLocked(kCall, event));
  if (!state->recorded) return absl::OkStatus();
  Work work;
  work.kind = WorkKind::kWait;
  work.after.push_back(*state->recorded);
  EnqueueLocked(queue, std::move(work));
  return absl::OkStatus();
}

absl::Status DeviceState::Synchronize() {
  constexpr absl::string_view kCall = "cuCtxSynchronize";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  for (auto& [id, queue] : queues_) {
    if (queue->capturing) {
      for (auto& [other_id, other] : queues_) other->capture_invalidated |= other->capturing;
      return CaptureError(kCall, kCaptureUnsupported, "a stream of the context is capturing");
    }
  }
  GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, AllQueuesLocked()));
  return StickyErrorLocked(kCall);
}

absl::StatusOr<uint64_t> DeviceState::CreateEvent(absl::string_view call, bool disable_timing) {
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  const uint64_t id = next_event_id_++;
  events_[id].disable_timing = disable_timing;
  return id;
}

void DeviceState::DestroyEvent(uint64_t id) {
  absl::MutexLock lock(&mu_);
  events_.erase(id);
}

absl::Status DeviceState::RecordEvent(Event* event, Stream* stream) {
  constexpr absl::string_view kCall = "cuEventRecord";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  GPURPC_ASSIGN_OR_RETURN(EventState* const state, EventOfLocked(kCall, event));
  Work work;
  work.kind = WorkKind::kRecord;
  work.event = static_cast<const FakeEvent*>(event)->id();
  // The event now stands for this point, whatever an earlier record still queued does.
  state->recorded = Point{queue, EnqueueLocked(queue, std::move(work))};
  state->completed_at.reset();
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceState::QueryEvent(Event* event) {
  constexpr absl::string_view kCall = "cuEventQuery";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const EventState* const state, EventOfLocked(kCall, event));
  return !state->recorded || DoneLocked(*state->recorded);
}

absl::Status DeviceState::SynchronizeEvent(Event* event) {
  constexpr absl::string_view kCall = "cuEventSynchronize";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const EventState* const state, EventOfLocked(kCall, event));
  if (state->recorded) GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, {*state->recorded}));
  return StickyErrorLocked(kCall);
}

absl::StatusOr<float> DeviceState::ElapsedTime(Event* start, Event* end) {
  constexpr absl::string_view kCall = "cuEventElapsedTime";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const EventState* const from, EventOfLocked(kCall, start));
  GPURPC_ASSIGN_OR_RETURN(const EventState* const to, EventOfLocked(kCall, end));
  for (const EventState* state : {from, to}) {
    if (state->disable_timing) {
      return absl::FailedPreconditionError(
          absl::StrCat(kCall, ": the event was created with timing disabled"));
    }
    if (!state->recorded) {
      return absl::FailedPreconditionError(absl::StrCat(kCall, ": event has not been recorded"));
    }
  }
  for (const EventState* state : {from, to}) {
    if (!DoneLocked(*state->recorded)) {
      return absl::UnavailableError(
          absl::StrCat(kCall, ": ", kNotReady, " - event not completed yet"));
    }
    if (!state->completed_at) {
      // Only a point whose work was dropped at Shutdown completes without a time.
      return absl::AbortedError(absl::StrCat(kCall, ": ", kContextDestroyed));
    }
  }
  return std::chrono::duration<float, std::milli>(*to->completed_at - *from->completed_at).count();
}

// --- CUDA graphs (fake_graph.h) --------------------------------------------------------------

absl::Status DeviceState::BeginCapture(Stream* stream) {
  constexpr absl::string_view kCall = "cuStreamBeginCapture";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  if (stream == nullptr) {
    return CaptureError(kCall, kCaptureUnsupported, "the legacy stream cannot be captured");
  }
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, QueueOfLocked(kCall, stream, kCapturable));
  Queue& queue = *queues_.at(id);
  if (queue.capturing) {
    return CaptureError(kCall, kIllegalState, "the stream is already capturing");
  }
  queue.capturing = true;
  queue.capture_invalidated = false;
  queue.capture.clear();
  return absl::OkStatus();
}

absl::StatusOr<GraphOps> DeviceState::EndCapture(Stream* stream) {
  constexpr absl::string_view kCall = "cuStreamEndCapture";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  if (stream == nullptr) return CaptureError(kCall, kIllegalState, "the stream is not capturing");
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, QueueOfLocked(kCall, stream, kCapturable));
  Queue& queue = *queues_.at(id);
  if (!queue.capturing) return CaptureError(kCall, kIllegalState, "the stream is not capturing");
  queue.capturing = false;
  GraphOps ops = std::move(queue.capture);
  queue.capture.clear();
  if (queue.capture_invalidated) {
    return CaptureError(kCall, kCaptureInvalidated,
                        "work the capture could not record was enqueued on a capturing stream");
  }
  return ops;
}

absl::StatusOr<CaptureStatus> DeviceState::QueryCapture(Stream* stream) {
  constexpr absl::string_view kCall = "cuStreamIsCapturing";
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  if (stream == nullptr) return CaptureStatus::kNone;
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, QueueOfLocked(kCall, stream, kCapturable));
  const Queue& queue = *queues_.at(id);
  if (!queue.capturing) return CaptureStatus::kNone;
  return queue.capture_invalidated ? CaptureStatus::kInvalidated : CaptureStatus::kActive;
}

absl::Status DeviceState::LaunchGraph(FakeGraphExec* exec, Stream* stream) {
  constexpr absl::string_view kCall = "cuGraphLaunch";
  std::shared_ptr<const GraphOps> ops = exec->snapshot();
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
  GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
  GPURPC_RETURN_IF_ERROR(MakeRoomLocked(kCall, queue, 0));
  Work work;
  work.kind = WorkKind::kGraph;
  work.graph = std::move(ops);
  if (exec->last_launch_seq != 0) {
    work.after.push_back(Point{exec->last_launch_queue, exec->last_launch_seq});
  }
  exec->last_launch_seq = EnqueueLocked(queue, std::move(work));
  exec->last_launch_queue = queue;
  return absl::OkStatus();
}

// --- Private helpers -------------------------------------------------------------------------

absl::Status DeviceState::CaptureError(absl::string_view call, absl::string_view error,
                                       absl::string_view detail) {
  return absl::FailedPreconditionError(absl::StrCat(call, ": ", error, ": ", detail));
}

absl::Status DeviceState::StickyErrorLocked(absl::string_view call) const {
  if (fault_.empty()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(call, ": ", fault_));
}

absl::Status DeviceState::CheckAliveLocked(absl::string_view call) const {
  if (!shutting_down_) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrCat(call, ": ", kContextDestroyed, ": the fake context is being destroyed"));
}

void DeviceState::PoisonLocked(absl::string_view error, absl::string_view where) {
  if (fault_.empty()) fault_ = absl::StrCat(error, " in ", where);
}

absl::Status DeviceState::NoAllocation(DevicePtr ptr) {
  return absl::InvalidArgumentError(
      absl::StrCat("cuMemFree: ", kInvalidValue, ": no live fake allocation starts at ", Hex(ptr)));
}

absl::StatusOr<uint64_t> DeviceState::QueueOfLocked(absl::string_view call, Stream* stream,
                                                    bool capturable) {
  GPURPC_RETURN_IF_ERROR(CheckAliveLocked(call));
  if (stream == nullptr) {
    bool implicit = false;
    for (auto& [id, queue] : queues_) {
      if (queue->capturing && !queue->non_blocking) {
        queue->capture_invalidated = true;
        implicit = true;
      }
    }
    if (implicit) return CaptureError(call, kCaptureImplicit, "a blocking stream is capturing");
    return kLegacyQueue;
  }
  const auto* fake = dynamic_cast<const FakeStream*>(stream);
  if (fake == nullptr || fake->owner() != this || queues_.count(fake->queue()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": ", kInvalidHandle, ": the stream was not created by this fake context"));
  }
  Queue& queue = *queues_.at(fake->queue());
  if (queue.capturing && !capturable) {
    queue.capture_invalidated = true;
    return CaptureError(call, kCaptureUnsupported, "the stream is capturing a graph");
  }
  return fake->queue();
}

absl::StatusOr<DeviceState::EventState*> DeviceState::EventOfLocked(absl::string_view call,
                                                                    Event* event) {
  const auto* fake = dynamic_cast<const FakeEvent*>(event);
  const auto it =
      fake == nullptr || fake->owner() != this ? events_.end() : events_.find(fake->id());
  if (it == events_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": ", kInvalidHandle, ": the event was not created by this fake context"));
  }
  return &it->second;
}

absl::Status DeviceState::MakeRoomLocked(absl::string_view call, uint64_t queue_id,
                                         uint64_t bytes) {
  const auto room = [this, queue_id, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shutting_down_) return true;
    const auto it = queues_.find(queue_id);
    if (it == queues_.end()) return true;
    return it->second->pending.size() < kMaxQueuedWork &&
           (queued_bytes_ == 0 ||
            (queued_bytes_ <= kMaxQueuedBytes && bytes <= kMaxQueuedBytes - queued_bytes_));
  };
  mu_.Await(absl::Condition(&room));
  GPURPC_RETURN_IF_ERROR(CheckAliveLocked(call));
  // A fault may have come while this waited.
  GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
  if (queues_.count(queue_id) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", kInvalidHandle, ": the stream was destroyed meanwhile"));
  }
  return absl::OkStatus();
}

uint64_t DeviceState::EnqueueLocked(uint64_t queue_id, Work work) {
  Queue& queue = *queues_.at(queue_id);
  if (queue.capturing) {
    if (Record(work, &queue.capture)) return 0;
    queue.capture_invalidated = true;
  }
  if (queue.legacy) {
    for (const auto& [id, other] : queues_) {
      if (!other->legacy && !other->non_blocking && other->completed < other->enqueued) {
        work.after.push_back(Point{id, other->enqueued});
      }
    }
  } else if (!queue.non_blocking) {
    const Queue& legacy = *queues_.at(kLegacyQueue);
    if (legacy.completed < legacy.enqueued) {
      work.after.push_back(Point{kLegacyQueue, legacy.enqueued});
    }
  }
  work.seq = ++queue.enqueued;
  queued_bytes_ += work.bytes.size();
  queue.pending.push_back(std::move(work));
  return queue.enqueued;
}

bool DeviceState::DoneLocked(const Point& point) const {
  const auto it = queues_.find(point.queue);
  return it == queues_.end() || it->second->completed >= point.seq;
}

bool DeviceState::AllDoneLocked(const std::vector<Point>& points) const {
  for (const Point& point : points) {
    if (!DoneLocked(point)) return false;
  }
  return true;
}

std::vector<DeviceState::Point> DeviceState::AllQueuesLocked() const {
  std::vector<Point> points;
  for (const auto& [id, queue] : queues_) points.push_back(Point{id, queue->enqueued});
  return points;
}

std::vector<DeviceState::Point> DeviceState::StreamPointsLocked(uint64_t queue_id) const {
  const Queue& queue = *queues_.at(queue_id);
  if (!queue.legacy) return {Point{queue_id, queue.enqueued}};
  std::vector<Point> points;
  for (const auto& [id, other] : queues_) {
    if (!other->non_blocking) points.push_back(Point{id, other->enqueued});
  }
  return points;
}

absl::Status DeviceState::WaitLocked(absl::string_view call, const std::vector<Point>& points) {
  const auto done = [this, &points]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shutting_down_ || AllDoneLocked(points);
  };
  mu_.Await(absl::Condition(&done));
  return CheckAliveLocked(call);
}

void DeviceState::RunQueue(uint64_t id) {
  absl::MutexLock lock(&mu_);
  // Owned by queues_ until this thread has been joined.
  Queue* const queue = queues_.at(id).get();
  const auto runnable = [this, queue]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shutting_down_ || queue->pending.empty()) {
      return shutting_down_ || queue->closing;
    }
    return AllDoneLocked(queue->pending.front().after);
  };
  for (;;) {
    mu_.Await(absl::Condition(&runnable));
    if (shutting_down_ || queue->pending.empty()) return;
    Work work = std::move(queue->pending.front());
    queue->pending.pop_front();
    if (fault_.empty()) RunLocked(id, work);
    if (shutting_down_) return;
    queued_bytes_ -= work.bytes.size();
    queue->completed = work.seq;
  }
}

void DeviceState::RunLocked(uint64_t queue, Work& work) {
  switch (work.kind) {
    case WorkKind::kUpload: {
      uint8_t* const to = FindLocked(work.dst, work.size_bytes);
      if (to == nullptr) return PoisonLocked(kIllegalAddress, "a fake cuMemcpyHtoDAsync");
      std::memcpy(to, work.bytes.data(), work.size_bytes);
      return;
    }
    case WorkKind::kUploadFromHost: {
      uint8_t* const to = FindLocked(work.dst, work.size_bytes);
      if (to == nullptr) return PoisonLocked(kIllegalAddress, "a fake cuMemcpyHtoDAsync");
      std::memcpy(to, work.host, work.size_bytes);
      return;
    }
    case WorkKind::kDownload: {
      const uint8_t* const from = FindLocked(work.src, work.size_bytes);
      if (from == nullptr) return PoisonLocked(kIllegalAddress, "a fake cuMemcpyDtoHAsync");
      std::memcpy(work.host, from, work.size_bytes);
      return;
    }
    case WorkKind::kMemset:
      return MemsetLocked(work);
    case WorkKind::kCopy: {
      uint8_t* const to = FindLocked(work.dst, work.size_bytes);
      const uint8_t* const from = FindLocked(work.src, work.size_bytes);
      if (to == nullptr || from == nullptr) {
        return PoisonLocked(kIllegalAddress, "a fake cuMemcpyDtoDAsync");
      }
      // CUDA leaves overlapping copies undefined; memmove gives them the obvious meaning.
      std::memmove(to, from, work.size_bytes);
      return;
    }
    case WorkKind::kCopy3D: {
      // The ends were checked when it was enqueued; the check is repeated row by row in
      // case a free raced ahead (it cannot: Free waits for queued work).
      for (uint64_t z = 0; z < work.count; ++z) {
        for (uint64_t y = 0; y < work.rows; ++y) {
          uint8_t* const to =
              FindLocked(work.dst + z * work.dst_slice + y * work.dst_pitch, work.size_bytes);
          const uint8_t* const from =
              FindLocked(work.src + z * work.src_slice + y * work.src_pitch, work.size_bytes);
          if (to == nullptr || from == nullptr) {
            return PoisonLocked(kIllegalAddress, "a fake cuMemcpy3DAsync");
          }
          std::memmove(to, from, work.size_bytes);
        }
      }
      return;
    }
    case WorkKind::kKernel:
      if (work.kernel->kind == KernelKind::kSpinUs) {
        return SpinLocked(Arg<uint64_t>(*work.kernel, work.bytes, 0));
      }
      return RunKernelLocked(*work.kernel, work.count, work.bytes);
    case WorkKind::kRecord: {
      const auto it = events_.find(work.event);
      if (it == events_.end()) return;
      EventState& state = it->second;
      if (state.recorded && state.recorded->queue == queue && state.recorded->seq == work.seq) {
        state.completed_at = Clock::now();
      }
      return;
    }
    case WorkKind::kWait:
      return;
    case WorkKind::kGraph:
      for (const GraphOp& op : *work.graph) {
        if (!fault_.empty() || shutting_down_) return;
        Work step = Replay(op);
        RunLocked(queue, step);
      }
      return;
  }
}

bool DeviceState::Record(const Work& work, GraphOps* ops) {
  GraphOp op;
  switch (work.kind) {
    case WorkKind::kKernel:
      op.kind = GraphNodeKind::kKernel;
      op.kernel = work.kernel;
      op.count = work.count;
      op.args = work.bytes;
      break;
    case WorkKind::kMemset:
      op.kind = GraphNodeKind::kMemset;
      op.dst = work.dst;
      op.value = work.value;
      op.element_size_bytes = work.element_size_bytes;
      op.count = work.count;
      break;
    case WorkKind::kCopy:
      op.kind = GraphNodeKind::kCopy;
      op.dst = work.dst;
      op.src = work.src;
      op.size_bytes = work.size_bytes;
      break;
    default:
      return false;
  }
  ops->push_back(std::move(op));
  return true;
}

DeviceState::Work DeviceState::Replay(const GraphOp& op) {
  Work work;
  work.dst = op.dst;
  work.src = op.src;
  work.size_bytes = op.size_bytes;
  work.value = op.value;
  work.element_size_bytes = op.element_size_bytes;
  work.count = op.count;
  switch (op.kind) {
    case GraphNodeKind::kKernel:
      work.kind = WorkKind::kKernel;
      work.kernel = static_cast<const BuiltinKernel*>(op.kernel);
      work.bytes = op.args;
      break;
    case GraphNodeKind::kMemset:
      work.kind = WorkKind::kMemset;
      break;
    case GraphNodeKind::kCopy:
      work.kind = WorkKind::kCopy;
      break;
    case GraphNodeKind::kOther:
      work.kind = WorkKind::kWait;  // nothing to do
      break;
  }
  return work;
}

void DeviceState::MemsetLocked(const Work& work) {
  uint8_t* const to = FindLocked(work.dst, work.count * work.element_size_bytes);
  if (to == nullptr) return PoisonLocked(kIllegalAddress, "a fake cuMemsetAsync");
  switch (work.element_size_bytes) {
    case 1:
      std::memset(to, static_cast<uint8_t>(work.value), work.count);
      break;
    case 2:
      for (uint64_t i = 0; i < work.count; ++i) {
        StoreElement<uint16_t>(to, i, static_cast<uint16_t>(work.value));
      }
      break;
    default:
      for (uint64_t i = 0; i < work.count; ++i) StoreElement<uint32_t>(to, i, work.value);
  }
}

void DeviceState::SpinLocked(uint64_t microseconds) {
  const Clock::time_point deadline =
      Clock::now() +
      std::chrono::microseconds(static_cast<int64_t>(std::min(microseconds, kMaxSpinUs)));
  while (!shutting_down_) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return;
    mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), absl::FromChrono(deadline - now));
  }
}

bool DeviceState::ReleaseLocked(DevicePtr ptr) {
  const auto it = allocations_.find(ptr);
  if (it == allocations_.end()) return false;
  used_bytes_ -= it->second.size_bytes;
  allocations_.erase(it);
  return true;
}

uint8_t* DeviceState::FindLocked(DevicePtr ptr, uint64_t size_bytes) {
  auto it = allocations_.upper_bound(ptr);
  if (it == allocations_.begin()) return nullptr;
  --it;
  const uint64_t offset = ptr - it->first;
  const Allocation& allocation = it->second;
  if (offset >= allocation.size_bytes || size_bytes > allocation.size_bytes - offset) {
    return nullptr;
  }
  return allocation.host.get() + offset;
}

absl::StatusOr<uint8_t*> DeviceState::ResolveLocked(absl::string_view call, DevicePtr ptr,
                                                    uint64_t size_bytes) {
  uint8_t* const host = FindLocked(ptr, size_bytes);
  if (host == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": ", size_bytes,
                                                   " bytes at ", Hex(ptr),
                                                   " do not lie within one live fake allocation"));
  }
  return host;
}

uint8_t* DeviceState::KernelAccessLocked(const BuiltinKernel& kernel, DevicePtr ptr, uint64_t count,
                                         uint64_t element_size_bytes) {
  if (ptr % element_size_bytes != 0) {
    PoisonLocked(kMisalignedAddress, absl::StrCat("fake kernel '", kernel.name, "'"));
    return nullptr;
  }
  const std::optional<uint64_t> size_bytes = CheckedMul(count, element_size_bytes);
  uint8_t* const host = size_bytes ? FindLocked(ptr, *size_bytes) : nullptr;
  if (host == nullptr) {
    PoisonLocked(kIllegalAddress, absl::StrCat("fake kernel '", kernel.name, "'"));
  }
  return host;
}

void DeviceState::RunKernelLocked(const BuiltinKernel& k, uint64_t threads,
                                  absl::Span<const uint8_t> args) {
  const auto access = [&](DevicePtr ptr, uint64_t count, uint64_t element_size_bytes)
                          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                            return KernelAccessLocked(k, ptr, count, element_size_bytes);
                          };
  const auto fault = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    PoisonLocked(kIllegalAddress, absl::StrCat("fake kernel '", k.name, "'"));
  };
  RunBuiltinKernel(k, threads, args, access, fault);
}

}  // namespace gpurpc::backend::fake
