// Compile and launch through the daemon on a real GPU (ctest label `gpu`): gpurpcd with the
// CUDA backend and real worker processes, through the C++ client and, where the client
// hides the protocol, the raw gpurpc.v1 stubs.
//
// Every test skips, printing why, when there is no CUDA driver or the daemon cannot start
// with --backend=cuda.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CudaAvailable;
using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::Ge;
using ::testing::Gt;
using ::testing::HasSubstr;
using ::testing::SizeIs;
using ::testing::StartsWith;

constexpr char kKernels[] = R"cuda(
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

// One partial sum per block in shared memory, then one atomicAdd per block.
extern "C" __global__ void block_sum(const float* x, float* total, unsigned long long n) {
  __shared__ float partial[256];
  float sum = 0.0f;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    sum += x[i];
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(total, partial[0]);
}

__device__ void spin_ns(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// Every thread waits `ns` before it writes: a slow producer.
extern "C" __global__ void slow_fill(unsigned* out, unsigned value, unsigned long long n,
                                     unsigned long long ns) {
  spin_ns(ns);
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    out[i] = value;
  }
}

extern "C" __global__ void spin(unsigned long long ns) { spin_ns(ns); }

extern "C" __global__ void add_one(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}

extern "C" __global__ void write_to(int* p) { *p = 1; }

extern "C" __global__ void sum_float2(float2 v, float* out) { *out = v.x + v.y; }

extern "C" __global__ void __launch_bounds__(128) bounded(float* out) {
  out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shared_reverse(unsigned* out, unsigned n) {
  extern __shared__ unsigned s[];
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) s[i] = i;
  __syncthreads();
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
}

extern "C" __global__ void bump(unsigned* counter) { atomicAdd(counter, 1u); }
)cuda";

// The fake backend's built-in kernels with their signatures: the layout the fake reports
// must be the one the CUDA compiler gives.
constexpr char kFakeKernelSignatures[] = R"cuda(
extern "C" __global__ void axpy_f32(float a, const float* x, float* y, unsigned long long n) {}
extern "C" __global__ void fill_u32(unsigned* out, unsigned value, unsigned long long n) {}
extern "C" __global__ void spin_us(unsigned long long us) {}
)cuda";

template <typename T>
std::vector<uint8_t> ToBytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

CompileOptions Source(std::string source) {
  CompileOptions options;
  options.source = std::move(source);
  return options;
}

LaunchConfig Linear(uint32_t grid, uint32_t block, const Stream* stream = nullptr) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  config.stream = stream;
  return config;
}

std::vector<float> RandomFloats(size_t n, float low, float high, uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> distribution(low, high);
  std::vector<float> values(n);
  for (float& value : values) value = distribution(generator);
  return values;
}

struct Float2 {
  float x, y;
};
struct Float4 {
  float x, y, z, w;
};

class ComputeGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_reason_ = new std::string();
    if (absl::Status cuda = CudaAvailable(); !cuda.ok()) {
      *skip_reason_ = cuda.ToString();
      return;
    }
    TestDaemon::Options options;
    options.backend = "cuda";
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
  }

  absl::StatusOr<Function> Kernel(const std::string& name) {
    return KernelIn(session_, &module_, name);
  }

  // `name` from kKernels, compiled once per `module` slot.
  static absl::StatusOr<Function> KernelIn(const Session& session, std::optional<Module>* module,
                                           const std::string& name) {
    if (!module->has_value()) {
      absl::StatusOr<CompileResult> result = session.Compile(Source(kKernels));
      if (!result.ok()) return result.status();
      if (!result->success()) {
        return absl::InternalError(absl::StrCat("the kernels do not compile: ", result->log()));
      }
      module->emplace(std::move(result->module));
    }
    return (*module)->GetFunction(name);
  }

  absl::StatusOr<Buffer> UploadNew(const std::vector<uint8_t>& bytes) {
    absl::StatusOr<Buffer> buffer = session_.Allocate(bytes.size());
    if (!buffer.ok()) return buffer.status();
    if (absl::Status status = buffer->Upload(bytes); !status.ok()) return status;
    return buffer;
  }

  absl::Status RawLaunch(const v1::LaunchCommand& launch) {
    auto stub = v1::ExecutionService::NewStub(client_->channel());
    v1::LaunchRequest request;
    *request.mutable_launch() = launch;
    v1::LaunchResponse response;
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(session_.id()));
    return FromGrpcStatus(stub->Launch(&context, request, &response));
  }

  static TestDaemon* daemon_;
  static std::string* skip_reason_;
  std::optional<Client> client_;
  Session session_;
  std::optional<Module> module_;
};

