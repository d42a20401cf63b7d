// /metrics of a real gpurpcd (--metrics-listen; docs/METRICS.md) on the fake backend, with
// real worker processes, driven through the C++ client. Every scrape is fetched over a raw
// socket and parsed strictly as the Prometheus text format 0.0.4 (ParseExposition below):
// every line a HELP, TYPE or comment line or a sample, every sample of a family declared by
// a TYPE line before it, each family's lines together, no series twice, histogram buckets
// cumulative and ending with +Inf equal to _count. Then the counters must have moved by
// exactly what the test did, and the gauges must show what is open. Last, hostile HTTP
// clients: the daemon stays up and keeps answering both HTTP and gRPC.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

// ------------------------------------------------------------------------- raw HTTP

int ConnectTo(int port) {
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

struct HttpReply {
  int status = 0;
  std::string head;
  std::string body;
};

// Sends `request` as it is, reads until the server closes, splits the answer.
absl::StatusOr<HttpReply> HttpExchange(int port, const std::string& request) {
  const int fd = ConnectTo(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect: ", std::strerror(errno)));
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer and close before reading it all
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
  if (!closed) return absl::DeadlineExceededError("the server did not end its answer in 20 s");
  HttpReply reply;
  const size_t end_of_head = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || end_of_head == std::string::npos || raw.size() < 12 ||
      !absl::SimpleAtoi(raw.substr(9, 3), &reply.status)) {
    return absl::InternalError(absl::StrCat("not an HTTP answer: '", raw.substr(0, 200), "'"));
  }
  reply.head = raw.substr(0, end_of_head);
  reply.body = raw.substr(end_of_head + 4);
  return reply;
}

std::string HttpGet(const std::string& path) {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
}

// ------------------------------------------------------------------- the text format

using Labels = std::map<std::string, std::string>;

struct Exposition {
  std::map<std::string, std::string> types;  // family -> counter, gauge, histogram, ...
  std::map<std::string, std::string> help;
  // name -> labels -> value
  std::map<std::string, std::map<Labels, double>> samples;

  std::optional<double> Find(const std::string& name, const Labels& labels = {}) const {
    auto family = samples.find(name);
    if (family == samples.end()) return std::nullopt;
    auto sample = family->second.find(labels);
    if (sample == family->second.end()) return std::nullopt;
    return sample->second;
  }
  // A counter's value; a series not made yet is 0.
  double Counter(const std::string& name, const Labels& labels = {}) const {
    return Find(name, labels).value_or(0);
  }
};

bool IsMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool IsLabelName(absl::string_view name) {
  return IsMetricName(name) && name.find(':') == absl::string_view::npos;
}

bool ParseValue(absl::string_view text, double* value) {
  if (text == "+Inf" || text == "Inf") {
    *value = INFINITY;
    return true;
  }
  if (text == "-Inf") {
    *value = -INFINITY;
    return true;
  }
  if (text == "NaN") {
    *value = NAN;
    return true;
  }
  return absl::SimpleAtod(text, value) && !std::isnan(*value) && !std::isinf(*value);
}

// The family a sample name belongs to under the declared types, or "" when none.
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  if (types.count(name) != 0 && types.at(name) != "histogram" && types.at(name) != "summary") {
    return name;
  }
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    if (absl::EndsWith(name, suffix)) {
      const std::string base = name.substr(0, name.size() - std::strlen(suffix));
      auto it = types.find(base);
      if (it != types.end() && it->second == "histogram") return base;
      if (it != types.end() && it->second == "summary" && std::string(suffix) != "_bucket") {
        return base;
      }
    }
  }
  return "";
}

