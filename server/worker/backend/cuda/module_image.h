// Prepares a module image (PTX, cubin or fatbin) for cuModuleLoadDataEx.
//
// cuModuleLoadDataEx takes no size: it reads PTX up to a NUL and trusts the headers of a
// binary image. So PTX gets a trailing NUL when it lacks one, and the headers of an ELF
// (cubin) or fatbin image are checked against the bytes actually received, so that a
// truncated or hostile image is rejected here instead of making the driver read past the
// buffer. Binary images are also copied when they are not 8-byte aligned.
//
// No CUDA headers here: this is plain byte checking (module_footprint.h's checks).
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_IMAGE_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_IMAGE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gpurpc::backend::cuda {

enum class ModuleImageKind { kPtx, kCubin, kFatbin };

const char* ModuleImageKindName(ModuleImageKind kind);

// An image ready for the driver. It may point into the span it was made from, which must
// then outlive it. Movable; data() stays valid across moves.
class ModuleImage {
 public:
  // INVALID_ARGUMENT for an empty image or a binary image whose headers point outside it.
  // Anything that is neither ELF nor fatbin is taken to be PTX text (the driver judges it).
  static absl::StatusOr<ModuleImage> Prepare(absl::Span<const uint8_t> image);

  const void* data() const {
    return storage_.empty() ? static_cast<const void*>(borrowed_)
                            : static_cast<const void*>(storage_.data());
  }
  ModuleImageKind kind() const { return kind_; }
  // The size received (without a NUL added here).
  size_t size_bytes() const { return size_bytes_; }
  // True when the image was copied (to add a NUL or to align it).
  bool copied() const { return !storage_.empty(); }

 private:
  ModuleImage() = default;

  const uint8_t* borrowed_ = nullptr;
  std::vector<uint64_t> storage_;  // uint64_t: 8-byte alignment for ELF headers.
  ModuleImageKind kind_ = ModuleImageKind::kPtx;
  size_t size_bytes_ = 0;
};

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_IMAGE_H_
