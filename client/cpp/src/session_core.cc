#include "client/cpp/src/session_core.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/limits.h"

namespace gpurpc::internal {
namespace {

// A batch is sent when it holds this many commands or bytes (or at a sync/barrier).
constexpr int kMaxBatchCommands = 4096;
constexpr size_t kMaxBatchBytes = 8u << 20;

// First wait before re-opening a broken WatchSession stream; it doubles up to the cap.
constexpr absl::Duration kWatchInitialBackoff = absl::Milliseconds(50);

constexpr int64_t kNoTimeout = std::numeric_limits<int64_t>::max();

// A google.rpc.Code from the wire; anything out of range is FAILED_PRECONDITION (what a
// FAULTED session answers unless the daemon says otherwise).
absl::StatusCode FaultCode(int32_t code) {
  if (code <= 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kFailedPrecondition;
  }
  return static_cast<absl::StatusCode>(code);
}

}  // namespace

// ---------------------------------------------------------------------- SessionWatch

// One WatchSession stream on the background queue. Its reactions run on the background
// thread; it lives until its last operation has come back (its own reference, self_).
class WatchCall {
 public:
  explicit WatchCall(std::shared_ptr<SessionWatch::State> state) : state_(std::move(state)) {}

  // Opens the stream (`core` is alive: the state's lock is held). `self` keeps this alive.
  void Begin(SessionCore& core, std::shared_ptr<WatchCall> self) {
    self_ = std::move(self);
    core.AddMetadata(&context_);
    // No deadline: the stream is meant to stay open as long as the session is used.
    reader_ =
        core.sessions().PrepareAsyncWatchSession(&context_, request_, Background::Get().queue());
    ops_ = 2;
    reader_->StartCall(static_cast<Background::Tag*>(&started_));
    reader_->Read(&event_, static_cast<Background::Tag*>(&read_));
  }

  // Thread-safe (TryCancel runs no reaction inline on a completion queue).
  void Cancel() { context_.TryCancel(); }

 private:
  struct Op final : Background::Tag {
    Op(WatchCall* call, void (WatchCall::*react)(bool)) : call(call), react(react) {}
    void Run(bool ok) override {
      WatchCall* const target = call;
      (target->*react)(ok);
      target->OpDone();
    }
    WatchCall* const call;
    void (WatchCall::*const react)(bool);
  };

  void OnStarted(bool) {}  // a failed start fails the read too
  void OnRead(bool ok);
  void OnFinished(bool) { finished_seen_ = true; }
  void OpDone() {
    if (--ops_ > 0 || !finished_seen_) return;
    // The last operation is back: report the end, and go.
    std::shared_ptr<WatchCall> self = std::move(self_);
    Report();
  }
  void Report();

  const std::shared_ptr<SessionWatch::State> state_;
  grpc::ClientContext context_;
  v1::WatchSessionRequest request_;
  v1::SessionEvent event_;
  grpc::Status status_;
  std::unique_ptr<grpc::ClientAsyncReader<v1::SessionEvent>> reader_;
  Op started_{this, &WatchCall::OnStarted};
  Op read_{this, &WatchCall::OnRead};
  Op finished_{this, &WatchCall::OnFinished};
  std::atomic<int> ops_{0};
  bool finished_seen_ = false;
  std::shared_ptr<WatchCall> self_;
};

// The re-open of a broken stream after its backoff; frees itself when run.
class WatchAlarm final : public Background::Tag {
 public:
  explicit WatchAlarm(std::shared_ptr<SessionWatch::State> state) : state_(std::move(state)) {}
  void Set(absl::Duration after) {
    alarm_.Set(Background::Get().queue(), absl::ToChronoTime(absl::Now() + after),
               static_cast<Background::Tag*>(this));
  }
  void Cancel() { alarm_.Cancel(); }
  void Run(bool fired) override;

