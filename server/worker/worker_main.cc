#include "server/worker/worker_main.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "server/log_format.h"
#include "server/status_interceptor.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compile_cache.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/device_output.h"
#include "server/worker/framed_commands.h"
#include "server/worker/host_region.h"
#include "server/worker/service.h"
#include "server/worker/session.h"
#include "spdlog/spdlog.h"

namespace gpurpc::worker {
namespace {

// Bounds of the worker's gRPC server. The front end relays at most what clients send, but a
// worker must never grow without limit whatever arrives: calls beyond the thread bound are
// answered RESOURCE_EXHAUSTED by gRPC, streams beyond the stream bound wait in the front
// end's channel.
constexpr int kWorkerMaxConcurrentStreams = 128;
constexpr size_t kWorkerMemoryBytes = 1ull << 30;
// Open files: gRPC's socket, the driver's device files, compile cache files and the sockets
// of compile helpers (at most kMaxConcurrentCompiles at once) need far fewer.
constexpr rlim_t kWorkerMaxOpenFiles = 4096;
// How long a worker whose session faulted goes on after answering the observing call
// (kWorkerExitSessionFaulted, common/worker_exit.h).
constexpr std::chrono::milliseconds kFaultExitDelay{300};

// Limits of this process, set before any tenant input. Soft and hard alike, so that nothing
// in the worker can raise them again.
//  - RLIMIT_CORE 0: no core file with a tenant's data (PR_SET_DUMPABLE 0 already stops
//    them; this holds even if something makes the process dumpable again).
//  - RLIMIT_NOFILE: kWorkerMaxOpenFiles (or the lower hard limit we were given).
// Not RLIMIT_NPROC: it counts every process and thread of the daemon's user -- the front
// end and every tenant's worker together --, so a value here would fail thread creation in
// this worker (CUDA's and gRPC's threads) because of what other tenants' workers do, and
// bound nothing of this worker's own. What bounds this worker's threads and processes
// instead: gRPC's threads (kWorkerMaxThreads), one thread per framed command channel (at
// most kMaxDirectChannelsPerSession; their messages share kFramedMemoryBytes, beside gRPC's
// memory bound, and each holds one reply), a download's fill-ahead helper (at most 8, each with
// one chunk of at most 4 MiB beside gRPC's memory bound; ChunksAhead in service.cc), CUDA's
// own fixed few, and compile helpers,
// the only processes a worker starts, one per compile that misses the cache: at most
// kMaxConcurrentCompiles (or the tenant's max_concurrent_compiles) per session at once
// (Session::Compile), each unable to fork (its seccomp filter, compiler/sandbox.cc) and
// killed at --compile-timeout.
absl::Status SetWorkerLimits() {
  struct Limit {
    int resource;
    const char* name;
    rlim_t value;
  };
  for (const Limit& limit : {Limit{RLIMIT_CORE, "RLIMIT_CORE", 0},
                             Limit{RLIMIT_NOFILE, "RLIMIT_NOFILE", kWorkerMaxOpenFiles}}) {
    struct rlimit current {};
    if (getrlimit(limit.resource, &current) != 0) {
      return absl::InternalError(
          absl::StrCat("getrlimit(", limit.name, "): ", std::strerror(errno)));
    }
    const rlim_t value = std::min(limit.value, current.rlim_max);
    const struct rlimit wanted = {value, value};
    if (setrlimit(limit.resource, &wanted) != 0) {
      return absl::InternalError(
          absl::StrCat("setrlimit(", limit.name, ", ", value, "): ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// The disk cache is shared by every tenant, so its folder must be this user's alone and its
// files are authenticated with a key kept outside it (compile_cache.h). Returns that key
// ("" when there is no disk cache), read here from its file: never from the command line.
absl::StatusOr<std::string> PrepareCompileCache(const DaemonOptions& options) {
  if (options.cache_dir.empty()) return std::string();
  GPURPC_RETURN_IF_ERROR(compiler::PrepareCacheDirectory(options.cache_dir));
  return compiler::LoadOrCreateCacheKey(options.cache_key_file.empty()
                                            ? compiler::DefaultCacheKeyPath(options.cache_dir)
                                            : options.cache_key_file);
}

compiler::SandboxOptions CompileSandboxOptions(const DaemonOptions& options) {
  compiler::SandboxOptions sandbox;
  sandbox.mode =
      compiler::ParseSandboxMode(options.compile_sandbox).value_or(compiler::SandboxMode::kAuto);
  sandbox.allow_unsandboxed = options.allow_unsandboxed_compile;
  sandbox.timeout = options.compile_timeout;
  sandbox.cpu_seconds = options.compile_cpu_seconds;
  sandbox.memory_bytes = options.compile_memory_bytes;
  return sandbox;  // helper_path: this executable
}

// Probes the protection compiles run under, logs it and returns it for ListDevices.
std::string ReportCompileSandbox(const compiler::Compiler* compiler,
                                 const absl::Status& compiler_status) {
  if (compiler == nullptr) {
    return absl::StrCat("unavailable: NVRTC is not available: ", compiler_status.message());
  }
  const std::string report = compiler->ProbeSandbox();
  if (absl::StartsWith(report, "unavailable")) {
    spdlog::warn("compile sandbox: {}", report);
  } else {
    spdlog::info("compile sandbox: {}", report);
  }
  return report;
}

}  // namespace

int WorkerMain(const DaemonOptions& options) {
  // Workers of different tenants run as the same user: none may ptrace another, read its
  // memory through /proc, or leave a core dump with a tenant's data behind.
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  // Debian's Abseil is built with absl::Mutex's deadlock detection on, which makes every
  // lock ~3x dearer (~90 ns instead of ~30 ns here) on the launch path; the unit tests keep
  // it on to catch lock-order inversions.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const absl::Status limits = SetWorkerLimits();
  // The front end's fds must not leak into the compile helpers this worker spawns.
  for (const int fd : {options.worker_fd, options.worker_status_fd, options.worker_region_fd,
                       options.worker_relay_fd}) {
    if (fd >= 0) fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC);
  }
  // Die with the front end: an orphaned worker would hold a GPU context forever.
  // PR_SET_PDEATHSIG would fire when the front-end *thread* that spawned us ends, so watch
  // the parent process instead.
  const pid_t parent = getppid();
  if (parent == 1) return kWorkerExitBadUsage;
  std::thread([parent] {
    while (getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(kWorkerExitBadUsage);
  }).detach();

  ProcessLogOptions log;
  log.logger_name = "worker";
  log.process = "worker";
  log.with_device = true;
  log.device = options.device;
  log.text_pattern =
      "[%Y-%m-%d %H:%M:%S.%e] [%l] [worker %P dev " + std::to_string(options.device) + "] %v";
  log.format = ParseLogFormat(options.log_format).value_or(LogFormat::kText);
  log.level = options.log_level;
  InstallProcessLogger(log);
  if (!limits.ok()) {
    spdlog::error("cannot limit the worker's resources: {}", limits.ToString());
    return kWorkerExitLimitsFailed;
  }

  // A session's worker captures its stdout before CUDA starts: that is where the driver
  // writes the kernels' printf output, which goes to the session's client (device_output.h).
  std::unique_ptr<DeviceOutput> device_output;
  if (options.device >= 0) {
    auto started = DeviceOutput::Start();
    if (started.ok()) {
      device_output = *std::move(started);
    } else {
      spdlog::warn("device printf output will go to the daemon's log: {}",
                   started.status().ToString());
    }
  }

  std::unique_ptr<backend::Backend> backend;
  if (options.backend == "fake") {
    backend = backend::MakeFakeBackend(options.fake_memory_bytes, options.fake_devices);
  } else {
    auto cuda = backend::MakeCudaBackend();
    if (!cuda.ok()) {
      spdlog::error("cuda backend unavailable: {}", cuda.status().ToString());
      return kWorkerExitBackendUnavailable;
    }
    backend = std::move(*cuda);
  }

  compiler::CompilerOptions compiler_options;
  compiler_options.cache_dir = options.cache_dir;
  compiler_options.cache_max_bytes = options.cache_max_bytes;
  compiler_options.cuda_include_dir = options.cuda_include_dir;
  compiler_options.sandbox = CompileSandboxOptions(options);
  // Rather than run with a cache that others could write to, refuse to start (and so the
  // daemon does too). Never log the key.
  absl::StatusOr<std::string> mac_key = PrepareCompileCache(options);
  if (!mac_key.ok()) {
    spdlog::error("refusing to start: {}", mac_key.status().ToString());
    return kWorkerExitCacheRefused;
  }
  compiler_options.mac_key = *std::move(mac_key);
  auto compiler = compiler::Compiler::Create(compiler_options);
  absl::Status compiler_status = compiler.status();
  if (!compiler.ok()) spdlog::warn("NVRTC unavailable: {}", compiler_status.ToString());
  compiler::Compiler* compiler_ptr = compiler.ok() ? compiler->get() : nullptr;
  const int nvrtc_version = compiler_ptr != nullptr ? compiler_ptr->nvrtc_version() : 0;
  // The inventory worker reports the compile protection in ListDevices (and the log): it
  // probes for it now, by confining a helper and compiling in it, while the rest starts.
  std::shared_future<std::string> compile_sandbox;
  if (options.device < 0) {
    compile_sandbox = std::async(std::launch::async, [compiler_ptr, compiler_status] {
                        return ReportCompileSandbox(compiler_ptr, compiler_status);
                      }).share();
  }

  std::unique_ptr<Session> session;
  if (options.device >= 0) {
    auto context = backend->OpenContext(options.device);
    if (!context.ok()) {
      spdlog::error("cannot open a context on device {}: {}", options.device,
                    context.status().ToString());
      return kWorkerExitContextFailed;
    }
    session = std::make_unique<Session>(std::move(*context), compiler_ptr, compiler_status,
                                        ExitOnKernelTimeout(options.worker_status_fd));
    session->set_region_socket(options.region_socket);
    session->set_device_output(device_output.get());
    session->set_on_fault([status_fd = options.worker_status_fd](const absl::Status& fault) {
      // The reply to the observing call goes out first; then the worker ends (see
      // kWorkerExitSessionFaulted). Destructors are not run: the context is lost anyway.
      std::thread([status_fd, message = std::string(fault.message())] {
        std::this_thread::sleep_for(kFaultExitDelay);
        spdlog::error("sticky fault ({}); ending the worker", message);
        WriteStatusLine(status_fd, message);
        _exit(kWorkerExitSessionFaulted);
      }).detach();
    });
  }

  std::function<std::string()> sandbox_report;
  if (compile_sandbox.valid()) sandbox_report = [compile_sandbox] { return compile_sandbox.get(); };
  auto services =
      MakeWorkerServices(backend.get(), session.get(), nvrtc_version, std::move(sandbox_report));
  grpc::ServerBuilder builder;
  grpc::ResourceQuota quota("gpurpcd-worker");
  quota.Resize(kWorkerMemoryBytes);
  quota.SetMaxThreads(kWorkerMaxThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kWorkerMaxConcurrentStreams);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrameBytes);
  for (auto& service : services) builder.RegisterService(service.get());
  builder.experimental().SetInterceptorCreators(
      StatusInterceptors(/*mark_worker_answers=*/true, kWorkerMaxThreads));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    spdlog::error("cannot start the worker's gRPC server");
    return kWorkerExitServerFailed;
  }
  // Direct channels of same-host clients (HostRegionService.OpenDirectChannel): a second
  // server with ExecutionService only, bounded like the first.
  std::vector<std::unique_ptr<grpc::Service>> direct_services;
  std::unique_ptr<grpc::Server> direct_server;
  // The messages of every framed channel together (framed_commands.h); outlives the channels.
  FramedMemory framed_memory_budget(kFramedMemoryBytes);
  // The session services' unary handlers for the front end's framed unary channels; outlives
  // the channels.
  std::unique_ptr<RelayedUnaryCalls> relayed_unary_calls;
  std::unique_ptr<DirectChannels> direct_channels;
  std::unique_ptr<RegionChannel> region_channel;
  std::unique_ptr<RelayChannel> relay_channel;
  if (session != nullptr && options.worker_region_fd >= 0) {
    direct_services = MakeDirectServices(session.get());
    grpc::ServerBuilder direct_builder;
    grpc::ResourceQuota direct_quota("gpurpcd-worker-direct");
    direct_quota.Resize(kWorkerMemoryBytes);
    direct_quota.SetMaxThreads(kWorkerMaxThreads);
    direct_builder.SetResourceQuota(direct_quota);
    direct_builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kWorkerMaxConcurrentStreams);
    direct_builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    direct_builder.SetMaxSendMessageSize(kMaxMessageBytes);
    for (auto& service : direct_services) direct_builder.RegisterService(service.get());
    direct_builder.experimental().SetInterceptorCreators(
        StatusInterceptors(/*mark_worker_answers=*/false, kWorkerMaxThreads));
    direct_server = direct_builder.BuildAndStart();
    if (direct_server == nullptr) {
      spdlog::error("cannot start the worker's direct gRPC server");
      return kWorkerExitServerFailed;
    }
    Session* const served = session.get();
    FramedMemory* const framed_memory = &framed_memory_budget;
    relayed_unary_calls = std::make_unique<RelayedUnaryCalls>(session.get());
    const RelayedUnaryCalls* const unary_calls = relayed_unary_calls.get();
    direct_channels = std::make_unique<DirectChannels>(
        direct_server.get(), [served, framed_memory, unary_calls](int fd, FramedPeer peer) {
          if (peer == FramedPeer::kFrontEndUnary) return ServeRelayedUnaryCalls(*unary_calls, fd);
          if (peer == FramedPeer::kFrontEndUpload || peer == FramedPeer::kFrontEndDownload) {
            return ServeRelayedTransfer(served, fd, framed_memory, peer);
          }
          ServeFramedCommands(served, fd, framed_memory, peer);
        });
    // Regions' memfds and direct channels' sockets arrive from the front end on their own
    // channel (gRPC carries no fds).
    Session* const target = session.get();
    DirectChannels* const channels = direct_channels.get();
    region_channel = std::make_unique<RegionChannel>(
        options.worker_region_fd,
        [target, channels](const v1::AttachHostRegionRequest& request, int fd) -> absl::Status {
          if (!request.direct_channel()) {
            if (request.framed_commands()) {
              return absl::InvalidArgumentError(
                  "AttachHostRegionRequest: framed_commands is for direct channels only");
            }
            return target->AttachHostRegion(request.region_id(), request.ticket(), fd);
          }
          if (absl::Status taken = target->TakeDirectTicket(request.ticket()); !taken.ok()) {
            return taken;
          }
          return channels->Admit(fd, request.framed_commands());
        });
    // The front end's relayed command streams (server/frontend/command_relay.h).
    if (options.worker_relay_fd >= 0) {
      relay_channel = std::make_unique<RelayChannel>(
          options.worker_relay_fd,
          [channels](int fd, FramedPeer peer) { return channels->AdmitRelayed(fd, peer); });
    }
  }
  // gRPC 1.51 hangs on a blocking fd (DESIGN §2).
  const int flags = fcntl(options.worker_fd, F_GETFL);
  fcntl(options.worker_fd, F_SETFL, flags | O_NONBLOCK);
  grpc::AddInsecureChannelFromFd(server.get(), options.worker_fd);
  spdlog::debug("serving");
  server->Wait();
  return 0;
}

}  // namespace gpurpc::worker
