// Context limits, cache and shared memory configuration and settable function attributes
// through the daemon (ctest label `service`): ModuleService.SetContextLimit and its
// siblings (module_service.proto), through the raw gpurpc.v1 stubs (the C++ client has no
// calls for them), against a real gpurpcd with worker processes on the fake backend.
//
// Every enum and value is a client's: unknown enum values, read-only attributes and values
// outside gpurpc's bounds (server/worker/session.h) must be refused with INVALID_ARGUMENT
// naming them, before the driver is touched, and the session must go on working after.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/shared_daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::SharedDaemonTest;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;
// The fake device: 4 multiprocessors (fake_device.h) x 2048 resident threads
// (fake_backend.cc's kResidentThreads).
constexpr uint64_t kFakeResidentThreads = 4 * 2048;
// The fake's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES until raised, and its opt-in
// maximum (fake_device.h).
constexpr uint32_t kDefaultDynamicShared = 48 * 1024;
constexpr int kOptinShared = 232448;

// The raw ModuleService of one session.
class RawModules {
 public:
  RawModules(const Client& client, uint64_t session_id)
      : session_id_(std::to_string(session_id)),
        stub_(v1::ModuleService::NewStub(client.channel())) {}

  template <typename Request, typename Response, typename Method>
  absl::Status Call(Method method, const Request& request, Response* response) {
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, session_id_);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return FromGrpcStatus(((*stub_).*method)(&context, request, response));
  }

  absl::StatusOr<v1::SetContextLimitResponse> SetLimit(int limit, uint64_t value) {
    v1::SetContextLimitRequest request;
    request.set_limit(static_cast<v1::ContextLimit>(limit));
    request.set_value(value);
    v1::SetContextLimitResponse response;
    absl::Status status = Call(&v1::ModuleService::Stub::SetContextLimit, request, &response);
    if (!status.ok()) return status;
    return response;
  }
  absl::StatusOr<uint64_t> GetLimit(int limit) {
    v1::GetContextLimitRequest request;
    request.set_limit(static_cast<v1::ContextLimit>(limit));
    v1::GetContextLimitResponse response;
    absl::Status status = Call(&v1::ModuleService::Stub::GetContextLimit, request, &response);
    if (!status.ok()) return status;
    return response.value();
  }
  absl::Status SetCacheConfig(int config) {
    v1::SetCacheConfigRequest request;
    request.set_config(static_cast<v1::CacheConfig>(config));
    v1::SetCacheConfigResponse response;
    return Call(&v1::ModuleService::Stub::SetCacheConfig, request, &response);
  }
  absl::StatusOr<int> GetCacheConfig() {
    v1::GetCacheConfigResponse response;
    absl::Status status =
        Call(&v1::ModuleService::Stub::GetCacheConfig, v1::GetCacheConfigRequest(), &response);
    if (!status.ok()) return status;
    return static_cast<int>(response.config());
  }
  absl::Status SetSharedConfig(int config, uint64_t function_id = 0) {
    v1::SetSharedConfigRequest request;
    request.set_config(static_cast<v1::SharedConfig>(config));
    request.set_function_id(function_id);
    v1::SetSharedConfigResponse response;
    return Call(&v1::ModuleService::Stub::SetSharedConfig, request, &response);
  }
  absl::StatusOr<int> GetSharedConfig() {
    v1::GetSharedConfigResponse response;
    absl::Status status =
        Call(&v1::ModuleService::Stub::GetSharedConfig, v1::GetSharedConfigRequest(), &response);
    if (!status.ok()) return status;
    return static_cast<int>(response.config());
  }
  absl::StatusOr<v1::FunctionAttributes> SetAttribute(uint64_t function_id, int attribute,
                                                      int64_t value) {
    v1::SetFunctionAttributeRequest request;
    request.set_function_id(function_id);
    request.set_attribute(static_cast<v1::FunctionAttribute>(attribute));
    request.set_value(value);
    v1::SetFunctionAttributeResponse response;
    absl::Status status = Call(&v1::ModuleService::Stub::SetFunctionAttribute, request, &response);
    if (!status.ok()) return status;
    return response.attributes();
  }
  absl::Status SetFunctionCacheConfig(uint64_t function_id, int config) {
    v1::SetFunctionCacheConfigRequest request;
    request.set_function_id(function_id);
    request.set_config(static_cast<v1::CacheConfig>(config));
    v1::SetFunctionCacheConfigResponse response;
    return Call(&v1::ModuleService::Stub::SetFunctionCacheConfig, request, &response);
  }
  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id, const std::string& name) {
    v1::GetFunctionRequest request;
    request.set_module_id(module_id);
    request.set_name(name);
    v1::GetFunctionResponse response;
    absl::Status status = Call(&v1::ModuleService::Stub::GetFunction, request, &response);
    if (!status.ok()) return status;
    return response;
  }

 private:
  const std::string session_id_;
  std::unique_ptr<v1::ModuleService::Stub> stub_;
};

