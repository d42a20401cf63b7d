// The fake backend's simulated device: the state of one fake context (DeviceState) and the
// handles whose calls it checks (FakeStream, FakeEvent, FakeFunction). fake_backend.cc builds
// the backend objects over it (Backend, Context, Module, Array, HostRegistration) and lists
// what the fake reproduces from CUDA; this is where most of that happens: device memory in
// host memory, bounds-checked, with a gap after every allocation; a queue of work per stream,
// run in order by the stream's own thread, with the legacy stream's implicit synchronization;
// events, StreamWaitEvent and their timing; graph capture and replay (fake_graph.h); bounded
// queues; and the built-in kernels (fake_kernels.h) run against this memory.
//
// Threading: DeviceState's methods may be called from any thread at once. One mutex guards
// all of its state; a call that waits (Download, the synchronizations, Free, a full queue)
// waits without holding it. A stream's work runs on that stream's thread, under the mutex,
// except spin_us, which sleeps without it.
//
// Ownership: the context, its modules and every handle share the DeviceState (shared_ptr),
// so that a handle outliving its context is harmless. Handles name the state's objects by id
// and release them when destroyed (a stream waits for its queued work first). The context
// calls Shutdown, which stops every thread and drops queued work, then ReleaseAll.
//
// Errors follow backend.h; messages name the driver call and the CUDA error. A fault in
// queued work (an access outside a live allocation, a misaligned access,
// fault_illegal_address) is sticky: from then on every call returns ABORTED naming the first
// fault, and queued work is skipped. After Shutdown, calls that would enqueue or wait return
// ABORTED (CUDA_ERROR_CONTEXT_IS_DESTROYED).
#ifndef GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_DEVICE_H_
#define GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_DEVICE_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/fake/fake_graph.h"
#include "server/worker/backend/fake/fake_kernels.h"

namespace gpurpc::backend::fake {

// The fake device's shape: what its DeviceInfo reports (fake_backend.cc) and what launches
// are checked against.
inline constexpr int kMultiprocessorCount = 4;
inline constexpr int kMaxThreadsPerBlock = 1024;
inline constexpr std::array<int, 3> kMaxBlockDim = {1024, 1024, 64};
inline constexpr std::array<int, 3> kMaxGridDim = {2147483647, 65535, 65535};
inline constexpr int kSharedMemoryPerBlockBytes = 49152;
inline constexpr int kSharedMemoryPerBlockOptinBytes = 232448;
inline constexpr int kTotalConstantMemoryBytes = 65536;
inline constexpr int kWarpSize = 32;

// CUDA errors that the device and the backend objects both report.
inline constexpr char kInvalidValue[] = "CUDA_ERROR_INVALID_VALUE (invalid argument)";
inline constexpr char kInvalidHandle[] = "CUDA_ERROR_INVALID_HANDLE (invalid resource handle)";

// a * b, or the largest uint64_t when that overflows (a launch's thread count).
uint64_t SaturatingMul(uint64_t a, uint64_t b);

class DeviceState;

// Handles name their DeviceState's objects by id; the state (shared with the context and the
// modules) is kept alive by each, so that a straggling handle's destruction is harmless.
class FakeStream final : public Stream {
 public:
  FakeStream(std::shared_ptr<DeviceState> state, uint64_t queue)
      : state_(std::move(state)), queue_(queue) {}
  // Waits for the stream's queued work, then stops its thread.
  ~FakeStream() override;
  const DeviceState* owner() const { return state_.get(); }
  uint64_t queue() const { return queue_; }

 private:
  const std::shared_ptr<DeviceState> state_;
  const uint64_t queue_;
};

class FakeEvent final : public Event {
 public:
  FakeEvent(std::shared_ptr<DeviceState> state, uint64_t id) : state_(std::move(state)), id_(id) {}
  ~FakeEvent() override;
  const DeviceState* owner() const { return state_.get(); }
  uint64_t id() const { return id_; }

 private:
  const std::shared_ptr<DeviceState> state_;
  const uint64_t id_;
};

class FakeFunction final : public Function {
 public:
  FakeFunction(const DeviceState* owner, const BuiltinKernel& kernel)
      : owner_(owner), kernel_(kernel) {
    attributes_.max_threads_per_block = kMaxThreadsPerBlock;
  }

  const std::vector<ParamInfo>& params() const override { return kernel_.params; }
  const FunctionAttributes& attributes() const override { return attributes_; }

