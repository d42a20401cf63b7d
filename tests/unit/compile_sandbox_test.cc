// The compile sandbox (server/worker/compiler/sandbox.h, compile_helper.h) against the real
// kernel and the real NVRTC (no GPU needed): a secret file with a random marker is planted
// beside the test, and every route we know to make NVRTC read a file of the server is tried
// -- preprocessor spellings that walk past a text scan, computed includes, symlinks, /proc
// and /dev/fd paths, header and program names, options -- through the sandboxed NVRTC entry
// point directly (no text scan in the way) and through Compiler::Compile. The marker must
// never come back. Also: normal compiles still work inside, the confinement primitives
// refuse what they should, the wall/CPU/memory limits, and the refusal to compile
// unconfined without --allow-unsandboxed-compile.
//
// The binary is its own compile helper (compile_helper_main.cc). Landlock and namespace
// mode run separately; a mode this kernel refuses is skipped with the reason.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/compile_helper.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/compiler/nvrtc_library.h"
#include "server/worker/compiler/sandbox.h"
#include "spdlog/spdlog.h"
#include "tests/testing/compile_escape.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::compiler {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::Eq;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr char kIncludeDir[] = "/usr/local/cuda/include";

using ::gpurpc::testing::EscapePid;
using ::gpurpc::testing::EscapeRoute;
using ::gpurpc::testing::EscapeSecret;
using ::gpurpc::testing::kEscapeKernel;

constexpr const char* kTail = kEscapeKernel;

const EscapeSecret& TheSecret() {
  return ::gpurpc::testing::PlantEscapeSecret(::testing::TempDir());
}

std::vector<std::string> BaseOptions() {
  return {"--gpu-architecture=compute_75", std::string("--include-path=") + kIncludeDir,
          std::string("--include-path=") + kIncludeDir + "/cccl"};
}

// The routes, against this process: it holds the secret's fd, and is in the secret's folder
// for the routes that need it (RunRoute). Its environment got the marker after it started.
std::vector<EscapeRoute> Routes() {
  EscapePid self{getpid()};
  self.has_secret_fd = true;
  self.cwd_is_secret_dir = true;
  return ::gpurpc::testing::EscapeRoutes(TheSecret(), {self});
}

// What the sandboxed entry point gets for `route`: exactly the route's text and options,
// plus the architecture and the toolkit folders.
NvrtcInvocation Invocation(const EscapeRoute& route) {
  NvrtcInvocation invocation;
  invocation.source = route.source;
  if (!route.program_name.empty()) invocation.program_name = route.program_name;
  invocation.options = BaseOptions();
  invocation.options.insert(invocation.options.end(), route.options.begin(), route.options.end());
  invocation.headers = route.headers;
  invocation.cubin = false;
  return invocation;
}

// Everything that leaves the helper, as text.
std::string Everything(const absl::StatusOr<NvrtcOutcome>& outcome) {
  if (!outcome.ok()) return std::string(outcome.status().message());
  std::string all = outcome->log;
  all.append(outcome->image.begin(), outcome->image.end());
  for (const auto& [expression, lowered] : outcome->lowered_names) {
    absl::StrAppend(&all, expression, lowered);
  }
  return all;
}

std::string Summary(const absl::StatusOr<NvrtcOutcome>& outcome) {
  if (!outcome.ok()) return outcome.status().ToString().substr(0, 160);
  std::string first_line = outcome->log.substr(0, outcome->log.find('\n'));
  return absl::StrCat("nvrtcResult ", outcome->compile_result, ": ", first_line.substr(0, 140));
}

// Runs `route` with the cwd (of this process, which the helper inherits) in the secret's
// folder, and the secret's toolkit folder readable, as the route asks.
absl::StatusOr<NvrtcOutcome> RunRoute(const HelperSettings& settings, const EscapeRoute& route) {
  char previous[4096];
  if (getcwd(previous, sizeof(previous)) == nullptr) abort();
  if (route.needs_secret_cwd && chdir(TheSecret().dir.c_str()) != 0) abort();
  HelperSettings with_fake_toolkit = settings;
  if (route.needs_fake_toolkit) with_fake_toolkit.read_dirs.push_back(TheSecret().fake_toolkit);
  absl::StatusOr<NvrtcOutcome> outcome = RunNvrtcInHelper(with_fake_toolkit, Invocation(route));
  if (chdir(previous) != 0) abort();
  return outcome;
}

// ------------------------------------------------------------------------ fixtures

// A compiler whose helpers use `mode`; its memory cache is off.
std::unique_ptr<Compiler> MakeCompiler(SandboxMode mode, bool allow_unsandboxed = false) {
  CompilerOptions options;
  options.cache_dir = "";
  options.memory_cache_max_bytes = 0;
  options.sandbox.mode = mode;
  options.sandbox.allow_unsandboxed = allow_unsandboxed;
  absl::StatusOr<std::unique_ptr<Compiler>> compiler = Compiler::Create(options);
  if (!compiler.ok()) {
    ADD_FAILURE() << compiler.status();
    return nullptr;
  }
  return std::move(compiler).value();
}

