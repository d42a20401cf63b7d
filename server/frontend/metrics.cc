#include "server/frontend/metrics.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"
#include "gpurpc/v1/admin_service.pb.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "gpurpc/v1/session_service.pb.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {
namespace {

using metrics::Counter;
using metrics::MetricType;
using metrics::SampleWriter;

// The services whose methods get a label of their own.
constexpr const char* kServices[] = {
    "gpurpc.v1.DeviceService",     "gpurpc.v1.SessionService", "gpurpc.v1.AdminService",
    "gpurpc.v1.MemoryService",     "gpurpc.v1.ModuleService",  "gpurpc.v1.ExecutionService",
    "gpurpc.v1.HostRegionService",
};

constexpr const char* kCodeNames[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

constexpr FaultCause kFaultCauses[] = {FaultCause::kKernelTimeout, FaultCause::kDeviceFault,
                                       FaultCause::kWorkerExit, FaultCause::kQuota};

constexpr absl::Duration kCacheWalkInterval = absl::Seconds(5);
// A cache folder holding more entries than this is not walked further (the gauges then
// undercount; the cache's own bound keeps it far below).
constexpr uint64_t kMaxCacheEntries = 1'000'000;

// The first call makes the child; later calls read the pointer kept in `slot`.
template <typename Metric, typename Make>
Metric* Lazy(std::atomic<Metric*>& slot, Make make) {
  Metric* metric = slot.load(std::memory_order_acquire);
  if (metric == nullptr) {
    metric = make();  // the family hands every caller the same child
    slot.store(metric, std::memory_order_release);
  }
  return metric;
}

// Adds the regular files under the folder `fd` (not followed through symbolic links) to
// `usage`, descending `depth` more levels. Takes `fd`.
template <typename Usage>
void Walk(int fd, int depth, Usage* usage, uint64_t* entries) {
  DIR* dir = fdopendir(fd);
  if (dir == nullptr) {
    close(fd);
    return;
  }
  while (dirent* entry = readdir(dir)) {
    if (++*entries > kMaxCacheEntries) break;
    const std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISREG(st.st_mode)) {
      ++usage->files;
      usage->bytes += static_cast<uint64_t>(st.st_size);
    } else if (S_ISDIR(st.st_mode) && depth > 0) {
      const int child =
          openat(dirfd(dir), entry->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (child >= 0) Walk(child, depth - 1, usage, entries);
    }
  }
  closedir(dir);
}

}  // namespace

const char* FaultCauseLabel(FaultCause cause) {
  switch (cause) {
    case FaultCause::kKernelTimeout:
      return "kernel_timeout";
    case FaultCause::kDeviceFault:
      return "device_fault";
    case FaultCause::kWorkerExit:
      return "worker_exit";
    case FaultCause::kQuota:
      return "quota";
  }
  return "unknown";
}

FrontendMetrics::FrontendMetrics(const DaemonOptions& options)
    : cache_dir_(options.cache_dir), cache_max_bytes_(options.cache_max_bytes) {
  // Link in and register the descriptors of every service file.
  v1::ListDevicesRequest::descriptor();
  v1::OpenSessionRequest::descriptor();
  v1::ListSessionsRequest::descriptor();
  v1::AllocateRequest::descriptor();
  v1::CompileRequest::descriptor();
  v1::CreateStreamRequest::descriptor();
  v1::RegisterHostRegionRequest::descriptor();
  auto make_method = [](std::string label) {
    auto method = std::make_unique<MethodMetrics>();
    method->label = std::move(label);
    for (auto& code : method->codes) code.store(nullptr);
    method->latency.store(nullptr);
    method->to_worker.store(nullptr);
    method->to_client.store(nullptr);
    return method;
  };
  for (const char* name : kServices) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    if (service == nullptr) continue;
    for (int i = 0; i < service->method_count(); ++i) {
      std::string path = absl::StrCat("/", name, "/", service->method(i)->name());
      methods_.emplace(path, make_method(path));
    }
  }
  unknown_method_ = make_method("unknown");

