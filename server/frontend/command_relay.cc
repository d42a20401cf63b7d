#include "server/frontend/command_relay.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/limits.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/frontend/relay_status.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr char kCommandStreamMethod[] = "/gpurpc.v1.ExecutionService/CommandStream";
constexpr char kUploadStreamMethod[] = "/gpurpc.v1.MemoryService/UploadStream";
constexpr char kDownloadStreamMethod[] = "/gpurpc.v1.MemoryService/DownloadStream";
// The framing (kFrameHeaderBytes, kEndFrameBit, kMaxEndFrameBytes) is common/limits.h's.
// The largest reply accepted from the worker: a message's limit, as on the gRPC relay; on a
// transfer channel, what a DownloadResponse of the largest chunk takes (the worker refuses
// larger chunks), so that a worker cannot make the front end hold 80 MiB frames per transfer.
constexpr size_t kMaxReplyBytes = kMaxMessageBytes;
constexpr size_t kMaxTransferReplyBytes = kMaxTransferChunkBytes + (size_t{64} << 10);
static_assert(kMaxTransferReplyBytes <= kMaxReplyBytes);
// What a send takes at most from a message's pieces at once.
constexpr int kMaxIovecs = 64;

// A received frame's bytes, handed to gRPC without a copy.
struct Frame {
  std::unique_ptr<char[]> bytes;
  size_t size = 0;
};

grpc::ByteBuffer ToByteBuffer(Frame frame) {
  if (frame.size == 0) {
    grpc::Slice empty;
    return grpc::ByteBuffer(&empty, 1);
  }
  char* bytes = frame.bytes.release();
  grpc::Slice slice(
      bytes, frame.size, [](void* p) { delete[] static_cast<char*>(p); }, bytes);
  return grpc::ByteBuffer(&slice, 1);
}

class FramedRelay final : public grpc::ServerGenericBidiReactor {
 public:
  // Relays a call of `method` (a command stream, or one streamed transfer: `kind`, whose
  // relay slot it holds, and which sets the largest frame it takes from the worker). Takes
  // `fd` (our end of the channel, non-blocking) and `wake_fd` (an eventfd).
  FramedRelay(std::shared_ptr<SessionRecord> session, const char* method,
              SessionRecord::RelayKind kind, int fd, int wake_fd,
              FrontendMetrics::RelayCounters counters)
      : session_(std::move(session)),
        method_(method),
        kind_(kind),
        max_reply_bytes_(kind == SessionRecord::RelayKind::kTransfer ? kMaxTransferReplyBytes
                                                                     : kMaxReplyBytes),
        fd_(fd),
        wake_fd_(wake_fd),
        counters_(counters) {}

