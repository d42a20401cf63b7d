// Tests of the CUDA backend on a real GPU (ctest label `gpu`).
//
// Every test needs a driver and a device: when MakeCudaBackend() fails, each one skips
// and prints why (CudaBackendTestData needs neither). The kernels are files of
// tests/gpu/data: PTX written by nvcc 13.0 from the CUDA C++ below (cuda_backend_kernels.ptx,
// compute_75, so any CUDA 13 device JIT-compiles it), and add_one built for sm_90 as a cubin
// (add_one.sm_90.cubin: `nvcc -cubin -arch=sm_90`) and as a fatbin (add_one.sm_90.fatbin:
// `nvcc -fatbin -gencode arch=compute_90,code=sm_90`); tests of those skip on other devices.
// The build copies tests/gpu/data to `data` beside this executable and the install puts it
// beside the installed one (libexec/gpurpc/tests/data, tests/CMakeLists.txt): the test reads
// the files from there, found from its own path (/proc/self/exe).
//
//   extern "C" __global__ void add_one(float* p, unsigned long long n) {
//     unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
//     if (i < n) p[i] += 1.0f;
//   }
//   extern "C" __global__ void noop() {}
//   extern "C" __global__ void shared_roundtrip(unsigned int* out, unsigned int n) {
//     extern __shared__ unsigned int s[];
//     for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) s[i] = i;
//     __syncthreads();
//     for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
//   }
//   extern "C" __global__ void store_to(int* p) { *p = 1; }
//   __device__ unsigned int counter;
//   extern "C" __global__ void bump_counter() { atomicAdd(&counter, 1u); }

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Field;
using ::testing::HasSubstr;
using ::testing::SizeIs;
using ::testing::StartsWith;

// CUdevice_attribute values (the test does not include cuda.h).
constexpr int kAttributeWarpSize = 10;
constexpr int kAttributeMultiprocessorCount = 16;
constexpr int kAttributeComputeCapabilityMajor = 75;

// The kernels of the header comment, read once per process from `data` beside the test
// executable; NOT_FOUND naming the path when a file cannot be read.
struct TestKernels {
  std::string ptx;     // cuda_backend_kernels.ptx: add_one, noop, shared_roundtrip, ...
  std::string cubin;   // add_one.sm_90.cubin
  std::string fatbin;  // add_one.sm_90.fatbin
};

// `data` in the folder of this executable (/proc/self/exe: wherever the tree was copied, and
// also in a death test's re-executed child); `data` in the working folder if that fails.
std::filesystem::path TestDataDir() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::filesystem::path("data") : self.parent_path() / "data";
}

absl::StatusOr<std::string> ReadTestData(const std::string& name) {
  const std::filesystem::path path = TestDataDir() / name;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read the test data file ", path.string(),
                                            " (tests/gpu/data, copied beside the test "
                                            "executable by the build and by the install)"));
  }
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

absl::StatusOr<TestKernels> LoadTestKernels() {
  TestKernels kernels;
  GPURPC_ASSIGN_OR_RETURN(kernels.ptx, ReadTestData("cuda_backend_kernels.ptx"));
  GPURPC_ASSIGN_OR_RETURN(kernels.cubin, ReadTestData("add_one.sm_90.cubin"));
  GPURPC_ASSIGN_OR_RETURN(kernels.fatbin, ReadTestData("add_one.sm_90.fatbin"));
  return kernels;
}

const absl::StatusOr<TestKernels>& Kernels() {
  static const auto* const kernels = new absl::StatusOr<TestKernels>(LoadTestKernels());
  return *kernels;
}

absl::Span<const uint8_t> Bytes(absl::string_view text) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

std::vector<uint8_t> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<uint8_t> bytes(size);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = random();
    std::memcpy(&bytes[i], &word, 8);
  }
  for (; i < size; ++i) bytes[i] = static_cast<uint8_t>(random());
  return bytes;
}

// Packs `args` at the offsets `function` reports, checking each size.
template <typename... Args>
std::vector<uint8_t> PackArgs(const Function& function, const Args&... args) {
  const std::vector<ParamInfo>& params = function.params();
  EXPECT_EQ(params.size(), sizeof...(Args));
  std::vector<uint8_t> packed;
  if (params.size() != sizeof...(Args) || params.empty()) return packed;
  packed.resize(params.back().offset_bytes + params.back().size_bytes);
  size_t index = 0;
  auto put = [&](const auto& arg) {
    const ParamInfo& param = params[index++];
    EXPECT_EQ(param.size_bytes, sizeof(arg));
    std::memcpy(packed.data() + param.offset_bytes, &arg,
                std::min<size_t>(sizeof(arg), param.size_bytes));
  };
  (put(args), ...);
  return packed;
}

