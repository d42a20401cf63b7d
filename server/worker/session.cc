#include "server/worker/session.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/compiler/cuda_libraries.h"
#include "server/worker/device_output.h"

namespace gpurpc::worker {
namespace {

bool IsSticky(const absl::Status& status) { return IsStickyFault(status); }

std::string DescribePointer(const v1::DevicePointer& pointer) {
  switch (pointer.target_case()) {
    case v1::DevicePointer::kBuffer:
      return absl::StrFormat("buffer %d + %d", pointer.buffer().buffer_id(),
                             pointer.buffer().offset_bytes());
    case v1::DevicePointer::kDeviceAddress:
      return absl::StrFormat("address 0x%x", pointer.device_address());
    default:
      return "an unset pointer";
  }
}

std::string DescribeParams(const std::vector<backend::ParamInfo>& params) {
  std::string out;
  for (size_t i = 0; i < params.size(); ++i) {
    absl::StrAppendFormat(&out, "%s#%d: %d bytes at offset %d", i == 0 ? "" : ", ", i,
                          params[i].size_bytes, params[i].offset_bytes);
  }
  return out.empty() ? "none" : out;
}

uint32_t ArgSize(const v1::KernelArg& arg) {
  switch (arg.value_case()) {
    case v1::KernelArg::kU8:
      return 1;
    case v1::KernelArg::kU16:
      return 2;
    case v1::KernelArg::kU32:
      return 4;
    case v1::KernelArg::kU64:
      return 8;
    case v1::KernelArg::kF32:
      return 4;
    case v1::KernelArg::kF64:
      return 8;
    case v1::KernelArg::kBuffer:
      return 8;
    case v1::KernelArg::kRaw:
      return static_cast<uint32_t>(arg.raw().size());
    case v1::KernelArg::kDeviceAddress:
      return 8;
    default:
      return 0;
  }
}

const char* ArgKind(const v1::KernelArg& arg) {
  switch (arg.value_case()) {
    case v1::KernelArg::kU8:
      return "u8";
    case v1::KernelArg::kU16:
      return "u16";
    case v1::KernelArg::kU32:
      return "u32";
    case v1::KernelArg::kU64:
      return "u64";
    case v1::KernelArg::kF32:
      return "f32";
    case v1::KernelArg::kF64:
      return "f64";
    case v1::KernelArg::kBuffer:
      return "buffer pointer";
    case v1::KernelArg::kRaw:
      return "raw bytes";
    case v1::KernelArg::kDeviceAddress:
      return "device address";
    default:
      return "unset";
  }
}

// Names are C strings to the driver: "k\0x" would find "k".
absl::Status CheckName(const char* call, const char* field, const std::string& name) {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s is empty", call, field));
  }
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is %d bytes, more than the limit of %d bytes", call, field,
                        name.size(), kMaxNameBytes));
  }
  if (const size_t nul = name.find('\0'); nul != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s has a NUL byte at offset %d; names are C strings without NUL bytes",
                        call, field, nul));
  }
  return absl::OkStatus();
}

// The packed size of a kernel's parameters as the driver reports them, after checking that
// the layout can be packed: every parameter non-empty, inside kMaxParamBytes and
// overlapping no other, in whatever order they come. A module image is the client's
// input, so a layout that fails is INVALID_ARGUMENT.
absl::StatusOr<uint32_t> CheckParamLayout(const std::string& kernel,
                                          const std::vector<backend::ParamInfo>& params) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return params[a].offset_bytes < params[b].offset_bytes; });
  uint64_t end = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const uint64_t offset = params[i].offset_bytes;
    const uint64_t size = params[i].size_bytes;
    if (size == 0 || offset + size > kMaxParamBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GetFunction: kernel '%s' reports parameter #%d as %d bytes at offset %d, which "
          "is not within a parameter block of 1 to %d bytes; the module image is malformed",
          kernel, i, size, offset, kMaxParamBytes));
    }
    if (k > 0) {
      const size_t previous = order[k - 1];
      if (offset < uint64_t{params[previous].offset_bytes} + params[previous].size_bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "GetFunction: kernel '%s' reports parameter #%d (%d bytes at offset %d) "
            "overlapping parameter #%d (%d bytes at offset %d); the module image is malformed",
            kernel, i, size, offset, previous, params[previous].size_bytes,
            params[previous].offset_bytes));
      }
    }
    end = std::max(end, offset + size);
  }
  return static_cast<uint32_t>(end);
}

absl::Status CheckDim(const char* name, const v1::Dim3& dim, const std::array<int, 3>& max,
                      backend::Dim3* out) {
  const uint32_t v[3] = {dim.x(), dim.y(), dim.z()};
  static constexpr const char* kAxis[3] = {"x", "y", "z"};
  for (int i = 0; i < 3; ++i) {
    if (v[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.%s is 0; every launch dimension must be at least 1", name, kAxis[i]));
    }
    if (max[i] > 0 && v[i] > static_cast<uint32_t>(max[i])) {
      return absl::InvalidArgumentError(absl::StrFormat("%s.%s = %d exceeds the device limit of %d",
                                                        name, kAxis[i], v[i], max[i]));
    }
  }
  *out = backend::Dim3{v[0], v[1], v[2]};
  return absl::OkStatus();
}

// A byte count for messages, e.g. "64 MiB (67108864 bytes)".
std::string Bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrFormat("%d bytes", bytes);
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.4g %s (%d bytes)", value, kUnits[unit], bytes);
}

// The wire's ContextLimit, checked: INVALID_ARGUMENT naming it when it is none.
absl::StatusOr<backend::ContextLimit> ToContextLimit(const char* call, int limit) {
  if (!v1::ContextLimit_IsValid(limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: limit %d is not a ContextLimit (0 = STACK_SIZE, 1 = PRINTF_FIFO_SIZE, "
        "2 = MALLOC_HEAP_SIZE, 3 = DEV_RUNTIME_SYNC_DEPTH, 4 = DEV_RUNTIME_PENDING_LAUNCH_COUNT, "
        "5 = MAX_L2_FETCH_GRANULARITY, 6 = PERSISTING_L2_CACHE_SIZE)",
        call, limit));
  }
  return static_cast<backend::ContextLimit>(limit);
}

absl::StatusOr<backend::CacheConfig> ToCacheConfig(const char* call, int config) {
  if (!v1::CacheConfig_IsValid(config)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: cache config %d is not a CacheConfig (0 = PREFER_NONE, 1 = PREFER_SHARED, "
        "2 = PREFER_L1, 3 = PREFER_EQUAL)",
        call, config));
  }
  return static_cast<backend::CacheConfig>(config);
}

// The limit's name as the wire spells it, for messages.
std::string LimitName(backend::ContextLimit limit) {
  return v1::ContextLimit_Name(static_cast<v1::ContextLimit>(limit));
}

}  // namespace

Session::Session(std::unique_ptr<backend::Context> context, compiler::Compiler* compiler,
                 absl::Status compiler_status, Watchdog::FireFn on_kernel_timeout)
    : context_(std::move(context)),
      compiler_(compiler),
      compiler_status_(std::move(compiler_status)),
      on_kernel_timeout_(on_kernel_timeout ? std::move(on_kernel_timeout)
                                           : ExitOnKernelTimeout(-1)) {}

Session::~Session() {
  // Captures end and graph execs and graphs go before everything they use (functions,
  // modules, streams).
  ReleaseGraphs();
  // No call is in flight any more. The watchdog's thread stops and its events go first:
  // nothing may outlive the context it was made in.
  watchdog_ptr_.store(nullptr, std::memory_order_release);
  std::unique_ptr<Watchdog> watchdog;
  std::unordered_map<uint64_t, std::shared_ptr<FunctionEntry>> functions;
  std::unordered_map<uint64_t, std::shared_ptr<ModuleEntry>> modules;
  std::unordered_map<uint64_t, std::shared_ptr<backend::Event>> events;
  std::unordered_map<uint64_t, std::shared_ptr<backend::Stream>> streams;
  std::unordered_map<uint64_t, backend::DevicePtr> buffers;
  std::unordered_map<uint64_t, std::shared_ptr<RegionEntry>> regions;
  {
    absl::MutexLock lock(&mu_);
    regions.swap(regions_);
    watchdog = std::move(watchdog_);
    functions.swap(functions_);
    modules.swap(modules_);
    events.swap(events_);
    streams.swap(streams_);
    buffers.swap(buffers_);
    ranges_.clear();
  }
  // Dependency order, outside mu_ (each is a backend call).
  watchdog.reset();
  functions.clear();
  modules.clear();
  events.clear();
  streams.clear();
  // Each waits for the context's queued work, then unpins and unmaps.
  regions.clear();
  for (const auto& [id, address] : buffers) {
    absl::Status status = context_->Free(address);
    (void)status;  // The context is going away; a failure here frees nothing less.
  }
  context_.reset();
}

