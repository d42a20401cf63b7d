#include "server/worker/backend/cuda/module_image.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gpurpc::backend::cuda {
namespace {

// ELF64 layout (System V gABI).
constexpr uint8_t kElfMagic[4] = {0x7f, 'E', 'L', 'F'};
constexpr size_t kElf64HeaderBytes = 64;
constexpr uint8_t kElfClass64 = 2;
constexpr size_t kElfClassOffset = 4;
constexpr size_t kElfPhoffOffset = 0x20;
constexpr size_t kElfShoffOffset = 0x28;
constexpr size_t kElfPhentsizeOffset = 0x36;
constexpr size_t kElfPhnumOffset = 0x38;
constexpr size_t kElfShentsizeOffset = 0x3a;
constexpr size_t kElfShnumOffset = 0x3c;
constexpr size_t kElf64SectionHeaderBytes = 64;
constexpr size_t kElfShTypeOffset = 0x04;
constexpr size_t kElfShOffsetOffset = 0x18;
constexpr size_t kElfShSizeOffset = 0x20;
constexpr uint32_t kElfShtNobits = 8;

// Fatbin container header: magic, version (u16), header size (u16), payload size (u64).
constexpr uint32_t kFatbinMagic = 0xBA55ED50;
constexpr size_t kFatbinHeaderBytes = 16;

template <typename T>
T Load(const uint8_t* bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof(value));
  return value;  // Little-endian, like every platform CUDA runs on.
}

// True when [offset, offset + length) lies within [0, size), without overflow.
bool InBounds(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

absl::Status Truncated(absl::string_view kind, absl::string_view what, size_t size) {
  return absl::InvalidArgumentError(absl::StrCat("invalid ", kind, " image: ", what,
                                                 " lies outside the ", size,
                                                 " bytes received (truncated image?)"));
}

absl::Status CheckElf(const uint8_t* bytes, size_t size) {
  if (size < kElf64HeaderBytes) return Truncated("cubin (ELF)", "the ELF header", size);
  if (bytes[kElfClassOffset] != kElfClass64) {
    return absl::InvalidArgumentError("invalid cubin (ELF) image: not a 64-bit ELF file");
  }
  const uint64_t phoff = Load<uint64_t>(bytes, kElfPhoffOffset);
  const uint64_t shoff = Load<uint64_t>(bytes, kElfShoffOffset);
  const uint64_t phentsize = Load<uint16_t>(bytes, kElfPhentsizeOffset);
  const uint64_t phnum = Load<uint16_t>(bytes, kElfPhnumOffset);
  const uint64_t shentsize = Load<uint16_t>(bytes, kElfShentsizeOffset);
  const uint64_t shnum = Load<uint16_t>(bytes, kElfShnumOffset);
  if (phnum > 0 && !InBounds(phoff, phentsize * phnum, size)) {
    return Truncated("cubin (ELF)", "the program header table", size);
  }
  if (shnum == 0) return absl::OkStatus();
  if (shentsize < kElf64SectionHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid cubin (ELF) image: section header entries of ", shentsize, " bytes"));
  }
  if (!InBounds(shoff, shentsize * shnum, size)) {
    return Truncated("cubin (ELF)", "the section header table", size);
  }
  for (uint64_t i = 0; i < shnum; ++i) {
    const size_t header = shoff + i * shentsize;
    if (Load<uint32_t>(bytes, header + kElfShTypeOffset) == kElfShtNobits) continue;
    const uint64_t offset = Load<uint64_t>(bytes, header + kElfShOffsetOffset);
    const uint64_t length = Load<uint64_t>(bytes, header + kElfShSizeOffset);
    if (!InBounds(offset, length, size)) {
      return Truncated("cubin (ELF)", absl::StrCat("section ", i), size);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFatbin(const uint8_t* bytes, size_t size) {
  if (size < kFatbinHeaderBytes) return Truncated("fatbin", "the fatbin header", size);
  const uint64_t header_size = Load<uint16_t>(bytes, 6);
  const uint64_t payload_size = Load<uint64_t>(bytes, 8);
  if (header_size < kFatbinHeaderBytes || !InBounds(header_size, payload_size, size)) {
    return Truncated("fatbin", "the fatbin payload", size);
  }
  return absl::OkStatus();
}

}  // namespace

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
  if (size >= sizeof(kElfMagic) && std::memcmp(bytes, kElfMagic, sizeof(kElfMagic)) == 0) {
    result.kind_ = ModuleImageKind::kCubin;
    if (absl::Status status = CheckElf(bytes, size); !status.ok()) return status;
  } else if (size >= sizeof(uint32_t) && Load<uint32_t>(bytes, 0) == kFatbinMagic) {
    result.kind_ = ModuleImageKind::kFatbin;
    if (absl::Status status = CheckFatbin(bytes, size); !status.ok()) return status;
  } else {
    result.kind_ = ModuleImageKind::kPtx;
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
