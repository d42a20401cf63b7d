// Two-level cache of successful NVRTC compiles, keyed by a SHA-256 of everything that
// determines the output (see Compiler::Compile):
//
//  * memory: an LRU bounded by `memory_max_bytes`, private to this process;
//  * disk (when `dir` is set and `mac_key` holds at least kCacheMacKeyBytes bytes): one file
//    per key at `<dir>/<key hex[0:2]>/<key hex>.bin`, shared by every worker process of the
//    host, and so by every tenant. Files are written (mode 0600, subfolders 0700) to a
//    unique temporary name in the same folder and rename()d into place, so a reader sees
//    either nothing or a whole file. Each file carries a magic, a format version, its key
//    and a trailing HMAC-SHA256, keyed with `mac_key`, of everything before it. The MAC key
//    is a per-daemon secret kept outside the cache folder (LoadOrCreateCacheKey), so whoever
//    can write into the folder but cannot read the key cannot make a file that verifies: a
//    planted, damaged or foreign file (another MAC key, another format, another cache key)
//    is logged (its path and the reason, never its contents), removed and reported as a
//    miss, and the compile simply runs again. A disk hit refreshes the file's mtime, and
//    after every write the folder is trimmed, oldest mtime first, to 90% of
//    `disk_max_bytes` whenever it holds more than `disk_max_bytes`. Other processes may
//    delete or replace files at any time; every step tolerates that.
//
// The folder itself must pass PrepareCacheDirectory (the constructor checks it, creating it
// when missing): a directory, not a symlink, owned by this user, not writable by group or
// others. When it does not, or when `mac_key` is empty or short, the disk layer is off for
// this instance and the constructor logs why, once. The worker runs both checks at startup
// and refuses to start rather than run without them (worker_main.cc).
//
// The cache is best effort: I/O failures are logged and never fail a compile.
//
// Thread safety: all methods may be called concurrently. One mutex guards the memory LRU
// and is never held across disk I/O.
#ifndef GPURPC_SERVER_WORKER_COMPILER_COMPILE_CACHE_H_
#define GPURPC_SERVER_WORKER_COMPILER_COMPILE_CACHE_H_

#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/worker/compiler/sha256.h"

namespace gpurpc::compiler {

// What a successful compile produced; immutable once cached and shared between hits.
struct CacheEntry {
  std::vector<uint8_t> image;
  std::string log;
  std::vector<std::pair<std::string, std::string>> lowered_names;
  std::vector<std::string> effective_options;
  std::string arch;

  // Approximate memory footprint, for the memory bound.
  uint64_t SizeBytes() const;
};

// Length of the MAC key of cache files, and of the key file.
inline constexpr size_t kCacheMacKeyBytes = 32;

struct CompileCacheOptions {
  std::string dir;  // "" disables the disk layer
  uint64_t disk_max_bytes = 1ull << 30;
  uint64_t memory_max_bytes = 64ull << 20;
  // Raw bytes (kCacheMacKeyBytes of them, from LoadOrCreateCacheKey) that key the HMAC of
  // every cache file. A secret: never logged. Empty or shorter: the disk layer is off.
  std::string mac_key;
};

// Makes sure `dir` can hold the shared cache: creates it and its missing parents with mode
// 0700, and returns OK when it then is a directory (not a symbolic link) owned by this
// process's effective user and not writable by group or others. Otherwise
// FAILED_PRECONDITION naming `dir` and the reason (or the failing mkdir's errno). An
// existing directory's mode is never changed.
absl::Status PrepareCacheDirectory(const std::string& dir);

// The MAC key of the cache, kept in the file at `path`:
//  * when `path` exists, its content, provided it is a regular file (not a symbolic link)
//    owned by this process's effective user, neither readable nor writable by group or
//    others, and exactly kCacheMacKeyBytes long; otherwise FAILED_PRECONDITION naming
//    `path` and the reason;
//  * when it does not, kCacheMacKeyBytes from getrandom(), written (mode 0600, O_EXCL,
//    O_NOFOLLOW, fsync'ed) to a temporary file beside it that is then hard-linked to
//    `path`, so that a concurrent reader never sees a short file. Processes racing to
//    create it all end up with the key of the one that linked first. A process killed
//    meanwhile leaves its `<path>.tmp.*` file behind; nothing ever reads it.
// The parent folder must exist. Errors name the path, never the key.
absl::StatusOr<std::string> LoadOrCreateCacheKey(const std::string& path);

// Where the key file is by default: `cache_dir` (trailing slashes dropped) with ".key"
// appended, i.e. beside the cache folder, not inside it. "" for an empty `cache_dir`.
std::string DefaultCacheKeyPath(absl::string_view cache_dir);

class CompileCache {
 public:
  // Checks `options.dir` with PrepareCacheDirectory (creating it when missing) and
  // `options.mac_key`; when either fails, logs why once and keeps the disk layer off.
  // Never fails.
  explicit CompileCache(CompileCacheOptions options);

  CompileCache(const CompileCache&) = delete;
  CompileCache& operator=(const CompileCache&) = delete;

  // The entry for `key`, or null on a miss. A disk hit also fills the memory layer.
  std::shared_ptr<const CacheEntry> Lookup(const Sha256Digest& key) ABSL_LOCKS_EXCLUDED(mu_);

  // Stores `entry` in both layers (disk only when enabled and the file fits the bound).
  void Insert(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Where the disk layer keeps `key` ("" when the disk layer is off).
  std::string PathFor(const Sha256Digest& key) const;

  // Whether the disk layer is on (see the constructor).
  bool disk_enabled() const { return disk_enabled_; }

 private:
  struct DigestHash {
    size_t operator()(const Sha256Digest& digest) const {
      // The digest is already uniformly distributed; any 8 bytes make a good hash.
      size_t hash;
      std::memcpy(&hash, digest.data(), sizeof(hash));
      return hash;
    }
  };
  using LruList = std::list<std::pair<Sha256Digest, std::shared_ptr<const CacheEntry>>>;

  std::shared_ptr<const CacheEntry> LookupMemory(const Sha256Digest& key) ABSL_LOCKS_EXCLUDED(mu_);
  void InsertMemory(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Disk I/O: never with mu_ held.
  std::shared_ptr<const CacheEntry> ReadDisk(const Sha256Digest& key) const
      ABSL_LOCKS_EXCLUDED(mu_);
  void WriteDisk(const Sha256Digest& key, const CacheEntry& entry) const ABSL_LOCKS_EXCLUDED(mu_);
  void EnforceDiskBound() const ABSL_LOCKS_EXCLUDED(mu_);

  const CompileCacheOptions options_;
  bool disk_enabled_ = false;  // set once by the constructor

  // Guards the memory layer: the LRU list, its index and their size.
  absl::Mutex mu_;
  LruList lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<Sha256Digest, LruList::iterator, DigestHash> index_ ABSL_GUARDED_BY(mu_);
  uint64_t memory_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_COMPILE_CACHE_H_