// The probe's answer per mode, computed once.
const std::string& ProbeFor(SandboxMode mode) {
  static std::map<SandboxMode, std::string>* const probes = new std::map<SandboxMode, std::string>;
  auto it = probes->find(mode);
  if (it == probes->end()) {
    std::unique_ptr<Compiler> compiler = MakeCompiler(mode);
    it = probes->emplace(mode, compiler ? compiler->ProbeSandbox() : "unavailable: no compiler")
             .first;
  }
  return it->second;
}

class SandboxModeTest : public ::testing::TestWithParam<SandboxMode> {
 protected:
  void SetUp() override {
    const std::string& probe = ProbeFor(GetParam());
    if (absl::StartsWith(probe, "unavailable")) {
      GTEST_SKIP() << "--compile-sandbox=" << SandboxModeName(GetParam())
                   << " does not work on this machine: " << probe;
    }
    compiler_ = MakeCompiler(GetParam());
    ASSERT_NE(compiler_, nullptr);
  }

  HelperSettings Settings() const { return compiler_->helper_settings(); }

  std::unique_ptr<Compiler> compiler_;
};

std::string ModeName(const ::testing::TestParamInfo<SandboxMode>& info) {
  return std::string(SandboxModeName(info.param));
}

// ------------------------------------------------------------------------ tests

TEST_P(SandboxModeTest, ProbeNamesTheMode) {
  const std::string& probe = ProbeFor(GetParam());
  if (GetParam() == SandboxMode::kLandlock) {
    EXPECT_EQ(probe, absl::StrCat("landlock (ABI ", LandlockAbi(), ") + seccomp"));
  } else {
    EXPECT_EQ(probe, "namespace + seccomp");
  }
  std::cout << "probe: " << probe << "\n";
}

TEST_P(SandboxModeTest, NoRouteReachesTheSecret) {
  const EscapeSecret& secret = TheSecret();
  for (const EscapeRoute& route : Routes()) {
    const absl::StatusOr<NvrtcOutcome> outcome = RunRoute(Settings(), route);
    std::cout << "  " << route.name << ": " << Summary(outcome) << "\n";
    EXPECT_THAT(Everything(outcome), Not(HasSubstr(secret.marker))) << "route: " << route.name;
    if (outcome.ok()) {
      EXPECT_EQ(outcome->sandbox, ProbeFor(GetParam())) << route.name;
    }
  }
}

// The same routes through the full compile path: the scan refuses some early; none leaks.
TEST_P(SandboxModeTest, NoRouteReachesTheSecretThroughCompile) {
  const EscapeSecret& secret = TheSecret();
  for (const EscapeRoute& route : Routes()) {
    CompileRequest request;
    request.source = route.source;
    request.program_name = route.program_name;
    request.options = route.options;
    for (const auto& [name, content] : route.headers) request.headers.push_back({name, content});
    request.target = "compute_75";
    char previous[4096];
    ASSERT_NE(getcwd(previous, sizeof(previous)), nullptr);
    if (route.needs_secret_cwd) {
      ASSERT_EQ(chdir(secret.dir.c_str()), 0);
    }
    absl::StatusOr<CompileResult> result = compiler_->Compile(request);
    ASSERT_EQ(chdir(previous), 0);
    std::string all = result.ok()
                          ? result->log + std::string(result->image.begin(), result->image.end())
                          : std::string(result.status().message());
    EXPECT_THAT(all, Not(HasSubstr(secret.marker))) << "route: " << route.name;
  }
}

TEST_P(SandboxModeTest, NothingIsWritten) {
  const EscapeSecret& secret = TheSecret();
  const std::string out = secret.dir + "/out";
  std::filesystem::create_directories(out);
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"-time=" + out + "/time.csv"},
           {"--fdevice-time-trace=" + out + "/trace.json"},
           {"--create-pch=" + out + "/x.pch"},
           {"-pch", "--pch-dir=" + out},
       }) {
    NvrtcInvocation invocation;
    invocation.source = kTail;
    invocation.options = BaseOptions();
    invocation.options.insert(invocation.options.end(), extra.begin(), extra.end());
    invocation.cubin = false;
    const absl::StatusOr<NvrtcOutcome> outcome = RunNvrtcInHelper(Settings(), invocation);
    std::cout << "  " << absl::StrJoin(extra, " ") << ": " << Summary(outcome) << "\n";
  }
  EXPECT_TRUE(std::filesystem::is_empty(out)) << "the compiles wrote into " << out;
}

