// Graceful drain (--drain-timeout): what a rolling update (Kubernetes' SIGTERM, then SIGKILL
// after the grace period) sees, through the C++ client against a real gpurpcd with real
// worker processes (fake backend). On SIGTERM health turns NOT_SERVING at once, new sessions
// are refused with UNAVAILABLE saying why, and open sessions go on until they close (then the
// daemon exits), until the drain timeout, or until a second signal.
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

class DrainTest : public ::testing::Test {
 protected:
  void Start(const std::string& drain_timeout) {
    auto port = testing::FreeLoopbackPort();
    ASSERT_THAT(port, IsOk());
    health_address_ = absl::StrCat("127.0.0.1:", *port);
    TestDaemon::Options options;
    options.extra_flags = {"--drain-timeout=" + drain_timeout,
                           "--health-listen=" + health_address_};
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
  }

  // grpc.health.v1.Health/Check of service "": 1 SERVING, 2 NOT_SERVING, -1 no answer.
  int Health() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const testing::RawCallResult call =
        testing::RawCall(grpc::CreateChannel(health_address_, grpc::InsecureChannelCredentials()),
                         &context, "/grpc.health.v1.Health/Check", {""});
    // A unary answer: exactly one message.
    if (!call.status.ok() || call.responses.size() != 1) return -1;
    const std::string& bytes = call.responses[0];
    // HealthCheckResponse { ServingStatus status = 1; }: "\x08" then the value.
    return bytes.size() == 2 && bytes[0] == '\x08' ? bytes[1] : -1;
  }

  void Signal(int signal_number) { ASSERT_EQ(kill(daemon_->pid(), signal_number), 0); }

  bool NewSessionsRefused() {
    auto refused = client_->OpenSession(0, "drain test, too late");
    return !refused.ok() && refused.status().code() == absl::StatusCode::kUnavailable &&
           absl::StrContains(refused.status().message(), "shutting down");
  }

  bool Exited() { return !daemon_->CheckRunning().ok(); }

  std::string health_address_;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(DrainTest, OpenSessionsFinishNewOnesAreRefusedAndTheDaemonExitsWhenTheyClose) {
  Start("60s");
  EXPECT_EQ(Health(), 1);
  auto session = client_->OpenSession(0, "drain test");
  ASSERT_THAT(session, IsOk());
  auto buffer = session->Allocate(4096);
  ASSERT_THAT(buffer, IsOk());
  ASSERT_THAT(buffer->Upload(std::vector<uint8_t>(4096, 7)), IsOk());

  Signal(SIGTERM);
  // Probe only once the drain has begun and counted the open session: a probe that came
  // earlier would open a session of its own, which the count would include.
  ASSERT_TRUE(Eventually([&] {
    return absl::StrContains(daemon_->Log(), "draining: 1 session(s) open");
  })) << daemon_->Log();
  EXPECT_TRUE(NewSessionsRefused()) << "OpenSession was not refused after SIGTERM";
  auto refused = client_->OpenSession(0, "drain test, too late");
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("another daemon")));
  EXPECT_EQ(Health(), 2);  // NOT_SERVING while the open session goes on

  // The open session works as before: new memory, its old bytes, a new connection of the
  // same client (the listeners stay open for it).
  auto more = session->Allocate(1024);
  ASSERT_THAT(more, IsOk());
  auto bytes = buffer->Download();
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(*bytes, std::vector<uint8_t>(4096, 7));
  auto reconnected = Client::Connect(daemon_->address());
  ASSERT_THAT(reconnected, IsOk());
  EXPECT_THAT(reconnected->ListDevices(), IsOk());
  EXPECT_FALSE(Exited());

  // Its close is the last: the daemon ends without waiting for the drain timeout (60 s).
  ASSERT_THAT(session->Close(), IsOk());
  EXPECT_TRUE(Eventually([&] { return Exited(); })) << daemon_->Log();
}

TEST_F(DrainTest, TheDrainTimeoutEndsSessionsThatDoNotClose) {
  Start("1s");
  auto session = client_->OpenSession(0, "drain test, never closes");
  ASSERT_THAT(session, IsOk());
  Signal(SIGTERM);
  EXPECT_TRUE(Eventually([&] { return Exited(); })) << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), HasSubstr("drain timeout (1s) reached"));
  // The client learns that its session is gone at its next call.
  EXPECT_FALSE(session->Allocate(64).ok());
}

TEST_F(DrainTest, ASecondSignalStopsAtOnce) {
  Start("10m");
  auto session = client_->OpenSession(0, "drain test, second signal");
  ASSERT_THAT(session, IsOk());
  Signal(SIGTERM);
  ASSERT_TRUE(Eventually([&] { return NewSessionsRefused(); }));
  EXPECT_FALSE(Exited());
  Signal(SIGINT);
  EXPECT_TRUE(Eventually([&] { return Exited(); })) << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), HasSubstr("while draining: stopping the workers"));
}

TEST_F(DrainTest, WithNoSessionOpenTheDaemonExitsAtOnce) {
  Start("10m");
  Signal(SIGTERM);
  EXPECT_TRUE(Eventually([&] { return Exited(); })) << daemon_->Log();
}

TEST_F(DrainTest, TheDrainTimeoutFlagIsChecked) {
  for (const char* bad : {"--drain-timeout=soon", "--drain-timeout=-1s"}) {
    TestDaemon::Options options;
    options.extra_flags = {bad};
    auto daemon = TestDaemon::Start(std::move(options));
    EXPECT_THAT(daemon.status(),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("--drain-timeout")))
        << bad;
  }
}

}  // namespace
}  // namespace gpurpc