 private:
  const std::shared_ptr<SessionWatch::State> state_;
  grpc::Alarm alarm_;
};

struct SessionWatch::State : std::enable_shared_from_this<SessionWatch::State> {
  State(SessionCore* core, absl::Duration backoff_cap)
      : core(core), backoff_cap(backoff_cap), backoff(kWatchInitialBackoff) {}

  // Opens a stream.
  void OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (core == nullptr || call != nullptr) return;
    call = std::make_shared<WatchCall>(shared_from_this());
    call->Begin(*core, call);
  }

  void OnEvent(const v1::SessionEvent& event) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    backoff = kWatchInitialBackoff;  // the stream works
    if (core != nullptr) SessionWatch::Deliver(core, event);
  }

  void OnCallDone(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    call.reset();
    if (core == nullptr) return;  // stopped
    switch (status.error_code()) {
      case grpc::StatusCode::OK:                // the session was closed or reclaimed
      case grpc::StatusCode::NOT_FOUND:         // gone (reclaimed, closed, daemon restarted)
      case grpc::StatusCode::UNIMPLEMENTED:     // a daemon without WatchSession
      case grpc::StatusCode::INVALID_ARGUMENT:  // retrying cannot help
      case grpc::StatusCode::UNAUTHENTICATED:
      case grpc::StatusCode::PERMISSION_DENIED:
        SessionWatch::End(core, status);
        return;
      default:
        break;  // a broken connection, a daemon restarting, ...: re-open after a backoff
    }
    alarm = new WatchAlarm(shared_from_this());
    alarm->Set(backoff);
    backoff = std::min(backoff * 2, backoff_cap);
  }

  void OnAlarm(WatchAlarm* fired_alarm, bool fired) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (alarm == fired_alarm) alarm = nullptr;
    if (fired) OpenLocked();
  }

  absl::Mutex mu;
  SessionCore* core ABSL_GUARDED_BY(mu);  // null once stopped: nothing reaches the core afterwards
  const absl::Duration backoff_cap;
  absl::Duration backoff ABSL_GUARDED_BY(mu);
  std::shared_ptr<WatchCall> call ABSL_GUARDED_BY(mu);  // the open stream, if any
  // The pending re-open, if any (it frees itself).
  WatchAlarm* alarm ABSL_GUARDED_BY(mu) = nullptr;
};

void WatchCall::OnRead(bool ok) {
  if (!ok) {
    // The stream ended (or was cancelled): its status follows.
    ++ops_;
    reader_->Finish(&status_, static_cast<Background::Tag*>(&finished_));
    return;
  }
  state_->OnEvent(event_);
  ++ops_;
  reader_->Read(&event_, static_cast<Background::Tag*>(&read_));
}

void WatchCall::Report() { state_->OnCallDone(status_); }

void WatchAlarm::Run(bool fired) {
  state_->OnAlarm(this, fired);
  delete this;
}

SessionWatch::SessionWatch(SessionCore* core, absl::Duration backoff_cap)
    : state_(std::make_shared<State>(core, backoff_cap)) {}

SessionWatch::~SessionWatch() { Stop(); }

void SessionWatch::Start() {
  absl::MutexLock lock(&state_->mu);
  state_->OpenLocked();
}

void SessionWatch::Stop() {
  // Under the lock, so that no reaction is between its check of `core` and its use: once
  // this returns, nothing reaches the core. Cancelling on a completion queue runs nothing
  // inline, so it may be done here too.
  absl::MutexLock lock(&state_->mu);
  state_->core = nullptr;
  if (state_->call != nullptr) state_->call->Cancel();
  if (state_->alarm != nullptr) state_->alarm->Cancel();
}

void SessionWatch::Deliver(SessionCore* core, const v1::SessionEvent& event) {
  core->OnWatchEvent(event);
}

void SessionWatch::End(SessionCore* core, const grpc::Status& status) { core->OnWatchEnd(status); }

// ---------------------------------------------------------------------- command stream

