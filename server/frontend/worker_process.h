// One worker process seen from the front end: spawned by exec of the daemon's own binary
// (never fork after CUDA init), connected through a private socketpair that nobody else can
// open, and reaped by a thread of its own so that its death is noticed at once. A pipe (the
// worker's fd 4, --worker-status-fd) carries the one line a worker writes when it ends
// itself on purpose (the kernel watchdog); it is read when the worker is reaped. A
// SOCK_SEQPACKET socketpair (the worker's fd 5, --worker-region-fd) carries the memfds of
// same-host regions (host_region_service.proto), which gRPC cannot. Another (the worker's
// fd 6, --worker-relay-fd) carries the sockets of relayed command streams and unary calls
// (OpenCommandChannel, OpenUnaryChannel).
#ifndef GPURPC_SERVER_FRONTEND_WORKER_PROCESS_H_
#define GPURPC_SERVER_FRONTEND_WORKER_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "grpcpp/channel.h"

namespace gpurpc::frontend {

class WorkerProcess {
 public:
  // Starts `exe` with `args` (WorkerArgs: --worker-fd=3 --worker-status-fd=4
  // --worker-region-fd=5 --worker-relay-fd=6 ...). The child gets fd 3 as its end of the gRPC
  // socketpair, fd 4 as the write end of its status pipe, fd 5 as its end of the region
  // channel and fd 6 as its end of the relay channel.
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Spawn(const std::string& exe,
                                                              const std::vector<std::string>& args);

  // Kills the process (if still running) and reaps it. Never throws.
  ~WorkerProcess();

  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  // Waits until the worker answers a ListDevices call and returns the answer. UNAVAILABLE
  // with the exit description when it died first, DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<v1::ListDevicesResponse> WaitReady(absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // SIGKILL; idempotent. Kill() + WaitExited() frees the worker's GPU context.
  void Kill() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `timeout` for the process to end; true when it has.
  bool WaitExited(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  bool exited() const ABSL_LOCKS_EXCLUDED(mu_);
  // "exited with code 3", "killed by signal 9 (Killed)"; empty while running.
  std::string exit_description() const ABSL_LOCKS_EXCLUDED(mu_);
  // The exit code, or -1 while running or when a signal ended it.
  int exit_code() const ABSL_LOCKS_EXCLUDED(mu_);
  // What the worker wrote to its status pipe before it ended (at most 4 KiB; a backslash,
  // control and non-ASCII bytes escaped as \xNN); empty when nothing.
  std::string exit_message() const ABSL_LOCKS_EXCLUDED(mu_);

  // Hands a client's region memfd (not taken) to the worker with `request` and returns the
  // worker's answer. One attach at a time per worker: RESOURCE_EXHAUSTED while another
  // runs (it never waits for it). UNAVAILABLE when the worker is gone;
  // DEADLINE_EXCEEDED after `timeout` (the channel is then closed for good: a late answer
  // could not be told from the next one).
  absl::StatusOr<v1::AttachHostRegionReply> AttachRegion(const v1::AttachHostRegionRequest& request,
                                                         int memfd, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(region_mu_);

  // A new framed command channel to the worker (server/worker/framed_commands.h): one end of
  // a fresh socketpair is handed to the worker on the relay channel, the other returned
  // (close-on-exec, blocking; the caller closes it). Never waits; the worker admits the
  // channel when it reads the relay channel. A channel it refuses (over
  // kMaxRelayedChannelsPerSession) gets an end frame saying why; one to a worker that ended
  // reads as closed. UNAVAILABLE when the socket cannot be made or handed over.
  absl::StatusOr<int> OpenCommandChannel() { return OpenRelayedChannel("c"); }
  // The same for a framed unary channel (server/frontend/unary_channels.h).
  absl::StatusOr<int> OpenUnaryChannel() { return OpenRelayedChannel("u"); }
  // The same for a framed transfer channel, which carries one UploadStream (`upload`) or
  // DownloadStream call (server/frontend/command_relay.h).
  absl::StatusOr<int> OpenTransferChannel(bool upload) {
    return OpenRelayedChannel(upload ? "U" : "D");
  }

  // Called once, on the reaper thread, when the process ends (at once if it already has).
  void SetExitCallback(std::function<void(const std::string& description)> callback)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  WorkerProcess(pid_t pid, std::shared_ptr<grpc::Channel> channel, int status_fd, int region_fd,
                int relay_fd);
  absl::StatusOr<v1::AttachHostRegionReply> AttachRegionLocked(
      const v1::AttachHostRegionRequest& request, int memfd, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(region_mu_);
  void Reap() ABSL_LOCKS_EXCLUDED(mu_);
  // Hands a fresh channel to the worker on the relay channel, tagged `kind` ("c": commands,
  // "u": unary calls, "U" / "D": an upload / a download).
  absl::StatusOr<int> OpenRelayedChannel(const char* kind);

  const pid_t pid_;
  const int status_fd_;  // read end of the status pipe, closed by Reap
  const int relay_fd_;   // our end of the relay channel, closed by the destructor
  std::shared_ptr<grpc::Channel> channel_;
  std::thread reaper_;
  // Guards what the reaper learns when the process ends, and the exit callback.
  mutable absl::Mutex mu_;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;
  std::string exit_description_ ABSL_GUARDED_BY(mu_);
  int exit_code_ ABSL_GUARDED_BY(mu_) = -1;
  std::string exit_message_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> on_exit_ ABSL_GUARDED_BY(mu_);
  absl::Mutex region_mu_;
  int region_fd_ ABSL_GUARDED_BY(region_mu_);  // our end of the region channel, -1 once closed
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_WORKER_PROCESS_H_