// Parses and checks the whole text; the error names the line.
absl::StatusOr<Exposition> ParseExposition(const std::string& text) {
  Exposition out;
  if (!text.empty() && text.back() != '\n') {
    return absl::InvalidArgumentError("the text does not end with a newline");
  }
  std::set<std::string> finished;  // families whose lines have ended
  std::string current;             // the family of the last line
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    if (line.empty()) continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", number, " '", line, "': ", why));
    };
    auto enter = [&](const std::string& family) -> absl::Status {
      if (family == current) return absl::OkStatus();
      if (finished.count(family) != 0) return bad("the lines of " + family + " are not together");
      if (!current.empty()) finished.insert(current);
      current = family;
      return absl::OkStatus();
    };
    if (line[0] == '#') {
      const std::vector<std::string> words = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (words.size() >= 3 && (words[1] == "HELP" || words[1] == "TYPE")) {
        const std::string& name = words[2];
        if (!IsMetricName(name)) return bad("not a metric name");
        if (absl::Status s = enter(name); !s.ok()) return s;
        if (words[1] == "HELP") {
          if (out.help.count(name) != 0) return bad("a second HELP");
          out.help[name] = words.size() > 3 ? words[3] : "";
        } else {
          if (words.size() != 4) return bad("TYPE without a type");
          static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                                       "untyped"};
          if (kTypes.count(words[3]) == 0) return bad("unknown type");
          if (out.types.count(name) != 0) return bad("a second TYPE");
          if (out.samples.count(name) != 0) return bad("TYPE after samples of its family");
          out.types[name] = words[3];
        }
      }
      continue;  // any other # line is a comment
    }
    // name{label="value",...} value [timestamp]
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    const std::string name(line.substr(0, i));
    if (!IsMetricName(name)) return bad("not a metric name");
    Labels labels;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        size_t eq = line.find('=', i);
        if (eq == absl::string_view::npos) return bad("a label without =");
        const std::string label(line.substr(i, eq - i));
        if (!IsLabelName(label)) return bad("not a label name: " + label);
        if (eq + 1 >= line.size() || line[eq + 1] != '"') return bad("an unquoted label value");
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            if (++j >= line.size()) return bad("an escape at the end");
            if (line[j] == 'n') {
              value += '\n';
            } else if (line[j] == '\\' || line[j] == '"') {
              value += line[j];
            } else {
              return bad("an unknown escape");
            }
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) return bad("an unterminated label value");
        if (!labels.emplace(label, value).second) return bad("label " + label + " twice");
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) return bad("no }");
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') return bad("no space before the value");
    const std::vector<std::string> rest = absl::StrSplit(line.substr(i + 1), ' ');
    if (rest.empty() || rest.size() > 2) return bad("not 'value [timestamp]'");
    double value = 0;
    if (!ParseValue(rest[0], &value)) return bad("not a value");
    int64_t timestamp = 0;
    if (rest.size() == 2 && !absl::SimpleAtoi(rest[1], &timestamp)) return bad("not a timestamp");
    const std::string family = FamilyOf(name, out.types);
    if (family.empty()) return bad("a sample of no declared TYPE");
    if (absl::Status s = enter(family); !s.ok()) return s;
    const std::string& type = out.types[family];
    if (type == "counter" && !(value >= 0)) return bad("a negative or NaN counter");
    if (absl::EndsWith(name, "_bucket") && labels.count("le") == 0)
      return bad("a bucket without le");
    if (!absl::EndsWith(name, "_bucket") && labels.count("le") != 0 && type == "histogram") {
      return bad("le outside a bucket");
    }
    if (!out.samples[name].emplace(labels, value).second) return bad("a series twice");
  }
  // Histograms: per series (labels without le), buckets cumulative, ending with +Inf ==
  // _count, with a _sum.
  for (const auto& [family, type] : out.types) {
    if (type != "histogram") continue;
    std::map<Labels, std::vector<std::pair<double, double>>> buckets;  // le -> count
    for (const auto& [labels, value] : out.samples[family + "_bucket"]) {
      Labels series = labels;
      double le = 0;
      if (!ParseValue(series["le"], &le)) {
        return absl::InvalidArgumentError(absl::StrCat(family, ": le '", series["le"], "'"));
      }
      series.erase("le");
      buckets[series].emplace_back(le, value);
    }
    for (auto& [series, list] : buckets) {
      std::sort(list.begin(), list.end());
      for (size_t k = 1; k < list.size(); ++k) {
        if (list[k].second < list[k - 1].second) {
          return absl::InvalidArgumentError(absl::StrCat(family, ": buckets not cumulative"));
        }
      }
      if (list.empty() || !std::isinf(list.back().first)) {
        return absl::InvalidArgumentError(absl::StrCat(family, ": no +Inf bucket"));
      }
      auto count = out.Find(family + "_count", series);
      if (!count.has_value() || *count != list.back().second) {
        return absl::InvalidArgumentError(absl::StrCat(family, ": +Inf bucket is not _count"));
      }
      if (!out.Find(family + "_sum", series).has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(family, ": no _sum"));
      }
    }
    for (const char* suffix : {"_count", "_sum"}) {
      for (const auto& [labels, value] : out.samples[family + suffix]) {
        if (buckets.count(labels) == 0) {
          return absl::InvalidArgumentError(absl::StrCat(family, suffix, " without buckets"));
        }
      }
    }
  }
  return out;
}

