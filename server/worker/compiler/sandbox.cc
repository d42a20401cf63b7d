#include "server/worker/compiler/sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/landlock.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

// Landlock definitions newer than the oldest kernel headers we build with (Linux 6.1 has
// ABI 2). The values are the kernel's UAPI and never change.
#ifndef LANDLOCK_CREATE_RULESET_VERSION
#define LANDLOCK_CREATE_RULESET_VERSION (1U << 0)
#endif
#ifndef LANDLOCK_ACCESS_FS_REFER
#define LANDLOCK_ACCESS_FS_REFER (1ULL << 13)  // ABI 2
#endif
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)  // ABI 3
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15)  // ABI 5
#endif
#ifndef LANDLOCK_ACCESS_NET_BIND_TCP
#define LANDLOCK_ACCESS_NET_BIND_TCP (1ULL << 0)  // ABI 4
#endif
#ifndef LANDLOCK_ACCESS_NET_CONNECT_TCP
#define LANDLOCK_ACCESS_NET_CONNECT_TCP (1ULL << 1)  // ABI 4
#endif
#ifndef LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET
#define LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)  // ABI 6
#endif
#ifndef LANDLOCK_SCOPE_SIGNAL
#define LANDLOCK_SCOPE_SIGNAL (1ULL << 1)  // ABI 6
#endif
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_pivot_root
#define SYS_pivot_root 155
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif

#if defined(__SANITIZE_ADDRESS__)
#define GPURPC_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GPURPC_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef GPURPC_ADDRESS_SANITIZER
#define GPURPC_ADDRESS_SANITIZER 0
#endif

namespace gpurpc::compiler {
namespace {

// struct landlock_ruleset_attr as of ABI 6; the size passed tells the kernel which fields
// are there, so older kernels get only the fields they know.
struct RulesetAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;
};

// The highest ABI whose rights this file knows; a newer kernel is used at this level.
constexpr int kLandlockAbiKnown = 7;

std::string Errno(int error) { return std::strerror(error); }

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status SetLimit(int resource, const char* name, rlim_t soft, rlim_t hard) {
  const rlimit limit{soft, hard};
  if (setrlimit(resource, &limit) != 0) {
    return absl::InternalError(absl::StrCat("setrlimit(", name, "): ", Errno(errno)));
  }
  return absl::OkStatus();
}

// Closes every descriptor above 2 except `keep`.
absl::Status CloseOtherFds(int keep) {
  const auto close_range = [](unsigned first, unsigned last) {
    return first > last ? 0 : syscall(SYS_close_range, first, last, 0);
  };
  if (close_range(3, static_cast<unsigned>(keep) - 1) == 0 &&
      close_range(static_cast<unsigned>(keep) + 1, ~0U) == 0) {
    return absl::OkStatus();
  }
  if (errno != ENOSYS) return absl::InternalError(absl::StrCat("close_range: ", Errno(errno)));
  // Kernels before 5.9: walk /proc/self/fd.
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return absl::InternalError(absl::StrCat("/proc/self/fd: ", Errno(errno)));
  std::vector<int> fds;
  while (dirent* entry = readdir(dir)) {
    const int fd = atoi(entry->d_name);
    if (fd > 2 && fd != keep && fd != dirfd(dir)) fds.push_back(fd);
  }
  closedir(dir);
  for (int fd : fds) close(fd);
  return absl::OkStatus();
}

// Threads of this process; Landlock confines only the calling thread and unshare(2) of a
// user namespace needs a single-threaded process. 0 when /proc cannot tell.
int ThreadCount() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

// ------------------------------------------------------------------------------ Landlock

absl::StatusOr<int> ApplyLandlock(const std::vector<std::string>& read_dirs) {
  std::string why;
  const int abi = LandlockAbi(&why);
  if (abi < 1) return absl::FailedPreconditionError(absl::StrCat("Landlock: ", why));
  const int level = std::min(abi, kLandlockAbiKnown);

  RulesetAttr attr{};
  size_t attr_size = sizeof(attr.handled_access_fs);
  attr.handled_access_fs =
      LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE |
      LANDLOCK_ACCESS_FS_READ_DIR | LANDLOCK_ACCESS_FS_REMOVE_DIR | LANDLOCK_ACCESS_FS_REMOVE_FILE |
      LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
      LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_BLOCK |
      LANDLOCK_ACCESS_FS_MAKE_SYM;
  if (level >= 2) attr.handled_access_fs |= LANDLOCK_ACCESS_FS_REFER;
  if (level >= 3) attr.handled_access_fs |= LANDLOCK_ACCESS_FS_TRUNCATE;
  if (level >= 5) attr.handled_access_fs |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
  if (level >= 4) {
    attr.handled_access_net = LANDLOCK_ACCESS_NET_BIND_TCP | LANDLOCK_ACCESS_NET_CONNECT_TCP;
    attr_size = offsetof(RulesetAttr, scoped);
  }
  if (level >= 6) {
    attr.scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL;
    attr_size = sizeof(attr);
  }
  const Fd ruleset(static_cast<int>(syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0)));
  if (ruleset.get() < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("Landlock: landlock_create_ruleset (ABI ", abi, "): ", Errno(errno)));
  }
  for (const std::string& dir : read_dirs) {
    const Fd folder(open(dir.c_str(), O_PATH | O_CLOEXEC | O_DIRECTORY));
    if (folder.get() < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Landlock: cannot open ", dir, ": ", Errno(errno)));
    }
    landlock_path_beneath_attr rule{};
    rule.allowed_access = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR;
    rule.parent_fd = folder.get();
    if (syscall(SYS_landlock_add_rule, ruleset.get(), LANDLOCK_RULE_PATH_BENEATH, &rule, 0) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Landlock: landlock_add_rule(", dir, "): ", Errno(errno)));
    }
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
      syscall(SYS_landlock_restrict_self, ruleset.get(), 0) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("Landlock: landlock_restrict_self: ", Errno(errno)));
  }
  return abi;
}