TEST_P(SandboxModeTest, NormalCompilesWork) {
  CompileRequest request;
  request.target = "sm_90";
  request.source = R"(
#include <curand_kernel.h>
#include <cuda_fp16.h>
template <typename T>
__global__ void fill(T* out, T value) { out[threadIdx.x] = value; }
extern "C" __global__ void uniform(float* out, __half* h, unsigned long long seed) {
  curandState state;
  curand_init(seed, threadIdx.x, 0, &state);
  out[threadIdx.x] = curand_uniform(&state);
  h[threadIdx.x] = __hadd(h[threadIdx.x], __float2half(1.0f));
}
)";
  request.name_expressions = {"fill<float>"};
  ASSERT_OK_AND_ASSIGN(CompileResult cubin, compiler_->Compile(request));
  EXPECT_TRUE(cubin.success) << cubin.log;
  ASSERT_GE(cubin.image.size(), 4u);
  EXPECT_EQ(std::string(cubin.image.begin(), cubin.image.begin() + 4),
            "\x7f"
            "ELF");
  ASSERT_EQ(cubin.lowered_names.size(), 1u);
  EXPECT_THAT(cubin.lowered_names[0].second, StartsWith("_Z"));

  request.target = "compute_80";
  request.options = {"-G", "--split-compile=2"};  // threads inside the helper, debug info
  ASSERT_OK_AND_ASSIGN(CompileResult ptx, compiler_->Compile(request));
  EXPECT_TRUE(ptx.success) << ptx.log;
  EXPECT_THAT(std::string(ptx.image.begin(), ptx.image.end()), HasSubstr(".entry"));

  // Headers sent with the request, and a compile error with its log.
  request.options = {};
  request.source = "#include \"config.h\"\nint x = kValue + ;\n";
  request.headers = {{"config.h", "constexpr int kValue = 3;\n"}};
  ASSERT_OK_AND_ASSIGN(CompileResult failed, compiler_->Compile(request));
  EXPECT_FALSE(failed.success);
  EXPECT_THAT(failed.log, HasSubstr("kernel.cu(2): error"));
}

// The confinement primitives themselves, in a forked child of this (single-threaded)
// process: what a compromised NVRTC could try.
TEST_P(SandboxModeTest, ConfinedProcessIsRefused) {
  const EscapeSecret& secret = TheSecret();
  struct stat secret_before;
  ASSERT_EQ(stat(secret.file.c_str(), &secret_before), 0);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const int out = pipe_fds[1];
    const auto report = [&](const char* what, long rc) {
      const std::string line = absl::StrCat(what, "=", rc < 0 ? -errno : rc, "\n");
      (void)!write(out, line.data(), line.size());
    };
    absl::Status limited = LimitSelf(60, 8ull << 30, out);
    absl::StatusOr<Confinement> confined =
        ConfineSelf(GetParam(), false, {kIncludeDir, std::string(kIncludeDir) + "/cccl"});
    report("confined", limited.ok() && confined.ok() ? 0 : -1);
    report("secret_fd_closed", fcntl(secret.fd, F_GETFD));
    report("open_secret", open(secret.file.c_str(), O_RDONLY));
    report("open_toolkit_header",
           open((std::string(kIncludeDir) + "/cuda_fp16.h").c_str(), O_RDONLY));
    report("open_proc_status", open("/proc/self/status", O_RDONLY));
    report("open_etc_passwd", open("/etc/passwd", O_RDONLY));
    report("create_in_tmp", open((secret.dir + "/new").c_str(), O_WRONLY | O_CREAT, 0600));
    report("write_toolkit", open((std::string(kIncludeDir) + "/cuda_fp16.h").c_str(), O_WRONLY));
    report("socket_inet", socket(AF_INET, SOCK_STREAM, 0));
    report("socket_unix", socket(AF_UNIX, SOCK_STREAM, 0));
    int pair[2];
    report("socketpair", socketpair(AF_UNIX, SOCK_STREAM, 0, pair));
    report("unshare_user", unshare(CLONE_NEWUSER));
    report("mount", mount("none", "/", "tmpfs", 0, nullptr));
    report("ptrace_parent", ptrace(PTRACE_ATTACH, getppid(), nullptr, nullptr));
    report("kill_parent", kill(getppid(), 0));
    report("kill_group", kill(0, 0));
    report("kill_self", kill(getpid(), 0));
    report("clone3", syscall(SYS_clone3, nullptr, 0));
    const long cloned = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, 0);
    if (cloned == 0) _exit(0);
    report("clone_newuser", cloned);
    pthread_t thread;
    static int ran = 0;
    const int created = pthread_create(
        &thread, nullptr,
        [](void*) -> void* {
          ran = 1;
          return nullptr;
        },
        nullptr);
    if (created == 0) pthread_join(thread, nullptr);
    report("thread", created == 0 && ran == 1 ? 0 : -1);
    char* const argv[] = {const_cast<char*>("/bin/true"), nullptr};
    report("execve", execve("/bin/true", argv, nullptr));
    // Metadata of the daemon user's files (Landlock has no rights for it).
    report("chmod_secret", chmod(secret.file.c_str(), 0666));
    report("chown_secret", chown(secret.file.c_str(), getuid(), getgid()));
    report("utimensat_secret", utimensat(AT_FDCWD, secret.file.c_str(), nullptr, 0));
    report("setxattr_secret", setxattr(secret.file.c_str(), "user.x", "y", 1, 0));
    // No children: they would outlive the wall-time kill.
    const long forked = syscall(SYS_clone, SIGCHLD, nullptr, nullptr, nullptr, 0);
    if (forked == 0) _exit(0);
    report("fork", forked);
    // Nothing done to other processes of the same user.
    struct rlimit one_second = {1, 1};
    report("prlimit_parent", prlimit(getppid(), RLIMIT_CPU, &one_second, nullptr));
    report("setpriority_parent", setpriority(PRIO_PROCESS, getppid(), 19));
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(0, &cpus);
    report("affinity_parent", sched_setaffinity(getppid(), sizeof(cpus), &cpus));
    report("inotify", inotify_init1(0));
    struct rlimit own;
    report("getrlimit_self", getrlimit(RLIMIT_NOFILE, &own));
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string text;
  char buffer[512];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) text.append(buffer, n);
  close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  std::map<std::string, long> results;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(line, '=');
    ASSERT_EQ(parts.size(), 2u) << line;
    results[parts[0]] = std::stol(parts[1]);
  }
  std::cout << text;
  const auto denied = [](long rc) {
    return rc == -EACCES || rc == -EPERM || rc == -ENOENT || rc == -EROFS;
  };
  EXPECT_EQ(results["confined"], 0);
  EXPECT_EQ(results["secret_fd_closed"], -EBADF);
  EXPECT_PRED1(denied, results["open_secret"]);
  EXPECT_GE(results["open_toolkit_header"], 0);
  EXPECT_PRED1(denied, results["open_proc_status"]);
  EXPECT_PRED1(denied, results["open_etc_passwd"]);
  EXPECT_PRED1(denied, results["create_in_tmp"]);
  EXPECT_LT(results["write_toolkit"], 0);
  for (const char* name :
       {"chmod_secret", "chown_secret", "utimensat_secret", "setxattr_secret", "fork",
        "prlimit_parent", "setpriority_parent", "affinity_parent", "inotify"}) {
    EXPECT_PRED1(denied, results[name]) << name;
  }
  EXPECT_EQ(results["getrlimit_self"], 0);
  struct stat secret_stat;
  ASSERT_EQ(stat(secret.file.c_str(), &secret_stat), 0);
  EXPECT_EQ(secret_stat.st_mode, secret_before.st_mode)
      << "the confined child changed the secret's mode";
  EXPECT_EQ(results["socket_inet"], -EPERM);
  EXPECT_EQ(results["socket_unix"], -EPERM);
  EXPECT_EQ(results["socketpair"], -EPERM);
  EXPECT_EQ(results["unshare_user"], -EPERM);
  EXPECT_EQ(results["mount"], -EPERM);
  EXPECT_EQ(results["ptrace_parent"], -EPERM);
  EXPECT_EQ(results["kill_parent"], -EPERM);
  EXPECT_EQ(results["kill_group"], -EPERM);
  EXPECT_EQ(results["kill_self"], 0);
  EXPECT_EQ(results["clone3"], -ENOSYS);
  EXPECT_EQ(results["clone_newuser"], -EPERM);
  EXPECT_EQ(results["thread"], 0);
  EXPECT_EQ(results["execve"], -EPERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_FALSE(std::filesystem::exists(secret.dir + "/new"));
}

