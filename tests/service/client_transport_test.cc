// How the C++ client waits for the daemon (client/cpp/src/transport.h), against a real gpurpcd
// on the fake backend (ctest label `service`):
// - no gRPC callback-API thread ever starts in a client process (their presence makes every
//   call hand its answer over between threads), whatever the client does;
// - streamed transfers on raw messages (chunks copied once, into pooled buffers, straight into
//   the caller's memory on the way back) carry every byte of odd sizes and offsets, and a bad
//   range or a buffer too small is refused;
// - a large transfer split over several connections (ConnectOptions::transfer_connections)
//   carries every byte, opens its connections, and a bad range is refused whole;
// - several threads waiting on one session's command stream take turns driving it: all of them
//   get their answers, and with a stopped daemon every one of them returns at its deadline.
// No timing assertions: what must not hang has a generous bound.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr absl::Duration kMustNotHang = absl::Seconds(30);
constexpr uint64_t kMiB = 1 << 20;

// The names of this process's threads.
std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return names;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat("/proc/self/task/", entry->d_name, "/comm"));
    std::string name;
    std::getline(comm, name);
    names.push_back(name);
  }
  closedir(tasks);
  return names;
}

std::vector<uint8_t> Pattern(size_t size, uint8_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
  return bytes;
}

absl::StatusOr<Client> Connect(const std::string& address,
                               absl::Duration call_timeout = absl::Seconds(60),
                               int transfer_connections = 4) {
  ConnectOptions options;
  options.address = address;
  options.use_environment = false;
  options.call_timeout = call_timeout;
  options.transfer_connections = transfer_connections;
  return Client::Connect(options);
}

// Sockets this process holds open.
int OpenSockets() {
  int sockets = 0;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return -1;
  while (dirent* entry = readdir(fds)) {
    char target[256];
    const std::string path = absl::StrCat("/proc/self/fd/", entry->d_name);
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n > 0 && std::string(target, static_cast<size_t>(n)).rfind("socket:", 0) == 0) ++sockets;
  }
  closedir(fds);
  return sockets;
}

// True once every thread of `pid` is stopped.
bool AllThreadsStopped(pid_t pid) {
  DIR* tasks = opendir(absl::StrCat("/proc/", pid, "/task").c_str());
  if (tasks == nullptr) return false;
  bool stopped = true;
  int seen = 0;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream stat(absl::StrCat("/proc/", pid, "/task/", entry->d_name, "/stat"));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) continue;
    ++seen;
    if (line[paren + 2] != 'T' && line[paren + 2] != 't') stopped = false;
  }
  closedir(tasks);
  return stopped && seen > 0;
}

class ClientTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto daemon = TestDaemon::Start();
    ASSERT_OK(daemon.status());
    daemon_ = *std::move(daemon);
  }
  std::unique_ptr<TestDaemon> daemon_;
};

TEST_F(ClientTransportTest, NoGrpcCallbackThreadStartsInTheClient) {
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function add_one, module.GetFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(3 * kMiB));
  const std::vector<uint8_t> data = Pattern(3 * kMiB, 1);
  ASSERT_OK(buffer.Upload(data));  // streamed
  LaunchConfig config;
  config.block = Dim3{32, 1, 1};
  for (int i = 0; i < 20; ++i) {
    ASSERT_OK(add_one.LaunchAsync(config, buffer, uint64_t{0}));
    ASSERT_OK(session.Synchronize());
  }
  ASSERT_OK(add_one.Launch(config, buffer, uint64_t{0}));  // unary
  ASSERT_OK(session.KeepAlive().status());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download());  // streamed
  EXPECT_EQ(back, data);
  ASSERT_OK(client.GetServerInfo().status());
  // An idle moment: the background thread serves the watch meanwhile. A fixed time is the
  // point: no callback thread may start while the client idles (past kBackgroundQuiet).
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_OK(session.Close());
  for (const std::string& name : ThreadNames()) {
    EXPECT_NE(name, "nexting_thread") << "a gRPC callback-API thread runs in the client";
  }
}

