// Client::Connect: address resolution, credentials (bearer token, TLS, mutual TLS) and the
// first call that proves the daemon answers and accepts them.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cpp/src/daemons.h"
#include "client/cpp/src/session_core.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_interceptor.h"

namespace gpurpc {
namespace {

std::string Env(const char* name, bool use_environment) {
  if (!use_environment) return "";
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

bool IsUnixTarget(const std::string& target) {
  return absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:");
}

// True for targets an http_proxy in the environment must not capture.
bool IsLoopbackTarget(const std::string& target) {
  if (IsUnixTarget(target)) return true;
  std::string host = target;
  if (absl::StartsWith(host, "dns:///")) host = host.substr(7);
  if (absl::StartsWith(host, "ipv4:")) host = host.substr(5);
  if (absl::StartsWith(host, "ipv6:")) host = host.substr(5);
  if (absl::StartsWith(host, "[")) {
    host = host.substr(1, host.find(']') - 1);
  } else if (size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

bool IsSocket(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

std::string Normalize(std::string target) {
  target = std::string(absl::StripAsciiWhitespace(target));
  if (absl::StartsWith(target, "/")) return "unix:" + target;
  return target;
}

// Reads a whole file; the status names the file and the reason, never its contents.
absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot read %s %s: %s", what, path, std::strerror(errno)));
  }
  std::stringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrFormat("cannot read %s %s", what, path));
  }
  return contents.str();
}

// PEM text given inline, else read from the file given, else from the file named by the
// environment variable; "" when none of them is set.
absl::StatusOr<std::string> Pem(const std::string& pem, const std::string& file,
                                const char* env_name, bool use_environment,
                                const std::string& what) {
  if (!pem.empty()) return pem;
  if (!file.empty()) return ReadFile(file, what);
  if (std::string env = Env(env_name, use_environment); !env.empty()) {
    return ReadFile(env, absl::StrCat(what, " (", env_name, ")"));
  }
  return std::string();
}

// A token must go into an HTTP/2 header value: printable ASCII without spaces.
absl::Status CheckToken(const std::string& token, const std::string& origin) {
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the token from ", origin,
          " contains characters that cannot be sent (only printable ASCII without spaces)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TokenFromFile(const std::string& path, const std::string& what) {
  absl::StatusOr<std::string> contents = ReadFile(path, what);
  if (!contents.ok()) return contents.status();
  std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is empty"));
  if (absl::Status status = CheckToken(token, absl::StrCat(what, " ", path)); !status.ok()) {
    return status;
  }
  return token;
}

// The token: explicit, else the explicit file, else $GPURPC_TOKEN, else $GPURPC_TOKEN_FILE;
// "" when none is configured.
absl::StatusOr<std::string> ResolveToken(const ConnectOptions& options) {
  if (!options.token.empty()) {
    std::string token(absl::StripAsciiWhitespace(options.token));
    if (absl::Status status = CheckToken(token, "ConnectOptions::token"); !status.ok()) {
      return status;
    }
    return token;
  }
  if (!options.token_file.empty()) return TokenFromFile(options.token_file, "token file");
  if (std::string env = Env("GPURPC_TOKEN", options.use_environment); !env.empty()) {
    std::string token(absl::StripAsciiWhitespace(env));
    if (absl::Status status = CheckToken(token, "GPURPC_TOKEN"); !status.ok()) return status;
    return token;
  }
  if (std::string file = Env("GPURPC_TOKEN_FILE", options.use_environment); !file.empty()) {
    return TokenFromFile(file, "token file (GPURPC_TOKEN_FILE)");
  }
  return std::string();
}

// Adds the bearer token to the initial metadata of every call on the channel.
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(std::string header) : header_(std::move(header)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", header_);
    }
    methods->Proceed();
  }

 private:
  std::string header_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(const std::string& token) : header_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new TokenInterceptor(header_);
  }

 private:
  const std::string header_;
};

// gRPC's words for a failed TLS handshake (e.g. "Ssl handshake failed: ... certificate
// verify failed").
bool IsTlsFailure(const std::string& message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "handshake") || absl::StrContains(lower, "ssl") ||
         absl::StrContains(lower, "tls") || absl::StrContains(lower, "certificate");
}

