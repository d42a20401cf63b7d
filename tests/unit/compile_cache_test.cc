// The compile cache through the Compiler, against the real NVRTC: hits and misses, what the
// key covers, persistence across instances, integrity checks (a keyed MAC: planted and
// foreign files are refused), the disk bound, the memory layer and concurrency; and the
// rules for the cache folder and the MAC key file. Each test gets a fresh cache folder.
#include "server/worker/compiler/compile_cache.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/compiler.h"
#include "server/worker/compiler/sha256.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::compiler {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Two MAC keys of the right length, as two daemons would have.
std::string MacKey() { return std::string(kCacheMacKeyBytes, '\x5a'); }
std::string OtherMacKey() { return std::string(kCacheMacKeyBytes, '\xa5'); }

CompileRequest Kernel(int variant = 0) {
  CompileRequest request;
  request.source =
      "extern \"C\" __global__ void scale(float* data, int n) {\n"
      "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
      "  if (i < n) data[i] *= " +
      std::to_string(variant + 2) + ".0f;\n}\n";
  request.target = "sm_90";
  return request;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

mode_t ModeOf(const std::string& path) {
  struct stat st = {};
  EXPECT_EQ(lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// Sets a file's mtime `age_seconds` into the past.
void Age(const std::string& path, int age_seconds) {
  timespec times[2];
  clock_gettime(CLOCK_REALTIME, &times[0]);
  times[0].tv_sec -= age_seconds;
  times[1] = times[0];
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

class CompileCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "compile_cache_test_XXXXXX";
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    // A folder that does not exist yet: the compiler must create it (mkdir -p).
    cache_dir_ = dir_ + "/nested/cache";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  CompilerOptions Options() const {
    CompilerOptions options;
    options.cache_dir = cache_dir_;
    options.mac_key = MacKey();
    return options;
  }

  std::unique_ptr<Compiler> MakeCompiler(const CompilerOptions& options) {
    auto compiler = Compiler::Create(options);
    EXPECT_THAT(compiler, IsOk());
    return compiler.ok() ? std::move(compiler).value() : nullptr;
  }

  // A compiler whose memory layer is off, so every hit comes from disk.
  std::unique_ptr<Compiler> DiskOnlyCompiler() {
    CompilerOptions options = Options();
    options.memory_cache_max_bytes = 0;
    return MakeCompiler(options);
  }

  std::string PathFor(const CompileResult& result) const {
    return cache_dir_ + "/" + result.cache_key.substr(0, 2) + "/" + result.cache_key + ".bin";
  }

  // Every file under the cache folder (entries and leftovers alike).
  std::vector<std::string> FilesInCache() const {
    std::vector<std::string> files;
    if (!Exists(cache_dir_)) return files;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(cache_dir_)) {
      if (entry.is_regular_file()) files.push_back(entry.path().string());
    }
    return files;
  }

  std::string dir_;
  std::string cache_dir_;
};

TEST_F(CompileCacheTest, SecondCompileIsAHitWithTheSameResult) {
  auto compiler = MakeCompiler(Options());
  ASSERT_NE(compiler, nullptr);
  CompileRequest request = Kernel();
  request.source += "__global__ void warn() { int unused; }\n";  // a log worth caching
  ASSERT_OK_AND_ASSIGN(CompileResult first, compiler->Compile(request));
  ASSERT_TRUE(first.success) << first.log;
  EXPECT_FALSE(first.cache_hit);
  EXPECT_TRUE(Exists(PathFor(first)));

  ASSERT_OK_AND_ASSIGN(CompileResult second, compiler->Compile(request));
  EXPECT_TRUE(second.success);
  EXPECT_TRUE(second.cache_hit);
  EXPECT_EQ(second.image, first.image);
  EXPECT_EQ(second.cache_key, first.cache_key);
  EXPECT_EQ(second.log, first.log);
  EXPECT_THAT(second.log, HasSubstr("warning"));
  EXPECT_EQ(second.effective_options, first.effective_options);
  EXPECT_EQ(second.arch, first.arch);
}

TEST_F(CompileCacheTest, AnyChangeInTheRequestIsAMiss) {
  auto compiler = MakeCompiler(Options());
  ASSERT_NE(compiler, nullptr);
  CompileRequest base = Kernel();
  base.source = "#include \"a.h\"\n" + base.source +
                "template <typename T> __global__ void t(T* p) { p[0] = T(A); }\n";
  base.headers = {{"a.h", "#define A 1\n"}};
  base.name_expressions = {"t<float>"};
  ASSERT_OK_AND_ASSIGN(CompileResult original, compiler->Compile(base));
  ASSERT_TRUE(original.success) << original.log;

  std::vector<std::pair<std::string, CompileRequest>> variants;
  variants.emplace_back("source", base);
  variants.back().second.source += "// a comment\n";
  variants.emplace_back("option", base);
  variants.back().second.options = {"-DUNUSED=1"};
  variants.emplace_back("header content", base);
  variants.back().second.headers[0].content = "#define A 2\n";
  variants.emplace_back("extra header", base);
  variants.back().second.headers.push_back({"b.h", ""});
  variants.emplace_back("name expression", base);
  variants.back().second.name_expressions.emplace_back("t<int>");
  variants.emplace_back("target", base);
  variants.back().second.target = "sm_80";
  variants.emplace_back("program name", base);
  variants.back().second.program_name = "other.cu";

  std::set<std::string> keys = {original.cache_key};
  for (const auto& [what, request] : variants) {
    ASSERT_OK_AND_ASSIGN(CompileResult result, compiler->Compile(request));
    EXPECT_TRUE(result.success) << what << ": " << result.log;
    EXPECT_FALSE(result.cache_hit) << "changing the " << what << " must miss";
    EXPECT_TRUE(keys.insert(result.cache_key).second) << what << " reused a key";
  }
  ASSERT_OK_AND_ASSIGN(CompileResult again, compiler->Compile(base));
  EXPECT_TRUE(again.cache_hit);
}

TEST_F(CompileCacheTest, FieldBoundariesDoNotCollide) {
  // Moving bytes between adjacent fields must change the key.
  auto compiler = MakeCompiler(Options());
  ASSERT_NE(compiler, nullptr);
  CompileRequest one = Kernel();
  one.headers = {{"ab.h", "c"}};
  CompileRequest two = Kernel();
  two.headers = {{"a", "b.hc"}};
  ASSERT_OK_AND_ASSIGN(CompileResult first, compiler->Compile(one));
  ASSERT_OK_AND_ASSIGN(CompileResult second, compiler->Compile(two));
  EXPECT_FALSE(second.cache_hit);
  EXPECT_NE(first.cache_key, second.cache_key);
}

TEST_F(CompileCacheTest, NewInstanceOnTheSameFolderHits) {
  CompileResult first;
  {
    auto compiler = MakeCompiler(Options());
    ASSERT_NE(compiler, nullptr);
    ASSERT_OK_AND_ASSIGN(first, compiler->Compile(Kernel()));
    ASSERT_TRUE(first.success);
  }
  auto restarted = MakeCompiler(Options());
  ASSERT_NE(restarted, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult second, restarted->Compile(Kernel()));
  EXPECT_TRUE(second.cache_hit);
  EXPECT_EQ(second.image, first.image);
  EXPECT_EQ(second.effective_options, first.effective_options);
}

TEST_F(CompileCacheTest, FailedCompilesAreNotCached) {
  auto compiler = MakeCompiler(Options());
  ASSERT_NE(compiler, nullptr);
  CompileRequest broken = Kernel();
  broken.source += "this is not C++;\n";
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(CompileResult result, compiler->Compile(broken));
    EXPECT_FALSE(result.success);
    EXPECT_FALSE(result.cache_hit);
  }
  EXPECT_TRUE(FilesInCache().empty());
}

class DamagedFileTest : public CompileCacheTest,
                        public ::testing::WithParamInterface<const char*> {};

TEST_P(DamagedFileTest, IsDetectedRecompiledAndRewritten) {
  const std::string damage = GetParam();
  CompileResult original;
  {
    auto compiler = DiskOnlyCompiler();
    ASSERT_NE(compiler, nullptr);
    ASSERT_OK_AND_ASSIGN(original, compiler->Compile(Kernel()));
  }
  const std::string path = PathFor(original);
  const std::string good = ReadFile(path);
  std::string data = good;
  ASSERT_GT(data.size(), 100u);
  if (damage == "flipped byte") {
    data[data.size() / 2] ^= 0x01;
  } else if (damage == "truncated") {
    data.resize(data.size() / 2);
  } else if (damage == "empty") {
    data.clear();
  } else if (damage == "another key") {
    // A well-formed file of another request under this key's name.
    auto compiler = DiskOnlyCompiler();
    ASSERT_OK_AND_ASSIGN(CompileResult other, compiler->Compile(Kernel(1)));
    data = ReadFile(PathFor(other));
  } else if (damage == "plain checksum" || damage == "planted image") {
    // What anyone who can write into the folder but does not know the MAC key can make:
    // the right layout, ending in a correct plain SHA-256 instead of the MAC (the format
    // of version 1), around the real entry or around an image of their own.
    std::string body = data.substr(0, data.size() - 32);
    if (damage == "planted image") body[body.size() - 10] ^= 0x01;  // the image is last
    const Sha256Digest checksum = Sha256::Hash(body);
    data = body + std::string(checksum.begin(), checksum.end());
  } else if (damage == "another MAC key") {
    // The same entry as another daemon (another key file) writes it.
    CompilerOptions options = Options();
    options.memory_cache_max_bytes = 0;
    options.mac_key = OtherMacKey();
    auto other = MakeCompiler(options);
    ASSERT_NE(other, nullptr);
    ASSERT_OK_AND_ASSIGN(CompileResult result, other->Compile(Kernel()));
    EXPECT_FALSE(result.cache_hit) << "a file under another MAC key must not verify";
    data = ReadFile(path);
    ASSERT_EQ(data.size(), good.size());
    ASSERT_NE(data, good);
  }
  WriteFile(path, data);

  auto compiler = DiskOnlyCompiler();
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult recompiled, compiler->Compile(Kernel()));
  EXPECT_TRUE(recompiled.success);
  EXPECT_FALSE(recompiled.cache_hit) << "a " << damage << " file must not be used";
  EXPECT_EQ(recompiled.image, original.image);
  EXPECT_EQ(ReadFile(path), good) << "the damaged file must have been replaced";

  ASSERT_OK_AND_ASSIGN(CompileResult rewritten, compiler->Compile(Kernel()));
  EXPECT_TRUE(rewritten.cache_hit) << "the entry must have been rewritten";
  EXPECT_EQ(rewritten.image, original.image);
}

