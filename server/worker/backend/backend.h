// The device backend interface: the only layer of the worker that touches a device.
//
// Two implementations: `cuda` (the driver API, loaded with dlopen at run time) and `fake`
// (a host-memory test double that never passes for a GPU, asynchronous like CUDA: a thread
// per stream, the same ordering, faults that surface at a later call). The worker's session
// layer (server/worker/session.h) owns handle tables, bounds checks and argument checks; a
// backend only executes raw, already-validated operations on device addresses.
//
// Error contract for every method (absl codes, see DESIGN §3):
// - INVALID_ARGUMENT: the driver rejected an argument or an image. Device addresses are
//   arguments: an address argument that no allocation covers is INVALID_ARGUMENT, never
//   NOT_FOUND (a kernel's access outside one is an execution fault: ABORTED).
// - NOT_FOUND: a name (kernel, global) that the module does not have.
// - RESOURCE_EXHAUSTED: out of device memory or another driver resource.
// - ABORTED: a sticky execution fault (illegal address, trap, misaligned access, launch
//   failure...). The context is unusable afterwards; the worker reports it and exits.
// - DATA_LOSS: an uncorrectable ECC error (also sticky).
// - UNAVAILABLE: no driver or no device; also "not ready yet" (CUDA_ERROR_NOT_READY, see
//   Context::ElapsedTime).
// - FAILED_PRECONDITION: CUDA graph capture misuse (see Context::BeginCapture), and events
//   that cannot be timed (see Context::ElapsedTime).
// - INTERNAL: anything else.
// Messages name the driver call and the CUDA error name, e.g.
// "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was
// encountered)".
//
// Thread safety: a Context and the objects it creates may be used from several threads at
// once; implementations serialise internally where the driver needs it.
#ifndef GPURPC_SERVER_WORKER_BACKEND_BACKEND_H_
#define GPURPC_SERVER_WORKER_BACKEND_BACKEND_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gpurpc::backend {

// A device address in the context's address space.
using DevicePtr = uint64_t;

// What the front end and clients learn about a device.
struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  uint64_t total_memory_bytes = 0;
  int multiprocessor_count = 0;
  int max_threads_per_block = 0;
  std::array<int, 3> max_block_dim{};
  std::array<int, 3> max_grid_dim{};
  int max_shared_memory_per_block_bytes = 0;
  int max_shared_memory_per_block_optin_bytes = 0;
  int warp_size = 0;
  std::string pci_bus_id;
  // Every CUdevice_attribute the driver answers, keyed by its enum value.
  std::map<int, int64_t> attributes;
  bool is_fake = false;
};

struct MemInfo {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};

// One kernel parameter in the packed argument buffer.
struct ParamInfo {
  uint32_t offset_bytes = 0;
  uint32_t size_bytes = 0;
};

struct FunctionAttributes {
  int num_regs = 0;
  int shared_size_bytes = 0;
  int const_size_bytes = 0;
  int local_size_bytes = 0;
  int max_threads_per_block = 0;
  int ptx_version = 0;
  int binary_version = 0;
  int max_dynamic_shared_size_bytes = 0;
};

// Context and function configuration (Context::SetLimit and after), with the driver's
// values (CUlimit, CUfunc_cache, CUfunction_attribute).
enum class ContextLimit : int {
  kStackSize = 0,                     // bytes per thread
  kPrintfFifoSize = 1,                // bytes
  kMallocHeapSize = 2,                // bytes
  kDevRuntimeSyncDepth = 3,           // a depth
  kDevRuntimePendingLaunchCount = 4,  // launches
  kMaxL2FetchGranularity = 5,         // bytes, 0 to 128 (a hint)
  kPersistingL2CacheSize = 6,         // bytes
};
enum class CacheConfig : int {
  kPreferNone = 0,
  kPreferShared = 1,
  kPreferL1 = 2,
  kPreferEqual = 3
};
// The settable function attributes.
enum class FunctionAttribute : int {
  kMaxDynamicSharedSizeBytes = 8,
  kPreferredSharedMemoryCarveout = 9,  // -1 (default) or 0 to 100 percent
};

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
};