// The call timeout: explicit, else $GPURPC_TIMEOUT (seconds, or an absl duration such as
// "90s"), else the default.
absl::StatusOr<absl::Duration> ResolveCallTimeout(const ConnectOptions& options) {
  if (options.call_timeout != absl::ZeroDuration()) {
    if (options.call_timeout < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ConnectOptions::call_timeout must be positive, got ",
                       absl::FormatDuration(options.call_timeout)));
    }
    return options.call_timeout;
  }
  const std::string env(absl::StripAsciiWhitespace(Env("GPURPC_TIMEOUT", options.use_environment)));
  if (env.empty()) return internal::kDefaultCallTimeout;
  absl::Duration timeout;
  double seconds = 0;
  if (absl::SimpleAtod(env, &seconds) && std::isfinite(seconds)) {
    timeout = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(env, &timeout) || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPURPC_TIMEOUT='", absl::CHexEscape(env.substr(0, 64)),
        "' is not a timeout: give seconds (e.g. 90) or a duration (e.g. 90s, 10m, 1h)"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPURPC_TIMEOUT='", env, "' is not a timeout: it must be positive"));
  }
  return timeout;
}

grpc::Status CallListDevices(const std::shared_ptr<grpc::Channel>& channel, absl::Duration timeout,
                             bool wait_for_ready) {
  auto stub = v1::DeviceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_wait_for_ready(wait_for_ready);
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
  v1::ListDevicesResponse response;
  return stub->ListDevices(&context, v1::ListDevicesRequest(), &response);
}

}  // namespace

namespace internal {

std::shared_ptr<grpc::Channel> ChannelFactory::Make(const std::string& target,
                                                    const std::string& tls_name) const {
  grpc::ChannelArguments channel_args = args;
  // An http_proxy in the environment must not capture loopback traffic.
  if (IsLoopbackTarget(target)) channel_args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  if (!tls_name.empty()) {
    // An address a dns:/// name resolved to: the daemon is still that name to TLS and HTTP/2.
    if (tls && !name_overridden) channel_args.SetSslTargetNameOverride(tls_name);
    channel_args.SetString(GRPC_ARG_DEFAULT_AUTHORITY, tls_name);
  }
  if (token.empty()) return grpc::CreateCustomChannel(target, credentials, channel_args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<TokenInterceptorFactory>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, channel_args,
                                                                 std::move(factories));
}

}  // namespace internal

std::vector<std::string> DefaultSocketPaths() {
  std::vector<std::string> paths;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    paths.push_back(absl::StrCat(xdg, "/gpurpc/gpurpcd.sock"));
  }
  paths.push_back("/run/gpurpc/gpurpcd.sock");
  paths.push_back(absl::StrCat("/tmp/gpurpc-", getuid(), "/gpurpcd.sock"));
  return paths;
}

absl::StatusOr<std::string> ResolveAddress(const std::string& address, bool use_environment) {
  if (std::string target = Normalize(address); !target.empty()) return target;
  if (std::string target = Normalize(Env("GPURPC_ADDRESS", use_environment)); !target.empty()) {
    return target;
  }
  const std::vector<std::string> paths = DefaultSocketPaths();
  const std::string tmp_prefix = absl::StrCat("/tmp/gpurpc-", getuid(), "/");
  for (const std::string& path : paths) {
    if (!IsSocket(path)) continue;
    // Anyone may create a folder in /tmp: the daemon's folder there counts only when it is
    // the user's own and only the user may write it (else another user could squat it and
    // receive this client's data).
    if (absl::StartsWith(path, tmp_prefix)) {
      struct stat st;
      const std::string dir = path.substr(0, path.rfind('/'));
      if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() ||
          (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        continue;
      }
    }
    return "unix:" + path;
  }
  return absl::UnavailableError(absl::StrCat(
      "no gpurpcd address given and no daemon socket found at ", absl::StrJoin(paths, ", "),
      " (GPURPC_ADDRESS is not set): set GPURPC_ADDRESS (e.g. gpubox:50051 or "
      "unix:/path/to/gpurpcd.sock) or pass an address"));
}

