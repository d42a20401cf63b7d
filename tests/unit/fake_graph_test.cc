// The fake backend's CUDA graphs (server/worker/backend/fake/fake_graph.h) directly, below
// the session layer: what a capturing stream records and refuses, the CUDA errors it
// models, replays with the checks of the operations themselves, updates and kernel-node
// parameters.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kElements = 64;

absl::Span<const uint8_t> AsBytes(absl::string_view text) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

std::vector<uint8_t> Pack(std::initializer_list<std::pair<size_t, uint64_t>> fields, size_t size) {
  std::vector<uint8_t> packed(size, 0);
  for (const auto& [offset, value] : fields) std::memcpy(packed.data() + offset, &value, 8);
  return packed;
}

class FakeGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeFakeBackend(uint64_t{64} << 20);
    ASSERT_OK_AND_ASSIGN(context_, backend_->OpenContext(0));
    ASSERT_OK_AND_ASSIGN(module_,
                         context_->LoadModule(AsBytes(::gpurpc::testing::kFakeKernelsPtx)));
    ASSERT_OK_AND_ASSIGN(fill_, module_->GetFunction("fill_u32"));
    ASSERT_OK_AND_ASSIGN(add_one_, module_->GetFunction("add_one_f32"));
    ASSERT_OK_AND_ASSIGN(data_, context_->Alloc(kElements * 4));
    ASSERT_OK_AND_ASSIGN(blocking_, context_->CreateStream(/*non_blocking=*/false));
    ASSERT_OK_AND_ASSIGN(non_blocking_, context_->CreateStream(/*non_blocking=*/true));
  }

  static LaunchConfig Threads(uint32_t n) {
    LaunchConfig config;
    config.block.x = n;
    return config;
  }

  absl::Status Fill(uint32_t value, Stream* stream, DevicePtr where = 0) {
    const std::vector<uint8_t> args =
        Pack({{0, where == 0 ? data_ : where}, {8, value}, {16, kElements}}, 24);
    return context_->Launch(fill_, Threads(kElements), args, stream);
  }

  absl::StatusOr<std::vector<uint32_t>> Words() {
    std::vector<uint32_t> words(kElements);
    absl::Status status = context_->Download(words.data(), data_, kElements * 4, nullptr);
    if (!status.ok()) return status;
    return words;
  }

  absl::StatusOr<std::shared_ptr<Graph>> CaptureFill(Stream* stream, uint32_t value) {
    if (absl::Status s = context_->BeginCapture(stream); !s.ok()) return s;
    if (absl::Status s = Fill(value, stream); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<Graph>> graph = context_->EndCapture(stream);
    if (!graph.ok()) return graph.status();
    return std::shared_ptr<Graph>(*std::move(graph));
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Context> context_;
  std::unique_ptr<Module> module_;
  Function* fill_ = nullptr;
  Function* add_one_ = nullptr;
  DevicePtr data_ = 0;
  std::unique_ptr<Stream> blocking_;
  std::unique_ptr<Stream> non_blocking_;
};

TEST_F(FakeGraphTest, ACaptureRecordsKernelsMemsetsAndCopiesInOrderAndRunsNothing) {
  ASSERT_OK_AND_ASSIGN(DevicePtr other, context_->Alloc(kElements * 4));
  EXPECT_THAT(context_->QueryCapture(blocking_.get()), IsOkAndHolds(CaptureStatus::kNone));
  ASSERT_OK(context_->BeginCapture(blocking_.get()));
  EXPECT_THAT(context_->QueryCapture(blocking_.get()), IsOkAndHolds(CaptureStatus::kActive));
  ASSERT_OK(Fill(3, blocking_.get()));
  ASSERT_OK(context_->Memset(other, 9, 4, kElements, blocking_.get()));
  ASSERT_OK(context_->CopyDeviceToDevice(other, data_, 16, blocking_.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Graph> graph, context_->EndCapture(blocking_.get()));
  EXPECT_THAT(graph->nodes(),
              ElementsAre(GraphNodeKind::kKernel, GraphNodeKind::kMemset, GraphNodeKind::kCopy));
  ASSERT_OK(context_->Synchronize());
  EXPECT_THAT(Words(), IsOkAndHolds(Each(0u)));

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphExec> exec,
                       context_->InstantiateGraph(std::move(graph)));
  ASSERT_OK(context_->LaunchGraph(exec.get(), non_blocking_.get()));
  ASSERT_OK(context_->SynchronizeStream(non_blocking_.get()));
  EXPECT_THAT(Words(), IsOkAndHolds(Each(3u)));
  std::vector<uint32_t> copied(kElements);
  ASSERT_OK(context_->Download(copied.data(), other, kElements * 4, nullptr));
  EXPECT_THAT(std::vector<uint32_t>(copied.begin(), copied.begin() + 4), Each(3u));
  EXPECT_THAT(std::vector<uint32_t>(copied.begin() + 4, copied.end()), Each(9u));
}

TEST_F(FakeGraphTest, WorkACaptureCannotRecordIsRefusedAndInvalidatesIt) {
  ASSERT_OK(context_->BeginCapture(blocking_.get()));
  EXPECT_THAT(context_->BeginCapture(blocking_.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ILLEGAL_STATE")));
  uint32_t word = 1;
  EXPECT_THAT(context_->Upload(data_, &word, 4, blocking_.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")));
  EXPECT_THAT(context_->QueryCapture(blocking_.get()), IsOkAndHolds(CaptureStatus::kInvalidated));
  EXPECT_THAT(context_->EndCapture(blocking_.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")));
  EXPECT_THAT(context_->EndCapture(blocking_.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not capturing")));

  // The legacy stream while a blocking stream captures, and Synchronize.
  ASSERT_OK(context_->BeginCapture(blocking_.get()));
  EXPECT_THAT(Fill(1, nullptr), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("CUDA_ERROR_STREAM_CAPTURE_IMPLICIT")));
  EXPECT_THAT(context_->Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(context_->EndCapture(blocking_.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("INVALIDATED")));
  // A non-blocking one leaves the legacy stream alone.
  ASSERT_OK(context_->BeginCapture(non_blocking_.get()));
  ASSERT_OK(Fill(1, nullptr));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Graph> graph, context_->EndCapture(non_blocking_.get()));
  EXPECT_THAT(graph->nodes(), ElementsAre());
  EXPECT_THAT(context_->BeginCapture(nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("legacy")));
  // Nothing was poisoned.
  EXPECT_THAT(Words(), IsOkAndHolds(Each(1u)));
}

TEST_F(FakeGraphTest, AReplayOnFreedMemoryFaultsWithoutTouchingTheHost) {
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Graph> graph, CaptureFill(blocking_.get(), 5));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphExec> exec, context_->InstantiateGraph(graph));
  ASSERT_OK(context_->Free(data_));
  data_ = 0;
  ASSERT_OK(context_->LaunchGraph(exec.get(), blocking_.get()));
  EXPECT_THAT(context_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
}

TEST_F(FakeGraphTest, UpdatesAndKernelNodeParametersApplyToLaterLaunchesOnly) {
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Graph> one, CaptureFill(blocking_.get(), 1));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Graph> two, CaptureFill(blocking_.get(), 2));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphExec> exec, context_->InstantiateGraph(one));
  // A spin ahead keeps the first launch queued while the exec changes.
  ASSERT_OK_AND_ASSIGN(Function * spin, module_->GetFunction("spin_us"));
  ASSERT_OK(context_->Launch(spin, Threads(1), Pack({{0, 100'000}}, 8), blocking_.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), blocking_.get()));
  ASSERT_OK(context_->UpdateGraphExec(exec.get(), two.get()));
  ASSERT_OK(context_->SynchronizeStream(blocking_.get()));
  EXPECT_THAT(Words(), IsOkAndHolds(Each(1u)));
  ASSERT_OK(context_->LaunchGraph(exec.get(), blocking_.get()));
  ASSERT_OK(context_->SynchronizeStream(blocking_.get()));
  EXPECT_THAT(Words(), IsOkAndHolds(Each(2u)));

  // Another kernel for node 0, with its own arguments.
  ASSERT_OK(context_->SetGraphExecKernelNode(exec.get(), 0, add_one_, Threads(kElements),
                                             Pack({{0, data_}, {8, 4}}, 16)));
  ASSERT_OK(context_->LaunchGraph(exec.get(), blocking_.get()));
  ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> words, Words());
  float first;
  std::memcpy(&first, &words[0], 4);
  float two_as_float;
  const uint32_t two_bits = 2;
  std::memcpy(&two_as_float, &two_bits, 4);
  EXPECT_EQ(first, two_as_float + 1.0f);
  EXPECT_EQ(words[4], 2u);
  // Refusals: wrong sizes, no such node, another topology.
  EXPECT_THAT(context_->SetGraphExecKernelNode(exec.get(), 0, fill_, Threads(kElements),
                                               std::vector<uint8_t>(8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("24 bytes")));
  EXPECT_THAT(context_->SetGraphExecKernelNode(exec.get(), 1, fill_, Threads(kElements),
                                               std::vector<uint8_t>(24)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a kernel node")));
  ASSERT_OK(context_->BeginCapture(blocking_.get()));
  ASSERT_OK(context_->Memset(data_, 0, 4, kElements, blocking_.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Graph> memset, context_->EndCapture(blocking_.get()));
  EXPECT_THAT(context_->UpdateGraphExec(exec.get(), memset.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED")));
}

TEST_F(FakeGraphTest, LaunchesOfOneGraphExecRunOneAfterTheOtherAcrossStreams) {
  ASSERT_OK_AND_ASSIGN(Function * copy, module_->GetFunction("copy_bytes"));
  ASSERT_OK_AND_ASSIGN(Function * spin, module_->GetFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(DevicePtr out, context_->Alloc(kElements * 4));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> other, context_->CreateStream(true));
  // The graph copies data to out.
  ASSERT_OK(context_->BeginCapture(non_blocking_.get()));
  ASSERT_OK(context_->Launch(copy, Threads(kElements * 4),
                             Pack({{0, out}, {8, data_}, {16, kElements * 4}}, 24),
                             non_blocking_.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Graph> graph, context_->EndCapture(non_blocking_.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphExec> exec,
                       context_->InstantiateGraph(std::move(graph)));
  // First launch behind a spin on one stream; the second on another stream waits for it, and
  // the fill queued after the second runs after both copies.
  ASSERT_OK(context_->Launch(spin, Threads(1), Pack({{0, 100'000}}, 8), non_blocking_.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), non_blocking_.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), other.get()));
  ASSERT_OK(Fill(7, other.get()));
  ASSERT_OK(context_->Synchronize());
  std::vector<uint32_t> copied(kElements);
  ASSERT_OK(context_->Download(copied.data(), out, kElements * 4, nullptr));
  EXPECT_THAT(copied, Each(0u));
  EXPECT_THAT(Words(), IsOkAndHolds(Each(7u)));
}

TEST_F(FakeGraphTest, GraphsOfAnotherContextAreRefused) {
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Graph> graph, CaptureFill(blocking_.get(), 1));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> other, backend_->OpenContext(0));
  EXPECT_THAT(other->InstantiateGraph(graph).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not captured by this")));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphExec> exec, context_->InstantiateGraph(graph));
  EXPECT_THAT(other->LaunchGraph(exec.get(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not made by this")));
}

}  // namespace
}  // namespace gpurpc::backend
