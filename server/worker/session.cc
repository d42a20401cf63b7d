#include "server/worker/session.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/array_shape.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/worker/device_output.h"

namespace gpurpc::worker {
namespace {

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
  decltype(functions_)::Map functions;
  decltype(modules_)::Map modules;
  decltype(events_)::Map events;
  decltype(retained_events_) retained_events;
  decltype(streams_)::Map streams;
  decltype(arrays_)::Map arrays;
  decltype(buffers_)::Map buffers;
  absl::flat_hash_set<backend::DevicePtr> opened;
  decltype(regions_)::Map regions;
  {
    absl::MutexLock lock(&mu_);
    regions = regions_.TakeAll();
    watchdog = std::move(watchdog_);
    functions = functions_.TakeAll();
    modules = modules_.TakeAll();
    events = events_.TakeAll();
    retained_events = std::move(retained_events_);
    retained_events_.clear();
    event_ipc_.clear();
    streams = streams_.TakeAll();
    arrays = arrays_.TakeAll();
    buffers = buffers_.TakeAll();
    opened = std::move(opened_);
    opened_.clear();
    ranges_.clear();
  }
  // Dependency order, outside mu_ (each is a backend call).
  watchdog.reset();
  functions.clear();
  modules.clear();
  events.clear();
  retained_events.clear();
  streams.clear();
  // Each waits for the context's queued work, then unpins and unmaps.
  regions.clear();
  arrays.clear();
  for (const auto& [id, address] : buffers) {
    // The context is going away; a failure here frees nothing less.
    absl::Status status =
        opened.contains(address) ? context_->CloseExportedMemory(address) : context_->Free(address);
    (void)status;
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
  sizes.arrays = arrays_.size();
  sizes.ranges = ranges_.size();
  sizes.modules = modules_.size();
  sizes.functions = functions_.size();
  sizes.streams = streams_.size();
  sizes.events = events_.size() + retained_events_.size();
  sizes.regions = regions_.size();
  sizes.graphs = graphs_.size();
  sizes.graph_execs = graph_execs_.size();
  return sizes;
}

uint64_t Session::NewIdLocked() {
  for (;;) {
    const uint64_t id = ids_.Next();
    if (!buffers_.contains(id) && !modules_.contains(id) && !functions_.contains(id) &&
        !streams_.contains(id) && !events_.contains(id) && !retained_events_.contains(id) &&
        !regions_.contains(id) && !graphs_.contains(id) && !graph_execs_.contains(id)) {
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

absl::Status Session::RecordFault(absl::Status status) {
  if (status.ok() || !IsStickyFault(status)) return status;
  {
    absl::MutexLock lock(&mu_);
    if (fault_.ok()) {
      // The call that observes the fault reports it as it is (ABORTED or DATA_LOSS).
      fault_ = status;
      faulted_.store(true, std::memory_order_release);
    } else {
      // Built here, under mu_: fault() takes mu_ itself (a second sticky fault used to call
      // it with mu_ held, and a worker deadlocked on its own lock).
      return FaultLocked();
    }
  }
  if (on_fault_) on_fault_(status);
  return status;
}

absl::Status Session::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return FaultLocked();
}

absl::Status Session::FaultLocked() const {
  // Every call after the observing one: the session is unusable, retrying cannot help.
  return absl::FailedPreconditionError(
      absl::StrCat("the session FAULTED earlier: ", fault_.message()));
}

// ---------------------------------------------------------------------------- memory

absl::StatusOr<v1::BufferInfo> Session::Allocate(uint64_t size_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (size_bytes == 0) return absl::InvalidArgumentError("Allocate: size_bytes must be > 0");
  GPURPC_ASSIGN_OR_RETURN(backend::DevicePtr address, RecordFault(context_->Alloc(size_bytes)));
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = NewIdLocked();
    buffers_.Insert(id, address);
    ranges_[address] = Range{id, size_bytes};
  }
  v1::BufferInfo info;
  info.set_buffer_id(id);
  info.set_device_address(address);
  info.set_size_bytes(size_bytes);
  return info;
}

absl::StatusOr<v1::BufferInfo> Session::AllocateArray(const v1::ArrayDescriptor& descriptor) {
  GPURPC_RETURN_IF_ERROR(fault());
  const auto refuse = [](const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: ", status.message()));
  };
  absl::StatusOr<uint64_t> charged =
      ArrayChargeBytes(descriptor.width(), descriptor.height(), descriptor.depth(),
                       descriptor.format(), descriptor.num_channels(), descriptor.flags());
  if (!charged.ok()) return refuse(charged.status());
  backend::ArrayShape shape;
  shape.width = descriptor.width();
  shape.height = descriptor.height();
  shape.depth = descriptor.depth();
  shape.format = descriptor.format();
  shape.num_channels = descriptor.num_channels();
  shape.flags = descriptor.flags();
  shape.element_bytes = *ArrayElementBytes(shape.format, shape.num_channels);
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Array> array,
                          RecordFault(context_->CreateArray(shape)));
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = NewIdLocked();
    arrays_.Insert(id, ArrayEntry{std::move(array), shape, *charged});
  }
  v1::BufferInfo info;
  info.set_buffer_id(id);
  info.set_size_bytes(*charged);
  *info.mutable_array() = descriptor;
  return info;
}

absl::Status Session::Free(uint64_t buffer_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  backend::DevicePtr address;
  bool opened = false;
  {
    absl::MutexLock lock(&mu_);
    if (arrays_.contains(buffer_id)) {
      // Destroyed when the last copy using it lets go (cuArrayDestroy, after queued work).
      GPURPC_RETURN_IF_ERROR(arrays_.Take(buffer_id, "Free").status());
      return absl::OkStatus();
    }
    GPURPC_ASSIGN_OR_RETURN(address, buffers_.Take(buffer_id, "Free"));
    ranges_.erase(address);
    opened = opened_.erase(address) != 0;
  }
  if (opened) return RecordFault(context_->CloseExportedMemory(address));
  return RecordFault(context_->Free(address));
}

absl::StatusOr<Session::ExportedMemory> Session::ExportMemory(uint64_t buffer_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  backend::DevicePtr address;
  ExportedMemory exported;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(address, buffers_.Find(buffer_id, "ExportMemory"));
    if (opened_.contains(address)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ExportMemory: buffer %d was opened from another session's export; export the "
          "original there",
          buffer_id));
    }
    exported.size_bytes = ranges_.at(address).size_bytes;
  }
  GPURPC_ASSIGN_OR_RETURN(exported.ipc_handle, RecordFault(context_->ExportMemory(address)));
  return exported;
}