LaunchConfig Linear(uint64_t threads, uint32_t block = 256) {
  LaunchConfig config;
  config.block.x = block;
  config.grid.x = static_cast<uint32_t>((threads + block - 1) / block);
  return config;
}

MATCHER_P2(ParamIs, offset_bytes, size_bytes, "") {
  return arg.offset_bytes == static_cast<uint32_t>(offset_bytes) &&
         arg.size_bytes == static_cast<uint32_t>(size_bytes);
}

// The kernel files are found beside the executable (in the build tree as in an install)
// and are what their names say. Needs no driver: never skips.
TEST(CudaBackendTestData, KernelFilesAreFound) {
  const absl::StatusOr<TestKernels>& kernels = Kernels();
  ASSERT_OK(kernels.status());
  std::cout << "test data from " << TestDataDir().string() << "\n";
  EXPECT_THAT(kernels->ptx, StartsWith(".version 9.0\n.target sm_75\n"));
  for (const char* entry : {"add_one", "noop", "shared_roundtrip", "store_to", "bump_counter"}) {
    EXPECT_THAT(kernels->ptx, HasSubstr(absl::StrCat(".visible .entry ", entry, "(")));
  }
  EXPECT_THAT(kernels->cubin, StartsWith("\x7f"
                                         "ELF"));
  EXPECT_THAT(kernels->fatbin, StartsWith("\x50\xed\x55\xba"));  // 0xba55ed50, little-endian
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend();
    if (!backend.ok()) GTEST_SKIP() << "no CUDA driver: " << backend.status();
    backend_ = std::move(backend).value();
    ASSERT_OK_AND_ASSIGN(context_, backend_->OpenContext(0));
    ASSERT_OK(Kernels().status());
  }

  Context& context() { return *context_; }
  // The kernel files (TestKernels); SetUp made sure they were read.
  const TestKernels& kernels() const { return *Kernels(); }

  absl::StatusOr<std::unique_ptr<Module>> LoadKernels() {
    return context_->LoadModule(Bytes(kernels().ptx));
  }

  bool IsSm90() const {
    return context_->device().compute_capability_major == 9 &&
           context_->device().compute_capability_minor == 0;
  }

  // Uploads `data` to a new buffer on `stream` and returns its address.
  absl::StatusOr<DevicePtr> UploadNew(const std::vector<uint8_t>& data, Stream* stream = nullptr) {
    absl::StatusOr<DevicePtr> ptr = context_->Alloc(data.size());
    if (!ptr.ok()) return ptr;
    absl::Status status = context_->Upload(*ptr, data.data(), data.size(), stream);
    if (!status.ok()) return status;
    return ptr;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Context> context_;  // After backend_: destroyed first.
};

TEST_F(CudaBackendTest, ListDevicesIsSane) {
  EXPECT_EQ(backend_->name(), "cuda");
  EXPECT_GE(backend_->driver_version(), 13000);
  ASSERT_OK_AND_ASSIGN(std::vector<DeviceInfo> devices, backend_->ListDevices());
  ASSERT_FALSE(devices.empty());
  for (size_t i = 0; i < devices.size(); ++i) {
    const DeviceInfo& device = devices[i];
    SCOPED_TRACE(absl::StrCat("device ", i, " ", device.name));
    std::cout << "device " << i << ": " << device.name << ", sm_" << device.compute_capability_major
              << device.compute_capability_minor << ", " << device.total_memory_bytes << " bytes, "
              << device.multiprocessor_count << " SMs, PCI " << device.pci_bus_id << ", "
              << device.attributes.size() << " attributes; driver " << backend_->driver_version()
              << "\n";
    EXPECT_EQ(device.ordinal, static_cast<int>(i));
    EXPECT_FALSE(device.name.empty());
    EXPECT_FALSE(device.is_fake);
    EXPECT_GE(device.compute_capability_major, 7);
    EXPECT_GE(device.total_memory_bytes, uint64_t{1} << 30);
    EXPECT_GT(device.multiprocessor_count, 0);
    EXPECT_GE(device.max_threads_per_block, 256);
    for (int d = 0; d < 3; ++d) {
      EXPECT_GT(device.max_block_dim[d], 0);
      EXPECT_GT(device.max_grid_dim[d], 0);
    }
    EXPECT_GE(device.max_grid_dim[0], 65535);
    EXPECT_GE(device.max_shared_memory_per_block_bytes, 48 << 10);
    EXPECT_GE(device.max_shared_memory_per_block_optin_bytes,
              device.max_shared_memory_per_block_bytes);
    EXPECT_EQ(device.warp_size, 32);
    EXPECT_THAT(device.pci_bus_id, HasSubstr(":"));
    EXPECT_GT(device.attributes.size(), 100u);
    ASSERT_TRUE(device.attributes.count(kAttributeMultiprocessorCount));
    EXPECT_EQ(device.attributes.at(kAttributeMultiprocessorCount), device.multiprocessor_count);
    ASSERT_TRUE(device.attributes.count(kAttributeWarpSize));
    EXPECT_EQ(device.attributes.at(kAttributeWarpSize), 32);
    ASSERT_TRUE(device.attributes.count(kAttributeComputeCapabilityMajor));
    EXPECT_EQ(device.attributes.at(kAttributeComputeCapabilityMajor),
              device.compute_capability_major);
  }
}

