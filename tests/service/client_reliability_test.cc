// The C++ client when things go wrong (ctest label `service`): call deadlines, Close with the
// daemon stopped or killed, the reclaim of a killed client's session after the grace period,
// an idle client that keeps its session by watching it, a fault delivered by the watch, and
// a daemon restart (the old session answers NOT_FOUND saying so; the same Client opens a new
// session). Against real gpurpcd processes on the fake backend, whose spin_us kernel runs on a
// stream thread (a launch returns at once, as on a GPU).
//
// No timing assertions: what must happen is polled for with generous deadlines, and what must
// not hang is given a generous upper bound.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

extern char** environ;

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr absl::Duration kMustNotHang = absl::Seconds(30);

// Environment of the child process of KilledClientsSessionIsReclaimedAfterTheGrace.
constexpr char kChildAddressEnv[] = "GPURPC_RELIABILITY_CHILD_ADDRESS";
constexpr char kChildOutputEnv[] = "GPURPC_RELIABILITY_CHILD_OUTPUT";

// The fake backend's built-in kernels as real CUDA (tests/testing/fake_kernels.h).
constexpr const char* kFakeKernels = ::gpurpc::testing::kFakeKernelsSource;

// A client of `address` with only what is set here (GPURPC_* of the test's environment must
// not change how the test talks to its daemon).
absl::StatusOr<Client> Connect(const std::string& address,
                               absl::Duration call_timeout = absl::Seconds(60)) {
  ConnectOptions options;
  options.address = address;
  options.use_environment = false;
  options.call_timeout = call_timeout;
  return Client::Connect(options);
}

// True once every thread of `pid` is stopped ('T' in /proc/PID/task/TID/stat): SIGSTOP takes
// effect a moment after kill() returns, and a thread still running could answer a call.
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
    // pid (comm) state ...; comm may contain spaces: the state follows the last ')'.
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) continue;
    ++seen;
    if (line[paren + 2] != 'T' && line[paren + 2] != 't') stopped = false;
  }
  closedir(tasks);
  return stopped && seen > 0;
}

// True while thread `tid` of this process sleeps ('S' in /proc/self/task/TID/stat): blocked
// in the kernel, as a thread waiting for an answer is.
bool ThreadSleeps(pid_t tid) {
  std::ifstream stat(absl::StrCat("/proc/self/task/", tid, "/stat"));
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'S';
}

// SIGSTOPs a process for the object's lifetime (SIGCONT at the end, also when a test fails).
// ok() once every thread of it has stopped.
class Stopped {
 public:
  explicit Stopped(pid_t pid) : pid_(pid) {
    if (pid_ <= 0 || kill(pid_, SIGSTOP) != 0) return;
    sent_ = true;
    ok_ = Eventually([&] { return AllThreadsStopped(pid_); }, absl::Seconds(10));
  }
  ~Stopped() {
    if (sent_) kill(pid_, SIGCONT);
  }
  bool ok() const { return ok_; }

 private:
  pid_t pid_;
  bool sent_ = false;
  bool ok_ = false;
};

// How long `f` takes.
absl::Duration Timed(const std::function<void()>& f) {
  const absl::Time start = absl::Now();
  f();
  return absl::Now() - start;
}

class ClientReliabilityTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> extra_flags = {}, std::string idle_timeout = "30s") {
    TestDaemon::Options options;
    options.idle_timeout = std::move(idle_timeout);
    options.extra_flags = std::move(extra_flags);
    auto daemon = TestDaemon::Start(options);
    ASSERT_OK(daemon.status());
    daemon_ = *std::move(daemon);
  }

  std::unique_ptr<TestDaemon> daemon_;
};

// ------------------------------------------------------------------------ deadlines

TEST_F(ClientReliabilityTest, SynchronizeOfALongKernelEndsAtItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(90)));
  EXPECT_EQ(client.call_timeout(), absl::Seconds(90));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  EXPECT_EQ(session.call_timeout(), absl::Seconds(90));
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function spin, module.GetFunction("spin_us"));
  // 30 s of "GPU" work; the launch itself returns once it is queued.
  ASSERT_OK(spin.Launch({}, uint64_t{30'000'000}));

  absl::Status synced;
  const absl::Duration took = Timed([&] { synced = session.Synchronize(absl::Seconds(1)); });
  EXPECT_THAT(synced, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("Session::Synchronize"), HasSubstr("1s"),
                                     HasSubstr("does not cancel"))));
  EXPECT_LT(took, kMustNotHang);

  // The session's own call timeout bounds a Synchronize without one.
  session.set_call_timeout(absl::Milliseconds(500));
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("500ms")));

  // The session stays usable: a deadline does not fault it.
  session.set_call_timeout(absl::Seconds(60));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_EQ(session.state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_OK(session.fault());
  EXPECT_OK(session.GetMemInfo().status());
  // Closing does not wait for the kernel.
  absl::Status closed;
  EXPECT_LT(Timed([&] { closed = session.Close(); }), kMustNotHang);
  EXPECT_OK(closed);
}

