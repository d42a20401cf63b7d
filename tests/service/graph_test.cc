// CUDA graphs through the daemon (ctest label `service`): stream capture, instantiation,
// replay, updates and kernel-node arguments, through the C++ client (and the raw gpurpc.v1
// stubs where the client cannot say a hostile request), against a real gpurpcd with worker
// processes on the fake backend.
//
// The fake backend replays a graph's recorded operations in order on the launch stream's
// thread, with the address checks of the operations themselves (fake_graph.h), so the data
// a replay produces is checked here exactly as a GPU would produce it.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/shared_daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::SharedDaemonTest;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint64_t kElements = 256;

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

template <typename T>
std::vector<uint8_t> ToBytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// `grid` blocks of `block` threads along x, on `stream`.
LaunchConfig Linear(uint32_t grid, uint32_t block, const Stream* stream = nullptr) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  config.stream = stream;
  return config;
}

// The raw ExecutionService of one session, for requests the client does not make.
class RawSession {
 public:
  RawSession(const Client& client, uint64_t session_id)
      : session_id_(std::to_string(session_id)),
        stub_(v1::ExecutionService::NewStub(client.channel())) {}

  template <typename Request, typename Response, typename Method>
  absl::Status Call(Method method, const Request& request, Response* response) {
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, session_id_);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return FromGrpcStatus(((*stub_).*method)(&context, request, response));
  }

  absl::Status BeginCapture(uint64_t stream_id, int mode = v1::CAPTURE_MODE_RELAXED) {
    v1::BeginCaptureRequest request;
    request.set_stream_id(stream_id);
    request.set_mode(static_cast<v1::CaptureMode>(mode));
    v1::BeginCaptureResponse response;
    return Call(&v1::ExecutionService::Stub::BeginCapture, request, &response);
  }
  absl::Status EndCapture(uint64_t stream_id) {
    v1::EndCaptureRequest request;
    request.set_stream_id(stream_id);
    v1::EndCaptureResponse response;
    return Call(&v1::ExecutionService::Stub::EndCapture, request, &response);
  }
  absl::Status LaunchGraph(uint64_t exec_id, uint64_t stream_id = 0) {
    v1::LaunchGraphRequest request;
    request.mutable_launch()->set_graph_exec_id(exec_id);
    request.mutable_launch()->set_stream_id(stream_id);
    v1::LaunchGraphResponse response;
    return Call(&v1::ExecutionService::Stub::LaunchGraph, request, &response);
  }
  absl::Status Instantiate(uint64_t graph_id) {
    v1::InstantiateGraphRequest request;
    request.set_graph_id(graph_id);
    v1::InstantiateGraphResponse response;
    return Call(&v1::ExecutionService::Stub::InstantiateGraph, request, &response);
  }
  absl::Status GetNodes(uint64_t graph_id) {
    v1::GetGraphNodesRequest request;
    request.set_graph_id(graph_id);
    v1::GetGraphNodesResponse response;
    return Call(&v1::ExecutionService::Stub::GetGraphNodes, request, &response);
  }
  absl::Status SetArgs(const v1::SetGraphExecKernelNodeArgsRequest& request) {
    v1::SetGraphExecKernelNodeArgsResponse response;
    return Call(&v1::ExecutionService::Stub::SetGraphExecKernelNodeArgs, request, &response);
  }

 private:
  const std::string session_id_;
  std::unique_ptr<v1::ExecutionService::Stub> stub_;
};

