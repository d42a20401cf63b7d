// --log-format (server/log_format.h): the JSON string escaping, the JSON line formatter, the
// process logger with gRPC's lines routed into it, and the flag and config field.
//
// Lines are checked two ways: exact strings where the expected text is known, and by parsing
// with protobuf's JSON parser (google.protobuf.Struct, an implementation independent of ours)
// plus a UTF-8 check of our own, so that the message comes back intact.
#include "server/log_format.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"
#include "server/options.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
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
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::testing::HasSubstr;

std::string Escape(absl::string_view text) {
  std::string out;
  AppendJsonString(text, out);
  return out;
}

// True when `text` is well-formed UTF-8 (no overlong forms, no surrogates, <= U+10FFFF),
// decoded by code point rather than by the byte table log_format.cc uses.
bool IsValidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    int extra;
    uint32_t code;
    if (lead < 0x80) {
      extra = 0;
      code = lead;
    } else if ((lead & 0xE0) == 0xC0) {
      extra = 1;
      code = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      extra = 2;
      code = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      extra = 3;
      code = lead & 0x07;
    } else {
      return false;
    }
    if (i + extra >= text.size()) return false;  // truncated
    for (int k = 1; k <= extra; ++k) {
      const auto byte = static_cast<unsigned char>(text[i + k]);
      if ((byte & 0xC0) != 0x80) return false;
      code = (code << 6) | (byte & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (code < kMin[extra] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
      return false;
    }
    i += extra + 1;
  }
  return true;
}

// Parses one JSON object with protobuf's parser.
absl::StatusOr<google::protobuf::Struct> ParseObject(const std::string& line) {
  google::protobuf::Struct object;
  const auto status = google::protobuf::util::JsonStringToMessage(line, &object);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(status.ToString(), " in: ", line));
  }
  return object;
}

// A JSON string literal's contents back, via protobuf's parser: {"s": <literal>}.
absl::StatusOr<std::string> Unescape(const std::string& literal) {
  auto object = ParseObject(absl::StrCat("{\"s\":", literal, "}"));
  if (!object.ok()) return object.status();
  const auto& fields = object->fields();
  auto it = fields.find("s");
  if (it == fields.end() || it->second.kind_case() != google::protobuf::Value::kStringValue) {
    return absl::InternalError(absl::StrCat("no string in ", literal));
  }
  return it->second.string_value();
}

