// The fake device backend: a test double in host memory for the worker's session layer, the
// service tests and client development, behind the same interface as the CUDA backend. It
// runs no device code: a module's kernels are the host-implemented built-ins below, picked by
// name, and the device says it is fake wherever it is described, so that it can never pass
// for a GPU.
//
// What it does reproduce from CUDA is what the layers above must handle:
// - Module images: LoadModule refuses what the CUDA backend or its driver refuses
//   (fake_module_image.h): it accepts well-formed PTX (what NVRTC emits for compute_75, the
//   fake's CompileTarget), cubins and uncompressed fatbins. Module::GetFunction finds a kernel
//   only when the image defines it (a PTX `.entry`, a cubin function symbol) AND it is one of
//   the built-ins, declared in PTX with the built-in's parameter layout. Globals are read
//   from PTX only.
// - Linking (LinkModule): each input is checked as LoadModule checks an image of its type
//   (a library as an ar archive), a symbol defined twice or a PTX external function that no
//   input defines (unless a library is linked) fails the link as cuLinkComplete does, and the
//   module has the kernels and globals of every input.
// - Asynchronous streams: every stream, the legacy default stream included, has a thread that
//   runs its work in order. Upload, Memset, CopyDeviceToDevice, Launch, RecordEvent and
//   StreamWaitEvent check their arguments, enqueue and return; Download waits for the work
//   queued before it on its stream, then copies. The legacy stream (nullptr) synchronizes with
//   every blocking stream, both ways (so synchronizing or querying it covers their work);
//   non-blocking streams do not synchronize with it.
//   StreamWaitEvent orders later work after the event's recorded point; an event completes,
//   and is timed, when its record point runs.
// - Bounds: every access lies in one live allocation, with a gap after every allocation so
//   that overruns fault.
// - Sticky faults: a kernel that faults (fault_illegal_address, or an access outside a live
//   allocation) poisons the context when it runs on its stream's thread; from then on every
//   call returns ABORTED naming the fault, and queued work is skipped.
// - Implicit synchronization: Free, and destroying a module that has globals, wait for all
//   queued work (as cuMemFree does); destroying a stream waits for its queued work; destroying
//   the context stops every thread at once, interrupting spin_us kernels.
// - Registered host memory: RegisterHostMemory records the range (overlaps refused as
//   CUDA does); CopyHostToDeviceAsync / CopyDeviceToHostAsync enqueue like any copy and
//   touch the host bytes on the stream's thread, so a client that reads a region before
//   synchronising sees what CUDA would show it; unregistering waits for queued work.
// - CUDA graphs (fake_graph.h): a capturing stream records its kernels, memsets and
//   device-to-device copies instead of queueing them, and refuses other work
//   (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidating the capture) as does the legacy
//   stream while a blocking stream captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and
//   Synchronize; a graph launch is one piece of work that replays the operations in order.
// - Long-running kernels: spin_us sleeps on its stream's thread without holding the lock.
// - Bounded queues: at most 1024 pieces of work wait per stream and 64 MiB of upload and
//   argument bytes per context; a call beyond that waits for room, as cuLaunchKernel blocks
//   on a full queue, so a client cannot grow the worker's memory behind a long kernel.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/fake/fake_graph.h"
#include "server/worker/backend/fake/fake_kernels.h"
#include "server/worker/backend/fake/fake_module_image.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/backend/ptx_globals.h"

namespace gpurpc::backend {
namespace {

using fake::Arg;
using fake::BuiltinKernel;
using fake::BuiltinKernelNames;
using fake::FindBuiltinKernel;
using fake::KernelKind;
using fake::LoadElement;
using fake::PackedSizeBytes;
using fake::StoreElement;

using Clock = std::chrono::steady_clock;

constexpr char kDeviceName[] = "gpurpc fake device (host memory, not a GPU)";
// A virtual architecture: NVRTC then emits PTX, whose entries and globals the fake reads.
constexpr char kCompileTarget[] = "compute_75";

// Far from zero, so that a null or a small integer used as a pointer never resolves, and
// easy to recognise in logs.
constexpr DevicePtr kFirstAddress = 0x100000000000;
// cuMemAlloc's alignment guarantee.
constexpr uint64_t kAlignmentBytes = 256;
// Unmapped space after every allocation, so that running past the end of one buffer faults
// instead of landing silently in the next one.
constexpr uint64_t kGapBytes = uint64_t{1} << 20;

constexpr int kMultiprocessorCount = 4;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr std::array<int, 3> kMaxBlockDim = {1024, 1024, 64};
constexpr std::array<int, 3> kMaxGridDim = {2147483647, 65535, 65535};
constexpr int kSharedMemoryPerBlockBytes = 49152;
constexpr int kSharedMemoryPerBlockOptinBytes = 232448;
constexpr int kTotalConstantMemoryBytes = 65536;
constexpr int kWarpSize = 32;

// CUdevice_attribute values from cuda.h, spelled out because the fake builds without CUDA.
constexpr int kAttrMaxThreadsPerBlock = 1;
constexpr int kAttrMaxBlockDimX = 2;
constexpr int kAttrMaxBlockDimY = 3;
constexpr int kAttrMaxBlockDimZ = 4;
constexpr int kAttrMaxGridDimX = 5;
constexpr int kAttrMaxGridDimY = 6;
constexpr int kAttrMaxGridDimZ = 7;
constexpr int kAttrMaxSharedMemoryPerBlock = 8;
constexpr int kAttrTotalConstantMemory = 9;
constexpr int kAttrWarpSize = 10;
constexpr int kAttrMultiprocessorCount = 16;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
constexpr int kAttrMaxSharedMemoryPerBlockOptin = 97;

// Context limits as a fresh CUDA 13 context reports them (cuCtxGetLimit), and the
// threads the driver reserves a stack for (multiprocessors x 2048 resident threads, the
// value the front end assumes without CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR).
constexpr uint64_t kDefaultStackBytes = 1024;
constexpr uint64_t kDefaultPrintfFifoBytes = uint64_t{1} << 20;
constexpr uint64_t kDefaultMallocHeapBytes = uint64_t{8} << 20;
constexpr uint64_t kDefaultDevRuntimeSyncDepth = 2;
constexpr uint64_t kDefaultDevRuntimePendingLaunchCount = 2048;
constexpr uint64_t kDefaultMaxL2FetchGranularity = 32;
constexpr uint64_t kResidentThreads = uint64_t{kMultiprocessorCount} * 2048;
// The fake has no persisting L2 (CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 0).
constexpr uint64_t kMaxPersistingL2Bytes = 0;
constexpr char kUnsupportedLimit[] = "CUDA_ERROR_UNSUPPORTED_LIMIT (limit is not supported)";
constexpr char kOutOfMemory[] = "CUDA_ERROR_OUT_OF_MEMORY (out of memory)";

constexpr char kIllegalAddress[] =
    "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)";
constexpr char kMisalignedAddress[] = "CUDA_ERROR_MISALIGNED_ADDRESS (misaligned address)";
constexpr char kInvalidValue[] = "CUDA_ERROR_INVALID_VALUE (invalid argument)";
constexpr char kInvalidHandle[] = "CUDA_ERROR_INVALID_HANDLE (invalid resource handle)";
constexpr char kSymbolNotFound[] = "CUDA_ERROR_NOT_FOUND (named symbol not found)";
constexpr char kNotReady[] = "CUDA_ERROR_NOT_READY (device not ready)";
constexpr char kContextDestroyed[] = "CUDA_ERROR_CONTEXT_IS_DESTROYED (context is destroyed)";

constexpr absl::string_view kLoadCall = "cuModuleLoadDataEx";

// The longest spin_us honoured (about 35 years): beyond it a kernel spins until its context is
// destroyed.
constexpr uint64_t kMaxSpinUs = uint64_t{1} << 50;

// Bounds on what may wait in the queues (EnqueueLocked): pieces of work per stream, and
// upload and kernel-argument bytes per context.
constexpr size_t kMaxQueuedWork = 1024;
constexpr uint64_t kMaxQueuedBytes = uint64_t{64} << 20;

DeviceInfo MakeDeviceInfo(uint64_t total_memory_bytes, int ordinal = 0) {
  DeviceInfo info;
  info.ordinal = ordinal;
  info.name = kDeviceName;
  info.compute_capability_major = 0;
  info.compute_capability_minor = 0;
  info.total_memory_bytes = total_memory_bytes;
  info.multiprocessor_count = kMultiprocessorCount;
  info.max_threads_per_block = kMaxThreadsPerBlock;
  info.max_block_dim = kMaxBlockDim;
  info.max_grid_dim = kMaxGridDim;
  info.max_shared_memory_per_block_bytes = kSharedMemoryPerBlockBytes;
  info.max_shared_memory_per_block_optin_bytes = kSharedMemoryPerBlockOptinBytes;
  info.warp_size = kWarpSize;
  info.attributes = {
      {kAttrMaxThreadsPerBlock, kMaxThreadsPerBlock},
      {kAttrMaxBlockDimX, kMaxBlockDim[0]},
      {kAttrMaxBlockDimY, kMaxBlockDim[1]},
      {kAttrMaxBlockDimZ, kMaxBlockDim[2]},
      {kAttrMaxGridDimX, kMaxGridDim[0]},
      {kAttrMaxGridDimY, kMaxGridDim[1]},
      {kAttrMaxGridDimZ, kMaxGridDim[2]},
      {kAttrMaxSharedMemoryPerBlock, kSharedMemoryPerBlockBytes},
      {kAttrTotalConstantMemory, kTotalConstantMemoryBytes},
      {kAttrWarpSize, kWarpSize},
      {kAttrMultiprocessorCount, kMultiprocessorCount},
      {kAttrComputeCapabilityMajor, 0},
      {kAttrComputeCapabilityMinor, 0},
      {kAttrMaxSharedMemoryPerBlockOptin, kSharedMemoryPerBlockOptinBytes},
  };
  info.is_fake = true;
  return info;
}

std::string Hex(DevicePtr ptr) { return absl::StrFormat("0x%x", ptr); }

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return std::nullopt;
  return a * b;
}

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  return CheckedMul(a, b).value_or(std::numeric_limits<uint64_t>::max());
}

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

