// The front end's CUDA IPC record (server/frontend/ipc_registry.h): who may open a handle,
// and the lifetime rules that keep exported memory from being freed under an importer.
#include "server/frontend/ipc_registry.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::frontend {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::FieldsAre;
using ::testing::HasSubstr;

IpcRegistry::Export Exported(const std::string& tenant, uint64_t session, uint64_t buffer,
                             int device = 0) {
  IpcRegistry::Export entry;
  entry.tenant = tenant;
  entry.session_id = session;
  entry.device = device;
  entry.buffer_id = buffer;
  entry.ipc_handle = std::string(64, 'h');
  entry.size_bytes = 4096;
  return entry;
}

TEST(IpcRegistryTest, TokensAreRandomAndOnePerBuffer) {
  IpcRegistry registry;
  const std::string token = registry.Add(Exported("alice", 1, 10));
  EXPECT_EQ(token.size(), IpcRegistry::kTokenBytes);
  // The same buffer again: the same token; another buffer: another.
  EXPECT_EQ(registry.Add(Exported("alice", 1, 10)), token);
  std::set<std::string> tokens = {token};
  for (uint64_t buffer = 11; buffer < 111; ++buffer) {
    tokens.insert(registry.Add(Exported("alice", 1, buffer)));
  }
  EXPECT_EQ(tokens.size(), 101u);
  EXPECT_EQ(registry.exports(), 101u);
  // The driver's handle is not the token.
  EXPECT_EQ(tokens.count(std::string(32, 'h')), 0u);
}

TEST(IpcRegistryTest, OnlyTheSameTenantOnTheSameDeviceInAnotherSessionOpens) {
  IpcRegistry registry;
  const std::string token = registry.Add(Exported("alice", 1, 10));
  // Another tenant, an unknown token and a wrong-sized one learn nothing.
  const auto not_found = StatusIs(absl::StatusCode::kNotFound, HasSubstr("no export"));
  EXPECT_THAT(registry.BeginOpen(token, "bob", 2, 0).status(), not_found);
  std::string guess = token;
  guess[0] ^= 1;
  EXPECT_THAT(registry.BeginOpen(guess, "alice", 2, 0).status(), not_found);
  EXPECT_THAT(registry.BeginOpen("short", "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 bytes")));
  EXPECT_THAT(registry.BeginOpen(token, "alice", 1, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own buffer 10")));
  EXPECT_THAT(registry.BeginOpen(token, "alice", 2, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device 0")));
  auto opened = registry.BeginOpen(token, "alice", 2, 0);
  ASSERT_THAT(opened, IsOk());
  EXPECT_EQ(opened->buffer_id, 10u);
  EXPECT_EQ(opened->ipc_handle, std::string(64, 'h'));
  // Once per session, pending or open.
  EXPECT_THAT(registry.BeginOpen(token, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("opening")));
  ASSERT_THAT(registry.CommitOpen(token, 2, 77), IsOk());
  EXPECT_THAT(registry.BeginOpen(token, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("buffer 77")));
  // A third session may open it too.
  EXPECT_THAT(registry.BeginOpen(token, "alice", 3, 0), IsOk());
  registry.CancelOpen(token, 3);
  EXPECT_THAT(registry.BeginOpen(token, "alice", 3, 0), IsOk());
}

TEST(IpcRegistryTest, AnExportedBufferCannotBeFreedWhileOpenOrBeingOpened) {
  IpcRegistry registry;
  const std::string token = registry.Add(Exported("alice", 1, 10));
  ASSERT_THAT(registry.BeginOpen(token, "alice", 2, 0), IsOk());
  // Pending counts: a free racing the open is refused.
  EXPECT_THAT(registry.BeginFree(1, 10),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("session(s) 2")));
  ASSERT_THAT(registry.CommitOpen(token, 2, 77), IsOk());
  EXPECT_THAT(registry.BeginFree(1, 10), StatusIs(absl::StatusCode::kFailedPrecondition));
  // Other buffers of the session free as usual.
  EXPECT_THAT(registry.BeginFree(1, 11), IsOk());
  // The importer closes: now the exporter may free, and while it does nobody may open.
  registry.Freed(2, 77);
  ASSERT_THAT(registry.BeginFree(1, 10), IsOk());
  EXPECT_THAT(registry.BeginOpen(token, "alice", 3, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  // A free that failed leaves the export standing.
  registry.CancelFree(1, 10);
  EXPECT_THAT(registry.BeginOpen(token, "alice", 3, 0), IsOk());
  registry.CancelOpen(token, 3);
  // A free that succeeded ends it.
  ASSERT_THAT(registry.BeginFree(1, 10), IsOk());
  registry.Freed(1, 10);
  EXPECT_EQ(registry.exports(), 0u);
  EXPECT_THAT(registry.BeginOpen(token, "alice", 3, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  // A new export of a buffer with the same id is a new token.
  EXPECT_NE(registry.Add(Exported("alice", 1, 10)), token);
}

TEST(IpcRegistryTest, TheExportersEndClosesItsImportsAndFailsPendingOpens) {
  IpcRegistry registry;
  const std::string a = registry.Add(Exported("alice", 1, 10));
  const std::string b = registry.Add(Exported("alice", 1, 11));
  const std::string other = registry.Add(Exported("alice", 5, 50));
  ASSERT_THAT(registry.BeginOpen(a, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(a, 2, 77), IsOk());
  ASSERT_THAT(registry.BeginOpen(b, "alice", 3, 0), IsOk());  // pending
  ASSERT_THAT(registry.BeginOpen(other, "alice", 1, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(other, 1, 99), IsOk());
  // Session 1 ends: the open import of its export comes back to be closed; the pending one
  // fails when it commits; session 1's own import of session 5's export is forgotten.
  EXPECT_THAT(registry.SessionEnded(1), ElementsAre(FieldsAre(2u, 77u)));
  EXPECT_THAT(registry.CommitOpen(b, 3, 88), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(registry.exports(), 1u);
  EXPECT_THAT(registry.BeginFree(5, 50), IsOk());
  // An importer's end forgets its imports only.
  registry.CancelFree(5, 50);
  ASSERT_THAT(registry.BeginOpen(other, "alice", 4, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(other, 4, 66), IsOk());
  EXPECT_TRUE(registry.SessionEnded(4).empty());
  EXPECT_THAT(registry.BeginFree(5, 50), IsOk());
}

}  // namespace
}  // namespace gpurpc::frontend
