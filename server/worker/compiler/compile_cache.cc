#include "server/worker/compiler/compile_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace gpurpc::compiler {
namespace {

// File layout (all integers little-endian):
//   magic "GPURPCNV" | u32 format version | 32-byte key |
//   str arch | str log | u64 count, str option... | u64 count, (str, str) name... |
//   str image | 32-byte SHA-256 of every preceding byte
// where str = u64 length + bytes. Bump kFileFormatVersion with any change; the key's
// format version (compiler.cc) changes with it so old files are simply never looked up.
constexpr char kMagic[8] = {'G', 'P', 'U', 'R', 'P', 'C', 'N', 'V'};
constexpr uint32_t kFileFormatVersion = 1;
constexpr size_t kHeaderBytes = sizeof(kMagic) + 4 + 32;
constexpr size_t kTrailerBytes = 32;
// Larger files are not ours (or are damaged); refusing them bounds the read allocation.
constexpr uint64_t kMaxFileBytes = 4ull << 30;
// A temporary file this old belongs to a writer that died before its rename().
constexpr time_t kStaleTempSeconds = 3600;
constexpr char kTempPrefix[] = ".tmp.";
constexpr char kSuffix[] = ".bin";
// Per-entry bookkeeping (list node, map node, strings' headers) for the memory bound.
constexpr uint64_t kEntryOverheadBytes = 256;

void AppendU32(std::string* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

void AppendU64(std::string* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

void AppendString(std::string* out, absl::string_view value) {
  AppendU64(out, value.size());
  out->append(value.data(), value.size());
}

std::string Serialize(const Sha256Digest& key, const CacheEntry& entry) {
  std::string out;
  out.reserve(kHeaderBytes + kTrailerBytes + entry.SizeBytes());
  out.append(kMagic, sizeof(kMagic));
  AppendU32(&out, kFileFormatVersion);
  out.append(reinterpret_cast<const char*>(key.data()), key.size());
  AppendString(&out, entry.arch);
  AppendString(&out, entry.log);
  AppendU64(&out, entry.effective_options.size());
  for (const std::string& option : entry.effective_options) AppendString(&out, option);
  AppendU64(&out, entry.lowered_names.size());
  for (const auto& [expression, lowered] : entry.lowered_names) {
    AppendString(&out, expression);
    AppendString(&out, lowered);
  }
  AppendString(&out, absl::string_view(reinterpret_cast<const char*>(entry.image.data()),
                                       entry.image.size()));
  const Sha256Digest checksum = Sha256::Hash(out);
  out.append(reinterpret_cast<const char*>(checksum.data()), checksum.size());
  return out;
}

// Bounds-checked reader over the body of a cache file.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}

  bool ReadU64(uint64_t* value) {
    if (data_.size() < 8) return false;
    *value = 0;
    for (int i = 0; i < 8; ++i) {
      *value |= uint64_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    }
    data_.remove_prefix(8);
    return true;
  }

  bool ReadString(absl::string_view* value) {
    uint64_t size;
    if (!ReadU64(&size) || size > data_.size()) return false;
    *value = data_.substr(0, size);
    data_.remove_prefix(size);
    return true;
  }

  bool ReadString(std::string* value) {
    absl::string_view view;
    if (!ReadString(&view)) return false;
    value->assign(view.data(), view.size());
    return true;
  }

  // A count of items that each take at least 8 bytes: bounded by what is left, so a
  // damaged count cannot trigger a huge reserve().
  bool ReadCount(uint64_t* count) { return ReadU64(count) && *count <= data_.size() / 8; }

  bool done() const { return data_.empty(); }

 private:
  absl::string_view data_;
};

// Parses a whole file. Returns null and sets `*problem` when any check fails.
std::shared_ptr<const CacheEntry> Parse(absl::string_view file, const Sha256Digest& key,
                                        std::string* problem) {
  if (file.size() < kHeaderBytes + kTrailerBytes) {
    *problem = absl::StrCat("truncated (", file.size(), " bytes)");
    return nullptr;
  }
  const absl::string_view body = file.substr(0, file.size() - kTrailerBytes);
  const Sha256Digest checksum = Sha256::Hash(body);
  if (std::memcmp(checksum.data(), file.data() + body.size(), checksum.size()) != 0) {
    *problem = "checksum mismatch";
    return nullptr;
  }
  if (std::memcmp(body.data(), kMagic, sizeof(kMagic)) != 0) {
    *problem = "bad magic";
    return nullptr;
  }
  uint32_t version = 0;
  for (int i = 0; i < 4; ++i) {
    version |= uint32_t{static_cast<uint8_t>(body[sizeof(kMagic) + i])} << (8 * i);
  }
  if (version != kFileFormatVersion) {
    *problem = absl::StrCat("format version ", version, ", expected ", kFileFormatVersion);
    return nullptr;
  }
  if (std::memcmp(body.data() + sizeof(kMagic) + 4, key.data(), key.size()) != 0) {
    *problem = "holds another key";
    return nullptr;
  }

  Reader reader(body.substr(kHeaderBytes));
  auto entry = std::make_shared<CacheEntry>();
  uint64_t count = 0;
  bool ok =
      reader.ReadString(&entry->arch) && reader.ReadString(&entry->log) && reader.ReadCount(&count);
  if (ok) {
    entry->effective_options.resize(count);
    for (std::string& option : entry->effective_options) {
      ok = ok && reader.ReadString(&option);
    }
  }
  ok = ok && reader.ReadCount(&count);
  if (ok) {
    entry->lowered_names.resize(count);
    for (auto& [expression, lowered] : entry->lowered_names) {
      ok = ok && reader.ReadString(&expression) && reader.ReadString(&lowered);
    }
  }
  absl::string_view image;
  ok = ok && reader.ReadString(&image) && reader.done();
  if (!ok) {
    *problem = "malformed fields";
    return nullptr;
  }
  entry->image.assign(image.begin(), image.end());
  return entry;
}

std::string ErrnoText(int error) { return std::strerror(error); }

// mkdir -p. Succeeds when the folder exists at the end, whoever created it.
bool MakeDirs(const std::string& path, std::string* error) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      *error = absl::StrCat("mkdir ", prefix, ": ", ErrnoText(errno));
      return false;
    }
    if (slash == std::string::npos) break;
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *error = absl::StrCat(path, " is not a folder");
    return false;
  }
  return true;
}