TEST_F(CudaBackendTest, ContextDescribesItsDevice) {
  ASSERT_OK_AND_ASSIGN(std::vector<DeviceInfo> devices, backend_->ListDevices());
  const DeviceInfo& device = context().device();
  EXPECT_EQ(device.ordinal, 0);
  EXPECT_EQ(device.name, devices[0].name);
  EXPECT_EQ(device.pci_bus_id, devices[0].pci_bus_id);
  EXPECT_EQ(context().CompileTarget(),
            absl::StrCat("sm_", device.compute_capability_major, device.compute_capability_minor));
}

TEST_F(CudaBackendTest, OpenContextRejectsABadOrdinal) {
  EXPECT_THAT(backend_->OpenContext(1 << 20),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuDeviceGet")));
}

TEST_F(CudaBackendTest, UploadDownloadRoundTrips) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(true));
  const uint64_t sizes[] = {1,       1000,          64 << 10, (64 << 10) + 1, (1 << 20) + 1,
                            8 << 20, (8 << 20) + 1, 64 << 20};
  constexpr uint64_t kGuardBytes = 64;
  for (Stream* on : {static_cast<Stream*>(nullptr), stream.get()}) {
    for (uint64_t size : sizes) {
      for (uint64_t offset : {uint64_t{0}, uint64_t{3}}) {
        SCOPED_TRACE(absl::StrCat(on == nullptr ? "default stream" : "stream", ", size ", size,
                                  ", offset ", offset));
        const uint64_t total = offset + size + kGuardBytes;
        ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(total));
        ASSERT_OK(context().Memset(buffer, 0x5A, 1, total, on));
        const std::vector<uint8_t> data = RandomBytes(size, size * 31 + offset);
        ASSERT_OK(context().Upload(buffer + offset, data.data(), size, on));

        std::vector<uint8_t> exact(size);
        ASSERT_OK(context().Download(exact.data(), buffer + offset, size, on));
        EXPECT_TRUE(exact == data);

        std::vector<uint8_t> whole(total);
        ASSERT_OK(context().Download(whole.data(), buffer, total, on));
        EXPECT_TRUE(std::equal(data.begin(), data.end(), whole.begin() + offset));
        EXPECT_TRUE(std::all_of(whole.begin(), whole.begin() + offset,
                                [](uint8_t b) { return b == 0x5A; }));
        EXPECT_TRUE(std::all_of(whole.begin() + offset + size, whole.end(),
                                [](uint8_t b) { return b == 0x5A; }));
        ASSERT_OK(context().Free(buffer));
      }
    }
  }
}

TEST_F(CudaBackendTest, ZeroByteTransfersAreNoOps) {
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(16));
  uint8_t byte = 7;
  EXPECT_OK(context().Upload(buffer, &byte, 0, nullptr));
  EXPECT_OK(context().Download(&byte, buffer, 0, nullptr));
  EXPECT_OK(context().CopyDeviceToDevice(buffer, buffer + 8, 0, nullptr));
  EXPECT_OK(context().Memset(buffer, 0, 4, 0, nullptr));
  EXPECT_EQ(byte, 7);
  EXPECT_OK(context().Free(buffer));
}

// The stream is kept busy so that the copies are still queued when Upload returns; the
// source is overwritten at once and the device must still receive the original bytes.
TEST_F(CudaBackendTest, UploadSourceMayBeReusedAtOnce) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(true));
  const uint64_t busy_count = uint64_t{128} << 20;  // floats
  ASSERT_OK_AND_ASSIGN(DevicePtr busy, context().Alloc(busy_count * sizeof(float)));
  ASSERT_OK(context().Memset(busy, 0, 4, busy_count, stream.get()));

  for (uint64_t size : {uint64_t{1000}, uint64_t{20} << 20}) {
    SCOPED_TRACE(absl::StrCat("size ", size));
    ASSERT_OK_AND_ASSIGN(DevicePtr dst, context().Alloc(size));
    for (int i = 0; i < 20; ++i) {
      const std::vector<uint8_t> args = PackArgs(*add_one, busy, busy_count);
      ASSERT_OK(context().Launch(add_one, Linear(busy_count), args, stream.get()));
    }
    const std::vector<uint8_t> original = RandomBytes(size, 99);
    std::vector<uint8_t> src = original;
    ASSERT_OK(context().Upload(dst, src.data(), size, stream.get()));
    std::fill(src.begin(), src.end(), 0xFF);
    std::vector<uint8_t> back(size);
    ASSERT_OK(context().Download(back.data(), dst, size, stream.get()));
    EXPECT_TRUE(back == original);
    ASSERT_OK(context().Free(dst));
  }
  ASSERT_OK(context().Free(busy));
}

