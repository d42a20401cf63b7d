#include "server/worker/backend/fake/fake_module_image.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace gpurpc::backend::fake {
namespace {

constexpr char kInvalidPtx[] = "CUDA_ERROR_INVALID_PTX (a PTX JIT compilation failed)";
constexpr char kInvalidImage[] = "CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)";
constexpr char kNoBinary[] =
    "CUDA_ERROR_NO_BINARY_FOR_GPU (no kernel image is available for execution on the device)";

// The most parameter bytes a kernel may take (CUDA 12.1 and later, Volta and later).
constexpr uint64_t kMaxKernelParamBytes = 32764;
// Deeper nesting of braces, parentheses and brackets than any compiler emits.
constexpr size_t kMaxNesting = 1024;
// Far beyond any parameter; a larger array extent is garbage.
constexpr uint64_t kMaxExtent = uint64_t{1} << 32;

// ELF64 (System V gABI) offsets that module_footprint.cc does not export.
constexpr size_t kElfDataOffset = 5;
constexpr uint8_t kElfDataLittleEndian = 1;
constexpr size_t kElfMachineOffset = 0x12;
constexpr uint16_t kElfMachineCuda = 190;
constexpr size_t kElfShoffOffset = 0x28;
constexpr size_t kElfShentsizeOffset = 0x3a;
constexpr size_t kElfShnumOffset = 0x3c;
constexpr size_t kElfShTypeOffset = 0x04;
constexpr size_t kElfShOffsetOffset = 0x18;
constexpr size_t kElfShSizeOffset = 0x20;
constexpr size_t kElfShLinkOffset = 0x28;
constexpr size_t kElfShEntsizeOffset = 0x38;
constexpr uint32_t kElfShtSymtab = 2;
constexpr uint32_t kElfShtNobits = 8;
constexpr uint64_t kElfSymbolBytes = 24;
constexpr size_t kElfSymInfoOffset = 4;
constexpr size_t kElfSymShndxOffset = 6;
constexpr uint8_t kElfSttFunc = 2;

// Fatbin layout, as module_footprint.cc reads it (and has validated before this runs).
constexpr size_t kFatbinHeaderSizeOffset = 6;
constexpr size_t kFatbinPayloadSizeOffset = 8;
constexpr size_t kFatbinEntryHeaderBytes = 64;
constexpr size_t kFatbinEntryHeaderSizeOffset = 4;
constexpr size_t kFatbinEntryPayloadSizeOffset = 8;
constexpr uint16_t kFatbinKindPtx = 1;
constexpr uint16_t kFatbinKindElf = 2;
constexpr uint16_t kFatbinKindElfAlt = 0x10;

template <typename T>
T Load(const uint8_t* bytes, uint64_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof(value));
  return value;  // Little-endian, like every platform CUDA runs on.
}

bool InBounds(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

absl::Status Error(uint64_t line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
}

// --- PTX ------------------------------------------------------------------------------------

bool IsWordChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '$' || c == '%' ||
         c == '.';
}

bool IsFollowChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '$';
}

// A PTX identifier: [a-zA-Z]{followsym}* or [_$%]{followsym}+.
bool IsIdentifier(absl::string_view word) {
  if (word.empty()) return false;
  const char first = word[0];
  if (!absl::ascii_isalpha(static_cast<unsigned char>(first))) {
    if (first != '_' && first != '$' && first != '%') return false;
    if (word.size() == 1) return false;
  }
  for (size_t i = 1; i < word.size(); ++i) {
    if (!IsFollowChar(word[i])) return false;
  }
  return true;
}

