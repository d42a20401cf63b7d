// One conformance suite for backend::Context (server/worker/backend/backend.h), run against
// both backends: what the contract promises and the session layer relies on, with the same
// calls, the same kernels (kFakeKernelsSource, compiled by the real NVRTC for the context's
// CompileTarget) and the same expected status codes.
//
// GPURPC_CONFORMANCE_BACKEND picks the backend a binary tests: "fake" (backend_conformance_test,
// label unit) or "cuda" (backend_conformance_gpu_test, label gpu; every test skips, printing
// why, when there is no driver or no device).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "server/worker/compiler/compiler.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/pack_args.h"
#include "tests/testing/status_matchers.h"

#ifndef GPURPC_CONFORMANCE_BACKEND
#error "define GPURPC_CONFORMANCE_BACKEND as \"fake\" or \"cuda\""
#endif

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::PackArgs;
using ::gpurpc::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Ge;
using ::testing::HasSubstr;

constexpr uint64_t kFakeMemoryBytes = uint64_t{256} << 20;

struct FakeBackendFactory {
  static constexpr const char* kName = "fake";
  static absl::StatusOr<std::unique_ptr<Backend>> Make() {
    return MakeFakeBackend(kFakeMemoryBytes);
  }
};

struct CudaBackendFactory {
  static constexpr const char* kName = "cuda";
  static absl::StatusOr<std::unique_ptr<Backend>> Make() { return MakeCudaBackend(); }
};

constexpr bool Selected(std::string_view name) {
  return std::string_view(GPURPC_CONFORMANCE_BACKEND) == name;
}
static_assert(Selected("fake") || Selected("cuda"),
              "GPURPC_CONFORMANCE_BACKEND must be \"fake\" or \"cuda\"");
using Factories = std::conditional_t<Selected("cuda"), ::testing::Types<CudaBackendFactory>,
                                     ::testing::Types<FakeBackendFactory>>;

struct FactoryName {
  template <typename Factory>
  static std::string GetName(int) {
    return Factory::kName;
  }
};

// Bytes that differ from their neighbours and from any memset value used here.
std::vector<uint8_t> Pattern(size_t size, uint8_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) {
    bytes[i] = static_cast<uint8_t>((i * 131 + (i >> 8) * 7 + seed) % 251);
  }
  return bytes;
}

absl::Span<const uint8_t> AsBytes(absl::string_view text) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// kFakeKernelsSource compiled by NVRTC (no GPU needed) for `target`, once per target.
absl::StatusOr<std::string> CompileFakeKernels(const std::string& target) {
  static auto* const images = new std::map<std::string, std::string>();
  if (const auto it = images->find(target); it != images->end()) return it->second;
  compiler::CompilerOptions options;
  options.cache_dir = "";
  absl::StatusOr<std::unique_ptr<compiler::Compiler>> compiler =
      compiler::Compiler::Create(options);
  if (!compiler.ok()) return compiler.status();
  compiler::CompileRequest request;
  request.source = ::gpurpc::testing::kFakeKernelsSource;
  request.target = target;
  absl::StatusOr<compiler::CompileResult> result = (*compiler)->Compile(request);
  if (!result.ok()) return result.status();
  if (!result->success) {
    return absl::InternalError(absl::StrCat("the fake kernels do not compile: ", result->log));
  }
  std::string image(result->image.begin(), result->image.end());
  images->emplace(target, image);
  return image;
}

LaunchConfig Blocks(uint32_t blocks, uint32_t threads_per_block) {
  LaunchConfig config;
  config.grid.x = blocks;
  config.block.x = threads_per_block;
  return config;
}