// The parser itself refuses what it must.
TEST(ExpositionParserTest, RefusesMalformedText) {
  EXPECT_THAT(ParseExposition("# TYPE a counter\na 1\n"), IsOk());
  EXPECT_THAT(ParseExposition("a 1\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no declared TYPE")));
  EXPECT_THAT(ParseExposition("# TYPE a counter\na -1\n").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
  EXPECT_THAT(
      ParseExposition("# TYPE a gauge\na{x=\"1\"} 1\n# TYPE b gauge\nb 1\na{x=\"2\"} 1\n").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not together")));
  EXPECT_THAT(ParseExposition("# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(ParseExposition("# TYPE a gauge\na{x=\"\\q\"} 1\n").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("escape")));
  EXPECT_THAT(ParseExposition("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} "
                              "1\nh_sum 1\nh_count 1\n")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cumulative")));
  EXPECT_THAT(
      ParseExposition("# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 1\n").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("_count")));
  auto parsed =
      ParseExposition("# HELP a A \\\\ help\n# TYPE a gauge\na{x=\"q\\\"\\\\\\n\"} 2.5\n");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->Find("a", {{"x", "q\"\\\n"}}), 2.5);
}

// ---------------------------------------------------------------------------- tests

constexpr char kUpload[] = "/gpurpc.v1.MemoryService/Upload";
constexpr char kDownload[] = "/gpurpc.v1.MemoryService/Download";
constexpr char kAllocate[] = "/gpurpc.v1.MemoryService/Allocate";
constexpr char kCompile[] = "/gpurpc.v1.ModuleService/Compile";
constexpr char kLoadModule[] = "/gpurpc.v1.ModuleService/LoadModule";
constexpr char kOpen[] = "/gpurpc.v1.SessionService/OpenSession";
constexpr char kClose[] = "/gpurpc.v1.SessionService/CloseSession";

class MetricsTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    auto port = testing::FreeLoopbackPort();
    ASSERT_THAT(port, IsOk());
    port_ = *port;
    TestDaemon::Options options;
    options.extra_flags = std::move(flags);
    options.extra_flags.push_back(absl::StrCat("--metrics-listen=127.0.0.1:", port_));
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    ConnectOptions connect;
    connect.address = daemon_->address();
    connect.use_environment = false;  // no GPURPC_DIRECT: every call goes through the relay
    connect.call_timeout = absl::Seconds(60);
    auto client = Client::Connect(connect);
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
    auto info = client_->GetServerInfo();
    ASSERT_THAT(info, IsOk());
    tenant_ = info->tenant();
  }

  // GET /metrics, checked as HTTP and parsed as the text format.
  Exposition Scrape() {
    auto reply = HttpExchange(port_, HttpGet("/metrics"));
    EXPECT_THAT(reply, IsOk());
    if (!reply.ok()) return Exposition();
    EXPECT_EQ(reply->status, 200) << reply->head;
    EXPECT_THAT(reply->head, HasSubstr("Content-Type: text/plain; version=0.0.4"));
    auto parsed = ParseExposition(reply->body);
    EXPECT_THAT(parsed, IsOk()) << reply->body;
    return parsed.ok() ? *std::move(parsed) : Exposition();
  }

  static Labels Rpc(const std::string& method, const std::string& code) {
    return {{"method", method}, {"code", code}};
  }
  static double Delta(const Exposition& before, const Exposition& after, const std::string& name,
                      const Labels& labels = {}) {
    return after.Counter(name, labels) - before.Counter(name, labels);
  }

  int port_ = 0;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::string tenant_;
};

