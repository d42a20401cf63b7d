// Fuzzes the early checks the worker's compiler applies to a client's compile request
// (server/worker/compiler/compiler.h): the option check (ForbiddenOptionReason), the
// #include scan of sources and headers (CheckIncludeDirectives) and the header/program name
// check (CheckRequestName). They are the production functions, called as Compile calls them.
//
// The first input byte picks a mode; every mode asserts determinism and an invariant:
//   0  raw text for the include scan. Invariant: a line that is unmistakably an #include
//      of an absolute or ".." name (only plain code before it) is refused.
//   1  a source generated from the input out of code, comments, string, character and raw
//      string literals, digit separators, line continuations, trigraphs, digraphs and
//      directives, whose live (C++-visible) directives the generator knows. Invariant: a
//      source with a live #include / #include_next / #import / #embed / __has_include /
//      __has_embed of an absolute or ".." name, or a live computed #include, is refused.
//   2  NUL-separated options. Invariant: an accepted option makes neither NVRTC nor the
//      tools it hands options to (-Xcudafe: the EDG front end, -Xptxas: ptxas) read or
//      write a file; see FileAccess for what that covers and how it was measured.
//   3  a header or program name. Invariant: accepted names are relative, at most 256
//      characters, and have no "..", NUL or backslash.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/worker/compiler/compiler.h"
#include "tests/fuzz/fuzz_check.h"

namespace gpurpc::fuzz {
namespace {

using compiler::CheckIncludeDirectives;
using compiler::CheckRequestName;
using compiler::ForbiddenOptionReason;

bool BadIncludeName(absl::string_view name) {
  return absl::StartsWith(name, "/") || absl::StrContains(name, "..");
}

// Runs the include scan twice (it must be deterministic) and checks the refusal's form.
absl::Status ScanIncludes(absl::string_view text) {
  const absl::Status first = CheckIncludeDirectives("source", text);
  const absl::Status second = CheckIncludeDirectives("source", text);
  FUZZ_CHECK(first == second, "the include scan is not deterministic: ", first.ToString(), " then ",
             second.ToString(), " for ", Quote(text));
  if (!first.ok()) {
    FUZZ_CHECK(first.code() == absl::StatusCode::kInvalidArgument,
               "a refusal must be INVALID_ARGUMENT: ", first.ToString());
    FUZZ_CHECK(absl::StartsWith(first.message(), "source line "),
               "a refusal must name the text and the line: ", first.ToString());
  }
  return first;
}

// ------------------------------------------------------------------- mode 0: raw text

// Bytes that cannot open a comment, a literal, a line continuation or a trigraph: text made
// only of these leaves the preprocessor in plain code.
bool Plain(char c) {
  return c != '/' && c != '*' && c != '"' && c != '\'' && c != '\\' && c != '?' && c != '\0';
}

// The name of `line` when it is unmistakably `#include "name"` or `#include <name>` (blanks
// allowed where C allows them), else nullopt-like false.
bool ObviousInclude(absl::string_view line, std::string* name) {
  size_t i = 0;
  const auto blanks = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  };
  blanks();
  if (i >= line.size() || line[i] != '#') return false;
  ++i;
  blanks();
  if (line.substr(i, 7) != "include") return false;
  i += 7;
  if (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '"' && line[i] != '<') {
    return false;  // #include_next, #includex ...
  }
  blanks();
  if (i >= line.size() || (line[i] != '"' && line[i] != '<')) return false;
  const char close = line[i] == '"' ? '"' : '>';
  const size_t end = line.find(close, i + 1);
  if (end == absl::string_view::npos) return false;
  const absl::string_view quoted = line.substr(i + 1, end - i - 1);
  for (size_t k = 0; k < quoted.size(); ++k) {
    const char c = quoted[k];
    if (c == '\\' || c == '?' || c == '\'' || c == '"' || c == '\0') return false;
    if (c == '/' && k + 1 < quoted.size() && (quoted[k + 1] == '/' || quoted[k + 1] == '*')) {
      return false;  // undefined in a header name
    }
  }
  *name = std::string(quoted);
  return true;
}

void FuzzRawText(absl::string_view text) {
  const absl::Status status = ScanIncludes(text);
  if (!status.ok()) return;
  // Accepted: no unmistakable bad #include may follow plain text.
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == absl::string_view::npos) end = text.size();
    std::string name;
    if (ObviousInclude(text.substr(start, end - start), &name)) {
      FUZZ_CHECK(!BadIncludeName(name), "the include scan accepted #include of ", Quote(name),
                 " on a line after plain code: ", Quote(text));
    }
    for (size_t k = start; k < end; ++k) {
      if (!Plain(text[k])) return;  // later lines may be inside a comment or literal
    }
    start = end + 1;
  }
}