  // Starts the thread and the first read. Returns false (and the reactor is not started:
  // the caller deletes it) when the thread cannot be started.
  bool Start() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    try {
      thread_ = std::thread([this] { Loop(); });
    } catch (const std::system_error& e) {
      spdlog::warn("session {}: cannot start a framed relay thread ({}); relaying by gRPC",
                   session_->id(), e.what());
      return false;
    }
    // A command stream stays open for the life of a client: it keeps the session alive by its
    // traffic, not by being open (as on the gRPC relay, proxy.cc); a transfer is a call in
    // flight until the worker's side ends.
    if (kind_ == SessionRecord::RelayKind::kTransfer) {
      session_->BeginCall();
    } else {
      session_->Touch();
    }
    StartRead(&from_client_);
    return true;
  }

  ~FramedRelay() override {
    close(fd_);
    close(wake_fd_);
    session_->GiveRelaySlot(kind_);
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    session_->Touch();
    if (worker_done_ || to_worker_broken_) return;  // nothing more goes to the worker
    if (!ok) {
      // The client half-closed (or went away): pass that on once the last message is out.
      client_half_closed_ = true;
      if (!out_pending_) shutdown(fd_, SHUT_WR);
      return;
    }
    if (counters_.to_worker != nullptr) counters_.to_worker->Increment(from_client_.Length());
    PrepareOutLocked();
    if (SendLocked()) {
      AfterSentLocked();
    } else {
      out_pending_ = true;  // the thread sends the rest when the socket takes it
      Wake();
    }
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    server_write_pending_ = false;
    to_client_.Clear();
    if (!ok) {
      ClientGoneLocked();
    } else if (reply_held_) {
      reply_held_ = false;
      to_client_.Swap(&held_);
      held_.Clear();
      server_write_pending_ = true;
      StartWrite(&to_client_);
      Wake();  // the thread reads the worker's next reply
    }
    MaybeFinishLocked();
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ClientGoneLocked();
  }

  void OnDone() override ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    Wake();
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        // gRPC runs a bidi reactor's OnDone on its own threads, never inline in Finish.
        spdlog::critical("framed relay: OnDone ran on the relay's own thread");
        std::abort();
      }
      thread_.join();
    }
    delete this;
  }

 private:
  // The client is gone (cancelled, or a write to it failed): nothing more goes either way.
  // The worker finishes the batch it runs, fails to send its reply and ends the channel, so a
  // batch queued behind it never runs (as on the gRPC relay, whose worker call is cancelled).
  void ClientGoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (client_gone_) return;
    client_gone_ = true;
    reply_held_ = false;
    held_.Clear();
    out_pending_ = false;
    out_pieces_.clear();
    out_slices_.clear();
    shutdown(fd_, SHUT_RDWR);
    Wake();
  }

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // The message in from_client_ becomes the pieces to send: its length prefix, then its slices.
  void PrepareOutLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_slices_.clear();
    out_pieces_.clear();
    (void)from_client_.Dump(&out_slices_);
    from_client_.Clear();
    size_t length = 0;
    for (const grpc::Slice& slice : out_slices_) length += slice.size();
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      out_header_[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    }
    out_pieces_.emplace_back(out_header_, kFrameHeaderBytes);
    for (const grpc::Slice& slice : out_slices_) {
      if (slice.size() > 0) {
        out_pieces_.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
    }
    out_piece_ = 0;
    out_offset_ = 0;
  }

  // Sends what is left of the pieces without waiting. True when they are all out, or when
  // the channel broke (to_worker_broken_: the thread then sees the worker's side end).
  bool SendLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (out_piece_ < out_pieces_.size()) {
      iovec iov[kMaxIovecs];
      int count = 0;
      for (size_t i = out_piece_; i < out_pieces_.size() && count < kMaxIovecs; ++i, ++count) {
        const size_t skip = i == out_piece_ ? out_offset_ : 0;
        iov[count].iov_base = const_cast<char*>(out_pieces_[i].data() + skip);
        iov[count].iov_len = out_pieces_[i].size() - skip;
      }
      msghdr message{};
      message.msg_iov = iov;
      message.msg_iovlen = static_cast<size_t>(count);
      ssize_t sent = sendmsg(fd_, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
        // The worker's side is gone, or the send failed midway: the worker must not wait for
        // the rest of the message, so it is told the channel ended (it then closes it).
        to_worker_broken_ = true;
        shutdown(fd_, SHUT_WR);
        return true;
      }
      while (sent > 0) {
        const size_t left = out_pieces_[out_piece_].size() - out_offset_;
        if (static_cast<size_t>(sent) < left) {
          out_offset_ += static_cast<size_t>(sent);
          break;
        }
        sent -= static_cast<ssize_t>(left);
        ++out_piece_;
        out_offset_ = 0;
      }
    }
    return true;
  }

  // A message is out (or the channel broke): read the next one, or pass on the half-close.
  void AfterSentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_pieces_.clear();
    out_slices_.clear();
    if (to_worker_broken_ || worker_done_) return;
    if (client_half_closed_) {
      shutdown(fd_, SHUT_WR);
    } else {
      StartRead(&from_client_);
    }
  }

  // A reply from the worker: to the client now, or held until the write in progress is done.
  // False when it is held (the thread reads no further reply until then).
  bool DeliverLocked(Frame frame) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    session_->Touch();
    if (client_gone_) return true;  // dropped
    if (counters_.to_client != nullptr) counters_.to_client->Increment(frame.size);
    grpc::ByteBuffer reply = ToByteBuffer(std::move(frame));
    if (!server_write_pending_) {
      to_client_.Swap(&reply);
      server_write_pending_ = true;
      StartWrite(&to_client_);
      return true;
    }
    held_.Swap(&reply);
    reply_held_ = true;
    return false;
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (worker_done_ && !server_write_pending_ && !reply_held_ && !finished_) {
      finished_ = true;
      Finish(final_status_);
    }
  }

  // The thread: sends what the socket did not take at once, and reads the worker's frames.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_) {
    unsigned char header[kFrameHeaderBytes];
    size_t header_read = 0;
    Frame frame;
    size_t body_read = 0;
    bool in_body = false;
    bool end_frame = false;
    for (;;) {
      short events = 0;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        if (out_pending_) events |= POLLOUT;
        if (!reply_held_) events |= POLLIN;
      }
      pollfd fds[2] = {{events != 0 ? fd_ : -1, events, 0}, {wake_fd_, POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return WorkerSideEnded(absl::StrCat("poll: ", std::strerror(errno)));
      }
      if (fds[1].revents != 0) {
        uint64_t count = 0;
        (void)!read(wake_fd_, &count, sizeof(count));
      }
      if ((events & POLLOUT) != 0 && (fds[0].revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
        absl::MutexLock lock(&mu_);
        if (out_pending_ && SendLocked()) {
          out_pending_ = false;
          AfterSentLocked();
        }
      }
      if ((events & POLLIN) == 0 || (fds[0].revents & (POLLIN | POLLERR | POLLHUP)) == 0) {
        continue;
      }
      // Read what is there, frame by frame, until the socket is empty or a reply is held.
      for (;;) {
        ssize_t n;
        if (!in_body) {
          n = recv(fd_, header + header_read, kFrameHeaderBytes - header_read, 0);
        } else {
          n = recv(fd_, frame.bytes.get() + body_read, frame.size - body_read, 0);
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (n <= 0) {
          const bool between_frames = n == 0 && !in_body && header_read == 0;
          return WorkerSideEnded(between_frames ? std::string()
                                 : n == 0       ? std::string("it closed mid-frame")
                                                : absl::StrCat("recv: ", std::strerror(errno)));
        }
        if (!in_body) {
          header_read += static_cast<size_t>(n);
          if (header_read < kFrameHeaderBytes) continue;
          header_read = 0;
          uint32_t prefix = 0;
          for (size_t i = 0; i < kFrameHeaderBytes; ++i) prefix |= uint32_t{header[i]} << (8 * i);
          end_frame = (prefix & kEndFrameBit) != 0;
          const size_t length = prefix & ~kEndFrameBit;
          const size_t limit = end_frame ? kMaxEndFrameBytes : max_reply_bytes_;
          if (length > limit) {
            return WorkerSideEnded(
                absl::StrFormat("it announced a frame of %d bytes, over the limit", length));
          }
          frame.size = length;
          frame.bytes.reset(length > 0 ? new char[length] : nullptr);
          body_read = 0;
          in_body = true;
        } else {
          body_read += static_cast<size_t>(n);
        }
        if (!in_body || body_read < frame.size) continue;
        in_body = false;
        if (end_frame) {
          v1::CommandError error;
          if (!error.ParseFromArray(frame.bytes.get(), static_cast<int>(frame.size))) {
            return WorkerSideEnded("its end frame does not parse");
          }
          grpc::Status end = StatusFromWorker(error.code(), error.message());
          absl::MutexLock lock(&mu_);
          end_status_ = std::move(end);
          has_end_status_ = true;
          continue;  // the socket closes next
        }
        Frame reply = std::exchange(frame, Frame());
        absl::MutexLock lock(&mu_);
        if (!DeliverLocked(std::move(reply))) break;
      }
    }
  }

  // The worker's side ended: closed after its end frame (whose status ends the stream: OK
  // for the clean end after the client half-closed), or broken without one (`broken` says how
  // when it was not a plain close). Decides the stream's status, and finishes once the replies
  // are written.
  void WorkerSideEnded(const std::string& broken) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status status;
    bool answered_by_worker = false;
    bool client_gone = false;
    {
      absl::MutexLock lock(&mu_);
      client_gone = client_gone_;
      if (has_end_status_) {
        status = end_status_;
        answered_by_worker = true;
      } else if (client_gone_) {
        // The worker closed after the client left mid-message: nothing broke.
        status = grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      } else {
        status = grpc::Status(
            grpc::StatusCode::UNAVAILABLE,
            absl::StrCat(
                "the session's worker ended the ",
                kind_ == SessionRecord::RelayKind::kTransfer ? "transfer" : "command stream",
                broken.empty() ? std::string() : absl::StrCat(" (", broken, ")")));
      }
    }
    // Records a fault the worker reported or a worker that ended (as the gRPC relay does,
    // whether or not the client is still there). May wait for a dying worker: unlocked, on
    // this thread.
    status = TranslateWorkerStatus(*session_, method_, status, answered_by_worker);
    if (client_gone) status = grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
    absl::MutexLock lock(&mu_);
    if (kind_ == SessionRecord::RelayKind::kTransfer) {
      session_->EndCall();
    } else {
      session_->Touch();
    }
    worker_done_ = true;
    out_pending_ = false;
    final_status_ = std::move(status);
    MaybeFinishLocked();
  }

  const std::shared_ptr<SessionRecord> session_;
  const char* const method_;
  const SessionRecord::RelayKind kind_;
  // The largest reply frame taken from the worker (kMaxTransferReplyBytes on a transfer
  // channel, else kMaxReplyBytes); an end frame's is kMaxEndFrameBytes.
  const size_t max_reply_bytes_;
  const int fd_;
  const int wake_fd_;
  const FrontendMetrics::RelayCounters counters_;
  std::thread thread_;

  // Guards the relay's state. gRPC's reactions and the thread take it; nothing that waits
  // runs under it (sends do not wait).
  absl::Mutex mu_;
  grpc::ByteBuffer from_client_ ABSL_GUARDED_BY(mu_);
  // The message being sent to the worker: its length prefix and slices, and how far it got.
  char out_header_[kFrameHeaderBytes] ABSL_GUARDED_BY(mu_) = {};
  std::vector<grpc::Slice> out_slices_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::string_view> out_pieces_ ABSL_GUARDED_BY(mu_);
  size_t out_piece_ ABSL_GUARDED_BY(mu_) = 0;
  size_t out_offset_ ABSL_GUARDED_BY(mu_) = 0;
  bool out_pending_ ABSL_GUARDED_BY(mu_) = false;  // the thread sends the rest
  bool to_worker_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool client_half_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer to_client_ ABSL_GUARDED_BY(mu_);  // being written to the client
  grpc::ByteBuffer held_ ABSL_GUARDED_BY(mu_);       // waits for that write
  bool server_write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool reply_held_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);
  bool has_end_status_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

