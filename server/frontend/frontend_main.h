// Entry point of the front end: the gRPC edge that clients talk to. It holds no CUDA
// context and never runs NVRTC; every session-scoped call is relayed to the session's
// worker process.
#ifndef GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_
#define GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_

#include "server/options.h"

namespace gpurpc::frontend {

// Serves until SIGTERM or SIGINT, then drains and ends every worker. Returns the exit code.
int FrontendMain(const DaemonOptions& options);

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_