std::shared_ptr<const std::function<void(absl::string_view)>> CommandStreamState::PrintToStdout() {
  return std::make_shared<const std::function<void(absl::string_view)>>([](absl::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  });
}

void CommandStreamState::DeliverDeviceOutput(absl::string_view text) {
  if (text.empty()) return;
  std::shared_ptr<const std::function<void(absl::string_view)>> handler;
  {
    absl::MutexLock lock(&mu);
    handler = device_output;
  }
  if (handler != nullptr && *handler) (*handler)(text);
}

// One ExecutionService.CommandStream call on a completion queue of its own (transport.h),
// driven by the threads that wait for it (SessionCore::WaitCommands) and, once replaced or
// closed (Retire), drained by Background. A read is always pending until the stream ends;
// then the call asks for its status.
class CommandCall final : public Drainable {
 public:
  CommandCall(std::shared_ptr<CommandStreamState> state, uint64_t generation)
      : state_(std::move(state)), generation_(generation) {}

  void Begin(const SessionCore& core, v1::ExecutionService::Stub& stub)
      ABSL_LOCKS_EXCLUDED(ops_mu_) {
    // No deadline on the stream itself: it lives as long as the session; each write and each
    // wait for a reply has one (SessionCore::FlushLocked, WaitProcessed).
    core.AddMetadata(&context_);
    // The headers go with the first batch: StartCall then starts no operation (gRPC's
    // stream uses one operation set for both, and a Write before a StartCall has come back
    // would be a second operation of it in flight).
    context_.set_initial_metadata_corked(true);
    absl::MutexLock lock(&ops_mu_);
    stream_ = stub.PrepareAsyncCommandStream(&context_, &queue_);
    stream_->StartCall(kStartTag);
    stream_->Read(&reply_, kReadTag);
  }

  // Starts writing `batch`; one write at a time (the caller waits for write_pending to
  // clear). False when the stream has ended or the call was retired (nothing is written).
  bool Write(std::shared_ptr<v1::CommandBatch> batch) ABSL_LOCKS_EXCLUDED(ops_mu_) {
    absl::MutexLock lock(&ops_mu_);
    if (ended_ || retired_) return false;
    writing_ = std::move(batch);
    stream_->Write(*writing_, kWriteTag);
    return true;
  }

  // Waits at most until `until` for one event of the call and handles it; false when none
  // came (or the queue is drained). The caller holds no lock of the state.
  bool DriveOnce(absl::Time until) ABSL_LOCKS_EXCLUDED(ops_mu_, state_->mu) {
    void* tag = nullptr;
    bool ok = false;
    if (queue_.AsyncNext(&tag, &ok, QueueDeadline(until)) != grpc::CompletionQueue::GOT_EVENT) {
      return false;
    }
    Handle(tag, ok);
    return true;
  }

  // Thread-safe; runs nothing inline.
  void Cancel() { context_.TryCancel(); }

