// Waiting in tests for something that must happen (a reclaim, a signal's effect, a worker's
// exit): a poll with a deadline, never a fixed sleep and never a spin without bound. The
// bound is generous, for a loaded two-core machine; it is never a measure of speed.
#ifndef GPURPC_TESTS_TESTING_EVENTUALLY_H_
#define GPURPC_TESTS_TESTING_EVENTUALLY_H_

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gpurpc::testing {

inline constexpr absl::Duration kEventually = absl::Seconds(30);

// Polls `predicate` every `interval` until it returns true (then true) or `limit` has passed
// (then false, after one last try).
template <typename Predicate>
bool Eventually(Predicate&& predicate, absl::Duration limit = kEventually,
                absl::Duration interval = absl::Milliseconds(20)) {
  const absl::Time deadline = absl::Now() + limit;
  for (;;) {
    if (predicate()) return true;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(interval);
  }
}

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_EVENTUALLY_H_
