// The life of a session as the daemon runs it (ctest label `service`): WatchSession, the
// reclaim of sessions whose client is gone (the grace period after the last watch, the idle
// timeout of clients that never watch), daemon restarts (gpurpc-instance), the fault codes of
// a crashed worker and of the kernel watchdog, and a flood of not-ready answers. Against a
// real gpurpcd with real worker processes on the fake backend, whose spin_us kernel runs on a
// stream thread (a launch returns at once, as on a GPU).
//
// Everything goes through the raw gpurpc.v1 stubs, so that the test controls exactly what is
// sent: the client libraries open WatchSession and send gpurpc-instance on their own, which
// would keep sessions alive that a test wants reclaimed. Tenants "alice" and "bob" reach the
// daemon over loopback TCP with bearer tokens; the test's own user, over the Unix socket, is
// the daemon's admin (to learn a session's worker pid).
//
// No timing assertions: what must happen is polled for with generous deadlines, and what must
// not happen is watched for a bounded time.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/v1/admin_service.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::kEventually;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = 1ull << 20;
constexpr absl::Duration kCallTimeout = absl::Seconds(60);
constexpr int32_t kFailedPrecondition = static_cast<int32_t>(absl::StatusCode::kFailedPrecondition);
constexpr int32_t kDeadlineExceeded = static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded);

// The fake backend's built-in kernels as real CUDA (tests/testing/fake_kernels.h).
constexpr const char* kFakeKernels = ::gpurpc::testing::kFakeKernelsSource;

std::string CurrentUser() {
  struct passwd* pw = getpwuid(geteuid());
  return pw != nullptr ? pw->pw_name : absl::StrCat("uid-", geteuid());
}

