#include "server/worker/compiler/sha256.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace gpurpc::compiler {
namespace {

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "gpurpc: OpenSSL SHA-256 failed: %s\n", what);
  std::abort();
}

// Fetched once: an explicit fetch saves the provider lookup that EVP_sha256() would repeat
// on every EVP_DigestInit_ex.
const EVP_MD* Sha256Method() {
  static const EVP_MD* const kMethod = [] {
    EVP_MD* method = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    if (method == nullptr) Die("EVP_MD_fetch(SHA256)");
    return method;
  }();
  return kMethod;
}

}  // namespace

Sha256::Sha256(Engine /*engine*/) : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr) Die("EVP_MD_CTX_new");
  if (EVP_DigestInit_ex(context_, Sha256Method(), nullptr) != 1) Die("EVP_DigestInit_ex");
}

Sha256::~Sha256() { EVP_MD_CTX_free(context_); }

bool Sha256::HardwareAccelerated() {
#if defined(__x86_64__)
  static const bool kAvailable = [] {
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (ebx & bit_SHA) != 0;
  }();
  return kAvailable;
#else
  return false;
#endif
}

void Sha256::Update(const void* data, size_t size) {
  if (size == 0) return;
  if (EVP_DigestUpdate(context_, data, size) != 1) Die("EVP_DigestUpdate");
}

Sha256Digest Sha256::Finish() {
  Sha256Digest digest;
  unsigned int size = 0;
  if (EVP_DigestFinal_ex(context_, digest.data(), &size) != 1 || size != digest.size()) {
    Die("EVP_DigestFinal_ex");
  }
  return digest;
}

Sha256Digest Sha256::Hash(absl::string_view data) {
  Sha256 hasher;
  hasher.Update(data);
  return hasher.Finish();
}

std::string DigestToHex(const Sha256Digest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * digest.size());
  for (uint8_t byte : digest) {
    hex.push_back(kHex[byte >> 4]);
    hex.push_back(kHex[byte & 0xf]);
  }
  return hex;
}

}  // namespace gpurpc::compiler
