#include "server/worker/service.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "google/protobuf/descriptor.h"
#include "gpurpc/internal/v1/worker_control.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/host_region_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/impl/codegen/method_handler.h"
#include "server/parse_checked_service.h"
#include "server/parse_limit.h"
#include "server/status_interceptor.h"
#include "server/worker/framed_commands.h"
#include "server/worker/raw_messages.h"

namespace gpurpc::worker {
namespace {

// The streaming methods on raw messages (raw_messages.h): handlers that see the bytes.
using RawStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
template <typename Service>
using RawHandler =
    grpc::internal::BidiStreamingHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>;

// The index of `method` in the generated `service` (its order in the .proto).
int MethodIndex(const char* service, const char* method) {
  const google::protobuf::ServiceDescriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service);
  const google::protobuf::MethodDescriptor* found =
      descriptor == nullptr ? nullptr : descriptor->FindMethodByName(method);
  if (found == nullptr) {
    std::fprintf(stderr, "gpurpc worker: no method %s.%s in the generated code\n", service, method);
    std::abort();
  }
  return found->index();
}

// INVALID_ARGUMENT for message `index` (from 1) of a stream that does not parse as `type`.
grpc::Status NotParsed(const char* method, uint64_t index, const char* type) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, NotParsedMessage(method, index, type));
}

void SetDim(const std::array<int, 3>& in, v1::Dim3* out) {
  out->set_x(in[0]);
  out->set_y(in[1]);
  out->set_z(in[2]);
}

// Answers a unary call from a StatusOr, filling the response with `fill` on success.
template <typename T, typename Fill>
grpc::Status Answer(absl::StatusOr<T> result, Fill fill) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  fill(*result);
  return grpc::Status::OK;
}

// Answers a synchronising unary call: on success the response carries the device printf
// output captured by then. An error answer carries no message (gRPC sends none), so the
// output stays captured for the next synchronising answer instead of being taken into one
// that is dropped (after a fault no answer succeeds again, and it is lost either way).
template <typename Response>
grpc::Status AnswerSynchronized(const absl::Status& status, Session& session, Response* response) {
  if (!status.ok()) return ToGrpcStatus(status);
  response->set_device_output(session.TakeDeviceOutput());
  return grpc::Status::OK;
}

// The chunks of one DownloadStream, filled ahead of the writes: while the handler's thread
// writes chunk k to the wire, a helper thread copies chunk k + 1 off the device (DMA, then
// the host copy into the message), so that the device side overlaps the transport's. At
// most kAhead filled chunk waits beside the one being written: a client that stops reading
// holds two chunks of the worker's memory, not one. Chunks come out in order; an error comes
// after the chunks filled before it. At most kMaxHelpers run in a worker at once (their threads
// and chunks are outside gRPC's thread and memory bounds); a download beyond that fills its
// chunks between its writes, as without them.
class ChunksAhead {
 public:
  // fill(offset, n, out) makes the message of bytes [offset, offset + n).
  using Fill = std::function<absl::Status(uint64_t, uint64_t, grpc::ByteBuffer*)>;
  static constexpr size_t kAhead = 1;
  static constexpr int kMaxHelpers = 8;

  // A helper for a download of `total` bytes, or null when none may start (a slot or a
  // thread missing).
  static std::unique_ptr<ChunksAhead> Start(uint64_t total, uint64_t chunk, Fill fill) {
    if (helpers_.fetch_add(1) >= kMaxHelpers) {
      helpers_.fetch_sub(1);
      return nullptr;
    }
    try {
      return std::make_unique<ChunksAhead>(total, chunk, std::move(fill));
    } catch (const std::system_error&) {
      helpers_.fetch_sub(1);
      return nullptr;
    }
  }

  // Throws std::system_error when no thread can start (Start answers null then).
  ChunksAhead(uint64_t total, uint64_t chunk, Fill fill)
      : total_(total), chunk_(chunk), fill_(std::move(fill)), thread_([this] { Run(); }) {}
  ~ChunksAhead() {
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
    }
    thread_.join();
    helpers_.fetch_sub(1);
  }
  ChunksAhead(const ChunksAhead&) = delete;
  ChunksAhead& operator=(const ChunksAhead&) = delete;

  // Waits for the next chunk; its fill's error once the chunks before it are taken.
  absl::Status Next(grpc::ByteBuffer* out) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](ChunksAhead* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return !self->ready_.empty() || !self->error_.ok();
        },
        this));
    if (ready_.empty()) return error_;
    *out = std::move(ready_.front());
    ready_.pop_front();
    return absl::OkStatus();
  }

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    for (uint64_t done = 0; done < total_;) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ChunksAhead* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
              return self->stopped_ || self->ready_.size() < kAhead;
            },
            this));
        if (stopped_) return;
      }
      const uint64_t n = std::min(chunk_, total_ - done);
      grpc::ByteBuffer message;
      absl::Status status = fill_(done, n, &message);
      absl::MutexLock lock(&mu_);
      if (!status.ok()) {
        error_ = std::move(status);
        return;
      }
      ready_.push_back(std::move(message));
      done += n;
    }
  }

  const uint64_t total_;
  const uint64_t chunk_;
  const Fill fill_;
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> ready_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;                         // last: it starts once the members above exist
  static inline std::atomic<int> helpers_{0};  // ChunksAhead alive in this worker
};

// The gRPC server's stream as RawMessages.
class GrpcMessages final : public RawMessages {
 public:
  explicit GrpcMessages(RawStream* stream) : stream_(stream) {}
  bool Read(grpc::ByteBuffer* message) override { return stream_->Read(message); }
  bool Write(const grpc::ByteBuffer& message) override { return stream_->Write(message); }

