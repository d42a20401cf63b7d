// CUDA graphs on a real GPU (ctest label `gpu`): the CUDA backend's capture, graph and
// graph-exec calls directly (their error mapping above all: capture misuse must be
// FAILED_PRECONDITION and never poison the context), then the whole path through gpurpcd
// with the CUDA backend and the C++ client.
//
// Every test skips, printing why, when there is no CUDA driver or device.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CudaAvailable;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint64_t kElements = 1024;

// Besides the fake kernels (tests/testing/fake_kernels.h): one that needs dynamic shared
// memory beyond the default 48 KiB.
constexpr char kSharedKernel[] = R"cuda(
extern "C" __global__ void shared_reverse(unsigned* out, unsigned n) {
  extern __shared__ unsigned s[];
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) s[i] = i;
  __syncthreads();
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
}
)cuda";

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// Packed arguments of the fake kernels.
std::vector<uint8_t> Pack(std::initializer_list<std::pair<size_t, uint64_t>> fields, size_t size) {
  std::vector<uint8_t> packed(size, 0);
  for (const auto& [offset, value] : fields) std::memcpy(packed.data() + offset, &value, 8);
  return packed;
}

// ------------------------------------------------------------------------ the backend

class CudaGraphBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<backend::Backend>> made = backend::MakeCudaBackend();
    if (!made.ok()) GTEST_SKIP() << "no CUDA backend: " << made.status();
    backend_ = *std::move(made);
    ASSERT_OK_AND_ASSIGN(context_, backend_->OpenContext(0));
    const std::string ptx = ::gpurpc::testing::kFakeKernelsPtx;
    ASSERT_OK_AND_ASSIGN(module_,
                         context_->LoadModule(absl::Span<const uint8_t>(
                             reinterpret_cast<const uint8_t*>(ptx.data()), ptx.size() + 1)));
    ASSERT_OK_AND_ASSIGN(add_one_, module_->GetFunction("add_one_f32"));
    ASSERT_OK_AND_ASSIGN(fill_, module_->GetFunction("fill_u32"));
    ASSERT_OK_AND_ASSIGN(data_, context_->Alloc(kElements * 4));
    ASSERT_OK(context_->Memset(data_, 0, 4, kElements, nullptr));
    ASSERT_OK(context_->Synchronize());
  }

  void TearDown() override {
    if (context_ != nullptr && data_ != 0) context_->Free(data_).IgnoreError();
  }

  backend::LaunchConfig Config(uint32_t threads) {
    backend::LaunchConfig config;
    config.grid.x = (threads + 255) / 256;
    config.block.x = 256;
    return config;
  }

  absl::Status AddOne(backend::Stream* stream) {
    const std::vector<uint8_t> args = Pack({{0, data_}, {8, kElements}}, 16);
    return context_->Launch(add_one_, Config(kElements), args, stream);
  }

  absl::StatusOr<std::vector<float>> Floats() {
    std::vector<uint8_t> bytes(kElements * 4);
    absl::Status status = context_->Download(bytes.data(), data_, bytes.size(), nullptr);
    if (!status.ok()) return status;
    return FromBytes<float>(bytes);
  }

  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<backend::Context> context_;
  std::unique_ptr<backend::Module> module_;
  backend::Function* add_one_ = nullptr;
  backend::Function* fill_ = nullptr;
  backend::DevicePtr data_ = 0;
};

