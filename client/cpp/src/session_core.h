// Shared state behind a Session and every handle made from it: the stubs, the session
// metadata, the call timeout, the session's watch (WatchSession) and the command stream.
//
// How calls wait (transport.h): every call runs on a completion queue of its own that the
// waiting thread drives up to the call's deadline, never on gRPC's callback API (whose
// threads would take every socket event from the waiting thread); a call whose request is
// stuck behind HTTP/2 flow control is cancelled and abandoned at its deadline. The watch runs
// on the process's background thread.
#ifndef GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
#define GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/cpp/src/transport.h"
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

class SessionCore;

// The session's WatchSession stream, on the process's background thread (transport.h): no
// thread is parked per session. Events go to SessionCore::OnWatchEvent, the end to
// SessionCore::OnWatchEnd; a broken stream is re-opened after a backoff (an alarm) until the
// session is closed, found gone (NOT_FOUND), or the daemon ends the stream itself (the session
// was closed or reclaimed).
class SessionWatch {
 public:
  // `backoff_cap` bounds the wait between re-opens (a fraction of the daemon's grace).
  SessionWatch(SessionCore* core, absl::Duration backoff_cap);
  ~SessionWatch();  // Stop()
  void Start();
  // Cancels the stream or the pending re-open and returns once nothing can reach the core any
  // more (cancellation is local: this does not wait for the daemon; what is left of the call
  // ends on the background thread).
  void Stop();

  struct State;  // shared with the stream and the alarm, which may outlive this object

 private:
  // What the state reports to the core (SessionCore's private reactions).
  static void Deliver(SessionCore* core, const v1::SessionEvent& event);
  static void End(SessionCore* core, const grpc::Status& status);

  std::shared_ptr<State> state_;
};

class CommandCall;

// What the replies and the end of the command stream tell, shared by SessionCore and its
// CommandCalls (an abandoned call may outlive the session).
struct CommandStreamState {
  // Gives `text` (non-empty) to the handler, outside mu.
  void DeliverDeviceOutput(absl::string_view text) ABSL_LOCKS_EXCLUDED(mu);

  // What SessionCore::WaitCommands waits for (absl::Condition(state, &...)): the stream
  // ended or the session was closed; the batch being written is written, or that.
  bool StreamOver() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stream_ended || closed; }
  bool WriteDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return !write_pending || StreamOver();
  }

  absl::Mutex mu;
  absl::CondVar cv;  // signalled (under mu) whenever anything below changes
  // The current call's; the events of an earlier call (cancelled and replaced) change
  // nothing.
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  // The last sequence of each batch sent and not yet answered: the worker answers every
  // batch with exactly one reply, in order, also when an error skipped its tail.
  std::deque<uint64_t> unanswered_batches ABSL_GUARDED_BY(mu);
  uint64_t processed_through ABSL_GUARDED_BY(mu) = 0;
  absl::Status first_error ABSL_GUARDED_BY(mu);   // first failed command since the last sync
  absl::Status stream_error ABSL_GUARDED_BY(mu);  // the stream ended with this
  bool stream_ended ABSL_GUARDED_BY(mu) = false;
  // Once set, the next command opens a new stream.
  bool stream_error_reported ABSL_GUARDED_BY(mu) = false;
  bool write_pending ABSL_GUARDED_BY(mu) = false;  // a batch is being written
  bool write_ok ABSL_GUARDED_BY(mu) = true;        // how the last write ended
  bool abandoned ABSL_GUARDED_BY(mu) = false;      // the call was cancelled with a write stuck
  bool closed ABSL_GUARDED_BY(mu) = false;         // the session is closed: waiters return
  // The current call while waiters may drive it (SessionCore::WaitCommands), and whether
  // one does.
  std::shared_ptr<CommandCall> drivable ABSL_GUARDED_BY(mu);
  bool driving ABSL_GUARDED_BY(mu) = false;
  // Session::SetDeviceOutputHandler's handler; null: drop the output.
  std::shared_ptr<const std::function<void(absl::string_view)>> device_output ABSL_GUARDED_BY(mu) =
      PrintToStdout();

  // The default device output handler.
  static std::shared_ptr<const std::function<void(absl::string_view)>> PrintToStdout();
};

class SessionCore {
 public:
  SessionCore(std::shared_ptr<grpc::Channel> channel, const v1::OpenSessionResponse& opened,
              absl::Duration call_timeout);
  ~SessionCore();

