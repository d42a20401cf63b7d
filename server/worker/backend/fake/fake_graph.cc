#include "server/worker/backend/fake/fake_graph.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace gpurpc::backend::fake {
namespace {

constexpr char kUpdateFailure[] =
    "cuGraphExecUpdate: CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE (the graph update was not "
    "performed because it included changes which violated constraints specific to "
    "instantiated graph update)";

const char* KindName(GraphNodeKind kind) {
  switch (kind) {
    case GraphNodeKind::kKernel:
      return "a kernel";
    case GraphNodeKind::kMemset:
      return "a memset";
    case GraphNodeKind::kCopy:
      return "a copy";
    case GraphNodeKind::kOther:
      break;
  }
  return "another node";
}

}  // namespace

std::vector<GraphNodeKind> KindsOf(const GraphOps& ops) {
  std::vector<GraphNodeKind> kinds;
  kinds.reserve(ops.size());
  for (const GraphOp& op : ops) kinds.push_back(op.kind);
  return kinds;
}

FakeGraph::FakeGraph(const void* owner, GraphOps ops)
    : owner_(owner),
      ops_(std::make_shared<const GraphOps>(std::move(ops))),
      kinds_(KindsOf(*ops_)) {}

FakeGraphExec::FakeGraphExec(const void* owner, std::shared_ptr<const GraphOps> ops)
    : owner_(owner), ops_(std::move(ops)) {}

std::shared_ptr<const GraphOps> FakeGraphExec::snapshot() const {
  absl::MutexLock lock(&mu_);
  return ops_;
}

absl::Status FakeGraphExec::Update(const FakeGraph& graph) {
  const GraphOps& next = *graph.ops();
  absl::MutexLock lock(&mu_);
  const GraphOps& current = *ops_;
  if (current.size() != next.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kUpdateFailure,
                     ": CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED (the graph "
                     "exec has ",
                     current.size(), " nodes, the graph ", next.size(), ")"));
  }
  for (size_t i = 0; i < next.size(); ++i) {
    if (current[i].kind != next[i].kind) {
      return absl::FailedPreconditionError(
          absl::StrCat(kUpdateFailure, ": CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED (node ", i,
                       " is ", KindName(current[i].kind), " in the graph exec and ",
                       KindName(next[i].kind), " in the graph)"));
    }
    if (current[i].kind == GraphNodeKind::kMemset &&
        current[i].element_size_bytes != next[i].element_size_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          kUpdateFailure, ": CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED (memset node ", i,
          " sets ", current[i].element_size_bytes, "-byte elements in the graph exec and ",
          next[i].element_size_bytes, "-byte elements in the graph)"));
    }
  }
  ops_ = graph.ops();  // immutable: shared, not copied
  return absl::OkStatus();
}

absl::Status FakeGraphExec::SetKernelNode(size_t index, const void* kernel, uint64_t threads,
                                          absl::Span<const uint8_t> args) {
  absl::MutexLock lock(&mu_);
  if (index >= ops_->size() || (*ops_)[index].kind != GraphNodeKind::kKernel) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuGraphExecKernelNodeSetParams: CUDA_ERROR_INVALID_VALUE (invalid argument): node ", index,
        " is not a kernel node of the graph exec (", ops_->size(), " nodes)"));
  }
  auto next = std::make_shared<GraphOps>(*ops_);
  GraphOp& op = (*next)[index];
  op.kernel = kernel;
  op.count = threads;
  op.args.assign(args.begin(), args.end());
  ops_ = std::move(next);
  return absl::OkStatus();
}

}  // namespace gpurpc::backend::fake
