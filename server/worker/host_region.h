// Same-host regions, the worker's half (the protocol is in
// proto/gpurpc/v1/host_region_service.proto): checking and mapping the memfd a client sent
// over the daemon's region socket, and the worker's end of the private region channel to
// the front end.
//
// A region's memfd comes from a tenant and is hostile until checked. MapClientMemfd accepts
// only a regular shared-memory file (memfd or hugetlbfs) that is sealed against shrinking
// (F_SEAL_SHRINK), so that the client cannot truncate it under the worker's mapping (which
// would end the worker with SIGBUS when a copy touches the lost pages), at least as large as
// the region, and mappable read-write (not F_SEAL_WRITE / F_SEAL_FUTURE_WRITE, not opened
// read-only).
#ifndef GPURPC_SERVER_WORKER_HOST_REGION_H_
#define GPURPC_SERVER_WORKER_HOST_REGION_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "grpcpp/server.h"
#include "server/worker/framed_commands.h"

namespace gpurpc::worker {

// Regions one session may hold, attached or not.
inline constexpr uint32_t kMaxHostRegionsPerSession = 256;
// Bytes of an attach ticket.
inline constexpr size_t kHostRegionTicketBytes = 16;
// Direct channels (HostRegionService.OpenDirectChannel) one session may hold open, and
// tickets for them it may hold unused.
inline constexpr size_t kMaxDirectChannelsPerSession = 8;
// Framed channels the front end may relay a session's command streams, unary calls and
// streamed transfers on at once (RelayChannel), as many as the worker's gRPC server has threads for
// the gRPC relay. The front end relays at most SessionRecord::kMaxRelayedCommandStreams at once,
// but a stream whose client left frees its place there while its worker thread still finishes the
// batch it runs.
inline constexpr size_t kMaxRelayedChannelsPerSession = 64;
// Of those, the most that may be transfers (kFrontEndUpload, kFrontEndDownload): a transfer
// whose client left frees its front-end place at once while its worker thread may still wait
// (a download behind a long kernel), so that transfers alone can never take every place and
// leave none for the session's command streams and unary calls.
inline constexpr size_t kMaxRelayedTransfersPerSession = 32;
static_assert(kMaxRelayedTransfersPerSession < kMaxRelayedChannelsPerSession);

// A client's memfd mapped shared read-write; unmapped when destroyed.
class MappedRegion {
 public:
  // Checks `fd` (see the file comment; INVALID_ARGUMENT naming what is wrong) and maps its
  // first `size_bytes`. Does not take or close `fd`.
  static absl::StatusOr<std::unique_ptr<MappedRegion>> Map(int fd, uint64_t size_bytes);
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }

 private:
  MappedRegion(uint8_t* data, uint64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  uint8_t* const data_;
  const uint64_t size_bytes_;
};

// 16 random bytes from the kernel (getrandom).
absl::StatusOr<std::string> NewAttachTicket();

// The direct channels of a session's worker: client socket ends (passed on the region
// socket) served either by the worker's second gRPC server, which has only ExecutionService,
// or, framed, by a thread of their own that runs `serve_framed(fd, kDirectClient)` (the
// framed command protocol, framed_commands.h); and the front end's relayed command streams,
// unary calls and streamed transfers (RelayChannel), framed, each on a thread that runs
// `serve_framed(fd, peer)` with its FramedPeer (kFrontEndRelay, kFrontEndUnary,
// kFrontEndUpload, kFrontEndDownload).
class DirectChannels {
 public:
  using ServeFramedFn = std::function<void(int fd, FramedPeer peer)>;
  // `server` must outlive this object. `serve_framed(fd, peer)` serves a framed channel until
  // it ends and must not close `fd`.
  DirectChannels(grpc::Server* server, ServeFramedFn serve_framed)
      : server_(server), serve_framed_(std::move(serve_framed)) {}
  // Shuts the framed channels down and joins their threads.
  ~DirectChannels();
  DirectChannels(const DirectChannels&) = delete;
  DirectChannels& operator=(const DirectChannels&) = delete;

