// CUDA arrays (MemoryService.Allocate with an ArrayDescriptor) and 3D copies (Copy3DCommand),
// through the C++ client against a real gpurpcd with real worker processes: shapes and
// formats round trip, copies land where the layout says, every out-of-bounds or malformed
// request is refused with nothing written, arrays belong to one session, and they count
// against the tenant's device-memory quota. Compiled twice: label `service` with the fake
// backend, label `gpu` with the CUDA backend (GPURPC_TEST_BACKEND), where the worker makes
// real cuArray3DCreate arrays and copies with cuMemcpy3DAsync; it skips without a driver.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr char kBackend[] = GPURPC_TEST_BACKEND;
constexpr uint64_t kMiB = 1ull << 20;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 rng(seed);
  for (auto& byte : out) byte = static_cast<uint8_t>(rng());
  return out;
}

v1::ArrayDescriptor Shape(uint64_t width, uint64_t height, uint64_t depth, v1::ArrayFormat format,
                          uint32_t channels, uint32_t flags = 0) {
  v1::ArrayDescriptor descriptor;
  descriptor.set_width(width);
  descriptor.set_height(height);
  descriptor.set_depth(depth);
  descriptor.set_format(format);
  descriptor.set_num_channels(channels);
  descriptor.set_flags(flags);
  return descriptor;
}

class ArrayTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags = {}) {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA arrays: " << cuda;
      }
    }
    TestDaemon::Options options;
    options.backend = kBackend;
    options.extra_flags = std::move(flags);
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
    session_ = Open();
  }
  void SetUp() override { StartDaemon(); }

  Session Open() {
    auto session = client_->OpenSession(0, "array test");
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : Session();
  }

  // A raw Allocate, for requests the client library would not build.
  grpc::Status RawAllocate(const v1::AllocateRequest& request, v1::AllocateResponse* response) {
    auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
    v1::MemoryService::Stub stub(channel);
    grpc::ClientContext context;
    context.AddMetadata("gpurpc-session", std::to_string(session_.id()));
    return stub.Allocate(&context, request, response);
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  Session session_;
};

TEST_F(ArrayTest, ShapesAndFormatsRoundTrip) {
  struct Case {
    v1::ArrayDescriptor shape;
    uint64_t row_bytes;
  };
  const std::vector<Case> cases = {
      {Shape(1000, 0, 0, v1::ARRAY_FORMAT_FLOAT, 1), 4000},        // 1D
      {Shape(37, 19, 0, v1::ARRAY_FORMAT_UNSIGNED_INT8, 4), 148},  // 2D, uchar4
      {Shape(16, 8, 5, v1::ARRAY_FORMAT_HALF, 2), 64},             // 3D, half2
      {Shape(9, 7, 3, v1::ARRAY_FORMAT_SIGNED_INT32, 4), 144},     // 3D, int4
      {Shape(64, 32, 4, v1::ARRAY_FORMAT_UNSIGNED_INT16, 1, /*LAYERED*/ 1), 128},
      {Shape(33, 0, 0, v1::ARRAY_FORMAT_SIGNED_INT8, 2), 66},
      {Shape(40, 0, 3, v1::ARRAY_FORMAT_FLOAT, 1, /*LAYERED*/ 1), 160},
      {Shape(16, 16, 6, v1::ARRAY_FORMAT_FLOAT, 1, /*CUBEMAP*/ 4), 64},
      {Shape(16, 16, 0, v1::ARRAY_FORMAT_UNSIGNED_INT8, 4, /*TEXTURE_GATHER*/ 8), 64},
  };
  uint32_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.shape.ShortDebugString());
    auto array = session_.AllocateArray(c.shape);
    ASSERT_THAT(array, IsOk());
    EXPECT_NE(array->id(), 0u);
    EXPECT_EQ(array->row_bytes(), c.row_bytes);
    const uint64_t packed = array->row_bytes() * array->rows() * array->slices();
    // Charged at least what it holds.
    EXPECT_GE(array->charged_bytes(), packed);
    const std::vector<uint8_t> data = RandomBytes(packed, seed++);
    ASSERT_THAT(array->Upload(data), IsOk());
    auto back = array->Download();
    ASSERT_THAT(back, IsOk());
    EXPECT_EQ(*back, data);
  }
}