  rpcs_ = registry_.AddCounter(
      "gpurpc_rpcs_total",
      "gRPC calls the daemon answered, by method (the gRPC path; \"unknown\" for a path gpurpc "
      "does not serve) and status code, as the client received it",
      {"method", "code"});
  rpc_seconds_ = registry_.AddHistogram(
      "gpurpc_rpc_duration_seconds",
      "Time from the start of a call to its status, by method (for a streaming call, the "
      "stream's whole life)",
      {"method"}, metrics::LatencyBuckets());
  relayed_bytes_ = registry_.AddCounter(
      "gpurpc_relayed_bytes_total",
      "Bytes of the gRPC messages the front end relayed between clients and session workers, "
      "by method and direction (to_worker: uploads and requests; to_client: downloads and "
      "answers); calls on a direct channel are not relayed and not counted",
      {"method", "direction"});
  auto* streams = registry_.AddCounter(
      "gpurpc_command_streams_total",
      "CommandStream calls the front end relayed, by how: framed (a framed channel to the "
      "worker) or grpc (a gRPC call to the worker: --command-relay=grpc, or a session relaying "
      "8 streams already)",
      {"relay"});
  streams_framed_ = streams->WithLabels({"framed"});
  streams_grpc_ = streams->WithLabels({"grpc"});
  auto* transfers = registry_.AddCounter(
      "gpurpc_transfer_streams_total",
      "UploadStream and DownloadStream calls the front end relayed, by how: framed (a framed "
      "transfer channel to the worker) or grpc (a gRPC call to the worker: "
      "--command-relay=grpc, or a session relaying 8 transfers already)",
      {"relay"});
  transfers_framed_ = transfers->WithLabels({"framed"});
  transfers_grpc_ = transfers->WithLabels({"grpc"});
  auto* unary = registry_.AddCounter(
      "gpurpc_unary_calls_relayed_total",
      "Unary calls of the session services the front end relayed to workers, by how: framed (a "
      "framed unary channel to the worker) or grpc (a gRPC call to the worker: "
      "--command-relay=grpc, a request over 64 KiB, or a session whose framed unary channels "
      "are all busy)",
      {"relay"});
  unary_framed_ = unary->WithLabels({"framed"});
  unary_grpc_ = unary->WithLabels({"grpc"});
  sessions_opened_ = registry_.AddCounter("gpurpc_sessions_opened_total",
                                          "Sessions opened, by tenant", {"tenant"});
  auto* ended = registry_.AddCounter(
      "gpurpc_sessions_ended_total",
      "Sessions ended, by how: closed (CloseSession, the client's or an admin's) or reclaimed "
      "(the daemon ended it because its client was gone)",
      {"how"});
  sessions_closed_ = ended->WithLabels({"closed"});
  sessions_reclaimed_ = ended->WithLabels({"reclaimed"});
  auto* faults = registry_.AddCounter(
      "gpurpc_session_faults_total",
      "Sessions that became FAULTED, by cause: kernel_timeout (the kernel watchdog), "
      "device_fault (a sticky CUDA error), worker_exit (the worker process ended otherwise), "
      "quota (an over-quota module could not be unloaded)",
      {"cause"});
  for (FaultCause cause : kFaultCauses) {
    faults_[static_cast<int>(cause)] = faults->WithLabels({FaultCauseLabel(cause)});
  }
  watchdog_kills_ =
      registry_
          .AddCounter("gpurpc_watchdog_kills_total",
                      "Session workers the kernel watchdog ended (a kernel ran past the "
                      "tenant's kernel timeout)",
                      {})
          ->Get();
  cache_hits_ = registry_
                    .AddCounter("gpurpc_compile_cache_hits_total",
                                "Compiles answered from the compile cache (memory or disk)", {})
                    ->Get();
  cache_misses_ =
      registry_
          .AddCounter("gpurpc_compile_cache_misses_total",
                      "Compiles that missed the compile cache and ran NVRTC (failed compiles "
                      "included; refused requests, which never reach the cache, are not)",
                      {})
          ->Get();
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_compile_cache_disk_bytes",
      "Bytes of the files in the compile cache folder (--cache-dir), shared by "
      "every worker; read at most every 5 s",
      {}, [this](SampleWriter& out) { out.Add({}, static_cast<double>(CacheDiskUsage().bytes)); });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_compile_cache_disk_files",
      "Files in the compile cache folder (--cache-dir); read at most every 5 s", {},
      [this](SampleWriter& out) { out.Add({}, static_cast<double>(CacheDiskUsage().files)); });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_compile_cache_max_bytes",
      "The compile cache folder's size bound (--cache-max-bytes)", {},
      [this](SampleWriter& out) { out.Add({}, static_cast<double>(cache_max_bytes_)); });
}

