#include "server/frontend/session_manager.h"

#include <pthread.h>

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_count.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "common/worker_exit.h"
#include "gpurpc/internal/v1/worker_control.grpc.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr absl::Duration kWorkerStartTimeout = absl::Seconds(60);
constexpr absl::Duration kMaintainInterval = absl::Milliseconds(200);
constexpr absl::Duration kBindTimeout = absl::Seconds(10);

std::string NewInstanceId() {
  HandleIdGenerator ids;
  return absl::StrFormat("%016x", ids.Next());
}

// One message for an unknown session and for another tenant's: never confirm that an id
// exists.
absl::Status NoSuchSession(uint64_t session_id) {
  return absl::NotFoundError(absl::StrFormat(
      "no session %d (it was closed, reclaimed after the idle timeout, or never existed)",
      session_id));
}

}  // namespace

SessionRecord::SessionRecord(uint64_t id, int device, std::unique_ptr<WorkerProcess> worker,
                             std::string tenant, std::string peer, std::string client_label)
    : id_(id),
      device_(device),
      tenant_(std::move(tenant)),
      peer_(std::move(peer)),
      client_label_(std::move(client_label)),
      worker_(std::move(worker)),
      stub_(std::make_unique<grpc::GenericStub>(worker_->channel())),
      unary_channels_(std::make_unique<UnaryChannels>(
          [worker = worker_.get()] { return worker->OpenUnaryChannel(); })),
      last_activity_ns_(absl::GetCurrentTimeNanos()) {}

SessionRecord::~SessionRecord() {
  // Destroying the worker kills and reaps it, which frees everything on the GPU.
  unary_channels_.reset();
  stub_.reset();
  worker_.reset();
}

absl::Status SessionRecord::CheckUsable() const {
  absl::MutexLock lock(&mu_);
  if (fault_cause_.empty()) return absl::OkStatus();
  return absl::Status(fault_code_,
                      absl::StrFormat("session %d is FAULTED: %s; close it and open a new session",
                                      id_, fault_cause_));
}

v1::SessionState SessionRecord::state() const {
  absl::MutexLock lock(&mu_);
  return fault_cause_.empty() ? v1::SESSION_STATE_ACTIVE : v1::SESSION_STATE_FAULTED;
}

std::string SessionRecord::fault_cause() const {
  absl::MutexLock lock(&mu_);
  return fault_cause_;
}

absl::StatusCode SessionRecord::fault_code() const {
  absl::MutexLock lock(&mu_);
  return fault_code_;
}

bool SessionRecord::MarkFaulted(const std::string& cause, absl::StatusCode code, FaultCause kind) {
  {
    absl::MutexLock lock(&mu_);
    if (!fault_cause_.empty() || closing_) return false;
    fault_cause_ = cause;
    fault_code_ = code;
  }
  if (metrics_ != nullptr) metrics_->SessionFaulted(kind);
  spdlog::warn("session {} FAULTED: {}", id_, cause);
  worker_->Kill();
  NotifyWatchers();
  return true;
}

bool SessionRecord::MarkFaultedByExit() {
  if (worker_->exit_code() == kWorkerExitKernelTimeout && !worker_->exit_message().empty()) {
    return MarkFaulted(worker_->exit_message(), absl::StatusCode::kDeadlineExceeded,
                       FaultCause::kKernelTimeout);
  }
  if (worker_->exit_code() == kWorkerExitSessionFaulted && !worker_->exit_message().empty()) {
    return MarkFaulted(worker_->exit_message(), absl::StatusCode::kFailedPrecondition,
                       FaultCause::kDeviceFault);
  }
  return MarkFaulted(absl::StrCat("its worker process ", worker_->exit_description()),
                     absl::StatusCode::kFailedPrecondition, FaultCause::kWorkerExit);
}

bool SessionRecord::MarkFaultAnswered(const std::string& cause) {
  {
    absl::MutexLock lock(&mu_);
    fault_answered_ = true;
  }
  return MarkFaulted(cause);
}

bool SessionRecord::fault_answered() const {
  absl::MutexLock lock(&mu_);
  return fault_answered_;
}

void SessionRecord::MarkClosing() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  NotifyWatchers();
}

bool SessionRecord::closing() const {
  absl::MutexLock lock(&mu_);
  return closing_;
}

absl::Status SessionRecord::Watch(Watcher* watcher) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(watchers_.size()) >= kMaxWatchers) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "session %d already has %d WatchSession streams open, the most one session may have", id_,
        kMaxWatchers));
  }
  watchers_.push_back(watcher);
  watched_ = true;
  Touch();
  watcher->OnSessionChanged(EventLocked(), closing_);
  return absl::OkStatus();
}

void SessionRecord::Unwatch(Watcher* watcher) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(std::remove(watchers_.begin(), watchers_.end(), watcher), watchers_.end());
  // The grace period runs from the end of the last watch.
  Touch();
}

bool SessionRecord::watched() const {
  absl::MutexLock lock(&mu_);
  return watched_;
}

int SessionRecord::watchers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watchers_.size());
}

