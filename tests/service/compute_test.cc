// Compile, launch, command-stream, fault, stream/event and module-global behaviour of the
// daemon (ctest label `service`): the real gpurpcd with real worker processes on the fake
// backend, through the C++ client and, where the client hides the protocol, the raw
// gpurpc.v1 stubs.
//
// NVRTC compiles for real in the fake worker (compute_75 PTX); the fake then runs its
// built-in host "kernels" by name, so the sources below define real CUDA kernels with
// exactly the names and signatures of those built-ins (extern "C", so that the names are
// the plain ones on a GPU too).

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::Ge;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;
using ::testing::StartsWith;

// The fake backend's built-in kernels as real CUDA (tests/testing/fake_kernels.h).
constexpr const char* kFakeKernels = ::gpurpc::testing::kFakeKernelsSource;

// Module globals in device and constant memory, kept alive by a kernel that uses them.
constexpr char kGlobals[] = R"cuda(
__device__ float g[4];
__constant__ float c[4];
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += g[i % 4] + c[i % 4];
}
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

CompileOptions Source(std::string source, std::string program_name = "kernel.cu") {
  CompileOptions options;
  options.source = std::move(source);
  options.program_name = std::move(program_name);
  return options;
}

CompileOptions WithOptions(std::string source, std::vector<std::string> nvrtc_options) {
  CompileOptions options = Source(std::move(source));
  options.options = std::move(nvrtc_options);
  return options;
}

CompileOptions WithNames(std::string source, std::vector<std::string> name_expressions) {
  CompileOptions options = Source(std::move(source));
  options.name_expressions = std::move(name_expressions);
  return options;
}

// `grid` blocks of `block` threads, along x.
LaunchConfig Linear(uint32_t grid, uint32_t block, const Stream* stream = nullptr) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  config.stream = stream;
  return config;
}

TestDaemon::Options DaemonWithCache(const std::string& cache_dir) {
  TestDaemon::Options options;
  options.cache_dir = cache_dir;
  return options;
}

TestDaemon::Options NoWarmWorkers() {
  TestDaemon::Options options;
  options.warm_workers = 0;
  return options;
}

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A packed argument blob laid out by a function's parameter offsets.
class Blob {
 public:
  explicit Blob(size_t size_bytes) : bytes_(size_bytes, '\0') {}
  template <typename T>
  Blob& Put(uint32_t offset_bytes, T value) {
    std::memcpy(bytes_.data() + offset_bytes, &value, sizeof(T));
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

void SetDim(uint32_t x, uint32_t y, uint32_t z, v1::Dim3* dim) {
  dim->set_x(x);
  dim->set_y(y);
  dim->set_z(z);
}

// The raw gpurpc.v1 API for one session: what the C++ client does not expose (typed
// arguments, destroying by id, the command stream's replies).
class RawSession {
 public:
  RawSession(const Client& client, const Session& session)
      : session_id_(std::to_string(session.id())),
        execution_(v1::ExecutionService::NewStub(client.channel())),
        modules_(v1::ModuleService::NewStub(client.channel())) {}

  void Prepare(grpc::ClientContext* context) const {
    context->AddMetadata(kSessionMetadataKey, session_id_);
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  v1::ExecutionService::Stub& execution() { return *execution_; }

  absl::Status Launch(const v1::LaunchCommand& launch) {
    v1::LaunchRequest request;
    *request.mutable_launch() = launch;
    v1::LaunchResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->Launch(&context, request, &response));
  }

  absl::StatusOr<uint64_t> CreateStream() {
    v1::CreateStreamResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->CreateStream(&context, v1::CreateStreamRequest(), &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.stream_id();
  }

  absl::Status DestroyStream(uint64_t stream_id) {
    v1::DestroyStreamRequest request;
    request.set_stream_id(stream_id);
    v1::DestroyStreamResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->DestroyStream(&context, request, &response));
  }

  absl::StatusOr<uint64_t> CreateEvent() {
    v1::CreateEventResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->CreateEvent(&context, v1::CreateEventRequest(), &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.event_id();
  }

  absl::Status DestroyEvent(uint64_t event_id) {
    v1::DestroyEventRequest request;
    request.set_event_id(event_id);
    v1::DestroyEventResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->DestroyEvent(&context, request, &response));
  }

  absl::StatusOr<float> ElapsedTime(uint64_t start_event_id, uint64_t end_event_id) {
    v1::EventElapsedTimeRequest request;
    request.set_start_event_id(start_event_id);
    request.set_end_event_id(end_event_id);
    v1::EventElapsedTimeResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->EventElapsedTime(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.elapsed_ms();
  }

  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id, const std::string& name) {
    v1::GetFunctionRequest request;
    request.set_module_id(module_id);
    request.set_name(name);
    v1::GetFunctionResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = modules_->GetFunction(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }

 private:
  const std::string session_id_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
};

// A temporary folder shared by daemons started one after the other.
class TempDir {
 public:
  TempDir() {
    char path[] = "/tmp/gpurpc-compute-test-XXXXXX";
    if (mkdtemp(path) != nullptr) path_ = path;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The cache file that holds `cache_key`, searched for under `dir`.
std::optional<std::filesystem::path> FindCacheFile(const std::string& dir,
                                                   const std::string& cache_key) {
  std::error_code error;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (it->is_regular_file() &&
        it->path().filename().string().find(cache_key) != std::string::npos) {
      return it->path();
    }
  }
  return std::nullopt;
}

class ComputeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto daemon = TestDaemon::Start();
    if (daemon.ok()) {
      daemon_ = std::move(daemon).value().release();
    } else {
      start_error_ = new std::string(daemon.status().ToString());
    }
  }

  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(daemon_, nullptr) << *start_error_;
    auto client = Client::Connect(daemon_->address());
    ASSERT_OK(client.status());
    client_.emplace(*std::move(client));
    ASSERT_OK_AND_ASSIGN(session_, client_->OpenSession());
  }

  absl::StatusOr<Function> FakeFunction(const std::string& name) {
    if (!fake_module_.has_value()) {
      absl::StatusOr<Module> module = CompileFakeKernels(session_);
      if (!module.ok()) return module.status();
      fake_module_.emplace(*std::move(module));
    }
    return fake_module_->GetFunction(name);
  }

  static std::vector<float> Iota(size_t n, float start, float step) {
    std::vector<float> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = start + step * static_cast<float>(i);
    return values;
  }

  absl::StatusOr<std::vector<float>> DownloadFloats(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<float>(*bytes);
  }

  absl::StatusOr<std::vector<uint32_t>> DownloadU32(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<uint32_t>(*bytes);
  }

  // A launch of axpy_f32 with valid arguments for the raw API, to be spoiled by a test.
  v1::LaunchCommand ValidAxpyLaunch(const Function& axpy, const Buffer& x, const Buffer& y,
                                    uint64_t n) {
    v1::LaunchCommand launch;
    launch.set_function_id(axpy.id());
    SetDim(1, 1, 1, launch.mutable_grid());
    SetDim(static_cast<uint32_t>(n), 1, 1, launch.mutable_block());
    launch.add_args()->set_f32(2.0f);
    launch.add_args()->mutable_buffer()->set_buffer_id(x.id());
    launch.add_args()->mutable_buffer()->set_buffer_id(y.id());
    launch.add_args()->set_u64(n);
    return launch;
  }

  static TestDaemon* daemon_;
  static std::string* start_error_;
  std::optional<Client> client_;
  Session session_;
  std::optional<Module> fake_module_;
};

TestDaemon* ComputeTest::daemon_ = nullptr;
std::string* ComputeTest::start_error_ = nullptr;

// ------------------------------------------------------------------------------ NVRTC

TEST_F(ComputeTest, CompileSucceedsAndLoadsTheModule) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kFakeKernels)));
  ASSERT_TRUE(result.success()) << result.log();
  EXPECT_THAT(result.response.image(), Not(IsEmpty()));
  EXPECT_NE(result.response.module_id(), 0u);
  EXPECT_EQ(result.module.id(), result.response.module_id());
  EXPECT_EQ(result.response.arch(), "compute_75");
  EXPECT_THAT(result.response.effective_options(), Contains("--gpu-architecture=compute_75"));
  EXPECT_THAT(result.response.cache_key(), SizeIs(64));
  // A PTX image for the fake's virtual architecture, naming the kernels.
  EXPECT_THAT(result.response.image(), HasSubstr("axpy_f32"));
  ASSERT_OK_AND_ASSIGN(Function axpy, result.module.GetFunction("axpy_f32"));
  EXPECT_NE(axpy.id(), 0u);
}