// ------------------------------------------------------- mode 1: generated C++ source

// Builds a source fragment by fragment. Every fragment begins and ends in plain C++ code (not
// inside a comment or literal), separated by a blank, so the generator knows which directives
// the C++ preprocessor sees.
class SourceGenerator {
 public:
  explicit SourceGenerator(FuzzedDataProvider& input) : input_(input) {}

  void Generate() {
    const int fragments = input_.ConsumeIntegralInRange(1, 24);
    for (int i = 0; i < fragments && input_.remaining_bytes() > 0; ++i) {
      text_ += ' ';
      switch (input_.ConsumeIntegralInRange(0, 10)) {
        case 0:
          Code();
          break;
        case 1:
          LineComment();
          break;
        case 2:
          BlockComment();
          break;
        case 3:
          StringLiteral();
          break;
        case 4:
          CharLiteral();
          break;
        case 5:
          RawString();
          break;
        case 6:
          Code();
          break;
        case 7:
          HasInclude();
          break;
        default:
          Directive();
          break;
      }
    }
  }

  const std::string& text() const { return text_; }
  // Why the source must be refused ("" when it may pass).
  const std::string& must_refuse() const { return must_refuse_; }

 private:
  void Refuse(absl::string_view why) {
    if (must_refuse_.empty()) must_refuse_ = std::string(why);
  }

  char Pick(absl::string_view alphabet) {
    return alphabet[input_.ConsumeIntegralInRange<size_t>(0, alphabet.size() - 1)];
  }

  // Up to `max` bytes of `alphabet`, with none of the `forbidden` sequences.
  std::string Text(absl::string_view alphabet, size_t max,
                   std::initializer_list<absl::string_view> forbidden = {}) {
    std::string out;
    const size_t n = input_.ConsumeIntegralInRange<size_t>(0, max);
    for (size_t i = 0; i < n && input_.remaining_bytes() > 0; ++i) {
      out += Pick(alphabet);
      for (absl::string_view bad : forbidden) {
        if (absl::EndsWith(out, bad)) out.pop_back();
      }
    }
    return out;
  }

  // Anything that may stand in a comment or literal: directive look-alikes included.
  static constexpr absl::string_view kLoose = "#%:<>\"'/*abz._- \tR()";

  void Code() {
    static constexpr const char* kCode[] = {"int x = 1;",
                                            "{",
                                            "}",
                                            "f(a, b);",
                                            "x / y;",
                                            "a * b;",
                                            "n = 1'000;",
                                            "n = 0x1'F;",
                                            "n = 1'0'0;",
                                            "c = 'a';",
                                            "c = '\\'';",
                                            "c = '\"';",
                                            "#",
                                            "%:",
                                            "<a.h>",
                                            "FOOR(x)",
                                            "u8 R",
                                            "_Pragma(\"once\")",
                                            "__has_include",
                                            "defined(__has_include)",
                                            "defined __has_include"};
    text_ += kCode[input_.ConsumeIntegralInRange<size_t>(0, std::size(kCode) - 1)];
  }

  void LineComment() { text_ += "//" + Text(kLoose, 40) + "\n"; }

  void BlockComment() {
    std::string body = Text("#%:<>\"'/*abz._- \tR()\n", 60, {"*/"});
    // "/*" + body + "*/": a body ending in '/' would not matter, one starting "/" neither.
    text_ += "/*" + body + "*/";
  }

  void StringLiteral() {
    std::string body;
    const int pieces = input_.ConsumeIntegralInRange(0, 8);
    for (int i = 0; i < pieces; ++i) {
      if (input_.ConsumeBool()) {
        body += Text("#%:<>'/*abz._- \tR()", 12);
      } else {
        static constexpr const char* kEscapes[] = {"\\\"", "\\\\", "\\n", "\\'"};
        body += kEscapes[input_.ConsumeIntegralInRange<size_t>(0, std::size(kEscapes) - 1)];
      }
    }
    static constexpr const char* kPrefixes[] = {"", "u8", "L", "u", "U"};
    text_ +=
        std::string(kPrefixes[input_.ConsumeIntegralInRange<size_t>(0, 4)]) + "\"" + body + "\"";
  }

