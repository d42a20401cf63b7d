// Sessions of the front end: each owns one worker process. Opens them (from a warm pool of
// pre-started workers per device), finds them for routing, marks them FAULTED when their
// worker dies, and reclaims those whose client is gone: a session that was watched
// (SessionService.WatchSession) is reclaimed --session-grace after its last watch ended with
// no call in flight; one never watched after --session-idle-timeout with no call and no
// KeepAlive.
//
// Tenancy: every session belongs to the tenant that opened it. Find* answers NOT_FOUND,
// word for word as for an id that never existed, when the caller's tenant is not the
// session's. The manager is also the tenants' ledger: it reserves a session slot (global
// and per tenant) before a worker is started, so that the caps hold under any number of
// concurrent opens; it accounts the device memory of every buffer (reserved before the
// worker allocates, released on Free or when the session ends) and the compiles running
// per tenant. Quotas come from DaemonOptions::QuotaFor, as last (re)loaded (SetLimits).
//
// Restarts: every run of the daemon has an instance id (16 hex digits). A call that names a
// session unknown to this run and an instance that is not this run's is answered NOT_FOUND
// with a message that says the daemon restarted.
//
// Blocking work for the gRPC callbacks (starting and ending workers) runs on the manager's
// own bounded pool of threads (RunBlocking), joined when the manager is destroyed.
//
// Thread safety: all methods are thread-safe.
#ifndef GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_
#define GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/handle_ids.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/session_service.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "server/frontend/ipc_registry.h"
#include "server/frontend/metrics.h"
#include "server/frontend/unary_channels.h"
#include "server/frontend/worker_process.h"
#include "server/options.h"

namespace gpurpc::frontend {

// One open session. Shared by the manager and the calls in flight on it.
class SessionRecord {
 public:
  SessionRecord(uint64_t id, int device, std::unique_ptr<WorkerProcess> worker, std::string tenant,
                std::string peer, std::string client_label);
  ~SessionRecord();

  uint64_t id() const { return id_; }
  int device() const { return device_; }
  const std::string& tenant() const { return tenant_; }
  const std::string& peer() const { return peer_; }
  const std::string& client_label() const { return client_label_; }
  absl::Duration age() const { return absl::Now() - opened_; }
  absl::Duration idle() const {
    return absl::Nanoseconds(absl::GetCurrentTimeNanos() - last_activity_ns_.load());
  }
  WorkerProcess& worker() { return *worker_; }
  grpc::GenericStub& stub() { return *stub_; }
  // The framed unary channels to the worker (unary_channels.h).
  UnaryChannels& unary_channels() { return *unary_channels_; }

  // OK while ACTIVE; once FAULTED the fault's code (FAILED_PRECONDITION, or
  // DEADLINE_EXCEEDED after the kernel watchdog) naming the cause.
  absl::Status CheckUsable() const;
  v1::SessionState state() const;
  std::string fault_cause() const;
  absl::StatusCode fault_code() const;  // kOk while ACTIVE
  // Records the first cause and ends the worker (its context is unusable anyway). Does
  // nothing once the session is closing. True when this call recorded the cause (and then
  // the metrics count a fault of kind `kind`).
  bool MarkFaulted(const std::string& cause,
                   absl::StatusCode code = absl::StatusCode::kFailedPrecondition,
                   FaultCause kind = FaultCause::kDeviceFault);
  // After the worker ended: records why, from its exit (the watchdog's line and exit code
  // 7 become DEADLINE_EXCEEDED, kind kKernelTimeout; a sticky fault's line and exit code 9,
  // FAILED_PRECONDITION with that cause, kind kDeviceFault; any other end, kWorkerExit).
  // Same return as MarkFaulted.
  bool MarkFaultedByExit();
  // MarkFaulted for a sticky fault that the worker answered to a call (the relay saw ABORTED
  // or DATA_LOSS from the worker itself): that call reported it, so a call that was in
  // flight when the worker then ended was told nothing new and is answered as every later
  // call is (fault_answered()). Same return as MarkFaulted.
  bool MarkFaultAnswered(const std::string& cause);
  bool fault_answered() const;
  // Called by Close before it ends the worker, so that the worker's death is no fault.
  void MarkClosing();
  bool closing() const;

