// Reliability on a real GPU, through the C++ client against a real gpurpcd on the CUDA
// backend: the kernel watchdog ends a kernel that never returns and gives its memory back,
// and a client process killed in the middle of an upload loses its session (and the device
// memory it held) after the grace period, not after the idle timeout. Another session is
// served throughout. Skips without a driver.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
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
#include "tests/testing/status_matchers.h"

extern char** environ;

namespace gpurpc {
namespace {

using ::gpurpc::testing::CudaAvailable;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
// What the victim holds: large enough that its return is unmistakable in cuMemGetInfo.
constexpr uint64_t kVictimBytes = 4 * kGiB;
// cuMemGetInfo moves by a few MiB with other contexts' bookkeeping.
constexpr uint64_t kSlackBytes = 256 * kMiB;

// The child mode of this binary (ReliabilityGpuChild): started by the dead-client test with
// the daemon's address in the environment.
constexpr char kChildAddressEnv[] = "GPURPC_RELIABILITY_CHILD_ADDRESS";

LaunchConfig Linear(uint32_t blocks, uint32_t threads) {
  LaunchConfig config;
  config.grid.x = blocks;
  config.block.x = threads;
  return config;
}

// Polls `done` every 100 ms until it is true or `limit` passed; true when it became true.
template <typename Done>
bool WaitFor(absl::Duration limit, Done done) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return done();
}

// Reads `fd` into `text` until a whole line with `word` is there (true), for at most `limit`
// (false then, or when the writer ends first).
bool ReadUntilLine(int fd, const std::string& word, std::string* text, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  for (;;) {
    const size_t at = text->find(word);
    if (at != std::string::npos && text->find('\n', at) != std::string::npos) return true;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    char buffer[4096];
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    text->append(buffer, static_cast<size_t>(n));
  }
}

// Device memory in use, as the control session sees it (cuMemGetInfo in its worker).
uint64_t UsedBytes(const Session& control) {
  absl::StatusOr<MemInfo> info = control.GetMemInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->total_bytes - info->free_bytes : 0;
}

// The control session still works end to end: upload, a kernel, download.
void ExpectHealthy(Session& control, const Function& add_one, const Buffer& data, float expect) {
  ASSERT_OK(add_one.Launch(Linear(4, 256), data, uint64_t{1024}));
  ASSERT_OK(control.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, data.Download());
  ASSERT_EQ(bytes.size(), 1024 * sizeof(float));
  float first = 0;
  std::memcpy(&first, bytes.data(), sizeof(first));
  EXPECT_EQ(first, expect);
}

constexpr char kKernels[] = R"cuda(
extern "C" __global__ void add_one(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}
// Never returns while *flag is 0: only the watchdog ends it.
extern "C" __global__ void hang_forever(volatile int* flag) {
  while (*flag == 0) {
  }
}
)cuda";

class ReliabilityGpuTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags) {
    if (absl::Status cuda = CudaAvailable(); !cuda.ok()) GTEST_SKIP() << cuda;
    TestDaemon::Options options;
    options.backend = "cuda";
    options.idle_timeout = "120s";  // far longer than any bound below
    options.extra_flags = std::move(flags);
    auto daemon = TestDaemon::Start(options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon_->address()));
    client_ = std::make_unique<Client>(std::move(client));
    ASSERT_OK_AND_ASSIGN(Session control, client_->OpenSession());
    control_ = std::make_unique<Session>(std::move(control));
    CompileOptions compile;
    compile.source = kKernels;
    ASSERT_OK_AND_ASSIGN(CompileResult compiled, control_->Compile(compile));
    ASSERT_TRUE(compiled.success()) << compiled.log();
    control_module_ = std::make_unique<Module>(std::move(compiled.module));
    ASSERT_OK_AND_ASSIGN(Function add_one, control_module_->GetFunction("add_one"));
    add_one_ = std::make_unique<Function>(std::move(add_one));
    ASSERT_OK_AND_ASSIGN(Buffer data, control_->Allocate(1024 * sizeof(float)));
    ASSERT_OK(data.Upload(std::vector<uint8_t>(1024 * sizeof(float), 0)));
    data_ = std::make_unique<Buffer>(std::move(data));
  }

  void Healthy() {
    ++control_value_;
    ExpectHealthy(*control_, *add_one_, *data_, control_value_);
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> control_;
  std::unique_ptr<Module> control_module_;
  std::unique_ptr<Function> add_one_;
  std::unique_ptr<Buffer> data_;
  float control_value_ = 0;
};