  void CharLiteral() {
    static constexpr const char* kChars[] = {"'a'", "'\"'", "'\\''", "'/'", "'*'", "'#'", "'\\\\'"};
    text_ += kChars[input_.ConsumeIntegralInRange<size_t>(0, std::size(kChars) - 1)];
  }

  void RawString() {
    const std::string delimiter = Text("abcxyz", 16);
    const std::string end = ")" + delimiter + "\"";
    std::string body = Text("#%:<>\"'/*abz._- \tR()\\\n", 60);
    while (absl::StrContains(body, end)) body.erase(body.find(end), 1);
    // A body ending in ")delim" would close early with the '"' of the terminator... it is
    // the terminator itself, so that is fine; but ")delim" + ")delim\"" is not an issue.
    static constexpr const char* kPrefixes[] = {"R", "u8R", "LR", "uR", "UR"};
    text_ += std::string(kPrefixes[input_.ConsumeIntegralInRange<size_t>(0, 4)]) + "\"" +
             delimiter + "(" + body + end;
  }

  // A blank between directive tokens: nothing, blanks, a comment (maybe over lines), or a
  // line continuation.
  std::string Gap(bool allow_empty) {
    switch (input_.ConsumeIntegralInRange(allow_empty ? 0 : 1, 6)) {
      case 0:
        return "";
      case 1:
        return " ";
      case 2:
        return "\t";
      case 3:
        return " \f\v ";
      case 4:
        return "/* " + Text("abz #\"/<", 8, {"*/"}) + " */";
      case 5:
        return "/*\n*/";
      default:
        return " \\\n ";
    }
  }

  // A header name of `close`'s kind, with line continuations (which the preprocessor removes
  // before it reads the name) maybe inserted.
  std::string Name(char close, std::string* logical) {
    std::string name = Text("abz._-/", 16, {"//", "/*"});
    static constexpr const char* kStarts[] = {"",      "",   "/",   "../",  "a/../",
                                              "/etc/", "..", "./.", "a/..b"};
    name = std::string(kStarts[input_.ConsumeIntegralInRange<size_t>(0, std::size(kStarts) - 1)]) +
           name;
    while (absl::StrContains(name, "//") || absl::StrContains(name, "/*")) {
      name.erase(name.find('/'), 1);
    }
    if (close == '>') {
      while (name.find('>') != std::string::npos) name.erase(name.find('>'), 1);
    }
    *logical = name;
    std::string written;
    for (char c : name) {
      if (input_.ConsumeIntegralInRange(0, 15) == 0) written += "\\\n";
      written += c;
    }
    return written;
  }

  // The operand of an #include-like directive; sets `why` when C++ reads a bad name.
  std::string Operand(std::string* why) {
    switch (input_.ConsumeIntegralInRange(0, 4)) {
      case 0: {
        *why = "a computed name";
        return input_.ConsumeBool() ? "HEADER" : "HEADER(x)";
      }
      case 1:
      case 2: {
        std::string logical;
        const std::string written = Name('"', &logical);
        if (BadIncludeName(logical)) *why = absl::StrCat("\"", logical, "\"");
        return "\"" + written + "\"";
      }
      default: {
        std::string logical;
        const std::string written = Name('>', &logical);
        if (BadIncludeName(logical)) *why = absl::StrCat("<", logical, ">");
        return "<" + written + ">";
      }
    }
  }

  // A directive on a line of its own.
  void Directive() {
    static constexpr const char* kHashes[] = {"#", "%:", "?\?=", "%\\\n:"};
    static constexpr const char* kKeywords[] = {"include",     "include_next", "import", "embed",
                                                "incl\\\nude", "define",       "pragma"};
    const std::string keyword =
        kKeywords[input_.ConsumeIntegralInRange<size_t>(0, std::size(kKeywords) - 1)];
    std::string line = "\n" + Gap(true);
    line += kHashes[input_.ConsumeIntegralInRange<size_t>(0, std::size(kHashes) - 1)];
    line += Gap(true);
    line += keyword;
    std::string why;
    const std::string operand = Operand(&why);
    // `#include"x"` needs no blank; a macro name after the keyword does.
    line += Gap(operand.front() == '"' || operand.front() == '<');
    line += operand;
    line += Text(" abz", 4) + "\n";
    text_ += line;
    const bool include_like = keyword != "define" && keyword != "pragma";
    if (include_like && !why.empty()) {
      Refuse(absl::StrCat("#", keyword, " of ", why));
    }
  }

