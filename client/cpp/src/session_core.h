// Shared state behind a Session and every handle made from it: the stubs, the session
// metadata, the call timeout, the session's watch (WatchSession) and the command stream.
//
// Why gRPC's callback API: a synchronous call whose request is stuck behind HTTP/2 flow
// control (the daemon stopped reading: SIGSTOPped, wedged) does not end at its deadline nor
// when cancelled; gRPC completes it only once the peer reads again. So every call that sends
// more than a few bytes (unary calls, the command stream's batches, streamed uploads) is
// started on the callback API and waited for on a condition variable with its deadline; at
// the deadline it is cancelled and left to finish on its own (its state lives in the
// callbacks), and the caller gets DEADLINE_EXCEEDED at once. Reads are not affected (a
// cancelled read ends at once), so the streamed download stays synchronous.
#ifndef GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
#define GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc::internal {

// Bounds of the calls that must never wait long whatever the call timeout: closing a session
// and the explicit KeepAlive (each also at most the call timeout), and the cleanup calls of
// handle destructors.
inline constexpr absl::Duration kCloseTimeout = absl::Seconds(5);
inline constexpr absl::Duration kKeepAliveTimeout = absl::Seconds(10);
inline constexpr absl::Duration kCleanupTimeout = absl::Seconds(10);
// How long a call that finds the channel disconnected waits for it to reconnect (once).
inline constexpr absl::Duration kReconnectTimeout = absl::Seconds(10);
// The call timeout when neither ConnectOptions::call_timeout nor $GPURPC_TIMEOUT sets one.
inline constexpr absl::Duration kDefaultCallTimeout = absl::Minutes(5);

// gRPC (1.51) runs the callbacks of every channel's callback-API calls on one shared
// "alternative" completion queue with threads of its own, and shuts that queue down (joining
// its threads) when the last channel that used it goes. The last channel can go on one of
// those threads (a call's ClientContext holds its channel, and the last owner of an abandoned
// call is its callback), and a queue shut down from its own thread crashes the process. One
// channel that never goes keeps the queue for the process's life; Client::Connect calls this
// (once is enough; later calls do nothing).
void KeepCallbackQueueAlive();

// The earlier of now + timeout and never (an infinite timeout).
absl::Time DeadlineAfter(absl::Duration timeout);
// Sets `deadline` on `context` unless it is infinite.
void SetDeadline(grpc::ClientContext* context, absl::Time deadline);
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

