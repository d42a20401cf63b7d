// The worker's Session core over the fake backend, in process: handle tables, bounds
// checks, launch checks and command batches, without gRPC.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/session.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/status_matchers.h"
#include "tests/unit/scripted_context.h"

namespace gpurpc::worker {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::ScriptedContext;
using ::gpurpc::testing::StatusIs;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = backend::MakeFakeBackend(64ull << 20);
    auto context = backend_->OpenContext(0);
    ASSERT_THAT(context, IsOk());
    session_ = std::make_unique<Session>(std::move(*context), nullptr,
                                         absl::UnavailableError("no NVRTC in this test"));
    auto module = session_->LoadModule(::gpurpc::testing::kFakeKernelsPtx);
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
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("takes 4 parameters")));
  launch.clear_args();
  launch.set_packed_args(std::string(24, '\0'));
  EXPECT_THAT(session_->Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
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
  EXPECT_THAT(session_->Allocate(16), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session_->Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(SessionTest, GlobalsAreAddressableLikeBuffers) {
  const std::string ptx =
      ".version 8.0\n.target sm_75\n.address_size 64\n"
      ".visible .const .align 4 .b8 coeffs[16];\n";
  auto module = session_->LoadModule(ptx);
  ASSERT_THAT(module, IsOk());
  auto global = session_->GetGlobal(*module, "coeffs");
  ASSERT_THAT(global, IsOk());
  EXPECT_EQ(global->size_bytes(), 16u);
  v1::DevicePointer pointer;
  pointer.set_device_address(global->device_address() + 4);
  EXPECT_THAT(session_->Resolve(pointer, 12, "test"), IsOk());
  EXPECT_THAT(session_->Resolve(pointer, 13, "test"), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(session_->UnloadModule(*module), IsOk());
  EXPECT_THAT(session_->Resolve(pointer, 4, "test"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(SessionFootprintTest, LoadModuleReportsTheDeviceMemoryOfItsGlobals) {
  // Large enough for the 3 GiB global: the fake backs it with untouched calloc pages.
  std::unique_ptr<backend::Backend> backend = backend::MakeFakeBackend(4ull << 30);
  auto context = backend->OpenContext(0);
  ASSERT_THAT(context, IsOk());
  Session session(std::move(*context), nullptr, absl::UnavailableError("no NVRTC"));
  const std::string ptx =
      ".version 8.0\n.target sm_75\n.address_size 64\n"
      ".visible .global .align 1 .b8 big[3221225472];\n";
  uint64_t device_memory_bytes = 0;
  auto module = session.LoadModule(ptx, &device_memory_bytes);
  ASSERT_THAT(module, IsOk());
  EXPECT_EQ(device_memory_bytes, 3ull << 30);
  auto global = session.GetGlobal(*module, "big");
  ASSERT_THAT(global, IsOk());
  EXPECT_EQ(global->size_bytes(), 3ull << 30);

  ASSERT_THAT(session.LoadModule(::gpurpc::testing::kFakeKernelsPtx, &device_memory_bytes), IsOk());
  EXPECT_EQ(device_memory_bytes, 0u);
}

TEST_F(SessionTest, CompileWithoutNvrtcIsUnavailableWithTheReason) {
  v1::CompileRequest request;
  request.set_source("__global__ void k() {}");
  EXPECT_THAT(session_->Compile(request),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no NVRTC in this test")));
}

TEST_F(SessionTest, NamesWithANulByteOrOverTheLimitAreInvalidArguments) {
  const std::string with_nul("fill_u32\0x", 10);  // the driver would find "fill_u32"
  EXPECT_THAT(session_->GetFunction(module_, with_nul),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GetFunction: name has a NUL byte at offset 8")));
  EXPECT_THAT(session_->GetGlobal(module_, std::string("g\0", 2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GetGlobal: name has a NUL byte at offset 1")));
  const std::string long_name(kMaxNameBytes + 1, 'k');
  EXPECT_THAT(session_->GetFunction(module_, long_name),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("name is 4097 bytes, more than the limit of 4096")));
  EXPECT_THAT(session_->GetGlobal(module_, long_name),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than the limit")));
  EXPECT_THAT(session_->GetFunction(module_, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name is empty")));
  // At the limit the name is looked up (and is no kernel of the module).
  EXPECT_THAT(session_->GetFunction(module_, std::string(kMaxNameBytes, 'k')),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(session_->table_sizes().functions, 0u);
}

// Kernels with parameter layouts the fake never reports, through the session's API.
class ScriptedSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto context = std::make_unique<ScriptedContext>();
    context_ = context.get();
    session_ = std::make_unique<Session>(std::move(context), nullptr,
                                         absl::UnavailableError("no NVRTC in this test"));
  }

  absl::StatusOr<v1::GetFunctionResponse> Define(const std::string& name,
                                                 std::vector<backend::ParamInfo> params) {
    context_->DefineKernel(name, std::move(params));
    auto module = session_->LoadModule("scripted image");
    if (!module.ok()) return module.status();
    return session_->GetFunction(*module, name);
  }

  static v1::LaunchCommand LaunchOf(uint64_t function_id) {
    v1::LaunchCommand launch;
    launch.set_function_id(function_id);
    for (v1::Dim3* dim : {launch.mutable_grid(), launch.mutable_block()}) {
      dim->set_x(1);
      dim->set_y(1);
      dim->set_z(1);
    }
    return launch;
  }

  ScriptedContext* context_ = nullptr;
  std::unique_ptr<Session> session_;
};

// Two calls in the backend when the fault happens: the first reports it as it is, the second
// as the session's earlier fault. (The second used to take the session's lock twice and hang
// the worker.)
TEST_F(ScriptedSessionTest, ASecondCallObservingTheFaultReportsTheFirst) {
  absl::StatusOr<uint64_t> event = session_->CreateEvent(false, false);
  ASSERT_THAT(event, IsOk());
  context_->set_record_status(absl::AbortedError("cuEventRecord: CUDA_ERROR_ILLEGAL_ADDRESS"));
  // Both calls are inside the backend before either returns.
  absl::Mutex mu;
  int inside = 0;
  context_->set_record_hook([&] {
    absl::MutexLock lock(&mu);
    ++inside;
    mu.AwaitWithTimeout(absl::Condition(
                            +[](int* n) { return *n >= 2; }, &inside),
                        absl::Seconds(30));
  });
  absl::Status results[2];
  std::thread first([&] { results[0] = session_->RecordEvent(*event, 0); });
  std::thread second([&] { results[1] = session_->RecordEvent(*event, 0); });
  first.join();
  second.join();
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(inside, 2);
  }
  if (results[0].code() != absl::StatusCode::kAborted) std::swap(results[0], results[1]);
  EXPECT_THAT(results[0], StatusIs(absl::StatusCode::kAborted, HasSubstr("ILLEGAL_ADDRESS")));
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("FAULTED earlier: cuEventRecord")));
}

TEST_F(ScriptedSessionTest, NarrowIntegerArgumentsMustFitTheirType) {
  // (unsigned char, unsigned short, unsigned)
  auto function = Define("narrow", {{0, 1}, {2, 2}, {4, 4}});
  ASSERT_THAT(function, IsOk());
  v1::LaunchCommand launch = LaunchOf(function->function_id());
  launch.add_args()->set_u8(0xFF);
  launch.add_args()->set_u16(0xFFFF);
  launch.add_args()->set_u32(0x01020304);
  ASSERT_THAT(session_->Launch(launch), IsOk());
  const uint8_t expected[] = {0xFF, 0, 0xFF, 0xFF, 0x04, 0x03, 0x02, 0x01};
  EXPECT_THAT(context_->last_packed_args(), ElementsAreArray(expected));

  launch.mutable_args(0)->set_u8(256);
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter #0: u8 value 256 does not fit in 8 bits (0 to 255)")));
  launch.mutable_args(0)->set_u8(0xFFFFFFFF);  // -1 as a 32-bit pattern
  EXPECT_THAT(session_->Launch(launch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter #0: u8 value 4294967295 does not fit")));
  launch.mutable_args(0)->set_u8(1);
  launch.mutable_args(1)->set_u16(0x10000);
  EXPECT_THAT(
      session_->Launch(launch),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("parameter #1: u16 value 65536 does not fit in 16 bits (0 to 65535)")));
  EXPECT_EQ(context_->launched(0), 1u);  // only the first launch reached the backend
}

TEST_F(ScriptedSessionTest, UnsortedParametersArePackedAtTheirOffsets) {
  // The driver reports parameter #0 after #1 in the buffer: a layout no compiler makes, but
  // nothing stops a hand-made image.
  auto function = Define("unsorted", {{8, 8}, {0, 4}});
  ASSERT_THAT(function, IsOk());
  v1::LaunchCommand launch = LaunchOf(function->function_id());
  launch.add_args()->set_u64(0x1112131415161718);
  launch.add_args()->set_u32(0x21222324);
  ASSERT_THAT(session_->Launch(launch), IsOk());
  const uint8_t expected[] = {0x24, 0x23, 0x22, 0x21, 0,    0,    0,    0,
                              0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11};
  EXPECT_THAT(context_->last_packed_args(), ElementsAreArray(expected));
  // The packed size is the end of the furthest parameter, not of the last one reported.
  launch.clear_args();
  launch.set_packed_args(std::string(12, '\0'));
  EXPECT_THAT(session_->Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("takes 2 parameters in 16 bytes")));
  launch.set_packed_args(std::string(16, '\0'));
  EXPECT_THAT(session_->Launch(launch), IsOk());
}

TEST_F(ScriptedSessionTest, LayoutsThatCannotBePackedAreRefusedAtGetFunction) {
  EXPECT_THAT(Define("overlapping", {{0, 8}, {4, 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter #1 (4 bytes at offset 4) overlapping parameter #0 "
                                 "(8 bytes at offset 0)")));
  EXPECT_THAT(Define("overlapping_unsorted", {{16, 8}, {0, 8}, {12, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlapping")));
  EXPECT_THAT(Define("beyond", {{0, 8}, {kMaxParamBytes - 2, 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter #1 as 4 bytes at offset 32762, which is not within "
                                 "a parameter block of 1 to 32764 bytes")));
  // offset + size overflows 32 bits: still refused, never wrapped.
  EXPECT_THAT(Define("wrapping", {{0xFFFFFFF8u, 16}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not within")));
  EXPECT_THAT(Define("empty_parameter", {{0, 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("as 0 bytes")));
  EXPECT_EQ(session_->table_sizes().functions, 0u);
  EXPECT_EQ(context_->launched(0), 0u);
}

TEST_F(SessionTest, HandleIdsAreNotRememberedOnceTheirObjectsAreGone) {
  // Nothing in the session (nor HandleIdGenerator) keeps issued ids: a create/destroy loop
  // leaves every table as it was.
  const Session::TableSizes before = session_->table_sizes();
  size_t most_events = 0;
  for (int i = 0; i < 100000; ++i) {
    auto event = session_->CreateEvent(/*disable_timing=*/true, /*blocking_sync=*/false);
    ASSERT_THAT(event, IsOk());
    most_events = std::max(most_events, session_->table_sizes().events);
    ASSERT_THAT(session_->DestroyEvent(*event), IsOk());
  }
  for (int i = 0; i < 1000; ++i) {
    auto buffer = session_->Allocate(64);
    ASSERT_THAT(buffer, IsOk());
    ASSERT_THAT(session_->Free(buffer->buffer_id()), IsOk());
    auto function = session_->GetFunction(module_, "spin_us");
    ASSERT_THAT(function, IsOk());
  }
  const Session::TableSizes after = session_->table_sizes();
  EXPECT_EQ(most_events, 1u);
  EXPECT_EQ(after.events, before.events);
  EXPECT_EQ(after.buffers, before.buffers);
  EXPECT_EQ(after.ranges, before.ranges);
  EXPECT_EQ(after.functions, 1u);  // one id per (module, name), however often asked
  EXPECT_EQ(after.modules, before.modules);
}

TEST_F(SessionTest, GetFunctionAndLaunchRaceUnloadModuleSafely) {
  // Threads look a kernel up and launch it while the main thread unloads its module; every
  // call succeeds or answers NOT_FOUND, and no function outlives its module's unload.
  v1::LaunchCommand launch;
  SetDims(&launch, 1, 1);
  launch.add_args()->set_u64(0);  // spin_us(0)
  for (int round = 0; round < 50; ++round) {
    auto module = session_->LoadModule(::gpurpc::testing::kFakeKernelsPtx);
    ASSERT_THAT(module, IsOk());
    std::atomic<bool> unloaded{false};
    std::atomic<int> unexpected{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, module_id = *module] {
        // Until the unload is done, and a few calls after it.
        for (int after = 0; after < 20;) {
          if (unloaded.load()) ++after;
          auto function = session_->GetFunction(module_id, "spin_us");
          if (!function.ok()) {
            if (function.status().code() != absl::StatusCode::kNotFound) ++unexpected;
            continue;
          }
          v1::LaunchCommand mine = launch;
          mine.set_function_id(function->function_id());
          absl::Status status = session_->Launch(mine);
          if (!status.ok() && status.code() != absl::StatusCode::kNotFound) ++unexpected;
        }
      });
    }
    std::this_thread::yield();
    ASSERT_THAT(session_->UnloadModule(*module), IsOk());
    unloaded.store(true);
    for (std::thread& thread : threads) thread.join();
    EXPECT_EQ(unexpected.load(), 0);
    // Only the fixture's module (and no function of the unloaded one) is left.
    const Session::TableSizes sizes = session_->table_sizes();
    ASSERT_EQ(sizes.modules, 1u);
    ASSERT_EQ(sizes.functions, 0u);
  }
  EXPECT_THAT(session_->Synchronize(), IsOk());
}

TEST_F(SessionTest, TheWatchdogEndsASpinningKernelOfTheFake) {
  absl::Notification fired;
  std::string message;
  auto context = backend_->OpenContext(0);
  ASSERT_THAT(context, IsOk());
  auto session = std::make_unique<Session>(std::move(*context), nullptr,
                                           absl::UnavailableError("no NVRTC in this test"),
                                           [&](const std::string& why) {
                                             message = why;
                                             fired.Notify();
                                           });
  Session::Limits limits;
  limits.kernel_timeout_ms = 200;
  ASSERT_THAT(session->Bind("tenant", limits), IsOk());
  auto module = session->LoadModule(::gpurpc::testing::kFakeKernelsPtx);
  ASSERT_THAT(module, IsOk());
  auto function = session->GetFunction(*module, "spin_us");
  ASSERT_THAT(function, IsOk());
  v1::LaunchCommand launch;
  launch.set_function_id(function->function_id());
  SetDims(&launch, 1, 1);
  // Ten minutes on the default stream: the fake's launch returns at once (asynchronous, as
  // CUDA), and destroying the session's context interrupts the kernel.
  launch.add_args()->set_u64(600ull * 1000 * 1000);
  ASSERT_THAT(session->Launch(launch), IsOk());
  ASSERT_TRUE(fired.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(message, KernelTimeoutMessage("spin_us", 200));
  session.reset();
}

TEST_F(ScriptedSessionTest, AFunctionLookedUpWhileItsModuleIsUnloadedIsNeverRegistered) {
  context_->DefineKernel("k", {});
  auto module = session_->LoadModule("scripted image");
  ASSERT_THAT(module, IsOk());
  absl::Notification inside;
  absl::Notification proceed;
  context_->set_get_function_hook([&] {
    inside.Notify();
    proceed.WaitForNotification();
  });
  absl::StatusOr<v1::GetFunctionResponse> result;
  std::thread lookup([&] { result = session_->GetFunction(*module, "k"); });
  inside.WaitForNotification();  // the lookup is inside the module's GetFunction
  ASSERT_THAT(session_->UnloadModule(*module), IsOk());
  EXPECT_EQ(context_->modules_alive(), 1);  // the lookup still holds the module
  proceed.Notify();
  lookup.join();
  context_->set_get_function_hook(nullptr);
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kNotFound,
                               HasSubstr("was unloaded while kernel 'k' was looked up")));
  EXPECT_EQ(session_->table_sizes().functions, 0u);
  EXPECT_EQ(context_->modules_alive(), 0);
}

TEST_F(ScriptedSessionTest, AModuleUnloadedDuringALaunchLivesUntilTheLaunchIsQueued) {
  context_->DefineKernel("k", {});
  auto module = session_->LoadModule("scripted image");
  ASSERT_THAT(module, IsOk());
  auto function = session_->GetFunction(*module, "k");
  ASSERT_THAT(function, IsOk());
  absl::Notification inside;
  absl::Notification proceed;
  context_->set_launch_hook([&] {
    inside.Notify();
    proceed.WaitForNotification();
  });
  absl::Status launched;
  std::thread launcher([&] { launched = session_->Launch(LaunchOf(function->function_id())); });
  inside.WaitForNotification();  // the launch is inside the backend with the module's function
  ASSERT_THAT(session_->UnloadModule(*module), IsOk());
  EXPECT_EQ(context_->modules_alive(), 1);
  proceed.Notify();
  launcher.join();
  context_->set_launch_hook(nullptr);
  EXPECT_THAT(launched, IsOk());
  EXPECT_EQ(context_->modules_alive(), 0);
  EXPECT_THAT(session_->Launch(LaunchOf(function->function_id())),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SessionTest, EmptyOperationsStillCheckTheirStream) {
  auto buffer = session_->Allocate(16);
  ASSERT_THAT(buffer, IsOk());
  constexpr uint64_t kUnknownStream = 12345;
  EXPECT_THAT(session_->Upload(buffer->device_address(), nullptr, 0, kUnknownStream),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stream 12345")));
  v1::MemsetCommand memset;
  *memset.mutable_destination() = At(*buffer);
  memset.set_element_size_bytes(4);
  memset.set_count(0);
  memset.set_stream_id(kUnknownStream);
  EXPECT_THAT(session_->Memset(memset),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stream 12345")));
  v1::CopyCommand copy;
  *copy.mutable_destination() = At(*buffer);
  *copy.mutable_source() = At(*buffer);
  copy.set_size_bytes(0);
  copy.set_stream_id(kUnknownStream);
  EXPECT_THAT(session_->Copy(copy),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stream 12345")));
  memset.set_stream_id(0);
  EXPECT_THAT(session_->Memset(memset), IsOk());
}

}  // namespace
}  // namespace gpurpc::worker
