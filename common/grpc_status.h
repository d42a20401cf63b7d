// The one conversion between absl::Status (used everywhere inside gpurpc) and
// grpc::Status (at the gRPC edge only, server and client).
#ifndef GPURPC_COMMON_GRPC_STATUS_H_
#define GPURPC_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace gpurpc {

// Codes map one to one (both follow google.rpc.Code). Messages longer than 4 KiB are
// truncated so that a runaway log cannot blow up trailers.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace gpurpc

#endif  // GPURPC_COMMON_GRPC_STATUS_H_
