#include "server/worker/backend/cuda/module_image.h"

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "server/worker/backend/module_footprint.h"

namespace gpurpc::backend::cuda {

const char* ModuleImageKindName(ModuleImageKind kind) {
  switch (kind) {
    case ModuleImageKind::kPtx:
      return "PTX";
    case ModuleImageKind::kCubin:
      return "cubin";
    case ModuleImageKind::kFatbin:
      return "fatbin";
  }
  return "unknown";
}

absl::StatusOr<ModuleImage> ModuleImage::Prepare(absl::Span<const uint8_t> image) {
  if (image.empty()) return absl::InvalidArgumentError("empty module image");
  const uint8_t* bytes = image.data();
  const size_t size = image.size();

  ModuleImage result;
  result.size_bytes_ = size;
  switch (DetectImageFormat(image)) {
    case ImageFormat::kCubin:
      result.kind_ = ModuleImageKind::kCubin;
      if (absl::Status status = ValidateCubin(image); !status.ok()) return status;
      break;
    case ImageFormat::kFatbin:
      result.kind_ = ModuleImageKind::kFatbin;
      if (absl::Status status = ValidateFatbin(image); !status.ok()) return status;
      break;
    case ImageFormat::kPtx:
      result.kind_ = ModuleImageKind::kPtx;
      break;
  }

  const bool needs_nul = result.kind_ == ModuleImageKind::kPtx && bytes[size - 1] != 0;
  const bool misaligned = result.kind_ != ModuleImageKind::kPtx &&
                          reinterpret_cast<uintptr_t>(bytes) % alignof(uint64_t) != 0;
  if (needs_nul || misaligned) {
    // Zero-filled, so a copied PTX image always ends in at least one NUL.
    result.storage_.assign(size / sizeof(uint64_t) + 1, 0);
    std::memcpy(result.storage_.data(), bytes, size);
  } else {
    result.borrowed_ = bytes;
  }
  return result;
}

}  // namespace gpurpc::backend::cuda
