#include "server/frontend/services.h"

#include <thread>

#include "absl/strings/str_format.h"
#include "common/grpc_status.h"

namespace gpurpc::frontend {

grpc::ServerUnaryReactor* DeviceServiceImpl::ListDevices(grpc::CallbackServerContext* context,
                                                         const v1::ListDevicesRequest*,
                                                         v1::ListDevicesResponse* response) {
  *response = sessions_->inventory();
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* DeviceServiceImpl::GetDevice(grpc::CallbackServerContext* context,
                                                       const v1::GetDeviceRequest* request,
                                                       v1::GetDeviceResponse* response) {
  auto* reactor = context->DefaultReactor();
  for (const v1::DeviceInfo& device : sessions_->inventory().devices()) {
    if (device.ordinal() == request->ordinal()) {
      *response->mutable_device() = device;
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
  }
  reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                               absl::StrFormat("no device with ordinal %d", request->ordinal())));
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::OpenSession(grpc::CallbackServerContext* context,
                                                          const v1::OpenSessionRequest* request,
                                                          v1::OpenSessionResponse* response) {
  auto* reactor = context->DefaultReactor();
  // Taking a worker may mean starting one (context creation takes ~100 ms): not on a
  // gRPC callback thread.
  std::thread([this, reactor, request, response] {
    auto session = sessions_->Open(request->device_ordinal(), request->client_label());
    if (!session.ok()) {
      reactor->Finish(ToGrpcStatus(session.status()));
      return;
    }
    response->set_session_id((*session)->id());
    for (const v1::DeviceInfo& device : sessions_->inventory().devices()) {
      if (device.ordinal() == request->device_ordinal()) *response->mutable_device() = device;
    }
    response->set_idle_timeout_ms(absl::ToInt64Milliseconds(sessions_->idle_timeout()));
    reactor->Finish(grpc::Status::OK);
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::CloseSession(grpc::CallbackServerContext* context,
                                                           const v1::CloseSessionRequest*,
                                                           v1::CloseSessionResponse*) {
  auto* reactor = context->DefaultReactor();
  auto session = sessions_->FindFromMetadata(context->client_metadata());
  if (!session.ok()) {
    reactor->Finish(ToGrpcStatus(session.status()));
    return reactor;
  }
  const uint64_t id = (*session)->id();
  session->reset();
  std::thread([this, reactor, id] {
    reactor->Finish(ToGrpcStatus(sessions_->Close(id)));
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::KeepAlive(grpc::CallbackServerContext* context,
                                                        const v1::KeepAliveRequest*,
                                                        v1::KeepAliveResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto session = sessions_->FindFromMetadata(context->client_metadata());
  if (!session.ok()) {
    reactor->Finish(ToGrpcStatus(session.status()));
    return reactor;
  }
  (*session)->Touch();
  response->set_state((*session)->state());
  response->set_fault_cause((*session)->fault_cause());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace gpurpc::frontend