TEST(LogFormatTest, ParsesTheFormatNames) {
  EXPECT_THAT(ParseLogFormat("text"), IsOkAndHolds(LogFormat::kText));
  EXPECT_THAT(ParseLogFormat("json"), IsOkAndHolds(LogFormat::kJson));
  EXPECT_THAT(ParseLogFormat("JSON").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--log-format: 'JSON' is not text or json")));
  EXPECT_THAT(ParseLogFormat("").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(LogFormatTest, EscapesEveryControlCharacter) {
  for (int c = 0; c < 0x20; ++c) {
    std::string expected;
    switch (c) {
      case '\b':
        expected = "\\b";
        break;
      case '\f':
        expected = "\\f";
        break;
      case '\n':
        expected = "\\n";
        break;
      case '\r':
        expected = "\\r";
        break;
      case '\t':
        expected = "\\t";
        break;
      default:
        expected = absl::StrFormat("\\u%04x", c);
    }
    const std::string input(1, static_cast<char>(c));
    EXPECT_EQ(Escape(input), "\"" + expected + "\"") << "character " << c;
    EXPECT_EQ(Escape("a" + input + "b"), "\"a" + expected + "b\"") << "character " << c;
    auto back = Unescape(Escape(input));
    ASSERT_THAT(back.status(), IsOk()) << "character " << c;
    EXPECT_EQ(*back, input) << "character " << c;
  }
  EXPECT_EQ(Escape("\x7f"), "\"\\u007f\"");
  EXPECT_EQ(Escape(std::string("nul\0here", 8)), "\"nul\\u0000here\"");
}

TEST(LogFormatTest, EscapesQuotesAndBackslashes) {
  EXPECT_EQ(Escape(R"(say "hi")"), R"("say \"hi\"")");
  EXPECT_EQ(Escape(R"(C:\path\n)"), R"("C:\\path\\n")");
  EXPECT_EQ(Escape(R"(\")"), R"("\\\"")");
  EXPECT_EQ(Escape(""), R"("")");
  EXPECT_EQ(Escape("/ stays / {} [] : ,"), R"("/ stays / {} [] : ,")");
  auto back = Unescape(Escape(R"(a "quoted" \ back\slash \" both)"));
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(*back, R"(a "quoted" \ back\slash \" both)");
}

TEST(LogFormatTest, KeepsValidUtf8) {
  const std::string text =
      "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \xEF\xBF\xBF \xF4\x8F\xBF\xBF";
  EXPECT_EQ(Escape(text), "\"" + text + "\"");
  auto back = Unescape(Escape(text));
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(*back, text);
}

TEST(LogFormatTest, ReplacesInvalidUtf8) {
  const std::string r = "\xEF\xBF\xBD";  // U+FFFD
  struct Case {
    std::string input;
    std::string expected;  // between the quotes
  };
  const std::vector<Case> cases = {
      {"\x80", r},  // a stray continuation byte
      {std::string("a\xBF") + "b", "a" + r + "b"},
      {"\xC0\xAF", r + r},  // overlong '/' (C0 is never valid)
      {"\xC1\xBF", r + r},
      {"\xE0\x80\xAF", r + r + r},          // overlong 3-byte form
      {"\xF0\x80\x80\xAF", r + r + r + r},  // overlong 4-byte form
      {"\xED\xA0\x80", r + r + r},          // a UTF-16 surrogate (U+D800)
      {"\xF4\x90\x80\x80", r + r + r + r},  // above U+10FFFF
      {"\xF5\x80", r + r},
      {"\xFF", r},
      {"\xFE\xFF", r + r},
      {"\xE2\x82", r},                           // truncated at the end: one U+FFFD
      {std::string("\xE2\x82") + "x", r + "x"},  // truncated before ASCII
      {std::string("\xF0\x9F\x98") + "x", r + "x"},
      {"\xF0\x9F\x98", r},
      {"\xC3", r},
      {"\xC3\xC3\xA9", r + "\xC3\xA9"},  // a lead byte, then a valid sequence
      {"\xE2\x82\"", r + "\\\""},        // the quote after it is still escaped
      {"\xE2\n", r + "\\n"},
  };
  for (const Case& c : cases) {
    const std::string escaped = Escape(c.input);
    EXPECT_EQ(escaped, "\"" + c.expected + "\"") << absl::CHexEscape(c.input);
    EXPECT_TRUE(IsValidUtf8(escaped)) << absl::CHexEscape(c.input);
    EXPECT_THAT(Unescape(escaped).status(), IsOk()) << absl::CHexEscape(c.input);
  }
}

// Random bytes, random valid UTF-8 and mixes: the output is always one line of valid UTF-8
// that parses as a JSON string, and valid UTF-8 comes back unchanged.
TEST(LogFormatTest, RandomInputsStayValidJson) {
  std::mt19937 random(20240501);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> length(0, 40);
  for (int round = 0; round < 3000; ++round) {
    std::string input;
    const int n = length(random);
    for (int i = 0; i < n; ++i) input.push_back(static_cast<char>(byte(random)));
    const std::string escaped = Escape(input);
    ASSERT_TRUE(IsValidUtf8(escaped)) << absl::CHexEscape(input);
    ASSERT_EQ(escaped.find('\n'), std::string::npos) << absl::CHexEscape(input);
    auto back = Unescape(escaped);
    ASSERT_THAT(back.status(), IsOk()) << absl::CHexEscape(input);
    if (IsValidUtf8(input)) {
      EXPECT_EQ(*back, input) << absl::CHexEscape(input);
    }
  }
  std::uniform_int_distribution<uint32_t> code_point(0, 0x10FFFF);
  for (int round = 0; round < 2000; ++round) {
    std::string input;
    for (int i = 0; i < 8; ++i) {
      uint32_t c = code_point(random);
      if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
      if (c < 0x80) {
        input.push_back(static_cast<char>(c));
      } else if (c < 0x800) {
        input.push_back(static_cast<char>(0xC0 | (c >> 6)));
        input.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      } else if (c < 0x10000) {
        input.push_back(static_cast<char>(0xE0 | (c >> 12)));
        input.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
        input.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      } else {
        input.push_back(static_cast<char>(0xF0 | (c >> 18)));
        input.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
        input.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
        input.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
    }
    ASSERT_TRUE(IsValidUtf8(input));
    auto back = Unescape(Escape(input));
    ASSERT_THAT(back.status(), IsOk()) << absl::CHexEscape(input);
    EXPECT_EQ(*back, input) << absl::CHexEscape(input);
  }
}

TEST(LogFormatTest, Rfc3339WithMillisecondsInUtc) {
  using std::chrono::milliseconds;
  using std::chrono::system_clock;
  EXPECT_EQ(Rfc3339Millis(system_clock::time_point(milliseconds(0))), "1970-01-01T00:00:00.000Z");
  // 2024-02-29T23:59:59.999Z, a leap day.
  EXPECT_EQ(Rfc3339Millis(system_clock::time_point(milliseconds(1709251199999))),
            "2024-02-29T23:59:59.999Z");
  EXPECT_EQ(Rfc3339Millis(system_clock::time_point(milliseconds(1709251200007))),
            "2024-03-01T00:00:00.007Z");
}

// A logger writing through JsonLogFormatter into a string.
struct CapturedLogger {
  explicit CapturedLogger(std::unique_ptr<spdlog::formatter> formatter) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
    logger = std::make_shared<spdlog::logger>("test", sink);
    logger->set_formatter(std::move(formatter));
    logger->set_level(spdlog::level::trace);
  }
  std::vector<std::string> Lines() const {
    std::vector<std::string> lines = absl::StrSplit(out.str(), '\n');
    EXPECT_EQ(lines.back(), "") << "the output does not end with a newline";
    lines.pop_back();
    return lines;
  }
  std::ostringstream out;
  std::shared_ptr<spdlog::logger> logger;
};

const google::protobuf::Value* Field(const google::protobuf::Struct& object,
                                     const std::string& name) {
  auto it = object.fields().find(name);
  return it == object.fields().end() ? nullptr : &it->second;
}

// The checks every JSON line must pass: exactly the keys ts, level, process, pid, msg (and
// device when `device` is set), ts RFC 3339 with ms in UTC and close to now.
void CheckLine(const std::string& line, const std::string& process, int pid,
               std::optional<int> device, google::protobuf::Struct* parsed) {
  ASSERT_TRUE(IsValidUtf8(line)) << line;
  auto object = ParseObject(line);
  ASSERT_THAT(object.status(), IsOk());
  std::vector<std::string> keys;
  for (const auto& [key, value] : object->fields()) keys.push_back(key);
  std::vector<std::string> expected_keys = {"level", "msg", "pid", "process", "ts"};
  if (device.has_value()) expected_keys.push_back("device");
  EXPECT_THAT(keys, ::testing::UnorderedElementsAreArray(expected_keys)) << line;
  const auto* ts = Field(*object, "ts");
  ASSERT_NE(ts, nullptr);
  ASSERT_TRUE(MatchesDigitPattern(ts->string_value(), "DDDD-DD-DDTDD:DD:DD.DDDZ")) << line;
  absl::Time time;
  std::string error;
  ASSERT_TRUE(absl::ParseTime(absl::RFC3339_full, ts->string_value(), &time, &error)) << error;
  EXPECT_LT(absl::AbsDuration(absl::Now() - time), absl::Minutes(1)) << line;
  EXPECT_EQ(Field(*object, "process")->string_value(), process) << line;
  EXPECT_EQ(Field(*object, "pid")->number_value(), pid) << line;
  if (device.has_value()) {
    EXPECT_EQ(Field(*object, "device")->number_value(), *device) << line;
  }
  // The order a reader sees: ts first, msg last.
  EXPECT_EQ(line.rfind("{\"ts\":\"", 0), 0u) << line;
  EXPECT_THAT(line, ::testing::EndsWith("}")) << line;
  *parsed = *std::move(object);
}

TEST(LogFormatTest, FormatterWritesOneJsonObjectPerLine) {
  CapturedLogger captured(std::make_unique<JsonLogFormatter>("frontend", 1234, false, 0));
  const std::string tricky =
      "multi\nline \"quoted\" back\\slash\ttab\r\x01\x1f\x7f bad:\xC3\x28 ok:\xC3\xA9";
  captured.logger->info("{}", tricky);
  captured.logger->warn("pid {} exited", 42);
  captured.logger->error("e");
  captured.logger->critical("c");
  captured.logger->debug("d");
  captured.logger->trace("t");
  const std::vector<std::string> lines = captured.Lines();
  ASSERT_EQ(lines.size(), 6u) << captured.out.str();
  const std::vector<std::string> levels = {"info",     "warning", "error",
                                           "critical", "debug",   "trace"};
  for (size_t i = 0; i < lines.size(); ++i) {
    google::protobuf::Struct object;
    ASSERT_NO_FATAL_FAILURE(CheckLine(lines[i], "frontend", 1234, std::nullopt, &object));
    EXPECT_EQ(Field(object, "level")->string_value(), levels[i]) << lines[i];
  }
  google::protobuf::Struct first;
  ASSERT_NO_FATAL_FAILURE(CheckLine(lines[0], "frontend", 1234, std::nullopt, &first));
  EXPECT_EQ(Field(first, "msg")->string_value(),
            "multi\nline \"quoted\" back\\slash\ttab\r\x01\x1f\x7f bad:\xEF\xBF\xBD( ok:\xC3\xA9");
  EXPECT_THAT(lines[0],
              HasSubstr(R"(,"level":"info","process":"frontend","pid":1234,"msg":"multi\nline )"
                        R"(\"quoted\" back\\slash\ttab\r\u0001\u001f\u007f bad:)"));
  google::protobuf::Struct second;
  ASSERT_NO_FATAL_FAILURE(CheckLine(lines[1], "frontend", 1234, std::nullopt, &second));
  EXPECT_EQ(Field(second, "msg")->string_value(), "pid 42 exited");
}

TEST(LogFormatTest, WorkerLinesNameTheirDevice) {
  for (int device : {-1, 0, 7}) {
    CapturedLogger captured(std::make_unique<JsonLogFormatter>("worker", 99, true, device));
    captured.logger->info("serving");
    // clone() is what each sink gets: the same fields.
    CapturedLogger cloned(JsonLogFormatter("worker", 99, true, device).clone());
    cloned.logger->info("serving");
    for (const CapturedLogger* c : {&captured, &cloned}) {
      const std::vector<std::string> lines = c->Lines();
      ASSERT_EQ(lines.size(), 1u);
      google::protobuf::Struct object;
      ASSERT_NO_FATAL_FAILURE(CheckLine(lines[0], "worker", 99, device, &object));
      EXPECT_THAT(lines[0], HasSubstr(absl::StrCat(R"("process":"worker","pid":99,"device":)",
                                                   device, R"(,"msg":"serving"})")));
    }
  }
}

TEST(LogFormatTest, TimestampsFollowTheClockAcrossSeconds) {
  JsonLogFormatter json("frontend", 1, false, 0);
  const std::vector<int64_t> times_ms = {1709251199998, 1709251199999, 1709251200000,
                                         1709251200001, 1709251199999, 1709251261234};
  const std::vector<std::string> expected = {
      "2024-02-29T23:59:59.998Z", "2024-02-29T23:59:59.999Z", "2024-03-01T00:00:00.000Z",
      "2024-03-01T00:00:00.001Z", "2024-02-29T23:59:59.999Z", "2024-03-01T00:01:01.234Z"};
  for (size_t i = 0; i < times_ms.size(); ++i) {
    spdlog::details::log_msg msg(
        std::chrono::system_clock::time_point(std::chrono::milliseconds(times_ms[i])),
        spdlog::source_loc{}, "test", spdlog::level::info, "m");
    spdlog::memory_buf_t out;
    json.format(msg, out);
    const std::string line(out.data(), out.size());
    EXPECT_EQ(line,
              absl::StrCat("{\"ts\":\"", expected[i],
                           R"(","level":"info","process":"frontend","pid":1,"msg":"m"})", "\n"));
  }
}

// InstallProcessLogger in JSON mode, with the process's stderr redirected to a file: spdlog's
// lines and gRPC's own (gpr_log) come out as JSON lines.
TEST(LogFormatTest, ProcessLoggerRoutesGrpcLinesInJsonMode) {
  char path[] = "/tmp/gpurpc-log-format-test-XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  fflush(stderr);
  const int saved = dup(2);
  ASSERT_GE(saved, 0);
  ASSERT_EQ(dup2(file, 2), 2);
  ProcessLogOptions options;
  options.logger_name = "json-test";
  options.process = "worker";
  options.with_device = true;
  options.device = 3;
  options.text_pattern = "unused %v";
  options.format = LogFormat::kJson;
  options.level = "debug";
  InstallProcessLogger(options);
  spdlog::info("hello \"world\"\nsecond line");
  spdlog::trace("below the level: not written");
  spdlog::debug("debug line");
  gpr_log_verbosity_init();  // what grpc_init does: until then gRPC logs nothing
  gpr_log(GPR_ERROR, "a gRPC error with \"quotes\"\nand a newline");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path);
  std::vector<std::string> lines = absl::StrSplit(text.str(), '\n');
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back(), "");
  lines.pop_back();
  ASSERT_EQ(lines.size(), 3u) << text.str();
  std::vector<std::string> messages;
  std::vector<std::string> levels;
  for (const std::string& line : lines) {
    google::protobuf::Struct object;
    ASSERT_NO_FATAL_FAILURE(CheckLine(line, "worker", getpid(), 3, &object));
    messages.push_back(Field(object, "msg")->string_value());
    levels.push_back(Field(object, "level")->string_value());
  }
  EXPECT_EQ(messages[0], "hello \"world\"\nsecond line");
  EXPECT_EQ(messages[1], "debug line");
  EXPECT_THAT(messages[2], ::testing::StartsWith("grpc "));
  EXPECT_THAT(messages[2], HasSubstr("log_format_test.cc:"));
  EXPECT_THAT(messages[2], ::testing::EndsWith(": a gRPC error with \"quotes\"\nand a newline"));
  EXPECT_EQ(levels, (std::vector<std::string>{"info", "debug", "error"}));
}