  uint64_t id() const { return id_; }
  const v1::DeviceInfo& device() const { return device_; }
  // The daemon holding the session (set once, before the core is shared).
  const std::string& target() const { return target_; }
  void set_target(std::string target) { target_ = std::move(target); }
  bool closed() const { return closed_.load(); }

  absl::Duration call_timeout() const;
  void set_call_timeout(absl::Duration timeout);

  // Session::SetDeviceOutputHandler; DeliverDeviceOutput hands a synchronising answer's
  // device_output to the handler (nothing for an empty one).
  void SetDeviceOutputHandler(std::function<void(absl::string_view)> handler)
      ABSL_LOCKS_EXCLUDED(commands_->mu);
  void DeliverDeviceOutput(absl::string_view output) const ABSL_LOCKS_EXCLUDED(commands_->mu);

  // What the watch knows: OK while the session is usable; else the status every call on it
  // answers now (the fault's code and cause for a FAULTED session, the daemon's NOT_FOUND
  // for a lost one, FAILED_PRECONDITION once closed). Calls check it first and return it
  // without a round trip.
  absl::Status CheckUsable() const ABSL_LOCKS_EXCLUDED(health_mu_);
  v1::SessionState state() const ABSL_LOCKS_EXCLUDED(health_mu_);

  // Adds the session metadata (id and daemon instance) to a call.
  void AddMetadata(grpc::ClientContext* context) const;

  v1::MemoryService::Stub& memory() { return *memory_; }
  v1::ModuleService::Stub& modules() { return *modules_; }
  v1::ExecutionService::Stub& execution() { return *execution_; }
  // ExecutionService through the front end also when a direct channel is in use: for the
  // calls whose record the front end keeps (DestroyEvent of an IPC event).
  v1::ExecutionService::Stub& relay_execution() { return *relay_execution_; }
  v1::SessionService::Stub& sessions() { return *sessions_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Sends ExecutionService calls (the command stream included) on `direct` from now on
  // (Session::UseDirectChannel). FAILED_PRECONDITION once the command stream was opened:
  // call it first, before the session is used from several threads.
  absl::Status UseExecutionChannel(std::shared_ptr<grpc::Channel> direct)
      ABSL_LOCKS_EXCLUDED(send_mu_, call_mu_);
  bool direct() const { return direct_channel_ != nullptr; }

  // The connections a large streamed transfer is split over: channel() first, then those
  // set here (each its own connection to the same daemon; set once, before the core is
  // shared). See ConnectOptions::transfer_connections.
  void set_transfer_channels(std::vector<std::shared_ptr<grpc::Channel>> extra) {
    transfer_channels_ = std::move(extra);
  }
  size_t transfer_connections() const { return 1 + transfer_channels_.size(); }
  const std::shared_ptr<grpc::Channel>& transfer_channel(size_t index) const {
    return index == 0 ? channel_ : transfer_channels_[index - 1];
  }

  // Command stream. Enqueue assigns the sequence number and sends a batch when it is full.
  absl::Status Enqueue(v1::Command command) ABSL_LOCKS_EXCLUDED(send_mu_);
  // Sends the queued batch.
  absl::Status Flush() ABSL_LOCKS_EXCLUDED(send_mu_);
  // Makes sure every command enqueued so far has been processed by the worker (so that a
  // unary call sent next is ordered after them), waiting at most `timeout`. Free when
  // nothing was enqueued since.
  absl::Status Barrier(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(send_mu_, commands_->mu);
  absl::Status Barrier() ABSL_LOCKS_EXCLUDED(send_mu_, commands_->mu) {
    return Barrier(call_timeout());
  }
  // Enqueues a sync marker and waits for it, at most `timeout` (DEADLINE_EXCEEDED naming
  // `call` then; the work goes on); returns the first asynchronous error since the last
  // synchronising call, or the stream's final error.
  // `event_id` (not 0): waits for that event instead (SyncCommand.event_id).
  absl::Status Sync(uint64_t stream_id, bool whole_session, absl::Duration timeout,
                    absl::string_view call, uint64_t event_id = 0)
      ABSL_LOCKS_EXCLUDED(send_mu_, commands_->mu);
  // What a synchronising unary call that succeeded answers instead (Function::
  // LaunchAndSynchronize, after a Barrier): the first asynchronous error since the last
  // synchronising call, which it clears, or OK.
  absl::Status TakeCommandError() ABSL_LOCKS_EXCLUDED(commands_->mu);

  // Stops the watch, cancels the command stream (queued commands are dropped: closing frees
  // everything anyway) and wakes every caller waiting on it, then closes the session
  // remotely with a deadline of kCloseTimeout (or the call timeout when shorter). Never
  // waits for more than that, also when the daemon is stopped, gone or restarted.
  absl::Status Close() ABSL_LOCKS_EXCLUDED(call_mu_, commands_->mu);

 private:
  friend class SessionWatch;
  void OnWatchEvent(const v1::SessionEvent& event) ABSL_LOCKS_EXCLUDED(health_mu_);
  // The watch ended for good with `status` (OK: the daemon ended it, the session is closed
  // or reclaimed; NOT_FOUND: the session is gone, e.g. the daemon restarted).
  void OnWatchEnd(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(health_mu_);

  // call_ for a holder of send_mu_: the only thread that replaces it, which holds call_mu_
  // too then (see below).
  const std::shared_ptr<CommandCall>& sending_call() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return call_;
  }

  absl::Status EnsureStreamLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_)
      ABSL_LOCKS_EXCLUDED(call_mu_, commands_->mu);
  // Waits (holding commands_->mu, which it releases while it drives) until `done` holds or
  // `deadline`, driving the current command stream call's completion queue while no other
  // thread does (transport.h): the thread that waits handles the replies. Returns whether
  // `done` holds (it is evaluated with commands_->mu held).
  bool WaitCommands(absl::Time deadline, const absl::Condition& done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commands_->mu);
  absl::Status FlushLocked(absl::Time deadline, absl::Duration timeout, absl::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_) ABSL_LOCKS_EXCLUDED(commands_->mu);
  absl::Status WaitProcessed(uint64_t sequence, absl::Time deadline, absl::Duration timeout,
                             absl::string_view call) ABSL_LOCKS_EXCLUDED(commands_->mu);
  absl::Status TakeCommandErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commands_->mu);