bool WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t written = write(fd, data.data(), data.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(written));
  }
  return true;
}

// Distinguishes this process's temporary files from those of processes with the same pid
// in other PID namespaces (containers sharing one cache volume).
uint64_t ProcessNonce() {
  static const uint64_t kNonce = [] {
    uint64_t value = 0;
    if (getrandom(&value, sizeof(value), GRND_NONBLOCK) != sizeof(value)) {
      timespec now;
      clock_gettime(CLOCK_REALTIME, &now);
      value = static_cast<uint64_t>(now.tv_nsec) * 0x9e3779b97f4a7c15ull ^
              static_cast<uint64_t>(now.tv_sec);
    }
    return value;
  }();
  return kNonce;
}

bool EndsWith(absl::string_view text, absl::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

bool IsHexPair(absl::string_view name) {
  return name.size() == 2 && std::isxdigit(static_cast<unsigned char>(name[0])) &&
         std::isxdigit(static_cast<unsigned char>(name[1]));
}

bool Older(const timespec& a, const timespec& b) {
  return a.tv_sec != b.tv_sec ? a.tv_sec < b.tv_sec : a.tv_nsec < b.tv_nsec;
}

}  // namespace

uint64_t CacheEntry::SizeBytes() const {
  uint64_t size = kEntryOverheadBytes + image.size() + log.size() + arch.size();
  for (const std::string& option : effective_options) size += option.size() + 32;
  for (const auto& [expression, lowered] : lowered_names) {
    size += expression.size() + lowered.size() + 64;
  }
  return size;
}

CompileCache::CompileCache(CompileCacheOptions options) : options_(std::move(options)) {
  if (options_.dir.empty()) return;
  std::string error;
  if (!MakeDirs(options_.dir, &error)) {
    spdlog::warn("compile cache: cannot create {} ({}); will retry on each write", options_.dir,
                 error);
  }
}

