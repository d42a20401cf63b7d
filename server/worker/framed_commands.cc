#include "server/worker/framed_commands.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gpurpc/internal/v1/worker_control.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "grpcpp/support/slice.h"
#include "server/worker/raw_messages.h"
#include "spdlog/spdlog.h"

namespace gpurpc::worker {
namespace {

// A message is read in pieces of at most this many bytes (into a scratch buffer of the
// channel, then appended: a client that trickles bytes costs a copy of what it sent, not a
// fill of a whole piece per byte).
constexpr size_t kReadPieceBytes = 1 << 20;

// Appends exactly `size` bytes read from `fd` to `out`, through `scratch`. CANCELLED "closed"
// when the client closed its end before the first byte of them, UNAVAILABLE for a short
// message or an error.
absl::Status ReadExactly(int fd, size_t size, std::vector<char>* scratch, std::string* out) {
  size_t read_so_far = 0;
  while (read_so_far < size) {
    const size_t want = std::min(size - read_so_far, scratch->size());
    const ssize_t n = recv(fd, scratch->data(), want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      if (n == 0 && read_so_far == 0) return absl::CancelledError("closed");
      return absl::UnavailableError(n == 0 ? std::string("the client closed mid-message")
                                           : absl::StrCat("recv: ", std::strerror(error)));
    }
    out->append(scratch->data(), static_cast<size_t>(n));
    read_so_far += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Frames `message` (length prefix, with `flags` or'ed in, then the message) and sends it.
absl::Status SendFrame(int fd, const google::protobuf::MessageLite& message, uint32_t flags = 0) {
  std::string frame(kFrameHeaderBytes, '\0');
  message.AppendToString(&frame);
  const uint32_t prefix = static_cast<uint32_t>(frame.size() - kFrameHeaderBytes) | flags;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    frame[i] = static_cast<char>((prefix >> (8 * i)) & 0xff);
  }
  return WriteAll(fd, frame);
}

absl::Status SendReply(int fd, const v1::CommandReply& reply) { return SendFrame(fd, reply); }

// How a relayed channel ends (framed_commands.h): the end frame, with the status as
// CommandStream's handler would have sent it (ToGrpcStatus: escaped, at most 4 KiB).
void SendEnd(int fd, const absl::Status& status) {
  const grpc::Status sent = ToGrpcStatus(status);
  v1::CommandError error;
  error.set_code(static_cast<int32_t>(sent.error_code()));
  error.set_message(sent.error_message());
  (void)SendFrame(fd, error, kEndFrameBit);  // the channel ends either way
}

// The end of a channel the client broke: for a direct client one last reply whose `error`
// says what was wrong, for the front end the end frame.
void SendProtocolError(int fd, FramedPeer peer, const absl::Status& status) {
  if (peer == FramedPeer::kFrontEndRelay) return SendEnd(fd, status);
  v1::CommandReply reply;
  reply.mutable_error()->set_code(static_cast<int32_t>(status.code()));
  reply.mutable_error()->set_message(std::string(status.message()));
  (void)SendReply(fd, reply);  // the channel ends either way
}

// Holds bytes taken from a FramedMemory and gives them back when it goes.
class MemoryHold {
 public:
  MemoryHold(FramedMemory* memory, size_t bytes) : memory_(memory), taken_(memory->Take(bytes)) {}
  ~MemoryHold() { memory_->Give(taken_); }
  MemoryHold(const MemoryHold&) = delete;
  MemoryHold& operator=(const MemoryHold&) = delete;

  // Gives back what it holds above `bytes`.
  void ShrinkTo(size_t bytes) {
    if (bytes >= taken_) return;
    memory_->Give(taken_ - bytes);
    taken_ = bytes;
  }

 private:
  FramedMemory* const memory_;
  size_t taken_;
};

void Serve(Session* session, int fd, FramedMemory* memory, FramedPeer peer) {
  const bool relayed = peer == FramedPeer::kFrontEndRelay;
  uint64_t last_sequence = 0;
  uint64_t index = 0;
  std::vector<char> scratch(kReadPieceBytes);
  std::string bytes;
  for (;;) {
    bytes.clear();
    if (absl::Status read = ReadExactly(fd, kFrameHeaderBytes, &scratch, &bytes); !read.ok()) {
      if (read.code() != absl::StatusCode::kCancelled) {
        spdlog::debug("framed command channel: {}", std::string(read.message()));
      } else if (relayed) {
        SendEnd(fd, absl::OkStatus());  // the client half-closed: the stream's clean end
      }
      return;
    }
    ++index;
    uint64_t length = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      length |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    }
    if (length > static_cast<uint64_t>(kMaxMessageBytes)) {
      SendProtocolError(fd, peer,
                        absl::InvalidArgumentError(absl::StrFormat(
                            "framed command channel: message %d announces %d bytes, more "
                            "than the %d bytes a CommandBatch may have",
                            index, length, kMaxMessageBytes)));
      return;
    }
    bytes.clear();
    // The message's bytes and what parsing them may take, taken before a byte is read;
    // once they are read, only what the walk bounds their parse to is kept; all given back
    // once the reply is out (framed_commands.h).
    const google::protobuf::Descriptor& type = *v1::CommandBatch::descriptor();
    const size_t limit = ParsedBytesLimit(static_cast<size_t>(length));
    MemoryHold hold(
        memory, static_cast<size_t>(length) +
                    std::min(limit, ParsedBytesBoundFromSize(type, static_cast<size_t>(length))));
    if (absl::Status read = ReadExactly(fd, static_cast<size_t>(length), &scratch, &bytes);
        !read.ok()) {
      spdlog::debug("framed command channel: message {}: {}", index, std::string(read.message()));
      return;
    }
    const size_t parsed_bound = ParsedBytesBound(type, bytes, limit);
    if (parsed_bound > limit) {
      SendProtocolError(fd, peer, CheckParsedBytes(type, bytes, [&] {
                          return relayed
                                     ? absl::StrFormat("CommandStream message %d", index)
                                     : absl::StrFormat("framed command channel: message %d", index);
                        }));
      return;
    }
    hold.ShrinkTo(static_cast<size_t>(length) + parsed_bound);
    // Messages of this batch only: a large upload's or download's bytes are not kept while
    // the channel idles.
    v1::CommandBatch batch;
    if (!batch.ParseFromString(bytes)) {
      SendProtocolError(
          fd, peer,
          absl::InvalidArgumentError(
              relayed ? NotParsedMessage("/gpurpc.v1.ExecutionService/CommandStream", index,
                                         "gpurpc.v1.CommandBatch")
                      : absl::StrFormat("framed command channel: message %d (%d bytes) is "
                                        "not a gpurpc.v1.CommandBatch",
                                        index, length)));
      return;
    }
    std::string().swap(bytes);
    v1::CommandReply reply;
    const absl::Status status = AnswerBatch(session, batch, &last_sequence, &reply);
    if (!status.ok() && status.code() == absl::StatusCode::kInvalidArgument) {
      SendProtocolError(fd, peer, status);  // sequence numbers: nothing of the batch ran
      return;
    }
    if (!status.ok() && !reply.has_error() && !relayed) {
      reply.mutable_error()->set_code(static_cast<int32_t>(status.code()));
      reply.mutable_error()->set_message(std::string(status.message()));
    }
    if (absl::Status sent = SendReply(fd, reply); !sent.ok()) {
      spdlog::debug("framed command channel: {}", std::string(sent.message()));
      return;
    }
    if (!status.ok()) {
      // A sticky fault ends the stream, as on CommandStream.
      if (relayed) SendEnd(fd, status);
      return;
    }
  }
}

// Reads exactly `size` bytes from `fd` into `to`. CANCELLED "closed" when the peer closed its
// end before the first of them, UNAVAILABLE for a short read or an error.
absl::Status RecvExactly(int fd, char* to, size_t size) {
  size_t read_so_far = 0;
  while (read_so_far < size) {
    const ssize_t n = recv(fd, to + read_so_far, size - read_so_far, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      if (n == 0 && read_so_far == 0) return absl::CancelledError("closed");
      return absl::UnavailableError(n == 0 ? std::string("the front end closed mid-message")
                                           : absl::StrCat("recv: ", std::strerror(error)));
    }
    read_so_far += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// A front end's framed transfer channel as the handler's RawMessages: each frame is one of the
// client's messages, read into memory taken from the worker's FramedMemory first (its length
// and what parsing it may take, as Serve takes them; held until the handler asks for the next
// message), and checked against the parse bound of the method's request type before the
// handler sees it; each message the handler writes goes back as one frame. Once a message was
// refused, or the channel broke mid-message, nothing more goes either way: the handler's
// answer to the "missing" message (an UploadResponse when every announced byte had arrived)
// is not sent, and the call ends with error(), as on the gRPC relay, where the front end
// refuses the message before the worker sees it.
class FramedMessages final : public RawMessages {
 public:
  FramedMessages(int fd, FramedMemory* memory, const char* method,
                 const google::protobuf::Descriptor& type)
      : fd_(fd), memory_(memory), method_(method), type_(type) {}

  bool Read(grpc::ByteBuffer* message) override { return ReadMessage(message, /*check=*/true); }

  // The same, but a message over its parse bound is kept, not refused: request_error() says
  // so, naming it as the call's one request, for a caller that first checks that no other
  // message follows (as the gRPC relay does).
  bool ReadRequest(grpc::ByteBuffer* message) { return ReadMessage(message, /*check=*/false); }
  const absl::Status& request_error() const { return request_error_; }

  bool Write(const grpc::ByteBuffer& message) override {
    if (!error_.ok()) return false;
    std::vector<grpc::Slice> slices;
    if (!message.Dump(&slices).ok()) return false;
    size_t length = 0;
    for (const grpc::Slice& slice : slices) length += slice.size();
    char header[kFrameHeaderBytes];
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    }
    std::vector<iovec> pieces;
    pieces.reserve(slices.size() + 1);
    pieces.push_back({header, kFrameHeaderBytes});
    for (const grpc::Slice& slice : slices) {
      if (slice.size() > 0) {
        pieces.push_back({const_cast<uint8_t*>(slice.begin()), slice.size()});
      }
    }
    return SendPieces(pieces);
  }

  // After the last message the handler read: true when the client half-closed there; false
  // when another message follows (its bytes are not read) or the channel broke.
  bool NothingFollows() {
    char header[kFrameHeaderBytes];
    const absl::Status read = RecvExactly(fd_, header, kFrameHeaderBytes);
    ended_ = true;
    return read.code() == absl::StatusCode::kCancelled;
  }

  // What went wrong with the client's bytes or the channel, OK when nothing did: it ends the
  // call, whatever the handler made of the missing message.
  const absl::Status& error() const { return error_; }

 private:
  bool ReadMessage(grpc::ByteBuffer* message, bool check) {
    if (ended_ || !error_.ok()) return false;
    char header[kFrameHeaderBytes];
    if (absl::Status read = RecvExactly(fd_, header, kFrameHeaderBytes); !read.ok()) {
      if (read.code() != absl::StatusCode::kCancelled) {
        error_ = absl::UnavailableError(absl::StrFormat("%s: the front end's channel broke: %s",
                                                        method_, std::string(read.message())));
        return false;
      }
      // Closed between messages: the client half-closed (or left, and then nobody reads what
      // the handler says).
      ended_ = true;
      return false;
    }
    ++index_;
    uint64_t length = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      length |= static_cast<uint64_t>(static_cast<uint8_t>(header[i])) << (8 * i);
    }
    if (length > static_cast<uint64_t>(kMaxMessageBytes)) {
      error_ = absl::InvalidArgumentError(
          absl::StrFormat("%s: message %d announces %d bytes, more than the %d a message may have",
                          method_, index_, length, kMaxMessageBytes));
      return false;
    }
    // The handler is done with the message before (it asks for the next one into the same
    // buffer): it goes, and its memory comes back, before this one's is taken, so that no
    // channel waits for memory while it holds some (framed_commands.h). Taken: the bytes and
    // what parsing them may take as far as their number tells; once they are read, only what
    // the walk bounds their parse to is kept.
    message->Clear();
    held_.reset();
    const size_t size = static_cast<size_t>(length);
    const size_t limit = ParsedBytesLimit(size);
    auto hold = std::make_unique<MemoryHold>(
        memory_, size + std::min(limit, ParsedBytesBoundFromSize(type_, size)));
    std::unique_ptr<char[]> bytes(new char[size > 0 ? size : 1]);
    if (absl::Status read = RecvExactly(fd_, bytes.get(), size); !read.ok()) {
      error_ = absl::UnavailableError(
          absl::StrFormat("%s: the front end's channel broke in message %d: %s", method_, index_,
                          std::string(read.message())));
      return false;
    }
    const std::string_view view(bytes.get(), size);
    const size_t parsed_bound = ParsedBytesBound(type_, view, limit);
    if (parsed_bound > limit) {
      absl::Status refused = CheckParsedBytes(type_, view, [&] {
        return check ? absl::StrFormat("%s: message %d of the stream", method_, index_)
                     : absl::StrFormat("%s: the request", method_);
      });
      if (check) {
        error_ = std::move(refused);
        return false;
      }
      request_error_ = std::move(refused);  // the caller refuses it; not parsed before that
    }
    hold->ShrinkTo(size + std::min(parsed_bound, limit));
    char* const raw = bytes.release();
    grpc::Slice slice(
        raw, size, [](void* p) { delete[] static_cast<char*>(p); }, raw);
    *message = grpc::ByteBuffer(&slice, 1);
    held_ = std::move(hold);
    return true;
  }

  bool SendPieces(std::vector<iovec>& pieces) {
    size_t next = 0;
    while (next < pieces.size()) {
      msghdr header{};
      header.msg_iov = pieces.data() + next;
      header.msg_iovlen = std::min<size_t>(pieces.size() - next, IOV_MAX);
      ssize_t sent = sendmsg(fd_, &header, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        spdlog::debug("framed transfer channel: sendmsg: {}", std::strerror(errno));
        return false;
      }
      while (next < pieces.size() && static_cast<size_t>(sent) >= pieces[next].iov_len) {
        sent -= static_cast<ssize_t>(pieces[next].iov_len);
        ++next;
      }
      if (sent > 0) {
        pieces[next].iov_base = static_cast<char*>(pieces[next].iov_base) + sent;
        pieces[next].iov_len -= static_cast<size_t>(sent);
      }
    }
    return true;
  }

  const int fd_;
  FramedMemory* const memory_;
  const char* const method_;
  const google::protobuf::Descriptor& type_;
  std::unique_ptr<MemoryHold> held_;  // the last message's memory
  uint64_t index_ = 0;
  bool ended_ = false;
  absl::Status error_;
  absl::Status request_error_;
};

// The first message of a call that takes exactly one, once the client half-closed after it;
// then no more. (The gRPC relay holds such a request until the half-close, so that a call with
// none or more than one is refused before it runs: so is this one.)
class OneRequest final : public RawMessages {
 public:
  OneRequest(FramedMessages* messages, grpc::ByteBuffer request)
      : messages_(messages), request_(std::move(request)) {}
  bool Read(grpc::ByteBuffer* message) override {
    if (taken_) return false;
    taken_ = true;
    *message = std::move(request_);
    return true;
  }
  bool Write(const grpc::ByteBuffer& message) override { return messages_->Write(message); }

 private:
  FramedMessages* const messages_;
  grpc::ByteBuffer request_;
  bool taken_ = false;
};

// The end frame of a transfer: the handler's status, as its gRPC server would send it.
void SendEnd(int fd, const grpc::Status& status) {
  v1::CommandError error;
  error.set_code(static_cast<int32_t>(status.error_code()));
  error.set_message(status.error_message().substr(0, kMaxEndFrameBytes / 2));
  (void)SendFrame(fd, error, kEndFrameBit);  // the channel ends either way
}

grpc::Status ServeTransfer(Session* session, int fd, FramedMemory* memory, bool upload) {
  if (upload) {
    FramedMessages messages(fd, memory, "/gpurpc.v1.MemoryService/UploadStream",
                            *v1::UploadStreamRequest::descriptor());
    grpc::Status status = ServeUploadStream(session, &messages);
    return messages.error().ok() ? status : ToGrpcStatus(messages.error());
  }
  static constexpr char kMethod[] = "/gpurpc.v1.MemoryService/DownloadStream";
  FramedMessages messages(fd, memory, kMethod, *v1::DownloadRequest::descriptor());
  grpc::ByteBuffer request;
  // As the gRPC relay: exactly one request first, then its parse bound.
  const bool one = messages.ReadRequest(&request);
  if (!messages.error().ok()) return ToGrpcStatus(messages.error());
  const bool more = one && !messages.NothingFollows();
  if (!one || more) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrFormat("%s takes exactly one request message; this call sent %s",
                                        kMethod, one ? "more" : "none"));
  }
  if (!messages.request_error().ok()) return ToGrpcStatus(messages.request_error());
  OneRequest single(&messages, std::move(request));
  return ServeDownloadStream(session, &single);
}

}  // namespace

