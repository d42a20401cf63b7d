#include "server/worker/backend/fake/ptx_globals.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace gpurpc::backend::fake {
namespace {

// Far beyond any device; a declaration claiming more is garbage, not a global to allocate.
constexpr uint64_t kMaxGlobalSizeBytes = uint64_t{1} << 48;

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > kMaxGlobalSizeBytes / a) return std::nullopt;
  return a * b;
}

// Comments go first so that a `;` or `{` inside one cannot split a statement. A line
// comment's newline is kept: it ends line directives such as `.version`.
std::string StripComments(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == '"') {
      const size_t close = text.find('"', i + 1);
      const size_t stop = close == absl::string_view::npos ? text.size() : close + 1;
      out.append(text.data() + i, stop - i);
      i = stop;
    } else if (text.substr(i, 2) == "//") {
      i = text.find('\n', i);
      if (i == absl::string_view::npos) break;
    } else if (text.substr(i, 2) == "/*") {
      out.push_back(' ');
      const size_t close = text.find("*/", i + 2);
      if (close == absl::string_view::npos) break;
      i = close + 2;
    } else {
      out.push_back(text[i++]);
    }
  }
  return out;
}

// Module-scope directives that end at the end of their line instead of at a `;`.
bool IsLineDirective(absl::string_view statement) {
  statement = absl::StripLeadingAsciiWhitespace(statement);
  for (absl::string_view directive : {".version", ".target", ".address_size", ".file"}) {
    if (absl::StartsWith(statement, directive)) return true;
  }
  return false;
}

// Splits the text into the `;`-terminated statements outside any `{ ... }` body (functions,
// debug sections). Braces after an `=` are an initializer and stay in the statement.
std::vector<std::string> ModuleScopeStatements(absl::string_view text) {
  std::vector<std::string> statements;
  std::string current;
  int body_depth = 0;
  int initializer_depth = 0;
  bool in_string = false;
  for (const char c : text) {
    if (body_depth > 0) {
      if (c == '{') ++body_depth;
      if (c == '}') --body_depth;
      continue;
    }
    if (in_string) {
      current.push_back(c);
      in_string = c != '"';
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        current.push_back(c);
        break;
      case '{':
        if (initializer_depth > 0 || current.find('=') != std::string::npos) {
          ++initializer_depth;
          current.push_back(c);
        } else {
          // A body: the header before it (`.entry name(...)`) declares no variable.
          body_depth = 1;
          current.clear();
        }
        break;
      case '}':
        if (initializer_depth > 0) --initializer_depth;
        current.push_back(c);
        break;
      case ';':
        statements.push_back(std::move(current));
        current.clear();
        initializer_depth = 0;
        break;
      case '\n':
        if (initializer_depth == 0 && IsLineDirective(current)) {
          current.clear();
        } else {
          current.push_back(' ');
        }
        break;
      default:
        current.push_back(c);
    }
  }
  return statements;
}

bool IsLinkage(absl::string_view token) {
  return token == ".visible" || token == ".extern" || token == ".weak" || token == ".common";
}

std::optional<uint64_t> ScalarSizeBytes(absl::string_view type) {
  for (absl::string_view t : {".b8", ".u8", ".s8"}) {
    if (type == t) return 1;
  }
  for (absl::string_view t : {".b16", ".u16", ".s16", ".f16", ".bf16"}) {
    if (type == t) return 2;
  }
  for (absl::string_view t : {".b32", ".u32", ".s32", ".f32", ".f16x2", ".bf16x2"}) {
    if (type == t) return 4;
  }
  for (absl::string_view t : {".b64", ".u64", ".s64", ".f64"}) {
    if (type == t) return 8;
  }
  if (type == ".b128") return 16;
  return std::nullopt;
}

bool IsIdentifier(absl::string_view name) {
  if (name.empty() || absl::ascii_isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (const char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '$' && c != '%') {
      return false;
    }
  }
  return true;
}

// Leaf values of `{1, {2, 3}}`: commas at every depth separate them.
uint64_t CountInitializerValues(absl::string_view initializer) {
  initializer = absl::StripAsciiWhitespace(initializer);
  if (initializer.empty()) return 0;
  uint64_t values = 1;
  for (const char c : initializer) values += c == ',' ? 1 : 0;
  return values;
}

