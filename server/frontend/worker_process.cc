#include "server/frontend/worker_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fd_passing.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

extern char** environ;

namespace gpurpc::frontend {
namespace {

// The child's fds: its gRPC socket (3), status pipe (4), region channel (5) and relay
// channel (6), as WorkerArgs names them.
constexpr int kChildFd = 3;
constexpr int kChildFdCount = 4;
constexpr size_t kMaxExitMessageBytes = 4096;

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Printable ASCII stays as it is; a backslash, control and non-ASCII bytes become \xNN.
std::string EscapeUnprintable(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && byte != '\\') {
      out += c;
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Spawn(
    const std::string& exe, const std::vector<std::string>& args) {
  // Our ends of the child's channels, and the child's ends (each duplicated above kChildFd so
  // that dup2 always clears its close-on-exec flag); whatever is still open when Spawn returns
  // is closed.
  struct Fds {
    int ours[kChildFdCount] = {-1, -1, -1, -1};
    int child[kChildFdCount] = {-1, -1, -1, -1};
    ~Fds() {
      for (const int fd : ours) {
        if (fd >= 0) close(fd);
      }
      for (const int fd : child) {
        if (fd >= 0) close(fd);
      }
    }
  } fds;
  for (int i = 0; i < kChildFdCount; ++i) {
    int pair[2];
    // The gRPC channel (a stream socket), the status pipe (ours reads), the region and the
    // relay channels (datagrams with descriptors).
    const int made = i == 0   ? socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair)
                     : i == 1 ? pipe2(pair, O_CLOEXEC)
                              : socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair);
    if (made != 0) return absl::UnavailableError(Errno(i == 1 ? "pipe2" : "socketpair"));
    fds.ours[i] = pair[0];
    fds.child[i] = fcntl(pair[1], F_DUPFD_CLOEXEC, 10);
    close(pair[1]);
    if (fds.child[i] < 0) return absl::UnavailableError(Errno("fcntl(F_DUPFD_CLOEXEC)"));
  }

  std::vector<std::string> argv_strings = {exe};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_strings) argv.push_back(arg.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (int i = 0; i < kChildFdCount; ++i) {
    posix_spawn_file_actions_adddup2(&actions, fds.child[i], kChildFd + i);
  }
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrFormat("cannot start worker %s: %s", exe, std::strerror(rc)));
  }
  const int channel_fd = std::exchange(fds.ours[0], -1);
  const int status_fd = std::exchange(fds.ours[1], -1);
  const int region_fd = std::exchange(fds.ours[2], -1);
  const int relay_fd = std::exchange(fds.ours[3], -1);

  // gRPC 1.51 hangs on a blocking fd (DESIGN §2).
  fcntl(channel_fd, F_SETFL, fcntl(channel_fd, F_GETFL) | O_NONBLOCK);
  // Read after the worker is reaped: whatever it wrote is there, and a process it left
  // behind holding the write end must not block the reaper.
  fcntl(status_fd, F_SETFL, fcntl(status_fd, F_GETFL) | O_NONBLOCK);
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  channel_args.SetMaxSendMessageSize(kMaxMessageBytes);
  channel_args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrameBytes);
  auto channel = grpc::CreateCustomInsecureChannelFromFd(absl::StrCat("worker-", pid), channel_fd,
                                                         channel_args);
  auto worker = std::unique_ptr<WorkerProcess>(
      new WorkerProcess(pid, std::move(channel), status_fd, region_fd, relay_fd));
  worker->reaper_ = std::thread([w = worker.get()] { w->Reap(); });
  spdlog::debug("started worker pid {}", pid);
  return worker;
}

WorkerProcess::WorkerProcess(pid_t pid, std::shared_ptr<grpc::Channel> channel, int status_fd,
                             int region_fd, int relay_fd)
    : pid_(pid),
      status_fd_(status_fd),
      relay_fd_(relay_fd),
      channel_(std::move(channel)),
      region_fd_(region_fd) {}

absl::StatusOr<int> WorkerProcess::OpenRelayedChannel(const char* kind) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return absl::UnavailableError(Errno("socketpair"));
  }
  // Never waits: a full relay channel (a worker that stopped taking channels) is a refusal.
  absl::Status sent = SendDatagram(relay_fd_, kind, {pair[1]}, MSG_DONTWAIT);
  close(pair[1]);
  if (!sent.ok()) {
    close(pair[0]);
    return absl::UnavailableError(
        absl::StrCat("cannot hand a relayed channel to the worker: ", sent.message()));
  }
  return pair[0];
}

