// The fake backend against the contract in server/worker/backend/backend.h and the fake's own
// promises: bounds-checked host memory, the built-in host kernels, asynchronous streams with
// CUDA's ordering (a thread per stream, the legacy stream's implicit synchronization, events),
// sticky faults that surface at the next call, module images checked as the CUDA backend and
// its driver check them (hand-built and from the real NVRTC, which needs no GPU), and module
// globals read from PTX.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/pack_args.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::kFakeKernelsPtx;
using ::gpurpc::testing::kFakeKernelsSource;
using ::gpurpc::testing::PackArgs;
using ::gpurpc::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::Ge;
using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::SizeIs;

constexpr uint64_t kTotalMemoryBytes = uint64_t{256} << 20;
constexpr DevicePtr kFirstAddress = 0x100000000000;
constexpr uint64_t kGapBytes = uint64_t{1} << 20;
constexpr char kIllegalAddress[] =
    "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)";

absl::Span<const uint8_t> AsBytes(absl::string_view text) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

std::string Hex(DevicePtr ptr) { return absl::StrFormat("0x%x", ptr); }

LaunchConfig Linear(uint32_t threads) {
  LaunchConfig config;
  config.block.x = threads;
  return config;
}

class FakeBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeFakeBackend(kTotalMemoryBytes);
    ASSERT_OK_AND_ASSIGN(context_, backend_->OpenContext(0));
    ASSERT_OK_AND_ASSIGN(module_, context_->LoadModule(AsBytes(kFakeKernelsPtx)));
  }

  DevicePtr Alloc(uint64_t size_bytes) {
    absl::StatusOr<DevicePtr> ptr = context_->Alloc(size_bytes);
    EXPECT_THAT(ptr, IsOk());
    return ptr.value_or(0);
  }

  template <typename T>
  DevicePtr AllocWith(const std::vector<T>& values) {
    const DevicePtr ptr = Alloc(values.size() * sizeof(T));
    EXPECT_THAT(context_->Upload(ptr, values.data(), values.size() * sizeof(T), nullptr), IsOk());
    return ptr;
  }

  template <typename T>
  std::vector<T> DownloadAs(DevicePtr ptr, size_t count) {
    std::vector<T> values(count);
    EXPECT_THAT(context_->Download(values.data(), ptr, count * sizeof(T), nullptr), IsOk());
    return values;
  }

  Function* Kernel(const std::string& name) {
    absl::StatusOr<Function*> function = module_->GetFunction(name);
    EXPECT_THAT(function, IsOk());
    return function.value_or(nullptr);
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Context> context_;
  std::unique_ptr<Module> module_;
};

// --- Device description -------------------------------------------------------------------

TEST(FakeBackendDeviceTest, DescribesOneFakeDevice) {
  std::unique_ptr<Backend> backend = MakeFakeBackend(kTotalMemoryBytes);
  EXPECT_EQ(backend->name(), "fake");
  EXPECT_EQ(backend->driver_version(), 0);
  ASSERT_OK_AND_ASSIGN(std::vector<DeviceInfo> devices, backend->ListDevices());
  ASSERT_THAT(devices, SizeIs(1));
  const DeviceInfo& device = devices[0];
  EXPECT_EQ(device.ordinal, 0);
  EXPECT_EQ(device.name, "gpurpc fake device (host memory, not a GPU)");
  EXPECT_TRUE(device.is_fake);
  EXPECT_EQ(device.compute_capability_major, 0);
  EXPECT_EQ(device.compute_capability_minor, 0);
  EXPECT_EQ(device.total_memory_bytes, kTotalMemoryBytes);
  EXPECT_EQ(device.multiprocessor_count, 4);
  EXPECT_EQ(device.max_threads_per_block, 1024);
  EXPECT_THAT(device.max_block_dim, ElementsAre(1024, 1024, 64));
  EXPECT_THAT(device.max_grid_dim, ElementsAre(2147483647, 65535, 65535));
  EXPECT_EQ(device.max_shared_memory_per_block_bytes, 49152);
  EXPECT_EQ(device.max_shared_memory_per_block_optin_bytes, 232448);
  EXPECT_EQ(device.warp_size, 32);
  EXPECT_EQ(device.pci_bus_id, "");
}

TEST(FakeBackendDeviceTest, AttributesAreKeyedByCudaEnumValues) {
  ASSERT_OK_AND_ASSIGN(std::vector<DeviceInfo> devices,
                       MakeFakeBackend(kTotalMemoryBytes)->ListDevices());
  ASSERT_THAT(devices, SizeIs(1));
  const std::map<int, int64_t> expected = {
      {1, 1024},  {2, 1024},  {3, 1024}, {4, 64}, {5, 2147483647}, {6, 65535}, {7, 65535},
      {8, 49152}, {9, 65536}, {10, 32},  {16, 4}, {75, 0},         {76, 0},    {97, 232448}};
  EXPECT_EQ(devices[0].attributes, expected);
}

