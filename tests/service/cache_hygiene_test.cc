// The shared compile cache at the daemon level (ctest label `service`): the real gpurpcd with
// real worker processes on the fake backend, through the C++ client. A cache folder that
// others can write to, or a key file that others can read, stops the daemon from starting;
// a cache file planted without the daemon's MAC key is never loaded, the compile runs again
// and its result replaces the planted file.
//
// NVRTC compiles for real in the fake worker (compute_75 PTX); the fake then runs its
// built-in host "kernels" by name, so the source defines a real CUDA kernel with the name
// and signature of one of those built-ins.

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/sha256.h"
#include "tests/testing/daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The fake backend's axpy_f32, as real CUDA with the same name and signature.
constexpr char kAxpy[] = R"cuda(
extern "C" __global__ void axpy_f32(float a, const float* x, float* y, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
)cuda";

// A folder for one test, removed afterwards, with the key file that daemons using
// `cache()` create beside it (`<cache>.key`, inside this folder too).
class TempDir {
 public:
  TempDir() {
    char path[] = "/tmp/gpurpc-cache-hygiene-test-XXXXXX";
    if (mkdtemp(path) != nullptr) path_ = path;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string cache() const { return path_ + "/cache"; }
  std::string key_file() const { return cache() + ".key"; }

 private:
  std::string path_;
};

TestDaemon::Options WithCache(const std::string& cache_dir) {
  TestDaemon::Options options;
  options.cache_dir = cache_dir;
  return options;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
  return out.good();
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

TEST(CacheHygieneTest, GroupWritableCacheDirStopsTheDaemon) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ASSERT_EQ(mkdir(dir.cache().c_str(), 0700), 0);
  ASSERT_EQ(chmod(dir.cache().c_str(), 0770), 0);

  absl::StatusOr<std::unique_ptr<TestDaemon>> daemon = TestDaemon::Start(WithCache(dir.cache()));
  ASSERT_FALSE(daemon.ok()) << "gpurpcd started with a group-writable cache folder";
  EXPECT_THAT(std::string(daemon.status().message()),
              AllOf(HasSubstr(dir.cache()), HasSubstr("writable by group or others")));
  EXPECT_FALSE(Exists(dir.key_file())) << "no key is made for a refused folder";
}

TEST(CacheHygieneTest, KeyFileOthersCanReadStopsTheDaemon) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ASSERT_TRUE(WriteFile(dir.key_file(), std::string(32, 'k')));
  ASSERT_EQ(chmod(dir.key_file().c_str(), 0644), 0);

  absl::StatusOr<std::unique_ptr<TestDaemon>> daemon = TestDaemon::Start(WithCache(dir.cache()));
  ASSERT_FALSE(daemon.ok()) << "gpurpcd started with a world-readable cache key";
  EXPECT_THAT(std::string(daemon.status().message()),
              AllOf(HasSubstr(dir.key_file()), HasSubstr("readable or writable by group")));
}

// Replaces the image (the last field) of the cache file `file` with `image` and ends it with a
// correct plain SHA-256 where the MAC goes: what anyone who can write into the folder but
// cannot read the key file could make.
std::string Forge(const std::string& file, const std::string& original_image,
                  const std::string& image) {
  const size_t body_size = file.size() - 32;
  const size_t prefix_size = body_size - original_image.size() - 8;  // u64 length + image
  std::string body = file.substr(0, prefix_size);
  for (int i = 0; i < 8; ++i) body.push_back(static_cast<char>(uint64_t{image.size()} >> (8 * i)));
  body += image;
  const compiler::Sha256Digest checksum = compiler::Sha256::Hash(body);
  return body + std::string(checksum.begin(), checksum.end());
}

TEST(CacheHygieneTest, PlantedCacheFileIsNotLoaded) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string source =
      absl::StrCat(kAxpy, "// planted-file test ", absl::ToUnixNanos(absl::Now()), "\n");
  CompileOptions compile;
  compile.source = source;

  std::string cache_key, image;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<TestDaemon> daemon,
                         TestDaemon::Start(WithCache(dir.cache())));
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon->address()));
    ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
    ASSERT_OK_AND_ASSIGN(CompileResult first, session.Compile(compile));
    ASSERT_TRUE(first.success()) << first.log();
    EXPECT_FALSE(first.response.cache_hit());
    cache_key = first.response.cache_key();
    image = first.response.image();
  }
  struct stat st;
  ASSERT_EQ(stat(dir.key_file().c_str(), &st), 0) << "the daemon made no key file";
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_size, 32);

  ASSERT_EQ(cache_key.size(), 64u);
  const std::string path =
      absl::StrCat(dir.cache(), "/", cache_key.substr(0, 2), "/", cache_key, ".bin");
  const std::string good = ReadFile(path);
  ASSERT_GT(good.size(), image.size() + 8 + 32) << "no cache file at " << path;
  ASSERT_EQ(good.substr(good.size() - 32 - image.size(), image.size()), image)
      << "the file does not end in the image and a 32-byte trailer";
  // The planted module: the real PTX with something of the attacker's added to it.
  std::string planted_image = image;
  const size_t end = planted_image.find('\0');
  planted_image.insert(end == std::string::npos ? planted_image.size() : end,
                       "\n// planted by someone without the key\n");
  const std::string planted = Forge(good, image, planted_image);
  ASSERT_TRUE(WriteFile(path, planted));

  // A fresh daemon (an empty memory cache) on the same folder and key file.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TestDaemon> daemon,
                       TestDaemon::Start(WithCache(dir.cache())));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon->address()));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession());
  ASSERT_OK_AND_ASSIGN(CompileResult second, session.Compile(compile));
  ASSERT_TRUE(second.success()) << second.log();
  EXPECT_FALSE(second.response.cache_hit()) << "the planted file was used";
  EXPECT_EQ(second.response.cache_key(), cache_key);
  EXPECT_EQ(second.response.image(), image);
  EXPECT_THAT(daemon->Log(), AllOf(HasSubstr(path), HasSubstr("MAC does not verify")));
  EXPECT_EQ(ReadFile(path), good) << "the fresh compile must replace the planted file";

  // The module is the real one: it loads and runs.
  ASSERT_OK_AND_ASSIGN(Function axpy, second.module.GetFunction("axpy_f32"));
  constexpr uint64_t kN = 1000;
  std::vector<float> x(kN), y(kN);
  for (uint64_t i = 0; i < kN; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  auto bytes = [](const std::vector<float>& v) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4);
  };
  ASSERT_OK_AND_ASSIGN(Buffer dx, session.Allocate(kN * sizeof(float)));
  ASSERT_OK_AND_ASSIGN(Buffer dy, session.Allocate(kN * sizeof(float)));
  ASSERT_OK(dx.Upload(bytes(x)));
  ASSERT_OK(dy.Upload(bytes(y)));
  LaunchConfig launch;
  launch.grid = {4, 1, 1};
  launch.block = {256, 1, 1};
  ASSERT_OK(axpy.Launch(launch, 2.0f, dx, dy, kN));
  ASSERT_OK(session.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> result, dy.Download());
  ASSERT_EQ(result.size(), kN * sizeof(float));
  std::vector<float> out(kN);
  std::memcpy(out.data(), result.data(), result.size());
  for (uint64_t i = 0; i < kN; ++i) {
    ASSERT_FLOAT_EQ(out[i], 2.0f * x[i] + 1.0f) << "element " << i;
  }
}

}  // namespace
}  // namespace gpurpc
