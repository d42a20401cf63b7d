// CUDA IPC between sessions of one tenant (SessionService.ExportMemory / OpenMemoryHandle and
// ExportEvent / OpenEventHandle) through the C++ client against a real gpurpcd with real
// worker processes. Compiled twice: label `service` with the fake backend, whose memory and
// events cannot leave its worker process (it answers UNIMPLEMENTED, and the handle checks
// that need no export run there), and label `gpu` with the CUDA backend
// (GPURPC_TEST_BACKEND), where two worker processes really share memory and events through
// cuIpcOpenMemHandle and cuIpcOpenEventHandle; it skips without a driver. Tenants: the test's own
// user over the Unix socket, and "mallory" with a bearer token over loopback TCP.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr char kBackend[] = GPURPC_TEST_BACKEND;
constexpr uint64_t kSize = 1 << 20;

bool IsCuda() { return std::string(kBackend) == "cuda"; }

class IpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (IsCuda()) {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping CUDA IPC: " << cuda;
      }
    }
    auto token = testing::MakeToken("mallory");
    ASSERT_THAT(token, IsOk());
    mallory_token_ = token->token;
    tokens_file_ = absl::StrCat(::testing::TempDir(), "/ipc_tokens_", getpid());
    std::ofstream(tokens_file_) << token->line << "\n";
    chmod(tokens_file_.c_str(), 0600);
    TestDaemon::Options options;
    options.backend = kBackend;
    options.listen_tcp = true;
    options.extra_flags = {absl::StrCat("--tokens-file=", tokens_file_)};
    auto daemon = TestDaemon::Start(options);
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
  }
  void TearDown() override { std::remove(tokens_file_.c_str()); }

  Session Open() {
    auto session = client_->OpenSession(0, "ipc test");
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : Session();
  }

  // A session of another tenant, "mallory" (bearer token over loopback TCP).
  Session OpenAsMallory() {
    ConnectOptions options;
    options.address = daemon_->tcp_address();
    options.token = mallory_token_;
    options.use_environment = false;
    auto mallory = Client::Connect(options);
    EXPECT_THAT(mallory, IsOk());
    if (!mallory.ok()) return Session();
    mallory_ = std::make_unique<Client>(*std::move(mallory));
    auto session = mallory_->OpenSession(0, "mallory");
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : Session();
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Client> mallory_;
  std::string tokens_file_;
  std::string mallory_token_;
};

