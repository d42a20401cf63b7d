#include "server/options.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "gpurpc/config/v1/daemon_config.pb.h"
#include "server/log_format.h"

namespace gpurpc {
namespace {

struct Flag {
  const char* name;
  const char* value_name;  // nullptr for internal flags, which --help does not list
  const char* help;
  std::function<absl::Status(DaemonOptions&, const std::string&)> set;
  bool boolean = false;  // takes no value, or =true / =false
};

absl::Status ParseBool(const std::string& name, const std::string& value, bool* out) {
  if (value == "true" || value == "1") {
    *out = true;
  } else if (value == "false" || value == "0") {
    *out = false;
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s: '%s' is not true or false", name, value));
  }
  return absl::OkStatus();
}

absl::Status ParseU32(const std::string& name, const std::string& value, uint32_t* out) {
  if (!absl::SimpleAtoi(value, out)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s: '%s' is not a non-negative 32-bit integer", name, value));
  }
  return absl::OkStatus();
}

absl::Status CheckTenantName(const std::string& what, const std::string& name) {
  if (!IsTenantName(name)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: '%s' is not a tenant name (1 to 128 of A-Z a-z 0-9 . _ @ + - = ,)", what, name));
  }
  return absl::OkStatus();
}

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
      {"config", "PATH",
       "configuration file (protobuf text format, see deploy/config/gpurpcd.conf); flags "
       "override it",
       [](DaemonOptions& o, const std::string& v) {
         o.config_file = v;
         return absl::OkStatus();
       }},
      {"listen", "HOST:PORT",
       "TCP address to serve on (default: none). Needs --tokens-file or --tls-client-ca, and "
       "TLS (--tls-cert) unless the address is loopback; --insecure overrides both",
       [](DaemonOptions& o, const std::string& v) {
         o.listen = v;
         return absl::OkStatus();
       }},
      {"unix-socket", "PATH",
       "unix socket to serve on; its clients are known by their user (default "
       "$XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock, else /run/gpurpc/gpurpcd.sock as root, else "
       "/tmp/gpurpc-UID/gpurpcd.sock); empty disables it",
       [](DaemonOptions& o, const std::string& v) {
         o.unix_socket = v;
         return absl::OkStatus();
       }},
      {"unix-socket-mode", "OCTAL",
       "permissions of the unix socket (default 0660: the daemon's user and group)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t mode = 0;
         if (v.empty() || v.size() > 4 || v.find_first_not_of("01234567") != std::string::npos ||
             (mode = static_cast<uint32_t>(std::stoul(v, nullptr, 8))) > 0777) {
           return absl::InvalidArgumentError(
               absl::StrFormat("--unix-socket-mode: '%s' is not an octal mode such as 0660", v));
         }
         o.unix_socket_mode = mode;
         return absl::OkStatus();
       }},
      {"region-socket", "PATH",
       "where same-host clients attach shared-memory regions (SOCK_SEQPACKET; the unix "
       "socket's mode); default: beside the unix socket (gpurpcd.sock -> "
       "gpurpcd-regions.sock); empty disables regions",
       [](DaemonOptions& o, const std::string& v) {
         if (!v.empty() && v != "auto" && v.front() != '/') {
           return absl::InvalidArgumentError(
               absl::StrFormat("--region-socket: '%s' is not an absolute path", v));
         }
         o.region_socket = v;
         return absl::OkStatus();
       }},
      {"max-host-region-bytes", "N",
       "same-host regions (pinned host memory) one session may hold (default 16 GiB; 0: no "
       "limit)",
       [](DaemonOptions& o, const std::string& v) {
         return ParseU64("max-host-region-bytes", v, &o.max_host_region_bytes);
       }},
      {"health-listen", "ADDRESS",
       "separate listener for grpc.health.v1 and reflection only, needing no credentials "
       "(HOST:PORT or unix:PATH; default: none)",
       [](DaemonOptions& o, const std::string& v) {
         o.health_listen = v;
         return absl::OkStatus();
       }},
      {"metrics-listen", "HOST:PORT",
       "serve Prometheus metrics over plain HTTP at GET /metrics on this address, e.g. "
       "127.0.0.1:9464 (no credentials, and the metrics name tenants; on a shared host loopback "
       "is not private: restrict it with a firewall or network policy, see docs/METRICS.md) "
       "(default: none)",
       [](DaemonOptions& o, const std::string& v) {
         if (!v.empty()) GPURPC_RETURN_IF_ERROR(ParseHostPort("--metrics-listen", v));
         o.metrics_listen = v;
         return absl::OkStatus();
       }},
      {"tokens-file", "PATH",
       "bearer tokens of TCP clients: lines 'tenant:salt_hex:sha256_hex' (see --new-token); "
       "reloaded on SIGHUP",
       [](DaemonOptions& o, const std::string& v) {
         o.tokens_file = v;
         return absl::OkStatus();
       }},
      {"tls-cert", "PEM", "TLS certificate (chain) of the TCP listener",
       [](DaemonOptions& o, const std::string& v) {
         o.tls_cert = v;
         return absl::OkStatus();
       }},
      {"tls-key", "PEM", "private key of --tls-cert",
       [](DaemonOptions& o, const std::string& v) {
         o.tls_key = v;
         return absl::OkStatus();
       }},
      {"tls-client-ca", "PEM",
       "CA bundle for client certificates (mutual TLS): a client presenting a certificate it "
       "signed is the tenant named by the certificate's common name",
       [](DaemonOptions& o, const std::string& v) {
         o.tls_client_ca = v;
         return absl::OkStatus();
       }},
      {"insecure", "",
       "allow a TCP listener without TLS on a non-loopback address, and without any "
       "credentials (every such client is the tenant 'anonymous'); logged loudly",
       [](DaemonOptions& o, const std::string& v) { return ParseBool("insecure", v, &o.insecure); },
       true},
      {"admin-tenants", "A,B", "tenants that may list and close every session (AdminService)",
       [](DaemonOptions& o, const std::string& v) {
         o.admin_tenants.clear();
         for (absl::string_view part : absl::StrSplit(v, ',', absl::SkipEmpty())) {
           GPURPC_RETURN_IF_ERROR(CheckTenantName("--admin-tenants", std::string(part)));
           o.admin_tenants.emplace_back(part);
         }
         return absl::OkStatus();
       }},
      {"new-token", "TENANT",
       "print a new random token for TENANT and its --tokens-file line, then exit",
       [](DaemonOptions& o, const std::string& v) {
         GPURPC_RETURN_IF_ERROR(CheckTenantName("--new-token", v));
         o.new_token_tenant = v;
         return absl::OkStatus();
       }},
      {"tenant-max-sessions", "N", "default quota: sessions a tenant may hold open (default 16)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t n;
         GPURPC_RETURN_IF_ERROR(ParseU32("tenant-max-sessions", v, &n));
         o.default_quota.set_max_sessions(n);
         return absl::OkStatus();
       }},
      {"tenant-max-device-memory-bytes", "N",
       "default quota: device memory a tenant's buffers may hold over all its sessions "
       "(default 0: no limit but the device's)",
       [](DaemonOptions& o, const std::string& v) {
         uint64_t n;
         GPURPC_RETURN_IF_ERROR(ParseU64("tenant-max-device-memory-bytes", v, &n));
         o.default_quota.set_max_device_memory_bytes(n);
         return absl::OkStatus();
       }},
      {"tenant-max-streams-per-session", "N", "default quota: streams per session (default 1024)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t n;
         GPURPC_RETURN_IF_ERROR(ParseU32("tenant-max-streams-per-session", v, &n));
         o.default_quota.set_max_streams_per_session(n);
         return absl::OkStatus();
       }},
      {"tenant-max-events-per-session", "N", "default quota: events per session (default 16384)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t n;
         GPURPC_RETURN_IF_ERROR(ParseU32("tenant-max-events-per-session", v, &n));
         o.default_quota.set_max_events_per_session(n);
         return absl::OkStatus();
       }},
      {"tenant-max-modules-per-session", "N",
       "default quota: modules loaded per session (default 1024)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t n;
         GPURPC_RETURN_IF_ERROR(ParseU32("tenant-max-modules-per-session", v, &n));
         o.default_quota.set_max_modules_per_session(n);
         return absl::OkStatus();
       }},
      {"tenant-max-concurrent-compiles", "N",
       "default quota: compiles of one tenant running at once (default 4)",
       [](DaemonOptions& o, const std::string& v) {
         uint32_t n;
         GPURPC_RETURN_IF_ERROR(ParseU32("tenant-max-concurrent-compiles", v, &n));
         o.default_quota.set_max_concurrent_compiles(n);
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
      {"session-grace", "DURATION",
       "reclaim a session this long after its client's last WatchSession stream ended (the "
       "client exited or its connection broke) with no call in flight (default 10s)",
       [](DaemonOptions& o, const std::string& v) {
         absl::Duration d;
         if (!absl::ParseDuration(v, &d) || d < absl::ZeroDuration()) {
           return absl::InvalidArgumentError(
               absl::StrFormat("--session-grace: '%s' is not a duration such as 10s", v));
         }
         o.session_grace = d;
         return absl::OkStatus();
       }},
      {"command-relay", "framed|grpc",
       "how the front end relays a session's command streams, unary calls and streamed "
       "transfers to its worker: framed (sockets of the worker's framed protocol, no gRPC "
       "between them: one per command stream, up to 8, up to 4 for unary calls, and one per "
       "UploadStream or DownloadStream, up to 8; the default) or grpc (a gRPC call to the "
       "worker for every call)",
       [](DaemonOptions& o, const std::string& v) {
         if (v != "framed" && v != "grpc") {
           return absl::InvalidArgumentError(
               absl::StrFormat("--command-relay: '%s' is neither framed nor grpc", v));
         }
         o.command_relay = v;
         return absl::OkStatus();
       }},
      {"drain-timeout", "DURATION",
       "on SIGTERM or SIGINT: health turns NOT_SERVING, new sessions are refused, and open "
       "sessions may go on this long before their workers are stopped; a second signal "
       "stops at once (default 20s: with the 5 s that stopping takes, under Kubernetes' 30 s "
       "grace)",
       [](DaemonOptions& o, const std::string& v) {
         absl::Duration d;
         if (!absl::ParseDuration(v, &d) || d < absl::ZeroDuration()) {
           return absl::InvalidArgumentError(
               absl::StrFormat("--drain-timeout: '%s' is not a duration such as 20s", v));
         }
         o.drain_timeout = d;
         return absl::OkStatus();
       }},
      {"kernel-timeout", "DURATION",
       "the kernel watchdog: a kernel running longer than this ends its session's worker "
       "(the session answers DEADLINE_EXCEEDED naming the kernel); 0 turns it off; a "
       "tenant's quota may override it (default 60s)",
       [](DaemonOptions& o, const std::string& v) {
         absl::Duration d;
         if (v == "0") {
           d = absl::ZeroDuration();
         } else if (!absl::ParseDuration(v, &d) || d < absl::ZeroDuration() ||
                    (d > absl::ZeroDuration() && d < absl::Milliseconds(1))) {
           return absl::InvalidArgumentError(absl::StrFormat(
               "--kernel-timeout: '%s' is not a duration of at least 1ms such as 60s (or 0 "
               "for no watchdog)",
               v));
         }
         o.default_quota.set_kernel_timeout_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(d)));
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
      {"cache-key-file", "PATH",
       "secret key (32 bytes, mode 0600, created when missing) that authenticates the compile "
       "cache's files (default: the cache dir's path with \".key\" appended, beside it)",
       [](DaemonOptions& o, const std::string& v) {
         o.cache_key_file = v;
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
      {"fake-devices", "N", "devices the fake backend serves, 1 to 16 (default 1)",
       [](DaemonOptions& o, const std::string& v) {
         int n = 0;
         if (!absl::SimpleAtoi(v, &n) || n < 1 || n > 16) {
           return absl::InvalidArgumentError(
               absl::StrFormat("--fake-devices: '%s' is not a count from 1 to 16", v));
         }
         o.fake_devices = n;
         return absl::OkStatus();
       }},
      {"cuda-include-dir", "PATH",
       "CUDA toolkit headers offered to NVRTC compiles (default /usr/local/cuda/include)",
       [](DaemonOptions& o, const std::string& v) {
         o.cuda_include_dir = v;
         return absl::OkStatus();
       }},
      {"compile-sandbox", "auto|landlock|namespace|none",
       "how the process that runs each NVRTC compile confines itself (default auto: "
       "landlock, else namespace, else none); a forced mode that cannot work here makes "
       "compiles fail with FAILED_PRECONDITION",
       [](DaemonOptions& o, const std::string& v) {
         if (v != "auto" && v != "landlock" && v != "namespace" && v != "none") {
           return absl::InvalidArgumentError(absl::StrFormat(
               "--compile-sandbox: '%s' is not one of auto, landlock, namespace, none", v));
         }
         o.compile_sandbox = v;
         return absl::OkStatus();
       }},
      {"allow-unsandboxed-compile", "",
       "run NVRTC unconfined when no compile sandbox works (or with --compile-sandbox=none); "
       "without it such compiles fail with FAILED_PRECONDITION",
       [](DaemonOptions& o, const std::string& v) {
         return ParseBool("allow-unsandboxed-compile", v, &o.allow_unsandboxed_compile);
       },
       true},
      {"compile-timeout", "DURATION",
       "wall time one NVRTC compile may take before it is killed (DEADLINE_EXCEEDED) "
       "(default 60s)",
       [](DaemonOptions& o, const std::string& v) {
         absl::Duration d;
         if (!absl::ParseDuration(v, &d) || d <= absl::ZeroDuration()) {
           return absl::InvalidArgumentError(absl::StrFormat(
               "--compile-timeout: '%s' is not a positive duration such as 60s", v));
         }
         o.compile_timeout = d;
         return absl::OkStatus();
       }},
      {"compile-cpu-seconds", "N",
       "CPU time one NVRTC compile may use (RESOURCE_EXHAUSTED beyond) (default 60)",
       [](DaemonOptions& o, const std::string& v) {
         GPURPC_RETURN_IF_ERROR(ParseU64("compile-cpu-seconds", v, &o.compile_cpu_seconds));
         if (o.compile_cpu_seconds == 0) {
           return absl::InvalidArgumentError("--compile-cpu-seconds: must be at least 1");
         }
         return absl::OkStatus();
       }},
      {"compile-memory-bytes", "N",
       "address space of the process running one NVRTC compile (RESOURCE_EXHAUSTED beyond); "
       "a small kernel needs about 160 MiB, one including curand_kernel.h about 260 MiB "
       "(default 8 GiB)",
       [](DaemonOptions& o, const std::string& v) {
         GPURPC_RETURN_IF_ERROR(ParseU64("compile-memory-bytes", v, &o.compile_memory_bytes));
         if (o.compile_memory_bytes < (64ull << 20)) {
           return absl::InvalidArgumentError(
               "--compile-memory-bytes: must be at least 67108864 (64 MiB)");
         }
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
         return absl::InvalidArgumentError(
             absl::StrFormat("--log-level: '%s' is not one of trace, debug, info, warn, error", v));
       }},
      {"log-format", "FORMAT",
       "text, or json: every line of the daemon and its workers one JSON object with ts "
       "(RFC 3339, UTC), level, process (frontend or worker), pid, device (workers) and msg "
       "(default text)",
       [](DaemonOptions& o, const std::string& v) {
         GPURPC_RETURN_IF_ERROR(ParseLogFormat(v).status());
         o.log_format = v;
         return absl::OkStatus();
       }},
      {"internal-worker", nullptr, "",
       [](DaemonOptions& o, const std::string&) {
         o.internal_worker = true;
         return absl::OkStatus();
       },
       true},
      {"internal-compile-helper", nullptr, "",
       [](DaemonOptions& o, const std::string&) {
         o.internal_compile_helper = true;
         return absl::OkStatus();
       },
       true},
      {"worker-fd", nullptr, "",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("worker-fd", v, 0, &o.worker_fd);
       }},
      {"worker-status-fd", nullptr, "",
       [](DaemonOptions& o, const std::string& v) {
         return ParseInt("worker-status-fd", v, -1, &o.worker_status_fd);
       }},
      {"worker-region-fd", nullptr, "",
       [](DaemonOptions& o,
          const std::string&
              v) { return ParseInt("worker-region-fd", v, -1, &o.worker_region_fd); }},
      {"worker-relay-fd", nullptr, "",
       [](DaemonOptions& o,
          const std::string& v) { return ParseInt("worker-relay-fd", v, -1, &o.worker_relay_fd); }},
      {"device", nullptr, "",
       [](DaemonOptions& o, const std::string& v) { return ParseInt("device", v, -1, &o.device); }},
  };
  return *flags;
}

const Flag* FindFlag(const std::string& name) {
  for (const Flag& f : Flags()) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

// Collects the text parser's errors with their line and column.
class ConfigErrors final : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    errors_.push_back(absl::StrFormat("line %d column %d: %s", line + 1, column + 1, message));
  }
  void AddWarning(int line, int column, const std::string& message) override {
    AddError(line, column, message);
  }
  std::string Text() const { return absl::StrJoin(errors_, "; "); }

 private:
  std::vector<std::string> errors_;
};

