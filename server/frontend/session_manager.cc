#include "server/frontend/session_manager.h"

#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "gpurpc/internal/v1/worker_control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr absl::Duration kWorkerStartTimeout = absl::Seconds(60);
constexpr absl::Duration kMaintainInterval = absl::Milliseconds(200);
constexpr absl::Duration kBindTimeout = absl::Seconds(10);

// One message for an unknown session and for another tenant's: never confirm that an id
// exists.
absl::Status NoSuchSession(uint64_t session_id) {
  return absl::NotFoundError(absl::StrFormat(
      "no session %d (it was closed, reclaimed after the idle timeout, or never existed)",
      session_id));
}

std::string Bytes(uint64_t bytes) {
  if (bytes >= (1ull << 30) && bytes % (1ull << 20) == 0) {
    return absl::StrFormat("%d bytes (%.2f GiB)", bytes, bytes / double(1ull << 30));
  }
  if (bytes >= (1ull << 20)) {
    return absl::StrFormat("%d bytes (%.1f MiB)", bytes, bytes / double(1ull << 20));
  }
  return absl::StrFormat("%d bytes", bytes);
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
      last_activity_ns_(absl::GetCurrentTimeNanos()) {}

SessionRecord::~SessionRecord() {
  // Destroying the worker kills and reaps it, which frees everything on the GPU.
  stub_.reset();
  worker_.reset();
}

absl::Status SessionRecord::CheckUsable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (fault_cause_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "session %d is FAULTED: %s; close it and open a new session", id_, fault_cause_));
}

v1::SessionState SessionRecord::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fault_cause_.empty() ? v1::SESSION_STATE_ACTIVE : v1::SESSION_STATE_FAULTED;
}

std::string SessionRecord::fault_cause() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fault_cause_;
}

bool SessionRecord::MarkFaulted(const std::string& cause) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fault_cause_.empty() || closing_) return false;
    fault_cause_ = cause;
  }
  spdlog::warn("session {} FAULTED: {}", id_, cause);
  worker_->Kill();
  return true;
}

void SessionRecord::MarkClosing() {
  std::lock_guard<std::mutex> lock(mu_);
  closing_ = true;
}

bool SessionRecord::closing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closing_;
}

SessionManager::SessionManager(DaemonOptions options, std::string exe)
    : options_(std::move(options)), exe_(std::move(exe)) {}

SessionManager::~SessionManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (maintainer_.joinable()) maintainer_.join();
  std::unordered_map<uint64_t, std::shared_ptr<SessionRecord>> sessions;
  std::map<int, std::deque<std::unique_ptr<WorkerProcess>>> pools;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions.swap(sessions_);
    pools.swap(pools_);
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
      // Exit code 3 is the worker's "backend unavailable" (worker_main.h); any other code
      // is a refusal of its own (an unsafe cache folder, ...), which its log line explains.
      const std::string exit = (*inventory_worker)->exit_description();
      if (options_.backend == "fake" || exit != "exited with code 3") {
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
    pools_[device.ordinal()];
  }
  maintainer_ = std::thread([this] { Maintain(); });
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WorkerProcess>> SessionManager::TakeWarmWorker(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = pools_[device];
    while (!pool.empty()) {
      std::unique_ptr<WorkerProcess> worker = std::move(pool.front());
      pool.pop_front();
      if (!worker->exited()) {
        wake_.notify_all();  // refill
        return worker;
      }
    }
  }
  wake_.notify_all();
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
  *request.mutable_quota() = options_.QuotaFor(tenant);
  internal::v1::BindResponse response;
  const grpc::Status status = stub.Bind(&context, request, &response);
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot hand the worker to the session: ", status.error_message()));
  }
  return absl::OkStatus();
}