absl::StatusOr<v1::BufferInfo> Session::OpenExportedMemory(const std::string& ipc_handle,
                                                           uint64_t size_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("OpenMemoryHandle: the export's size must be > 0");
  }
  GPURPC_ASSIGN_OR_RETURN(const backend::DevicePtr address,
                          RecordFault(context_->OpenExportedMemory(ipc_handle)));
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = NewIdLocked();
    buffers_.Insert(id, address);
    ranges_[address] = Range{id, size_bytes};
    opened_.insert(address);
  }
  v1::BufferInfo info;
  info.set_buffer_id(id);
  info.set_device_address(address);
  info.set_size_bytes(size_bytes);
  return info;
}

absl::StatusOr<v1::BufferInfo> Session::GetAllocation(const v1::GetAllocationRequest& request) {
  absl::MutexLock lock(&mu_);
  v1::BufferInfo info;
  if (request.target_case() == v1::GetAllocationRequest::kBufferId &&
      arrays_.contains(request.buffer_id())) {
    const ArrayEntry& entry = *arrays_.Lookup(request.buffer_id());
    info.set_buffer_id(request.buffer_id());
    info.set_size_bytes(entry.charged_bytes);
    v1::ArrayDescriptor* descriptor = info.mutable_array();
    descriptor->set_width(entry.shape.width);
    descriptor->set_height(entry.shape.height);
    descriptor->set_depth(entry.shape.depth);
    descriptor->set_format(static_cast<v1::ArrayFormat>(entry.shape.format));
    descriptor->set_num_channels(entry.shape.num_channels);
    descriptor->set_flags(entry.shape.flags);
    return info;
  }
  if (request.target_case() == v1::GetAllocationRequest::kBufferId) {
    GPURPC_ASSIGN_OR_RETURN(const backend::DevicePtr address,
                            buffers_.Find(request.buffer_id(), "GetAllocation"));
    info.set_buffer_id(request.buffer_id());
    info.set_device_address(address);
    info.set_size_bytes(ranges_.at(address).size_bytes);
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
  return RecordFault(context_->GetMemInfo());
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
    GPURPC_ASSIGN_OR_RETURN(base, buffers_.Find(pointer.buffer().buffer_id(), what));
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
  const absl::Span<const uint8_t> piece(static_cast<const uint8_t*>(data), size_bytes);
  return Upload(address, absl::MakeConstSpan(&piece, 1), size_bytes, stream_id);
}

absl::Status Session::Upload(backend::DevicePtr address,
                             absl::Span<const absl::Span<const uint8_t>> pieces,
                             uint64_t size_bytes, uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  // The stream is checked even when there is nothing to copy: an unknown id is NOT_FOUND.
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  if (size_bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "Upload"));
  return RecordFault(context_->UploadPieces(address, pieces, stream.get()));
}

