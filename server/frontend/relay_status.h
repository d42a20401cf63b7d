// What a client is answered when its session's worker answered a relayed call, or when the
// call to the worker broke: shared by the relays of server/frontend/proxy.h,
// server/frontend/unary_proxy.h and server/frontend/command_relay.h.

#ifndef GPURPC_SERVER_FRONTEND_RELAY_STATUS_H_
#define GPURPC_SERVER_FRONTEND_RELAY_STATUS_H_

#include <cstdint>
#include <string>

#include "grpcpp/support/status.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

// Maps `status`, the end of a relayed call to `method` of `session`, to what the client sees,
// and records faults:
// - a sticky fault (ABORTED, DATA_LOSS) marks the session FAULTED and says so;
// - UNAVAILABLE, INTERNAL, UNKNOWN or CANCELLED that the worker did not answer itself
//   (`answered_by_worker` false: the call broke) waits up to 250 ms (not for CANCELLED) for
//   a worker that is ending; one that ended makes the session FAULTED (or the call CANCELLED
//   when the session was being closed), and the answer names the cause;
// - anything else goes to the client as it is.
// May wait: never call it on one of gRPC's callback threads while holding a lock a callback
// takes.
grpc::Status TranslateWorkerStatus(SessionRecord& session, const std::string& method,
                                   const grpc::Status& status, bool answered_by_worker);

// A status a worker sent in a frame of the framed protocols (an end frame's CommandError, a
// RelayedAnswer): a code outside google.rpc.Code is UNKNOWN, and the message is cut and
// escaped as ToGrpcStatus does (at most 4 KiB), as the gRPC relay would have passed it on.
grpc::Status StatusFromWorker(int32_t code, const std::string& message);

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_RELAY_STATUS_H_