FrontendMetrics::~FrontendMetrics() = default;

void FrontendMetrics::Watch(const SessionManager* sessions) {
  const std::string version = GPURPC_VERSION;
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_build_info",
      "Always 1: the daemon's version, this run's instance id and its backend",
      {"version", "instance", "backend"}, [sessions, version](SampleWriter& out) {
        out.Add({version, sessions->instance(), sessions->inventory().backend()}, 1);
      });
  registry_.AddCallback(MetricType::kGauge, "gpurpc_start_time_seconds",
                        "When this run of the daemon started, in seconds since the Unix epoch", {},
                        [sessions](SampleWriter& out) {
                          out.Add({},
                                  absl::ToDoubleSeconds(sessions->started() - absl::UnixEpoch()));
                        });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_draining",
      "1 once the daemon drains (after SIGTERM: new sessions are refused)", {},
      [sessions](SampleWriter& out) { out.Add({}, sessions->draining() ? 1 : 0); });
  registry_.AddCallback(MetricType::kGauge, "gpurpc_device_info",
                        "Always 1, per device the daemon serves: its name and compute capability",
                        {"device", "name", "compute_capability"}, [sessions](SampleWriter& out) {
                          for (const v1::DeviceInfo& device : sessions->inventory().devices()) {
                            out.Add({absl::StrCat(device.ordinal()), device.name(),
                                     absl::StrCat(device.compute_capability_major(), ".",
                                                  device.compute_capability_minor())},
                                    1);
                          }
                        });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_device_memory_total_bytes",
      "Device memory of each device, as the driver reported it when the daemon started", {"device"},
      [sessions](SampleWriter& out) {
        for (const v1::DeviceInfo& device : sessions->inventory().devices()) {
          out.Add({absl::StrCat(device.ordinal())},
                  static_cast<double>(device.total_memory_bytes()));
        }
      });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_device_memory_accounted_bytes",
      "Device memory the sessions on each device hold as the tenants' ledger accounts it "
      "(buffers, module globals, local memory reservations; not the contexts' own overhead)",
      {"device"}, [sessions](SampleWriter& out) {
        for (const v1::DeviceInfo& device : sessions->inventory().devices()) {
          out.Add({absl::StrCat(device.ordinal())}, 0);
        }
        for (const SessionsSnapshot::Session& session : sessions->Snapshot().sessions) {
          out.Add({absl::StrCat(session.device)}, static_cast<double>(session.device_memory_bytes));
        }
      });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_sessions",
      "Sessions by tenant and state: active, faulted (open but unusable until closed), "
      "opening (a worker is being taken for it)",
      {"tenant", "state"}, [sessions](SampleWriter& out) {
        const SessionsSnapshot snapshot = sessions->Snapshot();
        for (const SessionsSnapshot::Session& session : snapshot.sessions) {
          out.Add({session.tenant, session.faulted ? "faulted" : "active"}, 1);
        }
        for (const auto& [tenant, opening] : snapshot.opening) {
          out.Add({tenant, "opening"}, opening);
        }
      });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_tenant_device_memory_bytes",
      "Device memory each tenant with open sessions holds, as its ledger accounts it (what "
      "max_device_memory_bytes limits)",
      {"tenant"}, [sessions](SampleWriter& out) {
        for (const SessionsSnapshot::Session& session : sessions->Snapshot().sessions) {
          out.Add({session.tenant}, static_cast<double>(session.device_memory_bytes));
        }
      });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_tenant_host_region_bytes",
      "Same-host regions (pinned host memory) each tenant with open sessions holds", {"tenant"},
      [sessions](SampleWriter& out) {
        for (const SessionsSnapshot::Session& session : sessions->Snapshot().sessions) {
          out.Add({session.tenant}, static_cast<double>(session.host_region_bytes));
        }
      });
  registry_.AddCallback(
      MetricType::kGauge, "gpurpc_worker_processes",
      "Running worker processes by device and role: session (bound to an open session) or "
      "warm (started ahead, waiting for a session)",
      {"device", "role"}, [sessions](SampleWriter& out) {
        const SessionsSnapshot snapshot = sessions->Snapshot();
        for (const auto& [device, warm] : snapshot.warm_workers) {
          out.Add({absl::StrCat(device), "warm"}, warm);
          out.Add({absl::StrCat(device), "session"}, 0);
        }
        for (const SessionsSnapshot::Session& session : snapshot.sessions) {
          out.Add({absl::StrCat(session.device), "session"}, session.worker_running ? 1 : 0);
        }
      });
}

