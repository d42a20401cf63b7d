// Standard device libraries of the server's CUDA toolkit that ModuleService.LinkModule links
// by name (PyCUDA's DynamicModule.add_stdlib). Only "cudadevrt", the device runtime
// (libcudadevrt.a), which kernels that launch kernels (dynamic parallelism) need.
//
// Where it is found, first hit wins:
//   1. $GPURPC_CUDADEVRT, the operator's override: the file itself or the folder holding
//      libcudadevrt.a (the worker inherits the daemon's environment). When it is set, it is
//      the only place looked at;
//   2. beside the toolkit whose headers the compiler uses (`cuda_include_dir`'s parent):
//      lib64, lib, targets/x86_64-linux/lib, targets/sbsa-linux/lib;
//   3. the same folders under /usr/local/cuda, then /usr/lib/x86_64-linux-gnu and
//      /usr/lib/aarch64-linux-gnu (Debian's nvidia-cuda-toolkit).
// No CUDA headers here. Thread-safe (reads the environment and the file system only).
#ifndef GPURPC_SERVER_WORKER_COMPILER_CUDA_LIBRARIES_H_
#define GPURPC_SERVER_WORKER_COMPILER_CUDA_LIBRARIES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gpurpc::compiler {

// The environment variable of the override.
inline constexpr char kCudadevrtEnv[] = "GPURPC_CUDADEVRT";
// The largest library file read.
inline constexpr uint64_t kMaxStandardLibraryBytes = 64ull << 20;

// The paths FindStandardLibrary tries for `name`'s file, in order (the override first).
std::vector<std::string> StandardLibraryCandidates(absl::string_view file_name,
                                                   absl::string_view cuda_include_dir);

// The contents of standard library `name`. INVALID_ARGUMENT for a name that is not a
// standard library (naming it and the known ones); FAILED_PRECONDITION when it is not
// installed (naming every path tried and the override variable), or is larger than
// kMaxStandardLibraryBytes; INTERNAL when it cannot be read.
absl::StatusOr<std::string> ReadStandardLibrary(absl::string_view name,
                                                absl::string_view cuda_include_dir);

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_CUDA_LIBRARIES_H_
