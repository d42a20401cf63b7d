// gpurpcd's command line: one table of flags, parsed for the front end and handed on to
// worker processes. No global flag registry: the parsed values live in DaemonOptions.
#ifndef GPURPC_SERVER_OPTIONS_H_
#define GPURPC_SERVER_OPTIONS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gpurpc/v1/device_service.pb.h"

namespace gpurpc {

struct DaemonOptions {
  // Front end. With no authentication configured the daemon serves only its Unix socket.
  std::string config_file;  // --config: a DaemonConfig in text format, applied before flags
  std::string listen;       // TCP; "" = none
  std::string unix_socket;  // "" = none; defaults to DefaultUnixSocket()
  uint32_t unix_socket_mode = 0660;
  // Where same-host clients attach their regions' memfds (host_region_service.proto), with
  // the Unix socket's mode. "auto" (resolved by ParseDaemonOptions) = beside the Unix socket,
  // "gpurpcd.sock" -> "gpurpcd-regions.sock"; "" = none (RegisterHostRegion is then
  // FAILED_PRECONDITION).
  std::string region_socket = "auto";
  // Why the "auto" region socket was left out (its path would be too long), for the log.
  std::string region_socket_note;
  // Same-host regions one session may hold (pinned host memory), bytes; 0 = no limit.
  uint64_t max_host_region_bytes = 16ull << 30;
  std::string health_listen;  // grpc.health.v1 + reflection only, no credentials; "" = none
  // Prometheus metrics over plain HTTP, GET /metrics only, no credentials (docs/METRICS.md):
  // HOST:PORT or [IPV6]:PORT; "" = none.
  std::string metrics_listen;
  // Authentication (TCP). The Unix socket's tenant is always the peer's user.
  std::string tokens_file;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;  // set = request and verify client certificates (mTLS)
  bool insecure = false;      // accept TCP without TLS off loopback / without any credentials
  std::vector<std::string> admin_tenants;
  // Quotas: the default for every tenant, and per-tenant overrides (config file only).
  v1::TenantQuota default_quota = DefaultQuota();
  std::map<std::string, v1::TenantQuota> tenant_quotas;
  // --new-token=TENANT: print a new token and its tokens-file line, then exit.
  std::string new_token_tenant;

  std::string backend = "auto";  // auto | cuda | fake
  absl::Duration session_idle_timeout = absl::Seconds(60);
  // How long a session outlives the last WatchSession stream of its client (session_service
  // .proto) with no call in flight.
  absl::Duration session_grace = absl::Seconds(10);
  // After SIGTERM (or SIGINT): how long open sessions may go on before the workers are
  // stopped; new sessions are refused meanwhile. Below Kubernetes' default 30 s grace.
  absl::Duration drain_timeout = absl::Seconds(20);
  // How the front end relays command streams to workers: "framed" or "grpc".
  std::string command_relay = "framed";
  int warm_workers = 1;
  int max_sessions = 64;
  std::string log_level = "info";
  // "text" (for people) or "json" (one JSON object per line, for log collectors; see
  // server/log_format.h). Handed to workers, so that their lines are in the same format.
  std::string log_format = "text";
  // Handed to workers.
  std::string cache_dir;  // "" = $XDG_CACHE_HOME/gpurpc or ~/.cache/gpurpc
  // The compile cache's MAC key (32 bytes, mode 0600; created when missing). "" = the cache
  // dir's path with ".key" appended, beside it. Workers read it themselves: the key itself
  // is never passed on a command line.
  std::string cache_key_file;
  uint64_t cache_max_bytes = 1ull << 30;
  uint64_t fake_memory_bytes = 8ull << 30;
  int fake_devices = 1;  // devices the fake backend serves, 1 to 16
  std::string cuda_include_dir = "/usr/local/cuda/include";
  // NVRTC compile helpers (server/worker/compiler/sandbox.h).
  std::string compile_sandbox = "auto";  // auto | landlock | namespace | none
  bool allow_unsandboxed_compile = false;
  absl::Duration compile_timeout = absl::Seconds(60);
  uint64_t compile_cpu_seconds = 60;
  uint64_t compile_memory_bytes = 8ull << 30;
  // Internal: set when this process is a worker started by the front end.
  bool internal_worker = false;
  int worker_fd = -1;
  // The worker writes why it ends itself (the kernel watchdog) here before it exits; the
  // front end reads it when the worker is reaped. -1 = none.
  int worker_status_fd = -1;
  // The worker's end of its region channel with the front end (host_region.h); -1 = none.
  int worker_region_fd = -1;
  // The worker's end of its relay channel (host_region.h, RelayChannel): the front end sends
  // one socket end per relayed command stream on it. -1 = none.
  int worker_relay_fd = -1;
  int device = -1;  // -1 = inventory worker (lists devices, opens no context)
  // Internal: set when this process is a compile helper started by a worker (its socket is
  // fd 3; everything else comes over it, see compile_helper.h).
  bool internal_compile_helper = false;

  bool help = false;

  // The quota every tenant has unless the configuration says otherwise.
  static v1::TenantQuota DefaultQuota();
  // `tenant`'s quota: the default with the tenant's overrides merged in.
  v1::TenantQuota QuotaFor(const std::string& tenant) const;
};

// Where the daemon listens when --unix-socket is not given:
// $XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock, else /run/gpurpc/gpurpcd.sock for root, else
// /tmp/gpurpc-<uid>/gpurpcd.sock. The clients look in the same places.
std::string DefaultUnixSocket();
// Tenant names appear in logs, metrics and the admin API: 1 to 128 of
// A-Z a-z 0-9 . _ @ + - = , (so a user name, a token's tenant or a certificate's CN).
bool IsTenantName(absl::string_view name);
// True for "localhost:N", "127.x.y.z:N" and "[::1]:N".
bool IsLoopbackAddress(const std::string& address);
// Splits "HOST:PORT" or "[IPV6]:PORT" (HOST a name or a numeric address, not empty; PORT a
// decimal 0 to 65535). INVALID_ARGUMENT naming `what` (the flag) and the address otherwise.
absl::Status ParseHostPort(const std::string& what, const std::string& address,
                           std::string* host = nullptr, int* port = nullptr);

// Parses argv: first the --config file when one is named, then every flag, so that flags
// override the file. INVALID_ARGUMENT names the bad flag, field or value (with the file's
// line and column for a syntax error); NOT_FOUND when the config file cannot be read.
absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv);
// The --help text, every user-facing flag with its default.
std::string DaemonUsage();
// The flags a worker for `device` is started with (everything it needs, explicitly). Its
// gRPC socket is `fd`, its status pipe (worker_status_fd) `fd + 1`, its region channel
// (worker_region_fd) `fd + 2`, its relay channel (worker_relay_fd) `fd + 3`.
std::vector<std::string> WorkerArgs(const DaemonOptions& options, int device, int fd);

}  // namespace gpurpc

#endif  // GPURPC_SERVER_OPTIONS_H_