// Checks `condition` every 100 ms for `duration`: false at the first time it does not hold.
bool Throughout(absl::Duration duration, const std::function<bool()>& condition) {
  const absl::Time end = absl::Now() + duration;
  while (absl::Now() < end) {
    if (!condition()) return false;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return condition();
}

// Joins a thread when the scope ends, also when an ASSERT returns early (after `stop`, which
// tells the thread to end).
class JoinOnExit {
 public:
  explicit JoinOnExit(std::thread& thread, std::function<void()> stop = nullptr)
      : thread_(thread), stop_(std::move(stop)) {}
  ~JoinOnExit() {
    if (stop_) stop_();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread& thread_;
  std::function<void()> stop_;
};

// A folder for tokens, config files and sockets, private to the test.
class Scratch {
 public:
  Scratch() {
    char dir[] = "/tmp/gpurpc-lifecycle-XXXXXX";
    if (mkdtemp(dir) != nullptr) path_ = dir;
  }
  ~Scratch() {
    if (!path_.empty() && std::system(absl::StrCat("rm -rf '", path_, "'").c_str()) != 0) {
      // A leftover temporary folder is harmless.
    }
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string file = absl::StrCat(path_, "/", name);
    std::ofstream(file) << text;
    chmod(file.c_str(), 0600);
    return file;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One client identity on one channel: a tenant over TCP (with its token) or the Unix-socket
// user (no token). Every call is raw: the metadata is exactly what the test asks for.
class Caller {
 public:
  Caller(std::shared_ptr<grpc::Channel> channel, std::string token)
      : channel_(std::move(channel)),
        token_(std::move(token)),
        sessions_(v1::SessionService::NewStub(channel_)),
        devices_(v1::DeviceService::NewStub(channel_)),
        memory_(v1::MemoryService::NewStub(channel_)),
        modules_(v1::ModuleService::NewStub(channel_)),
        execution_(v1::ExecutionService::NewStub(channel_)),
        admin_(v1::AdminService::NewStub(channel_)) {}

  // The credentials, the session id (0: none), the daemon instance ("": none) and a deadline
  // (infinite: none).
  void Prepare(grpc::ClientContext* context, uint64_t session_id = 0,
               const std::string& instance = "", absl::Duration timeout = kCallTimeout) const {
    if (!token_.empty()) context->AddMetadata("authorization", "Bearer " + token_);
    if (session_id != 0) context->AddMetadata(kSessionMetadataKey, std::to_string(session_id));
    if (!instance.empty()) context->AddMetadata(kInstanceMetadataKey, instance);
    if (timeout != absl::InfiniteDuration()) {
      context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    }
  }

  // One unary call of `stub`'s `method` on `session_id` (0: not session-scoped).
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Call(
      Stub* stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
      const Request& request, uint64_t session_id = 0, const std::string& instance = "",
      absl::Duration timeout = kCallTimeout) const {
    grpc::ClientContext context;
    Prepare(&context, session_id, instance, timeout);
    Response response;
    const grpc::Status status = (stub->*method)(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }

  v1::SessionService::Stub* sessions() const { return sessions_.get(); }
  v1::MemoryService::Stub* memory() const { return memory_.get(); }
  v1::ExecutionService::Stub* execution() const { return execution_.get(); }

  absl::StatusOr<v1::OpenSessionResponse> Open() const {
    v1::OpenSessionRequest request;
    request.set_client_label("session_lifecycle_test");
    return Call(sessions_.get(), &v1::SessionService::Stub::OpenSession, request);
  }
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(uint64_t session_id,
                                                  const std::string& instance = "") const {
    return Call(sessions_.get(), &v1::SessionService::Stub::KeepAlive, v1::KeepAliveRequest(),
                session_id, instance);
  }
  absl::Status Close(uint64_t session_id) const {
    return Call(sessions_.get(), &v1::SessionService::Stub::CloseSession, v1::CloseSessionRequest(),
                session_id)
        .status();
  }
  absl::StatusOr<v1::GetServerInfoResponse> Info() const {
    return Call(devices_.get(), &v1::DeviceService::Stub::GetServerInfo,
                v1::GetServerInfoRequest());
  }
  // The tenant's open sessions and device memory, or nullopt when GetServerInfo failed.
  std::optional<std::pair<uint32_t, uint64_t>> Usage() const {
    absl::StatusOr<v1::GetServerInfoResponse> info = Info();
    if (!info.ok()) return std::nullopt;
    return std::make_pair(info->sessions_open(), info->device_memory_bytes());
  }

  absl::StatusOr<uint64_t> Allocate(uint64_t session_id, uint64_t bytes) const {
    v1::AllocateRequest request;
    request.set_size_bytes(bytes);
    auto response = Call(memory_.get(), &v1::MemoryService::Stub::Allocate, request, session_id);
    if (!response.ok()) return response.status();
    return response->buffer().buffer_id();
  }
  absl::Status GetMemInfo(uint64_t session_id) const {
    return Call(memory_.get(), &v1::MemoryService::Stub::GetMemInfo, v1::GetMemInfoRequest(),
                session_id)
        .status();
  }
  // Uploads `bytes` (at most 1 MiB) to the start of `buffer` and downloads them again.
  absl::Status Roundtrip(uint64_t session_id, uint64_t buffer, const std::string& bytes) const {
    v1::UploadRequest upload;
    upload.mutable_destination()->mutable_buffer()->set_buffer_id(buffer);
    upload.set_data(bytes);
    auto written = Call(memory_.get(), &v1::MemoryService::Stub::Upload, upload, session_id);
    if (!written.ok()) return written.status();
    v1::DownloadRequest download;
    download.mutable_source()->mutable_buffer()->set_buffer_id(buffer);
    download.set_size_bytes(bytes.size());
    auto read = Call(memory_.get(), &v1::MemoryService::Stub::Download, download, session_id);
    if (!read.ok()) return read.status();
    if (read->data() != bytes) {
      return absl::DataLossError("the downloaded bytes differ from the uploaded ones");
    }
    return absl::OkStatus();
  }

  struct Kernels {
    uint64_t spin_us = 0;                // (unsigned long long microseconds)
    uint64_t fault_illegal_address = 0;  // ()
  };
  // Compiles the fake kernels in `session_id` (NVRTC, once per test process), or loads the
  // image of that compile, and looks up the two kernels.
  absl::StatusOr<Kernels> LoadKernels(uint64_t session_id) const {
    static absl::Mutex image_mu;
    static std::string* image = new std::string();  // guarded by image_mu
    uint64_t module_id = 0;
    {
      absl::MutexLock lock(&image_mu);
      if (image->empty()) {
        v1::CompileRequest compile;
        compile.set_source(kFakeKernels);
        compile.set_program_name("lifecycle.cu");
        auto compiled =
            Call(modules_.get(), &v1::ModuleService::Stub::Compile, compile, session_id);
        if (!compiled.ok()) return compiled.status();
        if (!compiled->success()) {
          return absl::InternalError(
              absl::StrCat("the fake kernels do not compile: ", compiled->log()));
        }
        *image = compiled->image();
        module_id = compiled->module_id();
      }
    }
    if (module_id == 0) {
      v1::LoadModuleRequest load;
      {
        absl::MutexLock lock(&image_mu);
        load.set_image(*image);
      }
      auto loaded = Call(modules_.get(), &v1::ModuleService::Stub::LoadModule, load, session_id);
      if (!loaded.ok()) return loaded.status();
      module_id = loaded->module_id();
    }
    Kernels kernels;
    for (auto [name, id] :
         {std::make_pair("spin_us", &kernels.spin_us),
          std::make_pair("fault_illegal_address", &kernels.fault_illegal_address)}) {
      v1::GetFunctionRequest request;
      request.set_module_id(module_id);
      request.set_name(name);
      auto function =
          Call(modules_.get(), &v1::ModuleService::Stub::GetFunction, request, session_id);
      if (!function.ok()) return function.status();
      *id = function->function_id();
    }
    return kernels;
  }

  absl::StatusOr<uint64_t> CreateStream(uint64_t session_id) const {
    auto stream = Call(execution_.get(), &v1::ExecutionService::Stub::CreateStream,
                       v1::CreateStreamRequest(), session_id);
    if (!stream.ok()) return stream.status();
    return stream->stream_id();
  }
  // One block of one thread; `argument` is the one u64 of spin_us, nullopt for none.
  absl::Status Launch(uint64_t session_id, uint64_t function, uint64_t stream,
                      std::optional<uint64_t> argument) const {
    v1::LaunchRequest request;
    v1::LaunchCommand* launch = request.mutable_launch();
    launch->set_function_id(function);
    for (v1::Dim3* dim : {launch->mutable_grid(), launch->mutable_block()}) {
      dim->set_x(1);
      dim->set_y(1);
      dim->set_z(1);
    }
    launch->set_stream_id(stream);
    if (argument.has_value()) launch->add_args()->set_u64(*argument);
    return Call(execution_.get(), &v1::ExecutionService::Stub::Launch, request, session_id)
        .status();
  }
  absl::Status SynchronizeStream(uint64_t session_id, uint64_t stream) const {
    v1::SynchronizeStreamRequest request;
    request.set_stream_id(stream);
    return Call(execution_.get(), &v1::ExecutionService::Stub::SynchronizeStream, request,
                session_id)
        .status();
  }
  absl::Status SynchronizeSession(uint64_t session_id) const {
    return Call(execution_.get(), &v1::ExecutionService::Stub::SynchronizeSession,
                v1::SynchronizeSessionRequest(), session_id)
        .status();
  }

  // AdminService.ListSessions: the worker pid of `session_id`, 0 when it is not listed.
  absl::StatusOr<int64_t> WorkerPid(uint64_t session_id) const {
    auto listed =
        Call(admin_.get(), &v1::AdminService::Stub::ListSessions, v1::ListSessionsRequest());
    if (!listed.ok()) return listed.status();
    for (const v1::SessionSummary& session : listed->sessions()) {
      if (session.session_id() == session_id) return session.worker_pid();
    }
    return 0;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::string token_;
  std::unique_ptr<v1::SessionService::Stub> sessions_;
  std::unique_ptr<v1::DeviceService::Stub> devices_;
  std::unique_ptr<v1::MemoryService::Stub> memory_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// One WatchSession stream, read on a thread of its own; cancelled and joined when destroyed.
class Watch {
 public:
  Watch(const Caller& caller, uint64_t session_id, const std::string& instance = "") {
    caller.Prepare(&context_, session_id, instance, absl::InfiniteDuration());
    reader_ = caller.sessions()->WatchSession(&context_, v1::WatchSessionRequest());
    thread_ = std::thread([this] {
      v1::SessionEvent event;
      while (reader_->Read(&event)) {
        std::lock_guard<std::mutex> lock(mu_);
        events_.push_back(event);
        changed_.notify_all();
      }
      const grpc::Status status = reader_->Finish();
      std::lock_guard<std::mutex> lock(mu_);
      end_ = status;
      changed_.notify_all();
    });
  }
  ~Watch() {
    Cancel();
    thread_.join();
  }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // As a client that stops watching (or exits): ClientContext::TryCancel.
  void Cancel() { context_.TryCancel(); }

  // The first event (in order of arrival) for which `matches` holds, waiting up to `timeout`.
  std::optional<v1::SessionEvent> WaitForEvent(
      const std::function<bool(const v1::SessionEvent&)>& matches,
      absl::Duration timeout = kEventually) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<v1::SessionEvent> found;
    changed_.wait_until(lock, absl::ToChronoTime(absl::Now() + timeout), [&] {
      for (const v1::SessionEvent& event : events_) {
        if (matches(event)) {
          found = event;
          return true;
        }
      }
      return end_.has_value();
    });
    return found;
  }
  std::optional<v1::SessionEvent> FirstEvent(absl::Duration timeout = kEventually) {
    return WaitForEvent([](const v1::SessionEvent&) { return true; }, timeout);
  }
  std::optional<v1::SessionEvent> FaultedEvent(absl::Duration timeout = kEventually) {
    return WaitForEvent(
        [](const v1::SessionEvent& event) { return event.state() == v1::SESSION_STATE_FAULTED; },
        timeout);
  }
  // The stream's final status once it ended within `timeout`.
  std::optional<grpc::Status> WaitForEnd(absl::Duration timeout = kEventually) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_until(lock, absl::ToChronoTime(absl::Now() + timeout),
                        [&] { return end_.has_value(); });
    return end_;
  }
  bool ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return end_.has_value();
  }
  std::vector<v1::SessionEvent> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> reader_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<v1::SessionEvent> events_;
  std::optional<grpc::Status> end_;
  std::thread thread_;
};

// A loopback TCP relay in front of the daemon that the test can cut as the kernel cuts the
// connections of a killed client process: every socket closed at once with a reset, no gRPC
// goodbye, no cancellation sent.
class CuttableRelay {
 public:
  static absl::StatusOr<std::unique_ptr<CuttableRelay>> Start(int target_port) {
    auto relay = std::unique_ptr<CuttableRelay>(new CuttableRelay(target_port));
    relay->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (relay->listen_fd_ < 0 ||
        bind(relay->listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        getsockname(relay->listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0 ||
        listen(relay->listen_fd_, 16) != 0 || pipe2(relay->wake_, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("cannot start the relay: ", strerror(errno)));
    }
    relay->port_ = ntohs(address.sin_port);
    relay->thread_ = std::thread([raw = relay.get()] { raw->Run(); });
    return relay;
  }
  ~CuttableRelay() {
    Cut();
    for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
      if (fd >= 0) close(fd);
    }
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Resets every relayed connection and stops relaying; returns once that is done.
  void Cut() {
    if (thread_.joinable()) {
      const char byte = 'x';
      if (write(wake_[1], &byte, 1) != 1) ADD_FAILURE() << "cannot wake the relay";
      thread_.join();
    }
  }

 private:
  explicit CuttableRelay(int target_port) : target_port_(target_port) {}

  int ConnectToTarget() const {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(target_port_));
    if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
      return fd;
    }
    if (fd >= 0) close(fd);
    return -1;
  }

  static bool WriteAll(int fd, const char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = write(fd, data, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }

  static void Reset(int fd) {
    linger hard{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    close(fd);
  }

  void Run() {
    std::vector<std::pair<int, int>> links;  // {client side, daemon side}
    std::vector<char> buffer(256 * 1024);
    for (;;) {
      std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      for (const auto& [client, daemon] : links) {
        fds.push_back({client, POLLIN, 0});
        fds.push_back({daemon, POLLIN, 0});
      }
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[1].revents != 0) break;  // cut
      std::vector<bool> dead(links.size(), false);
      for (size_t i = 0; i < links.size(); ++i) {
        for (int side = 0; side < 2 && !dead[i]; ++side) {
          if (fds[2 + 2 * i + side].revents == 0) continue;
          const int from = side == 0 ? links[i].first : links[i].second;
          const int to = side == 0 ? links[i].second : links[i].first;
          const ssize_t n = read(from, buffer.data(), buffer.size());
          if (n < 0 && errno == EINTR) continue;
          dead[i] = n <= 0 || !WriteAll(to, buffer.data(), static_cast<size_t>(n));
        }
      }
      for (size_t i = links.size(); i-- > 0;) {
        if (!dead[i]) continue;
        close(links[i].first);
        close(links[i].second);
        links.erase(links.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (fds[0].revents & POLLIN) {
        const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (client >= 0) {
          const int daemon = ConnectToTarget();
          if (daemon >= 0) {
            links.emplace_back(client, daemon);
          } else {
            close(client);
          }
        }
      }
    }
    for (const auto& [client, daemon] : links) {
      Reset(client);
      Reset(daemon);
    }
  }

  const int target_port_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

int TcpPort(const std::string& host_port) {
  return std::atoi(host_port.substr(host_port.rfind(':') + 1).c_str());
}

// gpurpc_relayed_bytes_total{direction="to_worker"} of `method` (e.g.
// "MemoryService/UploadStream") on the daemon's /metrics at `port`: the bytes of that
// method's requests that the front end has handed to session workers. The series appears
// when the front end takes the first call of the method (a request without fields counts 0
// bytes); nullopt before that, or without an answer.
std::optional<uint64_t> RelayedToWorkerAt(int port, const std::string& method) {
  const std::string body = ::gpurpc::testing::ScrapeMetrics(port).value_or("");
  const std::string series = absl::StrCat("\ngpurpc_relayed_bytes_total{method=\"/gpurpc.v1.",
                                          method, "\",direction=\"to_worker\"} ");
  const size_t at = body.find(series);
  if (at == std::string::npos) return std::nullopt;
  const size_t start = at + series.size();
  const size_t end = body.find('\n', start);
  uint64_t bytes = 0;
  if (end == std::string::npos || !absl::SimpleAtoi(body.substr(start, end - start), &bytes)) {
    return std::nullopt;
  }
  return bytes;
}

// A daemon with a token-authenticated loopback TCP listener for "alice" and "bob", and the
// test's user (over the Unix socket) as its admin.
class SessionLifecycleTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags, const std::string& config = "",
                   int warm_workers = 1) {
    for (const char* tenant : {"alice", "bob"}) {
      absl::StatusOr<::gpurpc::testing::TestToken> token = ::gpurpc::testing::MakeToken(tenant);
      ASSERT_THAT(token.status(), IsOk());
      tokens_.push_back(*token);
    }
    TestDaemon::Options options;
    options.listen_tcp = true;
    options.warm_workers = warm_workers;
    options.extra_flags = {
        absl::StrCat(
            "--tokens-file=",
            scratch_.Write("tokens", absl::StrCat(tokens_[0].line, "\n", tokens_[1].line, "\n"))),
        absl::StrCat("--admin-tenants=", CurrentUser())};
    if (!config.empty()) {
      options.extra_flags.push_back(
          absl::StrCat("--config=", scratch_.Write("gpurpcd.conf", config)));
    }
    options.extra_flags.insert(options.extra_flags.end(), flags.begin(), flags.end());
    auto daemon = TestDaemon::Start(options);
    ASSERT_THAT(daemon.status(), IsOk());
    daemon_ = *std::move(daemon);
    alice_.emplace(TcpChannel(daemon_->tcp_address()), tokens_[0].token);
    bob_.emplace(TcpChannel(daemon_->tcp_address()), tokens_[1].token);
    admin_.emplace(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()), "");
  }

  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      const std::string log = daemon_->Log();
      std::cerr << "---- gpurpcd log (last 12000 bytes) ----\n"
                << log.substr(log.size() > 12000 ? log.size() - 12000 : 0) << "\n---- end ----\n";
    }
  }

  // A channel of its own (its own connection), so that cutting one never touches another.
  static std::shared_ptr<grpc::Channel> TcpChannel(const std::string& address) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }

  // --metrics-listen on a free loopback port (metrics_port_), for RelayedToWorker: a flag
  // for StartDaemon.
  std::string MetricsListen() {
    absl::StatusOr<int> port = ::gpurpc::testing::FreeLoopbackPort();
    EXPECT_THAT(port.status(), IsOk());
    metrics_port_ = port.ok() ? *port : 0;
    return absl::StrCat("--metrics-listen=127.0.0.1:", metrics_port_);
  }
  std::optional<uint64_t> RelayedToWorker(const std::string& method) const {
    return RelayedToWorkerAt(metrics_port_, method);
  }

  // The tenant's (open sessions, device memory) reach `sessions` and 0 bytes within the bound.
  ::testing::AssertionResult UsageDropsTo(const Caller& caller, uint32_t sessions) {
    // Plain values, not the optional itself: GCC 12 sees it as maybe uninitialized once the
    // poll is inlined.
    bool answered = false;
    uint32_t open = 0;
    uint64_t bytes = 0;
    const bool dropped = Eventually([&] {
      const std::optional<std::pair<uint32_t, uint64_t>> usage = caller.Usage();
      answered = usage.has_value();
      if (answered) std::tie(open, bytes) = *usage;
      return answered && open == sessions && bytes == 0;
    });
    if (dropped) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "after " << kEventually << " the tenant still has "
           << (answered ? absl::StrCat(open, " sessions and ", bytes, " bytes")
                        : std::string("no GetServerInfo answer"));
  }

  // The worker `pid` is gone and only the warm pool's workers are left.
  ::testing::AssertionResult WorkerGone(int64_t pid, size_t warm_workers = 1) {
    std::vector<pid_t> workers;
    const bool gone = Eventually([&] {
      workers = daemon_->WorkerPids();
      return workers.size() == warm_workers &&
             std::find(workers.begin(), workers.end(), pid) == workers.end();
    });
    if (gone) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "worker " << pid << " or extra workers still run: the daemon's children are "
           << ::testing::PrintToString(workers);
  }

  Scratch scratch_;
  std::vector<::gpurpc::testing::TestToken> tokens_;
  std::unique_ptr<TestDaemon> daemon_;
  int metrics_port_ = 0;
  std::optional<Caller> alice_, bob_, admin_;
};

bool IsActive(const std::optional<v1::SessionEvent>& event) {
  return event.has_value() && event->state() == v1::SESSION_STATE_ACTIVE &&
         event->fault_code() == 0 && event->fault_cause().empty();
}

// ------------------------------------------------------------------------- WatchSession

TEST_F(SessionLifecycleTest, WatchReportsActiveThenTheFaultAndEndsOkWhenTheSessionCloses) {
  StartDaemon({});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();

  auto watch = std::make_unique<Watch>(*alice_, id);
  EXPECT_TRUE(IsActive(watch->FirstEvent())) << "first event of a healthy session";

  // A kernel fault surfaces at the next synchronising call, which answers ABORTED.
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  const absl::Status launched = alice_->Launch(id, kernels.fault_illegal_address, 0, std::nullopt);
  EXPECT_TRUE(launched.ok() || absl::IsAborted(launched)) << launched;
  EXPECT_THAT(alice_->SynchronizeSession(id),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("ILLEGAL_ADDRESS")));

  std::optional<v1::SessionEvent> faulted = watch->FaultedEvent();
  ASSERT_TRUE(faulted.has_value()) << "no FAULTED event within " << kEventually;
  EXPECT_THAT(faulted->fault_cause(), HasSubstr("ILLEGAL_ADDRESS"));
  EXPECT_EQ(faulted->fault_code(), kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_EQ(alive.fault_code(), kFailedPrecondition);
  EXPECT_EQ(alive.fault_cause(), faulted->fault_cause());
  EXPECT_THAT(alice_->GetMemInfo(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ILLEGAL_ADDRESS")));
  // A watch that starts on a FAULTED session hears so at once.
  auto late = std::make_unique<Watch>(*alice_, id);
  std::optional<v1::SessionEvent> first = late->FirstEvent();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->state(), v1::SESSION_STATE_FAULTED);
  EXPECT_EQ(first->fault_code(), kFailedPrecondition);

  // Closing ends every watch with OK.
  ASSERT_THAT(alice_->Close(id), IsOk());
  for (Watch* w : {watch.get(), late.get()}) {
    std::optional<grpc::Status> end = w->WaitForEnd();
    ASSERT_TRUE(end.has_value()) << "a watch still runs " << kEventually << " after the close";
    EXPECT_TRUE(end->ok()) << end->error_code() << ": " << end->error_message();
  }
  // The session is gone for a new watch.
  Watch after(*alice_, id);
  std::optional<grpc::Status> end = after.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(after.events().empty());
}

TEST_F(SessionLifecycleTest, WatchIsBoundedPerSessionAndNotFoundForOtherTenants) {
  StartDaemon({});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();

  std::vector<std::unique_ptr<Watch>> watches;
  for (int i = 0; i < 16; ++i) {
    watches.push_back(std::make_unique<Watch>(*alice_, id));
    EXPECT_TRUE(IsActive(watches.back()->FirstEvent())) << "watch " << i + 1;
  }
  {
    Watch seventeenth(*alice_, id);
    std::optional<grpc::Status> end = seventeenth.WaitForEnd();
    ASSERT_TRUE(end.has_value()) << "the 17th watch was not refused";
    EXPECT_EQ(end->error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(end->error_message(), HasSubstr("16"));
    EXPECT_TRUE(seventeenth.events().empty());
  }
  // Ending one makes room for another.
  watches.back()->Cancel();
  ASSERT_TRUE(watches.back()->WaitForEnd().has_value());
  watches.pop_back();
  bool admitted = Eventually([&] {
    auto again = std::make_unique<Watch>(*alice_, id);
    if (!IsActive(again->FirstEvent())) return false;
    watches.push_back(std::move(again));
    return true;
  });
  EXPECT_TRUE(admitted) << "no 16th watch after one of 16 ended";
  for (const auto& watch : watches) EXPECT_FALSE(watch->ended());

  // Another tenant: NOT_FOUND, word for word as for an id that never existed, also with a
  // daemon instance that is not this run's.
  const uint64_t unknown = id ^ 0x5a5a5a5a5a5aull;
  for (const std::string& instance :
       {std::string(), opened.daemon_instance(), std::string("0123456789abcdef")}) {
    Watch foreign(*bob_, id, instance);
    Watch nonexistent(*bob_, unknown, instance);
    std::optional<grpc::Status> foreign_end = foreign.WaitForEnd();
    std::optional<grpc::Status> unknown_end = nonexistent.WaitForEnd();
    ASSERT_TRUE(foreign_end.has_value() && unknown_end.has_value());
    EXPECT_EQ(foreign_end->error_code(), grpc::StatusCode::NOT_FOUND) << "instance " << instance;
    EXPECT_EQ(unknown_end->error_code(), grpc::StatusCode::NOT_FOUND) << "instance " << instance;
    EXPECT_EQ(absl::StrReplaceAll(foreign_end->error_message(), {{std::to_string(id), "N"}}),
              absl::StrReplaceAll(unknown_end->error_message(), {{std::to_string(unknown), "N"}}))
        << "instance " << instance;
    EXPECT_TRUE(foreign.events().empty());
  }
  // Nor may a tenant watch without naming a session properly.
  for (const std::string& value :
       {std::string("not-a-number"), std::string("0"), std::string(5000, '9')}) {
    grpc::ClientContext context;
    bob_->Prepare(&context, 0, "", kCallTimeout);
    context.AddMetadata(kSessionMetadataKey, value);
    auto reader = bob_->sessions()->WatchSession(&context, v1::WatchSessionRequest());
    v1::SessionEvent event;
    EXPECT_FALSE(reader->Read(&event));
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << value.substr(0, 20);
    EXPECT_LT(status.error_message().size(), 1024u);
  }
  // Alice's watches are untouched by all that.
  for (const auto& watch : watches) EXPECT_FALSE(watch->ended());
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE);
}

// A worker that dies (here: killed) faults its session: the call in flight answers ABORTED,
// every later call FAILED_PRECONDITION with the cause, and the watch hears it.
TEST_F(SessionLifecycleTest, WorkerCrashAbortsTheCallInFlightThenFailsPreconditions) {
  StartDaemon({MetricsListen()});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse other, bob_->Open());
  ASSERT_OK_AND_ASSIGN(uint64_t bobs_buffer, bob_->Allocate(other.session_id(), kMiB));
  Watch watch(*alice_, id);
  ASSERT_TRUE(IsActive(watch.FirstEvent()));
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, alice_->Allocate(id, 8 * kMiB));
  (void)buffer;
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  ASSERT_OK(alice_->Launch(id, kernels.spin_us, 0, 30'000'000));
  absl::Status in_flight = absl::UnknownError("not run");
  std::thread synchronize([&] { in_flight = alice_->SynchronizeSession(id); });
  JoinOnExit join_synchronize(synchronize);
  // The front end has taken the SynchronizeSession (its relay counter exists: the call is in
  // flight) and relays it to the worker, where it waits for the 30 s kernel.
  ASSERT_TRUE(Eventually([&] {
    return RelayedToWorker("ExecutionService/SynchronizeSession").has_value();
  })) << "the SynchronizeSession did not reach the daemon";
  ASSERT_OK_AND_ASSIGN(int64_t pid, admin_->WorkerPid(id));
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(static_cast<pid_t>(pid), SIGKILL), 0);
  synchronize.join();
  EXPECT_THAT(in_flight, StatusIs(absl::StatusCode::kAborted, HasSubstr("signal 9")));

  std::optional<v1::SessionEvent> faulted = watch.FaultedEvent();
  ASSERT_TRUE(faulted.has_value());
  EXPECT_EQ(faulted->fault_code(), kFailedPrecondition);
  EXPECT_THAT(faulted->fault_cause(), HasSubstr("signal 9"));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_EQ(alive.fault_code(), kFailedPrecondition);
  EXPECT_THAT(alice_->GetMemInfo(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("signal 9")));
  EXPECT_THAT(alice_->Allocate(id, kMiB).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("signal 9")));
  // Its memory is free; the session holds its slot until it is closed.
  EXPECT_TRUE(UsageDropsTo(*alice_, 1));
  // The other tenant never noticed.
  EXPECT_OK(bob_->Roundtrip(other.session_id(), bobs_buffer, std::string(4096, 'b')));
  ASSERT_OK(alice_->Close(id));
  std::optional<grpc::Status> end = watch.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_TRUE(end->ok()) << end->error_message();
}