TEST_F(ComputeTest, CompileKeepsWarningsInTheLogOfASuccess) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(R"cuda(
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  int never_used;
  if (threadIdx.x < n) data[threadIdx.x] += 1.0f;
}
)cuda",
                                                                     "warns.cu")));
  ASSERT_TRUE(result.success()) << result.log();
  EXPECT_THAT(result.log(), AllOf(HasSubstr("warning"), HasSubstr("never_used")));
  EXPECT_NE(result.module.id(), 0u);
}

TEST_F(ComputeTest, SyntaxErrorIsAnOkResponseWithTheLog) {
  ASSERT_OK_AND_ASSIGN(
      CompileResult result,
      session_.Compile(Source("extern \"C\" __global__ void k( { }\n", "broken.cu")));
  EXPECT_FALSE(result.success());
  EXPECT_THAT(result.log(), AllOf(HasSubstr("broken.cu"), HasSubstr("error")));
  EXPECT_EQ(result.response.module_id(), 0u);
  EXPECT_THAT(result.response.image(), IsEmpty());
  EXPECT_EQ(result.module.id(), 0u);
}

TEST_F(ComputeTest, UnknownOptionIsInvalidArgumentNamingIt) {
  EXPECT_THAT(session_.Compile(WithOptions(kFakeKernels, {"--no-such-option"})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--no-such-option")));
}

TEST_F(ComputeTest, IncludeOptionsAreRefusedNamingTheOption) {
  const std::vector<std::vector<std::string>> forbidden = {
      {"-I/etc"}, {"--include-path=/usr"}, {"-include x.h"}, {"-include", "x.h"}};
  for (const std::vector<std::string>& options : forbidden) {
    SCOPED_TRACE(options.front());
    EXPECT_THAT(session_.Compile(WithOptions(kFakeKernels, options)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(options.front()), HasSubstr("not allowed"))));
  }
}

TEST_F(ComputeTest, HeadersSentWithTheRequestAreFound) {
  CompileOptions options = Source(R"cuda(
#include "mylib/size.h"
#include <mylib/scale.h>
__device__ float from_header[kFromHeader];
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  if (threadIdx.x < n) data[threadIdx.x] = scale(from_header[threadIdx.x % kFromHeader]);
}
)cuda");
  options.headers = {
      {"mylib/size.h", "constexpr int kFromHeader = 7;\n"},
      {"mylib/scale.h", "__device__ inline float scale(float x) { return 3 * x; }\n"}};
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(options));
  ASSERT_TRUE(result.success()) << result.log();
  // The array's size came from the header.
  ASSERT_OK_AND_ASSIGN(Module::Global global, result.module.GetGlobal("from_header"));
  EXPECT_EQ(global.size_bytes, 7 * sizeof(float));
}

TEST_F(ComputeTest, AMissingHeaderFailsTheCompileWithTheLog) {
  ASSERT_OK_AND_ASSIGN(CompileResult result,
                       session_.Compile(Source("#include \"mylib/absent.h\"\n")));
  EXPECT_FALSE(result.success());
  EXPECT_THAT(result.log(), HasSubstr("mylib/absent.h"));
}

