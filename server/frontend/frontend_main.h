// Entry point of the front end: the gRPC edge that clients talk to. It holds no CUDA
// context and never runs NVRTC; every session-scoped call is relayed to the session's
// worker process.
#ifndef GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_
#define GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_

#include <functional>

#include "absl/status/statusor.h"
#include "server/options.h"

namespace gpurpc::frontend {

// How SIGHUP re-reads the configuration: the command line parsed again (its --config file
// first, then its flags, as at start).
using ReloadOptions = std::function<absl::StatusOr<DaemonOptions>()>;

// Serves until SIGTERM or SIGINT, then drains and ends every worker. Returns the exit code.
// SIGHUP re-reads the tokens file and, through `reload` (when given), the configuration:
// tenant quotas, --max-sessions, admin tenants and the front end's log level take effect at
// once; any other setting that changed is logged as needing a restart. A file or flag that
// does not parse is logged and everything stays as it was.
int FrontendMain(const DaemonOptions& options, ReloadOptions reload = nullptr);

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_FRONTEND_MAIN_H_
