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

std::string IpcRegistry::Add(Export entry) {
  absl::MutexLock lock(&mu_);
  const std::pair<uint64_t, uint64_t> key{entry.session_id, entry.buffer_id};
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
  return entry.exported;
}

absl::Status IpcRegistry::CommitOpen(const std::string& token, uint64_t session_id,
                                     uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (it != by_token_.end()) {
    for (Import& import : it->second.imports) {
      if (import.session_id == session_id && import.buffer_id == 0) {
        import.buffer_id = buffer_id;
        return absl::OkStatus();
      }
    }
  }
  return NotOpenable();
}

void IpcRegistry::CancelOpen(const std::string& token, uint64_t session_id) {
  absl::MutexLock lock(&mu_);
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
  by_buffer_.erase({it->second.exported.session_id, it->second.exported.buffer_id});
  by_token_.erase(it);
}

void IpcRegistry::Freed(uint64_t session_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  if (auto it = by_buffer_.find({session_id, buffer_id}); it != by_buffer_.end()) {
    EraseLocked(std::string(it->second));
  }
  for (auto& [token, entry] : by_token_) {
    auto& imports = entry.imports;
    imports.erase(std::remove_if(imports.begin(), imports.end(),
                                 [&](const Import& import) {
                                   return import.session_id == session_id &&
                                          import.buffer_id == buffer_id;
                                 }),
                  imports.end());
  }
}

std::vector<IpcRegistry::Import> IpcRegistry::SessionEnded(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  std::vector<Import> orphans;
  std::vector<std::string> ended;
  for (auto& [token, entry] : by_token_) {
    if (entry.exported.session_id == session_id) {
      for (const Import& import : entry.imports) {
        if (import.buffer_id != 0) orphans.push_back(import);
      }
      ended.push_back(token);
      continue;
    }
    auto& imports = entry.imports;
    imports.erase(
        std::remove_if(imports.begin(), imports.end(),
                       [&](const Import& import) { return import.session_id == session_id; }),
        imports.end());
  }
  for (const std::string& token : ended) EraseLocked(token);
  return orphans;
}

size_t IpcRegistry::exports() const {
  absl::MutexLock lock(&mu_);
  return by_token_.size();
}

}  // namespace gpurpc::frontend
