// The worker's gRPC edge: the session-scoped gpurpc.v1 services, served over the private
// socketpair to the front end. Each RPC converts protobuf to Session calls and the result
// back with the one ToGrpcStatus.
#ifndef GPURPC_SERVER_WORKER_SERVICE_H_
#define GPURPC_SERVER_WORKER_SERVICE_H_

#include <functional>
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

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_SERVICE_H_
