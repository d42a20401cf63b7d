// The NVRTC compiler against the real NVRTC (it needs no GPU): outputs, logs, option and
// header checks, limits, name expressions, toolkit headers; and the SHA-256 used for keys.
#include "server/worker/compiler/compiler.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/wrappers.pb.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/compile_helper.h"
#include "server/worker/compiler/sha256.h"
#include "server/worker/compiler/std_headers.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::compiler {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr char kKernel[] = R"(
extern "C" __global__ void scale(float* data, float factor, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] *= factor;
}
)";

CompileRequest Request(std::string source, std::string target = "sm_90") {
  CompileRequest request;
  request.source = std::move(source);
  request.target = std::move(target);
  return request;
}

std::string ImageText(const CompileResult& result) {
  return std::string(result.image.begin(), result.image.end());
}

// One compiler for the whole binary: NVRTC is loaded once. Its memory cache is off, so
// every compile reaches NVRTC.
Compiler* SharedCompiler() {
  static Compiler* const kCompiler = [] {
    CompilerOptions options;
    options.cache_dir = "";
    options.memory_cache_max_bytes = 0;
    auto compiler = Compiler::Create(options);
    return compiler.ok() ? std::move(compiler).value().release() : nullptr;
  }();
  return kCompiler;
}

class CompilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    compiler_ = SharedCompiler();
    ASSERT_NE(compiler_, nullptr) << Compiler::Create(CompilerOptions()).status();
  }

  Compiler* compiler_ = nullptr;
};

TEST_F(CompilerTest, ReportsNvrtcVersion) {
  EXPECT_GE(compiler_->nvrtc_version(), 11000);
  EXPECT_EQ(compiler_->nvrtc_version() % 10, 0);
}

TEST_F(CompilerTest, CompilesToCubinForSm) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(Request(kKernel, "sm_90")));
  ASSERT_TRUE(result.success) << result.log;
  ASSERT_GE(result.image.size(), 4u);
  EXPECT_EQ(ImageText(result).substr(0, 4),
            "\x7f"
            "ELF");
  EXPECT_EQ(result.arch, "sm_90");
  EXPECT_THAT(result.effective_options, Contains("--gpu-architecture=sm_90"));
  EXPECT_THAT(result.effective_options, Contains("--no-source-include"));
  EXPECT_FALSE(result.cache_hit);
  EXPECT_EQ(result.cache_key.size(), 64u);
}

TEST_F(CompilerTest, CompilesToPtxForCompute) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(Request(kKernel, "compute_75")));
  ASSERT_TRUE(result.success) << result.log;
  EXPECT_THAT(ImageText(result), HasSubstr(".entry"));
  EXPECT_THAT(ImageText(result), HasSubstr(".target sm_75"));
  ASSERT_FALSE(result.image.empty());
  EXPECT_EQ(result.image.back(), 0) << "PTX must be NUL-terminated";
  EXPECT_EQ(result.arch, "compute_75");
}

TEST_F(CompilerTest, UserArchOptionOverridesTarget) {
  CompileRequest request = Request(kKernel, "sm_90");
  request.options = {"-arch=compute_80"};
  ASSERT_OK_AND_ASSIGN(CompileResult ptx, compiler_->Compile(request));
  ASSERT_TRUE(ptx.success) << ptx.log;
  EXPECT_EQ(ptx.arch, "compute_80");
  EXPECT_THAT(ImageText(ptx), HasSubstr(".entry"));
  EXPECT_THAT(ptx.effective_options, Not(Contains("--gpu-architecture=sm_90")));

  request.options = {"-arch", "sm_80"};
  ASSERT_OK_AND_ASSIGN(CompileResult cubin, compiler_->Compile(request));
  ASSERT_TRUE(cubin.success) << cubin.log;
  EXPECT_EQ(cubin.arch, "sm_80");
  EXPECT_EQ(ImageText(cubin).substr(0, 4),
            "\x7f"
            "ELF");
}

TEST_F(CompilerTest, SyntaxErrorIsAFailedResultWithTheLog) {
  CompileRequest request = Request("__global__ void broken() { int x = ; }");
  request.program_name = "broken.cu";
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  EXPECT_FALSE(result.success);
  EXPECT_THAT(result.log, HasSubstr("error"));
  EXPECT_THAT(result.log, HasSubstr("broken.cu"));
  EXPECT_TRUE(result.image.empty());
}