TEST_F(CudaBackendTest, MemsetWritesEachElementSize) {
  constexpr uint64_t kSize = 4096;
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(kSize));
  ASSERT_OK(context().Memset(buffer, 0, 1, kSize, nullptr));
  ASSERT_OK(context().Memset(buffer + 1, 0x1AB, 1, 5, nullptr));  // Only the low byte.
  ASSERT_OK(context().Memset(buffer + 16, 0xBEEF, 2, 7, nullptr));
  ASSERT_OK(context().Memset(buffer + 64, 0xDEADBEEF, 4, 9, nullptr));
  std::vector<uint8_t> bytes(kSize);
  ASSERT_OK(context().Download(bytes.data(), buffer, kSize, nullptr));

  std::vector<uint8_t> expected(kSize, 0);
  std::fill(expected.begin() + 1, expected.begin() + 6, 0xAB);
  for (int i = 0; i < 7; ++i) {
    const uint16_t value = 0xBEEF;
    std::memcpy(&expected[16 + 2 * i], &value, 2);
  }
  for (int i = 0; i < 9; ++i) {
    const uint32_t value = 0xDEADBEEF;
    std::memcpy(&expected[64 + 4 * i], &value, 4);
  }
  EXPECT_TRUE(bytes == expected);

  EXPECT_THAT(context().Memset(buffer, 0, 3, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context().Memset(buffer + 1, 0, 4, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemsetD32Async")));
  EXPECT_OK(context().Synchronize());
  EXPECT_OK(context().Free(buffer));
}

TEST_F(CudaBackendTest, CopyDeviceToDevice) {
  const std::vector<uint8_t> data = RandomBytes(3 << 20, 7);
  ASSERT_OK_AND_ASSIGN(DevicePtr a, UploadNew(data));
  ASSERT_OK_AND_ASSIGN(DevicePtr b, context().Alloc(2 << 20));
  constexpr uint64_t kSize = (1 << 20) + 13;
  ASSERT_OK(context().CopyDeviceToDevice(b + 7, a + 5, kSize, nullptr));
  std::vector<uint8_t> back(kSize);
  ASSERT_OK(context().Download(back.data(), b + 7, kSize, nullptr));
  EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + 5));
  EXPECT_OK(context().Free(a));
  EXPECT_OK(context().Free(b));
}

TEST_F(CudaBackendTest, MemInfoFollowsAllocations) {
  ASSERT_OK_AND_ASSIGN(MemInfo before, context().GetMemInfo());
  EXPECT_GT(before.total_bytes, 0u);
  EXPECT_LE(before.free_bytes, before.total_bytes);
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(uint64_t{1} << 30));
  ASSERT_OK_AND_ASSIGN(MemInfo during, context().GetMemInfo());
  EXPECT_LT(during.free_bytes, before.free_bytes);
  EXPECT_EQ(during.total_bytes, before.total_bytes);
  EXPECT_OK(context().Free(buffer));
}

TEST_F(CudaBackendTest, HugeAllocIsResourceExhaustedAndTheContextStaysUsable) {
  EXPECT_THAT(context().Alloc(uint64_t{1} << 50),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("cuMemAlloc"), HasSubstr("CUDA_ERROR_OUT_OF_MEMORY"))));
  const std::vector<uint8_t> data = RandomBytes(100000, 3);
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, UploadNew(data));
  std::vector<uint8_t> back(data.size());
  ASSERT_OK(context().Download(back.data(), buffer, back.size(), nullptr));
  EXPECT_TRUE(back == data);
  EXPECT_OK(context().Free(buffer));
  EXPECT_OK(context().Synchronize());
}

