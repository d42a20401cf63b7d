#include "server/frontend/services.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

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

namespace {

// The front end's half of ExportMemory and ExportEvent: marks the export as under way,
// asks the session's worker off the gRPC threads (`ask`), records what it answered
// (`describe` fills the entry's driver handle and size) and answers the token (`reply`).
template <typename Answer>
grpc::ServerUnaryReactor* Export(
    SessionManager* sessions, grpc::ServerUnaryReactor* reactor,
    std::shared_ptr<SessionRecord> session, IpcRegistry::Kind kind, uint64_t object_id,
    std::function<grpc::Status(internal::v1::WorkerControl::Stub&, grpc::ClientContext*, Answer*)>
        ask,
    std::function<void(Answer&, IpcRegistry::Export&)> describe,
    std::function<void(std::string token, const Answer&)> reply) {
  const uint64_t session_id = session->id();
  // From here a Free (DestroyEvent) of the object, or the session's end, cancels the export
  // (Add fails).
  sessions->ipc().BeginExport(session_id, object_id);
  absl::Status queued = sessions->RunBlocking([=, session = std::move(session)] {
    Answer answer;
    grpc::ClientContext call;
    call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stub = internal::v1::WorkerControl::NewStub(session->worker().channel());
    if (const grpc::Status status = ask(*stub, &call, &answer); !status.ok()) {
      sessions->ipc().CancelExport(session_id, object_id);
      reactor->Finish(status);
      return;
    }
    IpcRegistry::Export entry;
    entry.kind = kind;
    entry.tenant = session->tenant();
    entry.session_id = session_id;
    entry.device = session->device();
    entry.object_id = object_id;
    describe(answer, entry);
    absl::StatusOr<std::string> token = sessions->ipc().Add(std::move(entry));
    if (!token.ok()) {
      reactor->Finish(ToGrpcStatus(token.status()));
      return;
    }
    if (sessions->EndIpcOfClosedSession(session_id)) {
      reactor->Finish(ToGrpcStatus(absl::NotFoundError(
          absl::StrFormat("%s: the session was closed while it exported",
                          kind == IpcRegistry::Kind::kEvent ? "ExportEvent" : "ExportMemory"))));
      return;
    }
    reply(*std::move(token), answer);
    reactor->Finish(grpc::Status::OK);
  });
  if (!queued.ok()) {
    sessions->ipc().CancelExport(session_id, object_id);
    return Fail(reactor, queued);
  }
  return reactor;
}

// The front end's half of OpenMemoryHandle and OpenEventHandle: begins the open in the
// registry, asks the session's worker off the gRPC threads (`ask`, which answers the new
// object's id) and commits it; `reply` fills the response.
template <typename Answer>
grpc::ServerUnaryReactor* Open(
    SessionManager* sessions, grpc::ServerUnaryReactor* reactor,
    std::shared_ptr<SessionRecord> session, const std::string& tenant, IpcRegistry::Kind kind,
    const std::string& token,
    std::function<grpc::Status(internal::v1::WorkerControl::Stub&, grpc::ClientContext*,
                               const IpcRegistry::Export&, Answer*, uint64_t*)>
        ask,
    std::function<void(Answer&)> reply) {
  const uint64_t session_id = session->id();
  absl::StatusOr<IpcRegistry::Export> exported =
      sessions->ipc().BeginOpen(kind, token, tenant, session_id, session->device());
  if (!exported.ok()) return Fail(reactor, exported.status());
  absl::Status queued =
      sessions->RunBlocking([=, session = std::move(session), exported = *std::move(exported)] {
        Answer answer;
        uint64_t object_id = 0;
        grpc::ClientContext call;
        call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        auto stub = internal::v1::WorkerControl::NewStub(session->worker().channel());
        if (const grpc::Status status = ask(*stub, &call, exported, &answer, &object_id);
            !status.ok()) {
          sessions->ipc().CancelOpen(token, session_id);
          reactor->Finish(status);
          return;
        }
        if (absl::Status committed = sessions->ipc().CommitOpen(token, session_id, object_id, kind);
            !committed.ok()) {
          // The exporter ended while this session opened it: close it again.
          sessions->CloseImports({IpcRegistry::Import{session_id, object_id, kind}});
          reactor->Finish(ToGrpcStatus(committed));
          return;
        }
        if (sessions->EndIpcOfClosedSession(session_id)) {
          // This session was closed while it opened the handle: what it opened went with its
          // worker, and the export must not count it as open.
          reactor->Finish(ToGrpcStatus(absl::NotFoundError(absl::StrFormat(
              "%s: the session was closed while it opened the handle",
              kind == IpcRegistry::Kind::kEvent ? "OpenEventHandle" : "OpenMemoryHandle"))));
          return;
        }
        reply(answer);
        reactor->Finish(grpc::Status::OK);
      });
  if (!queued.ok()) {
    sessions->ipc().CancelOpen(token, session_id);
    return Fail(reactor, queued);
  }
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* SessionServiceImpl::ExportMemory(grpc::CallbackServerContext* context,
                                                           const v1::ExportMemoryRequest* request,
                                                           v1::ExportMemoryResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  const uint64_t buffer_id = request->buffer_id();
  using Answer = internal::v1::ExportMemoryResponse;
  return Export<Answer>(
      sessions_, reactor, *std::move(session), IpcRegistry::Kind::kMemory, buffer_id,
      [buffer_id](internal::v1::WorkerControl::Stub& stub, grpc::ClientContext* call,
                  Answer* answer) {
        internal::v1::ExportMemoryRequest ask;
        ask.set_buffer_id(buffer_id);
        return stub.ExportMemory(call, ask, answer);
      },
      [](Answer& answer, IpcRegistry::Export& entry) {
        entry.ipc_handle = std::move(*answer.mutable_ipc_handle());
        entry.size_bytes = answer.size_bytes();
      },
      [response](std::string token, const Answer& answer) {
        response->set_handle(std::move(token));
        response->set_size_bytes(answer.size_bytes());
      });
}

grpc::ServerUnaryReactor* SessionServiceImpl::OpenMemoryHandle(
    grpc::CallbackServerContext* context, const v1::OpenMemoryHandleRequest* request,
    v1::OpenMemoryHandleResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  using Answer = internal::v1::OpenMemoryHandleResponse;
  return Open<Answer>(
      sessions_, reactor, *std::move(session), identity->tenant, IpcRegistry::Kind::kMemory,
      request->handle(),
      [](internal::v1::WorkerControl::Stub& stub, grpc::ClientContext* call,
         const IpcRegistry::Export& exported, Answer* answer, uint64_t* buffer_id) {
        internal::v1::OpenMemoryHandleRequest ask;
        ask.set_ipc_handle(exported.ipc_handle);
        ask.set_size_bytes(exported.size_bytes);
        const grpc::Status status = stub.OpenMemoryHandle(call, ask, answer);
        *buffer_id = answer->buffer().buffer_id();
        return status;
      },
      [response](Answer& answer) {
        *response->mutable_buffer() = std::move(*answer.mutable_buffer());
      });
}

grpc::ServerUnaryReactor* SessionServiceImpl::ExportEvent(grpc::CallbackServerContext* context,
                                                          const v1::ExportEventRequest* request,
                                                          v1::ExportEventResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  const uint64_t event_id = request->event_id();
  using Answer = internal::v1::ExportEventResponse;
  return Export<Answer>(
      sessions_, reactor, *std::move(session), IpcRegistry::Kind::kEvent, event_id,
      [event_id](internal::v1::WorkerControl::Stub& stub, grpc::ClientContext* call,
                 Answer* answer) {
        internal::v1::ExportEventRequest ask;
        ask.set_event_id(event_id);
        return stub.ExportEvent(call, ask, answer);
      },
      [](Answer& answer, IpcRegistry::Export& entry) {
        entry.ipc_handle = std::move(*answer.mutable_ipc_handle());
      },
      [response](std::string token, const Answer&) { response->set_handle(std::move(token)); });
}

grpc::ServerUnaryReactor* SessionServiceImpl::OpenEventHandle(
    grpc::CallbackServerContext* context, const v1::OpenEventHandleRequest* request,
    v1::OpenEventHandleResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return Fail(reactor, identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return Fail(reactor, session.status());
  using Answer = internal::v1::OpenEventHandleResponse;
  return Open<Answer>(
      sessions_, reactor, *std::move(session), identity->tenant, IpcRegistry::Kind::kEvent,
      request->handle(),
      [](internal::v1::WorkerControl::Stub& stub, grpc::ClientContext* call,
         const IpcRegistry::Export& exported, Answer* answer, uint64_t* event_id) {
        internal::v1::OpenEventHandleRequest ask;
        ask.set_ipc_handle(exported.ipc_handle);
        const grpc::Status status = stub.OpenEventHandle(call, ask, answer);
        *event_id = answer->event_id();
        return status;
      },
      [response](Answer& answer) { response->set_event_id(answer.event_id()); });
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