// A few hundred bytes of macros can make NVRTC print megabytes; what reaches the worker,
// the client and the shared cache is capped at 1 MiB, with a note saying so.
TEST_F(CompilerTest, HugeLogsAreCapped) {
  const std::string source = R"(
#define A0 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
#define A1 A0 A0 A0 A0 A0 A0 A0 A0
#define A2 A1 A1 A1 A1 A1 A1 A1 A1
#define A3 A2 A2 A2 A2 A2 A2 A2 A2
#define A4 A3 A3 A3 A3 A3 A3 A3 A3
#define DO_PRAGMA(x) _Pragma(#x)
#define W DO_PRAGMA(message(A4))
W W W W W W W W
extern "C" __global__ void k() {}
)";
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(Request(source, "compute_75")));
  EXPECT_TRUE(result.success);
  EXPECT_LE(result.log.size(), (1u << 20) + 200);
  EXPECT_THAT(result.log, HasSubstr("only the first 1048576 are kept"));
}

TEST_F(CompilerTest, WarningShowsInTheLogOnSuccess) {
  ASSERT_OK_AND_ASSIGN(CompileResult result,
                       compiler_->Compile(Request("__global__ void k() { int unused; }")));
  EXPECT_TRUE(result.success);
  EXPECT_THAT(result.log, HasSubstr("warning"));
  EXPECT_FALSE(result.image.empty());
}

TEST_F(CompilerTest, UnknownOptionIsInvalidArgumentNamingIt) {
  CompileRequest request = Request(kKernel);
  request.options = {"-DX=1", "--no-such-option"};
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'--no-such-option'"), HasSubstr("unrecognized"))));
}

