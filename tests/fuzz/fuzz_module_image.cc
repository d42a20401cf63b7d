// Fuzzes module image validation: every byte of a LoadModule request reaches these before a
// driver does. The input is the image itself, handed to
//   - backend::DetectImageFormat, ValidateCubin, ValidateFatbin and ModuleFootprintBytes
//     (server/worker/backend/module_footprint.h),
//   - the PTX readers ParsePtxVariables and ParsePtxGlobals (ptx_globals.h),
//   - the fake backend's Context::LoadModule, through the public backend.h interface, and
//     the module it returns (GetGlobal, GetFunction, device_memory_bytes).
// Invariants (beyond no crash, leak or undefined behaviour, and determinism):
//   - an empty image is refused; a non-empty PTX (anything that is not ELF or fatbin) always
//     has a footprint; an accepted cubin or fatbin passed its structural validation;
//   - a PTX footprint is read up to the first NUL, is at least every .global variable's
//     rounded size, and is UINT64_MAX when a .global variable's size cannot be read;
//   - ParsePtxGlobals names each variable once, none empty, each a module-scope declaration;
//   - the fake loads only images whose footprint can be read, and its module reports that
//     footprint; it has no kernel but built-in ones; it answers GetGlobal for each global of a
//     PTX image with its size, and NOT_FOUND for a name the image does not declare.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/backend/ptx_globals.h"
#include "tests/fuzz/fuzz_check.h"