void SessionManager::ReleaseSlot(const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = tenant_slots_.find(tenant); it != tenant_slots_.end()) {
    if (--it->second == 0) tenant_slots_.erase(it);
  }
  --total_slots_;
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Open(int device_ordinal,
                                                                    const std::string& client_label,
                                                                    const std::string& tenant,
                                                                    const std::string& peer) {
  if (pools_.count(device_ordinal) == 0) {
    return absl::NotFoundError(absl::StrFormat("no device with ordinal %d (this daemon serves %d)",
                                               device_ordinal, inventory_.devices_size()));
  }
  const v1::TenantQuota quota = options_.QuotaFor(tenant);
  {
    // Reserve the slot before the worker is taken, so that the caps hold under any number
    // of concurrent opens.
    std::lock_guard<std::mutex> lock(mu_);
    if (total_slots_ >= static_cast<uint32_t>(options_.max_sessions)) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("the daemon's limit of %d open sessions (--max-sessions) is reached",
                          options_.max_sessions));
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
  }
  auto worker = TakeWarmWorker(device_ordinal);
  if (!worker.ok()) {
    ReleaseSlot(tenant);
    return absl::UnavailableError(absl::StrCat("cannot start a worker for device ", device_ordinal,
                                               ": ", worker.status().message()));
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    do {
      id = ids_.Next();
    } while (sessions_.count(id) != 0);
  }
  if (absl::Status bound = BindWorker(**worker, id, tenant); !bound.ok()) {
    ReleaseSlot(tenant);
    return bound;
  }
  auto record = std::make_shared<SessionRecord>(id, device_ordinal, std::move(*worker), tenant,
                                                peer, client_label);
  std::weak_ptr<SessionRecord> weak = record;
  record->worker().SetExitCallback([this, weak](const std::string& description) {
    if (auto session = weak.lock()) {
      {
        // Its memory is free now, whatever the ledger says.
        std::lock_guard<std::mutex> lock(mu_);
        session->ForgetMemoryLocked();
      }
      session->MarkFaulted(absl::StrCat("its worker process ", description));
    }
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_[id] = record;
  }
  // The label is the client's text: escaped, so that it cannot forge log lines.
  spdlog::info("session {} opened on device {} for tenant {} ({}, worker pid {}){}{}", id,
               device_ordinal, tenant, peer, record->worker().pid(),
               client_label.empty() ? "" : ", client ", absl::CHexEscape(client_label));
  return record;
}

absl::Status SessionManager::Close(uint64_t session_id) {
  std::shared_ptr<SessionRecord> record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return NoSuchSession(session_id);
    record = std::move(it->second);
    sessions_.erase(it);
    record->ForgetMemoryLocked();
  }
  ReleaseSlot(record->tenant());
  record->MarkClosing();
  record->worker().Kill();
  record->worker().WaitExited(absl::Seconds(10));
  spdlog::info("session {} of tenant {} closed", session_id, record->tenant());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Find(uint64_t session_id,
                                                                    const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
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
  auto it = metadata.find(kSessionMetadataKey);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("this call is session-scoped: send the session id from OpenSession as '",
                     kSessionMetadataKey, "' metadata"));
  }
  const std::string value(it->second.data(), std::min<size_t>(it->second.size(), 64));
  uint64_t id = 0;
  if (!absl::SimpleAtoi(value, &id) || id == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("'%s' metadata '%s' is not a session id (a decimal 64-bit number)",
                        kSessionMetadataKey, absl::CHexEscape(value)));
  }
  return Find(id, tenant);
}

std::vector<std::shared_ptr<SessionRecord>> SessionManager::AllSessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<SessionRecord>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

TenantUsage SessionManager::Usage(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  TenantUsage usage;
  if (auto it = tenant_slots_.find(tenant); it != tenant_slots_.end()) usage.sessions = it->second;
  usage.device_memory_bytes = TenantMemoryLocked(tenant);
  if (auto it = tenant_compiles_.find(tenant); it != tenant_compiles_.end()) {
    usage.compiles = it->second;
  }
  return usage;
}

uint64_t SessionManager::MemoryBytes(const SessionRecord& session) const {
  std::lock_guard<std::mutex> lock(mu_);
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
  const uint64_t limit = options_.QuotaFor(session.tenant()).max_device_memory_bytes();
  if (limit != 0) {
    const uint64_t used = TenantMemoryLocked(session.tenant());
    if (bytes > limit || used > limit - bytes) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("quota max_device_memory_bytes of tenant '%s' is %s: the tenant holds "
                          "%s, and %s",
                          session.tenant(), Bytes(limit), Bytes(used), what));
    }
  }
  session.memory_bytes_ =
      bytes > UINT64_MAX - session.memory_bytes_ ? UINT64_MAX : session.memory_bytes_ + bytes;
  return absl::OkStatus();
}