template <typename Factory>
class BackendConformanceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = Factory::Make();
    if (!backend.ok()) {
      GTEST_SKIP() << "no " << Factory::kName << " backend: " << backend.status();
    }
    backend_ = std::move(backend).value();
    ASSERT_OK_AND_ASSIGN(context_, backend_->OpenContext(0));
  }

  Context& context() { return *context_; }

  absl::StatusOr<DevicePtr> AllocFilled(uint64_t size_bytes, uint8_t value) {
    absl::StatusOr<DevicePtr> ptr = context_->Alloc(size_bytes);
    if (!ptr.ok()) return ptr;
    if (absl::Status s = context_->Memset(*ptr, value, 1, size_bytes, nullptr); !s.ok()) return s;
    if (absl::Status s = context_->Synchronize(); !s.ok()) return s;
    return ptr;
  }

  absl::StatusOr<std::vector<uint8_t>> Read(DevicePtr src, uint64_t size_bytes,
                                            Stream* stream = nullptr) {
    std::vector<uint8_t> bytes(size_bytes);
    absl::Status status = context_->Download(bytes.data(), src, size_bytes, stream);
    if (!status.ok()) return status;
    return bytes;
  }

  // The fake kernels, compiled for this context and loaded once per test.
  absl::StatusOr<Module*> Kernels() {
    if (kernels_ != nullptr) return kernels_.get();
    absl::StatusOr<std::string> image = CompileFakeKernels(context_->CompileTarget());
    if (!image.ok()) return image.status();
    absl::StatusOr<std::unique_ptr<Module>> module = context_->LoadModule(AsBytes(*image));
    if (!module.ok()) return module.status();
    kernels_ = std::move(module).value();
    return kernels_.get();
  }

  absl::StatusOr<Function*> Kernel(const std::string& name) {
    absl::StatusOr<Module*> kernels = Kernels();
    if (!kernels.ok()) return kernels.status();
    return (*kernels)->GetFunction(name);
  }

  // A kernel that runs for `microseconds` on `stream`, so that what follows it is queued.
  absl::Status Spin(uint64_t microseconds, Stream* stream) {
    absl::StatusOr<Function*> spin = Kernel("spin_us");
    if (!spin.ok()) return spin.status();
    return context_->Launch(*spin, Blocks(1, 1), PackArgs(**spin, microseconds), stream);
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Context> context_;
  std::unique_ptr<Module> kernels_;
};

TYPED_TEST_SUITE(BackendConformanceTest, Factories, FactoryName);

// --- Memory ---------------------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, AllocLowersFreeMemoryAndFreeGivesItBack) {
  constexpr uint64_t kSize = uint64_t{64} << 20;
  ASSERT_OK_AND_ASSIGN(const MemInfo before, this->context().GetMemInfo());
  EXPECT_GT(before.total_bytes, 0u);
  EXPECT_LE(before.free_bytes, before.total_bytes);
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->context().Alloc(kSize));
  EXPECT_NE(ptr, 0u);
  ASSERT_OK_AND_ASSIGN(const MemInfo allocated, this->context().GetMemInfo());
  EXPECT_LE(allocated.free_bytes + kSize, before.free_bytes);
  EXPECT_EQ(allocated.total_bytes, before.total_bytes);
  ASSERT_OK(this->context().Free(ptr));
  ASSERT_OK_AND_ASSIGN(const MemInfo freed, this->context().GetMemInfo());
  EXPECT_GE(freed.free_bytes, allocated.free_bytes + kSize);
}

