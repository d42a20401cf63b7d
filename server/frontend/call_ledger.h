// The tenant's ledger's view of one relayed unary call (the proxy's unary relay, proxy.h):
// what some calls reserve, charge or release in the SessionManager as they pass through.
//
//   Allocate: the size (or an array's charge) is reserved against max_device_memory_bytes
//     before the worker sees the request, and committed to the buffer id the worker answers.
//   Free: refused while another session has the exported buffer open; the buffer's bytes
//     are released once the worker confirms.
//   Compile, LinkModule: the caller holds a slot of max_concurrent_compiles (BeginCompile)
//     for the call; it is given back when the call ends.
//   Compile, LoadModule, LinkModule: the loaded module's globals, as the worker reports them,
//     are charged; a module over quota is unloaded and the call answers RESOURCE_EXHAUSTED.
//   UnloadModule: its globals are released once the worker confirms.
//   GetFunction: the local memory the driver will reserve to launch the kernel is charged,
//     the largest per session; over quota the call answers RESOURCE_EXHAUSTED and the
//     function's id is never given out.
//   RegisterHostRegion: the size is reserved against max_host_region_bytes and recorded under
//     the id the worker answers; UnregisterHostRegion releases it once the worker confirms.
//   SetContextLimit: the device memory a stack, printf FIFO or malloc heap limit makes the
//     driver reserve is charged before the worker sets it.
//   DestroyEvent: an exported event opens no more.
//
// These calls run to their end in the worker even when the client cancels, so that the
// ledger sees what really happened. A request or answer that does not parse is passed on
// unread (the worker answers the request with the right error).
#ifndef GPURPC_SERVER_FRONTEND_CALL_LEDGER_H_
#define GPURPC_SERVER_FRONTEND_CALL_LEDGER_H_

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "server/frontend/metrics.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

// The calls the ledger reads on the way through.
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

// The ledger entry of a method path ("/gpurpc.v1.MemoryService/Allocate"); kNone for the rest.
Ledger LedgerFor(std::string_view method);

// One call's ledger. Not thread-safe: the relay calls it in order, BeforeWorker, then (for an
// OK answer) OnAnswer, then AfterWorker once.
class CallLedger {
 public:
  // `metrics` may be null; it counts Compile and LinkModule answers as cache hits or misses.
  CallLedger(SessionManager* sessions, std::shared_ptr<SessionRecord> session, Ledger ledger,
             FrontendMetrics* metrics)
      : sessions_(sessions), session_(std::move(session)), ledger_(ledger), metrics_(metrics) {}

  // Reads the request before it goes to the worker; not OK when the call is refused (the
  // worker never sees it).
  absl::Status BeforeWorker(const grpc::ByteBuffer& raw);
  // Reads the worker's OK answer before it goes to the client; not OK when the answer is
  // refused (the client does not get it).
  absl::Status OnAnswer(const grpc::ByteBuffer& raw);
  // The worker's side ended with `status` (as the client will see it).
  void AfterWorker(const grpc::Status& status);

 private:
  absl::Status ChargeModule(uint64_t module_id, uint64_t bytes);

  SessionManager* const sessions_;
  const std::shared_ptr<SessionRecord> session_;
  const Ledger ledger_;
  FrontendMetrics* const metrics_;
  uint64_t reserved_bytes_ = 0;
  // SetContextLimit of a device-memory limit: its ledger slot (-1: none) and value.
  int limit_slot_ = -1;
  uint64_t limit_value_ = 0;
  // Free's buffer, DestroyEvent's event, UnregisterHostRegion's region.
  uint64_t released_id_ = 0;
  uint64_t unloaded_module_ = 0;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_CALL_LEDGER_H_