absl::StatusOr<Client> Client::ConnectSeveral(std::vector<internal::TargetSpec> specs,
                                              internal::ChannelFactory factory,
                                              absl::Duration timeout, absl::Duration call_timeout,
                                              bool tls, bool has_credentials) {
  auto daemons = std::make_shared<internal::Daemons>(std::move(specs), std::move(factory));
  const std::vector<DaemonStatus> found = daemons->Probe(timeout);
  for (const DaemonStatus& daemon : found) {
    if (daemon.status.ok()) {
      std::shared_ptr<grpc::Channel> channel = daemons->ChannelFor(daemon.target);
      return Client(std::move(channel), daemon.target, call_timeout, std::move(daemons));
    }
  }
  // None answered. Credentials refused anywhere is the likelier mistake to report.
  for (const DaemonStatus& daemon : found) {
    if (absl::IsUnauthenticated(daemon.status)) {
      return absl::UnauthenticatedError(absl::StrCat(
          "gpurpcd at ", daemon.target,
          " refused the connection's credentials: ", daemon.status.message(),
          has_credentials ? ""
                          : " (no credentials were given: set ConnectOptions::token or "
                            "GPURPC_TOKEN / GPURPC_TOKEN_FILE, or use a TLS client "
                            "certificate)"));
    }
  }
  return absl::UnavailableError(
      absl::StrFormat("cannot reach any of the %d gpurpcd addresses%s: %s", found.size(),
                      tls ? " over TLS" : "", internal::DescribeUnavailable(found)));
}

absl::StatusOr<Client> Client::Connect(const std::string& address, absl::Duration timeout) {
  ConnectOptions options;
  options.address = address;
  options.timeout = timeout;
  return Connect(options);
}