// ------------------------------------------------------------------------------ namespace

absl::Status WriteProcFile(const char* path, const std::string& content) {
  const Fd fd(open(path, O_WRONLY | O_CLOEXEC));
  if (fd.get() < 0 ||
      write(fd.get(), content.data(), content.size()) != static_cast<ssize_t>(content.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("namespace: writing '", content, "' to ", path, ": ", Errno(errno)));
  }
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string prefix = path.substr(0, at);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("namespace: mkdir ", prefix, ": ", Errno(errno)));
    }
  }
  return absl::OkStatus();
}

// The mount flags a read-only remount of a bind mount of `path` must keep: in a user
// namespace the kernel refuses to clear flags the original mount was locked with.
unsigned long LockedFlags(const std::string& path) {
  struct statvfs info;
  if (statvfs(path.c_str(), &info) != 0) return 0;
  unsigned long flags = 0;
  if (info.f_flag & ST_NOSUID) flags |= MS_NOSUID;
  if (info.f_flag & ST_NODEV) flags |= MS_NODEV;
  if (info.f_flag & ST_NOEXEC) flags |= MS_NOEXEC;
  if (info.f_flag & ST_NOATIME) flags |= MS_NOATIME;
  if (info.f_flag & ST_NODIRATIME) flags |= MS_NODIRATIME;
  if (info.f_flag & ST_RELATIME) flags |= MS_RELATIME;
  return flags;
}

