// Runs the README's C++ example (readme_example.inc, cut out of README.md by CMakeLists.txt)
// against the daemon at $GPURPC_ADDRESS and checks y = 2 * x + y. Prints "consumer: ok".
#include <cstdio>
#include <vector>

#include "readme_example.inc"

int main() {
  constexpr size_t kN = 1000;
  std::vector<float> x(kN), y(kN);
  for (size_t i = 0; i < kN; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  const absl::Status status = Run(x, y);
  if (!status.ok()) {
    std::fprintf(stderr, "consumer: the README example failed: %s\n", status.ToString().c_str());
    return 1;
  }
  for (size_t i = 0; i < kN; ++i) {
    if (y[i] != 2.0f * static_cast<float>(i) + 1.0f) {
      std::fprintf(stderr, "consumer: y[%zu] = %g, expected %g\n", i, y[i], 2.0f * i + 1.0f);
      return 1;
    }
  }
  std::printf("consumer: ok (%zu elements of y = 2 * x + y through gpurpcd)\n", kN);
  return 0;
}