TEST_F(CudaBackendTest, FreeOfAnUnknownAddressIsInvalidArgument) {
  EXPECT_THAT(context().Free(0x1000),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemFree")));
  EXPECT_OK(context().Synchronize());
}

TEST_F(CudaBackendTest, LoadModuleRejectsInvalidImages) {
  EXPECT_THAT(context().LoadModule({}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context().LoadModule(Bytes("this is not a module")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuModuleLoadDataEx")));
  EXPECT_THAT(context().LoadModule(Bytes(".version 9.0\n.target sm_75\n.address_size 64\n"
                                         ".visible .entry broken() { this is not ptx; }\n")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("JIT error log")));
  const std::string garbage(4096, '\x7f');
  EXPECT_THAT(context().LoadModule(Bytes(garbage)), StatusIs(absl::StatusCode::kInvalidArgument));
  const std::string& cubin = kernels().cubin;
  EXPECT_THAT(context().LoadModule(Bytes(absl::string_view(cubin).substr(0, 200))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  const std::string& fatbin = kernels().fatbin;
  EXPECT_THAT(context().LoadModule(Bytes(absl::string_view(fatbin).substr(0, 1000))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  // Still usable.
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(16));
  EXPECT_OK(context().Free(buffer));
  EXPECT_OK(context().Synchronize());
}

TEST_F(CudaBackendTest, PtxModuleReportsFunctionsAndGlobals) {
  // With and without the trailing NUL (the backend adds one when missing).
  const std::string with_nul = kernels().ptx + '\0';
  ASSERT_OK(context().LoadModule(Bytes(with_nul)).status());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());

  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  EXPECT_THAT(add_one->params(), ::testing::ElementsAre(ParamIs(0, 8), ParamIs(8, 8)));
  const FunctionAttributes& attributes = add_one->attributes();
  EXPECT_GT(attributes.num_regs, 0);
  EXPECT_GT(attributes.max_threads_per_block, 0);
  EXPECT_EQ(attributes.ptx_version, 75);
  EXPECT_EQ(attributes.binary_version, context().device().compute_capability_major * 10 +
                                           context().device().compute_capability_minor);
  EXPECT_EQ(attributes.shared_size_bytes, 0);
  EXPECT_GE(attributes.max_dynamic_shared_size_bytes, 0);
  ASSERT_OK_AND_ASSIGN(Function * again, module->GetFunction("add_one"));
  EXPECT_EQ(again, add_one);

  ASSERT_OK_AND_ASSIGN(Function * noop, module->GetFunction("noop"));
  EXPECT_THAT(noop->params(), SizeIs(0));
  ASSERT_OK_AND_ASSIGN(Function * shared, module->GetFunction("shared_roundtrip"));
  EXPECT_THAT(shared->params(), ::testing::ElementsAre(ParamIs(0, 8), ParamIs(8, 4)));

  EXPECT_THAT(module->GetFunction("no_such_kernel"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("no_such_kernel"), HasSubstr("CUDA_ERROR_NOT_FOUND"))));

  ASSERT_OK_AND_ASSIGN(Module::Global counter, module->GetGlobal("counter"));
  EXPECT_NE(counter.address, 0u);
  EXPECT_EQ(counter.size_bytes, 4u);
  EXPECT_THAT(module->GetGlobal("no_such_global"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no_such_global")));
}

TEST_F(CudaBackendTest, LaunchAddOne) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(false));
  const uint64_t n = (1 << 20) + 3;
  std::vector<float> values(n);
  for (uint64_t i = 0; i < n; ++i) values[i] = static_cast<float>(i % 1000) * 0.5f;
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(n * sizeof(float)));
  ASSERT_OK(context().Upload(buffer, values.data(), n * sizeof(float), stream.get()));
  const std::vector<uint8_t> args = PackArgs(*add_one, buffer, n);
  ASSERT_OK(context().Launch(add_one, Linear(n), args, stream.get()));
  ASSERT_OK(context().Launch(add_one, Linear(n), args, stream.get()));
  ASSERT_OK(context().SynchronizeStream(stream.get()));
  std::vector<float> back(n);
  ASSERT_OK(context().Download(back.data(), buffer, n * sizeof(float), stream.get()));
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < n; ++i) wrong += back[i] != values[i] + 2.0f;
  EXPECT_EQ(wrong, 0u);
  EXPECT_OK(context().Free(buffer));
}

TEST_F(CudaBackendTest, LaunchWithoutParametersAndWithAGlobal) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * noop, module->GetFunction("noop"));
  for (int i = 0; i < 100; ++i) ASSERT_OK(context().Launch(noop, LaunchConfig{}, {}, nullptr));
  ASSERT_OK_AND_ASSIGN(Function * bump, module->GetFunction("bump_counter"));
  ASSERT_OK_AND_ASSIGN(Module::Global counter, module->GetGlobal("counter"));
  ASSERT_OK(context().Memset(counter.address, 0, 4, 1, nullptr));
  LaunchConfig config;
  config.grid.x = 10;
  config.block.x = 32;
  ASSERT_OK(context().Launch(bump, config, {}, nullptr));
  uint32_t value = 0;
  ASSERT_OK(context().Download(&value, counter.address, sizeof(value), nullptr));
  EXPECT_EQ(value, 320u);
}

TEST_F(CudaBackendTest, LaunchRaisesTheDynamicSharedMemoryLimit) {
  const int optin = context().device().max_shared_memory_per_block_optin_bytes;
  if (optin < (100 << 10)) GTEST_SKIP() << "device allows only " << optin << " bytes";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * shared, module->GetFunction("shared_roundtrip"));
  EXPECT_LT(shared->attributes().max_dynamic_shared_size_bytes, 100 << 10);
  for (uint32_t words : {25600u, 1000u, 25600u}) {  // 100 KiB, then less, then again.
    SCOPED_TRACE(absl::StrCat(words, " words"));
    ASSERT_OK_AND_ASSIGN(DevicePtr out, context().Alloc(words * 4));
    LaunchConfig config;
    config.block.x = 256;
    config.shared_memory_bytes = words * 4;
    ASSERT_OK(context().Launch(shared, config, PackArgs(*shared, out, words), nullptr));
    std::vector<uint32_t> back(words);
    ASSERT_OK(context().Download(back.data(), out, words * 4, nullptr));
    uint32_t wrong = 0;
    for (uint32_t i = 0; i < words; ++i) wrong += back[i] != words - 1 - i;
    EXPECT_EQ(wrong, 0u);
    ASSERT_OK(context().Free(out));
  }
  LaunchConfig too_much;
  too_much.shared_memory_bytes = static_cast<uint32_t>(optin) + 1;
  const uint32_t words = 1;
  EXPECT_THAT(context().Launch(shared, too_much, PackArgs(*shared, DevicePtr{0}, words), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared_roundtrip")));
  EXPECT_OK(context().Synchronize());
}

TEST_F(CudaBackendTest, BadLaunchConfigurationIsInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  LaunchConfig config;
  config.block.x = 4096;
  EXPECT_THAT(
      context().Launch(add_one, config, PackArgs(*add_one, DevicePtr{0}, uint64_t{0}), nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("cuLaunchKernel"), HasSubstr("add_one"))));
  EXPECT_OK(context().Synchronize());
}

void ExpectAddOneWorks(Context& context, Module& module) {
  ASSERT_OK_AND_ASSIGN(Function * add_one, module.GetFunction("add_one"));
  EXPECT_EQ(add_one->attributes().binary_version, 90);
  const uint64_t n = 1000;
  const std::vector<float> values(n, 41.0f);
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context.Alloc(n * sizeof(float)));
  ASSERT_OK(context.Upload(buffer, values.data(), n * sizeof(float), nullptr));
  ASSERT_OK(context.Launch(add_one, Linear(n), PackArgs(*add_one, buffer, n), nullptr));
  std::vector<float> back(n);
  ASSERT_OK(context.Download(back.data(), buffer, n * sizeof(float), nullptr));
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](float v) { return v == 42.0f; }));
  EXPECT_OK(context.Free(buffer));
}