bool SameLayout(const std::vector<ParamInfo>& a, const std::vector<ParamInfo>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].offset_bytes != b[i].offset_bytes || a[i].size_bytes != b[i].size_bytes) return false;
  }
  return true;
}

// "[0:8, 8:4]": offset:size of each parameter, in bytes.
std::string DescribeLayout(const std::vector<ParamInfo>& params) {
  return absl::StrCat("[",
                      absl::StrJoin(params, ", ",
                                    [](std::string* out, const ParamInfo& p) {
                                      absl::StrAppend(out, p.offset_bytes, ":", p.size_bytes);
                                    }),
                      "]");
}

class DeviceState;

// Handles name their DeviceState's objects by id; the state (shared with the context and the
// modules) is kept alive by each, so that a straggling handle's destruction is harmless.
class FakeStream final : public Stream {
 public:
  FakeStream(std::shared_ptr<DeviceState> state, uint64_t queue)
      : state_(std::move(state)), queue_(queue) {}
  // Waits for the stream's queued work, then stops its thread.
  ~FakeStream() override;
  const DeviceState* owner() const { return state_.get(); }
  uint64_t queue() const { return queue_; }

 private:
  const std::shared_ptr<DeviceState> state_;
  const uint64_t queue_;
};

class FakeEvent final : public Event {
 public:
  FakeEvent(std::shared_ptr<DeviceState> state, uint64_t id) : state_(std::move(state)), id_(id) {}
  ~FakeEvent() override;
  const DeviceState* owner() const { return state_.get(); }
  uint64_t id() const { return id_; }

 private:
  const std::shared_ptr<DeviceState> state_;
  const uint64_t id_;
};

class FakeFunction final : public Function {
 public:
  FakeFunction(const DeviceState* owner, const BuiltinKernel& kernel)
      : owner_(owner), kernel_(kernel) {
    attributes_.max_threads_per_block = kMaxThreadsPerBlock;
  }

  const std::vector<ParamInfo>& params() const override { return kernel_.params; }
  const FunctionAttributes& attributes() const override { return attributes_; }

  const DeviceState* owner() const { return owner_; }
  // Static: queued work may name it after the module is gone.
  const BuiltinKernel& kernel() const { return kernel_; }
  absl::string_view name() const { return kernel_.name; }

  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as the driver keeps it: 48 KiB minus
  // the static shared memory (none) until set. attributes() keeps the loaded values.
  int max_dynamic_shared_bytes() const {
    return max_dynamic_shared_bytes_.load(std::memory_order_acquire);
  }
  void set_max_dynamic_shared_bytes(int bytes) {
    max_dynamic_shared_bytes_.store(bytes, std::memory_order_release);
  }
  void set_carveout(int percent) { carveout_.store(percent, std::memory_order_release); }
  void set_cache_config(CacheConfig config) {
    cache_config_.store(config, std::memory_order_release);
  }

 private:
  const DeviceState* const owner_;
  const BuiltinKernel& kernel_;
  FunctionAttributes attributes_;
  std::atomic<int> max_dynamic_shared_bytes_{kSharedMemoryPerBlockBytes};
  std::atomic<int> carveout_{-1};
  std::atomic<CacheConfig> cache_config_{CacheConfig::kPreferNone};
};

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

// Everything a fake context owns, behind one mutex: memory, streams (queues of work, each
// with its thread), events and the sticky fault. Separate from the Context object because
// the modules and handles it makes share it.
class DeviceState {
 public:
  explicit DeviceState(uint64_t total_memory_bytes) : total_memory_bytes_(total_memory_bytes) {
    absl::MutexLock lock(&mu_);
    auto legacy = std::make_unique<Queue>();
    legacy->legacy = true;
    Queue* const queue = legacy.get();
    queues_.emplace(kLegacyQueue, std::move(legacy));
    // If the host cannot start one thread, nothing else would work either.
    queue->thread = std::thread(&DeviceState::RunQueue, this, kLegacyQueue);
  }
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;
  ~DeviceState() { Shutdown(); }

  // Stops every stream thread now: queued work is dropped and running spin_us kernels are
  // interrupted. Later calls that would enqueue or wait fail. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_) {
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

