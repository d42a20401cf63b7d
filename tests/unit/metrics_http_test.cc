// The metrics HTTP endpoint (server/metrics/http_server.h) on its own, over raw sockets:
// what it answers to GET /metrics, to other paths and methods, to bodies, to oversized
// requests, its connection bounds and idle timeout; and the --metrics-listen flag
// (server/options.h), from the command line and the config file.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"
#include "server/options.h"
#include "tests/testing/eventually.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::metrics {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::HasSubstr;

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Reads until the peer closes or `timeout` passes. False on timeout.
bool ReadToEnd(int fd, std::string* out, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[65536];
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;  // closed (or reset)
    out->append(buffer, static_cast<size_t>(n));
  }
}

struct Reply {
  int status = 0;
  std::string head;
  std::string body;
};

// Sends `request` as it is and reads the whole answer (the server closes after it: every
// request here says Connection: close, or is one the server closes on).
absl::StatusOr<Reply> Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect: ", strerror(errno)));
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close before it has read everything
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  const bool ended = ReadToEnd(fd, &raw, absl::Seconds(20));
  close(fd);
  if (!ended) return absl::DeadlineExceededError(absl::StrCat("no end of answer: ", raw));
  Reply reply;
  const size_t end_of_head = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || end_of_head == std::string::npos ||
      !absl::SimpleAtoi(raw.substr(9, 3), &reply.status)) {
    return absl::InternalError(absl::StrCat("not an HTTP answer: '", raw, "'"));
  }
  reply.head = raw.substr(0, end_of_head);
  reply.body = raw.substr(end_of_head + 4);
  return reply;
}

std::string Get(const std::string& path) {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
}

// True once the server has accepted `count` connections to 127.0.0.1:`port`, as the kernel
// shows them (/proc/net/tcp): that many established sockets on that local address, and none
// left in the listening socket's accept queue (a LISTEN socket's rx_queue is its length).
bool AcceptedAll(int port, int count) {
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);  // the header
  int established = 0;
  bool listening = false;
  unsigned backlog = 0;
  while (std::getline(tcp, line)) {
    unsigned address = 0, local_port = 0, state = 0, tx_queue = 0, rx_queue = 0;
    if (std::sscanf(line.c_str(), " %*u: %8X:%4X %*8X:%*4X %2X %8X:%8X", &address, &local_port,
                    &state, &tx_queue, &rx_queue) != 5 ||
        address != htonl(INADDR_LOOPBACK) || local_port != static_cast<unsigned>(port)) {
      continue;
    }
    if (state == 0x0A) {  // TCP_LISTEN
      listening = true;
      backlog = rx_queue;
    } else if (state == 0x01) {  // TCP_ESTABLISHED
      ++established;
    }
  }
  return listening && backlog == 0 && established == count;
}

class MetricsHttpTest : public ::testing::Test {
 protected:
  void Start(MetricsHttpServer::Limits limits = MetricsHttpServer::Limits()) {
    auto started = MetricsHttpServer::Start(
        "127.0.0.1:0",
        [this] {
          ++renders_;
          return std::string("# TYPE x counter\nx 1\n");
        },
        limits);
    ASSERT_THAT(started, IsOk());
    server_ = *std::move(started);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->address(), absl::StrCat("127.0.0.1:", server_->port()));
  }
  Reply Must(const std::string& request) {
    auto reply = Exchange(server_->port(), request);
    EXPECT_THAT(reply, IsOk());
    return reply.ok() ? *reply : Reply();
  }

  std::atomic<int> renders_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpTest, GetMetricsAnswersTheRenderedTextAndNothingElseIsServed) {
  ASSERT_NO_FATAL_FAILURE(Start());
  Reply ok = Must(Get("/metrics"));
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.body, "# TYPE x counter\nx 1\n");
  EXPECT_THAT(ok.head, HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8"));
  EXPECT_THAT(ok.head, HasSubstr("Content-Length: 21"));
  EXPECT_EQ(renders_.load(), 1);
  // A query string does not change the path.
  EXPECT_EQ(Must(Get("/metrics?name[]=x")).status, 200);
  // HEAD: the headers only.
  Reply head = Must("HEAD /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");

  for (const char* path : {"/", "/metrics/", "/metricsx", "/Metrics", "/../metrics", "/health"}) {
    Reply missing = Must(Get(path));
    EXPECT_EQ(missing.status, 404) << path;
    EXPECT_THAT(missing.body, HasSubstr("/metrics only")) << path;
  }
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "BREW"}) {
    Reply refused = Must(absl::StrCat(method, " /metrics HTTP/1.1\r\nHost: t\r\n\r\n"));
    EXPECT_EQ(refused.status, 405) << method;
    EXPECT_THAT(refused.head, HasSubstr("Allow: GET, HEAD")) << method;
  }
  EXPECT_EQ(renders_.load(), 3);  // the two GETs and the HEAD
}