 private:
  RawStream* const stream_;
};

// An UploadStream message longer than a chunk and its other fields may be: refused before
// it is split (its other fields are copied for parsing), naming it.
grpc::Status ChunkMessageSize(const grpc::ByteBuffer& raw, uint64_t index) {
  constexpr uint64_t kMaxChunkMessageBytes = kMaxTransferChunkBytes + (64 << 10);
  const uint64_t length = raw.Valid() ? raw.Length() : 0;
  if (length <= kMaxChunkMessageBytes) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      absl::StrFormat("UploadStream: message %d is %d bytes, more than a chunk of %d bytes and "
                      "its other fields may take (%d); send 1 MiB chunks",
                      index, length, kMaxTransferChunkBytes, kMaxChunkMessageBytes));
}

}  // namespace

// UploadStream (raw messages): each chunk goes to the device from the received bytes,
// piece by piece when they came in several (the backend copies each into its staging).
grpc::Status ServeUploadStream(Session* session, RawMessages* stream) {
  static constexpr char kType[] = "gpurpc.v1.UploadStreamRequest";
  grpc::ByteBuffer raw;
  if (!stream->Read(&raw)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "UploadStream: no message; the first names the destination");
  }
  uint64_t index = 1;
  v1::UploadStreamRequest first;
  SplitMessage chunk;
  if (grpc::Status size = ChunkMessageSize(raw, index); !size.ok()) return size;
  if (!SplitBytesField(&raw, v1::UploadStreamRequest::kDataFieldNumber, &first, &chunk)) {
    return NotParsed("/gpurpc.v1.MemoryService/UploadStream", index, kType);
  }
  const uint64_t total = first.total_size_bytes();
  auto base = session->Resolve(first.destination(), total, "UploadStream destination");
  if (!base.ok()) return ToGrpcStatus(base.status());
  const uint64_t stream_id = first.stream_id();
  uint64_t written = 0;
  v1::UploadStreamRequest later;  // the fields of later messages are not used
  for (;;) {
    if (chunk.size > kMaxTransferChunkBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrFormat("UploadStream: a chunk of %d bytes exceeds the limit "
                                          "of %d bytes per message; send 1 MiB chunks",
                                          chunk.size, kMaxTransferChunkBytes));
    }
    if (chunk.size > total - written) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrFormat("UploadStream: more than the announced %d bytes arrived", total));
    }
    absl::Status status = session->Upload(*base + written, chunk.pieces, chunk.size, stream_id);
    if (!status.ok()) return ToGrpcStatus(status);
    written += chunk.size;
    if (!stream->Read(&raw)) break;
    ++index;
    if (grpc::Status size = ChunkMessageSize(raw, index); !size.ok()) return size;
    if (!SplitBytesField(&raw, v1::UploadStreamRequest::kDataFieldNumber, &later, &chunk)) {
      return NotParsed("/gpurpc.v1.MemoryService/UploadStream", index, kType);
    }
  }
  if (written != total) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("UploadStream: the stream ended after %d of the "
                                        "announced %d bytes",
                                        written, total));
  }
  v1::UploadResponse response;
  response.set_bytes_written(written);
  stream->Write(SerializeRaw(response));
  return grpc::Status::OK;
}

// DownloadStream (raw messages): the device copies each chunk straight into the buffer
// that goes on the wire.
grpc::Status ServeDownloadStream(Session* session, RawMessages* stream) {
  grpc::ByteBuffer raw;
  v1::DownloadRequest request;
  if (!stream->Read(&raw) || !ParseRaw(raw, &request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "/gpurpc.v1.MemoryService/DownloadStream: the request is not a valid "
                        "message of the method's request type (it does not parse as "
                        "protobuf), or none was sent");
  }
  uint64_t chunk =
      request.chunk_size_bytes() == 0 ? kTransferChunkBytes : request.chunk_size_bytes();
  if (chunk > kMaxTransferChunkBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("DownloadStream: chunk_size_bytes %d exceeds %d", chunk,
                                        kMaxTransferChunkBytes));
  }
  const uint64_t total = request.size_bytes();
  auto base = session->Resolve(request.source(), total, "DownloadStream source");
  if (!base.ok()) return ToGrpcStatus(base.status());
  if (total == 0) {
    return ToGrpcStatus(session->Download(*base, nullptr, 0, request.stream_id()));
  }
  const uint64_t stream_id = request.stream_id();
  auto fill = [session, from = *base, stream_id](uint64_t offset, uint64_t n,
                                                 grpc::ByteBuffer* message) {
    static const std::string kNoHeader;
    return ChunkMessage(
        kNoHeader, v1::DownloadResponse::kDataFieldNumber, n,
        [&](uint8_t* to) { return session->Download(from + offset, to, n, stream_id); }, message);
  };
  // More than one chunk: the next is filled while one is written.
  // (Without a helper every chunk is filled here, between the writes.)
  std::unique_ptr<ChunksAhead> ahead;
  if (total > chunk) ahead = ChunksAhead::Start(total, chunk, fill);
  for (uint64_t done = 0; done < total;) {
    const uint64_t n = std::min(chunk, total - done);
    grpc::ByteBuffer message;
    absl::Status status = ahead != nullptr ? ahead->Next(&message) : fill(done, n, &message);
    if (!status.ok()) return ToGrpcStatus(status);
    if (!stream->Write(message)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "DownloadStream: the client went away");
    }
    done += n;
  }
  return grpc::Status::OK;
}

