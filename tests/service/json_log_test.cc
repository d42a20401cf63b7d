// --log-format=json on a real gpurpcd (fake backend, real worker processes): the daemon's
// whole log -- the front end's lines and its workers', from start to shutdown -- is one JSON
// object per line with ts, level, process, pid, msg (and device on workers' lines), parsed
// with protobuf's JSON parser; --log-format=text stays the default; a bad --log-format stops
// the daemon at start with a message naming the flag.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

// True when `text` matches `pattern`, where 'D' stands for a digit and every other character
// for itself (std::regex is avoided: GCC 12 warns inside it under the sanitizer build).
bool MatchesDigitPattern(absl::string_view text, absl::string_view pattern) {
  if (text.size() != pattern.size()) return false;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool digit = text[i] >= '0' && text[i] <= '9';
    if (pattern[i] == 'D' ? !digit : text[i] != pattern[i]) return false;
  }
  return true;
}

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

// One parsed line of the daemon's JSON log.
struct LogLine {
  std::string text;
  std::string ts;
  std::string level;
  std::string process;
  int64_t pid = 0;
  std::optional<int64_t> device;
  std::string msg;
};

// Parses and checks one line: a JSON object with exactly the keys of log_format.h, each of
// its type, ts RFC 3339 with milliseconds in UTC.
absl::StatusOr<LogLine> ParseLine(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(why, ": ", text));
  };
  google::protobuf::Struct object;
  if (auto status = google::protobuf::util::JsonStringToMessage(text, &object); !status.ok()) {
    return bad(absl::StrCat("not JSON (", status.ToString(), ")"));
  }
  const auto& fields = object.fields();
  auto string_field = [&](const std::string& name, std::string* out) {
    auto it = fields.find(name);
    if (it == fields.end() || it->second.kind_case() != google::protobuf::Value::kStringValue) {
      return false;
    }
    *out = it->second.string_value();
    return true;
  };
  auto integer_field = [&](const std::string& name, int64_t* out) {
    auto it = fields.find(name);
    if (it == fields.end() || it->second.kind_case() != google::protobuf::Value::kNumberValue) {
      return false;
    }
    const double value = it->second.number_value();
    *out = static_cast<int64_t>(value);
    return static_cast<double>(*out) == value;
  };
  LogLine line;
  line.text = text;
  if (!string_field("ts", &line.ts)) return bad("no string ts");
  if (!string_field("level", &line.level)) return bad("no string level");
  if (!string_field("process", &line.process)) return bad("no string process");
  if (!string_field("msg", &line.msg)) return bad("no string msg");
  if (!integer_field("pid", &line.pid) || line.pid <= 0) return bad("no positive integer pid");
  size_t expected_keys = 5;
  if (fields.count("device") != 0) {
    int64_t device;
    if (!integer_field("device", &device)) return bad("device is not an integer");
    line.device = device;
    ++expected_keys;
  }
  if (fields.size() != expected_keys) return bad("keys other than ts level process pid device msg");
  absl::Time time;
  std::string error;
  if (!MatchesDigitPattern(line.ts, "DDDD-DD-DDTDD:DD:DD.DDDZ") ||
      !absl::ParseTime(absl::RFC3339_full, line.ts, &time, &error)) {
    return bad("ts is not RFC 3339 with milliseconds and Z");
  }
  if (absl::AbsDuration(absl::Now() - time) > absl::Minutes(10)) return bad("ts is not now");
  static const std::set<std::string> kLevels = {"trace",   "debug", "info",
                                                "warning", "error", "critical"};
  if (kLevels.count(line.level) == 0) return bad("unknown level");
  if (line.process == "frontend") {
    if (line.device.has_value()) return bad("a front-end line with a device");
  } else if (line.process == "worker") {
    if (!line.device.has_value()) return bad("a worker line without a device");
  } else {
    return bad("process is neither frontend nor worker");
  }
  return line;
}

// SIGTERM, then waits for the daemon to exit (it drains nothing: --drain-timeout=0s), so
// that its log is complete; CheckRunning reaps it.
void StopAndWait(TestDaemon& daemon) {
  ASSERT_GT(daemon.pid(), 0);
  kill(daemon.pid(), SIGTERM);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (daemon.CheckRunning().ok()) {
    ASSERT_LT(absl::Now(), deadline) << "gpurpcd did not exit within 30 s of SIGTERM";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

class JsonLogServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpurpc-json-log-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (!dir_.empty()) {
      if (std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()) != 0) {
        // Leaving a temporary directory behind is harmless.
      }
    }
  }
  std::string dir_;
};