bool IsDir(const char* path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

absl::Status EnterNamespace(const std::vector<std::string>& read_dirs) {
  const uid_t uid = geteuid();
  const gid_t gid = getegid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("namespace: unshare(user, mount, network, IPC): ", Errno(errno),
                     " (unprivileged user namespaces may be off: user.max_user_namespaces, "
                     "kernel.unprivileged_userns_clone, or AppArmor's "
                     "kernel.apparmor_restrict_unprivileged_userns)"));
  }
  GPURPC_RETURN_IF_ERROR(WriteProcFile("/proc/self/setgroups", "deny"));
  GPURPC_RETURN_IF_ERROR(WriteProcFile("/proc/self/uid_map", absl::StrCat(uid, " ", uid, " 1")));
  GPURPC_RETURN_IF_ERROR(WriteProcFile("/proc/self/gid_map", absl::StrCat(gid, " ", gid, " 1")));
  const auto fail = [](absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrCat("namespace: ", what, ": ", Errno(errno)));
  };
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return fail("making / private");
  }
  // Each folder once: one beneath another is already in its bind mount. Each is opened now,
  // and bound through /proc/self/fd: the tmpfs below may cover where it lives (/tmp).
  std::vector<std::string> dirs = read_dirs;
  std::sort(dirs.begin(), dirs.end());
  struct Source {
    std::string path;
    std::unique_ptr<Fd> fd;
    unsigned long locked_flags;
  };
  std::vector<Source> sources;
  for (const std::string& dir : dirs) {
    if (dir.empty() || dir.front() != '/') {
      return absl::FailedPreconditionError(absl::StrCat("namespace: ", dir, " is not absolute"));
    }
    const bool covered = std::any_of(sources.begin(), sources.end(), [&](const Source& outer) {
      return dir == outer.path || absl::StartsWith(dir, outer.path + "/");
    });
    if (covered) continue;
    auto fd = std::make_unique<Fd>(open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (fd->get() < 0) return fail(absl::StrCat("opening ", dir));
    const unsigned long flags = LockedFlags(dir);
    sources.push_back(Source{dir, std::move(fd), flags});
  }
  // The new root: a tmpfs mounted over an existing folder (in this mount namespace only).
  const char* base = nullptr;
  for (const char* candidate : {"/tmp", "/mnt", "/var/tmp", "/run"}) {
    if (IsDir(candidate)) {
      base = candidate;
      break;
    }
  }
  if (base == nullptr) return absl::FailedPreconditionError("namespace: no folder for the root");
  if (mount("gpurpc-compile", base, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "mode=0755,size=1m,nr_inodes=4096") != 0) {
    return fail(absl::StrCat("mounting a tmpfs on ", base));
  }
  for (const Source& source : sources) {
    const std::string target = base + source.path;
    GPURPC_RETURN_IF_ERROR(MakeDirs(target));
    const std::string from = absl::StrCat("/proc/self/fd/", source.fd->get());
    if (mount(from.c_str(), target.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
      return fail(absl::StrCat("bind-mounting ", source.path));
    }
    if (mount(nullptr, target.c_str(), nullptr,
              MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | source.locked_flags,
              nullptr) != 0) {
      return fail(absl::StrCat("remounting ", source.path, " read-only"));
    }
  }
  sources.clear();  // closes the descriptors
  const std::string old_root = absl::StrCat(base, "/.old-root");
  if (mkdir(old_root.c_str(), 0700) != 0) return fail("mkdir for the old root");
  if (syscall(SYS_pivot_root, base, old_root.c_str()) != 0) return fail("pivot_root");
  if (chdir("/") != 0) return fail("chdir /");
  if (umount2("/.old-root", MNT_DETACH) != 0) return fail("detaching the old root");
  if (rmdir("/.old-root") != 0) return fail("rmdir /.old-root");
  if (mount(nullptr, "/", nullptr, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            nullptr) != 0) {
    return fail("remounting the new root read-only");
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------- capabilities, seccomp

void DropCapabilities() {
  for (int cap = 0; cap <= 63; ++cap) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);  // EPERM/EINVAL: fine
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct header{};
  header.version = _LINUX_CAPABILITY_VERSION_3;
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  syscall(SYS_capset, &header, data);
}

absl::Status ApplySeccomp() {
  scmp_filter_ctx filter = seccomp_init(SCMP_ACT_ALLOW);
  if (filter == nullptr) return absl::FailedPreconditionError("seccomp: seccomp_init failed");
  struct Release {
    scmp_filter_ctx filter;
    ~Release() { seccomp_release(filter); }
  } release{filter};
  // Our threads (none yet) and NVRTC's later ones all get the filter.
  seccomp_attr_set(filter, SCMP_FLTATR_CTL_TSYNC, 1);

  const auto add = [&](const char* name, uint32_t action, unsigned count,
                       const scmp_arg_cmp* args) -> absl::Status {
    // Unknown, or a pseudo-syscall (< 0): not a system call of this architecture.
    const int nr = seccomp_syscall_resolve_name(name);
    if (nr < 0) return absl::OkStatus();
    const int rc = seccomp_rule_add_array(filter, action, nr, count, args);
    if (rc != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("seccomp: rule for ", name, ": ", Errno(-rc)));
    }
    return absl::OkStatus();
  };
  static const char* const kDenied[] = {
      // network and new sockets
      "socket",
      "socketpair",
      "connect",
      "bind",
      "listen",
      "accept",
      "accept4",
      // new programs
      "execve",
      "execveat",
      // other processes
      "ptrace",
      "process_vm_readv",
      "process_vm_writev",
      "pidfd_getfd",
      "pidfd_send_signal",
      "tkill",
      "kcmp",
      // mounts and namespaces
      "mount",
      "umount",
      "umount2",
      "pivot_root",
      "chroot",
      "unshare",
      "setns",
      "fsopen",
      "fsconfig",
      "fsmount",
      "fspick",
      "move_mount",
      "open_tree",
      "mount_setattr",
      // kernel attack surface
      "bpf",
      "perf_event_open",
      "userfaultfd",
      "io_uring_setup",
      "io_uring_enter",
      "io_uring_register",
      "keyctl",
      "add_key",
      "request_key",
      "kexec_load",
      "kexec_file_load",
      "init_module",
      "finit_module",
      "delete_module",
      "open_by_handle_at",
      "name_to_handle_at",
      "personality",
      "acct",
      "swapon",
      "swapoff",
      "reboot",
      "syslog",
      "quotactl",
      "lookup_dcookie",
      "vhangup",
      "fanotify_init",
      "fanotify_mark",
      // Landlock has no rights for metadata: without these a confined helper could still
      // chmod the cache key file readable for all, or touch the daemon's files' times.
      "chmod",
      "fchmod",
      "fchmodat",
      "fchmodat2",
      "chown",
      "fchown",
      "lchown",
      "fchownat",
      "utime",
      "utimes",
      "futimesat",
      "utimensat",
      "setxattr",
      "lsetxattr",
      "fsetxattr",
      "setxattrat",
      "removexattr",
      "lremovexattr",
      "fremovexattr",
      "removexattrat",
      // no children (NVRTC needs threads only): a child would outlive the wall-time kill
      // and start its CPU and memory limits afresh
      "fork",
      "vfork",
      // watching the cache folder would show other tenants' activity
      "inotify_init",
      "inotify_init1",
      "inotify_add_watch",
      // other processes of the daemon's user: priorities, I/O priorities
      "setpriority",
      "ioprio_set",
      "migrate_pages",
      "move_pages",
  };
  const uint32_t eperm = SCMP_ACT_ERRNO(EPERM);
  for (const char* name : kDenied) {
    if (absl::Status status = add(name, eperm, 0, nullptr); !status.ok()) return status;
  }
  // Signals only to this process (raise/abort use tgkill(getpid(), ...)).
  const scmp_arg_cmp not_self[] = {SCMP_A0(SCMP_CMP_NE, static_cast<scmp_datum_t>(getpid()))};
  for (const char* name : {"kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"}) {
    if (absl::Status status = add(name, eperm, 1, not_self); !status.ok()) return status;
  }
  // Limits and scheduling of this process only (pid 0); glibc's getrlimit/setrlimit use
  // prlimit64(0, ...). Another pid could be the worker or the front end.
  const scmp_arg_cmp other_pid[] = {SCMP_A0(SCMP_CMP_NE, 0)};
  for (const char* name : {"prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam",
                           "sched_setattr"}) {
    if (absl::Status status = add(name, eperm, 1, other_pid); !status.ok()) return status;
  }
  // clone without CLONE_THREAD makes a process (fork), which is refused above.
  const scmp_arg_cmp not_thread[] = {SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0)};
  if (absl::Status status = add("clone", eperm, 1, not_thread); !status.ok()) return status;
  const scmp_arg_cmp tiocsti[] = {SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCSTI)};
  if (absl::Status status = add("ioctl", eperm, 1, tiocsti); !status.ok()) return status;
  // Threads yes, namespaces no. clone3 passes its flags in memory, which a filter cannot
  // read: ENOSYS makes glibc fall back to clone.
  for (const uint64_t flag :
       {uint64_t{CLONE_NEWNS}, uint64_t{CLONE_NEWUSER}, uint64_t{CLONE_NEWPID},
        uint64_t{CLONE_NEWNET}, uint64_t{CLONE_NEWIPC}, uint64_t{CLONE_NEWUTS},
        uint64_t{CLONE_NEWCGROUP}, uint64_t{CLONE_NEWTIME}}) {
    const scmp_arg_cmp has_flag[] = {SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag)};
    if (absl::Status status = add("clone", eperm, 1, has_flag); !status.ok()) return status;
  }
  if (absl::Status status = add("clone3", SCMP_ACT_ERRNO(ENOSYS), 0, nullptr); !status.ok()) {
    return status;
  }
  if (const int rc = seccomp_load(filter); rc != 0) {
    return absl::FailedPreconditionError(absl::StrCat("seccomp: loading the filter: ", Errno(-rc)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view SandboxModeName(SandboxMode mode) {
  switch (mode) {
    case SandboxMode::kAuto:
      return "auto";
    case SandboxMode::kLandlock:
      return "landlock";
    case SandboxMode::kNamespace:
      return "namespace";
    case SandboxMode::kNone:
      return "none";
  }
  return "?";
}

std::optional<SandboxMode> ParseSandboxMode(absl::string_view name) {
  for (SandboxMode mode :
       {SandboxMode::kAuto, SandboxMode::kLandlock, SandboxMode::kNamespace, SandboxMode::kNone}) {
    if (name == SandboxModeName(mode)) return mode;
  }
  return std::nullopt;
}

int LandlockAbi(std::string* why) {
  const long abi =
      syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  if (abi >= 1) return static_cast<int>(abi);
  if (why != nullptr) {
    *why = errno == ENOSYS       ? "not built into this kernel (ENOSYS)"
           : errno == EOPNOTSUPP ? "disabled on this kernel (EOPNOTSUPP; add landlock to lsm=)"
                                 : absl::StrCat("unavailable: ", Errno(errno));
  }
  return 0;
}

absl::Status LimitSelf(uint64_t cpu_seconds, uint64_t memory_bytes, int keep_fd) {
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    return absl::InternalError(absl::StrCat("PR_SET_NO_NEW_PRIVS: ", Errno(errno)));
  }
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    return absl::InternalError(absl::StrCat("PR_SET_DUMPABLE: ", Errno(errno)));
  }
  if (absl::Status status = CloseOtherFds(keep_fd); !status.ok()) return status;
  // SIGXCPU at the soft limit, SIGKILL a second later should it be caught.
  const rlim_t cpu = static_cast<rlim_t>(std::max<uint64_t>(cpu_seconds, 1));
  for (const absl::Status& status :
       {SetLimit(RLIMIT_CPU, "RLIMIT_CPU", cpu, cpu + 1),
        SetLimit(RLIMIT_FSIZE, "RLIMIT_FSIZE", 0, 0), SetLimit(RLIMIT_CORE, "RLIMIT_CORE", 0, 0),
        SetLimit(RLIMIT_NOFILE, "RLIMIT_NOFILE", 64, 64)}) {
    if (!status.ok()) return status;
  }
#if GPURPC_ADDRESS_SANITIZER
  // AddressSanitizer maps terabytes of shadow memory: an address-space limit fails its
  // allocator at once. Sanitizer builds run tests, never tenants (tests/run.sh leaves the
  // memory-limit tests out of its sanitizer run).
  (void)memory_bytes;
  return absl::OkStatus();
#else
  return SetLimit(RLIMIT_AS, "RLIMIT_AS", memory_bytes, memory_bytes);
#endif
}

absl::StatusOr<Confinement> ConfineSelf(SandboxMode mode, bool allow_unsandboxed,
                                        const std::vector<std::string>& read_dirs) {
  Confinement result;
  if (mode == SandboxMode::kNone) {
    if (!allow_unsandboxed) {
      return absl::FailedPreconditionError(
          "--compile-sandbox=none runs NVRTC unconfined; pass --allow-unsandboxed-compile to "
          "accept that");
    }
    result.description = kUnsandboxedDescription;
    return result;
  }
  if (const int threads = ThreadCount(); threads > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the compile helper has ", threads, " threads before confinement; it must have one"));
  }

  std::string fs;  // the file-system confinement that took
  if (mode == SandboxMode::kLandlock || mode == SandboxMode::kAuto) {
    absl::StatusOr<int> abi = ApplyLandlock(read_dirs);
    if (abi.ok()) {
      fs = absl::StrCat("landlock (ABI ", *abi, ")");
    } else if (mode == SandboxMode::kLandlock) {
      return abi.status();
    } else {
      result.notes.push_back(std::string(abi.status().message()));
    }
  }
  if (fs.empty() && (mode == SandboxMode::kNamespace || mode == SandboxMode::kAuto)) {
    absl::Status status = EnterNamespace(read_dirs);
    if (status.ok()) {
      fs = "namespace";
    } else if (mode == SandboxMode::kNamespace) {
      return status;
    } else {
      result.notes.push_back(std::string(status.message()));
    }
  }
  if (fs.empty()) {
    // auto, and neither mode works here.
    if (!allow_unsandboxed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no compile sandbox works on this machine (", absl::StrJoin(result.notes, "; "),
          "); pass --allow-unsandboxed-compile to compile unconfined"));
    }
    result.description = kUnsandboxedDescription;
    return result;
  }
  DropCapabilities();
  if (absl::Status status = ApplySeccomp(); !status.ok()) {
    // File-system confinement is in force, but the sandbox is not what it claims.
    return absl::FailedPreconditionError(
        absl::StrCat(status.message(), " (after ", fs, " was applied)"));
  }
  result.description = absl::StrCat(fs, " + seccomp");
  return result;
}

}  // namespace gpurpc::compiler