absl::Status Session::Download(backend::DevicePtr address, void* data, uint64_t size_bytes,
                               uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "Download"));
  if (size_bytes == 0) return RecordFault(context_->SynchronizeStream(stream.get()));
  return RecordFault(context_->Download(data, address, size_bytes, stream.get()));
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
        return RecordFault(
            context_->Memset(address, command.value(), element, command.count(), stream));
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
        return RecordFault(context_->CopyDeviceToDevice(dst, src, command.size_bytes(), stream));
      });
}

namespace {

// a * b, or nullopt when it overflows.
std::optional<uint64_t> Mul(uint64_t a, uint64_t b) {
  uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

}  // namespace

absl::StatusOr<Session::Copy3DSide> Session::ResolveCopy3DEnd(const v1::Copy3DEndpoint& endpoint,
                                                              const v1::Copy3DCommand& command,
                                                              const char* what) {
  const uint64_t width = command.width_bytes();
  const uint64_t height = command.height();
  const uint64_t depth = command.depth();
  const bool empty = width == 0 || height == 0 || depth == 0;
  Copy3DSide side;
  if (endpoint.target_case() == v1::Copy3DEndpoint::kArrayId) {
    if (endpoint.pitch_bytes() != 0 || endpoint.height() != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: pitch_bytes and height describe linear memory; an array has its own layout", what));
    }
    ArrayEntry entry;
    {
      absl::MutexLock lock(&mu_);
      GPURPC_ASSIGN_OR_RETURN(entry, arrays_.Find(endpoint.array_id(), what));
    }
    const backend::ArrayShape& shape = entry.shape;
    if (endpoint.x_bytes() % shape.element_bytes != 0 || width % shape.element_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: x_bytes %d and width_bytes %d must be multiples of the array's element size %d "
          "bytes",
          what, endpoint.x_bytes(), width, shape.element_bytes));
    }
    if (!empty &&
        (endpoint.x_bytes() > shape.row_bytes() || width > shape.row_bytes() - endpoint.x_bytes() ||
         endpoint.y() > shape.rows() || height > shape.rows() - endpoint.y() ||
         endpoint.z() > shape.slices() || depth > shape.slices() - endpoint.z())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d bytes x %d rows x %d slices at (x %d bytes, y %d, z %d) leave array %d of "
          "%d bytes x %d rows x %d slices",
          what, width, height, depth, endpoint.x_bytes(), endpoint.y(), endpoint.z(),
          endpoint.array_id(), shape.row_bytes(), shape.rows(), shape.slices()));
    }
    side.end.array = entry.array.get();
    side.end.x_bytes = endpoint.x_bytes();
    side.end.y = endpoint.y();
    side.end.z = endpoint.z();
    side.keep = std::move(entry.array);
    return side;
  }
  if (endpoint.target_case() != v1::Copy3DEndpoint::kDevice) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: set array_id or device", what));
  }
  if (endpoint.x_bytes() != 0 || endpoint.y() != 0 || endpoint.z() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: x_bytes, y and z place an array's copy; for linear memory put the offset in the "
        "pointer",
        what));
  }
  const uint64_t pitch = endpoint.pitch_bytes() == 0 ? width : endpoint.pitch_bytes();
  const uint64_t rows = endpoint.height() == 0 ? height : endpoint.height();
  if (pitch > kMaxCopy3DPitchBytes || rows > kMaxCopy3DPitchBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: pitch_bytes %d and height %d must be at most %d", what, pitch, rows,
                        kMaxCopy3DPitchBytes));
  }
  if (pitch < width || rows < height) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: rows of %d bytes do not fit a pitch of %d bytes, or %d rows a slice of %d rows", what,
        width, pitch, height, rows));
  }
  // The last byte the copy touches: (depth - 1) slices, (height - 1) rows and a row on.
  uint64_t extent = 0;
  if (!empty) {
    const std::optional<uint64_t> slices = Mul(depth - 1, pitch * rows);  // pitch * rows < 2^62
    if (!slices || *slices > UINT64_MAX - (height - 1) * pitch - width) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: the copy's extent overflows 64 bits", what));
    }
    extent = *slices + (height - 1) * pitch + width;
  }
  GPURPC_ASSIGN_OR_RETURN(side.end.address, Resolve(endpoint.device(), extent, what));
  side.end.pitch_bytes = pitch;
  side.end.height = rows;
  return side;
}

