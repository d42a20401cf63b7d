// Random 64-bit handle and session ids from the kernel's CSPRNG.
#ifndef GPURPC_COMMON_HANDLE_IDS_H_
#define GPURPC_COMMON_HANDLE_IDS_H_

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace gpurpc {

// Hands out non-zero 64-bit ids drawn from getrandom(2), so that an id tells nothing about
// any other id (session ids and handles cannot be guessed from ones a client has seen).
// Nothing is remembered per id: with 64 random bits a repeat is a 2^-64 event per pair,
// and the tables that store ids re-draw on the (practically impossible) clash with a live
// id. Ids are fetched from the kernel in blocks to keep the cost per id at a few ns.
//
// Thread-safe.
class HandleIdGenerator {
 public:
  uint64_t Next() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (;;) {
      if (next_ == kBlock) Refill();
      const uint64_t id = block_[next_++];
      if (id != 0) return id;
    }
  }

 private:
  static constexpr int kBlock = 32;

  void Refill() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint8_t* out = reinterpret_cast<uint8_t*>(block_);
    size_t left = sizeof(block_);
    while (left > 0) {
      const ssize_t n = getrandom(out, left, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        std::abort();  // no kernel randomness: never fall back to a guessable id
      }
      out += n;
      left -= static_cast<size_t>(n);
    }
    next_ = 0;
  }

  absl::Mutex mu_;
  uint64_t block_[kBlock] ABSL_GUARDED_BY(mu_) = {};
  int next_ ABSL_GUARDED_BY(mu_) = kBlock;  // the next unused id of block_
};

}  // namespace gpurpc

#endif  // GPURPC_COMMON_HANDLE_IDS_H_
