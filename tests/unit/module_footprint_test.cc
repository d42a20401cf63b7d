// ModuleFootprintBytes: the device memory a module's globals take, read from PTX, cubin and
// fatbin bytes before any driver sees them; hand-built and hostile images, and a cubin and
// PTX from the real NVRTC (it needs no GPU).
#include "server/worker/backend/module_footprint.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/backend/ptx_globals.h"
#include "server/worker/compiler/compiler.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::backend {
namespace {

using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kGiB = uint64_t{1} << 30;

absl::StatusOr<uint64_t> Footprint(const std::string& image) {
  return ModuleFootprintBytes(
      absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(image.data()), image.size()));
}

std::string Ptx(const std::string& body) {
  return ".version 8.0\n.target sm_90\n.address_size 64\n" + body;
}

// --- PTX --------------------------------------------------------------------------------

TEST(PtxFootprintTest, SixteenGibGlobalFromTheReport) {
  EXPECT_THAT(Footprint(Ptx(".global .align 1 .b8 big[17179869184];\n")), IsOkAndHolds(16 * kGiB));
}

TEST(PtxFootprintTest, ElementSizesVectorsAndDimensions) {
  EXPECT_THAT(Footprint(Ptx(".global .u8 a; .global .s16 b; .global .f32 c; .global .f64 d;")),
              IsOkAndHolds(1u + 2 + 4 + 8));
  EXPECT_THAT(Footprint(Ptx(".visible .global .align 16 .v4 .f32 v[8];")),
              IsOkAndHolds(4u * 4 * 8));
  EXPECT_THAT(Footprint(Ptx(".global .v2 .u64 w[3][5];")), IsOkAndHolds(2u * 8 * 15));
  EXPECT_THAT(Footprint(Ptx(".global .b8 hex[0x100];")), IsOkAndHolds(256u));
}

TEST(PtxFootprintTest, InitializersAndSeveralNamesInOneDeclaration) {
  EXPECT_THAT(Footprint(Ptx(".global .u32 a, b[4];")), IsOkAndHolds(4u + 16));
  EXPECT_THAT(Footprint(Ptx(".global .align 4 .u32 a = 1, b[4] = {1, 2, 3, 4}, c[] = {5, 6};")),
              IsOkAndHolds(4u + 16 + 8));
  EXPECT_THAT(Footprint(Ptx(".visible .global .align 4 .b8 h[12] = {1, 0, 0, 0, 2, 0, 0, 0, "
                            "3, 0, 0, 0};")),
              IsOkAndHolds(12u));
  EXPECT_THAT(Footprint(Ptx(".global .u64 ptrs[2] = {generic(a), generic(b)};")),
              IsOkAndHolds(16u));
}

TEST(PtxFootprintTest, OnlyGlobalStateSpaceCounts) {
  const std::string ptx = Ptx(R"(
.const .align 4 .b8 coeffs[4096];
.shared .align 4 .b8 tile[4096];
// .global .b8 commented_out[4096];
/* .global .b8 hidden[4096]; */
.global .attribute(.managed) .align 8 .u64 managed[2];
.visible .entry k(.param .u64 .ptr .global .align 4 k_param_0)
{
  .local .align 4 .b8 frame[4096];
  .reg .b64 %rd<3>;
  ld.global.u64 %rd1, [managed];
  ret;
}
)");
  EXPECT_THAT(Footprint(ptx), IsOkAndHolds(16u));
}

TEST(PtxFootprintTest, AlignmentRoundsUpAndDuplicatesCountOnceAtTheLargest) {
  EXPECT_THAT(Footprint(Ptx(".global .align 8 .b8 x[3];")), IsOkAndHolds(8u));
  EXPECT_THAT(Footprint(Ptx(".extern .global .b8 buf[16];\n.global .b8 buf[4096];\n")),
              IsOkAndHolds(4096u));
  EXPECT_THAT(Footprint(Ptx(".extern .global .align 8 .b8 elsewhere[];")), IsOkAndHolds(0u));
}

