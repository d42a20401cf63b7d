// The CUDA device backend: backend.h on the CUDA driver API, loaded at run time
// (driver_api.h).
//
// Structure (one subject per file in this folder):
// - context_core.h: ContextCore, the retained primary context of one device. The Context and
//   every object it creates hold it through a shared_ptr, so the primary context is released
//   only after the last of them is gone. It makes the context current on the calling thread
//   before each driver call (gRPC calls arrive on a thread pool), turns CUresults into
//   statuses and remembers when a sticky fault has poisoned the context, after which
//   destructors skip their driver calls.
// - this file: CudaContext (memory, copies, launches, streams, events, configuration and
//   graph capture, on the pieces below) and CudaBackend (devices, contexts).
// - staging_ring.h: the pinned staging rings that Upload and Download copy through.
// - cuda_module.h / module_loader.h: modules and kernels (function lookup, parameter layout,
//   the launch parameters of a packed argument buffer) and loading and linking them.
// - cuda_handles.h: CudaStream, CudaEvent, CudaHostRegistration, move-free owners of one
//   driver object each; cuda_graph.h: CudaGraph and CudaGraphExec.
// - device_info.h: what a device reports (ListDevices, OpenContext).
//
// The launch path allocates nothing, logs nothing and builds no string unless it fails.

#include <cuda.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/context_core.h"
#include "server/worker/backend/cuda/cuda_graph.h"
#include "server/worker/backend/cuda/cuda_handles.h"
#include "server/worker/backend/cuda/cuda_module.h"
#include "server/worker/backend/cuda/cuda_status.h"
#include "server/worker/backend/cuda/device_info.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "server/worker/backend/cuda/module_loader.h"
#include "server/worker/backend/cuda/staging_ring.h"

namespace gpurpc::backend {
namespace cuda {
namespace {

static_assert(sizeof(CUdeviceptr) == sizeof(DevicePtr), "CUdeviceptr must be 64-bit");

// Transfers up to this size use the small-transfer paths (see Upload/Download).
constexpr uint64_t kSmallTransferBytes = 64 << 10;
// The staging ring for large transfers: double-buffered, so the memcpy of one chunk
// overlaps the DMA of the other.
constexpr size_t kStagingSlotBytes = 8 << 20;
constexpr int kStagingSlots = 2;
// Small uploads get their own ring of many small slots, so that a burst of them does not
// wait for the GPU after the second one.
constexpr size_t kSmallStagingSlotBytes = kSmallTransferBytes;
constexpr int kSmallStagingSlots = 16;

std::string HexAddress(uint64_t address) { return absl::StrCat("0x", absl::Hex(address)); }

// The driver's CUlimit for a backend limit (the same values; checked, because the caller's
// value came from a client).
absl::StatusOr<CUlimit> ToCuLimit(ContextLimit limit) {
  switch (limit) {
    case ContextLimit::kStackSize:
      return CU_LIMIT_STACK_SIZE;
    case ContextLimit::kPrintfFifoSize:
      return CU_LIMIT_PRINTF_FIFO_SIZE;
    case ContextLimit::kMallocHeapSize:
      return CU_LIMIT_MALLOC_HEAP_SIZE;
    case ContextLimit::kDevRuntimeSyncDepth:
      return CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH;
    case ContextLimit::kDevRuntimePendingLaunchCount:
      return CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT;
    case ContextLimit::kMaxL2FetchGranularity:
      return CU_LIMIT_MAX_L2_FETCH_GRANULARITY;
    case ContextLimit::kPersistingL2CacheSize:
      return CU_LIMIT_PERSISTING_L2_CACHE_SIZE;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no CUlimit ", static_cast<int>(limit), " can be used through gpurpc"));
}

const char* CuLimitName(ContextLimit limit) {
  switch (limit) {
    case ContextLimit::kStackSize:
      return "CU_LIMIT_STACK_SIZE";
    case ContextLimit::kPrintfFifoSize:
      return "CU_LIMIT_PRINTF_FIFO_SIZE";
    case ContextLimit::kMallocHeapSize:
      return "CU_LIMIT_MALLOC_HEAP_SIZE";
    case ContextLimit::kDevRuntimeSyncDepth:
      return "CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH";
    case ContextLimit::kDevRuntimePendingLaunchCount:
      return "CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT";
    case ContextLimit::kMaxL2FetchGranularity:
      return "CU_LIMIT_MAX_L2_FETCH_GRANULARITY";
    case ContextLimit::kPersistingL2CacheSize:
      return "CU_LIMIT_PERSISTING_L2_CACHE_SIZE";
  }
  return "CU_LIMIT_?";
}

// ---------------------------------------------------------------------------------------

// One side of a CUDA_MEMCPY3D from a Copy3DEnd (the session checked the ranges).
void SetCopyEnd(const Copy3DEnd& end, bool source, CUDA_MEMCPY3D* copy) {
  if (end.array != nullptr) {
    const CUarray array = static_cast<const CudaArray*>(end.array)->handle();
    if (source) {
      copy->srcMemoryType = CU_MEMORYTYPE_ARRAY;
      copy->srcArray = array;
      copy->srcXInBytes = end.x_bytes;
      copy->srcY = end.y;
      copy->srcZ = end.z;
    } else {
      copy->dstMemoryType = CU_MEMORYTYPE_ARRAY;
      copy->dstArray = array;
      copy->dstXInBytes = end.x_bytes;
      copy->dstY = end.y;
      copy->dstZ = end.z;
    }
    return;
  }
  if (source) {
    copy->srcMemoryType = CU_MEMORYTYPE_DEVICE;
    copy->srcDevice = static_cast<CUdeviceptr>(end.address);
    copy->srcPitch = end.pitch_bytes;
    copy->srcHeight = end.height;
  } else {
    copy->dstMemoryType = CU_MEMORYTYPE_DEVICE;
    copy->dstDevice = static_cast<CUdeviceptr>(end.address);
    copy->dstPitch = end.pitch_bytes;
    copy->dstHeight = end.height;
  }
}

class CudaContext final : public Context {
 public:
  CudaContext(std::shared_ptr<ContextCore> core, DeviceInfo device)
      : core_(std::move(core)),
        api_(core_->api()),
        device_(std::move(device)),
        staging_(kStagingSlotBytes, kStagingSlots),
        small_staging_(kSmallStagingSlotBytes, kSmallStagingSlots) {}

  ~CudaContext() override {
    {
      absl::MutexLock lock(&staging_.mutex());
      staging_.Destroy(*core_);
    }
    {
      absl::MutexLock lock(&small_staging_.mutex());
      small_staging_.Destroy(*core_);
    }
    // core_ goes last: the primary context is released once every object made in it
    // (which all hold core_) is gone.
  }

  const DeviceInfo& device() const override { return device_; }

  std::string CompileTarget() const override {
    return absl::StrCat("sm_", device_.compute_capability_major, device_.compute_capability_minor);
  }

  absl::StatusOr<DevicePtr> Alloc(uint64_t size_bytes) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUdeviceptr address = 0;
    const CUresult result = api_.cuMemAlloc(&address, size_bytes);
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemAlloc", absl::StrCat("size_bytes=", size_bytes));
    }
    return static_cast<DevicePtr>(address);
  }

