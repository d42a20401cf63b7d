// Two-level cache of successful NVRTC compiles, keyed by a SHA-256 of everything that
// determines the output (see Compiler::Compile):
//
//  * memory: an LRU bounded by `memory_max_bytes`, private to this process;
//  * disk (when `dir` is set): one file per key at `<dir>/<key hex[0:2]>/<key hex>.bin`,
//    shared by every worker process of the host. Files are written to a unique temporary
//    name in the same folder and rename()d into place, so a reader sees either nothing or
//    a whole file. Each file carries a magic, a format version, its key and a trailing
//    SHA-256 of everything before it; a file that fails any check is logged, removed and
//    reported as a miss. A disk hit refreshes the file's mtime, and after every write the
//    folder is trimmed, oldest mtime first, to 90% of `disk_max_bytes` whenever it holds
//    more than `disk_max_bytes`. Other processes may delete or replace files at any time;
//    every step tolerates that.
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
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

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

struct CompileCacheOptions {
  std::string dir;  // "" disables the disk layer
  uint64_t disk_max_bytes = 1ull << 30;
  uint64_t memory_max_bytes = 64ull << 20;
};

class CompileCache {
 public:
  // Creates `options.dir` (mkdir -p) when set. Never fails: a folder that cannot be
  // created is logged, and every write retries.
  explicit CompileCache(CompileCacheOptions options);

  CompileCache(const CompileCache&) = delete;
  CompileCache& operator=(const CompileCache&) = delete;

  // The entry for `key`, or null on a miss. A disk hit also fills the memory layer.
  std::shared_ptr<const CacheEntry> Lookup(const Sha256Digest& key);

  // Stores `entry` in both layers (disk only when enabled and the file fits the bound).
  void Insert(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry);

  // Where the disk layer keeps `key` ("" when the disk layer is off).
  std::string PathFor(const Sha256Digest& key) const;

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

  std::shared_ptr<const CacheEntry> LookupMemory(const Sha256Digest& key);
  void InsertMemory(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry);
  std::shared_ptr<const CacheEntry> ReadDisk(const Sha256Digest& key) const;
  void WriteDisk(const Sha256Digest& key, const CacheEntry& entry) const;
  void EnforceDiskBound() const;

  const CompileCacheOptions options_;

  std::mutex mu_;
  LruList lru_;  // most recently used first
  std::unordered_map<Sha256Digest, LruList::iterator, DigestHash> index_;
  uint64_t memory_bytes_ = 0;
};

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_COMPILE_CACHE_H_