TYPED_TEST(BackendConformanceTest, AllocOfZeroBytesIsInvalidArgument) {
  EXPECT_THAT(this->context().Alloc(0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemAlloc")));
  // Not sticky.
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->context().Alloc(1));
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, FreeOfAnUnknownAddressIsInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->context().Alloc(4096));
  // Inside an allocation, and nowhere near one: addresses are arguments, not names.
  EXPECT_THAT(this->context().Free(ptr + 256),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemFree")));
  EXPECT_THAT(this->context().Free(0x1000),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemFree")));
  // The allocation is still live and the context still works.
  EXPECT_OK(this->context().Free(ptr));
  EXPECT_OK(this->context().Synchronize());
}

TYPED_TEST(BackendConformanceTest, DoubleFreeIsInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->context().Alloc(4096));
  ASSERT_OK(this->context().Free(ptr));
  EXPECT_THAT(this->context().Free(ptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemFree")));
  ASSERT_OK_AND_ASSIGN(const DevicePtr again, this->context().Alloc(4096));
  EXPECT_OK(this->context().Free(again));
  EXPECT_OK(this->context().Synchronize());
}

// --- Copies and memsets ---------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, UploadAndDownloadRoundTripOddSizesAtAnOffset) {
  constexpr uint64_t kOffset = 13;
  constexpr uint64_t kMargin = 16;
  // Below and above the CUDA backend's small-transfer and staging-slot sizes.
  for (const uint64_t size :
       {uint64_t{1}, uint64_t{7}, uint64_t{4099}, uint64_t{65537}, (uint64_t{9} << 20) + 3}) {
    SCOPED_TRACE(size);
    const uint64_t total = kOffset + size + kMargin;
    ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(total, 0xEE));
    const std::vector<uint8_t> data = Pattern(size, static_cast<uint8_t>(size));
    ASSERT_OK(this->context().Upload(ptr + kOffset, data.data(), size, nullptr));
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr + kOffset, size));
    EXPECT_TRUE(back == data);
    // Nothing outside [offset, offset + size) was written.
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> all, this->Read(ptr, total));
    EXPECT_EQ(std::vector<uint8_t>(all.begin(), all.begin() + kOffset),
              std::vector<uint8_t>(kOffset, 0xEE));
    EXPECT_EQ(std::vector<uint8_t>(all.end() - kMargin, all.end()),
              std::vector<uint8_t>(kMargin, 0xEE));
    EXPECT_OK(this->context().Free(ptr));
  }
}

// A message that arrived in slices: the pieces land end to end, whatever their sizes (empty
// ones too), also where a piece straddles the CUDA backend's 8 MiB staging slots, and the
// pieces' memory may be reused at once.
TYPED_TEST(BackendConformanceTest, UploadPiecesLandsThePiecesEndToEnd) {
  constexpr uint64_t kOffset = 13;
  constexpr uint64_t kMargin = 16;
  const std::vector<std::vector<uint64_t>> layouts = {
      {5},                                                     // one piece, small
      {0, 3, 0, 4096, 1, 0},                                   // small total, empty pieces between
      {16384, 16384, 16384, 16384, 7},                         // above the small-transfer size
      {(uint64_t{8} << 20) - 5, 10, (uint64_t{1} << 20) + 3},  // one across the slot edge
      {(uint64_t{20} << 20) + 1},                              // one piece over several slots
  };
  for (const std::vector<uint64_t>& layout : layouts) {
    uint64_t size = 0;
    for (uint64_t n : layout) size += n;
    SCOPED_TRACE(absl::StrCat(layout.size(), " pieces, ", size, " bytes"));
    const uint64_t total = kOffset + size + kMargin;
    ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(total, 0xEE));
    const std::vector<uint8_t> data = Pattern(size, static_cast<uint8_t>(layout.size()));
    std::vector<std::vector<uint8_t>> copies;
    std::vector<absl::Span<const uint8_t>> pieces;
    for (uint64_t at = 0, i = 0; i < layout.size(); at += layout[i], ++i) {
      copies.emplace_back(data.begin() + at, data.begin() + at + layout[i]);
    }
    for (const auto& copy : copies) pieces.emplace_back(copy.data(), copy.size());
    ASSERT_OK(this->context().UploadPieces(ptr + kOffset, pieces, nullptr));
    for (auto& copy : copies) std::fill(copy.begin(), copy.end(), 0x55);  // reused at once
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> all, this->Read(ptr, total));
    EXPECT_TRUE(std::equal(data.begin(), data.end(), all.begin() + kOffset)) << "bytes differ";
    EXPECT_EQ(std::vector<uint8_t>(all.begin(), all.begin() + kOffset),
              std::vector<uint8_t>(kOffset, 0xEE));
    EXPECT_EQ(std::vector<uint8_t>(all.end() - kMargin, all.end()),
              std::vector<uint8_t>(kMargin, 0xEE));
    EXPECT_OK(this->context().Free(ptr));
  }
}