// A warm worker killed while it waits in the pool: the next OpenSession, taken before the
// front end's reaper noticed the death or after, gets a live worker and a usable session.
TEST_F(SessionLifecycleTest, AWarmWorkerKilledInThePoolIsReplacedForTheNextSession) {
  StartDaemon({});
  for (int round = 0; round < 5; ++round) {
    // The spare: the one device worker while no session is open (the inventory worker lists
    // devices with --device=-1).
    pid_t spare = 0;
    ASSERT_TRUE(Eventually([&] {
      spare = 0;
      int device_workers = 0;
      for (const pid_t pid : daemon_->WorkerPids()) {
        std::ifstream file(absl::StrCat("/proc/", pid, "/cmdline"));
        const std::string cmdline((std::istreambuf_iterator<char>(file)),
                                  std::istreambuf_iterator<char>());
        if (cmdline.empty() || cmdline.find("--device=-1") != std::string::npos) continue;
        ++device_workers;
        spare = pid;
      }
      return device_workers == 1;
    })) << "round "
        << round << ": no single warm worker";
    ASSERT_EQ(kill(spare, SIGKILL), 0);
    absl::StatusOr<v1::OpenSessionResponse> opened = alice_->Open();
    ASSERT_THAT(opened.status(), IsOk()) << "round " << round;
    ASSERT_OK_AND_ASSIGN(uint64_t buffer, alice_->Allocate(opened->session_id(), kMiB));
    EXPECT_OK(alice_->Roundtrip(opened->session_id(), buffer, std::string(4096, 'a')));
    ASSERT_OK(alice_->Close(opened->session_id()));
  }
}