struct LaunchConfig {
  Dim3 grid;
  Dim3 block;
  uint32_t shared_memory_bytes = 0;
};

// Opaque backend objects. Destroying one releases the driver object (a stream after its
// queued work completes). They must be destroyed before the Context that made them.
class Stream {
 public:
  virtual ~Stream() = default;
};

class Event {
 public:
  virtual ~Event() = default;
};

// Host memory registered with the context (page-locked, cuMemHostRegister): copies between
// it and the device are DMA. Destroying it unregisters the memory; the caller first makes
// sure no queued copy still uses it (Context::Synchronize).
class HostRegistration {
 public:
  virtual ~HostRegistration() = default;
};

// A CUDA array (cuArray3DCreate): device memory in the driver's opaque, tiled layout, which
// kernels cannot address; Copy3D reaches it. `format` is a CUarray_format value and
// `element_bytes` the bytes of one element with all its channels. 1D arrays have height and
// depth 0, 2D arrays depth 0. Destroying one waits for queued work that uses it.
struct ArrayShape {
  uint64_t width = 0;
  uint64_t height = 0;
  uint64_t depth = 0;
  int format = 0;
  uint32_t num_channels = 1;
  uint32_t flags = 0;
  uint32_t element_bytes = 0;
  uint64_t row_bytes() const { return width * element_bytes; }
  uint64_t rows() const { return height == 0 ? 1 : height; }
  uint64_t slices() const { return depth == 0 ? 1 : depth; }
};
class Array {
 public:
  virtual ~Array() = default;
};

// One side of Context::Copy3D: an array (x in bytes, y, z where the copy starts), or linear
// device memory at `address` with rows `pitch_bytes` apart and slices `height` rows apart.
struct Copy3DEnd {
  Array* array = nullptr;
  DevicePtr address = 0;
  uint64_t pitch_bytes = 0;
  uint64_t height = 0;
  uint64_t x_bytes = 0;
  uint64_t y = 0;
  uint64_t z = 0;
};

// CUDA graphs (Context::BeginCapture and after). A Graph is what one capture of one stream
// recorded: its nodes form a chain, in capture order. A GraphExec is an executable graph
// instantiated from one Graph; it keeps that graph's backend object alive (its node handles
// name the nodes for SetGraphExecKernelNode), whatever the caller does with its own
// reference. Both are used from one call at a time per object or are serialised by the
// backend; destroying a GraphExec leaves launches already enqueued running.
enum class GraphNodeKind { kKernel, kMemset, kCopy, kOther };
enum class CaptureStatus { kNone, kActive, kInvalidated };

class Graph {
 public:
  virtual ~Graph() = default;
  // The nodes' kinds, in capture order (the chain from its root).
  virtual const std::vector<GraphNodeKind>& nodes() const = 0;
};

class GraphExec {
 public:
  virtual ~GraphExec() = default;
};

class Function {
 public:
  virtual ~Function() = default;
  virtual const std::vector<ParamInfo>& params() const = 0;
  virtual const FunctionAttributes& attributes() const = 0;
};

// A loaded module. Functions it returns are owned by it and live as long as it does.
class Module {
 public:
  virtual ~Module() = default;
  // NOT_FOUND when the module has no kernel of that name.
  virtual absl::StatusOr<Function*> GetFunction(const std::string& name) = 0;
  struct Global {
    DevicePtr address = 0;
    uint64_t size_bytes = 0;
  };
  // NOT_FOUND when the module has no global of that name.
  virtual absl::StatusOr<Global> GetGlobal(const std::string& name) = 0;
  // The device memory the module's globals take, as ModuleFootprintBytes
  // (module_footprint.h) computed it from the image before loading; UINT64_MAX when that
  // cannot be bounded. Fixed for the module's life.
  virtual uint64_t device_memory_bytes() const = 0;
};

