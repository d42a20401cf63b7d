#include "server/worker/worker_main.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <thread>

#include "common/limits.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/service.h"
#include "server/worker/session.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace gpurpc::worker {

int WorkerMain(const DaemonOptions& options) {
  // Die with the front end: an orphaned worker would hold a GPU context forever.
  // PR_SET_PDEATHSIG would fire when the front-end *thread* that spawned us ends, so watch
  // the parent process instead.
  const pid_t parent = getppid();
  if (parent == 1) return kExitBadUsage;
  std::thread([parent] {
    while (getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(kExitBadUsage);
  }).detach();

  auto logger = spdlog::stderr_color_mt("worker");
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] [worker %P dev " +
                      std::to_string(options.device) + "] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(options.log_level));

  std::unique_ptr<backend::Backend> backend;
  if (options.backend == "fake") {
    backend = backend::MakeFakeBackend(options.fake_memory_bytes);
  } else {
    auto cuda = backend::MakeCudaBackend();
    if (!cuda.ok()) {
      spdlog::error("cuda backend unavailable: {}", cuda.status().ToString());
      return kExitBackendUnavailable;
    }
    backend = std::move(*cuda);
  }

  compiler::CompilerOptions compiler_options;
  compiler_options.cache_dir = options.cache_dir;
  compiler_options.cache_max_bytes = options.cache_max_bytes;
  compiler_options.cuda_include_dir = options.cuda_include_dir;
  auto compiler = compiler::Compiler::Create(compiler_options);
  absl::Status compiler_status = compiler.status();
  if (!compiler.ok()) spdlog::warn("NVRTC unavailable: {}", compiler_status.ToString());
  compiler::Compiler* compiler_ptr = compiler.ok() ? compiler->get() : nullptr;
  const int nvrtc_version = compiler_ptr != nullptr ? compiler_ptr->nvrtc_version() : 0;

  std::unique_ptr<Session> session;
  if (options.device >= 0) {
    auto context = backend->OpenContext(options.device);
    if (!context.ok()) {
      spdlog::error("cannot open a context on device {}: {}", options.device,
                    context.status().ToString());
      return kExitContextFailed;
    }
    session = std::make_unique<Session>(std::move(*context), compiler_ptr, compiler_status);
  }

  auto services = MakeWorkerServices(backend.get(), session.get(), nvrtc_version);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  for (auto& service : services) builder.RegisterService(service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    spdlog::error("cannot start the worker's gRPC server");
    return kExitServerFailed;
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
