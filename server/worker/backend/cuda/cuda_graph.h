// CUDA graphs of the CUDA backend (backend.h's Graph and GraphExec), made and used by the
// Context's capture and graph methods (cuda_backend.cc).
//
// A CudaGraph owns the CUgraph one stream capture made (cuGraphDestroy when destroyed) and
// its nodes in capture order (the chain from its root) with their kinds, read once by
// ReadNodes. A CudaGraphExec owns an instantiated CUgraphExec (cuGraphExecDestroy when
// destroyed; launches already enqueued still run) and keeps the graph it was instantiated
// from alive: that graph's node handles name the exec's nodes. Destructors skip the driver
// on a poisoned context.
//
// Threading: the driver's graph objects are not internally synchronised, so every driver
// call that reads or changes one holds its object's mutex() (instantiation, updates, node
// handles in kernel node updates); a graph exec's mutex is always taken before a graph's
// (ABSL_ACQUIRED_BEFORE). nodes() is immutable after ReadNodes and needs no lock.
// Errors: the failed driver call's status (ContextCore::Error); INTERNAL when the captured
// nodes do not form a graph ReadNodes can order.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_GRAPH_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_GRAPH_H_

#include <cuda.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/context_core.h"

namespace gpurpc::backend::cuda {

class CudaGraph final : public Graph {
 public:
  CudaGraph(std::shared_ptr<ContextCore> core, CUgraph graph)
      : core_(std::move(core)), graph_(graph) {}
  ~CudaGraph() override;

  // Reads the nodes; the constructor's caller calls it once before handing the graph out.
  // Nothing else can reach the graph yet, so (like the constructor) it runs without
  // mutex() and is left out of the lock analysis.
  absl::Status ReadNodes() ABSL_NO_THREAD_SAFETY_ANALYSIS;

  const std::vector<GraphNodeKind>& nodes() const override { return kinds_; }
  CUgraph handle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return graph_; }
  const std::vector<CUgraphNode>& node_handles() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return nodes_;
  }
  absl::Mutex& mutex() ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  // The driver's graph and its nodes: every driver call on them holds mu_ (past ReadNodes).
  const CUgraph graph_ ABSL_GUARDED_BY(mu_);
  std::vector<CUgraphNode> nodes_ ABSL_GUARDED_BY(mu_);
  // Set by ReadNodes, read-only afterwards (nodes() reads it without mu_).
  std::vector<GraphNodeKind> kinds_;
  absl::Mutex mu_;
};

class CudaGraphExec final : public GraphExec {
 public:
  CudaGraphExec(std::shared_ptr<ContextCore> core, CUgraphExec exec,
                std::shared_ptr<CudaGraph> source)
      : core_(std::move(core)), exec_(exec), source_(std::move(source)) {}
  // Launches already enqueued still run (cuGraphExecDestroy does not wait for them).
  ~CudaGraphExec() override;
  CUgraphExec handle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return exec_; }
  // The graph it was instantiated from: its node handles name this exec's nodes.
  CudaGraph& source() const { return *source_; }
  absl::Mutex& mutex() ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  // The driver's graph exec: every driver call on it holds mu_.
  const CUgraphExec exec_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<CudaGraph> source_;
  // Lock order: a graph exec's mutex is taken before a graph's (its source's, or the graph
  // it is updated from; see UpdateGraphExec and SetGraphExecKernelNode).
  absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(source_->mutex());
};

// The name of a cuGraphExecUpdate result, for error messages.
const char* GraphExecUpdateResultName(CUgraphExecUpdateResult result);

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_GRAPH_H_
