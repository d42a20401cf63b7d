// CUDA IPC between sessions of one tenant (SessionService.ExportMemory / OpenMemoryHandle)
// through the C++ client against a real gpurpcd with real worker processes. Compiled twice:
// label `service` with the fake backend, whose memory cannot leave its worker process (it
// answers UNIMPLEMENTED, and the handle checks that need no export run there), and label
// `gpu` with the CUDA backend (GPURPC_TEST_BACKEND), where two worker processes really share
// memory through cuIpcOpenMemHandle; it skips without a driver. Tenants: the test's own user
// over the Unix socket, and "mallory" with a bearer token over loopback TCP.
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

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
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
  ConnectOptions options;
  options.address = daemon_->tcp_address();
  options.token = mallory_token_;
  options.use_environment = false;
  auto mallory = Client::Connect(options);
  ASSERT_THAT(mallory, IsOk());
  auto theirs = mallory->OpenSession(0, "mallory");
  ASSERT_THAT(theirs, IsOk());
  EXPECT_THAT(theirs->OpenMemoryHandle(*handle).status(),
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

}  // namespace
}  // namespace gpurpc
