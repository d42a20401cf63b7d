#include "server/worker/compiler/compile_helper.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/parse_limit.h"
#include "server/worker/compiler/compile_helper.pb.h"
#include "server/worker/compiler/nvrtc_library.h"
#include "spdlog/spdlog.h"

namespace gpurpc::compiler {
namespace {

// Frame bounds: settings and Hello are small; a request holds at most the source and the
// headers (MiBs), a response the image and the log.
constexpr uint32_t kMaxSmallFrame = 1u << 20;
constexpr uint32_t kMaxLargeFrame = 256u << 20;
// NVRTC's log as it reaches the worker, the client and the cache: a few hundred bytes of
// macros can make NVRTC print ~100 MB (nested expansions in _Pragma(message)), which every
// copy and the shared disk cache would otherwise carry.
constexpr size_t kMaxLogBytes = 1u << 20;

void CapLog(std::string* log) {
  if (log->size() <= kMaxLogBytes) return;
  const size_t full = log->size();
  log->resize(kMaxLogBytes);
  absl::StrAppend(log, "\n[gpurpc: NVRTC's log was ", full, " bytes; only the first ", kMaxLogBytes,
                  " are kept]\n");
}

// Exit statuses of the helper (besides 0).
constexpr int kExitProtocol = 2;     // no usable settings or request
constexpr int kExitNotConfined = 3;  // told the worker why in Hello
constexpr int kExitOutOfMemory = 4;  // operator new failed in our own code

// Set in every helper's environment. A process that has it and still gets to start a
// helper was started as one but is not one (a helper_path whose main() ignores
// --internal-compile-helper, e.g. a test binary without compile_helper_main.cc): it must
// not start helpers in turn.
constexpr char kHelperEnv[] = "GPURPC_COMPILE_HELPER=1";

constexpr char kProbeKernel[] = "extern \"C\" __global__ void gpurpc_probe(int* p) { *p = 1; }\n";

// --------------------------------------------------------------------------- framing

// Which way a frame transfer failed: the peer went away (the worker then asks the kernel
// why), or anything else.
constexpr absl::string_view kPeerClosed = "the compile helper closed the connection";

absl::Status WaitFd(int fd, short events, absl::Time deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("deadline");
      timeout_ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
    }
    pollfd entry{fd, events, 0};
    const int ready = poll(&entry, 1, timeout_ms);
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("poll: ", strerror(errno)));
    }
  }
}

