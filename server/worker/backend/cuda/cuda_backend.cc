// The CUDA device backend: backend.h on the CUDA driver API, loaded at run time
// (driver_api.h).
//
// Structure:
// - ContextCore: the retained primary context of one device. The Context and every object
//   it creates hold it through a shared_ptr, so the primary context is released only after
//   the last of them is gone. It makes the context current on the calling thread before
//   each driver call (gRPC calls arrive on a thread pool), turns CUresults into statuses
//   and remembers when a sticky fault has poisoned the context, after which destructors
//   skip their driver calls.
// - CudaContext: memory, copies through a pinned staging ring, modules, launches, streams
//   and events.
// - CudaModule / CudaFunction / CudaStream / CudaEvent: move-free owners of one driver
//   object each.
//
// The launch path allocates nothing, logs nothing and builds no string unless it fails.

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/cuda_status.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "server/worker/backend/cuda/module_image.h"
#include "server/worker/backend/module_footprint.h"
#include "spdlog/spdlog.h"

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
// JIT log buffers for cuModuleLoadDataEx.
constexpr size_t kJitLogBytes = 16 << 10;
// More parameters than fit in the 32764-byte parameter space means the driver never said
// "no more".
constexpr size_t kMaxKernelParams = 32764;

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

class ContextCore {
 public:
  // Takes over one reference to the primary context of `device` (released by the
  // destructor).
  ContextCore(const DriverApi& api, CUdevice device, CUcontext context, int ordinal)
      : api_(api), device_(device), context_(context), ordinal_(ordinal) {}

  ContextCore(const ContextCore&) = delete;
  ContextCore& operator=(const ContextCore&) = delete;

  ~ContextCore() {
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
                                             absl::string_view detail = {}) {
    absl::Status status = CuResultToStatus(&api_, result, call, detail);
    if (IsStickyCuResult(result) && !poisoned_.exchange(true, std::memory_order_acq_rel)) {
      spdlog::error("the CUDA context on device {} is poisoned: {}", ordinal_, status.ToString());
    }
    return status;
  }

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

// ---------------------------------------------------------------------------------------

class CudaFunction final : public Function {
 public:
  CudaFunction(CUfunction handle, std::string name, std::vector<ParamInfo> params,
               const FunctionAttributes& attributes)
      : handle_(handle),
        name_(std::move(name)),
        params_(std::move(params)),
        attributes_(attributes),
        dynamic_shared_limit_(
            static_cast<uint32_t>(std::max(0, attributes.max_dynamic_shared_size_bytes))) {}

  const std::vector<ParamInfo>& params() const override { return params_; }
  const FunctionAttributes& attributes() const override { return attributes_; }

  CUfunction handle() const { return handle_; }
  const std::string& name() const { return name_; }

  bool NeedsMoreDynamicShared(uint32_t bytes) const {
    return bytes > dynamic_shared_limit_.load(std::memory_order_acquire);
  }

  // Raises CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to at least `bytes`. Only ever
  // raises it, so concurrent launches asking for different sizes all stay valid.
  ABSL_ATTRIBUTE_NOINLINE absl::Status RaiseDynamicShared(ContextCore& core, uint32_t bytes)
      ABSL_LOCKS_EXCLUDED(raise_mu_) {
    absl::MutexLock lock(&raise_mu_);
    if (bytes <= dynamic_shared_limit_.load(std::memory_order_acquire)) {
      return absl::OkStatus();
    }
    const CUresult result = core.api().cuFuncSetAttribute(
        handle_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(bytes));
    if (result != CUDA_SUCCESS) {
      return core.Error(result, "cuFuncSetAttribute",
                        absl::StrCat("kernel ", name_, ": cannot allow ", bytes,
                                     " bytes of dynamic shared memory (the kernel uses ",
                                     attributes_.shared_size_bytes,
                                     " bytes of static shared memory; see the device's "
                                     "max_shared_memory_per_block_optin_bytes)"));
    }
    dynamic_shared_limit_.store(bytes, std::memory_order_release);
    return absl::OkStatus();
  }

