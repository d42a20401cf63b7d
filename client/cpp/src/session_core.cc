#include "client/cpp/src/session_core.h"

#include <algorithm>
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

void KeepCallbackQueueAlive() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed, on purpose (see the header). Its one call fails at once: nothing
    // listens there (a Unix socket path that cannot exist, so nothing goes to the network).
    static auto* const channel = new std::shared_ptr<grpc::Channel>(grpc::CreateChannel(
        "unix:/nonexistent/gpurpc-callback-queue-keeper", grpc::InsecureChannelCredentials()));
    struct Probe {
      grpc::ClientContext context;
      v1::KeepAliveRequest request;
      v1::KeepAliveResponse response;
    };
    auto* probe = new Probe();
    static auto* const stub = v1::SessionService::NewStub(*channel).release();
    // One callback call makes the channel take its reference on the shared queue.
    stub->async()->KeepAlive(&probe->context, &probe->request, &probe->response,
                             [probe](const grpc::Status&) { delete probe; });
  });
}

absl::Time DeadlineAfter(absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return absl::Now() + std::max(timeout, absl::ZeroDuration());
}

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

absl::Status TimeoutError(absl::string_view call, absl::Duration timeout,
                          absl::string_view detail) {
  return absl::DeadlineExceededError(absl::StrCat(
      call, " did not finish within ", absl::FormatDuration(timeout), detail.empty() ? "" : "; ",
      detail,
      " (the call timeout: set it with ConnectOptions::call_timeout, $GPURPC_TIMEOUT or "
      "Session::set_call_timeout)"));
}

absl::Status CallStatus(const grpc::Status& status, absl::string_view call, absl::Duration timeout,
                        absl::Time deadline) {
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && absl::Now() >= deadline) {
    return TimeoutError(call, timeout);
  }
  return FromGrpcStatus(status);
}

// ---------------------------------------------------------------------- DeadlineCanceller

DeadlineCanceller::DeadlineCanceller(grpc::ClientContext* context, absl::Time deadline)
    : state_(std::make_shared<State>()) {
  if (deadline == absl::InfiniteFuture()) return;
  state_->context = context;
  alarm_ = std::make_unique<grpc::Alarm>();
  // The callback runs on gRPC's executor, never inline; the state outlives this object.
  alarm_->Set(absl::ToChronoTime(deadline), [state = state_](bool expired) {
    if (!expired) return;  // cancelled: the step finished in time
    std::lock_guard<std::mutex> lock(state->mu);
    if (state->context == nullptr) return;
    state->fired = true;
    state->context->TryCancel();
  });
}

DeadlineCanceller::~DeadlineCanceller() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->context = nullptr;
  }
  if (alarm_ != nullptr) alarm_->Cancel();
}

bool DeadlineCanceller::fired() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fired;
}

// ---------------------------------------------------------------------- SessionWatch

class SessionWatch::Call : public grpc::ClientReadReactor<v1::SessionEvent> {
 public:
  explicit Call(SessionWatch* watch) : watch_(watch) {}

  // `self` keeps this alive until OnDone.
  void Begin(std::shared_ptr<Call> self) {
    self_ = std::move(self);
    watch_->core_->AddMetadata(&context_);
    // No deadline: the stream is meant to stay open as long as the session is used.
    watch_->core_->sessions().async()->WatchSession(&context_, &request_, this);
    StartRead(&event_);
    StartCall();
  }

  // Thread-safe, also before Begin (the call is then cancelled as it starts).
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    watch_->OnEvent(event_);
    StartRead(&event_);
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Call> self = std::move(self_);  // released as this returns
    watch_->OnCallDone(status);
  }

 private:
  SessionWatch* const watch_;
  grpc::ClientContext context_;
  v1::WatchSessionRequest request_;
  v1::SessionEvent event_;
  std::shared_ptr<Call> self_;
};