TestDaemon* ComputeGpuTest::daemon_ = nullptr;
std::string* ComputeGpuTest::skip_reason_ = nullptr;

TEST_F(ComputeGpuTest, CompilesACubinForTheDevice) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kKernels)));
  ASSERT_TRUE(result.success()) << result.log();
  EXPECT_EQ(result.response.arch(),
            absl::StrCat("sm_", session_.device().compute_capability_major(),
                         session_.device().compute_capability_minor()));
  // An ELF cubin, not PTX for the driver to JIT.
  EXPECT_THAT(result.response.image(), StartsWith("\x7f"
                                                  "ELF"));
}

MATCHER_P2(IsParam, offset_bytes, size_bytes, "") {
  return arg.offset_bytes() == static_cast<uint32_t>(offset_bytes) &&
         arg.size_bytes() == static_cast<uint32_t>(size_bytes);
}

TEST_F(ComputeGpuTest, FakeKernelLayoutsMatchTheCompiler) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kFakeKernelSignatures)));
  ASSERT_TRUE(result.success()) << result.log();
  ASSERT_OK_AND_ASSIGN(Function axpy, result.module.GetFunction("axpy_f32"));
  EXPECT_THAT(axpy.params(),
              ElementsAre(IsParam(0, 4), IsParam(8, 8), IsParam(16, 8), IsParam(24, 8)));
  ASSERT_OK_AND_ASSIGN(Function fill, result.module.GetFunction("fill_u32"));
  EXPECT_THAT(fill.params(), ElementsAre(IsParam(0, 8), IsParam(8, 4), IsParam(16, 8)));
  ASSERT_OK_AND_ASSIGN(Function spin, result.module.GetFunction("spin_us"));
  EXPECT_THAT(spin.params(), ElementsAre(IsParam(0, 8)));
}

TEST_F(ComputeGpuTest, SaxpyMatchesTheCpu) {
  constexpr uint64_t kN = 1 << 20;
  constexpr float kA = 1.75f;
  const std::vector<float> x = RandomFloats(kN, -10.0f, 10.0f, 1);
  const std::vector<float> y = RandomFloats(kN, -10.0f, 10.0f, 2);
  ASSERT_OK_AND_ASSIGN(Function saxpy, Kernel("saxpy"));
  ASSERT_OK_AND_ASSIGN(Buffer x_buffer, UploadNew(ToBytes(x)));
  ASSERT_OK_AND_ASSIGN(Buffer y_buffer, UploadNew(ToBytes(y)));
  ASSERT_OK(saxpy.Launch(Linear(kN / 256, 256), kA, x_buffer, y_buffer, kN));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, y_buffer.Download());
  const std::vector<float> result = FromBytes<float>(bytes);
  ASSERT_EQ(result.size(), kN);
  uint64_t mismatches = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    const float expected = kA * x[i] + y[i];
    // The GPU fuses into an FMA: one rounding fewer.
    if (std::fabs(result[i] - expected) > 1e-5f * (std::fabs(expected) + 1.0f)) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << ": " << result[i] << " != " << expected;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_F(ComputeGpuTest, ReductionMatchesTheCpuSum) {
  constexpr uint64_t kN = (1 << 20) + 12345;  // not a multiple of the block
  const std::vector<float> x = RandomFloats(kN, 0.0f, 1.0f, 3);
  const double expected = std::accumulate(x.begin(), x.end(), 0.0);
  ASSERT_OK_AND_ASSIGN(Function block_sum, Kernel("block_sum"));
  ASSERT_OK_AND_ASSIGN(Buffer x_buffer, UploadNew(ToBytes(x)));
  ASSERT_OK_AND_ASSIGN(Buffer total, UploadNew(ToBytes(std::vector<float>{0.0f})));
  ASSERT_OK(block_sum.Launch(Linear(264, 256), x_buffer, total, kN));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, total.Download());
  const float sum = FromBytes<float>(bytes)[0];
  EXPECT_NEAR(sum, expected, expected * 1e-4);
}

