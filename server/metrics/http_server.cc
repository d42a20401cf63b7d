#include "server/metrics/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "microhttpd.h"
#include "server/metrics/registry.h"
#include "server/options.h"

namespace gpurpc::metrics {
namespace {

// Marks a request whose first call has been answered (libmicrohttpd's per-request pointer).
char kAnswered;

MHD_Result Respond(MHD_Connection* connection, unsigned int code, const std::string& body,
                   const char* content_type, bool close) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (code == MHD_HTTP_METHOD_NOT_ALLOWED) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  }
  if (close) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
  const MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

constexpr char kTextPlain[] = "text/plain; charset=utf-8";

MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url, const char* method,
                  const char* /*version*/, const char* /*upload_data*/, size_t* upload_data_size,
                  void** request_state) {
  if (*request_state != nullptr) {
    // A body libmicrohttpd reads after the answer was queued: dropped unread.
    *upload_data_size = 0;
    return MHD_YES;
  }
  *request_state = &kAnswered;
  const bool get = std::strcmp(method, MHD_HTTP_METHOD_GET) == 0;
  const bool head = std::strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
  if (!get && !head) {
    return Respond(connection, MHD_HTTP_METHOD_NOT_ALLOWED,
                   "405 method not allowed: this endpoint answers GET /metrics only\n", kTextPlain,
                   true);
  }
  const char* length =
      MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
  const char* encoding =
      MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
  if (encoding != nullptr || (length != nullptr && std::strcmp(length, "0") != 0)) {
    return Respond(connection, MHD_HTTP_BAD_REQUEST,
                   "400 bad request: a request to this endpoint may not have a body\n", kTextPlain,
                   true);
  }
  if (std::strcmp(url, "/metrics") != 0) {
    return Respond(connection, MHD_HTTP_NOT_FOUND,
                   "404 not found: this endpoint serves /metrics only\n", kTextPlain, false);
  }
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  return Respond(connection, MHD_HTTP_OK, server->Render(), kExpositionContentType, false);
}

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render, Limits limits) {
  std::string host;
  int port = 0;
  if (absl::Status parsed = ParseHostPort("--metrics-listen", address, &host, &port);
      !parsed.ok()) {
    return parsed;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrFormat("--metrics-listen=%s: cannot resolve '%s': %s",
                                                  address, host, gai_strerror(rc)));
  }
  std::string why;
  int fd = -1;
  int family = AF_INET;
  for (addrinfo* candidate = found; candidate != nullptr && fd < 0;
       candidate = candidate->ai_next) {
    fd = socket(candidate->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = Errno("socket");
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (candidate->ai_family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    if (bind(fd, candidate->ai_addr, candidate->ai_addrlen) != 0) {
      why = Errno("bind");
    } else if (listen(fd, 64) != 0) {
      why = Errno("listen");
    } else {
      family = candidate->ai_family;
      break;
    }
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrFormat("--metrics-listen=%s: cannot listen there: %s", address, why));
  }
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_size) != 0) {
    why = Errno("getsockname");
    close(fd);
    return absl::UnavailableError(absl::StrFormat("--metrics-listen=%s: %s", address, why));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(std::move(render)));
  server->port_ = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  char numeric[INET6_ADDRSTRLEN] = "?";
  const void* raw =
      family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&bound)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&bound)->sin_addr);
  inet_ntop(family, raw, numeric, sizeof(numeric));
  server->address_ = family == AF_INET6 ? absl::StrCat("[", numeric, "]:", server->port_)
                                        : absl::StrCat(numeric, ":", server->port_);
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO;
  if (family == AF_INET6) flags |= MHD_USE_IPv6;
  server->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Handle, server.get(), MHD_OPTION_LISTEN_SOCKET, fd,
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(limits.max_connections),
      MHD_OPTION_PER_IP_CONNECTION_LIMIT, static_cast<unsigned int>(limits.max_connections_per_ip),
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned int>(limits.timeout_seconds),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, limits.memory_per_connection, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    close(fd);
    return absl::UnavailableError(
        absl::StrFormat("--metrics-listen=%s: libmicrohttpd could not start its server", address));
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);  // closes the listening socket too
}

}  // namespace gpurpc::metrics