  // OK, or ABORTED naming `call` once a fake kernel has faulted, like CUDA's sticky errors.
  absl::Status CheckHealthy(absl::string_view call) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return StickyErrorLocked(call);
  }

  // --- Memory -------------------------------------------------------------------------------

  absl::StatusOr<DevicePtr> Alloc(absl::string_view call, uint64_t size_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
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
      return absl::ResourceExhaustedError(absl::StrCat(call, ": the host cannot back ", size_bytes,
                                                       " bytes of fake device memory"));
    }
    // Addresses only grow, so a freed address never comes back: a stale pointer misses
    // instead of reaching a newer buffer.
    const DevicePtr ptr = next_address_;
    next_address_ = AlignUp(ptr + size_bytes + kGapBytes, kAlignmentBytes);
    allocations_.emplace(ptr, Allocation{size_bytes, HostMemory(static_cast<uint8_t*>(host))});
    used_bytes_ += size_bytes;
    return ptr;
  }

  // Like cuMemFree, waits for all queued work first, so that no stream thread touches freed
  // memory.
  absl::Status Free(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_) {
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

  // For teardown (a module's globals): waits for queued work like Free, but ignores a fault,
  // and an address that ReleaseAll already took.
  void Release(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    WaitLocked("cuModuleUnload", AllQueuesLocked()).IgnoreError();
    ReleaseLocked(ptr);
  }

  // After Shutdown: no thread is left to touch the memory.
  void ReleaseAll() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    allocations_.clear();
    used_bytes_ = 0;
  }

  absl::StatusOr<MemInfo> GetMemInfo() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked("cuMemGetInfo"));
    return MemInfo{total_memory_bytes_ - used_bytes_, total_memory_bytes_};
  }

  // --- Stream-ordered work --------------------------------------------------------------------

  absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
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

  // Waits for the work queued before it on `stream`; the copy itself runs on the stream's
  // thread, in order, into `dst`, which this call keeps alive by waiting.
  absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
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

  // --- Registered host memory (same-host regions) ---------------------------------------------

  absl::Status RegisterHost(const void* host, uint64_t size_bytes) ABSL_LOCKS_EXCLUDED(mu_) {
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

  // Waits for the queued work first, like Free: a copy may still use the range.
  void UnregisterHost(const void* host) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    WaitLocked("cuMemHostUnregister", AllQueuesLocked()).IgnoreError();
    registered_.erase(reinterpret_cast<uintptr_t>(host));
  }

  absl::Status CopyHostAsync(bool to_device, DevicePtr device, void* host, uint64_t size_bytes,
                             Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    const absl::string_view call = to_device ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
    GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(call, stream));
    if (size_bytes == 0) return absl::OkStatus();
    const auto start = reinterpret_cast<uintptr_t>(host);
    auto range = registered_.upper_bound(start);
    if (range == registered_.begin() || start + size_bytes < start ||
        std::prev(range)->first + std::prev(range)->second < start + size_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": ", kInvalidValue, ": the host range is not registered host memory"));
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

  absl::Status Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes, uint64_t count,
                      Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
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

  absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
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

  // A 3D copy between two linear layouts (an array is an allocation laid out densely): `depth`
  // slices of `height` rows of `width_bytes`, each end's rows `pitch` apart and slices `slice`
  // apart. Not capturable (the session refuses it on a capturing stream first).
  struct Layout {
    DevicePtr address = 0;
    uint64_t pitch = 0;
    uint64_t slice = 0;
  };
  absl::Status Copy3D(const Layout& dst, const Layout& src, uint64_t width_bytes, uint64_t height,
                      uint64_t depth, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
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

  // Checks the launch and enqueues it: the kernel runs, and may fault, on the stream's thread.
  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
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
          kCall, ": ", kInvalidValue, ": kernel '", kernel.name, "' takes ",
          PackedSizeBytes(kernel), " bytes of packed arguments, got ", packed_args.size()));
    }
    Work work;
    work.kind = WorkKind::kKernel;
    work.kernel = &kernel;
    work.count =
        SaturatingMul(SaturatingMul(uint64_t{config.grid.x} * config.grid.y, config.grid.z),
                      uint64_t{config.block.x} * config.block.y * config.block.z);
    work.bytes.assign(packed_args.begin(), packed_args.end());
    // A fault surfaces at a later call, as it does asynchronously on a GPU.
    EnqueueLocked(queue, std::move(work));
    return absl::OkStatus();
  }

  // --- Streams and events -------------------------------------------------------------------

  absl::StatusOr<uint64_t> CreateQueue(absl::string_view call, bool non_blocking)
      ABSL_LOCKS_EXCLUDED(mu_) {
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

  // Waits for the queue's work, then stops its thread (cuStreamDestroy releases a stream once
  // its work is done; the fake's caller waits for that).
  void DestroyQueue(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_) {
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

  absl::Status SynchronizeStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamSynchronize";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
    GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, StreamPointsLocked(queue)));
    return StickyErrorLocked(kCall);
  }

  absl::StatusOr<bool> QueryStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamQuery";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_ASSIGN_OR_RETURN(const uint64_t queue, QueueOfLocked(kCall, stream));
    return AllDoneLocked(StreamPointsLocked(queue));
  }

  // Later work on `stream` waits for the event's recorded point; a never-recorded event
  // orders nothing.
  absl::Status StreamWaitEvent(Stream* stream, Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
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

  absl::Status Synchronize() ABSL_LOCKS_EXCLUDED(mu_) {
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

  absl::StatusOr<uint64_t> CreateEvent(absl::string_view call, bool disable_timing)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(call));
    const uint64_t id = next_event_id_++;
    events_[id].disable_timing = disable_timing;
    return id;
  }

  // Queued work that records the event finds it gone and does nothing.
  void DestroyEvent(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    events_.erase(id);
  }

  absl::Status RecordEvent(Event* event, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
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

  absl::StatusOr<bool> QueryEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventQuery";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_ASSIGN_OR_RETURN(const EventState* const state, EventOfLocked(kCall, event));
    return !state->recorded || DoneLocked(*state->recorded);
  }

  absl::Status SynchronizeEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventSynchronize";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_ASSIGN_OR_RETURN(const EventState* const state, EventOfLocked(kCall, event));
    if (state->recorded) GPURPC_RETURN_IF_ERROR(WaitLocked(kCall, {*state->recorded}));
    return StickyErrorLocked(kCall);
  }

  // Between the times the two record points ran; UNAVAILABLE (CUDA_ERROR_NOT_READY, as the
  // CUDA backend maps it) until both have.
  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) ABSL_LOCKS_EXCLUDED(mu_) {
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
    return std::chrono::duration<float, std::milli>(*to->completed_at - *from->completed_at)
        .count();
  }

  // --- CUDA graphs (fake_graph.h) -------------------------------------------------------

  absl::Status BeginCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
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

  // The operations the capture recorded; the capture is over either way.
  absl::StatusOr<fake::GraphOps> EndCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamEndCapture";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    if (stream == nullptr) return CaptureError(kCall, kIllegalState, "the stream is not capturing");
    GPURPC_ASSIGN_OR_RETURN(const uint64_t id, QueueOfLocked(kCall, stream, kCapturable));
    Queue& queue = *queues_.at(id);
    if (!queue.capturing) return CaptureError(kCall, kIllegalState, "the stream is not capturing");
    queue.capturing = false;
    fake::GraphOps ops = std::move(queue.capture);
    queue.capture.clear();
    if (queue.capture_invalidated) {
      return CaptureError(kCall, kCaptureInvalidated,
                          "work the capture could not record was enqueued on a capturing stream");
    }
    return ops;
  }

  absl::StatusOr<CaptureStatus> QueryCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamIsCapturing";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    if (stream == nullptr) return CaptureStatus::kNone;
    GPURPC_ASSIGN_OR_RETURN(const uint64_t id, QueueOfLocked(kCall, stream, kCapturable));
    const Queue& queue = *queues_.at(id);
    if (!queue.capturing) return CaptureStatus::kNone;
    return queue.capture_invalidated ? CaptureStatus::kInvalidated : CaptureStatus::kActive;
  }

  // Enqueues one replay of `exec`'s current snapshot, after its previous launch.
  absl::Status LaunchGraph(fake::FakeGraphExec* exec, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuGraphLaunch";
    std::shared_ptr<const fake::GraphOps> ops = exec->snapshot();
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

 private:
  static constexpr uint64_t kLegacyQueue = 0;
  // QueueOfLocked: the call may be recorded by a capturing stream.
  static constexpr bool kCapturable = true;
  static constexpr char kCaptureUnsupported[] =
      "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (operation not permitted when stream is capturing)";
  static constexpr char kCaptureImplicit[] =
      "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (operation would make the legacy stream depend on a "
      "capturing blocking stream)";
  static constexpr char kCaptureInvalidated[] =
      "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (operation failed due to a previous error during "
      "capture)";
  static constexpr char kIllegalState[] =
      "CUDA_ERROR_ILLEGAL_STATE (the operation cannot be performed in the present state)";

  static absl::Status CaptureError(absl::string_view call, absl::string_view error,
                                   absl::string_view detail) {
    return absl::FailedPreconditionError(absl::StrCat(call, ": ", error, ": ", detail));
  }

  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using HostMemory = std::unique_ptr<uint8_t, FreeDeleter>;

  struct Allocation {
    uint64_t size_bytes = 0;
    HostMemory host;
  };

  // A point in a queue: done once the queue's work up to `seq` is (or the queue is gone,
  // which happens only after it drained).
  struct Point {
    uint64_t queue = 0;
    uint64_t seq = 0;
  };

  enum class WorkKind {
    kUpload,
    kUploadFromHost,
    kDownload,
    kMemset,
    kCopy,
    kCopy3D,
    kKernel,
    kRecord,
    kWait,
    kGraph
  };

  struct Work {
    WorkKind kind = WorkKind::kWait;
    // Its position in its queue, from 1.
    uint64_t seq = 0;
    // Points in other queues it waits for (the legacy stream's implicit synchronization,
    // StreamWaitEvent).
    std::vector<Point> after;
    DevicePtr dst = 0;
    DevicePtr src = 0;
    uint64_t size_bytes = 0;
    // Upload's bytes, Launch's packed arguments.
    std::vector<uint8_t> bytes;
    // Download's destination, kept alive by the waiting caller, or registered host memory
    // (CopyDeviceToHostAsync's destination, CopyHostToDeviceAsync's source) that the
    // caller keeps registered until the work has run.
    void* host = nullptr;
    uint32_t value = 0;
    uint32_t element_size_bytes = 0;
    // Memset's elements; a kernel's threads; a 3D copy's slices.
    uint64_t count = 0;
    // A 3D copy: rows per slice, and each end's row and slice pitch (size_bytes is a row).
    uint64_t rows = 0;
    uint64_t dst_pitch = 0;
    uint64_t dst_slice = 0;
    uint64_t src_pitch = 0;
    uint64_t src_slice = 0;
    const BuiltinKernel* kernel = nullptr;
    uint64_t event = 0;
    // A graph launch's operations, replayed in order.
    std::shared_ptr<const fake::GraphOps> graph;
  };

  // A stream. The fields are guarded by mu_ (the map that owns it is), except `thread`, which
  // only CreateQueue, DestroyQueue and Shutdown touch.
  struct Queue {
    bool legacy = false;
    bool non_blocking = false;
    // Being destroyed: the thread ends once the queue is empty.
    bool closing = false;
    std::deque<Work> pending;
    uint64_t enqueued = 0;
    uint64_t completed = 0;
    // A capture in progress: what it recorded, and whether work it could not record came.
    bool capturing = false;
    bool capture_invalidated = false;
    fake::GraphOps capture;
    std::thread thread;
  };

  struct EventState {
    bool disable_timing = false;
    // The latest record point; unset while never recorded.
    std::optional<Point> recorded;
    // When that point ran.
    std::optional<Clock::time_point> completed_at;
  };

  absl::Status StickyErrorLocked(absl::string_view call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (fault_.empty()) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat(call, ": ", fault_));
  }

  absl::Status CheckAliveLocked(absl::string_view call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!shutting_down_) return absl::OkStatus();
    return absl::AbortedError(
        absl::StrCat(call, ": ", kContextDestroyed, ": the fake context is being destroyed"));
  }

  // The first fault is the one every later call reports.
  void PoisonLocked(absl::string_view error, absl::string_view where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (fault_.empty()) fault_ = absl::StrCat(error, " in ", where);
  }

  // What cuMemFree answers for an address that no live allocation starts at (never
  // allocated, inside an allocation, or already freed): CUDA_ERROR_INVALID_VALUE, so
  // INVALID_ARGUMENT (backend.h: an address is an argument, NOT_FOUND is for names).
  static absl::Status NoAllocation(DevicePtr ptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuMemFree: ", kInvalidValue, ": no live fake allocation starts at ", Hex(ptr)));
  }

  // The queue of `stream` (nullptr: the legacy stream), if it belongs to this context and
  // may take the call: a capturing stream only takes `capturable` calls, and the legacy stream
  // none while a blocking stream captures (either refusal invalidates the captures).
  absl::StatusOr<uint64_t> QueueOfLocked(absl::string_view call, Stream* stream,
                                         bool capturable = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  absl::StatusOr<EventState*> EventOfLocked(absl::string_view call, Event* event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto* fake = dynamic_cast<const FakeEvent*>(event);
    const auto it =
        fake == nullptr || fake->owner() != this ? events_.end() : events_.find(fake->id());
    if (it == events_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": ", kInvalidHandle, ": the event was not created by this fake context"));
    }
    return &it->second;
  }

  // Queues are bounded, as a GPU's are (cuLaunchKernel blocks while its queue is full), so
  // that a client cannot grow the worker's memory without bound behind a long kernel: every
  // stream-ordered call first waits here, without the lock, for room in its queue and in the
  // context's queued bytes (one piece larger than that bound goes alone). Then it checks
  // its arguments and enqueues under one hold of the lock.
  absl::Status MakeRoomLocked(absl::string_view call, uint64_t queue_id, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Appends `work` to `queue` (which exists), with the legacy stream's implicit
  // synchronization: work on the legacy stream waits for all work queued so far on blocking
  // streams, and work on a blocking stream for all work queued so far on the legacy stream.
  // Returns its position. Every point it waits for was queued before it: no cycles.
  // On a capturing stream the work is recorded instead (returns 0); work the capture cannot
  // record (it came while its call waited for room) invalidates the capture and runs.
  uint64_t EnqueueLocked(uint64_t queue_id, Work work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  bool DoneLocked(const Point& point) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto it = queues_.find(point.queue);
    return it == queues_.end() || it->second->completed >= point.seq;
  }

  bool AllDoneLocked(const std::vector<Point>& points) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Point& point : points) {
      if (!DoneLocked(point)) return false;
    }
    return true;
  }

  // Everything queued so far, on every stream.
  std::vector<Point> AllQueuesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Point> points;
    for (const auto& [id, queue] : queues_) points.push_back(Point{id, queue->enqueued});
    return points;
  }

  // What synchronizing `queue` waits for: its work so far; for the legacy stream, also that
  // of every blocking stream, as work queued on it now would.
  std::vector<Point> StreamPointsLocked(uint64_t queue_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Queue& queue = *queues_.at(queue_id);
    if (!queue.legacy) return {Point{queue_id, queue.enqueued}};
    std::vector<Point> points;
    for (const auto& [id, other] : queues_) {
      if (!other->non_blocking) points.push_back(Point{id, other->enqueued});
    }
    return points;
  }

  // Blocks (without the lock) until every point is done, or the context is being destroyed.
  absl::Status WaitLocked(absl::string_view call, const std::vector<Point>& points)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto done = [this, &points]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutting_down_ || AllDoneLocked(points);
    };
    mu_.Await(absl::Condition(&done));
    return CheckAliveLocked(call);
  }

  // The body of a stream's thread: runs its queue's work in order, each piece once the
  // points it waits for are done. After a fault the work is skipped (but still counted
  // done, so that waiters wake and report the fault).
  void RunQueue(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_) {
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

  void RunLocked(uint64_t queue, Work& work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
        for (const fake::GraphOp& op : *work.graph) {
          if (!fault_.empty() || shutting_down_) return;
          Work step = Replay(op);
          RunLocked(queue, step);
        }
        return;
    }
  }

  // A capturable piece of work as a graph operation; false for other kinds.
  static bool Record(const Work& work, fake::GraphOps* ops) {
    fake::GraphOp op;
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

  // The work that replays `op`: run like the operation it recorded, with the same checks.
  static Work Replay(const fake::GraphOp& op) {
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

  void MemsetLocked(const Work& work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Sleeps on the stream's thread without the lock, so that other calls proceed while the
  // kernel "runs", as they would beside a GPU; Shutdown cuts it short.
  void SpinLocked(uint64_t microseconds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Clock::time_point deadline =
        Clock::now() +
        std::chrono::microseconds(static_cast<int64_t>(std::min(microseconds, kMaxSpinUs)));
    while (!shutting_down_) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline) return;
      mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), absl::FromChrono(deadline - now));
    }
  }

  bool ReleaseLocked(DevicePtr ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto it = allocations_.find(ptr);
    if (it == allocations_.end()) return false;
    used_bytes_ -= it->second.size_bytes;
    allocations_.erase(it);
    return true;
  }

  // The host bytes behind [ptr, ptr + size_bytes), or nullptr unless that range lies inside
  // one live allocation.
  uint8_t* FindLocked(DevicePtr ptr, uint64_t size_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // The session layer checks bounds before calling; this is the second line of defence.
  absl::StatusOr<uint8_t*> ResolveLocked(absl::string_view call, DevicePtr ptr, uint64_t size_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint8_t* const host = FindLocked(ptr, size_bytes);
    if (host == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": ", kInvalidValue, ": ", size_bytes, " bytes at ", Hex(ptr),
                       " do not lie within one live fake allocation"));
    }
    return host;
  }

  // Where a fake kernel's `count` (> 0) elements at `ptr` live, or nullptr after poisoning
  // the context the way that access would on a GPU.
  uint8_t* KernelAccessLocked(const BuiltinKernel& kernel, DevicePtr ptr, uint64_t count,
                              uint64_t element_size_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Runs a built-in kernel (fake_kernels.h) on this state's memory; an access outside a live
  // allocation (or a misaligned one) poisons the context the way it would on a GPU.
  void RunKernelLocked(const BuiltinKernel& k, uint64_t threads, absl::Span<const uint8_t> args)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto access = [&](DevicePtr ptr, uint64_t count, uint64_t element_size_bytes)
                            ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                              return KernelAccessLocked(k, ptr, count, element_size_bytes);
                            };
    const auto fault = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      PoisonLocked(kIllegalAddress, absl::StrCat("fake kernel '", k.name, "'"));
    };
    fake::RunBuiltinKernel(k, threads, args, access, fault);
  }

  const uint64_t total_memory_bytes_;
  absl::Mutex mu_;
  std::map<DevicePtr, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  // Registered host ranges: start -> size.
  std::map<uintptr_t, uint64_t> registered_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  DevicePtr next_address_ ABSL_GUARDED_BY(mu_) = kFirstAddress;
  // Empty while healthy; otherwise the sticky fault, without the call name.
  std::string fault_ ABSL_GUARDED_BY(mu_);
  // Set once by Shutdown: threads stop, waits end.
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // Every stream's queue, the legacy stream's (kLegacyQueue) included.
  std::map<uint64_t, std::unique_ptr<Queue>> queues_ ABSL_GUARDED_BY(mu_);
  uint64_t next_queue_id_ ABSL_GUARDED_BY(mu_) = kLegacyQueue + 1;
  std::map<uint64_t, EventState> events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_event_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Upload and argument bytes queued on every stream.
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