  // cuFuncSetAttribute. A new MAX_DYNAMIC_SHARED_SIZE_BYTES is also where RaiseDynamicShared
  // starts from (it may lower it: a later launch that asks for more raises it again).
  absl::Status SetAttribute(ContextCore& core, CUfunction_attribute attribute,
                            const char* attribute_name, int value) ABSL_LOCKS_EXCLUDED(raise_mu_) {
    absl::MutexLock lock(&raise_mu_);
    const CUresult result = core.api().cuFuncSetAttribute(handle_, attribute, value);
    if (result != CUDA_SUCCESS) {
      return core.Error(result, "cuFuncSetAttribute",
                        absl::StrCat(attribute_name, " = ", value, " for kernel ", name_));
    }
    if (attribute == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
      dynamic_shared_limit_.store(static_cast<uint32_t>(std::max(0, value)),
                                  std::memory_order_release);
    }
    return absl::OkStatus();
  }

 private:
  const CUfunction handle_;
  const std::string name_;
  const std::vector<ParamInfo> params_;
  const FunctionAttributes attributes_;
  // Stored only with raise_mu_ held, but loaded without it on the launch path (hence an
  // atomic, and no ABSL_GUARDED_BY).
  std::atomic<uint32_t> dynamic_shared_limit_;
  // Serialises the cuFuncSetAttribute calls on handle_ with the check-and-store of
  // dynamic_shared_limit_ that goes with them.
  absl::Mutex raise_mu_;
};

class CudaModule final : public Module {
 public:
  CudaModule(std::shared_ptr<ContextCore> core, CUmodule module, uint64_t device_memory_bytes)
      : core_(std::move(core)), module_(module), device_memory_bytes_(device_memory_bytes) {}

  ~CudaModule() override {
    functions_.clear();  // Handles only; the driver frees them with the module.
    const DriverApi& api = core_->api();
    core_->CleanUp("cuModuleUnload", [&] { return api.cuModuleUnload(module_); });
  }

  absl::StatusOr<Function*> GetFunction(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_) override {
    absl::MutexLock lock(&mu_);
    if (auto it = functions_.find(name); it != functions_.end()) return it->second.get();

    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const DriverApi& api = core_->api();
    CUfunction handle = nullptr;
    CUresult result = api.cuModuleGetFunction(&handle, module_, name.c_str());
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuModuleGetFunction",
                          result == CUDA_ERROR_NOT_FOUND
                              ? absl::StrCat("the module has no kernel named \"", name, "\"")
                              : absl::StrCat("kernel \"", name, "\""));
    }
    // Under lazy loading (the default since CUDA 12.2) some attributes need a fully
    // loaded function; load it now rather than on the first launch.
    result = api.cuFuncLoad(handle);
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuFuncLoad", absl::StrCat("kernel \"", name, "\""));
    }

    std::vector<ParamInfo> params;
    for (size_t i = 0;; ++i) {
      if (i > kMaxKernelParams) {
        return absl::InternalError(absl::StrCat("cuFuncGetParamInfo: kernel \"", name,
                                                "\" reports more than ", kMaxKernelParams,
                                                " parameters"));
      }
      size_t offset = 0;
      size_t size = 0;
      result = api.cuFuncGetParamInfo(handle, i, &offset, &size);
      if (result == CUDA_ERROR_INVALID_VALUE) break;  // Past the last parameter.
      if (result != CUDA_SUCCESS) {
        return core_->Error(result, "cuFuncGetParamInfo",
                            absl::StrCat("kernel \"", name, "\" parameter ", i));
      }
      params.push_back(ParamInfo{static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
    }

    FunctionAttributes attributes;
    const struct {
      CUfunction_attribute attribute;
      const char* attribute_name;
      int* value;
    } queries[] = {
        {CU_FUNC_ATTRIBUTE_NUM_REGS, "CU_FUNC_ATTRIBUTE_NUM_REGS", &attributes.num_regs},
        {CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES",
         &attributes.shared_size_bytes},
        {CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES",
         &attributes.const_size_bytes},
        {CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES",
         &attributes.local_size_bytes},
        {CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
         &attributes.max_threads_per_block},
        {CU_FUNC_ATTRIBUTE_PTX_VERSION, "CU_FUNC_ATTRIBUTE_PTX_VERSION", &attributes.ptx_version},
        {CU_FUNC_ATTRIBUTE_BINARY_VERSION, "CU_FUNC_ATTRIBUTE_BINARY_VERSION",
         &attributes.binary_version},
        {CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
         "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
         &attributes.max_dynamic_shared_size_bytes},
    };
    for (const auto& query : queries) {
      result = api.cuFuncGetAttribute(query.value, query.attribute, handle);
      if (result != CUDA_SUCCESS) {
        return core_->Error(result, "cuFuncGetAttribute",
                            absl::StrCat(query.attribute_name, " of kernel \"", name, "\""));
      }
    }

    auto function = std::make_unique<CudaFunction>(handle, name, std::move(params), attributes);
    Function* raw = function.get();
    functions_.emplace(name, std::move(function));
    return raw;
  }

  absl::StatusOr<Global> GetGlobal(const std::string& name) override {
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    CUdeviceptr address = 0;
    size_t size = 0;
    const CUresult result = core_->api().cuModuleGetGlobal(&address, &size, module_, name.c_str());
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuModuleGetGlobal",
                          result == CUDA_ERROR_NOT_FOUND
                              ? absl::StrCat("the module has no global named \"", name, "\"")
                              : absl::StrCat("global \"", name, "\""));
    }
    return Global{static_cast<DevicePtr>(address), static_cast<uint64_t>(size)};
  }

  uint64_t device_memory_bytes() const override { return device_memory_bytes_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  const CUmodule module_;
  const uint64_t device_memory_bytes_;
  absl::Mutex mu_;
  // Stable addresses: Function pointers are handed out.
  std::map<std::string, std::unique_ptr<CudaFunction>> functions_ ABSL_GUARDED_BY(mu_);
};

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

