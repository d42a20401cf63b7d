// ModuleService.LinkModule (JIT linking, dynamic parallelism) through the C++ client's
// Session::Link: the real gpurpcd with real worker processes. Built twice: label `service`
// on the fake backend, and label `gpu` (link_module_gpu_test) with the CUDA backend
// (GPURPC_TEST_BACKEND), where it skips without a driver and where a parent kernel launches
// a child kernel (dynamic parallelism) and the result is checked.
//
// NVRTC compiles for real in both (relocatable code); the fake then runs its built-in host
// kernels by name, so the linked sources define kernels with the built-ins' names and
// signatures (tests/testing/fake_kernels.h).

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/status_matchers.h"

#ifndef GPURPC_TEST_BACKEND
#define GPURPC_TEST_BACKEND "fake"
#endif

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr char kBackend[] = GPURPC_TEST_BACKEND;
constexpr uint64_t kMiB = 1 << 20;

bool OnGpu() { return std::string(kBackend) == "cuda"; }

// Two of the fake's built-ins, in separate translation units.
constexpr char kAxpy[] = R"cuda(
extern "C" __global__ void axpy_f32(float a, const float* x, float* y, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
)cuda";
constexpr char kFill[] = R"cuda(
extern "C" __global__ void fill_u32(unsigned* out, unsigned value, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}
)cuda";

// Dynamic parallelism: the parent launches the child from the device; the child is defined
// in another translation unit (an external function the linker must resolve).
constexpr char kChild[] = R"cuda(
extern "C" __global__ void child_square(unsigned* out, unsigned base, unsigned n) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[base + i] = (base + i) * (base + i);
}
)cuda";
constexpr char kParent[] = R"cuda(
extern "C" __global__ void child_square(unsigned* out, unsigned base, unsigned n);
extern "C" __global__ void parent_launch(unsigned* out, unsigned per_parent) {
  // Each parent thread launches one child grid over its slice.
  const unsigned base = (blockIdx.x * blockDim.x + threadIdx.x) * per_parent;
  child_square<<<(per_parent + 63) / 64, 64>>>(out, base, per_parent);
}
)cuda";

CompileOptions Source(std::string source, std::string program_name) {
  CompileOptions options;
  options.source = std::move(source);
  options.program_name = std::move(program_name);
  return options;
}

LaunchConfig Linear(uint32_t grid, uint32_t block) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  return config;
}

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// A minimal well-formed ar archive, standing in for libcudadevrt.a where the test points
// GPURPC_CUDADEVRT (the fake checks the archive's structure only).
std::string TinyArchive() {
  std::string member = "device runtime stand-in\n";  // 24 bytes: even, no padding
  std::string header = "stand_in.o/     0           0     0     644     ";
  header += std::to_string(member.size());
  header.resize(58, ' ');
  header += "`\n";
  return "!<arch>\n" + header + member;
}

class LinkModuleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (OnGpu()) {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA link tests: " << cuda;
      }
    }
  }

  void StartDaemon(std::vector<std::string> flags = {}, std::vector<std::string> env = {}) {
    TestDaemon::Options options;
    options.backend = kBackend;
    options.extra_flags = std::move(flags);
    options.env = std::move(env);
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon.status(), IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client.status(), IsOk());
    client_.emplace(*std::move(client));
    auto session = client_->OpenSession();
    ASSERT_THAT(session.status(), IsOk());
    session_ = *std::move(session);
  }

  // The fake has no toolkit of its own to trust in CI: it links a stand-in archive. On a
  // GPU the daemon finds the real libcudadevrt.a.
  std::vector<std::string> CudadevrtEnv() {
    if (OnGpu()) return {};
    const std::string path = absl::StrCat(::testing::TempDir(), "/libcudadevrt-stand-in.a");
    std::ofstream(path, std::ios::binary) << TinyArchive();
    return {absl::StrCat("GPURPC_CUDADEVRT=", path)};
  }

  // INVALID_ARGUMENT naming `what`, and the daemon and the session carry on. What the
  // driver's linker refuses (`by_linker`) is worded by the driver on a GPU: there only the
  // code is checked.
  void ExpectRefused(const LinkOptions& options, const std::string& what, bool by_linker = false) {
    if (by_linker && OnGpu()) {
      EXPECT_THAT(session_.Link(options).status(), StatusIs(absl::StatusCode::kInvalidArgument));
    } else {
      EXPECT_THAT(session_.Link(options).status(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
    }
    EXPECT_THAT(daemon_->CheckRunning(), IsOk());
    EXPECT_THAT(session_.Allocate(64).status(), IsOk());
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::optional<Client> client_;
  Session session_;
};

TEST_F(LinkModuleTest, SourcesAndPtxDataLinkIntoOneModuleThatRuns) {
  StartDaemon();
  // PTX made by a compile for a virtual architecture: data of type PTX.
  CompileOptions fill = Source(kFill, "fill.cu");
  fill.options = {"-rdc=true", "-arch=compute_75"};
  auto fill_ptx = session_.Compile(fill);
  ASSERT_THAT(fill_ptx.status(), IsOk());
  ASSERT_TRUE(fill_ptx->success()) << fill_ptx->log();
  LinkOptions options;
  options.AddSource(Source(kAxpy, "axpy.cu"))
      .AddData(v1::LINK_INPUT_TYPE_PTX, fill_ptx->response.image(), "fill.ptx");
  auto linked = session_.Link(options);
  ASSERT_THAT(linked.status(), IsOk());
  ASSERT_TRUE(linked->success());
  ASSERT_EQ(linked->response.sources_size(), 1);
  EXPECT_EQ(linked->response.sources(0).input_index(), 0u);
  EXPECT_THAT(linked->response.sources(0).effective_options(),
              ::testing::Contains("--relocatable-device-code=true"));
  EXPECT_NE(linked->module.id(), 0u);

  constexpr uint64_t n = 1000;
  auto x = session_.Allocate(n * 4);
  auto y = session_.Allocate(n * 4);
  ASSERT_THAT(x.status(), IsOk());
  ASSERT_THAT(y.status(), IsOk());
  auto fill_fn = linked->module.GetFunction("fill_u32");
  auto axpy_fn = linked->module.GetFunction("axpy_f32");
  ASSERT_THAT(fill_fn.status(), IsOk());
  ASSERT_THAT(axpy_fn.status(), IsOk());
  uint32_t one_bits;
  const float one = 1.0f;
  std::memcpy(&one_bits, &one, 4);
  ASSERT_THAT(fill_fn->LaunchAsync(Linear(4, 256), *x, one_bits, n), IsOk());
  ASSERT_THAT(fill_fn->LaunchAsync(Linear(4, 256), *y, one_bits, n), IsOk());
  ASSERT_THAT(axpy_fn->LaunchAsync(Linear(4, 256), 2.0f, *x, *y, n), IsOk());
  ASSERT_THAT(session_.Synchronize(), IsOk());
  auto out = session_.Download(y->at(0), n * 4);
  ASSERT_THAT(out.status(), IsOk());
  EXPECT_THAT(FromBytes<float>(*out), Each(3.0f));

  // A second link of the same sources is a cache hit.
  LinkOptions again;
  again.AddSource(Source(kAxpy, "axpy.cu"))
      .AddData(v1::LINK_INPUT_TYPE_PTX, fill_ptx->response.image(), "fill.ptx");
  auto relinked = session_.Link(again);
  ASSERT_THAT(relinked.status(), IsOk());
  EXPECT_TRUE(relinked->response.sources(0).cache_hit());
}

TEST_F(LinkModuleTest, AFailedCompileIsAResultWithTheLog) {
  StartDaemon();
  LinkOptions options;
  options.AddSource(Source(kAxpy, "good.cu"))
      .AddSource(Source("__global__ void broken( { }", "broken.cu"));
  auto linked = session_.Link(options);
  ASSERT_THAT(linked.status(), IsOk());
  EXPECT_FALSE(linked->success());
  ASSERT_EQ(linked->response.sources_size(), 2);
  EXPECT_TRUE(linked->response.sources(0).success());
  EXPECT_FALSE(linked->response.sources(1).success());
  EXPECT_EQ(linked->response.sources(1).input_index(), 1u);
  EXPECT_THAT(linked->response.sources(1).log(), HasSubstr("broken.cu"));
  EXPECT_EQ(linked->response.module_id(), 0u);
}

TEST_F(LinkModuleTest, DynamicParallelismLinksOnlyWithCudadevrt) {
  StartDaemon({}, CudadevrtEnv());
  LinkOptions without;
  without.AddSource(Source(kParent, "parent.cu")).AddSource(Source(kChild, "child.cu"));
  auto refused = session_.Link(without);
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuLinkComplete")));
  if (!OnGpu()) {
    // CUDA 13's device runtime entry points (__cudaCDP2GetParameterBufferV2 ...).
    EXPECT_THAT(refused.status().message(),
                AllOf(HasSubstr("Undefined reference to '__cudaCDP2"), HasSubstr("parent.cu")));
  }
  LinkOptions with;
  with.AddSource(Source(kParent, "parent.cu"))
      .AddSource(Source(kChild, "child.cu"))
      .AddStandardLibrary("cudadevrt");
  auto linked = session_.Link(with);
  ASSERT_THAT(linked.status(), IsOk());
  ASSERT_TRUE(linked->success());
  if (!OnGpu()) {
    // The fake runs only its built-ins: the module defines the kernel, the fake says so.
    EXPECT_THAT(linked->module.GetFunction("parent_launch").status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("built-in")));
    return;
  }
  // On the GPU: 8 parents x 4 threads, each launching a child grid over 100 elements.
  constexpr uint32_t kPerParent = 100;
  constexpr uint32_t kParents = 8 * 4;
  constexpr uint64_t n = uint64_t{kPerParent} * kParents;
  auto out = session_.Allocate(n * 4);
  ASSERT_THAT(out.status(), IsOk());
  ASSERT_THAT(session_.Memset(out->at(0), 0, 4, n), IsOk());
  auto parent = linked->module.GetFunction("parent_launch");
  ASSERT_THAT(parent.status(), IsOk());
  ASSERT_THAT(parent->LaunchAsync(Linear(8, 4), *out, kPerParent), IsOk());
  ASSERT_THAT(session_.Synchronize(), IsOk());
  auto bytes = session_.Download(out->at(0), n * 4);
  ASSERT_THAT(bytes.status(), IsOk());
  const std::vector<uint32_t> values = FromBytes<uint32_t>(*bytes);
  for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(values[i], i * i) << "element " << i;
}

TEST_F(LinkModuleTest, DynamicSourceModuleStyleSingleSource) {
  // A parent and its child in one source, as DynamicSourceModule compiles them.
  StartDaemon({}, CudadevrtEnv());
  LinkOptions options;
  options.AddSource(Source(absl::StrCat(kChild, kParent), "dynamic.cu"))
      .AddStandardLibrary("cudadevrt");
  options.log_verbose = true;
  auto linked = session_.Link(options);
  ASSERT_THAT(linked.status(), IsOk());
  ASSERT_TRUE(linked->success());
  if (!OnGpu()) {
    EXPECT_THAT(linked->log(), HasSubstr("library"));
    return;
  }
  constexpr uint32_t kPerParent = 64;
  constexpr uint64_t n = kPerParent * 2;
  auto out = session_.Allocate(n * 4);
  ASSERT_THAT(out.status(), IsOk());
  auto parent = linked->module.GetFunction("parent_launch");
  ASSERT_THAT(parent.status(), IsOk());
  ASSERT_THAT(parent->LaunchAsync(Linear(1, 2), *out, kPerParent), IsOk());
  ASSERT_THAT(session_.Synchronize(), IsOk());
  auto bytes = session_.Download(out->at(0), n * 4);
  ASSERT_THAT(bytes.status(), IsOk());
  const std::vector<uint32_t> values = FromBytes<uint32_t>(*bytes);
  for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(values[i], i * i) << "element " << i;
}

TEST_F(LinkModuleTest, AMissingStandardLibraryIsAFailedPreconditionNamingWhereItLooked) {
  StartDaemon({}, {"GPURPC_CUDADEVRT=/nonexistent/gpurpc-test/libcudadevrt.a"});
  LinkOptions options;
  options.AddSource(Source(kAxpy, "axpy.cu")).AddStandardLibrary("cudadevrt");
  EXPECT_THAT(session_.Link(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("not installed"), HasSubstr("/nonexistent/gpurpc-test"),
                             HasSubstr("GPURPC_CUDADEVRT"))));
  EXPECT_THAT(daemon_->CheckRunning(), IsOk());
}