absl::Status Session::Copy3D(const v1::Copy3DCommand& command) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const Copy3DSide dst,
                          ResolveCopy3DEnd(command.destination(), command, "Copy3D destination"));
  GPURPC_ASSIGN_OR_RETURN(const Copy3DSide src,
                          ResolveCopy3DEnd(command.source(), command, "Copy3D source"));
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(command.stream_id()));
  if (command.width_bytes() == 0 || command.height() == 0 || command.depth() == 0) {
    return absl::OkStatus();
  }
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(command.stream_id(), "Copy3D"));
  return RecordFault(context_->Copy3D(dst.end, src.end, command.width_bytes(), command.height(),
                                      command.depth(), stream.get()));
}

// ---------------------------------------------------------------------------- execution

absl::StatusOr<std::shared_ptr<backend::Stream>> Session::FindStream(uint64_t stream_id) {
  if (stream_id == 0) return std::shared_ptr<backend::Stream>();
  absl::MutexLock lock(&mu_);
  return streams_.Find(stream_id);
}

absl::StatusOr<std::shared_ptr<backend::Event>> Session::FindEvent(uint64_t event_id) {
  absl::MutexLock lock(&mu_);
  return events_.Find(event_id);
}

absl::StatusOr<std::shared_ptr<Session::FunctionEntry>> Session::FindFunction(
    uint64_t function_id) {
  absl::MutexLock lock(&mu_);
  return functions_.Find(function_id);
}