INSTANTIATE_TEST_SUITE_P(Modes, SandboxModeTest,
                         ::testing::Values(SandboxMode::kLandlock, SandboxMode::kNamespace),
                         ModeName);

// The routes are real: an unconfined NVRTC reads the secret through them. (If this fails,
// the escape tests above prove nothing.)
TEST(UnconfinedTest, RoutesAreRealWithoutTheSandbox) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kNone, /*allow_unsandboxed=*/true);
  ASSERT_NE(compiler, nullptr);
  const EscapeSecret& secret = TheSecret();
  int leaked = 0;
  for (const EscapeRoute& route : Routes()) {
    const absl::StatusOr<NvrtcOutcome> outcome = RunRoute(compiler->helper_settings(), route);
    const bool leaks = absl::StrContains(Everything(outcome), secret.marker);
    leaked += leaks;
    std::cout << "  " << (leaks ? "LEAKS " : "      ") << route.name << "\n";
    if (route.leaks_unconfined) {
      EXPECT_TRUE(leaks) << route.name << ": " << Summary(outcome);
    }
  }
  std::cout << leaked << " routes read the secret without a sandbox\n";
}

TEST(UnconfinedTest, RefusedWithoutTheFlag) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kNone);
  ASSERT_NE(compiler, nullptr);
  CompileRequest request;
  request.source = kTail;
  request.target = "compute_75";
  EXPECT_THAT(compiler->Compile(request), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                   AllOf(HasSubstr("--allow-unsandboxed-compile"),
                                                         HasSubstr("--compile-sandbox=none"))));
  EXPECT_THAT(compiler->ProbeSandbox(),
              AllOf(StartsWith("unavailable: "), HasSubstr("--allow-unsandboxed-compile")));

  std::unique_ptr<Compiler> allowed = MakeCompiler(SandboxMode::kNone, /*allow_unsandboxed=*/true);
  ASSERT_NE(allowed, nullptr);
  EXPECT_EQ(allowed->ProbeSandbox(), kUnsandboxedDescription);
  ASSERT_OK_AND_ASSIGN(CompileResult result, allowed->Compile(request));
  EXPECT_TRUE(result.success) << result.log;
}

