#include "server/frontend/proxy.h"

#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "grpcpp/support/byte_buffer.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// Services whose calls belong to a session and run in its worker.
constexpr const char* kSessionServices[] = {
    "/gpurpc.v1.MemoryService/",
    "/gpurpc.v1.ModuleService/",
    "/gpurpc.v1.ExecutionService/",
    "/gpurpc.v1.HostRegionService/",
};

bool IsSessionMethod(const std::string& method) {
  for (const char* prefix : kSessionServices) {
    if (absl::StartsWith(method, prefix)) return true;
  }
  return false;
}

// Answers a call at once with a status.
class RejectReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RejectReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// One relayed call. The server half faces the client, the WorkerHalf faces the worker.
// Two pumps run at once, each with at most one operation outstanding:
//   client -> worker: server Read, then worker Write, then server Read ...
//   worker -> client: worker Read, then server Write, then worker Read ...
// The object deletes itself when both halves are done.
class RelayReactor final : public grpc::ServerGenericBidiReactor {
 public:
  RelayReactor(grpc::GenericCallbackServerContext* context,
               std::shared_ptr<SessionRecord> session)
      : context_(context), session_(std::move(session)), worker_half_(this) {
    session_->BeginCall();
    worker_context_.set_deadline(context_->deadline());
    session_->stub().PrepareBidiStreamingCall(&worker_context_, context_->method(),
                                              grpc::StubOptions(), &worker_half_);
    // Held until no more worker operations will be started from the server side.
    worker_half_.AddHold();
    worker_half_.StartRead(&from_worker_);
    worker_half_.StartCall();
    StartRead(&from_client_);
  }

  // Server half.
  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!worker_ops_open_) return;
    if (ok) {
      worker_half_.StartWrite(&from_client_);
    } else {
      // The client half-closed (or went away): pass that on.
      worker_half_.StartWritesDone();
      CloseWorkerOpsLocked();
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    server_write_pending_ = false;
    if (!ok) {
      worker_context_.TryCancel();
    } else if (!worker_done_) {
      worker_half_.StartRead(&from_worker_);
    }
    MaybeFinishLocked();
  }

  void OnCancel() override { worker_context_.TryCancel(); }

  void OnDone() override {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      server_done_ = true;
      last = worker_done_;
    }
    if (last) delete this;
  }

 private:
  class WorkerHalf final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit WorkerHalf(RelayReactor* relay) : relay_(relay) {}
    void OnReadDone(bool ok) override { relay_->OnWorkerReadDone(ok); }
    void OnWriteDone(bool ok) override { relay_->OnWorkerWriteDone(ok); }
    void OnDone(const grpc::Status& status) override { relay_->OnWorkerDone(status); }

   private:
    RelayReactor* relay_;
  };

  void OnWorkerReadDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ok) {
      server_write_pending_ = true;
      StartWrite(&from_worker_);
    } else {
      // The worker is finishing; start nothing more on its side.
      CloseWorkerOpsLocked();
    }
  }

  void OnWorkerWriteDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ok) {
      StartRead(&from_client_);
    } else {
      CloseWorkerOpsLocked();
    }
  }

  void OnWorkerDone(const grpc::Status& status) {
    grpc::Status final_status = Translate(status);
    std::lock_guard<std::mutex> lock(mu_);
    session_->EndCall();
    worker_done_ = true;
    final_status_ = std::move(final_status);
    MaybeFinishLocked();
  }

  // Maps what the worker answered to what the client sees, and records faults.
  grpc::Status Translate(const grpc::Status& status) {
    switch (status.error_code()) {
      case grpc::StatusCode::ABORTED:
      case grpc::StatusCode::DATA_LOSS:
        // The worker reported a sticky CUDA fault: its context is lost for good.
        session_->MarkFaulted(status.error_message());
        return grpc::Status(status.error_code(),
                            absl::StrFormat("%s; session %d is now FAULTED",
                                            status.error_message(), session_->id()));
      case grpc::StatusCode::UNAVAILABLE:
      case grpc::StatusCode::INTERNAL:
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::CANCELLED: {
        // A worker's own UNAVAILABLE comes over a healthy channel; a dead worker breaks
        // the channel, and its reaper reports the exit within milliseconds.
        WorkerProcess& worker = session_->worker();
        const bool broken =
            worker.exited() || worker.channel()->GetState(false) != GRPC_CHANNEL_READY;
        if (broken && worker.WaitExited(absl::Seconds(2))) {
          session_->MarkFaulted(absl::StrCat("its worker process ", worker.exit_description()));
          return grpc::Status(grpc::StatusCode::ABORTED,
                              absl::StrFormat("session %d FAULTED during %s: %s",
                                              session_->id(), context_->method(),
                                              session_->fault_cause()));
        }
        return status;
      }
      default:
        return status;
    }
  }

  void CloseWorkerOpsLocked() {
    if (!worker_ops_open_) return;
    worker_ops_open_ = false;
    worker_half_.RemoveHold();
  }

  void MaybeFinishLocked() {
    if (worker_done_ && !server_write_pending_ && !finished_) {
      finished_ = true;
      Finish(final_status_);
    }
  }

  grpc::GenericCallbackServerContext* context_;
  std::shared_ptr<SessionRecord> session_;
  grpc::ClientContext worker_context_;
  WorkerHalf worker_half_;
  grpc::ByteBuffer from_client_;
  grpc::ByteBuffer from_worker_;

  std::mutex mu_;
  bool worker_ops_open_ = true;
  bool server_write_pending_ = false;
  bool worker_done_ = false;
  bool server_done_ = false;
  bool finished_ = false;
  grpc::Status final_status_;

  friend class WorkerHalf;
};

}  // namespace

grpc::ServerGenericBidiReactor* SessionProxy::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (!IsSessionMethod(context->method())) {
    return new RejectReactor(grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrFormat("gpurpcd has no method %s", context->method())));
  }
  auto session = sessions_->FindFromMetadata(context->client_metadata());
  if (!session.ok()) return new RejectReactor(ToGrpcStatus(session.status()));
  if (absl::Status usable = (*session)->CheckUsable(); !usable.ok()) {
    return new RejectReactor(ToGrpcStatus(usable));
  }
  return new RelayReactor(context, *std::move(session));
}

}  // namespace gpurpc::frontend

