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

#include "server/options.h"

namespace gpurpc::worker {

// Exit codes the front end turns into a fault cause.
inline constexpr int kExitBadUsage = 2;
inline constexpr int kExitBackendUnavailable = 3;
inline constexpr int kExitContextFailed = 4;
inline constexpr int kExitServerFailed = 5;
// The compile cache folder or its key file failed the checks of PrepareCacheDirectory /
// LoadOrCreateCacheKey (compile_cache.h); the worker's log says which and why.
inline constexpr int kExitCacheRefused = 6;
// The kernel watchdog (watchdog.h) found a kernel running past the session's kernel timeout
// and ended the worker, after writing one line naming the kernel and the timeout to
// --worker-status-fd: "kernel '<name>' ran longer than the kernel timeout of 5s
// (--kernel-timeout or the tenant's kernel_timeout_ms quota)".
inline constexpr int kExitKernelTimeout = 7;
// Setting the worker's resource limits failed at start (SetWorkerLimits in worker_main.cc);
// the worker's log says which.
inline constexpr int kExitLimitsFailed = 8;
// The session's context met a sticky fault (session.h's fault contract). The worker wrote
// the fault's message as one line to --worker-status-fd and ended itself a moment after
// answering the call that observed it (kFaultExitDelay), so that a fault seen on a direct
// channel, which the front end does not relay, still marks the session FAULTED and frees
// its GPU memory. On the relayed path the front end has usually ended the worker first.
inline constexpr int kExitSessionFaulted = 9;

int WorkerMain(const DaemonOptions& options);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_WORKER_MAIN_H_