// An input of Context::LinkModule. The values are the driver's CUjitInputType.
enum class LinkInputType : int {
  kCubin = 0,      // a cubin, relocatable or not
  kPtx = 1,        // PTX text
  kFatbinary = 2,  // a fatbin
  kObject = 3,     // a relocatable device object
  kLibrary = 4,    // an ar archive of device objects (libcudadevrt.a)
};
struct LinkInput {
  LinkInputType type = LinkInputType::kPtx;
  // For the linker's messages; no NUL.
  std::string name;
  // Valid for the duration of the LinkModule call.
  absl::Span<const uint8_t> data;
};
// What LinkModule made: the loaded module and the linker's info log.
struct LinkedModule {
  std::unique_ptr<Module> module;
  std::string info_log;
};

// One context on one device. `stream == nullptr` everywhere means the context's default
// stream (the legacy NULL stream).
class Context {
 public:
  virtual ~Context() = default;

  virtual const DeviceInfo& device() const = 0;
  // The NVRTC target for this device: "sm_90" (cubin) for a real GPU; the fake answers a
  // virtual "compute_XX" (PTX), because it runs no device code.
  virtual std::string CompileTarget() const = 0;

  // Memory. Alloc returns the device address of `size_bytes` (> 0) new bytes; 0 bytes is
  // INVALID_ARGUMENT (cuMemAlloc's CUDA_ERROR_INVALID_VALUE).
  virtual absl::StatusOr<DevicePtr> Alloc(uint64_t size_bytes) = 0;
  // Frees an allocation made by Alloc (waiting for the context's queued work, as cuMemFree
  // does). An address that no live allocation starts at (never allocated, inside an
  // allocation, already freed) is INVALID_ARGUMENT naming cuMemFree (the driver's
  // CUDA_ERROR_INVALID_VALUE), not NOT_FOUND; the session layer answers NOT_FOUND for
  // unknown buffer handles before a backend is asked.
  virtual absl::Status Free(DevicePtr ptr) = 0;
  virtual absl::StatusOr<MemInfo> GetMemInfo() = 0;

  // Host to device, ordered on `stream`. `src` may be reused as soon as this returns.
  virtual absl::Status Upload(DevicePtr dst, const void* src, uint64_t size_bytes,
                              Stream* stream) = 0;
  // Upload of `pieces` laid end to end (a message that arrived in several slices), as one
  // copy of their total size; the pieces may be reused as soon as this returns. The default
  // gathers them into one buffer first; a backend that stages uploads anyway copies each
  // piece straight into its staging memory instead.
  virtual absl::Status UploadPieces(DevicePtr dst,
                                    absl::Span<const absl::Span<const uint8_t>> pieces,
                                    Stream* stream) {
    if (pieces.size() == 1) return Upload(dst, pieces[0].data(), pieces[0].size(), stream);
    std::vector<uint8_t> gathered;
    for (absl::Span<const uint8_t> piece : pieces) {
      gathered.insert(gathered.end(), piece.begin(), piece.end());
    }
    return Upload(dst, gathered.data(), gathered.size(), stream);
  }
  // Device to host: waits for the work queued before it on `stream`, then fills `dst`.
  virtual absl::Status Download(void* dst, DevicePtr src, uint64_t size_bytes, Stream* stream) = 0;
  // Sets `count` elements of `element_size_bytes` (1, 2 or 4) to `value`, stream ordered.
  // Another element size is INVALID_ARGUMENT, and so is (for count > 0) a `dst` not
  // aligned to the element size (cuMemsetD16/D32's CUDA_ERROR_INVALID_VALUE).
  //
  // Upload, Download, Memset and CopyDeviceToDevice of 0 bytes (count 0) succeed whatever
  // the addresses, as the driver's copies do, without enqueueing anything.
  virtual absl::Status Memset(DevicePtr dst, uint32_t value, uint32_t element_size_bytes,
                              uint64_t count, Stream* stream) = 0;
  virtual absl::Status CopyDeviceToDevice(DevicePtr dst, DevicePtr src, uint64_t size_bytes,
                                          Stream* stream) = 0;