  // Cancels the call for good: no operation starts on it any more, waiters stop driving it,
  // and Background drains it (`self` is this call).
  void Retire(std::shared_ptr<CommandCall> self) ABSL_LOCKS_EXCLUDED(ops_mu_, state_->mu) {
    {
      absl::MutexLock lock(&ops_mu_);
      if (retired_) return;
      retired_ = true;
    }
    context_.TryCancel();
    queue_.Shutdown();
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->drivable.get() == this) state_->drivable.reset();
      if (state_->generation == generation_ && !state_->stream_ended) {
        // Its own end (Finish) is never asked for now: end it here, so that no wait for it
        // lasts.
        state_->stream_ended = true;
        state_->write_pending = false;
        state_->stream_error = absl::UnavailableError(
            "the command stream was given up (a write made no progress within the call "
            "timeout, or the session was closed)");
      }
      state_->cv.SignalAll();
    }
    Background::Get().Abandon(std::move(self));
  }

  grpc::CompletionQueue* drain_queue() override { return &queue_; }
  void OnDrained(void* tag, bool ok) override ABSL_LOCKS_EXCLUDED(ops_mu_, state_->mu) {
    Handle(tag, ok);
  }

 private:
  static inline void* const kStartTag = reinterpret_cast<void*>(1);
  static inline void* const kReadTag = reinterpret_cast<void*>(2);
  static inline void* const kWriteTag = reinterpret_cast<void*>(3);
  static inline void* const kFinishTag = reinterpret_cast<void*>(4);

  void Handle(void* tag, bool ok) ABSL_LOCKS_EXCLUDED(ops_mu_, state_->mu) {
    if (tag == kReadTag) {
      OnRead(ok);
    } else if (tag == kWriteTag) {
      absl::MutexLock lock(&state_->mu);
      if (state_->generation != generation_) return;
      state_->write_pending = false;
      state_->write_ok = ok;
      state_->cv.SignalAll();
    } else if (tag == kFinishTag) {
      absl::MutexLock lock(&state_->mu);
      if (state_->generation != generation_) return;
      state_->stream_ended = true;
      state_->write_pending = false;
      state_->stream_error = status_.ok()
                                 ? absl::FailedPreconditionError("the command stream has ended")
                                 : FromGrpcStatus(status_);
      state_->cv.SignalAll();
    }
    // kStartTag never comes (the headers are corked, see Begin).
  }

  void OnRead(bool ok) ABSL_LOCKS_EXCLUDED(ops_mu_, state_->mu) {
    if (!ok) {
      // The stream ended (or was cancelled): no more writes; its status follows.
      absl::MutexLock lock(&ops_mu_);
      ended_ = true;
      if (!retired_) stream_->Finish(&status_, kFinishTag);
      return;
    }
    // Before the batch counts as answered: the synchronisation that brought the output
    // returns only after its handler ran.
    state_->DeliverDeviceOutput(reply_.device_output());
    {
      absl::MutexLock lock(&state_->mu);
      // A replaced call reads on (it was cancelled) only until its end.
      if (state_->generation == generation_ && reply_.has_error() && state_->first_error.ok()) {
        state_->first_error =
            absl::Status(static_cast<absl::StatusCode>(reply_.error().code()),
                         absl::StrFormat("%s (command #%d)", reply_.error().message(),
                                         reply_.error().sequence()));
      }
      if (state_->generation == generation_ && !state_->unanswered_batches.empty()) {
        state_->processed_through =
            std::max(state_->processed_through, state_->unanswered_batches.front());
        state_->unanswered_batches.pop_front();
      }
      state_->cv.SignalAll();
    }
    absl::MutexLock lock(&ops_mu_);
    if (!retired_) stream_->Read(&reply_, kReadTag);
  }

  const std::shared_ptr<CommandStreamState> state_;
  const uint64_t generation_;
  grpc::CompletionQueue queue_;
  grpc::ClientContext context_;
  v1::CommandReply reply_;
  grpc::Status status_;
  absl::Mutex ops_mu_;  // orders the operations started on stream_
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::CommandBatch, v1::CommandReply>> stream_
      ABSL_GUARDED_BY(ops_mu_);
  bool ended_ ABSL_GUARDED_BY(ops_mu_) = false;    // the read failed: no more writes
  bool retired_ ABSL_GUARDED_BY(ops_mu_) = false;  // the queue is shut down: no more operations
  // Alive until the next write.
  std::shared_ptr<v1::CommandBatch> writing_ ABSL_GUARDED_BY(ops_mu_);
};

// ---------------------------------------------------------------------- SessionCore

