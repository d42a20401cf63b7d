#include "server/worker/compiler/cuda_libraries.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace gpurpc::compiler {
namespace {

constexpr absl::string_view kCudadevrt = "cudadevrt";

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void AddToolkitFolders(absl::string_view root, const std::string& file_name,
                       std::vector<std::string>* out) {
  for (absl::string_view lib :
       {"lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"}) {
    out->push_back(absl::StrCat(root, "/", lib, "/", file_name));
  }
}

}  // namespace

std::vector<std::string> StandardLibraryCandidates(absl::string_view file_name,
                                                   absl::string_view cuda_include_dir) {
  const std::string file(file_name);
  std::vector<std::string> candidates;
  if (const char* override_path = std::getenv(kCudadevrtEnv);
      override_path != nullptr && override_path[0] != '\0') {
    const std::string path(override_path);
    // The operator's word is final: no fallback that would hide a wrong path.
    candidates.push_back(IsDirectory(path) ? absl::StrCat(path, "/", file) : path);
    return candidates;
  }
  absl::string_view include_dir = cuda_include_dir;
  while (absl::ConsumeSuffix(&include_dir, "/")) {
  }
  if (absl::ConsumeSuffix(&include_dir, "/include") && !include_dir.empty()) {
    AddToolkitFolders(include_dir, file, &candidates);
  }
  AddToolkitFolders("/usr/local/cuda", file, &candidates);
  candidates.push_back("/usr/lib/x86_64-linux-gnu/" + file);
  candidates.push_back("/usr/lib/aarch64-linux-gnu/" + file);
  return candidates;
}

absl::StatusOr<std::string> ReadStandardLibrary(absl::string_view name,
                                                absl::string_view cuda_include_dir) {
  if (name != kCudadevrt) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown standard library '", absl::CHexEscape(name.substr(0, 256)),
                     "'; the server links only 'cudadevrt' (the device runtime) by name"));
  }
  const std::string file_name = absl::StrCat("lib", name, ".a");
  const std::vector<std::string> candidates =
      StandardLibraryCandidates(file_name, cuda_include_dir);
  for (const std::string& path : candidates) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (static_cast<uint64_t>(st.st_size) > kMaxStandardLibraryBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("standard library '", name, "' at ", path, " is ", st.st_size,
                       " bytes, more than the ", kMaxStandardLibraryBytes, " the server reads"));
    }
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      return absl::InternalError(absl::StrCat("cannot read standard library ", path));
    }
    if (bytes.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("standard library '", name, "' at ", path, " is empty"));
    }
    return bytes;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("standard library '", name, "' (", file_name,
                   ") is not installed on this server; tried ", absl::StrJoin(candidates, ", "),
                   ". The operator can set ", kCudadevrtEnv, " to the file or its folder"));
}

}  // namespace gpurpc::compiler