TYPED_TEST(BackendConformanceTest, UploadAndDownloadRoundTripOnCreatedStreams) {
  for (const bool non_blocking : {false, true}) {
    SCOPED_TRACE(non_blocking ? "non-blocking" : "blocking");
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream,
                         this->context().CreateStream(non_blocking));
    constexpr uint64_t kSize = 100003;
    ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->context().Alloc(kSize + 64));
    const std::vector<uint8_t> data = Pattern(kSize, non_blocking ? 1 : 2);
    ASSERT_OK(this->context().Upload(ptr + 5, data.data(), kSize, stream.get()));
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr + 5, kSize, stream.get()));
    EXPECT_TRUE(back == data);
    EXPECT_OK(this->context().Free(ptr));
  }
}

TYPED_TEST(BackendConformanceTest, MemsetWritesElementsOfOneTwoAndFourBytes) {
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(128, 0));
  ASSERT_OK(this->context().Memset(ptr + 3, 0x5A, 1, 5, nullptr));
  ASSERT_OK(this->context().Memset(ptr + 16, 0xBEEF, 2, 7, nullptr));
  ASSERT_OK(this->context().Memset(ptr + 64, 0xDEADBEEF, 4, 9, nullptr));
  std::vector<uint8_t> expected(128, 0);
  for (int i = 0; i < 5; ++i) expected[3 + i] = 0x5A;
  for (int i = 0; i < 7; ++i) {
    const uint16_t value = 0xBEEF;
    std::memcpy(&expected[16 + 2 * i], &value, sizeof(value));
  }
  for (int i = 0; i < 9; ++i) {
    const uint32_t value = 0xDEADBEEF;
    std::memcpy(&expected[64 + 4 * i], &value, sizeof(value));
  }
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr, 128));
  EXPECT_EQ(back, expected);
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, MemsetOfAnElementSizeOtherThanOneTwoOrFourIsInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(64, 0x11));
  for (const uint32_t element_size : {0u, 3u, 8u}) {
    EXPECT_THAT(this->context().Memset(ptr, 0, element_size, 4, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemset")))
        << element_size;
  }
  // Nothing was written.
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr, 64));
  EXPECT_EQ(back, std::vector<uint8_t>(64, 0x11));
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, MemsetOfAMisalignedAddressIsInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(64, 0));
  EXPECT_THAT(this->context().Memset(ptr + 1, 0, 2, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemsetD16Async")));
  EXPECT_THAT(this->context().Memset(ptr + 2, 0, 4, 1, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuMemsetD32Async")));
  EXPECT_OK(this->context().Synchronize());
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, ZeroByteOperationsSucceedWhateverTheAddress) {
  constexpr DevicePtr kNowhere = 0x1000;
  uint8_t byte = 0;
  EXPECT_OK(this->context().Upload(kNowhere, &byte, 0, nullptr));
  EXPECT_OK(this->context().Download(&byte, kNowhere, 0, nullptr));
  EXPECT_OK(this->context().CopyDeviceToDevice(kNowhere, kNowhere + 64, 0, nullptr));
  EXPECT_OK(this->context().Memset(kNowhere + 1, 0, 4, 0, nullptr));
  EXPECT_OK(this->context().Synchronize());
}

TYPED_TEST(BackendConformanceTest, CopyDeviceToDeviceCopiesBetweenAndWithinAllocations) {
  constexpr uint64_t kSize = 70001;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  const std::vector<uint8_t> data = Pattern(kSize, 9);
  ASSERT_OK_AND_ASSIGN(const DevicePtr src, this->context().Alloc(kSize));
  ASSERT_OK_AND_ASSIGN(const DevicePtr dst, this->AllocFilled(2 * kSize + 32, 0x33));
  ASSERT_OK(this->context().Upload(src, data.data(), kSize, stream.get()));
  ASSERT_OK(this->context().CopyDeviceToDevice(dst + 7, src, kSize, stream.get()));
  // Within one allocation: the copy's second half from its first.
  ASSERT_OK(this->context().CopyDeviceToDevice(dst + 7 + kSize, dst + 7, kSize, stream.get()));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back,
                       this->Read(dst, 2 * kSize + 32, stream.get()));
  EXPECT_EQ(std::vector<uint8_t>(back.begin(), back.begin() + 7), std::vector<uint8_t>(7, 0x33));
  EXPECT_TRUE(std::vector<uint8_t>(back.begin() + 7, back.begin() + 7 + kSize) == data);
  EXPECT_TRUE(std::vector<uint8_t>(back.begin() + 7 + kSize, back.begin() + 7 + 2 * kSize) == data);
  EXPECT_EQ(back.back(), 0x33);
  EXPECT_OK(this->context().Free(src));
  EXPECT_OK(this->context().Free(dst));
}

// --- Arrays and 3D copies --------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, Copy3DMovesRowsBetweenPitchedMemoryAndArrays) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  // A 2D float array of 12 x 6 (48-byte rows) and pitched linear memory of 64-byte rows.
  ArrayShape shape;
  shape.width = 12;
  shape.height = 6;
  shape.format = 0x20;  // CU_AD_FORMAT_FLOAT
  shape.num_channels = 1;
  shape.element_bytes = 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Array> array, this->context().CreateArray(shape));
  constexpr uint64_t kPitch = 64, kRows = 6;
  const std::vector<uint8_t> data = Pattern(kPitch * kRows, 21);
  ASSERT_OK_AND_ASSIGN(const DevicePtr src, this->context().Alloc(kPitch * kRows));
  ASSERT_OK(this->context().Upload(src, data.data(), data.size(), stream.get()));
  ASSERT_OK_AND_ASSIGN(const DevicePtr dst, this->AllocFilled(48 * kRows, 0x5a));
  // Zero the array, then copy 4 x 3 floats from linear (row 1, byte 8) into it at (x 16
  // bytes, y 2), then the whole array back out densely.
  ASSERT_OK_AND_ASSIGN(const DevicePtr zeros, this->AllocFilled(48 * kRows, 0));
  Copy3DEnd dense{nullptr, zeros, 48, kRows};
  Copy3DEnd whole{array.get()};
  ASSERT_OK(this->context().Copy3D(whole, dense, 48, kRows, 1, stream.get()));
  Copy3DEnd from{nullptr, src + kPitch + 8, kPitch, kRows};
  Copy3DEnd into{array.get(), 0, 0, 0, 16, 2, 0};
  ASSERT_OK(this->context().Copy3D(into, from, 16, 3, 1, stream.get()));
  Copy3DEnd out{nullptr, dst, 48, kRows};
  ASSERT_OK(this->context().Copy3D(out, whole, 48, kRows, 1, stream.get()));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(dst, 48 * kRows, stream.get()));
  std::vector<uint8_t> expected(48 * kRows, 0);
  for (uint64_t y = 0; y < 3; ++y) {
    std::copy_n(data.begin() + (1 + y) * kPitch + 8, 16, expected.begin() + (2 + y) * 48 + 16);
  }
  EXPECT_TRUE(back == expected);
  // 3D: two slices of linear memory with a slice pitch of 8 rows into a 3D array and back.
  ArrayShape cube = shape;
  cube.depth = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Array> volume, this->context().CreateArray(cube));
  ASSERT_OK_AND_ASSIGN(const DevicePtr slices, this->context().Alloc(kPitch * 8 * 2));
  const std::vector<uint8_t> slice_data = Pattern(kPitch * 8 * 2, 22);
  ASSERT_OK(this->context().Upload(slices, slice_data.data(), slice_data.size(), stream.get()));
  ASSERT_OK(this->context().Copy3D(Copy3DEnd{volume.get()}, Copy3DEnd{nullptr, slices, kPitch, 8},
                                   48, kRows, 2, stream.get()));
  ASSERT_OK_AND_ASSIGN(const DevicePtr packed, this->AllocFilled(48 * kRows * 2, 0));
  ASSERT_OK(this->context().Copy3D(Copy3DEnd{nullptr, packed, 48, kRows}, Copy3DEnd{volume.get()},
                                   48, kRows, 2, stream.get()));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> cube_back,
                       this->Read(packed, 48 * kRows * 2, stream.get()));
  for (uint64_t z = 0; z < 2; ++z) {
    for (uint64_t y = 0; y < kRows; ++y) {
      EXPECT_TRUE(std::equal(cube_back.begin() + (z * kRows + y) * 48,
                             cube_back.begin() + (z * kRows + y) * 48 + 48,
                             slice_data.begin() + z * kPitch * 8 + y * kPitch))
          << "z " << z << " y " << y;
    }
  }
  volume.reset();
  array.reset();
  for (DevicePtr ptr : {src, dst, zeros, slices, packed}) EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, ProfilingStartsAndStopsWithoutAProfiler) {
  EXPECT_OK(this->context().SetProfiling(true));
  EXPECT_OK(this->context().SetProfiling(false));
  EXPECT_OK(this->context().Synchronize());
}