TEST_F(ArrayTest, CopiesLandWhereTheLayoutSays) {
  // A 2D float array of 20 x 10, and pitched linear memory of 24 floats per row.
  auto array = session_.AllocateArray(Shape(20, 10, 0, v1::ARRAY_FORMAT_FLOAT, 1));
  ASSERT_THAT(array, IsOk());
  ASSERT_THAT(array->Upload(std::vector<uint8_t>(20 * 10 * 4, 0)), IsOk());
  constexpr uint64_t kPitch = 24 * 4;
  auto linear = session_.Allocate(kPitch * 10);
  ASSERT_THAT(linear, IsOk());
  const std::vector<uint8_t> source = RandomBytes(kPitch * 10, 7);
  ASSERT_THAT(linear->Upload(source), IsOk());

  // 6 x 4 floats from linear row 2, column 3 into the array at column 5, row 1.
  const uint64_t src_offset = 2 * kPitch + 3 * 4;
  ASSERT_THAT(session_.Copy3D(array->at(5 * 4, 1),
                              Copy3DEnd::Linear(linear->at(src_offset), kPitch), 6 * 4, 4),
              IsOk());
  auto image = array->Download();
  ASSERT_THAT(image, IsOk());
  std::vector<uint8_t> expected(20 * 10 * 4, 0);
  for (int y = 0; y < 4; ++y) {
    std::memcpy(&expected[((1 + y) * 20 + 5) * 4], &source[src_offset + y * kPitch], 6 * 4);
  }
  EXPECT_EQ(*image, expected);

  // Array to array, then back out to pitched linear memory.
  auto other = session_.AllocateArray(Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1));
  ASSERT_THAT(other, IsOk());
  ASSERT_THAT(other->Upload(std::vector<uint8_t>(8 * 8 * 4, 0xee)), IsOk());
  ASSERT_THAT(session_.Copy3D(other->at(0, 2), array->at(5 * 4, 1), 6 * 4, 4), IsOk());
  auto out = session_.Allocate(32 * 4 * 8);
  ASSERT_THAT(out, IsOk());
  ASSERT_THAT(session_.Copy3D(Copy3DEnd::Linear(out->at(), 32 * 4), other->at(), 8 * 4, 8), IsOk());
  auto rows = out->Download();
  ASSERT_THAT(rows, IsOk());
  for (int y = 0; y < 8; ++y) {
    for (int x = 0; x < 8; ++x) {
      const uint8_t* got = &(*rows)[y * 32 * 4 + x * 4];
      std::vector<uint8_t> want(4, 0xee);
      if (y >= 2 && y < 6 && x < 6) {
        std::memcpy(want.data(), &source[src_offset + (y - 2) * kPitch + x * 4], 4);
      }
      EXPECT_EQ(std::vector<uint8_t>(got, got + 4), want) << "x " << x << " y " << y;
    }
  }
}

TEST_F(ArrayTest, ThreeDimensionalCopiesWithSlicePitch) {
  // 4 x 3 x 5 uchar2 array; linear memory with 10-byte rows and 4-row slices.
  auto array = session_.AllocateArray(Shape(4, 3, 5, v1::ARRAY_FORMAT_UNSIGNED_INT8, 2));
  ASSERT_THAT(array, IsOk());
  constexpr uint64_t kPitch = 10, kRows = 4, kSlices = 5;
  auto linear = session_.Allocate(kPitch * kRows * kSlices);
  ASSERT_THAT(linear, IsOk());
  const std::vector<uint8_t> source = RandomBytes(kPitch * kRows * kSlices, 3);
  ASSERT_THAT(linear->Upload(source), IsOk());
  ASSERT_THAT(session_.Copy3D(array->at(), Copy3DEnd::Linear(linear->at(), kPitch, kRows), 8, 3, 5),
              IsOk());
  auto packed = array->Download();
  ASSERT_THAT(packed, IsOk());
  ASSERT_EQ(packed->size(), 8u * 3 * 5);
  for (uint64_t z = 0; z < 5; ++z) {
    for (uint64_t y = 0; y < 3; ++y) {
      EXPECT_EQ(
          std::memcmp(&(*packed)[(z * 3 + y) * 8], &source[z * kPitch * kRows + y * kPitch], 8), 0)
          << "z " << z << " y " << y;
    }
  }
  // On a stream, queued, then synchronised.
  auto stream = session_.CreateStream();
  ASSERT_THAT(stream, IsOk());
  auto copy = session_.Allocate(8 * 3 * 5);
  ASSERT_THAT(copy, IsOk());
  ASSERT_THAT(session_.Copy3DAsync(Copy3DEnd::Linear(copy->at()), array->at(), 8, 3, 5, &*stream),
              IsOk());
  ASSERT_THAT(stream->Synchronize(), IsOk());
  EXPECT_THAT(copy->Download(), testing::IsOkAndHolds(*packed));
}