v1::SessionEvent SessionRecord::EventLocked() const {
  v1::SessionEvent event;
  event.set_state(fault_cause_.empty() ? v1::SESSION_STATE_ACTIVE : v1::SESSION_STATE_FAULTED);
  event.set_fault_cause(fault_cause_);
  event.set_fault_code(static_cast<int32_t>(fault_code_));
  return event;
}

void SessionRecord::NotifyWatchers() {
  // Under mu_ so that a watcher cannot unregister (and be deleted) while it is told; a
  // watcher's OnSessionChanged only queues a write and never calls back.
  absl::MutexLock lock(&mu_);
  const v1::SessionEvent event = EventLocked();
  for (Watcher* watcher : watchers_) watcher->OnSessionChanged(event, closing_);
}

SessionManager::SessionManager(DaemonOptions options, std::string exe, FrontendMetrics* metrics)
    : options_(std::move(options)),
      limits_(options_),
      exe_(std::move(exe)),
      metrics_(metrics),
      instance_(NewInstanceId()) {}

SessionManager::~SessionManager() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (maintainer_.joinable()) maintainer_.join();
  // The blocking pool finishes what it holds (a close, an open) before the workers go.
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&blocking_mu_);
    blocking_stopping_ = true;
    threads.swap(blocking_threads_);
  }
  for (std::thread& thread : threads) thread.join();
  std::unordered_map<uint64_t, std::shared_ptr<SessionRecord>> sessions;
  std::map<int, std::deque<std::unique_ptr<WorkerProcess>>> pools;
  {
    absl::MutexLock lock(&mu_);
    sessions.swap(sessions_);
    pools.swap(pools_);
  }
  for (auto& [id, session] : sessions) session->MarkClosing();
}

absl::Status SessionManager::RunBlocking(std::function<void()> work) {
  absl::MutexLock lock(&blocking_mu_);
  if (blocking_stopping_) {
    return absl::UnavailableError("gpurpcd is shutting down");
  }
  if (blocking_queue_.size() >= kMaxBlockingQueue) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("gpurpcd has %d session opens and closes waiting already; retry shortly",
                        blocking_queue_.size()));
  }
  blocking_queue_.push_back(std::move(work));
  if (blocking_idle_ == 0 && static_cast<int>(blocking_threads_.size()) < kBlockingThreads) {
    blocking_threads_.emplace_back([this] { BlockingLoop(); });
  }
  return absl::OkStatus();
}

void SessionManager::BlockingLoop() {
  // Named, so that an operator (and gpurpc-soak) tells this pool from gRPC's threads.
  pthread_setname_np(pthread_self(), "gpurpc-blocking");
  absl::MutexLock lock(&blocking_mu_);
  for (;;) {
    ++blocking_idle_;
    blocking_mu_.Await(absl::Condition(
        +[](SessionManager* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->blocking_mu_) {
          return self->blocking_stopping_ || !self->blocking_queue_.empty();
        },
        this));
    --blocking_idle_;
    if (blocking_queue_.empty()) return;  // stopping, and nothing left to do
    std::function<void()> work = std::move(blocking_queue_.front());
    blocking_queue_.pop_front();
    blocking_mu_.Unlock();
    work();
    blocking_mu_.Lock();
  }
}

absl::StatusOr<std::unique_ptr<WorkerProcess>> SessionManager::StartWorker(int device) {
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<WorkerProcess> worker,
                          WorkerProcess::Spawn(exe_, WorkerArgs(options_, device, 3)));
  auto ready = worker->WaitReady(kWorkerStartTimeout);
  if (!ready.ok()) return ready.status();
  return worker;
}

