#include "server/worker/backend/module_footprint.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "server/worker/backend/ptx_globals.h"

namespace gpurpc::backend {
namespace {

constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();

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
constexpr size_t kElfShstrndxOffset = 0x3e;
constexpr size_t kElf64SectionHeaderBytes = 64;
constexpr size_t kElfShNameOffset = 0x00;
constexpr size_t kElfShTypeOffset = 0x04;
constexpr size_t kElfShOffsetOffset = 0x18;
constexpr size_t kElfShSizeOffset = 0x20;
constexpr uint32_t kElfShtNobits = 8;
constexpr uint64_t kElfShnXindex = 0xffff;

// Fatbin container header: magic, version (u16), header size (u16), payload size (u64).
constexpr uint32_t kFatbinMagic = 0xBA55ED50;
constexpr size_t kFatbinHeaderBytes = 16;
// Fatbin entry header (reverse-engineered, stable since CUDA 10): kind (u16), version (u16),
// header size (u32, 64 or more), payload size (u64), compressed size (u32), ..., flags (u64
// at 40). The payload follows the entry header.
constexpr size_t kFatbinEntryHeaderBytes = 64;
constexpr size_t kFatbinEntryHeaderSizeOffset = 4;
constexpr size_t kFatbinEntryPayloadSizeOffset = 8;
constexpr size_t kFatbinEntryCompressedSizeOffset = 16;
constexpr size_t kFatbinEntryFlagsOffset = 40;
constexpr uint16_t kFatbinKindPtx = 1;
constexpr uint16_t kFatbinKindElf = 2;
constexpr uint16_t kFatbinKindElfAlt = 0x10;
constexpr uint64_t kFatbinFlagCompressedLz4 = 0x2000;
constexpr uint64_t kFatbinFlagCompressedZstd = 0x8000;

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

uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return b > kSaturated - a ? kSaturated : a + b; }

// `value` rounded up to a multiple of `align` (0 or 1: unchanged), saturating.
uint64_t SaturatingRoundUp(uint64_t value, uint64_t align) {
  if (align <= 1 || value % align == 0) return value;
  return SaturatingAdd(value, align - value % align);
}

absl::Status Truncated(absl::string_view kind, absl::string_view what, size_t size) {
  return absl::InvalidArgumentError(absl::StrCat("invalid ", kind, " image: ", what,
                                                 " lies outside the ", size,
                                                 " bytes received (truncated image?)"));
}

absl::Status BadCubin(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("invalid cubin (ELF) image: ", what));
}

absl::StatusOr<uint64_t> CubinFootprint(absl::Span<const uint8_t> elf) {
  GPURPC_RETURN_IF_ERROR(ValidateCubin(elf));
  const uint8_t* bytes = elf.data();
  const uint64_t shoff = Load<uint64_t>(bytes, kElfShoffOffset);
  const uint64_t shentsize = Load<uint16_t>(bytes, kElfShentsizeOffset);
  const uint64_t shnum = Load<uint16_t>(bytes, kElfShnumOffset);
  const uint64_t shstrndx = Load<uint16_t>(bytes, kElfShstrndxOffset);
  if (shnum == 0) {
    // With e_shoff set, the real count is in section 0 (extended numbering), which
    // ValidateCubin did not check: no cubin needs 65280 sections.
    if (shoff != 0) return BadCubin("extended section numbering is not accepted");
    return 0;
  }
  if (shstrndx == kElfShnXindex || shstrndx >= shnum) {
    return BadCubin(
        absl::StrCat("section name table index ", shstrndx, " of ", shnum, " sections"));
  }
  // Every header and every non-NOBITS section is within the image (ValidateCubin).
  const size_t names_header = shoff + shstrndx * shentsize;
  if (Load<uint32_t>(bytes, names_header + kElfShTypeOffset) == kElfShtNobits) {
    return BadCubin("the section name table has no contents");
  }
  const uint64_t names_offset = Load<uint64_t>(bytes, names_header + kElfShOffsetOffset);
  const uint64_t names_size = Load<uint64_t>(bytes, names_header + kElfShSizeOffset);
  const absl::string_view names(reinterpret_cast<const char*>(bytes) + names_offset, names_size);
  uint64_t total = 0;
  for (uint64_t i = 0; i < shnum; ++i) {
    const size_t header = shoff + i * shentsize;
    const uint64_t name_offset = Load<uint32_t>(bytes, header + kElfShNameOffset);
    const size_t end =
        name_offset < names.size() ? names.find('\0', name_offset) : absl::string_view::npos;
    if (end == absl::string_view::npos) {
      return BadCubin(absl::StrCat("the name of section ", i, " lies outside the name table"));
    }
    const absl::string_view name = names.substr(name_offset, end - name_offset);
    if (absl::StartsWith(name, ".nv.global")) {
      total = SaturatingAdd(total, Load<uint64_t>(bytes, header + kElfShSizeOffset));
    }
  }
  return total;
}

uint64_t PtxFootprint(absl::string_view ptx) {
  std::map<std::string, uint64_t> largest_by_name;
  for (const PtxVariable& variable : ParsePtxVariables(ptx)) {
    if (variable.space != PtxVariable::Space::kGlobal) continue;
    if (variable.name.empty() || !variable.size_bytes) return kSaturated;
    uint64_t& largest = largest_by_name[variable.name];
    largest = std::max(largest, SaturatingRoundUp(*variable.size_bytes, variable.align_bytes));
  }
  uint64_t total = 0;
  for (const auto& [name, size_bytes] : largest_by_name) total = SaturatingAdd(total, size_bytes);
  return total;
}