// The files and bytes under the cache folder, as the daemon's gauges count them.
std::pair<double, double> CacheFolderUsage(const std::string& dir) {
  double files = 0;
  double bytes = 0;
  std::vector<std::string> folders = {dir};
  for (size_t f = 0; f < folders.size(); ++f) {
    DIR* d = opendir(folders[f].c_str());
    if (d == nullptr) continue;
    while (dirent* entry = readdir(d)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      const std::string path = folders[f] + "/" + name;
      struct stat st;
      if (lstat(path.c_str(), &st) != 0) continue;
      if (S_ISREG(st.st_mode)) {
        ++files;
        bytes += static_cast<double>(st.st_size);
      } else if (S_ISDIR(st.st_mode) && f == 0) {
        folders.push_back(path);
      }
    }
    closedir(d);
  }
  return {files, bytes};
}

TEST_F(MetricsTest, CountersMoveByExactlyWhatTheClientDid) {
  ASSERT_NO_FATAL_FAILURE(Start({"--fake-memory-bytes=4294967296"}));
  const Exposition before = Scrape();
  // Every family is declared with a help text.
  for (const char* family : {"gpurpc_rpcs_total",
                             "gpurpc_rpc_duration_seconds",
                             "gpurpc_relayed_bytes_total",
                             "gpurpc_sessions",
                             "gpurpc_sessions_opened_total",
                             "gpurpc_sessions_ended_total",
                             "gpurpc_worker_processes",
                             "gpurpc_session_faults_total",
                             "gpurpc_watchdog_kills_total",
                             "gpurpc_compile_cache_hits_total",
                             "gpurpc_compile_cache_misses_total",
                             "gpurpc_compile_cache_disk_bytes",
                             "gpurpc_compile_cache_disk_files",
                             "gpurpc_device_memory_total_bytes",
                             "gpurpc_device_memory_accounted_bytes",
                             "gpurpc_tenant_device_memory_bytes",
                             "gpurpc_tenant_host_region_bytes",
                             "gpurpc_device_info",
                             "gpurpc_build_info",
                             "gpurpc_draining"}) {
    EXPECT_EQ(before.types.count(family), 1u) << family;
    EXPECT_FALSE(before.help.count(family) == 0 || before.help.at(family).empty()) << family;
  }
  EXPECT_EQ(before.types.at("gpurpc_rpc_duration_seconds"), "histogram");
  EXPECT_EQ(before.types.at("gpurpc_rpcs_total"), "counter");
  EXPECT_EQ(before.types.at("gpurpc_sessions"), "gauge");
  EXPECT_EQ(before.Find("gpurpc_device_memory_total_bytes", {{"device", "0"}}), 4294967296.0);
  EXPECT_EQ(before.Find("gpurpc_device_memory_accounted_bytes", {{"device", "0"}}), 0.0);
  EXPECT_EQ(before.Find("gpurpc_worker_processes", {{"device", "0"}, {"role", "session"}}), 0.0);
  EXPECT_EQ(before.Find("gpurpc_draining"), 0.0);
  EXPECT_EQ(before.Find("gpurpc_compile_cache_max_bytes"), 1073741824.0);
  EXPECT_FALSE(before.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "active"}}));
  // The client's Connect and GetServerInfo were counted.
  EXPECT_GE(
      before.Counter("gpurpc_rpcs_total", Rpc("/gpurpc.v1.DeviceService/GetServerInfo", "OK")), 1);

  constexpr size_t kBytes = 256 * 1024;
  ASSERT_OK_AND_ASSIGN(Session session, client_->OpenSession(0, "metrics test"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(kBytes));
  std::vector<uint8_t> data(kBytes);
  for (size_t i = 0; i < kBytes; ++i) data[i] = static_cast<uint8_t>(i * 7);
  ASSERT_OK(buffer.Upload(data));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download());
  EXPECT_EQ(back, data);
  CompileOptions compile;
  compile.source = testing::kFakeKernelsSource;
  compile.program_name = "metrics_test.cu";
  ASSERT_OK_AND_ASSIGN(CompileResult first, session.Compile(compile));
  ASSERT_TRUE(first.success()) << first.log();
  ASSERT_OK_AND_ASSIGN(CompileResult second, session.Compile(compile));
  ASSERT_TRUE(second.success());
  EXPECT_FALSE(first.response.cache_hit());  // a fresh cache folder
  EXPECT_TRUE(second.response.cache_hit());
  // The failing call: an image the (fake) driver refuses.
  EXPECT_THAT(session.LoadModule("this is not a module image").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A path gpurpc does not serve: counted as method "unknown", never under its own name.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    EXPECT_EQ(testing::RawCall(client_->channel(), &context, "/evil.Service/Label9f3a", {""})
                  .status.error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }

  const Exposition open = Scrape();
  EXPECT_EQ(open.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "active"}}), 1.0);
  // The ledger holds the buffer (the fake kernels have no globals).
  EXPECT_EQ(open.Find("gpurpc_tenant_device_memory_bytes", {{"tenant", tenant_}}),
            static_cast<double>(kBytes));
  EXPECT_EQ(open.Find("gpurpc_device_memory_accounted_bytes", {{"device", "0"}}),
            static_cast<double>(kBytes));
  EXPECT_EQ(open.Find("gpurpc_tenant_host_region_bytes", {{"tenant", tenant_}}), 0.0);
  EXPECT_EQ(open.Find("gpurpc_worker_processes", {{"device", "0"}, {"role", "session"}}), 1.0);
  for (const auto& [labels, value] : open.samples.at("gpurpc_rpcs_total")) {
    EXPECT_FALSE(absl::StrContains(labels.at("method"), "evil")) << labels.at("method");
  }

  ASSERT_OK(session.Close());
  const Exposition after = Scrape();
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kOpen, "OK")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kClose, "OK")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kAllocate, "OK")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kUpload, "OK")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kDownload, "OK")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kCompile, "OK")), 2);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kLoadModule, "INVALID_ARGUMENT")), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kLoadModule, "OK")), 0);
  EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc("unknown", "UNIMPLEMENTED")), 1);
  // Each answered call was timed once.
  for (const char* method : {kOpen, kClose, kAllocate, kUpload, kDownload, kCompile, kLoadModule}) {
    double calls = 0;
    for (const auto& [labels, value] : after.samples.at("gpurpc_rpcs_total")) {
      if (labels.at("method") == method)
        calls += value - before.Counter("gpurpc_rpcs_total", labels);
    }
    EXPECT_EQ(Delta(before, after, "gpurpc_rpc_duration_seconds_count", {{"method", method}}),
              calls)
        << method;
    EXPECT_GT(after.Counter("gpurpc_rpc_duration_seconds_sum", {{"method", method}}), 0) << method;
  }
  // The bytes the relay carried: the upload's data plus a few bytes of its message.
  const double up = Delta(before, after, "gpurpc_relayed_bytes_total",
                          {{"method", kUpload}, {"direction", "to_worker"}});
  const double down = Delta(before, after, "gpurpc_relayed_bytes_total",
                            {{"method", kDownload}, {"direction", "to_client"}});
  EXPECT_GE(up, kBytes);
  EXPECT_LE(up, kBytes + 64);
  EXPECT_GE(down, kBytes);
  EXPECT_LE(down, kBytes + 64);
  EXPECT_LE(Delta(before, after, "gpurpc_relayed_bytes_total",
                  {{"method", kDownload}, {"direction", "to_worker"}}),
            64);
  // Sessions.
  EXPECT_EQ(Delta(before, after, "gpurpc_sessions_opened_total", {{"tenant", tenant_}}), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_sessions_ended_total", {{"how", "closed"}}), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_sessions_ended_total", {{"how", "reclaimed"}}), 0);
  EXPECT_FALSE(after.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "active"}}));
  EXPECT_FALSE(after.Find("gpurpc_tenant_device_memory_bytes", {{"tenant", tenant_}}));
  EXPECT_EQ(after.Find("gpurpc_device_memory_accounted_bytes", {{"device", "0"}}), 0.0);
  // The compile cache: one miss, then one hit.
  EXPECT_EQ(Delta(before, after, "gpurpc_compile_cache_misses_total"), 1);
  EXPECT_EQ(Delta(before, after, "gpurpc_compile_cache_hits_total"), 1);
  // Nothing faulted.
  for (const char* cause : {"kernel_timeout", "device_fault", "worker_exit", "quota"}) {
    EXPECT_EQ(Delta(before, after, "gpurpc_session_faults_total", {{"cause", cause}}), 0) << cause;
  }
  EXPECT_EQ(Delta(before, after, "gpurpc_watchdog_kills_total"), 0);
  // The cache folder's size, as this test counts it (the gauges are read at most every 5 s).
  const auto [files, bytes] = CacheFolderUsage(daemon_->cache_dir());
  EXPECT_GE(files, 1);
  Exposition cache;
  EXPECT_TRUE(Eventually([&] {
    cache = Scrape();
    return cache.Find("gpurpc_compile_cache_disk_files") == files &&
           cache.Find("gpurpc_compile_cache_disk_bytes") == bytes;
  })) << "the cache folder holds "
      << files << " files, " << bytes << " bytes; the gauges say "
      << cache.Counter("gpurpc_compile_cache_disk_files") << ", "
      << cache.Counter("gpurpc_compile_cache_disk_bytes");
  EXPECT_THAT(daemon_->CheckRunning(), IsOk());
}