  const DeviceState* owner() const { return owner_; }
  // Static: queued work may name it after the module is gone.
  const BuiltinKernel& kernel() const { return kernel_; }
  absl::string_view name() const { return kernel_.name; }

  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as the driver keeps it: 48 KiB minus
  // the static shared memory (none) until set. attributes() keeps the loaded values.
  int max_dynamic_shared_bytes() const {
    return max_dynamic_shared_bytes_.load(std::memory_order_acquire);
  }
  void set_max_dynamic_shared_bytes(int bytes) {
    max_dynamic_shared_bytes_.store(bytes, std::memory_order_release);
  }
  void set_carveout(int percent) { carveout_.store(percent, std::memory_order_release); }
  void set_cache_config(CacheConfig config) {
    cache_config_.store(config, std::memory_order_release);
  }

 private:
  const DeviceState* const owner_;
  const BuiltinKernel& kernel_;
  FunctionAttributes attributes_;
  std::atomic<int> max_dynamic_shared_bytes_{kSharedMemoryPerBlockBytes};
  std::atomic<int> carveout_{-1};
  std::atomic<CacheConfig> cache_config_{CacheConfig::kPreferNone};
};

// cuLaunchKernel's checks of `config` against the fake device's limits and the function's
// attributes: INVALID_ARGUMENT (CUDA_ERROR_INVALID_VALUE) saying what is out of range.
absl::Status CheckLaunchConfig(const FakeFunction& function, const LaunchConfig& config);

// Everything a fake context owns, behind one mutex: memory, streams (queues of work, each
// with its thread), events and the sticky fault. Separate from the Context object because
// the modules and handles it makes share it.
class DeviceState {
 public:
  explicit DeviceState(uint64_t total_memory_bytes);
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;
  ~DeviceState() { Shutdown(); }

  // Stops every stream thread now: queued work is dropped and running spin_us kernels are
  // interrupted. Later calls that would enqueue or wait fail. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // OK, or ABORTED naming `call` once a fake kernel has faulted, like CUDA's sticky errors.
  absl::Status CheckHealthy(absl::string_view call) ABSL_LOCKS_EXCLUDED(mu_);

  // --- Memory -------------------------------------------------------------------------------

