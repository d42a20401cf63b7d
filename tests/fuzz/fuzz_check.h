// Invariant checks for the fuzz targets. A failed check prints what was expected and what
// happened, then aborts: libFuzzer reports the abort as a crash and saves the input, and
// replaying that file (`fuzz_<name> FILE`) reproduces it.
#ifndef GPURPC_TESTS_FUZZ_FUZZ_CHECK_H_
#define GPURPC_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// FUZZ_CHECK(condition, pieces...): the pieces (anything with an operator<<, absl::Status
// included) say what the invariant is and what was seen.
#define FUZZ_CHECK(condition, ...)                                                             \
  do {                                                                                         \
    if (!(condition)) {                                                                        \
      std::fprintf(stderr, "\nFUZZ INVARIANT FAILED at %s:%d: %s\n  %s\n", __FILE__, __LINE__, \
                   #condition, ::gpurpc::fuzz::Message(__VA_ARGS__).c_str());                  \
      std::abort();                                                                            \
    }                                                                                          \
  } while (false)

namespace gpurpc::fuzz {

template <typename... Pieces>
std::string Message(const Pieces&... pieces) {
  std::ostringstream out;
  (out << ... << pieces);
  return out.str();
}

// `text` quoted for a message, with unprintable bytes escaped and long text cut.
inline std::string Quote(absl::string_view text, size_t max_bytes = 400) {
  std::string out = absl::StrCat("'", absl::CHexEscape(text.substr(0, max_bytes)), "'");
  if (text.size() > max_bytes) absl::StrAppend(&out, "... (", text.size(), " bytes)");
  return out;
}

}  // namespace gpurpc::fuzz

#endif  // GPURPC_TESTS_FUZZ_FUZZ_CHECK_H_