// Command streams held open at once on one session: each sends a sync and reads its answer,
// so that the front end has relayed it before Hold returns.
class HeldStreams {
 public:
  HeldStreams(const std::string& address, uint64_t session_id, int count) {
    auto stub = v1::ExecutionService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    for (int i = 0; i < count; ++i) {
      contexts_.push_back(std::make_unique<grpc::ClientContext>());
      contexts_.back()->AddMetadata("gpurpc-session", std::to_string(session_id));
      streams_.push_back(stub->CommandStream(contexts_.back().get()));
      v1::CommandBatch batch;
      v1::Command* sync = batch.add_commands();
      sync->set_sequence(1);
      sync->mutable_sync();
      v1::CommandReply reply;
      EXPECT_TRUE(streams_.back()->Write(batch) && streams_.back()->Read(&reply)) << "stream " << i;
    }
  }
  // Cancels every stream.
  ~HeldStreams() {
    for (auto& context : contexts_) context->TryCancel();
    for (auto& stream : streams_) (void)stream->Finish();
  }

 private:
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::CommandBatch, v1::CommandReply>>>
      streams_;
};

// CommandStream calls count by how the front end relays them: on framed channels, up to
// eight per session at once, and the rest by gRPC; the framed places come back when streams
// end, however they end.
TEST_F(MetricsTest, CommandStreamsCountByHowTheyAreRelayed) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto session = client_->OpenSession(0, "metrics test");
  ASSERT_THAT(session, IsOk());
  const Labels framed = {{"relay", "framed"}};
  const Labels grpc_relay = {{"relay", "grpc"}};
  const Exposition before = Scrape();
  {
    HeldStreams held(daemon_->address(), session->id(), 10);
    const Exposition during = Scrape();
    EXPECT_EQ(Delta(before, during, "gpurpc_command_streams_total", framed), 8);
    EXPECT_EQ(Delta(before, during, "gpurpc_command_streams_total", grpc_relay), 2);
  }
  // Cancelled, the streams give their framed places back (once the front end has ended them).
  EXPECT_TRUE(Eventually([&] {
    const Exposition start = Scrape();
    HeldStreams held(daemon_->address(), session->id(), 8);
    return Delta(start, Scrape(), "gpurpc_command_streams_total", framed) == 8;
  }));
}