absl::Status SendAll(int fd, const char* data, size_t size, absl::Time deadline) {
  while (size > 0) {
    const ssize_t sent = send(fd, data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      data += sent;
      size -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      GPURPC_RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline));
      continue;
    }
    if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      return absl::UnavailableError(kPeerClosed);
    }
    return absl::InternalError(absl::StrCat("send: ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, char* data, size_t size, absl::Time deadline) {
  while (size > 0) {
    const ssize_t got = recv(fd, data, size, MSG_DONTWAIT);
    if (got > 0) {
      data += got;
      size -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0 || (got < 0 && errno == ECONNRESET)) return absl::UnavailableError(kPeerClosed);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      GPURPC_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline));
      continue;
    }
    return absl::InternalError(absl::StrCat("recv: ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteFrame(int fd, const google::protobuf::MessageLite& message, absl::Time deadline) {
  std::string bytes;
  if (!message.SerializeToString(&bytes) || bytes.size() > kMaxLargeFrame) {
    return absl::InternalError(
        absl::StrCat("cannot frame a ", message.GetTypeName(), " of ", bytes.size(), " bytes"));
  }
  const uint32_t size = static_cast<uint32_t>(bytes.size());
  const char prefix[4] = {static_cast<char>(size), static_cast<char>(size >> 8),
                          static_cast<char>(size >> 16), static_cast<char>(size >> 24)};
  GPURPC_RETURN_IF_ERROR(SendAll(fd, prefix, sizeof(prefix), deadline));
  return SendAll(fd, bytes.data(), bytes.size(), deadline);
}

absl::Status ReadFrame(int fd, google::protobuf::MessageLite* message, uint32_t max_size,
                       absl::Time deadline) {
  unsigned char prefix[4];
  GPURPC_RETURN_IF_ERROR(RecvAll(fd, reinterpret_cast<char*>(prefix), sizeof(prefix), deadline));
  const uint32_t size = prefix[0] | (uint32_t{prefix[1]} << 8) | (uint32_t{prefix[2]} << 16) |
                        (uint32_t{prefix[3]} << 24);
  if (size > max_size) {
    return absl::InternalError(absl::StrCat("a ", message->GetTypeName(), " of ", size,
                                            " bytes is over the limit of ", max_size));
  }
  // Grown as bytes arrive: a peer that announces a large frame and stalls holds no memory.
  std::string bytes;
  constexpr size_t kStep = 1u << 20;
  while (bytes.size() < size) {
    const size_t at = bytes.size();
    const size_t step = std::min<size_t>(kStep, size - at);
    bytes.resize(at + step);
    GPURPC_RETURN_IF_ERROR(RecvAll(fd, bytes.data() + at, step, deadline));
  }
  // What the bytes parse to is bounded before they are parsed (server/parse_limit.h): the
  // helper compiles a tenant's source, so a reply of many tiny fields could otherwise take
  // many times its size in the worker. Twice the size and the allowance: a large string (a
  // cubin, a long log) parses to at most about twice its bytes.
  if (const auto* full = dynamic_cast<const google::protobuf::Message*>(message); full != nullptr) {
    absl::Status bound = CheckParsedBytes(
        *full->GetDescriptor(), bytes,
        [&] { return absl::StrCat("a ", message->GetTypeName(), " read from its peer"); },
        2 * bytes.size() + kParsedAllowanceBytes);
    if (!bound.ok()) return absl::InternalError(bound.message());
  }
  if (!message->ParseFromString(bytes)) {
    return absl::InternalError(absl::StrCat("malformed ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

std::string MemoryLimitMessage(uint64_t memory_bytes) {
  return absl::StrCat("the compile needs more memory than its limit of ", memory_bytes,
                      " bytes of address space (--compile-memory-bytes)");
}

// ---------------------------------------------------------------------- the helper side

// Owns one nvrtcProgram.
class Program {
 public:
  explicit Program(const NvrtcLibrary& nvrtc) : nvrtc_(nvrtc) {}
  ~Program() {
    if (program_ != nullptr) nvrtc_.DestroyProgram(&program_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  nvrtcProgram* out() { return &program_; }
  nvrtcProgram get() const { return program_; }

 private:
  const NvrtcLibrary& nvrtc_;
  nvrtcProgram program_ = nullptr;
};

void SetError(helper::Response* response, absl::Status status) {
  response->set_error_code(static_cast<int>(status.code()));
  response->set_error_message(std::string(status.message()));
}

absl::Status NvrtcError(const NvrtcLibrary& nvrtc, absl::string_view call, nvrtcResult result,
                        uint64_t memory_bytes) {
  const std::string message = absl::StrCat(call, " failed: ", nvrtc.ErrorName(result));
  switch (result) {
    case NVRTC_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(
          absl::StrCat(message, ": ", MemoryLimitMessage(memory_bytes)));
    case NVRTC_ERROR_INVALID_INPUT:
    case NVRTC_ERROR_INVALID_OPTION:
    case NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

// The compile itself, inside the confined helper.
void RunNvrtc(const NvrtcLibrary& nvrtc, const helper::Request& request, uint64_t memory_bytes,
              helper::Response* response) {
  std::vector<const char*> header_contents, header_names;
  for (const helper::Header& header : request.headers()) {
    header_contents.push_back(header.content().c_str());
    header_names.push_back(header.name().c_str());
  }
  Program program(nvrtc);
  nvrtcResult status = nvrtc.CreateProgram(
      program.out(), request.source().c_str(), request.program_name().c_str(),
      static_cast<int>(header_contents.size()), header_contents.data(), header_names.data());
  if (status != NVRTC_SUCCESS) {
    return SetError(response, NvrtcError(nvrtc, "nvrtcCreateProgram", status, memory_bytes));
  }
  for (const std::string& expression : request.name_expressions()) {
    status = nvrtc.AddNameExpression(program.get(), expression.c_str());
    if (status != NVRTC_SUCCESS) {
      return SetError(response,
                      NvrtcError(nvrtc, absl::StrCat("nvrtcAddNameExpression('", expression, "')"),
                                 status, memory_bytes));
    }
  }
  std::vector<const char*> options;
  for (const std::string& option : request.options()) options.push_back(option.c_str());
  const nvrtcResult compiled =
      nvrtc.CompileProgram(program.get(), static_cast<int>(options.size()), options.data());
  response->set_compile_result(compiled);

  size_t log_size = 0;
  status = nvrtc.GetProgramLogSize(program.get(), &log_size);
  if (status != NVRTC_SUCCESS) {
    return SetError(response, NvrtcError(nvrtc, "nvrtcGetProgramLogSize", status, memory_bytes));
  }
  std::string log(log_size, '\0');
  if (log_size > 0) {
    status = nvrtc.GetProgramLog(program.get(), log.data());
    if (status != NVRTC_SUCCESS) {
      return SetError(response, NvrtcError(nvrtc, "nvrtcGetProgramLog", status, memory_bytes));
    }
  }
  while (!log.empty() && log.back() == '\0') log.pop_back();
  // NVRTC's front end reports exhausted memory as a compile error.
  if (compiled == NVRTC_ERROR_OUT_OF_MEMORY ||
      (compiled == NVRTC_ERROR_COMPILATION &&
       absl::StrContains(log, "catastrophic error: out of memory"))) {
    return SetError(response, absl::ResourceExhaustedError(MemoryLimitMessage(memory_bytes)));
  }
  CapLog(&log);
  response->set_log(std::move(log));
  if (compiled != NVRTC_SUCCESS) return;

  size_t image_size = 0;
  status = request.cubin() ? nvrtc.GetCUBINSize(program.get(), &image_size)
                           : nvrtc.GetPTXSize(program.get(), &image_size);
  if (status != NVRTC_SUCCESS) {
    return SetError(response,
                    NvrtcError(nvrtc, request.cubin() ? "nvrtcGetCUBINSize" : "nvrtcGetPTXSize",
                               status, memory_bytes));
  }
  std::string image(image_size, '\0');
  if (image_size > 0) {
    status = request.cubin() ? nvrtc.GetCUBIN(program.get(), image.data())
                             : nvrtc.GetPTX(program.get(), image.data());
    if (status != NVRTC_SUCCESS) {
      return SetError(response, NvrtcError(nvrtc, request.cubin() ? "nvrtcGetCUBIN" : "nvrtcGetPTX",
                                           status, memory_bytes));
    }
  }
  response->set_image(std::move(image));
  for (const std::string& expression : request.name_expressions()) {
    const char* lowered = nullptr;
    status = nvrtc.GetLoweredName(program.get(), expression.c_str(), &lowered);
    if (status != NVRTC_SUCCESS || lowered == nullptr) {
      return SetError(response, absl::InvalidArgumentError(absl::StrCat(
                                    "name expression '", expression,
                                    "' has no lowered name: ", nvrtc.ErrorName(status))));
    }
    helper::LoweredName* name = response->add_lowered_names();
    name->set_expression(expression);
    name->set_lowered(lowered);
  }
}

// NVRTC dlopen()s libnvrtc-builtins by name during the first compile; once confined it
// could not open it, so it is loaded now (the later dlopen finds it by its SONAME).
absl::Status PreloadBuiltins(const NvrtcLibrary& nvrtc) {
  const size_t slash = nvrtc.path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : nvrtc.path.substr(0, slash);
  const bool alt = absl::StrContains(nvrtc.path.substr(slash + 1), ".alt.");
  const std::string file = absl::StrCat(dir, "/libnvrtc-builtins", alt ? ".alt" : "", ".so.",
                                        nvrtc.major, ".", nvrtc.minor);
  if (dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot preload ", file, ": ", error != nullptr ? error : "unknown error"));
  }
  return absl::OkStatus();
}

// Loads NVRTC, limits and confines the process as the settings say.
absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> Prepare(const helper::Config& config, int fd,
                                                            helper::Hello* hello) {
  const std::optional<SandboxMode> mode = ParseSandboxMode(config.sandbox_mode());
  if (!mode.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown sandbox mode '", config.sandbox_mode(), "'"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<const NvrtcLibrary> nvrtc,
                          NvrtcLibrary::LoadFile(config.nvrtc_path()));
  GPURPC_RETURN_IF_ERROR(PreloadBuiltins(*nvrtc));
  GPURPC_RETURN_IF_ERROR(LimitSelf(config.cpu_seconds(), config.memory_bytes(), fd));
  const std::vector<std::string> read_dirs(config.read_dirs().begin(), config.read_dirs().end());
  GPURPC_ASSIGN_OR_RETURN(Confinement confinement,
                          ConfineSelf(*mode, config.allow_unsandboxed(), read_dirs));
  hello->set_sandbox(confinement.description);
  for (std::string& note : confinement.notes) hello->add_notes(std::move(note));
  return nvrtc;
}

// ---------------------------------------------------------------------- the worker side

struct Child {
  pid_t pid = -1;
  int fd = -1;  // the worker's end of the socketpair
};

absl::StatusOr<Child> SpawnHelper(const std::string& path) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", strerror(errno)));
  }
  int child_end = fds[1];
  // The file actions below overwrite fds 0-3 in the child: keep its end out of their way.
  if (child_end <= kCompileHelperFd) {
    child_end = fcntl(fds[1], F_DUPFD_CLOEXEC, 10);
    close(fds[1]);
    if (child_end < 0) {
      close(fds[0]);
      return absl::InternalError(absl::StrCat("fcntl(F_DUPFD_CLOEXEC): ", strerror(errno)));
    }
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, child_end, kCompileHelperFd);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  sigdelset(&all, SIGKILL);
  sigdelset(&all, SIGSTOP);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setsigdefault(&attributes, &all);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  // The helper's environment: only what the dynamic loader needs to find our libraries
  // (the relocatable install's launcher sets LD_LIBRARY_PATH), and the helper marker. No
  // secrets in /proc/<helper>/environ, nothing that changes NVRTC's behaviour.
  std::vector<std::string> environment = {kHelperEnv};
  if (const char* library_path = getenv("LD_LIBRARY_PATH"); library_path != nullptr) {
    environment.push_back(absl::StrCat("LD_LIBRARY_PATH=", library_path));
  }
  std::vector<char*> envp;
  for (std::string& variable : environment) envp.push_back(variable.data());
  envp.push_back(nullptr);
  std::string flag = kCompileHelperFlag;
  std::string program = path;
  char* argv[] = {program.data(), flag.data(), nullptr};

  pid_t pid = -1;
  const int rc = posix_spawn(&pid, path.c_str(), &actions, &attributes, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  close(child_end);
  if (rc != 0) {
    close(fds[0]);
    return absl::InternalError(
        absl::StrCat("cannot start the compile helper ", path, ": ", strerror(rc)));
  }
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  return Child{pid, fds[0]};
}

struct Exit {
  int status = 0;
  rusage usage{};
};

// The helper is killed in every case: once its answer is in, there is nothing left for it
// to do; a helper that has closed its socket is already exiting, and its status stays.
Exit KillAndReap(pid_t pid) {
  Exit exit;
  kill(pid, SIGKILL);
  while (wait4(pid, &exit.status, 0, &exit.usage) < 0 && errno == EINTR) {
  }
  return exit;
}

// Why a helper ended without answering.
absl::Status DeathStatus(const Exit& exit, const SandboxOptions& sandbox, absl::string_view stage) {
  const double cpu = absl::ToDoubleSeconds(absl::DurationFromTimeval(exit.usage.ru_utime) +
                                           absl::DurationFromTimeval(exit.usage.ru_stime));
  if (WIFSIGNALED(exit.status)) {
    const int signal = WTERMSIG(exit.status);
    if (signal == SIGXCPU ||
        (signal == SIGKILL && cpu >= static_cast<double>(sandbox.cpu_seconds))) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the compile used more than its CPU-time limit of ", sandbox.cpu_seconds,
                       " s (--compile-cpu-seconds)"));
    }
    return absl::InternalError(absl::StrCat("the compile helper died from signal ", signal, " (",
                                            strsignal(signal), ") ", stage));
  }
  const int code = WIFEXITED(exit.status) ? WEXITSTATUS(exit.status) : -1;
  if (code == kExitOutOfMemory) {
    return absl::ResourceExhaustedError(MemoryLimitMessage(sandbox.memory_bytes));
  }
  return absl::InternalError(absl::StrCat("the compile helper (", sandbox.helper_path,
                                          ") exited with status ", code, " ", stage));
}

absl::StatusOr<NvrtcOutcome> RunHelper(const HelperSettings& settings,
                                       const NvrtcInvocation& invocation,
                                       std::vector<std::string>* notes) {
  const SandboxOptions& sandbox = settings.sandbox;
  if (sandbox.mode == SandboxMode::kNone && !sandbox.allow_unsandboxed) {
    return absl::FailedPreconditionError(
        "compiles are refused: --compile-sandbox=none runs NVRTC unconfined; pass "
        "--allow-unsandboxed-compile to accept that");
  }
  if (getenv("GPURPC_COMPILE_HELPER") != nullptr) {
    return absl::InternalError(absl::StrCat(
        "this process was started as a compile helper but did not act as one: ",
        sandbox.helper_path, " must dispatch ", kCompileHelperFlag, " to CompileHelperMain()"));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + sandbox.timeout;
  GPURPC_ASSIGN_OR_RETURN(Child child, SpawnHelper(sandbox.helper_path));

  absl::string_view stage = "before it confined itself";
  NvrtcOutcome outcome;
  const absl::Status status = [&]() -> absl::Status {
    helper::Config config;
    config.set_sandbox_mode(std::string(SandboxModeName(sandbox.mode)));
    config.set_allow_unsandboxed(sandbox.allow_unsandboxed);
    config.set_cpu_seconds(sandbox.cpu_seconds);
    config.set_memory_bytes(sandbox.memory_bytes);
    for (const std::string& dir : settings.read_dirs) config.add_read_dirs(dir);
    config.set_nvrtc_path(settings.nvrtc_path);
    GPURPC_RETURN_IF_ERROR(WriteFrame(child.fd, config, deadline));
    helper::Hello hello;
    GPURPC_RETURN_IF_ERROR(ReadFrame(child.fd, &hello, kMaxSmallFrame, deadline));
    if (notes != nullptr) notes->assign(hello.notes().begin(), hello.notes().end());
    if (!hello.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("compiles are refused: the compile sandbox (--compile-sandbox=",
                       SandboxModeName(sandbox.mode), ") cannot be applied: ", hello.error()));
    }
    outcome.sandbox = hello.sandbox();
    stage = "while compiling";

    helper::Request request;
    request.set_source(invocation.source);
    request.set_program_name(invocation.program_name);
    for (const std::string& option : invocation.options) request.add_options(option);
    for (const auto& [name, content] : invocation.headers) {
      helper::Header* header = request.add_headers();
      header->set_name(name);
      header->set_content(content);
    }
    for (const std::string& expression : invocation.name_expressions) {
      request.add_name_expressions(expression);
    }
    request.set_cubin(invocation.cubin);
    GPURPC_RETURN_IF_ERROR(WriteFrame(child.fd, request, deadline));
    helper::Response response;
    GPURPC_RETURN_IF_ERROR(ReadFrame(child.fd, &response, kMaxLargeFrame, deadline));
    if (response.error_code() != 0) {
      // The helper has run the client's compile: trust its code only within range.
      const int code = response.error_code();
      return absl::Status(code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
                              ? static_cast<absl::StatusCode>(code)
                              : absl::StatusCode::kInternal,
                          response.error_message());
    }
    outcome.compile_result = response.compile_result();
    outcome.log = std::move(*response.mutable_log());
    CapLog(&outcome.log);  // the helper is not trusted to have done it
    outcome.image.assign(response.image().begin(), response.image().end());
    for (const helper::LoweredName& name : response.lowered_names()) {
      outcome.lowered_names.emplace_back(name.expression(), name.lowered());
    }
    return absl::OkStatus();
  }();
  close(child.fd);
  const Exit exit = KillAndReap(child.pid);
  spdlog::debug("compile helper {}: {} in {} ({})", child.pid,
                status.ok() ? "compiled" : status.ToString(),
                absl::FormatDuration(absl::Now() - start), outcome.sandbox);
  if (status.ok()) return outcome;
  if (absl::IsDeadlineExceeded(status)) {
    return absl::DeadlineExceededError(
        absl::StrCat("the compile took longer than its wall-time limit of ",
                     absl::FormatDuration(sandbox.timeout), " (--compile-timeout)"));
  }
  if (absl::IsUnavailable(status) && status.message() == kPeerClosed) {
    return DeathStatus(exit, sandbox, stage);
  }
  return status;
}

}  // namespace

absl::StatusOr<NvrtcOutcome> RunNvrtcInHelper(const HelperSettings& settings,
                                              const NvrtcInvocation& invocation) {
  return RunHelper(settings, invocation, nullptr);
}

std::string ProbeCompileSandbox(const HelperSettings& settings, std::vector<std::string>* notes) {
  NvrtcInvocation probe;
  probe.source = kProbeKernel;
  probe.program_name = "gpurpc_probe.cu";
  probe.options = {"--gpu-architecture=compute_75"};
  probe.cubin = false;
  std::vector<std::string> skipped;
  absl::StatusOr<NvrtcOutcome> outcome = RunHelper(settings, probe, &skipped);
  for (const std::string& why : skipped) spdlog::info("compile sandbox: skipped {}", why);
  if (notes != nullptr) *notes = skipped;
  if (!outcome.ok()) return absl::StrCat("unavailable: ", outcome.status().message());
  if (outcome->compile_result != NVRTC_SUCCESS || outcome->image.size() <= 1) {
    return absl::StrCat("unavailable: NVRTC cannot compile inside ", outcome->sandbox,
                        " (nvrtcResult ", outcome->compile_result, "): ", outcome->log);
  }
  return outcome->sandbox;
}

int CompileHelperMain() {
  // Our own allocations (protobuf, strings) failing under RLIMIT_AS: say so by the status.
  std::set_new_handler([] { _exit(kExitOutOfMemory); });
  const int fd = kCompileHelperFd;
  helper::Config config;
  if (!ReadFrame(fd, &config, kMaxSmallFrame, absl::InfiniteFuture()).ok()) return kExitProtocol;

  helper::Hello hello;
  absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> nvrtc = Prepare(config, fd, &hello);
  hello.set_ok(nvrtc.ok());
  if (!nvrtc.ok()) hello.set_error(std::string(nvrtc.status().message()));
  if (!WriteFrame(fd, hello, absl::InfiniteFuture()).ok() || !nvrtc.ok()) {
    _exit(nvrtc.ok() ? kExitProtocol : kExitNotConfined);
  }

  // From here on the input is the client's.
  helper::Request request;
  if (!ReadFrame(fd, &request, kMaxLargeFrame, absl::InfiniteFuture()).ok()) _exit(kExitProtocol);
  helper::Response response;
  RunNvrtc(**nvrtc, request, config.memory_bytes(), &response);
  const bool sent = WriteFrame(fd, response, absl::InfiniteFuture()).ok();
  // No destructors: NVRTC's state dies with the process.
  _exit(sent ? 0 : kExitProtocol);
}

absl::Status ReadHelperFrame(int fd, google::protobuf::MessageLite* message, uint32_t max_size,
                             absl::Time deadline) {
  return ReadFrame(fd, message, max_size, deadline);
}

}  // namespace gpurpc::compiler
