// The CUDA graph half of the worker's Session (session.h): stream capture, graphs, graph
// execs and their launches, and the checks that keep work a capture cannot record off a
// capturing stream. The contract is ExecutionService's (proto/gpurpc/v1/
// execution_service.proto).
//
// What the session keeps beside the backend's objects: for every node, its type and, for a
// kernel node, the function (whose module it keeps loaded), the launch dimensions and what
// the node counts against kMaxGraphBytesPerSession. It records them as the work is
// enqueued on a capturing stream (EnqueueCapturable, under the stream's capture lock), so
// that GetGraphNodes can describe a graph and SetGraphExecKernelNodeArgs can check new
// arguments against the node's kernel exactly as Launch does.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

struct Session::StreamCapture {
  explicit StreamCapture(bool is_blocking) : blocking(is_blocking) {}
  // The stream synchronises with stream 0 (CreateStream without non_blocking).
  const bool blocking;
  // Held while work a capture records is enqueued on the stream, and while a capture of it
  // begins or ends.
  absl::Mutex mu;
  bool active ABSL_GUARDED_BY(mu) = false;
  std::vector<GraphNodeRecord> nodes ABSL_GUARDED_BY(mu);
  uint64_t bytes ABSL_GUARDED_BY(mu) = 0;  // reserved in graph_bytes_
};

struct Session::GraphEntry {
  std::shared_ptr<backend::Graph> graph;
  std::vector<GraphNodeRecord> nodes;  // immutable
  uint64_t bytes = 0;                  // reserved in graph_bytes_
};

struct Session::GraphExecEntry {
  std::unique_ptr<backend::GraphExec> exec;
  std::shared_ptr<const std::string> name;  // the watchdog's name for its launches
  // Serialises UpdateGraphExec and SetGraphExecKernelNodeArgs (and the records with them).
  absl::Mutex mu;
  std::vector<GraphNodeRecord> nodes ABSL_GUARDED_BY(mu);
  uint64_t bytes ABSL_GUARDED_BY(mu) = 0;  // reserved in graph_bytes_
  bool destroyed ABSL_GUARDED_BY(mu) = false;
};

namespace {

const char* TypeName(v1::GraphNodeType type) {
  switch (type) {
    case v1::GRAPH_NODE_TYPE_KERNEL:
      return "kernel";
    case v1::GRAPH_NODE_TYPE_MEMSET:
      return "memset";
    case v1::GRAPH_NODE_TYPE_MEMCPY:
      return "memcpy";
    default:
      return "unspecified";
  }
}

v1::GraphNodeType TypeOf(backend::GraphNodeKind kind) {
  switch (kind) {
    case backend::GraphNodeKind::kKernel:
      return v1::GRAPH_NODE_TYPE_KERNEL;
    case backend::GraphNodeKind::kMemset:
      return v1::GRAPH_NODE_TYPE_MEMSET;
    case backend::GraphNodeKind::kCopy:
      return v1::GRAPH_NODE_TYPE_MEMCPY;
    case backend::GraphNodeKind::kOther:
      break;
  }
  return v1::GRAPH_NODE_TYPE_UNSPECIFIED;
}

// "kernel, kernel, memset" (at most the first 16).
template <typename T, typename Name>
std::string DescribeTypes(const std::vector<T>& items, Name name) {
  constexpr size_t kShown = 16;
  std::vector<std::string> names;
  for (size_t i = 0; i < items.size() && i < kShown; ++i) names.push_back(name(items[i]));
  if (items.size() > kShown) names.push_back("...");
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

void SetDim(const backend::Dim3& in, v1::Dim3* out) {
  out->set_x(in.x);
  out->set_y(in.y);
  out->set_z(in.z);
}

absl::Status CapturingRefusal(const char* what, uint64_t stream_id) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: stream %d is capturing a graph (BeginCapture), and a capture records only kernel "
      "launches, memsets and device-to-device copies; end the capture first (EndCapture)",
      what, stream_id));
}

// A session's status keeps its code; its message says which call it answers.
absl::Status Prefixed(const char* what, const absl::Status& status, absl::string_view suffix = "") {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message(), suffix));
}

}  // namespace

std::shared_ptr<Session::StreamCapture> Session::NewStreamCapture(bool blocking) {
  return std::make_shared<StreamCapture>(blocking);
}