absl::Status SessionManager::ReserveMemory(SessionRecord& session, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (session.memory_gone_) return absl::OkStatus();  // the worker will answer
  return AddMemoryLocked(
      session, bytes,
      absl::StrFormat("this allocation asks for %s more; free some first", Bytes(bytes)));
}

void SessionManager::CommitBuffer(SessionRecord& session, uint64_t reserved_bytes,
                                  uint64_t buffer_id, uint64_t buffer_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (session.memory_gone_) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, reserved_bytes);
  session.memory_bytes_ += buffer_bytes;
  session.buffer_bytes_[buffer_id] = buffer_bytes;
}

void SessionManager::CancelReservation(SessionRecord& session, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (session.memory_gone_) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, bytes);
}

void SessionManager::ReleaseBuffer(SessionRecord& session, uint64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = session.buffer_bytes_.find(buffer_id);
  if (it == session.buffer_bytes_.end()) return;
  session.memory_bytes_ -= std::min(session.memory_bytes_, it->second);
  session.buffer_bytes_.erase(it);
}

absl::Status SessionManager::ChargeModule(SessionRecord& session, uint64_t module_id,
                                          uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (session.memory_gone_ || bytes == 0) return absl::OkStatus();
  GPURPC_RETURN_IF_ERROR(AddMemoryLocked(
      session, bytes,
      absl::StrFormat(
          "this module's globals (__device__ variables) take %s more; the module was not kept",
          bytes == UINT64_MAX ? std::string("an amount the server cannot bound") : Bytes(bytes))));
  session.module_bytes_[module_id] = bytes;
  return absl::OkStatus();
}

void SessionManager::ReleaseModule(SessionRecord& session, uint64_t module_id) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  if (session.memory_gone_ || reservation <= session.local_memory_bytes_) return absl::OkStatus();
  const uint64_t more = reservation - session.local_memory_bytes_;
  GPURPC_RETURN_IF_ERROR(AddMemoryLocked(
      session, more,
      absl::StrFormat("launching this kernel makes the driver reserve %s more (%d bytes of local "
                      "memory per thread for each of the device's %d resident threads); use "
                      "less local memory (smaller per-thread arrays, fewer spills)",
                      Bytes(more), local_bytes_per_thread, threads)));
  session.local_memory_bytes_ = reservation;
  return absl::OkStatus();
}

absl::Status SessionManager::BeginCompile(const std::string& tenant) {
  const uint32_t limit = options_.QuotaFor(tenant).max_concurrent_compiles();
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenant_compiles_.find(tenant);
  if (it == tenant_compiles_.end()) return;
  if (--it->second == 0) tenant_compiles_.erase(it);
}

size_t SessionManager::session_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

void SessionManager::Maintain() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    // Reclaim sessions whose client went away.
    std::vector<uint64_t> idle;
    for (const auto& [id, session] : sessions_) {
      if (session->IdleFor(options_.session_idle_timeout)) idle.push_back(id);
    }
    // Refill warm pools.
    std::vector<int> refill;
    for (auto& [device, pool] : pools_) {
      for (auto it = pool.begin(); it != pool.end();) {
        it = (*it)->exited() ? pool.erase(it) : std::next(it);
      }
      if (static_cast<int>(pool.size()) < options_.warm_workers) refill.push_back(device);
    }
    lock.unlock();
    for (uint64_t id : idle) {
      spdlog::info("session {} idle for more than {}; reclaiming it", id,
                   absl::FormatDuration(options_.session_idle_timeout));
      Close(id).IgnoreError();
    }
    bool refill_failed = false;
    for (int device : refill) {
      auto worker = StartWorker(device);
      refill_failed |= !worker.ok();
      lock.lock();
      if (worker.ok() && !stopping_) {
        pools_[device].push_back(std::move(*worker));
      } else if (!worker.ok()) {
        spdlog::error("cannot pre-start a worker for device {}: {}", device,
                      worker.status().ToString());
      }
      lock.unlock();
    }
    lock.lock();
    if (refill.empty() || refill_failed) {
      wake_.wait_for(
          lock, absl::ToChronoNanoseconds(refill_failed ? absl::Seconds(1) : kMaintainInterval));
    }
  }
}

}  // namespace gpurpc::frontend