TEST_F(ClientReliabilityTest, UnaryCallsOfAStoppedDaemonEndAtTheCallTimeout) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(4 << 20));
  Stopped stopped(daemon_->pid());
  ASSERT_TRUE(stopped.ok());
  absl::Status status;
  EXPECT_LT(Timed([&] { status = session.GetMemInfo().status(); }), kMustNotHang);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("GetMemInfo"), HasSubstr("1s"))));
  EXPECT_THAT(client.GetServerInfo().status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("GetServerInfo")));
  // A streamed transfer (4 MiB: chunks) ends when a chunk makes no progress.
  const std::vector<uint8_t> data(4 << 20, 7);
  EXPECT_LT(Timed([&] { status = buffer.Upload(data); }), kMustNotHang);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(Timed([&] { status = buffer.Download().status(); }), kMustNotHang);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(ClientReliabilityTest, TheTimeoutComesFromTheEnvironment) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ConnectOptions options;
  options.address = daemon_->address();
  struct Case {
    const char* value;
    absl::Duration expected;  // ZeroDuration: refused
  };
  for (const Case& c : {Case{"90s", absl::Seconds(90)}, Case{"2.5", absl::Milliseconds(2500)},
                        Case{"10m", absl::Minutes(10)}, Case{"soon", absl::ZeroDuration()},
                        Case{"-3", absl::ZeroDuration()}, Case{"0", absl::ZeroDuration()}}) {
    SCOPED_TRACE(c.value);
    setenv("GPURPC_TIMEOUT", c.value, 1);
    absl::StatusOr<Client> client = Client::Connect(options);
    if (c.expected == absl::ZeroDuration()) {
      EXPECT_THAT(client.status(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("GPURPC_TIMEOUT")));
    } else {
      ASSERT_OK(client.status());
      EXPECT_EQ(client->call_timeout(), c.expected);
    }
  }
  unsetenv("GPURPC_TIMEOUT");
  ASSERT_OK_AND_ASSIGN(Client defaults, Client::Connect(options));
  EXPECT_EQ(defaults.call_timeout(), absl::Minutes(5));
  options.call_timeout = absl::Seconds(7);  // explicit wins over the environment
  setenv("GPURPC_TIMEOUT", "90s", 1);
  ASSERT_OK_AND_ASSIGN(Client explicit_timeout, Client::Connect(options));
  unsetenv("GPURPC_TIMEOUT");
  EXPECT_EQ(explicit_timeout.call_timeout(), absl::Seconds(7));
}

// ------------------------------------------------------------------------ Close

TEST_F(ClientReliabilityTest, CloseReturnsWhileTheDaemonIsStopped) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(1024));
  ASSERT_OK(session.MemsetAsync(buffer.at(), 0, 4, 256));
  ASSERT_OK(session.Synchronize());
  ASSERT_OK_AND_ASSIGN(Session destroyed, client.OpenSession());
  {
    Stopped stopped(daemon_->pid());
    ASSERT_TRUE(stopped.ok());
    // A Synchronize waiting on the stopped daemon (its call timeout is 120 s) ends when
    // the session closes.
    ASSERT_OK(session.MemsetAsync(buffer.at(), 1, 4, 256));
    absl::Status synced;
    std::atomic<pid_t> waiter_tid{0};
    std::thread waiter([&] {
      waiter_tid = static_cast<pid_t>(syscall(SYS_gettid));
      synced = session.Synchronize();
    });
    // The waiter has sent its Synchronize and sleeps, waiting for the daemon's answer.
    EXPECT_TRUE(Eventually([&] { return waiter_tid.load() != 0 && ThreadSleeps(waiter_tid); }))
        << "the waiter does not wait";
    absl::Status closed;
    EXPECT_LT(Timed([&] { closed = session.Close(); }), kMustNotHang);
    EXPECT_THAT(closed, AnyOf(StatusIs(absl::StatusCode::kDeadlineExceeded),
                              StatusIs(absl::StatusCode::kUnavailable)));
    EXPECT_LT(Timed([&] { waiter.join(); }), kMustNotHang);
    EXPECT_FALSE(synced.ok()) << synced;
    EXPECT_THAT(session.GetMemInfo().status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
    // Destruction is bounded the same way, and so are the handles' cleanups.
    EXPECT_LT(Timed([&] {
                buffer = Buffer();
                destroyed = Session();
              }),
              kMustNotHang);
  }
  // Once the daemon runs again, the client works.
  ASSERT_OK_AND_ASSIGN(Session again, client.OpenSession());
  EXPECT_OK(again.GetMemInfo().status());
}