// --- Streams --------------------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, DownloadSeesUploadAndMemsetQueuedBeforeItOnTheSameStream) {
  constexpr uint64_t kSize = 4096;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(kSize, 0));
  const std::vector<uint8_t> data = Pattern(kSize, 4);
  // Behind a running kernel, so that the upload and the memset are still queued when the
  // download is asked for.
  ASSERT_OK(this->Spin(50000, stream.get()));
  ASSERT_OK(this->context().Upload(ptr, data.data(), kSize, stream.get()));
  ASSERT_OK(this->context().Memset(ptr + 1024, 0x7E, 1, 100, stream.get()));
  std::vector<uint8_t> expected = data;
  std::fill(expected.begin() + 1024, expected.begin() + 1124, 0x7E);
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr, kSize, stream.get()));
  EXPECT_TRUE(back == expected);
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, QueryStreamIsFalseWhileWorkRunsAndTrueAfterSynchronizeStream) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  ASSERT_OK(this->Spin(300000, stream.get()));
  EXPECT_THAT(this->context().QueryStream(stream.get()), IsOkAndHolds(false));
  ASSERT_OK(this->context().SynchronizeStream(stream.get()));
  EXPECT_THAT(this->context().QueryStream(stream.get()), IsOkAndHolds(true));
  // The default stream too.
  ASSERT_OK(this->Spin(1000, nullptr));
  ASSERT_OK(this->context().SynchronizeStream(nullptr));
  EXPECT_THAT(this->context().QueryStream(nullptr), IsOkAndHolds(true));
}