TEST(FakeBackendDeviceTest, OpenContextOfAnotherOrdinalIsNotFound) {
  std::unique_ptr<Backend> backend = MakeFakeBackend(kTotalMemoryBytes);
  EXPECT_THAT(backend->OpenContext(1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(backend->OpenContext(-1), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(FakeBackendTest, ContextDescribesItsDeviceAndCompilesToPtx) {
  EXPECT_TRUE(context_->device().is_fake);
  EXPECT_EQ(context_->device().name, "gpurpc fake device (host memory, not a GPU)");
  EXPECT_EQ(context_->device().total_memory_bytes, kTotalMemoryBytes);
  EXPECT_EQ(context_->CompileTarget(), "compute_75");
}

// --- Memory -------------------------------------------------------------------------------

TEST_F(FakeBackendTest, AllocationsAreAlignedAndSeparatedByAGap) {
  const DevicePtr a = Alloc(1000);
  const DevicePtr b = Alloc(1000);
  const DevicePtr c = Alloc(1);
  EXPECT_GE(a, kFirstAddress);
  for (const DevicePtr ptr : {a, b, c}) EXPECT_EQ(ptr % 256, 0u) << Hex(ptr);
  EXPECT_GE(b, a + 1000 + kGapBytes);
  EXPECT_GE(c, b + 1000 + kGapBytes);
}

TEST_F(FakeBackendTest, NewAllocationsAreZeroed) {
  const DevicePtr ptr = Alloc(4096);
  EXPECT_THAT(DownloadAs<uint8_t>(ptr, 4096), Each(0));
}

TEST_F(FakeBackendTest, UploadAndDownloadRoundTripAtOffsets) {
  const DevicePtr ptr = Alloc(64);
  const std::string text = "hello";
  ASSERT_THAT(context_->Upload(ptr + 10, text.data(), text.size(), nullptr), IsOk());
  std::string back(text.size(), '\0');
  ASSERT_THAT(context_->Download(back.data(), ptr + 10, back.size(), nullptr), IsOk());
  EXPECT_EQ(back, text);
  const std::vector<uint8_t> all = DownloadAs<uint8_t>(ptr, 64);
  EXPECT_EQ(all[9], 0);
  EXPECT_EQ(all[10], 'h');
  EXPECT_EQ(all[14], 'o');
  EXPECT_EQ(all[15], 0);
}

TEST_F(FakeBackendTest, UploadPastTheEndIsRejectedAndWritesNothing) {
  const DevicePtr ptr = Alloc(16);
  const std::vector<uint8_t> bytes(8, 0xff);
  EXPECT_THAT(context_->Upload(ptr + 12, bytes.data(), bytes.size(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(Hex(ptr + 12)), HasSubstr("8 bytes"))));
  EXPECT_THAT(DownloadAs<uint8_t>(ptr, 16), Each(0));
}

TEST_F(FakeBackendTest, RawAccessOutsideOneLiveAllocationIsInvalidArgument) {
  const DevicePtr a = Alloc(256);
  const DevicePtr b = Alloc(256);
  std::vector<uint8_t> host(512);
  // Past the end, into the gap, below the first address, and spanning two buffers.
  EXPECT_THAT(context_->Download(host.data(), a + 200, 100, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Download(host.data(), a + 256, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Download(host.data(), kFirstAddress - 1, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Download(host.data(), a, b + 256 - a, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Memset(a + 128, 0, 4, 33, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->CopyDeviceToDevice(b, a + 1, 256, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->CopyDeviceToDevice(b + 1, a, 256, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(FakeBackendTest, AccessToAFreedBufferIsInvalidArgument) {
  const DevicePtr ptr = Alloc(64);
  ASSERT_THAT(context_->Free(ptr), IsOk());
  uint8_t byte = 0;
  EXPECT_THAT(context_->Download(&byte, ptr, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(Hex(ptr))));
}

TEST_F(FakeBackendTest, FreedAddressesAreNotHandedOutAgain) {
  const DevicePtr first = Alloc(64);
  ASSERT_THAT(context_->Free(first), IsOk());
  EXPECT_NE(Alloc(64), first);
}

TEST_F(FakeBackendTest, AllocBeyondFreeMemoryIsResourceExhaustedAndContextStillWorks) {
  const DevicePtr held = Alloc(kTotalMemoryBytes / 2);
  EXPECT_THAT(context_->Alloc(kTotalMemoryBytes),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr(absl::StrFormat(
                           "fake device out of memory: asked for %d bytes, %d of "
                           "%d free",
                           kTotalMemoryBytes, kTotalMemoryBytes / 2, kTotalMemoryBytes))));
  const DevicePtr small = AllocWith<uint32_t>({7, 8, 9});
  EXPECT_THAT(DownloadAs<uint32_t>(small, 3), ElementsAre(7, 8, 9));
  EXPECT_THAT(context_->Free(held), IsOk());
  EXPECT_THAT(context_->Alloc(kTotalMemoryBytes / 2), IsOk());
}

TEST_F(FakeBackendTest, AllocOfZeroBytesIsInvalidArgument) {
  EXPECT_THAT(context_->Alloc(0), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(FakeBackendTest, MemInfoTracksAllocationsAndFrees) {
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(AllOf(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes),
                                 ::testing::Field(&MemInfo::total_bytes, kTotalMemoryBytes))));
  const DevicePtr ptr = Alloc(1000);
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes - 1000)));
  ASSERT_THAT(context_->Free(ptr), IsOk());
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes)));
}

TEST_F(FakeBackendTest, FreeOfAnUnknownAddressIsInvalidArgument) {
  const DevicePtr ptr = Alloc(64);
  // As cuMemFree's CUDA_ERROR_INVALID_VALUE (backend.h): an address is not a name.
  EXPECT_THAT(context_->Free(ptr + 8), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Free(12345), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(context_->Free(ptr), IsOk());
  EXPECT_THAT(context_->Free(ptr), StatusIs(absl::StatusCode::kInvalidArgument,
                                            AllOf(HasSubstr("cuMemFree: CUDA_ERROR_INVALID_VALUE"),
                                                  HasSubstr(Hex(ptr)))));
}

TEST(FakeBackendLargeMemoryTest, MultiGibibyteAllocationsAreZeroedLazily) {
  constexpr uint64_t kBig = uint64_t{3} << 30;
  std::unique_ptr<Backend> backend = MakeFakeBackend(uint64_t{8} << 30);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> context, backend->OpenContext(0));
  ASSERT_OK_AND_ASSIGN(const DevicePtr medium, context->Alloc(uint64_t{64} << 20));
  ASSERT_OK_AND_ASSIGN(const DevicePtr big, context->Alloc(kBig));
  const uint64_t marker = 0x0123456789abcdef;
  ASSERT_THAT(context->Upload(big + kBig - sizeof(marker), &marker, sizeof(marker), nullptr),
              IsOk());
  uint64_t back = 0;
  ASSERT_THAT(context->Download(&back, big + kBig - sizeof(marker), sizeof(back), nullptr), IsOk());
  EXPECT_EQ(back, marker);
  ASSERT_THAT(context->Download(&back, big + kBig / 2, sizeof(back), nullptr), IsOk());
  EXPECT_EQ(back, 0u);
  ASSERT_THAT(context->Download(&back, medium + (uint64_t{64} << 20) - 8, 8, nullptr), IsOk());
  EXPECT_EQ(back, 0u);
}

TEST_F(FakeBackendTest, Memset8WritesTheLowByte) {
  const DevicePtr ptr = Alloc(8);
  ASSERT_THAT(context_->Memset(ptr + 2, 0x123456ab, 1, 4, nullptr), IsOk());
  EXPECT_THAT(DownloadAs<uint8_t>(ptr, 8), ElementsAre(0, 0, 0xab, 0xab, 0xab, 0xab, 0, 0));
}

TEST_F(FakeBackendTest, Memset16WritesTheLowHalfWord) {
  const DevicePtr ptr = Alloc(12);
  ASSERT_THAT(context_->Memset(ptr + 2, 0xbeef1234, 2, 3, nullptr), IsOk());
  EXPECT_THAT(DownloadAs<uint16_t>(ptr, 6), ElementsAre(0, 0x1234, 0x1234, 0x1234, 0, 0));
}

TEST_F(FakeBackendTest, Memset32WritesTheWholeValue) {
  const DevicePtr ptr = Alloc(20);
  ASSERT_THAT(context_->Memset(ptr + 4, 0xdeadbeef, 4, 3, nullptr), IsOk());
  EXPECT_THAT(DownloadAs<uint32_t>(ptr, 5), ElementsAre(0, 0xdeadbeef, 0xdeadbeef, 0xdeadbeef, 0));
}

TEST_F(FakeBackendTest, MemsetRejectsOtherElementSizesAndMisalignedAddresses) {
  const DevicePtr ptr = Alloc(64);
  EXPECT_THAT(context_->Memset(ptr, 0, 8, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Memset(ptr + 2, 0, 4, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DownloadAs<uint8_t>(ptr, 64), Each(0));
}

TEST_F(FakeBackendTest, CopyDeviceToDeviceCopiesTheRange) {
  const DevicePtr src = AllocWith<uint8_t>({1, 2, 3, 4, 5, 6, 7, 8});
  const DevicePtr dst = Alloc(8);
  ASSERT_THAT(context_->CopyDeviceToDevice(dst + 2, src + 4, 4, nullptr), IsOk());
  EXPECT_THAT(DownloadAs<uint8_t>(dst, 8), ElementsAre(0, 0, 5, 6, 7, 8, 0, 0));
}

// --- Kernels ------------------------------------------------------------------------------

TEST_F(FakeBackendTest, KernelsHaveTheParameterLayoutOfTheirCSignature) {
  const auto layout = [&](const std::string& name) {
    std::vector<std::pair<uint32_t, uint32_t>> out;
    for (const ParamInfo& p : Kernel(name)->params())
      out.emplace_back(p.offset_bytes, p.size_bytes);
    return out;
  };
  EXPECT_THAT(layout("multiply_them"), ElementsAre(Pair(0, 8), Pair(8, 8), Pair(16, 8)));
  EXPECT_THAT(layout("axpy_f32"), ElementsAre(Pair(0, 4), Pair(8, 8), Pair(16, 8), Pair(24, 8)));
  EXPECT_THAT(layout("fill_u32"), ElementsAre(Pair(0, 8), Pair(8, 4), Pair(16, 8)));
  EXPECT_THAT(layout("add_one_f32"), ElementsAre(Pair(0, 8), Pair(8, 8)));
  EXPECT_THAT(layout("copy_bytes"), ElementsAre(Pair(0, 8), Pair(8, 8), Pair(16, 8)));
  EXPECT_THAT(layout("fault_illegal_address"), ElementsAre());
  EXPECT_THAT(layout("spin_us"), ElementsAre(Pair(0, 8)));
}

TEST_F(FakeBackendTest, KernelAttributesAllowFullBlocks) {
  const FunctionAttributes& attributes = Kernel("multiply_them")->attributes();
  EXPECT_EQ(attributes.max_threads_per_block, 1024);
  EXPECT_EQ(attributes.num_regs, 0);
  EXPECT_EQ(attributes.shared_size_bytes, 0);
  EXPECT_EQ(attributes.max_dynamic_shared_size_bytes, 0);
}

TEST_F(FakeBackendTest, UnknownKernelIsNotFoundAndListsTheBuiltIns) {
  EXPECT_THAT(module_->GetFunction("saxpy"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("CUDA_ERROR_NOT_FOUND"),
                             HasSubstr("the module defines no kernel 'saxpy'"),
                             HasSubstr("built-in host kernels (multiply_them, axpy_f32, fill_u32, "
                                       "add_one_f32, copy_bytes, fault_illegal_address, "
                                       "spin_us, print_i32)"))));
}

TEST_F(FakeBackendTest, MultiplyThemMultipliesElementwise) {
  std::vector<float> a(64), b(64), expected(64);
  for (int i = 0; i < 64; ++i) {
    a[i] = static_cast<float>(i);
    b[i] = 0.5f * static_cast<float>(i);
    expected[i] = a[i] * b[i];
  }
  const DevicePtr a_dev = AllocWith(a);
  const DevicePtr b_dev = AllocWith(b);
  const DevicePtr dest = Alloc(64 * sizeof(float));
  Function* kernel = Kernel("multiply_them");
  LaunchConfig config;
  config.grid.x = 2;
  config.block.x = 32;
  ASSERT_THAT(context_->Launch(kernel, config, PackArgs(*kernel, dest, a_dev, b_dev), nullptr),
              IsOk());
  EXPECT_THAT(DownloadAs<float>(dest, 64), ElementsAreArray(expected));
}

TEST_F(FakeBackendTest, AxpyComputesAXPlusYForTheFirstNElements) {
  const DevicePtr x = AllocWith<float>({1, 2, 3, 4});
  const DevicePtr y = AllocWith<float>({10, 20, 30, 40});
  Function* kernel = Kernel("axpy_f32");
  ASSERT_THAT(
      context_->Launch(kernel, Linear(32), PackArgs(*kernel, 2.0f, x, y, uint64_t{3}), nullptr),
      IsOk());
  EXPECT_THAT(DownloadAs<float>(y, 4), ElementsAre(12, 24, 36, 40));
}

TEST_F(FakeBackendTest, FillU32WritesTheValueToTheFirstNElements) {
  const DevicePtr out = Alloc(8 * sizeof(uint32_t));
  Function* kernel = Kernel("fill_u32");
  ASSERT_THAT(context_->Launch(kernel, Linear(32),
                               PackArgs(*kernel, out, uint32_t{0xcafe}, uint64_t{5}), nullptr),
              IsOk());
  EXPECT_THAT(DownloadAs<uint32_t>(out, 8),
              ElementsAre(0xcafe, 0xcafe, 0xcafe, 0xcafe, 0xcafe, 0, 0, 0));
}

TEST_F(FakeBackendTest, KernelsProcessOnlyElementsBelowTheThreadCount) {
  const DevicePtr out = Alloc(64 * sizeof(uint32_t));
  Function* kernel = Kernel("fill_u32");
  LaunchConfig config;  // 2*2*1 blocks of 2*1*2 threads: 16 threads over every dimension
  config.grid = {2, 2, 1};
  config.block = {2, 1, 2};
  ASSERT_THAT(
      context_->Launch(kernel, config, PackArgs(*kernel, out, uint32_t{1}, uint64_t{64}), nullptr),
      IsOk());
  const std::vector<uint32_t> values = DownloadAs<uint32_t>(out, 64);
  EXPECT_THAT(std::vector<uint32_t>(values.begin(), values.begin() + 16), Each(1));
  EXPECT_THAT(std::vector<uint32_t>(values.begin() + 16, values.end()), Each(0));
}

TEST_F(FakeBackendTest, AddOneIncrementsEachElement) {
  const DevicePtr data = AllocWith<float>({1.5f, -1, 0});
  Function* kernel = Kernel("add_one_f32");
  ASSERT_THAT(context_->Launch(kernel, Linear(3), PackArgs(*kernel, data, uint64_t{3}), nullptr),
              IsOk());
  EXPECT_THAT(DownloadAs<float>(data, 3), ElementsAre(2.5f, 0, 1));
}

TEST_F(FakeBackendTest, CopyBytesCopiesNBytes) {
  const DevicePtr src = AllocWith<uint8_t>({9, 8, 7, 6, 5});
  const DevicePtr dst = Alloc(5);
  Function* kernel = Kernel("copy_bytes");
  ASSERT_THAT(
      context_->Launch(kernel, Linear(64), PackArgs(*kernel, dst, src, uint64_t{4}), nullptr),
      IsOk());
  EXPECT_THAT(DownloadAs<uint8_t>(dst, 5), ElementsAre(9, 8, 7, 6, 0));
}

TEST_F(FakeBackendTest, KernelsFollowPointerArithmeticIntoABuffer) {
  const DevicePtr base = Alloc(8 * sizeof(uint32_t));
  Function* kernel = Kernel("fill_u32");
  ASSERT_THAT(
      context_->Launch(kernel, Linear(32),
                       PackArgs(*kernel, base + 4 * sizeof(uint32_t), uint32_t{3}, uint64_t{4}),
                       nullptr),
      IsOk());
  EXPECT_THAT(DownloadAs<uint32_t>(base, 8), ElementsAre(0, 0, 0, 0, 3, 3, 3, 3));
}

TEST_F(FakeBackendTest, SpinUsRunsForTheRequestedTime) {
  Function* kernel = Kernel("spin_us");
  const auto start = std::chrono::steady_clock::now();
  ASSERT_THAT(context_->Launch(kernel, Linear(1), PackArgs(*kernel, uint64_t{20000}), nullptr),
              IsOk());
  ASSERT_THAT(context_->Synchronize(), IsOk());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20));
}

TEST_F(FakeBackendTest, SynchronizeWaitsForAKernelSpinningOnAnotherThread) {
  Function* kernel = Kernel("spin_us");
  const std::vector<uint8_t> args = PackArgs(*kernel, uint64_t{200000});
  const auto start = std::chrono::steady_clock::now();
  std::thread launcher(
      [&] { EXPECT_THAT(context_->Launch(kernel, Linear(1), args, nullptr), IsOk()); });
  // Wait until the kernel is visibly running, then synchronise from this thread.
  bool running = false;
  while (!running && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
    absl::StatusOr<bool> idle = context_->QueryStream(nullptr);
    EXPECT_THAT(idle, IsOk());
    if (!idle.ok()) break;
    running = !*idle;
  }
  EXPECT_TRUE(running);
  EXPECT_THAT(context_->Synchronize(), IsOk());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(true));
  launcher.join();
}

TEST_F(FakeBackendTest, LaunchRejectsPackedArgumentsOfTheWrongSize) {
  const DevicePtr data = Alloc(16);
  Function* kernel = Kernel("add_one_f32");
  std::vector<uint8_t> args = PackArgs(*kernel, data, uint64_t{4});
  args.pop_back();
  EXPECT_THAT(context_->Launch(kernel, Linear(4), args, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("add_one_f32")));
  EXPECT_THAT(context_->Synchronize(), IsOk());
}

TEST_F(FakeBackendTest, LaunchRejectsConfigurationsBeyondTheDeviceLimits) {
  Function* kernel = Kernel("spin_us");
  const std::vector<uint8_t> args = PackArgs(*kernel, uint64_t{0});
  LaunchConfig too_wide = Linear(1025);
  LaunchConfig too_many_threads;
  too_many_threads.block = {32, 32, 2};
  LaunchConfig empty_grid;
  empty_grid.grid.x = 0;
  LaunchConfig tall_grid;
  tall_grid.grid.y = 65536;
  LaunchConfig too_much_shared;
  too_much_shared.shared_memory_bytes = 49153;
  for (const LaunchConfig& config :
       {too_wide, too_many_threads, empty_grid, tall_grid, too_much_shared}) {
    EXPECT_THAT(context_->Launch(kernel, config, args, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST_F(FakeBackendTest, LaunchRejectsAFunctionOfAnotherContext) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> other, backend_->OpenContext(0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> other_module,
                       other->LoadModule(AsBytes(kFakeKernelsPtx)));
  ASSERT_OK_AND_ASSIGN(Function * foreign, other_module->GetFunction("fault_illegal_address"));
  EXPECT_THAT(context_->Launch(foreign, Linear(1), {}, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Launch(nullptr, Linear(1), {}, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->Synchronize(), IsOk());
}

// --- Sticky faults --------------------------------------------------------------------------

TEST_F(FakeBackendTest, FaultPoisonsEveryLaterCallOnTheContext) {
  const DevicePtr ptr = Alloc(64);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context_->CreateStream(false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, context_->CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> end, context_->CreateEvent(false, false));
  ASSERT_THAT(context_->RecordEvent(start.get(), nullptr), IsOk());
  ASSERT_THAT(context_->RecordEvent(end.get(), nullptr), IsOk());
  Function* fault = Kernel("fault_illegal_address");
  Function* add_one = Kernel("add_one_f32");

  // The fault surfaces later, as it does asynchronously on a GPU.
  EXPECT_THAT(context_->Launch(fault, Linear(1), {}, stream.get()), IsOk());

  const std::string fault_text =
      absl::StrCat(kIllegalAddress, " in fake kernel 'fault_illegal_address'");
  EXPECT_THAT(context_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted, "cuCtxSynchronize: " + fault_text));
  EXPECT_THAT(context_->SynchronizeStream(stream.get()),
              StatusIs(absl::StatusCode::kAborted, "cuStreamSynchronize: " + fault_text));
  const auto aborted = StatusIs(absl::StatusCode::kAborted, HasSubstr(fault_text));
  uint8_t host[8] = {};
  EXPECT_THAT(context_->Download(host, ptr, 8, nullptr), aborted);
  EXPECT_THAT(context_->Upload(ptr, host, 8, nullptr), aborted);
  EXPECT_THAT(context_->Memset(ptr, 0, 1, 8, nullptr), aborted);
  EXPECT_THAT(context_->CopyDeviceToDevice(ptr, ptr + 8, 8, nullptr), aborted);
  EXPECT_THAT(context_->Alloc(64), aborted);
  EXPECT_THAT(context_->Free(ptr), aborted);
  EXPECT_THAT(context_->GetMemInfo(), aborted);
  EXPECT_THAT(context_->Launch(add_one, Linear(1), PackArgs(*add_one, ptr, uint64_t{1}), nullptr),
              aborted);
  EXPECT_THAT(context_->LoadModule(AsBytes(kFakeKernelsPtx)), aborted);
  EXPECT_THAT(module_->GetFunction("add_one_f32"), aborted);
  EXPECT_THAT(module_->GetGlobal("anything"), aborted);
  EXPECT_THAT(context_->CreateStream(true), aborted);
  EXPECT_THAT(context_->QueryStream(stream.get()), aborted);
  EXPECT_THAT(context_->StreamWaitEvent(stream.get(), start.get()), aborted);
  EXPECT_THAT(context_->CreateEvent(false, false), aborted);
  EXPECT_THAT(context_->RecordEvent(start.get(), nullptr), aborted);
  EXPECT_THAT(context_->QueryEvent(start.get()), aborted);
  EXPECT_THAT(context_->SynchronizeEvent(start.get()), aborted);
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()), aborted);
}

TEST_F(FakeBackendTest, OutOfBoundsKernelAccessFaultsLikeAnIllegalAddress) {
  const DevicePtr data = AllocWith<float>(std::vector<float>(16, 1.0f));
  Function* kernel = Kernel("add_one_f32");
  EXPECT_THAT(context_->Launch(kernel, Linear(32), PackArgs(*kernel, data, uint64_t{17}), nullptr),
              IsOk());
  EXPECT_THAT(context_->Synchronize(), StatusIs(absl::StatusCode::kAborted,
                                                absl::StrCat("cuCtxSynchronize: ", kIllegalAddress,
                                                             " in fake kernel 'add_one_f32'")));
}

TEST_F(FakeBackendTest, KernelAccessThroughAFreedPointerFaults) {
  const DevicePtr src = Alloc(16);
  const DevicePtr dst = Alloc(16);
  ASSERT_THAT(context_->Free(src), IsOk());
  Function* kernel = Kernel("copy_bytes");
  EXPECT_THAT(
      context_->Launch(kernel, Linear(16), PackArgs(*kernel, dst, src, uint64_t{16}), nullptr),
      IsOk());
  EXPECT_THAT(context_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("in fake kernel 'copy_bytes'")));
}

TEST_F(FakeBackendTest, MisalignedKernelAccessFaults) {
  const DevicePtr data = Alloc(64);
  Function* kernel = Kernel("add_one_f32");
  EXPECT_THAT(
      context_->Launch(kernel, Linear(4), PackArgs(*kernel, data + 2, uint64_t{4}), nullptr),
      IsOk());
  EXPECT_THAT(context_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_MISALIGNED_ADDRESS")));
}

TEST_F(FakeBackendTest, AFaultInOneContextLeavesAnotherHealthy) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> other, backend_->OpenContext(0));
  ASSERT_THAT(context_->Launch(Kernel("fault_illegal_address"), Linear(1), {}, nullptr), IsOk());
  EXPECT_THAT(other->Synchronize(), IsOk());
}

// --- Streams and events -------------------------------------------------------------------

TEST_F(FakeBackendTest, WorkOnACreatedStreamRunsInOrder) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context_->CreateStream(true));
  const DevicePtr data = Alloc(2 * sizeof(float));
  const std::vector<float> values = {1, 2};
  Function* kernel = Kernel("add_one_f32");
  ASSERT_THAT(context_->Upload(data, values.data(), 2 * sizeof(float), stream.get()), IsOk());
  ASSERT_THAT(
      context_->Launch(kernel, Linear(2), PackArgs(*kernel, data, uint64_t{2}), stream.get()),
      IsOk());
  std::vector<float> back(2);
  ASSERT_THAT(context_->Download(back.data(), data, 2 * sizeof(float), stream.get()), IsOk());
  EXPECT_THAT(back, ElementsAre(2, 3));
  EXPECT_THAT(context_->SynchronizeStream(stream.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(true));
}

TEST_F(FakeBackendTest, AStreamOfAnotherContextIsRejected) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> other, backend_->OpenContext(0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> foreign, other->CreateStream(false));
  const DevicePtr ptr = Alloc(4);
  const uint32_t value = 1;
  EXPECT_THAT(context_->Upload(ptr, &value, sizeof(value), foreign.get()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(context_->SynchronizeStream(foreign.get()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(FakeBackendTest, ElapsedTimeMeasuresBetweenRecordedEvents) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, context_->CreateStream(false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, context_->CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> end, context_->CreateEvent(false, true));
  Function* spin = Kernel("spin_us");
  ASSERT_THAT(context_->RecordEvent(start.get(), stream.get()), IsOk());
  ASSERT_THAT(context_->Launch(spin, Linear(1), PackArgs(*spin, uint64_t{5000}), stream.get()),
              IsOk());
  ASSERT_THAT(context_->RecordEvent(end.get(), stream.get()), IsOk());
  ASSERT_THAT(context_->SynchronizeEvent(end.get()), IsOk());
  EXPECT_THAT(context_->QueryEvent(end.get()), IsOkAndHolds(true));
  EXPECT_THAT(context_->StreamWaitEvent(nullptr, end.get()), IsOk());
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()), IsOkAndHolds(Ge(5.0f)));
  EXPECT_THAT(context_->ElapsedTime(start.get(), start.get()), IsOkAndHolds(0.0f));
}

TEST_F(FakeBackendTest, ElapsedTimeOfAnEventWithoutTimingIsFailedPrecondition) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> timed, context_->CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> untimed, context_->CreateEvent(true, false));
  ASSERT_THAT(context_->RecordEvent(timed.get(), nullptr), IsOk());
  ASSERT_THAT(context_->RecordEvent(untimed.get(), nullptr), IsOk());
  EXPECT_THAT(context_->ElapsedTime(timed.get(), untimed.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(context_->ElapsedTime(untimed.get(), timed.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(FakeBackendTest, ElapsedTimeOfAnUnrecordedEventIsFailedPrecondition) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> recorded, context_->CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> never, context_->CreateEvent(false, false));
  ASSERT_THAT(context_->RecordEvent(recorded.get(), nullptr), IsOk());
  EXPECT_THAT(context_->QueryEvent(never.get()), IsOkAndHolds(true));
  EXPECT_THAT(
      context_->ElapsedTime(recorded.get(), never.get()),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("event has not been recorded")));
}

TEST_F(FakeBackendTest, AnEventOfAnotherContextIsRejected) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> other, backend_->OpenContext(0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> foreign, other->CreateEvent(false, false));
  EXPECT_THAT(context_->RecordEvent(foreign.get(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- Asynchronous streams -------------------------------------------------------------------
//
// Ordering checks, not benchmarks: a "gate" is a spin_us kernel long enough (a minute) that
// it is still running whenever the test looks, and the fixture's context destruction cuts it
// short at the end of the test. Shorter spins are waited for.

constexpr uint64_t kGateUs = 60'000'000;
constexpr uint64_t kShortSpinUs = 1'000'000;

class FakeAsyncTest : public FakeBackendTest {
 protected:
  void Spin(uint64_t microseconds, Stream* stream) {
    Function* spin = Kernel("spin_us");
    ASSERT_THAT(context_->Launch(spin, Linear(1), PackArgs(*spin, microseconds), stream), IsOk());
  }

  void Fill(DevicePtr ptr, uint32_t value, uint64_t count, Stream* stream) {
    ASSERT_THAT(context_->Memset(ptr, value, 4, count, stream), IsOk());
  }

  std::vector<uint32_t> DownloadOn(DevicePtr ptr, size_t count, Stream* stream) {
    std::vector<uint32_t> values(count);
    EXPECT_THAT(context_->Download(values.data(), ptr, count * sizeof(uint32_t), stream), IsOk());
    return values;
  }

  std::unique_ptr<Stream> NewStream(bool non_blocking) {
    absl::StatusOr<std::unique_ptr<Stream>> stream = context_->CreateStream(non_blocking);
    EXPECT_THAT(stream, IsOk());
    return stream.ok() ? *std::move(stream) : nullptr;
  }

  // Ends a test whose gate spins on a stream it created: destroys the context under the
  // still-open streams (as a dying worker would), which stops their threads at once; the
  // handles' later destruction then does nothing. Destroying the stream first would wait
  // for its gate, as cuStreamDestroy's release does.
  void AbandonContext() {
    module_.reset();
    context_.reset();
  }

  // Polls `query` until it answers true, for at most 30 seconds.
  template <typename Query>
  static bool Eventually(Query query) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      absl::StatusOr<bool> done = query();
      if (!done.ok()) {
        ADD_FAILURE() << done.status();
        return false;
      }
      if (*done) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
};

TEST_F(FakeAsyncTest, LaunchOfSpinUsReturnsOnceEnqueued) {
  Function* spin = Kernel("spin_us");
  const auto start = std::chrono::steady_clock::now();
  ASSERT_THAT(context_->Launch(spin, Linear(1), PackArgs(*spin, kGateUs), nullptr), IsOk());
  // A minute of spinning is queued; the call came back long before.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(false));
}

TEST_F(FakeAsyncTest, StreamWorkRunsInOrderAfterTheCallsReturn) {
  std::unique_ptr<Stream> stream = NewStream(true);
  std::unique_ptr<Stream> observer = NewStream(true);
  const DevicePtr data = Alloc(3 * sizeof(float));
  Function* add_one = Kernel("add_one_f32");
  Spin(kShortSpinUs, stream.get());
  const std::vector<float> values = {1, 2, 3};
  ASSERT_THAT(context_->Upload(data, values.data(), 3 * sizeof(float), stream.get()), IsOk());
  ASSERT_THAT(
      context_->Launch(add_one, Linear(3), PackArgs(*add_one, data, uint64_t{3}), stream.get()),
      IsOk());
  ASSERT_THAT(
      context_->Launch(add_one, Linear(2), PackArgs(*add_one, data, uint64_t{2}), stream.get()),
      IsOk());
  // Still behind the spin: nothing has run yet, as another stream sees.
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(false));
  std::vector<float> early(3, -1.0f);
  ASSERT_THAT(context_->Download(early.data(), data, 3 * sizeof(float), observer.get()), IsOk());
  EXPECT_THAT(early, ElementsAre(0, 0, 0));
  // In order: the upload, then both increments.
  std::vector<float> back(3);
  ASSERT_THAT(context_->Download(back.data(), data, 3 * sizeof(float), stream.get()), IsOk());
  EXPECT_THAT(back, ElementsAre(3, 4, 4));
}

TEST_F(FakeAsyncTest, UploadCopiesItsSourceBeforeReturning) {
  std::unique_ptr<Stream> stream = NewStream(false);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, stream.get());
  std::vector<uint32_t> source = {1, 2, 3, 4};
  ASSERT_THAT(context_->Upload(data, source.data(), 4 * sizeof(uint32_t), stream.get()), IsOk());
  source.assign(4, 99);  // reused while the upload is still queued
  source.clear();
  source.shrink_to_fit();
  EXPECT_THAT(DownloadOn(data, 4, stream.get()), ElementsAre(1, 2, 3, 4));
}

TEST_F(FakeAsyncTest, DownloadWaitsForTheWorkQueuedBeforeIt) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, stream.get());
  Fill(data, 3, 4, stream.get());
  EXPECT_THAT(DownloadOn(data, 4, stream.get()), ElementsAre(3, 3, 3, 3));
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(true));
}

TEST_F(FakeAsyncTest, LegacyStreamWaitsForBlockingStreams) {
  std::unique_ptr<Stream> blocking = NewStream(false);
  const DevicePtr x = Alloc(4 * sizeof(uint32_t));
  const DevicePtr y = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, blocking.get());
  Fill(x, 5, 4, blocking.get());
  ASSERT_THAT(context_->CopyDeviceToDevice(y, x, 4 * sizeof(uint32_t), nullptr), IsOk());
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(false));
  EXPECT_THAT(DownloadOn(y, 4, nullptr), ElementsAre(5, 5, 5, 5));
  EXPECT_THAT(context_->QueryStream(blocking.get()), IsOkAndHolds(true));
}