INSTANTIATE_TEST_SUITE_P(Damage, DamagedFileTest,
                         ::testing::Values("flipped byte", "truncated", "empty", "another key",
                                           "plain checksum", "planted image", "another MAC key"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == ' ') c = '_';
                           }
                           return name;
                         });

TEST_F(CompileCacheTest, DiskBoundEvictsLeastRecentlyUsed) {
  std::string path_a, path_b;
  uint64_t size_a = 0, size_b = 0;
  {
    auto compiler = DiskOnlyCompiler();
    ASSERT_NE(compiler, nullptr);
    ASSERT_OK_AND_ASSIGN(CompileResult a, compiler->Compile(Kernel(0)));
    ASSERT_OK_AND_ASSIGN(CompileResult b, compiler->Compile(Kernel(1)));
    path_a = PathFor(a);
    path_b = PathFor(b);
    size_a = ReadFile(path_a).size();
    size_b = ReadFile(path_b).size();
  }
  // A was written first but used most recently: B is the least recently used.
  Age(path_a, 2000);
  Age(path_b, 1000);
  CompilerOptions options = Options();
  options.memory_cache_max_bytes = 0;
  // Room for two entries of this size, not three.
  options.cache_max_bytes = size_a + size_b + size_a / 2;
  auto compiler = MakeCompiler(options);
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult hit, compiler->Compile(Kernel(0)));
  EXPECT_TRUE(hit.cache_hit);  // refreshes A's mtime

  ASSERT_OK_AND_ASSIGN(CompileResult c, compiler->Compile(Kernel(2)));
  EXPECT_FALSE(c.cache_hit);
  EXPECT_TRUE(Exists(path_a));
  EXPECT_FALSE(Exists(path_b)) << "the least recently used entry must be evicted";
  EXPECT_TRUE(Exists(PathFor(c)));
  uint64_t total = 0;
  for (const std::string& file : FilesInCache()) total += ReadFile(file).size();
  EXPECT_LE(total, options.cache_max_bytes);
}

