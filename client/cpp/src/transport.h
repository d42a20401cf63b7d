// How the C++ client waits for gRPC (1.51), and why it never uses gRPC's callback API.
//
// gRPC runs callback-API calls on a pool of "nexting" threads (half the cores, 2 to 16) that all
// wait in the process's one epoll set. Once any callback call exists in a process, one of those
// threads reads every socket and hands each event to the thread that waits for it: measured on
// the fake backend (tests/benchmarks), a blocking KeepAlive cost the client twice the CPU and
// 4-5 thread wake-ups instead of 1.2 while one callback stream (the session's watch) was open,
// and on the 16-core H200 host the KeepAlive ping went from ~90 to ~200 us.
//
// So here:
// - A call that a thread waits for (unary calls, the command stream, streamed transfers) runs
//   on a completion queue of its own, which the waiting thread drives itself
//   (CompletionQueue::AsyncNext up to the call's deadline): the thread that waits reads the
//   socket, with no hand-over.
// - What nobody waits for (the sessions' WatchSession streams and their re-open backoff, and
//   calls given up at their deadline) runs on Background: one thread per process with a
//   completion queue of its own. It polls only while no call of the process has been in
//   flight for kBackgroundQuiet (so that it never takes a waiting caller's socket events, and
//   still answers the daemon's HTTP/2 keepalive pings and sees a broken connection when the
//   client is idle); while calls are in flight it looks at its queue without waiting every
//   kBackgroundGlance.
// - Deadlines: a call whose request is stuck behind HTTP/2 flow control (the daemon stopped
//   reading: SIGSTOPped, wedged) does not complete, not even when cancelled, until the peer
//   reads again; a blocking gRPC call would hang past its deadline. The waits here end at the
//   deadline anyway (AsyncNext's own), cancel the call and hand it to Background::Abandon,
//   which keeps its completion queue, context and buffers until gRPC lets go of them.
#ifndef GPURPC_CLIENT_CPP_SRC_TRANSPORT_H_
#define GPURPC_CLIENT_CPP_SRC_TRANSPORT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc::internal {

// How long the process must have had no call in flight before Background polls.
inline constexpr absl::Duration kBackgroundQuiet = absl::Milliseconds(20);
// How often Background looks at its queue (without waiting) while calls are in flight.
inline constexpr absl::Duration kBackgroundGlance = absl::Milliseconds(100);

// Something whose completion queue must be drained before it may be freed (a call given up,
// or the command stream's call once replaced or closed). Background::Abandon takes it after
// its owner has cancelled the call, shut its queue down and will start no operation on it.
class Drainable {
 public:
  virtual ~Drainable() = default;
  virtual grpc::CompletionQueue* drain_queue() = 0;
  // An event drained from the queue (its operation finished after the call was given up).
  virtual void OnDrained(void* tag, bool ok) {}
};

class Background {
 public:
  // The process's one, started on first use; never destroyed (it may hold calls of a stopped
  // daemon for as long as the process lives).
  static Background& Get();

  // What runs on the background thread: every tag of queue() is a Tag*.
  class Tag {
   public:
    virtual ~Tag() = default;
    virtual void Run(bool ok) = 0;
  };
  grpc::CompletionQueue* queue() { return &queue_; }

  // A call of this process in flight (scoped): the background thread stops polling (it is
  // woken if it polls) and does not poll again until no call has been in flight for
  // kBackgroundQuiet.
  class Busy {
   public:
    Busy();
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Background& background_;
  };

  // Drains `call`'s (shut down) completion queue as its operations finish, then lets it go.
  void Abandon(std::shared_ptr<Drainable> call) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Background();
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void Kick();
  // One event of queue() or nothing, waiting at most until `until`.
  void RunOne(std::chrono::system_clock::time_point until);
  void DrainAbandoned() ABSL_LOCKS_EXCLUDED(mu_);

