// Sessions of the front end: each owns one worker process. Opens them (from a warm pool of
// pre-started workers per device), finds them for routing, marks them FAULTED when their
// worker dies, and reclaims those whose client went quiet for the idle timeout.
//
// Thread safety: all methods are thread-safe.
#ifndef GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_
#define GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/handle_ids.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/session_service.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "server/frontend/worker_process.h"
#include "server/options.h"

namespace gpurpc::frontend {

// One open session. Shared by the manager and the calls in flight on it.
class SessionRecord {
 public:
  SessionRecord(uint64_t id, int device, std::unique_ptr<WorkerProcess> worker);
  ~SessionRecord();

  uint64_t id() const { return id_; }
  int device() const { return device_; }
  WorkerProcess& worker() { return *worker_; }
  grpc::GenericStub& stub() { return *stub_; }

  // OK while ACTIVE; FAILED_PRECONDITION naming the cause once FAULTED.
  absl::Status CheckUsable() const;
  v1::SessionState state() const;
  std::string fault_cause() const;
  // Records the first cause and ends the worker (its context is unusable anyway). Does
  // nothing once the session is closing. True when this call recorded the cause.
  bool MarkFaulted(const std::string& cause);
  // Called by Close before it ends the worker, so that the worker's death is no fault.
  void MarkClosing();
  bool closing() const;

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

 private:
  const uint64_t id_;
  const int device_;
  std::unique_ptr<WorkerProcess> worker_;
  std::unique_ptr<grpc::GenericStub> stub_;
  mutable std::mutex mu_;
  std::string fault_cause_;  // empty while ACTIVE
  bool closing_ = false;
  std::atomic<int64_t> last_activity_ns_;
  std::atomic<int> calls_in_flight_{0};
};

class SessionManager {
 public:
  // `exe` is the daemon binary, re-executed for workers.
  SessionManager(DaemonOptions options, std::string exe);
  // Ends every worker.
  ~SessionManager();

  // Resolves --backend=auto, lists devices through an inventory worker and starts the warm
  // pools. UNAVAILABLE with advice when no device can be served.
  absl::Status Start();

  const v1::ListDevicesResponse& inventory() const { return inventory_; }
  absl::Duration idle_timeout() const { return options_.session_idle_timeout; }

  absl::StatusOr<std::shared_ptr<SessionRecord>> Open(int device_ordinal,
                                                      const std::string& client_label);
  absl::Status Close(uint64_t session_id);
  // NOT_FOUND for an unknown id. Does not check the state.
  absl::StatusOr<std::shared_ptr<SessionRecord>> Find(uint64_t session_id);
  // Parses the "gpurpc-session" metadata value: INVALID_ARGUMENT when missing or malformed,
  // else Find.
  absl::StatusOr<std::shared_ptr<SessionRecord>> FindFromMetadata(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

  size_t session_count() const;

 private:
  absl::StatusOr<std::unique_ptr<WorkerProcess>> StartWorker(int device);
  absl::StatusOr<std::unique_ptr<WorkerProcess>> TakeWarmWorker(int device);
  void Maintain();  // background: refill pools, reclaim idle sessions

  DaemonOptions options_;
  const std::string exe_;
  v1::ListDevicesResponse inventory_;
  HandleIdGenerator ids_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::unordered_map<uint64_t, std::shared_ptr<SessionRecord>> sessions_;
  std::map<int, std::deque<std::unique_ptr<WorkerProcess>>> pools_;
  std::thread maintainer_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_SESSION_MANAGER_H_