TEST_F(CompileCacheTest, EntryLargerThanTheDiskBoundIsNotWritten) {
  CompilerOptions options = Options();
  options.cache_max_bytes = 100;
  auto compiler = MakeCompiler(options);
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult result, compiler->Compile(Kernel()));
  EXPECT_TRUE(result.success);
  EXPECT_TRUE(FilesInCache().empty());
  ASSERT_OK_AND_ASSIGN(CompileResult again, compiler->Compile(Kernel()));
  EXPECT_TRUE(again.cache_hit);  // still served from memory
}

TEST_F(CompileCacheTest, MemoryOnlyModeHitsInMemory) {
  CompilerOptions options;
  options.cache_dir = "";
  auto compiler = MakeCompiler(options);
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult first, compiler->Compile(Kernel()));
  ASSERT_OK_AND_ASSIGN(CompileResult second, compiler->Compile(Kernel()));
  EXPECT_FALSE(first.cache_hit);
  EXPECT_TRUE(second.cache_hit);
  EXPECT_EQ(second.image, first.image);
  EXPECT_FALSE(Exists(cache_dir_));

  // Memory is per instance: a new one starts cold.
  auto other = MakeCompiler(options);
  ASSERT_OK_AND_ASSIGN(CompileResult cold, other->Compile(Kernel()));
  EXPECT_FALSE(cold.cache_hit);
}