class ContextLimitsTest : public SharedDaemonTest<ContextLimitsTest> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SharedDaemonTest::SetUp());
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon().address()));
    client_.emplace(std::move(client));
    ASSERT_OK_AND_ASSIGN(session_, client_->OpenSession());
    ASSERT_OK_AND_ASSIGN(module_, CompileFakeKernels(session_));
    ASSERT_OK_AND_ASSIGN(fill_, module_.GetFunction("fill_u32"));
    raw_.emplace(*client_, session_.id());
  }

  // fill_u32(buffer, 7, 256) with `shared` bytes of dynamic shared memory, synchronized.
  absl::Status LaunchFill(uint32_t shared) {
    absl::StatusOr<Buffer> buffer = session_.Allocate(256 * 4);
    if (!buffer.ok()) return buffer.status();
    LaunchConfig config;
    config.block.x = 256;
    config.shared_memory_bytes = shared;
    if (absl::Status s = fill_.Launch(config, *buffer, uint32_t{7}, uint64_t{256}); !s.ok()) {
      return s;
    }
    return session_.Synchronize();
  }

  // The session still works: a launch and a limit read.
  void ExpectUsable() {
    EXPECT_OK(LaunchFill(0));
    EXPECT_OK(raw_->GetLimit(v1::LIMIT_STACK_SIZE).status());
  }

  std::optional<Client> client_;
  Session session_;
  Module module_;
  Function fill_;
  std::optional<RawModules> raw_;
};

TEST_F(ContextLimitsTest, FreshContextReportsTheDriverDefaults) {
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_STACK_SIZE), IsOkAndHolds(1024u));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_PRINTF_FIFO_SIZE), IsOkAndHolds(1 * kMiB));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(8 * kMiB));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_DEV_RUNTIME_SYNC_DEPTH), IsOkAndHolds(2u));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT), IsOkAndHolds(2048u));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_PERSISTING_L2_CACHE_SIZE), IsOkAndHolds(0u));
}