  // CUDA arrays. CreateArray makes an array of `shape`, which the caller has checked
  // (common/array_shape.h); the driver may still refuse it for this device
  // (INVALID_ARGUMENT) or lack the memory (RESOURCE_EXHAUSTED). Copy3D copies `depth`
  // slices of `height` rows of `width_bytes` between two ends, stream ordered
  // (cuMemcpy3DAsync); the caller has checked that every byte lies inside its array or
  // linear allocation, and a zero extent is not passed. The defaults answer UNIMPLEMENTED.
  virtual absl::StatusOr<std::unique_ptr<Array>> CreateArray(const ArrayShape& shape);
  virtual absl::Status Copy3D(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                              uint64_t height, uint64_t depth, Stream* stream);

  // CUDA IPC (each session is a process). ExportMemory: the driver's handle
  // (cuIpcGetMemHandle, 64 bytes) of the allocation that starts at `ptr`. OpenExportedMemory
  // maps an allocation that another process exported (cuIpcOpenMemHandle, with lazy peer
  // access) and returns its address in this context; INVALID_ARGUMENT for a handle the driver
  // refuses. CloseExportedMemory unmaps it (cuIpcCloseMemHandle); Free must not be used for
  // it. The defaults (and the fake, whose memory cannot leave its process) answer
  // UNIMPLEMENTED.
  virtual absl::StatusOr<std::string> ExportMemory(DevicePtr ptr);
  virtual absl::StatusOr<DevicePtr> OpenExportedMemory(const std::string& handle);
  virtual absl::Status CloseExportedMemory(DevicePtr ptr);
  // Events shared the same way. CreateInterprocessEvent: an event that can be exported
  // (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, so ElapsedTime refuses it). ExportEvent:
  // the driver's handle of such an event (cuIpcGetEventHandle, 64 bytes); the caller keeps the
  // event alive for as long as another process may use it. OpenExportedEvent: an event of
  // this context over another process's (cuIpcOpenEventHandle), which RecordEvent,
  // StreamWaitEvent, QueryEvent and SynchronizeEvent take like any event; destroying it
  // closes it. INVALID_ARGUMENT for a handle the driver refuses. The defaults (and the fake)
  // answer UNIMPLEMENTED.
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateInterprocessEvent(bool blocking_sync);
  virtual absl::StatusOr<std::string> ExportEvent(Event* event);
  virtual absl::StatusOr<std::unique_ptr<Event>> OpenExportedEvent(const std::string& handle);

  // Same-host regions. RegisterHostMemory pins [host, host + size_bytes) (size_bytes > 0)
  // for DMA; INVALID_ARGUMENT when the range overlaps memory already registered,
  // RESOURCE_EXHAUSTED when the host cannot pin that much.
  virtual absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(
      void* host, uint64_t size_bytes) = 0;
  // Stream-ordered, asynchronous copies between registered host memory and the device
  // (cuMemcpyHtoDAsync / cuMemcpyDtoHAsync): the host bytes are read or written when the
  // stream reaches the copy, so they must stay mapped and registered until then. The fake
  // refuses host ranges that are not registered (INVALID_ARGUMENT); the session layer only
  // passes ranges of its regions.
  virtual absl::Status CopyHostToDeviceAsync(DevicePtr dst, const void* src, uint64_t size_bytes,
                                             Stream* stream) = 0;
  virtual absl::Status CopyDeviceToHostAsync(void* dst, DevicePtr src, uint64_t size_bytes,
                                             Stream* stream) = 0;

  // Modules: PTX, cubin or fatbin. A rejected image is INVALID_ARGUMENT with the JIT log.
  // The CUDA backend also refuses, before the driver sees them, images whose footprint
  // ModuleFootprintBytes refuses (malformed binaries, compressed fatbins). The fake refuses
  // the same, and what a driver would: it accepts well-formed PTX (as NVRTC emits it for its
  // CompileTarget), cubins and uncompressed fatbins (fake/fake_module_image.h), and its
  // modules have only the kernels the image defines that it implements on the host.
  virtual absl::StatusOr<std::unique_ptr<Module>> LoadModule(absl::Span<const uint8_t> image) = 0;