namespace {

// Only ListDevices: the front end asks the inventory worker once and answers every client's
// DeviceService call from that inventory; no client call reaches a worker's DeviceService.
class DeviceServiceImpl final : public v1::DeviceService::Service {
 public:
  DeviceServiceImpl(backend::Backend* backend, int nvrtc_version,
                    std::function<std::string()> compile_sandbox)
      : backend_(backend),
        nvrtc_version_(nvrtc_version),
        compile_sandbox_(std::move(compile_sandbox)) {}

  grpc::Status ListDevices(grpc::ServerContext*, const v1::ListDevicesRequest*,
                           v1::ListDevicesResponse* response) override {
    auto devices = backend_->ListDevices();
    if (!devices.ok()) return ToGrpcStatus(devices.status());
    for (const backend::DeviceInfo& info : *devices) ToProto(info, response->add_devices());
    response->set_backend(backend_->name());
    response->set_driver_version(backend_->driver_version());
    response->set_nvrtc_version(nvrtc_version_);
    if (compile_sandbox_) response->set_compile_sandbox(compile_sandbox_());
    return grpc::Status::OK;
  }

 private:
  backend::Backend* backend_;
  int nvrtc_version_;
  std::function<std::string()> compile_sandbox_;
};

class MemoryServiceImpl final : public v1::MemoryService::Service {
 public:
  explicit MemoryServiceImpl(Session* session) : session_(session) {
    // The streamed transfers move raw messages: no copy of their bytes into or out of a
    // protobuf message (raw_messages.h).
    MarkMethodStreamed(
        MethodIndex("gpurpc.v1.MemoryService", "UploadStream"),
        new RawHandler<MemoryServiceImpl>(&MemoryServiceImpl::RawUploadStream, this));
    MarkMethodStreamed(
        MethodIndex("gpurpc.v1.MemoryService", "DownloadStream"),
        new RawHandler<MemoryServiceImpl>(&MemoryServiceImpl::RawDownloadStream, this));
  }

  grpc::Status Allocate(grpc::ServerContext*, const v1::AllocateRequest* request,
                        v1::AllocateResponse* response) override {
    auto fill = [&](v1::BufferInfo& info) { *response->mutable_buffer() = std::move(info); };
    if (!request->has_array()) return Answer(session_->Allocate(request->size_bytes()), fill);
    if (request->size_bytes() != 0) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          "Allocate: size_bytes must be 0 for an array (the server computes what it charges)"));
    }
    return Answer(session_->AllocateArray(request->array()), fill);
  }

  grpc::Status Free(grpc::ServerContext*, const v1::FreeRequest* request,
                    v1::FreeResponse*) override {
    return ToGrpcStatus(session_->Free(request->buffer_id()));
  }

  grpc::Status GetAllocation(grpc::ServerContext*, const v1::GetAllocationRequest* request,
                             v1::GetAllocationResponse* response) override {
    return Answer(session_->GetAllocation(*request),
                  [&](v1::BufferInfo& info) { *response->mutable_buffer() = std::move(info); });
  }

  grpc::Status GetMemInfo(grpc::ServerContext*, const v1::GetMemInfoRequest*,
                          v1::GetMemInfoResponse* response) override {
    return Answer(session_->GetMemInfo(), [&](const backend::MemInfo& info) {
      response->set_free_bytes(info.free_bytes);
      response->set_total_bytes(info.total_bytes);
    });
  }

  grpc::Status Upload(grpc::ServerContext*, const v1::UploadRequest* request,
                      v1::UploadResponse* response) override {
    if (request->data().size() > kMaxInlineBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrFormat("Upload: %d bytes exceed the unary limit of %d; use "
                                          "UploadStream",
                                          request->data().size(), kMaxInlineBytes));
    }
    auto address =
        session_->Resolve(request->destination(), request->data().size(), "Upload destination");
    if (!address.ok()) return ToGrpcStatus(address.status());
    absl::Status status = session_->Upload(*address, request->data().data(), request->data().size(),
                                           request->stream_id());
    if (status.ok()) response->set_bytes_written(request->data().size());
    return ToGrpcStatus(status);
  }

  grpc::Status Download(grpc::ServerContext*, const v1::DownloadRequest* request,
                        v1::DownloadResponse* response) override {
    if (request->size_bytes() > kMaxInlineBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrFormat("Download: %d bytes exceed the unary limit of %d; "
                                          "use DownloadStream",
                                          request->size_bytes(), kMaxInlineBytes));
    }
    auto address = session_->Resolve(request->source(), request->size_bytes(), "Download source");
    if (!address.ok()) return ToGrpcStatus(address.status());
    std::string* data = response->mutable_data();
    data->resize(request->size_bytes());
    return ToGrpcStatus(
        session_->Download(*address, data->data(), data->size(), request->stream_id()));
  }

  grpc::Status RawUploadStream(grpc::ServerContext*, RawStream* stream) {
    GrpcMessages messages(stream);
    return ServeUploadStream(session_, &messages);
  }

  grpc::Status RawDownloadStream(grpc::ServerContext*, RawStream* stream) {
    GrpcMessages messages(stream);
    return ServeDownloadStream(session_, &messages);
  }

  grpc::Status Memset(grpc::ServerContext*, const v1::MemsetRequest* request,
                      v1::MemsetResponse*) override {
    v1::MemsetCommand command;
    *command.mutable_destination() = request->destination();
    command.set_value(request->value());
    command.set_element_size_bytes(request->element_size_bytes());
    command.set_count(request->count());
    command.set_stream_id(request->stream_id());
    return ToGrpcStatus(session_->Memset(command));
  }

  grpc::Status CopyDeviceToDevice(grpc::ServerContext*,
                                  const v1::CopyDeviceToDeviceRequest* request,
                                  v1::CopyDeviceToDeviceResponse*) override {
    v1::CopyCommand command;
    *command.mutable_destination() = request->destination();
    *command.mutable_source() = request->source();
    command.set_size_bytes(request->size_bytes());
    command.set_stream_id(request->stream_id());
    return ToGrpcStatus(session_->Copy(command));
  }

 private:
  Session* session_;
};