  // WatchSession streams. A watcher is told the state (OnSessionChanged) when it starts
  // watching and whenever the session faults or closes, under the session's lock: it must
  // not call back into the session. Watch is RESOURCE_EXHAUSTED beyond kMaxWatchers.
  class Watcher {
   public:
    virtual ~Watcher() = default;
    virtual void OnSessionChanged(const v1::SessionEvent& event, bool closing) = 0;
  };
  static constexpr int kMaxWatchers = 16;
  absl::Status Watch(Watcher* watcher);
  void Unwatch(Watcher* watcher);

  // Activity tracking for the idle reclaim.
  void Touch() { last_activity_ns_ = absl::GetCurrentTimeNanos(); }
  void BeginCall() {
    ++calls_in_flight_;
    Touch();
  }
  void EndCall() {
    Touch();
    --calls_in_flight_;
  }
  bool IdleFor(absl::Duration timeout) const {
    return calls_in_flight_.load() == 0 &&
           absl::Nanoseconds(absl::GetCurrentTimeNanos() - last_activity_ns_.load()) > timeout;
  }
  // Calls relayed on framed channels (server/frontend/command_relay.h) at once, by kind:
  // TakeRelaySlot is false when kMaxRelayedCommandStreams command streams, or as many
  // streamed transfers (UploadStream, DownloadStream), are (the call then goes by gRPC);
  // GiveRelaySlot when one ends.
  enum class RelayKind { kCommandStream = 0, kTransfer = 1 };
  static constexpr int kMaxRelayedCommandStreams = 8;
  bool TakeRelaySlot(RelayKind kind) {
    std::atomic<int>& relayed = relayed_[static_cast<int>(kind)];
    int open = relayed.load();
    while (open < kMaxRelayedCommandStreams) {
      if (relayed.compare_exchange_weak(open, open + 1)) return true;
    }
    return false;
  }
  void GiveRelaySlot(RelayKind kind) { --relayed_[static_cast<int>(kind)]; }

  // True once a WatchSession stream was opened; then the grace period replaces the idle
  // timeout. Open streams now.
  bool watched() const;
  int watchers() const;

 private:
  const uint64_t id_;
  const int device_;
  const std::string tenant_;
  const std::string peer_;
  const std::string client_label_;
  const absl::Time opened_ = absl::Now();
  std::unique_ptr<WorkerProcess> worker_;
  std::unique_ptr<grpc::GenericStub> stub_;
  std::unique_ptr<UnaryChannels> unary_channels_;
  void NotifyWatchers() ABSL_LOCKS_EXCLUDED(mu_);
  v1::SessionEvent EventLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::string fault_cause_ ABSL_GUARDED_BY(mu_);  // empty while ACTIVE
  absl::StatusCode fault_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  bool fault_answered_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool watched_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> last_activity_ns_;
  std::atomic<int> calls_in_flight_{0};
  std::atomic<int> relayed_[2] = {0, 0};  // by RelayKind
  FrontendMetrics* metrics_ = nullptr;    // set by the manager before the record is shared

  friend class SessionManager;
  // Device memory ledger, guarded by the manager's mutex.
  std::unordered_map<uint64_t, uint64_t> buffer_bytes_;  // buffer id -> size
  std::unordered_map<uint64_t, uint64_t> module_bytes_;  // module id -> its globals' size
  std::unordered_map<uint64_t, uint64_t> region_bytes_;  // host region id -> its size
  uint64_t host_region_bytes_ = 0;                       // regions + reservations
  uint64_t memory_bytes_ = 0;                            // buffers + reservations
  uint64_t local_memory_bytes_ = 0;  // the largest launch reservation charged so far
  // SetContextLimit's reservations as last set (stack x resident threads, printf FIFO, malloc
  // heap), counted in memory_bytes_.
  uint64_t context_limit_bytes_[3] = {0, 0, 0};
  bool memory_gone_ = false;
  // The worker is gone (closed or dead): its memory is free, and the ledger forgets it.
  void ForgetMemoryLocked() {
    memory_gone_ = true;
    memory_bytes_ = 0;
    buffer_bytes_.clear();
    module_bytes_.clear();
    local_memory_bytes_ = 0;
    for (uint64_t& bytes : context_limit_bytes_) bytes = 0;
    region_bytes_.clear();
    host_region_bytes_ = 0;
  }  // the worker ended: its memory is free, accounts nothing
};

// What the metrics read at each scrape (metrics.h), taken under one lock.
struct SessionsSnapshot {
  struct Session {
    std::string tenant;
    int device = 0;
    bool faulted = false;
    bool worker_running = false;
    uint64_t device_memory_bytes = 0;  // as the ledger accounts it
    uint64_t host_region_bytes = 0;
  };
  std::vector<Session> sessions;
  std::map<std::string, uint32_t> opening;  // per tenant: opens in progress (slots held)
  std::map<int, int> warm_workers;          // per device: started, unbound, running
};

// What one tenant holds now.
struct TenantUsage {
  uint32_t sessions = 0;  // open, plus opens in progress
  uint64_t device_memory_bytes = 0;
  uint32_t compiles = 0;
  uint64_t host_region_bytes = 0;
};

class SessionManager {
 public:
  // `exe` is the daemon binary, re-executed for workers. `metrics` (may be null) counts
  // sessions opened and ended, faults and watchdog kills; it must outlive the manager.
  SessionManager(DaemonOptions options, std::string exe, FrontendMetrics* metrics = nullptr);
  // Ends every worker.
  ~SessionManager();