TEST(PtxFootprintTest, GlobalsInsideFunctionBodiesCount) {
  EXPECT_THAT(Footprint(Ptx(".entry k() { { .global .b8 inner[1024]; } ret; }")),
              IsOkAndHolds(1024u));
}

TEST(PtxFootprintTest, TextAfterTheFirstNulIsWhatTheDriverIgnores) {
  const std::string ptx =
      Ptx(".global .b8 a[4];\n") + std::string(1, '\0') + ".global .b8 b[1000000];\n";
  EXPECT_THAT(Footprint(ptx), IsOkAndHolds(4u));
}

TEST(PtxFootprintTest, NoGlobalsIsZero) {
  EXPECT_THAT(Footprint("fake image"), IsOkAndHolds(0u));
  EXPECT_THAT(Footprint(Ptx(".visible .entry k() { ret; }")), IsOkAndHolds(0u));
}

TEST(PtxFootprintTest, HostileDeclarationsSaturate) {
  for (const char* declaration : {
           ".global .b8 overflow[4294967296][4294967296];",
           ".global .v4 .b64 overflow[1152921504606846976];",
           ".global .b8 too_big[281474976710657];",  // 2^48 + 1
           ".global .b8 nested[[4]];",
           ".global .b8 unclosed[4;",
           ".global .b8 trailing[4]];",
           ".global .b8 symbolic[N];",
           ".global .b8 negative[-1];",
           ".global .b8 unsized[];",
           ".global .b8 two_unsized[][] = {1};",
           ".global .f128 unknown_type;",
           ".global .align 8;",
           ".global .align x .b8 bad_align[4];",
           ".global .b8 123bad_name[4];",
           ".global .b8 big[99999999999999999999999];",
       }) {
    EXPECT_THAT(Footprint(Ptx(declaration)), IsOkAndHolds(kMax)) << declaration;
  }
}

TEST(PtxFootprintTest, ManyLargeGlobalsSaturateInsteadOfWrapping) {
  std::string ptx = Ptx("");
  for (int i = 0; i < 70000; ++i) {
    absl::StrAppend(&ptx, ".global .b8 g", i, "[281474976710656];\n");  // 2^48 each
  }
  EXPECT_THAT(Footprint(ptx), IsOkAndHolds(kMax));
}

TEST(PtxFootprintTest, BracesInStringsAndStrayBracesDoNotHideGlobals) {
  EXPECT_THAT(Footprint(Ptx(".entry k() { .pragma \"{\"; ret; }\n.global .b8 after[4096];")),
              IsOkAndHolds(4096u));
  EXPECT_THAT(Footprint(Ptx("}\n.global .b8 after_stray[4096];")), IsOkAndHolds(4096u));
  EXPECT_THAT(Footprint(Ptx(".global .b8 unterminated[4096]")), IsOkAndHolds(4096u));
  EXPECT_THAT(Footprint(Ptx(".global .b8 no_semicolon[4096]\n.entry k() { ret; }")),
              IsOkAndHolds(kMax));
}

TEST(PtxGlobalsTest, TheFakeStillSkipsWhatItCannotRead) {
  const std::vector<PtxGlobal> globals = ParsePtxGlobals(
      Ptx(".global .b8 ok[4];\n.global .b8 bad[N];\n.extern .global .b8 elsewhere[];\n"
          ".global .texref tex;\n.entry k() { .global .b8 inner[8]; ret; }\n"
          ".global .u32 first = 1, second[2];\n"));
  std::vector<std::string> names;
  for (const PtxGlobal& global : globals) names.push_back(global.name);
  EXPECT_THAT(names, ::testing::ElementsAre("ok", "first", "second"));
  EXPECT_EQ(globals[2].size_bytes, 8u);
}

// --- cubin (ELF64) ----------------------------------------------------------------------

struct Section {
  std::string name;
  uint32_t type = 1;  // SHT_PROGBITS
  uint64_t size = 0;  // for SHT_NOBITS; otherwise the contents' size
  std::string contents;
};

template <typename T>
void Store(std::string* bytes, size_t offset, T value) {
  std::memcpy(bytes->data() + offset, &value, sizeof(value));
}