constexpr char kTemplated[] = R"cuda(
template <typename T>
__global__ void scale(T* x, T factor, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= factor;
}
)cuda";

TEST_F(ComputeTest, NameExpressionsGiveLoweredNames) {
  ASSERT_OK_AND_ASSIGN(CompileResult result,
                       session_.Compile(WithNames(kTemplated, {"scale<float>", "scale<double>"})));
  ASSERT_TRUE(result.success()) << result.log();
  ASSERT_THAT(result.response.lowered_names(), SizeIs(2));
  EXPECT_EQ(result.response.lowered_names(0).name_expression(), "scale<float>");
  EXPECT_EQ(result.response.lowered_names(1).name_expression(), "scale<double>");
  const std::string as_float = result.LoweredName("scale<float>");
  const std::string as_double = result.LoweredName("scale<double>");
  EXPECT_THAT(as_float, StartsWith("_Z"));
  EXPECT_THAT(as_double, StartsWith("_Z"));
  EXPECT_NE(as_float, as_double);
  // The instantiations are in the image under those names.
  EXPECT_THAT(result.response.image(), AllOf(HasSubstr(as_float), HasSubstr(as_double)));
}

TEST_F(ComputeTest, LoweredNameIsNotFoundOnTheFakeWhichNamesItsBuiltins) {
  ASSERT_OK_AND_ASSIGN(CompileResult result,
                       session_.Compile(WithNames(kTemplated, {"scale<float>"})));
  ASSERT_TRUE(result.success()) << result.log();
  const std::string lowered = result.LoweredName("scale<float>");
  ASSERT_THAT(lowered, StartsWith("_Z"));
  EXPECT_THAT(result.module.GetFunction(lowered),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(lowered), HasSubstr("built-in"), HasSubstr("axpy_f32"),
                             HasSubstr("fill_u32"), HasSubstr("fault_illegal_address"))));
}

// A source no other test compiles, so that the first compile in this daemon is a miss.
std::string UniqueSource(absl::string_view tag) {
  return absl::StrCat(kFakeKernels, "\n// ", tag, " ", absl::ToUnixNanos(absl::Now()), "\n");
}

TEST_F(ComputeTest, SecondIdenticalCompileIsACacheHit) {
  const CompileOptions options = Source(UniqueSource("same session"));
  ASSERT_OK_AND_ASSIGN(CompileResult first, session_.Compile(options));
  ASSERT_TRUE(first.success()) << first.log();
  EXPECT_FALSE(first.response.cache_hit());
  ASSERT_OK_AND_ASSIGN(CompileResult second, session_.Compile(options));
  ASSERT_TRUE(second.success()) << second.log();
  EXPECT_TRUE(second.response.cache_hit());
  EXPECT_EQ(second.response.cache_key(), first.response.cache_key());
  EXPECT_EQ(second.response.image(), first.response.image());
  // A hit is loaded like a fresh compile.
  EXPECT_NE(second.response.module_id(), 0u);
  EXPECT_NE(second.response.module_id(), first.response.module_id());
  EXPECT_OK(second.module.GetFunction("axpy_f32").status());
}

TEST_F(ComputeTest, CacheIsSharedBetweenSessions) {
  const CompileOptions options = Source(UniqueSource("two sessions"));
  ASSERT_OK_AND_ASSIGN(CompileResult first, session_.Compile(options));
  ASSERT_TRUE(first.success()) << first.log();
  EXPECT_FALSE(first.response.cache_hit());

  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  ASSERT_OK_AND_ASSIGN(CompileResult second, other.Compile(options));
  ASSERT_TRUE(second.success()) << second.log();
  EXPECT_TRUE(second.response.cache_hit());
  EXPECT_EQ(second.response.cache_key(), first.response.cache_key());
}

TEST_F(ComputeTest, CacheKeyChangesWithTheOptions) {
  const std::string source = UniqueSource("options");
  ASSERT_OK_AND_ASSIGN(CompileResult plain, session_.Compile(Source(source)));
  ASSERT_OK_AND_ASSIGN(CompileResult defined,
                       session_.Compile(WithOptions(source, {"-DSOMETHING=1"})));
  ASSERT_TRUE(plain.success()) << plain.log();
  ASSERT_TRUE(defined.success()) << defined.log();
  EXPECT_FALSE(defined.response.cache_hit());
  EXPECT_NE(defined.response.cache_key(), plain.response.cache_key());
}

// Compiles `source` in a fresh session of a daemon that uses `cache_dir`.
absl::StatusOr<v1::CompileResponse> CompileInFreshDaemon(const std::string& cache_dir,
                                                         const std::string& source,
                                                         int compiles = 1) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> daemon =
      TestDaemon::Start(DaemonWithCache(cache_dir));
  if (!daemon.ok()) return daemon.status();
  absl::StatusOr<Client> client = Client::Connect((*daemon)->address());
  if (!client.ok()) return client.status();
  absl::StatusOr<Session> session = client->OpenSession();
  if (!session.ok()) return session.status();
  v1::CompileResponse last;
  for (int i = 0; i < compiles; ++i) {
    absl::StatusOr<CompileResult> result = session->Compile(Source(source));
    if (!result.ok()) return result.status();
    last = result->response;
  }
  return last;
}

TEST(ComputeCacheTest, CacheHitSurvivesADaemonRestart) {
  TempDir cache;
  ASSERT_FALSE(cache.path().empty());
  const std::string source = UniqueSource("restart");
  ASSERT_OK_AND_ASSIGN(v1::CompileResponse first, CompileInFreshDaemon(cache.path(), source));
  ASSERT_TRUE(first.success()) << first.log();
  EXPECT_FALSE(first.cache_hit());

  ASSERT_OK_AND_ASSIGN(v1::CompileResponse after_restart,
                       CompileInFreshDaemon(cache.path(), source));
  ASSERT_TRUE(after_restart.success()) << after_restart.log();
  EXPECT_TRUE(after_restart.cache_hit());
  EXPECT_EQ(after_restart.cache_key(), first.cache_key());
  EXPECT_EQ(after_restart.image(), first.image());
}

