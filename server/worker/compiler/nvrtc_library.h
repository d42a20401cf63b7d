// NVRTC entry points resolved with dlopen at run time, so that the daemon starts (and
// reports UNAVAILABLE for compiles) on machines without the CUDA toolkit. Internal to the
// compiler: the only file outside this folder that may see nvrtc.h is the CUDA backend.
#ifndef GPURPC_SERVER_WORKER_COMPILER_NVRTC_LIBRARY_H_
#define GPURPC_SERVER_WORKER_COMPILER_NVRTC_LIBRARY_H_

#include <nvrtc.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace gpurpc::compiler {

// The resolved functions. Immutable after Load(); safe to share between threads (NVRTC
// itself is thread-safe as long as each program is used by one thread at a time).
struct NvrtcLibrary {
  // Tries, in order: "libnvrtc.so.13" (the loader's search path),
  // "<cuda_include_dir>/../lib64/libnvrtc.so.13", "/usr/local/cuda/lib64/libnvrtc.so.13",
  // then "libnvrtc.so". UNAVAILABLE, naming every attempt and its dlerror(), when none
  // loads or a required symbol is missing.
  static absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> Load(
      const std::string& cuda_include_dir);
  // Loads exactly `path` (the compile helper loads the file its worker resolved).
  static absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> LoadFile(const std::string& path);

  // Name of an nvrtcResult ("NVRTC_ERROR_INVALID_OPTION"), for messages.
  std::string ErrorName(nvrtcResult result) const;

  std::string path;  // the file that was loaded, as the dynamic loader found it (absolute)
  int major = 0;
  int minor = 0;
  // Distinguishes builds that report the same major.minor (patch releases change the
  // generated code too): "<major>.<minor>/<size of the library file in bytes>".
  std::string build_identity;

  decltype(&::nvrtcGetErrorString) GetErrorString = nullptr;
  decltype(&::nvrtcVersion) Version = nullptr;
  decltype(&::nvrtcCreateProgram) CreateProgram = nullptr;
  decltype(&::nvrtcDestroyProgram) DestroyProgram = nullptr;
  decltype(&::nvrtcAddNameExpression) AddNameExpression = nullptr;
  decltype(&::nvrtcCompileProgram) CompileProgram = nullptr;
  decltype(&::nvrtcGetProgramLogSize) GetProgramLogSize = nullptr;
  decltype(&::nvrtcGetProgramLog) GetProgramLog = nullptr;
  decltype(&::nvrtcGetCUBINSize) GetCUBINSize = nullptr;
  decltype(&::nvrtcGetCUBIN) GetCUBIN = nullptr;
  decltype(&::nvrtcGetPTXSize) GetPTXSize = nullptr;
  decltype(&::nvrtcGetPTX) GetPTX = nullptr;
  decltype(&::nvrtcGetLoweredName) GetLoweredName = nullptr;
};

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_NVRTC_LIBRARY_H_