TEST_F(FakeAsyncTest, BlockingStreamsWaitForTheLegacyStream) {
  std::unique_ptr<Stream> blocking = NewStream(false);
  std::unique_ptr<Stream> observer = NewStream(true);
  const DevicePtr x = Alloc(4 * sizeof(uint32_t));
  const DevicePtr y = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, nullptr);
  Fill(x, 6, 4, nullptr);
  ASSERT_THAT(context_->CopyDeviceToDevice(y, x, 4 * sizeof(uint32_t), blocking.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(blocking.get()), IsOkAndHolds(false));
  ASSERT_THAT(context_->SynchronizeStream(blocking.get()), IsOk());
  // The legacy stream's work ran first, so the copy saw it.
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(true));
  EXPECT_THAT(DownloadOn(y, 4, observer.get()), ElementsAre(6, 6, 6, 6));
}

TEST_F(FakeAsyncTest, NonBlockingStreamsDoNotWaitForTheLegacyStream) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kGateUs, nullptr);
  Fill(data, 7, 4, stream.get());
  EXPECT_THAT(DownloadOn(data, 4, stream.get()), ElementsAre(7, 7, 7, 7));
  ASSERT_THAT(context_->SynchronizeStream(stream.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(false));
}

TEST_F(FakeAsyncTest, LegacyStreamDoesNotWaitForNonBlockingStreams) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kGateUs, stream.get());
  Fill(data, 8, 4, nullptr);
  EXPECT_THAT(DownloadOn(data, 4, nullptr), ElementsAre(8, 8, 8, 8));
  ASSERT_THAT(context_->SynchronizeStream(nullptr), IsOk());
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(false));
  AbandonContext();
}

