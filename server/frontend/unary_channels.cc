#include "server/frontend/unary_channels.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/limits.h"
#include "gpurpc/internal/v1/worker_control.pb.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "grpcpp/support/slice.h"
#include "server/frontend/relay_status.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// An answer is read in pieces of at most this many bytes, so that a length the worker
// announces and never sends holds no more memory than what arrived.
constexpr size_t kReadPieceBytes = 1 << 20;

// Reads exactly `size` bytes into `out` (appended). "" when done; otherwise what went wrong
// ("closed" for a close before the first byte).
std::string ReadExactly(int fd, size_t size, std::string* out) {
  size_t got = 0;
  while (got < size) {
    const size_t want = std::min(size - got, kReadPieceBytes);
    const size_t at = out->size();
    out->resize(at + want);
    const ssize_t n = recv(fd, out->data() + at, want, 0);
    if (n < 0 && errno == EINTR) {
      out->resize(at);
      continue;
    }
    if (n <= 0) {
      const int error = errno;
      out->resize(at);
      if (n == 0) return got == 0 ? "closed" : "it closed mid-frame";
      return absl::StrCat("recv: ", std::strerror(error));
    }
    out->resize(at + static_cast<size_t>(n));
    got += static_cast<size_t>(n);
  }
  return std::string();
}

// A response's bytes handed to gRPC without a copy.
grpc::ByteBuffer ToByteBuffer(std::string bytes) {
  if (bytes.empty()) {
    grpc::Slice empty;
    return grpc::ByteBuffer(&empty, 1);
  }
  auto* owned = new std::string(std::move(bytes));
  grpc::Slice slice(
      owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
  return grpc::ByteBuffer(&slice, 1);
}

// How long no channel is opened after the worker refused one.
constexpr absl::Duration kRefusedBackoff = absl::Seconds(1);

// Calling threads waiting for an answer now, and how many may.
std::atomic<int> waiting_callers{0};
std::atomic<int> max_waiters{
    std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 4, 1, 8)};

// Takes a waiting slot, if one is free.
bool BeginInlineWait() {
  int now = waiting_callers.load();
  while (now < max_waiters.load()) {
    if (waiting_callers.compare_exchange_weak(now, now + 1)) return true;
  }
  return false;
}

// Waits up to `wait` for `fd` to have something to read (or to end). True when it has.
bool WaitReadable(int fd, absl::Duration wait) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(wait);
  for (;;) {
    const auto left = std::max(deadline - std::chrono::steady_clock::now(),
                               std::chrono::steady_clock::duration::zero());
    const timespec timeout = absl::ToTimespec(absl::FromChrono(left));
    pollfd watched{fd, POLLIN, 0};
    const int n = ppoll(&watched, 1, &timeout, nullptr);
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return n != 0;  // timed out; an error is the reader's to see
  }
}

// Whether a whole frame of at most the limits is in `fd`'s socket, so that reading it cannot
// wait.
bool WholeFrameQueued(int fd) {
  unsigned char header[kFrameHeaderBytes];
  if (recv(fd, header, sizeof(header), MSG_PEEK | MSG_DONTWAIT) !=
      static_cast<ssize_t>(sizeof(header))) {
    return false;
  }
  uint32_t prefix = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) prefix |= uint32_t{header[i]} << (8 * i);
  const size_t length = prefix & ~kEndFrameBit;
  if (length >
      ((prefix & kEndFrameBit) != 0 ? kMaxEndFrameBytes : static_cast<size_t>(kMaxMessageBytes))) {
    return false;
  }
  int queued = 0;
  return ioctl(fd, FIONREAD, &queued) == 0 && queued >= 0 &&
         static_cast<size_t>(queued) >= kFrameHeaderBytes + length;
}

// Whether `fd`, a channel with no call in flight, is still as it should be: open, and with
// nothing to read.
bool IdleAndOpen(int fd) {
  char byte;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  if (n > 0) {
    spdlog::warn("unary relay: the worker sent an answer to no call; channel closed");
  } else {
    spdlog::debug("unary relay: an idle channel ended ({}); it is closed",
                  n == 0 ? "closed by the worker" : std::strerror(errno));
  }
  return false;
}

}  // namespace

int UnaryChannels::max_inline_waiters() { return max_waiters.load(); }

void UnaryChannels::set_max_inline_waiters_for_test(int max) { max_waiters.store(max); }

int UnaryChannels::inline_waiters() { return waiting_callers.load(); }

UnaryChannels::Channel::~Channel() {
  if (fd >= 0) close(fd);
}