TEST_F(CompilerTest, UnsupportedTargetIsInvalidArgument) {
  EXPECT_THAT(compiler_->Compile(Request(kKernel, "sm_1")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--gpu-architecture=sm_1")));
}

TEST_F(CompilerTest, MissingOrMalformedTargetIsInvalidArgument) {
  EXPECT_THAT(compiler_->Compile(Request(kKernel, "")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target")));
  EXPECT_THAT(compiler_->Compile(Request(kKernel, "sm_90 -G")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target")));
}

TEST_F(CompilerTest, OptionsWithoutLoadableImageAreInvalidArgument) {
  CompileRequest request = Request(kKernel);
  request.options = {"-dlto"};
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no loadable")));
}

class ForbiddenOptionTest : public CompilerTest,
                            public ::testing::WithParamInterface<std::vector<std::string>> {};

TEST_P(ForbiddenOptionTest, IsInvalidArgumentNamingTheOption) {
  CompileRequest request = Request(kKernel);
  request.options = GetParam();
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'" + GetParam().back() + "'"), HasSubstr("not allowed"))));
}

INSTANTIATE_TEST_SUITE_P(
    ServerFiles, ForbiddenOptionTest,
    ::testing::Values(
        std::vector<std::string>{"-I/x"}, std::vector<std::string>{"-Ifoo"},
        std::vector<std::string>{"--include-path=/etc"}, std::vector<std::string>{"-include foo.h"},
        std::vector<std::string>{"-include"}, std::vector<std::string>{"--pre-include=x"},
        std::vector<std::string>{"--options-file=f"}, std::vector<std::string>{"-optf=f"},
        std::vector<std::string>{"-pch"}, std::vector<std::string>{"--create-pch=x.pch"},
        std::vector<std::string>{"--use-pch=x.pch"}, std::vector<std::string>{"--pch-dir=cache"},
        std::vector<std::string>{"-time=report.csv"},
        std::vector<std::string>{"--fdevice-time-trace=trace.json"},
        std::vector<std::string>{"-arch=../x"},
        std::vector<std::string>{"-DX=1", "--some-option=/abs/path"},
        std::vector<std::string>{"-arch", "/abs"},
        std::vector<std::string>{"-Xptxas=--options-file=opts.txt"},
        std::vector<std::string>{"-Xptxas=-v,/abs/file"}));

TEST_F(CompilerTest, PtxasOptionsPassThrough) {
  CompileRequest request = Request(kKernel);
  request.options = {"-Xptxas=-v"};
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  EXPECT_TRUE(result.success) << result.log;
  EXPECT_THAT(result.log, HasSubstr("ptxas info"));
}

TEST_F(CompilerTest, EmptyOrNulOptionIsInvalidArgument) {
  CompileRequest request = Request(kKernel);
  request.options = {""};
  EXPECT_THAT(compiler_->Compile(request), StatusIs(absl::StatusCode::kInvalidArgument));
  request.options = {std::string("-DX\0Y", 5)};
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NUL")));
}

TEST_F(CompilerTest, RequestHeadersAreFoundByQuotesAndAngles) {
  CompileRequest request = Request(R"(
#include "config.h"
#include <detail/math.h>
static_assert(kFactor == 3, "config.h was not used");
extern "C" __global__ void k(int* out) { out[0] = Triple(kFactor); }
)");
  request.headers = {{"config.h", "constexpr int kFactor = 3;\n"},
                     {"detail/math.h", "__device__ inline int Triple(int x) { return 3 * x; }\n"}};
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  EXPECT_TRUE(result.success) << result.log;
}

TEST_F(CompilerTest, SourceCannotIncludeFilesBesideTheWorker) {
  // Without --no-source-include NVRTC would search the worker's working directory.
  std::string dir = ::testing::TempDir() + "compiler_test_cwd_XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  { std::ofstream(dir + "/beside.h") << "#define BESIDE 1\n"; }
  char previous[4096];
  ASSERT_NE(getcwd(previous, sizeof(previous)), nullptr);
  ASSERT_EQ(chdir(dir.c_str()), 0);
  auto result = compiler_->Compile(Request("#include \"beside.h\"\n__global__ void k() {}"));
  ASSERT_EQ(chdir(previous), 0);
  std::filesystem::remove_all(dir);

  ASSERT_THAT(result, IsOk());
  EXPECT_FALSE(result->success);
  EXPECT_THAT(result->log, HasSubstr("beside.h"));
}

TEST_F(CompilerTest, BadHeaderNamesAreInvalidArgument) {
  const std::vector<std::string> bad_names = {"",
                                              "/abs.h",
                                              "../up.h",
                                              "a/../b.h",
                                              "back\\slash.h",
                                              std::string("nul\0.h", 6),
                                              std::string(257, 'h')};
  for (const std::string& name : bad_names) {
    CompileRequest request = Request(kKernel);
    request.headers = {{name, "// nothing\n"}};
    EXPECT_THAT(compiler_->Compile(request),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("header name")))
        << "name: " << name;
  }
  CompileRequest request = Request(kKernel);
  request.headers = {{std::string(256, 'h'), "// longest allowed name\n"}};
  EXPECT_THAT(compiler_->Compile(request), IsOk());
}

TEST_F(CompilerTest, DuplicateHeaderIsInvalidArgument) {
  CompileRequest request = Request(kKernel);
  request.headers = {{"a.h", "// one\n"}, {"b.h", ""}, {"a.h", "// two\n"}};
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("a.h"), HasSubstr("more than once"))));
}

TEST_F(CompilerTest, BadProgramNameIsInvalidArgument) {
  CompileRequest request = Request(kKernel);
  request.program_name = "/etc/kernel.cu";
  EXPECT_THAT(compiler_->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("program name")));
}

TEST_F(CompilerTest, NulInSourceIsInvalidArgument) {
  EXPECT_THAT(compiler_->Compile(Request(std::string("__global__ void k() {}\0junk", 27))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NUL byte at offset 22")));
}

TEST(CompilerLimitsTest, SizeLimitsAreInvalidArgumentNamingLimitAndSize) {
  CompilerOptions options;
  options.max_source_bytes = 1000;
  options.max_header_bytes = 100;
  options.max_total_header_bytes = 150;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Compiler> compiler, Compiler::Create(options));

  EXPECT_THAT(
      compiler->Compile(Request(std::string(1001, ' '))),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("1001 bytes"), HasSubstr("1000"), HasSubstr("max_source_bytes"))));
  CompileRequest at_limit = Request(std::string(1000 - sizeof(kKernel) + 1, ' ') + kKernel);
  ASSERT_EQ(at_limit.source.size(), 1000u);
  EXPECT_THAT(compiler->Compile(at_limit), IsOk());

  CompileRequest request = Request(kKernel);
  request.headers = {{"big.h", std::string(101, ' ')}};
  EXPECT_THAT(compiler->Compile(request), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   AllOf(HasSubstr("big.h"), HasSubstr("101 bytes"),
                                                         HasSubstr("max_header_bytes"))));

  request.headers = {{"a.h", std::string(80, ' ')}, {"b.h", std::string(80, ' ')}};
  EXPECT_THAT(compiler->Compile(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("160 bytes"), HasSubstr("max_total_header_bytes"))));
}