TEST_F(ClientReliabilityTest, CloseReturnsWhenTheDaemonWasKilled) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(1024));
  ASSERT_OK(session.MemsetAsync(buffer.at(), 0, 4, 256));
  ASSERT_OK(session.Synchronize());
  ASSERT_EQ(kill(daemon_->pid(), SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] { return !daemon_->CheckRunning().ok(); }));
  // The calls fail (the daemon is gone) without hanging.
  absl::Status status;
  EXPECT_LT(Timed([&] { status = session.Synchronize(); }), kMustNotHang);
  EXPECT_FALSE(status.ok());
  EXPECT_LT(Timed([&] { status = session.Close(); }), kMustNotHang);
  EXPECT_FALSE(status.ok());
}

// ------------------------------------------------------------------------ liveness

// The child process of KilledClientsSessionIsReclaimedAfterTheGrace (run only by it): opens a
// session, says its id, and waits to be killed.
TEST(ClientReliabilityChild, DISABLED_HoldASessionUntilKilled) {
  const char* address = std::getenv(kChildAddressEnv);
  const char* output = std::getenv(kChildOutputEnv);
  ASSERT_TRUE(address != nullptr && output != nullptr) << "run by the parent test only";
  ASSERT_OK_AND_ASSIGN(Client client, Connect(address));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  {
    std::ofstream out(absl::StrCat(output, ".tmp"));
    out << session.id() << "\n";
  }
  ASSERT_EQ(rename(absl::StrCat(output, ".tmp").c_str(), output), 0);
  absl::SleepFor(absl::Minutes(5));  // a fixed time is the point: held until the parent kills it
}

TEST_F(ClientReliabilityTest, KilledClientsSessionIsReclaimedAfterTheGrace) {
  // The idle timeout is far away: only the grace after the watch ended can reclaim it.
  ASSERT_NO_FATAL_FAILURE(Start({"--session-grace=2s"}, "600s"));
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address()));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse before, client.GetServerInfo());
  ASSERT_EQ(before.sessions_open(), 0u);

  const std::string output = absl::StrCat(daemon_->dir(), "/child-session");
  const std::string log = absl::StrCat(daemon_->dir(), "/child.log");
  std::vector<std::string> args = {"/proc/self/exe", "--gtest_filter=ClientReliabilityChild.*",
                                   "--gtest_also_run_disabled_tests"};
  std::vector<std::string> env = {absl::StrCat(kChildAddressEnv, "=", daemon_->address()),
                                  absl::StrCat(kChildOutputEnv, "=", output)};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t child = -1;
  const int spawned = posix_spawn(&child, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_EQ(spawned, 0) << strerror(spawned);
  auto child_log = [&] {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };

  uint64_t session_id = 0;
  const bool started = Eventually(
      [&] {
        std::ifstream in(output);
        std::string line;
        return std::getline(in, line) && absl::SimpleAtoi(line, &session_id);
      },
      absl::Seconds(60));
  if (!started) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    FAIL() << "the child opened no session; its log:\n" << child_log();
  }
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse held, client.GetServerInfo());
  EXPECT_EQ(held.sessions_open(), 1u);

  ASSERT_EQ(kill(child, SIGKILL), 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  uint32_t open = 1;
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
    open = info.ok() ? info->sessions_open() : 1;
    return open == 0;
  })) << "session "
      << session_id << " of the killed client is still open";
}

TEST_F(ClientReliabilityTest, AnIdleClientKeepsItsSessionByWatchingIt) {
  ASSERT_NO_FATAL_FAILURE(Start({"--session-grace=2s"}, "1s"));
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(16));
  const std::vector<uint8_t> data = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  ASSERT_OK(buffer.Upload(data));
  // No call for several idle timeouts (and longer than the grace).
  absl::SleepFor(absl::Milliseconds(3500));
  EXPECT_EQ(session.state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_THAT(buffer.Download(), ::gpurpc::testing::IsOkAndHolds(data));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_ACTIVE);
}

TEST_F(ClientReliabilityTest, TheWatchDeliversAFaultAndTheNextCallReportsItAtOnce) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fault, module.GetFunction("fault_illegal_address"));
  ASSERT_OK(fault.Launch({}));
  // The call that observes the fault.
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  // The watch reports it, without a call.
  ASSERT_TRUE(Eventually([&] { return session.state() == v1::SESSION_STATE_FAULTED; }));
  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("FAULTED"), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session.fault(), faulted);
  {
    // Answered from what the watch knows: no round trip (a stopped daemon would hold a call
    // for its 120 s timeout).
    Stopped stopped(daemon_->pid());
    ASSERT_TRUE(stopped.ok());
    absl::Status status;
    EXPECT_LT(Timed([&] { status = session.GetMemInfo().status(); }), kMustNotHang);
    EXPECT_THAT(status, faulted);
    EXPECT_LT(Timed([&] { status = fault.LaunchAsync({}); }), kMustNotHang);
    EXPECT_THAT(status, faulted);
  }
  // The daemon agrees.
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_EQ(state.fault_code(), static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_OK(session.Close());
  EXPECT_EQ(session.state(), v1::SESSION_STATE_UNSPECIFIED);
}