// ------------------------------------------------------------------------------ reclaim

TEST_F(SessionLifecycleTest, SessionIsReclaimedAfterTheGraceOnceItsLastWatchEnds) {
  StartDaemon({"--session-grace=1s", "--session-idle-timeout=60s"});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  EXPECT_EQ(opened.grace_ms(), 1000u);
  EXPECT_EQ(opened.idle_timeout_ms(), 60000u);
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, alice_->Allocate(id, 4 * kMiB));
  (void)buffer;
  ASSERT_OK_AND_ASSIGN(int64_t pid, admin_->WorkerPid(id));
  ASSERT_GT(pid, 0);
  auto watch = std::make_unique<Watch>(*alice_, id);
  ASSERT_TRUE(IsActive(watch->FirstEvent()));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, alice_->Info());
  EXPECT_EQ(info.sessions_open(), 1u);
  EXPECT_EQ(info.device_memory_bytes(), 4 * kMiB);

  // The client stops watching (as it does when it exits). GetServerInfo is no session call:
  // polling it does not keep the session.
  watch->Cancel();
  EXPECT_TRUE(UsageDropsTo(*alice_, 0));
  EXPECT_THAT(alice_->KeepAlive(id).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(WorkerGone(pid));
  EXPECT_THAT(daemon_->Log(), HasSubstr("--session-grace"));
}

