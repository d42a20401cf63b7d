#include "server/frontend/region_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fd_passing.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "server/frontend/unix_listener.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// Answers and closes a connection. The reply is small: it fits the socket's buffer even
// though the socket does not block.
void Reply(int fd, const absl::Status& status) {
  v1::AttachHostRegionReply reply;
  reply.set_code(static_cast<int>(status.code()));
  // Never an empty datagram: a SOCK_SEQPACKET reader cannot tell one from a hang-up.
  reply.set_message(status.ok()
                        ? std::string("attached")
                        : std::string(status.message()).substr(0, kMaxRegionDatagramBytes / 2));
  SendDatagram(fd, reply.SerializeAsString(), {}, MSG_DONTWAIT).IgnoreError();
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionListener>> RegionListener::Open(const std::string& path,
                                                                     uint32_t mode,
                                                                     SessionManager* sessions) {
  absl::StatusOr<int> fd = OpenListeningUnixSocket(path, mode, SOCK_SEQPACKET);
  if (!fd.ok()) return fd.status();
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(*fd);
    unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<RegionListener>(new RegionListener(path, *fd, wake, sessions));
}

RegionListener::RegionListener(std::string path, int listen_fd, int wake_fd,
                               SessionManager* sessions)
    : path_(std::move(path)), listen_fd_(listen_fd), wake_fd_(wake_fd), sessions_(sessions) {}

RegionListener::~RegionListener() {
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    spdlog::warn("waking the region listener: {}", std::strerror(errno));
  }
  if (thread_.joinable()) thread_.join();
  for (const Pending& connection : pending_) close(connection.fd);
  close(listen_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

void RegionListener::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void RegionListener::Loop() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    absl::Time first_deadline = absl::InfiniteFuture();
    for (const Pending& connection : pending_) {
      fds.push_back({connection.fd, POLLIN, 0});
      first_deadline = std::min(first_deadline, connection.deadline);
    }
    int timeout_ms = -1;
    if (first_deadline != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(first_deadline - absl::Now()) + 1));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("poll on the region socket: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    // Connections that spoke (or hung up), then those out of time.
    std::vector<Pending> still_waiting;
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < pending_.size(); ++i) {
      const Pending& connection = pending_[i];
      if (fds[i + 2].revents != 0) {
        Serve(connection);
      } else if (connection.deadline <= now) {
        Reply(connection.fd, absl::DeadlineExceededError(absl::StrFormat(
                                 "no AttachHostRegionRequest arrived within %s of connecting",
                                 absl::FormatDuration(kRequestTimeout))));
      } else {
        still_waiting.push_back(connection);
      }
    }
    pending_ = std::move(still_waiting);
    if (fds[1].revents != 0) Accept();
  }
}

void RegionListener::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("accept on the region socket: {}", std::strerror(errno));
        if (errno == EMFILE || errno == ENFILE) poll(nullptr, 0, 100);  // back off
      }
      return;
    }
    ucred cred{};
    socklen_t length = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
      close(fd);
      continue;
    }
    const size_t of_user = static_cast<size_t>(
        std::count_if(pending_.begin(), pending_.end(),
                      [&](const Pending& connection) { return connection.uid == cred.uid; }));
    if (pending_.size() >= kMaxPending || of_user >= kMaxPendingPerUser) {
      Reply(fd, absl::ResourceExhaustedError(absl::StrFormat(
                    "the region socket has %d connections waiting for their request (%d of "
                    "this user); try again",
                    pending_.size(), of_user)));
      continue;
    }
    pending_.push_back(Pending{fd, cred.uid, absl::Now() + kRequestTimeout});
  }
}

void RegionListener::Serve(const Pending& connection) {
  ReceivedDatagram datagram;
  if (absl::Status received = ReceiveDatagram(connection.fd, &datagram, MSG_DONTWAIT);
      !received.ok()) {
    close(connection.fd);  // hung up, or nothing to read after all
    return;
  }
  v1::AttachHostRegionRequest request;
  absl::Status shape;
  if (datagram.truncated) {
    shape = absl::InvalidArgumentError(absl::StrFormat(
        "the attach datagram is longer than %d bytes or carries more than 8 descriptors",
        kMaxRegionDatagramBytes));
  } else if (datagram.fds.size() != 1) {
    shape = absl::InvalidArgumentError(absl::StrFormat(
        "the attach datagram carries %d descriptors; send exactly one, the region's memfd "
        "(SCM_RIGHTS)",
        datagram.fds.size()));
  } else if (!request.ParseFromString(datagram.bytes)) {
    shape = absl::InvalidArgumentError("the attach datagram is not an AttachHostRegionRequest");
  } else if (request.session_id() == 0 || (request.region_id() == 0) != request.direct_channel()) {
    shape = absl::InvalidArgumentError(
        "AttachHostRegionRequest: session_id is required, and region_id unless (only when) "
        "direct_channel is set");
  } else if (request.framed_commands() && !request.direct_channel()) {
    shape = absl::InvalidArgumentError(
        "AttachHostRegionRequest: framed_commands is for direct channels only (direct_channel "
        "is not set)");
  }
  if (!shape.ok()) {
    Reply(connection.fd, shape);  // `datagram` closes the descriptors
    return;
  }
  if (in_flight_->fetch_add(1) >= kMaxAttachesInFlight) {
    in_flight_->fetch_sub(1);
    Reply(connection.fd, absl::ResourceExhaustedError(absl::StrFormat(
                             "%d attaches are in progress, the most the daemon runs at once; "
                             "try again",
                             kMaxAttachesInFlight)));
    return;
  }
  const int memfd = datagram.Release(0);
  const int fd = connection.fd;
  SessionManager* const sessions = sessions_;
  auto in_flight = in_flight_;
  absl::Status queued = sessions_->RunBlocking([sessions, request, memfd, fd, in_flight] {
    const v1::AttachHostRegionReply reply = sessions->AttachHostRegion(request, memfd);
    close(memfd);
    if (reply.code() != 0) {
      spdlog::debug("region attach for session {} region {}: {}", request.session_id(),
                    request.region_id(), reply.message());
    }
    Reply(fd, absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message()));
    in_flight->fetch_sub(1);
  });
  if (!queued.ok()) {
    in_flight_->fetch_sub(1);
    close(memfd);
    Reply(fd, queued);
  }
}

}  // namespace gpurpc::frontend
