// The worker's gRPC edge: the session-scoped gpurpc.v1 services, served over the private
// socketpair to the front end. Each RPC converts protobuf to Session calls and the result
// back with the one ToGrpcStatus.
#ifndef GPURPC_SERVER_WORKER_SERVICE_H_
#define GPURPC_SERVER_WORKER_SERVICE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpurpc/v1/device_service.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/service_type.h"
#include "server/worker/backend/backend.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

// Fills a proto DeviceInfo.
void ToProto(const backend::DeviceInfo& info, v1::DeviceInfo* out);

// Builds the services of one worker. `session` is null in inventory mode (device listing
// only). Neither pointer is owned; both outlive the services. `compile_sandbox`, when set,
// answers ListDevicesResponse.compile_sandbox (it may block until the worker's sandbox
// probe is done); the inventory worker sets it, session workers leave it empty.
std::vector<std::unique_ptr<grpc::Service>> MakeWorkerServices(
    backend::Backend* backend, Session* session, int nvrtc_version,
    std::function<std::string()> compile_sandbox = nullptr);

// The services of a session's direct channels (HostRegionService.OpenDirectChannel): only
// ExecutionService, whose calls the front end does not account for.
std::vector<std::unique_ptr<grpc::Service>> MakeDirectServices(Session* session);

// The messages of one streamed transfer, raw (raw_messages.h), whichever way they travel:
// the worker's gRPC server (MemoryService's UploadStream and DownloadStream), or the front
// end's framed transfer channel (ServeRelayedTransfer, framed_commands.h).
class RawMessages {
 public:
  virtual ~RawMessages() = default;
  // The client's next message; false once there is none (the client half-closed, left, or
  // the carrier broke).
  virtual bool Read(grpc::ByteBuffer* message) = 0;
  // Sends `message` to the client; false when it cannot go (the client left).
  virtual bool Write(const grpc::ByteBuffer& message) = 0;
};

// The handlers of MemoryService.UploadStream and DownloadStream, on either carrier: each
// checks every message it reads (sizes, fields, the destination or source range) and
// returns the call's status; an upload writes its UploadResponse before returning OK.
grpc::Status ServeUploadStream(Session* session, RawMessages* stream);
grpc::Status ServeDownloadStream(Session* session, RawMessages* stream);

// The unary methods of the session services (Memory, Module, Execution, HostRegion), for the
// front end's framed unary channels (ServeRelayedUnaryCalls, framed_commands.h): each runs
// the method's own gRPC handler, the one the worker's gRPC server runs, on a request's
// serialized bytes. `session` is not owned and outlives this object.
class RelayedUnaryCalls {
 public:
  // Parses `request` as the method's request type (INVALID_ARGUMENT as the worker's gRPC
  // server answers one that does not parse, NotParsedRequestMessage), runs the handler and,
  // for OK, serializes its response into `response`. Returns the handler's status.
  using Handler = std::function<grpc::Status(const std::string& request, std::string* response)>;

  explicit RelayedUnaryCalls(Session* session);
  ~RelayedUnaryCalls();
  RelayedUnaryCalls(const RelayedUnaryCalls&) = delete;
  RelayedUnaryCalls& operator=(const RelayedUnaryCalls&) = delete;

  // The handler of `method` ("/gpurpc.v1.ExecutionService/Launch"), null when it is not a
  // unary method of the session services.
  const Handler* Find(const std::string& method) const;
  // Its request type, for the parse bound (null as above).
  const google::protobuf::Descriptor* RequestType(const std::string& method) const;
  size_t size() const { return handlers_.size(); }

 private:
  struct Entry {
    Handler handler;
    const google::protobuf::Descriptor* request;
  };
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::map<std::string, Entry> handlers_;
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_SERVICE_H_
