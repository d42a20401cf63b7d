// The fake device backend: a test double in host memory for the worker's session layer, the
// service tests and client development, behind the same interface as the CUDA backend. It
// runs no device code: Module::GetFunction hands out a fixed set of host-implemented
// "kernels" whatever the image holds, and the device says it is fake wherever it is
// described, so that it can never pass for a GPU.
//
// Every stream-ordered operation runs synchronously when it is enqueued, which keeps stream
// order trivially. What the fake does reproduce from CUDA is what the layers above must
// handle: bounds (every access lies in one live allocation), a gap after every allocation so
// that overruns fault, sticky faults that poison the context, and long-running kernels.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/backend/ptx_globals.h"

namespace gpurpc::backend {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kDeviceName[] = "gpurpc fake device (host memory, not a GPU)";
// A virtual architecture: NVRTC then emits PTX, the one image format the fake reads (for
// its globals).
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

constexpr char kIllegalAddress[] =
    "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)";
constexpr char kMisalignedAddress[] = "CUDA_ERROR_MISALIGNED_ADDRESS (misaligned address)";
constexpr char kInvalidValue[] = "CUDA_ERROR_INVALID_VALUE (invalid argument)";
constexpr char kInvalidHandle[] = "CUDA_ERROR_INVALID_HANDLE (invalid resource handle)";
constexpr char kInvalidImage[] = "CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)";
constexpr char kSymbolNotFound[] = "CUDA_ERROR_NOT_FOUND (named symbol not found)";

DeviceInfo MakeDeviceInfo(uint64_t total_memory_bytes) {
  DeviceInfo info;
  info.ordinal = 0;
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

// Element i of a host buffer, through memcpy because the bytes carry no C++ object.
template <typename T>
T LoadElement(const uint8_t* base, uint64_t i) {
  T value;
  std::memcpy(&value, base + i * sizeof(T), sizeof(T));
  return value;
}

template <typename T>
void StoreElement(uint8_t* base, uint64_t i, T value) {
  std::memcpy(base + i * sizeof(T), &value, sizeof(T));
}

enum class KernelKind {
  kMultiplyThem,
  kAxpyF32,
  kFillU32,
  kAddOneF32,
  kCopyBytes,
  kFaultIllegalAddress,
  kSpinUs,
};

struct BuiltinKernel {
  KernelKind kind;
  const char* name;
  // Laid out as the CUDA compiler lays out the C signature: each parameter at an offset
  // aligned to its size.
  std::vector<ParamInfo> params;
};

const std::vector<BuiltinKernel>& BuiltinKernels() {
  static const auto* const kKernels = new std::vector<BuiltinKernel>{
      // (float* dest, const float* a, const float* b): PyCUDA's canonical example.
      {KernelKind::kMultiplyThem, "multiply_them", {{0, 8}, {8, 8}, {16, 8}}},
      // (float a, const float* x, float* y, unsigned long long n)
      {KernelKind::kAxpyF32, "axpy_f32", {{0, 4}, {8, 8}, {16, 8}, {24, 8}}},
      // (unsigned* out, unsigned value, unsigned long long n)
      {KernelKind::kFillU32, "fill_u32", {{0, 8}, {8, 4}, {16, 8}}},
      // (float* data, unsigned long long n)
      {KernelKind::kAddOneF32, "add_one_f32", {{0, 8}, {8, 8}}},
      // (char* dst, const char* src, unsigned long long n)
      {KernelKind::kCopyBytes, "copy_bytes", {{0, 8}, {8, 8}, {16, 8}}},
      // ()
      {KernelKind::kFaultIllegalAddress, "fault_illegal_address", {}},
      // (unsigned long long microseconds)
      {KernelKind::kSpinUs, "spin_us", {{0, 8}}},
  };
  return *kKernels;
}

std::string BuiltinKernelNames() {
  return absl::StrJoin(BuiltinKernels(), ", ",
                       [](std::string* out, const BuiltinKernel& k) { out->append(k.name); });
}

class DeviceState;

// Handles carry the DeviceState that made them, only to recognise a handle from another
// context; it is never dereferenced through them.
class FakeStream final : public Stream {
 public:
  explicit FakeStream(const DeviceState* owner) : owner_(owner) {}
  const DeviceState* owner() const { return owner_; }

 private:
  const DeviceState* const owner_;
};

class FakeEvent final : public Event {
 public:
  FakeEvent(const DeviceState* owner, bool disable_timing)
      : owner_(owner), disable_timing_(disable_timing) {}
  const DeviceState* owner() const { return owner_; }
  bool disable_timing() const { return disable_timing_; }

  // Only under the owner's mutex (an annotation cannot name another object's member).
  const std::optional<Clock::time_point>& recorded_at() const { return recorded_at_; }
  void set_recorded_at(Clock::time_point time) { recorded_at_ = time; }

 private:
  const DeviceState* const owner_;
  const bool disable_timing_;
  std::optional<Clock::time_point> recorded_at_;
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
  KernelKind kind() const { return kernel_.kind; }
  absl::string_view name() const { return kernel_.name; }

  uint64_t packed_size_bytes() const {
    if (kernel_.params.empty()) return 0;
    return uint64_t{kernel_.params.back().offset_bytes} + kernel_.params.back().size_bytes;
  }

  // Parameter `index` from a packed argument buffer whose size has been checked.
  template <typename T>
  T Arg(absl::Span<const uint8_t> packed_args, size_t index) const {
    T value;
    std::memcpy(&value, packed_args.data() + kernel_.params[index].offset_bytes, sizeof(T));
    return value;
  }

 private:
  const DeviceState* const owner_;
  const BuiltinKernel& kernel_;
  FunctionAttributes attributes_;
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
  if (config.shared_memory_bytes > static_cast<uint32_t>(kSharedMemoryPerBlockBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuLaunchKernel: ", kInvalidValue, ": ", config.shared_memory_bytes,
                     " bytes of dynamic shared memory, more than the ", kSharedMemoryPerBlockBytes,
                     " a block may use"));
  }
  return absl::OkStatus();
}

absl::Status CheckStream(absl::string_view call, const DeviceState* owner, Stream* stream) {
  if (stream == nullptr) return absl::OkStatus();
  const auto* fake = dynamic_cast<const FakeStream*>(stream);
  if (fake == nullptr || fake->owner() != owner) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": ", kInvalidHandle, ": the stream was not created by this fake context"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FakeEvent*> CheckEvent(absl::string_view call, const DeviceState* owner,
                                      Event* event) {
  auto* fake = dynamic_cast<FakeEvent*>(event);
  if (fake == nullptr || fake->owner() != owner) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": ", kInvalidHandle, ": the event was not created by this fake context"));
  }
  return fake;
}