TEST(ComputeCacheTest, CorruptedCacheFileIsDetectedAndReplaced) {
  TempDir cache;
  ASSERT_FALSE(cache.path().empty());
  const std::string source = UniqueSource("corrupt");
  ASSERT_OK_AND_ASSIGN(v1::CompileResponse first, CompileInFreshDaemon(cache.path(), source));
  ASSERT_TRUE(first.success()) << first.log();

  const std::optional<std::filesystem::path> file = FindCacheFile(cache.path(), first.cache_key());
  ASSERT_TRUE(file.has_value()) << "no cache file for key " << first.cache_key() << " under "
                                << cache.path();
  {
    std::fstream stream(*file, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(stream.good());
    const std::string content((std::istreambuf_iterator<char>(stream)),
                              std::istreambuf_iterator<char>());
    ASSERT_GT(content.size(), 64u);
    std::string flipped = content.substr(content.size() / 2, 16);
    for (char& c : flipped) c = static_cast<char>(~c);
    stream.clear();
    stream.seekp(static_cast<std::streamoff>(content.size() / 2));
    stream.write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
    ASSERT_TRUE(stream.good());
  }

  // After a restart (an empty memory cache), the bad file is a miss and a fresh compile...
  ASSERT_OK_AND_ASSIGN(v1::CompileResponse after_corruption,
                       CompileInFreshDaemon(cache.path(), source));
  ASSERT_TRUE(after_corruption.success()) << after_corruption.log();
  EXPECT_FALSE(after_corruption.cache_hit());
  EXPECT_EQ(after_corruption.image(), first.image());
  // ...whose result is stored again: the next daemon hits.
  ASSERT_OK_AND_ASSIGN(v1::CompileResponse repaired, CompileInFreshDaemon(cache.path(), source));
  ASSERT_TRUE(repaired.success()) << repaired.log();
  EXPECT_TRUE(repaired.cache_hit());
}

// ------------------------------------------------------------------------------ launches

MATCHER_P2(IsParam, offset_bytes, size_bytes, "") {
  return arg.offset_bytes() == static_cast<uint32_t>(offset_bytes) &&
         arg.size_bytes() == static_cast<uint32_t>(size_bytes);
}

TEST_F(ComputeTest, AxpyParamLayout) {
  ASSERT_OK_AND_ASSIGN(Function axpy, FakeFunction("axpy_f32"));
  EXPECT_THAT(axpy.params(),
              ElementsAre(IsParam(0, 4), IsParam(8, 8), IsParam(16, 8), IsParam(24, 8)));
  EXPECT_EQ(axpy.attributes().max_threads_per_block(), 1024);
}

class AxpyTest : public ComputeTest {
 protected:
  static constexpr uint64_t kN = 1000;
  static constexpr float kA = 2.5f;

  void SetUp() override {
    ComputeTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_OK_AND_ASSIGN(axpy_, FakeFunction("axpy_f32"));
    x_values_ = Iota(kN, 0.0f, 0.5f);
    y_values_ = Iota(kN, 1.0f, 1.0f);
    ASSERT_OK_AND_ASSIGN(x_, session_.Allocate(kN * sizeof(float)));
    ASSERT_OK_AND_ASSIGN(y_, session_.Allocate(kN * sizeof(float)));
    ASSERT_OK(x_.Upload(ToBytes(x_values_)));
    ASSERT_OK(y_.Upload(ToBytes(y_values_)));
  }

  // 4 blocks of 256 threads cover the 1000 elements.
  static LaunchConfig Config() { return Linear(4, 256); }

  void ExpectAxpyApplied() {
    ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
    ASSERT_EQ(y.size(), kN);
    for (uint64_t i = 0; i < kN; ++i) {
      ASSERT_FLOAT_EQ(y[i], kA * x_values_[i] + y_values_[i]) << "element " << i;
    }
  }

  Function axpy_;
  std::vector<float> x_values_, y_values_;
  Buffer x_, y_;
};

TEST_F(AxpyTest, TypedLaunch) {
  ASSERT_OK(axpy_.Launch(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, TypedLaunchAsync) {
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, PackedBlob) {
  const std::vector<v1::ParamInfo>& p = axpy_.params();
  ASSERT_THAT(p, SizeIs(4));
  Blob blob(p[3].offset_bytes() + p[3].size_bytes());
  blob.Put(p[0].offset_bytes(), kA)
      .Put(p[1].offset_bytes(), x_.device_address())
      .Put(p[2].offset_bytes(), y_.device_address())
      .Put(p[3].offset_bytes(), uint64_t{kN});
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), blob.bytes()));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, TypedProtoArgumentsPackedByTheServer) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy_.id());
  SetDim(4, 1, 1, launch.mutable_grid());
  SetDim(256, 1, 1, launch.mutable_block());
  launch.add_args()->set_f32(kA);
  launch.add_args()->set_device_address(x_.device_address());
  launch.add_args()->mutable_buffer()->set_buffer_id(y_.id());
  launch.add_args()->set_u64(kN);
  ASSERT_OK(raw.Launch(launch));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, BufferArgumentOffsetIsApplied) {
  // y[500..1000) += a * x[0..500): the server adds the buffer reference's offset.
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy_.id());
  SetDim(2, 1, 1, launch.mutable_grid());
  SetDim(256, 1, 1, launch.mutable_block());
  launch.add_args()->set_f32(kA);
  launch.add_args()->mutable_buffer()->set_buffer_id(x_.id());
  v1::BufferRef* y = launch.add_args()->mutable_buffer();
  y->set_buffer_id(y_.id());
  y->set_offset_bytes(500 * sizeof(float));
  launch.add_args()->set_u64(500);
  ASSERT_OK(raw.Launch(launch));
  ASSERT_OK_AND_ASSIGN(std::vector<float> result, DownloadFloats(y_));
  for (uint64_t i = 0; i < kN; ++i) {
    const float expected = i < 500 ? y_values_[i] : kA * x_values_[i - 500] + y_values_[i];
    ASSERT_FLOAT_EQ(result[i], expected) << "element " << i;
  }
}