TEST_F(FakeAsyncTest, NonBlockingStreamsRunConcurrently) {
  std::unique_ptr<Stream> first = NewStream(true);
  std::unique_ptr<Stream> second = NewStream(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> done, context_->CreateEvent(false, false));
  Spin(kGateUs, first.get());
  Spin(10'000, second.get());
  ASSERT_THAT(context_->RecordEvent(done.get(), second.get()), IsOk());
  // The second stream's kernel runs while the first's still spins.
  ASSERT_THAT(context_->SynchronizeEvent(done.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(second.get()), IsOkAndHolds(true));
  EXPECT_THAT(context_->QueryStream(first.get()), IsOkAndHolds(false));
  AbandonContext();
}

TEST_F(FakeAsyncTest, StreamWaitEventOrdersWorkAcrossStreams) {
  std::unique_ptr<Stream> producer = NewStream(true);
  std::unique_ptr<Stream> consumer = NewStream(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> ready, context_->CreateEvent(true, false));
  const DevicePtr x = Alloc(4 * sizeof(uint32_t));
  const DevicePtr y = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, producer.get());
  Fill(x, 9, 4, producer.get());
  ASSERT_THAT(context_->RecordEvent(ready.get(), producer.get()), IsOk());
  ASSERT_THAT(context_->StreamWaitEvent(consumer.get(), ready.get()), IsOk());
  ASSERT_THAT(context_->CopyDeviceToDevice(y, x, 4 * sizeof(uint32_t), consumer.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(consumer.get()), IsOkAndHolds(false));
  EXPECT_THAT(DownloadOn(y, 4, consumer.get()), ElementsAre(9, 9, 9, 9));
  EXPECT_THAT(context_->QueryEvent(ready.get()), IsOkAndHolds(true));
}

TEST_F(FakeAsyncTest, WaitingForANeverRecordedEventOrdersNothing) {
  std::unique_ptr<Stream> stream = NewStream(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> never, context_->CreateEvent(false, false));
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kGateUs, nullptr);
  ASSERT_THAT(context_->StreamWaitEvent(stream.get(), never.get()), IsOk());
  Fill(data, 11, 4, stream.get());
  EXPECT_THAT(DownloadOn(data, 4, stream.get()), ElementsAre(11, 11, 11, 11));
  EXPECT_THAT(context_->QueryEvent(never.get()), IsOkAndHolds(true));
}

TEST_F(FakeAsyncTest, QueriesAreFalseUntilTheWorkHasRun) {
  std::unique_ptr<Stream> stream = NewStream(false);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> event, context_->CreateEvent(false, false));
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(context_->RecordEvent(event.get(), stream.get()), IsOk());
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(false));
  EXPECT_THAT(context_->QueryEvent(event.get()), IsOkAndHolds(false));
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(false));  // it covers blocking streams
  EXPECT_TRUE(Eventually([&] { return context_->QueryEvent(event.get()); }));
  EXPECT_TRUE(Eventually([&] { return context_->QueryStream(stream.get()); }));
  EXPECT_THAT(context_->QueryStream(nullptr), IsOkAndHolds(true));
}

