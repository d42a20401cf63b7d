#include "server/frontend/call_ledger.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/array_shape.h"
#include "common/limits.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

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

}  // namespace

Ledger LedgerFor(std::string_view method) {
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

absl::Status CallLedger::BeforeWorker(const grpc::ByteBuffer& raw) {
  if (ledger_ == Ledger::kAllocate) {
    v1::AllocateRequest request;
    // An unparsable request goes on: the worker answers it with the right error, as it
    // does an array shape that ArrayChargeBytes refuses (nothing is reserved for it).
    if (ParseRelayed(raw, &request)) {
      uint64_t bytes = request.size_bytes();
      if (request.has_array()) {
        const v1::ArrayDescriptor& array = request.array();
        bytes = ArrayChargeBytes(array.width(), array.height(), array.depth(), array.format(),
                                 array.num_channels(), array.flags())
                    .value_or(0);
      }
      if (bytes > 0) {
        if (absl::Status reserved = sessions_->ReserveMemory(*session_, bytes); !reserved.ok()) {
          return reserved;
        }
        reserved_bytes_ = bytes;
      }
    }
  } else if (ledger_ == Ledger::kUnloadModule) {
    v1::UnloadModuleRequest request;
    if (ParseRelayed(raw, &request)) unloaded_module_ = request.module_id();
  } else if (ledger_ == Ledger::kFree) {
    v1::FreeRequest request;
    if (ParseRelayed(raw, &request)) {
      // Exported memory that another session has open must not be freed under it.
      if (absl::Status begun = sessions_->ipc().BeginFree(session_->id(), request.buffer_id());
          !begun.ok()) {
        return begun;
      }
      released_id_ = request.buffer_id();
    }
  } else if (ledger_ == Ledger::kRegisterRegion) {
    v1::RegisterHostRegionRequest request;
    if (ParseRelayed(raw, &request) && request.size_bytes() > 0) {
      if (absl::Status reserved = sessions_->ReserveHostRegion(*session_, request.size_bytes());
          !reserved.ok()) {
        return reserved;
      }
      reserved_bytes_ = request.size_bytes();
    }
  } else if (ledger_ == Ledger::kDestroyEvent) {
    v1::DestroyEventRequest request;
    if (ParseRelayed(raw, &request)) released_id_ = request.event_id();
  } else if (ledger_ == Ledger::kUnregisterRegion) {
    v1::UnregisterHostRegionRequest request;
    if (ParseRelayed(raw, &request)) released_id_ = request.region_id();
  } else if (ledger_ == Ledger::kSetContextLimit) {
    v1::SetContextLimitRequest request;
    // The device memory the driver reserves for the context: charged before the worker sets
    // it. Values outside the worker's bounds are not charged: the worker refuses them.
    if (ParseRelayed(raw, &request)) {
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
        if (!reserved.ok()) return reserved.status();
        limit_slot_ = slot;
        limit_value_ = request.value();
        reserved_bytes_ = *reserved;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CallLedger::OnAnswer(const grpc::ByteBuffer& raw) {
  switch (ledger_) {
    case Ledger::kAllocate: {
      v1::AllocateResponse response;
      if (reserved_bytes_ > 0 && ParseRelayed(raw, &response)) {
        sessions_->CommitBuffer(*session_, reserved_bytes_, response.buffer().buffer_id(),
                                response.buffer().size_bytes());
        reserved_bytes_ = 0;
      }
      return absl::OkStatus();
    }
    case Ledger::kGetFunction: {
      v1::GetFunctionResponse response;
      if (!ParseRelayed(raw, &response)) return absl::OkStatus();
      // Refused, the client never learns the function's id, so it cannot launch it.
      return sessions_->ChargeLocalMemory(
          *session_, static_cast<uint64_t>(std::max(0, response.attributes().local_size_bytes())));
    }
    case Ledger::kLoadModule: {
      v1::LoadModuleResponse response;
      if (!ParseRelayed(raw, &response)) return absl::OkStatus();
      return ChargeModule(response.module_id(), response.device_memory_bytes());
    }
    case Ledger::kCompile: {
      v1::CompileResponse response;
      if (!ParseRelayed(raw, &response)) return absl::OkStatus();
      // Every answered compile looked the cache up first: a miss ran NVRTC.
      if (metrics_ != nullptr) metrics_->CompileAnswered(response.cache_hit());
      return ChargeModule(response.module_id(), response.device_memory_bytes());
    }
    case Ledger::kLinkModule: {
      v1::LinkModuleResponse response;
      if (!ParseRelayed(raw, &response)) return absl::OkStatus();
      if (metrics_ != nullptr) {
        for (const v1::LinkSourceResult& source : response.sources()) {
          metrics_->CompileAnswered(source.cache_hit());
        }
      }
      return ChargeModule(response.module_id(), response.device_memory_bytes());
    }
    case Ledger::kRegisterRegion: {
      v1::RegisterHostRegionResponse response;
      if (reserved_bytes_ > 0 && ParseRelayed(raw, &response) && response.region_id() != 0) {
        sessions_->CommitHostRegion(*session_, reserved_bytes_, response.region_id());
        reserved_bytes_ = 0;
      }
      return absl::OkStatus();
    }
    case Ledger::kFree:
    case Ledger::kDestroyEvent:
    case Ledger::kUnloadModule:
    case Ledger::kUnregisterRegion:
    case Ledger::kSetContextLimit:
    case Ledger::kNone:
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status CallLedger::ChargeModule(uint64_t module_id, uint64_t bytes) {
  if (module_id == 0) return absl::OkStatus();
  absl::Status charged = sessions_->ChargeModule(*session_, module_id, bytes);
  if (!charged.ok()) UnloadInBackground(sessions_, session_, module_id);
  return charged;
}

void CallLedger::AfterWorker(const grpc::Status& status) {
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

}  // namespace gpurpc::frontend