SessionWatch::SessionWatch(SessionCore* core, absl::Duration backoff_cap)
    : core_(core), backoff_cap_(backoff_cap), backoff_(kWatchInitialBackoff) {}

SessionWatch::~SessionWatch() { Stop(); }

void SessionWatch::Start() { Open(); }

void SessionWatch::Open() {
  std::shared_ptr<Call> call = std::make_shared<Call>(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || call_ != nullptr) return;
    call_ = call;
  }
  // Outside mu_: gRPC may run the reactions (OnDone of a call that fails at once) inline.
  call->Begin(call);
}

void SessionWatch::OnEvent(const v1::SessionEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    backoff_ = kWatchInitialBackoff;  // the stream works
  }
  // The call is still open (OnDone comes after every OnReadDone), so Stop() has not
  // returned and core_ is alive.
  core_->OnWatchEvent(event);
}

void SessionWatch::OnCallDone(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  call_.reset();
  if (stopping_) {
    idle_cv_.notify_all();
    return;
  }
  switch (status.error_code()) {
    case grpc::StatusCode::OK:                // the session was closed or reclaimed
    case grpc::StatusCode::NOT_FOUND:         // gone (reclaimed, closed, daemon restarted)
    case grpc::StatusCode::UNIMPLEMENTED:     // a daemon without WatchSession
    case grpc::StatusCode::INVALID_ARGUMENT:  // retrying cannot help
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      // Under mu_, so that Stop() cannot return (and core_ go) meanwhile; the core takes
      // only its own health_mu_.
      core_->OnWatchEnd(status);
      idle_cv_.notify_all();
      return;
    default:
      break;  // a broken connection, a daemon restarting, ...: re-open after a backoff
  }
  alarm_ = std::make_shared<grpc::Alarm>();
  alarm_pending_ = true;
  // The callback runs on gRPC's executor, never inline.
  alarm_->Set(absl::ToChronoTime(absl::Now() + backoff_), [this](bool fired) { OnAlarm(fired); });
  backoff_ = std::min(backoff_ * 2, backoff_cap_);
}

void SessionWatch::OnAlarm(bool fired) {
  std::shared_ptr<Call> call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    alarm_pending_ = false;
    if (stopping_ || !fired) {
      idle_cv_.notify_all();
      return;
    }
    // Set before mu_ is released, so that Stop() waits for this call.
    call = std::make_shared<Call>(this);
    call_ = call;
  }
  call->Begin(call);
}

void SessionWatch::Stop() {
  std::shared_ptr<Call> call;
  std::shared_ptr<grpc::Alarm> alarm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    call = call_;
    if (alarm_pending_) alarm = alarm_;
  }
  // Outside mu_: cancelling may run the call's reactions inline.
  if (call != nullptr) call->Cancel();
  if (alarm != nullptr) alarm->Cancel();
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return call_ == nullptr && !alarm_pending_; });
}

// ---------------------------------------------------------------------- command stream

// What the replies and the end of the command stream tell, shared by SessionCore and its
// CommandCalls (an abandoned call may outlive the session).
struct CommandStreamState {
  std::mutex mu;
  std::condition_variable cv;
  // The current call's; the callbacks of an earlier call (cancelled and replaced) change
  // nothing.
  uint64_t generation = 0;
  // The last sequence of each batch sent and not yet answered: the worker answers every
  // batch with exactly one reply, in order, also when an error skipped its tail.
  std::deque<uint64_t> unanswered_batches;
  uint64_t processed_through = 0;
  absl::Status first_error;   // first failed command since the last sync
  absl::Status stream_error;  // the stream ended with this
  bool stream_ended = false;
  bool stream_error_reported = false;  // then the next command opens a new stream
  bool write_pending = false;          // a batch is being written
  bool write_ok = true;                // how the last write ended
  bool abandoned = false;              // the call was cancelled with a write stuck
  bool closed = false;                 // the session is closed: waiters return
};

