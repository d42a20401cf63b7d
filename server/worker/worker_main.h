// Entry point of a worker process (gpurpcd --internal-worker ...), started by the front end
// with one end of a private socketpair. It owns one context on one device and serves the
// session-scoped services over that socket until the front end kills it or goes away.
//
// NVRTC never runs in the worker: each compile that misses the compile cache runs in a
// compile helper process the worker spawns from its own executable (gpurpcd
// --internal-compile-helper, see compiler/compile_helper.h), which confines itself with
// Landlock or namespaces plus seccomp (compiler/sandbox.h, --compile-sandbox) and is bounded
// by --compile-timeout, --compile-cpu-seconds and --compile-memory-bytes. The inventory
// worker (device -1) probes that protection at startup -- a helper confines itself and
// compiles a trivial kernel --, logs it at info level and reports it in
// ListDevicesResponse.compile_sandbox; session workers leave that field empty. Without a
// working sandbox, compiles fail with FAILED_PRECONDITION unless the daemon was started
// with --allow-unsandboxed-compile.
#ifndef GPURPC_SERVER_WORKER_WORKER_MAIN_H_
#define GPURPC_SERVER_WORKER_WORKER_MAIN_H_

#include "common/worker_exit.h"  // the exit codes
#include "server/options.h"

namespace gpurpc::worker {

int WorkerMain(const DaemonOptions& options);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_WORKER_MAIN_H_
