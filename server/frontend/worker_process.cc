#include "server/frontend/worker_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

extern char** environ;

namespace gpurpc::frontend {
namespace {

constexpr int kChildFd = 3;

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Spawn(
    const std::string& exe, const std::vector<std::string>& args) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::UnavailableError(Errno("socketpair"));
  }
  // Keep the child's end above kChildFd so that dup2 always clears its close-on-exec flag.
  int child_end = fcntl(fds[1], F_DUPFD_CLOEXEC, 10);
  close(fds[1]);
  if (child_end < 0) {
    close(fds[0]);
    return absl::UnavailableError(Errno("fcntl(F_DUPFD_CLOEXEC)"));
  }

  std::vector<std::string> argv_strings = {exe};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_strings) argv.push_back(arg.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, child_end, kChildFd);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(child_end);
  if (rc != 0) {
    close(fds[0]);
    return absl::UnavailableError(
        absl::StrFormat("cannot start worker %s: %s", exe, std::strerror(rc)));
  }

  // gRPC 1.51 hangs on a blocking fd (DESIGN §2).
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  channel_args.SetMaxSendMessageSize(kMaxMessageBytes);
  auto channel = grpc::CreateCustomInsecureChannelFromFd(absl::StrCat("worker-", pid), fds[0],
                                                         channel_args);
  auto worker = std::unique_ptr<WorkerProcess>(new WorkerProcess(pid, std::move(channel)));
  worker->reaper_ = std::thread([w = worker.get()] { w->Reap(); });
  spdlog::debug("started worker pid {}", pid);
  return worker;
}

WorkerProcess::WorkerProcess(pid_t pid, std::shared_ptr<grpc::Channel> channel)
    : pid_(pid), channel_(std::move(channel)) {}

WorkerProcess::~WorkerProcess() {
  Kill();
  if (!reaper_.joinable()) return;
  // The last owner may drop us from inside the exit callback, on the reaper thread itself.
  if (reaper_.get_id() == std::this_thread::get_id()) {
    reaper_.detach();
  } else {
    reaper_.join();
  }
}

void WorkerProcess::Reap() {
  int status = 0;
  pid_t rc;
  do {
    rc = waitpid(pid_, &status, 0);
  } while (rc < 0 && errno == EINTR);
  std::string description;
  if (rc < 0) {
    description = Errno("waitpid");
  } else if (WIFEXITED(status)) {
    description = absl::StrCat("exited with code ", WEXITSTATUS(status));
  } else if (WIFSIGNALED(status)) {
    description = absl::StrFormat("was killed by signal %d (%s)", WTERMSIG(status),
                                  strsignal(WTERMSIG(status)));
  } else {
    description = "ended";
  }
  std::function<void(const std::string&)> callback;
  {
    std::lock_guard<std::mutex> lock(mu_);
    exited_ = true;
    exit_description_ = description;
    callback = std::move(on_exit_);
  }
  exited_cv_.notify_all();
  spdlog::debug("worker pid {} {}", pid_, description);
  if (callback) callback(description);
}

void WorkerProcess::Kill() {
  std::lock_guard<std::mutex> lock(mu_);
  // Only signal a pid we have not reaped yet: a reaped pid may belong to someone else.
  if (!exited_) kill(pid_, SIGKILL);
}

bool WorkerProcess::WaitExited(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return exited_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return exited_; });
}

bool WorkerProcess::exited() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exited_;
}

std::string WorkerProcess::exit_description() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exit_description_;
}

void WorkerProcess::SetExitCallback(std::function<void(const std::string&)> callback) {
  std::string description;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!exited_) {
      on_exit_ = std::move(callback);
      return;
    }
    description = exit_description_;
  }
  callback(description);
}

absl::StatusOr<v1::ListDevicesResponse> WorkerProcess::WaitReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto stub = v1::DeviceService::NewStub(channel_);
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(1))));
    context.set_wait_for_ready(true);
    v1::ListDevicesRequest request;
    v1::ListDevicesResponse response;
    grpc::Status status = stub->ListDevices(&context, request, &response);
    if (status.ok()) return response;
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return FromGrpcStatus(status);  // it runs, but cannot list devices
    }
    if (WaitExited(absl::ZeroDuration())) {
      return absl::UnavailableError(
          absl::StrCat("the worker process ", exit_description(), " while starting"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the worker process did not answer within ", absl::FormatDuration(timeout), ": ",
          status.error_message()));
    }
  }
}

}  // namespace gpurpc::frontend