TEST_F(CudaBackendTest, LoadsCubinAndFatbinImages) {
  if (!IsSm90()) GTEST_SKIP() << "the test's cubin and fatbin are for sm_90";
  for (const std::string* binary : {&kernels().cubin, &kernels().fatbin}) {
    const std::string& image = *binary;
    {
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context().LoadModule(Bytes(image)));
      ExpectAddOneWorks(context(), *module);
    }
    // Misaligned by one byte: the backend copies it to an aligned buffer.
    const std::string shifted = "x" + image;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module,
                         context().LoadModule(Bytes(absl::string_view(shifted).substr(1))));
    ExpectAddOneWorks(context(), *module);
  }
}

TEST_F(CudaBackendTest, StreamsOrderWorkAndReportCompletion) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> a, context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> b, context().CreateStream(false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> written, context().CreateEvent(true, false));
  const std::vector<uint8_t> data = RandomBytes(20 << 20, 11);
  ASSERT_OK_AND_ASSIGN(DevicePtr src, context().Alloc(data.size()));
  ASSERT_OK_AND_ASSIGN(DevicePtr dst, context().Alloc(data.size()));
  ASSERT_OK(context().Upload(src, data.data(), data.size(), a.get()));
  ASSERT_OK(context().RecordEvent(written.get(), a.get()));
  ASSERT_OK(context().StreamWaitEvent(b.get(), written.get()));
  ASSERT_OK(context().CopyDeviceToDevice(dst, src, data.size(), b.get()));
  std::vector<uint8_t> back(data.size());
  ASSERT_OK(context().Download(back.data(), dst, back.size(), b.get()));
  EXPECT_TRUE(back == data);

  ASSERT_OK(context().SynchronizeStream(a.get()));
  EXPECT_THAT(context().QueryStream(a.get()), ::gpurpc::testing::IsOkAndHolds(true));
  EXPECT_OK(context().SynchronizeStream(nullptr));
  EXPECT_OK(context().Synchronize());
  EXPECT_THAT(context().QueryStream(nullptr), ::gpurpc::testing::IsOkAndHolds(true));
  EXPECT_THAT(context().QueryStream(b.get()), ::gpurpc::testing::IsOkAndHolds(true));
  EXPECT_OK(context().Free(src));
  EXPECT_OK(context().Free(dst));
}