TEST_F(ClientReliabilityTest, TheKernelWatchdogsFaultIsTheDaemonsDeadlineExceeded) {
  ASSERT_NO_FATAL_FAILURE(Start({"--kernel-timeout=1s"}));
  ASSERT_OK_AND_ASSIGN(Client client, Connect(daemon_->address(), absl::Seconds(120)));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function spin, module.GetFunction("spin_us"));
  ASSERT_OK(spin.LaunchAsync({}, uint64_t{30'000'000}));
  ASSERT_OK(session.Flush());
  // The watchdog ends the worker after 1 s; the watch reports the fault, with the code every
  // call answers now: DEADLINE_EXCEEDED from the daemon, naming the kernel.
  ASSERT_TRUE(Eventually([&] { return session.state() == v1::SESSION_STATE_FAULTED; }));
  const auto watchdog = StatusIs(absl::StatusCode::kDeadlineExceeded,
                                 AllOf(HasSubstr("FAULTED"), HasSubstr("spin_us")));
  EXPECT_THAT(session.fault(), watchdog);
  EXPECT_THAT(session.GetMemInfo().status(), watchdog);
  EXPECT_THAT(session.Synchronize(), watchdog);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session.KeepAlive());
  EXPECT_EQ(state.fault_code(), static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
}

// ------------------------------------------------------------------------ restart

TEST_F(ClientReliabilityTest, AfterADaemonRestartTheSessionIsLostAndTheClientOpensANewOne) {
  // Both daemons serve one socket path in a private folder, as a restarted daemon does.
  char folder[] = "/tmp/gpurpc-restart-XXXXXX";
  ASSERT_NE(mkdtemp(folder), nullptr);
  struct RemoveFolder {
    const char* path;
    ~RemoveFolder() {
      if (std::system(absl::StrCat("rm -rf '", path, "'").c_str()) != 0) {
        // A leftover temporary folder is harmless.
      }
    }
  } remove_folder{folder};
  const std::string socket_path = absl::StrCat(folder, "/gpurpcd.sock");
  TestDaemon::Options options;
  options.unix_socket_path = socket_path;
  auto first = TestDaemon::Start(options);
  ASSERT_OK(first.status());
  const std::string address = (*first)->address();
  ASSERT_OK_AND_ASSIGN(Client client, Connect(address));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse first_info, client.GetServerInfo());
  ASSERT_OK_AND_ASSIGN(Session old_session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer old_buffer, old_session.Allocate(64));

  ASSERT_EQ(kill((*first)->pid(), SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] { return !(*first)->CheckRunning().ok(); }));
  auto second = TestDaemon::Start(options);
  ASSERT_OK(second.status());
  ASSERT_EQ((*second)->address(), address);

  // Once the channel is back, the old session's calls answer NOT_FOUND saying why.
  absl::Status old_call;
  ASSERT_TRUE(Eventually([&] {
    old_call = old_session.GetMemInfo().status();
    return !absl::IsUnavailable(old_call);
  })) << old_call;
  EXPECT_THAT(old_call, StatusIs(absl::StatusCode::kNotFound, HasSubstr("restarted")));
  // The watch learns it too, and then every call answers so at once.
  ASSERT_TRUE(Eventually([&] { return absl::IsNotFound(old_session.fault()); }))
      << old_session.fault();
  EXPECT_THAT(old_session.fault(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("restarted")));
  EXPECT_EQ(old_session.state(), v1::SESSION_STATE_UNSPECIFIED);
  EXPECT_THAT(old_buffer.Download(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("restarted")));

  // The same Client opens a new session right away, and it works.
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse second_info, client.GetServerInfo());
  EXPECT_NE(second_info.daemon_instance(), first_info.daemon_instance());
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(16));
  const std::vector<uint8_t> data(16, 0x5A);
  ASSERT_OK(buffer.Upload(data));
  EXPECT_THAT(buffer.Download(), ::gpurpc::testing::IsOkAndHolds(data));
  EXPECT_EQ(session.state(), v1::SESSION_STATE_ACTIVE);

  // Closing the lost session is prompt and harmless.
  absl::Status closed;
  EXPECT_LT(Timed([&] { closed = old_session.Close(); }), kMustNotHang);
  EXPECT_THAT(closed, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_OK(session.GetMemInfo().status());
}

}  // namespace
}  // namespace gpurpc
