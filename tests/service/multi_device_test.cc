// One daemon serving every device of its host: sessions on each device at once, through the
// C++ client against a real gpurpcd. Each session's device, memory info, buffers and kernels
// are its own device's; the daemon reports one session per device in its load;
// OpenSession(kAnyDevice) spreads sessions over the devices. Built twice: label `service` on
// the fake backend with two devices (--fake-devices=2), label `gpu` on the CUDA backend
// (GPURPC_TEST_BACKEND), where it skips on hosts with fewer than two GPUs.
#include <array>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::TestDaemon;

#ifndef GPURPC_TEST_BACKEND
#define GPURPC_TEST_BACKEND "fake"
#endif
constexpr char kBackend[] = GPURPC_TEST_BACKEND;
bool OnFake() { return std::string(kBackend) == "fake"; }

class MultiDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!OnFake()) {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "no CUDA: " << cuda;
      }
    }
    TestDaemon::Options options;
    options.backend = kBackend;
    options.warm_workers = 0;
    if (OnFake()) options.extra_flags = {"--fake-devices=2", "--fake-memory-bytes=1073741824"};
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
    auto devices = client_->ListDevices();
    ASSERT_THAT(devices, IsOk());
    devices_ = *devices;
    if (devices_.devices_size() < 2) {
      GTEST_SKIP() << "needs two GPUs; this host has " << devices_.devices_size();
    }
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  v1::ListDevicesResponse devices_;
};

TEST_F(MultiDeviceTest, SessionsOnEveryDeviceAtOnce) {
  const int count = devices_.devices_size();
  std::set<std::string> buses;
  for (const v1::DeviceInfo& device : devices_.devices()) buses.insert(device.pci_bus_id());
  if (!OnFake()) {
    EXPECT_EQ(static_cast<int>(buses.size()), count) << "every device is a GPU of its own";
  }

  // One thread per device, all at once: open, check the device, allocate, upload, compile,
  // launch, download; each with its own factor so that a mix-up shows.
  std::vector<Session> sessions(count);
  std::vector<std::vector<Buffer>> buffers(count);  // kept, so that the load counts them
  std::vector<absl::Status> results(count);
  std::vector<std::thread> threads;
  constexpr uint64_t kCount = 1 << 18;
  for (int d = 0; d < count; ++d) {
    threads.emplace_back([&, d] {
      auto run = [&]() -> absl::Status {
        auto session = client_->OpenSession(d, absl::StrCat("device ", d));
        if (!session.ok()) return session.status();
        if (session->device().ordinal() != d) {
          return absl::InternalError(absl::StrCat("session on ", session->device().ordinal()));
        }
        auto info = session->GetMemInfo();
        if (!info.ok()) return info.status();
        if (info->total_bytes != devices_.devices(d).total_memory_bytes()) {
          return absl::InternalError("GetMemInfo's total is not its device's");
        }
        // y += a * x with the fake's built-in axpy_f32 (real CUDA of the same name on a GPU).
        auto x = session->Allocate(kCount * sizeof(float));
        if (!x.ok()) return x.status();
        auto buffer = session->Allocate(kCount * sizeof(float));
        if (!buffer.ok()) return buffer.status();
        std::vector<float> data(kCount);
        for (uint64_t i = 0; i < kCount; ++i) data[i] = static_cast<float>(i % 1000);
        absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data.data()),
                                        data.size() * sizeof(float));
        if (absl::Status s = x->Upload(bytes); !s.ok()) return s;
        if (absl::Status s = session->Memset(buffer->at(), 0, 4, kCount); !s.ok()) return s;
        auto module = CompileFakeKernels(*session);
        if (!module.ok()) return module.status();
        auto function = module->GetFunction("axpy_f32");
        if (!function.ok()) return function.status();
        LaunchConfig launch;
        launch.grid = {static_cast<uint32_t>((kCount + 255) / 256), 1, 1};
        launch.block = {256, 1, 1};
        const float factor = static_cast<float>(d + 2);
        for (int repeat = 0; repeat < 50; ++repeat) {
          if (absl::Status s =
                  function->LaunchAsync(launch, repeat == 0 ? factor : 0.0f, *x, *buffer, kCount);
              !s.ok()) {
            return s;
          }
        }
        if (absl::Status s = session->Synchronize(); !s.ok()) return s;
        auto back = buffer->Download();
        if (!back.ok()) return back.status();
        std::vector<float> out(kCount);
        std::memcpy(out.data(), back->data(), back->size());
        for (uint64_t i = 0; i < kCount; ++i) {
          if (out[i] != data[i] * factor) {
            return absl::InternalError(
                absl::StrCat("device ", d, " element ", i, ": ", out[i], " != ", data[i] * factor));
          }
        }
        buffers[d].push_back(*std::move(x));
        buffers[d].push_back(*std::move(buffer));
        sessions[d] = *std::move(session);
        return absl::OkStatus();
      };
      results[d] = run();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int d = 0; d < count; ++d) EXPECT_THAT(results[d], IsOk()) << "device " << d;

  // The daemon's load: one session per device, its buffer counted there.
  auto loaded = client_->ListDevices();
  ASSERT_THAT(loaded, IsOk());
  for (const v1::DeviceInfo& device : loaded->devices()) {
    EXPECT_EQ(device.load().sessions(), 1u) << "device " << device.ordinal();
    EXPECT_GE(device.load().allocated_bytes(), 2 * kCount * sizeof(float));
  }
}

TEST_F(MultiDeviceTest, PlacementSpreadsOverTheDevices) {
  std::vector<Session> sessions;
  std::set<int> used;
  for (int i = 0; i < devices_.devices_size(); ++i) {
    auto session = client_->OpenSession(kAnyDevice, "placed");
    ASSERT_THAT(session, IsOk());
    used.insert(session->device().ordinal());
    sessions.push_back(*std::move(session));
  }
  EXPECT_EQ(static_cast<int>(used.size()), devices_.devices_size());
}

}  // namespace
}  // namespace gpurpc
