#include "server/frontend/proxy.h"

#include <algorithm>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/array_shape.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "google/protobuf/descriptor.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/frontend/command_relay.h"
#include "server/frontend/relay_status.h"
#include "server/parse_limit.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// Whether a method's client and server stream (unary and server-streaming methods take
// exactly one request message), and its request type.
struct MethodShape {
  bool client_streaming;
  bool server_streaming;
  const google::protobuf::Descriptor* request;
};

// Every streaming method of the session services, by its exact path ("/package.Service/Method"),
// from the generated descriptors.
const absl::flat_hash_map<std::string, MethodShape>& SessionMethods() {
  static const auto* const kMethods = [] {
    // Touch one message of each file so that its descriptors are linked in and registered.
    v1::AllocateRequest::descriptor();
    v1::CompileRequest::descriptor();
    v1::CreateStreamRequest::descriptor();
    v1::RegisterHostRegionRequest::descriptor();
    auto* methods = new absl::flat_hash_map<std::string, MethodShape>();
    for (const char* name : kSessionServices) {
      const google::protobuf::ServiceDescriptor* service =
          google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
      if (service == nullptr) continue;
      for (int i = 0; i < service->method_count(); ++i) {
        const google::protobuf::MethodDescriptor* method = service->method(i);
        // Unary methods are SessionUnaryProxy's, which reads them for the tenant's ledger:
        // none may reach this relay, which does not.
        if (!method->client_streaming() && !method->server_streaming()) continue;
        methods->emplace(absl::StrCat("/", name, "/", method->name()),
                         MethodShape{method->client_streaming(), method->server_streaming(),
                                     method->input_type()});
      }
    }
    return methods;
  }();
  return *kMethods;
}

constexpr char kCommandStreamMethod[] = "/gpurpc.v1.ExecutionService/CommandStream";
constexpr char kUploadStreamMethod[] = "/gpurpc.v1.MemoryService/UploadStream";
constexpr char kDownloadStreamMethod[] = "/gpurpc.v1.MemoryService/DownloadStream";

// Answers a call at once with a status.
class RejectReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RejectReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// One relayed streaming call (unary calls are SessionUnaryProxy's, unary_proxy.h). The
// server half faces the client, the WorkerHalf faces the worker.
// Two pumps run at once, each with at most one operation outstanding:
//   client -> worker: server Read, then worker Write, then server Read ...
//   worker -> client: worker Read, then server Write, then worker Read ...
// Each pump holds the worker call open (a hold) while it may still start a worker
// operation from a server-side callback; without that the worker call could complete
// in between and the operation would start on a finished call. The object deletes itself
// when both halves are done.
class RelayReactor final : public grpc::ServerGenericBidiReactor {
 public:
  // `metrics` may be null.
  RelayReactor(grpc::GenericCallbackServerContext* context, std::shared_ptr<SessionRecord> session,
               MethodShape shape, FrontendMetrics* metrics)
      : context_(context),
        relayed_(metrics != nullptr ? metrics->Relay(context->method())
                                    : FrontendMetrics::RelayCounters{nullptr, nullptr}),
        session_(std::move(session)),
        client_streaming_(shape.client_streaming),
        // The worker checks each command batch itself (its direct server has no front end in
        // front of it); every other message is checked here.
        parse_checked_(context->method() == kCommandStreamMethod ? nullptr : shape.request),
        worker_half_(this) {
    // Callbacks may fire on other threads before the constructor is done.
    absl::MutexLock lock(&mu_);
    // A command stream stays open for the life of a client: it keeps the session alive by
    // its traffic, not by being open, so that a vanished client is still reclaimed.
    counts_as_in_flight_ = context_->method() != kCommandStreamMethod;
    if (counts_as_in_flight_) {
      session_->BeginCall();
    } else {
      session_->Touch();
    }
    worker_context_.set_deadline(context_->deadline());
    session_->stub().PrepareBidiStreamingCall(&worker_context_, context_->method(),
                                              grpc::StubOptions(), &worker_half_);
    worker_half_.AddMultipleHolds(2);  // one per pump
    worker_half_.StartRead(&from_worker_);
    worker_half_.StartCall();
    StartRead(&from_client_);
  }