TEST_F(AxpyTest, OnlyElementsBelowTheThreadCountAreProcessed) {
  // One block of 100 threads with n = 1000: the fake, like a GPU, runs 100 threads.
  ASSERT_OK(axpy_.Launch(Linear(1, 100), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
  EXPECT_FLOAT_EQ(y[99], kA * x_values_[99] + y_values_[99]);
  EXPECT_FLOAT_EQ(y[100], y_values_[100]);
}

// The server checks arguments whatever the client did: the raw API with typed arguments.
TEST_F(AxpyTest, WrongArgumentCountNamesBothCounts) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args()->RemoveLast();
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("axpy_f32"), HasSubstr("4 parameters"),
                                                 HasSubstr("3 arguments"))));
}

TEST_F(AxpyTest, DoubleForAFloatNamesTheParameterAndSizes) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(0)->set_f64(2.5);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("#0"), HasSubstr("expected 4 bytes"),
                                                 HasSubstr("given 8 bytes"))));
}

TEST_F(AxpyTest, SixteenByteStructForAPointerNamesTheParameterAndSizes) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(2)->set_raw(std::string(16, '\x01'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("#2"), HasSubstr("expected 8 bytes"),
                                                 HasSubstr("given 16 bytes"))));
}

TEST_F(AxpyTest, PackedBlobOfTheWrongLengthNamesBothLengths) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.clear_args();
  launch.set_packed_args(std::string(24, '\0'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("32 bytes"), HasSubstr("24 bytes"))));
}

TEST_F(AxpyTest, UnknownBufferArgumentIsNotFoundNamingTheParameter) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(1)->mutable_buffer()->set_buffer_id(x_.id() ^ 0x5a5a5a5a);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("#1")));
}

TEST_F(AxpyTest, ClientRefusesADoubleForAFloat) {
  EXPECT_THAT(
      axpy_.Launch(Config(), 2.5, x_, y_, uint64_t{kN}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("#0"), HasSubstr("expected 4 bytes"), HasSubstr("given 8 bytes"))));
}

// Session::Synchronize, or a note that it did not return within `timeout`; then the session
// is closed, which ends a wait that would otherwise never end.
absl::Status SynchronizeWithin(Session& session, absl::Duration timeout) {
  std::future<absl::Status> done =
      std::async(std::launch::async, [&session] { return session.Synchronize(); });
  if (done.wait_for(absl::ToChronoNanoseconds(timeout)) == std::future_status::ready) {
    return done.get();
  }
  session.Close().IgnoreError();
  done.wait();
  return absl::DeadlineExceededError(
      absl::StrCat("Session::Synchronize did not return within ", absl::FormatDuration(timeout)));
}

TEST_F(AxpyTest, AsyncArgumentErrorSurfacesAtSynchronize) {
  // The bad launch and the sync marker travel in one batch: the marker is skipped.
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), std::string(8, '\0')));
  ASSERT_THAT(SynchronizeWithin(session_, absl::Seconds(20)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes")));
  // Not a fault: the session goes on.
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(SynchronizeWithin(session_, absl::Seconds(20)));
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, AsyncArgumentErrorOfAnEarlierBatchSurfacesAtSynchronize) {
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), std::string(8, '\0')));
  ASSERT_OK(session_.Flush());
  ASSERT_THAT(SynchronizeWithin(session_, absl::Seconds(20)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes")));
  // Reported once; the session goes on.
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(SynchronizeWithin(session_, absl::Seconds(20)));
  ExpectAxpyApplied();
}

struct DimCase {
  const char* name;
  Dim3 grid;
  Dim3 block;
  uint32_t shared_memory_bytes;
  const char* names;  // what the message must name
};

class LaunchDimsTest : public AxpyTest, public ::testing::WithParamInterface<DimCase> {};

TEST_P(LaunchDimsTest, IsInvalidArgumentNamingTheDimension) {
  const DimCase& c = GetParam();
  LaunchConfig config;
  config.grid = c.grid;
  config.block = c.block;
  config.shared_memory_bytes = c.shared_memory_bytes;
  EXPECT_THAT(axpy_.Launch(config, kA, x_, y_, uint64_t{kN}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.names)));
  // Nothing ran.
  ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
  EXPECT_EQ(y, y_values_);
}

INSTANTIATE_TEST_SUITE_P(
    Dims, LaunchDimsTest,
    ::testing::Values(DimCase{"BlockXZero", {1, 1, 1}, {0, 1, 1}, 0, "block.x is 0"},
                      DimCase{"GridZZero", {1, 1, 0}, {32, 1, 1}, 0, "grid.z is 0"},
                      DimCase{"BlockX1025", {1, 1, 1}, {1025, 1, 1}, 0, "block.x = 1025"},
                      DimCase{"Block1056Threads", {1, 1, 1}, {32, 33, 1}, 0, "1056 threads"},
                      DimCase{"BlockZ65", {1, 1, 1}, {1, 1, 65}, 0, "block.z = 65"},
                      DimCase{"GridY65536", {1, 65536, 1}, {32, 1, 1}, 0, "grid.y = 65536"},
                      DimCase{"SharedMemory", {1, 1, 1}, {32, 1, 1}, 1u << 20, "shared memory"}),
    [](const ::testing::TestParamInfo<DimCase>& info) { return info.param.name; });

TEST_F(ComputeTest, UnknownFunctionIsNotFound) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(0x123456789abcdefull);
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(1, 1, 1, launch.mutable_block());
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("function")));
}