// --command-relay=grpc relays every command stream by gRPC.
TEST_F(MetricsTest, CommandStreamsGoByGrpcWhenTold) {
  ASSERT_NO_FATAL_FAILURE(Start({"--command-relay=grpc"}));
  auto session = client_->OpenSession(0, "metrics test");
  ASSERT_THAT(session, IsOk());
  const Exposition before = Scrape();
  { HeldStreams held(daemon_->address(), session->id(), 3); }
  const Exposition after = Scrape();
  EXPECT_EQ(Delta(before, after, "gpurpc_command_streams_total", {{"relay", "grpc"}}), 3);
  EXPECT_EQ(Delta(before, after, "gpurpc_command_streams_total", {{"relay", "framed"}}), 0);
}

// UploadStream and DownloadStream count by how the front end relays them (framed transfer
// channels by default, gRPC when told), and their calls and bytes count as the gRPC relay's
// do.
TEST_F(MetricsTest, TransfersCountByHowTheyAreRelayed) {
  constexpr char kUploadStream[] = "/gpurpc.v1.MemoryService/UploadStream";
  constexpr char kDownloadStream[] = "/gpurpc.v1.MemoryService/DownloadStream";
  constexpr size_t kBytes = 3 << 20;  // streamed: over the 1 MiB of a unary call
  for (const bool framed : {true, false}) {
    SCOPED_TRACE(framed ? "framed" : "grpc");
    ASSERT_NO_FATAL_FAILURE(Start(framed ? std::vector<std::string>{}
                                         : std::vector<std::string>{"--command-relay=grpc"}));
    auto session = client_->OpenSession(0, "metrics test");
    ASSERT_THAT(session, IsOk());
    ASSERT_OK_AND_ASSIGN(Buffer buffer, session->Allocate(kBytes));
    std::vector<uint8_t> data(kBytes);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
    const Exposition before = Scrape();
    ASSERT_OK(buffer.Upload(data));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download());
    EXPECT_TRUE(back == data);
    const Exposition after = Scrape();
    EXPECT_EQ(Delta(before, after, "gpurpc_transfer_streams_total", {{"relay", "framed"}}),
              framed ? 2 : 0);
    EXPECT_EQ(Delta(before, after, "gpurpc_transfer_streams_total", {{"relay", "grpc"}}),
              framed ? 0 : 2);
    EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kUploadStream, "OK")), 1);
    EXPECT_EQ(Delta(before, after, "gpurpc_rpcs_total", Rpc(kDownloadStream, "OK")), 1);
    const double up = Delta(before, after, "gpurpc_relayed_bytes_total",
                            {{"method", kUploadStream}, {"direction", "to_worker"}});
    const double down = Delta(before, after, "gpurpc_relayed_bytes_total",
                              {{"method", kDownloadStream}, {"direction", "to_client"}});
    EXPECT_GE(up, kBytes);
    EXPECT_LE(up, kBytes + 1024);
    EXPECT_GE(down, kBytes);
    EXPECT_LE(down, kBytes + 1024);
    ASSERT_OK(session->Close());
  }
}

