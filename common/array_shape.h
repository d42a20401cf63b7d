// CUDA array shapes (MemoryService.Allocate with an ArrayDescriptor, memory_service.proto):
// the checks and the device-memory charge that the front end (to reserve the tenant's quota
// before the worker creates anything) and the worker (to refuse and to report) both apply.
// Plain integers, so that no side needs the other's types.
#ifndef GPURPC_COMMON_ARRAY_SHAPE_H_
#define GPURPC_COMMON_ARRAY_SHAPE_H_

#include <algorithm>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"

namespace gpurpc {

// Each of width, height and depth is at most this (devices allow less; the driver refuses
// beyond the device's maxima).
inline constexpr uint64_t kMaxArrayExtent = uint64_t{1} << 20;
// CUDA_ARRAY3D_LAYERED | SURFACE_LDST | CUBEMAP | TEXTURE_GATHER.
inline constexpr uint32_t kArrayFlagsAllowed = 0x1 | 0x2 | 0x4 | 0x8;
// Copy3DCommand's largest linear pitch and slice height (the driver's maximum pitch).
inline constexpr uint64_t kMaxCopy3DPitchBytes = (uint64_t{1} << 31) - 1;
// The charge's padding, after the driver's tiled (block-linear) layout as measured on the
// H200 (array_test's TheChargeCoversWhatTheDeviceUses): rows to 512 bytes; a 2D slice's
// rows to a power of two from 32 up to 256, then to a multiple of 256 (300 rows took 512);
// a 3D array's slices likewise, to a power of two up to 32, then a multiple of 32. Layers
// of a layered array are slices of their own and are not padded.
inline constexpr uint64_t kArrayRowAlignBytes = 512;
inline constexpr uint64_t kArrayMinRows = 32;
inline constexpr uint64_t kArrayRowBlock = 256;
inline constexpr uint64_t kArraySliceBlock = 32;

// `n` (>= 1) rounded up to a power of two while below `block`, else to a multiple of it.
inline uint64_t PadToBlock(uint64_t n, uint64_t block) {
  if (n >= block) return (n + block - 1) / block * block;
  uint64_t padded = 1;
  while (padded < n) padded <<= 1;
  return padded;
}

// Bytes of one element of `format` (a CUarray_format value) with `channels` channels;
// INVALID_ARGUMENT naming the bad field.
inline absl::StatusOr<uint32_t> ArrayElementBytes(int format, uint32_t channels) {
  uint32_t bytes = 0;
  switch (format) {
    case 1:  // UNSIGNED_INT8
    case 8:  // SIGNED_INT8
      bytes = 1;
      break;
    case 2:   // UNSIGNED_INT16
    case 9:   // SIGNED_INT16
    case 16:  // HALF
      bytes = 2;
      break;
    case 3:   // UNSIGNED_INT32
    case 10:  // SIGNED_INT32
    case 32:  // FLOAT
      bytes = 4;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "array format %d is not an ArrayFormat (1, 2, 3 = UNSIGNED_INT8/16/32, 8, 9, 10 = "
          "SIGNED_INT8/16/32, 16 = HALF, 32 = FLOAT)",
          format));
  }
  if (channels != 1 && channels != 2 && channels != 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("array num_channels must be 1, 2 or 4, got %d", channels));
  }
  return bytes * channels;
}

// Checks a descriptor and returns the device memory it is charged: rows of width * element
// bytes rounded up to kArrayRowAlignBytes, times the height padded as above (1 for a 1D
// array), times the depth padded as above (1 for 1D and 2D). At most 2^20 * 2^9 * 2^20 * 2^20 bytes
// in theory; the sums below cannot overflow because each factor is bounded first.
inline absl::StatusOr<uint64_t> ArrayChargeBytes(uint64_t width, uint64_t height, uint64_t depth,
                                                 int format, uint32_t channels, uint32_t flags) {
  absl::StatusOr<uint32_t> element = ArrayElementBytes(format, channels);
  if (!element.ok()) return element.status();
  if (width == 0 || width > kMaxArrayExtent || height > kMaxArrayExtent ||
      depth > kMaxArrayExtent) {
    return absl::InvalidArgumentError(
        absl::StrFormat("array shape %dx%dx%d: width must be 1..%d, height and depth 0..%d", width,
                        height, depth, kMaxArrayExtent, kMaxArrayExtent));
  }
  if ((flags & ~kArrayFlagsAllowed) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("array flags 0x%x: only LAYERED (1), SURFACE_LDST (2), CUBEMAP (4) and "
                        "TEXTURE_GATHER (8) are served",
                        flags));
  }
  // The driver's rules for the shapes the flags make (cuArray3DCreate), checked here so that
  // every backend refuses the same.
  const bool layered = (flags & 0x1) != 0;
  const bool cubemap = (flags & 0x4) != 0;
  if (depth > 0 && height == 0 && !layered) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "array shape %dx%dx%d: a 3D array needs a height (only a LAYERED 1D array has depth "
        "without height)",
        width, height, depth));
  }
  if (layered && depth == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("array shape %dx%dx%d: a LAYERED array needs depth >= 1 (its layers)",
                        width, height, depth));
  }
  if (cubemap && (width != height || (layered ? depth % 6 != 0 : depth != 6))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "array shape %dx%dx%d: a CUBEMAP array is square (width == height) with depth 6, or a "
        "multiple of 6 when LAYERED",
        width, height, depth));
  }
  if ((flags & 0x8) != 0 && (height == 0 || depth != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "array shape %dx%dx%d: TEXTURE_GATHER is for 2D arrays only", width, height, depth));
  }
  const uint64_t row =
      (width * *element + kArrayRowAlignBytes - 1) / kArrayRowAlignBytes * kArrayRowAlignBytes;
  // A 1D array (and each layer of a 1D layered one) is one row; 2D and 3D slices are tiled.
  const uint64_t rows =
      height == 0 ? 1 : std::max(kArrayMinRows, PadToBlock(height, kArrayRowBlock));
  const uint64_t slices = depth == 0 ? 1 : (layered ? depth : PadToBlock(depth, kArraySliceBlock));
  // row <= 2^20 * 16 = 2^24, rows <= 2^20 + 256: row * rows < 2^45; times slices (<= 2^20 +
  // 32) can reach 2^65, so bound it.
  const uint64_t slice_bytes = row * rows;
  if (slices > (uint64_t{1} << 62) / slice_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("array shape %dx%dx%d is larger than any device", width, height, depth));
  }
  return slice_bytes * slices;
}

}  // namespace gpurpc

#endif  // GPURPC_COMMON_ARRAY_SHAPE_H_