TEST_F(CompilerTest, NameExpressionsGiveLoweredNames) {
  CompileRequest request = Request(R"(
template <typename T>
__global__ void fill(T* out, T value) { out[threadIdx.x] = value; }
)");
  request.name_expressions = {"fill<float>", "fill<int>"};
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  ASSERT_TRUE(result.success) << result.log;
  ASSERT_EQ(result.lowered_names.size(), 2u);
  EXPECT_EQ(result.lowered_names[0].first, "fill<float>");
  EXPECT_THAT(result.lowered_names[0].second, StartsWith("_Z"));
  EXPECT_EQ(result.lowered_names[1].first, "fill<int>");
  EXPECT_THAT(result.lowered_names[1].second, StartsWith("_Z"));
  EXPECT_NE(result.lowered_names[0].second, result.lowered_names[1].second);
  // The mangled names are the kernels' symbols in the cubin.
  EXPECT_THAT(ImageText(result), HasSubstr(result.lowered_names[0].second));
}

TEST_F(CompilerTest, InvalidNameExpressionFailsTheCompile) {
  CompileRequest request = Request("template <typename T> __global__ void f(T*) {}");
  request.name_expressions = {"f<no_such_type>"};
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  EXPECT_FALSE(result.success);
  EXPECT_THAT(result.log, HasSubstr("no_such_type"));
}

