// One datagram with file descriptors over an AF_UNIX SOCK_SEQPACKET socket (SCM_RIGHTS):
// how same-host regions travel (proto/gpurpc/v1/host_region_service.proto). Used by the
// C++ client, the front end's region socket and the front end <-> worker region channel.
#ifndef GPURPC_COMMON_FD_PASSING_H_
#define GPURPC_COMMON_FD_PASSING_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace gpurpc {

// Largest datagram of the region protocol, either way.
inline constexpr size_t kMaxRegionDatagramBytes = 1024;

// A received datagram and the descriptors that came with it. The descriptors are owned
// (close-on-exec, closed by the destructor unless released).
struct ReceivedDatagram {
  std::string bytes;
  std::vector<int> fds;
  // MSG_TRUNC / MSG_CTRUNC: the datagram or its descriptors did not fit (the descriptors
  // that did are in `fds`, and are closed with the rest).
  bool truncated = false;
  ReceivedDatagram() = default;
  ReceivedDatagram(ReceivedDatagram&& other) noexcept;
  ReceivedDatagram& operator=(ReceivedDatagram&&) = delete;
  ReceivedDatagram(const ReceivedDatagram&) = delete;
  ~ReceivedDatagram();
  // Gives up ownership of fds[i] (it becomes -1 in `fds`).
  int Release(size_t i);
};

// Sends `bytes` (at most kMaxRegionDatagramBytes) with `fds` (at most 8) as one datagram;
// `flags` as for sendmsg (MSG_NOSIGNAL is always added). UNAVAILABLE with errno's text.
absl::Status SendDatagram(int socket_fd, absl::string_view bytes, const std::vector<int>& fds,
                          int flags = 0);

// Receives one datagram of up to kMaxRegionDatagramBytes with up to 8 descriptors (more are
// closed by the kernel path that truncates; `truncated` says so). UNAVAILABLE when the peer
// closed (message "closed"; an empty datagram without descriptors reads the same, so the
// protocol never sends one) or on an error; `flags` as for recvmsg (MSG_CMSG_CLOEXEC is
// always added).
absl::Status ReceiveDatagram(int socket_fd, ReceivedDatagram* out, int flags = 0);

}  // namespace gpurpc

#endif  // GPURPC_COMMON_FD_PASSING_H_