TEST_F(ClientTransportTest, StreamedTransfersOfOddSizesCarryEveryByte) {
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(9 * kMiB));
  for (uint64_t size : {kMiB + 1, 2 * kMiB + kMiB / 2 + 7, 4 * kMiB, 8 * kMiB + 3}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{13}}) {
      SCOPED_TRACE(absl::StrCat(size, " bytes at ", offset));
      const std::vector<uint8_t> data = Pattern(size, static_cast<uint8_t>(size + offset));
      ASSERT_OK(buffer.Upload(data, offset));
      ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download(offset, size));
      ASSERT_EQ(back.size(), data.size());
      EXPECT_TRUE(back == data) << "the bytes differ";
      // Into the caller's memory, at an offset of a larger span.
      std::vector<uint8_t> into(size + 5, 0xee);
      ASSERT_OK(session.DownloadInto(buffer.at(offset), absl::MakeSpan(into).subspan(5, size)));
      EXPECT_TRUE(std::equal(data.begin(), data.end(), into.begin() + 5)) << "the bytes differ";
      EXPECT_EQ(into[0], 0xee);
    }
  }
  // Past the buffer's end: refused by the daemon, naming the range.
  const std::vector<uint8_t> too_much = Pattern(2 * kMiB, 3);
  EXPECT_THAT(buffer.Upload(too_much, 8 * kMiB), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(buffer.Download(8 * kMiB, 2 * kMiB).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // The session works on.
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> start, buffer.Download(0, 16));
  EXPECT_EQ(start.size(), 16u);
}

// A large transfer goes as parts on several connections (ConnectOptions::transfer_connections)
// and carries every byte, whichever way it is read back; a bad range is refused whole, with
// nothing written; a smaller one, or a client of one connection, opens no other connection.
TEST_F(ClientTransportTest, LargeTransfersSplitOverConnectionsCarryEveryByte) {
  ASSERT_OK_AND_ASSIGN(Client one, Connect(daemon_->address(), absl::Seconds(60), 1));
  ASSERT_OK_AND_ASSIGN(Client four, Connect(daemon_->address(), absl::Seconds(60), 4));
  ASSERT_OK_AND_ASSIGN(Session single, one.OpenSession());
  ASSERT_OK_AND_ASSIGN(Session parted, four.OpenSession());
  constexpr uint64_t kSize = 40 * kMiB + 12345;  // 5 parts' worth, cut at whole chunks
  ASSERT_OK_AND_ASSIGN(Buffer buffer, parted.Allocate(kSize + 100));
  const std::vector<uint8_t> small = Pattern(12 * kMiB, 9);

  // Below two parts' size: one stream, no other connection.
  const int sockets_before = OpenSockets();
  ASSERT_OK(buffer.Upload(small, 3));
  EXPECT_EQ(OpenSockets(), sockets_before);

  // In parts: three more connections, and every byte where it belongs.
  const std::vector<uint8_t> data = Pattern(kSize, 5);
  ASSERT_OK(buffer.Upload(data, 7));
  EXPECT_EQ(OpenSockets(), sockets_before + 3);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download(7, kSize));
  EXPECT_TRUE(back == data) << "the bytes read back in parts differ";
  std::vector<uint8_t> into(kSize, 0);
  ASSERT_OK(parted.DownloadInto(buffer.at(7), absl::MakeSpan(into)));
  EXPECT_TRUE(into == data) << "the bytes read back into the caller's memory differ";

  // Written as one stream (a raw address is never split), read back in parts; and a client of
  // one connection moves the same bytes as one stream each way.
  const std::vector<uint8_t> other = Pattern(kSize, 6);
  ASSERT_NE(buffer.at(7).device_address, 0u);
  ASSERT_OK(parted.Upload(DeviceRef::Address(buffer.at(7).device_address), other));
  ASSERT_OK_AND_ASSIGN(back, buffer.Download(7, kSize));
  EXPECT_TRUE(back == other) << "bytes written as one stream read back in parts differ";
  ASSERT_OK(buffer.Upload(data, 7));
  ASSERT_OK_AND_ASSIGN(Buffer alone, single.Allocate(kSize));
  const int sockets_single = OpenSockets();
  ASSERT_OK(alone.Upload(data));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> single_back, alone.Download());
  EXPECT_TRUE(single_back == data) << "the bytes a one-connection client read back differ";
  EXPECT_EQ(OpenSockets(), sockets_single);

  // Past the buffer's end, in parts' size: refused as one stream would refuse it, and
  // nothing written (the parts before the end would have been).
  const std::vector<uint8_t> too_much = Pattern(32 * kMiB, 11);
  const absl::Status refused = buffer.Upload(too_much, 16 * kMiB);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(refused.message(), HasSubstr("UploadStream destination"));
  ASSERT_OK_AND_ASSIGN(back, buffer.Download(7, kSize));
  EXPECT_TRUE(back == data) << "a refused upload wrote some of its bytes";
  EXPECT_THAT(buffer.Download(16 * kMiB, 32 * kMiB).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(ClientTransportTest, TransferConnectionsOutOfRangeAreRefusedAtConnect) {
  for (int connections : {0, -1, kMaxTransferConnections + 1}) {
    EXPECT_THAT(Connect(daemon_->address(), absl::Seconds(60), connections).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("ConnectOptions::transfer_connections")))
        << connections;
  }
  ConnectOptions options;
  options.address = daemon_->address();
  for (const char* value : {"0", "17", "four", "4x", ""}) {
    setenv("GPURPC_TRANSFER_CONNECTIONS", value, 1);
    const absl::StatusOr<Client> client = Client::Connect(options);
    if (std::string(value).empty()) {
      EXPECT_OK(client.status());  // unset: the option's value
    } else {
      EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("GPURPC_TRANSFER_CONNECTIONS")))
          << value;
    }
  }
  setenv("GPURPC_TRANSFER_CONNECTIONS", "2", 1);
  EXPECT_OK(Client::Connect(options).status());
  unsetenv("GPURPC_TRANSFER_CONNECTIONS");
  // Checked before connecting: with no daemon there, or an address list of several daemons,
  // a bad value is still named (not UNAVAILABLE, not ignored).
  for (const std::string& address : {std::string("unix:") + daemon_->dir() + "/nobody-here.sock",
                                     absl::StrCat(daemon_->address(), ",", daemon_->address())}) {
    ConnectOptions bad;
    bad.address = address;
    bad.timeout = absl::Seconds(2);
    bad.transfer_connections = 0;
    EXPECT_THAT(Client::Connect(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("ConnectOptions::transfer_connections")))
        << address;
  }
}

