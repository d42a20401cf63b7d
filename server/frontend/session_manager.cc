#include "server/frontend/session_manager.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr absl::Duration kWorkerStartTimeout = absl::Seconds(60);
constexpr absl::Duration kMaintainInterval = absl::Milliseconds(200);

}  // namespace

SessionRecord::SessionRecord(uint64_t id, int device, std::unique_ptr<WorkerProcess> worker)
    : id_(id),
      device_(device),
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
      why = absl::StrCat("the CUDA backend could not start (the worker ",
                         (*inventory_worker)->exit_description(), "; its log is above)");
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

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Open(
    int device_ordinal, const std::string& client_label) {
  if (pools_.count(device_ordinal) == 0) {
    return absl::NotFoundError(absl::StrFormat(
        "no device with ordinal %d (this daemon serves %d)", device_ordinal,
        inventory_.devices_size()));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the daemon's limit of %d open sessions is reached", options_.max_sessions));
    }
  }
  auto worker = TakeWarmWorker(device_ordinal);
  if (!worker.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot start a worker for device ", device_ordinal, ": ",
                     worker.status().message()));
  }
  const uint64_t id = ids_.Next();
  auto record = std::make_shared<SessionRecord>(id, device_ordinal, std::move(*worker));
  std::weak_ptr<SessionRecord> weak = record;
  record->worker().SetExitCallback([weak](const std::string& description) {
    if (auto session = weak.lock()) {
      session->MarkFaulted(absl::StrCat("its worker process ", description));
    }
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_[id] = record;
  }
  spdlog::info("session {} opened on device {} (worker pid {}){}{}", id, device_ordinal,
               record->worker().pid(), client_label.empty() ? "" : " for ", client_label);
  return record;
}

absl::Status SessionManager::Close(uint64_t session_id) {
  std::shared_ptr<SessionRecord> record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrFormat("no session %d", session_id));
    }
    record = std::move(it->second);
    sessions_.erase(it);
  }
  record->MarkClosing();
  record->worker().Kill();
  record->worker().WaitExited(absl::Seconds(10));
  spdlog::info("session {} closed", session_id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::Find(uint64_t session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "no session %d (it was closed, reclaimed after the idle timeout, or never existed)",
        session_id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<SessionRecord>> SessionManager::FindFromMetadata(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  auto it = metadata.find(kSessionMetadataKey);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this call is session-scoped: send the session id from OpenSession as '",
        kSessionMetadataKey, "' metadata"));
  }
  const std::string value(it->second.data(), it->second.size());
  uint64_t id = 0;
  if (!absl::SimpleAtoi(value, &id) || id == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' metadata '%s' is not a session id (a decimal 64-bit number)",
        kSessionMetadataKey, value));
  }
  return Find(id);
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
      wake_.wait_for(lock, absl::ToChronoNanoseconds(refill_failed ? absl::Seconds(1)
                                                                   : kMaintainInterval));
    }
  }
}

}  // namespace gpurpc::frontend