TEST_F(ComputeGpuTest, TemplatedKernelThroughNameExpressions) {
  CompileOptions options = Source(R"cuda(
template <typename T, int N>
__global__ void scale(T* x, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= T(N);
}
)cuda");
  options.name_expressions = {"scale<float, 4>", "scale<double, 2>"};
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(options));
  ASSERT_TRUE(result.success()) << result.log();
  const std::string as_float = result.LoweredName("scale<float, 4>");
  const std::string as_double = result.LoweredName("scale<double, 2>");
  ASSERT_THAT(as_float, StartsWith("_Z"));
  ASSERT_THAT(as_double, StartsWith("_Z"));
  ASSERT_OK_AND_ASSIGN(Function scale_float, result.module.GetFunction(as_float));
  ASSERT_OK_AND_ASSIGN(Function scale_double, result.module.GetFunction(as_double));
  EXPECT_THAT(scale_float.params(), ElementsAre(IsParam(0, 8), IsParam(8, 8)));

  constexpr uint64_t kN = 1000;
  std::vector<float> floats(kN);
  std::vector<double> doubles(kN);
  for (uint64_t i = 0; i < kN; ++i) {
    floats[i] = 0.5f * static_cast<float>(i);
    doubles[i] = 0.25 * static_cast<double>(i);
  }
  ASSERT_OK_AND_ASSIGN(Buffer float_buffer, UploadNew(ToBytes(floats)));
  ASSERT_OK_AND_ASSIGN(Buffer double_buffer, UploadNew(ToBytes(doubles)));
  ASSERT_OK(scale_float.LaunchAsync(Linear(4, 256), float_buffer, kN));
  ASSERT_OK(scale_double.LaunchAsync(Linear(4, 256), double_buffer, kN));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> float_bytes, float_buffer.Download());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> double_bytes, double_buffer.Download());
  const std::vector<float> scaled_floats = FromBytes<float>(float_bytes);
  const std::vector<double> scaled_doubles = FromBytes<double>(double_bytes);
  for (uint64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(scaled_floats[i], floats[i] * 4.0f) << "element " << i;
    ASSERT_EQ(scaled_doubles[i], doubles[i] * 2.0) << "element " << i;
  }
}

TEST_F(ComputeGpuTest, ConstantMemoryThroughGetGlobal) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(R"cuda(
__constant__ float coeffs[4];
extern "C" __global__ void poly(const float* x, float* y, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float v = x[i];
    y[i] = coeffs[0] + v * (coeffs[1] + v * (coeffs[2] + v * coeffs[3]));
  }
}
)cuda")));
  ASSERT_TRUE(result.success()) << result.log();
  ASSERT_OK_AND_ASSIGN(Module::Global coeffs, result.module.GetGlobal("coeffs"));
  EXPECT_EQ(coeffs.size_bytes, 4 * sizeof(float));
  ASSERT_OK_AND_ASSIGN(Function poly, result.module.GetFunction("poly"));

  constexpr uint64_t kN = 4096;
  const std::vector<float> x = RandomFloats(kN, -2.0f, 2.0f, 4);
  ASSERT_OK_AND_ASSIGN(Buffer x_buffer, UploadNew(ToBytes(x)));
  ASSERT_OK_AND_ASSIGN(Buffer y_buffer, session_.Allocate(kN * sizeof(float)));
  // Two sets of coefficients, one after the other: the kernel reads what was uploaded.
  for (const std::vector<float>& c : {std::vector<float>{1.0f, -2.0f, 0.5f, 0.25f},
                                      std::vector<float>{-3.0f, 0.0f, 1.5f, -1.0f}}) {
    ASSERT_OK(session_.Upload(coeffs.ref(), ToBytes(c)));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> read_back,
                         session_.Download(coeffs.ref(), coeffs.size_bytes));
    EXPECT_EQ(FromBytes<float>(read_back), c);
    ASSERT_OK(poly.Launch(Linear(kN / 256, 256), x_buffer, y_buffer, kN));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, y_buffer.Download());
    const std::vector<float> y = FromBytes<float>(bytes);
    for (uint64_t i = 0; i < kN; ++i) {
      const float v = x[i];
      const float expected = c[0] + v * (c[1] + v * (c[2] + v * c[3]));
      ASSERT_NEAR(y[i], expected, 1e-4f * (std::fabs(expected) + 1.0f)) << "element " << i;
    }
  }
}

