#include "server/frontend/ipc_registry.h"

#include <openssl/rand.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace gpurpc::frontend {
namespace {

const char* OpenCall(IpcRegistry::Kind kind) {
  return kind == IpcRegistry::Kind::kEvent ? "OpenEventHandle" : "OpenMemoryHandle";
}

absl::Status NotOpenable(IpcRegistry::Kind kind) {
  return absl::NotFoundError(absl::StrFormat(
      "%s: no export this tenant can open as %s has this handle (unknown, another tenant's, "
      "of the other kind, or ended: its %s, or its session ended)",
      OpenCall(kind), kind == IpcRegistry::Kind::kEvent ? "an event" : "memory",
      kind == IpcRegistry::Kind::kEvent ? "event was destroyed" : "buffer was freed"));
}

}  // namespace

void IpcRegistry::BeginExport(uint64_t session_id, uint64_t object_id) {
  absl::MutexLock lock(&mu_);
  ++exporting_[{session_id, object_id}];
}

void IpcRegistry::CancelExport(uint64_t session_id, uint64_t object_id) {
  absl::MutexLock lock(&mu_);
  auto it = exporting_.find({session_id, object_id});
  if (it != exporting_.end() && --it->second == 0) exporting_.erase(it);
}

absl::StatusOr<std::string> IpcRegistry::Add(Export entry) {
  absl::MutexLock lock(&mu_);
  const ObjectKey key{entry.session_id, entry.object_id};
  auto under_way = exporting_.find(key);
  if (under_way == exporting_.end()) {
    return entry.kind == Kind::kEvent
               ? absl::NotFoundError(absl::StrFormat(
                     "ExportEvent: event %d was destroyed, or its session ended, while it "
                     "was exported",
                     entry.object_id))
               : absl::NotFoundError(absl::StrFormat(
                     "ExportMemory: buffer %d was freed, or its session ended, while it was "
                     "exported",
                     entry.object_id));
  }
  if (--under_way->second == 0) exporting_.erase(under_way);
  if (auto it = by_object_.find(key); it != by_object_.end()) return it->second;
  std::string token(kTokenBytes, '\0');
  do {
    // RAND_bytes fails only when the generator cannot be seeded: then no token at all is
    // better than a guessable one.
    if (RAND_bytes(reinterpret_cast<unsigned char*>(token.data()), kTokenBytes) != 1) {
      std::abort();
    }
  } while (by_token_.contains(token));
  by_object_[key] = token;
  by_token_[token] = Entry{std::move(entry), {}};
  return token;
}

absl::StatusOr<IpcRegistry::Export> IpcRegistry::BeginOpen(Kind kind, const std::string& token,
                                                           const std::string& tenant,
                                                           uint64_t session_id, int device) {
  const char* call = OpenCall(kind);
  const char* object = kind == Kind::kEvent ? "event" : "buffer";
  if (token.size() != kTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a handle is %d bytes (from %s), got %d", call, kTokenBytes,
                        kind == Kind::kEvent ? "ExportEvent" : "ExportMemory", token.size()));
  }
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (it == by_token_.end() || it->second.exported.tenant != tenant ||
      it->second.exported.kind != kind || it->second.freeing) {
    return NotOpenable(kind);
  }
  Entry& entry = it->second;
  if (entry.exported.session_id == session_id) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: the handle is this session's own %s %d; use it directly", call, object,
                        entry.exported.object_id));
  }
  if (entry.exported.device != device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the %s is on device %d and this session on device %d; open it from a session on "
        "device %d",
        call, kind == Kind::kEvent ? "event" : "memory", entry.exported.device, device,
        entry.exported.device));
  }
  for (const Import& import : entry.imports) {
    if (import.session_id != session_id) continue;
    return absl::AlreadyExistsError(
        import.object_id == 0
            ? absl::StrFormat("%s: this session is opening the handle already", call)
            : absl::StrFormat("%s: this session has the handle open already as %s %d", call, object,
                              import.object_id));
  }
  entry.imports.push_back(Import{session_id, 0, kind});
  opening_.insert({session_id, token});
  return entry.exported;
}

absl::Status IpcRegistry::CommitOpen(const std::string& token, uint64_t session_id,
                                     uint64_t object_id, Kind kind) {
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (opening_.erase({session_id, token}) == 0) return NotOpenable(kind);
  if (it != by_token_.end()) {
    for (Import& import : it->second.imports) {
      if (import.session_id == session_id && import.object_id == 0) {
        import.object_id = object_id;
        by_import_[{session_id, object_id}] = token;
        return absl::OkStatus();
      }
    }
  }
  return NotOpenable(kind);
}