TEST_F(ContextLimitsTest, SetLimitsRoundTripAndReportTheReservation) {
  ASSERT_OK_AND_ASSIGN(v1::SetContextLimitResponse heap,
                       raw_->SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 256 * kMiB));
  EXPECT_EQ(heap.value(), 256 * kMiB);
  // Stack 1 KiB for every resident thread, FIFO 1 MiB, heap 256 MiB.
  EXPECT_EQ(heap.reserved_device_bytes(), 1024 * kFakeResidentThreads + 1 * kMiB + 256 * kMiB);
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(256 * kMiB));

  ASSERT_OK_AND_ASSIGN(v1::SetContextLimitResponse fifo,
                       raw_->SetLimit(v1::LIMIT_PRINTF_FIFO_SIZE, 8 * kMiB));
  EXPECT_EQ(fifo.value(), 8 * kMiB);
  ASSERT_OK_AND_ASSIGN(v1::SetContextLimitResponse stack,
                       raw_->SetLimit(v1::LIMIT_STACK_SIZE, 16 * kKiB));
  EXPECT_EQ(stack.value(), 16 * kKiB);
  EXPECT_EQ(stack.reserved_device_bytes(),
            16 * kKiB * kFakeResidentThreads + 8 * kMiB + 256 * kMiB);

  EXPECT_OK(raw_->SetLimit(v1::LIMIT_DEV_RUNTIME_SYNC_DEPTH, 4).status());
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_DEV_RUNTIME_SYNC_DEPTH), IsOkAndHolds(4u));
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, 4096).status());
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT), IsOkAndHolds(4096u));
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_MAX_L2_FETCH_GRANULARITY, 128).status());
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_MAX_L2_FETCH_GRANULARITY), IsOkAndHolds(128u));
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_PERSISTING_L2_CACHE_SIZE, 0).status());
  // The largest values gpurpc allows.
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 1 * kGiB).status());
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_PRINTF_FIFO_SIZE, 64 * kMiB).status());
  EXPECT_OK(raw_->SetLimit(v1::LIMIT_STACK_SIZE, 64 * kKiB).status());
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_STACK_SIZE), IsOkAndHolds(64 * kKiB));
  ExpectUsable();

  // Another session starts from the defaults: limits belong to one context.
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawModules other_raw(*client_, other.id());
  EXPECT_THAT(other_raw.GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(8 * kMiB));
}