TEST_F(ReliabilityGpuTest, WatchdogEndsAHungKernelAndGivesItsMemoryBack) {
  StartDaemon({"--kernel-timeout=2s"});
  if (IsSkipped() || HasFatalFailure()) return;
  Healthy();
  const uint64_t baseline = UsedBytes(*control_);

  ASSERT_OK_AND_ASSIGN(Session victim, client_->OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer hoard, victim.Allocate(kVictimBytes));
  ASSERT_OK_AND_ASSIGN(Buffer flag, victim.Allocate(sizeof(int)));
  ASSERT_OK(flag.Upload(std::vector<uint8_t>(sizeof(int), 0)));
  CompileOptions compile;
  compile.source = kKernels;
  ASSERT_OK_AND_ASSIGN(CompileResult compiled, victim.Compile(compile));
  ASSERT_TRUE(compiled.success()) << compiled.log();
  ASSERT_OK_AND_ASSIGN(Function hang, compiled.module.GetFunction("hang_forever"));
  EXPECT_GE(UsedBytes(*control_), baseline + kVictimBytes - kSlackBytes);

  const absl::Time launched = absl::Now();
  ASSERT_OK(hang.LaunchAsync(Linear(1, 1), flag));
  // The other session is served while the kernel spins (the GPU time-slices contexts).
  Healthy();
  // A synchronize waits for the kernel, and ends when the watchdog ends the worker.
  const absl::Status sync = victim.Synchronize();
  const absl::Duration took = absl::Now() - launched;
  EXPECT_THAT(sync, StatusIs(absl::StatusCode::kDeadlineExceeded,
                             AllOf(HasSubstr("hang_forever"), HasSubstr("2s"))));
  std::cout << "[ info ] the watchdog ended the kernel " << absl::FormatDuration(took)
            << " after its launch (--kernel-timeout=2s)\n";
  EXPECT_LT(took, absl::Seconds(60));
  // Every later call says the same.
  EXPECT_THAT(victim.Allocate(64).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("hang_forever")));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, victim.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_EQ(state.fault_code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));

  // The 4 GiB are back within seconds, and the control session never noticed.
  EXPECT_TRUE(
      WaitFor(absl::Seconds(30), [&] { return UsedBytes(*control_) <= baseline + kSlackBytes; }))
      << "used " << UsedBytes(*control_) << " bytes, baseline " << baseline;
  Healthy();
}

TEST_F(ReliabilityGpuTest, KernelsShorterThanTheTimeoutRunToTheEnd) {
  StartDaemon({"--kernel-timeout=3s"});
  if (IsSkipped() || HasFatalFailure()) return;
  // A second of work per kernel, five in a row on one stream: the timeout is per kernel,
  // not per queue.
  CompileOptions compile;
  compile.source = R"cuda(
extern "C" __global__ void busy(unsigned long long cycles, unsigned long long* out) {
  const long long start = clock64();
  while (clock64() - start < (long long)cycles) {
  }
  *out += 1;
}
)cuda";
  ASSERT_OK_AND_ASSIGN(CompileResult compiled, control_->Compile(compile));
  ASSERT_TRUE(compiled.success()) << compiled.log();
  ASSERT_OK_AND_ASSIGN(Function busy, compiled.module.GetFunction("busy"));
  ASSERT_OK_AND_ASSIGN(Buffer out, control_->Allocate(8));
  ASSERT_OK(out.Upload(std::vector<uint8_t>(8, 0)));
  // ~1 s at the H200's ~1.98 GHz boost clock (less when it runs slower: still under 3 s).
  constexpr uint64_t kCycles = 2'000'000'000ull;
  for (int i = 0; i < 5; ++i) ASSERT_OK(busy.LaunchAsync(Linear(1, 1), kCycles, out));
  ASSERT_OK(control_->Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  uint64_t count = 0;
  std::memcpy(&count, bytes.data(), sizeof(count));
  EXPECT_EQ(count, 5u);
}