TEST_F(CompileCacheTest, MemoryBoundEvictsLeastRecentlyUsed) {
  CompilerOptions options;
  options.cache_dir = "";
  ASSERT_OK_AND_ASSIGN(CompileResult probe, MakeCompiler(options)->Compile(Kernel()));
  // Room for one entry of this size, not two.
  options.memory_cache_max_bytes = probe.image.size() * 3 / 2;
  auto compiler = MakeCompiler(options);
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult a, compiler->Compile(Kernel(0)));
  ASSERT_OK_AND_ASSIGN(CompileResult a_hit, compiler->Compile(Kernel(0)));
  EXPECT_TRUE(a_hit.cache_hit);
  ASSERT_OK_AND_ASSIGN(CompileResult b, compiler->Compile(Kernel(1)));
  ASSERT_OK_AND_ASSIGN(CompileResult b_hit, compiler->Compile(Kernel(1)));
  EXPECT_TRUE(b_hit.cache_hit);
  ASSERT_OK_AND_ASSIGN(CompileResult a_again, compiler->Compile(Kernel(0)));
  EXPECT_FALSE(a_again.cache_hit) << "A should have been evicted by B";
}

TEST_F(CompileCacheTest, ConcurrentCompilesFromManyThreadsSucceed) {
  // Two instances on one folder stand in for two worker processes.
  auto first = MakeCompiler(Options());
  auto second = MakeCompiler(Options());
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  constexpr size_t kThreads = 8;
  std::vector<CompileResult> shared(kThreads), own(kThreads);
  std::vector<absl::Status> statuses(2 * kThreads);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Compiler& compiler = t % 2 == 0 ? *first : *second;
      auto same = compiler.Compile(Kernel(0));
      statuses[2 * t] = same.status();
      if (same.ok()) shared[t] = std::move(same).value();
      auto distinct = compiler.Compile(Kernel(100 + static_cast<int>(t)));
      statuses[2 * t + 1] = distinct.status();
      if (distinct.ok()) own[t] = std::move(distinct).value();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : statuses) EXPECT_OK(status);
  for (size_t t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(shared[t].success) << shared[t].log;
    EXPECT_TRUE(own[t].success) << own[t].log;
    EXPECT_EQ(shared[t].image, shared[0].image);
    EXPECT_EQ(shared[t].cache_key, shared[0].cache_key);
  }
  // Exactly the entries, and no temporary files left behind.
  EXPECT_EQ(FilesInCache().size(), kThreads + 1);
  auto restarted = MakeCompiler(Options());
  for (int t = 0; t < static_cast<int>(kThreads); ++t) {
    ASSERT_OK_AND_ASSIGN(CompileResult result, restarted->Compile(Kernel(100 + t)));
    EXPECT_TRUE(result.cache_hit);
  }
}

