// Same-host regions (HostRegionService and the region socket), through the C++ client and
// by hand on the region socket, against a real gpurpcd with real worker processes (fake
// backend): the data path, the limits and quota, and every way a local attacker could try
// to attach memory that is not theirs or that would hurt the worker. Compiled twice: label
// `service` with the fake backend, label `gpu` with the CUDA backend (GPURPC_TEST_BACKEND),
// where the worker really pins the memfd (cuMemHostRegister) and copies are DMA; it skips
// without a driver.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/fd_passing.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/host_region_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/socket_io.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::SendAll;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1ull << 20;
constexpr char kBackend[] = GPURPC_TEST_BACKEND;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 rng(seed);
  for (auto& byte : out) byte = static_cast<uint8_t>(rng());
  return out;
}

// A memfd made the way the protocol asks, or deliberately not.
struct Memfd {
  int fd = -1;
  explicit Memfd(uint64_t size, int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL,
                 unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING) {
    fd = memfd_create("host-region-test", flags);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    if (seals != 0) {
      EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0) << std::strerror(errno);
    }
  }
  ~Memfd() {
    if (fd >= 0) close(fd);
  }
};

class HostRegionTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags = {}) {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA regions: " << cuda;
      }
    }
    TestDaemon::Options options;
    options.backend = kBackend;
    options.extra_flags = std::move(flags);
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
  }
  void SetUp() override { StartDaemon(); }

  Session Open() {
    auto session = client_->OpenSession(0, "host region test");
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : Session();
  }

  template <typename Request, typename Response>
  grpc::Status Raw(const Session& session,
                   grpc::Status (v1::HostRegionService::Stub::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                   const Request& request, Response* response) {
    auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
    v1::HostRegionService::Stub stub(channel);
    grpc::ClientContext context;
    context.AddMetadata("gpurpc-session", std::to_string(session.id()));
    return (stub.*method)(&context, request, response);
  }

  v1::RegisterHostRegionResponse Register(const Session& session, uint64_t size) {
    v1::RegisterHostRegionRequest request;
    request.set_size_bytes(size);
    v1::RegisterHostRegionResponse response;
    const grpc::Status status =
        Raw(session, &v1::HostRegionService::Stub::RegisterHostRegion, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // One datagram with `fds` on the region socket; the daemon's answer.
  v1::AttachHostRegionReply SendAttach(const std::string& socket_path, const std::string& bytes,
                                       const std::vector<int>& fds) {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, socket_path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
        << std::strerror(errno);
    EXPECT_THAT(SendDatagram(fd, bytes, fds), IsOk());
    ReceivedDatagram answer;
    EXPECT_THAT(ReceiveDatagram(fd, &answer), IsOk());
    close(fd);
    v1::AttachHostRegionReply reply;
    EXPECT_TRUE(reply.ParseFromString(answer.bytes));
    return reply;
  }
  v1::AttachHostRegionReply Attach(const Session& session,
                                   const v1::RegisterHostRegionResponse& registered,
                                   const std::string& ticket, const std::vector<int>& fds) {
    v1::AttachHostRegionRequest request;
    request.set_session_id(session.id());
    request.set_region_id(registered.region_id());
    request.set_ticket(ticket);
    return SendAttach(registered.region_socket(), request.SerializeAsString(), fds);
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(HostRegionTest, BytesGoThroughTheRegionBothWays) {
  Session session = Open();
  const uint64_t size = 4 * kMiB + 17;  // not a page multiple
  auto region = session.CreateHostRegion(2 * size);
  ASSERT_THAT(region, IsOk());
  const std::vector<uint8_t> bytes = RandomBytes(size, 1);
  std::memcpy(region->data(), bytes.data(), size);
  auto buffer = session.Allocate(size);
  ASSERT_THAT(buffer, IsOk());
  auto stream = session.CreateStream();
  ASSERT_THAT(stream, IsOk());
  ASSERT_THAT(region->CopyToDevice(buffer->at(), 0, size, &*stream), IsOk());
  ASSERT_THAT(region->CopyFromDevice(buffer->at(), size, size, &*stream), IsOk());
  ASSERT_THAT(stream->Synchronize(), IsOk());
  EXPECT_EQ(std::memcmp(region->data() + size, bytes.data(), size), 0);
  // The device holds them too (read over gRPC).
  auto downloaded = buffer->Download();
  ASSERT_THAT(downloaded, IsOk());
  EXPECT_EQ(*downloaded, bytes);
  // Offsets on both sides.
  ASSERT_THAT(region->CopyFromDevice(buffer->at(100), 7, 1000), IsOk());
  ASSERT_THAT(session.Synchronize(), IsOk());
  EXPECT_EQ(std::memcmp(region->data() + 7, bytes.data() + 100, 1000), 0);
}

TEST_F(HostRegionTest, AGibibyteRoundTripsThroughOneRegion) {
  Session session = Open();
  const uint64_t size = std::string(kBackend) == "cuda" ? 1024 * kMiB : 64 * kMiB;
  auto region = session.CreateHostRegion(size);
  ASSERT_THAT(region, IsOk());
  for (uint64_t i = 0; i < size; i += 4096) region->data()[i] = static_cast<uint8_t>(i >> 12);
  auto buffer = session.Allocate(size);
  ASSERT_THAT(buffer, IsOk());
  ASSERT_THAT(region->CopyToDevice(buffer->at(), 0, size), IsOk());
  ASSERT_THAT(session.Synchronize(), IsOk());
  std::memset(region->data(), 0, size);
  ASSERT_THAT(region->CopyFromDevice(buffer->at(), 0, size), IsOk());
  ASSERT_THAT(session.Synchronize(), IsOk());
  for (uint64_t i = 0; i < size; i += 4096) {
    ASSERT_EQ(region->data()[i], static_cast<uint8_t>(i >> 12)) << "at " << i;
  }
}

TEST_F(HostRegionTest, CopyErrorsComeBackAndTheSessionGoesOn) {
  Session session = Open();
  auto region = session.CreateHostRegion(kMiB);
  ASSERT_THAT(region, IsOk());
  auto buffer = session.Allocate(kMiB);
  ASSERT_THAT(buffer, IsOk());
  ASSERT_THAT(region->CopyToDevice(buffer->at(), kMiB - 10, 11), IsOk());
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside region")));
  ASSERT_THAT(region->CopyToDevice(buffer->at(10), 0, kMiB), IsOk());
  EXPECT_THAT(session.Synchronize(), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(region->CopyFromDevice(buffer->at(), 0, 0), IsOk());
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size_bytes must be > 0")));
  v1::CopyHostRegionRequest copy;
  copy.set_region_id(region->id());
  copy.mutable_device()->mutable_buffer()->set_buffer_id(buffer->id());
  copy.set_size_bytes(16);
  copy.set_stream_id(12345);
  v1::CopyHostRegionResponse copied;
  grpc::Status status = Raw(session, &v1::HostRegionService::Stub::CopyHostRegion, copy, &copied);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  // Still usable.
  ASSERT_THAT(region->CopyToDevice(buffer->at(), 0, 16), IsOk());
  EXPECT_THAT(session.Synchronize(), IsOk());
}

TEST_F(HostRegionTest, ARegionBelongsToItsSessionOnly) {
  Session alice = Open();
  Session other = Open();  // the same tenant, another session
  auto region = alice.CreateHostRegion(kMiB);
  ASSERT_THAT(region, IsOk());
  auto buffer = other.Allocate(kMiB);
  ASSERT_THAT(buffer, IsOk());
  v1::CopyHostRegionRequest copy;
  copy.set_region_id(region->id());
  copy.mutable_device()->mutable_buffer()->set_buffer_id(buffer->id());
  copy.set_size_bytes(16);
  copy.set_to_device(false);
  v1::CopyHostRegionResponse copied;
  const grpc::Status status =
      Raw(other, &v1::HostRegionService::Stub::CopyHostRegion, copy, &copied);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  // A pending region of alice's, attached with its ticket but in the other session's name.
  const v1::RegisterHostRegionResponse pending = Register(alice, kMiB);
  Memfd memfd(kMiB);
  v1::AttachHostRegionRequest request;
  request.set_session_id(other.id());
  request.set_region_id(pending.region_id());
  request.set_ticket(pending.attach_ticket());
  v1::AttachHostRegionReply reply =
      SendAttach(pending.region_socket(), request.SerializeAsString(), {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound)) << reply.message();
  // The rightful attach still works.
  reply = Attach(alice, pending, pending.attach_ticket(), {memfd.fd});
  EXPECT_EQ(reply.code(), 0) << reply.message();
}

TEST_F(HostRegionTest, TicketsAreCheckedAndWorkOnce) {
  Session session = Open();
  const v1::RegisterHostRegionResponse registered = Register(session, kMiB);
  EXPECT_EQ(registered.attach_ticket().size(), 16u);
  EXPECT_THAT(registered.region_socket(), HasSubstr("regions"));
  Memfd memfd(kMiB);
  std::string wrong = registered.attach_ticket();
  wrong[0] ^= 1;
  v1::AttachHostRegionReply reply = Attach(session, registered, wrong, {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_THAT(reply.message(), HasSubstr("with that ticket"));
  reply = Attach(session, registered, "", {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  // A wrong ticket burns nothing; the right one works once.
  reply = Attach(session, registered, registered.attach_ticket(), {memfd.fd});
  EXPECT_EQ(reply.code(), 0) << reply.message();
  EXPECT_EQ(reply.message(), "attached");
  reply = Attach(session, registered, registered.attach_ticket(), {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  // An unknown session and a closed one answer in the same words.
  v1::AttachHostRegionRequest request;
  request.set_session_id(session.id() + 1);
  request.set_region_id(registered.region_id());
  request.set_ticket(registered.attach_ticket());
  reply = SendAttach(registered.region_socket(), request.SerializeAsString(), {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_THAT(reply.message(), HasSubstr("with that ticket"));
  Session closing = Open();
  const v1::RegisterHostRegionResponse orphan = Register(closing, kMiB);
  ASSERT_THAT(closing.Close(), IsOk());
  reply = Attach(closing, orphan, orphan.attach_ticket(), {memfd.fd});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
}

TEST_F(HostRegionTest, HostileDescriptorsAreRefusedAndTheRegionStillWaits) {
  Session session = Open();
  const v1::RegisterHostRegionResponse registered = Register(session, kMiB);
  const std::string& ticket = registered.attach_ticket();
  const auto invalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
  struct Case {
    std::string name;
    std::vector<int> fds;
    std::string message;
  };
  Memfd good(kMiB);
  Memfd second(kMiB);
  Memfd unsealed(kMiB, /*seals=*/0);
  Memfd small(kMiB - 1);
  Memfd write_sealed(kMiB, F_SEAL_SHRINK | F_SEAL_WRITE);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const std::string file_path = absl::StrCat(daemon_->dir(), "/plain-file");
  { std::ofstream(file_path) << std::string(kMiB, 'x'); }
  const int file_fd = open(file_path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(file_fd, 0);
  const int read_only = open(absl::StrCat("/proc/self/fd/", good.fd).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  const std::vector<Case> cases = {
      {"no descriptor", {}, "carries 0 descriptors"},
      {"two descriptors", {good.fd, second.fd}, "carries 2 descriptors"},
      {"a pipe", {pipe_fds[0]}, "not a memfd"},
      {"a regular file", {file_fd}, "not a memfd"},
      {"an unsealed memfd", {unsealed.fd}, "F_SEAL_SHRINK"},
      {"a memfd smaller than the region", {small.fd}, "less than the region"},
      {"a write-sealed memfd", {write_sealed.fd}, "sealed against writing"},
      {"a read-only descriptor of a good memfd", {read_only}, "read-write"},
  };
  for (const Case& c : cases) {
    const v1::AttachHostRegionReply reply = Attach(session, registered, ticket, c.fds);
    EXPECT_EQ(reply.code(), invalid) << c.name << ": " << reply.message();
    EXPECT_THAT(reply.message(), HasSubstr(c.message)) << c.name;
  }
  // Not a request at all.
  v1::AttachHostRegionReply reply =
      SendAttach(registered.region_socket(), std::string("\xff\xff\xff garbage", 11), {good.fd});
  EXPECT_EQ(reply.code(), invalid) << reply.message();
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  close(file_fd);
  close(read_only);
  // After all that the region still takes its memfd, and works.
  reply = Attach(session, registered, ticket, {good.fd});
  ASSERT_EQ(reply.code(), 0) << reply.message();
  // The seal holds: the client cannot shrink the memory under the worker.
  EXPECT_NE(ftruncate(good.fd, 0), 0);
  auto buffer = session.Allocate(kMiB);
  ASSERT_THAT(buffer, IsOk());
  v1::CopyHostRegionRequest copy;
  copy.set_region_id(registered.region_id());
  copy.mutable_device()->mutable_buffer()->set_buffer_id(buffer->id());
  copy.set_size_bytes(kMiB);
  copy.set_to_device(true);
  v1::CopyHostRegionResponse copied;
  const grpc::Status status =
      Raw(session, &v1::HostRegionService::Stub::CopyHostRegion, copy, &copied);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(session.Synchronize(), IsOk());
}

TEST_F(HostRegionTest, SilentAndCrowdingConnectionsDoNotHoldTheSocket) {
  Session session = Open();
  const v1::RegisterHostRegionResponse registered = Register(session, kMiB);
  std::vector<int> silent;
  for (int i = 0; i < 20; ++i) {  // more than kMaxPendingPerUser (16)
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, registered.region_socket().c_str(),
                 sizeof(address.sun_path) - 1);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    silent.push_back(fd);
  }
  // The ones over the bound are told at once; the others time out.
  int exhausted = 0;
  int timed_out = 0;
  for (const int fd : silent) {
    ReceivedDatagram answer;
    ASSERT_THAT(ReceiveDatagram(fd, &answer), IsOk());
    v1::AttachHostRegionReply reply;
    ASSERT_TRUE(reply.ParseFromString(answer.bytes));
    if (reply.code() == static_cast<int>(absl::StatusCode::kResourceExhausted)) ++exhausted;
    if (reply.code() == static_cast<int>(absl::StatusCode::kDeadlineExceeded)) ++timed_out;
    close(fd);
  }
  EXPECT_EQ(exhausted, 4);
  EXPECT_EQ(timed_out, 16);
  Memfd memfd(kMiB);
  const v1::AttachHostRegionReply reply =
      Attach(session, registered, registered.attach_ticket(), {memfd.fd});
  EXPECT_EQ(reply.code(), 0) << reply.message();
}

// A direct channel made by hand: the client's end of the socketpair as a gRPC channel.
std::shared_ptr<grpc::Channel> DirectChannelFromFd(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return grpc::CreateInsecureChannelFromFd("direct-test", fd);
}

TEST_F(HostRegionTest, TheDirectChannelCarriesExecutionAndNothingElse) {
  Session session = Open();
  ASSERT_THAT(session.UseDirectChannel(), IsOk());
  EXPECT_TRUE(session.direct());
  auto buffer = session.Allocate(kMiB);  // through the front end
  ASSERT_THAT(buffer, IsOk());
  auto stream = session.CreateStream();  // direct
  ASSERT_THAT(stream, IsOk());
  ASSERT_THAT(session.MemsetAsync(buffer->at(), 0x5a, 1, kMiB, &*stream), IsOk());
  auto region = session.CreateHostRegion(kMiB);
  ASSERT_THAT(region, IsOk());
  ASSERT_THAT(region->CopyFromDevice(buffer->at(), 0, kMiB, &*stream), IsOk());
  ASSERT_THAT(stream->Synchronize(), IsOk());
  EXPECT_EQ(region->data()[0], 0x5a);
  EXPECT_EQ(region->data()[kMiB - 1], 0x5a);
  auto downloaded = buffer->Download(0, 16);  // through the front end, after the direct work
  ASSERT_THAT(downloaded, IsOk());
  EXPECT_EQ((*downloaded)[15], 0x5a);

  // By hand: a second channel serves ExecutionService, and nothing the front end accounts
  // for or controls.
  v1::OpenDirectChannelResponse opened;
  const grpc::Status status = Raw(session, &v1::HostRegionService::Stub::OpenDirectChannel,
                                  v1::OpenDirectChannelRequest(), &opened);
  ASSERT_TRUE(status.ok()) << status.error_message();
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  v1::AttachHostRegionRequest attach;
  attach.set_session_id(session.id());
  attach.set_ticket(opened.attach_ticket());
  attach.set_direct_channel(true);
  v1::AttachHostRegionReply reply =
      SendAttach(opened.region_socket(), attach.SerializeAsString(), {pair[1]});
  close(pair[1]);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  auto direct = DirectChannelFromFd(pair[0]);
  {
    v1::ExecutionService::Stub stub(direct);
    grpc::ClientContext context;
    v1::CreateStreamResponse created;
    const grpc::Status made = stub.CreateStream(&context, v1::CreateStreamRequest(), &created);
    EXPECT_TRUE(made.ok()) << made.error_message();
  }
  {
    v1::MemoryService::Stub stub(direct);
    grpc::ClientContext context;
    v1::AllocateRequest request;
    request.set_size_bytes(kMiB);
    v1::AllocateResponse allocated;
    const grpc::Status refused = stub.Allocate(&context, request, &allocated);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << refused.error_message();
  }
  {
    v1::HostRegionService::Stub stub(direct);
    grpc::ClientContext context;
    v1::RegisterHostRegionRequest request;
    request.set_size_bytes(kMiB);
    v1::RegisterHostRegionResponse registered;
    const grpc::Status refused = stub.RegisterHostRegion(&context, request, &registered);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << refused.error_message();
    EXPECT_NE(refused.error_message().find("not served on this channel"), std::string::npos)
        << refused.error_message();
  }
  // The ticket is used up.
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  reply = SendAttach(opened.region_socket(), attach.SerializeAsString(), {pair[1]});
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound)) << reply.message();
  close(pair[0]);
  close(pair[1]);
}

TEST_F(HostRegionTest, DirectChannelsRefuseWhatIsNotAStreamSocketAndAreBounded) {
  Session session = Open();
  auto ticket = [&] {
    v1::OpenDirectChannelResponse opened;
    const grpc::Status status = Raw(session, &v1::HostRegionService::Stub::OpenDirectChannel,
                                    v1::OpenDirectChannelRequest(), &opened);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return opened;
  };
  auto attach = [&](const v1::OpenDirectChannelResponse& opened, int fd) {
    v1::AttachHostRegionRequest request;
    request.set_session_id(session.id());
    request.set_ticket(opened.attach_ticket());
    request.set_direct_channel(true);
    return SendAttach(opened.region_socket(), request.SerializeAsString(), {fd});
  };
  const auto invalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
  Memfd memfd(kMiB);
  EXPECT_EQ(attach(ticket(), memfd.fd).code(), invalid);
  int datagram[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, datagram), 0);
  EXPECT_EQ(attach(ticket(), datagram[0]).code(), invalid);
  close(datagram[0]);
  close(datagram[1]);
  const int unconnected = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(attach(ticket(), unconnected).code(), invalid);
  close(unconnected);
  // A region attach with region_id 0 is malformed; so is a direct one that names a region.
  v1::AttachHostRegionRequest malformed;
  malformed.set_session_id(session.id());
  malformed.set_ticket(ticket().attach_ticket());
  EXPECT_EQ(SendAttach(ticket().region_socket(), malformed.SerializeAsString(), {memfd.fd}).code(),
            invalid);
  // Tickets and live channels are bounded.
  std::vector<int> ends;
  int accepted = 0;
  int exhausted = 0;
  for (int i = 0; i < 12; ++i) {
    v1::OpenDirectChannelResponse opened;
    const grpc::Status status = Raw(session, &v1::HostRegionService::Stub::OpenDirectChannel,
                                    v1::OpenDirectChannelRequest(), &opened);
    if (!status.ok()) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << status.error_message();
      ++exhausted;
      continue;
    }
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    const v1::AttachHostRegionReply reply = attach(opened, pair[1]);
    close(pair[1]);
    ends.push_back(pair[0]);
    if (reply.code() == 0) {
      ++accepted;
    } else {
      EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kResourceExhausted))
          << reply.message();
      ++exhausted;
    }
  }
  EXPECT_EQ(accepted, 8);
  EXPECT_EQ(exhausted, 4);
  for (const int fd : ends) close(fd);
}

class HostRegionFaultTest : public HostRegionTest {
 protected:
  // No warm worker: the one process that appears with the session is its worker.
  void SetUp() override { StartDaemon({"--warm-workers=0"}); }
};

TEST_F(HostRegionFaultTest, AFaultSeenOnTheDirectChannelFaultsTheSessionAndEndsItsWorker) {
  // The front end never sees a direct call's answer; the worker must tell it by ending.
  const std::vector<pid_t> before = daemon_->WorkerPids();
  Session session = Open();
  pid_t worker = 0;
  for (pid_t pid : daemon_->WorkerPids()) {
    if (std::find(before.begin(), before.end(), pid) == before.end()) worker = pid;
  }
  ASSERT_NE(worker, 0);
  ASSERT_THAT(session.UseDirectChannel(), IsOk());
  CompileOptions options;
  options.source = testing::kFakeKernelsSource;
  auto compiled = session.Compile(options);
  ASSERT_THAT(compiled, IsOk());
  ASSERT_TRUE(compiled->success()) << compiled->log();
  auto fault = compiled->module.GetFunction("fault_illegal_address");
  ASSERT_THAT(fault, IsOk());
  ASSERT_THAT(fault->Launch(LaunchConfig{Dim3{1, 1, 1}, Dim3{1, 1, 1}}), IsOk());
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  // The worker ends itself and the front end marks the session FAULTED with the cause: a
  // call through the front end says so, and the session's watch sees it.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  auto gone = [&] {
    const std::vector<pid_t> pids = daemon_->WorkerPids();
    return std::find(pids.begin(), pids.end(), worker) == pids.end();
  };
  while (!gone() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(gone()) << "the faulted worker " << worker << " still runs";
  while (session.state() != v1::SESSION_STATE_FAULTED && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(session.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_THAT(session.fault(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  // Once the front end knows (the watch said so), it answers for the session itself. (A call
  // that reaches the worker while it ends gets ABORTED "FAULTED during ..." instead.)
  EXPECT_THAT(session.Allocate(64), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  // Another session of the same daemon is untouched.
  Session other = Open();
  EXPECT_THAT(other.Allocate(64), IsOk());
}

TEST_F(HostRegionTest, TheDirectChannelMustBeChosenFirst) {
  Session session = Open();
  auto buffer = session.Allocate(kMiB);
  ASSERT_THAT(buffer, IsOk());
  ASSERT_THAT(session.MemsetAsync(buffer->at(), 1, 1, 16), IsOk());
  EXPECT_THAT(session.UseDirectChannel(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already open")));
  EXPECT_THAT(session.Synchronize(), IsOk());
}

class HostRegionLimitsTest : public HostRegionTest {
 protected:
  void SetUp() override {}
};

TEST_F(HostRegionLimitsTest, TheSessionLimitHolds) {
  StartDaemon({"--max-host-region-bytes=8388608"});
  if (IsSkipped() || HasFatalFailure()) return;  // GTEST_SKIP in StartDaemon returns from it only
  Session session = Open();
  auto first = session.CreateHostRegion(6 * kMiB);
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(session.CreateHostRegion(3 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-host-region-bytes")));
  ASSERT_THAT(first->Unregister(), IsOk());
  EXPECT_THAT(session.CreateHostRegion(8 * kMiB), IsOk());
}

TEST_F(HostRegionLimitsTest, TheTenantQuotaHoldsOverSessions) {
  const std::string config_dir = ::testing::TempDir();
  const std::string config = absl::StrCat(config_dir, "/host-region-quota.conf");
  { std::ofstream(config) << "default_quota { max_host_region_bytes: 6291456 }\n"; }
  StartDaemon({absl::StrCat("--config=", config)});
  if (IsSkipped() || HasFatalFailure()) return;  // GTEST_SKIP in StartDaemon returns from it only
  Session a = Open();
  Session b = Open();
  auto held = a.CreateHostRegion(4 * kMiB);
  ASSERT_THAT(held, IsOk());
  EXPECT_THAT(b.CreateHostRegion(4 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_host_region_bytes")));
  EXPECT_THAT(b.CreateHostRegion(2 * kMiB), IsOk());
  // Closing the session gives its regions back to the tenant.
  held = HostRegion();
  ASSERT_THAT(a.Close(), IsOk());
  Session c = Open();
  EXPECT_THAT(c.CreateHostRegion(4 * kMiB), IsOk());
}

TEST_F(HostRegionLimitsTest, NoRegionSocketMeansFailedPrecondition) {
  StartDaemon({"--region-socket="});
  if (IsSkipped() || HasFatalFailure()) return;  // GTEST_SKIP in StartDaemon returns from it only
  Session session = Open();
  EXPECT_THAT(session.CreateHostRegion(kMiB),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no region socket")));
  // Everything else works.
  EXPECT_THAT(session.Allocate(kMiB), IsOk());
}

// ---------------------------------------------------------------------------------------
// The framed command protocol (OpenDirectChannel with AttachHostRegionRequest.framed_commands),
// spoken by hand: a 4-byte little-endian length and that many bytes, a CommandBatch from the
// client, a CommandReply from the worker.

// The most bytes a frame may announce (kMaxMessageBytes, 80 MiB).
constexpr uint32_t kMaxFrameBytes = 80u << 20;
// How long a reply or the end of a channel may take before the test gives up on it.
constexpr absl::Duration kFrameTimeout = absl::Seconds(10);

// An owned descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

std::string FrameHeader(uint32_t length) {
  std::string header(4, '\0');
  for (int i = 0; i < 4; ++i) header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return header;
}

// One frame: the length prefix and `body`.
bool SendFrame(int fd, const std::string& body) {
  return SendAll(fd, FrameHeader(static_cast<uint32_t>(body.size())) + body);
}
bool SendBatch(int fd, const v1::CommandBatch& batch) {
  return SendFrame(fd, batch.SerializeAsString());
}

// Reads exactly `size` bytes into `out` before `deadline`. OUT_OF_RANGE when the peer ended
// the stream (end of file, or a reset) before the first of them, DATA_LOSS when it ended
// after some, DEADLINE_EXCEEDED when they do not come in time.
absl::Status ReadExactly(int fd, size_t size, absl::Time deadline, std::string* out) {
  out->clear();
  char piece[1 << 16];
  while (out->size() < size) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("only ", out->size(), " of ", size, " bytes came in time"));
    }
    pollfd ready{fd, POLLIN, 0};
    const int polled = poll(&ready, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (polled < 0 && errno != EINTR) return absl::InternalError(std::strerror(errno));
    if (polled <= 0) continue;
    const ssize_t n = recv(fd, piece, std::min(size - out->size(), sizeof(piece)), MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n == 0 || (n < 0 && errno == ECONNRESET)) {
      const std::string how = n == 0 ? "end of file" : "connection reset";
      if (out->empty()) return absl::OutOfRangeError(how);
      return absl::DataLossError(absl::StrCat(how, " after ", out->size(), " of ", size, " bytes"));
    }
    if (n < 0) return absl::InternalError(absl::StrCat("recv: ", std::strerror(errno)));
    out->append(piece, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// The next reply frame on `fd`.
absl::StatusOr<v1::CommandReply> ReadReply(int fd) {
  const absl::Time deadline = absl::Now() + kFrameTimeout;
  std::string bytes;
  if (absl::Status read = ReadExactly(fd, 4, deadline, &bytes); !read.ok()) return read;
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i)
    length |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  if (length > kMaxFrameBytes) {
    return absl::DataLossError(absl::StrCat("a reply frame announces ", length, " bytes"));
  }
  if (absl::Status read = ReadExactly(fd, length, deadline, &bytes); !read.ok()) return read;
  v1::CommandReply reply;
  if (!reply.ParseFromString(bytes))
    return absl::DataLossError("a reply that is not a CommandReply");
  return reply;
}

// OK once the peer ended the stream with nothing more to read.
absl::Status AwaitEnd(int fd) {
  std::string bytes;
  const absl::Status read = ReadExactly(fd, 1, absl::Now() + kFrameTimeout, &bytes);
  if (read.code() == absl::StatusCode::kOutOfRange) return absl::OkStatus();
  if (read.ok()) return absl::FailedPreconditionError("more bytes instead of the end");
  return read;
}

v1::DevicePointer At(uint64_t buffer_id, uint64_t offset) {
  v1::DevicePointer pointer;
  pointer.mutable_buffer()->set_buffer_id(buffer_id);
  pointer.mutable_buffer()->set_offset_bytes(offset);
  return pointer;
}
v1::Command MemsetCommand(uint64_t sequence, uint64_t buffer_id, uint64_t offset, uint8_t value,
                          uint64_t count) {
  v1::Command command;
  command.set_sequence(sequence);
  *command.mutable_memset()->mutable_destination() = At(buffer_id, offset);
  command.mutable_memset()->set_value(value);
  command.mutable_memset()->set_element_size_bytes(1);
  command.mutable_memset()->set_count(count);
  return command;
}
v1::Command UploadCommand(uint64_t sequence, uint64_t buffer_id, uint64_t offset,
                          const std::string& data) {
  v1::Command command;
  command.set_sequence(sequence);
  *command.mutable_upload()->mutable_destination() = At(buffer_id, offset);
  command.mutable_upload()->set_data(data);
  return command;
}
v1::Command DownloadCommand(uint64_t sequence, uint64_t buffer_id, uint64_t offset, uint64_t size) {
  v1::Command command;
  command.set_sequence(sequence);
  *command.mutable_download()->mutable_source() = At(buffer_id, offset);
  command.mutable_download()->set_size_bytes(size);
  return command;
}
v1::Command SyncCommand(uint64_t sequence) {
  v1::Command command;
  command.set_sequence(sequence);
  command.mutable_sync()->set_stream_id(0);
  return command;
}
v1::CommandBatch Batch(std::vector<v1::Command> commands) {
  v1::CommandBatch batch;
  for (v1::Command& command : commands) *batch.add_commands() = std::move(command);
  return batch;
}

constexpr int kInvalidArgument = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kNotFound = static_cast<int>(absl::StatusCode::kNotFound);
constexpr int kResourceExhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);

class HostRegionFramedTest : public HostRegionTest {
 protected:
  // Asks for a ticket and attaches one end of a new socketpair as a direct channel of
  // `session` (framed or gRPC); the other end goes to *client_end whatever the answer. A
  // refused ticket comes back as the reply's code and message.
  v1::AttachHostRegionReply AttachChannel(const Session& session, bool framed,
                                          UniqueFd* client_end) {
    v1::OpenDirectChannelResponse opened;
    const grpc::Status status = Raw(session, &v1::HostRegionService::Stub::OpenDirectChannel,
                                    v1::OpenDirectChannelRequest(), &opened);
    v1::AttachHostRegionReply reply;
    if (!status.ok()) {
      reply.set_code(static_cast<int>(status.error_code()));
      reply.set_message(absl::StrCat("OpenDirectChannel: ", status.error_message()));
      return reply;
    }
    int pair[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    client_end->reset(pair[0]);
    v1::AttachHostRegionRequest request;
    request.set_session_id(session.id());
    request.set_ticket(opened.attach_ticket());
    request.set_direct_channel(true);
    request.set_framed_commands(framed);
    reply = SendAttach(opened.region_socket(), request.SerializeAsString(), {pair[1]});
    close(pair[1]);
    return reply;
  }
  // A framed channel of `session`, or an invalid descriptor (and a failure).
  UniqueFd OpenFramed(const Session& session) {
    UniqueFd end;
    const v1::AttachHostRegionReply reply = AttachChannel(session, /*framed=*/true, &end);
    EXPECT_EQ(reply.code(), 0) << reply.message();
    if (reply.code() != 0) end.reset();
    return end;
  }
};

TEST_F(HostRegionFramedTest, BatchesAreAnsweredOncePerBatchInOrder) {
  Session session = Open();
  auto buffer = session.Allocate(4096);  // through the front end
  ASSERT_THAT(buffer, IsOk());
  const uint64_t id = buffer->id();
  UniqueFd channel = OpenFramed(session);
  ASSERT_GE(channel.get(), 0);

  const std::vector<uint8_t> random = RandomBytes(256, 7);
  const std::string uploaded(random.begin(), random.end());
  ASSERT_TRUE(SendBatch(channel.get(), Batch({MemsetCommand(1, id, 0, 0x5a, 4096),
                                              UploadCommand(2, id, 100, uploaded), SyncCommand(3),
                                              DownloadCommand(4, id, 0, 4096)})));
  auto reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->has_error()) << reply->error().message();
  EXPECT_EQ(reply->processed_through_sequence(), 4u);
  EXPECT_EQ(reply->skipped_from_sequence(), 0u);
  std::string expected(4096, '\x5a');
  expected.replace(100, uploaded.size(), uploaded);
  ASSERT_EQ(reply->downloads_size(), 1);
  EXPECT_EQ(reply->downloads(0).sequence(), 4u);
  EXPECT_TRUE(reply->downloads(0).data() == expected);

  // Two batches back to back, then their replies: in order, one each.
  ASSERT_TRUE(SendBatch(
      channel.get(), Batch({MemsetCommand(10, id, 0, 0x11, 16), DownloadCommand(11, id, 0, 16)})));
  ASSERT_TRUE(SendBatch(
      channel.get(), Batch({MemsetCommand(12, id, 0, 0x22, 8), DownloadCommand(13, id, 0, 16)})));
  auto first = ReadReply(channel.get());
  ASSERT_THAT(first, IsOk());
  auto second = ReadReply(channel.get());
  ASSERT_THAT(second, IsOk());
  EXPECT_FALSE(first->has_error()) << first->error().message();
  EXPECT_FALSE(second->has_error()) << second->error().message();
  EXPECT_EQ(first->processed_through_sequence(), 11u);
  EXPECT_EQ(second->processed_through_sequence(), 13u);
  ASSERT_EQ(first->downloads_size(), 1);
  ASSERT_EQ(second->downloads_size(), 1);
  EXPECT_EQ(first->downloads(0).sequence(), 11u);
  EXPECT_EQ(second->downloads(0).sequence(), 13u);
  EXPECT_EQ(first->downloads(0).data(), std::string(16, '\x11'));
  EXPECT_EQ(second->downloads(0).data(), std::string(8, '\x22') + std::string(8, '\x11'));

  // An empty batch (a zero-length frame) is a batch too: it is answered, and says how far
  // the channel got.
  ASSERT_TRUE(SendFrame(channel.get(), ""));
  auto empty = ReadReply(channel.get());
  ASSERT_THAT(empty, IsOk());
  EXPECT_FALSE(empty->has_error()) << empty->error().message();
  EXPECT_EQ(empty->processed_through_sequence(), 13u);
  EXPECT_EQ(empty->downloads_size(), 0);

  // The front end sees the same memory, and the session goes on.
  ASSERT_THAT(session.Synchronize(), IsOk());
  auto downloaded = buffer->Download(0, 4096);
  ASSERT_THAT(downloaded, IsOk());
  expected.replace(0, 16, std::string(8, '\x22') + std::string(8, '\x11'));
  EXPECT_TRUE(std::string(downloaded->begin(), downloaded->end()) == expected);
  // Nothing more was sent: nothing more comes, and the channel stays open.
  std::string extra;
  EXPECT_THAT(ReadExactly(channel.get(), 1, absl::Now() + absl::Milliseconds(100), &extra),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(HostRegionFramedTest, CommandErrorsComeBackAndTheChannelGoesOn) {
  Session session = Open();
  auto buffer = session.Allocate(4096);
  ASSERT_THAT(buffer, IsOk());
  const uint64_t id = buffer->id();
  UniqueFd channel = OpenFramed(session);
  ASSERT_GE(channel.get(), 0);
  ASSERT_TRUE(
      SendBatch(channel.get(), Batch({MemsetCommand(1, id, 0, 0x01, 4096), SyncCommand(2)})));
  auto reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  ASSERT_FALSE(reply->has_error()) << reply->error().message();

  // A buffer that does not exist: the error names the command, the rest of the batch is
  // skipped.
  ASSERT_TRUE(SendBatch(channel.get(), Batch({MemsetCommand(3, id + 1000, 0, 0x77, 16),
                                              MemsetCommand(4, id, 0, 0x77, 16)})));
  reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  ASSERT_TRUE(reply->has_error());
  EXPECT_EQ(reply->error().sequence(), 3u);
  EXPECT_EQ(reply->error().code(), kNotFound) << reply->error().message();
  EXPECT_EQ(reply->skipped_from_sequence(), 4u);
  EXPECT_EQ(reply->processed_through_sequence(), 3u);

  // A range outside the buffer, after a command that ran.
  ASSERT_TRUE(SendBatch(channel.get(), Batch({MemsetCommand(5, id, 4000, 0x02, 16),
                                              MemsetCommand(6, id, 4000, 0x03, 200)})));
  reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  ASSERT_TRUE(reply->has_error());
  EXPECT_EQ(reply->error().sequence(), 6u);
  EXPECT_EQ(reply->error().code(), kInvalidArgument) << reply->error().message();
  EXPECT_THAT(reply->error().message(), HasSubstr("outside the buffer"));
  EXPECT_EQ(reply->skipped_from_sequence(), 0u);
  EXPECT_EQ(reply->processed_through_sequence(), 6u);

  // The channel still works: the skipped memset did not run, the refused one wrote nothing,
  // the one before it did.
  ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(7), DownloadCommand(8, id, 0, 4096)})));
  reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->has_error()) << reply->error().message();
  EXPECT_EQ(reply->processed_through_sequence(), 8u);
  ASSERT_EQ(reply->downloads_size(), 1);
  std::string expected(4096, '\x01');
  expected.replace(4000, 16, std::string(16, '\x02'));
  EXPECT_TRUE(reply->downloads(0).data() == expected);
}

TEST_F(HostRegionFramedTest, HostileFramesEndTheChannelAndNotTheWorker) {
  Session session = Open();
  auto buffer = session.Allocate(4096);
  ASSERT_THAT(buffer, IsOk());
  const uint64_t id = buffer->id();

  // Lengths above 80 MiB: one reply that says so, then the end.
  for (const uint32_t length : {0xffffffffu, kMaxFrameBytes + 1}) {
    SCOPED_TRACE(absl::StrCat("length ", length));
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendAll(channel.get(), FrameHeader(length)));
    auto reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), kInvalidArgument);
    EXPECT_THAT(reply->error().message(),
                HasSubstr(absl::StrCat("message 1 announces ", length, " bytes")));
    EXPECT_EQ(reply->processed_through_sequence(), 0u);
    EXPECT_THAT(AwaitEnd(channel.get()), IsOk());
  }
  {
    // Bytes that are not a CommandBatch (field 1 with wire type 7), after a good batch.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(1)})));
    ASSERT_TRUE(SendFrame(channel.get(), std::string("\x0f\x01garbage", 9)));
    auto reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    EXPECT_FALSE(reply->has_error()) << reply->error().message();
    EXPECT_EQ(reply->processed_through_sequence(), 1u);
    reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), kInvalidArgument);
    EXPECT_THAT(reply->error().message(),
                HasSubstr("message 2 (9 bytes) is not a gpurpc.v1.CommandBatch"));
    EXPECT_THAT(AwaitEnd(channel.get()), IsOk());
  }
  {
    // 64 MiB announced, a few bytes sent, then the client's end shut: no reply, the end.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendAll(channel.get(), FrameHeader(64 * kMiB) + "\x0a\x02"));
    ASSERT_EQ(shutdown(channel.get(), SHUT_WR), 0);
    EXPECT_THAT(AwaitEnd(channel.get()), IsOk());
  }
  // The worker lives on: the session works through the front end and on a new channel.
  EXPECT_THAT(session.Allocate(64), IsOk());
  EXPECT_THAT(session.Synchronize(), IsOk());
  UniqueFd channel = OpenFramed(session);
  ASSERT_GE(channel.get(), 0);
  ASSERT_TRUE(SendBatch(channel.get(), Batch({MemsetCommand(1, id, 0, 0x42, 8), SyncCommand(2),
                                              DownloadCommand(3, id, 0, 8)})));
  auto reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->has_error()) << reply->error().message();
  ASSERT_EQ(reply->downloads_size(), 1);
  EXPECT_EQ(reply->downloads(0).data(), std::string(8, '\x42'));
}

TEST_F(HostRegionFramedTest, SequencesThatDoNotIncreaseEndTheChannelAndRunNothing) {
  Session session = Open();
  auto buffer = session.Allocate(4096);
  ASSERT_THAT(buffer, IsOk());
  const uint64_t id = buffer->id();
  auto expect_refused = [](int fd, const std::string& message) {
    auto reply = ReadReply(fd);
    ASSERT_THAT(reply, IsOk());
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), kInvalidArgument) << reply->error().message();
    EXPECT_THAT(reply->error().message(), HasSubstr(message));
    EXPECT_THAT(AwaitEnd(fd), IsOk());
  };
  {
    // A number repeated inside a batch: nothing of the batch runs, not even its start.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(
        SendBatch(channel.get(), Batch({MemsetCommand(1, id, 0, 0x01, 4096), SyncCommand(2)})));
    auto reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    ASSERT_FALSE(reply->has_error()) << reply->error().message();
    ASSERT_TRUE(
        SendBatch(channel.get(), Batch({MemsetCommand(3, id, 0, 0x33, 16), SyncCommand(3)})));
    expect_refused(channel.get(), "sequence 3 does not increase (last was 3)");
    ASSERT_THAT(session.Synchronize(), IsOk());
    auto downloaded = buffer->Download(0, 16);
    ASSERT_THAT(downloaded, IsOk());
    EXPECT_EQ(*downloaded, std::vector<uint8_t>(16, 0x01));
  }
  {
    // Each channel counts on its own (1 again is fine here), but not backwards.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(1)})));
    auto reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    EXPECT_FALSE(reply->has_error()) << reply->error().message();
    ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(1)})));
    expect_refused(channel.get(), "sequence 1 does not increase (last was 1)");
  }
  {
    // Zero is not above the start.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(0)})));
    expect_refused(channel.get(), "sequence 0 does not increase (last was 0)");
  }
  {
    // Skipped commands used their numbers up.
    UniqueFd channel = OpenFramed(session);
    ASSERT_GE(channel.get(), 0);
    ASSERT_TRUE(SendBatch(channel.get(), Batch({MemsetCommand(1, id + 1000, 0, 0, 16),
                                                SyncCommand(2), SyncCommand(5)})));
    auto reply = ReadReply(channel.get());
    ASSERT_THAT(reply, IsOk());
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), kNotFound) << reply->error().message();
    EXPECT_EQ(reply->skipped_from_sequence(), 2u);
    ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(4)})));
    expect_refused(channel.get(), "sequence 4 does not increase (last was 5)");
  }
  EXPECT_THAT(session.Synchronize(), IsOk());
}