absl::StatusOr<uint64_t> Session::CreateStream(bool non_blocking) {
  GPURPC_RETURN_IF_ERROR(fault());
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("streams", streams_.size(), limits_.max_streams,
                                            "max_streams_per_session"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> stream,
                          RecordFault(context_->CreateStream(non_blocking)));
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(
      CheckCountLocked("streams", streams_.size(), limits_.max_streams, "max_streams_per_session"));
  const uint64_t id = NewIdLocked();
  streams_.Insert(id, std::move(stream));
  stream_captures_[id] = NewStreamCapture(/*blocking=*/!non_blocking);
  return id;
}

absl::Status Session::DestroyStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<backend::Stream> stream;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(
        stream, streams_.Take(stream_id, "DestroyStream",
                              stream_id == 0 ? " (the default stream cannot be destroyed)" : ""));
  }
  AbandonCapture(stream_id, stream.get());
  return absl::OkStatus();
}

absl::Status Session::SynchronizeStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "SynchronizeStream"));
  return RecordFault(context_->SynchronizeStream(stream.get()));
}

absl::StatusOr<bool> Session::QueryStream(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "QueryStream"));
  return RecordFault(context_->QueryStream(stream.get()));
}

absl::Status Session::Synchronize() {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(RefuseWhileAnyCaptures("SynchronizeSession"));
  return RecordFault(context_->Synchronize());
}

absl::StatusOr<uint64_t> Session::CreateEvent(bool disable_timing, bool blocking_sync,
                                              bool interprocess) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (interprocess && !disable_timing) {
    return absl::InvalidArgumentError(
        "CreateEvent: an interprocess event needs disable_timing (CUDA times no event it "
        "shares between processes)");
  }
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckEventCountLocked());
  }
  GPURPC_ASSIGN_OR_RETURN(
      std::unique_ptr<backend::Event> event,
      RecordFault(interprocess ? context_->CreateInterprocessEvent(blocking_sync)
                               : context_->CreateEvent(disable_timing, blocking_sync)));
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(CheckEventCountLocked());
  const uint64_t id = NewIdLocked();
  events_.Insert(id, std::move(event));
  if (interprocess) event_ipc_[id] = EventIpc::kInterprocess;
  return id;
}

absl::Status Session::CheckEventCountLocked() const {
  absl::Status status = CheckCountLocked("events", events_.size() + retained_events_.size(),
                                         limits_.max_events, "max_events_per_session");
  if (status.ok() || retained_events_.empty()) return status;
  return absl::ResourceExhaustedError(
      absl::StrFormat("%s (%d of them exported and destroyed: they count until the session ends)",
                      status.message(), retained_events_.size()));
}

absl::Status Session::DestroyEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<backend::Event> event;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(event, events_.Take(event_id, "DestroyEvent"));
    if (auto it = event_ipc_.find(event_id); it != event_ipc_.end()) {
      // Sessions that opened an exported event may wait on it until this session ends, and
      // CUDA leaves using it after cuEventDestroy undefined: the driver's event stays.
      if (it->second == EventIpc::kExported) retained_events_[event_id] = std::move(event);
      event_ipc_.erase(it);
    }
  }
  // Destroyed here, outside mu_ (a backend call), unless a call in flight still uses it.
  return absl::OkStatus();
}

absl::StatusOr<std::string> Session::ExportEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<backend::Event> event;
  bool first_export = false;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(event, events_.Find(event_id, "ExportEvent"));
    auto it = event_ipc_.find(event_id);
    if (it == event_ipc_.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ExportEvent: event %d was not created interprocess (CreateEvent with interprocess "
          "and disable_timing)",
          event_id));
    }
    if (it->second == EventIpc::kOpened) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ExportEvent: event %d was opened from another session's export; export the "
          "original there",
          event_id));
    }
    if (it->second == EventIpc::kInterprocess) {
      if (exported_events_ >= kMaxExportedEventsPerSession) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "ExportEvent: this session has exported %d events, the most one session may (an "
            "exported event is kept until its session ends)",
            exported_events_));
      }
      // Exported from here on, before the driver is asked: a DestroyEvent meanwhile keeps it
      // (and its slot in the event quota), as it does for any exported event.
      it->second = EventIpc::kExported;
      ++exported_events_;
      first_export = true;
    }
  }
  absl::StatusOr<std::string> handle = RecordFault(context_->ExportEvent(event.get()));
  if (!handle.ok() && first_export) {
    // Not exported after all: unless it was destroyed meanwhile (then it stays retained
    // until the session ends, which is safe), it is a plain interprocess event again.
    absl::MutexLock lock(&mu_);
    if (auto it = event_ipc_.find(event_id); it != event_ipc_.end()) {
      it->second = EventIpc::kInterprocess;
      --exported_events_;
    }
  }
  return handle;
}

