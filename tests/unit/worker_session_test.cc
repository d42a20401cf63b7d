// The worker's Session core over the fake backend, in process: handle tables, bounds
// checks, launch checks and command batches, without gRPC.
#include "server/worker/session.h"

#include <cstring>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::worker {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::HasSubstr;

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = backend::MakeFakeBackend(64ull << 20);
    auto context = backend_->OpenContext(0);
    ASSERT_THAT(context, IsOk());
    session_ = std::make_unique<Session>(std::move(*context), nullptr,
                                         absl::UnavailableError("no NVRTC in this test"));
    auto module = session_->LoadModule("fake image");
    ASSERT_THAT(module, IsOk());
    module_ = *module;
  }

  uint64_t Function(const std::string& name) {
    auto function = session_->GetFunction(module_, name);
    EXPECT_THAT(function, IsOk());
    return function.ok() ? function->function_id() : 0;
  }

  static v1::DevicePointer At(const v1::BufferInfo& buffer, uint64_t offset = 0) {
    v1::DevicePointer pointer;
    pointer.mutable_buffer()->set_buffer_id(buffer.buffer_id());
    pointer.mutable_buffer()->set_offset_bytes(offset);
    return pointer;
  }

  static void SetDims(v1::LaunchCommand* launch, uint32_t grid, uint32_t block) {
    launch->mutable_grid()->set_x(grid);
    launch->mutable_grid()->set_y(1);
    launch->mutable_grid()->set_z(1);
    launch->mutable_block()->set_x(block);
    launch->mutable_block()->set_y(1);
    launch->mutable_block()->set_z(1);
  }

  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<Session> session_;
  uint64_t module_ = 0;
};

TEST_F(SessionTest, GetFunctionReturnsTheSameIdForTheSameName) {
  const uint64_t a = Function("fill_u32");
  EXPECT_NE(a, 0u);
  EXPECT_EQ(Function("fill_u32"), a);
  EXPECT_THAT(session_->GetFunction(module_, "no_such_kernel"),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(session_->GetFunction(12345, "fill_u32"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SessionTest, TypedArgumentsArePackedAtTheParameterOffsets) {
  auto buffer = session_->Allocate(64);
  ASSERT_THAT(buffer, IsOk());
  v1::LaunchCommand launch;
  launch.set_function_id(Function("fill_u32"));
  SetDims(&launch, 1, 16);
  *launch.add_args()->mutable_buffer() = At(*buffer, 0).buffer();
  launch.add_args()->set_u32(0xCAFE);
  launch.add_args()->set_u64(16);
  ASSERT_THAT(session_->Launch(launch), IsOk());
  uint32_t out[16];
  ASSERT_THAT(session_->Download(buffer->device_address(), out, sizeof(out), 0), IsOk());
  for (uint32_t v : out) EXPECT_EQ(v, 0xCAFEu);
}

TEST_F(SessionTest, ArgumentMismatchNamesTheParameter) {
  v1::LaunchCommand launch;
  launch.set_function_id(Function("axpy_f32"));
  SetDims(&launch, 1, 1);
  launch.add_args()->set_f64(2.0);  // the kernel takes a float
  launch.add_args()->set_u64(0);
  launch.add_args()->set_u64(0);
  launch.add_args()->set_u64(0);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter #0: expected 4 bytes, given 8 bytes")));
  launch.mutable_args()->RemoveLast();
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("takes 4 parameters")));
  launch.clear_args();
  launch.set_packed_args(std::string(24, '\0'));
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("packed arguments are 24 bytes")));
}

TEST_F(SessionTest, LaunchDimensionsAreCheckedAgainstTheDevice) {
  v1::LaunchCommand launch;
  launch.set_function_id(Function("fault_illegal_address"));
  SetDims(&launch, 1, 2048);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block.x = 2048")));
  SetDims(&launch, 1, 0);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block.x is 0")));
  SetDims(&launch, 1, 1);
  launch.mutable_grid()->set_y(70000);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grid.y = 70000")));
  launch.mutable_grid()->set_y(1);
  launch.set_shared_memory_bytes(1 << 20);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared memory")));
}