TEST_F(ComputeGpuTest, EventOrdersTwoStreams) {
  constexpr uint64_t kN = 1 << 16;
  constexpr uint32_t kValue = 0xC0FFEE;
  ASSERT_OK_AND_ASSIGN(Function slow_fill, Kernel("slow_fill"));
  ASSERT_OK_AND_ASSIGN(Stream producer, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Stream consumer, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Event written, session_.CreateEvent(/*disable_timing=*/true));
  ASSERT_OK_AND_ASSIGN(Buffer source, session_.Allocate(kN * 4));
  ASSERT_OK_AND_ASSIGN(Buffer destination, session_.Allocate(kN * 4));
  ASSERT_OK(session_.Memset(source.at(), 0, 4, kN));
  ASSERT_OK(session_.Memset(destination.at(), 0, 4, kN));
  ASSERT_OK(session_.Synchronize());

  // The producer spins ~20 ms before writing; the consumer copies once the event says so.
  ASSERT_OK(
      slow_fill.LaunchAsync(Linear(64, 256, &producer), source, kValue, kN, uint64_t{20'000'000}));
  ASSERT_OK(written.Record(&producer));
  ASSERT_OK(consumer.WaitEvent(written));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(destination.at(), source.at(), kN * 4, &consumer));
  ASSERT_OK(consumer.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, destination.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(kValue));
}

TEST_F(ComputeGpuTest, ElapsedTimeAroundAKernelIsPositive) {
  ASSERT_OK_AND_ASSIGN(Function spin, Kernel("spin"));
  ASSERT_OK_AND_ASSIGN(Event start, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Event end, session_.CreateEvent());
  ASSERT_OK(start.Record());
  ASSERT_OK(spin.LaunchAsync(Linear(1, 1), uint64_t{2'000'000}));
  ASSERT_OK(end.Record());
  ASSERT_OK(end.Synchronize());
  ASSERT_OK_AND_ASSIGN(float elapsed_ms, end.ElapsedSince(start));
  EXPECT_THAT(elapsed_ms, Gt(0.0f));
  EXPECT_THAT(elapsed_ms, Ge(1.0f));  // the kernel spins 2 ms
}

TEST_F(ComputeGpuTest, Float2ByValueIsPassedCorrectly) {
  ASSERT_OK_AND_ASSIGN(Function sum, Kernel("sum_float2"));
  EXPECT_THAT(sum.params(), ElementsAre(IsParam(0, 8), IsParam(8, 8)));
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(sizeof(float)));
  ASSERT_OK(sum.Launch(Linear(1, 1), Float2{1.5f, 2.25f}, out));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  EXPECT_EQ(FromBytes<float>(bytes)[0], 3.75f);
}

TEST_F(ComputeGpuTest, Float4AgainstAFloat2ParameterIsRefusedByTheServer) {
  ASSERT_OK_AND_ASSIGN(Function sum, Kernel("sum_float2"));
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(sizeof(float)));
  const Float4 value{1, 2, 3, 4};
  v1::LaunchCommand launch;
  launch.set_function_id(sum.id());
  launch.mutable_grid()->set_x(1);
  launch.mutable_grid()->set_y(1);
  launch.mutable_grid()->set_z(1);
  *launch.mutable_block() = launch.grid();
  launch.add_args()->set_raw(std::string(reinterpret_cast<const char*>(&value), sizeof(value)));
  launch.add_args()->mutable_buffer()->set_buffer_id(out.id());
  EXPECT_THAT(RawLaunch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                          AllOf(HasSubstr("#0"), HasSubstr("expected 8 bytes"),
                                                HasSubstr("given 16 bytes"))));
}

TEST_F(ComputeGpuTest, Float4AgainstAFloat2ParameterIsRefusedByTheClient) {
  ASSERT_OK_AND_ASSIGN(Function sum, Kernel("sum_float2"));
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(sizeof(float)));
  EXPECT_THAT(
      sum.Launch(Linear(1, 1), Float4{1, 2, 3, 4}, out),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("#0"), HasSubstr("expected 8 bytes"), HasSubstr("given 16 bytes"))));
}

