// The worker's session state: handle tables, bounds checks and launch checks over one
// backend Context. This is the core of the worker; it speaks protobuf messages but not
// gRPC (server/worker/service.cc is the gRPC edge).
//
// Fault contract: when the backend reports a sticky execution fault (ABORTED or
// DATA_LOSS), the call that observed it returns that status, and every later call
// FAILED_PRECONDITION naming it; the front end marks the session FAULTED on the first and
// ends the worker process.
//
// Thread safety: all methods may be called concurrently. Handle tables are guarded by one
// mutex that is never held across a blocking backend call.
#ifndef GPURPC_SERVER_WORKER_SESSION_H_
#define GPURPC_SERVER_WORKER_SESSION_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/handle_ids.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"

namespace gpurpc::worker {

// Largest payload of a unary upload/download or an inline command-stream upload.
inline constexpr uint64_t kMaxInlineBytes = 1ull << 20;
// Largest total of DownloadCommand bytes in one command batch.
inline constexpr uint64_t kMaxBatchDownloadBytes = 64ull << 20;

class Session {
 public:
  // `compiler` may be null (NVRTC missing): Compile then answers UNAVAILABLE with
  // `compiler_status`'s message. The compiler is not owned and must outlive the session.
  Session(std::unique_ptr<backend::Context> context, compiler::Compiler* compiler,
          absl::Status compiler_status);
  // Frees everything in dependency order: functions and modules, events, streams, buffers,
  // then the context.
  ~Session();

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const backend::DeviceInfo& device() const { return context_->device(); }

  // Per-session limits from the tenant's quota; 0 = no limit of its own.
  struct Limits {
    uint32_t max_streams = 0;
    uint32_t max_events = 0;
    uint32_t max_modules = 0;
  };
  // Binds the session to the tenant the front end handed it to (see worker_control.proto).
  // FAILED_PRECONDITION when already bound. Until bound, the tenant is "" and there are no
  // limits: the front end binds every worker before it relays a client's call to it.
  absl::Status Bind(const std::string& tenant, const Limits& limits);
  std::string tenant() const;

  // Memory.
  absl::StatusOr<v1::BufferInfo> Allocate(uint64_t size_bytes);
  absl::Status Free(uint64_t buffer_id);
  absl::StatusOr<v1::BufferInfo> GetAllocation(const v1::GetAllocationRequest& request);
  absl::StatusOr<backend::MemInfo> GetMemInfo();
  // Resolves `pointer` to a device address such that [address, address + size_bytes) lies
  // inside one buffer (or module global) of this session. `what` names the operand in
  // error messages ("destination", "source").
  absl::StatusOr<backend::DevicePtr> Resolve(const v1::DevicePointer& pointer,
                                             uint64_t size_bytes, const char* what);
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
  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id,
                                                     const std::string& name);
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
  // limits, then enqueues it.
  absl::Status Launch(const v1::LaunchCommand& launch);

  // Runs one command-stream batch in order and fills `reply`. Returns non-OK only for a
  // sticky fault (the stream must then end with that status); per-command errors go into
  // `reply.error`. `last_sequence` is the highest sequence seen on this stream so far; it
  // is advanced.
  absl::Status RunBatch(const v1::CommandBatch& batch, uint64_t* last_sequence,
                        v1::CommandReply* reply);

  // OK, or FAILED_PRECONDITION naming the sticky fault once one happened.
  absl::Status fault() const;

 private:
  struct ModuleEntry {
    std::unique_ptr<backend::Module> module;
    std::map<std::string, uint64_t> functions_by_name;
    std::vector<backend::DevicePtr> global_addresses;
  };
  struct FunctionEntry {
    backend::Function* function = nullptr;
    std::string name;
    std::shared_ptr<ModuleEntry> module;  // keeps the module loaded while in use
    uint64_t module_id = 0;
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

  absl::StatusOr<std::shared_ptr<backend::Stream>> FindStream(uint64_t stream_id);
  absl::StatusOr<std::shared_ptr<backend::Event>> FindEvent(uint64_t event_id);
  absl::StatusOr<std::shared_ptr<FunctionEntry>> FindFunction(uint64_t function_id);
  // Under mu_.
  absl::StatusOr<backend::DevicePtr> ResolveLocked(const v1::DevicePointer& pointer,
                                                   uint64_t size_bytes, const char* what);
  absl::Status CheckLaunchDims(const FunctionEntry& entry, const v1::LaunchCommand& launch,
                               backend::LaunchConfig* config) const;
  // The launch's arguments as the kernel takes them: the packed blob itself, or typed
  // arguments packed into `scratch`.
  absl::StatusOr<absl::Span<const uint8_t>> PackArgs(const FunctionEntry& entry,
                                                     const v1::LaunchCommand& launch,
                                                     std::vector<uint8_t>* scratch);
  absl::Status RunCommand(const v1::Command& command, v1::CommandReply* reply,
                          uint64_t* download_bytes);
  // A fresh id that no live handle of this session has. Under mu_.
  uint64_t NewIdLocked();
  // RESOURCE_EXHAUSTED naming the quota when `count` objects of a kind already reach
  // `limit` (0 = none). Under mu_.
  absl::Status CheckCountLocked(const char* what, size_t count, uint32_t limit,
                                const char* quota_name) const;

  std::unique_ptr<backend::Context> context_;
  compiler::Compiler* compiler_;
  absl::Status compiler_status_;
  HandleIdGenerator ids_;

  mutable std::mutex mu_;
  bool bound_ = false;                                  // guarded by mu_
  std::string tenant_;                                  // guarded by mu_
  Limits limits_;                                       // guarded by mu_
  absl::Status fault_;                                  // guarded by mu_
  std::map<backend::DevicePtr, Range> ranges_;          // by start address
  std::unordered_map<uint64_t, backend::DevicePtr> buffers_;
  std::unordered_map<uint64_t, std::shared_ptr<ModuleEntry>> modules_;
  std::unordered_map<uint64_t, std::shared_ptr<FunctionEntry>> functions_;
  std::unordered_map<uint64_t, std::shared_ptr<backend::Stream>> streams_;
  std::unordered_map<uint64_t, std::shared_ptr<backend::Event>> events_;
  std::atomic<bool> faulted_{false};
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_SESSION_H_