TEST_F(ComputeTest, AnotherSessionsFunctionIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Function axpy, FakeFunction("axpy_f32"));
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawSession raw(*client_, other);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy.id());
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(1, 1, 1, launch.mutable_block());
  launch.set_packed_args(std::string(32, '\0'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, UnknownStreamIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(64));
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(add_one.id());
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(16, 1, 1, launch.mutable_block());
  launch.add_args()->mutable_buffer()->set_buffer_id(data.id());
  launch.add_args()->set_u64(16);
  launch.set_stream_id(0x7777);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stream")));
}

// ------------------------------------------------------------------------------ command stream

TEST_F(ComputeTest, AsyncCommandsRunInOrder) {
  constexpr uint64_t kN = 1024;
  ASSERT_OK_AND_ASSIGN(Function fill, FakeFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(kN * 4));
  ASSERT_OK_AND_ASSIGN(Buffer copy, session_.Allocate(kN * 4));
  const LaunchConfig all = Linear(4, 256);
  // 10.0 everywhere; then 1.0 in the first half; then +1 three times over the first three
  // quarters; then a copy. Any reordering changes some element.
  ASSERT_OK(session_.MemsetAsync(data.at(), FloatBits(10.0f), 4, kN));
  ASSERT_OK(fill.LaunchAsync(all, data, FloatBits(1.0f), uint64_t{kN / 2}));
  for (int i = 0; i < 3; ++i) ASSERT_OK(add_one.LaunchAsync(all, data, uint64_t{kN * 3 / 4}));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(copy.at(), data.at(), kN * 4));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<float> values, DownloadFloats(copy));
  ASSERT_EQ(values.size(), kN);
  for (uint64_t i = 0; i < kN; ++i) {
    const float expected = i < kN / 2 ? 4.0f : i < kN * 3 / 4 ? 13.0f : 10.0f;
    ASSERT_EQ(values[i], expected) << "element " << i;
  }
}

TEST_F(ComputeTest, TenThousandAsyncLaunchesAreAllApplied) {
  constexpr uint64_t kN = 64;
  constexpr int kLaunches = 10000;
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(kN * 4));
  ASSERT_OK(data.Upload(ToBytes(Iota(kN, 0.0f, 1.0f))));
  for (int i = 0; i < kLaunches; ++i) {
    ASSERT_OK(add_one.LaunchAsync(Linear(1, 64), data, kN));
  }
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<float> values, DownloadFloats(data));
  EXPECT_EQ(values, Iota(kN, static_cast<float>(kLaunches), 1.0f));
}

v1::Command MemsetCommand(uint64_t sequence, uint64_t buffer_id, uint32_t value, uint64_t count) {
  v1::Command command;
  command.set_sequence(sequence);
  v1::MemsetCommand* memset = command.mutable_memset();
  memset->mutable_destination()->mutable_buffer()->set_buffer_id(buffer_id);
  memset->set_value(value);
  memset->set_element_size_bytes(4);
  memset->set_count(count);
  return command;
}

v1::Command DownloadCommand(uint64_t sequence, uint64_t buffer_id, uint64_t size_bytes) {
  v1::Command command;
  command.set_sequence(sequence);
  command.mutable_download()->mutable_source()->mutable_buffer()->set_buffer_id(buffer_id);
  command.mutable_download()->set_size_bytes(size_bytes);
  return command;
}

TEST_F(ComputeTest, CommandStreamReportsTheFailedSequenceAndSkipsTheRestOfItsBatch) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);

  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(1, buffer.id(), 1, 4);
  *batch.add_commands() = MemsetCommand(2, buffer.id() ^ 0x5a5a5a5a, 2, 4);  // no such buffer
  *batch.add_commands() = MemsetCommand(3, buffer.id(), 3, 4);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_error());
  EXPECT_EQ(reply.error().sequence(), 2u);
  EXPECT_EQ(reply.error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(reply.error().message(), HasSubstr("buffer"));
  EXPECT_EQ(reply.skipped_from_sequence(), 3u);
  EXPECT_EQ(reply.processed_through_sequence(), 2u);

  // A later batch runs, and shows that #1 ran and #3 did not.
  batch.Clear();
  *batch.add_commands() = MemsetCommand(4, buffer.id(), 4, 1);
  *batch.add_commands() = DownloadCommand(5, buffer.id(), 16);
  ASSERT_TRUE(stream->Write(batch));
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_FALSE(reply.has_error()) << reply.error().message();
  EXPECT_EQ(reply.processed_through_sequence(), 5u);
  ASSERT_THAT(reply.downloads(), SizeIs(1));
  EXPECT_EQ(reply.downloads(0).sequence(), 5u);
  EXPECT_THAT(FromBytes<uint32_t>(std::vector<uint8_t>(reply.downloads(0).data().begin(),
                                                       reply.downloads(0).data().end())),
              ElementsAre(4u, 1u, 1u, 1u));

  stream->WritesDone();
  EXPECT_OK(FromGrpcStatus(stream->Finish()));
}

TEST_F(ComputeTest, CommandStreamErrorInTheLastCommandSkipsNothing) {
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(7, 0x5a5a5a5a, 0, 1);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_EQ(reply.error().sequence(), 7u);
  EXPECT_EQ(reply.skipped_from_sequence(), 0u);
  EXPECT_EQ(reply.processed_through_sequence(), 7u);
  stream->WritesDone();
  EXPECT_OK(FromGrpcStatus(stream->Finish()));
}

TEST_F(ComputeTest, NonIncreasingSequenceNumbersEndTheStreamWithInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(5, buffer.id(), 1, 4);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_FALSE(reply.has_error());

  batch.Clear();
  *batch.add_commands() = MemsetCommand(5, buffer.id(), 2, 4);
  stream->Write(batch);  // may already fail if the server has ended the call
  while (stream->Read(&reply)) {
  }
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not increase")));
  // A protocol error is not a fault: the session goes on.
  EXPECT_OK(session_.Allocate(16).status());
}