TEST_F(JsonLogServiceTest, EveryLineOfDaemonAndWorkersIsJson) {
  TestDaemon::Options options;
  // A cache folder whose name needs escaping: the workers log it ("compiler: NVRTC ...;
  // cache PATH"), so their lines carry quotes, a backslash, a newline and a byte that is
  // not UTF-8.
  const std::string cache_dir = absl::StrCat(dir_, "/cache \"quoted\" back\\slash\nline \xff");
  options.cache_dir = cache_dir;
  options.extra_flags = {"--log-format=json"};  // TestDaemon logs at debug level
  auto started = TestDaemon::Start(std::move(options));
  ASSERT_THAT(started, IsOk());
  std::unique_ptr<TestDaemon> daemon = *std::move(started);
  const pid_t frontend_pid = daemon->pid();

  // A session: its worker (device 0) logs as it starts, compiles and serves.
  const std::string label = "json \"log\" test\n\\";
  {
    ConnectOptions connect;
    connect.address = daemon->address();
    connect.use_environment = false;
    connect.call_timeout = absl::Seconds(60);
    auto client = Client::Connect(connect);
    ASSERT_THAT(client, IsOk());
    auto session = client->OpenSession(0, label);
    ASSERT_THAT(session, IsOk());
    auto buffer = session->Allocate(4096);
    ASSERT_THAT(buffer, IsOk());
    CompileOptions compile;
    compile.source = testing::kFakeKernelsSource;
    compile.program_name = "json_log_test.cu";
    auto compiled = session->Compile(compile);
    ASSERT_THAT(compiled, IsOk());
    ASSERT_TRUE(compiled->success()) << compiled->log();
    ASSERT_THAT(session->Close(), IsOk());
  }
  StopAndWait(*daemon);
  const std::string log = daemon->Log();

  ASSERT_FALSE(log.empty());
  ASSERT_TRUE(absl::EndsWith(log, "\n")) << "the log does not end with a newline:\n" << log;
  std::vector<std::string> texts = absl::StrSplit(log, '\n');
  texts.pop_back();
  std::vector<LogLine> lines;
  for (const std::string& text : texts) {
    auto line = ParseLine(text);
    ASSERT_TRUE(line.ok()) << line.status() << "\nin the log:\n" << log;
    lines.push_back(*std::move(line));
  }

  // The front end: its own pid, the session's opening with the client's label (which the
  // front end C-escapes) and the worker it runs on.
  int64_t session_worker = 0;
  bool opened = false;
  for (const LogLine& line : lines) {
    if (line.process != "frontend") continue;
    EXPECT_EQ(line.pid, frontend_pid) << line.text;
    const std::string prefix = "worker pid ";
    if (absl::StrContains(line.msg, "opened on device 0") &&
        absl::StrContains(line.msg, absl::CHexEscape(label))) {
      opened = true;
      const size_t at = line.msg.find(prefix);
      ASSERT_NE(at, std::string::npos) << line.text;
      std::vector<std::string> rest = absl::StrSplit(line.msg.substr(at + prefix.size()), ')');
      ASSERT_TRUE(absl::SimpleAtoi(rest[0], &session_worker)) << line.text;
    }
  }
  ASSERT_TRUE(opened) << "no front-end line for the session's opening:\n" << log;

  // The workers: the inventory worker (device -1) and the session's (device 0), each with
  // its own pid, and the cache path back exactly, but for the byte that is not UTF-8.
  std::map<int64_t, std::set<int64_t>> devices_by_pid;
  std::string expected_path = cache_dir;
  expected_path.replace(expected_path.size() - 1, 1, "\xEF\xBF\xBD");
  bool path_seen = false;
  for (const LogLine& line : lines) {
    if (line.process != "worker") continue;
    EXPECT_NE(line.pid, frontend_pid) << line.text;
    devices_by_pid[line.pid].insert(*line.device);
    if (line.pid == session_worker && absl::StrContains(line.msg, "compiler: NVRTC")) {
      EXPECT_THAT(line.msg, ::testing::EndsWith(absl::StrCat("cache ", expected_path)));
      EXPECT_THAT(line.text, HasSubstr(R"(cache \"quoted\" back\\slash\nline )"
                                       "\xEF\xBF\xBD"));
      path_seen = true;
    }
  }
  ASSERT_EQ(devices_by_pid.count(session_worker), 1u)
      << "no line of the session's worker (pid " << session_worker << "):\n"
      << log;
  EXPECT_EQ(devices_by_pid[session_worker], std::set<int64_t>{0});
  EXPECT_TRUE(path_seen) << "the session's worker did not log its compiler:\n" << log;
  bool inventory = false;
  for (const auto& [pid, devices] : devices_by_pid) {
    EXPECT_EQ(devices.size(), 1u) << "worker " << pid << " logged several devices";
    inventory = inventory || devices.count(-1) != 0;
  }
  EXPECT_TRUE(inventory) << "no line of the inventory worker (device -1):\n" << log;
}