absl::StatusOr<Session::StreamAndCapture> Session::FindStreamCapture(uint64_t stream_id) {
  if (stream_id == 0) return StreamAndCapture{nullptr, legacy_capture_};
  absl::MutexLock lock(&mu_);
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<backend::Stream> stream, streams_.Find(stream_id));
  std::shared_ptr<StreamCapture>& capture = stream_captures_[stream_id];
  // CreateStream makes one for every stream; a non-blocking one is the safe guess.
  if (capture == nullptr) capture = NewStreamCapture(/*blocking=*/false);
  return StreamAndCapture{std::move(stream), capture};
}

absl::Status Session::ReserveGraphBytesLocked(uint64_t bytes, const char* what) {
  if (bytes > kMaxGraphBytesPerSession - std::min(graph_bytes_, kMaxGraphBytesPerSession)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: the graphs of this session would take %d bytes of worker memory, more than its "
        "bound of %d (every node's kernel arguments plus %d bytes, counted again for each "
        "graph exec); destroy graphs or graph execs first",
        what, graph_bytes_ + bytes, kMaxGraphBytesPerSession, kGraphNodeOverheadBytes));
  }
  graph_bytes_ += bytes;
  return absl::OkStatus();
}

void Session::ReleaseGraphBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  graph_bytes_ -= std::min(bytes, graph_bytes_);
}

absl::Status Session::EnqueueCapturable(
    uint64_t stream_id, const char* what, absl::FunctionRef<GraphNodeRecord()> describe,
    absl::FunctionRef<absl::Status(backend::Stream*, bool)> enqueue) {
  GPURPC_ASSIGN_OR_RETURN(StreamAndCapture target, FindStreamCapture(stream_id));
  StreamCapture& capture = *target.capture;
  absl::MutexLock capture_lock(&capture.mu);
  if (!capture.active) {
    if (stream_id == 0 && blocking_captures_active_.load(std::memory_order_acquire) > 0) {
      return RefuseWhileCapturing(0, what);
    }
    return enqueue(target.stream.get(), /*capturing=*/false);
  }
  GraphNodeRecord node = describe();
  node.cost_bytes += kGraphNodeOverheadBytes;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(ReserveGraphBytesLocked(node.cost_bytes, what));
  }
  absl::Status status = enqueue(target.stream.get(), /*capturing=*/true);
  if (!status.ok()) {
    ReleaseGraphBytes(node.cost_bytes);
    return status;
  }
  capture.bytes += node.cost_bytes;
  capture.nodes.push_back(std::move(node));
  return absl::OkStatus();
}

absl::Status Session::RefuseWhileCapturing(uint64_t stream_id, const char* what) {
  if (stream_id == 0) {
    if (blocking_captures_active_.load(std::memory_order_acquire) == 0) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    if (blocking_capturing_streams_.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: stream 0, the legacy default stream, cannot be used while blocking stream %s "
        "captures a graph (CUDA would make stream 0 wait for the capture: "
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT); end the capture first, or create the capturing "
        "stream non_blocking",
        what, absl::StrJoin(blocking_capturing_streams_, ", ")));
  }
  if (captures_active_.load(std::memory_order_acquire) == 0) return absl::OkStatus();
  std::shared_ptr<StreamCapture> capture;
  {
    absl::MutexLock lock(&mu_);
    auto it = stream_captures_.find(stream_id);
    if (it == stream_captures_.end()) return absl::OkStatus();
    capture = it->second;
  }
  absl::MutexLock capture_lock(&capture->mu);
  if (capture->active) return CapturingRefusal(what, stream_id);
  return absl::OkStatus();
}

absl::Status Session::RefuseWhileAnyCaptures(const char* what) {
  if (captures_active_.load(std::memory_order_acquire) == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (capturing_streams_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: stream %s of this session is capturing a graph (BeginCapture), and the whole "
      "session cannot be synchronised meanwhile; end the capture first (EndCapture), or "
      "synchronise other streams one by one",
      what, absl::StrJoin(capturing_streams_, ", ")));
}

// ---------------------------------------------------------------------------- capture

