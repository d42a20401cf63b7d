#include "server/worker/compiler/nvrtc_library.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpurpc::compiler {
namespace {

// Resolves `name` into `*fn`; appends to `missing` when absent.
template <typename Fn>
void Resolve(void* handle, const char* name, Fn* fn, std::vector<std::string>* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*fn == nullptr) missing->push_back(name);
}

absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> LoadFirst(
    const std::vector<std::string>& candidates) {
  std::vector<std::string> attempts;
  void* handle = nullptr;
  std::string loaded_path;
  for (const std::string& candidate : candidates) {
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      loaded_path = candidate;
      break;
    }
    const char* error = dlerror();
    attempts.push_back(absl::StrCat(candidate, " (", error ? error : "unknown error", ")"));
  }
  if (handle == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("NVRTC could not be loaded; tried: ", absl::StrJoin(attempts, "; ")));
  }

  // The handle is deliberately never dlclose'd: NVRTC keeps internal state and threads
  // alive for the life of the process, and unloading it under them is not supported.
  auto library = std::make_unique<NvrtcLibrary>();
  library->path = loaded_path;
  std::vector<std::string> missing;
  Resolve(handle, "nvrtcGetErrorString", &library->GetErrorString, &missing);
  Resolve(handle, "nvrtcVersion", &library->Version, &missing);
  Resolve(handle, "nvrtcCreateProgram", &library->CreateProgram, &missing);
  Resolve(handle, "nvrtcDestroyProgram", &library->DestroyProgram, &missing);
  Resolve(handle, "nvrtcAddNameExpression", &library->AddNameExpression, &missing);
  Resolve(handle, "nvrtcCompileProgram", &library->CompileProgram, &missing);
  Resolve(handle, "nvrtcGetProgramLogSize", &library->GetProgramLogSize, &missing);
  Resolve(handle, "nvrtcGetProgramLog", &library->GetProgramLog, &missing);
  Resolve(handle, "nvrtcGetCUBINSize", &library->GetCUBINSize, &missing);
  Resolve(handle, "nvrtcGetCUBIN", &library->GetCUBIN, &missing);
  Resolve(handle, "nvrtcGetPTXSize", &library->GetPTXSize, &missing);
  Resolve(handle, "nvrtcGetPTX", &library->GetPTX, &missing);
  Resolve(handle, "nvrtcGetLoweredName", &library->GetLoweredName, &missing);
  if (!missing.empty()) {
    return absl::UnavailableError(
        absl::StrCat("NVRTC loaded from ", loaded_path, " lacks: ", absl::StrJoin(missing, ", ")));
  }
  const nvrtcResult result = library->Version(&library->major, &library->minor);
  if (result != NVRTC_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("nvrtcVersion failed in ", loaded_path, ": ", library->ErrorName(result)));
  }
  // The file behind the handle, wherever the loader's search found it.
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(library->Version), &info) != 0 && info.dli_fname != nullptr) {
    library->path = info.dli_fname;
  }
  // Absolute and free of symlinks: the compile helper loads this very file, and its
  // sandbox names the folder.
  if (char resolved[PATH_MAX]; realpath(library->path.c_str(), resolved) != nullptr) {
    library->path = resolved;
  }
  library->build_identity = absl::StrCat(library->major, ".", library->minor);
  struct stat st;
  if (stat(library->path.c_str(), &st) == 0) {
    absl::StrAppend(&library->build_identity, "/", st.st_size);
  }
  return std::unique_ptr<const NvrtcLibrary>(std::move(library));
}

}  // namespace

absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> NvrtcLibrary::Load(
    const std::string& cuda_include_dir) {
  // The versioned name first: the unversioned symlink only exists with the toolkit's
  // development files, and another major version would have a different ABI.
  std::vector<std::string> candidates = {"libnvrtc.so.13"};
  if (!cuda_include_dir.empty()) {
    candidates.emplace_back(cuda_include_dir + "/../lib64/libnvrtc.so.13");
  }
  candidates.emplace_back("/usr/local/cuda/lib64/libnvrtc.so.13");
  candidates.emplace_back("libnvrtc.so");
  return LoadFirst(candidates);
}

absl::StatusOr<std::unique_ptr<const NvrtcLibrary>> NvrtcLibrary::LoadFile(
    const std::string& path) {
  return LoadFirst({path});
}

std::string NvrtcLibrary::ErrorName(nvrtcResult result) const {
  const char* name = GetErrorString != nullptr ? GetErrorString(result) : nullptr;
  return name != nullptr ? std::string(name)
                         : absl::StrCat("NVRTC error ", static_cast<int>(result));
}

}  // namespace gpurpc::compiler
