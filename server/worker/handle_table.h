// HandleTable<T>: one kind of a session's handles (buffers, modules, functions, streams,
// events, regions, graphs, graph execs), by the id the client holds.
//
// The session layer keeps one table per kind and answers an id that is not in the table the
// same way for every kind: NOT_FOUND "[<call>: ]no <noun> <id> in this session". Ids come
// from the session (Session::NewIdLocked), unique over all of its tables.
//
// Thread safety: none of its own. Session guards every table with its mu_ (the tables are
// declared ABSL_GUARDED_BY it), and values are usually shared_ptrs, so that a caller keeps
// an object alive after dropping the lock.
#ifndef GPURPC_SERVER_WORKER_HANDLE_TABLE_H_
#define GPURPC_SERVER_WORKER_HANDLE_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace gpurpc::worker {

template <typename T>
class HandleTable {
 public:
  using Map = std::unordered_map<uint64_t, T>;

  // `noun` names one handle in errors ("stream"); it must outlive the table.
  explicit HandleTable(const char* noun) : noun_(noun) {}

  HandleTable(const HandleTable&) = delete;
  HandleTable& operator=(const HandleTable&) = delete;

  // The value of `id`, or nullptr. Valid until the table changes.
  T* Lookup(uint64_t id) {
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : &it->second;
  }
  const T* Lookup(uint64_t id) const {
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : &it->second;
  }

  // A copy of the value of `id` (for shared_ptr values: a reference that keeps the object
  // alive), or NotFound(id, call).
  absl::StatusOr<T> Find(uint64_t id, absl::string_view call = {}) const {
    const T* value = Lookup(id);
    if (value == nullptr) return NotFound(id, call);
    return *value;
  }

  // Removes `id` and returns its value, or NotFound(id, call, hint) and changes nothing.
  absl::StatusOr<T> Take(uint64_t id, absl::string_view call = {}, absl::string_view hint = {}) {
    auto it = map_.find(id);
    if (it == map_.end()) return NotFound(id, call, hint);
    T value = std::move(it->second);
    map_.erase(it);
    return value;
  }

  // NOT_FOUND "[<call>: ]no <noun> <id> in this session[<hint>]".
  absl::Status NotFound(uint64_t id, absl::string_view call = {},
                        absl::string_view hint = {}) const {
    return absl::NotFoundError(absl::StrCat(call, call.empty() ? "" : ": ", "no ", noun_, " ", id,
                                            " in this session", hint));
  }

  bool contains(uint64_t id) const { return map_.count(id) != 0; }
  size_t size() const { return map_.size(); }
  bool empty() const { return map_.empty(); }

  // Adds a new id (one that NewIdLocked gave; an id already present keeps its value).
  void Insert(uint64_t id, T value) { map_.emplace(id, std::move(value)); }
  // Removes `id` if present.
  void Erase(uint64_t id) { map_.erase(id); }

  // Empties the table and returns what it held (~Session destroys it outside its lock).
  Map TakeAll() {
    Map all;
    all.swap(map_);
    return all;
  }

 private:
  const char* const noun_;
  Map map_;
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_HANDLE_TABLE_H_
