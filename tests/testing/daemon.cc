#include "tests/testing/daemon.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

extern char** environ;

namespace gpurpc::testing {

std::string TestDaemon::Binary() {
  if (const char* bin = std::getenv("GPURPCD_BIN"); bin != nullptr && *bin != '\0') return bin;
  return GPURPC_GPURPCD_PATH;
}

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(Options options) {
  auto daemon = std::unique_ptr<TestDaemon>(new TestDaemon());
  char tmpl[] = "/tmp/gpurpc-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  daemon->dir_ = tmpl;
  std::string socket_path = daemon->dir_ + "/gpurpcd.sock";
  if (!options.unix_socket_path.empty()) socket_path = options.unix_socket_path;
  if (options.default_unix_socket) {
    daemon->runtime_dir_ = daemon->dir_ + "/xdg";
    if (mkdir(daemon->runtime_dir_.c_str(), 0700) != 0) {
      return absl::InternalError(absl::StrCat("mkdir ", daemon->runtime_dir_, " failed"));
    }
    socket_path = daemon->runtime_dir_ + "/gpurpc/gpurpcd.sock";
  }
  daemon->address_ = absl::StrCat("unix:", socket_path);
  daemon->log_path_ = daemon->dir_ + "/gpurpcd.log";
  if (options.cache_dir.empty()) {
    daemon->cache_dir_ = daemon->dir_ + "/cache";
    daemon->own_cache_dir_ = true;
  } else {
    daemon->cache_dir_ = options.cache_dir;
  }

  std::string listen_flag = "--listen=";
  if (options.listen_tcp) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    if (!port.ok()) return port.status();
    daemon->tcp_address_ = absl::StrCat("127.0.0.1:", *port);
    listen_flag += daemon->tcp_address_;
  }
  std::vector<std::string> args = {Binary(), listen_flag};
  if (!options.default_unix_socket) args.push_back(absl::StrCat("--unix-socket=", socket_path));
  args.insert(args.end(), {absl::StrCat("--backend=", options.backend),
                           absl::StrCat("--session-idle-timeout=", options.idle_timeout),
                           absl::StrCat("--warm-workers=", options.warm_workers),
                           absl::StrCat("--cache-dir=", daemon->cache_dir_), "--log-level=debug",
                           // Stopped with SIGTERM at the end of every test: no drain (a
                           // test's --drain-timeout in extra_flags comes later and wins).
                           "--drain-timeout=0s"});
  args.insert(args.end(), options.extra_flags.begin(), options.extra_flags.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  // The environment: ours, minus what options.env replaces, plus options.env.
  std::vector<std::string> env_strings = options.env;
  if (options.default_unix_socket) {
    env_strings.push_back(absl::StrCat("XDG_RUNTIME_DIR=", daemon->runtime_dir_));
  }
  auto replaced = [&](const char* entry) {
    const char* eq = std::strchr(entry, '=');
    const std::string name(entry, eq == nullptr ? std::strlen(entry) : eq - entry);
    for (const std::string& e : env_strings) {
      if (e.compare(0, name.size() + 1, name + "=") == 0) return true;
    }
    return false;
  };
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!replaced(*e)) envp.push_back(*e);
  }
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, daemon->log_path_.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 2, 1);
  const int rc = posix_spawn(&daemon->pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    daemon->pid_ = -1;
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", strerror(rc)));
  }

  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    int status;
    if (waitpid(daemon->pid_, &status, WNOHANG) == daemon->pid_) {
      daemon->pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat("gpurpcd exited at start; its log:\n", daemon->Log()));
    }
    if (access(socket_path.c_str(), F_OK) == 0) {
      // A plain blocking stub on its own socket: no GPURPC_* variable of the test's
      // environment (a token, TLS files) changes how the harness talks to it, and no callback
      // call of the client library is left behind: the reference such a call holds may be the
      // last one to its channel and drop on gRPC 1.51's callback thread, whose teardown from
      // that thread aborts the process ("grpc_cq_internal_unref: assertion failed").
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      v1::DeviceService::Stub stub(
          grpc::CreateCustomChannel(daemon->address_, grpc::InsecureChannelCredentials(), args));
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      v1::ListDevicesResponse devices;
      if (stub.ListDevices(&context, v1::ListDevicesRequest(), &devices).ok()) return daemon;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("gpurpcd did not answer within 60 s; its log:\n", daemon->Log()));
}

