// main() of the unit-test binaries that compile with NVRTC. Compiles run in a helper process
// started from /proc/self/exe with --internal-compile-helper (compile_helper.h), which is
// the test binary itself here: that flag runs the helper, anything else runs the tests.
// Linking this file replaces gtest_main's main().
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/compiler/compile_helper.h"

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], gpurpc::compiler::kCompileHelperFlag) == 0) {
    return gpurpc::compiler::CompileHelperMain();
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