FakeStream::~FakeStream() { state_->DestroyQueue(queue_); }

FakeEvent::~FakeEvent() { state_->DestroyEvent(id_); }

class FakeModule final : public Module {
 public:
  FakeModule(std::shared_ptr<DeviceState> state, std::vector<fake::DeclaredKernel> kernels,
             uint64_t device_memory_bytes)
      : state_(std::move(state)), device_memory_bytes_(device_memory_bytes) {
    for (fake::DeclaredKernel& declared : kernels) {
      const BuiltinKernel* const builtin = FindBuiltinKernel(declared.name);
      if (builtin != nullptr &&
          (!declared.params || SameLayout(*declared.params, builtin->params))) {
        functions_.emplace(declared.name, std::make_unique<FakeFunction>(state_.get(), *builtin));
      }
      declared_.emplace(std::move(declared.name), std::move(declared.params));
    }
  }

  ~FakeModule() override {
    for (const auto& [name, global] : globals_) state_->Release(global.address);
  }

  // Module loading only; the map is read-only once the module is handed out.
  absl::Status AddGlobal(const PtxGlobal& global) {
    // A zero-length global still needs an address of its own, and Alloc refuses 0 bytes.
    GPURPC_ASSIGN_OR_RETURN(const DevicePtr address,
                            state_->Alloc(kLoadCall, std::max<uint64_t>(global.size_bytes, 1)));
    globals_.emplace(global.name, Global{address, global.size_bytes});
    return absl::OkStatus();
  }

