// Finds the module-scope variables of a PTX text, so that the fake backend can answer
// Module::GetGlobal for modules that NVRTC compiled to PTX. It is not a PTX parser: it reads
// only declarations of the `.global` and `.const` state spaces outside function bodies, e.g.
//   .global .align 4 .b8 name[16];
//   .visible .const .align 8 .u64 table[32] = {...};
//   .extern .global .v4 .f32 grid[2][8];
// Thread-compatible (pure functions).
#ifndef GPURPC_SERVER_WORKER_BACKEND_FAKE_PTX_GLOBALS_H_
#define GPURPC_SERVER_WORKER_BACKEND_FAKE_PTX_GLOBALS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace gpurpc::backend::fake {

struct PtxGlobal {
  std::string name;
  // Element size (vector width included) times the element count of every dimension.
  uint64_t size_bytes = 0;
};

// True when `image` is text: no NUL byte before its trailing NULs (NVRTC terminates PTX with
// one). Cubins and fatbins are binary and always contain NULs.
bool LooksLikePtxText(absl::string_view image);

// The `.global` and `.const` variables declared at module scope in `ptx`, in declaration
// order, each name once (the first declaration wins). Declarations whose type or size cannot
// be read are skipped rather than rejected, because the fake accepts any image. Initializers
// are ignored except to size an unsized array (`name[] = {1, 2, 3}`).
std::vector<PtxGlobal> ParsePtxGlobals(absl::string_view ptx);

}  // namespace gpurpc::backend::fake

#endif  // GPURPC_SERVER_WORKER_BACKEND_FAKE_PTX_GLOBALS_H_
