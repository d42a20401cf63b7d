// gpurpcd's command line: one table of flags, parsed for the front end and handed on to
// worker processes. No global flag registry: the parsed values live in DaemonOptions.
#ifndef GPURPC_SERVER_OPTIONS_H_
#define GPURPC_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace gpurpc {

struct DaemonOptions {
  // Front end.
  std::string listen = "127.0.0.1:50051";
  std::string unix_socket;
  std::string backend = "auto";  // auto | cuda | fake
  absl::Duration session_idle_timeout = absl::Seconds(60);
  int warm_workers = 1;
  int max_sessions = 64;
  std::string log_level = "info";
  // Handed to workers.
  std::string cache_dir;  // "" = $XDG_CACHE_HOME/gpurpc or ~/.cache/gpurpc
  uint64_t cache_max_bytes = 1ull << 30;
  uint64_t fake_memory_bytes = 8ull << 30;
  std::string cuda_include_dir = "/usr/local/cuda/include";
  // Internal: set when this process is a worker started by the front end.
  bool internal_worker = false;
  int worker_fd = -1;
  int device = -1;  // -1 = inventory worker (lists devices, opens no context)

  bool help = false;
};

// Parses argv. INVALID_ARGUMENT names the bad flag or value.
absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv);
// The --help text, every user-facing flag with its default.
std::string DaemonUsage();
// The flags a worker for `device` is started with (everything it needs, explicitly).
std::vector<std::string> WorkerArgs(const DaemonOptions& options, int device, int fd);

}  // namespace gpurpc

#endif  // GPURPC_SERVER_OPTIONS_H_