// Runs a unary call on gRPC's callback API and waits for it at most until its deadline,
// `timeout` from now (also the call's gRPC deadline); past it (plus kAbandonMargin) the call
// is cancelled and abandoned, and DEADLINE_EXCEEDED naming `name` returned. `start` begins
// the call: start(context, const Request*, Response*, std::function<void(grpc::Status)>),
// i.e. stub.async()->Method(...). `prepare` adds metadata. The request is moved into the
// call's state (it must outlive an abandoned call).
template <typename Request, typename Response, typename Start>
absl::Status RunUnary(absl::string_view name, Start&& start, Request request, Response* response,
                      absl::Duration timeout,
                      const std::function<void(grpc::ClientContext*)>& prepare,
                      bool wait_for_ready = false) {
  struct Call {
    grpc::ClientContext context;
    Request request;
    Response response;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
  };
  auto call = std::make_shared<Call>();
  call->request = std::move(request);
  if (prepare) prepare(&call->context);
  call->context.set_wait_for_ready(wait_for_ready);
  const absl::Time deadline = DeadlineAfter(timeout);
  SetDeadline(&call->context, deadline);
  // The callback may run inline (a call that fails at once): no lock is held here.
  start(&call->context, &call->request, &call->response, [call](grpc::Status status) {
    std::lock_guard<std::mutex> lock(call->mu);
    call->status = std::move(status);
    call->done = true;
    call->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(call->mu);
  if (deadline == absl::InfiniteFuture()) {
    call->cv.wait(lock, [&] { return call->done; });
  } else if (!call->cv.wait_until(lock, absl::ToChronoTime(deadline + kAbandonMargin),
                                  [&] { return call->done; })) {
    lock.unlock();
    call->context.TryCancel();  // may run the callback inline: unlocked
    return TimeoutError(name, timeout);
  }
  const grpc::Status status = call->status;
  if (status.ok()) *response = std::move(call->response);
  lock.unlock();
  return CallStatus(status, name, timeout, deadline);
}

// Cancels a call (`context`) at `deadline` unless destroyed first: a deadline for the blocking
// reads of the synchronous API, which take none of their own (one Read of a stream; a
// cancelled read ends at once, unlike a write: see above). No thread: a grpc::Alarm runs the
// cancellation on gRPC's own threads.
class DeadlineCanceller {
 public:
  DeadlineCanceller(grpc::ClientContext* context, absl::Time deadline);
  ~DeadlineCanceller();
  DeadlineCanceller(const DeadlineCanceller&) = delete;
  DeadlineCanceller& operator=(const DeadlineCanceller&) = delete;
  // True when the deadline passed and the call was cancelled.
  bool fired() const;

 private:
  struct State {
    std::mutex mu;
    grpc::ClientContext* context = nullptr;  // null once disarmed
    bool fired = false;
  };
  std::shared_ptr<State> state_;
  std::unique_ptr<grpc::Alarm> alarm_;
};

class SessionCore;

// The session's WatchSession stream, on gRPC's callback API: no thread is parked per session.
// Events go to SessionCore::OnWatchEvent, the end to SessionCore::OnWatchEnd; a broken stream
// is re-opened after a backoff (a grpc::Alarm) until the session is closed, found gone
// (NOT_FOUND), or the daemon ends the stream itself (the session was closed or reclaimed).
class SessionWatch {
 public:
  // `backoff_cap` bounds the wait between re-opens (a fraction of the daemon's grace).
  SessionWatch(SessionCore* core, absl::Duration backoff_cap);
  ~SessionWatch();  // Stop()
  void Start();
  // Cancels the stream or the pending re-open and returns once no callback can run any more
  // (cancellation is local: this does not wait for the daemon).
  void Stop();

 private:
  class Call;
  void Open();  // mu_ not held
  void OnEvent(const v1::SessionEvent& event);
  void OnCallDone(const grpc::Status& status);
  void OnAlarm(bool fired);

  SessionCore* const core_;
  const absl::Duration backoff_cap_;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  bool stopping_ = false;
  std::shared_ptr<Call> call_;          // the open stream, if any
  std::shared_ptr<grpc::Alarm> alarm_;  // the pending re-open, if any
  bool alarm_pending_ = false;
  absl::Duration backoff_;
};

class CommandCall;
struct CommandStreamState;

class SessionCore {
 public:
  SessionCore(std::shared_ptr<grpc::Channel> channel, const v1::OpenSessionResponse& opened,
              absl::Duration call_timeout);
  ~SessionCore();

  uint64_t id() const { return id_; }
  const v1::DeviceInfo& device() const { return device_; }
  bool closed() const { return closed_.load(); }

  absl::Duration call_timeout() const;
  void set_call_timeout(absl::Duration timeout);

  // What the watch knows: OK while the session is usable; else the status every call on it
  // answers now (the fault's code and cause for a FAULTED session, the daemon's NOT_FOUND
  // for a lost one, FAILED_PRECONDITION once closed). Calls check it first and return it
  // without a round trip.
  absl::Status CheckUsable() const;
  v1::SessionState state() const;

  // Adds the session metadata (id and daemon instance) to a call.
  void AddMetadata(grpc::ClientContext* context) const;

  v1::MemoryService::Stub& memory() { return *memory_; }
  v1::ModuleService::Stub& modules() { return *modules_; }
  v1::ExecutionService::Stub& execution() { return *execution_; }
  v1::SessionService::Stub& sessions() { return *sessions_; }

  // Command stream. Enqueue assigns the sequence number and sends a batch when it is full.
  absl::Status Enqueue(v1::Command command);
  // Sends the queued batch.
  absl::Status Flush();
  // Makes sure every command enqueued so far has been processed by the worker (so that a
  // unary call sent next is ordered after them), waiting at most `timeout`. Free when
  // nothing was enqueued since.
  absl::Status Barrier(absl::Duration timeout);
  absl::Status Barrier() { return Barrier(call_timeout()); }
  // Enqueues a sync marker and waits for it, at most `timeout` (DEADLINE_EXCEEDED naming
  // `call` then; the work goes on); returns the first asynchronous error since the last
  // synchronising call, or the stream's final error.
  absl::Status Sync(uint64_t stream_id, bool whole_session, absl::Duration timeout,
                    absl::string_view call);

  // Stops the watch, cancels the command stream (queued commands are dropped: closing frees
  // everything anyway) and wakes every caller waiting on it, then closes the session
  // remotely with a deadline of kCloseTimeout (or the call timeout when shorter). Never
  // waits for more than that, also when the daemon is stopped, gone or restarted.
  absl::Status Close();

 private:
  friend class SessionWatch;
  void OnWatchEvent(const v1::SessionEvent& event);
  // The watch ended for good with `status` (OK: the daemon ended it, the session is closed
  // or reclaimed; NOT_FOUND: the session is gone, e.g. the daemon restarted).
  void OnWatchEnd(const grpc::Status& status);

  absl::Status EnsureStreamLocked(absl::Time deadline);
  absl::Status FlushLocked(absl::Time deadline, absl::Duration timeout, absl::string_view call);
  absl::Status WaitProcessed(uint64_t sequence, absl::Time deadline, absl::Duration timeout,
                             absl::string_view call);

  std::shared_ptr<grpc::Channel> channel_;
  const uint64_t id_;
  const std::string id_string_;
  const std::string instance_;
  const v1::DeviceInfo device_;
  std::unique_ptr<v1::SessionService::Stub> sessions_;
  std::unique_ptr<v1::MemoryService::Stub> memory_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  std::atomic<bool> closed_{false};
  // Nanoseconds; INT64_MAX = no deadline.
  std::atomic<int64_t> call_timeout_ns_;

  // What the watch reported (see CheckUsable).
  mutable std::mutex health_mu_;
  v1::SessionState state_ = v1::SESSION_STATE_ACTIVE;
  absl::Status unusable_;

  std::unique_ptr<SessionWatch> watch_;

  // Command stream, on the callback API (CommandCall, in the .cc): no thread of its own.
  // send_mu_ orders enqueue/flush (one batch write in flight at a time); the replies and the
  // stream's end update `commands_` (its own mutex), which outlives this object while an
  // abandoned call still runs. call_mu_ guards call_ for Close, which cancels it without
  // send_mu_ (whose holder may be waiting for a write). Never take send_mu_ while holding
  // commands_->mu or call_mu_.
  std::mutex send_mu_;
  std::mutex call_mu_;
  std::shared_ptr<CommandCall> call_;
  const std::shared_ptr<CommandStreamState> commands_;
  v1::CommandBatch batch_;
  size_t batch_bytes_ = 0;
  uint64_t next_sequence_ = 0;
  uint64_t sent_through_ = 0;
};

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