bool IsDigits(absl::string_view text) {
  if (text.empty()) return false;
  for (const char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// sm_75, compute_90a, sm_100f, and the target options PTX knows.
bool IsTargetName(absl::string_view name) {
  for (absl::string_view option :
       {"texmode_unified", "texmode_independent", "debug", "map_f64_to_f32"}) {
    if (name == option) return true;
  }
  absl::string_view number;
  if (absl::StartsWith(name, "sm_")) {
    number = name.substr(3);
  } else if (absl::StartsWith(name, "compute_")) {
    number = name.substr(8);
  } else {
    return false;
  }
  if (!number.empty() && (number.back() == 'a' || number.back() == 'f')) number.remove_suffix(1);
  return IsDigits(number) && number.size() <= 4;
}

// A PTX integer: decimal or 0x hex, with an optional U suffix.
std::optional<uint64_t> ParseInteger(absl::string_view text) {
  if (!text.empty() && (text.back() == 'U' || text.back() == 'u')) text.remove_suffix(1);
  uint64_t value = 0;
  if (absl::StartsWithIgnoreCase(text, "0x")) {
    text.remove_prefix(2);
    if (text.empty() || !absl::SimpleHexAtoi(text, &value)) return std::nullopt;
    return value;
  }
  if (!IsDigits(text) || !absl::SimpleAtoi(text, &value)) return std::nullopt;
  return value;
}

std::optional<uint64_t> ParamTypeBytes(absl::string_view type, bool allow_predicate) {
  for (absl::string_view t : {".b8", ".u8", ".s8"}) {
    if (type == t) return 1;
  }
  for (absl::string_view t : {".b16", ".u16", ".s16", ".f16", ".bf16"}) {
    if (type == t) return 2;
  }
  for (absl::string_view t : {".b32", ".u32", ".s32", ".f32", ".f16x2", ".bf16x2"}) {
    if (type == t) return 4;
  }
  for (absl::string_view t :
       {".b64", ".u64", ".s64", ".f64", ".texref", ".samplerref", ".surfref"}) {
    if (type == t) return 8;
  }
  if (type == ".b128") return 16;
  if (allow_predicate && type == ".pred") return 1;
  return std::nullopt;
}

bool IsStateSpace(absl::string_view word) {
  return word == ".global" || word == ".const" || word == ".local" || word == ".shared";
}

bool IsLinkage(absl::string_view word) {
  return word == ".visible" || word == ".extern" || word == ".weak" || word == ".common";
}

// Directives that may follow a kernel's or function's parameter list, before its body.
bool IsHeaderDirective(absl::string_view word) {
  for (absl::string_view d :
       {".maxntid", ".reqntid", ".minnctapersm", ".maxnctapersm", ".maxnreg", ".noreturn",
        ".explicitcluster", ".reqnctapercluster", ".maxclusterrank", ".blocksareclusters",
        ".abi_preserve", ".abi_preserve_control"}) {
    if (word == d) return true;
  }
  return false;
}

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

struct Token {
  enum class Kind { kEnd, kWord, kString, kPunct };
  Kind kind = Kind::kEnd;
  absl::string_view text;
  uint64_t line = 1;
  // Open braces, parentheses and brackets after this token.
  size_t depth = 0;

  bool Is(absl::string_view word) const { return kind != Kind::kEnd && text == word; }
  bool IsDirective() const { return kind == Kind::kWord && absl::StartsWith(text, "."); }
};

std::string Describe(const Token& token) {
  if (token.kind == Token::Kind::kEnd) return "the end of the text";
  if (token.text.size() > 40) return absl::StrCat("'", token.text.substr(0, 40), "...'");
  return absl::StrCat("'", token.text, "'");
}

// Splits PTX text (without NULs) into words, strings and punctuation, skipping comments and
// whitespace, and refuses what is not PTX text: bytes outside printable ASCII (outside
// comments and strings), unterminated comments and strings, and unbalanced or over-deep
// braces, parentheses and brackets.
class PtxLexer {
 public:
  explicit PtxLexer(absl::string_view text) : text_(text) {}

  absl::Status Next(Token* token) {
    GPURPC_RETURN_IF_ERROR(SkipSpaceAndComments());
    token->line = line_;
    if (pos_ == text_.size()) {
      if (!open_.empty()) {
        return Error(open_.back().second,
                     absl::StrCat("'", std::string(1, open_.back().first), "' is never closed"));
      }
      token->kind = Token::Kind::kEnd;
      token->text = absl::string_view();
      token->depth = 0;
      return absl::OkStatus();
    }
    const size_t start = pos_;
    const char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      while (pos_ < text_.size() && text_[pos_] != '"' && text_[pos_] != '\n') {
        pos_ += text_[pos_] == '\\' && pos_ + 1 < text_.size() && text_[pos_ + 1] != '\n' ? 2 : 1;
      }
      if (pos_ >= text_.size() || text_[pos_] != '"') {
        return Error(line_, "a string literal is not closed on its line");
      }
      ++pos_;
      token->kind = Token::Kind::kString;
    } else if (IsWordChar(c)) {
      while (pos_ < text_.size() && IsWordChar(text_[pos_])) ++pos_;
      token->kind = Token::Kind::kWord;
    } else {
      const auto byte = static_cast<unsigned char>(c);
      if (byte < 0x20 || byte >= 0x7f) {
        return Error(line_, absl::StrFormat("byte 0x%02x is not PTX text (PTX is ASCII; a cubin "
                                            "or fatbin must start with its magic number)",
                                            byte));
      }
      ++pos_;
      token->kind = Token::Kind::kPunct;
      GPURPC_RETURN_IF_ERROR(Nest(c));
    }
    token->text = text_.substr(start, pos_ - start);
    token->depth = open_.size();
    return absl::OkStatus();
  }

 private:
  absl::Status SkipSpaceAndComments() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '\n') {
        ++line_;
        ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
        ++pos_;
      } else if (text_.substr(pos_, 2) == "//") {
        const size_t end = text_.find('\n', pos_);
        pos_ = end == absl::string_view::npos ? text_.size() : end;
      } else if (text_.substr(pos_, 2) == "/*") {
        const size_t end = text_.find("*/", pos_ + 2);
        if (end == absl::string_view::npos) return Error(line_, "a /* comment is never closed");
        for (size_t i = pos_; i < end; ++i) line_ += text_[i] == '\n' ? 1 : 0;
        pos_ = end + 2;
      } else {
        break;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Nest(char c) {
    if (c == '{' || c == '(' || c == '[') {
      if (open_.size() >= kMaxNesting) {
        return Error(
            line_, absl::StrCat("braces, parentheses and brackets nest deeper than ", kMaxNesting));
      }
      open_.emplace_back(c, line_);
      return absl::OkStatus();
    }
    const char opener = c == '}' ? '{' : c == ')' ? '(' : c == ']' ? '[' : '\0';
    if (opener == '\0') return absl::OkStatus();
    if (open_.empty()) {
      return Error(line_, absl::StrCat("'", std::string(1, c), "' closes nothing"));
    }
    if (open_.back().first != opener) {
      return Error(line_, absl::StrCat("'", std::string(1, c), "' does not close the '",
                                       std::string(1, open_.back().first), "' of line ",
                                       open_.back().second));
    }
    open_.pop_back();
    return absl::OkStatus();
  }

  const absl::string_view text_;
  size_t pos_ = 0;
  uint64_t line_ = 1;
  std::vector<std::pair<char, uint64_t>> open_;
};

// Reads the module-scope structure of PTX: the header directives, declarations, and the
// header of every function; function bodies are only skipped (balanced).
class PtxChecker {
 public:
  explicit PtxChecker(absl::string_view text) : lexer_(text) {}

  absl::StatusOr<std::vector<DeclaredKernel>> Run() {
    GPURPC_RETURN_IF_ERROR(ReadHeader());
    Token token;
    for (;;) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (token.kind == Token::Kind::kEnd) break;
      if (token.Is(";")) continue;
      while (token.kind == Token::Kind::kWord && IsLinkage(token.text)) {
        GPURPC_RETURN_IF_ERROR(Next(&token));
      }
      GPURPC_RETURN_IF_ERROR(ReadModuleStatement(token));
    }
    return std::move(kernels_);
  }

 private:
  absl::Status Next(Token* token) {
    if (has_pushed_back_) {
      *token = pushed_back_;
      has_pushed_back_ = false;
      return absl::OkStatus();
    }
    return lexer_.Next(token);
  }

  void PushBack(const Token& token) {
    pushed_back_ = token;
    has_pushed_back_ = true;
  }

  absl::Status ReadHeader() {
    Token token;
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (token.kind == Token::Kind::kEnd) {
      return Error(token.line, "the PTX text holds nothing but whitespace and comments");
    }
    if (!token.Is(".version")) {
      return Error(token.line,
                   absl::StrCat("PTX must begin with a .version directive, not ", Describe(token)));
    }
    GPURPC_RETURN_IF_ERROR(Next(&token));
    const size_t dot = token.text.find('.');
    if (token.kind != Token::Kind::kWord || dot == absl::string_view::npos ||
        !IsDigits(token.text.substr(0, dot)) || !IsDigits(token.text.substr(dot + 1))) {
      return Error(token.line, absl::StrCat(".version needs a MAJOR.MINOR number such as 8.0, not ",
                                            Describe(token)));
    }
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (!token.Is(".target")) {
      return Error(token.line,
                   absl::StrCat(".version must be followed by .target, not ", Describe(token)));
    }
    for (;;) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (token.kind != Token::Kind::kWord || !IsTargetName(token.text)) {
        return Error(token.line, absl::StrCat("unknown .target ", Describe(token),
                                              " (expected sm_NN or compute_NN, e.g. compute_75)"));
      }
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (!token.Is(",")) break;
    }
    if (token.Is(".address_size")) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (!token.Is("32") && !token.Is("64")) {
        return Error(token.line,
                     absl::StrCat(".address_size must be 32 or 64, not ", Describe(token)));
      }
    } else {
      PushBack(token);
    }
    return absl::OkStatus();
  }

  // `token` is the statement's first word after its linkage directives.
  absl::Status ReadModuleStatement(const Token& token) {
    if (!token.IsDirective()) {
      return Error(token.line,
                   absl::StrCat(Describe(token),
                                " at module scope: outside function bodies PTX holds only "
                                "directives (.entry, .func, .global, .const, ...)"));
    }
    const absl::string_view directive = token.text;
    if (directive == ".entry") return ReadFunction(token, /*is_entry=*/true);
    if (directive == ".func") return ReadFunction(token, /*is_entry=*/false);
    if (IsStateSpace(directive) || directive == ".reg" || directive == ".tex") {
      return SkipDeclaration(token);
    }
    if (directive == ".file") return ReadFile(token);
    if (directive == ".section") return SkipSection(token);
    if (directive == ".pragma" || directive == ".alias") return SkipDeclaration(token);
    if (directive == ".version" || directive == ".target" || directive == ".address_size") {
      return Error(token.line,
                   absl::StrCat(directive, " may appear only once, at the start of the module"));
    }
    return Error(token.line,
                 absl::StrCat("unknown directive ", Describe(token), " at module scope"));
  }

  // Up to the `;` that ends the statement; braces only in an initializer (after `=`).
  absl::Status SkipDeclaration(const Token& first) {
    const size_t depth = first.depth;
    bool initializer = false;
    Token token;
    for (;;) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (token.kind == Token::Kind::kEnd) {
        return Error(first.line,
                     absl::StrCat("the ", first.text, " statement is not ended by ';'"));
      }
      if (token.Is("=")) initializer = true;
      if (token.Is("{") && !initializer) {
        return Error(token.line, absl::StrCat("'{' in the ", first.text, " statement of line ",
                                              first.line, " (a missing ';'?)"));
      }
      if (token.Is(";") && token.depth == depth) return absl::OkStatus();
    }
  }

  // `.file 1 "name"` or `.file 1 "name", timestamp, size`: a line directive, no `;`.
  absl::Status ReadFile(const Token& first) {
    Token token;
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (!ParseInteger(token.text) || token.kind != Token::Kind::kWord) {
      return Error(first.line, absl::StrCat(".file needs a file number, not ", Describe(token)));
    }
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (token.kind != Token::Kind::kString) {
      return Error(first.line,
                   absl::StrCat(".file needs a quoted file name, not ", Describe(token)));
    }
    for (int i = 0; i < 2; ++i) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (!token.Is(",")) {
        PushBack(token);
        return absl::OkStatus();
      }
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (token.kind != Token::Kind::kWord || !ParseInteger(token.text)) {
        return Error(first.line, absl::StrCat(".file: ", Describe(token), " is not a number"));
      }
    }
    return absl::OkStatus();
  }

  // `.section .debug_info { ... }`.
  absl::Status SkipSection(const Token& first) {
    Token token;
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (!token.IsDirective()) {
      return Error(first.line,
                   absl::StrCat(".section needs a section name, not ", Describe(token)));
    }
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (!token.Is("{")) {
      return Error(token.line, absl::StrCat(".section ", Describe(token), ": expected '{'"));
    }
    return SkipBlock(token);
  }

  // `open` is a `{`; consumes up to its `}`.
  absl::Status SkipBlock(const Token& open) {
    Token token;
    for (;;) {
      GPURPC_RETURN_IF_ERROR(Next(&token));
      // The lexer refuses the end of the text with a brace open, so this loop ends.
      if (token.kind == Token::Kind::kEnd) return Error(open.line, "'{' is never closed");
      if (token.Is("}") && token.depth + 1 == open.depth) return absl::OkStatus();
    }
  }

  // `.entry name (params) directives { body }`, or `;` instead of a body; `.func` may have a
  // return parameter list before its name, and `.reg` parameters.
  absl::Status ReadFunction(const Token& first, bool is_entry) {
    const absl::string_view what = is_entry ? "kernel" : "function";
    Token token;
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (!is_entry && token.Is("(")) {
      std::vector<ParamInfo> ignored;
      GPURPC_RETURN_IF_ERROR(ReadParams(token, "a function's return value", false, &ignored));
      GPURPC_RETURN_IF_ERROR(Next(&token));
    }
    if (token.kind != Token::Kind::kWord || !IsIdentifier(token.text)) {
      return Error(token.line,
                   absl::StrCat(first.text, " needs a ", what, " name, not ", Describe(token)));
    }
    const std::string name(token.text);
    const std::string owner = absl::StrCat(what, " '", name, "'");
    std::vector<ParamInfo> params;
    GPURPC_RETURN_IF_ERROR(Next(&token));
    if (token.Is("(")) {
      GPURPC_RETURN_IF_ERROR(ReadParams(token, owner, is_entry, &params));
      GPURPC_RETURN_IF_ERROR(Next(&token));
    }
    while (token.IsDirective() || token.Is(",") ||
           (token.kind == Token::Kind::kWord && ParseInteger(token.text))) {
      if (token.IsDirective() && !IsHeaderDirective(token.text)) {
        return Error(token.line, absl::StrCat("unknown directive ", Describe(token),
                                              " in the header of ", owner));
      }
      GPURPC_RETURN_IF_ERROR(Next(&token));
    }
    if (token.Is(";")) {  // a declaration: defines nothing
      declared_.insert(name);
      return absl::OkStatus();
    }
    if (!token.Is("{")) {
      return Error(token.line, absl::StrCat(Describe(token), " after the header of ", owner,
                                            ": expected its body ('{') or ';'"));
    }
    if (!defined_.insert(name).second) {
      return Error(first.line, absl::StrCat(owner, " is defined twice"));
    }
    GPURPC_RETURN_IF_ERROR(SkipBlock(token));
    if (is_entry) kernels_.push_back(DeclaredKernel{name, std::move(params)});
    return absl::OkStatus();
  }

  // `open` is the `(`; reads up to its `)`. Kernel parameters are `.param` only and their
  // layout goes to `params`.
  absl::Status ReadParams(const Token& open, absl::string_view owner, bool is_entry,
                          std::vector<ParamInfo>* params) {
    uint64_t end_bytes = 0;
    Token token;
    for (size_t index = 0;; ++index) {
      const auto bad = [&](absl::string_view what) {
        return Error(token.line, absl::StrCat("parameter ", index, " of ", owner, ": ", what));
      };
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (index == 0 && token.Is(")")) return absl::OkStatus();
      if (!token.Is(".param") && (is_entry || !token.Is(".reg"))) {
        return bad(absl::StrCat("expected ", is_entry ? ".param" : ".param or .reg", ", not ",
                                Describe(token)));
      }
      uint64_t align = 0;
      std::optional<uint64_t> element_bytes;
      uint64_t vector = 1;
      bool pointer = false;
      for (;;) {
        GPURPC_RETURN_IF_ERROR(Next(&token));
        if (token.Is(".align")) {
          GPURPC_RETURN_IF_ERROR(Next(&token));
          const std::optional<uint64_t> value =
              token.kind == Token::Kind::kWord ? ParseInteger(token.text) : std::nullopt;
          if (!value || *value == 0 || (*value & (*value - 1)) != 0 || *value > 4096) {
            return bad(absl::StrCat(".align needs a power of two, not ", Describe(token)));
          }
          if (!pointer) align = *value;  // after .ptr it is the pointee's alignment
        } else if (token.Is(".ptr")) {
          if (!element_bytes) return bad(".ptr before the parameter's type");
          pointer = true;
        } else if (token.IsDirective() && IsStateSpace(token.text)) {
          if (!pointer) return bad(absl::StrCat(Describe(token), " outside a .ptr attribute"));
        } else if (token.Is(".v2") || token.Is(".v4")) {
          vector = token.text[2] - '0';
        } else if (token.IsDirective()) {
          const std::optional<uint64_t> bytes = ParamTypeBytes(token.text, !is_entry);
          if (!bytes) return bad(absl::StrCat("unknown type ", Describe(token)));
          if (element_bytes) return bad(absl::StrCat("a second type ", Describe(token)));
          element_bytes = *bytes;
        } else {
          break;
        }
      }
      if (!element_bytes) return bad(absl::StrCat("no type before ", Describe(token)));
      if (token.kind != Token::Kind::kWord || !IsIdentifier(token.text)) {
        return bad(absl::StrCat("expected its name, not ", Describe(token)));
      }
      uint64_t count = 1;
      GPURPC_RETURN_IF_ERROR(Next(&token));
      if (token.Is("[")) {
        GPURPC_RETURN_IF_ERROR(Next(&token));
        const std::optional<uint64_t> extent =
            token.kind == Token::Kind::kWord ? ParseInteger(token.text) : std::nullopt;
        if (!extent || *extent == 0 || *extent > kMaxExtent) {
          return bad(absl::StrCat("array extent ", Describe(token), " is not a positive number"));
        }
        count = *extent;
        GPURPC_RETURN_IF_ERROR(Next(&token));
        if (!token.Is("]")) return bad(absl::StrCat("expected ']', not ", Describe(token)));
        GPURPC_RETURN_IF_ERROR(Next(&token));
      }
      const uint64_t size_bytes = *element_bytes * vector * count;  // < 2^32 * 64: no overflow
      const uint64_t offset = AlignUp(end_bytes, align != 0 ? align : *element_bytes * vector);
      end_bytes = offset + size_bytes;
      if (is_entry) {
        if (end_bytes > kMaxKernelParamBytes) {
          return bad(absl::StrCat("the parameters take more than the ", kMaxKernelParamBytes,
                                  " bytes a kernel may take"));
        }
        params->push_back(
            ParamInfo{static_cast<uint32_t>(offset), static_cast<uint32_t>(size_bytes)});
      }
      if (token.Is(")") && token.depth + 1 == open.depth) return absl::OkStatus();
      if (!token.Is(",")) return bad(absl::StrCat("expected ',' or ')', not ", Describe(token)));
    }
  }

  PtxLexer lexer_;
  // Not a std::optional: GCC 12 under ASan warns (wrongly) that it may be uninitialized.
  Token pushed_back_;
  bool has_pushed_back_ = false;
  std::set<std::string> defined_;
  std::set<std::string> declared_;
  std::vector<DeclaredKernel> kernels_;

 public:
  // After Run: kernels and functions with a body, and functions only declared here.
  const std::set<std::string>& defined() const { return defined_; }
  std::vector<std::string> External() const {
    std::vector<std::string> external;
    for (const std::string& name : declared_) {
      if (defined_.count(name) == 0) external.push_back(name);
    }
    return external;
  }
};