// The same calls through the C++ client's Session and Function.
TEST_F(ContextLimitsTest, TheClientsCallsRoundTrip) {
  EXPECT_THAT(session_.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 64 * kMiB), IsOkAndHolds(64 * kMiB));
  EXPECT_THAT(session_.GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(64 * kMiB));
  EXPECT_THAT(session_.SetLimit(v1::LIMIT_PRINTF_FIFO_SIZE, 65 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LIMIT_PRINTF_FIFO_SIZE")));
  ASSERT_OK(session_.SetCacheConfig(v1::CACHE_CONFIG_PREFER_SHARED));
  EXPECT_THAT(session_.GetCacheConfig(), IsOkAndHolds(v1::CACHE_CONFIG_PREFER_SHARED));
  EXPECT_THAT(session_.SetCacheConfig(static_cast<v1::CacheConfig>(99)),
              StatusIs(absl::StatusCode::kInvalidArgument));

  ASSERT_OK(fill_.SetAttribute(v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * 1024));
  EXPECT_EQ(fill_.attributes().max_dynamic_shared_size_bytes(), 64 * 1024);
  EXPECT_OK(LaunchFill(60 * 1024));
  EXPECT_THAT(
      fill_.SetAttribute(v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kOptinShared + 1),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(fill_.SetCacheConfig(v1::CACHE_CONFIG_PREFER_L1));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, UnknownLimitsAreRefusedByNumber) {
  for (int limit : {7, 8, 9, 10, 1000, -1}) {
    SCOPED_TRACE(limit);
    EXPECT_THAT(raw_->SetLimit(limit, 1), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   AllOf(HasSubstr(absl::StrCat("limit ", limit)),
                                                         HasSubstr("is not a ContextLimit"))));
    EXPECT_THAT(raw_->GetLimit(limit),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a ContextLimit")));
  }
  ExpectUsable();
}

TEST_F(ContextLimitsTest, ValuesOutsideTheBoundsAreRefusedNamingThem) {
  const struct {
    int limit;
    uint64_t value;
    const char* says;
  } cases[] = {
      {v1::LIMIT_STACK_SIZE, 0, "LIMIT_STACK_SIZE = 0 is outside 1..65536"},
      {v1::LIMIT_STACK_SIZE, 64 * kKiB + 1, "LIMIT_STACK_SIZE = 65537 is outside 1..65536"},
      {v1::LIMIT_STACK_SIZE, UINT64_MAX, "LIMIT_STACK_SIZE"},
      {v1::LIMIT_PRINTF_FIFO_SIZE, 0, "LIMIT_PRINTF_FIFO_SIZE = 0"},
      {v1::LIMIT_PRINTF_FIFO_SIZE, 64 * kMiB + 1, "outside 1..67108864"},
      {v1::LIMIT_MALLOC_HEAP_SIZE, 0, "LIMIT_MALLOC_HEAP_SIZE = 0"},
      {v1::LIMIT_MALLOC_HEAP_SIZE, 1 * kGiB + 1, "outside 1..1073741824"},
      {v1::LIMIT_MALLOC_HEAP_SIZE, UINT64_MAX, "LIMIT_MALLOC_HEAP_SIZE"},
      {v1::LIMIT_DEV_RUNTIME_SYNC_DEPTH, 25, "LIMIT_DEV_RUNTIME_SYNC_DEPTH = 25 is outside 0..24"},
      {v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, 0, "outside 1..32768"},
      {v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, 32769, "outside 1..32768"},
      {v1::LIMIT_MAX_L2_FETCH_GRANULARITY, 129, "outside 0..128"},
      // The fake device has no persisting L2 (its maximum is 0).
      {v1::LIMIT_PERSISTING_L2_CACHE_SIZE, 1, "max persisting L2 cache size"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.limit, " = ", c.value));
    EXPECT_THAT(raw_->SetLimit(c.limit, c.value),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.says)));
  }
  // Nothing changed.
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_STACK_SIZE), IsOkAndHolds(1024u));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(8 * kMiB));
  EXPECT_THAT(raw_->GetLimit(v1::LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT), IsOkAndHolds(2048u));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, CacheConfigRoundTripsAndRefusesUnknownValues) {
  EXPECT_THAT(raw_->GetCacheConfig(), IsOkAndHolds(v1::CACHE_CONFIG_PREFER_NONE));
  for (int config : {v1::CACHE_CONFIG_PREFER_SHARED, v1::CACHE_CONFIG_PREFER_L1,
                     v1::CACHE_CONFIG_PREFER_EQUAL, v1::CACHE_CONFIG_PREFER_NONE}) {
    SCOPED_TRACE(config);
    EXPECT_OK(raw_->SetCacheConfig(config));
    EXPECT_THAT(raw_->GetCacheConfig(), IsOkAndHolds(config));
  }
  EXPECT_OK(raw_->SetCacheConfig(v1::CACHE_CONFIG_PREFER_L1));
  for (int config : {4, 99, -1}) {
    SCOPED_TRACE(config);
    EXPECT_THAT(raw_->SetCacheConfig(config),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(absl::StrCat("cache config ", config)),
                               HasSubstr("is not a CacheConfig"))));
    EXPECT_THAT(raw_->SetFunctionCacheConfig(fill_.id(), config),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a CacheConfig")));
  }
  EXPECT_THAT(raw_->GetCacheConfig(), IsOkAndHolds(v1::CACHE_CONFIG_PREFER_L1));

  EXPECT_OK(raw_->SetFunctionCacheConfig(fill_.id(), v1::CACHE_CONFIG_PREFER_SHARED));
  EXPECT_THAT(raw_->SetFunctionCacheConfig(12345, v1::CACHE_CONFIG_PREFER_SHARED),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function 12345")));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, ProfilingStartsAndStopsAndSaysWhetherItWasOn) {
  EXPECT_THAT(session_.SetProfiling(true), IsOkAndHolds(false));
  EXPECT_THAT(session_.SetProfiling(true), IsOkAndHolds(true));
  EXPECT_THAT(session_.SetProfiling(false), IsOkAndHolds(true));
  EXPECT_THAT(session_.SetProfiling(false), IsOkAndHolds(false));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, SharedConfigIsCheckedAndAnswersTheFixedBankWidth) {
  EXPECT_THAT(raw_->GetSharedConfig(), IsOkAndHolds(v1::SHARED_CONFIG_FOUR_BYTE_BANK_SIZE));
  EXPECT_OK(raw_->SetSharedConfig(v1::SHARED_CONFIG_EIGHT_BYTE_BANK_SIZE));
  // As the driver on a device with a fixed bank width: the setting changes nothing.
  EXPECT_THAT(raw_->GetSharedConfig(), IsOkAndHolds(v1::SHARED_CONFIG_FOUR_BYTE_BANK_SIZE));
  EXPECT_OK(raw_->SetSharedConfig(v1::SHARED_CONFIG_DEFAULT_BANK_SIZE, fill_.id()));
  EXPECT_THAT(raw_->SetSharedConfig(3), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("config 3 is not a SharedConfig")));
  EXPECT_THAT(raw_->SetSharedConfig(v1::SHARED_CONFIG_FOUR_BYTE_BANK_SIZE, 12345),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function 12345")));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, MaxDynamicSharedSizeGatesLaunchesOnTheFake) {
  // As the driver: up to 48 KiB without opting in, not more.
  EXPECT_OK(LaunchFill(kDefaultDynamicShared));
  EXPECT_THAT(LaunchFill(kDefaultDynamicShared + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared memory")));

  ASSERT_OK_AND_ASSIGN(
      v1::FunctionAttributes raised,
      raw_->SetAttribute(fill_.id(), v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000));
  EXPECT_EQ(raised.max_dynamic_shared_size_bytes(), 100000);
  EXPECT_OK(LaunchFill(100000));
  EXPECT_THAT(LaunchFill(100001), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED")));
  // GetFunction reports the value now in force.
  ASSERT_OK_AND_ASSIGN(v1::GetFunctionResponse again, raw_->GetFunction(module_.id(), "fill_u32"));
  EXPECT_EQ(again.function_id(), fill_.id());
  EXPECT_EQ(again.attributes().max_dynamic_shared_size_bytes(), 100000);

  // The most the device allows with opt-in (the kernel has no static shared memory).
  EXPECT_OK(raw_->SetAttribute(fill_.id(), v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                               kOptinShared)
                .status());
  EXPECT_OK(LaunchFill(kOptinShared));
  // Lowered again, launches above it fail again.
  EXPECT_OK(
      raw_->SetAttribute(fill_.id(), v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 1024)
          .status());
  EXPECT_THAT(LaunchFill(2048), StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectUsable();
}

TEST_F(ContextLimitsTest, FunctionAttributesAreBoundedAndReadOnlyOnesRefused) {
  const struct {
    int attribute;
    int64_t value;
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kOptinShared + 1,
       absl::StatusCode::kInvalidArgument, "is outside 0..232448"},
      {v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, -1, absl::StatusCode::kInvalidArgument,
       "MAX_DYNAMIC_SHARED_SIZE_BYTES = -1"},
      {v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, INT64_MAX,
       absl::StatusCode::kInvalidArgument, "is outside 0..232448"},
      {v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 101,
       absl::StatusCode::kInvalidArgument, "is outside -1..100"},
      {v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, -2,
       absl::StatusCode::kInvalidArgument, "is outside -1..100"},
      {v1::FUNCTION_ATTRIBUTE_NUM_REGS, 8, absl::StatusCode::kInvalidArgument,
       "FUNCTION_ATTRIBUTE_NUM_REGS is read-only"},
      {v1::FUNCTION_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 128, absl::StatusCode::kInvalidArgument,
       "FUNCTION_ATTRIBUTE_MAX_THREADS_PER_BLOCK is read-only"},
      {10, 1, absl::StatusCode::kInvalidArgument, "attribute 10 is not a FunctionAttribute"},
      {-5, 1, absl::StatusCode::kInvalidArgument, "attribute -5 is not a FunctionAttribute"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.attribute, " = ", c.value));
    EXPECT_THAT(raw_->SetAttribute(fill_.id(), c.attribute, c.value),
                StatusIs(c.code, HasSubstr(c.says)));
  }
  EXPECT_THAT(
      raw_->SetAttribute(12345, v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 50),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function 12345")));

  for (int carveout : {-1, 0, 50, 100}) {
    SCOPED_TRACE(carveout);
    ASSERT_OK_AND_ASSIGN(
        v1::FunctionAttributes attributes,
        raw_->SetAttribute(fill_.id(), v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                           carveout));
    EXPECT_EQ(attributes.preferred_shared_memory_carveout(), carveout);
  }
  ExpectUsable();
}

// The stack, printf FIFO and malloc heap reserve device memory the ledger does not see:
// together they must fit the tenant's max_device_memory_bytes.
TEST(ContextLimitsQuotaTest, ReservationsMustFitTheTenantsDeviceMemoryQuota) {
  TestDaemon::Options options;
  options.extra_flags = {absl::StrCat("--tenant-max-device-memory-bytes=", 64 * kMiB)};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TestDaemon> daemon, TestDaemon::Start(options));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  RawModules raw(client, session.id());
  // Defaults: 1 KiB x 8192 threads = 8 MiB of stack, 1 MiB FIFO, 8 MiB heap.
  ASSERT_OK_AND_ASSIGN(v1::SetContextLimitResponse heap,
                       raw.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 40 * kMiB));
  EXPECT_EQ(heap.reserved_device_bytes(), 8 * kMiB + 1 * kMiB + 40 * kMiB);
  EXPECT_THAT(
      raw.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 60 * kMiB),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("LIMIT_MALLOC_HEAP_SIZE"), HasSubstr("max_device_memory_bytes"))));
  // 4 KiB of stack for 8192 threads is 32 MiB: with 41 MiB more, over 64 MiB.
  EXPECT_THAT(raw.SetLimit(v1::LIMIT_STACK_SIZE, 4 * kKiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("LIMIT_STACK_SIZE")));
  EXPECT_THAT(raw.GetLimit(v1::LIMIT_MALLOC_HEAP_SIZE), IsOkAndHolds(40 * kMiB));
  EXPECT_THAT(raw.GetLimit(v1::LIMIT_STACK_SIZE), IsOkAndHolds(1024u));
  // Lowering one makes room for another.
  EXPECT_OK(raw.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 1 * kMiB).status());
  EXPECT_OK(raw.SetLimit(v1::LIMIT_STACK_SIZE, 4 * kKiB).status());
}