TEST_F(HostRegionFramedTest, FramedCommandsNeedADirectChannel) {
  Session session = Open();
  const v1::RegisterHostRegionResponse registered = Register(session, kMiB);
  Memfd memfd(kMiB);
  v1::AttachHostRegionRequest request;
  request.set_session_id(session.id());
  request.set_region_id(registered.region_id());
  request.set_ticket(registered.attach_ticket());
  request.set_framed_commands(true);
  v1::AttachHostRegionReply reply =
      SendAttach(registered.region_socket(), request.SerializeAsString(), {memfd.fd});
  EXPECT_EQ(reply.code(), kInvalidArgument) << reply.message();
  EXPECT_THAT(reply.message(), HasSubstr("framed_commands is for direct channels only"));
  // The front end refuses the shape before it looks for the session: a session that does
  // not exist is not what the answer is about.
  v1::AttachHostRegionRequest nowhere = request;
  nowhere.set_session_id(session.id() + 1000);
  const v1::AttachHostRegionReply refused =
      SendAttach(registered.region_socket(), nowhere.SerializeAsString(), {memfd.fd});
  EXPECT_EQ(refused.code(), kInvalidArgument) << refused.message();
  EXPECT_THAT(refused.message(), HasSubstr("direct_channel is not set"));
  // Refused before the ticket was looked at: it still attaches the region.
  request.set_framed_commands(false);
  reply = SendAttach(registered.region_socket(), request.SerializeAsString(), {memfd.fd});
  EXPECT_EQ(reply.code(), 0) << reply.message();
}

