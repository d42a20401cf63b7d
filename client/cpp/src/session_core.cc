#include "client/cpp/src/session_core.h"

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

}  // namespace

SessionCore::SessionCore(std::shared_ptr<grpc::Channel> channel, uint64_t id,
                         v1::DeviceInfo device, uint64_t idle_timeout_ms)
    : channel_(std::move(channel)),
      id_(id),
      id_string_(std::to_string(id)),
      device_(std::move(device)),
      sessions_(v1::SessionService::NewStub(channel_)),
      memory_(v1::MemoryService::NewStub(channel_)),
      modules_(v1::ModuleService::NewStub(channel_)),
      execution_(v1::ExecutionService::NewStub(channel_)) {
  const auto interval = std::chrono::milliseconds(std::max<uint64_t>(idle_timeout_ms / 3, 50));
  keepalive_ = std::thread([this, interval] { KeepAliveLoop(interval); });
}

SessionCore::~SessionCore() { Close().IgnoreError(); }

void SessionCore::Prepare(grpc::ClientContext* context) const {
  context->AddMetadata(kSessionMetadataKey, id_string_);
}

void SessionCore::KeepAliveLoop(std::chrono::milliseconds interval) {
  std::unique_lock<std::mutex> lock(keepalive_mu_);
  while (!keepalive_cv_.wait_for(lock, interval, [&] { return stop_keepalive_; })) {
    lock.unlock();
    grpc::ClientContext context;
    Prepare(&context);
    context.set_deadline(std::chrono::system_clock::now() + interval);
    v1::KeepAliveResponse response;
    sessions_->KeepAlive(&context, v1::KeepAliveRequest(), &response);
    lock.lock();
  }
}

absl::Status SessionCore::EnsureStreamLocked() {
  if (stream_ != nullptr) {
    std::unique_lock<std::mutex> lock(state_mu_);
    if (!stream_error_reported_) return absl::OkStatus();
    // A reported fault ends the stream: wait for that end before starting over.
    state_cv_.wait(lock, [&] { return stream_ended_; });
  }
  if (closed_) return absl::FailedPreconditionError("the session is closed");
  if (stream_ != nullptr) {
    // The old stream ended and its error was reported: start over, so that what the
    // daemon says now (e.g. FAILED_PRECONDITION for a FAULTED session) is what callers see.
    if (reader_.joinable()) reader_.join();
    stream_.reset();
    std::lock_guard<std::mutex> lock(state_mu_);
    stream_ended_ = false;
    stream_error_reported_ = false;
    stream_error_ = absl::OkStatus();
    unanswered_batches_.clear();
    processed_through_ = sent_through_ = next_sequence_;
  }
  stream_context_ = std::make_unique<grpc::ClientContext>();
  Prepare(stream_context_.get());
  stream_ = execution_->CommandStream(stream_context_.get());
  reader_ = std::thread([this] { ReadReplies(); });
  return absl::OkStatus();
}

void SessionCore::ReadReplies() {
  v1::CommandReply reply;
  while (stream_->Read(&reply)) {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (reply.has_error() && first_error_.ok()) {
      first_error_ = absl::Status(
          static_cast<absl::StatusCode>(reply.error().code()),
          absl::StrFormat("%s (command #%d)", reply.error().message(), reply.error().sequence()));
    }
    if (!unanswered_batches_.empty()) {
      processed_through_ = std::max(processed_through_, unanswered_batches_.front());
      unanswered_batches_.pop_front();
    }
    state_cv_.notify_all();
  }
  grpc::Status status = stream_->Finish();
  std::lock_guard<std::mutex> lock(state_mu_);
  stream_ended_ = true;
  stream_error_ = status.ok() ? absl::FailedPreconditionError("the command stream has ended")
                              : FromGrpcStatus(status);
  state_cv_.notify_all();
}

