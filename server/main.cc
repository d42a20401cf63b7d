// gpurpcd: one binary for three process kinds. Started by a user it is the front end;
// started by the front end with --internal-worker it is a session's worker; started by a
// worker with --internal-compile-helper it runs one NVRTC compile in a sandbox.
#include <malloc.h>

#include <iostream>

#include "server/frontend/frontend_main.h"
#include "server/options.h"
#include "server/worker/compiler/compile_helper.h"
#include "server/worker/worker_main.h"

int main(int argc, char** argv) {
  // Bulk transfers allocate and free megabyte buffers all the time (gRPC's read buffers, the
  // chunks the worker sends). Above glibc's default mmap threshold each one is a fresh
  // mapping, faulted in page by page and unmapped again: keep buffers up to 8 MiB in the heap
  // instead, and let up to 32 MiB of freed heap wait for reuse before it goes back to the
  // kernel (measured on the fake backend: the page faults were a sixth of the front end's CPU
  // during a 1 GiB upload; the front end's RSS after many transfers is ~120 MiB instead of
  // ~30 MiB, well inside the soak check's tolerance).
  mallopt(M_MMAP_THRESHOLD, 8 << 20);
  mallopt(M_TRIM_THRESHOLD, 32 << 20);
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
  return gpurpc::frontend::FrontendMain(
      *options, [argc, argv]() { return gpurpc::ParseDaemonOptions(argc, argv); });
}