TEST_F(ComputeTest, DecreasingSequenceInsideABatchEndsTheStream) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(9, buffer.id(), 1, 4);
  *batch.add_commands() = MemsetCommand(8, buffer.id(), 2, 4);
  stream->Write(batch);
  v1::CommandReply reply;
  while (stream->Read(&reply)) {
  }
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not increase")));
}

// ------------------------------------------------------------------------------ faults

// A daemon of its own with no warm workers, so that its children are exactly the sessions'
// workers.
class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(daemon_, TestDaemon::Start(NoWarmWorkers()));
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon_->address()));
    client_.emplace(std::move(client));
  }

  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      const std::string log = daemon_->Log();
      std::cerr << "---- gpurpcd log (last 8000 bytes) ----\n"
                << log.substr(log.size() > 8000 ? log.size() - 8000 : 0)
                << "---- end of gpurpcd log ----\n";
    }
  }

  // Opens a session and returns it with its worker's pid.
  absl::StatusOr<std::pair<Session, pid_t>> OpenSessionWithPid() {
    const std::vector<pid_t> before = daemon_->WorkerPids();
    absl::StatusOr<Session> session = client_->OpenSession();
    if (!session.ok()) return session.status();
    for (pid_t pid : daemon_->WorkerPids()) {
      if (std::find(before.begin(), before.end(), pid) == before.end()) {
        return std::make_pair(*std::move(session), pid);
      }
    }
    return absl::InternalError("no new worker process appeared for the session");
  }

  bool WorkerGone(pid_t pid, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const std::vector<pid_t> pids = daemon_->WorkerPids();
      if (std::find(pids.begin(), pids.end(), pid) == pids.end()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::optional<Client> client_;
};

TEST_F(FaultTest, FaultingKernelFaultsOnlyItsSession) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  ASSERT_OK_AND_ASSIGN(auto b, OpenSessionWithPid());
  Session& session_a = a.first;
  Session& session_b = b.first;
  ASSERT_NE(a.second, b.second);

  ASSERT_OK_AND_ASSIGN(Module module_a, CompileFakeKernels(session_a));
  ASSERT_OK_AND_ASSIGN(Function fault, module_a.GetFunction("fault_illegal_address"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer_a, session_a.Allocate(64));
  ASSERT_OK_AND_ASSIGN(Module module_b, CompileFakeKernels(session_b));
  ASSERT_OK_AND_ASSIGN(Function add_one_b, module_b.GetFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer_b, session_b.Allocate(64 * sizeof(float)));
  ASSERT_OK(buffer_b.Upload(ToBytes(std::vector<float>(64, 0.0f))));

  // Session B works throughout, concurrently with A's fault.
  std::atomic<int> b_iterations{0};
  std::atomic<int> b_failures{0};
  std::string b_first_failure;
  std::thread b_thread([&] {
    for (int i = 1; i <= 200; ++i) {
      absl::Status status = add_one_b.Launch(Linear(1, 64), buffer_b, uint64_t{64});
      absl::StatusOr<std::vector<uint8_t>> bytes =
          status.ok() ? buffer_b.Download() : absl::StatusOr<std::vector<uint8_t>>(status);
      if (!bytes.ok() || FromBytes<float>(*bytes) != std::vector<float>(64, float(i))) {
        if (b_failures.fetch_add(1) == 0) {
          b_first_failure = absl::StrCat("iteration ", i, ": ",
                                         bytes.ok() ? "wrong values" : bytes.status().ToString());
        }
      }
      b_iterations.store(i);
    }
  });
  while (b_iterations.load() < 20) std::this_thread::sleep_for(std::chrono::milliseconds(1));

  // Asynchronous, like CUDA: the launch itself succeeds, the fault surfaces at the sync.
  EXPECT_OK(fault.Launch({}));
  EXPECT_THAT(session_a.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  b_thread.join();
  EXPECT_EQ(b_failures.load(), 0) << b_first_failure;

  // Every later call on A: FAILED_PRECONDITION naming the cause.
  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_THAT(session_a.Allocate(64), faulted);
  EXPECT_THAT(buffer_a.Download(), faulted);
  EXPECT_THAT(session_a.GetMemInfo(), faulted);
  EXPECT_THAT(session_a.Compile(Source(kFakeKernels)), faulted);
  EXPECT_THAT(module_a.GetFunction("axpy_f32"), faulted);
  EXPECT_THAT(session_a.CreateStream(), faulted);
  EXPECT_THAT(fault.Launch({}), faulted);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session_a.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_THAT(state.fault_cause(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));

  // A's worker process is gone; B's is not, and B still answers correctly.
  EXPECT_TRUE(WorkerGone(a.second, absl::Seconds(10)));
  EXPECT_THAT(daemon_->WorkerPids(), Contains(b.second));
  ASSERT_OK(add_one_b.Launch(Linear(1, 64), buffer_b, uint64_t{64}));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, buffer_b.Download());
  EXPECT_THAT(FromBytes<float>(bytes), Each(201.0f));
}

TEST_F(FaultTest, FaultedSessionRefusesAsyncWorkAndSynchronize) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fault, module.GetFunction("fault_illegal_address"));
  ASSERT_OK_AND_ASSIGN(Function add_one, module.GetFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(64));
  ASSERT_OK(fault.LaunchAsync({}));
  ASSERT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));

  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_THAT(session.Synchronize(), faulted);
  // Enqueueing may or may not report it at once; the next sync must.
  const absl::Status enqueued = add_one.LaunchAsync(Linear(1, 16), buffer, uint64_t{16});
  if (!enqueued.ok()) {
    EXPECT_THAT(enqueued, faulted);
  }
  EXPECT_THAT(session.Synchronize(), faulted);
  absl::Status memset = session.MemsetAsync(buffer.at(), 0, 4, 16);
  if (memset.ok()) memset = session.Synchronize();
  EXPECT_THAT(memset, faulted);
}

