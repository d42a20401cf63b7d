// What a module image costs in device memory, read from its bytes before any driver sees
// them, and the structural checks of binary images that this needs (shared with the CUDA
// backend's ModuleImage, which checks every image it hands to the driver with them).
//
// The footprint is the device memory that the module's globals take: its `__device__`
// variables. It is what the worker reports as LoadModuleResponse.device_memory_bytes and
// the front end charges to the tenant's max_device_memory_bytes. It does not include code,
// constant banks, or local memory that launches reserve.
//
// No CUDA headers here: plain byte reading. Pure functions, thread-compatible.
#ifndef GPURPC_SERVER_WORKER_BACKEND_MODULE_FOOTPRINT_H_
#define GPURPC_SERVER_WORKER_BACKEND_MODULE_FOOTPRINT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gpurpc::backend {

enum class ImageFormat { kPtx, kCubin, kFatbin };

const char* ImageFormatName(ImageFormat format);

// ELF magic: cubin; fatbin magic (0xBA55ED50): fatbin; anything else is taken to be PTX.
ImageFormat DetectImageFormat(absl::Span<const uint8_t> image);

// INVALID_ARGUMENT unless `elf` is a 64-bit ELF whose program and section header tables and
// every section with file contents lie within its bytes.
absl::Status ValidateCubin(absl::Span<const uint8_t> elf);
// INVALID_ARGUMENT unless the fatbin header and the payload it announces lie within the
// bytes.
absl::Status ValidateFatbin(absl::Span<const uint8_t> fatbin);

// The device memory the module's globals take, in bytes:
// - cubin: the sum of the sizes of the sections whose names start with ".nv.global"
//   (`.nv.global`, SHT_NOBITS, and `.nv.global.init`, PROGBITS);
// - PTX (read up to its first NUL, as the driver reads it): the sum over `.global`
//   declarators of element size (vector width included) times every array extent, each
//   rounded up to its `.align`; a name declared twice counts once, at its largest; `.const`
//   is not counted;
// - fatbin: the largest footprint of its cubin and PTX entries (the driver picks one).
// Sums saturate: anything that cannot be read or does not fit (an unknown type, a
// malformed or non-numeric extent, an unsized array without an initializer, more than
// 2^48 bytes in one global) makes the answer UINT64_MAX, never less than the truth.
// INVALID_ARGUMENT for an empty image, a cubin that fails ValidateCubin or whose section
// names cannot be read (including extended section numbering), a fatbin that fails
// ValidateFatbin or whose entries run outside it, and a fatbin with a compressed entry or
// an entry that is neither a cubin nor PTX text (the footprint of what the driver would
// inflate cannot be known beforehand).
absl::StatusOr<uint64_t> ModuleFootprintBytes(absl::Span<const uint8_t> image);

}  // namespace gpurpc::backend

#endif  // GPURPC_SERVER_WORKER_BACKEND_MODULE_FOOTPRINT_H_
