#include "server/worker/compiler/compile_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "spdlog/spdlog.h"

namespace gpurpc::compiler {
namespace {

// File layout (all integers little-endian):
//   magic "GPURPCNV" | u32 format version | 32-byte key |
//   str arch | str log | u64 count, str option... | u64 count, (str, str) name... |
//   str image | 32-byte HMAC-SHA256 (keyed with the cache's MAC key) of every preceding byte
// where str = u64 length + bytes. Bump kFileFormatVersion with any change. Files of another
// version fail the version check and are removed when looked up.
//   Version 1 ended in a plain SHA-256, which anyone can compute: it told damage apart,
//   not forgery.
constexpr char kMagic[8] = {'G', 'P', 'U', 'R', 'P', 'C', 'N', 'V'};
constexpr uint32_t kFileFormatVersion = 2;
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
// Subfolders and files of the cache, and the key file: this user only.
constexpr mode_t kFolderMode = 0700;
constexpr mode_t kFileMode = 0600;

// HMAC-SHA256 of `data` under `key`. False only when libcrypto fails (never in practice).
bool Mac(absl::string_view key, absl::string_view data, Sha256Digest* mac) {
  unsigned int size = 0;
  return HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
              reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac->data(),
              &size) != nullptr &&
         size == mac->size();
}

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

// The file for `entry`, or "" when the MAC cannot be computed.
std::string Serialize(const Sha256Digest& key, const CacheEntry& entry, absl::string_view mac_key) {
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
  Sha256Digest mac;
  if (!Mac(mac_key, out, &mac)) return "";
  out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
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

// Parses a whole file. Returns null and sets `*problem` when any check fails; nothing but
// the magic and the version is looked at before the MAC has verified. `*keep` is set when
// the failure is ours (libcrypto) rather than the file's.
std::shared_ptr<const CacheEntry> Parse(absl::string_view file, const Sha256Digest& key,
                                        absl::string_view mac_key, std::string* problem,
                                        bool* keep) {
  if (file.size() < kHeaderBytes + kTrailerBytes) {
    *problem = absl::StrCat("truncated (", file.size(), " bytes)");
    return nullptr;
  }
  const absl::string_view body = file.substr(0, file.size() - kTrailerBytes);
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
  Sha256Digest mac;
  if (!Mac(mac_key, body, &mac)) {
    *problem = "cannot compute the MAC (libcrypto failed)";
    *keep = true;
    return nullptr;
  }
  if (CRYPTO_memcmp(mac.data(), file.data() + body.size(), mac.size()) != 0) {
    *problem = "MAC does not verify (planted, damaged, or written under another MAC key)";
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

// `path` without trailing slashes ("/" stays "/"), so that lstat() looks at a symbolic
// link itself rather than at what it points to.
std::string WithoutTrailingSlashes(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return std::string(path);
}

// mkdir -p, new folders with `mode`. Fails only when a mkdir fails for another reason than
// EEXIST; the caller checks what is there at the end.
bool MakeDirs(const std::string& path, mode_t mode, std::string* error) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && mkdir(prefix.c_str(), mode) != 0 && errno != EEXIST) {
      *error = absl::StrCat("mkdir ", prefix, ": ", ErrnoText(errno));
      return false;
    }
    if (slash == std::string::npos) break;
  }
  return true;
}

// A subfolder of the cache: mkdir -p, then it must be a real directory (not a link).
bool MakeSubfolder(const std::string& path, std::string* error) {
  if (!MakeDirs(path, kFolderMode, error)) return false;
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *error = absl::StrCat(path, " is not a directory");
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

bool ReadAll(int fd, char* data, size_t size, size_t* done) {
  *done = 0;
  while (*done < size) {
    const ssize_t got = pread(fd, data + *done, size - *done, static_cast<off_t>(*done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return false;
    if (got == 0) break;
    *done += static_cast<size_t>(got);
  }
  return true;
}

absl::Status KeyFileRefused(const std::string& path, absl::string_view reason) {
  return absl::FailedPreconditionError(absl::StrCat("compile cache key file ", path, " ", reason));
}

// The key in the existing file at `path`; NOT_FOUND when there is none.
absl::StatusOr<std::string> ReadKeyFile(const std::string& path) {
  // lstat first so that a device or FIFO is refused without being opened; fstat below
  // checks the file actually opened.
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    return KeyFileRefused(path, absl::StrCat("cannot be examined: ", ErrnoText(errno)));
  }
  if (S_ISLNK(st.st_mode)) return KeyFileRefused(path, "is a symbolic link");
  if (!S_ISREG(st.st_mode)) return KeyFileRefused(path, "is not a regular file");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    if (errno == ELOOP) return KeyFileRefused(path, "is a symbolic link");
    return KeyFileRefused(path, absl::StrCat("cannot be opened: ", ErrnoText(errno)));
  }
  std::string key(kCacheMacKeyBytes, '\0');
  absl::Status status;
  size_t got = 0;
  if (fstat(fd, &st) != 0) {
    status = KeyFileRefused(path, absl::StrCat("cannot be examined: ", ErrnoText(errno)));
  } else if (!S_ISREG(st.st_mode)) {
    status = KeyFileRefused(path, "is not a regular file");
  } else if (st.st_uid != geteuid()) {
    status = KeyFileRefused(path, absl::StrCat("is owned by uid ", st.st_uid,
                                               ", not by this process's uid ", geteuid()));
  } else if ((st.st_mode & (S_IRGRP | S_IWGRP | S_IROTH | S_IWOTH)) != 0) {
    status = KeyFileRefused(
        path, absl::StrFormat("is readable or writable by group or others (mode %04o); it "
                              "must be 0600 or stricter",
                              st.st_mode & 07777));
  } else if (static_cast<uint64_t>(st.st_size) != kCacheMacKeyBytes) {
    status = KeyFileRefused(
        path, absl::StrCat("is ", st.st_size, " bytes long, not ", kCacheMacKeyBytes));
  } else if (!ReadAll(fd, key.data(), key.size(), &got)) {
    status = KeyFileRefused(path, absl::StrCat("cannot be read: ", ErrnoText(errno)));
  } else if (got != key.size()) {
    status = KeyFileRefused(path, absl::StrCat("shrank to ", got, " bytes while being read"));
  }
  close(fd);
  if (!status.ok()) {
    OPENSSL_cleanse(key.data(), key.size());
    return status;
  }
  return key;
}

// Creates the key file at `path` with a new random key; ALREADY_EXISTS when another
// process created it first (its key is then the one to use).
absl::StatusOr<std::string> CreateKeyFile(const std::string& path) {
  std::string key(kCacheMacKeyBytes, '\0');
  for (size_t done = 0; done < key.size();) {
    const ssize_t got = getrandom(key.data() + done, key.size() - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::InternalError(
          absl::StrCat("getrandom for the compile cache key failed: ", ErrnoText(errno)));
    }
    done += static_cast<size_t>(got);
  }
  static std::atomic<uint64_t> counter{0};
  const std::string temp_path = absl::StrCat(path, kTempPrefix, getpid(), ".",
                                             absl::Hex(ProcessNonce()), ".", counter.fetch_add(1));
  auto fail = [&](absl::Status status, bool remove_temp) {
    if (remove_temp) unlink(temp_path.c_str());
    OPENSSL_cleanse(key.data(), key.size());
    return status;
  };
  const int fd =
      open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kFileMode);
  if (fd < 0) {
    return fail(KeyFileRefused(path, absl::StrCat("cannot be created (", temp_path, ": ",
                                                  ErrnoText(errno), ")")),
                false);
  }
  // fchmod: the umask must not leave the owner unable to read it. fsync: after a crash the
  // file must not be there but short, which would refuse every later start.
  const bool written = fchmod(fd, kFileMode) == 0 && WriteAll(fd, key) && fsync(fd) == 0;
  const int write_errno = errno;
  if (close(fd) != 0 || !written) {
    return fail(KeyFileRefused(path, absl::StrCat("cannot be written (", temp_path, ": ",
                                                  ErrnoText(written ? errno : write_errno), ")")),
                true);
  }
  // link() never replaces an existing file, unlike rename(): the first process to link wins
  // and everyone else reads its key. renameat2(RENAME_NOREPLACE) for file systems without
  // hard links.
  int rc = link(temp_path.c_str(), path.c_str());
  bool linked = rc == 0;
  if (rc != 0 && (errno == EPERM || errno == EOPNOTSUPP || errno == EMLINK)) {
    rc = renameat2(AT_FDCWD, temp_path.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE);
  }
  if (rc != 0) {
    if (errno == EEXIST) return fail(absl::AlreadyExistsError(path), true);
    return fail(KeyFileRefused(path, absl::StrCat("cannot be created (link from ", temp_path, ": ",
                                                  ErrnoText(errno), ")")),
                true);
  }
  if (linked) unlink(temp_path.c_str());
  // Make the new name durable too; failing that only risks a new key after a crash.
  const size_t slash = path.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (const int dir_fd = open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return key;
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

absl::Status PrepareCacheDirectory(const std::string& dir) {
  auto refused = [&dir](absl::string_view reason) {
    return absl::FailedPreconditionError(
        absl::StrCat("compile cache directory ", dir, " ", reason));
  };
  if (dir.empty()) return refused("is empty (no path given)");
  const std::string path = WithoutTrailingSlashes(dir);
  std::string error;
  if (!MakeDirs(path, kFolderMode, &error)) {
    return refused(absl::StrCat("cannot be created (", error, ")"));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    return refused(absl::StrCat("cannot be examined: ", ErrnoText(errno)));
  }
  if (S_ISLNK(st.st_mode)) {
    return refused("is a symbolic link; give the directory it points to, if it is meant");
  }
  if (!S_ISDIR(st.st_mode)) return refused("is not a directory");
  if (st.st_uid != geteuid()) {
    return refused(
        absl::StrCat("is owned by uid ", st.st_uid, ", not by this process's uid ", geteuid()));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return refused(absl::StrFormat(
        "is writable by group or others (mode %04o): anyone who can write there could plant "
        "or delete compiled code; chmod go-w it, or use another --cache-dir",
        st.st_mode & 07777));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LoadOrCreateCacheKey(const std::string& path) {
  if (path.empty()) {
    return absl::FailedPreconditionError("compile cache key file: no path given");
  }
  // Each round either returns or saw another process create or remove the file meanwhile.
  for (int attempt = 0; attempt < 8; ++attempt) {
    absl::StatusOr<std::string> key = ReadKeyFile(path);
    if (key.ok() || !absl::IsNotFound(key.status())) return key;
    key = CreateKeyFile(path);
    if (key.ok() || !absl::IsAlreadyExists(key.status())) return key;
  }
  return KeyFileRefused(path, "keeps appearing and disappearing (another process?)");
}

std::string DefaultCacheKeyPath(absl::string_view cache_dir) {
  if (cache_dir.empty()) return "";
  return absl::StrCat(WithoutTrailingSlashes(cache_dir), ".key");
}

CompileCache::CompileCache(CompileCacheOptions options) : options_(std::move(options)) {
  if (options_.dir.empty()) return;
  if (options_.mac_key.size() < kCacheMacKeyBytes) {
    spdlog::warn(
        "compile cache: disk layer off for {}: the MAC key has {} bytes, {} are needed "
        "(LoadOrCreateCacheKey); compiles are cached in memory only",
        options_.dir, options_.mac_key.size(), kCacheMacKeyBytes);
    return;
  }
  if (absl::Status status = PrepareCacheDirectory(options_.dir); !status.ok()) {
    spdlog::warn("compile cache: disk layer off: {}; compiles are cached in memory only",
                 std::string(status.message()));
    return;
  }
  disk_enabled_ = true;
}

std::string CompileCache::PathFor(const Sha256Digest& key) const {
  if (!disk_enabled_) return "";
  const std::string hex = DigestToHex(key);
  return absl::StrCat(options_.dir, "/", hex.substr(0, 2), "/", hex, kSuffix);
}

std::shared_ptr<const CacheEntry> CompileCache::Lookup(const Sha256Digest& key) {
  if (auto entry = LookupMemory(key)) return entry;
  if (!disk_enabled_) return nullptr;
  auto entry = ReadDisk(key);
  if (entry != nullptr) InsertMemory(key, entry);
  return entry;
}

void CompileCache::Insert(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry) {
  if (disk_enabled_) WriteDisk(key, *entry);
  InsertMemory(key, std::move(entry));
}

std::shared_ptr<const CacheEntry> CompileCache::LookupMemory(const Sha256Digest& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

void CompileCache::InsertMemory(const Sha256Digest& key, std::shared_ptr<const CacheEntry> entry) {
  const uint64_t size = entry->SizeBytes();
  // An entry larger than the whole bound would only evict everything else and then itself.
  if (size > options_.memory_max_bytes) return;
  absl::MutexLock lock(&mu_);
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
  // O_NONBLOCK: a FIFO planted at this path must not hang the worker. O_NOFOLLOW: the
  // cache never writes links, so a link here was planted.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY);
  if (fd < 0) {
    // ENOENT is the ordinary miss (never written, or evicted by another process).
    if (errno == ELOOP) {
      spdlog::warn("compile cache: removing {}: a symbolic link", path);
      unlink(path.c_str());
    } else if (errno != ENOENT) {
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
    ReadAll(fd, data.data(), data.size(), &done);  // an error reads as a truncated file
    data.resize(done);
  }
  close(fd);

  std::shared_ptr<const CacheEntry> entry;
  bool keep = false;
  if (problem.empty()) entry = Parse(data, key, options_.mac_key, &problem, &keep);
  if (entry == nullptr && keep) {
    spdlog::warn("compile cache: cannot check {}: {}", path, problem);
    return nullptr;
  }
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
  const std::string data = Serialize(key, entry, options_.mac_key);
  if (data.empty()) {
    spdlog::warn("compile cache: not writing {}: cannot compute the MAC", DigestToHex(key));
    return;
  }
  if (data.size() > options_.disk_max_bytes) {
    spdlog::debug("compile cache: entry of {} bytes exceeds the disk bound of {} bytes",
                  data.size(), options_.disk_max_bytes);
    return;
  }
  const std::string hex = DigestToHex(key);
  const std::string folder = absl::StrCat(options_.dir, "/", hex.substr(0, 2));
  std::string error;
  if (!MakeSubfolder(folder, &error)) {
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
    fd = open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kFileMode);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    spdlog::warn("compile cache: cannot create {}: {}", temp_path, ErrnoText(errno));
    return;
  }
  // No fsync: after a crash the MAC catches a torn file, and a lost entry is only a
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