TEST_F(IpcTest, HandlesThatNameNoExportAreRefused) {
  Session session = Open();
  EXPECT_THAT(session.OpenMemoryHandle(std::string(32, '\x01')).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
  EXPECT_THAT(session.OpenMemoryHandle("").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 bytes")));
  EXPECT_THAT(session.OpenMemoryHandle(std::string(4096, 'x')).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 bytes")));
  // Unknown buffers are not exported.
  Buffer none;
  EXPECT_THAT(session.ExportMemory(none).status(), StatusIs(absl::StatusCode::kNotFound));
  // The session is unharmed.
  EXPECT_THAT(session.Allocate(64).status(), IsOk());
}

TEST_F(IpcTest, EventHandlesThatNameNoExportAreRefused) {
  Session session = Open();
  EXPECT_THAT(session.OpenEventHandle(std::string(32, '\x01')).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
  EXPECT_THAT(session.OpenEventHandle("short").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 bytes")));
  Event none;
  EXPECT_THAT(session.ExportEvent(none).status(), StatusIs(absl::StatusCode::kNotFound));
  // An event made without the interprocess flag is not exported (on every backend).
  auto plain = session.CreateEvent(/*disable_timing=*/true);
  ASSERT_THAT(plain, IsOk());
  EXPECT_THAT(session.ExportEvent(*plain).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not created interprocess")));
  EXPECT_THAT(plain->Synchronize(), IsOk());
}

TEST_F(IpcTest, TheFakeBackendSaysItCannotShareEvents) {
  if (IsCuda()) GTEST_SKIP() << "the CUDA backend shares events: the other tests cover it";
  Session session = Open();
  EXPECT_THAT(session.CreateInterprocessEvent().status(),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("CUDA IPC")));
  // The refusal hurt nothing.
  auto event = session.CreateEvent();
  ASSERT_THAT(event, IsOk());
  EXPECT_THAT(event->Record(), IsOk());
  EXPECT_THAT(event->Synchronize(), IsOk());
}

TEST_F(IpcTest, TheFakeBackendSaysItCannotShareMemory) {
  if (IsCuda()) GTEST_SKIP() << "the CUDA backend shares memory: the other tests cover it";
  Session session = Open();
  auto buffer = session.Allocate(kSize);
  ASSERT_THAT(buffer, IsOk());
  EXPECT_THAT(session.ExportMemory(*buffer).status(),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("CUDA IPC")));
  // Nothing was exported: the buffer frees as usual.
  EXPECT_THAT(buffer->Free(), IsOk());
}

class CudaIpcTest : public IpcTest {
 protected:
  void SetUp() override {
    if (!IsCuda()) GTEST_SKIP() << "CUDA IPC needs the CUDA backend (the gpu label runs it)";
    IpcTest::SetUp();
  }
};

TEST_F(CudaIpcTest, AnotherSessionOfTheTenantReadsAndWritesTheMemory) {
  Session exporter = Open();
  Session importer = Open();
  auto original = exporter.Allocate(kSize);
  ASSERT_THAT(original, IsOk());
  std::vector<uint8_t> data(kSize);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSERT_THAT(original->Upload(data), IsOk());

  auto handle = exporter.ExportMemory(*original);
  ASSERT_THAT(handle, IsOk());
  EXPECT_EQ(handle->size(), 32u);
  EXPECT_THAT(exporter.ExportMemory(*original), IsOkAndHolds(*handle));  // same handle again
  auto opened = importer.OpenMemoryHandle(*handle);
  ASSERT_THAT(opened, IsOk());
  EXPECT_EQ(opened->size_bytes(), kSize);
  // The importer sees the exporter's bytes...
  EXPECT_THAT(opened->Download(), IsOkAndHolds(data));
  // ...and what it writes, the exporter sees.
  ASSERT_THAT(importer.Memset(opened->at(4096), 0xab, 1, 100), IsOk());
  ASSERT_THAT(importer.Synchronize(), IsOk());
  auto seen = original->Download(4096, 100);
  ASSERT_THAT(seen, IsOk());
  EXPECT_EQ(*seen, std::vector<uint8_t>(100, 0xab));
  // Bounds hold on the opened buffer as on any.
  EXPECT_THAT(opened->Download(kSize - 8, 16).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // Once per session; not in the exporting session itself.
  EXPECT_THAT(importer.OpenMemoryHandle(*handle).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already")));
  EXPECT_THAT(exporter.OpenMemoryHandle(*handle).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own buffer")));
  // An opened buffer is not exported again.
  EXPECT_THAT(importer.ExportMemory(*opened).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("export the original")));
}

TEST_F(CudaIpcTest, TheExporterCannotFreeMemoryAnotherSessionHasOpen) {
  Session exporter = Open();
  Session importer = Open();
  auto original = exporter.Allocate(kSize);
  ASSERT_THAT(original, IsOk());
  auto handle = exporter.ExportMemory(*original);
  ASSERT_THAT(handle, IsOk());
  auto opened = importer.OpenMemoryHandle(*handle);
  ASSERT_THAT(opened, IsOk());
  EXPECT_THAT(original->Free(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr(absl::StrCat("session(s) ", importer.id()))));
  // The refused Free left the memory and its export in place: the importer still reads it,
  // closes it, and a third session can open it after.
  EXPECT_THAT(opened->Download(0, 16).status(), IsOk());
  ASSERT_THAT(opened->Free(), IsOk());  // closes the mapping
  Session again = Open();
  auto third = again.OpenMemoryHandle(*handle);
  ASSERT_THAT(third, IsOk());
  ASSERT_THAT(third->Free(), IsOk());
  // The handle whose Free was refused still owns the buffer: now nobody has it open.
  EXPECT_THAT(original->Free(), IsOk());
}

TEST_F(CudaIpcTest, AFreedExportCannotBeOpened) {
  Session exporter = Open();
  Session importer = Open();
  auto original = exporter.Allocate(kSize);
  ASSERT_THAT(original, IsOk());
  auto handle = exporter.ExportMemory(*original);
  ASSERT_THAT(handle, IsOk());
  ASSERT_THAT(original->Free(), IsOk());
  EXPECT_THAT(importer.OpenMemoryHandle(*handle).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
}

TEST_F(CudaIpcTest, AnotherTenantCannotOpenTheHandle) {
  Session exporter = Open();
  auto original = exporter.Allocate(kSize);
  ASSERT_THAT(original, IsOk());
  auto handle = exporter.ExportMemory(*original);
  ASSERT_THAT(handle, IsOk());
  Session theirs = OpenAsMallory();
  EXPECT_THAT(theirs.OpenMemoryHandle(*handle).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
  // And the export is untouched: the owner's tenant still opens it.
  Session importer = Open();
  EXPECT_THAT(importer.OpenMemoryHandle(*handle).status(), IsOk());
}

TEST_F(CudaIpcTest, WhenTheExporterEndsItsImportsAreClosed) {
  Session exporter = Open();
  Session importer = Open();
  auto original = exporter.Allocate(kSize);
  ASSERT_THAT(original, IsOk());
  auto handle = exporter.ExportMemory(*original);
  ASSERT_THAT(handle, IsOk());
  auto opened = importer.OpenMemoryHandle(*handle);
  ASSERT_THAT(opened, IsOk());
  const DeviceRef where = opened->at();
  ASSERT_THAT(exporter.Close(), IsOk());
  // The importer's buffer is closed for it: its id answers NOT_FOUND.
  EXPECT_TRUE(testing::Eventually(
      [&] { return importer.Download(where, 16).status().code() == absl::StatusCode::kNotFound; },
      absl::Seconds(30)));
  EXPECT_THAT(importer.Allocate(64).status(), IsOk());
  // And the handle is gone.
  Session late = Open();
  EXPECT_THAT(late.OpenMemoryHandle(*handle).status(), StatusIs(absl::StatusCode::kNotFound));
}

// `grid` blocks of `block` threads along x, on `stream`.
LaunchConfig Linear(uint32_t grid, uint32_t block, const Stream* stream) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  config.stream = stream;
  return config;
}

TEST_F(CudaIpcTest, AnotherSessionsStreamWaitsForTheExportersEvent) {
  constexpr uint32_t kWords = 256;
  Session exporter = Open();
  Session importer = Open();
  auto theirs = testing::CompileFakeKernels(exporter);
  auto ours = testing::CompileFakeKernels(importer);
  ASSERT_THAT(theirs, IsOk());
  ASSERT_THAT(ours, IsOk());
  auto spin = theirs->GetFunction("spin_us");
  auto fill = theirs->GetFunction("fill_u32");
  auto copy = ours->GetFunction("copy_bytes");
  ASSERT_THAT(spin, IsOk());
  ASSERT_THAT(fill, IsOk());
  ASSERT_THAT(copy, IsOk());
  auto shared = exporter.Allocate(kWords * 4);
  ASSERT_THAT(shared, IsOk());
  ASSERT_THAT(exporter.Memset(shared->at(), 0, 1, kWords * 4), IsOk());
  ASSERT_THAT(exporter.Synchronize(), IsOk());
  auto memory = exporter.ExportMemory(*shared);
  auto done = exporter.CreateInterprocessEvent();
  ASSERT_THAT(memory, IsOk());
  ASSERT_THAT(done, IsOk());
  auto handle = exporter.ExportEvent(*done);
  ASSERT_THAT(handle, IsOk());
  EXPECT_EQ(handle->size(), 32u);
  EXPECT_THAT(exporter.ExportEvent(*done), IsOkAndHolds(*handle));  // same handle again
  EXPECT_NE(*handle, *memory);
  auto opened_memory = importer.OpenMemoryHandle(*memory);
  auto opened = importer.OpenEventHandle(*handle);
  ASSERT_THAT(opened_memory, IsOk());
  ASSERT_THAT(opened, IsOk());

  // The exporter's stream: a long spin, then the words are filled, then the event.
  auto stream = exporter.CreateStream();
  ASSERT_THAT(stream, IsOk());
  ASSERT_THAT(spin->LaunchAsync(Linear(1, 1, &*stream), uint64_t{500'000}), IsOk());
  ASSERT_THAT(fill->LaunchAsync(Linear(1, kWords, &*stream), *shared, 0xC0FFEEu, uint64_t{kWords}),
              IsOk());
  ASSERT_THAT(done->Record(&*stream), IsOk());
  // Query waits for the queued commands: the record has reached the driver, and the spin
  // still runs.
  EXPECT_THAT(done->Query(), IsOkAndHolds(false));

  // The importer's stream waits on the opened event, then copies the shared words out.
  auto copied = importer.Allocate(kWords * 4);
  auto waiting = importer.CreateStream();
  ASSERT_THAT(copied, IsOk());
  ASSERT_THAT(waiting, IsOk());
  ASSERT_THAT(waiting->WaitEvent(*opened), IsOk());
  ASSERT_THAT(copy->LaunchAsync(Linear(4, kWords, &*waiting), *copied, *opened_memory,
                                uint64_t{kWords * 4}),
              IsOk());
  ASSERT_THAT(waiting->Synchronize(), IsOk());
  auto words = copied->Download();
  ASSERT_THAT(words, IsOk());
  std::vector<uint8_t> expected;
  for (uint32_t i = 0; i < kWords; ++i) {
    for (int b = 0; b < 4; ++b) expected.push_back(static_cast<uint8_t>(0xC0FFEEu >> (8 * b)));
  }
  EXPECT_EQ(*words, expected) << "the copy ran before the exporter's fill";
  EXPECT_THAT(opened->Query(), IsOkAndHolds(true));
  EXPECT_THAT(opened->Synchronize(), IsOk());
  // Interprocess events have no timing, opened ones neither.
  auto start = importer.CreateEvent();
  ASSERT_THAT(start, IsOk());
  ASSERT_THAT(start->Record(&*waiting), IsOk());
  ASSERT_THAT(opened->Record(&*waiting), IsOk());
  ASSERT_THAT(waiting->Synchronize(), IsOk());
  EXPECT_THAT(start->ElapsedSince(*start), IsOk());
  EXPECT_THAT(opened->ElapsedSince(*start).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  // Once per session; not in the exporting session; an opened event is not exported again;
  // handles of one kind do not open as the other.
  EXPECT_THAT(importer.OpenEventHandle(*handle).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already")));
  EXPECT_THAT(exporter.OpenEventHandle(*handle).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own event")));
  EXPECT_THAT(importer.ExportEvent(*opened).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("export the original")));
  Session third = Open();
  EXPECT_THAT(third.OpenEventHandle(*memory).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(third.OpenMemoryHandle(*handle).status(), StatusIs(absl::StatusCode::kNotFound));
  // Closing it (assigning over the handle destroys the event) lets the session open it again.
  *opened = Event();
  auto again = importer.OpenEventHandle(*handle);
  ASSERT_THAT(again, IsOk());
  EXPECT_THAT(again->Synchronize(), IsOk());
}

TEST_F(CudaIpcTest, TheExportersEventOutlivesItsDestroyUntilItsSessionEnds) {
  Session exporter = Open();
  Session importer = Open();
  auto event = exporter.CreateInterprocessEvent();
  ASSERT_THAT(event, IsOk());
  auto handle = exporter.ExportEvent(*event);
  ASSERT_THAT(handle, IsOk());
  auto opened = importer.OpenEventHandle(*handle);
  ASSERT_THAT(opened, IsOk());
  *event = Event();  // destroys it
  // No new opens...
  Session late = Open();
  EXPECT_THAT(late.OpenEventHandle(*handle).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
  // ...but the opened one still works on both ends of its use.
  auto stream = importer.CreateStream();
  ASSERT_THAT(stream, IsOk());
  EXPECT_THAT(opened->Record(&*stream), IsOk());
  EXPECT_THAT(stream->WaitEvent(*opened), IsOk());
  EXPECT_THAT(stream->Synchronize(), IsOk());
  EXPECT_THAT(opened->Synchronize(), IsOk());
  // When the exporter ends, the opened event is closed for the importer: its id answers
  // NOT_FOUND, and the session goes on.
  ASSERT_THAT(exporter.Close(), IsOk());
  EXPECT_TRUE(testing::Eventually(
      [&] { return opened->Query().status().code() == absl::StatusCode::kNotFound; },
      absl::Seconds(30)));
  EXPECT_THAT(importer.Synchronize(), IsOk());
  EXPECT_THAT(importer.CreateEvent().status(), IsOk());
}

TEST_F(CudaIpcTest, AnExportedEventCountsAgainstTheEventQuotaUntilItsSessionEnds) {
  TestDaemon::Options options;
  options.backend = kBackend;
  options.extra_flags = {"--tenant-max-events-per-session=3"};
  auto daemon = TestDaemon::Start(options);
  ASSERT_THAT(daemon, IsOk());
  auto client = Client::Connect((*daemon)->address());
  ASSERT_THAT(client, IsOk());
  auto session = client->OpenSession(0, "ipc quota");
  ASSERT_THAT(session, IsOk());
  {
    auto exported = session->CreateInterprocessEvent();
    auto plain = session->CreateEvent();
    ASSERT_THAT(exported, IsOk());
    ASSERT_THAT(plain, IsOk());
    ASSERT_THAT(session->ExportEvent(*exported), IsOk());
  }  // both destroyed: the plain one's slot comes back, the exported one's does not
  auto second = session->CreateEvent();
  auto third = session->CreateEvent();
  ASSERT_THAT(second, IsOk());
  ASSERT_THAT(third, IsOk());
  EXPECT_THAT(session->CreateEvent().status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("1 of them exported and destroyed")));
  // Opened events count too.
  *third = Event();
  auto other = client->OpenSession(0, "ipc quota exporter");
  ASSERT_THAT(other, IsOk());
  auto theirs = other->CreateInterprocessEvent();
  ASSERT_THAT(theirs, IsOk());
  auto handle = other->ExportEvent(*theirs);
  ASSERT_THAT(handle, IsOk());
  auto opened = session->OpenEventHandle(*handle);
  ASSERT_THAT(opened, IsOk());
  EXPECT_THAT(session->OpenEventHandle(*handle).status(),
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(session->CreateEvent().status(), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST_F(CudaIpcTest, AnEventClosedOnTheDirectChannelCanBeOpenedAgain) {
  Session exporter = Open();
  Session importer = Open();
  ASSERT_THAT(importer.UseDirectChannel(), IsOk());
  ASSERT_TRUE(importer.direct());
  auto event = exporter.CreateInterprocessEvent();
  ASSERT_THAT(event, IsOk());
  auto handle = exporter.ExportEvent(*event);
  ASSERT_THAT(handle, IsOk());
  for (int round = 0; round < 3; ++round) {
    auto opened = importer.OpenEventHandle(*handle);
    ASSERT_THAT(opened, IsOk()) << "round " << round;
    auto stream = importer.CreateStream();  // on the direct channel
    ASSERT_THAT(stream, IsOk());
    ASSERT_THAT(stream->WaitEvent(*opened), IsOk());
    ASSERT_THAT(stream->Synchronize(), IsOk());
    // The handle's destructor sends DestroyEvent through the front end, which then forgets
    // the import: the next round opens the handle again.
  }
}

TEST_F(CudaIpcTest, AnotherTenantCannotOpenAnEventHandle) {
  Session exporter = Open();
  auto event = exporter.CreateInterprocessEvent();
  ASSERT_THAT(event, IsOk());
  auto handle = exporter.ExportEvent(*event);
  ASSERT_THAT(handle, IsOk());
  Session theirs = OpenAsMallory();
  EXPECT_THAT(theirs.OpenEventHandle(*handle).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export")));
  Session importer = Open();
  EXPECT_THAT(importer.OpenEventHandle(*handle).status(), IsOk());
}

}  // namespace
}  // namespace gpurpc
