#include "server/worker/host_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/fd_passing.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace gpurpc::worker {

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::Map(int fd, uint64_t size_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the region's descriptor: fstat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        "the region's descriptor is not a memfd (not a regular file); create it with "
        "memfd_create(MFD_ALLOW_SEALING)");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "the region's descriptor is not a memfd (it takes no seals); create it with "
        "memfd_create(MFD_ALLOW_SEALING)");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "the region's memfd is not sealed against shrinking; add F_SEAL_SHRINK "
        "(fcntl F_ADD_SEALS) before attaching it");
  }
#ifdef F_SEAL_FUTURE_WRITE
  constexpr int kWriteSeals = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;
#else
  constexpr int kWriteSeals = F_SEAL_WRITE;
#endif
  if ((seals & kWriteSeals) != 0) {
    return absl::InvalidArgumentError(
        "the region's memfd is sealed against writing; copies from the device write it");
  }
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < size_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the region's memfd holds %d bytes, less than the region's %d", st.st_size, size_bytes));
  }
  void* data = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    if (error == EACCES || error == EPERM) {
      return absl::InvalidArgumentError(
          absl::StrCat("the region's memfd cannot be mapped read-write (opened read-only?): mmap: ",
                       std::strerror(error)));
    }
    if (error == ENOMEM) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping the region: mmap: ", std::strerror(error)));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("mapping the region: mmap: ", std::strerror(error)));
  }
  return std::unique_ptr<MappedRegion>(new MappedRegion(static_cast<uint8_t*>(data), size_bytes));
}

MappedRegion::~MappedRegion() { munmap(data_, size_bytes_); }

absl::StatusOr<std::string> NewAttachTicket() {
  std::string ticket(kHostRegionTicketBytes, '\0');
  size_t filled = 0;
  while (filled < ticket.size()) {
    const ssize_t n = getrandom(ticket.data() + filled, ticket.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  return ticket;
}

DirectChannels::~DirectChannels() {
  absl::MutexLock lock(&mu_);
  for (const auto& framed : framed_) shutdown(framed->fd, SHUT_RDWR);
  for (const auto& framed : framed_) {
    if (framed->thread.joinable()) framed->thread.join();
    close(framed->fd);
  }
}

void DirectChannels::Prune() {
  for (auto it = live_.begin(); it != live_.end();) {
    struct stat st;
    if (fstat(it->first, &st) != 0 || st.st_dev != it->second.first ||
        st.st_ino != it->second.second) {
      it = live_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = framed_.begin(); it != framed_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      close((*it)->fd);
      it = framed_.erase(it);
    } else {
      ++it;
    }
  }
}

namespace {

// OK when `fd` is one end of a connected AF_UNIX SOCK_STREAM socket.
absl::Status CheckChannelSocket(int fd) {
  int type = 0;
  int domain = 0;
  socklen_t length = sizeof(type);
  sockaddr_un peer{};
  socklen_t peer_length = sizeof(peer);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM ||
      (length = sizeof(domain), getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &length)) != 0 ||
      domain != AF_UNIX || getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0) {
    return absl::InvalidArgumentError(
        "a direct channel's descriptor must be one end of a connected AF_UNIX SOCK_STREAM "
        "socketpair");
  }
  return absl::OkStatus();
}

// The peer a relayed channel's kind names (WorkerProcess::OpenRelayedChannel), null for none.
const FramedPeer* RelayedPeer(const std::string& kind) {
  static constexpr FramedPeer kCommands = FramedPeer::kFrontEndRelay;
  static constexpr FramedPeer kUnary = FramedPeer::kFrontEndUnary;
  static constexpr FramedPeer kUpload = FramedPeer::kFrontEndUpload;
  static constexpr FramedPeer kDownload = FramedPeer::kFrontEndDownload;
  if (kind == "c") return &kCommands;
  if (kind == "u") return &kUnary;
  if (kind == "U") return &kUpload;
  if (kind == "D") return &kDownload;
  return nullptr;
}

}  // namespace

size_t DirectChannels::FramedCountLocked(FramedPeer peer) const {
  size_t count = 0;
  for (const auto& framed : framed_) count += framed->peer == peer ? 1 : 0;
  return count;
}

absl::Status DirectChannels::Admit(int fd, bool framed) {
  if (absl::Status checked = CheckChannelSocket(fd); !checked.ok()) return checked;
  absl::MutexLock lock(&mu_);
  Prune();
  const size_t open = live_.size() + FramedCountLocked(FramedPeer::kDirectClient);
  if (open >= kMaxDirectChannelsPerSession) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("this session holds %d direct channels, the most it may", open));
  }
  if (framed) return StartFramedLocked(fd, FramedPeer::kDirectClient);
  const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (mine < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("dup: ", std::strerror(errno)));
  }
  // gRPC 1.51 hangs on a blocking fd.
  fcntl(mine, F_SETFL, fcntl(mine, F_GETFL) | O_NONBLOCK);
  struct stat st;
  fstat(mine, &st);
  live_[mine] = {st.st_dev, st.st_ino};
  grpc::AddInsecureChannelFromFd(server_, mine);  // owns `mine` from here on
  return absl::OkStatus();
}