  // Links `inputs` (at least one; the caller has bounded their number and sizes) with the
  // driver's JIT linker (cuLinkCreate, cuLinkAddData per input in order, cuLinkComplete)
  // for this context's device, then loads the linked image as LoadModule does (its
  // footprint, the same refusals). `log_verbose` asks for CU_JIT_LOG_VERBOSE. An input the
  // linker rejects, or a link that fails (undefined or duplicate symbols, a type that does
  // not match the bytes), is INVALID_ARGUMENT naming the input and with the linker's error
  // log. The fake links without a driver: it checks each input as LoadModule checks an
  // image of that type (a library must be an ar archive), refuses a kernel or global
  // defined twice and an external function of a PTX input that no input defines (library
  // archives' symbol tables count), and its module has the kernels and globals of every
  // input. Answers UNIMPLEMENTED unless the backend overrides it.
  virtual absl::StatusOr<LinkedModule> LinkModule(absl::Span<const LinkInput> inputs,
                                                  bool log_verbose);

  // Enqueues a kernel. `packed_args` is laid out as function->params() describes (the
  // caller has checked it). Returns once enqueued. Dynamic shared memory above the
  // function's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: the CUDA backend raises
  // the attribute first (up to the device's opt-in maximum); the fake, which has no opt-in
  // of its own, refuses the launch (INVALID_ARGUMENT) as the driver would.
  virtual absl::Status Launch(Function* function, const LaunchConfig& config,
                              absl::Span<const uint8_t> packed_args, Stream* stream) = 0;

  // Streams.
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream(bool non_blocking) = 0;
  virtual absl::Status SynchronizeStream(Stream* stream) = 0;
  // True when all work queued on `stream` is done.
  virtual absl::StatusOr<bool> QueryStream(Stream* stream) = 0;
  virtual absl::Status StreamWaitEvent(Stream* stream, Event* event) = 0;
  // Waits for all work of the context.
  virtual absl::Status Synchronize() = 0;

  // Events.
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent(bool disable_timing,
                                                             bool blocking_sync) = 0;
  virtual absl::Status RecordEvent(Event* event, Stream* stream) = 0;
  // True when the event has completed (or was never recorded).
  virtual absl::StatusOr<bool> QueryEvent(Event* event) = 0;
  virtual absl::Status SynchronizeEvent(Event* event) = 0;
  // Milliseconds between two recorded, completed events (>= 0 when `end` was recorded after
  // `start` on one stream). The driver answers CUDA_ERROR_INVALID_HANDLE for an event
  // created with timing disabled or never recorded; both backends answer
  // FAILED_PRECONDITION naming cuEventElapsedTime for those (the event's state, not a bad
  // argument: DESIGN §3, which clients rely on), and UNAVAILABLE (CUDA_ERROR_NOT_READY)
  // while either has not completed.
  virtual absl::StatusOr<float> ElapsedTime(Event* start, Event* end) = 0;

  // Context and function configuration. Every method answers UNIMPLEMENTED unless the
  // backend overrides it (the CUDA and fake backends do; test doubles need not). The caller
  // (the session layer) has checked the enum and the value against gpurpc's bounds
  // (module_service.proto, SetContextLimit); a backend still refuses what the driver
  // refuses, with the driver's error: INVALID_ARGUMENT for a value or a limit the device
  // does not take (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_UNSUPPORTED_LIMIT),
  // RESOURCE_EXHAUSTED when the driver cannot reserve the memory a limit needs.
  //
  // cuCtxSetLimit / cuCtxGetLimit. The stack, printf FIFO and malloc heap are device memory
  // the driver reserves for the context (the stack once per resident thread).
  virtual absl::Status SetLimit(ContextLimit limit, uint64_t value);
  virtual absl::StatusOr<uint64_t> GetLimit(ContextLimit limit);
  // cuCtxSetCacheConfig / cuCtxGetCacheConfig (a preference).
  virtual absl::Status SetCacheConfig(CacheConfig config);
  // cuProfilerStart (true) / cuProfilerStop (false); both succeed without a profiler.
  virtual absl::Status SetProfiling(bool enabled);
  virtual absl::StatusOr<CacheConfig> GetCacheConfig();
  // cuFuncSetAttribute on `function` (made by this context). Setting
  // kMaxDynamicSharedSizeBytes changes what the CUDA backend's Launch starts from when it
  // raises the limit for a launch that asks for more (see Launch); the fake refuses such
  // a launch as the driver does. Function::attributes() keeps the values the function was
  // loaded with.
  virtual absl::Status SetFunctionAttribute(Function* function, FunctionAttribute attribute,
                                            int value);
  // cuFuncSetCacheConfig (a preference).
  virtual absl::Status SetFunctionCacheConfig(Function* function, CacheConfig config);

