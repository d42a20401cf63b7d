// The worker's session state: handle tables, bounds checks and launch checks over one
// backend Context. This is the core of the worker; it speaks protobuf messages but not
// gRPC (server/worker/service.cc is the gRPC edge).
//
// Fault contract: when the backend reports a sticky execution fault (ABORTED or
// DATA_LOSS), the call that observed it returns that status, and every later call
// FAILED_PRECONDITION naming it; the front end marks the session FAULTED on the first and
// ends the worker process.
//
// Kernel watchdog: Bind with a non-zero Limits::kernel_timeout_ms starts a Watchdog
// (watchdog.h) that every successful launch, unary or in a command batch, reports to; a
// kernel that runs past the timeout calls `on_kernel_timeout` (in the worker: write the
// reason to the front end's status pipe and _exit(kExitKernelTimeout)).
//
// Names (kernels, globals) are C strings to the driver: a name with a NUL byte, an empty
// name or one over kMaxNameBytes is INVALID_ARGUMENT naming the field.
//
// Thread safety: all methods may be called concurrently. Handle tables are guarded by one
// mutex that is never held across a backend call. Functions and globals stay valid while a
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
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/handle_ids.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/watchdog.h"

namespace gpurpc::worker {

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
    size_t ranges = 0;
    size_t modules = 0;
    size_t functions = 0;
    size_t streams = 0;
    size_t events = 0;
  };
  TableSizes table_sizes() const ABSL_LOCKS_EXCLUDED(mu_);
  // The watchdog started by Bind, or null (tests).
  const Watchdog* watchdog() const { return watchdog_ptr_.load(std::memory_order_acquire); }

  // Memory.
  absl::StatusOr<v1::BufferInfo> Allocate(uint64_t size_bytes);
  absl::Status Free(uint64_t buffer_id);
  absl::StatusOr<v1::BufferInfo> GetAllocation(const v1::GetAllocationRequest& request);
  absl::StatusOr<backend::MemInfo> GetMemInfo();
  // Resolves `pointer` to a device address such that [address, address + size_bytes) lies
  // inside one buffer (or module global) of this session. `what` names the operand in
  // error messages ("destination", "source").
  absl::StatusOr<backend::DevicePtr> Resolve(const v1::DevicePointer& pointer, uint64_t size_bytes,
                                             const char* what);
  absl::Status Upload(backend::DevicePtr address, const void* data, uint64_t size_bytes,
                      uint64_t stream_id);
  absl::Status Download(backend::DevicePtr address, void* data, uint64_t size_bytes,
                        uint64_t stream_id);
  absl::Status Memset(const v1::MemsetCommand& command);
  absl::Status Copy(const v1::CopyCommand& command);

  // Modules.
  // Compiles and, unless compile_only, loads the result; the response's module_id and
  // device_memory_bytes are set when it was loaded.
  absl::StatusOr<v1::CompileResponse> Compile(const v1::CompileRequest& request);
  // Loads `image` and returns the module id. When `device_memory_bytes` is not null it is
  // set to the device memory the module's globals take (backend::Module::
  // device_memory_bytes: UINT64_MAX when unbounded), for LoadModuleResponse.
  absl::StatusOr<uint64_t> LoadModule(const std::string& image,
                                      uint64_t* device_memory_bytes = nullptr);
  absl::Status UnloadModule(uint64_t module_id);
  // INVALID_ARGUMENT for a bad name (see the file comment) and for a kernel whose parameter
  // layout, as the driver reports it, cannot be packed (an empty parameter, parameters that
  // overlap, or one ending past kMaxParamBytes); NOT_FOUND when the module was unloaded
  // while the kernel was looked up.
  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id, const std::string& name);
  absl::StatusOr<v1::GetGlobalResponse> GetGlobal(uint64_t module_id, const std::string& name);

  // Streams and events.
  absl::StatusOr<uint64_t> CreateStream(bool non_blocking);
  absl::Status DestroyStream(uint64_t stream_id);
  absl::Status SynchronizeStream(uint64_t stream_id);
  absl::StatusOr<bool> QueryStream(uint64_t stream_id);
  absl::Status Synchronize();
  absl::StatusOr<uint64_t> CreateEvent(bool disable_timing, bool blocking_sync);
  absl::Status DestroyEvent(uint64_t event_id);
  absl::Status RecordEvent(uint64_t event_id, uint64_t stream_id);
  absl::StatusOr<bool> QueryEvent(uint64_t event_id);
  absl::Status SynchronizeEvent(uint64_t event_id);
  absl::StatusOr<float> ElapsedTime(uint64_t start_event_id, uint64_t end_event_id);
  absl::Status StreamWaitEvent(uint64_t stream_id, uint64_t event_id);

  // Checks a launch against the kernel's parameter layout and the device and function
  // limits, then enqueues it (and reports it to the watchdog). Typed u8/u16 arguments must
  // fit their width: a larger value is INVALID_ARGUMENT naming the parameter, its type and
  // the value, never truncated.
  absl::Status Launch(const v1::LaunchCommand& launch);

  // Runs one command-stream batch in order and fills `reply`. Returns non-OK only for a
  // sticky fault (the stream must then end with that status); per-command errors go into
  // `reply.error`. `last_sequence` is the highest sequence seen on this stream so far; it
  // is advanced.
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
  };
  // A resolvable device range: a buffer (id != 0) or a module global (id == 0).
  struct Range {
    uint64_t id = 0;
    uint64_t size_bytes = 0;
  };

  // Records sticky faults; returns `status` unchanged.
  absl::Status Check(absl::Status status);
  template <typename T>
  absl::StatusOr<T> Check(absl::StatusOr<T> value) {
    if (!value.ok()) Check(value.status()).IgnoreError();
    return value;
  }

  absl::StatusOr<std::shared_ptr<backend::Stream>> FindStream(uint64_t stream_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<backend::Event>> FindEvent(uint64_t event_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<FunctionEntry>> FindFunction(uint64_t function_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<backend::DevicePtr> ResolveLocked(const v1::DevicePointer& pointer,
                                                   uint64_t size_bytes, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // A fresh id that no live handle of this session has. Nothing is remembered per id
  // (HandleIdGenerator), so creating and destroying handles in a loop grows nothing.
  uint64_t NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the quota when `count` objects of a kind already reach
  // `limit` (0 = none).
  absl::Status CheckCountLocked(const char* what, size_t count, uint32_t limit,
                                const char* quota_name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Compile's slot: RESOURCE_EXHAUSTED when the session's compiles at once are at their
  // bound; EndCompile gives the slot back.
  absl::Status BeginCompile() ABSL_LOCKS_EXCLUDED(mu_);
  void EndCompile() ABSL_LOCKS_EXCLUDED(mu_);

  std::unique_ptr<backend::Context> context_;
  compiler::Compiler* const compiler_;
  const absl::Status compiler_status_;
  const Watchdog::FireFn on_kernel_timeout_;
  HandleIdGenerator ids_;

  mutable absl::Mutex mu_;
  bool bound_ ABSL_GUARDED_BY(mu_) = false;
  std::string tenant_ ABSL_GUARDED_BY(mu_);
  Limits limits_ ABSL_GUARDED_BY(mu_);
  absl::Status fault_ ABSL_GUARDED_BY(mu_);
  uint32_t compiles_running_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<backend::DevicePtr, Range> ranges_ ABSL_GUARDED_BY(mu_);  // by start address
  std::unordered_map<uint64_t, backend::DevicePtr> buffers_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<ModuleEntry>> modules_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<FunctionEntry>> functions_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<backend::Stream>> streams_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<backend::Event>> events_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> faulted_{false};
  // Set once by Bind; the launch path reads the pointer without mu_.
  std::unique_ptr<Watchdog> watchdog_ ABSL_GUARDED_BY(mu_);
  std::atomic<Watchdog*> watchdog_ptr_{nullptr};
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_SESSION_H_
