#include "server/worker/watchdog.h"

#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "server/worker/worker_main.h"
#include "spdlog/spdlog.h"

namespace gpurpc::worker {
namespace {}  // namespace

std::string FormatKernelTimeout(uint64_t timeout_ms) {
  if (timeout_ms % 1000 == 0) return absl::StrCat(timeout_ms / 1000, "s");
  return absl::StrCat(timeout_ms, "ms");
}

std::string KernelTimeoutMessage(absl::string_view kernel, uint64_t timeout_ms) {
  return absl::StrFormat(
      "kernel '%s' ran longer than the kernel timeout of %s (--kernel-timeout or the tenant's "
      "kernel_timeout_ms quota)",
      kernel, FormatKernelTimeout(timeout_ms));
}

Watchdog::Watchdog(backend::Context* context, Options options, FireFn fire)
    : context_(context), options_(std::move(options)), fire_(std::move(fire)) {
  if (options_.start_thread) thread_ = std::thread([this] { Run(); });
}

Watchdog::~Watchdog() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
  std::vector<std::unique_ptr<backend::Event>> events;
  {
    absl::MutexLock lock(&mu_);
    streams_.clear();
    free_.clear();
    events.swap(events_);
  }
  // Destroyed outside mu_ (a backend call each), still before the context: a recorded,
  // unfinished event may be destroyed (its resources go when it completes).
  events.clear();
}

Watchdog::Clock::time_point Watchdog::Now() const {
  return options_.now ? options_.now() : Clock::now();
}

bool Watchdog::watching() const {
  absl::MutexLock lock(&mu_);
  return watching_;
}

size_t Watchdog::streams_tracked() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

size_t Watchdog::pending_markers() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, state] : streams_) n += state->pending.size();
  return n;
}

size_t Watchdog::events_created() const {
  absl::MutexLock lock(&mu_);
  return events_.size();
}

void Watchdog::StopWatchingLocked(const std::string& why) {
  if (!watching_) return;
  watching_ = false;
  if (!why.empty()) spdlog::error("kernel watchdog stopped: {}", why);
}

bool Watchdog::Accept(const absl::Status& status, const char* call) {
  if (status.ok()) return true;
  absl::MutexLock lock(&mu_);
  if (IsStickyFault(status)) {
    // Not a timeout: the context is gone and the session reports the fault.
    if (watching_)
      spdlog::info("kernel watchdog stops after a sticky fault: {}", status.ToString());
    StopWatchingLocked("");
  } else {
    StopWatchingLocked(absl::StrCat(call, " failed: ", status.ToString(),
                                    "; kernels of this session are no longer timed"));
  }
  return false;
}

void Watchdog::OnLaunch(uint64_t stream_id, backend::Stream* stream,
                        std::shared_ptr<const std::string> kernel) {
  enum class Plan { kReuse, kCreate, kCoalesce };
  Plan plan;
  backend::Event* event = nullptr;
  uint64_t coalesced_serial = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!watching_) return;
    auto it = streams_.find(stream_id);
    const size_t pending = it == streams_.end() ? 0 : it->second->pending.size();
    const bool pool_full = free_.empty() && events_.size() + creating_ >= options_.max_events;
    if (pending > 0 && (pending >= options_.max_markers_per_stream || pool_full)) {
      // The poller leaves a marker alone while a record of it is in flight.
      Marker& newest = it->second->pending.back();
      ++newest.recording;
      event = newest.event;
      coalesced_serial = newest.serial;
      plan = Plan::kCoalesce;
    } else if (!free_.empty()) {
      event = free_.back();
      free_.pop_back();
      plan = Plan::kReuse;
    } else {
      ++creating_;
      plan = Plan::kCreate;
    }
  }

  if (plan == Plan::kCreate) {
    absl::StatusOr<std::unique_ptr<backend::Event>> created =
        context_->CreateEvent(/*disable_timing=*/true, /*blocking_sync=*/false);
    absl::MutexLock lock(&mu_);
    --creating_;
    if (created.ok()) {
      event = created->get();
      events_.push_back(*std::move(created));
    } else if (IsStickyFault(created.status())) {
      StopWatchingLocked("");
      return;
    } else {
      // A later launch on this stream records a marker behind this kernel too.
      spdlog::warn(
          "kernel watchdog: cuEventCreate failed ({}); kernel '{}' is timed only "
          "with the next launch on its stream",
          created.status().ToString(), *kernel);
      return;
    }
  }

  const absl::Status recorded = context_->RecordEvent(event, stream);

  {
    absl::MutexLock lock(&mu_);
    if (plan == Plan::kCoalesce) {
      // Still queued: the poller pops no marker with a record in flight.
      std::deque<Marker>& pending = streams_.at(stream_id)->pending;
      for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
        if (it->serial != coalesced_serial) continue;
        --it->recording;
        if (recorded.ok()) ++it->generation;
        break;
      }
    } else if (recorded.ok()) {
      std::shared_ptr<StreamState>& state = streams_[stream_id];
      if (state == nullptr) state = std::make_shared<StreamState>();
      if (state->pending.empty()) state->oldest_since = Now();
      state->pending.push_back(Marker{event, std::move(kernel), next_serial_++, 0, 0});
    } else {
      free_.push_back(event);
    }
  }
  if (!recorded.ok()) {
    if (IsStickyFault(recorded)) {
      Accept(recorded, "cuEventRecord");
    } else {
      spdlog::warn(
          "kernel watchdog: cuEventRecord failed ({}); the last kernel on stream {} "
          "is timed only with the next launch on it",
          recorded.ToString(), stream_id);
    }
  }
}

