// The front end's record of CUDA IPC exports (SessionService.ExportMemory/OpenMemoryHandle
// and ExportEvent/OpenEventHandle, session_service.proto): which buffer or event of which
// session a handle names, which sessions have it open, and what must happen when either
// side frees or ends. Buffer and event ids share a session's id space (the worker's
// HandleIdGenerator), so one (session, id) key serves both kinds.
//
// The driver's IPC handle never leaves the daemon. A client gets a token: 32 random bytes
// (OpenSSL's RAND_bytes) that name one export in this run of the front end. Only sessions of
// the exporting tenant on the exporting device may open it; every other token answers one
// NOT_FOUND, so a tenant learns nothing about another's exports.
//
// Lifetime rules (CUDA leaves freeing exported memory that another process has open
// undefined, so gpurpc never lets it happen through its API):
// - An export is begun (BeginExport) before the exporter's worker makes the driver's handle;
//   a Free of the buffer or the end of its session meanwhile cancels it, and Add then fails,
//   so no token ever names freed memory.
// - An open is begun (BeginOpen) before the importer's worker maps the memory and counts as
//   an import from then on, so a Free of the exported buffer racing the open is refused.
// - Free of an exported buffer with imports is FAILED_PRECONDITION (BeginFree); while a
//   Free is under way, opens are refused.
// - When the exporting session ends, its imports are handed back (SessionEnded) for the
//   caller to close in their sessions; a pending open then fails at CommitOpen.
// - Events: the exporter's worker keeps an exported event until its session ends, so
//   destroying it is never refused; EventDestroyed only stops new opens of it (and forgets
//   an opened event that its session closed). A token opens only with its own kind's call.
//
// Thread-safe; every method takes the registry's own lock, never another.
#ifndef GPURPC_SERVER_FRONTEND_IPC_REGISTRY_H_
#define GPURPC_SERVER_FRONTEND_IPC_REGISTRY_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gpurpc::frontend {

class IpcRegistry {
 public:
  static constexpr size_t kTokenBytes = 32;

  enum class Kind { kMemory, kEvent };

  struct Export {
    Kind kind = Kind::kMemory;
    std::string tenant;
    uint64_t session_id = 0;
    int device = 0;
    uint64_t object_id = 0;   // the buffer or event
    std::string ipc_handle;   // the driver's
    uint64_t size_bytes = 0;  // memory only
  };
  // A session's buffer or event that was opened from an export.
  struct Import {
    uint64_t session_id = 0;
    uint64_t object_id = 0;  // 0 while the open is pending
    Kind kind = Kind::kMemory;
  };

  // Before asking the worker to export `object_id` of `session_id`: marks the export as
  // under way (several may be).
  void BeginExport(uint64_t session_id, uint64_t object_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The worker could not export it.
  void CancelExport(uint64_t session_id, uint64_t object_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends an export begun with BeginExport: the token of `entry`'s (session, object), the
  // existing one when it was exported before, else a new one. NOT_FOUND when the buffer was
  // freed, the event destroyed, or its session ended, since BeginExport (or BeginExport was
  // not called).
  absl::StatusOr<std::string> Add(Export entry) ABSL_LOCKS_EXCLUDED(mu_);

  // Begins opening `token`, a `kind` export, in session `session_id` of `tenant` on
  // `device`: the export, now counted as open there (pending). NOT_FOUND for a token this
  // tenant cannot open (also one of the other kind); INVALID_ARGUMENT for a token of the
  // wrong size, the session's own export or another device; ALREADY_EXISTS when the session
  // has it open or is opening it.
  absl::StatusOr<Export> BeginOpen(Kind kind, const std::string& token, const std::string& tenant,
                                   uint64_t session_id, int device) ABSL_LOCKS_EXCLUDED(mu_);
  // The open of a `kind` export succeeded as buffer or event `object_id`: OK, or NOT_FOUND
  // when the export ended meanwhile (the caller then closes it).
  absl::Status CommitOpen(const std::string& token, uint64_t session_id, uint64_t object_id,
                          Kind kind) ABSL_LOCKS_EXCLUDED(mu_);
  // The open failed.
  void CancelOpen(const std::string& token, uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Before a Free of `buffer_id` in `session_id`: FAILED_PRECONDITION naming the sessions
  // that have it open; otherwise OK, and until Freed or CancelFree no session can begin
  // opening it (BeginOpen answers NOT_FOUND), so no open races the free.
  absl::Status BeginFree(uint64_t session_id, uint64_t buffer_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The Free failed: the export stands again.
  void CancelFree(uint64_t session_id, uint64_t buffer_id) ABSL_LOCKS_EXCLUDED(mu_);
  // After a Free: the buffer's export ends, and so do the import it was and any export of
  // it under way.
  void Freed(uint64_t session_id, uint64_t buffer_id) ABSL_LOCKS_EXCLUDED(mu_);
  // After a DestroyEvent relayed by the front end: an export of the event opens no more
  // (its imports stay, to be closed when the exporting session ends, since its worker keeps
  // the event until then), an export under way is cancelled, and the import it was ends.
  void EventDestroyed(uint64_t session_id, uint64_t event_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A session ended: its exports, exports under way and imports are forgotten. Returns the
  // imports of its exports that other sessions still hold, for the caller to close there.
  std::vector<Import> SessionEnded(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  size_t exports() const ABSL_LOCKS_EXCLUDED(mu_);
  // Opened imports and exports under way, for tests.
  size_t imports() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t exports_under_way() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    Export exported;
    std::vector<Import> imports;
    bool freeing = false;  // a Free is under way, or the event was destroyed
  };
  using ObjectKey = std::pair<uint64_t, uint64_t>;  // (session, buffer or event)
  // Drops the export named by `token`, its (session, object) entry and its imports' entries.
  void EraseLocked(const std::string& token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the import `key` of the export named by `token`; object 0: every import of the
  // session there, opened or pending.
  void EraseImportLocked(const std::string& token, ObjectKey key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> by_token_ ABSL_GUARDED_BY(mu_);
  // Ordered by session, so that a session's entries are one range (SessionEnded does not
  // walk other sessions' exports, nor a Free other buffers').
  // Exports: (session, object) -> token.
  absl::btree_map<ObjectKey, std::string> by_object_ ABSL_GUARDED_BY(mu_);
  // Opened imports: (importing session, its buffer or event) -> the export's token.
  absl::btree_map<ObjectKey, std::string> by_import_ ABSL_GUARDED_BY(mu_);
  // Opens under way: (opening session, the export's token).
  absl::btree_set<std::pair<uint64_t, std::string>> opening_ ABSL_GUARDED_BY(mu_);
  // Exports under way: (session, object) -> how many.
  absl::btree_map<ObjectKey, int> exporting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_IPC_REGISTRY_H_