// Applies a DaemonConfig file: each scalar field through the flag of the same name (one
// table of settings, one set of checks), then the quotas.
absl::Status ApplyConfigFile(const std::string& path, DaemonOptions& options) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrFormat("--config: cannot read '%s'", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  config::v1::DaemonConfig config;
  google::protobuf::TextFormat::Parser parser;
  ConfigErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(absl::StrFormat("--config %s: %s", path, errors.Text()));
  }
  const google::protobuf::Reflection* reflection = config.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(config, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) continue;
    std::string flag_name = field->name();
    std::replace(flag_name.begin(), flag_name.end(), '_', '-');
    const Flag* flag = FindFlag(flag_name);
    if (flag == nullptr) {
      return absl::InternalError(absl::StrFormat("config field %s has no flag", field->name()));
    }
    std::string value;
    if (field->is_repeated()) {
      std::vector<std::string> items;
      for (int i = 0; i < reflection->FieldSize(config, field); ++i) {
        items.push_back(reflection->GetRepeatedString(config, field, i));
      }
      value = absl::StrJoin(items, ",");
    } else {
      google::protobuf::TextFormat::PrintFieldValueToString(config, field, -1, &value);
      if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
        value = reflection->GetString(config, field);
      }
    }
    if (absl::Status status = flag->set(options, value); !status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--config %s: field %s: %s", path, field->name(), status.message()));
    }
  }
  if (config.has_default_quota()) options.default_quota.MergeFrom(config.default_quota());
  for (const auto& [tenant, quota] : config.tenant_quotas()) {
    if (absl::Status status = CheckTenantName("tenant_quotas", tenant); !status.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("--config %s: %s", path, status.message()));
    }
    options.tenant_quotas[tenant] = quota;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv) {
  DaemonOptions options;
  options.unix_socket = DefaultUnixSocket();
  // The config file first (wherever --config appears), so that every flag overrides it.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--config=")) {
      options.config_file = arg.substr(9);
    } else if (arg == "--config" && i + 1 < argc) {
      options.config_file = argv[i + 1];
    }
  }
  if (!options.config_file.empty()) {
    GPURPC_RETURN_IF_ERROR(ApplyConfigFile(options.config_file, options));
  }
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
    const Flag* flag = FindFlag(name);
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("unknown flag --%s (see --help)", name));
    }
    if (!has_value && flag->boolean) {
      value = "true";
    } else if (!has_value) {
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
  if (options.region_socket == "auto") {
    options.region_socket.clear();
    if (!options.unix_socket.empty()) {
      // Clients get the region socket's path in answers and may run elsewhere: it is
      // absolute even beside a relative unix socket path (the daemon's working folder).
      std::string unix_socket = options.unix_socket;
      if (unix_socket.front() != '/') {
        char cwd[4096];
        unix_socket = getcwd(cwd, sizeof(cwd)) != nullptr && cwd[0] == '/'
                          ? absl::StrCat(cwd, "/", unix_socket)
                          : std::string();
      }
      if (unix_socket.empty()) {
        options.region_socket_note =
            "no region socket: the working folder is unknown, so no absolute path beside the "
            "relative unix socket path can be made; give --region-socket one";
      } else {
        options.region_socket =
            absl::EndsWith(unix_socket, ".sock")
                ? absl::StrCat(unix_socket.substr(0, unix_socket.size() - 5), "-regions.sock")
                : absl::StrCat(unix_socket, ".regions");
      }
      // A socket is bound under a temporary name 21 bytes longer (unix_listener.cc), and
      // sun_path holds 107: beside a long Unix socket path, go without regions rather than
      // fail to start.
      if (options.region_socket.size() + 21 > 107) {
        options.region_socket_note = absl::StrFormat(
            "no region socket: the path beside the unix socket (%s) would be too long for a "
            "socket; give --region-socket a shorter one",
            options.region_socket);
        options.region_socket.clear();
      }
    }
  }
  if (options.internal_worker && options.worker_fd < 0) {
    return absl::InvalidArgumentError("--internal-worker needs --worker-fd");
  }
  if (options.internal_worker || options.internal_compile_helper || options.help ||
      !options.new_token_tenant.empty()) {
    return options;
  }
  if (options.listen.empty() && options.unix_socket.empty()) {
    return absl::InvalidArgumentError(
        "nothing to serve on: --listen and --unix-socket are both empty");
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together: give both");
  }
  if (!options.tls_client_ca.empty() && options.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls-client-ca (mutual TLS) needs the server's own --tls-cert and --tls-key");
  }
  if (!options.listen.empty() && !options.insecure) {
    if (options.tokens_file.empty() && options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--listen=%s: a TCP listener needs a way to authenticate its clients: "
          "--tokens-file and/or --tls-client-ca (or --insecure, where every TCP client is the "
          "tenant 'anonymous')",
          options.listen));
    }
    if (options.tls_cert.empty() && !IsLoopbackAddress(options.listen)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--listen=%s is not a loopback address: without TLS (--tls-cert, --tls-key) tokens "
          "and data would cross the network in the clear; give a certificate, or --insecure",
          options.listen));
    }
  }
  return options;
}