absl::Status Session::Bind(const std::string& tenant, const Limits& limits) {
  absl::MutexLock lock(&mu_);
  if (bound_) {
    return absl::FailedPreconditionError("Bind: this worker is already bound to a session");
  }
  bound_ = true;
  tenant_ = tenant;
  limits_ = limits;
  if (limits.kernel_timeout_ms > 0) {
    Watchdog::Options options;
    options.timeout_ms = limits.kernel_timeout_ms;
    // Creates no backend object yet (events come with the first launches).
    watchdog_ = std::make_unique<Watchdog>(context_.get(), std::move(options), on_kernel_timeout_);
    watchdog_ptr_.store(watchdog_.get(), std::memory_order_release);
  }
  return absl::OkStatus();
}

std::string Session::tenant() const {
  absl::MutexLock lock(&mu_);
  return tenant_;
}

Session::TableSizes Session::table_sizes() const {
  absl::MutexLock lock(&mu_);
  TableSizes sizes;
  sizes.buffers = buffers_.size();
  sizes.ranges = ranges_.size();
  sizes.modules = modules_.size();
  sizes.functions = functions_.size();
  sizes.streams = streams_.size();
  sizes.events = events_.size();
  sizes.regions = regions_.size();
  sizes.graphs = graphs_.size();
  sizes.graph_execs = graph_execs_.size();
  return sizes;
}

uint64_t Session::NewIdLocked() {
  for (;;) {
    const uint64_t id = ids_.Next();
    if (buffers_.count(id) == 0 && modules_.count(id) == 0 && functions_.count(id) == 0 &&
        streams_.count(id) == 0 && events_.count(id) == 0 && regions_.count(id) == 0 &&
        graphs_.count(id) == 0 && graph_execs_.count(id) == 0) {
      return id;
    }
  }
}

absl::Status Session::CheckCountLocked(const char* what, size_t count, uint32_t limit,
                                       const char* quota_name) const {
  if (limit == 0 || count < limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "quota %s of tenant '%s' reached: this session holds %d %s of at most %d; destroy "
      "some first",
      quota_name, tenant_, count, what, limit));
}

absl::Status Session::Check(absl::Status status) {
  if (status.ok() || !IsSticky(status)) return status;
  {
    absl::MutexLock lock(&mu_);
    if (fault_.ok()) {
      // The call that observes the fault reports it as it is (ABORTED or DATA_LOSS).
      fault_ = status;
      faulted_.store(true, std::memory_order_release);
    } else {
      return fault();
    }
  }
  if (on_fault_) on_fault_(status);
  return status;
}

absl::Status Session::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  // Every call after the observing one: the session is unusable, retrying cannot help.
  return absl::FailedPreconditionError(
      absl::StrCat("the session FAULTED earlier: ", fault_.message()));
}

// ---------------------------------------------------------------------------- memory

absl::StatusOr<v1::BufferInfo> Session::Allocate(uint64_t size_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (size_bytes == 0) return absl::InvalidArgumentError("Allocate: size_bytes must be > 0");
  GPURPC_ASSIGN_OR_RETURN(backend::DevicePtr address, Check(context_->Alloc(size_bytes)));
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = NewIdLocked();
    buffers_[id] = address;
    ranges_[address] = Range{id, size_bytes};
  }
  v1::BufferInfo info;
  info.set_buffer_id(id);
  info.set_device_address(address);
  info.set_size_bytes(size_bytes);
  return info;
}

absl::Status Session::Free(uint64_t buffer_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  backend::DevicePtr address;
  {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(buffer_id);
    if (it == buffers_.end()) {
      return absl::NotFoundError(absl::StrFormat("Free: no buffer %d in this session", buffer_id));
    }
    address = it->second;
    buffers_.erase(it);
    ranges_.erase(address);
  }
  return Check(context_->Free(address));
}

absl::StatusOr<v1::BufferInfo> Session::GetAllocation(const v1::GetAllocationRequest& request) {
  absl::MutexLock lock(&mu_);
  v1::BufferInfo info;
  if (request.target_case() == v1::GetAllocationRequest::kBufferId) {
    auto it = buffers_.find(request.buffer_id());
    if (it == buffers_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("GetAllocation: no buffer %d in this session", request.buffer_id()));
    }
    info.set_buffer_id(it->first);
    info.set_device_address(it->second);
    info.set_size_bytes(ranges_.at(it->second).size_bytes);
    return info;
  }
  if (request.target_case() != v1::GetAllocationRequest::kDeviceAddress) {
    return absl::InvalidArgumentError("GetAllocation: set buffer_id or device_address");
  }
  const uint64_t address = request.device_address();
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin() || std::prev(it)->second.id == 0 ||
      address - std::prev(it)->first >= std::prev(it)->second.size_bytes) {
    return absl::NotFoundError(
        absl::StrFormat("GetAllocation: address 0x%x is in no buffer of this session", address));
  }
  --it;
  info.set_buffer_id(it->second.id);
  info.set_device_address(it->first);
  info.set_size_bytes(it->second.size_bytes);
  return info;
}

absl::StatusOr<backend::MemInfo> Session::GetMemInfo() {
  GPURPC_RETURN_IF_ERROR(fault());
  return Check(context_->GetMemInfo());
}

absl::StatusOr<backend::DevicePtr> Session::Resolve(const v1::DevicePointer& pointer,
                                                    uint64_t size_bytes, const char* what) {
  absl::MutexLock lock(&mu_);
  return ResolveLocked(pointer, size_bytes, what);
}

absl::StatusOr<backend::DevicePtr> Session::ResolveLocked(const v1::DevicePointer& pointer,
                                                          uint64_t size_bytes, const char* what) {
  backend::DevicePtr base = 0;
  uint64_t offset = 0;
  uint64_t limit = 0;
  if (pointer.target_case() == v1::DevicePointer::kBuffer) {
    auto it = buffers_.find(pointer.buffer().buffer_id());
    if (it == buffers_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("%s: no buffer %d in this session", what, pointer.buffer().buffer_id()));
    }
    base = it->second;
    offset = pointer.buffer().offset_bytes();
    limit = ranges_.at(base).size_bytes;
  } else if (pointer.target_case() == v1::DevicePointer::kDeviceAddress) {
    const uint64_t address = pointer.device_address();
    auto it = ranges_.upper_bound(address);
    if (it == ranges_.begin()) {
      return absl::NotFoundError(
          absl::StrFormat("%s: address 0x%x is in no buffer of this session", what, address));
    }
    --it;
    base = it->first;
    offset = address - base;
    limit = it->second.size_bytes;
    if (offset >= limit && !(offset == limit && size_bytes == 0)) {
      return absl::NotFoundError(
          absl::StrFormat("%s: address 0x%x is in no buffer of this session", what, address));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrFormat("%s: pointer not set", what));
  }
  if (offset > limit || size_bytes > limit - offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: range [%d, %d) of %s is outside the buffer of %d bytes", what, offset,
                        offset + size_bytes, DescribePointer(pointer), limit));
  }
  return base + offset;
}

absl::Status Session::Upload(backend::DevicePtr address, const void* data, uint64_t size_bytes,
                             uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  // The stream is checked even when there is nothing to copy: an unknown id is NOT_FOUND.
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  if (size_bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "Upload"));
  return Check(context_->Upload(address, data, size_bytes, stream.get()));
}

absl::Status Session::Download(backend::DevicePtr address, void* data, uint64_t size_bytes,
                               uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "Download"));
  if (size_bytes == 0) return Check(context_->SynchronizeStream(stream.get()));
  return Check(context_->Download(data, address, size_bytes, stream.get()));
}

