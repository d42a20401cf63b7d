// CUDA graphs of the C++ client: Stream::BeginCapture/EndCapture/IsCapturing, Graph and
// GraphExec (client.h; the protocol is ExecutionService's graph RPCs in
// proto/gpurpc/v1/execution_service.proto).
//
// Ordering: launches, memsets and copies go through the session's command stream, the
// graph calls are unary RPCs, so every graph call first waits until the commands enqueued
// before it were processed (SessionCore::Barrier): work enqueued before BeginCapture runs,
// work enqueued before EndCapture is captured, a GraphExec::Launch enqueued before an
// update runs with the old parameters.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_format.h"
#include "client/cpp/src/session_core.h"
#include "client/cpp/src/session_object.h"
#include "gpurpc/client.h"

namespace gpurpc {
namespace {

using internal::NoSession;
using internal::SessionCore;

// A unary ExecutionService call of the session after the commands queued before it
// (internal::SessionCall: its health first, its metadata, a deadline `timeout` from now).
#define GPURPC_GRAPH_CALL(core, Method, request, response, timeout)                               \
  [&]() -> absl::Status {                                                                         \
    SessionCore& graph_core = (core);                                                             \
    if (absl::Status usable = graph_core.CheckUsable(); !usable.ok()) return usable;              \
    if (absl::Status queued = graph_core.Barrier(timeout); !queued.ok()) return queued;           \
    return internal::SessionCall(graph_core, GPURPC_RPC(graph_core.execution(), Method), #Method, \
                                 (request), (response), (timeout));                               \
  }()

void SetDim(const Dim3& in, v1::Dim3* out) {
  out->set_x(in.x);
  out->set_y(in.y);
  out->set_z(in.z);
}

}  // namespace

// ---------------------------------------------------------------------------- Stream

absl::Status Stream::BeginCapture(v1::CaptureMode mode) const {
  if (core_ == nullptr) return NoSession();
  v1::BeginCaptureRequest request;
  request.set_stream_id(id_);
  request.set_mode(mode);
  v1::BeginCaptureResponse response;
  return GPURPC_GRAPH_CALL(*core_, BeginCapture, request, &response, core_->call_timeout());
}

absl::StatusOr<Graph> Stream::EndCapture() const {
  if (core_ == nullptr) return NoSession();
  v1::EndCaptureRequest request;
  request.set_stream_id(id_);
  v1::EndCaptureResponse response;
  absl::Status status =
      GPURPC_GRAPH_CALL(*core_, EndCapture, request, &response, core_->call_timeout());
  if (!status.ok()) return status;
  Graph graph;
  graph.core_ = core_;
  graph.id_ = response.graph_id();
  graph.node_count_ = response.node_count();
  return graph;
}

absl::StatusOr<bool> Stream::IsCapturing() const {
  if (core_ == nullptr) return NoSession();
  v1::GetCaptureInfoRequest request;
  request.set_stream_id(id_);
  v1::GetCaptureInfoResponse response;
  absl::Status status =
      GPURPC_GRAPH_CALL(*core_, GetCaptureInfo, request, &response, core_->call_timeout());
  if (!status.ok()) return status;
  return response.status() != v1::CAPTURE_STATUS_NONE;
}

// ---------------------------------------------------------------------------- Graph

Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;
Graph::~Graph() = default;

absl::Status Graph::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  v1::DestroyGraphRequest request;
  request.set_graph_id(id);
  v1::DestroyGraphResponse response;
  return GPURPC_GRAPH_CALL(core, DestroyGraph, request, &response, timeout);
}

absl::Status Graph::Destroy() { return ReleaseNow("DestroyGraph: already destroyed"); }

absl::StatusOr<GraphExec> Graph::Instantiate() const {
  if (core_ == nullptr) return NoSession();
  v1::InstantiateGraphRequest request;
  request.set_graph_id(id_);
  v1::InstantiateGraphResponse response;
  absl::Status status =
      GPURPC_GRAPH_CALL(*core_, InstantiateGraph, request, &response, core_->call_timeout());
  if (!status.ok()) return status;
  GraphExec exec;
  exec.core_ = core_;
  exec.id_ = response.graph_exec_id();
  return exec;
}

absl::StatusOr<std::vector<v1::GraphNode>> Graph::Nodes() const {
  if (core_ == nullptr) return NoSession();
  v1::GetGraphNodesRequest request;
  request.set_graph_id(id_);
  v1::GetGraphNodesResponse response;
  absl::Status status =
      GPURPC_GRAPH_CALL(*core_, GetGraphNodes, request, &response, core_->call_timeout());
  if (!status.ok()) return status;
  return std::vector<v1::GraphNode>(response.nodes().begin(), response.nodes().end());
}

// ---------------------------------------------------------------------------- GraphExec

GraphExec::GraphExec(GraphExec&&) noexcept = default;
GraphExec& GraphExec::operator=(GraphExec&&) noexcept = default;
GraphExec::~GraphExec() = default;

absl::Status GraphExec::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  v1::DestroyGraphExecRequest request;
  request.set_graph_exec_id(id);
  v1::DestroyGraphExecResponse response;
  return GPURPC_GRAPH_CALL(core, DestroyGraphExec, request, &response, timeout);
}

absl::Status GraphExec::Destroy() { return ReleaseNow("DestroyGraphExec: already destroyed"); }

absl::Status GraphExec::Launch(const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  command.mutable_launch_graph()->set_graph_exec_id(id_);
  command.mutable_launch_graph()->set_stream_id(stream == nullptr ? 0 : stream->id());
  return core_->Enqueue(std::move(command));
}

absl::Status GraphExec::Update(const Graph& graph) const {
  if (core_ == nullptr) return NoSession();
  v1::UpdateGraphExecRequest request;
  request.set_graph_exec_id(id_);
  request.set_graph_id(graph.id());
  v1::UpdateGraphExecResponse response;
  return GPURPC_GRAPH_CALL(*core_, UpdateGraphExec, request, &response, core_->call_timeout());
}

absl::Status GraphExec::SetKernelNodeArgsPacked(uint32_t node_index, const Function& function,
                                                const LaunchConfig& config,
                                                absl::Span<const KernelArg> args) const {
  if (core_ == nullptr) return NoSession();
  absl::StatusOr<std::string> packed = function.Pack(args);
  if (!packed.ok()) return packed.status();
  v1::SetGraphExecKernelNodeArgsRequest request;
  request.set_graph_exec_id(id_);
  request.set_node_index(node_index);
  request.set_function_id(function.id());
  SetDim(config.grid, request.mutable_grid());
  SetDim(config.block, request.mutable_block());
  request.set_shared_memory_bytes(config.shared_memory_bytes);
  request.set_packed_args(*std::move(packed));
  v1::SetGraphExecKernelNodeArgsResponse response;
  return GPURPC_GRAPH_CALL(*core_, SetGraphExecKernelNodeArgs, request, &response,
                           core_->call_timeout());
}

}  // namespace gpurpc
