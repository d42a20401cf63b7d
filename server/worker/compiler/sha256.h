// SHA-256 (FIPS 180-4), used for compile-cache keys and for the integrity trailer of cache
// files. A small self-contained implementation so that the compiler depends on no crypto
// library; it is not constant-time and is not meant for secrets. On x86-64 CPUs with the
// SHA extensions it uses them (about 10x faster), because every disk-cache hit hashes the
// whole file and a cached compile must stay well under a millisecond.
#ifndef GPURPC_SERVER_WORKER_COMPILER_SHA256_H_
#define GPURPC_SERVER_WORKER_COMPILER_SHA256_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace gpurpc::compiler {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental hasher: Update() any number of times, then Finish() once.
// Not thread-safe; one instance per computation.
class Sha256 {
 public:
  enum class Engine {
    kFastest,   // the SHA extensions when the CPU has them, else portable code
    kPortable,  // plain C++ (for tests that compare the two)
  };

  explicit Sha256(Engine engine = Engine::kFastest);

  // Whether kFastest uses the CPU's SHA extensions on this machine.
  static bool HardwareAccelerated();

  void Update(const void* data, size_t size);
  void Update(absl::string_view data) { Update(data.data(), data.size()); }
  // Returns the digest. The hasher must not be used afterwards.
  Sha256Digest Finish();

  // One-shot convenience.
  static Sha256Digest Hash(absl::string_view data);

 private:
  // Runs the compression function over `blocks` consecutive 64-byte blocks.
  void Compress(const uint8_t* data, size_t blocks);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_;
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
  bool use_hardware_;
};

// Lower-case hex of `digest` (64 characters).
std::string DigestToHex(const Sha256Digest& digest);

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_SHA256_H_