absl::Status Session::Memset(const v1::MemsetCommand& command) {
  GPURPC_RETURN_IF_ERROR(fault());
  const uint32_t element = command.element_size_bytes();
  if (element != 1 && element != 2 && element != 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Memset: element_size_bytes must be 1, 2 or 4, got %d", element));
  }
  if (command.count() > (~0ull) / element) {
    return absl::InvalidArgumentError("Memset: count * element size overflows");
  }
  GPURPC_ASSIGN_OR_RETURN(
      backend::DevicePtr address,
      Resolve(command.destination(), command.count() * element, "Memset destination"));
  if (address % element != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Memset: destination 0x%x is not aligned to the element size %d", address, element));
  }
  if (command.count() == 0) return FindStream(command.stream_id()).status();
  return EnqueueCapturable(
      command.stream_id(), "Memset",
      [] {
        GraphNodeRecord node;
        node.type = v1::GRAPH_NODE_TYPE_MEMSET;
        return node;
      },
      [&](backend::Stream* stream, bool) {
        return Check(context_->Memset(address, command.value(), element, command.count(), stream));
      });
}

absl::Status Session::Copy(const v1::CopyCommand& command) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(
      backend::DevicePtr dst,
      Resolve(command.destination(), command.size_bytes(), "CopyDeviceToDevice destination"));
  GPURPC_ASSIGN_OR_RETURN(backend::DevicePtr src, Resolve(command.source(), command.size_bytes(),
                                                          "CopyDeviceToDevice source"));
  if (command.size_bytes() == 0) return FindStream(command.stream_id()).status();
  return EnqueueCapturable(
      command.stream_id(), "CopyDeviceToDevice",
      [] {
        GraphNodeRecord node;
        node.type = v1::GRAPH_NODE_TYPE_MEMCPY;
        return node;
      },
      [&](backend::Stream* stream, bool) {
        return Check(context_->CopyDeviceToDevice(dst, src, command.size_bytes(), stream));
      });
}

// ---------------------------------------------------------------------------- modules

absl::StatusOr<v1::CompileResponse> Session::Compile(const v1::CompileRequest& request) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (compiler_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("Compile: NVRTC is not available on this server: ",
                                               compiler_status_.message()));
  }
  compiler::CompileRequest creq;
  creq.source = request.source();
  creq.program_name = request.program_name();
  creq.options.assign(request.options().begin(), request.options().end());
  for (const v1::Header& header : request.headers()) {
    creq.headers.push_back(compiler::Header{header.name(), header.content()});
  }
  creq.name_expressions.assign(request.name_expressions().begin(),
                               request.name_expressions().end());
  creq.target = context_->CompileTarget();
  creq.tenant = tenant();
  // Every compile that misses the cache is a helper process: bound how many run at once
  // (the front end's per-tenant count ends when a client cancels, the compile does not).
  GPURPC_RETURN_IF_ERROR(BeginCompile());
  absl::StatusOr<compiler::CompileResult> compiled = compiler_->Compile(creq);
  EndCompile();
  GPURPC_ASSIGN_OR_RETURN(compiler::CompileResult result, std::move(compiled));

  v1::CompileResponse response;
  response.set_success(result.success);
  response.set_log(std::move(result.log));
  response.set_cache_hit(result.cache_hit);
  response.set_arch(result.arch);
  response.set_cache_key(result.cache_key);
  for (auto& option : result.effective_options) response.add_effective_options(option);
  for (auto& [expression, lowered] : result.lowered_names) {
    v1::LoweredName* name = response.add_lowered_names();
    name->set_name_expression(expression);
    name->set_lowered_name(lowered);
  }
  if (!result.success) return response;
  response.mutable_image()->assign(result.image.begin(), result.image.end());
  if (!request.compile_only()) {
    uint64_t device_memory_bytes = 0;
    GPURPC_ASSIGN_OR_RETURN(uint64_t module_id, LoadModule(response.image(), &device_memory_bytes));
    response.set_module_id(module_id);
    response.set_device_memory_bytes(device_memory_bytes);
  }
  return response;
}

absl::Status Session::BeginCompile() {
  absl::MutexLock lock(&mu_);
  uint32_t limit = kMaxConcurrentCompiles;
  if (limits_.max_concurrent_compiles != 0 && limits_.max_concurrent_compiles < limit) {
    limit = limits_.max_concurrent_compiles;
  }
  if (compiles_running_ >= limit) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Compile: this session already runs %d compiles, the most it may run at once (quota "
        "max_concurrent_compiles of tenant '%s', at most %d per session); retry when one has "
        "finished",
        compiles_running_, tenant_, kMaxConcurrentCompiles));
  }
  ++compiles_running_;
  return absl::OkStatus();
}

void Session::EndCompile() {
  absl::MutexLock lock(&mu_);
  --compiles_running_;
}

absl::StatusOr<uint64_t> Session::LoadModule(const std::string& image,
                                             uint64_t* device_memory_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (image.empty()) return absl::InvalidArgumentError("LoadModule: the image is empty");
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("modules", modules_.size(), limits_.max_modules,
                                            "max_modules_per_session"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Module> module,
                          Check(context_->LoadModule(absl::Span<const uint8_t>(
                              reinterpret_cast<const uint8_t*>(image.data()), image.size()))));
  const uint64_t footprint = module->device_memory_bytes();
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, AddModule(std::move(module)));
  if (device_memory_bytes != nullptr) *device_memory_bytes = footprint;
  return id;
}

absl::StatusOr<uint64_t> Session::AddModule(std::unique_ptr<backend::Module> module) {
  auto entry = std::make_shared<ModuleEntry>();
  entry->module = std::move(module);
  absl::MutexLock lock(&mu_);
  // Checked again: concurrent loads may have passed the first check together.
  GPURPC_RETURN_IF_ERROR(
      CheckCountLocked("modules", modules_.size(), limits_.max_modules, "max_modules_per_session"));
  const uint64_t id = NewIdLocked();
  modules_[id] = std::move(entry);
  return id;
}

namespace {

// The CUDA linker's input type of a wire one; nullopt for one that is not a LinkInputType
// (or is unspecified).
std::optional<backend::LinkInputType> ToBackendInputType(int type) {
  switch (type) {
    case v1::LINK_INPUT_TYPE_CUBIN:
      return backend::LinkInputType::kCubin;
    case v1::LINK_INPUT_TYPE_PTX:
      return backend::LinkInputType::kPtx;
    case v1::LINK_INPUT_TYPE_FATBINARY:
      return backend::LinkInputType::kFatbinary;
    case v1::LINK_INPUT_TYPE_OBJECT:
      return backend::LinkInputType::kObject;
    case v1::LINK_INPUT_TYPE_LIBRARY:
      return backend::LinkInputType::kLibrary;
    default:
      return std::nullopt;
  }
}

// Whether a source's options already ask for relocatable device code: true for
// "-rdc=true" and its spellings, INVALID_ARGUMENT for one that turns it off.
absl::StatusOr<bool> HasRelocatableDeviceCode(
    int index, const google::protobuf::RepeatedPtrField<std::string>& options) {
  bool has = false;
  for (int i = 0; i < options.size(); ++i) {
    absl::string_view option = absl::StripLeadingAsciiWhitespace(options.Get(i));
    absl::string_view value;
    if (absl::ConsumePrefix(&option, "--relocatable-device-code") ||
        absl::ConsumePrefix(&option, "-rdc")) {
      if (absl::ConsumePrefix(&option, "=")) {
        value = option;
      } else if (option.empty() && i + 1 < options.size()) {
        value = options.Get(i + 1);
      } else if (!option.empty()) {
        continue;  // another option that starts alike
      }
      if (value == "true") {
        has = true;
      } else {
        return absl::InvalidArgumentError(absl::StrFormat(
            "LinkModule: input %d: option '%s' turns relocatable device code off; linked "
            "sources are compiled with --relocatable-device-code=true",
            index, absl::CHexEscape(options.Get(i).substr(0, 256))));
      }
    }
  }
  return has;
}

// The structural checks LoadModule applies to an image, for a data input of a link: the
// driver's linker trusts the sizes inside cubin, ELF object and fatbin headers as its loader
// does, so their bytes must first be shown to lie within the input; compressed fatbin
// entries are refused (what they inflate to is unknown). Libraries are linked only by name
// from the server's toolkit: an archive's members would reach the linker unchecked.
absl::Status CheckLinkData(int index, const v1::LinkData& data) {
  const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data.data().data()),
                                        data.data().size());
  const std::string what =
      absl::StrFormat("LinkModule: input %d ('%s')", index, absl::CHexEscape(data.name()));
  const backend::ImageFormat format = backend::DetectImageFormat(bytes);
  const auto declared = [&](backend::ImageFormat expected, const char* type) -> absl::Status {
    if (format == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is declared %s but its bytes are %s", what, type, backend::ImageFormatName(format)));
  };
  const auto annotate = [&](const absl::Status& status) {
    return status.ok() ? status
                       : absl::InvalidArgumentError(absl::StrCat(what, ": ", status.message()));
  };
  switch (data.type()) {
    case v1::LINK_INPUT_TYPE_PTX:
      return declared(backend::ImageFormat::kPtx, "PTX");
    case v1::LINK_INPUT_TYPE_CUBIN:
    case v1::LINK_INPUT_TYPE_OBJECT:
      GPURPC_RETURN_IF_ERROR(declared(backend::ImageFormat::kCubin, "a cubin or ELF object"));
      return annotate(backend::ValidateCubin(bytes));
    case v1::LINK_INPUT_TYPE_FATBINARY:
      GPURPC_RETURN_IF_ERROR(declared(backend::ImageFormat::kFatbin, "a fatbin"));
      // Validates the header and every entry, and refuses compressed entries.
      return annotate(backend::ModuleFootprintBytes(bytes).status());
    case v1::LINK_INPUT_TYPE_LIBRARY:
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          ": libraries are linked only from the server's toolkit, by name "
          "(standard_library \"cudadevrt\"); send your own library's members as "
          "LINK_INPUT_TYPE_OBJECT or _CUBIN inputs, which are checked before the linker "
          "reads them"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(what, ": unknown input type"));
  }
}