TEST(HelperStartTest, AHelperThatIsNotOneIsInternal) {
  for (const std::string& path : {std::string("/bin/true"), std::string("/nonexistent/gpurpcd")}) {
    CompilerOptions options;
    options.memory_cache_max_bytes = 0;
    options.sandbox.helper_path = path;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compiler> compiler, Compiler::Create(options));
    CompileRequest request;
    request.source = kTail;
    request.target = "compute_75";
    EXPECT_THAT(compiler->Compile(request), StatusIs(absl::StatusCode::kInternal, HasSubstr(path)));
    EXPECT_THAT(compiler->ProbeSandbox(), AllOf(StartsWith("unavailable: "), HasSubstr(path)));
  }
}

TEST(ConcurrencyTest, CompilesRunAtOnce) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kAuto);
  ASSERT_NE(compiler, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> succeeded{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3; ++i) {
        CompileRequest request;
        request.source = absl::StrCat("extern \"C\" __global__ void k", t, "_", i,
                                      "(int* p) { *p = ", t * 10 + i, "; }\n");
        request.target = "compute_75";
        absl::StatusOr<CompileResult> result = compiler->Compile(request);
        if (result.ok() && result->success) ++succeeded;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(succeeded.load(), 24);
}

// Runs `body` in a forked child of this (single-threaded) process in which the system
// calls `denied` fail with their errno -- a seccomp filter that the child's helpers inherit,
// standing in for a kernel without Landlock or without user namespaces -- and returns what
// the body returned.
std::string InChildWithout(const std::vector<std::pair<long, int>>& denied,
                           const std::function<std::string()>& body) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return "pipe failed";
  const pid_t child = fork();
  if (child == 0) {
    std::vector<sock_filter> program = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr))};
    for (const auto& [nr, error] : denied) {
      program.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1));
      program.push_back(
          BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<uint32_t>(error)));
    }
    program.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
    sock_fprog fprog{static_cast<unsigned short>(program.size()), program.data()};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) != 0) {
      _exit(3);
    }
    const std::string out = body();
    (void)!write(pipe_fds[1], out.data(), out.size());
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  close(pipe_fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return out;
}

// "<probe>\n<compile status>" for a compiler of `mode`.
std::string ProbeAndCompile(SandboxMode mode, bool allow_unsandboxed) {
  CompilerOptions options;
  options.memory_cache_max_bytes = 0;
  options.sandbox.mode = mode;
  options.sandbox.allow_unsandboxed = allow_unsandboxed;
  absl::StatusOr<std::unique_ptr<Compiler>> compiler = Compiler::Create(options);
  if (!compiler.ok()) return compiler.status().ToString();
  CompileRequest request;
  request.source = kTail;
  request.target = "compute_75";
  absl::StatusOr<CompileResult> result = (*compiler)->Compile(request);
  return absl::StrCat(
      (*compiler)->ProbeSandbox(), "\n",
      result.ok() ? (result->success ? "compiled" : "compile error") : result.status().ToString());
}

TEST(SandboxFallbackTest, WithoutLandlock) {
  if (absl::StartsWith(ProbeFor(SandboxMode::kNamespace), "unavailable")) {
    GTEST_SKIP() << "needs user namespaces: " << ProbeFor(SandboxMode::kNamespace);
  }
  const std::vector<std::pair<long, int>> no_landlock = {{SYS_landlock_create_ruleset, ENOSYS}};
  EXPECT_EQ(InChildWithout(no_landlock, [] { return ProbeAndCompile(SandboxMode::kAuto, false); }),
            "namespace + seccomp\ncompiled");
  const std::string forced =
      InChildWithout(no_landlock, [] { return ProbeAndCompile(SandboxMode::kLandlock, true); });
  EXPECT_THAT(forced, AllOf(StartsWith("unavailable: "), HasSubstr("--compile-sandbox=landlock"),
                            HasSubstr("Landlock: not built into this kernel (ENOSYS)"),
                            HasSubstr("\nFAILED_PRECONDITION: ")));
}

TEST(SandboxFallbackTest, WithoutLandlockNorUserNamespaces) {
  const std::vector<std::pair<long, int>> nothing = {{SYS_landlock_create_ruleset, EOPNOTSUPP},
                                                     {SYS_unshare, EPERM}};
  const std::string refused =
      InChildWithout(nothing, [] { return ProbeAndCompile(SandboxMode::kAuto, false); });
  EXPECT_THAT(refused, AllOf(StartsWith("unavailable: "), HasSubstr("no compile sandbox works"),
                             HasSubstr("Landlock: disabled"), HasSubstr("namespace: unshare"),
                             HasSubstr("--allow-unsandboxed-compile"),
                             HasSubstr("\nFAILED_PRECONDITION: ")));
  EXPECT_EQ(InChildWithout(nothing, [] { return ProbeAndCompile(SandboxMode::kAuto, true); }),
            absl::StrCat(kUnsandboxedDescription, "\ncompiled"));
  const std::string forced =
      InChildWithout(nothing, [] { return ProbeAndCompile(SandboxMode::kNamespace, true); });
  EXPECT_THAT(forced, AllOf(StartsWith("unavailable: "), HasSubstr("--compile-sandbox=namespace"),
                            HasSubstr("\nFAILED_PRECONDITION: ")));
}