SessionCore::SessionCore(std::shared_ptr<grpc::Channel> channel,
                         const v1::OpenSessionResponse& opened, absl::Duration call_timeout)
    : channel_(std::move(channel)),
      id_(opened.session_id()),
      id_string_(std::to_string(opened.session_id())),
      instance_(opened.daemon_instance()),
      device_(opened.device()),
      sessions_(v1::SessionService::NewStub(channel_)),
      memory_(v1::MemoryService::NewStub(channel_)),
      modules_(v1::ModuleService::NewStub(channel_)),
      execution_(v1::ExecutionService::NewStub(channel_)),
      relay_execution_(v1::ExecutionService::NewStub(channel_)),
      commands_(std::make_shared<CommandStreamState>()) {
  set_call_timeout(call_timeout);
  // Re-open a broken watch well within the daemon's grace, so that a short network drop
  // keeps the session.
  const absl::Duration grace = absl::Milliseconds(opened.grace_ms());
  const absl::Duration cap = opened.grace_ms() == 0
                                 ? absl::Seconds(2)
                                 : std::clamp(grace / 4, absl::Milliseconds(100), absl::Seconds(2));
  watch_ = std::make_unique<SessionWatch>(this, cap);
  watch_->Start();
}

SessionCore::~SessionCore() { Close().IgnoreError(); }

absl::Duration SessionCore::call_timeout() const {
  const int64_t ns = call_timeout_ns_.load(std::memory_order_relaxed);
  return ns == kNoTimeout ? absl::InfiniteDuration() : absl::Nanoseconds(ns);
}

void SessionCore::SetDeviceOutputHandler(std::function<void(absl::string_view)> handler) {
  auto shared =
      handler ? std::make_shared<const std::function<void(absl::string_view)>>(std::move(handler))
              : nullptr;
  absl::MutexLock lock(&commands_->mu);
  commands_->device_output = std::move(shared);
}

void SessionCore::DeliverDeviceOutput(absl::string_view output) const {
  commands_->DeliverDeviceOutput(output);
}

void SessionCore::set_call_timeout(absl::Duration timeout) {
  call_timeout_ns_.store(timeout == absl::InfiniteDuration()
                             ? kNoTimeout
                             : absl::ToInt64Nanoseconds(std::max(timeout, absl::ZeroDuration())),
                         std::memory_order_relaxed);
}

void SessionCore::AddMetadata(grpc::ClientContext* context) const {
  context->AddMetadata(kSessionMetadataKey, id_string_);
  if (!instance_.empty()) context->AddMetadata(kInstanceMetadataKey, instance_);
}

absl::Status SessionCore::CheckUsable() const {
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session %d is closed (Session::Close or its destruction); open a new "
                        "session",
                        id_));
  }
  absl::MutexLock lock(&health_mu_);
  return unusable_;
}

v1::SessionState SessionCore::state() const {
  if (closed_) return v1::SESSION_STATE_UNSPECIFIED;
  absl::MutexLock lock(&health_mu_);
  return state_;
}

void SessionCore::OnWatchEvent(const v1::SessionEvent& event) {
  if (event.state() != v1::SESSION_STATE_FAULTED) return;
  absl::MutexLock lock(&health_mu_);
  if (!unusable_.ok()) return;  // the first word stands
  state_ = v1::SESSION_STATE_FAULTED;
  // The daemon's own words for a call on a FAULTED session.
  unusable_ =
      absl::Status(FaultCode(event.fault_code()),
                   absl::StrFormat("session %d is FAULTED: %s; close it and open a new session",
                                   id_, event.fault_cause().substr(0, 4096)));
}

void SessionCore::OnWatchEnd(const grpc::Status& status) {
  absl::MutexLock lock(&health_mu_);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    // Returned as is: e.g. the daemon's "... the daemon restarted ..., open a new session".
    state_ = v1::SESSION_STATE_UNSPECIFIED;
    if (unusable_.ok() || unusable_.code() != absl::StatusCode::kNotFound) {
      unusable_ = FromGrpcStatus(status);
    }
  } else if (status.ok()) {
    state_ = v1::SESSION_STATE_UNSPECIFIED;
    unusable_ = absl::NotFoundError(
        absl::StrFormat("session %d was closed or reclaimed by the daemon (it ended the session's "
                        "WatchSession stream); open a new session",
                        id_));
  }
  // Anything else (a daemon without WatchSession, refused credentials) says nothing about
  // the session; its calls get the daemon's answers.
}

