#include "client/cpp/src/transport.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/alarm.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace gpurpc::internal {
namespace {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Wakes the background thread out of a poll (an alarm due at once); frees itself when run.
class KickTag final : public Background::Tag {
 public:
  explicit KickTag(std::atomic<bool>* pending) : pending_(pending) {}
  void Arm(grpc::CompletionQueue* queue) {
    alarm_.Set(queue, gpr_now(GPR_CLOCK_MONOTONIC), static_cast<Background::Tag*>(this));
  }
  void Run(bool) override {
    pending_->store(false);
    delete this;
  }

 private:
  std::atomic<bool>* const pending_;
  grpc::Alarm alarm_;
};

}  // namespace

// ---------------------------------------------------------------------- Background

Background& Background::Get() {
  static Background* const background = new Background();  // never destroyed (see header)
  return *background;
}

Background::Background() {
  thread_ = std::thread([this] { Loop(); });
  thread_.detach();  // lives as long as the process (see Get)
}

Background::Busy::Busy() : background_(Background::Get()) {
  background_.busy_.fetch_add(1);
  // Seen after the increment (both sequentially consistent): either the thread sees this call
  // before it polls, or this sees it polling and wakes it.
  if (background_.polling_.load()) background_.Kick();
}

Background::Busy::~Busy() {
  background_.last_busy_ns_.store(SteadyNowNs());
  background_.busy_.fetch_sub(1);
}

void Background::Kick() {
  bool expected = false;
  if (!kick_pending_.compare_exchange_strong(expected, true)) return;
  (new KickTag(&kick_pending_))->Arm(&queue_);
}

void Background::Abandon(std::shared_ptr<Drainable> call) {
  absl::MutexLock lock(&mu_);
  abandoned_.push_back(std::move(call));
}

void Background::RunOne(std::chrono::system_clock::time_point until) {
  void* tag = nullptr;
  bool ok = false;
  if (queue_.AsyncNext(&tag, &ok, until) == grpc::CompletionQueue::GOT_EVENT) {
    static_cast<Tag*>(tag)->Run(ok);
  }
}

void Background::DrainAbandoned() {
  std::vector<std::shared_ptr<Drainable>> calls;
  {
    absl::MutexLock lock(&mu_);
    if (abandoned_.empty()) return;
    calls.swap(abandoned_);
  }
  std::vector<std::shared_ptr<Drainable>> pending;
  const auto now = std::chrono::system_clock::now();
  for (std::shared_ptr<Drainable>& call : calls) {
    grpc::CompletionQueue* queue = call->drain_queue();
    for (;;) {
      void* tag = nullptr;
      bool ok = false;
      const grpc::CompletionQueue::NextStatus next = queue->AsyncNext(&tag, &ok, now);
      if (next == grpc::CompletionQueue::GOT_EVENT) {
        call->OnDrained(tag, ok);
        continue;
      }
      if (next == grpc::CompletionQueue::TIMEOUT) pending.push_back(std::move(call));
      break;  // SHUTDOWN: drained, `call` goes
    }
  }
  absl::MutexLock lock(&mu_);
  abandoned_.insert(abandoned_.end(), std::make_move_iterator(pending.begin()),
                    std::make_move_iterator(pending.end()));
}

void Background::Loop() {
  const int64_t quiet_ns = absl::ToInt64Nanoseconds(kBackgroundQuiet);
  const auto glance = absl::ToChronoNanoseconds(kBackgroundGlance);
  for (;;) {
    DrainAbandoned();
    // While calls are in flight (or were lately), only look at the queue now and then,
    // without waiting in the epoll set that their threads drive.
    const int64_t quiet_for = SteadyNowNs() - last_busy_ns_.load();
    if (busy_.load() != 0 || quiet_for < quiet_ns) {
      RunOne(std::chrono::system_clock::now());
      std::this_thread::sleep_for(
          busy_.load() != 0 ? glance
                            : std::min<std::chrono::nanoseconds>(
                                  glance, std::chrono::nanoseconds(quiet_ns - quiet_for)));
      continue;
    }
    polling_.store(true);
    if (busy_.load() != 0) {  // a call began meanwhile (see Busy)
      polling_.store(false);
      continue;
    }
    // Idle: wait for the watches' events (and the daemon's pings) until a call begins (it
    // kicks) or the next look at the abandoned calls.
    RunOne(std::chrono::system_clock::now() + std::chrono::seconds(1));
    polling_.store(false);
  }
}

// ---------------------------------------------------------------------- helpers

absl::Time DeadlineAfter(absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return absl::Now() + std::max(timeout, absl::ZeroDuration());
}

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

std::chrono::system_clock::time_point QueueDeadline(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) {
    return std::chrono::system_clock::now() + std::chrono::hours(24 * 365 * 100);
  }
  return absl::ToChronoTime(deadline);
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

// ---------------------------------------------------------------------- RawStreamCall

RawStreamCall::RawStreamCall(const std::shared_ptr<grpc::Channel>& channel,
                             const std::string& method,
                             const std::function<void(grpc::ClientContext*)>& add_metadata)
    : stub_(channel) {
  if (add_metadata) add_metadata(&context_);
  // The headers go with the first message: StartCall then starts no operation (gRPC's stream
  // uses one operation set for both, and a Write before a StartCall has come back would be a
  // second operation of it in flight). So kStart never comes back.
  context_.set_initial_metadata_corked(true);
  stream_ = stub_.PrepareCall(&context_, method, &queue_);
  stream_->StartCall(TagOf(kStart));
}

