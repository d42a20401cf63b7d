#include "server/frontend/services.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr size_t kMaxClientLabelBytes = 256;

// Answers `reactor` with `status` and returns it, for the early exits below.
grpc::ServerUnaryReactor* Fail(grpc::ServerUnaryReactor* reactor, const absl::Status& status) {
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* DeviceServiceImpl::ListDevices(grpc::CallbackServerContext* context,
                                                         const v1::ListDevicesRequest*,
                                                         v1::ListDevicesResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (auto identity = auth_->Authenticate(*context); !identity.ok()) {
    return Fail(reactor, identity.status());
  }
  *response = sessions_->inventory();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* DeviceServiceImpl::GetDevice(grpc::CallbackServerContext* context,
                                                       const v1::GetDeviceRequest* request,
                                                       v1::GetDeviceResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (auto identity = auth_->Authenticate(*context); !identity.ok()) {
    return Fail(reactor, identity.status());
  }
  for (const v1::DeviceInfo& device : sessions_->inventory().devices()) {
    if (device.ordinal() == request->ordinal()) {
      *response->mutable_device() = device;
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
  }
  return Fail(reactor, absl::NotFoundError(
                           absl::StrFormat("no device with ordinal %d", request->ordinal())));
}

grpc::ServerUnaryReactor* DeviceServiceImpl::GetServerInfo(grpc::CallbackServerContext* context,
                                                           const v1::GetServerInfoRequest*,
                                                           v1::GetServerInfoResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  response->set_version(GPURPC_VERSION);
  response->set_tenant(identity->tenant);
  response->set_auth_method(identity->method);
  response->set_admin(auth_->IsAdmin(identity->tenant));
  *response->mutable_quota() = sessions_->options().QuotaFor(identity->tenant);
  const TenantUsage usage = sessions_->Usage(identity->tenant);
  response->set_sessions_open(usage.sessions);
  response->set_device_memory_bytes(usage.device_memory_bytes);
  response->set_compile_sandbox(sessions_->inventory().compile_sandbox());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::OpenSession(grpc::CallbackServerContext* context,
                                                          const v1::OpenSessionRequest* request,
                                                          v1::OpenSessionResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  if (request->client_label().size() > kMaxClientLabelBytes) {
    return Fail(reactor, absl::InvalidArgumentError(absl::StrFormat(
                             "client_label is %d bytes; the limit is %d",
                             request->client_label().size(), kMaxClientLabelBytes)));
  }
  // Taking a worker may mean starting one (context creation takes ~100 ms): not on a
  // gRPC callback thread.
  std::thread([this, reactor, request, response, identity = *std::move(identity)] {
    auto session = sessions_->Open(request->device_ordinal(), request->client_label(),
                                   identity.tenant, identity.peer);
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
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
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
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  (*session)->Touch();
  response->set_state((*session)->state());
  response->set_fault_cause((*session)->fault_cause());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListSessions(grpc::CallbackServerContext* context,
                                                         const v1::ListSessionsRequest* request,
                                                         v1::ListSessionsResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  if (!auth_->IsAdmin(identity->tenant)) {
    return Fail(reactor, absl::PermissionDeniedError(absl::StrFormat(
                             "tenant '%s' is not an admin of this daemon", identity->tenant)));
  }
  std::vector<std::shared_ptr<SessionRecord>> sessions = sessions_->AllSessions();
  std::sort(sessions.begin(), sessions.end(), [](const auto& a, const auto& b) {
    if (a->tenant() != b->tenant()) return a->tenant() < b->tenant();
    return a->age() > b->age();
  });
  for (const auto& session : sessions) {
    if (!request->tenant().empty() && session->tenant() != request->tenant()) continue;
    v1::SessionSummary* out = response->add_sessions();
    out->set_session_id(session->id());
    out->set_tenant(session->tenant());
    out->set_device_ordinal(session->device());
    out->set_device_memory_bytes(sessions_->MemoryBytes(*session));
    out->set_age_ms(absl::ToInt64Milliseconds(session->age()));
    out->set_idle_ms(absl::ToInt64Milliseconds(session->idle()));
    out->set_state(session->state());
    out->set_fault_cause(session->fault_cause());
    out->set_peer(session->peer());
    out->set_client_label(session->client_label());
    out->set_worker_pid(session->worker().pid());
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::CloseSession(
    grpc::CallbackServerContext* context, const v1::AdminCloseSessionRequest* request,
    v1::AdminCloseSessionResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  if (!auth_->IsAdmin(identity->tenant)) {
    return Fail(reactor, absl::PermissionDeniedError(absl::StrFormat(
                             "tenant '%s' is not an admin of this daemon", identity->tenant)));
  }
  std::string owner;
  for (const auto& session : sessions_->AllSessions()) {
    if (session->id() == request->session_id()) owner = session->tenant();
  }
  if (owner.empty()) {
    return Fail(reactor,
                absl::NotFoundError(absl::StrFormat("no session %d", request->session_id())));
  }
  response->set_tenant(owner);
  const uint64_t id = request->session_id();
  std::thread([this, reactor, id, admin = identity->tenant] {
    absl::Status status = sessions_->Close(id);
    if (status.ok()) spdlog::info("admin {} closed session {}", admin, id);
    reactor->Finish(ToGrpcStatus(status));
  }).detach();
  return reactor;
}

}  // namespace gpurpc::frontend
