// Entry point of a worker process (gpurpcd --internal-worker ...), started by the front end
// with one end of a private socketpair. It owns one context on one device and serves the
// session-scoped services over that socket until the front end kills it or goes away.
#ifndef GPURPC_SERVER_WORKER_WORKER_MAIN_H_
#define GPURPC_SERVER_WORKER_WORKER_MAIN_H_

#include "server/options.h"

namespace gpurpc::worker {

// Exit codes the front end turns into a fault cause.
inline constexpr int kExitBadUsage = 2;
inline constexpr int kExitBackendUnavailable = 3;
inline constexpr int kExitContextFailed = 4;
inline constexpr int kExitServerFailed = 5;

int WorkerMain(const DaemonOptions& options);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_WORKER_MAIN_H_