// Everything a fake context owns, behind one mutex. Separate from the Context object
// because the modules it loads share it: they free their globals through it.
class DeviceState {
 public:
  explicit DeviceState(uint64_t total_memory_bytes) : total_memory_bytes_(total_memory_bytes) {}
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // OK, or ABORTED naming `call` once a fake kernel has faulted, like CUDA's sticky errors.
  absl::Status CheckHealthy(absl::string_view call) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return StickyErrorLocked(call);
  }

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

  absl::Status Free(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked("cuMemFree"));
    if (!ReleaseLocked(ptr)) {
      return absl::NotFoundError(
          absl::StrCat("cuMemFree: no live fake allocation starts at ", Hex(ptr)));
    }
    return absl::OkStatus();
  }

  // For teardown (a module's globals): ignores a fault, and an address that ReleaseAll
  // already took.
  void Release(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ReleaseLocked(ptr);
  }

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

  absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuMemcpyHtoDAsync";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    // Like CUDA, an empty copy succeeds whatever the address.
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_ASSIGN_OR_RETURN(uint8_t* const host, ResolveLocked(kCall, dst, size_bytes));
    std::memcpy(host, src, size_bytes);
    return absl::OkStatus();
  }

  absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuMemcpyDtoHAsync";
    absl::MutexLock lock(&mu_);
    WaitForRunningKernelsLocked();
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_ASSIGN_OR_RETURN(const uint8_t* const host, ResolveLocked(kCall, src, size_bytes));
    std::memcpy(dst, host, size_bytes);
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
    GPURPC_RETURN_IF_ERROR(CheckStream(call, this, stream));
    if (element_size_bytes != 1 && element_size_bytes != 2 && element_size_bytes != 4) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": element size ",
                                                     element_size_bytes,
                                                     " bytes; it must be 1, 2 or 4"));
    }
    // cuMemsetD16/D32 require an address aligned to the element.
    if (dst % element_size_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": address ",
                                                     Hex(dst), " is not aligned to ",
                                                     element_size_bytes, " bytes"));
    }
    const std::optional<uint64_t> size_bytes = CheckedMul(count, element_size_bytes);
    if (!size_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": ", kInvalidValue, ": ", count,
                                                     " elements overflow the address space"));
    }
    if (*size_bytes == 0) return absl::OkStatus();
    GPURPC_ASSIGN_OR_RETURN(uint8_t* const host, ResolveLocked(call, dst, *size_bytes));
    switch (element_size_bytes) {
      case 1:
        std::memset(host, static_cast<uint8_t>(value), count);
        break;
      case 2:
        for (uint64_t i = 0; i < count; ++i) {
          StoreElement<uint16_t>(host, i, static_cast<uint16_t>(value));
        }
        break;
      default:
        for (uint64_t i = 0; i < count; ++i) StoreElement<uint32_t>(host, i, value);
    }
    return absl::OkStatus();
  }

  absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuMemcpyDtoDAsync";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_ASSIGN_OR_RETURN(uint8_t* const to, ResolveLocked(kCall, dst, size_bytes));
    GPURPC_ASSIGN_OR_RETURN(const uint8_t* const from, ResolveLocked(kCall, src, size_bytes));
    // CUDA leaves overlapping copies undefined; memmove gives them the obvious meaning.
    std::memmove(to, from, size_bytes);
    return absl::OkStatus();
  }

  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuLaunchKernel";
    uint64_t spin_us = 0;
    {
      absl::MutexLock lock(&mu_);
      GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
      GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
      const auto* fake = dynamic_cast<const FakeFunction*>(function);
      if (fake == nullptr || fake->owner() != this) {
        return absl::InvalidArgumentError(absl::StrCat(
            kCall, ": ", kInvalidHandle, ": the function was not loaded by this fake context"));
      }
      GPURPC_RETURN_IF_ERROR(CheckLaunchConfig(*fake, config));
      if (packed_args.size() != fake->packed_size_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            kCall, ": ", kInvalidValue, ": kernel '", fake->name(), "' takes ",
            fake->packed_size_bytes(), " bytes of packed arguments, got ", packed_args.size()));
      }
      if (fake->kind() != KernelKind::kSpinUs) {
        const uint64_t threads =
            SaturatingMul(SaturatingMul(uint64_t{config.grid.x} * config.grid.y, config.grid.z),
                          uint64_t{config.block.x} * config.block.y * config.block.z);
        RunKernelLocked(*fake, threads, packed_args);
        // A fault surfaces at a later call, as it does asynchronously on a GPU.
        return absl::OkStatus();
      }
      spin_us = fake->Arg<uint64_t>(packed_args, 0);
      ++running_kernels_;
    }
    // Sleeps unlocked, so that other threads' calls proceed while the kernel "runs", as they
    // would beside a GPU; the synchronising ones wait for it (WaitForRunningKernelsLocked).
    std::this_thread::sleep_for(std::chrono::microseconds(
        static_cast<int64_t>(std::min<uint64_t>(spin_us, std::numeric_limits<int64_t>::max()))));
    absl::MutexLock lock(&mu_);
    --running_kernels_;
    return absl::OkStatus();
  }

  absl::Status SynchronizeStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamSynchronize";
    absl::MutexLock lock(&mu_);
    WaitForRunningKernelsLocked();
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    return CheckStream(kCall, this, stream);
  }

  absl::StatusOr<bool> QueryStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamQuery";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    return running_kernels_ == 0;
  }

  absl::Status StreamWaitEvent(Stream* stream, Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuStreamWaitEvent";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    // Everything recorded before has already run: nothing to wait for.
    return CheckEvent(kCall, this, event).status();
  }

  absl::Status Synchronize() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    WaitForRunningKernelsLocked();
    return StickyErrorLocked("cuCtxSynchronize");
  }

  absl::Status RecordEvent(Event* event, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventRecord";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckStream(kCall, this, stream));
    GPURPC_ASSIGN_OR_RETURN(FakeEvent* const fake, CheckEvent(kCall, this, event));
    fake->set_recorded_at(Clock::now());
    return absl::OkStatus();
  }

  absl::StatusOr<bool> QueryEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventQuery";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_RETURN_IF_ERROR(CheckEvent(kCall, this, event).status());
    return running_kernels_ == 0;
  }

  absl::Status SynchronizeEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventSynchronize";
    absl::MutexLock lock(&mu_);
    WaitForRunningKernelsLocked();
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    return CheckEvent(kCall, this, event).status();
  }

  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr absl::string_view kCall = "cuEventElapsedTime";
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(StickyErrorLocked(kCall));
    GPURPC_ASSIGN_OR_RETURN(const FakeEvent* const from, CheckEvent(kCall, this, start));
    GPURPC_ASSIGN_OR_RETURN(const FakeEvent* const to, CheckEvent(kCall, this, end));
    for (const FakeEvent* event : {from, to}) {
      if (event->disable_timing()) {
        return absl::FailedPreconditionError(
            absl::StrCat(kCall, ": the event was created with timing disabled"));
      }
      if (!event->recorded_at().has_value()) {
        return absl::FailedPreconditionError(absl::StrCat(kCall, ": event has not been recorded"));
      }
    }
    return std::chrono::duration<float, std::milli>(*to->recorded_at() - *from->recorded_at())
        .count();
  }

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using HostMemory = std::unique_ptr<uint8_t, FreeDeleter>;

  struct Allocation {
    uint64_t size_bytes = 0;
    HostMemory host;
  };

  absl::Status StickyErrorLocked(absl::string_view call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (fault_.empty()) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat(call, ": ", fault_));
  }

  // The first fault is the one every later call reports.
  void PoisonLocked(absl::string_view error, absl::string_view kernel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (fault_.empty()) fault_ = absl::StrCat(error, " in fake kernel '", kernel, "'");
  }

  bool NoKernelRunning() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_kernels_ == 0; }

  void WaitForRunningKernelsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    mu_.Await(absl::Condition(this, &DeviceState::NoKernelRunning));
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
  uint8_t* KernelAccessLocked(const FakeFunction& function, DevicePtr ptr, uint64_t count,
                              uint64_t element_size_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ptr % element_size_bytes != 0) {
      PoisonLocked(kMisalignedAddress, function.name());
      return nullptr;
    }
    const std::optional<uint64_t> size_bytes = CheckedMul(count, element_size_bytes);
    uint8_t* const host = size_bytes ? FindLocked(ptr, *size_bytes) : nullptr;
    if (host == nullptr) PoisonLocked(kIllegalAddress, function.name());
    return host;
  }

  // Element i is processed when i < threads (and i < n for kernels that take n). Every
  // pointer's whole range is resolved before anything is written, so a faulting kernel
  // writes nothing; the context is unusable afterwards anyway.
  void RunKernelLocked(const FakeFunction& f, uint64_t threads, absl::Span<const uint8_t> args)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto access = [&](size_t param, uint64_t count, uint64_t element_size_bytes) {
      return KernelAccessLocked(f, f.Arg<DevicePtr>(args, param), count, element_size_bytes);
    };
    switch (f.kind()) {
      case KernelKind::kMultiplyThem: {
        const uint64_t n = threads;
        uint8_t* const dest = access(0, n, sizeof(float));
        if (dest == nullptr) return;
        const uint8_t* const a = access(1, n, sizeof(float));
        if (a == nullptr) return;
        const uint8_t* const b = access(2, n, sizeof(float));
        if (b == nullptr) return;
        for (uint64_t i = 0; i < n; ++i) {
          StoreElement<float>(dest, i, LoadElement<float>(a, i) * LoadElement<float>(b, i));
        }
        return;
      }
      case KernelKind::kAxpyF32: {
        const float alpha = f.Arg<float>(args, 0);
        const uint64_t n = std::min(threads, f.Arg<uint64_t>(args, 3));
        if (n == 0) return;
        const uint8_t* const x = access(1, n, sizeof(float));
        if (x == nullptr) return;
        uint8_t* const y = access(2, n, sizeof(float));
        if (y == nullptr) return;
        for (uint64_t i = 0; i < n; ++i) {
          StoreElement<float>(y, i, alpha * LoadElement<float>(x, i) + LoadElement<float>(y, i));
        }
        return;
      }
      case KernelKind::kFillU32: {
        const uint32_t value = f.Arg<uint32_t>(args, 1);
        const uint64_t n = std::min(threads, f.Arg<uint64_t>(args, 2));
        if (n == 0) return;
        uint8_t* const out = access(0, n, sizeof(uint32_t));
        if (out == nullptr) return;
        for (uint64_t i = 0; i < n; ++i) StoreElement<uint32_t>(out, i, value);
        return;
      }
      case KernelKind::kAddOneF32: {
        const uint64_t n = std::min(threads, f.Arg<uint64_t>(args, 1));
        if (n == 0) return;
        uint8_t* const data = access(0, n, sizeof(float));
        if (data == nullptr) return;
        for (uint64_t i = 0; i < n; ++i) {
          StoreElement<float>(data, i, LoadElement<float>(data, i) + 1.0f);
        }
        return;
      }
      case KernelKind::kCopyBytes: {
        const uint64_t n = std::min(threads, f.Arg<uint64_t>(args, 2));
        if (n == 0) return;
        uint8_t* const dst = access(0, n, 1);
        if (dst == nullptr) return;
        const uint8_t* const src = access(1, n, 1);
        if (src == nullptr) return;
        std::memmove(dst, src, n);
        return;
      }
      case KernelKind::kFaultIllegalAddress:
        PoisonLocked(kIllegalAddress, f.name());
        return;
      case KernelKind::kSpinUs:
        return;  // Launch sleeps for it outside the lock.
    }
  }

  const uint64_t total_memory_bytes_;
  absl::Mutex mu_;
  std::map<DevicePtr, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  DevicePtr next_address_ ABSL_GUARDED_BY(mu_) = kFirstAddress;
  // Empty while healthy; otherwise the sticky fault, without the call name.
  std::string fault_ ABSL_GUARDED_BY(mu_);
  // spin_us kernels sleeping outside the lock.
  int running_kernels_ ABSL_GUARDED_BY(mu_) = 0;
};