// PTX bytes as the driver reads them: text up to a NUL, here required to be at the end.
absl::StatusOr<absl::string_view> PtxTextOf(absl::Span<const uint8_t> image) {
  absl::string_view text(reinterpret_cast<const char*>(image.data()), image.size());
  while (!text.empty() && text.back() == '\0') text.remove_suffix(1);
  if (text.empty()) return absl::InvalidArgumentError("the PTX text is empty (only NUL bytes)");
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte ", nul, " of ", image.size(),
        " is a NUL inside the text; PTX is text (a cubin or fatbin must start with its "
        "magic number)"));
  }
  return text;
}

absl::Status ReadPtx(absl::Span<const uint8_t> image, FakeModuleImage* out) {
  GPURPC_ASSIGN_OR_RETURN(const absl::string_view text, PtxTextOf(image));
  if (text.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("the PTX text holds a NUL byte");
  }
  PtxChecker checker(text);
  GPURPC_ASSIGN_OR_RETURN(out->kernels, checker.Run());
  out->defined_functions.assign(checker.defined().begin(), checker.defined().end());
  out->external_functions = checker.External();
  out->globals = ParsePtxGlobals(text);
  return absl::OkStatus();
}

// --- cubin ----------------------------------------------------------------------------------

// The functions the symbol tables of `elf` define. ModuleFootprintBytes has checked the
// section header table and that every section with contents lies within the image.
absl::StatusOr<std::vector<DeclaredKernel>> CubinKernels(absl::Span<const uint8_t> elf) {
  const uint8_t* bytes = elf.data();
  if (elf[kElfDataOffset] != kElfDataLittleEndian) {
    return absl::InvalidArgumentError("the ELF is not little-endian; cubins are");
  }
  const uint16_t machine = Load<uint16_t>(bytes, kElfMachineOffset);
  if (machine != kElfMachineCuda) {
    return absl::InvalidArgumentError(absl::StrCat("the ELF is for machine ", machine,
                                                   ", not a CUDA GPU (EM_CUDA, ", kElfMachineCuda,
                                                   "): load a cubin from nvcc or NVRTC"));
  }
  const uint64_t shoff = Load<uint64_t>(bytes, kElfShoffOffset);
  const uint64_t shentsize = Load<uint16_t>(bytes, kElfShentsizeOffset);
  const uint64_t shnum = Load<uint16_t>(bytes, kElfShnumOffset);
  if (shnum == 0) return absl::InvalidArgumentError("the ELF has no sections, so no code");
  std::vector<DeclaredKernel> kernels;
  std::set<std::string> seen;
  for (uint64_t i = 0; i < shnum; ++i) {
    const uint64_t header = shoff + i * shentsize;
    if (Load<uint32_t>(bytes, header + kElfShTypeOffset) != kElfShtSymtab) continue;
    const uint64_t offset = Load<uint64_t>(bytes, header + kElfShOffsetOffset);
    const uint64_t size = Load<uint64_t>(bytes, header + kElfShSizeOffset);
    const uint64_t entsize = Load<uint64_t>(bytes, header + kElfShEntsizeOffset);
    const uint64_t link = Load<uint32_t>(bytes, header + kElfShLinkOffset);
    if (entsize != kElfSymbolBytes || size % kElfSymbolBytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("symbol table section ", i, " has entries of ", entsize, " bytes over ",
                       size, " bytes; ELF64 symbols take ", kElfSymbolBytes));
    }
    if (link == 0 || link >= shnum ||
        Load<uint32_t>(bytes, shoff + link * shentsize + kElfShTypeOffset) == kElfShtNobits) {
      return absl::InvalidArgumentError(absl::StrCat("symbol table section ", i,
                                                     " names string table section ", link,
                                                     ", which has no contents"));
    }
    const uint64_t names_header = shoff + link * shentsize;
    const uint64_t names_offset = Load<uint64_t>(bytes, names_header + kElfShOffsetOffset);
    const uint64_t names_size = Load<uint64_t>(bytes, names_header + kElfShSizeOffset);
    if (!InBounds(offset, size, elf.size()) || !InBounds(names_offset, names_size, elf.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("symbol table section ", i, " lies outside the image (truncated?)"));
    }
    const absl::string_view names(reinterpret_cast<const char*>(bytes) + names_offset, names_size);
    for (uint64_t s = 0; s < size / kElfSymbolBytes; ++s) {
      const uint64_t symbol = offset + s * kElfSymbolBytes;
      const uint8_t info = bytes[symbol + kElfSymInfoOffset];
      const uint16_t section = Load<uint16_t>(bytes, symbol + kElfSymShndxOffset);
      if ((info & 0xf) != kElfSttFunc || section == 0) continue;
      const uint64_t name_offset = Load<uint32_t>(bytes, symbol);
      const size_t end =
          name_offset < names.size() ? names.find('\0', name_offset) : absl::string_view::npos;
      if (end == absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat("the name of symbol ", s, " of section ", i,
                                                       " lies outside its string table"));
      }
      std::string name(names.substr(name_offset, end - name_offset));
      if (!name.empty() && seen.insert(name).second) {
        kernels.push_back(DeclaredKernel{std::move(name), std::nullopt});
      }
    }
  }
  return kernels;
}