UnaryChannels::~UnaryChannels() {
  std::vector<std::unique_ptr<Channel>> channels;
  {
    absl::MutexLock lock(&shared_->mu);
    shared_->closing = true;
    channels.swap(shared_->channels);
    for (const auto& channel : channels) {
      shutdown(channel->fd, SHUT_RDWR);
      channel->wake.Signal();
    }
  }
  for (auto& channel : channels) {
    if (!channel->thread.joinable()) continue;
    if (channel->thread.get_id() == std::this_thread::get_id()) {
      // A call's completion dropped the session's last reference on this channel's thread:
      // the thread goes on with the channel, which the shared state keeps until it is gone.
      channel->thread.detach();
      absl::MutexLock lock(&shared_->mu);
      shared_->channels.push_back(std::move(channel));
      continue;
    }
    channel->thread.join();
  }
}

int UnaryChannels::open() const {
  absl::MutexLock lock(&shared_->mu);
  int count = 0;
  for (const auto& channel : shared_->channels) count += channel->broken ? 0 : 1;
  return count;
}

void UnaryChannels::PruneLocked(Shared& shared) {
  for (auto it = shared.channels.begin(); it != shared.channels.end();) {
    Channel& channel = **it;
    if (!channel.finished.load() || !channel.thread.joinable()) {
      ++it;
      continue;
    }
    channel.thread.join();
    it = shared.channels.erase(it);
  }
}

UnaryChannels::Channel* UnaryChannels::TakeLocked() {
  PruneLocked(*shared_);
  for (const auto& channel : shared_->channels) {
    if (channel->broken || channel->busy) continue;
    if (!IdleAndOpen(channel->fd)) {
      BreakLocked(*shared_, channel.get());
      continue;
    }
    channel->busy = true;
    return channel.get();
  }
  // Channels whose threads are still ending count too: they are bounded as the live ones.
  if (shared_->closing || shared_->channels.size() >= static_cast<size_t>(kMaxUnaryChannels) ||
      absl::Now() < shared_->no_channels_until) {
    return nullptr;
  }
  absl::StatusOr<int> fd = open_();
  if (!fd.ok()) {
    spdlog::debug("relaying a unary call by gRPC: {}", std::string(fd.status().message()));
    return nullptr;
  }
  auto channel = std::make_unique<Channel>();
  channel->fd = *fd;
  channel->busy = true;
  Channel* const raw = channel.get();
  try {
    raw->thread = std::thread([shared = shared_, raw] { Loop(shared, raw); });
  } catch (const std::system_error& e) {
    spdlog::warn("cannot start a unary relay thread ({}); relaying by gRPC", e.what());
    return nullptr;  // `channel` closes the fd
  }
  shared_->channels.push_back(std::move(channel));
  return raw;
}

bool UnaryChannels::Call(const std::string& method, const grpc::ByteBuffer& request, Done& done,
                         absl::Duration wait) {
  if (request.Length() > kMaxRelayedRequestBytes || method.size() > kMaxRelayedMethodBytes) {
    return false;
  }
  internal::v1::RelayedCall call;
  call.set_method(method);
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok()) return false;
  std::string* bytes = call.mutable_request();
  bytes->reserve(request.Length());
  for (const grpc::Slice& slice : slices) {
    bytes->append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  std::string frame(kFrameHeaderBytes, '\0');
  call.AppendToString(&frame);
  const uint32_t length = static_cast<uint32_t>(frame.size() - kFrameHeaderBytes);
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  Channel* channel;
  {
    absl::MutexLock lock(&shared_->mu);
    channel = TakeLocked();
    if (channel == nullptr) return false;
    channel->done = std::move(done);
    // Sent under the lock, so that the channel (and its fd) cannot be pruned meanwhile; the
    // send does not wait: the channel's socket is empty (its last answer was read whole) and
    // the frame fits its buffer. A send that fails breaks the channel: its reader then sees
    // the end and answers the call.
    size_t sent = 0;
    while (sent < frame.size()) {
      const ssize_t n =
          send(channel->fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        spdlog::debug("unary relay: send: {}", n < 0 ? std::strerror(errno) : "nothing sent");
        shutdown(channel->fd, SHUT_RDWR);
        break;
      }
      sent += static_cast<size_t>(n);
    }
    if (wait <= absl::ZeroDuration() || shared_->caller_waiting || !BeginInlineWait()) {
      channel->thread_reads = true;
      channel->wake.Signal();
      return true;
    }
    shared_->caller_waiting = true;
  }
  // This thread waits for the answer. Meanwhile nobody else reads the channel, and it stays
  // (it is busy and not broken, so it is neither taken nor pruned); the caller keeps these
  // channels alive.
  std::optional<Frame> answer;
  if (WaitReadable(channel->fd, wait) && WholeFrameQueued(channel->fd)) {
    answer = ReadFrame(*shared_, channel);  // does not wait: the frame is in the socket
  }
  waiting_callers.fetch_sub(1);
  const bool here = answer.has_value() && answer->outcome != Outcome::kBroken;
  {
    absl::MutexLock lock(&shared_->mu);
    shared_->caller_waiting = false;
    if (!here) {
      channel->read_already = std::move(answer);
      channel->thread_reads = true;
      channel->wake.Signal();
      return true;
    }
  }
  // Completes the call here; the channel may be gone once this returns.
  Complete(*shared_, channel, *std::move(answer));
  return true;
}