  // `#if ... __has_include(...)` (or __has_embed), maybe after other uses of the name.
  void HasInclude() {
    static constexpr const char* kBefore[] = {"",
                                              "defined(__has_include) && ",
                                              "defined __has_include && ",
                                              "__has_include(<a.h>) || ",
                                              "__has_include(\"a.h\") && ",
                                              "__has_embed(\"a.h\") && "};
    static constexpr const char* kNames[] = {"__has_include", "__has_include_next", "__has_embed"};
    std::string why;
    std::string line = "\n#if ";
    line += kBefore[input_.ConsumeIntegralInRange<size_t>(0, std::size(kBefore) - 1)];
    line += kNames[input_.ConsumeIntegralInRange<size_t>(0, std::size(kNames) - 1)];
    // One statement per choice: the order the input is read in must not be the compiler's.
    line += Gap(true);
    line += "(";
    line += Gap(true);
    line += Operand(&why);
    line += Gap(true);
    line += ")\n#endif\n";
    text_ += line;
    if (!why.empty()) Refuse(absl::StrCat("__has_include of ", why));
  }

  FuzzedDataProvider& input_;
  std::string text_;
  std::string must_refuse_;
};

void FuzzGeneratedSource(FuzzedDataProvider& input) {
  SourceGenerator generator(input);
  generator.Generate();
  const absl::Status status = ScanIncludes(generator.text());
  if (!generator.must_refuse().empty()) {
    FUZZ_CHECK(!status.ok(), "the include scan accepted a source with a live ",
               generator.must_refuse(), ":\n", generator.text(),
               "\n(escaped: ", Quote(generator.text(), 4000), ")");
  }
}

// ---------------------------------------------------------------------- mode 2: options

// What NVRTC (13.0) does with an element of the options array, measured: it skips leading
// blanks (" -I/dir" adds /dir to the include path); an option's name ends at '=' and must
// match exactly ("--include-path /dir" is unrecognized); -I takes its value joined
// ("-I/dir", "-I /dir", "-I=/dir"); a value may also be the next element ("-I", "/dir");
// -Xcudafe=V and -Xptxas=V hand V on to the EDG front end and to ptxas, and so does
// "-Xcudafe" followed by the element V.
//
// Names (without leading dashes) of options that make NVRTC read or write a file.
constexpr absl::string_view kNvrtcFileOptions[] = {
    "include-path", "include", "pre-include",       "pch", "create-pch", "use-pch",
    "pch-dir",      "time",    "fdevice-time-trace"};
// ... of ptxas (-Xptxas, --ptxas-options): --options-file=F reads F (measured) ...
constexpr absl::string_view kPtxasFileOptions[] = {"options-file", "optf"};
// ... and of the EDG front end (-Xcudafe): --preinclude=F and --sys_include=D read F and D
// relative to the working directory and --error_output=F creates F (measured);
// --include_directory is its -I.
constexpr absl::string_view kFrontEndFileOptions[] = {
    "include_directory", "sys_include", "preinclude", "error_output",
    "create_pch",        "use_pch",     "pch_dir"};

// Who reads an option: NVRTC, or a tool NVRTC hands it on to (another -X tool: any file option
// of the two known ones counts).
enum class Reader { kNvrtc, kPtxas, kFrontEnd, kOtherTool };

