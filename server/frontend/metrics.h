// The front end's metrics (docs/METRICS.md lists every one): counters of what happened,
// updated where it happens, and gauges read from the session manager when /metrics is
// scraped. --metrics-listen serves them (server/metrics/http_server.h).
//
// Where each is counted:
//   RPCs by method and code, latency     the status interceptor (CallObserver), every call
//                                        of the main server, whatever listener it came by
//   bytes relayed to and from workers    the relay (proxy.cc), per message
//   compile cache hits and misses        the relay, from each CompileResponse's cache_hit
//   command streams by relay             the relay, when a CommandStream starts
//   sessions opened, closed, reclaimed   the session manager
//   faults by cause, watchdog kills      SessionRecord::MarkFaulted, the worker's exit
//   sessions, workers, memory, devices   SessionManager::Snapshot and the inventory, per scrape
//   compile cache size                   the cache folder, walked at most every 5 s
//
// Method labels are the gRPC paths of gpurpc's services; a call to any other path counts
// as method "unknown", so that clients cannot make up label values.
//
// Thread safety: every method may be called from any thread.
#ifndef GPURPC_SERVER_FRONTEND_METRICS_H_
#define GPURPC_SERVER_FRONTEND_METRICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics/registry.h"
#include "server/options.h"
#include "server/status_interceptor.h"

namespace gpurpc::frontend {

class SessionManager;

// Why a session became FAULTED, as gpurpc_session_faults_total counts it.
enum class FaultCause {
  kKernelTimeout,  // the kernel watchdog ended its worker
  kDeviceFault,    // a sticky CUDA error (an illegal address, say): the context is lost
  kWorkerExit,     // its worker process ended otherwise (crashed, killed from outside)
  kQuota,          // a module over the tenant's memory quota could not be unloaded
};
// "kernel_timeout", "device_fault", "worker_exit", "quota".
const char* FaultCauseLabel(FaultCause cause);

class FrontendMetrics final : public CallObserver {
 public:
  explicit FrontendMetrics(const DaemonOptions& options);
  ~FrontendMetrics() override;

  // Adds the families read from `sessions` at each scrape (sessions by tenant and state,
  // worker processes, device memory, devices). `sessions` must be started (its inventory
  // is read) and outlive every later Exposition().
  void Watch(const SessionManager* sessions);
  // The text exposition of every metric.
  std::string Exposition() const { return registry_.Exposition(); }

  // Events.
  void OnCallEnd(std::string_view method, grpc::StatusCode code, double seconds) override;
  void SessionOpened(const std::string& tenant);
  // `reclaimed`: ended by the daemon because its client was gone; else closed by a call
  // (the client's CloseSession or an admin's).
  void SessionClosed(bool reclaimed);
  void SessionFaulted(FaultCause cause);
  void WatchdogKill();
  void CompileAnswered(bool cache_hit);
  // A command stream began, relayed on a framed channel or by gRPC (command_relay.h).
  void CommandStreamRelayed(bool framed);
  // An UploadStream or DownloadStream began, relayed on a framed transfer channel or by gRPC
  // (command_relay.h).
  void TransferRelayed(bool framed);
  // A unary call went to the worker, on a framed unary channel or by gRPC (unary_channels.h).
  void UnaryCallRelayed(bool framed);

  // The byte counters of the relay for `method` (a path of the session services; anything
  // else counts as "unknown"). Kept by each relayed call.
  struct RelayCounters {
    metrics::Counter* to_worker;
    metrics::Counter* to_client;
  };
  RelayCounters Relay(std::string_view method);

 private:
  static constexpr int kCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED
  struct MethodMetrics {
    std::string label;
    std::atomic<metrics::Counter*> codes[kCodes];
    std::atomic<metrics::Histogram*> latency;
    std::atomic<metrics::Counter*> to_worker;
    std::atomic<metrics::Counter*> to_client;
  };
  MethodMetrics& Method(std::string_view method);
  // The compile cache folder's files and bytes, walked at most every kCacheWalkInterval.
  struct CacheUsage {
    uint64_t files = 0;
    uint64_t bytes = 0;
  };
  CacheUsage CacheDiskUsage() const ABSL_LOCKS_EXCLUDED(cache_mu_);

  const std::string cache_dir_;
  const uint64_t cache_max_bytes_;
  metrics::Registry registry_;

  // Immutable after the constructor: looked up without a lock.
  absl::flat_hash_map<std::string, std::unique_ptr<MethodMetrics>> methods_;
  std::unique_ptr<MethodMetrics> unknown_method_;

  metrics::Family<metrics::Counter>* rpcs_;
  metrics::Family<metrics::Histogram>* rpc_seconds_;
  metrics::Family<metrics::Counter>* relayed_bytes_;
  metrics::Family<metrics::Counter>* sessions_opened_;
  // The tenants sessions_opened_ has a series for: at most kMaxTenantLabels, later tenants
  // count as "other" (a counter series lives forever, and tenants come from clients: every
  // uid of a user namespace, every name a CA signs).
  static constexpr size_t kMaxTenantLabels = 256;
  absl::Mutex tenant_labels_mu_;
  absl::flat_hash_map<std::string, bool> tenant_labels_ ABSL_GUARDED_BY(tenant_labels_mu_);
  metrics::Counter* sessions_closed_;
  metrics::Counter* sessions_reclaimed_;
  metrics::Counter* faults_[4];
  metrics::Counter* watchdog_kills_;
  metrics::Counter* cache_hits_;
  metrics::Counter* cache_misses_;
  metrics::Counter* streams_framed_;
  metrics::Counter* streams_grpc_;
  metrics::Counter* transfers_framed_;
  metrics::Counter* transfers_grpc_;
  metrics::Counter* unary_framed_;
  metrics::Counter* unary_grpc_;

  mutable absl::Mutex cache_mu_;
  mutable absl::Time cache_walked_ ABSL_GUARDED_BY(cache_mu_) = absl::InfinitePast();
  mutable CacheUsage cache_usage_ ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_METRICS_H_