  // Server half.
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    session_->Touch();
    if (!to_worker_open_) return;
    if (!client_streaming_) {
      // A method that takes one request message: the message is held until the client
      // half-closes, so that a call with none or with more than one is refused before the
      // worker sees anything (gRPC's clients send the message and the half-close together).
      if (ok && !request_held_) {
        request_held_ = true;
        StartRead(&extra_);
        return;
      }
      if (ok || !request_held_) {
        refusal_ =
            grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                         absl::StrFormat("%s takes exactly one request message; this call sent %s",
                                         context_->method(), ok ? "more" : "none"));
        RefuseLocked();
        return;
      }
      // The one message, then the half-close.
      if (!ParseLimitLocked()) {
        RefuseLocked();
        return;
      }
      CountToWorker(from_client_);
      worker_half_.StartWriteLast(&from_client_, grpc::WriteOptions());
      return;
    }
    // The messages of a client-streaming call go on as they are: the worker parses them itself
    // and refuses one that does not parse, naming it (server/worker/raw_messages.h).
    if (ok && !ParseLimitLocked()) {
      // Refused: the worker never sees the request.
      RefuseLocked();
      return;
    }
    if (ok) {
      // While one message is written to the worker the next is read from the client; a
      // message that arrives before the write is done waits for it (held_from_client_).
      if (worker_write_pending_) {
        held_from_client_ = true;
      } else {
        WriteToWorkerLocked();
      }
    } else {
      // The client half-closed (or went away): pass that on once the last message is out.
      client_half_closed_ = true;
      if (!worker_write_pending_ && !held_from_client_) {
        worker_half_.StartWritesDone();
        CloseToWorkerLocked();
      }
    }
  }

  // The request is refused (refusal_ says why) before the worker saw it.
  void RefuseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    worker_context_.TryCancel();
    CloseToWorkerLocked();  // the worker call ends cancelled: OnWorkerDone finishes
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    server_write_pending_ = false;
    if (ok) {
      // A message read from the worker meanwhile goes out now, and the read pump goes on
      // (its hold is still held while the worker's side is open).
      if (held_from_worker_) {
        held_from_worker_ = false;
        WriteToClientLocked();
      }
    } else {
      // The client is gone: stop the worker call and read nothing more from it (a read
      // still pending ends unheeded).
      worker_context_.TryCancel();
      held_from_worker_ = false;
      CloseFromWorkerLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override { worker_context_.TryCancel(); }

  void OnDone() override ABSL_LOCKS_EXCLUDED(mu_) {
    bool last;
    {
      absl::MutexLock lock(&mu_);
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

  void OnWorkerReadDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (ok) {
      if (!from_worker_open_) return;  // the client is gone (OnWriteDone)
      // While one answer is written to the client the next is read from the worker; one
      // that arrives before the write is done waits for it (held_from_worker_).
      if (server_write_pending_) {
        held_from_worker_ = true;
      } else {
        WriteToClientLocked();
      }
    } else {
      // The worker has ended the call (perhaps before the client half-closed): start no
      // more worker operations from either pump, so that its status can come through.
      CloseFromWorkerLocked();
      CloseToWorkerLocked();
      MaybeFinishLocked();
    }
  }

  void OnWorkerWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    worker_write_pending_ = false;
    if (!ok || !client_streaming_ || !to_worker_open_) {
      CloseToWorkerLocked();  // a one-message call's only write, or the worker is gone
      return;
    }
    if (held_from_client_) {
      held_from_client_ = false;
      WriteToWorkerLocked();
    } else if (client_half_closed_) {
      worker_half_.StartWritesDone();
      CloseToWorkerLocked();
    }
  }

  // The message in from_client_ goes to the worker, and the next one is read from the client.
  void WriteToWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    to_worker_.Swap(&from_client_);
    from_client_.Clear();
    CountToWorker(to_worker_);
    worker_write_pending_ = true;
    worker_half_.StartWrite(&to_worker_);
    StartRead(&from_client_);
  }

  // The answer in from_worker_ goes to the client, and the next one is read from the worker
  // (while its side is open).
  void WriteToClientLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    to_client_.Swap(&from_worker_);
    from_worker_.Clear();
    CountToClient(to_client_);
    server_write_pending_ = true;
    StartWrite(&to_client_);
    if (from_worker_open_) worker_half_.StartRead(&from_worker_);
  }

  void OnWorkerDone(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status final_status = Translate(status);
    absl::MutexLock lock(&mu_);
    WorkerFinishedLocked(std::move(final_status));
    MaybeFinishLocked();
  }

  // The worker's side is over with `final_status` (translated).
  void WorkerFinishedLocked(grpc::Status final_status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!refusal_.ok()) final_status = refusal_;
    if (counts_as_in_flight_) {
      session_->EndCall();
    } else {
      session_->Touch();
    }
    worker_done_ = true;
    final_status_ = std::move(final_status);
  }

  // Maps what the worker answered to what the client sees, and records faults
  // (relay_status.h).
  grpc::Status Translate(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    if (status.ok()) return status;  // the common case: no trailers to look at
    return TranslateWorkerStatus(*session_, context_->method(), status, AnsweredByWorker());
  }

  // True when the worker's own server sent the status (it marks every answer, see
  // server/status_interceptor.h), false when gRPC made it up for a broken call.
  bool AnsweredByWorker() const {
    const auto& trailers = worker_context_.GetServerTrailingMetadata();
    return trailers.find(kWorkerAnswerMetadataKey) != trailers.end();
  }

  // Refuses a client's message (in from_client_) whose parse would take more memory than
  // its ParsedBytesLimit (server/parse_limit.h), before the worker parses it. False when
  // refused (refusal_ says why).
  bool ParseLimitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (parse_checked_ == nullptr) return true;
    const uint64_t index = ++messages_from_client_;
    absl::Status size = CheckParsedBytes(*parse_checked_, from_client_, [this, index] {
      return client_streaming_
                 ? absl::StrFormat("%s: message %d of the stream", context_->method(), index)
                 : absl::StrFormat("%s: the request", context_->method());
    });
    if (size.ok()) return true;
    refusal_ = ToGrpcStatus(size);
    return false;
  }

  void CountToWorker(const grpc::ByteBuffer& message) {
    if (relayed_.to_worker != nullptr) relayed_.to_worker->Increment(message.Length());
  }
  void CountToClient(const grpc::ByteBuffer& message) {
    if (relayed_.to_client != nullptr) relayed_.to_client->Increment(message.Length());
  }

  // Each pump ends once; ending it releases its hold on the worker call.
  void CloseToWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!to_worker_open_) return;
    to_worker_open_ = false;
    worker_half_.RemoveHold();
  }
  void CloseFromWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!from_worker_open_) return;
    from_worker_open_ = false;
    worker_half_.RemoveHold();
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (worker_done_ && !server_write_pending_ && !held_from_worker_ && !finished_) {
      finished_ = true;
      Finish(final_status_);
    }
  }

  grpc::GenericCallbackServerContext* context_;
  const FrontendMetrics::RelayCounters relayed_;
  std::shared_ptr<SessionRecord> session_;
  const bool client_streaming_;
  // The request type whose messages ParseLimitLocked checks (null: none).
  const google::protobuf::Descriptor* const parse_checked_;
  // Guards the relay's state: both pumps and their buffers, and how far each half has got. gRPC's
  // callbacks take it (never while calling out to something that may wait; see Translate).
  absl::Mutex mu_;
  // a one-message call's message is in from_client_
  bool request_held_ ABSL_GUARDED_BY(mu_) = false;
  // where a one-message call's half-close (or excess) is read
  grpc::ByteBuffer extra_ ABSL_GUARDED_BY(mu_);
  grpc::Status refusal_ ABSL_GUARDED_BY(mu_);
  // Messages of the client checked by ParseLimitLocked.
  uint64_t messages_from_client_ ABSL_GUARDED_BY(mu_) = 0;
  // Not guarded: gRPC's ClientContext is thread-safe for TryCancel (OnCancel) and is read
  // unlocked for the worker's trailers (Translate).
  grpc::ClientContext worker_context_;
  WorkerHalf worker_half_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer from_client_ ABSL_GUARDED_BY(mu_);  // being read from the client
  grpc::ByteBuffer to_worker_ ABSL_GUARDED_BY(mu_);    // being written to the worker
  grpc::ByteBuffer from_worker_ ABSL_GUARDED_BY(mu_);  // being read from the worker
  grpc::ByteBuffer to_client_ ABSL_GUARDED_BY(mu_);    // being written to the client
  bool worker_write_pending_ ABSL_GUARDED_BY(mu_) = false;
  // from_client_ waits for the worker write to end
  bool held_from_client_ ABSL_GUARDED_BY(mu_) = false;
  // from_worker_ waits for the client write to end
  bool held_from_worker_ ABSL_GUARDED_BY(mu_) = false;
  bool client_half_closed_ ABSL_GUARDED_BY(mu_) = false;

  bool counts_as_in_flight_ ABSL_GUARDED_BY(mu_) = true;
  bool to_worker_open_ ABSL_GUARDED_BY(mu_) = true;
  bool from_worker_open_ ABSL_GUARDED_BY(mu_) = true;
  bool server_write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;
  bool server_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);

  friend class WorkerHalf;
};

}  // namespace

