// The one conversion between absl::Status (used everywhere inside gpurpc) and
// grpc::Status (at the gRPC edge only, server and client).
#ifndef GPURPC_COMMON_GRPC_STATUS_H_
#define GPURPC_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace gpurpc {

// Codes map one to one (both follow google.rpc.Code). Messages may quote what a client sent:
// ToGrpcStatus escapes control and non-ASCII bytes (as \xNN; newlines and tabs stay) and
// truncates the message at 4 KiB on the wire, so that no message can forge terminal output
// or blow up the peer's trailer limit.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// The one rule of the fault contract (server/worker/session.h): a status with code ABORTED
// or DATA_LOSS is a sticky fault, after which the session's context is lost for good. The
// worker, the front end's relay and the C++ client all decide it here.
inline bool IsStickyFaultCode(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted || code == absl::StatusCode::kDataLoss;
}
inline bool IsStickyFault(const absl::Status& status) { return IsStickyFaultCode(status.code()); }
inline bool IsStickyFault(const grpc::Status& status) {
  return IsStickyFaultCode(static_cast<absl::StatusCode>(status.error_code()));
}

}  // namespace gpurpc

#endif  // GPURPC_COMMON_GRPC_STATUS_H_