// Backend objects come only from this backend (the session layer never mixes backends),
// hence the static_casts.
CUstream ToCuStream(Stream* stream) {
  return stream == nullptr ? nullptr : static_cast<CudaStream*>(stream)->handle();
}

// ---------------------------------------------------------------------------------------

// Pinned host buffers for staging copies. Each slot has an event recorded after the copy
// that uses it; a slot is reused only after its event has completed. All methods except
// the constructor, mutex() and slot_bytes() require mutex() held (ABSL_EXCLUSIVE_LOCKS_REQUIRED);
// all but slot accessors also the context current.
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

  absl::Status EnsureAllocated(ContextCore& core) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Waits until the last copy that used `slot` has completed.
  absl::Status WaitIdle(ContextCore& core, Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Marks `slot` busy until the work just queued on `stream` completes.
  absl::Status MarkPending(ContextCore& core, Slot& slot, CUstream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const CUresult result = core.api().cuEventRecord(slot.done, stream);
    if (ABSL_PREDICT_FALSE(result != CUDA_SUCCESS)) {
      // Without the event we cannot tell when the DMA stops reading the slot: wait.
      core.api().cuStreamSynchronize(stream);
      return core.Error(result, "cuEventRecord", "staging event");
    }
    slot.pending = true;
    return absl::OkStatus();
  }

  // Waits for in-flight copies, then frees the events and the pinned memory. Never throws.
  void Destroy(ContextCore& core) noexcept ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

 private:
  absl::Mutex mu_;
  const size_t slot_bytes_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  void* host_ ABSL_GUARDED_BY(mu_) = nullptr;  // One allocation; the slots are slices of it.
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
};

// ---------------------------------------------------------------------------------------

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

// A graph captured from a stream, with its nodes in capture order (the chain from its
// root) and their kinds. The driver's graph objects are not internally synchronised: every
// call that reads or changes one holds mutex() (Instantiate, Update, node handles in
// SetParams; a graph exec's mutex is always taken before its graph's).
class CudaGraph final : public Graph {
 public:
  CudaGraph(std::shared_ptr<ContextCore> core, CUgraph graph)
      : core_(std::move(core)), graph_(graph) {}
  ~CudaGraph() override {
    const DriverApi& api = core_->api();
    // A copy: the lambda is analysed apart from this destructor, which needs no lock.
    const CUgraph graph = graph_;
    core_->CleanUp("cuGraphDestroy", [&] { return api.cuGraphDestroy(graph); });
  }