TYPED_TEST(BackendConformanceTest, StreamWaitEventOrdersAnotherStreamAfterTheRecordedWork) {
  constexpr uint64_t kSize = 1024;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> writer, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> reader, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> written, this->context().CreateEvent(true, false));
  ASSERT_OK_AND_ASSIGN(const DevicePtr ptr, this->AllocFilled(kSize, 0));
  ASSERT_OK(this->Spin(50000, writer.get()));
  ASSERT_OK(this->context().Memset(ptr, 0x77, 1, kSize, writer.get()));
  ASSERT_OK(this->context().RecordEvent(written.get(), writer.get()));
  ASSERT_OK(this->context().StreamWaitEvent(reader.get(), written.get()));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(ptr, kSize, reader.get()));
  EXPECT_EQ(back, std::vector<uint8_t>(kSize, 0x77));
  EXPECT_OK(this->context().Free(ptr));
}

TYPED_TEST(BackendConformanceTest, StreamWaitEventOnANeverRecordedEventWaitsForNothing) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> busy, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> waiter, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> never, this->context().CreateEvent(false, false));
  ASSERT_OK(this->Spin(500000, busy.get()));
  ASSERT_OK(this->context().StreamWaitEvent(waiter.get(), never.get()));
  ASSERT_OK(this->context().SynchronizeStream(waiter.get()));
  // The waiter did not wait for the other stream's kernel.
  EXPECT_THAT(this->context().QueryStream(busy.get()), IsOkAndHolds(false));
  EXPECT_OK(this->context().SynchronizeStream(busy.get()));
}

