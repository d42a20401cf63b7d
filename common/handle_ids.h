// Random, never-reused 64-bit handle ids.
#ifndef GPURPC_COMMON_HANDLE_IDS_H_
#define GPURPC_COMMON_HANDLE_IDS_H_

#include <cstdint>
#include <mutex>
#include <random>
#include <unordered_set>

namespace gpurpc {

// Hands out random non-zero 64-bit ids, never the same one twice in its lifetime.
// Seeded from std::random_device so ids cannot be guessed from one another.
// Thread-safe.
class HandleIdGenerator {
 public:
  HandleIdGenerator() : engine_(Seed()) {}

  uint64_t Next() {
    std::lock_guard<std::mutex> lock(mu_);
    for (;;) {
      uint64_t id = engine_();
      if (id != 0 && issued_.insert(id).second) return id;
    }
  }

 private:
  static std::seed_seq::result_type Word(std::random_device& rd) { return rd(); }
  static std::mt19937_64 Seed() {
    std::random_device rd;
    std::seed_seq seq{Word(rd), Word(rd), Word(rd), Word(rd), Word(rd), Word(rd)};
    return std::mt19937_64(seq);
  }

  std::mutex mu_;
  std::mt19937_64 engine_;
  std::unordered_set<uint64_t> issued_;
};

}  // namespace gpurpc

#endif  // GPURPC_COMMON_HANDLE_IDS_H_
