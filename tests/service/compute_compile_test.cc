// NVRTC through the daemon: compiles, their logs, headers, name expressions and the compile cache
// (also across a restart and with a corrupted file). Shared fixture and helpers:
// compute_fixture.h.
#include "tests/service/compute_fixture.h"

namespace gpurpc::compute_test {
namespace {

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

}  // namespace
}  // namespace gpurpc::compute_test
