// Marks every status the worker's gRPC server sends with trailing metadata
// (kWorkerAnswerMetadataKey, common/limits.h), so that the front end's relay can tell the
// worker's own answer (say UNAVAILABLE for an event that is not ready) from the status gRPC
// makes up when the worker's channel breaks (the worker died). Without the mark the relay
// would have to wait for the worker's exit on every UNAVAILABLE to know which it was.
#ifndef GPURPC_SERVER_WORKER_STATUS_MARKER_H_
#define GPURPC_SERVER_WORKER_STATUS_MARKER_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace gpurpc::worker {

// Register with ServerBuilder::experimental().SetInterceptorCreators.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStatusMarker();

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_STATUS_MARKER_H_