bool IsBlank(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

absl::string_view SkipBlanks(absl::string_view option) {
  while (!option.empty() && IsBlank(option.front())) option.remove_prefix(1);
  return option;
}

constexpr absl::string_view kNameCharacters =
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_";

// The tool that the option `name` (before any '=') hands values on to, or kNvrtc for none
// (also for a name NVRTC does not recognize).
Reader ToolOf(absl::string_view name) {
  if (name.find_first_not_of(kNameCharacters) != absl::string_view::npos) return Reader::kNvrtc;
  if (name == "-Xptxas" || name == "--ptxas-options" || name == "-ptxas-options") {
    return Reader::kPtxas;
  }
  if (name == "-Xcudafe") return Reader::kFrontEnd;
  if (absl::StartsWith(name, "-X")) return Reader::kOtherTool;
  return Reader::kNvrtc;
}

bool Listed(absl::string_view bare, absl::Span<const absl::string_view> names) {
  for (absl::string_view name : names) {
    if (bare == name) return true;
  }
  return false;
}

// Why `option` would make `reader` touch a file, or "" when it would not.
std::string FileAccess(absl::string_view option, Reader reader) {
  option = SkipBlanks(option);
  if (absl::StartsWith(option, "-I")) return "an include path";
  const size_t equals = option.find('=');
  const absl::string_view name = option.substr(0, equals);
  // Names take one or two dashes ("---include-path" is unrecognized).
  absl::string_view bare = name;
  if (!absl::ConsumePrefix(&bare, "--")) absl::ConsumePrefix(&bare, "-");
  if (absl::StartsWith(name, "-")) {
    if (Listed(bare, kNvrtcFileOptions)) return absl::StrCat("the file option ", name);
    const bool ptxas = reader == Reader::kPtxas || reader == Reader::kOtherTool;
    const bool front_end = reader == Reader::kFrontEnd || reader == Reader::kOtherTool;
    if ((ptxas && Listed(bare, kPtxasFileOptions)) ||
        (front_end && Listed(bare, kFrontEndFileOptions))) {
      return absl::StrCat("the tool's file option ", name);
    }
    // A name with other characters is no option of NVRTC's or a tool's: unrecognized.
    if (name.find_first_not_of(kNameCharacters) != absl::string_view::npos) return "";
  }
  const absl::string_view value =
      !absl::StartsWith(option, "-")
          ? option
          : (equals == absl::string_view::npos ? absl::string_view() : option.substr(equals + 1));
  if (absl::StartsWith(value, "/")) return "an absolute path";
  if (absl::StrContains(value, "..")) return "a \"..\" path";
  if (const Reader tool = ToolOf(name); tool != Reader::kNvrtc) {
    for (absl::string_view part : absl::StrSplit(value, ',')) {
      if (std::string why = FileAccess(part, tool); !why.empty()) {
        return absl::StrCat("through ", name, ": ", why);
      }
    }
  }
  return "";
}

// The tool that the element after `option` goes to ("-Xcudafe", "V"), or kNvrtc.
Reader NextElementReader(absl::string_view option) {
  option = SkipBlanks(option);
  if (option.find('=') != absl::string_view::npos) return Reader::kNvrtc;
  return ToolOf(option);
}

// The options of one request: Compile refuses the request at its first forbidden option, so
// the invariant holds for requests whose every option passed.
void FuzzOptions(absl::string_view rest) {
  Reader reader = Reader::kNvrtc;
  for (absl::string_view option : absl::StrSplit(rest, '\0')) {
    if (option.empty()) return;  // Compile refuses empty options before this check
    const std::string reason = ForbiddenOptionReason(option);
    FUZZ_CHECK(reason == ForbiddenOptionReason(option), "the option check is not deterministic");
    if (!reason.empty()) return;
    const std::string access = FileAccess(option, reader);
    FUZZ_CHECK(access.empty(), "the option check accepted ", Quote(option),
               reader != Reader::kNvrtc ? " (handed on to a tool by the option before it)" : "",
               ", which makes NVRTC touch a file: ", access);
    reader = NextElementReader(option);
  }
}

// ------------------------------------------------------------------------ mode 3: names

void FuzzName(absl::string_view name) {
  const absl::Status status = CheckRequestName("header name", name);
  FUZZ_CHECK(status == CheckRequestName("header name", name),
             "the name check is not deterministic");
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument, status.ToString());
    return;
  }
  FUZZ_CHECK(!name.empty() && name.size() <= 256 && name.front() != '/' &&
                 !absl::StrContains(name, "..") && name.find('\0') == absl::string_view::npos &&
                 name.find('\\') == absl::string_view::npos,
             "the name check accepted ", Quote(name));
}

}  // namespace
}  // namespace gpurpc::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      gpurpc::fuzz::FuzzRawText(rest);
      break;
    case 1: {
      FuzzedDataProvider input(data + 1, size - 1);
      gpurpc::fuzz::FuzzGeneratedSource(input);
      break;
    }
    case 2:
      gpurpc::fuzz::FuzzOptions(rest);
      break;
    default:
      gpurpc::fuzz::FuzzName(rest);
      break;
  }
  return 0;
}