void IpcRegistry::CancelOpen(const std::string& token, uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  opening_.erase({session_id, token});
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  auto& imports = it->second.imports;
  imports.erase(std::remove_if(imports.begin(), imports.end(),
                               [&](const Import& import) {
                                 return import.session_id == session_id && import.object_id == 0;
                               }),
                imports.end());
}

absl::Status IpcRegistry::BeginFree(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_object_.find({session_id, buffer_id});
  if (it == by_object_.end()) return absl::OkStatus();
  Entry& entry = by_token_.at(it->second);
  if (entry.exported.kind != Kind::kMemory) return absl::OkStatus();  // the worker refuses
  if (entry.imports.empty()) {
    entry.freeing = true;
    return absl::OkStatus();
  }
  std::vector<uint64_t> sessions;
  for (const Import& import : entry.imports) sessions.push_back(import.session_id);
  return absl::FailedPreconditionError(absl::StrFormat(
      "Free: buffer %d is exported and open in session(s) %s; free it there first (CUDA "
      "leaves freeing memory another process has open undefined)",
      buffer_id, absl::StrJoin(sessions, ", ")));
}

void IpcRegistry::CancelFree(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_object_.find({session_id, buffer_id});
  if (it == by_object_.end()) return;
  Entry& entry = by_token_.at(it->second);
  if (entry.exported.kind == Kind::kMemory) entry.freeing = false;
}

void IpcRegistry::EraseLocked(const std::string& token) {
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  for (const Import& import : it->second.imports) {
    if (import.object_id != 0) by_import_.erase({import.session_id, import.object_id});
  }
  by_object_.erase({it->second.exported.session_id, it->second.exported.object_id});
  by_token_.erase(it);
}

void IpcRegistry::EraseImportLocked(const std::string& token, ObjectKey key) {
  by_import_.erase(key);
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  auto& imports = it->second.imports;
  imports.erase(std::remove_if(imports.begin(), imports.end(),
                               [&](const Import& import) {
                                 return import.session_id == key.first &&
                                        (key.second == 0 || import.object_id == key.second);
                               }),
                imports.end());
}

void IpcRegistry::Freed(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  const ObjectKey key{session_id, buffer_id};
  exporting_.erase(key);
  if (auto it = by_object_.find(key); it != by_object_.end()) {
    EraseLocked(std::string(it->second));
  }
  if (auto it = by_import_.find(key); it != by_import_.end()) {
    EraseImportLocked(std::string(it->second), key);
  }
}

void IpcRegistry::EventDestroyed(uint64_t session_id, uint64_t event_id) {
  absl::MutexLock lock(&mu_);
  const ObjectKey key{session_id, event_id};
  exporting_.erase(key);
  if (auto it = by_object_.find(key); it != by_object_.end()) {
    Entry& entry = by_token_.at(it->second);
    if (entry.exported.kind == Kind::kEvent) entry.freeing = true;
  }
  if (auto it = by_import_.find(key); it != by_import_.end()) {
    EraseImportLocked(std::string(it->second), key);
  }
}

std::vector<IpcRegistry::Import> IpcRegistry::SessionEnded(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  const ObjectKey first{session_id, 0};
  const ObjectKey last{session_id, UINT64_MAX};
  exporting_.erase(exporting_.lower_bound(first), exporting_.upper_bound(last));
  // Its exports: the imports other sessions opened come back to be closed; pending opens
  // fail at CommitOpen.
  std::vector<Import> orphans;
  std::vector<std::string> ended;
  for (auto it = by_object_.lower_bound(first); it != by_object_.upper_bound(last); ++it) {
    for (const Import& import : by_token_.at(it->second).imports) {
      if (import.object_id != 0) orphans.push_back(import);
    }
    ended.push_back(it->second);
  }
  for (const std::string& token : ended) EraseLocked(token);
  // Its imports, opened or pending: forgotten (its worker's mappings end with it).
  std::vector<std::pair<std::string, ObjectKey>> imported;
  for (auto it = by_import_.lower_bound(first); it != by_import_.upper_bound(last); ++it) {
    imported.emplace_back(it->second, it->first);
  }
  for (auto it = opening_.lower_bound({session_id, std::string()});
       it != opening_.end() && it->first == session_id;) {
    imported.emplace_back(it->second, ObjectKey{session_id, 0});
    it = opening_.erase(it);
  }
  // A pending open of this session then fails at CommitOpen (its mapping ends with its
  // worker).
  for (const auto& [token, key] : imported) EraseImportLocked(token, key);
  return orphans;
}

size_t IpcRegistry::exports() const {
  absl::MutexLock lock(&mu_);
  return by_token_.size();
}

size_t IpcRegistry::imports() const {
  absl::MutexLock lock(&mu_);
  return by_import_.size();
}

size_t IpcRegistry::exports_under_way() const {
  absl::MutexLock lock(&mu_);
  return exporting_.size();
}

}  // namespace gpurpc::frontend
