#include "common/fd_passing.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace gpurpc {
namespace {

constexpr size_t kMaxFds = 8;

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

ReceivedDatagram::ReceivedDatagram(ReceivedDatagram&& other) noexcept
    : bytes(std::move(other.bytes)), fds(std::move(other.fds)), truncated(other.truncated) {
  other.fds.clear();
}

ReceivedDatagram::~ReceivedDatagram() {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

int ReceivedDatagram::Release(size_t i) {
  const int fd = fds.at(i);
  fds[i] = -1;
  return fd;
}

absl::Status SendDatagram(int socket_fd, absl::string_view bytes, const std::vector<int>& fds,
                          int flags) {
  if (bytes.size() > kMaxRegionDatagramBytes || fds.size() > kMaxFds) {
    return absl::InvalidArgumentError(absl::StrCat("a region datagram takes at most ",
                                                   kMaxRegionDatagramBytes, " bytes and ", kMaxFds,
                                                   " descriptors"));
  }
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  if (!fds.empty()) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t sent = sendmsg(socket_fd, &message, flags | MSG_NOSIGNAL);
    if (sent >= 0) {
      if (static_cast<size_t>(sent) != bytes.size()) {
        return absl::UnavailableError("sendmsg: the datagram went out short");
      }
      return absl::OkStatus();
    }
    if (errno == EINTR) continue;
    return absl::UnavailableError(Errno("sendmsg"));
  }
}

absl::Status ReceiveDatagram(int socket_fd, ReceivedDatagram* out, int flags) {
  out->bytes.assign(kMaxRegionDatagramBytes, '\0');
  for (int fd : out->fds) {
    if (fd >= 0) close(fd);
  }
  out->fds.clear();
  out->truncated = false;
  iovec iov{out->bytes.data(), out->bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t received = -1;
  for (;;) {
    received = recvmsg(socket_fd, &message, flags | MSG_CMSG_CLOEXEC);
    if (received >= 0 || errno != EINTR) break;
  }
  if (received < 0) return absl::UnavailableError(Errno("recvmsg"));
  // Every descriptor that arrived is ours to close, whatever else is wrong.
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      out->fds.push_back(fd);
    }
  }
  out->truncated = (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  out->bytes.resize(static_cast<size_t>(received));
  if (received == 0 && out->fds.empty() && !out->truncated) {
    return absl::UnavailableError("closed");
  }
  return absl::OkStatus();
}

}  // namespace gpurpc