TEST_F(CudaGraphBackendTest, CaptureInstantiateLaunchAndNodeKindsInOrder) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::Stream> stream, context_->CreateStream(false));
  ASSERT_OK_AND_ASSIGN(backend::DevicePtr other, context_->Alloc(kElements * 4));
  ASSERT_OK(context_->BeginCapture(stream.get()));
  EXPECT_THAT(context_->QueryCapture(stream.get()), IsOkAndHolds(backend::CaptureStatus::kActive));
  ASSERT_OK(context_->Memset(other, 0, 4, kElements, stream.get()));
  for (int i = 0; i < 100; ++i) ASSERT_OK(AddOne(stream.get()));
  ASSERT_OK(context_->CopyDeviceToDevice(other, data_, kElements * 4, stream.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::Graph> graph, context_->EndCapture(stream.get()));
  EXPECT_THAT(context_->QueryCapture(stream.get()), IsOkAndHolds(backend::CaptureStatus::kNone));
  const std::vector<backend::GraphNodeKind>& kinds = graph->nodes();
  ASSERT_THAT(kinds, SizeIs(102));
  EXPECT_EQ(kinds.front(), backend::GraphNodeKind::kMemset);
  EXPECT_EQ(kinds[1], backend::GraphNodeKind::kKernel);
  EXPECT_EQ(kinds[100], backend::GraphNodeKind::kKernel);
  EXPECT_EQ(kinds.back(), backend::GraphNodeKind::kCopy);
  EXPECT_THAT(Floats(), IsOkAndHolds(Each(0.0f)));  // captured, not run

  std::shared_ptr<backend::Graph> shared = std::move(graph);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::GraphExec> exec,
                       context_->InstantiateGraph(shared));
  ASSERT_OK(context_->LaunchGraph(exec.get(), stream.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), nullptr));  // the legacy stream orders after it
  ASSERT_OK(context_->Synchronize());
  EXPECT_THAT(Floats(), IsOkAndHolds(Each(200.0f)));
  std::vector<uint8_t> copied(kElements * 4);
  ASSERT_OK(context_->Download(copied.data(), other, copied.size(), nullptr));
  EXPECT_THAT(FromBytes<float>(copied), Each(200.0f));
  ASSERT_OK(context_->Free(other));
}