TEST_F(SessionLifecycleTest, WatchedSessionOutlivesTheIdleTimeout) {
  StartDaemon({"--session-grace=1s", "--session-idle-timeout=1s"});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  Watch watch(*alice_, id);
  ASSERT_TRUE(IsActive(watch.FirstEvent()));
  // Four idle timeouts with no call at all: the open watch holds the session.
  EXPECT_TRUE(Throughout(absl::Seconds(4), [&] {
    std::optional<std::pair<uint32_t, uint64_t>> usage = alice_->Usage();
    return usage.has_value() && usage->first == 1;
  })) << "the session of an open watch was reclaimed";
  EXPECT_FALSE(watch.ended());
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE);
}

TEST_F(SessionLifecycleTest, NeverWatchedSessionIsReclaimedAfterTheIdleTimeout) {
  StartDaemon({"--session-grace=60s", "--session-idle-timeout=2s"});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, alice_->Allocate(id, kMiB));
  (void)buffer;
  ASSERT_OK_AND_ASSIGN(int64_t pid, admin_->WorkerPid(id));
  EXPECT_TRUE(UsageDropsTo(*alice_, 0));
  EXPECT_THAT(alice_->KeepAlive(id).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(WorkerGone(pid));
  EXPECT_THAT(daemon_->Log(), HasSubstr("--session-idle-timeout"));
}