// ---------------------------------------------------------------- the cache without NVRTC

CacheEntry SomeEntry() {
  CacheEntry entry;
  entry.image = {'c', 'u', 'b', 'i', 'n', 0, 1, 2, 3};
  entry.log = "a warning";
  entry.arch = "sm_90";
  entry.effective_options = {"-arch=sm_90"};
  entry.lowered_names = {{"f<int>", "_Z1fIiEvv"}};
  return entry;
}

Sha256Digest SomeKey() { return Sha256::Hash("some request"); }

TEST_F(CompileCacheTest, GoodFileHitsInAnotherInstance) {
  {
    CompileCache cache({cache_dir_, 1ull << 30, 0, MacKey()});
    ASSERT_TRUE(cache.disk_enabled());
    cache.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
  }
  CompileCache cache({cache_dir_, 1ull << 30, 0, MacKey()});
  std::shared_ptr<const CacheEntry> hit = cache.Lookup(SomeKey());
  ASSERT_NE(hit, nullptr);
  EXPECT_EQ(hit->image, SomeEntry().image);
  EXPECT_EQ(hit->log, SomeEntry().log);
  EXPECT_EQ(hit->lowered_names, SomeEntry().lowered_names);
}

TEST_F(CompileCacheTest, PlantedFileIsRemovedAndMissed) {
  CompileCache cache({cache_dir_, 1ull << 30, 0, MacKey()});
  cache.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
  const std::string path = cache.PathFor(SomeKey());
  const std::string good = ReadFile(path);
  ASSERT_GT(good.size(), 32u);
  // Another image in the right layout, with a correct plain SHA-256 where the MAC goes.
  std::string body = good.substr(0, good.size() - 32);
  body[body.size() - 1] ^= 0x7f;
  const Sha256Digest checksum = Sha256::Hash(body);
  WriteFile(path, body + std::string(checksum.begin(), checksum.end()));

  EXPECT_EQ(cache.Lookup(SomeKey()), nullptr);
  EXPECT_FALSE(Exists(path)) << "the planted file must be removed";
}

TEST_F(CompileCacheTest, FileUnderAnotherMacKeyIsRemovedAndMissed) {
  {
    CompileCache other({cache_dir_, 1ull << 30, 0, OtherMacKey()});
    other.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
  }
  CompileCache cache({cache_dir_, 1ull << 30, 0, MacKey()});
  const std::string path = cache.PathFor(SomeKey());
  ASSERT_TRUE(Exists(path));
  EXPECT_EQ(cache.Lookup(SomeKey()), nullptr);
  EXPECT_FALSE(Exists(path));
}

TEST_F(CompileCacheTest, FilesAndFoldersAreForThisUserOnly) {
  CompileCache cache({cache_dir_, 1ull << 30, 0, MacKey()});
  cache.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
  const std::string path = cache.PathFor(SomeKey());
  EXPECT_EQ(ModeOf(cache_dir_), 0700u);
  EXPECT_EQ(ModeOf(std::filesystem::path(path).parent_path().string()), 0700u);
  EXPECT_EQ(ModeOf(path), 0600u);
}