TEST(SandboxAutoTest, AutoPrefersLandlock) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kAuto);
  ASSERT_NE(compiler, nullptr);
  const std::string probe = compiler->ProbeSandbox();
  std::cout << "auto: " << probe << "\n";
  if (LandlockAbi() > 0) {
    EXPECT_EQ(probe, absl::StrCat("landlock (ABI ", LandlockAbi(), ") + seccomp"));
  } else {
    EXPECT_THAT(probe, AnyOf(Eq("namespace + seccomp"), StartsWith("unavailable: ")));
  }
}

// ------------------------------------------------------------------------ the scan

// The text scan is an early, readable refusal (the sandbox is the guarantee): it sees
// through the respellings the preprocessor accepts.
struct Spelling {
  const char* name;
  const char* text;
};

class ScanTest : public ::testing::TestWithParam<Spelling> {};

TEST_P(ScanTest, RespelledDirectiveIsRefusedEarly) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kAuto);
  ASSERT_NE(compiler, nullptr);
  const std::string text = GetParam().text;
  CompileRequest request;
  request.source = "// line 1\n" + text + kTail;
  request.target = "compute_75";
  EXPECT_THAT(compiler->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("source line ")))
      << text;
  request.source = std::string("#include \"h.h\"\n") + kTail;
  request.headers = {{"h.h", text}};
  EXPECT_THAT(compiler->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("header 'h.h' line ")))
      << text;
}

INSTANTIATE_TEST_SUITE_P(
    Spellings, ScanTest,
    ::testing::Values(
        Spelling{"ContinuationInInclude", "#inc\\\nlude \"/etc/passwd\""},
        Spelling{"ContinuationAfterHash", "#\\\ninclude </etc/passwd>"},
        Spelling{"ContinuationBeforeName", "#include \\\n\"/etc/passwd\""},
        Spelling{"ContinuationInName", "#include \"/et\\\nc/passwd\""},
        Spelling{"CrLfContinuation", "#inc\\\r\nlude \"/etc/passwd\""},
        Spelling{"CommentAfterHash", "#/**/include \"/etc/passwd\""},
        Spelling{"MultiLineComment", "# /*\n*/ include \"/etc/passwd\""},
        Spelling{"CommentBeforeName", "#include/* x */\"../x.h\""},
        Spelling{"Digraph", "%:include \"/etc/passwd\""},
        Spelling{"DigraphIncludeNext", "  %:  include_next <../x.h>"},
        Spelling{"TrigraphHash", "?\?=include \"/etc/passwd\""},
        Spelling{"TrigraphContinuation", "#inc?\?/\nlude \"/etc/passwd\""},
        Spelling{"Import", "#import \"/etc/passwd\""}, Spelling{"Embed", "#embed \"/etc/passwd\""},
        Spelling{"HasIncludeNext", "#if __has_include_next(</etc/passwd>)\n#endif"},
        Spelling{"HasEmbed", "#if __has_embed(\"/etc/passwd\")\n#endif"},
        Spelling{"ContinuationInHasInclude", "#if __has_\\\ninclude(\"/etc/passwd\")\n#endif"},
        Spelling{"ComputedOnSecondLine", "#define F \"/etc/passwd\"\n#  include F"},
        Spelling{"IdentifierEndingInR",
                 "#define FOOR 1\nint y = FOOR\"(\";\n#include \"/etc/passwd\"\n)\";"}),
    [](const ::testing::TestParamInfo<Spelling>& info) { return std::string(info.param.name); });

TEST(ScanTest, NoFalseAlarms) {
  std::unique_ptr<Compiler> compiler = MakeCompiler(SandboxMode::kAuto);
  ASSERT_NE(compiler, nullptr);
  CompileRequest request;
  request.target = "compute_75";
  request.headers = {{"a.h", "#define A 1\n"}};
  request.source = std::string(R"x(
#include "a.h"  // a comment with "/etc/passwd" in it
/* #include "/etc/passwd" in a comment
#include "../up.h" */
__device__ const char* kUrl = "http://example.com/*not a comment*/";
__device__ const char* kRaw = R"(
#include "/etc/passwd"
)";
__device__ const char kQuote = '"';
#include "a.h"
__device__ int kDigits = 1'000'000;
)x") + kTail;
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler->Compile(request));
  EXPECT_TRUE(result.success) << result.log;
}

// ------------------------------------------------------------------------ limits