class FakeModule final : public Module {
 public:
  FakeModule(std::shared_ptr<DeviceState> state, uint64_t device_memory_bytes)
      : state_(std::move(state)), device_memory_bytes_(device_memory_bytes) {
    for (const BuiltinKernel& kernel : BuiltinKernels()) {
      functions_.push_back(std::make_unique<FakeFunction>(state_.get(), kernel));
    }
  }

  ~FakeModule() override {
    for (const auto& [name, global] : globals_) state_->Release(global.address);
  }

  // Module loading only; the map is read-only once the module is handed out.
  absl::Status AddGlobal(const PtxGlobal& global) {
    // A zero-length global still needs an address of its own, and Alloc refuses 0 bytes.
    GPURPC_ASSIGN_OR_RETURN(
        const DevicePtr address,
        state_->Alloc("cuModuleLoadData", std::max<uint64_t>(global.size_bytes, 1)));
    globals_.emplace(global.name, Global{address, global.size_bytes});
    return absl::OkStatus();
  }

  absl::StatusOr<Function*> GetFunction(const std::string& name) override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuModuleGetFunction"));
    for (const std::unique_ptr<FakeFunction>& function : functions_) {
      if (function->name() == name) return function.get();
    }
    return absl::NotFoundError(
        absl::StrCat("the fake backend runs only its built-in host kernels (", BuiltinKernelNames(),
                     "); it has no kernel '", name, "'"));
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
  const std::shared_ptr<DeviceState> state_;
  const uint64_t device_memory_bytes_;
  std::vector<std::unique_ptr<FakeFunction>> functions_;
  std::map<std::string, Global> globals_;
};