// One ExecutionService.CommandStream call on gRPC's callback API. Alive until OnDone (self_).
// A read is always pending until the stream ends; a hold keeps OnDone away until then, so
// that Write (StartWrite) never races with OnDone.
class CommandCall : public grpc::ClientBidiReactor<v1::CommandBatch, v1::CommandReply> {
 public:
  CommandCall(std::shared_ptr<CommandStreamState> state, uint64_t generation)
      : state_(std::move(state)), generation_(generation) {}

  void Begin(const SessionCore& core, v1::ExecutionService::Stub& stub,
             std::shared_ptr<CommandCall> self) {
    self_ = std::move(self);
    // No deadline on the stream itself: it lives as long as the session; each write and each
    // wait for a reply has one (SessionCore::FlushLocked, WaitProcessed).
    core.AddMetadata(&context_);
    stub.async()->CommandStream(&context_, this);
    AddHold();
    StartRead(&reply_);
    StartCall();
  }

  // Starts writing `batch`; one write at a time (the caller waits for write_pending to
  // clear). False when the stream has ended (nothing is written). No lock of the state may
  // be held: the reaction may run inline.
  bool Write(std::shared_ptr<v1::CommandBatch> batch) {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (ended_) return false;
    writing_ = std::move(batch);
    StartWrite(writing_.get());
    return true;
  }

  // Thread-safe; no lock may be held (reactions may run inline).
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The stream ended (or was cancelled): no more writes; OnDone follows once the hold
      // is gone. `keep` outlives the lock (OnDone may run inline and drop self_).
      std::shared_ptr<CommandCall> keep = self_;
      std::lock_guard<std::mutex> lock(write_mu_);
      ended_ = true;
      RemoveHold();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(state_->mu);
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
      state_->cv.notify_all();
    }
    StartRead(&reply_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->generation != generation_) return;
    state_->write_pending = false;
    state_->write_ok = ok;
    state_->cv.notify_all();
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<CommandCall> self = std::move(self_);  // released as this returns
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->generation != generation_) return;
    state_->stream_ended = true;
    state_->write_pending = false;
    state_->stream_error = status.ok()
                               ? absl::FailedPreconditionError("the command stream has ended")
                               : FromGrpcStatus(status);
    state_->cv.notify_all();
  }

 private:
  const std::shared_ptr<CommandStreamState> state_;
  const uint64_t generation_;
  grpc::ClientContext context_;
  v1::CommandReply reply_;
  std::mutex write_mu_;
  bool ended_ = false;                         // guarded by write_mu_
  std::shared_ptr<v1::CommandBatch> writing_;  // alive until its write ends
  std::shared_ptr<CommandCall> self_;
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
  std::lock_guard<std::mutex> lock(health_mu_);
  return unusable_;
}

v1::SessionState SessionCore::state() const {
  if (closed_) return v1::SESSION_STATE_UNSPECIFIED;
  std::lock_guard<std::mutex> lock(health_mu_);
  return state_;
}

void SessionCore::OnWatchEvent(const v1::SessionEvent& event) {
  if (event.state() != v1::SESSION_STATE_FAULTED) return;
  std::lock_guard<std::mutex> lock(health_mu_);
  if (!unusable_.ok()) return;  // the first word stands
  state_ = v1::SESSION_STATE_FAULTED;
  // The daemon's own words for a call on a FAULTED session.
  unusable_ =
      absl::Status(FaultCode(event.fault_code()),
                   absl::StrFormat("session %d is FAULTED: %s; close it and open a new session",
                                   id_, event.fault_cause().substr(0, 4096)));
}

