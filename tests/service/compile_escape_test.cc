// The compile sandbox seen from a client (ctest label `service`): a real gpurpcd with real
// worker processes on the fake backend (or GPURPC_ESCAPE_TEST_BACKEND), through the C++ client's
// Session::Compile. A secret with a random marker is planted beside the test
// (tests/testing/compile_escape.h); the daemon is started in the secret's folder, with the marker
// in its environment and the secret's file open on an inherited descriptor, and every route we know
// is tried, including /proc paths of the daemon and its workers. The marker must never come back in
// a reply, nor appear in the daemon's log. Also: ListDevices names the protection, the limits
// answer with their codes and flags, and the daemon refuses unconfined compiles without
// --allow-unsandboxed-compile.
#include "tests/testing/compile_escape.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::EscapePid;
using ::gpurpc::testing::EscapeRoute;
using ::gpurpc::testing::EscapeSecret;
using ::gpurpc::testing::kEscapeKernel;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;
using ::testing::StartsWith;

const EscapeSecret& TheSecret() {
  return ::gpurpc::testing::PlantEscapeSecret(::testing::TempDir());
}

// A daemon started in the secret's folder, with the marker in its environment.
absl::StatusOr<std::unique_ptr<TestDaemon>> StartDaemon(std::vector<std::string> flags) {
  const EscapeSecret& secret = TheSecret();
  TestDaemon::Options options;
  // GPURPC_ESCAPE_TEST_BACKEND=cuda runs the same routes against workers that hold a real
  // CUDA context (the GPU run); the default is the fake backend.
  if (const char* backend = std::getenv("GPURPC_ESCAPE_TEST_BACKEND");
      backend != nullptr && *backend != '\0') {
    options.backend = backend;
  }
  options.extra_flags = std::move(flags);
  options.env = {absl::StrCat(::gpurpc::testing::kEscapeSecretEnv, "=", secret.marker)};
  const std::filesystem::path previous = std::filesystem::current_path();
  std::filesystem::current_path(secret.dir);
  absl::StatusOr<std::unique_ptr<TestDaemon>> daemon = TestDaemon::Start(options);
  std::filesystem::current_path(previous);
  return daemon;
}

bool HoldsSecretFd(pid_t pid) {
  std::error_code error;
  const auto target =
      std::filesystem::read_symlink(absl::StrCat("/proc/", pid, "/fd/", TheSecret().fd), error);
  return !error && target == TheSecret().file;
}

// The routes against the daemon and every worker it has now.
std::vector<EscapeRoute> Routes(const TestDaemon& daemon) {
  std::vector<EscapePid> pids;
  std::vector<pid_t> all = daemon.WorkerPids();
  all.push_back(daemon.pid());
  for (pid_t pid : all) {
    EscapePid p{pid};
    p.environ_has_marker = true;
    p.has_secret_fd = HoldsSecretFd(pid);
    p.cwd_is_secret_dir = true;
    pids.push_back(p);
  }
  return ::gpurpc::testing::EscapeRoutes(TheSecret(), pids);
}

CompileOptions Request(const EscapeRoute& route) {
  CompileOptions options;
  options.source = route.source;
  if (!route.program_name.empty()) options.program_name = route.program_name;
  options.options = route.options;
  options.headers = route.headers;
  return options;
}

// Everything a compile sends back, as text.
std::string Everything(const absl::StatusOr<CompileResult>& result) {
  if (!result.ok()) return std::string(result.status().message());
  const v1::CompileResponse& response = result->response;
  std::string all = response.log() + response.image();
  for (const std::string& option : response.effective_options()) all += option;
  for (const v1::LoweredName& name : response.lowered_names()) all += name.lowered_name();
  return all;
}

std::string Summary(const absl::StatusOr<CompileResult>& result) {
  if (!result.ok()) return result.status().ToString().substr(0, 150);
  const std::string& log = result->log();
  return absl::StrCat(result->success() ? "compiled" : "failed", ": ",
                      log.substr(0, std::min<size_t>(log.find('\n'), 120)));
}

struct Connected {
  std::unique_ptr<TestDaemon> daemon;
  std::optional<Client> client;
  Session session;
};

absl::StatusOr<Connected> Connect(std::vector<std::string> flags) {
  Connected out;
  GPURPC_ASSIGN_OR_RETURN(out.daemon, StartDaemon(std::move(flags)));
  GPURPC_ASSIGN_OR_RETURN(Client client, Client::Connect(out.daemon->address()));
  out.client.emplace(std::move(client));
  GPURPC_ASSIGN_OR_RETURN(out.session, out.client->OpenSession(0));
  return out;
}

