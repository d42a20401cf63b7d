#include "gpurpc/client.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_format.h"
#include "client/cpp/src/session_core.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gpurpc/v1/admin_service.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc {
namespace internal {

// Keeps a module loaded while a Module or any Function from it exists.
struct ModuleHandle {
  std::shared_ptr<SessionCore> core;
  uint64_t id = 0;
  ~ModuleHandle();
};

}  // namespace internal

namespace {

using internal::SessionCore;

// Cleanup in destructors: never throws; says what failed when asked to.
void ReportCleanup(const char* what, const absl::Status& status) {
  if (status.ok() || std::getenv("GPURPC_CLIENT_DEBUG") == nullptr) return;
  std::fprintf(stderr, "gpurpc: cleanup of %s failed: %s\n", what, status.ToString().c_str());
}

void SetPointer(const DeviceRef& ref, v1::DevicePointer* out) {
  if (ref.buffer_id != 0) {
    out->mutable_buffer()->set_buffer_id(ref.buffer_id);
    out->mutable_buffer()->set_offset_bytes(ref.offset_bytes);
  } else {
    out->set_device_address(ref.device_address);
  }
}

uint64_t StreamId(const Stream* stream) { return stream == nullptr ? 0 : stream->id(); }

absl::Status NoSession() { return absl::FailedPreconditionError("no session (moved from?)"); }

template <typename Request, typename Response, typename Method>
absl::Status Call(SessionCore& core, Method method, const Request& request, Response* response) {
  grpc::ClientContext context;
  core.Prepare(&context);
  return FromGrpcStatus(method(&context, request, response));
}

void SetDim(const Dim3& in, v1::Dim3* out) {
  out->set_x(in.x);
  out->set_y(in.y);
  out->set_z(in.z);
}

absl::Status UploadImpl(SessionCore& core, const DeviceRef& dst, absl::Span<const uint8_t> data,
                        uint64_t stream_id) {
  if (absl::Status status = core.Barrier(); !status.ok()) return status;
  if (data.size() <= kTransferChunkBytes) {
    v1::UploadRequest request;
    SetPointer(dst, request.mutable_destination());
    request.set_data(data.data(), data.size());
    request.set_stream_id(stream_id);
    v1::UploadResponse response;
    grpc::ClientContext context;
    core.Prepare(&context);
    return FromGrpcStatus(core.memory().Upload(&context, request, &response));
  }
  grpc::ClientContext context;
  core.Prepare(&context);
  v1::UploadResponse response;
  auto writer = core.memory().UploadStream(&context, &response);
  v1::UploadStreamRequest message;
  SetPointer(dst, message.mutable_destination());
  message.set_total_size_bytes(data.size());
  message.set_stream_id(stream_id);
  for (size_t done = 0; done < data.size();) {
    const size_t n = std::min<size_t>(kTransferChunkBytes, data.size() - done);
    message.set_data(data.data() + done, n);
    if (!writer->Write(message)) break;  // the server ended the call; Finish says why
    message.Clear();
    done += n;
  }
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

absl::Status DownloadImpl(SessionCore& core, const DeviceRef& src, absl::Span<uint8_t> out,
                          uint64_t stream_id) {
  if (absl::Status status = core.Barrier(); !status.ok()) return status;
  v1::DownloadRequest request;
  SetPointer(src, request.mutable_source());
  request.set_size_bytes(out.size());
  request.set_stream_id(stream_id);
  grpc::ClientContext context;
  core.Prepare(&context);
  if (out.size() <= kTransferChunkBytes) {
    v1::DownloadResponse response;
    grpc::Status status = core.memory().Download(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    if (response.data().size() != out.size()) {
      return absl::InternalError("Download: the daemon returned a short answer");
    }
    std::copy(response.data().begin(), response.data().end(), out.begin());
    return absl::OkStatus();
  }
  auto reader = core.memory().DownloadStream(&context, request);
  v1::DownloadResponse chunk;
  size_t done = 0;
  while (reader->Read(&chunk)) {
    if (chunk.data().size() > out.size() - done) {
      context.TryCancel();
      reader->Finish().ok();
      return absl::InternalError("DownloadStream: the daemon sent more than asked");
    }
    std::copy(chunk.data().begin(), chunk.data().end(), out.begin() + done);
    done += chunk.data().size();
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (done != out.size()) {
    return absl::InternalError(
        absl::StrFormat("DownloadStream: %d of %d bytes arrived", done, out.size()));
  }
  return absl::OkStatus();
}

}  // namespace

internal::ModuleHandle::~ModuleHandle() {
  if (core == nullptr || core->closed()) return;
  v1::UnloadModuleRequest request;
  request.set_module_id(id);
  v1::UnloadModuleResponse response;
  ReportCleanup("module", Call(*core,
                               [&](grpc::ClientContext* c, const auto& r, auto* o) {
                                 return core->modules().UnloadModule(c, r, o);
                               },
                               request, &response));
}

// ---------------------------------------------------------------------------- Client

// Client::Connect is in connect.cc.

absl::StatusOr<v1::ListDevicesResponse> Client::ListDevices() const {
  auto stub = v1::DeviceService::NewStub(channel_);
  grpc::ClientContext context;
  v1::ListDevicesResponse response;
  grpc::Status status = stub->ListDevices(&context, v1::ListDevicesRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<Session> Client::OpenSession(int device_ordinal,
                                            const std::string& client_label) const {
  auto stub = v1::SessionService::NewStub(channel_);
  grpc::ClientContext context;
  v1::OpenSessionRequest request;
  request.set_device_ordinal(device_ordinal);
  request.set_client_label(client_label.empty() ? "gpurpc C++ client" : client_label);
  v1::OpenSessionResponse response;
  grpc::Status status = stub->OpenSession(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Session session;
  session.core_ = std::make_shared<SessionCore>(channel_, response.session_id(),
                                                response.device(), response.idle_timeout_ms());
  return session;
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo() const {
  auto stub = v1::DeviceService::NewStub(channel_);
  grpc::ClientContext context;
  v1::GetServerInfoResponse response;
  grpc::Status status = stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ListSessionsResponse> Client::AdminListSessions(
    const std::string& tenant) const {
  auto stub = v1::AdminService::NewStub(channel_);
  grpc::ClientContext context;
  v1::ListSessionsRequest request;
  request.set_tenant(tenant);
  v1::ListSessionsResponse response;
  grpc::Status status = stub->ListSessions(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::AdminCloseSessionResponse> Client::AdminCloseSession(uint64_t session_id) const {
  auto stub = v1::AdminService::NewStub(channel_);
  grpc::ClientContext context;
  v1::AdminCloseSessionRequest request;
  request.set_session_id(session_id);
  v1::AdminCloseSessionResponse response;
  grpc::Status status = stub->CloseSession(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// ---------------------------------------------------------------------------- Session

Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    if (core_ != nullptr) ReportCleanup("session", core_->Close());
    core_ = std::move(other.core_);
  }
  return *this;
}
Session::~Session() {
  if (core_ != nullptr) ReportCleanup("session", core_->Close());
}

uint64_t Session::id() const { return core_ == nullptr ? 0 : core_->id(); }
const v1::DeviceInfo& Session::device() const {
  static const v1::DeviceInfo kNone;
  return core_ == nullptr ? kNone : core_->device();
}

absl::Status Session::Close() {
  if (core_ == nullptr) return NoSession();
  return core_->Close();
}

absl::StatusOr<v1::KeepAliveResponse> Session::KeepAlive() const {
  if (core_ == nullptr) return NoSession();
  grpc::ClientContext context;
  core_->Prepare(&context);
  v1::KeepAliveResponse response;
  grpc::Status status = core_->sessions().KeepAlive(&context, v1::KeepAliveRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<Buffer> Session::Allocate(uint64_t size_bytes) const {
  if (core_ == nullptr) return NoSession();
  v1::AllocateRequest request;
  request.set_size_bytes(size_bytes);
  v1::AllocateResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->memory().Allocate(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Buffer buffer;
  buffer.core_ = core_;
  buffer.id_ = response.buffer().buffer_id();
  buffer.device_address_ = response.buffer().device_address();
  buffer.size_bytes_ = response.buffer().size_bytes();
  return buffer;
}

absl::StatusOr<MemInfo> Session::GetMemInfo() const {
  if (core_ == nullptr) return NoSession();
  grpc::ClientContext context;
  core_->Prepare(&context);
  v1::GetMemInfoResponse response;
  grpc::Status status = core_->memory().GetMemInfo(&context, v1::GetMemInfoRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return MemInfo{response.free_bytes(), response.total_bytes()};
}

absl::Status Session::Upload(const DeviceRef& dst, absl::Span<const uint8_t> data,
                             const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return UploadImpl(*core_, dst, data, StreamId(stream));
}

absl::StatusOr<std::vector<uint8_t>> Session::Download(const DeviceRef& src, uint64_t size_bytes,
                                                       const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  std::vector<uint8_t> out(size_bytes);
  absl::Status status = DownloadImpl(*core_, src, absl::MakeSpan(out), StreamId(stream));
  if (!status.ok()) return status;
  return out;
}

absl::Status Session::DownloadInto(const DeviceRef& src, absl::Span<uint8_t> out,
                                   const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return DownloadImpl(*core_, src, out, StreamId(stream));
}

absl::Status Session::Memset(const DeviceRef& dst, uint32_t value, uint32_t element_size_bytes,
                             uint64_t count, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::MemsetRequest request;
  SetPointer(dst, request.mutable_destination());
  request.set_value(value);
  request.set_element_size_bytes(element_size_bytes);
  request.set_count(count);
  request.set_stream_id(StreamId(stream));
  v1::MemsetResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  return FromGrpcStatus(core_->memory().Memset(&context, request, &response));
}

absl::Status Session::CopyDeviceToDevice(const DeviceRef& dst, const DeviceRef& src,
                                         uint64_t size_bytes, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::CopyDeviceToDeviceRequest request;
  SetPointer(dst, request.mutable_destination());
  SetPointer(src, request.mutable_source());
  request.set_size_bytes(size_bytes);
  request.set_stream_id(StreamId(stream));
  v1::CopyDeviceToDeviceResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  return FromGrpcStatus(core_->memory().CopyDeviceToDevice(&context, request, &response));
}

absl::Status Session::MemsetAsync(const DeviceRef& dst, uint32_t value,
                                  uint32_t element_size_bytes, uint64_t count,
                                  const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  v1::MemsetCommand* memset = command.mutable_memset();
  SetPointer(dst, memset->mutable_destination());
  memset->set_value(value);
  memset->set_element_size_bytes(element_size_bytes);
  memset->set_count(count);
  memset->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Session::CopyDeviceToDeviceAsync(const DeviceRef& dst, const DeviceRef& src,
                                              uint64_t size_bytes, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  v1::CopyCommand* copy = command.mutable_copy();
  SetPointer(dst, copy->mutable_destination());
  SetPointer(src, copy->mutable_source());
  copy->set_size_bytes(size_bytes);
  copy->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Session::UploadAsync(const DeviceRef& dst, absl::Span<const uint8_t> data,
                                  const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (data.size() > kTransferChunkBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "UploadAsync: %d bytes exceed the inline limit of %d; use Upload", data.size(),
        kTransferChunkBytes));
  }
  v1::Command command;
  v1::UploadCommand* upload = command.mutable_upload();
  SetPointer(dst, upload->mutable_destination());
  upload->set_data(data.data(), data.size());
  upload->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::StatusOr<CompileResult> Session::Compile(const CompileOptions& options) const {
  if (core_ == nullptr) return NoSession();
  v1::CompileRequest request;
  request.set_source(options.source);
  request.set_program_name(options.program_name);
  for (const std::string& option : options.options) request.add_options(option);
  for (const auto& [name, content] : options.headers) {
    v1::Header* header = request.add_headers();
    header->set_name(name);
    header->set_content(content);
  }
  for (const std::string& expression : options.name_expressions) {
    request.add_name_expressions(expression);
  }
  CompileResult result;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->modules().Compile(&context, request, &result.response);
  if (!status.ok()) return FromGrpcStatus(status);
  if (result.response.success() && result.response.module_id() != 0) {
    result.module.core_ = core_;
    result.module.handle_ = std::make_shared<internal::ModuleHandle>();
    result.module.handle_->core = core_;
    result.module.handle_->id = result.response.module_id();
  }
  return result;
}

std::string CompileResult::LoweredName(const std::string& name_expression) const {
  for (const v1::LoweredName& name : response.lowered_names()) {
    if (name.name_expression() == name_expression) return name.lowered_name();
  }
  return "";
}

absl::StatusOr<Module> Session::LoadModule(const std::string& image) const {
  if (core_ == nullptr) return NoSession();
  v1::LoadModuleRequest request;
  request.set_image(image);
  v1::LoadModuleResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->modules().LoadModule(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Module module;
  module.core_ = core_;
  module.handle_ = std::make_shared<internal::ModuleHandle>();
  module.handle_->core = core_;
  module.handle_->id = response.module_id();
  return module;
}

absl::StatusOr<Stream> Session::CreateStream(bool non_blocking) const {
  if (core_ == nullptr) return NoSession();
  v1::CreateStreamRequest request;
  request.set_non_blocking(non_blocking);
  v1::CreateStreamResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->execution().CreateStream(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Stream stream;
  stream.core_ = core_;
  stream.id_ = response.stream_id();
  return stream;
}

absl::StatusOr<Event> Session::CreateEvent(bool disable_timing) const {
  if (core_ == nullptr) return NoSession();
  v1::CreateEventRequest request;
  request.set_disable_timing(disable_timing);
  v1::CreateEventResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->execution().CreateEvent(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Event event;
  event.core_ = core_;
  event.id_ = response.event_id();
  return event;
}

absl::Status Session::Flush() const {
  if (core_ == nullptr) return NoSession();
  return core_->Flush();
}

absl::Status Session::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  return core_->Sync(0, /*whole_session=*/true);
}

// ---------------------------------------------------------------------------- Buffer

Buffer::Buffer(Buffer&& other) noexcept
    : core_(std::move(other.core_)),
      id_(std::exchange(other.id_, 0)),
      device_address_(std::exchange(other.device_address_, 0)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (id_ != 0) ReportCleanup("buffer", Free());
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
    device_address_ = std::exchange(other.device_address_, 0);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

Buffer::~Buffer() {
  if (id_ != 0 && core_ != nullptr && !core_->closed()) ReportCleanup("buffer", Free());
}

absl::Status Buffer::Free() {
  if (core_ == nullptr || id_ == 0) return absl::NotFoundError("Free: buffer already freed");
  // Work queued on the command stream may still use it: let it be enqueued first.
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::FreeRequest request;
  request.set_buffer_id(std::exchange(id_, 0));
  v1::FreeResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  return FromGrpcStatus(core_->memory().Free(&context, request, &response));
}

absl::Status Buffer::Upload(absl::Span<const uint8_t> data, uint64_t offset_bytes) const {
  if (core_ == nullptr) return NoSession();
  return UploadImpl(*core_, at(offset_bytes), data, 0);
}

absl::StatusOr<std::vector<uint8_t>> Buffer::Download(uint64_t offset_bytes,
                                                      uint64_t size_bytes) const {
  if (core_ == nullptr) return NoSession();
  std::vector<uint8_t> out(size_bytes);
  absl::Status status = DownloadImpl(*core_, at(offset_bytes), absl::MakeSpan(out), 0);
  if (!status.ok()) return status;
  return out;
}

// ---------------------------------------------------------------------------- Stream, Event

Stream::Stream(Stream&& other) noexcept
    : core_(std::move(other.core_)), id_(std::exchange(other.id_, 0)) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Stream doomed(std::move(*this));
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}
Stream::~Stream() {
  if (id_ == 0 || core_ == nullptr || core_->closed()) return;
  if (!core_->Barrier().ok()) return;
  v1::DestroyStreamRequest request;
  request.set_stream_id(id_);
  v1::DestroyStreamResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  ReportCleanup("stream",
                FromGrpcStatus(core_->execution().DestroyStream(&context, request, &response)));
}

absl::Status Stream::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  return core_->Sync(id_, /*whole_session=*/false);
}

absl::Status Stream::WaitEvent(const Event& event) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  command.mutable_wait_event()->set_event_id(event.id());
  command.mutable_wait_event()->set_stream_id(id_);
  return core_->Enqueue(std::move(command));
}

Event::Event(Event&& other) noexcept
    : core_(std::move(other.core_)), id_(std::exchange(other.id_, 0)) {}
Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event doomed(std::move(*this));
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}
Event::~Event() {
  if (id_ == 0 || core_ == nullptr || core_->closed()) return;
  if (!core_->Barrier().ok()) return;
  v1::DestroyEventRequest request;
  request.set_event_id(id_);
  v1::DestroyEventResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  ReportCleanup("event",
                FromGrpcStatus(core_->execution().DestroyEvent(&context, request, &response)));
}

absl::Status Event::Record(const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  command.mutable_record_event()->set_event_id(id_);
  command.mutable_record_event()->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Event::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::SynchronizeEventRequest request;
  request.set_event_id(id_);
  v1::SynchronizeEventResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  return FromGrpcStatus(core_->execution().SynchronizeEvent(&context, request, &response));
}

absl::StatusOr<bool> Event::Query() const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::QueryEventRequest request;
  request.set_event_id(id_);
  v1::QueryEventResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->execution().QueryEvent(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.done();
}

absl::StatusOr<float> Event::ElapsedSince(const Event& start) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::EventElapsedTimeRequest request;
  request.set_start_event_id(start.id());
  request.set_end_event_id(id_);
  v1::EventElapsedTimeResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->execution().EventElapsedTime(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.elapsed_ms();
}

// ---------------------------------------------------------------------------- modules

uint64_t Module::id() const { return handle_ == nullptr ? 0 : handle_->id; }

absl::StatusOr<Function> Module::GetFunction(const std::string& name) const {
  if (core_ == nullptr) return NoSession();
  v1::GetFunctionRequest request;
  request.set_module_id(id());
  request.set_name(name);
  v1::GetFunctionResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->modules().GetFunction(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  Function function;
  function.core_ = core_;
  function.module_ = handle_;
  function.id_ = response.function_id();
  function.name_ = name;
  function.params_.assign(response.params().begin(), response.params().end());
  function.attributes_ = response.attributes();
  return function;
}

absl::StatusOr<Module::Global> Module::GetGlobal(const std::string& name) const {
  if (core_ == nullptr) return NoSession();
  v1::GetGlobalRequest request;
  request.set_module_id(id());
  request.set_name(name);
  v1::GetGlobalResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  grpc::Status status = core_->modules().GetGlobal(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return Global{response.device_address(), response.size_bytes()};
}

absl::StatusOr<std::string> Function::Pack(absl::Span<const KernelArg> args) const {
  if (args.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kernel '%s' takes %d parameters; %d arguments were given", name_, params_.size(),
        args.size()));
  }
  const size_t total =
      params_.empty() ? 0 : params_.back().offset_bytes() + params_.back().size_bytes();
  std::string packed(total, '\0');
  for (size_t i = 0; i < args.size(); ++i) {
    const std::vector<uint8_t>& bytes = args[i].bytes();
    if (bytes.size() != params_[i].size_bytes()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "kernel '%s' parameter #%d: expected %d bytes, given %d bytes", name_, i,
          params_[i].size_bytes(), bytes.size()));
    }
    std::copy(bytes.begin(), bytes.end(), packed.begin() + params_[i].offset_bytes());
  }
  return packed;
}

namespace {

void FillLaunch(uint64_t function_id, const LaunchConfig& config, std::string packed,
                v1::LaunchCommand* launch) {
  launch->set_function_id(function_id);
  SetDim(config.grid, launch->mutable_grid());
  SetDim(config.block, launch->mutable_block());
  launch->set_shared_memory_bytes(config.shared_memory_bytes);
  launch->set_stream_id(StreamId(config.stream));
  launch->set_packed_args(std::move(packed));
}

}  // namespace

absl::Status Function::LaunchPacked(const LaunchConfig& config, absl::Span<const KernelArg> args,
                                    bool async) const {
  if (core_ == nullptr) return NoSession();
  auto packed = Pack(args);
  if (!packed.ok()) return packed.status();
  if (async) return LaunchBlobAsync(config, *std::move(packed));
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::LaunchRequest request;
  FillLaunch(id_, config, *std::move(packed), request.mutable_launch());
  v1::LaunchResponse response;
  grpc::ClientContext context;
  core_->Prepare(&context);
  return FromGrpcStatus(core_->execution().Launch(&context, request, &response));
}

absl::Status Function::LaunchBlobAsync(const LaunchConfig& config, std::string packed_args) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  FillLaunch(id_, config, std::move(packed_args), command.mutable_launch());
  return core_->Enqueue(std::move(command));
}

}  // namespace gpurpc