namespace {

grpc::ServerGenericBidiReactor* StartFramedRelay(const std::shared_ptr<SessionRecord>& session,
                                                 const char* method, SessionRecord::RelayKind kind,
                                                 FrontendMetrics* metrics) {
  if (!session->TakeRelaySlot(kind)) return nullptr;
  absl::StatusOr<int> fd =
      kind == SessionRecord::RelayKind::kCommandStream
          ? session->worker().OpenCommandChannel()
          : session->worker().OpenTransferChannel(absl::string_view(method) == kUploadStreamMethod);
  const int wake_fd = fd.ok() ? eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK) : -1;
  if (!fd.ok() || wake_fd < 0) {
    spdlog::debug("session {}: relaying {} by gRPC: {}", session->id(), method,
                  fd.ok() ? absl::StrCat("eventfd: ", std::strerror(errno))
                          : std::string(fd.status().message()));
    if (fd.ok()) close(*fd);
    session->GiveRelaySlot(kind);
    return nullptr;
  }
  fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) | O_NONBLOCK);
  const FrontendMetrics::RelayCounters counters =
      metrics != nullptr ? metrics->Relay(method)
                         : FrontendMetrics::RelayCounters{nullptr, nullptr};
  // The relay owns the fds and the slot from here (its destructor gives them back).
  auto* relay = new FramedRelay(session, method, kind, *fd, wake_fd, counters);
  if (!relay->Start()) {
    delete relay;
    return nullptr;
  }
  return relay;
}

}  // namespace

grpc::ServerGenericBidiReactor* StartFramedCommandRelay(
    const std::shared_ptr<SessionRecord>& session, FrontendMetrics* metrics) {
  return StartFramedRelay(session, kCommandStreamMethod, SessionRecord::RelayKind::kCommandStream,
                          metrics);
}

grpc::ServerGenericBidiReactor* StartFramedTransferRelay(
    const std::shared_ptr<SessionRecord>& session, bool upload, FrontendMetrics* metrics) {
  return StartFramedRelay(session, upload ? kUploadStreamMethod : kDownloadStreamMethod,
                          SessionRecord::RelayKind::kTransfer, metrics);
}

}  // namespace gpurpc::frontend
