// The compile sandbox: what a compile helper process (compile_helper.h) does to itself
// before it reads a client's source, so that NVRTC -- whatever the source's preprocessor
// directives, header names or options say -- can read nothing but the toolkit's headers.
//
// In order, in the helper (single-threaded at that point, NVRTC and its builtins already
// loaded):
//   1. LimitSelf: PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE 0, every fd but 0-2 (/dev/null) and
//      the socket closed, RLIMIT_CPU (SIGXCPU, then SIGKILL a second later), RLIMIT_AS,
//      RLIMIT_FSIZE 0, RLIMIT_CORE 0, RLIMIT_NOFILE 64.
//   2. ConfineSelf, by mode:
//      landlock:  a Landlock ruleset handling every file-system right the kernel's ABI
//                 knows, with read (files and folders) beneath the include folders only;
//                 TCP bind/connect handled with no rule (ABI >= 4); abstract unix sockets
//                 and signals scoped (ABI >= 6). Nothing else on the file system is
//                 reachable: not /proc, /dev, /etc, $HOME, /tmp, the cache, NVRTC's folder.
//      namespace: new user, mount, network and IPC namespaces; the root becomes a tmpfs that
//                 holds read-only bind mounts of the include folders at their own paths,
//                 and the old root is detached (no /proc, no /dev, nothing else).
//      none:      no file-system confinement (accepted only with allow_unsandboxed).
//      auto:      landlock, else namespace, else none when allow_unsandboxed.
//      Then, in the two confined modes, every capability is dropped and a seccomp filter
//      (default allow) answers EPERM to: socket, socketpair, connect, bind, listen, accept,
//      accept4, execve, execveat, ptrace, process_vm_readv/writev, mount and the new mount
//      API, umount2, pivot_root, chroot, unshare, setns, bpf, perf_event_open, userfaultfd,
//      io_uring, keyctl, add_key, request_key, kexec, module loading, open_by_handle_at,
//      name_to_handle_at, pidfd_getfd/pidfd_send_signal, kill/tgkill/rt_*sigqueueinfo aimed
//      at another process, tkill, kcmp, ioctl(TIOCSTI), personality, syslog, acct, swapon,
//      reboot, quotactl, fanotify_init, vhangup, and clone with any namespace flag; clone3
//      gets ENOSYS so that glibc falls back to clone, whose flags the filter can see.
//
// What NVRTC needs, found with strace (CUDA 13.0): read access to the include folders, and
// libnvrtc-builtins, which it dlopen()s by name on its first compile (preloaded instead).
// It also tries /etc/localtime, /etc/ld.so.cache and libcuda.so.1 (for nothing a compile
// needs) and stat()s the working directory; all of that may fail. It needs no thread of
// its own (--split-compile starts some; they inherit the confinement).
//
// Not hidden: under Landlock, whether a path outside the allowed folders exists (opening
// it fails with EACCES rather than ENOENT, and stat(2) is not confined); namespace mode
// shows no such path at all. File contents are never reachable in either mode.
#ifndef GPURPC_SERVER_WORKER_COMPILER_SANDBOX_H_
#define GPURPC_SERVER_WORKER_COMPILER_SANDBOX_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gpurpc::compiler {

enum class SandboxMode { kAuto, kLandlock, kNamespace, kNone };

// "auto", "landlock", "namespace", "none".
absl::string_view SandboxModeName(SandboxMode mode);
std::optional<SandboxMode> ParseSandboxMode(absl::string_view name);

// How compiles are confined and bounded (the daemon's --compile-* flags).
struct SandboxOptions {
  SandboxMode mode = SandboxMode::kAuto;  // --compile-sandbox
  // --allow-unsandboxed-compile: run NVRTC unconfined when no sandbox works (auto) or when
  // the mode is none. Without it such compiles fail with FAILED_PRECONDITION.
  bool allow_unsandboxed = false;
  absl::Duration timeout = absl::Seconds(60);  // --compile-timeout: wall time of a compile
  uint64_t cpu_seconds = 60;                   // --compile-cpu-seconds: RLIMIT_CPU
  // --compile-memory-bytes: RLIMIT_AS of the helper, counting its whole address space.
  // Measured (CUDA 13.0, x86-64, CompileCostTest.DISABLED_SmallestMemoryLimit): a small
  // kernel compiles under 160 MiB, one including curand_kernel.h under 260 MiB. The default
  // leaves room for template-heavy code (CUB, CUTLASS); a bomb stops at it or at the CPU
  // limit.
  uint64_t memory_bytes = 8ull << 30;
  // The executable started as the helper with --internal-compile-helper: gpurpcd itself,
  // or a test binary whose main() dispatches that flag to CompileHelperMain().
  std::string helper_path = "/proc/self/exe";
};

// Landlock's ABI version on this kernel (1, 2, ...), or 0 when Landlock is missing or
// disabled; `why` (optional) then says which.
int LandlockAbi(std::string* why = nullptr);

// Step 1 above. `keep_fd` is the helper's socket.
absl::Status LimitSelf(uint64_t cpu_seconds, uint64_t memory_bytes, int keep_fd);

// The outcome of ConfineSelf.
struct Confinement {
  std::string description;         // "landlock (ABI 7) + seccomp", "namespace + seccomp", ...
  std::vector<std::string> notes;  // why auto skipped a mode
};

// Step 2 above: confines the calling process, which must be single-threaded.
// FAILED_PRECONDITION, saying why, when the mode cannot be applied (for auto: when no mode
// works and allow_unsandboxed is false). Irreversible: on error the process must not go on
// to compile.
absl::StatusOr<Confinement> ConfineSelf(SandboxMode mode, bool allow_unsandboxed,
                                        const std::vector<std::string>& read_dirs);

// The description of unsandboxed compiles.
inline constexpr char kUnsandboxedDescription[] =
    "none (unsandboxed compiles accepted by --allow-unsandboxed-compile)";

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_SANDBOX_H_