TEST_F(CudaBackendTest, EventsMeasureElapsedTime) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, context().CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> end, context().CreateEvent(false, true));
  EXPECT_THAT(context().QueryEvent(end.get()), ::gpurpc::testing::IsOkAndHolds(true));
  const uint64_t n = uint64_t{64} << 20;
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(n * sizeof(float)));
  ASSERT_OK(context().Memset(buffer, 0, 4, n, stream.get()));
  ASSERT_OK(context().RecordEvent(start.get(), stream.get()));
  for (int i = 0; i < 20; ++i) {
    ASSERT_OK(context().Launch(add_one, Linear(n), PackArgs(*add_one, buffer, n), stream.get()));
  }
  ASSERT_OK(context().RecordEvent(end.get(), stream.get()));
  ASSERT_OK(context().SynchronizeEvent(end.get()));
  EXPECT_THAT(context().QueryEvent(end.get()), ::gpurpc::testing::IsOkAndHolds(true));
  ASSERT_OK_AND_ASSIGN(float milliseconds, context().ElapsedTime(start.get(), end.get()));
  std::cout << "20 add_one launches over " << n << " floats took " << milliseconds << " ms\n";
  EXPECT_GE(milliseconds, 0.0f);
  float first = 0;
  ASSERT_OK(context().Download(&first, buffer, sizeof(first), stream.get()));
  EXPECT_EQ(first, 20.0f);
  EXPECT_OK(context().Free(buffer));
}

TEST_F(CudaBackendTest, ElapsedTimeNeedsTimingAndRecordedEvents) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> untimed, context().CreateEvent(true, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> timed, context().CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> never_recorded, context().CreateEvent(false, false));
  ASSERT_OK(context().RecordEvent(untimed.get(), nullptr));
  ASSERT_OK(context().RecordEvent(timed.get(), nullptr));
  ASSERT_OK(context().Synchronize());
  EXPECT_THAT(context().ElapsedTime(untimed.get(), timed.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("timing")));
  EXPECT_THAT(context().ElapsedTime(timed.get(), never_recorded.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("recorded")));
  EXPECT_THAT(context().QueryEvent(never_recorded.get()), ::gpurpc::testing::IsOkAndHolds(true));
  EXPECT_OK(context().SynchronizeEvent(never_recorded.get()));
  ASSERT_OK_AND_ASSIGN(float zero, context().ElapsedTime(timed.get(), timed.get()));
  EXPECT_EQ(zero, 0.0f);
}

// backend.h: destroying a stream releases it after its queued work; a module (and events)
// may be destroyed with launches of it still queued.
TEST_F(CudaBackendTest, DestroyingObjectsWithQueuedWorkIsSafe) {
  const uint64_t n = uint64_t{16} << 20;
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(n * sizeof(float)));
  ASSERT_OK(context().Memset(buffer, 0, 4, n, nullptr));
  ASSERT_OK(context().Synchronize());
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
    ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(true));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> event, context().CreateEvent(false, false));
    for (int i = 0; i < 50; ++i) {
      ASSERT_OK(context().Launch(add_one, Linear(n), PackArgs(*add_one, buffer, n), stream.get()));
    }
    ASSERT_OK(context().RecordEvent(event.get(), stream.get()));
    event.reset();
    stream.reset();
    module.reset();
  }
  ASSERT_OK(context().Synchronize());
  std::vector<float> back(n);
  ASSERT_OK(context().Download(back.data(), buffer, n * sizeof(float), nullptr));
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](float v) { return v == 50.0f; }));
  EXPECT_OK(context().Free(buffer));
}

