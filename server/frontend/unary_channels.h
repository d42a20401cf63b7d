// A session's unary calls relayed to its worker on framed unary channels rather than on gRPC
// calls (the proxy's RelayReactor uses them where it can, proxy.h). A relayed gRPC unary call
// costs the front end a client call of its own and the worker a call of its gRPC server, each
// with hand-offs between gRPC's threads; on a framed channel the request is one send, the
// worker runs the method's handler on the channel's thread (ServeRelayedUnaryCalls,
// server/worker/framed_commands.h) and the answer is one receive on the front end's thread of
// the channel, which completes the call.
//
// Each channel is one end of a socketpair whose other end went to the worker on its relay
// channel (WorkerProcess::OpenUnaryChannel). A channel carries one call at a time: a
// RelayedCall frame (internal.v1, worker_control.proto) out, a RelayedAnswer frame back. The
// front end keeps up to kMaxUnaryChannels per session, opened as calls need them and kept for
// the next; a call that finds none free goes by gRPC, as does a request larger than
// kMaxRelayedRequestBytes (common/limits.h), so a send to a channel, whose socket is empty
// when the call takes it, never waits.
//
// Everything the worker sends is checked: a frame over kMaxMessageBytes, bytes that are not
// a RelayedAnswer, an end frame (the worker refused the channel) or a closed socket end the
// channel; the call in flight on it is then answered as the gRPC relay answers a call whose
// worker broke (relay_status.h decides whether the worker died). A call whose client cancels
// still waits for its answer (a ledger call must see what the worker did; any other call's
// handler would run to its end on the worker's gRPC server too), and the channel then serves
// the next call.
#ifndef GPURPC_SERVER_FRONTEND_UNARY_RELAY_H_
#define GPURPC_SERVER_FRONTEND_UNARY_RELAY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"

namespace gpurpc::frontend {

class UnaryChannels {
 public:
  // Framed unary channels a session keeps open at most.
  static constexpr int kMaxUnaryChannels = 4;

  // How a call ended: the worker's answer (`answered_by_worker`, with `response` for OK), or
  // a broken channel (UNAVAILABLE, not answered by the worker).
  using Done = absl::AnyInvocable<void(grpc::Status status, bool answered_by_worker,
                                       grpc::ByteBuffer response) &&>;

  // Opens a channel to the worker: the front end's end of a connected stream socket, blocking
  // (WorkerProcess::OpenUnaryChannel); the channels take and close it.
  using Opener = std::function<absl::StatusOr<int>()>;
  explicit UnaryChannels(Opener open) : open_(std::move(open)) {}
  // Shuts every channel down and joins their threads (a call still in flight is answered
  // UNAVAILABLE first).
  ~UnaryChannels();
  UnaryChannels(const UnaryChannels&) = delete;
  UnaryChannels& operator=(const UnaryChannels&) = delete;

  // Sends `request` of `method` (a unary method of the session services) on a free channel,
  // opening one when fewer than kMaxUnaryChannels are open; `done` runs once, on the
  // channel's thread, when the call ends; it is moved from only then. False (and `done` is
  // left as it was) when the call cannot go framed: no channel is free, the request is larger
  // than kMaxRelayedRequestBytes, or no channel could be opened. The caller then relays the
  // call by gRPC.
  bool Call(const std::string& method, const grpc::ByteBuffer& request, Done& done)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Channels open now (for tests and metrics).
  int open() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Channel {
    int fd = -1;
    std::thread thread;
    Done done;                          // the call in flight (guarded by mu_)
    bool busy = false;                  // guarded by mu_
    bool broken = false;                // guarded by mu_: its thread has ended or is ending
    std::atomic<bool> finished{false};  // its thread returned: it may be joined
  };
  // The channel's thread: reads answers and completes the calls, until the channel ends.
  void Loop(Channel* channel) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends `channel`'s call in flight (if any) with `status` and marks it broken.
  void Broken(Channel* channel, grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Joins and forgets the channels whose threads returned.
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Channel* TakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Opener open_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_UNARY_RELAY_H_
