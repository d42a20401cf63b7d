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

constexpr IpcRegistry::Kind kMemory = IpcRegistry::Kind::kMemory;
constexpr IpcRegistry::Kind kEvent = IpcRegistry::Kind::kEvent;

IpcRegistry::Export Exported(const std::string& tenant, uint64_t session, uint64_t buffer,
                             int device = 0, IpcRegistry::Kind kind = kMemory) {
  IpcRegistry::Export entry;
  entry.kind = kind;
  entry.tenant = tenant;
  entry.session_id = session;
  entry.device = device;
  entry.object_id = buffer;
  entry.ipc_handle = std::string(64, 'h');
  entry.size_bytes = 4096;
  return entry;
}

// An export as the front end makes one: begun, then added once the worker answered.
std::string Export(IpcRegistry& registry, const std::string& tenant, uint64_t session,
                   uint64_t buffer, int device = 0, IpcRegistry::Kind kind = kMemory) {
  registry.BeginExport(session, buffer);
  absl::StatusOr<std::string> token = registry.Add(Exported(tenant, session, buffer, device, kind));
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
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "bob", 2, 0).status(), not_found);
  std::string guess = token;
  guess[0] ^= 1;
  EXPECT_THAT(registry.BeginOpen(kMemory, guess, "alice", 2, 0).status(), not_found);
  EXPECT_THAT(registry.BeginOpen(kMemory, "short", "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 bytes")));
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 1, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own buffer 10")));
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 2, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device 0")));
  auto opened = registry.BeginOpen(kMemory, token, "alice", 2, 0);
  ASSERT_THAT(opened, IsOk());
  EXPECT_EQ(opened->object_id, 10u);
  EXPECT_EQ(opened->ipc_handle, std::string(64, 'h'));
  // Once per session, pending or open.
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("opening")));
  ASSERT_THAT(registry.CommitOpen(token, 2, 77, kMemory), IsOk());
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("buffer 77")));
  // A third session may open it too.
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0), IsOk());
  registry.CancelOpen(token, 3);
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0), IsOk());
}

TEST(IpcRegistryTest, AnExportedBufferCannotBeFreedWhileOpenOrBeingOpened) {
  IpcRegistry registry;
  const std::string token = Export(registry, "alice", 1, 10);
  ASSERT_THAT(registry.BeginOpen(kMemory, token, "alice", 2, 0), IsOk());
  // Pending counts: a free racing the open is refused.
  EXPECT_THAT(registry.BeginFree(1, 10),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("session(s) 2")));
  ASSERT_THAT(registry.CommitOpen(token, 2, 77, kMemory), IsOk());
  EXPECT_THAT(registry.BeginFree(1, 10), StatusIs(absl::StatusCode::kFailedPrecondition));
  // Other buffers of the session free as usual.
  EXPECT_THAT(registry.BeginFree(1, 11), IsOk());
  // The importer closes: now the exporter may free, and while it does nobody may open.
  registry.Freed(2, 77);
  ASSERT_THAT(registry.BeginFree(1, 10), IsOk());
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  // A free that failed leaves the export standing.
  registry.CancelFree(1, 10);
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0), IsOk());
  registry.CancelOpen(token, 3);
  // A free that succeeded ends it.
  ASSERT_THAT(registry.BeginFree(1, 10), IsOk());
  registry.Freed(1, 10);
  EXPECT_EQ(registry.exports(), 0u);
  EXPECT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  // A new export of a buffer with the same id is a new token.
  EXPECT_NE(Export(registry, "alice", 1, 10), token);
}