// Runs every route on `c`, expecting no marker in any reply nor in the daemon's log.
void ExpectNoRouteLeaks(Connected& c) {
  const EscapeSecret& secret = TheSecret();
  for (const EscapeRoute& route : Routes(*c.daemon)) {
    const absl::StatusOr<CompileResult> result = c.session.Compile(Request(route));
    std::cout << "  " << route.name << ": " << Summary(result) << "\n";
    EXPECT_THAT(Everything(result), Not(HasSubstr(secret.marker))) << "route: " << route.name;
  }
  EXPECT_THAT(c.daemon->Log(), Not(HasSubstr(secret.marker)));
}

class CompileEscapeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CompileEscapeTest, NoRouteReachesTheSecret) {
  absl::StatusOr<Connected> c = Connect({"--compile-sandbox=" + GetParam()});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_OK_AND_ASSIGN(v1::ListDevicesResponse devices, c->client->ListDevices());
  if (absl::StartsWith(devices.compile_sandbox(), "unavailable") && GetParam() != "auto") {
    GTEST_SKIP() << "--compile-sandbox=" << GetParam()
                 << " does not work here: " << devices.compile_sandbox();
  }
  EXPECT_THAT(devices.compile_sandbox(),
              MatchesRegex("landlock \\(ABI [0-9]+\\) \\+ seccomp|namespace \\+ seccomp"));
  if (GetParam() == "namespace") {
    EXPECT_EQ(devices.compile_sandbox(), "namespace + seccomp");
  }
  std::cout << "compile sandbox: " << devices.compile_sandbox() << "\n";
  ExpectNoRouteLeaks(*c);

  // And normal compiles work in there.
  CompileOptions normal;
  normal.source = std::string(R"(
#include <curand_kernel.h>
#include <cuda_fp16.h>
extern "C" __global__ void uniform(float* out, __half* h, unsigned long long seed) {
  curandState state;
  curand_init(seed, threadIdx.x, 0, &state);
  out[threadIdx.x] = curand_uniform(&state);
  h[threadIdx.x] = __hadd(h[threadIdx.x], __float2half(1.0f));
})");
  ASSERT_OK_AND_ASSIGN(CompileResult result, c->session.Compile(normal));
  EXPECT_TRUE(result.success()) << result.log();
  EXPECT_FALSE(result.response.image().empty());
}

INSTANTIATE_TEST_SUITE_P(Modes, CompileEscapeTest, ::testing::Values("auto", "namespace"),
                         [](const auto& info) { return info.param; });

// The same routes against a daemon that runs NVRTC unconfined (the operator accepted it):
// what the scan and the option checks alone let through. Printed, not asserted: they are
// early refusals, not the protection.
TEST(CompileEscapeUnconfinedTest, WhatTheChecksAloneStop) {
  absl::StatusOr<Connected> c = Connect({"--compile-sandbox=none", "--allow-unsandboxed-compile"});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_OK_AND_ASSIGN(v1::ListDevicesResponse devices, c->client->ListDevices());
  EXPECT_EQ(devices.compile_sandbox(),
            "none (unsandboxed compiles accepted by --allow-unsandboxed-compile)");
  int leaked = 0, refused = 0, total = 0;
  for (const EscapeRoute& route : Routes(*c->daemon)) {
    const absl::StatusOr<CompileResult> result = c->session.Compile(Request(route));
    ++total;
    refused += !result.ok() && absl::IsInvalidArgument(result.status());
    const bool leaks = absl::StrContains(Everything(result), TheSecret().marker);
    leaked += leaks;
    if (leaks) std::cout << "  LEAKS without a sandbox: " << route.name << "\n";
  }
  std::cout << total << " routes: " << refused << " refused by the checks, " << leaked
            << " read the secret without a sandbox\n";
}

// A toolkit include folder (--cuda-include-dir) with symlinks that point out of it: a
// relative toolkit include passes every check, and only the sandbox stops NVRTC from
// following the link.
std::vector<CompileOptions> ThroughToolkitSymlinks() {
  std::vector<CompileOptions> out;
  for (const char* include : {"#include <evil.h>", "#include \"evil.h\"", "#include <up/secret.h>",
                              "#include <up/links/link.h>"}) {
    CompileOptions options;
    options.source = std::string("#include <ok.h>\n") + include + kEscapeKernel;
    out.push_back(options);
  }
  return out;
}