TEST_F(CudaGraphBackendTest, CaptureMisuseIsFailedPreconditionAndNeverPoisonsTheContext) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::Stream> stream, context_->CreateStream(false));
  EXPECT_THAT(context_->BeginCapture(nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->EndCapture(stream.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(context_->BeginCapture(stream.get()));
  EXPECT_THAT(context_->BeginCapture(stream.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(AddOne(stream.get()));
  // Host copies are refused before the driver sees them: the capture goes on.
  std::vector<uint8_t> bytes(16, 1);
  EXPECT_THAT(context_->Upload(data_, bytes.data(), bytes.size(), stream.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("capturing")));
  EXPECT_THAT(context_->Download(bytes.data(), data_, bytes.size(), stream.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("capturing")));
  // Another thread allocates and loads meanwhile (RELAXED capture).
  std::thread other([&] {
    absl::StatusOr<backend::DevicePtr> memory = context_->Alloc(1 << 20);
    EXPECT_OK(memory.status());
    if (memory.ok()) {
      EXPECT_OK(context_->Free(*memory));
    }
  });
  other.join();
  // The driver's own refusals: FAILED_PRECONDITION, and the capture is invalidated.
  EXPECT_THAT(context_->SynchronizeStream(stream.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CAPTURE")));
  EXPECT_THAT(context_->QueryCapture(stream.get()),
              IsOkAndHolds(backend::CaptureStatus::kInvalidated));
  EXPECT_THAT(context_->EndCapture(stream.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")));
  // The legacy stream while a blocking stream captures.
  ASSERT_OK(context_->BeginCapture(stream.get()));
  EXPECT_THAT(AddOne(nullptr), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("CUDA_ERROR_STREAM_CAPTURE_IMPLICIT")));
  EXPECT_THAT(context_->EndCapture(stream.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // The context is fine.
  ASSERT_OK(AddOne(stream.get()));
  ASSERT_OK(context_->Synchronize());
  EXPECT_THAT(Floats(), IsOkAndHolds(Each(1.0f)));
}

TEST_F(CudaGraphBackendTest, UpdateAndKernelNodeParams) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::Stream> stream, context_->CreateStream(true));
  auto capture_fill = [&](uint32_t value) -> absl::StatusOr<std::shared_ptr<backend::Graph>> {
    if (absl::Status s = context_->BeginCapture(stream.get()); !s.ok()) return s;
    const std::vector<uint8_t> args = Pack({{0, data_}, {8, value}, {16, kElements}}, 24);
    if (absl::Status s = context_->Launch(fill_, Config(kElements), args, stream.get()); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<backend::Graph>> graph = context_->EndCapture(stream.get());
    if (!graph.ok()) return graph.status();
    return std::shared_ptr<backend::Graph>(*std::move(graph));
  };
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<backend::Graph> one, capture_fill(1));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<backend::Graph> two, capture_fill(2));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::GraphExec> exec, context_->InstantiateGraph(one));
  ASSERT_OK(context_->UpdateGraphExec(exec.get(), two.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), stream.get()));
  ASSERT_OK(context_->SynchronizeStream(stream.get()));
  std::vector<uint8_t> bytes(kElements * 4);
  ASSERT_OK(context_->Download(bytes.data(), data_, bytes.size(), stream.get()));
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(2u));

  // Another kernel for the node: add_one_f32 on the same memory.
  const std::vector<uint8_t> args = Pack({{0, data_}, {8, kElements}}, 16);
  ASSERT_OK(context_->SetGraphExecKernelNode(exec.get(), 0, add_one_, Config(kElements), args));
  ASSERT_OK(context_->Memset(data_, 0, 4, kElements, stream.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), stream.get()));
  ASSERT_OK(context_->LaunchGraph(exec.get(), stream.get()));
  ASSERT_OK(context_->SynchronizeStream(stream.get()));
  EXPECT_THAT(Floats(), IsOkAndHolds(Each(2.0f)));

  // A graph of another topology: the driver refuses the update, FAILED_PRECONDITION.
  ASSERT_OK(context_->BeginCapture(stream.get()));
  ASSERT_OK(AddOne(stream.get()));
  ASSERT_OK(AddOne(stream.get()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<backend::Graph> pair, context_->EndCapture(stream.get()));
  EXPECT_THAT(context_->UpdateGraphExec(exec.get(), pair.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE")));
  ASSERT_OK(context_->LaunchGraph(exec.get(), stream.get()));
  ASSERT_OK(context_->SynchronizeStream(stream.get()));
  EXPECT_THAT(Floats(), IsOkAndHolds(Each(3.0f)));
}

// ------------------------------------------------------------------------ through gpurpcd

class GraphGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_reason_ = new std::string();
    if (absl::Status cuda = CudaAvailable(); !cuda.ok()) {
      *skip_reason_ = cuda.ToString();
      return;
    }
    TestDaemon::Options options;
    options.backend = "cuda";
    options.extra_flags = {"--kernel-timeout=2s"};
    auto daemon = TestDaemon::Start(options);
    if (!daemon.ok()) {
      *skip_reason_ =
          absl::StrCat("gpurpcd --backend=cuda cannot start: ", daemon.status().ToString());
      return;
    }
    daemon_ = std::move(daemon).value().release();
  }

  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete skip_reason_;
    skip_reason_ = nullptr;
  }

  void SetUp() override {
    if (daemon_ == nullptr) GTEST_SKIP() << *skip_reason_;
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon_->address()));
    client_.emplace(std::move(client));
    ASSERT_OK_AND_ASSIGN(session_, client_->OpenSession());
    ASSERT_FALSE(session_.device().is_fake());
    CompileOptions options;
    options.source = absl::StrCat(::gpurpc::testing::kFakeKernelsSource, kSharedKernel);
    ASSERT_OK_AND_ASSIGN(CompileResult compiled, session_.Compile(options));
    ASSERT_TRUE(compiled.success()) << compiled.log();
    module_ = std::move(compiled.module);
    ASSERT_OK_AND_ASSIGN(add_one_, module_.GetFunction("add_one_f32"));
    ASSERT_OK_AND_ASSIGN(fill_, module_.GetFunction("fill_u32"));
    ASSERT_OK_AND_ASSIGN(spin_, module_.GetFunction("spin_us"));
    ASSERT_OK_AND_ASSIGN(shared_reverse_, module_.GetFunction("shared_reverse"));
  }

  static LaunchConfig Linear(uint32_t threads, const Stream* stream = nullptr) {
    LaunchConfig config;
    config.grid.x = (threads + 255) / 256;
    config.block.x = 256;
    config.stream = stream;
    return config;
  }

  absl::StatusOr<Buffer> Zeros(uint64_t bytes) {
    absl::StatusOr<Buffer> buffer = session_.Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    if (absl::Status s = session_.Memset(buffer->at(0), 0, 1, bytes); !s.ok()) return s;
    return buffer;
  }

  static TestDaemon* daemon_;
  static std::string* skip_reason_;
  std::optional<Client> client_;
  Session session_;
  Module module_;
  Function add_one_, fill_, spin_, shared_reverse_;
};

TestDaemon* GraphGpuTest::daemon_ = nullptr;
std::string* GraphGpuTest::skip_reason_ = nullptr;

