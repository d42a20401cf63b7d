// The compile helper: every NVRTC compile runs in a short-lived process of its own, so that
// the kernel -- not a scan of the source -- decides which files NVRTC can read, and so that
// a compile that runs away can be bounded and killed without harming the worker.
//
// The worker starts its own executable (`SandboxOptions::helper_path`, /proc/self/exe) with
// `--internal-compile-helper` through posix_spawn (never fork: the worker may hold a CUDA
// context), with fds 0-2 on /dev/null, one end of a socketpair on fd 3, and an environment
// of LD_LIBRARY_PATH alone. Over the socket (compile_helper.proto):
//   1. the worker sends its settings (sandbox mode, limits, include folders, NVRTC's file);
//   2. the helper loads NVRTC and its builtins, limits and confines itself (sandbox.h) and
//      answers Hello -- or why it could not confine itself, and exits;
//   3. only then does it read the request (the client's text), compile, answer and _exit.
// The worker kills the helper at --compile-timeout, and always once it has its answer; a
// helper killed by RLIMIT_CPU or short of memory is reported as RESOURCE_EXHAUSTED.
//
// One helper per compile (not a reused one): exact per-compile rlimits (RLIMIT_CPU counts a
// process's whole life), a fresh address space for every tenant's source, nothing left
// behind by a compile that went wrong. Its cost, measured on a 2-core x86-64 VM with a warm
// page cache (CompileCostTest.HelperCostPerCompile, gpurpcd as the helper): starting,
// loading NVRTC and confining take ~15 ms; a trivial kernel takes ~40 ms against ~11 ms in
// an NVRTC already warm in the calling process, one including curand_kernel.h ~590 ms
// against ~500 ms (a fresh NVRTC's first compile is slower than a warm one's). Cache hits
// never start a helper.
#ifndef GPURPC_SERVER_WORKER_COMPILER_COMPILE_HELPER_H_
#define GPURPC_SERVER_WORKER_COMPILER_COMPILE_HELPER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"
#include "server/worker/compiler/sandbox.h"

namespace gpurpc::compiler {

// The flag that makes gpurpcd (or a test binary, see SandboxOptions::helper_path) a compile
// helper, and the fd its socket is on.
inline constexpr char kCompileHelperFlag[] = "--internal-compile-helper";
inline constexpr int kCompileHelperFd = 3;

// Everything a worker needs to start helpers.
struct HelperSettings {
  SandboxOptions sandbox;
  // Folders the compile may read: the toolkit include folder and its cccl/ subfolder.
  std::vector<std::string> read_dirs;
  // The NVRTC library file, absolute (NvrtcLibrary::path).
  std::string nvrtc_path;
};

// One NVRTC compile exactly as given: nothing is checked or added.
struct NvrtcInvocation {
  std::string source;
  std::string program_name = "kernel.cu";
  std::vector<std::string> options;
  std::vector<std::pair<std::string, std::string>> headers;  // (name, content)
  std::vector<std::string> name_expressions;
  bool cubin = true;  // false: PTX
};

struct NvrtcOutcome {
  int compile_result = 0;  // nvrtcCompileProgram's nvrtcResult
  std::string log;
  std::vector<uint8_t> image;  // on success
  std::vector<std::pair<std::string, std::string>> lowered_names;
  std::string sandbox;  // the confinement it ran under, e.g. "landlock (ABI 7) + seccomp"
};

// Runs `invocation` in a new helper: the sandboxed NVRTC entry point. Errors:
//   FAILED_PRECONDITION  the sandbox cannot be applied as configured (the message says why
//                        and names the flag), or mode none without allow_unsandboxed;
//   DEADLINE_EXCEEDED    wall time over sandbox.timeout (--compile-timeout);
//   RESOURCE_EXHAUSTED   CPU time over sandbox.cpu_seconds (--compile-cpu-seconds), or memory
//                        over sandbox.memory_bytes (--compile-memory-bytes);
//   INVALID_ARGUMENT     NVRTC refused an input outside nvrtcCompileProgram (e.g. a name
//                        expression with no lowered name);
//   INTERNAL             the helper could not be started, broke the protocol or crashed.
// A compile error is not an error here: compile_result and the log say so.
absl::StatusOr<NvrtcOutcome> RunNvrtcInHelper(const HelperSettings& settings,
                                              const NvrtcInvocation& invocation);

// Starts a helper, lets it confine itself and compile a trivial kernel, and describes the
// protection in force: "landlock (ABI 7) + seccomp", "namespace + seccomp",
// "none (unsandboxed compiles accepted by --allow-unsandboxed-compile)", or
// "unavailable: <why>". `notes` (optional) receives why auto mode skipped a mode.
std::string ProbeCompileSandbox(const HelperSettings& settings,
                                std::vector<std::string>* notes = nullptr);

// main() of a helper process (fd kCompileHelperFd is its socket); returns its exit status.
int CompileHelperMain();

// One frame of the helper protocol read from `fd` (a 4-byte little-endian length, then the
// message) into `message`, for the protocol's tests. INTERNAL when the length is over
// `max_size`, when the bytes would parse to more than twice their size plus 16 MiB
// (server/parse_limit.h: the helper compiles a tenant's source and is not trusted), or do not
// parse; DEADLINE_EXCEEDED after `deadline`; UNAVAILABLE when the peer closed.
absl::Status ReadHelperFrame(int fd, google::protobuf::MessageLite* message, uint32_t max_size,
                             absl::Time deadline);

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_COMPILE_HELPER_H_