  // Reads the nodes; the constructor's caller calls it once before handing the graph out.
  // Nothing else can reach the graph yet, so (like the constructor) it runs without
  // mutex() and is left out of the lock analysis.
  absl::Status ReadNodes() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const DriverApi& api = core_->api();
    size_t count = 0;
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api.cuGraphGetNodes(graph_, nullptr, &count), "cuGraphGetNodes"));
    std::vector<CUgraphNode> all(count);
    if (count > 0) {
      GPURPC_RETURN_IF_ERROR(
          core_->Check(api.cuGraphGetNodes(graph_, all.data(), &count), "cuGraphGetNodes"));
      all.resize(count);
    }
    // Topological order (Kahn), ties in cuGraphGetNodes order: for the chain a one-stream
    // capture makes, the order the work was enqueued in.
    std::map<CUgraphNode, size_t> waiting;  // node -> dependencies not yet placed
    std::map<CUgraphNode, std::vector<CUgraphNode>> dependents;
    for (CUgraphNode node : all) waiting.emplace(node, 0);
    for (CUgraphNode node : all) {
      size_t n = 0;
      GPURPC_RETURN_IF_ERROR(
          core_->Check(api.cuGraphNodeGetDependentNodes(node, nullptr, nullptr, &n),
                       "cuGraphNodeGetDependentNodes"));
      std::vector<CUgraphNode>& out = dependents[node];
      out.resize(n);
      if (n > 0) {
        GPURPC_RETURN_IF_ERROR(
            core_->Check(api.cuGraphNodeGetDependentNodes(node, out.data(), nullptr, &n),
                         "cuGraphNodeGetDependentNodes"));
        out.resize(n);
      }
      for (CUgraphNode next : out) ++waiting[next];
    }
    std::vector<CUgraphNode> ready;
    for (CUgraphNode node : all) {
      if (waiting[node] == 0) ready.push_back(node);
    }
    std::reverse(ready.begin(), ready.end());  // a stack, first node on top
    while (!ready.empty()) {
      CUgraphNode node = ready.back();
      ready.pop_back();
      nodes_.push_back(node);
      const std::vector<CUgraphNode>& out = dependents[node];
      for (auto it = out.rbegin(); it != out.rend(); ++it) {
        if (--waiting[*it] == 0) ready.push_back(*it);
      }
    }
    if (nodes_.size() != all.size()) {
      return absl::InternalError(absl::StrCat("the captured graph has ", all.size(),
                                              " nodes but only ", nodes_.size(),
                                              " are reachable in dependency order"));
    }
    for (CUgraphNode node : nodes_) {
      CUgraphNodeType type;
      GPURPC_RETURN_IF_ERROR(
          core_->Check(api.cuGraphNodeGetType(node, &type), "cuGraphNodeGetType"));
      switch (type) {
        case CU_GRAPH_NODE_TYPE_KERNEL:
          kinds_.push_back(GraphNodeKind::kKernel);
          break;
        case CU_GRAPH_NODE_TYPE_MEMSET:
          kinds_.push_back(GraphNodeKind::kMemset);
          break;
        case CU_GRAPH_NODE_TYPE_MEMCPY:
          kinds_.push_back(GraphNodeKind::kCopy);
          break;
        default:
          kinds_.push_back(GraphNodeKind::kOther);
      }
    }
    return absl::OkStatus();
  }

  const std::vector<GraphNodeKind>& nodes() const override { return kinds_; }
  CUgraph handle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return graph_; }
  const std::vector<CUgraphNode>& node_handles() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return nodes_;
  }
  absl::Mutex& mutex() ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  // The driver's graph and its nodes: every driver call on them holds mu_ (past ReadNodes).
  const CUgraph graph_ ABSL_GUARDED_BY(mu_);
  std::vector<CUgraphNode> nodes_ ABSL_GUARDED_BY(mu_);
  // Set by ReadNodes, read-only afterwards (nodes() reads it without mu_).
  std::vector<GraphNodeKind> kinds_;
  absl::Mutex mu_;
};

class CudaGraphExec final : public GraphExec {
 public:
  CudaGraphExec(std::shared_ptr<ContextCore> core, CUgraphExec exec,
                std::shared_ptr<CudaGraph> source)
      : core_(std::move(core)), exec_(exec), source_(std::move(source)) {}
  // Launches already enqueued still run (cuGraphExecDestroy does not wait for them).
  ~CudaGraphExec() override {
    const DriverApi& api = core_->api();
    // A copy: the lambda is analysed apart from this destructor, which needs no lock.
    const CUgraphExec exec = exec_;
    core_->CleanUp("cuGraphExecDestroy", [&] { return api.cuGraphExecDestroy(exec); });
  }
  CUgraphExec handle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return exec_; }
  // The graph it was instantiated from: its node handles name this exec's nodes.
  CudaGraph& source() const { return *source_; }
  absl::Mutex& mutex() ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  // The driver's graph exec: every driver call on it holds mu_.
  const CUgraphExec exec_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<CudaGraph> source_;
  // Lock order: a graph exec's mutex is taken before a graph's (its source's, or the graph
  // it is updated from; see UpdateGraphExec and SetGraphExecKernelNode).
  absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(source_->mutex());
};