  // CUDA graphs. Every method answers UNIMPLEMENTED unless the backend overrides it (the
  // CUDA and fake backends do; test doubles need not). Errors besides the common ones:
  // FAILED_PRECONDITION for capture misuse (CUDA_ERROR_STREAM_CAPTURE_*, a stream that does
  // not capture, an update the driver refuses); never ABORTED or DATA_LOSS for it, which
  // would end the session.
  //
  // Begins capturing `stream` (never nullptr: the legacy stream cannot capture) in
  // CU_STREAM_CAPTURE_MODE_RELAXED, so that other threads' calls keep working. While it
  // captures, kernel launches, memsets and device-to-device copies on it are recorded, not
  // run; the backend refuses (FAILED_PRECONDITION, and may invalidate the capture) what
  // cannot be captured: uploads, downloads, event records and waits, synchronising or
  // querying it, and, while a blocking stream captures, any use of the legacy stream and
  // Synchronize. The session layer refuses all of these before they get here.
  virtual absl::Status BeginCapture(Stream* stream);
  // Ends the capture of `stream` and returns its graph; FAILED_PRECONDITION when the stream
  // does not capture or the capture was invalidated (which ends it).
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream* stream);
  virtual absl::StatusOr<CaptureStatus> QueryCapture(Stream* stream);
  // An executable graph of `graph` (made by this context), which it keeps alive.
  virtual absl::StatusOr<std::unique_ptr<GraphExec>> InstantiateGraph(std::shared_ptr<Graph> graph);
  // Enqueues one run of `exec`'s nodes, in order, on `stream`. Returns once enqueued.
  virtual absl::Status LaunchGraph(GraphExec* exec, Stream* stream);
  // cuGraphExecUpdate: `exec` takes the node parameters of `graph`, which must have the same
  // nodes (count and kinds, in order; the caller checked); FAILED_PRECONDITION when the
  // driver refuses, and `exec` is then unchanged. Launches already enqueued are not affected.
  virtual absl::Status UpdateGraphExec(GraphExec* exec, Graph* graph);
  // cuGraphExecKernelNodeSetParams for node `node_index` (a kernel node; the caller checked)
  // of the graph `exec` was instantiated from: `function` with `config` and `packed_args`
  // laid out as function->params() describes (checked by the caller), for later launches.
  virtual absl::Status SetGraphExecKernelNode(GraphExec* exec, size_t node_index,
                                              Function* function, const LaunchConfig& config,
                                              absl::Span<const uint8_t> packed_args);
};

