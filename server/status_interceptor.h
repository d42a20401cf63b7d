// A server interceptor for both halves of the daemon, applied to every call:
// - A request that does not parse as its protobuf type (or a unary call with no request, or
//   one a callback method refused as too large to parse: server/parse_checked_service.h) is
//   answered by gRPC with INTERNAL or UNIMPLEMENTED and no message; the interceptor turns
//   that into INVALID_ARGUMENT naming the method, as every other bad argument is answered.
//   (gpurpc's own statuses always carry a message.) A method the server does not serve at
//   all stays UNIMPLEMENTED, with a message saying so.
// - gRPC's "Server Threadpool Exhausted" (RESOURCE_EXHAUSTED when every thread of the
//   server's resource quota is busy) is reworded to name the limit, `max_threads`.
// - In a worker (mark_worker_answers), every status the worker sends is marked with
//   trailing metadata (kWorkerAnswerMetadataKey, common/limits.h), so that the front end's
//   relay tells the worker's own answer (say UNAVAILABLE for an event that is not ready)
//   from the status gRPC makes up when the worker's channel breaks (the worker died).
//   Without the mark the relay would have to wait for the worker's exit on every
//   UNAVAILABLE to know which it was.
// - With a CallObserver (the front end's metrics), every call's end is reported: its
//   method, the status code as sent (after the rewording above) and how long the call took.
#ifndef GPURPC_SERVER_STATUS_INTERCEPTOR_H_
#define GPURPC_SERVER_STATUS_INTERCEPTOR_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "grpcpp/support/server_interceptor.h"

namespace gpurpc {

// Told of every call a server answers. Runs on gRPC's threads, once per call, just before
// the status is sent: thread-safe and quick.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  // `method`: the call's path ("/gpurpc.v1.SessionService/OpenSession"), as the client sent
  // it for calls of a generic service, "" when gRPC names none. `seconds`: from the start
  // of the call (for a streaming call, its whole life) to its status.
  virtual void OnCallEnd(std::string_view method, grpc::StatusCode code, double seconds) = 0;
};

// The message of the INVALID_ARGUMENT above, for a request of `method` that does not parse
// (also the worker's answer to such a request relayed on a framed unary channel).
std::string NotParsedRequestMessage(std::string_view method);

// For ServerBuilder::experimental().SetInterceptorCreators. `observer` (may be null) must
// outlive the server.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
StatusInterceptors(bool mark_worker_answers, int max_threads, CallObserver* observer = nullptr);

}  // namespace gpurpc

#endif  // GPURPC_SERVER_STATUS_INTERCEPTOR_H_