TEST_F(FakeAsyncTest, ElapsedTimeIsNotReadyUntilBothEventsHaveRunThenTimesTheWork) {
  std::unique_ptr<Stream> stream = NewStream(true);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, context_->CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> end, context_->CreateEvent(false, false));
  ASSERT_THAT(context_->RecordEvent(start.get(), stream.get()), IsOk());
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(context_->RecordEvent(end.get(), stream.get()), IsOk());
  // As the CUDA backend reports cuEventElapsedTime's CUDA_ERROR_NOT_READY.
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()),
              StatusIs(absl::StatusCode::kUnavailable,
                       "cuEventElapsedTime: CUDA_ERROR_NOT_READY (device not ready) - event not "
                       "completed yet"));
  ASSERT_THAT(context_->SynchronizeEvent(end.get()), IsOk());
  // Timed when the records ran, around the spin, not when they were queued.
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()), IsOkAndHolds(Ge(1000.0f)));
  // Re-recorded: not ready again until the new point runs.
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(context_->RecordEvent(end.get(), stream.get()), IsOk());
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()),
              StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_THAT(context_->SynchronizeStream(stream.get()), IsOk());
  EXPECT_THAT(context_->ElapsedTime(start.get(), end.get()), IsOkAndHolds(Ge(2000.0f)));
}

TEST_F(FakeAsyncTest, AFaultHappensWhenTheKernelRunsAndSurfacesAtTheNextCall) {
  std::unique_ptr<Stream> stream = NewStream(true);
  Function* fault = Kernel("fault_illegal_address");
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(context_->Launch(fault, Linear(1), {}, stream.get()), IsOk());
  // Not run yet: the context is still healthy.
  EXPECT_THAT(context_->Alloc(16), IsOk());
  const auto aborted =
      StatusIs(absl::StatusCode::kAborted,
               HasSubstr(absl::StrCat(kIllegalAddress, " in fake kernel 'fault_illegal_address'")));
  EXPECT_THAT(context_->SynchronizeStream(stream.get()), aborted);
  // Sticky: the same error from every call after, synchronizing or not.
  EXPECT_THAT(context_->QueryStream(nullptr), aborted);
  EXPECT_THAT(context_->Alloc(16), aborted);
  EXPECT_THAT(context_->Launch(fault, Linear(1), {}, nullptr), aborted);
  EXPECT_THAT(context_->Synchronize(), aborted);
  EXPECT_THAT(context_->SynchronizeStream(stream.get()), aborted);
}

TEST_F(FakeAsyncTest, WorkQueuedBehindAFaultIsSkipped) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(context_->Launch(Kernel("fault_illegal_address"), Linear(1), {}, stream.get()),
              IsOk());
  Fill(data, 12, 4, stream.get());
  uint32_t back[4] = {};
  EXPECT_THAT(context_->Download(back, data, sizeof(back), stream.get()),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr("cuMemcpyDtoHAsync"), HasSubstr(kIllegalAddress))));
  EXPECT_THAT(back, Each(0u));
}

TEST_F(FakeAsyncTest, OutOfBoundsAccessFaultsWhenTheKernelRuns) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(16 * sizeof(float));
  Function* add_one = Kernel("add_one_f32");
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(
      context_->Launch(add_one, Linear(32), PackArgs(*add_one, data, uint64_t{17}), stream.get()),
      IsOk());
  EXPECT_THAT(context_->GetMemInfo(), IsOk());
  EXPECT_THAT(context_->Synchronize(), StatusIs(absl::StatusCode::kAborted,
                                                absl::StrCat("cuCtxSynchronize: ", kIllegalAddress,
                                                             " in fake kernel 'add_one_f32'")));
  EXPECT_THAT(context_->GetMemInfo(), StatusIs(absl::StatusCode::kAborted));
}

TEST_F(FakeAsyncTest, FreeWaitsForQueuedWorkThatUsesTheBuffer) {
  std::unique_ptr<Stream> stream = NewStream(true);
  const DevicePtr data = Alloc(64 * sizeof(float));
  Function* add_one = Kernel("add_one_f32");
  Spin(kShortSpinUs, stream.get());
  ASSERT_THAT(
      context_->Launch(add_one, Linear(64), PackArgs(*add_one, data, uint64_t{64}), stream.get()),
      IsOk());
  ASSERT_THAT(context_->Free(data), IsOk());
  // Free returned after the kernel ran, on live memory: no fault.
  EXPECT_THAT(context_->QueryStream(stream.get()), IsOkAndHolds(true));
  EXPECT_THAT(context_->Synchronize(), IsOk());
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes)));
}

TEST_F(FakeAsyncTest, DestroyingAStreamWaitsForItsWork) {
  std::unique_ptr<Stream> observer = NewStream(true);
  const DevicePtr data = Alloc(4 * sizeof(uint32_t));
  {
    std::unique_ptr<Stream> stream = NewStream(true);
    Spin(kShortSpinUs, stream.get());
    Fill(data, 13, 4, stream.get());
  }
  EXPECT_THAT(DownloadOn(data, 4, observer.get()), ElementsAre(13, 13, 13, 13));
}

TEST_F(FakeAsyncTest, DestroyingAnEventWithARecordQueuedIsHarmless) {
  std::unique_ptr<Stream> stream = NewStream(true);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> event, context_->CreateEvent(false, false));
    Spin(100'000, stream.get());
    ASSERT_THAT(context_->RecordEvent(event.get(), stream.get()), IsOk());
  }
  EXPECT_THAT(context_->SynchronizeStream(stream.get()), IsOk());
}

// Queues are bounded (1024 pieces of work per stream, 64 MiB of queued bytes per context):
// calls beyond that wait for room, as cuLaunchKernel does when its queue is full, and
// everything still runs, in order.
TEST_F(FakeAsyncTest, WorkBeyondTheQueueBoundsWaitsForRoomAndAllRuns) {
  std::unique_ptr<Stream> stream = NewStream(true);
  constexpr uint64_t kCount = 1 << 18;  // 1 MiB of floats
  const DevicePtr data = Alloc(kCount * sizeof(float));
  Function* add_one = Kernel("add_one_f32");
  Spin(200'000, stream.get());
  for (int i = 0; i < 3000; ++i) {
    ASSERT_THAT(
        context_->Launch(add_one, Linear(1), PackArgs(*add_one, data, uint64_t{1}), stream.get()),
        IsOk());
  }
  Spin(200'000, stream.get());
  std::vector<float> values(kCount);
  for (int i = 0; i < 80; ++i) {
    values[1] = static_cast<float>(i);
    ASSERT_THAT(context_->Upload(data + sizeof(float), values.data() + 1,
                                 (kCount - 1) * sizeof(float), stream.get()),
                IsOk());
  }
  std::vector<float> back(2);
  ASSERT_THAT(context_->Download(back.data(), data, 2 * sizeof(float), stream.get()), IsOk());
  EXPECT_THAT(back, ElementsAre(3000.0f, 79.0f));
}

TEST(FakeBackendShutdownTest, DestroyingTheContextInterruptsQueuedSpins) {
  std::unique_ptr<Backend> backend = MakeFakeBackend(kTotalMemoryBytes);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Context> context, backend->OpenContext(0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module,
                       context->LoadModule(AsBytes(kFakeKernelsPtx)));
  ASSERT_OK_AND_ASSIGN(Function * spin, module->GetFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(const DevicePtr data, context->Alloc(64));
  // Minutes of work, running and queued, on the legacy stream.
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(context->Launch(spin, Linear(1), PackArgs(*spin, kGateUs), nullptr), IsOk());
  }
  ASSERT_THAT(context->Memset(data, 1, 1, 64, nullptr), IsOk());
  EXPECT_THAT(context->QueryStream(nullptr), IsOkAndHolds(false));
  module.reset();  // no globals: nothing to wait for
  const auto start = std::chrono::steady_clock::now();
  context.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// Several threads, each with its own stream, and the legacy stream between them: every
// result is the one stream order gives.
TEST_F(FakeAsyncTest, ConcurrentStreamsFromSeveralThreadsKeepTheirOrder) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  constexpr uint64_t kCount = 256;
  Function* add_one = Kernel("add_one_f32");
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Stream> stream = NewStream(t % 2 == 0);
      const DevicePtr data = Alloc(kCount * sizeof(float));
      std::vector<float> values(kCount, static_cast<float>(t));
      for (int round = 0; round < kRounds; ++round) {
        EXPECT_THAT(context_->Upload(data, values.data(), kCount * sizeof(float), stream.get()),
                    IsOk());
        for (int k = 0; k < 3; ++k) {
          EXPECT_THAT(context_->Launch(add_one, Linear(kCount), PackArgs(*add_one, data, kCount),
                                       stream.get()),
                      IsOk());
        }
        std::vector<float> back(kCount);
        EXPECT_THAT(context_->Download(back.data(), data, kCount * sizeof(float), stream.get()),
                    IsOk());
        EXPECT_THAT(back, Each(static_cast<float>(t) + 3.0f)) << "thread " << t;
        if (round % 10 == 0) {
          EXPECT_THAT(context_->Synchronize(), IsOk());
        }
      }
      EXPECT_THAT(context_->Free(data), IsOk());
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(context_->Synchronize(), IsOk());
}

// --- Modules ------------------------------------------------------------------------------

constexpr char kPtx[] = R"ptx(
//
// Generated by hand for the fake backend's tests.
// .global .align 4 .u32 commented_out;
//

.version 8.0
.target sm_75
.address_size 64

	// .globl	scale
.global .align 4 .b8 name[16];
.const .align 4 .f32 coeffs[4] = {0f3F800000, 0f40000000, 0f40400000, 0f40800000};
.visible .const .align 8 .u64 table[32];
.global .align 4 .u32 counter;
.extern .global .align 16 .v4 .f32 quads[2];
/* .global .u32 hidden_in_block_comment; */
.visible .global .align 4 .u32 sized_by_initializer[] = {1, 2, 3};
.global .align 4 .f32 grid[2][3];
.visible .global .align 1 .b8 a, b[3];

.visible .entry scale(
	.param .u64 scale_param_0,
	.param .f32 scale_param_1
)
{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<3>;
	.local .align 4 .b8 not_a_module_global[4];
	.shared .align 4 .b8 tile[128];

	ld.param.u64 	%rd1, [scale_param_0];
	ret;
}
.shared .align 4 .b8 module_shared[64];
)ptx";

TEST_F(FakeBackendTest, PtxGlobalsHaveTheirDeclaredSizes) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(AsBytes(kPtx)));
  const std::map<std::string, uint64_t> expected = {
      {"name", 16},   {"coeffs", 16}, {"table", 256},
      {"counter", 4}, {"quads", 32},  {"sized_by_initializer", 12},
      {"grid", 24},   {"a", 1},       {"b", 3}};
  std::set<DevicePtr> addresses;
  for (const auto& [name, size_bytes] : expected) {
    ASSERT_OK_AND_ASSIGN(const Module::Global global, module->GetGlobal(name));
    EXPECT_EQ(global.size_bytes, size_bytes) << name;
    EXPECT_EQ(global.address % 256, 0u) << name;
    addresses.insert(global.address);
  }
  EXPECT_THAT(addresses, SizeIs(expected.size()));
}