TEST_F(ComputeGpuTest, WrongArgumentCountIsRefused) {
  ASSERT_OK_AND_ASSIGN(Function saxpy, Kernel("saxpy"));
  ASSERT_OK_AND_ASSIGN(Buffer x, session_.Allocate(1024));
  v1::LaunchCommand launch;
  launch.set_function_id(saxpy.id());
  launch.mutable_grid()->set_x(1);
  launch.mutable_grid()->set_y(1);
  launch.mutable_grid()->set_z(1);
  *launch.mutable_block() = launch.grid();
  launch.add_args()->set_f32(1.0f);
  launch.add_args()->mutable_buffer()->set_buffer_id(x.id());
  EXPECT_THAT(RawLaunch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("4 parameters"), HasSubstr("2 arguments"))));
}

TEST_F(ComputeGpuTest, DoubleForAFloatIsRefused) {
  ASSERT_OK_AND_ASSIGN(Function saxpy, Kernel("saxpy"));
  ASSERT_OK_AND_ASSIGN(Buffer x, session_.Allocate(1024));
  v1::LaunchCommand launch;
  launch.set_function_id(saxpy.id());
  launch.mutable_grid()->set_x(1);
  launch.mutable_grid()->set_y(1);
  launch.mutable_grid()->set_z(1);
  *launch.mutable_block() = launch.grid();
  launch.add_args()->set_f64(1.0);
  launch.add_args()->mutable_buffer()->set_buffer_id(x.id());
  launch.add_args()->mutable_buffer()->set_buffer_id(x.id());
  launch.add_args()->set_u64(256);
  EXPECT_THAT(RawLaunch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                          AllOf(HasSubstr("#0"), HasSubstr("expected 4 bytes"),
                                                HasSubstr("given 8 bytes"))));
}

TEST_F(ComputeGpuTest, PackedBlobOfTheWrongLengthIsRefused) {
  ASSERT_OK_AND_ASSIGN(Function saxpy, Kernel("saxpy"));
  v1::LaunchCommand launch;
  launch.set_function_id(saxpy.id());
  launch.mutable_grid()->set_x(1);
  launch.mutable_grid()->set_y(1);
  launch.mutable_grid()->set_z(1);
  *launch.mutable_block() = launch.grid();
  launch.set_packed_args(std::string(28, '\0'));
  EXPECT_THAT(RawLaunch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                          AllOf(HasSubstr("32 bytes"), HasSubstr("28 bytes"))));
}

struct DimCase {
  const char* name;
  Dim3 grid;
  Dim3 block;
  uint32_t shared_memory_bytes;
  const char* names;
};

class GpuLaunchDimsTest : public ComputeGpuTest, public ::testing::WithParamInterface<DimCase> {};

TEST_P(GpuLaunchDimsTest, IsInvalidArgumentNamingTheDimension) {
  const DimCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(Function add_one, Kernel("add_one"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(4096));
  LaunchConfig config;
  config.grid = c.grid;
  config.block = c.block;
  config.shared_memory_bytes = c.shared_memory_bytes;
  EXPECT_THAT(add_one.Launch(config, data, uint64_t{0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.names)));
  // A refused launch is not a fault.
  EXPECT_OK(session_.Synchronize());
}

INSTANTIATE_TEST_SUITE_P(
    Dims, GpuLaunchDimsTest,
    ::testing::Values(DimCase{"BlockXZero", {1, 1, 1}, {0, 1, 1}, 0, "block.x is 0"},
                      DimCase{"BlockX1025", {1, 1, 1}, {1025, 1, 1}, 0, "block.x = 1025"},
                      DimCase{"Block1056Threads", {1, 1, 1}, {32, 33, 1}, 0, "1056 threads"},
                      DimCase{"BlockZ65", {1, 1, 1}, {1, 1, 65}, 0, "block.z = 65"},
                      DimCase{"GridY65536", {1, 65536, 1}, {32, 1, 1}, 0, "grid.y = 65536"},
                      DimCase{"SharedMemory", {1, 1, 1}, {32, 1, 1}, 1u << 20, "shared memory"}),
    [](const ::testing::TestParamInfo<DimCase>& info) { return info.param.name; });

TEST_F(ComputeGpuTest, LaunchBoundsLimitTheBlock) {
  ASSERT_OK_AND_ASSIGN(Function bounded, Kernel("bounded"));
  EXPECT_LE(bounded.attributes().max_threads_per_block(), 128);
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(256 * sizeof(float)));
  EXPECT_THAT(bounded.Launch(Linear(1, 256), out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("256 threads")));
  EXPECT_OK(bounded.Launch(Linear(1, 128), out));
  EXPECT_OK(session_.Synchronize());
}