  // Only a kernel that the image defines and that the fake implements on the host.
  absl::StatusOr<Function*> GetFunction(const std::string& name) override {
    constexpr absl::string_view kCall = "cuModuleGetFunction";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    if (const auto it = functions_.find(name); it != functions_.end()) return it->second.get();
    const auto declared = declared_.find(name);
    if (declared == declared_.end()) {
      return absl::NotFoundError(
          absl::StrCat(kCall, ": ", kSymbolNotFound, ": the module defines no kernel '", name, "'",
                       DescribeDeclared(), "; the fake backend runs its built-in host kernels (",
                       BuiltinKernelNames(), ") for modules that define them"));
    }
    const BuiltinKernel* const builtin = FindBuiltinKernel(name);
    if (builtin == nullptr) {
      return absl::NotFoundError(
          absl::StrCat(kCall, ": the module defines kernel '", name,
                       "', but the fake backend runs only its built-in host kernels (",
                       BuiltinKernelNames(), "); run this one on a GPU worker"));
    }
    return absl::NotFoundError(
        absl::StrCat(kCall, ": the module's kernel '", name, "' takes parameters laid out ",
                     DescribeLayout(*declared->second),
                     " (offset:size in bytes), but the fake backend's "
                     "built-in host kernel '",
                     name, "' is ", name, builtin->signature, ", laid out ",
                     DescribeLayout(builtin->params), "; declare it with that signature"));
  }

  absl::StatusOr<Global> GetGlobal(const std::string& name) override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuModuleGetGlobal"));
    const auto it = globals_.find(name);
    if (it == globals_.end()) {
      return absl::NotFoundError(absl::StrCat("cuModuleGetGlobal: ", kSymbolNotFound,
                                              ": the module declares no global '", name, "'"));
    }
    return it->second;
  }

  uint64_t device_memory_bytes() const override { return device_memory_bytes_; }

 private:
  // " (it defines a, b, c)", at most a few names.
  std::string DescribeDeclared() const {
    if (declared_.empty()) return " (it defines none)";
    constexpr size_t kShown = 8;
    std::vector<absl::string_view> names;
    for (const auto& [name, params] : declared_) {
      if (names.size() == kShown) break;
      names.push_back(name);
    }
    return absl::StrCat(" (it defines ", absl::StrJoin(names, ", "),
                        declared_.size() > kShown ? ", ..." : "", ")");
  }

  const std::shared_ptr<DeviceState> state_;
  const uint64_t device_memory_bytes_;
  // Every kernel the image defines, with its parameter layout when PTX declares one.
  std::map<std::string, std::optional<std::vector<ParamInfo>>> declared_;
  // Those the fake runs.
  std::map<std::string, std::unique_ptr<FakeFunction>> functions_;
  std::map<std::string, Global> globals_;
};