void SessionCore::OnWatchEnd(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(health_mu_);
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
  if (call_ != nullptr) {
    std::unique_lock<std::mutex> lock(commands_->mu);
    if (!commands_->stream_error_reported) return absl::OkStatus();
    // A reported error ends the stream. Wait (at most until the deadline) for the daemon to
    // end it, so that what it says next (e.g. FAILED_PRECONDITION for a FAULTED session) is
    // what callers see; not for a stream abandoned with a write stuck: that end may never
    // come.
    if (!commands_->abandoned) {
      commands_->cv.wait_until(lock,
                               absl::ToChronoTime(std::min(deadline, absl::Now() + kCloseTimeout)),
                               [&] { return commands_->stream_ended || commands_->closed; });
    }
    old = call_;
  }
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  if (old != nullptr) old->Cancel();  // harmless when it ended; no lock held
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(commands_->mu);
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
  {
    std::lock_guard<std::mutex> lock(call_mu_);
    call_ = call;
  }
  call->Begin(*this, *execution_, call);
  return absl::OkStatus();
}

absl::Status SessionCore::Enqueue(v1::Command command) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const absl::Duration timeout = call_timeout();
  const absl::Time deadline = DeadlineAfter(timeout);
  std::lock_guard<std::mutex> lock(send_mu_);
  if (absl::Status status = EnsureStreamLocked(deadline); !status.ok()) return status;
  command.set_sequence(++next_sequence_);
  batch_bytes_ += command.ByteSizeLong();
  batch_.add_commands()->Swap(&command);
  if (batch_.commands_size() >= kMaxBatchCommands || batch_bytes_ >= kMaxBatchBytes) {
    return FlushLocked(deadline, timeout, "sending queued commands");
  }
  return absl::OkStatus();
}