// The front end charges the reservations to the tenant's ledger: they count with buffers and
// across the tenant's sessions, lowering one frees room, and a refused value charges nothing.
TEST(ContextLimitsQuotaTest, ReservationsAreChargedWithBuffersAndAcrossSessions) {
  TestDaemon::Options options;
  options.extra_flags = {absl::StrCat("--tenant-max-device-memory-bytes=", 64 * kMiB)};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TestDaemon> daemon, TestDaemon::Start(options));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon->address()));
  ASSERT_OK_AND_ASSIGN(Session first, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(Session second, client.OpenSession());
  RawModules raw_first(client, first.id());
  RawModules raw_second(client, second.id());

  ASSERT_OK(raw_first.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 40 * kMiB).status());
  // 40 MiB of heap + 30 MiB of buffer > 64 MiB: the allocation is refused by the ledger.
  EXPECT_THAT(first.Allocate(30 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
  // Across sessions of the tenant, too.
  EXPECT_THAT(
      raw_second.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 30 * kMiB),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("LIMIT_MALLOC_HEAP_SIZE"), HasSubstr("max_device_memory_bytes"))));
  // A value the worker refuses (beyond gpurpc's bound) is not charged.
  EXPECT_THAT(raw_second.SetLimit(v1::LIMIT_PRINTF_FIFO_SIZE, 65 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(Buffer small, second.Allocate(20 * kMiB));
  // Lowering the heap frees its room for a buffer.
  ASSERT_OK(raw_first.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 1 * kMiB).status());
  ASSERT_OK_AND_ASSIGN(Buffer big, first.Allocate(40 * kMiB));
  // The stack's reservation is per resident thread: 2 KiB x 8192 = 16 MiB more, over 64 MiB.
  EXPECT_THAT(raw_first.SetLimit(v1::LIMIT_STACK_SIZE, 2 * kKiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("LIMIT_STACK_SIZE")));
  // A closed session's reservations go with it.
  ASSERT_OK(first.Close());
  ASSERT_OK(raw_second.SetLimit(v1::LIMIT_MALLOC_HEAP_SIZE, 40 * kMiB).status());
}

}  // namespace
}  // namespace gpurpc