TEST_F(CompileCacheTest, NoDiskLayerWithoutAFullMacKey) {
  for (const std::string& key : {std::string(), std::string(kCacheMacKeyBytes - 1, 'k')}) {
    CompileCache cache({cache_dir_, 1ull << 30, 64ull << 20, key});
    EXPECT_FALSE(cache.disk_enabled()) << key.size() << "-byte key";
    EXPECT_EQ(cache.PathFor(SomeKey()), "");
    cache.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
    EXPECT_NE(cache.Lookup(SomeKey()), nullptr) << "memory still works";
    EXPECT_TRUE(FilesInCache().empty());
  }

  // Through the compiler too.
  CompilerOptions options = Options();
  options.mac_key.clear();
  auto compiler = MakeCompiler(options);
  ASSERT_NE(compiler, nullptr);
  ASSERT_OK_AND_ASSIGN(CompileResult first, compiler->Compile(Kernel()));
  ASSERT_OK_AND_ASSIGN(CompileResult second, compiler->Compile(Kernel()));
  EXPECT_TRUE(first.success);
  EXPECT_TRUE(second.cache_hit);
  EXPECT_TRUE(FilesInCache().empty());
}

TEST_F(CompileCacheTest, NoDiskLayerInAFolderOthersCanWrite) {
  ASSERT_OK(PrepareCacheDirectory(cache_dir_));
  ASSERT_EQ(chmod(cache_dir_.c_str(), 0770), 0);
  CompileCache cache({cache_dir_, 1ull << 30, 64ull << 20, MacKey()});
  EXPECT_FALSE(cache.disk_enabled());
  cache.Insert(SomeKey(), std::make_shared<CacheEntry>(SomeEntry()));
  EXPECT_TRUE(FilesInCache().empty());
}

// ----------------------------------------------------------------------- the cache folder

class CacheDirectoryTest : public CompileCacheTest {};

TEST_F(CacheDirectoryTest, IsCreatedWithMissingParentsForThisUserOnly) {
  const std::string dir = dir_ + "/a/b/cache";
  ASSERT_OK(PrepareCacheDirectory(dir));
  EXPECT_EQ(ModeOf(dir_ + "/a"), 0700u);
  EXPECT_EQ(ModeOf(dir_ + "/a/b"), 0700u);
  EXPECT_EQ(ModeOf(dir), 0700u);
  EXPECT_OK(PrepareCacheDirectory(dir)) << "an existing good folder is fine";
  EXPECT_OK(PrepareCacheDirectory(dir + "/")) << "with a trailing slash too";
}

TEST_F(CacheDirectoryTest, ExistingReadableFolderIsKeptAsItIs) {
  const std::string dir = dir_ + "/cache";
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  EXPECT_OK(PrepareCacheDirectory(dir));
  EXPECT_EQ(ModeOf(dir), 0755u);
}

class WritableCacheDirectoryTest : public CacheDirectoryTest,
                                   public ::testing::WithParamInterface<mode_t> {};

TEST_P(WritableCacheDirectoryTest, IsRefused) {
  const std::string dir = dir_ + "/cache";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(dir.c_str(), GetParam()), 0);
  EXPECT_THAT(PrepareCacheDirectory(dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(dir), HasSubstr("writable by group or others"))));
}

INSTANTIATE_TEST_SUITE_P(Modes, WritableCacheDirectoryTest,
                         ::testing::Values(0770, 0730, 0707, 0702, 01777), [](const auto& info) {
                           char name[16];
                           std::snprintf(name, sizeof(name), "mode%04o", info.param);
                           return std::string(name);
                         });

TEST_F(CacheDirectoryTest, SymbolicLinkIsRefused) {
  const std::string real = dir_ + "/real";
  const std::string link = dir_ + "/cache";
  ASSERT_EQ(mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  EXPECT_THAT(PrepareCacheDirectory(link),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(link), HasSubstr("symbolic link"))));
  EXPECT_THAT(PrepareCacheDirectory(link + "/"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("symbolic link")));
}

TEST_F(CacheDirectoryTest, RegularFileIsRefused) {
  const std::string file = dir_ + "/cache";
  WriteFile(file, "not a folder");
  EXPECT_THAT(PrepareCacheDirectory(file),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(file), HasSubstr("not a directory"))));
}

TEST_F(CacheDirectoryTest, FolderOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "not root: cannot give a folder to another user";
  const std::string dir = dir_ + "/cache";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  if (chown(dir.c_str(), 65534, 65534) != 0) {
    GTEST_SKIP() << "cannot chown to 65534: " << std::strerror(errno);
  }
  EXPECT_THAT(PrepareCacheDirectory(dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(dir), HasSubstr("owned by uid 65534"))));
}

