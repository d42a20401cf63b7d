// Same-host regions (HostRegionService and the region socket), through the C++ client and
// by hand on the region socket, against a real gpurpcd with real worker processes (fake
// backend): the data path, the limits and quota, and every way a local attacker could try
// to attach memory that is not theirs or that would hurt the worker. Compiled twice: label
// `service` with the fake backend, label `gpu` with the CUDA backend (GPURPC_TEST_BACKEND),
// where the worker really pins the memfd (cuMemHostRegister) and copies are DMA; it skips
// without a driver.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
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
  Session session = Open();
  EXPECT_THAT(session.CreateHostRegion(kMiB),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no region socket")));
  // Everything else works.
  EXPECT_THAT(session.Allocate(kMiB), IsOk());
}

}  // namespace
}  // namespace gpurpc
