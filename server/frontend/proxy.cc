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

// Services whose calls belong to a session and run in its worker.
constexpr const char* kSessionServices[] = {
    "gpurpc.v1.MemoryService",
    "gpurpc.v1.ModuleService",
    "gpurpc.v1.ExecutionService",
    "gpurpc.v1.HostRegionService",
};

// Whether a method's client and server stream (unary and server-streaming methods take
// exactly one request message), and its request type.
struct MethodShape {
  bool client_streaming;
  bool server_streaming;
  const google::protobuf::Descriptor* request;
};

// Every method of the session services, by its exact path ("/package.Service/Method"),
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
constexpr char kAllocateMethod[] = "/gpurpc.v1.MemoryService/Allocate";
constexpr char kFreeMethod[] = "/gpurpc.v1.MemoryService/Free";
constexpr char kDestroyEventMethod[] = "/gpurpc.v1.ExecutionService/DestroyEvent";
constexpr char kCompileMethod[] = "/gpurpc.v1.ModuleService/Compile";
constexpr char kLoadModuleMethod[] = "/gpurpc.v1.ModuleService/LoadModule";
constexpr char kLinkModuleMethod[] = "/gpurpc.v1.ModuleService/LinkModule";
constexpr char kUnloadModuleMethod[] = "/gpurpc.v1.ModuleService/UnloadModule";
constexpr char kGetFunctionMethod[] = "/gpurpc.v1.ModuleService/GetFunction";
constexpr char kSetContextLimitMethod[] = "/gpurpc.v1.ModuleService/SetContextLimit";
constexpr char kRegisterRegionMethod[] = "/gpurpc.v1.HostRegionService/RegisterHostRegion";
constexpr char kUnregisterRegionMethod[] = "/gpurpc.v1.HostRegionService/UnregisterHostRegion";

// Calls the ledger reads on the way through.
enum class Ledger {
  kNone,
  kAllocate,
  kFree,
  kDestroyEvent,
  kCompile,
  kLoadModule,
  kLinkModule,
  kUnloadModule,
  kGetFunction,
  kRegisterRegion,
  kUnregisterRegion,
  kSetContextLimit,
};

Ledger LedgerFor(const std::string& method) {
  if (method == kAllocateMethod) return Ledger::kAllocate;
  if (method == kFreeMethod) return Ledger::kFree;
  if (method == kDestroyEventMethod) return Ledger::kDestroyEvent;
  if (method == kCompileMethod) return Ledger::kCompile;
  if (method == kLoadModuleMethod) return Ledger::kLoadModule;
  if (method == kLinkModuleMethod) return Ledger::kLinkModule;
  if (method == kUnloadModuleMethod) return Ledger::kUnloadModule;
  if (method == kGetFunctionMethod) return Ledger::kGetFunction;
  if (method == kRegisterRegionMethod) return Ledger::kRegisterRegion;
  if (method == kUnregisterRegionMethod) return Ledger::kUnregisterRegion;
  if (method == kSetContextLimitMethod) return Ledger::kSetContextLimit;
  return Ledger::kNone;
}

// Unloads a module the tenant's quota cannot hold, off the gRPC threads (rare).
void UnloadInBackground(SessionManager* sessions, std::shared_ptr<SessionRecord> session,
                        uint64_t module_id) {
  auto unload = [session, module_id] {
    v1::UnloadModuleRequest request;
    request.set_module_id(module_id);
    v1::UnloadModuleResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status status = v1::ModuleService::NewStub(session->worker().channel())
                                    ->UnloadModule(&context, request, &response);
    if (!status.ok()) {
      spdlog::warn("session {}: cannot unload over-quota module {}: {}", session->id(), module_id,
                   status.error_message());
    }
  };
  if (absl::Status queued = sessions->RunBlocking(unload); !queued.ok()) {
    // The module stays loaded but uncharged: end the session rather than let it keep memory
    // its quota does not allow.
    session->MarkFaulted(absl::StrCat("a module over the tenant's memory quota could not be "
                                      "unloaded: ",
                                      queued.message()),
                         absl::StatusCode::kFailedPrecondition, FaultCause::kQuota);
  }
}