absl::Status SessionCore::FlushLocked(absl::Time deadline, absl::Duration timeout,
                                      absl::string_view call) {
  if (batch_.commands_size() == 0) return absl::OkStatus();
  const uint64_t last = batch_.commands(batch_.commands_size() - 1).sequence();
  auto batch = std::make_shared<v1::CommandBatch>();
  batch->Swap(&batch_);
  batch_bytes_ = 0;
  {
    std::lock_guard<std::mutex> lock(commands_->mu);
    if (commands_->closed) return CheckUsable();
    if (commands_->stream_ended) {
      commands_->stream_error_reported = true;
      return commands_->stream_error;
    }
    commands_->unanswered_batches.push_back(last);
    commands_->write_pending = true;
  }
  const bool started = call_->Write(std::move(batch));
  std::unique_lock<std::mutex> lock(commands_->mu);
  if (!started) {
    commands_->write_pending = false;
    commands_->write_ok = false;
  }
  auto written = [&] {
    return !commands_->write_pending || commands_->stream_ended || commands_->closed;
  };
  if (deadline == absl::InfiniteFuture()) {
    commands_->cv.wait(lock, written);
  } else if (!commands_->cv.wait_until(lock, absl::ToChronoTime(deadline + kAbandonMargin),
                                       written)) {
    // The daemon takes no bytes (stopped, wedged): give the stream up.
    commands_->stream_error_reported = true;
    commands_->abandoned = true;
    lock.unlock();
    call_->Cancel();
    return TimeoutError(call, timeout,
                        "the daemon took no commands, so the command stream was cancelled: "
                        "commands enqueued since the last synchronising call may not have run");
  }
  if (commands_->closed) {
    lock.unlock();
    return CheckUsable();
  }
  if (commands_->write_pending || !commands_->write_ok) {
    // The call is over: wait for its status (it comes at once once a write failed).
    commands_->cv.wait_until(lock,
                             absl::ToChronoTime(std::min(deadline, absl::Now() + kCloseTimeout)),
                             [&] { return commands_->stream_ended || commands_->closed; });
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
  std::lock_guard<std::mutex> lock(send_mu_);
  if (call_ == nullptr) return absl::OkStatus();
  const absl::Duration timeout = call_timeout();
  return FlushLocked(DeadlineAfter(timeout), timeout, "Session::Flush");
}

absl::Status SessionCore::WaitProcessed(uint64_t sequence, absl::Time deadline,
                                        absl::Duration timeout, absl::string_view call) {
  std::unique_lock<std::mutex> lock(commands_->mu);
  auto done = [&] {
    return commands_->processed_through >= sequence || commands_->stream_ended || commands_->closed;
  };
  if (deadline == absl::InfiniteFuture()) {
    commands_->cv.wait(lock, done);
  } else if (!commands_->cv.wait_until(lock, absl::ToChronoTime(deadline), done)) {
    return TimeoutError(call, timeout,
                        "a deadline does not cancel the GPU work: it goes on, and a later "
                        "synchronising call waits for it");
  }
  if (commands_->processed_through >= sequence) return absl::OkStatus();
  if (commands_->closed) {
    lock.unlock();
    return CheckUsable();
  }
  commands_->stream_error_reported = true;
  return commands_->stream_error;
}

absl::Status SessionCore::Barrier(absl::Duration timeout) {
  const absl::Time deadline = DeadlineAfter(timeout);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (call_ == nullptr) return absl::OkStatus();
    {
      // A stream whose end was already reported orders nothing any more; the unary call
      // that follows gets the daemon's own answer.
      std::lock_guard<std::mutex> state_lock(commands_->mu);
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
                               absl::string_view call) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const absl::Time deadline = DeadlineAfter(timeout);
  v1::Command command;
  command.mutable_sync()->set_stream_id(stream_id);
  command.mutable_sync()->set_whole_session(whole_session);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (absl::Status status = EnsureStreamLocked(deadline); !status.ok()) return status;
    command.set_sequence(++next_sequence_);
    batch_.add_commands()->Swap(&command);
    if (absl::Status status = FlushLocked(deadline, timeout, call); !status.ok()) return status;
    target = sent_through_;
  }
  absl::Status waited = WaitProcessed(target, deadline, timeout, call);
  std::lock_guard<std::mutex> lock(commands_->mu);
  if (commands_->processed_through < target && !commands_->stream_ended) {
    // The deadline passed first (or the session closed): the sync marker is still queued,
    // and its answer (and any error before it) is for a later synchronising call.
    return waited;
  }
  // A fault ends the stream: once said here, the next command starts a new one.
  if (commands_->stream_ended || commands_->first_error.code() == absl::StatusCode::kAborted ||
      commands_->first_error.code() == absl::StatusCode::kDataLoss) {
    commands_->stream_error_reported = true;
  }
  if (!commands_->first_error.ok()) {
    // The command's own error (e.g. the fault, with its sequence number) says more than
    // the stream's end.
    absl::Status error = std::move(commands_->first_error);
    commands_->first_error = absl::OkStatus();
    return error;
  }
  return waited;
}

absl::Status SessionCore::Close() {
  if (closed_.exchange(true)) return absl::OkStatus();
  if (watch_ != nullptr) watch_->Stop();
  {
    // Wakes every caller waiting on the command stream (a write stuck behind a stopped
    // daemon included).
    std::lock_guard<std::mutex> lock(commands_->mu);
    commands_->closed = true;
    commands_->cv.notify_all();
  }
  std::shared_ptr<CommandCall> call;
  {
    std::lock_guard<std::mutex> lock(call_mu_);
    call = call_;
  }
  // The call ends on its own (at once, or once a stuck write ends); it holds only what it
  // shares with this object through commands_.
  if (call != nullptr) call->Cancel();
  const absl::Duration timeout = std::min(call_timeout(), kCloseTimeout);
  v1::CloseSessionResponse response;
  return RunUnary(
      "CloseSession",
      [this](grpc::ClientContext* context, const v1::CloseSessionRequest* request,
             v1::CloseSessionResponse* out, std::function<void(grpc::Status)> done) {
        sessions_->async()->CloseSession(context, request, out, std::move(done));
      },
      v1::CloseSessionRequest(), &response, timeout,
      [this](grpc::ClientContext* context) { AddMetadata(context); });
}

}  // namespace gpurpc::internal
