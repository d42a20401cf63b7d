// The kernel watchdog of a session worker: a kernel that runs longer than the session's
// kernel timeout (TenantQuota.kernel_timeout_ms, the daemon's --kernel-timeout by default)
// ends the worker process, because nothing else stops a kernel that never ends: killing the
// process destroys its context, and the hung kernel with it (DESIGN §1).
//
// How it measures. After every successful launch the session calls OnLaunch, which records
// a marker event (from a pool, created with timing disabled, reused) on the launch's stream
// right behind the kernel. Per stream, markers complete in order. A thread polls every
// `poll_interval` (50 ms): per stream it pops the completed markers (QueryEvent) and looks
// at the oldest unfinished one. That marker has been "the oldest" since the previous marker
// of its stream completed, or since its launch when nothing was pending before it; once
// that is longer than the timeout, the kernel behind it has run too long (measured from
// when the work queued before it on its stream finished, as device_service.proto says: time
// it spent waiting for other streams -- StreamWaitEvent, the legacy default stream's
// implicit waits -- counts towards it). The watchdog then calls `fire` once, with
// KernelTimeoutMessage, and stops; in the worker, `fire` is ExitOnKernelTimeout.
//
// One marker per launch, not one per command batch: a marker per batch would measure a
// whole batch (up to 4096 launches from the C++ client) against one kernel's timeout and
// kill correct programs whose kernels are each well within it. The price is one event record
// per launch: on an H200 (driver 580) cuEventRecord on a timing-disabled event takes ~0.12 µs
// alone and adds 0.1-0.4 µs to a launch beside cuLaunchKernel's ~3 µs; the poller's
// cuEventQuery (~1.3 µs) is paid per stream every poll_interval, not per launch. The
// watchdog's own bookkeeping adds ~0.2 µs of worker CPU per launch (two uncontended locks,
// a pooled event, a queued marker).
//
// Bounded: a stream holds at most `max_markers_per_stream` markers, and the pool at most
// `max_events` events (a stream with no pending marker always gets one, so the pool can
// exceed that by the number of streams, which the tenant's stream quota bounds). Past a
// bound, the launch coalesces into the stream's newest marker: the marker is recorded again
// behind the new launch (an event reflects its latest record) and now covers both; it keeps
// the name of the first launch it covers, which is the first unfinished kernel once the
// markers before it have completed, and the timeout then applies to the group. Coalescing
// only happens with more than `max_markers_per_stream` launches queued and unfinished on a
// stream, or `max_events` on all streams together.
//
// Destroyed streams: the session calls nothing. Markers hold backend events, never the
// stream: the work queued on a destroyed stream still runs (CUDA frees the stream after it),
// so its markers stay watched, and the stream's entry goes once they have completed.
//
// A sticky fault (QueryEvent or RecordEvent answering ABORTED or DATA_LOSS) is not a
// timeout: the watchdog stops watching, and the session reports the fault.
//
// Locking: the watchdog never calls the backend while it holds its own mutex `mu_` (nor the
// session's: OnLaunch is called without it), so a backend call that blocks -- a launch
// queue full of hung kernels -- never stops the poller. Threads launching on one stream at
// once may queue their markers in another order than they recorded them: a hung kernel is
// still found (every marker recorded behind it stays unfinished, and the oldest one of them
// ages), but it may then be reported under the name of a kernel launched beside it, which
// no order of such launches could tell apart anyway.
//
// Thread safety: OnLaunch may be called from any number of threads at once.
#ifndef GPURPC_SERVER_WORKER_WATCHDOG_H_
#define GPURPC_SERVER_WORKER_WATCHDOG_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/worker/backend/backend.h"

namespace gpurpc::worker {

// "5s" for whole seconds, else "1500ms".
std::string FormatKernelTimeout(uint64_t timeout_ms);

// The watchdog's report, exactly: kernel '<name>' ran longer than the kernel timeout of
// <FormatKernelTimeout> (--kernel-timeout or the tenant's kernel_timeout_ms quota)
std::string KernelTimeoutMessage(absl::string_view kernel, uint64_t timeout_ms);

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // Called once, on the watchdog's thread (or PollOnce's caller), with the message.
  using FireFn = std::function<void(const std::string& message)>;

