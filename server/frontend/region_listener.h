// The daemon's region socket: where same-host clients attach the memfds of their regions
// (proto/gpurpc/v1/host_region_service.proto), since gRPC cannot carry descriptors. An
// AF_UNIX SOCK_SEQPACKET socket, created as safely as the Unix socket (unix_listener.h) and
// with its mode.
//
// Each connection carries one AttachHostRegionRequest datagram with exactly one descriptor
// and gets one AttachHostRegionReply before it is closed. Nobody is trusted here: the
// request names a session and a region, and the region's one-time ticket (which only the
// session's client learned, over its authenticated gRPC call) is the proof, checked by the
// session's worker. The listener checks the shape (one descriptor, a request that parses,
// at most kMaxRegionDatagramBytes) and hands the rest to SessionManager::AttachHostRegion
// on the manager's blocking pool; the worker checks the memfd itself (host_region.h).
//
// Bounds, so that no local user can hold the daemon: a connection must send its request
// within kRequestTimeout; at most kMaxPending connections wait for theirs, kMaxPendingPerUser
// per peer uid; at most kMaxAttachesInFlight attaches run at once, and one per session
// (WorkerProcess::AttachRegion); a connection over a bound gets RESOURCE_EXHAUSTED at once.
// Waiting connections are polled by the accepting thread, never given a thread each.
//
// Thread safety: Start and the destructor are called from one thread.
#ifndef GPURPC_SERVER_FRONTEND_REGION_LISTENER_H_
#define GPURPC_SERVER_FRONTEND_REGION_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class RegionListener {
 public:
  static constexpr size_t kMaxPending = 128;
  static constexpr size_t kMaxPendingPerUser = 16;
  static constexpr absl::Duration kRequestTimeout = absl::Seconds(2);
  // Attaches handed to the blocking pool at once (each may pin gigabytes for seconds); one
  // over gets RESOURCE_EXHAUSTED, so that the pool stays free for opening sessions.
  static constexpr int kMaxAttachesInFlight = 16;

  // Binds and listens on `path` with permissions `mode`. Errors as UnixListener::Open.
  // `sessions` must outlive the listener.
  static absl::StatusOr<std::unique_ptr<RegionListener>> Open(const std::string& path,
                                                              uint32_t mode,
                                                              SessionManager* sessions);
  // Stops accepting, closes the connections still waiting and removes the socket file.
  // Attaches already handed to the blocking pool finish there.
  ~RegionListener();

  void Start();
  const std::string& path() const { return path_; }

 private:
  struct Pending {
    int fd;
    uid_t uid;
    absl::Time deadline;
  };
  RegionListener(std::string path, int listen_fd, int wake_fd, SessionManager* sessions);
  void Loop();
  void Accept();
  // Reads the request of `connection` (readable) and dispatches it; closes it unless it was
  // handed on.
  void Serve(const Pending& connection);

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;
  SessionManager* const sessions_;
  std::vector<Pending> pending_;  // only the loop's thread touches it
  const std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
  std::thread thread_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_REGION_LISTENER_H_
