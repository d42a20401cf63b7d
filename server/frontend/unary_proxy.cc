#include "server/frontend/unary_proxy.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "server/frontend/proxy.h"
#include "server/frontend/relay_status.h"
#include "server/frontend/unary_channels.h"
#include "server/parse_limit.h"

namespace gpurpc::frontend {
namespace {

// How long the gRPC thread that took a framed call may wait for its answer and complete the
// call itself (UnaryChannels::Call): a short call then costs no hand-off to the channel's
// thread. Not for the methods that usually take milliseconds (NVRTC, the driver's JIT,
// pinning a host region), whose wait would only hold the gRPC thread.
absl::Duration AnswerWait(Ledger ledger) {
  switch (ledger) {
    case Ledger::kCompile:
    case Ledger::kLinkModule:
    case Ledger::kLoadModule:
    case Ledger::kRegisterRegion:
      return absl::ZeroDuration();
    default:
      return UnaryChannels::kShortCallWait;
  }
}

// One relayed call, from the handler to OnDone (it deletes itself).
class UnaryRelay final : public grpc::ServerUnaryReactor {
 public:
  UnaryRelay(const SessionUnaryProxy::Method& method, SessionManager* sessions,
             std::shared_ptr<SessionRecord> session, FrontendMetrics* metrics,
             grpc::CallbackServerContext* context, grpc::ByteBuffer* response)
      : method_(method),
        session_(std::move(session)),
        metrics_(metrics),
        relayed_(metrics != nullptr ? metrics->Relay(method.path)
                                    : FrontendMetrics::RelayCounters{nullptr, nullptr}),
        ledger_(sessions, session_, method.ledger, metrics),
        response_(response) {
    // A ledger call runs to its end in the worker even when the client cancels or its
    // deadline passes: the ledger must see what the worker really did (an allocation made
    // after the client gave up still holds memory; a compile still holds a CPU).
    if (method.ledger == Ledger::kNone) worker_context_.set_deadline(context->deadline());
  }

  // Checks the request and sends it to the worker. The caller holds a compile slot for a
  // Compile or LinkModule, given back when the call ends (CallLedger::AfterWorker).
  void Start(const grpc::ByteBuffer* request, bool framed) {
    session_->BeginCall();
    if (request == nullptr || !request->Valid()) {
      // No whole message arrived before the client half-closed.
      return Refuse(
          grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                       absl::StrFormat("%s takes exactly one request message; this call sent none",
                                       method_.path)));
    }
    if (absl::Status size =
            CheckParsedBytes(*method_.request, *request,
                             [this] { return absl::StrCat(method_.path, ": the request"); });
        !size.ok()) {
      return Refuse(ToGrpcStatus(size));
    }
    if (absl::Status admitted = ledger_.BeforeWorker(*request); !admitted.ok()) {
      return Refuse(ToGrpcStatus(admitted));
    }
    if (relayed_.to_worker != nullptr) relayed_.to_worker->Increment(request->Length());
    request_ = request;
    if (framed) {
      // The completion may come after this relay is gone (a call abandoned in OnCancel): it
      // reaches the relay through `framed_`, which it shares.
      framed_ = std::make_shared<FramedCall>(this);
      UnaryChannels::Done done = [call = framed_](UnaryChannels::Outcome outcome,
                                                  grpc::Status status, grpc::ByteBuffer answer) {
        UnaryRelay* relay;
        {
          absl::MutexLock lock(&call->mu);
          relay = std::exchange(call->relay, nullptr);
        }
        // Null: the client's call already ended; the answer is dropped.
        if (relay != nullptr) relay->FramedDone(outcome, std::move(status), &answer);
      };
      const bool sent =
          session_->unary_channels().Call(method_.path, *request, done, AnswerWait(method_.ledger));
      if (metrics_ != nullptr) metrics_->UnaryCallRelayed(sent);
      if (sent) return;
      framed_.reset();
    } else if (metrics_ != nullptr) {
      metrics_->UnaryCallRelayed(false);
    }
    StartGrpc();
  }