  // Serves `fd` (not taken: a duplicate is kept) after checking that it is a connected
  // AF_UNIX SOCK_STREAM socket (INVALID_ARGUMENT otherwise) and that fewer than
  // kMaxDirectChannelsPerSession channels, gRPC and framed together, are open
  // (RESOURCE_EXHAUSTED).
  absl::Status Admit(int fd, bool framed) ABSL_LOCKS_EXCLUDED(mu_);
  // Serves `fd` (not taken), a channel the front end relays a command stream
  // (FramedPeer::kFrontEndRelay), unary calls (kFrontEndUnary) or a streamed transfer
  // (kFrontEndUpload, kFrontEndDownload) on, after the same check of the socket;
  // RESOURCE_EXHAUSTED when kMaxRelayedChannelsPerSession of these kinds are open, or for a
  // transfer when kMaxRelayedTransfersPerSession transfers are. These do not count against the
  // client's kMaxDirectChannelsPerSession.
  absl::Status AdmitRelayed(int fd, FramedPeer peer) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Framed {
    int fd = -1;  // closed once the thread is joined
    FramedPeer peer = FramedPeer::kDirectClient;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  // Forgets the gRPC channels whose fds gRPC closed, and joins the framed channels that ended.
  void Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts serving a duplicate of `fd` framed, on a thread of its own.
  absl::Status StartFramedLocked(int fd, FramedPeer peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t FramedCountLocked(FramedPeer peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  grpc::Server* const server_;
  const ServeFramedFn serve_framed_;
  absl::Mutex mu_;
  // Channels handed to gRPC: fd -> (device, inode), forgotten once gRPC closed the fd.
  std::map<int, std::pair<dev_t, ino_t>> live_ ABSL_GUARDED_BY(mu_);
  std::list<std::unique_ptr<Framed>> framed_ ABSL_GUARDED_BY(mu_);
};

// The worker's end of the region channel (--worker-region-fd, a SOCK_SEQPACKET socketpair
// with the front end): a thread that receives one AttachHostRegionRequest datagram with one
// descriptor at a time, calls `attach(request, fd)` (which must not keep `fd`; the channel
// closes it afterwards) and answers one AttachHostRegionReply. Ends when the front end
// closes its end; the destructor shuts the socket down and joins.
class RegionChannel {
 public:
  using AttachFn = std::function<absl::Status(const v1::AttachHostRegionRequest& request, int fd)>;
  RegionChannel(int fd, AttachFn attach);
  ~RegionChannel();
  RegionChannel(const RegionChannel&) = delete;
  RegionChannel& operator=(const RegionChannel&) = delete;

 private:
  void Loop();
  const int fd_;
  const AttachFn attach_;
  std::thread thread_;
};

// The worker's end of the relay channel (--worker-relay-fd, a SOCK_SEQPACKET socketpair
// with the front end, which nobody else holds): each datagram is one byte with one
// descriptor, one end of a socketpair on which the front end relays a client's command stream
// ('c', server/frontend/command_relay.h), unary calls ('u', server/frontend/unary_channels.h)
// or one UploadStream ('U') or DownloadStream ('D') call (command_relay.h); it goes to `admit`
// (DirectChannels::AdmitRelayed) with its FramedPeer. There is no answer on this channel: a channel
// that cannot be admitted gets an end frame with the refusal (RefuseRelayedChannel) and is closed.
// Ends when the front end closes its end; the destructor shuts the socket down and joins.
class RelayChannel {
 public:
  using AdmitFn = std::function<absl::Status(int fd, FramedPeer peer)>;
  RelayChannel(int fd, AdmitFn admit);
  ~RelayChannel();
  RelayChannel(const RelayChannel&) = delete;
  RelayChannel& operator=(const RelayChannel&) = delete;

 private:
  void Loop();
  const int fd_;
  const AdmitFn admit_;
  std::thread thread_;
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_HOST_REGION_H_