TEST_F(MetricsTest, TheWatchdogsKillIsAFaultOfItsCause) {
  ASSERT_NO_FATAL_FAILURE(Start({"--kernel-timeout=1s"}));
  const Exposition before = Scrape();
  ASSERT_OK_AND_ASSIGN(Session session, client_->OpenSession(0, "metrics watchdog test"));
  CompileOptions compile;
  compile.source = testing::kFakeKernelsSource;
  ASSERT_OK_AND_ASSIGN(CompileResult compiled, session.Compile(compile));
  ASSERT_TRUE(compiled.success()) << compiled.log();
  ASSERT_OK_AND_ASSIGN(Function spin, compiled.module.GetFunction("spin_us"));
  ASSERT_OK(spin.LaunchAsync({}, uint64_t{30'000'000}));  // 30 s on a 1 s watchdog
  ASSERT_OK(session.Flush());
  ASSERT_TRUE(Eventually([&] { return session.state() == v1::SESSION_STATE_FAULTED; }));
  Exposition faulted;
  ASSERT_TRUE(Eventually([&] {
    faulted = Scrape();
    return Delta(before, faulted, "gpurpc_watchdog_kills_total") >= 1;
  }));
  EXPECT_EQ(Delta(before, faulted, "gpurpc_watchdog_kills_total"), 1);
  EXPECT_EQ(Delta(before, faulted, "gpurpc_session_faults_total", {{"cause", "kernel_timeout"}}),
            1);
  for (const char* cause : {"device_fault", "worker_exit", "quota"}) {
    EXPECT_EQ(Delta(before, faulted, "gpurpc_session_faults_total", {{"cause", cause}}), 0)
        << cause;
  }
  EXPECT_EQ(faulted.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "faulted"}}), 1.0);
  EXPECT_FALSE(faulted.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "active"}}));
  // Its worker is gone.
  EXPECT_EQ(faulted.Find("gpurpc_worker_processes", {{"device", "0"}, {"role", "session"}}), 0.0);
  ASSERT_OK(session.Close());
  const Exposition closed = Scrape();
  EXPECT_FALSE(closed.Find("gpurpc_sessions", {{"tenant", tenant_}, {"state", "faulted"}}));
  EXPECT_EQ(Delta(before, closed, "gpurpc_sessions_ended_total", {{"how", "closed"}}), 1);
}

