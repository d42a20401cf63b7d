#include "server/frontend/frontend_main.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/resource_quota.h"
#include "server/frontend/auth.h"
#include "server/frontend/metrics.h"
#include "server/frontend/proxy.h"
#include "server/frontend/region_listener.h"
#include "server/frontend/services.h"
#include "server/frontend/session_manager.h"
#include "server/frontend/unary_proxy.h"
#include "server/frontend/unix_listener.h"
#include "server/log_format.h"
#include "server/metrics/http_server.h"
#include "server/parse_checked_service.h"
#include "server/status_interceptor.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

// The settings a restart is needed for, by name, that differ between `now` and `fresh`.
std::vector<std::string> NeedRestart(const DaemonOptions& now, const DaemonOptions& fresh) {
  std::vector<std::string> changed;
  auto check = [&changed](bool differs, const char* name) {
    if (differs) changed.push_back(name);
  };
  check(now.listen != fresh.listen, "listen");
  check(now.unix_socket != fresh.unix_socket, "unix_socket");
  check(now.unix_socket_mode != fresh.unix_socket_mode, "unix_socket_mode");
  check(now.region_socket != fresh.region_socket, "region_socket");
  check(now.max_host_region_bytes != fresh.max_host_region_bytes, "max_host_region_bytes");
  check(now.health_listen != fresh.health_listen, "health_listen");
  check(now.metrics_listen != fresh.metrics_listen, "metrics_listen");
  check(now.tokens_file != fresh.tokens_file, "tokens_file");
  check(now.tls_cert != fresh.tls_cert, "tls_cert");
  check(now.tls_key != fresh.tls_key, "tls_key");
  check(now.tls_client_ca != fresh.tls_client_ca, "tls_client_ca");
  check(now.insecure != fresh.insecure, "insecure");
  check(now.backend != fresh.backend, "backend");
  check(now.session_idle_timeout != fresh.session_idle_timeout, "session_idle_timeout");
  check(now.session_grace != fresh.session_grace, "session_grace");
  check(now.drain_timeout != fresh.drain_timeout, "drain_timeout");
  check(now.warm_workers != fresh.warm_workers, "warm_workers");
  check(now.log_format != fresh.log_format, "log_format");
  check(now.cache_dir != fresh.cache_dir, "cache_dir");
  check(now.cache_key_file != fresh.cache_key_file, "cache_key_file");
  check(now.cache_max_bytes != fresh.cache_max_bytes, "cache_max_bytes");
  check(now.fake_memory_bytes != fresh.fake_memory_bytes, "fake_memory_bytes");
  check(now.cuda_include_dir != fresh.cuda_include_dir, "cuda_include_dir");
  check(now.compile_sandbox != fresh.compile_sandbox, "compile_sandbox");
  check(now.allow_unsandboxed_compile != fresh.allow_unsandboxed_compile,
        "allow_unsandboxed_compile");
  check(now.compile_timeout != fresh.compile_timeout, "compile_timeout");
  check(now.compile_cpu_seconds != fresh.compile_cpu_seconds, "compile_cpu_seconds");
  check(now.compile_memory_bytes != fresh.compile_memory_bytes, "compile_memory_bytes");
  return changed;
}

// SIGHUP: the tokens, then the configuration (see FrontendMain in the header).
void Reload(Authenticator& auth, SessionManager& sessions, const DaemonOptions& started,
            const ReloadOptions& reload) {
  if (absl::Status status = auth.ReloadTokens(); !status.ok()) {
    spdlog::error("SIGHUP: keeping the tokens in force: {}", std::string(status.message()));
  }
  if (!reload) return;
  absl::StatusOr<DaemonOptions> fresh = reload();
  if (!fresh.ok()) {
    spdlog::error("SIGHUP: the configuration does not parse, keeping the settings in force: {}",
                  std::string(fresh.status().message()));
    return;
  }
  const auto level = spdlog::level::from_str(fresh->log_level);
  sessions.SetLimits(*fresh);
  auth.SetAdmins(fresh->admin_tenants);
  spdlog::set_level(level);
  spdlog::info(
      "SIGHUP: reloaded the tenant quotas ({} per-tenant), max_sessions {}, {} admin "
      "tenant(s) and log level {}",
      fresh->tenant_quotas.size(), fresh->max_sessions, fresh->admin_tenants.size(),
      fresh->log_level);
  if (const std::vector<std::string> changed = NeedRestart(started, *fresh); !changed.empty()) {
    spdlog::warn("SIGHUP: these settings changed but take effect only at a restart: {}",
                 absl::StrJoin(changed, ", "));
  }
}