TEST_F(SessionTest, BatchStopsAtTheFailingCommandAndNamesIt) {
  auto buffer = session_->Allocate(16);
  ASSERT_THAT(buffer, IsOk());
  v1::CommandBatch batch;
  v1::Command* ok = batch.add_commands();
  ok->set_sequence(1);
  ok->mutable_memset()->set_element_size_bytes(1);
  ok->mutable_memset()->set_count(16);
  ok->mutable_memset()->set_value(7);
  *ok->mutable_memset()->mutable_destination() = At(*buffer);
  v1::Command* bad = batch.add_commands();
  bad->set_sequence(2);
  *bad->mutable_memset() = ok->memset();
  bad->mutable_memset()->set_count(17);  // one past the end
  v1::Command* skipped = batch.add_commands();
  skipped->set_sequence(3);
  *skipped->mutable_memset() = ok->memset();
  skipped->mutable_memset()->set_value(9);

  uint64_t last = 0;
  v1::CommandReply reply;
  ASSERT_THAT(session_->RunBatch(batch, &last, &reply), IsOk());
  EXPECT_EQ(reply.error().sequence(), 2u);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(reply.skipped_from_sequence(), 3u);
  EXPECT_EQ(reply.processed_through_sequence(), 2u);
  uint8_t out[16];
  ASSERT_THAT(session_->Download(buffer->device_address(), out, 16, 0), IsOk());
  for (uint8_t v : out) EXPECT_EQ(v, 7);  // the skipped memset did not run

  v1::CommandBatch stale;
  stale.add_commands()->set_sequence(3);
  EXPECT_THAT(session_->RunBatch(stale, &last, &reply),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not increase")));
}

TEST_F(SessionTest, FaultIsStickyAndReturnedByEveryLaterCall) {
  v1::LaunchCommand launch;
  launch.set_function_id(Function("fault_illegal_address"));
  SetDims(&launch, 1, 1);
  ASSERT_THAT(session_->Launch(launch), IsOk());  // asynchronous, like CUDA
  EXPECT_THAT(session_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session_->Allocate(16),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session_->Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(SessionTest, GlobalsAreAddressableLikeBuffers) {
  const std::string ptx = ".version 8.0\n.target sm_75\n.address_size 64\n"
                          ".visible .const .align 4 .b8 coeffs[16];\n";
  auto module = session_->LoadModule(ptx);
  ASSERT_THAT(module, IsOk());
  auto global = session_->GetGlobal(*module, "coeffs");
  ASSERT_THAT(global, IsOk());
  EXPECT_EQ(global->size_bytes(), 16u);
  v1::DevicePointer pointer;
  pointer.set_device_address(global->device_address() + 4);
  EXPECT_THAT(session_->Resolve(pointer, 12, "test"), IsOk());
  EXPECT_THAT(session_->Resolve(pointer, 13, "test"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(session_->UnloadModule(*module), IsOk());
  EXPECT_THAT(session_->Resolve(pointer, 4, "test"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(SessionFootprintTest, LoadModuleReportsTheDeviceMemoryOfItsGlobals) {
  // Large enough for the 3 GiB global: the fake backs it with untouched calloc pages.
  std::unique_ptr<backend::Backend> backend = backend::MakeFakeBackend(4ull << 30);
  auto context = backend->OpenContext(0);
  ASSERT_THAT(context, IsOk());
  Session session(std::move(*context), nullptr, absl::UnavailableError("no NVRTC"));
  const std::string ptx = ".version 8.0\n.target sm_75\n.address_size 64\n"
                          ".visible .global .align 1 .b8 big[3221225472];\n";
  uint64_t device_memory_bytes = 0;
  auto module = session.LoadModule(ptx, &device_memory_bytes);
  ASSERT_THAT(module, IsOk());
  EXPECT_EQ(device_memory_bytes, 3ull << 30);
  auto global = session.GetGlobal(*module, "big");
  ASSERT_THAT(global, IsOk());
  EXPECT_EQ(global->size_bytes(), 3ull << 30);

  ASSERT_THAT(session.LoadModule("fake image", &device_memory_bytes), IsOk());
  EXPECT_EQ(device_memory_bytes, 0u);
}

TEST_F(SessionTest, CompileWithoutNvrtcIsUnavailableWithTheReason) {
  v1::CompileRequest request;
  request.set_source("__global__ void k() {}");
  EXPECT_THAT(session_->Compile(request),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no NVRTC in this test")));
}

}  // namespace
}  // namespace gpurpc::worker
