// CUDA graphs of the fake backend, captured and replayed by its simulated device
// (server/worker/backend/fake/fake_device.h): what a capture recorded, and executable graphs
// that replay it.
//
// A capturing fake stream does not run the kernels, memsets and device-to-device copies
// enqueued on it: it appends one GraphOp per operation (checked like the operation itself,
// then kept by value: kernel arguments are copied). A FakeGraph holds those operations,
// immutable. A FakeGraphExec holds a snapshot of them that a launch enqueues as one piece of
// work, after the exec's previous launch whatever its stream (launches of one CUDA graph exec
// never overlap): the stream's thread replays the operations in order, with the checks a
// normal fake operation gets when it runs (memory freed since the capture faults the context
// like any access outside a live allocation, never touching the host heap). Updates
// (cuGraphExecUpdate, cuGraphExecKernelNodeSetParams) replace the snapshot, copy on write,
// so launches already enqueued run what they were given, as on a GPU.
//
// Thread safety: a FakeGraph is immutable; a FakeGraphExec serialises its own methods.
#ifndef GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_GRAPH_H_
#define GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_GRAPH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"

namespace gpurpc::backend::fake {

// One captured operation.
struct GraphOp {
  GraphNodeKind kind = GraphNodeKind::kKernel;
  DevicePtr dst = 0;
  DevicePtr src = 0;
  // A copy's bytes.
  uint64_t size_bytes = 0;
  // A memset's value and element size.
  uint32_t value = 0;
  uint32_t element_size_bytes = 0;
  // A memset's elements; a kernel's threads.
  uint64_t count = 0;
  // A kernel: the fake's built-in (static; fake_device.cc knows its type) and its packed
  // arguments.
  const void* kernel = nullptr;
  std::vector<uint8_t> args;
};
using GraphOps = std::vector<GraphOp>;

// The kinds of `ops`, in order.
std::vector<GraphNodeKind> KindsOf(const GraphOps& ops);

class FakeGraph final : public Graph {
 public:
  // `owner` identifies the fake context that captured it.
  FakeGraph(const void* owner, GraphOps ops);
  const std::vector<GraphNodeKind>& nodes() const override { return kinds_; }
  const void* owner() const { return owner_; }
  const std::shared_ptr<const GraphOps>& ops() const { return ops_; }

 private:
  const void* const owner_;
  const std::shared_ptr<const GraphOps> ops_;
  const std::vector<GraphNodeKind> kinds_;
};

class FakeGraphExec final : public GraphExec {
 public:
  FakeGraphExec(const void* owner, std::shared_ptr<const GraphOps> ops);
  const void* owner() const { return owner_; }

  // What a launch enqueues now.
  std::shared_ptr<const GraphOps> snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

  // Where its latest launch was enqueued (queue, position; 0 = never launched): the next
  // launch, on any stream, runs after it, as launches of one CUDA graph exec do. Read and
  // written only under the owning fake context's lock (DeviceState, fake_device.h).
  uint64_t last_launch_queue = 0;
  uint64_t last_launch_seq = 0;

  // cuGraphExecUpdate as the fake models it: the same number of nodes of the same kinds, and
  // memsets of the same element size; otherwise FAILED_PRECONDITION
  // (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE with the CUgraphExecUpdateResult and the node) and
  // nothing changes.
  absl::Status Update(const FakeGraph& graph) ABSL_LOCKS_EXCLUDED(mu_);

  // Gives kernel node `index` another kernel, thread count and packed arguments (the caller
  // checked them against the kernel). INVALID_ARGUMENT for an index past the nodes or a node
  // that is not a kernel (CUDA_ERROR_INVALID_VALUE).
  absl::Status SetKernelNode(size_t index, const void* kernel, uint64_t threads,
                             absl::Span<const uint8_t> args) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const void* const owner_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const GraphOps> ops_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpurpc::backend::fake

#endif  // GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_GRAPH_H_