// --- Events ---------------------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, QueryEventOfANeverRecordedEventIsTrue) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> event, this->context().CreateEvent(false, false));
  EXPECT_THAT(this->context().QueryEvent(event.get()), IsOkAndHolds(true));
  EXPECT_OK(this->context().SynchronizeEvent(event.get()));
}

TYPED_TEST(BackendConformanceTest, RecordedEventCompletesWithItsWorkAndSynchronizeEventWaitsForIt) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> event, this->context().CreateEvent(false, false));
  ASSERT_OK(this->Spin(300000, stream.get()));
  ASSERT_OK(this->context().RecordEvent(event.get(), stream.get()));
  EXPECT_THAT(this->context().QueryEvent(event.get()), IsOkAndHolds(false));
  ASSERT_OK(this->context().SynchronizeEvent(event.get()));
  EXPECT_THAT(this->context().QueryEvent(event.get()), IsOkAndHolds(true));
  EXPECT_THAT(this->context().QueryStream(stream.get()), IsOkAndHolds(true));
}

TYPED_TEST(BackendConformanceTest, ElapsedTimeBetweenTwoCompletedTimingEventsIsNotNegative) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, this->context().CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> end, this->context().CreateEvent(false, false));
  ASSERT_OK(this->context().RecordEvent(start.get(), stream.get()));
  ASSERT_OK(this->Spin(2000, stream.get()));
  ASSERT_OK(this->context().RecordEvent(end.get(), stream.get()));
  ASSERT_OK(this->context().SynchronizeEvent(end.get()));
  // The 2 ms kernel ran between the two records.
  EXPECT_THAT(this->context().ElapsedTime(start.get(), end.get()), IsOkAndHolds(Ge(1.0f)));
  EXPECT_THAT(this->context().ElapsedTime(start.get(), start.get()), IsOkAndHolds(0.0f));
}

TYPED_TEST(BackendConformanceTest, ElapsedTimeWithATimingDisabledEventIsFailedPrecondition) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> timed, this->context().CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> untimed, this->context().CreateEvent(true, false));
  ASSERT_OK(this->context().RecordEvent(timed.get(), nullptr));
  ASSERT_OK(this->context().RecordEvent(untimed.get(), nullptr));
  ASSERT_OK(this->context().Synchronize());
  EXPECT_THAT(this->context().ElapsedTime(timed.get(), untimed.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("cuEventElapsedTime"), HasSubstr("timing"))));
  EXPECT_THAT(this->context().ElapsedTime(untimed.get(), timed.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cuEventElapsedTime")));
}

TYPED_TEST(BackendConformanceTest, ElapsedTimeWithANeverRecordedEventIsFailedPrecondition) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> recorded, this->context().CreateEvent(false, false));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> never, this->context().CreateEvent(false, false));
  ASSERT_OK(this->context().RecordEvent(recorded.get(), nullptr));
  ASSERT_OK(this->context().Synchronize());
  EXPECT_THAT(this->context().ElapsedTime(recorded.get(), never.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("cuEventElapsedTime"), HasSubstr("recorded"))));
}

// --- Modules and kernels --------------------------------------------------------------------