const char* GraphExecUpdateResultName(CUgraphExecUpdateResult result) {
  switch (result) {
    case CU_GRAPH_EXEC_UPDATE_SUCCESS:
      return "CU_GRAPH_EXEC_UPDATE_SUCCESS";
    case CU_GRAPH_EXEC_UPDATE_ERROR:
      return "CU_GRAPH_EXEC_UPDATE_ERROR";
    case CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE";
    case CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED";
  }
  return "an unknown CUgraphExecUpdateResult";
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
    if (size_bytes == 0) return absl::OkStatus();
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    const CUstream cu_stream = ToCuStream(stream);
    GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(cu_stream, "cuMemcpyHtoDAsync"));
    StagingRing& ring = size_bytes <= kSmallTransferBytes ? small_staging_ : staging_;
    absl::MutexLock lock(&ring.mutex());
    GPURPC_RETURN_IF_ERROR(ring.EnsureAllocated(*core_));
    const auto* bytes = static_cast<const uint8_t*>(src);
    for (uint64_t offset = 0; offset < size_bytes;) {
      const size_t chunk =
          static_cast<size_t>(std::min<uint64_t>(ring.slot_bytes(), size_bytes - offset));
      StagingRing::Slot& slot = ring.NextSlot();
      GPURPC_RETURN_IF_ERROR(ring.WaitIdle(*core_, slot));
      std::memcpy(slot.host, bytes + offset, chunk);
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
    // Refusals before the driver sees the image name the call that would have refused it,
    // as the driver's own refusals (and the fake's) do.
    const auto refused_early = [](const absl::Status& status) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuModuleLoadDataEx: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid) - ",
          status.message()));
    };
    absl::StatusOr<ModuleImage> prepared_or = ModuleImage::Prepare(image);
    if (!prepared_or.ok()) return refused_early(prepared_or.status());
    ModuleImage prepared = *std::move(prepared_or);
    // Before the driver allocates the globals: an image whose footprint cannot be known is
    // refused here.
    const absl::StatusOr<uint64_t> footprint = ModuleFootprintBytes(image);
    if (!footprint.ok()) return refused_early(footprint.status());
    const uint64_t device_memory_bytes = *footprint;
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    std::string error_log(kJitLogBytes, '\0');
    std::string info_log(kJitLogBytes, '\0');
    CUjit_option options[] = {
        CU_JIT_ERROR_LOG_BUFFER,
        CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CU_JIT_INFO_LOG_BUFFER,
        CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    };
    // The size options are unsigned ints passed by value in the pointer slot.
    void* values[] = {
        error_log.data(),
        reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
        info_log.data(),
        reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
    };
    static_assert(sizeof(options) / sizeof(options[0]) == sizeof(values) / sizeof(values[0]));
    CUmodule module = nullptr;
    const CUresult result = api_.cuModuleLoadDataEx(
        &module, prepared.data(), sizeof(options) / sizeof(options[0]), options, values);
    // The buffers were zero-filled and the driver was told one byte less than their size.
    error_log.resize(std::strlen(error_log.c_str()));
    info_log.resize(std::strlen(info_log.c_str()));
    if (result != CUDA_SUCCESS) {
      std::string detail = absl::StrCat(ModuleImageKindName(prepared.kind()), " image of ",
                                        prepared.size_bytes(), " bytes rejected");
      if (!error_log.empty()) absl::StrAppend(&detail, "; JIT error log: ", error_log);
      absl::Status status = core_->Error(result, "cuModuleLoadDataEx", detail);
      switch (status.code()) {
        case absl::StatusCode::kResourceExhausted:
        case absl::StatusCode::kAborted:
        case absl::StatusCode::kDataLoss:
        case absl::StatusCode::kUnavailable:
          return status;
        default:
          // Whatever the driver's reason, the image is what was wrong (backend.h).
          return absl::InvalidArgumentError(status.message());
      }
    }
    if (!info_log.empty()) spdlog::debug("cuModuleLoadDataEx info log: {}", info_log);
    return std::unique_ptr<Module>(
        std::make_unique<CudaModule>(core_, module, device_memory_bytes));
  }

  absl::StatusOr<LinkedModule> LinkModule(absl::Span<const LinkInput> inputs,
                                          bool log_verbose) override {
    if (inputs.empty()) return absl::InvalidArgumentError("cuLinkAddData: nothing to link");
    GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
    std::string error_log(kJitLogBytes, '\0');
    std::string info_log(kJitLogBytes, '\0');
    // The linker targets the current context's device. The log buffers stay valid until
    // cuLinkDestroy, which also frees the linked image.
    CUjit_option options[] = {
        CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CU_JIT_INFO_LOG_BUFFER,  CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CU_JIT_LOG_VERBOSE,
    };
    void* values[] = {
        error_log.data(),
        reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
        info_log.data(),
        reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
        reinterpret_cast<void*>(static_cast<uintptr_t>(log_verbose ? 1 : 0)),
    };
    static_assert(sizeof(options) / sizeof(options[0]) == sizeof(values) / sizeof(values[0]));
    CUlinkState state = nullptr;
    CUresult result =
        api_.cuLinkCreate(sizeof(options) / sizeof(options[0]), options, values, &state);
    if (result != CUDA_SUCCESS) return core_->Error(result, "cuLinkCreate", "");
    struct Destroy {
      const DriverApi& api;
      std::shared_ptr<ContextCore> core;
      CUlinkState state;
      ~Destroy() {
        core->CleanUp("cuLinkDestroy", [&] { return api.cuLinkDestroy(state); });
      }
    } destroy{api_, core_, state};
    const auto logs = [&] {
      error_log.resize(std::strlen(error_log.c_str()));
      return error_log.empty() ? std::string() : absl::StrCat("; linker error log: ", error_log);
    };
    // An image the linker refuses, or a failed link, is what the caller sent (backend.h).
    const auto refused = [&](CUresult failed, const char* call, const std::string& detail) {
      absl::Status status = core_->Error(failed, call, absl::StrCat(detail, logs()));
      switch (status.code()) {
        case absl::StatusCode::kResourceExhausted:
        case absl::StatusCode::kAborted:
        case absl::StatusCode::kDataLoss:
        case absl::StatusCode::kUnavailable:
          return status;
        default:
          return absl::InvalidArgumentError(status.message());
      }
    };
    for (size_t i = 0; i < inputs.size(); ++i) {
      const LinkInput& input = inputs[i];
      std::vector<uint8_t> text;  // PTX must be NUL-terminated for the driver
      void* data = const_cast<uint8_t*>(input.data.data());
      size_t size = input.data.size();
      std::vector<uint64_t> aligned;  // binaries at 8-byte alignment, as ModuleImage does
      if (input.type == LinkInputType::kPtx && (size == 0 || input.data[size - 1] != 0)) {
        text.assign(input.data.begin(), input.data.end());
        text.push_back(0);
        data = text.data();
        size = text.size();
      } else if (input.type != LinkInputType::kPtx &&
                 reinterpret_cast<uintptr_t>(data) % alignof(uint64_t) != 0) {
        aligned.assign(size / sizeof(uint64_t) + 1, 0);
        std::memcpy(aligned.data(), input.data.data(), size);
        data = aligned.data();
      }
      result = api_.cuLinkAddData(state, static_cast<CUjitInputType>(input.type), data, size,
                                  input.name.c_str(), 0, nullptr, nullptr);
      if (result != CUDA_SUCCESS) {
        return refused(result, "cuLinkAddData",
                       absl::StrCat("input ", i, " '", absl::CHexEscape(input.name), "' (",
                                    input.data.size(), " bytes) rejected"));
      }
    }
    void* linked = nullptr;
    size_t linked_bytes = 0;
    result = api_.cuLinkComplete(state, &linked, &linked_bytes);
    if (result != CUDA_SUCCESS) return refused(result, "cuLinkComplete", "link failed");
    info_log.resize(std::strlen(info_log.c_str()));
    LinkedModule out;
    // The image is the linker's until cuLinkDestroy: LoadModule reads it before that.
    GPURPC_ASSIGN_OR_RETURN(out.module, LoadModule(absl::Span<const uint8_t>(
                                            static_cast<const uint8_t*>(linked), linked_bytes)));
    out.info_log = std::move(info_log);
    return out;
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
    size_t args_size = packed_args.size();
    void* extra[] = {
        CU_LAUNCH_PARAM_BUFFER_POINTER,
        const_cast<uint8_t*>(packed_args.data()),
        CU_LAUNCH_PARAM_BUFFER_SIZE,
        &args_size,
        CU_LAUNCH_PARAM_END,
    };
    const CUresult result = api_.cuLaunchKernel(
        cuda_function->handle(), config.grid.x, config.grid.y, config.grid.z, config.block.x,
        config.block.y, config.block.z, config.shared_memory_bytes, ToCuStream(stream),
        /*kernelParams=*/nullptr, args_size == 0 ? nullptr : extra);
    if (ABSL_PREDICT_TRUE(result == CUDA_SUCCESS)) return absl::OkStatus();
    return LaunchError(result, *cuda_function, config, args_size);
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
    size_t args_size = packed_args.size();
    void* extra[] = {
        CU_LAUNCH_PARAM_BUFFER_POINTER,
        const_cast<uint8_t*>(packed_args.data()),
        CU_LAUNCH_PARAM_BUFFER_SIZE,
        &args_size,
        CU_LAUNCH_PARAM_END,
    };
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
    params.extra = args_size == 0 ? nullptr : extra;  // copied by the driver
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

absl::StatusOr<DeviceInfo> QueryDeviceInfo(const DriverApi& api, int ordinal) {
  CUdevice device = 0;
  CUresult result = api.cuDeviceGet(&device, ordinal);
  if (result != CUDA_SUCCESS) {
    return CuResultToStatus(&api, result, "cuDeviceGet", absl::StrCat("ordinal ", ordinal));
  }
  auto fail = [&](const char* call, absl::string_view what) {
    return CuResultToStatus(&api, result, call, absl::StrCat(what, " of device ", ordinal));
  };

  DeviceInfo info;
  info.ordinal = ordinal;

  char name[256] = {};
  result = api.cuDeviceGetName(name, sizeof(name) - 1, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceGetName", "name");
  info.name = name;

  size_t total_bytes = 0;
  result = api.cuDeviceTotalMem(&total_bytes, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceTotalMem", "total memory");
  info.total_memory_bytes = total_bytes;

  char bus_id[64] = {};
  result = api.cuDeviceGetPCIBusId(bus_id, sizeof(bus_id) - 1, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceGetPCIBusId", "PCI bus id");
  info.pci_bus_id = bus_id;

  const struct {
    CUdevice_attribute attribute;
    const char* attribute_name;
    int* value;
  } required[] = {
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
       &info.compute_capability_major},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
       &info.compute_capability_minor},
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
       &info.multiprocessor_count},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
       &info.max_threads_per_block},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X",
       &info.max_block_dim[0]},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y",
       &info.max_block_dim[1]},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z",
       &info.max_block_dim[2]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X",
       &info.max_grid_dim[0]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y",
       &info.max_grid_dim[1]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z",
       &info.max_grid_dim[2]},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
       "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK", &info.max_shared_memory_per_block_bytes},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
       "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
       &info.max_shared_memory_per_block_optin_bytes},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, "CU_DEVICE_ATTRIBUTE_WARP_SIZE", &info.warp_size},
  };
  for (const auto& query : required) {
    result = api.cuDeviceGetAttribute(query.value, query.attribute, device);
    if (result != CUDA_SUCCESS) return fail("cuDeviceGetAttribute", query.attribute_name);
  }

  // Everything else the driver answers; values it does not know (reserved or removed
  // attributes) are left out.
  for (int attribute = 1; attribute < static_cast<int>(CU_DEVICE_ATTRIBUTE_MAX); ++attribute) {
    int value = 0;
    if (api.cuDeviceGetAttribute(&value, static_cast<CUdevice_attribute>(attribute), device) ==
        CUDA_SUCCESS) {
      info.attributes[attribute] = value;
    }
  }
  info.is_fake = false;
  return info;
}

absl::Status NoDeviceError(const DriverApi& api) {
  return absl::UnavailableError(
      absl::StrCat("no CUDA device: the NVIDIA driver (CUDA ", api.driver_version / 1000, ".",
                   (api.driver_version % 1000) / 10, ") reports 0 devices"));
}

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