class FakeHostRegistration final : public HostRegistration {
 public:
  FakeHostRegistration(std::shared_ptr<DeviceState> state, void* host)
      : state_(std::move(state)), host_(host) {}
  ~FakeHostRegistration() override { state_->UnregisterHost(host_); }

 private:
  const std::shared_ptr<DeviceState> state_;
  void* const host_;
};

// An array is a fake allocation laid out densely: rows of row_bytes, slices of rows().
class FakeArray final : public Array {
 public:
  FakeArray(std::shared_ptr<DeviceState> state, const void* owner, DevicePtr base,
            const ArrayShape& shape)
      : state_(std::move(state)), owner_(owner), base_(base), shape_(shape) {}
  // Like cuArrayDestroy after the work that uses it.
  ~FakeArray() override { state_->Release(base_); }

  const void* owner() const { return owner_; }
  const ArrayShape& shape() const { return shape_; }
  DevicePtr base() const { return base_; }

 private:
  const std::shared_ptr<DeviceState> state_;
  const void* const owner_;
  const DevicePtr base_;
  const ArrayShape shape_;
};

class FakeContext final : public Context {
 public:
  explicit FakeContext(uint64_t total_memory_bytes, int ordinal = 0)
      : info_(MakeDeviceInfo(total_memory_bytes, ordinal)),
        state_(std::make_shared<DeviceState>(total_memory_bytes)) {}

  // Stops every stream thread (cutting spin_us kernels short), then frees every allocation,
  // even one a straggling module still names: its later release finds nothing and does
  // nothing.
  ~FakeContext() override {
    state_->Shutdown();
    state_->ReleaseAll();
  }

  const DeviceInfo& device() const override { return info_; }
  std::string CompileTarget() const override { return kCompileTarget; }

  absl::StatusOr<DevicePtr> Alloc(uint64_t size_bytes) override {
    return state_->Alloc("cuMemAlloc", size_bytes);
  }
  absl::Status Free(DevicePtr ptr) override { return state_->Free(ptr); }
  absl::StatusOr<MemInfo> GetMemInfo() override { return state_->GetMemInfo(); }

  absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes,
                      Stream* stream) override {
    return state_->Upload(dst, src, size_bytes, stream);
  }
  absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream) override {
    return state_->Download(dst, src, size_bytes, stream);
  }
  absl::Status Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes, uint64_t count,
                      Stream* stream) override {
    return state_->Memset(dst, value, element_size_bytes, count, stream);
  }
  absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes,
                                  Stream* stream) override {
    return state_->CopyDeviceToDevice(dst, src, size_bytes, stream);
  }

  // Nothing to collect: like the driver without a profiler attached, both succeed.
  absl::Status SetProfiling(bool enabled) override {
    return state_->CheckHealthy(enabled ? "cuProfilerStart" : "cuProfilerStop");
  }

  absl::StatusOr<std::unique_ptr<Array>> CreateArray(const ArrayShape& shape) override {
    constexpr absl::string_view kCall = "cuArray3DCreate";
    if (shape.element_bytes == 0 || shape.width == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kInvalidValue, ": an array needs a width and an element size"));
    }
    // The shape was checked (each extent <= 2^20, elements <= 16 bytes): no overflow.
    GPURPC_ASSIGN_OR_RETURN(
        const DevicePtr base,
        state_->Alloc(kCall, shape.row_bytes() * shape.rows() * shape.slices()));
    return std::make_unique<FakeArray>(state_, this, base, shape);
  }

  absl::Status Copy3D(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                      uint64_t height, uint64_t depth, Stream* stream) override {
    GPURPC_ASSIGN_OR_RETURN(const DeviceState::Layout to, LayoutOf(dst));
    GPURPC_ASSIGN_OR_RETURN(const DeviceState::Layout from, LayoutOf(src));
    return state_->Copy3D(to, from, width_bytes, height, depth, stream);
  }

  absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(
      void* host, uint64_t size_bytes) override {
    GPURPC_RETURN_IF_ERROR(state_->RegisterHost(host, size_bytes));
    return std::make_unique<FakeHostRegistration>(state_, host);
  }
  absl::Status CopyHostToDeviceAsync(DevicePtr dst, const void* src, uint64_t size_bytes,
                                     Stream* stream) override {
    // The host side is only read (kUploadFromHost).
    return state_->CopyHostAsync(true, dst, const_cast<void*>(src), size_bytes, stream);
  }
  absl::Status CopyDeviceToHostAsync(void* dst, DevicePtr src, uint64_t size_bytes,
                                     Stream* stream) override {
    return state_->CopyHostAsync(false, src, dst, size_bytes, stream);
  }

  absl::StatusOr<std::unique_ptr<Module>> LoadModule(absl::Span<const uint8_t> image) override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kLoadCall));
    GPURPC_ASSIGN_OR_RETURN(fake::FakeModuleImage read,
                            fake::ReadFakeModuleImage(image, kLoadCall));
    auto module =
        std::make_unique<FakeModule>(state_, std::move(read.kernels), read.device_memory_bytes);
    // On failure the module's destructor frees the globals allocated so far.
    for (const PtxGlobal& global : read.globals) {
      GPURPC_RETURN_IF_ERROR(module->AddGlobal(global));
    }
    return module;
  }

  // Links as backend.h describes: each input checked as its type says, then the union.
  absl::StatusOr<LinkedModule> LinkModule(absl::Span<const LinkInput> inputs,
                                          bool log_verbose) override {
    constexpr absl::string_view kAddCall = "cuLinkAddData";
    constexpr absl::string_view kCompleteCall = "cuLinkComplete";
    constexpr absl::string_view kInvalid =
        "CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kAddCall));
    if (inputs.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(kCompleteCall, ": nothing to link"));
    }
    std::vector<fake::DeclaredKernel> kernels;
    std::vector<PtxGlobal> globals;
    uint64_t footprint = 0;
    std::map<std::string, std::string> defined;                  // symbol -> the input defining it
    std::vector<std::pair<std::string, std::string>> externals;  // (symbol, input)
    bool has_library = false;
    std::string info_log;
    const auto link_failed = [&](absl::string_view error) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCompleteCall, ": ", kInvalid, ": link failed; linker error log: error   : ", error));
    };
    for (size_t i = 0; i < inputs.size(); ++i) {
      const LinkInput& input = inputs[i];
      const std::string name = absl::CHexEscape(input.name);
      const std::string what = absl::StrCat("input ", i, " '", name, "'");
      if (input.data.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(kAddCall, ": ", what, " is empty"));
      }
      if (input.type == LinkInputType::kLibrary) {
        if (absl::Status archive = fake::CheckArchive(input.data); !archive.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(kAddCall, ": ", kInvalid, ": ", what,
                                                         " (library): ", archive.message()));
        }
        has_library = true;
        if (log_verbose) absl::StrAppend(&info_log, "info    : library ", what, " added\n");
        continue;
      }
      ImageFormat expected = ImageFormat::kPtx;
      const char* type_name = "PTX";
      switch (input.type) {
        case LinkInputType::kPtx:
          break;
        case LinkInputType::kCubin:
          expected = ImageFormat::kCubin;
          type_name = "cubin";
          break;
        case LinkInputType::kObject:
          expected = ImageFormat::kCubin;
          type_name = "object";
          break;
        case LinkInputType::kFatbinary:
          expected = ImageFormat::kFatbin;
          type_name = "fatbin";
          break;
        default:
          return absl::InvalidArgumentError(
              absl::StrCat(kAddCall, ": CUDA_ERROR_INVALID_VALUE: ", what,
                           " has unknown input type ", static_cast<int>(input.type)));
      }
      const ImageFormat format = DetectImageFormat(input.data);
      if (format != expected) {
        return absl::InvalidArgumentError(absl::StrCat(kAddCall, ": ", kInvalid, ": ", what,
                                                       " is given as ", type_name, " but holds ",
                                                       ImageFormatName(format)));
      }
      absl::StatusOr<fake::FakeModuleImage> read = fake::ReadFakeModuleImage(input.data, kAddCall);
      if (!read.ok()) {
        return absl::Status(read.status().code(),
                            absl::StrCat(what, ": ", read.status().message()));
      }
      footprint = footprint > UINT64_MAX - read->device_memory_bytes
                      ? UINT64_MAX
                      : footprint + read->device_memory_bytes;
      std::vector<std::string> symbols = read->defined_functions;
      if (format != ImageFormat::kPtx) {
        for (const fake::DeclaredKernel& kernel : read->kernels) symbols.push_back(kernel.name);
      }
      for (const PtxGlobal& global : read->globals) symbols.push_back(global.name);
      for (const std::string& symbol : symbols) {
        auto [it, inserted] = defined.emplace(symbol, name);
        if (!inserted) {
          return link_failed(absl::StrCat("Multiple definition of '", symbol, "' in '", name,
                                          "', first defined in '", it->second, "'"));
        }
      }
      for (std::string& symbol : read->external_functions) {
        externals.emplace_back(std::move(symbol), name);
      }
      for (fake::DeclaredKernel& kernel : read->kernels) kernels.push_back(std::move(kernel));
      for (PtxGlobal& global : read->globals) globals.push_back(std::move(global));
      if (log_verbose) {
        absl::StrAppend(&info_log, "info    : ", type_name, " ", what, " added, ",
                        read->kernels.size(), " kernel(s)\n");
      }
    }
    // Library archives' device code is not readable here (libcudadevrt.a's is compressed):
    // any library input is taken to define what the other inputs lack.
    if (!has_library) {
      for (const auto& [symbol, input] : externals) {
        if (defined.count(symbol) == 0) {
          return link_failed(
              absl::StrCat("Undefined reference to '", symbol, "' in '", input, "'"));
        }
      }
    }
    auto module = std::make_unique<FakeModule>(state_, std::move(kernels), footprint);
    for (const PtxGlobal& global : globals) GPURPC_RETURN_IF_ERROR(module->AddGlobal(global));
    LinkedModule linked;
    linked.module = std::move(module);
    linked.info_log = std::move(info_log);
    return linked;
  }

  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream) override {
    return state_->Launch(function, config, packed_args, stream);
  }

  // Limits are kept as values; the stack, printf FIFO and malloc heap must fit the fake
  // device's free memory (the driver reserves them), as with the driver.
  absl::Status SetLimit(ContextLimit limit, uint64_t value) override {
    constexpr absl::string_view kCall = "cuCtxSetLimit";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    const int index = static_cast<int>(limit);
    if (index < 0 || index >= static_cast<int>(kLimitCount)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kUnsupportedLimit, ": CUlimit ", index));
    }
    if ((limit == ContextLimit::kMaxL2FetchGranularity && value > 128) ||
        (limit == ContextLimit::kPersistingL2CacheSize && value > kMaxPersistingL2Bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kInvalidValue, ": CUlimit ", index, " = ", value));
    }
    absl::MutexLock lock(&limits_mu_);
    std::array<uint64_t, kLimitCount> next = limits_;
    next[index] = value;
    const auto reserved = [](const std::array<uint64_t, kLimitCount>& l) {
      const uint64_t stack = l[static_cast<int>(ContextLimit::kStackSize)];
      const uint64_t stack_bytes =
          stack > UINT64_MAX / kResidentThreads ? UINT64_MAX : stack * kResidentThreads;
      const uint64_t rest = l[static_cast<int>(ContextLimit::kPrintfFifoSize)] +
                            l[static_cast<int>(ContextLimit::kMallocHeapSize)];
      return stack_bytes > UINT64_MAX - rest ? UINT64_MAX : stack_bytes + rest;
    };
    const uint64_t before = reserved(limits_);
    const uint64_t after = reserved(next);
    if (after > before) {
      GPURPC_ASSIGN_OR_RETURN(const MemInfo memory, state_->GetMemInfo());
      if (after - before > memory.free_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            kCall, ": ", kOutOfMemory, ": CUlimit ", index, " = ", value, " needs ", after - before,
            " more bytes of device memory, ", memory.free_bytes, " are free"));
      }
    }
    limits_ = next;
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> GetLimit(ContextLimit limit) override {
    constexpr absl::string_view kCall = "cuCtxGetLimit";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    const int index = static_cast<int>(limit);
    if (index < 0 || index >= static_cast<int>(kLimitCount)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kUnsupportedLimit, ": CUlimit ", index));
    }
    absl::MutexLock lock(&limits_mu_);
    return limits_[index];
  }
  absl::Status SetCacheConfig(CacheConfig config) override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuCtxSetCacheConfig"));
    GPURPC_RETURN_IF_ERROR(CheckCacheConfig("cuCtxSetCacheConfig", config));
    cache_config_.store(config, std::memory_order_release);
    return absl::OkStatus();
  }
  absl::StatusOr<CacheConfig> GetCacheConfig() override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuCtxGetCacheConfig"));
    return cache_config_.load(std::memory_order_acquire);
  }
  absl::Status SetFunctionAttribute(Function* function, FunctionAttribute attribute,
                                    int value) override {
    constexpr absl::string_view kCall = "cuFuncSetAttribute";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    GPURPC_ASSIGN_OR_RETURN(FakeFunction * fake, OwnFunction(kCall, function));
    switch (attribute) {
      case FunctionAttribute::kMaxDynamicSharedSizeBytes:
        if (value < 0 ||
            value > kSharedMemoryPerBlockOptinBytes - fake->attributes().shared_size_bytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              kCall, ": ", kInvalidValue, ": CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = ",
              value, " for kernel '", fake->name(), "' (at most ",
              kSharedMemoryPerBlockOptinBytes - fake->attributes().shared_size_bytes, ")"));
        }
        fake->set_max_dynamic_shared_bytes(value);
        return absl::OkStatus();
      case FunctionAttribute::kPreferredSharedMemoryCarveout:
        if (value < -1 || value > 100) {
          return absl::InvalidArgumentError(absl::StrCat(
              kCall, ": ", kInvalidValue, ": CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = ",
              value, " for kernel '", fake->name(), "' (-1 to 100)"));
        }
        fake->set_carveout(value);
        return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat(kCall, ": ", kInvalidValue, ": attribute ", static_cast<int>(attribute)));
  }
  absl::Status SetFunctionCacheConfig(Function* function, CacheConfig config) override {
    constexpr absl::string_view kCall = "cuFuncSetCacheConfig";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    GPURPC_ASSIGN_OR_RETURN(FakeFunction * fake, OwnFunction(kCall, function));
    GPURPC_RETURN_IF_ERROR(CheckCacheConfig(kCall, config));
    fake->set_cache_config(config);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(bool non_blocking) override {
    GPURPC_ASSIGN_OR_RETURN(const uint64_t queue,
                            state_->CreateQueue("cuStreamCreate", non_blocking));
    return std::make_unique<FakeStream>(state_, queue);
  }
  absl::Status SynchronizeStream(Stream* stream) override {
    return state_->SynchronizeStream(stream);
  }
  absl::StatusOr<bool> QueryStream(Stream* stream) override { return state_->QueryStream(stream); }
  absl::Status StreamWaitEvent(Stream* stream, Event* event) override {
    return state_->StreamWaitEvent(stream, event);
  }
  absl::Status Synchronize() override { return state_->Synchronize(); }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent(bool disable_timing,
                                                     bool blocking_sync) override {
    GPURPC_ASSIGN_OR_RETURN(const uint64_t id,
                            state_->CreateEvent("cuEventCreate", disable_timing));
    return std::make_unique<FakeEvent>(state_, id);
  }
  absl::Status RecordEvent(Event* event, Stream* stream) override {
    return state_->RecordEvent(event, stream);
  }
  absl::StatusOr<bool> QueryEvent(Event* event) override { return state_->QueryEvent(event); }
  absl::Status SynchronizeEvent(Event* event) override { return state_->SynchronizeEvent(event); }
  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) override {
    return state_->ElapsedTime(start, end);
  }

  absl::Status BeginCapture(Stream* stream) override { return state_->BeginCapture(stream); }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream* stream) override {
    GPURPC_ASSIGN_OR_RETURN(fake::GraphOps ops, state_->EndCapture(stream));
    return std::make_unique<fake::FakeGraph>(state_.get(), std::move(ops));
  }
  absl::StatusOr<CaptureStatus> QueryCapture(Stream* stream) override {
    return state_->QueryCapture(stream);
  }
  absl::StatusOr<std::unique_ptr<GraphExec>> InstantiateGraph(
      std::shared_ptr<Graph> graph) override {
    constexpr absl::string_view kCall = "cuGraphInstantiateWithFlags";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    const auto* fake = dynamic_cast<const fake::FakeGraph*>(graph.get());
    if (fake == nullptr || fake->owner() != state_.get()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCall, ": ", kInvalidHandle, ": the graph was not captured by this fake context"));
    }
    return std::make_unique<fake::FakeGraphExec>(state_.get(), fake->ops());
  }
  absl::Status LaunchGraph(GraphExec* exec, Stream* stream) override {
    GPURPC_ASSIGN_OR_RETURN(fake::FakeGraphExec * fake, OwnExec("cuGraphLaunch", exec));
    return state_->LaunchGraph(fake, stream);
  }
  absl::Status UpdateGraphExec(GraphExec* exec, Graph* graph) override {
    constexpr absl::string_view kCall = "cuGraphExecUpdate";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    GPURPC_ASSIGN_OR_RETURN(fake::FakeGraphExec * fake, OwnExec(kCall, exec));
    const auto* source = dynamic_cast<const fake::FakeGraph*>(graph);
    if (source == nullptr || source->owner() != state_.get()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCall, ": ", kInvalidHandle, ": the graph was not captured by this fake context"));
    }
    return fake->Update(*source);
  }
  absl::Status SetGraphExecKernelNode(GraphExec* exec, size_t node_index, Function* function,
                                      const LaunchConfig& config,
                                      absl::Span<const uint8_t> packed_args) override {
    constexpr absl::string_view kCall = "cuGraphExecKernelNodeSetParams";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    GPURPC_ASSIGN_OR_RETURN(fake::FakeGraphExec * fake, OwnExec(kCall, exec));
    const auto* kernel = dynamic_cast<const FakeFunction*>(function);
    if (kernel == nullptr || kernel->owner() != state_.get()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCall, ": ", kInvalidHandle, ": the function was not loaded by this fake context"));
    }
    GPURPC_RETURN_IF_ERROR(CheckLaunchConfig(*kernel, config));
    if (packed_args.size() != PackedSizeBytes(kernel->kernel())) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kInvalidValue, ": kernel '", kernel->name(), "' takes ",
                       PackedSizeBytes(kernel->kernel()), " bytes of packed arguments, got ",
                       packed_args.size()));
    }
    const uint64_t threads =
        SaturatingMul(SaturatingMul(uint64_t{config.grid.x} * config.grid.y, config.grid.z),
                      uint64_t{config.block.x} * config.block.y * config.block.z);
    return fake->SetKernelNode(node_index, &kernel->kernel(), threads, packed_args);
  }

 private:
  // Where an end's first byte is and how its rows and slices are spaced.
  absl::StatusOr<DeviceState::Layout> LayoutOf(const Copy3DEnd& end) const {
    if (end.array == nullptr) {
      return DeviceState::Layout{end.address, end.pitch_bytes, end.pitch_bytes * end.height};
    }
    const auto* array = dynamic_cast<const FakeArray*>(end.array);
    if (array == nullptr || array->owner() != this) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuMemcpy3DAsync: ", kInvalidHandle, ": the array was not created by this fake context"));
    }
    const ArrayShape& shape = array->shape();
    const uint64_t pitch = shape.row_bytes();
    const uint64_t slice = pitch * shape.rows();
    return DeviceState::Layout{array->base() + end.z * slice + end.y * pitch + end.x_bytes, pitch,
                               slice};
  }

  absl::StatusOr<fake::FakeGraphExec*> OwnExec(absl::string_view call, GraphExec* exec) const {
    auto* fake = dynamic_cast<fake::FakeGraphExec*>(exec);
    if (fake == nullptr || fake->owner() != state_.get()) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": ", kInvalidHandle, ": the graph exec was not made by this fake context"));
    }
    return fake;
  }
  absl::StatusOr<FakeFunction*> OwnFunction(absl::string_view call, Function* function) const {
    auto* fake = dynamic_cast<FakeFunction*>(function);
    if (fake == nullptr || fake->owner() != state_.get()) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": ", kInvalidHandle, ": the function was not loaded by this fake context"));
    }
    return fake;
  }
  static absl::Status CheckCacheConfig(absl::string_view call, CacheConfig config) {
    const int value = static_cast<int>(config);
    if (value < 0 || value > static_cast<int>(CacheConfig::kPreferEqual)) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": ", kInvalidValue, ": CUfunc_cache ", value));
    }
    return absl::OkStatus();
  }

  static constexpr size_t kLimitCount = 7;  // CU_LIMIT_STACK_SIZE .. PERSISTING_L2_CACHE_SIZE

  const DeviceInfo info_;
  const std::shared_ptr<DeviceState> state_;
  absl::Mutex limits_mu_;
  // By CUlimit value.
  std::array<uint64_t, kLimitCount> limits_ ABSL_GUARDED_BY(limits_mu_) = {
      kDefaultStackBytes,
      kDefaultPrintfFifoBytes,
      kDefaultMallocHeapBytes,
      kDefaultDevRuntimeSyncDepth,
      kDefaultDevRuntimePendingLaunchCount,
      kDefaultMaxL2FetchGranularity,
      0};
  std::atomic<CacheConfig> cache_config_{CacheConfig::kPreferNone};
};

