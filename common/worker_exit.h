// How a worker process (gpurpcd --internal-worker, server/worker/worker_main.h) ends: the
// exit codes it uses, shared by the worker, which exits with them, and the front end, which
// reads them (SessionRecord::MarkFaultedByExit in server/frontend/session_manager.cc). Codes
// 7 and 9 come with one line on the worker's status pipe, which becomes the session's fault
// cause (DEADLINE_EXCEEDED and FAILED_PRECONDITION); any other exit, these codes or a signal,
// faults the session as "its worker process exited with code N" (or "was killed by signal
// N"), and the worker's log says why. In common/ because both sides of the process edge need
// them and the front end never includes worker code.
#ifndef GPURPC_COMMON_WORKER_EXIT_H_
#define GPURPC_COMMON_WORKER_EXIT_H_

namespace gpurpc {

inline constexpr int kWorkerExitBadUsage = 2;
inline constexpr int kWorkerExitBackendUnavailable = 3;
inline constexpr int kWorkerExitContextFailed = 4;
inline constexpr int kWorkerExitServerFailed = 5;
// The compile cache folder or its key file failed the checks of PrepareCacheDirectory /
// LoadOrCreateCacheKey (compile_cache.h); the worker's log says which and why.
inline constexpr int kWorkerExitCacheRefused = 6;
// The kernel watchdog (watchdog.h) found a kernel running past the session's kernel timeout
// and ended the worker, after writing one line naming the kernel and the timeout to
// --worker-status-fd: "kernel '<name>' ran longer than the kernel timeout of 5s
// (--kernel-timeout or the tenant's kernel_timeout_ms quota)".
inline constexpr int kWorkerExitKernelTimeout = 7;
// Setting the worker's resource limits failed at start (SetWorkerLimits in worker_main.cc);
// the worker's log says which.
inline constexpr int kWorkerExitLimitsFailed = 8;
// The session's context met a sticky fault (session.h's fault contract). The worker wrote
// the fault's message as one line to --worker-status-fd and ended itself a moment after
// answering the call that observed it (kFaultExitDelay), so that a fault seen on a direct
// channel, which the front end does not relay, still marks the session FAULTED and frees
// its GPU memory. On the relayed path the front end has usually ended the worker first.
inline constexpr int kWorkerExitSessionFaulted = 9;

}  // namespace gpurpc

#endif  // GPURPC_COMMON_WORKER_EXIT_H_