// --- fatbin ---------------------------------------------------------------------------------

// Checks every entry; takes the first PTX entry, else the first cubin.
absl::Status ReadFatbin(absl::Span<const uint8_t> image, FakeModuleImage* out) {
  const uint8_t* bytes = image.data();
  const uint64_t first = Load<uint16_t>(bytes, kFatbinHeaderSizeOffset);
  const uint64_t payload_size = Load<uint64_t>(bytes, kFatbinPayloadSizeOffset);
  if (!InBounds(first, payload_size, image.size())) {
    return absl::InvalidArgumentError("the fatbin payload lies outside the image");
  }
  const uint64_t end = first + payload_size;
  std::optional<FakeModuleImage> ptx;
  std::optional<FakeModuleImage> cubin;
  for (uint64_t pos = first, index = 0; pos < end; ++index) {
    if (!InBounds(pos, kFatbinEntryHeaderBytes, end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the header of fatbin entry ", index, " lies outside the payload"));
    }
    const uint16_t kind = Load<uint16_t>(bytes, pos);
    const uint64_t header_size = Load<uint32_t>(bytes, pos + kFatbinEntryHeaderSizeOffset);
    const uint64_t size = Load<uint64_t>(bytes, pos + kFatbinEntryPayloadSizeOffset);
    if (header_size < kFatbinEntryHeaderBytes || !InBounds(pos, header_size, end) ||
        !InBounds(pos + header_size, size, end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fatbin entry ", index, " lies outside the payload"));
    }
    const absl::Span<const uint8_t> payload = image.subspan(pos + header_size, size);
    if (kind == kFatbinKindPtx) {
      FakeModuleImage entry;
      if (absl::Status status = ReadPtx(payload, &entry); !status.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fatbin entry ", index, " (PTX): ", status.message()));
      }
      if (!ptx) ptx = std::move(entry);
    } else if (kind == kFatbinKindElf || kind == kFatbinKindElfAlt) {
      if (payload.size() < 4 || DetectImageFormat(payload) != ImageFormat::kCubin) {
        return absl::InvalidArgumentError(
            absl::StrCat("fatbin entry ", index, " (cubin) is not an ELF"));
      }
      absl::StatusOr<std::vector<DeclaredKernel>> kernels = CubinKernels(payload);
      if (!kernels.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fatbin entry ", index, " (cubin): ", kernels.status().message()));
      }
      if (!cubin) {
        cubin.emplace();
        cubin->kernels = *std::move(kernels);
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("fatbin entry ", index, " is of kind ", kind, ", neither cubin nor PTX"));
    }
    pos += header_size + size;
  }
  std::optional<FakeModuleImage>& chosen = ptx ? ptx : cubin;
  if (!chosen) return absl::NotFoundError("the fatbin holds no cubin and no PTX");
  out->kernels = std::move(chosen->kernels);
  out->globals = std::move(chosen->globals);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<DeclaredKernel>> CheckPtxText(absl::string_view ptx) {
  if (ptx.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("the PTX text holds a NUL byte");
  }
  return PtxChecker(ptx).Run();
}

absl::StatusOr<FakeModuleImage> ReadFakeModuleImage(absl::Span<const uint8_t> image,
                                                    absl::string_view call) {
  if (image.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", kInvalidImage, ": the image is empty"));
  }
  FakeModuleImage out;
  out.format = DetectImageFormat(image);
  const std::string what =
      absl::StrCat(ImageFormatName(out.format), " image of ", image.size(), " bytes rejected: ");
  // The checks the CUDA backend makes before the driver sees the image, then what the
  // driver would refuse.
  absl::StatusOr<uint64_t> footprint = ModuleFootprintBytes(image);
  if (!footprint.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", kInvalidImage, ": ", what, footprint.status().message()));
  }
  out.device_memory_bytes = *footprint;
  absl::Status status;
  switch (out.format) {
    case ImageFormat::kPtx:
      status = ReadPtx(image, &out);
      if (!status.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(call, ": ", kInvalidPtx, ": ", what, status.message()));
      }
      break;
    case ImageFormat::kCubin: {
      absl::StatusOr<std::vector<DeclaredKernel>> kernels = CubinKernels(image);
      if (!kernels.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(call, ": ", kInvalidImage, ": ", what, kernels.status().message()));
      }
      out.kernels = *std::move(kernels);
      break;
    }
    case ImageFormat::kFatbin:
      status = ReadFatbin(image, &out);
      if (!status.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            call, ": ", status.code() == absl::StatusCode::kNotFound ? kNoBinary : kInvalidImage,
            ": ", what, status.message()));
      }
      break;
  }
  return out;
}