bool IsTenantName(absl::string_view name) {
  return !name.empty() && name.size() <= 128 &&
         name.find_first_not_of(
             "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
             "._@+-=,") == absl::string_view::npos;
}

std::string DefaultUnixSocket() {
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR"); runtime != nullptr && *runtime == '/') {
    return absl::StrCat(runtime, "/gpurpc/gpurpcd.sock");
  }
  if (geteuid() == 0) return "/run/gpurpc/gpurpcd.sock";
  return absl::StrCat("/tmp/gpurpc-", geteuid(), "/gpurpcd.sock");
}

bool IsLoopbackAddress(const std::string& address) {
  std::string host = address;
  if (absl::StartsWith(host, "[")) {
    host = host.substr(
        1, host.find(']') == std::string::npos ? std::string::npos : host.find(']') - 1);
  } else if (size_t colon = host.rfind(':'); colon != std::string::npos) {
    host.resize(colon);
  }
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::Status ParseHostPort(const std::string& what, const std::string& address, std::string* host,
                           int* port) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: '%s' is not HOST:PORT or [IPV6]:PORT: %s", what, address, why));
  };
  std::string host_part;
  std::string port_part;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == std::string::npos) return bad("no ] after the IPv6 address");
    host_part = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') return bad("no :PORT");
    port_part = address.substr(close + 2);
    in6_addr v6;
    if (inet_pton(AF_INET6, host_part.c_str(), &v6) != 1) {
      return bad("the part in [] is not an IPv6 address");
    }
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no :PORT");
    host_part = address.substr(0, colon);
    port_part = address.substr(colon + 1);
    if (host_part.find(':') != std::string::npos) {
      return bad("an IPv6 address goes in brackets, as [::1]:9464");
    }
  }
  if (host_part.empty()) return bad("no host (0.0.0.0 means every IPv4 interface)");
  int number = -1;
  if (port_part.empty() || port_part.size() > 5 ||
      port_part.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port_part, &number) || number > 65535) {
    return bad("the port is not a number from 0 to 65535");
  }
  if (host != nullptr) *host = host_part;
  if (port != nullptr) *port = number;
  return absl::OkStatus();
}

