#include "server/frontend/unix_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

absl::Status PrepareParent(const std::string& dir) {
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return absl::UnavailableError(Errno(dir));
    // mkdir -p, one level at a time.
    const size_t slash = dir.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      if (absl::Status parent = PrepareParent(dir.substr(0, slash)); !parent.ok()) return parent;
    }
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::UnavailableError(Errno(absl::StrCat("mkdir ", dir)));
    }
    if (lstat(dir.c_str(), &st) != 0) return absl::UnavailableError(Errno(dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the socket's folder %s is not a directory (or is a symlink)", dir));
  }
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the socket's folder %s belongs to uid %d, who could replace the socket; use a "
        "folder of the daemon's user",
        dir, st.st_uid));
  }
  if ((st.st_mode & (S_IWOTH | S_IWGRP)) != 0) {
    // Even with the sticky bit: another user could create the socket's name first and
    // receive the clients (and their tokens).
    return absl::FailedPreconditionError(absl::StrFormat(
        "the socket's folder %s is writable by others (mode %04o); use a folder only the "
        "daemon's user may write, e.g. %s/gpurpc",
        dir, st.st_mode & 07777, dir));
  }
  return absl::OkStatus();
}

absl::Status Bind(int fd, const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat("unix socket path %s is longer than %d bytes",
                                                      path, sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return absl::UnavailableError(Errno(absl::StrCat("bind ", path)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> OpenListeningUnixSocket(const std::string& path, uint32_t mode, int type) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrFormat("unix socket path '%s' is not absolute", path));
  }
  const std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty()) {
    if (absl::Status status = PrepareParent(dir); !status.ok()) return status;
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s exists and is not a socket; not replacing it", path));
    }
    // A socket of an earlier run, or of a daemon still running: refuse the latter.
    const int probe = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(),
                std::min(path.size() + 1, sizeof(address.sun_path) - 1));
    const bool live =
        probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    if (probe >= 0) close(probe);
    if (live) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "another process of uid %d is serving on %s%s", st.st_uid, path,
          st.st_uid == geteuid() ? " (another gpurpcd?)" : " - not ours: refusing to start"));
    }
    unlink(path.c_str());
  }

  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(Errno("socket(AF_UNIX)"));
  // Bound under a name nobody else can guess-and-race, given its mode, then moved into place.
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) nonce = getpid();
  const std::string temp = absl::StrFormat("%s.%016x.tmp", path, nonce);
  absl::Status status = Bind(fd, temp);
  if (status.ok() && chmod(temp.c_str(), mode) != 0) {
    status = absl::UnavailableError(Errno(absl::StrCat("chmod ", temp)));
  }
  if (status.ok() && rename(temp.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(Errno(absl::StrCat("rename to ", path)));
  }
  if (status.ok() && listen(fd, 128) != 0) status = absl::UnavailableError(Errno("listen"));
  if (!status.ok()) {
    unlink(temp.c_str());
    close(fd);
    return status;
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Open(const std::string& path,
                                                                 uint32_t mode,
                                                                 Authenticator* auth) {
  absl::StatusOr<int> opened = OpenListeningUnixSocket(path, mode, SOCK_STREAM);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    unlink(path.c_str());
    return absl::UnavailableError(Errno("eventfd"));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd, wake, auth));
}

UnixListener::UnixListener(std::string path, int listen_fd, int wake_fd, Authenticator* auth)
    : path_(std::move(path)), listen_fd_(listen_fd), wake_fd_(wake_fd), auth_(auth) {}

UnixListener::~UnixListener() {
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    spdlog::warn("{}", Errno("waking the unix listener"));
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

void UnixListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("{}", Errno("poll on the unix socket"));
      return;
    }
    if (fds[1].revents != 0) return;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      spdlog::warn("{}", Errno("accept on the unix socket"));
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: back off instead of spinning.
        poll(nullptr, 0, 100);
      }
      continue;
    }
    ucred cred{};
    socklen_t length = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
      spdlog::warn("{}", Errno("SO_PEERCRED"));
      close(fd);
      continue;
    }
    if (absl::Status admitted = Admit(fd, cred.uid); !admitted.ok()) {
      spdlog::warn("unix socket: refused a connection of uid {}: {}", cred.uid,
                   std::string(admitted.message()));
      close(fd);
      continue;
    }
    auth_->RegisterUnixPeer(fd, cred.uid, cred.pid);
    // gRPC owns the fd from here on (and closes it).
    grpc::AddInsecureChannelFromFd(server, fd);
  }
}

absl::Status UnixListener::Admit(int fd, uid_t uid) {
  // Forget connections gRPC has closed: their fd is gone or now names another socket.
  size_t of_uid = 0;
  for (auto it = live_.begin(); it != live_.end();) {
    struct stat st;
    if (fstat(it->first, &st) != 0 || st.st_ino != it->second.inode ||
        st.st_dev != it->second.device) {
      it = live_.erase(it);
      continue;
    }
    if (it->second.uid == uid) ++of_uid;
    ++it;
  }
  if (live_.size() >= kMaxConnections) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%d connections are open, the most the socket takes", live_.size()));
  }
  if (of_uid >= kMaxConnectionsPerUser) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the user holds %d connections, the most one user may (%d)", of_uid,
                        kMaxConnectionsPerUser));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::UnavailableError(Errno("fstat"));
  live_[fd] = Connection{st.st_dev, st.st_ino, uid};
  return absl::OkStatus();
}

}  // namespace gpurpc::frontend