TEST_F(MetricsTest, HostileHttpClientsLeaveTheDaemonServing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto expect_status = [&](const std::string& request, int status) {
    auto reply = HttpExchange(port_, request);
    ASSERT_THAT(reply, IsOk()) << request.substr(0, 100);
    EXPECT_EQ(reply->status, status) << request.substr(0, 100) << "\n" << reply->head;
  };
  expect_status("POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\nhello=world", 405);
  expect_status("POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 2000000000\r\n\r\nabc", 405);
  expect_status("PUT /metrics HTTP/1.1\r\nHost: t\r\n\r\n", 405);
  expect_status("DELETE / HTTP/1.1\r\nHost: t\r\n\r\n", 405);
  expect_status(HttpGet("/"), 404);
  expect_status(HttpGet("/metrics/../../etc/passwd"), 404);
  expect_status("GET /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody", 400);
  {
    auto reply = HttpExchange(port_, HttpGet("/metrics?" + std::string(100 * 1024, 'x')));
    ASSERT_THAT(reply, IsOk());
    EXPECT_GE(reply->status, 400);
    EXPECT_LT(reply->status, 500);
  }
  // Not HTTP, sent and left (whatever the server makes of it, it stays up).
  static constexpr char kGarbage[] = "\x00\xff\x16\x03\x01 garbage\r\n\r\n";
  if (const int fd = ConnectTo(port_); fd >= 0) {
    send(fd, kGarbage, sizeof(kGarbage) - 1, MSG_NOSIGNAL);
    close(fd);
  }
  // Many connections at once, each idle or half a request, then gone.
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {
    const int fd = ConnectTo(port_);
    if (fd < 0) break;
    if (i % 2 == 0) send(fd, "GET /metr", 9, MSG_NOSIGNAL);
    fds.push_back(fd);
  }
  EXPECT_GE(fds.size(), 100u);
  // Meanwhile the daemon's gRPC side answers.
  EXPECT_THAT(client_->ListDevices(), IsOk());
  for (int fd : fds) close(fd);
  // The endpoint serves again once they are gone (closed connections free their slots).
  Exposition scraped;
  EXPECT_TRUE(Eventually([&] {
    auto reply = HttpExchange(port_, HttpGet("/metrics"));
    if (!reply.ok() || reply->status != 200) return false;
    auto parsed = ParseExposition(reply->body);
    if (!parsed.ok()) return false;
    scraped = *std::move(parsed);
    return true;
  })) << "no scrape after the hostile clients";
  EXPECT_EQ(scraped.types.count("gpurpc_rpcs_total"), 1u);
  // None of the HTTP requests was a gRPC call.
  double unknown = 0;
  for (const auto& [labels, value] : scraped.samples["gpurpc_rpcs_total"]) {
    if (labels.at("method") == "unknown") unknown += value;
  }
  EXPECT_EQ(unknown, 0);
  EXPECT_THAT(daemon_->CheckRunning(), IsOk());
  ASSERT_OK_AND_ASSIGN(Session session, client_->OpenSession(0, "after the hostile clients"));
  EXPECT_OK(session.Close());
}

TEST(MetricsStartTest, AnAddressInUseStopsTheDaemonNamingIt) {
  // A port held by a listening socket of this test.
  const int holder = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(holder, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(holder, 1), 0);
  socklen_t size = sizeof(address);
  ASSERT_EQ(getsockname(holder, reinterpret_cast<sockaddr*>(&address), &size), 0);
  const std::string taken = absl::StrCat("127.0.0.1:", ntohs(address.sin_port));
  TestDaemon::Options options;
  options.extra_flags = {"--metrics-listen=" + taken};
  auto daemon = TestDaemon::Start(std::move(options));
  close(holder);
  ASSERT_FALSE(daemon.ok()) << "the daemon started without its metrics endpoint";
  EXPECT_THAT(
      std::string(daemon.status().message()),
      ::testing::AllOf(HasSubstr("cannot serve metrics"), HasSubstr(taken), HasSubstr("in use")));
}

}  // namespace
}  // namespace gpurpc
