// The fake device backend: a test double in host memory for the worker's session layer, the
// service tests and client development, behind the same interface as the CUDA backend. It
// runs no device code: a module's kernels are the host-implemented built-ins of
// fake_kernels.h, picked by name, and the device says it is fake wherever it is described, so
// that it can never pass for a GPU.
//
// This file has the backend objects: FakeBackend, FakeContext, FakeModule, FakeArray and
// FakeHostRegistration. The simulated device they drive (memory, streams and their threads,
// events, capture, the work that runs on a stream) is DeviceState, in fake_device.h, with the
// stream, event and function handles whose calls it checks.
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
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/fake/fake_device.h"
#include "server/worker/backend/fake/fake_graph.h"
#include "server/worker/backend/fake/fake_kernels.h"
#include "server/worker/backend/fake/fake_module_image.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/backend/ptx_globals.h"

namespace gpurpc::backend {
namespace {

using fake::BuiltinKernel;
using fake::BuiltinKernelNames;
using fake::CheckLaunchConfig;
using fake::DeviceState;
using fake::FakeEvent;
using fake::FakeFunction;
using fake::FakeStream;
using fake::FindBuiltinKernel;
using fake::kInvalidHandle;
using fake::kInvalidValue;
using fake::kMaxBlockDim;
using fake::kMaxGridDim;
using fake::kMaxThreadsPerBlock;
using fake::kMultiprocessorCount;
using fake::kSharedMemoryPerBlockBytes;
using fake::kSharedMemoryPerBlockOptinBytes;
using fake::kTotalConstantMemoryBytes;
using fake::kWarpSize;
using fake::PackedSizeBytes;
using fake::SaturatingMul;

constexpr char kDeviceName[] = "gpurpc fake device (host memory, not a GPU)";
// A virtual architecture: NVRTC then emits PTX, whose entries and globals the fake reads.
constexpr char kCompileTarget[] = "compute_75";

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

constexpr char kSymbolNotFound[] = "CUDA_ERROR_NOT_FOUND (named symbol not found)";

constexpr absl::string_view kLoadCall = "cuModuleLoadDataEx";

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
