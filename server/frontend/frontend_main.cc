#include "server/frontend/frontend_main.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>

#include "common/limits.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/frontend/proxy.h"
#include "server/frontend/services.h"
#include "server/frontend/session_manager.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

std::string SelfExe() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "/proc/self/exe";
  path[n] = '\0';
  return path;
}

}  // namespace

int FrontendMain(const DaemonOptions& options) {
  auto logger = spdlog::stderr_color_mt("gpurpcd");
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(options.log_level));

  // Signals are taken synchronously by this thread; every other thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disappears mid-write must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);

  SessionManager sessions(options, SelfExe());
  if (absl::Status status = sessions.Start(); !status.ok()) {
    spdlog::critical("{}", std::string(status.message()));
    return 1;
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  DeviceServiceImpl device_service(&sessions);
  SessionServiceImpl session_service(&sessions);
  SessionProxy proxy(&sessions);

  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // Find clients that vanished without closing their connection (a command stream would
  // otherwise stay open on a dead TCP connection for hours), and accept clients' pings.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
  int tcp_port = 0;
  if (!options.listen.empty()) {
    builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &tcp_port);
  }
  if (!options.unix_socket.empty()) {
    unlink(options.unix_socket.c_str());  // a stale socket from an earlier run
    builder.AddListeningPort("unix:" + options.unix_socket, grpc::InsecureServerCredentials());
  }
  builder.RegisterService(&device_service);
  builder.RegisterService(&session_service);
  builder.RegisterCallbackGenericService(&proxy);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (!options.listen.empty() && tcp_port == 0)) {
    spdlog::critical("cannot serve on {}{}{}", options.listen,
                     options.unix_socket.empty() ? "" : " / unix:", options.unix_socket);
    return 1;
  }
  spdlog::info("gpurpcd serving{}{}{}{} with the {} backend, session idle timeout {}",
               options.listen.empty() ? "" : " on ", options.listen,
               options.unix_socket.empty() ? "" : " and unix:", options.unix_socket,
               sessions.inventory().backend(), absl::FormatDuration(options.session_idle_timeout));

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("{}: draining", strsignal(signal_number));
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}

}  // namespace gpurpc::frontend