  // Resolves --backend=auto, lists devices through an inventory worker and starts the warm
  // pools. UNAVAILABLE with advice when no device can be served.
  absl::Status Start();

  const v1::ListDevicesResponse& inventory() const { return inventory_; }
  absl::Duration idle_timeout() const { return options_.session_idle_timeout; }
  absl::Duration grace() const { return options_.session_grace; }
  // This run of the daemon: 16 hex digits, and when it started.
  const std::string& instance() const { return instance_; }
  absl::Time started() const { return started_; }

  // Runs `work` on the manager's pool of threads for blocking work (starting or ending a
  // worker takes up to seconds: never on a gRPC callback thread). RESOURCE_EXHAUSTED when
  // kMaxBlockingQueue tasks are already waiting; the work then does not run.
  static constexpr int kBlockingThreads = 64;
  static constexpr size_t kMaxBlockingQueue = 1024;
  absl::Status RunBlocking(std::function<void()> work);

  // CUDA IPC exports between the tenants' sessions (ipc_registry.h).
  IpcRegistry& ipc() { return ipc_; }
  // Closes buffers and events that sessions opened from an export that has ended (their
  // worker's MemoryService.Free in the background; ExecutionService.DestroyEvent before it
  // returns, within 5 s for all): the sessions' ids for them answer NOT_FOUND. Blocks: call
  // it off the gRPC threads.
  void CloseImports(std::vector<IpcRegistry::Import> imports);
  // After an export or an open that the registry recorded for `session_id` outside this
  // manager's lock: when the session was closed meanwhile, its last IpcRegistry::SessionEnded
  // may have run before that record, so this ends its entries again (closing what other
  // sessions opened of them) and returns true. Close removes a session before it calls
  // SessionEnded, so one of the two always sees the record.
  bool EndIpcOfClosedSession(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Opens a session for `tenant`. RESOURCE_EXHAUSTED naming the limit when the daemon's
  // --max-sessions or the tenant's max_sessions is reached (checked and reserved before a
  // worker is taken); NOT_FOUND for an unknown device; UNAVAILABLE when no worker starts, and
  // once the daemon is draining (StartDraining).
  absl::StatusOr<std::shared_ptr<SessionRecord>> Open(int device_ordinal,
                                                      const std::string& client_label,
                                                      const std::string& tenant,
                                                      const std::string& peer);
  // Closes any session (the caller has checked who may). NOT_FOUND for an unknown id. The
  // session leaves the tables and the ledger and its worker is killed at once; Close then
  // waits (up to 10 s) until the worker has ended and the GPU has its memory back, unless
  // `ending` is given: then the caller gets the session to wait for itself (it answers its
  // client first: ending a CUDA context takes up to a second, more when many end at once).
  absl::Status Close(uint64_t session_id, std::shared_ptr<SessionRecord>* ending = nullptr);
  // Closes `session` if it is still the one under its id and still has no client (see the
  // file comment): the check and the removal happen under one lock, so a call that arrives
  // in between keeps it. True when it was closed.
  bool CloseIfAbandoned(const std::shared_ptr<SessionRecord>& session);
  // NOT_FOUND for an unknown id or one of another tenant. Does not check the state.
  absl::StatusOr<std::shared_ptr<SessionRecord>> Find(uint64_t session_id,
                                                      const std::string& tenant);
  // Parses the "gpurpc-session" metadata value: INVALID_ARGUMENT when missing or malformed,
  // else Find; an unknown session whose "gpurpc-instance" metadata names another run of the
  // daemon is NOT_FOUND saying that the daemon restarted.
  absl::StatusOr<std::shared_ptr<SessionRecord>> FindFromMetadata(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, const std::string& tenant);
  // Every session, for the admin API.
  std::vector<std::shared_ptr<SessionRecord>> AllSessions() const;

  size_t session_count() const;
  SessionsSnapshot Snapshot() const;
  // Every served device's load now (ListDevices, GetDevice): sessions open or opening on it
  // and the device memory its sessions hold as the ledger counts it.
  struct DeviceLoad {
    uint32_t sessions = 0;
    uint64_t allocated_bytes = 0;
  };
  std::map<int, DeviceLoad> DeviceLoads() const;
  // The inventory with each device's load and whether new sessions are accepted filled in.
  v1::ListDevicesResponse InventoryWithLoad() const;
  // Shutting down (SIGTERM): from now on Open answers UNAVAILABLE saying so, while the open
  // sessions go on until they close or the drain timeout ends them (frontend_main.cc).
  void StartDraining() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  const DaemonOptions& options() const { return options_; }
  // The limits SIGHUP may change (frontend_main.cc): the tenants' quotas and --max-sessions.
  // The tenant-wide quotas (sessions, device memory, host regions, concurrent compiles)
  // apply from the next check; a session's own (streams, events, modules per session) are
  // fixed when it opens. Lowering a limit ends nothing that is open.
  v1::TenantQuota QuotaFor(const std::string& tenant) const ABSL_LOCKS_EXCLUDED(limits_mu_);
  int max_sessions() const ABSL_LOCKS_EXCLUDED(limits_mu_);
  // Takes default_quota, tenant_quotas and max_sessions from `fresh`.
  void SetLimits(const DaemonOptions& fresh) ABSL_LOCKS_EXCLUDED(limits_mu_);
  TenantUsage Usage(const std::string& tenant) const;
  // Device memory `session` accounts for now.
  uint64_t MemoryBytes(const SessionRecord& session) const;

  // Device memory ledger. ReserveMemory: RESOURCE_EXHAUSTED naming the quota, the tenant's
  // use and the request when `bytes` more would pass max_device_memory_bytes. A
  // reservation ends with CommitBuffer (it becomes the buffer's) or CancelReservation.
  absl::Status ReserveMemory(SessionRecord& session, uint64_t bytes);
  void CommitBuffer(SessionRecord& session, uint64_t reserved_bytes, uint64_t buffer_id,
                    uint64_t buffer_bytes);
  void CancelReservation(SessionRecord& session, uint64_t bytes);
  void ReleaseBuffer(SessionRecord& session, uint64_t buffer_id);
  // A loaded module's globals (as the worker computed them, UINT64_MAX when it could not):
  // charged after the load; RESOURCE_EXHAUSTED naming the quota when they do not fit, and
  // then nothing is charged (the caller unloads the module).
  absl::Status ChargeModule(SessionRecord& session, uint64_t module_id, uint64_t bytes);
  void ReleaseModule(SessionRecord& session, uint64_t module_id);
  // The local memory the driver reserves for launches of a kernel: its per-thread local
  // size for every thread the device can hold at once. A context keeps the largest
  // reservation it made, so a session is charged the largest over the kernels it obtained
  // (GetFunction); RESOURCE_EXHAUSTED naming the quota when that does not fit.
  absl::Status ChargeLocalMemory(SessionRecord& session, uint64_t local_bytes_per_thread);
  // ModuleService.SetContextLimit of a device-memory limit (`slot` 0: LIMIT_STACK_SIZE, whose
  // `value` is per thread and reserves it for every resident thread; 1: the printf FIFO; 2:
  // the malloc heap): reserves what the new value adds over the one set before, before the
  // call reaches the worker (RESOURCE_EXHAUSTED naming the limit and the quota when it does
  // not fit), and returns the bytes reserved. Commit on the worker's OK (the session is then
  // charged exactly the new value, lowering it frees room); Cancel otherwise.
  absl::StatusOr<uint64_t> ReserveContextLimit(SessionRecord& session, int slot, uint64_t value);
  void CommitContextLimit(SessionRecord& session, int slot, uint64_t value, uint64_t reserved);
  // Same-host regions (host_region_service.proto), as device memory above but against the
  // tenant's max_host_region_bytes: reserved before RegisterHostRegion reaches the worker,
  // committed to the region id it answers, released by UnregisterHostRegion.
  absl::Status ReserveHostRegion(SessionRecord& session, uint64_t bytes);
  void CommitHostRegion(SessionRecord& session, uint64_t reserved_bytes, uint64_t region_id);
  void CancelHostRegionReservation(SessionRecord& session, uint64_t bytes);
  void ReleaseHostRegion(SessionRecord& session, uint64_t region_id);
  // A client's attach on the region socket: hands `memfd` (not taken) to the worker of
  // request.session_id. Any tenant's client may ask; the region's one-time ticket, which the
  // worker checks, is the proof. A session that does not exist or cannot serve answers
  // NOT_FOUND in the same words as a wrong ticket.
  v1::AttachHostRegionReply AttachHostRegion(const v1::AttachHostRegionRequest& request, int memfd);

  // Compile slots: RESOURCE_EXHAUSTED when the tenant's max_concurrent_compiles run.
  absl::Status BeginCompile(const std::string& tenant);
  void EndCompile(const std::string& tenant);

 private:
  absl::StatusOr<std::unique_ptr<WorkerProcess>> StartWorker(int device);
  absl::StatusOr<std::unique_ptr<WorkerProcess>> TakeWarmWorker(int device);
  // Hands the worker to its tenant (WorkerControl.Bind).
  absl::Status BindWorker(WorkerProcess& worker, uint64_t session_id, const std::string& tenant);
  void ReleaseSlot(const std::string& tenant, int device_ordinal) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t TenantMemoryLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Threads `device` holds at once (multiprocessors x threads per multiprocessor), 0 when
  // the inventory does not know the device.
  uint64_t ResidentThreads(int device) const;
  // Adds `bytes` to the session's account, or RESOURCE_EXHAUSTED naming the quota, the
  // tenant's use and `what` asks for more.
  absl::Status AddMemoryLocked(SessionRecord& session, uint64_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `session` has no client any more, or "" while it has one.
  std::string AbandonedLocked(const SessionRecord& session) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `session` out of the tables; the caller then ends its worker (EndWorker).
  void RemoveLocked(SessionRecord& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndWorker(SessionRecord& session) ABSL_LOCKS_EXCLUDED(mu_);
  void Maintain();  // background: refill pools, reclaim idle sessions
  void BlockingLoop();

  DaemonOptions options_;
  // Only default_quota, tenant_quotas and max_sessions are read from it (SetLimits). A leaf
  // lock: taken inside mu_, never the other way round.
  mutable absl::Mutex limits_mu_;
  DaemonOptions limits_ ABSL_GUARDED_BY(limits_mu_);
  const std::string exe_;
  FrontendMetrics* const metrics_;
  const std::string instance_;
  const absl::Time started_ = absl::Now();
  v1::ListDevicesResponse inventory_;  // written by Start only, before any other call
  HandleIdGenerator ids_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool maintain_wanted_ ABSL_GUARDED_BY(mu_) = false;  // wakes Maintain early
  std::unordered_map<uint64_t, std::shared_ptr<SessionRecord>> sessions_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> draining_{false};
  // Session slots per tenant: open sessions plus opens in progress; the sum over tenants is
  // the daemon's count against --max-sessions.
  std::map<std::string, uint32_t> tenant_slots_ ABSL_GUARDED_BY(mu_);
  uint32_t total_slots_ ABSL_GUARDED_BY(mu_) = 0;
  // Per device: opens in progress (slots reserved, session not registered yet).
  std::map<int, uint32_t> device_opening_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint32_t> tenant_compiles_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::deque<std::unique_ptr<WorkerProcess>>> pools_ ABSL_GUARDED_BY(mu_);
  std::thread maintainer_;

  // The pool of RunBlocking.
  absl::Mutex blocking_mu_;
  std::deque<std::function<void()>> blocking_queue_ ABSL_GUARDED_BY(blocking_mu_);
  bool blocking_stopping_ ABSL_GUARDED_BY(blocking_mu_) = false;
  int blocking_idle_ ABSL_GUARDED_BY(blocking_mu_) = 0;
  std::vector<std::thread> blocking_threads_ ABSL_GUARDED_BY(blocking_mu_);
  IpcRegistry ipc_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_