TEST_P(CompileEscapeTest, ToolkitSymlinksLeadNowhere) {
  const EscapeSecret& secret = TheSecret();
  absl::StatusOr<Connected> c =
      Connect({"--compile-sandbox=" + GetParam(), "--cuda-include-dir=" + secret.fake_toolkit});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_OK_AND_ASSIGN(v1::ListDevicesResponse devices, c->client->ListDevices());
  if (absl::StartsWith(devices.compile_sandbox(), "unavailable") && GetParam() != "auto") {
    GTEST_SKIP() << "--compile-sandbox=" << GetParam()
                 << " does not work here: " << devices.compile_sandbox();
  }
  for (const CompileOptions& options : ThroughToolkitSymlinks()) {
    const absl::StatusOr<CompileResult> result = c->session.Compile(options);
    const std::string include = options.source.substr(0, options.source.find('\n', 16));
    std::cout << "  " << include.substr(16) << ": " << Summary(result) << "\n";
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(result->success());
    EXPECT_THAT(Everything(result), Not(HasSubstr(secret.marker)));
  }
  EXPECT_THAT(c->daemon->Log(), Not(HasSubstr(secret.marker)));
}

// ... and that those routes are real: unconfined, NVRTC reads the secret through them.
TEST(CompileEscapeUnconfinedTest, ToolkitSymlinksAreRealRoutes) {
  const EscapeSecret& secret = TheSecret();
  absl::StatusOr<Connected> c = Connect({"--compile-sandbox=none", "--allow-unsandboxed-compile",
                                         "--cuda-include-dir=" + secret.fake_toolkit});
  ASSERT_TRUE(c.ok()) << c.status();
  for (const CompileOptions& options : ThroughToolkitSymlinks()) {
    EXPECT_THAT(Everything(c->session.Compile(options)), HasSubstr(secret.marker))
        << options.source;
  }
}

TEST(CompileSandboxFlagsTest, NoneWithoutTheFlagIsRefused) {
  absl::StatusOr<Connected> c = Connect({"--compile-sandbox=none"});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_OK_AND_ASSIGN(v1::ListDevicesResponse devices, c->client->ListDevices());
  EXPECT_THAT(devices.compile_sandbox(),
              AllOf(StartsWith("unavailable: "), HasSubstr("--allow-unsandboxed-compile")));
  CompileOptions options;
  options.source = kEscapeKernel;
  EXPECT_THAT(c->session.Compile(options), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                    AllOf(HasSubstr("--allow-unsandboxed-compile"),
                                                          HasSubstr("--compile-sandbox=none"))));
}

// 40 headers, each including the next one twice: 2^40 inclusions.
CompileOptions IncludeBomb() {
  CompileOptions options;
  options.source = std::string("#include \"bomb0.h\"\n") + kEscapeKernel;
  for (int i = 0; i < 40; ++i) {
    const std::string next = absl::StrCat("bomb", i + 1, ".h");
    options.headers.emplace_back(
        absl::StrCat("bomb", i, ".h"),
        absl::StrCat("#include \"", next, "\"\n#include \"", next, "\"\n"));
  }
  options.headers.emplace_back("bomb40.h", "#define LEAF 1\n");
  return options;
}

// 2^40 distinct template instantiations: memory and CPU.
CompileOptions TemplateBomb() {
  CompileOptions options;
  options.source = R"(
template <int N, unsigned long long M> struct T {
  static constexpr unsigned long long v = T<N - 1, 2 * M>::v + T<N - 1, 2 * M + 1>::v;
};
template <unsigned long long M> struct T<0, M> { static constexpr unsigned long long v = M; };
extern "C" __global__ void k(unsigned long long* o) { *o = T<40, 1>::v; })";
  return options;
}

void ExpectCompileStillWorks(Connected& c) {
  CompileOptions options;
  options.source = kEscapeKernel;
  ASSERT_OK_AND_ASSIGN(CompileResult result, c.session.Compile(options));
  EXPECT_TRUE(result.success()) << result.log();
}

TEST(CompileLimitsServiceTest, WallTime) {
  absl::StatusOr<Connected> c = Connect({"--compile-timeout=2s"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->session.Compile(IncludeBomb()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("--compile-timeout")));
  ExpectCompileStillWorks(*c);
}

TEST(CompileLimitsServiceTest, CpuTime) {
  absl::StatusOr<Connected> c = Connect({"--compile-cpu-seconds=1"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->session.Compile(IncludeBomb()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--compile-cpu-seconds")));
  ExpectCompileStillWorks(*c);
}

TEST(CompileLimitsServiceTest, Memory) {
  absl::StatusOr<Connected> c = Connect({"--compile-memory-bytes=1073741824"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->session.Compile(TemplateBomb()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--compile-memory-bytes")));
  ExpectCompileStillWorks(*c);
}

}  // namespace
}  // namespace gpurpc