absl::StatusOr<uint64_t> Session::OpenExportedEvent(const std::string& ipc_handle) {
  GPURPC_RETURN_IF_ERROR(fault());
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckEventCountLocked());
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Event> event,
                          RecordFault(context_->OpenExportedEvent(ipc_handle)));
  absl::MutexLock lock(&mu_);
  GPURPC_RETURN_IF_ERROR(CheckEventCountLocked());
  const uint64_t id = NewIdLocked();
  events_.Insert(id, std::move(event));
  event_ipc_[id] = EventIpc::kOpened;
  return id;
}

absl::Status Session::RecordEvent(uint64_t event_id, uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "RecordEvent"));
  return RecordFault(context_->RecordEvent(event.get(), stream.get()));
}

absl::StatusOr<bool> Session::QueryEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  return RecordFault(context_->QueryEvent(event.get()));
}

absl::Status Session::SynchronizeEvent(uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  return RecordFault(context_->SynchronizeEvent(event.get()));
}

absl::StatusOr<float> Session::ElapsedTime(uint64_t start_event_id, uint64_t end_event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto start, FindEvent(start_event_id));
  GPURPC_ASSIGN_OR_RETURN(auto end, FindEvent(end_event_id));
  return RecordFault(context_->ElapsedTime(start.get(), end.get()));
}

absl::Status Session::StreamWaitEvent(uint64_t stream_id, uint64_t event_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(stream_id));
  GPURPC_ASSIGN_OR_RETURN(auto event, FindEvent(event_id));
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(stream_id, "StreamWaitEvent"));
  return RecordFault(context_->StreamWaitEvent(stream.get(), event.get()));
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
        GPURPC_RETURN_IF_ERROR(
            RecordFault(context_->Launch(entry->function, config, packed, stream)));
        // Every launch, unary or in a command batch, comes through here. A captured one
        // runs only as part of a graph launch, which is watched instead.
        if (Watchdog* watchdog = watchdog_ptr_.load(std::memory_order_acquire);
            watchdog != nullptr && !capturing) {
          watchdog->OnLaunch(launch.stream_id(), stream, entry->name);
        }
        return absl::OkStatus();
      });
}

absl::Status Session::LaunchAndSynchronize(const v1::LaunchCommand& launch) {
  GPURPC_RETURN_IF_ERROR(fault());
  // Refused before the launch: a captured launch that then answered FAILED_PRECONDITION
  // would leave the client not knowing that its kernel is in the graph.
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(launch.stream_id(), "Launch with synchronize"));
  GPURPC_RETURN_IF_ERROR(Launch(launch));
  absl::Status waited = SynchronizeStream(launch.stream_id());
  if (waited.ok() || IsStickyFault(waited)) return waited;
  // Another call of the session began a capture on the stream, or destroyed it, after the
  // check above: the kernel is enqueued (or captured), and the answer must say so.
  return absl::Status(waited.code(),
                      absl::StrCat("Launch with synchronize: the kernel was enqueued, but the "
                                   "wait for its stream failed: ",
                                   waited.message()));
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
    case v1::Command::kCopy3D:
      return Copy3D(command.copy_3d());
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
      if (command.sync().event_id() != 0) return SynchronizeEvent(command.sync().event_id());
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
      if (IsStickyFault(status)) return status;
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