absl::Status SessionManager::Start() {
  const bool automatic = options_.backend == "auto";
  if (automatic) options_.backend = "cuda";
  auto inventory_worker = WorkerProcess::Spawn(exe_, WorkerArgs(options_, -1, 3));
  if (!inventory_worker.ok()) return inventory_worker.status();
  auto inventory = (*inventory_worker)->WaitReady(kWorkerStartTimeout);
  if (!inventory.ok() || inventory->devices().empty()) {
    std::string why = inventory.ok() ? "the driver reports no CUDA device"
                                     : std::string(inventory.status().message());
    if (!inventory.ok() && (*inventory_worker)->WaitExited(absl::Seconds(2))) {
      // kWorkerExitBackendUnavailable: no driver; any other code is a refusal of its own
      // (an unsafe cache folder, ...), which its log line explains.
      const std::string exit = (*inventory_worker)->exit_description();
      if (options_.backend == "fake" ||
          (*inventory_worker)->exit_code() != kWorkerExitBackendUnavailable) {
        return absl::UnavailableError(absl::StrCat(
            "the worker that lists the devices ", exit,
            "; its log above says why, and the daemon cannot start until that is fixed"));
      }
      why = absl::StrCat("the CUDA backend could not start (the worker ", exit,
                         "; its log is above)");
    }
    return absl::UnavailableError(absl::StrCat(
        "no GPU to serve with --backend=", automatic ? "auto" : options_.backend, ": ", why,
        ". To run without a GPU, start with --backend=fake (a host-memory test double)."));
  }
  inventory_ = *std::move(inventory);
  inventory_worker->reset();
  for (const v1::DeviceInfo& device : inventory_.devices()) {
    spdlog::info("device {}: {} (compute capability {}.{}, {} MiB){}", device.ordinal(),
                 device.name(), device.compute_capability_major(),
                 device.compute_capability_minor(), device.total_memory_bytes() >> 20,
                 device.is_fake() ? " - FAKE backend, not a GPU" : "");
    absl::MutexLock lock(&mu_);
    pools_[device.ordinal()];
  }
  maintainer_ = std::thread([this] { Maintain(); });
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WorkerProcess>> SessionManager::TakeWarmWorker(int device) {
  {
    absl::MutexLock lock(&mu_);
    maintain_wanted_ = true;  // refill
    auto& pool = pools_[device];
    while (!pool.empty()) {
      std::unique_ptr<WorkerProcess> worker = std::move(pool.front());
      pool.pop_front();
      if (!worker->exited()) return worker;
    }
  }
  return StartWorker(device);
}

absl::Status SessionManager::BindWorker(WorkerProcess& worker, uint64_t session_id,
                                        const std::string& tenant) {
  internal::v1::WorkerControl::Stub stub(worker.channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kBindTimeout));
  internal::v1::BindRequest request;
  request.set_session_id(session_id);
  request.set_tenant(tenant);
  *request.mutable_quota() = QuotaFor(tenant);
  request.set_max_host_region_bytes_per_session(options_.max_host_region_bytes);
  internal::v1::BindResponse response;
  const grpc::Status status = stub.Bind(&context, request, &response);
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot hand the worker to the session: ", status.error_message()));
  }
  return absl::OkStatus();
}

void SessionManager::ReleaseSlot(const std::string& tenant, int device_ordinal) {
  absl::MutexLock lock(&mu_);
  if (auto it = tenant_slots_.find(tenant); it != tenant_slots_.end()) {
    if (--it->second == 0) tenant_slots_.erase(it);
  }
  --total_slots_;
  if (auto it = device_opening_.find(device_ordinal); it != device_opening_.end()) {
    if (--it->second == 0) device_opening_.erase(it);
  }
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Open(int device_ordinal,
                                                                    const std::string& client_label,
                                                                    const std::string& tenant,
                                                                    const std::string& peer) {
  const v1::TenantQuota quota = QuotaFor(tenant);
  if (draining()) {
    return absl::UnavailableError(
        "gpurpcd is shutting down (draining: its open sessions may finish, no new one "
        "starts); open the session on another daemon, or retry once it has restarted");
  }
  {
    // Reserve the slot before the worker is taken, so that the caps hold under any number
    // of concurrent opens.
    absl::MutexLock lock(&mu_);
    if (pools_.count(device_ordinal) == 0) {
      return absl::NotFoundError(
          absl::StrFormat("no device with ordinal %d (this daemon serves %d)", device_ordinal,
                          inventory_.devices_size()));
    }
    if (const int max = max_sessions(); total_slots_ >= static_cast<uint32_t>(max)) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the daemon's limit of %d open sessions (--max-sessions) is reached", max));
    }
    uint32_t& held = tenant_slots_[tenant];
    if (quota.max_sessions() != 0 && held >= quota.max_sessions()) {
      if (held == 0) tenant_slots_.erase(tenant);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "quota max_sessions of tenant '%s' reached: it holds %d open sessions of at most "
          "%d; close one first",
          tenant, held, quota.max_sessions()));
    }
    ++held;
    ++total_slots_;
    ++device_opening_[device_ordinal];
  }
  auto worker = TakeWarmWorker(device_ordinal);
  if (!worker.ok()) {
    ReleaseSlot(tenant, device_ordinal);
    return absl::UnavailableError(absl::StrCat("cannot start a worker for device ", device_ordinal,
                                               ": ", worker.status().message()));
  }
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    do {
      id = ids_.Next();
    } while (sessions_.count(id) != 0);
  }
  absl::Status bound = BindWorker(**worker, id, tenant);
  if (!bound.ok() && (*worker)->WaitExited(absl::Milliseconds(250))) {
    // A warm worker that died while it waited in the pool, before its reaper noticed: the
    // session gets a fresh one (once) rather than the dead one's error.
    spdlog::warn("a warm worker for device {} had ended ({}); starting another", device_ordinal,
                 std::string(bound.message()));
    worker = StartWorker(device_ordinal);
    bound =
        worker.ok()
            ? BindWorker(**worker, id, tenant)
            : absl::UnavailableError(absl::StrCat("cannot start a worker for device ",
                                                  device_ordinal, ": ", worker.status().message()));
  }
  if (!bound.ok()) {
    ReleaseSlot(tenant, device_ordinal);
    return bound;
  }
  auto record = std::make_shared<SessionRecord>(id, device_ordinal, std::move(*worker), tenant,
                                                peer, client_label);
  record->metrics_ = metrics_;
  std::weak_ptr<SessionRecord> weak = record;
  WorkerProcess* bound_worker = &record->worker();
  record->worker().SetExitCallback([this, weak, bound_worker](const std::string&) {
    // Exit code 7: the kernel watchdog ended the worker (which wrote why first). The worker
    // object outlives this callback, which its own reaper thread runs.
    if (metrics_ != nullptr && bound_worker->exit_code() == kWorkerExitKernelTimeout) {
      metrics_->WatchdogKill();
    }
    if (auto session = weak.lock()) {
      {
        // Its memory is free now, whatever the ledger says.
        absl::MutexLock lock(&mu_);
        session->ForgetMemoryLocked();
      }
      // And so is what it exported: close it where other sessions opened it.
      CloseImports(ipc_.SessionEnded(session->id()));
      session->MarkFaultedByExit();
    }
  });
  {
    absl::MutexLock lock(&mu_);
    sessions_[id] = record;
    if (auto it = device_opening_.find(device_ordinal); it != device_opening_.end()) {
      if (--it->second == 0) device_opening_.erase(it);
    }
  }
  if (metrics_ != nullptr) metrics_->SessionOpened(tenant);
  // The label is the client's text: escaped, so that it cannot forge log lines.
  spdlog::info("session {} opened on device {} for tenant {} ({}, worker pid {}){}{}", id,
               device_ordinal, tenant, peer, record->worker().pid(),
               client_label.empty() ? "" : ", client ", absl::CHexEscape(client_label));
  return record;
}