class ModuleServiceImpl final : public v1::ModuleService::Service {
 public:
  explicit ModuleServiceImpl(Session* session) : session_(session) {}

  grpc::Status Compile(grpc::ServerContext*, const v1::CompileRequest* request,
                       v1::CompileResponse* response) override {
    return Answer(session_->Compile(*request),
                  [&](v1::CompileResponse& result) { *response = std::move(result); });
  }

  grpc::Status LoadModule(grpc::ServerContext*, const v1::LoadModuleRequest* request,
                          v1::LoadModuleResponse* response) override {
    uint64_t device_memory_bytes = 0;
    return Answer(session_->LoadModule(request->image(), &device_memory_bytes), [&](uint64_t id) {
      response->set_module_id(id);
      response->set_device_memory_bytes(device_memory_bytes);
    });
  }

  grpc::Status LinkModule(grpc::ServerContext*, const v1::LinkModuleRequest* request,
                          v1::LinkModuleResponse* response) override {
    return Answer(session_->LinkModule(*request),
                  [&](v1::LinkModuleResponse& result) { *response = std::move(result); });
  }

  grpc::Status UnloadModule(grpc::ServerContext*, const v1::UnloadModuleRequest* request,
                            v1::UnloadModuleResponse*) override {
    return ToGrpcStatus(session_->UnloadModule(request->module_id()));
  }

  grpc::Status GetFunction(grpc::ServerContext*, const v1::GetFunctionRequest* request,
                           v1::GetFunctionResponse* response) override {
    return Answer(session_->GetFunction(request->module_id(), request->name()),
                  [&](v1::GetFunctionResponse& result) { *response = std::move(result); });
  }

  grpc::Status GetGlobal(grpc::ServerContext*, const v1::GetGlobalRequest* request,
                         v1::GetGlobalResponse* response) override {
    return Answer(session_->GetGlobal(request->module_id(), request->name()),
                  [&](v1::GetGlobalResponse& result) { *response = std::move(result); });
  }

  // Enum fields are open in proto3: an unknown value arrives as its number, which the
  // session checks.
  grpc::Status SetContextLimit(grpc::ServerContext*, const v1::SetContextLimitRequest* request,
                               v1::SetContextLimitResponse* response) override {
    return Answer(session_->SetContextLimit(static_cast<int>(request->limit()), request->value()),
                  [&](v1::SetContextLimitResponse& result) { *response = std::move(result); });
  }

  grpc::Status GetContextLimit(grpc::ServerContext*, const v1::GetContextLimitRequest* request,
                               v1::GetContextLimitResponse* response) override {
    return Answer(session_->GetContextLimit(static_cast<int>(request->limit())),
                  [&](uint64_t value) { response->set_value(value); });
  }

  grpc::Status SetProfiling(grpc::ServerContext*, const v1::SetProfilingRequest* request,
                            v1::SetProfilingResponse* response) override {
    return Answer(session_->SetProfiling(request->enabled()),
                  [&](bool was_enabled) { response->set_was_enabled(was_enabled); });
  }

  grpc::Status SetCacheConfig(grpc::ServerContext*, const v1::SetCacheConfigRequest* request,
                              v1::SetCacheConfigResponse*) override {
    return ToGrpcStatus(session_->SetCacheConfig(static_cast<int>(request->config())));
  }

  grpc::Status GetCacheConfig(grpc::ServerContext*, const v1::GetCacheConfigRequest*,
                              v1::GetCacheConfigResponse* response) override {
    return Answer(session_->GetCacheConfig(),
                  [&](int config) { response->set_config(static_cast<v1::CacheConfig>(config)); });
  }

  grpc::Status SetSharedConfig(grpc::ServerContext*, const v1::SetSharedConfigRequest* request,
                               v1::SetSharedConfigResponse*) override {
    return ToGrpcStatus(
        session_->SetSharedConfig(static_cast<int>(request->config()), request->function_id()));
  }

  grpc::Status GetSharedConfig(grpc::ServerContext*, const v1::GetSharedConfigRequest*,
                               v1::GetSharedConfigResponse* response) override {
    return Answer(session_->GetSharedConfig(),
                  [&](int config) { response->set_config(static_cast<v1::SharedConfig>(config)); });
  }

  grpc::Status SetFunctionAttribute(grpc::ServerContext*,
                                    const v1::SetFunctionAttributeRequest* request,
                                    v1::SetFunctionAttributeResponse* response) override {
    return Answer(
        session_->SetFunctionAttribute(request->function_id(),
                                       static_cast<int>(request->attribute()), request->value()),
        [&](v1::SetFunctionAttributeResponse& result) { *response = std::move(result); });
  }

  grpc::Status SetFunctionCacheConfig(grpc::ServerContext*,
                                      const v1::SetFunctionCacheConfigRequest* request,
                                      v1::SetFunctionCacheConfigResponse*) override {
    return ToGrpcStatus(session_->SetFunctionCacheConfig(request->function_id(),
                                                         static_cast<int>(request->config())));
  }

 private:
  Session* session_;
};

class ExecutionServiceImpl final : public v1::ExecutionService::Service {
 public:
  using grpc::Service::GetHandler;  // for ParseCheckedService
  explicit ExecutionServiceImpl(Session* session) : session_(session) {
    // Raw messages: a batch that does not parse is refused naming it (raw_messages.h).
    MarkMethodStreamed(
        MethodIndex("gpurpc.v1.ExecutionService", "CommandStream"),
        new RawHandler<ExecutionServiceImpl>(&ExecutionServiceImpl::RawCommandStream, this));
  }

