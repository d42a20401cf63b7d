// The daemon's Unix socket. gRPC cannot tell who is on the other end of a Unix socket, so
// the front end accepts connections itself, asks the kernel who the peer is
// (SO_PEERCRED: uid and pid, which the peer cannot forge), registers that with the
// Authenticator, and only then hands the connection to the gRPC server, where it is
// served like any other (its calls show the peer "fd:N").
//
// The socket is created under a temporary name, given its mode, then renamed into place, so
// that it is never reachable with looser permissions. A missing parent folder is created
// 0755; a parent that another user (other than root) owns is refused, because that user
// could replace the socket.
//
// Connections are bounded: at most kMaxConnectionsPerUser per peer uid and kMaxConnections
// in all, so that one user cannot take the daemon's file descriptors; a connection over a
// bound is closed at once (and logged). A connection counts until gRPC has closed its fd
// (seen by the fd no longer naming the same socket).
//
// Thread safety: Start and the destructor are called from one thread; accepting runs on a
// thread of its own.
#ifndef GPURPC_SERVER_FRONTEND_UNIX_LISTENER_H_
#define GPURPC_SERVER_FRONTEND_UNIX_LISTENER_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "server/frontend/auth.h"

namespace gpurpc::frontend {

// Creates, binds and listens on a Unix socket of `type` (SOCK_STREAM, SOCK_SEQPACKET) at
// `path` with permissions `mode`, safely as described above (the folder's checks, never
// looser permissions, a live socket of another process refused). Returns the
// non-blocking, close-on-exec listening fd. Errors as UnixListener::Open.
absl::StatusOr<int> OpenListeningUnixSocket(const std::string& path, uint32_t mode, int type);

class UnixListener {
 public:
  static constexpr size_t kMaxConnectionsPerUser = 256;
  static constexpr size_t kMaxConnections = 4096;

  // Binds and listens on `path` with permissions `mode`. FAILED_PRECONDITION when the
  // path or its folder is unsafe or taken by something that is not a socket;
  // UNAVAILABLE for other socket errors.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Open(const std::string& path, uint32_t mode,
                                                            Authenticator* auth);
  // Stops accepting and removes the socket file.
  ~UnixListener();

  // Starts accepting connections into `server` (which must outlive this listener).
  void Start(grpc::Server* server);

 private:
  UnixListener(std::string path, int listen_fd, int wake_fd, Authenticator* auth);
  void AcceptLoop(grpc::Server* server);
  // Counts `fd` (of `uid`) against the bounds; RESOURCE_EXHAUSTED when over one.
  absl::Status Admit(int fd, uid_t uid);

  struct Connection {
    dev_t device;
    ino_t inode;
    uid_t uid;
  };

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;  // eventfd that ends the accept loop
  Authenticator* auth_;
  std::thread thread_;
  std::map<int, Connection> live_;  // by fd; accept thread only
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_UNIX_LISTENER_H_