absl::Status Session::BeginCapture(uint64_t stream_id, int mode) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (mode < v1::CAPTURE_MODE_GLOBAL || mode > v1::CAPTURE_MODE_RELAXED) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BeginCapture: mode %d is not a CaptureMode (0 = GLOBAL, 1 = THREAD_LOCAL, 2 = RELAXED; "
        "the server captures in RELAXED mode whichever is given)",
        mode));
  }
  if (stream_id == 0) {
    return absl::InvalidArgumentError(
        "BeginCapture: stream 0 is the legacy default stream, which cannot be captured; create "
        "a stream (CreateStream) and capture that");
  }
  absl::StatusOr<StreamAndCapture> target = FindStreamCapture(stream_id);
  if (!target.ok()) return Prefixed("BeginCapture", target.status());
  StreamCapture& capture = *target->capture;
  // Stream 0 work in flight is enqueued before a blocking stream's capture begins (it would
  // make stream 0 depend on the capture), and none starts until the capture is known.
  std::optional<absl::MutexLock> legacy_lock;
  if (capture.blocking) legacy_lock.emplace(&legacy_capture_->mu);
  absl::MutexLock capture_lock(&capture.mu);
  if (capture.active) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "BeginCapture: stream %d is already capturing; end that capture first (EndCapture)",
        stream_id));
  }
  {
    absl::MutexLock lock(&mu_);
    if (graphs_.size() + capturing_streams_.size() >= kMaxGraphsPerSession) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "BeginCapture: this session holds %d graphs and %d captures in progress, the most it "
          "may (%d together); destroy graphs first (DestroyGraph)",
          graphs_.size(), capturing_streams_.size(), kMaxGraphsPerSession));
    }
    capturing_streams_.insert(stream_id);
    captures_active_.store(capturing_streams_.size(), std::memory_order_release);
  }
  absl::Status status = RecordFault(context_->BeginCapture(target->stream.get()));
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    capturing_streams_.erase(stream_id);
    captures_active_.store(capturing_streams_.size(), std::memory_order_release);
    return status;
  }
  capture.active = true;
  capture.nodes.clear();
  capture.bytes = 0;
  if (capture.blocking) {
    blocking_capturing_streams_.insert(stream_id);
    blocking_captures_active_.store(blocking_capturing_streams_.size(), std::memory_order_release);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EndCaptureResponse> Session::EndCapture(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (stream_id == 0) {
    return absl::FailedPreconditionError(
        "EndCapture: stream 0 is not capturing (the legacy default stream cannot be captured)");
  }
  absl::StatusOr<StreamAndCapture> target = FindStreamCapture(stream_id);
  if (!target.ok()) return Prefixed("EndCapture", target.status());
  StreamCapture& capture = *target->capture;
  absl::MutexLock capture_lock(&capture.mu);
  if (!capture.active) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "EndCapture: stream %d is not capturing; begin a capture first (BeginCapture)", stream_id));
  }
  absl::StatusOr<std::unique_ptr<backend::Graph>> graph =
      RecordFault(context_->EndCapture(target->stream.get()));
  // The capture is over, whatever the driver said.
  std::vector<GraphNodeRecord> nodes = std::move(capture.nodes);
  const uint64_t bytes = capture.bytes;
  capture.active = false;
  capture.nodes.clear();
  capture.bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    capturing_streams_.erase(stream_id);
    blocking_capturing_streams_.erase(stream_id);
    captures_active_.store(capturing_streams_.size(), std::memory_order_release);
    blocking_captures_active_.store(blocking_capturing_streams_.size(), std::memory_order_release);
  }
  if (!graph.ok()) {
    ReleaseGraphBytes(bytes);
    const absl::Status& status = graph.status();
    if (status.code() == absl::StatusCode::kAborted ||
        status.code() == absl::StatusCode::kDataLoss) {
      return status;  // a sticky fault, reported as the backend said it
    }
    return Prefixed("EndCapture", status, "; the capture is over, without a graph");
  }
  // The driver's nodes are the work this session enqueued, in order (EnqueueCapturable holds
  // the stream's capture lock across each enqueue).
  const std::vector<backend::GraphNodeKind>& kinds = (*graph)->nodes();
  bool same = kinds.size() == nodes.size();
  for (size_t i = 0; same && i < kinds.size(); ++i) same = TypeOf(kinds[i]) == nodes[i].type;
  if (!same) {
    ReleaseGraphBytes(bytes);
    return absl::InternalError(absl::StrFormat(
        "EndCapture: the captured graph has %d nodes (%s), but this session enqueued %d on "
        "stream %d while it captured (%s); the graph is dropped",
        kinds.size(),
        DescribeTypes(kinds, [](backend::GraphNodeKind k) { return TypeName(TypeOf(k)); }),
        nodes.size(), stream_id,
        DescribeTypes(nodes, [](const GraphNodeRecord& n) { return TypeName(n.type); })));
  }
  auto entry = std::make_shared<GraphEntry>();
  entry->graph = std::shared_ptr<backend::Graph>(*std::move(graph));
  entry->nodes = std::move(nodes);
  entry->bytes = bytes;
  v1::EndCaptureResponse response;
  response.set_node_count(static_cast<uint32_t>(entry->nodes.size()));
  absl::MutexLock lock(&mu_);
  const uint64_t id = NewIdLocked();
  graphs_.Insert(id, std::move(entry));
  response.set_graph_id(id);
  return response;
}