// A call in flight is a live client: its session outlives the grace after its watch ended,
// and the grace starts when the call ends.
TEST_F(SessionLifecycleTest, CallInFlightKeepsASessionWhoseWatchEnded) {
  StartDaemon({"--session-grace=1s", "--session-idle-timeout=60s", MetricsListen()});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  auto watch = std::make_unique<Watch>(*alice_, id);
  ASSERT_TRUE(IsActive(watch->FirstEvent()));
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  ASSERT_OK_AND_ASSIGN(uint64_t stream, alice_->CreateStream(id));
  ASSERT_OK(alice_->Launch(id, kernels.spin_us, stream, 12'000'000));  // returns at once
  absl::Status synchronized = absl::UnknownError("not run");
  absl::Notification done;
  std::thread synchronize([&] {
    synchronized = alice_->SynchronizeStream(id, stream);  // waits for the 12 s kernel
    done.Notify();
  });
  JoinOnExit join_synchronize(synchronize);
  // It reaches the worker (the front end has relayed its request), and waits there.
  ASSERT_TRUE(Eventually([&] {
    return RelayedToWorker("ExecutionService/SynchronizeStream").value_or(0) > 0;
  })) << "the SynchronizeStream did not reach the worker";
  watch->Cancel();
  ASSERT_TRUE(watch->WaitForEnd().has_value());
  // Four graces while the call runs: kept.
  EXPECT_TRUE(Throughout(absl::Seconds(4), [&] {
    std::optional<std::pair<uint32_t, uint64_t>> usage = alice_->Usage();
    return done.HasBeenNotified() || (usage.has_value() && usage->first == 1);
  })) << "the session was reclaimed during a call";
  EXPECT_FALSE(done.HasBeenNotified()) << "the 12 s kernel ended early: " << synchronized;
  synchronize.join();
  EXPECT_OK(synchronized);
  // The call ended and nobody watches: reclaimed after the grace.
  EXPECT_TRUE(UsageDropsTo(*alice_, 0));
  EXPECT_THAT(alice_->KeepAlive(id).status(), StatusIs(absl::StatusCode::kNotFound));
}

// A client process killed mid-transfer: its connection breaks without a word (no cancel, no
// GOAWAY), with a watch and a streamed upload open on it. The session goes within the bound.
TEST_F(SessionLifecycleTest, ClientCutOffMidTransferIsReclaimed) {
  StartDaemon({"--session-grace=1s", "--session-idle-timeout=60s", MetricsListen()});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CuttableRelay> relay,
                       CuttableRelay::Start(TcpPort(daemon_->tcp_address())));
  Caller doomed(TcpChannel(relay->address()), tokens_[0].token);  // alice, through the relay
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, doomed.Open());
  const uint64_t id = opened.session_id();
  constexpr uint64_t kTotal = 64 * kMiB;
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, doomed.Allocate(id, kTotal));
  ASSERT_OK_AND_ASSIGN(int64_t pid, admin_->WorkerPid(id));
  auto watch = std::make_unique<Watch>(doomed, id);
  ASSERT_TRUE(IsActive(watch->FirstEvent()));

  absl::Notification sent, cut;
  grpc::Status upload_status;
  std::thread upload([&] {
    grpc::ClientContext context;
    doomed.Prepare(&context, id, "", absl::InfiniteDuration());
    v1::UploadResponse response;
    auto writer = doomed.memory()->UploadStream(&context, &response);
    const std::string chunk(kMiB, 'u');
    v1::UploadStreamRequest first;
    first.mutable_destination()->mutable_buffer()->set_buffer_id(buffer);
    first.set_total_size_bytes(kTotal);
    first.set_data(chunk);
    bool ok = writer->Write(first);
    v1::UploadStreamRequest next;
    next.set_data(chunk);
    for (int i = 1; ok && i < 8; ++i) ok = writer->Write(next);
    sent.Notify();
    cut.WaitForNotification();
    // A client that does not know yet that it is gone: these fail.
    for (uint64_t i = 8; ok && i < kTotal / kMiB; ++i) ok = writer->Write(next);
    upload_status = writer->Finish();
  });
  JoinOnExit join_upload(upload, [&] {
    relay->Cut();
    if (!cut.HasBeenNotified()) cut.Notify();
  });
  sent.WaitForNotification();
  // The eight chunks sent are on their way to the worker: the front end has relayed them.
  EXPECT_TRUE(Eventually([&] {
    return RelayedToWorker("MemoryService/UploadStream").value_or(0) >= 8 * kMiB;
  })) << "the front end did not relay the chunks sent to the worker";
  relay->Cut();
  cut.Notify();
  upload.join();
  EXPECT_FALSE(upload_status.ok()) << "the upload completed through a cut connection";
  std::optional<grpc::Status> end = watch->WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_FALSE(end->ok());

  EXPECT_TRUE(UsageDropsTo(*alice_, 0));
  EXPECT_THAT(alice_->KeepAlive(id).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(WorkerGone(pid));
  // Alice (on a healthy connection) carries on.
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse again, alice_->Open());
  ASSERT_OK_AND_ASSIGN(uint64_t fresh, alice_->Allocate(again.session_id(), kMiB));
  EXPECT_OK(alice_->Roundtrip(again.session_id(), fresh, std::string(1000, 'a')));
}

// ------------------------------------------------------------------------------ restart