TEST_F(FakeBackendTest, PtxGlobalsAreZeroedAndWritable) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(AsBytes(kPtx)));
  ASSERT_OK_AND_ASSIGN(const Module::Global coeffs, module->GetGlobal("coeffs"));
  EXPECT_THAT(DownloadAs<float>(coeffs.address, 4), Each(0.0f));
  const std::vector<float> values = {1, 2, 3, 4};
  ASSERT_THAT(context_->Upload(coeffs.address, values.data(), coeffs.size_bytes, nullptr), IsOk());
  EXPECT_THAT(DownloadAs<float>(coeffs.address, 4), ElementsAreArray(values));
  const float extra = 5;
  EXPECT_THAT(context_->Upload(coeffs.address + coeffs.size_bytes, &extra, sizeof(extra), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(FakeBackendTest, OnlyModuleScopeGlobalAndConstVariablesAreGlobals) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(AsBytes(kPtx)));
  for (const char* name : {"commented_out", "hidden_in_block_comment", "not_a_module_global",
                           "tile", "module_shared", "scale", "scale_param_0"}) {
    EXPECT_THAT(module->GetGlobal(name), StatusIs(absl::StatusCode::kNotFound)) << name;
  }
}

TEST_F(FakeBackendTest, PtxGlobalsUseDeviceMemoryUntilTheModuleIsDestroyed) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(AsBytes(kPtx)));
  constexpr uint64_t kGlobalBytes = 16 + 16 + 256 + 4 + 32 + 12 + 24 + 1 + 3;
  EXPECT_THAT(context_->GetMemInfo(), IsOkAndHolds(::testing::Field(
                                          &MemInfo::free_bytes, kTotalMemoryBytes - kGlobalBytes)));
  module.reset();
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes)));
}

TEST_F(FakeBackendTest, ModuleWhoseGlobalsDoNotFitIsResourceExhaustedAndLeaksNothing) {
  const std::string ptx =
      ".version 8.0\n.target sm_75\n.global .align 4 .b8 small[64];\n"
      ".global .align 4 .b8 huge[" +
      std::to_string(kTotalMemoryBytes) + "];\n";
  EXPECT_THAT(context_->LoadModule(AsBytes(ptx)), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes)));
}

TEST_F(FakeBackendTest, UnknownGlobalIsNotFound) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(AsBytes(kPtx)));
  EXPECT_THAT(module->GetGlobal("nonexistent"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nonexistent")));
}

TEST_F(FakeBackendTest, EmptyImageIsInvalidArgument) {
  EXPECT_THAT(context_->LoadModule({}), StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- Module images: what the fake accepts and refuses ------------------------------------

std::string Ptx(const std::string& body) {
  return ".version 8.0\n.target sm_75\n.address_size 64\n" + body;
}

template <typename T>
void Store(std::string* bytes, size_t offset, T value) {
  std::memcpy(bytes->data() + offset, &value, sizeof(value));
}

struct ElfSection {
  std::string name;
  uint32_t type = 1;  // SHT_PROGBITS
  std::string contents;
  uint32_t link = 0;
  uint64_t entsize = 0;
};

constexpr uint32_t kShtSymtab = 2;
constexpr uint32_t kShtStrtab = 3;
constexpr uint16_t kEmCuda = 190;
constexpr size_t kShoffOffset = 0x28;

// A little-endian ELF64: header, contents, then the section headers (null, `sections`...,
// .shstrtab last).
std::string Elf(std::vector<ElfSection> sections, uint16_t machine = kEmCuda) {
  std::string names(1, '\0');
  std::vector<uint32_t> name_offsets;
  sections.push_back(ElfSection{".shstrtab", kShtStrtab, ""});
  for (const ElfSection& section : sections) {
    name_offsets.push_back(static_cast<uint32_t>(names.size()));
    names += section.name + '\0';
  }
  sections.back().contents = names;
  std::string elf(64, '\0');
  elf[0] = 0x7f;
  elf[1] = 'E';
  elf[2] = 'L';
  elf[3] = 'F';
  elf[4] = 2;  // ELFCLASS64
  elf[5] = 1;  // little-endian
  elf[6] = 1;
  Store<uint16_t>(&elf, 0x10, 2);  // ET_EXEC
  Store<uint16_t>(&elf, 0x12, machine);
  std::vector<uint64_t> offsets;
  for (const ElfSection& section : sections) {
    offsets.push_back(elf.size());
    elf += section.contents;
  }
  while (elf.size() % 8 != 0) elf.push_back('\0');
  const uint64_t shoff = elf.size();
  elf.append(64 * (sections.size() + 1), '\0');
  for (size_t i = 0; i < sections.size(); ++i) {
    const size_t header = shoff + 64 * (i + 1);
    Store<uint32_t>(&elf, header + 0x00, name_offsets[i]);
    Store<uint32_t>(&elf, header + 0x04, sections[i].type);
    Store<uint64_t>(&elf, header + 0x18, offsets[i]);
    Store<uint64_t>(&elf, header + 0x20, sections[i].contents.size());
    Store<uint32_t>(&elf, header + 0x28, sections[i].link);
    Store<uint64_t>(&elf, header + 0x38, sections[i].entsize);
  }
  Store<uint64_t>(&elf, kShoffOffset, shoff);
  Store<uint16_t>(&elf, 0x3a, 64);
  Store<uint16_t>(&elf, 0x3c, static_cast<uint16_t>(sections.size() + 1));
  Store<uint16_t>(&elf, 0x3e, static_cast<uint16_t>(sections.size()));
  return elf;
}

// A cubin as nvcc lays one out: a string table, a symbol table whose global FUNC symbols (with
// STO_CUDA_ENTRY) are the kernels, and one .text section per kernel; plus a __device__ object.
std::string CubinDefining(const std::vector<std::string>& kernels, uint16_t machine = kEmCuda) {
  std::string strtab(1, '\0');
  std::string symtab(24, '\0');  // the null symbol
  const auto add_symbol = [&](const std::string& name, uint8_t info, uint16_t section) {
    std::string symbol(24, '\0');
    Store<uint32_t>(&symbol, 0, static_cast<uint32_t>(strtab.size()));
    symbol[4] = static_cast<char>(info);
    symbol[5] = 0x10;
    Store<uint16_t>(&symbol, 6, section);
    Store<uint64_t>(&symbol, 16, 16);
    symtab += symbol;
    strtab += name + '\0';
  };
  // Sections: 1 .strtab, 2 .symtab, 3 .nv.global.init, 4... one .text per kernel.
  add_symbol("device_variable", (1 << 4) | 1, 3);  // GLOBAL OBJECT: not a kernel
  for (size_t i = 0; i < kernels.size(); ++i) {
    add_symbol(kernels[i], (1 << 4) | 2, static_cast<uint16_t>(4 + i));  // GLOBAL FUNC
  }
  add_symbol("undefined_function", (1 << 4) | 2, 0);  // UND: defined elsewhere
  std::vector<ElfSection> sections = {
      ElfSection{".strtab", kShtStrtab, strtab},
      ElfSection{".symtab", kShtSymtab, symtab, /*link=*/1, /*entsize=*/24},
      ElfSection{".nv.global.init", 1, std::string(16, '\0')},
  };
  for (const std::string& kernel : kernels) {
    sections.push_back(ElfSection{".text." + kernel, 1, std::string(16, '\1')});
  }
  return Elf(std::move(sections), machine);
}

struct FatbinEntry {
  uint16_t kind = 2;  // 1: PTX, 2: cubin
  std::string payload;
  uint64_t flags = 0x11;
};

// An uncompressed fatbin, as nvcc --no-compress makes one (module_footprint.cc's layout).
std::string Fatbin(const std::vector<FatbinEntry>& entries) {
  std::string body;
  for (const FatbinEntry& entry : entries) {
    std::string header(64, '\0');
    Store<uint16_t>(&header, 0, entry.kind);
    Store<uint16_t>(&header, 2, 0x0101);
    Store<uint32_t>(&header, 4, 64);
    Store<uint64_t>(&header, 8, entry.payload.size());
    Store<uint32_t>(&header, 28, 75);
    Store<uint64_t>(&header, 40, entry.flags);
    body += header + entry.payload;
  }
  std::string fatbin(16, '\0');
  Store<uint32_t>(&fatbin, 0, 0xBA55ED50);
  Store<uint16_t>(&fatbin, 4, 1);
  Store<uint16_t>(&fatbin, 6, 16);
  Store<uint64_t>(&fatbin, 8, body.size());
  return fatbin + body;
}

std::vector<std::string> BuiltinNames() {
  return {"multiply_them",         "axpy_f32", "fill_u32", "add_one_f32", "copy_bytes",
          "fault_illegal_address", "spin_us"};
}

class FakeImageTest : public FakeBackendTest {
 protected:
  absl::StatusOr<std::unique_ptr<Module>> Load(const std::string& image) {
    return context_->LoadModule(AsBytes(image));
  }

  // `image` is refused as INVALID_ARGUMENT with every one of `substrings`, and the refusal
  // leaves nothing behind.
  void ExpectRejected(const std::string& image, const std::vector<std::string>& substrings) {
    absl::StatusOr<std::unique_ptr<Module>> module = Load(image);
    EXPECT_THAT(module,
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuModuleLoadDataEx")))
        << image.substr(0, 200);
    for (const std::string& substring : substrings) {
      EXPECT_THAT(module.status().message(), HasSubstr(substring)) << image.substr(0, 200);
    }
    EXPECT_THAT(context_->GetMemInfo(),
                IsOkAndHolds(::testing::Field(&MemInfo::free_bytes, kTotalMemoryBytes)));
    EXPECT_THAT(context_->Synchronize(), IsOk());
  }
};

TEST_F(FakeImageTest, TheCheckedInNvrtcPtxDefinesEveryBuiltIn) {
  for (const std::string& name : BuiltinNames()) {
    EXPECT_THAT(module_->GetFunction(name), IsOk()) << name;
  }
  EXPECT_EQ(module_->device_memory_bytes(), 0u);
}

TEST_F(FakeImageTest, GetFunctionFindsOnlyBuiltInsTheImageDefines) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, Load(Ptx(R"(
.visible .entry fill_u32(.param .u64 out, .param .u32 value, .param .u64 n)
{
  ret;
}
.visible .entry saxpy(.param .f32 a, .param .u64 x)
{
  ret;
}
)")));
  EXPECT_THAT(module->GetFunction("fill_u32"), IsOk());
  EXPECT_THAT(
      module->GetFunction("add_one_f32"),
      StatusIs(absl::StatusCode::kNotFound, AllOf(HasSubstr("CUDA_ERROR_NOT_FOUND"),
                                                  HasSubstr("defines no kernel 'add_one_f32'"),
                                                  HasSubstr("it defines fill_u32, saxpy"))));
  EXPECT_THAT(module->GetFunction("saxpy"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("defines kernel 'saxpy'"), HasSubstr("built-in"),
                             HasSubstr("fault_illegal_address"), HasSubstr("GPU worker"))));
}

TEST_F(FakeImageTest, ABuiltInDeclaredWithAnotherLayoutIsNotFound) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, Load(Ptx(R"(
.visible .entry fill_u32(.param .u64 out, .param .u64 value)
{
  ret;
}
)")));
  EXPECT_THAT(module->GetFunction("fill_u32"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("[0:8, 8:8]"), HasSubstr("[0:8, 8:4, 16:8]"),
                             HasSubstr("fill_u32(unsigned* out, unsigned value, unsigned long "
                                       "long n)"))));
}

TEST_F(FakeImageTest, WellFormedPtxInEveryShapeLoads) {
  // What NVRTC, nvcc -G and hand-written PTX contain: CRLF line ends, comments everywhere,
  // line directives, pointer attributes, aligned byte-array parameters, performance
  // directives, device functions and their prototypes, a debug section, pragmas, and an
  // entry without a parameter list.
  std::string ptx = R"(//
// Generated by hand /* not a comment start */
//
.version 9.0
.target sm_75, texmode_independent
.address_size 64
.file 1 "/tmp/kernel.cu", 1700000000, 1234
.file 2 "kernel.h"
.extern .func (.param .b32 func_retval0) vprintf(.param .b64 vprintf_param_0, .param .b64 p1);
.global .align 4 .b8 table[64] = {1, 2, 3, {4}};
.const .align 8 .u64 coeffs[2];
.pragma "nounroll";
.func (.param .b32 r) helper(.reg .b32 a, .reg .pred p)
{
  ret;
}
.weak .entry axpy_f32(
	.param .f32 axpy_f32_param_0,
	.param .u64 .ptr .global .align 4 axpy_f32_param_1,
	.param .u64 .ptr .align 1 axpy_f32_param_2,
	.param .u64 axpy_f32_param_3
) .maxntid 256, 1, 1 .minnctapersm 2
{
	.reg .b64 %rd<3>;
	{ // a nested scope
	.reg .b32 %r<2>;
	}
	ld.param.u64 %rd1, [axpy_f32_param_1];
	call.uni (retval0), vprintf, (param0, param1);
	ret;
}
.visible .entry add_one_f32(.param .align 8 .b8 add_one_f32_param_0[8], .param .u64 n)
{
	ret;
}
.entry fault_illegal_address
{
	trap;
}
.section .debug_abbrev
{
.b8 1
.b8 17
}
)";
  std::string crlf;
  for (const char c : ptx) {
    if (c == '\n') crlf += '\r';
    crlf += c;
  }
  for (const std::string& image : {ptx, crlf, ptx + std::string(3, '\0')}) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, Load(image));
    EXPECT_THAT(module->GetFunction("axpy_f32"), IsOk());
    EXPECT_THAT(module->GetFunction("add_one_f32"), IsOk());
    EXPECT_THAT(module->GetFunction("fault_illegal_address"), IsOk());
    EXPECT_THAT(module->GetFunction("helper"), StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(module->GetFunction("vprintf"), StatusIs(absl::StatusCode::kNotFound));
    ASSERT_OK_AND_ASSIGN(const Module::Global table, module->GetGlobal("table"));
    EXPECT_EQ(table.size_bytes, 64u);
    EXPECT_EQ(module->device_memory_bytes(), 64u);
  }
}