TEST(LogFormatTest, ProcessLoggerTextModeKeepsThePattern) {
  char path[] = "/tmp/gpurpc-log-format-test-XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  fflush(stderr);
  const int saved = dup(2);
  ASSERT_GE(saved, 0);
  ASSERT_EQ(dup2(file, 2), 2);
  ProcessLogOptions options;
  options.logger_name = "text-test";
  options.process = "frontend";
  options.text_pattern = "[%l] text: %v";
  options.format = LogFormat::kText;
  options.level = "info";
  InstallProcessLogger(options);
  spdlog::info("plain \"as is\"");
  spdlog::debug("below the level");
  spdlog::warn("w");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path);
  EXPECT_EQ(text.str(), "[info] text: plain \"as is\"\n[warning] text: w\n");
}

// The flag and the config field, through ParseDaemonOptions, and on to the workers.
absl::StatusOr<DaemonOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "gpurpcd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return ParseDaemonOptions(static_cast<int>(argv.size()), argv.data());
}

TEST(LogFormatTest, FlagAndConfigField) {
  auto defaults = Parse({});
  ASSERT_THAT(defaults.status(), IsOk());
  EXPECT_EQ(defaults->log_format, "text");
  auto json = Parse({"--log-format=json"});
  ASSERT_THAT(json.status(), IsOk());
  EXPECT_EQ(json->log_format, "json");
  EXPECT_THAT(Parse({"--log-format=bogus"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--log-format: 'bogus' is not text or json")));
  EXPECT_THAT(Parse({"--log-format"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--log-format")));
  EXPECT_THAT(DaemonUsage(), HasSubstr("--log-format=FORMAT"));

  char path[] = "/tmp/gpurpc-log-format-config-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "log_format: \"json\"\n";
  auto from_file = Parse({absl::StrCat("--config=", path)});
  ASSERT_THAT(from_file.status(), IsOk());
  EXPECT_EQ(from_file->log_format, "json");
  auto overridden = Parse({absl::StrCat("--config=", path), "--log-format=text"});
  ASSERT_THAT(overridden.status(), IsOk());
  EXPECT_EQ(overridden->log_format, "text");
  std::ofstream(path, std::ios::trunc) << "log_format: \"xml\"\n";
  EXPECT_THAT(Parse({absl::StrCat("--config=", path)}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("field log_format: --log-format: 'xml' is not text or json")));
  unlink(path);

  // A worker is started with the front end's format and parses it back.
  const std::vector<std::string> args = WorkerArgs(*json, 0, 3);
  EXPECT_THAT(args, ::testing::Contains("--log-format=json"));
  auto worker = Parse(args);
  ASSERT_THAT(worker.status(), IsOk());
  EXPECT_TRUE(worker->internal_worker);
  EXPECT_EQ(worker->log_format, "json");
  EXPECT_THAT(WorkerArgs(*defaults, 0, 3), ::testing::Contains("--log-format=text"));
}

}  // namespace
}  // namespace gpurpc