std::string CompileCache::PathFor(const Sha256Digest& key) const {
  if (options_.dir.empty()) return "";
  const std::string hex = DigestToHex(key);
  return absl::StrCat(options_.dir, "/", hex.substr(0, 2), "/", hex, kSuffix);
}

std::shared_ptr<const CacheEntry> CompileCache::Lookup(const Sha256Digest& key) {
  if (auto entry = LookupMemory(key)) return entry;
  if (options_.dir.empty()) return nullptr;
  auto entry = ReadDisk(key);
  if (entry != nullptr) InsertMemory(key, entry);
  return entry;
}

void CompileCache::Insert(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry) {
  if (!options_.dir.empty()) WriteDisk(key, *entry);
  InsertMemory(key, std::move(entry));
}

std::shared_ptr<const CacheEntry> CompileCache::LookupMemory(const Sha256Digest& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

void CompileCache::InsertMemory(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry) {
  const uint64_t size = entry->SizeBytes();
  // An entry larger than the whole bound would only evict everything else and then itself.
  if (size > options_.memory_max_bytes) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) {
    // Two threads compiled the same request at once; keep the first, mark it recent.
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  lru_.emplace_front(key, std::move(entry));
  index_.emplace(key, lru_.begin());
  memory_bytes_ += size;
  while (memory_bytes_ > options_.memory_max_bytes && !lru_.empty()) {
    memory_bytes_ -= lru_.back().second->SizeBytes();
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

std::shared_ptr<const CacheEntry> CompileCache::ReadDisk(const Sha256Digest& key) const {
  const std::string path = PathFor(key);
  // O_NONBLOCK: a FIFO planted at this path must not hang the worker.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    // ENOENT is the ordinary miss (never written, or evicted by another process).
    if (errno != ENOENT) {
      spdlog::warn("compile cache: cannot open {}: {}", path, ErrnoText(errno));
    }
    return nullptr;
  }
  struct stat st = {};
  std::string data;
  std::string problem;
  const bool have_stat = fstat(fd, &st) == 0;
  if (!have_stat) {
    problem = absl::StrCat("fstat: ", ErrnoText(errno));
  } else if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > kMaxFileBytes) {
    problem = absl::StrCat("not a regular file of sane size (", st.st_size, " bytes)");
  } else {
    data.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t got =
          pread(fd, data.data() + done, data.size() - done, static_cast<off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      done += static_cast<size_t>(got);
    }
    data.resize(done);
  }
  close(fd);

  std::shared_ptr<const CacheEntry> entry;
  if (problem.empty()) entry = Parse(data, key, &problem);
  if (entry == nullptr) {
    spdlog::warn("compile cache: removing {}: {}", path, problem);
    // Remove only the file that was checked: another process may already have replaced
    // it with a good one through rename(), and that one must stay.
    struct stat now;
    if (have_stat && stat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev &&
        now.st_ino == st.st_ino && unlink(path.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("compile cache: cannot remove {}: {}", path, ErrnoText(errno));
    }
    return nullptr;
  }
  // The disk bound evicts by mtime, so a hit makes the file young again.
  if (utimensat(AT_FDCWD, path.c_str(), nullptr, 0) != 0 && errno != ENOENT) {
    spdlog::debug("compile cache: cannot touch {}: {}", path, ErrnoText(errno));
  }
  return entry;
}

void CompileCache::WriteDisk(const Sha256Digest& key, const CacheEntry& entry) const {
  const std::string data = Serialize(key, entry);
  if (data.size() > options_.disk_max_bytes) {
    spdlog::debug("compile cache: entry of {} bytes exceeds the disk bound of {} bytes",
                  data.size(), options_.disk_max_bytes);
    return;
  }
  const std::string hex = DigestToHex(key);
  const std::string folder = absl::StrCat(options_.dir, "/", hex.substr(0, 2));
  std::string error;
  if (!MakeDirs(folder, &error)) {
    spdlog::warn("compile cache: not writing {}: {}", hex, error);
    return;
  }

  // The temporary name is unique per process and write; O_EXCL makes a collision with
  // a stranger's file (same pid in another PID namespace) fail rather than share it.
  static std::atomic<uint64_t> counter{0};
  std::string temp_path;
  int fd = -1;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    temp_path = absl::StrCat(folder, "/", kTempPrefix, hex, ".", getpid(), ".",
                             absl::Hex(ProcessNonce()), ".", counter.fetch_add(1));
    fd = open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    spdlog::warn("compile cache: cannot create {}: {}", temp_path, ErrnoText(errno));
    return;
  }
  // No fsync: after a crash the checksum catches a torn file, and a lost entry is only a
  // recompile. fsync would cost milliseconds on every miss.
  const bool written = WriteAll(fd, data);
  const int write_errno = errno;
  if (close(fd) != 0 || !written) {
    spdlog::warn("compile cache: cannot write {}: {}", temp_path,
                 ErrnoText(written ? errno : write_errno));
    unlink(temp_path.c_str());
    return;
  }
  const std::string path = PathFor(key);
  if (rename(temp_path.c_str(), path.c_str()) != 0) {
    spdlog::warn("compile cache: cannot rename {} to {}: {}", temp_path, path, ErrnoText(errno));
    unlink(temp_path.c_str());
    return;
  }
  EnforceDiskBound();
}

void CompileCache::EnforceDiskBound() const {
  // A full scan per write: writes follow compiles that take tens of milliseconds or more,
  // and a scan (one fstatat per file) is cheap next to that. Counting the whole folder
  // each time, rather than a running total, keeps every process right about what others
  // wrote and removed.
  struct File {
    std::string path;
    timespec mtime;
    uint64_t size_bytes;
  };
  std::vector<File> files;
  uint64_t total_bytes = 0;
  const time_t now = time(nullptr);

  DIR* top = opendir(options_.dir.c_str());
  if (top == nullptr) {
    if (errno != ENOENT) {
      spdlog::warn("compile cache: cannot list {}: {}", options_.dir, ErrnoText(errno));
    }
    return;
  }
  while (const dirent* sub_entry = readdir(top)) {
    if (!IsHexPair(sub_entry->d_name)) continue;
    const std::string folder = absl::StrCat(options_.dir, "/", sub_entry->d_name);
    DIR* sub = opendir(folder.c_str());
    if (sub == nullptr) continue;  // removed under us, or not a folder
    while (const dirent* file_entry = readdir(sub)) {
      const absl::string_view name = file_entry->d_name;
      const bool is_entry = EndsWith(name, kSuffix) && name[0] != '.';
      const bool is_temp = name.rfind(kTempPrefix, 0) == 0;
      if (!is_entry && !is_temp) continue;
      struct stat st;
      if (fstatat(dirfd(sub), file_entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
          !S_ISREG(st.st_mode)) {
        continue;  // ENOENT: evicted or renamed by another process meanwhile
      }
      std::string path = absl::StrCat(folder, "/", name);
      if (is_temp) {
        if (now - st.st_mtim.tv_sec > kStaleTempSeconds) {
          unlink(path.c_str());
        } else {
          total_bytes += static_cast<uint64_t>(st.st_size);  // a write in progress
        }
        continue;
      }
      total_bytes += static_cast<uint64_t>(st.st_size);
      files.push_back({std::move(path), st.st_mtim, static_cast<uint64_t>(st.st_size)});
    }
    closedir(sub);
  }
  closedir(top);

  if (total_bytes <= options_.disk_max_bytes) return;
  // Trim below the bound, not just to it, so that the next few writes do not each pay
  // for an eviction.
  const uint64_t target_bytes = options_.disk_max_bytes / 10 * 9;
  std::sort(files.begin(), files.end(),
            [](const File& a, const File& b) { return Older(a.mtime, b.mtime); });
  size_t removed = 0;
  for (const File& file : files) {
    if (total_bytes < target_bytes) break;
    if (unlink(file.path.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("compile cache: cannot evict {}: {}", file.path, ErrnoText(errno));
      continue;
    }
    // ENOENT counts too: another process evicted it, and the space is free either way.
    total_bytes -= file.size_bytes;
    ++removed;
  }
  spdlog::debug("compile cache: evicted {} files from {}; {} bytes remain", removed, options_.dir,
                total_bytes);
}

}  // namespace gpurpc::compiler
