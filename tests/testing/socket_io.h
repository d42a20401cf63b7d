// Writing to a socket by hand in tests that play one side of a protocol (a worker on a relay
// channel, a client on the region socket). Header-only, so any test (unit, service or gpu)
// has it through gpurpc_testing's include path, with no library to link.
#ifndef GPURPC_TESTS_TESTING_SOCKET_IO_H_
#define GPURPC_TESTS_TESTING_SOCKET_IO_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <string_view>

namespace gpurpc::testing {

// Sends all of `bytes` on `fd` (MSG_NOSIGNAL, so a closed peer is an error, not SIGPIPE),
// retrying after EINTR. False when the peer's side ended first or the socket refused them
// (a send that failed, or timed out under SO_SNDTIMEO).
inline bool SendAll(int fd, std::string_view bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_SOCKET_IO_H_