void SessionManager::RemoveLocked(SessionRecord& session) {
  sessions_.erase(session.id());
  session.ForgetMemoryLocked();
  if (auto it = tenant_slots_.find(session.tenant()); it != tenant_slots_.end()) {
    if (--it->second == 0) tenant_slots_.erase(it);
  }
  --total_slots_;
}

void SessionManager::CloseImports(std::vector<IpcRegistry::Import> imports) {
  // Events are closed here and now, within one deadline for all of them: Close calls this
  // before it ends the exporter's worker, whose cuEventDestroy would leave them undefined.
  const auto events_deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
  for (const IpcRegistry::Import& import : imports) {
    std::shared_ptr<SessionRecord> holder;
    {
      absl::MutexLock lock(&mu_);
      auto it = sessions_.find(import.session_id);
      if (it == sessions_.end()) continue;  // ended too: its mapping went with its worker
      holder = it->second;
    }
    const bool event = import.kind == IpcRegistry::Kind::kEvent;
    auto close = [holder, import,
                  deadline = event ? events_deadline
                                   : std::chrono::system_clock::now() + std::chrono::seconds(30)] {
      grpc::ClientContext context;
      context.set_deadline(deadline);
      grpc::Status status;
      if (import.kind == IpcRegistry::Kind::kEvent) {
        v1::DestroyEventRequest request;
        request.set_event_id(import.object_id);
        v1::DestroyEventResponse response;
        status = v1::ExecutionService::NewStub(holder->worker().channel())
                     ->DestroyEvent(&context, request, &response);
      } else {
        v1::FreeRequest request;
        request.set_buffer_id(import.object_id);
        v1::FreeResponse response;
        status = v1::MemoryService::NewStub(holder->worker().channel())
                     ->Free(&context, request, &response);
      }
      // NOT_FOUND: the session closed it already.
      if (!status.ok() && status.error_code() != grpc::StatusCode::NOT_FOUND) {
        spdlog::warn("session {}: cannot close {} {} opened from an ended export: {}", holder->id(),
                     import.kind == IpcRegistry::Kind::kEvent ? "event" : "buffer",
                     import.object_id, status.error_message());
      }
    };
    // Memory in the background; the pool is full only under a flood: then here, on this
    // (non-gRPC) thread.
    if (event) {
      close();
    } else if (absl::Status queued = RunBlocking(close); !queued.ok()) {
      close();
    }
  }
}

bool SessionManager::EndIpcOfClosedSession(uint64_t session_id) {
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.count(session_id) != 0) return false;
  }
  CloseImports(ipc_.SessionEnded(session_id));
  return true;
}

void SessionManager::EndWorker(SessionRecord& session) {
  session.MarkClosing();
  session.worker().Kill();
  session.worker().WaitExited(absl::Seconds(10));
}

absl::Status SessionManager::Close(uint64_t session_id, std::shared_ptr<SessionRecord>* ending) {
  std::shared_ptr<SessionRecord> record;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return NoSuchSession(session_id);
    record = it->second;
    RemoveLocked(*record);
  }
  // Before its worker is ended: other sessions' mappings of its exported memory are closed
  // (queued, not awaited), and the events they opened from it (awaited, CloseImports).
  CloseImports(ipc_.SessionEnded(session_id));
  if (metrics_ != nullptr) metrics_->SessionClosed(/*reclaimed=*/false);
  spdlog::info("session {} of tenant {} closed", session_id, record->tenant());
  if (ending != nullptr) {
    record->MarkClosing();
    record->worker().Kill();
    *ending = std::move(record);
    return absl::OkStatus();
  }
  EndWorker(*record);
  return absl::OkStatus();
}