  absl::Status Free(DevicePtr ptr) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuMemFree(static_cast<CUdeviceptr>(ptr));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemFree", absl::StrCat("ptr=", HexAddress(ptr)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<MemInfo> GetMemInfo() override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api_.cuMemGetInfo(&free_bytes, &total_bytes), "cuMemGetInfo"));
    return MemInfo{free_bytes, total_bytes};
  }

  // Always through pinned staging: `src` is copied before this returns, so the caller may
  // reuse it at once whatever memory it is (even pinned memory, with which a plain
  // cuMemcpyHtoDAsync would still be reading after the return).
  absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(staging_.mutex(), small_staging_.mutex()) override {
    const auto* bytes = static_cast<const uint8_t*>(src);
    return StagedUpload(dst, size_bytes, stream, [bytes](uint8_t* to, uint64_t offset, size_t n) {
      std::memcpy(to, bytes + offset, n);
    });
  }

  // Each piece is copied once, straight into the staging slots (no gathered copy first).
  absl::Status UploadPieces(DevicePtr dst, absl::Span<const absl::Span<const uint8_t>> pieces,
                            Stream* stream)
      ABSL_LOCKS_EXCLUDED(staging_.mutex(), small_staging_.mutex()) override {
    uint64_t size_bytes = 0;
    for (absl::Span<const uint8_t> piece : pieces) size_bytes += piece.size();
    // The slots are filled in order: a cursor walks the pieces once.
    size_t piece = 0;
    size_t within = 0;
    return StagedUpload(dst, size_bytes, stream, [&](uint8_t* to, uint64_t, size_t n) {
      while (n > 0) {
        const size_t take = std::min(n, pieces[piece].size() - within);
        std::memcpy(to, pieces[piece].data() + within, take);
        to += take;
        n -= take;
        within += take;
        if (within == pieces[piece].size()) {
          ++piece;
          within = 0;
        }
      }
    });
  }