absl::Status CheckArchive(absl::Span<const uint8_t> archive) {
  constexpr absl::string_view kMagic = "!<arch>\n";
  constexpr uint64_t kHeaderBytes = 60;
  const absl::string_view bytes(reinterpret_cast<const char*>(archive.data()), archive.size());
  if (!absl::StartsWith(bytes, kMagic)) {
    return absl::InvalidArgumentError("not an ar archive (no \"!<arch>\" magic)");
  }
  uint64_t offset = kMagic.size();
  int members = 0;
  while (offset < archive.size()) {
    if (archive.size() - offset < kHeaderBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("member ", members, "'s header at byte ", offset, " is cut short"));
    }
    const absl::string_view header = bytes.substr(offset, kHeaderBytes);
    if (header.substr(58, 2) != "`\n") {
      return absl::InvalidArgumentError(
          absl::StrCat("member ", members, "'s header at byte ", offset, " is malformed"));
    }
    const absl::string_view size_field = absl::StripAsciiWhitespace(header.substr(48, 10));
    const std::optional<uint64_t> size = ParseInteger(size_field);
    if (!size || !IsDigits(size_field)) {
      return absl::InvalidArgumentError(
          absl::StrCat("member ", members, " at byte ", offset, " has no valid size"));
    }
    offset += kHeaderBytes;
    if (*size > archive.size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat("member ", members, " at byte ", offset,
                                                     " runs past the end of the archive"));
    }
    offset += *size + (*size % 2);  // members are 2-byte aligned
    ++members;
  }
  if (members == 0) return absl::InvalidArgumentError("the archive has no members");
  return absl::OkStatus();
}

}  // namespace gpurpc::backend::fake