absl::Status DirectChannels::AdmitRelayed(int fd, FramedPeer peer) {
  if (peer == FramedPeer::kDirectClient) {
    return absl::InvalidArgumentError("a relayed channel is the front end's");
  }
  if (absl::Status checked = CheckChannelSocket(fd); !checked.ok()) return checked;
  absl::MutexLock lock(&mu_);
  Prune();
  const size_t open = framed_.size() - FramedCountLocked(FramedPeer::kDirectClient);
  if (open >= kMaxRelayedChannelsPerSession) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "this session has %d relayed channels (command streams, unary calls and transfers), "
        "the most it may",
        open));
  }
  if (peer == FramedPeer::kFrontEndUpload || peer == FramedPeer::kFrontEndDownload) {
    const size_t transfers = FramedCountLocked(FramedPeer::kFrontEndUpload) +
                             FramedCountLocked(FramedPeer::kFrontEndDownload);
    if (transfers >= kMaxRelayedTransfersPerSession) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "this session has %d relayed transfers (UploadStream, DownloadStream) in its worker, "
          "the most it may; transfers whose clients left end once the work before them on "
          "their stream is done",
          transfers));
    }
  }
  return StartFramedLocked(fd, peer);
}

absl::Status DirectChannels::StartFramedLocked(int fd, FramedPeer peer) {
  const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (mine < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("dup: ", std::strerror(errno)));
  }
  // Blocking: the channel's thread waits in recv and send.
  fcntl(mine, F_SETFL, fcntl(mine, F_GETFL) & ~O_NONBLOCK);
  auto channel = std::make_unique<Framed>();
  channel->fd = mine;
  channel->peer = peer;
  Framed* const raw = channel.get();
  try {
    raw->thread = std::thread([this, raw] {
      serve_framed_(raw->fd, raw->peer);
      raw->done.store(true);
    });
  } catch (const std::system_error& e) {
    // The host's thread limit counts every tenant's workers: a refusal, not the worker's end.
    close(mine);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the framed channel's thread: ", e.what()));
  }
  framed_.push_back(std::move(channel));
  return absl::OkStatus();
}

RelayChannel::RelayChannel(int fd, AdmitFn admit) : fd_(fd), admit_(std::move(admit)) {
  thread_ = std::thread([this] { Loop(); });
}

RelayChannel::~RelayChannel() {
  shutdown(fd_, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  close(fd_);
}

void RelayChannel::Loop() {
  for (;;) {
    ReceivedDatagram datagram;
    if (absl::Status received = ReceiveDatagram(fd_, &datagram); !received.ok()) {
      if (received.message() != "closed") {
        spdlog::warn("relay channel: {}", std::string(received.message()));
      }
      return;
    }
    const FramedPeer* const peer = RelayedPeer(datagram.bytes);
    if (datagram.truncated || datagram.fds.size() != 1 || peer == nullptr) {
      spdlog::warn("relay channel: a malformed datagram ({} bytes, {} descriptors); dropped",
                   datagram.bytes.size(), datagram.fds.size());
      continue;  // its descriptors close with it
    }
    // Admitted, the channel is served on a duplicate; refused, it gets an end frame that
    // says why (the client's stream ends with that status). This one closes here either way.
    if (absl::Status admitted = admit_(datagram.fds[0], *peer); !admitted.ok()) {
      spdlog::warn("relay channel: a relayed channel was refused: {}",
                   std::string(admitted.message()));
      RefuseRelayedChannel(datagram.fds[0], admitted);
    }
  }
}

RegionChannel::RegionChannel(int fd, AttachFn attach) : fd_(fd), attach_(std::move(attach)) {
  thread_ = std::thread([this] { Loop(); });
}

RegionChannel::~RegionChannel() {
  shutdown(fd_, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  close(fd_);
}

void RegionChannel::Loop() {
  for (;;) {
    ReceivedDatagram datagram;
    if (absl::Status received = ReceiveDatagram(fd_, &datagram); !received.ok()) {
      if (received.message() != "closed") {
        spdlog::warn("region channel: {}", std::string(received.message()));
      }
      return;
    }
    // The front end has checked the client's datagram; the worker checks again, since the
    // region table is its own.
    v1::AttachHostRegionRequest request;
    absl::Status status;
    if (datagram.truncated || datagram.fds.size() != 1 ||
        !request.ParseFromString(datagram.bytes)) {
      status = absl::InvalidArgumentError(
          "the region channel carried a malformed attach (the front end should have refused it)");
    } else {
      status = attach_(request, datagram.fds[0]);
    }
    v1::AttachHostRegionReply reply;
    reply.set_code(static_cast<int>(status.code()));
    // Never an empty datagram: a SOCK_SEQPACKET reader cannot tell one from a hang-up.
    reply.set_message(status.ok()
                          ? std::string("attached")
                          : std::string(status.message()).substr(0, kMaxRegionDatagramBytes / 2));
    if (absl::Status sent = SendDatagram(fd_, reply.SerializeAsString(), {}); !sent.ok()) {
      spdlog::warn("region channel: {}", std::string(sent.message()));
      return;
    }
  }
}

}  // namespace gpurpc::worker