  grpc::Status CreateStream(grpc::ServerContext*, const v1::CreateStreamRequest* request,
                            v1::CreateStreamResponse* response) override {
    return Answer(session_->CreateStream(request->non_blocking()),
                  [&](uint64_t id) { response->set_stream_id(id); });
  }
  grpc::Status DestroyStream(grpc::ServerContext*, const v1::DestroyStreamRequest* request,
                             v1::DestroyStreamResponse*) override {
    return ToGrpcStatus(session_->DestroyStream(request->stream_id()));
  }
  grpc::Status SynchronizeStream(grpc::ServerContext*, const v1::SynchronizeStreamRequest* request,
                                 v1::SynchronizeStreamResponse* response) override {
    return AnswerSynchronized(session_->SynchronizeStream(request->stream_id()), *session_,
                              response);
  }
  grpc::Status QueryStream(grpc::ServerContext*, const v1::QueryStreamRequest* request,
                           v1::QueryStreamResponse* response) override {
    return Answer(session_->QueryStream(request->stream_id()),
                  [&](bool done) { response->set_done(done); });
  }
  grpc::Status SynchronizeSession(grpc::ServerContext*, const v1::SynchronizeSessionRequest*,
                                  v1::SynchronizeSessionResponse* response) override {
    return AnswerSynchronized(session_->Synchronize(), *session_, response);
  }
  grpc::Status CreateEvent(grpc::ServerContext*, const v1::CreateEventRequest* request,
                           v1::CreateEventResponse* response) override {
    return Answer(session_->CreateEvent(request->disable_timing(), request->blocking_sync(),
                                        request->interprocess()),
                  [&](uint64_t id) { response->set_event_id(id); });
  }
  grpc::Status DestroyEvent(grpc::ServerContext*, const v1::DestroyEventRequest* request,
                            v1::DestroyEventResponse*) override {
    return ToGrpcStatus(session_->DestroyEvent(request->event_id()));
  }
  grpc::Status RecordEvent(grpc::ServerContext*, const v1::RecordEventRequest* request,
                           v1::RecordEventResponse*) override {
    return ToGrpcStatus(session_->RecordEvent(request->event_id(), request->stream_id()));
  }
  grpc::Status QueryEvent(grpc::ServerContext*, const v1::QueryEventRequest* request,
                          v1::QueryEventResponse* response) override {
    return Answer(session_->QueryEvent(request->event_id()),
                  [&](bool done) { response->set_done(done); });
  }
  grpc::Status SynchronizeEvent(grpc::ServerContext*, const v1::SynchronizeEventRequest* request,
                                v1::SynchronizeEventResponse* response) override {
    return AnswerSynchronized(session_->SynchronizeEvent(request->event_id()), *session_, response);
  }
  grpc::Status EventElapsedTime(grpc::ServerContext*, const v1::EventElapsedTimeRequest* request,
                                v1::EventElapsedTimeResponse* response) override {
    return Answer(session_->ElapsedTime(request->start_event_id(), request->end_event_id()),
                  [&](float ms) { response->set_elapsed_ms(ms); });
  }
  grpc::Status StreamWaitEvent(grpc::ServerContext*, const v1::StreamWaitEventRequest* request,
                               v1::StreamWaitEventResponse*) override {
    return ToGrpcStatus(session_->StreamWaitEvent(request->stream_id(), request->event_id()));
  }
  grpc::Status Launch(grpc::ServerContext*, const v1::LaunchRequest* request,
                      v1::LaunchResponse* response) override {
    if (!request->synchronize()) return ToGrpcStatus(session_->Launch(request->launch()));
    response->set_synchronized(true);
    return AnswerSynchronized(session_->LaunchAndSynchronize(request->launch()), *session_,
                              response);
  }

  // CUDA graphs.
  grpc::Status BeginCapture(grpc::ServerContext*, const v1::BeginCaptureRequest* request,
                            v1::BeginCaptureResponse*) override {
    return ToGrpcStatus(session_->BeginCapture(request->stream_id(), request->mode()));
  }
  grpc::Status EndCapture(grpc::ServerContext*, const v1::EndCaptureRequest* request,
                          v1::EndCaptureResponse* response) override {
    return Answer(session_->EndCapture(request->stream_id()),
                  [&](v1::EndCaptureResponse& r) { *response = std::move(r); });
  }
  grpc::Status GetCaptureInfo(grpc::ServerContext*, const v1::GetCaptureInfoRequest* request,
                              v1::GetCaptureInfoResponse* response) override {
    return Answer(session_->GetCaptureInfo(request->stream_id()),
                  [&](v1::GetCaptureInfoResponse& r) { *response = std::move(r); });
  }
  grpc::Status InstantiateGraph(grpc::ServerContext*, const v1::InstantiateGraphRequest* request,
                                v1::InstantiateGraphResponse* response) override {
    return Answer(session_->InstantiateGraph(request->graph_id()),
                  [&](uint64_t id) { response->set_graph_exec_id(id); });
  }
  grpc::Status LaunchGraph(grpc::ServerContext*, const v1::LaunchGraphRequest* request,
                           v1::LaunchGraphResponse*) override {
    return ToGrpcStatus(session_->LaunchGraph(request->launch()));
  }
  grpc::Status DestroyGraph(grpc::ServerContext*, const v1::DestroyGraphRequest* request,
                            v1::DestroyGraphResponse*) override {
    return ToGrpcStatus(session_->DestroyGraph(request->graph_id()));
  }
  grpc::Status DestroyGraphExec(grpc::ServerContext*, const v1::DestroyGraphExecRequest* request,
                                v1::DestroyGraphExecResponse*) override {
    return ToGrpcStatus(session_->DestroyGraphExec(request->graph_exec_id()));
  }
  grpc::Status GetGraphNodes(grpc::ServerContext*, const v1::GetGraphNodesRequest* request,
                             v1::GetGraphNodesResponse* response) override {
    return Answer(session_->GetGraphNodes(request->graph_id()),
                  [&](v1::GetGraphNodesResponse& r) { *response = std::move(r); });
  }
  grpc::Status UpdateGraphExec(grpc::ServerContext*, const v1::UpdateGraphExecRequest* request,
                               v1::UpdateGraphExecResponse*) override {
    return ToGrpcStatus(session_->UpdateGraphExec(request->graph_exec_id(), request->graph_id()));
  }
  grpc::Status SetGraphExecKernelNodeArgs(grpc::ServerContext*,
                                          const v1::SetGraphExecKernelNodeArgsRequest* request,
                                          v1::SetGraphExecKernelNodeArgsResponse*) override {
    return ToGrpcStatus(session_->SetGraphExecKernelNodeArgs(*request));
  }