class FakeBackend final : public Backend {
 public:
  FakeBackend(uint64_t total_memory_bytes, int device_count)
      : total_memory_bytes_(total_memory_bytes), device_count_(device_count) {}

  std::string name() const override { return "fake"; }
  int driver_version() const override { return 0; }

  absl::StatusOr<std::vector<DeviceInfo>> ListDevices() override {
    std::vector<DeviceInfo> devices;
    for (int ordinal = 0; ordinal < device_count_; ++ordinal) {
      devices.push_back(MakeDeviceInfo(total_memory_bytes_, ordinal));
    }
    return devices;
  }

  // Every device is its own memory: a context of device 1 never sees device 0's buffers.
  absl::StatusOr<std::unique_ptr<Context>> OpenContext(int ordinal) override {
    if (ordinal < 0 || ordinal >= device_count_) {
      return absl::NotFoundError(absl::StrCat("no fake device with ordinal ", ordinal,
                                              "; the fake backend has devices 0 to ",
                                              device_count_ - 1, " (--fake-devices)"));
    }
    return std::make_unique<FakeContext>(total_memory_bytes_, ordinal);
  }

 private:
  const uint64_t total_memory_bytes_;
  const int device_count_;
};

}  // namespace

std::unique_ptr<Backend> MakeFakeBackend(uint64_t total_memory_bytes, int device_count) {
  return std::make_unique<FakeBackend>(total_memory_bytes, std::max(device_count, 1));
}

}  // namespace gpurpc::backend