absl::StatusOr<v1::GetCaptureInfoResponse> Session::GetCaptureInfo(uint64_t stream_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  v1::GetCaptureInfoResponse response;
  response.set_status(v1::CAPTURE_STATUS_NONE);
  if (stream_id == 0) return response;
  absl::StatusOr<StreamAndCapture> target = FindStreamCapture(stream_id);
  if (!target.ok()) return Prefixed("GetCaptureInfo", target.status());
  StreamCapture& capture = *target->capture;
  absl::MutexLock capture_lock(&capture.mu);
  if (!capture.active) return response;
  GPURPC_ASSIGN_OR_RETURN(backend::CaptureStatus status,
                          RecordFault(context_->QueryCapture(target->stream.get())));
  // Capturing as far as the session knows: a driver that says otherwise lost the capture.
  response.set_status(status == backend::CaptureStatus::kActive ? v1::CAPTURE_STATUS_ACTIVE
                                                                : v1::CAPTURE_STATUS_INVALIDATED);
  response.set_node_count(static_cast<uint32_t>(capture.nodes.size()));
  return response;
}

void Session::AbandonCapture(uint64_t stream_id, backend::Stream* stream) {
  std::shared_ptr<StreamCapture> capture;
  {
    absl::MutexLock lock(&mu_);
    auto it = stream_captures_.find(stream_id);
    if (it == stream_captures_.end()) return;
    capture = std::move(it->second);
    stream_captures_.erase(it);
  }
  absl::MutexLock capture_lock(&capture->mu);
  if (!capture->active) return;
  // The graph, if the driver makes one, is dropped at once.
  RecordFault(context_->EndCapture(stream).status()).IgnoreError();
  capture->active = false;
  capture->nodes.clear();
  const uint64_t bytes = std::exchange(capture->bytes, 0);
  absl::MutexLock lock(&mu_);
  graph_bytes_ -= std::min(bytes, graph_bytes_);
  capturing_streams_.erase(stream_id);
  blocking_capturing_streams_.erase(stream_id);
  captures_active_.store(capturing_streams_.size(), std::memory_order_release);
  blocking_captures_active_.store(blocking_capturing_streams_.size(), std::memory_order_release);
}

void Session::ReleaseGraphs() {
  std::vector<std::pair<uint64_t, std::shared_ptr<backend::Stream>>> capturing;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : capturing_streams_) {
      if (const auto* stream = streams_.Lookup(id)) capturing.emplace_back(id, *stream);
    }
  }
  for (auto& [id, stream] : capturing) AbandonCapture(id, stream.get());
  decltype(graph_execs_)::Map execs;
  decltype(graphs_)::Map graphs;
  {
    absl::MutexLock lock(&mu_);
    execs = graph_execs_.TakeAll();
    graphs = graphs_.TakeAll();
    graph_bytes_ = 0;
  }
  // Outside mu_: backend calls. Execs first (each holds its graph's backend object).
  execs.clear();
  graphs.clear();
}

// ---------------------------------------------------------------------------- graphs

absl::StatusOr<uint64_t> Session::InstantiateGraph(uint64_t graph_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphEntry> graph;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(graph, graphs_.Find(graph_id, "InstantiateGraph"));
    if (graph_execs_.size() + graph_execs_pending_ >= kMaxGraphExecsPerSession) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "InstantiateGraph: this session holds %d graph execs, the most it may; destroy some "
          "first (DestroyGraphExec)",
          kMaxGraphExecsPerSession));
    }
    GPURPC_RETURN_IF_ERROR(ReserveGraphBytesLocked(graph->bytes, "InstantiateGraph"));
    ++graph_execs_pending_;
  }
  absl::StatusOr<std::unique_ptr<backend::GraphExec>> exec =
      RecordFault(context_->InstantiateGraph(graph->graph));
  auto entry = std::make_shared<GraphExecEntry>();
  const absl::Status instantiated = exec.status();
  if (exec.ok()) {
    entry->exec = *std::move(exec);
    absl::MutexLock exec_lock(&entry->mu);
    entry->nodes = graph->nodes;
    entry->bytes = graph->bytes;
  }
  absl::MutexLock lock(&mu_);
  --graph_execs_pending_;
  if (entry->exec == nullptr) {
    graph_bytes_ -= std::min(graph->bytes, graph_bytes_);
    return instantiated;
  }
  const uint64_t id = NewIdLocked();
  entry->name = std::make_shared<const std::string>(absl::StrCat("graph exec ", id));
  graph_execs_.Insert(id, std::move(entry));
  return id;
}