TEST_F(CudaBackendTest, ConcurrentUseFromManyThreads) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  constexpr int kThreads = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto check = [&](const absl::Status& status) {
        if (!status.ok()) {
          ++failures;
          ADD_FAILURE() << "thread " << t << ": " << status;
        }
        return status.ok();
      };
      absl::StatusOr<std::unique_ptr<Stream>> stream = context().CreateStream(t % 2 == 0);
      if (!check(stream.status())) return;
      for (int round = 0; round < 10; ++round) {
        const uint64_t size = round % 2 == 0 ? 1000 + t : (9 << 20) + t;
        const std::vector<uint8_t> data = RandomBytes(size, t * 100 + round);
        absl::StatusOr<DevicePtr> buffer = context().Alloc(size);
        if (!check(buffer.status())) return;
        if (!check(context().Upload(*buffer, data.data(), size, stream->get()))) return;
        std::vector<uint8_t> back(size);
        if (!check(context().Download(back.data(), *buffer, size, stream->get()))) return;
        if (back != data) {
          ++failures;
          ADD_FAILURE() << "thread " << t << " round " << round << ": data differs";
        }
        const uint64_t floats = size / sizeof(float);
        if (!check(context().Launch(add_one, Linear(floats), PackArgs(*add_one, *buffer, floats),
                                    stream->get()))) {
          return;
        }
        if (!check(context().SynchronizeStream(stream->get()))) return;
        if (!check(context().Free(*buffer))) return;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

// Not a timed assertion (DESIGN §6): prints the launch rate for the GPU run's log.
TEST_F(CudaBackendTest, ManyLaunchesSucceed) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, LoadKernels());
  ASSERT_OK_AND_ASSIGN(Function * noop, module->GetFunction("noop"));
  ASSERT_OK_AND_ASSIGN(Function * add_one, module->GetFunction("add_one"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(DevicePtr buffer, context().Alloc(4));
  const std::vector<uint8_t> args = PackArgs(*add_one, buffer, uint64_t{1});
  constexpr int kLaunches = 100000;
  for (Function* function : {noop, add_one}) {
    const absl::Span<const uint8_t> packed =
        function == noop ? absl::Span<const uint8_t>() : absl::MakeConstSpan(args);
    const auto begin = std::chrono::steady_clock::now();
    for (int i = 0; i < kLaunches; ++i) {
      const absl::Status status = context().Launch(function, LaunchConfig{}, packed, stream.get());
      if (!status.ok()) {
        ADD_FAILURE() << status;
        break;
      }
    }
    const auto enqueued = std::chrono::steady_clock::now();
    ASSERT_OK(context().SynchronizeStream(stream.get()));
    const auto done = std::chrono::steady_clock::now();
    const double enqueue_s = std::chrono::duration<double>(enqueued - begin).count();
    const double total_s = std::chrono::duration<double>(done - begin).count();
    std::cout << (function == noop ? "noop" : "add_one") << ": " << kLaunches
              << " launches enqueued at " << kLaunches / enqueue_s << "/s, completed at "
              << kLaunches / total_s << "/s\n";
  }
  float value = 0;
  ASSERT_OK(context().Download(&value, buffer, sizeof(value), stream.get()));
  EXPECT_GT(value, 0.0f);
  EXPECT_OK(context().Free(buffer));
}

// Runs in a child process (the fault poisons the whole process). Returns the exit code:
// 0 when every step behaved, after printing what happened to stderr.
int FaultAndReport(Context& context, absl::string_view kernels_ptx) {
  absl::StatusOr<std::unique_ptr<Module>> module = context.LoadModule(Bytes(kernels_ptx));
  if (!module.ok()) {
    std::fprintf(stderr, "LoadModule: %s\n", module.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<Function*> store_to = (*module)->GetFunction("store_to");
  if (!store_to.ok()) return 3;
  absl::StatusOr<std::unique_ptr<Stream>> stream = context.CreateStream(true);
  if (!stream.ok()) return 4;
  const DevicePtr bad = 0x10;
  absl::Status status =
      context.Launch(*store_to, LaunchConfig{}, PackArgs(**store_to, bad), stream->get());
  if (status.ok()) status = context.Synchronize();
  std::fprintf(stderr, "fault: %s\n", status.ToString().c_str());
  if (status.code() != absl::StatusCode::kAborted) return 5;
  const absl::StatusOr<DevicePtr> after = context.Alloc(16);
  std::fprintf(stderr, "after: %s\n", after.status().ToString().c_str());
  if (after.status().code() != absl::StatusCode::kAborted) return 6;
  // Destroying objects of a poisoned context must neither crash nor hang.
  stream->reset();
  module->reset();
  return 0;
}

using CudaBackendDeathTest = CudaBackendTest;

TEST_F(CudaBackendDeathTest, IllegalAddressIsAbortedAndPoisonsTheContext) {
  // "threadsafe" re-executes the test binary for the child: never fork after CUDA init.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int code = FaultAndReport(*context_, kernels().ptx);
        context_.reset();
        backend_.reset();
        std::fflush(stderr);
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "CUDA_ERROR_ILLEGAL_ADDRESS");
}

}  // namespace
}  // namespace gpurpc::backend
