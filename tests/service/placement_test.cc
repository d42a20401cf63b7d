// Sessions placed over several daemons (issue "Beyond one machine"), through the C++ client
// against three real gpurpcds with real worker processes (fake backend) on this box: the
// address list and dns:/// names, placement by free memory then sessions, daemons that are
// down or draining passed over, one daemon under two addresses counted once, one device list
// over all daemons, and a session's calls staying on its daemon. The ranking and the
// address parsing are also tested alone. Built twice: label `service` with the fake backend
// (three daemons), label `gpu` with the CUDA backend (GPURPC_TEST_BACKEND): two daemons
// sharing one real GPU, where the placement and memory tests run and the tests of client
// logic alone (down, draining, duplicate addresses, bad lists) skip.
#include <signal.h>
#include <sys/stat.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/src/daemons.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

#ifndef GPURPC_TEST_BACKEND
#define GPURPC_TEST_BACKEND "fake"
#endif
constexpr char kBackend[] = GPURPC_TEST_BACKEND;
bool OnFake() { return std::string(kBackend) == "fake"; }

constexpr uint64_t kGiB = uint64_t{1} << 30;
// ------------------------------------------------------------------ ranking and parsing

DaemonStatus Answered(const std::string& target, std::vector<std::pair<uint64_t, uint32_t>> devices,
                      bool accepting = true) {
  DaemonStatus daemon;
  daemon.target = target;
  daemon.devices.set_daemon_instance("instance-" + target);
  daemon.devices.set_accepting_sessions(accepting);
  int ordinal = 0;
  for (const auto& [free, sessions] : devices) {
    v1::DeviceInfo* device = daemon.devices.add_devices();
    device->set_ordinal(ordinal++);
    device->mutable_load()->set_free_memory_bytes(free);
    device->mutable_load()->set_sessions(sessions);
  }
  return daemon;
}

std::vector<std::string> Order(const std::vector<DaemonStatus>& daemons) {
  std::vector<std::string> order;
  for (const internal::PlacementCandidate& c : internal::RankDevices(daemons)) {
    order.push_back(absl::StrCat(daemons[c.daemon].target, "/", c.ordinal));
  }
  return order;
}

TEST(RankDevicesTest, MostFreeMemoryThenFewestSessionsThenOrder) {
  std::vector<DaemonStatus> daemons = {
      Answered("a", {{8 * kGiB, 3}, {8 * kGiB, 1}}),
      Answered("b", {{9 * kGiB, 5}}),
      Answered("c", {{8 * kGiB, 1}}),
  };
  EXPECT_THAT(Order(daemons), ElementsAre("b/0", "a/1", "c/0", "a/0"));
}

TEST(RankDevicesTest, FreeMemoryCountsInSteps) {
  // 100 MiB more free memory does not outweigh a session fewer.
  std::vector<DaemonStatus> daemons = {Answered("a", {{8 * kGiB + (100 << 20), 2}}),
                                       Answered("b", {{8 * kGiB, 1}})};
  EXPECT_THAT(Order(daemons), ElementsAre("b/0", "a/0"));
}

TEST(RankDevicesTest, PassesOverDownAndDrainingDaemons) {
  DaemonStatus down;
  down.target = "down";
  down.status = absl::UnavailableError("connection refused");
  std::vector<DaemonStatus> daemons = {down, Answered("draining", {{80 * kGiB, 0}}, false),
                                       Answered("up", {{1 * kGiB, 9}})};
  EXPECT_THAT(Order(daemons), ElementsAre("up/0"));
  const std::string why = internal::DescribeUnavailable(daemons);
  EXPECT_THAT(why, HasSubstr("down: connection refused"));
  EXPECT_THAT(why, HasSubstr("draining: draining"));
  // A daemon from before load reporting (no instance, no load) may take sessions.
  DaemonStatus old_daemon;
  old_daemon.target = "old";
  old_daemon.devices.add_devices()->set_ordinal(0);
  daemons.push_back(old_daemon);
  EXPECT_THAT(Order(daemons), ElementsAre("up/0", "old/0"));
}

