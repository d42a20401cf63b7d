// The compile cache through the Compiler, against the real NVRTC: hits and misses, what the
// key covers, persistence across instances, integrity checks, the disk bound, the memory
// layer and concurrency. Each test gets a fresh cache folder.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/compiler.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::compiler {
namespace {

using ::gpurpc::testing::IsOk;
using ::testing::HasSubstr;

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
                         ::testing::Values("flipped byte", "truncated", "empty", "another key"),
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

}  // namespace
}  // namespace gpurpc::compiler