absl::Status SessionCore::EnsureStreamLocked(absl::Time deadline) {
  std::shared_ptr<CommandCall> old;
  if (sending_call() != nullptr) {
    absl::MutexLock lock(&commands_->mu);
    if (!commands_->stream_error_reported) return absl::OkStatus();
    // A reported error ends the stream. Wait (at most until the deadline) for the daemon to
    // end it, so that what it says next (e.g. FAILED_PRECONDITION for a FAULTED session) is
    // what callers see; not for a stream abandoned with a write stuck: that end may never
    // come.
    if (!commands_->abandoned) {
      Background::Busy busy;
      WaitCommands(std::min(deadline, absl::Now() + kCloseTimeout),
                   absl::Condition(commands_.get(), &CommandStreamState::StreamOver));
    }
    old = sending_call();
  }
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  if (old != nullptr) old->Retire(old);  // harmless when it ended; no lock held
  uint64_t generation;
  {
    absl::MutexLock lock(&commands_->mu);
    generation = ++commands_->generation;
    commands_->stream_ended = false;
    commands_->stream_error_reported = false;
    commands_->stream_error = absl::OkStatus();
    commands_->write_pending = false;
    commands_->write_ok = true;
    commands_->abandoned = false;
    commands_->unanswered_batches.clear();
    commands_->processed_through = sent_through_ = next_sequence_;
  }
  auto call = std::make_shared<CommandCall>(commands_, generation);
  call->Begin(*this, *execution_);
  {
    absl::MutexLock lock(&call_mu_);
    call_ = call;
  }
  bool closed;
  {
    absl::MutexLock lock(&commands_->mu);
    closed = commands_->closed;
    if (!closed) commands_->drivable = call;
  }
  if (closed) {
    // Close ran meanwhile (it marks the state closed before it retires call_).
    call->Retire(call);
    return CheckUsable();
  }
  return absl::OkStatus();
}

absl::Status SessionCore::UseExecutionChannel(std::shared_ptr<grpc::Channel> direct) {
  absl::MutexLock lock(&send_mu_);
  {
    absl::MutexLock call_lock(&call_mu_);
    if (call_ != nullptr || next_sequence_ != 0) {
      return absl::FailedPreconditionError(
          "UseDirectChannel: the session's command stream is already open; switch first");
    }
  }
  direct_channel_ = std::move(direct);
  execution_ = v1::ExecutionService::NewStub(direct_channel_);
  return absl::OkStatus();
}

absl::Status SessionCore::Enqueue(v1::Command command) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const absl::Duration timeout = call_timeout();
  const absl::Time deadline = DeadlineAfter(timeout);
  absl::MutexLock lock(&send_mu_);
  if (absl::Status status = EnsureStreamLocked(deadline); !status.ok()) return status;
  command.set_sequence(++next_sequence_);
  batch_bytes_ += command.ByteSizeLong();
  batch_.add_commands()->Swap(&command);
  if (batch_.commands_size() >= kMaxBatchCommands || batch_bytes_ >= kMaxBatchBytes) {
    return FlushLocked(deadline, timeout, "sending queued commands");
  }
  return absl::OkStatus();
}

bool SessionCore::WaitCommands(absl::Time deadline, const absl::Condition& done) {
  for (;;) {
    if (done.Eval()) return true;
    if (deadline != absl::InfiniteFuture() && absl::Now() >= deadline) return false;
    std::shared_ptr<CommandCall> call = commands_->driving ? nullptr : commands_->drivable;
    if (call == nullptr) {
      // Another thread drives the call (it reports every event), or there is none to drive.
      if (deadline == absl::InfiniteFuture()) {
        commands_->cv.Wait(&commands_->mu);
      } else {
        commands_->cv.WaitWithDeadline(&commands_->mu, deadline);
      }
      continue;
    }
    commands_->driving = true;
    commands_->mu.Unlock();
    call->DriveOnce(deadline);
    call.reset();
    commands_->mu.Lock();
    commands_->driving = false;
    commands_->cv.SignalAll();  // a waiter that does not drive may take over
  }
}

