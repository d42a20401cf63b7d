// Finds the module-scope variables of a PTX text: the fake backend answers Module::GetGlobal
// from them, and the module footprint (module_footprint.h) sums the `.global` ones. It is not
// a PTX parser: it reads only declarations of the `.global` and `.const` state spaces, e.g.
//   .global .align 4 .b8 name[16];
//   .visible .const .align 8 .u64 table[32] = {...};
//   .extern .global .v4 .f32 grid[2][8];
//   .global .u32 a = 1, b[4];
// Thread-compatible (pure functions).
#ifndef GPURPC_SERVER_WORKER_BACKEND_PTX_GLOBALS_H_
#define GPURPC_SERVER_WORKER_BACKEND_PTX_GLOBALS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace gpurpc::backend {

struct PtxGlobal {
  std::string name;
  // Element size (vector width included) times the element count of every dimension.
  uint64_t size_bytes = 0;
};

// One declarator of a `.global` or `.const` declaration, as written.
struct PtxVariable {
  enum class Space { kGlobal, kConst };
  Space space = Space::kGlobal;
  // True inside a function body (the fake ignores these; the footprint counts them).
  bool in_function = false;
  bool is_extern = false;
  // A `.texref`, `.samplerref` or `.surfref`: an opaque handle, counted as 8 bytes.
  bool is_handle = false;
  // `name[]` without an initializer: size_bytes is 0 for `.extern` (storage defined
  // elsewhere), nullopt otherwise.
  bool unsized = false;
  // Empty when the declarator could not be read.
  std::string name;
  // Element size times element count; nullopt when it cannot be read: an unknown type, a
  // malformed or non-numeric extent, more than 2^48 bytes, or an unsized array without an
  // initializer. Readers that must not under-count treat nullopt as "unbounded".
  std::optional<uint64_t> size_bytes;
  // The `.align` operand; 0 when none was given (or it could not be read: then
  // size_bytes is nullopt too).
  uint64_t align_bytes = 0;
};

// True when `image` is text: no NUL byte before its trailing NULs (NVRTC terminates PTX with
// one). Cubins and fatbins are binary and always contain NULs.
bool LooksLikePtxText(absl::string_view image);

// Every `.global` and `.const` declarator in `ptx` (module scope and function bodies), in
// order, duplicates included. `ptx` is read as the driver reads it: up to its first NUL.
std::vector<PtxVariable> ParsePtxVariables(absl::string_view ptx);

// The `.global` and `.const` variables declared at module scope in `ptx`, in declaration
// order, each name once (the first declaration wins). Declarations whose type or size cannot
// be read are skipped rather than rejected: the fake checks a module's structure
// (fake/fake_module_image.h), not its declarations. Initializers are ignored except to size
// an unsized array (`name[] = {1, 2, 3}`).
std::vector<PtxGlobal> ParsePtxGlobals(absl::string_view ptx);

}  // namespace gpurpc::backend

#endif  // GPURPC_SERVER_WORKER_BACKEND_PTX_GLOBALS_H_
