// The devices/sessions/memory contract, through the C++ client against a real gpurpcd with
// real worker processes. Compiled twice: label `service` with the fake backend, label
// `gpu` with the CUDA backend (GPURPC_TEST_BACKEND), where it skips without a driver.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr char kBackend[] = GPURPC_TEST_BACKEND;
constexpr uint64_t kMiB = 1ull << 20;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 rng(seed);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32_t v = rng();
    std::memcpy(out.data() + i, &v, 4);
  }
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(rng());
  return out;
}

class MemoryContractTest : public ::testing::Test {
 protected:
  static TestDaemon::Options DaemonOptions() {
    TestDaemon::Options options;
    options.backend = kBackend;
    return options;
  }

  void StartDaemon(TestDaemon::Options options) {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA contract: " << cuda;
      }
    }
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
  }

  void SetUp() override { StartDaemon(DaemonOptions()); }

  // The sessions the test's tenant holds open, as GetServerInfo says; -1 without an answer.
  int64_t SessionsOpen() const {
    absl::StatusOr<v1::GetServerInfoResponse> info = client_->GetServerInfo();
    return info.ok() ? static_cast<int64_t>(info->sessions_open()) : -1;
  }

  Session Open() {
    auto session = client_->OpenSession(0, "memory contract test");
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : Session();
  }

  // Calls a MemoryService method with the given session id directly (no client checks).
  grpc::Status RawFree(uint64_t session_id, uint64_t buffer_id) {
    auto stub = v1::MemoryService::NewStub(client_->channel());
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(session_id));
    v1::FreeRequest request;
    request.set_buffer_id(buffer_id);
    v1::FreeResponse response;
    return stub->Free(&context, request, &response);
  }

  void ExpectRoundTrip(const Session& session, uint64_t size, uint64_t offset, uint32_t seed) {
    const uint64_t guard = 64;
    auto buffer = session.Allocate(std::max<uint64_t>(offset + size + guard, 1));
    ASSERT_THAT(buffer, IsOk());
    ASSERT_THAT(session.Memset(buffer->at(0), 0xA5, 1, buffer->size_bytes()), IsOk());
    const std::vector<uint8_t> data = RandomBytes(size, seed);
    ASSERT_THAT(buffer->Upload(data, offset), IsOk()) << "size " << size;
    auto back = buffer->Download(offset, size);
    ASSERT_THAT(back, IsOk());
    EXPECT_TRUE(*back == data) << "round trip of " << size << " bytes at offset " << offset;
    auto around = buffer->Download(0, buffer->size_bytes());
    ASSERT_THAT(around, IsOk());
    for (uint64_t i = 0; i < offset; ++i) ASSERT_EQ((*around)[i], 0xA5) << i;
    for (uint64_t i = offset + size; i < around->size(); ++i) ASSERT_EQ((*around)[i], 0xA5) << i;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(MemoryContractTest, ListsItsDevicesWithLaunchLimits) {
  auto devices = client_->ListDevices();
  ASSERT_THAT(devices, IsOk());
  ASSERT_GE(devices->devices_size(), 1);
  EXPECT_EQ(devices->backend(), kBackend);
  const v1::DeviceInfo& device = devices->devices(0);
  EXPECT_GT(device.total_memory_bytes(), 0u);
  EXPECT_GT(device.multiprocessor_count(), 0);
  EXPECT_GT(device.max_threads_per_block(), 0);
  EXPECT_GT(device.max_grid_dim().x(), 0u);
  EXPECT_GT(device.max_shared_memory_per_block_bytes(), 0);
  EXPECT_FALSE(device.attributes().empty());
  if (std::string(kBackend) == "fake") {
    EXPECT_TRUE(device.is_fake());
    EXPECT_THAT(device.name(), HasSubstr("not a GPU"));
  } else {
    EXPECT_FALSE(device.is_fake());
    EXPECT_GE(device.compute_capability_major(), 7);
  }
}

TEST_F(MemoryContractTest, OpenSessionOnUnknownDeviceIsNotFound) {
  EXPECT_THAT(client_->OpenSession(99), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(MemoryContractTest, RoundTripsRandomBytesAtSizesAndOffsets) {
  Session session = Open();
  const uint64_t sizes[] = {0, 1, 4095, kMiB + 1, 64 * kMiB};
  const uint64_t offsets[] = {0, 3, 4096 + 7};
  uint32_t seed = 1;
  for (uint64_t size : sizes) {
    for (uint64_t offset : offsets) {
      if (size == 64 * kMiB && offset != 3) continue;  // one 64 MiB run is enough
      ExpectRoundTrip(session, size, offset, seed++);
    }
  }
}

// The worker fills a download's next chunks while it writes one: a client that reads a
// little and goes away (or reads nothing) must leave no filler behind that blocks the
// session, and the next downloads carry every byte.
TEST_F(MemoryContractTest, ADownloadStreamAbandonedMidwayLeavesTheSessionServing) {
  Session session = Open();
  const uint64_t size = 32 * kMiB + 5;
  auto buffer = session.Allocate(size);
  ASSERT_THAT(buffer, IsOk());
  const std::vector<uint8_t> data = RandomBytes(size, 77);
  ASSERT_THAT(buffer->Upload(data), IsOk());
  auto stub = v1::MemoryService::NewStub(client_->channel());
  for (int read_before_leaving : {0, 1, 3}) {
    SCOPED_TRACE(absl::StrCat(read_before_leaving, " chunks read"));
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(session.id()));
    v1::DownloadRequest request;
    request.mutable_source()->mutable_buffer()->set_buffer_id(buffer->id());
    request.set_size_bytes(size);
    auto reader = stub->DownloadStream(&context, request);
    v1::DownloadResponse chunk;
    for (int i = 0; i < read_before_leaving; ++i) {
      ASSERT_TRUE(reader->Read(&chunk));
      EXPECT_EQ(chunk.data().size(), kMiB);
      EXPECT_EQ(std::memcmp(chunk.data().data(), data.data() + i * kMiB, chunk.data().size()), 0)
          << "chunk " << i << " holds other bytes";
    }
    context.TryCancel();
    // CANCELLED, or OK where the transport had taken in the whole stream before the cancel.
    const grpc::StatusCode code = reader->Finish().error_code();
    EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::OK) << code;
    auto back = buffer->Download(0, size);
    ASSERT_THAT(back, IsOk());
    EXPECT_TRUE(*back == data) << "the download after an abandoned one differs";
  }
}

// A flood of downloads that are never read: more than the worker's 8 fill-ahead helpers, so
// the later ones fill inline. While they stall, the session still downloads every byte, and
// once they are cancelled it still does.
TEST_F(MemoryContractTest, ManyStalledDownloadStreamsLeaveTheSessionServing) {
  Session session = Open();
  const uint64_t size = 16 * kMiB + 3;
  auto buffer = session.Allocate(size);
  ASSERT_THAT(buffer, IsOk());
  const std::vector<uint8_t> data = RandomBytes(size, 78);
  ASSERT_THAT(buffer->Upload(data), IsOk());
  auto stub = v1::MemoryService::NewStub(client_->channel());
  constexpr int kStalled = 12;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>>> readers;
  for (int i = 0; i < kStalled; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->AddMetadata(kSessionMetadataKey, std::to_string(session.id()));
    v1::DownloadRequest request;
    request.mutable_source()->mutable_buffer()->set_buffer_id(buffer->id());
    request.set_size_bytes(size);
    readers.push_back(stub->DownloadStream(contexts.back().get(), request));
  }
  auto during = buffer->Download(0, size);
  ASSERT_THAT(during, IsOk());
  EXPECT_TRUE(*during == data) << "a download beside stalled ones differs";
  for (int i = 0; i < kStalled; ++i) {
    contexts[i]->TryCancel();
    const grpc::StatusCode code = readers[i]->Finish().error_code();
    EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::OK) << code;
  }
  auto after = buffer->Download(0, size);
  ASSERT_THAT(after, IsOk());
  EXPECT_TRUE(*after == data) << "a download after the stalled ones differs";
}