std::string SelfExe() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "/proc/self/exe";
  path[n] = '\0';
  return path;
}

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--", flag, " ", path, ": cannot read it"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The main listener's TCP credentials: TLS when a certificate is configured (requesting and
// verifying client certificates when a client CA is), else plaintext (loopback or
// --insecure; options.cc refuses the rest).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonOptions& options, const Authenticator& auth) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  auto cert = ReadFile("tls-cert", options.tls_cert);
  if (!cert.ok()) return cert.status();
  auto key = ReadFile("tls-key", options.tls_key);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!options.tls_client_ca.empty()) {
    auto ca = ReadFile("tls-client-ca", options.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    // A certificate is optional (token clients have none) but verified when presented.
    ssl.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::SslServerCredentials(ssl);
  credentials->SetAuthMetadataProcessor(auth.EarlyCheck());
  return credentials;
}

std::string Describe(const DaemonOptions& options) {
  std::string out;
  if (!options.unix_socket.empty()) {
    absl::StrAppend(&out, "unix:", options.unix_socket, " (tenant = peer user)");
  }
  if (!options.region_socket.empty()) {
    absl::StrAppend(&out, ", regions on ", options.region_socket);
  }
  if (!options.listen.empty()) {
    std::vector<std::string> how;
    if (!options.tls_cert.empty()) how.push_back("TLS");
    if (!options.tls_client_ca.empty()) how.push_back("client certificates");
    if (!options.tokens_file.empty()) how.push_back("bearer tokens");
    if (options.insecure) how.push_back("INSECURE: unauthenticated clients allowed");
    absl::StrAppend(&out, out.empty() ? "" : " and ", options.listen, " (",
                    absl::StrJoin(how, ", "), ")");
  }
  return out;
}

// Takes the reflection plugin off a builder. libgrpc++_reflection registers its plugin for
// every ServerBuilder when it is loaded, and reflection must not answer without credentials
// on the main listener.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return plugin->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

// Bounds on what clients can make the front end hold before a call is authenticated (and
// after): memory for buffered messages, threads, streams per connection.
constexpr size_t kFrontendMemoryBytes = 2ull << 30;
constexpr int kFrontendMaxThreads = 512;
constexpr int kMaxConcurrentStreamsPerConnection = 256;
// What a request of the front end's own services (a few bytes each, parsed before the
// caller is authenticated; WatchSession's is held for the stream's life) may take once
// parsed (server/parse_checked_service.h).
constexpr size_t kOwnServiceParseBytes = 256 << 10;
// The health listener's (no credentials at all): see where its server is built.
constexpr int kHealthMaxMessageBytes = 64 << 10;
constexpr int kHealthMaxThreads = 32;

}  // namespace

