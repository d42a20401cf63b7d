#include "server/worker/backend/ptx_globals.h"

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
#include "absl/strings/string_view.h"

namespace gpurpc::backend {
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

struct Statement {
  std::string text;
  bool in_function = false;
};

// Splits the text into `;`-terminated statements, each marked with whether it lies inside a
// `{ ... }` body (a function or a block in one). Braces after an `=` are an initializer and
// stay in the statement. Text before a `{` or `}` that ends no statement is kept as one (a
// function header declares no variable), so that malformed text is read, not dropped.
std::vector<Statement> SplitStatements(absl::string_view text) {
  std::vector<Statement> statements;
  std::string current;
  uint64_t body_depth = 0;
  uint64_t initializer_depth = 0;
  bool in_string = false;
  const auto flush = [&] {
    if (!absl::StripAsciiWhitespace(current).empty()) {
      statements.push_back(Statement{std::move(current), body_depth > 0});
    }
    current.clear();
    initializer_depth = 0;
  };
  for (const char c : text) {
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
          flush();
          ++body_depth;
        }
        break;
      case '}':
        if (initializer_depth > 0) {
          --initializer_depth;
          current.push_back(c);
        } else {
          // A stray `}` at module scope ends the statement before it rather than hiding
          // the ones after it.
          flush();
          if (body_depth > 0) --body_depth;
        }
        break;
      case ';':
        flush();
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
  flush();  // an unterminated last statement still counts
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

bool IsHandleType(absl::string_view type) {
  return type == ".texref" || type == ".samplerref" || type == ".surfref";
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

// A PTX integer constant as an array extent or alignment: decimal or 0x hex, with an
// optional U suffix. (A leading-0 octal reads as decimal, which is never smaller.)
std::optional<uint64_t> ParseInteger(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (!text.empty() && (text.back() == 'U' || text.back() == 'u')) text.remove_suffix(1);
  uint64_t value = 0;
  if (absl::StartsWithIgnoreCase(text, "0x")) {
    text.remove_prefix(2);
    if (text.empty() || !absl::SimpleHexAtoi(text, &value)) return std::nullopt;
  } else if (text.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(text[0])) ||
             !absl::SimpleAtoi(text, &value)) {
    return std::nullopt;
  }
  return value;
}

// Leaf values of `{1, {2, 3}}`: commas at every depth separate them.
uint64_t CountInitializerValues(absl::string_view initializer) {
  initializer = absl::StripAsciiWhitespace(initializer);
  if (initializer.empty()) return 0;
  uint64_t values = 1;
  for (const char c : initializer) values += c == ',' ? 1 : 0;
  return values;
}

// Fills name, size_bytes and unsized of `variable` from `name`, `name[16]`, `name[4][4]` or
// `name[]` (sized by its initializer). `element_bytes` is nullopt for an unreadable type.
void ParseDeclarator(absl::string_view declarator, absl::string_view initializer,
                     std::optional<uint64_t> element_bytes, PtxVariable* variable) {
  const size_t bracket = declarator.find('[');
  const absl::string_view name = declarator.substr(0, bracket);
  if (!IsIdentifier(name)) return;
  variable->name = std::string(name);
  uint64_t known_count = 1;
  bool has_unsized_dim = false;
  absl::string_view rest =
      bracket == absl::string_view::npos ? absl::string_view() : declarator.substr(bracket);
  while (!rest.empty()) {
    const size_t close = rest.find(']');
    if (rest[0] != '[' || close == absl::string_view::npos) return;
    const absl::string_view dim_text = rest.substr(1, close - 1);
    rest.remove_prefix(close + 1);
    if (dim_text.empty()) {
      if (has_unsized_dim) return;
      has_unsized_dim = true;
      continue;
    }
    const std::optional<uint64_t> dim = ParseInteger(dim_text);
    if (!dim) return;
    const std::optional<uint64_t> product = CheckedMul(known_count, *dim);
    if (!product) return;
    known_count = *product;
  }
  uint64_t count = known_count;
  if (has_unsized_dim) {
    const uint64_t values = CountInitializerValues(initializer);
    if (values == 0) {
      // `.extern .global .b8 buf[];` names storage defined elsewhere.
      variable->unsized = true;
      if (variable->is_extern) variable->size_bytes = 0;
      return;
    }
    if (known_count == 0) return;
    const std::optional<uint64_t> total =
        CheckedMul(known_count, (values + known_count - 1) / known_count);
    if (!total) return;
    count = *total;
  }
  if (!element_bytes) return;
  variable->size_bytes = CheckedMul(*element_bytes, count);
}

// Splits at the commas outside brackets, braces and parentheses.
std::vector<absl::string_view> SplitTopLevel(absl::string_view text) {
  std::vector<absl::string_view> parts;
  int64_t depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '[' || c == '{' || c == '(') ++depth;
    if (c == ']' || c == '}' || c == ')') --depth;
    if (c == ',' && depth <= 0) {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(text.substr(start));
  return parts;
}

std::string RemoveWhitespace(absl::string_view text) {
  std::string out;
  for (const char c : text) {
    if (!absl::ascii_isspace(static_cast<unsigned char>(c))) out.push_back(c);
  }
  return out;
}

// The next whitespace-separated token of `*text`, consumed.
absl::string_view NextToken(absl::string_view* text) {
  *text = absl::StripLeadingAsciiWhitespace(*text);
  size_t end = 0;
  while (end < text->size() && !absl::ascii_isspace(static_cast<unsigned char>((*text)[end]))) {
    ++end;
  }
  const absl::string_view token = text->substr(0, end);
  text->remove_prefix(end);
  return token;
}

// Appends the variables a `.global`/`.const` statement declares; ignores any other statement.
void ParseDeclaration(const Statement& statement, std::vector<PtxVariable>* variables) {
  // `.attribute(.managed)` (with or without spaces inside) becomes one `.attribute` token.
  std::string text;
  for (size_t i = 0; i < statement.text.size(); ++i) {
    text.push_back(statement.text[i]);
    if (absl::EndsWith(text, ".attribute")) {
      size_t j = i + 1;
      while (j < statement.text.size() &&
             absl::ascii_isspace(static_cast<unsigned char>(statement.text[j]))) {
        ++j;
      }
      if (j < statement.text.size() && statement.text[j] == '(') {
        const size_t close = statement.text.find(')', j);
        i = close == std::string::npos ? statement.text.size() : close;
        text.push_back(' ');
      }
    }
  }
  absl::string_view rest = text;
  PtxVariable base;
  base.in_function = statement.in_function;
  absl::string_view token = NextToken(&rest);
  while (IsLinkage(token)) {
    base.is_extern |= token == ".extern";
    token = NextToken(&rest);
  }
  if (token == ".global") {
    base.space = PtxVariable::Space::kGlobal;
  } else if (token == ".const") {
    base.space = PtxVariable::Space::kConst;
  } else {
    return;
  }
  uint64_t vector_width = 1;
  std::optional<uint64_t> scalar_size;
  bool readable = true;
  while (true) {
    absl::string_view lookahead = rest;
    token = NextToken(&lookahead);
    if (!absl::StartsWith(token, ".")) break;
    rest = lookahead;
    if (token == ".align") {
      const std::optional<uint64_t> align = ParseInteger(NextToken(&rest));
      if (align && *align <= kMaxGlobalSizeBytes) {
        base.align_bytes = *align;
      } else {
        readable = false;
      }
    } else if (token == ".attribute") {
      continue;
    } else if (token == ".v2" || token == ".v4" || token == ".v8") {
      vector_width = token[2] - '0';
    } else if (std::optional<uint64_t> size = ScalarSizeBytes(token)) {
      scalar_size = size;
    } else if (IsHandleType(token)) {
      base.is_handle = true;
      scalar_size = sizeof(uint64_t);
    } else {
      readable = false;  // a type this reader does not know
    }
  }
  std::optional<uint64_t> element_bytes;
  if (readable && scalar_size) element_bytes = *scalar_size * vector_width;
  for (absl::string_view part : SplitTopLevel(rest)) {
    absl::string_view declarator = part;
    absl::string_view initializer;
    if (const size_t equals = part.find('='); equals != absl::string_view::npos) {
      declarator = part.substr(0, equals);
      initializer = part.substr(equals + 1);
    }
    PtxVariable variable = base;
    ParseDeclarator(RemoveWhitespace(declarator), initializer, element_bytes, &variable);
    variables->push_back(std::move(variable));
  }
}

}  // namespace

bool LooksLikePtxText(absl::string_view image) {
  while (!image.empty() && image.back() == '\0') image.remove_suffix(1);
  return !image.empty() && image.find('\0') == absl::string_view::npos;
}

std::vector<PtxVariable> ParsePtxVariables(absl::string_view ptx) {
  ptx = ptx.substr(0, ptx.find('\0'));
  std::vector<PtxVariable> variables;
  for (const Statement& statement : SplitStatements(StripComments(ptx))) {
    ParseDeclaration(statement, &variables);
  }
  return variables;
}

std::vector<PtxGlobal> ParsePtxGlobals(absl::string_view ptx) {
  std::vector<PtxGlobal> globals;
  std::set<std::string> seen;
  for (PtxVariable& variable : ParsePtxVariables(ptx)) {
    if (variable.in_function || variable.is_handle || variable.unsized || variable.name.empty() ||
        !variable.size_bytes) {
      continue;
    }
    if (seen.insert(variable.name).second) {
      globals.push_back(PtxGlobal{std::move(variable.name), *variable.size_bytes});
    }
  }
  return globals;
}

}  // namespace gpurpc::backend