absl::Status SessionCore::FlushLocked(absl::Time deadline, absl::Duration timeout,
                                      absl::string_view call) {
  if (batch_.commands_size() == 0) return absl::OkStatus();
  const uint64_t last = batch_.commands(batch_.commands_size() - 1).sequence();
  auto batch = std::make_shared<v1::CommandBatch>();
  batch->Swap(&batch_);
  batch_bytes_ = 0;
  {
    absl::MutexLock lock(&commands_->mu);
    if (commands_->closed) return CheckUsable();
    if (commands_->stream_ended) {
      commands_->stream_error_reported = true;
      return commands_->stream_error;
    }
    commands_->unanswered_batches.push_back(last);
    commands_->write_pending = true;
  }
  Background::Busy busy;
  const std::shared_ptr<CommandCall>& stream = sending_call();
  const bool started = stream->Write(std::move(batch));
  absl::ReleasableMutexLock lock(&commands_->mu);
  if (!started) {
    commands_->write_pending = false;
    commands_->write_ok = false;
  }
  if (!WaitCommands(deadline == absl::InfiniteFuture() ? deadline : deadline + kAbandonMargin,
                    absl::Condition(commands_.get(), &CommandStreamState::WriteDone))) {
    // The daemon takes no bytes (stopped, wedged): give the stream up.
    commands_->stream_error_reported = true;
    commands_->abandoned = true;
    lock.Release();
    stream->Retire(stream);
    return TimeoutError(call, timeout,
                        "the daemon took no commands, so the command stream was cancelled: "
                        "commands enqueued since the last synchronising call may not have run");
  }
  if (commands_->closed) {
    lock.Release();
    return CheckUsable();
  }
  if (commands_->write_pending || !commands_->write_ok) {
    // The call is over: wait for its status (it comes at once once a write failed).
    WaitCommands(std::min(deadline, absl::Now() + kCloseTimeout),
                 absl::Condition(commands_.get(), &CommandStreamState::StreamOver));
    commands_->stream_error_reported = true;
    if (!commands_->stream_ended) {
      return absl::UnavailableError(
          absl::StrCat(call, ": the command stream broke and did not say why"));
    }
    return commands_->stream_error;
  }
  sent_through_ = last;
  return absl::OkStatus();
}

absl::Status SessionCore::Flush() {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  absl::MutexLock lock(&send_mu_);
  if (sending_call() == nullptr) return absl::OkStatus();
  const absl::Duration timeout = call_timeout();
  return FlushLocked(DeadlineAfter(timeout), timeout, "Session::Flush");
}

absl::Status SessionCore::WaitProcessed(uint64_t sequence, absl::Time deadline,
                                        absl::Duration timeout, absl::string_view call) {
  Background::Busy busy;
  absl::ReleasableMutexLock lock(&commands_->mu);
  auto processed = [this, sequence]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commands_->mu) {
    return commands_->processed_through >= sequence || commands_->StreamOver();
  };
  if (!WaitCommands(deadline, absl::Condition(&processed))) {
    return TimeoutError(call, timeout,
                        "a deadline does not cancel the GPU work: it goes on, and a later "
                        "synchronising call waits for it");
  }
  if (commands_->processed_through >= sequence) return absl::OkStatus();
  if (commands_->closed) {
    lock.Release();
    return CheckUsable();
  }
  commands_->stream_error_reported = true;
  return commands_->stream_error;
}