absl::Status AnswerBatch(Session* session, const v1::CommandBatch& batch, uint64_t* last_sequence,
                         v1::CommandReply* reply) {
  absl::Status status = session->RunBatch(batch, last_sequence, reply);
  if (!status.ok() && status.code() == absl::StatusCode::kInvalidArgument) return status;
  // A batch that synchronised carries the device printf output captured by then.
  for (const v1::Command& command : batch.commands()) {
    if (command.has_sync()) {
      reply->set_device_output(session->TakeDeviceOutput());
      break;
    }
  }
  return status;
}

size_t FramedMemory::Take(size_t bytes) {
  const size_t want = Clamp(bytes);
  absl::MutexLock lock(&mu_);
  struct Room {
    const size_t* free;
    size_t want;
    bool operator()() const { return *free >= want; }
  };
  const Room room{&free_, want};
  mu_.Await(absl::Condition(&room));
  free_ -= want;
  return want;
}

void FramedMemory::Give(size_t bytes) {
  absl::MutexLock lock(&mu_);
  free_ += bytes;
}

size_t FramedMemory::free() const {
  absl::MutexLock lock(&mu_);
  return free_;
}

void RefuseRelayedChannel(int fd, const absl::Status& status) {
  SendEnd(fd, status);  // a few KiB at most: a fresh socket's buffer takes it at once
}

