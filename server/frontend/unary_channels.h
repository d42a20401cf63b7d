// A session's unary calls relayed to its worker on framed unary channels rather than on gRPC
// calls (SessionUnaryProxy uses them where it can, unary_proxy.h). A relayed gRPC unary call
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
// Who reads the answer: the calling thread may wait for it itself, for a bounded time (`wait`
// in Call), and complete the call there; a short call then costs no hand-off between threads.
// At most max_inline_waiters() calling threads of the process wait so at once (they are
// gRPC's threads, which serve every client), and one per session, so that one session's
// calls cannot take every waiting slot. The calling thread reads a frame only once the
// whole frame is in the socket, so a worker that sends part of one cannot hold it, and it
// completes only a call the worker answered (or refused): a frame that breaks the channel
// is completed by the channel's thread, since that may wait for the worker's exit. A call
// whose answer has not come within the wait, or that may not wait, is handed to the
// channel's thread, which reads that answer and completes the call. A channel's socket is
// read only while a call is in flight on it.
//
// Everything the worker sends is checked: a frame over kMaxMessageBytes, bytes that are not
// a RelayedAnswer or a closed socket end the channel; the call in flight on it is then
// answered as the gRPC relay answers a call whose worker broke (relay_status.h decides
// whether the worker died). Bytes that arrive on an idle channel (an answer to no call) or an
// idle channel the worker closed are found when the channel is next taken: the channel ends
// and the call takes another. A status message is cut to what ToGrpcStatus sends (4 KiB).
// An end frame as a channel's first frame is the worker refusing the channel (it serves
// kMaxRelayedChannelsPerSession at most): the call never ran, its caller relays it by gRPC, and
// no channel is opened for the next second. A call whose client left may be abandoned by its
// caller (the unary proxy does so for calls the ledger does not read); its answer is then
// read and dropped, and the channel serves the next call.
//
// The channels and their threads share their state, so a call's completion may drop the last
// reference to the session (and so destroy these channels) on a channel's own thread. A
// call's completion on the calling thread must not destroy them: the caller keeps them alive
// until Call returns.
#ifndef GPURPC_SERVER_FRONTEND_UNARY_CHANNELS_H_
#define GPURPC_SERVER_FRONTEND_UNARY_CHANNELS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"

namespace gpurpc::frontend {

class UnaryChannels {
 public:
  // Framed unary channels a session keeps open at most.
  static constexpr int kMaxUnaryChannels = 4;

  // How a call ended: the worker's answer (`status`, with `response` for OK); a broken channel
  // (`status` UNAVAILABLE, made up here); or the worker refused the channel and never ran the
  // call (`status` is its refusal).
  enum class Outcome { kAnswered, kBroken, kRefused };
  using Done =
      absl::AnyInvocable<void(Outcome outcome, grpc::Status status, grpc::ByteBuffer response) &&>;

  // Opens a channel to the worker: the front end's end of a connected stream socket, blocking
  // (WorkerProcess::OpenUnaryChannel); the channels take and close it.
  using Opener = std::function<absl::StatusOr<int>()>;
  explicit UnaryChannels(Opener open)
      : open_(std::move(open)), shared_(std::make_shared<Shared>()) {}
  // Shuts every channel down and joins their threads (a call still in flight is answered
  // UNAVAILABLE first); on a channel's own thread, that thread finishes on its own.
  ~UnaryChannels();
  UnaryChannels(const UnaryChannels&) = delete;
  UnaryChannels& operator=(const UnaryChannels&) = delete;

  // How long the relay lets a calling thread wait for a short call's answer (unary_proxy.cc).
  static constexpr absl::Duration kShortCallWait = absl::Microseconds(250);

  // Sends `request` of `method` (a unary method of the session services) on a free channel,
  // opening one when fewer than kMaxUnaryChannels are open. `done` runs once, when the call
  // ends: on this thread before Call returns when the worker's whole answer (or refusal) was
  // in the socket within `wait` and a waiting slot was free, else on the channel's thread
  // (see above). `done` is moved from only when the call went framed. False (and `done` is
  // left as it was) when the call cannot go framed: no channel is free, the request is larger
  // than kMaxRelayedRequestBytes, or no channel could be opened. The caller then relays the
  // call by gRPC.
  bool Call(const std::string& method, const grpc::ByteBuffer& request, Done& done,
            absl::Duration wait = absl::ZeroDuration());

  // Channels open now (for tests and metrics).
  int open() const;

  // Calling threads that may wait for an answer at once, over the whole process: a quarter of
  // the machine's hardware threads, 1 to 8, so that most of gRPC's threads stay free.
  static int max_inline_waiters();
  static void set_max_inline_waiters_for_test(int max);
  // Calling threads waiting for an answer now (for tests).
  static int inline_waiters();

 private:
  // One frame read from a channel: what it means for the call in flight.
  struct Frame {
    Outcome outcome = Outcome::kBroken;
    grpc::Status status;
    grpc::ByteBuffer response;  // for an OK answer
    bool ends_channel = true;   // the channel cannot carry another call
  };
  struct Channel {
    ~Channel();  // closes fd (the thread is joined or detached by then)
    int fd = -1;
    std::thread thread;
    // Guarded by Shared::mu.
    Done done;                          // the call in flight
    bool busy = false;                  // a call is in flight
    bool thread_reads = false;          // ... and its thread is to read the answer
    std::optional<Frame> read_already;  // ... or to complete it with this broken frame
    bool broken = false;                // its thread has ended or is ending
    bool answered_once = false;         // a frame came: an end frame now is no refusal
    absl::CondVar wake;                 // thread_reads, broken or closing changed
    std::atomic<bool> finished{false};  // its thread returned: it may be joined
  };
  struct Shared {
    absl::Mutex mu;
    std::vector<std::unique_ptr<Channel>> channels ABSL_GUARDED_BY(mu);
    bool closing ABSL_GUARDED_BY(mu) = false;
    absl::Time no_channels_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
    bool caller_waiting ABSL_GUARDED_BY(mu) = false;  // a calling thread waits for an answer
  };
  // The channel's thread: reads the answers of the calls handed to it and completes those
  // calls, until the channel ends.
  static void Loop(const std::shared_ptr<Shared>& shared, Channel* channel);
  // Reads the frame that answers `channel`'s call in flight, waiting for it.
  static Frame ReadFrame(Shared& shared, Channel* channel);
  // Completes `channel`'s call in flight with `frame`. False when the channel ended.
  static bool Complete(Shared& shared, Channel* channel, Frame frame);
  // Ends `channel`'s call in flight (if any) with `outcome` and `status`, and marks the
  // channel broken.
  static void End(Shared& shared, Channel* channel, Outcome outcome, grpc::Status status);
  // The channel may not be used again; its thread ends.
  static void BreakLocked(Shared& shared, Channel* channel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared.mu);
  // Joins and forgets the channels whose threads returned.
  static void PruneLocked(Shared& shared) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared.mu);
  Channel* TakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared_->mu);

  const Opener open_;
  const std::shared_ptr<Shared> shared_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_UNARY_CHANNELS_H_