absl::Status Session::LaunchGraph(const v1::LaunchGraphCommand& launch) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphExecEntry> exec;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(exec, graph_execs_.Find(launch.graph_exec_id(), "LaunchGraph"));
  }
  const uint64_t stream_id = launch.stream_id();
  absl::StatusOr<StreamAndCapture> target = FindStreamCapture(stream_id);
  if (!target.ok()) return Prefixed("LaunchGraph", target.status());
  StreamCapture& capture = *target->capture;
  absl::MutexLock capture_lock(&capture.mu);
  if (capture.active) return CapturingRefusal("LaunchGraph", stream_id);
  if (stream_id == 0 && blocking_captures_active_.load(std::memory_order_acquire) > 0) {
    return RefuseWhileCapturing(0, "LaunchGraph");
  }
  GPURPC_RETURN_IF_ERROR(
      RecordFault(context_->LaunchGraph(exec->exec.get(), target->stream.get())));
  // Timed like one kernel: the whole graph from when the work before it on the stream ends.
  if (Watchdog* watchdog = watchdog_ptr_.load(std::memory_order_acquire)) {
    watchdog->OnLaunch(stream_id, target->stream.get(), exec->name);
  }
  return absl::OkStatus();
}

absl::Status Session::DestroyGraph(uint64_t graph_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphEntry> graph;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(graph, graphs_.Take(graph_id, "DestroyGraph"));
    graph_bytes_ -= std::min(graph->bytes, graph_bytes_);
  }
  // Destroyed here, outside mu_ (a backend call), unless a graph exec or a call still uses it.
  return absl::OkStatus();
}

absl::Status Session::DestroyGraphExec(uint64_t graph_exec_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphExecEntry> exec;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(exec, graph_execs_.Take(graph_exec_id, "DestroyGraphExec"));
  }
  uint64_t bytes;
  {
    absl::MutexLock exec_lock(&exec->mu);
    exec->destroyed = true;
    bytes = exec->bytes;
  }
  ReleaseGraphBytes(bytes);
  return absl::OkStatus();
}

absl::StatusOr<v1::GetGraphNodesResponse> Session::GetGraphNodes(uint64_t graph_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphEntry> graph;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(graph, graphs_.Find(graph_id, "GetGraphNodes"));
  }
  v1::GetGraphNodesResponse response;
  for (size_t i = 0; i < graph->nodes.size(); ++i) {
    const GraphNodeRecord& record = graph->nodes[i];
    v1::GraphNode* node = response.add_nodes();
    node->set_index(static_cast<uint32_t>(i));
    node->set_type(record.type);
    if (record.type != v1::GRAPH_NODE_TYPE_KERNEL || record.function == nullptr) continue;
    node->set_function_id(record.function_id);
    node->set_kernel_name(*record.function->name);
    for (const backend::ParamInfo& param : record.function->function->params()) {
      v1::ParamInfo* info = node->add_params();
      info->set_offset_bytes(param.offset_bytes);
      info->set_size_bytes(param.size_bytes);
    }
    SetDim(record.config.grid, node->mutable_grid());
    SetDim(record.config.block, node->mutable_block());
    node->set_shared_memory_bytes(record.config.shared_memory_bytes);
  }
  return response;
}