TEST_F(CompilerTest, ToolkitHeadersCompile) {
  ASSERT_OK_AND_ASSIGN(CompileResult half, compiler_->Compile(Request(R"(
#include <cuda_fp16.h>
extern "C" __global__ void add(__half* a, const __half* b) {
  a[threadIdx.x] = __hadd(a[threadIdx.x], b[threadIdx.x]);
}
)")));
  EXPECT_TRUE(half.success) << half.log;

  ASSERT_OK_AND_ASSIGN(CompileResult random, compiler_->Compile(Request(R"(
#include <curand_kernel.h>
extern "C" __global__ void uniform(float* out, unsigned long long seed) {
  curandState state;
  curand_init(seed, threadIdx.x, 0, &state);
  out[threadIdx.x] = curand_uniform(&state);
}
)")));
  EXPECT_TRUE(random.success) << random.log;
}

// Every shim compiles on its own, without a warning, in the C++ dialects it supports, to both
// output kinds.
class StdHeaderShimTest : public CompilerTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(StdHeaderShimTest, CompilesAlone) {
  // The C headers stand alone; the C++ ones are libcu++'s, which needs C++17.
  const std::string& name = GetParam();
  const bool c_header = absl::EndsWith(name, ".h") || (name.size() > 1 && name[0] == 'c' &&
                                                       name != "complex" && name != "chrono");
  // (dialect, target) pairs: each dialect and each output kind at least once.
  std::vector<std::pair<const char*, const char*>> cases = {{"-std=c++17", "sm_90"},
                                                            {"-std=c++20", "compute_75"}};
  if (c_header) cases.emplace_back("-std=c++11", "sm_90");
  for (const auto& [std, target] : cases) {
    CompileRequest request = Request(absl::StrCat("#include <", name, ">\n", kKernel), target);
    request.options = {std};
    ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
    EXPECT_TRUE(result.success) << name << " " << std << " " << target << ":\n" << result.log;
    EXPECT_THAT(result.log, Not(HasSubstr("warning"))) << name << " " << std;
  }
  // PyCUDA's SourceModule wraps the whole source in extern "C" { ... } by default.
  ASSERT_OK_AND_ASSIGN(
      CompileResult wrapped,
      compiler_->Compile(Request(absl::StrCat("extern \"C\" {\n#include <", name,
                                              ">\n__global__ void k(int* p) { *p = 1; }\n}\n"))));
  EXPECT_TRUE(wrapped.success) << name << " inside extern \"C\":\n" << wrapped.log;
}

std::vector<std::string> ShimNames() {
  std::vector<std::string> names;
  for (const Header& shim : StdHeaderShims()) {
    if (!absl::StartsWith(shim.name, "__")) names.push_back(shim.name);
  }
  return names;
}

INSTANTIATE_TEST_SUITE_P(All, StdHeaderShimTest, ::testing::ValuesIn(ShimNames()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!absl::ascii_isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST_F(CompilerTest, StdHeaderShimsGiveWhatKernelsUse) {
  // What PyCUDA-era kernels write: C headers with their macros and typedefs, std:: names.
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(Request(R"(
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <limits.h>
#include <float.h>
#include <assert.h>
#include <cstdint>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <complex>
static_assert(sizeof(uint64_t) == 8 && sizeof(std::int16_t) == 2, "stdint");
static_assert(INT_MAX == 2147483647 && UINT32_MAX == 4294967295u, "limits");
static_assert(std::is_same<std::uint32_t, uint32_t>::value, "type_traits");
extern "C" __global__ void k(float* f, uint32_t* u, int64_t* i, size_t n) {
  assert(n > 0);
  printf("%d %f %s\n", INT_MAX, FLT_MAX, "printf");
  f[0] = std::sqrt(f[0]) + sqrtf(f[1]) + std::sin(1.0f) + float(M_PI) + INFINITY + FLT_EPSILON +
         std::numeric_limits<float>::max() + std::abs(std::complex<float>(3.0f, 4.0f));
  u[0] = UINT32_MAX + abs(-3) + std::abs(-3) + static_cast<uint32_t>(strlen("abc"));
  std::pair<int, float> p = std::make_pair(1, 2.0f);
  i[0] = p.first + std::min(3, 4) + std::max<int64_t>(5, 6) + (std::isnan(f[0]) ? 1 : 0);
  void* m = malloc(16);
  memset(m, 0, 16);
  free(m);
}
)")));
  EXPECT_TRUE(result.success) << result.log;
}

TEST_F(CompilerTest, RequestHeaderWinsOverTheShimOfTheSameName) {
  CompileRequest request = Request(R"(
#include <stdint.h>
static_assert(kMine == 7, "the request's stdint.h was not used");
extern "C" __global__ void k(int* out) { out[0] = kMine; }
)");
  request.headers = {{"stdint.h", "constexpr int kMine = 7;\n"}};
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler_->Compile(request));
  EXPECT_TRUE(result.success) << result.log;
}

TEST_F(CompilerTest, UnshimmedStandardHeaderStillSaysItCannotBeOpened) {
  ASSERT_OK_AND_ASSIGN(CompileResult result,
                       compiler_->Compile(Request("#include <iostream>\n" + std::string(kKernel))));
  EXPECT_FALSE(result.success);
  EXPECT_THAT(result.log, HasSubstr("iostream"));
}

std::string HexOf(Sha256::Engine engine, absl::string_view data) {
  Sha256 hasher(engine);
  hasher.Update(data);
  return DigestToHex(hasher.Finish());
}

class Sha256Test : public ::testing::TestWithParam<Sha256::Engine> {};

// FIPS 180-4 / NIST CAVP test vectors, on the portable code and on the CPU's SHA
// extensions where this machine has them.
TEST_P(Sha256Test, KnownVectors) {
  const Sha256::Engine engine = GetParam();
  EXPECT_EQ(HexOf(engine, ""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HexOf(engine, "abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(HexOf(engine, "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(HexOf(engine,
                  "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmn"
                  "hijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(HexOf(engine, std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_P(Sha256Test, IncrementalUpdatesMatchOneShot) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 31 + 7));
  for (size_t length : {0u, 1u, 55u, 56u, 63u, 64u, 65u, 119u, 120u, 1000u}) {
    const absl::string_view message(data.data(), length);
    const std::string expected = HexOf(GetParam(), message);
    for (size_t chunk : {1u, 3u, 63u, 64u, 100u}) {
      Sha256 hasher(GetParam());
      for (size_t offset = 0; offset < length; offset += chunk) {
        hasher.Update(message.substr(offset, chunk));
      }
      EXPECT_EQ(DigestToHex(hasher.Finish()), expected)
          << "length " << length << " chunk " << chunk;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, Sha256Test,
                         ::testing::Values(Sha256::Engine::kPortable, Sha256::Engine::kFastest),
                         [](const auto& info) {
                           return info.param == Sha256::Engine::kPortable ? "Portable" : "Fastest";
                         });

TEST(Sha256EnginesTest, AgreeOnManyLengths) {
  if (!Sha256::HardwareAccelerated()) {
    GTEST_SKIP() << "this CPU has no SHA extensions; only the portable code runs here";
  }
  std::string data;
  for (int i = 0; i < 4096; ++i) data.push_back(static_cast<char>((i * 7919) >> 3));
  for (size_t length = 0; length <= data.size(); length += 37) {
    const absl::string_view message(data.data(), length);
    EXPECT_EQ(HexOf(Sha256::Engine::kFastest, message), HexOf(Sha256::Engine::kPortable, message))
        << "length " << length;
  }
}

}  // namespace
}  // namespace gpurpc::compiler

namespace gpurpc::compiler {
namespace {

class IncludeCheckTest : public ::testing::TestWithParam<const char*> {};

TEST_P(IncludeCheckTest, IncludesOutsideTheRequestAreRefused) {
  auto compiler = Compiler::Create(CompilerOptions());
  ASSERT_TRUE(compiler.ok()) << compiler.status();
  CompileRequest request;
  request.source = std::string("// line 1\n") + GetParam() + "\n__global__ void k() {}\n";
  request.target = "sm_90";
  auto result = (*compiler)->Compile(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << GetParam();
  EXPECT_THAT(std::string(result.status().message()), ::testing::HasSubstr("source line "));
  // The same inside a header sent with the request.
  request.source = "#include \"h.h\"\n__global__ void k() {}\n";
  request.headers = {{"h.h", GetParam()}};
  result = (*compiler)->Compile(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Directives, IncludeCheckTest,
                         ::testing::Values("#include \"/etc/passwd\"", "  #  include </etc/hosts>",
                                           "#include \"../../etc/passwd\"",
                                           "#include <../secret.h>", "#include_next </x.h>",
                                           "#define F \"/etc/passwd\"\n#include F",
                                           "#if __has_include(\"/etc/shadow\")\n#endif"));

// The helper protocol's frames are parsed only when what they parse to is bounded: a helper
// that a tenant's source subverted cannot make its worker take many times a reply's size.
std::string Frame(const std::string& bytes) {
  const auto size = static_cast<uint32_t>(bytes.size());
  std::string frame = {static_cast<char>(size), static_cast<char>(size >> 8),
                       static_cast<char>(size >> 16), static_cast<char>(size >> 24)};
  return frame + bytes;
}

absl::Status ReadOneFrame(const std::string& frame, google::protobuf::MessageLite* message) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError("socketpair");
  }
  std::thread writer([&] {
    size_t sent = 0;
    while (sent < frame.size()) {
      const ssize_t n = send(fds[1], frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
  });
  absl::Status read = ReadHelperFrame(fds[0], message, 256u << 20, absl::Now() + absl::Seconds(60));
  close(fds[0]);  // a writer still sending (the frame was refused early) stops
  writer.join();
  close(fds[1]);
  return read;
}

TEST(HelperFrameTest, AFrameThatWouldParseToManyTimesItsSizeIsRefusedUnparsed) {
  // 8 million unknown varint fields: 16 MB that protobuf would parse to some 400 MB.
  std::string fields;
  fields.reserve(16'000'000);
  for (int i = 0; i < 8'000'000; ++i) fields += "\x78\x01";
  google::protobuf::BytesValue message;
  EXPECT_THAT(ReadOneFrame(Frame(fields), &message),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("would take more than")));
  EXPECT_TRUE(message.value().empty());
}

TEST(HelperFrameTest, LargeImagesAndLogsStillParse) {
  // A 60 MB string parses to about twice its size: under the bound.
  google::protobuf::BytesValue big;
  std::string value;
  value.resize(60'000'000, 'c');
  big.set_value(std::move(value));
  google::protobuf::BytesValue message;
  ASSERT_THAT(ReadOneFrame(Frame(big.SerializeAsString()), &message), IsOk());
  EXPECT_EQ(message.value().size(), 60'000'000u);
}

}  // namespace
}  // namespace gpurpc::compiler