// "sm_90" -> "compute_90" (the device's virtual architecture: PTX, which the linker
// compiles for the device); anything else as it is.
std::string VirtualArchitecture(const std::string& target) {
  if (absl::StartsWith(target, "sm_")) return absl::StrCat("compute_", target.substr(3));
  return target;
}

}  // namespace

absl::StatusOr<v1::LinkModuleResponse> Session::LinkModule(const v1::LinkModuleRequest& request) {
  GPURPC_RETURN_IF_ERROR(fault());
  const int count = request.inputs_size();
  if (count == 0) {
    return absl::InvalidArgumentError(
        "LinkModule: no inputs; give sources, data or standard libraries to link");
  }
  if (count > kMaxLinkInputs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LinkModule: %d inputs, more than the %d one link may have", count, kMaxLinkInputs));
  }
  // Every input is checked before anything is compiled, read or linked.
  int sources = 0;
  std::vector<bool> add_rdc(count, false);
  std::set<std::string> libraries;
  for (int i = 0; i < count; ++i) {
    const v1::LinkInput& input = request.inputs(i);
    switch (input.input_case()) {
      case v1::LinkInput::kSource: {
        ++sources;
        if (input.source().source().empty()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the source is empty", i));
        }
        GPURPC_ASSIGN_OR_RETURN(const bool has_rdc,
                                HasRelocatableDeviceCode(i, input.source().options()));
        add_rdc[i] = !has_rdc;
        break;
      }
      case v1::LinkInput::kData: {
        const v1::LinkData& data = input.data();
        if (!ToBackendInputType(data.type())) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d has unknown input type %d; it must be one of "
                              "LINK_INPUT_TYPE_CUBIN, _PTX, _FATBINARY, _OBJECT or _LIBRARY",
                              i, static_cast<int>(data.type())));
        }
        if (data.data().empty()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the data is empty", i));
        }
        if (data.name().size() > static_cast<size_t>(kMaxLinkInputNameBytes)) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the name is %d bytes long, more than %d", i,
                              data.name().size(), kMaxLinkInputNameBytes));
        }
        if (data.name().find('\0') != std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the name contains a NUL byte", i));
        }
        GPURPC_RETURN_IF_ERROR(CheckLinkData(i, data));
        break;
      }
      case v1::LinkInput::kStandardLibrary: {
        const std::string& name = input.standard_library();
        if (name != "cudadevrt") {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: unknown standard library '%s'; the server links only "
              "'cudadevrt' (the device runtime) by name",
              i, absl::CHexEscape(name.substr(0, kMaxLinkInputNameBytes))));
        }
        if (!libraries.insert(name).second) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: standard library '%s' is named twice", i, name));
        }
        break;
      }
      case v1::LinkInput::INPUT_NOT_SET:
        return absl::InvalidArgumentError(absl::StrFormat(
            "LinkModule: input %d sets none of source, data and standard_library", i));
    }
  }
  if (sources > kMaxLinkSources) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LinkModule: %d sources, more than the %d one link may compile", sources, kMaxLinkSources));
  }
  if (sources > 0 && compiler_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "LinkModule: NVRTC is not available on this server: ", compiler_status_.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("modules", modules_.size(), limits_.max_modules,
                                            "max_modules_per_session"));
  }

  v1::LinkModuleResponse response;
  // Compiled images and library files, kept until the link is done (a deque: its elements
  // stay where they are as it grows).
  std::deque<std::string> owned;
  std::deque<std::vector<uint8_t>> images;
  uint64_t held_bytes = 0;
  for (const v1::LinkInput& input : request.inputs()) {
    if (input.input_case() == v1::LinkInput::kData) held_bytes += input.data().data().size();
  }
  std::vector<backend::LinkInput> inputs(count);
  const std::string include_dir =
      compiler_ != nullptr ? compiler_->cuda_include_dir() : "/usr/local/cuda/include";
  for (int i = 0; i < count; ++i) {
    const v1::LinkInput& input = request.inputs(i);
    backend::LinkInput& linked = inputs[i];
    const auto span_of = [](const std::string& bytes) {
      return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                       bytes.size());
    };
    switch (input.input_case()) {
      case v1::LinkInput::kSource: {
        const v1::LinkSource& source = input.source();
        compiler::CompileRequest creq;
        creq.source = source.source();
        creq.program_name = source.program_name();
        creq.options.assign(source.options().begin(), source.options().end());
        if (add_rdc[i]) creq.options.emplace_back("--relocatable-device-code=true");
        for (const v1::Header& header : source.headers()) {
          creq.headers.push_back(compiler::Header{header.name(), header.content()});
        }
        creq.name_expressions.assign(source.name_expressions().begin(),
                                     source.name_expressions().end());
        creq.target = VirtualArchitecture(context_->CompileTarget());
        creq.tenant = tenant();
        GPURPC_RETURN_IF_ERROR(BeginCompile());
        absl::StatusOr<compiler::CompileResult> compiled = compiler_->Compile(creq);
        EndCompile();
        if (!compiled.ok()) {
          return absl::Status(
              compiled.status().code(),
              absl::StrFormat("LinkModule: input %d: %s", i, compiled.status().message()));
        }
        v1::LinkSourceResult* result = response.add_sources();
        result->set_input_index(i);
        result->set_success(compiled->success);
        result->set_log(std::move(compiled->log));
        result->set_cache_hit(compiled->cache_hit);
        result->set_arch(compiled->arch);
        for (auto& option : compiled->effective_options) result->add_effective_options(option);
        for (auto& [expression, lowered] : compiled->lowered_names) {
          v1::LoweredName* name = result->add_lowered_names();
          name->set_name_expression(expression);
          name->set_lowered_name(lowered);
        }
        if (!compiled->success) {
          response.set_success(false);
          return response;
        }
        // What one link holds in this worker is bounded like one message: the compiled
        // images (a cache hit costs no compile time, so the bound must be on bytes) plus
        // the data inputs.
        held_bytes += compiled->image.size();
        if (held_bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: the compiled sources and data come to more than %d MiB, "
              "the most one link may hold; link fewer or smaller inputs",
              i, kMaxMessageBytes >> 20));
        }
        images.push_back(std::move(compiled->image));
        linked.type = absl::StartsWith(compiled->arch, "sm_") ? backend::LinkInputType::kCubin
                                                              : backend::LinkInputType::kPtx;
        linked.name = source.program_name().empty() ? "kernel.cu" : source.program_name();
        linked.data = absl::MakeConstSpan(images.back());
        break;
      }
      case v1::LinkInput::kData:
        linked.type = *ToBackendInputType(input.data().type());
        linked.name = input.data().name().empty() ? absl::StrCat("input", i) : input.data().name();
        linked.data = span_of(input.data().data());
        break;
      case v1::LinkInput::kStandardLibrary: {
        absl::StatusOr<std::string> library =
            compiler::ReadStandardLibrary(input.standard_library(), include_dir);
        if (!library.ok()) {
          return absl::Status(
              library.status().code(),
              absl::StrFormat("LinkModule: input %d: %s", i, library.status().message()));
        }
        owned.push_back(*std::move(library));
        linked.type = backend::LinkInputType::kLibrary;
        linked.name = absl::StrCat("lib", input.standard_library(), ".a");
        linked.data = span_of(owned.back());
        break;
      }
      case v1::LinkInput::INPUT_NOT_SET:
        break;  // refused above
    }
  }
  absl::StatusOr<backend::LinkedModule> linked =
      Check(context_->LinkModule(inputs, request.log_verbose()));
  if (!linked.ok()) {
    return absl::Status(linked.status().code(),
                        absl::StrCat("LinkModule: ", linked.status().message()));
  }
  const uint64_t footprint = linked->module->device_memory_bytes();
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, AddModule(std::move(linked->module)));
  response.set_success(true);
  response.set_log(std::move(linked->info_log));
  response.set_module_id(id);
  response.set_device_memory_bytes(footprint);
  return response;
}