  grpc::CompletionQueue queue_;
  std::atomic<int> busy_{0};
  std::atomic<int64_t> last_busy_ns_{0};  // steady clock
  std::atomic<bool> polling_{false};
  std::atomic<bool> kick_pending_{false};
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Drainable>> abandoned_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The earlier of now + timeout and never (an infinite timeout).
absl::Time DeadlineAfter(absl::Duration timeout);
// Sets `deadline` on `context` unless it is infinite.
void SetDeadline(grpc::ClientContext* context, absl::Time deadline);
// `deadline` for CompletionQueue::AsyncNext (far in the future for an infinite one).
std::chrono::system_clock::time_point QueueDeadline(absl::Time deadline);
// absl::Status of a finished call named `call` whose client deadline was `deadline` (from
// `timeout`): a DEADLINE_EXCEEDED that our deadline caused says which call ran out of which
// timeout; anything else (the daemon's own DEADLINE_EXCEEDED of the kernel watchdog
// included) is the daemon's status as is.
absl::Status CallStatus(const grpc::Status& status, absl::string_view call, absl::Duration timeout,
                        absl::Time deadline);
// The DEADLINE_EXCEEDED of a call that did not finish within `timeout`.
absl::Status TimeoutError(absl::string_view call, absl::Duration timeout,
                          absl::string_view detail = "");

// How long past its deadline a call may take to report it before it is abandoned (gRPC ends
// a call at its deadline itself, unless its request is stuck; see above).
inline constexpr absl::Duration kAbandonMargin = absl::Milliseconds(250);

// A unary call on a completion queue of its own (see above). The request goes out in one
// batch with the wait for the daemon's headers, the answer comes in another, so that the
// answer (the deadline's included) is seen also while the request is stuck.
template <typename Response>
struct UnaryCall final : Drainable {
  grpc::CompletionQueue queue;
  grpc::ClientContext context;
  Response response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  grpc::CompletionQueue* drain_queue() override { return &queue; }
};

inline void* const kSentTag = reinterpret_cast<void*>(1);
inline void* const kAnsweredTag = reinterpret_cast<void*>(2);

// Runs a unary call and waits for it at most until its deadline, `timeout` from now (also the
// call's gRPC deadline); past it (plus kAbandonMargin) the call is cancelled and abandoned, and
// DEADLINE_EXCEEDED naming `name` returned. `prepare` creates the call:
// prepare(grpc::ClientContext*, const Request&, grpc::CompletionQueue*) returning the
// stub's PrepareAsyncMethod(...) reader. `add_metadata` adds metadata.
template <typename Request, typename Response, typename Prepare>
auto RunUnary(absl::string_view name, Prepare&& prepare, const Request& request, Response* response,
              absl::Duration timeout, const std::function<void(grpc::ClientContext*)>& add_metadata,
              bool wait_for_ready = false)
    -> decltype(prepare(std::declval<grpc::ClientContext*>(), request,
                        std::declval<grpc::CompletionQueue*>()),
                absl::Status()) {
  auto call = std::make_shared<UnaryCall<Response>>();
  if (add_metadata) add_metadata(&call->context);
  call->context.set_wait_for_ready(wait_for_ready);
  const absl::Time deadline = DeadlineAfter(timeout);
  SetDeadline(&call->context, deadline);
  Background::Busy busy;
  call->reader = prepare(&call->context, request, &call->queue);
  call->reader->StartCall();
  call->reader->ReadInitialMetadata(kSentTag);
  call->reader->Finish(&call->response, &call->status, kAnsweredTag);
  const auto until =
      QueueDeadline(deadline == absl::InfiniteFuture() ? deadline : deadline + kAbandonMargin);
  bool sent = false;
  bool answered = false;
  while (!sent || !answered) {
    void* tag = nullptr;
    bool ok = false;
    if (call->queue.AsyncNext(&tag, &ok, until) != grpc::CompletionQueue::GOT_EVENT) break;
    (tag == kAnsweredTag ? answered : sent) = true;
  }
  call->queue.Shutdown();
  if (!sent || !answered) {
    // Its request is still stuck (the daemon takes no bytes): give the call up.
    call->context.TryCancel();
    Background::Get().Abandon(call);
    if (!answered) return TimeoutError(name, timeout);
  } else {
    void* tag = nullptr;
    bool ok = false;
    while (call->queue.Next(&tag, &ok)) {
    }  // nothing is pending: returns at once
  }
  if (call->status.ok()) *response = std::move(call->response);
  return CallStatus(call->status, name, timeout, deadline);
}

// A streamed call of raw messages (grpc::GenericStub: the bytes as they go on the wire) on a
// completion queue of its own, used and driven by one thread at a time. Each kind of
// operation has its own tag; at most one of each is pending.
class RawStreamCall final : public Drainable {
 public:
  enum Op { kStart, kWrite, kWritesDone, kRead, kFinish, kOpCount };

  // `method` is the full path ("/package.Service/Method").
  RawStreamCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                const std::function<void(grpc::ClientContext*)>& add_metadata);

  void Write(const grpc::ByteBuffer& message);
  void WriteLast(const grpc::ByteBuffer& message);
  void WritesDone();
  // Starts reading the next message into one of the call's two buffers, in turn, and returns
  // it. The buffers are the call's, so a read abandoned with the call (End) still has somewhere
  // to land; a buffer holds its message once the read finished and is reused by the read after
  // next.
  grpc::ByteBuffer* Read();
  void Finish();
  const grpc::Status& status() const { return status_; }

  // Waits until `op` has finished (true, its result in *ok) or `until` (false).
  bool Await(Op op, absl::Time until, bool* ok);
  // Ends the call: when no operation is pending its queue is drained here; otherwise (a
  // deadline passed, or the caller gave up) it is cancelled and abandoned to Background.
  static void End(std::shared_ptr<RawStreamCall> call);

  grpc::CompletionQueue* drain_queue() override { return &queue_; }

 private:
  void Started(Op op) { pending_[op] = true; }
  static void* TagOf(Op op) { return reinterpret_cast<void*>(static_cast<intptr_t>(op) + 1); }

  grpc::CompletionQueue queue_;
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  grpc::Status status_;
  grpc::ByteBuffer received_[2];
  int next_received_ = 0;
  bool pending_[kOpCount] = {};
  bool done_[kOpCount] = {};
  bool ok_[kOpCount] = {};
};

// Outgoing chunks: `header` (serialized fields of the message, data aside) followed by `data`
// as the length-delimited field `field_number`, in one buffer of a pool that gRPC gives
// back once the transport has written it (so that a long transfer does not map and fault in
// fresh memory for every chunk): one copy of the bytes.
grpc::ByteBuffer ChunkMessage(const std::string& header, int field_number, const uint8_t* data,
                              size_t size);

// Copies the length-delimited field `field_number` of the raw message `message` to `out`,
// from *copied on (advanced by what was copied). INTERNAL naming `what` when the message
// does not parse, holds the field twice or holds more than `out` has room for.
absl::Status CopyChunkField(grpc::ByteBuffer* message, int field_number, absl::Span<uint8_t> out,
                            size_t* copied, absl::string_view what);

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_TRANSPORT_H_