TEST_F(MemoryContractTest, ZeroByteTransferAtTheEndIsAllowed) {
  Session session = Open();
  auto buffer = session.Allocate(16);
  ASSERT_THAT(buffer, IsOk());
  EXPECT_THAT(buffer->Upload({}, 16), IsOk());
  auto empty = buffer->Download(16, 0);
  ASSERT_THAT(empty, IsOk());
  EXPECT_TRUE(empty->empty());
}

TEST_F(MemoryContractTest, AllocateZeroBytesIsInvalid) {
  Session session = Open();
  EXPECT_THAT(session.Allocate(0), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(MemoryContractTest, EveryOutOfBoundsAccessIsRejectedAndWritesNothing) {
  Session session = Open();
  auto buffer = session.Allocate(4096);
  ASSERT_THAT(buffer, IsOk());
  auto other = session.Allocate(4096);
  ASSERT_THAT(other, IsOk());
  ASSERT_THAT(session.Memset(buffer->at(0), 0x11, 1, 4096), IsOk());
  const auto small = RandomBytes(100, 7);
  const auto big = RandomBytes(2 * kMiB, 8);  // the chunked stream path
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  EXPECT_THAT(buffer->Upload(small, 4000), StatusIs(kInvalid, HasSubstr("outside the buffer")));
  EXPECT_THAT(buffer->Upload(small, 5000), StatusIs(kInvalid));
  EXPECT_THAT(buffer->Upload(big, 0), StatusIs(kInvalid));
  EXPECT_THAT(buffer->Upload(small, ~0ull - 10), StatusIs(kInvalid));
  EXPECT_THAT(buffer->Download(4000, 100), StatusIs(kInvalid));
  EXPECT_THAT(buffer->Download(0, 2 * kMiB), StatusIs(kInvalid));
  EXPECT_THAT(session.Memset(buffer->at(4000), 0, 1, 97), StatusIs(kInvalid));
  EXPECT_THAT(session.Memset(buffer->at(4000), 0, 4, 25), StatusIs(kInvalid));
  EXPECT_THAT(session.Memset(buffer->at(1), 0, 4, 4), StatusIs(kInvalid, HasSubstr("aligned")));
  EXPECT_THAT(session.Memset(buffer->at(0), 0, 3, 4), StatusIs(kInvalid));
  EXPECT_THAT(session.CopyDeviceToDevice(buffer->at(4000), other->at(0), 97), StatusIs(kInvalid));
  EXPECT_THAT(session.CopyDeviceToDevice(buffer->at(0), other->at(4000), 97), StatusIs(kInvalid));
  // Address arithmetic: inside the buffer but running past its end.
  EXPECT_THAT(session.Upload(DeviceRef::Address(buffer->device_address() + 4090), small),
              StatusIs(kInvalid));
  // An address in no buffer at all. (Past the end of one buffer may be the start of the
  // next: the driver packs allocations.)
  EXPECT_THAT(session.Upload(DeviceRef::Address(64), small), StatusIs(absl::StatusCode::kNotFound));

  auto back = buffer->Download(0, 4096);
  ASSERT_THAT(back, IsOk());
  EXPECT_TRUE(std::all_of(back->begin(), back->end(), [](uint8_t b) { return b == 0x11; }))
      << "a rejected call wrote into the buffer";
}

TEST_F(MemoryContractTest, AddressArithmeticReachesTheRightBytes) {
  Session session = Open();
  auto buffer = session.Allocate(1024);
  ASSERT_THAT(buffer, IsOk());
  const auto data = RandomBytes(1024, 9);
  ASSERT_THAT(buffer->Upload(data), IsOk());
  auto part = session.Download(DeviceRef::Address(buffer->device_address() + 100), 50);
  ASSERT_THAT(part, IsOk());
  EXPECT_TRUE(std::equal(part->begin(), part->end(), data.begin() + 100));
}

TEST_F(MemoryContractTest, MemsetsEachElementSize) {
  Session session = Open();
  auto buffer = session.Allocate(64);
  ASSERT_THAT(buffer, IsOk());
  ASSERT_THAT(session.Memset(buffer->at(0), 0, 1, 64), IsOk());
  ASSERT_THAT(session.Memset(buffer->at(0), 0x7F, 1, 8), IsOk());
  ASSERT_THAT(session.Memset(buffer->at(8), 0xBEEF, 2, 4), IsOk());
  ASSERT_THAT(session.Memset(buffer->at(16), 0xDEADBEEF, 4, 4), IsOk());
  auto back = buffer->Download(0, 64);
  ASSERT_THAT(back, IsOk());
  for (int i = 0; i < 8; ++i) EXPECT_EQ((*back)[i], 0x7F);
  for (int i = 0; i < 4; ++i) {
    uint16_t v;
    std::memcpy(&v, back->data() + 8 + 2 * i, 2);
    EXPECT_EQ(v, 0xBEEF);
  }
  for (int i = 0; i < 4; ++i) {
    uint32_t v;
    std::memcpy(&v, back->data() + 16 + 4 * i, 4);
    EXPECT_EQ(v, 0xDEADBEEFu);
  }
  for (int i = 32; i < 64; ++i) EXPECT_EQ((*back)[i], 0);
}

TEST_F(MemoryContractTest, CopiesDeviceToDeviceWithOffsets) {
  Session session = Open();
  auto a = session.Allocate(1000);
  auto b = session.Allocate(1000);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  const auto data = RandomBytes(1000, 11);
  ASSERT_THAT(a->Upload(data), IsOk());
  ASSERT_THAT(session.Memset(b->at(0), 0, 1, 1000), IsOk());
  ASSERT_THAT(session.CopyDeviceToDevice(b->at(10), a->at(500), 300), IsOk());
  auto back = b->Download(10, 300);
  ASSERT_THAT(back, IsOk());
  EXPECT_TRUE(std::equal(back->begin(), back->end(), data.begin() + 500));
}

TEST_F(MemoryContractTest, MemInfoReportsTotalAndFreeing) {
  Session session = Open();
  auto info = session.GetMemInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_GT(info->total_bytes, 0u);
  EXPECT_LE(info->free_bytes, info->total_bytes);
}

TEST_F(MemoryContractTest, UnknownHandleDoubleFreeAndOtherSessionsHandlesAreNotFound) {
  Session a = Open();
  Session b = Open();
  auto buffer = a.Allocate(256);
  ASSERT_THAT(buffer, IsOk());
  const uint64_t id = buffer->id();

  EXPECT_EQ(RawFree(a.id(), 0x1234567).error_code(), grpc::StatusCode::NOT_FOUND);
  // Another session's handle and address: NOT_FOUND, never PERMISSION_DENIED.
  EXPECT_EQ(RawFree(b.id(), id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(b.Download(DeviceRef{id, 0, 0}, 16), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(b.Download(DeviceRef::Address(buffer->device_address()), 16),
              StatusIs(absl::StatusCode::kNotFound));
  // Still A's.
  EXPECT_THAT(a.Download(buffer->at(0), 16), IsOk());
  EXPECT_TRUE(RawFree(a.id(), id).ok());
  EXPECT_EQ(RawFree(a.id(), id).error_code(), grpc::StatusCode::NOT_FOUND);  // double free
}

// The ownership rules every handle shares (internal::SessionObject in client.h), through
// Buffer, Stream and Event: a move hands the object over, the moved-from handle frees
// nothing, assigning over a live handle frees what it held, and a handle whose release was
// refused still owns its object.
TEST_F(MemoryContractTest, HandlesHandOverOnMoveAndFreeWhatTheyHeldWhenAssignedOver) {
  Session session = Open();
  auto first = session.Allocate(256);
  auto second = session.Allocate(256);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  const uint64_t first_id = first->id();
  const uint64_t second_id = second->id();
  {
    Buffer taken(std::move(*first));
    EXPECT_EQ(taken.id(), first_id);
    EXPECT_EQ(first->id(), 0u);
    // The moved-from handle keeps no address into the buffer it gave away.
    EXPECT_EQ(first->device_address(), 0u);
    EXPECT_EQ(first->at(16).device_address, 0u);
    EXPECT_THAT(session.Download(first->at(0), 16), StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(first->Free(), StatusIs(absl::StatusCode::kNotFound));
    *first = std::move(taken);  // back again; `taken` dies holding nothing
  }
  EXPECT_THAT(session.Download(first->at(0), 16), IsOk());  // nothing was freed

  *first = std::move(*second);  // frees the first buffer, takes the second
  EXPECT_EQ(first->id(), second_id);
  EXPECT_EQ(second->id(), 0u);
  EXPECT_THAT(session.Download(DeviceRef{first_id, 0, 0}, 16),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(session.Download(first->at(0), 16), IsOk());

  auto stream = session.CreateStream();
  auto event = session.CreateEvent();
  ASSERT_THAT(stream, IsOk());
  ASSERT_THAT(event, IsOk());
  {
    Stream moved_stream(std::move(*stream));
    Event moved_event(std::move(*event));
    *stream = std::move(moved_stream);
    *event = std::move(moved_event);
  }
  ASSERT_THAT(event->Record(&*stream), IsOk());
  EXPECT_THAT(stream->Synchronize(), IsOk());
  EXPECT_THAT(event->Synchronize(), IsOk());
  EXPECT_THAT(first->Free(), IsOk());
  EXPECT_THAT(first->Free(), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(MemoryContractTest, AllocationBeyondFreeMemoryIsResourceExhaustedAndHarmless) {
  Session session = Open();
  auto info = session.GetMemInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_THAT(session.Allocate(info->total_bytes * 4),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ExpectRoundTrip(session, 4096, 5, 3);
}

TEST_F(MemoryContractTest, SessionScopedCallsNeedTheSessionMetadata) {
  auto stub = v1::MemoryService::NewStub(client_->channel());
  v1::AllocateRequest request;
  request.set_size_bytes(16);
  v1::AllocateResponse response;
  {
    grpc::ClientContext context;
    grpc::Status status = stub->Allocate(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr(kSessionMetadataKey));
  }
  {
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, "not-a-number");
    EXPECT_EQ(stub->Allocate(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, "12345");
    EXPECT_EQ(stub->Allocate(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(MemoryContractTest, ClosedSessionIsNotFound) {
  Session session = Open();
  const uint64_t id = session.id();
  ASSERT_THAT(session.Close(), IsOk());
  EXPECT_EQ(RawFree(id, 1).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(MemoryContractTest, SixteenParallelSessionsSeeOnlyTheirOwnData) {
  constexpr int kSessions = 16;
  std::vector<std::thread> threads;
  std::vector<uint64_t> buffer_ids(kSessions);
  std::vector<uint64_t> session_ids(kSessions);
  std::atomic<int> failures{0};
  std::atomic<int> ready{0};
  std::atomic<bool> release{false};
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] {
      auto session = client_->OpenSession(0, "parallel " + std::to_string(i));
      if (!session.ok()) {
        ++failures;
        ++ready;
        return;
      }
      const auto data = RandomBytes(kMiB + 17, 1000 + i);
      auto buffer = session->Allocate(data.size());
      if (!buffer.ok() || !buffer->Upload(data).ok()) ++failures;
      if (buffer.ok()) buffer_ids[i] = buffer->id();
      session_ids[i] = session->id();
      ++ready;
      while (!release) std::this_thread::yield();  // all sessions alive at once
      for (int round = 0; round < 3 && buffer.ok(); ++round) {
        auto back = buffer->Download();
        if (!back.ok() || *back != data) ++failures;
      }
      // Every other session's buffer id is unknown here.
      for (int j = 0; j < kSessions; ++j) {
        if (j == i || buffer_ids[j] == 0) continue;
        if (session->Download(DeviceRef{buffer_ids[j], 0, 0}, 1).status().code() !=
            absl::StatusCode::kNotFound) {
          ++failures;
        }
      }
    });
  }
  while (ready < kSessions) std::this_thread::yield();
  release = true;
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

class IsolationTest : public MemoryContractTest {
 protected:
  void SetUp() override {
    TestDaemon::Options options = DaemonOptions();
    options.warm_workers = 0;  // each session's worker is the newest child
    options.idle_timeout = "1500ms";
    StartDaemon(options);
  }
};

TEST_F(IsolationTest, KilledWorkerFaultsOnlyItsSession) {
  Session victim = Open();
  const std::vector<pid_t> before = daemon_->WorkerPids();
  ASSERT_EQ(before.size(), 1u);
  Session bystander = Open();
  auto buffer = victim.Allocate(1024);
  ASSERT_THAT(buffer, IsOk());

  ASSERT_EQ(kill(before[0], SIGKILL), 0);
  absl::StatusOr<v1::KeepAliveResponse> state;
  for (int i = 0; i < 200; ++i) {
    state = victim.KeepAlive();
    if (state.ok() && state->state() == v1::SESSION_STATE_FAULTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->state(), v1::SESSION_STATE_FAULTED);
  EXPECT_THAT(state->fault_cause(), HasSubstr("signal 9"));
  EXPECT_THAT(victim.Allocate(16),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("signal 9")));
  EXPECT_THAT(buffer->Download(0, 16), StatusIs(absl::StatusCode::kFailedPrecondition));

  ExpectRoundTrip(bystander, kMiB + 1, 7, 42);
}

TEST_F(IsolationTest, WorkerKilledDuringACallAbortsThatCall) {
  Session victim = Open();
  const std::vector<pid_t> workers = daemon_->WorkerPids();
  ASSERT_EQ(workers.size(), 1u);
  auto buffer = victim.Allocate(64 * kMiB);
  ASSERT_THAT(buffer, IsOk());
  const auto data = RandomBytes(64 * kMiB, 5);
  std::atomic<int> uploads{0};
  std::atomic<bool> finished{false};
  std::thread killer([&] {
    // Once the uploads are under way (the first is done, the next one is in flight).
    Eventually([&] { return uploads.load() > 0 || finished.load(); }, testing::kEventually,
               absl::Milliseconds(1));
    kill(workers[0], SIGKILL);
  });
  absl::Status status;
  for (int i = 0; i < 50 && status.ok(); ++i) {
    status = buffer->Upload(data);
    ++uploads;
  }
  finished = true;
  killer.join();
  EXPECT_THAT(status, ::testing::AnyOf(StatusIs(absl::StatusCode::kAborted),
                                       StatusIs(absl::StatusCode::kFailedPrecondition)));
  EXPECT_THAT(victim.Allocate(16), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(IsolationTest, VanishedClientIsReclaimedAfterTheIdleTimeout) {
  // A client that opens a session and disappears: no calls, no keepalive.
  auto stub = v1::SessionService::NewStub(client_->channel());
  grpc::ClientContext open_context;
  v1::OpenSessionRequest request;
  v1::OpenSessionResponse response;
  ASSERT_TRUE(stub->OpenSession(&open_context, request, &response).ok());
  EXPECT_EQ(response.idle_timeout_ms(), 1500u);
  ASSERT_EQ(daemon_->WorkerPids().size(), 1u);

  // Meanwhile a well-behaved session stays alive: its client holds a WatchSession stream.
  Session kept = Open();

  // Reclaimed after the idle timeout: the tenant holds only the kept session, and the
  // reclaimed session's worker ends. (GetServerInfo is no session call: polling it does not
  // keep the session.)
  EXPECT_TRUE(Eventually([&] { return SessionsOpen() == 1; }))
      << "the vanished client's session was not reclaimed";
  EXPECT_TRUE(Eventually([&] { return daemon_->WorkerPids().size() == 1u; }))
      << "the reclaimed session's worker still runs";
  grpc::ClientContext context;
  context.AddMetadata(kSessionMetadataKey, std::to_string(response.session_id()));
  v1::KeepAliveResponse state;
  EXPECT_EQ(stub->KeepAlive(&context, v1::KeepAliveRequest(), &state).error_code(),
            grpc::StatusCode::NOT_FOUND);
  ExpectRoundTrip(kept, 100, 1, 77);
}

TEST_F(IsolationTest, AnOpenCommandStreamDoesNotKeepAVanishedClientsSession) {
  auto sessions = v1::SessionService::NewStub(client_->channel());
  grpc::ClientContext open_context;
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(sessions->OpenSession(&open_context, v1::OpenSessionRequest(), &opened).ok());
  // The client opens its command stream, uses it once, and then goes quiet with the stream
  // still open (as a hung or partitioned client would).
  auto execution = v1::ExecutionService::NewStub(client_->channel());
  grpc::ClientContext stream_context;
  stream_context.AddMetadata(kSessionMetadataKey, std::to_string(opened.session_id()));
  auto stream = execution->CommandStream(&stream_context);
  v1::CommandBatch batch;
  v1::Command* sync = batch.add_commands();
  sync->set_sequence(1);
  sync->mutable_sync()->set_whole_session(true);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));

  // Reclaimed after the idle timeout, the open stream notwithstanding. (GetServerInfo is no
  // session call: polling it does not keep the session.)
  EXPECT_TRUE(Eventually([&] { return SessionsOpen() == 0; }))
      << "the session of a quiet command stream was not reclaimed";
  grpc::ClientContext context;
  context.AddMetadata(kSessionMetadataKey, std::to_string(opened.session_id()));
  v1::KeepAliveResponse state;
  EXPECT_EQ(sessions->KeepAlive(&context, v1::KeepAliveRequest(), &state).error_code(),
            grpc::StatusCode::NOT_FOUND);
  stream_context.TryCancel();
  stream->Finish().ok();
}

#if GPURPC_TEST_LARGE
TEST_F(MemoryContractTest, SixGibBufferRoundTrip) {
  Session session = Open();
  const uint64_t size = 6ull << 30;
  auto buffer = session.Allocate(size);
  ASSERT_THAT(buffer, IsOk());
  std::vector<uint8_t> data = RandomBytes(size, 6);
  ASSERT_THAT(buffer->Upload(data), IsOk());
  std::vector<uint8_t> back(size);
  ASSERT_THAT(session.DownloadInto(buffer->at(0), absl::MakeSpan(back)), IsOk());
  EXPECT_TRUE(back == data);
}
#endif

}  // namespace
}  // namespace gpurpc
