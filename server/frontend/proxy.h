// Routes every streaming call of the session services (CommandStream, UploadStream,
// DownloadStream) to its session's worker without re-encoding it, and answers a method gpurpcd
// does not have: a callback generic service that relays raw messages in both directions,
// authenticates the caller and checks that the session is the caller tenant's first, and turns
// a worker's death or fault into the session's FAULTED state. Each message of the client is
// checked against the parse bound (server/parse_limit.h) before the worker parses it, but for
// command batches, which the worker checks itself. Unary methods are registered by
// SessionUnaryProxy (unary_proxy.h), which also keeps the tenant's ledger; none comes here.
//
// A command stream goes to the worker on a framed channel (command_relay.h), where the session
// has room for one; what the client sees is the same.
//
// With metrics (metrics.h), the relay counts the bytes of every message it passes on, per
// method and direction.
#ifndef GPURPC_SERVER_FRONTEND_PROXY_H_
#define GPURPC_SERVER_FRONTEND_PROXY_H_

#include "grpcpp/generic/async_generic_service.h"
#include "server/frontend/auth.h"
#include "server/frontend/metrics.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

// The services whose calls belong to a session and run in its worker: their unary methods are
// relayed by SessionUnaryProxy (unary_proxy.h), their streaming ones by SessionProxy.
inline constexpr const char* kSessionServices[] = {
    "gpurpc.v1.MemoryService",
    "gpurpc.v1.ModuleService",
    "gpurpc.v1.ExecutionService",
    "gpurpc.v1.HostRegionService",
};

class SessionProxy final : public grpc::CallbackGenericService {
 public:
  // `metrics` may be null; it must outlive the proxy. With `framed_relay`, command streams go
  // to the workers on framed channels (command_relay.h) where they can, else by gRPC.
  SessionProxy(SessionManager* sessions, const Authenticator* auth,
               FrontendMetrics* metrics = nullptr, bool framed_relay = true)
      : sessions_(sessions), auth_(auth), metrics_(metrics), framed_relay_(framed_relay) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  SessionManager* sessions_;
  const Authenticator* auth_;
  FrontendMetrics* metrics_;
  const bool framed_relay_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_PROXY_H_