absl::Status SessionCore::Barrier(absl::Duration timeout) {
  const absl::Time deadline = DeadlineAfter(timeout);
  uint64_t target;
  {
    absl::MutexLock lock(&send_mu_);
    if (sending_call() == nullptr) return absl::OkStatus();
    {
      // A stream whose end was already reported orders nothing any more; the unary call
      // that follows gets the daemon's own answer.
      absl::MutexLock state_lock(&commands_->mu);
      if ((commands_->stream_ended || commands_->abandoned) && commands_->stream_error_reported &&
          batch_.commands_size() == 0) {
        return absl::OkStatus();
      }
    }
    if (absl::Status status = FlushLocked(deadline, timeout, "sending queued commands");
        !status.ok()) {
      return status;
    }
    target = sent_through_;
  }
  return WaitProcessed(target, deadline, timeout, "waiting for the queued commands");
}

absl::Status SessionCore::Sync(uint64_t stream_id, bool whole_session, absl::Duration timeout,
                               absl::string_view call, uint64_t event_id) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const absl::Time deadline = DeadlineAfter(timeout);
  v1::Command command;
  command.mutable_sync()->set_stream_id(stream_id);
  command.mutable_sync()->set_whole_session(whole_session);
  command.mutable_sync()->set_event_id(event_id);
  uint64_t target;
  {
    absl::MutexLock lock(&send_mu_);
    if (absl::Status status = EnsureStreamLocked(deadline); !status.ok()) return status;
    command.set_sequence(++next_sequence_);
    batch_.add_commands()->Swap(&command);
    if (absl::Status status = FlushLocked(deadline, timeout, call); !status.ok()) return status;
    target = sent_through_;
  }
  absl::Status waited = WaitProcessed(target, deadline, timeout, call);
  absl::MutexLock lock(&commands_->mu);
  if (commands_->processed_through < target && !commands_->stream_ended) {
    // The deadline passed first (or the session closed): the sync marker is still queued,
    // and its answer (and any error before it) is for a later synchronising call.
    return waited;
  }
  absl::Status error = TakeCommandErrorLocked();
  // The command's own error (e.g. the fault, with its sequence number) says more than the
  // stream's end.
  return error.ok() ? waited : error;
}

absl::Status SessionCore::TakeCommandErrorLocked() {
  // A fault ends the stream: once said here, the next command starts a new one.
  if (commands_->stream_ended || IsStickyFault(commands_->first_error)) {
    commands_->stream_error_reported = true;
  }
  return std::exchange(commands_->first_error, absl::OkStatus());
}

absl::Status SessionCore::TakeCommandError() {
  absl::MutexLock lock(&commands_->mu);
  return TakeCommandErrorLocked();
}

absl::Status SessionCore::Close() {
  if (closed_.exchange(true)) return absl::OkStatus();
  if (watch_ != nullptr) watch_->Stop();
  {
    // Wakes every caller waiting on the command stream (a write stuck behind a stopped
    // daemon included).
    absl::MutexLock lock(&commands_->mu);
    commands_->closed = true;
    commands_->cv.SignalAll();
  }
  std::shared_ptr<CommandCall> call;
  {
    absl::MutexLock lock(&call_mu_);
    call = call_;
  }
  // The call ends on the background thread (at once, or once a stuck write ends); it holds
  // only what it shares with this object through commands_.
  if (call != nullptr) call->Retire(call);
  const absl::Duration timeout = std::min(call_timeout(), kCloseTimeout);
  v1::CloseSessionResponse response;
  return RunUnary(
      "CloseSession",
      [this](grpc::ClientContext* context, const v1::CloseSessionRequest& request,
             grpc::CompletionQueue* queue) {
        return sessions_->PrepareAsyncCloseSession(context, request, queue);
      },
      v1::CloseSessionRequest(), &response, timeout,
      [this](grpc::ClientContext* context) { AddMetadata(context); });
}

}  // namespace gpurpc::internal