absl::Status BadFatbin(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("invalid fatbin image: ", what));
}

absl::StatusOr<uint64_t> FatbinFootprint(absl::Span<const uint8_t> image) {
  GPURPC_RETURN_IF_ERROR(ValidateFatbin(image));
  const uint8_t* bytes = image.data();
  const uint64_t first = Load<uint16_t>(bytes, 6);
  const uint64_t end = first + Load<uint64_t>(bytes, 8);  // within the image (validated)
  uint64_t largest = 0;
  for (uint64_t pos = first, index = 0; pos < end; ++index) {
    if (!InBounds(pos, kFatbinEntryHeaderBytes, end)) {
      return BadFatbin(absl::StrCat("the header of entry ", index, " lies outside the payload"));
    }
    const uint16_t kind = Load<uint16_t>(bytes, pos);
    const uint64_t header_size = Load<uint32_t>(bytes, pos + kFatbinEntryHeaderSizeOffset);
    const uint64_t payload_size = Load<uint64_t>(bytes, pos + kFatbinEntryPayloadSizeOffset);
    const uint64_t compressed_size = Load<uint32_t>(bytes, pos + kFatbinEntryCompressedSizeOffset);
    const uint64_t flags = Load<uint64_t>(bytes, pos + kFatbinEntryFlagsOffset);
    if (header_size < kFatbinEntryHeaderBytes || !InBounds(pos, header_size, end) ||
        !InBounds(pos + header_size, payload_size, end)) {
      return BadFatbin(absl::StrCat("entry ", index, " lies outside the payload"));
    }
    if ((flags & (kFatbinFlagCompressedLz4 | kFatbinFlagCompressedZstd)) != 0 ||
        compressed_size != 0) {
      return BadFatbin(absl::StrCat(
          "entry ", index,
          " is compressed; compressed fatbins are not accepted, because the device memory "
          "their globals take cannot be known before the driver inflates them (build with "
          "nvcc --no-compress, or load the cubin or PTX)"));
    }
    const absl::Span<const uint8_t> payload = image.subspan(pos + header_size, payload_size);
    const absl::string_view text(reinterpret_cast<const char*>(payload.data()), payload.size());
    uint64_t footprint = 0;
    if (kind == kFatbinKindPtx) {
      if (!LooksLikePtxText(text)) {
        return BadFatbin(absl::StrCat("PTX entry ", index, " is not text (compressed?)"));
      }
      footprint = PtxFootprint(text);
    } else if (kind == kFatbinKindElf || kind == kFatbinKindElfAlt) {
      if (payload.size() < sizeof(kElfMagic) ||
          std::memcmp(payload.data(), kElfMagic, sizeof(kElfMagic)) != 0) {
        return BadFatbin(absl::StrCat("cubin entry ", index, " is not an ELF (compressed?)"));
      }
      GPURPC_ASSIGN_OR_RETURN(footprint, CubinFootprint(payload));
    } else {
      return BadFatbin(absl::StrCat("entry ", index, " is of kind ", kind,
                                    ", neither cubin nor PTX; such entries are not accepted"));
    }
    largest = std::max(largest, footprint);
    pos += header_size + payload_size;  // <= end: checked above
  }
  return largest;
}

}  // namespace

const char* ImageFormatName(ImageFormat format) {
  switch (format) {
    case ImageFormat::kPtx:
      return "PTX";
    case ImageFormat::kCubin:
      return "cubin";
    case ImageFormat::kFatbin:
      return "fatbin";
  }
  return "unknown";
}

ImageFormat DetectImageFormat(absl::Span<const uint8_t> image) {
  if (image.size() >= sizeof(kElfMagic) &&
      std::memcmp(image.data(), kElfMagic, sizeof(kElfMagic)) == 0) {
    return ImageFormat::kCubin;
  }
  if (image.size() >= sizeof(uint32_t) && Load<uint32_t>(image.data(), 0) == kFatbinMagic) {
    return ImageFormat::kFatbin;
  }
  return ImageFormat::kPtx;
}

absl::Status ValidateCubin(absl::Span<const uint8_t> elf) {
  const uint8_t* bytes = elf.data();
  const size_t size = elf.size();
  if (size < kElf64HeaderBytes) return Truncated("cubin (ELF)", "the ELF header", size);
  if (bytes[kElfClassOffset] != kElfClass64) return BadCubin("not a 64-bit ELF file");
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
    return BadCubin(absl::StrCat("section header entries of ", shentsize, " bytes"));
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

absl::Status ValidateFatbin(absl::Span<const uint8_t> fatbin) {
  const uint8_t* bytes = fatbin.data();
  const size_t size = fatbin.size();
  if (size < kFatbinHeaderBytes) return Truncated("fatbin", "the fatbin header", size);
  const uint64_t header_size = Load<uint16_t>(bytes, 6);
  const uint64_t payload_size = Load<uint64_t>(bytes, 8);
  if (header_size < kFatbinHeaderBytes || !InBounds(header_size, payload_size, size)) {
    return Truncated("fatbin", "the fatbin payload", size);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ModuleFootprintBytes(absl::Span<const uint8_t> image) {
  if (image.empty()) return absl::InvalidArgumentError("empty module image");
  switch (DetectImageFormat(image)) {
    case ImageFormat::kCubin:
      return CubinFootprint(image);
    case ImageFormat::kFatbin:
      return FatbinFootprint(image);
    case ImageFormat::kPtx:
      break;
  }
  return PtxFootprint(absl::string_view(reinterpret_cast<const char*>(image.data()), image.size()));
}

}  // namespace gpurpc::backend