TEST_F(MetricsHttpTest, BodiesAreRefusedUnread) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // A POST with a body that never arrives in full: answered at once, not waited for.
  Reply post =
      Must("POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\npartial body");
  EXPECT_EQ(post.status, 405);
  Reply with_body = Must("GET /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(with_body.status, 400);
  EXPECT_THAT(with_body.body, HasSubstr("may not have a body"));
  Reply chunked = Must(
      "GET /metrics HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: "
      "chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
  EXPECT_EQ(chunked.status, 400);
  EXPECT_EQ(renders_.load(), 0);
  // An explicit empty body is no body.
  EXPECT_EQ(Must("GET /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: "
                 "close\r\n\r\n")
                .status,
            200);
}

TEST_F(MetricsHttpTest, OversizedAndMalformedRequestsAreAnsweredWithErrors) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // A request line past the connection's memory (16 KiB).
  Reply long_url = Must(Get("/metrics?" + std::string(64 * 1024, 'a')));
  EXPECT_GE(long_url.status, 400);
  EXPECT_LT(long_url.status, 500);
  // Headers past it.
  std::string headers = "GET /metrics HTTP/1.1\r\nHost: t\r\n";
  for (int i = 0; i < 2000; ++i) absl::StrAppend(&headers, "X-Filler-", i, ": ", "abcdefgh\r\n");
  Reply many_headers = Must(headers + "\r\n");
  EXPECT_GE(many_headers.status, 400);
  EXPECT_LT(many_headers.status, 500);
  // Not HTTP at all.
  static constexpr char kGarbage[] = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\r\n\r\n";
  auto garbage = Exchange(server_->port(), std::string(kGarbage, sizeof(kGarbage) - 1));
  if (garbage.ok()) {
    EXPECT_GE(garbage->status, 400);
  } else {
    // Closed without an answer is as good.
    EXPECT_THAT(garbage.status(), StatusIs(absl::StatusCode::kInternal));
  }
  EXPECT_EQ(renders_.load(), 0);
  EXPECT_EQ(Must(Get("/metrics")).status, 200);
}

TEST_F(MetricsHttpTest, ConnectionsAreBoundedAndIdleOnesClosed) {
  MetricsHttpServer::Limits limits;
  limits.max_connections = 16;
  limits.max_connections_per_ip = 4;
  limits.timeout_seconds = 1;
  ASSERT_NO_FATAL_FAILURE(Start(limits));
  // Four idle connections from 127.0.0.1 take its share; a fifth is closed at once.
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(Connect(server_->port()));
    ASSERT_GE(idle.back(), 0);
  }
  ASSERT_TRUE(::gpurpc::testing::Eventually([&] { return AcceptedAll(server_->port(), 4); }))
      << "the server did not accept the four connections";
  const int fifth = Connect(server_->port());
  ASSERT_GE(fifth, 0);  // the kernel accepts; the server closes it
  std::string nothing;
  EXPECT_TRUE(ReadToEnd(fifth, &nothing, absl::Seconds(5)));
  EXPECT_EQ(nothing, "");
  close(fifth);
  // The idle ones are closed after the timeout (1 s), without any answer.
  for (int fd : idle) {
    std::string got;
    EXPECT_TRUE(ReadToEnd(fd, &got, absl::Seconds(10))) << "an idle connection stayed open";
    EXPECT_EQ(got, "");
    close(fd);
  }
  // Then the endpoint serves again, once the server has counted the closed ones out (its
  // polling thread does that after the client sees the close: poll with a deadline).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<Reply> again = Exchange(server_->port(), Get("/metrics"));
  while (!(again.ok() && again->status == 200) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    again = Exchange(server_->port(), Get("/metrics"));
  }
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->status, 200);

  // A flood of connections that each send half a request and vanish.
  for (int i = 0; i < 200; ++i) {
    const int fd = Connect(server_->port());
    if (fd < 0) continue;
    send(fd, "GET /metr", 9, MSG_NOSIGNAL);
    close(fd);
  }
  bool served = false;
  for (int attempt = 0; attempt < 100 && !served; ++attempt) {
    auto reply = Exchange(server_->port(), Get("/metrics"));
    served = reply.ok() && reply->status == 200;
    if (!served) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(served) << "the endpoint did not serve after a flood of connections";
}