// 2^40 distinct instantiations: CPU and memory until a limit stops it.
constexpr char kTemplateBomb[] = R"(
template <int N, unsigned long long M> struct T {
  static constexpr unsigned long long v = T<N - 1, 2 * M>::v + T<N - 1, 2 * M + 1>::v;
};
template <unsigned long long M> struct T<0, M> { static constexpr unsigned long long v = M; };
extern "C" __global__ void k(unsigned long long* o) { *o = T<40, 1>::v; }
)";

// 40 headers, each including the next one twice: 2^40 inclusions, CPU and little memory.
// (NVRTC refuses a header that includes itself.)
std::vector<Header> IncludeBomb() {
  std::vector<Header> headers;
  for (int i = 0; i < 40; ++i) {
    const std::string next = absl::StrCat("bomb", i + 1, ".h");
    headers.push_back({absl::StrCat("bomb", i, ".h"),
                       absl::StrCat("#include \"", next, "\"\n#include \"", next, "\"\n")});
  }
  headers.push_back({"bomb40.h", "#define LEAF 1\n"});
  return headers;
}

CompileRequest Bomb(const char* source, std::vector<Header> headers = {}) {
  CompileRequest request;
  request.source = source;
  request.headers = std::move(headers);
  request.target = "compute_75";
  return request;
}

std::unique_ptr<Compiler> LimitedCompiler(absl::Duration timeout, uint64_t cpu_seconds,
                                          uint64_t memory_bytes) {
  CompilerOptions options;
  options.cache_dir = "";
  options.memory_cache_max_bytes = 0;
  options.sandbox.timeout = timeout;
  options.sandbox.cpu_seconds = cpu_seconds;
  options.sandbox.memory_bytes = memory_bytes;
  absl::StatusOr<std::unique_ptr<Compiler>> compiler = Compiler::Create(options);
  EXPECT_THAT(compiler, IsOk());
  return compiler.ok() ? std::move(compiler).value() : nullptr;
}

// For failure messages: what a compile that should have been stopped said instead.
std::string Describe(const absl::StatusOr<CompileResult>& result) {
  if (!result.ok()) return result.status().ToString();
  return absl::StrCat("OK, success=", result->success, ", log: ", result->log.substr(0, 600));
}

void ExpectNormalCompileWorks(Compiler* compiler) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler->Compile(Bomb(kTail)));
  EXPECT_TRUE(result.success) << result.log;
}

TEST(CompileLimitsTest, WallTimeLimitIsDeadlineExceeded) {
  std::unique_ptr<Compiler> compiler = LimitedCompiler(absl::Seconds(2), 60, 64ull << 30);
  ASSERT_NE(compiler, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<CompileResult> result =
      compiler->Compile(Bomb("#include \"bomb0.h\"\n", IncludeBomb()));
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("--compile-timeout"), HasSubstr("2s"))))
      << Describe(result);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ExpectNormalCompileWorks(compiler.get());
}

TEST(CompileLimitsTest, CpuLimitIsResourceExhausted) {
  std::unique_ptr<Compiler> compiler = LimitedCompiler(absl::Seconds(60), 1, 64ull << 30);
  ASSERT_NE(compiler, nullptr);
  const absl::StatusOr<CompileResult> result =
      compiler->Compile(Bomb("#include \"bomb0.h\"\n", IncludeBomb()));
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kResourceExhausted,
                               AllOf(HasSubstr("CPU"), HasSubstr("--compile-cpu-seconds"))))
      << Describe(result);
  ExpectNormalCompileWorks(compiler.get());
}

TEST(CompileLimitsTest, MemoryLimitIsResourceExhausted) {
  std::unique_ptr<Compiler> compiler = LimitedCompiler(absl::Seconds(60), 60, 1ull << 30);
  ASSERT_NE(compiler, nullptr);
  const absl::StatusOr<CompileResult> result = compiler->Compile(Bomb(kTemplateBomb));
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kResourceExhausted,
                               AllOf(HasSubstr("memory"), HasSubstr("--compile-memory-bytes"))))
      << Describe(result);
  ExpectNormalCompileWorks(compiler.get());
}

TEST(CompileLimitsTest, TemplateBombUnderDefaultsEndsWithALimit) {
  std::unique_ptr<Compiler> compiler = LimitedCompiler(absl::Seconds(5), 3, 2ull << 30);
  ASSERT_NE(compiler, nullptr);
  const absl::StatusOr<CompileResult> result = compiler->Compile(Bomb(kTemplateBomb));
  EXPECT_THAT(result, AnyOf(StatusIs(absl::StatusCode::kResourceExhausted),
                            StatusIs(absl::StatusCode::kDeadlineExceeded)))
      << Describe(result);
  ExpectNormalCompileWorks(compiler.get());
}

// ------------------------------------------------------------------------ cost