std::string SessionManager::AbandonedLocked(const SessionRecord& session) const {
  if (session.watchers() > 0) return "";
  if (session.watched()) {
    if (!session.IdleFor(options_.session_grace)) return "";
    return absl::StrCat("its client is gone: its last WatchSession stream ended more than ",
                        absl::FormatDuration(options_.session_grace),
                        " ago (--session-grace) and no call came since");
  }
  if (!session.IdleFor(options_.session_idle_timeout)) return "";
  return absl::StrCat("no call and no KeepAlive for more than ",
                      absl::FormatDuration(options_.session_idle_timeout),
                      " (--session-idle-timeout)");
}

bool SessionManager::CloseIfAbandoned(const std::shared_ptr<SessionRecord>& session) {
  std::string why;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session->id());
    if (it == sessions_.end() || it->second != session) return false;
    why = AbandonedLocked(*session);
    if (why.empty()) return false;
    RemoveLocked(*session);
  }
  if (metrics_ != nullptr) metrics_->SessionClosed(/*reclaimed=*/true);
  spdlog::info("session {} of tenant {} reclaimed: {}", session->id(), session->tenant(), why);
  // As Close: what other sessions opened from its exports is closed before its worker ends.
  CloseImports(ipc_.SessionEnded(session->id()));
  EndWorker(*session);
  return true;
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Find(uint64_t session_id,
                                                                    const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NoSuchSession(session_id);
  if (it->second->tenant() != tenant) {
    // Worth an operator's attention, but at most once a second: a tenant must not be able
    // to flood the log.
    static std::atomic<int64_t> last_warning_ns{0};
    const int64_t now = absl::GetCurrentTimeNanos();
    int64_t last = last_warning_ns.load();
    if (now - last > 1'000'000'000 && last_warning_ns.compare_exchange_strong(last, now)) {
      spdlog::warn("tenant {} named session {} of tenant {}; answered NOT_FOUND", tenant,
                   session_id, it->second->tenant());
    }
    return NoSuchSession(session_id);
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::FindFromMetadata(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, const std::string& tenant) {
  if (metadata.count(kSessionMetadataKey) > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the call carries more than one '", kSessionMetadataKey, "' metadata value; send one"));
  }
  auto it = metadata.find(kSessionMetadataKey);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("this call is session-scoped: send the session id from OpenSession as '",
                     kSessionMetadataKey, "' metadata"));
  }
  // The whole value is parsed; only the message quotes at most 64 bytes of it.
  const absl::string_view value(it->second.data(), it->second.size());
  uint64_t id = 0;
  if (value.size() > 64 || !absl::SimpleAtoi(value, &id) || id == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' metadata '%s%s' is not a session id (a decimal 64-bit number)", kSessionMetadataKey,
        absl::CHexEscape(value.substr(0, 64)), value.size() > 64 ? "..." : ""));
  }
  auto session = Find(id, tenant);
  if (session.ok() || !absl::IsNotFound(session.status())) return session;
  if (auto instance = metadata.find(kInstanceMetadataKey); instance != metadata.end()) {
    const absl::string_view named(instance->second.data(),
                                  std::min<size_t>(instance->second.size(), 64));
    if (named != instance_) {
      return absl::NotFoundError(absl::StrFormat(
          "no session %d: it belonged to an earlier run of gpurpcd (instance %s), and the "
          "daemon restarted at %s (now instance %s), which ended every session of the earlier "
          "run; open a new session",
          id, absl::CHexEscape(named),
          absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", started_, absl::UTCTimeZone()), instance_));
    }
  }
  return session;
}

std::vector<std::shared_ptr<SessionRecord>> SessionManager::AllSessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<SessionRecord>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

TenantUsage SessionManager::Usage(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  TenantUsage usage;
  if (auto it = tenant_slots_.find(tenant); it != tenant_slots_.end()) usage.sessions = it->second;
  usage.device_memory_bytes = TenantMemoryLocked(tenant);
  for (const auto& [id, session] : sessions_) {
    if (session->tenant() == tenant) usage.host_region_bytes += session->host_region_bytes_;
  }
  if (auto it = tenant_compiles_.find(tenant); it != tenant_compiles_.end()) {
    usage.compiles = it->second;
  }
  return usage;
}

uint64_t SessionManager::MemoryBytes(const SessionRecord& session) const {
  absl::MutexLock lock(&mu_);
  return session.memory_bytes_;
}

uint64_t SessionManager::TenantMemoryLocked(const std::string& tenant) const {
  uint64_t total = 0;
  for (const auto& [id, session] : sessions_) {
    if (session->tenant() == tenant) {
      total =
          session->memory_bytes_ > UINT64_MAX - total ? UINT64_MAX : total + session->memory_bytes_;
    }
  }
  return total;
}

absl::Status SessionManager::AddMemoryLocked(SessionRecord& session, uint64_t bytes,
                                             absl::string_view what) {
  const uint64_t limit = QuotaFor(session.tenant()).max_device_memory_bytes();
  if (limit != 0) {
    const uint64_t used = TenantMemoryLocked(session.tenant());
    if (bytes > limit || used > limit - bytes) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("quota max_device_memory_bytes of tenant '%s' is %s: the tenant holds "
                          "%s, and %s",
                          session.tenant(), FormatBytes(limit), FormatBytes(used), what));
    }
  }
  session.memory_bytes_ =
      bytes > UINT64_MAX - session.memory_bytes_ ? UINT64_MAX : session.memory_bytes_ + bytes;
  return absl::OkStatus();
}