TEST(IpcRegistryTest, TheExportersEndClosesItsImportsAndFailsPendingOpens) {
  IpcRegistry registry;
  const std::string a = Export(registry, "alice", 1, 10);
  const std::string b = Export(registry, "alice", 1, 11);
  const std::string other = Export(registry, "alice", 5, 50);
  ASSERT_THAT(registry.BeginOpen(kMemory, a, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(a, 2, 77, kMemory), IsOk());
  ASSERT_THAT(registry.BeginOpen(kMemory, b, "alice", 3, 0), IsOk());  // pending
  ASSERT_THAT(registry.BeginOpen(kMemory, other, "alice", 1, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(other, 1, 99, kMemory), IsOk());
  // Session 1 ends: the open import of its export comes back to be closed; the pending one
  // fails when it commits; session 1's own import of session 5's export is forgotten.
  EXPECT_THAT(registry.SessionEnded(1), ElementsAre(FieldsAre(2u, 77u, kMemory)));
  EXPECT_THAT(registry.CommitOpen(b, 3, 88, kMemory), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(registry.exports(), 1u);
  EXPECT_THAT(registry.BeginFree(5, 50), IsOk());
  // An importer's end forgets its imports only.
  registry.CancelFree(5, 50);
  ASSERT_THAT(registry.BeginOpen(kMemory, other, "alice", 4, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(other, 4, 66, kMemory), IsOk());
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
  ASSERT_THAT(registry.BeginOpen(kMemory, token, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(token, 2, 20, kMemory), IsOk());
  ASSERT_THAT(registry.BeginOpen(kMemory, token, "alice", 3, 0), IsOk());
  EXPECT_EQ(registry.imports(), 1u);
  EXPECT_TRUE(registry.SessionEnded(3).empty());
  EXPECT_THAT(registry.CommitOpen(token, 3, 30, kMemory), StatusIs(absl::StatusCode::kNotFound));
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
  ASSERT_THAT(registry.BeginOpen(kMemory, token, "alice", 4, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(token, 4, 40, kMemory), IsOk());
  EXPECT_TRUE(registry.SessionEnded(4).empty());
  EXPECT_EQ(registry.imports(), 0u);
  EXPECT_THAT(registry.BeginFree(1, 10), IsOk());
  registry.Freed(1, 10);
  EXPECT_EQ(registry.exports(), 0u);
}

TEST(IpcRegistryTest, ATokenOpensOnlyAsItsOwnKind) {
  IpcRegistry registry;
  const std::string memory = Export(registry, "alice", 1, 10);
  const std::string event = Export(registry, "alice", 1, 11, 0, kEvent);
  EXPECT_THAT(registry.BeginOpen(kEvent, memory, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("OpenEventHandle")));
  EXPECT_THAT(registry.BeginOpen(kMemory, event, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("OpenMemoryHandle")));
  // The wrong kind's refusal is the unknown token's, word for word.
  EXPECT_EQ(registry.BeginOpen(kEvent, memory, "alice", 2, 0).status(),
            registry.BeginOpen(kEvent, std::string(32, 'x'), "alice", 2, 0).status());
  EXPECT_THAT(registry.BeginOpen(kEvent, event, "bob", 2, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.BeginOpen(kEvent, event, "alice", 1, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own event 11")));
  ASSERT_THAT(registry.BeginOpen(kEvent, event, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(event, 2, 20, kEvent), IsOk());
  EXPECT_THAT(registry.BeginOpen(kEvent, event, "alice", 2, 0).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("as event 20")));
  // A Free naming the event's id is the worker's to refuse: the registry neither blocks it
  // nor, when it is "cancelled", lets a destroyed event's export open again.
  EXPECT_THAT(registry.BeginFree(1, 11), IsOk());
  registry.EventDestroyed(1, 11);
  registry.CancelFree(1, 11);
  EXPECT_THAT(registry.BeginOpen(kEvent, event, "alice", 3, 0).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("event was destroyed")));
}

TEST(IpcRegistryTest, ADestroyedEventOpensNoMoreButItsImportsAreClosedAtTheExportersEnd) {
  IpcRegistry registry;
  const std::string event = Export(registry, "alice", 1, 11, 0, kEvent);
  ASSERT_THAT(registry.BeginOpen(kEvent, event, "alice", 2, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(event, 2, 20, kEvent), IsOk());
  ASSERT_THAT(registry.BeginOpen(kEvent, event, "alice", 3, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(event, 3, 30, kEvent), IsOk());
  // Session 3 closes its event: it may open the handle again while it is exported.
  registry.EventDestroyed(3, 30);
  EXPECT_EQ(registry.imports(), 1u);
  ASSERT_THAT(registry.BeginOpen(kEvent, event, "alice", 3, 0), IsOk());
  ASSERT_THAT(registry.CommitOpen(event, 3, 31, kEvent), IsOk());
  // The exporter destroys it: no new opens, and an export under way of it ends too.
  registry.BeginExport(1, 11);
  registry.EventDestroyed(1, 11);
  EXPECT_THAT(registry.Add(Exported("alice", 1, 11, 0, kEvent)).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("event 11 was destroyed")));
  EXPECT_THAT(registry.BeginOpen(kEvent, event, "alice", 4, 0).status(),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(registry.exports(), 1u);
  // Its session ends: the events opened from it come back to be closed, as events.
  EXPECT_THAT(registry.SessionEnded(1),
              ElementsAre(FieldsAre(2u, 20u, kEvent), FieldsAre(3u, 31u, kEvent)));
  EXPECT_EQ(registry.exports(), 0u);
  EXPECT_EQ(registry.imports(), 0u);
}

TEST(IpcRegistryTest, AnOpenThatLosesTheRaceWithTheExportersEndNamesItsOwnCall) {
  IpcRegistry registry;
  const std::string event = Export(registry, "alice", 1, 12, 0, kEvent);
  ASSERT_THAT(registry.BeginOpen(kEvent, event, "alice", 5, 0), IsOk());
  EXPECT_TRUE(registry.SessionEnded(1).empty());  // nothing opened yet
  EXPECT_THAT(registry.CommitOpen(event, 5, 50, kEvent),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("OpenEventHandle")));
}

}  // namespace
}  // namespace gpurpc::frontend