absl::Status Session::UnloadModule(uint64_t module_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<ModuleEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = modules_.find(module_id);
    if (it == modules_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("UnloadModule: no module %d in this session", module_id));
    }
    entry = std::move(it->second);
    modules_.erase(it);
    for (const auto& [name, function_id] : entry->functions_by_name) functions_.erase(function_id);
    for (backend::DevicePtr address : entry->global_addresses) ranges_.erase(address);
  }
  // Launches still holding the entry keep the module loaded until they are enqueued.
  return absl::OkStatus();
}

absl::StatusOr<v1::GetFunctionResponse> Session::GetFunction(uint64_t module_id,
                                                             const std::string& name) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(CheckName("GetFunction", "name", name));
  std::shared_ptr<ModuleEntry> entry;
  v1::GetFunctionResponse response;
  {
    absl::MutexLock lock(&mu_);
    auto it = modules_.find(module_id);
    if (it == modules_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("GetFunction: no module %d in this session", module_id));
    }
    entry = it->second;
    auto known = entry->functions_by_name.find(name);
    if (known != entry->functions_by_name.end()) response.set_function_id(known->second);
  }
  // `entry` keeps the module, and so `function`, alive whatever UnloadModule does meanwhile.
  GPURPC_ASSIGN_OR_RETURN(backend::Function * function, Check(entry->module->GetFunction(name)));
  GPURPC_ASSIGN_OR_RETURN(const uint32_t packed_bytes, CheckParamLayout(name, function->params()));
  if (response.function_id() == 0) {
    auto function_entry = std::make_shared<FunctionEntry>();
    function_entry->function = function;
    function_entry->name = std::make_shared<const std::string>(name);
    function_entry->module = entry;
    function_entry->module_id = module_id;
    function_entry->packed_bytes = packed_bytes;
    absl::MutexLock lock(&mu_);
    // Unloaded while we looked: registering the function now would resurrect the module.
    auto it = modules_.find(module_id);
    if (it == modules_.end() || it->second != entry) {
      return absl::NotFoundError(absl::StrFormat(
          "GetFunction: module %d was unloaded while kernel '%s' was looked up", module_id, name));
    }
    auto [known, inserted] = entry->functions_by_name.emplace(name, 0);
    if (inserted) {
      known->second = NewIdLocked();
      functions_[known->second] = std::move(function_entry);
    }
    response.set_function_id(known->second);
  }
  for (const backend::ParamInfo& param : function->params()) {
    v1::ParamInfo* info = response.add_params();
    info->set_offset_bytes(param.offset_bytes);
    info->set_size_bytes(param.size_bytes);
  }
  std::shared_ptr<FunctionEntry> function_entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = functions_.find(response.function_id());
    if (it != functions_.end()) function_entry = it->second;
  }
  if (function_entry != nullptr) {
    FillAttributes(*function_entry, response.mutable_attributes());
  } else {  // unloaded meanwhile: the attributes it was loaded with
    FunctionEntry loaded;
    loaded.function = function;
    FillAttributes(loaded, response.mutable_attributes());
  }
  return response;
}

void Session::FillAttributes(const FunctionEntry& entry, v1::FunctionAttributes* out) {
  const backend::FunctionAttributes& attrs = entry.function->attributes();
  out->set_num_regs(attrs.num_regs);
  out->set_shared_size_bytes(attrs.shared_size_bytes);
  out->set_const_size_bytes(attrs.const_size_bytes);
  out->set_local_size_bytes(attrs.local_size_bytes);
  out->set_max_threads_per_block(attrs.max_threads_per_block);
  out->set_ptx_version(attrs.ptx_version);
  out->set_binary_version(attrs.binary_version);
  const int dynamic_shared = entry.max_dynamic_shared_bytes.load(std::memory_order_acquire);
  out->set_max_dynamic_shared_size_bytes(dynamic_shared >= 0 ? dynamic_shared
                                                             : attrs.max_dynamic_shared_size_bytes);
  out->set_preferred_shared_memory_carveout(entry.carveout.load(std::memory_order_acquire));
}

// ---------------------------------------------------------------- context configuration

uint64_t Session::StackReservationBytes(uint64_t stack_bytes) const {
  // As the front end's ledger counts local memory (SessionManager::ChargeLocalMemory):
  // multiprocessors x CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR (39), 2048 when
  // the device does not say.
  const backend::DeviceInfo& device = context_->device();
  auto it = device.attributes.find(39);
  const uint64_t per_multiprocessor =
      it != device.attributes.end() && it->second > 0 ? static_cast<uint64_t>(it->second) : 2048;
  const uint64_t threads =
      static_cast<uint64_t>(std::max(device.multiprocessor_count, 1)) * per_multiprocessor;
  return stack_bytes > UINT64_MAX / threads ? UINT64_MAX : stack_bytes * threads;
}