void Watchdog::PollOnce() {
  std::vector<Probe> probes;
  {
    absl::MutexLock lock(&mu_);
    if (!watching_) return;
    for (const auto& [id, state] : streams_) {
      if (state->pending.empty()) continue;
      const Marker& front = state->pending.front();
      probes.push_back(
          Probe{state, front.event, front.serial, front.generation, front.recording > 0});
    }
  }
  CheckProbes(probes);
  probes.clear();
  absl::MutexLock lock(&mu_);
  for (auto it = streams_.begin(); it != streams_.end();) {
    // Nothing to watch: the entry goes, a destroyed stream's too. A later launch makes a new
    // one.
    if (it->second->pending.empty()) {
      it = streams_.erase(it);
    } else {
      ++it;
    }
  }
}

void Watchdog::CheckProbes(std::vector<Probe>& probes) {
  const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
  for (Probe& probe : probes) {
    for (;;) {
      if (!probe.recording) {
        absl::StatusOr<bool> done = context_->QueryEvent(probe.event);
        if (!Accept(done.status(), "cuEventQuery")) return;
        if (*done) {
          absl::MutexLock lock(&mu_);
          std::deque<Marker>& pending = probe.state->pending;
          if (!pending.empty() && pending.front().serial == probe.serial &&
              pending.front().generation == probe.generation && pending.front().recording == 0) {
            free_.push_back(pending.front().event);
            pending.pop_front();
            // The next marker is the oldest from now on.
            probe.state->oldest_since = Now();
            if (pending.empty()) break;
            const Marker& next = pending.front();
            probe.event = next.event;
            probe.serial = next.serial;
            probe.generation = next.generation;
            probe.recording = next.recording > 0;
            continue;
          }
          // Re-recorded meanwhile (coalesced): its latest record is what counts, next round.
        }
      }
      std::string message;
      {
        absl::MutexLock lock(&mu_);
        const std::deque<Marker>& pending = probe.state->pending;
        if (!watching_) return;
        if (pending.empty() || Now() - probe.state->oldest_since <= timeout) break;
        message = KernelTimeoutMessage(*pending.front().kernel, options_.timeout_ms);
        StopWatchingLocked("");
      }
      fire_(message);
      return;
    }
  }
}

void Watchdog::Run() {
  while (!stop_.WaitForNotificationWithTimeout(options_.poll_interval)) {
    PollOnce();
    if (!watching()) return;
  }
}

Watchdog::FireFn ExitOnKernelTimeout(int status_fd) {
  return [status_fd](const std::string& message) {
    spdlog::error("{}; ending the worker", message);
    WriteStatusLine(status_fd, message);
    _exit(kWorkerExitKernelTimeout);
  };
}

void WriteStatusLine(int status_fd, const std::string& message) {
  if (status_fd < 0) return;
  const std::string line = message + "\n";
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = write(status_fd, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
}

}  // namespace gpurpc::worker