class GraphTest : public SharedDaemonTest<GraphTest> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SharedDaemonTest::SetUp());
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon().address()));
    client_.emplace(std::move(client));
    ASSERT_OK_AND_ASSIGN(session_, client_->OpenSession());
    ASSERT_OK_AND_ASSIGN(module_, CompileFakeKernels(session_));
    ASSERT_OK_AND_ASSIGN(fill_, module_.GetFunction("fill_u32"));
    ASSERT_OK_AND_ASSIGN(add_one_, module_.GetFunction("add_one_f32"));
    ASSERT_OK_AND_ASSIGN(copy_, module_.GetFunction("copy_bytes"));
    ASSERT_OK_AND_ASSIGN(spin_, module_.GetFunction("spin_us"));
    raw_.emplace(*client_, session_.id());
  }

  absl::StatusOr<Buffer> Zeros(uint64_t bytes) {
    absl::StatusOr<Buffer> buffer = session_.Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    if (absl::Status s = session_.Memset(buffer->at(0), 0, 1, bytes); !s.ok()) return s;
    return buffer;
  }

  absl::StatusOr<std::vector<uint32_t>> Words(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<uint32_t>(*bytes);
  }

  absl::StatusOr<std::vector<float>> Floats(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<float>(*bytes);
  }

  // A graph of one fill_u32(buffer, value, kElements) node, captured on `stream`.
  absl::StatusOr<Graph> FillGraph(const Stream& stream, const Buffer& buffer, uint32_t value) {
    if (absl::Status s = stream.BeginCapture(); !s.ok()) return s;
    if (absl::Status s =
            fill_.LaunchAsync(Linear(1, kElements, &stream), buffer, value, uint64_t{kElements});
        !s.ok()) {
      return s;
    }
    return stream.EndCapture();
  }

  std::optional<Client> client_;
  Session session_;
  Module module_;
  Function fill_, add_one_, copy_, spin_;
  std::optional<RawSession> raw_;
};

// ----------------------------------------------------------------------------- replay

TEST_F(GraphTest, HundredCapturedKernelsReplayedGiveTheRightData) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * sizeof(float)));
  EXPECT_THAT(stream.IsCapturing(), IsOkAndHolds(false));
  ASSERT_OK(stream.BeginCapture());
  EXPECT_THAT(stream.IsCapturing(), IsOkAndHolds(true));
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK(add_one_.LaunchAsync(Linear(1, kElements, &stream), data, uint64_t{kElements}));
  }
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  EXPECT_THAT(stream.IsCapturing(), IsOkAndHolds(false));
  EXPECT_EQ(graph.node_count(), 100u);
  // Captured, not run.
  EXPECT_THAT(Floats(data), IsOkAndHolds(Each(0.0f)));

  ASSERT_OK_AND_ASSIGN(std::vector<v1::GraphNode> nodes, graph.Nodes());
  ASSERT_THAT(nodes, SizeIs(100));
  for (size_t i = 0; i < nodes.size(); ++i) {
    EXPECT_EQ(nodes[i].index(), i);
    EXPECT_EQ(nodes[i].type(), v1::GRAPH_NODE_TYPE_KERNEL);
    EXPECT_EQ(nodes[i].function_id(), add_one_.id());
    EXPECT_EQ(nodes[i].kernel_name(), "add_one_f32");
    EXPECT_EQ(nodes[i].block().x(), kElements);
    EXPECT_EQ(nodes[i].grid().x(), 1u);
    EXPECT_THAT(nodes[i].params(), SizeIs(2));
  }

  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  for (int i = 0; i < 3; ++i) ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Floats(data), IsOkAndHolds(Each(300.0f)));
  // On the default stream too, and after the graph itself is gone.
  ASSERT_OK(graph.Destroy());
  ASSERT_OK(exec.Launch());
  ASSERT_OK(session_.Synchronize());
  EXPECT_THAT(Floats(data), IsOkAndHolds(Each(400.0f)));
}

TEST_F(GraphTest, CaptureRecordsMemsetsAndCopiesAndReplaysReadLiveMemory) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer a, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Buffer b, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(session_.MemsetAsync(a.at(0), 3, 4, kElements, &stream));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(b.at(0), a.at(0), kElements * 4, &stream));
  ASSERT_OK(add_one_.LaunchAsync(Linear(1, kElements, &stream), b, uint64_t{kElements}));
  // Empty work is no node.
  ASSERT_OK(session_.MemsetAsync(a.at(0), 0, 4, 0, &stream));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(std::vector<v1::GraphNode> nodes, graph.Nodes());
  std::vector<v1::GraphNodeType> types;
  for (const v1::GraphNode& node : nodes) types.push_back(node.type());
  EXPECT_THAT(types, ElementsAre(v1::GRAPH_NODE_TYPE_MEMSET, v1::GRAPH_NODE_TYPE_MEMCPY,
                                 v1::GRAPH_NODE_TYPE_KERNEL));
  EXPECT_EQ(nodes[0].function_id(), 0u);
  EXPECT_THAT(Words(a), IsOkAndHolds(Each(0u)));

  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(a), IsOkAndHolds(Each(3u)));
  float three;
  const uint32_t three_bits = 3;
  std::memcpy(&three, &three_bits, 4);
  EXPECT_THAT(Floats(b), IsOkAndHolds(Each(three + 1.0f)));
}

