// The fake backend's built-in kernels (fake_kernels.h) compiled on a session of a real daemon,
// for tests that launch them through the C++ client (on the fake backend, or on a GPU where
// the same source runs as real CUDA).
#ifndef GPURPC_TESTS_TESTING_FAKE_KERNELS_MODULE_H_
#define GPURPC_TESTS_TESTING_FAKE_KERNELS_MODULE_H_

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gpurpc/client.h"
#include "tests/testing/fake_kernels.h"

namespace gpurpc::testing {

// kFakeKernelsSource compiled and loaded on `session`; INTERNAL with NVRTC's log when it
// does not compile.
inline absl::StatusOr<Module> CompileFakeKernels(const Session& session) {
  CompileOptions options;
  options.source = kFakeKernelsSource;
  absl::StatusOr<CompileResult> result = session.Compile(options);
  if (!result.ok()) return result.status();
  if (!result->success()) {
    return absl::InternalError(absl::StrCat("the fake kernels do not compile: ", result->log()));
  }
  return std::move(result->module);
}

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_FAKE_KERNELS_MODULE_H_