absl::StatusOr<v1::SetContextLimitResponse> Session::SetContextLimit(int limit_value,
                                                                     uint64_t value) {
  constexpr char kCall[] = "SetContextLimit";
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::ContextLimit limit, ToContextLimit(kCall, limit_value));
  const std::string name = LimitName(limit);
  const auto out_of_bounds = [&](uint64_t low, uint64_t high, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s = %d is outside %d..%d%s", kCall, name, value, low, high, why));
  };
  const backend::DeviceInfo& device = context_->device();
  switch (limit) {
    case backend::ContextLimit::kStackSize: {
      if (value == 0 || value > kMaxStackBytesPerThread) {
        return out_of_bounds(1, kMaxStackBytesPerThread, " (bytes of stack per GPU thread)");
      }
      const uint64_t reservation = StackReservationBytes(value);
      if (reservation > kMaxStackReservationBytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s = %d bytes per thread makes the driver reserve %s of device memory (for "
            "each of the device's %d resident threads), more than the %s gpurpc allows; at "
            "most %d bytes per thread on this device",
            kCall, name, value, Bytes(reservation), StackReservationBytes(1),
            Bytes(kMaxStackReservationBytes),
            kMaxStackReservationBytes / std::max<uint64_t>(StackReservationBytes(1), 1)));
      }
      break;
    }
    case backend::ContextLimit::kPrintfFifoSize:
      if (value == 0 || value > kMaxPrintfFifoBytes) {
        return out_of_bounds(1, kMaxPrintfFifoBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kMallocHeapSize:
      if (value == 0 || value > kMaxMallocHeapBytes) {
        return out_of_bounds(1, kMaxMallocHeapBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kDevRuntimeSyncDepth:
      if (value > kMaxDevRuntimeSyncDepth) return out_of_bounds(0, kMaxDevRuntimeSyncDepth, "");
      break;
    case backend::ContextLimit::kDevRuntimePendingLaunchCount:
      if (value == 0 || value > kMaxDevRuntimePendingLaunchCount) {
        return out_of_bounds(1, kMaxDevRuntimePendingLaunchCount, "");
      }
      break;
    case backend::ContextLimit::kMaxL2FetchGranularity:
      if (value > kMaxL2FetchGranularityBytes) {
        return out_of_bounds(0, kMaxL2FetchGranularityBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kPersistingL2CacheSize: {
      // CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE (108); 0 when the device has none.
      auto it = device.attributes.find(108);
      const uint64_t max =
          it != device.attributes.end() && it->second > 0 ? static_cast<uint64_t>(it->second) : 0;
      if (value > max) {
        return out_of_bounds(0, max, " (bytes; the device's max persisting L2 cache size)");
      }
      break;
    }
  }

  const bool reserves = limit == backend::ContextLimit::kStackSize ||
                        limit == backend::ContextLimit::kPrintfFifoSize ||
                        limit == backend::ContextLimit::kMallocHeapSize;
  absl::MutexLock limits_lock(&limits_mu_);
  // The three reservations at the values they will have.
  const auto reservation_with = [&](uint64_t* total) -> absl::Status {
    uint64_t sum = 0;
    for (backend::ContextLimit each :
         {backend::ContextLimit::kStackSize, backend::ContextLimit::kPrintfFifoSize,
          backend::ContextLimit::kMallocHeapSize}) {
      uint64_t current = value;
      if (each != limit) {
        GPURPC_ASSIGN_OR_RETURN(current, Check(context_->GetLimit(each)));
      }
      const uint64_t bytes =
          each == backend::ContextLimit::kStackSize ? StackReservationBytes(current) : current;
      sum = bytes > UINT64_MAX - sum ? UINT64_MAX : sum + bytes;
    }
    *total = sum;
    return absl::OkStatus();
  };
  if (reserves) {
    uint64_t quota = 0;
    {
      absl::MutexLock lock(&mu_);
      quota = limits_.max_device_memory_bytes;
    }
    uint64_t total = 0;
    GPURPC_RETURN_IF_ERROR(reservation_with(&total));
    if (quota > 0 && total > quota) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: %s = %d would make the driver reserve %s for the context's stack, printf FIFO "
          "and malloc heap together, more than the tenant's max_device_memory_bytes quota of "
          "%s",
          kCall, name, value, Bytes(total), Bytes(quota)));
    }
  }
  GPURPC_RETURN_IF_ERROR(Check(context_->SetLimit(limit, value)));
  v1::SetContextLimitResponse response;
  GPURPC_ASSIGN_OR_RETURN(const uint64_t now, Check(context_->GetLimit(limit)));
  response.set_value(now);
  uint64_t reserved = 0;
  for (backend::ContextLimit each :
       {backend::ContextLimit::kStackSize, backend::ContextLimit::kPrintfFifoSize,
        backend::ContextLimit::kMallocHeapSize}) {
    GPURPC_ASSIGN_OR_RETURN(const uint64_t current, Check(context_->GetLimit(each)));
    const uint64_t bytes =
        each == backend::ContextLimit::kStackSize ? StackReservationBytes(current) : current;
    reserved = bytes > UINT64_MAX - reserved ? UINT64_MAX : reserved + bytes;
  }
  response.set_reserved_device_bytes(reserved);
  return response;
}

absl::StatusOr<uint64_t> Session::GetContextLimit(int limit_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::ContextLimit limit,
                          ToContextLimit("GetContextLimit", limit_value));
  return Check(context_->GetLimit(limit));
}

absl::Status Session::SetCacheConfig(int config_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config,
                          ToCacheConfig("SetCacheConfig", config_value));
  return Check(context_->SetCacheConfig(config));
}

absl::StatusOr<int> Session::GetCacheConfig() {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config, Check(context_->GetCacheConfig()));
  return static_cast<int>(config);
}

absl::Status Session::SetSharedConfig(int config, uint64_t function_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (!v1::SharedConfig_IsValid(config)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SetSharedConfig: config %d is not a SharedConfig (0 = DEFAULT_BANK_SIZE, "
                        "1 = FOUR_BYTE_BANK_SIZE, 2 = EIGHT_BYTE_BANK_SIZE)",
                        config));
  }
  if (function_id != 0) GPURPC_RETURN_IF_ERROR(FindFunction(function_id).status());
  // cuCtxSetSharedMemConfig / cuFuncSetSharedMemConfig are deprecated, and on the devices
  // CUDA 13 supports (compute capability 7.5 and later) the bank width is fixed: the driver
  // does nothing ("This function will do nothing on devices with fixed shared memory bank
  // size", cuda.h). Nor does gpurpc.
  return absl::OkStatus();
}

absl::StatusOr<int> Session::GetSharedConfig() {
  GPURPC_RETURN_IF_ERROR(fault());
  // What cuCtxGetSharedMemConfig answers on a device with a fixed bank width.
  return static_cast<int>(v1::SHARED_CONFIG_FOUR_BYTE_BANK_SIZE);
}

absl::StatusOr<v1::SetFunctionAttributeResponse> Session::SetFunctionAttribute(uint64_t function_id,
                                                                               int attribute,
                                                                               int64_t value) {
  constexpr char kCall[] = "SetFunctionAttribute";
  GPURPC_RETURN_IF_ERROR(fault());
  if (!v1::FunctionAttribute_IsValid(attribute)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: attribute %d is not a FunctionAttribute (8 = MAX_DYNAMIC_SHARED_SIZE_BYTES and "
        "9 = PREFERRED_SHARED_MEMORY_CARVEOUT can be set)",
        kCall, attribute));
  }
  const std::string name =
      v1::FunctionAttribute_Name(static_cast<v1::FunctionAttribute>(attribute));
  if (attribute != v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
      attribute != v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s is read-only (only FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and "
        "FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT can be set)",
        kCall, name));
  }
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<FunctionEntry> entry, FindFunction(function_id));
  backend::FunctionAttribute backend_attribute;
  if (attribute == v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    const backend::DeviceInfo& device = context_->device();
    const int64_t optin = std::max(device.max_shared_memory_per_block_optin_bytes,
                                   device.max_shared_memory_per_block_bytes);
    const int64_t max =
        std::max<int64_t>(0, optin - entry->function->attributes().shared_size_bytes);
    if (value < 0 || value > max) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s = %d for kernel '%s' is outside 0..%d (the device's %d bytes of shared "
          "memory per block with opt-in, minus the kernel's %d bytes of static shared memory)",
          kCall, name, value, *entry->name, max, optin,
          entry->function->attributes().shared_size_bytes));
    }
    backend_attribute = backend::FunctionAttribute::kMaxDynamicSharedSizeBytes;
  } else {
    if (value < -1 || value > 100) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s = %d for kernel '%s' is outside -1..100 (percent of the maximum shared "
          "memory; -1 = no preference)",
          kCall, name, value, *entry->name));
    }
    backend_attribute = backend::FunctionAttribute::kPreferredSharedMemoryCarveout;
  }
  GPURPC_RETURN_IF_ERROR(Check(
      context_->SetFunctionAttribute(entry->function, backend_attribute, static_cast<int>(value))));
  if (backend_attribute == backend::FunctionAttribute::kMaxDynamicSharedSizeBytes) {
    entry->max_dynamic_shared_bytes.store(static_cast<int>(value), std::memory_order_release);
  } else {
    entry->carveout.store(static_cast<int>(value), std::memory_order_release);
  }
  v1::SetFunctionAttributeResponse response;
  FillAttributes(*entry, response.mutable_attributes());
  return response;
}

absl::Status Session::SetFunctionCacheConfig(uint64_t function_id, int config_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config,
                          ToCacheConfig("SetFunctionCacheConfig", config_value));
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<FunctionEntry> entry, FindFunction(function_id));
  return Check(context_->SetFunctionCacheConfig(entry->function, config));
}