absl::Status SessionManager::ReserveMemory(SessionRecord& session, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return absl::OkStatus();  // the worker will answer
  return AddMemoryLocked(
      session, bytes,
      absl::StrFormat("this allocation asks for %s more; free some first", FormatBytes(bytes)));
}

void SessionManager::CommitBuffer(SessionRecord& session, uint64_t reserved_bytes,
                                  uint64_t buffer_id, uint64_t buffer_bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, reserved_bytes);
  session.memory_bytes_ += buffer_bytes;
  session.buffer_bytes_[buffer_id] = buffer_bytes;
}

void SessionManager::CancelReservation(SessionRecord& session, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, bytes);
}

void SessionManager::ReleaseBuffer(SessionRecord& session, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = session.buffer_bytes_.find(buffer_id);
  if (it == session.buffer_bytes_.end()) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, it->second);
  session.buffer_bytes_.erase(it);
}

absl::Status SessionManager::ReserveHostRegion(SessionRecord& session, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return absl::OkStatus();  // the worker will answer
  const uint64_t limit = QuotaFor(session.tenant()).max_host_region_bytes();
  if (limit != 0) {
    uint64_t used = 0;
    for (const auto& [id, other] : sessions_) {
      if (other->tenant() == session.tenant()) {
        used = other->host_region_bytes_ > UINT64_MAX - used ? UINT64_MAX
                                                             : used + other->host_region_bytes_;
      }
    }
    if (bytes > limit || used > limit - bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "quota max_host_region_bytes of tenant '%s' is %s: the tenant holds %s of "
          "same-host regions, and this region asks for %s more; unregister some first",
          session.tenant(), FormatBytes(limit), FormatBytes(used), FormatBytes(bytes)));
    }
  }
  session.host_region_bytes_ = bytes > UINT64_MAX - session.host_region_bytes_
                                   ? UINT64_MAX
                                   : session.host_region_bytes_ + bytes;
  return absl::OkStatus();
}

void SessionManager::CommitHostRegion(SessionRecord& session, uint64_t reserved_bytes,
                                      uint64_t region_id) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return;
  session.region_bytes_[region_id] = reserved_bytes;  // the reservation becomes the region's
}

void SessionManager::CancelHostRegionReservation(SessionRecord& session, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return;
  session.host_region_bytes_ -= std::min(session.host_region_bytes_, bytes);
}

void SessionManager::ReleaseHostRegion(SessionRecord& session, uint64_t region_id) {
  absl::MutexLock lock(&mu_);
  auto it = session.region_bytes_.find(region_id);
  if (it == session.region_bytes_.end()) return;
  session.host_region_bytes_ -= std::min(session.host_region_bytes_, it->second);
  session.region_bytes_.erase(it);
}

v1::AttachHostRegionReply SessionManager::AttachHostRegion(
    const v1::AttachHostRegionRequest& request, int memfd) {
  v1::AttachHostRegionReply reply;
  auto answer = [&reply](const absl::Status& status) {
    reply.set_code(static_cast<int>(status.code()));
    reply.set_message(std::string(status.message()));
    return reply;
  };
  std::shared_ptr<SessionRecord> session;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = sessions_.find(request.session_id()); it != sessions_.end()) {
      session = it->second;
    }
  }
  // The same words as the worker's for a wrong ticket: whether a session exists is not
  // the asker's business.
  if (session == nullptr || !session->CheckUsable().ok()) {
    return answer(absl::NotFoundError(absl::StrFormat(
        "no region %d of this session waits for its memfd with that ticket", request.region_id())));
  }
  session->BeginCall();
  absl::StatusOr<v1::AttachHostRegionReply> attached =
      session->worker().AttachRegion(request, memfd, absl::Seconds(60));
  session->EndCall();
  if (!attached.ok()) return answer(attached.status());
  return *attached;
}

absl::Status SessionManager::ChargeModule(SessionRecord& session, uint64_t module_id,
                                          uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_ || bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(AddMemoryLocked(
      session, bytes,
      absl::StrFormat(
          "this module's globals (__device__ variables) take %s more; the module was not kept",
          bytes == UINT64_MAX ? std::string("an amount the server cannot bound")
                              : FormatBytes(bytes))));
  session.module_bytes_[module_id] = bytes;
  return absl::OkStatus();
}

