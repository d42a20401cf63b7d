#include "server/frontend/ipc_registry.h"

#include <openssl/rand.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace gpurpc::frontend {
namespace {

absl::Status NotOpenable() {
  return absl::NotFoundError(
      "OpenMemoryHandle: no export this tenant can open has this handle (unknown, another "
      "tenant's, or its buffer was freed or its session ended)");
}

}  // namespace

void IpcRegistry::BeginExport(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  ++exporting_[{session_id, buffer_id}];
}

void IpcRegistry::CancelExport(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = exporting_.find({session_id, buffer_id});
  if (it != exporting_.end() && --it->second == 0) exporting_.erase(it);
}

absl::StatusOr<std::string> IpcRegistry::Add(Export entry) {
  absl::MutexLock lock(&mu_);
  const BufferKey key{entry.session_id, entry.buffer_id};
  auto under_way = exporting_.find(key);
  if (under_way == exporting_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "ExportMemory: buffer %d was freed, or its session ended, while it was exported",
        entry.buffer_id));
  }
  if (--under_way->second == 0) exporting_.erase(under_way);
  if (auto it = by_buffer_.find(key); it != by_buffer_.end()) return it->second;
  std::string token(kTokenBytes, '\0');
  do {
    // RAND_bytes fails only when the generator cannot be seeded: then no token at all is
    // better than a guessable one.
    if (RAND_bytes(reinterpret_cast<unsigned char*>(token.data()), kTokenBytes) != 1) {
      std::abort();
    }
  } while (by_token_.contains(token));
  by_buffer_[key] = token;
  by_token_[token] = Entry{std::move(entry), {}};
  return token;
}

absl::StatusOr<IpcRegistry::Export> IpcRegistry::BeginOpen(const std::string& token,
                                                           const std::string& tenant,
                                                           uint64_t session_id, int device) {
  if (token.size() != kTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("OpenMemoryHandle: a handle is %d bytes (from ExportMemory), got %d",
                        kTokenBytes, token.size()));
  }
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (it == by_token_.end() || it->second.exported.tenant != tenant || it->second.freeing) {
    return NotOpenable();
  }
  Entry& entry = it->second;
  if (entry.exported.session_id == session_id) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "OpenMemoryHandle: the handle is this session's own buffer %d; use it directly",
        entry.exported.buffer_id));
  }
  if (entry.exported.device != device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "OpenMemoryHandle: the memory is on device %d and this session on device %d; open it "
        "from a session on device %d",
        entry.exported.device, device, entry.exported.device));
  }
  for (const Import& import : entry.imports) {
    if (import.session_id != session_id) continue;
    return absl::AlreadyExistsError(
        import.buffer_id == 0
            ? std::string("OpenMemoryHandle: this session is opening the handle already")
            : absl::StrFormat("OpenMemoryHandle: this session has the handle open already as "
                              "buffer %d",
                              import.buffer_id));
  }
  entry.imports.push_back(Import{session_id, 0});
  opening_.insert({session_id, token});
  return entry.exported;
}

absl::Status IpcRegistry::CommitOpen(const std::string& token, uint64_t session_id,
                                     uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  if (opening_.erase({session_id, token}) == 0) return NotOpenable();
  auto it = by_token_.find(token);
  if (it != by_token_.end()) {
    for (Import& import : it->second.imports) {
      if (import.session_id == session_id && import.buffer_id == 0) {
        import.buffer_id = buffer_id;
        by_import_[{session_id, buffer_id}] = token;
        return absl::OkStatus();
      }
    }
  }
  return NotOpenable();
}

void IpcRegistry::CancelOpen(const std::string& token, uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  opening_.erase({session_id, token});
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  auto& imports = it->second.imports;
  imports.erase(std::remove_if(imports.begin(), imports.end(),
                               [&](const Import& import) {
                                 return import.session_id == session_id && import.buffer_id == 0;
                               }),
                imports.end());
}

absl::Status IpcRegistry::BeginFree(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_buffer_.find({session_id, buffer_id});
  if (it == by_buffer_.end()) return absl::OkStatus();
  Entry& entry = by_token_.at(it->second);
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
  auto it = by_buffer_.find({session_id, buffer_id});
  if (it != by_buffer_.end()) by_token_.at(it->second).freeing = false;
}

void IpcRegistry::EraseLocked(const std::string& token) {
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  for (const Import& import : it->second.imports) {
    if (import.buffer_id != 0) by_import_.erase({import.session_id, import.buffer_id});
  }
  by_buffer_.erase({it->second.exported.session_id, it->second.exported.buffer_id});
  by_token_.erase(it);
}

void IpcRegistry::EraseImportLocked(const std::string& token, BufferKey key) {
  by_import_.erase(key);
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  auto& imports = it->second.imports;
  imports.erase(std::remove_if(imports.begin(), imports.end(),
                               [&](const Import& import) {
                                 return import.session_id == key.first &&
                                        (key.second == 0 || import.buffer_id == key.second);
                               }),
                imports.end());
}

void IpcRegistry::Freed(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  const BufferKey key{session_id, buffer_id};
  exporting_.erase(key);
  if (auto it = by_buffer_.find(key); it != by_buffer_.end()) {
    EraseLocked(std::string(it->second));
  }
  if (auto it = by_import_.find(key); it != by_import_.end()) {
    EraseImportLocked(std::string(it->second), key);
  }
}

std::vector<IpcRegistry::Import> IpcRegistry::SessionEnded(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  const BufferKey first{session_id, 0};
  const BufferKey last{session_id, UINT64_MAX};
  exporting_.erase(exporting_.lower_bound(first), exporting_.upper_bound(last));
  // Its exports: the imports other sessions opened come back to be closed; pending opens
  // fail at CommitOpen.
  std::vector<Import> orphans;
  std::vector<std::string> ended;
  for (auto it = by_buffer_.lower_bound(first); it != by_buffer_.upper_bound(last); ++it) {
    for (const Import& import : by_token_.at(it->second).imports) {
      if (import.buffer_id != 0) orphans.push_back(import);
    }
    ended.push_back(it->second);
  }
  for (const std::string& token : ended) EraseLocked(token);
  // Its imports, opened or pending: forgotten (its worker's mappings end with it).
  std::vector<std::pair<std::string, BufferKey>> imported;
  for (auto it = by_import_.lower_bound(first); it != by_import_.upper_bound(last); ++it) {
    imported.emplace_back(it->second, it->first);
  }
  for (auto it = opening_.lower_bound({session_id, std::string()});
       it != opening_.end() && it->first == session_id;) {
    imported.emplace_back(it->second, BufferKey{session_id, 0});
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
