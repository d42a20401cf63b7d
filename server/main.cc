// gpurpcd: one binary for three process kinds. Started by a user it is the front end;
// started by the front end with --internal-worker it is a session's worker; started by a
// worker with --internal-compile-helper it runs one NVRTC compile in a sandbox.
#include <iostream>

#include "server/frontend/frontend_main.h"
#include "server/options.h"
#include "server/worker/compiler/compile_helper.h"
#include "server/worker/worker_main.h"

int main(int argc, char** argv) {
  auto options = gpurpc::ParseDaemonOptions(argc, argv);
  if (!options.ok()) {
    std::cerr << "gpurpcd: " << options.status().message() << "\n";
    return 2;
  }
  if (options->help) {
    std::cout << gpurpc::DaemonUsage();
    return 0;
  }
  // Everything a helper needs comes over its socket (fd 3), from its worker.
  if (options->internal_compile_helper) return gpurpc::compiler::CompileHelperMain();
  if (options->internal_worker) return gpurpc::worker::WorkerMain(*options);
  return gpurpc::frontend::FrontendMain(*options);
}