TEST_F(FakeImageTest, EmptyRandomAndTextImagesAreRejected) {
  EXPECT_THAT(context_->LoadModule({}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)")));
  std::mt19937 random(20240611);
  for (int i = 0; i < 20; ++i) {
    std::string bytes(64 + 97 * i, '\0');
    for (char& c : bytes) c = static_cast<char>(random() & 0xff);
    // Neither ELF nor fatbin magic: taken for PTX, and refused as such.
    bytes[0] = 'x';
    ExpectRejected(bytes, {"CUDA_ERROR_INVALID_PTX"});
  }
  ExpectRejected("any image will do", {"line 1: PTX must begin with a .version directive"});
  ExpectRejected(std::string(8, '\0'), {"empty"});
  ExpectRejected("  // nothing but a comment\n", {"nothing but whitespace and comments"});
}

TEST_F(FakeImageTest, MalformedPtxIsRejectedWithTheLine) {
  const std::string entry = ".visible .entry k()\n{\n\tret;\n}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {".version 8.0\n", ".version must be followed by .target, not the end of the text"},
      {".target sm_75\n.version 8.0\n", "must begin with a .version directive"},
      {".version 8\n.target sm_75\n", "MAJOR.MINOR"},
      {".version 8.0\n.target gfx90a\n", "unknown .target 'gfx90a'"},
      {".version 8.0\n.target sm_75\n.address_size 48\n", ".address_size must be 32 or 64"},
      {Ptx(".version 8.0\n"), "line 4: .version may appear only once"},
      {Ptx(".visible .entry k()\n{\n\tret;\n"), "line 5: '{' is never closed"},
      {Ptx(entry + "}\n"), "line 8: '}' closes nothing"},
      {Ptx(".visible .entry k(.param .u64 a\n{\n}\n"), "parameter 0 of kernel 'k'"},
      {Ptx(".visible .entry k()\n{\n\tld.param.u64 %rd1, [a;\n}\n"), "does not close the '['"},
      {Ptx(".visible .entry k(.param .u64)\n{\n}\n"), "expected its name, not ')'"},
      {Ptx(".visible .entry k(.u64 a)\n{\n}\n"), "expected .param, not '.u64'"},
      {Ptx(".visible .entry k(.reg .u64 a)\n{\n}\n"), "expected .param, not '.reg'"},
      {Ptx(".visible .entry k(.param .u128 a)\n{\n}\n"), "unknown type '.u128'"},
      {Ptx(".visible .entry k(.param .u64 .u32 a)\n{\n}\n"), "a second type '.u32'"},
      {Ptx(".visible .entry k(.param a)\n{\n}\n"), "no type before 'a'"},
      {Ptx(".visible .entry k(.param .u64 a,)\n{\n}\n"), "parameter 1 of kernel 'k'"},
      {Ptx(".visible .entry k(.param .u64 a b)\n{\n}\n"), "expected ',' or ')', not 'b'"},
      {Ptx(".visible .entry k(.param .b8 a[0])\n{\n}\n"), "array extent '0'"},
      {Ptx(".visible .entry k(.param .b8 a[n])\n{\n}\n"), "array extent 'n'"},
      {Ptx(".visible .entry k(.param .align 3 .b8 a[4])\n{\n}\n"), "power of two"},
      {Ptx(".visible .entry k(.param .global .u64 a)\n{\n}\n"), "outside a .ptr attribute"},
      {Ptx(".visible .entry k(.param .b8 a[40000])\n{\n}\n"), "32764 bytes a kernel may take"},
      {Ptx(".visible .entry (.param .u64 a)\n{\n}\n"), ".entry needs a kernel name"},
      {Ptx(".visible .entry 9k()\n{\n}\n"), ".entry needs a kernel name"},
      {Ptx(entry + entry), "line 8: kernel 'k' is defined twice"},
      {Ptx(".visible .entry k() .maxntid 128 .bogus 4\n{\n}\n"), "unknown directive '.bogus'"},
      {Ptx(".visible .entry k()\n\tret;\n"), "expected its body ('{') or ';'"},
      {Ptx("mov.u32 %r1, 1;\n"), "'mov.u32' at module scope"},
      {Ptx(".frobnicate 1;\n"), "unknown directive '.frobnicate' at module scope"},
      {Ptx("{\n}\n"), "'{' at module scope"},
      {Ptx(".global .u32 x\n" + entry), "'{' in the .global statement of line 4"},
      {Ptx(".global .u32 x"), "the .global statement is not ended by ';'"},
      {Ptx(".file one \"a.cu\"\n"), ".file needs a file number"},
      {Ptx(".section .debug_info .b8 1;\n"), "expected '{'"},
      {Ptx("/* never closed\n" + entry), "line 4: a /* comment is never closed"},
      {Ptx(".pragma \"nounroll;\n"), "line 4: a string literal is not closed"},
      {Ptx(entry + "\x01"), "line 8: byte 0x01 is not PTX text"},
      {Ptx(".global .u32 caf\xc3\xa9;\n"), "byte 0xc3 is not PTX text"},
      {Ptx(entry + std::string(1, '\0') + entry), "is a NUL inside the text"},
      {Ptx(".visible .entry k()\n{\n" + std::string(2000, '(') + std::string(2000, ')') + "\n}\n"),
       "nest deeper than 1024"},
  };
  for (const auto& [ptx, expected] : cases) {
    ExpectRejected(
        ptx, {"CUDA_ERROR_INVALID_PTX (a PTX JIT compilation failed)", "PTX image of", expected});
  }
}