TEST(ParseTargetsTest, ListsAndDnsNames) {
  auto specs = internal::ParseTargets(" unix:/a.sock , /b.sock,dns:///gpu.example:7000,h:1");
  ASSERT_THAT(specs, IsOk());
  ASSERT_EQ(specs->size(), 4u);
  EXPECT_EQ((*specs)[0].target, "unix:/a.sock");
  EXPECT_EQ((*specs)[1].target, "unix:/b.sock");
  EXPECT_TRUE((*specs)[2].resolve);
  EXPECT_EQ((*specs)[2].host, "gpu.example");
  EXPECT_EQ((*specs)[2].port, "7000");
  EXPECT_FALSE((*specs)[3].resolve);
}

TEST(ParseTargetsTest, RejectsEmptyEntriesAndPortlessNames) {
  EXPECT_THAT(internal::ParseTargets("unix:/a,,unix:/b"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty entry (entry 2)")));
  EXPECT_THAT(internal::ParseTargets("unix:/a,"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("entry 2")));
  EXPECT_THAT(internal::ParseTargets("dns:///gpu.example"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(internal::ParseTargets("dns:///:7000"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
}

TEST(ParseTargetsTest, ResolvesLoopbackName) {
  auto addresses = internal::ResolveAll("localhost", "7000");
  ASSERT_THAT(addresses, IsOk());
  EXPECT_FALSE(addresses->empty());
  for (const std::string& address : *addresses) EXPECT_THAT(address, HasSubstr(":7000"));
  EXPECT_THAT(internal::ResolveAll("no-such-host.invalid", "1"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot resolve")));
}

// ------------------------------------------------------------------ three daemons

class PlacementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!OnFake()) {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping placement on GPUs: " << cuda;
      }
    }
    for (int i = 0; i < (OnFake() ? 3 : 2); ++i) {
      TestDaemon::Options options;
      options.backend = kBackend;
      options.extra_flags = {"--drain-timeout=60s"};
      if (OnFake()) options.extra_flags.push_back(absl::StrCat("--fake-memory-bytes=", 4 * kGiB));
      options.warm_workers = 0;
      auto daemon = TestDaemon::Start(std::move(options));
      ASSERT_THAT(daemon, IsOk());
      daemons_.push_back(*std::move(daemon));
    }
  }

  std::string List() const {
    std::vector<std::string> addresses;
    for (const auto& daemon : daemons_) addresses.push_back(daemon->address());
    return absl::StrJoin(addresses, ",");
  }

  absl::StatusOr<Client> Connect(const std::string& address) const {
    ConnectOptions options;
    options.address = address;
    options.use_environment = false;
    options.timeout = absl::Seconds(10);
    return Client::Connect(options);
  }

  // Which daemon (index) holds `session`.
  int DaemonOf(const Session& session) const {
    for (size_t i = 0; i < daemons_.size(); ++i) {
      if (daemons_[i] != nullptr && session.daemon_target() == daemons_[i]->address()) return i;
    }
    return -1;
  }

  std::vector<std::unique_ptr<TestDaemon>> daemons_;
};

// The tests of the client's own logic need no GPU: the fake run covers them.
#define SKIP_ON_GPU() \
  if (!OnFake()) GTEST_SKIP() << "client logic alone: the fake backend's run covers it"

TEST_F(PlacementTest, SpreadsSessionsOverThreeDaemons) {
  auto client = Connect(List());
  ASSERT_THAT(client, IsOk());
  EXPECT_TRUE(client->multi_daemon());
  std::vector<Session> sessions;
  std::map<int, int> per_daemon;
  const int count = static_cast<int>(daemons_.size());
  for (int i = 0; i < 2 * count; ++i) {
    auto session = client->OpenSession(kAnyDevice, "placement");
    ASSERT_THAT(session, IsOk());
    ++per_daemon[DaemonOf(*session)];
    sessions.push_back(*std::move(session));
  }
  std::map<int, int> expected;
  for (int i = 0; i < count; ++i) expected[i] = 2;
  EXPECT_EQ(per_daemon, expected);
  // Every daemon reports its two sessions in its device's load.
  const std::vector<DaemonStatus> found = client->Daemons();
  ASSERT_EQ(found.size(), daemons_.size());
  for (const DaemonStatus& daemon : found) {
    ASSERT_THAT(daemon.status, IsOk());
    EXPECT_TRUE(daemon.devices.accepting_sessions());
    EXPECT_FALSE(daemon.devices.daemon_instance().empty());
    ASSERT_EQ(daemon.devices.devices_size(), 1);
    EXPECT_EQ(daemon.devices.devices(0).load().sessions(), 2u) << daemon.target;
  }
}

TEST_F(PlacementTest, FreeMemorySteersPlacementAndCallsStayOnTheirDaemon) {
  auto client = Connect(List());
  ASSERT_THAT(client, IsOk());
  auto first = client->OpenSession(kAnyDevice);
  ASSERT_THAT(first, IsOk());
  const int busy = DaemonOf(*first);
  ASSERT_EQ(busy, 0);  // all equal: the first in order
  auto buffer = first->Allocate(kGiB);
  ASSERT_THAT(buffer, IsOk());
  std::vector<uint8_t> bytes(4096, 0x5a);
  ASSERT_THAT(buffer->Upload(bytes), IsOk());
  // Daemon 0 now has 1 GiB less free: the next sessions go to the others, though daemon 0
  // has no more sessions than they will.
  std::vector<Session> others;
  for (size_t i = 0; i < daemons_.size(); ++i) {
    auto session = client->OpenSession(kAnyDevice);
    ASSERT_THAT(session, IsOk());
    EXPECT_NE(DaemonOf(*session), busy);
    others.push_back(*std::move(session));
  }
  // The buffer's bytes come back from the daemon that holds them, and only that daemon's
  // ledger counts them.
  auto back = buffer->Download(0, bytes.size());
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(*back, bytes);
  for (const DaemonStatus& daemon : client->Daemons()) {
    ASSERT_THAT(daemon.status, IsOk());
    const uint64_t allocated = daemon.devices.devices(0).load().allocated_bytes();
    if (daemon.target == daemons_[busy]->address()) {
      EXPECT_GE(allocated, kGiB);
      EXPECT_EQ(daemon.devices.devices(0).load().free_memory_bytes(),
                daemon.devices.devices(0).total_memory_bytes() - allocated);
    } else {
      EXPECT_LT(allocated, kGiB) << daemon.target;
    }
  }
}

TEST_F(PlacementTest, DaemonsThatAreDownArePassedOver) {
  SKIP_ON_GPU();
  const std::string list = List();
  const std::string down = daemons_[1]->address();
  daemons_[1].reset();  // stopped: its socket refuses
  auto client = Connect(list);
  ASSERT_THAT(client, IsOk());
  for (int i = 0; i < 4; ++i) {
    auto session = client->OpenSession(kAnyDevice);
    ASSERT_THAT(session, IsOk());
    EXPECT_NE(session->daemon_target(), down);
  }
  const std::vector<DaemonStatus> found = client->Daemons();
  ASSERT_EQ(found.size(), 3u);
  EXPECT_FALSE(found[1].status.ok());
  EXPECT_EQ(found[1].target, down);
  {
    // One list of devices over the daemons that answer: device 1 is daemon 2's.
    auto second = client->OpenSession(1);
    ASSERT_THAT(second, IsOk());
    EXPECT_EQ(DaemonOf(*second), 2);
  }
  EXPECT_THAT(client->OpenSession(2),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("serve 2 devices")));
  // All down: Connect names each.
  daemons_[0].reset();
  daemons_[2].reset();
  auto none = Connect(list);
  EXPECT_THAT(none, StatusIs(absl::StatusCode::kUnavailable, HasSubstr(down)));
  EXPECT_THAT(client->OpenSession(kAnyDevice),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no daemon can take")));
}

TEST_F(PlacementTest, DrainingDaemonIsPassedOver) {
  SKIP_ON_GPU();
  auto client = Connect(List());
  ASSERT_THAT(client, IsOk());
  auto held = client->OpenSession(0);  // keeps daemon 0 draining rather than gone
  ASSERT_THAT(held, IsOk());
  ASSERT_EQ(DaemonOf(*held), 0);
  ASSERT_EQ(kill(daemons_[0]->pid(), SIGTERM), 0);
  ASSERT_TRUE(Eventually([&] {
    const std::vector<DaemonStatus> found = client->Daemons();
    return found[0].status.ok() && !found[0].devices.accepting_sessions();
  }));
  for (int i = 0; i < 3; ++i) {
    auto session = client->OpenSession(kAnyDevice);
    ASSERT_THAT(session, IsOk());
    EXPECT_NE(DaemonOf(*session), 0);
  }
  // The session it holds goes on meanwhile.
  EXPECT_THAT(held->Allocate(4096), IsOk());
}

TEST_F(PlacementTest, OneDaemonUnderTwoAddressesCountsOnce) {
  SKIP_ON_GPU();
  // The same daemon twice by its socket path, and by an equivalent spelling of it.
  const std::string path = daemons_[2]->address().substr(5);  // strip "unix:"
  auto client = Connect(absl::StrCat(daemons_[2]->address(), ",", path, ",unix://", path));
  ASSERT_THAT(client, IsOk());
  const std::vector<DaemonStatus> found = client->Daemons();
  int answered = 0;
  for (const DaemonStatus& daemon : found) answered += daemon.status.ok() ? 1 : 0;
  EXPECT_EQ(answered, 1);
  auto session = client->OpenSession(0);
  ASSERT_THAT(session, IsOk());
  EXPECT_THAT(client->OpenSession(1), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(PlacementTest, BadAddressListsAreRefusedWithTheEntry) {
  SKIP_ON_GPU();
  EXPECT_THAT(Connect(absl::StrCat(daemons_[0]->address(), ",,", daemons_[1]->address())),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty entry (entry 2)")));
  EXPECT_THAT(Connect(absl::StrCat(daemons_[0]->address(), ",dns:///nohostport")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dns:///nohostport")));
  auto client = Connect(List());
  ASSERT_THAT(client, IsOk());
  EXPECT_THAT(client->OpenSession(-2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kAnyDevice")));
}

TEST(PlacementDnsTest, DnsNameReachesTheDaemonBehindIt) {
  SKIP_ON_GPU();
  absl::StatusOr<testing::TestToken> token = testing::MakeToken("dns-user");
  ASSERT_THAT(token, IsOk());
  char tmpl[] = "/tmp/gpurpc-placement-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string tokens_file = absl::StrCat(tmpl, "/tokens");
  FILE* f = fopen(tokens_file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fprintf(f, "%s\n", token->line.c_str());
  fclose(f);
  ASSERT_EQ(chmod(tokens_file.c_str(), 0600), 0);
  TestDaemon::Options options;
  options.listen_tcp = true;
  options.extra_flags = {"--tokens-file=" + tokens_file};
  auto daemon = TestDaemon::Start(std::move(options));
  ASSERT_THAT(daemon, IsOk());
  const std::string port = (*daemon)->tcp_address().substr((*daemon)->tcp_address().rfind(':') + 1);
  // With a second, unreachable daemon in the list, so that placement runs.
  auto unused = testing::FreeLoopbackPort();
  ASSERT_THAT(unused, IsOk());
  ConnectOptions connect;
  connect.address = absl::StrCat("dns:///localhost:", port, ",127.0.0.1:", *unused);
  connect.token = token->token;
  connect.use_environment = false;
  auto client = Client::Connect(connect);
  ASSERT_THAT(client, IsOk());
  auto session = client->OpenSession(kAnyDevice);
  ASSERT_THAT(session, IsOk());
  EXPECT_THAT(session->daemon_target(), HasSubstr(absl::StrCat(":", port)));
  auto info = client->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->tenant(), "dns-user");
  EXPECT_THAT(session->Allocate(1024), IsOk());
  std::system(absl::StrCat("rm -rf '", tmpl, "'").c_str());
}

}  // namespace
}  // namespace gpurpc