absl::Status SessionCore::Enqueue(v1::Command command) {
  std::lock_guard<std::mutex> lock(send_mu_);
  if (absl::Status status = EnsureStreamLocked(); !status.ok()) return status;
  command.set_sequence(++next_sequence_);
  batch_bytes_ += command.ByteSizeLong();
  batch_.add_commands()->Swap(&command);
  if (batch_.commands_size() >= kMaxBatchCommands || batch_bytes_ >= kMaxBatchBytes) {
    return FlushLocked();
  }
  return absl::OkStatus();
}

absl::Status SessionCore::FlushLocked() {
  if (batch_.commands_size() == 0) return absl::OkStatus();
  const uint64_t last = batch_.commands(batch_.commands_size() - 1).sequence();
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    unanswered_batches_.push_back(last);
  }
  const bool written = stream_->Write(batch_);
  batch_.Clear();
  batch_bytes_ = 0;
  if (!written) {
    std::unique_lock<std::mutex> lock(state_mu_);
    state_cv_.wait(lock, [&] { return stream_ended_; });
    stream_error_reported_ = true;
    return stream_error_;
  }
  sent_through_ = last;
  return absl::OkStatus();
}

absl::Status SessionCore::Flush() {
  std::lock_guard<std::mutex> lock(send_mu_);
  if (stream_ == nullptr) return absl::OkStatus();
  return FlushLocked();
}

absl::Status SessionCore::WaitProcessed(uint64_t sequence) {
  std::unique_lock<std::mutex> lock(state_mu_);
  state_cv_.wait(lock, [&] { return processed_through_ >= sequence || stream_ended_; });
  if (processed_through_ >= sequence) return absl::OkStatus();
  stream_error_reported_ = true;
  return stream_error_;
}

absl::Status SessionCore::Barrier() {
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (stream_ == nullptr) return absl::OkStatus();
    {
      // A stream whose end was already reported orders nothing any more; the unary call
      // that follows gets the daemon's own answer.
      std::lock_guard<std::mutex> state_lock(state_mu_);
      if (stream_ended_ && stream_error_reported_ && batch_.commands_size() == 0) {
        return absl::OkStatus();
      }
    }
    if (absl::Status status = FlushLocked(); !status.ok()) return status;
    target = sent_through_;
  }
  return WaitProcessed(target);
}

absl::Status SessionCore::Sync(uint64_t stream_id, bool whole_session) {
  v1::Command command;
  command.mutable_sync()->set_stream_id(stream_id);
  command.mutable_sync()->set_whole_session(whole_session);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (absl::Status status = EnsureStreamLocked(); !status.ok()) return status;
    command.set_sequence(++next_sequence_);
    batch_.add_commands()->Swap(&command);
    if (absl::Status status = FlushLocked(); !status.ok()) return status;
    target = sent_through_;
  }
  absl::Status waited = WaitProcessed(target);
  std::lock_guard<std::mutex> lock(state_mu_);
  // A fault ends the stream: once said here, the next command starts a new one.
  if (stream_ended_ || first_error_.code() == absl::StatusCode::kAborted ||
      first_error_.code() == absl::StatusCode::kDataLoss) {
    stream_error_reported_ = true;
  }
  if (!first_error_.ok()) {
    // The command's own error (e.g. the fault, with its sequence number) says more than
    // the stream's end.
    absl::Status error = std::move(first_error_);
    first_error_ = absl::OkStatus();
    return error;
  }
  return waited;
}

absl::Status SessionCore::Close() {
  if (closed_.exchange(true)) return absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(keepalive_mu_);
    stop_keepalive_ = true;
  }
  keepalive_cv_.notify_all();
  if (keepalive_.joinable()) keepalive_.join();
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (stream_ != nullptr) {
      FlushLocked().IgnoreError();
      stream_->WritesDone();
    }
  }
  if (reader_.joinable()) reader_.join();
  grpc::ClientContext context;
  Prepare(&context);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CloseSessionResponse response;
  return FromGrpcStatus(sessions_->CloseSession(&context, v1::CloseSessionRequest(), &response));
}

}  // namespace gpurpc::internal
