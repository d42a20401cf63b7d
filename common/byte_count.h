// Byte counts in error messages, one wording for the whole server.
#ifndef GPURPC_COMMON_BYTE_COUNT_H_
#define GPURPC_COMMON_BYTE_COUNT_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace gpurpc {

// "512 bytes" below 1 KiB; above, the exact count first (what a user compares with what they
// asked for) and a readable size after it: "67108864 bytes (64 MiB)",
// "1610612736 bytes (1.5 GiB)".
inline std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrFormat("%d bytes", bytes);
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 6) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%d bytes (%.4g %s)", bytes, value, kUnits[unit]);
}

}  // namespace gpurpc

#endif  // GPURPC_COMMON_BYTE_COUNT_H_