int FrontendMain(const DaemonOptions& options, ReloadOptions reload) {
  // Debian's Abseil is built with absl::Mutex's deadlock detection on, which makes every
  // lock ~3x dearer; the unit tests keep it on to catch lock-order inversions.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (!options.new_token_tenant.empty()) {
    const NewToken token = MakeToken(options.new_token_tenant);
    std::cout << token.token << "\n" << token.line << "\n";
    return 0;
  }

  ProcessLogOptions log;
  log.logger_name = "gpurpcd";
  log.process = "frontend";
  log.text_pattern = "[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v";
  log.format = ParseLogFormat(options.log_format).value_or(LogFormat::kText);
  log.level = options.log_level;
  InstallProcessLogger(log);

  // Signals are taken synchronously by this thread; every other thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disappears mid-write must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);

  Authenticator auth(options);
  if (absl::Status status = auth.Start(); !status.ok()) {
    spdlog::critical("{}", std::string(status.message()));
    return 1;
  }
  auto tcp_credentials = TcpCredentials(options, auth);
  if (!tcp_credentials.ok()) {
    spdlog::critical("{}", std::string(tcp_credentials.status().message()));
    return 1;
  }
  if (!options.listen.empty() && options.insecure) {
    spdlog::warn("!!! --insecure: {} accepts {}{}; anyone who can reach it can use the GPUs",
                 options.listen,
                 options.tls_cert.empty() ? "plaintext connections" : "TLS connections",
                 options.tokens_file.empty() && options.tls_client_ca.empty()
                     ? " without any credentials (tenant 'anonymous')"
                     : " and calls without credentials (tenant 'anonymous')");
  }

  // Counted whether or not --metrics-listen serves them (a few atomic adds per call); it
  // outlives everything that counts into it.
  FrontendMetrics metrics(options);
  SessionManager sessions(options, SelfExe(), &metrics);
  if (absl::Status status = sessions.Start(); !status.ok()) {
    spdlog::critical("{}", std::string(status.message()));
    return 1;
  }
  metrics.Watch(&sessions);
  // Prometheus metrics over HTTP (the health listener is gRPC: it cannot answer a GET).
  // Started before any gRPC listener, so that a bad address fails the start before a client
  // is served; destroyed before the session manager and the metrics it reads.
  std::unique_ptr<metrics::MetricsHttpServer> metrics_server;
  if (!options.metrics_listen.empty()) {
    auto started = metrics::MetricsHttpServer::Start(options.metrics_listen,
                                                     [&metrics] { return metrics.Exposition(); });
    if (!started.ok()) {
      spdlog::critical("cannot serve metrics: {}", std::string(started.status().message()));
      return 1;
    }
    metrics_server = *std::move(started);
    spdlog::info("metrics on http://{}/metrics", metrics_server->address());
  }
  spdlog::info("compile sandbox: {}", sessions.inventory().compile_sandbox().empty()
                                          ? "not reported by the worker"
                                          : sessions.inventory().compile_sandbox());

  DeviceServiceImpl device_service(&sessions, &auth);
  SessionServiceImpl session_service(&sessions, &auth);
  AdminServiceImpl admin_service(&sessions, &auth);
  // Session services: unary methods relayed by SessionUnaryProxy, streaming ones (and unknown
  // methods) by the generic SessionProxy.
  SessionUnaryProxy unary_proxy(&sessions, &auth, &metrics, options.command_relay == "framed");
  SessionProxy proxy(&sessions, &auth, &metrics, options.command_relay == "framed");

  // The main server: authenticated services only: the reflection plugin is taken off its
  // builder, and it is built with the default health service off, so that neither answers
  // here without credentials.
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<WithoutReflection>());
  grpc::ResourceQuota quota("gpurpcd-frontend");
  quota.Resize(kFrontendMemoryBytes);
  quota.SetMaxThreads(kFrontendMaxThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxConcurrentStreamsPerConnection);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrameBytes);
  // Find clients that vanished without closing their connection (a command stream would
  // otherwise stay open on a dead TCP connection for hours), and accept clients' pings.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
  int tcp_port = 0;
  if (!options.listen.empty()) {
    builder.AddListeningPort(options.listen, *tcp_credentials, &tcp_port);
  }
  // Their requests are checked before gRPC parses them, even before the caller is
  // authenticated (server/parse_checked_service.h); the relay checks the session services'.
  ParseCheckedService checked_device_service(
      &device_service, v1::DeviceService::service_full_name(), kOwnServiceParseBytes);
  ParseCheckedService checked_session_service(
      &session_service, v1::SessionService::service_full_name(), kOwnServiceParseBytes);
  ParseCheckedService checked_admin_service(&admin_service, v1::AdminService::service_full_name(),
                                            kOwnServiceParseBytes);
  builder.RegisterService(&checked_device_service);
  builder.RegisterService(&checked_session_service);
  builder.RegisterService(&checked_admin_service);
  builder.RegisterService(&unary_proxy);
  builder.RegisterCallbackGenericService(&proxy);
  builder.experimental().SetInterceptorCreators(
      StatusInterceptors(/*mark_worker_answers=*/false, kFrontendMaxThreads, &metrics));

  // The health listener: grpc.health.v1 and reflection, nothing else, no credentials.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<grpc::Server> health_server;
  if (!options.health_listen.empty()) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder health_builder;
    // No credentials here, so what a caller can make the server hold is kept small: a
    // health check or a reflection request is a few bytes (a message's parse is bounded by
    // its size, server/parse_limit.h: some 3 MiB for 64 KiB), reflection streams take at
    // most kHealthMaxThreads threads (the health service is callback-based and takes none),
    // and a connection at most 8 streams.
    health_builder.SetMaxReceiveMessageSize(kHealthMaxMessageBytes);
    grpc::ResourceQuota health_quota("gpurpcd-health");
    health_quota.Resize(size_t{64} << 20);
    health_quota.SetMaxThreads(kHealthMaxThreads);
    health_builder.SetResourceQuota(health_quota);
    health_builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 8);
    int health_port = 0;
    health_builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                                    &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr ||
        (health_port == 0 && options.health_listen.rfind("unix:", 0) != 0)) {
      spdlog::critical("cannot serve health on {}", options.health_listen);
      return 1;
    }
  }
  grpc::EnableDefaultHealthCheckService(false);

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (!options.listen.empty() && tcp_port == 0)) {
    spdlog::critical("cannot serve on {}", options.listen);
    return 1;
  }
  std::unique_ptr<UnixListener> unix_listener;
  if (!options.unix_socket.empty()) {
    auto listener = UnixListener::Open(options.unix_socket, options.unix_socket_mode, &auth);
    if (!listener.ok()) {
      spdlog::critical("cannot serve on unix:{}: {}", options.unix_socket,
                       std::string(listener.status().message()));
      return 1;
    }
    unix_listener = *std::move(listener);
    unix_listener->Start(server.get());
  }
  // Same-host regions' memfds (host_region_service.proto); workers tell clients the path.
  std::unique_ptr<RegionListener> region_listener;
  if (!options.region_socket_note.empty()) spdlog::warn("{}", options.region_socket_note);
  if (!options.region_socket.empty()) {
    auto listener =
        RegionListener::Open(options.region_socket, options.unix_socket_mode, &sessions);
    if (!listener.ok()) {
      spdlog::critical("cannot serve the region socket {}: {}", options.region_socket,
                       std::string(listener.status().message()));
      return 1;
    }
    region_listener = *std::move(listener);
    region_listener->Start();
  }
  if (health_server != nullptr) {
    health_server->GetHealthCheckService()->SetServingStatus(true);
  }
  const uint64_t kernel_timeout_ms = options.default_quota.kernel_timeout_ms();
  spdlog::info(
      "gpurpcd {} (instance {}) serving on {} with the {} backend; sessions: idle timeout {}, "
      "grace {}; kernel watchdog {}{}{}",
      GPURPC_VERSION, sessions.instance(), Describe(options), sessions.inventory().backend(),
      absl::FormatDuration(options.session_idle_timeout),
      absl::FormatDuration(options.session_grace),
      kernel_timeout_ms == 0
          ? std::string("off")
          : absl::FormatDuration(absl::Milliseconds(static_cast<int64_t>(kernel_timeout_ms))),
      options.health_listen.empty() ? "" : "; health and reflection on ", options.health_listen);

  for (;;) {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    if (signal_number == SIGHUP) {
      Reload(auth, sessions, options, reload);
      continue;
    }
    spdlog::info("{}: draining", strsignal(signal_number));
    break;
  }
  // Draining: health says NOT_SERVING at once (load balancers and Kubernetes stop sending
  // new clients), new sessions are refused, and the open ones may go on (their clients keep
  // every listener) until they close or --drain-timeout ends them. A second SIGTERM or
  // SIGINT stops at once; SIGHUP still reloads.
  if (health_server != nullptr) health_server->GetHealthCheckService()->SetServingStatus(false);
  sessions.StartDraining();
  const absl::Time drain_deadline = absl::Now() + options.drain_timeout;
  if (sessions.session_count() > 0) {
    spdlog::info(
        "draining: {} session(s) open; waiting up to {} for them to close "
        "(--drain-timeout)",
        sessions.session_count(), absl::FormatDuration(options.drain_timeout));
  }
  while (sessions.session_count() > 0) {
    const absl::Duration left = drain_deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      spdlog::warn("drain timeout ({}) reached: stopping the workers of {} open session(s)",
                   absl::FormatDuration(options.drain_timeout), sessions.session_count());
      break;
    }
    const timespec wait = absl::ToTimespec(std::min(left, absl::Milliseconds(100)));
    const int signal_number = sigtimedwait(&signals, nullptr, &wait);
    if (signal_number == SIGHUP) {
      Reload(auth, sessions, options, reload);
    } else if (signal_number > 0) {
      spdlog::warn("{} while draining: stopping the workers of {} open session(s) now",
                   strsignal(signal_number), sessions.session_count());
      break;
    }
  }
  unix_listener.reset();  // accept no more
  region_listener.reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  if (health_server != nullptr) {
    health_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    health_server->Wait();
  }
  return 0;
}

}  // namespace gpurpc::frontend