// The child process of DeadClientIsReclaimedAfterTheGrace: opens a session, takes 4 GiB,
// says READY on stdout, then uploads into it until it is killed.
TEST(ReliabilityGpuChild, HoldMemoryAndUploadUntilKilled) {
  const char* address = std::getenv(kChildAddressEnv);
  if (address == nullptr) GTEST_SKIP() << "only run as the child of the dead-client test";
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(address));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Buffer hoard, session.Allocate(kVictimBytes));
  std::printf("READY %llu\n", static_cast<unsigned long long>(session.id()));
  std::fflush(stdout);
  const std::vector<uint8_t> chunk(256 * kMiB, 0x5a);
  bool said = false;
  for (;;) {
    for (uint64_t offset = 0; offset < kVictimBytes; offset += chunk.size()) {
      ASSERT_OK(hoard.Upload(chunk, offset));
      if (!said) {
        std::printf("UPLOADING\n");  // the first chunk is in: the uploads are under way
        std::fflush(stdout);
        said = true;
      }
    }
  }
}

TEST_F(ReliabilityGpuTest, DeadClientIsReclaimedAfterTheGrace) {
  StartDaemon({"--session-grace=3s"});
  if (IsSkipped() || HasFatalFailure()) return;
  Healthy();
  const uint64_t baseline = UsedBytes(*control_);
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client_->GetServerInfo());
  const uint32_t sessions_before = info.sessions_open();

  // This binary again, as the child above.
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::string exe(4096, '\0');
  exe.resize(std::max<ssize_t>(0, readlink("/proc/self/exe", exe.data(), exe.size())));
  std::string filter = "--gtest_filter=ReliabilityGpuChild.HoldMemoryAndUploadUntilKilled";
  std::vector<char*> argv = {exe.data(), filter.data(), nullptr};
  std::vector<std::string> env_strings = {absl::StrCat(kChildAddressEnv, "=", daemon_->address())};
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, exe.c_str(), &actions, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);

  // Wait for READY, then for its uploads to be under way, and kill it mid-transfer.
  std::string text;
  const bool ready = ReadUntilLine(out[0], "READY", &text, absl::Seconds(60));
  if (ready) {
    EXPECT_GE(UsedBytes(*control_), baseline + kVictimBytes - kSlackBytes);
  }
  const bool uploading =
      ready && ReadUntilLine(out[0], "UPLOADING", &text, ::gpurpc::testing::kEventually);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  const absl::Time killed = absl::Now();
  close(out[0]);
  ASSERT_TRUE(ready) << "the child said: " << text;
  ASSERT_TRUE(uploading) << "the child did not start uploading; it said: " << text;

  // Reclaimed after the 3 s grace (plus the reclaim pass), well before the 120 s idle
  // timeout: the tenant's session count and the device memory are back.
  EXPECT_TRUE(WaitFor(absl::Seconds(30), [&] {
    auto now = client_->GetServerInfo();
    return now.ok() && now->sessions_open() == sessions_before;
  }));
  EXPECT_TRUE(
      WaitFor(absl::Seconds(30), [&] { return UsedBytes(*control_) <= baseline + kSlackBytes; }))
      << "used " << UsedBytes(*control_) << " bytes, baseline " << baseline;
  std::cout << "[ info ] the killed client's session and its 4 GiB were reclaimed "
            << absl::FormatDuration(absl::Now() - killed)
            << " after the kill (--session-grace=3s, idle timeout 120s)\n";
  Healthy();
}

}  // namespace
}  // namespace gpurpc