absl::StatusOr<v1::AttachHostRegionReply> WorkerProcess::AttachRegion(
    const v1::AttachHostRegionRequest& request, int memfd, absl::Duration timeout) {
  // One at a time: a second attach of the same session is told to retry rather than park
  // a thread of the front end's blocking pool behind the first (pinning takes seconds).
  if (!region_mu_.TryLock()) {
    return absl::ResourceExhaustedError(
        "another attach of this session is in progress; attach one region at a time");
  }
  absl::StatusOr<v1::AttachHostRegionReply> reply = AttachRegionLocked(request, memfd, timeout);
  region_mu_.Unlock();
  return reply;
}

absl::StatusOr<v1::AttachHostRegionReply> WorkerProcess::AttachRegionLocked(
    const v1::AttachHostRegionRequest& request, int memfd, absl::Duration timeout) {
  if (region_fd_ < 0) {
    return absl::UnavailableError("the session's region channel is closed");
  }
  auto broken = [&](absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(region_mu_) {
    // A late answer could not be told from the next one: no more attaches on this worker.
    close(region_fd_);
    region_fd_ = -1;
    return status;
  };
  if (absl::Status sent = SendDatagram(region_fd_, request.SerializeAsString(), {memfd});
      !sent.ok()) {
    return broken(absl::UnavailableError(
        absl::StrCat("the session's worker is gone (", sent.message(), ")")));
  }
  pollfd pfd{region_fd_, POLLIN, 0};
  int ready = -1;
  do {
    ready = poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  } while (ready < 0 && errno == EINTR);
  if (ready == 0) {
    return broken(absl::DeadlineExceededError(
        absl::StrFormat("the session's worker did not map and pin the region within %s",
                        absl::FormatDuration(timeout))));
  }
  ReceivedDatagram answer;
  if (absl::Status received = ReceiveDatagram(region_fd_, &answer); !received.ok()) {
    return broken(absl::UnavailableError("the session's worker ended before it answered"));
  }
  v1::AttachHostRegionReply reply;
  if (answer.truncated || !answer.fds.empty() || !reply.ParseFromString(answer.bytes)) {
    return broken(absl::InternalError("the session's worker sent a malformed region answer"));
  }
  return reply;
}

WorkerProcess::~WorkerProcess() {
  Kill();
  {
    absl::MutexLock lock(&region_mu_);
    if (region_fd_ >= 0) close(region_fd_);
    region_fd_ = -1;
  }
  close(relay_fd_);
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
  // What the worker wrote before it ended is in the pipe (non-blocking: stop at EAGAIN).
  std::string message;
  char buffer[512];
  while (message.size() < kMaxExitMessageBytes) {
    const ssize_t n = read(status_fd_, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    message.append(buffer, std::min<size_t>(n, kMaxExitMessageBytes - message.size()));
  }
  close(status_fd_);
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) {
    message.pop_back();
  }
  // The line may quote a tenant's kernel name: never let it forge log lines or terminal
  // escapes.
  message = EscapeUnprintable(message);
  int code = -1;
  std::string description;
  if (rc < 0) {
    description = Errno("waitpid");
  } else if (WIFEXITED(status)) {
    code = WEXITSTATUS(status);
    description = absl::StrCat("exited with code ", code);
  } else if (WIFSIGNALED(status)) {
    description = absl::StrFormat("was killed by signal %d (%s)", WTERMSIG(status),
                                  strsignal(WTERMSIG(status)));
  } else {
    description = "ended";
  }
  std::function<void(const std::string&)> callback;
  {
    absl::MutexLock lock(&mu_);
    exited_ = true;
    exit_description_ = description;
    exit_code_ = code;
    exit_message_ = std::move(message);
    callback = std::move(on_exit_);
  }  // unlocking wakes WaitExited: absl::Mutex re-checks its Await condition
  spdlog::debug("worker pid {} {}", pid_, description);
  if (callback) callback(description);
}

void WorkerProcess::Kill() {
  absl::MutexLock lock(&mu_);
  // Only signal a pid we have not reaped yet: a reaped pid may belong to someone else.
  if (!exited_) kill(pid_, SIGKILL);
}

bool WorkerProcess::WaitExited(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&exited_), timeout);
}

bool WorkerProcess::exited() const {
  absl::MutexLock lock(&mu_);
  return exited_;
}

std::string WorkerProcess::exit_description() const {
  absl::MutexLock lock(&mu_);
  return exit_description_;
}

int WorkerProcess::exit_code() const {
  absl::MutexLock lock(&mu_);
  return exit_code_;
}

std::string WorkerProcess::exit_message() const {
  absl::MutexLock lock(&mu_);
  return exit_message_;
}

void WorkerProcess::SetExitCallback(std::function<void(const std::string&)> callback) {
  std::string description;
  {
    absl::MutexLock lock(&mu_);
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
      return absl::DeadlineExceededError(absl::StrCat("the worker process did not answer within ",
                                                      absl::FormatDuration(timeout), ": ",
                                                      status.error_message()));
    }
  }
}

}  // namespace gpurpc::frontend