namespace gpurpc::fuzz {
namespace {

using backend::ImageFormat;

constexpr uint64_t kUnbounded = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kMaxGlobalBytes = uint64_t{1} << 48;  // ptx_globals.h
// The fake device's memory: globals beyond it are refused as the driver would.
constexpr uint64_t kFakeMemoryBytes = 64ull << 20;
constexpr const char* kBuiltinKernels[] = {"multiply_them", "axpy_f32",   "fill_u32",
                                           "add_one_f32",   "copy_bytes", "fault_illegal_address",
                                           "spin_us"};

std::string Describe(const absl::StatusOr<uint64_t>& value) {
  return value.ok() ? absl::StrCat(*value) : value.status().ToString();
}

bool SameResult(const absl::StatusOr<uint64_t>& a, const absl::StatusOr<uint64_t>& b) {
  return a.ok() == b.ok() && (a.ok() ? *a == *b : a.status() == b.status());
}

uint64_t RoundUp(uint64_t value, uint64_t align) {
  if (align <= 1 || value % align == 0) return value;
  const uint64_t add = align - value % align;
  return value > kUnbounded - add ? kUnbounded : value + add;
}

void CheckFootprint(absl::Span<const uint8_t> image) {
  const ImageFormat format = backend::DetectImageFormat(image);
  FUZZ_CHECK(format == backend::DetectImageFormat(image), "format detection is not deterministic");
  const absl::Status cubin = backend::ValidateCubin(image);
  const absl::Status fatbin = backend::ValidateFatbin(image);
  const absl::StatusOr<uint64_t> footprint = backend::ModuleFootprintBytes(image);
  const absl::StatusOr<uint64_t> again = backend::ModuleFootprintBytes(image);
  FUZZ_CHECK(SameResult(footprint, again),
             "ModuleFootprintBytes is not deterministic: ", Describe(footprint), " then ",
             Describe(again));
  if (!footprint.ok()) {
    FUZZ_CHECK(footprint.status().code() == absl::StatusCode::kInvalidArgument,
               "a refused image must be INVALID_ARGUMENT: ", footprint.status().ToString());
  }
  if (image.empty()) {
    FUZZ_CHECK(!footprint.ok(), "an empty image has a footprint");
    return;
  }
  switch (format) {
    case ImageFormat::kCubin:
      if (footprint.ok()) FUZZ_CHECK(cubin.ok(), "a footprint for an invalid cubin: ", cubin);
      return;
    case ImageFormat::kFatbin:
      if (footprint.ok()) FUZZ_CHECK(fatbin.ok(), "a footprint for an invalid fatbin: ", fatbin);
      return;
    case ImageFormat::kPtx:
      break;
  }
  FUZZ_CHECK(footprint.ok(), "non-empty PTX without a footprint: ", footprint.status());
  const absl::string_view text(reinterpret_cast<const char*>(image.data()), image.size());
  // Read up to the first NUL, as the driver reads it.
  const size_t nul = text.find('\0');
  if (nul != absl::string_view::npos && nul > 0) {
    const absl::string_view head = text.substr(0, nul);
    const absl::StatusOr<uint64_t> of_head = backend::ModuleFootprintBytes(
        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(head.data()), head.size()));
    if (backend::DetectImageFormat(absl::Span<const uint8_t>(
            reinterpret_cast<const uint8_t*>(head.data()), head.size())) == ImageFormat::kPtx) {
      FUZZ_CHECK(SameResult(footprint, of_head),
                 "PTX bytes after the first NUL count: ", Describe(footprint), " with them, ",
                 Describe(of_head), " without");
    }
  }
  bool unreadable = false;
  for (const backend::PtxVariable& variable : backend::ParsePtxVariables(text)) {
    if (variable.size_bytes) {
      FUZZ_CHECK(*variable.size_bytes <= kMaxGlobalBytes, "variable '", variable.name, "' of ",
                 *variable.size_bytes, " bytes, over the 2^48 limit");
    }
    if (variable.space != backend::PtxVariable::Space::kGlobal) continue;
    if (variable.name.empty() || !variable.size_bytes) {
      unreadable = true;
      continue;
    }
    const uint64_t rounded = RoundUp(*variable.size_bytes, variable.align_bytes);
    FUZZ_CHECK(*footprint >= rounded, "footprint ", *footprint, " is less than the ", rounded,
               " bytes of .global '", variable.name, "'");
  }
  if (unreadable) {
    FUZZ_CHECK(*footprint == kUnbounded,
               "a .global whose size cannot be read, yet a bounded footprint of ", *footprint);
  }
}

std::vector<backend::PtxGlobal> CheckPtxGlobals(absl::string_view text) {
  std::vector<backend::PtxGlobal> globals = backend::ParsePtxGlobals(text);
  std::set<std::string> module_scope;
  for (const backend::PtxVariable& variable : backend::ParsePtxVariables(text)) {
    if (!variable.in_function) module_scope.insert(variable.name);
  }
  std::set<std::string> names;
  for (const backend::PtxGlobal& global : globals) {
    FUZZ_CHECK(!global.name.empty(), "ParsePtxGlobals returned an unnamed global");
    FUZZ_CHECK(names.insert(global.name).second, "ParsePtxGlobals named '", global.name, "' twice");
    FUZZ_CHECK(module_scope.count(global.name) == 1, "global '", global.name,
               "' is no module-scope declaration");
    FUZZ_CHECK(global.size_bytes <= kMaxGlobalBytes, "global '", global.name, "' of ",
               global.size_bytes, " bytes");
  }
  return globals;
}

// One context for every input (each has a stream thread): modules free their globals when
// they go, and loading faults nothing.
backend::Context& FakeContext() {
  static backend::Context* const context = [] {
    static backend::Backend* const fake = backend::MakeFakeBackend(kFakeMemoryBytes).release();
    absl::StatusOr<std::unique_ptr<backend::Context>> opened = fake->OpenContext(0);
    FUZZ_CHECK(opened.ok(), "the fake opens no context: ", opened.status());
    return opened->release();
  }();
  return *context;
}

void CheckFakeLoad(absl::Span<const uint8_t> image) {
  absl::StatusOr<std::unique_ptr<backend::Module>> module = FakeContext().LoadModule(image);
  if (image.empty()) {
    FUZZ_CHECK(!module.ok(), "the fake loaded an empty image");
  }
  if (!module.ok()) {
    const absl::StatusCode code = module.status().code();
    FUZZ_CHECK(
        code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kResourceExhausted,
        "LoadModule may refuse an image (INVALID_ARGUMENT) or run out of memory "
        "(RESOURCE_EXHAUSTED), nothing else: ",
        module.status());
    return;
  }
  const absl::StatusOr<uint64_t> footprint = backend::ModuleFootprintBytes(image);
  FUZZ_CHECK(footprint.ok(),
             "the fake loaded an image whose footprint cannot be read: ", footprint.status());
  FUZZ_CHECK((*module)->device_memory_bytes() == *footprint, "the module reports ",
             (*module)->device_memory_bytes(), " bytes of globals, ModuleFootprintBytes ",
             *footprint);
  for (const char* name : kBuiltinKernels) {
    absl::StatusOr<backend::Function*> function = (*module)->GetFunction(name);
    FUZZ_CHECK(function.ok() || function.status().code() == absl::StatusCode::kNotFound,
               "GetFunction(", name, "): ", function.status());
  }
  absl::StatusOr<backend::Function*> other = (*module)->GetFunction("not_a_builtin");
  FUZZ_CHECK(!other.ok() && other.status().code() == absl::StatusCode::kNotFound,
             "the fake has a kernel that is no built-in");
  const absl::string_view text(reinterpret_cast<const char*>(image.data()), image.size());
  if (!backend::LooksLikePtxText(text)) return;
  std::set<std::string> names;
  for (const backend::PtxGlobal& global : CheckPtxGlobals(text)) {
    names.insert(global.name);
    absl::StatusOr<backend::Module::Global> found = (*module)->GetGlobal(global.name);
    FUZZ_CHECK(found.ok(), "global '", global.name,
               "' of the PTX is not in the module: ", found.status());
    FUZZ_CHECK(found->size_bytes == global.size_bytes, "global '", global.name, "' has ",
               found->size_bytes, " bytes in the module, ", global.size_bytes, " in the PTX");
  }
  // No PTX identifier has a blank.
  constexpr char kUndeclared[] = "fuzz undeclared";
  if (names.count(kUndeclared) == 0) {
    absl::StatusOr<backend::Module::Global> missing = (*module)->GetGlobal(kUndeclared);
    FUZZ_CHECK(!missing.ok() && missing.status().code() == absl::StatusCode::kNotFound,
               "GetGlobal of an undeclared name: ",
               missing.ok() ? std::string("found") : missing.status().ToString());
  }
}

}  // namespace
}  // namespace gpurpc::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const uint8_t> image(data, size);
  gpurpc::fuzz::CheckFootprint(image);
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  gpurpc::fuzz::CheckPtxGlobals(text);
  gpurpc::fuzz::CheckFakeLoad(image);
  return 0;
}
