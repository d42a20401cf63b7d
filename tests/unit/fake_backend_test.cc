// The fake backend against the contract in server/worker/backend/backend.h and the fake's own
// promises: bounds-checked host memory, the built-in host kernels, sticky faults, events and
// module globals read from PTX.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
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

// Packs arguments at the offsets the function reports, as the session layer does.
template <typename... Args>
std::vector<uint8_t> PackArgs(const Function& function, Args... args) {
  const std::vector<ParamInfo>& params = function.params();
  EXPECT_EQ(params.size(), sizeof...(Args));
  std::vector<uint8_t> packed(
      params.empty() ? 0 : params.back().offset_bytes + params.back().size_bytes);
  size_t index = 0;
  const auto put = [&](auto value) {
    if (index >= params.size()) return;
    const ParamInfo& param = params[index++];
    EXPECT_EQ(param.size_bytes, sizeof(value));
    if (param.offset_bytes + sizeof(value) > packed.size()) {
      ADD_FAILURE() << "parameter past the packed size";
      return;
    }
    std::memcpy(packed.data() + param.offset_bytes, &value, sizeof(value));
  };
  (put(args), ...);
  return packed;
}

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
    ASSERT_OK_AND_ASSIGN(module_, context_->LoadModule(AsBytes("any image will do")));
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

TEST_F(FakeBackendTest, FreeOfAnUnknownAddressIsNotFound) {
  const DevicePtr ptr = Alloc(64);
  EXPECT_THAT(context_->Free(ptr + 8), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(context_->Free(12345), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_THAT(context_->Free(ptr), IsOk());
  EXPECT_THAT(context_->Free(ptr), StatusIs(absl::StatusCode::kNotFound, HasSubstr(Hex(ptr))));
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
                       "the fake backend runs only its built-in host kernels (multiply_them, "
                       "axpy_f32, fill_u32, add_one_f32, copy_bytes, fault_illegal_address, "
                       "spin_us); it has no kernel 'saxpy'"));
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
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> other_module, other->LoadModule(AsBytes("x")));
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
  EXPECT_THAT(context_->LoadModule(AsBytes("x")), aborted);
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

TEST_F(FakeBackendTest, BinaryImagesLoadWithBuiltInKernelsAndNoGlobals) {
  const std::vector<uint8_t> cubin = {0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, '.', 'g'};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Module> module, context_->LoadModule(cubin));
  EXPECT_THAT(module->GetFunction("multiply_them"), IsOk());
  EXPECT_THAT(module->GetGlobal("g"), StatusIs(absl::StatusCode::kNotFound));
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