TEST_F(ComputeGpuTest, DynamicSharedMemoryAbove48KiBWorks) {
  constexpr uint32_t kN = 16384;  // 64 KiB of shared memory: needs the opt-in
  ASSERT_OK_AND_ASSIGN(Function reverse, Kernel("shared_reverse"));
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(kN * sizeof(uint32_t)));
  LaunchConfig config = Linear(1, 256);
  config.shared_memory_bytes = kN * sizeof(uint32_t);
  ASSERT_OK(reverse.Launch(config, out, kN));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  const std::vector<uint32_t> values = FromBytes<uint32_t>(bytes);
  for (uint32_t i = 0; i < kN; ++i) ASSERT_EQ(values[i], kN - 1 - i) << "element " << i;
}

TEST_F(ComputeGpuTest, IllegalAddressFaultsOnlyItsSession) {
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  std::optional<Module> other_module;
  ASSERT_OK_AND_ASSIGN(Function write_to, Kernel("write_to"));
  ASSERT_OK_AND_ASSIGN(Function add_one, KernelIn(other, &other_module, "add_one"));
  constexpr uint64_t kN = 4096;
  ASSERT_OK_AND_ASSIGN(Buffer data, other.Allocate(kN * sizeof(float)));
  ASSERT_OK(data.Upload(ToBytes(std::vector<float>(kN, 0.0f))));

  constexpr int kIterations = 300;
  std::atomic<int> done{0};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::thread victim([&] {
    for (int i = 1; i <= kIterations; ++i) {
      absl::Status status = add_one.Launch(Linear(kN / 256, 256), data, kN);
      absl::StatusOr<std::vector<uint8_t>> bytes =
          status.ok() ? data.Download() : absl::StatusOr<std::vector<uint8_t>>(status);
      if (!bytes.ok() ||
          FromBytes<float>(*bytes) != std::vector<float>(kN, static_cast<float>(i))) {
        if (failures.fetch_add(1) == 0) {
          first_failure = absl::StrCat("iteration ", i, ": ",
                                       bytes.ok() ? "wrong values" : bytes.status().ToString());
        }
      }
      done.store(i);
    }
  });
  absl::Status fault_launch, fault_sync, after_fault;
  bool victim_under_way = false;
  std::thread culprit([&] {
    victim_under_way = Eventually([&] { return done.load() >= 20; }, ::gpurpc::testing::kEventually,
                                  absl::Milliseconds(1));
    fault_launch = write_to.Launch(Linear(1, 1), uint64_t{0});  // a null pointer
    fault_sync = session_.Synchronize();
    after_fault = session_.Allocate(64).status();
  });
  culprit.join();
  victim.join();

  EXPECT_TRUE(victim_under_way) << "the other session did not get through 20 iterations";
  EXPECT_OK(fault_launch);
  EXPECT_THAT(fault_sync,
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(after_fault, StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_EQ(done.load(), kIterations);
  EXPECT_EQ(failures.load(), 0) << first_failure;
}

TEST_F(ComputeGpuTest, LaunchAndSynchronizeAnswersOnceTheKernelIsDone) {
  constexpr uint64_t kN = 1 << 16;
  constexpr unsigned kValue = 0x5eed;
  ASSERT_OK_AND_ASSIGN(Function slow_fill, Kernel("slow_fill"));
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(kN * sizeof(unsigned)));
  // 50 ms per thread before it writes: answered on enqueue, the stream would still be busy
  // and the buffer unwritten.
  ASSERT_OK(slow_fill.LaunchAndSynchronize(Linear(kN / 256, 256, &stream), out, kValue, kN,
                                           uint64_t{50'000'000}));
  EXPECT_THAT(stream.Query(), IsOkAndHolds(true));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(kValue));
}

