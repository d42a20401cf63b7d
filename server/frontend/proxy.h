// Routes every session-scoped call to its session's worker without re-encoding it: a
// callback generic service that relays raw messages in both directions (unary and
// streaming alike), authenticates the caller and checks that the session is the caller
// tenant's first, and turns a worker's death or fault into the session's FAULTED state.
//
// Some calls are also read on the way through, for the tenant's ledger: Allocate (the
// size is reserved against max_device_memory_bytes before the worker sees the request,
// and the answer's buffer id is recorded), Free (the buffer's bytes are released once the
// worker confirms), Compile and LinkModule (a slot of max_concurrent_compiles is held while
// it runs), Compile, LoadModule and LinkModule (the loaded module's globals, as the worker
// reports them, are
// charged; a module over quota is unloaded and the call answers RESOURCE_EXHAUSTED) and
// UnloadModule (its globals are released) and GetFunction (the local memory the driver will
// reserve to launch the kernel is charged, the largest per session; over quota the call
// answers RESOURCE_EXHAUSTED and the function's id is never given out), RegisterHostRegion
// (the region's size is reserved against max_host_region_bytes and recorded under the id the
// worker answers) and UnregisterHostRegion (released once the worker confirms). These ledger
// calls run to
// their end in the worker even when the client cancels, so that the ledger sees what really
// happened.
//
// A command stream goes to the worker on a framed channel instead (command_relay.h), where
// the session has room for one; what the client sees is the same.
//
// With metrics (metrics.h), the relay counts the bytes of every message it passes on, per
// method and direction, and each Compile answer as a compile cache hit or miss.
#ifndef GPURPC_SERVER_FRONTEND_PROXY_H_
#define GPURPC_SERVER_FRONTEND_PROXY_H_

#include "grpcpp/generic/async_generic_service.h"
#include "server/frontend/auth.h"
#include "server/frontend/metrics.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class SessionProxy final : public grpc::CallbackGenericService {
 public:
  // `metrics` may be null; it must outlive the proxy. With `framed_command_streams`, command
  // streams go to the workers on framed channels (command_relay.h) where they can, else
  // every call is relayed by gRPC.
  SessionProxy(SessionManager* sessions, const Authenticator* auth,
               FrontendMetrics* metrics = nullptr, bool framed_command_streams = true)
      : sessions_(sessions),
        auth_(auth),
        metrics_(metrics),
        framed_command_streams_(framed_command_streams) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  SessionManager* sessions_;
  const Authenticator* auth_;
  FrontendMetrics* metrics_;
  const bool framed_command_streams_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_PROXY_H_