// ------------------------------------------------------------------------ the MAC key file

class CacheKeyFileTest : public CompileCacheTest {
 protected:
  // Writes `data` to a new file `path` with exactly `mode`.
  static void WriteWithMode(const std::string& path, const std::string& data, mode_t mode) {
    WriteFile(path, data);
    ASSERT_EQ(chmod(path.c_str(), mode), 0) << path;
  }

  // Names in `dir_` that look like leftover temporary files.
  std::vector<std::string> Leftovers() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      const std::string name = entry.path().filename().string();
      if (name.find(".tmp.") != std::string::npos) names.push_back(name);
    }
    return names;
  }
};

TEST_F(CacheKeyFileTest, IsCreatedForThisUserOnlyAndReused) {
  const std::string path = dir_ + "/cache.key";
  ASSERT_OK_AND_ASSIGN(std::string key, LoadOrCreateCacheKey(path));
  EXPECT_EQ(key.size(), kCacheMacKeyBytes);
  EXPECT_NE(key, std::string(kCacheMacKeyBytes, '\0'));
  EXPECT_EQ(ModeOf(path), 0600u);
  EXPECT_EQ(ReadFile(path), key);
  ASSERT_OK_AND_ASSIGN(std::string again, LoadOrCreateCacheKey(path));
  EXPECT_EQ(again, key);
  EXPECT_TRUE(Leftovers().empty());

  // Another file, another key.
  ASSERT_OK_AND_ASSIGN(std::string other, LoadOrCreateCacheKey(dir_ + "/other.key"));
  EXPECT_NE(other, key);
}

TEST_F(CacheKeyFileTest, DefaultPathIsBesideTheCacheFolder) {
  EXPECT_EQ(DefaultCacheKeyPath("/var/cache/gpurpc"), "/var/cache/gpurpc.key");
  EXPECT_EQ(DefaultCacheKeyPath("/var/cache/gpurpc//"), "/var/cache/gpurpc.key");
  EXPECT_EQ(DefaultCacheKeyPath("cache"), "cache.key");
  EXPECT_EQ(DefaultCacheKeyPath(""), "");
}

class SharedKeyFileTest : public CacheKeyFileTest, public ::testing::WithParamInterface<mode_t> {};

TEST_P(SharedKeyFileTest, IsRefused) {
  const std::string path = dir_ + "/cache.key";
  WriteWithMode(path, std::string(kCacheMacKeyBytes, 'k'), GetParam());
  EXPECT_THAT(LoadOrCreateCacheKey(path),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("readable or writable by group or "
                                                        "others"))));
}

INSTANTIATE_TEST_SUITE_P(Modes, SharedKeyFileTest,
                         ::testing::Values(0640, 0620, 0604, 0602, 0644, 0666),
                         [](const auto& info) {
                           char name[16];
                           std::snprintf(name, sizeof(name), "mode%04o", info.param);
                           return std::string(name);
                         });

TEST_F(CacheKeyFileTest, FileOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "not root: cannot give a file to another user";
  const std::string path = dir_ + "/cache.key";
  WriteWithMode(path, std::string(kCacheMacKeyBytes, 'k'), 0600);
  if (chown(path.c_str(), 65534, 65534) != 0) {
    GTEST_SKIP() << "cannot chown to 65534: " << std::strerror(errno);
  }
  EXPECT_THAT(LoadOrCreateCacheKey(path),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("owned by uid 65534"))));
}

TEST_F(CacheKeyFileTest, FileOfAnotherSizeIsRefused) {
  const std::string path = dir_ + "/cache.key";
  for (size_t size : {size_t{0}, kCacheMacKeyBytes - 1, kCacheMacKeyBytes + 1, size_t{4096}}) {
    std::filesystem::remove(path);
    WriteWithMode(path, std::string(size, 'k'), 0600);
    EXPECT_THAT(LoadOrCreateCacheKey(path),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr(path), HasSubstr("bytes long"))))
        << size << " bytes";
    EXPECT_EQ(ReadFile(path).size(), size) << "a refused file is left alone";
  }
}