void SessionManager::ReleaseModule(SessionRecord& session, uint64_t module_id) {
  absl::MutexLock lock(&mu_);
  auto it = session.module_bytes_.find(module_id);
  if (it == session.module_bytes_.end()) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, it->second);
  session.module_bytes_.erase(it);
}

absl::Status SessionManager::ChargeLocalMemory(SessionRecord& session,
                                               uint64_t local_bytes_per_thread) {
  if (local_bytes_per_thread == 0) return absl::OkStatus();
  // Every thread the device can hold at once: multiprocessors x threads per multiprocessor
  // (CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39).
  uint64_t threads = 0;
  for (const v1::DeviceInfo& device : inventory_.devices()) {
    if (device.ordinal() != session.device()) continue;
    auto it = device.attributes().find(39);
    const uint64_t per_multiprocessor =
        it != device.attributes().end() && it->second > 0 ? it->second : 2048;
    threads =
        static_cast<uint64_t>(std::max(device.multiprocessor_count(), 1)) * per_multiprocessor;
  }
  const uint64_t reservation = local_bytes_per_thread > UINT64_MAX / std::max<uint64_t>(threads, 1)
                                   ? UINT64_MAX
                                   : local_bytes_per_thread * threads;
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_ || reservation <= session.local_memory_bytes_) return absl::OkStatus();
  const uint64_t more = reservation - session.local_memory_bytes_;
  GPURPC_RETURN_IF_ERROR(AddMemoryLocked(
      session, more,
      absl::StrFormat("launching this kernel makes the driver reserve %s more (%d bytes of local "
                      "memory per thread for each of the device's %d resident threads); use "
                      "less local memory (smaller per-thread arrays, fewer spills)",
                      FormatBytes(more), local_bytes_per_thread, threads)));
  session.local_memory_bytes_ = reservation;
  return absl::OkStatus();
}

uint64_t SessionManager::ResidentThreads(int device) const {
  // Every thread the device can hold at once: multiprocessors x threads per multiprocessor
  // (CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39).
  for (const v1::DeviceInfo& info : inventory_.devices()) {
    if (info.ordinal() != device) continue;
    auto it = info.attributes().find(39);
    const uint64_t per_multiprocessor =
        it != info.attributes().end() && it->second > 0 ? it->second : 2048;
    return static_cast<uint64_t>(std::max(info.multiprocessor_count(), 1)) * per_multiprocessor;
  }
  return 0;
}

absl::StatusOr<uint64_t> SessionManager::ReserveContextLimit(SessionRecord& session, int slot,
                                                             uint64_t value) {
  static constexpr const char* kNames[3] = {"LIMIT_STACK_SIZE", "LIMIT_PRINTF_FIFO_SIZE",
                                            "LIMIT_MALLOC_HEAP_SIZE"};
  uint64_t bytes = value;
  if (slot == 0) {
    const uint64_t threads = std::max<uint64_t>(ResidentThreads(session.device()), 1);
    bytes = value > UINT64_MAX / threads ? UINT64_MAX : value * threads;
  }
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_ || bytes <= session.context_limit_bytes_[slot]) return uint64_t{0};
  const uint64_t more = bytes - session.context_limit_bytes_[slot];
  GPURPC_RETURN_IF_ERROR(AddMemoryLocked(
      session, more,
      absl::StrFormat("SetContextLimit %s = %d makes the driver reserve %s more device memory; "
                      "lower it or free some first",
                      kNames[slot], value, FormatBytes(more))));
  return more;
}

void SessionManager::CommitContextLimit(SessionRecord& session, int slot, uint64_t value,
                                        uint64_t reserved) {
  uint64_t bytes = value;
  if (slot == 0) {
    const uint64_t threads = std::max<uint64_t>(ResidentThreads(session.device()), 1);
    bytes = value > UINT64_MAX / threads ? UINT64_MAX : value * threads;
  }
  absl::MutexLock lock(&mu_);
  if (session.memory_gone_) return;
  // Take the reservation back, then count exactly the new value in place of the old one.
  session.memory_bytes_ -= std::min(session.memory_bytes_, reserved);
  uint64_t& charged = session.context_limit_bytes_[slot];
  session.memory_bytes_ -= std::min(session.memory_bytes_, charged);
  session.memory_bytes_ =
      bytes > UINT64_MAX - session.memory_bytes_ ? UINT64_MAX : session.memory_bytes_ + bytes;
  charged = bytes;
}

absl::Status SessionManager::BeginCompile(const std::string& tenant) {
  const uint32_t limit = QuotaFor(tenant).max_concurrent_compiles();
  absl::MutexLock lock(&mu_);
  uint32_t& running = tenant_compiles_[tenant];
  if (limit != 0 && running >= limit) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "quota max_concurrent_compiles of tenant '%s' reached: %d compiles of at most %d are "
        "running; retry when one has finished",
        tenant, running, limit));
  }
  ++running;
  return absl::OkStatus();
}

void SessionManager::EndCompile(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto it = tenant_compiles_.find(tenant);
  if (it == tenant_compiles_.end()) return;
  if (--it->second == 0) tenant_compiles_.erase(it);
}