TEST_F(LinkModuleTest, HostileInputsAreRefusedNamingWhatWasWrong) {
  StartDaemon({}, CudadevrtEnv());
  ExpectRefused(LinkOptions(), "no inputs");
  {
    LinkOptions options;
    for (int i = 0; i <= kMaxLinkInputs; ++i) options.AddStandardLibrary("cudadevrt");
    ExpectRefused(options, absl::StrCat(kMaxLinkInputs + 1, " inputs"));
  }
  {
    LinkOptions options;
    for (int i = 0; i <= kMaxLinkSources; ++i) options.AddSource(Source(kAxpy, "a.cu"));
    ExpectRefused(options, absl::StrCat(kMaxLinkSources + 1, " sources"));
  }
  {
    LinkOptions options;
    options.AddData(static_cast<v1::LinkInputType>(99), "x", "odd");
    ExpectRefused(options, "input 0 has unknown input type 99");
  }
  {
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_UNSPECIFIED, "x", "unset");
    ExpectRefused(options, "unknown input type 0");
  }
  {
    LinkOptions options;
    options.AddStandardLibrary("cudadevrt").AddData(v1::LINK_INPUT_TYPE_PTX, "", "empty.ptx");
    ExpectRefused(options, "input 1: the data is empty");
  }
  {
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_PTX, "x", std::string(kMaxLinkInputNameBytes + 1, 'n'));
    ExpectRefused(options, "the name is");
  }
  {
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_PTX, "x", std::string("a\0b", 3));
    ExpectRefused(options, "NUL");
  }
  {
    LinkOptions options;
    options.AddStandardLibrary("m");
    ExpectRefused(options, "unknown standard library 'm'");
  }
  {
    LinkOptions options;
    options.AddStandardLibrary("../../etc/passwd");
    ExpectRefused(options, "unknown standard library");
  }
  {
    LinkOptions options;
    options.AddStandardLibrary("cudadevrt").AddStandardLibrary("cudadevrt");
    ExpectRefused(options, "named twice");
  }
  {
    LinkOptions options;
    options.request.add_inputs();
    ExpectRefused(options, "input 0 sets none of");
  }
  {
    LinkOptions options;
    CompileOptions source = Source(kAxpy, "axpy.cu");
    source.options = {"-rdc=false"};
    options.AddSource(source);
    ExpectRefused(options, "turns relocatable device code off");
  }
  {
    LinkOptions options;
    CompileOptions source = Source(kAxpy, "axpy.cu");
    source.options = {"-I/etc"};
    options.AddSource(source);
    ExpectRefused(options, "input 0");
  }
  {
    LinkOptions options;
    options.AddSource(Source("", "empty.cu"));
    ExpectRefused(options, "the source is empty");
  }
  {
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_PTX, ".version 9.0\n.target sm_75\n.entry broken(",
                    "broken.ptx");
    ExpectRefused(options, "broken.ptx", /*by_linker=*/true);
  }
  {
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_CUBIN, ".version 9.0\n.target sm_75\n", "not.cubin");
    ExpectRefused(options, "not.cubin", /*by_linker=*/true);
  }
  {
    // A library from the client: its members would reach the linker unchecked.
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_LIBRARY, "!<arch>\n", "libmine.a");
    ExpectRefused(options, "'libmine.a'): libraries are linked only from the server's toolkit");
  }
  {
    // Bytes that are not what they are declared to be, checked before any linker sees them.
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_FATBINARY, ".version 9.0\n.target sm_75\n", "a.fatbin");
    ExpectRefused(options, "'a.fatbin') is declared a fatbin but its bytes are");
  }
  {
    // An ELF header whose section table lies beyond the bytes sent.
    std::string elf(64, '\0');
    elf[0] = 0x7f;
    elf[1] = 'E';
    elf[2] = 'L';
    elf[3] = 'F';
    elf[4] = 2;        // 64-bit
    elf[0x28] = 0x10;  // e_shoff far past the end
    elf[0x29] = 0x27;
    elf[0x3c] = 4;  // e_shnum
    LinkOptions options;
    options.AddData(v1::LINK_INPUT_TYPE_OBJECT, elf, "short.o");
    ExpectRefused(options, "'short.o')");
  }
  {
    // The same kernel defined twice.
    LinkOptions options;
    options.AddSource(Source(kAxpy, "one.cu")).AddSource(Source(kAxpy, "two.cu"));
    ExpectRefused(options, "Multiple definition of 'axpy_f32'", /*by_linker=*/true);
  }
}