grpc::ServerGenericBidiReactor* SessionProxy::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  const auto& methods = SessionMethods();
  const auto method = methods.find(context->method());
  if (method == methods.end()) {
    return new RejectReactor(
        grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                     absl::StrFormat("gpurpcd has no method %s",
                                     absl::CHexEscape(context->method().substr(0, 256)))));
  }
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return new RejectReactor(ToGrpcStatus(identity.status()));
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return new RejectReactor(ToGrpcStatus(session.status()));
  if (absl::Status usable = (*session)->CheckUsable(); !usable.ok()) {
    return new RejectReactor(ToGrpcStatus(usable));
  }
  if (context->method() == kCommandStreamMethod) {
    grpc::ServerGenericBidiReactor* relay =
        framed_relay_ ? StartFramedCommandRelay(*session, metrics_) : nullptr;
    if (metrics_ != nullptr) metrics_->CommandStreamRelayed(relay != nullptr);
    if (relay != nullptr) return relay;
  }
  const bool upload = context->method() == kUploadStreamMethod;
  if (upload || context->method() == kDownloadStreamMethod) {
    grpc::ServerGenericBidiReactor* relay =
        framed_relay_ ? StartFramedTransferRelay(*session, upload, metrics_) : nullptr;
    if (metrics_ != nullptr) metrics_->TransferRelayed(relay != nullptr);
    if (relay != nullptr) return relay;
  }
  return new RelayReactor(context, *std::move(session), method->second, metrics_);
}

}  // namespace gpurpc::frontend
