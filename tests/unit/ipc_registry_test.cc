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

// An export as the front end makes one: begun, then added once the worker answered.
std::string Export(IpcRegistry& registry, const std::string& tenant, uint64_t session,
                   uint64_t buffer, int device = 0) {
  registry.BeginExport(session, buffer);
  absl::StatusOr<std::string> token = registry.Add(Exported(tenant, session, buffer, device));
  EXPECT_THAT(token, IsOk());
  return token.value_or("");
}

TEST(IpcRegistryTest, TokensAreRandomAndOnePerBuffer) {
  IpcRegistry registry;
  const std::string token = Export(registry, "alice", 1, 10);
  EXPECT_EQ(token.size(), IpcRegistry::kTokenBytes);
  // The same buffer again: the same token; another buffer: another.
  EXPECT_EQ(Export(registry, "alice", 1, 10), token);
  std::set<std::string> tokens = {token};
  for (uint64_t buffer = 11; buffer < 111; ++buffer) {
    tokens.insert(Export(registry, "alice", 1, buffer));
  }
  EXPECT_EQ(tokens.size(), 101u);
  EXPECT_EQ(registry.exports(), 101u);
  // The driver's handle is not the token.
  EXPECT_EQ(tokens.count(std::string(32, 'h')), 0u);
}

TEST(IpcRegistryTest, OnlyTheSameTenantOnTheSameDeviceInAnotherSessionOpens) {
  IpcRegistry registry;
  const std::string token = Export(registry, "alice", 1, 10);
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
  const std::string token = Export(registry, "alice", 1, 10);
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
  EXPECT_NE(Export(registry, "alice", 1, 10), token);
}

TEST(IpcRegistryTest, TheExportersEndClosesItsImportsAndFailsPendingOpens) {
  IpcRegistry registry;
  const std::string a = Export(registry, "alice", 1, 10);
  const std::string b = Export(registry, "alice", 1, 11);
  const std::string other = Export(registry, "alice", 5, 50);
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

TEST(IpcRegistryTest, AFreeOrTheSessionsEndDuringAnExportCancelsIt) {
  IpcRegistry registry;
  const auto cancelled = StatusIs(absl::StatusCode::kNotFound, HasSubstr("while it was exported"));
  // Never begun, or cancelled: nothing to add.
  EXPECT_THAT(registry.Add(Exported("alice", 1, 10)).status(), cancelled);
  registry.BeginExport(1, 10);
  registry.CancelExport(1, 10);
  EXPECT_THAT(registry.Add(Exported("alice", 1, 10)).status(), cancelled);
  // The buffer freed while its worker made the handle: the handle names freed memory.
  registry.BeginExport(1, 10);
  ASSERT_THAT(registry.BeginFree(1, 10), IsOk());  // no export yet: nothing stops the Free
  registry.Freed(1, 10);
  EXPECT_THAT(registry.Add(Exported("alice", 1, 10)).status(), cancelled);
  // The session ended meanwhile, with two exports under way and one of another buffer.
  registry.BeginExport(1, 11);
  registry.BeginExport(1, 11);
  registry.BeginExport(1, 12);
  registry.BeginExport(2, 11);
  EXPECT_TRUE(registry.SessionEnded(1).empty());
  EXPECT_THAT(registry.Add(Exported("alice", 1, 11)).status(), cancelled);
  EXPECT_THAT(registry.Add(Exported("alice", 1, 12)).status(), cancelled);
  EXPECT_EQ(registry.exports(), 0u);
  // Another session's export was not touched.
  EXPECT_THAT(registry.Add(Exported("alice", 2, 11)), IsOk());
  EXPECT_EQ(registry.exports(), 1u);
  EXPECT_EQ(registry.exports_under_way(), 0u);
  // Two exports of one buffer under way at once both succeed, with one token.
  registry.BeginExport(3, 30);
  registry.BeginExport(3, 30);
  auto first = registry.Add(Exported("alice", 3, 30));
  auto second = registry.Add(Exported("alice", 3, 30));
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(*first, *second);
  EXPECT_EQ(registry.exports_under_way(), 0u);
}

TEST(IpcRegistryTest, AnImportersEndOrFreeLeavesNothingBehind) {
  IpcRegistry registry;
  const std::string token = Export(registry, "alice", 1, 10);
  // Session 2 opens it; session 3 is still opening it when it ends.
  ASSERT_THAT(registry.BeginOpen(token, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(token, 2, 20), IsOk());
  ASSERT_THAT(registry.BeginOpen(token, "alice", 3, 0), IsOk());
  EXPECT_EQ(registry.imports(), 1u);
  EXPECT_TRUE(registry.SessionEnded(3).empty());
  EXPECT_THAT(registry.CommitOpen(token, 3, 30), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.BeginFree(1, 10),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("session(s) 2")));
  // Session 2 frees another buffer of its own: its import stays; then the imported one.
  registry.Freed(2, 21);
  EXPECT_EQ(registry.imports(), 1u);
  registry.Freed(2, 20);
  EXPECT_EQ(registry.imports(), 0u);
  EXPECT_THAT(registry.BeginFree(1, 10), IsOk());
  registry.CancelFree(1, 10);
  // Opened again and the importer ends: the exporter can free.
  ASSERT_THAT(registry.BeginOpen(token, "alice", 4, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(token, 4, 40), IsOk());
  EXPECT_TRUE(registry.SessionEnded(4).empty());
  EXPECT_EQ(registry.imports(), 0u);
  EXPECT_THAT(registry.BeginFree(1, 10), IsOk());
  registry.Freed(1, 10);
  EXPECT_EQ(registry.exports(), 0u);
}

}  // namespace
}  // namespace gpurpc::frontend
