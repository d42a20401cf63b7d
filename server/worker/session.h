// The worker's session state: handle tables, bounds checks and launch checks over one
// backend Context. This is the core of the worker; it speaks protobuf messages but not
// gRPC (server/worker/service.cc is the gRPC edge).
//
// Fault contract: when the backend reports a sticky execution fault (ABORTED or
// DATA_LOSS), the call that observed it returns that status, and every later call
// FAILED_PRECONDITION naming it; the front end marks the session FAULTED on the first and
// ends the worker process. A call that does not pass through the front end (a same-host
// direct channel) cannot tell it, so the first fault also runs `on_fault` (set_on_fault; in
// the worker: write the cause to the status pipe and end the process shortly after, which
// the front end sees as the fault).
//
// Kernel watchdog: Bind with a non-zero Limits::kernel_timeout_ms starts a Watchdog
// (watchdog.h) that every successful launch, unary or in a command batch, reports to (a
// graph launch as one kernel named "graph exec <id>"; a launch that a capture records, never);
// a kernel that runs past the timeout calls `on_kernel_timeout` (in the worker: write the
// reason to the front end's status pipe and _exit(kWorkerExitKernelTimeout)).
//
// Names (kernels, globals) are C strings to the driver: a name with a NUL byte, an empty
// name or one over kMaxNameBytes is INVALID_ARGUMENT naming the field.
//
// Thread safety: all methods may be called concurrently. Handle tables are guarded by one
// mutex that is never held across a backend call. Each stream's capture lock (CUDA graphs,
// see BeginCapture) is held across the enqueue of work a capture records on that stream.
// Functions and globals stay valid while a
// call uses them even if their module is unloaded concurrently: calls hold the module's
// entry (a shared_ptr) for their duration, and a function looked up while its module is
// being unloaded is never registered.
#ifndef GPURPC_SERVER_WORKER_SESSION_H_
#define GPURPC_SERVER_WORKER_SESSION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/handle_ids.h"
#include "common/limits.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/host_region_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/handle_table.h"
#include "server/worker/watchdog.h"

namespace gpurpc::worker {

class DeviceOutput;

// Largest payload of a unary upload/download or an inline command-stream upload.
inline constexpr uint64_t kMaxInlineBytes = 1ull << 20;
// Largest total of DownloadCommand bytes in one command batch.
inline constexpr uint64_t kMaxBatchDownloadBytes = 64ull << 20;
// Longest kernel or global name looked up in a module.
inline constexpr size_t kMaxNameBytes = 4096;
// Largest parameter block a kernel may report (CUDA 12.1+ on Volta and later: 32764 bytes).
inline constexpr uint32_t kMaxParamBytes = 32764;
// Compiles of one session running at once, whatever the tenant's quota says: each one that
// misses the cache is a compile helper process (compiler/compile_helper.h).
inline constexpr uint32_t kMaxConcurrentCompiles = 8;
// CUDA graphs of one session (execution_service.proto): graphs (captures in progress
// count), graph execs, and the worker memory all of them may take, counted as every node's
// kernel arguments plus kGraphNodeOverheadBytes (a graph exec counts its nodes again).
inline constexpr size_t kMaxGraphsPerSession = 1024;
inline constexpr size_t kMaxGraphExecsPerSession = 1024;
inline constexpr uint64_t kMaxGraphBytesPerSession = 256ull << 20;
inline constexpr uint64_t kGraphNodeOverheadBytes = 256;

// Bounds of ModuleService.SetContextLimit (module_service.proto). The stack, printf FIFO and
// malloc heap are device memory the driver reserves for the context outside the session's
// buffers. The front end charges them to the tenant's ledger (proxy.cc, SessionManager::
// ReserveContextLimit); these fixed bounds (and the tenant's max_device_memory_bytes, see
// Session::SetContextLimit) bound them also where no quota is set.
// Stack bytes per GPU thread, and what the driver reserves for all of them (the stack size
// times every thread the device can hold: multiprocessors x max threads per multiprocessor;
// about 270k threads on an H200, so 4 GiB allows about 15 KiB per thread there).
// (kMaxStackBytesPerThread, kMaxStackReservationBytes, kMaxPrintfFifoBytes and
// kMaxMallocHeapBytes are in common/limits.h: the front end charges by them.)
// The device runtime (dynamic parallelism): nesting depth (CUDA's own maximum) and pending
// launches (each reserves a launch slot in device memory; the default is 2048).
inline constexpr uint64_t kMaxDevRuntimeSyncDepth = 24;
inline constexpr uint64_t kMaxDevRuntimePendingLaunchCount = 32768;
// CU_LIMIT_MAX_L2_FETCH_GRANULARITY takes 0 to 128 bytes.
inline constexpr uint64_t kMaxL2FetchGranularityBytes = 128;

class Session {
 public:
  // `compiler` may be null (NVRTC missing): Compile then answers UNAVAILABLE with
  // `compiler_status`'s message. The compiler is not owned and must outlive the session.
  // `on_kernel_timeout` is the watchdog's fire action (null: ExitOnKernelTimeout(-1)).
  Session(std::unique_ptr<backend::Context> context, compiler::Compiler* compiler,
          absl::Status compiler_status, Watchdog::FireFn on_kernel_timeout = nullptr);
  // Stops the watchdog, then frees everything in dependency order: functions and modules,
  // events, streams, buffers, then the context.
  ~Session();

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const backend::DeviceInfo& device() const { return context_->device(); }