inline absl::StatusOr<LinkedModule> Context::LinkModule(absl::Span<const LinkInput>, bool) {
  return absl::UnimplementedError("this backend cannot link modules");
}
inline absl::StatusOr<std::unique_ptr<Array>> Context::CreateArray(const ArrayShape&) {
  return absl::UnimplementedError("this backend has no CUDA arrays");
}
inline absl::Status Context::Copy3D(const Copy3DEnd&, const Copy3DEnd&, uint64_t, uint64_t,
                                    uint64_t, Stream*) {
  return absl::UnimplementedError("this backend has no 3D copies");
}
inline absl::Status Context::SetLimit(ContextLimit, uint64_t) {
  return absl::UnimplementedError("this backend cannot set context limits");
}
inline absl::StatusOr<uint64_t> Context::GetLimit(ContextLimit) {
  return absl::UnimplementedError("this backend cannot read context limits");
}
inline absl::StatusOr<std::string> Context::ExportMemory(DevicePtr) {
  return absl::UnimplementedError(
      "this backend cannot share device memory with another session's process (CUDA IPC "
      "needs the CUDA backend)");
}
inline absl::StatusOr<DevicePtr> Context::OpenExportedMemory(const std::string&) {
  return absl::UnimplementedError(
      "this backend cannot map another session's device memory (CUDA IPC needs the CUDA "
      "backend)");
}
inline absl::Status Context::CloseExportedMemory(DevicePtr) {
  return absl::UnimplementedError("this backend maps no other session's device memory");
}
inline absl::StatusOr<std::unique_ptr<Event>> Context::CreateInterprocessEvent(bool) {
  return absl::UnimplementedError(
      "this backend cannot make interprocess events (CUDA IPC needs the CUDA backend)");
}
inline absl::StatusOr<std::string> Context::ExportEvent(Event*) {
  return absl::UnimplementedError(
      "this backend cannot share events with another session's process (CUDA IPC needs the "
      "CUDA backend)");
}
inline absl::StatusOr<std::unique_ptr<Event>> Context::OpenExportedEvent(const std::string&) {
  return absl::UnimplementedError(
      "this backend cannot open another session's event (CUDA IPC needs the CUDA backend)");
}
inline absl::Status Context::SetProfiling(bool) {
  return absl::UnimplementedError("this backend has no profiler control");
}
inline absl::Status Context::SetCacheConfig(CacheConfig) {
  return absl::UnimplementedError("this backend has no cache configuration");
}
inline absl::StatusOr<CacheConfig> Context::GetCacheConfig() {
  return absl::UnimplementedError("this backend has no cache configuration");
}
inline absl::Status Context::SetFunctionAttribute(Function*, FunctionAttribute, int) {
  return absl::UnimplementedError("this backend cannot set function attributes");
}
inline absl::Status Context::SetFunctionCacheConfig(Function*, CacheConfig) {
  return absl::UnimplementedError("this backend has no cache configuration");
}
inline absl::Status Context::BeginCapture(Stream*) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}
inline absl::StatusOr<std::unique_ptr<Graph>> Context::EndCapture(Stream*) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}
inline absl::StatusOr<CaptureStatus> Context::QueryCapture(Stream*) { return CaptureStatus::kNone; }
inline absl::StatusOr<std::unique_ptr<GraphExec>> Context::InstantiateGraph(
    std::shared_ptr<Graph>) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}
inline absl::Status Context::LaunchGraph(GraphExec*, Stream*) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}
inline absl::Status Context::UpdateGraphExec(GraphExec*, Graph*) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}
inline absl::Status Context::SetGraphExecKernelNode(GraphExec*, size_t, Function*,
                                                    const LaunchConfig&,
                                                    absl::Span<const uint8_t>) {
  return absl::UnimplementedError("this backend has no CUDA graphs");
}

// A backend: enumerates devices and opens contexts.
class Backend {
 public:
  virtual ~Backend() = default;
  // "cuda" or "fake".
  virtual std::string name() const = 0;
  // Driver version (cuDriverGetVersion); 0 for the fake.
  virtual int driver_version() const = 0;
  virtual absl::StatusOr<std::vector<DeviceInfo>> ListDevices() = 0;
  // Opens the one context this worker process owns on `ordinal`.
  virtual absl::StatusOr<std::unique_ptr<Context>> OpenContext(int ordinal) = 0;
};

// Factories. MakeCudaBackend loads libcuda.so.1 with dlopen; without a driver or a device it
// returns UNAVAILABLE with a message that says so.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend();
// The fake serves `device_count` devices, ordinals 0 to device_count - 1, each with memory of
// its own: `total_memory_bytes` is what each reports and the most it will allocate.
std::unique_ptr<Backend> MakeFakeBackend(uint64_t total_memory_bytes, int device_count = 1);

}  // namespace gpurpc::backend

#endif  // GPURPC_SERVER_WORKER_BACKEND_BACKEND_H_