v1::TenantQuota DaemonOptions::DefaultQuota() {
  v1::TenantQuota quota;
  quota.set_max_sessions(16);
  quota.set_max_device_memory_bytes(0);
  quota.set_max_streams_per_session(1024);
  quota.set_max_events_per_session(16384);
  quota.set_max_modules_per_session(1024);
  quota.set_max_concurrent_compiles(4);
  quota.set_kernel_timeout_ms(60'000);
  return quota;
}

v1::TenantQuota DaemonOptions::QuotaFor(const std::string& tenant) const {
  v1::TenantQuota quota = default_quota;
  if (auto it = tenant_quotas.find(tenant); it != tenant_quotas.end()) {
    quota.MergeFrom(it->second);  // proto3: only the fields the override sets (non-zero)
  }
  return quota;
}

std::string DaemonUsage() {
  std::string out =
      "gpurpcd: serves NVIDIA GPUs over gRPC (gpurpc.v1): device memory, NVRTC compiles and\n"
      "stream-ordered kernel launches. Each session runs in its own worker process.\n\n"
      "Usage: gpurpcd [--flag=value ...]\n\nFlags:\n";
  for (const Flag& flag : Flags()) {
    if (flag.value_name == nullptr) continue;
    if (flag.boolean) {
      absl::StrAppendFormat(&out, "  --%s\n      %s\n", flag.name, flag.help);
    } else {
      absl::StrAppendFormat(&out, "  --%s=%s\n      %s\n", flag.name, flag.value_name, flag.help);
    }
  }
  out += "  --help\n      print this text\n";
  return out;
}

std::vector<std::string> WorkerArgs(const DaemonOptions& options, int device, int fd) {
  return {"--internal-worker",
          absl::StrCat("--worker-fd=", fd),
          absl::StrCat("--worker-status-fd=", fd + 1),
          absl::StrCat("--worker-region-fd=", fd + 2),
          absl::StrCat("--worker-relay-fd=", fd + 3),
          absl::StrCat("--region-socket=", options.region_socket),
          absl::StrCat("--device=", device),
          absl::StrCat("--backend=", options.backend),
          absl::StrCat("--cache-dir=", options.cache_dir),
          absl::StrCat("--cache-key-file=", options.cache_key_file),
          absl::StrCat("--cache-max-bytes=", options.cache_max_bytes),
          absl::StrCat("--fake-memory-bytes=", options.fake_memory_bytes),
          absl::StrCat("--fake-devices=", options.fake_devices),
          absl::StrCat("--cuda-include-dir=", options.cuda_include_dir),
          absl::StrCat("--compile-sandbox=", options.compile_sandbox),
          absl::StrCat("--allow-unsandboxed-compile=",
                       options.allow_unsandboxed_compile ? "true" : "false"),
          absl::StrCat("--compile-timeout=", absl::FormatDuration(options.compile_timeout)),
          absl::StrCat("--compile-cpu-seconds=", options.compile_cpu_seconds),
          absl::StrCat("--compile-memory-bytes=", options.compile_memory_bytes),
          absl::StrCat("--log-level=", options.log_level),
          absl::StrCat("--log-format=", options.log_format)};
}

}  // namespace gpurpc