void UnaryChannels::BreakLocked(Shared& shared, Channel* channel) {
  channel->broken = true;
  channel->wake.Signal();
}

void UnaryChannels::End(Shared& shared, Channel* channel, Outcome outcome, grpc::Status status) {
  Done done;
  {
    absl::MutexLock lock(&shared.mu);
    BreakLocked(shared, channel);
    if (channel->busy) done = std::move(channel->done);
    channel->busy = false;
    channel->thread_reads = false;
    channel->done = nullptr;
    if (outcome == Outcome::kRefused) shared.no_channels_until = absl::Now() + kRefusedBackoff;
  }
  if (done) std::move(done)(outcome, std::move(status), grpc::ByteBuffer());
}

void UnaryChannels::Loop(const std::shared_ptr<Shared>& shared, Channel* channel) {
  for (;;) {
    std::optional<Frame> frame;
    {
      absl::MutexLock lock(&shared->mu);
      while (!channel->thread_reads && !channel->broken && !shared->closing) {
        channel->wake.Wait(&shared->mu);
      }
      // A call handed over is answered even when closing: the shut-down socket ends it.
      if (!channel->thread_reads) break;
      frame = std::move(channel->read_already);
      channel->read_already.reset();
    }
    if (!Complete(*shared, channel,
                  frame.has_value() ? *std::move(frame) : ReadFrame(*shared, channel))) {
      break;
    }
  }
  shutdown(channel->fd, SHUT_RDWR);
  channel->finished.store(true);
}

UnaryChannels::Frame UnaryChannels::ReadFrame(Shared& shared, Channel* channel) {
  const int fd = channel->fd;
  auto broken = [](std::string message) {
    Frame frame;
    frame.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, std::move(message));
    return frame;
  };
  std::string bytes;
  if (std::string error = ReadExactly(fd, kFrameHeaderBytes, &bytes); !error.empty()) {
    return broken(absl::StrCat("the session's worker ended the call",
                               error == "closed" ? "" : absl::StrCat(" (", error, ")")));
  }
  uint32_t prefix = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    prefix |= uint32_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  }
  const bool end_frame = (prefix & kEndFrameBit) != 0;
  const size_t length = prefix & ~kEndFrameBit;
  bytes.clear();
  std::string error;
  if (length > (end_frame ? kMaxEndFrameBytes : static_cast<size_t>(kMaxMessageBytes))) {
    error = absl::StrFormat("it announced a frame of %d bytes, over the limit", length);
  } else {
    error = ReadExactly(fd, length, &bytes);
    if (error == "closed") error = "it closed mid-frame";
  }
  if (!error.empty()) {
    return broken(absl::StrCat("the session's worker ended the call (", error, ")"));
  }
  if (end_frame) {
    // The worker ended the channel: as its first frame, it refused the channel and never
    // read the call (its status says why); later, the call is answered by it.
    v1::CommandError refusal;
    if (!refusal.ParseFromString(bytes)) {
      return broken("the session's worker ended the call (its end frame does not parse)");
    }
    bool first;
    {
      absl::MutexLock lock(&shared.mu);
      first = !channel->answered_once;
    }
    Frame frame;
    frame.outcome = first ? Outcome::kRefused : Outcome::kAnswered;
    frame.status = StatusFromWorker(refusal.code(), refusal.message());
    return frame;
  }
  internal::v1::RelayedAnswer answer;
  if (!answer.ParseFromString(bytes)) {
    return broken("the session's worker ended the call (its answer does not parse)");
  }
  std::string().swap(bytes);
  Frame frame;
  frame.outcome = Outcome::kAnswered;
  frame.status = StatusFromWorker(answer.code(), answer.message());
  if (frame.status.ok()) frame.response = ToByteBuffer(std::move(*answer.mutable_response()));
  frame.ends_channel = false;
  return frame;
}

bool UnaryChannels::Complete(Shared& shared, Channel* channel, Frame frame) {
  if (frame.ends_channel) {
    End(shared, channel, frame.outcome, std::move(frame.status));
    return false;
  }
  Done done;
  {
    absl::MutexLock lock(&shared.mu);
    channel->answered_once = true;
    done = std::move(channel->done);
    channel->done = nullptr;
    // Free for the next call, which may be handed to the thread before this one is done.
    channel->busy = false;
    channel->thread_reads = false;
  }
  std::move(done)(Outcome::kAnswered, std::move(frame.status), std::move(frame.response));
  return true;
}

}  // namespace gpurpc::frontend