  std::shared_ptr<grpc::Channel> channel_;
  const uint64_t id_;
  const std::string id_string_;
  const std::string instance_;
  const v1::DeviceInfo device_;
  std::string target_;
  std::unique_ptr<v1::SessionService::Stub> sessions_;
  std::unique_ptr<v1::MemoryService::Stub> memory_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  const std::unique_ptr<v1::ExecutionService::Stub> relay_execution_;
  std::shared_ptr<grpc::Channel> direct_channel_;                  // set by UseExecutionChannel
  std::vector<std::shared_ptr<grpc::Channel>> transfer_channels_;  // set_transfer_channels
  std::atomic<bool> closed_{false};
  // Nanoseconds; INT64_MAX = no deadline.
  std::atomic<int64_t> call_timeout_ns_;

  // What the watch reported (see CheckUsable).
  mutable absl::Mutex health_mu_;
  v1::SessionState state_ ABSL_GUARDED_BY(health_mu_) = v1::SESSION_STATE_ACTIVE;
  absl::Status unusable_ ABSL_GUARDED_BY(health_mu_);

  std::unique_ptr<SessionWatch> watch_;

  // Command stream (CommandCall, in the .cc), on a completion queue of its own that the
  // threads waiting for it drive (WaitCommands): no thread of its own.
  // send_mu_ orders enqueue/flush (one batch write in flight at a time); the replies and the
  // stream's end update `commands_` (its own mutex), which outlives this object while an
  // abandoned call still runs. call_mu_ guards call_ for Close, which retires it without
  // send_mu_ (whose holder may be waiting for a write): call_ changes only under both, so a
  // holder of send_mu_ reads it without call_mu_ (sending_call()). Never take send_mu_ while
  // holding commands_->mu or call_mu_.
  absl::Mutex send_mu_;
  absl::Mutex call_mu_;
  std::shared_ptr<CommandCall> call_ ABSL_GUARDED_BY(call_mu_);
  const std::shared_ptr<CommandStreamState> commands_;
  v1::CommandBatch batch_ ABSL_GUARDED_BY(send_mu_);
  size_t batch_bytes_ ABSL_GUARDED_BY(send_mu_) = 0;
  uint64_t next_sequence_ ABSL_GUARDED_BY(send_mu_) = 0;
  uint64_t sent_through_ ABSL_GUARDED_BY(send_mu_) = 0;
};

// Keeps a module loaded while a Module or any Function from it exists (Compile, LoadModule
// and Session::Link make them; the destructor, in client.cc, unloads the module).
struct ModuleHandle {
  std::shared_ptr<SessionCore> core;
  uint64_t id = 0;
  ~ModuleHandle();
};

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
