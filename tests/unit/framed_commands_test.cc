// The framed command protocol's worker half (server/worker/framed_commands.h) over the fake
// backend, in process, on socketpairs: the memory budget its channels share (a message is
// charged before its bytes are read; one that does not fit waits for the others), and what
// a channel answers; and the front end's framed unary and transfer channels.
#include "server/worker/framed_commands.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gpurpc/internal/v1/worker_control.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gtest/gtest.h"
#include "server/parse_limit.h"
#include "server/worker/backend/backend.h"
#include "server/worker/service.h"
#include "server/worker/session.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::worker {
namespace {

using ::gpurpc::testing::IsOk;

TEST(FramedMemoryTest, TakesAndGivesBack) {
  FramedMemory memory(100);
  memory.Take(60);
  EXPECT_EQ(memory.free(), 40u);
  memory.Take(40);
  EXPECT_EQ(memory.free(), 0u);
  memory.Give(60);
  memory.Give(40);
  EXPECT_EQ(memory.free(), 100u);
  // More than the capacity is the whole capacity, given back whole.
  const size_t taken = memory.Take(1000);
  EXPECT_EQ(taken, 100u);
  EXPECT_EQ(memory.free(), 0u);
  memory.Give(taken);
  EXPECT_EQ(memory.free(), 100u);
}

TEST(FramedMemoryTest, ATakeThatDoesNotFitWaitsForAGive) {
  FramedMemory memory(100);
  memory.Take(70);
  std::atomic<bool> taken{false};
  std::thread waiter([&] {
    memory.Take(50);
    taken = true;
  });
  // It cannot take 50 of the 30 free; it takes them once 70 come back.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(taken.load());
  memory.Give(70);
  waiter.join();
  EXPECT_TRUE(taken.load());
  EXPECT_EQ(memory.free(), 50u);
}

// A session over the fake backend and framed channels served on socketpairs.
class FramedChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = backend::MakeFakeBackend(64ull << 20);
    auto context = backend_->OpenContext(0);
    ASSERT_THAT(context, IsOk());
    session_ = std::make_unique<Session>(std::move(*context), nullptr,
                                         absl::UnavailableError("no NVRTC in this test"));
    auto buffer = session_->Allocate(1 << 20);
    ASSERT_THAT(buffer, IsOk());
    buffer_ = buffer->buffer_id();
  }

  void TearDown() override {
    for (Channel& channel : channels_) {
      if (channel.client >= 0) close(channel.client);
      if (channel.server.joinable()) channel.server.join();
      close(channel.worker);
    }
  }

  struct Channel {
    int client = -1;
    int worker = -1;
    std::thread server;
  };

  // A channel served by ServeFramedCommands on its own thread; returns its index.
  size_t Open(FramedMemory* memory) {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    Channel& channel = channels_.emplace_back();
    channel.client = fds[0];
    channel.worker = fds[1];
    Session* session = session_.get();
    const int worker = fds[1];
    channel.server =
        std::thread([session, worker, memory] { ServeFramedCommands(session, worker, memory); });
    return channels_.size() - 1;
  }

  static std::string Frame(const v1::CommandBatch& batch) {
    return Frame(batch.SerializeAsString());
  }
  static std::string Frame(const std::string& body) {
    std::string frame(kFrameHeaderBytes, '\0');
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      frame[i] = static_cast<char>((body.size() >> (8 * i)) & 0xff);
    }
    return frame + body;
  }

  // A batch with an upload of `bytes` bytes into the buffer, then a sync.
  v1::CommandBatch UploadBatch(size_t bytes, uint64_t first_sequence) const {
    v1::CommandBatch batch;
    v1::Command* upload = batch.add_commands();
    upload->set_sequence(first_sequence);
    upload->mutable_upload()->mutable_destination()->mutable_buffer()->set_buffer_id(buffer_);
    upload->mutable_upload()->set_data(std::string(bytes, 'x'));
    v1::Command* sync = batch.add_commands();
    sync->set_sequence(first_sequence + 1);
    sync->mutable_sync();
    return batch;
  }

  void Send(size_t channel, const std::string& bytes) {
    ASSERT_EQ(send(channels_[channel].client, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }

  // Whether a reply starts to arrive on `channel` within `wait`.
  bool Answered(size_t channel, absl::Duration wait) {
    pollfd entry{channels_[channel].client, POLLIN, 0};
    return poll(&entry, 1, static_cast<int>(absl::ToInt64Milliseconds(wait))) == 1;
  }

  // Reads one reply.
  v1::CommandReply Reply(size_t channel) {
    v1::CommandReply reply;
    std::string header = ReadExactly(channel, kFrameHeaderBytes);
    size_t length = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      length |= static_cast<size_t>(static_cast<uint8_t>(header[i])) << (8 * i);
    }
    EXPECT_TRUE(reply.ParseFromString(ReadExactly(channel, length)));
    return reply;
  }

  std::string ReadExactly(size_t channel, size_t size) {
    std::string out(size, '\0');
    size_t got = 0;
    while (got < size) {
      const ssize_t n = recv(channels_[channel].client, out.data() + got, size - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    EXPECT_EQ(got, size);
    return out;
  }

  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<Session> session_;
  uint64_t buffer_ = 0;
  std::deque<Channel> channels_;
};

TEST_F(FramedChannelTest, AChannelAnswersItsBatchesAndGivesTheMemoryBack) {
  FramedMemory memory(kFramedMemoryBytes);
  const size_t channel = Open(&memory);
  for (uint64_t round = 0; round < 3; ++round) {
    Send(channel, Frame(UploadBatch(4096, 1 + 2 * round)));
    const v1::CommandReply reply = Reply(channel);
    EXPECT_FALSE(reply.has_error()) << reply.error().message();
    EXPECT_EQ(reply.processed_through_sequence(), 2 + 2 * round);
  }
  // Given back once each reply is out.
  for (int i = 0; i < 200 && memory.free() != kFramedMemoryBytes; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(memory.free(), kFramedMemoryBytes);
}

// What a message takes from the memory before its bytes are read: its length, and what
// parsing that many bytes may take (framed_commands.h).
size_t Reserved(size_t body) {
  return body + std::min(ParsedBytesLimit(body),
                         ParsedBytesBoundFromSize(*v1::CommandBatch::descriptor(), body));
}

TEST_F(FramedChannelTest, AMessageThatDoesNotFitWaitsForTheChannelThatHoldsTheMemory) {
  const std::string big = Frame(UploadBatch(64 << 10, 1));
  const std::string small = Frame(UploadBatch(16, 1));
  const size_t big_reserved = Reserved(big.size() - kFrameHeaderBytes);
  const size_t small_reserved = Reserved(small.size() - kFrameHeaderBytes);
  // Room for the big message or the small one, not both.
  const size_t capacity = big_reserved + small_reserved - 1;
  FramedMemory memory(capacity);
  const size_t holder = Open(&memory);
  const size_t waiter = Open(&memory);

  // The holder announces its message and sends half of it: it is charged already.
  Send(holder, big.substr(0, big.size() / 2));
  for (int i = 0; i < 200 && memory.free() != small_reserved - 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(memory.free(), small_reserved - 1);

  // The other channel's whole message waits, unanswered, for that memory.
  Send(waiter, small);
  EXPECT_FALSE(Answered(waiter, absl::Milliseconds(300)));

  // The rest of the big message: it is answered, gives the memory back, and the small one
  // goes on.
  Send(holder, big.substr(big.size() / 2));
  const v1::CommandReply big_reply = Reply(holder);
  EXPECT_FALSE(big_reply.has_error()) << big_reply.error().message();
  const v1::CommandReply small_reply = Reply(waiter);
  EXPECT_FALSE(small_reply.has_error()) << small_reply.error().message();
  EXPECT_EQ(small_reply.processed_through_sequence(), 2u);
  for (int i = 0; i < 200 && memory.free() != capacity; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(memory.free(), capacity);
}

TEST_F(FramedChannelTest, ABatchThatWouldParseTooLargeIsRefusedAndGivesItsMemoryBack) {
  FramedMemory memory(kFramedMemoryBytes);
  const size_t channel = Open(&memory);
  // 2.5 million empty commands: 5 MB on the wire, some 180 MB parsed.
  std::string body;
  for (int i = 0; i < 2'500'000; ++i) body.append("\x0a\x00", 2);
  Send(channel, Frame(body));
  const v1::CommandReply reply = Reply(channel);
  ASSERT_TRUE(reply.has_error());
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(reply.error().message(),
              ::testing::HasSubstr("framed command channel: message 1 (a gpurpc.v1.CommandBatch "
                                   "of 5000000 bytes) would take more than"));
  channels_[channel].server.join();  // the channel ends
  EXPECT_EQ(memory.free(), kFramedMemoryBytes);
}

TEST_F(FramedChannelTest, ALargeBatchKeepsOnlyItsWalkedBound) {
  // 4 MiB of uploads: bounded from its size alone it might take its whole limit,
  // walked it takes little more than its bytes. Two such messages of two channels fit in
  // memory for one and a bit: the second waits only until the first has been read.
  v1::CommandBatch batch = UploadBatch(1 << 20, 1);
  for (uint64_t sequence = 3; sequence <= 5; ++sequence) {
    v1::Command* upload = batch.add_commands();
    *upload = batch.commands(0);
    upload->set_sequence(sequence);
  }
  const std::string big = Frame(batch);
  const size_t body = big.size() - kFrameHeaderBytes;
  ASSERT_EQ(Reserved(body), body + ParsedBytesLimit(body));
  FramedMemory memory(Reserved(body) + 2 * body);
  const size_t first = Open(&memory);
  const size_t second = Open(&memory);
  Send(first, big);
  Send(second, big);
  for (const size_t channel : {first, second}) {
    const v1::CommandReply reply = Reply(channel);
    EXPECT_FALSE(reply.has_error()) << reply.error().message();
  }
  for (int i = 0; i < 200 && memory.free() != Reserved(body) + 2 * body; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(memory.free(), Reserved(body) + 2 * body);
}

TEST_F(FramedChannelTest, AChannelThatEndsMidMessageGivesItsMemoryBack) {
  FramedMemory memory(kFramedMemoryBytes);
  const size_t channel = Open(&memory);
  const std::string big = Frame(UploadBatch(64 << 10, 1));
  Send(channel, big.substr(0, 100));
  for (int i = 0; i < 200 && memory.free() == kFramedMemoryBytes; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(memory.free(), kFramedMemoryBytes);
  close(channels_[channel].client);  // the client goes away mid-message
  channels_[channel].client = -1;
  channels_[channel].server.join();
  EXPECT_EQ(memory.free(), kFramedMemoryBytes);
}

// The front end's framed unary channels (ServeRelayedUnaryCalls): the same session, a
// channel served on a socketpair, frames written and read by hand as a front end would.
class RelayedUnaryTest : public FramedChannelTest {
 protected:
  void SetUp() override {
    FramedChannelTest::SetUp();
    calls_ = std::make_unique<RelayedUnaryCalls>(session_.get());
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    Channel& channel = channels_.emplace_back();
    channel.client = fds[0];
    channel.worker = fds[1];
    const RelayedUnaryCalls* calls = calls_.get();
    const int worker = fds[1];
    channel.server = std::thread([calls, worker] { ServeRelayedUnaryCalls(*calls, worker); });
  }

  void SendCall(const std::string& method, const std::string& request) {
    internal::v1::RelayedCall call;
    call.set_method(method);
    call.set_request(request);
    Send(0, Frame(call.SerializeAsString()));
  }

  // One frame: whether it is an end frame, and its bytes.
  std::pair<bool, std::string> ReadFrame() {
    const std::string header = ReadExactly(0, kFrameHeaderBytes);
    uint32_t prefix = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      prefix |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
    }
    return {(prefix & kEndFrameBit) != 0, ReadExactly(0, prefix & ~kEndFrameBit)};
  }

  internal::v1::RelayedAnswer Answer() {
    auto [end, bytes] = ReadFrame();
    EXPECT_FALSE(end);
    internal::v1::RelayedAnswer answer;
    EXPECT_TRUE(answer.ParseFromString(bytes));
    return answer;
  }

  v1::CommandError End() {
    auto [end, bytes] = ReadFrame();
    EXPECT_TRUE(end);
    v1::CommandError error;
    EXPECT_TRUE(error.ParseFromString(bytes));
    return error;
  }

  // Whether the worker closed the channel (EOF) within a second.
  bool Closed() {
    if (!Answered(0, absl::Seconds(1))) return false;
    char byte;
    return recv(channels_[0].client, &byte, 1, MSG_DONTWAIT) == 0;
  }

  std::unique_ptr<RelayedUnaryCalls> calls_;
};

TEST_F(RelayedUnaryTest, EveryUnaryMethodOfTheSessionServicesHasAHandler) {
  size_t unary = 0;
  for (const char* name : {"gpurpc.v1.MemoryService", "gpurpc.v1.ModuleService",
                           "gpurpc.v1.ExecutionService", "gpurpc.v1.HostRegionService"}) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    ASSERT_NE(service, nullptr) << name;
    for (int i = 0; i < service->method_count(); ++i) {
      const google::protobuf::MethodDescriptor* method = service->method(i);
      if (method->client_streaming() || method->server_streaming()) continue;
      ++unary;
      const std::string path = absl::StrCat("/", name, "/", method->name());
      EXPECT_NE(calls_->Find(path), nullptr) << path;
      EXPECT_EQ(calls_->RequestType(path), method->input_type()) << path;
    }
  }
  EXPECT_EQ(calls_->size(), unary);
  EXPECT_EQ(calls_->Find("/gpurpc.v1.ExecutionService/CommandStream"), nullptr);
  EXPECT_EQ(calls_->Find("/gpurpc.internal.v1.WorkerControl/Bind"), nullptr);
}

TEST_F(RelayedUnaryTest, CallsAreAnsweredInTurnAndErrorsKeepTheChannel) {
  // A good call: the answer is the handler's response.
  v1::GetAllocationRequest get;
  get.set_buffer_id(buffer_);
  SendCall("/gpurpc.v1.MemoryService/GetAllocation", get.SerializeAsString());
  internal::v1::RelayedAnswer answer = Answer();
  EXPECT_EQ(answer.code(), 0) << answer.message();
  v1::GetAllocationResponse got;
  ASSERT_TRUE(got.ParseFromString(answer.response()));
  EXPECT_EQ(got.buffer().buffer_id(), buffer_);
  EXPECT_EQ(got.buffer().size_bytes(), 1u << 20);

  // The handler's error, with no response; the channel goes on.
  get.set_buffer_id(buffer_ + 1000);
  SendCall("/gpurpc.v1.MemoryService/GetAllocation", get.SerializeAsString());
  answer = Answer();
  EXPECT_EQ(answer.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND)) << answer.message();
  EXPECT_TRUE(answer.response().empty());

  // A request that does not parse: named as the worker's gRPC server names it.
  SendCall("/gpurpc.v1.ExecutionService/Launch", std::string("\xff\xff\xff", 3));
  answer = Answer();
  EXPECT_EQ(answer.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(answer.message(), ::testing::HasSubstr("/gpurpc.v1.ExecutionService/Launch: the "
                                                     "request is not a valid message"));

  // A method no handler serves, a streaming one, and one of the private control service.
  for (const char* method :
       {"/gpurpc.v1.MemoryService/Nothing", "/gpurpc.v1.ExecutionService/CommandStream",
        "/gpurpc.internal.v1.WorkerControl/Bind"}) {
    SendCall(method, "");
    answer = Answer();
    EXPECT_EQ(answer.code(), static_cast<int>(grpc::StatusCode::UNIMPLEMENTED)) << method;
  }

  // Still serving.
  get.set_buffer_id(buffer_);
  SendCall("/gpurpc.v1.MemoryService/GetAllocation", get.SerializeAsString());
  EXPECT_EQ(Answer().code(), 0);
}

TEST_F(RelayedUnaryTest, AnOversizedFrameEndsTheChannelWithAnEndFrame) {
  const uint32_t length = kMaxRelayedRequestBytes + kMaxRelayedMethodBytes + 1000;
  std::string header(kFrameHeaderBytes, '\0');
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  Send(0, header);
  const v1::CommandError end = End();
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(), ::testing::HasSubstr("more than the"));
  EXPECT_TRUE(Closed());
}

TEST_F(RelayedUnaryTest, AFrameThatIsNotACallEndsTheChannelWithAnEndFrame) {
  Send(0, Frame(std::string("\xff\xff\xff\xff", 4)));
  const v1::CommandError end = End();
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(), ::testing::HasSubstr("not a gpurpc.internal.v1.RelayedCall"));
  EXPECT_TRUE(Closed());
}

TEST_F(RelayedUnaryTest, AFrontEndThatClosesMidFrameEndsTheChannelQuietly) {
  Send(0, std::string("\x10\x00\x00\x00", 4) + "abc");
  shutdown(channels_[0].client, SHUT_WR);
  EXPECT_TRUE(Closed());
}

// The front end's framed transfer channels (ServeRelayedTransfer): one UploadStream or
// DownloadStream call per channel, frames written and read by hand as a front end would.
class RelayedTransferTest : public FramedChannelTest {
 protected:
  // A transfer channel served on its own thread; returns its index.
  size_t OpenTransfer(FramedPeer peer) {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    Channel& channel = channels_.emplace_back();
    channel.client = fds[0];
    channel.worker = fds[1];
    Session* session = session_.get();
    FramedMemory* memory = &memory_;
    const int worker = fds[1];
    channel.server = std::thread(
        [session, worker, memory, peer] { ServeRelayedTransfer(session, worker, memory, peer); });
    return channels_.size() - 1;
  }

  // One frame: whether it is an end frame, and its bytes.
  std::pair<bool, std::string> ReadFrame(size_t channel) {
    const std::string header = ReadExactly(channel, kFrameHeaderBytes);
    uint32_t prefix = 0;
    for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
      prefix |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
    }
    return {(prefix & kEndFrameBit) != 0, ReadExactly(channel, prefix & ~kEndFrameBit)};
  }

  // Reads frames until the end frame: the messages before it, and the status it carries.
  std::pair<std::vector<std::string>, v1::CommandError> ReadToEnd(size_t channel) {
    std::vector<std::string> messages;
    for (;;) {
      auto [end, bytes] = ReadFrame(channel);
      if (end) {
        v1::CommandError error;
        EXPECT_TRUE(error.ParseFromString(bytes));
        return {std::move(messages), std::move(error)};
      }
      if (bytes.empty() && messages.size() > 10'000) break;  // a runaway channel
      messages.push_back(std::move(bytes));
    }
    return {std::move(messages), v1::CommandError()};
  }

  void HalfClose(size_t channel) { shutdown(channels_[channel].client, SHUT_WR); }

  // Waits for the channel's thread (it ends after its end frame) and for its memory.
  void ExpectEndedWithMemoryBack(size_t channel) {
    channels_[channel].server.join();
    EXPECT_EQ(memory_.free(), kFramedMemoryBytes);
  }

  v1::UploadStreamRequest UploadMessage(std::string data, uint64_t total = 0) const {
    v1::UploadStreamRequest request;
    if (total != 0) {
      request.mutable_destination()->mutable_buffer()->set_buffer_id(buffer_);
      request.set_total_size_bytes(total);
    }
    request.set_data(std::move(data));
    return request;
  }

  v1::DownloadRequest DownloadMessage(uint64_t size, uint64_t chunk) const {
    v1::DownloadRequest request;
    request.mutable_source()->mutable_buffer()->set_buffer_id(buffer_);
    request.set_size_bytes(size);
    request.set_chunk_size_bytes(chunk);
    return request;
  }

  static constexpr char kExactlyOne[] =
      "/gpurpc.v1.MemoryService/DownloadStream takes exactly one request message; this call "
      "sent ";

  FramedMemory memory_{kFramedMemoryBytes};
};

TEST_F(RelayedTransferTest, AnUploadAndADownloadGoThroughWhole) {
  std::string bytes(1 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  const size_t up = OpenTransfer(FramedPeer::kFrontEndUpload);
  const size_t piece = 300'000;  // pieces that do not divide the buffer
  for (size_t offset = 0; offset < bytes.size(); offset += piece) {
    const v1::UploadStreamRequest message = UploadMessage(
        bytes.substr(offset, piece), offset == 0 ? static_cast<uint64_t>(bytes.size()) : 0);
    Send(up, Frame(message.SerializeAsString()));
  }
  HalfClose(up);
  auto [answers, end] = ReadToEnd(up);
  EXPECT_EQ(end.code(), 0) << end.message();
  ASSERT_EQ(answers.size(), 1u);
  v1::UploadResponse response;
  ASSERT_TRUE(response.ParseFromString(answers[0]));
  EXPECT_EQ(response.bytes_written(), bytes.size());
  ExpectEndedWithMemoryBack(up);

  // Read back in chunks that do not divide it either: the chunks come in order, then OK.
  const size_t down = OpenTransfer(FramedPeer::kFrontEndDownload);
  Send(down, Frame(DownloadMessage(bytes.size(), 400'000).SerializeAsString()));
  HalfClose(down);
  auto [chunks, down_end] = ReadToEnd(down);
  EXPECT_EQ(down_end.code(), 0) << down_end.message();
  std::string got;
  for (const std::string& chunk : chunks) {
    v1::DownloadResponse message;
    ASSERT_TRUE(message.ParseFromString(chunk));
    EXPECT_LE(message.data().size(), 400'000u);
    got += message.data();
  }
  EXPECT_EQ(chunks.size(), 3u);
  EXPECT_TRUE(got == bytes);
  ExpectEndedWithMemoryBack(down);
}

TEST_F(RelayedTransferTest, TheHandlersErrorsEndTheCall) {
  // More bytes than announced: the gRPC handler's own error.
  const size_t up = OpenTransfer(FramedPeer::kFrontEndUpload);
  Send(up, Frame(UploadMessage("abcdefgh", 4).SerializeAsString()));
  auto [answers, end] = ReadToEnd(up);
  EXPECT_TRUE(answers.empty());
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(), ::testing::HasSubstr("more than the announced 4 bytes arrived"));
  ExpectEndedWithMemoryBack(up);

  // A half-close before the announced bytes.
  const size_t short_up = OpenTransfer(FramedPeer::kFrontEndUpload);
  Send(short_up, Frame(UploadMessage("ab", 4).SerializeAsString()));
  HalfClose(short_up);
  end = ReadToEnd(short_up).second;
  EXPECT_THAT(end.message(), ::testing::HasSubstr("the stream ended after 2 of the announced 4"));
  ExpectEndedWithMemoryBack(short_up);

  // Bytes that are not an UploadStreamRequest, after a good first message.
  const size_t garbage = OpenTransfer(FramedPeer::kFrontEndUpload);
  Send(garbage, Frame(UploadMessage("ab", 4).SerializeAsString()));
  Send(garbage, Frame(std::string("\xff\xff\xff\xff", 4)));
  end = ReadToEnd(garbage).second;
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(), ::testing::HasSubstr("UploadStream"));
  ExpectEndedWithMemoryBack(garbage);

  // A download past the buffer's end.
  const size_t past = OpenTransfer(FramedPeer::kFrontEndDownload);
  Send(past, Frame(DownloadMessage((1 << 20) + 1, 0).SerializeAsString()));
  HalfClose(past);
  auto [chunks, past_end] = ReadToEnd(past);
  EXPECT_TRUE(chunks.empty());
  EXPECT_NE(past_end.code(), 0);
  EXPECT_THAT(past_end.message(), ::testing::HasSubstr("DownloadStream source"));
  ExpectEndedWithMemoryBack(past);
}

TEST_F(RelayedTransferTest, ADownloadTakesExactlyOneRequest) {
  // Two requests: refused before either runs.
  const size_t two = OpenTransfer(FramedPeer::kFrontEndDownload);
  const std::string request = Frame(DownloadMessage(16, 0).SerializeAsString());
  Send(two, request + request);
  auto [chunks, end] = ReadToEnd(two);
  EXPECT_TRUE(chunks.empty());
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
  EXPECT_EQ(end.message(), std::string(kExactlyOne) + "more");
  ExpectEndedWithMemoryBack(two);

  // None.
  const size_t none = OpenTransfer(FramedPeer::kFrontEndDownload);
  HalfClose(none);
  end = ReadToEnd(none).second;
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
  EXPECT_EQ(end.message(), std::string(kExactlyOne) + "none");
  ExpectEndedWithMemoryBack(none);

  // One request that is not a DownloadRequest.
  const size_t garbage = OpenTransfer(FramedPeer::kFrontEndDownload);
  Send(garbage, Frame(std::string("\xff\xff\xff\xff", 4)));
  HalfClose(garbage);
  end = ReadToEnd(garbage).second;
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(), ::testing::HasSubstr("DownloadStream: the request is not a valid"));
  ExpectEndedWithMemoryBack(garbage);
}

TEST_F(RelayedTransferTest, HostileFramesAreRefusedBeforeTheyAreReadOrParsed) {
  // A length over a message's limit: refused from the header, nothing taken.
  const size_t huge = OpenTransfer(FramedPeer::kFrontEndUpload);
  const uint32_t length = static_cast<uint32_t>(kMaxMessageBytes) + 1;
  std::string header(kFrameHeaderBytes, '\0');
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  Send(huge, header);
  v1::CommandError end = ReadToEnd(huge).second;
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(),
              ::testing::HasSubstr(absl::StrCat("UploadStream: message 1 announces ", length)));
  ExpectEndedWithMemoryBack(huge);

  // 2.5 million unknown varint fields: 5 MB that would parse to some 40 MB and more.
  const size_t fields = OpenTransfer(FramedPeer::kFrontEndDownload);
  std::string body;
  for (int i = 0; i < 2'500'000; ++i) body.append("\x78\x00", 2);
  // A download's request is refused once the front end half-closed after it (a second
  // message would be refused as that, first: as on the gRPC relay), never parsed.
  std::thread sender([&] {
    Send(fields, Frame(body));
    HalfClose(fields);
  });
  end = ReadToEnd(fields).second;
  sender.join();
  EXPECT_EQ(end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(end.message(),
              ::testing::HasSubstr("DownloadStream: the request (a "
                                   "gpurpc.v1.DownloadRequest of 5000000 bytes) would take"));
  ExpectEndedWithMemoryBack(fields);

  // The same as an upload's second message, after every byte its first announced arrived:
  // refused, with no UploadResponse before the end frame.
  const size_t upload = OpenTransfer(FramedPeer::kFrontEndUpload);
  std::thread uploader([&] {
    Send(upload, Frame(UploadMessage("abcd", 4).SerializeAsString()));
    Send(upload, Frame(body));
  });
  const auto [frames, upload_end] = ReadToEnd(upload);
  uploader.join();
  EXPECT_EQ(upload_end.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(upload_end.message(),
              ::testing::HasSubstr("UploadStream: message 2 of the stream (a "
                                   "gpurpc.v1.UploadStreamRequest of 5000000 bytes) would take"));
  EXPECT_TRUE(frames.empty()) << "an answer came before the refusal";
  ExpectEndedWithMemoryBack(upload);
}

TEST_F(RelayedTransferTest, AFrontEndThatLeavesMidTransferEndsTheChannel) {
  // Mid-message: the message's memory comes back.
  const size_t up = OpenTransfer(FramedPeer::kFrontEndUpload);
  const std::string message =
      Frame(UploadMessage(std::string(200'000, 'x'), 1 << 20).SerializeAsString());
  Send(up, message.substr(0, 1000));
  for (int i = 0; i < 200 && memory_.free() == kFramedMemoryBytes; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(memory_.free(), kFramedMemoryBytes);
  close(channels_[up].client);
  channels_[up].client = -1;
  ExpectEndedWithMemoryBack(up);

  // A download whose reader stops reading and goes: the worker's send fails and it ends.
  const size_t down = OpenTransfer(FramedPeer::kFrontEndDownload);
  Send(down, Frame(DownloadMessage(1 << 20, 4096).SerializeAsString()));
  HalfClose(down);
  EXPECT_TRUE(Answered(down, absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(50));  // the socket's buffer fills; the worker waits
  close(channels_[down].client);
  channels_[down].client = -1;
  ExpectEndedWithMemoryBack(down);
}

}  // namespace
}  // namespace gpurpc::worker
