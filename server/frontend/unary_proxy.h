// Relays every unary call of the session services (Memory, Module, Execution, HostRegion) to
// its session's worker: a callback service whose methods are registered raw (the request's
// bytes, never parsed by gRPC), so a call is one reaction, as the front end's own unary methods
// are, rather than the several of a generic streaming relay (proxy.h relays the streaming
// methods and answers unknown ones).
//
// Each call is authenticated and its session checked as the caller tenant's, its request
// checked against the parse bound (server/parse_limit.h) and read by the tenant's ledger
// (call_ledger.h), all before the worker sees it. It then goes to the worker on one of the
// session's framed unary channels (unary_channels.h) where one is free and the request is
// small, else as a gRPC call; either way the worker runs the same handler and the client sees
// the same answer. A worker's death or fault turns into the session's FAULTED state
// (relay_status.h). A call with no request message is refused UNIMPLEMENTED before the worker
// sees it (gRPC reads one message of a unary call; more are not read). A call whose client
// cancels or whose deadline passes ends at once (its framed answer, when it comes, is dropped),
// but a call the ledger reads waits for the worker's answer, so that the ledger records what
// the worker did.
#ifndef GPURPC_SERVER_FRONTEND_UNARY_PROXY_H_
#define GPURPC_SERVER_FRONTEND_UNARY_PROXY_H_

#include <deque>
#include <string>

#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/frontend/auth.h"
#include "server/frontend/call_ledger.h"
#include "server/frontend/metrics.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class SessionUnaryProxy final : public grpc::Service {
 public:
  // `metrics` may be null; it and the rest must outlive the service. With `framed`, calls go
  // on framed unary channels where they can (--command-relay=framed), else always by gRPC.
  SessionUnaryProxy(SessionManager* sessions, const Authenticator* auth, FrontendMetrics* metrics,
                    bool framed);

  struct Method {
    std::string path;  // "/gpurpc.v1.ExecutionService/Launch"
    const google::protobuf::Descriptor* request;
    Ledger ledger;
  };

 private:
  // The handler of every method: authenticates, finds the session and starts the relay.
  grpc::ServerUnaryReactor* Relay(const Method& method, grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response);

  SessionManager* const sessions_;
  const Authenticator* const auth_;
  FrontendMetrics* const metrics_;
  const bool framed_;
  std::deque<Method> methods_;  // stable: gRPC keeps pointers to their paths
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_UNARY_PROXY_H_