TEST(SessionLifecycleRestartTest, SessionOfAnEarlierRunIsNotFoundSayingTheDaemonRestarted) {
  Scratch scratch;
  ASSERT_FALSE(scratch.path().empty());
  TestDaemon::Options options;
  options.unix_socket_path = scratch.path() + "/gpurpcd.sock";
  const absl::Time before_a = absl::Now();
  auto a = TestDaemon::Start(options);
  ASSERT_THAT(a.status(), IsOk());
  const absl::Time after_a = absl::Now();
  Caller local(
      grpc::CreateChannel("unix:" + options.unix_socket_path, grpc::InsecureChannelCredentials()),
      "");
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info_a, local.Info());
  const std::string instance_a = info_a.daemon_instance();
  EXPECT_EQ(instance_a.size(), 16u);
  EXPECT_EQ(instance_a.find_first_not_of("0123456789abcdef"), std::string::npos) << instance_a;
  EXPECT_GE(info_a.started_unix_ms(), absl::ToUnixMillis(before_a) - 1000);
  EXPECT_LE(info_a.started_unix_ms(), absl::ToUnixMillis(after_a) + 1000);
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, local.Open());
  const uint64_t id = opened.session_id();
  EXPECT_EQ(opened.daemon_instance(), instance_a);
  ASSERT_THAT(local.KeepAlive(id, instance_a).status(), IsOk());

  a->reset();  // stops A: its sessions end with it
  auto b = TestDaemon::Start(options);
  ASSERT_THAT(b.status(), IsOk());
  // The same channel reconnects to B (waiting for the reconnection, whatever its backoff).
  absl::StatusOr<v1::GetServerInfoResponse> info_b;
  ASSERT_TRUE(Eventually([&] {
    info_b = local.Info();
    return info_b.ok();
  })) << info_b.status();
  const std::string instance_b = info_b->daemon_instance();
  EXPECT_NE(instance_b, instance_a);
  EXPECT_EQ(instance_b.size(), 16u);

  // With A's instance: the daemon restarted, for every kind of session-scoped call.
  absl::Status restarted = local.KeepAlive(id, instance_a).status();
  EXPECT_THAT(restarted, StatusIs(absl::StatusCode::kNotFound,
                                  AllOf(HasSubstr("restarted"), HasSubstr(std::to_string(id)),
                                        HasSubstr(instance_a), HasSubstr(instance_b))));
  {
    v1::AllocateRequest request;
    request.set_size_bytes(kMiB);
    EXPECT_THAT(
        local.Call(local.memory(), &v1::MemoryService::Stub::Allocate, request, id, instance_a)
            .status(),
        StatusIs(absl::StatusCode::kNotFound, HasSubstr("restarted")));
    Watch watch(local, id, instance_a);
    std::optional<grpc::Status> end = watch.WaitForEnd();
    ASSERT_TRUE(end.has_value());
    EXPECT_EQ(end->error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(end->error_message(), HasSubstr("restarted"));
  }
  // Without an instance, or with B's own: the plain NOT_FOUND.
  for (const std::string& instance : {std::string(), instance_b}) {
    absl::Status plain = local.KeepAlive(id, instance).status();
    EXPECT_THAT(plain, StatusIs(absl::StatusCode::kNotFound, Not(HasSubstr("restarted"))))
        << "instance '" << instance << "'";
  }
  // A hostile instance value is neither echoed at length nor trusted.
  {
    const std::string hostile = std::string(3000, 'z') + "\\'\"%s%n";
    absl::Status status = local.KeepAlive(id, hostile).status();
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, HasSubstr("restarted")));
    EXPECT_LT(status.message().size(), 1024u);
  }
  // A new session on the same channel works.
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse reopened, local.Open());
  EXPECT_EQ(reopened.daemon_instance(), instance_b);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive,
                       local.KeepAlive(reopened.session_id(), instance_b));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE);
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, local.Allocate(reopened.session_id(), kMiB));
  EXPECT_OK(local.Roundtrip(reopened.session_id(), buffer, std::string(512, 'r')));
}

// ----------------------------------------------------------------------------- watchdog

TEST_F(SessionLifecycleTest, KernelWatchdogFaultsOnlyTheSessionOfTheHungKernel) {
  StartDaemon({"--kernel-timeout=1s"});
  // Bob's control session, opened before, round-trips data throughout.
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse control, bob_->Open());
  ASSERT_OK_AND_ASSIGN(uint64_t control_buffer, bob_->Allocate(control.session_id(), kMiB));
  std::atomic<bool> stop{false};
  std::atomic<int> roundtrips{0};
  absl::Mutex failures_mu;
  std::vector<std::string> failures;
  std::thread control_traffic([&] {
    for (int i = 0; !stop.load(); ++i) {
      const std::string bytes(64 * 1024, static_cast<char>('a' + i % 26));
      const absl::Status status = bob_->Roundtrip(control.session_id(), control_buffer, bytes);
      if (status.ok()) {
        ++roundtrips;
      } else {
        absl::MutexLock lock(&failures_mu);
        failures.push_back(status.ToString());
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  JoinOnExit join_control_traffic(control_traffic, [&] { stop = true; });

  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, alice_->Info());
  EXPECT_EQ(info.quota().kernel_timeout_ms(), 1000u);
  Watch watch(*alice_, id);
  ASSERT_TRUE(IsActive(watch.FirstEvent()));
  ASSERT_OK_AND_ASSIGN(uint64_t buffer, alice_->Allocate(id, 8 * kMiB));
  (void)buffer;
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  ASSERT_OK_AND_ASSIGN(uint64_t stream, alice_->CreateStream(id));
  const absl::Status launched = alice_->Launch(id, kernels.spin_us, stream, 30'000'000);
  EXPECT_TRUE(launched.ok() || absl::IsDeadlineExceeded(launched)) << launched;
  // A call waiting for the kernel when the watchdog ends it.
  absl::Status waiting = absl::UnknownError("not run");
  std::thread waiter([&] { waiting = alice_->SynchronizeStream(id, stream); });
  JoinOnExit join_waiter(waiter);

  absl::StatusOr<v1::KeepAliveResponse> alive;
  const bool faulted = Eventually([&] {
    alive = alice_->KeepAlive(id);
    return alive.ok() && alive->state() == v1::SESSION_STATE_FAULTED;
  });
  ASSERT_TRUE(faulted) << "the 30 s kernel still runs " << kEventually << " after a 1s timeout: "
                       << (alive.ok() ? alive->DebugString() : alive.status().ToString());
  EXPECT_EQ(alive->fault_code(), kDeadlineExceeded);
  EXPECT_THAT(alive->fault_cause(),
              AllOf(HasSubstr("kernel 'spin_us'"), HasSubstr("kernel timeout of 1s")));
  // Every session-scoped call now answers DEADLINE_EXCEEDED naming the kernel and the timeout.
  EXPECT_THAT(alice_->GetMemInfo(id),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("spin_us"), HasSubstr("kernel timeout of 1s"))));
  EXPECT_THAT(alice_->SynchronizeStream(id, stream),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("spin_us")));
  waiter.join();
  EXPECT_THAT(waiting, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("spin_us")));
  std::optional<v1::SessionEvent> event = watch.FaultedEvent();
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->fault_code(), kDeadlineExceeded);
  EXPECT_THAT(event->fault_cause(), HasSubstr("spin_us"));
  // The worker is gone, and its memory with it.
  EXPECT_TRUE(Eventually([&] {
    std::optional<std::pair<uint32_t, uint64_t>> usage = alice_->Usage();
    return usage.has_value() && usage->second == 0;
  }));

  // Bob never noticed.
  stop = true;
  control_traffic.join();
  EXPECT_GT(roundtrips.load(), 0);
  EXPECT_TRUE(failures.empty()) << failures.size()
                                << " control roundtrips failed, first: " << failures.front();
  EXPECT_OK(bob_->Roundtrip(control.session_id(), control_buffer, std::string(4096, 'z')));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse bobs, bob_->KeepAlive(control.session_id()));
  EXPECT_EQ(bobs.state(), v1::SESSION_STATE_ACTIVE);

  // Closing the faulted session ends the watch with OK; alice starts over.
  ASSERT_OK(alice_->Close(id));
  std::optional<grpc::Status> end = watch.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_TRUE(end->ok()) << end->error_message();
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse again, alice_->Open());
  ASSERT_OK_AND_ASSIGN(uint64_t fresh, alice_->Allocate(again.session_id(), kMiB));
  EXPECT_OK(alice_->Roundtrip(again.session_id(), fresh, std::string(100, 'q')));
}