TEST(MetricsHttpStartTest, BadAddressesAreRefusedNamingThem) {
  auto render = [] { return std::string(); };
  EXPECT_THAT(MetricsHttpServer::Start("nonsense", render).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nonsense")));
  EXPECT_THAT(MetricsHttpServer::Start("no-such-host.invalid:9464", render).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no-such-host.invalid")));
  auto first = MetricsHttpServer::Start("127.0.0.1:0", render);
  ASSERT_THAT(first, IsOk());
  const std::string taken = absl::StrCat("127.0.0.1:", (*first)->port());
  EXPECT_THAT(MetricsHttpServer::Start(taken, render).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       ::testing::AllOf(HasSubstr(taken), HasSubstr("in use"))));
  // IPv6 loopback, where the machine has it.
  auto v6 = MetricsHttpServer::Start("[::1]:0", render);
  if (v6.ok()) {
    EXPECT_EQ((*v6)->address(), absl::StrCat("[::1]:", (*v6)->port()));
  } else {
    EXPECT_THAT(v6.status(), StatusIs(absl::StatusCode::kUnavailable));
  }
}

absl::StatusOr<DaemonOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "gpurpcd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return ParseDaemonOptions(static_cast<int>(argv.size()), argv.data());
}

TEST(MetricsListenFlagTest, ParsedFromFlagsAndTheConfigFile) {
  auto none = Parse({});
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->metrics_listen, "");  // off by default
  for (const char* good : {"127.0.0.1:9464", "0.0.0.0:0", "localhost:65535", "[::1]:9464", "[::]:1",
                           "metrics.example.com:80"}) {
    auto parsed = Parse({absl::StrCat("--metrics-listen=", good)});
    ASSERT_THAT(parsed, IsOk()) << good;
    EXPECT_EQ(parsed->metrics_listen, good);
  }
  for (const char* bad :
       {"9464", ":9464", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:http",
        "::1:9464", "[::1]9464", "[nothost]:1", "unix:/tmp/x"}) {
    EXPECT_THAT(Parse({absl::StrCat("--metrics-listen=", bad)}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("--metrics-listen"), HasSubstr(bad))))
        << bad;
  }
  // An empty value turns it off (a flag overriding the config file).
  char path[] = "/tmp/gpurpc-metrics-config-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "metrics_listen: \"127.0.0.1:9100\"\n";
  auto from_file = Parse({absl::StrCat("--config=", path)});
  ASSERT_THAT(from_file, IsOk());
  EXPECT_EQ(from_file->metrics_listen, "127.0.0.1:9100");
  auto overridden = Parse({absl::StrCat("--config=", path), "--metrics-listen="});
  ASSERT_THAT(overridden, IsOk());
  EXPECT_EQ(overridden->metrics_listen, "");
  std::ofstream(path) << "metrics_listen: \"9100\"\n";
  EXPECT_THAT(Parse({absl::StrCat("--config=", path)}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("field metrics_listen"), HasSubstr("9100"))));
  std::remove(path);
  EXPECT_THAT(DaemonUsage(), HasSubstr("--metrics-listen=HOST:PORT"));
}

}  // namespace
}  // namespace gpurpc::metrics
