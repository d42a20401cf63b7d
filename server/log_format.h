// How gpurpcd's processes write their logs (--log-format): the front end and its workers each
// log with spdlog to stderr, either as text for people or, with --log-format=json, as one
// JSON object per line for log collectors:
//
//   {"ts":"2024-05-01T12:34:56.789Z","level":"info","process":"worker","pid":4242,
//    "device":0,"msg":"..."}
//
// `ts` is the UTC time in RFC 3339 with milliseconds; `level` one of trace, debug, info,
// warning, error, critical; `process` "frontend" or "worker"; `device` only on workers' lines
// (-1 for the inventory worker, which opens no device); `msg` the message as a JSON string:
// quotes, backslashes and every control character escaped, invalid UTF-8 replaced by U+FFFD,
// so that a message with newlines still makes one line. In JSON mode gRPC's own log lines
// (gpr_log) go through the same logger, so every line the process writes to stderr is JSON.
#ifndef GPURPC_SERVER_LOG_FORMAT_H_
#define GPURPC_SERVER_LOG_FORMAT_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spdlog/formatter.h"
#include "spdlog/logger.h"

namespace gpurpc {

enum class LogFormat { kText, kJson };

// "text" or "json"; INVALID_ARGUMENT naming --log-format otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);

// Appends `text` to `out` as a JSON string literal, quotes included: `"` and `\` escaped, the
// control characters U+0000 to U+001F and U+007F escaped (\b \f \n \r \t, else \u00XX), valid
// UTF-8 copied as is, and each maximal ill-formed subsequence (a stray continuation byte, a
// truncated sequence, an overlong form, a surrogate, a code point above U+10FFFF) replaced
// by one U+FFFD.
void AppendJsonString(absl::string_view text, std::string& out);

// Formats a UTC time as RFC 3339 with milliseconds and "Z": "2024-05-01T12:34:56.789Z".
std::string Rfc3339Millis(std::chrono::system_clock::time_point time);

// An spdlog formatter writing each record as one JSON line (see the top of this file).
class JsonLogFormatter final : public spdlog::formatter {
 public:
  // `process` is the "process" field; `device` is written only when `with_device`.
  JsonLogFormatter(std::string process, pid_t pid, bool with_device, int device);

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override;
  std::unique_ptr<spdlog::formatter> clone() const override;

 private:
  const std::string process_;
  const pid_t pid_;
  const bool with_device_;
  const int device_;
  // The fields that never change, `,"process":...,"pid":N[,"device":N],"msg":`.
  std::string fixed_;
  // The last second formatted, "YYYY-MM-DDTHH:MM:SS", and which second it was.
  int64_t cached_second_ = INT64_MIN;
  std::string cached_prefix_;
  std::string scratch_;
};

// What InstallProcessLogger sets up.
struct ProcessLogOptions {
  std::string logger_name;   // spdlog's name for the logger ("gpurpcd", "worker")
  std::string process;       // the JSON "process" field: "frontend" or "worker"
  bool with_device = false;  // workers: write "device"
  int device = -1;
  std::string text_pattern;  // spdlog pattern of --log-format=text
  LogFormat format = LogFormat::kText;
  std::string level = "info";  // --log-level
};

// Makes the process's default spdlog logger, writing to stderr in the chosen format at the
// chosen level. In JSON mode gRPC's log lines are routed to it as well (their file and line
// in front of the message). Returns the logger (also spdlog's default from now on).
std::shared_ptr<spdlog::logger> InstallProcessLogger(const ProcessLogOptions& options);

}  // namespace gpurpc

#endif  // GPURPC_SERVER_LOG_FORMAT_H_
