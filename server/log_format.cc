#include "server/log_format.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/log.h"
#include "spdlog/details/os.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace gpurpc {
namespace {

// U+FFFD REPLACEMENT CHARACTER in UTF-8.
constexpr char kReplacement[] = "\xEF\xBF\xBD";

bool IsContinuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// The level names of the JSON lines (those of spdlog's text lines, `%l`).
absl::string_view LevelName(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace:
      return "trace";
    case spdlog::level::debug:
      return "debug";
    case spdlog::level::info:
      return "info";
    case spdlog::level::warn:
      return "warning";
    case spdlog::level::err:
      return "error";
    case spdlog::level::critical:
      return "critical";
    default:
      return "off";
  }
}

// Where gRPC's own log lines go in JSON mode: a logger kept alive for good (gRPC's threads may
// log while the process exits, after spdlog's registry is gone), in KeptLoggers.
std::atomic<spdlog::logger*> grpc_logger{nullptr};

// Every logger gRPC's lines were ever routed to, never destroyed; reachable, so that a leak
// checker does not count it.
void KeepForGrpc(std::shared_ptr<spdlog::logger> logger) {
  static auto* const mu = new absl::Mutex;  // guards *kept
  static auto* const kept ABSL_PT_GUARDED_BY(mu) = new std::vector<std::shared_ptr<spdlog::logger>>;
  absl::MutexLock lock(mu);
  kept->push_back(logger);
  grpc_logger.store(logger.get(), std::memory_order_release);
}

void GrpcLogToSpdlog(gpr_log_func_args* args) {
  spdlog::logger* logger = grpc_logger.load(std::memory_order_acquire);
  if (logger == nullptr) return;
  spdlog::level::level_enum level = spdlog::level::info;
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      level = spdlog::level::debug;
      break;
    case GPR_LOG_SEVERITY_INFO:
      level = spdlog::level::info;
      break;
    case GPR_LOG_SEVERITY_ERROR:
      level = spdlog::level::err;
      break;
  }
  logger->log(level, "grpc {}:{}: {}", args->file != nullptr ? args->file : "?", args->line,
              args->message != nullptr ? args->message : "");
}

}  // namespace

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrFormat("--log-format: '%s' is not text or json", name));
}

void AppendJsonString(absl::string_view text, std::string& out) {
  out.reserve(out.size() + text.size() + 2);
  out.push_back('"');
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    const unsigned char byte = bytes[i];
    if (byte < 0x80) {
      switch (byte) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\b':
          out += "\\b";
          break;
        case '\f':
          out += "\\f";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (byte < 0x20 || byte == 0x7F) {
            absl::StrAppendFormat(&out, "\\u%04x", byte);
          } else {
            out.push_back(static_cast<char>(byte));
          }
      }
      ++i;
      continue;
    }
    // A multi-byte sequence: its length and the range of its second byte (Unicode's table
    // of well-formed UTF-8, which leaves out overlong forms, surrogates and > U+10FFFF).
    size_t length = 0;
    unsigned char low = 0x80;
    unsigned char high = 0xBF;
    if (byte >= 0xC2 && byte <= 0xDF) {
      length = 2;
    } else if (byte == 0xE0) {
      length = 3;
      low = 0xA0;
    } else if (byte >= 0xE1 && byte <= 0xEC) {
      length = 3;
    } else if (byte == 0xED) {
      length = 3;
      high = 0x9F;
    } else if (byte >= 0xEE && byte <= 0xEF) {
      length = 3;
    } else if (byte == 0xF0) {
      length = 4;
      low = 0x90;
    } else if (byte >= 0xF1 && byte <= 0xF3) {
      length = 4;
    } else if (byte == 0xF4) {
      length = 4;
      high = 0x8F;
    }
    if (length == 0) {  // a stray continuation byte, C0, C1 or F5..FF
      out += kReplacement;
      ++i;
      continue;
    }
    // How much of the sequence is well formed: the lead byte and then each byte in range.
    size_t good = 1;
    if (i + 1 < size && bytes[i + 1] >= low && bytes[i + 1] <= high) {
      good = 2;
      while (good < length && i + good < size && IsContinuation(bytes[i + good])) ++good;
    }
    if (good == length) {
      out.append(text.data() + i, length);
    } else {
      out += kReplacement;  // one for the maximal ill-formed subpart
    }
    i += good;
  }
  out.push_back('"');
}

std::string Rfc3339Millis(std::chrono::system_clock::time_point time) {
  const auto since_epoch = time.time_since_epoch();
  const auto seconds = std::chrono::floor<std::chrono::seconds>(since_epoch);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch - seconds).count();
  const std::time_t t = static_cast<std::time_t>(seconds.count());
  std::tm tm{};
  gmtime_r(&t, &tm);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                         tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(millis));
}

JsonLogFormatter::JsonLogFormatter(std::string process, pid_t pid, bool with_device, int device)
    : process_(std::move(process)), pid_(pid), with_device_(with_device), device_(device) {
  fixed_ = ",\"process\":";
  AppendJsonString(process_, fixed_);
  absl::StrAppend(&fixed_, ",\"pid\":", pid_);
  if (with_device_) absl::StrAppend(&fixed_, ",\"device\":", device_);
  fixed_ += ",\"msg\":";
}

void JsonLogFormatter::format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) {
  const auto since_epoch = msg.time.time_since_epoch();
  const int64_t second = std::chrono::floor<std::chrono::seconds>(since_epoch).count();
  if (second != cached_second_) {
    // "YYYY-MM-DDTHH:MM:SS" of this second; the milliseconds are added per record.
    const std::string full = Rfc3339Millis(msg.time);
    cached_prefix_ = full.substr(0, full.size() - 5);
    cached_second_ = second;
  }
  const int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() - second * 1000);
  scratch_.clear();
  absl::StrAppend(&scratch_, "{\"ts\":\"", cached_prefix_);
  absl::StrAppendFormat(&scratch_, ".%03dZ\",\"level\":\"", millis);
  absl::StrAppend(&scratch_, LevelName(msg.level), "\"", fixed_);
  AppendJsonString(absl::string_view(msg.payload.data(), msg.payload.size()), scratch_);
  scratch_ += "}";
  scratch_ += spdlog::details::os::default_eol;
  dest.append(scratch_.data(), scratch_.data() + scratch_.size());
}

std::unique_ptr<spdlog::formatter> JsonLogFormatter::clone() const {
  return std::make_unique<JsonLogFormatter>(process_, pid_, with_device_, device_);
}

std::shared_ptr<spdlog::logger> InstallProcessLogger(const ProcessLogOptions& options) {
  std::shared_ptr<spdlog::logger> logger;
  if (options.format == LogFormat::kJson) {
    // No colours: nothing but the JSON object may be on the line.
    logger = std::make_shared<spdlog::logger>(options.logger_name,
                                              std::make_shared<spdlog::sinks::stderr_sink_mt>());
    logger->set_formatter(std::make_unique<JsonLogFormatter>(options.process, getpid(),
                                                             options.with_device, options.device));
  } else {
    logger = std::make_shared<spdlog::logger>(
        options.logger_name, std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    logger->set_pattern(options.text_pattern);
  }
  logger->set_level(spdlog::level::from_str(options.level));
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(options.level));
  if (options.format == LogFormat::kJson) {
    KeepForGrpc(logger);
    gpr_set_log_function(GrpcLogToSpdlog);
  }
  return logger;
}

}  // namespace gpurpc