absl::Status Session::UpdateGraphExec(uint64_t graph_exec_id, uint64_t graph_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<GraphExecEntry> exec;
  std::shared_ptr<GraphEntry> graph;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(exec, graph_execs_.Find(graph_exec_id, "UpdateGraphExec"));
    GPURPC_ASSIGN_OR_RETURN(graph, graphs_.Find(graph_id, "UpdateGraphExec"));
  }
  absl::MutexLock exec_lock(&exec->mu);
  if (exec->destroyed) {
    return absl::NotFoundError(
        absl::StrFormat("UpdateGraphExec: graph exec %d was destroyed meanwhile", graph_exec_id));
  }
  if (exec->nodes.size() != graph->nodes.size()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "UpdateGraphExec: graph exec %d has %d nodes and graph %d has %d; an update needs the "
        "same topology (instantiate the graph instead)",
        graph_exec_id, exec->nodes.size(), graph_id, graph->nodes.size()));
  }
  for (size_t i = 0; i < graph->nodes.size(); ++i) {
    if (exec->nodes[i].type != graph->nodes[i].type) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "UpdateGraphExec: node %d is a %s node in graph exec %d but a %s node in graph %d; an "
          "update needs the same topology (instantiate the graph instead)",
          i, TypeName(exec->nodes[i].type), graph_exec_id, TypeName(graph->nodes[i].type),
          graph_id));
    }
  }
  const uint64_t before = exec->bytes;
  const uint64_t after = graph->bytes;
  if (after > before) {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(ReserveGraphBytesLocked(after - before, "UpdateGraphExec"));
  }
  absl::Status status =
      RecordFault(context_->UpdateGraphExec(exec->exec.get(), graph->graph.get()));
  if (!status.ok()) {
    if (after > before) ReleaseGraphBytes(after - before);
    return status;
  }
  if (before > after) ReleaseGraphBytes(before - after);
  exec->nodes = graph->nodes;
  exec->bytes = after;
  return absl::OkStatus();
}

absl::Status Session::SetGraphExecKernelNodeArgs(
    const v1::SetGraphExecKernelNodeArgsRequest& request) {
  GPURPC_RETURN_IF_ERROR(fault());
  constexpr char kCall[] = "SetGraphExecKernelNodeArgs";
  const uint64_t exec_id = request.graph_exec_id();
  std::shared_ptr<GraphExecEntry> exec;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(exec, graph_execs_.Find(exec_id, kCall));
  }
  absl::MutexLock exec_lock(&exec->mu);
  if (exec->destroyed) {
    return absl::NotFoundError(
        absl::StrFormat("%s: graph exec %d was destroyed meanwhile", kCall, exec_id));
  }
  const uint32_t index = request.node_index();
  if (index >= exec->nodes.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: node_index %d is past the %d nodes of graph exec %d", kCall, index,
                        exec->nodes.size(), exec_id));
  }
  GraphNodeRecord& node = exec->nodes[index];
  if (node.type != v1::GRAPH_NODE_TYPE_KERNEL || node.function == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: node %d of graph exec %d is a %s node, not a kernel node", kCall,
                        index, exec_id, TypeName(node.type)));
  }
  std::shared_ptr<FunctionEntry> function = node.function;
  uint64_t function_id = node.function_id;
  if (request.function_id() != 0) {
    absl::StatusOr<std::shared_ptr<FunctionEntry>> found = FindFunction(request.function_id());
    if (!found.ok()) return Prefixed(kCall, found.status());
    function = *std::move(found);
    function_id = request.function_id();
  }
  // The launch this node will make, checked exactly as Launch checks one.
  v1::LaunchCommand launch;
  launch.set_function_id(function_id);
  if (request.has_grid()) {
    *launch.mutable_grid() = request.grid();
  } else {
    SetDim(node.config.grid, launch.mutable_grid());
  }
  if (request.has_block()) {
    *launch.mutable_block() = request.block();
  } else {
    SetDim(node.config.block, launch.mutable_block());
  }
  launch.set_shared_memory_bytes(request.has_shared_memory_bytes()
                                     ? request.shared_memory_bytes()
                                     : node.config.shared_memory_bytes);
  launch.set_packed_args(request.packed_args());
  *launch.mutable_args() = request.args();
  backend::LaunchConfig config;
  GPURPC_RETURN_IF_ERROR(CheckLaunchDims(*function, launch, &config));
  std::vector<uint8_t> scratch;
  GPURPC_ASSIGN_OR_RETURN(absl::Span<const uint8_t> packed, PackArgs(*function, launch, &scratch));

  const uint64_t cost = packed.size() + kGraphNodeOverheadBytes;
  if (cost > node.cost_bytes) {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(ReserveGraphBytesLocked(cost - node.cost_bytes, kCall));
  }
  absl::Status status = RecordFault(context_->SetGraphExecKernelNode(
      exec->exec.get(), index, function->function, config, packed));
  if (!status.ok()) {
    if (cost > node.cost_bytes) ReleaseGraphBytes(cost - node.cost_bytes);
    return status;
  }
  if (node.cost_bytes > cost) ReleaseGraphBytes(node.cost_bytes - cost);
  exec->bytes = exec->bytes - node.cost_bytes + cost;
  node.function = std::move(function);
  node.function_id = function_id;
  node.config = config;
  node.cost_bytes = cost;
  return absl::OkStatus();
}

}  // namespace gpurpc::worker