class FakeContext final : public Context {
 public:
  explicit FakeContext(uint64_t total_memory_bytes)
      : info_(MakeDeviceInfo(total_memory_bytes)),
        state_(std::make_shared<DeviceState>(total_memory_bytes)) {}

  // Frees every allocation now, even one a straggling module still names: its later
  // release finds nothing and does nothing.
  ~FakeContext() override { state_->ReleaseAll(); }

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

  absl::StatusOr<std::unique_ptr<Module>> LoadModule(absl::Span<const uint8_t> image) override {
    constexpr absl::string_view kCall = "cuModuleLoadData";
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy(kCall));
    if (image.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ", kInvalidImage, ": the image is empty"));
    }
    // Reported as the CUDA backend would; an image the CUDA backend would refuse for its
    // footprint loads here anyway (the fake accepts any image) and counts as unbounded.
    const uint64_t device_memory_bytes =
        ModuleFootprintBytes(image).value_or(std::numeric_limits<uint64_t>::max());
    auto module = std::make_unique<FakeModule>(state_, device_memory_bytes);
    const absl::string_view text(reinterpret_cast<const char*>(image.data()), image.size());
    // Cubins and fatbins are accepted too, but only PTX text declares globals the fake can
    // read. On failure the module's destructor frees the globals allocated so far.
    if (LooksLikePtxText(text)) {
      for (const PtxGlobal& global : ParsePtxGlobals(text)) {
        GPURPC_RETURN_IF_ERROR(module->AddGlobal(global));
      }
    }
    return module;
  }

  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream) override {
    return state_->Launch(function, config, packed_args, stream);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(bool non_blocking) override {
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuStreamCreate"));
    return std::make_unique<FakeStream>(state_.get());
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
    GPURPC_RETURN_IF_ERROR(state_->CheckHealthy("cuEventCreate"));
    return std::make_unique<FakeEvent>(state_.get(), disable_timing);
  }
  absl::Status RecordEvent(Event* event, Stream* stream) override {
    return state_->RecordEvent(event, stream);
  }
  absl::StatusOr<bool> QueryEvent(Event* event) override { return state_->QueryEvent(event); }
  absl::Status SynchronizeEvent(Event* event) override { return state_->SynchronizeEvent(event); }
  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) override {
    return state_->ElapsedTime(start, end);
  }

 private:
  const DeviceInfo info_;
  const std::shared_ptr<DeviceState> state_;
};

class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(uint64_t total_memory_bytes) : total_memory_bytes_(total_memory_bytes) {}

  std::string name() const override { return "fake"; }
  int driver_version() const override { return 0; }

  absl::StatusOr<std::vector<DeviceInfo>> ListDevices() override {
    return std::vector<DeviceInfo>{MakeDeviceInfo(total_memory_bytes_)};
  }

  absl::StatusOr<std::unique_ptr<Context>> OpenContext(int ordinal) override {
    if (ordinal != 0) {
      return absl::NotFoundError(absl::StrCat("no fake device with ordinal ", ordinal,
                                              "; the fake backend has only device 0"));
    }
    return std::make_unique<FakeContext>(total_memory_bytes_);
  }

 private:
  const uint64_t total_memory_bytes_;
};

}  // namespace

std::unique_ptr<Backend> MakeFakeBackend(uint64_t total_memory_bytes) {
  return std::make_unique<FakeBackend>(total_memory_bytes);
}

}  // namespace gpurpc::backend