// `name`, `name[16]`, `name[4][4]` or `name[]` (sized by its initializer) to a name and an
// element count.
std::optional<std::pair<std::string, uint64_t>> ParseDeclarator(absl::string_view declarator,
                                                                absl::string_view initializer) {
  const size_t bracket = declarator.find('[');
  const absl::string_view name = declarator.substr(0, bracket);
  if (!IsIdentifier(name)) return std::nullopt;
  uint64_t known_count = 1;
  bool has_unsized_dim = false;
  absl::string_view rest =
      bracket == absl::string_view::npos ? absl::string_view() : declarator.substr(bracket);
  while (!rest.empty()) {
    const size_t close = rest.find(']');
    if (rest[0] != '[' || close == absl::string_view::npos) return std::nullopt;
    const absl::string_view dim_text = rest.substr(1, close - 1);
    rest.remove_prefix(close + 1);
    if (dim_text.empty()) {
      if (has_unsized_dim) return std::nullopt;
      has_unsized_dim = true;
      continue;
    }
    uint64_t dim = 0;
    if (!absl::SimpleAtoi(dim_text, &dim)) return std::nullopt;
    const std::optional<uint64_t> product = CheckedMul(known_count, dim);
    if (!product) return std::nullopt;
    known_count = *product;
  }
  if (!has_unsized_dim) return std::make_pair(std::string{name}, known_count);
  if (known_count == 0) return std::nullopt;
  const uint64_t values = CountInitializerValues(initializer);
  const uint64_t unsized_dim = (values + known_count - 1) / known_count;
  const std::optional<uint64_t> count = CheckedMul(known_count, unsized_dim);
  if (!count || *count == 0) return std::nullopt;
  return std::make_pair(std::string{name}, *count);
}

// Appends the variables a `.global`/`.const` statement declares; ignores any other statement.
void ParseDeclaration(absl::string_view statement, std::vector<PtxGlobal>* globals) {
  absl::string_view declaration = statement;
  absl::string_view initializer;
  if (const size_t equals = statement.find('='); equals != absl::string_view::npos) {
    declaration = statement.substr(0, equals);
    initializer = statement.substr(equals + 1);
  }
  const std::vector<absl::string_view> tokens =
      absl::StrSplit(declaration, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty());
  size_t i = 0;
  while (i < tokens.size() && IsLinkage(tokens[i])) ++i;
  if (i == tokens.size() || (tokens[i] != ".global" && tokens[i] != ".const")) return;
  ++i;
  uint64_t vector_width = 1;
  std::optional<uint64_t> scalar_size;
  for (; i < tokens.size() && absl::StartsWith(tokens[i], "."); ++i) {
    const absl::string_view token = tokens[i];
    if (token == ".align") {
      ++i;  // and its operand
    } else if (absl::StartsWith(token, ".attribute")) {
      continue;
    } else if (token == ".v2" || token == ".v4" || token == ".v8") {
      vector_width = token[2] - '0';
    } else if (std::optional<uint64_t> size = ScalarSizeBytes(token)) {
      scalar_size = size;
    } else {
      return;  // .texref, .samplerref, .surfref or something newer: no plain data
    }
  }
  if (!scalar_size || i > tokens.size()) return;
  const std::string declarators =
      absl::StrJoin(tokens.begin() + static_cast<std::ptrdiff_t>(i), tokens.end(), "");
  for (absl::string_view declarator : absl::StrSplit(declarators, ',', absl::SkipEmpty())) {
    std::optional<std::pair<std::string, uint64_t>> parsed =
        ParseDeclarator(declarator, initializer);
    if (!parsed) continue;
    std::optional<uint64_t> size_bytes = CheckedMul(*scalar_size * vector_width, parsed->second);
    if (!size_bytes) continue;
    globals->push_back(PtxGlobal{std::move(parsed->first), *size_bytes});
  }
}

}  // namespace

bool LooksLikePtxText(absl::string_view image) {
  while (!image.empty() && image.back() == '\0') image.remove_suffix(1);
  return !image.empty() && image.find('\0') == absl::string_view::npos;
}

std::vector<PtxGlobal> ParsePtxGlobals(absl::string_view ptx) {
  std::vector<PtxGlobal> declared;
  for (const std::string& statement : ModuleScopeStatements(StripComments(ptx))) {
    ParseDeclaration(statement, &declared);
  }
  std::vector<PtxGlobal> globals;
  std::set<std::string> seen;
  for (PtxGlobal& global : declared) {
    if (seen.insert(global.name).second) globals.push_back(std::move(global));
  }
  return globals;
}

}  // namespace gpurpc::backend::fake
