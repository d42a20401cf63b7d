// SHA-256 (FIPS 180-4) for compile-cache keys, computed by OpenSSL's libcrypto (EVP), which
// uses the CPU's SHA extensions where there are any: every cached compile hashes its whole
// request, and a cache hit must stay well under a millisecond. The integrity of cache files
// is not a plain digest but an HMAC (see compile_cache.h).
#ifndef GPURPC_SERVER_WORKER_COMPILER_SHA256_H_
#define GPURPC_SERVER_WORKER_COMPILER_SHA256_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

// OpenSSL's EVP_MD_CTX (openssl/types.h), declared here so that callers need no OpenSSL
// headers.
struct evp_md_ctx_st;

namespace gpurpc::compiler {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental hasher: Update() any number of times, then Finish() once.
// Not thread-safe; one instance per computation. Not copyable.
class Sha256 {
 public:
  // Kept so that callers need not change. Both engines are OpenSSL's SHA-256, which picks
  // the CPU's SHA extensions by itself when there are any; they always agree.
  enum class Engine {
    kFastest,
    kPortable,
  };

  // Aborts the process if libcrypto cannot set up SHA-256 (a broken installation: no
  // cache key could be computed at all).
  explicit Sha256(Engine engine = Engine::kFastest);
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  // Whether this CPU has the SHA extensions (which OpenSSL's SHA-256 then uses).
  static bool HardwareAccelerated();

  void Update(const void* data, size_t size);
  void Update(absl::string_view data) { Update(data.data(), data.size()); }
  // Returns the digest. The hasher must not be used afterwards.
  Sha256Digest Finish();

  // One-shot convenience.
  static Sha256Digest Hash(absl::string_view data);

 private:
  evp_md_ctx_st* context_;  // OpenSSL's EVP_MD_CTX, owned
};

// Lower-case hex of `digest` (64 characters).
std::string DigestToHex(const Sha256Digest& digest);

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_SHA256_H_