TEST_F(GraphTest, NothingRunsWhileANonBlockingStreamCapturesAndStreamZeroStaysUsable) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), data, 7u, uint64_t{kElements}));
  // Stream 0 work runs meanwhile; the captured fill does not.
  ASSERT_OK(session_.Flush());
  EXPECT_THAT(Words(data), IsOkAndHolds(Each(0u)));
  ASSERT_OK(fill_.LaunchAsync(Linear(1, 4), data, 1u, uint64_t{4}));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> head, session_.Download(data.at(0), 16));
  EXPECT_THAT(FromBytes<uint32_t>(head), Each(1u));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(data), IsOkAndHolds(Each(7u)));
}

// ----------------------------------------------------------------------------- update

TEST_F(GraphTest, UpdateTakesTheParametersOfAGraphOfTheSameTopology) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer a, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Buffer b, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Graph first, FillGraph(stream, a, 1));
  ASSERT_OK_AND_ASSIGN(Graph second, FillGraph(stream, b, 2));
  ASSERT_OK_AND_ASSIGN(GraphExec exec, first.Instantiate());
  ASSERT_OK(exec.Update(second));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(a), IsOkAndHolds(Each(0u)));
  EXPECT_THAT(Words(b), IsOkAndHolds(Each(2u)));

  // Another topology: refused, naming the difference; the exec keeps what it had.
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), a, 5u, uint64_t{kElements}));
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), a, 6u, uint64_t{kElements}));
  ASSERT_OK_AND_ASSIGN(Graph two_nodes, stream.EndCapture());
  EXPECT_THAT(exec.Update(two_nodes), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               AllOf(HasSubstr("1 nodes"), HasSubstr("has 2"),
                                                     HasSubstr("same topology"))));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(session_.MemsetAsync(a.at(0), 9, 4, kElements, &stream));
  ASSERT_OK_AND_ASSIGN(Graph memset, stream.EndCapture());
  EXPECT_THAT(exec.Update(memset),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("node 0 is a kernel node"), HasSubstr("memset node"))));
  ASSERT_OK(session_.Memset(b.at(0), 0, 4, kElements));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(a), IsOkAndHolds(Each(0u)));
  EXPECT_THAT(Words(b), IsOkAndHolds(Each(2u)));
}

// ------------------------------------------------------------------- kernel node args