void ServeRelayedUnaryCalls(const RelayedUnaryCalls& calls, int fd) {
  std::vector<char> scratch(kReadPieceBytes);
  std::string bytes;
  for (;;) {
    bytes.clear();
    if (absl::Status read = ReadExactly(fd, kFrameHeaderBytes, &scratch, &bytes); !read.ok()) {
      if (read.code() != absl::StatusCode::kCancelled) {
        spdlog::debug("framed unary channel: {}", std::string(read.message()));
      }
      break;
    }
    uint64_t length = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      length |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    }
    constexpr uint64_t kMaxCallBytes = kMaxRelayedRequestBytes + kMaxRelayedMethodBytes + 16;
    if (length > kMaxCallBytes) {
      SendEnd(fd, absl::InvalidArgumentError(absl::StrFormat(
                      "framed unary channel: a call of %d bytes, more than the %d a relayed "
                      "call may have",
                      length, kMaxCallBytes)));
      break;
    }
    bytes.clear();
    if (absl::Status read = ReadExactly(fd, static_cast<size_t>(length), &scratch, &bytes);
        !read.ok()) {
      spdlog::debug("framed unary channel: {}", std::string(read.message()));
      break;
    }
    // Two length-delimited fields of at most kMaxCallBytes: parsing takes no more than that.
    internal::v1::RelayedCall call;
    if (!call.ParseFromString(bytes)) {
      SendEnd(fd,
              absl::InvalidArgumentError(
                  "framed unary channel: a frame that is not a gpurpc.internal.v1.RelayedCall"));
      break;
    }
    internal::v1::RelayedAnswer answer;
    grpc::Status status;
    const RelayedUnaryCalls::Handler* handler = calls.Find(call.method());
    if (handler == nullptr) {
      status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            absl::StrFormat("gpurpcd has no unary method %s",
                                            absl::CHexEscape(call.method().substr(0, 256))));
    } else if (absl::Status size =
                   CheckParsedBytes(*calls.RequestType(call.method()), call.request(),
                                    [&] { return absl::StrCat(call.method(), ": the request"); });
               !size.ok()) {
      status = ToGrpcStatus(size);
    } else {
      status = (*handler)(call.request(), answer.mutable_response());
    }
    if (!status.ok()) answer.clear_response();
    answer.set_code(static_cast<int32_t>(status.error_code()));
    answer.set_message(status.error_message());
    if (absl::Status sent = SendFrame(fd, answer); !sent.ok()) {
      spdlog::debug("framed unary channel: {}", std::string(sent.message()));
      break;
    }
  }
  shutdown(fd, SHUT_RDWR);
}

void ServeFramedCommands(Session* session, int fd, FramedMemory* memory, FramedPeer peer) {
  Serve(session, fd, memory, peer);
  shutdown(fd, SHUT_RDWR);
}

void ServeRelayedTransfer(Session* session, int fd, FramedMemory* memory, FramedPeer peer) {
  SendEnd(fd, ServeTransfer(session, fd, memory, peer == FramedPeer::kFrontEndUpload));
  shutdown(fd, SHUT_RDWR);
}

}  // namespace gpurpc::worker