TEST_F(ArrayTest, BadShapesAreRefusedAndNothingIsCharged) {
  struct Case {
    const char* name;
    v1::ArrayDescriptor shape;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"no format", Shape(8, 8, 0, v1::ARRAY_FORMAT_UNSPECIFIED, 1), "not an ArrayFormat"},
      {"a format that is not one", Shape(8, 8, 0, static_cast<v1::ArrayFormat>(5), 1),
       "not an ArrayFormat"},
      {"3 channels", Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 3), "num_channels"},
      {"0 channels", Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 0), "num_channels"},
      {"width 0", Shape(0, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1), "width must be"},
      {"width past 2^20", Shape((1u << 20) + 1, 0, 0, v1::ARRAY_FORMAT_FLOAT, 1), "width must be"},
      {"depth without height", Shape(8, 0, 4, v1::ARRAY_FORMAT_FLOAT, 1), "needs a height"},
      {"layered without layers", Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1, 1), "depth >= 1"},
      {"a cubemap that is not square", Shape(8, 4, 6, v1::ARRAY_FORMAT_FLOAT, 1, 4), "CUBEMAP"},
      {"a cubemap of 5 faces", Shape(8, 8, 5, v1::ARRAY_FORMAT_FLOAT, 1, 4), "CUBEMAP"},
      {"a layered cubemap of 8 faces", Shape(8, 8, 8, v1::ARRAY_FORMAT_FLOAT, 1, 5), "CUBEMAP"},
      {"gather on a 3D array", Shape(8, 8, 2, v1::ARRAY_FORMAT_FLOAT, 1, 8), "TEXTURE_GATHER"},
      {"huge in every dimension", Shape(1u << 20, 1u << 20, 1u << 20, v1::ARRAY_FORMAT_FLOAT, 4),
       "larger than any device"},
      {"an unknown flag", Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1, 0x10), "flags"},
      {"sparse (not served)", Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1, 0x40), "flags"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT(session_.AllocateArray(c.shape).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.says)));
  }
  // size_bytes beside an array (a client trying to pick its own charge).
  v1::AllocateRequest request;
  request.set_size_bytes(1);
  *request.mutable_array() = Shape(1024, 1024, 0, v1::ARRAY_FORMAT_FLOAT, 4);
  v1::AllocateResponse response;
  const grpc::Status status = RawAllocate(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("size_bytes must be 0"));
  // Nothing is held: the session's ledger is empty.
  auto info = client_->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 0u);
  // And the session still works.
  EXPECT_THAT(session_.AllocateArray(Shape(8, 8, 0, v1::ARRAY_FORMAT_FLOAT, 1)).status(), IsOk());
}