  // CommandStream (raw messages, parsed here: see raw_messages.h).
  grpc::Status RawCommandStream(grpc::ServerContext*, RawStream* stream) {
    grpc::ByteBuffer raw;
    v1::CommandBatch batch;
    v1::CommandReply reply;
    uint64_t last_sequence = 0;
    uint64_t index = 0;
    while (stream->Read(&raw)) {
      ++index;
      // What the batch would take once parsed, before it is (server/parse_limit.h): the
      // direct server has no front end in front of it to check.
      if (absl::Status size =
              CheckParsedBytes(*v1::CommandBatch::descriptor(), raw,
                               [&] { return absl::StrFormat("CommandStream message %d", index); });
          !size.ok()) {
        return ToGrpcStatus(size);
      }
      if (!ParseRaw(raw, &batch)) {
        return NotParsed("/gpurpc.v1.ExecutionService/CommandStream", index,
                         "gpurpc.v1.CommandBatch");
      }
      raw.Clear();
      reply.Clear();
      absl::Status status = AnswerBatch(session_, batch, &last_sequence, &reply);
      if (!status.ok() && status.code() == absl::StatusCode::kInvalidArgument) {
        return ToGrpcStatus(status);  // a protocol error (sequence numbers)
      }
      stream->Write(SerializeRaw(reply));
      if (!status.ok()) return ToGrpcStatus(status);  // a sticky fault ends the stream
    }
    return grpc::Status::OK;
  }

 private:
  Session* session_;
};

class HostRegionServiceImpl final : public v1::HostRegionService::Service {
 public:
  explicit HostRegionServiceImpl(Session* session) : session_(session) {}

  grpc::Status RegisterHostRegion(grpc::ServerContext*,
                                  const v1::RegisterHostRegionRequest* request,
                                  v1::RegisterHostRegionResponse* response) override {
    return Answer(session_->RegisterHostRegion(request->size_bytes()),
                  [&](v1::RegisterHostRegionResponse& r) { *response = std::move(r); });
  }
  grpc::Status UnregisterHostRegion(grpc::ServerContext*,
                                    const v1::UnregisterHostRegionRequest* request,
                                    v1::UnregisterHostRegionResponse*) override {
    return ToGrpcStatus(session_->UnregisterHostRegion(request->region_id()));
  }
  grpc::Status CopyHostRegion(grpc::ServerContext*, const v1::CopyHostRegionRequest* request,
                              v1::CopyHostRegionResponse*) override {
    v1::RegionCopyCommand command;
    command.set_region_id(request->region_id());
    command.set_region_offset_bytes(request->region_offset_bytes());
    *command.mutable_device() = request->device();
    command.set_size_bytes(request->size_bytes());
    command.set_to_device(request->to_device());
    command.set_stream_id(request->stream_id());
    return ToGrpcStatus(session_->CopyHostRegion(command));
  }
  grpc::Status OpenDirectChannel(grpc::ServerContext*, const v1::OpenDirectChannelRequest*,
                                 v1::OpenDirectChannelResponse* response) override {
    return Answer(session_->OpenDirectChannel(),
                  [&](v1::OpenDirectChannelResponse& r) { *response = std::move(r); });
  }

 private:
  Session* session_;
};

// The front end's private control calls (never relayed from clients).
class WorkerControlImpl final : public internal::v1::WorkerControl::Service {
 public:
  explicit WorkerControlImpl(Session* session) : session_(session) {}

  grpc::Status Bind(grpc::ServerContext*, const internal::v1::BindRequest* request,
                    internal::v1::BindResponse*) override {
    Session::Limits limits;
    limits.max_streams = request->quota().max_streams_per_session();
    limits.max_events = request->quota().max_events_per_session();
    limits.max_modules = request->quota().max_modules_per_session();
    limits.max_concurrent_compiles = request->quota().max_concurrent_compiles();
    limits.kernel_timeout_ms = request->quota().kernel_timeout_ms();
    limits.max_host_region_bytes = request->max_host_region_bytes_per_session();
    limits.max_device_memory_bytes = request->quota().max_device_memory_bytes();
    return ToGrpcStatus(session_->Bind(request->tenant(), limits));
  }

  grpc::Status ExportMemory(grpc::ServerContext*, const internal::v1::ExportMemoryRequest* request,
                            internal::v1::ExportMemoryResponse* response) override {
    return Answer(session_->ExportMemory(request->buffer_id()),
                  [&](Session::ExportedMemory& exported) {
                    response->set_ipc_handle(std::move(exported.ipc_handle));
                    response->set_size_bytes(exported.size_bytes);
                  });
  }

