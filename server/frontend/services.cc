#include "server/frontend/services.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "gpurpc/internal/v1/worker_control.grpc.pb.h"
#include "server/frontend/ipc_registry.h"
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
  *response = sessions_->InventoryWithLoad();
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
  const v1::ListDevicesResponse inventory = sessions_->InventoryWithLoad();
  for (const v1::DeviceInfo& device : inventory.devices()) {
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
  *response->mutable_quota() = sessions_->QuotaFor(identity->tenant);
  const TenantUsage usage = sessions_->Usage(identity->tenant);
  response->set_sessions_open(usage.sessions);
  response->set_device_memory_bytes(usage.device_memory_bytes);
  response->set_compile_sandbox(sessions_->inventory().compile_sandbox());
  response->set_daemon_instance(sessions_->instance());
  response->set_started_unix_ms(absl::ToUnixMillis(sessions_->started()));
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
  absl::Status queued =
      sessions_->RunBlocking([this, reactor, request, response, identity = *std::move(identity)] {
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
        response->set_grace_ms(absl::ToInt64Milliseconds(sessions_->grace()));
        response->set_daemon_instance(sessions_->instance());
        reactor->Finish(grpc::Status::OK);
      });
  if (!queued.ok()) return Fail(reactor, queued);
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
  absl::Status queued = sessions_->RunBlocking([this, reactor, id] {
    // Answered once the worker is told to end; its context then ends here, off the
    // client's clock.
    std::shared_ptr<SessionRecord> ending;
    reactor->Finish(ToGrpcStatus(sessions_->Close(id, &ending)));
    if (ending != nullptr) ending->worker().WaitExited(absl::Seconds(10));
  });
  if (!queued.ok()) return Fail(reactor, queued);
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
  response->set_fault_code(static_cast<int32_t>((*session)->fault_code()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::ExportMemory(grpc::CallbackServerContext* context,
                                                           const v1::ExportMemoryRequest* request,
                                                           v1::ExportMemoryResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  const uint64_t session_id = (*session)->id();
  // From here a Free of the buffer, or the session's end, cancels the export (Add fails).
  sessions_->ipc().BeginExport(session_id, request->buffer_id());
  absl::Status queued =
      sessions_->RunBlocking([this, reactor, request, response, session = *std::move(session)] {
        internal::v1::ExportMemoryRequest ask;
        ask.set_buffer_id(request->buffer_id());
        internal::v1::ExportMemoryResponse answer;
        grpc::ClientContext call;
        call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        const grpc::Status status =
            internal::v1::WorkerControl::NewStub(session->worker().channel())
                ->ExportMemory(&call, ask, &answer);
        if (!status.ok()) {
          sessions_->ipc().CancelExport(session->id(), request->buffer_id());
          reactor->Finish(status);
          return;
        }
        IpcRegistry::Export entry;
        entry.tenant = session->tenant();
        entry.session_id = session->id();
        entry.device = session->device();
        entry.buffer_id = request->buffer_id();
        entry.ipc_handle = answer.ipc_handle();
        entry.size_bytes = answer.size_bytes();
        absl::StatusOr<std::string> token = sessions_->ipc().Add(std::move(entry));
        if (!token.ok()) {
          reactor->Finish(ToGrpcStatus(token.status()));
          return;
        }
        if (sessions_->EndIpcOfClosedSession(session->id())) {
          reactor->Finish(ToGrpcStatus(absl::NotFoundError(
              "ExportMemory: the session was closed while its buffer was exported")));
          return;
        }
        response->set_handle(*std::move(token));
        response->set_size_bytes(answer.size_bytes());
        reactor->Finish(grpc::Status::OK);
      });
  if (!queued.ok()) {
    sessions_->ipc().CancelExport(session_id, request->buffer_id());
    return Fail(reactor, queued);
  }
  return reactor;
}

grpc::ServerUnaryReactor* SessionServiceImpl::OpenMemoryHandle(
    grpc::CallbackServerContext* context, const v1::OpenMemoryHandleRequest* request,
    v1::OpenMemoryHandleResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  const uint64_t session_id = (*session)->id();
  absl::StatusOr<IpcRegistry::Export> exported = sessions_->ipc().BeginOpen(
      request->handle(), identity->tenant, session_id, (*session)->device());
  if (!exported.ok()) return Fail(reactor, exported.status());
  absl::Status queued = sessions_->RunBlocking([this, reactor, request, response,
                                                session = *std::move(session),
                                                exported = *std::move(exported)] {
    internal::v1::OpenMemoryHandleRequest ask;
    ask.set_ipc_handle(exported.ipc_handle);
    ask.set_size_bytes(exported.size_bytes);
    internal::v1::OpenMemoryHandleResponse answer;
    grpc::ClientContext call;
    call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status status = internal::v1::WorkerControl::NewStub(session->worker().channel())
                                    ->OpenMemoryHandle(&call, ask, &answer);
    if (!status.ok()) {
      sessions_->ipc().CancelOpen(request->handle(), session->id());
      reactor->Finish(status);
      return;
    }
    const uint64_t buffer_id = answer.buffer().buffer_id();
    if (absl::Status committed =
            sessions_->ipc().CommitOpen(request->handle(), session->id(), buffer_id);
        !committed.ok()) {
      // The exporter ended while this session mapped its memory: close the mapping again.
      sessions_->CloseImports({IpcRegistry::Import{session->id(), buffer_id}});
      reactor->Finish(ToGrpcStatus(committed));
      return;
    }
    if (sessions_->EndIpcOfClosedSession(session->id())) {
      // This session was closed while it opened the handle: its mapping went with its
      // worker, and the export must not count it as open.
      reactor->Finish(ToGrpcStatus(absl::NotFoundError(
          "OpenMemoryHandle: the session was closed while it opened the handle")));
      return;
    }
    *response->mutable_buffer() = answer.buffer();
    reactor->Finish(grpc::Status::OK);
  });
  if (!queued.ok()) {
    sessions_->ipc().CancelOpen(request->handle(), session_id);
    return Fail(reactor, queued);
  }
  return reactor;
}

namespace {

// One WatchSession stream: writes the session's state now and after every change, and
// finishes OK when the session closes. At most one write is in flight; a change that
// arrives during a write is written after it (only the latest state matters). Lock order:
// the session's lock, then this reactor's (the session calls OnSessionChanged under its
// lock); the reactor never calls into the session while it holds its own.
class WatchReactor final : public grpc::ServerWriteReactor<v1::SessionEvent>,
                           public SessionRecord::Watcher {
 public:
  explicit WatchReactor(std::shared_ptr<SessionRecord> session) : session_(std::move(session)) {}

  // Registers with the session (which reports the state at once); answers the call when
  // that is refused.
  void Start() {
    if (absl::Status watching = session_->Watch(this); !watching.ok()) {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      Finish(ToGrpcStatus(watching));
    }
  }

  void OnSessionChanged(const v1::SessionEvent& event, bool closing) override {
    absl::MutexLock lock(&mu_);
    pending_ = event;
    changed_ = true;
    closing_ = closing;
    MaybeWriteLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;  // the client is gone
    MaybeWriteLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    MaybeWriteLocked();
  }

  void OnDone() override {
    session_->Unwatch(this);
    delete this;
  }

 private:
  void MaybeWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (cancelled_) {
      finished_ = true;
      Finish(grpc::Status::CANCELLED);
    } else if (changed_) {
      changed_ = false;
      event_ = pending_;
      writing_ = true;
      StartWrite(&event_);
    } else if (closing_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  const std::shared_ptr<SessionRecord> session_;
  absl::Mutex mu_;
  v1::SessionEvent pending_ ABSL_GUARDED_BY(mu_);
  v1::SessionEvent event_ ABSL_GUARDED_BY(mu_);  // the one being written
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// Answers a server-streaming call at once with a status.
class RejectWatch final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  explicit RejectWatch(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerWriteReactor<v1::SessionEvent>* SessionServiceImpl::WatchSession(
    grpc::CallbackServerContext* context, const v1::WatchSessionRequest*) {
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return new RejectWatch(identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return new RejectWatch(session.status());
  auto* reactor = new WatchReactor(*std::move(session));
  reactor->Start();
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
  absl::Status queued = sessions_->RunBlocking([this, reactor, id, admin = identity->tenant] {
    absl::Status status = sessions_->Close(id);
    if (status.ok()) spdlog::info("admin {} closed session {}", admin, id);
    reactor->Finish(ToGrpcStatus(status));
  });
  if (!queued.ok()) return Fail(reactor, queued);
  return reactor;
}

}  // namespace gpurpc::frontend
