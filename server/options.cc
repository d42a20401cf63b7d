#include "server/options.h"

#include <cstdlib>
#include <functional>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gpurpc {
namespace {

struct Flag {
  const char* name;
  const char* value_name;  // nullptr for internal flags, which --help does not list
  const char* help;
  std::function<absl::Status(DaemonOptions&, const std::string&)> set;
};

absl::Status ParseU64(const std::string& name, const std::string& value, uint64_t* out) {
  if (!absl::SimpleAtoi(value, out)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s: '%s' is not a non-negative integer", name, value));
  }
  return absl::OkStatus();
}

absl::Status ParseInt(const std::string& name, const std::string& value, int min, int* out) {
  if (!absl::SimpleAtoi(value, out) || *out < min) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s: '%s' is not an integer >= %d", name, value, min));
  }
  return absl::OkStatus();
}

const std::vector<Flag>& Flags() {
  static const auto* flags = new std::vector<Flag>{
      {"listen", "HOST:PORT",
       "TCP address to serve on (default 127.0.0.1:50051); empty disables TCP",
       [](DaemonOptions& o, const std::string& v) {
         o.listen = v;
         return absl::OkStatus();
       }},
      {"unix-socket", "PATH", "also serve on this unix socket (default: none)",
       [](DaemonOptions& o, const std::string& v) {
         o.unix_socket = v;
         return absl::OkStatus();
       }},
      {"backend", "auto|cuda|fake",
       "device backend (default auto: cuda when a driver and a device exist, else a startup "
       "error); fake is a host-memory test double, not a GPU",
       [](DaemonOptions& o, const std::string& v) {
         if (v != "auto" && v != "cuda" && v != "fake") {
           return absl::InvalidArgumentError(
               absl::StrFormat("--backend: '%s' is not one of auto, cuda, fake", v));
         }
         o.backend = v;
         return absl::OkStatus();
       }},
      {"session-idle-timeout", "DURATION",
       "reclaim a session with no call and no keepalive for this long, e.g. 30s, 5m "
       "(default 60s)",
       [](DaemonOptions& o, const std::string& v) {
         absl::Duration d;
         if (!absl::ParseDuration(v, &d) || d <= absl::ZeroDuration()) {
           return absl::InvalidArgumentError(absl::StrFormat(
               "--session-idle-timeout: '%s' is not a positive duration such as 30s", v));
         }
         o.session_idle_timeout = d;
         return absl::OkStatus();
       }},
      {"warm-workers", "N",
       "worker processes kept started per device so that opening a session skips context "
       "creation (default 1)",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("warm-workers", v, 0, &o.warm_workers);
       }},
      {"max-sessions", "N", "most sessions open at once (default 64)",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("max-sessions", v, 1, &o.max_sessions);
       }},
      {"cache-dir", "PATH",
       "NVRTC compile cache shared by all sessions (default $XDG_CACHE_HOME/gpurpc or "
       "~/.cache/gpurpc)",
       [](DaemonOptions& o, const std::string& v) {
         o.cache_dir = v;
         return absl::OkStatus();
       }},
      {"cache-max-bytes", "N", "size bound of the on-disk compile cache (default 1 GiB)",
       [](DaemonOptions& o, const std::string& v) {
         return ParseU64("cache-max-bytes", v, &o.cache_max_bytes);
       }},
      {"fake-memory-bytes", "N", "device memory the fake backend reports (default 8 GiB)",
       [](DaemonOptions& o, const std::string& v) {
         return ParseU64("fake-memory-bytes", v, &o.fake_memory_bytes);
       }},
      {"cuda-include-dir", "PATH",
       "CUDA toolkit headers offered to NVRTC compiles (default /usr/local/cuda/include)",
       [](DaemonOptions& o, const std::string& v) {
         o.cuda_include_dir = v;
         return absl::OkStatus();
       }},
      {"log-level", "LEVEL", "trace, debug, info, warn or error (default info)",
       [](DaemonOptions& o, const std::string& v) {
         static const char* kLevels[] = {"trace", "debug", "info", "warn", "error"};
         for (const char* level : kLevels) {
           if (v == level) {
             o.log_level = v;
             return absl::OkStatus();
           }
         }
         return absl::InvalidArgumentError(absl::StrFormat(
             "--log-level: '%s' is not one of trace, debug, info, warn, error", v));
       }},
      {"internal-worker", nullptr, "",
       [](DaemonOptions& o, const std::string&) {
         o.internal_worker = true;
         return absl::OkStatus();
       }},
      {"worker-fd", nullptr, "",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("worker-fd", v, 0, &o.worker_fd);
       }},
      {"device", nullptr, "",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("device", v, -1, &o.device);
       }},
  };
  return *flags;
}

}  // namespace

absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv) {
  DaemonOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      options.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unexpected argument '%s' (flags look like --name=value)", arg));
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      has_value = true;
    }
    const Flag* flag = nullptr;
    for (const Flag& f : Flags()) {
      if (name == f.name) flag = &f;
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown flag --%s (see --help)", name));
    }
    if (!has_value && name != "internal-worker") {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrFormat("--%s needs a value", name));
      }
      value = argv[++i];
    }
    if (absl::Status status = flag->set(options, value); !status.ok()) return status;
  }
  if (options.cache_dir.empty()) {
    if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
      options.cache_dir = absl::StrCat(xdg, "/gpurpc");
    } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
      options.cache_dir = absl::StrCat(home, "/.cache/gpurpc");
    }
  }
  if (options.internal_worker && options.worker_fd < 0) {
    return absl::InvalidArgumentError("--internal-worker needs --worker-fd");
  }
  if (!options.internal_worker && options.listen.empty() && options.unix_socket.empty()) {
    return absl::InvalidArgumentError("nothing to serve on: --listen is empty and no "
                                      "--unix-socket was given");
  }
  return options;
}

std::string DaemonUsage() {
  std::string out =
      "gpurpcd: serves NVIDIA GPUs over gRPC (gpurpc.v1): device memory, NVRTC compiles and\n"
      "stream-ordered kernel launches. Each session runs in its own worker process.\n\n"
      "Usage: gpurpcd [--flag=value ...]\n\nFlags:\n";
  for (const Flag& flag : Flags()) {
    if (flag.value_name == nullptr) continue;
    absl::StrAppendFormat(&out, "  --%s=%s\n      %s\n", flag.name, flag.value_name, flag.help);
  }
  out += "  --help\n      print this text\n";
  return out;
}

std::vector<std::string> WorkerArgs(const DaemonOptions& options, int device, int fd) {
  return {"--internal-worker",
          absl::StrCat("--worker-fd=", fd),
          absl::StrCat("--device=", device),
          absl::StrCat("--backend=", options.backend),
          absl::StrCat("--cache-dir=", options.cache_dir),
          absl::StrCat("--cache-max-bytes=", options.cache_max_bytes),
          absl::StrCat("--fake-memory-bytes=", options.fake_memory_bytes),
          absl::StrCat("--cuda-include-dir=", options.cuda_include_dir),
          absl::StrCat("--log-level=", options.log_level)};
}

}  // namespace gpurpc
