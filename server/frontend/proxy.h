// Routes every session-scoped call to its session's worker without re-encoding it: a
// callback generic service that relays raw messages in both directions (unary and
// streaming alike), checks the session first, and turns a worker's death or fault into
// the session's FAULTED state.
#ifndef GPURPC_SERVER_FRONTEND_PROXY_H_
#define GPURPC_SERVER_FRONTEND_PROXY_H_

#include "grpcpp/generic/async_generic_service.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class SessionProxy final : public grpc::CallbackGenericService {
 public:
  explicit SessionProxy(SessionManager* sessions) : sessions_(sessions) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;

 private:
  SessionManager* sessions_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_PROXY_H_