  absl::StatusOr<DevicePtr> Alloc(absl::string_view call, uint64_t size_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Like cuMemFree, waits for all queued work first, so that no stream thread touches freed
  // memory.
  absl::Status Free(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_);

  // For teardown (a module's globals): waits for queued work like Free, but ignores a fault,
  // and an address that ReleaseAll already took.
  void Release(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_);

  // After Shutdown: no thread is left to touch the memory.
  void ReleaseAll() ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<MemInfo> GetMemInfo() ABSL_LOCKS_EXCLUDED(mu_);

  // --- Stream-ordered work --------------------------------------------------------------------

  absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for the work queued before it on `stream`; the copy itself runs on the stream's
  // thread, in order, into `dst`, which this call keeps alive by waiting.
  absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Registered host memory (same-host regions) ---------------------------------------------

  absl::Status RegisterHost(const void* host, uint64_t size_bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for the queued work first, like Free: a copy may still use the range.
  void UnregisterHost(const void* host) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status CopyHostAsync(bool to_device, DevicePtr device, void* host, uint64_t size_bytes,
                             Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes, uint64_t count,
                      Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A 3D copy between two linear layouts (an array is an allocation laid out densely): `depth`
  // slices of `height` rows of `width_bytes`, each end's rows `pitch` apart and slices `slice`
  // apart. Not capturable (the session refuses it on a capturing stream first).
  struct Layout {
    DevicePtr address = 0;
    uint64_t pitch = 0;
    uint64_t slice = 0;
  };
  absl::Status Copy3D(const Layout& dst, const Layout& src, uint64_t width_bytes, uint64_t height,
                      uint64_t depth, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Checks the launch and enqueues it: the kernel runs, and may fault, on the stream's thread.
  absl::Status Launch(Function* function, const LaunchConfig& config,
                      absl::Span<const uint8_t> packed_args, Stream* stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Streams and events -------------------------------------------------------------------

  absl::StatusOr<uint64_t> CreateQueue(absl::string_view call, bool non_blocking)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for the queue's work, then stops its thread (cuStreamDestroy releases a stream once
  // its work is done; the fake's caller waits for that).
  void DestroyQueue(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status SynchronizeStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<bool> QueryStream(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Later work on `stream` waits for the event's recorded point; a never-recorded event
  // orders nothing.
  absl::Status StreamWaitEvent(Stream* stream, Event* event) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Synchronize() ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<uint64_t> CreateEvent(absl::string_view call, bool disable_timing)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Queued work that records the event finds it gone and does nothing.
  void DestroyEvent(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status RecordEvent(Event* event, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<bool> QueryEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status SynchronizeEvent(Event* event) ABSL_LOCKS_EXCLUDED(mu_);

  // Between the times the two record points ran; UNAVAILABLE (CUDA_ERROR_NOT_READY, as the
  // CUDA backend maps it) until both have.
  absl::StatusOr<float> ElapsedTime(Event* start, Event* end) ABSL_LOCKS_EXCLUDED(mu_);

  // --- CUDA graphs (fake_graph.h) -------------------------------------------------------

  absl::Status BeginCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // The operations the capture recorded; the capture is over either way.
  absl::StatusOr<GraphOps> EndCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<CaptureStatus> QueryCapture(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Enqueues one replay of `exec`'s current snapshot, after its previous launch.
  absl::Status LaunchGraph(FakeGraphExec* exec, Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Clock = std::chrono::steady_clock;

  static constexpr uint64_t kLegacyQueue = 0;
  // QueueOfLocked: the call may be recorded by a capturing stream.
  static constexpr bool kCapturable = true;
  static constexpr char kCaptureUnsupported[] =
      "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (operation not permitted when stream is capturing)";
  static constexpr char kCaptureImplicit[] =
      "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (operation would make the legacy stream depend on a "
      "capturing blocking stream)";
  static constexpr char kCaptureInvalidated[] =
      "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (operation failed due to a previous error during "
      "capture)";
  static constexpr char kIllegalState[] =
      "CUDA_ERROR_ILLEGAL_STATE (the operation cannot be performed in the present state)";

  static absl::Status CaptureError(absl::string_view call, absl::string_view error,
                                   absl::string_view detail);

  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using HostMemory = std::unique_ptr<uint8_t, FreeDeleter>;

  struct Allocation {
    uint64_t size_bytes = 0;
    HostMemory host;
  };

  // A point in a queue: done once the queue's work up to `seq` is (or the queue is gone,
  // which happens only after it drained).
  struct Point {
    uint64_t queue = 0;
    uint64_t seq = 0;
  };

  enum class WorkKind {
    kUpload,
    kUploadFromHost,
    kDownload,
    kMemset,
    kCopy,
    kCopy3D,
    kKernel,
    kRecord,
    kWait,
    kGraph
  };

  struct Work {
    WorkKind kind = WorkKind::kWait;
    // Its position in its queue, from 1.
    uint64_t seq = 0;
    // Points in other queues it waits for (the legacy stream's implicit synchronization,
    // StreamWaitEvent).
    std::vector<Point> after;
    DevicePtr dst = 0;
    DevicePtr src = 0;
    uint64_t size_bytes = 0;
    // Upload's bytes, Launch's packed arguments.
    std::vector<uint8_t> bytes;
    // Download's destination, kept alive by the waiting caller, or registered host memory
    // (CopyDeviceToHostAsync's destination, CopyHostToDeviceAsync's source) that the
    // caller keeps registered until the work has run.
    void* host = nullptr;
    uint32_t value = 0;
    uint32_t element_size_bytes = 0;
    // Memset's elements; a kernel's threads; a 3D copy's slices.
    uint64_t count = 0;
    // A 3D copy: rows per slice, and each end's row and slice pitch (size_bytes is a row).
    uint64_t rows = 0;
    uint64_t dst_pitch = 0;
    uint64_t dst_slice = 0;
    uint64_t src_pitch = 0;
    uint64_t src_slice = 0;
    const BuiltinKernel* kernel = nullptr;
    uint64_t event = 0;
    // A graph launch's operations, replayed in order.
    std::shared_ptr<const GraphOps> graph;
  };

  // A stream. The fields are guarded by mu_ (the map that owns it is), except `thread`, which
  // only CreateQueue, DestroyQueue and Shutdown touch.
  struct Queue {
    bool legacy = false;
    bool non_blocking = false;
    // Being destroyed: the thread ends once the queue is empty.
    bool closing = false;
    std::deque<Work> pending;
    uint64_t enqueued = 0;
    uint64_t completed = 0;
    // A capture in progress: what it recorded, and whether work it could not record came.
    bool capturing = false;
    bool capture_invalidated = false;
    GraphOps capture;
    std::thread thread;
  };

  struct EventState {
    bool disable_timing = false;
    // The latest record point; unset while never recorded.
    std::optional<Point> recorded;
    // When that point ran.
    std::optional<Clock::time_point> completed_at;
  };

  absl::Status StickyErrorLocked(absl::string_view call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status CheckAliveLocked(absl::string_view call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The first fault is the one every later call reports.
  void PoisonLocked(absl::string_view error, absl::string_view where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // What cuMemFree answers for an address that no live allocation starts at (never
  // allocated, inside an allocation, or already freed): CUDA_ERROR_INVALID_VALUE, so
  // INVALID_ARGUMENT (backend.h: an address is an argument, NOT_FOUND is for names).
  static absl::Status NoAllocation(DevicePtr ptr);

  // The queue of `stream` (nullptr: the legacy stream), if it belongs to this context and
  // may take the call: a capturing stream only takes `capturable` calls, and the legacy stream
  // none while a blocking stream captures (either refusal invalidates the captures).
  absl::StatusOr<uint64_t> QueueOfLocked(absl::string_view call, Stream* stream,
                                         bool capturable = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<EventState*> EventOfLocked(absl::string_view call, Event* event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Queues are bounded, as a GPU's are (cuLaunchKernel blocks while its queue is full), so
  // that a client cannot grow the worker's memory without bound behind a long kernel: every
  // stream-ordered call first waits here, without the lock, for room in its queue and in the
  // context's queued bytes (one piece larger than that bound goes alone). Then it checks
  // its arguments and enqueues under one hold of the lock.
  absl::Status MakeRoomLocked(absl::string_view call, uint64_t queue_id, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Appends `work` to `queue` (which exists), with the legacy stream's implicit
  // synchronization: work on the legacy stream waits for all work queued so far on blocking
  // streams, and work on a blocking stream for all work queued so far on the legacy stream.
  // Returns its position. Every point it waits for was queued before it: no cycles.
  // On a capturing stream the work is recorded instead (returns 0); work the capture cannot
  // record (it came while its call waited for room) invalidates the capture and runs.
  uint64_t EnqueueLocked(uint64_t queue_id, Work work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool DoneLocked(const Point& point) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool AllDoneLocked(const std::vector<Point>& points) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Everything queued so far, on every stream.
  std::vector<Point> AllQueuesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // What synchronizing `queue` waits for: its work so far; for the legacy stream, also that
  // of every blocking stream, as work queued on it now would.
  std::vector<Point> StreamPointsLocked(uint64_t queue_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Blocks (without the lock) until every point is done, or the context is being destroyed.
  absl::Status WaitLocked(absl::string_view call, const std::vector<Point>& points)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The body of a stream's thread: runs its queue's work in order, each piece once the
  // points it waits for are done. After a fault the work is skipped (but still counted
  // done, so that waiters wake and report the fault).
  void RunQueue(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  void RunLocked(uint64_t queue, Work& work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A capturable piece of work as a graph operation; false for other kinds.
  static bool Record(const Work& work, GraphOps* ops);

  // The work that replays `op`: run like the operation it recorded, with the same checks.
  static Work Replay(const GraphOp& op);

  void MemsetLocked(const Work& work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Sleeps on the stream's thread without the lock, so that other calls proceed while the
  // kernel "runs", as they would beside a GPU; Shutdown cuts it short.
  void SpinLocked(uint64_t microseconds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool ReleaseLocked(DevicePtr ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The host bytes behind [ptr, ptr + size_bytes), or nullptr unless that range lies inside
  // one live allocation.
  uint8_t* FindLocked(DevicePtr ptr, uint64_t size_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The session layer checks bounds before calling; this is the second line of defence.
  absl::StatusOr<uint8_t*> ResolveLocked(absl::string_view call, DevicePtr ptr, uint64_t size_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Where a fake kernel's `count` (> 0) elements at `ptr` live, or nullptr after poisoning
  // the context the way that access would on a GPU.
  uint8_t* KernelAccessLocked(const BuiltinKernel& kernel, DevicePtr ptr, uint64_t count,
                              uint64_t element_size_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Runs a built-in kernel (fake_kernels.h) on this state's memory; an access outside a live
  // allocation (or a misaligned one) poisons the context the way it would on a GPU.
  void RunKernelLocked(const BuiltinKernel& k, uint64_t threads, absl::Span<const uint8_t> args)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t total_memory_bytes_;
  absl::Mutex mu_;
  std::map<DevicePtr, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  // Registered host ranges: start -> size.
  std::map<uintptr_t, uint64_t> registered_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Where the next allocation goes: kFirstAddress (fake_device.cc) at first, and only up.
  DevicePtr next_address_ ABSL_GUARDED_BY(mu_);
  // Empty while healthy; otherwise the sticky fault, without the call name.
  std::string fault_ ABSL_GUARDED_BY(mu_);
  // Set once by Shutdown: threads stop, waits end.
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // Every stream's queue, the legacy stream's (kLegacyQueue) included.
  std::map<uint64_t, std::unique_ptr<Queue>> queues_ ABSL_GUARDED_BY(mu_);
  uint64_t next_queue_id_ ABSL_GUARDED_BY(mu_) = kLegacyQueue + 1;
  std::map<uint64_t, EventState> events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_event_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Upload and argument bytes queued on every stream.
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpurpc::backend::fake

#endif  // GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_DEVICE_H_