TEST_F(HostRegionFramedTest, FramedAndGrpcDirectChannelsShareTheBound) {
  Session session = Open();
  // One gRPC direct channel, in use.
  UniqueFd grpc_end;
  v1::AttachHostRegionReply reply = AttachChannel(session, /*framed=*/false, &grpc_end);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  auto direct = DirectChannelFromFd(grpc_end.release());  // gRPC owns the descriptor
  {
    v1::ExecutionService::Stub stub(direct);
    grpc::ClientContext context;
    v1::CreateStreamResponse created;
    const grpc::Status made = stub.CreateStream(&context, v1::CreateStreamRequest(), &created);
    ASSERT_TRUE(made.ok()) << made.error_message();
  }
  // Framed ones: 7 more fit (8 in all), the rest are refused.
  std::vector<UniqueFd> framed;
  int exhausted = 0;
  for (int i = 0; i < 10; ++i) {
    UniqueFd end;
    reply = AttachChannel(session, /*framed=*/true, &end);
    if (reply.code() == 0) {
      framed.push_back(std::move(end));
    } else {
      EXPECT_EQ(reply.code(), kResourceExhausted) << reply.message();
      EXPECT_THAT(reply.message(), HasSubstr("8 direct channels"));
      ++exhausted;
    }
  }
  ASSERT_EQ(framed.size(), 7u);
  EXPECT_EQ(exhausted, 3);
  // Every admitted one is served.
  for (const UniqueFd& end : framed) {
    ASSERT_TRUE(SendBatch(end.get(), Batch({SyncCommand(1)})));
    auto answered = ReadReply(end.get());
    ASSERT_THAT(answered, IsOk());
    EXPECT_FALSE(answered->has_error()) << answered->error().message();
  }
  // Closing a framed channel's end frees its place once the worker has seen it go.
  framed.back().reset();
  framed.pop_back();
  UniqueFd replacement;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (;;) {
    reply = AttachChannel(session, /*framed=*/true, &replacement);
    if (reply.code() != kResourceExhausted || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(reply.code(), 0) << reply.message();
  ASSERT_TRUE(SendBatch(replacement.get(), Batch({SyncCommand(1)})));
  auto answered = ReadReply(replacement.get());
  ASSERT_THAT(answered, IsOk());
  EXPECT_FALSE(answered->has_error()) << answered->error().message();
  // And the bound holds again.
  UniqueFd one_more;
  reply = AttachChannel(session, /*framed=*/true, &one_more);
  EXPECT_EQ(reply.code(), kResourceExhausted) << reply.message();
  // The gRPC channel still works alongside.
  v1::ExecutionService::Stub stub(direct);
  grpc::ClientContext context;
  v1::SynchronizeSessionResponse synced;
  const grpc::Status status =
      stub.SynchronizeSession(&context, v1::SynchronizeSessionRequest(), &synced);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// `count` copies of `element` (wire bytes made by hand).
std::string Repeated(const std::string& element, size_t count) {
  std::string out;
  out.reserve(element.size() * count);
  for (size_t i = 0; i < count; ++i) out += element;
  return out;
}

// `requests` (any bytes) to `method` on `channel`, then a half-close; the call's status.
grpc::Status RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::vector<std::string>& requests) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return testing::RawCall(channel, &context, method, requests).status;
}

// What a message would take once parsed is bounded before it is parsed on both of the
// worker's own paths, where no front end relays (server/parse_limit.h): a gRPC direct
// channel (typed unary requests and command batches) and a framed channel.
TEST_F(HostRegionFramedTest, MessagesThatWouldParseTooLargeAreRefusedOnTheDirectPaths) {
  Session session = Open();
  UniqueFd grpc_end;
  v1::AttachHostRegionReply reply = AttachChannel(session, /*framed=*/false, &grpc_end);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  auto direct = DirectChannelFromFd(grpc_end.release());  // gRPC owns the descriptor
  // 8 million unknown fields (field 15, varint), 2 bytes each, as a unary request.
  grpc::Status status = RawCall(direct, "/gpurpc.v1.ExecutionService/CreateStream",
                                {Repeated(std::string("\x78\x01", 2), 8'000'000)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("/gpurpc.v1.ExecutionService/CreateStream: the request (a "
                        "gpurpc.v1.CreateStreamRequest of 16000000 bytes) would take more than"));
  // 2.5 million empty commands in a batch, after a good one.
  status = RawCall(direct, "/gpurpc.v1.ExecutionService/CommandStream",
                   {Batch({SyncCommand(1)}).SerializeAsString(),
                    Repeated(std::string("\x0a\x00", 2), 2'500'000)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("CommandStream message 2 (a gpurpc.v1.CommandBatch of 5000000 bytes) "
                        "would take more than"));
  // The channel goes on.
  {
    v1::ExecutionService::Stub stub(direct);
    grpc::ClientContext context;
    v1::CreateStreamResponse created;
    const grpc::Status made = stub.CreateStream(&context, v1::CreateStreamRequest(), &created);
    EXPECT_TRUE(made.ok()) << made.error_message();
  }

  // A framed channel: the same batch, after a good one, is answered as a protocol error.
  UniqueFd channel = OpenFramed(session);
  ASSERT_GE(channel.get(), 0);
  ASSERT_TRUE(SendBatch(channel.get(), Batch({SyncCommand(1)})));
  ASSERT_TRUE(SendFrame(channel.get(), Repeated(std::string("\x0a\x00", 2), 2'500'000)));
  auto answered = ReadReply(channel.get());
  ASSERT_THAT(answered, IsOk());
  EXPECT_FALSE(answered->has_error()) << answered->error().message();
  answered = ReadReply(channel.get());
  ASSERT_THAT(answered, IsOk());
  ASSERT_TRUE(answered->has_error());
  EXPECT_EQ(answered->error().code(), kInvalidArgument);
  EXPECT_THAT(answered->error().message(),
              HasSubstr("framed command channel: message 2 (a gpurpc.v1.CommandBatch of 5000000 "
                        "bytes) would take more than"));
  EXPECT_THAT(AwaitEnd(channel.get()), IsOk());
  // A new framed channel works, and so does the session.
  UniqueFd again = OpenFramed(session);
  ASSERT_GE(again.get(), 0);
  ASSERT_TRUE(SendBatch(again.get(), Batch({SyncCommand(1)})));
  answered = ReadReply(again.get());
  ASSERT_THAT(answered, IsOk());
  EXPECT_FALSE(answered->has_error()) << answered->error().message();
  EXPECT_THAT(session.Synchronize(), IsOk());
}

TEST_F(HostRegionFramedTest, ClosingTheSessionEndsItsFramedChannels) {
  Session session = Open();
  UniqueFd idle = OpenFramed(session);
  ASSERT_GE(idle.get(), 0);
  ASSERT_TRUE(SendBatch(idle.get(), Batch({SyncCommand(1)})));
  auto reply = ReadReply(idle.get());
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->has_error()) << reply->error().message();
  // One waits in the middle of a message that never completes.
  UniqueFd stalled = OpenFramed(session);
  ASSERT_GE(stalled.get(), 0);
  ASSERT_TRUE(SendAll(stalled.get(), FrameHeader(64 * kMiB) + "\x0a\x02"));
  // Still open before the close.
  std::string bytes;
  EXPECT_THAT(ReadExactly(idle.get(), 1, absl::Now() + absl::Milliseconds(100), &bytes),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  ASSERT_THAT(session.Close(), IsOk());
  EXPECT_THAT(AwaitEnd(idle.get()), IsOk());
  EXPECT_THAT(AwaitEnd(stalled.get()), IsOk());
}

TEST_F(HostRegionFramedTest, AStickyFaultIsReportedOnceAndEndsTheChannel) {
  Session session = Open();
  CompileOptions options;
  options.source = testing::kFakeKernelsSource;
  auto compiled = session.Compile(options);
  ASSERT_THAT(compiled, IsOk());
  ASSERT_TRUE(compiled->success()) << compiled->log();
  auto fault = compiled->module.GetFunction("fault_illegal_address");
  ASSERT_THAT(fault, IsOk());
  UniqueFd channel = OpenFramed(session);
  ASSERT_GE(channel.get(), 0);
  v1::Command launch;
  launch.set_sequence(1);
  launch.mutable_launch()->set_function_id(fault->id());
  for (v1::Dim3* dim :
       {launch.mutable_launch()->mutable_grid(), launch.mutable_launch()->mutable_block()}) {
    dim->set_x(1);
    dim->set_y(1);
    dim->set_z(1);
  }
  ASSERT_TRUE(SendBatch(channel.get(), Batch({launch, SyncCommand(2), SyncCommand(3)})));
  auto reply = ReadReply(channel.get());
  ASSERT_THAT(reply, IsOk());
  ASSERT_TRUE(reply->has_error());
  EXPECT_EQ(reply->error().code(), static_cast<int>(absl::StatusCode::kAborted))
      << reply->error().message();
  EXPECT_THAT(reply->error().message(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_EQ(reply->processed_through_sequence(), reply->error().sequence());
  EXPECT_EQ(reply->skipped_from_sequence(), reply->error().sequence() + 1);
  EXPECT_THAT(AwaitEnd(channel.get()), IsOk());
}

}  // namespace
}  // namespace gpurpc
