// Context limits and function configuration on the real driver (ctest label `gpu`): the CUDA
// backend's SetLimit/GetLimit (cuCtxSetLimit/cuCtxGetLimit) and cache configuration. Skips,
// with the reason, without a driver and a device. The kernels that need the new limits
// (device malloc, more than 48 KiB of dynamic shared memory after SetFunctionAttribute) are
// in tests/python/test_context_config.py (gpu-marked).

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::testing::Ge;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

class ContextLimitsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend();
    if (!backend.ok()) GTEST_SKIP() << "no CUDA driver or device: " << backend.status();
    backend_ = std::move(backend).value();
    absl::StatusOr<std::unique_ptr<Context>> context = backend_->OpenContext(0);
    ASSERT_TRUE(context.ok()) << context.status();
    context_ = std::move(context).value();
  }
  void TearDown() override {
    context_.reset();
    backend_.reset();
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Context> context_;
};

TEST_F(ContextLimitsGpuTest, LimitsReadBackFromTheDriver) {
  ASSERT_OK(context_->SetLimit(ContextLimit::kPrintfFifoSize, 8 * kMiB));
  ASSERT_OK(context_->SetLimit(ContextLimit::kStackSize, 8 * kKiB));
  ASSERT_OK(context_->SetLimit(ContextLimit::kMallocHeapSize, 128 * kMiB));
  // The driver may round up, never down.
  ASSERT_OK_AND_ASSIGN(uint64_t fifo, context_->GetLimit(ContextLimit::kPrintfFifoSize));
  EXPECT_THAT(fifo, Ge(8 * kMiB));
  ASSERT_OK_AND_ASSIGN(uint64_t stack, context_->GetLimit(ContextLimit::kStackSize));
  EXPECT_THAT(stack, Ge(8 * kKiB));
  ASSERT_OK_AND_ASSIGN(uint64_t heap, context_->GetLimit(ContextLimit::kMallocHeapSize));
  EXPECT_THAT(heap, Ge(128 * kMiB));
  ASSERT_OK(context_->Synchronize());
}

TEST_F(ContextLimitsGpuTest, CacheConfigRoundTrips) {
  ASSERT_OK(context_->SetCacheConfig(CacheConfig::kPreferL1));
  ASSERT_OK_AND_ASSIGN(CacheConfig config, context_->GetCacheConfig());
  EXPECT_EQ(config, CacheConfig::kPreferL1);
  ASSERT_OK(context_->SetCacheConfig(CacheConfig::kPreferNone));
}

}  // namespace
}  // namespace gpurpc::backend