  // Per-session limits from the tenant's quota; 0 = no limit of its own.
  struct Limits {
    uint32_t max_streams = 0;
    uint32_t max_events = 0;
    uint32_t max_modules = 0;
    // Compiles at once (never more than kMaxConcurrentCompiles).
    uint32_t max_concurrent_compiles = 0;
    // The kernel watchdog's timeout; 0 = no watchdog.
    uint64_t kernel_timeout_ms = 0;
    // Same-host regions of the session, bytes (the daemon's --max-host-region-bytes).
    uint64_t max_host_region_bytes = 0;
    // The tenant's max_device_memory_bytes: what SetContextLimit's reservations (stack,
    // printf FIFO, malloc heap) may add up to at most.
    uint64_t max_device_memory_bytes = 0;
  };
  // Binds the session to the tenant the front end handed it to (see worker_control.proto)
  // and starts the watchdog when the limits ask for one. FAILED_PRECONDITION when already
  // bound. Until bound, the tenant is "" and there are no limits: the front end binds every
  // worker before it relays a client's call to it.
  absl::Status Bind(const std::string& tenant, const Limits& limits) ABSL_LOCKS_EXCLUDED(mu_);
  std::string tenant() const ABSL_LOCKS_EXCLUDED(mu_);

  // How many objects the session's tables hold (tests, and to show they stay bounded).
  struct TableSizes {
    size_t buffers = 0;
    size_t arrays = 0;
    size_t ranges = 0;
    size_t modules = 0;
    size_t functions = 0;
    size_t streams = 0;
    size_t events = 0;
    size_t regions = 0;
    size_t graphs = 0;
    size_t graph_execs = 0;
  };
  TableSizes table_sizes() const ABSL_LOCKS_EXCLUDED(mu_);
  // The watchdog started by Bind, or null (tests).
  const Watchdog* watchdog() const { return watchdog_ptr_.load(std::memory_order_acquire); }

