// What the fake backend reads from a module image before it "loads" it: the same structural
// checks that make the CUDA backend (or its driver) refuse an image, and the kernels and
// globals the image declares, since the fake runs no device code and can only hand out the
// host kernels that an image names.
//
// Accepted:
// - PTX text, as NVRTC emits it (for compute_75, the fake's CompileTarget) or as written by
//   hand: ASCII, starting with `.version` and `.target`, balanced braces, parentheses and
//   brackets, terminated comments and strings, only directives at module scope, and every
//   `.entry`/`.func` header well formed (a parameter list of `.param` declarations with known
//   types). The body of a function is not read beyond its balance: the fake compiles nothing.
// - cubins: a 64-bit little-endian ELF for EM_CUDA that ModuleFootprintBytes accepts, whose
//   symbol tables and their string tables lie within the image.
// - fatbins that ModuleFootprintBytes accepts (uncompressed), whose every PTX and cubin entry
//   passes the checks above and that hold at least one of them. The fake takes its first
//   PTX entry, or its first cubin when it has no PTX (a GPU would take the cubin of its
//   architecture: the fake has none).
// Everything else is INVALID_ARGUMENT, CUDA_ERROR_INVALID_PTX or CUDA_ERROR_INVALID_IMAGE
// style, naming what was wrong (with a line number for PTX).
//
// No CUDA headers here: plain byte reading. Pure functions, thread-compatible.
#ifndef GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_MODULE_IMAGE_H_
#define GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_MODULE_IMAGE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/backend/ptx_globals.h"

namespace gpurpc::backend::fake {

// A kernel (a PTX `.entry` with a body, or a function symbol of a cubin) the image defines.
struct DeclaredKernel {
  std::string name;
  // Laid out as cuFuncGetParamInfo reports it: each parameter at an offset aligned to its
  // `.align` (or its size). nullopt for a cubin kernel, whose layout the fake does not read.
  std::optional<std::vector<ParamInfo>> params;
};

struct FakeModuleImage {
  // The format of the image as received.
  ImageFormat format = ImageFormat::kPtx;
  // Of the PTX or cubin the fake takes (for a fatbin, the entry it picks), in order.
  std::vector<DeclaredKernel> kernels;
  // Module-scope globals of that PTX (ParsePtxGlobals); none for a cubin.
  std::vector<PtxGlobal> globals;
  // PTX only: the kernels and functions it defines (with a body), and the functions it only
  // declares (`.extern .func f(...);`), which a link must find in another input.
  std::vector<std::string> defined_functions;
  std::vector<std::string> external_functions;
  // ModuleFootprintBytes of the whole image.
  uint64_t device_memory_bytes = 0;
};

// Checks `image` as described above. `call` names the driver call in error messages.
absl::StatusOr<FakeModuleImage> ReadFakeModuleImage(absl::Span<const uint8_t> image,
                                                    absl::string_view call);

// The PTX checks alone, on text without NULs: the kernels `ptx` defines, or
// INVALID_ARGUMENT with "line N: what is wrong".
absl::StatusOr<std::vector<DeclaredKernel>> CheckPtxText(absl::string_view ptx);

// The structure of an ar archive (a LinkInputType::kLibrary input): the "!<arch>\n"
// magic, then at least one member whose 60-byte header is well formed and whose data lies
// within the archive. INVALID_ARGUMENT saying what is wrong otherwise. The members are not
// read (libcudadevrt.a holds compressed fatbins the fake cannot look into).
absl::Status CheckArchive(absl::Span<const uint8_t> archive);

}  // namespace gpurpc::backend::fake

#endif  // GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_MODULE_IMAGE_H_