TestDaemon::~TestDaemon() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    int status;
    bool ended = false;
    for (int i = 0; i < 1000 && !ended; ++i) {
      ended = waitpid(pid_, &status, WNOHANG) == pid_;
      if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!ended) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
  }
  if (!dir_.empty()) {
    std::string command = absl::StrCat("rm -rf '", dir_, "'");
    if (std::system(command.c_str()) != 0) {
      // Leaving a temporary directory behind is harmless.
    }
  }
}

absl::Status TestDaemon::CheckRunning() {
  if (pid_ <= 0) return absl::UnavailableError("gpurpcd is not running (it exited earlier)");
  int status = 0;
  const pid_t waited = waitpid(pid_, &status, WNOHANG);
  if (waited == 0) return absl::OkStatus();
  std::string how = "could not be waited for";
  if (waited == pid_) {
    pid_ = -1;
    if (WIFEXITED(status)) {
      how = absl::StrCat("exited with status ", WEXITSTATUS(status));
    } else if (WIFSIGNALED(status)) {
      how = absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                         strsignal(WTERMSIG(status)), ")");
    }
  }
  return absl::UnavailableError(absl::StrCat("gpurpcd ", how, "; its log:\n", Log()));
}

std::string TestDaemon::Log() const {
  std::ifstream in(log_path_);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<pid_t> TestDaemon::WorkerPids() const {
  std::vector<pid_t> pids;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  while (dirent* entry = readdir(proc)) {
    const pid_t pid = std::atoi(entry->d_name);
    if (pid <= 0) continue;
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    std::getline(stat, line);
    // pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'.
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(line.substr(paren + 2), ' ');
    if (fields.size() > 1 && std::atoi(fields[1].c_str()) == pid_ && fields[0] != "Z") {
      pids.push_back(pid);
    }
  }
  closedir(proc);
  return pids;
}

int KillDeviceWorkers(TestDaemon& daemon, std::vector<pid_t>* pids) {
  int killed = 0;
  for (const pid_t pid : daemon.WorkerPids()) {
    std::ifstream file(absl::StrCat("/proc/", pid, "/cmdline"));
    std::string cmdline((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (cmdline.find("--device=-1") != std::string::npos) continue;
    if (kill(pid, SIGKILL) == 0) {
      ++killed;
      if (pids != nullptr) pids->push_back(pid);
    }
  }
  return killed;
}

absl::Status CudaAvailable() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    return absl::UnavailableError(absl::StrCat("no CUDA driver (libcuda.so.1): ", dlerror()));
  }
  dlclose(driver);
  return absl::OkStatus();
}

absl::StatusOr<TestToken> MakeToken(const std::string& tenant) {
  const std::string command = absl::StrCat("'", TestDaemon::Binary(), "' --new-token=", tenant);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("popen failed: ", command));
  std::string out;
  char buffer[1024];
  for (size_t n; (n = fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int status = pclose(pipe);
  std::vector<std::string> lines = absl::StrSplit(out, '\n');
  if (status != 0 || lines.size() < 2 || lines[1].rfind(tenant + ":", 0) != 0) {
    return absl::InternalError(absl::StrCat("`", command, "` failed (status ", status, "): ", out));
  }
  return TestToken{lines[0], lines[1]};
}

absl::StatusOr<std::string> ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const std::string error = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect: ", error));
  }
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  char buffer[65536];
  bool closed = false;
  while (!closed && absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      closed = true;
    } else {
      raw.append(buffer, static_cast<size_t>(n));
    }
  }
  close(fd);
  if (!closed) return absl::DeadlineExceededError("/metrics did not end its answer in 20 s");
  const size_t body = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 200", 0) != 0 || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("not a 200 answer: '", raw.substr(0, 200), "'"));
  }
  return raw.substr(body + 4);
}

absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string error = strerror(errno);
    close(fd);
    return absl::InternalError(absl::StrCat("binding a loopback port: ", error));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace gpurpc::testing