TYPED_TEST(BackendConformanceTest, LoadModuleOfGarbageBytesIsInvalidArgument) {
  const std::vector<std::string> images = {
      std::string(),
      "this is not a module",
      std::string(4096, '\x7f'),
      // An ELF header, then nothing an ELF file holds.
      std::string("\177ELF\2\1\1", 7) + std::string(57, '\x5a'),
  };
  for (const std::string& garbage : images) {
    EXPECT_THAT(this->context().LoadModule(AsBytes(garbage)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuModuleLoadDataEx")))
        << garbage.size() << " bytes";
  }
  // Not sticky.
  EXPECT_OK(this->Kernels().status());
}

TYPED_TEST(BackendConformanceTest, GetFunctionOrGetGlobalOfAMissingNameIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Module * kernels, this->Kernels());
  EXPECT_THAT(kernels->GetFunction("no_such_kernel"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("cuModuleGetFunction"), HasSubstr("no_such_kernel"))));
  EXPECT_THAT(kernels->GetGlobal("no_such_global"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("cuModuleGetGlobal"), HasSubstr("no_such_global"))));
  // The module's own kernels are still found.
  EXPECT_OK(kernels->GetFunction("fill_u32").status());
}

TYPED_TEST(BackendConformanceTest, FunctionsReportTheParameterLayoutOfTheirSignature) {
  ASSERT_OK_AND_ASSIGN(Function * fill, this->Kernel("fill_u32"));
  // (unsigned* out, unsigned value, unsigned long long n)
  ASSERT_EQ(fill->params().size(), 3u);
  EXPECT_EQ(fill->params()[0].offset_bytes, 0u);
  EXPECT_EQ(fill->params()[0].size_bytes, 8u);
  EXPECT_EQ(fill->params()[1].offset_bytes, 8u);
  EXPECT_EQ(fill->params()[1].size_bytes, 4u);
  EXPECT_EQ(fill->params()[2].offset_bytes, 16u);
  EXPECT_EQ(fill->params()[2].size_bytes, 8u);
  EXPECT_GT(fill->attributes().max_threads_per_block, 0);
}

TYPED_TEST(BackendConformanceTest, LaunchedKernelWritesItsPatternToDeviceMemory) {
  constexpr uint64_t kWords = 1024;
  constexpr uint64_t kFilled = 1000;
  constexpr uint32_t kValue = 0xC0FFEE42;
  ASSERT_OK_AND_ASSIGN(Function * fill, this->Kernel("fill_u32"));
  ASSERT_OK_AND_ASSIGN(const DevicePtr out, this->AllocFilled(kWords * 4, 0));
  // 1024 threads, of which the first 1000 write.
  ASSERT_OK(
      this->context().Launch(fill, Blocks(8, 128), PackArgs(*fill, out, kValue, kFilled), nullptr));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> bytes, this->Read(out, kWords * 4));
  std::vector<uint32_t> words(kWords);
  std::memcpy(words.data(), bytes.data(), bytes.size());
  EXPECT_EQ(std::vector<uint32_t>(words.begin(), words.begin() + kFilled),
            std::vector<uint32_t>(kFilled, kValue));
  EXPECT_EQ(std::vector<uint32_t>(words.begin() + kFilled, words.end()),
            std::vector<uint32_t>(kWords - kFilled, 0u));
  EXPECT_OK(this->context().Free(out));
}

TYPED_TEST(BackendConformanceTest, KernelOnACreatedStreamRunsAfterTheUploadBeforeIt) {
  constexpr uint64_t kSize = 3001;
  ASSERT_OK_AND_ASSIGN(Function * copy, this->Kernel("copy_bytes"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, this->context().CreateStream(true));
  ASSERT_OK_AND_ASSIGN(const DevicePtr src, this->AllocFilled(kSize, 0));
  ASSERT_OK_AND_ASSIGN(const DevicePtr dst, this->AllocFilled(kSize, 0));
  const std::vector<uint8_t> data = Pattern(kSize, 77);
  ASSERT_OK(this->Spin(20000, stream.get()));
  ASSERT_OK(this->context().Upload(src, data.data(), kSize, stream.get()));
  ASSERT_OK(this->context().Launch(copy, Blocks((kSize + 255) / 256, 256),
                                   PackArgs(*copy, dst, src, kSize), stream.get()));
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> back, this->Read(dst, kSize, stream.get()));
  EXPECT_TRUE(back == data);
  EXPECT_OK(this->context().Free(src));
  EXPECT_OK(this->context().Free(dst));
}

}  // namespace
}  // namespace gpurpc::backend