  grpc::Status OpenMemoryHandle(grpc::ServerContext*,
                                const internal::v1::OpenMemoryHandleRequest* request,
                                internal::v1::OpenMemoryHandleResponse* response) override {
    return Answer(session_->OpenExportedMemory(request->ipc_handle(), request->size_bytes()),
                  [&](v1::BufferInfo& info) { *response->mutable_buffer() = std::move(info); });
  }

  grpc::Status ExportEvent(grpc::ServerContext*, const internal::v1::ExportEventRequest* request,
                           internal::v1::ExportEventResponse* response) override {
    return Answer(session_->ExportEvent(request->event_id()),
                  [&](std::string& handle) { response->set_ipc_handle(std::move(handle)); });
  }

  grpc::Status OpenEventHandle(grpc::ServerContext*,
                               const internal::v1::OpenEventHandleRequest* request,
                               internal::v1::OpenEventHandleResponse* response) override {
    return Answer(session_->OpenExportedEvent(request->ipc_handle()),
                  [&](uint64_t id) { response->set_event_id(id); });
  }

 private:
  Session* session_;
};

}  // namespace

void ToProto(const backend::DeviceInfo& info, v1::DeviceInfo* out) {
  out->set_ordinal(info.ordinal);
  out->set_name(info.name);
  out->set_compute_capability_major(info.compute_capability_major);
  out->set_compute_capability_minor(info.compute_capability_minor);
  out->set_total_memory_bytes(info.total_memory_bytes);
  out->set_multiprocessor_count(info.multiprocessor_count);
  out->set_max_threads_per_block(info.max_threads_per_block);
  SetDim(info.max_block_dim, out->mutable_max_block_dim());
  SetDim(info.max_grid_dim, out->mutable_max_grid_dim());
  out->set_max_shared_memory_per_block_bytes(info.max_shared_memory_per_block_bytes);
  out->set_max_shared_memory_per_block_optin_bytes(info.max_shared_memory_per_block_optin_bytes);
  out->set_warp_size(info.warp_size);
  out->set_pci_bus_id(info.pci_bus_id);
  for (const auto& [attribute, value] : info.attributes)
    (*out->mutable_attributes())[attribute] = value;
  out->set_is_fake(info.is_fake);
}

std::vector<std::unique_ptr<grpc::Service>> MakeDirectServices(Session* session) {
  std::vector<std::unique_ptr<grpc::Service>> services;
  // No front end relays these calls, so the requests are checked here before gRPC parses
  // them (server/parse_checked_service.h).
  services.push_back(std::make_unique<ParseCheckedService>(
      std::make_unique<ExecutionServiceImpl>(session), v1::ExecutionService::service_full_name()));
  return services;
}

std::vector<std::unique_ptr<grpc::Service>> MakeWorkerServices(
    backend::Backend* backend, Session* session, int nvrtc_version,
    std::function<std::string()> compile_sandbox) {
  std::vector<std::unique_ptr<grpc::Service>> services;
  services.push_back(
      std::make_unique<DeviceServiceImpl>(backend, nvrtc_version, std::move(compile_sandbox)));
  if (session != nullptr) {
    services.push_back(std::make_unique<MemoryServiceImpl>(session));
    services.push_back(std::make_unique<ModuleServiceImpl>(session));
    services.push_back(std::make_unique<ExecutionServiceImpl>(session));
    services.push_back(std::make_unique<HostRegionServiceImpl>(session));
    services.push_back(std::make_unique<WorkerControlImpl>(session));
  }
  return services;
}

namespace {

// Adds `name` of `service` (served by `impl`) to `handlers`. The name must be a unary method
// of the generated service whose request is `Request` (else a programming error: abort).
template <typename Impl, typename Base, typename Request, typename Response, typename Entry>
void AddRelayed(std::map<std::string, Entry>* handlers, Impl* impl, const char* service,
                const char* name,
                grpc::Status (Base::*method)(grpc::ServerContext*, const Request*, Response*)) {
  const google::protobuf::MethodDescriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
          absl::StrFormat("%s.%s", service, name));
  if (descriptor == nullptr || descriptor->client_streaming() || descriptor->server_streaming() ||
      descriptor->input_type() != Request::descriptor()) {
    std::fprintf(stderr, "gpurpc worker: %s.%s is not a unary method taking %s\n", service, name,
                 Request::descriptor()->full_name().c_str());
    std::abort();
  }
  const std::string path = absl::StrFormat("/%s/%s", service, name);
  Entry entry;
  entry.request = Request::descriptor();
  entry.handler = [impl, method, path](const std::string& bytes, std::string* out) {
    Request request;
    if (!request.ParseFromString(bytes)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, NotParsedRequestMessage(path));
    }
    Response response;
    // The handlers never read their ServerContext (none exists on a framed channel).
    grpc::Status status = (impl->*method)(nullptr, &request, &response);
    if (status.ok() && !response.SerializeToString(out)) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrFormat("%s: the response could not be serialized", path));
    }
    return status;
  };
  handlers->emplace(path, std::move(entry));
}

}  // namespace