void RawStreamCall::Write(const grpc::ByteBuffer& message) {
  Started(kWrite);
  stream_->Write(message, TagOf(kWrite));
}

void RawStreamCall::WriteLast(const grpc::ByteBuffer& message) {
  Started(kWrite);
  stream_->WriteLast(message, grpc::WriteOptions(), TagOf(kWrite));
}

void RawStreamCall::WritesDone() {
  Started(kWritesDone);
  stream_->WritesDone(TagOf(kWritesDone));
}

grpc::ByteBuffer* RawStreamCall::Read() {
  grpc::ByteBuffer* message = &received_[next_received_];
  next_received_ ^= 1;
  Started(kRead);
  stream_->Read(message, TagOf(kRead));
  return message;
}

void RawStreamCall::Finish() {
  Started(kFinish);
  stream_->Finish(&status_, TagOf(kFinish));
}

bool RawStreamCall::Await(Op op, absl::Time until, bool* ok) {
  const auto deadline = QueueDeadline(until);
  while (!done_[op]) {
    void* tag = nullptr;
    bool tag_ok = false;
    if (queue_.AsyncNext(&tag, &tag_ok, deadline) != grpc::CompletionQueue::GOT_EVENT) {
      return false;
    }
    const auto finished = static_cast<Op>(reinterpret_cast<intptr_t>(tag) - 1);
    pending_[finished] = false;
    done_[finished] = true;
    ok_[finished] = tag_ok;
  }
  done_[op] = false;
  *ok = ok_[op];
  return true;
}

void RawStreamCall::End(std::shared_ptr<RawStreamCall> call) {
  bool pending = false;
  for (bool p : call->pending_) pending = pending || p;
  if (pending) call->context_.TryCancel();
  call->queue_.Shutdown();
  if (pending) {
    Background::Get().Abandon(std::move(call));
    return;
  }
  void* tag = nullptr;
  bool ok = false;
  while (call->queue_.Next(&tag, &ok)) {
  }  // nothing is pending: returns at once
}

// ---------------------------------------------------------------------- chunks

namespace {

// Buffers of outgoing chunks, handed back by gRPC when the transport has written them.
class ChunkPool {
 public:
  struct Block {
    size_t capacity;
    std::unique_ptr<uint8_t[]> bytes;
  };

  static Block* Take(size_t size) { return Get().TakeBlock(size); }

  // gRPC's destroy callback of a chunk's slice.
  static void Give(void* user_data) { Get().GiveBlock(static_cast<Block*>(user_data)); }

 private:
  static constexpr size_t kUsualBytes = (1u << 20) + 256;
  static constexpr size_t kKeptBlocks = 8;

  // The process's one, never destroyed (gRPC may give a block back while the process exits).
  static ChunkPool& Get() {
    static auto* const pool = new ChunkPool();
    return *pool;
  }

  Block* TakeBlock(size_t size) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < free_blocks_.size(); ++i) {
        if (free_blocks_[i]->capacity >= size) {
          Block* block = free_blocks_[i];
          free_blocks_.erase(free_blocks_.begin() + static_cast<std::ptrdiff_t>(i));
          return block;
        }
      }
    }
    // Room for the usual chunk and its header, so that the block fits the next ones too.
    const size_t capacity = std::max(size, kUsualBytes);
    return new Block{capacity, std::unique_ptr<uint8_t[]>(new uint8_t[capacity])};
  }

  void GiveBlock(Block* block) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (free_blocks_.size() < kKeptBlocks) {
        free_blocks_.push_back(block);
        return;
      }
    }
    delete block;
  }

  absl::Mutex mu_;
  std::vector<Block*> free_blocks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ByteBuffer ChunkMessage(const std::string& header, int field_number, const uint8_t* data,
                              size_t size) {
  using google::protobuf::internal::WireFormatLite;
  using google::protobuf::io::CodedOutputStream;
  const uint32_t tag =
      WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  const size_t total = header.size() + CodedOutputStream::VarintSize32(tag) +
                       CodedOutputStream::VarintSize32(static_cast<uint32_t>(size)) + size;
  ChunkPool::Block* block = ChunkPool::Take(total);
  uint8_t* p = block->bytes.get();
  std::memcpy(p, header.data(), header.size());
  p += header.size();
  p = CodedOutputStream::WriteVarint32ToArray(tag, p);
  p = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(size), p);
  if (size > 0) std::memcpy(p, data, size);
  grpc::Slice slice(block->bytes.get(), total, &ChunkPool::Give, block);
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status CopyChunkField(grpc::ByteBuffer* message, int field_number, absl::Span<uint8_t> out,
                            size_t* copied, absl::string_view what) {
  using google::protobuf::internal::WireFormatLite;
  const size_t length = message->Length();
  grpc::ProtoBufferReader reader(message);
  google::protobuf::io::CodedInputStream in(&reader);
  bool seen = false;
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;  // the end, or a malformed tag (told apart below)
    if (WireFormatLite::GetTagFieldNumber(tag) == field_number &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t size = 0;
      if (seen || !in.ReadVarint32(&size)) break;
      if (size > out.size() - *copied) {
        return absl::InternalError(absl::StrCat(what, ": the daemon sent more bytes than asked"));
      }
      if (!in.ReadRaw(out.data() + *copied, static_cast<int>(size))) break;
      *copied += size;
      seen = true;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      break;
    }
  }
  if (static_cast<size_t>(in.CurrentPosition()) != length) {
    return absl::InternalError(
        absl::StrCat(what, ": a message of the daemon does not parse (", length, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace gpurpc::internal
