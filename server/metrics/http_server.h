// The HTTP endpoint that Prometheus scrapes: GET (or HEAD) /metrics and nothing else, served
// by libmicrohttpd from one thread of its own (its internal polling thread, epoll on Linux),
// with bounded connections, per-client connections, connection memory and idle time.
//
//   GET /metrics                  200, the text `render` returns (kExpositionContentType)
//   another path                  404
//   another method                405 with "Allow: GET, HEAD"
//   a request with a body         400 (none is read: the connection is closed after)
//   a request line or headers     libmicrohttpd's own 414 or 431 (they must fit
//   beyond the memory limit       Limits::memory_per_connection)
//
// Past max_connections_per_ip from one address a new connection is closed at once; past
// max_connections it waits unaccepted in the listen backlog. A connection idle for
// timeout_seconds is closed. (Clients that trickle bytes can hold every slot: the endpoint
// must be reachable by the scraper only, see docs/METRICS.md.) The listening socket and
// every accepted one are close-on-exec (worker processes never inherit them).
#ifndef GPURPC_SERVER_METRICS_HTTP_SERVER_H_
#define GPURPC_SERVER_METRICS_HTTP_SERVER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct MHD_Daemon;

namespace gpurpc::metrics {

class MetricsHttpServer {
 public:
  struct Limits {
    unsigned max_connections = 32;
    unsigned max_connections_per_ip = 8;
    unsigned timeout_seconds = 10;
    size_t memory_per_connection = 16 * 1024;
  };

  // Binds `address` (HOST:PORT or [IPV6]:PORT, see ParseHostPort in server/options.h; port 0 takes
  // a free port, see port()) and starts serving. `render` runs on the server's thread, once per
  // GET. INVALID_ARGUMENT for a malformed address, UNAVAILABLE naming the address and the reason
  // when it cannot be resolved or bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render, Limits limits);
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render) {
    return Start(address, std::move(render), Limits());
  }

  // Stops: closes the listening socket and every connection, and joins the thread.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port, and the bound address in numbers ("127.0.0.1:9464", "[::1]:9464").
  int port() const { return port_; }
  const std::string& address() const { return address_; }

  // libmicrohttpd's request handler (public for its C callback only).
  std::string Render() const { return render_(); }

 private:
  explicit MetricsHttpServer(std::function<std::string()> render) : render_(std::move(render)) {}

  const std::function<std::string()> render_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  std::string address_;
};

}  // namespace gpurpc::metrics

#endif  // GPURPC_SERVER_METRICS_HTTP_SERVER_H_
