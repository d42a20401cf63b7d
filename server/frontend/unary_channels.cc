#include "server/frontend/unary_channels.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/limits.h"
#include "gpurpc/internal/v1/worker_control.pb.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "grpcpp/support/slice.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// The largest end frame (a status) accepted from the worker.
constexpr size_t kMaxEndFrameBytes = 64 << 10;
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

grpc::StatusCode CodeOf(int32_t code) {
  return code >= 0 && code <= grpc::StatusCode::UNAUTHENTICATED
             ? static_cast<grpc::StatusCode>(code)
             : grpc::StatusCode::UNKNOWN;
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

}  // namespace

UnaryChannels::~UnaryChannels() {
  std::vector<std::unique_ptr<Channel>> channels;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    channels.swap(channels_);
    for (const auto& channel : channels) shutdown(channel->fd, SHUT_RDWR);
  }
  for (auto& channel : channels) {
    if (channel->thread.joinable()) {
      if (channel->thread.get_id() == std::this_thread::get_id()) {
        // The channels would be destroyed under their own thread. A call's completion never
        // holds the session's last reference: the proxy's reactor that holds it is deleted
        // on gRPC's threads.
        spdlog::critical("unary relay: a session's channels were closed from one of them");
        std::abort();
      }
      channel->thread.join();
    }
    close(channel->fd);
  }
}

int UnaryChannels::open() const {
  absl::MutexLock lock(&mu_);
  int count = 0;
  for (const auto& channel : channels_) count += channel->broken ? 0 : 1;
  return count;
}

void UnaryChannels::PruneLocked() {
  for (auto it = channels_.begin(); it != channels_.end();) {
    Channel& channel = **it;
    if (!channel.finished.load()) {
      ++it;
      continue;
    }
    channel.thread.join();
    close(channel.fd);
    it = channels_.erase(it);
  }
}

UnaryChannels::Channel* UnaryChannels::TakeLocked() {
  PruneLocked();
  int live = 0;
  for (const auto& channel : channels_) {
    if (channel->broken) continue;
    ++live;
    if (!channel->busy) {
      channel->busy = true;
      return channel.get();
    }
  }
  // Channels whose threads are still ending count too: they are bounded as the live ones.
  if (closing_ || channels_.size() >= static_cast<size_t>(kMaxUnaryChannels)) return nullptr;
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
    raw->thread = std::thread([this, raw] { Loop(raw); });
  } catch (const std::system_error& e) {
    spdlog::warn("cannot start a unary relay thread ({}); relaying by gRPC", e.what());
    close(raw->fd);
    return nullptr;
  }
  channels_.push_back(std::move(channel));
  return raw;
}

bool UnaryChannels::Call(const std::string& method, const grpc::ByteBuffer& request, Done& done) {
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
    absl::MutexLock lock(&mu_);
    channel = TakeLocked();
    if (channel == nullptr) return false;
    channel->done = std::move(done);
  }
  // The channel's socket is empty (its last answer was read whole), and the frame fits its
  // buffer: the send does not wait. A send that fails breaks the channel: its thread then
  // sees the end and answers the call.
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
  return true;
}

void UnaryChannels::Broken(Channel* channel, grpc::Status status) {
  Done done;
  {
    absl::MutexLock lock(&mu_);
    channel->broken = true;
    if (channel->busy) done = std::move(channel->done);
    channel->busy = false;
    channel->done = nullptr;
  }
  if (done) std::move(done)(std::move(status), false, grpc::ByteBuffer());
}

void UnaryChannels::Loop(Channel* channel) {
  const int fd = channel->fd;
  std::string frame;
  for (;;) {
    frame.clear();
    if (std::string error = ReadExactly(fd, kFrameHeaderBytes, &frame); !error.empty()) {
      Broken(channel,
             grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("the session's worker ended the call",
                                       error == "closed" ? "" : absl::StrCat(" (", error, ")"))));
      break;
    }
    uint32_t prefix = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      prefix |= uint32_t{static_cast<uint8_t>(frame[i])} << (8 * i);
    }
    const bool end_frame = (prefix & kEndFrameBit) != 0;
    const size_t length = prefix & ~kEndFrameBit;
    frame.clear();
    std::string error;
    if (length > (end_frame ? kMaxEndFrameBytes : static_cast<size_t>(kMaxMessageBytes))) {
      error = absl::StrFormat("it announced a frame of %d bytes, over the limit", length);
    } else {
      error = ReadExactly(fd, length, &frame);
      if (error == "closed") error = "it closed mid-frame";
    }
    if (!error.empty()) {
      Broken(channel,
             grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("the session's worker ended the call (", error, ")")));
      break;
    }
    grpc::Status status;
    grpc::ByteBuffer response;
    if (end_frame) {
      // The worker refused the channel (it has too many): the call's answer, and the end.
      v1::CommandError refusal;
      if (!refusal.ParseFromString(frame)) {
        Broken(channel, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     "the session's worker ended the call (its end frame does "
                                     "not parse)"));
        break;
      }
      status = grpc::Status(CodeOf(refusal.code()), refusal.message());
    } else {
      internal::v1::RelayedAnswer answer;
      if (!answer.ParseFromString(frame)) {
        Broken(channel, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     "the session's worker ended the call (its answer does not "
                                     "parse)"));
        break;
      }
      std::string().swap(frame);
      status = grpc::Status(CodeOf(answer.code()), answer.message());
      if (status.ok()) response = ToByteBuffer(std::move(*answer.mutable_response()));
    }
    Done done;
    {
      absl::MutexLock lock(&mu_);
      if (!channel->busy) {
        // An answer to no call: the worker does not keep the protocol.
        channel->broken = true;
        error = "an answer to no call";
      } else {
        done = std::move(channel->done);
        channel->done = nullptr;
        // Free for the next call once this one is answered; an end frame ends the channel.
        channel->busy = false;
        if (end_frame) channel->broken = true;
      }
    }
    if (!error.empty()) {
      spdlog::warn("unary relay: the worker sent {}; channel closed", error);
      break;
    }
    std::move(done)(std::move(status), true, std::move(response));
    if (end_frame) break;
  }
  shutdown(fd, SHUT_RDWR);
  channel->finished.store(true);
}

}  // namespace gpurpc::frontend