TEST_F(GraphGpuTest, HundredKernelGraphReplaysAndReportsItsNodes) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(session_.MemsetAsync(data.at(0), 0, 4, kElements, &stream));
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK(add_one_.LaunchAsync(Linear(kElements, &stream), data, uint64_t{kElements}));
  }
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  EXPECT_EQ(graph.node_count(), 101u);
  ASSERT_OK_AND_ASSIGN(std::vector<v1::GraphNode> nodes, graph.Nodes());
  EXPECT_EQ(nodes.front().type(), v1::GRAPH_NODE_TYPE_MEMSET);
  EXPECT_EQ(nodes.back().type(), v1::GRAPH_NODE_TYPE_KERNEL);
  EXPECT_EQ(nodes.back().kernel_name(), "add_one_f32");
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  for (int i = 0; i < 10; ++i) ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, data.Download());
  EXPECT_THAT(FromBytes<float>(bytes), Each(100.0f));
}

TEST_F(GraphGpuTest, KernelNodeArgsIncludingDynamicSharedMemory) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream(/*non_blocking=*/true));
  constexpr uint32_t kWords = 20000;  // 80 000 bytes of dynamic shared memory
  ASSERT_OK_AND_ASSIGN(Buffer out, Zeros(kWords * 4));
  LaunchConfig small;
  small.block.x = 256;
  small.shared_memory_bytes = 256 * 4;
  small.stream = &stream;
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(shared_reverse_.LaunchAsync(small, out, 256u));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  LaunchConfig large = small;
  large.shared_memory_bytes = kWords * 4;
  ASSERT_OK(exec.SetKernelNodeArgs(0, shared_reverse_, large, out, kWords));
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  const std::vector<uint32_t> words = FromBytes<uint32_t>(bytes);
  for (uint32_t i = 0; i < kWords; ++i) ASSERT_EQ(words[i], kWords - 1 - i) << i;
}

TEST_F(GraphGpuTest, CaptureMisuseLeavesTheSessionUsable) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill_.LaunchAsync(Linear(kElements, &stream), data, 5u, uint64_t{kElements}));
  EXPECT_THAT(stream.Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(session_.Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(session_.Download(data.at(0), 16, &stream).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(session_.Download(data.at(0), 16).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stream 0")));
  // Other threads allocate, free and compile while the capture runs (RELAXED mode).
  std::thread other([&] {
    absl::StatusOr<Buffer> scratch = session_.Allocate(1 << 20);
    EXPECT_OK(scratch.status());
    CompileOptions options;
    options.source = "extern \"C\" __global__ void k() {}";
    EXPECT_OK(session_.Compile(options).status());
  });
  other.join();
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  EXPECT_EQ(graph.node_count(), 1u);
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(stream.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, data.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(5u));
  EXPECT_EQ(session_.state(), v1::SESSION_STATE_ACTIVE);
}

TEST_F(GraphGpuTest, ConcurrentLaunchesOfOneGraphExec) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Buffer data, Zeros(kElements * 4));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(add_one_.LaunchAsync(Linear(kElements, &stream), data, uint64_t{kElements}));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 250; ++i) EXPECT_OK(exec.Launch(&stream));
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, data.Download());
  EXPECT_THAT(FromBytes<float>(bytes), Each(1000.0f));
}

TEST_F(GraphGpuTest, TheWatchdogTimesAGraphAsOneKernel) {
  ASSERT_OK_AND_ASSIGN(Session session, client_->OpenSession());
  CompileOptions options;
  options.source = ::gpurpc::testing::kFakeKernelsSource;
  ASSERT_OK_AND_ASSIGN(CompileResult compiled, session.Compile(options));
  ASSERT_TRUE(compiled.success());
  ASSERT_OK_AND_ASSIGN(Function spin, compiled.module.GetFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Stream stream, session.CreateStream());
  ASSERT_OK(stream.BeginCapture());
  // Each node within the 2 s timeout, the graph not.
  for (int i = 0; i < 5; ++i) {
    LaunchConfig one;
    one.stream = &stream;
    ASSERT_OK(spin.LaunchAsync(one, uint64_t{1'000'000}));
  }
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  ASSERT_OK_AND_ASSIGN(GraphExec exec, graph.Instantiate());
  ASSERT_OK(exec.Launch(&stream));
  ASSERT_OK(session.Flush());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (session.state() != v1::SESSION_STATE_FAULTED && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(session.fault(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        HasSubstr(absl::StrCat("graph exec ", exec.id()))));
  // The fixture's session on the same daemon is fine.
  ASSERT_OK(session_.Synchronize());
}

}  // namespace
}  // namespace gpurpc