size_t SessionManager::session_count() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

SessionsSnapshot SessionManager::Snapshot() const {
  SessionsSnapshot snapshot;
  absl::MutexLock lock(&mu_);
  snapshot.sessions.reserve(sessions_.size());
  std::map<std::string, uint32_t> open;
  for (const auto& [id, session] : sessions_) {
    SessionsSnapshot::Session& out = snapshot.sessions.emplace_back();
    out.tenant = session->tenant();
    out.device = session->device();
    out.faulted = session->state() == v1::SESSION_STATE_FAULTED;
    out.worker_running = !session->worker_->exited();
    out.device_memory_bytes = session->memory_bytes_;
    out.host_region_bytes = session->host_region_bytes_;
    ++open[session->tenant()];
  }
  for (const auto& [tenant, slots] : tenant_slots_) {
    const uint32_t opened = open.count(tenant) != 0 ? open[tenant] : 0;
    if (slots > opened) snapshot.opening[tenant] = slots - opened;
  }
  for (const auto& [device, pool] : pools_) {
    int running = 0;
    for (const auto& worker : pool) running += worker->exited() ? 0 : 1;
    snapshot.warm_workers[device] = running;
  }
  return snapshot;
}

v1::TenantQuota SessionManager::QuotaFor(const std::string& tenant) const {
  absl::MutexLock lock(&limits_mu_);
  return limits_.QuotaFor(tenant);
}

int SessionManager::max_sessions() const {
  absl::MutexLock lock(&limits_mu_);
  return limits_.max_sessions;
}

void SessionManager::SetLimits(const DaemonOptions& fresh) {
  absl::MutexLock lock(&limits_mu_);
  limits_.default_quota = fresh.default_quota;
  limits_.tenant_quotas = fresh.tenant_quotas;
  limits_.max_sessions = fresh.max_sessions;
}

std::map<int, SessionManager::DeviceLoad> SessionManager::DeviceLoads() const {
  std::map<int, DeviceLoad> loads;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, session] : sessions_) {
    DeviceLoad& load = loads[session->device()];
    ++load.sessions;
    load.allocated_bytes += session->memory_bytes_;
  }
  for (const auto& [device, opening] : device_opening_) loads[device].sessions += opening;
  return loads;
}

v1::ListDevicesResponse SessionManager::InventoryWithLoad() const {
  v1::ListDevicesResponse response = inventory_;
  const std::map<int, DeviceLoad> loads = DeviceLoads();
  // Memory in steps of 256 MiB, rounded up: what placement needs, and no finer a view of
  // other tenants' allocations than that.
  constexpr uint64_t kStep = uint64_t{256} << 20;
  for (v1::DeviceInfo& device : *response.mutable_devices()) {
    v1::DeviceLoad* out = device.mutable_load();
    if (auto it = loads.find(device.ordinal()); it != loads.end()) {
      out->set_sessions(it->second.sessions);
      const uint64_t bytes = it->second.allocated_bytes;
      out->set_allocated_bytes(bytes > UINT64_MAX - kStep ? UINT64_MAX
                                                          : (bytes + kStep - 1) / kStep * kStep);
    }
    const uint64_t total = device.total_memory_bytes();
    out->set_free_memory_bytes(total > out->allocated_bytes() ? total - out->allocated_bytes() : 0);
  }
  response.set_daemon_instance(instance_);
  response.set_accepting_sessions(!draining());
  return response;
}

void SessionManager::Maintain() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    maintain_wanted_ = false;
    // Reclaim sessions whose client is gone: listed here, checked again and closed under
    // the lock by CloseIfAbandoned, so that a call arriving in between keeps its session.
    std::vector<std::shared_ptr<SessionRecord>> abandoned;
    for (const auto& [id, session] : sessions_) {
      if (!AbandonedLocked(*session).empty()) abandoned.push_back(session);
    }
    // Refill warm pools.
    std::vector<int> refill;
    for (auto& [device, pool] : pools_) {
      for (auto it = pool.begin(); it != pool.end();) {
        it = (*it)->exited() ? pool.erase(it) : std::next(it);
      }
      if (static_cast<int>(pool.size()) < options_.warm_workers) refill.push_back(device);
    }
    mu_.Unlock();
    for (const auto& session : abandoned) CloseIfAbandoned(session);
    abandoned.clear();
    bool refill_failed = false;
    for (int device : refill) {
      auto worker = StartWorker(device);
      refill_failed |= !worker.ok();
      absl::MutexLock refill_lock(&mu_);
      if (worker.ok() && !stopping_) {
        pools_[device].push_back(std::move(*worker));
      } else if (!worker.ok()) {
        spdlog::error("cannot pre-start a worker for device {}: {}", device,
                      worker.status().ToString());
      }
    }
    mu_.Lock();
    if (refill.empty() || refill_failed) {
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](SessionManager* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                                 return self->stopping_ || self->maintain_wanted_;
                               },
                               this),
                           refill_failed ? absl::Seconds(1) : kMaintainInterval);
    }
  }
}

}  // namespace gpurpc::frontend