// NVRTC in this process, for comparison: median milliseconds of `runs` compiles.
double InProcessMs(const NvrtcLibrary& nvrtc, const NvrtcInvocation& invocation, int runs) {
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    nvrtcProgram program = nullptr;
    EXPECT_EQ(
        nvrtc.CreateProgram(&program, invocation.source.c_str(), "kernel.cu", 0, nullptr, nullptr),
        NVRTC_SUCCESS);
    std::vector<const char*> options;
    for (const std::string& option : invocation.options) options.push_back(option.c_str());
    EXPECT_EQ(nvrtc.CompileProgram(program, static_cast<int>(options.size()), options.data()),
              NVRTC_SUCCESS);
    size_t size = 0;
    nvrtc.GetPTXSize(program, &size);
    std::string ptx(size, '\0');
    nvrtc.GetPTX(program, ptx.data());
    nvrtc.DestroyProgram(&program);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Not a pass/fail measure: prints what a helper costs per compile, against NVRTC's own
// time for the same kernels in this process.
// With $GPURPCD_BIN set, gpurpcd is the helper, as in the daemon.
TEST(CompileCostTest, HelperCostPerCompile) {
  CompilerOptions options;
  options.memory_cache_max_bytes = 0;
  if (const char* gpurpcd = getenv("GPURPCD_BIN")) options.sandbox.helper_path = gpurpcd;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compiler> compiler, Compiler::Create(options));
  const auto time = [&](const NvrtcInvocation& invocation, int runs) {
    std::vector<double> ms;
    for (int i = 0; i < runs; ++i) {
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<NvrtcOutcome> outcome =
          RunNvrtcInHelper(compiler->helper_settings(), invocation);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
      EXPECT_THAT(outcome, IsOk());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  NvrtcInvocation trivial;
  trivial.source = kTail;
  trivial.options = BaseOptions();
  trivial.cubin = false;
  NvrtcInvocation curand = trivial;
  curand.source = std::string("#include <curand_kernel.h>\n") + kTail;
  // A helper that starts, confines itself and stops at NVRTC's first check.
  NvrtcInvocation rejected;
  rejected.options = {"--no-such-option"};
  const double setup = time(rejected, 9);
  const double small = time(trivial, 9);
  const double big = time(curand, 5);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<const NvrtcLibrary> nvrtc,
                       NvrtcLibrary::LoadFile(compiler->helper_settings().nvrtc_path));
  InProcessMs(*nvrtc, trivial, 1);  // loads the builtins
  const double small_in_process = InProcessMs(*nvrtc, trivial, 9);
  const double big_in_process = InProcessMs(*nvrtc, curand, 5);
  const std::string sandbox = compiler->ProbeSandbox();
  std::cout << "median wall time per compile, " << sandbox
            << " helper: start + confine + rejected option " << setup << " ms; trivial kernel "
            << small << " ms (in this process: " << small_in_process << " ms); curand_kernel.h "
            << big << " ms (in this process: " << big_in_process << " ms)\n";
  // The helper's memory, in the debug log.
  spdlog::set_level(spdlog::level::debug);
  (void)RunNvrtcInHelper(compiler->helper_settings(), rejected);
  (void)RunNvrtcInHelper(compiler->helper_settings(), trivial);
  (void)RunNvrtcInHelper(compiler->helper_settings(), curand);
  spdlog::set_level(spdlog::level::info);
}

// How much address space (RLIMIT_AS, --compile-memory-bytes) a helper needs for a small
// kernel and for one including curand_kernel.h: the smallest limit, to 16 MiB, under which
// the compile succeeds. Slow (a binary search of compiles); run it by hand with
// --gtest_also_run_disabled_tests ($GPURPCD_BIN set: with gpurpcd as the helper, whose
// gRPC and protobuf libraries take more address space than this binary's).
TEST(CompileCostTest, DISABLED_SmallestMemoryLimit) {
  const auto works = [](const std::string& source, uint64_t memory_bytes) {
    CompilerOptions options;
    options.memory_cache_max_bytes = 0;
    options.sandbox.memory_bytes = memory_bytes;
    if (const char* gpurpcd = getenv("GPURPCD_BIN")) options.sandbox.helper_path = gpurpcd;
    absl::StatusOr<std::unique_ptr<Compiler>> compiler = Compiler::Create(options);
    if (!compiler.ok()) return false;
    CompileRequest request;
    request.source = source;
    request.target = "sm_90";
    absl::StatusOr<CompileResult> result = (*compiler)->Compile(request);
    return result.ok() && result->success;
  };
  for (const std::string& source :
       {std::string(kTail), std::string("#include <curand_kernel.h>\n") + kTail,
        std::string("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n") + kTail}) {
    uint64_t low = 64ull << 20, high = 8ull << 30;  // fails at low, works at high
    ASSERT_TRUE(works(source, high));
    while (high - low > (16ull << 20)) {
      const uint64_t middle = (low + high) / 2;
      (works(source, middle) ? high : low) = middle;
    }
    std::cout << "smallest --compile-memory-bytes: " << (high >> 20) << " MiB for "
              << source.substr(0, source.find('\n')) << "\n";
  }
}

}  // namespace
}  // namespace gpurpc::compiler