constexpr uint32_t kNobits = 8;
constexpr size_t kShoffOffset = 0x28;
constexpr size_t kShnumOffset = 0x3c;
constexpr size_t kShstrndxOffset = 0x3e;

// A minimal ELF64: header, contents, then the section headers (null, sections...,
// .shstrtab last).
std::string Elf(std::vector<Section> sections) {
  std::string names(1, '\0');
  std::vector<uint32_t> name_offsets;
  sections.push_back(Section{".shstrtab", 3, 0, ""});
  for (const Section& section : sections) {
    name_offsets.push_back(static_cast<uint32_t>(names.size()));
    names += section.name + '\0';
  }
  sections.back().contents = names;
  std::string elf(64, '\0');
  elf[0] = 0x7f;
  elf[1] = 'E';
  elf[2] = 'L';
  elf[3] = 'F';
  elf[4] = 2;  // ELFCLASS64
  elf[5] = 1;  // little-endian
  elf[6] = 1;
  std::vector<uint64_t> offsets;
  for (const Section& section : sections) {
    offsets.push_back(elf.size());
    if (section.type != kNobits) elf += section.contents;
  }
  while (elf.size() % 8 != 0) elf.push_back('\0');
  const uint64_t shoff = elf.size();
  elf.append(64 * (sections.size() + 1), '\0');
  for (size_t i = 0; i < sections.size(); ++i) {
    const size_t header = shoff + 64 * (i + 1);
    Store<uint32_t>(&elf, header + 0x00, name_offsets[i]);
    Store<uint32_t>(&elf, header + 0x04, sections[i].type);
    Store<uint64_t>(&elf, header + 0x18, offsets[i]);
    Store<uint64_t>(&elf, header + 0x20,
                    sections[i].type == kNobits ? sections[i].size : sections[i].contents.size());
  }
  Store<uint64_t>(&elf, kShoffOffset, shoff);
  Store<uint16_t>(&elf, 0x3a, 64);
  Store<uint16_t>(&elf, kShnumOffset, static_cast<uint16_t>(sections.size() + 1));
  Store<uint16_t>(&elf, kShstrndxOffset, static_cast<uint16_t>(sections.size()));
  return elf;
}

std::string TypicalCubin() {
  return Elf({Section{".text.k", 1, 0, std::string(128, '\1')},
              Section{".nv.constant0.k", 1, 0, std::string(64, '\0')},
              Section{".nv.shared.k", kNobits, 4096, ""},
              Section{".nv.global.init", 1, 0, std::string(12, '\1')},
              Section{".nv.global", kNobits, uint64_t{1} << 34, ""}});
}

TEST(CubinFootprintTest, SumsNvGlobalSections) {
  EXPECT_THAT(Footprint(TypicalCubin()), IsOkAndHolds((uint64_t{1} << 34) + 12));
}

TEST(CubinFootprintTest, NoGlobalsIsZero) {
  EXPECT_THAT(Footprint(Elf({Section{".text.k", 1, 0, "code"}})), IsOkAndHolds(0u));
}

TEST(CubinFootprintTest, HugeNobitsSizesSaturate) {
  EXPECT_THAT(Footprint(Elf({Section{".nv.global", kNobits, uint64_t{1} << 63, ""},
                             Section{".nv.global.x", kNobits, uint64_t{1} << 63, ""}})),
              IsOkAndHolds(kMax));
}