TEST_F(ClientTransportTest, ThreadsWaitingOnOneCommandStreamTakeTurnsDrivingIt) {
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  constexpr int kThreads = 6;
  constexpr int kRounds = 100;
  std::vector<Buffer> buffers;
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(256 * 4));
    buffers.push_back(std::move(buffer));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      LaunchConfig config;
      config.block = Dim3{256, 1, 1};
      for (int round = 0; round < kRounds; ++round) {
        const unsigned value = static_cast<unsigned>(t * 1000 + round);
        if (!fill.LaunchAsync(config, buffers[t], value, uint64_t{256}).ok() ||
            !session.Synchronize().ok()) {
          ++failures;
          return;
        }
        absl::StatusOr<std::vector<uint8_t>> back = buffers[t].Download();
        if (!back.ok() || back->size() != 256 * 4 ||
            *reinterpret_cast<const unsigned*>(back->data() + 4 * 255) != value) {
          ++failures;
          return;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(ClientTransportTest, EveryWaiterOfAStoppedDaemonReturnsAtItsDeadline) {
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(1024));
  ASSERT_OK(session.MemsetAsync(buffer.at(), 0, 4, 256));
  ASSERT_OK(session.Synchronize());
  ASSERT_EQ(kill(daemon_->pid(), SIGSTOP), 0);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!AllThreadsStopped(daemon_->pid()) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  constexpr int kWaiters = 4;
  std::vector<absl::Status> results(kWaiters);
  std::vector<std::thread> waiters;
  const absl::Time started = absl::Now();
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&, i] {
      absl::Status queued = session.MemsetAsync(buffer.at(), i, 4, 256);
      results[i] = queued.ok() ? session.Synchronize(absl::Seconds(1)) : queued;
    });
  }
  for (std::thread& waiter : waiters) waiter.join();
  const absl::Duration took = absl::Now() - started;
  kill(daemon_->pid(), SIGCONT);
  EXPECT_LT(took, kMustNotHang);
  for (const absl::Status& result : results) {
    EXPECT_THAT(result, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("1s")));
  }
  // Once the daemon runs again, the session works.
  EXPECT_OK(session.Synchronize());
  EXPECT_OK(session.GetMemInfo().status());
}

}  // namespace
}  // namespace gpurpc