  // Memory.
  absl::StatusOr<v1::BufferInfo> Allocate(uint64_t size_bytes);
  // A CUDA array (MemoryService.Allocate with an ArrayDescriptor): INVALID_ARGUMENT for a
  // shape common/array_shape.h refuses. Its id shares the buffers' id space; its BufferInfo
  // has device_address 0 and the bytes it is charged.
  absl::StatusOr<v1::BufferInfo> AllocateArray(const v1::ArrayDescriptor& descriptor);
  // Frees a buffer or an array; closes a buffer opened by OpenExportedMemory.
  absl::Status Free(uint64_t buffer_id);
  // CUDA IPC's worker half (worker_control.proto): the driver's handle of a buffer of this
  // session and its size (NOT_FOUND for an unknown buffer, INVALID_ARGUMENT for one that was
  // itself opened from another session's export), and a handle opened as a new buffer of
  // `size_bytes` (> 0) that Free closes.
  struct ExportedMemory {
    std::string ipc_handle;
    uint64_t size_bytes = 0;
  };
  absl::StatusOr<ExportedMemory> ExportMemory(uint64_t buffer_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::BufferInfo> OpenExportedMemory(const std::string& ipc_handle,
                                                    uint64_t size_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::BufferInfo> GetAllocation(const v1::GetAllocationRequest& request);
  absl::StatusOr<backend::MemInfo> GetMemInfo();
  // Resolves `pointer` to a device address such that [address, address + size_bytes) lies
  // inside one buffer (or module global) of this session. `what` names the operand in
  // error messages ("destination", "source").
  absl::StatusOr<backend::DevicePtr> Resolve(const v1::DevicePointer& pointer, uint64_t size_bytes,
                                             const char* what);
  absl::Status Upload(backend::DevicePtr address, const void* data, uint64_t size_bytes,
                      uint64_t stream_id);
  // The same for bytes that arrived in several pieces, laid end to end (Backend::UploadPieces);
  // the single-buffer form above is one piece of this.
  absl::Status Upload(backend::DevicePtr address,
                      absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t size_bytes,
                      uint64_t stream_id);
  absl::Status Download(backend::DevicePtr address, void* data, uint64_t size_bytes,
                        uint64_t stream_id);
  absl::Status Memset(const v1::MemsetCommand& command);
  absl::Status Copy(const v1::CopyCommand& command);
  // Copy3DCommand (execution_service.proto): every byte of both ends checked against its
  // array or its one buffer; refused (FAILED_PRECONDITION) on a capturing stream.
  absl::Status Copy3D(const v1::Copy3DCommand& command);

  // Modules.
  // Compiles and, unless compile_only, loads the result; the response's module_id and
  // device_memory_bytes are set when it was loaded.
  absl::StatusOr<v1::CompileResponse> Compile(const v1::CompileRequest& request);
  // Loads `image` and returns the module id. When `device_memory_bytes` is not null it is
  // set to the device memory the module's globals take (backend::Module::
  // device_memory_bytes: UINT64_MAX when unbounded), for LoadModuleResponse.
  absl::StatusOr<uint64_t> LoadModule(const std::string& image,
                                      uint64_t* device_memory_bytes = nullptr);
  // Links the request's inputs into one loaded module (ModuleService.LinkModule: its
  // contract, codes and bounds, common/limits.h). Sources compile as Compile compiles them
  // (same compiler, cache and compile slots) with relocatable device code, for the device's
  // virtual architecture unless their options name one; standard libraries are read from
  // the toolkit (compiler/cuda_libraries.h); the backend links and loads. Every input is
  // checked before anything is compiled or linked. A source that fails to compile is OK
  // with success = false and nothing linked.
  absl::StatusOr<v1::LinkModuleResponse> LinkModule(const v1::LinkModuleRequest& request);
  absl::Status UnloadModule(uint64_t module_id);
  // INVALID_ARGUMENT for a bad name (see the file comment) and for a kernel whose parameter
  // layout, as the driver reports it, cannot be packed (an empty parameter, parameters that
  // overlap, or one ending past kMaxParamBytes); NOT_FOUND when the module was unloaded
  // while the kernel was looked up.
  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id, const std::string& name);
  absl::StatusOr<v1::GetGlobalResponse> GetGlobal(uint64_t module_id, const std::string& name);

  // Context and function configuration (the contract is ModuleService's in
  // module_service.proto). Enum arguments are the wire's values and are checked here:
  // one that is not a value of its enum is INVALID_ARGUMENT naming it, as is a value
  // outside its bound (the bounds above).
  //
  // SetContextLimit also refuses (RESOURCE_EXHAUSTED) a stack, printf FIFO or malloc heap
  // that would make the three reservations together exceed Limits::max_device_memory_bytes;
  // it answers the value the driver reports afterwards and the reservations.
  absl::StatusOr<v1::SetContextLimitResponse> SetContextLimit(int limit, uint64_t value)
      ABSL_LOCKS_EXCLUDED(mu_, limits_mu_);
  absl::StatusOr<uint64_t> GetContextLimit(int limit);
  absl::Status SetCacheConfig(int config);
  // ModuleService.SetProfiling: the backend's answer; on success, whether it was on before.
  absl::StatusOr<bool> SetProfiling(bool enabled) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int> GetCacheConfig();
  // Checks `config` (and `function_id` when not 0), then does what CUDA 13 does on every
  // device it supports: nothing (the bank width is fixed at four bytes).
  absl::Status SetSharedConfig(int config, uint64_t function_id);
  // SHARED_CONFIG_FOUR_BYTE_BANK_SIZE (see SetSharedConfig).
  absl::StatusOr<int> GetSharedConfig();
  absl::StatusOr<v1::SetFunctionAttributeResponse> SetFunctionAttribute(uint64_t function_id,
                                                                        int attribute,
                                                                        int64_t value);
  absl::Status SetFunctionCacheConfig(uint64_t function_id, int config);

  // Streams and events.
  absl::StatusOr<uint64_t> CreateStream(bool non_blocking);
  absl::Status DestroyStream(uint64_t stream_id);
  absl::Status SynchronizeStream(uint64_t stream_id);
  absl::StatusOr<bool> QueryStream(uint64_t stream_id);
  absl::Status Synchronize();
  // An interprocess event (shareable through ExportEvent) needs disable_timing:
  // INVALID_ARGUMENT otherwise.
  absl::StatusOr<uint64_t> CreateEvent(bool disable_timing, bool blocking_sync,
                                       bool interprocess = false);
  // Destroying an exported event drops its id, but the backend event is kept until the
  // session ends (other sessions may have opened it); it counts against max_events until
  // then. Destroying an opened one closes it.
  absl::Status DestroyEvent(uint64_t event_id);
  // CUDA IPC of events' worker half (worker_control.proto): the driver's handle of an
  // interprocess event (NOT_FOUND for an unknown event; INVALID_ARGUMENT for one not created
  // interprocess, or opened from an export; RESOURCE_EXHAUSTED beyond
  // kMaxExportedEventsPerSession events exported), and a handle opened as a new event.
  absl::StatusOr<std::string> ExportEvent(uint64_t event_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<uint64_t> OpenExportedEvent(const std::string& ipc_handle)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RecordEvent(uint64_t event_id, uint64_t stream_id);
  absl::StatusOr<bool> QueryEvent(uint64_t event_id);
  absl::Status SynchronizeEvent(uint64_t event_id);
  absl::StatusOr<float> ElapsedTime(uint64_t start_event_id, uint64_t end_event_id);
  absl::Status StreamWaitEvent(uint64_t stream_id, uint64_t event_id);

  // Same-host regions (proto/gpurpc/v1/host_region_service.proto; the implementation is in
  // session_regions.cc). The path clients attach regions through, "" when the daemon serves
  // none (RegisterHostRegion is then FAILED_PRECONDITION). Set before serving.
  void set_region_socket(std::string path) { region_socket_ = std::move(path); }
  // Where kernels' printf output is captured (device_output.h); none when unset. Set before
  // serving; not owned, outlives the session.
  void set_device_output(DeviceOutput* output) { device_output_ = output; }
  // The device printf output captured since the last take ("" without a capture). The
  // synchronising answers call it after the synchronisation.
  std::string TakeDeviceOutput();
  // Runs once, on the thread that observed it, when the first sticky fault is recorded (with
  // that fault). Set before serving.
  void set_on_fault(std::function<void(const absl::Status&)> on_fault) {
    on_fault_ = std::move(on_fault);
  }
  // Reserves a region: INVALID_ARGUMENT for size 0, RESOURCE_EXHAUSTED past
  // Limits::max_host_region_bytes or kMaxHostRegionsPerSession.
  absl::StatusOr<v1::RegisterHostRegionResponse> RegisterHostRegion(uint64_t size_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Maps and pins the memfd `fd` (not taken: the caller closes it) as region `region_id`
  // when `ticket` is the region's ticket and the region waits for its memfd. NOT_FOUND,
  // without saying which, for an unknown region, a wrong ticket or a region that is already
  // attached; INVALID_ARGUMENT for a memfd MappedRegion::Map refuses (the region then still
  // waits: the client may retry with a good one).
  absl::Status AttachHostRegion(uint64_t region_id, const std::string& ticket, int fd)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the session's queued work, then unpins and unmaps the region.
  absl::Status UnregisterHostRegion(uint64_t region_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Enqueues a copy between an attached region and a buffer of the session.
  absl::Status CopyHostRegion(const v1::RegionCopyCommand& command) ABSL_LOCKS_EXCLUDED(mu_);
  // A one-time ticket for a direct channel (HostRegionService.OpenDirectChannel):
  // RESOURCE_EXHAUSTED when kMaxDirectChannelsPerSession tickets wait unused.
  absl::StatusOr<v1::OpenDirectChannelResponse> OpenDirectChannel() ABSL_LOCKS_EXCLUDED(mu_);
  // Uses up `ticket`; NOT_FOUND when it is not one of the session's unused tickets.
  absl::Status TakeDirectTicket(const std::string& ticket) ABSL_LOCKS_EXCLUDED(mu_);

  // Checks a launch against the kernel's parameter layout and the device and function
  // limits, then enqueues it (and reports it to the watchdog). Typed u8/u16 arguments must
  // fit their width: a larger value is INVALID_ARGUMENT naming the parameter, its type and
  // the value, never truncated.
  absl::Status Launch(const v1::LaunchCommand& launch);
  // ExecutionService.Launch with `synchronize`: Launch, then SynchronizeStream on the
  // launch's stream. A stream that captures when the call begins (or stream 0 while a
  // blocking stream captures) is refused FAILED_PRECONDITION before anything is enqueued,
  // as SynchronizeStream would refuse it; an argument error returns before the wait. A wait
  // that fails after the launch for any reason but a fault (a capture or DestroyStream of
  // another call in between) says in its message that the kernel was enqueued.
  absl::Status LaunchAndSynchronize(const v1::LaunchCommand& launch);

  // CUDA graphs (the contract is ExecutionService's in execution_service.proto; the
  // implementation is in session_graphs.cc). A capture records what Launch, Memset and Copy
  // enqueue on its stream while it lasts; work that cannot be captured is refused with
  // FAILED_PRECONDITION before the backend sees it (Upload, Download, SynchronizeStream,
  // QueryStream, RecordEvent, StreamWaitEvent and LaunchGraph on a capturing stream; any of
  // them and these three on stream 0 while a blocking stream captures; Synchronize while
  // any stream captures), so that the capture goes on. DestroyStream abandons a capture.
  //
  // Each stream has a capture state whose lock is held while work that a capture records
  // (Launch, Memset, Copy, LaunchGraph) is enqueued on it, so that a capture begins or ends
  // between two such pieces of work, never during one; beginning the capture of a blocking
  // stream also holds stream 0's. Lock order: a graph exec's lock, then a stream's capture
  // lock, then mu_.
  // `mode` is a v1::CaptureMode value (the capture is RELAXED whatever it says).
  absl::Status BeginCapture(uint64_t stream_id, int mode) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::EndCaptureResponse> EndCapture(uint64_t stream_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::GetCaptureInfoResponse> GetCaptureInfo(uint64_t stream_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<uint64_t> InstantiateGraph(uint64_t graph_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Enqueues a graph exec (and reports it to the watchdog, named "graph exec <id>").
  absl::Status LaunchGraph(const v1::LaunchGraphCommand& launch) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DestroyGraph(uint64_t graph_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DestroyGraphExec(uint64_t graph_exec_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::GetGraphNodesResponse> GetGraphNodes(uint64_t graph_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status UpdateGraphExec(uint64_t graph_exec_id, uint64_t graph_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Checks the arguments and dimensions exactly like Launch.
  absl::Status SetGraphExecKernelNodeArgs(const v1::SetGraphExecKernelNodeArgsRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs one command-stream batch in order and fills `reply`. Returns non-OK for a sticky
  // fault (the stream must then end with that status) and INVALID_ARGUMENT for a batch
  // whose sequence numbers do not increase (nothing of it runs); other per-command errors
  // go into `reply.error`, and the rest of the batch is skipped. `last_sequence` is the
  // highest sequence seen on this stream so far; it is advanced.
  absl::Status RunBatch(const v1::CommandBatch& batch, uint64_t* last_sequence,
                        v1::CommandReply* reply);

  // OK, or FAILED_PRECONDITION naming the sticky fault once one happened.
  absl::Status fault() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct ModuleEntry {
    std::unique_ptr<backend::Module> module;
    // Guarded by the session's mu_ (an annotation cannot name another object's member).
    std::map<std::string, uint64_t> functions_by_name;
    std::vector<backend::DevicePtr> global_addresses;
  };
  struct FunctionEntry {
    backend::Function* function = nullptr;    // owned by `module`
    std::shared_ptr<const std::string> name;  // shared with the watchdog's markers
    std::shared_ptr<ModuleEntry> module;      // keeps the module loaded while in use
    uint64_t module_id = 0;
    // The packed size of the parameters: the end of the last byte of any of them, checked
    // (CheckParamLayout) when the function was looked up.
    uint32_t packed_bytes = 0;
    // Attributes set with SetFunctionAttribute (-1 for the dynamic shared memory: not set,
    // the loaded attributes() hold; the carveout's default is -1).
    std::atomic<int> max_dynamic_shared_bytes{-1};
    std::atomic<int> carveout{-1};
  };
  // A same-host region (session_regions.cc).
  struct RegionEntry;

  // CUDA graphs (session_graphs.cc). One node as the session recorded it when it was
  // captured (or set since, for a graph exec's nodes).
  struct GraphNodeRecord {
    v1::GraphNodeType type = v1::GRAPH_NODE_TYPE_UNSPECIFIED;
    // Kernel nodes: the function (which keeps its module loaded), its id, the launch.
    std::shared_ptr<FunctionEntry> function;
    uint64_t function_id = 0;
    backend::LaunchConfig config;
    // What it counts against kMaxGraphBytesPerSession.
    uint64_t cost_bytes = 0;
  };
  struct StreamCapture;   // a stream's capture state
  struct GraphEntry;      // a graph
  struct GraphExecEntry;  // a graph exec
  struct StreamAndCapture {
    std::shared_ptr<backend::Stream> stream;  // null for stream 0
    std::shared_ptr<StreamCapture> capture;
  };

  // An array and what Copy3D checks against. Shared so that a copy in flight keeps it alive
  // while Free takes it out of the table.
  struct ArrayEntry {
    std::shared_ptr<backend::Array> array;
    backend::ArrayShape shape;
    uint64_t charged_bytes = 0;
  };
  // One end of a Copy3D, resolved and checked.
  struct Copy3DSide {
    backend::Copy3DEnd end;
    std::shared_ptr<backend::Array> keep;
  };
  absl::StatusOr<Copy3DSide> ResolveCopy3DEnd(const v1::Copy3DEndpoint& endpoint,
                                              const v1::Copy3DCommand& command, const char* what)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A resolvable device range: a buffer (id != 0) or a module global (id == 0).
  struct Range {
    uint64_t id = 0;
    uint64_t size_bytes = 0;
  };

  // Passes a backend status through the fault contract (top of this file): OK and
  // non-sticky errors come back unchanged; the first sticky fault (ABORTED or DATA_LOSS) is
  // recorded, runs on_fault_ and comes back unchanged; a sticky fault after the first comes
  // back as fault() (FAILED_PRECONDITION naming the first).
  // Every backend result goes through it before it is returned.
  absl::Status RecordFault(absl::Status status);
  template <typename T>
  absl::StatusOr<T> RecordFault(absl::StatusOr<T> value) {
    if (value.ok()) return value;
    return RecordFault(value.status());
  }

  // fault()'s FAILED_PRECONDITION, once a fault was recorded.
  absl::Status FaultLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<backend::Stream>> FindStream(uint64_t stream_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<backend::Event>> FindEvent(uint64_t event_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<FunctionEntry>> FindFunction(uint64_t function_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<backend::DevicePtr> ResolveLocked(const v1::DevicePointer& pointer,
                                                   uint64_t size_bytes, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A function's attributes as GetFunction and SetFunctionAttribute report them.
  static void FillAttributes(const FunctionEntry& entry, v1::FunctionAttributes* out);
  // What the driver reserves for a stack of `stack_bytes` per thread: for every thread the
  // device can hold (saturating).
  uint64_t StackReservationBytes(uint64_t stack_bytes) const;
  absl::Status CheckLaunchDims(const FunctionEntry& entry, const v1::LaunchCommand& launch,
                               backend::LaunchConfig* config) const;
  // The launch's arguments as the kernel takes them: the packed blob itself, or typed
  // arguments packed into `scratch`.
  absl::StatusOr<absl::Span<const uint8_t>> PackArgs(const FunctionEntry& entry,
                                                     const v1::LaunchCommand& launch,
                                                     std::vector<uint8_t>* scratch)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunCommand(const v1::Command& command, v1::CommandReply* reply,
                          uint64_t* download_bytes);

  // CUDA graphs (session_graphs.cc).
  static std::shared_ptr<StreamCapture> NewStreamCapture(bool blocking);
  // NOT_FOUND for an unknown stream; stream 0's capture state is legacy_capture_.
  absl::StatusOr<StreamAndCapture> FindStreamCapture(uint64_t stream_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Enqueues work that a capture records: `enqueue(stream, capturing)` runs with the
  // stream's capture lock held; while the stream captures, `describe()` is recorded as a
  // node once `enqueue` succeeded. `what` names the call in errors.
  absl::Status EnqueueCapturable(uint64_t stream_id, const char* what,
                                 absl::FunctionRef<GraphNodeRecord()> describe,
                                 absl::FunctionRef<absl::Status(backend::Stream*, bool)> enqueue)
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION naming `what` for work that cannot be captured on a capturing stream
  // (see BeginCapture), or on stream 0 while a blocking stream captures; OK otherwise, also
  // for an unknown stream (the caller reports that).
  absl::Status RefuseWhileCapturing(uint64_t stream_id, const char* what) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RefuseWhileAnyCaptures(const char* what) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a capture of a stream being destroyed, dropping what it recorded.
  void AbandonCapture(uint64_t stream_id, backend::Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);
  // ~Session: abandons captures, then destroys graph execs and graphs.
  void ReleaseGraphs() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReserveGraphBytesLocked(uint64_t bytes, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseGraphBytes(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // A fresh id that no live handle of this session has. Nothing is remembered per id
  // (HandleIdGenerator), so creating and destroying handles in a loop grows nothing.
  uint64_t NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the quota when `count` objects of a kind already reach
  // `limit` (0 = none).
  // Registers a loaded module (LoadModule, LinkModule): RESOURCE_EXHAUSTED at the session's
  // module bound, when the module is dropped (unloaded).
  absl::StatusOr<uint64_t> AddModule(std::unique_ptr<backend::Module> module)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckCountLocked(const char* what, size_t count, uint32_t limit,
                                const char* quota_name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckCountLocked for one more event (retained exported events count).
  absl::Status CheckEventCountLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Compile's slot: RESOURCE_EXHAUSTED when the session's compiles at once are at their
  // bound; EndCompile gives the slot back.
  absl::Status BeginCompile() ABSL_LOCKS_EXCLUDED(mu_);
  void EndCompile() ABSL_LOCKS_EXCLUDED(mu_);

  std::unique_ptr<backend::Context> context_;
  compiler::Compiler* const compiler_;
  const absl::Status compiler_status_;
  const Watchdog::FireFn on_kernel_timeout_;
  HandleIdGenerator ids_;

  // Serialises SetContextLimit, whose check reads the other limits (never held with mu_).
  absl::Mutex limits_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  bool bound_ ABSL_GUARDED_BY(mu_) = false;
  std::string tenant_ ABSL_GUARDED_BY(mu_);
  Limits limits_ ABSL_GUARDED_BY(mu_);
  absl::Status fault_ ABSL_GUARDED_BY(mu_);
  uint32_t compiles_running_ ABSL_GUARDED_BY(mu_) = 0;
  bool profiling_ ABSL_GUARDED_BY(mu_) = false;
  std::map<backend::DevicePtr, Range> ranges_ ABSL_GUARDED_BY(mu_);  // by start address
  // The handles the client holds, one table per kind (handle_table.h).
  HandleTable<backend::DevicePtr> buffers_ ABSL_GUARDED_BY(mu_){"buffer"};
  HandleTable<ArrayEntry> arrays_ ABSL_GUARDED_BY(mu_){"array"};
  // Buffers opened from another session's export (by address): Free closes them.
  absl::flat_hash_set<backend::DevicePtr> opened_ ABSL_GUARDED_BY(mu_);
  HandleTable<std::shared_ptr<ModuleEntry>> modules_ ABSL_GUARDED_BY(mu_){"module"};
  HandleTable<std::shared_ptr<FunctionEntry>> functions_ ABSL_GUARDED_BY(mu_){"function"};
  HandleTable<std::shared_ptr<backend::Stream>> streams_ ABSL_GUARDED_BY(mu_){"stream"};
  HandleTable<std::shared_ptr<backend::Event>> events_ ABSL_GUARDED_BY(mu_){"event"};
  // The events of events_ that take part in CUDA IPC, and exported events destroyed by the
  // client, kept until the session ends (DestroyEvent).
  enum class EventIpc { kInterprocess, kExported, kOpened };
  absl::flat_hash_map<uint64_t, EventIpc> event_ipc_ ABSL_GUARDED_BY(mu_);
  // By the id they had, which no new handle gets (the front end's record of the export
  // stays keyed by it).
  absl::flat_hash_map<uint64_t, std::shared_ptr<backend::Event>> retained_events_
      ABSL_GUARDED_BY(mu_);
  // Events exported over the session's life (at most kMaxExportedEventsPerSession).
  size_t exported_events_ ABSL_GUARDED_BY(mu_) = 0;
  HandleTable<std::shared_ptr<RegionEntry>> regions_ ABSL_GUARDED_BY(mu_){"region"};
  uint64_t region_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // summed over regions_
  // Direct-channel tickets issued and not yet claimed (session_regions.cc).
  std::vector<std::string> direct_tickets_ ABSL_GUARDED_BY(mu_);
  // CUDA graphs: every stream's capture state (by stream id; stream 0's is legacy_capture_),
  // the streams that capture, graphs, graph execs (and instantiations under way), and the
  // bytes they count against kMaxGraphBytesPerSession.
  std::unordered_map<uint64_t, std::shared_ptr<StreamCapture>> stream_captures_
      ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<StreamCapture> legacy_capture_ = NewStreamCapture(/*blocking=*/false);
  std::set<uint64_t> capturing_streams_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> blocking_capturing_streams_ ABSL_GUARDED_BY(mu_);
  HandleTable<std::shared_ptr<GraphEntry>> graphs_ ABSL_GUARDED_BY(mu_){"graph"};
  HandleTable<std::shared_ptr<GraphExecEntry>> graph_execs_ ABSL_GUARDED_BY(mu_){"graph exec"};
  size_t graph_execs_pending_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t graph_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The sizes of capturing_streams_ and blocking_capturing_streams_, read without mu_.
  std::atomic<size_t> captures_active_{0};
  std::atomic<size_t> blocking_captures_active_{0};
  std::string region_socket_;
  DeviceOutput* device_output_ = nullptr;
  std::function<void(const absl::Status&)> on_fault_;
  std::atomic<bool> faulted_{false};
  // Set once by Bind; the launch path reads the pointer without mu_.
  std::unique_ptr<Watchdog> watchdog_ ABSL_GUARDED_BY(mu_);
  std::atomic<Watchdog*> watchdog_ptr_{nullptr};
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_SESSION_H_
