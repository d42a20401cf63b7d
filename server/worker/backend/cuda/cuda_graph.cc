#include "server/worker/backend/cuda/cuda_graph.h"

#include <algorithm>
#include <cstddef>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {

CudaGraph::~CudaGraph() {
  const DriverApi& api = core_->api();
  // A copy: the lambda is analysed apart from this destructor, which needs no lock.
  const CUgraph graph = graph_;
  core_->CleanUp("cuGraphDestroy", [&] { return api.cuGraphDestroy(graph); });
}

absl::Status CudaGraph::ReadNodes() {
  const DriverApi& api = core_->api();
  size_t count = 0;
  GPURPC_RETURN_IF_ERROR(
      core_->Check(api.cuGraphGetNodes(graph_, nullptr, &count), "cuGraphGetNodes"));
  std::vector<CUgraphNode> all(count);
  if (count > 0) {
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api.cuGraphGetNodes(graph_, all.data(), &count), "cuGraphGetNodes"));
    all.resize(count);
  }
  // Topological order (Kahn), ties in cuGraphGetNodes order: for the chain a one-stream
  // capture makes, the order the work was enqueued in.
  std::map<CUgraphNode, size_t> waiting;  // node -> dependencies not yet placed
  std::map<CUgraphNode, std::vector<CUgraphNode>> dependents;
  for (CUgraphNode node : all) waiting.emplace(node, 0);
  for (CUgraphNode node : all) {
    size_t n = 0;
    GPURPC_RETURN_IF_ERROR(
        core_->Check(api.cuGraphNodeGetDependentNodes(node, nullptr, nullptr, &n),
                     "cuGraphNodeGetDependentNodes"));
    std::vector<CUgraphNode>& out = dependents[node];
    out.resize(n);
    if (n > 0) {
      GPURPC_RETURN_IF_ERROR(
          core_->Check(api.cuGraphNodeGetDependentNodes(node, out.data(), nullptr, &n),
                       "cuGraphNodeGetDependentNodes"));
      out.resize(n);
    }
    for (CUgraphNode next : out) ++waiting[next];
  }
  std::vector<CUgraphNode> ready;
  for (CUgraphNode node : all) {
    if (waiting[node] == 0) ready.push_back(node);
  }
  std::reverse(ready.begin(), ready.end());  // a stack, first node on top
  while (!ready.empty()) {
    CUgraphNode node = ready.back();
    ready.pop_back();
    nodes_.push_back(node);
    const std::vector<CUgraphNode>& out = dependents[node];
    for (auto it = out.rbegin(); it != out.rend(); ++it) {
      if (--waiting[*it] == 0) ready.push_back(*it);
    }
  }
  if (nodes_.size() != all.size()) {
    return absl::InternalError(absl::StrCat("the captured graph has ", all.size(),
                                            " nodes but only ", nodes_.size(),
                                            " are reachable in dependency order"));
  }
  for (CUgraphNode node : nodes_) {
    CUgraphNodeType type;
    GPURPC_RETURN_IF_ERROR(core_->Check(api.cuGraphNodeGetType(node, &type), "cuGraphNodeGetType"));
    switch (type) {
      case CU_GRAPH_NODE_TYPE_KERNEL:
        kinds_.push_back(GraphNodeKind::kKernel);
        break;
      case CU_GRAPH_NODE_TYPE_MEMSET:
        kinds_.push_back(GraphNodeKind::kMemset);
        break;
      case CU_GRAPH_NODE_TYPE_MEMCPY:
        kinds_.push_back(GraphNodeKind::kCopy);
        break;
      default:
        kinds_.push_back(GraphNodeKind::kOther);
    }
  }
  return absl::OkStatus();
}

CudaGraphExec::~CudaGraphExec() {
  const DriverApi& api = core_->api();
  // A copy: the lambda is analysed apart from this destructor, which needs no lock.
  const CUgraphExec exec = exec_;
  core_->CleanUp("cuGraphExecDestroy", [&] { return api.cuGraphExecDestroy(exec); });
}

const char* GraphExecUpdateResultName(CUgraphExecUpdateResult result) {
  switch (result) {
    case CU_GRAPH_EXEC_UPDATE_SUCCESS:
      return "CU_GRAPH_EXEC_UPDATE_SUCCESS";
    case CU_GRAPH_EXEC_UPDATE_ERROR:
      return "CU_GRAPH_EXEC_UPDATE_ERROR";
    case CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED";
    case CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE";
    case CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED:
      return "CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED";
  }
  return "an unknown CUgraphExecUpdateResult";
}

}  // namespace gpurpc::backend::cuda