FrontendMetrics::MethodMetrics& FrontendMetrics::Method(std::string_view method) {
  // Debian's Abseil has a string_view of its own.
  auto it = methods_.find(absl::string_view(method.data(), method.size()));
  return it != methods_.end() ? *it->second : *unknown_method_;
}

void FrontendMetrics::OnCallEnd(std::string_view method, grpc::StatusCode code, double seconds) {
  MethodMetrics& m = Method(method);
  const int index = static_cast<int>(code) >= 0 && static_cast<int>(code) < kCodes
                        ? static_cast<int>(code)
                        : static_cast<int>(grpc::StatusCode::UNKNOWN);
  Lazy(m.codes[index], [&] {
    return rpcs_->WithLabels({m.label, kCodeNames[index]});
  })->Increment();
  Lazy(m.latency, [&] { return rpc_seconds_->WithLabels({m.label}); })->Observe(seconds);
}

FrontendMetrics::RelayCounters FrontendMetrics::Relay(std::string_view method) {
  MethodMetrics& m = Method(method);
  return RelayCounters{Lazy(m.to_worker,
                            [&] {
                              return relayed_bytes_->WithLabels({m.label, "to_worker"});
                            }),
                       Lazy(m.to_client, [&] {
                         return relayed_bytes_->WithLabels({m.label, "to_client"});
                       })};
}

void FrontendMetrics::SessionOpened(const std::string& tenant) {
  std::string label = tenant;
  {
    absl::MutexLock lock(&tenant_labels_mu_);
    if (!tenant_labels_.contains(tenant)) {
      if (tenant_labels_.size() < kMaxTenantLabels) {
        tenant_labels_.emplace(tenant, true);
      } else {
        label = "other";
      }
    }
  }
  sessions_opened_->WithLabels({label})->Increment();
}

void FrontendMetrics::SessionClosed(bool reclaimed) {
  (reclaimed ? sessions_reclaimed_ : sessions_closed_)->Increment();
}

void FrontendMetrics::SessionFaulted(FaultCause cause) {
  faults_[static_cast<int>(cause)]->Increment();
}

void FrontendMetrics::WatchdogKill() { watchdog_kills_->Increment(); }

void FrontendMetrics::CommandStreamRelayed(bool framed) {
  (framed ? streams_framed_ : streams_grpc_)->Increment();
}

void FrontendMetrics::TransferRelayed(bool framed) {
  (framed ? transfers_framed_ : transfers_grpc_)->Increment();
}

void FrontendMetrics::UnaryCallRelayed(bool framed) {
  (framed ? unary_framed_ : unary_grpc_)->Increment();
}

void FrontendMetrics::CompileAnswered(bool cache_hit) {
  (cache_hit ? cache_hits_ : cache_misses_)->Increment();
}

FrontendMetrics::CacheUsage FrontendMetrics::CacheDiskUsage() const {
  absl::MutexLock lock(&cache_mu_);
  const absl::Time now = absl::Now();
  if (now - cache_walked_ < kCacheWalkInterval) return cache_usage_;
  CacheUsage usage;
  if (!cache_dir_.empty()) {
    const int fd = open(cache_dir_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    uint64_t entries = 0;
    // <dir>/<2 hex digits>/<key>.bin (compile_cache.h): two levels.
    if (fd >= 0) Walk(fd, 1, &usage, &entries);
  }
  cache_usage_ = usage;
  cache_walked_ = now;
  return usage;
}

}  // namespace gpurpc::frontend