// Parses a relayed message without consuming the buffer.
template <typename Message>
bool ParseRelayed(const grpc::ByteBuffer& buffer, Message* message) {
  grpc::ByteBuffer copy(buffer);  // shares the slices
  return grpc::SerializationTraits<Message>::Deserialize(&copy, message).ok();
}

// Answers a call at once with a status.
class RejectReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RejectReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// One relayed call. The server half faces the client, the WorkerHalf faces the worker.
// A unary method is relayed as a unary call to the worker (one request, one answer, one
// completion: a third of the reactions of a streamed relay, each of which costs a hand-over
// between gRPC's threads); the answer goes to the client with the status in one operation.
// Streaming methods use the pumps below.
// Two pumps run at once, each with at most one operation outstanding:
//   client -> worker: server Read, then worker Write, then server Read ...
//   worker -> client: worker Read, then server Write, then worker Read ...
// Each pump holds the worker call open (a hold) while it may still start a worker
// operation from a server-side callback; without that the worker call could complete
// in between and the operation would start on a finished call. The object deletes itself
// when both halves are done.
class RelayReactor final : public grpc::ServerGenericBidiReactor {
 public:
  // For Ledger::kCompile and kLinkModule the caller has taken a compile slot of the
  // session's tenant,
  // which this relay gives back when the call ends.
  // `metrics` may be null.
  RelayReactor(grpc::GenericCallbackServerContext* context, SessionManager* sessions,
               std::shared_ptr<SessionRecord> session, Ledger ledger, MethodShape shape,
               FrontendMetrics* metrics)
      : context_(context),
        sessions_(sessions),
        metrics_(metrics),
        relayed_(metrics != nullptr ? metrics->Relay(context->method())
                                    : FrontendMetrics::RelayCounters{nullptr, nullptr}),
        session_(std::move(session)),
        ledger_(ledger),
        client_streaming_(shape.client_streaming),
        unary_(!shape.client_streaming && !shape.server_streaming),
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
    // A ledger call runs to its end in the worker even when the client cancels or its
    // deadline passes: the ledger must see what the worker really did (an allocation made
    // after the client gave up still holds memory; a compile still holds a CPU).
    if (ledger_ == Ledger::kNone) worker_context_.set_deadline(context_->deadline());
    if (unary_) {
      StartRead(&from_client_);  // the worker call starts once the request is complete
      return;
    }
    session_->stub().PrepareBidiStreamingCall(&worker_context_, context_->method(),
                                              grpc::StubOptions(), &worker_half_);
    worker_half_.AddMultipleHolds(2);  // one per pump
    worker_half_.StartRead(&from_worker_);
    worker_half_.StartCall();
    StartRead(&from_client_);
  }

  // Server half.
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    bool start_unary = false;
    {
      absl::MutexLock lock(&mu_);
      start_unary = OnReadDoneLocked(ok);
    }
    // Outside the lock: the completion must be free to take it whenever it runs.
    if (start_unary) StartUnaryWorkerCall();
  }

  // True when the unary call to the worker is to start now.
  bool OnReadDoneLocked(bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    session_->Touch();
    if (!to_worker_open_) return false;
    if (!client_streaming_) {
      // A method that takes one request message: the message is held until the client
      // half-closes, so that a call with none or with more than one is refused before the
      // worker sees anything (gRPC's clients send the message and the half-close together).
      if (ok && !request_held_) {
        request_held_ = true;
        StartRead(&extra_);
        return false;
      }
      if (ok || !request_held_) {
        refusal_ =
            grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                         absl::StrFormat("%s takes exactly one request message; this call sent %s",
                                         context_->method(), ok ? "more" : "none"));
        RefuseLocked();
        return false;
      }
      // The one message, then the half-close.
      if (!ParseLimitLocked() || !LedgerBeforeWorkerLocked()) {
        RefuseLocked();
        return false;
      }
      if (unary_) {
        to_worker_open_ = false;  // the one request goes with the call
        return true;
      }
      CountToWorker(from_client_);
      worker_half_.StartWriteLast(&from_client_, grpc::WriteOptions());
      return false;
    }
    // The messages of a client-streaming call go on as they are: the worker parses them itself
    // and refuses one that does not parse, naming it (server/worker/raw_messages.h).
    if (ok && (!ParseLimitLocked() || !LedgerBeforeWorkerLocked())) {
      // Refused: the worker never sees the request.
      RefuseLocked();
      return false;
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
    return false;
  }

  // The request is refused (refusal_ says why) before the worker saw it.
  void RefuseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    worker_context_.TryCancel();
    if (!unary_) {
      CloseToWorkerLocked();  // the worker call ends cancelled: OnWorkerDone finishes
      return;
    }
    // No worker call was started: finish here.
    to_worker_open_ = false;
    WorkerFinishedLocked(grpc::Status(grpc::StatusCode::CANCELLED, "not sent to the worker"));
    MaybeFinishLocked();
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
      // The client is gone: stop the worker call (a ledger call has already answered) and
      // read nothing more from it (a read still pending ends unheeded).
      if (ledger_ == Ledger::kNone) worker_context_.TryCancel();
      held_from_worker_ = false;
      CloseFromWorkerLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    if (ledger_ == Ledger::kNone) worker_context_.TryCancel();
  }

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

  // Starts the unary worker call with the request in from_client_; its answer lands in
  // from_worker_. Runs without mu_ (the completion must be free to take it whenever it
  // runs): OnReadDoneLocked has closed the client -> worker side, so nothing else touches
  // either buffer until the completion, OnWorkerUnaryDone, takes mu_.
  void StartUnaryWorkerCall() ABSL_LOCKS_EXCLUDED(mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CountToWorker(from_client_);
    session_->stub().UnaryCall(&worker_context_, context_->method(), grpc::StubOptions(),
                               &from_client_, &from_worker_,
                               [this](grpc::Status status) { OnWorkerUnaryDone(status); });
  }

  void OnWorkerReadDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (ok && !LedgerOnAnswerLocked()) {
      // Refused by the ledger: the client does not get the answer; read the worker call
      // to its end, and refusal_ becomes the status.
      worker_half_.StartRead(&from_worker_);
      return;
    }
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

  // The unary worker call ended; its answer, if any, is in from_worker_.
  void OnWorkerUnaryDone(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status final_status = Translate(status);  // may wait for a dying worker: unlocked
    absl::MutexLock lock(&mu_);
    // Refused by the ledger: the client does not get the answer, refusal_ is the status.
    const bool answered = status.ok() && LedgerOnAnswerLocked();
    WorkerFinishedLocked(std::move(final_status));
    if (answered && final_status_.ok() && !finished_) {
      finished_ = true;
      CountToClient(from_worker_);
      StartWriteAndFinish(&from_worker_, grpc::WriteOptions(), final_status_);
      return;
    }
    MaybeFinishLocked();
  }

  // The worker's side is over with `final_status` (translated).
  void WorkerFinishedLocked(grpc::Status final_status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LedgerAfterWorkerLocked(final_status);
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
  // its ParsedBytesLimit (server/parse_limit.h), before anything parses it: the ledger
  // here, the worker there. False when refused (refusal_ says why).
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

  // Reads the client's request of a ledger call before it goes on to the worker. False when
  // the call is refused (refusal_ says why).
  bool LedgerBeforeWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ledger_ == Ledger::kAllocate && !request_seen_) {
      request_seen_ = true;
      v1::AllocateRequest request;
      // An unparsable request goes on: the worker answers it with the right error, as it
      // does an array shape that ArrayChargeBytes refuses (nothing is reserved for it).
      if (ParseRelayed(from_client_, &request)) {
        uint64_t bytes = request.size_bytes();
        if (request.has_array()) {
          const v1::ArrayDescriptor& array = request.array();
          bytes = ArrayChargeBytes(array.width(), array.height(), array.depth(), array.format(),
                                   array.num_channels(), array.flags())
                      .value_or(0);
        }
        if (bytes > 0) {
          if (!Admitted(sessions_->ReserveMemory(*session_, bytes))) return false;
          reserved_bytes_ = bytes;
        }
      }
    } else if (ledger_ == Ledger::kUnloadModule && !request_seen_) {
      request_seen_ = true;
      v1::UnloadModuleRequest request;
      if (ParseRelayed(from_client_, &request)) unloaded_module_ = request.module_id();
    } else if (ledger_ == Ledger::kFree && !request_seen_) {
      request_seen_ = true;
      v1::FreeRequest request;
      if (ParseRelayed(from_client_, &request)) {
        // Exported memory that another session has open must not be freed under it.
        if (!Admitted(sessions_->ipc().BeginFree(session_->id(), request.buffer_id()))) {
          return false;
        }
        released_id_ = request.buffer_id();
      }
    } else if (ledger_ == Ledger::kRegisterRegion && !request_seen_) {
      request_seen_ = true;
      v1::RegisterHostRegionRequest request;
      if (ParseRelayed(from_client_, &request) && request.size_bytes() > 0) {
        if (!Admitted(sessions_->ReserveHostRegion(*session_, request.size_bytes()))) {
          return false;
        }
        reserved_bytes_ = request.size_bytes();
      }
    } else if (ledger_ == Ledger::kDestroyEvent && !request_seen_) {
      request_seen_ = true;
      v1::DestroyEventRequest request;
      if (ParseRelayed(from_client_, &request)) released_id_ = request.event_id();
    } else if (ledger_ == Ledger::kUnregisterRegion && !request_seen_) {
      request_seen_ = true;
      v1::UnregisterHostRegionRequest request;
      if (ParseRelayed(from_client_, &request)) released_id_ = request.region_id();
    } else if (ledger_ == Ledger::kSetContextLimit && !request_seen_) {
      request_seen_ = true;
      v1::SetContextLimitRequest request;
      // The device memory the driver reserves for the context: charged before the worker sets
      // it. Values outside the worker's bounds are not charged: the worker refuses them.
      if (ParseRelayed(from_client_, &request)) {
        int slot = -1;
        if (request.limit() == v1::LIMIT_STACK_SIZE && request.value() > 0 &&
            request.value() <= kMaxStackBytesPerThread) {
          slot = 0;
        } else if (request.limit() == v1::LIMIT_PRINTF_FIFO_SIZE && request.value() > 0 &&
                   request.value() <= kMaxPrintfFifoBytes) {
          slot = 1;
        } else if (request.limit() == v1::LIMIT_MALLOC_HEAP_SIZE && request.value() > 0 &&
                   request.value() <= kMaxMallocHeapBytes) {
          slot = 2;
        }
        if (slot >= 0) {
          absl::StatusOr<uint64_t> reserved =
              sessions_->ReserveContextLimit(*session_, slot, request.value());
          if (!Admitted(reserved.status())) return false;
          limit_slot_ = slot;
          limit_value_ = request.value();
          reserved_bytes_ = *reserved;
        }
      }
    }
    return true;
  }

  // Reads the worker's answer of a ledger call before it goes on to the client: commits an
  // Allocate's reservation to its buffer, charges the globals of a module that LoadModule,
  // LinkModule or Compile loaded (unloading it when they are over quota) and the local memory of a
  // kernel that GetFunction found. False when the answer is refused (refusal_ says why).
  bool LedgerOnAnswerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (ledger_) {
      case Ledger::kAllocate: {
        v1::AllocateResponse response;
        if (reserved_bytes_ > 0 && ParseRelayed(from_worker_, &response)) {
          sessions_->CommitBuffer(*session_, reserved_bytes_, response.buffer().buffer_id(),
                                  response.buffer().size_bytes());
          reserved_bytes_ = 0;
        }
        return true;
      }
      case Ledger::kGetFunction: {
        v1::GetFunctionResponse response;
        if (!ParseRelayed(from_worker_, &response)) return true;
        // Refused, the client never learns the function's id, so it cannot launch it.
        return Admitted(sessions_->ChargeLocalMemory(
            *session_,
            static_cast<uint64_t>(std::max(0, response.attributes().local_size_bytes()))));
      }
      case Ledger::kLoadModule: {
        v1::LoadModuleResponse response;
        if (!ParseRelayed(from_worker_, &response)) return true;
        return ChargeModuleLocked(response.module_id(), response.device_memory_bytes());
      }
      case Ledger::kCompile: {
        v1::CompileResponse response;
        if (!ParseRelayed(from_worker_, &response)) return true;
        // Every answered compile looked the cache up first: a miss ran NVRTC.
        if (metrics_ != nullptr) metrics_->CompileAnswered(response.cache_hit());
        return ChargeModuleLocked(response.module_id(), response.device_memory_bytes());
      }
      case Ledger::kLinkModule: {
        v1::LinkModuleResponse response;
        if (!ParseRelayed(from_worker_, &response)) return true;
        if (metrics_ != nullptr) {
          for (const v1::LinkSourceResult& source : response.sources()) {
            metrics_->CompileAnswered(source.cache_hit());
          }
        }
        return ChargeModuleLocked(response.module_id(), response.device_memory_bytes());
      }
      case Ledger::kRegisterRegion: {
        v1::RegisterHostRegionResponse response;
        if (reserved_bytes_ > 0 && ParseRelayed(from_worker_, &response) &&
            response.region_id() != 0) {
          sessions_->CommitHostRegion(*session_, reserved_bytes_, response.region_id());
          reserved_bytes_ = 0;
        }
        return true;
      }
      case Ledger::kFree:
      case Ledger::kDestroyEvent:
      case Ledger::kUnloadModule:
      case Ledger::kUnregisterRegion:
      case Ledger::kSetContextLimit:
      case Ledger::kNone:
        return true;
    }
    return true;
  }

  // module_id 0: nothing was loaded (compile_only, or a failed compile).
  bool ChargeModuleLocked(uint64_t module_id, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (module_id == 0) return true;
    if (Admitted(sessions_->ChargeModule(*session_, module_id, bytes))) return true;
    UnloadInBackground(sessions_, session_, module_id);
    return false;
  }

  // True for OK; otherwise records the refusal and returns false.
  bool Admitted(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (status.ok()) return true;
    refusal_ = ToGrpcStatus(status);
    return false;
  }

  void LedgerAfterWorkerLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (ledger_) {
      case Ledger::kAllocate:
        if (reserved_bytes_ > 0) sessions_->CancelReservation(*session_, reserved_bytes_);
        reserved_bytes_ = 0;
        break;
      case Ledger::kFree:
        if (status.ok() && released_id_ != 0) {
          sessions_->ReleaseBuffer(*session_, released_id_);
          sessions_->ipc().Freed(session_->id(), released_id_);
        } else if (released_id_ != 0) {
          sessions_->ipc().CancelFree(session_->id(), released_id_);
        }
        break;
      case Ledger::kDestroyEvent:
        // An exported event opens no more; an opened one is no longer open here.
        if (status.ok() && released_id_ != 0) {
          sessions_->ipc().EventDestroyed(session_->id(), released_id_);
        }
        break;
      case Ledger::kRegisterRegion:
        if (reserved_bytes_ > 0) sessions_->CancelHostRegionReservation(*session_, reserved_bytes_);
        reserved_bytes_ = 0;
        break;
      case Ledger::kUnregisterRegion:
        if (status.ok() && released_id_ != 0) sessions_->ReleaseHostRegion(*session_, released_id_);
        break;
      case Ledger::kSetContextLimit:
        if (limit_slot_ >= 0) {
          if (status.ok()) {
            sessions_->CommitContextLimit(*session_, limit_slot_, limit_value_, reserved_bytes_);
          } else if (reserved_bytes_ > 0) {
            sessions_->CancelReservation(*session_, reserved_bytes_);
          }
        }
        reserved_bytes_ = 0;
        break;
      case Ledger::kCompile:
      case Ledger::kLinkModule:
        sessions_->EndCompile(session_->tenant());
        break;
      case Ledger::kUnloadModule:
        if (status.ok() && unloaded_module_ != 0) {
          sessions_->ReleaseModule(*session_, unloaded_module_);
        }
        break;
      case Ledger::kLoadModule:
      case Ledger::kGetFunction:
      case Ledger::kNone:
        break;
    }
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
    if (!unary_) worker_half_.RemoveHold();
  }
  void CloseFromWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!from_worker_open_) return;
    from_worker_open_ = false;
    if (!unary_) worker_half_.RemoveHold();
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (worker_done_ && !server_write_pending_ && !held_from_worker_ && !finished_) {
      finished_ = true;
      Finish(final_status_);
    }
  }

  grpc::GenericCallbackServerContext* context_;
  SessionManager* sessions_;
  FrontendMetrics* const metrics_;
  const FrontendMetrics::RelayCounters relayed_;
  std::shared_ptr<SessionRecord> session_;
  const Ledger ledger_;
  const bool client_streaming_;
  const bool unary_;  // neither side streams: relayed as a unary worker call
  // The request type whose messages ParseLimitLocked checks (null: none).
  const google::protobuf::Descriptor* const parse_checked_;
  // Guards the relay's state: the ledger's view of the call, both pumps and their buffers,
  // and how far each half has got. gRPC's callbacks take it (never while calling out to
  // something that may wait; see Translate).
  absl::Mutex mu_;
  // a one-message call's message is in from_client_
  bool request_held_ ABSL_GUARDED_BY(mu_) = false;
  // where a one-message call's half-close (or excess) is read
  grpc::ByteBuffer extra_ ABSL_GUARDED_BY(mu_);
  bool request_seen_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // SetContextLimit of a device-memory limit: its ledger slot (-1: none) and value.
  int limit_slot_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t limit_value_ ABSL_GUARDED_BY(mu_) = 0;
  // Free's buffer, DestroyEvent's event, UnregisterHostRegion's region.
  uint64_t released_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unloaded_module_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status refusal_ ABSL_GUARDED_BY(mu_);
  // Messages of the client checked by ParseLimitLocked.
  uint64_t messages_from_client_ ABSL_GUARDED_BY(mu_) = 0;
  // Not guarded: gRPC's ClientContext is thread-safe for TryCancel (OnCancel) and is read
  // unlocked for the worker's trailers (Translate).
  grpc::ClientContext worker_context_;
  WorkerHalf worker_half_ ABSL_GUARDED_BY(mu_);
  // The unary relay hands from_client_ and from_worker_ to its worker call unlocked
  // (StartUnaryWorkerCall).
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
        framed_command_streams_ ? StartFramedCommandRelay(*session, metrics_) : nullptr;
    if (metrics_ != nullptr) metrics_->CommandStreamRelayed(relay != nullptr);
    if (relay != nullptr) return relay;
  }
  const Ledger ledger = LedgerFor(context->method());
  // A link may run NVRTC for its sources: it holds a compile slot like Compile.
  if (ledger == Ledger::kCompile || ledger == Ledger::kLinkModule) {
    if (absl::Status slot = sessions_->BeginCompile(identity->tenant); !slot.ok()) {
      return new RejectReactor(ToGrpcStatus(slot));
    }
  }
  return new RelayReactor(context, sessions_, *std::move(session), ledger, method->second,
                          metrics_);
}

}  // namespace gpurpc::frontend