RelayedUnaryCalls::RelayedUnaryCalls(Session* session) {
  auto memory = std::make_unique<MemoryServiceImpl>(session);
  auto module = std::make_unique<ModuleServiceImpl>(session);
  auto execution = std::make_unique<ExecutionServiceImpl>(session);
  auto region = std::make_unique<HostRegionServiceImpl>(session);
  auto* const h = &handlers_;
  {
    using S = MemoryServiceImpl;
    S* const i = memory.get();
    const char* const n = "gpurpc.v1.MemoryService";
    AddRelayed(h, i, n, "Allocate", &S::Allocate);
    AddRelayed(h, i, n, "Free", &S::Free);
    AddRelayed(h, i, n, "GetAllocation", &S::GetAllocation);
    AddRelayed(h, i, n, "GetMemInfo", &S::GetMemInfo);
    AddRelayed(h, i, n, "Upload", &S::Upload);
    AddRelayed(h, i, n, "Download", &S::Download);
    AddRelayed(h, i, n, "Memset", &S::Memset);
    AddRelayed(h, i, n, "CopyDeviceToDevice", &S::CopyDeviceToDevice);
  }
  {
    using S = ModuleServiceImpl;
    S* const i = module.get();
    const char* const n = "gpurpc.v1.ModuleService";
    AddRelayed(h, i, n, "Compile", &S::Compile);
    AddRelayed(h, i, n, "LoadModule", &S::LoadModule);
    AddRelayed(h, i, n, "LinkModule", &S::LinkModule);
    AddRelayed(h, i, n, "UnloadModule", &S::UnloadModule);
    AddRelayed(h, i, n, "GetFunction", &S::GetFunction);
    AddRelayed(h, i, n, "GetGlobal", &S::GetGlobal);
    AddRelayed(h, i, n, "SetContextLimit", &S::SetContextLimit);
    AddRelayed(h, i, n, "GetContextLimit", &S::GetContextLimit);
    AddRelayed(h, i, n, "SetCacheConfig", &S::SetCacheConfig);
    AddRelayed(h, i, n, "GetCacheConfig", &S::GetCacheConfig);
    AddRelayed(h, i, n, "SetSharedConfig", &S::SetSharedConfig);
    AddRelayed(h, i, n, "GetSharedConfig", &S::GetSharedConfig);
    AddRelayed(h, i, n, "SetFunctionAttribute", &S::SetFunctionAttribute);
    AddRelayed(h, i, n, "SetFunctionCacheConfig", &S::SetFunctionCacheConfig);
    AddRelayed(h, i, n, "SetProfiling", &S::SetProfiling);
  }
  {
    using S = ExecutionServiceImpl;
    S* const i = execution.get();
    const char* const n = "gpurpc.v1.ExecutionService";
    AddRelayed(h, i, n, "CreateStream", &S::CreateStream);
    AddRelayed(h, i, n, "DestroyStream", &S::DestroyStream);
    AddRelayed(h, i, n, "SynchronizeStream", &S::SynchronizeStream);
    AddRelayed(h, i, n, "QueryStream", &S::QueryStream);
    AddRelayed(h, i, n, "SynchronizeSession", &S::SynchronizeSession);
    AddRelayed(h, i, n, "CreateEvent", &S::CreateEvent);
    AddRelayed(h, i, n, "DestroyEvent", &S::DestroyEvent);
    AddRelayed(h, i, n, "RecordEvent", &S::RecordEvent);
    AddRelayed(h, i, n, "QueryEvent", &S::QueryEvent);
    AddRelayed(h, i, n, "SynchronizeEvent", &S::SynchronizeEvent);
    AddRelayed(h, i, n, "EventElapsedTime", &S::EventElapsedTime);
    AddRelayed(h, i, n, "StreamWaitEvent", &S::StreamWaitEvent);
    AddRelayed(h, i, n, "Launch", &S::Launch);
    AddRelayed(h, i, n, "BeginCapture", &S::BeginCapture);
    AddRelayed(h, i, n, "EndCapture", &S::EndCapture);
    AddRelayed(h, i, n, "GetCaptureInfo", &S::GetCaptureInfo);
    AddRelayed(h, i, n, "InstantiateGraph", &S::InstantiateGraph);
    AddRelayed(h, i, n, "LaunchGraph", &S::LaunchGraph);
    AddRelayed(h, i, n, "DestroyGraph", &S::DestroyGraph);
    AddRelayed(h, i, n, "DestroyGraphExec", &S::DestroyGraphExec);
    AddRelayed(h, i, n, "GetGraphNodes", &S::GetGraphNodes);
    AddRelayed(h, i, n, "UpdateGraphExec", &S::UpdateGraphExec);
    AddRelayed(h, i, n, "SetGraphExecKernelNodeArgs", &S::SetGraphExecKernelNodeArgs);
  }
  {
    using S = HostRegionServiceImpl;
    S* const i = region.get();
    const char* const n = "gpurpc.v1.HostRegionService";
    AddRelayed(h, i, n, "RegisterHostRegion", &S::RegisterHostRegion);
    AddRelayed(h, i, n, "UnregisterHostRegion", &S::UnregisterHostRegion);
    AddRelayed(h, i, n, "CopyHostRegion", &S::CopyHostRegion);
    AddRelayed(h, i, n, "OpenDirectChannel", &S::OpenDirectChannel);
  }
  services_.push_back(std::move(memory));
  services_.push_back(std::move(module));
  services_.push_back(std::move(execution));
  services_.push_back(std::move(region));
}

RelayedUnaryCalls::~RelayedUnaryCalls() = default;

const RelayedUnaryCalls::Handler* RelayedUnaryCalls::Find(const std::string& method) const {
  const auto found = handlers_.find(method);
  return found == handlers_.end() ? nullptr : &found->second.handler;
}

const google::protobuf::Descriptor* RelayedUnaryCalls::RequestType(
    const std::string& method) const {
  const auto found = handlers_.find(method);
  return found == handlers_.end() ? nullptr : found->second.request;
}

}  // namespace gpurpc::worker