absl::StatusOr<v1::GetGlobalResponse> Session::GetGlobal(uint64_t module_id,
                                                         const std::string& name) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(CheckName("GetGlobal", "name", name));
  std::shared_ptr<ModuleEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = modules_.find(module_id);
    if (it == modules_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("GetGlobal: no module %d in this session", module_id));
    }
    entry = it->second;
  }
  GPURPC_ASSIGN_OR_RETURN(backend::Module::Global global, Check(entry->module->GetGlobal(name)));
  {
    // Register the global as a device range so that memory calls can address it; never
    // for a module unloaded meanwhile (its globals are gone with it).
    absl::MutexLock lock(&mu_);
    auto it = modules_.find(module_id);
    if (it == modules_.end() || it->second != entry) {
      return absl::NotFoundError(absl::StrFormat(
          "GetGlobal: module %d was unloaded while global '%s' was looked up", module_id, name));
    }
    if (global.size_bytes > 0 &&
        ranges_.emplace(global.address, Range{0, global.size_bytes}).second) {
      entry->global_addresses.push_back(global.address);
    }
  }
  v1::GetGlobalResponse response;
  response.set_device_address(global.address);
  response.set_size_bytes(global.size_bytes);
  return response;
}

// ---------------------------------------------------------------------------- execution

absl::StatusOr<std::shared_ptr<backend::Stream>> Session::FindStream(uint64_t stream_id) {
  if (stream_id == 0) return std::shared_ptr<backend::Stream>();
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream_id);
  if (it == streams_.end()) {
    return absl::NotFoundError(absl::StrFormat("no stream %d in this session", stream_id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<backend::Event>> Session::FindEvent(uint64_t event_id) {
  absl::MutexLock lock(&mu_);
  auto it = events_.find(event_id);
  if (it == events_.end()) {
    return absl::NotFoundError(absl::StrFormat("no event %d in this session", event_id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Session::FunctionEntry>> Session::FindFunction(
    uint64_t function_id) {
  absl::MutexLock lock(&mu_);
  auto it = functions_.find(function_id);
  if (it == functions_.end()) {
    return absl::NotFoundError(absl::StrFormat("no function %d in this session", function_id));
  }
  return it->second;
}

absl::StatusOr<uint64_t> Session::CreateStream(bool non_blocking) {
  GPURPC_RETURN_IF_ERROR(fault());
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("streams", streams_.size(), limits_.max_streams,
                                            "max_streams_per_session"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> stream,
                          Check(context_->CreateStream(non_blocking)));
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(
      CheckCountLocked("streams", streams_.size(), limits_.max_streams, "max_streams_per_session"));
  const uint64_t id = NewIdLocked();
  streams_[id] = std::move(stream);
  stream_captures_[id] = NewStreamCapture(/*blocking=*/!non_blocking);
  return id;
}

absl::Status Session::DestroyStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<backend::Stream> stream;
  {
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(stream_id);
    if (it == streams_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("DestroyStream: no stream %d in this session%s", stream_id,
                          stream_id == 0 ? " (the default stream cannot be destroyed)" : ""));
    }
    stream = std::move(it->second);
    streams_.erase(it);
  }
  AbandonCapture(stream_id, stream.get());
  return absl::OkStatus();
}

absl::Status Session::SynchronizeStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "SynchronizeStream"));
  return Check(context_->SynchronizeStream(stream.get()));
}

absl::StatusOr<bool> Session::QueryStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "QueryStream"));
  return Check(context_->QueryStream(stream.get()));
}

absl::Status Session::Synchronize() {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(RefuseWhileAnyCaptures("SynchronizeSession"));
  return Check(context_->Synchronize());
}

absl::StatusOr<uint64_t> Session::CreateEvent(bool disable_timing, bool blocking_sync) {
  GPURPC_RETURN_IF_ERROR(fault());
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(
        CheckCountLocked("events", events_.size(), limits_.max_events, "max_events_per_session"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Event> event,
                          Check(context_->CreateEvent(disable_timing, blocking_sync)));
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(
      CheckCountLocked("events", events_.size(), limits_.max_events, "max_events_per_session"));
  const uint64_t id = NewIdLocked();
  events_[id] = std::move(event);
  return id;
}

absl::Status Session::DestroyEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<backend::Event> event;
  {
    absl::MutexLock lock(&mu_);
    auto it = events_.find(event_id);
    if (it == events_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("DestroyEvent: no event %d in this session", event_id));
    }
    event = std::move(it->second);
    events_.erase(it);
  }
  // Destroyed here, outside mu_ (a backend call), unless a call in flight still uses it.
  return absl::OkStatus();
}

absl::Status Session::RecordEvent(uint64_t event_id, uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "RecordEvent"));
  return Check(context_->RecordEvent(event.get(), stream.get()));
}

absl::StatusOr<bool> Session::QueryEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  return Check(context_->QueryEvent(event.get()));
}

absl::Status Session::SynchronizeEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  return Check(context_->SynchronizeEvent(event.get()));
}

absl::StatusOr<float> Session::ElapsedTime(uint64_t start_event_id, uint64_t end_event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto start, FindEvent(start_event_id));
  GPURPC_ASSIGN_OR_RETURN(auto end, FindEvent(end_event_id));
  return Check(context_->ElapsedTime(start.get(), end.get()));
}

absl::Status Session::StreamWaitEvent(uint64_t stream_id, uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "StreamWaitEvent"));
  return Check(context_->StreamWaitEvent(stream.get(), event.get()));
}

absl::Status Session::CheckLaunchDims(const FunctionEntry& entry, const v1::LaunchCommand& launch,
                                      backend::LaunchConfig* config) const {
  const backend::DeviceInfo& device = context_->device();
  GPURPC_RETURN_IF_ERROR(CheckDim("grid", launch.grid(), device.max_grid_dim, &config->grid));
  GPURPC_RETURN_IF_ERROR(CheckDim("block", launch.block(), device.max_block_dim, &config->block));
  const uint64_t threads = uint64_t{config->block.x} * config->block.y * config->block.z;
  int limit = device.max_threads_per_block;
  const int function_limit = entry.function->attributes().max_threads_per_block;
  if (function_limit > 0 && (limit <= 0 || function_limit < limit)) limit = function_limit;
  if (limit > 0 && threads > static_cast<uint64_t>(limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kernel '%s': a block of %d threads exceeds the limit of %d threads per block", *entry.name,
        threads, limit));
  }
  const uint64_t shared =
      uint64_t{launch.shared_memory_bytes()} + entry.function->attributes().shared_size_bytes;
  const int shared_limit = std::max(device.max_shared_memory_per_block_optin_bytes,
                                    device.max_shared_memory_per_block_bytes);
  if (shared_limit > 0 && shared > static_cast<uint64_t>(shared_limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kernel '%s': %d bytes of dynamic shared memory plus %d static exceed the device "
        "limit of %d bytes per block",
        *entry.name, launch.shared_memory_bytes(), entry.function->attributes().shared_size_bytes,
        shared_limit));
  }
  config->shared_memory_bytes = launch.shared_memory_bytes();
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const uint8_t>> Session::PackArgs(const FunctionEntry& entry,
                                                            const v1::LaunchCommand& launch,
                                                            std::vector<uint8_t>* scratch) {
  const std::vector<backend::ParamInfo>& params = entry.function->params();
  const std::string& kernel = *entry.name;
  const uint64_t expected = entry.packed_bytes;
  if (launch.args_size() > 0 && !launch.packed_args().empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kernel '%s': give either packed_args or typed args, not both", kernel));
  }
  if (launch.args_size() == 0) {
    if (launch.packed_args().size() != expected) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "kernel '%s' takes %d parameters in %d bytes (%s); the packed arguments are %d "
          "bytes",
          kernel, params.size(), expected, DescribeParams(params), launch.packed_args().size()));
    }
    // The blob is used where it lies: no copy on the launch path.
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(launch.packed_args().data()),
                                     expected);
  }
  if (static_cast<size_t>(launch.args_size()) != params.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kernel '%s' takes %d parameters (%s); %d arguments were given", kernel,
                        params.size(), DescribeParams(params), launch.args_size()));
  }
  std::vector<uint8_t>* packed = scratch;
  packed->assign(expected, 0);
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < launch.args_size(); ++i) {
    const v1::KernelArg& arg = launch.args(i);
    const backend::ParamInfo& param = params[i];
    const uint32_t size = ArgSize(arg);
    if (size != param.size_bytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("kernel '%s' parameter #%d: expected %d bytes, given %d bytes (%s)",
                          kernel, i, param.size_bytes, size, ArgKind(arg)));
    }
    // CheckParamLayout saw to this when the function was looked up; whatever the layout,
    // nothing is ever written outside `packed`.
    if (uint64_t{param.offset_bytes} + size > packed->size()) {
      return absl::InternalError(absl::StrFormat(
          "kernel '%s' parameter #%d: %d bytes at offset %d lie outside the %d-byte parameter "
          "block",
          kernel, i, size, param.offset_bytes, packed->size()));
    }
    uint8_t* out = packed->data() + param.offset_bytes;
    uint64_t u64 = 0;
    switch (arg.value_case()) {
      case v1::KernelArg::kU8:
      case v1::KernelArg::kU16: {
        const uint32_t value = arg.value_case() == v1::KernelArg::kU8 ? arg.u8() : arg.u16();
        const uint32_t max = size == 1 ? 0xFFu : 0xFFFFu;
        if (value > max) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "kernel '%s' parameter #%d: %s value %d does not fit in %d bits (0 to %d); give "
              "a negative value as its %d-bit two's complement, e.g. %d for -1",
              kernel, i, ArgKind(arg), value, size * 8, max, size * 8, max));
        }
        u64 = value;
        break;
      }
      case v1::KernelArg::kU32:
        u64 = arg.u32();
        break;
      case v1::KernelArg::kU64:
        u64 = arg.u64();
        break;
      case v1::KernelArg::kDeviceAddress:
        u64 = arg.device_address();
        break;
      case v1::KernelArg::kF32: {
        const float f = arg.f32();
        std::memcpy(out, &f, 4);
        continue;
      }
      case v1::KernelArg::kF64: {
        const double d = arg.f64();
        std::memcpy(out, &d, 8);
        continue;
      }
      case v1::KernelArg::kBuffer: {
        v1::DevicePointer pointer;
        *pointer.mutable_buffer() = arg.buffer();
        auto address = ResolveLocked(pointer, 0, "kernel argument");
        if (!address.ok()) {
          return absl::Status(address.status().code(),
                              absl::StrFormat("kernel '%s' parameter #%d: %s", kernel, i,
                                              address.status().message()));
        }
        u64 = *address;
        break;
      }
      case v1::KernelArg::kRaw:
        std::memcpy(out, arg.raw().data(), size);
        continue;
      default:
        return absl::InvalidArgumentError(
            absl::StrFormat("kernel '%s' parameter #%d: argument not set", kernel, i));
    }
    // Little-endian integer of `size` bytes (x86-64 and aarch64 hosts and the GPU agree).
    std::memcpy(out, &u64, size);
  }
  return absl::Span<const uint8_t>(packed->data(), packed->size());
}