  // Copies `size_bytes` into pinned staging slots (fill(to, offset, n) writes bytes
  // [offset, offset + n) of the source, called for increasing offsets) and queues each
  // slot's DMA on `stream`.
  template <typename Fill>
  absl::Status StagedUpload(DevicePtr dst, uint64_t size_bytes, Stream* stream, Fill fill)
      ABSL_LOCKS_EXCLUDED(staging_.mutex(), small_staging_.mutex()) {
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUstream cu_stream = ToCuStream(stream);
    GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(cu_stream, "cuMemcpyHtoDAsync"));
    StagingRing& ring = size_bytes <= kSmallTransferBytes ? small_staging_ : staging_;
    absl::MutexLock lock(&ring.mutex());
    GPURPC_RETURN_IF_ERROR(ring.EnsureAllocated(*core_));
    for (uint64_t offset = 0; offset < size_bytes;) {
      const size_t chunk =
          static_cast<size_t>(std::min<uint64_t>(ring.slot_bytes(), size_bytes - offset));
      StagingRing::Slot& slot = ring.NextSlot();
      GPURPC_RETURN_IF_ERROR(ring.WaitIdle(*core_, slot));
      fill(slot.host, offset, chunk);
      const CUresult result = api_.cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst + offset),
                                                     slot.host, chunk, cu_stream);
      if (result != CUDA_SUCCESS) {
        return core_->Error(result, "cuMemcpyHtoDAsync",
                            absl::StrCat("dst=", HexAddress(dst + offset), " size_bytes=", chunk));
      }
      GPURPC_RETURN_IF_ERROR(ring.MarkPending(*core_, slot, cu_stream));
      offset += chunk;
    }
    return absl::OkStatus();
  }

  absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(staging_.mutex()) override {
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUstream cu_stream = ToCuStream(stream);
    GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(cu_stream, "cuMemcpyDtoHAsync"));
    auto* bytes = static_cast<uint8_t*>(dst);

    if (size_bytes <= kSmallTransferBytes) {
      // Straight into `dst`. Into pageable memory this returns when the copy is done;
      // the stream sync covers a pinned `dst`.
      const CUresult result =
          api_.cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), size_bytes, cu_stream);
      if (result != CUDA_SUCCESS) {
        return core_->Error(result, "cuMemcpyDtoHAsync",
                            absl::StrCat("src=", HexAddress(src), " size_bytes=", size_bytes));
      }
      return core_->Check(api_.cuStreamSynchronize(cu_stream), "cuStreamSynchronize");
    }

    // Double-buffered: chunk k+1 is in flight while chunk k is copied out.
    absl::MutexLock lock(&staging_.mutex());
    GPURPC_RETURN_IF_ERROR(staging_.EnsureAllocated(*core_));
    const uint64_t chunk_bytes = staging_.slot_bytes();
    const uint64_t chunks = (size_bytes + chunk_bytes - 1) / chunk_bytes;
    auto chunk_size = [&](uint64_t k) {
      return static_cast<size_t>(std::min(chunk_bytes, size_bytes - k * chunk_bytes));
    };
    auto issue = [&](uint64_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(staging_.mutex()) -> absl::Status {
      StagingRing::Slot& slot = staging_.slot(k);
      // The slot may still feed an earlier upload, or hold chunk k - slot_count, which
      // was copied out before.
      GPURPC_RETURN_IF_ERROR(staging_.WaitIdle(*core_, slot));
      const DevicePtr from = src + k * chunk_bytes;
      const CUresult result = api_.cuMemcpyDtoHAsync(slot.host, static_cast<CUdeviceptr>(from),
                                                     chunk_size(k), cu_stream);
      if (result != CUDA_SUCCESS) {
        return core_->Error(result, "cuMemcpyDtoHAsync",
                            absl::StrCat("src=", HexAddress(from), " size_bytes=", chunk_size(k)));
      }
      return staging_.MarkPending(*core_, slot, cu_stream);
    };
    GPURPC_RETURN_IF_ERROR(issue(0));
    for (uint64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) GPURPC_RETURN_IF_ERROR(issue(k + 1));
      StagingRing::Slot& slot = staging_.slot(k);
      GPURPC_RETURN_IF_ERROR(staging_.WaitIdle(*core_, slot));
      std::memcpy(bytes + k * chunk_bytes, slot.host, chunk_size(k));
    }
    return absl::OkStatus();
  }

  absl::Status Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes, uint64_t count,
                      Stream* stream) override {
    if (element_size_bytes != 1 && element_size_bytes != 2 && element_size_bytes != 4) {
      // Worded as the fake words it: there is no driver call for this size to name.
      return absl::InvalidArgumentError(
          absl::StrCat("cuMemsetAsync: CUDA_ERROR_INVALID_VALUE (invalid argument) - element size ",
                       element_size_bytes, " bytes; it must be 1, 2 or 4"));
    }
    if (count == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUstream cu_stream = ToCuStream(stream);
    const auto address = static_cast<CUdeviceptr>(dst);
    CUresult result = CUDA_SUCCESS;
    const char* call = nullptr;
    switch (element_size_bytes) {
      case 1:
        call = "cuMemsetD8Async";
        result = api_.cuMemsetD8Async(address, static_cast<unsigned char>(value), count, cu_stream);
        break;
      case 2:
        call = "cuMemsetD16Async";
        result =
            api_.cuMemsetD16Async(address, static_cast<unsigned short>(value), count, cu_stream);
        break;
      default:
        call = "cuMemsetD32Async";
        result = api_.cuMemsetD32Async(address, value, count, cu_stream);
        break;
    }
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, call,
                          absl::StrCat("dst=", HexAddress(dst), " count=", count,
                                       " (the address must be aligned to the element size)"));
    }
    return absl::OkStatus();
  }

  absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes,
                                  Stream* stream) override {
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result =
        api_.cuMemcpyDtoDAsync(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src),
                               size_bytes, ToCuStream(stream));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemcpyDtoDAsync",
                          absl::StrCat("dst=", HexAddress(dst), " src=", HexAddress(src),
                                       " size_bytes=", size_bytes));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Array>> CreateArray(const ArrayShape& shape) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUDA_ARRAY3D_DESCRIPTOR descriptor{};
    descriptor.Width = shape.width;
    descriptor.Height = shape.height;
    descriptor.Depth = shape.depth;
    descriptor.Format = static_cast<CUarray_format>(shape.format);
    descriptor.NumChannels = shape.num_channels;
    descriptor.Flags = shape.flags;
    CUarray array = nullptr;
    const CUresult result = api_.cuArray3DCreate(&array, &descriptor);
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuArray3DCreate",
                          absl::StrCat("width=", shape.width, " height=", shape.height,
                                       " depth=", shape.depth, " format=", shape.format,
                                       " channels=", shape.num_channels, " flags=", shape.flags));
    }
    return std::make_unique<CudaArray>(core_, array);
  }

  absl::Status Copy3D(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                      uint64_t height, uint64_t depth, Stream* stream) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUDA_MEMCPY3D copy{};
    SetCopyEnd(src, /*source=*/true, &copy);
    SetCopyEnd(dst, /*source=*/false, &copy);
    copy.WidthInBytes = width_bytes;
    copy.Height = height;
    copy.Depth = depth;
    const CUresult result = api_.cuMemcpy3DAsync(&copy, ToCuStream(stream));
    if (result != CUDA_SUCCESS) {
      return core_->Error(
          result, "cuMemcpy3DAsync",
          absl::StrCat("width_bytes=", width_bytes, " height=", height, " depth=", depth));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ExportMemory(DevicePtr ptr) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUipcMemHandle handle{};
    const CUresult result = api_.cuIpcGetMemHandle(&handle, static_cast<CUdeviceptr>(ptr));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuIpcGetMemHandle", absl::StrCat("ptr=", HexAddress(ptr)));
    }
    return std::string(handle.reserved, sizeof(handle.reserved));
  }

  absl::StatusOr<DevicePtr> OpenExportedMemory(const std::string& bytes) override {
    CUipcMemHandle handle{};
    if (bytes.size() != sizeof(handle.reserved)) {
      return absl::InvalidArgumentError(absl::StrCat("cuIpcOpenMemHandle: a handle is ",
                                                     sizeof(handle.reserved), " bytes, got ",
                                                     bytes.size()));
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    std::memcpy(handle.reserved, bytes.data(), sizeof(handle.reserved));
    CUdeviceptr address = 0;
    const CUresult result =
        api_.cuIpcOpenMemHandle(&address, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (result != CUDA_SUCCESS) return core_->Error(result, "cuIpcOpenMemHandle");
    return static_cast<DevicePtr>(address);
  }

  absl::Status CloseExportedMemory(DevicePtr ptr) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuIpcCloseMemHandle(static_cast<CUdeviceptr>(ptr));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuIpcCloseMemHandle", absl::StrCat("ptr=", HexAddress(ptr)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateInterprocessEvent(bool blocking_sync) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    unsigned int flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
    if (blocking_sync) flags |= CU_EVENT_BLOCKING_SYNC;
    CUevent event = nullptr;
    GPURPC_RETURN_IF_ERROR(core_->Check(api_.cuEventCreate(&event, flags), "cuEventCreate"));
    return std::unique_ptr<Event>(
        std::make_unique<CudaEvent>(core_, event, /*timing_enabled=*/false));
  }

  absl::StatusOr<std::string> ExportEvent(Event* event) override {
    if (event == nullptr) return absl::InvalidArgumentError("ExportEvent: no event");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUipcEventHandle handle{};
    const CUresult result =
        api_.cuIpcGetEventHandle(&handle, static_cast<CudaEvent*>(event)->handle());
    if (result != CUDA_SUCCESS) return core_->Error(result, "cuIpcGetEventHandle");
    return std::string(handle.reserved, sizeof(handle.reserved));
  }

  absl::StatusOr<std::unique_ptr<Event>> OpenExportedEvent(const std::string& bytes) override {
    CUipcEventHandle handle{};
    if (bytes.size() != sizeof(handle.reserved)) {
      return absl::InvalidArgumentError(absl::StrCat("cuIpcOpenEventHandle: a handle is ",
                                                     sizeof(handle.reserved), " bytes, got ",
                                                     bytes.size()));
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    std::memcpy(handle.reserved, bytes.data(), sizeof(handle.reserved));
    CUevent event = nullptr;
    const CUresult result = api_.cuIpcOpenEventHandle(&event, handle);
    if (result != CUDA_SUCCESS) return core_->Error(result, "cuIpcOpenEventHandle");
    // Destroying it closes it (cuEventDestroy, as the driver documents).
    return std::unique_ptr<Event>(
        std::make_unique<CudaEvent>(core_, event, /*timing_enabled=*/false));
  }

  absl::Status SetProfiling(bool enabled) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return enabled ? core_->Check(api_.cuProfilerStart(), "cuProfilerStart")
                   : core_->Check(api_.cuProfilerStop(), "cuProfilerStop");
  }

  absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(
      void* host, uint64_t size_bytes) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuMemHostRegister(host, size_bytes, 0);
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemHostRegister", absl::StrCat("size_bytes=", size_bytes));
    }
    return std::make_unique<CudaHostRegistration>(core_, host);
  }

  absl::Status CopyHostToDeviceAsync(DevicePtr dst, const void* src, uint64_t size_bytes,
                                     Stream* stream) override {
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result =
        api_.cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, size_bytes, ToCuStream(stream));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemcpyHtoDAsync",
                          absl::StrCat("dst=", HexAddress(dst), " size_bytes=", size_bytes));
    }
    return absl::OkStatus();
  }

  absl::Status CopyDeviceToHostAsync(void* dst, DevicePtr src, uint64_t size_bytes,
                                     Stream* stream) override {
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result =
        api_.cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), size_bytes, ToCuStream(stream));
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuMemcpyDtoHAsync",
                          absl::StrCat("src=", HexAddress(src), " size_bytes=", size_bytes));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Module>> LoadModule(absl::Span<const uint8_t> image) override {
    return LoadCudaModule(core_, image);
  }

  absl::StatusOr<LinkedModule> LinkModule(absl::Span<const LinkInput> inputs,
                                          bool log_verbose) override {
    return LinkCudaModule(core_, inputs, log_verbose);
  }

  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream) override {
    if (ABSL_PREDICT_FALSE(function == nullptr)) {
      return absl::InvalidArgumentError("Launch: no function");
    }
    auto* cuda_function = static_cast<CudaFunction*>(function);
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    if (ABSL_PREDICT_FALSE(cuda_function->NeedsMoreDynamicShared(config.shared_memory_bytes))) {
      GPURPC_RETURN_IF_ERROR(cuda_function->RaiseDynamicShared(*core_, config.shared_memory_bytes));
    }
    PackedLaunchArgs args(packed_args);
    const CUresult result = api_.cuLaunchKernel(
        cuda_function->handle(), config.grid.x, config.grid.y, config.grid.z, config.block.x,
        config.block.y, config.block.z, config.shared_memory_bytes, ToCuStream(stream),
        /*kernelParams=*/nullptr, args.extra());
    if (ABSL_PREDICT_TRUE(result == CUDA_SUCCESS)) return absl::OkStatus();
    return LaunchError(result, *cuda_function, config, args.size_bytes());
  }

  absl::Status SetLimit(ContextLimit limit, uint64_t value) override {
    GPURPC_ASSIGN_OR_RETURN(const CUlimit cu_limit, ToCuLimit(limit));
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuCtxSetLimit(cu_limit, static_cast<size_t>(value));
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    return LimitError(result, "cuCtxSetLimit", limit, absl::StrCat(" = ", value));
  }

  absl::StatusOr<uint64_t> GetLimit(ContextLimit limit) override {
    GPURPC_ASSIGN_OR_RETURN(const CUlimit cu_limit, ToCuLimit(limit));
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    size_t value = 0;
    const CUresult result = api_.cuCtxGetLimit(&value, cu_limit);
    if (result == CUDA_SUCCESS) return static_cast<uint64_t>(value);
    return LimitError(result, "cuCtxGetLimit", limit, "");
  }

  absl::Status SetCacheConfig(CacheConfig config) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return core_->Check(api_.cuCtxSetCacheConfig(static_cast<CUfunc_cache>(config)),
                        "cuCtxSetCacheConfig");
  }

  absl::StatusOr<CacheConfig> GetCacheConfig() override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUfunc_cache config = CU_FUNC_CACHE_PREFER_NONE;
    GPURPC_RETURN_IF_ERROR(core_->Check(api_.cuCtxGetCacheConfig(&config), "cuCtxGetCacheConfig"));
    if (config < CU_FUNC_CACHE_PREFER_NONE || config > CU_FUNC_CACHE_PREFER_EQUAL) {
      return absl::InternalError(
          absl::StrCat("cuCtxGetCacheConfig: unknown CUfunc_cache ", static_cast<int>(config)));
    }
    return static_cast<CacheConfig>(config);
  }

  absl::Status SetFunctionAttribute(Function* function, FunctionAttribute attribute,
                                    int value) override {
    if (function == nullptr) return absl::InvalidArgumentError("cuFuncSetAttribute: no function");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    auto* cuda_function = static_cast<CudaFunction*>(function);
    switch (attribute) {
      case FunctionAttribute::kMaxDynamicSharedSizeBytes:
        return cuda_function->SetAttribute(*core_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
                                           value);
      case FunctionAttribute::kPreferredSharedMemoryCarveout:
        return cuda_function->SetAttribute(
            *core_, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", value);
    }
    return absl::InvalidArgumentError(absl::StrCat("cuFuncSetAttribute: attribute ",
                                                   static_cast<int>(attribute), " cannot be set"));
  }

  absl::Status SetFunctionCacheConfig(Function* function, CacheConfig config) override {
    if (function == nullptr) {
      return absl::InvalidArgumentError("cuFuncSetCacheConfig: no function");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    auto* cuda_function = static_cast<CudaFunction*>(function);
    const CUresult result =
        api_.cuFuncSetCacheConfig(cuda_function->handle(), static_cast<CUfunc_cache>(config));
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    return core_->Error(result, "cuFuncSetCacheConfig",
                        absl::StrCat("kernel ", cuda_function->name()));
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(bool non_blocking) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUstream stream = nullptr;
    GPURPC_RETURN_IF_ERROR(core_->Check(
        api_.cuStreamCreate(&stream, non_blocking ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT),
        "cuStreamCreate"));
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(core_, stream));
  }

  absl::Status SynchronizeStream(Stream* stream) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return core_->Check(api_.cuStreamSynchronize(ToCuStream(stream)), "cuStreamSynchronize");
  }

  absl::StatusOr<bool> QueryStream(Stream* stream) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuStreamQuery(ToCuStream(stream));
    if (result == CUDA_SUCCESS) return true;
    if (result == CUDA_ERROR_NOT_READY) return false;
    return core_->Error(result, "cuStreamQuery");
  }

  absl::Status StreamWaitEvent(Stream* stream, Event* event) override {
    if (event == nullptr) return absl::InvalidArgumentError("StreamWaitEvent: no event");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return core_->Check(
        api_.cuStreamWaitEvent(ToCuStream(stream), static_cast<CudaEvent*>(event)->handle(),
                               CU_EVENT_WAIT_DEFAULT),
        "cuStreamWaitEvent");
  }

  absl::Status Synchronize() override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    // The CUDA 13 variant names the context to synchronise.
    return core_->Check(api_.cuCtxSynchronize(core_->context()), "cuCtxSynchronize");
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent(bool disable_timing,
                                                     bool blocking_sync) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    unsigned int flags = CU_EVENT_DEFAULT;
    if (disable_timing) flags |= CU_EVENT_DISABLE_TIMING;
    if (blocking_sync) flags |= CU_EVENT_BLOCKING_SYNC;
    CUevent event = nullptr;
    GPURPC_RETURN_IF_ERROR(core_->Check(api_.cuEventCreate(&event, flags), "cuEventCreate"));
    return std::unique_ptr<Event>(
        std::make_unique<CudaEvent>(core_, event, /*timing_enabled=*/!disable_timing));
  }

  absl::Status RecordEvent(Event* event, Stream* stream) override {
    if (event == nullptr) return absl::InvalidArgumentError("RecordEvent: no event");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return core_->Check(
        api_.cuEventRecord(static_cast<CudaEvent*>(event)->handle(), ToCuStream(stream)),
        "cuEventRecord");
  }

  absl::StatusOr<bool> QueryEvent(Event* event) override {
    if (event == nullptr) return absl::InvalidArgumentError("QueryEvent: no event");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUresult result = api_.cuEventQuery(static_cast<CudaEvent*>(event)->handle());
    if (result == CUDA_SUCCESS) return true;
    if (result == CUDA_ERROR_NOT_READY) return false;
    return core_->Error(result, "cuEventQuery");
  }

  absl::Status SynchronizeEvent(Event* event) override {
    if (event == nullptr) return absl::InvalidArgumentError("SynchronizeEvent: no event");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    return core_->Check(api_.cuEventSynchronize(static_cast<CudaEvent*>(event)->handle()),
                        "cuEventSynchronize");
  }

  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) override {
    if (start == nullptr || end == nullptr) {
      return absl::InvalidArgumentError("ElapsedTime: no event");
    }
    auto* start_event = static_cast<CudaEvent*>(start);
    auto* end_event = static_cast<CudaEvent*>(end);
    if (!start_event->timing_enabled() || !end_event->timing_enabled()) {
      return absl::FailedPreconditionError(
          "cuEventElapsedTime: both events must be created with timing enabled "
          "(disable_timing = false)");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    float milliseconds = 0;
    const CUresult result =
        api_.cuEventElapsedTime(&milliseconds, start_event->handle(), end_event->handle());
    if (result == CUDA_SUCCESS) return milliseconds;
    if (result == CUDA_ERROR_NOT_READY) {
      return core_->Error(result, "cuEventElapsedTime", "event not completed yet");
    }
    if (result == CUDA_ERROR_INVALID_HANDLE) {
      return absl::FailedPreconditionError(
          core_
              ->Error(result, "cuEventElapsedTime",
                      "both events must have been recorded, and created with timing enabled")
              .message());
    }
    return core_->Error(result, "cuEventElapsedTime");
  }

  // ------------------------------------------------------------------------ CUDA graphs

  absl::Status BeginCapture(Stream* stream) override {
    if (stream == nullptr) {
      return absl::InvalidArgumentError(
          "cuStreamBeginCapture: the legacy default stream cannot be captured");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    // RELAXED: the session's other calls run on other threads meanwhile (backend.h).
    return core_->Check(
        api_.cuStreamBeginCapture(ToCuStream(stream), CU_STREAM_CAPTURE_MODE_RELAXED),
        "cuStreamBeginCapture");
  }

  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream* stream) override {
    if (stream == nullptr) {
      return absl::FailedPreconditionError("cuStreamEndCapture: the legacy stream never captures");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUgraph graph = nullptr;
    const CUresult result = api_.cuStreamEndCapture(ToCuStream(stream), &graph);
    if (result != CUDA_SUCCESS) {
      if (graph != nullptr) api_.cuGraphDestroy(graph);
      return core_->Error(result, "cuStreamEndCapture");
    }
    if (graph == nullptr) {
      return absl::FailedPreconditionError("cuStreamEndCapture: the capture produced no graph");
    }
    auto captured = std::make_unique<CudaGraph>(core_, graph);  // destroys it on failure
    GPURPC_RETURN_IF_ERROR(captured->ReadNodes());
    return std::unique_ptr<Graph>(std::move(captured));
  }

  absl::StatusOr<CaptureStatus> QueryCapture(Stream* stream) override {
    if (stream == nullptr) return CaptureStatus::kNone;
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api_.cuStreamIsCapturing(ToCuStream(stream), &status), "cuStreamIsCapturing"));
    switch (status) {
      case CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return CaptureStatus::kActive;
      case CU_STREAM_CAPTURE_STATUS_INVALIDATED:
        return CaptureStatus::kInvalidated;
      default:
        return CaptureStatus::kNone;
    }
  }

  absl::StatusOr<std::unique_ptr<GraphExec>> InstantiateGraph(
      std::shared_ptr<Graph> graph) override {
    auto cuda_graph = std::static_pointer_cast<CudaGraph>(std::move(graph));
    if (cuda_graph == nullptr) return absl::InvalidArgumentError("cuGraphInstantiate: no graph");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUgraphExec exec = nullptr;
    {
      absl::MutexLock lock(&cuda_graph->mutex());
      const CUresult result = api_.cuGraphInstantiateWithFlags(&exec, cuda_graph->handle(), 0);
      if (result != CUDA_SUCCESS) return core_->Error(result, "cuGraphInstantiateWithFlags");
    }
    return std::unique_ptr<GraphExec>(
        std::make_unique<CudaGraphExec>(core_, exec, std::move(cuda_graph)));
  }

  absl::Status LaunchGraph(GraphExec* exec, Stream* stream) override {
    auto* cuda_exec = static_cast<CudaGraphExec*>(exec);
    if (cuda_exec == nullptr) return absl::InvalidArgumentError("cuGraphLaunch: no graph exec");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    absl::MutexLock lock(&cuda_exec->mutex());
    return core_->Check(api_.cuGraphLaunch(cuda_exec->handle(), ToCuStream(stream)),
                        "cuGraphLaunch");
  }

  absl::Status UpdateGraphExec(GraphExec* exec, Graph* graph) override {
    auto* cuda_exec = static_cast<CudaGraphExec*>(exec);
    auto* cuda_graph = static_cast<CudaGraph*>(graph);
    if (cuda_exec == nullptr || cuda_graph == nullptr) {
      return absl::InvalidArgumentError("cuGraphExecUpdate: no graph exec or graph");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    absl::MutexLock exec_lock(&cuda_exec->mutex());
    absl::MutexLock graph_lock(&cuda_graph->mutex());
    CUgraphExecUpdateResultInfo info{};
    const CUresult result =
        api_.cuGraphExecUpdate(cuda_exec->handle(), cuda_graph->handle(), &info);
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    std::string detail = GraphExecUpdateResultName(info.result);
    const std::vector<CUgraphNode>& nodes = cuda_graph->node_handles();
    const auto at = std::find(nodes.begin(), nodes.end(), info.errorNode);
    if (info.errorNode != nullptr && at != nodes.end()) {
      absl::StrAppend(&detail, " at node ", at - nodes.begin(), " of the graph");
    }
    return core_->Error(result, "cuGraphExecUpdate", detail);
  }

  absl::Status SetGraphExecKernelNode(GraphExec* exec, size_t node_index, Function* function,
                                      const LaunchConfig& config,
                                      absl::Span<const uint8_t> packed_args) override {
    auto* cuda_exec = static_cast<CudaGraphExec*>(exec);
    auto* cuda_function = static_cast<CudaFunction*>(function);
    if (cuda_exec == nullptr || cuda_function == nullptr) {
      return absl::InvalidArgumentError(
          "cuGraphExecKernelNodeSetParams: no graph exec or function");
    }
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    if (cuda_function->NeedsMoreDynamicShared(config.shared_memory_bytes)) {
      GPURPC_RETURN_IF_ERROR(cuda_function->RaiseDynamicShared(*core_, config.shared_memory_bytes));
    }
    absl::MutexLock exec_lock(&cuda_exec->mutex());
    CudaGraph& source = cuda_exec->source();
    absl::MutexLock graph_lock(&source.mutex());
    if (node_index >= source.node_handles().size() ||
        source.nodes()[node_index] != GraphNodeKind::kKernel) {
      return absl::InvalidArgumentError(absl::StrCat("cuGraphExecKernelNodeSetParams: node ",
                                                     node_index, " is not a kernel node"));
    }
    PackedLaunchArgs args(packed_args);
    CUDA_KERNEL_NODE_PARAMS_v2 params{};
    params.func = cuda_function->handle();
    params.gridDimX = config.grid.x;
    params.gridDimY = config.grid.y;
    params.gridDimZ = config.grid.z;
    params.blockDimX = config.block.x;
    params.blockDimY = config.block.y;
    params.blockDimZ = config.block.z;
    params.sharedMemBytes = config.shared_memory_bytes;
    params.kernelParams = nullptr;
    params.extra = args.extra();  // copied by the driver
    const CUresult result = api_.cuGraphExecKernelNodeSetParams(
        cuda_exec->handle(), source.node_handles()[node_index], &params);
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    return core_->Error(result, "cuGraphExecKernelNodeSetParams",
                        absl::StrCat("node ", node_index, " kernel ", cuda_function->name()));
  }

 private:
  // Uploads and downloads go through pinned staging slots that an event guards: captured,
  // the copy would read the slot at every replay and the event would never complete. The
  // session refuses them on a capturing stream; this is the backend's own check.
  absl::Status RefuseWhileCapturing(CUstream stream, const char* call) {
    if (stream == nullptr) return absl::OkStatus();  // the driver checks the legacy stream
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api_.cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing"));
    if (status == CU_STREAM_CAPTURE_STATUS_NONE) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(call,
                     ": the stream is capturing a graph; copies from or to host memory "
                     "cannot be captured"));
  }

  ABSL_ATTRIBUTE_NOINLINE absl::Status LaunchError(CUresult result, const CudaFunction& function,
                                                   const LaunchConfig& config, size_t args_size) {
    return core_->Error(
        result, "cuLaunchKernel",
        absl::StrCat("kernel ", function.name(), " grid (", config.grid.x, ",", config.grid.y, ",",
                     config.grid.z, ") block (", config.block.x, ",", config.block.y, ",",
                     config.block.z, ") shared_memory_bytes=", config.shared_memory_bytes, " args ",
                     args_size, " bytes"));
  }

  // A failed cuCtxSetLimit / cuCtxGetLimit. CUDA_ERROR_UNSUPPORTED_LIMIT (a limit this
  // device does not have) is the client's argument, not an internal error.
  ABSL_ATTRIBUTE_NOINLINE absl::Status LimitError(CUresult result, const char* call,
                                                  ContextLimit limit, absl::string_view value) {
    absl::Status status = core_->Error(result, call, absl::StrCat(CuLimitName(limit), value));
    if (result == CUDA_ERROR_UNSUPPORTED_LIMIT) {
      return absl::InvalidArgumentError(
          absl::StrCat(status.message(), "; this device does not support that limit"));
    }
    return status;
  }

  const std::shared_ptr<ContextCore> core_;
  const DriverApi& api_;
  const DeviceInfo device_;
  StagingRing staging_;
  StagingRing small_staging_;
};

