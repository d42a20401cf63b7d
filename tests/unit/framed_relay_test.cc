// The front end's framed relay of streamed transfers (server/frontend/command_relay.h) against
// a worker played by the test: a worker's frame on a transfer channel may be at most a 4 MiB
// chunk and 64 KiB; one of exactly that size goes to the client whole, and one a byte larger
// ends the call UNAVAILABLE, saying so, with nothing of it relayed.
//
// The relay is the one the daemon runs: StartFramedTransferRelay on a SessionRecord, served by
// a gRPC callback generic service in the test, called by the test's client. Its worker is a
// real WorkerProcess: this test binary again (main() below), which hands its end of the relay
// channel back to the test and waits; the test then takes each transfer channel the front end
// opens and speaks the framed protocol on it itself.
#include <fcntl.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/fd_passing.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/frontend/command_relay.h"
#include "server/frontend/session_manager.h"
#include "server/frontend/worker_process.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/socket_io.h"

namespace gpurpc::frontend {
namespace {

using ::gpurpc::testing::SendAll;

// The worker process's mode: argv[2] is a descriptor (inherited) on which it sends its end of
// the relay channel (fd 6, WorkerProcess::Spawn), then waits until the test closes its side.
constexpr char kForwardRelayChannelFlag[] = "--internal-forward-relay-channel";
constexpr int kWorkerRelayFd = 6;

constexpr char kUploadStream[] = "/gpurpc.v1.MemoryService/UploadStream";
constexpr char kDownloadStream[] = "/gpurpc.v1.MemoryService/DownloadStream";

// The largest frame the front end takes from a worker on a transfer channel
// (kMaxTransferReplyBytes in command_relay.cc): a 4 MiB chunk and 64 KiB.
constexpr size_t kLimit = kMaxTransferChunkBytes + (size_t{64} << 10);

std::string Header(uint32_t prefix) {
  std::string header(kFrameHeaderBytes, '\0');
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    header[i] = static_cast<char>((prefix >> (8 * i)) & 0xff);
  }
  return header;
}

std::string Frame(const std::string& body) {
  return Header(static_cast<uint32_t>(body.size())) + body;
}

// The end frame of a call that went well (a CommandError of code OK serializes to nothing).
std::string OkEndFrame() { return Header(kEndFrameBit); }

// `size` bytes that differ from one offset to the next.
std::string Pattern(size_t size) {
  std::string out(size, '\0');
  for (size_t i = 0; i < size; ++i) out[i] = static_cast<char>((i * 131 + i / 251) & 0xff);
  return out;
}

bool ReadExactly(int fd, char* out, size_t size) {
  size_t got = 0;
  while (got < size) {
    const ssize_t n = recv(fd, out + got, size - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

// One frame from the front end (the client's message as it relays it); "" on failure, which
// fails the test.
std::string ReadFrame(int fd) {
  char header[kFrameHeaderBytes];
  if (!ReadExactly(fd, header, sizeof(header))) {
    ADD_FAILURE() << "no frame from the front end";
    return "";
  }
  uint32_t length = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    length |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
  }
  std::string body(length, '\0');
  if (!ReadExactly(fd, body.data(), body.size())) ADD_FAILURE() << "a frame cut short";
  return body;
}

void SetTimeouts(int fd, int seconds) {
  const timeval timeout{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

// The daemon's session proxy reduced to the framed transfer relay of one session.
class TransferRelayService final : public grpc::CallbackGenericService {
 public:
  explicit TransferRelayService(std::shared_ptr<SessionRecord> session)
      : session_(std::move(session)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    const bool upload = context->method() == kUploadStream;
    if (upload || context->method() == kDownloadStream) {
      grpc::ServerGenericBidiReactor* relay =
          StartFramedTransferRelay(session_, upload, /*metrics=*/nullptr);
      if (relay != nullptr) return relay;
      ADD_FAILURE() << "StartFramedTransferRelay did not relay " << context->method();
    }
    return grpc::CallbackGenericService::CreateReactor(context);  // UNIMPLEMENTED
  }

 private:
  const std::shared_ptr<SessionRecord> session_;
};

// Parameter: true for UploadStream, false for DownloadStream (both are transfer channels).
class FramedTransferRelayTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    // The worker: this binary, given a descriptor (above fd 6, which Spawn's dup2 sets, and
    // inherited: no close-on-exec) on which to hand back its end of the relay channel.
    char exe[PATH_MAX] = {};
    ASSERT_GT(readlink("/proc/self/exe", exe, sizeof(exe) - 1), 0) << std::strerror(errno);
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
    forward_ = pair[0];
    const int child_end = fcntl(pair[1], F_DUPFD, 10);
    close(pair[1]);
    ASSERT_GE(child_end, 10) << std::strerror(errno);
    auto worker = WorkerProcess::Spawn(exe, {kForwardRelayChannelFlag, std::to_string(child_end)});
    close(child_end);
    ASSERT_TRUE(worker.ok()) << worker.status();
    SetTimeouts(forward_, 10);
    ReceivedDatagram handed;
    ASSERT_TRUE(ReceiveDatagram(forward_, &handed).ok()) << "the worker sent no relay channel";
    ASSERT_EQ(handed.fds.size(), 1u);
    relay_channel_ = handed.Release(0);
    SetTimeouts(relay_channel_, 10);
    session_ = std::make_shared<SessionRecord>(1, 0, *std::move(worker), "tenant", "peer",
                                               "framed relay test");

    service_ = std::make_unique<TransferRelayService>(session_);
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    builder.RegisterCallbackGenericService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(-1);
    arguments.SetMaxSendMessageSize(-1);
    channel_ = server_->InProcessChannel(arguments);
  }

  void TearDown() override {
    channel_.reset();
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    service_.reset();
    session_.reset();  // kills and reaps the worker
    if (relay_channel_ >= 0) close(relay_channel_);
    if (forward_ >= 0) close(forward_);
  }

  const char* method() const { return GetParam() ? kUploadStream : kDownloadStream; }

  // The worker's end of the next transfer channel the front end opens: checks its kind ("U"
  // for an upload, "D" for a download); -1 when none came.
  int NextChannel() {
    ReceivedDatagram channel;
    if (absl::Status received = ReceiveDatagram(relay_channel_, &channel); !received.ok()) {
      ADD_FAILURE() << "the front end opened no channel: " << received;
      return -1;
    }
    EXPECT_EQ(channel.bytes, GetParam() ? "U" : "D");
    if (channel.fds.size() != 1) {
      ADD_FAILURE() << "a channel came with " << channel.fds.size() << " descriptors";
      return -1;
    }
    const int fd = channel.Release(0);
    SetTimeouts(fd, 20);
    return fd;
  }

  // One call of method() with one request message (any bytes: the front end does not parse
  // it), while `worker` plays the worker's side of its channel (given its fd, after the
  // client's message was read from it).
  testing::RawCallResult Call(const std::function<void(int fd)>& worker) {
    const std::string request = "the client's message";
    std::thread worker_thread([&] {
      const int fd = NextChannel();
      if (fd < 0) return;
      EXPECT_EQ(ReadFrame(fd), request);
      worker(fd);
      close(fd);
    });
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    testing::RawCallResult result = testing::RawCall(channel_, &context, method(), {request});
    worker_thread.join();
    return result;
  }

  int forward_ = -1;
  int relay_channel_ = -1;
  std::shared_ptr<SessionRecord> session_;
  std::unique_ptr<TransferRelayService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_P(FramedTransferRelayTest, AWorkerFrameOfExactlyTheLimitGoesToTheClientWhole) {
  const std::string largest = Pattern(kLimit);
  testing::RawCallResult call = Call([&](int fd) {
    EXPECT_TRUE(SendAll(fd, Frame(largest)));
    EXPECT_TRUE(SendAll(fd, OkEndFrame()));
  });
  EXPECT_TRUE(call.status.ok()) << call.status.error_code() << ": " << call.status.error_message();
  ASSERT_EQ(call.responses.size(), 1u);
  EXPECT_EQ(call.responses[0].size(), kLimit);
  EXPECT_TRUE(call.responses[0] == largest) << "the frame's bytes changed on the way";
}

TEST_P(FramedTransferRelayTest, AWorkerFrameOneByteOverTheLimitEndsTheCallWithNothingOfIt) {
  // A good frame first (relayed), then one a byte over the limit, whole, then a clean end: the
  // front end stops at the oversized frame's header, and closes the channel once the call
  // has ended, so the worker's send of its body may fail.
  const std::string over = Pattern(kLimit + 1);
  testing::RawCallResult call = Call([&](int fd) {
    ASSERT_TRUE(SendAll(fd, Frame("a good frame")));
    if (SendAll(fd, Frame(over))) (void)SendAll(fd, OkEndFrame());
  });
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::UNAVAILABLE) << call.status.error_message();
  EXPECT_EQ(call.status.error_message(),
            "the session's worker ended the transfer (it announced a frame of 4259841 bytes, "
            "over the limit)");
  // Only the good frame reached the client (sizes, not bytes: a failure must not print 4 MiB).
  std::vector<size_t> sizes;
  for (const std::string& response : call.responses) sizes.push_back(response.size());
  EXPECT_THAT(sizes, ::testing::ElementsAre(std::string("a good frame").size()))
      << "something of the oversized frame reached the client";
  if (!call.responses.empty()) {
    EXPECT_EQ(call.responses[0], "a good frame");
  }
}

INSTANTIATE_TEST_SUITE_P(Transfers, FramedTransferRelayTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Upload" : "Download";
                         });

// The worker process's main: hands its end of the relay channel to the test on `to`, then
// waits until the test closes its side (or kills it).
int ForwardRelayChannel(int to) {
  if (!SendDatagram(to, "relay", {kWorkerRelayFd}).ok()) return 1;
  close(kWorkerRelayFd);
  for (;;) {
    char byte;
    const ssize_t n = recv(to, &byte, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 0;
  }
}

}  // namespace
}  // namespace gpurpc::frontend

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], gpurpc::frontend::kForwardRelayChannelFlag) == 0) {
    return gpurpc::frontend::ForwardRelayChannel(std::atoi(argv[2]));
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