absl::StatusOr<Client> Client::Connect(const ConnectOptions& options) {
  absl::StatusOr<std::string> target = ResolveAddress(options.address, options.use_environment);
  if (!target.ok()) return target.status();
  absl::StatusOr<std::string> token = ResolveToken(options);
  if (!token.ok()) return token.status();
  absl::StatusOr<absl::Duration> call_timeout = ResolveCallTimeout(options);
  if (!call_timeout.ok()) return call_timeout.status();

  // TLS settings from the environment describe a remote daemon; a Unix socket is plain.
  const bool env_tls = options.use_environment && !IsUnixTarget(*target);
  absl::StatusOr<std::string> roots = Pem(options.root_certs_pem, options.root_certs_file,
                                          "GPURPC_TLS_CA", env_tls, "TLS root certificates");
  if (!roots.ok()) return roots.status();
  absl::StatusOr<std::string> cert = Pem(options.client_cert_pem, options.client_cert_file,
                                         "GPURPC_TLS_CERT", env_tls, "TLS client certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = Pem(options.client_key_pem, options.client_key_file,
                                        "GPURPC_TLS_KEY", env_tls, "TLS client key");
  if (!key.ok()) return key.status();
  if (cert->empty() != key->empty()) {
    return absl::InvalidArgumentError(
        "mutual TLS needs both a client certificate and its private key "
        "(client_cert_* and client_key_*, or GPURPC_TLS_CERT and GPURPC_TLS_KEY)");
  }
  const std::string env_tls_flag = absl::AsciiStrToLower(Env("GPURPC_TLS", env_tls));
  const bool tls = options.tls || env_tls_flag == "1" || env_tls_flag == "true" ||
                   env_tls_flag == "yes" || !roots->empty() || !cert->empty();
  std::string server_name = options.server_name_override;
  if (server_name.empty()) server_name = Env("GPURPC_TLS_SERVER_NAME", env_tls);

  internal::ChannelFactory factory;
  factory.args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  factory.args.SetMaxSendMessageSize(kMaxMessageBytes);
  factory.args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrameBytes);
  // Reconnect soon after the daemon comes back (gRPC's default backoff grows to 120 s): a
  // session's watch must re-attach within the daemon's grace.
  factory.args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  factory.args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  factory.token = *token;
  factory.tls = tls;
  if (tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *roots;
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
    factory.credentials = grpc::SslCredentials(ssl);
    if (!server_name.empty()) {
      factory.args.SetSslTargetNameOverride(server_name);
      factory.name_overridden = true;
    }
  } else {
    factory.credentials = grpc::InsecureChannelCredentials();
  }

  // Checked before any connection: a bad value is the caller's to fix, daemon or none.
  int connections = options.transfer_connections;
  if (const std::string env = Env("GPURPC_TRANSFER_CONNECTIONS", options.use_environment);
      !env.empty()) {
    if (!absl::SimpleAtoi(env, &connections) || connections < 1 ||
        connections > kMaxTransferConnections) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPURPC_TRANSFER_CONNECTIONS='", absl::CHexEscape(env.substr(0, 64)),
                       "' is not a number of connections from 1 to ", kMaxTransferConnections));
    }
  }
  if (connections < 1 || connections > kMaxTransferConnections) {
    return absl::InvalidArgumentError(absl::StrCat("ConnectOptions::transfer_connections is ",
                                                   options.transfer_connections, "; give 1 to ",
                                                   kMaxTransferConnections));
  }

  // Several daemons: a list, or a dns:/// name with several addresses.
  absl::StatusOr<std::vector<internal::TargetSpec>> specs = internal::ParseTargets(*target);
  if (!specs.ok()) return specs.status();
  bool several = specs->size() > 1;
  if (!several && specs->front().resolve) {
    absl::StatusOr<std::vector<std::string>> addresses =
        internal::ResolveAll(specs->front().host, specs->front().port);
    several = addresses.ok() && addresses->size() > 1;
  }
  if (several)
    return ConnectSeveral(*std::move(specs), std::move(factory), options.timeout, *call_timeout,
                          tls, !token->empty() || !cert->empty());

  std::shared_ptr<grpc::Channel> channel = factory.Make(*target);

  // Wait for the connection; a failed TLS handshake ends the wait at once (retrying cannot
  // fix a certificate), anything else (e.g. a daemon still starting) is retried until the
  // deadline.
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoNanoseconds(options.timeout);
  for (grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
       state != GRPC_CHANNEL_READY; state = channel->GetState(/*try_to_connect=*/true)) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      grpc::Status reason = CallListDevices(channel, absl::Seconds(1), /*wait_for_ready=*/false);
      if (tls && reason.error_code() == grpc::StatusCode::UNAVAILABLE &&
          IsTlsFailure(reason.error_message())) {
        return absl::UnavailableError(
            absl::StrFormat("cannot reach gpurpcd at %s: the TLS handshake failed: %s", *target,
                            reason.error_message()));
      }
    }
    if (!channel->WaitForStateChange(state, deadline)) break;
  }

  // One call proves that the daemon answers and accepts the credentials.
  absl::Duration left = absl::FromChrono(deadline - std::chrono::system_clock::now());
  grpc::Status status =
      CallListDevices(channel, std::max(left, absl::Milliseconds(100)), /*wait_for_ready=*/true);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    // The channel never became ready: ask once more without waiting, for gRPC's reason
    // (connection refused, TLS handshake failed, ...).
    grpc::Status reason = CallListDevices(channel, absl::Seconds(2), /*wait_for_ready=*/false);
    if (reason.error_code() == grpc::StatusCode::UNAVAILABLE ||
        reason.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      std::string why = reason.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                            ? "no answer"
                            : reason.error_message();
      return absl::UnavailableError(absl::StrFormat("cannot reach gpurpcd at %s within %s%s: %s",
                                                    *target, absl::FormatDuration(options.timeout),
                                                    tls ? " over TLS" : "", why));
    }
    status = reason;  // it answered after all
  }
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    const bool has_credentials = !token->empty() || !cert->empty();
    return absl::UnauthenticatedError(absl::StrCat(
        "gpurpcd at ", *target, " refused the connection's credentials: ", status.error_message(),
        has_credentials ? ""
                        : " (no credentials were given: set ConnectOptions::token or "
                          "GPURPC_TOKEN / GPURPC_TOKEN_FILE, or use a TLS client certificate)"));
  }
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrFormat("cannot reach gpurpcd at %s%s: %s", *target,
                                                  tls ? " over TLS" : "", status.error_message()));
  }
  if (!status.ok()) {
    absl::Status error = FromGrpcStatus(status);
    return absl::Status(error.code(), absl::StrCat("gpurpcd at ", *target, ": ", error.message()));
  }
  Client client(std::move(channel), *target, *call_timeout);
  if (connections > 1) {
    // Each transfer channel has subchannels of its own, so its own connection: gRPC shares
    // one connection among channels of the same target and arguments otherwise.
    auto transfer = std::make_shared<internal::ChannelFactory>(factory);
    transfer->args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    client.transfer_factory_ = std::move(transfer);
    client.transfer_connections_ = connections;
  }
  return client;
}

}  // namespace gpurpc