TEST_F(CacheKeyFileTest, SymbolicLinkIsRefused) {
  const std::string real = dir_ + "/real.key";
  const std::string link = dir_ + "/cache.key";
  ASSERT_OK(LoadOrCreateCacheKey(real).status());
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  EXPECT_THAT(LoadOrCreateCacheKey(link),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(link), HasSubstr("symbolic link"))));

  // A dangling link is not followed to create the file where it points.
  const std::string target = dir_ + "/elsewhere.key";
  const std::string dangling = dir_ + "/dangling.key";
  ASSERT_EQ(symlink(target.c_str(), dangling.c_str()), 0);
  EXPECT_THAT(LoadOrCreateCacheKey(dangling),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("symbolic link")));
  EXPECT_FALSE(Exists(target));
}

TEST_F(CacheKeyFileTest, FolderIsRefused) {
  const std::string path = dir_ + "/cache.key";
  ASSERT_EQ(mkdir(path.c_str(), 0700), 0);
  EXPECT_THAT(LoadOrCreateCacheKey(path),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("not a regular file"))));
}

TEST_F(CacheKeyFileTest, MissingParentFolderIsAnError) {
  const std::string path = dir_ + "/missing/cache.key";
  EXPECT_THAT(LoadOrCreateCacheKey(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(path)));
}

// Several processes (as the workers of one daemon starting at once) racing to create the
// key file all end up with the same key, the one in the file.
TEST_F(CacheKeyFileTest, ConcurrentCreatorsInSeveralProcessesAgree) {
  constexpr int kRounds = 10;
  constexpr int kProcesses = 8;
  constexpr size_t kMessageBytes = 1 + kCacheMacKeyBytes;  // 'K' + key, or 'E' + error
  for (int round = 0; round < kRounds; ++round) {
    const std::string path = dir_ + "/race" + std::to_string(round) + ".key";
    int go[2], results[2];
    ASSERT_EQ(pipe(go), 0);
    ASSERT_EQ(pipe(results), 0);
    std::vector<pid_t> children;
    for (int p = 0; p < kProcesses; ++p) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        close(go[1]);
        close(results[0]);
        char byte;
        while (read(go[0], &byte, 1) < 0 && errno == EINTR) {
        }  // EOF: everyone starts at once
        absl::StatusOr<std::string> key = LoadOrCreateCacheKey(path);
        std::string message = key.ok() ? "K" + *key : "E" + std::string(key.status().message());
        message.resize(kMessageBytes, ' ');
        // One write of less than PIPE_BUF bytes: never interleaved with another child's.
        _exit(write(results[1], message.data(), message.size()) ==
                      static_cast<ssize_t>(message.size())
                  ? 0
                  : 1);
      }
      children.push_back(pid);
    }
    close(go[0]);
    close(results[1]);
    close(go[1]);  // go

    std::string all;
    char buffer[512];
    for (ssize_t got; (got = read(results[0], buffer, sizeof(buffer))) != 0;) {
      if (got < 0 && errno == EINTR) continue;
      ASSERT_GT(got, 0);
      all.append(buffer, static_cast<size_t>(got));
    }
    close(results[0]);
    for (pid_t pid : children) {
      int status = 0;
      ASSERT_EQ(waitpid(pid, &status, 0), pid);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    ASSERT_EQ(all.size(), kProcesses * kMessageBytes);
    const std::string in_file = ReadFile(path);
    ASSERT_EQ(in_file.size(), kCacheMacKeyBytes);
    for (int p = 0; p < kProcesses; ++p) {
      const std::string message = all.substr(p * kMessageBytes, kMessageBytes);
      ASSERT_EQ(message[0], 'K') << "round " << round << ": " << message.substr(1);
      EXPECT_EQ(message.substr(1), in_file) << "round " << round << ", process " << p;
    }
    EXPECT_EQ(ModeOf(path), 0600u);
  }
  EXPECT_TRUE(Leftovers().empty());
}

}  // namespace
}  // namespace gpurpc::compiler