TEST_F(FaultTest, OutOfBoundsFakeKernelFaultsTheSession) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer small, session.Allocate(16 * sizeof(uint32_t)));
  // 1024 threads and n = 1024 over a buffer of 16 elements.
  EXPECT_OK(fill.Launch(Linear(4, 256), small, 7u, uint64_t{1024}));
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session.Allocate(64), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_TRUE(WorkerGone(a.second, absl::Seconds(10)));
}

TEST_F(FaultTest, InBoundsFillIsNotAFault) {
  // The control for the test above: the same launch with n inside the buffer.
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer small, session.Allocate(16 * sizeof(uint32_t)));
  EXPECT_OK(fill.Launch(Linear(4, 256), small, 7u, uint64_t{16}));
  EXPECT_OK(session.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, small.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(7u));
}

// ------------------------------------------------------------------------------ streams, events

TEST_F(ComputeTest, StreamCreateAndDestroy) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t stream, raw.CreateStream());
  EXPECT_NE(stream, 0u);
  EXPECT_OK(raw.DestroyStream(stream));
  EXPECT_THAT(raw.DestroyStream(stream), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, DestroyUnknownOrDefaultStreamIsNotFound) {
  RawSession raw(*client_, session_);
  EXPECT_THAT(raw.DestroyStream(0x4242), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw.DestroyStream(0), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, EventCreateAndDestroy) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t event, raw.CreateEvent());
  EXPECT_NE(event, 0u);
  EXPECT_OK(raw.DestroyEvent(event));
  EXPECT_THAT(raw.DestroyEvent(event), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw.DestroyEvent(0x4242), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, AnotherSessionsStreamIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawSession raw(*client_, other);
  EXPECT_THAT(raw.DestroyStream(stream.id()), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, EventRecordQuerySynchronize) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Event event, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &stream), uint64_t{1000}));
  ASSERT_OK(event.Record(&stream));
  EXPECT_OK(event.Synchronize());
  EXPECT_THAT(event.Query(), IsOkAndHolds(true));
  EXPECT_OK(stream.Synchronize());
}

TEST_F(ComputeTest, ElapsedTimeBetweenEventsIsNotNegative) {
  ASSERT_OK_AND_ASSIGN(Event start, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Event end, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK(start.Record());
  ASSERT_OK(spin.LaunchAsync({}, uint64_t{2000}));
  ASSERT_OK(end.Record());
  ASSERT_OK(end.Synchronize());
  ASSERT_OK_AND_ASSIGN(float elapsed_ms, end.ElapsedSince(start));
  EXPECT_THAT(elapsed_ms, Ge(0.0f));
  // The fake runs the 2 ms spin between the two records.
  EXPECT_THAT(elapsed_ms, Ge(1.5f));
}

TEST_F(ComputeTest, ElapsedTimeOfAnUnrecordedEventIsFailedPrecondition) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t start, raw.CreateEvent());
  ASSERT_OK_AND_ASSIGN(uint64_t end, raw.CreateEvent());
  EXPECT_THAT(raw.ElapsedTime(start, end), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(ComputeTest, StreamWaitEventOrdersTwoStreams) {
  constexpr uint64_t kN = 256;
  ASSERT_OK_AND_ASSIGN(Stream writer, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Stream reader, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Event written, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Function fill, FakeFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer source, session_.Allocate(kN * 4));
  ASSERT_OK_AND_ASSIGN(Buffer destination, session_.Allocate(kN * 4));
  ASSERT_OK(session_.Memset(source.at(), 0, 4, kN));
  ASSERT_OK(session_.Memset(destination.at(), 0, 4, kN));

  ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &writer), uint64_t{5000}));
  ASSERT_OK(fill.LaunchAsync(Linear(1, 256, &writer), source, 0xC0FFEEu, kN));
  ASSERT_OK(written.Record(&writer));
  ASSERT_OK(reader.WaitEvent(written));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(destination.at(), source.at(), kN * 4, &reader));
  ASSERT_OK(reader.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> values, DownloadU32(destination));
  EXPECT_THAT(values, Each(0xC0FFEEu));
}

TEST_F(ComputeTest, WaitOnAnUnknownEventIsNotFound) {
  RawSession raw(*client_, session_);
  v1::StreamWaitEventRequest request;
  request.set_event_id(0x4242);
  v1::StreamWaitEventResponse response;
  grpc::ClientContext context;
  raw.Prepare(&context);
  EXPECT_THAT(FromGrpcStatus(raw.execution().StreamWaitEvent(&context, request, &response)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("event")));
}

// ------------------------------------------------------------------------------ globals

TEST_F(ComputeTest, DeviceAndConstantGlobalsCanBeWrittenAndRead) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kGlobals)));
  ASSERT_TRUE(result.success()) << result.log();
  for (const char* name : {"g", "c"}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(Module::Global global, result.module.GetGlobal(name));
    EXPECT_NE(global.device_address, 0u);
    EXPECT_EQ(global.size_bytes, 4 * sizeof(float));
    const std::vector<float> values = {1.5f, -2.0f, 3.25f, 42.0f};
    ASSERT_OK(session_.Upload(global.ref(), ToBytes(values)));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                         session_.Download(global.ref(), global.size_bytes));
    EXPECT_EQ(FromBytes<float>(bytes), values);
    // The range is bounded by the global's size.
    EXPECT_THAT(session_.Download(global.ref(), global.size_bytes + 4).status(), Not(IsOk()));
  }
}

TEST_F(ComputeTest, UnknownGlobalIsNotFound) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kGlobals)));
  ASSERT_TRUE(result.success()) << result.log();
  EXPECT_THAT(result.module.GetGlobal("no_such_global"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no_such_global")));
}

}  // namespace
}  // namespace gpurpc