TEST_F(JsonLogServiceTest, ConfigFileFieldSelectsJson) {
  const std::string config = dir_ + "/gpurpcd.conf";
  {
    FILE* file = std::fopen(config.c_str(), "w");
    ASSERT_NE(file, nullptr);
    std::fputs("log_format: \"json\"\n", file);
    std::fclose(file);
  }
  TestDaemon::Options options;
  options.extra_flags = {absl::StrCat("--config=", config)};
  auto started = TestDaemon::Start(std::move(options));
  ASSERT_THAT(started, IsOk());
  std::unique_ptr<TestDaemon> daemon = *std::move(started);
  StopAndWait(*daemon);
  const std::string log = daemon->Log();
  std::vector<std::string> texts = absl::StrSplit(log, '\n', absl::SkipEmpty());
  ASSERT_FALSE(texts.empty());
  std::set<std::string> processes;
  for (const std::string& text : texts) {
    auto line = ParseLine(text);
    ASSERT_TRUE(line.ok()) << line.status() << "\nin the log:\n" << log;
    processes.insert(line->process);
  }
  EXPECT_EQ(processes, (std::set<std::string>{"frontend", "worker"})) << log;
}

TEST_F(JsonLogServiceTest, TextStaysTheDefault) {
  auto started = TestDaemon::Start();
  ASSERT_THAT(started, IsOk());
  std::unique_ptr<TestDaemon> daemon = *std::move(started);
  StopAndWait(*daemon);
  const std::string log = daemon->Log();
  std::vector<std::string> texts = absl::StrSplit(log, '\n', absl::SkipEmpty());
  ASSERT_FALSE(texts.empty());
  // spdlog's text lines of both kinds of process; none in JSON. (gRPC's own lines, which
  // text mode leaves in gRPC's format, may come between them.)
  int frontend = 0;
  int worker = 0;
  for (const std::string& text : texts) {
    EXPECT_FALSE(absl::StartsWith(text, "{")) << text;
    // "[YYYY-MM-DD HH:MM:SS.mmm] [..."
    const absl::string_view head = absl::string_view(text).substr(0, 27);
    if (!MatchesDigitPattern(head, "[DDDD-DD-DD DD:DD:DD.DDD] [")) continue;
    ++(absl::StrContains(text, "] [worker ") ? worker : frontend);
  }
  EXPECT_GT(frontend, 0) << log;
  EXPECT_GT(worker, 0) << log;
}

// The binary, run directly: exit status 2 and one line naming the flag and the value.
TEST_F(JsonLogServiceTest, BadFormatIsRefusedAtStart) {
  for (const std::string& flags :
       {std::string("--log-format=bogus"), std::string("--log-format=JSON"),
        std::string("--log-format=")}) {
    const std::string command =
        absl::StrCat("'", TestDaemon::Binary(), "' --backend=fake --unix-socket='", dir_,
                     "/never.sock' ", flags, " 2>&1");
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string out;
    char buffer[4096];
    for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
    const int status = pclose(pipe);
    ASSERT_TRUE(WIFEXITED(status)) << command;
    EXPECT_EQ(WEXITSTATUS(status), 2) << command << ": " << out;
    const std::string value = flags.substr(flags.find('=') + 1);
    EXPECT_EQ(out, absl::StrCat("gpurpcd: --log-format: '", value, "' is not text or json\n"))
        << command;
    struct stat info;
    EXPECT_NE(stat((dir_ + "/never.sock").c_str(), &info), 0) << "it served anyway";
  }
  // From a config file: the field and the flag are named.
  const std::string config = dir_ + "/bad.conf";
  {
    FILE* file = std::fopen(config.c_str(), "w");
    ASSERT_NE(file, nullptr);
    std::fputs("log_format: \"yaml\"\n", file);
    std::fclose(file);
  }
  TestDaemon::Options options;
  options.extra_flags = {absl::StrCat("--config=", config)};
  auto started = TestDaemon::Start(std::move(options));
  ASSERT_FALSE(started.ok());
  EXPECT_THAT(std::string(started.status().message()),
              HasSubstr("field log_format: --log-format: 'yaml' is not text or json"));
}

}  // namespace
}  // namespace gpurpc