// ---------------------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const DriverApi& api) : api_(api) {}

  std::string name() const override { return "cuda"; }
  int driver_version() const override { return api_.driver_version; }

  absl::StatusOr<std::vector<DeviceInfo>> ListDevices() override {
    int count = 0;
    const CUresult result = api_.cuDeviceGetCount(&count);
    if (result != CUDA_SUCCESS) {
      return absl::UnavailableError(CuResultToStatus(&api_, result, "cuDeviceGetCount").message());
    }
    if (count <= 0) return NoDeviceError(api_);
    std::vector<DeviceInfo> devices;
    devices.reserve(static_cast<size_t>(count));
    for (int ordinal = 0; ordinal < count; ++ordinal) {
      GPURPC_ASSIGN_OR_RETURN(DeviceInfo info, QueryDeviceInfo(api_, ordinal));
      devices.push_back(std::move(info));
    }
    return devices;
  }

  absl::StatusOr<std::unique_ptr<Context>> OpenContext(int ordinal) override {
    GPURPC_ASSIGN_OR_RETURN(DeviceInfo info, QueryDeviceInfo(api_, ordinal));
    CUdevice device = 0;
    CUresult result = api_.cuDeviceGet(&device, ordinal);
    if (result != CUDA_SUCCESS) {
      return CuResultToStatus(&api_, result, "cuDeviceGet", absl::StrCat("ordinal ", ordinal));
    }
    CUcontext context = nullptr;
    result = api_.cuDevicePrimaryCtxRetain(&context, device);
    if (result != CUDA_SUCCESS) {
      return CuResultToStatus(&api_, result, "cuDevicePrimaryCtxRetain",
                              absl::StrCat("device ", ordinal));
    }
    // From here the core owns the reference and releases it on every path.
    auto core = std::make_shared<ContextCore>(api_, device, context, ordinal);
    GPURPC_RETURN_IF_ERROR(core->MakeCurrent());
    return std::unique_ptr<Context>(
        std::make_unique<CudaContext>(std::move(core), std::move(info)));
  }

 private:
  const DriverApi& api_;
};

}  // namespace
}  // namespace cuda

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend() {
  GPURPC_ASSIGN_OR_RETURN(const cuda::DriverApi* api, cuda::LoadDriverApi());
  int count = 0;
  const CUresult result = api->cuDeviceGetCount(&count);
  if (result != CUDA_SUCCESS) {
    return absl::UnavailableError(
        cuda::CuResultToStatus(api, result, "cuDeviceGetCount").message());
  }
  if (count <= 0) return cuda::NoDeviceError(*api);
  return std::unique_ptr<Backend>(std::make_unique<cuda::CudaBackend>(*api));
}

}  // namespace gpurpc::backend