TEST_F(GraphTest, KernelNodeArgsChangeLaterLaunchesOnly) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Buffer first, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Buffer second, Zeros(kElements * 4));
  // fill data with 5, then copy data to `first`.
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), data, 5u, uint64_t{kElements}));
  ASSERT_OK(copy_.LaunchAsync(Linear(4, kElements, &stream), first, data, uint64_t{kElements * 4}));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  // A long kernel ahead keeps the first launch queued while the nodes change.
  ASSERT_OK(spin_.LaunchAsync(Linear(1, 1, &stream), uint64_t{200'000}));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(exec.SetKernelNodeArgs(0, fill_, Linear(1, kElements), data, 9u, uint64_t{kElements}));
  ASSERT_OK(exec.SetKernelNodeArgs(1, copy_, Linear(4, kElements), second, data,
                                   uint64_t{kElements * 4}));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(first), IsOkAndHolds(Each(5u)));
  EXPECT_THAT(Words(second), IsOkAndHolds(Each(9u)));

  // Another kernel for node 0: add_one_f32 on the floats of `first`.
  ASSERT_OK(exec.SetKernelNodeArgs(0, add_one_, Linear(1, kElements), first, uint64_t{kElements}));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  float five;
  const uint32_t five_bits = 5;
  std::memcpy(&five, &five_bits, 4);
  EXPECT_THAT(Floats(first), IsOkAndHolds(Each(five + 1.0f)));
}

TEST_F(GraphTest, KernelNodeArgsAreCheckedLikeALaunch) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), data, 5u, uint64_t{kElements}));
  ASSERT_OK(session_.MemsetAsync(data.at(0), 1, 4, 4, &stream));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());

  v1::SetGraphExecKernelNodeArgsRequest request;
  request.set_graph_exec_id(exec.id());
  request.set_node_index(0);
  auto typed = [&](v1::SetGraphExecKernelNodeArgsRequest r) {
    r.clear_args();
    r.add_args()->mutable_buffer()->set_buffer_id(data.id());
    r.add_args()->set_u32(8);
    r.add_args()->set_u64(kElements);
    return r;
  };
  // Typed arguments, the node's kernel and dimensions kept: fine.
  ASSERT_OK(raw_->SetArgs(typed(request)));
  // Wrong sizes and counts, as a launch names them.
  v1::SetGraphExecKernelNodeArgsRequest bad = typed(request);
  bad.mutable_args(1)->set_u64(8);
  EXPECT_THAT(raw_->SetArgs(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("parameter #1: expected 4 bytes")));
  bad = typed(request);
  bad.mutable_args()->RemoveLast();
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 arguments were given")));
  bad = request;
  bad.set_packed_args(std::string(23, '\0'));
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("packed arguments are 23")));
  bad = typed(request);
  bad.mutable_args(0)->mutable_buffer()->set_buffer_id(12345);
  EXPECT_THAT(raw_->SetArgs(bad), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no buffer")));
  bad = typed(request);
  bad.mutable_grid()->set_x(0);
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grid.x is 0")));
  bad = typed(request);
  bad.mutable_block()->set_x(2048);
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block.x")));
  bad = typed(request);
  bad.set_function_id(12345);
  EXPECT_THAT(raw_->SetArgs(bad), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function")));
  bad = typed(request);
  bad.set_node_index(1);
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node 1 of graph exec")));
  bad = typed(request);
  bad.set_node_index(2);
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the 2 nodes")));
  bad = typed(request);
  bad.set_graph_exec_id(12345);
  EXPECT_THAT(raw_->SetArgs(bad),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph exec 12345")));
  // The client packs by the function's layout first.
  EXPECT_THAT(exec.SetKernelNodeArgs(0, fill_, Linear(1, kElements), data, uint64_t{1}),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // None of them changed the node: it fills with 8.
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> words, Words(data));
  EXPECT_THAT(std::vector<uint32_t>(words.begin(), words.begin() + 4), Each(1u));
  EXPECT_THAT(std::vector<uint32_t>(words.begin() + 4, words.end()), Each(8u));
}

// ------------------------------------------------------------------- hostile inputs

TEST_F(GraphTest, CaptureMisuseIsRefusedAndTheSessionStaysUsable) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  EXPECT_THAT(raw_->BeginCapture(0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("legacy default stream")));
  EXPECT_THAT(raw_->BeginCapture(12345),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stream 12345")));
  EXPECT_THAT(raw_->BeginCapture(stream.id(), 7),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode 7")));
  EXPECT_THAT(stream.EndCapture().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not capturing")));
  EXPECT_THAT(raw_->EndCapture(0), StatusIs(absl::StatusCode::kFailedPrecondition));

  ASSERT_OK(stream.BeginCapture(v1::CAPTURE_MODE_GLOBAL));
  EXPECT_THAT(stream.BeginCapture(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already capturing")));
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), data, 4u, uint64_t{kElements}));
  const auto capturing = [](const char* call) {
    return StatusIs(absl::StatusCode::kFailedPrecondition,
                    AllOf(HasSubstr(call), HasSubstr("capturing a graph")));
  };
  EXPECT_THAT(stream.Synchronize(), capturing("SynchronizeStream"));
  EXPECT_THAT(session_.Synchronize(), capturing("SynchronizeSession"));
  EXPECT_THAT(session_.Download(data.at(0), 16, &stream).status(), capturing("Download"));
  EXPECT_THAT(session_.Upload(data.at(0), ToBytes(std::vector<uint32_t>{1, 2}), &stream),
              capturing("Upload"));
  // A blocking stream captures: stream 0 is off limits.
  const auto legacy = StatusIs(absl::StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr("stream 0"), HasSubstr("non_blocking")));
  EXPECT_THAT(session_.Download(data.at(0), 16).status(), legacy);
  EXPECT_THAT(fill_.Launch(Linear(1, 4), data, 1u, uint64_t{4}), legacy);
  ASSERT_OK_AND_ASSIGN(Event event, session_.CreateEvent());
  // Queued work that is refused surfaces at the next synchronising call, as any error of
  // queued work does (the rest of its batch is skipped); the capture goes on regardless.
  ASSERT_OK(event.Record(&stream));
  ASSERT_OK(session_.Flush());
  ASSERT_OK(add_one_.LaunchAsync(Linear(1, kElements, &stream), data, uint64_t{kElements}));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  EXPECT_EQ(graph.node_count(), 2u);
  EXPECT_THAT(session_.Synchronize(), capturing("RecordEvent"));
  ASSERT_OK(session_.Synchronize());

  // The session and the graph work.
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  float four;
  const uint32_t four_bits = 4;
  std::memcpy(&four, &four_bits, 4);
  EXPECT_THAT(Floats(data), IsOkAndHolds(Each(four + 1.0f)));

  // A graph launch cannot be captured.
  ASSERT_OK(stream.BeginCapture());
  EXPECT_THAT(raw_->LaunchGraph(exec.id(), stream.id()), capturing("LaunchGraph"));
  // Destroying a capturing stream abandons its capture.
  const uint64_t stream_id = stream.id();
  { Stream doomed = std::move(stream); }
  EXPECT_THAT(raw_->EndCapture(stream_id), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(session_.Synchronize());
}

TEST_F(GraphTest, UnknownDestroyedAndForeignIdsAreNotFound) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK_AND_ASSIGN(Graph graph, FillGraph(stream, data, 3));
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  EXPECT_THAT(raw_->Instantiate(12345),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph 12345")));
  EXPECT_THAT(raw_->GetNodes(0), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph 0")));
  EXPECT_THAT(raw_->LaunchGraph(12345),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph exec 12345")));
  EXPECT_THAT(raw_->LaunchGraph(exec.id(), 12345),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stream 12345")));
  // A graph id is no graph exec id and the other way round.
  EXPECT_THAT(raw_->LaunchGraph(graph.id()), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw_->Instantiate(exec.id()), StatusIs(absl::StatusCode::kNotFound));

  // Another session (of the same tenant) cannot name them.
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawSession other_raw(*client_, other.id());
  EXPECT_THAT(other_raw.Instantiate(graph.id()), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(other_raw.GetNodes(graph.id()), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(other_raw.LaunchGraph(exec.id()), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(other_raw.BeginCapture(stream.id()), StatusIs(absl::StatusCode::kNotFound));

  // Destroyed: NOT_FOUND, by the unary RPC or from the command stream.
  const uint64_t exec_id = exec.id();
  ASSERT_OK(exec.Destroy());
  EXPECT_THAT(exec.Destroy(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw_->LaunchGraph(exec_id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph exec")));
  ASSERT_OK(exec.Launch());  // id 0 now: refused by the daemon, surfaced at the sync
  EXPECT_THAT(session_.Synchronize(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no graph exec 0")));
  const uint64_t graph_id = graph.id();
  ASSERT_OK(graph.Destroy());
  EXPECT_THAT(raw_->Instantiate(graph_id), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(session_.Synchronize());
  EXPECT_THAT(Words(data), IsOkAndHolds(Each(0u)));
}

TEST_F(GraphTest, GraphsAndGraphExecsAreBoundedPerSession) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  std::vector<Graph> graphs;
  absl::Status status;
  while (status.ok() && graphs.size() < 2000) {
    absl::StatusOr<Graph> graph = FillGraph(stream, data, 1);
    status = graph.status();
    if (graph.ok()) graphs.push_back(*std::move(graph));
  }
  EXPECT_EQ(graphs.size(), 1024u);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted,
                               AllOf(HasSubstr("1024 graphs"), HasSubstr("DestroyGraph"))));
  graphs.pop_back();
  ASSERT_OK_AND_ASSIGN(Graph again, FillGraph(stream, data, 1));
  graphs.clear();

  std::vector<GraphExec> execs;
  while (execs.size() < 2000) {
    absl::StatusOr<GraphExec> exec = again.Instantiate();
    status = exec.status();
    if (!exec.ok()) break;
    execs.push_back(*std::move(exec));
  }
  EXPECT_EQ(execs.size(), 1024u);
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("1024 graph execs")));
  execs.clear();
  ASSERT_OK(stream.Synchronize());
}

TEST_F(GraphTest, GraphsAreBoundedInWorkerMemory) {
  // 1000 nodes of 24 argument bytes count 280 000 bytes per graph exec: the 256 MiB bound
  // comes long before the 1024 graph execs.
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  for (int i = 0; i < 1000; ++i) {
    ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements, &stream), data, 2u, uint64_t{kElements}));
  }
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  std::vector<GraphExec> execs;
  absl::Status status;
  while (execs.size() < 1024) {
    absl::StatusOr<GraphExec> exec = graph.Instantiate();
    status = exec.status();
    if (!exec.ok()) break;
    execs.push_back(*std::move(exec));
  }
  EXPECT_LT(execs.size(), 1000u);
  EXPECT_GT(execs.size(), 900u);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted,
                               AllOf(HasSubstr("bound of 268435456"), HasSubstr("graph execs"))));
  // What was given back can be taken again.
  execs.pop_back();
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(data), IsOkAndHolds(Each(2u)));
}

TEST_F(GraphTest, AReplayOnFreedMemoryFaultsItsSessionOnly) {
  ASSERT_OK_AND_ASSIGN(Session victim, client_->OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(victim));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Stream stream, victim.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, victim.Allocate(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill.LaunchAsync(Linear(1, kElements, &stream), data, 1u, uint64_t{kElements}));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(data.Free());
  ASSERT_OK(exec.Launch(&stream));
  EXPECT_THAT(victim.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("ILLEGAL_ADDRESS")));
  // This session and the daemon go on.
  ASSERT_OK(daemon().CheckRunning());
  ASSERT_OK_AND_ASSIGN(Buffer mine, Zeros(kElements * 4));
  ASSERT_OK(fill_.LaunchAsync(Linear(1, kElements), mine, 6u, uint64_t{kElements}));
  ASSERT_OK(session_.Synchronize());
  EXPECT_THAT(Words(mine), IsOkAndHolds(Each(6u)));
}

TEST_F(GraphTest, UnloadingAModuleKeepsItsKernelsInGraphs) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  std::optional<GraphExec> exec;
  {
    ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session_));
    ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
    ASSERT_OK(stream.BeginCapture());
    ASSERT_OK(fill.LaunchAsync(Linear(1, kElements, &stream), data, 11u, uint64_t{kElements}));
    ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
    ASSERT_OK_AND_ASSIGN(GraphExec made, graph.Instantiate());
    exec.emplace(std::move(made));
  }  // the module and its function go (unloaded once nothing uses them)
  ASSERT_OK(exec->Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(Words(data), IsOkAndHolds(Each(11u)));
}

// ----------------------------------------------------------------------------- watchdog

TEST(GraphWatchdogTest, AGraphThatRunsTooLongEndsItsSessionNamingTheGraphExec) {
  TestDaemon::Options options;
  options.extra_flags = {"--kernel-timeout=1s"};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TestDaemon> daemon, TestDaemon::Start(options));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function spin, module.GetFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Stream stream, session.CreateStream());
  ASSERT_OK(stream.BeginCapture());
  // Each node is within the timeout; the graph as a whole is not.
  for (int i = 0; i < 6; ++i) ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &stream), uint64_t{400'000}));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(session.Flush());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (session.state() != v1::SESSION_STATE_FAULTED && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(session.fault(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        AllOf(HasSubstr(absl::StrCat("graph exec ", exec.id())),
                                              HasSubstr("kernel timeout of 1s"))));
}

}  // namespace
}  // namespace gpurpc