TEST_F(SessionLifecycleTest, TenantKernelTimeoutOverridesTheDaemonDefault) {
  StartDaemon({"--kernel-timeout=0"}, R"(
tenant_quotas { key: "alice" value { kernel_timeout_ms: 500 } }
)");
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse alice_info, alice_->Info());
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse bob_info, bob_->Info());
  EXPECT_EQ(alice_info.quota().kernel_timeout_ms(), 500u);
  EXPECT_EQ(bob_info.quota().kernel_timeout_ms(), 0u);

  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse bobs, bob_->Open());
  ASSERT_OK_AND_ASSIGN(Caller::Kernels bob_kernels, bob_->LoadKernels(bobs.session_id()));
  ASSERT_OK_AND_ASSIGN(uint64_t bob_stream, bob_->CreateStream(bobs.session_id()));
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse alices, alice_->Open());
  ASSERT_OK_AND_ASSIGN(Caller::Kernels alice_kernels, alice_->LoadKernels(alices.session_id()));

  // Bob's 3 s kernel, with no watchdog for him, and alice's 30 s one, with 500 ms for her.
  ASSERT_OK(bob_->Launch(bobs.session_id(), bob_kernels.spin_us, bob_stream, 3'000'000));
  const absl::Status launched =
      alice_->Launch(alices.session_id(), alice_kernels.spin_us, 0, 30'000'000);
  EXPECT_TRUE(launched.ok() || absl::IsDeadlineExceeded(launched)) << launched;
  absl::StatusOr<v1::KeepAliveResponse> alive;
  ASSERT_TRUE(Eventually([&] {
    alive = alice_->KeepAlive(alices.session_id());
    return alive.ok() && alive->state() == v1::SESSION_STATE_FAULTED;
  })) << (alive.ok() ? alive->DebugString() : alive.status().ToString());
  EXPECT_EQ(alive->fault_code(), kDeadlineExceeded);
  EXPECT_THAT(alive->fault_cause(),
              AllOf(HasSubstr("kernel 'spin_us'"), HasSubstr("kernel timeout of 500ms")));

  EXPECT_OK(bob_->SynchronizeStream(bobs.session_id(), bob_stream));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse bob_alive, bob_->KeepAlive(bobs.session_id()));
  EXPECT_EQ(bob_alive.state(), v1::SESSION_STATE_ACTIVE);
}

// The timeout is per kernel, not per queue: ten 300 ms kernels on one stream (3 s in all)
// under a 2 s timeout all complete.
TEST_F(SessionLifecycleTest, KernelsShorterThanTheTimeoutComplete) {
  StartDaemon({"--kernel-timeout=2s"});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  ASSERT_OK_AND_ASSIGN(uint64_t stream, alice_->CreateStream(id));
  for (int i = 0; i < 10; ++i) {
    ASSERT_OK(alice_->Launch(id, kernels.spin_us, stream, 300'000)) << "launch " << i;
  }
  EXPECT_OK(alice_->SynchronizeStream(id, stream));
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE) << alive.fault_cause();
  // And again after the queue drained: the watchdog measures each kernel afresh.
  ASSERT_OK(alice_->Launch(id, kernels.spin_us, stream, 300'000));
  EXPECT_OK(alice_->SynchronizeStream(id, stream));
  ASSERT_OK_AND_ASSIGN(alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE) << alive.fault_cause();
}

// ------------------------------------------------------------------------ not-ready flood

// EventElapsedTime on an event recorded behind a kernel that still runs is UNAVAILABLE
// (CUDA_ERROR_NOT_READY, execution_service.proto): answered by the worker at once, not a
// fault, however many arrive together.
TEST_F(SessionLifecycleTest, ElapsedTimeFloodOnAnUnfinishedEventIsNotReadyAndHarmless) {
  StartDaemon({});
  ASSERT_OK_AND_ASSIGN(v1::OpenSessionResponse opened, alice_->Open());
  const uint64_t id = opened.session_id();
  Watch watch(*alice_, id);
  ASSERT_TRUE(IsActive(watch.FirstEvent()));
  ASSERT_OK_AND_ASSIGN(Caller::Kernels kernels, alice_->LoadKernels(id));
  auto create_event = [&]() -> absl::StatusOr<uint64_t> {
    auto event = alice_->Call(alice_->execution(), &v1::ExecutionService::Stub::CreateEvent,
                              v1::CreateEventRequest(), id);
    if (!event.ok()) return event.status();
    return event->event_id();
  };
  auto record = [&](uint64_t event) {
    v1::RecordEventRequest request;
    request.set_event_id(event);
    return alice_->Call(alice_->execution(), &v1::ExecutionService::Stub::RecordEvent, request, id)
        .status();
  };
  ASSERT_OK_AND_ASSIGN(uint64_t start, create_event());
  ASSERT_OK_AND_ASSIGN(uint64_t end, create_event());
  ASSERT_OK(record(start));
  ASSERT_OK(alice_->Launch(id, kernels.spin_us, 0, 40'000'000));  // returns at once
  ASSERT_OK(record(end));

  // 200 calls from 32 threads at once: a session's worker runs at most kWorkerMaxThreads (64)
  // calls at a time and refuses more (bad_input_test checks that refusal); this flood is
  // about the front end never parking on a not-ready answer.
  constexpr int kCalls = 200;
  constexpr int kThreads = 32;
  std::vector<absl::Status> answers(kCalls);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kCalls; i += kThreads) {
        v1::EventElapsedTimeRequest request;
        request.set_start_event_id(start);
        request.set_end_event_id(end);
        // Well within the 40 s kernel: an answer that waited for it misses this deadline.
        answers[i] = alice_
                         ->Call(alice_->execution(), &v1::ExecutionService::Stub::EventElapsedTime,
                                request, id, "", absl::Seconds(25))
                         .status();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  int not_ready = 0;
  for (const absl::Status& answer : answers) {
    if (absl::IsUnavailable(answer) && absl::StrContains(answer.message(), "NOT_READY")) {
      ++not_ready;
    } else {
      ADD_FAILURE() << "EventElapsedTime answered " << answer;
    }
  }
  EXPECT_EQ(not_ready, kCalls);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse alive, alice_->KeepAlive(id));
  EXPECT_EQ(alive.state(), v1::SESSION_STATE_ACTIVE) << alive.fault_cause();
  EXPECT_OK(alice_->GetMemInfo(id));
  EXPECT_FALSE(watch.FaultedEvent(absl::ZeroDuration()).has_value());
  ASSERT_OK(alice_->Close(id));  // ends the kernel with the worker
}

}  // namespace
}  // namespace gpurpc