absl::Status Session::Launch(const v1::LaunchCommand& launch) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<FunctionEntry> entry, FindFunction(launch.function_id()));
  backend::LaunchConfig config;
  GPURPC_RETURN_IF_ERROR(CheckLaunchDims(*entry, launch, &config));
  thread_local std::vector<uint8_t> scratch;
  GPURPC_ASSIGN_OR_RETURN(absl::Span<const uint8_t> packed, PackArgs(*entry, launch, &scratch));
  return EnqueueCapturable(
      launch.stream_id(), "Launch",
      [&] {
        GraphNodeRecord node;
        node.type = v1::GRAPH_NODE_TYPE_KERNEL;
        node.function = entry;
        node.function_id = launch.function_id();
        node.config = config;
        node.cost_bytes = packed.size();
        return node;
      },
      [&](backend::Stream* stream, bool capturing) -> absl::Status {
        GPURPC_RETURN_IF_ERROR(Check(context_->Launch(entry->function, config, packed, stream)));
        // Every launch, unary or in a command batch, comes through here. A captured one
        // runs only as part of a graph launch, which is watched instead.
        if (Watchdog* watchdog = watchdog_ptr_.load(std::memory_order_acquire);
            watchdog != nullptr && !capturing) {
          watchdog->OnLaunch(launch.stream_id(), stream, entry->name);
        }
        return absl::OkStatus();
      });
}

// ---------------------------------------------------------------------------- commands

absl::Status Session::RunCommand(const v1::Command& command, v1::CommandReply* reply,
                                 uint64_t* download_bytes) {
  switch (command.kind_case()) {
    case v1::Command::kLaunch:
      return Launch(command.launch());
    case v1::Command::kMemset:
      return Memset(command.memset());
    case v1::Command::kCopy:
      return Copy(command.copy());
    case v1::Command::kUpload: {
      const v1::UploadCommand& upload = command.upload();
      if (upload.data().size() > kMaxInlineBytes) {
        return absl::InvalidArgumentError(
            absl::StrFormat("UploadCommand: %d bytes exceed the inline limit of %d; split it",
                            upload.data().size(), kMaxInlineBytes));
      }
      GPURPC_ASSIGN_OR_RETURN(
          backend::DevicePtr address,
          Resolve(upload.destination(), upload.data().size(), "UploadCommand destination"));
      return Upload(address, upload.data().data(), upload.data().size(), upload.stream_id());
    }
    case v1::Command::kDownload: {
      const v1::DownloadCommand& download = command.download();
      if (download.size_bytes() > kMaxBatchDownloadBytes - *download_bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "DownloadCommand: the batch's downloads exceed %d bytes; use DownloadStream",
            kMaxBatchDownloadBytes));
      }
      GPURPC_ASSIGN_OR_RETURN(
          backend::DevicePtr address,
          Resolve(download.source(), download.size_bytes(), "DownloadCommand source"));
      v1::DownloadResult* result = reply->add_downloads();
      result->set_sequence(command.sequence());
      std::string* data = result->mutable_data();
      data->resize(download.size_bytes());
      *download_bytes += download.size_bytes();
      return Download(address, data->data(), data->size(), download.stream_id());
    }
    case v1::Command::kRecordEvent:
      return RecordEvent(command.record_event().event_id(), command.record_event().stream_id());
    case v1::Command::kWaitEvent:
      return StreamWaitEvent(command.wait_event().stream_id(), command.wait_event().event_id());
    case v1::Command::kSync:
      return command.sync().whole_session() ? Synchronize()
                                            : SynchronizeStream(command.sync().stream_id());
    case v1::Command::kRegionCopy:
      return CopyHostRegion(command.region_copy());
    case v1::Command::kLaunchGraph:
      return LaunchGraph(command.launch_graph());
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("command %d: no command kind set", command.sequence()));
  }
}

absl::Status Session::RunBatch(const v1::CommandBatch& batch, uint64_t* last_sequence,
                               v1::CommandReply* reply) {
  // Every sequence number of the batch first, the skipped ones included: a batch whose
  // numbers do not increase runs nothing, and the last number seen only grows.
  uint64_t previous = *last_sequence;
  for (const v1::Command& command : batch.commands()) {
    if (command.sequence() <= previous) {
      return absl::InvalidArgumentError(
          absl::StrFormat("command stream: sequence %d does not increase (last was %d)",
                          command.sequence(), previous));
    }
    previous = command.sequence();
  }
  uint64_t download_bytes = 0;
  for (int i = 0; i < batch.commands_size(); ++i) {
    const v1::Command& command = batch.commands(i);
    *last_sequence = command.sequence();
    absl::Status status = RunCommand(command, reply, &download_bytes);
    if (!status.ok()) {
      v1::CommandError* error = reply->mutable_error();
      error->set_sequence(command.sequence());
      error->set_code(static_cast<int32_t>(status.code()));
      error->set_message(std::string(status.message()));
      if (i + 1 < batch.commands_size()) {
        reply->set_skipped_from_sequence(batch.commands(i + 1).sequence());
        *last_sequence = batch.commands(batch.commands_size() - 1).sequence();
      }
      if (command.kind_case() == v1::Command::kDownload && !reply->downloads().empty() &&
          reply->downloads().rbegin()->sequence() == command.sequence()) {
        reply->mutable_downloads()->RemoveLast();
      }
      reply->set_processed_through_sequence(command.sequence());
      if (IsSticky(status)) return status;
      return absl::OkStatus();
    }
  }
  reply->set_processed_through_sequence(*last_sequence);
  return absl::OkStatus();
}

std::string Session::TakeDeviceOutput() {
  return device_output_ != nullptr ? device_output_->Take() : std::string();
}

}  // namespace gpurpc::worker