  // The client cancelled or its deadline passed. A call the ledger does not read ends at once:
  // a gRPC worker call is cancelled, a framed one abandoned (the worker runs its handler to
  // the end, and the answer is dropped). A ledger call waits for the worker's answer, so
  // that the ledger sees what the worker did.
  void OnCancel() override {
    if (method_.ledger != Ledger::kNone) return;
    worker_context_.TryCancel();
    if (framed_ == nullptr) return;
    bool abandoned;
    {
      absl::MutexLock lock(&framed_->mu);
      abandoned = framed_->relay != nullptr;
      framed_->relay = nullptr;
    }
    if (!abandoned) return;  // answered meanwhile: that answer finishes the call
    ledger_.AfterWorker(grpc::Status(grpc::StatusCode::CANCELLED, "abandoned"));
    session_->EndCall();
    Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                        "the client cancelled the call, or its deadline passed"));
  }
  void OnDone() override { delete this; }

 private:
  // What a framed call's completion shares with its relay.
  struct FramedCall {
    explicit FramedCall(UnaryRelay* r) : relay(r) {}
    absl::Mutex mu;
    UnaryRelay* relay ABSL_GUARDED_BY(mu) = nullptr;  // null once answered or abandoned
  };

  // Relays the request to the worker as a gRPC call.
  void StartGrpc() {
    session_->stub().UnaryCall(&worker_context_, method_.path, grpc::StubOptions(), request_,
                               &from_worker_, [this](grpc::Status status) {
                                 // The trailers are read only for a status to translate.
                                 WorkerDone(status, !status.ok() && AnsweredByWorker(), nullptr);
                               });
  }

  // A framed call ended. A channel the worker refused never ran the call: it goes by gRPC.
  void FramedDone(UnaryChannels::Outcome outcome, grpc::Status status, grpc::ByteBuffer* answer) {
    if (outcome == UnaryChannels::Outcome::kRefused) {
      if (metrics_ != nullptr) metrics_->UnaryCallRelayed(false);
      return StartGrpc();
    }
    WorkerDone(status, outcome == UnaryChannels::Outcome::kAnswered, answer);
  }

  // Refused before the worker saw the request.
  void Refuse(grpc::Status status) {
    ledger_.AfterWorker(grpc::Status(grpc::StatusCode::CANCELLED, "not sent to the worker"));
    session_->EndCall();
    Finish(std::move(status));
  }

  // The worker's side ended: its answer is in from_worker_ (by gRPC) or in `framed_answer`.
  // `answered_by_worker`: the status is the worker's own answer.
  void WorkerDone(const grpc::Status& status, bool answered_by_worker,
                  grpc::ByteBuffer* framed_answer) {
    // May wait for a dying worker (on a gRPC or a channel thread, never under a lock).
    grpc::Status final_status =
        status.ok() ? status
                    : TranslateWorkerStatus(*session_, method_.path, status, answered_by_worker);
    if (framed_answer != nullptr) from_worker_.Swap(framed_answer);
    // Refused by the ledger: the client does not get the answer.
    absl::Status refused = status.ok() ? ledger_.OnAnswer(from_worker_) : absl::OkStatus();
    ledger_.AfterWorker(final_status);
    if (!refused.ok()) final_status = ToGrpcStatus(refused);
    session_->EndCall();
    if (final_status.ok()) {
      if (relayed_.to_client != nullptr) relayed_.to_client->Increment(from_worker_.Length());
      response_->Swap(&from_worker_);
    }
    Finish(std::move(final_status));
  }

  // True when the worker's own server sent the status (it marks every answer, see
  // server/status_interceptor.h), false when gRPC made it up for a broken call.
  bool AnsweredByWorker() const {
    const auto& trailers = worker_context_.GetServerTrailingMetadata();
    return trailers.find(kWorkerAnswerMetadataKey) != trailers.end();
  }

  const SessionUnaryProxy::Method& method_;
  const std::shared_ptr<SessionRecord> session_;
  FrontendMetrics* const metrics_;
  const FrontendMetrics::RelayCounters relayed_;
  CallLedger ledger_;
  grpc::ByteBuffer* const response_;           // gRPC's, written before Finish
  const grpc::ByteBuffer* request_ = nullptr;  // gRPC's, valid until OnDone
  // Set before the call is bound (Start runs in the handler), read by OnCancel after.
  std::shared_ptr<FramedCall> framed_;
  grpc::ClientContext worker_context_;
  grpc::ByteBuffer from_worker_;
};

}  // namespace

SessionUnaryProxy::SessionUnaryProxy(SessionManager* sessions, const Authenticator* auth,
                                     FrontendMetrics* metrics, bool framed)
    : sessions_(sessions), auth_(auth), metrics_(metrics), framed_(framed) {
  // Touch one message of each file so that its descriptors are linked in and registered.
  v1::AllocateRequest::descriptor();
  v1::CompileRequest::descriptor();
  v1::CreateStreamRequest::descriptor();
  v1::RegisterHostRegionRequest::descriptor();
  for (const char* name : kSessionServices) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    for (int i = 0; i < (service != nullptr ? service->method_count() : 0); ++i) {
      const google::protobuf::MethodDescriptor* descriptor = service->method(i);
      if (descriptor->client_streaming() || descriptor->server_streaming()) continue;
      const std::string path = absl::StrCat("/", name, "/", descriptor->name());
      const Method& method =
          methods_.emplace_back(Method{path, descriptor->input_type(), LedgerFor(path)});
      AddMethod(new grpc::internal::RpcServiceMethod(
          method.path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
      MarkMethodRawCallback(
          static_cast<int>(methods_.size() - 1),
          new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
              [this, &method](grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                              grpc::ByteBuffer* response) {
                return Relay(method, context, request, response);
              }));
    }
  }
}

grpc::ServerUnaryReactor* SessionUnaryProxy::Relay(const Method& method,
                                                   grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  auto refuse = [context](const absl::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  };
  auto identity = auth_->Authenticate(*context);
  if (!identity.ok()) return refuse(identity.status());
  auto session = sessions_->FindFromMetadata(context->client_metadata(), identity->tenant);
  if (!session.ok()) return refuse(session.status());
  if (absl::Status usable = (*session)->CheckUsable(); !usable.ok()) return refuse(usable);
  // A link may run NVRTC for its sources: it holds a compile slot like Compile.
  if (method.ledger == Ledger::kCompile || method.ledger == Ledger::kLinkModule) {
    if (absl::Status slot = sessions_->BeginCompile(identity->tenant); !slot.ok()) {
      return refuse(slot);
    }
  }
  auto* relay = new UnaryRelay(method, sessions_, *std::move(session), metrics_, context, response);
  relay->Start(request, framed_);
  return relay;
}

}  // namespace gpurpc::frontend