TEST(CubinFootprintTest, MalformedHeadersAreInvalidArgument) {
  const std::string cubin = TypicalCubin();
  EXPECT_THAT(Footprint(cubin.substr(0, 40)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Footprint(cubin.substr(0, cubin.size() - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("section header table")));

  std::string bad_index = cubin;
  Store<uint16_t>(&bad_index, kShstrndxOffset, 200);
  EXPECT_THAT(Footprint(bad_index), StatusIs(absl::StatusCode::kInvalidArgument));
  Store<uint16_t>(&bad_index, kShstrndxOffset, 0xffff);
  EXPECT_THAT(Footprint(bad_index), StatusIs(absl::StatusCode::kInvalidArgument));

  std::string extended = cubin;
  Store<uint16_t>(&extended, kShnumOffset, 0);
  EXPECT_THAT(Footprint(extended),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("extended")));

  // The last section's name offset points past the name table.
  std::string bad_name = cubin;
  const uint64_t shoff = [&] {
    uint64_t value;
    std::memcpy(&value, bad_name.data() + kShoffOffset, sizeof(value));
    return value;
  }();
  Store<uint32_t>(&bad_name, shoff + 64 * 5, 0x7fffffff);
  EXPECT_THAT(Footprint(bad_name),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name table")));

  // The name table is NOBITS.
  std::string nobits_names = cubin;
  Store<uint32_t>(&nobits_names, shoff + 64 * 6 + 4, kNobits);
  EXPECT_THAT(Footprint(nobits_names), StatusIs(absl::StatusCode::kInvalidArgument));

  // A section whose contents lie outside the image.
  std::string outside = cubin;
  Store<uint64_t>(&outside, shoff + 64 * 1 + 0x18, uint64_t{1} << 62);
  EXPECT_THAT(Footprint(outside), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CubinFootprintTest, UnterminatedNameTableIsInvalidArgument) {
  std::string cubin = Elf({Section{".nv.global", kNobits, 16, ""}});
  // Drop the name table's last NUL by shrinking its size by one.
  uint64_t shoff;
  std::memcpy(&shoff, cubin.data() + kShoffOffset, sizeof(shoff));
  uint64_t size;
  std::memcpy(&size, cubin.data() + shoff + 64 * 2 + 0x20, sizeof(size));
  Store<uint64_t>(&cubin, shoff + 64 * 2 + 0x20, size - 1);
  EXPECT_THAT(Footprint(cubin), StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- fatbin -----------------------------------------------------------------------------

struct Entry {
  uint16_t kind = 2;
  std::string payload;
  uint64_t flags = 0x11;
  uint32_t compressed_size = 0;
};

std::string Fatbin(const std::vector<Entry>& entries) {
  std::string body;
  for (const Entry& entry : entries) {
    std::string header(64, '\0');
    Store<uint16_t>(&header, 0, entry.kind);
    Store<uint16_t>(&header, 2, 0x0101);
    Store<uint32_t>(&header, 4, 64);
    Store<uint64_t>(&header, 8, entry.payload.size());
    Store<uint32_t>(&header, 16, entry.compressed_size);
    Store<uint32_t>(&header, 28, 90);
    Store<uint64_t>(&header, 40, entry.flags);
    body += header + entry.payload;
  }
  std::string fatbin(16, '\0');
  Store<uint32_t>(&fatbin, 0, 0xBA55ED50);
  Store<uint16_t>(&fatbin, 4, 1);
  Store<uint16_t>(&fatbin, 6, 16);
  Store<uint64_t>(&fatbin, 8, body.size());
  return fatbin + body;
}

TEST(FatbinFootprintTest, LargestOfItsEntries) {
  const std::string ptx = Ptx(".global .b8 big[" + std::to_string(uint64_t{1} << 35) + "];\n");
  EXPECT_THAT(Footprint(Fatbin({Entry{2, TypicalCubin()}, Entry{1, ptx + '\0'}})),
              IsOkAndHolds(uint64_t{1} << 35));
  EXPECT_THAT(Footprint(Fatbin({Entry{1, Ptx(".global .b8 small[8];")}, Entry{2, TypicalCubin()}})),
              IsOkAndHolds((uint64_t{1} << 34) + 12));
  EXPECT_THAT(Footprint(Fatbin({})), IsOkAndHolds(0u));
}

TEST(FatbinFootprintTest, CompressedEntriesAreRefused) {
  for (const Entry& entry :
       {Entry{1, Ptx(".global .b8 a[4];"), 0x8011, 0}, Entry{2, TypicalCubin(), 0x2011, 0},
        Entry{1, Ptx(".global .b8 a[4];"), 0x11, 20}}) {
    EXPECT_THAT(Footprint(Fatbin({entry})),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("compressed fatbins are not accepted")));
  }
}

TEST(FatbinFootprintTest, UnreadableEntriesAreRefused) {
  EXPECT_THAT(Footprint(Fatbin({Entry{2, "\x28\xb5\x2f\xfd not an elf"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an ELF")));
  EXPECT_THAT(Footprint(Fatbin({Entry{1, std::string("binary\0junk", 11)}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not text")));
  EXPECT_THAT(Footprint(Fatbin({Entry{4, "lto ir"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kind 4")));
  std::string truncated_cubin = TypicalCubin();
  truncated_cubin.resize(truncated_cubin.size() - 8);
  EXPECT_THAT(Footprint(Fatbin({Entry{2, truncated_cubin}})),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(FatbinFootprintTest, EntriesOutsideThePayloadAreRefused) {
  std::string fatbin = Fatbin({Entry{2, TypicalCubin()}});
  std::string too_long = fatbin;
  Store<uint64_t>(&too_long, 16 + 8, uint64_t{1} << 62);  // the entry's payload size
  EXPECT_THAT(Footprint(too_long), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string short_header = fatbin;
  Store<uint32_t>(&short_header, 16 + 4, 8);  // entry header size below 64
  EXPECT_THAT(Footprint(short_header), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string huge_header = fatbin;
  Store<uint32_t>(&huge_header, 16 + 4, 0xffffffff);
  EXPECT_THAT(Footprint(huge_header), StatusIs(absl::StatusCode::kInvalidArgument));
  // A payload that ends inside the next entry header.
  std::string partial = fatbin + std::string(10, '\0');
  Store<uint64_t>(&partial, 8, fatbin.size() - 16 + 10);
  EXPECT_THAT(Footprint(partial), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Footprint(fatbin.substr(0, 12)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ModuleFootprintTest, EmptyImageIsInvalidArgument) {
  EXPECT_THAT(Footprint(""), StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- real NVRTC output --------------------------------------------------------------------

constexpr char kGlobalsSource[] = R"(
__device__ char g[1 << 20];
__device__ int h[3] = {1, 2, 3};
extern "C" __global__ void touch(int* out) {
  out[threadIdx.x] = g[threadIdx.x] + h[threadIdx.x % 3];
}
)";

compiler::Compiler* SharedCompiler() {
  static compiler::Compiler* const kCompiler = [] {
    compiler::CompilerOptions options;
    options.cache_dir = "";
    options.memory_cache_max_bytes = 0;
    auto compiler = compiler::Compiler::Create(options);
    return compiler.ok() ? std::move(compiler).value().release() : nullptr;
  }();
  return kCompiler;
}

TEST(NvrtcFootprintTest, CubinAndPtxCountDeviceVariables) {
  compiler::Compiler* compiler = SharedCompiler();
  ASSERT_NE(compiler, nullptr) << compiler::Compiler::Create(compiler::CompilerOptions()).status();
  constexpr uint64_t kExpected = (uint64_t{1} << 20) + 12;
  for (const char* target : {"sm_90", "compute_90"}) {
    compiler::CompileRequest request;
    request.source = kGlobalsSource;
    request.target = target;
    ASSERT_OK_AND_ASSIGN(compiler::CompileResult result, compiler->Compile(request));
    ASSERT_TRUE(result.success) << result.log;
    const std::string image(result.image.begin(), result.image.end());
    EXPECT_EQ(DetectImageFormat(result.image),
              std::string(target) == "sm_90" ? ImageFormat::kCubin : ImageFormat::kPtx);
    ASSERT_OK_AND_ASSIGN(const uint64_t footprint, Footprint(image));
    EXPECT_GE(footprint, kExpected) << target;
    EXPECT_LT(footprint, kExpected + 4096) << target;
    if (std::string(target) == "sm_90") {
      // Wrapped in an uncompressed fatbin, as nvcc --no-compress makes one.
      EXPECT_THAT(Footprint(Fatbin({Entry{2, image}})), IsOkAndHolds(footprint));
    }
  }
}

}  // namespace
}  // namespace gpurpc::backend