TEST_F(ArrayTest, OutOfBoundsCopiesAreRefusedAndWriteNothing) {
  auto array = session_.AllocateArray(Shape(16, 8, 2, v1::ARRAY_FORMAT_FLOAT, 1));  // 64 B rows
  ASSERT_THAT(array, IsOk());
  const std::vector<uint8_t> original = RandomBytes(64 * 8 * 2, 11);
  ASSERT_THAT(array->Upload(original), IsOk());
  auto linear = session_.Allocate(4096);
  ASSERT_THAT(linear, IsOk());
  const std::vector<uint8_t> linear_original = RandomBytes(4096, 12);
  ASSERT_THAT(linear->Upload(linear_original), IsOk());
  Copy3DEnd unknown;
  unknown.array_id = 0x123456789;
  Copy3DEnd linear_with_offset = Copy3DEnd::Linear(linear->at());
  linear_with_offset.y = 1;
  Copy3DEnd array_with_pitch = array->at();
  array_with_pitch.pitch_bytes = 64;

  struct Case {
    const char* name;
    Copy3DEnd dst;
    Copy3DEnd src;
    uint64_t width, height, depth;
    absl::StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"a row past the array's width", array->at(4), Copy3DEnd::Linear(linear->at()), 64, 1, 1,
       absl::StatusCode::kInvalidArgument, "leave array"},
      {"rows past its height", array->at(0, 5), Copy3DEnd::Linear(linear->at()), 64, 4, 1,
       absl::StatusCode::kInvalidArgument, "leave array"},
      {"slices past its depth", array->at(0, 0, 1), Copy3DEnd::Linear(linear->at()), 64, 8, 2,
       absl::StatusCode::kInvalidArgument, "leave array"},
      {"x not a multiple of the element", array->at(2), Copy3DEnd::Linear(linear->at()), 8, 1, 1,
       absl::StatusCode::kInvalidArgument, "multiples of the array's element size"},
      {"a width that splits an element", array->at(), Copy3DEnd::Linear(linear->at()), 6, 1, 1,
       absl::StatusCode::kInvalidArgument, "multiples of the array's element size"},
      {"offsets that wrap around", array->at(0, ~0ull - 2), Copy3DEnd::Linear(linear->at()), 4, 4,
       1, absl::StatusCode::kInvalidArgument, "leave array"},
      {"linear source past its buffer", array->at(), Copy3DEnd::Linear(linear->at(), 1024), 64, 8,
       1, absl::StatusCode::kInvalidArgument, "outside the buffer"},
      {"linear rows not fitting the pitch", array->at(), Copy3DEnd::Linear(linear->at(), 32), 64, 1,
       1, absl::StatusCode::kInvalidArgument, "do not fit a pitch"},
      {"a pitch past 2^31", array->at(), Copy3DEnd::Linear(linear->at(), 1ull << 40), 64, 2, 1,
       absl::StatusCode::kInvalidArgument, "at most"},
      {"an extent that overflows", array->at(),
       Copy3DEnd::Linear(linear->at(), (1ull << 31) - 1, (1ull << 31) - 1), 64, 8, 2,
       absl::StatusCode::kInvalidArgument, "outside the buffer"},
      {"array offsets on linear memory", array->at(), linear_with_offset, 64, 1, 1,
       absl::StatusCode::kInvalidArgument, "put the offset in the pointer"},
      {"a pitch on an array", array_with_pitch, Copy3DEnd::Linear(linear->at()), 64, 1, 1,
       absl::StatusCode::kInvalidArgument, "an array has its own layout"},
      {"an unknown array", unknown, Copy3DEnd::Linear(linear->at()), 4, 1, 1,
       absl::StatusCode::kNotFound, "array"},
      {"an unknown array as the source", Copy3DEnd::Linear(linear->at()), unknown, 4, 1, 1,
       absl::StatusCode::kNotFound, "array"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT(session_.Copy3D(c.dst, c.src, c.width, c.height, c.depth),
                StatusIs(c.code, HasSubstr(c.says)));
  }
  // A buffer id is not an array id, nor an array id a buffer.
  Copy3DEnd buffer_as_array;
  buffer_as_array.array_id = linear->id();
  EXPECT_THAT(session_.Copy3D(buffer_as_array, array->at(), 4, 1, 1),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(session_.CopyDeviceToDevice(linear->at(), DeviceRef{array->id(), 0, 0}, 4),
              StatusIs(absl::StatusCode::kNotFound));
  // Nothing was written anywhere, and the session is usable.
  EXPECT_THAT(array->Download(), testing::IsOkAndHolds(original));
  EXPECT_THAT(linear->Download(), testing::IsOkAndHolds(linear_original));
  // A zero extent copies nothing and is fine.
  EXPECT_THAT(session_.Copy3D(array->at(), Copy3DEnd::Linear(linear->at()), 0, 1, 1), IsOk());
}

// What an array is charged covers what the device gives it: for each shape, 64 arrays take
// no more free memory than 64 charges plus one 2 MiB page of allocation granularity. (On the
// fake the device use is the packed size; on a GPU the driver's tiled layout.)
TEST_F(ArrayTest, TheChargeCoversWhatTheDeviceUses) {
  const std::vector<v1::ArrayDescriptor> shapes = {
      Shape(1, 0, 0, v1::ARRAY_FORMAT_UNSIGNED_INT8, 1),
      Shape(3, 3, 0, v1::ARRAY_FORMAT_FLOAT, 1),
      Shape(100, 0, 0, v1::ARRAY_FORMAT_FLOAT, 4),
      Shape(129, 33, 0, v1::ARRAY_FORMAT_FLOAT, 1),
      Shape(500, 300, 0, v1::ARRAY_FORMAT_UNSIGNED_INT8, 4),
      Shape(33, 17, 9, v1::ARRAY_FORMAT_HALF, 2),
      Shape(64, 64, 64, v1::ARRAY_FORMAT_FLOAT, 1),
      Shape(1000, 1000, 0, v1::ARRAY_FORMAT_FLOAT, 1, /*SURFACE_LDST*/ 2),
  };
  for (const v1::ArrayDescriptor& shape : shapes) {
    SCOPED_TRACE(shape.ShortDebugString());
    auto before = session_.GetMemInfo();
    ASSERT_THAT(before, IsOk());
    std::vector<Array> arrays;
    uint64_t charged = 0;
    for (int i = 0; i < 64; ++i) {
      auto array = session_.AllocateArray(shape);
      ASSERT_THAT(array, IsOk());
      charged += array->charged_bytes();
      arrays.push_back(*std::move(array));
    }
    auto after = session_.GetMemInfo();
    ASSERT_THAT(after, IsOk());
    const uint64_t used = before->free_bytes - after->free_bytes;
    std::printf("array %s: 64 use %llu bytes of the device, charged %llu\n",
                shape.ShortDebugString().c_str(), static_cast<unsigned long long>(used),
                static_cast<unsigned long long>(charged));
    EXPECT_LE(used, charged + 2 * kMiB);
  }
}

TEST_F(ArrayTest, ArraysBelongToOneSessionAndFreeOnce) {
  auto array = session_.AllocateArray(Shape(32, 32, 0, v1::ARRAY_FORMAT_FLOAT, 1));
  ASSERT_THAT(array, IsOk());
  Session other = Open();
  auto theirs = other.Allocate(32 * 32 * 4);
  ASSERT_THAT(theirs, IsOk());
  // Another session cannot name this session's array, in either direction.
  Copy3DEnd stolen;
  stolen.array_id = array->id();
  EXPECT_THAT(other.Copy3D(Copy3DEnd::Linear(theirs->at()), stolen, 128, 32),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(other.Copy3D(stolen, Copy3DEnd::Linear(theirs->at()), 128, 32),
              StatusIs(absl::StatusCode::kNotFound));
  auto mine = session_.Allocate(128);
  ASSERT_THAT(mine, IsOk());

  const uint64_t id = array->id();
  ASSERT_THAT(array->Free(), IsOk());
  EXPECT_THAT(array->Free(), StatusIs(absl::StatusCode::kNotFound));
  Copy3DEnd freed;
  freed.array_id = id;
  EXPECT_THAT(session_.Copy3D(Copy3DEnd::Linear(mine->at()), freed, 128, 1),
              StatusIs(absl::StatusCode::kNotFound));
}

// A daemon of its own with a 4 MiB quota for every tenant.
class ArrayQuotaTest : public ArrayTest {
 protected:
  void SetUp() override {
    config_ = absl::StrCat(::testing::TempDir(), "/array_quota_", getpid(), ".conf");
    std::ofstream(config_) << "default_quota { max_device_memory_bytes: " << 4 * kMiB << " }\n";
    StartDaemon({absl::StrCat("--config=", config_)});
  }
  void TearDown() override { std::remove(config_.c_str()); }
  std::string config_;
};

TEST_F(ArrayQuotaTest, ArraysCountAgainstTheTenantsMemoryQuota) {
  // 1024 x 512 floats: charged 2 MiB (1024 * 4 bytes a row, 512 rows).
  auto first = session_.AllocateArray(Shape(1024, 512, 0, v1::ARRAY_FORMAT_FLOAT, 1));
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->charged_bytes(), 2 * kMiB);
  auto info = client_->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 2 * kMiB);
  // 2 MiB + 3 MiB > 4 MiB: refused, naming the quota.
  auto refused = session_.AllocateArray(Shape(1024, 768, 0, v1::ARRAY_FORMAT_FLOAT, 1));
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
  // Linear memory and arrays share the one ledger.
  EXPECT_THAT(session_.Allocate(3 * kMiB).status(), StatusIs(absl::StatusCode::kResourceExhausted));
  // Freeing gives the bytes back.
  ASSERT_THAT(first->Free(), IsOk());
  info = client_->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 0u);
  EXPECT_THAT(session_.AllocateArray(Shape(1024, 768, 0, v1::ARRAY_FORMAT_FLOAT, 1)).status(),
              IsOk());
  // Closing the session gives back what it held.
  ASSERT_THAT(session_.Close(), IsOk());
  info = client_->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 0u);
}

}  // namespace
}  // namespace gpurpc