// The linked module's globals are charged to the tenant like LoadModule's and Compile's:
// within the quota they count, over it the module is unloaded and the call refused.
TEST_F(LinkModuleTest, LinkedGlobalsAreChargedToTheTenantsLedger) {
  const std::string config = absl::StrCat(::testing::TempDir(), "/link-quota.conf");
  { std::ofstream(config) << "default_quota { max_device_memory_bytes: 67108864 }\n"; }
  StartDaemon({absl::StrCat("--config=", config)});
  const std::string small_ptx =
      ".version 8.0\n.target sm_75\n.address_size 64\n"
      ".visible .global .align 4 .b8 small_buffer[16777216];\n";
  LinkOptions small_options;
  small_options.AddData(v1::LINK_INPUT_TYPE_PTX, small_ptx, "small.ptx")
      .AddSource(Source(kAxpy, "axpy.cu"));
  auto small = session_.Link(small_options);
  ASSERT_THAT(small.status(), IsOk());
  ASSERT_TRUE(small->success());
  EXPECT_GE(small->response.device_memory_bytes(), 16 * kMiB);
  auto info = client_->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  const uint64_t charged = info->device_memory_bytes();
  EXPECT_GE(charged, 16 * kMiB);
  EXPECT_EQ(charged, small->response.device_memory_bytes());
  const std::string big_ptx =
      ".version 8.0\n.target sm_75\n.address_size 64\n"
      ".visible .global .align 4 .b8 big_buffer[268435456];\n";
  LinkOptions big_options;
  big_options.AddData(v1::LINK_INPUT_TYPE_PTX, big_ptx, "big.ptx");
  EXPECT_THAT(session_.Link(big_options).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
  info = client_->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), charged);
  // Unloading gives the bytes back.
  small->module = Module();
  ASSERT_THAT(session_.Synchronize(), IsOk());
  for (int attempt = 0; attempt < 100; ++attempt) {
    info = client_->GetServerInfo();
    ASSERT_THAT(info.status(), IsOk());
    if (info->device_memory_bytes() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(info->device_memory_bytes(), 0u);
}

}  // namespace
}  // namespace gpurpc