  struct Options {
    uint64_t timeout_ms = 0;  // > 0
    absl::Duration poll_interval = absl::Milliseconds(50);
    size_t max_markers_per_stream = 1024;
    size_t max_events = 4096;
    // The clock; null = Clock::now. Tests pass a manual one.
    std::function<Clock::time_point()> now;
    // False: no thread; the caller drives PollOnce (tests).
    bool start_thread = true;
  };

  // `context` is not owned and must outlive the watchdog. Events are created lazily, on the
  // launching threads.
  Watchdog(backend::Context* context, Options options, FireFn fire);
  // Stops and joins the thread, then destroys the events (before the context goes).
  ~Watchdog();

  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // After a successful launch of `kernel` on the session's stream `stream_id` (0 and a null
  // `stream` for the default stream). `stream` is only used during the call.
  void OnLaunch(uint64_t stream_id, backend::Stream* stream,
                std::shared_ptr<const std::string> kernel) ABSL_LOCKS_EXCLUDED(mu_);

  // One round of the poller (what the thread does every poll_interval).
  void PollOnce() ABSL_LOCKS_EXCLUDED(mu_);

  // False once it fired, met a sticky fault or a backend error it cannot watch through.
  bool watching() const ABSL_LOCKS_EXCLUDED(mu_);
  // For tests and bounds checks.
  size_t streams_tracked() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t pending_markers() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t events_created() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Marker {
    backend::Event* event = nullptr;
    // The first launch this marker covers.
    std::shared_ptr<const std::string> kernel;
    uint64_t serial = 0;      // unique per marker
    uint64_t generation = 0;  // bumped by every coalescing re-record
    int recording = 0;        // re-records in flight: not to be popped meanwhile
  };
  // Guarded by the watchdog's mu_ (an annotation cannot name another object's member).
  struct StreamState {
    std::deque<Marker> pending;
    // When pending.front() became the oldest unfinished marker.
    Clock::time_point oldest_since;
  };

  // The oldest marker of one stream, as PollOnce found it.
  struct Probe {
    std::shared_ptr<StreamState> state;
    backend::Event* event;
    uint64_t serial;
    uint64_t generation;
    bool recording;
  };

  Clock::time_point Now() const;
  void Run();
  // Pops what completed behind each probe and fires for an overdue one.
  void CheckProbes(std::vector<Probe>& probes) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops watching for good; `why` is logged unless empty. Under mu_.
  void StopWatchingLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A backend status on the watchdog's own calls: stops watching on a sticky fault (the
  // session reports it) or any other error (logged). Returns false when it stopped.
  bool Accept(const absl::Status& status, const char* call) ABSL_LOCKS_EXCLUDED(mu_);

  backend::Context* const context_;
  const Options options_;
  const FireFn fire_;

  mutable absl::Mutex mu_;
  bool watching_ ABSL_GUARDED_BY(mu_) = true;
  std::unordered_map<uint64_t, std::shared_ptr<StreamState>> streams_ ABSL_GUARDED_BY(mu_);
  // Every event ever created (destroyed with the watchdog) and the ones not in use.
  std::vector<std::unique_ptr<backend::Event>> events_ ABSL_GUARDED_BY(mu_);
  std::vector<backend::Event*> free_ ABSL_GUARDED_BY(mu_);
  // Events being created right now, counted against max_events.
  size_t creating_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;

  absl::Notification stop_;
  std::thread thread_;
};

// The worker's fire action: logs `message`, writes it as one line to `status_fd` (the
// front end's status pipe; skipped when < 0) and ends the process with
// kWorkerExitKernelTimeout (common/worker_exit.h) at once, without running destructors: the hung
// kernel makes an orderly context teardown block forever.
Watchdog::FireFn ExitOnKernelTimeout(int status_fd);

// Writes `message` and a newline to `status_fd` (skipped when < 0), retrying short writes;
// gives up quietly when the front end is gone (the exit code alone must then do).
void WriteStatusLine(int status_fd, const std::string& message);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_WATCHDOG_H_