TEST_F(FakeImageTest, CubinFunctionSymbolsAreItsKernels) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module,
                       Load(CubinDefining({"fill_u32", "spin_us", "not_builtin"})));
  ASSERT_OK_AND_ASSIGN(Function * fill, module->GetFunction("fill_u32"));
  EXPECT_EQ(fill->params().size(), 3u);  // the built-in's layout: a cubin's is not read
  EXPECT_THAT(module->GetFunction("spin_us"), IsOk());
  EXPECT_THAT(module->GetFunction("add_one_f32"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("defines no kernel")));
  EXPECT_THAT(module->GetFunction("not_builtin"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("built-in")));
  for (const char* symbol : {"device_variable", "undefined_function"}) {
    EXPECT_THAT(module->GetFunction(symbol),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("defines no kernel")))
        << symbol;
  }
  EXPECT_THAT(module->GetGlobal("device_variable"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(module->device_memory_bytes(), 16u);  // .nv.global.init
  // And the kernel runs.
  const DevicePtr out = Alloc(4 * sizeof(uint32_t));
  ASSERT_THAT(
      context_->Launch(fill, Linear(4), PackArgs(*fill, out, uint32_t{5}, uint64_t{4}), nullptr),
      IsOk());
  EXPECT_THAT(DownloadAs<uint32_t>(out, 4), ElementsAre(5, 5, 5, 5));
}

TEST_F(FakeImageTest, CorruptCubinsAreRejected) {
  const std::string cubin = CubinDefining({"fill_u32"});
  uint64_t shoff;
  std::memcpy(&shoff, cubin.data() + kShoffOffset, sizeof(shoff));
  const size_t symtab_header = shoff + 64 * 2;  // section 2

  ExpectRejected(std::string("\x7f"
                             "ELF\x02\x01\x01\0\0\0.g",
                             12),
                 {"CUDA_ERROR_INVALID_IMAGE", "cubin image of 12 bytes", "truncated"});
  ExpectRejected(cubin.substr(0, cubin.size() - 1), {"CUDA_ERROR_INVALID_IMAGE", "truncated"});
  ExpectRejected(cubin.substr(0, cubin.size() / 2), {"CUDA_ERROR_INVALID_IMAGE"});
  ExpectRejected(CubinDefining({"fill_u32"}, /*machine=*/62),
                 {"machine 62, not a CUDA GPU (EM_CUDA, 190)"});
  std::string big_endian = cubin;
  big_endian[5] = 2;
  ExpectRejected(big_endian, {"not little-endian"});
  std::string no_sections = cubin;
  Store<uint64_t>(&no_sections, kShoffOffset, 0);
  Store<uint16_t>(&no_sections, 0x3c, 0);
  ExpectRejected(no_sections, {"no sections"});
  std::string entsize = cubin;
  Store<uint64_t>(&entsize, symtab_header + 0x38, 16);
  ExpectRejected(entsize, {"entries of 16 bytes"});
  std::string link = cubin;
  Store<uint32_t>(&link, symtab_header + 0x28, 200);
  ExpectRejected(link, {"names string table section 200"});
  std::string name = cubin;
  uint64_t symtab_offset;
  std::memcpy(&symtab_offset, cubin.data() + symtab_header + 0x18, sizeof(symtab_offset));
  Store<uint32_t>(&name, symtab_offset + 24 * 2, 0x7fffffff);  // the kernel's name
  ExpectRejected(name, {"lies outside its string table"});
  std::string outside = cubin;
  Store<uint64_t>(&outside, symtab_header + 0x18, uint64_t{1} << 40);
  ExpectRejected(outside, {"CUDA_ERROR_INVALID_IMAGE", "truncated"});
}

TEST_F(FakeImageTest, FatbinsLoadTheirPtxOrElseTheirCubin) {
  const std::string ptx =
      Ptx(".global .align 4 .b8 g[8];\n"
          ".visible .entry add_one_f32(.param .u64 data, .param .u64 n)\n{\n\tret;\n}\n");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> both,
                       Load(Fatbin({FatbinEntry{2, CubinDefining({"fill_u32"})},
                                    FatbinEntry{1, ptx + std::string(5, '\0')}})));
  EXPECT_THAT(both->GetFunction("add_one_f32"), IsOk());
  EXPECT_THAT(both->GetFunction("fill_u32"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(both->GetGlobal("g"), IsOk());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> cubin_only,
                       Load(Fatbin({FatbinEntry{2, CubinDefining({"fill_u32"})}})));
  EXPECT_THAT(cubin_only->GetFunction("fill_u32"), IsOk());
}

TEST_F(FakeImageTest, CorruptFatbinsAreRejected) {
  const std::string good = Fatbin({FatbinEntry{2, CubinDefining({"fill_u32"})}});
  ExpectRejected(good.substr(0, 12), {"CUDA_ERROR_INVALID_IMAGE", "fatbin image of 12 bytes"});
  ExpectRejected(good.substr(0, good.size() - 1), {"CUDA_ERROR_INVALID_IMAGE"});
  ExpectRejected(Fatbin({FatbinEntry{2, CubinDefining({"fill_u32"}), 0x2011}}), {"compressed"});
  ExpectRejected(Fatbin({FatbinEntry{4, "lto ir"}}), {"kind 4"});
  ExpectRejected(Fatbin({FatbinEntry{1, "not ptx at all"}}),
                 {"CUDA_ERROR_INVALID_IMAGE", "fatbin entry 0 (PTX): line 1"});
  ExpectRejected(Fatbin({FatbinEntry{1, Ptx("")}, FatbinEntry{2, CubinDefining({"fill_u32"}, 62)}}),
                 {"fatbin entry 1 (cubin)", "machine 62"});
  ExpectRejected(Fatbin({}), {"CUDA_ERROR_NO_BINARY_FOR_GPU", "no cubin and no PTX"});
}

// --- Real NVRTC output (NVRTC needs no GPU) ---------------------------------------------

compiler::Compiler* SharedCompiler() {
  static compiler::Compiler* const kCompiler = [] {
    compiler::CompilerOptions options;
    options.cache_dir = "";
    options.memory_cache_max_bytes = 0;
    auto compiler = compiler::Compiler::Create(options);
    return compiler.ok() ? std::move(compiler).value().release() : nullptr;
  }();
  return kCompiler;
}

absl::StatusOr<std::string> CompileWithNvrtc(const std::string& source, const std::string& target) {
  compiler::Compiler* compiler = SharedCompiler();
  if (compiler == nullptr) {
    return compiler::Compiler::Create(compiler::CompilerOptions()).status();
  }
  compiler::CompileRequest request;
  request.source = source;
  request.target = target;
  GPURPC_ASSIGN_OR_RETURN(compiler::CompileResult result, compiler->Compile(request));
  if (!result.success) return absl::InternalError(result.log);
  return std::string(result.image.begin(), result.image.end());
}

TEST_F(FakeImageTest, NvrtcOutputLoadsWithEveryBuiltInLaidOutAsTheCheckedInPtx) {
  ASSERT_OK_AND_ASSIGN(const std::string ptx,
                       CompileWithNvrtc(kFakeKernelsSource, context_->CompileTarget()));
  ASSERT_OK_AND_ASSIGN(const std::string cubin, CompileWithNvrtc(kFakeKernelsSource, "sm_75"));
  for (const std::string& image : {ptx, cubin, Fatbin({FatbinEntry{2, cubin}}),
                                   Fatbin({FatbinEntry{2, cubin}, FatbinEntry{1, ptx}})}) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, Load(image));
    for (const std::string& name : BuiltinNames()) {
      ASSERT_OK_AND_ASSIGN(Function * function, module->GetFunction(name));
      EXPECT_EQ(function->params().size(), Kernel(name)->params().size()) << name;
    }
  }
  // The checked-in PTX is what this NVRTC emits, or differs only in its comments.
  EXPECT_THAT(ptx, HasSubstr(".visible .entry spin_us(\n\t.param .u64 spin_us_param_0\n)"));
}

TEST_F(FakeImageTest, NvrtcCubinTruncatedAnywhereIsRejected) {
  ASSERT_OK_AND_ASSIGN(const std::string cubin, CompileWithNvrtc(kFakeKernelsSource, "sm_75"));
  for (size_t size = 16; size < cubin.size(); size += cubin.size() / 7) {
    ExpectRejected(cubin.substr(0, size), {"CUDA_ERROR_INVALID_IMAGE"});
  }
}

TEST_F(FakeImageTest, NvrtcPtxOfOtherKernelsNamesWhatTheFakeLacks) {
  ASSERT_OK_AND_ASSIGN(const std::string ptx, CompileWithNvrtc(R"(
__device__ float device_table[16];
__global__ void fill_u32(unsigned* out, unsigned value, unsigned long long n) { out[0] = value; }
extern "C" __global__ void scale(float* x, float f) { x[0] *= f * device_table[0]; }
)",
                                                               context_->CompileTarget()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, Load(ptx));
  // Without extern "C" the kernel's name is mangled: there is no plain fill_u32.
  EXPECT_THAT(module->GetFunction("fill_u32"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("_Z8fill_u32Pjjy")));
  EXPECT_THAT(module->GetFunction("scale"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("built-in")));
  ASSERT_OK_AND_ASSIGN(const Module::Global table, module->GetGlobal("device_table"));
  EXPECT_EQ(table.size_bytes, 64u);
}

// --- Concurrency ----------------------------------------------------------------------------

TEST_F(FakeBackendTest, ConcurrentAllocationsGetDistinctAddresses) {
  constexpr size_t kThreads = 4;
  constexpr size_t kPerThread = 200;
  constexpr uint64_t kSizeBytes = 128;
  std::vector<std::vector<DevicePtr>> results(kThreads);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < kPerThread; ++i) {
        absl::StatusOr<DevicePtr> ptr = context_->Alloc(kSizeBytes);
        EXPECT_THAT(ptr, IsOk());
        if (ptr.ok()) results[t].push_back(*ptr);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::set<DevicePtr> distinct;
  for (const std::vector<DevicePtr>& ptrs : results) distinct.insert(ptrs.begin(), ptrs.end());
  EXPECT_THAT(distinct, SizeIs(kThreads * kPerThread));
  EXPECT_THAT(context_->GetMemInfo(),
              IsOkAndHolds(::testing::Field(
                  &MemInfo::free_bytes, kTotalMemoryBytes - kThreads * kPerThread * kSizeBytes)));
}

}  // namespace
}  // namespace gpurpc::backend