TEST_F(ComputeGpuTest, LaunchAndSynchronizeAnswersTheFaultOfItsKernel) {
  ASSERT_OK_AND_ASSIGN(Session session, client_->OpenSession());
  std::optional<Module> module;
  ASSERT_OK_AND_ASSIGN(Function write_to, KernelIn(session, &module, "write_to"));
  EXPECT_THAT(write_to.LaunchAndSynchronize(Linear(1, 1), uint64_t{0}),  // a null pointer
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session.Allocate(64), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
}

TEST_F(ComputeGpuTest, CurandKernelCompilesAndRuns) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(R"cuda(
#include <curand_kernel.h>
extern "C" __global__ void uniform(float* out, unsigned long long seed, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    curandState state;
    curand_init(seed, i, 0, &state);
    out[i] = curand_uniform(&state);
  }
}
)cuda")));
  ASSERT_TRUE(result.success()) << result.log();
  ASSERT_OK_AND_ASSIGN(Function uniform, result.module.GetFunction("uniform"));
  constexpr uint64_t kN = 1 << 16;
  ASSERT_OK_AND_ASSIGN(Buffer out, session_.Allocate(kN * sizeof(float)));
  ASSERT_OK(uniform.Launch(Linear(kN / 256, 256), out, uint64_t{1234}, kN));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, out.Download());
  const std::vector<float> values = FromBytes<float>(bytes);
  double sum = 0;
  for (float value : values) {
    ASSERT_GT(value, 0.0f);
    ASSERT_LE(value, 1.0f);
    sum += value;
  }
  EXPECT_NEAR(sum / kN, 0.5, 0.01);
  EXPECT_NE(values.front(), values.back());
}

TEST_F(ComputeGpuTest, HundredThousandAsyncLaunchesThenSync) {
  constexpr int kLaunches = 100000;
  ASSERT_OK_AND_ASSIGN(Function bump, Kernel("bump"));
  ASSERT_OK_AND_ASSIGN(Buffer counter, UploadNew(ToBytes(std::vector<uint32_t>{0})));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kLaunches; ++i) ASSERT_OK(bump.LaunchAsync(Linear(1, 1), counter));
  ASSERT_OK(session_.Synchronize());
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  std::cout << "[ info ] " << kLaunches << " async launches + sync in " << elapsed.count() << " s ("
            << kLaunches / elapsed.count() << " launches/s)\n";
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, counter.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), ElementsAre(static_cast<uint32_t>(kLaunches)));
}

// The device-memory quota on a real GPU: buffers, a module's __device__ globals and the
// local memory the driver reserves for a kernel all count, and what does not fit is refused
// before the GPU holds it (a 1.5 GiB global, a kernel whose local memory would take ~17 GiB).
TEST(GpuQuotaTest, GlobalsAndLocalMemoryCountAgainstTheQuota) {
  if (absl::Status cuda = CudaAvailable(); !cuda.ok()) GTEST_SKIP() << cuda;
  TestDaemon::Options options;
  options.backend = "cuda";
  options.extra_flags = {"--tenant-max-device-memory-bytes=1073741824"};  // 1 GiB
  auto daemon = TestDaemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect((*daemon)->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(MemInfo before, session.GetMemInfo());

  // 1.5 GiB of __device__ globals (NVRTC refuses single arrays of 4 GiB and more).
  CompileOptions big_global;
  big_global.source =
      "__device__ char huge[3ull << 29];\n"
      "extern \"C\" __global__ void touch(unsigned long long i) { huge[i] = 1; }\n";
  auto global = session.Compile(big_global);
  if (global.ok()) {
    ASSERT_TRUE(global->success()) << "NVRTC refused the source: " << global->log();
  }
  EXPECT_THAT(global.status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));

  CompileOptions big_local;
  big_local.source =
      "extern \"C\" __global__ void spill(int* out, int n) {\n"
      "  volatile int scratch[16384];\n"  // 64 KiB of local memory per thread
      "  for (int i = 0; i < 16384; ++i) scratch[i] = i * n;\n"
      "  out[threadIdx.x] = scratch[(threadIdx.x * 7919) % 16384];\n"
      "}\n";
  ASSERT_OK_AND_ASSIGN(CompileResult compiled, session.Compile(big_local));
  ASSERT_TRUE(compiled.success()) << compiled.log();
  EXPECT_THAT(compiled.module.GetFunction("spill").status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("local memory")));

  // Neither stayed on the GPU: the device's free memory did not drop by a gigabyte.
  ASSERT_OK_AND_ASSIGN(MemInfo after, session.GetMemInfo());
  EXPECT_LT(before.free_bytes - std::min(before.free_bytes, after.free_bytes), 1ull << 30);
  // And the session still works within its quota.
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(1ull << 29));
  EXPECT_THAT(session.Allocate(3ull << 28).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
}

}  // namespace
}  // namespace gpurpc
